"""GPU-only checks (skipped without CUDA): bf16 model vs fp32, graphs vs eager, batch independence of
seeded requests, and DAC precision on the GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def test_bf16_gpu_model_matches_fp32_cpu():
    from engine.frontend.prompt import Conditioning, PromptBuilder
    from engine.model.checkpoint import random_model

    cpu = random_model("tiny", device="cpu", dtype=torch.float32)
    gpu = random_model("tiny", device="cuda", dtype=torch.bfloat16)
    gpu.enable_triton()
    ids = torch.from_numpy(PromptBuilder(cpu.cfg).build("Compare precisions.", Conditioning(speaker=True)))
    spk = torch.randn(2048)
    a = cpu.forward_full(ids, speaker=spk)
    b = gpu.forward_full(ids.cuda(), speaker=spk.cuda()).cpu()
    cos = _cos(a, b)
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    print(f"tiny bf16 GPU vs fp32 CPU: cos {cos:.6f}, argmax agreement {agree:.3f}")
    assert cos > 0.999 and agree > 0.9


def _run(node, prompts, seeds, steps, speakers=None):
    from engine.contract.records import SamplingParams
    from engine.llm.node import Sequence

    speakers = speakers or [None] * len(prompts)
    seqs = [
        Sequence(rid=i, prompt=p, params=SamplingParams(seed=s), max_frames=steps, ignore_eos=True, speaker=spk)
        for i, (p, s, spk) in enumerate(zip(prompts, seeds, speakers, strict=True))
    ]
    for s in seqs:
        node.admit(s)
    frames = {s.rid: [] for s in seqs}
    for s, c in node.prefill([(s, s.prompt_len) for s in seqs]):
        frames[s.rid].append(c)
    while any(s.finish_reason is None for s in seqs):
        for s, c in node.decode([s for s in seqs if s.finish_reason is None]):
            frames[s.rid].append(c)
    for s in seqs:
        node.release(s)
    return [np.stack(frames[s.rid]) for s in seqs]


@pytest.mark.parametrize("mode", ["seeded", "always", "off"])
def test_graphs_equal_eager_and_seeded_batch_independence(mode):
    """--batch-invariant seeded (the default) or always: a seeded request's codes alone and among 3 unseeded
    requests are identical (seeded: every call it is in replays the invariant set; a batch of unseeded ones
    replays the default set). Off: most frames agree (a near-tie flipped by a batch-shaped bf16 GEMM
    diverges the rest)."""
    from engine.frontend.prompt import PromptBuilder
    from engine.llm.node import LLMNode
    from engine.model.checkpoint import random_model

    model = random_model("tiny", device="cuda", dtype=torch.bfloat16)
    pb = PromptBuilder(model.cfg)
    target = pb.build("The seeded one.")
    others = [pb.build(t) for t in ("Other text here.", "Yet another request", "x")]
    graphed = LLMNode(model, n_slots=8, max_len=256, cuda_graphs=True, batch_invariant=mode)
    alone = _run(graphed, [target], [42], 60)[0]
    graphed.calls.clear()
    busy = _run(graphed, [*others, target], [None, None, None, 42], 60)[-1]
    invariant = mode != "off"
    assert graphed.calls == {("prefill", invariant): 1, ("decode", invariant): 59}
    graphed.calls.clear()
    _run(graphed, others, [None, None, None], 10)
    assert graphed.calls == {("prefill", mode == "always"): 1, ("decode", mode == "always"): 9}
    eager = LLMNode(model, n_slots=8, max_len=256, cuda_graphs=False, batch_invariant=mode)
    eager_alone = _run(eager, [target], [42], 60)[0]
    same_batch = float((alone == busy).all(-1).mean())
    print(f"batch invariant {mode}: seeded request alone vs among 3 unseeded: {same_batch:.1%} of frames identical")
    assert np.array_equal(alone, eager_alone)  # the graph replays exactly the eager kernels
    if invariant:
        np.testing.assert_array_equal(alone, busy)
    else:
        assert same_batch >= 0.9


@pytest.mark.slow
def test_seed_holds_alone_and_in_a_full_batch_full_size():
    """The batch-invariance target, as the engine runs (full-size random weights, 128 slots, CUDA graphs, compiled
    sampler, --batch-invariant seeded): a seeded, voiced request's codes alone equal its codes when it is
    prefilled packed with 127 unseeded requests and decoded among them, in another slot and row; every call
    it is in replays the invariant graphs, and the 127 alone replay the default ones."""
    from engine.frontend.prompt import Conditioning, PromptBuilder
    from engine.llm.node import LLMNode
    from engine.model.checkpoint import random_model

    model = random_model("full", device="cuda", dtype=torch.bfloat16)
    node = LLMNode(model, n_slots=128, max_len=512, compile=True, batch_invariant="seeded")
    print(
        "capture s / MiB reserved (decode, prefill), default and invariant kernels:",
        {
            inv: (
                round(node.graphs.capture_s[inv], 1),
                node.graphs.capture_bytes[inv] >> 20,
                round(node.prefill_graphs.capture_s[inv], 1),
                node.prefill_graphs.capture_bytes[inv] >> 20,
            )
            for inv in node.kernel_sets
        },
    )
    pb = PromptBuilder(model.cfg)
    target = pb.build("The seeded sentence we regenerate for an edit.", Conditioning(speaker=True))
    voice = torch.randn(model.cfg.speaker_embedding_dim, device="cuda")
    others = [pb.build(f"Another request, number {i}, with its own words.") for i in range(127)]
    frames = 40
    alone = _run(node, [target], [1234], frames, [voice])[0]
    prompts = [*others[:64], target, *others[64:]]
    speakers = [None] * 64 + [voice] + [None] * 63
    node.calls.clear()
    full = _run(node, prompts, [None] * 64 + [1234] + [None] * 63, frames, speakers)[64]
    # the prefill call that packs it is invariant; the calls packing only unseeded prompts need not be
    assert node.calls[("prefill", True)] == 1 and node.calls[("decode", True)] == frames - 1
    assert not node.calls[("decode", False)]
    node.calls.clear()
    _run(node, others, [None] * 127, 4)
    assert not node.calls[("decode", True)] and not node.calls[("prefill", True)]
    same = (alone == full).all(-1)
    print(
        f"seeded request alone vs in a full batch of 128: {same.mean():.1%} of frames identical"
        + ("" if same.all() else f", first difference at frame {int(np.argmin(same))}")
    )
    np.testing.assert_array_equal(alone, full)


def test_dac_bf16_vs_fp32_snr():
    from engine.dac.codec import Codec

    codec = Codec.random("full", seed=0)
    codes = torch.randint(0, 1024, (4, 48, 9))
    ref = codec.to("cuda", torch.float32).decode(codes.cuda()).float()
    low = codec.to("cuda", torch.bfloat16).decode(codes.cuda()).float()
    snr = 10 * torch.log10(ref.pow(2).sum() / (ref - low).pow(2).sum())
    print(f"DAC bf16 vs fp32 on GPU: SNR {float(snr):.1f} dB")
    assert float(snr) > 20


@pytest.mark.slow
def test_dac_compiled_incremental_equals_eager():
    """IncrementalDAC(compiled=True) (Inductor around cuDNN, plain Snake) equals the eager calls (fused Triton
    Snake), call after call through the state cache (tiny codec: a shorter compile)."""
    from engine.dac.codec import Codec
    from engine.dac.incremental import IncrementalDAC

    codec = Codec.random("tiny", seed=0, device="cuda", dtype=torch.float32)
    eager, compiled = IncrementalDAC(codec, slots=2), IncrementalDAC(codec, slots=2, compiled=True)
    codes = np.random.default_rng(1).integers(0, 1024, (2, 40, 9))
    for a in range(0, 50, 10):
        c = np.zeros((2, 10, 9), dtype=np.int64)
        c[:, : max(0, min(10, 40 - a))] = codes[:, a : a + 10]
        packed = torch.from_numpy(eager.pack(c, np.array([0, 1]), np.full(2, a), np.array([40, 33]))).cuda()
        x, y = eager.run(packed, 10).cpu().numpy(), compiled.run(packed, 10).cpu().numpy()
        snr = _snr(x, y)
        print(f"compiled vs eager incremental DAC, call {a // 10}: SNR {snr:.1f} dB")
        assert snr > 60


def test_compiled_decode_matches_plain():
    """torch.compile fuses the bf16 stages differently, so whole trajectories may drift after a near-tie;
    one step's logits from the same cache must agree."""
    from engine.frontend.prompt import PromptBuilder
    from engine.model.checkpoint import random_model
    from engine.model.zonos2 import PrefillSeq

    model = random_model("tiny", device="cuda", dtype=torch.bfloat16)
    model.enable_triton()
    ids = torch.from_numpy(PromptBuilder(model.cfg).build("Compiled or not.")).cuda()
    model.setup_cache(4, 256)
    model.prefill(
        ids,
        [
            PrefillSeq(1, 0, len(ids)),
        ],
        None,
    )
    new = torch.randint(0, 1024, (3, 10), device="cuda")
    new[:, 9] = model.cfg.text_pad_id
    slots, pos = torch.tensor([1, 2, 3], device="cuda"), torch.tensor([len(ids), 0, 0], device="cuda")
    plain = model.decode(new, slots, pos)
    model.compile_decode()
    fused = model.decode(new, slots, pos)
    cos = _cos(plain, fused)
    print(f"torch.compile'd decode vs plain, one step: cos {cos:.6f}")
    assert cos > 0.999


