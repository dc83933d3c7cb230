"""Sentence splitting of streamed text (app/core/text_buffer.py): the segmenter, the streaming rule, and the
UTF-8 budget of one utterance."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.core.breaks import split_breaks
from app.core.style_tags import split_tags
from app.core.text_buffer import TextBuffer, split_to_budget, unfinished_tag_start, utf8_len

ISSUE_TEXT = "Dr. Smith paid $5.50 on Jan. 3rd, 2026. He left at 5 p.m. today."
ISSUE_SENTENCES = ["Dr. Smith paid $5.50 on Jan. 3rd, 2026.", "He left at 5 p.m. today."]


def stream(text: str, step: int, budget: int = 500, language: str = "en_us") -> list[str]:
    buf = TextBuffer(budget, language)
    out = []
    for i in range(0, len(text), step):
        out += buf.append(text[i : i + step])
    return out + buf.flush()


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_abbreviations_numbers_and_times_do_not_cut_sentences(step):
    """Two utterances, whatever pieces the text arrives in."""
    assert stream(ISSUE_TEXT, step) == ISSUE_SENTENCES


def test_word_by_word_like_an_llm():
    buf = TextBuffer(500)
    out = []
    for word in ISSUE_TEXT.split(" "):
        out += buf.append(word + " ")
    assert out == ISSUE_SENTENCES[:1]  # the second one's end is not certain until more text or a flush
    assert buf.flush() == ISSUE_SENTENCES[1:]


@pytest.mark.parametrize(
    "text, language, sentences",
    [
        (
            "J. R. R. Tolkien wrote it. Then Mr. Baggins left.",
            "en_us",
            ["J. R. R. Tolkien wrote it.", "Then Mr. Baggins left."],
        ),
        (
            "The value is 3.14. Version 2.0.1 shipped. Done!",
            "en_us",
            ["The value is 3.14.", "Version 2.0.1 shipped.", "Done!"],
        ),
        (
            "Visit https://example.com/a.b?x=1. Then email a.b@c.org. Thanks.",
            "en_us",
            ["Visit https://example.com/a.b?x=1.", "Then email a.b@c.org.", "Thanks."],
        ),
        (
            "I live in the U.S. It is big. See e.g. the docs, i.e. the manual.",
            "en_us",
            ["I live in the U.S.", "It is big.", "See e.g. the docs, i.e. the manual."],
        ),
        ("你好。今天天气很好！我们去公园吧？好的", "cmn", ["你好。", "今天天气很好！", "我们去公园吧？", "好的"]),
        ("こんにちは。元気ですか？はい", "ja", ["こんにちは。", "元気ですか？", "はい"]),
        (
            "Am 3. Januar kam Dr. Müller. Er ging z.B. nach Hause.",
            "de",
            ["Am 3. Januar kam Dr. Müller.", "Er ging z.B. nach Hause."],
        ),
        ("Line one\nLine two\n\nThree. Four", "en_us", ["Line one", "Line two", "Three.", "Four"]),
    ],
)
def test_segmenter_cases(text, language, sentences):
    assert stream(text, 1000, language=language) == sentences
    assert stream(text, 1, language=language) == sentences


def test_streaming_rule():
    buf = TextBuffer(max_utterance_bytes=40)
    assert buf.append("Hello there. How") == []  # after a period: once the next word is complete
    assert buf.append(" are") == ["Hello there."]
    assert buf.append(" you?") == []  # a sentence ends only when the next one starts (or a flush)
    assert buf.append(" Fine!\nNext") == ["How are you?", "Fine!"]  # a newline ends one at once
    assert buf.append("…") == []
    assert buf.flush() == ["Next…"]
    assert buf.append("Dr. ") == []  # "Dr." could go on: not a sentence yet
    assert buf.append("Smith") == []
    assert buf.flush() == ["Dr. Smith"]
    assert buf.append("你好。再见") == ["你好。"]  # no period: certain as soon as text follows
    assert buf.append("！O") == ["再见！"]
    buf.clear()
    buf.clear()
    long = "word " * 30  # no punctuation: still spoken, in pieces at word boundaries, nothing lost
    pieces = buf.append(long) + buf.flush()
    assert all(len(p) <= 40 for p in pieces) and " ".join(pieces).split() == long.split()


def test_trailing_whitespace_is_not_lost():
    """ "Hello world. " gave empty_text over HTTP (the sentence came out of append)."""
    buf = TextBuffer(500)
    assert buf.append("Hello world. \n") + buf.flush() == ["Hello world."]
    assert TextBuffer(500).flush() == []


@pytest.mark.parametrize("blank", [" " * 600, "\t\u3000 " * 200, "Done. " + " " * 600])
def test_whitespace_past_the_budget_is_nothing_to_speak(blank):
    """Whitespace alone past the utterance budget (an LLM streaming indentation) was cut into no pieces and raised
    IndexError: every socket API ended the session with `internal`."""
    buf = TextBuffer(100)
    spoken = buf.append(blank)
    assert spoken + buf.append("Next one. And") + buf.flush() == [
        *(["Done."] if "Done" in blank else []),
        "Next one.",
        "And",
    ]
    assert stream(blank, 7, budget=100) == (["Done."] if "Done" in blank else [])


@pytest.mark.parametrize("text", ["😀" * 600, "д" * 1500, "👨‍👩‍👧" * 50, "e\u0301" * 300, "中" * 900])
def test_long_text_is_cut_by_utf8_length_and_nothing_is_lost(text):
    """The prompt is one frame per byte, so the budget counts bytes, and a cut never splits a
    character or a cluster (family emoji, combining accents)."""
    pieces = stream(text, 37, budget=100)
    assert "".join(pieces) == text
    assert all(utf8_len(p) <= 100 for p in pieces)
    if not text.startswith(("👨", "e")):  # no clusters: every piece but the last is full to a character
        assert all(utf8_len(p) > 100 - 4 for p in pieces[:-1])
    if text.startswith("👨"):
        assert all(p.startswith("👨") and p.endswith("👧") for p in pieces)
    if text.startswith("e"):
        assert all(p.startswith("e") and p.endswith("\u0301") for p in pieces)


@pytest.mark.parametrize("text", ["a" + "\u0301" * 9999, "\u200d" * 5000, "👍" + "\U0001f3fb\ufe0f" * 3000])
def test_a_cluster_past_the_budget_is_cut_at_the_budget(text):
    """A cluster longer than the budget can only be cut inside: in pieces as large as fit, nothing lost. It was cut
    a character at a time (10,000 one-character utterances for one letter with 9,999 accents), and each cut looked at
    the whole rest of the text: one socket message held the event loop, every session's audio, ~0.6 s."""
    pieces = split_to_budget(text, 100)
    assert "".join(pieces) == text
    assert all(utf8_len(p) <= 100 for p in pieces)
    assert len(pieces) <= utf8_len(text) // 96 + 1  # each but the last full to a character (4 bytes at most)


