"""Inline style tags (app/core/style_tags.py) and how the pipeline queues the text around them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from app.core.breaks import split_breaks
from app.core.emotion import check_emotion
from app.core.options import SynthesisOptions
from app.core.pipeline import UtterancePipeline, speak
from app.core.style_tags import StyleTag, split_tags, styled_options
from app.core.tag_vocabulary import NEUTRAL, TAG_WORDS
from app.core.text_buffer import TextBuffer, broken_tag_start, unfinished_tag_start
from app.io.errors import RequestError
from app.settings import Limits
from app.voices.library import Voice
from engine.frontend.emotion import EmotionDirections
from tests.unit.test_pipeline import FakeEngine, fake_gateway, open_session, refused_then_spoken, shut


def tags(parts: list) -> list:
    return [p.name if isinstance(p, StyleTag) else p for p in parts]


async def played_until_flushed(ws, engine) -> list:
    """The socket's messages up to its `flushed`, each utterance it starts played (how many: the segmenter's)."""

    async def play_all() -> None:
        for n in range(1, 10):
            FakeEngine.play(await engine.started(n))

    player = asyncio.create_task(play_all())
    try:
        return await ws.until("flushed")
    finally:
        player.cancel()


def test_tags_split_the_text():
    assert split_tags("No tags.") == ["No tags."]
    assert split_tags("  ") == ["  "]  # a text without tags is as it was
    assert tags(split_tags("[happy] Hello there.")) == ["happy", "Hello there."]
    assert tags(split_tags("Well, [ SAD ]I lost.")) == ["Well,", "sad", "I lost."]
    assert tags(split_tags("<emotion value=\"angry\"/>Stop. <Emotion value='calm' /> Sit.")) == [
        "angry",
        "Stop.",
        "calm",
        "Sit.",
    ]
    assert tags(split_tags("<emotion value=excited>Yes!</emotion> No.")) == ["excited", "Yes!", NEUTRAL, "No."]
    assert tags(split_tags("Ends [whispering]")) == ["Ends", "whispering"]
    assert tags(split_tags('<emotion value="[happy]"/> x')) == ["[happy]", "x"]  # one tag, not two


@pytest.mark.parametrize("text", ["See [1] and [citation needed].", "[smug] grin", "[] [ ] [happy-go-lucky]", "a[b]c"])
def test_brackets_outside_the_table_are_text(text):
    assert split_tags(text) == [text]
    assert "smug" not in TAG_WORDS


@pytest.mark.parametrize(
    "tag",
    [
        "<emotion/>",
        '<emotion value=""/>',
        "<emotion intensity='high'/>",
        '<emotion title="value=sad"/>',  # a quoted value is no attribute
        "<emotion value='happy' loud/>",  # attributes that are none (app/core/tag_vocabulary.py `attributes`)
        '<emotion value="happy"intensity="high"/>',
    ],
)
def test_an_emotion_tag_without_a_value_is_refused(tag):
    with pytest.raises(RequestError) as e:
        split_tags(f"Before {tag} after.")
    assert e.value.code == "bad_text"


def test_a_text_holds_a_bounded_number_of_tags():
    with pytest.raises(RequestError) as e:
        split_tags("[happy] a " * 17)
    assert e.value.code == "bad_text"
    assert len(split_tags("[happy] a " * 16)) == 32


def directions(named: tuple[str, ...] = ("happy",), axes: bool = True) -> EmotionDirections:
    rng = np.random.default_rng(0)
    vec = lambda: rng.standard_normal(8).astype(np.float32)  # noqa: E731
    return EmotionDirections(
        dim=8,
        named={n: vec() for n in named},
        axes={a: vec() for a in ("valence", "arousal")} if axes else {},
    )


def test_a_tag_maps_onto_a_named_direction_or_the_axes():
    base = SynthesisOptions()
    base.emotion.strength = 2.0
    happy = styled_options(StyleTag("happy", "[happy]"), base, directions(), True)
    assert happy.emotion.enabled and happy.emotion.sliders == {"happy": 1.0} and happy.emotion.strength == 2.0
    sad = styled_options(StyleTag("sad", "[sad]"), base, directions(), True)
    assert sad.emotion.sliders == {} and sad.emotion.valence < 0 and sad.emotion.arousal < 0
    assert not base.emotion.enabled and base.emotion.sliders == {}  # the request's own options are untouched
    assert styled_options(StyleTag(NEUTRAL, "[neutral]"), base, directions(), True) is base


@pytest.mark.parametrize(
    ("tag", "folder", "speaker", "says"),
    [
        ("happy", None, True, "--emotion-directions-dir"),
        ("sad", directions(axes=False), True, "no emotion 'sad'"),
        ("smug", directions(), True, "no emotion 'smug'"),
        ("whispering", directions(), True, "no control"),
        ("happy", directions(), False, "has none"),
    ],
)
def test_a_tag_that_cannot_be_applied_is_refused(tag, folder, speaker, says):
    with pytest.raises(RequestError) as e:
        styled_options(StyleTag(tag, f"[{tag}]"), SynthesisOptions(), folder, speaker)
    assert e.value.code == "unsupported_tag" and e.value.status == 400 and says in str(e.value), str(e.value)


def voice() -> Voice:
    return Voice(id="v", name="v", owner="", source="embedding", dim=8, embedding=np.ones(8, np.float32))


def pipeline(folder: EmotionDirections | None) -> UtterancePipeline:
    gw = fake_gateway()
    gw.prompts = SimpleNamespace(emotion=folder)
    gw.check_emotion = lambda opts, voice, clip=False: check_emotion(folder, opts, voice, None, clip)
    return UtterancePipeline(gw, "test")  # type: ignore[arg-type]


def test_a_tag_styles_the_text_after_it_across_sentences_and_texts_until_the_turn_ends():
    """The text around a tag is spoken without it, in one continuation chain; the tag holds across sentences
    and later texts of the turn, a cancel or the end of the turn ends it."""

    async def go():
        pipe = pipeline(directions())
        opts = SynthesisOptions()
        added = pipe.add(["Hello there [happy] how are you?", "Fine."], opts, voice(), None, "c")
        added += pipe.add(["And you? [neutral] Good."], opts, voice(), None, "c")
        added += pipe.add(["[sad] Bye."], opts, voice(), None, "c")
        pipe.end("c")
        added += pipe.add(["Next turn."], opts, voice(), None, "c")
        pipe.close()
        return added

    added = asyncio.run(go())
    texts = ["Hello there", "how are you?", "Fine.", "And you?", "Good.", "Bye.", "Next turn."]
    assert [u.text for u in added] == texts
    sliders = [u.opts.emotion.sliders if u.opts.emotion.enabled else None for u in added]
    assert sliders[:5] == [None, {"happy": 1.0}, {"happy": 1.0}, {"happy": 1.0}, None]
    assert added[5].opts.emotion.valence < 0 and sliders[6] is None
    chain = added[0].chain
    assert chain is not None and all(u.chain is chain for u in added[:5])  # one voice across the tag


def test_a_refused_tag_queues_nothing_and_keeps_the_style():
    async def go():
        pipe = pipeline(None)
        with pytest.raises(RequestError) as e:
            pipe.add(["Fine so far.", "[happy] Then a tag."], SynthesisOptions(), voice(), None)
        assert e.value.code == "unsupported_tag"
        assert len(pipe) == 0 and pipe.styles == {}
        assert [u.text for u in pipe.add(["[1] is text."], SynthesisOptions(), voice(), None)] == ["[1] is text."]
        pipe.close()

    asyncio.run(go())


def test_a_message_with_a_refused_tag_is_refused_whole_on_the_socket():
    """The sentences before a refused tag in the same message are not spoken: a message's tags are checked when
    it arrives, before the buffer hands out any sentence of it; the socket goes on."""

    sent = [{"text": "Quiet now. [whispering] Sleep.", "flush": True}]
    err, seen, texts = refused_then_spoken(sent, "Fine [1].", emotions=False)
    assert err["type"] == "error" and err["code"] == "unsupported_tag", err
    assert texts == ["Fine [1]."] and [m["text"] for m in seen if m["type"] == "audio.start"] == ["Fine [1]."]


def test_a_tag_split_across_messages_is_refused_once_and_the_socket_goes_on():
    """Each half of a tag passes its own message's check; the sentence they make is refused when it is spoken
    (the flush), and then that sentence is gone: the next text is spoken and a close closes."""

    async def go():
        session, ws, engine, task = await open_session()
        session.gw.prompts = SimpleNamespace(emotion=None)
        ws.send(type="text", text="Hi [hap")
        ws.send(type="text", text="py] there.")
        ws.send(type="flush")
        err = await ws.next_json()
        ws.send(type="text", text="Fine.", flush=True)
        FakeEngine.play(await engine.started(1))
        seen = await ws.until("flushed")
        ws.send(type="text", text="And <emotion value=")
        ws.send(type="text", text="'happy'/> bye.")
        ws.send(type="close")
        closing = await ws.until("session.closed")
        await shut(ws, task)
        return err, seen, closing, engine.texts

    err, seen, closing, texts = asyncio.run(go())
    assert err["type"] == "error" and err["code"] == "unsupported_tag", err
    assert texts == ["Fine."] and [m["text"] for m in seen if m["type"] == "audio.start"] == ["Fine."]
    assert [m["code"] for m in closing if m["type"] == "error"] == ["unsupported_tag"], closing


@pytest.mark.parametrize("cut", ["<", "<emo", "< /", "<SPE", "<br", "<pros", "<say", "<emph", "<su"])
def test_a_tag_cut_inside_its_name_is_dropped_with_the_message_that_completes_it(cut):
    """A tag whose first message ends inside the element's name (`Hi <emo`, then `tion value=...`): the message
    that completes it is refused, and the half before it goes with it; it was kept and read aloud ("Hi <emo") by
    the next flush, as no pattern of a whole element name saw it as a tag's start."""
    rest = {"<": 'emotion value="happy"/>', "<emo": 'tion value="happy"/>', "< /": "speed>", "<SPE": 'ED ratio="2"/>'}
    # SSML's (the hostile pass: the session's list of element names lacked them, and "Hi <pros" was read aloud)
    rest |= {"<pros": 'ody rate="slow">', "<say": '-as interpret-as="date">1/2</say-as>', "<emph": "asis>"}
    rest |= {"<su": 'b alias="">x</sub>'}
    completes = rest.get(cut, 'eak time="soon"/>')

    sent = [{"text": f"Hi {cut}"}, {"text": f"{completes} there. And on"}]
    err, seen, texts = refused_then_spoken(sent, " we go.", emotions=False)
    assert err["type"] == "error" and err["code"] in ("unsupported_tag", "bad_text"), err
    assert texts == ["we go."] and [m["text"] for m in seen if m["type"] == "audio.start"] == ["we go."]


