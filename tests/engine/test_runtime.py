"""The serving runtime: a real engine process (CPU, tiny model) behind the gateway's EngineClient."""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from app.core.engine_client import EngineClient
from engine.contract import records as m
from engine.contract.records import SamplingParams
from engine.contract.settings import EngineSettings, WeightSources
from engine.frontend.config import Zonos2Config, preset_params
from engine.frontend.prompt import Conditioning, PromptBuilder
from tests.asyncloop import LoopThread, running_engine

PB = PromptBuilder(Zonos2Config.from_dict(preset_params("tiny")))
SLOTS, QUEUE = 4, 3


@pytest.fixture(scope="module")
def rt():
    settings = EngineSettings(
        device="cpu", max_batch=SLOTS, max_queue=QUEUE, max_context=1024, prefill_chunk=64, stats_interval_s=0.2
    )
    with running_engine(settings) as rt:
        yield rt


def request(text: str, max_frames: int, ignore_eos: bool = True, **params: Any) -> m.SubmitRequest:
    return m.SubmitRequest(
        rid=0, prompt=PB.build(text), params=SamplingParams(**params), max_frames=max_frames, ignore_eos=ignore_eos
    )


async def collect(client: EngineClient, req: m.SubmitRequest) -> tuple[np.ndarray, m.Finished | m.Error, list[int]]:
    stream = client.submit(req)
    pcm, indexes, end = [], [], None
    async for ev in stream:
        if isinstance(ev, m.Audio):
            pcm.append(ev.pcm)
            indexes.append(ev.index)
        elif isinstance(ev, m.Finished | m.Error):
            end = ev
    assert end is not None
    return (np.concatenate(pcm) if pcm else np.zeros(0, np.int16)), end, indexes


def test_concurrent_requests_stream_correct_audio(rt):
    lt, client = rt
    reqs = [
        request("Hello.", 30, seed=1),
        request("A somewhat longer sentence to speak.", 57, seed=2, temperature=0.8, top_k=20),
        request("Third one", 80, seed=3, top_p=0.9, min_p=0.0),
        request("Fourth, with the end-of-audio rule.", 400, ignore_eos=False, seed=4),
    ]

    async def go():
        return await asyncio.gather(*(collect(client, r) for r in reqs))

    results = lt.run(go())
    for req, (pcm, end, idx) in zip(reqs, results, strict=True):
        assert end.type == m.FINISHED, end
        assert isinstance(end, m.Finished) and end.stats is not None
        assert idx == list(range(len(idx)))  # chunks arrive in order, none lost
        stats = end.stats
        if req.ignore_eos:
            assert end.reason == "max_frames" and stats.frames == req.max_frames
            assert len(pcm) == req.max_frames * 512  # every aligned frame, no gap, no duplicate
        else:
            eos = stats.eos_frame
            if end.reason == "eos":
                assert eos is not None
                assert len(pcm) == eos * 512 and eos + 8 <= stats.frames <= eos + 8 + 9
            else:
                assert len(pcm) == stats.frames * 512
        assert stats.ttfa_ms is not None and stats.ttfa_ms > 0
        assert stats.audio_s == pytest.approx(len(pcm) / 44100, abs=1e-3)
        assert np.abs(pcm.astype(np.int32)).max() > 0


def test_seeded_request_same_audio_alone_and_in_busy_batch(rt):
    lt, client = rt
    target = dict(text="Reproducible words.", max_frames=60, seed=1234, temperature=1.0)

    async def alone():
        return await collect(client, request(**target))

    async def busy():
        others = [
            collect(client, request(f"noise {i}", 70 + i, seed=None, top_k=5 + i, temperature=0.5 + i / 4))
            for i in range(3)
        ]
        res = await asyncio.gather(*others, collect(client, request(**target)))
        return res[-1]

    a, _, _ = lt.run(alone())
    b, _, _ = lt.run(busy())
    assert len(a) == len(b) == 60 * 512
    # the codes are identical; PCM may differ by float rounding of batched convolutions only
    assert np.abs(a.astype(np.int32) - b.astype(np.int32)).max() <= 1


