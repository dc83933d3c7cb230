"""Buffers text streamed in from an LLM and cuts it into utterances at sentence boundaries.

Sentence boundaries come from sentencex (Wikimedia's rule-based segmenter: per-language abbreviation
lists with fallbacks, ~300 languages), so "Dr. Smith paid $5.50 on Jan. 3rd." stays one sentence.
Streaming rule: a sentence is handed out only once its end is certain, that is once the segmenter sees
text after it ("Dr. " could still be followed by "Smith"), and after a period once the word after it is
complete (the segmenter's decision depends on that word); a newline ends a sentence at once; `flush`
hands out the rest. A sentence longer than the utterance budget is cut, by its UTF-8 length (the prompt
takes one frame per byte; its tags, never spoken, count nothing), at a clause mark or a space if there is one, never
inside a character, an inline tag or a character reference (`&amp;`). No sentence ends inside an element spoken whole
(`<sub>`, `<say-as>`, `<spell>`), or after its opening while its closing is still to come. A CDATA section's content
is text as written (`append`), cut into sentences as any text.
Where a text ends inside a tag is read here too: one still arriving (`unfinished_tag_start`, kept for the text that
completes it) and one no text can complete (`broken_tag_start`: a socket's text at the client's flush, and an HTTP
route's whole text, app/core/pipeline.py `speak`), refused alike (`cut_tag_refusal`).
"""

from __future__ import annotations

import re
import unicodedata

import sentencex

from app.core.tag_vocabulary import (
    ATTRIBUTES_ARRIVING,
    CDATA_END,
    CDATA_OPEN,
    ELEMENT_NAMES,
    MARK,
    READ_AS_ELEMENTS,
    REFERENCE,
    TAG_MAX,
    TAG_WORDS,
    UNSPOKEN_TAG,
    cdata_as_text,
    cdata_tail,
    names_pattern,
    reference_start,
)
from app.io.errors import GatewayError as G
from app.io.errors import RequestError

# The gateway's text-normalization languages (engine.frontend.textnorm) -> sentencex language codes.
_SEGMENTER_LANGUAGE = {"cmn": "zh", "zh": "zh", "pt_br": "pt", "fr_fr": "fr", "en_us": "en", "en_gb": "en"}
# Where a too-long sentence is best cut: after a clause mark (ASCII ones need a space after them).
_CLAUSE = re.compile(r"[,;:)\]](?=\s)|\s[–—-](?=\s)|[、，；：]")
# A break or style tag (app/core/breaks.py, app/core/style_tags.py), or a character reference: a cut moves before one it
# would split (`&a`, `mp;` were each read as text)
_TAG = re.compile(rf"<[^<>]{{0,{TAG_MAX}}}>|\[[^\[\]]{{0,40}}\]|{REFERENCE.pattern}")
_JOINERS = {"\u200d", "\u20e3"}  # zero-width joiner, combining keycap
# A period can end an abbreviation or an initial, and the segmenter decides by the word after it
# ("J. R. R. To" splits, "J. R. R. Tolkien" does not): such an end is certain once that word is complete.
_PERIOD_END = re.compile(r"\.[\"'”’)\]]*\s*$")
_COMPLETE_WORD = re.compile(r"\S\s")
# An element whose text is read otherwise (app/core/style_tags.py: spelled, or as its alias) is spoken whole: a sentence
# is not cut inside one, nor after its opening before its closing has come (the segmenter cuts `<sub alias="United
# States">U.` from `S.</sub> is big.`: two halves, neither of them an element, each refused)
_SPOKEN_WHOLE = READ_AS_ELEMENTS | {"spell"}
# So is XML's markup, taken out whole (app/core/tag_vocabulary.py XML_MARKUP: a comment, a declaration, a document
# type), from its opening to its end: the segmenter cut `Hi <!` from `-- a note -->` and `<?` from `xml ...?>`, and
# the comment's sentences apart, each half refused. (A `<!` opens one only as `<!--` or `<!DOCTYPE`, or cut before
# either: prose's `<!` held every sentence after it). And a CDATA section still open at the end of the buffer
# (`cdata_as_text`: its opening, perhaps a `]` or two; its text before it is the buffer's) or its opening cut
# (`<![CD`): held back as a whole tag is, up to its `]]>`
_XML_ENDS = {"<!--": "-->", "<?": "?>", "<!": ">", CDATA_OPEN: CDATA_END, "<![": CDATA_END}
_WHOLE_OPEN = re.compile(
    rf"<\s*({names_pattern(_SPOKEN_WHOLE)})(?![\w-])[^<>]{{0,{TAG_MAX}}}>"
    rf"|(<!--|<\?|(?-i:{re.escape(CDATA_OPEN)})|(?-i:<!\[(?=(?:C(?:D(?:A(?:T(?:A)?)?)?)?)?\Z))|<!(?=-|D|\Z))",
    re.IGNORECASE,
)
_WHOLE_CLOSE = {name: re.compile(rf"<\s*/\s*{re.escape(name)}\s*>", re.IGNORECASE) for name in _SPOKEN_WHOLE}
_WHOLE_CLOSE |= {opening: re.compile(re.escape(end)) for opening, end in _XML_ENDS.items()}


