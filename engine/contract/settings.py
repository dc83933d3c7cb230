"""What the gateway tells the engine process at start: where the weights come from and how to run."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from engine.contract.cpus import current_cpus, parse_cpu_list
from engine.contract.flags import check, flag
from engine.contract.records import SEED_LIMIT


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which containers and taskset narrow): what both
    processes size their threads and workers by, never the host's count."""
    cpus = current_cpus()
    return len(cpus) if cpus is not None else os.cpu_count() or 1  # (None: not Linux)


# Decode slots when --max-batch is not given: 256 x the full context fit an H200's KV cache (84 GB); where they
# do not, the engine shortens the context rather than the slots. On a CPU, 8.
GPU_SLOTS = 256
CPU_SLOTS = 8
MAX_SLOTS = 4096  # --max-batch's ceiling (each slot holds a KV cache of the whole context)
RANDOM_PRESETS = ("tiny", "full")
BATCH_INVARIANT_MODES = ("seeded", "always", "off")
QUANTIZATION_MODES = ("none", "fp8")
CHUNK_SCHEDULES = ("default", "low_latency", "reference")  # engine/dac/schedule.py
DAC_DTYPES = ("auto", "float32", "bfloat16")
ADMISSION_MODES = ("auto", "realtime", "slots")
_MS = 60_000.0  # a minute: the ceiling of a millisecond setting
_NEVER = 1e9  # a wait (ms or s) this long never ends: the bound of the settings where that means "never"
_FRAMES = 1 << 20  # the ceiling of a frame count (hours of audio)


@dataclass(frozen=True)
class WeightSources:
    """`None` means the embedded random default of that node (tiny, deterministic: speaks noise)."""

    model_path: str | None = field(
        default=None,
        metadata=flag("ZONOS2 checkpoint dir (params.json + model.pth); default: random tiny model", metavar="DIR"),
    )
    dac_weights: str | None = field(
        default=None, metadata=flag("DAC weights_44khz_8kbps_0.0.1.pth; default: random tiny DAC", metavar="FILE")
    )
    speaker_weights: str | None = field(
        default=None, metadata=flag("ECAPA speaker encoder HF dir (config.json + model.safetensors)", metavar="DIR")
    )
    aligner_path: str | None = field(
        default=None,
        metadata=flag(
            "CTC forced aligner for word timestamps: torchaudio's MMS_FA checkpoint (model.pt, a wav2vec2 state "
            "dict); default: none (word times are estimated)",
            name="aligner",
            metavar="FILE",
        ),
    )
    random_preset: str = field(
        default="tiny",
        metadata=flag(
            "size of the random model used without --model-path (full = release size, GPU)",
            choices=RANDOM_PRESETS,
            name="random-weights",
        ),
    )
    seed: int = field(
        default=0, metadata=flag("seed of the random weights", lo=0, hi=SEED_LIMIT - 1, name="random-weights-seed")
    )

    def __post_init__(self) -> None:
        check(self)

    def check(self) -> None:
        for name, p in (
            ("model path", self.model_path),
            ("DAC weights", self.dac_weights),
            ("speaker weights", self.speaker_weights),
            ("aligner checkpoint", self.aligner_path),
        ):
            if p is not None and not Path(p).exists():
                raise FileNotFoundError(f"{name} {p} does not exist")

    def describe(self) -> dict[str, str]:
        size = "full-size" if self.random_preset == "full" else "tiny"
        out = {
            "model": self.model_path or f"random {size} ZONOS2 (seed {self.seed})",
            "dac": self.dac_weights or f"random {size} DAC",
            "speaker_encoder": self.speaker_weights or f"random {size} ECAPA",
        }
        if self.aligner_path:
            out["aligner"] = self.aligner_path
        return out


MAX_SPRINTS = 2  # first-audio sprint steps per iteration at most (the LLM node keeps host buffers for each in flight)