def test_a_client_without_a_resampler_gets_a_smaller_first_call(rt):
    """first_samples says what the client takes in before its first output: 1 (44.1 kHz, no resampler) makes
    the stream's call 0 10 frames, its first audio record 363 samples after 18 generated frames, where a 24 kHz
    client (1,701) or one that says nothing keeps 13 frames (1,899 samples after 21); the same seed's PCM is
    the same to float rounding (one int16 step). A value out of bounds is that request's bad_request, naming
    the field."""
    lt, client = rt
    target = dict(text="Reproducible words.", max_frames=60, seed=1234, temperature=1.0)

    async def chunks(req: m.SubmitRequest) -> tuple[list[np.ndarray], m.Record]:
        pcm, end = [], None
        async for ev in client.submit(req):
            if isinstance(ev, m.Audio):
                pcm.append(ev.pcm)
            elif isinstance(ev, m.Finished | m.Error):
                end = ev
        assert end is not None
        return pcm, end

    async def go():
        runs = {first: await chunks(replace(request(**target), first_samples=first)) for first in (None, 1, 1701)}
        bad = [await chunks(replace(request("x", 10), first_samples=v)) for v in (-1, m.FIRST_SAMPLES_MAX + 1)]
        return runs, bad, await collect(client, request("after it", 10, seed=1))

    runs, bad, (pcm, after, _) = lt.run(go())
    assert all(end.type == m.FINISHED for _, end in runs.values())
    assert [len(c[0]) for c, _ in runs.values()] == [13 * 512 - 4757, 10 * 512 - 4757, 13 * 512 - 4757]
    whole = [np.concatenate(c) for c, _ in runs.values()]
    assert len(whole[0]) == 60 * 512 and all(np.abs(whole[0].astype(np.int32) - w).max() <= 1 for w in whole[1:])
    for chunks_, end in bad:
        assert not chunks_ and isinstance(end, m.Error) and end.code == "bad_request" and "first_samples" in end.message
    assert after.type == m.FINISHED and len(pcm) == 10 * 512


def test_cancel_frees_the_slot_within_a_step(rt):
    lt, client = rt

    async def go():
        stream = client.submit(request("This will be interrupted.", 900, seed=5))
        async for ev in stream:
            if ev.type == m.AUDIO:
                break
        t0 = time.perf_counter()
        ack = await client.cancel(stream.rid)  # resolves when the engine reports the slot free
        return time.perf_counter() - t0, ack

    round_trip, ack = lt.run(go())
    assert ack is not None and ack.freed is not None
    print(f"cancel -> slot free: {round_trip * 1e3:.1f} ms round trip, {ack.freed.free_ms} ms in the engine")
    assert ack.reason == "cancelled" and ack.freed.free_slots == SLOTS
    assert round_trip < 1.0  # one decode step of the tiny model is ~20 ms on this CPU


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1e308},
        {"repetition_penalty": 1e39},
        {"temperature": float("nan")},
        {"top_p": float("inf")},
        {"temperature": "hot"},
        {"top_k": 2**40},
    ],
)
def test_a_record_outside_the_bounds_is_that_requests_error(rt, params):
    """A value the gateway's door would refuse, sent straight to the engine (an older gateway, a
    bug), is that request's bad_request; the engine lives on and serves the next request."""
    lt, client = rt
    restarts = client.restarts

    async def go():
        bad = m.SubmitRequest(rid=0, prompt=PB.build("x"), params=SamplingParams(), max_frames=10, ignore_eos=True)
        bad.params.__dict__.update(params)  # past the dataclass: what a record off the ring can hold
        return await collect(client, bad), await collect(client, request("after it", 10, seed=1))

    (_, end, _), (pcm, after, _) = lt.run(go())
    assert end.type == m.ERROR and end.code == "bad_request", end
    assert after.type == m.FINISHED and len(pcm) == 10 * 512
    assert client.restarts == restarts


