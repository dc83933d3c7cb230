"""OpenAI's `instructions` ("speak cheerfully", "calm and slow") onto what ZONOS2 can do: the emotion axes
(valence, arousal: needs --emotion-directions-dir with those axes) and the speaking rate (needs a model with
speaking-rate buckets). The emotion words (EMOTION_WORDS, app/core/tag_vocabulary.py: bracket tags name them
too) and the words below are the whole table (docs/clients.md); a word of the instructions that names a manner
of speaking and is not in it, or that the server cannot apply, is reported back, never silently dropped. The
words of an instruction add up, each capped to the axes' bounds.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from app.core.options import SPEED_RANGE, SynthesisOptions
from app.core.tag_vocabulary import EMOTION_WORDS
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from engine.frontend.emotion import EmotionDirections

# word -> a speed multiplier (the speaking rate)
SPEED_WORDS: dict[str, float] = {
    "slow": 0.85,
    "slowly": 0.85,
    "fast": 1.2,
    "quick": 1.2,
    "quickly": 1.2,
    "rapid": 1.25,
    "rapidly": 1.25,
    "brisk": 1.1,
    "briskly": 1.1,
    "leisurely": 0.8,
}
# words that ask for a manner of speaking the table does not have (reported as not applied)
MANNER_WORDS = {
    "whisper",
    "whispering",
    "shout",
    "shouting",
    "loud",
    "loudly",
    "quiet",
    "quietly",
    "soft",
    "softly",
    "accent",
    "british",
    "american",
    "sarcastic",
    "sarcastically",
    "dramatic",
    "dramatically",
    "robotic",
    "sing",
    "singing",
    "deep",
    "high",
    "low",
    "pitch",
    "emphasis",
    "emphasize",
}
AXIS_LIMIT = 1.0
# instructions are a sentence or two; read word by word on the event loop, and named back in a response header
MAX_INSTRUCTIONS_CHARS = 4096

_WORD = re.compile(r"[a-z]+")


@dataclass
class Instructions:
    """What an instruction asked for, what of it is applied, what is not (and why)."""

    applied: list[str] = field(default_factory=list)
    unmapped: list[str] = field(default_factory=list)


def _lookup(word: str) -> tuple[float, float] | float | None:
    """The table's value for a word or its adverb / noun ("cheerfully", "calmness")."""
    for table in (EMOTION_WORDS, SPEED_WORDS):
        for key, value in table.items():
            if word == key or (word.startswith(key) and word[len(key) :] in ("ly", "ally", "ily", "ness")):
                return value
    return None


def apply_instructions(
    text: str, opts: SynthesisOptions, directions: EmotionDirections | None, speaking_rate: bool, voice: bool = True
) -> tuple[SynthesisOptions, Instructions]:
    """`opts` with what `text` asks for, and the report. A field the request sets itself (emotion_*,
    speed) is not overridden. `voice`: the request has one (an emotion moves a voice: without one it is not
    applied)."""
    if len(text) > MAX_INSTRUCTIONS_CHARS:
        raise RequestError(G.BAD_PARAMS, f"instructions are limited to {MAX_INSTRUCTIONS_CHARS} characters")
    report = Instructions()
    valence = arousal = 0.0
    speed = 1.0
    axes = directions is not None and all(a in directions.axes for a in ("valence", "arousal"))
    for word in _WORD.findall(text.lower()):
        value = _lookup(word)
        if value is None:
            if word in MANNER_WORDS:
                report.unmapped.append(f"{word} (no such control)")
            continue
        if isinstance(value, tuple):
            if not axes:
                report.unmapped.append(f"{word} (no emotion directions with valence and arousal axes)")
                continue
            if not voice:
                report.unmapped.append(f"{word} (an emotion is applied to a voice; this request has none)")
                continue
            valence, arousal = valence + value[0], arousal + value[1]
        else:
            if not speaking_rate:
                report.unmapped.append(f"{word} (this model has no speaking-rate control)")
                continue
            speed *= value
        report.applied.append(word)
    # each word named once (the words still add up: "very very happy")
    report.applied, report.unmapped = list(dict.fromkeys(report.applied)), list(dict.fromkeys(report.unmapped))
    emo = opts.emotion
    if (valence or arousal) and not emo.requested:
        clip = lambda x: max(-AXIS_LIMIT, min(AXIS_LIMIT, x))  # noqa: E731
        opts = dataclasses.replace(
            opts, emotion=dataclasses.replace(emo, enabled=True, valence=clip(valence), arousal=clip(arousal))
        )
    if (
        speed != 1.0
        and opts.cond.speed is None
        and opts.cond.speaking_rate is None
        and opts.cond.speaking_rate_bucket is None
    ):
        speed = max(SPEED_RANGE[0], min(SPEED_RANGE[1], speed))
        opts = dataclasses.replace(opts, cond=dataclasses.replace(opts.cond, speed=speed))
    return opts, report