def test_prefill_graphs_match_unpadded_prefill():
    """A captured, padded prefill replay gives the plain packed prefill's last-frame logits, speakers
    and a chunk continuing a cached prompt included."""
    from engine.frontend.prompt import Conditioning, PromptBuilder
    from engine.llm.graphs import PrefillGraphs
    from engine.model.checkpoint import random_model
    from engine.model.zonos2 import PrefillSeq

    model = random_model("tiny", device="cuda", dtype=torch.bfloat16)
    model.enable_triton()
    model.setup_cache(5, 256)
    pb = PromptBuilder(model.cfg)
    a = torch.from_numpy(pb.build("Graphs and speakers.", Conditioning(speaker=True))).cuda()
    b = torch.from_numpy(pb.build("Another one")).cuda()
    spk = torch.randn(2048, device="cuda")
    seqs = [PrefillSeq(0, 0, 20), PrefillSeq(1, 0, len(b))]
    plain = model.prefill(torch.cat([a[:20], b]), seqs, [spk, None])
    plain_rest = model.prefill(a[20:], [PrefillSeq(0, 20, len(a) - 20)], [None])
    graphs = PrefillGraphs(model, scratch_slot=4, buckets=(32, 64, 128))
    graphs.capture()
    seqs = [PrefillSeq(2, 0, 20), PrefillSeq(3, 0, len(b))]
    replay = graphs.run(torch.cat([a[:20], b]), seqs, [spk, None]).clone()
    replay_rest = graphs.run(a[20:], [PrefillSeq(2, 20, len(a) - 20)], [None])
    print(f"prefill graph vs plain: cos {_cos(plain, replay):.6f} / {_cos(plain_rest, replay_rest):.6f}")
    assert _cos(plain, replay) > 0.999 and _cos(plain_rest, replay_rest) > 0.999


