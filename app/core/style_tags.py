"""Inline style tags: Cartesia's `<emotion value="happy"/>` and bracket tags such as `[happy]` (ElevenLabs' v3
audio tags) in a text, on every API. A tag sets the emotion of the text after it, until the next tag or the end
of the turn; it is not spoken and is not part of any reported text or word time. The text after a tag
continues the text before it (the same continuation chain, as after a break: the voice does not reset).

Which bracket words are tags is app/core/tag_vocabulary.py's table (TAG_WORDS), and only it: a bracket holding
one word of the table (any case, spaces allowed inside the brackets) is a tag; any other bracket (`[1]`,
`[citation needed]`, `[smug]`) is text and is spoken as written. An `<emotion .../>` element is always a tag.

A tag becomes the emotion controls (app/core/emotion.py, --emotion-directions-dir): an emotion the folder has
as a named direction is that slider at weight 1; otherwise a word of TAG_EMOTIONS (the instructions' emotion
words and a few more) is its valence and arousal, when the folder has both axes. `neutral` (and `</emotion>`)
returns to the request's own emotion fields. The tag replaces the request's sliders, valence and arousal for its
text and keeps its strength and calibration key. A tag the server cannot apply (no emotion directions, no voice
to apply them to, an emotion it cannot map, a manner such as [whispering] that ZONOS2 has no control for) is
refused with `unsupported_tag`, never spoken as text and never dropped; a malformed `<emotion>` element is
`bad_text`.

Cartesia's other inline elements (what pipecat's CartesiaTTSService.SPELL, SPEED_TAG and VOLUME_TAG write):
`<spell>AB12</spell>` is not a tag but spelled text: its characters are spoken one by one ("A B 1 2"), in the utterance
it stands in (`spell_out`), a bracket's too (`<spell>[laughs]</spell>` is "[ l a u g h s ]": no tag in spelled text);
`<speed ratio="1.5"/>` and `<volume ratio="0.5"/>` are tags ZONOS2 has no in-text control for, refused with
`unsupported_tag` like [whispering]; so is ElevenLabs' SSML `<phoneme ...>` (ZONOS2 has no phoneme input, as for a
dictionary's phoneme rule), and SSML's `<prosody>`, `<emphasis>`, `<audio>` and `<lang>`, and Polly's
and Azure's own (`<amazon:effect>`, `<mstts:express-as>`, ...: UNSUPPORTED_ELEMENTS). SSML's structure, `<speak>`,
`<p>`, `<s>` and Azure's wrapping `<voice>` (WRAPPER_ELEMENTS) ask for nothing spoken: their tags are taken out
(`unwrap`) and the text inside them spoken. SSML's `<mark name="..."/>` is not spoken either: a named point of the
text (`Mark`), kept with the text around it (`MarkedText`: a mark does not cut an utterance) for our socket to report
once the audio before it is sent (app/core/timestamps.py `MarkTime`); a mark without a good name is `bad_text`
(`mark_name`). SSML's `<say-as>` and `<sub>` (READ_AS_ELEMENTS) are replaced by
what they say (`read_as`): a say-as that spells (interpret-as characters, spell-out, verbatim, digits, telephone)
becomes a spell element of its text, one of a number (cardinal, number) its text, read as written; any other
interpret-as is refused with `unsupported_tag`; `<sub alias="United States">U.S.</sub>` is its alias, spoken and
reported. Such an element is whole in its sentence (the text buffer cuts none inside one); an opening or closing left
alone, an empty alias or one holding a tag are `bad_text`, and so is a break tag their taking out would make of the
text around them (`A <<p>break time="1s"/>`: breaks were taken out before). None of them is ever read aloud as markup,
nor is an XML character reference (`&amp;` is `&`: `unescape`). A CDATA section's content is text as written, no tag in
it (`<![CDATA[<break time="1s"/>]]>` is those characters: app/core/tag_vocabulary.py `cdata_as_text`, which the text
buffer and the HTTP routes' whole texts apply first); one with no `]]>` is `bad_text`.
"""

from __future__ import annotations

import dataclasses
import re
import unicodedata
from dataclasses import dataclass

