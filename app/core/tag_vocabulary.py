"""The inline tags' vocabulary: which words and elements of a text are tags rather than words to read, the
emotion words that both the tags and OpenAI's `instructions` name, and `markup_in`, the first tag a text holds.

It also holds how a tag is written: its bound (TAG_MAX), an attribute (`ATTRIBUTE`, `name="value"`) and the one
reader of a tag's attributes (`attributes`), which every element that reads one uses (a break's time and strength, an
emotion's value, a say-as' interpret-as, a sub's alias); how XML's character references are (`REFERENCE`, and
`reference_start`, one still arriving); and XML's own markup around SSML's elements (`XML_MARKUP`: a declaration, a
comment, a document type, taken out).

Its readers: app/core/style_tags.py splits a text at its tags and applies them, app/core/breaks.py reads its breaks,
app/core/instructions.py maps an instruction's words onto the emotion axes, app/voices/lexicons.py refuses a
pronunciation rule whose alias holds a tag, app/core/text_buffer.py cuts no sentence inside a say-as or sub element
and keeps the marks (`MARK`) that follow a sentence with it.
Of app/ it imports only io/errors.py, so each of them can import it: the options import the dictionaries, and the
tags and the instructions import the options (tests/unit/test_contract.py: no import circle).
"""

from __future__ import annotations

import re

from app.io.errors import GatewayError as G
from app.io.errors import RequestError

# characters inside a tag's < > at most (a break's, an emotion element's): the text buffer never cuts inside one,
# and the patterns look no further for its end (unbounded, each opening with no end looks through the rest of the
# text: 1666 "<break" in one message take the event loop 0.25 s)
TAG_MAX = 200
BREAK_OPEN = re.compile(r"<\s*break\b", re.IGNORECASE)  # an opening that starts no whole tag was cut: refused
# an element's end (`<break time="1s"></break>`, as XML writers and SSML-writing LLMs send it): nothing to do, not text
BREAK_END = re.compile(r"<\s*/\s*break\s*>", re.IGNORECASE)
# a whole break tag: its attributes (app/core/breaks.py reads them) and its '>'
BREAK_TAG = re.compile(rf"<\s*break\b([^<>]{{0,{TAG_MAX}}})>", re.IGNORECASE)

# A tag's attribute, as a pattern: a space, its name (whole: `data-alias` is no alias), `=` and its value, "quoted",
# 'quoted' (a quoted value may hold '>', not '<') or bare (no space, quote, '<', '>', '=' or '/'); `name="value"` only,
# so that text between a '<s' and a '>' that is no tag (`if a<s and b>c`) is no attributes
ATTRIBUTE = rf"""\s+[\w:.-]+\s*=\s*(?:"[^"<]{{0,{TAG_MAX}}}"|'[^'<]{{0,{TAG_MAX}}}'|[^\s"'<>=/]{{1,{TAG_MAX}}})"""
# the last attribute of a tag still arriving (`ti`, `time=`, `time="1`), or none
ATTRIBUTE_ARRIVING = rf"""(?:\s+[\w:.-]*(?:\s*=\s*(?:"[^"<]{{0,{TAG_MAX}}}|'[^'<]{{0,{TAG_MAX}}}|[^\s"'<>=/]*))?)?"""
_ATTRIBUTE = re.compile(ATTRIBUTE)
_TAG_END = re.compile(r"\s*(?:/\s*)?")  # what may follow a tag's attributes before its '>'


def attributes(text: str, written: str) -> dict[str, str]:
    """A tag's attributes, `text` being what follows its name up to its '>' (a closing '/' with it): each name (lower
    case) -> its value as written (quotes off, character references kept). Read attribute by attribute, so that a
    quoted value (`foo="strength=none"`) is never read as another attribute. Text that is not attributes (a stray
    quote, a name without a value, no space between two) or a name twice (XML forbids it) is refused (`bad_text`),
    naming the tag as `written`."""
    found: dict[str, str] = {}
    pos = 0
    while m := _ATTRIBUTE.match(text, pos):
        name, _, value = m.group(0).partition("=")
        name, value = name.strip().lower(), value.strip()
        # XML forbids a name twice in one tag (`<mark name="a" name="b"/>` reported `a`, another reader may take `b`)
        if name in found:
            raise RequestError(G.BAD_TEXT, f"a tag names each attribute once, not {name!r} twice: {written[:60]!r}")
        found[name] = value[1:-1] if value[0] in "\"'" else value
        pos = m.end()
    if not _TAG_END.fullmatch(text, pos):
        what = 'a tag\'s attributes are name="value" pairs (quotes optional), a space before each'
        raise RequestError(G.BAD_TEXT, f"{what}: {written[:60]!r}")
    return found