@pytest.mark.parametrize("halves", [("Hi <emo", 'tion value="happy"/> there. And'), ("Hi [hap", "py] there. And")])
def test_a_split_tag_whose_sentence_a_later_message_completes_does_not_refuse_the_context_for_good(halves):
    """The tag is whole once the second message is buffered, but its sentence ends only with the third: that message
    is refused, and the buffered sentence holding the tag goes with it. It was kept, and refused again with every
    later text of the context: the context could never speak again (the hostile pass)."""

    sent = [*({"text": half} for half in halves), {"text": " more. "}]
    err, seen, texts = refused_then_spoken(sent, "Fine.", emotions=False)
    assert err["type"] == "error" and err["code"] == "unsupported_tag", err
    assert [m["type"] for m in seen if m["type"] == "error"] == [], seen
    assert texts == ["Fine."] and [m["text"] for m in seen if m["type"] == "audio.start"] == ["Fine."]


@pytest.mark.parametrize(
    "halves",
    [
        ("Hi <pros", 'ody rate="slow">a</prosody> there.'),
        ("Hi <amazon:eff", 'ect name="whispered">a</amazon:effect> there.'),
        ('Hi <break time="1', 's"/> [whispering] there.'),
    ],
)
def test_a_message_refused_on_its_own_takes_the_half_tag_it_was_to_complete(halves):
    """The second half of a cut tag comes in a message refused for its own tags (a whole `</prosody>`, `[whispering]`):
    the buffered first half goes with it, as when the sentence that completes it is refused. It was kept, and read
    aloud with the next text: `Hi <pros more.`"""
    err, seen, texts = refused_then_spoken([{"text": half} for half in halves], " more.", emotions=False)
    assert err["type"] == "error" and err["code"] == "unsupported_tag", err
    assert texts == ["more."] and [m["text"] for m in seen if m["type"] == "audio.start"] == ["more."]


@pytest.mark.parametrize(
    "messages",
    [
        # an ElevenLabs v3 reply streamed token by token, ending in a tag ZONOS2 refuses, then the turn's flush
        [{"text": "That is funny."}, {"text": " ["}, {"text": "laughs"}, {"text": "]"}, {"text": "", "flush": True}],
        # the message completing a cut tag also completes its sentence, the one before it waiting on the period rule
        [{"text": "That is funny. <br"}, {"text": 'eak time="soon"/> there. And more'}],
        [{"text": "That is funny. [whisp"}, {"text": "ering] there. And more"}],
    ],
)
def test_a_sentence_of_earlier_messages_before_a_refused_one_is_still_spoken(messages):
    """A tag split across messages refuses its sentence (and the message or flush that completed it), not the
    sentence before it, whole in the earlier, accepted messages and held back only until the text after it came
    (the period rule): it was dropped with the refused one, never spoken, its message having drawn no error."""

    async def go():
        session, ws, engine, task = await open_session()
        session.gw.prompts = SimpleNamespace(emotion=None)
        for m in messages:
            ws.send(type="text", **m)
        err = await ws.next_json()
        ws.send(type="text", text=" Fine.", flush=True)

        seen = await played_until_flushed(ws, engine)
        await shut(ws, task)
        return err, seen, engine.texts

    err, seen, texts = asyncio.run(go())
    assert err["type"] == "error" and err["code"] in ("unsupported_tag", "bad_text"), err
    assert texts == ["That is funny.", "Fine."], texts
    assert [m["text"] for m in seen if m["type"] == "audio.start"] == texts, seen