from app.core.options import SynthesisOptions
from app.core.tag_vocabulary import (
    ATTRIBUTE,
    BRACKET,
    BREAK_END,
    BREAK_OPEN,
    CDATA_END,
    CDATA_OPEN,
    ELEMENT_OPEN,
    EMOTION_OPEN,
    EMOTION_TAG,
    MARK,
    MARK_NAME_MAX,
    NEUTRAL,
    READ_AS_ELEMENTS,
    REFERENCE,
    REFERENCE_NAMES,
    STRUCTURE_TAG,
    TAG_EMOTIONS,
    TAG_MAX,
    TAG_WORDS,
    UNSUPPORTED_ELEMENTS,
    UNSUPPORTED_TAGS,
    XML_MARKUP_OPEN,
    attributes,
    markup_in,
    names_pattern,
    still_arriving,
)
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from engine.frontend.emotion import EmotionDirections

MAX_TAGS = 16  # tags in one text (each starts an utterance of the session's queue)
_UNSUPPORTED = names_pattern(UNSUPPORTED_ELEMENTS)
_ELEMENT = re.compile(rf"<\s*(?:/\s*)?({_UNSUPPORTED})(?![\w-])[^<>]{{0,{TAG_MAX}}}>", re.IGNORECASE)

_SPELL = re.compile(r"<\s*(?:(/)\s*)?spell\s*(?:/\s*)?>", re.IGNORECASE)
# SSML's say-as: the interpret-as values whose text is spelled (as Cartesia's <spell>), and those whose text is read as
# written (the text normalizer reads its numbers)
SAY_AS_SPELLED = ("characters", "spell-out", "verbatim", "digits", "telephone")
SAY_AS_READ = ("cardinal", "number")
_READ_AS = names_pattern(READ_AS_ELEMENTS)
# a whole say-as or sub element: its opening (name="value" attributes), its text (no tag in it) and its closing
_READ_AS_ELEMENT = re.compile(rf"<\s*({_READ_AS})((?:{ATTRIBUTE})*)\s*>([^<]*)<\s*/\s*\1\s*>", re.IGNORECASE)
# an opening or a closing of one that no whole element holds
_READ_AS_TAG = re.compile(rf"<\s*(?:(/)\s*)?({_READ_AS})(?=[\s/>])((?:{ATTRIBUTE})*)\s*(?:/\s*)?>", re.IGNORECASE)


@dataclass(frozen=True)
class StyleTag:
    name: str  # the emotion it names, lower case (NEUTRAL: the request's own)
    written: str  # the tag as the text has it (for errors)


@dataclass(frozen=True)
class Mark:
    """SSML's `<mark name="..."/>`: a named point of the text, not spoken (`mark_name` checks it)."""

    name: str


@dataclass(frozen=True)
class MarkedText:
    """Spoken text with the marks it holds: each (where it stands in `text`, a character index: the words that end by
    then are before it; its name), in order. `text` may be empty: marks with no text beside them (between two breaks
    or style tags, or a text of marks alone)."""

    text: str
    marks: tuple[tuple[int, str], ...]


def mark_name(written: str, attribute_text: str) -> str:
    """The name of a mark (as `written`; `attribute_text`, what follows its element name), its character references
    read: refused (`bad_text`) when it has none, an empty one, one longer than MARK_NAME_MAX characters, or one
    holding markup or a character that is not printable (a name is echoed back, never spoken)."""
    name = attributes(attribute_text, written).get("name")
    if name is None:
        raise RequestError(G.BAD_TEXT, f'a mark needs a name, such as <mark name="here"/>: {written[:60]!r}')
    if any(not _printable_reference(m) for m in REFERENCE.finditer(name)):  # (`unescape` drops it: the name changed)
        raise RequestError(G.BAD_TEXT, f"a mark's name holds only printable characters: {written[:60]!r}")
    name = unescape(name)
    if not name.strip():
        raise RequestError(G.BAD_TEXT, f"a mark's name is not empty: {written[:60]!r}")
    if len(name) > MARK_NAME_MAX:
        raise RequestError(G.BAD_TEXT, f"a mark's name is at most {MARK_NAME_MAX} characters: {written[:60]!r}")
    if "<" in name or ">" in name or markup_in(name) is not None or not name.isprintable():
        raise RequestError(G.BAD_TEXT, f"a mark's name holds no markup and only printable characters: {written[:60]!r}")
    return name


