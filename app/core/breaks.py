"""Inline breaks: `<break time="500ms"/>` (ElevenLabs' and Cartesia's syntax; also "1.5s") in a text is that
much silence, exactly, between the speech before and after it; SSML's `<break strength="strong"/>` (and a bare
`<break/>`, SSML's medium) is the silence of its strength (STRENGTH_S). The speech after a break continues the speech
before it (the same continuation chain: a break does not reset the voice)."""

from __future__ import annotations

import re

from app.core.tag_vocabulary import BREAK_END, BREAK_OPEN, BREAK_TAG, attributes
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from engine.contract.constants import SAMPLE_RATE

MAX_BREAK_S = 10.0  # one break at most (ElevenLabs allows 3 s; a longer pause is the client's to make)
MAX_BREAKS = 16  # breaks in one text (each is an utterance of the session's queue)
_BREAK_END_SPACED = re.compile(r"\s*<\s*/\s*break\s*>\s*", re.IGNORECASE)
# SSML's break strengths as silence (Azure's documented durations; SSML 1.1 names them, leaves the length to the
# engine): a break with a time is that time; "none" is no break at all (the words either side join); a bare
# <break/> is "medium", as SSML and Azure read it
STRENGTH_S = {"none": 0.0, "x-weak": 0.25, "weak": 0.5, "medium": 0.75, "strong": 1.0, "x-strong": 1.25}
DEFAULT_STRENGTH = "medium"
# a break's time: a number and its unit, 500ms or 1.5s (spaces around them allowed)
_TIME = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s)\s*", re.IGNORECASE)


def split_breaks(text: str, partial: bool = False) -> list[str | float]:
    """The text's pieces in order: spoken text (str, never empty or blank) and breaks (seconds). A break tag with
    an invalid time or strength is refused (`bad_text`), never spoken as text; `strength="none"` joins the words
    either side; an element's end (`</break>`) is dropped (a text of nothing else has no pieces). `partial`: a
    streamed message, whose last tag may still be arriving (its opening with no `>` after it)."""
    out: list[str | float] = []
    if BREAK_END.search(text):
        text = _BREAK_END_SPACED.sub(" ", text).strip()
        if not text:
            return out
    pos = 0
    tags = list(BREAK_TAG.finditer(text))
    whole = {m.start() for m in tags}
    last_end = text.rfind(">")
    for o in BREAK_OPEN.finditer(text):
        if o.start() not in whole and not (partial and last_end < o.start()):
            raise RequestError(
                G.BAD_TEXT, f"a break tag must end with '>' in the same sentence: {text[o.start() : o.start() + 60]!r}"
            )
    if len(tags) > MAX_BREAKS:
        raise RequestError(G.BAD_TEXT, f"at most {MAX_BREAKS} breaks in one text")
    pending = ""  # the spoken text since the last break (across `strength="none"` tags, which join it)
    for m in tags:
        segment = text[pos : m.start()]
        pending = _joined(pending, segment) if pending.endswith(" ") else pending + segment
        pos = m.end()
        seconds = break_seconds(m.group(0), m.group(1))
        if seconds == 0.0:
            pending = pending.rstrip() + " "
            continue
        if pending.strip():
            out.append(pending.strip())
        pending = ""
        out.append(seconds)
    rest = text[pos:]
    rest = _joined(pending, rest) if pending.endswith(" ") else pending + rest
    if rest.strip() or not (out or tags):
        out.append(rest if not out else rest.strip())
    return out


# what follows a word without a space: a `strength="none"` break before it joins the words with none
_CLOSING = re.compile(r"\s*[,.;:!?…)\]}»”’、。，！？；：]")


def _joined(pending: str, segment: str) -> str:
    """The text before a `strength="none"` break (a space after it) and the text after: one space between the words,
    none before a closing mark (`Hello<break strength="none"/>, world` is "Hello, world": "Hello , world" made ","
    a word of its own in the word times)."""
    segment = segment.lstrip()
    return (pending.rstrip() if _CLOSING.match(segment) else pending) + segment


def break_seconds(tag: str, attribute_text: str) -> float:
    """A break tag's silence (`tag` as written, `attribute_text` what follows its name): its time, else its strength's
    (STRENGTH_S; 0.0 is "none"), else medium's. A time that is not one (`time="soon"`, `time="1sx"`), or out of range,
    an unknown strength (beside a time too: it was ignored there) and attributes that are none (`attributes`) are
    refused (`bad_text`)."""
    found = attributes(attribute_text, tag)
    strength = found.get("strength", DEFAULT_STRENGTH).strip().lower()
    if strength not in STRENGTH_S:
        raise RequestError(G.BAD_TEXT, f"a break's strength is one of {', '.join(STRENGTH_S)}: {tag[:60]!r}")
    if "time" not in found:
        return STRENGTH_S[strength]
    t = _TIME.fullmatch(found["time"])
    if t is None:
        raise RequestError(G.BAD_TEXT, f"a break's time is a number with ms or s, as 500ms or 1.5s: {tag[:60]!r}")
    seconds = float(t.group(1)) / (1000.0 if t.group(2).lower() == "ms" else 1.0)
    # at least one sample of silence (a shorter one was none: a text of only such a break made an empty answer)
    if round(seconds * SAMPLE_RATE) < 1 or seconds > MAX_BREAK_S:
        written = f"{t.group(1)} {t.group(2).lower()}"  # (as written: 10.0001 s was "not 10 s" in :g)
        raise RequestError(
            G.BAD_TEXT,
            f"a break is at least one sample (1/{SAMPLE_RATE} s) and at most {MAX_BREAK_S:g} s, not {written}",
        )
    return seconds
