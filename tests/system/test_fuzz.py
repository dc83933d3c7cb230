"""Fuzzing of the WebSocket protocol and of the HTTP request parsing (hypothesis) against a real server.

Every reply must be a well-formed success or a well-formed error with a specific code: never a 5xx,
never `internal`, never a hang (every exchange has a timeout), never a traceback in the server log,
and the server must still serve a normal request afterwards.

Deterministic by default (CI); ZONOS_FUZZ_RANDOM=1 explores new examples, ZONOS_FUZZ_EXAMPLES=N sets
how many per test.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import re
import socket
import time
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import numpy as np
import pytest
import soundfile as sf
import websockets
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from app.core.options import PARAM_KEYS
from app.core.tag_vocabulary import MARK_NAME_MAX
from app.doors.openai_speech import SPEECH_FIELDS as _SPEECH_FIELDS
from app.doors.reference import GENERATE_FIELDS as _GENERATE_FIELDS
from app.doors.voices import BLEND_FIELDS, RENAME_FIELDS, UPLOAD_PARTS
from engine.contract.records import FIRST_SAMPLES_MAX
from tests.conftest import ONE_SLOT

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("ZONOS_FUZZ_EXAMPLES", "50"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("ZONOS_FUZZ_RANDOM"),
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# The newer surfaces (dialect sockets and URLs, voice names): fewer examples each, so the file stays within
# about a minute on two busy cores; ZONOS_FUZZ_EXAMPLES scales them too.
FUZZ_SMALL = settings(FUZZ, max_examples=max(4, EXAMPLES // 3))
CODE = re.compile(r"^[a-z][a-z_]*$")
SERVER_TYPES = {
    "session.created",
    "session.updated",
    "audio.start",
    "audio.done",
    "flushed",
    "cancelled",
    "mark",
    "session.closed",
    "error",
    "audio.words",  # session.config `timestamps`: estimated, and with the fuzz server's aligner, aligned
}


@pytest.fixture(scope="module")
def aligner_checkpoint(tmp_path_factory) -> str:
    """A small synthetic checkpoint of MMS_FA's format (engine/aligner/model.py)."""
    from engine.aligner.model import AlignerConfig, random_checkpoint

    return str(random_checkpoint(tmp_path_factory.mktemp("aligner") / "model.pt", AlignerConfig.tiny()))


@pytest.fixture(scope="module")
def fuzz_server(start_server, aligner_checkpoint):
    # every utterance is short (30 frames), so a fuzzed request that is valid costs little; with an aligner,
    # a fuzzed `timestamps: true` sends every utterance (any text, any audio) through it
    return start_server(
        "--max-frames",
        "30",
        "--max-pending-utterances",
        "8",
        "--max-http-chars",
        "300",
        "--aligner",
        aligner_checkpoint,
    )


def small_wav() -> bytes:
    buf = io.BytesIO()
    sf.write(buf, (0.1 * np.sin(np.arange(16000) / 5)).astype(np.float32), 16000, format="WAV")
    return buf.getvalue()


def npy(values: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, values)
    return buf.getvalue()


# ---- strategies ----------------------------------------------------------------------------------------
leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30)
)
anything = st.recursive(
    leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4), max_leaves=8
)
# Issue 17: lone surrogates (valid JSON escapes, invalid text), multi-byte text that is long in UTF-8 bytes
# (one prompt frame per byte) though short in characters, and the ordinary cases.
surrogates = st.text(
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF) | st.characters(), min_size=1, max_size=12
)
short_text = (
    st.text(max_size=60)
    | surrogates
    | st.sampled_from(
        [
            "Hello there.",
            "One. Two. Three.",
            "¿Qué tal?",
            "数字 123。",
            "",
            "   ",
            "\n\n",
            "a" * 250,
            "\ud800 hello.",
            "Fine. \udfff",
            "😀" * 600,
            "Привет" * 250,
            "数" * 700 + "。",
            "é" * 400 + ". Done.",
            'Go <break time="300ms"/> on.',
            '<break time="bad"/>',
            '<break time="99s"/>.',
            "<break/>",
            '<break strength="x-strong"/> a <break strength="none"/> b <break strength="loud"/>',
            "<break strength=none/>",
            '<speak>Go <mark name="m1"/>on <voice name="x">hi</voice> <lang xml:lang="fr">oui</lang></speak>',
            '<break strength="" time=""/>',
            "<break time=1s>x",
            "[happy] Hi.",
            '<emotion value="happy"/> Hi.',
            # style tags (app/core/style_tags.py): mapped, refused (unsupported_tag, bad_text), or text
            "Hi [sad] there [NEUTRAL] you.",
            "[whispering] psst.",
            "<emotion/> x.",
            "<emotion value='calm'>Yes.</emotion> No.",
            "[happy]",
            "[1] [citation needed] [smug].",
            "[happy] a " * 17,
            '<emotion value="[happy]"/> x <break time="200ms"/> [sad] y.',
            # a tag a sentence cut leaves without its '>' (a newline inside it, too long for the budget): bad_text
            'Hi <emotion\nvalue="happy"/> there.',
            'Hi <break\ntime="1s"/> there.',
            'Hi <emotion value="' + "a" * 2100 + '"/> there.',
            # Cartesia's other elements: spelled text, or refused (unsupported_tag), cut (bad_text)
            "Code <spell>AB-12</spell>. Bye <spell>Q",
            "R2</spell> <SPELL/> x.",
            '<speed ratio="1.5"/>Fast. <volume ratio=0.5 /> quiet </speed>.',
            "Hi <spell\n>x</spell>.",
            'Say <phoneme alphabet="ipa" ph="x">tomato</phoneme>.',
            # SSML: structure taken out (speak, p, s), controls refused (prosody, emphasis, audio), cut ones
            '<speak version="1.1"><p><s>Hi.</s></p><p>There</p></speak>',
            '<speak>Say <prosody rate="slow">this</prosody> <emphasis>now</emphasis>.</speak>',
            '<say-as interpret-as="characters">AB</say-as> <audio src="x.wav"/> <speak></speak> a <s b',
            # SSML's say-as (spelled, read as written, refused) and sub (its alias; bad_text without one or cut)
            "<SAY-AS interpret-as='digits'>4.7</say-as> <say-as interpret-as=cardinal>12</say-as>. Next.",
            '<say-as interpret-as="date">1/2</say-as> <say-as>x</say-as>',
            '<sub alias="United States">U.S.</sub> is big. Next. <sub alias="">x</sub>',
            "H<sub>2</sub>O <sub alias='[happy]'>y</sub> <sub alias=\"x\">a\nb</sub> </sub> <sub alias=z",
            '<say-as interpret-as="characters">A. B C D E F G H</say-as> then <sub alias="x">open',
            "Hi <prosody\nrate=2>x.",
            # attribute names whole (data-alias is none), character references (in an alias, spelled, in the text)
            '<sub data-alias="x">y</sub> <sub title="alias=x" alias="AT&amp;T">ATT</sub> &lt;3 &#0; &#xD800; &amp;amp;',
            "<say-as interpret-as='characters'>A&amp;B&#x32;</say-as> <sub alias='&lt;break/&gt;'>x</sub> Code <say-",
            # the vendors' elements (refused), one cut inside its name
            '<speak><amazon:effect name="whispered">Hi</amazon:effect> <mstts:silence value="1s"/> <amazon:eff',
            # SSML: a quoted '>', a pretty-printed <speak> cut by its newline, a long one, not tags, cut names
            '<speak a="x>y"><s/>Hi<p/>there</speak> if a<s and b>c then x<p',
            '<speak version="1.0"\n xmlns="http://www.w3.org/2001/10/synthesis">\n<p>Hello.</p>\n</speak>',
            '<speak x="' + "a" * 300 + '">Hi</speak> <spea',
            "Hi <pros",
            'Wait <break time="1s"></break> now. </break>',
            # prose after a '<' and an element's name; a none-break before a mark; odd break attributes; a long run
            # of spaces after a '<' (its patterns were quadratic in it)
            "We need x < s. Then go on. if a <s and b",
            'Hello<break strength="none"/>, world <break time="1s" strength="loud"/> <break data-strength="none"/>',
            "<" + " " * 1990 + "x.",
            # attributes read as attributes: a quoted value is none, attributes that are no pairs are bad_text
            '<break foo="strength=none"/> <break data="time=2s"/> <break time="1sx"/> <break time="1s" loud/>',
            "<emotion value='happy' loud/> x <emotion title=\"value=sad\"/> <break time=1s strength='weak\"/>",
            # character references cut across messages (held back while spoken as it comes), a bare '&' at the end
            "Call AT&am",
            "p;T or &#x1",
            "F600; & x &",
            # a bracket in spelled text is characters, no tag
            '<say-as interpret-as="characters">[laughs]</say-as> <spell>[happy] x</spell> [sad] <spell>[whispering]',
            # a break made by taking out a tag (bad_text, it was read aloud), a reference cut at a message's end
            'A <<p>break time="1s"/> B </<s>break> <<sub alias="break/">x</sub>> Tom &am',
            "AT&T &#x65E5" + "日" * 170 + "&#x65E5;" * 3,
            # SSML's marks (reported on our socket): at the start, two in a row, at the end, between sentences, alone
            # between breaks, cut across messages; without a name, empty, too long, with markup, malformed (bad_text)
            '<mark name="a"/>Go<mark name=b/><mark name=\'c\'></mark> on.<mark name="d"/> <mark name="e"/> Next.',
            '<break time="50ms"/><mark name="alone"/><break time="50ms"/> x <ma',
            'rk name="cut"/> y. <mark name="x',
            '<mark/> <mark name=""/> <mark name="' + "m" * (MARK_NAME_MAX + 1) + '"/> <mark name="&lt;b&gt;"/>',
            '<mark name="[happy]"/> <mark name="a" loud/> <mark id="x"/> <mark name="ok"></mark> </mark>',
            # a mark inside a tag (bad_text: taken out, it left the tag whole as text, read aloud)
            '[hap<mark name="m"/>py] x. <emo<mark name="n"/>tion value="sad"/> y. <bre<mark name="o"/>ak time="1s"/>',
            '<mark name="&#x202E;evil"/> <mark name="a&#0;b"/> <mark name="&#xD800;"/> <mark name="&#x1F600;"/> x.',
            # an attribute twice, a CDATA section in an attribute's value (whole, cut across messages): bad_text; a mark
            # after every word of a long sentence and 400 marks alone (marks cost nothing of the utterance budget)
            '<mark name="a" name="b"/> x. <break time="1s" TIME="2s"/> y. <mark name="<![CDATA[x]]>"/> z.',
            '<break time="<![CDATA[1s]]>"/> w. <mark name="<![CDATA[',
            'x]]>"/> v. ' + " ".join(f'w{i}<mark name="m{i}"/>' for i in range(200)) + ".",
            "".join(f'<mark name="n{i}"/>' for i in range(400)) + " u.",
            # XML's markup: taken out whole (a declaration, a comment, a document type), cut ones bad_text
            '<?xml version="1.0"?><!DOCTYPE speak><speak>Hi <!-- a. b? --> there.</speak> a --> b <!-- open <?x',
            "<!" * 40 + "<?" * 40 + "<!--" * 40,
            # CDATA sections: their content text as written (markup in one is none), split across messages, long (past
            # the utterance budget), left open at a message's end or cut in their opening; many openings
            'Say <![CDATA[<break time="1s"/> & [happy] <!-- x -->]]> now. <![CDATA[a]]]]><![CDATA[>]]>',
            "Code <![CDATA[if (a < b && c[0] > d) { x(); }",
            "]] ]]> done. <![CD",
            'ATA[<break time="soon"/>. <sub alias="x">' + "<&[]> " * 120 + "]]",
            "<![CDATA[" * 60 + "]]>" * 3,
            # a section's content of several sentences, a mark and a cut-looking tag in it (its sentences are cut as
            # prose's, none of it read as markup)
            '<![CDATA[One. <mark name="m"/> Two? ]] <break time="1s" three.]]> after.',
            # tags cut at the end of a text the client flushes (refused, the text before spoken), prose that is not
            "Hi <brea",
            'Wait <break time="1',
            "Is two < if a<b see [note [hap",
            # a whole text (HTTP) ending in a cut tag: bad_text naming it; prose ending in a '<' is spoken
            'Hi <break time="1s"',
            "So a < b and x<3",
            "Hi </pros ",
            # breaks and style tags cost nothing of the utterance budget: a sentence past it with tags between its words
            " ".join(f'word{i} <break time="1ms"/> [calm] <p>' for i in range(15)) + " end " * 80 + ".",
            # short breaks and marks, no sentence end (messages of them add up in the buffer): each utterance they
            # become counts against --max-pending-utterances, not each sentence
            "".join(f'w <break time="1ms"/><mark name="m{i}"/>' for i in range(16)),
        ]
    )
)
# texts with style tags for a server with emotion directions (happy, sad: named; valence, arousal: axes)
# a mark of any name (its quotes and references too) before any text
marked_text = st.builds(lambda name, t: f'<mark name="{name}"/>{t}', st.text(max_size=MARK_NAME_MAX + 2), short_text)
tagged_text = st.sampled_from(
    ["[happy] Hi.", "Hi [sad] there.", '<emotion value="calm"/> Go.', "[neutral] x.", "[smug] y.", "[laughs] z."]
) | st.builds(lambda w, t: f"[{w}] {t}", st.sampled_from(["happy", "content", "angry", "whisper", "x"]), short_text)


