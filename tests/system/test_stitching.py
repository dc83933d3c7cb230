"""ElevenLabs request stitching through a real gateway (CPU, tiny model): `request-id` on every answer, and a
request naming an earlier one with `previous_request_ids` is submitted to the engine as the continuation of
that request's kept frames (its prompt, as the engine counted it, grows by exactly the earlier text and
frames); refusals name the id (the store's bounds: tests/unit/test_stitching.py; another gateway process:
tests/system/test_workers.py)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from urllib.parse import quote

import httpx
import numpy as np
import pytest

from engine.frontend.longform import BOUNDARY_TRIM
from engine.frontend.prompt import SILENCE_FRAMES

pytestmark = pytest.mark.slow

KEYS = ("stitch-key-1", "stitch-key-2")
REQUEST_ID = re.compile(r"[0-9a-f]{32}")
A_TEXT, B_TEXT = "Hello there.", "How are you?"
A_FRAMES = 12


def engine_requests(log: Path, since: int) -> list[tuple[int, int]]:
    """(prompt frames, frames) of every request the engine finished after byte `since` of the server's log,
    as the engine counted them (its `rid N done:` line)."""
    with log.open("rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    return [(int(p), int(n)) for p, n in re.findall(r"done: RequestStats\(.*?prompt_frames=(\d+), frames=(\d+)", text)]


def upload_voice(url: str, key: str, seed: int) -> str:
    emb = io.BytesIO()
    np.save(emb, np.random.default_rng(seed).standard_normal(2048).astype(np.float32))
    r = httpx.post(
        url + "/v1/voices",
        headers={"xi-api-key": key},
        files={"embedding": ("v.npy", emb.getvalue())},
        data={"name": f"V{seed}"},
        timeout=60,
    )
    assert r.status_code in (200, 201), r.text
    return r.json()["id"]


def tts(url: str, key: str, voice: str, text: str, frames: int, **body) -> httpx.Response:
    """One ElevenLabs text-to-speech request of exactly `frames` frames (no end of audio)."""
    q = quote(json.dumps({"max_frames": frames, "ignore_eos": True, "seed": 3}))
    return httpx.post(
        f"{url}/v1/text-to-speech/{voice}?output_format=pcm_16000&zonos_params={q}",
        headers={"xi-api-key": key},
        json={"text": text, **body},
        timeout=120,
    )


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(*(a for k in KEYS for a in ("--api-key", k)))


@pytest.fixture(scope="module")
def voices(server) -> tuple[str, str, str]:
    return (
        upload_voice(server.url, KEYS[0], 1),
        upload_voice(server.url, KEYS[0], 2),
        upload_voice(server.url, KEYS[1], 1),
    )


def test_a_request_continues_the_kept_frames_of_the_requests_it_names(server, voices):
    voice = voices[0]
    since = server.log.stat().st_size
    a = tts(server.url, KEYS[0], voice, A_TEXT, A_FRAMES)
    assert a.status_code == 200 and a.content, a.text
    a_id = a.headers["request-id"]
    assert REQUEST_ID.fullmatch(a_id) and a.headers["x-request-id"] != a_id  # ours is unchanged
    plain = tts(server.url, KEYS[0], voice, B_TEXT, 6)
    b = tts(server.url, KEYS[0], voice, B_TEXT, 7, previous_request_ids=[a_id])
    assert plain.status_code == b.status_code == 200, b.text
    assert b.headers["request-id"] not in (a_id, plain.headers["request-id"])  # a fresh id per request
    # a third continues the second, which continued the first: the first stays pinned in front (as in a context)
    c = tts(server.url, KEYS[0], voice, B_TEXT, 8, previous_request_ids=[a_id, b.headers["request-id"]])
    # previous_text alone is not used (no frames of it exist: the model would speak it)
    text_only = tts(server.url, KEYS[0], voice, B_TEXT, 9, previous_text=A_TEXT)
    assert c.status_code == text_only.status_code == 200, (c.text, text_only.text)
    prompts = dict((n, p) for p, n in engine_requests(server.log, since))
    fresh = prompts[6]
    silence = len(SILENCE_FRAMES)
    assert prompts[7] == fresh - silence + len(A_TEXT) + 1 + A_FRAMES  # A's text and frames teacher-forced
    assert prompts[8] == fresh - silence + len(A_TEXT) + 1 + len(B_TEXT) + 1 + A_FRAMES + 7
    assert prompts[9] == fresh


def test_ids_that_are_not_this_keys_voices_finished_requests_are_refused_by_name(server, voices):
    mine, other_voice, theirs = voices
    a = tts(server.url, KEYS[0], mine, A_TEXT, 5)
    assert a.status_code == 200
    a_id = a.headers["request-id"]
    unknown = "0" * 32
    for key, voice, ids, named in (
        (KEYS[1], theirs, [a_id], a_id),  # another key's request
        (KEYS[0], mine, [unknown], unknown),
        (KEYS[0], mine, [a_id, "not-an-id"], "not-an-id"),
        (KEYS[0], other_voice, [a_id], a_id),  # another voice
    ):
        r = tts(server.url, key, voice, B_TEXT, 5, previous_request_ids=ids)
        assert r.status_code == 400, r.text
        detail = r.json()["detail"]
        assert detail["status"] == "bad_params" and named in detail["message"], detail
        assert REQUEST_ID.fullmatch(r.headers["request-id"])  # on an error too
    for ids in ([a_id] * 4, a_id, [1], ["x" * 129]):
        r = tts(server.url, KEYS[0], mine, B_TEXT, 5, previous_request_ids=ids)
        assert r.status_code == 400 and "previous_request_ids" in r.json()["detail"]["message"], r.text
    r = tts(server.url, KEYS[0], mine, B_TEXT, 5, next_request_ids=[unknown], next_text="Later.")
    assert r.status_code == 200  # accepted, not used
    r = tts(server.url, KEYS[0], mine, B_TEXT, 5, next_request_ids=[a_id] * 4)
    assert r.status_code == 400


def test_a_request_cut_off_keeps_nothing(server, voices):
    """ElevenLabs: an id can be continued once its audio was read to the end."""
    voice = voices[0]
    q = quote(json.dumps({"max_frames": 400, "ignore_eos": True}))
    with httpx.stream(
        "POST",
        f"{server.url}/v1/text-to-speech/{voice}/stream?output_format=pcm_16000&zonos_params={q}",
        headers={"xi-api-key": KEYS[0]},
        json={"text": A_TEXT},
        timeout=120,
    ) as r:
        assert r.status_code == 200
        cut = r.headers["request-id"]
        next(r.iter_bytes())
    r = tts(server.url, KEYS[0], voice, B_TEXT, 5, previous_request_ids=[cut])
    assert r.status_code == 400 and cut in r.text


def test_a_request_ending_in_a_sentence_its_rules_leave_empty_can_be_continued(server, voices):
    """A last sentence its pronunciation rules leave with nothing to say ("Um" read as "") is passed over as a break
    is: the request ends in the state of the sentence before it, which a later request continues (the chain ended at
    the empty sentence, so the request kept no state: its id was refused as unknown)."""
    voice = voices[0]
    made = httpx.post(
        server.url + "/v1/pronunciation-dictionaries/add-from-rules",
        headers={"xi-api-key": KEYS[0]},
        json={"name": "fillers", "rules": [{"type": "alias", "string_to_replace": "Um", "alias": ""}]},
        timeout=60,
    )
    assert made.status_code == 200, made.text
    locators = [{"pronunciation_dictionary_id": made.json()["id"]}]
    since = server.log.stat().st_size
    a = tts(server.url, KEYS[0], voice, A_TEXT + "\nUm", 13, pronunciation_dictionary_locators=locators)
    assert a.status_code == 200 and a.content, a.text
    fresh = tts(server.url, KEYS[0], voice, B_TEXT, 10)
    b = tts(server.url, KEYS[0], voice, B_TEXT, 11, previous_request_ids=[a.headers["request-id"]])
    assert fresh.status_code == b.status_code == 200, b.text
    prompts = dict((n, p) for p, n in engine_requests(server.log, since))
    # A's text and kept frames teacher-forced (held for the empty sentence: its last BOUNDARY_TRIM frames not kept)
    assert prompts[11] == prompts[10] - len(SILENCE_FRAMES) + len(A_TEXT) + 1 + 13 - BOUNDARY_TRIM