# SSML's marks at a sentence's start (the segmenter leaves `you.<mark name="x"/> ` a sentence's end and puts the mark
# before the next one) belong to the sentence before them: reported after its last word, not after the next one starts
_LEADING_MARKS = re.compile(rf"(?:\s*{MARK.pattern})+\s*", re.IGNORECASE)


def segmenter_language(language: str) -> str:
    return _SEGMENTER_LANGUAGE.get(language, language.split("_")[0] or "en")


def spoken_whole(text: str) -> list[tuple[int, int]]:
    """Where each element spoken whole (`_SPOKEN_WHOLE`, and XML's markup: `_XML_ENDS`) starts and ends in `text`, in
    order; one not closed yet (its closing still to come) ends past the text, at len(text) + 1."""
    spans: list[tuple[int, int]] = []
    pos = 0
    while m := _WHOLE_OPEN.search(text, pos):
        close = _WHOLE_CLOSE[m.group(1).lower() if m.group(1) else m.group(2)].search(text, m.end())
        spans.append((m.start(), close.end() if close else len(text) + 1))
        if close is None:
            break
        pos = close.end()
    return spans


_OPEN_BRACKET = re.compile(r"\[\s*(?:[A-Za-z]+\s*)?$")  # a bracket tag's first half: `[hap` (app/core/style_tags.py)
# an element's opening cut inside its name (`<emo`, `</`, `<`, `<say-`, `<amazon:eff`: a name may hold a hyphen or a
# colon): no pattern of a whole name sees it yet
_OPEN_NAME = re.compile(r"<\s*(?:/\s*)?([A-Za-z:-]*)$")
_SPELL_OPENING = re.compile(r"<\s*spell\s*>", re.IGNORECASE)
_CUT_NAME = re.compile(r"</?([A-Za-z:-]+)$")  # one cut inside its name for certain: a letter of it, right after its '<'


# an element's opening with its name whole and its `>` not yet come (`<break time="1`): its name says if it is a tag,
# and what follows the name must be attributes as a tag writes them (`name="value"`, quotes optional), the last one
# perhaps still arriving (`ti`, `time=`, `time="1`): prose after a `<` and an element's name (`x < s. Then go on.`,
# `if a <s and b`) is no tag, and was held back until the client's flush (or dropped by an ElevenLabs close_context)
_OPEN_ELEMENT = re.compile(rf"<\s*(?:/\s*)?([A-Za-z:-]+)(?={ATTRIBUTES_ARRIVING})")


def unfinished_tag_start(text: str) -> int | None:
    """Where a tag still arriving begins at the end of buffered text (a bracket or an element of ours cut inside its
    name or attributes), None if it ends in none: speaking as it comes (a hold's timer, ElevenLabs' auto_mode,
    Cartesia's zero buffer delay) keeps that tail for the text that completes it, which it would read aloud
    (`Hi <spea` spoken, then `k>`). So does an element spoken whole whose closing has not come (`<sub alias="x">U.S.`:
    its sentence would be refused), and so does XML's markup whose end has not come (`<!-- a note`, `<?xml`), and an
    XML character reference cut before its `;` (`AT&am`, then `p;T`: "AT&am" was spoken, then "p;T";
    app/core/tag_vocabulary.py `reference_start`)."""
    if "<" in text and (spans := spoken_whole(text)) and spans[-1][1] > len(text):
        return spans[-1][0]
    if (start := cut_name_start(text)) is not None:
        return start
    if (m := _OPEN_ELEMENT.search(text[-TAG_MAX:])) and m.group(1).lower() in ELEMENT_NAMES:
        return len(text) - len(text[-TAG_MAX:]) + m.start()
    return reference_start(text)