def test_full_queue_refuses_clearly_and_recovers(rt):
    lt, client = rt

    async def go():
        # long enough to hold their slots while all are submitted (~50 ms), short enough not to wait long for
        # the queued ones' first events (they start when these end)
        streams = [client.submit(request(f"long {i}", 300, seed=i)) for i in range(SLOTS + QUEUE + 3)]
        firsts = await asyncio.gather(*(s.next() for s in streams))
        refused = [s for s, ev in zip(streams, firsts, strict=True) if ev.type == m.ERROR]
        codes = {ev.code for ev in firsts if isinstance(ev, m.Error)}
        for s in streams:
            s.cancel()
        after = await collect(client, request("after the storm", 20, seed=9))
        return len(refused), codes, after

    n_refused, codes, (pcm, end, _) = lt.run(go())
    assert n_refused == 3 and codes == {"queue_full"}, (n_refused, codes)
    assert end.type == m.FINISHED and len(pcm) == 20 * 512


def test_bad_requests_get_errors_and_engine_lives(rt):
    lt, client = rt
    cfg = PB.cfg

    async def go():
        too_long = m.SubmitRequest(rid=0, prompt=PB.build("x" * 1100), params=SamplingParams(), max_frames=10)
        bad_params = request("x", 10, temperature=-1.0)
        bad_spk = replace(request("x", 10), speaker_embedding=np.ones(7, np.float32))
        nan_spk = replace(request("x", 10), speaker_embedding=np.full(cfg.speaker_embedding_dim, np.nan, np.float32))
        short_clip = replace(request("x", 10), clip=np.zeros(100, np.float32), clip_sr=24000)
        loud_clip = replace(request("x", 10), clip=np.full(24000, 3e38, np.float32), clip_sr=24000)
        # finite, past EMBEDDING_ABS_MAX: it overflowed the speaker projections, noise to the frame cap
        huge_spk = replace(request("x", 10), speaker_embedding=np.full(cfg.speaker_embedding_dim, 3e38, np.float32))
        requests = (too_long, bad_params, bad_spk, nan_spk, short_clip, loud_clip, huge_spk)
        results = [await collect(client, r) for r in requests]
        ok = await collect(client, request("still fine", 12, seed=1))
        return results, ok

    results, ok = lt.run(go())
    assert [getattr(r[1], "code", None) for r in results] == [
        "prompt_too_long",
        "bad_request",
        "bad_voice",
        "bad_voice",
        "bad_audio",
        "bad_audio",
        "bad_voice",
    ]
    assert ok[1].type == m.FINISHED and cfg.speaker_embedding_dim == 2048


def test_an_engine_without_an_aligner_refuses_align_clearly(rt):
    from app.core.engine_client import EngineRefused

    lt, client = rt
    assert client.info["aligner"] is False and not client.aligns
    with pytest.raises(EngineRefused, match="no aligner") as e:
        lt.run(client.align(np.zeros(44100, np.int16), 44100, "hello"))
    assert e.value.code == "bad_request"
    assert lt.run(collect(client, request("still fine", 8, seed=1)))[1].type == m.FINISHED


def test_voice_embedding_and_clone_walks(rt):
    lt, client = rt
    rng = np.random.default_rng(0)
    clip = (0.1 * rng.standard_normal(44100)).astype(np.float32)

    async def go():
        emb = await client.embed(clip, 44100)
        prompt = PB.build("with a voice", Conditioning(speaker=True))
        by_embedding = replace(request("with a voice", 20, seed=3), prompt=prompt, speaker_embedding=emb)
        by_clip = replace(request("with a voice", 20, seed=3), prompt=prompt, clip=clip, clip_sr=44100)
        a = await collect(client, by_embedding)
        b = await collect(client, by_clip)
        return emb, a, b

    emb, a, b = lt.run(go())
    assert emb.shape == (2048,) and np.isfinite(emb).all()
    # prefill_clone (clip -> speaker_encoder -> LLM) equals prefill with the cached embedding
    assert a[1].type == b[1].type == m.FINISHED
    assert np.array_equal(a[0], b[0])


def test_killed_engine_is_restarted_and_serves_again(rt):
    lt, client = rt

    async def go():
        stream = client.submit(request("in flight when the engine dies", 900, seed=1))
        await stream.next()
        old_pid = client.pid
        client.kill_engine()
        events = [ev async for ev in stream]
        await asyncio.wait_for(client.ready.wait(), 180)
        after = await collect(client, request("back again", 16, seed=2))
        return events[-1], old_pid, client.pid, after

    last, old_pid, new_pid, (pcm, end, _) = lt.run(go(), timeout=240)
    assert last.type == m.ERROR and last.code == "engine_restarted"
    assert new_pid != old_pid and client.restarts >= 1
    assert end.type == m.FINISHED and len(pcm) == 16 * 512


