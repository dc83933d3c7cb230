"""The WebSocket session and the utterance pipeline in-process, against a fake engine whose streams the
test drives event by event: ordering, flush, cancel and close are checked without a model and without
depending on how fast anything runs."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from starlette.websockets import WebSocketDisconnect, WebSocketState

from app.core import door_policy
from app.core import session as session_module
from app.core.emotion import check_emotion
from app.core.engine_client import Event, Stream
from app.core.metrics import Metrics
from app.core.options import SynthesisOptions
from app.core.pipeline import DEFAULT_CONTEXT, UtterancePipeline, engine_error, speak, utterance_bytes
from app.doors.speech import speech_response
from app.doors.ws import Session
from app.io.audio_output import OutputFormat
from app.io.errors import RequestError
from app.settings import GatewaySettings, Limits
from app.voices.lexicons import Aliases
from engine.contract import records as m
from engine.contract.errors import EngineError
from engine.frontend.config import Zonos2Config, preset_params
from engine.frontend.emotion import EmotionDirections

TIMEOUT = 30  # generous ceilings: nothing here waits on wall-clock speed, only on events


def engine_stats(frames: int) -> m.RequestStats:
    """A finished record's stats, as the engine measures them (only `frames` matters here)."""
    return m.RequestStats(
        queue_ms=0.0,
        prefill_wait_ms=0.0,
        prefill_ms=1.0,
        first_chunk_ms=1.0,
        ttfa_ms=2.0,
        e2e_ms=3.0,
        prompt_frames=10,
        frames=frames,
        eos_frame=None,
        audio_s=frames * 512 / 44100,
        rtf=0.5,
        speaker_encoder_ms=0.0,
        continued=False,
    )


class FakeEngine:
    """Stands in for Gateway.start_utterance + the engine: every utterance gets a real Stream that the
    test feeds with audio and a finish."""

    def __init__(self) -> None:
        self.streams: list[Stream] = []
        self.texts: list[str] = []
        self.cancelled: list[int] = []
        self.limits: list[int] = []  # the max_frames each piece was submitted with
        self.first_samples: list[int | None] = []  # what each utterance's encoder takes in before it outputs
        self.opts: list[SynthesisOptions] = []  # each utterance's options (a style tag's emotion applied)
        self.chains: list[Any] = []  # each utterance's continuation chain (None: none)
        self.voices: list[Any] = []  # each utterance's voice
        self._streams: dict[int, Stream] = {}
        self._changed = asyncio.Event()

    def cancel(self, rid: int) -> None:
        self.cancelled.append(rid)

    def _streams_changed(self) -> None:
        """EngineClient's hook for the counts other gateway processes read: no other process reads a fake's."""

    async def start_utterance(
        self,
        text: str,
        opts: Any,
        voice: Any = None,
        clip: Any = None,
        owner: Any = None,
        chain: Any = None,
        link: Any = None,
    ) -> Stream:
        if link is not None:  # no continuation here (tests/engine/test_continuation.py has it): the next starts fresh
            link.settle()
        stream = Stream(len(self.streams) + 1, self, 10**9)  # type: ignore[arg-type]
        self._streams[stream.rid] = stream
        self.streams.append(stream)
        self.texts.append(text)
        self.first_samples.append(opts.first_samples)
        self.opts.append(opts)
        self.chains.append(chain)
        self.voices.append(voice)
        self._changed.set()
        return stream

    async def started(self, n: int) -> Stream:
        """Wait until n utterances have been started; the n-th one's stream."""
        async with asyncio.timeout(TIMEOUT):
            while len(self.streams) < n:
                self._changed.clear()
                await self._changed.wait()
        return self.streams[n - 1]

    @staticmethod
    def play(stream: Stream, samples: int = 512, finish: bool = True) -> None:
        stream._deliver(m.Audio(stream.rid, 0, np.ones(samples, np.int16)))
        if finish:
            stream._deliver(m.Finished(stream.rid, "eos", stats=engine_stats(1)))


def fake_gateway(limits: Limits | None = None, directions: EmotionDirections | None = None) -> SimpleNamespace:
    """`directions`: the server's emotion directions (--emotion-directions-dir; style tags need them)."""
    settings = replace(GatewaySettings(), limits=limits or Limits())
    engine = FakeEngine()
    cfg = Zonos2Config.from_dict(preset_params("tiny"))
    gw = SimpleNamespace(
        settings=settings,
        metrics=Metrics(),
        cfg=cfg,
        start_utterance=engine.start_utterance,
        engine=SimpleNamespace(info={"max_context": 6144}),
        fake=engine,
        resolve_voice=lambda ref, owner: None,
        draining=False,
        prompts=SimpleNamespace(emotion=directions),
    )
    # the gateway's door check, on this server's directions
    gw.check_emotion = lambda opts, voice, clip=False: check_emotion(directions, opts, voice, cfg.dim, clip)
    return gw


class FakeSocket:
    def __init__(self) -> None:
        self.application_state = WebSocketState.CONNECTED
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.out: asyncio.Queue[Any] = asyncio.Queue()
        self.close_code: int | None = None

    async def receive(self) -> dict[str, Any]:
        return await self.inbox.get()

    async def send_text(self, text: str) -> None:
        await self.out.put(json.loads(text))

    async def send_bytes(self, data: bytes) -> None:
        await self.out.put(data)

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.close_code = code
        self.application_state = WebSocketState.DISCONNECTED

    def send(self, **msg: Any) -> None:
        self.inbox.put_nowait({"type": "websocket.receive", "text": json.dumps(msg)})

    async def next_json(self) -> dict[str, Any]:
        async with asyncio.timeout(TIMEOUT):
            while True:
                msg = await self.out.get()
                if isinstance(msg, dict):
                    return msg

    async def until(self, kind: str) -> list[dict[str, Any]]:
        """Messages up to and including the first of type kind."""
        seen = []
        while True:
            seen.append(await self.next_json())
            if seen[-1]["type"] == kind:
                return seen


async def open_session(limits: Limits | None = None) -> tuple[Session, FakeSocket, FakeEngine, asyncio.Task]:
    gw = fake_gateway(limits)
    ws = FakeSocket()
    session = Session(ws, gw, "")  # type: ignore[arg-type]
    task = asyncio.create_task(session.run())
    assert (await ws.next_json())["type"] == "session.created"
    return session, ws, gw.fake, task


async def shut(ws: FakeSocket, task: asyncio.Task) -> None:
    ws.inbox.put_nowait({"type": "websocket.disconnect"})
    async with asyncio.timeout(TIMEOUT):
        await task


def refused_then_spoken(
    messages: list[dict | str], spoken: str, emotions: bool = True
) -> tuple[dict, list[dict], list[str]]:
    """On a socket: send `messages` (a dict: a `text` message's fields; a str: a message's raw JSON), read the error
    they draw, then send `spoken` with a flush -> (that error, what the socket sent up to `flushed`, the texts the
    engine was given). emotions=False: no emotion directions loaded (an emotion tag cannot be applied)."""

    async def go():
        session, ws, engine, task = await open_session()
        if not emotions:
            session.gw.prompts = SimpleNamespace(emotion=None)
        for message in messages:
            if isinstance(message, str):
                ws.inbox.put_nowait({"type": "websocket.receive", "text": message})
            else:
                ws.send(type="text", **message)
        err = await ws.next_json()
        ws.send(type="text", text=spoken, flush=True)
        engine.play(await engine.started(1))
        seen = await ws.until("flushed")
        await shut(ws, task)
        return err, seen, engine.texts

    return asyncio.run(go())


def test_close_with_a_full_queue_still_speaks_everything_and_closes():
    """3 queued utterances (the limit) plus unterminated text, then close."""

    async def go():
        _session, ws, engine, task = await open_session(Limits(max_pending_utterances=3))
        ws.send(type="text", text="One. Two. Three. Four")
        ws.send(type="close")
        for i in range(1, 5):
            engine.play(await engine.started(i))
        seen = await ws.until("session.closed")
        async with asyncio.timeout(TIMEOUT):
            await task  # the session ends by itself
        return seen, ws.close_code, engine.texts

    seen, code, texts = asyncio.run(go())
    assert [d["text"] for d in seen if d["type"] == "audio.start"] == ["One.", "Two.", "Three.", "Four"]
    assert not [d for d in seen if d["type"] == "error"]
    assert sum(d["type"] == "audio.done" for d in seen) == 4 and code == 1000
    assert texts == ["One.", "Two.", "Three.", "Four"]


def test_the_pending_limit_bounds_the_utterances_queued_not_the_sentences():
    """--max-pending-utterances counts what is queued: each utterance a sentence becomes (its text between breaks and
    style tags, each break's silence, marks alone between two breaks). One sentence of 6 short breaks is 13 of them,
    one sentence counted: queued past a limit of 8 behind an utterance playing (a 10 K text of them queued ~500 for one
    session). Refused whole with too_many_utterances, nothing of it queued and its text kept buffered, as past the
    limit in sentences. An empty queue takes it whole (else a sentence of more breaks than the limit could never be
    spoken); a normal text of several sentences is spoken as ever."""
    breaks = " ".join(f'w{i} <break time="1ms"/><mark name="m{i}"/>' for i in range(6)) + " end."

    async def go() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
        _session, ws, engine, task = await open_session(Limits(max_pending_utterances=8))
        ws.send(type="text", text="Playing.", flush=True)
        await engine.started(1)
        ws.send(type="text", text=breaks, flush=True)
        refused = await ws.until("error")
        ws.send(type="cancel")
        await ws.until("cancelled")
        await ws.until("flushed")  # ("Playing."'s, its text dropped)
        ws.send(type="text", text=breaks, flush=True)  # (nothing queued: taken whole)
        for n in range(2, 9):
            engine.play(await engine.started(n))
        seen = await ws.until("flushed")
        ws.send(type="text", text="One. Two. Three. Four. Five.", flush=True)
        for n in range(9, 14):
            engine.play(await engine.started(n))
        seen += await ws.until("flushed")
        await shut(ws, task)
        return refused, seen, engine.texts

    refused, seen, texts = asyncio.run(go())
    assert refused[-1]["code"] == "too_many_utterances" and "at most 8" in refused[-1]["message"], refused
    assert not [d for d in refused if d["type"] == "audio.start"] and texts[0] == "Playing.", refused
    assert texts[1:] == [*(f"w{i}" for i in range(6)), "end.", "One.", "Two.", "Three.", "Four.", "Five."], texts
    assert not [d for d in seen if d["type"] == "error"], seen


def test_a_flush_refused_for_buffer_full_speaks_nothing_of_its_text(monkeypatch):
    """Past the answers a session keeps waiting (MAX_PENDING_ANSWERS: 2 here, 4,096 in production), a flush is
    refused with buffer_full: its text was queued and spoken first, the error saying otherwise. Refused before its text
    is queued now: a flush message's text stays buffered (a later flush speaks it), a text message with `flush` is
    refused whole (none of it taken)."""
    from app.core import lanes as lanes_module

    monkeypatch.setattr(lanes_module, "MAX_PENDING_ANSWERS", 2)

    async def go() -> tuple[list[dict[str, Any]], list[str], list[dict[str, Any]], list[str]]:
        _session, ws, engine, task = await open_session()
        for ctx in ("a", "b"):  # two answers waiting for their audio
            ws.send(type="text", text=f"{ctx.upper()} one.", context_id=ctx, flush=True)
        await engine.started(2)
        ws.send(type="text", text="C whole.", context_id="c", flush=True)
        refused = await ws.until("error")
        ws.send(type="text", text="C kept.", context_id="c")
        ws.send(type="flush", context_id="c")
        refused += await ws.until("error")
        texts = list(engine.texts)
        for n in (1, 2):
            engine.play(await engine.started(n))
        seen = await ws.until("flushed")
        seen += await ws.until("flushed")
        ws.send(type="flush", context_id="c")  # (room again: its text spoken now)
        engine.play(await engine.started(3))
        seen += await ws.until("flushed")
        await shut(ws, task)
        return refused, texts, seen, engine.texts

    refused, texts_then, seen, texts = asyncio.run(go())
    errors = [d for d in refused if d["type"] == "error"]
    assert [(d["code"], d["context_id"]) for d in errors] == [("buffer_full", "c")] * 2, errors
    assert texts_then == ["A one.", "B one."], texts_then  # neither refused text was queued
    assert texts == ["A one.", "B one.", "C kept."] and not [d for d in seen if d["type"] == "error"], seen
    assert [d["context_id"] for d in seen if d["type"] == "flushed"] == ["a", "b", "c"], seen


