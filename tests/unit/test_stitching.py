"""Request stitching's state and store (app/core/stitching.py): a finished request's window survives the
data dir whole, is continued with the new request's own window size, and the store keeps each owner's
newest requests within the count, the bytes and the time it is given (the gateway path:
tests/system/test_stitching.py)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import numpy as np
import pytest

from app.core.continuation import Chain
from app.core.stitching import Kept, StitchStore, new_request_id
from app.io.errors import RequestError
from app.settings import Limits
from engine.frontend.longform import Continuation, LongFormOptions


def codes(n: int, v: int) -> np.ndarray:
    return np.full((n, 9), v, np.int64)


def state(*chunks: tuple[str, int]) -> Continuation:
    """The window after these chunks (text, frames) with the default options."""
    cont = Continuation()
    for i, (text, n) in enumerate(chunks):
        cont.add(text, codes(n, 1000 + i))
    return cont


def store(tmp_path: Path, **limits) -> StitchStore:
    return StitchStore(tmp_path / "stitching", Limits(**limits), "random:tiny:0")


def test_a_kept_state_survives_the_disk_and_continues_with_the_new_requests_window():
    kept = Kept.load(Kept.of(state(("One.", 5), ("Two.", 6), ("Three.", 7)), "v1", "m").dump())
    assert (kept.voice, kept.model, kept.index) == ("v1", "m", 3)
    assert kept.anchor is not None and kept.anchor[0] == "One." and np.array_equal(kept.anchor[1], codes(5, 1000))
    assert [t for t, _ in kept.tail] == ["Three."] and np.array_equal(kept.tail[0][1], codes(7, 1002))
    text, frames = kept.continuation(LongFormOptions()).window()  # the pinned first chunk, then the last
    assert text == "One. Three." and len(frames) == 12
    text, frames = kept.continuation(LongFormOptions(pin_anchor=False)).window()
    assert text == "Three." and len(frames) == 7
    assert kept.continuation(LongFormOptions(window_chunks=1)).window()[0] == "One."  # the anchor alone
    assert kept.continuation(LongFormOptions(window_chunks=1, pin_anchor=False)).window()[1].size == 0  # fresh
    # one chunk: no anchor in front of itself
    assert Kept.of(state(("Only.", 4)), "v", "m").continuation(LongFormOptions()).window()[0] == "Only."


def test_a_seeded_chain_continues_the_kept_window_and_ends_in_its_own_state():
    class Done:  # a final request's stream as the chain sees it
        rid, kept = 7, codes(3, 5)

    async def go():
        chain = Chain(LongFormOptions(), seed=state(("One.", 5), ("Two.", 6)), keep=True)
        link = chain.link()
        ctx = await chain.context(link)
        link.settle("Three.", Done())  # type: ignore[arg-type]
        return ctx, chain.state(), chain

    ctx, after, chain = asyncio.run(go())
    assert ctx.prev is None and ctx.text == "One. Two." and len(ctx.codes) == 11  # a stream of its own
    assert after is not None and after.index == 3 and after.window()[0] == "One. Three."
    assert chain.cont.index == 2  # the chain's own state is left as it was
    assert Chain(LongFormOptions()).state() is None


class Held:
    """A held (non-final) request's stream as the chain sees it: its kept frames, and whether it was ended."""

    def __init__(self, rid: int, kept: np.ndarray) -> None:
        self.rid, self.kept, self.ended = rid, kept, False
        self.kept_ready = asyncio.Event()
        self.kept_ready.set()

    def end(self) -> None:
        self.ended = True


def test_a_link_with_nothing_to_say_is_passed_over_as_a_break_is():
    """An utterance its pronunciation rules leave empty (no engine work) stands for the link before it: the next link
    continues that one's stream (it started a fresh stream: the voice reset), a turn that ends on it ends that stream
    (it held its tail for the continuation grace), and the state a later request continues holds it."""

    async def go(last_is_empty: bool):
        chain = Chain(LongFormOptions(), keep=True)
        first, empty = chain.link(), chain.link()
        await chain.context(first)
        held = Held(3, codes(4, 7))
        first.settle("Right.", held)  # type: ignore[arg-type]
        if last_is_empty:
            chain.end()  # the turn ends on the empty link, before it is passed over
            await chain.pass_over(empty)
            return held, None, chain.state()
        await chain.pass_over(empty)
        ctx = await chain.context(chain.link())
        return held, ctx, None

    held, ctx, _ = asyncio.run(go(False))
    assert ctx is not None and ctx.prev is held and ctx.text == "Right." and len(ctx.codes) == 4 and not held.ended
    held, _, after = asyncio.run(go(True))
    assert held.ended and after is not None and after.index == 1 and after.window()[0] == "Right."


def test_a_link_that_leaves_the_chain_ends_the_stream_before_it():
    """A link that makes no chunk (several engine requests, or failed before its chunk) leaves the chain: the next link
    starts fresh, and the stream before it, which only it would have continued, ends at once (or once submitted)."""

    async def go(submitted_first: bool):
        chain = Chain(LongFormOptions())
        first, leaving = chain.link(), chain.link()
        await chain.context(first)
        held = Held(3, codes(4, 7))
        if submitted_first:
            first.settle("Right.", held)  # type: ignore[arg-type]
        chain.leave(leaving)
        ended_before_settle = held.ended
        first.settle("Right.", held)  # type: ignore[arg-type]  # (a no-op when settled above)
        ctx = await chain.context(chain.link())
        return held.ended, ended_before_settle, ctx

    ended, _, ctx = asyncio.run(go(True))
    assert ended and ctx.prev is None and ctx.text == ""  # fresh
    ended, before, _ = asyncio.run(go(False))
    assert ended and not before  # ended as soon as it was submitted


