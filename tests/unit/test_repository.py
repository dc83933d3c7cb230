"""The repository stays lean: raw benchmark output and other large files live outside git."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_DOCS_FILE_BYTES = 1_000_000
MAX_TRACKED_BYTES = 3_000_000


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


def test_tracked_bytes_stay_under_3_mb() -> None:
    sizes = tracked_sizes()
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total <= MAX_TRACKED_BYTES, f"the repository tracks {total:,} bytes; largest: {largest}"