# what follows an element's name in an opening still arriving at the end of a text: attributes, the last perhaps cut
# (`alias="a >`: a quoted value may hold '>'), a closing '/' perhaps
ATTRIBUTES_ARRIVING = rf"(?:{ATTRIBUTE})*{ATTRIBUTE_ARRIVING}\s*(?:/\s*)?\Z"
_ARRIVING = re.compile(ATTRIBUTES_ARRIVING)


def still_arriving(text: str, name_end: int) -> bool:
    """Whether the element opening whose name ends at `name_end` runs to the end of `text` as attributes still
    arriving: a streamed message's last tag, which a later message completes."""
    return _ARRIVING.match(text, name_end) is not None


# XML's character references (an SSML writer escapes every '&' and '<' of its text): `&amp;` and the other four names,
# `&#233;`, `&#xE9;` (app/core/style_tags.py `unescape` reads them); the text buffer cuts none
REFERENCE_NAMES = {"amp": "&", "lt": "<", "gt": ">", "quot": '"', "apos": "'"}
# a reference's digits (U+10FFFF) and letters at most
_DECIMALS, _HEXES, _LETTERS = 7, 6, max(map(len, REFERENCE_NAMES))
REFERENCE = re.compile(
    rf"&(?:({'|'.join(REFERENCE_NAMES)})|#([0-9]{{1,{_DECIMALS}}})|#[xX]([0-9a-fA-F]{{1,{_HEXES}}}));"
)
# a reference cut before its ';' at the end of a text (`&`, `&am`, `&#`, `&#12`, `&#x1F`): more text may complete it
_REFERENCE_ARRIVING = re.compile(
    rf"&(?:#(?:[0-9]{{0,{_DECIMALS}}}|[xX][0-9a-fA-F]{{0,{_HEXES}}})|([a-z]{{0,{_LETTERS}}}))\Z"
)


def reference_start(text: str) -> int | None:
    """Where the word of an XML character reference still arriving begins at the end of `text` (`AT&am`, `x &#12`:
    what follows may complete it, `p;T`; the word with it, so that `AT&amp;T` is one word, not `AT` and `&T`), None if
    it ends in none (`&b`, `& `, `&amp;`: text, or a whole reference)."""
    m = _REFERENCE_ARRIVING.search(text, max(0, len(text) - 3 - _DECIMALS))
    if m is None or (m.group(1) is not None and not any(n.startswith(m.group(1)) for n in REFERENCE_NAMES)):
        return None
    start = m.start()
    while start > 0 and text[start - 1].isalnum():
        start -= 1
    return start


# The emotion words of OpenAI's `instructions` (app/core/instructions.py, docs/clients.md), each a bracket tag too:
# word (its stem: "cheerful" also matches "cheerfully") -> (valence, arousal) on the emotion axes
EMOTION_WORDS: dict[str, tuple[float, float]] = {
    "cheerful": (0.6, 0.4),
    "happy": (0.6, 0.3),
    "joyful": (0.7, 0.5),
    "excited": (0.5, 0.7),
    "enthusiastic": (0.5, 0.6),
    "upbeat": (0.5, 0.4),
    "warm": (0.4, -0.1),
    "friendly": (0.4, 0.1),
    "calm": (0.1, -0.5),
    "soothing": (0.2, -0.6),
    "relaxed": (0.2, -0.5),
    "gentle": (0.2, -0.4),
    "serious": (-0.1, -0.1),
    "sad": (-0.6, -0.3),
    "somber": (-0.5, -0.4),
    "melancholic": (-0.6, -0.4),
    "angry": (-0.6, 0.6),
    "furious": (-0.8, 0.8),
    "annoyed": (-0.4, 0.3),
    "scared": (-0.5, 0.6),
    "nervous": (-0.3, 0.5),
    "energetic": (0.3, 0.7),
    "tired": (-0.2, -0.6),
    "bored": (-0.3, -0.5),
}
NEUTRAL = "neutral"  # back to the request's own emotion
# Emotions a tag may name beyond EMOTION_WORDS, with their (valence, arousal): Cartesia's emotion
# names that are too common as plain words for the instructions ("content") to read them there.
TAG_EMOTIONS: dict[str, tuple[float, float]] = {
    **EMOTION_WORDS,
    "content": (0.4, -0.2),
    "surprised": (0.2, 0.6),
    "curious": (0.2, 0.3),
    "frustrated": (-0.5, 0.4),
    "disappointed": (-0.5, -0.2),
    "anxious": (-0.4, 0.5),
    "confident": (0.3, 0.2),
}
# Bracket words that are tags ZONOS2 has no control for (ElevenLabs' v3 audio tags): refused, not spoken.
UNSUPPORTED_TAGS = frozenset(
    {
        "whisper",
        "whispers",
        "whispering",
        "shout",
        "shouts",
        "shouting",
        "laugh",
        "laughs",
        "laughing",
        "chuckles",
        "giggles",
        "sigh",
        "sighs",
        "exhales",
        "inhales",
        "crying",
        "sobbing",
        "sarcastic",
        "mischievously",
        "singing",
    }
)
TAG_WORDS = frozenset(TAG_EMOTIONS) | UNSUPPORTED_TAGS | {NEUTRAL}  # every bracket word that is a tag

