"""engine/guidance.py: the reference's guidance formula and which twin a request gets."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from engine.contract.records import SamplingParams
from engine.guidance import guide, twin


def test_guide_formula_per_row_scales():
    g = torch.Generator().manual_seed(0)
    cond, uncond = torch.randn(3, 9, 17, generator=g), torch.randn(3, 9, 17, generator=g)
    scales = torch.tensor([2.0, 1.0, -1.0])
    out = guide(cond, uncond, scales)
    assert out.dtype == torch.float32 and out.shape == cond.shape
    torch.testing.assert_close(out[0], uncond[0] + 2.0 * (cond[0] - uncond[0]))
    torch.testing.assert_close(out[1], cond[1])  # 1.0: the conditional logits
    torch.testing.assert_close(out[2], 2 * uncond[2] - cond[2])  # negative scale opposes the condition
    torch.testing.assert_close(
        guide(cond.bfloat16(), uncond.bfloat16(), 0.5),
        uncond.bfloat16().float() + 0.5 * (cond.bfloat16().float() - uncond.bfloat16().float()),
    )


def test_which_twin():
    assert twin(SamplingParams(), has_speaker=True, continuation=True) is None
    assert twin(SamplingParams(cfg_scale=2.0), has_speaker=True, continuation=False) == ("speaker", 2.0)
    assert twin(SamplingParams(cfg_scale=2.0), has_speaker=False, continuation=True) is None  # nothing to drop
    assert twin(SamplingParams(prefix_cfg_scale=1.5), has_speaker=False, continuation=False) is None  # 1st chunk
    both = SamplingParams(cfg_scale=2.0, prefix_cfg_scale=-0.5)
    assert twin(both, has_speaker=True, continuation=True) == ("prefix", -0.5)  # prefix CFG wins
    assert twin(both, has_speaker=True, continuation=False) == ("speaker", 2.0)
    # emotion CFG (emotion-control-clean): a voice with an emotion; the other twins win when asked for too
    emo = SamplingParams(emotion_cfg_scale=3.0)
    assert twin(emo, has_speaker=True, continuation=False, has_emotion=True) == ("emotion", 3.0)
    assert twin(emo, has_speaker=True, continuation=True, has_emotion=False) is None  # no emotion to drop
    assert twin(emo, has_speaker=False, continuation=False, has_emotion=True) is None
    assert twin(SamplingParams(emotion_cfg_scale=3.0, cfg_scale=2.0), True, False, True) == ("speaker", 2.0)
    assert twin(SamplingParams(emotion_cfg_scale=3.0, prefix_cfg_scale=0.5), True, True, True) == ("prefix", 0.5)


@pytest.mark.parametrize("value", [math.nan, math.inf, 101.0, True, "2", None])
@pytest.mark.parametrize("name", ["cfg_scale", "prefix_cfg_scale", "emotion_cfg_scale"])
def test_validate_refuses(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value}).validate()
    SamplingParams(**{name: -3}).validate()


def test_scales_travel_in_the_submit_record():

    import numpy as np

    from engine.contract.records import SubmitRequest

    req = SubmitRequest(
        rid=1,
        prompt=np.zeros((3, 10), np.int64),
        max_frames=5,
        params=SamplingParams(cfg_scale=2.5, prefix_cfg_scale=-1.0, emotion_cfg_scale=3.0),
    )
    back = SubmitRequest.decode(*req.encode())
    assert back.params == req.params and back.params.cfg_scale == 2.5
    # the prefix twin's prompt travels between the prompt and the speaker embedding
    req = replace(
        req,
        uncond_prompt=np.arange(20).reshape(2, 10),
        speaker_embedding=np.linspace(0, 1, 16, dtype=np.float32),
        hold=True,
        continues=7,
    )
    back = SubmitRequest.decode(*req.encode())
    assert np.array_equal(back.uncond_prompt, req.uncond_prompt) and np.array_equal(back.prompt, req.prompt)
    assert np.array_equal(back.speaker_embedding, req.speaker_embedding) and (back.hold, back.continues) == (True, 7)
    assert back.emotion_delta is None and back.uncond_speaker is None
    # emotion: the 'proj' delta and the raw/lda twin's voice, between the twin's prompt and the speaker
    req = replace(
        req,
        emotion_delta=np.linspace(-1, 1, 24, dtype=np.float32),
        uncond_speaker=np.linspace(1, 2, 16, dtype=np.float32),
    )
    back = SubmitRequest.decode(*req.encode())
    assert np.array_equal(back.emotion_delta, req.emotion_delta) and np.array_equal(
        back.uncond_speaker, req.uncond_speaker
    )
    assert np.array_equal(back.speaker_embedding, req.speaker_embedding)
    assert np.array_equal(back.uncond_prompt, req.uncond_prompt) and np.array_equal(back.prompt, req.prompt)
    req = replace(req, speaker_embedding=None, clip=np.ones(100, np.float32), clip_sr=16000)
    back = SubmitRequest.decode(*req.encode())
    assert np.array_equal(back.clip, req.clip) and np.array_equal(back.emotion_delta, req.emotion_delta)
    header, payload = req.encode()
    with pytest.raises(ValueError, match="emotion_dim"):  # a header that lies about the payload
        SubmitRequest.decode(header | {"emotion_dim": 10**6}, payload)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_guided_logits_of_the_packed_prefill_on_gpu(dtype):
    """A speaker-CFG pair and a prefix-CFG pair prefilled in one packed batch through the production
    prefill path (Triton attention on CUDA): each row's last logits equal forward_full's, and guide() on
    them equals the formula on two plain passes (fp32: 1-cos < 1e-6)."""
    import numpy as np

    from engine.frontend.prompt import Conditioning, PromptBuilder
    from engine.model.checkpoint import random_model
    from engine.model.zonos2 import PrefillSeq

    model = random_model("tiny", device="cuda", dtype=dtype)
    model.enable_triton()
    pb = PromptBuilder(model.cfg)
    cond = Conditioning(speaker=True)
    codes = np.random.default_rng(0).integers(0, 1024, size=(300, 9))
    cont = pb.build_continuation("It began like this.", "And then it went on.", codes, cond)
    fresh = pb.build("And then it went on.", cond)
    spk = torch.randn(2048, device="cuda")
    prompts = [cont, fresh, cont]  # conditional, prefix twin (speaker kept), speaker twin (no speaker)
    speakers = [spk, spk, None]
    model.setup_cache(4, len(cont) + 8)
    ids = torch.from_numpy(np.concatenate(prompts)).cuda()
    seqs = [PrefillSeq(slot=i, start=0, length=len(p)) for i, p in enumerate(prompts)]
    packed = model.prefill(ids, seqs, speakers).float()
    plain = torch.stack(
        [
            model.forward_full(torch.from_numpy(p).cuda(), speaker=s)[-1].float()
            for p, s in zip(prompts, speakers, strict=True)
        ]
    )
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    for i in range(3):
        cos = torch.nn.functional.cosine_similarity(packed[i].flatten().double(), plain[i].flatten().double(), 0)
        assert 1 - float(cos) < tol, (i, float(cos))
    for (i, j), s in (((0, 1), -0.5), ((0, 2), 2.5)):
        got = guide(packed[i], packed[j], s)
        want = plain[j] + s * (plain[i] - plain[j])
        cos = torch.nn.functional.cosine_similarity(got.flatten().double(), want.flatten().double(), 0)
        assert 1 - float(cos) < tol, (i, j, float(cos))


# ---- twins in the sampler and the LLM node ------------------------------------------------------
@pytest.mark.parametrize("scale", [2.5, -0.5])
def test_a_pair_samples_the_guided_formula_and_the_twin_draws_the_same_frame(scale):
    """Slots 0 (conditional) and 1 (twin) paired; slot 2, unpaired with the same parameters and seed, is
    given guide(cond, uncond, s) computed here: all three draw the same frame at every step, so the guided
    sampling is the formula and the twin's history is the conditional's. Slot 3 (unpaired) is untouched."""
    from engine.llm.sampling import SamplerState

    c, v = 9, 64
    st = SamplerState(5, c, v, "cpu")
    params = SamplingParams(temperature=1.0, top_k=20, min_p=0.05, repetition_penalty=1.5, repetition_window=8)
    for slot in range(4):
        st.admit(slot, params, seed=7)
    st.pair_slots(0, 1, scale)
    g = torch.Generator().manual_seed(3)
    for _ in range(12):
        cond, uncond, other = (torch.randn(c, v, generator=g) * 3 for _ in range(3))
        logits = torch.stack([cond, uncond, guide(cond, uncond, scale), other])
        slots = torch.tensor([3, 1, 2, 0])  # any order in the batch
        codes = st.sample(logits[[3, 1, 2, 0]], slots, eager=True)
        assert torch.equal(codes[3], codes[1]) and torch.equal(codes[3], codes[2])
    assert torch.equal(st.history[0], st.history[1]) and torch.equal(st.history[0], st.history[2])
    assert not torch.equal(st.history[0], st.history[3])


def test_a_pair_whose_partner_is_not_in_the_batch_samples_its_own_logits():
    from engine.llm.sampling import SamplerState

    st = SamplerState(3, 9, 32, "cpu")
    for slot in range(3):
        st.admit(slot, SamplingParams(), seed=5)
    st.pair_slots(0, 1, 3.0)
    logits = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(4))
    a = st.sample(logits[:1].clone(), torch.tensor([0]), eager=True)
    b = st.sample(logits[:1].clone(), torch.tensor([2]), eager=True)  # slot 2: same seed and step, unpaired
    assert torch.equal(a, b)


def _node(device: str = "cpu"):
    from engine.llm.node import LLMNode
    from engine.model.checkpoint import random_model

    return LLMNode(
        random_model("tiny", device=device, dtype=torch.float32),
        n_slots=4,
        max_len=256,
        cuda_graphs=device != "cpu",
        triton=None if device != "cpu" else False,
    )


KINDS = ["speaker", "prefix", "emotion", "emotion_raw"]


@pytest.mark.parametrize("kind", KINDS)
def test_twins_decode_in_lockstep_through_the_llm_node(kind):
    twins_in_lockstep(kind, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_twins_decode_in_lockstep_through_the_captured_graph(kind):
    """The same through the GPU node: Triton prefill, the captured decode graph (with the sampler's
    guidance in it), another request sharing the steps."""
    twins_in_lockstep(kind, "cuda")


def twins_in_lockstep(kind: str, device: str) -> None:
    """A guided request and its twin (speaker CFG: its prompt without the speaker; prefix CFG: the chunk's
    fresh prompt; emotion CFG: the same prompt and voice without the 'proj' delta on the projected speaker
    row, or, emotion_raw, with the speaker embedding before a raw/lda emotion moved it) prefilled together
    and decoded together, beside an unguided request: the same frame at every step, the same history; the
    guided first frame is the formula's on the two rows' prefill logits; release frees both."""
    import numpy as np

    from engine.frontend.prompt import Conditioning, PromptBuilder
    from engine.llm.node import Sequence
    from engine.llm.sampling import SamplerState

    node = _node(device)
    pb = PromptBuilder(node.cfg)
    cond = Conditioning(speaker=True)
    codes = np.random.default_rng(0).integers(0, 1024, size=(30, 9))
    prompt = pb.build_continuation("It began.", "And went on.", codes, cond, non_final=True)
    spk = torch.randn(node.cfg.speaker_embedding_dim, generator=torch.Generator().manual_seed(1)).to(device)
    params = SamplingParams(seed=9, cfg_scale=2.0, prefix_cfg_scale=-0.5, emotion_cfg_scale=3.0)
    scale = {"speaker": 2.0, "prefix": -0.5}.get(kind, 3.0)
    g = torch.Generator().manual_seed(2)
    delta = torch.randn(node.cfg.dim, generator=g).to(device) if kind == "emotion" else None
    moved = spk + 0.3 * torch.randn(spk.shape, generator=g).to(device)  # emotion_raw: the voice with its emotion
    seq = Sequence(
        rid=1,
        prompt=prompt,
        params=params,
        max_frames=20,
        ignore_eos=True,
        speaker=moved if kind == "emotion_raw" else spk,
        emotion=delta,
    )
    tw = Sequence(
        rid=-1,
        prompt=pb.build("And went on.", cond, non_final=True) if kind == "prefix" else prompt,
        params=params,
        max_frames=20,
        speaker=None if kind == "speaker" else spk,
        ignore_eos=True,
    )
    other = Sequence(
        rid=2, prompt=pb.build("Someone else."), params=SamplingParams(seed=3), max_frames=20, ignore_eos=True
    )
    free = len(node.free_slots)
    node.admit(seq)
    node.admit_twin(seq, tw, scale)
    node.admit(other)
    assert len(node.free_slots) == free - 3
    # the first frame: the formula on the two rows' own last logits (the model run alone per prompt)
    ids = [torch.from_numpy(p).to(device) for p in (seq.prompt, tw.prompt)]
    want_logits = guide(
        node.model.forward_full(ids[0], speaker=seq.speaker, emotion=delta)[-1].float(),
        node.model.forward_full(ids[1], speaker=tw.speaker)[-1].float(),
        scale,
    )
    ref = SamplerState(1, node.cfg.n_codebooks, node.cfg.audio_vocab, device)
    ref.admit(0, params, seq.seed)
    want = ref.sample(want_logits[None], torch.tensor([0], device=device), eager=True)[0].cpu().numpy()
    first = dict(
        (s.rid, c) for s, c in node.prefill([(seq, seq.prompt_len), (other, other.prompt_len), (tw, tw.prompt_len)])
    )
    assert np.array_equal(first[1], first[-1]) and np.array_equal(first[1], want)
    for _ in range(8):
        out = dict((s.rid, c) for s, c in node.decode([seq, other, tw]))
        assert np.array_equal(out[1], out[-1])
    assert torch.equal(node.sampler.history[seq.slot], node.sampler.history[tw.slot])
    node.release(seq)
    node.release(tw)
    node.release(other)
    assert len(node.free_slots) == free


def test_engine_runs_guided_requests_and_frees_their_twins():
    """Through a real engine process (CPU, tiny): a speaker-CFG request completes with all its audio; a
    guided request cancelled mid-way has no audio after the acknowledgement; every slot (twins included) is
    free afterwards; a prefix-CFG request without its twin's prompt runs unguided (nothing to drop)."""
    import asyncio

    import numpy as np

    from app.core.engine_client import EngineClient
    from engine.contract import records as m
    from engine.contract.settings import EngineSettings, WeightSources
    from engine.frontend.config import Zonos2Config, preset_params
    from engine.frontend.prompt import Conditioning, PromptBuilder
    from tests.asyncloop import LoopThread

    pb = PromptBuilder(Zonos2Config.from_dict(preset_params("tiny")))
    lt = LoopThread()
    client = EngineClient(
        WeightSources(),
        EngineSettings(device="cpu", max_batch=3, max_context=512, stats_interval_s=0.1),
        ring_bytes=8 << 20,
    )
    emb = np.random.default_rng(2).standard_normal(2048).astype(np.float32)

    def req(frames: int, **params) -> m.SubmitRequest:
        return m.SubmitRequest(
            rid=0,
            prompt=pb.build("Hello there.", Conditioning(speaker=True)),
            params=SamplingParams(seed=4, **params),
            max_frames=frames,
            ignore_eos=True,
            speaker_embedding=emb,
        )

    async def read(stream) -> tuple[int, m.Finished | m.Error | None]:
        n = 0
        async for ev in stream:
            if ev.type == m.AUDIO:
                n += len(ev.pcm)
            elif ev.type in (m.FINISHED, m.ERROR):
                return n, ev
        return n, None

    async def run():
        await client.start()
        await asyncio.wait_for(client.ready.wait(), 180)
        done = await read(client.submit(req(30, cfg_scale=2.0)))
        prefix = await read(client.submit(req(20, prefix_cfg_scale=3.0)))
        seen: list[tuple[str, int]] = []
        on_event = client._on_event
        client._on_event = lambda h, p: (seen.append((h.get("type"), h.get("rid"))), on_event(h, p))[1]
        stream = client.submit(req(400, cfg_scale=2.0))
        ev = await stream.next()
        while ev.type != m.AUDIO:
            ev = await stream.next()
        running = None
        for _ in range(200):  # while it generates, it and its twin hold two of the three slots
            if client.stats is not None and client.stats.active == 1:
                running = client.stats.free_slots
                break
            await asyncio.sleep(0.05)
        ack = await client.cancel(stream.rid)
        for _ in range(200):
            if client.stats is not None and client.stats.active == 0 and client.stats.free_slots == 3:
                break
            await asyncio.sleep(0.05)
        client._on_event = on_event
        last = client.stats
        assert last is not None
        return (
            done,
            prefix,
            ack,
            seen,
            stream.rid,
            {"active": last.active, "free_slots": last.free_slots, "running_free": running},
        )

    try:
        (n, end), (n2, end2), ack, seen, rid, stats = lt.run(run(), timeout=300)
    finally:
        lt.run(client.close())
        lt.close()
    assert isinstance(end, m.Finished) and end.reason == "max_frames" and n == 30 * 512
    assert isinstance(end2, m.Finished) and end2.reason == "max_frames" and n2 == 20 * 512
    assert ack is not None and ack.reason == "cancelled"
    assert (m.AUDIO, rid) not in seen[seen.index((m.FINISHED, rid)) + 1 :]
    assert stats["running_free"] == 1  # a guided request takes two slots
    assert stats["active"] == 0 and stats["free_slots"] == 3  # the twins' slots are back too


