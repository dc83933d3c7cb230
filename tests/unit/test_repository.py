"""The repository stays lean: raw benchmark output and other large files live outside git."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_DOCS_FILE_BYTES = 1_000_000
# the code and its tests grow with the features (~2.9 MB of text when this was set, 4.0 MB on 2026-12-06); what must
# never come back is raw output: a bench dump or a capture is a large file or a binary one, which the two limits
# below catch
MAX_TRACKED_BYTES = 5_000_000
MAX_FILE_BYTES = 250_000
MAX_BINARY_BYTES = 400_000  # images (the docs' two PNGs, ~97 kB), nothing else


def tracked_sizes() -> dict[str, int]:
    """Bytes of every file git tracks in this checkout (those deleted in the work tree count as 0)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    names = [n for n in out.decode().split("\0") if n]
    return {n: os.path.getsize(ROOT / n) if (ROOT / n).is_file() else 0 for n in names}


def test_no_tracked_file_under_docs_is_over_1_mb() -> None:
    big = {n: s for n, s in tracked_sizes().items() if n.startswith("docs/") and s > MAX_DOCS_FILE_BYTES}
    assert not big, f"tracked files under docs/ over {MAX_DOCS_FILE_BYTES:,} bytes (keep raw output out of git): {big}"


def test_tracked_bytes_stay_under_5_mb() -> None:
    sizes = tracked_sizes()
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total <= MAX_TRACKED_BYTES, f"the repository tracks {total:,} bytes; largest: {largest}"
    big = {n: s for n, s in sizes.items() if s > MAX_FILE_BYTES}
    assert not big, f"tracked files over {MAX_FILE_BYTES:,} bytes (keep raw output out of git): {big}"


def test_binary_files_stay_small() -> None:
    """Files git sees as binary (images, captures, archives) together stay under MAX_BINARY_BYTES."""
    sizes = tracked_sizes()  # skips outside a git checkout
    out = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "--eol", "-z"], capture_output=True, check=True
    ).stdout.decode()
    binary = [e.split("\t", 1)[1] for e in out.split("\0") if e and e.startswith("i/-text")]
    total = sum(sizes.get(n, 0) for n in binary)
    assert total <= MAX_BINARY_BYTES, f"binary files take {total:,} bytes: {sorted(binary)}"
