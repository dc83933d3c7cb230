"""The WebSocket protocol against a real server on loopback, with the `websockets` client."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import time
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
import websockets

from engine.frontend.longform import BOUNDARY_TRIM
from tests.conftest import ONE_SLOT
from tests.wsclient import Client

pytestmark = pytest.mark.slow


async def connect(server, **config: Any) -> Client:
    ws = await websockets.connect(server.ws_url, max_size=None)
    c = Client(ws)
    created = await c.recv()
    assert created["type"] == "session.created" and created["session_id"].startswith("s_")
    if config:
        await c.send(type="session.config", **config)
        assert (await c.recv())["type"] == "session.updated"
    return c


def run(coro):
    return asyncio.run(coro)


def test_full_session_streamed_text(server):
    async def go():
        c = await connect(
            server, encoding="pcm_s16le", sample_rate=24000, params={"seed": 1, "max_frames": 60, "ignore_eos": True}
        )
        await c.send(type="text", text="Hello there. How are", context_id="turn-1")
        await c.send(type="text", text=" you today?", context_id="turn-1")
        await c.send(type="flush", context_id="turn-1")
        done = []
        while True:
            d = await c.recv()
            if d["type"] == "audio.done":
                done.append(d)
            if d["type"] == "flushed":
                break
        starts = [x for x in c.log if x["type"] == "audio.start"]
        await c.send(type="close")
        assert (await c.recv())["type"] == "session.closed"
        return c, starts, done

    c, starts, done = run(go())
    assert [s["text"] for s in starts] == ["Hello there.", "How are you today?"]
    assert all(s["context_id"] == "turn-1" for s in starts)
    for i, d in enumerate(done):
        pcm = np.frombuffer(bytes(c.audio[d["utterance_id"]]), dtype="<i2")
        # 60 frames of 512 samples at 44.1 kHz, resampled to 24 kHz (soxr streaming keeps the length); the
        # second sentence continues the first (on by default), which keeps all but its last 3 frames
        kept = 60 - (BOUNDARY_TRIM if i == 0 else 0)
        assert abs(len(pcm) - kept * 512 * 24000 / 44100) <= 2
        st = d["stats"]
        assert st["frames"] == 60 and st["ttfa_ms"] > 0 and st["rtf"] > 0
        assert st["audio_ms"] == pytest.approx(kept * 512 / 44.1, abs=0.2)


def test_the_first_audio_message_is_sized_for_the_output(server):
    """A 44.1 kHz client (no resampler) gets its first audio from a 10-frame first DAC call: 363 samples, 3
    decode steps before a 13-frame call; so does a 24 kHz client, whose resampler's start (app/io/resample.py)
    has output from those 363 samples in: 152 (soxr alone would have needed the 13-frame call's 1,899)."""

    async def first(**config: Any) -> int:
        c = await connect(server, params={"seed": 3, "max_frames": 60, "ignore_eos": True}, **config)
        await c.send(type="text", text="Hello there.", flush=True)
        while True:
            msg = await asyncio.wait_for(c.ws.recv(), 60)
            if isinstance(msg, bytes):
                await c.ws.close()
                return len(msg)

    assert run(first()) == (10 * 512 - 4757) * 2
    assert run(first(sample_rate=24000)) == 152 * 2


def test_float32_native_rate_and_seed_reproducible(server):
    async def one() -> bytes:
        c = await connect(server, encoding="pcm_f32le", params={"seed": 77, "max_frames": 40, "ignore_eos": True})
        await c.send(type="text", text="Same seed, same audio.", flush=True)
        d = await c.until("audio.done")
        await c.ws.close()
        return bytes(c.audio[d["utterance_id"]])

    a, b = run(one()), run(one())
    x = np.frombuffer(a, dtype="<f4")
    assert len(x) == 40 * 512 and np.abs(x).max() <= 1.0
    assert a == b


def test_cancel_mid_utterance_stops_audio_and_frees_gpu(server):
    async def go():
        c = await connect(server, params={"seed": 3, "max_frames": 2000, "ignore_eos": True})
        await c.send(type="text", text="A very long story that we will interrupt.", flush=True)
        await c.until("audio.start")
        while len(c.audio[c.current]) < 8192:  # some audio has arrived
            msg = await asyncio.wait_for(c.ws.recv(), 30)
            if isinstance(msg, bytes):
                c.audio[c.current] += msg
        await c.send(type="cancel")
        while True:
            msg = await asyncio.wait_for(c.ws.recv(), 60)
            if isinstance(msg, str) and json.loads(msg)["type"] == "cancelled":
                break
        # Everything between `cancelled` and the next utterance's audio.start: no audio of the cancelled
        # text may be in it (read up to a later event, not for a while: no wall-clock window).
        await c.send(type="session.config", params={"max_frames": 5})
        await c.send(type="text", text="After the cancel.", flush=True)
        after: list[Any] = []
        while True:
            msg = await asyncio.wait_for(c.ws.recv(), 60)
            if isinstance(msg, str) and json.loads(msg)["type"] == "audio.start":
                break
            after.append(msg)
        while not (isinstance(msg, str) and json.loads(msg)["type"] == "flushed"):
            msg = await asyncio.wait_for(c.ws.recv(), 60)
        await c.ws.close()
        return after

    after = run(go())
    # no audio of the cancelled text follows `cancelled`; its pending flush (flush=True) is answered
    assert [json.loads(x)["type"] for x in after] == ["flushed", "session.updated"], after
    assert json.loads(after[0]) == {"type": "flushed", "context_id": "default"}
    deadline = time.monotonic() + 60  # (the gauge is refreshed once a second)
    while (active := engine_active(server)) != 0 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert active == 0  # the engine slot is free again


def engine_active(server) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("zonos_engine_active_requests"):
            return float(line.split()[-1])
    raise AssertionError("metric missing")


def test_two_sessions_at_once(server):
    async def session(text: str, seed: int) -> int:
        c = await connect(server, params={"seed": seed, "max_frames": 50, "ignore_eos": True})
        await c.send(type="text", text=text, flush=True)
        d = await c.until("audio.done")
        await c.ws.close()
        return len(c.audio[d["utterance_id"]])

    async def go():
        return await asyncio.gather(session("First session speaking.", 1), session("Second one too.", 2))

    assert run(go()) == [50 * 512 * 2, 50 * 512 * 2]


def test_voice_clip_in_session_config(server):
    buf = io.BytesIO()
    sf.write(buf, 0.1 * np.sin(np.linspace(0, 2000, 44100)).astype(np.float32), 44100, format="WAV")
    clip = base64.b64encode(buf.getvalue()).decode()

    async def go():
        c = await connect(server)
        await c.send(type="session.config", voice_clip=clip, params={"max_frames": 30, "ignore_eos": True})
        upd = await c.recv()
        await c.send(type="text", text="Cloned voice.", flush=True)
        d = await c.until("audio.done")
        await c.ws.close()
        return upd, d

    upd, d = run(go())
    assert upd["voice"] == "clip" and d["stats"]["frames"] == 30


def test_a_null_in_session_config_is_the_fields_default(server):
    """A client that serializes every field sends null for what it did not set: each is its default, as `voice`
    and `params` take it (it was bad_params for encoding, sample_rate and timestamps)."""

    async def go():
        c = await connect(server)
        await c.send(type="session.config", encoding="mulaw", timestamps=True)
        first = await c.recv()
        nulls = dict.fromkeys(("voice", "voice_clip", "encoding", "sample_rate", "params", "timestamps", "lexicon"))
        await c.send(type="session.config", **nulls)
        reset = await c.recv()
        await c.send(type="session.config", encoding="mulaw", sample_rate=None)
        telephone = await c.recv()
        await c.ws.close()
        return first, reset, telephone

    first, reset, telephone = run(go())
    assert (first["encoding"], first["sample_rate"], first["timestamps"]) == ("mulaw", 8000, True)
    assert reset["type"] == "session.updated", reset
    assert (reset["encoding"], reset["sample_rate"], reset["timestamps"], reset["voice"]) == (
        "pcm_s16le",
        44100,
        False,
        None,
    )
    assert (telephone["encoding"], telephone["sample_rate"]) == ("mulaw", 8000)  # G.711's own rate


@pytest.mark.parametrize(
    "payload, code",
    [
        ("{not json", "bad_message"),
        (json.dumps({"type": "dance"}), "bad_message"),
        (json.dumps({"type": "text", "text": 5}), "bad_message"),
        (json.dumps({"type": "text", "text": "x" * 20000}), "text_too_long"),
        (json.dumps({"type": "session.config", "voice": "no-such-voice"}), "unknown_voice"),
        (json.dumps({"type": "session.config", "params": {"temperature": "hot"}}), "bad_params"),
        (json.dumps({"type": "session.config", "params": {"bogus": 1}}), "bad_params"),
        (json.dumps({"type": "session.config", "sample_rate": 12345}), "bad_params"),
        (json.dumps({"type": "session.config", "voice_clip": "bm90IGF1ZGlv"}), "bad_audio"),
        (json.dumps([1, 2]), "bad_message"),
        # a lone surrogate is a coded error, not `internal` and a lost session
        ('{"type": "text", "text": "\\ud800 hello."}', "bad_text"),
        ('{"type": "text", "text": "Fine. \\udfff", "flush": true}', "bad_text"),
        # conditioning that would fail every later utterance is refused by the config
        *(
            (json.dumps({"type": "session.config", "params": p}), "bad_params")
            for p in (
                {"speaking_rate_bucket": 8},
                {"speaking_rate_bucket": -1},
                {"speaking_rate": -5},
                {"quality_buckets": {"lufs": 99}},
                {"quality_buckets": {"nosuch": 1}},
                {"quality_values": {"nosuch": 1.0}},
                {"speed": 9.0},
                {"speed": 0.01},
                {"top_k": 5000},
            )
        ),
    ],
)
def test_bad_input_gets_clear_errors_and_session_continues(server, payload, code):
    async def go():
        c = await connect(server, params={"max_frames": 20, "ignore_eos": True})
        await c.ws.send(payload)
        err = await c.recv()
        await c.send(type="text", text="still alive", flush=True)
        done = await c.until("audio.done")
        await c.ws.close()
        return err, done

    err, done = run(go())
    assert err["type"] == "error" and err["code"] == code and err["message"]
    assert done["stats"]["frames"] == 20


def utterance_budget(server) -> int:
    async def go():
        async with websockets.connect(server.ws_url) as ws:
            return json.loads(await ws.recv())["limits"]["max_utterance_bytes"]

    return run(go())


def test_abbreviations_do_not_cut_sentences(server):
    """Two utterances, not five ('Dr.', 'Smith paid $5.50 on Jan.', ...)."""

    async def go():
        c = await connect(server, params={"max_frames": 3, "ignore_eos": True})
        text = "Dr. Smith paid $5.50 on Jan. 3rd, 2026. He left at 5 p.m. today."
        for word in text.split(" "):
            await c.send(type="text", text=word + " ")
        await c.send(type="flush")
        await c.until("flushed")
        await c.ws.close()
        return [d["text"] for d in c.log if d["type"] == "audio.start"]

    assert run(go()) == ["Dr. Smith paid $5.50 on Jan. 3rd, 2026.", "He left at 5 p.m. today."]


@pytest.mark.parametrize("text", ["😀" * 600, "д" * 1500])
def test_multibyte_text_is_cut_by_bytes_and_all_spoken(server, text):
    """600 emoji (2400 bytes) or 1500 Cyrillic letters without a space gave prompt_too_long;
    now they are cut into utterances that fit the engine's context, and every character is spoken."""
    budget = utterance_budget(server)

    async def go():
        c = await connect(server, params={"max_frames": 3, "ignore_eos": True})
        await c.send(type="text", text=text, flush=True)
        await c.until("flushed", timeout=300)
        await c.ws.close()
        return c.log

    log = run(go())
    assert not [d for d in log if d["type"] == "error"]
    spoken = [d["text"] for d in log if d["type"] == "audio.start"]
    assert "".join(spoken) == text and all(len(t.encode()) <= budget for t in spoken)
    assert len(spoken) > 1 and sum(d["type"] == "audio.done" for d in log) == len(spoken)


def test_close_with_a_full_queue_speaks_everything_then_closes(server):
    """32 queued utterances (the limit) plus unterminated text, then close: everything is
    spoken and session.closed comes (it never came: the close's flush was refused)."""
    n = 32  # --max-pending-utterances default

    async def go():
        c = await connect(server, params={"max_frames": 2, "ignore_eos": True})
        await c.send(type="text", text=" ".join(f"Number {i}." for i in range(n)) + " And the rest")
        await c.send(type="close")
        await c.until("session.closed", timeout=300)
        return c.log

    log = run(go())
    assert not [d for d in log if d["type"] == "error"]
    spoken = [d["text"] for d in log if d["type"] == "audio.start"]
    assert spoken == [f"Number {i}." for i in range(n)] + ["And the rest"]
    assert sum(d["type"] == "audio.done" for d in log) == n + 1


def test_word_times_and_what_a_barge_in_heard(server):
    """session.config `timestamps`: `audio.words` after the audio that completes them, every word of each
    utterance once, in order, within its audio sent; a cancel's `cancelled` says what each utterance that
    had begun to play got (its audio, the words it covers)."""

    async def go():
        c = await connect(server, timestamps=True, params={"seed": 1, "max_frames": 60, "ignore_eos": True})
        await c.send(type="text", text="Hello there. How are you today?", flush=True)
        while (await c.recv())["type"] != "flushed":
            pass
        await c.send(type="session.config", params={"seed": 2, "max_frames": 2000, "ignore_eos": True})
        await c.recv()
        await c.send(type="text", text="A long one that plays for a while before it is cut.", flush=True)
        while (await c.recv())["type"] != "audio.start":
            pass
        await c.audio_bytes(44100)  # half a second of 44.1 kHz s16 audio has been played
        await c.send(type="cancel")
        cancelled = await c.until("cancelled")
        await c.ws.close()
        return c.log, cancelled

    log, cancelled = run(go())
    words = [m for m in log if m.get("type") == "audio.words"]
    by_u: dict[str, list] = {}
    for m in words:
        assert m["source"] == "estimated"
        by_u.setdefault(m["utterance_id"], []).extend(m["words"])
    first_two = [by_u[u] for u in ("u_1", "u_2")]
    assert [w["word"] for w in first_two[0]] == ["Hello", "there."]
    assert [w["word"] for w in first_two[1]] == ["How", "are", "you", "today?"]
    for ws_ in first_two:
        starts = [w["start_ms"] for w in ws_]
        assert starts == sorted(starts) and all(w["end_ms"] <= 60 * 512 / 44.1 + 1 for w in ws_)
    heard = cancelled["heard"]
    assert len(heard) == 1 and heard[0]["audio_ms"] >= 400 and heard[0]["source"] == "estimated"
    spoken = heard[0]["words"]
    assert (
        spoken
        == ["A", "long", "one", "that", "plays", "for", "a", "while", "before", "it", "is", "cut."][: len(spoken)]
    )


def test_a_session_that_closes_while_queued_takes_its_engine_work_with_it(shared_server):
    """One slot, held by one session's long utterance: a second session's utterance waits in the engine's
    queue. When that socket drops without a word, the gateway cancels its engine request: it leaves the
    queue cancelled (not run for nobody) while the holder still runs."""
    srv = shared_server(*ONE_SLOT)

    def engine() -> tuple[int, int, int]:
        """(active, waiting, cancelled) of the one engine."""
        e = httpx.get(srv.url + "/readyz", timeout=10).json()["engines"][0]
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        cancelled = next(
            float(line.split()[1]) for line in metrics.splitlines() if line.startswith("zonos_engine_cancelled ")
        )
        return e["active"], e["waiting"], int(cancelled)

    async def wait_for(state: tuple[int, int, int] | None) -> list[tuple[int, int, int]]:
        """Poll until the engine is in `state` (None: idle, any count)."""
        seen: list[tuple[int, int, int]] = []
        deadline = time.monotonic() + 120  # a failure guard only
        while time.monotonic() < deadline:
            seen.append(await asyncio.to_thread(engine))
            if seen[-1] == state or (state is None and seen[-1][:2] == (0, 0)):
                break
            await asyncio.sleep(0.2)
        return seen

    async def wait_for_idle() -> list[tuple[int, int, int]]:
        seen = await wait_for(None)
        assert seen[-1][:2] == (0, 0), seen
        return seen

    async def drain(ws) -> None:  # the holder reads its audio: it is never cancelled as a slow consumer
        async for _ in ws:
            pass

    async def go():
        # the server is shared: count from the engine idle (what earlier tests left has ended)
        n = (await wait_for_idle())[-1][2]
        holder = await connect(srv, params={"max_frames": 2500, "ignore_eos": True})
        await holder.send(type="text", text="Hold the slot.", flush=True)
        await holder.until("audio.start", timeout=120)
        reading = asyncio.create_task(drain(holder.ws))
        queued = await connect(srv)
        await queued.send(type="text", text="Queued.", flush=True)
        before = await wait_for((1, 1, n))  # it waits behind the holder
        queued.ws.transport.abort()  # the client vanishes: no close frame
        after = await wait_for((1, 0, n + 1))
        await holder.ws.close()
        await reading
        return n, before, after

    n, before, after = run(go())
    assert before[-1] == (1, 1, n), before
    assert after[-1] == (1, 0, n + 1), after  # cancelled in the queue while the slot's holder still runs


def test_a_break_is_exact_silence_and_the_voice_goes_on_after_it(server):
    """`<break time="700ms"/>` between two sentences: an utterance of exactly that much silence between them,
    and the sentence after it continues the one before (one continuation chain); a break without a valid
    time is refused, never spoken."""

    async def go():
        c = await connect(
            server, encoding="pcm_s16le", sample_rate=24000, params={"seed": 1, "max_frames": 20, "ignore_eos": True}
        )
        await c.send(type="text", text='Hello there. <break time="700ms"/> How are you?', flush=True)
        while (await c.recv())["type"] != "flushed":
            pass
        await c.send(type="text", text='Bad <break time="soon"/> tag.', flush=True)
        err = await c.until("error")
        await c.ws.close()
        return c, err

    c, err = run(go())
    starts = [m for m in c.log if m["type"] == "audio.start"]
    assert [m["text"] for m in starts] == ["Hello there.", "", "How are you?"]
    silence = c.audio[starts[1]["utterance_id"]]
    assert len(silence) == 2 * round(0.7 * 24000) and not any(silence)
    done = {m["utterance_id"]: m for m in c.log if m["type"] == "audio.done"}
    assert done[starts[0]["utterance_id"]]["stats"]["engine"]["continued"] is True  # the voice went on
    assert err["code"] == "bad_text" and "break" in err["message"]


def test_marks_come_with_their_audio_and_none_after_a_barge_in(server):
    """SSML's `<mark name="..."/>` without word times asked for: a `mark` message after audio of its utterance, in the
    text's order, its time within the audio sent, before its `audio.done` and the `flushed`; a barge-in before a mark's
    words were sent reports it never; a mark with an empty name is bad_text (docs/protocol.md "Marks")."""

    async def go():
        c = await connect(server, params={"seed": 1, "max_frames": 60, "ignore_eos": True})
        text = '<speak><mark name="start"/>Hello there<mark name="mid"/>.<mark name="end"/> How are you?</speak>'
        await c.send(type="text", text=text, flush=True)
        seen: list = []  # each message, and a mark with the audio its utterance had sent by then (bytes)
        while not seen or seen[-1]["type"] != "flushed":
            seen.append(await c.recv())
            if seen[-1]["type"] == "mark":
                seen[-1]["sent"] = len(c.audio[c.current or ""])
        await c.send(type="session.config", params={"seed": 2, "max_frames": 2000, "ignore_eos": True})
        await c.until("session.updated")
        await c.send(type="text", text='<mark name="begin"/>A long one that plays for a while<mark name="far"/>.')
        await c.send(type="flush")
        await c.until("audio.start")
        await c.audio_bytes(44100)  # half a second of 44.1 kHz s16 audio
        await c.send(type="cancel")
        await c.until("cancelled")
        await c.send(type="text", text='Bye <mark name=""/> now.', flush=True)
        err = await c.until("error")
        await c.send(type="text", text="Bye.", flush=True)
        after = [await c.recv()]
        while after[-1]["type"] != "flushed":
            after.append(await c.recv())
        await c.ws.close()
        return seen, c.log, err

    seen, log, err = run(go())
    marks = [m for m in seen if m["type"] == "mark"]
    assert [(m["utterance_id"], m["name"]) for m in marks] == [("u_1", "start"), ("u_1", "mid"), ("u_1", "end")]
    assert all(m["sent"] > 0 and m["time_ms"] <= m["sent"] / 2 / 44.1 + 1e-6 for m in marks), marks
    assert [m["time_ms"] for m in marks] == sorted(m["time_ms"] for m in marks)
    kinds = [m["type"] for m in seen]
    assert kinds.index("audio.done") > max(i for i, k in enumerate(kinds) if k == "mark") and kinds[-1] == "flushed"
    assert [m["text"] for m in seen if m["type"] == "audio.start"] == ["Hello there.", "How are you?"]
    later = [m["name"] for m in log[len(seen) :] if m["type"] == "mark"]
    assert later == ["begin"], later  # `far`: its words never sent
    assert err["code"] == "bad_text" and "mark" in err["message"]


@pytest.mark.parametrize(
    "text",
    [
        '[hap<mark name="m"/>py] Hello there.',
        '<emo<mark name="m"/>tion value="happy"/> Hello there.',
        '<mark name="&#x202E;evil"/> Hello there.',
        '<mark name="a&#0;b"/> Hello there.',
    ],
)
def test_a_mark_inside_a_tag_or_naming_what_cannot_be_printed_is_bad_text(server, text):
    """A mark inside a bracket tag or an element's opening: taken out, it left the tag whole as text, and `[happy]`
    (the text of the utterance the engine read) was spoken as words. A name with a reference to a character that is
    not printable (a bidi override, NUL), as the character itself is: the reference was dropped and the mark reported
    under another name (`evil`, `ab`) (hostile pass). Refused (bad_text) as a mark inside a sub is (docs/protocol.md
    "Marks"); the next text is spoken."""

    async def go():
        c = await connect(server, params={"seed": 1, "max_frames": 10, "ignore_eos": True})
        await c.send(type="text", text=text, flush=True)
        first = await c.recv()
        await c.send(type="text", text="Bye.", flush=True)
        await c.until("flushed")
        await c.ws.close()
        return first, c.log

    first, log = run(go())
    assert first["type"] == "error" and first["code"] == "bad_text" and "mark" in first["message"], first
    assert [m["text"] for m in log if m["type"] == "audio.start"] == ["Bye."]


def test_a_refused_message_names_its_context(server):
    """An error that refuses a text, flush or cancel names the context the message was for, as an utterance's error
    does: without it, a client that had begun a new turn (the demo page's next Speak, on a context of its own) took
    the refusal of its earlier text for its new text's and ended that turn."""

    async def go():
        c = await connect(server, params={"max_frames": 10, "ignore_eos": True})
        for payload in (
            {"type": "text", "text": 'Bad <break time="soon"/> tag.', "context_id": "turn-7"},
            {"type": "text", "text": "[whispering] Quiet.", "flush": True},
            {"type": "flush", "context_id": "turn-8", "bogus": 1},
            {"type": "cancel", "context_id": "turn-9", "bogus": 1},
            {"type": "flush", "bogus": 1},
            {"type": "text", "text": "Hi.", "context_id": 5},
            {"type": "session.config", "params": {"seed": 1.5}},
        ):
            await c.send(**payload)
            yield await c.until("error")
        await c.ws.close()

    async def collect():
        return [e async for e in go()]

    errors = run(collect())
    assert [(e["code"], e.get("context_id")) for e in errors] == [
        ("bad_text", "turn-7"),
        ("unsupported_tag", "default"),
        ("bad_message", "turn-8"),
        ("bad_message", "turn-9"),
        ("bad_message", None),
        ("bad_message", None),
        ("bad_params", None),
    ], errors
    assert "utterance_id" not in errors[0] and errors[-1]["message"] == "seed must be an integer"


def test_a_refused_break_split_across_messages_does_not_refuse_the_rest_of_the_turn(server):
    """Each half of `<break time="x"/>` passes its own message's check; the message that completes its sentence is
    refused (`bad_text`), and the half buffered before it goes with it: kept, its open `<break` refused every later
    sentence of the turn until a flush dropped it (an error for each, nothing spoken)."""

    async def go():
        c = await connect(server, params={"seed": 1, "max_frames": 20, "ignore_eos": True})
        await c.send(type="text", text="Hello there <break ti")
        await c.send(type="text", text='me="x"/> friend. Next one.')
        err = await c.until("error")
        await c.send(type="text", text=" Another sentence. And more.", flush=True)
        while (await c.recv())["type"] not in ("flushed", "error"):
            pass
        # a bracket tag's halves, `[hap` + `py]`: unsupported here (no emotion directions), its half goes too
        await c.send(type="text", text="Well [hap")
        await c.send(type="text", text="py] then. Next one.")
        await c.until("error")
        await c.send(type="text", text=" Fine now.", flush=True)
        while (await c.recv())["type"] not in ("flushed", "error"):
            pass
        await c.ws.close()
        return c, err

    c, err = run(go())
    assert err["code"] == "bad_text" and "break" in err["message"], err
    assert [m["code"] for m in c.log if m["type"] == "error"] == ["bad_text", "unsupported_tag"], c.log
    assert [m["text"] for m in c.log if m["type"] == "audio.start"] == ["Another sentence.", "And more.", "Fine now."]


def test_aliases_that_grow_an_utterance_past_its_limit_are_refused(server):
    """An alias is up to 256 characters: a rule for "a" made a sentence of 40 "a" 10 KB of text, 36 engine
    requests of prompt, for a 79-character message. The text after the rules is held to the utterance's limit:
    text_too_long for that utterance, and the session goes on (a sentence the rules keep short is spoken)."""

    async def go():
        c = await connect(
            server,
            params={"seed": 1, "max_frames": 5, "ignore_eos": True},
            lexicon=[{"grapheme": "a", "alias": "b" * 256}],
        )
        await c.send(type="text", text="a " * 39 + "a.", flush=True)
        error = await c.until("error")
        await c.until("flushed")
        await c.send(type="text", text="Say a word.", flush=True)
        done = await c.until("audio.done")
        await c.ws.close()
        return error, done

    error, done = run(go())
    assert error["code"] == "text_too_long" and "pronunciation rules" in error["message"], error
    assert done["stats"]["audio_ms"] > 0


def test_an_utterance_its_aliases_leave_empty_is_no_engine_work(server):
    """A rule that reads a filler word as nothing ("Um" -> ""): a sentence of only that word went to the engine as an
    empty prompt, which a real model babbles to its frame limit. It is an utterance of no audio now (audio.start,
    audio.done with no frames, as a break of none); the sentences around it are spoken, one continuation chain."""

    async def go():
        c = await connect(
            server, params={"seed": 1, "max_frames": 5, "ignore_eos": True}, lexicon=[{"grapheme": "Um", "alias": ""}]
        )
        await c.send(type="text", text="Right.\nUm\nSo it goes.", flush=True)
        await c.until("flushed")
        await c.ws.close()
        return c

    c = run(go())
    starts = [m["text"] for m in c.log if m["type"] == "audio.start"]
    done = {m["utterance_id"]: m["stats"] for m in c.log if m["type"] == "audio.done"}
    assert starts == ["Right.", "Um", "So it goes."] and not [m for m in c.log if m["type"] == "error"], c.log
    empty = done[next(m["utterance_id"] for m in c.log if m["type"] == "audio.start" and m["text"] == "Um")]
    assert empty["frames"] is None and empty["audio_ms"] == 0, empty
    assert sum(s["frames"] or 0 for s in done.values()) == 10  # the two sentences around it: 5 frames each
    # passed over as a break is: the sentence after it continues the one before it (one voice, one stream); the chain
    # ended at it, "So it goes." started a fresh stream and "Right." held its tail for the continuation grace
    right = next(m["utterance_id"] for m in c.log if m["type"] == "audio.start" and m["text"] == "Right.")
    assert done[right]["engine"]["continued"] is True, done[right]


def test_a_sentence_that_leaves_the_chain_ends_the_one_before_it_at_once(start_server):
    """A sentence that continues no chain (one whose aliases make it several engine requests, one refused before it was
    submitted, one its aliases leave empty) ends the held stream of the sentence before it now: it was held for the
    continuation grace, which the engine waits out (here 10 minutes: the hang guard below), so that sentence's tail,
    its audio.done and the turn's flushed (and all the audio of a sentence shorter than the held margin) waited."""
    srv = start_server("--continuation-grace-ms", "600000")
    grow = [
        {"grapheme": "zork", "alias": "word " * 50},
        {"grapheme": "zz", "alias": "b" * 256},
        {"grapheme": "Um", "alias": ""},
    ]
    text = "Right.\nSay zork now.\nAgain.\n" + "zz " * 10 + "\nOnce more.\nUm\nAnd on."

    async def go():
        c = await connect(srv, params={"seed": 1, "max_frames": 5, "ignore_eos": True}, lexicon=grow)
        await c.send(type="text", text=text, flush=True)
        while (await c.recv(timeout=120))["type"] != "flushed":  # (a hang guard: the grace is 600 s)
            pass
        await c.ws.close()
        return c

    c = run(go())
    starts = [m["text"] for m in c.log if m["type"] == "audio.start"]
    errors = [m["code"] for m in c.log if m["type"] == "error"]
    assert starts == ["Right.", "Say zork now.", "Again.", "Once more.", "Um", "And on."] and errors == [
        "text_too_long"
    ]


def test_a_sentence_of_several_requests_cut_at_max_frames_counts_its_frames(server):
    """A sentence its aliases make several engine requests, cut at the session's max_frames: its audio.done said
    `frames: null` and `engine: {}` (the piece playing was cancelled at the limit and its finish made up) although
    its 10 frames of audio were sent. They are counted now, with the engine's stats, and the reason is max_frames."""

    async def go():
        c = await connect(
            server,
            params={"seed": 1, "max_frames": 10, "ignore_eos": True},
            lexicon=[{"grapheme": "zork", "alias": "word " * 50}],
        )
        await c.send(type="text", text="Say zork now.", flush=True)
        done = await c.until("audio.done")
        await c.ws.close()
        return done["stats"]

    stats = run(go())
    assert stats["finish_reason"] == "max_frames" and stats["frames"] == 10, stats
    assert stats["audio_ms"] == round(10 * 512 / 44100 * 1e3, 2) and stats["engine"]["frames"] == 10, stats
    assert stats["engine"]["audio_s"] == round(10 * 512 / 44100, 4) and stats["engine"]["ttfa_ms"] is not None


def test_pronunciation_dictionaries_through_the_elevenlabs_routes_and_our_socket(start_server, tmp_path):
    """Uploaded as PLS and as rules, listed, used by our session.config `lexicon` (the alias reaches the
    model: the prompt grows by it), refused for phonemes, kept across a restart, deleted."""
    from tests.unit.test_lexicons import PHONEME, PLS

    data = tmp_path / "data"
    srv = start_server(data_dir=data)
    up = httpx.post(
        srv.url + "/v1/pronunciation-dictionaries/add-from-file",
        timeout=30,
        files={"file": ("lex.pls", PLS)},
        data={"name": "mine"},
    )
    assert up.status_code == 200 and up.json()["version_rules_num"] == 3, up.text
    bad = httpx.post(
        srv.url + "/v1/pronunciation-dictionaries/add-from-file",
        timeout=30,
        files={"file": ("lex.pls", PHONEME)},
        data={"name": "phonemes"},
    )
    assert bad.status_code == 400 and "phoneme" in bad.text
    rules = httpx.post(
        srv.url + "/v1/pronunciation-dictionaries/add-from-rules",
        timeout=30,
        json={
            "name": "rules",
            "rules": [{"type": "alias", "string_to_replace": "hi", "alias": "hello there my friend"}],
        },
    )
    assert rules.status_code == 200
    listed = httpx.get(srv.url + "/v1/pronunciation-dictionaries").json()["pronunciation_dictionaries"]
    assert {d["name"] for d in listed} == {"mine", "rules"}

    async def prompt_frames(lexicon):
        c = await connect(
            srv,
            params={"seed": 1, "max_frames": 5, "ignore_eos": True},
            **({"lexicon": lexicon} if lexicon is not None else {}),
        )
        await c.send(type="text", text="Say hi to the tomato.", flush=True)
        done = await c.until("audio.done")
        await c.ws.close()
        return done["stats"]["engine"]["prompt_frames"]

    plain = run(prompt_frames(None))
    aliased = run(
        prompt_frames(
            [rules.json()["id"], {"pronunciation_dictionary_id": up.json()["id"]}, {"grapheme": "Say", "alias": "Say"}]
        )
    )
    assert aliased == plain + len("hello there my friend") - len("hi") + len("tomahto") - len("tomato")

    async def refused():
        c = await connect(srv)
        await c.send(type="session.config", lexicon=["pd_0000000000000000"])
        err = await c.until("error")
        await c.ws.close()
        return err

    assert run(refused())["code"] == "unknown_lexicon"
    big = [
        httpx.post(
            srv.url + "/v1/pronunciation-dictionaries/add-from-rules",
            timeout=60,
            json={"name": f"big {k}", "rules": [{"string_to_replace": f"w{k}x{i}", "alias": "a"} for i in range(5000)]},
        ).json()["id"]
        for k in range(2)
    ]

    async def too_many():  # one request's dictionaries are bounded in all (each rule is a pattern alternative)
        c = await connect(srv)
        await c.send(type="session.config", lexicon=big)
        err = await c.until("error")
        await c.ws.close()
        return err

    assert run(too_many())["code"] == "bad_lexicon"
    for lid in big:
        httpx.delete(srv.url + f"/v1/pronunciation-dictionaries/{lid}")
    srv.stop()
    again = start_server(data_dir=data)  # a restart keeps them
    got = httpx.get(again.url + f"/v1/pronunciation-dictionaries/{up.json()['id']}")
    assert got.status_code == 200 and got.json()["rules"][0] == {
        "type": "alias",
        "string_to_replace": "tomato",
        "alias": "tomahto",
    }
    assert httpx.delete(again.url + f"/v1/pronunciation-dictionaries/{up.json()['id']}").status_code == 200
    assert httpx.get(again.url + f"/v1/pronunciation-dictionaries/{up.json()['id']}").status_code == 404


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_bug_in_a_session_ends_that_session_only(tmp_path, monkeypatch):
    """A bug in a session's code (here: its message handler raises, or its pump does as it sends audio) ends that
    session alone, in its API's shape: the `internal` error, close 1011, and one log record with the traceback
    (none from the server besides); its place among the sessions is given back, and a session open beside it
    speaks on. (The streaming routes run their endpoint without Starlette's per-socket wrapper, app/server.py
    SessionRoute: the session's own handler in app/doors/handshake.py `serve_session` is what answers a bug.)"""
    from websockets.sync.client import connect as sync_connect

    from app.core.session import StreamingSession
    from app.doors import ws as ours
    from app.doors.dialects import elevenlabs
    from tests.conftest import in_process_gateway

    def buggy(on_message):
        async def patched(self, data):
            if data.get("text") == "bug":
                raise RuntimeError("a bug in on_message")
            if data.get("text") == "pump bug.":
                self.pump_bug = True
            return await on_message(self, data)

        return patched

    monkeypatch.setattr(ours.Session, "on_message", buggy(ours.Session.on_message))
    monkeypatch.setattr(elevenlabs.ElevenLabsSession, "on_message", buggy(elevenlabs.ElevenLabsSession.on_message))
    send_bytes = StreamingSession.send_bytes_locked

    async def send_bytes_locked(self, data):
        if getattr(self, "pump_bug", False):
            raise RuntimeError("a bug in the pump")
        await send_bytes(self, data)

    monkeypatch.setattr(StreamingSession, "send_bytes_locked", send_bytes_locked)
    fast = {"max_frames": 5, "ignore_eos": True}

    def last_json_and_close(ws) -> tuple[dict[str, Any], int | None]:
        last: dict[str, Any] = {}
        with pytest.raises(websockets.ConnectionClosed):
            while True:
                msg = ws.recv(timeout=60)
                if isinstance(msg, str):
                    last = json.loads(msg)
        return last, ws.close_code

    failed, server_errors = _Records(), _Records()
    with in_process_gateway(tmp_path, "--no-text-normalization") as (port, app):
        logging.getLogger("gateway.session").addHandler(failed)
        logging.getLogger("uvicorn.error").addHandler(server_errors)
        buf = io.BytesIO()
        np.save(buf, np.random.default_rng(7).standard_normal(2048).astype(np.float32))
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/voices", files={"embedding": ("ada.npy", buf.getvalue())}, data={"name": "Ada"}
        )
        assert r.status_code in (200, 201), r.text
        try:
            with sync_connect(f"ws://127.0.0.1:{port}/v1/tts/ws") as beside:
                assert json.loads(beside.recv(timeout=60))["type"] == "session.created"
                ends = []
                for text in ("bug", "pump bug."):
                    with sync_connect(f"ws://127.0.0.1:{port}/v1/tts/ws") as ws:
                        ws.send(json.dumps({"type": "session.config", "params": fast}))
                        ws.send(json.dumps({"type": "text", "text": text, "flush": True}))
                        ends.append(last_json_and_close(ws))
                el = f"ws://127.0.0.1:{port}/v1/text-to-speech/Ada/multi-stream-input?output_format=pcm_24000"
                with sync_connect(el) as ws:
                    ws.send(json.dumps({"text": "bug", "context_id": "c"}))
                    ends.append(last_json_and_close(ws))
                gw = app.state.gateway
                for _ in range(600):  # each failed session's place is given back as its handler ends
                    if len(gw.live) == 1:
                        break
                    time.sleep(0.1)
                assert len(gw.live) == 1
                metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
                assert "\nzonos_active_sessions 1.0\n" in metrics
                beside.send(json.dumps({"type": "session.config", "params": fast}))
                beside.send(json.dumps({"type": "text", "text": "Still here.", "flush": True}))
                seen: list[str] = []
                while "audio.done" not in seen:
                    msg = beside.recv(timeout=60)
                    if isinstance(msg, str):
                        seen.append(json.loads(msg)["type"])
                assert "error" not in seen, seen
        finally:
            logging.getLogger("gateway.session").removeHandler(failed)
            logging.getLogger("uvicorn.error").removeHandler(server_errors)
    assert ends == [
        ({"type": "error", "code": "internal", "message": "internal error"}, 1011),
        ({"type": "error", "code": "internal", "message": "internal error"}, 1011),
        ({"message": "internal error", "error": "internal"}, 1011),
    ]
    bugs = [r for r in failed.records if "session failed" in r.getMessage()]
    assert len(bugs) == 3 and all(r.exc_info is not None for r in bugs), bugs
    assert not [r for r in server_errors.records if r.levelno >= logging.ERROR], server_errors.records
