"""What the gateway tells the engine process at start: where the weights come from and how to run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WeightSources:
    """`None` means the embedded random default of that node (tiny, deterministic: speaks noise)."""

    model_path: str | None = None  # dir with params.json + model.pth / model.safetensors
    dac_weights: str | None = None  # weights_44khz_8kbps_0.0.1.pth
    speaker_weights: str | None = None  # HF dir: config.json + model.safetensors
    random_preset: str = "tiny"  # for the LLM when model_path is None: tiny | full
    seed: int = 0

    def check(self) -> None:
        for name, p in (("model path", self.model_path), ("DAC weights", self.dac_weights),
                        ("speaker weights", self.speaker_weights)):
            if p is not None and not Path(p).exists():
                raise FileNotFoundError(f"{name} {p} does not exist")

    def describe(self) -> dict[str, str]:
        size = "full-size" if self.random_preset == "full" else "tiny"
        return {
            "model": self.model_path or f"random {size} ZONOS2 (seed {self.seed})",
            "dac": self.dac_weights or f"random {size} DAC",
            "speaker_encoder": self.speaker_weights or f"random {size} ECAPA",
        }


BATCH_INVARIANT_MODES = ("seeded", "always", "off")


@dataclass
class EngineSettings:
    device: str = "auto"  # cpu | cuda | cuda:N
    dac_device: str | None = None  # place the dac_decoder elsewhere (default: with the LLM)
    max_batch: int | None = None  # decode slots (None: 256 on a GPU, 8 on a CPU)
    max_context: int | None = None  # frames per slot (prompt + audio); default: the model's max_seqlen
    max_queue: int = 64  # requests waiting for a slot before new ones are refused
    prefill_chunk: int = 512  # prompt frames per loop iteration (bounds one iteration's prefill time)
    # with at least prefill_group_min_streams decoding, a prefill of fewer than prefill_group_frames waits
    # up to prefill_group_wait_ms for more arrivals to share its call (0: never)
    prefill_group_wait_ms: float = 20.0
    prefill_group_min_streams: int = 32
    prefill_group_frames: int = 256
    cuda_graphs: bool = True
    # overlap scheduling of decode steps: launch step N+1 before step N's codes are read back, so the host's
    # bookkeeping (EOS, DAC pushes, records) runs while the GPU decodes instead of between steps. Seeded output is
    # the same either way. None: on with a GPU (it shortens first audio: docs/architecture.md), off on a CPU,
    # where a launch is not asynchronous
    overlap_decode: bool | None = None
    compile: bool = True  # torch.compile the decode stages on CUDA (fuses small kernels; ~1 min at start)
    # which steps run the batch-invariant kernels (engine/model/batch_invariant.py), one of BATCH_INVARIANT_MODES:
    # seeded: a decode step or packed prefill holding a request with an explicit seed (its codes are then the
    # same whatever else runs), the default kernels otherwise; always: every step; off: none (a seed holds
    # only for a request decoded alone)
    batch_invariant: str = "seeded"
    # none: experts in the model dtype (the exact default) | fp8: MoE experts quantized at load to block-scaled
    # e4m3, w8a8 kernels (engine/model/quantize.py); needs a GPU with FP8 tensor cores, refused on a CPU
    quantization: str = "none"
    # new frames per dac_decoder call (engine/dac/schedule.py; every schedule is exact): default (13, then 10)
    # | low_latency (13, then 4) | reference (16)
    chunk_schedule: str = "default"
    # float32 | bfloat16 (38-40 dB SNR vs float32 on random weights, 1.6x the audio per GPU second) |
    # auto: bfloat16 on a GPU, float32 on a CPU
    dac_dtype: str = "auto"
    dac_max_batch: int = 64  # streams per DAC call (each (batch, frames) shape is captured in a graph)
    # new frames the DAC is fed per iteration (0: all that are ready), least recently served first: bounds
    # the DAC work one iteration launches when many streams are ready at once
    dac_frames_per_step: int = 1280
    # a stream's steady DAC call waits up to dac_max_hold iterations while fewer than dac_min_batch streams
    # have one ready, so calls gather into batches the GPU runs efficiently (first and final calls never wait)
    dac_min_batch: int = 32
    dac_max_hold: int = 4
    dac_max_in_flight: int = 3  # DAC launches not yet landed before the engine stops launching more
    admission: str = "auto"  # realtime (protect live streams) | slots (a free slot is enough) | auto: realtime on GPU
    admission_headroom: float = 0.9  # realtime: admit while the predicted iteration period stays under 0.9 x 11.6 ms
    admission_max_wait_s: float = 5.0  # realtime: a request waiting longer is refused with engine_busy
    # realtime: admit while every playing stream's slack (the audio its player, started admission_prebuffer_ms
    # after the stream's first byte, still holds when its next chunk lands) stays above this, after the prefill
    # a new stream costs (engine/runtime/admission.py). A stream that has just sent its first chunk has ~70 ms
    # of slack at ~10 ms iterations (its 43 ms of audio and its player's 150 ms prebuffer, less 12 iterations
    # to its next chunk), so a higher floor holds the door shut whenever a young stream plays
    # (docs/architecture.md)
    admission_lead_floor_ms: float = 40.0
    admission_prebuffer_ms: float = 150.0
    # realtime: streams admitted whose players have not started yet (slow start: their cost is not seen yet)
    admission_max_starting: int = 32
    outbox_bytes_per_request: int = 32 << 20
    stats_interval_s: float = 1.0
    # continuation (engine/frontend/longform.py): a held stream (its chunk ended non-final, the next not here yet) is
    # flushed once it has been held continuation_grace_ms (the gateway's time to send the next chunk after the
    # kept frames) and its player (started admission_prebuffer_ms after the first byte) holds less than
    # continuation_flush_lead_ms of audio (or none of its audio has gone out yet)
    continuation_flush_lead_ms: float = 250.0
    continuation_grace_ms: float = 40.0


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use, found without importing torch (the gateway never does): the
    driver's device list, narrowed by CUDA_VISIBLE_DEVICES as CUDA would narrow it."""
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = Path("/proc/driver/nvidia/gpus")
    present = len(list(gpus.iterdir())) if gpus.is_dir() else 0
    if visible is None:
        return present
    entries = [v.strip() for v in visible.split(",")]
    count = 0
    for v in entries:  # CUDA stops at the first entry that names no device
        if not v or v.startswith("-") or (v.isdigit() and int(v) >= present):
            break
        count += 1
    return count
