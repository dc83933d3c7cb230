"""The gateway runs without torch: it imports only the torch-free contract (engine/contract) and the
torch-free helpers it shares with the engine (config, prompt, text normalization, clip decoding); the
engine's nodes are imported in the spawned engine process alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent("""
    import importlib, importlib.abc, pkgutil, sys

    BLOCKED = ("torch", "torchaudio", "triton", "dac", "audiotools")

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"the gateway imported {name}")
            return None

    sys.meta_path.insert(0, NoTorch())
    import app
    for mod in pkgutil.walk_packages(app.__path__, "app."):
        importlib.import_module(mod.name)
    # the process boundary: the gateway reaches into engine/ only through the contract and the front end
    beyond = sorted(m for m in sys.modules if m.startswith("engine.")
                    and not m.startswith(("engine.contract", "engine.frontend")))
    assert not beyond, f"the gateway imported {beyond}"
    for name in ("engine.contract.records", "engine.contract.rings", "engine.contract.lifeline",
                 "engine.contract.settings", "engine.contract.constants", "engine.contract.process"):
        importlib.import_module(name)
    from app.__main__ import parse_args
    from app.server import create_app
    create_app(parse_args(["--port", "8123"]))
    from engine.frontend.prompt import PromptBuilder
    from engine.frontend.config import Zonos2Config, preset_params
    PromptBuilder(Zonos2Config.from_dict(preset_params("tiny"))).build("Hello there.")
    print("imported", sorted(m for m in sys.modules if m.startswith(("app", "engine")))[-1], "without torch")
""")


def test_gateway_imports_and_builds_its_app_without_torch():
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "without torch" in r.stdout


def test_the_probe_does_block_torch():
    """The blocker itself works: an engine node imported the same way fails."""
    probe = PROBE.split("import app\n")[0] + "import engine.llm.node\n"
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "the gateway imported torch" in r.stderr


def test_model_constants_are_written_in_one_module():
    """N_CODEBOOKS, CODEBOOK_SIZE, EOA_ID and PAD_ID are engine/contract/constants.py's; a default or a
    preset elsewhere takes them from there, so no other module writes their values."""
    import re

    root = ROOT
    owner = root / "engine" / "contract" / "constants.py"
    written = re.compile(
        r"""["']?\b(n_codebooks|codebook_size|eoa_id|audio_pad_id|pad_id)\b["']?\s*(:\s*int\s*)?[=:]\s*\d""",
        re.IGNORECASE,
    )
    found = [
        f"{p.relative_to(root)}:{n}: {line.strip()}"
        for p in sorted((root / "engine").rglob("*.py")) + sorted((root / "app").rglob("*.py"))
        if p != owner
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if written.search(line.split("#")[0])
    ]
    assert not found, found


# docs/architecture.md: "Imports run one way: doors → core → voices, io → settings and engine/contract, engine/frontend.
# One exception: voices/lexicons.py imports core/tag_vocabulary.py, a leaf module." Each folder of app/ and what it
# may import of app/ (the top-level modules, server.py, workers.py, __main__.py, import anything).
LAYERS = {
    "doors": {"doors", "core", "voices", "io", "settings"},
    "core": {"core", "voices", "io", "settings"},
    "voices": {"voices", "io", "settings"},
    "io": {"io", "settings"},
}
IMPORT_EXCEPTIONS = {("voices/lexicons.py", "app.core.tag_vocabulary")}  # (the module imported: no other of core)


def test_the_gateway_s_folders_import_one_way():
    import ast

    wrong = []
    for folder, allowed in LAYERS.items():
        for path in sorted((ROOT / "app" / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT / "app"))
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom) and node.level == 0
                    else []
                )
                for name in names:
                    parts = name.split(".")
                    if parts[0] != "app" or len(parts) == 1 or parts[1] in allowed:
                        continue
                    if (rel, name) not in IMPORT_EXCEPTIONS:
                        wrong.append(f"app/{rel}:{node.lineno} imports {name}")
    assert not wrong, "docs/architecture.md's one way:\n" + "\n".join(wrong)


def _imports(path: Path, modules: set[str]) -> list[tuple[str, int]]:
    """The modules of `modules` that `path`'s code imports when it runs, with the line: at module level and inside
    functions alike (an import moved into a function to dodge a circle still closes it, one call later), not those
    under `if TYPE_CHECKING:` (annotations only: never imported)."""
    import ast

    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((a.name, node.lineno) for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
            found.extend((name, node.lineno) for name in subs or [node.module] if name in modules)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def import_cycles(root: Path, package: str) -> list[str]:
    """Each circle of imports among `package`'s modules (under `root`) that a depth-first walk meets, written as
    `a:LINE -> b:LINE -> a`, where LINE is the import's line in the module before it."""
    files = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges = {m: _imports(p, set(files) - {m}) for m, p in files.items()}
    cycles: list[str] = []
    state: dict[str, int] = {}  # 1: on the walk's path, 2: done
    path: list[tuple[str, int]] = []

    def walk(module: str) -> None:
        state[module] = 1
        for target, line in edges[module]:
            path.append((module, line))
            if state.get(target) == 1:
                start = next(i for i, (m, _) in enumerate(path) if m == target)
                cycles.append(" -> ".join(f"{m}:{n}" for m, n in path[start:]) + f" -> {target}")
            elif target not in state:
                walk(target)
            path.pop()
        state[module] = 2

    for module in files:
        if module not in state:
            walk(module)
    return cycles


def test_the_gateway_s_modules_import_no_circle():
    """No module of app/ imports, directly or through others, a module that imports it: each can be read,
    changed and imported on its own. A fact two sides of a circle need goes into a leaf module both import
    (app/core/tag_vocabulary.py), never into an import inside a function, which this counts too."""
    cycles = import_cycles(ROOT, "app")
    assert not cycles, "import circles in app/ (module:line of each import):\n" + "\n".join(cycles)


def test_the_circle_check_finds_a_circle_closed_inside_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "sub" / "__init__.py"):
        init.write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("import os\n\n\ndef f():\n    from pkg.c import x\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg import e\n")
    (pkg / "e.py").write_text("from pkg.d import y\n")
    assert import_cycles(tmp_path, "pkg") == ["pkg.a:1 -> pkg.sub.b:5 -> pkg.c:1 -> pkg.a"]