def _tags(text: str, partial: bool) -> list[tuple[int, int, StyleTag | Mark]]:
    found: list[tuple[int, int, StyleTag | Mark]] = []
    # a bracket in spelled text is characters to spell (`<say-as interpret-as="characters">[laughs]</say-as>`), no tag
    spelled = [(start, end) for start, end, inside in _spell_pieces(text) if inside] if "<" in text else []
    for m in BRACKET.finditer(text):
        word = m.group(1).lower()
        if word in TAG_WORDS and not any(start <= m.start() < end for start, end in spelled):
            found.append((m.start(), m.end(), StyleTag(word, m.group(0))))
    last_end = text.rfind(">")
    marks = list(MARK.finditer(text))
    whole = {m.start() for m in (*_ELEMENT.finditer(text), *_SPELL.finditer(text), *marks)}
    for o in ELEMENT_OPEN.finditer(text):
        if o.start() not in whole and not (partial and (last_end < o.start() or still_arriving(text, o.end()))):
            cut, name = text[o.start() : o.start() + 60], o.group(1).lower()
            raise RequestError(G.BAD_TEXT, f"a {name} tag must end with '>' in the same sentence: {cut!r}")
    for o in XML_MARKUP_OPEN.finditer(text):  # (whole ones were taken out: `unwrap`; a CDATA section's is text)
        if not (partial and last_end < o.start()):
            cut = text[o.start() : o.start() + 60]
            what = f"XML's markup ends with '>' in its sentence, within {TAG_MAX} characters (a comment holds no '--')"
            if cut.startswith(CDATA_OPEN):
                what = f"a CDATA section ends with {CDATA_END!r} in its text"
            raise RequestError(G.BAD_TEXT, f"{what}: {cut!r}")
    for m in _ELEMENT.finditer(text):
        found.append((m.start(), m.end(), StyleTag(m.group(1).lower(), m.group(0))))
    for m in marks:
        found.append((m.start(), m.end(), Mark(mark_name(m.group(0), m.group(1)))))
    elements = list(EMOTION_TAG.finditer(text))
    whole = {m.start() for m in elements}
    for o in EMOTION_OPEN.finditer(text):
        if o.start() not in whole and not (partial and (last_end < o.start() or still_arriving(text, o.end()))):
            cut = text[o.start() : o.start() + 60]
            raise RequestError(G.BAD_TEXT, f"an emotion tag must end with '>' in the same sentence: {cut!r}")
    for m in elements:
        if m.group(1):  # </emotion>: the element's end
            found.append((m.start(), m.end(), StyleTag(NEUTRAL, m.group(0))))
            continue
        value = attributes(m.group(2), m.group(0)).get("value", "").strip().lower()
        if not value:
            raise RequestError(G.BAD_TEXT, f'an emotion tag needs a value such as value="happy": {m.group(0)[:60]!r}')
        found.append((m.start(), m.end(), StyleTag(value, m.group(0))))
    found.sort(key=lambda t: t[0])
    return found


