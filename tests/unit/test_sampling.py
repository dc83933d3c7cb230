"""Per-request sampling: semantics against a plain per-row implementation of the reference's order,
independence of requests sharing a batch, and the counter-based random stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.contract.records import (
    HISTORY,
    REPETITION_PENALTY_MAX,
    SEED_LIMIT,
    TEMPERATURE_MAX,
    TOP_K_MAX,
    SamplingParams,
)
from engine.llm.sampling import SamplerState

V, C = 1026, 9


def reference_probs(logits: np.ndarray, history: list[np.ndarray], p: SamplingParams) -> np.ndarray:
    """Spec §6, one request, row by row: rep penalty -> temperature -> top-k -> softmax -> top-p -> min-p."""
    out = np.zeros_like(logits, dtype=np.float64)
    window = history[-p.repetition_window :] if p.repetition_window else []
    n_rep = C if p.repetition_codebooks < 0 else p.repetition_codebooks
    for c in range(C):
        x = logits[c].astype(np.float64).copy()
        if c < n_rep:
            seen = {int(f[c]) for f in window if f[c] < 1024}
            for t in seen:
                x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x = x / max(p.temperature, 1e-6)
        k = p.top_k if p.top_k >= 1 else 1024
        kth = np.sort(x)[::-1][min(k, V) - 1]
        x[x < kth] = -np.inf
        prob = np.exp(x - x.max())
        prob /= prob.sum()
        if 0 < p.top_p < 1:
            order = np.argsort(-prob, kind="stable")
            cum = np.cumsum(prob[order])
            remove = cum - prob[order] > p.top_p
            prob[order[remove]] = 0
            prob /= prob.sum()
        if p.min_p > 0:
            prob[prob < p.min_p * prob.max()] = 0
            prob /= prob.sum()
        out[c] = prob
    return out


def probs_of(filtered: torch.Tensor) -> np.ndarray:
    return torch.softmax(filtered.double(), dim=-1).numpy()


PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_k=5, min_p=0.0, repetition_window=3, repetition_penalty=2.0),
    SamplingParams(temperature=1.3, top_k=0, top_p=0.9, min_p=0.05, repetition_codebooks=-1),
    SamplingParams(temperature=1.0, top_k=TOP_K_MAX, top_p=0.5, min_p=0.0, repetition_window=0),
]


def test_filtered_distribution_matches_reference_per_request():
    """Four requests with different settings in ONE batch each get exactly their own distribution."""
    rng = np.random.default_rng(0)
    state = SamplerState(n_slots=6, n_codebooks=C, vocab=V, device="cpu")
    slots = torch.tensor([5, 0, 3, 1])
    histories: list[list[np.ndarray]] = [[] for _ in PARAMS]
    for i, p in enumerate(PARAMS):
        state.admit(int(slots[i]), p, seed=i)
    for _step in range(6):
        logits = torch.from_numpy(rng.normal(0, 3, size=(len(PARAMS), C, V)).astype(np.float32))
        # make repeats likely so the penalty matters
        logits[:, :, :4] += 6
        got = probs_of(state.filtered_logits(logits, slots))
        for i, p in enumerate(PARAMS):
            want = reference_probs(logits[i].numpy(), histories[i], p)
            assert np.allclose(got[i], want, atol=1e-5), (i, np.abs(got[i] - want).max())
        codes = state.sample(logits, slots)
        for i in range(len(PARAMS)):
            histories[i].append(codes[i].numpy())


def test_seeded_request_is_batch_independent():
    rng = np.random.default_rng(1)
    seq = [torch.from_numpy(rng.normal(0, 2, size=(C, V)).astype(np.float32)) for _ in range(8)]
    alone = SamplerState(4, C, V, "cpu")
    alone.admit(2, SamplingParams(seed=42), seed=42)
    a = [alone.sample(x[None], torch.tensor([2]))[0] for x in seq]

    busy = SamplerState(8, C, V, "cpu")
    busy.admit(6, SamplingParams(seed=42), seed=42)
    for other in (0, 1, 7):
        busy.admit(other, SamplingParams(top_k=3, temperature=0.5, top_p=0.3), seed=other)
    b = []
    for x in seq:
        batch = torch.stack(
            [
                torch.from_numpy(rng.normal(0, 2, size=(C, V)).astype(np.float32)),
                x,
                torch.zeros(C, V),
                torch.randn(C, V),
            ]
        )
        b.append(busy.sample(batch, torch.tensor([0, 6, 1, 7]))[1])
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_samples_follow_the_distribution():
    """Counter-based Gumbel-max is an exact categorical draw: frequencies match the probabilities."""
    n = 4000
    state = SamplerState(n, 1, 8, "cpu")
    p = SamplingParams(temperature=1.0, top_k=8, min_p=0.0, repetition_window=0, repetition_codebooks=-1)
    for s in range(n):
        state.admit(s, p, seed=1000 + s)
    logits = torch.log(torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005]))
    codes = state.sample(logits.expand(n, 1, 8).contiguous(), torch.arange(n))[:, 0]
    freq = torch.bincount(codes, minlength=8).double() / n
    assert torch.allclose(freq, logits.exp().double(), atol=0.03), freq


def test_different_seeds_differ_and_same_seed_repeats():
    logits = torch.zeros(2, C, V)
    st = SamplerState(2, C, V, "cpu")
    st.admit(0, SamplingParams(min_p=0.0, top_k=0), seed=7)
    st.admit(1, SamplingParams(min_p=0.0, top_k=0), seed=8)
    a = st.sample(logits, torch.tensor([0, 1]))
    assert not torch.equal(a[0], a[1])
    st.admit(0, SamplingParams(min_p=0.0, top_k=0), seed=7)
    assert torch.equal(st.sample(logits[:1], torch.tensor([0]))[0], a[0])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1},
        {"top_p": 1.5},
        {"min_p": -0.1},
        {"repetition_penalty": 0.5},
        {"repetition_window": 10_000},
        {"repetition_codebooks": 12},
        {"seed": -3},
    ],
)
def test_invalid_params_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs).validate()


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
        ),
    ],
)
def test_values_at_their_bounds_sample_valid_codes(device):
    """Every value at the edge of its bound (records.py, checked at the door and on submit) fits the
    sampler's tensors and samples valid codes, with a repeated history, on the device the engine runs on."""
    edges = [
        SamplingParams(
            temperature=TEMPERATURE_MAX,
            repetition_penalty=REPETITION_PENALTY_MAX,
            repetition_window=HISTORY,
            repetition_codebooks=-1,
            top_k=TOP_K_MAX,
            top_p=1.0,
            min_p=1.0,
        ),
        SamplingParams(
            temperature=0.0,
            repetition_penalty=1.0,
            repetition_window=0,
            top_k=-1,
            top_p=0.0,
            min_p=0.0,
            seed=SEED_LIMIT - 1,
        ),
        SamplingParams(temperature=5e-324, top_p=1e-320, min_p=1e-320, repetition_penalty=REPETITION_PENALTY_MAX),
    ]
    st = SamplerState(len(edges), C, V, device)
    for slot, p in enumerate(edges):
        p.validate(C)
        st.admit(slot, p, seed=p.seed or slot)
    slots = torch.arange(len(edges), device=device)
    logits = torch.randn(len(edges), C, V, device=device) * 30
    for _ in range(HISTORY + 3):  # past the history ring: every code penalised at the largest penalty
        codes = st.sample(logits, slots)
        assert codes.shape == (len(edges), C) and bool(((codes >= 0) & (codes < V)).all())


