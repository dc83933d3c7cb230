"""Continuation across sentences: one DAC stream for a reply of several chunks, the kept
frames the engine returns, the continued prompt, the held tail's flush, cancel in the middle (CPU, tiny)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # the fused Snake runs in Triton's interpreter (before anything imports it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.dac.codec import HOP, Codec
from engine.dac.schedule import DELAY, ChunkSchedule
from engine.dac.streaming import StreamingDecoder, decode_offline, to_int16
from engine.frontend.longform import BOUNDARY_TRIM, trim_chunk_codes, windowed_context_indices
from tests.engine.test_dac_streaming import snr_db

EXACT_DB = 100.0  # streamed vs one-shot, fp32 on CPU: float rounding only (as tests/engine/test_dac_streaming.py)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def codec() -> Codec:
    return Codec.random("tiny", seed=0)


def chunk(rng: np.random.Generator, eos: int, c: int) -> tuple[np.ndarray, int, int]:
    """A chunk as the engine generates it: an EOA in codebook c at step eos + c fixes its end at `eos`
    (engine/llm/eos.py) and generation stops 9 frames later. (frames, eos, the step the EOS is known)."""
    frames = rng.integers(0, 1024, (eos + c + 10, 9))
    return frames, eos, eos + c


def run_chunks(
    dec: StreamingDecoder,
    rid: int,
    chunks: list[tuple[np.ndarray, int, int]],
    final_last: bool,
    first_samples: int | None = None,
) -> tuple[list[np.ndarray], list[int]]:
    """Stream the chunks into one stream as the scheduler does: frame by frame, the EOS when the engine
    knows it; every chunk but the last (or all, final_last False) held. Returns (PCM pieces, kept lengths).
    Checks after every step that nothing past a chunk's eventual kept end was fed to the decoder."""
    out: list[np.ndarray] = []
    kept: list[int] = []
    offset = 0
    for i, (frames, eos, known) in enumerate(chunks):
        last = i == len(chunks) - 1
        hold = not (last and final_last)
        if i == 0:
            dec.open(rid, hold=hold, first_samples=first_samples)
        else:
            dec.resume(rid, hold=hold)
        bound = offset + eos - BOUNDARY_TRIM - DELAY  # the chunk's kept end, in complete aligned frames
        for k, f in enumerate(frames):
            dec.push(rid, f, eos_frame=eos if k >= known else None)
            out += [pcm for _, pcm, _ in dec.step(as_float=True)]
            if hold:
                assert dec._reqs[rid].fed <= max(0, bound)
        if hold:
            kept.append(dec.hold(rid, eos))
            assert kept[-1] == eos - BOUNDARY_TRIM and dec.held(rid)
            out += [pcm for _, pcm, _ in dec.step(as_float=True)]
            assert dec._reqs[rid].fed <= max(0, offset + kept[-1] - DELAY)
            offset += kept[-1]
        else:
            dec.finish(rid, eos)
    return out, kept


def expected(codec: Codec, chunks: list[tuple[np.ndarray, int, int]]) -> np.ndarray:
    """One-shot decode of the kept frames of every chunk but the last, then the last chunk's frames, to
    the last chunk's end of audio: what the reference's one vocoder stream plays."""
    parts = [trim_chunk_codes(f, e, BOUNDARY_TRIM) for f, e, _ in chunks[:-1]]
    offset = sum(len(p) for p in parts)
    frames, eos, _ = chunks[-1]
    return decode_offline(codec, np.concatenate([*parts, frames]), offset + eos)