def silent_flac(seconds: float, sr: int, channels: int = 1) -> bytes:
    """Small on disk, large once decoded: what a clip at a high rate or with many channels is."""
    buf = io.BytesIO()
    sf.write(buf, np.zeros((int(seconds * sr), channels), np.float32), sr, format="FLAC", subtype="PCM_16")
    return buf.getvalue()


HIGH_RATE_CLIPS = [
    base64.b64encode(c).decode()
    for c in (
        silent_flac(59, 384_000),  # over the rate limit: refused from the header
        silent_flac(20, 192_000),  # at the limit: decoded and embedded
        silent_flac(2, 48_000, 8),  # 8 channels, mixed down
    )
]
b64 = (
    st.binary(max_size=300).map(lambda b: base64.b64encode(b).decode())
    | st.sampled_from(HIGH_RATE_CLIPS)
    | st.just(base64.b64encode(small_wav()).decode())
    | st.just("data:audio/wav;base64," + base64.b64encode(small_wav()).decode())
    | st.just(base64.b64encode(npy(np.ones(2048, np.float32))).decode())
    | st.just(base64.b64encode(npy(np.full(2048, 3e38, np.float32))).decode())  # finite, past EMBEDDING_ABS_MAX
    | st.just(base64.b64encode(npy(np.ones(7, np.float32))).decode())
    | st.text(max_size=40)
)
# Issue 21: finite numbers past float32 (1e308 once killed the engine), past int64, subnormal, at the bounds.
extreme = st.sampled_from(
    [
        1e308,
        -1e308,
        1e39,
        3.4e38,
        3.5e38,
        1e300,
        1e-320,
        -0.0,
        100.0,
        100.000001,
        101,
        10**30,
        2**63,
        2**63 - 1,
        -(2**63),
        2**64,
        10**400,
    ]
)
typical_params = {
    "temperature": st.floats(-1, 3) | extreme | anything,
    "top_k": st.integers(-5, 2000) | extreme | anything,
    "top_p": st.floats(-0.5, 1.5) | extreme | anything,
    "min_p": st.floats(-0.5, 1.5) | extreme | anything,
    "repetition_window": st.integers(-5, 300) | extreme | anything,
    "repetition_penalty": st.floats(0, 3) | extreme | anything,
    "repetition_codebooks": st.integers(-3, 12) | extreme | anything,
    "seed": st.integers(-5, 2**64) | extreme | anything,
    "max_frames": st.integers(-5, 40) | extreme | anything,
    "ignore_eos": st.booleans() | anything,
    "language": st.sampled_from(["en_us", "de", "ja", "klingon", "EN-us"]) | anything,
    "text_normalization": st.booleans() | anything,
    "speaking_rate": st.floats(-5, 40) | extreme | anything,
    "speed": st.floats(-1, 5) | extreme | anything,
    "speaking_rate_bucket": st.integers(-2, 10) | extreme | anything,
    "quality_buckets": st.none()
    | st.dictionaries(
        st.sampled_from(["trailing_silence_s", "pitch_std", "x"]), st.integers(-2, 12) | extreme | anything, max_size=3
    )
    | anything,
    "quality_values": st.none()
    | st.dictionaries(
        st.sampled_from(["trailing_silence_s", "pitch_std", "x"]),
        st.floats(allow_nan=True) | extreme | anything,
        max_size=3,
    )
    | anything,
    "accurate_mode": st.booleans() | anything,
    "clean_speaker_background": st.booleans() | anything,
}
# issue 22: the reference's long-form, guidance and emotion fields (more in the block at the end)
floats_any = st.floats(allow_nan=True, allow_infinity=True)
typical_params |= {
    "long_form": st.none() | st.booleans() | anything,
    "long_form_chunk_chars": st.integers(-2, 300) | anything,
    "long_form_window_chunks": st.integers(-1, 70) | anything,
    "long_form_pin_anchor": st.booleans() | anything,
    "long_form_split_mode": st.sampled_from(["word", "sentence", "paragraph"]) | anything,
    "cfg_scale": floats_any | anything,
    "prefix_cfg_scale": floats_any | anything,
    "emotion_cfg_scale": floats_any | anything,
    "emotion_enabled": st.booleans() | anything,
    "emotion_sliders": st.dictionaries(
        st.sampled_from(["happy", "sad", "valence", "smug", ""]), st.floats(-12, 12) | floats_any | anything, max_size=3
    )
    | anything,
    "emotion_valence": st.floats(-12, 12) | anything,
    "emotion_arousal": st.floats(-12, 12) | anything,
    "emotion_strength": st.floats(-12, 12) | floats_any | anything,
}
assert set(typical_params) == PARAM_KEYS


@st.composite
def params(draw) -> Any:
    if draw(st.integers(0, 9)) == 0:
        return draw(anything)
    keys = draw(st.lists(st.sampled_from([*sorted(PARAM_KEYS), "bogus"]), max_size=5, unique=True))
    return {k: draw(typical_params.get(k, anything)) for k in keys}


