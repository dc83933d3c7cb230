"""How the gateway starts an engine process without importing the engine: the spawn target resolves the
entry point by name in the child (the contract imports nothing above it)."""

from __future__ import annotations

import importlib
from typing import Any

ENGINE_ENTRY = "engine.runtime.entry:engine_main"


def run_engine(*args: Any) -> None:
    """multiprocessing's spawn target: import the engine's entry point here, in the engine process."""
    module, _, name = ENGINE_ENTRY.partition(":")
    getattr(importlib.import_module(module), name)(*args)