@pytest.mark.parametrize(
    "text, kept",
    [
        ("Hi <spea", "<spea"),
        ('Hi <break time="1', '<break time="1'),
        ("Hi [hap", "[hap"),
        ('x <emotion value="ha', '<emotion value="ha'),
        ('Hi <sub alias="x">U.S.', '<sub alias="x">U.S.'),  # an element whose closing is still to come
        ('Hi <say-as interpret-as="digits">12</say-as', '<say-as interpret-as="digits">12</say-as'),
        ('Hi <sub alias="x">y</sub>', ""),
        ("Hi <su", "<su"),
        ("Hi </spe", "</spe"),
        # cut at or after the hyphen of say-as' name (it was read aloud: `Code <say-`, then `as interpret-as=...`)
        ("Code <say-", "<say-"),
        ("Code <SAY-A", "<SAY-A"),
        ("Code </say-", "</say-"),
        ("Hi <amazon:eff", "<amazon:eff"),
        ('Hi <mstts:express-as style="chee', '<mstts:express-as style="chee'),
        ("Hi <", "<"),
        ("Hi <b>", ""),  # not of ours, and whole
        ('Hi <break time="1s"/> there', ""),
        ("Hi <foo bar", ""),  # not an element of ours: text
        ("[1] and [", "["),
        ("Hi <break ti", "<break ti"),
        ('Hi <break time = "1s" /', '<break time = "1s" /'),
        ('<speak version="1.0" xml:lang="en', '<speak version="1.0" xml:lang="en'),
        # a quoted value may hold '>' (`<speak a="x>y">` is a tag): one still arriving too (it was spoken)
        ('Hi <sub alias="a > b', '<sub alias="a > b'),
        ("Hi <speak a='x>y' b=\"2", "<speak a='x>y' b=\"2"),
        ("x < s and", "< s and"),  # (`and=...` may still come)
        # prose after a `<` and an element's name: no tag (it was held back, and an ElevenLabs close_context dropped it)
        ("We need x < s. Then go on. ", ""),
        ("if a <s and b", ""),
        ("x < speed limit here", ""),
        ('x <break time="1s" then more', ""),
        # an XML character reference cut before its ';' (`AT&am` was spoken, then `p;T`), as long as it may be one, and
        # the word it is in (`AT&amp;T` is one word)
        ("Call AT&am", "AT&am"),
        ("AT&", "AT&"),
        ("(Tom&#", "Tom&#"),
        ("x &#12", "&#12"),
        ("x &#", "&#"),
        ("x &#X1f", "&#X1f"),
        ("it's &apos", "&apos"),
        ("&amp;T &l", "&l"),
        ('<sub alias="AT&am', '<sub alias="AT&am'),  # (the tag's start)
        ("AT& T", ""),  # a bare '&' before a space: text
        ("AT&\n", ""),
        ("AT&b", ""),  # no reference's name begins so
        ("AT&AM", ""),  # (names are lower case)
        ("AT&amp;", ""),  # whole
        ("x &#12345678", ""),  # past the largest code point's digits
        ("x &#x1234567", ""),
        ("x &#1a", ""),
    ],
)
def test_speaking_as_it_comes_keeps_a_tag_still_arriving(text, kept):
    """A hold's timer, auto_mode and a zero buffer delay speak what is buffered without the client's flush: a tag
    still arriving at its end stays for the text that completes it (text_buffer.py `unfinished_tag_start`)."""
    start = unfinished_tag_start(text)
    assert (text[start:] if start is not None else "") == kept


def test_a_flush_of_every_context_speaks_the_others_and_names_the_refused_one():
    """A flush without a context whose first context's buffered text is refused (a tag split across messages) still
    speaks the other contexts' text, and its error names the refused context; the flush gets no `flushed`. It
    stopped at the first refusal: the contexts after it stayed unspoken, and the error named none (the hostile
    pass)."""

    async def go():
        session, ws, engine, task = await open_session()
        session.gw.prompts = SimpleNamespace(emotion=None)
        ws.send(type="text", text="Hi [hap", context_id="a")
        ws.send(type="text", text="py] there", context_id="a")
        ws.send(type="text", text="Fine", context_id="b")
        ws.send(type="flush")
        err = await ws.next_json()
        FakeEngine.play(await engine.started(1))
        seen = await ws.until("audio.done")
        ws.send(type="flush", context_id="b")
        seen += await ws.until("flushed")
        await shut(ws, task)
        return err, seen, engine.texts

    err, seen, texts = asyncio.run(go())
    assert (err["type"], err["code"], err.get("context_id")) == ("error", "unsupported_tag", "a"), err
    assert texts == ["Fine"] and [m["context_id"] for m in seen if m["type"] == "audio.start"] == ["b"]
    assert [m for m in seen if m["type"] in ("error", "flushed")] == [{"type": "flushed", "context_id": "b"}]


@pytest.mark.parametrize(
    "text", ['Hi <emotion\nvalue="happy"/> there.', 'Hi <emotion value="' + "a" * 400 + '"/> there.', "Hi <emotion"]
)
def test_an_emotion_tag_cut_by_a_newline_or_the_budget_is_refused_not_spoken(text):
    """A newline ends a sentence at once and a long tag is cut at the utterance budget: the piece holding the
    tag's opening is refused, so no half of the tag is read aloud."""
    buf = TextBuffer(300)
    pieces = buf.append(text) + buf.flush()
    with pytest.raises(RequestError) as e:
        for piece in pieces:
            split_tags(piece)
    assert e.value.code == "bad_text"
    assert split_tags("Hi <emotion", partial=True) == ["Hi <emotion"]  # a streamed tag, still arriving


# Cartesia's other inline elements (pipecat's CartesiaTTSService.SPELL, SPEED_TAG, VOLUME_TAG write them): they were
# read aloud as markup ("less than spell greater than ...").
@pytest.mark.parametrize(
    "text, spoken",
    [
        ("Your code is <spell>AB12</spell>.", ["Your code is A B 1 2."]),
        ("Call <SPELL> 555 01 </spell> now", ["Call 5 5 5 0 1 now"]),
        ("[happy] It is <spell>x-é</spell>", ["happy", "It is x - é"]),  # a combining accent stays on its letter
        ("A sentence cut leaves <spell>Q.", ["A sentence cut leaves Q ."]),  # the rest of the text is spelled
        ("R2</spell> was the code.", ["R 2 was the code."]),  # its opening was in the sentence before
        # a spelled character is a word of its own beside a word or another spelled element ("A BC D", "IDA B"), and
        # keeps its punctuation
        ("<spell>AB</spell><spell>CD</spell>", ["A B C D"]),
        ('ID<say-as interpret-as="characters">AB</say-as>x, (<spell>Q</spell>).', ["ID A B x, (Q)."]),
    ],
)
def test_a_spell_element_is_spoken_character_by_character(text, spoken):
    assert tags(split_tags(text)) == spoken