def message(kind: str, fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    return st.fixed_dictionaries({"type": st.just(kind)}, optional=fields)


ctx = st.text(min_size=0, max_size=140) | anything
ws_json = st.one_of(
    message(
        "text",
        {
            "text": short_text | marked_text | anything,
            "context_id": ctx,
            "flush": st.booleans() | anything,
            "extra": anything,
        },
    ),
    message("flush", {"context_id": ctx}),
    message("cancel", {"context_id": ctx}),
    message(
        "session.config",
        {
            "voice": st.none() | st.text(max_size=20) | anything,
            "voice_clip": st.none() | b64,
            "encoding": st.none() | st.sampled_from(["pcm_s16le", "pcm_f32le", "mp3"]) | anything,
            "sample_rate": st.none() | st.sampled_from([44100, 24000, 16000, 8000, 12345]) | anything,
            "params": st.none() | params(),
            "timestamps": st.none() | st.booleans() | st.sampled_from(["estimated", "aligned", ""]) | anything,
            "lexicon": st.none() | st.lists(st.text(max_size=8), max_size=2) | anything,
        },
    ),
    message("close", {}),
    st.dictionaries(st.text(max_size=12), anything, max_size=4),
    st.fixed_dictionaries({"type": anything}),
)
# Nesting deeper than any message needs (the JSON parser stops at the recursion limit, ~1000): alone,
# or as the value of a field.
deep_json = st.builds(
    lambda n, wrap, obj: (
        ('{"type":"text","text":%s}' if wrap else "%s") % (('{"a":' * n + "1" + "}" * n) if obj else "[" * n + "]" * n)
    ),
    st.sampled_from([33, 999, 1001, 100_000]),
    st.booleans(),
    st.booleans(),
)
ws_frame = (
    ws_json.map(lambda d: json.dumps(d))
    | st.text(max_size=40)
    | anything.map(json.dumps)
    | st.binary(max_size=64)
    | deep_json
)


# ---- WebSocket -----------------------------------------------------------------------------------------
def check_reply(d: Any) -> None:
    assert isinstance(d, dict) and d.get("type") in SERVER_TYPES, d
    if d["type"] == "audio.words":
        assert d["source"] in ("estimated", "aligned") and isinstance(d["utterance_id"], str), d
        assert all(0 <= w["start_ms"] <= w["end_ms"] and isinstance(w["word"], str) for w in d["words"]), d
    if d["type"] == "mark":
        assert isinstance(d["name"], str) and 0 < len(d["name"]) <= MARK_NAME_MAX and "<" not in d["name"], d
        assert isinstance(d["utterance_id"], str) and isinstance(d["context_id"], str) and d["time_ms"] >= 0, d
    if d["type"] == "error":
        assert CODE.match(str(d.get("code"))) and d["code"] != "internal", d
        assert isinstance(d.get("message"), str), d
        # the context of the utterance, or of the text, flush or cancel it refuses: a context id the client could send
        assert "context_id" not in d or (isinstance(d["context_id"], str) and 0 < len(d["context_id"]) <= 128), d


async def ws_exchange(url: str, frames: list[str | bytes]) -> list[dict[str, Any]]:
    replies: list[dict[str, Any]] = []
    async with websockets.connect(url, max_size=None, open_timeout=20) as ws:
        replies.append(json.loads(await asyncio.wait_for(ws.recv(), 20)))
        # short utterances by default; the fuzzed config may override this
        await ws.send(json.dumps({"type": "session.config", "params": {"max_frames": 8, "ignore_eos": True}}))
        try:
            for f in frames:
                await ws.send(f)
            await ws.send(json.dumps({"type": "cancel"}))
            await ws.send(json.dumps({"type": "close"}))
            while True:  # the session must end by itself: session.closed, then a normal close
                msg = await asyncio.wait_for(ws.recv(), 30)
                if isinstance(msg, str):
                    replies.append(json.loads(msg))
        except websockets.ConnectionClosedOK:
            pass
        assert ws.close_code in (1000, None), (ws.close_code, ws.close_reason)
    return replies


DEEP = "[" * 100_000 + "]" * 100_000


@FUZZ
@given(frames=st.lists(ws_frame, min_size=1, max_size=6))
# issue 17's cases, always run: deep nesting, lone surrogates, multi-byte text, high-rate clips
@example(frames=[DEEP, '{"type":"text","text":' + DEEP + "}", '{"type":"text","text":"\\ud800 hello."}'])
@example(frames=[json.dumps({"type": "text", "text": t, "flush": True}) for t in ("😀" * 600, "Привет" * 250)])
@example(frames=[json.dumps({"type": "text", "text": " " * 5000}), json.dumps({"type": "text", "text": "Hi."})])
@example(
    frames=[json.dumps({"type": "session.config", "voice_clip": c}) for c in HIGH_RATE_CLIPS]
    + [json.dumps({"type": "text", "text": "Hi.", "flush": True})]
)
# a cancel while a config's clip is embedded: at once, the text held back behind the config dropped or kept
@example(
    frames=[
        json.dumps({"type": "session.config", "voice_clip": HIGH_RATE_CLIPS[0]}),
        json.dumps({"type": "text", "text": "Dropped.", "flush": True}),
        json.dumps({"type": "text", "text": "Kept.", "context_id": "b", "flush": True}),
        json.dumps({"type": "flush", "extra": 1}),
        json.dumps({"type": "cancel", "context_id": "default"}),
        json.dumps({"type": "text", "text": "Hi.", "flush": True}),
    ]
)
# SSML's marks: reported in order, once each, before the flushed, on streamed halves too; bad ones refused
@example(
    frames=[
        json.dumps({"type": "session.config", "timestamps": "estimated"}),
        json.dumps({"type": "text", "text": '<mark name="a"/>Hello<mark name="b"/> there.<mark name="c"/> Next <ma'}),
        json.dumps({"type": "text", "text": 'rk name="d"/>one.', "flush": True}),
        json.dumps({"type": "text", "text": '<mark name=""/> x. <mark/> y.', "flush": True}),
    ]
)
def test_fuzz_websocket_messages(fuzz_server, frames):
    replies = asyncio.run(asyncio.wait_for(ws_exchange(fuzz_server.ws_url, frames), 90))
    for d in replies:
        check_reply(d)
    assert replies[0]["type"] == "session.created"
    assert replies[-1]["type"] == "session.closed"


def test_a_text_frame_that_is_not_utf8_closes_1007_without_a_traceback(fuzz_server):
    """A text frame whose bytes are not UTF-8 (the JSON fuzz above only sends valid text) closes the socket with 1007,
    logged as one line: no traceback for each such client."""

    async def go() -> int | None:
        async with websockets.connect(fuzz_server.ws_url, max_size=None, open_timeout=30) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(b'{"type":"text","text":"\xff\xfe hi."}', text=True)
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    await asyncio.wait_for(ws.recv(), 30)
            return ws.close_code

    assert asyncio.run(go()) == 1007
    log = fuzz_server.log.read_text()
    assert "Invalid UTF-8" in log and "Traceback" not in log[log.index("Invalid UTF-8") :], log[-3000:]


# ---- HTTP ----------------------------------------------------------------------------------------------
openai_values = {
    "model": st.sampled_from(["zonos2", "tts-1", "gpt-4o-mini-tts", ""]) | anything,
    "input": short_text | anything,
    "voice": st.sampled_from(["alloy", "nobody"]) | anything,
    "response_format": st.sampled_from(["pcm", "wav", "mp3", "flac", "opus", "aac"]) | anything,
    "speed": st.floats(0, 5) | anything,
    "stream_format": st.sampled_from(["audio", "sse", "x"]) | anything,
    "instructions": st.sampled_from(["speak cheerfully", "calm and slow", "whisper", "", "happy slowly " * 400])
    | surrogates
    | anything,
    "stream": anything,
    "params": params(),
    "sample_rate": st.sampled_from([24000, 44100, 16000, 8000, 22050]) | anything,
    "speaking_rate_enabled": st.booleans() | anything,
}
generate_values = {
    "text": short_text | anything,
    "max_tokens": st.integers(-3, 40) | anything,
    "fade_out_ms": st.floats(-10, 6000) | anything,
    "stream": st.booleans() | anything,
    "topk": st.integers(-3, 2000) | anything,
    "speaker_audio_base64": b64,
    "speaker_wav_base64": b64,
    "speaker_embedding_base64": b64,
    "speaker_embedding_id": st.text(max_size=20) | anything,
    "speaker_blend_embedding_id_a": st.text(max_size=10) | anything,
    "speaker_blend_embedding_id_b": st.text(max_size=10) | anything,
    "speaker_blend_t": st.floats() | anything,
    "speaking_rate_enabled": st.booleans() | anything,
    "quality_enabled": st.booleans() | anything,
    "quality_buckets": st.lists(st.none() | st.integers(-2, 12), max_size=8) | anything,
    "quality_values": st.lists(st.none() | st.floats(), max_size=8) | anything,
}


@st.composite
def body(draw, fields: set[str], values: dict[str, st.SearchStrategy], valid: dict[str, Any]) -> bytes:
    """Mostly a valid request with 1-3 fields changed (so the fuzz reaches deep into the parsing),
    sometimes any JSON value or bytes that are not JSON at all."""
    shape = draw(st.integers(0, 19))
    if shape == 0:
        return draw(st.binary(max_size=200))
    if shape == 1:
        return json.dumps(draw(anything)).encode()
    if shape == 2:
        return draw(deep_json).encode()
    d = dict(valid)
    for k in draw(st.lists(st.sampled_from([*sorted(fields), "surprise"]), min_size=1, max_size=3, unique=True)):
        if k in d and draw(st.integers(0, 4)) == 0:
            del d[k]
        else:
            d[k] = draw(values[k] if k in values else typical_params.get(k, anything))
    return json.dumps(d).encode()


def check_http(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert CODE.match(err["code"]) and err["code"] != "internal" and isinstance(err["message"], str), err
    else:
        assert r.status_code == 200
        assert r.headers["content-type"].split(";")[0] in {
            "audio/pcm",
            "audio/wav",
            "audio/mpeg",
            "audio/flac",
            "audio/ogg",
            "audio/aac",
            "text/event-stream",
        }


def post(url: str, data: bytes, content_type: str) -> httpx.Response:
    # the whole body is read: a stream that breaks off mid-way raises here
    return httpx.post(url, content=data, headers={"content-type": content_type}, timeout=60)


content_types = st.sampled_from(["application/json"] * 4 + ["text/plain", "application/x-www-form-urlencoded", ""])


@FUZZ
@given(
    data=body(
        _SPEECH_FIELDS,
        generate_values | openai_values,
        {"input": "Hello there.", "response_format": "pcm", "params": {"max_frames": 5, "ignore_eos": True}},
    ),
    ctype=content_types,
)
@example(data=DEEP.encode(), ctype="application/json")
@example(data=b'{"input": "\\ud800 hi", "response_format": "pcm"}', ctype="application/json")
@example(data=b'{"input": "Hi.", "instructions": "calm \\udfff", "response_format": "pcm"}', ctype="application/json")
@example(
    data=json.dumps(
        {"input": "Привет" * 50, "response_format": "pcm", "params": {"max_frames": 5, "ignore_eos": True}}
    ).encode(),
    ctype="application/json",
)
def test_fuzz_openai_speech(fuzz_server, data, ctype):
    check_http(post(fuzz_server.url + "/v1/audio/speech", data, ctype))


@FUZZ
@given(
    data=body(
        _GENERATE_FIELDS,
        generate_values,
        {"text": "Hello there.", "max_tokens": 5, "ignore_eos": True, "stream": False},
    ),
    ctype=content_types,
)
@example(data=DEEP.encode(), ctype="application/json")
@example(data=b'{"text": "\\udfff", "stream": false}', ctype="application/json")
@example(
    data=json.dumps(
        {"text": "Hi.", "max_tokens": 5, "stream": False, "speaker_audio_base64": HIGH_RATE_CLIPS[0]}
    ).encode(),
    ctype="application/json",
)
@example(
    data=json.dumps(
        {"text": "Hi.", "max_tokens": 5, "stream": False, "speaker_audio_base64": HIGH_RATE_CLIPS[1]}
    ).encode(),
    ctype="application/json",
)
# a falsy non-number as fade_out_ms and a non-boolean switch (taken as 0 and as true): bad_params
@example(
    data=json.dumps({"text": "Hi.", "max_tokens": 5, "fade_out_ms": False, "speaking_rate_enabled": "false"}).encode(),
    ctype="application/json",
)
def test_fuzz_tts_generate(fuzz_server, data, ctype):
    check_http(post(fuzz_server.url + "/tts/generate", data, ctype))


# ---- voices: names must be strings (issue 21) -----------------------------------------------------------
@pytest.fixture(scope="module")
def voices(fuzz_server) -> dict[str, str]:
    """Two library voices: "Fuzzed" (what the dialect sockets speak with) and one that gets renamed."""
    ids = {}
    for name, value in (("Fuzzed", 1.0), ("Renamed", 0.5)):
        r = httpx.post(
            fuzz_server.url + "/v1/voices",
            files={"embedding": (f"{name}.npy", npy(np.full(2048, value, np.float32)))},
            data={"name": name},
            timeout=60,
        )
        assert r.status_code in (200, 201), r.text
        ids[name] = r.json()["id"]
    return ids


@FUZZ_SMALL
@given(
    name=st.text(max_size=70) | surrogates | anything, label=st.text(max_size=70) | anything, t=st.floats() | anything
)
@example(name=12, label=True, t=0.5)
@example(name="n" * 65, label="n" * 65, t=0.5)
@example(name="clip\ud800.npy", label=None, t=0.5)  # a file name the voice keeps: it must be valid text
@example(name="tv null t", label=None, t=None)  # null is t left out (0.5), as /tts/generate's speaker_blend_t
def test_fuzz_voice_names(fuzz_server, voices, name, label, t):
    """A name or label is a string or nothing: never turned into "12" or "True"; no 5xx; one name rule on every
    route (a name too long is refused, never cut). A speaker's file name is kept in its voice (original_name): one
    with a lone surrogate was stored, and from then on every listing of the library was a 500."""
    url, vid = fuzz_server.url, voices["Renamed"]
    before = httpx.get(url + f"/v1/voices/{vid}", timeout=60).json()["name"]
    emb = base64.b64encode(npy(np.full(2048, 0.25, np.float32))).decode()
    js = {"content-type": "application/json"}  # json.dumps: NaN and Infinity are sent as JSON extensions
    patch = httpx.patch(url + f"/v1/voices/{vid}", content=json.dumps({"name": name}), headers=js, timeout=60)
    blend = httpx.post(
        url + "/v1/voices/blend",
        content=json.dumps({"a": vid, "b": vid, "t": 0.5, "name": name}),
        headers=js,
        timeout=60,
    )
    for r in (
        patch,
        blend,
        httpx.post(
            url + "/v1/voices/blend",
            content=json.dumps({"a": vid, "b": vid, "t": t, "name": name}),
            headers=js,
            timeout=60,
        ),
        httpx.post(
            url + "/tts/speakers",
            headers=js | {"X-TTS-Session-ID": "fuzz"},
            timeout=60,
            content=json.dumps({"label": label, "speaker_embedding_base64": emb, "speaker_embedding_name": name}),
        ),
    ):
        check_json_http(r)
    if isinstance(name, str) and name.strip():  # one name rule: a name is refused on every route or on none
        label_as_name = httpx.post(
            url + "/tts/speakers",
            headers=js | {"X-TTS-Session-ID": "fuzz"},
            timeout=60,
            content=json.dumps({"label": name, "speaker_embedding_base64": emb}),
        )
        verdicts = {
            r.status_code == 400 and r.json()["error"]["code"] == "bad_name" for r in (patch, blend, label_as_name)
        }
        assert len(verdicts) == 1, (name, patch.text, blend.text, label_as_name.text)
        if blend.status_code < 300:
            assert blend.json()["name"] == name.strip(), (name, blend.text)  # kept as given, never cut
    check_json_http(httpx.get(url + "/v1/voices", timeout=60))
    check_json_http(httpx.get(url + "/tts/speakers", headers={"X-TTS-Session-ID": "fuzz"}, timeout=60))
    after = httpx.get(url + f"/v1/voices/{vid}", timeout=60).json()["name"]
    if patch.status_code == 200:
        assert isinstance(name, str) and after == name.strip(), (name, after)
    else:
        assert after == before, (name, before, after)


@FUZZ_SMALL
@given(
    extra=st.dictionaries(
        st.sampled_from(["weight", "T", "name", "t", "a", "voice", ""]) | st.text(max_size=8), anything, max_size=3
    )
)
@example(extra={"weight": 0.2})
@example(extra={"t": 0.25, "name": "Fuzz blend"})  # no unknown field: served
def test_fuzz_voice_json_bodies_name_their_unknown_fields(fuzz_server, voices, extra):
    """The voice library's JSON bodies (a blend's {a, b, t, name}, a rename's {name}) refuse a field they do not take
    with bad_params naming it (app/io/json_input.py check_fields): a blend's misspelt "weight" was a blend at 0.5."""
    url, vid = fuzz_server.url, voices["Renamed"]
    js = {"content-type": "application/json"}
    blend_body = {"a": vid, "b": vid, "t": 0.5} | extra
    patch_body = {"name": "Renamed"} | extra
    for path, send, body, fields in (
        ("/v1/voices/blend", httpx.post, blend_body, BLEND_FIELDS),
        (f"/v1/voices/{vid}", httpx.patch, patch_body, RENAME_FIELDS),
    ):
        r = send(url + path, content=json.dumps(body), headers=js, timeout=60)
        check_json_http(r)
        unknown = sorted(set(body) - fields)
        if unknown:
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"] == {"code": "bad_params", "message": f"unknown fields {unknown}"}, r.text
    httpx.patch(url + f"/v1/voices/{vid}", json={"name": "Renamed"}, timeout=60)  # as the other tests found it


@FUZZ_SMALL
@given(
    parts=st.lists(
        st.tuples(
            # (a name as httpx sends it: it percent-encodes a control character or a quote)
            st.sampled_from(["file", "embedding", "name", "voice_name", "files", ""])
            | st.text("abcdefghijklmnopqrstuvwxyz_-é", max_size=8),
            st.booleans(),  # a file part (with a filename), else a text field
            st.integers(0, 3),
        ),
        max_size=4,
    )
)
@example(parts=[("embedding", True, 1), ("voice_name", False, 0)])
@example(parts=[("embedding", True, 1), ("embedding", True, 2)])
@example(parts=[("embedding", True, 1), ("name", False, 0), ("name", False, 1)])
@example(parts=[("embedding", True, 1), ("file", False, 0)])
@example(parts=[("embedding", True, 3), ("name", False, 2)])  # a well-formed upload: served
def test_fuzz_voice_upload_parts(fuzz_server, parts):
    """POST /v1/voices's form takes `file` parts (files), one `embedding` (a file) and one `name` (text): any
    other part, a second embedding or name, or a text field for a file is bad_upload, never dropped in silence
    (a voice made of the rest); no 5xx."""
    files = []
    for key, is_file, n in parts:
        if key == "embedding" or (is_file and key != "file"):
            body: Any = npy(np.full(2048, 0.1 + n / 10, np.float32))
        else:
            body = f"fuzz voice {n}"
        files.append((key, (f"p{n}.npy", body) if is_file else (None, body)))
    r = httpx.post(fuzz_server.url + "/v1/voices", files=files or {"": (None, "")}, timeout=60)
    check_json_http(r)
    keys = [k for k, _, _ in parts]
    unknown = sorted(set(keys) - UPLOAD_PARTS)
    if unknown:
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_upload", r.text
        assert f"unknown form fields {unknown}" in r.json()["error"]["message"], r.text
    if r.status_code < 300:  # served: every part was one the form takes, each as the one thing it is
        assert not unknown and keys.count("embedding") <= 1 and keys.count("name") <= 1, (parts, r.text)
        assert all(f for k, f, _ in parts if k in ("file", "embedding")), (parts, r.text)
        assert all(not f for k, f, _ in parts if k == "name"), (parts, r.text)
        httpx.delete(fuzz_server.url + f"/v1/voices/{r.json()['id']}", timeout=60)


def check_json_http(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert CODE.match(err["code"]) and err["code"] != "internal", err


# ---- the dialects' sockets: their URLs and their messages --------------------------------------
digits = st.sampled_from(["24000", "8000", "²", "٣", "１６０００", "-1", "1e3", "", "99999999999999999999999", "0"])
query_value = (
    digits
    | st.text(max_size=12)
    | st.sampled_from(
        [
            "true",
            "false",
            "pcm_24000",
            "ulaw_8000",
            "mp3_44100_128",
            "pcm_²",
            "opus_48000_64",
            "linear16",
            "mulaw",
            "4294967295",
            "4294967296",
            "180",
            "181",
            "on",
            "1.1",  # (Deepgram's speed)
            "0_3",  # (float() read it as 3.0)
            "nan",
        ]
    )
)
zonos_params = params().map(lambda p: json.dumps(p)) | st.text(max_size=20)
SOCKETS = {  # path -> the query keys it reads
    "/v1/tts/ws": ["encoding", "sample_rate", "voice"],
    "/v1/text-to-speech/Fuzzed/multi-stream-input": [
        "output_format",
        "auto_mode",
        "seed",
        "language_code",
        "apply_text_normalization",
        "zonos_params",
        "sync_alignment",
        "inactivity_timeout",
        "enable_ssml_parsing",
        "model_id",
        "enable_logging",
        "optimize_streaming_latency",
    ],
    "/v1/text-to-speech/Fuzzed/stream-input": [
        "output_format",
        "auto_mode",
        "seed",
        "zonos_params",
        "optimize_streaming_latency",
        "enable_logging",
        "sync_alignment",
        "inactivity_timeout",
        "apply_text_normalization",
        "language_code",
    ],
    "/tts/websocket": ["cartesia_version", "zonos_params"],
    "/v1/speak": ["model", "encoding", "sample_rate", "speed", "bit_rate", "mip_opt_out", "zonos_params"],
}


UNREAD = {"model_id", "cartesia_version"}  # keys of SOCKETS the gateway does not read (taken as they come)


@st.composite
def socket_url(draw) -> tuple[str, list[tuple[str, str]]]:
    """A socket and its URL settings: a key may come twice, with another value (a key the socket reads: refused)
    or with the same (that value)."""
    path = draw(st.sampled_from(sorted(SOCKETS)))
    keys = draw(st.lists(st.sampled_from(SOCKETS[path]), max_size=3))
    pairs = [(k, draw(zonos_params if k == "zonos_params" else query_value)) for k in keys]
    if pairs and draw(st.booleans()):
        pairs.append(draw(st.sampled_from(pairs)))  # a setting repeated with its value
    return path, pairs


def conflicting(query: Any) -> bool:
    """Whether a key the socket reads comes twice with different values."""
    pairs = list(query.items()) if isinstance(query, dict) else query
    return any(len({v for key, v in pairs if key == k}) > 1 for k, _ in pairs if k not in UNREAD)


async def handshake(url: str) -> tuple[Any, Any]:
    """(the open socket, None) or (None, the refusal's HTTP response)."""
    try:
        return await websockets.connect(url, max_size=None, open_timeout=30), None
    except websockets.InvalidStatus as e:
        return None, e.response


def check_refusal(resp: Any) -> None:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.body[:300])
    body = json.loads(resp.body)
    assert isinstance(body, dict) and "internal" not in json.dumps(body).lower(), body


@FUZZ_SMALL
@given(where=socket_url())
@example(where=("/v1/speak", {"sample_rate": "²"}))
@example(where=("/v1/tts/ws", {"sample_rate": "²"}))
@example(where=("/v1/text-to-speech/Fuzzed/multi-stream-input", {"output_format": "pcm_²", "seed": "²"}))
@example(where=("/v1/speak", {"zonos_params": '{"temperature": 1e39}'}))
@example(where=("/v1/speak", {"bit_rate": "-1"}))
@example(where=("/v1/speak", {"mip_opt_out": "yes"}))
@example(where=("/v1/speak", [("sample_rate", "8000"), ("sample_rate", "24000")]))  # a repeated setting
@example(where=("/v1/tts/ws", [("sample_rate", "8000"), ("sample_rate", "24000")]))
@example(where=("/v1/text-to-speech/Fuzzed/stream-input", [("output_format", "pcm_16000"), ("output_format", "")]))
@example(where=("/tts/websocket", [("zonos_params", "{}"), ("zonos_params", "{ }")]))
@example(where=("/tts/websocket", [("cartesia_version", "1"), ("cartesia_version", "2")]))  # not read: taken
def test_fuzz_socket_urls(fuzz_server, voices, where):
    """Every socket's URL settings: accepted, or refused with a 4xx in its dialect's shape (our socket: an
    error with a code, then close 1008), never a 500 or a dropped connection."""
    path, query = where

    async def go():
        ws, refused = await handshake(fuzz_server.ws_url.replace("/v1/tts/ws", path) + "?" + urlencode(query))
        if refused is not None:
            check_refusal(refused)
            return
        assert path == "/v1/tts/ws" or not conflicting(query), query  # (our socket refuses in band)
        async with ws:
            if path == "/v1/tts/ws":
                first = json.loads(await asyncio.wait_for(ws.recv(), 30))
                assert first["type"] == "error" or not conflicting(query), (query, first)
                if first["type"] == "error":
                    check_reply(first)
                    with pytest.raises(websockets.ConnectionClosed):
                        await asyncio.wait_for(ws.recv(), 30)
                    assert ws.close_code == 1008
                else:
                    assert first["type"] == "session.created"

    asyncio.run(asyncio.wait_for(go(), 60))


def dialect_ctx() -> st.SearchStrategy:
    return st.sampled_from(["a", "b", "c"]) | st.text(max_size=6) | st.just("x" * 129) | anything


embedding = (
    st.sampled_from(
        [
            "abc",
            {"a": 1},
            [1, "a"],
            [[1.0], [2.0]],
            [10**400] * 2048,
            ["1"] * 2048,
            [True] * 2048,
            [1e39] * 2048,
            [0.01] * 2048,
            [0.01] * 2047,
            None,
        ]
    )
    | st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=3)
    | anything
)
el_message = st.fixed_dictionaries(
    {},
    optional={
        "text": short_text | anything,
        "context_id": dialect_ctx(),
        "flush": st.booleans() | anything,
        "close_context": st.booleans() | anything,
        "close_socket": st.just(False) | anything,
        "try_trigger_generation": st.booleans() | anything,
        "voice_settings": st.fixed_dictionaries(
            {},
            optional={
                "speed": st.floats(0, 5) | extreme | anything,
                "stability": st.floats(0, 1) | extreme | anything,
                "similarity_boost": st.floats(0, 1) | anything,
                "style": st.floats(0, 1) | anything,
                "use_speaker_boost": st.booleans() | anything,
            },
        )
        | anything,
        # not used, held to ElevenLabs' schedule: a list of numbers each in 50..500
        "generation_config": st.fixed_dictionaries(
            {},
            optional={
                "chunk_length_schedule": st.lists(st.integers(40, 510) | extreme | anything, max_size=5) | anything
            },
        )
        | anything,
        "pronunciation_dictionary_locators": st.lists(
            st.fixed_dictionaries({"pronunciation_dictionary_id": st.sampled_from(["pd_0000000000000000", "x"])}),
            max_size=2,
        )
        | anything,
    },
)
ca_output = (
    st.fixed_dictionaries(
        {},
        optional={
            "container": st.sampled_from(["raw", "wav"]) | anything,
            "encoding": st.sampled_from(["pcm_s16le", "pcm_f32le", "pcm_mulaw", "x"]) | anything,
            # a float that is a whole number is that integer (24000.0); any other float is refused
            "sample_rate": st.sampled_from([24000, 8000, 12345, 10**400, 24000.0, 8000.5]) | extreme | anything,
        },
    )
    | anything
)
# Cartesia's fields that are accepted and not used (type-checked: app/doors/dialects/cartesia.py check_unused)
ca_unused = {
    "model_id": st.sampled_from(["sonic-2", "sonic-english", "sonic-3.5"]) | anything,
    "add_phoneme_timestamps": st.booleans() | anything,
    "use_normalized_timestamps": st.booleans() | anything,
    "use_original_timestamps": st.booleans() | anything,
}
ca_voice_controls = (
    st.fixed_dictionaries(
        {},
        optional={
            # Cartesia's: a name or a number in -1..1; tags: strings of 1..64 characters (names not checked)
            "speed": st.sampled_from(["fast", "fastest", "warp", 0.5, -1, 1.5]) | extreme | anything,
            "emotion": st.sampled_from([["positivity"], ["positivity:high", "curiosity"], ["joy"], ["anger:max"]])
            | anything,
        },
    )
    | anything
)
ca_message = st.fixed_dictionaries(
    {},
    optional={
        **ca_unused,
        "duration": st.sampled_from([5, 2.5, 0, -1, 1e6]) | extreme | anything,  # (0, --max-request-audio-s]
        "transcript": short_text | anything,
        "continue": st.booleans() | anything,
        "context_id": dialect_ctx(),
        "flush": st.booleans() | anything,
        "cancel": st.booleans() | anything,
        "voice": st.fixed_dictionaries(
            {"mode": st.sampled_from(["id", "embedding", "clone"]) | anything},
            optional={
                "id": st.sampled_from(["Fuzzed", "Nobody"]) | anything,
                "embedding": embedding,
                "__experimental_controls": ca_voice_controls,
            },
        )
        | anything,
        "output_format": ca_output,
        "language": st.sampled_from(["en", "de", "xx"]) | anything,
        "max_buffer_delay_ms": st.sampled_from([0, 10, 3000, 5001, -1, 10**400, 0.0, 0.5]) | extreme | anything,
        "generation_config": st.fixed_dictionaries(
            {},
            optional={
                "speed": st.floats(0, 3) | extreme | anything,
                "volume": st.floats(0, 3) | extreme | anything,
                "emotion": anything,
            },
        )
        | anything,
        "speed": st.sampled_from(["slow", "slowest", "warp"]) | extreme | anything,
    },
)
dg_message = st.fixed_dictionaries(
    {"type": st.sampled_from(["Speak", "Flush", "Clear", "Nope"]) | anything}, optional={"text": short_text | anything}
)
VALID_CA = {
    "model_id": "sonic",
    "voice": {"mode": "id", "id": "Fuzzed"},
    "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 8000},
}


def check_dialect_reply(dialect: str, d: Any) -> None:
    assert isinstance(d, dict), d
    if dialect == "elevenlabs":
        if "error" in d:
            assert CODE.match(str(d["error"])) and d["error"] != "internal" and isinstance(d["message"], str), d
        else:
            assert "audio" in d or d.get("isFinal") is True, d
    elif dialect == "cartesia":
        assert d.get("type") in {"chunk", "done", "flush_done", "error"} and "context_id" in d, d
        if d["type"] == "error":
            assert CODE.match(str(d["error_code"])) and d["error_code"] != "internal", d
    else:
        assert d.get("type") in {"Metadata", "Flushed", "Cleared", "Warning", "Error"}, d
        code = d.get("warn_code") or d.get("err_code")
        if d["type"] in ("Warning", "Error"):
            assert re.fullmatch(r"[A-Za-z_]+", str(code)) and code.lower() != "internal", d


def context_ids(messages: list[Any]) -> set[str]:
    return {
        m["context_id"]
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("context_id"), str) and 0 < len(m["context_id"]) <= 128
    }