def broken_tag_start(text: str) -> int | None:
    """Where a tag cut at the end of text the client's own flush speaks begins (`Hi <brea`, `Hi <break time="1`, `[hap`,
    `<sub alias="x">U.S.` with no closing, `<!-- a note`, a CDATA section with no `]]>`), None if it ends in none: no
    text can complete it now, so it is refused (`bad_text`) and the text before it spoken (`flush`; read aloud, the
    half of a name was "less than brea"). What may be prose is spoken: a `<`, `</`, `<!` or `<?` with nothing after it
    (`Is two <`), a name after a space (`if a < b`) or one letter right after a word (`if a<b`), a bracket whose word
    begins no tag word (`[note`), an XML character reference cut (`AT&am`: as written). Spaces after it are none of
    its (LiveKit's Deepgram plugin sends each word with one)."""
    text = text.rstrip()
    if "<" in text and (spans := spoken_whole(text)) and spans[-1][1] > len(text):
        start = spans[-1][0]
        # (a spell element's opening left alone spells to the end of its text: app/core/style_tags.py `spell_out`)
        return None if text[start:] in ("<!", "<?") or _SPELL_OPENING.match(text, start) else start
    if (m := _OPEN_BRACKET.search(text)) and (word := m.group(0)[1:].strip().lower()):
        return m.start() if any(w.startswith(word) for w in TAG_WORDS) else None
    if (m := _CUT_NAME.search(text)) and any(n.startswith(m.group(1).lower()) for n in ELEMENT_NAMES):
        after_word = m.start() > 0 and text[m.start() - 1].isalnum()
        return None if after_word and len(m.group(1)) == 1 else m.start()
    if (m := _OPEN_ELEMENT.search(text[-TAG_MAX:])) and m.group(1).lower() in ELEMENT_NAMES:
        return len(text) - len(text[-TAG_MAX:]) + m.start()
    return None


def cut_name_start(text: str) -> int | None:
    """Where a tag cut inside its name begins at the end of `text` (a bracket's first half, or an element's opening
    whose name so far begins one of ours), None if it ends in none."""
    if m := _OPEN_BRACKET.search(text):
        return m.start()
    if (m := _OPEN_NAME.search(text)) and any(n.startswith(m.group(1).lower()) for n in ELEMENT_NAMES):
        return m.start()
    return None


# The refusal of a tag cut at the end of a text that is complete (`broken_tag_start`: no text can complete the tag):
# our socket's and the dialects' flush and close (the text before it spoken), and an HTTP route's whole text (refused
# whole, 400), in one wording that names the tag
CUT_TAG = "a tag cut at the end of the text, which no text can complete"


def cut_tag_refusal(text: str, start: int, what_is_spoken: str) -> RequestError:
    """The `bad_text` refusal of the tag cut at `start` of a complete `text` (`broken_tag_start`), naming it;
    `what_is_spoken`: what comes of the text before it."""
    return RequestError(G.BAD_TEXT, f"{CUT_TAG} ({what_is_spoken}): {text[start:].rstrip()[:60]!r}")


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _attached(ch: str) -> bool:
    """A character that belongs to the one before it (a cut before it would split what is seen as one)."""
    cp = ord(ch)
    return (
        bool(unicodedata.combining(ch))
        or ch in _JOINERS
        or 0xFE00 <= cp <= 0xFE0F
        or 0x1F3FB <= cp <= 0x1F3FF
        or 0xE0020 <= cp <= 0xE007F
        or unicodedata.category(ch) == "Mc"
    )