def _snr(ref: np.ndarray, x: np.ndarray) -> float:
    ref64, x64 = ref.astype(np.float64), x.astype(np.float64)  # before the difference: int16 PCM would wrap
    return float(10 * np.log10(np.sum(ref64**2) / max(np.sum((ref64 - x64) ** 2), 1e-30)))


def test_dac_graphed_streaming_equals_eager_streaming_equals_one_shot():
    """The incremental DAC's captured calls replay its eager calls (same state cache updates); a stream
    launched and collected asynchronously on the GPU (fused masked Snake, graphs, several calls in flight,
    3 streams in varying batches) equals the one-shot decode of the same codes, in fp32 and bf16."""
    from engine.dac.codec import HOP, Codec
    from engine.dac.graphs import DacGraphs
    from engine.dac.incremental import IncrementalDAC
    from engine.dac.streaming import StreamingDecoder, decode_offline

    for dtype, floor in ((torch.float32, 50.0), (torch.bfloat16, 25.0)):
        codec = Codec.random("full", seed=0, device="cuda", dtype=dtype)
        rng = np.random.default_rng(0)
        codes = rng.integers(0, 1024, (3, 60, 9))
        eager_net, graph_net = IncrementalDAC(codec, slots=4), IncrementalDAC(codec, slots=4)
        graphs = DacGraphs(graph_net, {(4, 10)})
        graphs.capture()
        eager_out, graph_out = [], []
        for a in range(0, 70, 10):  # 7 calls: 60 real frames, then the flush
            c = np.zeros((4, 10, 9), dtype=np.int64)
            c[:3, : max(0, min(10, 60 - a))] = codes[:, a : a + 10]
            packed = torch.from_numpy(
                eager_net.pack(c, np.array([0, 1, 2, 4]), np.full(4, a), np.array([60] * 3 + [0]))
            )
            eager_out.append(eager_net.run(packed.cuda(), 10).cpu().numpy())
            graph_out.append(graphs.run(packed.pin_memory(), 10).cpu().numpy())
        eager, replay = np.concatenate(eager_out, 1)[:3], np.concatenate(graph_out, 1)[:3]
        snr = _snr(eager, replay)
        print(f"DAC {dtype}: incremental graph replay vs eager SNR {snr:.1f} dB")
        assert snr > 60
        lag = eager_net.lag
        for r in range(3):
            ref = codec.decode(torch.from_numpy(codes[r : r + 1]).cuda())[0].float().cpu().numpy()
            snr = _snr(ref, replay[r, lag : lag + 60 * HOP])
            print(f"DAC {dtype}: incremental (graphs) vs one-shot, row {r}: SNR {snr:.1f} dB")
            assert snr > floor

        dec = StreamingDecoder(codec)
        dec.capture(max_batch=4)
        frames = {rid: rng.integers(0, 1024, (200, 9)) for rid in range(3)}
        out: dict[int, list[np.ndarray]] = {rid: [] for rid in frames}
        stream = torch.cuda.Stream()
        for k in range(200):
            rids = [r for r in frames if k >= 7 * r]  # staggered starts: varying batches
            dec.push_rows(rids, np.stack([frames[r][k - 7 * r] for r in rids]))
            with torch.cuda.stream(stream):
                dec.launch(max_batch=4, max_frames=20)
            for rid, pcm, _ in dec.collect(as_float=True):
                out[rid].append(pcm)
        for rid in frames:
            dec.push(rid, frames[rid][200 - 7 * rid :])
            dec.finish(rid, None)
        while dec.pending() or dec.in_flight():
            with torch.cuda.stream(stream):
                dec.launch(max_batch=4)
            for rid, pcm, _ in dec.collect(as_float=True, wait=True):
                out[rid].append(pcm)
        assert dec.active() == 0
        for rid, f in frames.items():
            x = np.concatenate(out[rid])
            snr = _snr(decode_offline(codec, f), x)
            print(f"DAC {dtype}: async stream vs one-shot SNR {snr:.1f} dB")
            assert len(x) == 200 * HOP and snr > floor


