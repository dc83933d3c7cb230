"""Where a process's host time goes, from py-spy's collapsed stacks (`py-spy record -f raw`).

Usage::

    py-spy record --pid PID -d 10 -r 200 -f raw -o engine.txt --nonblocking
    python bench/stack_summary.py engine.txt --wall 2000 [--top 25]

Prints the functions that take the most samples by their own time (the innermost frame) and inclusive
(anywhere on the stack, counted once per sample). py-spy leaves out the samples of idle threads (waiting in
select/epoll, a lock or a sleep) unless it is run with --idle, so the samples are the time the threads
computed; with --wall (rate x duration: the samples one always-busy thread would give) the shares are of
the wall time, else of the samples taken.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from collections.abc import Iterable, Sequence

LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")


def parse(lines: Iterable[str]) -> list[tuple[list[str], int]]:
    """Collapsed stacks ("outer;...;inner count") -> [(frames outer to inner, samples)]."""
    out = []
    for line in lines:
        m = LINE.match(line.rstrip("\n"))
        if m and m["stack"]:
            out.append((m["stack"].split(";"), int(m["count"])))
    return out


def frame_name(frame: str) -> str:
    """py-spy's `function (file.py:line)` -> `function (file.py)`: one entry per function, not per line."""
    return re.sub(r":\d+\)$", ")", frame.strip())


def summarize(stacks: Sequence[tuple[list[str], int]], top: int = 25, wall: int | None = None) -> str:
    taken = sum(n for _, n in stacks)
    if not taken:
        return "no samples"
    total = wall or taken
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    for frames, n in stacks:
        names = [frame_name(f) for f in frames]
        own[names[-1]] += n
        for name in set(names):
            incl[name] += n
    of = "of the wall time" if wall else "of the samples"
    lines = [
        f"{taken} samples" + (f" ({taken / wall:.1%} of {wall}: one thread always busy)" if wall else ""),
        f"own time (innermost frame), share {of}, top {top}:",
    ]
    lines += [f"  {n / total:6.1%}  {name}" for name, n in own.most_common(top)]
    lines.append(f"inclusive (anywhere on the stack), share {of}, top {top}:")
    lines += [f"  {n / total:6.1%}  {name}" for name, n in incl.most_common(top)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="py-spy's raw output (collapsed stacks)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--wall", type=int, help="rate x duration of the recording: shares of the wall time")
    a = p.parse_args(argv)
    with open(a.path) as f:
        print(summarize(parse(f), a.top, a.wall))


if __name__ == "__main__":
    main()