def test_a_spell_element_stays_in_its_utterance():
    """Spelled text is text, not a tag: it does not cut the sentence into utterances, and the utterance's reported
    text is what is spoken."""

    async def go():
        pipe = pipeline(None)
        added = pipe.add(["Your code is <spell>AB12</spell>, thanks."], SynthesisOptions(), voice(), None, "c")
        pipe.close()
        return added

    assert [u.text for u in asyncio.run(go())] == ["Your code is A B 1 2, thanks."]


@pytest.mark.parametrize("text", ["<spell></spell>", "<spell> </spell>", " <SPELL>\n</spell> "])
def test_a_spell_element_of_nothing_is_nothing_to_say(text):
    """As a text of only tags: no utterance on a socket, `empty_text` over HTTP. It was an utterance of no audio
    (`audio.start` with an empty text, `audio.done`), and over HTTP a 200 of no audio."""
    assert split_tags(text) == []
    assert tags(split_tags("[neutral]" + text)) == [NEUTRAL]
    assert [p.strip() for p in split_tags(text + " Hi.")] == ["Hi."]

    async def go():
        pipe = pipeline(None)
        added = pipe.add([text], SynthesisOptions(), voice(), None, "c")
        pipe.close()
        with pytest.raises(RequestError) as e:
            async for _ in speak(fake_gateway(), "openai", text, SynthesisOptions(), None, None):
                pass
        return added, e.value.code

    assert asyncio.run(go()) == ([], "empty_text")


def refused_on_add(text: str) -> tuple[RequestError, int]:
    """The error a session's pipeline raises adding `text`, and the utterances it queued (none: refused whole)."""

    async def go():
        pipe = pipeline(directions())
        with pytest.raises(RequestError) as e:
            pipe.add([text], SynthesisOptions(), voice(), None)
        queued = len(pipe)
        pipe.close()
        return e.value, queued

    return asyncio.run(go())


@pytest.mark.parametrize("tag", ['<speed ratio="1.5"/>', "<volume ratio=0.5 />", "</speed>"])
def test_cartesia_speed_and_volume_tags_are_refused_not_spoken(tag):
    """ZONOS2 has no in-text control for them: unsupported_tag, and nothing of the text is queued."""
    assert tags(split_tags(f"Before {tag} after.")) == ["Before", tag.split()[0].strip("</>"), "after."]

    err, queued = refused_on_add(f"Fine so far. {tag} Then faster.")
    assert err.code == "unsupported_tag" and "no in-text control" in str(err) and queued == 0, str(err)


def test_an_ssml_phoneme_element_is_refused_not_spoken():
    """ElevenLabs' SSML `<phoneme alphabet ph>word</phoneme>`: ZONOS2 has no phoneme input (a dictionary's phoneme rule
    is refused too); it was read aloud as markup."""

    err, queued = refused_on_add('Say <phoneme alphabet="ipa" ph="t@meItoU">tomato</phoneme>.')
    assert err.code == "unsupported_tag" and "phoneme input" in str(err) and queued == 0, str(err)


@pytest.mark.parametrize(
    ("tag", "name"),
    [
        ('<prosody rate="slow">', "prosody"),
        ("</prosody>", "prosody"),
        ('<emphasis level="strong">', "emphasis"),
        ('<audio src="https://example.com/a.wav"/>', "audio"),
        ('<lang xml:lang="fr-FR">', "lang"),
        # the vendors' own: Amazon Polly's and Azure's (they were read aloud, "amazon effect name equals whispered")
        ('<amazon:effect name="whispered">', "amazon:effect"),
        ("</amazon:effect>", "amazon:effect"),
        ('<amazon:domain name="news">', "amazon:domain"),
        ("<amazon:breath/>", "amazon:breath"),
        ('<AMAZON:AUTO-BREATHS volume="x-loud">', "amazon:auto-breaths"),
        ('<mstts:express-as style="cheerful" styledegree="2">', "mstts:express-as"),
        ('<mstts:silence type="Sentenceboundary" value="200ms"/>', "mstts:silence"),
    ],
)
def test_ssml_elements_zonos2_has_no_control_for_are_refused_not_spoken(tag, name):
    """An agent written for an SSML engine sends `<prosody>`, `<emphasis>`, `<audio>`, `<lang>`: each was
    read aloud as markup ("prosody rate equals slow"); now unsupported_tag, and nothing of the text is queued."""
    assert tags(split_tags(f"Before {tag} after.")) == ["Before", name, "after."]

    err, queued = refused_on_add(f"Fine so far. {tag} Then.")
    assert err.code == "unsupported_tag" and name in str(err) and queued == 0, str(err)


@pytest.mark.parametrize(
    ("text", "spoken"),
    [
        ("<speak><p>Hello there.</p><p>How are you?</p></speak>", ["Hello there. How are you?"]),
        (
            '<speak version="1.1" xmlns="http://www.w3.org/2001/10/synthesis"><s>One</s><s>two</s>.</speak>',
            ["One two."],
        ),
        ("Hello <p>world</p>.", ["Hello world."]),
        ("and <p> more", ["and more"]),
        ("<SPEAK>Case</Speak>", ["Case"]),
        # Azure's documents wrap every text in a voice element: the request's voice speaks it
        (
            '<speak version="1.0" xml:lang="en-US"><voice name="en-US-JennyNeural">Hi there.</voice></speak>',
            ["Hi there."],
        ),
        ("<speak></speak>", []),
        ('<speak a="x>y">Hi</speak>', ["Hi"]),  # a quoted '>' is the attribute's (its rest was read aloud: 'y">Hi')
        ("<speak version=\"1.0\"\n  xml:lang='en-US'><p xml:lang=en>Hi</p></speak>", ["Hi"]),
        # not SSML's structure: text, spoken as written (a tag needs its '>'; other names are not these)
        ("a <s b and <pre> or <subtotal>", ["a <s b and <pre> or <subtotal>"]),
        ("if a<s and b>c then x<p", ["if a<s and b>c then x<p"]),  # no tag: 'and b' was taken out as its attributes
        # XML's own markup around the elements (the W3C's examples begin with the declaration): read aloud, "xml
        # version equals 1.0"
        ('<?xml version="1.0" encoding="UTF-8"?><speak version="1.0">Hello.</speak>', ["Hello."]),
        ("<?xml version='1.0'?><speak>Hi <!-- a note. Really? --> there.</speak>", ["Hi there."]),
        ('<!DOCTYPE speak PUBLIC "-//W3C//DTD SYNTHESIS 1.0//EN" "synthesis.dtd"><speak>Hi</speak>', ["Hi"]),
        ("Hi<!---->there <?pi x?>now", ["Hi there now"]),
        ("a --> b and c <! d", ["a --> b and c <! d"]),  # an arrow, and `<!` with no comment: text
    ],
)
def test_ssml_structure_is_taken_out_and_its_text_spoken(text, spoken):
    """`<speak>`, `<p>` and `<s>` ask for nothing ZONOS2 would do otherwise: their tags are taken out (a space where
    one stood between two words), the text inside them spoken and reported as spoken."""
    assert split_tags(text) == spoken
    assert split_tags(f"<speak>[happy] {text}</speak>")[0] == StyleTag("happy", "[happy]")