def _spoken_fit(text: str, max_bytes: int, unspoken: re.Pattern[str] | None = UNSPOKEN_TAG) -> int | None:
    """The characters of the longest prefix of `text` whose spoken part is at most max_bytes UTF-8 bytes, or None when
    all of it is. A tag that is never spoken (`unspoken`: a mark, a break, a style tag, SSML's structure; each taken out
    before the engine, whose prompt is cut to the budget again as spoken: Gateway.start_utterance) costs nothing, nor
    does the space before it: a mark after every word left a sentence of 60 words 5 utterances, 8 breaks in a sentence
    of 45 bytes 5 at a budget of 60. Looks no further than the prefix (and its tags), so a long text costs in proportion
    to its pieces. `unspoken` None: every character is spoken (the gateway's cut of the spoken text)."""
    pos, room = 0, max_bytes
    while True:
        # the next tag that begins within the budget's characters (one past them, or longer than a tag, counts as
        # text: a cut too early, never too late)
        window = pos + room + 1
        ahead = text[pos:window]
        tagged = unspoken is not None and ("<" in ahead or "[" in ahead)
        m = unspoken.search(text, pos, window + TAG_MAX + 16) if tagged and unspoken is not None else None
        end = m.start() if m is not None and m.start() < window else len(text)
        chunk = text[pos : min(end, window)]
        if utf8_len(chunk) > room:  # past the budget within this text: the most of it that fits
            return pos + len(chunk[:room].encode("utf-8", "surrogatepass")[:room].decode("utf-8", "ignore"))
        if end == len(text) or m is None:
            return None
        room -= utf8_len(chunk)
        pos = m.end()


def split_to_budget(sentence: str, max_bytes: int, spoken_only: bool = True) -> list[str]:
    """Cut a sentence into pieces of at most max_bytes UTF-8 bytes spoken (its tags cost nothing: `_spoken_fit`),
    nothing lost. Each cut looks at the next piece's characters only, so a long text costs in proportion to its pieces.
    `spoken_only` False: the text is all spoken, every character counted (the gateway's cut of a spoken text, whose
    `<mark name="x"/>` is a CDATA section's characters, read aloud: free, 100 of them were one piece of 1,600 bytes)."""
    parts: list[str] = []
    sentence = sentence.strip()
    unspoken = UNSPOKEN_TAG if spoken_only else None
    while (fit := _spoken_fit(sentence, max_bytes, unspoken)) is not None:  # the longest prefix that fits (characters)
        head = sentence[:fit]
        cut = 0
        # a tag the piece begins with is no place to cut: its spaces are not the text's (`<break time="1s"/>` then CJK
        # text was cut at the break's own space, both halves refused)
        lead = m.end() if (m := _TAG.match(sentence)) and m.end() < fit else 0
        clauses = [m.end() for m in _CLAUSE.finditer(head, lead)]
        if clauses and clauses[-1] >= fit // 2:
            cut = clauses[-1]
        elif (space := max(head.rfind(" ", lead), head.rfind("\n", lead), head.rfind("\t", lead))) > 0:
            cut = space
        else:  # no space (CJK, emoji, a long word): cut between characters, not inside a cluster
            cut = fit
            while cut > 1 and (_attached(sentence[cut]) or sentence[cut - 1] in _JOINERS):
                cut -= 1
            if cut == 1 and (_attached(sentence[1]) or sentence[0] in _JOINERS):
                # a cluster longer than the budget (9,999 combining accents on one letter) has no cut but inside it:
                # at the budget, not a piece per character (10,000 pieces, each cut costing the whole text)
                cut = fit
        for m in _TAG.finditer(sentence, 0, fit + TAG_MAX):  # never inside a tag: its halves would be read as text
            if m.start() < cut < m.end() and m.start() > 0:
                cut = m.start()
        # nor inside an element spoken whole (its halves would be refused), unless it begins the piece (longer than the
        # budget: no cut keeps it whole); one ending past the next budget's characters is as long
        for start, end in spoken_whole(sentence[: fit + max_bytes]) if "<" in sentence[:cut] else ():
            if start < cut < end and start > 0:
                cut = start
        cut = max(cut, 1)
        piece = sentence[:cut].strip()
        if piece:
            parts.append(piece)
        sentence = sentence[cut:].strip()
    if sentence:
        parts.append(sentence)
    return parts


def _before_marks(segment: str) -> str:
    """`segment` without the marks (and whitespace) it ends with: where its text ends (a period's place). Its marks
    are found once, and the ones at its end walked back (a pattern anchored at the end was tried from every mark of it:
    quadratic in a message of marks)."""
    end = len(segment.rstrip())
    if not segment.endswith(">", 0, end):
        return segment
    for m in reversed(list(MARK.finditer(segment, 0, end))):
        if m.end() != end:
            break
        end = m.start()
        while end and segment[end - 1].isspace():
            end -= 1
    return segment[:end]