def split_tags(text: str, partial: bool = False) -> list[str | StyleTag | MarkedText]:
    """The text's pieces in order: spoken text (str, stripped, never blank), style tags, and spoken text with the marks
    it holds (MarkedText: a mark does not cut the text, and its text may be empty: marks alone). A text without
    tags is returned as it is (one piece), its spell elements spelled (none, if they spell nothing). A malformed
    `<emotion>` element or mark is refused (`bad_text`). `partial`: a streamed message, whose last element may still be
    arriving (its opening with no `>` after it). SSML's structural tags are taken out first (`unwrap`), and its say-as
    and sub elements replaced by what they say (`read_as`)."""
    plain = read_as(unwrap(text), partial)
    spoken = MARK.sub("", plain) if "<" in plain else plain  # (marks are taken out below, a space kept between words)
    if spoken != text:
        _no_break_made(text, spoken)
    if spoken != plain:
        _no_tag_made_of_marks(plain, spoken)
    tags = _tags(plain, partial)
    if not tags:
        said = spell_out(plain)
        # an element that spells nothing leaves nothing to say: no piece, as a text of only tags (`<spell></spell>`
        # was an utterance of no audio on a socket, and a 200 of no audio over HTTP where `[neutral]` is empty_text)
        return [said] if said is text or said.strip() else []
    if sum(isinstance(tag, StyleTag) for _, _, tag in tags) > MAX_TAGS:
        raise RequestError(G.BAD_TEXT, f"at most {MAX_TAGS} style tags in one text")
    out: list[str | StyleTag | MarkedText] = []
    run, marks = "", []  # the text since the last style tag, and where its marks stand in it
    pos = 0
    for start, end, tag in tags:
        if start < pos:  # inside the tag before it (`<emotion value="[happy]"/>`): part of that one
            continue
        run = _joined(run, spell_out(plain[pos:start]))
        if isinstance(tag, Mark):
            marks.append((len(run), tag.name))
        else:
            out += _spoken(run, marks)
            run, marks = "", []
            out.append(tag)
        pos = end
    out += _spoken(_joined(run, spell_out(plain[pos:])), marks)
    return out


def _spoken(run: str, marks: list[tuple[int, str]]) -> list[str | MarkedText]:
    """The piece of a text between two style tags (`run`, unstripped) and the marks in it: none when it is blank and
    holds no mark, its text when it holds none."""
    text = run.strip()
    if not marks:
        return [text] if text else []
    lead = len(run) - len(run.lstrip())
    return [MarkedText(text, tuple((min(max(0, at - lead), len(text)), name) for at, name in marks))]


def _joined(before: str, piece: str) -> str:
    """`piece` after `before`, where a tag taken out stood between them: a space keeps two words apart
    (`Hello.</p><p>There`), and two spaces are one (`and <p> more`)."""
    if not before or not piece:
        return before + piece
    if not before[-1].isspace() and piece[0].isalnum():
        return before + " " + piece
    if before[-1] == " " and piece[0] == " ":
        return before + piece[1:]
    return before + piece


def _no_tag_made_of_marks(text: str, spoken: str) -> None:
    """Refused (`bad_text`) when taking the marks out of `text` (`spoken`) made a tag of the text around one: a mark
    inside a tag (`[hap<mark name="m"/>py]`, `<emo<mark name="m"/>tion value="sad"/>`) is outside every tag once taken
    out, and the tag's text, whole again, was read aloud (`[happy]` spoken as words)."""

    def found(pattern: re.Pattern[str], where: str) -> list[re.Match[str]]:
        return [m for m in pattern.finditer(where) if pattern is not BRACKET or m.group(1).lower() in TAG_WORDS]

    for pattern in (BREAK_OPEN, BREAK_END, EMOTION_OPEN, ELEMENT_OPEN, BRACKET):
        if len(made := found(pattern, spoken)) > len(found(pattern, text)):
            cut = spoken[made[-1].start() : made[-1].start() + 40]
            raise RequestError(G.BAD_TEXT, f"a mark stands outside every tag, not inside one: {cut!r}")


def _no_break_made(text: str, plain: str) -> None:
    """Refused (`bad_text`) when taking out `text`'s structure and reading its say-as and sub elements (`plain`) made a
    break tag of the text around one (`A <<p>break time="1s"/>`, `<<sub alias="break">x</sub>/>`): breaks were taken
    out before (app/core/pipeline.py `inline_pieces`), and it was read aloud."""
    for pattern in (BREAK_OPEN, BREAK_END):
        made = list(pattern.finditer(plain))
        if len(made) > len(pattern.findall(text)):
            cut = plain[made[-1].start() : made[-1].start() + 40]
            raise RequestError(G.BAD_TEXT, f"a break tag is whole as written, not made by taking out a tag: {cut!r}")


def unwrap(text: str) -> str:
    """`text` without SSML's structural tags (`<speak ...>`, `<p>`, `<s>` and their closings: WRAPPER_ELEMENTS), the
    text inside them kept; where a tag stood between two words (`Hello.</p><p>There`) a space keeps them apart."""
    if "<" not in text:
        return text
    pieces = [piece for piece in STRUCTURE_TAG.split(text) if piece]
    if len(pieces) == 1 and len(pieces[0]) == len(text):
        return text
    out = ""
    for piece in pieces:
        out = _joined(out, piece)
    return out


