"""The aligner node: word times of finished utterances, batched, on its own thread and CUDA stream.

Like the speaker_encoder (engine/speaker/worker.py), the engine loop only hands work over (`submit`) and polls
for what is done (`results`); the thread takes every utterance queued by the time it is free and what arrives
within `gather_s` of the first one (at most `max_batch`, `max_batch_s` of audio in all), resamples each to 16 kHz
(soxr), runs one padded forward over the batch, then one batched Viterbi and its backtrack on the device
(engine/aligner/align.py), so the decode loop never waits for it. Its stream has
the lowest priority: where the decode step and the aligner both have work queued, the step's blocks go first.

Why gather: a forward is ~450 eager launches whatever its batch, and each launch hands the interpreter's lock
back and forth with the engine loop (which shares it). Word times follow an utterance's audio (nobody plays
them), so waiting a few hundred milliseconds to align ten utterances in one forward costs the listener nothing
and the decode loop a tenth of the hand-offs.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import soxr
import torch

from engine.aligner.align import Tokens, min_frames, tokenize, viterbi, word_times
from engine.aligner.model import SAMPLE_RATE, Wav2Vec2Aligner, frames_for
from engine.contract.constants import ALIGN_WAIT_S

log = logging.getLogger(__name__)

MAX_AUDIO_S = 120.0  # one utterance's audio at most (a sentence is seconds; attention is quadratic in it)
MAX_BATCH = 16  # utterances per forward
MAX_BATCH_S = 240.0  # audio per forward, padding included
GATHER_S = 0.3  # how long a batch waits for more utterances after its first arrived (module docstring)
MAX_QUEUED_S = 600.0  # audio waiting to be aligned at most: past it a new utterance is refused (AlignerBehind)
Words = list[tuple[str, float, float]]


def _rate_ok(sample_rate: object) -> bool:
    return not isinstance(sample_rate, bool) and isinstance(sample_rate, int) and 8000 <= sample_rate <= 192000


def _queued_s(pcm: np.ndarray, sample_rate: int) -> float:
    """An utterance's seconds in the queue's count (a bad sample rate is its own error later, in `prepare`)."""
    return len(pcm) / sample_rate if _rate_ok(sample_rate) else 0.0


class AlignerBehind(RuntimeError):
    """The aligner is behind: its queue is full, or an utterance waited in it longer than ALIGN_WAIT_S (its
    words would come after the gateway stopped waiting for them)."""


@dataclass
class _Item:
    key: Any
    pcm: np.ndarray
    sample_rate: int
    text: str
    at: float = 0.0  # when it was submitted (time.monotonic)


class Aligner:
    """The model and the steps around it: audio + text -> word times, a batch at a time."""

    def __init__(self, model: Wav2Vec2Aligner) -> None:
        self.model = model
        self.device = next(model.parameters()).device

    @staticmethod
    def prepare(pcm: np.ndarray, sample_rate: int, text: str) -> tuple[np.ndarray, Tokens]:
        """16 kHz float32 audio and the text's tokens; ValueError for what cannot be aligned."""
        if not _rate_ok(sample_rate):
            raise ValueError(f"sample rate must be an integer in 8000..192000 Hz, not {sample_rate!r}")
        x = np.asarray(pcm)
        if x.ndim != 1:
            raise ValueError("the audio must be mono ([samples])")
        x = x.astype(np.float32) / 32768.0 if x.dtype == np.int16 else x.astype(np.float32)
        if not np.isfinite(x).all():
            raise ValueError("the audio holds a NaN or an infinity")
        if len(x) > MAX_AUDIO_S * sample_rate:
            raise ValueError(f"the audio is longer than {MAX_AUDIO_S:g} s")
        tok = tokenize(text)
        wav = soxr.resample(x, sample_rate, SAMPLE_RATE) if sample_rate != SAMPLE_RATE else x
        wav = wav[: len(x) * SAMPLE_RATE // sample_rate]  # soxr rounds its length up: no word may end past the audio
        frames = int(frames_for(torch.tensor(len(wav))))
        if frames < min_frames(tok.tokens):
            raise ValueError(
                f"{len(x) / sample_rate:.2f} s of audio ({frames} frames) is too short for the text's "
                f"{len(tok.tokens)} letters"
            )
        return np.ascontiguousarray(wav, dtype=np.float32), tok

    @torch.inference_mode()
    def align(self, batch: list[tuple[np.ndarray, Tokens]]) -> list[Words]:
        """Word times of prepared utterances, in one forward and one Viterbi."""
        lengths = torch.tensor([len(w) for w, _ in batch])
        wav = torch.zeros(len(batch), int(lengths.max()))
        for i, (w, _) in enumerate(batch):
            wav[i, : len(w)] = torch.from_numpy(w)
        wav = wav.to(self.device, non_blocking=True)
        logp, frames = self.model(wav, lengths.to(self.device))
        states = viterbi(logp, frames, [tok.tokens for _, tok in batch])
        return [word_times(tok, s, len(w) / SAMPLE_RATE) for (w, tok), s in zip(batch, states, strict=True)]


class AlignerWorker:
    def __init__(
        self,
        aligner: Aligner,
        max_batch: int = MAX_BATCH,
        max_batch_s: float = MAX_BATCH_S,
        gather_s: float = GATHER_S,
    ) -> None:
        self.aligner = aligner
        self.max_batch, self.max_batch_s, self.gather_s = max_batch, max_batch_s, gather_s
        self._todo: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._done: deque[tuple[Any, Words | None, Exception | None]] = deque()
        self._lock = threading.Lock()
        self._queued_s = 0.0  # audio submitted and not yet taken
        self.batches = 0  # forwards run (the tests see batching in it)
        self._thread = threading.Thread(target=self._run, name="aligner", daemon=True)
        self._thread.start()

    def submit(self, key: Any, pcm: np.ndarray, sample_rate: int, text: str) -> None:
        """Align `text` to `pcm`; its (key, words, error) comes out of `results` later. AlignerBehind when
        MAX_QUEUED_S of audio waits already."""
        seconds = _queued_s(pcm, sample_rate)
        with self._lock:
            if self._queued_s + seconds > MAX_QUEUED_S:
                raise AlignerBehind(f"the aligner is behind ({self._queued_s:.0f} s of audio waiting)")
            self._queued_s += seconds
        self._todo.put(_Item(key, pcm, sample_rate, text, time.monotonic()))

    def results(self) -> list[tuple[Any, Words | None, Exception | None]]:
        """Finished utterances since the last call: (key, [(word, start_s, end_s)] or None, error or None)."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def close(self) -> None:
        self._todo.put(None)

    def _take(self, first: _Item) -> tuple[list[_Item], bool]:
        """`first` and what else is queued now or until `gather_s` after `first` was submitted, within the batch
        bounds; whether close was asked."""
        items, audio_s = [first], len(first.pcm) / max(1, first.sample_rate)
        until = first.at + self.gather_s
        while len(items) < self.max_batch:
            try:
                item = self._todo.get(timeout=max(0.0, until - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                return items, True
            items.append(item)
            audio_s = max(audio_s, len(item.pcm) / max(1, item.sample_rate))
            if audio_s * len(items) >= self.max_batch_s:
                break
        return items, False

    def _run(self) -> None:
        device = self.aligner.device
        stream = torch.cuda.Stream(device, priority=0) if device.type == "cuda" else None
        closing = False
        while not closing and (first := self._todo.get()) is not None:
            items, closing = self._take(first)
            with self._lock:
                self._queued_s = max(0.0, self._queued_s - sum(_queued_s(i.pcm, i.sample_rate) for i in items))
            ready: list[tuple[_Item, np.ndarray, Tokens]] = []
            now = time.monotonic()
            for item in items:
                if now - item.at > ALIGN_WAIT_S:  # nobody waits for these words any more
                    self._done.append((item.key, None, AlignerBehind(f"waited {now - item.at:.0f} s to be aligned")))
                    continue
                try:
                    wav, tok = Aligner.prepare(item.pcm, item.sample_rate, item.text)
                    ready.append((item, wav, tok))
                except ValueError as e:  # this utterance cannot be aligned: its own error, not the batch's
                    self._done.append((item.key, None, e))
            if not ready:
                continue
            try:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        words = self.aligner.align([(w, t) for _, w, t in ready])
                else:
                    words = self.aligner.align([(w, t) for _, w, t in ready])
                self.batches += 1
                self._done.extend((item.key, w, None) for (item, _, _), w in zip(ready, words, strict=True))
            except Exception as e:  # a bug (or out of memory): these utterances fail, not the engine
                log.exception("aligner failed on a batch of %d", len(ready))
                self._done.extend((item.key, None, e) for item, _, _ in ready)
