"""The test suite itself: a test changes no process-wide state that outlives it, so the GPU list passes in
any order (a CPU helper once set TRITON_INTERPRET for the whole process, and every Triton kernel after it ran
in the interpreter on CUDA tensors)."""

from __future__ import annotations

import re
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
    assert not offenders, "scope environment changes with monkeypatch (or tests/conftest.py triton_on_cpu):\n" + \
        "\n".join(offenders)


def test_triton_on_cpu_sets_nothing_where_cuda_is(monkeypatch):
    import os

    import torch

    from tests.conftest import triton_on_cpu

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    triton_on_cpu()
    assert "TRITON_INTERPRET" not in os.environ
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    triton_on_cpu()
    assert os.environ["TRITON_INTERPRET"] == "1"
