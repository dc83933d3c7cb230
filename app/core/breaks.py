"""Inline breaks: `<break time="500ms"/>` (ElevenLabs' and Cartesia's syntax; also "1.5s") in a text is that
much silence, exactly, between the speech before and after it. The speech after a break continues the speech
before it (the same continuation chain: a break does not reset the voice)."""

from __future__ import annotations

import re

from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from engine.contract.constants import SAMPLE_RATE

MAX_BREAK_S = 10.0  # one break at most (ElevenLabs allows 3 s; a longer pause is the client's to make)
MAX_BREAKS = 16  # breaks in one text (each is an utterance of the session's queue)
# characters inside a tag's < > at most (a break's, an emotion element's): the text buffer never cuts inside one,
# and the patterns look no further for its end (unbounded, each opening with no end looks through the rest of the
# text: 1666 "<break" in one message take the event loop 0.25 s)
TAG_MAX = 200
_TAG = re.compile(rf"<\s*break\b([^<>]{{0,{TAG_MAX}}})>", re.IGNORECASE)
BREAK_OPEN = re.compile(r"<\s*break\b", re.IGNORECASE)  # an opening that starts no whole tag was cut: refused
# an element's end (`<break time="1s"></break>`, as XML writers and SSML-writing LLMs send it): nothing to do, not text
BREAK_END = re.compile(r"<\s*/\s*break\s*>", re.IGNORECASE)
_BREAK_END_SPACED = re.compile(r"\s*<\s*/\s*break\s*>\s*", re.IGNORECASE)
_TIME = re.compile(r"""\btime\s*=\s*["']?\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s)\s*["']?""", re.IGNORECASE)


def split_breaks(text: str, partial: bool = False) -> list[str | float]:
    """The text's pieces in order: spoken text (str, never empty or blank) and breaks (seconds). A break tag
    without a valid time is refused (`bad_text`), never spoken as text; an element's end (`</break>`) is dropped (a
    text of nothing else has no pieces). `partial`: a streamed message, whose last tag may still be arriving (its
    opening with no `>` after it)."""
    out: list[str | float] = []
    if BREAK_END.search(text):
        text = _BREAK_END_SPACED.sub(" ", text).strip()
        if not text:
            return out
    pos = 0
    tags = list(_TAG.finditer(text))
    whole = {m.start() for m in tags}
    last_end = text.rfind(">")
    for o in BREAK_OPEN.finditer(text):
        if o.start() not in whole and not (partial and last_end < o.start()):
            raise RequestError(
                G.BAD_TEXT, f"a break tag must end with '>' in the same sentence: {text[o.start() : o.start() + 60]!r}"
            )
    if len(tags) > MAX_BREAKS:
        raise RequestError(G.BAD_TEXT, f"at most {MAX_BREAKS} breaks in one text")
    for m in tags:
        before = text[pos : m.start()]
        if before.strip():
            out.append(before.strip())
        t = _TIME.search(m.group(1))
        if t is None:
            raise RequestError(G.BAD_TEXT, f'a break needs a time such as time="500ms" or "1.5s": {m.group(0)[:60]!r}')
        seconds = float(t.group(1)) / (1000.0 if t.group(2).lower() == "ms" else 1.0)
        # at least one sample of silence (a shorter one was none: a text of only such a break made an empty answer)
        if round(seconds * SAMPLE_RATE) < 1 or seconds > MAX_BREAK_S:
            written = f"{t.group(1)} {t.group(2).lower()}"  # (as written: 10.0001 s was "not 10 s" in :g)
            raise RequestError(
                G.BAD_TEXT,
                f"a break is at least one sample (1/{SAMPLE_RATE} s) and at most {MAX_BREAK_S:g} s, not {written}",
            )
        out.append(seconds)
        pos = m.end()
    rest = text[pos:]
    if rest.strip() or not out:
        out.append(rest if not out else rest.strip())
    return out