def test_realtime_admission_answers_overload_with_engine_busy_and_a_hint():
    """With realtime admission and a lead floor no playing stream can meet, a newcomer waits its bounded
    time in the queue, then gets engine_busy with a retry hint; the playing stream is untouched."""
    lt = LoopThread()
    settings = EngineSettings(
        device="cpu",
        max_batch=SLOTS,
        max_context=2048,
        admission="realtime",
        admission_max_wait_s=0.3,
        admission_lead_floor_ms=1e7,
        stats_interval_s=0.2,
    )
    client = EngineClient(WeightSources(), settings, ring_bytes=8 << 20)

    async def go() -> tuple[m.Started | m.Audio | m.Finished | m.Error, m.Finished | m.Error, int]:
        await client.start()
        await asyncio.wait_for(client.ready.wait(), 180)
        playing = client.submit(request("a long stream", 2000, seed=1))
        while (ev := await playing.next()).type != m.AUDIO:  # it plays: admission now reads its lead
            assert ev.type == m.STARTED, ev
        newcomer = client.submit(request("a newcomer", 20, seed=2))
        first = await newcomer.next()
        refused = first
        playing.cancel()
        pcm, end, _ = await collect(client, request("after the load", 20, seed=3))
        return refused, end, len(pcm)

    try:
        refused, end, n = lt.run(go(), timeout=300)
    finally:
        lt.run(client.close())
        lt.close()
    assert isinstance(refused, m.Error) and refused.code == "engine_busy", refused
    assert refused.retry_after_ms is not None and refused.retry_after_ms > 0
    assert end.type == m.FINISHED and n == 20 * 512  # once the load is gone, requests start again


def test_a_malformed_record_in_the_inbox_is_refused_and_the_engine_lives(rt):
    """A record that is none of the contract's (engine/contract/records.py), put straight into the engine's
    inbox: one that names a request is that request's bad_request, an unknown type is logged and dropped;
    the engine serves the next request."""
    from app.core.engine_client import Stream

    lt, client = rt
    restarts = client.restarts

    async def go():
        rid = next(client._rid)
        stream = Stream(rid, client, client.max_buffered_samples)
        client._streams[rid] = stream
        assert client._inbox is not None
        assert client._inbox.try_put({"type": m.SUBMIT, "rid": rid, "prompt_frames": "many"})
        assert client._inbox.try_put({"type": "no_such_record", "rid": rid})
        first = await stream.next()
        return first, await collect(client, request("after it", 10, seed=1))

    first, (pcm, after, _) = lt.run(go())
    assert isinstance(first, m.Error) and first.code == "bad_request", first
    assert after.type == m.FINISHED and len(pcm) == 10 * 512
    assert client.restarts == restarts


def test_overlap_engine_process_same_audio_and_cancel_frees_slots(rt):
    """An engine process with overlap scheduling (`overlap_decode`): seeded requests of different lengths
    running together give the audio of the engine without overlap (the module's), and a cancel mid-way is
    acknowledged once its slot is free (one step later: the step in flight still wrote it) with every slot
    free (no audio after the acknowledgement: tests/engine/test_overlap.py)."""
    lt0, plain = rt
    reqs = [
        request("Hello.", 30, seed=1),
        request("A somewhat longer sentence to speak.", 57, seed=2, top_k=20),
        request("Fourth, with the end-of-audio rule.", 400, ignore_eos=False, seed=4),
    ]

    async def batch(client: EngineClient):
        return await asyncio.gather(*(collect(client, r) for r in reqs))

    want = lt0.run(batch(plain))
    lt = LoopThread()
    settings = EngineSettings(
        device="cpu",
        max_batch=SLOTS,
        max_queue=QUEUE,
        max_context=1024,
        prefill_chunk=64,
        stats_interval_s=0.2,
        overlap_decode=True,
    )
    client = EngineClient(WeightSources(), settings, ring_bytes=8 << 20)

    async def go():
        await client.start()
        await asyncio.wait_for(client.ready.wait(), 180)
        got = await batch(client)
        stream = client.submit(request("This will be interrupted.", 900, seed=5))
        async for ev in stream:
            if ev.type == m.AUDIO:
                break
        return got, await client.cancel(stream.rid)

    try:
        got, ack = lt.run(go(), timeout=300)
    finally:
        lt.run(client.close())
        lt.close()
    for (pa, ea, _), (pb, eb, _) in zip(want, got, strict=True):
        assert isinstance(ea, m.Finished) and isinstance(eb, m.Finished) and ea.reason == eb.reason
        assert ea.stats.frames == eb.stats.frames and ea.stats.eos_frame == eb.stats.eos_frame
        assert len(pa) == len(pb) and np.abs(pa.astype(np.int32) - pb.astype(np.int32)).max() <= 1
    assert ack is not None and ack.reason == "cancelled" and ack.freed is not None
    assert ack.freed.free_slots == SLOTS