@pytest.mark.parametrize(
    "schedule", [ChunkSchedule(), ChunkSchedule(frames=7, first_frames=3)], ids=["default", "3 then 7"]
)
def test_five_chunks_are_one_stream_equal_to_one_shot(codec: Codec, schedule: ChunkSchedule):
    rng = np.random.default_rng(5)
    chunks = [chunk(rng, eos, c) for eos, c in [(40, 8), (31, 0), (25, 4), (60, 2), (33, 8)]]
    dec = StreamingDecoder(codec, schedule, slots=4)
    out, kept = run_chunks(dec, 9, chunks, final_last=True)
    out += [pcm for _, pcm, _ in dec.step(as_float=True)]
    x = np.concatenate(out)
    ref = expected(codec, chunks)
    assert kept == [e - BOUNDARY_TRIM for _, e, _ in chunks[:-1]]
    assert len(x) == len(ref) == (sum(kept) + chunks[-1][1]) * HOP
    assert snr_db(ref, x) >= EXACT_DB
    assert dec.active() == 0 and len(dec._free) == 4  # the one slot is back


def test_a_continued_stream_with_a_smaller_first_call_is_the_same_stream(codec: Codec):
    """A client without a resampler (first_samples=1): the stream's call 0 has 10 frames, and the joins after it
    change nothing: its PCM equals the 13-frame stream's (to float rounding: one int16 step) and the one-shot decode."""
    rng = np.random.default_rng(5)
    chunks = [chunk(rng, eos, c) for eos, c in [(40, 8), (31, 0), (25, 4)]]
    pcm = {}
    for first in (None, 1):
        dec = StreamingDecoder(codec, slots=2)
        sizes: list[int] = []

        def run(x: torch.Tensor, f: int, run=dec.net.run, sizes=sizes) -> torch.Tensor:
            sizes.append(f)
            return run(x, f)

        dec.net.run = run  # type: ignore[method-assign]
        out, _ = run_chunks(dec, 3, chunks, final_last=True, first_samples=first)
        out += [p for _, p, _ in dec.step(as_float=True)]
        pcm[first] = to_int16(np.concatenate(out))
        assert sizes[0] == (13 if first is None else 10)
    assert len(pcm[None]) == len(pcm[1]) and np.abs(pcm[None].astype(np.int32) - pcm[1]).max() <= 1
    assert snr_db(expected(codec, chunks), pcm[1] / 32767.0) > 60  # int16 rounding


def test_a_held_stream_flushed_ends_at_its_last_chunks_end_of_audio(codec: Codec):
    rng = np.random.default_rng(6)
    chunks = [chunk(rng, eos, c) for eos, c in [(30, 3), (45, 8)]]
    dec = StreamingDecoder(codec, slots=2)
    out, _ = run_chunks(dec, 1, chunks, final_last=False)
    assert dec.held(1) and not dec.pending()  # the tail waits for a next chunk
    dec.flush(1)
    finals = dec.step(as_float=True)
    assert [f for _, _, f in finals] == [True]
    x = np.concatenate(out + [pcm for _, pcm, _ in finals])
    ref = expected(codec, chunks)  # the flushed last chunk ends as a final one would: at its EOS
    assert len(x) == len(ref) and snr_db(ref, x) >= EXACT_DB
    assert dec.active() == 0


def test_a_held_chunk_without_end_of_audio_keeps_all_but_the_trim(codec: Codec):
    frames = np.random.default_rng(7).integers(0, 1024, (50, 9))
    dec = StreamingDecoder(codec, slots=2)
    dec.open(2, hold=True, track_eos=False)  # ignore_eos: the chunk ends at max_frames
    for f in frames:
        dec.push(2, f)
        dec.step()
        assert dec._reqs[2].fed <= 50 - BOUNDARY_TRIM - DELAY
    assert dec.hold(2, None) == 50 - BOUNDARY_TRIM


