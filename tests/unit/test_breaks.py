"""Inline breaks (app/core/breaks.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from app.core.breaks import split_breaks
from app.core.options import SynthesisOptions
from app.core.pipeline import UtterancePipeline
from app.core.style_tags import split_tags
from app.core.tag_vocabulary import TAG_MAX, attributes, markup_in
from app.core.text_buffer import TextBuffer, unfinished_tag_start
from app.io.errors import RequestError
from tests.unit.test_pipeline import fake_gateway


def test_breaks_split_the_text():
    assert split_breaks("No tags.") == ["No tags."]
    assert split_breaks('One. <break time="500ms"/> Two.') == ["One.", 0.5, "Two."]
    assert split_breaks("<break time='1.5s' />Go") == [1.5, "Go"]
    assert split_breaks('A<BREAK TIME="2S"/>') == ["A", 2.0]
    assert split_breaks("") == [""]


def test_a_break_of_a_strength_is_its_silence():
    """SSML's strengths (Azure's durations), a bare <break/> as medium; a time wins over a strength; "none" joins
    the words either side (a text of nothing else has no pieces, as a text of only `</break>`)."""
    assert split_breaks('A <break strength="x-weak"/> B <break strength=weak/> C') == ["A", 0.25, "B", 0.5, "C"]
    assert split_breaks("A <break/> B <break strength='STRONG' /> C <break strength=\"x-strong\"/>") == [
        "A",
        0.75,
        "B",
        1.0,
        "C",
        1.25,
    ]
    assert split_breaks('A <break strength="medium" time="20ms"/> B') == ["A", 0.02, "B"]
    assert split_breaks('one<break strength="none"/>two <break strength="none"/> three.') == ["one two three."]
    assert split_breaks('<break strength="none"/> ') == []
    assert split_breaks('A <break strength="none"/><break time="1s"/>B') == ["A", 1.0, "B"]


def test_a_none_break_before_a_closing_mark_joins_without_a_space():
    """`Hello<break strength="none"/>, world`: "Hello, world" ("Hello , world" made "," a word of the word times)."""
    assert split_breaks(
        'Hello<break strength="none"/>, world. Yes <break strength="none"/> . Ok<break strength="none"/>!'
    ) == ["Hello, world. Yes. Ok!"]
    assert split_breaks('A<break strength="none"/>(b) <break strength="none"/>c<break time="1s"/>d') == [
        "A (b) c",
        1.0,
        "d",
    ]


def test_a_breaks_attributes_are_whole_names():
    """`data-strength="none"` or `x:time="5s"` is another attribute: the break is medium (it was read as its strength,
    joining the words, or as its time)."""
    assert split_breaks('A <break data-strength="none"/> B <break x:time="5s"/> C') == ["A", 0.75, "B", 0.75, "C"]
    assert split_breaks('A <break data-time="5s" time="1s"/> B') == ["A", 1.0, "B"]


@pytest.mark.parametrize(
    "text, pieces",
    [
        # a quoted value is no attribute: `foo="strength=none"` joined the words, `data="time=2s"` was a 2 s break
        ('A <break foo="strength=none"/> B', ["A", 0.75, "B"]),
        ('A <break data="time=2s"/> B', ["A", 0.75, "B"]),
        ("A <break title='time=\"1s\"' strength=weak/> B", ["A", 0.5, "B"]),
        ('A <break alt="x time=3s" time="1s"/> B', ["A", 1.0, "B"]),
        # what worked stays: bare values, either quote, any case, spaces around '=' and the value
        ("A <break time=1s/> B <break strength=none/> C", ["A", 1.0, "B C"]),
        ("A <BREAK TIME = '1.5S' /> B <break Strength=\"STRONG\" > C", ["A", 1.5, "B", 1.0, "C"]),
        ('A <break time=" 2s "/> B <break time="1s"/>', ["A", 2.0, "B", 1.0]),
    ],
)
def test_a_breaks_attributes_are_read_as_attributes(text, pieces):
    assert split_breaks(text) == pieces


@pytest.mark.parametrize(
    "tag",
    [
        '<break time="1sx"/>',  # (read as 1 s: the time's pattern stopped where it matched)
        '<break time="1s" junk/>',  # a name without a value
        '<break time="1s"strength="weak"/>',  # no space between two
        '<break "time=1s"/>',  # a stray quoted value
        "<break time='1s\"/>",  # quotes that do not match
        '<break time="1s" time="2s"/>',  # an attribute twice (XML forbids it: the first was taken)
        '<break time="1s" TIME="2s"/>',
    ],
)
def test_a_break_whose_attributes_are_none_is_refused(tag):
    with pytest.raises(RequestError) as e:
        split_breaks(f"Before {tag} after.")
    assert e.value.code == "bad_text", str(e.value)


@pytest.mark.parametrize(
    "messages", [['A <break time="<![CDATA[1s]]>"/> after.'], ['A <break time="<![CDATA[', '1s]]>"/> after.']]
)
def test_a_cdata_section_in_a_breaks_time_is_no_time(messages):
    """XML has no markup in an attribute's value: `time="<![CDATA[1s]]>"` paused 1 s, its section read as its
    content; now the section is its characters, no time (whole, or split across messages)."""
    buffer = TextBuffer(500)
    sentences = [s for m in [*messages, " Next. "] for s in buffer.append(m)]
    assert sentences[1:] == [], sentences  # (the tag is held whole, to its section's end)
    with pytest.raises(RequestError) as e:
        for piece in split_breaks(sentences[0]):  # (as the pipeline reads a sentence: its breaks, then its tags)
            if isinstance(piece, str):
                split_tags(piece)
    assert e.value.code == "bad_text", str(e.value)


def test_one_reader_takes_every_tags_attributes():
    """`attributes` (app/core/tag_vocabulary.py) reads the break's, the emotion's, the say-as' and the sub's."""
    assert attributes(""" a=1 B='x y' c = "p=q" d="" /""", "t") == {"a": "1", "b": "x y", "c": "p=q", "d": ""}
    assert attributes("", "t") == {} and attributes(" / ", "t") == {}
    for text in (" a", ' a="1"b="2"', " a=", ' a="1', " =1", ' a="1" "b"', " a=x/y"):
        with pytest.raises(RequestError) as e:
            attributes(text, "<t" + text + ">")
        assert e.value.code == "bad_text" and "name=" in str(e.value), (text, str(e.value))


def test_a_break_elements_end_is_dropped_not_spoken():
    """`<break time="1s"></break>` (XML writers and SSML-writing LLMs close the element): the end was read aloud."""
    assert split_breaks('Hi <break time="1s"></break> there.') == ["Hi", 1.0, "there."]
    assert split_breaks("Hi </BREAK > there, a</break>b.") == ["Hi there, a b."]
    assert split_breaks(" </break> ") == []  # nothing else: no piece, so no utterance

    async def go():
        pipe = UtterancePipeline(fake_gateway(), "test")  # type: ignore[arg-type]
        added = pipe.add(['Wait <break time="200ms"></break> now.', "</break>"], SynthesisOptions(), None, None)
        pipe.close()
        return added

    added = asyncio.run(go())
    assert [(u.text, u.silence_s) for u in added] == [("Wait", None), ("", 0.2), ("now.", None)]


@pytest.mark.parametrize(
    "tag",
    [
        '<break time="soon"/>',
        '<break time=""/>',
        '<break time="0ms"/>',
        '<break time="11s"/>',
        '<break strength="loud"/>',
        '<break strength=""/>',
        '<break time="later" strength="strong"/>',
        '<break time="500ms" strength="loud"/>',  # (the time won, the strength was not looked at)
    ],
)
def test_a_break_without_a_valid_time_or_strength_is_refused(tag):
    with pytest.raises(RequestError) as e:
        split_breaks(f"Before {tag} after.")
    assert e.value.code == "bad_text"


@pytest.mark.parametrize(
    "time, shown",
    [("10.00001s", "10.00001 s"), ("10000.0001ms", "10000.0001 ms"), ("0s", "0 s"), ("0.00000001s", "0.00000001 s")],
)
def test_a_break_out_of_range_is_refused_naming_its_time(time, shown):
    """The refusal names the time as written: just past the limit it said "at most 10 s, not 10 s". A break of less
    than one sample is no silence at all (a text of only that made an empty answer, an unreadable whole FLAC)."""
    with pytest.raises(RequestError) as e:
        split_breaks(f'Before <break time="{time}"/> after.')
    assert e.value.code == "bad_text" and str(e.value).endswith(f"not {shown}"), str(e.value)
    assert split_breaks('<break time="10s"/>') == [10.0]
    assert split_breaks('<break time="0.023ms"/>') == [0.023e-3]  # one sample at 44.1 kHz (22.7 us) is kept


def test_a_text_holds_a_bounded_number_of_breaks():
    with pytest.raises(RequestError) as e:
        split_breaks('<break time="1ms"/>' * 17)
    assert e.value.code == "bad_text"
    assert len(split_breaks('a <break time="1ms"/>' * 16)) == 32


@pytest.mark.parametrize(
    "text", ['Hi <break\ntime="1s"/> there.', 'Hi <break time="1s" ' + "x" * 400 + "/> there.", "Hi <break"]
)
def test_a_break_cut_by_a_newline_or_the_budget_is_refused_not_spoken(text):
    buf = TextBuffer(300)
    pieces = buf.append(text) + buf.flush()
    with pytest.raises(RequestError) as e:
        for piece in pieces:
            split_breaks(piece)
    assert e.value.code == "bad_text"
    assert split_breaks("Hi <break time=", partial=True) == ["Hi <break time="]  # a streamed tag, still arriving


@pytest.mark.parametrize("opening", ["<break", "< break ", "<emotion", "</emotion value=", "<!--", "<?"])
def test_unclosed_tag_openings_cost_little(opening):
    """A message of thousands of tag openings with no end: each one's pattern looked through the rest of the text
    for a `>` (36 KB of "<break" took ~4 s of the event loop every session shares; 10 KB, the buffer's limit, 0.25 s,
    and such a message is refused, so a client could send it again and again). A tag ends within TAG_MAX
    characters; the bound is ~100x what it takes."""
    text = opening * (36000 // len(opening))
    split = split_breaks if "break" in opening else split_tags
    cpu = time.thread_time()
    assert split(text, partial=True) == [text]  # still arriving: its openings may end in the next message
    with pytest.raises(RequestError) as e:
        split(text)
    cpu = time.thread_time() - cpu
    assert e.value.code == "bad_text"
    assert cpu < 0.5, f"{cpu:.2f} s of CPU"


@pytest.mark.parametrize(
    "text", ["<" + " " * 4000 + "x.", "<" + "\t " * 2000 + "x", "<spell" + " " * 9990 + "x", "[" + " " * 9990 + "a1"]
)
def test_an_opening_and_a_long_run_of_spaces_costs_little(text):
    """A `<` and thousands of spaces before a character that ends no tag: `<\\s*/?\\s*` tried every split of the run
    between its two `\\s*` (quadratic: a sentence of 10,000 characters, the buffer's limit, took 28 s of the event
    loop every session shares in split_tags, 8 s in markup_in, 2 s in each as-it-comes flush's unfinished_tag_start;
    4,000 here, ~5 s). `<spell  ...` and `[  ...` had the same shape, at 0.15 and 0.5 s for 10,000. Each is linear
    now; the bound is ~50x what it takes."""
    cpu = time.thread_time()
    with contextlib.suppress(RequestError):  # (a cut `<spell` is bad_text)
        split_tags(text)
    markup_in(text)
    unfinished_tag_start(text)
    cpu = time.thread_time() - cpu
    assert cpu < 0.5, f"{cpu:.2f} s of CPU"


def test_a_tag_ends_within_tag_max_characters():
    assert split_breaks(f'a <break time="1s"{" " * (TAG_MAX - 20)}/> b') == ["a", 1.0, "b"]
    with pytest.raises(RequestError):
        split_breaks(f'a <break time="1s"{" " * TAG_MAX}/> b')
