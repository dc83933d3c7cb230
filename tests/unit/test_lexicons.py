"""Pronunciation dictionaries (app/voices/lexicons.py): PLS and rule uploads, phoneme rules refused, alias
rules applied to whole words, stored per owner."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import threading
import time
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.voices import lexicons
from app.voices.lexicons import (
    MAX_PLS_TAGS,
    MAX_RULES,
    PLS_FEED_BYTES,
    Aliases,
    LexiconStore,
    Rule,
    apply_rules,
    apply_rules_off_loop,
    rules_from_json,
    rules_from_pls,
)

PLS = b"""<?xml version="1.0" encoding="UTF-8"?>
<lexicon version="1.0" xmlns="http://www.w3.org/2005/01/pronunciation-lexicon" alphabet="ipa" xml:lang="en-US">
  <lexeme><grapheme>tomato</grapheme><alias>tomahto</alias></lexeme>
  <lexeme><grapheme>ZONOS</grapheme><grapheme>Zonos</grapheme><alias>zoh nos</alias></lexeme>
</lexicon>"""
PHONEME = PLS.replace(b"<alias>tomahto</alias>", b"<phoneme>t\xc9\x99\xcb\x88m\xc9\x91\xcb\x90to\xca\x8a</phoneme>")


def test_pls_aliases_are_read_and_phonemes_refused():
    rules = rules_from_pls(PLS)
    assert rules == [Rule("tomato", "tomahto"), Rule("ZONOS", "zoh nos"), Rule("Zonos", "zoh nos")]
    with pytest.raises(RequestError) as e:
        rules_from_pls(PHONEME)
    assert e.value.code == "bad_lexicon" and "phoneme" in str(e.value) and "tomato" in str(e.value)
    for bad in (b"not xml", b"<root/>", b'<!DOCTYPE x [<!ENTITY a "aaaa">]><lexicon>&a;</lexicon>'):
        with pytest.raises(RequestError):
            rules_from_pls(bad)


def test_a_pls_of_too_many_tags_is_refused_before_it_is_parsed():
    """1 MB of empty elements (parsed: 0.3 s of the parser holding the GIL) is refused from its count of tags; a file
    of MAX_RULES lexemes, each with two graphemes and a phoneme beside its alias, is read (parsed in pieces)."""
    crowded = PLS.replace(b"</lexicon>", b"<x/>" * (MAX_PLS_TAGS + 1) + b"</lexicon>")
    with pytest.raises(RequestError) as e:
        rules_from_pls(crowded)
    assert e.value.code == "bad_lexicon" and f"at most {MAX_PLS_TAGS} tags" in str(e.value), e.value
    n = MAX_RULES // 2 - 2  # with PLS's three: MAX_RULES - 1 rules
    lexeme = "<lexeme><grapheme>w{0}</grapheme><grapheme>W{0}</grapheme><phoneme>p</phoneme><alias>a{0}</alias>"
    lexeme += "</lexeme>"
    full = PLS.replace(b"</lexicon>", "".join(lexeme.format(i) for i in range(n)).encode() + b"</lexicon>")
    assert len(full) > 2 * PLS_FEED_BYTES and full.count(b"<") > 9 * n
    rules = rules_from_pls(full)
    assert len(rules) == 3 + 2 * n and rules[-1] == Rule(f"W{n - 1}", f"a{n - 1}")


def test_rules_from_json_take_elevenlabs_rules_and_refuse_phonemes():
    assert rules_from_json([{"type": "alias", "string_to_replace": "SQL", "alias": "sequel"}]) == [
        Rule("SQL", "sequel")
    ]
    with pytest.raises(RequestError):
        rules_from_json([{"type": "phoneme", "string_to_replace": "SQL", "phoneme": "si", "alphabet": "ipa"}])
    for bad in ([], "x", [{"alias": "y"}], [{"string_to_replace": "x" * 300, "alias": "y"}]):
        with pytest.raises(RequestError):
            rules_from_json(bad)


@pytest.mark.parametrize(
    "alias",
    [
        'wait <break time="1s"/>',
        "<spell>OTP</spell>",
        "[happy] yes",
        '<emotion value="calm"/>',
        "<speed ratio=2/>",
        '<prosody rate="slow">',
        "x</break>",
    ],
)
def test_an_alias_holding_a_tag_is_refused_it_would_be_read_aloud(alias):
    """Aliases replace words after a text's breaks and tags were taken out of it: a tag in an alias reached the model
    as markup ("less than break time equals ..."). Refused when the rule is made, JSON or PLS; a bracket that is no
    tag ([1]) and a lone '<' are text, as in any text."""
    with pytest.raises(RequestError) as e:
        rules_from_json([{"type": "alias", "string_to_replace": "OTP", "alias": alias}])
    assert e.value.code == "bad_lexicon" and "OTP" in str(e.value) and "tag" in str(e.value), str(e.value)
    escaped = alias.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").encode()
    with pytest.raises(RequestError) as e:
        rules_from_pls(PLS.replace(b"<alias>tomahto</alias>", b"<alias>" + escaped + b"</alias>"))
    assert e.value.code == "bad_lexicon" and "tomato" in str(e.value), str(e.value)
    assert rules_from_json([{"grapheme": "lt", "alias": "less than <3 [1]"}]) == [Rule("lt", "less than <3 [1]")]


@pytest.mark.parametrize(
    "alias",
    [b'<alias><break time="1s"/></alias>', b"<alias>x<sub>y</sub>z</alias>", b"<alias>a<emphasis>b</emphasis></alias>"],
)
def test_a_pls_alias_holding_an_element_is_refused(alias):
    """An element inside a PLS alias: its text before the element was taken and the rest dropped in silence
    (`<alias><break time="1s"/></alias>` read "tomato" as nothing, `x<sub>y</sub>z` as "x"; the hostile pass), while
    the JSON rules refuse a break or tag in an alias."""
    with pytest.raises(RequestError) as e:
        rules_from_pls(PLS.replace(b"<alias>tomahto</alias>", alias))
    assert e.value.code == "bad_lexicon" and "plain text" in str(e.value), str(e.value)
    with pytest.raises(RequestError):
        rules_from_pls(PLS.replace(b"<grapheme>tomato</grapheme>", b"<grapheme>to<b/>mato</grapheme>"))


def test_aliases_replace_whole_words_case_sensitively():
    rules = (Rule("tomato", "tomahto"), Rule("New York", "New York City"), Rule("New", "Old"))
    assert apply_rules("A tomato, tomatoes, Tomato.", rules) == "A tomahto, tomatoes, Tomato."
    assert apply_rules("New York is New.", rules) == "New York City is Old."  # the longest match first


def test_a_letter_s_combining_mark_is_part_of_its_word():
    """A word spelled with combining marks (decomposed accents, Indic vowel signs and viramas) is not a grapheme
    that ends before the mark: "cafe" -> "kaffee" read "cafe\u0301" as "kaffee\u0301", and "नमस" replaced the start of
    "नमस्ते", leaving its virama on the alias (the hostile pass)."""
    rules = (Rule("cafe", "kaffee"), Rule("नमस", "hi"), Rule("e", "E"))
    assert apply_rules("cafe\u0301 au lait, cafe.", rules) == "cafe\u0301 au lait, kaffee."
    assert apply_rules("नमस्ते नमस", rules) == "नमस्ते hi"
    assert apply_rules("\u0301e x", rules) == "\u0301e x"  # a mark before it: not a word's start either


def _regex_rules(text: str, rules: tuple[Rule, ...]) -> str:
    """The rule as a regex says it: whole words, the first rule of a grapheme, the longest grapheme first."""
    table: dict[str, str] = {}
    for r in rules:
        table.setdefault(r.grapheme, r.alias)
    alts = "|".join(re.escape(g) for g in sorted(table, key=len, reverse=True))
    return re.sub(rf"(?<!\w)(?:{alts})(?!\w)", lambda m: table[m.group(0)], text)


_PIECES = st.text(alphabet="ab _.-é1²", max_size=5).map(str.strip).filter(bool)


@settings(max_examples=300, deadline=None)
@given(
    rules=st.lists(st.tuples(_PIECES, st.sampled_from(["X", "", "a b"])), min_size=1, max_size=6),
    text=st.text(alphabet="ab _.-é1²\n", max_size=40),
)
def test_aliases_match_the_regex_rule(rules, text):
    rs = tuple(Rule(g, a) for g, a in rules)
    assert apply_rules(text, rs) == _regex_rules(text, rs)


def test_a_hostile_dictionary_costs_little_cpu_and_keeps_no_memory():
    """5000 graphemes that share a 250-character prefix with the text, which one more grapheme keeps a regex
    from factoring out: matched as one regex alternation, each word's start tried every grapheme to its end, in
    one C call holding the GIL (every session's event loop waited ~1 s per 2000-character utterance), and each
    such dictionary's compiled pattern stayed cached (~17 MB, 256 of them). The bound is ~50x what it takes."""
    dictionaries = [(*(Rule("a " * 125 + f"{k}{i:05d}", "x") for i in range(4999)), Rule("z", "y")) for k in range(3)]
    text = "a " * 4000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cpu = time.thread_time()
        for rules in dictionaries:
            assert apply_rules(text, rules) == text
        cpu = time.thread_time() - cpu
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert cpu < 0.5, f"{cpu:.2f} s of CPU"
    assert kept < 1 << 20, f"{kept} bytes kept"


def test_dictionaries_are_per_owner_and_on_disk(tmp_path):
    store = LexiconStore(tmp_path)
    lex = store.add("alice", "mine", [Rule("a", "b")])
    assert [x.id for x in LexiconStore(tmp_path).list("alice")] == [lex.id]  # a new store (a restart) sees it
    assert LexiconStore(tmp_path).list("bob") == []
    with pytest.raises(RequestError) as e:
        store.get(lex.id, "bob")
    assert e.value.code == "unknown_lexicon"
    store.delete(lex.id, "alice")
    assert store.list("alice") == []


def test_dictionaries_added_at_once_never_take_an_owner_past_the_limit(tmp_path, monkeypatch):
    """The count and the write are one step under the owner's lock (every gateway process's): requests at once
    (here 8 threads, each counting slowly) add exactly what the limit leaves room for."""
    monkeypatch.setattr(lexicons, "MAX_PER_OWNER", 3)
    store = LexiconStore(tmp_path)
    count = store._ids

    def slow_count(owner: str) -> list[str]:
        ids = count(owner)
        time.sleep(0.05)  # the window in which another request could count the same number
        return ids

    monkeypatch.setattr(store, "_ids", slow_count)
    added, refused = [], []

    def add(i: int) -> None:
        try:
            added.append(store.add("alice", f"d{i}", [Rule("a", "b")]))
        except RequestError as e:
            refused.append(e.code)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(added) == 3 and refused == ["bad_lexicon"] * 5
    assert len(LexiconStore(tmp_path).list("alice")) == 3


def test_a_write_left_unfinished_by_a_killed_process_is_removed_at_start_once_old(tmp_path):
    """A `.tmp-*` file older than SHARED_RECOVER_AGE_S is a killed process's; a younger one may be another
    gateway process's write in progress and stays."""
    store = LexiconStore(tmp_path)
    store.add("alice", "mine", [Rule("a", "b")])
    folder = tmp_path / "alice"
    old, young = folder / ".tmp-old", folder / ".tmp-young"
    old.write_text("[")
    young.write_text("[")
    past = time.time() - lexicons.SHARED_RECOVER_AGE_S - 1
    os.utime(old, (past, past))
    LexiconStore(tmp_path)
    assert not old.exists() and young.exists()
    assert len(LexiconStore(tmp_path).list("alice")) == 1


def test_text_with_no_utf8_form_is_a_bad_lexicon_and_nothing_is_written(tmp_path):
    """A lone surrogate (JSON's "\\ud800") in a rule, a name or a description has no place in the store's UTF-8
    files: writing it raised UnicodeEncodeError (a 500) after the rules file was written."""
    for bad in ({"string_to_replace": "x\ud800", "alias": "y"}, {"string_to_replace": "x", "alias": "\udfffy"}):
        with pytest.raises(RequestError) as e:
            rules_from_json([bad])
        assert e.value.code == "bad_lexicon" and "surrogate" in str(e.value)
    store = LexiconStore(tmp_path)
    for name, description in (("d\ud800", None), ("d", "\ud800")):
        with pytest.raises(RequestError) as e:
            store.add("alice", name, [Rule("a", "b")], description)
        assert e.value.code == "bad_lexicon"
    assert store.list("alice") == [] and not [p for p in tmp_path.rglob("*") if p.is_file()]


def _count_parses(monkeypatch) -> list[int]:
    """The length of every document json.loads parses from now on (the store's reads)."""
    parsed: list[int] = []
    real = json.loads

    def counted(s, *args, **kwargs):
        parsed.append(len(s))
        return real(s, *args, **kwargs)

    monkeypatch.setattr(json, "loads", counted)
    return parsed


def test_a_listing_reads_only_its_owners_metadata_and_rules_are_stored_as_utf8(tmp_path, monkeypatch):
    """An owner's hundred dictionaries of thousands of rules are hundreds of MB: a listing, and the count a new
    dictionary is held to (MAX_PER_OWNER), read only that owner's metadata, never rules (every listing parsed every
    owner's rules: ~1.5 s holding the GIL, so a few clients listing in a loop stalled every session's audio); the
    rules are UTF-8 on disk (\\u escapes were 3x the bytes and 9x the parse). A dictionary is still read whole."""
    store = LexiconStore(tmp_path)
    rules = [Rule("é" * 100 + str(i), "à" * 50) for i in range(100)]
    mine = [store.add("alice", f"d{k}", rules) for k in range(3)]
    store.add("bob", "other", rules)
    text = sum(len(r.grapheme.encode()) + len(r.alias.encode()) for r in rules)
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.json")) < 4 * text * 1.2
    parsed = _count_parses(monkeypatch)
    listed = store.list("alice")
    store.add("alice", "d3", rules[:1])
    assert [x.id for x in listed] == [x.id for x in mine]
    assert [x.public()["version_rules_num"] for x in listed] == [100] * 3
    assert sum(parsed) < text / 10, f"{sum(parsed)} characters parsed"
    assert store.get(mine[0].id, "alice").rules == rules


def test_a_dictionary_named_again_is_not_parsed_again_until_its_file_changes(tmp_path, monkeypatch):
    """Each session or context that names a dictionary reads it (in a worker thread: Gateway.lexicon): its rules are
    parsed once and kept while their file is the same (a flood of configs naming a 1 MB dictionary parsed it for each,
    holding every socket's audio); a file another process rewrote is read again, and a deleted dictionary is unknown
    at once. The routes' `get` reads the file whole."""
    store = LexiconStore(tmp_path)
    rules = [Rule(f"word{i}", f"alias{i}") for i in range(2000)]
    lex = store.add("alice", "big", rules)
    parsed = _count_parses(monkeypatch)
    for _ in range(20):
        assert store.aliases(lex.id, "alice") == Aliases(rules)
    big = [n for n in parsed if n > 10_000]
    assert len(big) == 1, parsed  # the rules once; each lookup still reads the small metadata (another's delete)
    assert store.aliases(lex.id, "alice") is store.aliases(lex.id, "alice")  # one object, shared
    assert store.get(lex.id, "alice").rules == rules
    LexiconStore(tmp_path)._put(store._rules_path(lex.id, "alice"), [["new", "rules"]])  # another process writes it
    assert store.aliases(lex.id, "alice") == Aliases([Rule("new", "rules")])
    LexiconStore(tmp_path).delete(lex.id, "alice")  # and another deletes it
    with pytest.raises(RequestError) as e:
        store.aliases(lex.id, "alice")
    assert e.value.code == G.UNKNOWN_LEXICON


def test_dictionaries_kept_parsed_are_no_work_for_the_collector(tmp_path):
    """The store keeps RULES_CACHE dictionaries parsed, and every session that names one holds it: as Rule objects,
    one for the collector to track per rule, 32 dictionaries of 5000 rules added 12-20 ms to every full collection
    of the gateway process (hostile pass; the collector's pause is every session's audio waiting). Kept as Aliases
    (strings and tuples of ints), a dictionary is a few objects whatever its size."""
    store = LexiconStore(tmp_path)
    rules = [Rule(f"w{i}{'x' * 40}", f"alias {i}") for i in range(MAX_RULES)]
    lex = store.add("alice", "big", rules)
    aliases = store.aliases(lex.id, "alice")
    gc.collect()  # (the collector untracks what holds only strings and numbers as it meets it)
    assert gc.is_tracked(rules[0])  # one object per rule, were they kept as Rules
    held = [aliases._table, aliases._lengths, *aliases._lengths.values()]
    assert not [type(o) for o in held if gc.is_tracked(o)]
    assert apply_rules("say w7" + "x" * 40 + " now", aliases) == "say alias 7 now"


def test_a_store_of_one_document_per_dictionary_is_moved_to_its_owners_folder(tmp_path):
    legacy = {"id": "pd_0123456789abcdef", "name": "old", "owner": "alice", "rules": [{"grapheme": "a", "alias": "b"}]}
    (tmp_path / "pd_0123456789abcdef.json").write_text(json.dumps(legacy | {"version_id": "v_1", "created_at": 1.0}))
    store = LexiconStore(tmp_path)
    assert [x.id for x in store.list("alice")] == ["pd_0123456789abcdef"] and store.list("bob") == []
    assert store.get("pd_0123456789abcdef", "alice").rules == [Rule("a", "b")]
    assert not (tmp_path / "pd_0123456789abcdef.json").exists()


def test_rules_are_applied_off_the_event_loop(monkeypatch):
    """A dictionary's rules are matched in a worker thread (a large one takes tens of milliseconds), not on the
    loop every session shares; no rules: nothing to do, inline."""
    threads: list[int] = []
    real = lexicons.apply_rules

    def spy(text: str, rules: tuple[Rule, ...]) -> str:
        threads.append(threading.get_ident())
        return real(text, rules)

    monkeypatch.setattr(lexicons, "apply_rules", spy)

    async def go(rules: tuple[Rule, ...]) -> tuple[str, int]:
        return await apply_rules_off_loop("A tomato.", rules), threading.get_ident()

    out, loop_thread = asyncio.run(go((Rule("tomato", "tomahto"),)))
    assert out == "A tomahto." and threads and loop_thread not in threads
    assert asyncio.run(go(()))[0] == "A tomato." and len(threads) == 1


def test_the_dictionary_routes_use_the_store_off_the_event_loop(tmp_path, monkeypatch):
    """A dictionary can be MB of JSON: every route reads and writes the store in a worker thread, never on the
    loop the sessions share."""
    from types import SimpleNamespace

    from starlette.applications import Starlette
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from app.core.gateway import Gateway
    from app.core.metrics import Metrics
    from app.doors.dialects import elevenlabs_lexicons as routes

    store = LexiconStore(tmp_path)
    threads: dict[str, set[int]] = {}
    for name in ("add", "list", "get", "delete"):
        real = getattr(store, name)

        def spy(*args, _real=real, _name=name):
            threads.setdefault(_name, set()).add(threading.get_ident())
            return _real(*args)

        monkeypatch.setattr(store, name, spy)
    loop_threads: set[int] = set()

    def on_loop(endpoint):
        async def route(request):
            loop_threads.add(threading.get_ident())
            return await endpoint(request)

        return route

    base = "/v1/pronunciation-dictionaries"
    app = Starlette(
        routes=[
            Route(base + "/add-from-rules", on_loop(routes.add_from_rules), methods=["POST"]),
            Route(base, on_loop(routes.list_dictionaries), methods=["GET"]),
            Route(base + "/{dictionary_id}", on_loop(routes.dictionary), methods=["GET", "DELETE"]),
        ]
    )
    app.state.gateway = SimpleNamespace(
        settings=SimpleNamespace(api_keys=()), owner_of=Gateway.owner_of, lexicons=store, metrics=Metrics()
    )
    with TestClient(app) as client:
        rules = [{"type": "alias", "string_to_replace": "tomato", "alias": "tomahto"}]
        lid = client.post(base + "/add-from-rules", json={"name": "d", "rules": rules}).json()["id"]
        assert [d["id"] for d in client.get(base).json()["pronunciation_dictionaries"]] == [lid]
        assert client.get(f"{base}/{lid}").json()["rules"][0]["alias"] == "tomahto"
        assert client.delete(f"{base}/{lid}").json() == {"deleted": lid}
    assert set(threads) == {"add", "list", "get", "delete"} and loop_threads
    assert not loop_threads & set().union(*threads.values())


def test_a_requests_stored_dictionaries_are_read_off_the_event_loop(tmp_path, monkeypatch):
    """Gateway.lexicon (our session.config `lexicon`, ElevenLabs' locators, Cartesia's `pronunciation_dict_id`, and
    their HTTP bodies) reads a stored dictionary in a worker thread. The store keeps RULES_CACHE dictionaries parsed,
    an owner may have MAX_PER_OWNER: a client naming a different one in each of a run of pipelined configs had each
    1 MB of rules parsed on the event loop, back to back (hostile pass: /healthz p50 2 -> 275 ms, max 1 s)."""
    from types import SimpleNamespace

    from app.core.gateway import Gateway

    assert lexicons.RULES_CACHE < lexicons.MAX_PER_OWNER  # why the cache alone is no bound
    store = LexiconStore(tmp_path)
    lex = store.add("alice", "d", [Rule("tomato", "tomahto")])
    threads: list[int] = []
    real = store.aliases

    def spy(*args):
        threads.append(threading.get_ident())
        return real(*args)

    monkeypatch.setattr(store, "aliases", spy)

    async def go(spec):
        return await Gateway.lexicon(SimpleNamespace(lexicons=store), spec, "alice"), threading.get_ident()

    rules, loop_thread = asyncio.run(go([lex.id, {"grapheme": "a", "alias": "b"}]))
    assert rules == Aliases([Rule("tomato", "tomahto"), Rule("a", "b")])
    assert threads and loop_thread not in threads
    with pytest.raises(RequestError) as e:
        asyncio.run(go([{"pronunciation_dictionary_id": "pd_0000000000000000"}]))
    assert e.value.code == G.UNKNOWN_LEXICON


def test_a_request_names_at_most_max_rules_rules_counting_every_dictionary_it_names(tmp_path):
    """The rules a request names are bounded in all, a dictionary named twice counted twice: its rules are merged
    on the event loop (64 locators of one 5000-rule dictionary would be 320,000 lookups, ~20 ms, per config). One
    dictionary named alone is the store's own object, shared."""
    from types import SimpleNamespace

    from app.core.gateway import Gateway

    store = LexiconStore(tmp_path)
    big = store.add("alice", "big", [Rule(f"w{i}", "x") for i in range(MAX_RULES)])
    small = store.add("alice", "small", [Rule("tomato", "tomahto"), Rule("w1", "first")])
    gw = SimpleNamespace(lexicons=store)

    async def go(spec):
        return await Gateway.lexicon(gw, spec, "alice")  # type: ignore[arg-type]

    with pytest.raises(RequestError) as e:
        asyncio.run(go([big.id, big.id]))
    assert e.value.code == G.BAD_LEXICON
    assert asyncio.run(go([big.id])) is store.aliases(big.id, "alice")
    merged = asyncio.run(go([small.id, {"grapheme": "w1", "alias": "second"}, {"grapheme": "x", "alias": "y"}]))
    assert apply_rules("w1 tomato x", merged) == "first tomahto y"  # the first rule of a grapheme wins