def test_a_draining_session_closes_only_once_its_turn_is_spoken(monkeypatch):
    """The server drains (a SIGTERM): a session closes with 1012 once nothing is buffered, queued or playing and no
    message came for DRAIN_QUIET_S, not while its turn's text is still arriving or speaking."""
    monkeypatch.setattr(session_module, "DRAIN_QUIET_S", 0.05)

    async def go():
        session, ws, engine, task = await open_session()
        ws.send(type="text", text="The turn so far")
        await asyncio.sleep(0.2)
        session.drain()
        await asyncio.sleep(0.3)
        open_with_text = ws.close_code is None and not task.done()
        ws.send(type="text", text=" ends here.", flush=True)
        stream = await engine.started(1)
        await asyncio.sleep(0.3)
        open_while_speaking = ws.close_code is None and not task.done()
        engine.play(stream)
        seen = await ws.until("audio.done")
        async with asyncio.timeout(TIMEOUT):
            await task  # it ends by itself
        return open_with_text, open_while_speaking, seen, ws.close_code

    open_with_text, open_while_speaking, seen, code = asyncio.run(go())
    assert open_with_text and open_while_speaking
    assert [d["text"] for d in seen if d["type"] == "audio.start"] == ["The turn so far ends here."]
    assert code == session_module.DRAIN_CLOSE_CODE == 1012


def test_text_after_close_is_refused_but_cancel_still_works():
    async def go():
        _session, ws, engine, task = await open_session()
        ws.send(type="text", text="A long one.", flush=True)
        stream = await engine.started(1)
        engine.play(stream, finish=False)
        await ws.until("audio.start")
        ws.send(type="close")
        ws.send(type="text", text="More.")
        err = await ws.until("error")
        ws.send(type="cancel")
        rest = await ws.until("session.closed")
        async with asyncio.timeout(TIMEOUT):
            await task
        return err[-1], rest

    err, rest = asyncio.run(go())
    assert err["code"] == "bad_message" and "closing" in err["message"]
    assert [d["type"] for d in rest] == ["cancelled", "flushed", "session.closed"]


def test_flush_then_cancel_answers_the_flush_after_cancelled():
    """A flush whose text is cancelled is answered by `flushed` right after `cancelled`."""

    async def go():
        _session, ws, engine, task = await open_session()
        ws.send(type="text", text="First turn.", context_id="a")
        ws.send(type="flush", context_id="a")
        ws.send(type="text", text="Other turn.", context_id="b")
        ws.send(type="flush", context_id="b")
        engine.play(await engine.started(1), finish=False)
        await ws.until("audio.start")
        ws.send(type="cancel", context_id="a")
        after_cancel = await ws.until("flushed")
        engine.play(await engine.started(2))
        rest = await ws.until("flushed")
        await shut(ws, task)
        return after_cancel, rest, engine

    after_cancel, rest, engine = asyncio.run(go())
    assert [(d["type"], d.get("context_id")) for d in after_cancel] == [("cancelled", "a"), ("flushed", "a")]
    assert [(d["type"], d.get("context_id")) for d in rest] == [
        ("audio.start", "b"),
        ("audio.done", "b"),
        ("flushed", "b"),
    ]
    assert engine.cancelled == [1]


def test_cancel_all_answers_every_pending_flush_once():
    async def go():
        _session, ws, engine, task = await open_session()
        ws.send(type="text", text="One. Two.", flush=True)
        ws.send(type="flush")
        ws.send(type="flush", context_id="default")
        engine.play(await engine.started(1), finish=False)
        await ws.until("audio.start")
        ws.send(type="cancel")
        seen = await ws.until("cancelled")
        seen += [await ws.next_json() for _ in range(3)]
        ws.send(type="flush")  # nothing queued: answered at once
        seen.append(await ws.next_json())
        await shut(ws, task)
        return seen

    seen = asyncio.run(go())
    assert [d["type"] for d in seen] == ["cancelled", "flushed", "flushed", "flushed", "flushed"]


def flush_marks(session) -> dict:
    """The flushes waiting in the session's default lane: (context or None for all, the last queued utterance each
    waits for) -> its answers."""
    lane = session.lanes.get(DEFAULT_CONTEXT)
    return dict(lane.marks) if lane else {}


def test_pending_flush_marks_stay_bounded():
    """Alternating flushes, and flushes of text that is then cancelled, while one long
    utterance plays, cost at most two marks per queued utterance; every flush is still answered once."""

    async def go():
        session, ws, engine, task = await open_session()
        ws.send(type="text", text="Playing for a long time.", context_id="a", flush=True)
        engine.play(await engine.started(1), finish=False)
        await ws.until("audio.start")
        n = 300
        for i in range(n):
            ws.send(type="flush", context_id=None if i % 2 else "a")
        for _ in range(n):  # text of another context, flushed for all, then cancelled
            ws.send(type="text", text="Brief.", context_id="b")
            ws.send(type="flush")
            ws.send(type="cancel", context_id="b")
        got = []
        while sum(d["type"] == "cancelled" for d in got) < n:
            got.append(await ws.next_json())
        marks = len(flush_marks(session))
        engine.play(engine.streams[0])
        flushed = sum(d["type"] == "flushed" for d in got)
        while flushed < 2 * n + 1:
            d = await ws.next_json()
            flushed += d["type"] == "flushed"
        await shut(ws, task)
        return marks, flush_marks(session)

    marks, left = asyncio.run(go())
    assert marks <= 2 and left == {}


def test_utterances_play_in_order_and_the_next_one_is_prefetched():
    async def go():
        _session, ws, engine, task = await open_session()
        ws.send(type="session.config", params={"long_form": False})  # a continuation chain starts them all
        assert (await ws.next_json())["type"] == "session.updated"
        ws.send(type="text", text="One. Two. Three.", flush=True)
        first = await engine.started(1)
        await engine.started(2)  # the next one generates while the first plays
        assert len(engine.streams) == 2  # max_inflight_per_session
        engine.play(engine.streams[1])  # the second finishes first: it still plays second
        engine.play(first)
        engine.play(await engine.started(3))
        seen = await ws.until("flushed")
        await shut(ws, task)
        return seen

    seen = asyncio.run(go())
    starts = [d["text"] for d in seen if d["type"] == "audio.start"]
    assert starts == ["One.", "Two.", "Three."]
    done = [d for d in seen if d["type"] == "audio.done"]
    assert all(d["stats"]["audio_ms"] == pytest.approx(512 / 44.1, abs=0.01) for d in done)
    assert all(d["stats"]["ttfa_ms"] is not None and d["stats"]["rtf"] is not None for d in done)


@pytest.mark.parametrize("contexts", [6, 1])
def test_sentences_each_flushed_or_in_contexts_of_their_own_generate_at_most_max_inflight_at_once(contexts):
    """Our socket plays every context in one lane. A sentence that starts a continuation chain was started however far
    back in the queue it stood (the rule for a chain's later links, which must continue the one before), and a
    sentence starts a chain in a context of its own, or after a flush (the turn's end): a client that sent one sentence
    to each of 12 contexts had 12 engine requests at once (measured: `open` 12, 4 waiting for a slot on a CPU server's
    8), and so did a voice agent sending each sentence of a reply with its flush, past --max-inflight-per-session (2):
    one socket filling the engine's queue (and, reading nothing, holding it until the send timeout). Now only the links
    of a chain already started start beyond that depth (hostile pass)."""

    async def go():
        session, ws, engine, task = await open_session()
        for i in range(6):
            ws.send(type="text", text=f"Context {i % contexts} speaks.", context_id=f"c{i % contexts}", flush=True)
        ws.send(type="flush", context_id="nothing-queued")  # answered at once, once the texts before it are handled
        assert (await ws.until("flushed"))[-1]["context_id"] == "nothing-queued"
        queue = session.lanes[DEFAULT_CONTEXT].pipe.queue
        assert len(queue) == 6 and all(u.chain is not None for u in queue)  # (each the first of its chain)
        generating = sum(u.start_task is not None for u in queue)
        for n in range(1, 7):  # each one played lets the next start
            engine.play(await engine.started(n))
        seen = [d for _ in range(6) for d in await ws.until("flushed")]
        await shut(ws, task)
        return generating, seen

    generating, seen = asyncio.run(go())
    assert generating == 2  # (it was 6: every sentence)
    assert [d["context_id"] for d in seen if d["type"] == "audio.start"] == [f"c{i % contexts}" for i in range(6)]


def test_lone_surrogate_is_a_coded_error_and_the_session_goes_on():
    """Text side: no `internal`, no lost session."""
    err, seen, _ = refused_then_spoken(['{"type":"text","text":"\\ud800 hello."}'], "Still here.")
    assert err["type"] == "error" and err["code"] == "bad_text"
    assert [d["text"] for d in seen if d["type"] == "audio.start"] == ["Still here."]


def test_a_context_id_with_a_lone_surrogate_is_refused_not_echoed():
    """A context id is echoed in every message about its context: one with a lone surrogate (JSON's "\\ud800", no
    UTF-8 form) is refused as its text would be (the hostile pass: it was accepted and echoed back)."""

    raw = '{"type":"text","text":"Hello.","context_id":"c\\ud800","flush":true}'
    err, seen, texts = refused_then_spoken([raw], "Still here.")
    assert err["type"] == "error" and err["code"] == "bad_message" and "context_id" in err["message"], err
    assert "context_id" not in err
    assert texts == ["Still here."] and [d["text"] for d in seen if d["type"] == "audio.start"] == ["Still here."]


def test_queued_messages_are_handled_one_step_of_the_event_loop_each():
    """uvicorn's WebSocket protocol queues every message of one read at once, and a queue's get returns without
    yielding while it holds one: a client pipelining thousands of small messages (64 KB of `{"type":"nope"}` is
    4,000) had them all handled in one step of the event loop while every other session and request waited
    (hostile pass: /healthz 2 ms -> over 5 s on one socket; a Cartesia context-opening message each, 440 ms). The
    session lets the loop run between two messages: here a task that counts the loop's steps advances between
    every two answers."""

    async def go():
        _session, ws, _engine, task = await open_session()
        steps = 0

        async def count() -> None:
            nonlocal steps
            while True:
                steps += 1
                await asyncio.sleep(0)

        at: list[int] = []
        send_text = ws.send_text

        async def answer(text: str) -> None:
            at.append(steps)
            await send_text(text)

        ws.send_text = answer  # type: ignore[method-assign]
        counter = asyncio.create_task(count())
        for _ in range(200):
            ws.send(type="nope")
        for _ in range(200):
            assert (await ws.next_json())["code"] == "bad_message"
        counter.cancel()
        await shut(ws, task)
        return at

    at = asyncio.run(go())
    assert len(at) == 200 and all(b > a for a, b in itertools.pairwise(at)), at


def test_a_text_whose_flush_is_no_boolean_is_refused_whole():
    err, seen, texts = refused_then_spoken([{"text": "Not this.", "flush": "false"}], "This one.")
    assert (err["type"], err["code"]) == ("error", "bad_message")
    assert texts == ["This one."] and [d["text"] for d in seen if d["type"] == "audio.start"] == ["This one."]