async def dialect_exchange(base: str, dialect: str, messages: list[Any]) -> None:
    """Send the fuzzed messages, then what ends the session in that dialect; every reply must be well formed,
    and the session must still work: a probe after the fuzz is spoken and answered, then a clean close."""
    p = quote(json.dumps({"max_frames": 5, "ignore_eos": True}))
    url = {
        "elevenlabs": f"/v1/text-to-speech/Fuzzed/multi-stream-input?output_format=pcm_8000&zonos_params={p}",
        "cartesia": f"/tts/websocket?zonos_params={p}",
        "deepgram": f"/v1/speak?model=Fuzzed&encoding=linear16&sample_rate=8000&zonos_params={p}",
    }[dialect]
    async with websockets.connect(base + url, max_size=None, open_timeout=30) as ws:
        for m in messages:
            await ws.send(json.dumps(m))
        if dialect == "elevenlabs":  # every context closed (each isFinal), then a probe context
            for ctx in context_ids(messages):
                await ws.send(json.dumps({"context_id": ctx, "close_context": True}))
                await ws.send(json.dumps({"context_id": ctx, "close_context": True}))  # twice: dropped now
            probe = {"text": "Probe. ", "context_id": "probe-21", "flush": True, "close_context": True}
            done = lambda d: d == {"isFinal": True, "contextId": "probe-21"}  # noqa: E731
        elif dialect == "cartesia":  # every context cancelled, then a probe context to its done
            for ctx in context_ids(messages):
                await ws.send(json.dumps({"context_id": ctx, "cancel": True}))
            probe = {**VALID_CA, "transcript": "Probe.", "continue": False, "context_id": "probe-21"}
            done = lambda d: d.get("type") == "done" and d.get("context_id") == "probe-21"  # noqa: E731
        else:  # everything cleared, then a probe: its Flushed is the first after the last Cleared
            await ws.send(json.dumps({"type": "Clear"}))
            await ws.send(json.dumps({"type": "Speak", "text": "Probe."}))
            probe = {"type": "Flush"}
            clears = 1 + sum(1 for m in messages if isinstance(m, dict) and m.get("type") == "Clear")
            seen = {"Cleared": 0}

            def done(d: dict[str, Any]) -> bool:
                seen["Cleared"] += d.get("type") == "Cleared"
                return d.get("type") == "Flushed" and seen["Cleared"] == clears

        await ws.send(json.dumps(probe))
        ids: list[int] = []  # Deepgram's sequence ids, as they come: each answer's above every one before it
        while True:
            msg = await asyncio.wait_for(ws.recv(), 60)
            if isinstance(msg, bytes):
                continue
            d = json.loads(msg)
            check_dialect_reply(dialect, d)
            if dialect == "deepgram" and d["type"] in ("Flushed", "Cleared"):
                assert type(d["sequence_id"]) is int and (not ids or d["sequence_id"] > ids[-1]), (ids, d)
                ids.append(d["sequence_id"])
            if done(d):
                break
        if dialect == "deepgram":  # every Flush took an id (the probe's too), answered by the probe's Flushed at last
            flushes = 1 + sum(1 for m in messages if isinstance(m, dict) and m.get("type") == "Flush")
            assert ids[-1] >= flushes - 1, (ids, flushes)