def test_a_seeded_request_that_speaks_only_breaks_keeps_the_window_it_continued():
    """A request of breaks alone (`<break time="1s"/>`) continuing a kept one links no utterance: the voice's
    window goes on through it unchanged (a break does not reset the voice), so its own id can be continued."""
    seed = state(("One.", 5), ("Two.", 6))
    after = Chain(LongFormOptions(), seed=seed, keep=True).state()
    assert after is not None and after.index == 2 and after.window()[0] == "One. Two."
    assert Chain(LongFormOptions(), keep=True).state() is None  # nothing spoken, nothing continued: nothing kept


def test_the_store_keeps_an_owners_requests_for_that_owner_only(tmp_path):
    s = store(tmp_path)
    rid = new_request_id()
    s.put("k1", rid, Kept.of(state(("One.", 5)), "v1", s.model))
    assert s.get("k1", rid) is not None
    assert s.get("k2", rid) is None and s.get("", rid) is None  # another key's, and the anonymous owner's
    for bad in ("", "../k1/" + rid, rid.upper(), rid + "0", "x" * 32):
        assert s.get("k1", bad) is None


def test_an_expired_request_is_refused_and_deleted(tmp_path):
    s = store(tmp_path, stitch_ttl_s=60)
    rid = new_request_id()
    s.put("", rid, Kept.of(state(("One.", 5)), "v1", s.model))
    path = s.root / "_anonymous" / f"{rid}.npz"
    os.utime(path, (time.time() - 61, time.time() - 61))
    assert s.get("", rid) is None and not path.exists()


def test_an_owner_keeps_its_newest_requests_within_the_count_and_the_bytes(tmp_path):
    s = store(tmp_path, stitch_requests=3)
    ids = [new_request_id() for _ in range(5)]
    for i, rid in enumerate(ids):
        s.put("k1", rid, Kept.of(state(("One.", 50)), "v1", s.model))
        os.utime(s.root / "k1" / f"{rid}.npz", (1e9 + i, time.time() - 10 + i))  # their order, whatever the clock
    s.put("k2", new_request_id(), Kept.of(state(("One.", 50)), "v1", s.model))  # another owner's prunes only its own
    assert [s.get("k1", r) is not None for r in ids] == [False, False, True, True, True]
    one = len(Kept.of(state(("One.", 50)), "v1", s.model).dump())
    s = store(tmp_path, stitch_bytes=2 * one + one // 2)
    s.put("k1", (last := new_request_id()), Kept.of(state(("One.", 50)), "v1", s.model))
    kept = sorted(p.name for p in (s.root / "k1").iterdir())
    assert len(kept) == 2 and f"{last}.npz" in kept
    s = store(tmp_path, stitch_bytes=one - 1)  # one request over the bytes: not kept at all
    s.put("k3", (big := new_request_id()), Kept.of(state(("One.", 50)), "v1", s.model))
    assert s.get("k3", big) is None


def test_an_unreadable_file_is_no_request(tmp_path):
    s = store(tmp_path)
    rid = new_request_id()
    (s.root / "k1").mkdir(parents=True)
    (s.root / "k1" / f"{rid}.npz").write_bytes(b"PK\x03\x04 not a zip")
    assert s.get("k1", rid) is None


def test_previous_request_ids_name_the_request_a_refusal_is_about(tmp_path):
    s = store(tmp_path)
    a, b = new_request_id(), new_request_id()
    s.put("k1", a, Kept.of(state(("One.", 5)), "v1", s.model))
    s.put("k1", b, Kept.of(state(("One.", 5), ("Two.", 6)), "v1", s.model))
    assert s.previous([a, b], "k1", "v1").index == 2  # the last one is continued
    missing = new_request_id()
    with pytest.raises(RequestError) as e:
        s.previous([a, missing], "k1", "v1")
    assert e.value.code == "bad_params" and missing in str(e.value)
    with pytest.raises(RequestError) as e:
        s.previous([a], "k2", "v1")
    assert a in str(e.value)
    with pytest.raises(RequestError) as e:
        s.previous([a], "k1", "v2")
    assert a in str(e.value) and "another voice" in str(e.value)
    other = StitchStore(s.root, s.limits, "another model")
    with pytest.raises(RequestError):
        other.previous([a], "k1", "v1")


def test_stitching_off_or_long_form_off_refuses_ids_and_keeps_nothing(tmp_path):
    off = store(tmp_path, stitch_requests=0)
    on = store(tmp_path)

    async def go(s: StitchStore, ids: list[str], long_form: bool | None = None):
        return await s.stitch(ids, "k1", "v1", LongFormOptions(long_form=long_form), new_request_id())

    assert asyncio.run(go(off, [])) is None and asyncio.run(go(on, [], long_form=False)) is None
    for s, lf in ((off, None), (on, False)):
        with pytest.raises(RequestError) as e:
            asyncio.run(go(s, [new_request_id()], lf))
        assert e.value.code == "bad_params"
    st = asyncio.run(go(on, []))
    assert st is not None and st.seed is None