def test_a_request_that_can_never_fit_is_refused_and_blocks_nobody():
    """A guided request needs two decode slots: on a one-slot engine it is refused at once with
    `cannot_fit` (it once waited forever, and every request behind it too); and on an engine whose free
    slots cannot take a guided pair yet, a plain request queued behind the pair runs first."""
    import asyncio

    import numpy as np

    from app.core.engine_client import EngineClient
    from engine.contract import records as m
    from engine.contract.errors import EngineError
    from engine.contract.settings import EngineSettings, WeightSources
    from engine.frontend.config import Zonos2Config, preset_params
    from engine.frontend.prompt import Conditioning, PromptBuilder
    from tests.asyncloop import LoopThread

    pb = PromptBuilder(Zonos2Config.from_dict(preset_params("tiny")))
    emb = np.random.default_rng(2).standard_normal(2048).astype(np.float32)

    def req(frames: int, **params) -> m.SubmitRequest:
        return m.SubmitRequest(
            rid=0,
            prompt=pb.build("Hello there.", Conditioning(speaker=True)),
            params=SamplingParams(seed=4, **params),
            max_frames=frames,
            ignore_eos=True,
            speaker_embedding=emb,
        )

    async def end(stream) -> m.Finished | m.Error:
        async for ev in stream:
            if isinstance(ev, m.Finished | m.Error):
                return ev
        raise AssertionError("the stream ended without finished or error")

    lt = LoopThread()
    one = EngineClient(WeightSources(), EngineSettings(device="cpu", max_batch=1, max_context=512), ring_bytes=8 << 20)
    two = EngineClient(WeightSources(), EngineSettings(device="cpu", max_batch=2, max_context=512), ring_bytes=8 << 20)

    async def run():
        await one.start()
        await two.start()
        await asyncio.wait_for(one.ready.wait(), 180)
        await asyncio.wait_for(two.ready.wait(), 180)
        guided = await asyncio.wait_for(end(one.submit(req(10, cfg_scale=2.0))), 60)
        plain = await asyncio.wait_for(end(one.submit(req(10))), 120)  # the engine still serves
        # two slots: a long plain request holds one; a guided pair waits for both; a short plain one behind
        # the pair takes the free slot and ends while the pair still waits
        long = two.submit(req(300))
        await long.next()  # started
        pair = two.submit(req(10, cfg_scale=2.0))
        short = two.submit(req(5))
        order = []

        async def note(name, stream):
            order.append((name, await end(stream)))

        await asyncio.wait_for(asyncio.gather(note("short", short), note("long", long), note("pair", pair)), 240)
        return guided, plain, order

    try:
        guided, plain, order = lt.run(run(), timeout=600)
    finally:
        lt.run(one.close())
        lt.run(two.close())
        lt.close()
    assert isinstance(guided, m.Error) and guided.code == EngineError.CANNOT_FIT and "--max-batch" in guided.message
    assert isinstance(plain, m.Finished) and plain.reason == "max_frames"
    assert [name for name, _ in order] == ["short", "long", "pair"], order
    assert all(isinstance(ev, m.Finished) and ev.reason == "max_frames" for _, ev in order), order