def test_long_sentences_are_cut_at_clauses_then_spaces():
    s = "This is a long clause, with a comma; and then more words here and there and everywhere"
    assert split_to_budget(s, 50) == [
        "This is a long clause, with a comma;",
        "and then more words here and there and everywhere",
    ]
    assert split_to_budget("aaaa bbbb cccc", 9) == ["aaaa", "bbbb cccc"]


@pytest.mark.parametrize("step", [7, 100_000])
def test_marks_are_not_spoken_and_cost_nothing_of_the_budget(step):
    """A mark after every word (a voice agent's word-by-word bookmarks) made a sentence of 60 words 5 utterances: its
    marks counted as the text the prompt holds, which the gateway takes them out of. One utterance now; a sentence whose
    words pass the budget is still cut by them, each piece's spoken text within it, nothing lost."""
    sentence = " ".join(f'word{i}<mark name="after-word-{i}"/>' for i in range(60)) + "."
    assert utf8_len(sentence) > 1500 and utf8_len(re.sub(r"<[^>]*>", "", sentence)) < 500
    buffer = TextBuffer(500)
    out = [s for i in range(0, len(sentence) + 7, step) for s in buffer.append((sentence + " Next. ")[i : i + step])]
    assert out == [sentence] and split_to_budget(sentence, 500) == [sentence]
    marks_alone = "".join(f'<mark name="m{i}"/>' for i in range(600))
    assert split_to_budget(marks_alone, 500) == [marks_alone]
    long = " ".join(f'w{i}<mark name="m{i}"/>' for i in range(600))
    pieces = split_to_budget(long, 500)
    assert " ".join(pieces) == long and len(pieces) == 6
    assert all(utf8_len(re.sub(r"<[^>]*>", "", p)) <= 500 for p in pieces)
    assert split_to_budget("a" * 1000, 500) == ["a" * 500] * 2  # (text alone as before)