def test_compiled_and_eager_sampler_agree_at_every_batch():
    """The first frame after a prefill is sampled eagerly, later frames by the compiled sampler in the decode
    graph (one compile per bucket): both draw the same table noise and filter without float sums, so a row
    gets the same code from either path, alone or among 63 others."""
    from engine.contract.records import SamplingParams
    from engine.llm.sampling import SamplerState

    c, v, n = 9, 1026, 64
    params = SamplingParams(seed=5, top_p=0.9, min_p=0.1, temperature=0.8)
    states = {compiled: SamplerState(n + 1, c, v, "cuda", compiled=compiled) for compiled in (False, True)}
    for st in states.values():
        for s in range(n):
            st.admit(s, params if s == 7 else SamplingParams(seed=s, top_k=s % 50), seed=5 if s == 7 else s)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(4):
        logits = torch.randn(n, c, v, device="cuda", generator=gen) * 3
        codes = {}
        for compiled, st in states.items():
            alone = st.sample(logits[7:8], torch.tensor([7], device="cuda"))[0].clone()
            st.step[7] -= 1  # the same frame again, now among the others
            st.history_step[7, st.step[7] % st.history_step.shape[1]] = -1
            batch = st.sample(logits, torch.arange(n, device="cuda"))
            assert torch.equal(alone, batch[7]), compiled
            codes[compiled] = batch
        assert torch.equal(codes[False], codes[True])


def test_overlap_with_captured_graphs_equals_eager_without(built_engines):
    """Overlap scheduling as the engine runs it on a GPU: captured decode graphs that gather their
    inputs from the sampler's device buffer, step k+1 launched before step k is read back, the slots of a
    request that ended (EOS, cancel) kept until the step in flight that still writes them is read. Every
    seeded request of tests/engine/test_overlap.py's mix (different lengths, a guided pair, a cancel, admissions
    into slots freed one step before) has the same frames as an eager engine without overlap, and no
    admission lands in a slot a step in flight writes (drive asserts it)."""
    from engine.contract.settings import EngineSettings, WeightSources
    from engine.runtime.engine import Engine
    from tests.engine.test_overlap import SLOTS, assert_same, compare_mixed, drive, mixed_requests

    def engine(graphs: bool) -> Engine:
        built = Engine(
            WeightSources(),
            EngineSettings(
                device="cuda",
                max_batch=SLOTS,
                max_queue=16,
                max_context=512,
                prefill_chunk=64,
                compile=False,
                admission="slots",  # admitted as slots free up, as on a CPU (realtime admission times the wall clock)
                cuda_graphs=graphs,
                dac_dtype="float32",
                stats_interval_s=1e9,
                continuation_flush_lead_ms=-1e9,
                continuation_grace_ms=1e9,
            ),
        )
        built_engines.append(built)  # stopped and the switch interval restored after the test
        return built

    eager = engine(False)
    graphed = engine(True)
    assert graphed.llm.graphs is not None and eager.llm.graphs is None
    plain, overlapped = compare_mixed(eager, False, graphed, True, pcm_tolerance=64)
    print("reasons with overlap:", {rid: end.reason for rid, end in sorted(overlapped.ends.items())})
    assert any(again for _, _, again in overlapped.admissions)  # a slot freed one step before went to a newcomer
    # first-audio sprints on the captured graphs (small batch buckets launched behind the step, up to six decode
    # steps in flight): the same frames as the eager engine without them
    reqs, cancel_at, submit_at = mixed_requests()
    sprinted = drive(graphed, True, reqs, cancel_at, submit_at, sprints=2)
    assert sprinted.counters["sprint_frames"] > 0
    assert_same(plain, sprinted, [r.rid for r in reqs + submit_at[3][1] if r.rid != 1], pcm_tolerance=64)


