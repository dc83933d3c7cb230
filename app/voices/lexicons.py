"""Pronunciation dictionaries: alias rules ("tomato" is read as "tomahto"), stored per owner in the data dir
beside the voices, applied to a text before its normalization (whole words, case-sensitive as PLS and
ElevenLabs' rules are).

ZONOS2 reads text, so a rule can only say what to read instead: an alias. A phoneme rule (IPA or CMU
Arpabet, in a PLS `<phoneme>` or an ElevenLabs `phoneme` rule) has nothing to map onto and is refused when
the dictionary is uploaded, naming the grapheme, never dropped in silence.

The store is files, one folder per owner: a dictionary's metadata (`<id>.json`, small) and its rules
(`<id>.rules.json`, UTF-8), each written whole and renamed into place, rules first; an owner's new dictionary is
counted and written under the owner's file lock, so MAX_PER_OWNER holds across gateway processes. They are read
on each lookup, so every gateway process sees a dictionary the moment another one has written it; a listing reads
only its owner's metadata (an owner's hundred dictionaries of thousands of rules are hundreds of MB: reading them
all would hold the GIL, and every session's event loop, ~1.5 s per listing).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import fcntl
import json
import re
import secrets
import threading
import time
import unicodedata
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from defusedxml import ElementTree

from app.core.tag_vocabulary import markup_in
from app.io.checks import check_text
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.voices.library import SHARED_RECOVER_AGE_S, replace_file

MAX_RULES = 5000  # rules in one dictionary
MAX_TEXT = 256  # characters of a grapheme or an alias
MAX_PER_OWNER = 100  # dictionaries one owner keeps
RULES_CACHE = 32  # dictionaries whose parsed rules a gateway process keeps (LexiconStore._read_rules)
_ID = re.compile(r"^pd_[0-9a-f]{16}$")
# A PLS file's tags ('<'), counted before it is parsed: a lexeme of one grapheme and an alias is 6, and a file of
# MAX_RULES such holds 30,000. Parsed, 1 MB of 250,000 empty elements took 0.3 s of the parser's C (which holds the
# GIL throughout), and the route parsed on the event loop: every session's audio waited.
MAX_PLS_TAGS = 16 * MAX_RULES
PLS_FEED_BYTES = 1 << 16  # parsed per call (in a worker thread): the event loop's thread takes the GIL between calls
_PLS_NS = "{http://www.w3.org/2005/01/pronunciation-lexicon}"
_ANONYMOUS = "_anonymous"  # the owner without API keys (owners are hex digests: no clash)


@dataclass(frozen=True)
class Rule:
    grapheme: str  # the text to replace: whole words, case-sensitive
    alias: str


@dataclass
class Lexicon:
    id: str
    name: str
    owner: str
    rules: list[Rule]
    version_id: str = field(default_factory=lambda: "v_" + secrets.token_hex(8))
    description: str = ""
    created_at: float = field(default_factory=time.time)
    rule_count: int = 0  # len(rules), also where the rules were not read (a listing)

    def public(self) -> dict[str, Any]:
        """ElevenLabs' metadata shape."""
        return {
            "id": self.id,
            "name": self.name,
            "version_id": self.version_id,
            "version_rules_num": self.rule_count,
            "description": self.description or None,
            "creation_time_unix": int(self.created_at),
            "permission_on_resource": "admin",
        }


