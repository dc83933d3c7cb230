"""Word times of an utterance, on the audio actually sent (docs/protocol.md "Word timestamps").

Sentence and chunk boundaries are exact: the gateway knows every sample's utterance. Inside a sentence ZONOS2
says nothing about where a word falls, so without a forced aligner the words are placed inside the
utterance's span: in proportion to their syllables (and the pauses their punctuation asks for), and within
the part of the audio that is voiced (the silence before the first and after the last voiced frame is no
word's). Every word is marked `"source": "estimated"`.

With a forced aligner (`--aligner`, engine/aligner/), each utterance's audio, once all sent, and its text go to the
engine's aligner, and its measured word times follow the estimate as `"source": "aligned"` (`aligned_words`;
app/core/playback.py hands them to the session, whose dialect sends them in its shape: docs/protocol.md "Word
timestamps").

The times are on the audio a listener's decoder plays (`AudioTimeline`'s `heard`, the encoder: app/io/audio_output.py
`Encoder.lead_s` and `heard_s`): a compressed stream's decoder plays its codec's delay first (MP3's 1,105 samples,
AAC's 1,024: docs/protocol.md "Word timestamps"), so every time is moved that much later, here and nowhere else
(`AudioTimeline.on_heard_clock`), and an utterance's audio ends where its decoded audio does (the last frame's
padding included), where the next utterance's clock begins.

The estimate streams: a word is placed once the audio sent reaches its estimated end (the total length is
still unknown: it is reckoned from a speaking rate, stretched to the audio sent when that runs longer), and
the words left when the utterance ends share the audio left, so the times are monotonic, every word gets
one, and none lies past the audio sent when it is reported.

SSML's marks (app/core/style_tags.py `Mark`) ride on the same clock: a mark is reached when the word before it is
placed, at that word's end (a mark before the utterance's first word: at its start, reported with its first audio),
so it is reported in the words' order, after the audio before it, and never past the audio sent (`MarkTime`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np

from engine.contract.constants import SAMPLE_RATE

_T = TypeVar("_T")

SOURCE = "estimated"  # what the client is told these times are
ALIGNED = "aligned"  # the source of times measured by the engine's aligner (`aligned_words`)
SYLLABLES_PER_S = 4.2  # a typical speaking rate: the total is reckoned from it until the audio says more
PAUSE_SYLLABLES = {",": 1.0, ";": 1.5, ":": 1.5, "-": 0.5, ".": 2.0, "!": 2.0, "?": 2.0, "…": 2.0}
FRAME = SAMPLE_RATE // 100  # 10 ms of 44.1 kHz audio: the unit of the voiced-or-not decision
QUIET_DB = 30.0  # a frame this far below the utterance's loudest frames is silence

CharTime = tuple[str, float, float]  # a character of an alignment: (character, start, end), seconds
_WORD = re.compile(r"\S+")
_VOWELS = re.compile(r"[aeiouyàâäéèêëîïôöùûüœæ]+", re.IGNORECASE)


@dataclass(frozen=True)
class WordTime:
    word: str
    start_s: float  # from the utterance's first sample
    end_s: float
    char_start: int  # the word's place in the utterance's text
    char_end: int

    def as_json(self) -> dict[str, object]:
        return {
            "word": self.word,
            "start_ms": round(self.start_s * 1e3, 1),
            "end_ms": round(self.end_s * 1e3, 1),
            "char_start": self.char_start,
            "char_end": self.char_end,
        }


@dataclass(frozen=True)
class MarkTime:
    """An SSML mark reached: its name and its time (the end of the word before it; the utterance's start when none
    is), on the same clock as the words'."""

    name: str
    time_s: float


def aligned_words(text: str, words: tuple[tuple[str, float, float], ...]) -> list[WordTime] | None:
    """The aligner's times (engine/aligner/: each `\\S+` word of the text, in order) as WordTimes; None when they
    are not the text's words (then the estimate stands)."""
    spans = [(m.start(), m.end()) for m in _WORD.finditer(text)]
    if len(spans) != len(words) or any(text[a:b] != w for (a, b), (w, _, _) in zip(spans, words, strict=True)):
        return None
    return [WordTime(w, s, e, a, b) for (a, b), (w, s, e) in zip(spans, words, strict=True)]