@pytest.mark.parametrize(
    "text",
    [
        "Code <spell\nAB</spell>.",
        'Go <speed ratio="' + "1" * 300 + '"/> on.',
        # a pretty-printed document's `<speak` cut by a newline (its halves were read aloud), a speak tag too long
        '<speak version="1.0"',
        '<speak version="1.0" xmlns="' + "x" * 300 + '">Hi.</speak>',
    ],
)
def test_a_spell_or_speed_tag_without_its_end_is_refused_not_spoken(text):
    with pytest.raises(RequestError) as e:
        split_tags(text)
    assert e.value.code == "bad_text"
    assert split_tags("Code <spell", partial=True) == ["Code <spell"]  # a streamed tag, still arriving
    with pytest.raises(RequestError) as e:
        split_tags('Say <prosody rate="slow" and go.')  # SSML's unsupported ones too
    assert e.value.code == "bad_text"
    assert split_tags("Say <prosody", partial=True) == ["Say <prosody"]


def spoken_on_socket(*messages: dict) -> tuple[list[dict], list[str]]:
    """Send `messages` on a session of our socket, the last a flush: (what the client got up to `flushed`, the texts
    the engine was asked to speak)."""

    async def go():
        _, ws, engine, task = await open_session()
        for m in messages:
            ws.send(**m)
        seen = await played_until_flushed(ws, engine)
        await shut(ws, task)
        return seen, engine.texts

    return asyncio.run(go())


def test_a_spell_element_on_the_socket_reaches_the_engine_spelled():
    seen, texts = spoken_on_socket(dict(type="text", text="Your PIN is <spell>4711</spell>.", flush=True))
    assert texts == ["Your PIN is 4 7 1 1."], texts
    assert [m["text"] for m in seen if m["type"] == "audio.start"] == ["Your PIN is 4 7 1 1."]


def test_ssml_streamed_word_by_word_reaches_the_engine_and_the_client_without_its_markup():
    """An agent's SSML arrives cut anywhere (`<spe` + `ak ...>`, `Hello.</p>` + `<p>There`): the buffer joins the
    halves, and the engine, `audio.start` and the word times see only the words."""

    async def go():
        _, ws, engine, task = await open_session()
        pieces = ["<spe", 'ak version="1.1" xml:lang="en-US">', "<p><s>Hello", ".</s></p><", "p>There", "</p></speak>"]
        for piece in pieces:
            ws.send(type="text", text=piece)
        ws.send(type="flush")

        seen = await played_until_flushed(ws, engine)
        await shut(ws, task)
        return seen, engine.texts

    seen, texts = asyncio.run(go())
    assert [m for m in seen if m["type"] == "error"] == [], seen
    assert " ".join(texts) == "Hello. There", texts
    assert " ".join(m["text"] for m in seen if m["type"] == "audio.start") == "Hello. There", seen


def test_a_pretty_printed_speak_tag_cut_by_its_newline_is_refused_over_http_not_read_aloud():
    """A newline ends a sentence: a `<speak` whose attributes go on the next line was two sentences of markup,
    spoken ("speak version equals 1.0", "xmlns equals ..."); now bad_text, before any audio."""
    text = '<speak version="1.0"\n       xmlns="http://www.w3.org/2001/10/synthesis">\n  <p>Hello.</p>\n</speak>'

    async def go():
        chunks = 0
        with pytest.raises(RequestError) as e:
            async for _ in speak(fake_gateway(), "openai", text, SynthesisOptions(), None, None):
                chunks += 1
        return e.value.code, chunks

    assert asyncio.run(go()) == ("bad_text", 0)
    one_line = text.replace("\n      ", "")  # on one line the tag is whole: taken out
    assert [p.strip() for p in split_tags(one_line)] == ["Hello."]


# SSML's say-as and sub (an agent written for Polly, Google or Azure sends them): say-as was refused whatever it
# asked for, and sub read aloud as its written text ("U.S."), not its alias
@pytest.mark.parametrize(
    "text, spoken",
    [
        ('Code <say-as interpret-as="characters">AB12</say-as>.', ["Code A B 1 2."]),
        ("<SAY-AS Interpret-As='Spell-Out'>ok</Say-As> then", ["o k then"]),
        ("Pin <say-as interpret-as=digits>4711</say-as>", ["Pin 4 7 1 1"]),
        ('Call <say-as interpret-as="telephone">555-01</say-as>', ["Call 5 5 5 - 0 1"]),
        ('<say-as interpret-as="verbatim">A.B.C.</say-as> ok.', ["A . B . C . ok."]),
        ('Buy <say-as interpret-as="cardinal">12</say-as> eggs.', ["Buy 12 eggs."]),  # the normalizer reads it
        ("<say-as interpret-as='number'>3</say-as> [happy] yes", ["3", "happy", "yes"]),
        ('The <sub alias="United States">U.S.</sub> is big.', ["The United States is big."]),
        ("<SUB ALIAS='World Wide Web'>WWW</sub> and <sub alias=NASA>N</sub>.", ["World Wide Web and NASA."]),
        ('<speak><sub alias="a > b">x</sub></speak>', ["a > b"]),  # a quoted '>' is the alias's
        ('<say-as interpret-as="characters"></say-as>', []),  # nothing to say, as <spell></spell>
        # an attribute's name is whole, and a quoted value is no attribute: `data-alias` was the alias,
        # `title="alias=x"` gave x, `data-interpret-as` the say-as' kind (and `data-value` an emotion's)
        ('<sub data-alias="x" alias="United States">U.S.</sub>', ["United States"]),
        ('<sub title="alias=x" alias="United States">U.S.</sub>', ["United States"]),
        ('<say-as data-interpret-as="date" interpret-as="characters">AB</say-as>', ["A B"]),
        ('<emotion data-value="sad" value="happy"/> hi', ["happy", "hi"]),
        # XML's character references (an SSML writer must escape '&' and '<'): the character, never read aloud
        ('<sub alias="AT&amp;T">ATT</sub> calls.', ["AT&T calls."]),
        ('<say-as interpret-as="characters">A&amp;B&#49;&#x32;</say-as>', ["A & B 1 2"]),
        ("<speak>Tom &amp; Jo &lt;3 &quot;a&quot; &apos;o&apos; &#233;t&#xE9;</speak>", ["Tom & Jo <3 \"a\" 'o' été"]),
        ("<spell>&lt;b&gt;</spell> &amp;amp; &bogus; & a &#0;b&#xD800;c", ["< b > &amp; &bogus; & a bc"]),
    ],
)
def test_ssml_say_as_and_sub_are_spoken_as_they_say(text, spoken):
    assert tags(split_tags(text)) == spoken


