"""Long-form continuation: one voice across chunks, as the reference's `prefix-cfg-longform` branch does it.

Long text is cut into chunks of whole words (or whole sentences); every chunk after the first is generated as
the literal continuation of earlier chunks: their text goes into the prompt and their generated (delayed)
frames follow it as teacher-forced audio rows (engine/frontend/prompt.py `PromptBuilder.build_continuation`). Because
a chunk continues the exact frames put before it, the chunks' frames concatenate into one delayed stream that
one DAC stream decodes with no join.

The window of earlier chunks is the last `window_chunks - 1` whole chunks, plus the first chunk pinned in
front once it has scrolled out of that tail (the middle is evicted), so every chunk is grounded on the same
reference voice. Only whole chunks are fed: each chunk's text is the complete transcript of its frames.

A non-final chunk drops its last `BOUNDARY_TRIM` frames before the next continues it, and its prompt has no
trailing-silence conditioning, so it does not end utterance-finally (the join would be audible).

Everything here is numpy and plain Python: the gateway builds prompts without torch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.contract.constants import N_CODEBOOKS

SPLIT_MODES = ("word", "sentence")
DEFAULT_CHUNK_CHARS = 150  # the reference's long_form_chunk_chars
DEFAULT_WINDOW_CHUNKS = 2  # the new chunk + one chunk of teacher-forced context
BOUNDARY_TRIM = 3  # frames a non-final chunk loses at its end (residual trailing silence)
# Bounds checked at the door (the reference has none; a chunk of 0 characters would crash its worker).
CHUNK_CHARS_RANGE = (1, 100_000)
WINDOW_CHUNKS_RANGE = (1, 64)

# A sentence ends after ASCII enders followed by whitespace, or right after a CJK full-width ender, which
# usually has no space after it. Closing quotes/brackets stay with the sentence, as the reference's comment
# says (its re.split drops them with the whitespace: 'He said "go." Then' loses the quote there).
_SENTENCE_END = re.compile(r'[.!?…]["\'”’)\]]*(?=\s)|[。！？]')


def _sentences(text: str) -> list[str]:
    out, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        out.append(text[start : m.end()])
        start = m.end()
    out.append(text[start:])
    return [s.strip() for s in out if s.strip()]


# ---- chunking -----------------------------------------------------------------------------------------------
def split_words(text: str, max_chars: int = DEFAULT_CHUNK_CHARS) -> list[str]:
    """Greedy packing of whitespace-separated words into chunks of at most `max_chars` (a longer word is a
    chunk of its own). " ".join(chunks) is the text with whitespace runs collapsed."""
    if max_chars <= 0:
        raise ValueError("max_chars must be positive")
    chunks: list[str] = []
    cur = ""
    for word in text.split():
        if not cur:
            cur = word
        elif len(cur) + 1 + len(word) <= max_chars:
            cur = f"{cur} {word}"
        else:
            chunks.append(cur)
            cur = word
    if cur:
        chunks.append(cur)
    return chunks


def split_sentences(text: str, max_chars: int = DEFAULT_CHUNK_CHARS) -> list[str]:
    """Greedy packing of whole sentences into chunks of at most `max_chars`; a sentence longer than that is
    flushed on its own and cut by words."""
    if max_chars <= 0:
        raise ValueError("max_chars must be positive")
    sentences = _sentences(text)
    chunks: list[str] = []
    cur = ""
    for s in sentences:
        if len(s) > max_chars:
            if cur:
                chunks.append(cur)
                cur = ""
            chunks.extend(split_words(s, max_chars))
        elif not cur:
            cur = s
        elif len(cur) + 1 + len(s) <= max_chars:
            cur = f"{cur} {s}"
        else:
            chunks.append(cur)
            cur = s
    if cur:
        chunks.append(cur)
    return chunks


def split_text(text: str, max_chars: int = DEFAULT_CHUNK_CHARS, mode: str = "word") -> list[str]:
    if mode == "word":
        return split_words(text, max_chars)
    if mode == "sentence":
        return split_sentences(text, max_chars)
    raise ValueError(f"unknown split mode {mode!r}; expected one of {list(SPLIT_MODES)}")


# ---- frames and windows -------------------------------------------------------------------------------------
def context_chunks(window_chunks: int) -> int:
    """Earlier chunks carried as context: the window counts the new chunk too (1 = no teacher forcing)."""
    if window_chunks < 1:
        raise ValueError("window_chunks must be >= 1")
    return window_chunks - 1


def trim_chunk_codes(frames: np.ndarray, eos_frame: int | None, drop_trailing_frames: int = 0) -> np.ndarray:
    """A chunk's generated (delayed) frames [N, 9] cut to its content: up to `eos_frame` (all of them when
    the chunk ended without an end of audio), less `drop_trailing_frames` more. The result is both the audio
    kept from the chunk and the next chunk's prefix: the same frames, or the stream is no longer contiguous."""
    frames = np.asarray(frames)
    end = len(frames) if eos_frame is None else max(0, int(eos_frame))
    end = max(0, min(end, len(frames)) - max(0, int(drop_trailing_frames)))
    return frames[:end].copy()


