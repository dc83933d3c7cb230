"""How many new frames each dac_decoder call feeds a stream: its latency and how streams batch together."""

from __future__ import annotations

from dataclasses import dataclass

from engine.dac.codec import HOP, N_CODEBOOKS

DELAY = N_CODEBOOKS - 1  # codebook 8 of aligned frame t arrives with delayed frame t + 8

FIRST_AUDIO_FRAMES = 10  # the decoder's lag (4,757 samples, engine/dac/incremental.py) rounded up to frames
# call 0 of the default schedule: 13 x 512 - 4,757 = 1,899 samples (43 ms), enough that a client's streaming
# resampler (soxr HQ, app/io/audio_output.py) has output for it at 24, 22.05 and 16 kHz (1,701-1,854 input
# samples before its first block); a request that says what its client needs (SubmitRequest.first_samples)
# gets the first call that serves it soonest (`first_size`)
FIRST_CALL_FRAMES = 13
# a call 0 that only a client behind a codec takes: LAME, Opus and FLAC at 24 kHz write their first whole frame
# after 3,208 engine samples (app/io/audio_output.py `first_samples`): 16 x 512 - 4,757 = 3,435 brings it in call 0,
# after 24 steps, where 10 or 13 frames wait for call 1 (28 and 31 steps); it costs a third more DAC graphs
CODEC_CALL_FRAMES = 16


@dataclass(frozen=True)
class ChunkSchedule:
    """New aligned frames (512 samples, 11.6 ms) per dac_decoder call of a stream.

    The decoder decodes every frame once and exactly (engine/dac/incremental.py), whatever the call sizes:
    they only set when audio leaves and how calls batch. A call of F frames returns the stream's next
    F x 512 samples, delayed by the decoder's lag of 4,757 samples (9.3 frames), and calls batch only with
    calls of the same F (one CUDA graph per (batch bucket, F)).

    frames: new frames per call once a stream is running. All streams use the same size, so a stream's
        first call and its last ones batch with everyone's steady calls.
    first_frames: frames of call 0 when the request does not say what its client needs (None: `frames`).
        Call 0 is ready after first_frames + 8 generated frames (codebook 8 lags by 8) and emits
        first_frames x 512 - 4,757 samples.
    first_choices: further sizes of call 0 for a request that says what its client needs (`first_size`);
        each is a call size, with its own graphs (and a stream's last calls may use it).

    Default: 13 frames in call 0, then 10 per call: first audio after 21 steps (13 + 8), 1,899 samples,
    enough for a 24 or 16 kHz client's resampler, then 10 frames (116 ms) every 10 steps: a player that
    starts 150 ms after its first byte never stalls while a step takes up to 11.6 ms (real time). A request
    that says how many samples its client needs before it outputs anything gets the call 0, among the sizes
    that exist, that brings them soonest (`first_size`): 10 frames (363 samples, first audio after 18 steps)
    for a PCM client at any rate (its resampler holds back at most 128 samples), 16 (24 steps) for an MP3,
    Opus or FLAC client at 24 kHz. One steady size keeps few graph shapes per batch bucket and
    lets every ready stream share one call (a 10-frame call 0 batches with the steady calls). The final calls
    of a stream feed the frames past its end (masked) that flush the decoder: 10 after the last real frame,
    in calls of the same size.
    """

    frames: int = FIRST_AUDIO_FRAMES
    first_frames: int | None = FIRST_CALL_FRAMES
    first_choices: tuple[int, ...] = (CODEC_CALL_FRAMES,)

    def __post_init__(self) -> None:
        if self.frames <= 0 or (self.first_frames is not None and self.first_frames <= 0):
            raise ValueError("frames and first_frames must be > 0")
        if any(f <= 0 for f in self.first_choices):
            raise ValueError("first_choices must be > 0")

    def next_size(self, n_calls: int) -> int:
        """New frames of a stream's next call, given the calls it had."""
        return self.first_frames if n_calls == 0 and self.first_frames is not None else self.frames

    def first_size(self, need: int | None, lag: int) -> int:
        """Frames of call 0 for a client that outputs nothing before it has `need` samples (None: not said,
        `first_frames`), for a decoder `lag` samples behind the frames fed. Among the sizes the schedule has
        (their shapes are warmed and captured), the one whose calls bring `need` samples after the fewest
        frames (call 0 itself where it can), the smaller on a tie (it batches with the steady calls)."""
        default = self.next_size(0)
        if need is None:
            return default
        sizes = [f for f in self.call_sizes() if lag < f * HOP] or [default]

        def fed(f: int) -> int:  # frames fed by the call that brings the client `need` samples
            return f + self.frames * max(0, -(-(need + lag - f * HOP) // (self.frames * HOP)))

        return min(sizes, key=lambda f: (fed(f), f))

    def call_sizes(self) -> tuple[int, ...]:
        """Every call size (F) a stream uses (its last calls included)."""
        return tuple(sorted({self.frames, self.next_size(0), *self.first_choices}))

    def sizes(self, n: int) -> list[int]:
        """The first n call sizes (for docs/tests)."""
        return [self.next_size(i) for i in range(n)]

    @classmethod
    def low_latency(cls) -> ChunkSchedule:
        """First audio as early as the default, then 4 frames per call: audio leaves every 4 steps
        (2.5x the calls of the default, in smaller batches)."""
        return cls(frames=4, first_frames=FIRST_CALL_FRAMES, first_choices=())

    @classmethod
    def reference(cls) -> ChunkSchedule:
        """ZONOS2's TTSVocoderManager cadence, 16-frame chunks (decoded exactly here; the reference
        re-decodes 4 frames of context and cross-fades them, with audible seams)."""
        return cls(frames=16, first_frames=None, first_choices=())