def _rule(grapheme: object, alias: object, where: str) -> Rule:
    if not isinstance(grapheme, str) or not grapheme.strip() or len(grapheme) > MAX_TEXT:
        raise RequestError(G.BAD_LEXICON, f"{where}: the text to replace must be 1-{MAX_TEXT} characters")
    if not isinstance(alias, str) or len(alias) > MAX_TEXT:
        raise RequestError(
            G.BAD_LEXICON, f"{where}: the alias for {grapheme[:40]!r} must be text of at most {MAX_TEXT} characters"
        )
    check_text(grapheme, f"{where}: the text to replace", G.BAD_LEXICON)
    check_text(alias, f"{where}: the alias", G.BAD_LEXICON)
    tag = markup_in(alias)
    if tag is not None:  # aliases replace words after the text's tags were taken out: a tag here would be read aloud
        raise RequestError(
            G.BAD_LEXICON,
            f"{where}: the alias for {grapheme[:40]!r} holds the tag {tag!r}: an alias is read as plain text, "
            "so put breaks and tags in the text itself",
        )
    return Rule(grapheme.strip(), alias)


def _phoneme_refused(grapheme: str) -> RequestError:
    return RequestError(
        G.BAD_LEXICON,
        f"the rule for {grapheme[:40]!r} gives phonemes: ZONOS2 reads text and has no "
        "phoneme input, so only alias rules can be followed (write how it is "
        "read instead)",
    )


def rules_from_json(rules: object) -> list[Rule]:
    """ElevenLabs' `add-from-rules` rules ({type: alias, string_to_replace, alias}), or ours ({grapheme,
    alias}); a phoneme rule is refused."""
    if not isinstance(rules, list) or not rules or len(rules) > MAX_RULES:
        raise RequestError(G.BAD_LEXICON, f"rules must be a list of 1-{MAX_RULES} rules")
    out = []
    for i, r in enumerate(rules):
        if not isinstance(r, dict):
            raise RequestError(G.BAD_LEXICON, f"rule {i} must be an object")
        grapheme = r.get("string_to_replace", r.get("grapheme"))
        if r.get("type", "alias") == "phoneme" or "phoneme" in r:
            raise _phoneme_refused(str(grapheme))
        if r.get("type", "alias") != "alias":
            raise RequestError(G.BAD_LEXICON, f"rule {i}: type must be 'alias' (or 'phoneme', which is refused)")
        out.append(_rule(grapheme, r.get("alias"), f"rule {i}"))
    return out


def _pls_text(element: Any) -> str:
    """A PLS grapheme's or alias's text. One that holds an element (`<alias><break time="1s"/></alias>`,
    `x<sub>y</sub>z`) is refused: only its text before the element was read (the alias was "" or "x"), the rest
    dropped in silence, and an alias is plain text (the JSON rules refuse a tag in it)."""
    if len(element):
        name = str(element[0].tag).rpartition("}")[2]
        kind = str(element.tag).rpartition("}")[2]
        raise RequestError(
            G.BAD_LEXICON,
            f"a <lexeme>'s <{kind}> holds the element <{name[:40]}> after {(element.text or '')[:40]!r}: a grapheme "
            "and an alias are plain text, so put breaks and tags in the text itself",
        )
    return element.text or ""


def rules_from_pls(data: bytes) -> list[Rule]:
    """A W3C PLS lexicon: each lexeme's graphemes read as its alias; a lexeme with a phoneme is refused. Run it in a
    worker thread: it is parsed PLS_FEED_BYTES at a time."""
    if data.count(b"<") > MAX_PLS_TAGS:
        raise RequestError(G.BAD_LEXICON, f"a PLS lexicon holds at most {MAX_PLS_TAGS} tags ({MAX_RULES} lexemes)")
    try:
        parser = ElementTree.XMLParser()  # defusedxml's, as its fromstring makes it: no entities, no external DTD
        for at in range(0, len(data), PLS_FEED_BYTES):
            parser.feed(data[at : at + PLS_FEED_BYTES])
        root = parser.close()
    except Exception as e:  # defusedxml refuses entities and DTDs; a parse error is the file's
        raise RequestError(G.BAD_LEXICON, f"not a PLS lexicon: {str(e)[:200]}") from None
    if root.tag not in (f"{_PLS_NS}lexicon", "lexicon"):
        raise RequestError(G.BAD_LEXICON, "not a PLS lexicon: the root element must be <lexicon>")
    out = []
    for lexeme in root:
        if lexeme.tag not in (f"{_PLS_NS}lexeme", "lexeme"):
            continue
        graphemes = [_pls_text(g) for g in lexeme if g.tag in (f"{_PLS_NS}grapheme", "grapheme")]
        aliases = [_pls_text(a) for a in lexeme if a.tag in (f"{_PLS_NS}alias", "alias")]
        if any(p.tag in (f"{_PLS_NS}phoneme", "phoneme") for p in lexeme) and not aliases:
            raise _phoneme_refused(graphemes[0] if graphemes else "?")
        if not graphemes or not aliases:
            raise RequestError(G.BAD_LEXICON, "every <lexeme> needs a <grapheme> and an <alias>")
        out += [_rule(g, aliases[0], "a <lexeme>") for g in graphemes]
    if not out or len(out) > MAX_RULES:
        raise RequestError(G.BAD_LEXICON, f"a lexicon holds 1-{MAX_RULES} lexemes")
    return out