def ends_the_socket(m: Any) -> bool:
    """A fuzzed message that closes the socket (the probe after the fuzz needs it open)."""
    return isinstance(m, dict) and (m.get("close_socket") is True or m.get("type") == "Close")


dialect_case = st.sampled_from(["elevenlabs", "cartesia", "deepgram"]).flatmap(
    lambda d: st.tuples(
        st.just(d),
        st.lists(
            {
                "elevenlabs": el_message,
                "cartesia": ca_message | ca_message.map(lambda m: {**VALID_CA, **m}),
                "deepgram": dg_message,
            }[d]
            | anything,
            max_size=6,
        ).map(lambda ms: [m for m in ms if not ends_the_socket(m)]),
    )
)
# issue 21: malformed embeddings next to a context that plays on; a Flush past the utterance limit
ISSUE_21_EMBEDDINGS = [
    {**VALID_CA, "transcript": "Playing. ", "continue": True, "context_id": "a", "max_buffer_delay_ms": 0}
] + [
    {**VALID_CA, "transcript": "x", "context_id": f"e{i}", "voice": {"mode": "embedding", "embedding": e}}
    for i, e in enumerate(["abc", {"a": 1}, [1, "a"], [10**400] * 2048, [True] * 2048, ["1"] * 2048])
]


@FUZZ_SMALL
@given(case=dialect_case)
@example(case=("cartesia", ISSUE_21_EMBEDDINGS))
# ElevenLabs' schedule out of its range, Cartesia's older controls out of theirs, a duration past ours: refused
@example(case=("elevenlabs", [{"text": " ", "context_id": "c", "generation_config": {"chunk_length_schedule": [20]}}]))
@example(
    case=(
        "cartesia",
        [
            {**VALID_CA, "transcript": "x", "context_id": "d", "duration": 10**400},
            {**VALID_CA, "transcript": "x", "context_id": "s", "speed": "warp"},
            {
                **VALID_CA,
                "transcript": "x",
                "voice": {
                    "mode": "id",
                    "id": "Fuzzed",
                    "__experimental_controls": {"speed": 2, "emotion": ["joy:max"]},
                },
            },
        ],
    )
)
# a Clear before any Flush and after every one was answered takes an id of its own (its Cleared repeated id 0)
@example(case=("deepgram", [{"type": "Clear"}, {"type": "Flush"}, {"type": "Clear"}, {"type": "Clear"}]))
@example(case=("deepgram", [{"type": "Speak", "text": "One. "}, *[{"type": "Flush"}] * 2, {"type": "Clear"}]))
@example(
    case=(
        "deepgram",
        [
            {"type": "Speak", "text": "One. Two. Three. Four. Five. Six. Seven. Eight. Nine"},
            {"type": "Flush"},
            {"type": "Flush"},
        ],
    )
)
@example(
    case=(
        "elevenlabs",
        [
            {"text": "All in one. ", "context_id": "a", "flush": True, "close_context": True},
            {"text": " ", "context_id": "a", "close_context": True},
        ],
    )
)
def test_fuzz_dialect_messages(fuzz_server, voices, case):
    """Every dialect's message shapes (and malformed ones): well-formed replies only, no `internal`, and the
    session still speaks a probe afterwards."""
    dialect, messages = case
    asyncio.run(asyncio.wait_for(dialect_exchange(fuzz_server.url.replace("http", "ws"), dialect, messages), 120))


el_closing = st.fixed_dictionaries(
    {"close_socket": st.just(True)},
    optional={
        "text": short_text | anything,
        "context_id": dialect_ctx(),
        "flush": st.booleans() | anything,
        "close_context": st.booleans() | anything,
        "voice_settings": anything,
    },
)


@FUZZ_SMALL
@given(
    kind=st.sampled_from(["multi-stream-input", "stream-input"]),
    before=st.lists(el_message, max_size=3).map(lambda ms: [m for m in ms if not ends_the_socket(m)]),
    last=el_closing,
)
@example(kind="multi-stream-input", before=[], last={"text": "All in one. ", "flush": True, "close_socket": True})
@example(kind="multi-stream-input", before=[], last={"text": "Hi. ", "context_id": "x" * 129, "close_socket": True})
@example(
    kind="stream-input", before=[{"text": "Hi. "}, {"text": "more", "close_context": True}], last={"close_socket": True}
)
def test_fuzz_elevenlabs_close_socket_with_anything(fuzz_server, voices, kind, before, last):
    """close_socket with anything else in its message: well-formed replies only, and the socket closes
    cleanly (1000) after the audio and isFinal of what was flushed, whatever the rest of the message was."""
    p = quote(json.dumps({"max_frames": 5, "ignore_eos": True}))
    url = f"/v1/text-to-speech/Fuzzed/{kind}?output_format=pcm_8000&zonos_params={p}"

    async def go() -> int | None:
        async with websockets.connect(
            fuzz_server.url.replace("http", "ws") + url, max_size=None, open_timeout=30
        ) as ws:
            with contextlib.suppress(websockets.ConnectionClosed):  # {"text": ""} ends the one-context socket
                for m in [*before, last]:
                    await ws.send(json.dumps(m))
                while True:
                    check_dialect_reply("elevenlabs", json.loads(await asyncio.wait_for(ws.recv(), 60)))
            return ws.close_code

    assert asyncio.run(asyncio.wait_for(go(), 120)) == 1000


