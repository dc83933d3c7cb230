"""The engine: owns the device and builds the nodes (LLM, dac_decoder, speaker_encoder, and the aligner when
--aligner names a checkpoint).

It loads each node's weights, chooses the DAC's dtype, makes the CUDA streams, captures the graphs and
warms every path once, so that the scheduler (engine/runtime/scheduler.py) only batches, admits and moves
records between the rings and the nodes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import Any

import numpy as np
import torch

from engine.aligner.worker import Aligner, AlignerWorker
from engine.contract.collector import freeze_startup_heap, log_long_pauses
from engine.contract.cpus import affinity_text
from engine.contract.settings import CHUNK_SCHEDULES, CPU_SLOTS, GPU_SLOTS, EngineSettings, WeightSources
from engine.dac.schedule import ChunkSchedule
from engine.dac.streaming import StreamingDecoder
from engine.llm.node import LLMNode, Sequence
from engine.offline import run_sequence
from engine.speaker.worker import SpeakerWorker
from engine.weights import load_aligner, load_codec, load_model, load_speaker_encoder

log = logging.getLogger("engine")

DAC_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SCHEDULES = {"default": ChunkSchedule, "low_latency": ChunkSchedule.low_latency, "reference": ChunkSchedule.reference}
assert tuple(SCHEDULES) == CHUNK_SCHEDULES  # the flag's choices


class Engine:
    """The nodes of one device, built and warmed. `llm_stream()` / `dac_stream()` are the CUDA streams
    each node's work runs on (no-ops on a CPU)."""

    def __init__(self, src: WeightSources, settings: EngineSettings) -> None:
        t0 = time.perf_counter()
        self.src = src
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.on_gpu = self.device.startswith("cuda")
        from engine.model.quantize import check_mode

        check_mode(settings.quantization, self.device)  # before minutes of loading: fp8 needs FP8 tensor cores
        model = load_model(src, self.device, quantization=settings.quantization)
        slots = settings.max_batch or (GPU_SLOTS if self.on_gpu else CPU_SLOTS)
        max_context = settings.max_context or kv_frames_that_fit(model, slots + 1)
        self.llm = LLMNode(
            model,
            slots,
            max_context,
            settings.cuda_graphs,
            settings.compile,
            batch_invariant=settings.batch_invariant,
            mixed=settings.mixed_prefill,
        )
        self.dac_device = settings.dac_device or self.device
        dtype = (
            settings.dac_dtype
            if settings.dac_dtype != "auto"
            else ("bfloat16" if self.dac_device.startswith("cuda") else "float32")
        )
        self.codec = load_codec(src, self.dac_device, DAC_DTYPES[dtype])
        # twice the LLM's slots: a stream keeps its DAC slot while its last audio is decoded after generation
        self.dac = StreamingDecoder(self.codec, SCHEDULES[settings.chunk_schedule](), slots=2 * slots)
        self.speaker_encoder = load_speaker_encoder(src, self.device)
        self.speaker = SpeakerWorker(self.speaker_encoder)
        aligner_model = load_aligner(src, self.device)  # the fourth node, only with --aligner
        self.aligner = AlignerWorker(Aligner(aligner_model)) if aligner_model is not None else None
        # The dac_decoder runs in the scheduler's thread on its own CUDA stream: its calls are graph replays
        # that return at once, and their PCM is collected on a later iteration, so the LLM never waits for
        # audio. The LLM's stream has the higher priority: where both have work queued, the decode step's
        # blocks are scheduled first. (A separate Python thread convoys on the GIL behind the loop.)
        self._dac_stream = torch.cuda.Stream(self.codec.device) if self.codec.device.type == "cuda" else None
        self._llm_stream = torch.cuda.Stream(self.device, priority=-1) if self.on_gpu else None
        # the loop waits for each decode step with the GIL released; when the step is done it must get the
        # GIL back from the speaker_encoder thread at once, not after the default 5 ms switch interval
        sys.setswitchinterval(2e-4)
        self.load_s = time.perf_counter() - t0

    def llm_stream(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self._llm_stream) if self._llm_stream is not None else contextlib.nullcontext()

    def dac_stream(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self._dac_stream) if self._dac_stream is not None else contextlib.nullcontext()

    def warmup(self) -> float:
        """One short request through every node, the DAC's shapes planned and captured, so that first
        traffic pays no lazy-init cost. Returns the seconds it took."""
        t0 = time.perf_counter()
        from engine.contract.records import SamplingParams
        from engine.frontend.prompt import PromptBuilder

        prompt = PromptBuilder(self.llm.cfg).build("warm up")
        if len(self.llm.kernel_sets) > 1:  # an unseeded request runs the default kernels, a seeded one the other set
            run_sequence(self.llm, Sequence(rid=-1, prompt=prompt, params=SamplingParams(), max_frames=8))
        seq = Sequence(rid=-1, prompt=prompt, params=SamplingParams(seed=0), max_frames=40, ignore_eos=True)
        frames = run_sequence(self.llm, seq)
        self.dac.open(-1)
        self.dac.push(-1, frames)
        self.dac.finish(-1, None)
        while self.dac.pending():
            self.dac.step()
        if self._dac_stream is not None:  # cuDNN plans (and graphs) for every chunk shape now, not on a request
            with self.dac_stream():
                n = self.dac.warmup(max_batch=self.settings.dac_max_batch)
                if self.settings.cuda_graphs:
                    self.dac.capture(max_batch=self.settings.dac_max_batch)
            log.info("dac_decoder warmed %d chunk shapes%s", n, " and captured them" if self.dac.graphs else "")
        clip = np.random.default_rng(0).normal(0, 0.1, 24000).astype(np.float32)
        self.speaker_encoder.embed(clip, 24000)
        if self.aligner is not None:
            pcm = (clip[:16000] * 32767).astype(np.int16)
            self.aligner.aligner.align([Aligner.prepare(pcm, 16000, "warm up")])
        self.sync()
        # everything built so far (modules, compiled graphs) lives as long as the process: keep it out of
        # the cyclic collector, whose full passes over it paused every stream for hundreds of ms
        freeze_startup_heap()
        log_long_pauses(log)
        return time.perf_counter() - t0

    def sync(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize()

    def describe(self) -> dict[str, Any]:
        """What the engine runs, for its `ready` record."""
        return {
            "device": self.device,
            "dac_device": self.dac_device,
            "slots": self.llm.n_slots,
            "max_context": self.llm.max_len,
            "load_s": round(self.load_s, 3),
            "quantization": self.settings.quantization,
            "weights": self.src.describe(),
            "speaker_dim": self.llm.cfg.speaker_embedding_dim,
            "pid": os.getpid(),
            "aligner": self.aligner is not None,
            "cpus": affinity_text(),
        }


def resolve_device(device: str) -> str:
    """`auto` is a GPU when this process sees one."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def kv_frames_that_fit(model: Any, slots: int, reserve_bytes: int = 16 << 30) -> int | None:
    """Frames per slot of a KV cache sized from free GPU memory: the model's max_seqlen when it fits,
    else what `slots` slots can hold once `reserve_bytes` are kept back (DAC graphs, activations,
    prefill). None on a CPU (the model's own limit)."""
    dev = model.multi_output.weight.device
    if dev.type != "cuda":
        return None
    cfg = model.cfg
    per_frame = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * model.multi_output.weight.element_size()
    free, _ = torch.cuda.mem_get_info(dev)
    fit = int(max(0, free - reserve_bytes) // (slots * per_frame))
    if fit >= cfg.max_seqlen:
        return None
    if fit < 256:
        raise RuntimeError(f"{slots} KV slots do not fit in {free / 2**30:.1f} GiB free: lower --max-batch")
    log.warning("KV cache: %d frames per slot fit in free memory (model max %d)", fit, cfg.max_seqlen)
    return fit