def test_closing_a_loading_engine_stops_it_at_once():
    """An engine still loading reads no record, so a server stopped while it starts (SIGTERM) ends it rather
    than waiting for it to load and read the Shutdown record."""
    lt = LoopThread()
    client = EngineClient(
        WeightSources(), EngineSettings(device="cpu", max_batch=1, max_context=256), ring_bytes=1 << 20, restart=False
    )

    async def start_and_close() -> None:
        await client.start()  # spawned; its Ready record cannot have been read yet
        assert not client.ready.is_set()
        await client.close()

    try:
        lt.run(start_and_close(), timeout=120)
    finally:
        lt.close()
    assert client._proc is not None and client._proc.exitcode == -signal.SIGTERM


def test_the_client_times_each_start_to_its_first_audio(rt):
    """What the door adds to a newcomer's wait (app/core/door_policy.py FirstAudio): each fresh stream's time
    from its `started` to its first audio record, as the gateway saw them, and once enough starts came, their
    p90 in the load the door reads."""
    lt, client = rt
    client.first_audio.reset()

    async def go() -> None:
        for i in range(4):
            await collect(client, request(f"Start number {i}.", 12, seed=i))

    lt.run(go())
    seen = [s for _, s in client.first_audio._seen]
    assert len(seen) == 4 and all(s > 0 for s in seen)
    last = client.first_audio._seen[-1][0]
    assert client.first_audio.recent(now=last) == sorted(seen)[3]  # of four, the p90 is the slowest


def test_what_a_submitted_request_becomes_or_why_it_cannot_run():
    """engine/runtime/job.py `job_for`, the scheduler's first look at a request (no engine needed): a frame
    budget cut to the context, a guided request's twin, and each refusal's error code."""
    from engine.contract.errors import EngineError as E
    from engine.runtime.job import Refused, job_for

    cfg = PB.cfg
    ok = job_for(request("Hello.", 5000), cfg, max_len=256, n_slots=2, device="cpu")
    assert ok.seq.max_frames == 256 - 1 - ok.seq.prompt_len and ok.guidance is None and ok.slots_needed == 1
    voiced = replace(request("Hello.", 50, cfg_scale=2.0), speaker_embedding=np.zeros(cfg.speaker_embedding_dim, "f4"))
    guided = job_for(voiced, cfg, max_len=256, n_slots=2, device="cpu")
    assert guided.guidance is not None and guided.guidance.kind == "speaker" and guided.twin.rid == -guided.seq.rid
    bad_voice = replace(voiced, speaker_embedding=np.full(cfg.speaker_embedding_dim, np.nan, "f4"))
    for req, n_slots, code in (
        (replace(request("Hello.", 50), prompt=np.zeros((3, 2), np.int64)), 2, E.BAD_REQUEST),
        (request("x" * 600, 50), 2, E.PROMPT_TOO_LONG),
        (request("Hello.", 50, top_k=-3), 2, E.BAD_REQUEST),
        (bad_voice, 2, E.BAD_VOICE),
        (voiced, 1, E.CANNOT_FIT),  # a twin needs a second slot
    ):
        with pytest.raises(Refused) as got:
            job_for(req, cfg, max_len=256, n_slots=n_slots, device="cpu")
        assert got.value.code == code, (code, str(got.value))