def test_server_healthy_after_fuzzing(fuzz_server):
    """Runs after the fuzz tests (file order): a normal request still works, nothing crashed."""
    r = httpx.post(
        fuzz_server.url + "/v1/audio/speech",
        timeout=60,
        json={"input": "Still fine.", "response_format": "pcm", "params": {"max_frames": 20, "ignore_eos": True}},
    )
    assert r.status_code == 200 and abs(len(r.content) // 2 - 20 * 512 * 24000 / 44100) <= 2
    assert httpx.get(fuzz_server.url + "/readyz").status_code == 200
    metrics = httpx.get(fuzz_server.url + "/metrics").text
    assert "zonos_engine_restarts 0.0" in metrics  # the engine never fell over
    log = fuzz_server.log.read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    assert "without completing handshake" not in log, log[-3000:]  # refusals are answered, not dropped


# ---- issue 22: emotion fields against a server with emotion directions loaded --------------------------------
@pytest.fixture(scope="module")
def emotion_fuzz_server(start_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("emotion_fuzz")
    rng = np.random.default_rng(0)
    directions = {}
    for name in ("happy", "sad", "valence", "arousal"):
        np.save(folder / f"{name}.npy", (0.05 * rng.standard_normal(2048)).astype(np.float32))
        directions[name] = {"file": f"{name}.npy", "kind": "axis" if name in ("valence", "arousal") else "named"}
    (folder / "manifest.json").write_text(json.dumps({"dim": 2048, "space": "raw", "directions": directions}))
    (folder / "calibration.json").write_text(json.dumps({"global_default": 2.0, "default": {"happy": 3.0}}))
    return start_server("--max-frames", "30", "--emotion-directions-dir", str(folder))


emotion_fields = [k for k in typical_params if k.startswith(("emotion_", "long_form", "cfg_", "prefix_cfg"))]
emotion_voice = {"speaker_embedding_base64": base64.b64encode(npy(np.ones(2048, np.float32))).decode()}
# a voice near the engine's bound (±1e6 on every axis): any emotion moves it past the bound, which the gateway refuses
# (bad_params) before the engine would (bad_voice)
_NEAR_BOUND = np.full(2048, 1e6, np.float32)
_NEAR_BOUND[0] = -1e6
near_bound_voice = {"speaker_embedding_base64": base64.b64encode(npy(_NEAR_BOUND)).decode()}
emotion_voices = {
    "speaker_embedding_base64": st.sampled_from([emotion_voice, near_bound_voice]).map(
        lambda v: v["speaker_embedding_base64"]
    )
}
EMOTION_AT_THE_BOUND = {"emotion_enabled": True, "emotion_sliders": {"happy": 10}, "emotion_strength": 10}


def check_emotion_http(r: httpx.Response) -> None:
    """check_http, and no engine refusal of a voice: what the emotion makes of one is the gateway's to refuse."""
    check_http(r)
    assert r.status_code == 200 or r.json()["error"]["code"] != "bad_voice", r.text


@FUZZ
@given(
    data=body(
        {*emotion_fields, "speaker_embedding_base64"},
        emotion_voices,
        {
            "text": "Hello there.",
            "max_tokens": 5,
            "ignore_eos": True,
            "stream": False,
            "emotion_enabled": True,
            **emotion_voice,
        },
    )
)
@example(
    data=json.dumps(
        {
            "text": "Hi.",
            "max_tokens": 5,
            "stream": False,
            "emotion_enabled": True,
            "emotion_sliders": {"happy": 1.0},
            "emotion_valence": 0.5,
            **emotion_voice,
        }
    ).encode()
)
@example(
    data=json.dumps(
        {"text": "Hi.", "max_tokens": 5, "stream": False, **EMOTION_AT_THE_BOUND, **near_bound_voice}
    ).encode()
)
def test_fuzz_tts_generate_emotion(emotion_fuzz_server, data):
    check_emotion_http(post(emotion_fuzz_server.url + "/tts/generate", data, "application/json"))


@FUZZ
@given(
    data=body(
        {*emotion_fields, "input", "speaker_embedding_base64"},
        {"input": tagged_text | short_text, **emotion_voices},
        {
            "input": "Hello there.",
            "response_format": "pcm",
            "max_frames": 5,
            "ignore_eos": True,
            "emotion_enabled": True,
            **emotion_voice,
        },
    )
)
@example(
    data=json.dumps(
        {"input": "Hi.", "response_format": "pcm", "max_frames": 5, **EMOTION_AT_THE_BOUND, **near_bound_voice}
    ).encode()
)
def test_fuzz_openai_speech_emotion(emotion_fuzz_server, data):
    check_emotion_http(post(emotion_fuzz_server.url + "/v1/audio/speech", data, "application/json"))


# An integer past float's range (JSON carries any: 1 followed by 400 zeros) in a number field: math.isfinite
# raised OverflowError on it, a 500 `internal` on every route.
HUGE = "1" + "0" * 400


@pytest.mark.parametrize(
    "field",
    [
        "temperature",
        "top_p",
        "cfg_scale",
        "prefix_cfg_scale",
        "emotion_cfg_scale",
        "emotion_strength",
        "emotion_valence",
        "emotion_arousal",
        "emotion_sliders",
    ],
)
def test_huge_integers_are_bad_params(emotion_fuzz_server, field):
    value = f'{{"happy": {HUGE}}}' if field == "emotion_sliders" else HUGE
    voice = json.dumps(emotion_voice)[1:-1]
    for path, head in (
        ("/tts/generate", '"text": "Hi.", "max_tokens": 5, "stream": false'),
        ("/v1/audio/speech", '"input": "Hi.", "response_format": "pcm", "max_frames": 5'),
    ):
        r = post(
            emotion_fuzz_server.url + path,
            f'{{{head}, "emotion_enabled": true, {voice}, "{field}": {value}}}'.encode(),
            "application/json",
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_params", (path, r.status_code, r.text)
    if field == "temperature":  # the OpenAI route's own speed too
        r = post(
            emotion_fuzz_server.url + "/v1/audio/speech",
            f'{{"input": "Hi.", "speed": {HUGE}}}'.encode(),
            "application/json",
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_params", r.text


@pytest.mark.parametrize("extra", ['"stream": "false"', '"stream": 0', '"quality_values": [0, 0, 0, 0, 0, 0, 0, 0, 0]'])
def test_generate_refuses_what_it_used_to_read_loosely(emotion_fuzz_server, extra):
    """/tts/generate: a `stream` that is not a boolean ("false", a string, streamed) and a quality_values list
    longer than the model's quality features (silently cut) are bad_params."""
    r = post(
        emotion_fuzz_server.url + "/tts/generate",
        f'{{"text": "Hi.", "max_tokens": 5, {extra}}}'.encode(),
        "application/json",
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_params", r.text


def test_websocket_config_refuses_an_unknown_emotion_at_once(emotion_fuzz_server):
    """session.config with emotion fields its voice cannot take (an unknown name) is refused when it comes, as
    every HTTP door refuses it: it was accepted (session.updated) and then failed every utterance."""

    async def run() -> list[dict[str, Any]]:
        async with websockets.connect(emotion_fuzz_server.ws_url, max_size=None, open_timeout=20) as ws:
            await asyncio.wait_for(ws.recv(), 20)
            await ws.send(
                json.dumps(
                    {
                        "type": "session.config",
                        "voice_clip": base64.b64encode(small_wav()).decode(),
                        "params": {"emotion_enabled": True, "emotion_sliders": {"nope": 1.0}},
                    }
                )
            )
            first = json.loads(await asyncio.wait_for(ws.recv(), 60))
            await ws.send(
                json.dumps(
                    {
                        "type": "session.config",
                        "params": {
                            "emotion_enabled": True,
                            "emotion_sliders": {"happy": 1.0},
                            "emotion_cfg_scale": 2.0,
                        },
                    }
                )
            )
            second = json.loads(await asyncio.wait_for(ws.recv(), 60))
            return [first, second]

    refused, ok = asyncio.run(run())
    assert refused["type"] == "error" and refused["code"] == "bad_params" and "nope" in refused["message"], refused
    assert ok["type"] == "session.updated" and ok["voice"] is None, ok  # the refused config changed nothing


def test_emotion_server_healthy_after_fuzzing(emotion_fuzz_server):
    r = httpx.post(
        emotion_fuzz_server.url + "/tts/generate",
        timeout=60,
        json={
            "text": "Still fine.",
            "max_tokens": 5,
            "ignore_eos": True,
            "stream": False,
            "emotion_enabled": True,
            "emotion_sliders": {"sad": 1.0},
            **emotion_voice,
        },
    )
    assert r.status_code == 200 and len(r.content) == 5 * 512 * 4, r.text
    assert "zonos_engine_restarts 0.0" in httpx.get(emotion_fuzz_server.url + "/metrics").text
    log = emotion_fuzz_server.log.read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    assert "without completing handshake" not in log, log[-3000:]  # refusals are answered, not dropped


# ---- the dialects' HTTP routes (issue 24.1: app/doors/dialects/*_http.py) ------------------------------------------
# Each answers in its vendor's error shape; the check is the same: never a 5xx or `internal`, a specific code.
DIALECT_KEY = "fuzz-dialect-key"


@pytest.fixture(scope="module")
def dialect_fuzz_server(start_server):
    srv = start_server("--max-frames", "30", "--max-http-chars", "300", "--api-key", DIALECT_KEY)
    r = httpx.post(
        srv.url + "/v1/voices",
        headers={"X-API-Key": DIALECT_KEY},
        data={"name": "Ada"},
        timeout=60,
        files={"embedding": ("ada.npy", npy(np.random.default_rng(3).standard_normal(2048).astype(np.float32)))},
    )
    assert r.status_code in (200, 201), r.text
    return srv


@st.composite
def dialect_body(draw, values: dict[str, st.SearchStrategy], valid: dict[str, Any]) -> bytes:
    """A valid request with 1-3 fields changed, removed or added, or any JSON value, or bytes."""
    shape = draw(st.integers(0, 14))
    if shape == 0:
        return draw(st.binary(max_size=120))
    if shape == 1:
        return json.dumps(draw(anything)).encode()
    d = dict(valid)
    for k in draw(st.lists(st.sampled_from([*sorted(values), "surprise"]), min_size=1, max_size=3, unique=True)):
        if k in d and draw(st.integers(0, 4)) == 0:
            del d[k]
        else:
            d[k] = draw(values.get(k, anything))
    return json.dumps(d).encode()


DIALECT_MEDIA = {
    "audio/pcm",
    "audio/wav",
    "audio/mpeg",
    "audio/ogg",
    "audio/flac",
    "audio/aac",
    "audio/PCMU",
    "audio/PCMA",
    "application/json",
    "application/x-ndjson",
    "text/event-stream",
}


def check_dialect(r: httpx.Response, error_code: Any) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        code = error_code(r.json())
        assert isinstance(code, str) and code.lower() != "internal" and re.fullmatch(r"[A-Za-z_]+", code), r.text
    else:
        assert r.status_code == 200 and r.headers["content-type"].split(";")[0] in DIALECT_MEDIA, r.headers


FAST_Q = "zonos_params=" + json.dumps({"max_frames": 5, "ignore_eos": True})
# the key in the URL, repeated: with another value (refused, 401, even though the last one is right), with its own
URL_KEYS = (f"api_key=x&api_key={DIALECT_KEY}", f"api_key={DIALECT_KEY}&api_key={DIALECT_KEY}")


def url_key_header(query: str) -> str:
    """The key header of a request with `query`: none where the query names the right key (it is read then)."""
    return "" if DIALECT_KEY in query else DIALECT_KEY


KEPT_ID = "@kept"
request_ids = st.sampled_from([KEPT_ID, KEPT_ID, "0" * 32, "x", "", "x" * 129]) | st.text(max_size=40)
el_values = {
    "text": short_text | anything,
    "model_id": st.sampled_from(["eleven_flash_v2_5"]) | anything,
    "voice_settings": st.none()
    | st.fixed_dictionaries(
        {}, optional={"speed": st.floats(-1, 3) | anything, "stability": anything, "use_speaker_boost": anything}
    )
    | anything,
    "language_code": st.sampled_from(["en", "de", "xx", ""]) | anything,
    "seed": st.integers(-3, 2**33) | anything,
    "apply_text_normalization": st.sampled_from(["auto", "on", "off"]) | anything,
    "previous_text": st.text(max_size=20) | anything,
    "next_text": anything,
    # KEPT_ID: a request id the server kept (the `kept_id` fixture's); the others: unknown, malformed, too long
    "previous_request_ids": st.lists(request_ids, max_size=4) | anything,
    "next_request_ids": st.lists(request_ids, max_size=4) | anything,
    "pronunciation_dictionary_locators": anything,
    "use_pvc_as_ivc": anything,
    "apply_language_text_normalization": anything,
}
el_routes = st.sampled_from(["", "/stream", "/with-timestamps", "/stream/with-timestamps"])
el_queries = st.sampled_from(
    [
        "output_format=pcm_16000",
        "output_format=mp3_22050_32",
        "output_format=ulaw_8000",
        "output_format=opus_48000_32",
        "output_format=pcm_1",
        "output_format=pcm_",
        "output_format=pcm_２４０００",
        "output_format=x",
        "optimize_streaming_latency=9",
        "",
        "output_format=opus_24000_32",
        "output_format=alaw_16000",
        "auto_mode=maybe",
        "apply_text_normalization=sometimes",
        "enable_logging=no",
        "inactivity_timeout=0",
        "seed=4294967296",
        "seed=4294967295",
        "seed=-1",
        # repeated settings: with another value refused, with the same one that value; a URL key beside the key
        # header is not read
        "output_format=pcm_16000&output_format=mp3_44100_128",
        "output_format=pcm_16000&output_format=pcm_16000",
        "seed=1&seed=2",
        "auto_mode=true&auto_mode=false",
        "zonos_params=%7B%7D",  # beside FAST_Q's
        "api_key=a&api_key=b",
        *URL_KEYS,
    ]
)


@FUZZ
@given(
    data=dialect_body(el_values, {"text": "Hello there."}),
    route=el_routes,
    query=el_queries,
    voice=st.sampled_from(["Ada", "Ada", "nobody", "%00", "x" * 300]),
    ctype=content_types,
)
@example(
    data=json.dumps({"text": "Hi.", "previous_request_ids": [KEPT_ID], "previous_text": "Hello."}).encode(),
    route="/stream/with-timestamps",
    query="",
    voice="Ada",
    ctype="application/json",
)
def test_fuzz_elevenlabs_http(dialect_fuzz_server, kept_id, data, route, query, voice, ctype):
    r = httpx.post(
        f"{dialect_fuzz_server.url}/v1/text-to-speech/{voice}{route}?{FAST_Q}&{query}",
        content=data.replace(json.dumps(KEPT_ID).encode(), json.dumps(kept_id).encode()),
        headers={"content-type": ctype, "xi-api-key": url_key_header(query)},
        timeout=60,
    )
    check_dialect(r, lambda b: b["detail"]["status"])
    if r.status_code == 200 and route.endswith("with-timestamps"):
        docs = [json.loads(x) for x in r.text.splitlines()] if route.startswith("/stream") else [r.json()]
        for d in docs:
            check_el_alignment(d)
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["request-id"]), r.headers  # every answer, errors too


def check_el_alignment(d: dict[str, Any]) -> None:
    """An ElevenLabs with-timestamps object: base64 audio, and alignments that are null or three arrays of one
    length, monotonic times in seconds."""
    assert set(d) == {"audio_base64", "alignment", "normalized_alignment"}, d
    base64.b64decode(d["audio_base64"], validate=True)
    assert d["alignment"] == d["normalized_alignment"]
    if d["alignment"] is not None:
        chars = d["alignment"]["characters"]
        starts, ends = d["alignment"]["character_start_times_seconds"], d["alignment"]["character_end_times_seconds"]
        assert len(chars) == len(starts) == len(ends) > 0 and all(isinstance(c, str) and len(c) == 1 for c in chars)
        assert starts == sorted(starts) and all(e >= a >= 0 for a, e in zip(starts, ends, strict=True)), d


@pytest.fixture(scope="module")
def kept_id(dialect_fuzz_server) -> str:
    """The request-id of a finished request of Ada: previous_request_ids that the server kept."""
    r = httpx.post(
        f"{dialect_fuzz_server.url}/v1/text-to-speech/Ada?{FAST_Q}",
        json={"text": "Hello there."},
        headers={"xi-api-key": DIALECT_KEY},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.headers["request-id"]


cartesia_format = st.fixed_dictionaries(
    {},
    optional={
        "container": st.sampled_from(["raw", "wav", "mp3", "ogg"]) | anything,
        "encoding": st.sampled_from(["pcm_s16le", "pcm_f32le", "pcm_mulaw", "pcm_alaw", "pcm_s24le"]) | anything,
        "sample_rate": st.sampled_from([8000, 16000, 22050, 24000, 44100, 48000, 11025, 0, -1, 24000.0, 24000.5])
        | anything,
        "bit_rate": st.integers(-1, 10**6) | st.sampled_from([128000.0, 0.5]) | extreme | anything,
    },
)
cartesia_values = {
    "transcript": short_text | anything,
    "model_id": anything,
    "language": st.sampled_from(["en", "xx"]) | anything,
    "voice": st.fixed_dictionaries(
        {},
        optional={
            "mode": st.sampled_from(["id", "embedding", "clone"]) | anything,
            "id": st.sampled_from(["Ada", "nobody"]) | anything,
            "embedding": st.lists(st.floats(allow_nan=True), max_size=4) | anything,
            "__experimental_controls": ca_voice_controls,
        },
    )
    | anything,
    "output_format": cartesia_format | anything,
    "generation_config": st.fixed_dictionaries(
        {},
        optional={
            "speed": st.floats(-1, 3) | anything,
            "volume": st.floats(0, 3) | extreme | anything,
            "emotion": st.sampled_from(["neutral", "angry"]) | anything,
        },
    )
    | anything,
    "speed": st.sampled_from(["slow", "normal", "fastest", "warp", 1.0]) | anything,
    "context_id": st.text(max_size=140) | anything,
    "add_timestamps": anything,
    "pronunciation_dict_id": st.sampled_from(["pd_0000000000000000", "x"]) | anything,
    "duration": st.sampled_from([5, 2.5, 0, -1, 1e6]) | extreme | anything,
    # documented and not used: Cartesia's types are checked (ca_unused)
    **ca_unused,
}
CARTESIA_VALID = {
    "transcript": "Hello there.",
    "voice": {"mode": "id", "id": "Ada"},
    "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000},
}


# repeated settings: zonos_params beside FAST_Q's (another value: refused; the same: that value); a URL key beside
# the key header is not read, a query naming the right key is sent without the header (url_key_header): twice
# with different values it is refused (401), with the same one that key
cartesia_queries = st.sampled_from(["", "", "zonos_params=%7B%7D", FAST_Q, "api_key=a&api_key=b", *URL_KEYS])


@FUZZ
@given(
    data=dialect_body(cartesia_values, CARTESIA_VALID),
    route=st.sampled_from(["/tts/bytes", "/tts/sse"]),
    ctype=content_types,
    query=cartesia_queries,
)
@example(
    data=json.dumps(CARTESIA_VALID | {"voice": {"mode": "embedding", "embedding": [1e39] * 2048}}).encode(),
    route="/tts/bytes",
    ctype="application/json",
    query="",
)
@example(data=json.dumps(CARTESIA_VALID).encode(), route="/tts/sse", ctype="application/json", query=URL_KEYS[0])
def test_fuzz_cartesia_http(dialect_fuzz_server, data, route, ctype, query):
    r = httpx.post(
        f"{dialect_fuzz_server.url}{route}?{FAST_Q}&{query}",
        content=data,
        timeout=60,
        headers={"content-type": ctype, "X-API-Key": url_key_header(query), "Cartesia-Version": "2025-04-16"},
    )
    check_dialect(r, lambda b: b["title"])


# (key, value) pairs: a key may come twice (with another value: refused, INVALID_QUERY_PARAMETER)
deepgram_query = st.lists(
    st.tuples(
        st.sampled_from(
            ["model", "encoding", "container", "sample_rate", "speed", "bit_rate", "callback", "mip_opt_out"]
        ),
        st.sampled_from(
            [
                "Ada",
                "nobody",
                "linear16",
                "mulaw",
                "alaw",
                "mp3",
                "opus",
                "flac",
                "aac",
                "wav",
                "none",
                "ogg",
                "8000",
                "22050",
                "48000",
                "1.1",
                "nan",
                "inf",
                "0_3",  # (float() read it as 3.0)
                "+1",
                " 1",
                "1e0",
                "１",
                "1e400",
                "9",
                "0.01",
                "-1",
                "²",
                "",
                "true",  # (mip_opt_out: a boolean, not used)
                "False",
                "yes",
            ]
        ),
    ),
    max_size=4,
)


# the key headers: a blank Authorization (a client's empty key) beside the key header hides it not; a wrong one does
deepgram_auth = st.sampled_from(
    [
        {"Authorization": f"Token {DIALECT_KEY}"},
        {"Authorization": f"Bearer {DIALECT_KEY}"},
        {"Authorization": "Token", "X-API-Key": DIALECT_KEY},
        {"Authorization": "Bearer", "xi-api-key": DIALECT_KEY},
        {"Authorization": "Bearer wrong", "X-API-Key": DIALECT_KEY},
        {"Authorization": "Token", "X-API-Key": ""},
    ]
)


@FUZZ
@given(
    data=dialect_body({"text": short_text | anything}, {"text": "Hello there."}),
    query=deepgram_query,
    ctype=content_types,
    auth=deepgram_auth,
)
def test_fuzz_deepgram_http(dialect_fuzz_server, data, query, ctype, auth):
    r = httpx.post(
        f"{dialect_fuzz_server.url}/v1/speak?{FAST_Q}",
        params=query,
        content=data,
        timeout=60,
        headers={"content-type": ctype, **auth},
    )
    check_dialect(r, lambda b: b["err_code"])


def test_dialect_server_healthy_after_fuzzing(dialect_fuzz_server):
    r = httpx.post(
        f"{dialect_fuzz_server.url}/v1/speak?{FAST_Q}&container=none",
        json={"text": "Still fine."},
        headers={"Authorization": f"Token {DIALECT_KEY}"},
        timeout=60,
    )
    assert r.status_code == 200 and len(r.content) == 2 * round(5 * 512 * 24000 / 44100)
    metrics = httpx.get(dialect_fuzz_server.url + "/metrics", headers={"X-API-Key": DIALECT_KEY}).text
    assert "zonos_engine_restarts 0.0" in metrics
    log = dialect_fuzz_server.log.read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]


# ---- continuation records between the gateway and the engine (issue 22) ------------------------------------
@pytest.fixture(scope="module")
def engine_client(aligner_checkpoint):
    from engine.contract.settings import EngineSettings, WeightSources
    from tests.asyncloop import running_engine

    settings = EngineSettings(device="cpu", max_batch=3, max_queue=4, max_context=512, stats_interval_s=0.1)
    with running_engine(settings, WeightSources(aligner_path=aligner_checkpoint)) as rt:
        yield rt


rid_values = st.integers(-3, 40) | st.integers(-(2**63), 2**63 - 1)
guidance = st.tuples(
    st.sampled_from([1.0, 2.0, -0.5]),
    st.sampled_from([1.0, 3.0]),
    st.booleans(),
    st.booleans(),
    st.sampled_from([1.0, 2.0]),
    st.sampled_from(["none", "delta", "wrong", "uncond"]),
)
# SubmitRequest.first_samples: none, what a client needs (44.1 kHz, 24 kHz, 8 kHz), its bounds and past them
first_samples_values = st.sampled_from(
    [None, 0, 1, 1701, 3525, -1, FIRST_SAMPLES_MAX, FIRST_SAMPLES_MAX + 1]
) | st.integers(-(2**63), 2**63 - 1)
continuation_op = st.one_of(
    # hold, continues (any rid: unknown, running, own), (cfg_scale, prefix_cfg_scale, a voice, a twin prompt,
    # emotion_cfg_scale, an emotion: a 'proj' delta of the right or a wrong size, or a raw/lda twin's voice),
    # first_samples
    st.tuples(st.just("submit"), st.booleans(), rid_values, guidance, first_samples_values),
    st.tuples(st.just("end"), rid_values),
    st.tuples(st.just("cancel"), rid_values),
    st.tuples(st.just("continue_last"), st.booleans()),  # a well-formed continuation of the last held request
)


@FUZZ_SMALL
@given(ops=st.lists(continuation_op, min_size=1, max_size=8))
def test_fuzz_continuation_records(engine_client, ops):
    """submit records with any hold/continues, guidance twins and first_samples, `end` and cancels of any rid,
    in any order: every request is answered (finished or error), the engine lives and is idle afterwards
    (every slot free: the twins' too)."""
    from engine.contract import records as m
    from engine.contract.records import SamplingParams
    from engine.frontend.config import Zonos2Config, preset_params
    from engine.frontend.prompt import Conditioning, PromptBuilder

    lt, client = engine_client
    pb = PromptBuilder(Zonos2Config.from_dict(preset_params("tiny")))

    async def go() -> list[m.Finished | m.Error]:
        streams, ends = [], []
        for op in ops:
            if op[0] in ("submit", "continue_last"):
                held = [s for s in streams if s.kept is not None]
                if op[0] == "continue_last":
                    hold, cont = op[1], held[-1].rid if held else 0
                    cfg, pcfg, voice, uncond, ecfg, emotion = 1.0, 1.0, False, False, 1.0, "none"
                    first = None
                else:
                    hold, cont, (cfg, pcfg, voice, uncond, ecfg, emotion), first = op[1:]
                cond = Conditioning(speaker=voice)
                req = m.SubmitRequest(
                    rid=0,
                    prompt=pb.build("Hi.", cond, non_final=hold),
                    params=SamplingParams(seed=1, cfg_scale=cfg, prefix_cfg_scale=pcfg, emotion_cfg_scale=ecfg),
                    max_frames=12,
                    ignore_eos=True,
                    hold=hold,
                    continues=cont,
                    speaker_embedding=np.ones(2048, np.float32) if voice else None,
                    uncond_prompt=pb.build("Hi!", cond) if uncond else None,
                    emotion_delta={
                        "delta": np.full(128, 0.5, np.float32),  # the tiny model's dim
                        "wrong": np.ones(7, np.float32),
                    }.get(emotion),
                    uncond_speaker=np.full(2048, 0.5, np.float32) if emotion == "uncond" else None,
                    first_samples=first,
                )
                streams.append(client.submit(req))
            elif op[0] == "end":
                client.end(op[1])
            else:
                client._inbox.try_put(*m.Cancel(op[1]).encode())
            await asyncio.sleep(0.01)
        for s in streams:  # an unended held request is flushed by the engine on its own
            s.end()
            async for ev in s:
                if ev.type in (m.FINISHED, m.ERROR):
                    ends.append(ev)
        for _ in range(400):
            if client.stats is not None and client.stats.active == 0 and client.stats.free_slots == 3:
                return ends
            await asyncio.sleep(0.05)
        raise AssertionError(f"the engine is not idle: {client.stats}")

    ends = lt.run(asyncio.wait_for(go(), 120), timeout=150)
    assert all(isinstance(e, m.Finished | m.Error) for e in ends)


# ---- align records (the aligner node, engine/aligner/) ----------------------------------------------------------
align_audio = st.tuples(
    st.integers(0, 3 * 44100),  # samples
    st.sampled_from(["noise", "silence", "full scale"]),
    st.integers(0, 2**32 - 1),
)


@FUZZ_SMALL
@given(
    calls=st.lists(
        st.tuples(
            align_audio,
            st.sampled_from([44100, 16000, 8000, 22050]) | st.integers(-10, 10**7),
            st.text(max_size=200) | st.sampled_from(["Hello there.", "42.", "", "a " * 400, "Ça va ? Très bien’s!"]),
        ),
        min_size=1,
        max_size=6,
    )
)
@example(calls=[((44100, "noise", 1), 44100, "Hello there, how are you?"), ((0, "silence", 0), 44100, "Hi.")])
@example(calls=[((601, "noise", 0), 0, "")])  # a bad rate is bad_request, not a full queue (engine_busy)
@example(calls=[((119345, "noise", 84), 22050, "A word, and Ze")])  # soxr's rounded-up length: no end past n / sr
def test_fuzz_align_records(engine_client, calls):
    """align records with any audio, sample rate and text, several at once (one batch): each is answered with
    every word of its text, in order, with times within its audio, or with bad_request, never internal; the
    engine lives."""
    from app.core.engine_client import EngineRefused
    from engine.contract.errors import EngineError

    lt, client = engine_client

    def pcm(n: int, kind: str, seed: int) -> np.ndarray:
        if kind == "silence":
            return np.zeros(n, np.int16)
        if kind == "full scale":
            return np.where(np.arange(n) % 2, 32767, -32768).astype(np.int16)
        return (np.random.default_rng(seed).standard_normal(n) * 3000).clip(-32768, 32767).astype(np.int16)

    async def go() -> list[Any]:
        return await asyncio.gather(
            *(client.align(pcm(*audio), sr, text, timeout=120) for audio, sr, text in calls), return_exceptions=True
        )

    answers = lt.run(asyncio.wait_for(go(), 150), timeout=160)
    for ((n, _, _), sr, text), got in zip(calls, answers, strict=True):
        if isinstance(got, EngineRefused):
            assert got.code == EngineError.BAD_REQUEST and str(got), got
            continue
        assert not isinstance(got, BaseException), got
        assert [w for w, _, _ in got] == text.split()
        assert all(0 <= s <= e <= n / sr + 1e-6 for _, s, e in got)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    body=st.fixed_dictionaries(
        {},
        optional={
            "name": st.text(max_size=120) | surrogates | anything,
            "rules": st.lists(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "type": st.sampled_from(["alias", "phoneme", "x"]) | anything,
                        "string_to_replace": st.text(max_size=300) | surrogates | anything,
                        "alias": st.text(max_size=300) | surrogates | anything,
                        "phoneme": anything,
                    },
                ),
                max_size=4,
            )
            | anything,
            "description": anything,
        },
    ),
    pls=st.binary(max_size=200)
    | st.sampled_from(
        [
            b"<lexicon/>",
            b"<lexicon><lexeme/></lexicon>",
            # an element inside an alias or a grapheme (refused: only its text before the element was read)
            b'<lexicon><lexeme><grapheme>a</grapheme><alias><break time="1s"/></alias></lexeme></lexicon>',
            b"<lexicon><lexeme><grapheme>a<b/>c</grapheme><alias>x<sub>y</sub>z</alias></lexeme></lexicon>",
        ]
    ),
)
@example(body={"description": float("inf"), "name": float("nan")}, pls=b"")
@example(body={"name": "d", "rules": [{"string_to_replace": "a\ud800", "alias": "b"}]}, pls=b"")
@example(
    body={"name": "d\udfff", "rules": [{"string_to_replace": "a", "alias": "b"}], "description": "\ud800"}, pls=b""
)
def test_fuzz_pronunciation_dictionaries(fuzz_server, body, pls):
    """Any rules body or lexicon file: a dictionary or a 4xx, never a 5xx."""
    r = httpx.post(  # json.dumps writes inf and nan as the non-JSON a client may send
        fuzz_server.url + "/v1/pronunciation-dictionaries/add-from-rules",
        content=json.dumps(body),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code in (200, 400, 413), r.text
    r = httpx.post(
        fuzz_server.url + "/v1/pronunciation-dictionaries/add-from-file",
        timeout=30,
        files={"file": ("x.pls", pls)},
        data={"name": "fuzz"},
    )
    assert r.status_code in (200, 400, 413), r.text
    for d in httpx.get(fuzz_server.url + "/v1/pronunciation-dictionaries").json()["pronunciation_dictionaries"]:
        httpx.delete(fuzz_server.url + f"/v1/pronunciation-dictionaries/{d['id']}")


# ---- the bound on request bodies read at once (app/io/bodies.py) -----------------------------------------------
# Each route that reads a JSON body, and how its API's error body names the code
BODY_ROUTES = {
    "/v1/audio/speech": lambda b: b["error"]["code"],
    "/tts/generate": lambda b: b["error"]["code"],
    "/tts/speakers": lambda b: b["error"]["code"] if b["detail"] == b["error"]["message"] else None,
    "/v1/voices/blend": lambda b: b["error"]["code"],
    "/v1/pronunciation-dictionaries/add-from-rules": lambda b: b["detail"]["status"],
    "/v1/text-to-speech/Fuzzed": lambda b: b["detail"]["status"],
    "/tts/bytes": lambda b: b["title"],
    "/v1/speak": lambda b: b["err_code"].lower(),
}


@pytest.fixture
def bound_held(fuzz_server):
    """An upload that holds nearly all of the process's bound (--max-body-bytes-in-flight, 64 MiB by default) while
    its body has not come: any other body over 64 KiB must be refused."""
    from app.settings import SMALL_BODY, Limits

    def held() -> float:
        text = httpx.get(fuzz_server.url + "/metrics", timeout=30).text
        return float(re.search(r"^zonos_request_body_bytes (\S+)$", text, re.M).group(1))

    size = Limits().max_body_bytes_in_flight - SMALL_BODY
    with socket.create_connection(("127.0.0.1", fuzz_server.port), timeout=30) as s:
        s.sendall(
            b"POST /v1/voices HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; boundary=b\r\n"
            b"Content-Length: %d\r\n\r\n--b\r\n" % size
        )
        for _ in range(600):
            if held() == size:
                break
            time.sleep(0.1)
        assert held() == size
        yield SMALL_BODY
    for _ in range(600):  # its client went: the share is given back
        if held() == 0:
            break
        time.sleep(0.1)
    assert held() == 0


@FUZZ_SMALL
@given(
    route=st.sampled_from(sorted(BODY_ROUTES)),
    size=st.integers(0, 150_000),
    as_json=st.booleans(),
    chunked=st.booleans(),
)
@example(route="/tts/speakers", size=70_000, as_json=True, chunked=False)
@example(route="/v1/speak", size=100_000, as_json=False, chunked=True)
def test_fuzz_bodies_past_the_bound(fuzz_server, bound_held, route, size, as_json, chunked):
    """While the bound is held: a body over 64 KiB (declared, or as it arrives) is refused with 503
    too_many_uploads, Retry-After and its API's error shape, or by the route's own smaller limit (413); a smaller
    body is answered as ever; never another 5xx, never a hang."""
    data = json.dumps({"text": "Hi.", "pad": "x" * size}).encode() if as_json else os.urandom(size)
    content: Any = iter([data[i : i + 40_000] for i in range(0, len(data), 40_000)]) if chunked else data
    headers = {"content-type": "application/json", "X-TTS-Session-ID": "fuzz"}
    r = httpx.post(fuzz_server.url + route, content=content, headers=headers, timeout=60)
    code = BODY_ROUTES[route](r.json()) if r.status_code >= 400 else None
    if r.status_code == 503:
        assert code == "too_many_uploads" and r.headers["retry-after"] == "1" and len(data) > bound_held, r.text
    else:
        assert r.status_code < 500 and code != "too_many_uploads", (r.status_code, r.text[:300])
        assert len(data) <= bound_held or r.status_code == 413, (len(data), r.status_code, r.text[:300])


def test_a_socket_clip_past_the_bound_is_a_coded_error_and_the_session_goes_on(fuzz_server, bound_held):
    """A `voice_clip` is decoded within the same bound: past it, `too_many_uploads` over the socket, the session's
    config unchanged, and the session goes on (a small clip is still decoded: these bytes are no audio)."""

    async def go() -> list[dict[str, Any]]:
        async with websockets.connect(fuzz_server.ws_url, max_size=None) as ws:
            got = [json.loads(await ws.recv())]
            for clip in ("A" * 100_000, "A" * 1000):
                await ws.send(json.dumps({"type": "session.config", "voice_clip": clip}))
                got.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
            await ws.send(json.dumps({"type": "close"}))
            got.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
            return got

    got = asyncio.run(go())
    assert [m["type"] for m in got] == ["session.created", "error", "error", "session.closed"], got
    assert got[1]["code"] == "too_many_uploads" and got[2]["code"] == "bad_audio", got


# ---- the bound on audio held by whole-file answers (app/doors/speech.py AnswerHold) ----------------------------
# a whole-file answer's body on each route that sends one, and how its error body names the code; each asks for a
# fixed length (the random tiny model may end a sentence at its first frame: a 200 with no audio)
_FIXED = {"seed": 3, "max_frames": 40, "ignore_eos": True}
WHOLE_ANSWERS = {
    "/v1/audio/speech": ({"input": "Hi.", "response_format": "wav", "params": _FIXED}, lambda b: b["error"]["code"]),
    "/v1/audio/speech ": ({"input": "Hi.", "response_format": "flac", "params": _FIXED}, lambda b: b["error"]["code"]),
    "/tts/generate": (
        {"text": "Hi.", "stream": False, "seed": 3, "max_tokens": 40, "ignore_eos": True},
        lambda b: b["error"]["code"],
    ),
}


def test_whole_answers_past_their_bound_are_refused_at_once_and_given_back(start_server):
    """While one whole-file answer (WAV, FLAC, /tts/generate stream:false) holds the process's bound
    (--max-whole-answer-bytes), another is refused before any engine work, 503 too_many_answers with Retry-After,
    in its API's error shape; a streamed answer is not counted; once the holder's client goes, its share is back
    and a whole answer is served again."""
    from app.doors.speech import ANSWER_FIRST_BYTES, ANSWER_RETRY_AFTER_S

    srv = start_server("--max-batch", "1", "--max-whole-answer-bytes", str(ANSWER_FIRST_BYTES * 3 // 2))

    def held() -> float:
        text = httpx.get(srv.url + "/metrics", timeout=30).text
        return float(re.search(r"^zonos_whole_answer_bytes (\S+)$", text, re.M).group(1))

    params = {"ignore_eos": True, "max_frames": 2500}
    long = json.dumps({"input": "Hold it.", "response_format": "wav", "params": params})
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:  # waits on its whole answer
        s.sendall(
            b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(long), long.encode())
        )
        deadline = time.monotonic() + 120
        while held() < ANSWER_FIRST_BYTES:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        for route, (body, code_of) in WHOLE_ANSWERS.items():
            r = httpx.post(srv.url + route.strip(), json=body, timeout=60)
            assert r.status_code == 503 and code_of(r.json()) == "too_many_answers", (route, r.status_code, r.text)
            assert r.headers["retry-after"] == str(ANSWER_RETRY_AFTER_S)
    deadline = time.monotonic() + 120
    while held():  # its client went: its answer is cancelled (client_gone) and its share given back
        assert time.monotonic() < deadline
        time.sleep(0.1)
    for route, (body, _) in WHOLE_ANSWERS.items():
        r = httpx.post(srv.url + route.strip(), json=body, timeout=120)
        assert r.status_code == 200 and len(r.content) > 1000, (route, r.status_code, r.text[:300])
    assert held() == 0


def test_a_whole_answer_gives_its_body_share_back_once_its_audio_begins(shared_server):
    """A /tts/generate stream:false body with a clip holds part of --max-body-bytes-in-flight while it is read and
    its clip embedded, not until its whole answer is sent (its audio's whole generation): once its audio is being
    generated, the bound is free for other uploads."""
    from app.doors.speech import ANSWER_FIRST_BYTES

    srv = shared_server(*ONE_SLOT)  # left as found: its request ends with its client

    def held() -> tuple[float, float]:
        text = httpx.get(srv.url + "/metrics", timeout=30).text
        body, whole = (
            float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))
            for name in ("zonos_request_body_bytes", "zonos_whole_answer_bytes")
        )
        return body, whole

    buf = io.BytesIO()
    sf.write(buf, (0.1 * np.sin(np.arange(88200) / 5)).astype(np.float32), 44100, format="WAV", subtype="PCM_16")
    clip = base64.b64encode(buf.getvalue()).decode()
    long = {"text": "Hold it.", "stream": False, "ignore_eos": True, "max_tokens": 2500, "speaker_audio_base64": clip}
    data = json.dumps(long).encode()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:  # waits on its whole answer
        s.sendall(
            b"POST /tts/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
        )
        deadline = time.monotonic() + 120
        while (h := held())[1] <= ANSWER_FIRST_BYTES:  # past its first audio: generating the rest
            assert time.monotonic() < deadline, h
            time.sleep(0.1)
        assert h[0] == 0, h
    deadline = time.monotonic() + 120
    while held() != (0, 0):
        assert time.monotonic() < deadline
        time.sleep(0.1)