# Inline elements ZONOS2 has no in-text control for (Cartesia's speed and volume, ElevenLabs' SSML phoneme, and SSML's
# prosody, emphasis, audio, voice and lang, which an agent written for an SSML engine sends): tags, refused, so that
# the client hears of it rather than "prosody rate equals slow" (the request's own speed, voice and language apply)
# and the vendors' own SSML elements (Amazon Polly's `amazon:`, Azure's `mstts:`), which an agent written for them
# sends: ZONOS2 has none of their controls (whispering, a speaking style, breaths, a domain's reading); were read aloud
VENDOR_ELEMENTS = frozenset(
    {
        "amazon:effect",
        "amazon:domain",
        "amazon:breath",
        "amazon:auto-breaths",
        "amazon:emotion",
        "mstts:express-as",
        "mstts:silence",
        "mstts:viseme",
        "mstts:backgroundaudio",
        "mstts:audioduration",
        "mstts:voiceconversion",
        "mstts:ttsembedding",
    }
)
UNSUPPORTED_ELEMENTS = (
    frozenset({"speed", "volume", "phoneme", "prosody", "emphasis", "audio", "lang"}) | VENDOR_ELEMENTS
)
# SSML's structure (the document, paragraphs, sentences; `<voice>`, in which an Azure document wraps all its text, so
# that refusing it refused every Azure-written text), which asks for nothing ZONOS2 would speak otherwise: its tags
# are taken out and the text inside them spoken by the request's voice (a voice element names none of ours)
WRAPPER_ELEMENTS = frozenset({"speak", "p", "s", "voice"})
# SSML's `<mark name="..."/>`: a named point of the text, never spoken, reported on our socket once the audio before it
# has been sent (app/core/style_tags.py `Mark`, docs/protocol.md "Marks"); its name is echoed back, so it is bounded
MARK_ELEMENT = "mark"
MARK_NAME_MAX = 128  # characters of a mark's name at most (its character references read)
# a whole mark: its attributes (read by `attributes`, which refuses any that are not name="value" pairs) and its '>'
MARK = re.compile(rf"<\s*{MARK_ELEMENT}(?![\w-])([^<>]{{0,{TAG_MAX}}})>", re.IGNORECASE)
# SSML's elements whose text is read otherwise (say-as spelled or as written, by its interpret-as; sub as its alias):
# each is whole in the sentence it is spoken in (the text buffer cuts none inside one)
READ_AS_ELEMENTS = frozenset({"say-as", "sub"})
# every inline element's name: a text that ends inside one (`Hi <emo`, `Hi <pros`) ends in a tag still arriving
ELEMENT_NAMES = frozenset(
    {"break", "emotion", "spell", MARK_ELEMENT, *UNSUPPORTED_ELEMENTS, *WRAPPER_ELEMENTS, *READ_AS_ELEMENTS}
)
# the elements whose opening must end with its '>' in its sentence (breaks' and emotions' are below): `<speak` too,
# whose attributes a pretty-printed document puts on lines of their own (a newline ends a sentence, and each half was
# read aloud: "speak version equals"); not `<p` and `<s`, which ordinary text writes (`a <s b`, `x<p`)


def names_pattern(names: frozenset[str] | set[str]) -> str:
    """A regex alternation of element names, the longest first (so that `say-as` is never read as a shorter name)."""
    return "|".join(re.escape(n) for n in sorted(names, key=lambda n: (-len(n), n)))