def test_the_first_call_after_a_join_never_waits_for_a_batch(codec: Codec):
    """Steady calls wait up to max_hold launches for others to batch with (launch's min_batch), but the first
    call after `resume` is the audio at a sentence join, whose listener is playing the held tail: it goes the
    launch it is ready, as with no batching at all; the steady calls after it wait as usual."""
    rng = np.random.default_rng(3)
    first, second = chunk(rng, 30, 2), chunk(rng, 40, 5)

    def launches(max_hold: int) -> list[int]:
        dec = StreamingDecoder(codec, ChunkSchedule(frames=2, first_frames=2), slots=2)
        run_chunks(dec, 5, [first], final_last=False)  # chunk one played; its stream is held
        dec.resume(5, hold=False)
        out = []
        for f in second[0][:16]:
            dec.push(5, f)
            out.append(dec.launch(min_batch=4, max_hold=max_hold))
            dec.collect(wait=True)
        return out

    batched, alone = launches(3), launches(0)
    join = next(i for i, n in enumerate(alone) if n)
    assert batched[:join] == alone[:join] == [0] * join and batched[join] > 0  # the join's call: at once
    assert sum(batched[join + 1 :]) < sum(alone[join + 1 :])  # later steady calls did wait for a batch


def test_drop_in_the_middle_of_a_continued_stream_frees_its_slot(codec: Codec):
    rng = np.random.default_rng(8)
    chunks = [chunk(rng, 30, 2), chunk(rng, 40, 5)]
    dec = StreamingDecoder(codec, slots=2)
    run_chunks(dec, 4, chunks[:1], final_last=False)
    dec.resume(4, hold=True)
    for f in chunks[1][0][:20]:
        dec.push(4, f)
        dec.step()
    dec.drop(4)
    assert dec.step() == [] and dec.active() == 0 and len(dec._free) == 2


# ---- the engine (a real engine process, CPU, tiny model) --------------------------------------------------


@pytest.fixture(scope="module")
def rt():
    from engine.contract.settings import EngineSettings
    from tests.asyncloop import running_engine

    # a long flush lead: on 2 busy cores the next chunk must never lose the race to the flush
    settings = EngineSettings(
        device="cpu",
        max_batch=4,
        max_queue=4,
        max_context=1024,
        prefill_chunk=64,
        stats_interval_s=0.2,
        continuation_flush_lead_ms=-1e9,
        continuation_grace_ms=1e9,
    )
    with running_engine(settings) as rt:
        yield rt


TEXTS = ["One.", "Two two.", "Three three three.", "Four.", "Five five."]


def _builder():
    from engine.frontend.config import Zonos2Config, preset_params
    from engine.frontend.prompt import PromptBuilder

    return PromptBuilder(Zonos2Config.from_dict(preset_params("tiny")))


async def _read(stream, out: list[np.ndarray]):
    """The stream's audio into out; its last record (a Finished or an Error)."""
    from engine.contract import records as m

    async for ev in stream:
        if ev.type == m.AUDIO:
            out.append(ev.pcm)
        elif ev.type in (m.FINISHED, m.ERROR):
            return ev
    return None


def _submit_chain(client, texts: list[str], hold_last: bool, max_frames: int = 40):
    """Submit the chunks one after another as the gateway does: each continues the kept frames the one
    before sent (build_continuation of them); returns (streams, kept frames, prompts)."""
    import asyncio

    from engine.contract import records as m
    from engine.contract.records import SamplingParams
    from engine.frontend.longform import Continuation

    pb = _builder()
    cont = Continuation()
    streams, kept, prompts = [], [], []

    async def go():
        prev = None
        for i, text in enumerate(texts):
            final = i == len(texts) - 1 and not hold_last
            if prev is None:
                prompt = pb.build(text, non_final=not final)
            else:
                await asyncio.wait_for(prev.kept_ready.wait(), 120)
                assert prev.kept is not None
                kept.append(prev.kept)
                cont.add(texts[i - 1], prev.kept)
                ctx_text, ctx_codes = cont.window()
                prompt = pb.build_continuation(ctx_text, text, ctx_codes, non_final=not final)
            prompts.append(prompt)
            req = m.SubmitRequest(
                rid=0,
                prompt=prompt,
                params=SamplingParams(seed=11 + i),
                max_frames=max_frames,
                ignore_eos=True,
                hold=not final,
                continues=prev.rid if prev else 0,
            )
            prev = client.submit(req)
            streams.append(prev)
        if hold_last:
            await asyncio.wait_for(prev.kept_ready.wait(), 120)
            kept.append(prev.kept)

    return go, streams, kept, prompts


