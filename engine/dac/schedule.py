"""When the dac_decoder cuts chunks and how much it re-decodes (the stream's latency and its seams)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.dac.codec import N_CODEBOOKS

log = logging.getLogger(__name__)

DELAY = N_CODEBOOKS - 1  # codebook 8 of aligned frame t arrives with delayed frame t + 8


RF_FRAMES = 9  # DAC-44k decoder receptive field, each side, in frames (measured: exact beyond 9)


@dataclass(frozen=True)
class ChunkSchedule:
    """When to cut chunks and how much to re-decode, in aligned frames (512 samples, 11.6 ms).

    first_chunk_frames: size of chunk 0; it is ready after first_chunk_frames + 8 generated
        frames and emits first_chunk_frames - holdback of them (time to first audio).
    chunk_frames: cap on later chunk sizes. Chunk i+1 has min(chunk_frames, max(first // 2,
        pace * frames emitted so far)) frames, so a chunk never brings more than pace x the audio
        the client already holds. With pace 0.5 a player that starts 150 ms after its first byte
        never stalls while a step takes up to ~10 ms (the generator at >= 1.16x real time); pace 1
        stalled from 9 ms and 64-frame chunks from 8 ms (a model of the player; the load where it
        matters is the live-capacity benchmark's). Sizes depend on the schedule only, so requests
        stay in step and batch together.
    context_frames: already-decoded frames re-fed to DAC before each chunk (left context; the
        held-back frames are part of it). Left edge effects vanish at holdback + 9.
    overlap_frames: raised-cosine cross-fade between held-back audio and its re-decode.
    lookahead_frames: frames held back at the end of each non-final chunk, whose decode lacked
        right context; the next chunk re-decodes them. None = overlap_frames (the reference's
        rule). Each frame costs one generation step of latency.

    Default (`.exact` is True): hold back 9 frames with 18 of context and no cross-fade, so the
    stream equals a one-shot decode up to float rounding (~-120 dB in fp32 on CPU; on GPU the
    rounding floor is TF32 convs ~-63 dB, bf16 ~-38 dB). Chunk sizes 12, 6, 6, 7, 11, 16, 24, 32...;
    first audio after 20 steps (3 frames). `low_latency()` holds back 4: first audio after 16
    steps, but the worst seam frame is only ~10-12 dB below the signal (bench/dac_seams.py).
    """

    first_chunk_frames: int = 12
    chunk_frames: int = 32
    context_frames: int = 2 * RF_FRAMES
    overlap_frames: int = 0
    lookahead_frames: int | None = RF_FRAMES
    pace: float = 0.5

    def __post_init__(self) -> None:
        if self.first_chunk_frames <= 0 or self.chunk_frames <= 0:
            raise ValueError("first_chunk_frames and chunk_frames must be > 0")
        if self.overlap_frames < 0 or self.pace <= 0:
            raise ValueError("overlap_frames must be >= 0 and pace > 0")
        if self.holdback < self.overlap_frames:
            raise ValueError("lookahead_frames must be >= overlap_frames (the fade uses held-back audio)")
        if self.context_frames < self.holdback:
            raise ValueError("context_frames must be >= lookahead_frames (held-back frames are re-decoded)")
        if self.first_chunk_frames <= self.holdback:
            log.warning(
                "ChunkSchedule: first_chunk_frames %d <= holdback %d: chunk 0 emits no audio",
                self.first_chunk_frames, self.holdback,
            )

    @property
    def holdback(self) -> int:
        return self.overlap_frames if self.lookahead_frames is None else self.lookahead_frames

    @property
    def exact(self) -> bool:
        """True if streaming reproduces one-shot decoding (no seam error at all)."""
        return self.holdback >= RF_FRAMES + self.overlap_frames and self.context_frames >= self.holdback + RF_FRAMES

    def next_size(self, n_chunks: int, decoded: int) -> int:
        """Size of the next chunk, given the chunks/aligned frames already cut."""
        if n_chunks == 0:
            return self.first_chunk_frames
        emitted = max(0, decoded - self.holdback)
        return max(1, min(self.chunk_frames, max(self.first_chunk_frames // 2, int(self.pace * emitted))))

    def input_lengths(self, n: int = 16) -> list[int]:
        """DAC input lengths (context included) of the first n non-final chunks."""
        out, planned = [], 0
        for i in range(n):
            size = self.next_size(i, planned)
            out.append(planned + size - max(0, planned - self.context_frames))
            planned += size
        return out

    def length_buckets(self, quantum: int = 16) -> list[int]:
        """Input lengths chunks are rounded up to (by extending their left context where the
        history allows): the non-final lengths plus multiples of `quantum` up to the longest final
        chunk that follows the schedule (a chunk's worth, the 8 frames that complete at the end, and
        context); beyond, multiples of 64."""
        longest_final = self.context_frames + self.chunk_frames + DELAY
        top = max(64, *self.input_lengths(), -(-longest_final // quantum) * quantum)
        return sorted(set(self.input_lengths()) | set(range(quantum, top + 1, quantum)))

    def sizes(self, n: int) -> list[int]:
        """The first n chunk sizes (for docs/tests)."""
        out: list[int] = []
        for i in range(n):
            out.append(self.next_size(i, sum(out)))
        return out

    @classmethod
    def low_latency(cls) -> ChunkSchedule:
        """First audio 4 steps earlier than the default, at the cost of small seam errors."""
        return cls(first_chunk_frames=8, chunk_frames=32, context_frames=16, overlap_frames=4, lookahead_frames=None,
                   pace=1.0)

    @classmethod
    def reference(cls) -> ChunkSchedule:
        """ZONOS2's TTSVocoderManager: 16-frame chunks, 4 frames of context = overlap."""
        return cls(first_chunk_frames=16, chunk_frames=16, context_frames=4, overlap_frames=4,
                   lookahead_frames=None, pace=1e9)
