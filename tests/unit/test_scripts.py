"""scripts/setup on a fresh machine: what it does when the machine's Python cannot make a virtualenv."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A python3 as Debian's is without python3-venv: `-m venv` writes .venv/bin/python, then fails (ensurepip missing)
NO_ENSUREPIP = """#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  mkdir -p "$3/bin" && printf '#!/bin/sh\\nexit 1\\n' > "$3/bin/python" && chmod +x "$3/bin/python"
  echo "The virtual environment was not created successfully because ensurepip is not available." >&2
  exit 1
fi
exec python3 "$@"
"""


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("python3") is None, reason="needs bash and python3")
def test_setup_without_venv_support_says_what_to_install_and_leaves_no_half_made_venv(tmp_path: Path) -> None:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup", tmp_path / "scripts" / "setup")
    for name in ("requirements.txt", "requirements-textnorm.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    python = tmp_path / "python3-without-venv"
    python.write_text(NO_ENSUREPIP)
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python)}
    for _ in range(2):  # and the run after it fails the same way, not on a .venv it takes for made
        run = subprocess.run(
            ["bash", "scripts/setup"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 1, run.stderr
        assert "apt-get install python3-venv" in run.stderr
        assert not (tmp_path / ".venv").exists()


def test_setup_for_the_browser_tests_without_apt_get_goes_on_without_chromium(tmp_path: Path) -> None:
    """`scripts/test` runs `scripts/setup --browser`: on a machine that is not Debian (no apt-get) it stopped there,
    so the suite could not run at all; the browser tests skip without chromium."""
    (tmp_path / "scripts").mkdir()
    # this machine may have chromium: the copy looks for it where there is none
    script = (ROOT / "scripts" / "setup").read_text().replace("/usr/bin/chromium", str(tmp_path / "no-chromium"))
    (tmp_path / "scripts" / "setup").write_text(script)
    requirements = b""
    for name in ("requirements.txt", "requirements-textnorm.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
        requirements += (ROOT / name).read_bytes()
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("#!/bin/sh\nexit 0\n")
    (venv / "python").chmod(0o755)
    (tmp_path / ".venv" / f".requirements-{hashlib.sha256(requirements).hexdigest()[:16]}").touch()  # installed
    tools = tmp_path / "bin"  # a PATH with what the script uses, and no apt-get
    tools.mkdir()
    for tool in ("bash", "cat", "sha256sum", "cut", "dirname", "rm", "touch", "id"):
        found = shutil.which(tool)
        if found is None:
            pytest.skip(f"needs {tool}")
        (tools / tool).symlink_to(found)
    run = subprocess.run(
        ["bash", "scripts/setup", "--browser"],
        cwd=tmp_path,
        env={"PATH": str(tools), "HOME": str(tmp_path), "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "browser tests will be skipped" in run.stderr