def _word_char(c: str) -> bool:
    # what a regex's \w matches in text, and the marks that belong to the letter before them (a combining accent,
    # an Indic vowel sign or virama): "cafe" is not a whole word of "cafe\u0301", nor "नमस" of "नमस्ते"
    return c.isalnum() or c == "_" or unicodedata.category(c)[0] == "M"


class Aliases:
    """Rules ready to apply: each grapheme's alias (the first rule of a grapheme wins) and, per first character, the
    lengths of the graphemes it begins, longest first. Strings and tuples of ints only, which the collector does not
    track: a dictionary kept parsed (LexiconStore) or named by a session is a few objects to it, not one per rule (32
    dictionaries of 5000 Rule objects added 12-20 ms to every full collection of the gateway process, hostile pass),
    and an utterance's lookups need no table built for them."""

    __slots__ = ("_lengths", "_table")

    def __init__(self, rules: Iterable[Rule | tuple[str, str]] = ()) -> None:
        table: dict[str, str] = {}
        for r in rules:
            grapheme, alias = (r.grapheme, r.alias) if isinstance(r, Rule) else r
            table.setdefault(grapheme, alias)
        lengths: dict[str, set[int]] = {}
        for g in table:
            lengths.setdefault(g[0], set()).add(len(g))
        self._table = table
        self._lengths = {c: tuple(sorted(ls, reverse=True)) for c, ls in lengths.items()}

    def __len__(self) -> int:
        return len(self._table)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Aliases) and other._table == self._table

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Aliases({len(self._table)} graphemes)"

    def items(self) -> Iterable[tuple[str, str]]:
        """(grapheme, alias), in the order the rules came."""
        return self._table.items()


def apply_rules(text: str, rules: Aliases | Iterable[Rule]) -> str:
    """`text` with each whole-word occurrence of a rule's grapheme read as its alias (the first rule of a
    grapheme wins; at one place the longest grapheme wins, "New York City" over "New York"), left to right.

    A lookup by length rather than one regex alternation of every grapheme: matching an alternation is one C
    call that holds the GIL throughout (5000 graphemes sharing a 250-character prefix take ~1 s per utterance,
    every session's event loop waiting), and each compiled pattern takes ~17 MB. Here the work at a word's
    start is one slice per distinct grapheme length beginning with its character."""
    aliases = rules if isinstance(rules, Aliases) else Aliases(rules)
    if not aliases:
        return text
    table, lengths = aliases._table, aliases._lengths
    out: list[str] = []
    done = i = 0
    n = len(text)
    while i < n:
        found = 0
        if text[i] in lengths and (i == 0 or not _word_char(text[i - 1])):
            for size in lengths[text[i]]:
                end = i + size
                if end <= n and text[i:end] in table and (end == n or not _word_char(text[end])):
                    found = size
                    break
        if found:
            out += (text[done:i], table[text[i : i + found]])
            i = done = i + found
        else:
            i += 1
    return "".join(out) + text[done:]