def test_temperature_zero_is_greedy():
    st = SamplerState(1, C, V, "cpu")
    st.admit(0, SamplingParams(temperature=0.0, repetition_window=0), seed=1)
    logits = torch.randn(1, C, V)
    assert torch.equal(st.sample(logits, torch.tensor([0]))[0], logits[0].argmax(-1))


def test_first_frame_after_prefill_is_sampled_outside_the_compiled_sampler():
    """The prefill path samples any number of rows, so it must not go through the torch.compile'd copies:
    each new row count would trace again while every live stream waits. With those copies made to fail,
    prefill still samples, and the same frames as an intact node with the same seeds."""
    from engine.frontend.prompt import PromptBuilder
    from engine.llm.node import LLMNode, Sequence
    from engine.model.checkpoint import random_model

    model = random_model("tiny")
    prompts = [PromptBuilder(model.cfg).build(t) for t in ("One.", "Two words.", "And three.")]

    def first_frames(poison: bool) -> list[np.ndarray]:
        node = LLMNode(model, n_slots=4, max_len=128)
        if poison:

            def traced(*_args, **_kwargs):
                raise AssertionError("prefill sampling went through the compiled sampler")

            node.sampler._filter = node.sampler._noise = traced
        seqs = [
            Sequence(rid=i, prompt=p, params=SamplingParams(seed=10 + i), max_frames=4) for i, p in enumerate(prompts)
        ]
        for s in seqs:
            node.admit(s)
        return [codes for _, codes in node.prefill([(s, s.prompt_len) for s in seqs])]

    got, ref = first_frames(poison=True), first_frames(poison=False)
    assert len(got) == 3
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_rows_filtered_logits_are_the_same_bits_in_any_batch():
    """Top-p and min-p decide per row without float sums (fixed-point mass, exp(l - max) against min_p), so a
    row's filtered logits, and its noise, are the same bits alone and among rows of other settings."""
    from engine.llm.sampling import gumbel_noise

    rng = np.random.default_rng(3)
    st = SamplerState(8, C, V, "cpu")
    for s in range(8):
        st.admit(
            s,
            SamplingParams(top_p=(0.3, 0.9, 0.0)[s % 3], min_p=(0.0, 0.05, 0.2)[s % 3], temperature=0.5 + 0.1 * s),
            seed=100 + s,
        )
    logits = torch.from_numpy(rng.normal(0, 3, size=(8, C, V)).astype(np.float32))
    full = st.filtered_logits(logits, torch.arange(8))
    noise = gumbel_noise(st.seed, st.step, (C, V))
    for s in range(8):
        one = torch.tensor([s])
        assert torch.equal(st.filtered_logits(logits[s : s + 1], one)[0], full[s])
        assert torch.equal(gumbel_noise(st.seed[one], st.step[one], (C, V))[0], noise[s])
    plain = SamplerState(1, C, V, "cpu")
    plain.admit(0, SamplingParams(top_p=0.0, min_p=0.0, temperature=0.5), seed=100)
    # slot 0's top-p 0.3 keeps fewer codes than the same row unfiltered: the filter is active
    unfiltered = plain.filtered_logits(logits[:1], torch.tensor([0]))[0]
    assert (torch.isfinite(full[0]).sum(-1) < torch.isfinite(unfiltered).sum(-1)).all()