def test_a_failing_start_costs_one_utterance_not_the_session():
    async def go():
        session, ws, engine, task = await open_session()
        real = engine.start_utterance

        async def start(text, *a, **kw):
            if text == "Bad.":
                raise RuntimeError("a bug")
            return await real(text, *a, **kw)

        session.gw.start_utterance = start
        ws.send(type="text", text="Bad. Good.", flush=True)
        engine.play(await engine.started(1))
        seen = await ws.until("flushed")
        await shut(ws, task)
        return seen

    seen = asyncio.run(go())
    kinds = [(d["type"], d.get("code")) for d in seen]
    assert kinds[0] == ("error", "internal") and ("audio.done", None) in kinds


def test_http_speak_yields_every_sentence_in_order():
    """At the pipeline: all sentences, trailing whitespace included, in order."""

    async def go():
        gw = fake_gateway()
        chunks = []

        async def feed():
            for i in range(1, 4):
                FakeEngine.play(await gw.fake.started(i), samples=100 * i)

        feeder = asyncio.create_task(feed())
        async for x in speak(gw, "openai", "One. Two. Three. \n", SynthesisOptions(), None, None):  # type: ignore[arg-type]
            chunks.append(len(x))
        await feeder
        return chunks, gw.fake.texts

    chunks, texts = asyncio.run(go())
    assert texts == ["One.", "Two.", "Three."] and chunks == [100, 200, 300]


def test_http_speak_holds_the_break_and_tag_limits_over_the_whole_text():
    """16 breaks (or tags) per sentence would pass the per-sentence checks: a 4 KB text of them was half an hour of
    silence. The whole text is refused before anything starts."""

    async def refused(text: str) -> RequestError:
        gw = fake_gateway()
        with pytest.raises(RequestError) as e:
            async with asyncio.timeout(10):  # a failure guard: accepted, it would wait for the fake engine's audio
                async for _ in speak(gw, "openai", text, SynthesisOptions(), None, None):  # type: ignore[arg-type]
                    pass
        assert gw.fake.texts == []
        return e.value

    breaks = asyncio.run(refused(("A. " + '<break time="10s"/>' * 9) * 2))
    tags = asyncio.run(refused("A [neutral] b. " * 17))
    assert (breaks.code, breaks.status) == (tags.code, tags.status) == ("bad_text", 400)
    assert "breaks" in str(breaks) and "style tags" in str(tags)


def test_every_utterance_tells_the_engine_what_its_encoder_needs_first():
    """Our socket (its session.config output) and an HTTP answer (speech_response, every HTTP door) send each
    utterance with the samples its encoder takes in before it outputs anything: 1 at 44.1 kHz (the engine's
    10-frame first call), the resampler's at 24, 16 or 8 kHz, MP3's first frame."""

    async def socket() -> list[int | None]:
        _session, ws, engine, task = await open_session()
        for config in ({}, {"sample_rate": 24000}, {"encoding": "mulaw"}):
            if config:
                ws.send(type="session.config", **config)
                assert (await ws.next_json())["type"] == "session.updated"
            ws.send(type="text", text="One.", flush=True)
            engine.play(await engine.started(len(engine.streams) + 1))
            await ws.until("flushed")
        await shut(ws, task)
        return engine.first_samples

    async def http(fmt: OutputFormat) -> int | None:
        gw = fake_gateway()
        never: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        request = SimpleNamespace(
            app=SimpleNamespace(state=SimpleNamespace(gateway=gw)), receive=lambda: never, scope={"state": {}}
        )

        async def feed() -> None:
            FakeEngine.play(await gw.fake.started(1), samples=4000)

        feeder = asyncio.create_task(feed())
        response = await speech_response(request, "openai", "One.", SynthesisOptions(), None, fmt)  # type: ignore[arg-type]
        body = b"".join([chunk async for chunk in response.body_iterator])  # type: ignore[misc]
        await feeder
        assert body
        return gw.fake.first_samples[0]

    assert asyncio.run(socket()) == [1, 86, 108]
    formats = [OutputFormat("pcm_s16le", 44100), OutputFormat("pcm_s16le", 16000, wav=True), OutputFormat("mp3", 44100)]
    assert [asyncio.run(http(f)) for f in formats] == [1, 128, 2528]


def test_a_queued_utterance_holds_no_encoder_until_it_plays():
    """An 8 kHz encoder (its resampler's state) is ~100 KB: each of a session's 32 queued utterances held one from
    the moment it was queued (at 256 sessions, ~800 MB). It is made when the utterance begins to play, for the
    output fixed when it was queued (a later session.config is for later text)."""

    async def go() -> tuple[list[bool], list[int]]:
        session, ws, engine, task = await open_session()
        ws.send(type="session.config", encoding="mulaw", params={"long_form": False})
        assert (await ws.next_json())["type"] == "session.updated"
        ws.send(type="text", text="One. Two. Three. Four.", flush=True)
        await engine.started(2)
        queued = [u.encoder is not None for u in list(session.lanes[DEFAULT_CONTEXT].pipe.queue)[1:]]
        ws.send(type="session.config", encoding="pcm_s16le", sample_rate=44100)
        assert (await ws.next_json())["type"] == "session.updated"
        sizes = []
        for n in range(1, 5):
            engine.play(await engine.started(n))
            size = 0
            while True:
                msg = await ws.out.get()
                if isinstance(msg, bytes):
                    size += len(msg)
                elif msg["type"] == "audio.done":
                    break
            sizes.append(size)
        await ws.until("flushed")
        await shut(ws, task)
        return queued, sizes

    queued, sizes = asyncio.run(go())
    assert queued == [False, False, False]
    assert sizes == [sizes[0]] * 4 and sizes[0] < 512  # mulaw at 8 kHz, every one: 1 byte a sample


def test_a_break_holds_the_door_no_room():
    """The door holds room for a conversation by the audio it plays (app/core/door_policy.py Conversation); a break
    (silence the gateway makes, no engine work) is no speech: a client sending a 0.1 s break every few seconds on
    each of a few sockets held every slot of the door for free, and newcomers were refused."""

    async def go() -> tuple[tuple[float, float], tuple[float, float], tuple[float, float]]:
        session, ws, engine, task = await open_session()
        c = session.conversation
        c.audio_end, c.credit_s = 0.0, 0.0  # spoke long ago
        ws.send(type="text", text='<break time="100ms"/>', flush=True)
        await ws.until("flushed")
        after_break = (c.audio_end, c.credit_s)
        ws.send(type="text", text="One.", flush=True)
        engine.play(await engine.started(1))
        await ws.until("flushed")
        after_speech = (c.audio_end, c.credit_s)
        await shut(ws, task)
        return (0.0, 0.0), after_break, after_speech

    before, after_break, after_speech = asyncio.run(go())
    assert after_break == before and after_speech[0] > 0.0 and after_speech[1] > 0.0


class _Clock:
    """The door's clock (app/core/door_policy.py), moved by hand."""

    def __init__(self) -> None:
        self.t = time.monotonic()

    def monotonic(self) -> float:
        return self.t


@pytest.mark.parametrize(
    ("samples", "pause_s", "held"), [(512, 9.0, [True, False, False, False]), (44100, 2.0, [True] * 4)]
)
def test_a_hold_is_kept_by_the_audio_a_session_plays(monkeypatch, samples, pause_s, held):
    """A hostile client sending a one-frame utterance every 9 s (the hold is 10 s) kept the door's room held for it
    forever at no cost, and newcomers were refused: a hold now lasts while the session's audio plays at a real pace
    and then for what its audio earned. A session speaking 1 s sentences with 2 s pauses keeps it."""
    clock = _Clock()
    monkeypatch.setattr(door_policy, "time", clock)

    async def go() -> list[bool]:
        session, ws, engine, task = await open_session(Limits(conversation_hold_s=10.0))
        seen = []
        for i in range(1, 5):
            clock.t += pause_s
            seen.append(session.conversation.held(clock.t))
            ws.send(type="text", text="a.", flush=True)
            engine.play(await engine.started(i), samples=samples)
            await ws.until("flushed")
            clock.t += samples / 44100  # its audio plays
        await shut(ws, task)
        return seen

    assert asyncio.run(go()) == held


def test_engine_errors_map_to_http_statuses():
    assert engine_error(m.Error(1, EngineError.PROMPT_TOO_LONG, "x")).status == 400
    assert engine_error(m.Error(1, EngineError.QUEUE_FULL, "")).status == 503
    unknown = engine_error(m.decode({"type": m.ERROR, "rid": 1, "code": "weird", "message": ""}))
    assert unknown.status == 500 and unknown.code == "internal"
    # every code the engine sends for a client's request is a 4xx or 503; only a bug (internal) is a 500
    assert all(
        400 <= c.http_status < 600 and (c.http_status != 500) == (c is not EngineError.INTERNAL) for c in EngineError
    )

    async def go():
        gw = fake_gateway()

        async def feed():
            stream = await gw.fake.started(1)
            stream._deliver(m.Error(stream.rid, EngineError.PROMPT_TOO_LONG, "too long"))

        feeder = asyncio.create_task(feed())
        with pytest.raises(RequestError) as e:
            async for _ in speak(gw, "openai", "Hi.", SynthesisOptions(), None, None):  # type: ignore[arg-type]
                pass
        await feeder
        return e.value

    err = asyncio.run(go())
    assert (err.code, err.status) == ("prompt_too_long", 400)


