"""Command-line flags generated from settings dataclasses: a field's metadata (`flag(...)`) holds its help,
bounds and choices, so a setting and its flag are one declaration and its bounds are checked in one place
(`check`, which both a parsed command line and settings built in code go through)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Bound = float | Callable[[], float]  # a callable: a bound known only on the machine (e.g. its CPU count)


@dataclass(frozen=True)
class Flag:
    help: str
    lo: Bound | None = None
    hi: Bound | None = None
    lo_open: bool = False  # the value must be above lo, not equal to it
    choices: tuple[str, ...] | None = None
    name: str | None = None  # the flag's name when it is not the field's (max_wait_s -> --max-wait)
    aliases: tuple[str, ...] = ()
    metavar: str | None = None


def flag(
    help: str,
    *,
    lo: Bound | None = None,
    hi: Bound | None = None,
    lo_open: bool = False,
    choices: tuple[str, ...] | None = None,
    name: str | None = None,
    aliases: tuple[str, ...] = (),
    metavar: str | None = None,
) -> dict[str, Flag]:
    """Field metadata making the field a flag: `field(default=..., metadata=flag("help", lo=1, hi=64))`."""
    return {"flag": Flag(help, lo, hi, lo_open, choices, name, aliases, metavar)}


def flag_of(f: dataclasses.Field) -> Flag | None:
    return f.metadata.get("flag")


def option(f: dataclasses.Field) -> str:
    """The flag's name: `--` and the field's name with dashes, unless the metadata names it."""
    meta = flag_of(f)
    return "--" + ((meta.name if meta else None) or f.name.replace("_", "-"))


def _value(b: Bound) -> float:
    return b() if callable(b) else b


def _fmt(v: float) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def range_text(meta: Flag, integer: bool) -> str:
    """The allowed range as the error and the help say it: 1..4096 (an integer), (0, 3600], >= 0."""
    lo = None if meta.lo is None else _value(meta.lo)
    hi = None if meta.hi is None else _value(meta.hi)
    if lo is not None and hi is not None:
        if integer:
            return f"{int(lo) + meta.lo_open}..{int(hi)}"
        return f"{'(' if meta.lo_open else '['}{_fmt(lo)}, {_fmt(hi)}]"
    if lo is not None:
        return f"{'>' if meta.lo_open else '>='} {_fmt(lo)}"
    return f"<= {_fmt(hi)}" if hi is not None else "any value"


def _base_type(hint: Any) -> tuple[type, bool]:
    """(the value's type, whether None is allowed) of a field's type hint; a tuple[str, ...] gives tuple."""
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0]
    return (typing.get_origin(hint) or hint), optional


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A settings class's field types, resolved once."""
    return typing.get_type_hints(cls)


def check(obj: Any) -> None:
    """ValueError naming the flag and its range for the first flag field of `obj` outside its bounds or
    choices (None passes where the field allows it)."""
    hints = _hints(obj.__class__)
    for f in dataclasses.fields(obj):
        meta = flag_of(f)
        if meta is None:
            continue
        value = getattr(obj, f.name)
        kind, optional = _base_type(hints[f.name])
        if value is None and optional:
            continue
        if meta.choices is not None and value not in meta.choices:
            raise ValueError(f"{option(f)} must be one of {', '.join(meta.choices)}, got {value!r}")
        if kind in (int, float):
            lo = None if meta.lo is None else _value(meta.lo)
            hi = None if meta.hi is None else _value(meta.hi)
            bad = (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or (kind is int and not isinstance(value, int))
                or (lo is not None and (value <= lo if meta.lo_open else value < lo))
                or (hi is not None and value > hi)
                or value != value
            )
            if bad:
                raise ValueError(
                    f"{option(f)} must be {'an integer' if kind is int else 'a number'} in "
                    f"{range_text(meta, kind is int)}, got {value!r}"
                )


_METAVARS = {int: "N", float: "X", str: "VALUE", Path: "PATH"}


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    dest: str = "",
    only: tuple[str, ...] | None = None,
) -> None:
    """One argument per flag field of `cls` (those named in `only`, when given), its destination
    `dest + field name`. A bool is --x / --no-x; a tuple is a repeatable flag; the bounds are checked when
    the settings are built from the values (`check`), where the message can name the range."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        meta = flag_of(f)
        if meta is None or (only is not None and f.name not in only):
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
        kind, _ = _base_type(hints[f.name])
        names = [option(f), *meta.aliases]
        helptext = meta.help
        if kind in (int, float) and (meta.lo is not None or meta.hi is not None):
            helptext += f"; range {range_text(meta, kind is int)}"
        if default is not None and kind is not bool and "default" not in meta.help:
            helptext += f"; default {default}"
        kw: dict[str, Any] = {"dest": dest + f.name, "help": helptext.replace("%", "%%")}
        if kind is bool:
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, default=default, **kw)
        elif kind is tuple:
            parser.add_argument(*names, action="append", default=list(default), metavar=meta.metavar, **kw)
        else:
            parser.add_argument(
                *names,
                type=str if kind is Path else kind,
                default=default,
                choices=meta.choices,
                metavar=meta.metavar or _METAVARS.get(kind),
                **kw,
            )


def values(ns: argparse.Namespace, cls: type, dest: str = "", only: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The parsed values of `cls`'s flag fields, by field name, in the field's type (tuples, paths)."""
    hints = _hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if flag_of(f) is None or (only is not None and f.name not in only):
            continue
        v = getattr(ns, dest + f.name)
        kind, _ = _base_type(hints[f.name])
        out[f.name] = tuple(v) if kind is tuple else Path(v) if kind is Path and v is not None else v
    return out