def test_a_reply_of_five_requests_is_one_stream_and_each_prompt_continues_the_kept_frames(rt, codec: Codec):
    five_requests(*rt, codec, min_snr_db=60)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_reply_of_five_requests_is_one_stream(codec: Codec):
    """The same through the GPU engine: captured decode graphs and DAC graphs (fp32 DAC, compared with the
    one-shot decode on the CPU: cuDNN's algorithms differ in rounding only)."""
    import asyncio

    from app.core.engine_client import EngineClient
    from engine.contract.settings import EngineSettings, WeightSources
    from tests.asyncloop import LoopThread

    lt = LoopThread()
    settings = EngineSettings(
        device="cuda",
        max_batch=8,
        max_context=1024,
        compile=False,
        dac_dtype="float32",
        stats_interval_s=0.2,
        continuation_flush_lead_ms=-1e9,
        continuation_grace_ms=1e9,
    )
    client = EngineClient(WeightSources(), settings, ring_bytes=8 << 20)

    async def start() -> None:
        await client.start()
        await asyncio.wait_for(client.ready.wait(), 600)

    try:
        lt.run(start(), timeout=700)
        five_requests(lt, client, codec, min_snr_db=40)
    finally:
        lt.run(client.close())
        lt.close()


def five_requests(lt, client, codec: Codec, min_snr_db: float) -> None:
    """Five sentences submitted as the gateway does (each continuing the one before), the last ended with
    `end`: each prompt continues the kept frames the engine returned, each request's audio is its kept
    frames', and the whole is the one-shot decode of the kept frames end to end."""
    import asyncio

    from engine.contract import records as m
    from engine.dac.streaming import to_int16

    go, streams, kept, prompts = _submit_chain(client, TEXTS, hold_last=True)
    pcm: list[np.ndarray] = []
    sizes: list[int] = []

    async def run():
        submit = asyncio.create_task(go())
        ends = []
        while len(ends) < len(TEXTS):
            while len(streams) <= len(ends):
                await asyncio.sleep(0.01)
            if len(ends) == len(TEXTS) - 1:
                await submit
                streams[-1].end()  # no sixth sentence: the last one's tail is flushed now
            own: list[np.ndarray] = []
            ends.append(await _read(streams[len(ends)], own))
            sizes.append(sum(len(p) for p in own))
            pcm.extend(own)
        return ends

    ends = lt.run(run(), timeout=600)
    assert [e.type for e in ends] == [m.FINISHED] * 5 and all(e.reason == "max_frames" for e in ends)
    assert [len(k) for k in kept] == [40 - BOUNDARY_TRIM] * 5  # ignore_eos: all frames less the trim
    # every prompt after the first continues exactly the frames the engine returned: the default window
    # (the chunk before, and the first chunk pinned in front once it has left that tail)
    pb = _builder()
    for i in range(1, 5):
        idx = windowed_context_indices(i, 1, pin_anchor=True)
        assert idx == ([0] if i == 1 else [0, i - 1])
        ref = pb.build_continuation(
            " ".join(TEXTS[j] for j in idx), TEXTS[i], np.concatenate([kept[j] for j in idx]), non_final=True
        )
        assert np.array_equal(prompts[i], ref)
    # each request's own audio is its kept frames' (the stream's audio is split where they end); the
    # flushed last chunk keeps all its frames
    assert sizes == [len(k) * HOP for k in kept[:4]] + [40 * HOP]
    x = np.concatenate(pcm)
    total = sum(len(k) for k in kept[:4]) + 40
    assert len(x) == total * HOP
    # one DAC stream: the audio is the one-shot decode of the kept frames end to end (up to the last
    # chunk's end, which the flush decodes with frames the kept ones lack)
    ref = to_int16(decode_offline(codec, np.concatenate(kept)))
    n = (sum(len(k) for k in kept) - DELAY - 10) * HOP
    assert snr_db(ref[:n].astype(np.float64), x[:n].astype(np.float64)) > min_snr_db