@pytest.mark.parametrize(
    "tag",
    [
        '<break time="100ms"/>',
        '<break strength="none"/>',
        "<break/></break>",
        '<emotion value="happy"/>',
        "</emotion>",
        "[ happy ]",
        "<p><s>",
        "<!-- a note -->",
        '<mark name="m"/>',
    ],
)
def test_breaks_and_style_tags_cost_nothing_of_the_budget(tag):
    """The utterance budget counts what is spoken: a sentence with breaks and style tags (each taken out before the
    engine, as a mark is) is cut into no more pieces than the same sentence without them. Counted, 8 breaks in a
    sentence of 45 bytes at a budget of 60 cut it into 5 requests where it is one."""
    words = [f"word{i}" for i in range(9)]
    plain = " ".join(words) + "."
    tagged = f" {tag} ".join(words) + "."
    assert utf8_len(plain) < 60 < utf8_len(tagged)
    assert len(split_to_budget(tagged, 60)) == len(split_to_budget(plain, 60)) == 1
    buffer = TextBuffer(60)
    assert buffer.append(tagged + " Next. ") == [tagged]
    # past the budget the spoken words still are cut by it, nothing lost, never inside a tag
    long = f" {tag} ".join(f"w{i}" for i in range(100)) + "."
    pieces = split_to_budget(long, 60)
    assert " ".join(pieces) == long and len(pieces) == len(split_to_budget(" ".join(f"w{i}" for i in range(100)), 60))


def test_the_gateways_cut_of_spoken_text_counts_every_character():
    """The gateway cuts the spoken text (normalized, its tags long taken out) to the budget again: there a tag's
    characters are spoken (a CDATA section's content as written), each one a byte of the prompt, none free: 100 marks
    as text were one piece of 1,600 bytes past a budget of 50."""
    spoken = '<mark name="x"/> [happy] <break time="1s"/>' * 40
    pieces = split_to_budget(spoken, 50, spoken_only=False)
    assert all(utf8_len(p) <= 50 for p in pieces) and "".join(pieces).replace(" ", "") == spoken.replace(" ", "")


def test_a_long_sentence_is_never_cut_inside_a_tag():
    """A cut that would fall inside a break or style tag moves before it: its halves would be spoken as text."""
    s = 'Words words words <speed ratio="1.5"/> more words.'  # (a tag refused later: its characters counted)
    assert split_to_budget(s, 30) == ["Words words words", '<speed ratio="1.5"/> more', "words."]
    # (a tag a piece begins with is no place to cut: `then` fits after it)
    assert split_to_budget("Some words [ note ] then more.", 16) == ["Some words", "[ note ] then", "more."]
    # (a break costs nothing: the cut falls by the words)
    said = 'Say it <break time="1s"/> and on and on'
    assert split_to_budget(said, 12) == ['Say it <break time="1s"/> and', "on and on"]


@pytest.mark.parametrize("reference", ["&amp;", "&#233;", "&#x1F600;"])
def test_a_long_sentence_without_spaces_is_never_cut_inside_a_character_reference(reference):
    """A cut between characters (no space: CJK) moves before a reference it would split: `&a` and `mp;` were each
    spoken as text."""
    for n in range(12):
        pieces = split_to_budget("数" * n + reference + "数" * 12, 20)
        assert "".join(pieces) == "数" * n + reference + "数" * 12
        assert [p for p in pieces if "&" in p and reference not in p] == [], pieces