def reply_frames(chunk_frames: Sequence[int]) -> int:
    """Frames a reply of chunks that generated these many frames each, without an end of audio, plays: each
    chunk but the last keeps all but BOUNDARY_TRIM of them (at least none)."""
    *held, last = chunk_frames
    return sum(max(0, f - BOUNDARY_TRIM) for f in held) + last


def windowed_context_indices(cur_index: int, context_chunks: int, pin_anchor: bool) -> list[int]:
    """The earlier chunks chunk `cur_index` continues: the last `context_chunks` of them, with chunk 0 in
    front once it has left that tail (when `pin_anchor`). E.g. context 1, pinned: 1 -> [0], 2 -> [0, 1],
    5 -> [0, 4]."""
    start = max(0, cur_index - context_chunks)
    idx = list(range(start, cur_index))
    return [0, *idx] if pin_anchor and start > 0 else idx


@dataclass
class LongFormOptions:
    """The reference's `long_form_*` request fields and their defaults."""

    long_form: bool | None = None  # None: on when the text is longer than one chunk
    chunk_chars: int = DEFAULT_CHUNK_CHARS
    window_chunks: int = DEFAULT_WINDOW_CHUNKS
    pin_anchor: bool = True
    split_mode: str = "word"

    def validate(self) -> None:
        lo, hi = CHUNK_CHARS_RANGE
        if (
            isinstance(self.chunk_chars, bool)
            or not isinstance(self.chunk_chars, int)
            or not lo <= self.chunk_chars <= hi
        ):
            raise ValueError(f"long_form_chunk_chars must be an integer in {lo}..{hi}")
        lo, hi = WINDOW_CHUNKS_RANGE
        if (
            isinstance(self.window_chunks, bool)
            or not isinstance(self.window_chunks, int)
            or not lo <= self.window_chunks <= hi
        ):
            raise ValueError(f"long_form_window_chunks must be an integer in {lo}..{hi}")
        if self.split_mode not in SPLIT_MODES:
            raise ValueError(f"long_form_split_mode must be one of {list(SPLIT_MODES)}")
        if self.long_form is not None and not isinstance(self.long_form, bool):
            raise ValueError("long_form must be true, false or null")
        if not isinstance(self.pin_anchor, bool):
            raise ValueError("long_form_pin_anchor must be true or false")

    def chunks(self, text: str) -> list[str]:
        """The chunks the reference generates `text` in: [text] itself when long form is off (or it is one
        chunk anyway)."""
        use = self.long_form if self.long_form is not None else len(text) > self.chunk_chars
        if not use:
            return [text]
        parts = split_text(text, self.chunk_chars, self.split_mode)
        return parts if len(parts) > 1 else [text]


@dataclass
class Continuation:
    """The chunks a context has generated so far, as far as later chunks need them: the pinned first chunk
    and the rolling tail (the reference's `_LongFormState` window). `add` each chunk's kept frames
    (`trim_chunk_codes`) in order; `window()` is what the next chunk continues."""

    window_chunks: int = DEFAULT_WINDOW_CHUNKS
    pin_anchor: bool = True
    index: int = 0  # chunks added so far = the index of the next chunk
    anchor_text: str = ""
    anchor_codes: np.ndarray | None = None
    tail: list[tuple[str, np.ndarray]] = field(default_factory=list)
    n_codebooks: int = N_CODEBOOKS

    def add(self, text: str, kept: np.ndarray) -> None:
        if self.index == 0 and self.pin_anchor:
            self.anchor_text, self.anchor_codes = text, np.asarray(kept)
        n = context_chunks(self.window_chunks)
        if n > 0:
            self.tail = [*self.tail, (text, np.asarray(kept))][-n:]
        self.index += 1

    def window(self, anchor: bool = True) -> tuple[str, np.ndarray]:
        """(context text, context frames [F, 9]) for the next chunk; empty frames: start fresh. anchor=False:
        without the pinned first chunk (a prompt that would not fit the context otherwise)."""
        n = context_chunks(self.window_chunks)
        pinned = anchor and self.pin_anchor and self.anchor_codes is not None and self.index > n
        parts = [(self.anchor_text, self.anchor_codes)] if pinned and self.anchor_codes is not None else []
        parts += self.tail
        text = " ".join(t for t, _ in parts)
        return text, concat_codes([c for _, c in parts], self.n_codebooks)


def concat_codes(chunks: Sequence[np.ndarray], n_codebooks: int = N_CODEBOOKS) -> np.ndarray:
    """Frames of several chunks, in order, as one [F, n_codebooks] int64 array."""
    if not chunks:
        return np.zeros((0, n_codebooks), dtype=np.int64)
    return np.concatenate([np.asarray(c, dtype=np.int64).reshape(-1, n_codebooks) for c in chunks])