def test_utterance_budget_follows_the_engine_context():
    gw = fake_gateway()
    assert utterance_bytes(gw) == min(Limits().max_text_chars, (6144 - 32) // 7, Limits().max_frames // 6)
    gw.engine.info["max_context"] = 1024
    assert utterance_bytes(gw) == (1024 - 32) // 7


# ---- an utterance whose spoken text outgrew the budget (app/core/gateway.py PieceStream) ---------------------
def _piece_submitter(engine: FakeEngine, events: dict[str, list[Event]]) -> tuple[Any, list[str]]:
    """submit(piece, max_frames) -> a Stream that already holds the events given for that piece."""
    submitted: list[str] = []
    limits = engine.limits

    def submit(piece: str, max_frames: int) -> Stream:
        stream = Stream(len(engine.streams) + 1, engine, 10**9)  # type: ignore[arg-type]
        engine._streams[stream.rid] = stream
        engine.streams.append(stream)
        submitted.append(piece)
        limits.append(max_frames)
        for ev in events.get(piece, []):
            stream._deliver(ev)
        return stream

    return submit, submitted


def _audio(n: int = 512) -> Event:
    return m.Audio(0, 0, np.ones(n, np.int16))


def _finished(reason: str = "eos", frames: int = 5) -> Event:
    return m.Finished(0, reason, stats=engine_stats(frames))


def test_pieces_play_in_order_one_ahead_and_finish_once():
    from app.core.gateway import PieceStream

    async def go():
        engine = FakeEngine()
        events = {p: [_audio(), _finished(frames=i + 1)] for i, p in enumerate(["one", "two", "three"])}
        submit, submitted = _piece_submitter(engine, events)
        stream = PieceStream(submit, ["one", "two", "three"], 1000)
        assert submitted == ["one"]
        first = await stream.__anext__()
        assert first.type == m.AUDIO and submitted == ["one", "two"]  # the next generates while this plays
        rest = [ev async for ev in stream]
        return [first, *rest], submitted

    seen, submitted = asyncio.run(go())
    assert [ev.type for ev in seen] == [m.AUDIO] * 3 + [m.FINISHED]
    assert isinstance(seen[-1], m.Finished) and seen[-1].stats is not None
    assert seen[-1].stats.frames == 1 + 2 + 3 and seen[-1].reason == "eos"
    assert submitted == ["one", "two", "three"]


def test_a_piece_cut_by_max_frames_is_reported_and_an_error_ends_the_rest():
    from app.core.gateway import PieceStream

    async def go():
        engine = FakeEngine()
        submit, _ = _piece_submitter(engine, {"a": [_audio(), _finished("max_frames")], "b": [_audio(), _finished()]})
        cut = [ev async for ev in PieceStream(submit, ["a", "b"], 1000)]
        err = m.Error(0, EngineError.ENGINE_RESTARTED, "x")
        submit, submitted = _piece_submitter(engine, {"x": [_audio(), err]})
        failed = [ev async for ev in PieceStream(submit, ["x", "y", "z"], 1000)]
        return cut, failed, submitted, engine

    cut, failed, submitted, engine = asyncio.run(go())
    assert isinstance(cut[-1], m.Finished) and cut[-1].reason == "max_frames"  # never hidden
    assert [ev.type for ev in failed] == [m.AUDIO, m.ERROR]
    assert submitted == ["x", "y"] and engine.streams[-1].done  # the one ahead was cancelled, z never sent
    assert engine.cancelled == [engine.streams[-1].rid]


def test_the_pieces_of_one_utterance_share_its_frame_limit():
    """Each piece may take what the ones before it left; the audio stops at the limit, the one playing and
    the one ahead are cancelled, and the utterance finishes max_frames."""
    from app.core.gateway import PieceStream

    async def go():
        engine = FakeEngine()
        events = {p: [_audio(3 * 512), _audio(3 * 512), _finished("max_frames")] for p in ("a", "b", "c")}
        submit, submitted = _piece_submitter(engine, events)
        seen = [ev async for ev in PieceStream(submit, ["a", "b", "c"], 8)]
        return seen, submitted, engine

    seen, submitted, engine = asyncio.run(go())
    audio = [len(ev.pcm) for ev in seen if isinstance(ev, m.Audio)]
    assert sum(audio) == 8 * 512 and audio == [3 * 512, 3 * 512, 2 * 512]
    assert isinstance(seen[-1], m.Finished) and seen[-1].reason == "max_frames"
    # b was sent ahead while a played (nothing played yet: all 8), c once a had played 6 (2 left); c is
    # cancelled when b reaches the limit
    assert engine.limits == [8, 8, 2] and submitted == ["a", "b", "c"]
    assert engine.streams[-1].done


def test_a_sentence_cut_at_max_frames_reports_the_frames_of_its_pieces():
    """audio.done's `frames` and engine stats count every piece also when the utterance's limit cuts it (they were
    null, the piece playing cancelled and its finish made up). The first piece, sent with the utterance's limit,
    reaches it with its own: it is not cancelled, its finish (right after its last audio) is waited for. A later one,
    sent with more while the one before played, is cancelled at the limit: the audio played of it counts."""
    from app.core.gateway import PieceStream

    async def own_limit():
        engine = FakeEngine()
        events = {"a": [_audio(6 * 512), _audio(4 * 512)], "b": [_audio()]}  # b: still generating
        submit, _ = _piece_submitter(engine, events)
        stream = PieceStream(submit, ["a", "b"], 10)
        seen = [await stream.__anext__(), await stream.__anext__()]
        engine.streams[0]._deliver(_finished("max_frames", frames=10))  # the engine's, after the limit's audio
        seen += [ev async for ev in stream]
        return seen, engine

    seen, engine = asyncio.run(own_limit())
    assert sum(len(ev.pcm) for ev in seen if isinstance(ev, m.Audio)) == 10 * 512
    end = seen[-1]
    assert isinstance(end, m.Finished) and end.reason == "max_frames" and end.stats is not None
    assert end.stats.frames == 10 and end.stats.audio_s == round(10 * 512 / 44100, 4)
    assert engine.cancelled == [engine.streams[1].rid]  # the one ahead; the first ended on the engine

    async def cancelled_at_limit():
        engine = FakeEngine()
        events = {"a": [_audio(3 * 512), _finished(frames=3)], "b": [_audio(3 * 512), _audio(3 * 512)]}
        submit, _ = _piece_submitter(engine, events)
        return [ev async for ev in PieceStream(submit, ["a", "b"], 8)], engine

    seen, engine = asyncio.run(cancelled_at_limit())
    assert [len(ev.pcm) for ev in seen if isinstance(ev, m.Audio)] == [3 * 512, 3 * 512, 2 * 512]
    end = seen[-1]
    assert isinstance(end, m.Finished) and end.reason == "max_frames" and end.stats is not None
    assert end.stats.frames == 3 + 5 and end.stats.audio_s == round(8 * 512 / 44100, 4)
    assert end.stats.ttfa_ms == engine_stats(3).ttfa_ms  # the first piece's first audio
    assert engine.limits == [8, 8] and engine.cancelled == [engine.streams[1].rid]


def test_cancelling_pieces_stops_the_one_playing_and_the_one_ahead():
    from app.core.gateway import PieceStream

    async def go():
        engine = FakeEngine()
        submit, submitted = _piece_submitter(engine, {"a": [_audio()]})
        stream = PieceStream(submit, ["a", "b", "c"], 1000)
        await stream.__anext__()
        stream.cancel()
        return [ev async for ev in stream], submitted, engine

    after, submitted, engine = asyncio.run(go())
    assert after == [] and submitted == ["a", "b"]
    assert sorted(engine.cancelled) == [s.rid for s in engine.streams]


def test_our_socket_calibrates_the_emotion_by_the_voice_id():
    """docs/protocol.md: the emotion's calibration key is the voice's id (our socket has no field naming
    another); it follows the voice a session.config picks, and is dropped with the voice."""
    voice = SimpleNamespace(id="v_ada", embedding=np.ones(2048, np.float32))

    async def go():
        session, ws, _engine, task = await open_session()
        session.gw.resolve_voice = lambda ref, owner: voice if ref else None
        ws.send(type="session.config", voice="ada", params={"emotion_strength": 2.0})
        await ws.until("session.updated")
        keyed = session.opts.emotion.speaker_key
        ws.send(type="session.config", voice=None)
        await ws.until("session.updated")
        dropped = session.opts.emotion.speaker_key
        await shut(ws, task)
        return keyed, dropped, session.opts.emotion.strength

    keyed, dropped, strength = asyncio.run(go())
    assert keyed == "v_ada" and dropped is None and strength == 2.0


@pytest.mark.parametrize("change", [{"voice": "b"}, {"voice": None}, {"voice": "a2"}, {"params": {"seed": 3}}])
def test_a_voice_changed_mid_turn_starts_a_chain_of_its_own(change):
    """One chain is one voice (docs/protocol.md "One voice, one stream"): the sentence after a session.config that
    picks another voice (or none) starts a chain of its own, and the one before it ends its chain (generated final,
    not held for a continuation that would not come). It continued the old voice's chain: its prompt held the old
    voice's frames and its audio went on in their DAC stream, so the new voice spoke on in the old one. The same
    voice again (another object of the same embedding) or a config of other settings keeps the turn's chain."""
    voices = {
        "a": SimpleNamespace(id="v_a", embedding=np.ones(2048, np.float32)),
        "a2": SimpleNamespace(id="v_a", embedding=np.ones(2048, np.float32)),  # the same voice, read again
        "b": SimpleNamespace(id="v_b", embedding=np.full(2048, 2.0, np.float32)),
    }

    async def go() -> FakeEngine:
        session, ws, engine, task = await open_session()
        session.gw.resolve_voice = lambda ref, owner: voices[ref] if ref else None
        ws.send(type="session.config", voice="a")
        await ws.until("session.updated")
        ws.send(type="text", text="One. Two ")  # "One." is certain once the word after it is complete
        await engine.started(1)
        ws.send(type="session.config", **change)
        await ws.until("session.updated")
        ws.send(type="text", text="and three.", flush=True)
        FakeEngine.play(engine.streams[0])
        FakeEngine.play(await engine.started(2))
        await ws.until("flushed")
        await shut(ws, task)
        return engine

    engine = asyncio.run(go())
    assert engine.texts == ["One.", "Two and three."]
    first, second = engine.chains
    assert first is not None and second is not None
    if "voice" in change and change["voice"] != "a2":
        assert second is not first and first.last.final  # the old voice's sentence ended its chain
    else:
        assert second is first


class _CountingLock(asyncio.Lock):
    """A send lock that says how many times it was asked for, so a test can wait until a task waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0
        self.changed = asyncio.Event()

    async def acquire(self) -> bool:
        self.asked += 1
        self.changed.set()
        return await super().acquire()

    async def asked_for(self, n: int) -> None:
        async with asyncio.timeout(TIMEOUT):
            while self.asked < n:
                self.changed.clear()
                await self.changed.wait()


def test_elevenlabs_close_socket_survives_a_context_that_ends_while_others_close():
    """close_socket closes every context in turn; closing one answers the marks every lane has due, so a closed
    context whose audio just ended gets its isFinal then and leaves `ctxs` under the loop: the loop must not look it
    up again (a KeyError ended the session with `internal`, close 1011, its other contexts' audio lost)."""
    from app.doors.dialects.elevenlabs import ElevenLabsSession

    async def go() -> tuple[list[Any], int | None]:
        gw = fake_gateway()
        ws = FakeSocket()
        ws.query_params = {"output_format": "pcm_44100"}  # type: ignore[attr-defined]
        ws.path_params = {"voice_id": "any"}  # type: ignore[attr-defined]
        session = ElevenLabsSession(ws, gw, "")  # type: ignore[arg-type]
        lock = session.send_lock = _CountingLock()
        task = asyncio.create_task(session.run())
        ws.send(text="Still open", context_id="a")  # a context before b in the session's order, not closing
        ws.send(text="Bee.", context_id="b", flush=True)
        ws.send(context_id="b", close_context=True)
        stream = await gw.fake.started(1)
        FakeEngine.play(stream, finish=False)
        assert (await ws.next_json())["contextId"] == "b"  # b's audio is out
        async with lock:  # b's end waits for the lock; then close_socket's first close (of a) waits behind it
            asked = lock.asked
            stream._deliver(m.Finished(stream.rid, "eos", stats=engine_stats(1)))
            await lock.asked_for(asked + 1)
            ws.send(close_socket=True)
            await lock.asked_for(asked + 2)
        seen = []
        async with asyncio.timeout(TIMEOUT):
            await task
        while not ws.out.empty():
            msg = ws.out.get_nowait()
            if isinstance(msg, dict):
                seen.append(msg)
        return seen, ws.close_code

    seen, code = asyncio.run(go())
    assert {"isFinal": True, "contextId": "b"} in seen and not any("error" in d for d in seen), seen
    assert code == 1000


def test_elevenlabs_a_close_context_while_its_first_audio_goes_out_is_a_barge_in():
    """With auto_mode a close_context ends a context's input while none of its audio has been sent, and is a
    barge-in once it has (Context.kept_by_close). Which was taken when the close arrived, before it had the send
    lock: a close that came while a pump encoded (mp3, the default, in a codec thread) or sent the context's first
    audio, and so waited for the lock, let the whole reply play on though the client had heard it begin."""
    from app.doors.dialects.elevenlabs import ElevenLabsSession

    async def go() -> tuple[list[Any], list[int]]:
        gw = fake_gateway()
        ws = FakeSocket()
        ws.query_params = {"output_format": "pcm_44100", "auto_mode": "true"}  # type: ignore[attr-defined]
        ws.path_params = {"voice_id": "any"}  # type: ignore[attr-defined]
        session = ElevenLabsSession(ws, gw, "")  # type: ignore[arg-type]
        lock = session.send_lock = _CountingLock()
        task = asyncio.create_task(session.run())
        ws.send(text="Hello there. ", context_id="a")  # auto_mode: each text spoken as it comes
        ws.send(text="And a second sentence. ", context_id="a")
        first = await gw.fake.started(1)
        async with lock:  # the pump's first audio waits for the lock (a slow socket, a codec thread)
            asked = lock.asked
            FakeEngine.play(first, finish=False)
            await lock.asked_for(asked + 1)
            ws.send(context_id="a", close_context=True)  # the listener spoke: pipecat closes the context
            await lock.asked_for(asked + 2)  # the close waits behind the first audio
        seen = []
        async with asyncio.timeout(TIMEOUT):
            while not seen or seen[-1].get("isFinal") is not True:
                seen.append(await ws.next_json())
        cancelled = list(gw.fake.cancelled)
        await shut(ws, task)
        return seen, cancelled

    seen, cancelled = asyncio.run(go())
    assert [d.get("isFinal") for d in seen] == [None, True] and seen[0]["audio"]  # the first audio, then the end
    assert 1 in cancelled  # the reply heard beginning was cut, not played on


def cartesia_socket(
    limits: Limits | None = None, directions: EmotionDirections | None = None
) -> tuple[Any, FakeSocket, Any, dict, dict]:
    """A Cartesia session on the fake engine (no aligner, no pronunciation dictionaries), not running yet: (gateway,
    socket, the session, a raw 44.1 kHz output_format, an embedding voice)."""
    from app.doors.dialects.cartesia import CartesiaSession

    gw = fake_gateway(limits, directions)
    gw.engine.aligns = False

    async def no_lexicon(ids: Any, owner: str) -> Aliases:
        return Aliases()

    gw.lexicon = no_lexicon
    ws = FakeSocket()
    ws.query_params = {}  # type: ignore[attr-defined]
    session = CartesiaSession(ws, gw, "")  # type: ignore[arg-type]
    fmt = {"output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 44100}}
    voice = {"mode": "embedding", "embedding": [0.1] * gw.cfg.speaker_embedding_dim}
    return gw, ws, session, fmt, voice


def cartesia_session(
    limits: Limits | None = None, directions: EmotionDirections | None = None
) -> tuple[Any, FakeSocket, asyncio.Task, dict, dict]:
    """`cartesia_socket`'s session, running: (gateway, socket, its task, the output_format, the voice)."""
    gw, ws, session, fmt, voice = cartesia_socket(limits, directions)
    return gw, ws, asyncio.create_task(session.run()), fmt, voice


def test_cartesia_a_context_id_used_again_before_its_done_keeps_each_contexts_audio_apart():
    """A Cartesia id used again once its input ended (`continue: false`) but before its `done` is a new context: the
    old one's utterances still playing are the old one's (their timestamps on its clock, its done), and the new
    one's timestamps count from its own first audio, not after the old one's."""

    async def go() -> list[dict[str, Any]]:
        gw, ws, task, first, voice = cartesia_session()
        streams = []
        for text in ("One.", "Two."):  # the second before the first's audio: the same id, a new context
            ws.send(transcript=text, context_id="a", add_timestamps=True, voice=voice, **first)
            streams.append(await gw.fake.started(len(streams) + 1))
        for stream in streams:
            FakeEngine.play(stream, samples=44100)
        seen = []
        while sum(d.get("type") == "done" for d in seen) < 2:
            seen.append(await ws.next_json())
        await shut(ws, task)
        return seen

    seen = asyncio.run(go())
    stamps = [d["word_timestamps"] for d in seen if d["type"] == "timestamps"]
    assert [s["words"] for s in stamps] == [["One."], ["Two."]]
    assert [s["start"][0] for s in stamps] == [0.0, 0.0], seen


def test_cartesia_each_chunk_carries_the_flush_id_of_its_text():
    """Cartesia's flush_id names the flush segment a chunk's text was sent in: the text before the first flush is
    1, after it 2, ... (an empty flush counts too), and each flush_done names the segment it ends. Chunks carried the
    context's flush count when they were sent: audio of the first segment sent after two flushes said 2."""

    async def go() -> list[dict[str, Any]]:
        gw, ws, task, fmt, voice = cartesia_session()
        common = {"context_id": "a", "voice": voice, "max_buffer_delay_ms": 0, **fmt}
        ws.send(transcript="One.", **{"continue": True}, **common)
        ws.send(transcript="", flush=True, **{"continue": True}, **common)
        ws.send(transcript="Two.", **{"continue": True}, **common)
        ws.send(transcript="Three.", flush=True, **{"continue": True}, **common)
        ws.send(transcript="", flush=True, **{"continue": True}, **common)  # empty: segment 3 has no text
        ws.send(transcript="Four.", **{"continue": False}, **common)
        seen: list[dict[str, Any]] = []
        first = await gw.fake.started(1)
        for _ in range(50):  # every message is taken before any audio is sent
            await asyncio.sleep(0)
        FakeEngine.play(first)
        for n in range(2, 5):
            FakeEngine.play(await gw.fake.started(n))
        while not seen or seen[-1].get("type") != "done":
            seen.append(await ws.next_json())
        await shut(ws, task)
        return seen

    seen = asyncio.run(go())
    assert [(m["type"], m.get("flush_id")) for m in seen if m["type"] != "done"] == [
        ("chunk", 1),
        ("flush_done", 1),
        ("chunk", 2),
        ("chunk", 2),
        ("flush_done", 2),
        ("flush_done", 3),
        ("chunk", 4),
    ], seen


def test_a_socket_of_many_contexts_has_engine_work_in_at_most_its_limit_of_them():
    """A Cartesia socket that opens more contexts than --max-inflight-per-session: only that many of them have
    engine work at once; the next starts once one has played what it started, so one socket's contexts cannot
    fill the engine's queue."""

    async def settle() -> None:  # whatever would start now has started (the fake engine starts at once)
        for _ in range(50):
            await asyncio.sleep(0)

    async def go() -> tuple[list[str], list[str], int]:
        gw, ws, task, fmt, voice = cartesia_session(Limits(max_inflight_per_session=2))
        for ctx in "abcd":
            ws.send(transcript=f"Context {ctx}.", context_id=ctx, voice=voice, **fmt)
        await gw.fake.started(2)
        await settle()
        first = list(gw.fake.texts)
        FakeEngine.play(gw.fake.streams[0])  # the first context plays to its end: a third may start
        await gw.fake.started(3)
        await settle()
        second = list(gw.fake.texts)
        for n in range(2, 5):  # the rest, each as it starts
            FakeEngine.play(gw.fake.streams[n - 1])
            if n < 4:
                await gw.fake.started(n + 1)
        dones = 0
        while dones < 4:
            dones += (await ws.next_json()).get("type") == "done"
        await shut(ws, task)
        return first, second, len(gw.fake.texts)

    first, second, every = asyncio.run(go())
    assert first == ["Context a.", "Context b."], first
    assert second == ["Context a.", "Context b.", "Context c."], second
    assert every == 4


def test_a_context_waiting_for_its_turn_is_not_held_back_by_a_context_whose_text_keeps_coming():
    """While a context waits for its turn of engine work, the contexts that have some start nothing more: it goes
    next once one of them has played what it started (else a context sent more text would keep its turn, and a newer
    context's reply would wait for all of it), and the one that gave way goes after it."""

    async def go() -> list[list[str]]:
        gw, ws, task, fmt, voice = cartesia_session(Limits(max_inflight_per_session=1))
        ws.send(transcript="One.", context_id="a", voice=voice, **fmt)
        await gw.fake.started(1)
        ws.send(transcript="Bee.", context_id="b", voice=voice, **fmt)  # waits for its turn
        ws.send(transcript="Two.", context_id="a", voice=voice, **fmt)  # more of a meanwhile
        seen = []
        for n in (1, 2, 3):
            await gw.fake.started(n)
            for _ in range(50):  # whatever would start now has started (the fake engine starts at once)
                await asyncio.sleep(0)
            seen.append(list(gw.fake.texts))
            FakeEngine.play(gw.fake.streams[n - 1])
        dones = 0
        while dones < 3:
            dones += (await ws.next_json()).get("type") == "done"
        await shut(ws, task)
        return seen

    seen = asyncio.run(go())
    assert seen == [["One."], ["One.", "Bee."], ["One.", "Bee.", "Two."]], seen


def test_a_turn_in_progress_goes_on_while_another_context_waits_for_its_turn():
    """The sentences of a turn in progress (a context's continuation chain) start while another context waits: its
    held stream waits for the next one (with --continuation-flush-lead-ms below 0, for ever), and its voice goes on.
    The waiting context goes next once the turn has played what it started."""

    async def go() -> list[list[str]]:
        gw, ws, task, fmt, voice = cartesia_session(Limits(max_inflight_per_session=1))
        turn = {"context_id": "a", "voice": voice, "continue": True, "max_buffer_delay_ms": 0, **fmt}
        ws.send(transcript="One.", **turn)
        await gw.fake.started(1)
        ws.send(transcript="Bee.", context_id="b", voice=voice, **fmt)  # waits for its turn
        ws.send(transcript=" Two.", **turn)  # the turn in progress goes on
        seen = []
        for n, plays in ((2, (0, 1)), (3, (2,))):  # the turn plays what it started, then b's turn
            await gw.fake.started(n)
            for _ in range(50):  # whatever would start now has started (the fake engine starts at once)
                await asyncio.sleep(0)
            seen.append(list(gw.fake.texts))
            for i in plays:
                FakeEngine.play(gw.fake.streams[i])
        ws.send(transcript="", **{**turn, "continue": False})
        dones = 0
        while dones < 2:
            dones += (await ws.next_json()).get("type") == "done"
        await shut(ws, task)
        return seen

    seen = asyncio.run(go())
    assert seen == [["One.", "Two."], ["One.", "Two.", "Bee."]], seen


def test_cartesia_a_new_context_while_the_server_drains_is_refused_as_a_retry_elsewhere():
    """While the server drains, a context whose turn is open is spoken on; a new one gets Cartesia's error with
    `shutting_down` and status 503 (the server's side: retry on another replica), not a client error's 400."""

    async def go() -> dict[str, Any]:
        gw, ws, task, fmt, voice = cartesia_session()
        ws.send(transcript="A turn begins. And then it", context_id="a", voice=voice, **{"continue": True}, **fmt)
        await gw.fake.started(1)  # a's turn is open
        gw.draining = True
        ws.send(transcript="A new one.", context_id="b", voice=voice, **fmt)
        refused = await ws.next_json()
        await shut(ws, task)
        return refused

    refused = asyncio.run(go())
    assert refused["error_code"] == "shutting_down" and refused["status_code"] == 503, refused
    assert refused["context_id"] == "b"


class _GoneSocket(FakeSocket):
    """A socket whose client vanished: every send raises, as Starlette's does, after `lag` turns of the event loop
    (a send already in progress when the connection dropped)."""

    def __init__(self, lag: int) -> None:
        super().__init__()
        self.gone = False
        self.lag = lag

    async def _fail(self) -> None:
        for _ in range(self.lag):
            await asyncio.sleep(0)
        raise WebSocketDisconnect(1006)

    async def send_bytes(self, data: bytes) -> None:
        if self.gone:
            await self._fail()
        await super().send_bytes(data)

    async def send_text(self, text: str) -> None:
        if self.gone:
            await self._fail()
        await super().send_text(text)


@pytest.mark.parametrize("lag", range(6))
@pytest.mark.parametrize("contexts", [1, 3])
@pytest.mark.parametrize("disconnect_first", [True, False])
def test_a_client_that_vanishes_mid_audio_leaves_no_unretrieved_error(contexts: int, disconnect_first: bool, lag: int):
    """Pumps that fail sending to a client that is gone (one lane, or several contexts' lanes at once), whether the
    socket's disconnect is read first or not: the session ends and no error is left for asyncio to log at collection
    ("Future exception was never retrieved" / "Task exception was never retrieved", with a traceback each)."""
    import gc

    from app.doors.dialects.elevenlabs import ElevenLabsSession

    reported: list[str] = []

    async def go() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: reported.append(ctx["message"]))
        gw = fake_gateway(Limits(max_inflight_per_session=max(2, contexts)))  # every context's pump at once
        ws = _GoneSocket(lag)
        ws.query_params = {"output_format": "pcm_44100"}  # type: ignore[attr-defined]
        ws.path_params = {"voice_id": "any"}  # type: ignore[attr-defined]
        session = ElevenLabsSession(ws, gw, "")  # type: ignore[arg-type]
        task = asyncio.create_task(session.run())
        for i in range(contexts):
            ws.send(text="One.", context_id=f"c{i}", flush=True)
        streams = [await gw.fake.started(i + 1) for i in range(contexts)]
        ws.gone = True
        if disconnect_first:
            ws.inbox.put_nowait({"type": "websocket.disconnect"})
        for stream in streams:
            FakeEngine.play(stream, finish=False)
        if not disconnect_first:
            ws.inbox.put_nowait({"type": "websocket.disconnect"})
        async with asyncio.timeout(TIMEOUT):
            with contextlib.suppress(WebSocketDisconnect):
                await task
        del task, session, streams
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(go())
    gc.collect()
    assert reported == []


def test_a_session_that_ends_while_a_context_waits_for_its_turn_is_freed_without_the_collector():
    """A Cartesia socket whose second context still waits for its turn of engine work (--max-inflight-per-session 1)
    when the client leaves: the ended session is freed by its references alone, its waiting contexts' pipelines
    too (test_collector reaches this state only by chance; a cycle there would be freed only by the collector's
    full passes, which hold every socket's audio)."""
    import gc
    import weakref

    async def go() -> weakref.ref:
        gw, ws, session, fmt, voice = cartesia_socket(Limits(max_inflight_per_session=1))
        task = asyncio.create_task(session.run())
        ws.send(transcript="One.", context_id="a", voice=voice, **fmt)
        await gw.fake.started(1)
        ws.send(transcript="Bee.", context_id="b", voice=voice, **fmt)  # waits for its turn
        for _ in range(50):
            await asyncio.sleep(0)
        assert gw.fake.texts == ["One."]
        await shut(ws, task)
        ref = weakref.ref(session)
        del session, task
        return ref

    gc.collect()
    gc.disable()
    try:
        ref = asyncio.run(go())
        assert ref() is None, [type(r).__qualname__ for r in gc.get_referrers(ref())]
    finally:
        gc.enable()


def happy_directions() -> EmotionDirections:
    """Emotion directions of one named emotion, so that a `[happy]` tag can be taken."""
    dim = Zonos2Config.from_dict(preset_params("tiny")).speaker_embedding_dim
    return EmotionDirections(dim=dim, named={"happy": np.full(dim, 0.01, np.float32)})


async def settle() -> None:
    """Whatever would happen now without the engine or the client has happened (a lane played to its end)."""
    for _ in range(50):
        await asyncio.sleep(0)


def test_cartesia_a_context_idle_in_its_open_turn_keeps_its_chain_and_style_tag():
    """An LLM that pauses longer than the audio already sent: the context's first sentence has played to its end
    (nothing buffered or queued) while its turn is open (`continue: true`). Its next sentence goes on in the turn's
    continuation chain and style tag, as on our own socket; its idle lane was dropped, and the next sentence started
    a fresh chain, unstyled."""

    async def go() -> FakeEngine:
        gw, ws, task, fmt, voice = cartesia_session(directions=happy_directions())
        turn = {"context_id": "a", "voice": voice, "continue": True, "flush": True, **fmt}
        ws.send(transcript="[happy] One.", **turn)
        FakeEngine.play(await gw.fake.started(1))
        await ws.until("flush_done")
        await settle()  # the context holds no text or audio now
        ws.send(transcript=" Two.", **turn)
        FakeEngine.play(await gw.fake.started(2))
        await ws.until("flush_done")
        await shut(ws, task)
        return gw.fake

    fake = asyncio.run(go())
    assert fake.texts == ["One.", "Two."]
    assert fake.chains[0] is not None and fake.chains[1] is fake.chains[0]
    assert [o.emotion.sliders for o in fake.opts] == [{"happy": 1.0}] * 2


def test_elevenlabs_a_context_idle_in_its_open_turn_keeps_its_chain_and_style_tag_until_it_is_closed():
    """ElevenLabs with auto_mode (each text spoken as it comes): a context whose first sentence has played to its end
    while its turn is open goes on in the turn's chain and style tag; once closed, its lane ends."""
    from app.doors.dialects.elevenlabs import ElevenLabsSession
    from app.voices.library import Voice

    async def go() -> tuple[FakeEngine, bool, bool]:
        directions = happy_directions()
        gw = fake_gateway(directions=directions)
        voice = Voice("v", "v", "", "embedding", directions.dim, embedding=np.full(directions.dim, 0.1, np.float32))
        gw.resolve_voice = lambda ref, owner: voice
        ws = FakeSocket()
        ws.query_params = {"output_format": "pcm_44100", "auto_mode": "true"}  # type: ignore[attr-defined]
        ws.path_params = {"voice_id": "v"}  # type: ignore[attr-defined]
        session = ElevenLabsSession(ws, gw, "")  # type: ignore[arg-type]
        task = asyncio.create_task(session.run())
        ws.send(text="[happy] One.", context_id="a")
        FakeEngine.play(await gw.fake.started(1))
        assert (await ws.next_json())["contextId"] == "a"  # its audio
        await settle()  # the context holds no text or audio now
        kept = "a" in session.lanes
        ws.send(text=" Two.", context_id="a")
        FakeEngine.play(await gw.fake.started(2))
        ws.send(context_id="a", close_context=True)
        while not (await ws.next_json()).get("isFinal"):
            pass
        await settle()
        ended = "a" not in session.lanes
        await shut(ws, task)
        return gw.fake, kept, ended

    fake, kept, ended = asyncio.run(go())
    assert fake.texts == ["One.", "Two."]
    assert fake.chains[0] is not None and fake.chains[1] is fake.chains[0]
    assert [o.emotion.sliders for o in fake.opts] == [{"happy": 1.0}] * 2
    assert kept and ended


def test_contexts_idle_in_an_open_turn_count_towards_the_cap_and_the_oldest_gives_its_place_up():
    """A Cartesia socket of 20 contexts, each played to its end and left open (`continue: true`): the socket keeps at
    most MAX_CONTEXTS of them (what a client's memory costs is bounded), each new context ending the turn of the one
    whose text came longest ago (its next text starts a new chain); new contexts without text take no place. A new
    context is not refused for them."""
    from app.doors.dialects.common import MAX_CONTEXTS

    async def go() -> tuple[list[str], list[str], list[Any]]:
        gw, ws, session, fmt, voice = cartesia_socket()
        task = asyncio.create_task(session.run())
        turn = {"voice": voice, "continue": True, "flush": True, **fmt}
        for i in range(MAX_CONTEXTS + 4):
            ws.send(transcript=f"Context {i}.", context_id=f"k{i}", **turn)
            FakeEngine.play(await gw.fake.started(i + 1))
            await ws.until("flush_done")
        await settle()
        kept = sorted(session.lanes)  # the contexts whose lane is kept (each holds its chain)
        for i in range(4):  # new contexts without text take no place
            ws.send(transcript="", context_id=f"u{i}", **turn)
            await ws.until("flush_done")
        await settle()
        still = sorted(session.lanes)
        ws.send(transcript=" Again.", context_id="k0", **turn)
        FakeEngine.play(await gw.fake.started(MAX_CONTEXTS + 5))
        await ws.until("flush_done")
        await shut(ws, task)
        return kept, still, gw.fake.chains

    kept, still, chains = asyncio.run(go())
    assert kept == still == sorted(f"k{i}" for i in range(4, MAX_CONTEXTS + 4))
    assert chains[-1] is not chains[0]  # k0's turn was ended to make room: its text starts a new chain


class SlowEmbedding:
    """Stands in for Gateway.embed_clip (decode and speaker encoder): a clip's embedding comes when the test lets it,
    as a large clip's comes after seconds."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.asked = asyncio.Event()
        self.ready = asyncio.Event()

    async def __call__(self, raw: bytes, owner: str) -> Any:
        from app.voices.library import Voice

        self.asked.set()
        await self.ready.wait()
        return Voice("clip", "clip", owner, "clip", self.dim, embedding=np.zeros(self.dim, np.float32))


def test_a_cancel_while_a_configs_clip_is_embedded_takes_effect_at_once():
    """A cancel right after a session.config with a large voice_clip is not held back by the clip's embedding (up to
    EMBED_WAIT_S): the audio playing stops and `cancelled` comes at once, the text sent between the config and the
    cancel for the cancelled context is dropped (its flush answered after `cancelled`), and the rest waits for the
    config, in order: another context's text is spoken in the clip's voice, and the session goes on."""
    from app.io.bodies import BodyBudget

    async def go() -> tuple[list[dict[str, Any]], list[dict[str, Any]], FakeEngine, bool]:
        session, ws, engine, task = await open_session()
        embed = SlowEmbedding(session.gw.cfg.speaker_embedding_dim)
        session.gw.embed_clip = embed
        session.gw.bodies = BodyBudget(1 << 30)
        ws.send(type="text", text="Playing.", flush=True)
        stream = await engine.started(1)
        engine.play(stream, finish=False)
        await ws.until("audio.start")
        ws.send(type="session.config", voice_clip="Y2xpcA==")
        ws.send(type="text", text="Cancelled with it.", flush=True)
        ws.send(type="text", text="Other.", context_id="b", flush=True)
        ws.send(type="cancel", context_id=DEFAULT_CONTEXT)
        async with asyncio.timeout(TIMEOUT):
            await embed.asked.wait()
        cancelled = await ws.until("cancelled")
        cancelled += [await ws.next_json(), await ws.next_json()]
        embedding = not embed.ready.is_set()  # the cancel came while the clip was still being embedded
        embed.ready.set()
        rest = await ws.until("session.updated")
        engine.play(await engine.started(2))
        rest += await ws.until("flushed")
        await shut(ws, task)
        return cancelled, rest, engine, embedding

    cancelled, rest, engine, embedding = asyncio.run(go())
    assert embedding and [d["type"] for d in cancelled] == ["cancelled", "flushed", "flushed"], cancelled
    assert [d["context_id"] for d in cancelled] == [DEFAULT_CONTEXT] * 3
    assert engine.cancelled == [engine.streams[0].rid]
    assert rest[0]["voice"] == "clip" and rest[-1] == {"type": "flushed", "context_id": "b"}
    assert [d["type"] for d in rest if d["type"] != "audio.start"] == ["session.updated", "audio.done", "flushed"]
    assert engine.texts == ["Playing.", "Other."] and engine.voices[1].id == "clip"


def test_messages_held_back_behind_a_configs_clip_are_bounded(monkeypatch):
    """While a config's clip is embedded, the messages after it wait for it up to a bound (MAX_HELD_BACK messages);
    one past it is refused (buffer_full) and not taken; those held back are handled in order once the config is."""
    from app.doors import ws as ws_module
    from app.io.bodies import BodyBudget

    monkeypatch.setattr(ws_module, "MAX_HELD_BACK", 2)

    async def go() -> tuple[list[dict[str, Any]], FakeEngine]:
        session, ws, engine, task = await open_session()
        embed = SlowEmbedding(session.gw.cfg.speaker_embedding_dim)
        session.gw.embed_clip = embed
        session.gw.bodies = BodyBudget(1 << 30)
        ws.send(type="session.config", voice_clip="Y2xpcA==")
        for text in ("One. ", "Two. ", "Three. "):
            ws.send(type="text", text=text)
        refused = await ws.until("error")
        embed.ready.set()
        seen = refused + await ws.until("session.updated")
        ws.send(type="flush")
        for n in (1, 2):
            engine.play(await engine.started(n))
        seen += await ws.until("flushed")
        await shut(ws, task)
        return seen, engine

    seen, engine = asyncio.run(go())
    assert seen[0]["type"] == "error" and seen[0]["code"] == "buffer_full", seen
    assert engine.texts == ["One.", "Two."]


def test_a_session_whose_configs_clip_is_being_embedded_is_not_idle():
    """The idle timeout does not close a session while its config's clip is being embedded (the client waits for its
    session.updated): the config is handled beside the receive loop, whose wait for a message times out meanwhile."""
    from app.io.bodies import BodyBudget

    async def go() -> tuple[int | None, dict[str, Any]]:
        session, ws, _engine, task = await open_session(Limits(idle_timeout_s=0.05))
        embed = SlowEmbedding(session.gw.cfg.speaker_embedding_dim)
        session.gw.embed_clip = embed
        session.gw.bodies = BodyBudget(1 << 30)
        ws.send(type="session.config", voice_clip="Y2xpcA==")
        async with asyncio.timeout(TIMEOUT):
            await embed.asked.wait()
        await asyncio.sleep(0.5)  # ten idle timeouts
        code = ws.close_code
        embed.ready.set()
        updated = (await ws.until("session.updated"))[-1]
        await shut(ws, task)
        return code, updated

    code, updated = asyncio.run(go())
    assert code is None and updated["voice"] == "clip"


class SlowAligner:
    """Stands in for the engine's aligner node: it answers (each word of the text, 0.1 s apart) when the test lets it,
    as an aligner busy with other sessions' utterances answers later than their audio ends."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.ready = asyncio.Event()

    async def align(self, pcm: np.ndarray, sample_rate: int, text: str, timeout: float = 60.0) -> tuple:
        self.asked.set()
        await self.ready.wait()
        return tuple((w, 0.1 * i, 0.1 * i + 0.05) for i, w in enumerate(text.split()))