async def apply_rules_off_loop(text: str, rules: Aliases) -> str:
    """`apply_rules` in a worker thread: with thousands of rules of many lengths, a text's lookups take tens of
    milliseconds, which every session's event loop would wait for."""
    if not rules:
        return text
    return await asyncio.to_thread(apply_rules, text, rules)


class LexiconStore:
    """Dictionaries on disk, per owner (the API key that made them; "" without keys): see the module docstring."""

    def __init__(self, root: Path) -> None:
        self.root = root
        # the rules of dictionaries read lately, by (owner, id), each with the identity of the file it came from
        # (inode, mtime, size): each session or context that names a dictionary reads it (in a worker thread,
        # Gateway.lexicon), and a 1 MB file parsed for each of a flood of configs cost every socket's audio (4 -> 36 ms
        # p50 on /healthz, when it was read on the event loop); a file written since (any gateway process:
        # os.replace, a new inode) is read again
        self._rules: OrderedDict[tuple[str, str], tuple[tuple[int, int, int], Aliases]] = OrderedDict()
        self._rules_lock = threading.Lock()  # lookups run in worker threads (Gateway.lexicon, the routes)
        root.mkdir(parents=True, exist_ok=True)
        self._remove_unfinished()
        for legacy in root.glob("pd_*.json"):  # one document per dictionary in `root` itself: moved to its owner's
            lex = self._read_whole(legacy)
            if lex is not None:
                self._write(lex)
            legacy.unlink(missing_ok=True)

    def _remove_unfinished(self) -> None:
        """Writes a killed process left unfinished (`.tmp-*`, `_put`) go away; only those older than
        SHARED_RECOVER_AGE_S: younger ones may be another gateway process's write in progress."""
        now = time.time()
        for tmp in self.root.glob("*/.tmp-*"):
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime >= SHARED_RECOVER_AGE_S:
                    tmp.unlink()

    @contextlib.contextmanager
    def _owner_lock(self, owner: str) -> Iterator[None]:
        """The owner's folder, held by one writer at a time in every gateway process (an advisory file lock):
        the count of its dictionaries and the write of a new one are one step (`add`), so requests at once cannot
        take an owner past MAX_PER_OWNER."""
        folder = self._dir(owner)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # (released when the file closes)
            yield

    def _dir(self, owner: str) -> Path:
        return self.root / (owner or _ANONYMOUS)

    def _meta_path(self, lid: str, owner: str) -> Path:
        return self._dir(owner) / f"{lid}.json"

    def _rules_path(self, lid: str, owner: str) -> Path:
        return self._dir(owner) / f"{lid}.rules.json"

    @staticmethod
    def _put(path: Path, doc: object) -> None:
        # UTF-8 as it is: \uXXXX escapes would be 3x the bytes and 9x the parse
        replace_file(path, json.dumps(doc, ensure_ascii=False).encode())

    def _write(self, lex: Lexicon) -> None:
        self._dir(lex.owner).mkdir(parents=True, exist_ok=True)
        self._put(self._rules_path(lex.id, lex.owner), [[r.grapheme, r.alias] for r in lex.rules])
        meta = {k: v for k, v in asdict(lex).items() if k != "rules"}
        self._put(self._meta_path(lex.id, lex.owner), meta)  # last: a dictionary exists once its metadata does

    def add(self, owner: str, name: object, rules: list[Rule], description: object = None) -> Lexicon:
        if not isinstance(name, str) or not name.strip() or len(name) > 100:
            raise RequestError(G.BAD_LEXICON, "a dictionary needs a name of 1-100 characters")
        if description is not None and (not isinstance(description, str) or len(description) > 1000):
            raise RequestError(G.BAD_LEXICON, "description must be text of at most 1000 characters")
        check_text(name, "the dictionary's name", G.BAD_LEXICON)  # (both are written to a UTF-8 file)
        check_text(description or "", "description", G.BAD_LEXICON)
        lid = "pd_" + secrets.token_hex(8)
        lex = Lexicon(lid, name.strip(), owner, rules, description=description or "", rule_count=len(rules))
        with self._owner_lock(owner):
            if len(self._ids(owner)) >= MAX_PER_OWNER:
                raise RequestError(G.BAD_LEXICON, f"at most {MAX_PER_OWNER} dictionaries per key; delete one first")
            self._write(lex)
        return lex

    def _ids(self, owner: str) -> builtins.list[str]:
        folder = self._dir(owner)
        if not folder.is_dir():
            return []
        return [p.stem for p in folder.glob("pd_*.json") if _ID.match(p.stem)]

    @staticmethod
    def _read_whole(path: Path) -> Lexicon | None:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            doc["rules"] = [Rule(**r) for r in doc["rules"]]
            return Lexicon(**doc, rule_count=len(doc["rules"]))
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def _read_meta(self, lid: str, owner: str) -> Lexicon | None:
        try:
            doc = json.loads(self._meta_path(lid, owner).read_text(encoding="utf-8"))
            lex = Lexicon(**doc, rules=[])
        except (OSError, ValueError, TypeError):
            return None
        return lex if lex.owner == owner and lex.id == lid else None

    def _meta(self, lid: object, owner: str) -> Lexicon:
        lex = self._read_meta(lid, owner) if isinstance(lid, str) and _ID.match(lid) else None
        if lex is None:
            raise RequestError(G.UNKNOWN_LEXICON, f"no pronunciation dictionary {str(lid)[:40]!r}")
        return lex

    def get(self, lid: object, owner: str) -> Lexicon:
        """A dictionary with every rule of its file (the dictionary routes)."""
        lex = self._meta(lid, owner)
        try:
            lex.rules = [Rule(g, a) for g, a in json.loads(self._rules_path(lex.id, owner).read_text(encoding="utf-8"))]
        except (OSError, ValueError, TypeError):
            raise RequestError(G.UNKNOWN_LEXICON, f"no pronunciation dictionary {lex.id!r}") from None
        return lex

    def aliases(self, lid: object, owner: str) -> Aliases:
        """A dictionary's rules ready to apply (a request that names it): from the cache while its file is the one
        they were read from."""
        lex = self._meta(lid, owner)  # (read each time: another process may have deleted it)
        path, key = self._rules_path(lex.id, owner), (owner, lex.id)
        try:
            st = path.stat()
            ident = (st.st_ino, st.st_mtime_ns, st.st_size)
            with self._rules_lock:
                cached = self._rules.get(key)
                if cached is not None and cached[0] == ident:
                    self._rules.move_to_end(key)
                    return cached[1]
            aliases = Aliases((g, a) for g, a in json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            with self._rules_lock:
                self._rules.pop(key, None)
            raise RequestError(G.UNKNOWN_LEXICON, f"no pronunciation dictionary {lex.id!r}") from None
        with self._rules_lock:
            self._rules[key] = (ident, aliases)
            while len(self._rules) > RULES_CACHE:
                self._rules.popitem(last=False)
        return aliases

    def list(self, owner: str) -> builtins.list[Lexicon]:
        """The owner's dictionaries, oldest first: their metadata (`rules` is not read)."""
        found = (self._read_meta(lid, owner) for lid in self._ids(owner))
        return sorted((x for x in found if x is not None), key=lambda x: x.created_at)

    def delete(self, lid: object, owner: str) -> Lexicon:
        lex = self._meta(lid, owner)
        with self._rules_lock:
            self._rules.pop((owner, lex.id), None)
        self._meta_path(lex.id, owner).unlink(missing_ok=True)  # first: gone for every process at once
        self._rules_path(lex.id, owner).unlink(missing_ok=True)
        return lex