@pytest.mark.parametrize("tag", ['<break time="1s"/>', '<emotion value="happy"/>', '<say-as interpret-as="digits">'])
def test_a_tag_that_begins_a_long_sentence_without_spaces_is_not_cut_at_its_own_space(tag):
    """A sentence past the budget with no space but those inside the tag it begins with (CJK text after a break): the
    cut fell at the tag's own space ('<break' | 'time="1s"/>数数...'), and both halves were refused (bad_text)."""
    text = tag + "数" * 300
    pieces = split_to_budget(text, 500)
    spoken = [utf8_len(p.replace(tag, "")) for p in pieces]  # (a break or emotion tag costs nothing)
    assert pieces[0].startswith(tag) and "".join(pieces) == text and all(n <= 500 for n in spoken), pieces


@pytest.mark.parametrize(
    "element",
    ['<sub alias="Big Apple">New York City</sub>', '<say-as interpret-as="characters">AB CD EF</say-as>'],
)
@pytest.mark.parametrize("words", range(40, 50))
def test_a_long_sentence_is_never_cut_inside_an_element_spoken_whole(element, words):
    """A cut that would fall inside a say-as or sub element (at a space of its text) moves before its opening: each
    half was refused (bad_text, a valid sentence's audio lost) when the budget's cut fell there. One longer than the
    budget is still cut (and refused)."""
    s = "word " * words + f"the {element} is big today."
    pieces = split_to_budget(s, 250)
    assert sum(element[:4] in p for p in pieces) == 1 and any(element in p for p in pieces), pieces
    assert " ".join(pieces) == s.strip() and all(utf8_len(p) <= 250 for p in pieces)
    assert [element[:4] in p for p in split_to_budget(element + " x", 20)].count(True) == 1  # longer: cut


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_bang_that_opens_no_xml_markup_does_not_hold_the_sentences_after_it(step):
    """`<!` opens XML's markup only as `<!--` or `<!DOCTYPE` (or cut before either): prose's `<!` held every sentence
    after it as one, to the flush (and, spoken as it comes, held them all back)."""
    assert stream("Wow <! that is it. Next one. More.", step) == ["Wow <!", "that is it.", "Next one.", "More."]
    assert unfinished_tag_start("Wow <! that is it. Next") is None
    assert [unfinished_tag_start(t) for t in ("Hi <!", "Hi <!-", "Hi <!DOC", "Hi <!-- a")] == [3, 3, 3, 3]


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize(
    "text",
    [
        '<sub alias="United States">U.S.</sub> is big. Next.',
        '<say-as interpret-as="characters">A.B.C.</say-as> it is. Next.',
        'Go <sub alias="doctor">Dr.</sub> Smith. Next.',
        'Code <SAY-AS interpret-as="characters">X. Y Z</say-as> ok. Next.',  # words after the period, inside
        "Spell <spell>A.B.</spell> now. Next.",
        "Hi <!-- Note. This is how. Really? --> there. Next.",  # a comment (taken out: cut, each half was refused)
    ],
)
def test_a_sentence_is_not_cut_inside_an_element_read_as_a_whole(text, step):
    """The segmenter cut `<sub alias="United States">U.` from `S.</sub> is big.` (its halves were refused: each an
    element not whole), whatever pieces the text arrives in; nor is text cut after an opening whose closing is still
    to come."""
    assert stream(text, step) == [text.removesuffix(" Next."), "Next."]
    buf = TextBuffer(500)
    assert buf.append('Say <sub alias="x">A. B C D E ') == [] and buf.append("F</sub> now. And so ") == [
        'Say <sub alias="x">A. B C D E F</sub> now.'
    ]


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(st.characters(blacklist_categories=("Cs",)), max_size=400),
    step=st.integers(1, 50),
    budget=st.integers(8, 120),
)
def test_every_character_is_spoken_once_in_order(text, step, budget):
    pieces = stream(text, step, budget=budget)
    assert "".join("".join(p.split()) for p in pieces) == "".join(text.split())
    assert all(p.strip() and utf8_len(p) <= budget for p in pieces)