def test_cartesia_an_id_used_again_while_its_aligned_words_are_pending_keeps_them():
    """A Cartesia context ended (`continue: false`) whose audio has all been sent while its aligner answer is pending,
    and its id used again (a new context) meanwhile: the old context's aligned words are still sent, on its clock,
    before its done; the new context's follow. The reused id took the old utterance for the new context's, whose
    timestamps did not wait for it: its words were never sent."""

    async def go() -> list[dict[str, Any]]:
        gw, ws, session, fmt, voice = cartesia_socket()
        aligner = SlowAligner()
        gw.engine.aligns, gw.engine.align = True, aligner.align
        task = asyncio.create_task(session.run())
        ctx = {"context_id": "a", "voice": voice, "add_timestamps": True, **fmt}
        ws.send(transcript="One two.", **ctx)
        FakeEngine.play(await gw.fake.started(1))
        async with asyncio.timeout(TIMEOUT):
            await aligner.asked.wait()  # its audio is out, its aligned words are pending
        ws.send(transcript="Three.", **ctx)  # the id again, before its done
        FakeEngine.play(await gw.fake.started(2))
        await settle()
        aligner.ready.set()
        seen: list[dict[str, Any]] = []
        while sum(d.get("type") == "done" for d in seen) < 2:
            seen.append(await ws.next_json())
        await shut(ws, task)
        return seen

    seen = asyncio.run(go())
    kinds = [(d["type"], d["word_timestamps"]["words"] if d["type"] == "timestamps" else None) for d in seen]
    assert [k for k in kinds if k[0] != "chunk"] == [
        ("timestamps", ["One", "two."]),
        ("done", None),
        ("timestamps", ["Three."]),
        ("done", None),
    ], kinds


