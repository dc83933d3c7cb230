"""One parser for the numbers a client puts in a URL (`?sample_rate=24000`, `?seed=7`, the 24000 of
ElevenLabs' `output_format=pcm_24000`, Deepgram's `?speed=1.1`): ASCII digits only (with a fraction where the
setting takes one), else a coded RequestError (a 4xx, or a WebSocket error), never a ValueError from int(). Python's
own parsers are no check: `str.isdigit` takes "²" and "٣", int() takes "１２", " 12 ", "+12" and "1_2", float()
takes those and "nan", "inf", "1e400" (an infinity), so `?speed=1_0` was 10. And the one rule for a setting given
twice in a URL (`check_single`)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from app.io.errors import GatewayError as G
from app.io.errors import RequestError

# 18 digits: every setting fits in an int64, and int() of a huge digit string is never reached
_DECIMAL = re.compile(r"[0-9]{1,18}")
# a number with an optional fraction, as every vendor writes one ("1", "1.0", "0.85"): no sign, exponent, "nan",
# "inf", underscore or space; 18 digits each side keep it finite and exact enough for any setting
_FRACTION = re.compile(r"[0-9]{1,18}(?:\.[0-9]{1,18})?")


def _shown(text: str) -> str:
    return repr(text if len(text) <= 24 else text[:24] + "...")


def decimal(text: str, name: str, code: str = G.BAD_PARAMS) -> int:
    """`text` as a non-negative integer written in ASCII digits, else RequestError(code)."""
    if not _DECIMAL.fullmatch(text):
        raise RequestError(code, f"{name} must be a non-negative integer in ASCII digits, not {_shown(text)}")
    return int(text)


def fraction(text: str, name: str, code: str = G.BAD_PARAMS) -> float:
    """`text` as a non-negative number written in ASCII digits with an optional fraction ("1", "0.85"), else
    RequestError(code). The setting's own bounds are its owner's to check."""
    if not _FRACTION.fullmatch(text):
        raise RequestError(code, f"{name} must be a number in ASCII digits such as 1 or 0.85, not {_shown(text)}")
    return float(text)


def query_int(query: Mapping[str, str], key: str, code: str = G.BAD_PARAMS) -> int | None:
    """The integer setting `key` of a query string (None when absent or empty)."""
    raw = query.get(key)
    return None if raw is None or raw == "" else decimal(raw, key, code)


def query_fraction(query: Mapping[str, str], key: str, code: str = G.BAD_PARAMS) -> float | None:
    """The setting `key` of a query string that takes a fraction (None when absent or empty)."""
    raw = query.get(key)
    return None if raw is None or raw == "" else fraction(raw, key, code)


def check_single(query: Mapping[str, str], keys: Iterable[str], code: str = G.BAD_PARAMS, secret: bool = False) -> None:
    """Refuse a setting of `keys` given twice with different values (`?sample_rate=8000&sample_rate=24000`),
    RequestError(code) naming it: a query's get() keeps the last in silence, and which one the client meant is
    not known. The same value repeated is that value. `secret`: the values are not shown (an API key). Every
    door's query settings are checked here (docs/protocol.md, docs/dialects.md). A plain mapping (no getlist)
    holds one value a key."""
    getlist = getattr(query, "getlist", None)
    if getlist is None:
        return
    for key in keys:
        values = getlist(key)
        if len(set(values)) > 1:
            shown = (
                ""
                if secret
                else " (" + ", ".join(repr(v if len(v) <= 24 else v[:24] + "...") for v in values[:4]) + ")"
            )
            raise RequestError(code, f"{key} is given {len(values)} times with different values{shown}; give it once")