def syllables(word: str) -> float:
    """A word's weight: its vowel groups (at least one; a letterless token such as a number counts its
    characters), plus the pause its trailing punctuation asks for."""
    letters = re.sub(r"[^\w]", "", word)
    count = len(_VOWELS.findall(letters)) or max(1, len(letters) // 2)
    if len(letters) > 2 and letters.lower().endswith("e") and count > 1 and not letters.lower().endswith("le"):
        count -= 1  # a silent final e
    return count + PAUSE_SYLLABLES.get(word[-1], 0.0)


def char_times(words: list[WordTime]) -> list[CharTime]:
    """ElevenLabs' character alignment of some words, in seconds on the words' clock: each word's characters
    share its span evenly, a space after each (at the word's end)."""
    out: list[CharTime] = []
    for w in words:
        step = (w.end_s - w.start_s) / max(1, len(w.word))
        out += [(ch, w.start_s + i * step, w.start_s + (i + 1) * step) for i, ch in enumerate(w.word)]
        out.append((" ", w.end_s, w.end_s))
    return out


def run_to(chars: list[CharTime], end_s: float, since: float | None = None) -> list[CharTime]:
    """`chars` and a last space from their last end (or `since`, when there are none) to `end_s`, the end of
    the audio they cover: a client that advances its clock by an alignment's last end stays on the audio."""
    last = chars[-1][2] if chars else since
    if last is not None and end_s <= last:
        return chars
    start = last if last is not None else end_s
    return [*chars, (" ", start, max(start, end_s))]


def char_alignment(
    words: list[WordTime], start_s: float, end_s: float, timeline_s: float | None = None
) -> dict[str, list] | None:
    """ElevenLabs' WebSocket `alignment` of one audio message: the characters of the words it completes.

    Message clock (timeline_s None): times in ms from the message's first sample (a word begun in an earlier
    message starts before 0), and a last space that runs to the message's end (`run_to`), so a client that
    advances its clock by each message's alignment stays on the audio (pipecat).
    Context clock (timeline_s: where the words' clock starts in the context's audio, s): times in ms on the
    context's audio, only the words' characters (None when the message completes no word), so a client that
    reads every message's times as one timeline (LiveKit, `sync_alignment=true`) stays on the audio."""
    if timeline_s is not None:
        if not words:
            return None
        chars, origin = char_times(words), -timeline_s
    else:
        chars, origin = run_to(char_times(words), end_s, start_s), start_s
    return {
        "chars": [c for c, _, _ in chars],
        "charStartTimesMs": [round((a - origin) * 1e3, 1) for _, a, _ in chars],
        "charDurationsMs": [round((b - a) * 1e3, 1) for _, a, b in chars],
    }


def char_alignment_seconds(chars: list[CharTime]) -> dict[str, list] | None:
    """ElevenLabs' HTTP `alignment` (`/with-timestamps` routes) of `char_times` output: seconds on the
    response's clock (None: no characters)."""
    if not chars:
        return None
    return {
        "characters": [c for c, _, _ in chars],
        "character_start_times_seconds": [round(a, 4) for _, a, _ in chars],
        "character_end_times_seconds": [round(b, 4) for _, _, b in chars],
    }


@dataclass
class Chunk:
    """What one audio message covers: its span of the audio (seconds on the timeline's clock: the decoded audio,
    its codec's delay in its first message), the words that span completes (none unless the timeline estimates
    words) and the marks it reaches (its utterances' `marks`)."""

    start_s: float
    end_s: float
    words: list[WordTime] = field(default_factory=list)
    marks: list[MarkTime] = field(default_factory=list)


class Heard(Protocol):
    """What a listener's decoder makes of one encoded stream (app/io/audio_output.py `Encoder`)."""

    @property
    def lead_s(self) -> float:
        """The seconds it plays before the stream's first sample (the codec's delay)."""
        ...

    @property
    def heard_s(self) -> float:
        """The seconds it has made of the bytes out so far, the lead included."""
        ...

    def follow(self) -> None:
        """Keep count of what it makes (`heard_s`) from the stream's first byte on."""
        ...


class AudioTimeline:
    """The audio of utterances played one after another on one stream (an utterance of a socket, the whole text of
    an HTTP response), as it is handed to the encoder: what each message covers, and, with `words`, the words
    each completes (a WordClock per utterance, its times moved onto the timeline's clock). Every message's
    words are taken once, in order: the times the client gets are monotonic and cover every word.

    `heard`: the stream's encoder. The timeline's clock is then the audio its listener's decoder plays: every time
    is its lead later (`on_heard_clock`), a message's span ends where the decoded audio of the bytes out so far
    does (`Heard.heard_s`), and the last one where the stream's does (its last frame's padding included). Without
    one, the clock is the samples handed in."""

    def __init__(self, words: bool = True, heard: Heard | None = None) -> None:
        self.words = words
        self.heard: Heard | None = None
        if heard is not None:
            self.follow(heard)
        self.samples = 0  # handed to the encoder
        # of those, out of the encoder (a resampler holds back its last block until more comes): a word is reported,
        # and a message's span ends, only where the audio sent reaches (`feed`'s `sent`; without it, all of it)
        self._out = 0
        self._clock: WordClock | None = None
        self._offset = 0.0  # where the utterance playing began on the timeline (of the samples handed in)
        self._taken_s = 0.0  # where the messages taken end (the timeline's clock)
        self._pending: list[WordTime] = []
        self._marks: list[MarkTime] = []  # reached, not taken yet

    def follow(self, heard: Heard) -> None:
        """The timeline's clock is `heard`'s decoded audio (an HTTP answer's, once its encoder is made), before the
        stream's first byte."""
        heard.follow()
        self.heard = heard

    @property
    def sent_s(self) -> float:
        """The samples handed in, in seconds."""
        return self.samples / SAMPLE_RATE

    @property
    def end_s(self) -> float:
        """Where the audio out so far ends on the timeline's clock (the listener's decoded audio, with `heard`)."""
        return self._out / SAMPLE_RATE if self.heard is None else self.heard.heard_s

    def on_heard_clock(self, words: list[WordTime], offset_s: float = 0.0) -> list[WordTime]:
        """Words timed from the first sample of an utterance that began `offset_s` into the samples handed in, on
        the timeline's clock: the one place where the codec's delay (`Heard.lead_s`) moves a word time (and a mark's,
        `_shift`)."""
        shift = self._shift(offset_s)
        if not shift:
            return words
        return [dataclasses.replace(w, start_s=w.start_s + shift, end_s=w.end_s + shift) for w in words]

    def _shift(self, offset_s: float) -> float:
        return offset_s + (self.heard.lead_s if self.heard is not None else 0.0)

    def begin(self, text: str, marks: tuple[tuple[int, str], ...] = ()) -> WordClock | None:
        """An utterance of `text` begins here: its word clock (None without `words` and `marks`). `marks`: the SSML
        marks in `text` (index, name: app/core/style_tags.py MarkedText), reached on the word clock."""
        self.end()
        self._offset = self.sent_s
        self._clock = WordClock(text, marks) if self.words or marks else None
        if self._clock is not None:
            self._moved([])  # (a mark before its first word: reached now)
        return self._clock

    def feed(self, pcm: np.ndarray, sent: int | None = None) -> None:
        """Audio of the utterance (int16, 44.1 kHz), as handed to the encoder. `sent`: how much of the timeline's
        audio (44.1 kHz samples) the encoder has put out so far (Encoder.native_out: a resampler holds back up to
        ~40 ms), where it is not all of it."""
        self.samples += len(pcm)
        self._out = self.samples if sent is None else max(self._out, min(sent, self.samples))
        if self._clock is not None:
            self._moved(self._clock.feed(pcm, (self._out / SAMPLE_RATE) - self._offset))

    def end(self) -> None:
        """The utterance's audio is complete (and out of the encoder): its words left share it."""
        self._out = self.samples
        if self._clock is not None:
            self._moved(self._clock.finish())
            self._clock = None

    def take(self, final: bool = False) -> Chunk:
        """What the next message covers: the audio sent since the last one, the words completed (and marks reached)
        since that end within it (the words an ended utterance left wait for the audio a decoder has to reach them:
        an HTTP answer's encoder still holds its last audio when its next utterance begins). `final`: the stream's
        last message, its encoder closed: every word left, none past the stream's end (one that decodes to less than
        its codec's delay, an utterance that put no audio out, has its words, moved by the delay, past its end: they
        end with it, as on the samples)."""
        end_s = max(self._taken_s, self.end_s)
        words, self._pending = self._pending, []
        marks, self._marks = self._marks, []
        if final:
            if words and words[-1].end_s > end_s:
                words = [
                    dataclasses.replace(w, start_s=min(w.start_s, end_s), end_s=min(w.end_s, end_s)) for w in words
                ]
            if marks and marks[-1].time_s > end_s:
                marks = [dataclasses.replace(k, time_s=min(k.time_s, end_s)) for k in marks]
        else:  # what a decoder has not reached yet waits for a later message
            words, self._pending = _split_at(words, [w.end_s for w in words], end_s)
            marks, self._marks = _split_at(marks, [k.time_s for k in marks], end_s)
        chunk = Chunk(self._taken_s, end_s, words, marks)
        self._taken_s = chunk.end_s
        return chunk

    def _moved(self, words: list[WordTime]) -> None:
        if self.words:
            self._pending += self.on_heard_clock(words, self._offset)
        if self._clock is not None and (reached := self._clock.take_marks()):
            shift = self._shift(self._offset)
            self._marks += [dataclasses.replace(k, time_s=k.time_s + shift) for k in reached]


def _split_at(items: list[_T], times: list[float], end_s: float) -> tuple[list[_T], list[_T]]:
    """`items` (in time order) up to the first whose time is past `end_s`, and the rest."""
    cut = next((i for i, t in enumerate(times) if t > end_s + 1e-9), len(items))
    return items[:cut], items[cut:]


class WordClock:
    """The streaming estimate of one utterance's word times (module docstring)."""

    def __init__(self, text: str, marks: tuple[tuple[int, str], ...] = ()) -> None:
        self.words = [(m.group(), m.start(), m.end()) for m in _WORD.finditer(text)]
        # each mark: how many words come before it (those that end by its index), and its name; in order
        self._marks = [(sum(end <= at for _, _, end in self.words), name) for at, name in marks]
        self._reached: list[MarkTime] = [MarkTime(name, 0.0) for before, name in self._marks if not before]
        del self._marks[: len(self._reached)]
        weights = [syllables(w) for w, _, _ in self.words]
        self._ends = np.cumsum(weights) if weights else np.zeros(0)
        self._total = float(self._ends[-1]) if weights else 0.0
        self._next = 0  # the first word not placed yet
        self._placed_to = 0.0  # where the last placed word ends
        self._samples = 0
        self._energy = np.zeros(0, np.float32)  # per 10 ms frame of the audio so far
        self._th: tuple[int, float] = (0, 0.0)  # the silence threshold and the frame count it was found at
        self._tail = np.zeros(0, np.int16)

    @property
    def done(self) -> bool:
        return self._next >= len(self.words)

    def take_marks(self) -> list[MarkTime]:
        """The marks reached since the last call (times from the utterance's first sample)."""
        reached, self._reached = self._reached, []
        return reached

    def feed(self, pcm: np.ndarray, out_s: float | None = None) -> list[WordTime]:
        """More of the utterance's audio (int16 at 44.1 kHz, as handed to the encoder): the words it now holds.
        `out_s`: how much of it has been sent (the rest is held in the encoder): no word is placed past it."""
        self._measure(pcm)
        if self.done or not self._total:
            return []
        sent_s = self._samples / SAMPLE_RATE
        start = self._voiced_start()
        if start is None:
            return []
        span = max(self._total / SYLLABLES_PER_S, sent_s - start)  # the sentence's length as known so far
        voiced_to = self._voiced_end()  # a word is placed only in voiced audio: never in a pause or the tail
        if out_s is not None:
            voiced_to = min(voiced_to, out_s)
        out = []
        while not self.done:
            end = start + span * float(self._ends[self._next]) / self._total
            if end > voiced_to:
                break
            out.append(self._place(end))
        return out

    def finish(self) -> list[WordTime]:
        """The utterance's audio is complete: the words left share its voiced audio left."""
        if self.done:
            return []
        start = self._voiced_start()
        end = self._voiced_end()
        begin = max(self._placed_to, start if start is not None else 0.0)
        end = max(end, begin)
        done_weight = float(self._ends[self._next - 1]) if self._next else 0.0
        left = self._total - done_weight
        out = []
        while not self.done:
            frac = (float(self._ends[self._next]) - done_weight) / left if left else 1.0
            out.append(self._place(begin + (end - begin) * frac))
        return out

    def spoken(self, audio_s: float) -> list[str]:
        """The words heard within the first `audio_s` of the utterance (a barge-in's report): those placed
        that began by then, and of the rest, those whose estimated start lies within it."""
        heard = []
        start = self._voiced_start() or 0.0
        span = max(self._total / SYLLABLES_PER_S, self._samples / SAMPLE_RATE - start) if self._total else 0.0
        prev = 0.0
        for i, (word, _, _) in enumerate(self.words):
            begins = start + span * prev / self._total if self._total else 0.0
            prev = float(self._ends[i])
            if begins < audio_s:
                heard.append(word)
        return heard

    # ---- the audio ---------------------------------------------------------------------------------
    def _measure(self, pcm: np.ndarray) -> None:
        self._samples += len(pcm)
        x = np.concatenate([self._tail, pcm]) if len(self._tail) else pcm
        whole = len(x) // FRAME * FRAME
        if whole:
            frames = x[:whole].astype(np.float32).reshape(-1, FRAME)
            self._energy = np.concatenate([self._energy, np.sqrt(np.mean(frames * frames, axis=1) + 1e-9)])
        self._tail = np.asarray(x[whole:], np.int16)

    def _threshold(self) -> float:
        """Below it a frame is silence: QUIET_DB under the loudest frames so far (their 90th percentile), found
        once per frame count (each chunk's placing asks for it several times)."""
        n = len(self._energy)
        if self._th[0] != n:
            loud = 0.0
            if n:  # np.percentile(energy, 90) ("linear"), without its ~80 us of Python around a partition
                pos = 0.9 * (n - 1)
                lo = int(pos)
                hi = min(lo + 1, n - 1)
                part = np.partition(self._energy, (lo, hi))
                loud = float(part[lo] + (part[hi] - part[lo]) * (pos - lo))
            self._th = (n, loud * 10 ** (-QUIET_DB / 20))
        return self._th[1]

    def _voiced_start(self) -> float | None:
        """When the first voiced frame begins (None: none yet)."""
        voiced = np.flatnonzero(self._energy > self._threshold())
        return int(voiced[0]) * FRAME / SAMPLE_RATE if len(voiced) else None

    def _voiced_end(self) -> float:
        voiced = np.flatnonzero(self._energy > self._threshold())
        return (int(voiced[-1]) + 1) * FRAME / SAMPLE_RATE if len(voiced) else self._samples / SAMPLE_RATE

    def _place(self, end: float) -> WordTime:
        word, a, b = self.words[self._next]
        start = self._placed_to if self._next else (self._voiced_start() or 0.0)
        end = max(end, start)
        self._next += 1
        self._placed_to = end
        while self._marks and self._marks[0][0] <= self._next:  # the marks after this word
            self._reached.append(MarkTime(self._marks.pop(0)[1], end))
        return WordTime(word, start, end, a, b)
