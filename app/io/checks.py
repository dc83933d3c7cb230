"""The checks every API's door shares, one function each: client text, a sample rate, a context id, a base64
payload, a message's boolean field. Each door calls them on its own fields and names its own error code where its
dialect has one."""

from __future__ import annotations

import asyncio
import base64
import binascii
import math
from collections.abc import Iterable, Mapping
from typing import Any

from app.io.errors import GatewayError as G
from app.io.errors import RequestError

MAX_CONTEXT_ID = 128  # characters
# A base64 payload longer than this (characters) is decoded in a worker thread: binascii holds the GIL for
# a whole call (a 6 MiB clip held the event loop ~20-55 ms), so it decodes B64_CHUNK characters a call and the
# loop's thread takes the GIL between calls. Smaller ones decode inline: the thread hop costs more.
INLINE_BASE64 = 1 << 16
B64_CHUNK = 1 << 18  # a multiple of 4: every chunk but the last is whole base64 quads


def check_text(text: str, name: str = "text", code: str = G.BAD_TEXT) -> str:
    """The one check of client text every API makes: it must be valid Unicode (JSON can carry a lone
    surrogate such as "\\ud800", which has no UTF-8 form and so no prompt, nor a place in a UTF-8 file)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(
            code,
            f"{name} contains a lone surrogate (U+{ord(text[e.start]):04X} at character {e.start}); "
            "send valid Unicode text",
        ) from None
    return text


def text_field(data: dict[str, Any], key: str, limit: int) -> str:
    """The text of a one-shot (HTTP) request: a non-empty string within `limit` characters, valid Unicode."""
    text = data.get(key)
    if not isinstance(text, str) or not text.strip():
        raise RequestError(G.EMPTY_TEXT, f"{key} must be a non-empty string")
    if len(text) > limit:
        raise RequestError(G.TEXT_TOO_LONG, f"{key} is limited to {limit} characters")
    return check_text(text, key)


def finite(value: int | float) -> bool:
    """A finite number: JSON carries integers of any size, and math.isfinite raises OverflowError on one past
    float's range (10**400), which is no number any field takes."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


# how a refusal names the JSON types a field may hold (the Python types json.loads gives; a number is float here)
_JSON_TYPES = {str: "a string", bool: "true or false", float: "a number", dict: "an object", list: "an array"}


def _of_types(value: object, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # (a bool is an int to Python, never a number to JSON)
        return bool in types
    if isinstance(value, int | float):
        return float in types and finite(value)
    return isinstance(value, types)


def check_types(data: Mapping[str, Any], types: Mapping[str, tuple[type, ...]], code: str, prefix: str = "") -> None:
    """The one rule for fields a route accepts and does not use (OpenAI's `model`, ElevenLabs' `model_id`,
    Cartesia's `model_id`, `duration`, ...): each holds a JSON type its vendor documents, `types[key]` (`float`: a
    finite JSON number, an integer too; `str`, `bool`, `dict`, `list`), or null (as left out); else
    RequestError(code) naming it (`prefix`: where the object sits, "voice."). What the vendor would refuse is not
    ignored in silence: `"model": ["tts-1"]` was taken as no model."""
    for key, allowed in types.items():
        value = data.get(key)
        if value is not None and not _of_types(value, allowed):
            raise RequestError(code, f"{prefix}{key} must be {' or '.join(_JSON_TYPES[t] for t in allowed)}")


def bounded_number(value: object, name: str, lo: float, hi: float, code: str, lo_open: bool = False) -> float:
    """`value` as a JSON number (not a boolean), finite and within lo..hi (above lo, never at it, when `lo_open`:
    a length of 0 s), else RequestError(code) naming it (`name`) and its range."""
    number = value if not isinstance(value, bool) and isinstance(value, int | float) and finite(value) else None
    if number is not None and (lo < number if lo_open else lo <= number) and number <= hi:
        return float(number)
    span = f"above {lo:g}, up to {hi:g}" if lo_open else f"in {lo:g}..{hi:g}"
    raise RequestError(code, f"{name} must be a number {span}, not {str(value)[:40]!r}")


def check_number(
    data: Mapping[str, Any],
    key: str,
    lo: float,
    hi: float,
    code: str = G.BAD_PARAMS,
    prefix: str = "",
    lo_open: bool = False,
) -> float | None:
    """A number field bounded to its vendor's documented range (ElevenLabs' `voice_settings.stability`, 0..1;
    Cartesia's `generation_config.volume`, 0.5..2), read or not: None when absent or null, else `bounded_number`
    (`prefix`: where the object sits). A type check alone took 1e308 or -5 as the vendor would not, and ignored it
    in silence."""
    value = data.get(key)
    return None if value is None else bounded_number(value, prefix + key, lo, hi, code, lo_open)


def whole_number(value: object) -> int | None:
    """A JSON number that is whole, as an int: 24000 or 24000.0 (a client's float that is an integer: Python's
    24000.0 is serialized so); None for anything else (a boolean, 24000.5, NaN, an infinity, a string)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not value.is_integer():  # (NaN and the infinities are not)
        return None
    return int(value)


def check_sample_rate(
    rate: object,
    allowed: Iterable[int],
    code: str = G.BAD_PARAMS,
    what: str = "sample_rate must be one of",
    note: str = "",
) -> int:
    """`rate` as one of `allowed` (a number equal to one: 24000.0 is 24000; a boolean is none), else
    RequestError(code)."""
    allowed = list(allowed)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or rate not in allowed:
        raise RequestError(code, f"{what} {allowed}{note}")
    return int(rate)


def check_context_id(value: object, code: str = G.BAD_MESSAGE) -> str | None:
    """A client's context id: None when absent, else a string of 1-128 characters of valid Unicode (it is echoed
    in every message about its context: a lone surrogate has no UTF-8 form for a client to read)."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_CONTEXT_ID:
        raise RequestError(code, f"context_id must be a string of 1-{MAX_CONTEXT_ID} characters")
    return check_text(value, "context_id", code)


def check_flag(data: dict[str, Any], key: str, code: str = G.BAD_MESSAGE) -> bool:
    """A message's boolean field: absent or null is false, a JSON boolean is itself, anything else is refused
    (a "true", 1 or "yes" that meant a flush, a close or a cancel must not be dropped in silence)."""
    value = data.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(code, f"{key} must be true or false, not {type(value).__name__} {str(value)[:40]!r}")
    return value


def b64decode_chunks(text: str) -> bytes:
    """Strict base64 (as b64decode(validate=True)) a chunk at a time; padding only at the very end."""
    if len(text) <= B64_CHUNK:
        return base64.b64decode(text, validate=True)
    last = (len(text) - 1) // B64_CHUNK * B64_CHUNK
    if "=" in text[:last]:
        raise binascii.Error("padding before the end")
    return b"".join(base64.b64decode(text[i : i + B64_CHUNK], validate=True) for i in range(0, len(text), B64_CHUNK))


async def base64_payload(value: object, name: str, code: str = G.BAD_PARAMS) -> bytes:
    """Base64 bytes, or a data: URL's (what follows its first comma), else RequestError(code); a large one is
    decoded off the event loop. Whitespace around it is dropped, as the reference server drops it (a payload read
    from a file ends in a newline); inside it, it is refused."""
    text = str(value).strip().split(",", 1)[-1]
    try:
        if len(text) <= INLINE_BASE64:
            return base64.b64decode(text, validate=True)
        return await asyncio.to_thread(b64decode_chunks, text)
    except (binascii.Error, ValueError):
        raise RequestError(code, f"{name} must be base64 (or a data: URL)") from None