def served_stalls(text: str, plan: list[tuple[int, int, bool, float]]) -> tuple[float | None, float | None]:
    """Speak `text` (no player prebuffer) with the fake engine following `plan`: (utterance number, samples, its
    end?, seconds to wait first: counted from when the first audio was handed on); the server's stall counters."""

    async def go():
        gw = fake_gateway()
        gw.settings = replace(gw.settings, engine=replace(gw.settings.engine, admission_prebuffer_ms=0.0))
        first = asyncio.Event()

        async def feed():
            for n, samples, finish, wait_s in plan:
                stream = await gw.fake.started(n)
                if wait_s:
                    await first.wait()  # handed on: the player's clock runs from there
                    await asyncio.sleep(wait_s)
                FakeEngine.play(stream, samples=samples, finish=finish)

        feeder = asyncio.create_task(feed())
        async for _ in speak(gw, "openai", text, SynthesisOptions(), None, None):  # type: ignore[arg-type]
            first.set()
        await feeder
        return gw.metrics.registry

    reg = asyncio.run(go())
    labels = {"api": "openai"}
    return (
        reg.get_sample_value("zonos_listener_stalled_utterances_total", labels),
        reg.get_sample_value("zonos_listener_stall_seconds_total", labels),
    )


def test_audio_that_comes_after_the_player_ran_dry_is_counted_as_the_servers_stall():
    """The gateway counts what a player started --admission-prebuffer-ms after the first byte would hear stall, as
    it hands each piece on (app/core/playout.py): here no prebuffer, 512 samples (11.6 ms), then the next piece
    at least 50 ms later: one stall of at least 38 ms, in zonos_listener_stall* for the API."""
    stalled, seconds = served_stalls("Hi.", [(1, 512, False, 0.0), (1, 512, True, 0.05)])
    assert stalled == 1.0 and seconds is not None and seconds >= 0.038


