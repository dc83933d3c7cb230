"""SSML's `<mark name="..."/>` (app/core/style_tags.py `Mark`): never spoken, a point of its text that our socket
reports as a `mark` message once the audio before it has been sent, on the word clock (app/core/timestamps.py
`MarkTime`); the dialects and HTTP take it out unreported, as before (docs/protocol.md "Marks")."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from app.core.options import SynthesisOptions
from app.core.pipeline import UtterancePipeline, speak
from app.core.style_tags import MarkedText, StyleTag, split_tags
from app.core.tag_vocabulary import MARK_NAME_MAX
from app.core.text_buffer import TextBuffer
from app.core.timestamps import AudioTimeline, WordClock
from app.doors.dialects.cartesia import CartesiaSession
from app.doors.dialects.deepgram import DeepgramSession
from app.doors.dialects.elevenlabs import ElevenLabsSession
from app.doors.ws import Session
from app.io.errors import RequestError
from engine.contract.constants import SAMPLE_RATE
from tests.unit.test_pipeline import TIMEOUT, FakeEngine, fake_gateway, open_session, shut
from tests.unit.test_timestamps import speech

DIALECTS = (ElevenLabsSession, CartesiaSession, DeepgramSession)
BINARY = "<audio>"  # a binary frame, in a socket's messages as `received` lists them


@pytest.mark.parametrize(
    ("text", "pieces"),
    [
        ("Go <mark name=\"here\"/>on<mark name='x'></mark>.", [MarkedText("Go on.", ((3, "here"), (5, "x")))]),
        # at the start, two in a row, at the end: the words that end by a mark's index are before it
        (
            '<mark name="start"/>Hello there<mark name="a"/><mark name="b"/> you.<mark name="end"/>',
            [MarkedText("Hello there you.", ((0, "start"), (11, "a"), (11, "b"), (16, "end")))],
        ),
        # where it stood between two words a space keeps them apart, none before a closing mark (as for <p>)
        ("Hello<mark name=m/>world", [MarkedText("Hello world", ((5, "m"),))]),
        ("Hello <mark name=m/>, world", [MarkedText("Hello , world", ((6, "m"),))]),
        ("Hello<mark name=m/>, world", [MarkedText("Hello, world", ((5, "m"),))]),
        ("<spell>AB<mark name=m/>CD</spell>", [MarkedText("A B C D", ((3, "m"),))]),
        ('<mark name="AT&amp;T"/>x', [MarkedText("x", ((0, "AT&T"),))]),  # its references read
        ('<mark name="alone"/>', [MarkedText("", ((0, "alone"),))]),  # marks alone: an empty text of its own
        (
            "[happy]<mark name=a/>Hi<mark name=b/>[sad]<mark name=c/>",
            [
                StyleTag("happy", "[happy]"),
                MarkedText("Hi", ((0, "a"), (2, "b"))),
                StyleTag("sad", "[sad]"),
                MarkedText("", ((0, "c"),)),
            ],
        ),
        ("a <marker> b", ["a <marker> b"]),  # (no mark: its name is whole)
    ],
)
def test_a_mark_is_a_point_of_its_text_never_spoken(text, pieces):
    assert split_tags(text) == pieces


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("Go <mark/> on.", "needs a name"),
        ('Go <mark id="x"/> on.', "needs a name"),
        ('Go <mark name=""/> on.', "not empty"),
        ('Go <mark name="   "/> on.', "not empty"),
        (f'Go <mark name="{"x" * (MARK_NAME_MAX + 1)}"/> on.', f"at most {MARK_NAME_MAX}"),
        ('Go <mark name="&lt;b&gt;"/> on.', "no markup"),
        ('Go <mark name="[happy]"/> on.', "no markup"),
        ('Go <mark name="a\tb"/> on.', "printable"),
        ('Go <mark name="a" loud/> on.', 'name="value" pairs'),
        ('Go <mark name="a" on.', "must end with '>'"),
        ('Go <mark name="a" name="b"/> on.', "each attribute once"),  # (XML forbids it: `a` was reported)
        ('Go <mark name="a" NAME="a"/> on.', "each attribute once"),
    ],
)
def test_a_bad_mark_is_refused_with_bad_text_never_read_aloud(text, why):
    with pytest.raises(RequestError) as e:
        split_tags(text)
    assert e.value.code == "bad_text" and why in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "messages", [['Go <mark name="<![CDATA[x]]>"/> on.'], ['Go <mark name="<![CDATA[', 'x]]>"/> on.']]
)
def test_a_cdata_section_in_a_mark_name_is_no_name(messages):
    """XML has no markup in an attribute's value: `name="<![CDATA[x]]>"` was reported as `x`, its section read as its
    content; now the section is its characters, refused (whole, or split across messages)."""
    buffer = TextBuffer(500)
    sentences = [s for m in [*messages, " Next. "] for s in buffer.append(m)]
    assert len(sentences) == 1, sentences  # (the tag is held whole, to its section's end)
    with pytest.raises(RequestError) as e:
        split_tags(sentences[0])
    assert e.value.code == "bad_text", str(e.value)


def test_a_mark_name_of_the_longest_length_is_taken():
    name = "x" * MARK_NAME_MAX
    assert split_tags(f'Go <mark name="{name}"/> on.') == [MarkedText("Go on.", ((3, name),))]


def test_marks_at_a_sentence_start_belong_to_the_sentence_before():
    """The segmenter ends `One.` before the marks after it: they go with it (reported after its last word), and marks
    alone at the end are no sentence of their own (an utterance of no audio)."""
    buf = TextBuffer(500)
    assert buf.append('One.<mark name="a"/> <mark name="b"/> Two. Three') == ['One.<mark name="a"/> <mark name="b"/>']
    assert buf.flush() == ["Two.", "Three"]
    assert TextBuffer(500).flush() == [] and TextBuffer(500).append('Hi.<mark name="e"/>') == []
    buf = TextBuffer(500)
    buf.append('Hi.<mark name="e"/>')
    assert buf.flush() == ['Hi.<mark name="e"/>']
    # a period before a mark still waits for the word after it (the segmenter decides by it: `Dr. Smith`)
    buf = TextBuffer(500)
    assert buf.append('Dr.<mark name="e"/> Sm') == []
    assert buf.append("ith came. ") == [] and buf.flush() == ['Dr.<mark name="e"/> Smith came.']


def test_a_mark_is_reached_at_the_end_of_the_word_before_it():
    """Reached when that word is placed, never before the audio reaches it; one before the first word at once."""
    text = "Hello there you."
    clock = WordClock(text, ((0, "start"), (11, "a"), (11, "b"), (16, "end")))
    assert [(k.name, k.time_s) for k in clock.take_marks()] == [("start", 0.0)]
    audio = speech(1.5, lead_s=0.1, tail_s=0.2)
    words, marks, fed = [], [], 0
    for i in range(0, len(audio), 2048):
        words += clock.feed(audio[i : i + 2048])
        fed += len(audio[i : i + 2048])
        got = clock.take_marks()
        assert all(k.time_s <= fed / SAMPLE_RATE + 1e-9 for k in got)
        marks += got
    words += clock.finish()
    marks += clock.take_marks()
    ends = {w.word: w.end_s for w in words}
    assert [(k.name, k.time_s) for k in marks] == [("a", ends["there"]), ("b", ends["there"]), ("end", ends["you."])]


class Lead:
    """A decoder that plays `lead_s` before the stream's first sample (app/core/timestamps.py `Heard`)."""

    def __init__(self, lead_s: float, heard_s: float) -> None:
        self.lead_s, self.heard_s = lead_s, heard_s

    def follow(self) -> None:
        pass