def test_a_final_request_that_keeps_its_frames_gets_them_and_plays_the_same_audio(rt, codec: Codec):
    """keep_frames (request stitching, app/core/stitching.py): a final request's frames up to its end come in
    a `kept` record before its `finished`, for a fresh request and for the last chunk of a continued reply
    (its own chunk's frames); its audio is the same as without, and it is the decode of those frames."""
    import asyncio

    from engine.contract import records as m
    from engine.contract.records import SamplingParams
    from engine.dac.streaming import to_int16

    lt, client = rt
    pb = _builder()
    seen: list[tuple[str, int]] = []
    on_event = client._on_event

    def observe(header, payload):
        seen.append((header.get("type"), header.get("rid")))
        on_event(header, payload)

    async def one(keep: bool):
        req = m.SubmitRequest(
            rid=0,
            prompt=pb.build("Keep these frames."),
            params=SamplingParams(seed=5),
            max_frames=30,
            ignore_eos=True,
            keep_frames=keep,
        )
        stream, out = client.submit(req), []
        end = await _read(stream, out)
        return stream, end, np.concatenate(out)

    async def chain():  # two chunks, the final one keeping its frames
        first = client.submit(
            m.SubmitRequest(
                rid=0,
                prompt=pb.build("One.", non_final=True),
                params=SamplingParams(seed=6),
                max_frames=20,
                ignore_eos=True,
                hold=True,
            )
        )
        await asyncio.wait_for(first.kept_ready.wait(), 120)
        second = client.submit(
            m.SubmitRequest(
                rid=0,
                prompt=pb.build_continuation("One.", "Two.", first.kept),
                params=SamplingParams(seed=7),
                max_frames=12,
                ignore_eos=True,
                continues=first.rid,
                keep_frames=True,
            )
        )
        await _read(first, [])
        await _read(second, [])
        return second

    client._on_event = observe
    try:
        kept, end, audio = lt.run(one(True), timeout=600)
        plain, plain_end, plain_audio = lt.run(one(False), timeout=600)
        second = lt.run(chain(), timeout=600)
    finally:
        client._on_event = on_event
    assert end.reason == plain_end.reason == "max_frames"
    assert kept.kept is not None and kept.kept.shape == (30, 9) and plain.kept is None  # ignore_eos: every frame
    assert seen.index((m.KEPT, kept.rid)) < seen.index((m.FINISHED, kept.rid))
    assert (m.KEPT, plain.rid) not in seen
    assert np.array_equal(audio, plain_audio)  # keeping the frames changes nothing of the request's audio
    ref = to_int16(decode_offline(codec, kept.kept))
    n = (30 - DELAY - 10) * HOP
    assert snr_db(ref[:n].astype(np.float64), audio[:n].astype(np.float64)) > 60
    assert second.kept is not None and second.kept.shape == (12, 9)  # its own chunk's frames, not the first's


def test_cancel_in_the_middle_of_a_continued_reply(rt):
    """The second request of a reply is cancelled while it generates: no audio of it after the engine's
    acknowledgement, and every LLM and DAC slot is free again."""
    import asyncio

    from engine.contract import records as m

    lt, client = rt
    go, streams, _, _ = _submit_chain(client, TEXTS[:2], hold_last=True, max_frames=300)
    seen: list[tuple[str, int]] = []
    on_event = client._on_event

    def observe(header, payload):  # the events as they arrive from the engine, in order
        seen.append((header.get("type"), header.get("rid")))
        on_event(header, payload)

    client._on_event = observe

    async def run():
        submit = asyncio.create_task(go())
        while len(streams) < 1:
            await asyncio.sleep(0.01)
        assert (await _read(streams[0], [])).reason == "max_frames"  # finished once the second took over
        await submit
        second = streams[1]
        ev = await second.next()
        while ev.type != m.AUDIO:  # its own audio is playing: the middle of the reply
            ev = await second.next()
        ack = await client.cancel(second.rid)
        await asyncio.sleep(0.5)
        return second.rid, ack

    try:
        rid, ack = lt.run(run(), timeout=600)
    finally:
        client._on_event = on_event
    assert ack is not None and ack.reason == "cancelled"
    after = seen[seen.index((m.FINISHED, rid)) + 1 :]
    assert (m.AUDIO, rid) not in after and (m.KEPT, rid) not in after

    async def idle():  # every slot is free again: the engine's stats say so
        for _ in range(200):
            if client.stats is not None and client.stats.free_slots == 4 and client.stats.active == 0:
                return True
            await asyncio.sleep(0.05)
        return False

    assert lt.run(idle(), timeout=30)


