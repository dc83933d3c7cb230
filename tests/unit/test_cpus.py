"""--engine-cpus (engine/contract/cpus.py): its CPU lists, read as taskset reads them, refused with the flag's name
when they are not one or not this process's to give; pinning moves every thread of a process. The server started
with it: tests/system/test_workers.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from engine.contract.cpus import current_cpus, format_cpu_list, parse_cpu_list, split_cpus
from engine.contract.settings import EngineSettings

CPUS = sorted(current_cpus() or ())
needs_two_cpus = pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(CPUS) < 2,
    reason="--engine-cpus needs Linux and two CPUs in this process's affinity (one for the engine, one left)",
)


@pytest.mark.parametrize(
    "text, cpus",
    [
        ("3", {3}),
        ("0-1", {0, 1}),
        ("2,5-6", {2, 5, 6}),
        (" 4 , 6-7 ", {4, 6, 7}),
        ("5-5", {5}),
        ("1,1,0-1", {0, 1}),
        ("007", {7}),
    ],
)
def test_cpu_lists_read_as_taskset_reads_them(text, cpus):
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


def test_cpu_lists_are_written_with_ranges():
    assert format_cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert format_cpu_list({3}) == "3"
    assert format_cpu_list(set()) == ""


@pytest.mark.parametrize(
    "text", ["", " ", "a", "3-1", "-1", "1-", "1,,2", "1,", "1-2-3", "0x3", "1.5", "\u0663", "0-70000", "99999999"]
)
def test_what_is_no_cpu_list_is_refused_naming_the_flag(text):
    with pytest.raises(ValueError, match=r"^--engine-cpus"):
        parse_cpu_list(text)
    with pytest.raises(ValueError, match=r"^--engine-cpus"):  # settings built in code are checked the same way
        EngineSettings(cpus=text)


def test_unset_is_no_pinning():
    assert EngineSettings().cpus is None and EngineSettings().cpu_set is None
    assert EngineSettings(cpus="2,5-6").cpu_set == {2, 5, 6}


@needs_two_cpus
def test_the_engines_take_cpus_of_this_process_and_leave_the_gateways_one():
    engine, rest = split_cpus(str(CPUS[-1]))
    assert engine == {CPUS[-1]} and rest == set(CPUS[:-1])
    with pytest.raises(ValueError, match=r"^--engine-cpus .*leaves no CPU for the gateway processes"):
        split_cpus(format_cpu_list(CPUS))
    outside = CPUS[-1] + 1  # not in this process's affinity (whether or not the host has it)
    with pytest.raises(ValueError, match=rf"^--engine-cpus {outside}: CPU {outside} is not one this process may"):
        split_cpus(str(outside))


@pytest.mark.parametrize(
    "value, needle",
    [
        ("x", "--engine-cpus must be a CPU list such as 3, 0-1 or 2,5-6, got 'x'"),
        ("70000", "--engine-cpus: '70000' is not a range of CPUs"),
        ("3-1", "--engine-cpus: '3-1' is not a range of CPUs"),
    ],
)
def test_a_bad_flag_is_a_usage_error_naming_it(capsys, value, needle):
    from app.__main__ import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--engine-cpus", value])
    assert e.value.code == 2 and needle in capsys.readouterr().err


@needs_two_cpus
def test_cpus_the_process_may_not_give_are_a_usage_error(capsys):
    from app.__main__ import parse_args

    for value, needle in (
        (format_cpu_list(CPUS), "leaves no CPU for the gateway processes"),
        (str(CPUS[-1] + 1), f"CPU {CPUS[-1] + 1} is not one this process may run on"),
    ):
        with pytest.raises(SystemExit) as e:
            parse_args(["--engine-cpus", value])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"--engine-cpus {value}" in err and needle in err, err
    assert parse_args(["--engine-cpus", str(CPUS[0])]).engine.cpu_set == {CPUS[0]}


_PIN_WITH_A_THREAD_RUNNING = """
import json, os, sys, threading
from engine.contract.cpus import pin

started, stop = threading.Event(), threading.Event()
before = threading.Thread(target=lambda: (started.set(), stop.wait()))
before.start()
started.wait()
pin({int(sys.argv[1])})
after = threading.Thread(target=stop.wait)
after.start()
tasks = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
stop.set()
print(json.dumps(tasks))
"""


@needs_two_cpus
def test_pinning_moves_every_thread_of_the_process_and_those_it_starts_later():
    """Linux sets one thread's affinity at a time: a thread already running when the process pins itself is
    moved too, and a thread started after inherits it."""
    cpu = CPUS[-1]
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_PIN_WITH_A_THREAD_RUNNING), str(cpu)],
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    tasks = json.loads(out.stdout)
    assert len(tasks) == 3 and all(cpus == [cpu] for cpus in tasks.values()), tasks