def test_marks_ride_the_words_clock_without_word_times():
    """A timeline that reports no words still reaches its marks (the estimate runs for them), on the same clock as
    the words' (the codec's delay moves both, in one place); the stream's end bounds them."""
    audio = speech(1.0)
    timed = AudioTimeline(words=True, heard=Lead(0.025, 1.025))
    untimed = AudioTimeline(words=False, heard=Lead(0.025, 1.025))
    chunks: dict[bool, list] = {True: [], False: []}
    for timeline in (timed, untimed):
        timeline.begin("Hello there.", ((5, "m"), (12, "end")))
        timeline.feed(audio)
        timeline.end()
        chunks[timeline.words] = [timeline.take(final=True)]
    words = chunks[True][0].words
    assert [(k.name, k.time_s) for k in chunks[True][0].marks] == [("m", words[0].end_s), ("end", words[1].end_s)]
    assert chunks[False][0].words == [] and chunks[False][0].marks == chunks[True][0].marks
    assert words[0].start_s >= 0.025  # (the delay moved them)
    empty = AudioTimeline(words=False, heard=Lead(0.025, 0.0))
    empty.begin("", ((0, "alone"),))
    empty.end()
    assert [(k.name, k.time_s) for k in empty.take(final=True).marks] == [("alone", 0.0)]  # no audio: at its end