@pytest.mark.parametrize(
    "text, spoken",
    [
        ('<say-as interpret-as="characters">[laughs]</say-as>', ["[ l a u g h s ]"]),
        ("Say <spell>[Happy]</spell> [sad] now", ["Say [ H a p p y ]", "sad", "now"]),
        ("<SPELL>x [ neutral ]</spell>", ["x [ n e u t r a l ]"]),
        # a spell element a sentence cut left open or closed: its side is spelled, the other side's tags are tags
        ("Code <spell>a[whispering]", ["Code a [ w h i s p e r i n g ]"]),
        ("[calm]b</spell> [sad] c", ["[ c a l m ] b", "sad", "c"]),
        ("[happy] <spell>ab</spell>", ["happy", "a b"]),
    ],
)
def test_a_bracket_in_spelled_text_is_spelled_not_a_tag(text, spoken):
    """Spelled text (`<spell>`, say-as characters) is characters to spell, brackets too: `[laughs]` in it was a tag,
    refused (unsupported_tag), and `[happy]` styled the text after it and was not spelled."""
    assert tags(split_tags(text)) == spoken


def test_a_bracket_in_spelled_text_is_queued_spelled_on_a_server_without_emotions():
    async def go():
        pipe = pipeline(None)  # no emotion directions: a tag would be refused
        texts = ['Say <say-as interpret-as="characters">[laughs]</say-as>.', "<spell>[happy]</spell>"]
        added = pipe.add(texts, SynthesisOptions(), voice(), None)
        pipe.close()
        return [u.text for u in added]

    assert asyncio.run(go()) == ["Say [ l a u g h s ].", "[ h a p p y ]"]


@pytest.mark.parametrize("kind", ["date", "time", "ordinal", "currency", "", None, 'date" data-interpret-as="digits'])
def test_a_say_as_zonos2_cannot_read_is_refused_naming_those_it_can(kind):
    attribute = "" if kind is None else f' interpret-as="{kind}"'
    err, queued = refused_on_add(f"Fine so far. <say-as{attribute}>12/7</say-as> Then.")
    assert err.code == "unsupported_tag" and queued == 0, str(err)
    assert all(k in str(err) for k in ("characters", "spell-out", "verbatim", "digits", "telephone", "cardinal"))
    with pytest.raises(RequestError) as e:
        split_tags(f"<say-as{attribute}>12", partial=True)  # a streamed opening is checked as it comes
    assert e.value.code == "unsupported_tag"


@pytest.mark.parametrize(
    "text",
    [
        "H<sub>2</sub>O",  # no alias
        '<sub alias="">x</sub>',
        "<sub alias=' '>x</sub>",
        '<sub alias="[happy] hi">x</sub>',  # a tag in the alias
        "<sub alias=\"a <break time='1s'/> b\">x</sub>",
        '<sub alias="x">U.S.',  # an element a sentence cut left open, or closed
        "S.</sub> is big.",
        '<say-as interpret-as="characters">A',
        "B</say-as> ok",
        '<sub alias="x"/>',
        '<sub alias="x">a <break time="1s"/> b</sub>',
        '<sub data-alias="x">y</sub>',  # no alias: `data-alias` is another attribute
        '<sub alias="&#32;">x</sub>',  # an alias of a space
        '<sub alias="a &lt;break time=&quot;1s&quot;/&gt;">x</sub>',  # a tag in the alias, escaped
    ],
)
def test_a_sub_without_alias_or_an_element_not_whole_is_refused_not_spoken(text):
    """Never read aloud: `bad_text` when its sentence is spoken (the pipeline splits at the break first)."""
    with pytest.raises(RequestError) as e:
        for piece in split_breaks(text):
            if isinstance(piece, str):
                split_tags(piece)
    assert e.value.code == "bad_text", str(e.value)
    err, queued = refused_on_add(f"Fine so far. {text} Then.")
    assert err.code == "bad_text" and queued == 0, str(err)


@pytest.mark.parametrize(
    "text",
    [
        'A <<p>break time="1s"/> B',
        'A <<s>break strength="strong"/> B',
        "A <<mark name='m'/>break/> B",
        "A </<p>break> B",
        'A <<sub alias="break">x</sub> time="1s"/> B',
        "A <<sub alias='break time=\"1s\"/>'>x</sub> B",
        'A <<say-as interpret-as="cardinal">break time="1s"/></say-as> B',
    ],
)
def test_a_break_tag_that_taking_out_a_tag_would_make_is_refused_not_spoken(text):
    """Breaks are taken out of a text before SSML's structure and its say-as and sub elements (app/core/pipeline.py
    `inline_pieces`): a `<` before one of those and text after it made a break tag once the element was taken out or
    replaced (`A <<p>break time="1s"/> B`), read aloud as "A < break time equals 1 s"; `bad_text`, as a cut one."""
    with pytest.raises(RequestError) as e:
        for piece in split_breaks(text):
            if isinstance(piece, str):
                split_tags(piece)
    assert e.value.code == "bad_text", str(e.value)
    assert "break" in str(e.value)
    err, queued = refused_on_add(f"Fine so far. {text} Then.")
    assert err.code == "bad_text" and queued == 0, str(err)
    assert split_tags('A <p>B</p> <break time="1', partial=True) == ['A B <break time="1']  # a streamed one arriving


@pytest.mark.parametrize(
    "text",
    ["Hi <!-- a note", "Hi <?xml version='1.0'", "<!DOCTYPE speak", 'Hi <?xml a="' + "x" * 300, "a <!-- b -- c -->"],
)
def test_xml_markup_not_whole_in_its_sentence_is_refused_not_spoken(text):
    """A comment, a declaration or a document type with no end in its sentence (or a comment holding `--`, which XML
    forbids): `bad_text`, as a cut element (a streamed message may leave one open for the next)."""
    with pytest.raises(RequestError) as e:
        split_tags(f"{text} there.")
    assert e.value.code == "bad_text", str(e.value)
    if ">" not in text:  # (a comment holding `--` is no comment, arriving or not)
        assert split_tags(text, partial=True)


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        ("Hi <!", "<!"),
        ("Hi <!-", "<!-"),
        ("Hi <!-- a note. More", "<!-- a note. More"),
        ("Hi <?xm", "<?xm"),
        ('<?xml version="1.0" enc', '<?xml version="1.0" enc'),
        ("Hi <!-- a --> there", ""),
        ('<?xml version="1.0"?> Hi', ""),
    ],
)
def test_speaking_as_it_comes_keeps_xml_markup_still_arriving(text, kept):
    start = unfinished_tag_start(text)
    assert (text[start:] if start is not None else "") == kept