_ELEMENT_NAMES = names_pattern(UNSUPPORTED_ELEMENTS | READ_AS_ELEMENTS | {"spell", "speak", MARK_ELEMENT})

# a bracket holding one word: a tag when the word is of TAG_WORDS (`[happy]`), text otherwise (`[1]`, `[smug]`)
BRACKET = re.compile(r"\[\s*([A-Za-z]+)\s*\]")
# an element's opening (UNSUPPORTED_ELEMENTS', READ_AS_ELEMENTS', Cartesia's spell, SSML's speak and mark; an emotion
# element's below): one that does not start a whole element was cut (a newline ends a sentence at once, a long tag is
# cut at the utterance budget) and is refused, so that no half of it is read aloud
ELEMENT_OPEN = re.compile(rf"<\s*(?:/\s*)?({_ELEMENT_NAMES})(?![\w-])", re.IGNORECASE)
EMOTION_OPEN = re.compile(r"<\s*(?:/\s*)?emotion\b", re.IGNORECASE)
# XML's own markup an SSML document may hold around its elements (the W3C's examples begin with the declaration): the
# declaration and other processing instructions (`<?xml version="1.0"?>`), comments and the document type ask for
# nothing spoken, and are taken out as SSML's structure is (app/core/style_tags.py `unwrap`); each is whole in its
# sentence (the text buffer cuts no comment), else `bad_text`. A comment holds no `--` (XML's rule: so one opening
# that is no comment, of many, costs a few characters' look). An arrow (`-->`) and a `<!` that opens none are text
XML_MARKUP = re.compile(
    rf"<\?[^<>]{{0,{TAG_MAX}}}\?>|<!--(?:[^-]|-(?!-)){{0,{TAG_MAX}}}-->|<!DOCTYPE\b[^<>]{{0,{TAG_MAX}}}>",
    re.IGNORECASE,
)
# (and an opening of a CDATA section no `]]>` ends: `cdata_as_text` leaves one only while its end may still come)
XML_MARKUP_OPEN = re.compile(r"<(?:\?|!--|!DOCTYPE\b|(?-i:!\[CDATA\[))", re.IGNORECASE)

# XML's CDATA sections (`<![CDATA[if a < b && c]]>`): their content is text, as written, whatever it holds (markup in
# one is no markup: `<![CDATA[<break time="1s"/>]]>` is those characters, spoken, not a break), as Azure's and Polly's
# XML readers take it; an SSML writer wraps text with `&` and `<` in one rather than escape them. `cdata_as_text` makes
# each one's content text the rest of the gateway reads as written: its `&`, `<`, `>` and brackets as XML character
# references (`unescape` turns them back into the characters, spoken; no tag, break or bracket tag is read in them)
CDATA_OPEN, CDATA_END = "<![CDATA[", "]]>"
_AS_WRITTEN = {"&": "&amp;", "<": "&lt;", ">": "&gt;", "[": "&#91;", "]": "&#93;"}
_NOT_AS_WRITTEN = re.compile(r"[&<>\[\]]")
# at the end of a text: a section still open (its opening, then the `]` or `]]` that may begin its end), or its
# opening cut (`<`, `<!`, ..., `<![CDATA`): what a later message may go on with
_CDATA_TAIL = re.compile(r"<!\[CDATA\[\]{0,2}\Z|<(?:!(?:\[(?:C(?:D(?:A(?:T(?:A)?)?)?)?)?)?)?\Z")


def _as_written(content: str) -> str:
    return _NOT_AS_WRITTEN.sub(lambda m: _AS_WRITTEN[m.group(0)], content)


# the text before a CDATA opening that puts it in an element's attribute value (`<mark name="`): an opening, a space
_IN_ATTRIBUTE_VALUE = re.compile(r"<\s*[\w:.-]+\s[^<>]*=\s*[\"']?\Z")