async def received(ws, until: str) -> list[Any]:
    """The socket's messages up to and including the first of type `until`, a binary frame as BINARY."""
    seen: list[Any] = []
    async with asyncio.timeout(TIMEOUT):
        while True:
            msg = await ws.out.get()
            seen.append(BINARY if isinstance(msg, bytes) else msg)
            if isinstance(msg, dict) and msg["type"] == until:
                return seen


async def played(ws, engine, until: str = "flushed") -> list[Any]:
    """`received`, each utterance started played: some audio, then the rest and its end."""

    async def play_all() -> None:
        for n in range(1, 20):
            stream = await engine.started(n)
            FakeEngine.play(stream, 4096, finish=False)
            FakeEngine.play(stream, 30000)

    player = asyncio.create_task(play_all())
    try:
        return await received(ws, until)
    finally:
        player.cancel()


def spoken(messages: list[dict], timestamps: bool | str = False) -> tuple[list[Any], list[str]]:
    """On a socket (word times as `timestamps` asks): send `messages` (a `text` message's fields each), then a flush
    -> what the socket sent up to `flushed`, and the texts the engine was given."""

    async def go():
        _, ws, engine, task = await open_session()
        ws.send(type="session.config", timestamps=timestamps)
        await ws.until("session.updated")
        for m in messages:
            ws.send(type="text", **m)
        ws.send(type="flush")
        seen = await played(ws, engine)
        await shut(ws, task)
        return seen, engine.texts

    return asyncio.run(go())


def marks_of(seen: list[Any]) -> list[tuple[str, str]]:
    return [(m["utterance_id"], m["name"]) for m in seen if m != BINARY and m["type"] == "mark"]


def check_order(seen: list[Any]) -> None:
    """Each mark comes after some audio of its utterance (or, one of no audio, after its start) and before its
    `audio.done`, and every one before the `flushed`."""
    playing, text, audio_sent = None, "", False
    for m in seen:
        if m == BINARY:
            audio_sent = True
        elif m["type"] == "audio.start":
            playing, text, audio_sent = m["utterance_id"], m["text"], False
        elif m["type"] == "audio.done":
            playing = None
        elif m["type"] == "mark":
            assert m["utterance_id"] == playing and (audio_sent or not text), seen
    assert seen[-1]["type"] == "flushed"


@pytest.mark.parametrize("timestamps", [False, "estimated"])
def test_marks_come_in_order_with_the_audio_before_its_done_and_the_flush(timestamps):
    """With word times or without (as Azure's bookmarks): at the start, two in a row, in the middle, at the end, and
    between sentences; each once its audio was sent, at the end of the word before it."""
    text = '<mark name="start"/>Hello there<mark name="a"/><mark name="b"/> you.<mark name="end"/> '
    text += '<mark name="between"/> How are you?<mark name="last"/>'
    seen, texts = spoken([{"text": text}], timestamps)
    assert texts == ["Hello there you.", "How are you?"]  # never read aloud
    assert marks_of(seen) == [("u_1", n) for n in ("start", "a", "b", "end", "between")] + [("u_2", "last")]
    check_order(seen)
    marks = {m["name"]: m for m in seen if m != BINARY and m["type"] == "mark"}
    assert marks["start"]["time_ms"] == 0.0 and marks["a"]["time_ms"] == marks["b"]["time_ms"] > 0
    assert marks["end"]["time_ms"] == marks["between"]["time_ms"] > marks["a"]["time_ms"]
    assert all(m["context_id"] == "default" for m in marks.values())
    words = [w for m in seen if m != BINARY and m["type"] == "audio.words" for w in m["words"]]
    if timestamps:  # on the words' clock: the end of the word before each
        ends = {w["word"]: w["end_ms"] for w in words}
        assert marks["a"]["time_ms"] == ends["there"] and marks["end"]["time_ms"] == ends["you."]
        assert marks["last"]["time_ms"] == ends["you?"]
    else:
        assert words == []