def read_as(text: str, partial: bool = False) -> str:
    """`text` with SSML's `<say-as>` and `<sub>` elements replaced by what they say: a say-as whose interpret-as spells
    (SAY_AS_SPELLED) by a `<spell>` element of its text, one read as written (SAY_AS_READ) by its text, a sub by its
    alias. Another interpret-as (or none) is refused (`unsupported_tag`); an alias empty or holding a tag, and an
    opening or closing whose element is not whole in the text (a sentence cut left it alone; never read aloud), are
    `bad_text`. `partial`: a streamed message, whose elements may open or close in another message (its own tags are
    checked; the element is when its sentence is spoken)."""
    if "<" not in text:
        return text
    text = _READ_AS_ELEMENT.sub(lambda m: _read(m.group(1), m.group(2), m.group(0), m.group(3)), text)
    for m in _READ_AS_TAG.finditer(text):
        if not m.group(1):
            _read(m.group(2), m.group(3), m.group(0), "")
        if not partial:
            whole = "its opening, text and closing in one sentence, no longer than an utterance"
            whole += ", its text without tags (a mark goes before or after it)" if MARK.search(text) else ""
            raise RequestError(G.BAD_TEXT, f"a {m.group(2).lower()} element is whole, {whole}: {m.group(0)[:60]!r}")
    return _READ_AS_TAG.sub("", text) if partial else text


def _read(name: str, attribute_text: str, written: str, text: str) -> str:
    """What a say-as or sub element (its name, attributes, as written, its text) says; refused as `read_as` says."""
    if name.lower() == "sub":
        alias = attributes(attribute_text, written).get("alias", "").strip()
        spoken = unescape(alias)
        if not spoken.strip() or markup_in(spoken) is not None:
            what = "a sub's alias is the text spoken: not empty, no tag in it"
            raise RequestError(G.BAD_TEXT, f"{what}: {written[:60]!r}")
        return alias
    kind = attributes(attribute_text, written).get("interpret-as", "").strip().lower()
    if kind in SAY_AS_SPELLED:
        return f"<spell>{text}</spell>"
    if kind in SAY_AS_READ:
        return text
    raise RequestError(
        G.UNSUPPORTED_TAG,
        f"{written[:60]}: ZONOS2 reads say-as with interpret-as {', '.join(SAY_AS_SPELLED)} (spelled) or "
        f"{', '.join(SAY_AS_READ)} (as written) only",
    )


def _spelled(text: str) -> str:
    """`text`'s characters one by one, separated by spaces (a combining mark stays on its letter; spaces go)."""
    chars: list[str] = []
    for c in text:
        if c.isspace():
            continue
        if chars and unicodedata.combining(c):
            chars[-1] += c
        else:
            chars.append(c)
    return " ".join(chars)


def unescape(text: str) -> str:
    """`text` with XML's character references replaced by their characters (`&amp;` `&lt;` `&gt;` `&quot;` `&apos;`,
    `&#233;`, `&#xE9;`), once: an SSML writer escapes every `&` and `<` of its text, and the reference is no word to
    read. A reference to a character that has no sound (a control character, a surrogate) is dropped, to whitespace a
    space; any other `&` is text."""
    return REFERENCE.sub(_referenced, text) if "&" in text else text


def _printable_reference(m: re.Match[str]) -> bool:
    """Whether a character reference (a REFERENCE match) names a printable character (`&#x202E;`, `&#0;` do not)."""
    if m.group(1):
        return True
    code = int(m.group(2), 10) if m.group(2) else int(m.group(3), 16)
    return code <= 0x10FFFF and not 0xD800 <= code <= 0xDFFF and chr(code).isprintable()


def _referenced(m: re.Match[str]) -> str:
    if m.group(1):
        return REFERENCE_NAMES[m.group(1)]
    code = int(m.group(2), 10) if m.group(2) else int(m.group(3), 16)
    c = chr(code) if code <= 0x10FFFF and not 0xD800 <= code <= 0xDFFF else ""
    return " " if c.isspace() else c if c.isprintable() else ""