@dataclass
class EngineSettings:
    """Every field with `flag` metadata is a `python -m app` flag (engine/contract/flags.py), checked against
    its bounds whenever settings are built."""

    device: str = field(
        default="auto", metadata=flag("cpu, cuda, cuda:N (default: cuda if available)", metavar="DEVICE")
    )
    dac_device: str | None = field(
        default=None,
        metadata=flag("run the dac_decoder node on another device (default: with the LLM)", metavar="DEVICE"),
    )
    # the engine processes on CPUs of their own, every other process on the rest (engine/contract/cpus.py); with
    # several engines (--devices) they share the list. Unset: no pinning (its effect on storms is not measured yet)
    cpus: str | None = field(
        default=None,
        metadata=flag(
            "run the engine processes (all their threads) on these CPUs and every gateway process (and its workers) "
            "on the others this process may use: a CPU list as taskset takes it, e.g. 7 or 6-7 (several engines, "
            "--devices: they share it); default: no pinning",
            name="engine-cpus",
            metavar="LIST",
        ),
    )
    max_batch: int | None = field(
        default=None,
        metadata=flag(f"decode slots (default: {GPU_SLOTS} on a GPU, {CPU_SLOTS} on a CPU)", lo=1, hi=MAX_SLOTS),
    )
    max_context: int | None = field(
        default=None,
        metadata=flag(
            "frames per slot (prompt + audio); default: the model's max_seqlen, or what fits in free GPU memory",
            lo=1,
            hi=_FRAMES,
        ),
    )
    max_queue: int = field(
        default=64,
        metadata=flag("requests waiting for a decode slot before new ones get queue_full", lo=0, hi=1_000_000),
    )
    prefill_chunk: int = field(
        default=512,
        metadata=flag(
            "prompt frames prefilled per engine step (on a GPU at most 512, the largest captured size)",
            lo=1,
            hi=_FRAMES,
        ),
    )
    # a prompt chunk (at most 256 frames) rides along with the decode step: the weights are read once for both,
    # where a prefill call of its own reads every expert again (engine/llm/graphs.py MixedGraphs)
    mixed_prefill: bool = field(
        default=True,
        metadata=flag("prefill prompt chunks inside the decode step (GPU, CUDA graphs; seeded steps never mix)"),
    )
    # with at least prefill_group_min_streams decoding, a prefill of fewer than prefill_group_frames waits
    # up to prefill_group_wait_ms for more arrivals to share its call (0: never)
    prefill_group_wait_ms: float = field(
        default=20.0,
        metadata=flag(
            "with --prefill-group-min-streams decoding, a small prefill waits this long for others to share its "
            "call (0: never)",
            lo=0.0,
            hi=_MS,
        ),
    )
    prefill_group_min_streams: int = field(
        default=32, metadata=flag("decoding streams from which small prefills wait to be grouped", lo=0, hi=MAX_SLOTS)
    )
    prefill_group_frames: int = field(
        default=256, metadata=flag("a prefill of fewer frames than this waits to be grouped", lo=0, hi=_FRAMES)
    )
    cuda_graphs: bool = field(default=True, metadata=flag("capture the decode steps in CUDA graphs"))
    # overlap scheduling of decode steps: launch step N+1 before step N's codes are read back, so the host's
    # bookkeeping (EOS, DAC pushes, records) runs while the GPU decodes instead of between steps. Seeded output is
    # the same either way. None: on with a GPU (it shortens first audio: docs/architecture.md), off on a CPU,
    # where a launch is not asynchronous
    overlap_decode: bool | None = field(
        default=None,
        metadata=flag(
            "launch each decode step before the one before it is read back, so the host's bookkeeping overlaps "
            "the GPU (same seeded output; default: on with a GPU, off on a CPU)"
        ),
    )
    # a stream that has not sent its first audio gets this many extra decode steps of its own per iteration (a
    # small batch: the weights read again for a few rows) while the iteration, with them, stays under the admission's
    # bound (engine/runtime/admission.py `may_sprint`): its first audio comes in about half the iterations, and the
    # playing streams stay ahead of real time. Seeded output is the same. None: 1 with a GPU under realtime admission,
    # else 0
    first_audio_sprints: int | None = field(
        default=None,
        metadata=flag(
            "extra decode steps per iteration for streams that have not sent their first audio, while the iteration "
            "stays within the realtime bound (same seeded output; default: 1 with a GPU and realtime admission, "
            "else 0)",
            lo=0,
            hi=MAX_SPRINTS,
        ),
    )
    # a sprint runs only while it shortens the mean wait for first audio of the streams that wait for it by at
    # least this share (engine/runtime/admission.py `sprint_gain`): with a few streams a sprint of a few rows costs
    # nearly a whole step and would slow the newcomers it leaves out; at 128 streams it costs about half of one
    first_audio_sprint_gain: float = field(
        default=0.1,
        metadata=flag(
            "a first-audio sprint runs only while it shortens the mean wait for first audio of the streams "
            "waiting for it by at least this share",
            lo=0.0,
            hi=1.0,
        ),
    )
    compile: bool = field(
        default=True,
        metadata=flag(
            "torch.compile the decode stages on CUDA (fuses small kernels; ~1 min at start; --no-compile: "
            "a faster start)"
        ),
    )
    # which steps run the batch-invariant kernels (engine/model/batch_invariant.py): seeded: a decode step or
    # packed prefill holding a request with an explicit seed (its codes are then the same whatever else runs),
    # the default kernels otherwise; always: every step; off: none (a seed holds only for a request decoded alone)
    batch_invariant: str = field(
        default="seeded",
        metadata=flag(
            "which steps run the batch-invariant kernels. seeded (default): those holding a request with a seed, "
            "whose codes then do not depend on what else runs; other steps take the faster default kernels. "
            "always: every step. off: none (a seed holds only for a request served alone)",
            choices=BATCH_INVARIANT_MODES,
        ),
    )
    # none: experts in the model dtype (the exact default) | fp8: MoE experts quantized at load to block-scaled
    # e4m3, w8a8 kernels (engine/model/quantize.py); needs a GPU with FP8 tensor cores, refused on a CPU
    quantization: str = field(
        default="none",
        metadata=flag(
            "fp8: MoE experts quantized at load to block-scaled FP8 (half their memory and reads; a GPU with FP8 "
            "tensor cores); none: the exact bf16 model (default)",
            choices=QUANTIZATION_MODES,
        ),
    )
    chunk_schedule: str = field(
        default="default",
        metadata=flag(
            "new frames per DAC call: default (13, then 10), low_latency (13, then 4), reference (16); every "
            "schedule is exact",
            choices=CHUNK_SCHEDULES,
        ),
    )
    # float32 | bfloat16 (38-40 dB SNR vs float32 on random weights, 1.6x the audio per GPU second) |
    # auto: bfloat16 on a GPU, float32 on a CPU
    dac_dtype: str = field(
        default="auto",
        metadata=flag(
            "DAC precision (bfloat16: ~37 dB SNR vs float32, less GPU time per chunk; auto: bfloat16 on a GPU)",
            choices=DAC_DTYPES,
        ),
    )
    dac_max_batch: int = field(
        default=64, metadata=flag("streams per DAC call (each shape is a captured CUDA graph)", lo=1, hi=MAX_SLOTS)
    )
    # least recently served first: bounds the DAC work one iteration launches when many streams are ready at once
    dac_frames_per_step: int = field(
        default=1280,
        metadata=flag("new frames fed to the DAC per engine iteration (0: all that are ready)", lo=0, hi=_FRAMES),
    )
    # so calls gather into batches the GPU runs efficiently (first and final calls never wait)
    dac_min_batch: int = field(
        default=32,
        metadata=flag(
            "a steady DAC call waits (up to --dac-max-hold iterations) for this many streams to join it",
            lo=1,
            hi=MAX_SLOTS,
        ),
    )
    dac_max_hold: int = field(
        default=4, metadata=flag("iterations a steady DAC call may wait for a larger batch (0: never)", lo=0, hi=1000)
    )
    dac_max_in_flight: int = field(
        default=3, metadata=flag("DAC launches not yet landed before the engine stops launching more", lo=1, hi=64)
    )
    admission: str = field(
        default="auto",
        metadata=flag(
            "realtime: start a stream only while running ones keep real time (auto: on GPU); slots: whenever a "
            "decode slot is free",
            choices=ADMISSION_MODES,
        ),
    )
    admission_headroom: float = field(
        default=0.9,
        metadata=flag(
            "realtime admission: keep the engine iteration under this share of a frame (11.6 ms)",
            lo=0.0,
            hi=1.0,
            lo_open=True,
        ),
    )
    admission_max_wait_s: float = field(
        default=5.0,
        metadata=flag(
            "realtime admission: seconds a request may wait before engine_busy",
            lo=0.0,
            hi=3600.0,
            name="admission-max-wait",
        ),
    )
    # realtime: admit while every playing stream's slack (the audio its player, started admission_prebuffer_ms
    # after the stream's first byte, still holds when its next chunk lands) stays above this, after the prefill
    # a new stream costs (engine/runtime/admission.py). A stream that has just sent its first chunk has ~80 ms
    # of slack at ~10 ms iterations (its 43 ms of audio and its player's 150 ms prebuffer, less 11 iterations
    # to its next chunk's sending), so a much higher floor holds the door shut whenever a young stream plays
    # (docs/architecture.md)
    admission_lead_floor_ms: float = field(
        default=40.0,
        metadata=flag(
            "realtime admission: admit only while every playing stream's player will still hold this much audio "
            "(ms) when its next chunk lands",
            lo=0.0,
            hi=_NEVER,
        ),
    )
    # a stream's next chunk reaches its player this many iterations after its last frame is generated: the frames
    # read back in an iteration go to the dac_decoder in that iteration, and its calls land by the next one's start
    # (engine/runtime/scheduler.py `_step`); what admission's slack counts beyond the frames still to come
    admission_delivery_iterations: int = field(
        default=1,
        metadata=flag(
            "realtime admission: iterations from a chunk's last frame to its audio's sending, in the slack estimate",
            lo=0,
            hi=8,
        ),
    )
    admission_prebuffer_ms: float = field(
        default=150.0,
        metadata=flag(
            "realtime admission: the player model starts playing this long after a stream's first byte", lo=0.0, hi=_MS
        ),
    )
    admission_max_starting: int = field(
        default=32,
        metadata=flag(
            "realtime admission: streams admitted whose players have not started yet, or half the playing streams "
            "when that is more (slow start; >= 2: a guided request starts with its twin)",
            lo=1,
            hi=MAX_SLOTS,
        ),
    )
    outbox_bytes_per_request: int = field(
        default=32 << 20,
        metadata=flag("bytes of records one request may have waiting for the gateway", lo=1 << 16, hi=1 << 32),
    )
    # the gateway's door reads the engine's room (`admissible`) from the last record: at one a second it let in, under
    # a storm, streams that the engine's slack gate then held in its queue for up to ~400 ms (H200, 256-384 offered)
    stats_interval_s: float = field(
        default=0.1, metadata=flag("seconds between the engine's stats records", lo=0.0, hi=_NEVER, lo_open=True)
    )
    # continuation (engine/frontend/longform.py): a held stream (its chunk ended non-final, the next not here yet) is
    # flushed once it has been held continuation_grace_ms (the gateway's time to send the next chunk after the
    # kept frames) and its player (started admission_prebuffer_ms after the first byte) holds less than
    # continuation_flush_lead_ms of audio (or none of its audio has gone out yet)
    continuation_flush_lead_ms: float = field(
        default=250.0,
        metadata=flag(
            "a held stream (a sentence ended, the next not here yet) is flushed once its player holds less audio "
            "than this (below 0: never) ...",
            lo=-_NEVER,
            hi=_NEVER,
        ),
    )
    continuation_grace_ms: float = field(
        default=40.0,
        metadata=flag(
            "... and it has been held this long (the time the next sentence has to arrive)", lo=0.0, hi=_NEVER
        ),
    )

    def __post_init__(self) -> None:
        check(self)
        if self.cpus is not None:
            parse_cpu_list(self.cpus)  # its syntax; whether the CPUs are this process's: split_cpus, at start

    @property
    def cpu_set(self) -> frozenset[int] | None:
        """--engine-cpus' CPUs, None when unset (no pinning)."""
        return None if self.cpus is None else parse_cpu_list(self.cpus)


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
