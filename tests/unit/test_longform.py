"""Long-form continuation (engine/frontend/longform.py, PromptBuilder.build_continuation) against hand-worked values
of the reference's semantics (`prefix-cfg-longform`: tts/longform.py, tokenizer/server.py's window state and
the speaker frames its scheduler adds) and the expectations of its tests/misc/test_tts_longform.py."""

from __future__ import annotations

import numpy as np
import pytest

from engine.frontend.config import Zonos2Config, preset_params
from engine.frontend.longform import (
    BOUNDARY_TRIM,
    Continuation,
    LongFormOptions,
    context_chunks,
    split_sentences,
    split_text,
    split_words,
    trim_chunk_codes,
    windowed_context_indices,
)
from engine.frontend.prompt import SILENCE_FRAMES, Conditioning, PromptBuilder, PromptError, shear

CFG = Zonos2Config.from_dict(preset_params("full"))
PB = PromptBuilder(CFG)
PAD, TPAD = 1025, 519
SLOT, NOISY, CLEAN, ACCURATE, TRAIL3 = 519, 517, 516, 518, 511  # release ids (tests/unit/test_prompt.py)
RATE0 = 448  # first speaking-rate bucket id: 448 byte ids come first


def text_ids(s: str) -> list[int]:
    return [2, *(b + 192 for b in s.encode()), 3]


# ---- chunking -----------------------------------------------------------------------------------------------
def test_word_split_packs_greedily_and_keeps_words():
    text = "one two three four five six seven eight nine ten eleven twelve"
    chunks = split_words(text, 20)
    assert chunks == ["one two three four", "five six seven eight", "nine ten eleven", "twelve"]
    assert " ".join(chunks) == text
    assert split_words("hi " + "a" * 50 + " bye", 10) == ["hi", "a" * 50, "bye"]  # an oversized word alone
    assert split_words("hello   world\n", 150) == ["hello world"]


def test_sentence_split_keeps_sentences_whole():
    text = "First short one. Second short one. Third short one. Fourth one here."
    assert split_sentences(text, 40) == ["First short one. Second short one.", "Third short one. Fourth one here."]
    assert split_sentences("A b. C d. E f.", 40) == ["A b. C d. E f."]
    # closing quotes stay with their sentence (the reference's re.split drops them: a deliberate difference);
    # CJK enders split without a space
    assert split_sentences('He said "go." Then left.', 13) == ['He said "go."', "Then left."]
    assert split_sentences("(Yes.) No.", 6) == ["(Yes.)", "No."]
    assert split_sentences("你好。再见！", 3) == ["你好。", "再见！"]
    # a sentence longer than a chunk falls back to words, after flushing what was packed
    long = " ".join(["word"] * 12)  # 59 characters
    assert split_sentences(f"Hi. {long}. Bye.", 20) == ["Hi.", *split_words(long + ".", 20), "Bye."]


def test_split_dispatch():
    text = "Alpha beta. Gamma delta."
    assert split_text(text, 12, "word") == ["Alpha beta.", "Gamma delta."]
    assert split_text(text, 40, "sentence") == [text]
    with pytest.raises(ValueError):
        split_text(text, 40, "paragraph")
    with pytest.raises(ValueError):
        split_words(text, 0)


def test_long_form_auto_and_forced():
    short, long = "Short text.", " ".join(["word"] * 40)  # 199 characters
    assert LongFormOptions().chunks(short) == [short]
    assert LongFormOptions().chunks(long) == split_words(long, 150) and len(split_words(long, 150)) == 2
    assert LongFormOptions(long_form=False).chunks(long) == [long]
    assert LongFormOptions(long_form=True, chunk_chars=5).chunks("ab cd ef") == ["ab cd", "ef"]
    assert LongFormOptions(long_form=True).chunks(short) == [short]  # one chunk: an ordinary request


