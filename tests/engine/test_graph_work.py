"""The work the CUDA graphs capture, run eagerly on the CPU: DecodeGraphs (each row's input gathered on the
device from its slot's last sampled frame, a batch padded to its bucket with the scratch slot) and
PrefillGraphs (packed prompts padded to a token bucket, speaker rows, emotion deltas as a fixed-shape input)
give the codes the plain path gives. The GPU tests replay the captured graphs (tests/gpu/test_gpu.py); this
checks what goes into them wherever the suite runs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

# The packed prefill's attention is a Triton kernel: Triton's interpreter, on a CPU only. Where the suite has a
# GPU (no interpreter: these CPU tensors would take the plain PyTorch path, whose matmuls differ with the row
# count) tests/gpu/test_gpu.py replays the captured graphs themselves instead (pytestmark below).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.contract.records import SamplingParams
from engine.frontend.prompt import Conditioning, PromptBuilder
from engine.llm.graphs import DecodeGraphs, PrefillGraphs
from engine.llm.node import LLMNode, Sequence
from engine.model.checkpoint import random_model

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CPU check; on a GPU tests/gpu/test_gpu.py replays the captured graphs"
)

TEXTS = ["One short line.", "A second, somewhat longer line of text.", "Three.", "And a fourth one here."]
FRAMES = [14, 9, 5, 12]  # the batch shrinks as they end: 4 rows, then 3 (padded to the bucket of 4), 2, 1


def run(node: LLMNode, model, overlap: bool = False) -> dict[int, np.ndarray]:
    pb = PromptBuilder(model.cfg)
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i, (text, frames) in enumerate(zip(TEXTS, FRAMES, strict=True)):
        voice = i % 2 == 0
        seqs.append(
            Sequence(
                rid=i + 1,
                prompt=pb.build(text, Conditioning(speaker=voice)),
                params=SamplingParams(seed=20 + i, temperature=0.9),
                max_frames=frames,
                ignore_eos=True,
                speaker=torch.randn(model.cfg.speaker_embedding_dim, generator=gen) if voice else None,
                emotion=torch.randn(model.cfg.dim, generator=gen) if i == 2 else None,
            )
        )
    out: dict[int, list[np.ndarray]] = {s.rid: [] for s in seqs}
    for s in seqs:
        node.admit(s)
    for s, c in node.prefill([(s, s.prompt_len) for s in seqs]):
        out[s.rid].append(c)
    pending = None
    while True:
        live = [s for s in seqs if s.finish_reason is None and node.wants_step(s)]
        launched = node.decode_start(live) if live else None
        if pending is not None:  # overlap: the step before is read back while the next one is launched
            for s, c in node.decode_finish(pending):
                out[s.rid].append(c)
        pending = launched
        if not overlap and pending is not None:
            for s, c in node.decode_finish(pending):
                out[s.rid].append(c)
            pending = None
        if launched is None and pending is None:
            break
    return {rid: np.stack(c) for rid, c in out.items()}


def graphed_node(model) -> LLMNode:
    """A node whose decode and prefill go through DecodeGraphs / PrefillGraphs, not captured."""
    node = LLMNode(model, n_slots=4, cuda_graphs=False)
    node.graphs = DecodeGraphs(
        model, node.sampler, scratch_slot=node.n_slots, max_batch=node.n_slots, kernel_sets=node.kernel_sets
    )
    node.prefill_graphs = PrefillGraphs(model, scratch_slot=node.n_slots, kernel_sets=node.kernel_sets)
    return node


def plain_node(model) -> LLMNode:
    # the batch-invariant kernels on both sides: padding a batch to its bucket changes nothing by design
    # (tests/engine/test_batch_invariance.py), so the codes must be equal, not close
    return LLMNode(model, n_slots=4, cuda_graphs=False)


@pytest.mark.slow
def test_the_captured_work_run_eagerly_equals_the_plain_path():
    model = random_model("tiny", seed=3)
    plain = run(plain_node(model), model)
    node = graphed_node(model)
    graphed = run(node, model)
    assert {rid: len(c) for rid, c in graphed.items()} == dict(enumerate(FRAMES, 1))
    for rid in plain:
        assert np.array_equal(plain[rid], graphed[rid]), rid
    assert node.graphs.bucket(3) == 4  # the 3-row steps ran padded to the bucket of 4


@pytest.mark.slow
def test_the_captured_work_with_overlap_equals_the_plain_path():
    model = random_model("tiny", seed=3)
    plain = run(plain_node(model), model)
    overlapped = run(graphed_node(model), model, overlap=True)
    for rid in plain:
        assert np.array_equal(plain[rid], overlapped[rid]), rid