CDATA_TEXT = 'Say <![CDATA[a < bc. Tom & [x] <break time="1s"/>]]> then. <![CDATA[<p>!]]> Done.'
CDATA_SENTENCES = [
    "Say a &lt; bc.",
    'Tom &amp; &#91;x&#93; &lt;break time="1s"/&gt; then.',
    "&lt;p&gt;!",
    "Done.",
]


@pytest.mark.parametrize("step", [1, 2, 3, 5, 9, 11, 1000])
def test_a_cdata_sections_text_is_cut_as_text_whatever_pieces_it_arrives_in(step):
    """A CDATA section's content is held as text (its markup as character references, which the rest of the gateway
    speaks as the characters): its sentences are cut as any text's, the same whatever pieces it arrives in, and no
    piece of its opening or end is left in them (a section cut across messages was read aloud as markup)."""
    assert stream(CDATA_TEXT, step) == CDATA_SENTENCES


@pytest.mark.parametrize(
    ("text", "held"),
    [
        ("Hi. <![CDATA[a. b", "a. b<![CDATA["),  # its text so far is text: only its opening waits for its end
        ("Hi. <![CDATA[a. b]", "a. b<![CDATA[]"),  # (a `]` may begin its end)
        ("Hi. <![CD", "<![CD"),
        ("Hi. <!", "<!"),
    ],
)
def test_a_cdata_section_still_open_holds_back_only_its_opening(text, held):
    buf = TextBuffer(500)
    assert buf.append(text) in ([], ["Hi."]) and buf.text.endswith(held), buf.text
    start = unfinished_tag_start(buf.text)
    assert start is not None and buf.text[start:].startswith("<!"), buf.text


def test_a_cdata_section_past_the_budget_is_cut_into_pieces_of_text():
    """A section longer than an utterance: its text cut at the budget, between words, each piece text (it began a
    piece spoken whole, and was cut inside, its halves refused)."""
    words = " ".join(f"w{i}<" for i in range(60))
    out = stream(f"<![CDATA[{words}]]>", 7, budget=100)
    assert len(out) > 2 and all(utf8_len(s) <= 100 for s in out), out
    assert " ".join(out).split() == [f"w{i}&lt;" for i in range(60)], out


@pytest.mark.parametrize("budget", [12, 20, 500])
def test_a_cdata_section_cut_into_sentences_anywhere_speaks_its_content_as_written(budget):
    """A CDATA section's content is cut into sentences and budget pieces as prose is (7 to 24 pieces here, most of them
    inside the section), wherever the messages that bring it are cut (at every character, into three): harmless. The
    buffer holds its content as character references (`cdata_as_text`), so no piece holds its markup (`]]>` never read
    aloud, the second half of a cut never parsed as tags): each piece's breaks and tags (what a session queues:
    `split_breaks`, `split_tags`) are none, nothing is refused, and the characters spoken are the content's, in order
    (a cut only moves where one utterance ends: a word longer than a tiny budget is cut, as in prose)."""
    content = (
        'One. <break time="1s"/> & [happy] a < b? <mark name="m"/> ]] Two; <!-- x --> three <sub alias="x">U.S.</sub>.'
    )
    text = "Say <![CDATA[" + content + " Four.]]> after."
    expected = "".join(["Say", *content.split(), "Four.", "after."])
    counts = set()
    for i in range(len(text) + 1):
        for j in {i, min(len(text), i + 3), min(len(text), i + 11)}:
            buffer = TextBuffer(budget)
            pieces = buffer.append(text[:i]) + buffer.append(text[i:j]) + buffer.append(text[j:]) + buffer.flush()
            spoken: list[str] = []
            for piece in pieces:
                parts = split_breaks(piece)
                assert all(isinstance(p, str) for p in parts), (i, j, piece)  # no break made of its content
                tagged = [t for p in parts for t in split_tags(str(p))]
                assert all(isinstance(t, str) for t in tagged), (i, j, piece)  # nor a tag, nor a mark
                spoken += [str(t) for t in tagged]
            assert "".join("".join(spoken).split()) == expected, (i, j, pieces)
            counts.add(len(pieces))
    assert min(counts) >= (7 if budget == 500 else 16), counts