@pytest.mark.parametrize(
    "field,value",
    [
        ("chunk_chars", 0),
        ("chunk_chars", 1.5),
        ("chunk_chars", True),
        ("window_chunks", 0),
        ("window_chunks", 65),
        ("split_mode", "para"),
        ("long_form", "yes"),
        ("pin_anchor", None),
    ],
)
def test_long_form_options_refuse(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        LongFormOptions(**{field: value}).validate()


# ---- windows and trimming -----------------------------------------------------------------------------------
def test_context_chunks():
    assert [context_chunks(w) for w in (1, 2, 3, 4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        context_chunks(0)


def test_trim():
    frames = np.array([[i] * 9 for i in range(10)])
    assert trim_chunk_codes(frames, 8, drop_trailing_frames=2).tolist() == [[i] * 9 for i in range(6)]
    assert trim_chunk_codes(frames, None).tolist() == frames.tolist()  # ended at max_frames: all kept
    assert trim_chunk_codes(frames, None, BOUNDARY_TRIM).tolist() == frames[:7].tolist()
    assert len(trim_chunk_codes(frames, 2, drop_trailing_frames=3)) == 0  # never negative
    assert len(trim_chunk_codes(frames, 50)) == 10  # an eos past the end keeps everything
    assert BOUNDARY_TRIM == 3


def test_window_indices():
    assert windowed_context_indices(0, 1, True) == []
    assert windowed_context_indices(1, 1, True) == [0] and windowed_context_indices(1, 1, False) == [0]
    assert windowed_context_indices(5, 1, True) == [0, 4] and windowed_context_indices(5, 1, False) == [4]
    assert [windowed_context_indices(i, 2, True) for i in (2, 3, 4)] == [[0, 1], [0, 1, 2], [0, 2, 3]]
    assert windowed_context_indices(3, 0, True) == [0] and windowed_context_indices(3, 0, False) == []
    for cur in range(1, 8):
        for ctx in (1, 2, 3):
            idx = windowed_context_indices(cur, ctx, True)
            assert idx[-1] == cur - 1 and idx == sorted(set(idx))  # ends at the previous chunk, no repeats


@pytest.mark.parametrize("window", [1, 2, 3, 4])
@pytest.mark.parametrize("pin", [True, False])
def test_continuation_state_is_the_window(window, pin):
    """The state kept between chunks gives chunk i exactly the chunks windowed_context_indices names."""
    texts = [f"chunk {i}." for i in range(7)]
    kept = [np.full((3 + i, 9), 10 * i) for i in range(7)]
    state = Continuation(window_chunks=window, pin_anchor=pin)
    for i in range(7):
        idx = windowed_context_indices(i, window - 1, pin)
        text, codes = state.window()
        assert text == " ".join(texts[j] for j in idx)
        assert codes.shape == (sum(len(kept[j]) for j in idx), 9)
        if idx:
            assert np.array_equal(codes, np.concatenate([kept[j] for j in idx]))
        state.add(texts[i], kept[i])


# ---- prompt layout ------------------------------------------------------------------------------------------
def test_continuation_prompt_hand_worked():
    codes = np.array([[5] * 9, [6] * 8 + [1025]])
    cond = Conditioning(speaker=True, speaking_rate_bucket=3)
    ids = PB.build_continuation("Hi.", "Yo", codes, cond, non_final=True)
    head = [SLOT, NOISY, ACCURATE, RATE0 + 3, *text_ids("Hi. Yo")]
    assert ids[:, 9].tolist() == [*head, TPAD, TPAD]  # non-final: no trailing-silence token
    assert (ids[: len(head), :9] == PAD).all()
    assert np.array_equal(ids[len(head) :, :9], codes)  # the frames as they are (delayed), no silence
    final = PB.build_continuation("Hi.", "Yo", codes, cond)
    assert final[:, 9].tolist() == [SLOT, NOISY, ACCURATE, RATE0 + 3, TRAIL3, *text_ids("Hi. Yo"), TPAD, TPAD]
    # no speaker: the reference's scheduler adds no frames; clean/expressive markers as in a fresh prompt
    assert PB.build_continuation("a b", "c", codes)[:, 9].tolist() == [TRAIL3, *text_ids("a b c"), TPAD, TPAD]
    ids = PB.build_continuation(
        "a",
        "b",
        codes,
        Conditioning(speaker=True, clean_speaker_background=True, accurate_mode=False, quality_buckets=None),
    )
    assert ids[:, 9].tolist()[:3] == [SLOT, CLEAN, *text_ids("a b")[:1]]


def test_continuation_prompt_reference_shapes():
    """tests/misc/test_tts_longform.py: text rows + one row per frame; codes in the codebook columns and
    the text pad in the text column; the speaker slot first; no frames: a fresh prompt."""
    prev = np.full((4, 9), 7)
    ids = PB.build_continuation("hello world", "today", prev, Conditioning(quality_buckets=None))
    assert ids.shape == (len(text_ids("hello world today")) + 4, 10)
    assert (ids[-4:, :9] == 7).all() and (ids[-4:, 9] == TPAD).all()
    spk = PB.build_continuation("a b", "c", prev[:2], Conditioning(speaker=True, quality_buckets=None))
    assert spk[0].tolist() == [PAD] * 9 + [SLOT]
    fresh = PB.build_continuation("a b", "c", np.zeros((0, 9), np.int64), Conditioning())
    assert np.array_equal(fresh, PB.build("c", Conditioning()))


def test_non_final_fresh_chunk():
    """The first chunk of a long-form request starts fresh (silence lead-in) without trailing silence."""
    ids = PB.build("First.", Conditioning(quality_buckets={"trailing_silence_s": 3, "lufs": 11}), non_final=True)
    assert ids[:, 9].tolist()[:2] == [467, 2]  # lufs kept, trailing silence gone
    assert np.array_equal(ids[-17:, :9], shear(SILENCE_FRAMES, PAD))
    values = Conditioning(quality_buckets=None, quality_values={"trailing_silence_s": 0.5})
    assert PB.build("x", values, non_final=True)[:, 9].tolist()[0] == 2


def test_non_final_without_the_feature_drops_all_quality():
    params = preset_params("full")
    params["quality_features"] = ["lufs"]
    params["quality_buckets"] = {"lufs": params["quality_buckets"]["lufs"]}
    params["quality_num_buckets"] = len(params["quality_buckets"]["lufs"])
    params["text_vocab"] -= 60 - params["quality_num_buckets"]
    pb = PromptBuilder(Zonos2Config.from_dict(params))
    cond = Conditioning(quality_buckets={"lufs": 2})
    assert pb.build("x", cond)[:, 9].tolist()[0] != 2
    assert pb.build("x", cond, non_final=True)[:, 9].tolist()[0] == 2


@pytest.mark.parametrize(
    "frames", [np.zeros((3, 8), np.int64), np.full((2, 9), 1026), np.full((2, 9), -1), np.zeros((2, 3, 9), np.int64)]
)
def test_continuation_refuses_bad_frames(frames):
    with pytest.raises(PromptError):
        PB.build_continuation("a", "b", frames)


# ---- the request fields ---------------------------------------------------------------------------------------
def test_parse_options_carries_the_fields():
    from app.core.options import SynthesisOptions, parse_options

    opts = parse_options(
        {
            "long_form": True,
            "long_form_chunk_chars": 80,
            "long_form_window_chunks": 3,
            "long_form_pin_anchor": False,
            "long_form_split_mode": "sentence",
            "cfg_scale": 2.0,
            "prefix_cfg_scale": -0.5,
            "emotion_cfg_scale": 1.5,
        },
        100,
    )
    assert opts.long_form == LongFormOptions(True, 80, 3, False, "sentence")
    s = opts.sampling
    assert (s.cfg_scale, s.prefix_cfg_scale, s.emotion_cfg_scale) == (2.0, -0.5, 1.5)
    # a later params dict changes only what it names; null resets to the default (long_form: auto)
    again = parse_options({"long_form_chunk_chars": None, "long_form": None, "cfg_scale": 1.0}, 100, opts)
    assert again.long_form == LongFormOptions(None, 150, 3, False, "sentence")
    assert (again.sampling.cfg_scale, again.sampling.prefix_cfg_scale) == (1.0, -0.5)
    assert opts.sampling.cfg_scale == 2.0 and opts.long_form.chunk_chars == 80  # the base is untouched
    assert SynthesisOptions().long_form == LongFormOptions() and SynthesisOptions().sampling.cfg_scale == 1.0
    # and they reach the engine's request
    from app.core.prompts import PromptFactory
    from engine.frontend.config import Zonos2Config, preset_params

    req = PromptFactory(Zonos2Config.from_dict(preset_params("tiny"))).request(np.zeros((2, 10)), opts, 9)
    assert req.params.prefix_cfg_scale == -0.5


@pytest.mark.parametrize(
    "body",
    [
        {"long_form": "auto"},
        {"long_form_chunk_chars": 0},
        {"long_form_chunk_chars": 2.5},
        {"long_form_window_chunks": 0},
        {"long_form_pin_anchor": 1},
        {"long_form_split_mode": "paragraph"},
        {"cfg_scale": "2"},
        {"prefix_cfg_scale": 1e300},
        {"emotion_cfg_scale": True},
    ],
)
def test_http_routes_refuse_bad_fields(server, body):
    import httpx

    for route, base in (("/tts/generate", {"text": "x", "stream": False}), ("/v1/audio/speech", {"input": "x"})):
        r = httpx.post(server.url + route, json=base | body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_params", (route, r.text)
        assert next(iter(body)) in r.json()["error"]["message"]


def test_http_routes_accept_the_fields(server):
    import httpx

    fields = {
        "long_form": None,
        "long_form_chunk_chars": 40,
        "long_form_window_chunks": 3,
        "long_form_pin_anchor": False,
        "long_form_split_mode": "sentence",
        "cfg_scale": 1.0,
        "prefix_cfg_scale": 1.0,
    }
    r = httpx.post(
        server.url + "/tts/generate",
        timeout=120,
        json={"text": "Hello.", "max_tokens": 5, "ignore_eos": True, "stream": False} | fields,
    )
    assert r.status_code == 200 and len(r.content) == 5 * 512 * 4, r.text
    r = httpx.post(
        server.url + "/v1/audio/speech",
        timeout=120,
        json={"input": "Hello.", "response_format": "pcm", "params": {"max_frames": 5, "ignore_eos": True}} | fields,
    )
    assert r.status_code == 200, r.text