def test_a_held_stream_with_no_next_chunk_is_flushed_on_its_own():
    """No next sentence and no `end`: the engine finishes the held stream when its player runs low (the
    default flush lead), with every frame of the chunk's audio."""
    import asyncio

    from app.core.engine_client import EngineClient
    from engine.contract import records as m
    from engine.contract.records import SamplingParams
    from engine.contract.settings import EngineSettings, WeightSources
    from tests.asyncloop import LoopThread

    lt = LoopThread()
    client = EngineClient(
        WeightSources(),
        EngineSettings(device="cpu", max_batch=2, max_context=512, stats_interval_s=0.2),
        ring_bytes=8 << 20,
    )

    async def run():
        await client.start()
        await asyncio.wait_for(client.ready.wait(), 180)
        req = m.SubmitRequest(
            rid=0,
            prompt=_builder().build("Hello there.", non_final=True),
            params=SamplingParams(seed=3),
            max_frames=60,
            ignore_eos=True,
            hold=True,
        )
        stream = client.submit(req)
        pcm: list[np.ndarray] = []
        end = await asyncio.wait_for(_read(stream, pcm), 120)
        return stream, end, np.concatenate(pcm)

    try:
        stream, end, x = lt.run(run(), timeout=300)
    finally:
        lt.run(client.close())
        lt.close()
    assert end.type == m.FINISHED and end.reason == "max_frames"
    assert stream.kept is not None and len(stream.kept) == 60 - BOUNDARY_TRIM
    assert len(x) == 60 * HOP  # flushed as a final chunk: all 60 frames (ignore_eos), not the kept 57


def _run_observed(settings, body):
    """An engine process with `settings`; body(client, seen) runs once it is ready, with `seen` the (type, rid)
    of every event in the order the engine sent them. Returns (body's result, seen)."""
    import asyncio

    from app.core.engine_client import EngineClient
    from engine.contract.settings import WeightSources
    from tests.asyncloop import LoopThread

    lt = LoopThread()
    client = EngineClient(WeightSources(), settings, ring_bytes=8 << 20)
    seen: list[tuple[str, int]] = []

    async def run():
        await client.start()
        await asyncio.wait_for(client.ready.wait(), 180)
        on_event = client._on_event

        def observe(header, payload):
            seen.append((header.get("type"), header.get("rid")))
            on_event(header, payload)

        client._on_event = observe
        return await body(client, seen)

    try:
        return lt.run(run(), timeout=400), seen
    finally:
        lt.run(client.close())
        lt.close()