def cdata_as_text(text: str, before: str = "") -> str:
    """`text` with each CDATA section's content as text (`cdata_as_text('a <![CDATA[<b> & c]]>')` is
    `'a &lt;b&gt; &amp; c'`). A section with no end yet (a streamed message's, whose `]]>` a later one brings) has its
    content so far as text before its opening, which stays at the end with a `]` or `]]` that may begin its end
    (`'<![CDATA[a]'` is `'a<![CDATA[]'`): so its text is cut into sentences as any text is, and the tail left is a few
    characters (the text buffer cuts none inside it, `cdata_tail` finds it for the text that goes on, `before` the text
    before that tail). Twice is once."""
    if CDATA_OPEN not in text:
        return text
    out: list[str] = []
    pos = 0
    while (start := text.find(CDATA_OPEN, pos)) >= 0:
        out.append(text[pos:start])
        content = start + len(CDATA_OPEN)
        end = text.find(CDATA_END, content)
        lead = before[-TAG_MAX:] if pos == 0 else ""  # (the text `text` goes on from: a section at its start)
        if _IN_ATTRIBUTE_VALUE.search(lead + text[max(pos, start - TAG_MAX) : start]):
            # XML has no markup in an attribute's value: the section is no section there but its characters as written
            # (`<mark name="<![CDATA[x]]>"/>` named `x`, `time="<![CDATA[1s]]>"` paused), a value the tag refuses; one
            # with no end yet stays as written, whole: the text buffer holds it to its end (`]]>`), the tag refused then
            if end < 0:
                return "".join(out) + text[start:]
            out.append(_as_written(text[start : end + len(CDATA_END)]))
            pos = end + len(CDATA_END)
            continue
        if end < 0:
            rest = text[content:]
            held = min(2, len(rest) - len(rest.rstrip("]")))
            out += [_as_written(rest[: len(rest) - held]), CDATA_OPEN, rest[len(rest) - held :]]
            return "".join(out)
        out.append(_as_written(text[content:end]))
        pos = end + len(CDATA_END)
    out.append(text[pos:])
    return "".join(out)


def cdata_tail(text: str) -> int | None:
    """Where a CDATA section still open (`cdata_as_text`'s tail), or its opening cut (`Say <![CD`), begins at the end of
    `text`, None if it ends in neither: the text that follows goes on from there."""
    m = _CDATA_TAIL.search(text, max(0, len(text) - len(CDATA_OPEN) - 2))
    return None if m is None else m.start()


# A whole emotion element's opening or closing (app/core/style_tags.py reads its value)
EMOTION_TAG = re.compile(rf"<\s*(?:(/)\s*)?emotion\b([^<>]{{0,{TAG_MAX}}})>", re.IGNORECASE)
# a structural tag: its name, attributes (`name="value"`, a quoted value may hold '>') and its '>'; only these, so that
# text between a '<s' and a '>' that is no tag (`if a<s and b>c`) is spoken, not taken out with them
# (app/core/style_tags.py `unwrap`); and XML's own markup (a declaration, a comment, a document type), and a mark's
# closing (`</mark>`)
STRUCTURE_TAG = re.compile(
    rf"<\s*(?:/\s*)?(?:{names_pattern(WRAPPER_ELEMENTS)})(?=[\s/>])(?:{ATTRIBUTE})*\s*(?:/\s*)?>|{XML_MARKUP.pattern}"
    rf"|<\s*/\s*{MARK_ELEMENT}\s*>",
    re.IGNORECASE,
)
# A bracket tag (a word of TAG_WORDS: `[happy]`, `[ Laughs ]`); any other bracket is text
BRACKET_TAG = re.compile(rf"\[\s*(?:{names_pattern(TAG_WORDS)})\s*\]", re.IGNORECASE)
# What a text's tags are that is never spoken (each taken out before the engine), with a whitespace before it (the
# words either side are one space apart once it is out): a mark, a break, an emotion or bracket tag, SSML's structure
# and XML's markup. The utterance budget counts none of it (app/core/text_buffer.py `split_to_budget`): counted, a
# sentence with tags was cut into more requests than the same words without them
_UNSPOKEN = (MARK, BREAK_TAG, BREAK_END, EMOTION_TAG, BRACKET_TAG, STRUCTURE_TAG)
UNSPOKEN_TAG = re.compile(r"\s?(?:" + "|".join(p.pattern for p in _UNSPOKEN) + ")", re.IGNORECASE)


def markup_in(text: str) -> str | None:
    """The first inline tag `text` holds, whole or cut (a break, a style tag, a Cartesia element), or None: for
    text that is read as it is, with no tags taken out of it (a pronunciation rule's alias)."""
    opens = [m for p in (BREAK_OPEN, BREAK_END, EMOTION_OPEN, ELEMENT_OPEN, XML_MARKUP_OPEN) if (m := p.search(text))]
    opens += [m for m in BRACKET.finditer(text) if m.group(1).lower() in TAG_WORDS][:1]
    first = min(opens, key=lambda m: m.start(), default=None)
    return None if first is None else text[first.start() : first.start() + 40]
