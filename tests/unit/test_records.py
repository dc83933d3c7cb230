"""The records between the gateway and the engine (engine/contract/records.py): every one survives the trip
through a shared-memory ring unchanged, and a record that is none of the contract's is refused cleanly, by
the decoder and by the gateway's dispatch (the engine's side: tests/engine/test_runtime.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from app.core.engine_client import EngineClient, Stream
from engine.contract import records as m
from engine.contract.errors import EngineError as E
from engine.contract.rings import ShmRing
from engine.contract.settings import EngineSettings, WeightSources

RNG = np.random.default_rng(0)
STATS = m.RequestStats(
    queue_ms=1.5,
    prefill_wait_ms=0.25,
    prefill_ms=12.0,
    first_chunk_ms=30.0,
    ttfa_ms=43.75,
    e2e_ms=800.0,
    prompt_frames=42,
    frames=60,
    eos_frame=51,
    audio_s=0.5921,
    rtf=1.351,
    speaker_encoder_ms=0.0,
    continued=True,
)

RECORDS: list[m.Record] = [
    # gateway -> engine
    m.SubmitRequest(
        rid=1,
        prompt=RNG.integers(0, 1025, (7, 10)),
        params=m.SamplingParams(seed=3, top_k=5),
        max_frames=100,
        first_samples=1701,
    ),
    m.SubmitRequest(
        rid=2,
        prompt=RNG.integers(0, 1025, (5, 10)),
        params=m.SamplingParams(cfg_scale=2.0),
        max_frames=50,
        ignore_eos=True,
        speaker_embedding=RNG.standard_normal(16).astype(np.float32),
        hold=True,
        continues=1,
        uncond_prompt=RNG.integers(0, 1025, (3, 10)),
    ),
    m.SubmitRequest(
        rid=3,
        prompt=RNG.integers(0, 1025, (2, 10)),
        params=m.SamplingParams(),
        max_frames=9,
        clip=RNG.standard_normal(300).astype(np.float32),
        clip_sr=16000,
        first_samples=m.FIRST_SAMPLES_MAX,
    ),
    m.Cancel(4),
    m.End(5),
    m.Embed(6, 24000, RNG.standard_normal(1000).astype(np.float32)),
    m.Align(13, (RNG.standard_normal(4410) * 1000).astype(np.int16), 44100, "Hello, wörld — 42!"),
    m.Align(14, np.zeros(0, np.int16), 16000, ""),
    m.Shutdown(),
    # engine -> gateway
    m.Ready(
        device="cpu",
        dac_device="cpu",
        slots=4,
        max_context=1024,
        load_s=1.25,
        quantization="none",
        weights={"model": "random tiny ZONOS2 (seed 0)"},
        speaker_dim=2048,
        pid=1234,
        warmup_s=0.5,
        aligner=True,
    ),
    m.Started(7, queue_ms=3.25),
    m.Audio(7, 0, (RNG.standard_normal(512) * 1000).astype(np.int16)),
    m.Audio(7, 1, np.zeros(0, np.int16)),  # a final call with no samples left
    m.Kept(8, RNG.integers(0, 1024, (37, 9)), eos_frame=None),
    m.Kept(8, np.zeros((0, 9), np.int64), eos_frame=3),
    m.Finished(7, "eos", stats=STATS),
    m.Finished(9, m.CANCELLED, freed=m.CancelStats(free_ms=0.125, free_slots=3, frames=17)),
    m.Finished(10, m.CANCELLED, freed=m.CancelStats(free_ms=0.0, free_slots=4)),
    m.Finished(11, m.CANCELLED),
    m.Error(12, E.ENGINE_BUSY, "every stream is playing", retry_after_ms=250),
    m.Error(None, E.ENGINE_START_FAILED, "no weights"),
    m.Embedding(6, RNG.standard_normal(2048).astype(np.float32)),
    m.Aligned(13, (("Hello,", 0.02, 0.4), ("wörld", 0.4, 0.81), ("—", 0.81, 0.81), ("42!", 0.81, 1.3))),
    m.Aligned(14, ()),
    m.Stats(
        active=2,
        waiting=1,
        free_slots=2,
        step_ms_p50=21.5,
        period_ms=22.0,
        min_slack_ms=None,
        plain_period_ms=6.8,
        sprint_cost_ms=3.4,
        admissible=1,
        dac_in_flight=1,
        outbox_bytes=0,
        steps=100,
        prefill_frames=64,
        decode_frames=200,
        finished=3,
        cancelled=1,
    ),
    m.Stats(),
    m.SubmitRequest(
        rid=13, prompt=RNG.integers(0, 1025, (4, 10)), params=m.SamplingParams(), max_frames=8, keep_frames=True
    ),
    m.Reset(),  # (last: the tests above index this list)
]


@pytest.fixture
def ring() -> Iterator[ShmRing]:
    r = ShmRing.create(1 << 20)
    yield r
    r.close()
    r.unlink()


def through(ring: ShmRing, rec: m.Record) -> m.Record:
    assert ring.try_put(*rec.encode())
    got = ring.get()
    assert got is not None
    return m.decode(*got)


@pytest.mark.parametrize("rec", RECORDS, ids=lambda r: f"{r.type}")
def test_every_record_survives_the_ring(ring, rec):
    back = through(ring, rec)
    assert type(back) is type(rec) and back == rec
    assert back.type == rec.type


def test_every_record_type_is_covered():
    assert {type(r) for r in RECORDS} == set(m.REQUESTS + m.EVENTS)
    assert [c.type for c in m.REQUESTS] == [m.SUBMIT, m.CANCEL, m.END, m.EMBED, m.ALIGN, m.RESET, m.SHUTDOWN]
    assert [c.type for c in m.EVENTS] == [
        m.READY,
        m.STARTED,
        m.AUDIO,
        m.KEPT,
        m.FINISHED,
        m.ERROR,
        m.EMBEDDING,
        m.ALIGNED,
        m.STATS,
    ]


def test_records_are_frozen_and_compare_arrays_by_value():
    a = m.Audio(1, 0, np.arange(4, dtype=np.int16))
    with pytest.raises(AttributeError):
        a.rid = 2  # type: ignore[misc]
    assert a == m.Audio(1, 0, np.arange(4, dtype=np.int16)) and a != m.Audio(1, 0, np.arange(1, 5, dtype=np.int16))
    assert a != m.Audio(1, 0, np.arange(3, dtype=np.int16))


def test_decoded_arrays_have_the_engines_dtypes(ring):
    sub = through(ring, RECORDS[1])
    assert isinstance(sub, m.SubmitRequest) and sub.prompt.dtype == np.int64 and sub.uncond_prompt is not None
    assert sub.uncond_prompt.dtype == np.int64 and sub.speaker_embedding is not None
    assert sub.speaker_embedding.dtype == np.float32 and sub.clip is None
    kept = through(ring, next(r for r in RECORDS if isinstance(r, m.Kept)))
    assert isinstance(kept, m.Kept) and kept.frames.dtype == np.int64 and kept.frames.shape == (37, 9)
    align = through(ring, next(r for r in RECORDS if isinstance(r, m.Align)))
    assert isinstance(align, m.Align) and align.pcm.dtype == np.int16 and align.pcm.flags.writeable


@pytest.mark.parametrize(
    "words, payload",
    [
        (["a"], np.array([0.5, 0.25])),  # ends before it starts
        (["a"], np.array([float("nan"), 1.0])),
        (["a"], np.array([-1.0, 1.0])),
        (["a", "b"], np.array([0.0, 1.0])),  # a word without times
        ([1], np.array([0.0, 1.0])),
    ],
)
def test_aligned_times_are_checked(words, payload):
    with pytest.raises(m.MalformedRecord):
        m.decode({"type": m.ALIGNED, "rid": 1, "words": words}, payload.astype(np.float64).tobytes())


def test_request_stats_are_the_json_clients_read():
    d = STATS.as_dict()
    assert "engine_id" not in d and d["ttfa_ms"] == 43.75 and d["rtf"] == 1.351 and d["continued"] is True
    from dataclasses import replace

    assert replace(STATS, engine_id="1").as_dict()["engine_id"] == "1"


def test_an_unknown_error_code_reads_as_internal():
    err = m.decode({"type": m.ERROR, "rid": 3, "code": "no_such_code", "message": "?"})
    assert isinstance(err, m.Error) and err.code is E.INTERNAL and err.rid == 3


MALFORMED: list[tuple[object, bytes | None, int | None]] = [  # header, payload, the rid the refusal names
    (["submit"], None, None),
    ({"rid": 1}, None, None),
    ({"type": "no_such_record", "rid": 1}, None, None),
    ({"type": m.CANCEL}, None, None),
    ({"type": m.CANCEL, "rid": "1"}, None, None),
    ({"type": m.CANCEL, "rid": True}, None, None),
    ({"type": m.SUBMIT, "rid": 4, "prompt_frames": "many", "prompt_width": 10, "params": {}, "max_frames": 5}, b"", 4),
    (
        {"type": m.SUBMIT, "rid": 4, "prompt_frames": 3, "prompt_width": 10, "params": {}, "max_frames": 5},
        b"\0" * 40,
        4,
    ),  # a payload too short for its prompt
    ({"type": m.SUBMIT, "rid": 4, "prompt_frames": -1, "prompt_width": 10, "params": {}, "max_frames": 5}, b"", 4),
    (
        {"type": m.SUBMIT, "rid": 4, "prompt_frames": 1, "prompt_width": 10, "params": {"warmth": 1}, "max_frames": 5},
        b"\0" * 40,
        4,
    ),
    (
        {
            "type": m.SUBMIT,
            "rid": 4,
            "prompt_frames": 1,
            "prompt_width": 10,
            "params": {},
            "max_frames": 5,
            "speaker": "someone",
        },
        b"\0" * 40,
        4,
    ),
    (
        {
            "type": m.SUBMIT,
            "rid": 4,
            "prompt_frames": 1,
            "prompt_width": 10,
            "params": {},
            "max_frames": 5,
            "speaker": "embedding",
        },
        b"\0" * 43,
        4,
    ),  # a voice that is no float32 array
    *(
        (
            {
                "type": m.SUBMIT,
                "rid": 4,
                "prompt_frames": 1,
                "prompt_width": 10,
                "params": {},
                "max_frames": 5,
                "first_samples": bad,
            },
            b"\0" * 40,
            4,
        )
        for bad in (-1, m.FIRST_SAMPLES_MAX + 1, 1.5, "363", True)
    ),  # what the client needs before its first output: samples, 0..FIRST_SAMPLES_MAX
    (
        {
            "type": m.SUBMIT,
            "rid": 4,
            "prompt_frames": 1,
            "prompt_width": 10,
            "params": {},
            "max_frames": 5,
            "keep_frames": "yes",
        },
        b"\0" * 40,
        4,
    ),  # keep_frames is a bool
    ({"type": m.EMBED, "rid": 5, "clip_sr": 16000}, b"\0" * 6, 5),
    ({"type": m.AUDIO, "rid": 6, "index": 0, "samples": 10}, b"\0" * 19, 6),
    ({"type": m.AUDIO, "rid": 6, "index": 0}, b"", 6),
    ({"type": m.KEPT, "rid": 7, "frames": 2, "eos_frame": None}, b"\0" * 36, 7),
    ({"type": m.EMBEDDING, "rid": 8, "dim": 4}, b"\0" * 12, 8),
    ({"type": m.FINISHED, "rid": 9, "reason": "eos", "stats": {"frames": 3}}, None, None),
    ({"type": m.FINISHED, "rid": 9, "reason": 1}, None, 9),
    ({"type": m.ERROR, "rid": 10, "code": 7, "message": "x"}, None, 10),
    ({"type": m.STATS, "active": "many"}, None, None),
    ({"type": m.READY, "device": "cpu"}, None, None),
]


@pytest.mark.parametrize(("header", "payload", "rid"), MALFORMED)
def test_a_malformed_record_is_refused_cleanly(header, payload, rid):
    with pytest.raises(m.MalformedRecord) as e:
        m.decode(header, payload)
    assert isinstance(e.value, ValueError)
    if rid is not None:  # the engine answers the request it names with bad_request
        assert e.value.rid == rid


def test_the_gateway_drops_a_malformed_event_and_reads_on():
    """Garbage off the events ring is logged and dropped: the dispatch and the request's stream live on."""

    async def go() -> list[m.Record]:
        client = EngineClient(WeightSources(), EngineSettings(device="cpu"))
        stream = Stream(1, client, 10**9)
        client._streams[1] = stream
        for header, payload, _ in MALFORMED:
            client._on_event(header, payload)  # type: ignore[arg-type]
        client._on_event({"type": m.STATS, "active": "many"}, None)
        assert client.stats is None and not client.ready.is_set()
        for rec in (m.Audio(1, 0, np.ones(8, np.int16)), m.Finished(1, "eos", stats=STATS)):
            header, payload = rec.encode()
            client._on_event(header, None if payload is None else bytes(payload))  # as the ring hands it over
        return [ev async for ev in stream]

    seen = asyncio.run(go())
    assert [ev.type for ev in seen] == [m.AUDIO, m.FINISHED] and seen[-1] == m.Finished(1, "eos", stats=STATS)