def spell_out(text: str) -> str:
    """`text` with each `<spell>...</spell>` element (Cartesia's) replaced by its characters spelled out, and its
    character references by their characters (`unescape`; a spelled one is one character). A sentence cut may leave an
    element's opening or closing alone in a text: what follows a lone opening, or precedes a lone closing, is spelled;
    a tag is never left in the text."""
    pieces = _spell_pieces(text)
    if len(pieces) == 1:
        return unescape(text)
    out = ""
    spelled = False  # (what `out` ends with)
    for start, end, inside in pieces:
        piece = unescape(text[start:end])
        piece = _spelled(piece) if inside else piece
        # a spelled character is a word of its own: apart from a word or a spelled character beside it
        if piece and out and (inside or spelled) and out[-1].isalnum() and piece[0].isalnum():
            out += " "
        out += piece
        spelled = inside if piece else spelled
    return out


def _spell_pieces(text: str) -> list[tuple[int, int, bool]]:
    """`text` between its spell elements' openings and closings: each piece's start, end and whether it is spelled
    (what follows an opening, and what precedes a closing that comes first: its element began in an earlier sentence).
    One piece, not spelled, when it holds none."""
    marks = list(_SPELL.finditer(text))
    pieces: list[tuple[int, int, bool]] = []
    pos, inside = 0, bool(marks) and bool(marks[0].group(1))
    for m in [*marks, None]:
        pieces.append((pos, m.start() if m is not None else len(text), inside))
        if m is not None:
            inside, pos = not m.group(1), m.end()
    return pieces


def styled_options(
    tag: StyleTag | None, opts: SynthesisOptions, directions: EmotionDirections | None, speaker: bool
) -> SynthesisOptions:
    """`opts` with the emotion `tag` names (None or NEUTRAL: `opts` itself). `speaker`: the request has a voice
    the emotion can be applied to. Refused (`unsupported_tag`) when it cannot be applied."""
    if tag is None or tag.name == NEUTRAL:
        return opts
    if tag.name in UNSUPPORTED_TAGS:
        raise RequestError(
            G.UNSUPPORTED_TAG, f"{tag.written[:60]}: ZONOS2 has no control for {tag.name!r} (only emotions)"
        )
    if tag.name == "phoneme":
        raise RequestError(
            G.UNSUPPORTED_TAG,
            f"{tag.written[:60]}: ZONOS2 reads text and has no phoneme input (write how the word is read instead)",
        )
    if tag.name in UNSUPPORTED_ELEMENTS:
        hint = "; the request's own speed applies to its whole text" if tag.name == "speed" else ""
        what = f"ZONOS2 has no in-text control for {tag.name!r} (only emotions{hint})"
        raise RequestError(G.UNSUPPORTED_TAG, f"{tag.written[:60]}: {what}")
    if directions is None:
        raise RequestError(
            G.UNSUPPORTED_TAG,
            f"{tag.written[:60]}: emotion tags need emotion directions: this server was started without "
            "--emotion-directions-dir",
        )
    if not speaker:
        raise RequestError(
            G.UNSUPPORTED_TAG, f"{tag.written[:60]}: an emotion is applied to a voice; this request has none"
        )
    emo = opts.emotion
    if tag.name in directions.named:
        emo = dataclasses.replace(emo, enabled=True, sliders={tag.name: 1.0}, valence=0.0, arousal=0.0)
    elif tag.name in TAG_EMOTIONS and all(a in directions.axes for a in ("valence", "arousal")):
        valence, arousal = TAG_EMOTIONS[tag.name]
        emo = dataclasses.replace(emo, enabled=True, sliders={}, valence=valence, arousal=arousal)
    else:
        known = sorted(directions.named) + (
            sorted(TAG_EMOTIONS) if all(a in directions.axes for a in ("valence", "arousal")) else []
        )
        raise RequestError(
            G.UNSUPPORTED_TAG,
            f"{tag.written[:60]}: no emotion {tag.name!r} on this server; known: {', '.join(known) or 'none'}",
        )
    return dataclasses.replace(opts, emotion=emo)
