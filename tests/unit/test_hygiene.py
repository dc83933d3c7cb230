"""The test suite itself: a test changes no process-wide state that outlives it, so the GPU list passes in
any order (a CPU helper once set TRITON_INTERPRET for the whole process, and every Triton kernel after it ran
in the interpreter on CUDA tensors)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# environment writes outside monkeypatch: os.environ[...] = , .setdefault, .update, .pop, putenv
ENV_WRITE = re.compile(r"os\.environ\[[^\]]+\]\s*=(?!=)|os\.environ\.(setdefault|update|pop)\(|os\.putenv\(")


def test_only_the_triton_helper_writes_the_environment():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.name in ("conftest.py", "test_hygiene.py"):
            continue  # triton_on_cpu: sets nothing on a machine with CUDA
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("#"):
                continue
            if ENV_WRITE.search(line) and "TRITON_INTERPRET" in line and "torch.cuda.is_available" not in line:
                # allowed only right under a CUDA guard on the line before
                prev = path.read_text().splitlines()[n - 2]
                if "torch.cuda.is_available()" not in prev:
                    offenders.append(f"{path.relative_to(TESTS)}:{n}: {line.strip()}")
            elif ENV_WRITE.search(line) and "TRITON_INTERPRET" not in line:
                offenders.append(f"{path.relative_to(TESTS)}:{n}: {line.strip()}")
    assert not offenders, (
        "scope environment changes with monkeypatch (or tests/conftest.py triton_on_cpu):\n" + "\n".join(offenders)
    )


def test_triton_on_cpu_sets_nothing_where_cuda_is(monkeypatch):
    import torch

    from tests.conftest import triton_on_cpu

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    triton_on_cpu()
    assert "TRITON_INTERPRET" not in os.environ
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    triton_on_cpu()
    assert os.environ["TRITON_INTERPRET"] == "1"


LEAKS = """
import sys

import torch


def test_leaves_the_default_dtype_changed():
    torch.set_default_dtype(torch.float64)


def test_leaves_the_switch_interval_changed():  # as an Engine built in the test's own process does
    sys.setswitchinterval(2e-4)


def test_restores_it(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", not torch.backends.cudnn.deterministic)
"""


def test_a_test_that_leaves_a_process_wide_setting_changed_fails(tmp_path):
    """conftest's autouse check, loaded as a plugin into a pytest run of three tests: those that leave torch's
    default dtype or the interpreter's switch interval changed error in their teardown, naming the setting;
    the one whose change monkeypatch undoes passes."""
    (tmp_path / "test_leaks.py").write_text(LEAKS)
    root = TESTS.parent
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.conftest",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_leaks.py"),
        ],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "3 passed, 2 errors" in out, out  # the leaking tests ran, and their teardowns failed
    assert "ERROR at teardown of test_leaves_the_default_dtype_changed" in out and "default dtype" in out, out
    assert "ERROR at teardown of test_leaves_the_switch_interval_changed" in out and "switch interval" in out, out


BLAS_THREADS = """
import ctypes

import numpy
import torch

torch.ones(64).sum()
numpy.ones((64, 64)) @ numpy.ones((64, 64))
libs = [ctypes.CDLL(p) for p in {line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line}]
print("openblas threads", [f() for lib in libs if (f := getattr(lib, "scipy_openblas_get_num_threads64_", None))])
"""


def test_the_suite_s_math_library_threads_never_spin():
    """torch and numpy loaded after tests/conftest.py: torch's OpenMP runtime has idle threads that sleep at
    once (a spin count of 0) and numpy's OpenBLAS one thread (its idle threads spin too). Both libraries read
    their settings when they are loaded, so conftest must set them first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "OPENBLAS_"))}
    proc = subprocess.run(
        [sys.executable, "-c", "import tests.conftest\n" + BLAS_THREADS],
        cwd=TESTS.parent,
        env=env | {"PYTHONPATH": str(TESTS.parent), "OMP_DISPLAY_ENV": "VERBOSE"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GOMP_SPINCOUNT = '0'" in proc.stderr, proc.stderr[-3000:]
    assert "openblas threads [1]" in proc.stdout, proc.stdout  # numpy's OpenBLAS (scipy-openblas)


def test_every_port_a_test_binds_is_of_its_range(monkeypatch):
    """ZONOS_TEST_PORTS=LO-HI keeps the suite's servers and listeners on the ports it was given (a machine shared
    with other work); a binding of port 0 elsewhere in the suite would escape it."""
    from tests.conftest import free_port, loopback_socket

    with loopback_socket() as probe:  # a port free now (of the suite's own range, if it has one)
        port = probe.getsockname()[1]
    monkeypatch.setenv("ZONOS_TEST_PORTS", f"{port}-{port}")
    with loopback_socket() as a:
        assert a.getsockname()[1] == port
        try:
            loopback_socket()
        except RuntimeError as e:
            assert "ZONOS_TEST_PORTS" in str(e)
        else:
            raise AssertionError("a second socket was bound in a range of one port")
    assert free_port() == port
    offenders = [
        f"{path.relative_to(TESTS)}:{n}"
        for path in sorted(TESTS.rglob("*.py"))
        if path.name not in ("conftest.py", "test_hygiene.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"""["']127\.0\.0\.1["'],\s*0\)""", line)
    ]
    assert not offenders, "bind through tests/conftest.py loopback_socket / free_port:\n" + "\n".join(offenders)


def test_httpx_clients_share_one_default_ssl_context():
    """tests/conftest.py: every httpx client of the suite (each httpx.get/post makes one) shares one default SSL
    context, where each loaded the whole CA bundle anew (~25 ms of CPU, thousands of times a run); a client that
    asks for another verification still gets its own."""
    import ssl

    import httpx

    def context(client: httpx.Client | httpx.AsyncClient) -> ssl.SSLContext:
        return client._transport._pool._ssl_context  # type: ignore[attr-defined]

    with httpx.Client() as a, httpx.Client(timeout=3) as b:
        assert context(a) is context(b)
        assert context(httpx.AsyncClient()) is context(a)
        with httpx.Client(verify=False) as unverified:
            assert context(unverified) is not context(a) and context(unverified).verify_mode == ssl.CERT_NONE
