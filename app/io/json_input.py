"""One parser for every JSON object a client sends (WebSocket messages, HTTP bodies): a bad, deep, crowded or
non-object document is a coded RequestError, never a RecursionError or a 500."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from app.io.errors import RequestError

# Our messages and bodies nest a few levels at most ({"params": {"quality_buckets": {...}}}). A deeper
# document is refused whole, so no later code (validation, json.dumps, msgpack) ever walks one.
MAX_DEPTH = 32
# Values one document may hold, counted before it is parsed by its commas (every value but a container's first follows
# one; commas inside strings count too, so this bounds the values from above). json.loads runs on the event loop and
# holds the GIL for the whole call: an 18 MB body of zeros held every session's audio ~0.6 s, an 8 MB message ~0.25 s.
# Ours hold far fewer: a voice embedding is 2,048 numbers, a dictionary's rules (1 MB at most) some 30,000 values;
# text, base64 clips and embeddings carry next to no commas.
MAX_VALUES = 1 << 17


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        d += 1
        deepest = max(deepest, d)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((x, d) for x in v)
    return deepest


def parse_json_object(raw: str | bytes, code: str, what: str) -> dict[str, Any]:
    """`raw` as a JSON object, else RequestError(code, "<what> must be ..."); `what` names the input
    ("a message", "the body")."""
    if not raw:
        raise RequestError(code, f"{what} is empty: send a JSON object")
    if (raw.count(",") if isinstance(raw, str) else raw.count(b",")) >= MAX_VALUES:
        raise RequestError(code, f"{what} must hold at most {MAX_VALUES} JSON values (commas)")
    try:
        data = json.loads(raw)
    except RecursionError:  # json's C scanner nests on the C stack and stops at the recursion limit
        data = None
        too_deep = True
    except ValueError:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8/16/32
        raise RequestError(code, f"{what} must be a JSON object (this is not valid JSON)") from None
    else:
        # Only a document with enough brackets can be too deep: the count is one fast pass in C.
        opens = raw.count("[") + raw.count("{") if isinstance(raw, str) else raw.count(b"[") + raw.count(b"{")
        too_deep = opens > MAX_DEPTH and _depth(data) > MAX_DEPTH
    if too_deep:
        raise RequestError(code, f"{what} must be JSON nested at most {MAX_DEPTH} levels deep")
    if not isinstance(data, dict):
        raise RequestError(code, f"{what} must be a JSON object, not {_kind(data)}")
    return data


def check_fields(
    data: dict[str, Any], allowed: Collection[str], code: str, what: str = "fields", name_known: bool = False
) -> None:
    """The one rule on the keys of a client's JSON object: each must be one that `allowed` names, else
    RequestError(code, "unknown <what> [...]") naming the others (and, with `name_known`, those it takes). A misspelt
    field is refused, never left out silently (a blend's "weight" for "t" was a blend at 0.5)."""
    unknown = sorted(set(data).difference(allowed))
    if unknown:
        known = f"; known: {sorted(allowed)}" if name_known else ""
        raise RequestError(code, f"unknown {what} {unknown}{known}")


def _kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(
        type(value), "null"
    )