@pytest.mark.parametrize(
    "text",
    [
        'Say <sub alias="United States">U.S.',
        "U.S.</sub> is big.",
        'Say <sub alias="Uni',
        "</say-as> x",
        # cut inside a quoted value that holds '>' (whole, `<sub alias="a > b">x</sub>` is spoken "a > b"): the message
        # was refused, the opening "must end with '>'" (a '>' came after it: the value's)
        'Say <sub alias="a >',
        "Say <speak a='x>y' b=\"2",
    ],
)
def test_a_streamed_message_may_open_or_close_an_element_another_message_completes(text):
    assert split_tags(text, partial=True)  # checked when its sentence is spoken


def test_an_element_whose_quoted_value_holds_a_gt_streamed_in_two_messages_is_spoken_once_whole():
    seen, texts = spoken_on_socket(
        dict(type="text", text='Say <sub alias="a >'), dict(type="text", text=' b">x</sub> now.', flush=True)
    )
    assert [m for m in seen if m["type"] == "error"] == [] and texts == ["Say a > b now."], (seen, texts)


def test_ssml_sub_and_say_as_streamed_on_the_socket_reach_the_engine_and_the_client_as_they_say():
    """Word by word, as an LLM streams them: the engine and `audio.start` get the alias and the spelled text, one
    sentence however many periods the elements hold; a say-as of a date is refused, the socket goes on."""

    text = 'The <sub alias="United States">U.S.</sub> code is <say-as interpret-as="characters">A.B.</say-as> ok.'
    words = [dict(type="text", text=piece + " ") for piece in text.split(" ")]
    seen, texts = spoken_on_socket(*words, dict(type="flush"))
    assert texts == ["The United States code is A . B . ok."], texts
    assert [m["text"] for m in seen if m["type"] == "audio.start"] == texts

    sent = [{"text": 'On <say-as interpret-as="date">2026-12-07</say-as>.', "flush": True}]
    err, seen, texts = refused_then_spoken(sent, '<sub alias="Fine">F</sub>.')
    assert err["type"] == "error" and err["code"] == "unsupported_tag" and "characters" in err["message"], err
    assert texts == ["Fine."] and [m["text"] for m in seen if m["type"] == "audio.start"] == ["Fine."]


# ---- XML's CDATA sections: their content is text, as written -----------------------------------------------
@pytest.mark.parametrize(
    ("text", "spoken"),
    [
        # markup in one is none (XML's rule, Azure's and Polly's reading): those characters, not a break, not a tag
        ('Say <![CDATA[<break time="1s"/>]]> now.', 'Say <break time="1s"/> now.'),
        ("Tom <![CDATA[& Jerry [happy] <b>x</b> &amp;]]>.", "Tom & Jerry [happy] <b>x</b> &amp;."),
        ("<speak><p><![CDATA[if a < b]]></p></speak>", "if a < b"),
        ('Use <![CDATA[a]]]]><![CDATA[>b]]> <break time="1s"/> x.', "Use a]]>b"),  # (an end written so; a break)
        ('<sub alias="United States"><![CDATA[U.S.]]></sub> ok.', "United States ok."),
        ('<say-as interpret-as="characters"><![CDATA[A&B]]></say-as>.', "A & B."),
    ],
)
def test_a_cdata_sections_content_is_spoken_as_written_no_tag_in_it(text, spoken):
    """`<![CDATA[...]]>` was read aloud as markup ("CDATA"), its content's tags taken as tags: a break in one was a
    pause. Its content is text, spoken as written, on the socket and over HTTP (the whole text's checks too)."""
    seen, texts = spoken_on_socket(dict(type="text", text=text, flush=True))
    assert [m for m in seen if m["type"] == "error"] == [], seen
    assert " ".join(texts).startswith(spoken), texts
    assert " ".join(m["text"] for m in seen if m["type"] == "audio.start").startswith(spoken)

    async def over_http() -> list[str]:
        gw = fake_gateway()
        player = asyncio.create_task(_play_all(gw.fake))
        async for _ in speak(gw, "openai", text, SynthesisOptions(), None, None):
            pass
        player.cancel()
        return gw.fake.texts

    assert " ".join(asyncio.run(over_http())).startswith(spoken)


async def _collect(gen) -> None:
    async for _ in gen:
        pass


@pytest.mark.parametrize(
    "pieces",
    [
        ["Say <![CDATA[a < b ", '<break time="soon"/> ', "[laughs] & c]]> done."],
        ["Say <", "![CD", "ATA[a < b ", '<break time="soon"/> [laughs] & c]', "]", "> done."],
        ["Say <![CDATA[a < b ", '<break time="soon"/> [laughs] & c]]', "> done."],
    ],
)
def test_a_cdata_section_streamed_across_messages_is_text_until_its_end(pieces):
    """A section opened in one message (or its opening cut, `<![CD`) and ended in a later one: the messages between hold
    its text, markup included (`<break time="soon"/>` was refused as a bad break, `[laughs]` as a tag ZONOS2 has no
    control for), and the text after its end is read as any."""
    seen, texts = spoken_on_socket(*(dict(type="text", text=p) for p in pieces), dict(type="flush"))
    assert [m for m in seen if m["type"] == "error"] == [], seen
    spoken = 'Say a < b <break time="soon"/> [laughs] & c done.'
    assert " ".join(texts).split() == spoken.split(" "), texts


def test_a_cdata_section_longer_than_an_utterance_is_spoken_whole_as_text_in_pieces():
    """A section's text is cut into utterances as any text is (the budget), none of them refused or holding its
    markup: a long one streamed word by word, markup in it."""
    words = ("Code <![CDATA[" + " ".join(f"a<{i}> &" for i in range(200)) + "]]> end.").split(" ")
    seen, texts = spoken_on_socket(*(dict(type="text", text=w + " ") for w in words), dict(type="flush"))
    assert [m for m in seen if m["type"] == "error"] == [], seen
    assert len(texts) > 2 and all("CDATA" not in t and "&amp;" not in t for t in texts), texts
    assert " ".join(texts).split() == ["Code", *(w for i in range(200) for w in (f"a<{i}>", "&")), "end."]


@pytest.mark.parametrize("text", ["Say <![CDATA[a < b", "<![CDATA[x]] there.", "Say <![CDATA[ a ]]"])
def test_a_cdata_section_with_no_end_is_refused_not_read_aloud(text):
    """Over HTTP (a whole text) a section whose `]]>` never comes is `bad_text`, as an open comment is."""

    async def go() -> RequestError:
        with pytest.raises(RequestError) as e:
            async for _ in speak(fake_gateway(), "openai", text, SynthesisOptions(), None, None):
                pass
        return e.value

    err = asyncio.run(go())
    assert err.code == "bad_text" and "CDATA" in str(err), str(err)