def test_a_continuation_goes_before_newcomers_that_admission_holds_back():
    """Under load (realtime admission with a lead floor no playing stream meets: no new stream may start),
    the next chunk of a playing reply is still admitted at once, ahead of a newcomer that arrived before it:
    it carries on a stream whose listener is playing the held tail, so waiting would be a stall at the join.
    The newcomer starts only when the reply is done."""
    import asyncio

    from engine.contract import records as m
    from engine.contract.records import SamplingParams
    from engine.contract.settings import EngineSettings

    settings = EngineSettings(
        device="cpu",
        max_batch=4,
        max_context=1024,
        stats_interval_s=0.2,
        admission="realtime",
        admission_lead_floor_ms=1e7,
        admission_max_wait_s=120,
        continuation_flush_lead_ms=-1e9,
        continuation_grace_ms=1e9,
    )
    pb = _builder()

    async def body(client, seen):
        first = client.submit(
            m.SubmitRequest(
                rid=0,
                prompt=pb.build("One.", non_final=True),
                params=SamplingParams(seed=1),
                max_frames=30,
                ignore_eos=True,
                hold=True,
            )
        )
        await asyncio.wait_for(first.kept_ready.wait(), 120)
        newcomer = client.submit(
            m.SubmitRequest(
                rid=0, prompt=pb.build("A newcomer."), params=SamplingParams(seed=2), max_frames=10, ignore_eos=True
            )
        )
        prompt = pb.build_continuation("One.", "Two two.", first.kept, non_final=False)
        second = client.submit(
            m.SubmitRequest(
                rid=0, prompt=prompt, params=SamplingParams(seed=3), max_frames=30, ignore_eos=True, continues=first.rid
            )
        )
        ends = await asyncio.wait_for(asyncio.gather(_read(first, []), _read(second, []), _read(newcomer, [])), 240)
        return first.rid, second.rid, newcomer.rid, ends

    (a, b, n, ends), seen = _run_observed(settings, body)
    assert [e.type for e in ends] == [m.FINISHED] * 3, ends
    assert seen.index((m.STARTED, b)) < seen.index((m.STARTED, n))  # the continuation went first
    assert seen.index((m.FINISHED, a)) < seen.index((m.STARTED, n))  # the newcomer waited for the reply's end
    assert seen.index((m.FINISHED, b)) < seen.index((m.STARTED, n))


def test_a_continuation_prompt_is_prefilled_before_a_newcomer_admitted_earlier():
    """Prompts are prefilled a bounded chunk per iteration; a reply's next chunk (its listener is playing the
    held tail) takes the chunks before a newcomer's long prompt, even one admitted first: its first audio
    comes first."""
    import asyncio

    from engine.contract import records as m
    from engine.contract.records import SamplingParams
    from engine.contract.settings import EngineSettings

    settings = EngineSettings(
        device="cpu",
        max_batch=4,
        max_context=1024,
        stats_interval_s=0.2,
        prefill_chunk=16,
        admission="slots",
        continuation_flush_lead_ms=-1e9,
        continuation_grace_ms=1e9,
    )
    pb = _builder()

    async def body(client, seen):
        first = client.submit(
            m.SubmitRequest(
                rid=0,
                prompt=pb.build("One.", non_final=True),
                params=SamplingParams(seed=1),
                max_frames=20,
                ignore_eos=True,
                hold=True,
            )
        )
        await asyncio.wait_for(first.kept_ready.wait(), 120)
        long_prompt = pb.build("A newcomer with a long story to tell, " * 16)
        assert len(long_prompt) > 20 * 16  # many prefill calls
        newcomer = client.submit(
            m.SubmitRequest(rid=0, prompt=long_prompt, params=SamplingParams(seed=2), max_frames=5, ignore_eos=True)
        )
        while (m.STARTED, newcomer.rid) not in seen:  # admitted (a slot was free), its prefill under way
            await asyncio.sleep(0.005)
        prompt = pb.build_continuation("One.", "Two two.", first.kept, non_final=False)
        second = client.submit(
            m.SubmitRequest(
                rid=0, prompt=prompt, params=SamplingParams(seed=3), max_frames=20, ignore_eos=True, continues=first.rid
            )
        )
        ends = await asyncio.wait_for(asyncio.gather(_read(first, []), _read(second, []), _read(newcomer, [])), 240)
        return second.rid, newcomer.rid, len(prompt), ends

    (b, n, b_len, ends), seen = _run_observed(settings, body)
    assert [e.type for e in ends] == [m.FINISHED] * 3, ends
    assert b_len < 20 * 16
    assert seen.index((m.AUDIO, b)) < seen.index((m.AUDIO, n))