def _marks_kept_before(segments: list[str]) -> list[str]:
    """`segments` with the marks that begin one moved to the end of the one before it (`_LEADING_MARKS`); a segment
    of marks alone is no sentence of its own."""
    out: list[str] = []
    for s in segments:
        if out and (m := _LEADING_MARKS.match(s)):
            out[-1] += m.group(0)
            s = s[m.end() :]
        if s:
            out.append(s)
    return out


class TextBuffer:
    def __init__(self, max_utterance_bytes: int, language: str = "en_us") -> None:
        self.max_bytes = max(8, max_utterance_bytes)
        self.language = language
        self.text = ""

    def __len__(self) -> int:
        return len(self.text)

    def append(self, text: str) -> list[str]:
        """Add text; return the complete sentences that can be spoken now. A CDATA section's content is text as written
        (app/core/tag_vocabulary.py `cdata_as_text`), its sentences cut as any text's: one still open at the end is
        the few characters of its opening, the rest of it goes on from there."""
        tail = cdata_tail(self.text) if "<" in self.text[-len(CDATA_OPEN) - 2 :] else None
        if tail is None:
            self.text += cdata_as_text(text)
        else:
            self.text = self.text[:tail] + cdata_as_text(self.text[tail:] + text, self.text[:tail])
        return self._complete()

    def flush(self) -> list[str]:
        """Everything buffered, complete or not."""
        out = self._complete()
        rest, self.text = self.text, ""
        for sentence in self._segments(rest):
            out.extend(split_to_budget(sentence, self.max_bytes))
        return out

    def clear(self) -> None:
        self.text = ""

    def _segments(self, text: str) -> list[str]:
        """Sentences of text (each with its trailing whitespace), as the segmenter cuts them."""
        if not text.strip():
            return []
        segments = [s for s in sentencex.segment(segmenter_language(self.language), text) if s]
        if "".join(segments) != text:  # the segmenter keeps every character; if it ever does not, cut nothing
            return [text]
        spans = spoken_whole(text) if "<" in text else []
        if not spans:
            return _marks_kept_before(segments) if "<" in text else segments
        joined: list[str] = []
        pos, i = 0, 0
        for s in segments:  # a cut inside an element joins its two sides
            while i < len(spans) and spans[i][1] <= pos:
                i += 1
            if joined and i < len(spans) and spans[i][0] < pos:
                joined[-1] += s
            else:
                joined.append(s)
            pos += len(s)
        return _marks_kept_before(joined)

    def _complete(self) -> list[str]:
        out: list[str] = []
        # A newline ends a sentence now: whatever precedes it is complete.
        nl = self.text.rfind("\n")
        if nl >= 0:
            done, self.text = self.text[: nl + 1], self.text[nl + 1 :]
            for line in done.split("\n"):
                for sentence in self._segments(line):
                    out.extend(split_to_budget(sentence, self.max_bytes))
        # Otherwise a sentence is complete once the segmenter starts another one after it (after a
        # period: once the first word after it is complete).
        segments = self._segments(self.text)
        keep = 1
        ended = _before_marks(segments[-2]) if len(segments) > 1 else ""  # (the period before its marks)
        if len(segments) > 1 and _PERIOD_END.search(ended) and not _COMPLETE_WORD.search(segments[-1]):
            keep = 2
        if len(segments) > keep:
            for sentence in segments[:-keep]:
                out.extend(split_to_budget(sentence, self.max_bytes))
            self.text = "".join(segments[-keep:])
        # A run-on text without a sentence end is still spoken once it passes the utterance budget (whitespace
        # alone is nothing to speak: it has no pieces, and is dropped below).
        if _spoken_fit(self.text, self.max_bytes) is not None and self.text.strip():
            pieces = split_to_budget(self.text, self.max_bytes)
            out.extend(pieces[:-1])
            self.text = self.text[self.text.rfind(pieces[-1]) :]  # keeps the whitespace after it
        if not self.text.strip():
            self.text = ""
        return [s for s in out if s.strip()]