def test_noise_table_is_gumbel():
    """The table's quantiles follow Gumbel(0, 1): mean ~ Euler's gamma, and a hash's draws spread over it."""
    from engine.llm.sampling import NOISE_BITS, gumbel_noise, gumbel_table

    table = gumbel_table("cpu")
    assert table.shape == (2**NOISE_BITS,) and torch.all(table[1:] > table[:-1])
    assert abs(float(table.double().mean()) - 0.5772156649) < 1e-3
    draws = gumbel_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), (C, V)).double()
    assert abs(float(draws.mean()) - 0.5772156649) < 0.01 and abs(float(draws.var()) - np.pi**2 / 6) < 0.05


def test_top_k_has_one_limit_and_one_meaning_below_one():
    """The gateway, the engine's check and the sampler share one top_k limit (the codebook size) and one
    meaning of top_k < 1 (every code)."""
    from app.core.options import parse_options
    from app.io.errors import RequestError
    from engine.contract.constants import CODEBOOK_SIZE

    assert SamplingParams(top_k=0).top_k_codes() == SamplingParams(top_k=-1).top_k_codes() == CODEBOOK_SIZE
    assert SamplingParams(top_k=7).top_k_codes() == 7
    SamplingParams(top_k=CODEBOOK_SIZE).validate()
    with pytest.raises(ValueError, match=f"top_k must be an integer in -1..{CODEBOOK_SIZE}") as engine_side:
        SamplingParams(top_k=CODEBOOK_SIZE + 1).validate()
    with pytest.raises(RequestError) as gateway_side:
        parse_options({"top_k": CODEBOOK_SIZE + 1}, 100)
    assert str(engine_side.value) in str(gateway_side.value)


@pytest.mark.parametrize(
    "bad",
    [
        {"top_k": TOP_K_MAX + 1},
        {"repetition_penalty": 0.5},
        {"repetition_window": HISTORY + 1},
        {"repetition_codebooks": C + 1},
        {"temperature": TEMPERATURE_MAX * 2},
    ],
)
def test_the_sampler_takes_only_values_within_the_contracts_bounds(bad):
    """The sampler checks a request's values against the one set of bounds (SamplingParams.validate) rather
    than bending them into its own."""
    state = SamplerState(n_slots=1, n_codebooks=C, vocab=V, device="cpu")
    with pytest.raises(ValueError, match=next(iter(bad))):
        state.admit(0, SamplingParams(**bad), seed=1)