def test_a_piece_the_server_is_slow_to_send_on_is_counted_as_its_stall():
    """The server's stall counters time a piece when it is out of the server (app/core/pipeline.py `_sent`): its
    consumer encoded it and handed its bytes on. Here the engine's two pieces (512 samples each, no prebuffer) are
    both there at once, and sending the second takes 50 ms (a codec's thread, a busy loop): one stall of at least
    38 ms, which the time the engine's audio reached the gateway would not show."""

    async def go():
        gw = fake_gateway()
        gw.settings = replace(gw.settings, engine=replace(gw.settings.engine, admission_prebuffer_ms=0.0))

        async def feed():
            stream = await gw.fake.started(1)
            FakeEngine.play(stream, samples=512, finish=False)
            FakeEngine.play(stream, samples=512, finish=True)

        feeder = asyncio.create_task(feed())
        pieces = 0
        async for _ in speak(gw, "openai", "Hi.", SynthesisOptions(), None, None):  # type: ignore[arg-type]
            pieces += 1
            if pieces == 2:
                await asyncio.sleep(0.05)  # this piece's encoding and write
        await feeder
        return gw.metrics.registry

    reg = asyncio.run(go())
    labels = {"api": "openai"}
    assert reg.get_sample_value("zonos_listener_stalled_utterances_total", labels) == 1.0
    stalled_s = reg.get_sample_value("zonos_listener_stall_seconds_total", labels)
    assert stalled_s is not None and stalled_s >= 0.038


def test_a_late_next_sentence_is_a_stall_at_the_join():
    """A sentence whose text was complete while the sentence before still played continues that player: its first
    audio is due when the audio before runs out (app/core/playout.py), and one that comes later is counted as the
    server's stall. Here 1 s of audio, no prebuffer, and the next sentence's first audio at least 1.1 s after (the
    second sentence's turn to play must come while the first still plays: a busy CI machine has a second for it)."""
    stalled, seconds = served_stalls("One. Two.", [(1, 44100, True, 0.0), (2, 512, True, 1.1)])
    assert stalled == 1.0 and seconds is not None and seconds >= 0.09


def test_a_session_whose_listener_still_hears_its_audio_is_not_idle():
    """Idle counts from when the listener's player has played what was sent (app/core/playout.py), not from the send:
    a 60 s reply sent in one piece keeps the session busy (idle_s None: no eviction at --max-sessions) long after the
    send, while a 12 ms one leaves it idle once heard."""

    async def go() -> tuple[float | None, float | None]:
        got = []
        for samples in (60 * 44100, 512):
            session, ws, engine, task = await open_session()
            ws.send(type="text", text="Hello there.", flush=True)
            engine.play(await engine.started(1), samples=samples)
            await ws.until("flushed")
            async with asyncio.timeout(TIMEOUT):
                while session.playing():
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # the short one: prebuffer (150 ms) and 12 ms of audio played out
            got.append(session.idle_s(time.monotonic()))
            await shut(ws, task)
        return got[0], got[1]

    long_reply, short_reply = asyncio.run(go())
    assert long_reply is None
    assert short_reply is not None and short_reply >= 0.0


def test_a_reply_cut_by_a_barge_in_is_not_heard_out():
    """A cancel cuts the reply playing: its listener's player stops there, so the session is not held busy for the
    audio it had been sent (60 s here)."""

    async def go() -> float | None:
        session, ws, engine, task = await open_session()
        ws.send(type="text", text="Hello there.", flush=True)
        stream = await engine.started(1)
        engine.play(stream, samples=60 * 44100, finish=False)
        async with asyncio.timeout(TIMEOUT):  # handed on: its listener's player holds 60 s
            while not any(lane.pipe._dry_at for lane in session.lanes.values()):
                await asyncio.sleep(0.01)
        ws.send(type="cancel")
        await ws.until("cancelled")
        async with asyncio.timeout(TIMEOUT):
            while session.playing():
                await asyncio.sleep(0.01)
        idle = session.idle_s(time.monotonic() + 0.01)
        await shut(ws, task)
        return idle

    assert asyncio.run(go()) is not None


async def _played_out(session: Any) -> None:
    async with asyncio.timeout(TIMEOUT):
        while session.playing():
            await asyncio.sleep(0.01)


def test_a_barge_in_after_the_whole_reply_was_sent_stops_the_listeners_player():
    """A GPU sends a reply faster than it plays: the barge-in comes once all of it was sent (nothing queued), and its
    listener's player stops there all the same, so the session is idle again (hostile pass: a newcomer was refused
    with too_many_sessions for the rest of the 60 s)."""

    async def go() -> tuple[float | None, float | None]:
        session, ws, engine, task = await open_session()
        ws.send(type="text", text="Hello there.", flush=True)
        engine.play(await engine.started(1), samples=60 * 44100)
        await ws.until("flushed")
        await _played_out(session)
        before = session.idle_s(time.monotonic())
        ws.send(type="cancel")
        await ws.until("cancelled")
        after = session.idle_s(time.monotonic() + 0.01)
        await shut(ws, task)
        return before, after

    before, after = asyncio.run(go())
    assert before is None and after is not None


def test_an_utterance_with_no_audio_does_not_end_what_the_listener_still_hears():
    """A sentence that brings no audio (a break that rounds to no sample, or an engine request that ends at once) after
    a 60 s one: the listener still hears the 60 s, the session stays busy."""

    async def go() -> float | None:
        session, ws, engine, task = await open_session()
        ws.send(type="text", text="Hello there. Bye.", flush=True)
        engine.play(await engine.started(1), samples=60 * 44100)
        engine.play(await engine.started(2), samples=0)
        await ws.until("flushed")
        await _played_out(session)
        idle = session.idle_s(time.monotonic())
        await shut(ws, task)
        return idle

    assert asyncio.run(go()) is None


def test_each_context_lane_keeps_its_listener_busy_on_its_own():
    """With a lane per context (Cartesia), a short context finishing after a long one does not end the long one's
    listening: the session is busy until the longest has been heard (hostile pass: it was evicted 4.5 s later)."""

    async def go() -> float | None:
        gw, ws, session, fmt, voice = cartesia_socket()
        task = asyncio.create_task(session.run())
        ws.send(transcript="A long one.", context_id="c1", voice=voice, **fmt)
        FakeEngine.play(await gw.fake.started(1), samples=60 * 44100)
        await ws.until("done")
        ws.send(transcript="Hello.", context_id="c2", voice=voice, **fmt)
        FakeEngine.play(await gw.fake.started(2), samples=512)
        await ws.until("done")
        await _played_out(session)
        await asyncio.sleep(0.3)  # c2's 12 ms (and its prebuffer) heard
        idle = session.idle_s(time.monotonic())
        await shut(ws, task)
        return idle

    assert asyncio.run(go()) is None


def test_a_new_turn_starts_a_new_player():
    """The player carries on across the sentences of one turn (a late next sentence is a stall at the join), but a
    sentence after the turn was ended (a flush, a barge-in) starts a new player: however close its text came to the
    end of the audio before, its first audio is first-audio latency, not a stall (hostile pass)."""

    async def go(end_turn: bool) -> float | None:
        gw = fake_gateway()
        gw.settings = replace(gw.settings, engine=replace(gw.settings.engine, admission_prebuffer_ms=0.0))
        pipe = UtterancePipeline(gw, "test")  # type: ignore[arg-type]
        (one,) = pipe.add(["One."], SynthesisOptions(), None, None)
        FakeEngine.play(await gw.fake.started(1), samples=44100)  # 1 s
        async for _ in pipe.play(one):
            pass
        pipe.done(one)
        if end_turn:
            pipe.end()
        (two,) = pipe.add(["Two."], SynthesisOptions(), None, None)  # while One still plays
        stream = await gw.fake.started(2)

        async def consume() -> None:  # Two's turn to play comes at once: its audio comes 1.1 s later
            async for _ in pipe.play(two):
                pass

        playing = asyncio.create_task(consume())
        await asyncio.sleep(1.1)
        FakeEngine.play(stream, samples=512)
        await playing
        pipe.close()
        return gw.metrics.registry.get_sample_value("zonos_listener_stalled_utterances_total", {"api": "test"})

    assert asyncio.run(go(end_turn=False)) == 1.0  # the same turn: a stall at the join
    assert asyncio.run(go(end_turn=True)) is None  # a new turn: nothing counted