# docs/protocol.md (`seed`): a seeded request's PCM beside other streams is within this SNR of its PCM alone
# (the codes are identical; the DAC decodes its chunks in batches whose size depends on the load)
SEEDED_PCM_SNR_DB = 35.0


def test_seeded_request_alone_and_beside_1_8_127_streams_same_codes_pcm_within_the_stated_snr(built_engines):
    """What docs/protocol.md promises for a seed, as the engine's scheduler serves it (overlap, CUDA graphs,
    --batch-invariant seeded, the dac_decoder's batching; a tiny random LLM and the full-size DAC in bf16):
    alone twice, the same codes and PCM bit for bit; beside 1, 8 and 127 unseeded streams decoding with it,
    the same codes, length and end, and PCM within SEEDED_PCM_SNR_DB of the PCM alone. Driven one scheduler
    iteration at a time: nothing depends on speed."""
    from engine.contract.settings import EngineSettings, WeightSources
    from engine.dac.codec import Codec
    from engine.runtime.engine import Engine
    from tests.engine.test_overlap import drive, req

    engine = Engine(
        WeightSources(),
        EngineSettings(
            device="cuda",
            max_batch=128,
            max_queue=256,
            max_context=512,
            compile=False,
            admission="slots",
            batch_invariant="seeded",
            prefill_group_wait_ms=0,
            stats_interval_s=1e9,
            continuation_flush_lead_ms=-1e9,
            continuation_grace_ms=1e9,
        ),
    )
    built_engines.append(engine)
    engine.codec = Codec.random("full", seed=0, device="cuda", dtype=torch.bfloat16)  # drive decodes with it
    frames = 60
    target = req(1, "The seeded sentence we regenerate for an edit.", frames, seed=1234)

    def serve(n_others: int, sprints: int = 0):
        # the others start in the same iteration and outlast the target: every DAC call of the target's
        # can batch it with them
        others = [
            req(100 + i, f"Another stream, number {i}, with its own words.", frames + 20) for i in range(n_others)
        ]
        run = drive(
            engine,
            True,
            [*others[: n_others // 2], target, *others[n_others // 2 :]],
            max_iterations=5000,
            sprints=sprints,
        )
        return run.codes(1), run.audio(1), run.ends[1].reason

    codes, pcm, reason = serve(0)
    assert len(codes) == frames and len(pcm) > 0
    again = serve(0)
    np.testing.assert_array_equal(again[0], codes)
    np.testing.assert_array_equal(again[1], pcm)  # alone, the same DAC batches: identical PCM
    assert again[2] == reason
    # with first-audio sprints too (the engine's default on a GPU): the target sprints in small batches beside
    # 8 (one of the 16 nearest its first call) and 127 (in or out of the sprint rows: frames differ in timing only)
    for n, sprints in ((1, 0), (8, 0), (127, 0), (8, 1), (127, 1)):
        c, p, r = serve(n, sprints)
        np.testing.assert_array_equal(c, codes, err_msg=f"beside {n}, sprints {sprints}")
        assert len(p) == len(pcm) and r == reason, n
        snr = _snr(pcm, p)
        print(
            f"seeded request beside {n} streams (sprints {sprints}): codes identical, PCM SNR {snr:.1f} dB vs alone"
            + (" (identical)" if np.array_equal(p, pcm) else "")
        )
        assert snr >= SEEDED_PCM_SNR_DB, (n, snr)