def test_a_mark_split_across_messages_is_one_mark():
    halves = ["Hello <ma", 'rk name="a"/>there. Next <mark na', 'me="b"/>one.']
    seen, texts = spoken([{"text": t} for t in halves])
    assert texts == ["Hello there.", "Next one."]
    assert marks_of(seen) == [("u_1", "a"), ("u_2", "b")]
    check_order(seen)


def test_a_mark_between_two_breaks_is_an_utterance_of_no_audio_where_it_stands():
    seen, texts = spoken([{"text": 'A.<break time="100ms"/><mark name="m"/><break time="100ms"/>B.'}])
    assert texts == ["A.", "B."]
    starts = [(m["utterance_id"], m["text"]) for m in seen if m != BINARY and m["type"] == "audio.start"]
    assert starts == [("u_1", "A."), ("u_2", ""), ("u_3", ""), ("u_4", ""), ("u_5", "B.")]
    assert marks_of(seen) == [("u_3", "m")]
    check_order(seen)


def test_a_bad_mark_on_the_socket_is_bad_text_and_nothing_of_it_is_spoken():
    async def go():
        _, ws, engine, task = await open_session()
        ws.send(type="text", text='Fine. Go <mark name=""/> on.', flush=True)
        err = await ws.next_json()
        ws.send(type="text", text="Then this.", flush=True)
        seen = await played(ws, engine)
        await shut(ws, task)
        return err, seen, engine.texts

    err, seen, texts = asyncio.run(go())
    assert err["type"] == "error" and err["code"] == "bad_text" and "mark" in err["message"], err
    assert texts == ["Then this."] and marks_of(seen) == []


def test_a_barge_in_reports_no_mark_whose_audio_was_not_sent():
    """A cancel while the first words play: the mark at its start was reached (its first audio was sent), the one
    after its words and the one of the utterance queued behind it never are, then or later."""

    async def go():
        _, ws, engine, task = await open_session()
        text = '<mark name="early"/>One two three four five six seven eight<mark name="late"/> nine. '
        ws.send(type="text", text=text + 'Queued<mark name="queued"/> here.', flush=True)
        FakeEngine.play(await engine.started(1), 512, finish=False)  # 12 ms of audio: no word of it yet
        before = await received(ws, "mark")
        assert BINARY in before
        ws.send(type="cancel")
        after = await received(ws, "flushed")
        ws.send(type="text", text="Bye.", flush=True)
        after += await played(ws, engine)
        await shut(ws, task)
        return before, after

    before, after = asyncio.run(go())
    assert marks_of(before) == [("u_1", "early")]
    assert [m["type"] for m in after if m != BINARY][:2] == ["cancelled", "flushed"]
    assert marks_of(after) == []


def test_the_dialects_and_http_take_marks_out_unreported_as_before():
    """A pipeline that reports no marks (the dialects' sessions, the HTTP routes) speaks the text without them and
    queues nothing for marks alone."""

    async def go():
        gw = fake_gateway()
        pipe = UtterancePipeline(gw, "elevenlabs")
        added = pipe.add(['Hi <mark name="a"/> there.', '<mark name="b"/>'], SynthesisOptions(), None, None)
        pipe.close()
        chunks = [x async for x in _spoken_over_http(gw, 'Go <mark name="m"/>on.<break time="10ms"/><mark name="x"/>')]
        return added, gw.fake.texts, chunks

    added, texts, chunks = asyncio.run(go())
    assert [(u.text, u.marks) for u in added] == [("Hi there.", ())]
    assert texts[-1] == "Go on." and chunks
    assert Session.reports_marks and not any(d.reports_marks for d in DIALECTS)  # (whose lanes' pipelines these are)


async def _spoken_over_http(gw, text: str):
    async def play() -> None:
        FakeEngine.play(await gw.fake.started(len(gw.fake.streams) + 1))

    player = asyncio.create_task(play())
    try:
        async for x in speak(gw, "openai", text, SynthesisOptions(), None, None):
            yield np.asarray(x)
    finally:
        player.cancel()