def test_the_buffer_limit_counts_a_cdata_sections_text_as_the_buffer_holds_it():
    """The buffer holds a section's `<`, `&`, `>` and brackets as character references (their characters once
    spoken): the --max-buffer-chars check counts them so, or a message could fill it past its limit."""

    async def go() -> tuple[dict, dict]:
        _, ws, engine, task = await open_session(Limits(max_buffer_chars=100))
        ws.send(type="text", text="<![CDATA[" + "<" * 30 + "]]>")  # 42 characters sent, 120 held
        refused = await ws.next_json()
        ws.send(type="text", text="<![CDATA[" + "<" * 10 + "]]>", flush=True)  # 22 sent, 40 held
        FakeEngine.play(await engine.started(1))
        seen = await ws.until("flushed")
        await shut(ws, task)
        return refused, seen[-1]

    refused, flushed = asyncio.run(go())
    assert refused["code"] == "text_too_long" and flushed["type"] == "flushed", (refused, flushed)


# ---- a tag cut at the end of text the client flushes ------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "broken"),
    [
        ("Hi <brea", "<brea"),
        ("Hi <brea ", "<brea"),  # (LiveKit's Deepgram plugin sends each word with a space after it)
        ('Hi <break time="1', '<break time="1'),
        ("Hi <break ", "<break"),
        ("Hi </pros", "</pros"),
        ("Hi <b", "<b"),
        ("Hi x<br", "<br"),
        ("Hi [hap", "[hap"),
        ("Hi [laughs ", "[laughs"),
        ('Hi <sub alias="x">U.S.', '<sub alias="x">U.S.'),
        ("Hi <!-- a note", "<!-- a note"),
        ("Hi <!-", "<!-"),
        ("Hi a<![CDATA[", "<![CDATA["),
        ("Hi <![CD", "<![CD"),
        ("Hi <amazon:eff", "<amazon:eff"),
        # prose: no tag for certain
        ("Is two <", None),
        ("Is two < ", None),
        ("Hi </", None),
        ("Hi <!", None),
        ("Hi <?", None),
        ("if a < b", None),
        ("if a<b", None),
        ("see [note", None),
        ("see [1", None),
        ("Call AT&am", None),
        ("Hi <foo", None),
        ("Hi <b> there", None),
        ("Hi <spell>AB", None),  # (an opening left alone spells to the end of its text)
    ],
)
def test_a_tag_cut_at_the_end_of_a_flushed_text_is_found_prose_is_not(text, broken):
    start = broken_tag_start(text)
    assert (text[start:].rstrip() if start is not None else None) == broken


@pytest.mark.parametrize(
    ("text", "spoken"),
    [
        ("Hi <brea", "Hi"),  # was spoken "Hi <brea"
        ('Hi <break time="1', "Hi"),  # was bad_text, "Hi" unspoken
        ('Well. Hi <emotion value="ha', "Well. Hi"),
        ("Hi [hap", "Hi"),
        ("Hi <pros", "Hi"),
        ('Hi <sub alias="x">U.S.', "Hi"),
    ],
)
@pytest.mark.parametrize("end", ["flush", "close"])
def test_a_tag_cut_at_the_clients_flush_is_refused_and_the_text_before_it_spoken(text, spoken, end):
    """An LLM that stopped mid-tag, then the client's flush (or close): the text before the tag is spoken and the cut
    tag refused with `bad_text` naming the context, never read aloud, whichever point it was cut at (inside its name
    it was spoken as text, "Hi less than brea"; after it the whole sentence was refused, its words unspoken)."""

    async def go() -> tuple[list[dict], list[str]]:
        session, ws, engine, task = await open_session()
        session.gw.prompts = SimpleNamespace(emotion=None)
        ws.send(type="text", text=text, context_id="c")
        ws.send(type="flush" if end == "flush" else "close")
        player = asyncio.create_task(_play_all(engine))
        seen = await ws.until("error")
        if end == "close":
            seen += await ws.until("session.closed")
        else:
            ws.send(type="text", text="Next.", context_id="c", flush=True)
            seen += await ws.until("flushed")
        player.cancel()
        await shut(ws, task)
        return seen, engine.texts

    seen, texts = asyncio.run(go())
    errors = [m for m in seen if m["type"] == "error"]
    assert [(m["code"], m.get("context_id")) for m in errors] == [("bad_text", "c")], errors
    assert " ".join(texts).split() == spoken.split() + (["Next."] if end == "flush" else []), texts
    assert [m for m in seen if m["type"] == "flushed"] == (
        [{"type": "flushed", "context_id": "c"}] if end == "flush" else []
    )


async def _play_all(engine) -> None:
    for n in range(1, 10):
        FakeEngine.play(await engine.started(n))


@pytest.mark.parametrize("text", ["Is two <", "if a<b", "see [note", "Call AT&am"])
def test_prose_at_the_clients_flush_is_spoken(text):
    seen, texts = spoken_on_socket(dict(type="text", text=text, flush=True))
    assert [m for m in seen if m["type"] == "error"] == [] and texts == [text], (seen, texts)


def spoken_over_http(text: str) -> tuple[RequestError | None, list[str]]:
    """What an HTTP route makes of a whole text (app/core/pipeline.py `speak`, which every HTTP speech route speaks
    through): its refusal, or None, and the texts its utterances sent the engine."""

    async def go() -> tuple[RequestError | None, list[str]]:
        gw = fake_gateway()
        player = asyncio.create_task(_play_all(gw.fake))
        try:
            await _collect(speak(gw, "openai", text, SynthesisOptions(), None, None))
        except RequestError as e:
            return e, gw.fake.texts
        finally:
            player.cancel()
        return None, gw.fake.texts

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("text", "tag"),
    [
        ("Hi <brea", "<brea"),  # was spoken, "Hi less than brea"
        ("Hi <brea ", "<brea"),
        ('Hi <break time="1s"', '<break time="1s"'),
        ("Well. Hi </pros", "</pros"),
        ("Hi [hap", "[hap"),
        ('Hi <emotion value="ha', '<emotion value="ha'),
        ('Hi <sub alias="x">U.S.', '<sub alias="x">U.S.'),
        ("Hi <!-- a note", "<!-- a note"),
        ("Say <![CDATA[a < b", "<![CDATA["),
    ],
)
def test_a_tag_cut_at_the_end_of_a_whole_http_text_is_bad_text_naming_it(text, tag):
    """A whole text (HTTP) is complete, as our socket's text is at the client's flush: a tag cut at its end is refused
    (`bad_text`, naming the tag) by the one rule the socket's flush applies (`broken_tag_start`), before any engine
    work; it was spoken as text (`Hi <brea`: "Hi less than brea") or refused for another reason."""
    err, texts = spoken_over_http(text)
    assert err is not None and err.code == "bad_text" and repr(tag) in str(err), err
    assert "no text can complete" in str(err) and texts == [], (str(err), texts)


@pytest.mark.parametrize("text", ["a < b", "x<3", "Is two <", "if a<b", "see [note", "Call AT&am", "Hi <foo"])
def test_prose_at_the_end_of_a_whole_http_text_is_spoken(text):
    """What may be prose at a text's end (no tag's prefix, as the parser reads tags) is spoken as today."""
    err, texts = spoken_over_http(text)
    assert err is None and texts == [text], (err, texts)