def _requests(gw: Any, api: str, outcome: str) -> float | None:
    return gw.metrics.registry.get_sample_value("zonos_requests_total", {"api": api, "outcome": outcome})


def test_a_barge_in_counts_the_utterance_playing_as_cancelled_and_not_those_still_queued():
    """`zonos_requests_total{outcome="cancelled"}`: the utterance that had begun to play when the cancel came; the
    sentences queued behind it never played, so they are not requests of any outcome."""

    async def go() -> Any:
        session, ws, engine, task = await open_session()
        ws.send(type="text", text="One. Two. Three.", flush=True)
        stream = await engine.started(1)
        engine.play(stream, samples=44100, finish=False)
        async with asyncio.timeout(TIMEOUT):  # the first utterance is playing
            while not any(lane.pipe._dry_at for lane in session.lanes.values()):
                await asyncio.sleep(0.01)
        ws.send(type="cancel")
        await ws.until("cancelled")
        await shut(ws, task)
        return session.gw

    gw = asyncio.run(go())
    assert _requests(gw, "ws", "cancelled") == 1.0
    assert _requests(gw, "ws", "ok") is None and _requests(gw, "ws", "error") is None


def test_an_http_client_gone_mid_audio_counts_its_utterance_cancelled_and_one_played_out_ok():
    async def gone() -> Any:
        gw = fake_gateway()
        pcm = speak(gw, "openai", "One. Two.", SynthesisOptions(), None, None)  # type: ignore[arg-type]
        first = asyncio.ensure_future(anext(pcm))
        FakeEngine.play(await gw.fake.started(1), finish=False)
        await first
        await pcm.aclose()  # the client hung up
        return gw

    async def played() -> Any:
        gw = fake_gateway()
        pcm = speak(gw, "openai", "One.", SynthesisOptions(), None, None)  # type: ignore[arg-type]
        first = asyncio.ensure_future(anext(pcm))
        FakeEngine.play(await gw.fake.started(1))
        await first
        async for _ in pcm:
            pass
        return gw

    cut, whole = asyncio.run(gone()), asyncio.run(played())
    assert _requests(cut, "openai", "cancelled") == 1.0 and _requests(cut, "openai", "ok") is None
    assert _requests(whole, "openai", "ok") == 1.0 and _requests(whole, "openai", "cancelled") is None


def _errors(gw: Any, code: str) -> float | None:
    return gw.metrics.registry.get_sample_value("zonos_errors_total", {"code": code})


def test_an_http_utterances_error_is_counted_once_and_the_cap_counts_as_an_error_outcome():
    """An HTTP request's answer carries its utterance's error, which the pipeline counted: the door that answers it
    (`Metrics.count_error`, as app/server.py request_error, speech.cut_off and a dialect's errors_as do) counted it
    again (zonos_errors_total{internal} 2 for one failure). And an utterance cut at --max-request-audio-s counted
    under no zonos_requests_total outcome."""

    async def failed() -> Any:
        gw = fake_gateway()
        pcm = speak(gw, "openai", "One.", SynthesisOptions(), None, None)  # type: ignore[arg-type]
        first = asyncio.ensure_future(anext(pcm))
        stream = await gw.fake.started(1)
        stream._deliver(m.Error(stream.rid, EngineError.INTERNAL, "the engine failed"))
        with pytest.raises(RequestError) as got:
            await first
        gw.metrics.count_error(got.value)  # the door answering the request
        return gw

    async def capped() -> Any:
        gw = fake_gateway(Limits(max_request_audio_s=0.01))  # 441 samples
        pcm = speak(gw, "openai", "One.", SynthesisOptions(), None, None)  # type: ignore[arg-type]
        first = asyncio.ensure_future(anext(pcm))
        FakeEngine.play(await gw.fake.started(1), samples=1000, finish=False)
        assert len(await first) == 441
        with pytest.raises(RequestError) as got:
            await anext(pcm)
        assert got.value.code == "audio_too_long"
        gw.metrics.count_error(got.value)  # the door cutting the answer off (speech.cut_off)
        return gw

    gw = asyncio.run(failed())
    assert _errors(gw, "internal") == 1.0 and _requests(gw, "openai", "error") == 1.0
    gw = asyncio.run(capped())
    assert _errors(gw, "audio_too_long") == 1.0 and _requests(gw, "openai", "error") == 1.0


async def deepgram_session(limits: Limits | None = None) -> tuple[Any, FakeSocket, asyncio.Task]:
    """A Deepgram session (`/v1/speak`, linear16 at 24 kHz) on the fake engine, running, its Metadata read."""
    from app.doors.dialects.deepgram import DeepgramSession

    gw = fake_gateway(limits)
    ws = FakeSocket()
    ws.query_params = {}  # type: ignore[attr-defined]
    task = asyncio.create_task(DeepgramSession(ws, gw, "").run())  # type: ignore[arg-type]
    assert (await ws.next_json())["type"] == "Metadata"
    return gw, ws, task


async def deepgram_until(ws: FakeSocket, kind: str, engine: FakeEngine, first: int = 1) -> list[dict[str, Any]]:
    """The session's JSON messages up to its first of `kind`, every utterance it starts from the `first`-th on played
    meanwhile."""

    async def play_all() -> None:
        for n in itertools.count(first):
            FakeEngine.play(await engine.started(n))

    player = asyncio.create_task(play_all())
    try:
        seen = []
        while not seen or seen[-1]["type"] != kind:
            seen.append(await ws.next_json())
        return seen
    finally:
        player.cancel()


def test_deepgram_a_flush_refused_for_too_many_utterances_still_answers_flushed():
    """A Flush refused past --max-pending-utterances (too_many_utterances) got a Warning and no Flushed: LiveKit's
    plugin waits for the Flushed of each segment's Flush (and only logs a Warning), pipecat ends its turn's audio
    there; both hung. Now the Warning, then its Flushed (its own sequence id) after the audio queued before it; its
    text is dropped (kept, the next Flush spoke it in the next segment's place), and the next Flush's id follows."""

    async def go() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
        gw, ws, task = await deepgram_session(Limits(max_pending_utterances=2))
        ws.send(type="Speak", text="One. Two. Three")  # `One.` queued; `Two. Three` waits for a word after it
        ws.send(type="Flush")  # two more: past the limit while `One.` plays
        seen = [await ws.next_json()]
        seen += await deepgram_until(ws, "Flushed", gw.fake)
        ws.send(type="Speak", text="Again.")
        ws.send(type="Flush")
        again = await deepgram_until(ws, "Flushed", gw.fake, first=2)
        await shut(ws, task)
        return seen, again, gw.fake.texts

    seen, again, texts = asyncio.run(go())
    # (a Warning each: the Flush's, and the hold timer's had the machine stalled past its 0.3 s before the Flush)
    assert {m.get("warn_code") for m in seen[:-1]} == {"too_many_utterances"}, seen
    assert seen[-1] == {"type": "Flushed", "sequence_id": 0} and again == [{"type": "Flushed", "sequence_id": 1}]
    assert texts == ["One.", "Again."], texts


def test_deepgram_a_tag_cut_at_the_flush_is_refused_and_the_rest_spoken_then_flushed():
    """LiveKit's plugin sends a word a Speak, each with a space after it: an LLM that stopped mid-tag (`<brea`) leaves
    `Wait <brea ` for the Flush. The words before it are spoken (they were, and `<brea` with them, as text), the cut
    tag refused with a Warning, then the Flushed."""

    async def go() -> tuple[list[dict[str, Any]], list[str]]:
        gw, ws, task = await deepgram_session()
        for word in ("Hello", "there.", "Wait", "<brea"):
            ws.send(type="Speak", text=word + " ")
        ws.send(type="Flush")
        seen = await deepgram_until(ws, "Flushed", gw.fake)
        await shut(ws, task)
        return seen, gw.fake.texts

    seen, texts = asyncio.run(go())
    assert [(m["type"], m.get("warn_code")) for m in seen] == [("Warning", "bad_text"), ("Flushed", None)], seen
    assert seen[-1]["sequence_id"] == 0 and texts == ["Hello there.", "Wait"], texts


def test_deepgram_sequence_ids_never_repeat_nor_go_back():
    """Deepgram documents `sequence_id` as the id of the response (Flushed and Cleared alike; its examples give the
    first one 0). A Clear with no Flush to drop (before any Flush, or after every one was answered) takes an id of its
    own: its Cleared carried the last Flush's id, `max(0, flushes - 1)`, so a Clear before any Flush answered Cleared 0
    and the next Flush Flushed 0 too, and one after Flushed 0 answered Cleared 0 again: a client counting the answers
    read the cleared id as its new reply's. Each answer's id is above every one before it."""

    async def go() -> list[dict[str, Any]]:
        gw, ws, task = await deepgram_session()
        ws.send(type="Clear")  # nothing to drop: before any Flush
        seen = [await ws.next_json()]
        ws.send(type="Speak", text="Hello there.")
        ws.send(type="Flush")
        seen += await deepgram_until(ws, "Flushed", gw.fake)
        ws.send(type="Clear")  # every Flush answered: nothing to drop
        seen.append(await ws.next_json())
        ws.send(type="Flush")  # nothing buffered: answered at once
        seen.append(await ws.next_json())
        await shut(ws, task)
        return seen

    seen = asyncio.run(go())
    assert [(m["type"], m["sequence_id"]) for m in seen] == [
        ("Cleared", 0),
        ("Flushed", 1),
        ("Cleared", 2),
        ("Flushed", 3),
    ], seen


def test_deepgram_a_clear_that_waits_for_the_send_lock_takes_its_id_after_the_answers_before_it():
    """A Clear that comes while the pump holds the send lock to answer the Flush whose audio it has just sent: that
    Flushed goes out first, then the Cleared. The Cleared's id and the count of answers were set when the Clear
    arrived, before it had the lock: the Flushed going out meanwhile took id 1 (no Flush had it) and the Cleared after
    it went back to 0. Ids are now taken under the send lock, in the order the answers go out."""
    from app.doors.dialects.deepgram import DeepgramSession

    async def go() -> list[dict[str, Any]]:
        gw = fake_gateway()
        ws = FakeSocket()
        ws.query_params = {}  # type: ignore[attr-defined]
        session = DeepgramSession(ws, gw, "")  # type: ignore[arg-type]
        playback = session.playback
        armed = False

        async def answer_marks(lane: Any, stage: Any) -> None:
            nonlocal armed
            async with stage.send_lock:
                if armed:  # the Clear arrives now: its handler waits for the lock behind this
                    armed = False
                    ws.send(type="Clear")
                    for _ in range(50):
                        await asyncio.sleep(0)
                await playback.answer_marks_locked(lane, stage)

        playback._answer_marks = answer_marks  # type: ignore[method-assign]
        task = asyncio.create_task(session.run())
        assert (await ws.next_json())["type"] == "Metadata"
        ws.send(type="Speak", text="Hello there.")
        ws.send(type="Flush")
        stream = await gw.fake.started(1)
        armed = True
        FakeEngine.play(stream)
        seen = await ws.until("Cleared")
        ws.send(type="Flush")
        seen.append(await ws.next_json())
        await shut(ws, task)
        return seen

    seen = asyncio.run(go())
    assert [(m["type"], m["sequence_id"]) for m in seen] == [("Flushed", 0), ("Cleared", 1), ("Flushed", 2)], seen