# ---- the gateway's chain (app/core/continuation.py) -------------------------------------------------------------
class _Held:
    """A submitted request as the chain sees it: its rid, its kept frames once they came, end()."""

    def __init__(self, rid: int) -> None:
        import asyncio

        self.rid, self.kept, self.kept_ready, self.ended = rid, None, asyncio.Event(), False

    def end(self) -> None:
        self.ended = True


def test_chain_windows_in_order_restarts_after_a_failure_and_ends():
    import asyncio

    from app.core.continuation import Chain
    from engine.frontend.longform import LongFormOptions

    async def go():
        chain = Chain(LongFormOptions(window_chunks=2, pin_anchor=True))
        links = [chain.link() for _ in range(5)]
        kept = [np.full((4 + i, 9), i, np.int64) for i in range(5)]
        contexts = [asyncio.create_task(chain.context(ln)) for ln in links[1:]]  # all waiting, in order
        streams = []
        for i, ln in enumerate(links[:3]):
            s = _Held(10 + i)
            ln.settle(f"s{i}.", s)
            s.kept = kept[i]
            s.kept_ready.set()
            streams.append(s)
        c1, c2 = await contexts[0], await contexts[1]
        c3 = await contexts[2]
        links[3].settle()  # its request failed: the next starts over
        c4 = await contexts[3]
        chain.end()  # the last link is final (not submitted yet)
        return c1, c2, c3, c4, links, streams

    c1, c2, c3, c4, links, streams = asyncio.run(go())
    assert (c1.text, c1.prev.rid) == ("s0.", 10) and np.array_equal(c1.codes, np.full((4, 9), 0))
    assert c2.text == "s0. s1." and c2.prev.rid == 11 and len(c2.codes) == 4 + 5  # the first pinned in front
    assert c3.text == "s0. s2." and c3.prev.rid == 12 and len(c3.codes) == 4 + 6  # the middle evicted
    assert [t for t, _ in c3.smaller] == ["s2.", ""]  # without the anchor, then fresh
    assert c4.prev is None and c4.codes.size == 0
    assert links[4].final and not any(s.ended for s in streams)


# ---- through the gateway (a real server: HTTP) --------------------------------------------------------------
@pytest.mark.slow
def test_http_reply_is_continued_by_default_and_long_form_false_turns_it_off(server):
    import httpx

    from engine.frontend.longform import reply_frames

    def speak(**params) -> int:
        r = httpx.post(
            server.url + "/v1/audio/speech",
            timeout=120,
            json={
                "input": "One. Two. Three.",
                "response_format": "pcm",
                "sample_rate": 44100,
                "params": {"max_frames": 20, "ignore_eos": True, "seed": 2, **params},
            },
        )
        assert r.status_code == 200, r.text
        return len(r.content) // 2

    assert speak() == reply_frames([20] * 3) * HOP  # one stream: the first two keep all but 3 frames
    assert speak(long_form=False) == 3 * 20 * HOP  # three independent requests


@pytest.mark.slow
def test_http_guided_continued_reply_with_a_voice(server):
    """Speaker CFG and prefix CFG on a continued reply with a voice: every sentence spoken, all its frames."""
    import io

    import httpx

    from engine.frontend.longform import reply_frames

    buf = io.BytesIO()
    np.save(buf, np.random.default_rng(5).standard_normal(2048).astype(np.float32))
    r = httpx.post(
        server.url + "/v1/voices", files={"embedding": ("g.npy", buf.getvalue())}, data={"name": "G"}, timeout=60
    )
    assert r.status_code in (200, 201), r.text
    r = httpx.post(
        server.url + "/v1/audio/speech",
        timeout=180,
        json={
            "input": "One. Two. Three.",
            "voice": r.json()["id"],
            "response_format": "pcm",
            "sample_rate": 44100,
            "params": {"max_frames": 20, "ignore_eos": True, "cfg_scale": 2.0, "prefix_cfg_scale": 1.5},
        },
    )
    assert r.status_code == 200, r.text
    assert len(r.content) // 2 == reply_frames([20] * 3) * HOP