# ---- every malformed header or payload is a MalformedRecord, never another exception -------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_VALUES = st.recursive(
    _LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4) | st.integers(), inner, max_size=3),
    max_leaves=6,
)
_ENCODED = [r.encode() for r in RECORDS]


@st.composite
def _mangled(draw: st.DrawFn) -> tuple[object, bytes | None]:
    header, payload = draw(st.sampled_from(_ENCODED))
    header = dict(header)
    for _ in range(draw(st.integers(1, 3))):
        what = draw(st.sampled_from(["replace", "drop", "add", "type"]))
        keys = sorted(header, key=str)
        if what == "replace" and keys:
            header[draw(st.sampled_from(keys))] = draw(_VALUES)
        elif what == "drop" and keys:
            header.pop(draw(st.sampled_from(keys)))
        elif what == "add":
            header[draw(st.text(max_size=6))] = draw(_VALUES)
        else:
            header["type"] = draw(_VALUES | st.sampled_from([c.type for c in m.REQUESTS + m.EVENTS]))
    raw = None if payload is None else bytes(memoryview(np.ascontiguousarray(payload)).cast("B"))
    payload_out = draw(st.sampled_from(["keep", "none", "cut", "random"]))
    if payload_out == "none":
        raw = None
    elif payload_out == "cut" and raw:
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif payload_out == "random":
        raw = draw(st.binary(max_size=64))
    top = draw(st.sampled_from(["dict", "other"]))
    return (header if top == "dict" else draw(_VALUES)), raw


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mangled())
def test_every_malformed_record_is_a_malformed_record(case):
    header, payload = case
    try:
        rec = m.decode(header, payload)
    except m.MalformedRecord:
        return
    assert isinstance(rec, m.Record)
