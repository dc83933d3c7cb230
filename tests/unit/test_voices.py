"""Voices as first-class objects.

Unit tests of app/voices/library.py (embedding files, SLERP, the on-disk VoiceStore with its atomic writes and
crash recovery), then the /v1/voices API on the shared loopback server (tests/conftest.py `server`):
averaging several clips, previews, .npy/.npz round trips, blends, renames, deletes, every bad input,
and voices used by name from /v1/audio/speech, /tts/generate and the WebSocket protocol.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import io
import json
import logging
import os
import pickle
import zipfile

import httpx
import numpy as np
import pytest
import soundfile as sf
import websockets

from app.voices import library as voices_mod
from app.voices.library import MAX_EMBEDDING_ROWS, Voice, VoiceError, VoiceStore, parse_embedding_file, slerp

D = 2048  # the model's speaker embedding dimension (tiny preset and release alike)
FAST = {"max_frames": 12, "ignore_eos": True, "seed": 7}


def npy(arr: np.ndarray, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=allow_pickle)
    return buf.getvalue()


def npz(compressed: bool = False, **arrays: np.ndarray) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.getvalue()


def rand(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape or (D,)).astype(np.float32)


# ======================================================================================================
# Embedding files
# ======================================================================================================


def test_parse_embedding_accepts_npy_npz_and_averages():
    e = rand(1)
    assert np.array_equal(parse_embedding_file(npy(e), D), e)
    assert np.array_equal(parse_embedding_file(npy(e.astype(np.float64)), D), e)
    assert np.array_equal(parse_embedding_file(npy(e[None, None]), D), e)  # (1, 1, D) squeezes
    assert np.array_equal(parse_embedding_file(npy(np.arange(D, dtype=np.int16)), D), np.arange(D))
    rows = rand(2, 3, D)
    np.testing.assert_allclose(parse_embedding_file(npy(rows), D), rows.mean(0), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(parse_embedding_file(npy(np.asfortranarray(rows)), D), rows.mean(0), rtol=1e-6)
    # .npz: the 'emb' array wins over others; a single array needs no particular name
    got = parse_embedding_file(npz(other=rand(9), emb=rows), D)
    np.testing.assert_allclose(got, rows.mean(0), rtol=1e-6, atol=1e-7)
    assert np.array_equal(parse_embedding_file(npz(compressed=True, anything=e), D), e)
    # a structured array with a numeric 'emb' field gives that field
    rec = np.zeros(2, dtype=[("emb", "<f4", (D,)), ("label", "<i4")])
    rec["emb"] = rows[:2]
    np.testing.assert_allclose(parse_embedding_file(npy(rec), D), rows[:2].mean(0), rtol=1e-6, atol=1e-7)
    out = parse_embedding_file(npy(e), D)
    assert out.dtype == np.float32 and out.flags.writeable and out.flags.c_contiguous


def _header_only_npz(shape: tuple[int, ...]) -> bytes:
    """An .npz whose member *claims* a huge array but holds no data: must be refused from the header."""
    member = io.BytesIO()
    np.lib.format.write_array_header_1_0(member, {"descr": "<f4", "fortran_order": False, "shape": shape})
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("emb.npy", member.getvalue())
    return buf.getvalue()


def _truncated_npy() -> bytes:
    return npy(rand(3))[:-100]


def _empty_members(n: int) -> bytes:
    """A zip of n empty members: its central directory, which zipfile reads whole in Python, is n entries."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for i in range(n):
            zf.writestr(f"m{i}", b"")
    return buf.getvalue()


def _zip64_locator() -> bytes:
    """A one-array .npz with a zip64 end locator before its end record (zipfile would take the directory's size
    from the zip64 record it points to)."""
    data = npz(emb=rand(11))
    at = data.rindex(b"PK\x05\x06")
    return data[:at] + b"PK\x06\x07" + bytes(16) + data[at:]


BAD_EMBEDDINGS = {
    "wrong_dimension": (npy(np.ones(7, np.float32)), "shape (2048,) or (N, 2048), got (7,)"),
    "transposed_rows": (npy(rand(4, D, 3)), "got (2048, 3)"),
    "one_row_too_short": (npy(rand(4, 1, 100)), "got (1, 100)"),
    "three_dims": (npy(rand(5, 2, 3, D)), "got (2, 3, 2048)"),
    "no_rows": (npy(np.zeros((0, D), np.float32)), "holds no rows"),
    "nan": (npy(np.full(D, np.nan, np.float32)), "finite and within"),
    "inf_in_one_row": (npy(np.stack([rand(6), np.full(D, np.inf, np.float32)])), "finite and within"),
    "float64_overflow": (npy(np.full(D, 1e300)), "finite and within"),
    # finite, but past the speaker projections' bf16 range: the request sampled noise to its frame cap
    "huge_finite": (npy(np.full(D, 3e38, np.float32)), "finite and within"),
    "one_value_past_the_bound": (npy(np.concatenate([rand(12)[:-1], np.float32([2e6])])), "finite and within"),
    "complex": (npy(np.ones(D, np.complex64)), "real numbers"),
    "bool": (npy(np.ones(D, bool)), "real numbers"),
    "strings": (npy(np.array(["a"] * D)), "real numbers"),
    "pickled_object_array": (npy(np.array([rand(7)], dtype=object), allow_pickle=True), "object arrays"),
    "pickled_object_in_npz": (npz(emb=np.array([1, "x"], dtype=object)), "object arrays"),
    "raw_pickle": (pickle.dumps(rand(8)), "not a .npy/.npz"),
    "structured_without_emb": (npy(np.zeros(3, dtype=[("x", "<f4"), ("y", "<f4")])), "'emb' field"),
    "npz_two_arrays_no_emb": (npz(a=rand(9), b=rand(10)), "one array or an 'emb' array"),
    "npz_empty": (npz(), "one array or an 'emb' array"),
    "npz_twenty_arrays_no_emb": (npz(**{f"a{i:02d}": rand(i) for i in range(20)}), "'a07'] and 12 more"),
    "npz_many_members": (_empty_members(2000), "too many members"),
    "npz_zip64": (_zip64_locator(), "too many members"),
    "truncated": (_truncated_npy(), "truncated"),
    "text": (b"definitely not numpy", "not a .npy/.npz"),
    "empty": (b"", "not a .npy/.npz"),
    "bad_zip": (b"PK\x03\x04" + b"\0" * 64, "not a readable"),
    "huge_header": (_header_only_npz((10**9, D)), "too large"),
}


@pytest.mark.parametrize("case", list(BAD_EMBEDDINGS))
def test_parse_embedding_refuses(case):
    data, needle = BAD_EMBEDDINGS[case]
    with pytest.raises(VoiceError) as err:
        parse_embedding_file(data, D)
    assert err.value.code == "bad_embedding" and err.value.status == 400
    assert needle in str(err.value), str(err.value)


def test_embedding_errors_describe_the_file_not_python_objects():
    header = b"{garbage}" + b" " * 6 + b"\n"
    bad_header = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header
    with pytest.raises(VoiceError) as e:
        parse_embedding_file(bad_header, D)
    assert "object at 0x" not in str(e.value) and "header is damaged" in str(e.value), e.value


def test_compressed_npz_bomb_is_refused_before_inflating():
    data = npz(compressed=True, emb=np.zeros((MAX_EMBEDDING_ROWS + 1, D)))
    assert len(data) < 100_000  # ~16 MB of zeros in a few KB
    with pytest.raises(VoiceError, match="too large"):
        parse_embedding_file(data, D)
    with pytest.raises(VoiceError, match="too large"):
        parse_embedding_file(npz(compressed=True, emb=np.zeros((2 * MAX_EMBEDDING_ROWS + 1, 8), np.float32)), 8)
    ok = npz(compressed=True, emb=np.ones((MAX_EMBEDDING_ROWS, 8)))  # at the limit: accepted
    assert np.array_equal(parse_embedding_file(ok, 8), np.ones(8, np.float32))


# ======================================================================================================
# SLERP
# ======================================================================================================


def test_slerp_endpoints_midpoint_and_range():
    a, b = rand(11) * 3, rand(12)
    np.testing.assert_allclose(slerp(a, b, 0.0), a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(slerp(a, b, 1.0), b, rtol=1e-5, atol=1e-5)
    mid = slerp(a, b, 0.5)
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    assert np.isclose(np.linalg.norm(mid), (na + nb) / 2, rtol=1e-5)  # norms interpolate linearly
    ua, ub, um = a / na, b / nb, mid / np.linalg.norm(mid)
    assert np.isclose(um @ ua, um @ ub, rtol=1e-4)  # the direction is halfway along the great circle
    assert slerp(a, b, 0.3).dtype == np.float32
    np.testing.assert_allclose(slerp(a, 2 * a, 0.5), 1.5 * a, rtol=1e-5)  # parallel: no 0/0
    np.testing.assert_allclose(slerp(np.zeros(D, np.float32), b, 0.25), 0.25 * b, rtol=1e-6)
    for t in (-0.01, 1.01, float("nan")):
        with pytest.raises(VoiceError, match=r"\[0, 1\]"):
            slerp(a, b, t)


def test_a_blend_of_opposite_voices_is_refused_not_noise():
    """Antipodal voices have no one great circle between them: the midpoint was a zero or huge embedding (hostile
    pass); their ends are still themselves."""
    a = rand(13)
    for t in (0.5, 0.01, 0.99):
        with pytest.raises(VoiceError, match="opposite directions"):
            slerp(a, -2 * a, t)
    np.testing.assert_allclose(slerp(a, -a, 0.0), a, rtol=1e-6)
    np.testing.assert_allclose(slerp(a, -a, 1.0), -a, rtol=1e-6)


# ======================================================================================================
# VoiceStore on disk
# ======================================================================================================

DIM = 16


def add(
    store: VoiceStore,
    vid: str,
    name: str,
    seed: int = 0,
    owner: str = "",
    preview: bytes | None = None,
    created_at: float | None = None,
) -> Voice:
    v = Voice(id=vid, name=name, owner=owner, source="embedding", dim=DIM)
    if created_at is not None:
        v.created_at = created_at
    return store.add(v, rand(seed, DIM), preview)


def entries(root) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_store_persists_and_reloads(tmp_path):
    store = VoiceStore(tmp_path, DIM)
    add(store, "v_a", "Anna", seed=1, preview=b"RIFF-fake-wav", created_at=1.0)
    add(store, "v_b", "Ben", seed=2, created_at=2.0)
    assert entries(tmp_path) == ["v_a", "v_b"]
    assert entries(tmp_path / "v_a") == ["embedding.npy", "meta.json", "preview.wav"]
    meta = json.loads((tmp_path / "v_a" / "meta.json").read_text())
    assert meta["id"] == "v_a" and meta["name"] == "Anna" and "embedding" not in meta

    again = VoiceStore(tmp_path, DIM)
    assert again.error is None
    assert [v.id for v in again.list("")] == ["v_b", "v_a"]  # newest first
    a = again.get("v_a", "")
    assert a.name == "Anna" and a.has_preview and np.array_equal(a.embedding, rand(1, DIM))
    assert again.preview_bytes(a) == b"RIFF-fake-wav"
    assert again.preview_bytes(again.get("Ben", "")) is None


def test_get_by_id_or_name_newest_wins_and_owners_are_separate(tmp_path):
    store = VoiceStore(tmp_path, DIM)
    add(store, "v_old", "Same", seed=1, created_at=1.0)
    add(store, "v_new", "Same", seed=2, created_at=2.0)
    add(store, "v_key", "Private", seed=3, owner="k1")
    assert store.get("Same", "").id == "v_new" and store.get("v_old", "").id == "v_old"
    assert store.get("Private", "k1").id == "v_key"
    for ref, owner in (("Private", ""), ("v_key", "k2"), ("nobody", "")):
        with pytest.raises(VoiceError) as err:
            store.get(ref, owner)
        assert err.value.code == "unknown_voice" and err.value.status == 404
    with pytest.raises(VoiceError) as err:  # a 100,000-character name: its error quotes the start of it
        store.get("x" * 100_000, "")
    assert str(err.value) == f"no voice {'x' * 80!r}…"
    assert {v.id for v in store.list("k1")} == {"v_old", "v_new", "v_key"}  # public voices + its own
    assert {v.id for v in store.list("k2")} == {"v_old", "v_new"}


def test_one_key_stores_at_most_its_share_of_voices(tmp_path):
    """--max-voices-per-key: a key at its limit gets too_many_voices (409) for a new voice, whatever the other
    keys store; storing one of its voices again, or after deleting one, still works."""
    store = VoiceStore(tmp_path, DIM, max_per_owner=2)
    add(store, "v_1", "One", seed=1, owner="k1")
    add(store, "v_2", "Two", seed=2, owner="k1")
    with pytest.raises(VoiceError) as err:
        add(store, "v_3", "Three", seed=3, owner="k1")
    assert err.value.code == "too_many_voices" and err.value.status == 409 and "delete one" in str(err.value)
    add(store, "v_2", "Two again", seed=4, owner="k1")  # the same id stored again: no new voice
    add(store, "v_k2", "Theirs", seed=5, owner="k2")
    store.delete("v_1", "k1")
    add(store, "v_3", "Three", seed=3, owner="k1")
    assert {v.id for v in store.list("k1")} == {"v_2", "v_3"}


def test_a_keys_share_of_voices_is_the_servers_across_gateway_processes(tmp_path, monkeypatch):
    """--max-voices-per-key with --workers: each process counted the voices its memory held, and its rescan is due
    at most every SHARED_MIN_RESCAN_S (a clock the test holds still), so with 2 processes and a limit of 3 a key
    stored 6 (measured). The count is the store's now: a key's voices stored through the other process count at
    once, one it deleted there frees a place at once, and the same voice stored again is no new one."""
    now = [1000.0]
    monkeypatch.setattr(voices_mod.time, "monotonic", lambda: now[0])
    one, two = (VoiceStore(tmp_path, DIM, shared=True, max_per_owner=3) for _ in range(2))
    for i in range(3):
        add(one, f"v_{i}", f"n{i}", seed=i, owner="k1")
    with pytest.raises(VoiceError) as err:
        add(two, "v_3", "n3", seed=3, owner="k1")
    assert err.value.code == "too_many_voices" and err.value.status == 409
    add(two, "v_1", "n1 again", seed=1, owner="k1")  # one of its voices stored again: no new voice
    add(two, "v_k2", "Theirs", seed=5, owner="k2")
    one.delete("v_0", "k1")
    add(two, "v_3", "n3", seed=3, owner="k1")
    with pytest.raises(VoiceError):
        add(one, "v_4", "n4", seed=4, owner="k1")
    assert sorted(v.id for v in VoiceStore(tmp_path, DIM).list("k1")) == ["v_1", "v_2", "v_3"]


def test_disk_full_in_the_middle_of_a_write_leaves_no_half_voice(tmp_path, monkeypatch):
    store = VoiceStore(tmp_path, DIM)
    add(store, "v_keep", "Keep", seed=1)

    def no_space(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(voices_mod.np, "save", no_space)  # meta.json is written, the embedding fails
    with pytest.raises(VoiceError) as err:
        add(store, "v_new", "New", seed=2, preview=b"wav")
    assert err.value.code == "voice_store_unavailable" and err.value.status == 507
    assert "No space left on device" in str(err.value)
    # rewriting an existing voice's meta.json (a rename) fails the same way and changes nothing
    monkeypatch.setattr(voices_mod.os, "replace", no_space)
    with pytest.raises(VoiceError) as err:
        store.rename("Keep", "", "Renamed")
    assert err.value.status == 507
    monkeypatch.undo()

    assert entries(tmp_path) == ["v_keep"]  # no temp folder, no half voice, the old one untouched
    assert entries(tmp_path / "v_keep") == ["embedding.npy", "meta.json"]  # (no temporary meta.json left)
    assert store.find("v_new") is None and store.get("v_keep", "").name == "Keep"
    reloaded = VoiceStore(tmp_path, DIM)
    assert [(v.id, v.name) for v in reloaded.list("")] == [("v_keep", "Keep")]
    assert np.array_equal(reloaded.get("v_keep", "").embedding, rand(1, DIM))


class Crash(BaseException):
    """Stands for the process dying: nothing catches it."""


def test_crash_between_the_two_renames_is_recovered_at_load(tmp_path, monkeypatch):
    store = VoiceStore(tmp_path, DIM)
    add(store, "v_x", "Before", seed=1)
    np.save(tmp_path / "v_x" / "embedding.npy", np.ones(DIM + 1, np.float32))  # damaged: the folder reads as no voice
    real_replace, calls = os.replace, []

    def dies_on_second(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # the old version is set aside; the new one never lands
            raise Crash
        return real_replace(src, dst)

    monkeypatch.setattr(voices_mod.os, "replace", dies_on_second)
    with pytest.raises(Crash):
        add(store, "v_x", "After", seed=1)  # the same voice stored again over its damaged folder: replaced
    monkeypatch.undo()
    assert "v_x" not in entries(tmp_path) and any(n.startswith(".old-v_x-") for n in entries(tmp_path))
    (tmp_path / ".tmp-leftover").mkdir()
    (tmp_path / ".del-v_gone-1-2").mkdir()

    reloaded = VoiceStore(tmp_path, DIM)
    assert entries(tmp_path) == ["v_x"]  # restored as it was; leftovers cleaned
    assert json.loads((tmp_path / "v_x" / "meta.json").read_text())["name"] == "Before"
    assert np.load(tmp_path / "v_x" / "embedding.npy").shape == (DIM + 1,) and reloaded.find("v_x") is None
    v = add(reloaded, "v_x", "After", seed=1)  # stored again, uninterrupted: the damaged folder replaced
    assert v.name == "After" and entries(tmp_path) == ["v_x"]
    assert VoiceStore(tmp_path, DIM).get("v_x", "").name == "After"


def test_the_same_voice_stored_at_once_by_two_processes_is_the_one_that_landed_first(tmp_path):
    """Two uploads of one clip at once (a client retrying, two gateway processes): both found no voice of its id,
    embedded it, and stored it. The second set the first's folder aside to put its own in: another process found no
    voice of that id meanwhile, and where the first's landed between the second's look and its rename, the second
    failed, 503 voice_store_unavailable "Directory not empty" (measured: 2 of 160 uploads of 20 clips, 8 at once). The
    second now gets the voice that landed, left in place."""
    one, two = VoiceStore(tmp_path, DIM, shared=True), VoiceStore(tmp_path, DIM, shared=True)
    first = add(one, "v_a", "First", seed=1, preview=b"preview-bytes")
    folder = (tmp_path / "v_a").stat().st_ino
    mine = Voice(id="v_a", name="Second", owner="", source="embedding", dim=DIM)
    got = two.add(mine, rand(1, DIM))  # (two has not seen it: its rescan is not due)
    assert got is not mine and got.name == "First" and np.array_equal(got.embedding, first.embedding)
    assert (tmp_path / "v_a").stat().st_ino == folder and entries(tmp_path) == ["v_a"]  # never set aside
    assert two.get("v_a", "").name == "First" and two.preview_bytes(got) == b"preview-bytes"


def test_damaged_voice_folders_are_skipped(tmp_path, caplog):
    store = VoiceStore(tmp_path, DIM)
    add(store, "v_good", "Good", seed=1)
    for vid in ("v_meta", "v_noemb", "v_dim", "v_pickle", "v_nan", "v_moved"):
        add(store, vid, vid, seed=2)
    (tmp_path / "v_meta" / "meta.json").write_text("{ not json")
    (tmp_path / "v_noemb" / "embedding.npy").unlink()
    np.save(tmp_path / "v_dim" / "embedding.npy", np.ones(DIM + 1, np.float32))
    np.save(tmp_path / "v_pickle" / "embedding.npy", np.array([1, "x"], dtype=object), allow_pickle=True)
    np.save(tmp_path / "v_nan" / "embedding.npy", np.full(DIM, np.nan, np.float32))
    os.rename(tmp_path / "v_moved", tmp_path / "v_copy")  # meta.json names a folder that is not this one
    (tmp_path / "stray.txt").write_text("not a voice")
    (tmp_path / "v_empty").mkdir()

    with caplog.at_level(logging.WARNING, logger="gateway.voices"):
        reloaded = VoiceStore(tmp_path, DIM)
    assert reloaded.error is None
    assert [v.id for v in reloaded.list("")] == ["v_good"]
    skipped = caplog.text
    for name in ("v_meta", "v_noemb", "v_pickle", "v_nan", "v_copy", "v_empty"):
        assert name in skipped, name
    assert "v_dim" in skipped and "dimension" in skipped
    add(reloaded, "v_more", "More", seed=3)  # the store still works
    assert reloaded.get("More", "").id == "v_more"


def test_unwritable_store_root_reports_unavailable(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    store = VoiceStore(blocker / "voices", DIM)  # cannot be created: its parent is a file
    assert store.error and "unusable" in store.error
    assert store.list("") == []
    with pytest.raises(VoiceError) as err:
        add(store, "v_a", "A")
    assert err.value.code == "voice_store_unavailable" and err.value.status == 503

    # A root that exists but refuses writes (EACCES; root ignores chmod, so simulated): 503, not 507.
    ok = VoiceStore(tmp_path / "voices", DIM)

    def denied(*_a, **_k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(voices_mod.tempfile, "mkdtemp", denied)
    with pytest.raises(VoiceError) as err:
        add(ok, "v_a", "A")
    assert err.value.code == "voice_store_unavailable" and err.value.status == 503
    assert "Permission denied" in str(err.value)


def test_rename_keeps_embedding_and_preview(tmp_path):
    store = VoiceStore(tmp_path, DIM)
    add(store, "v_a", "Old name", seed=4, preview=b"preview-bytes")
    v = store.rename("Old name", "", "  New name  ")
    assert v.name == "New name" and v.id == "v_a"
    reloaded = VoiceStore(tmp_path, DIM)
    r = reloaded.get("New name", "")
    assert r.id == "v_a" and np.array_equal(r.embedding, rand(4, DIM))
    assert reloaded.preview_bytes(r) == b"preview-bytes"
    with pytest.raises(VoiceError):
        reloaded.get("Old name", "")
    for bad in ("", "x" * 65, "semi;colon", "new\nline"):
        with pytest.raises(VoiceError) as err:
            store.rename("v_a", "", bad)
        assert err.value.code == "bad_name"
    assert store.get("v_a", "").name == "New name"


def test_a_rename_never_takes_the_voice_away_from_another_process(tmp_path):
    """Two gateway processes on one library (a shared store). A rename swapped a whole new folder in: the voice's
    folder left for a moment, and the other process's lookups then answered unknown_voice (its rescan dropped the
    voice), its preview no_preview, and its own rename of the voice at that moment voice_store_unavailable (measured:
    2 processes, ~1,600 renames in 20 s). A rename now replaces meta.json in place: the folder stays, and the other
    process sees the new name at its next rescan."""
    one, two = VoiceStore(tmp_path, DIM, shared=True), VoiceStore(tmp_path, DIM, shared=True)
    add(one, "v_a", "Before", seed=1, preview=b"preview-bytes")
    two._sync(force=True)
    folder = (tmp_path / "v_a").stat().st_ino
    one.rename("v_a", "", "After")
    assert (tmp_path / "v_a").stat().st_ino == folder and entries(tmp_path) == ["v_a"]  # never moved aside
    assert entries(tmp_path / "v_a") == ["embedding.npy", "meta.json", "preview.wav"]  # (no temporary file left)
    two._sync(force=True)
    v = two.get("After", "")
    assert v.id == "v_a" and two.preview_bytes(v) == b"preview-bytes" and np.array_equal(v.embedding, rand(1, DIM))
    two.rename("v_a", "", "Again")  # the other process renames it too
    one._sync(force=True)
    assert one.get("v_a", "").name == "Again" and VoiceStore(tmp_path, DIM).get("v_a", "").name == "Again"


def test_a_rename_cut_short_leaves_the_voice_as_it_was(tmp_path, monkeypatch):
    """A rename that fails before its new meta.json is in place leaves the voice as it was and no file behind; one
    whose process died there (its `.meta-*` file left in the voice's folder) is cleaned up at the next start."""
    store = VoiceStore(tmp_path, DIM)
    add(store, "v_x", "Before", seed=1)

    def dies(src, dst):
        raise Crash

    monkeypatch.setattr(voices_mod.os, "replace", dies)
    with pytest.raises(Crash):
        store.rename("v_x", "", "After")
    monkeypatch.undo()
    assert entries(tmp_path / "v_x") == ["embedding.npy", "meta.json"] and store.get("v_x", "").name == "Before"
    (tmp_path / "v_x" / ".meta-left-by-a-kill").write_text('{"id": "v_x", "name": "After"}')
    reloaded = VoiceStore(tmp_path, DIM)
    assert reloaded.get("v_x", "").name == "Before"
    assert entries(tmp_path / "v_x") == ["embedding.npy", "meta.json"]


def test_a_voice_deleted_by_another_process_is_not_brought_back_by_a_rename(tmp_path):
    """One process renames a voice it still has in memory that another has just deleted: the rename wrote a whole new
    folder, so the deleted voice came back (both answered 200). Now: unknown_voice, and it stays deleted."""
    one, two = VoiceStore(tmp_path, DIM, shared=True), VoiceStore(tmp_path, DIM, shared=True)
    add(one, "v_a", "Doomed", seed=1, preview=b"preview-bytes")
    two._sync(force=True)
    two.delete("v_a", "")
    with pytest.raises(VoiceError) as err:
        one.rename("v_a", "", "Revived")  # (one's memory still holds it: its rescan is not due)
    assert err.value.code == "unknown_voice" and err.value.status == 404
    assert entries(tmp_path) == [] and VoiceStore(tmp_path, DIM).list("") == []
    assert one.preview_bytes(Voice(id="v_a", name="Doomed", owner="", source="clip", dim=DIM)) is None


def test_a_voice_deleted_by_another_process_is_gone_at_once_here_too(tmp_path):
    """One process deletes a voice the other still holds in memory (its rescan not due). The other went on using it
    (speech with a deleted voice), and storing the same array again through it answered `deduplicated` from memory
    and wrote nothing: 200 with the voice's id, then 404 in every process at their rescans (measured with --workers
    2). Now the other finds it gone at once, a name falls to another voice of that name, and a new upload lands."""
    one, two = VoiceStore(tmp_path, DIM, shared=True), VoiceStore(tmp_path, DIM, shared=True)
    add(one, "v_old", "Same name", seed=2, created_at=1.0)
    add(one, "v_a", "Same name", seed=1, created_at=2.0)
    two._sync(force=True)
    assert two.get("Same name", "").id == "v_a"
    one.delete("v_a", "")
    assert two.find("v_a") is None  # (its rescan is not due: it was in memory)
    assert two.get("Same name", "").id == "v_old"  # the name is the other voice's now
    with pytest.raises(VoiceError) as err:
        two.get("v_a", "")
    assert err.value.code == "unknown_voice"
    again = Voice(id="v_a", name="Back", owner="", source="embedding", dim=DIM)
    assert two.add(again, rand(1, DIM)) is again  # written, not an answer from memory
    assert VoiceStore(tmp_path, DIM).get("v_a", "").name == "Back" and one.get("v_a", "").name == "Back"


def test_a_voice_renamed_by_another_process_answers_to_its_new_name_only_at_once(tmp_path, monkeypatch):
    """One process renames a voice, then stores a new voice under the old name (a client that keeps a name for its
    newest voice); the other still held the voice in memory under its old name (its rescan not due: up to
    SHARED_MIN_RESCAN_S). Its lookups of the old name answered with the renamed voice: speech in the wrong voice, the
    new voice's name unknown (measured with --workers 2, the hostile pass). Now a voice found in memory whose folder
    changed is read again first (the stat `_gone` made already)."""
    now = [1000.0]
    monkeypatch.setattr(voices_mod.time, "monotonic", lambda: now[0])  # no rescan comes due by itself
    one, two = VoiceStore(tmp_path, DIM, shared=True), VoiceStore(tmp_path, DIM, shared=True)
    add(one, "v_a", "Alice", seed=1, created_at=1.0)
    two._sync(force=True)
    assert two.get("Alice", "").id == "v_a"
    one.rename("v_a", "", "Old Alice")
    add(one, "v_b", "Alice", seed=2, created_at=2.0)
    assert two.get("Alice", "").id == "v_b"  # (it was v_a: the voice renamed away)
    assert two.get("Old Alice", "").id == "v_a" and two.find("v_a").name == "Old Alice"
    one.rename("v_b", "", "Bob")
    with pytest.raises(VoiceError) as err:
        two.get("Alice", "")  # no voice has this name now
    assert err.value.code == "unknown_voice"
    assert two.get("Bob", "").id == "v_b" and one.get("Bob", "").id == "v_b"


def test_a_voice_deleted_while_another_process_stores_it_again_lands(tmp_path, monkeypatch):
    """One process stores a voice whose folder is already there (the same clip, stored before) just as another
    process deletes it: the folder in the way was gone by the time it was read, and setting it aside found nothing to
    move: 503 voice_store_unavailable. Now the new voice lands in its place. (The other process's delete is made to
    fall in that moment: the store's own read of the folder in the way runs it first.)"""
    one, two = VoiceStore(tmp_path, DIM, shared=True), VoiceStore(tmp_path, DIM, shared=True)
    add(one, "v_a", "First", seed=1)
    real = two._read_folder

    def deleted_meanwhile(d):
        monkeypatch.setattr(two, "_read_folder", real)
        one.delete("v_a", "")
        return real(d)

    monkeypatch.setattr(two, "_read_folder", deleted_meanwhile)
    mine = Voice(id="v_a", name="Second", owner="", source="embedding", dim=DIM)
    assert two.add(mine, rand(2, DIM)) is mine
    assert entries(tmp_path) == ["v_a"] and VoiceStore(tmp_path, DIM).get("v_a", "").name == "Second"


def test_default_and_foreign_voices_are_read_only(tmp_path):
    store = VoiceStore(tmp_path, DIM)
    store.remember_default(
        Voice(id="default_1", name="Narrator", owner="", source="default", dim=DIM), rand(5, DIM), None
    )
    add(store, "v_pub", "Public", seed=6)
    for op in (lambda: store.rename("Narrator", "", "x"), lambda: store.delete("default_1", "")):
        with pytest.raises(VoiceError) as err:
            op()
        assert err.value.code == "read_only" and err.value.status == 403
    with pytest.raises(VoiceError) as err:
        store.delete("v_pub", "some-key")  # visible to every key, owned by none of them
    assert err.value.code == "forbidden"
    assert entries(tmp_path) == ["v_pub"]  # defaults are never written to the store


def test_delete_then_reuse_the_name(tmp_path, monkeypatch):
    store = VoiceStore(tmp_path, DIM)
    add(store, "v_1", "Reused", seed=1)

    def io_error(*_a, **_k):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(voices_mod.os, "replace", io_error)
    with pytest.raises(VoiceError) as err:
        store.delete("Reused", "")
    assert err.value.status == 503 and store.get("Reused", "").id == "v_1"  # a failed delete changes nothing
    monkeypatch.undo()

    assert store.delete("Reused", "").id == "v_1"
    assert entries(tmp_path) == []
    with pytest.raises(VoiceError):
        store.get("Reused", "")
    add(store, "v_2", "Reused", seed=2)
    assert store.get("Reused", "").id == "v_2"
    reloaded = VoiceStore(tmp_path, DIM)
    assert [v.id for v in reloaded.list("")] == ["v_2"]
    assert np.array_equal(reloaded.get("Reused", "").embedding, rand(2, DIM))


# ======================================================================================================
# The /v1/voices API on a real server
# ======================================================================================================


def clip_wav(freq: float, seconds: float = 0.8, sr: int = 24_000) -> tuple[bytes, np.ndarray]:
    t = np.arange(int(seconds * sr)) / sr
    x = (0.25 * np.sin(2 * np.pi * freq * t) + 0.05 * np.sin(2 * np.pi * 3.1 * freq * t)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, x, sr, format="WAV", subtype="PCM_16")
    return buf.getvalue(), x


def post_voice(server, files, name: str | None = None) -> httpx.Response:
    return httpx.post(server.url + "/v1/voices", files=files, data={"name": name} if name else None, timeout=120)


def created(r: httpx.Response) -> dict:
    assert r.status_code in (200, 201), r.text
    return r.json()


def embedding_of(server, ref: str) -> np.ndarray:
    r = httpx.get(server.url + f"/v1/voices/{ref}/embedding", timeout=30)
    assert r.status_code == 200, r.text
    return np.load(io.BytesIO(r.content), allow_pickle=False)


def assert_clear_error(r: httpx.Response, status: int, code: str) -> None:
    """Our error shape, with that status and code, and a message about the file, not Python's objects (issue 17.10)."""
    assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    message = r.json()["error"]["message"]
    assert message and set(r.json()) == {"error"}
    for internal in ("object at 0x", "_io.", "ring capacity", "Traceback"):
        assert internal not in message, message


def upload_embedding(server, arr_bytes: bytes, name: str | None, filename: str = "e.npy") -> httpx.Response:
    return post_voice(server, {"embedding": (filename, arr_bytes, "application/octet-stream")}, name)


def pcm(server, voice: str) -> bytes:
    r = httpx.post(
        server.url + "/v1/audio/speech",
        timeout=120,
        json={"input": "Voice check.", "voice": voice, "response_format": "pcm", "params": FAST},
    )
    assert r.status_code == 200, r.text
    return r.content


@pytest.mark.slow
def test_several_clips_average_their_embeddings(server):
    clips = [clip_wav(170.0), clip_wav(240.0, 1.1), clip_wav(310.0, 0.9, sr=16_000)]
    singles = []
    for i, (data, _) in enumerate(clips):
        v = created(post_voice(server, {"file": (f"tv-single-{i}.wav", data, "audio/wav")}, f"tv single {i}"))
        assert v["source"] == "clip" and v["details"]["clips"] == 1
        singles.append(embedding_of(server, v["id"]))
    for n in (2, 3):
        files = [("file", (f"c{i}.wav", clips[i][0], "audio/wav")) for i in range(n)]
        v = created(post_voice(server, files, f"tv average {n}"))
        assert v["source"] == "clips" and v["details"]["clips"] == n and v["dim"] == D
        got = embedding_of(server, v["id"])
        np.testing.assert_allclose(got, np.mean(singles[:n], axis=0), rtol=1e-5, atol=1e-6)
        # the preview is the first clip, as uploaded
        prev = httpx.get(server.url + f"/v1/voices/{v['id']}/preview")
        assert prev.status_code == 200 and prev.headers["content-type"] == "audio/wav"
        audio, sr = sf.read(io.BytesIO(prev.content), dtype="float32")
        assert sr == 24_000 and np.abs(audio - clips[0][1]).max() <= 1 / 32768 + 1e-6


@pytest.mark.slow
def test_embedding_export_import_round_trip(server):
    data, _ = clip_wav(205.0)
    clip_voice = created(post_voice(server, {"file": ("tv-rt.wav", data, "audio/wav")}, "tv round trip clip"))
    exported = httpx.get(server.url + f"/v1/voices/{clip_voice['id']}/embedding")
    assert exported.headers["content-disposition"] == f'attachment; filename="{clip_voice["id"]}.npy"'
    emb = np.load(io.BytesIO(exported.content), allow_pickle=False)
    assert emb.dtype == np.float32 and emb.shape == (D,)

    imported = created(upload_embedding(server, exported.content, "tv round trip npy"))
    assert imported["source"] == "embedding" and imported["dim"] == D and not imported["has_preview"]
    assert np.array_equal(embedding_of(server, imported["id"]), emb)
    # the same voice: the same audio for the same seed
    assert pcm(server, "tv round trip npy") == pcm(server, clip_voice["id"])

    rows = np.stack([emb, rand(21), rand(22)])
    from_npz = created(upload_embedding(server, npz(emb=rows, note=np.zeros(3)), "tv round trip npz", "x.npz"))
    np.testing.assert_allclose(embedding_of(server, from_npz["id"]), rows.mean(0), rtol=1e-6, atol=1e-7)
    r = httpx.get(server.url + f"/v1/voices/{imported['id']}/preview")
    assert r.status_code == 404 and r.json()["error"]["code"] == "no_preview"


@pytest.mark.slow
def test_blend_by_name(server):
    a, b = rand(31) * 2, rand(32)
    created(upload_embedding(server, npy(a), "tv blend A"))
    created(upload_embedding(server, npy(b), "tv blend B"))
    for t, want in ((0, a), (1, b), (0.25, slerp(a, b, 0.25))):
        r = httpx.post(
            server.url + "/v1/voices/blend",
            json={"a": "tv blend A", "b": "tv blend B", "t": t, "name": f"tv blend {t}"},
        )
        v = created(r)
        assert v["source"] == "blend" and v["details"]["t"] == t
        np.testing.assert_allclose(embedding_of(server, f"tv blend {t}"), want, rtol=1e-5, atol=1e-5)
    v = created(httpx.post(server.url + "/v1/voices/blend", json={"a": "tv blend A", "b": "tv blend B"}))
    assert v["name"] == "tv blend A + tv blend B" and v["details"]["t"] == 0.5
    # null is the field left out, as /tts/generate's speaker_blend_t (it was refused with bad_blend): that blend again
    again = httpx.post(server.url + "/v1/voices/blend", json={"a": "tv blend A", "b": "tv blend B", "t": None})
    assert again.status_code == 200 and again.json()["id"] == v["id"] and again.json()["deduplicated"], again.text
    # voices and blends by name in /tts/generate
    for extra in (
        {"speaker_embedding_id": "tv blend 0.25"},
        {
            "speaker_blend_embedding_id_a": "tv blend A",
            "speaker_blend_embedding_id_b": "tv blend B",
            "speaker_blend_t": 0.25,
        },
    ):
        r = httpx.post(
            server.url + "/tts/generate",
            timeout=120,
            json={"text": "Blend.", "max_tokens": 8, "ignore_eos": True, "stream": False, "seed": 3} | extra,
        )
        assert r.status_code == 200 and len(r.content) == 8 * 512 * 4, r.text


@pytest.mark.slow
def test_a_blend_of_opposite_voices_is_a_clear_error_on_every_api(server):
    a = rand(33)
    created(upload_embedding(server, npy(a), "tv up"))
    created(upload_embedding(server, npy(-3 * a), "tv down"))
    r = httpx.post(server.url + "/v1/voices/blend", json={"a": "tv up", "b": "tv down"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_blend", r.text
    r = httpx.post(
        server.url + "/tts/generate",
        timeout=120,
        json={"text": "No.", "max_tokens": 8, "speaker_blend_embedding_id_a": "tv up"}
        | {"speaker_blend_embedding_id_b": "tv down", "speaker_blend_t": 0.5},
    )
    assert r.status_code == 400 and "opposite directions" in r.text, r.text


@pytest.mark.slow
@pytest.mark.parametrize(
    "body, status, code",
    [
        ({"a": "tv blend A", "b": "tv blend B", "t": -0.1}, 400, "bad_blend"),
        ({"a": "tv blend A", "b": "tv blend B", "t": 1.5}, 400, "bad_blend"),
        ({"a": "tv blend A", "b": "tv blend B", "t": "0.5"}, 400, "bad_blend"),
        ({"a": "tv blend A", "b": "tv blend B", "t": True}, 400, "bad_blend"),
        ({"a": "tv blend A"}, 400, "bad_blend"),
        ({"a": "tv blend A", "b": "no such voice"}, 404, "unknown_voice"),
        ({"a": "tv blend A", "b": "tv blend B", "name": "bad/name"}, 400, "bad_name"),
        # a misspelt field is refused, not left out: "weight" for "t" made a blend at 0.5
        ({"a": "tv blend A", "b": "tv blend B", "weight": 0.2}, 400, "bad_params"),
    ],
)
def test_bad_blends(server, body, status, code):
    created(upload_embedding(server, npy(rand(31) * 2), "tv blend A"))
    created(upload_embedding(server, npy(rand(32)), "tv blend B"))
    r = httpx.post(server.url + "/v1/voices/blend", json=body)
    assert_clear_error(r, status, code)


@pytest.mark.slow
def test_rename_delete_and_reuse_the_name(server):
    v = created(upload_embedding(server, npy(rand(41)), "tv rename me"))
    before = embedding_of(server, v["id"])
    r = httpx.patch(server.url + f"/v1/voices/{v['id']}", json={"name": "tv renamed"})
    assert r.status_code == 200 and r.json()["name"] == "tv renamed" and r.json()["id"] == v["id"]
    assert np.array_equal(embedding_of(server, "tv renamed"), before)
    assert httpx.get(server.url + "/v1/voices/tv rename me").status_code == 404
    r = httpx.patch(server.url + "/v1/voices/tv renamed", json={"name": "a|b"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_name"
    # a misspelt field names itself (it was a bad_name about the name it had not given)
    r = httpx.patch(server.url + "/v1/voices/tv renamed", json={"nmae": "tv other"})
    assert r.status_code == 400 and r.json()["error"] == {"code": "bad_params", "message": "unknown fields ['nmae']"}
    assert pcm(server, "tv renamed")  # usable by its new name

    assert httpx.delete(server.url + "/v1/voices/tv renamed").json() == {"deleted": v["id"]}
    assert httpx.get(server.url + f"/v1/voices/{v['id']}").status_code == 404
    r = httpx.post(server.url + "/v1/audio/speech", json={"input": "x", "voice": "tv renamed"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_voice"
    again = created(upload_embedding(server, npy(rand(42)), "tv renamed"))
    assert again["id"] != v["id"]
    assert np.array_equal(embedding_of(server, "tv renamed"), rand(42))
    assert httpx.get(server.url + f"/v1/voices/{again['id']}").json()["name"] == "tv renamed"


@pytest.mark.slow
def test_a_head_request_reads_a_voice_and_never_deletes_it(server):
    v = created(upload_embedding(server, npy(rand(43)), "tv head"))
    for ref in (v["id"], "tv head"):
        r = httpx.head(server.url + f"/v1/voices/{ref}")
        assert r.status_code == 200 and r.headers["content-type"] == "application/json", r
    assert httpx.get(server.url + f"/v1/voices/{v['id']}").json()["name"] == "tv head"  # (HEAD deleted it)
    assert httpx.head(server.url + "/v1/voices/tv no such voice").status_code == 404
    assert httpx.delete(server.url + f"/v1/voices/{v['id']}").json() == {"deleted": v["id"]}


@pytest.mark.slow
def test_voice_by_name_over_websocket(server):
    v = created(upload_embedding(server, npy(rand(51)), "tv ws voice"))

    async def go() -> tuple[dict, dict, int]:
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(
                json.dumps(
                    {"type": "session.config", "voice": "tv ws voice", "params": {"max_frames": 10, "ignore_eos": True}}
                )
            )
            upd = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "text", "text": "By name.", "flush": True}))
            n = 0
            while True:
                msg = await asyncio.wait_for(ws.recv(), 60)
                if isinstance(msg, bytes):
                    n += len(msg)
                    continue
                d = json.loads(msg)
                assert d["type"] != "error", d
                if d["type"] == "audio.done":
                    return upd, d, n

    upd, done, n = asyncio.run(go())
    assert upd["type"] == "session.updated" and upd["voice"] == v["id"]
    assert done["stats"]["frames"] == 10 and n > 0


@pytest.mark.slow
def test_default_name_comes_from_any_file_name(server):
    v = created(upload_embedding(server, npy(rand(61)), None, filename="C:\\fakepath\\tv my#voice!.npy"))
    assert v["name"] == "tv my_voice_"
    v = created(upload_embedding(server, npy(rand(62)), None, filename=".npy"))
    assert v["name"] == "voice"


def _zero_length_wav() -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(0, np.float32), 24_000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _silent(seconds: float, sr: int, channels: int = 1, fmt: str = "FLAC") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.zeros((int(seconds * sr), channels), np.float32), sr, format=fmt, subtype="PCM_16")
    return buf.getvalue()


BAD_UPLOADS = {
    "wrong_dimension": ({"embedding": ("e.npy", npy(np.ones(512, np.float32)))}, 400, "bad_embedding"),
    "nan": ({"embedding": ("e.npy", npy(np.full(D, np.nan, np.float32)))}, 400, "bad_embedding"),
    "pickled_object_npz": ({"embedding": ("e.npz", npz(emb=np.array([1, "x"], dtype=object)))}, 400, "bad_embedding"),
    "structured": ({"embedding": ("e.npy", npy(np.zeros(3, dtype=[("x", "<f4")])))}, 400, "bad_embedding"),
    "npz_bomb": ({"embedding": ("e.npz", _header_only_npz((10**9, D)))}, 400, "bad_embedding"),
    "non_audio": ({"file": ("x.wav", b"this is plain text, not a WAV")}, 400, "bad_audio"),
    "empty_file": ({"file": ("x.wav", b"")}, 400, "bad_audio"),
    "zero_length_wav": ({"file": ("x.wav", _zero_length_wav())}, 400, "bad_audio"),
    # issue 17.8: 80 KB that decode to 90 MB, refused from the header; too many channels likewise
    "rate_384k": ({"file": ("x.flac", _silent(59, 384_000))}, 400, "bad_audio"),
    "channels_17": ({"file": ("x.wav", _silent(1, 8000, 17, "WAV"))}, 400, "bad_audio"),
    "both_kinds": ({"file": ("x.wav", b"RIFF"), "embedding": ("e.npy", npy(rand(1)))}, 400, "bad_upload"),
    "bad_name": ({"embedding": ("e.npy", npy(rand(71)))}, 400, "bad_name"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_UPLOADS))
def test_bad_voice_uploads(server, case):
    files, status, code = BAD_UPLOADS[case]
    data = {"name": "no/slashes"} if case == "bad_name" else None
    r = httpx.post(server.url + "/v1/voices", files=files, data=data, timeout=60)
    assert_clear_error(r, status, code)


@pytest.mark.slow
@pytest.mark.parametrize(
    "parts, message",
    [
        # a misspelt part: the voice was named after its file ("e1"), the "voice_name" dropped
        (
            [("embedding", ("e1.npy", npy(rand(81)))), ("voice_name", (None, "Bob"))],
            "unknown form fields ['voice_name']",
        ),
        # two embeddings: the first was never read (a voice of the second alone)
        ([("embedding", ("e1.npy", npy(rand(82)))), ("embedding", ("e2.npy", npy(rand(83))))], "one 'embedding' part"),
        # two names: the last was kept
        ([("embedding", ("e1.npy", npy(rand(84)))), ("name", (None, "A")), ("name", (None, "B"))], "one 'name' part"),
        # a 'file' that is text, beside an embedding: ignored
        ([("embedding", ("e1.npy", npy(rand(85)))), ("file", (None, "clip.wav"))], "'file' must be a file"),
        ([("embedding", (None, "e.npy"))], "'embedding' must be a file"),
    ],
)
def test_a_voice_upload_refuses_parts_it_would_drop(server, parts, message):
    """Every part of POST /v1/voices is one the form takes (file, embedding, name), each one thing where it is one:
    an unknown, repeated or text-for-file part was dropped in silence and a voice made of the rest (201)."""
    before = {v["id"] for v in httpx.get(server.url + "/v1/voices", timeout=30).json()["voices"]}
    r = httpx.post(server.url + "/v1/voices", files=parts, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_upload", r.text
    assert message in r.json()["error"]["message"], r.text
    after = {v["id"] for v in httpx.get(server.url + "/v1/voices", timeout=30).json()["voices"]}
    assert after == before  # nothing stored


@pytest.mark.slow
def test_no_upload_and_unknown_voices(server):
    r = httpx.post(server.url + "/v1/voices", data={"name": "only a name"}, files={"x": ("x", b"")})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_upload"
    r = httpx.post(server.url + "/v1/voices", json={"name": "json body"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_upload"
    for method, path, body in (
        ("GET", "", None),
        ("GET", "/embedding", None),
        ("GET", "/preview", None),
        ("PATCH", "", {"name": "x"}),
        ("DELETE", "", None),
    ):
        r = httpx.request(method, server.url + f"/v1/voices/tv-nobody{path}", json=body)
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_voice", (method, path, r.text)
    r = httpx.post(server.url + "/tts/generate", json={"text": "x", "speaker_embedding_id": "tv-nobody"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_voice"


@pytest.mark.slow
@pytest.mark.parametrize("arr", [np.ones(5, np.float32), np.full(D, np.inf, np.float32)])
def test_inline_embedding_in_tts_generate_is_validated(server, arr):
    r = httpx.post(
        server.url + "/tts/generate",
        timeout=60,
        json={"text": "x", "speaker_embedding_base64": base64.b64encode(npy(arr)).decode()},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_embedding", r.text


@pytest.mark.slow
def test_names_are_refused_alike_and_a_reblend_keeps_its_name(server):
    """One name rule on every route: a name too long or with a bad character is refused, never cut; the same
    blend again is the voice it already is, renamed only when a name is asked for."""
    a = created(upload_embedding(server, npy(rand(51)), "tv same rule A"))
    b = created(upload_embedding(server, npy(rand(52)), "tv same rule B"))
    session = {"X-TTS-Session-ID": "tv-names"}
    emb = base64.b64encode(npy(rand(53))).decode()
    for bad in ("n" * 65, "a|b", " " + "x" * 65):
        answers = {
            "upload": upload_embedding(server, npy(rand(54)), bad),
            "patch": httpx.patch(server.url + f"/v1/voices/{a['id']}", json={"name": bad}),
            "blend": httpx.post(server.url + "/v1/voices/blend", json={"a": a["id"], "b": b["id"], "name": bad}),
            "speakers": httpx.post(
                server.url + "/tts/speakers", headers=session, json={"label": bad, "speaker_embedding_base64": emb}
            ),
        }
        for route, r in answers.items():
            assert r.status_code == 400 and r.json()["error"]["code"] == "bad_name", (route, bad, r.text)
    assert httpx.get(server.url + f"/v1/voices/{a['id']}").json()["name"] == "tv same rule A"
    ok = "n" * 64
    first = httpx.post(server.url + "/v1/voices/blend", json={"a": a["id"], "b": b["id"], "t": 0.3, "name": ok})
    assert first.status_code == 201 and first.json()["name"] == ok, first.text
    again = httpx.post(server.url + "/v1/voices/blend", json={"a": a["id"], "b": b["id"], "t": 0.3})
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"], again.text
    assert again.json()["name"] == ok and again.json()["deduplicated"]
    renamed = httpx.post(
        server.url + "/v1/voices/blend", json={"a": a["id"], "b": b["id"], "t": 0.3, "name": "tv same rule renamed"}
    )
    assert renamed.status_code == 200 and renamed.json()["name"] == "tv same rule renamed", renamed.text
    # a name the server makes up from two long names is cut to the longest a name may be, not refused
    long_a = created(upload_embedding(server, npy(rand(55)), "L" * 60))
    made = httpx.post(server.url + "/v1/voices/blend", json={"a": long_a["id"], "b": b["id"]})
    assert made.status_code == 201 and made.json()["name"] == ("L" * 60 + " + tv")[:64], made.text


def test_clips_of_one_upload_are_decoded_one_at_a_time(tmp_path):
    """A voice of 8 clips holds one decoded clip at a time (8 clips of 60 s at 192 kHz decode to 370 MB from 20 MB
    of FLAC), with the same average, seconds and first clip's preview."""
    import weakref
    from types import SimpleNamespace

    from app.core.gateway import preview_wav
    from app.doors.voices import store_clips

    alive: list[weakref.ref] = []
    most = 0

    async def decode_clip(data: bytes) -> tuple[np.ndarray, int]:
        samples = np.full(8000 * (1 + data[0]), data[0] / 10, np.float32)
        alive.append(weakref.ref(samples))
        return samples, 8000

    async def embed_samples(samples: np.ndarray, sr: int) -> np.ndarray:
        nonlocal most
        most = max(most, sum(r() is not None for r in alive))
        return np.full(D, float(samples[0]), np.float32)

    gw = SimpleNamespace(
        voices=VoiceStore(tmp_path, D),
        cfg=SimpleNamespace(speaker_embedding_dim=D),
        decode_clip=decode_clip,
        embed_samples=embed_samples,
    )
    stored = asyncio.run(store_clips(gw, "", [bytes([i]) for i in range(1, 9)], "Eight"))  # type: ignore[arg-type]
    assert most == 1
    voice = stored.voice
    assert voice.details == {"clips": 8, "seconds": float(sum(range(2, 10)))}
    assert np.allclose(voice.embedding, 0.45)
    assert gw.voices.preview_bytes(voice) == preview_wav(np.full(16000, 0.1, np.float32), 8000)


def test_an_uploads_clips_are_hashed_off_the_event_loop(tmp_path, monkeypatch):
    """An upload's voice id is a hash of its clips, up to 8 of --max-upload-bytes (80 MB: ~40-150 ms of sha256): it is
    computed in a worker thread, as a request's inline clip is (Gateway.embed_clip), not on the event loop while every
    session waits (hostile pass); a few small clips are hashed inline. The same id either way."""
    import threading
    from types import SimpleNamespace

    from app.doors.voices import store_clips
    from app.voices.library import INLINE_HASH

    threads: list[int] = []
    real = VoiceStore.clip_id

    def spy(owner: str, clips: list[bytes]) -> str:
        threads.append(threading.get_ident())
        return real(owner, clips)

    monkeypatch.setattr(VoiceStore, "clip_id", staticmethod(spy))

    async def decode_clip(data: bytes) -> tuple[np.ndarray, int]:
        return np.full(8000, 0.1, np.float32), 8000

    async def embed_samples(samples: np.ndarray, sr: int) -> np.ndarray:
        return np.full(D, 0.5, np.float32)

    gw = SimpleNamespace(
        voices=VoiceStore(tmp_path, D),
        cfg=SimpleNamespace(speaker_embedding_dim=D),
        decode_clip=decode_clip,
        embed_samples=embed_samples,
    )

    async def upload(clips: list[bytes]) -> tuple[str, int]:
        stored = await store_clips(gw, "o", clips, "V")  # type: ignore[arg-type]
        return stored.voice.id, threading.get_ident()

    big = [bytes([i]) * INLINE_HASH for i in range(2)]
    vid, loop_thread = asyncio.run(upload(big))
    assert vid == real("o", big) and threads == [threads[0]] and threads[0] != loop_thread
    _, loop_thread = asyncio.run(upload([b"\1", b"\2"]))
    assert threads[1] == loop_thread  # small: inline


def test_a_voices_public_form_copies_nothing_of_its_embedding():
    """`GET /v1/voices` answers each voice's public form on the event loop: it was `asdict`, which deep-copies every
    field, the embedding included (8 KB each), then dropped it: 1000 voices took ~18 ms a listing, and four clients
    listing in a loop held other requests up to 250 ms (hostile pass). Same fields, same order."""
    import tracemalloc

    emb = np.ones(4096 * 64, np.float32)  # 1 MiB: a copy of it cannot hide in the noise
    v = Voice("v_1", "Ada", "owner", "blend", len(emb), 1.5, True, {"a": "v_2", "b": "v_3", "t": 0.5}, emb)
    tracemalloc.start()
    try:
        public = v.public()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak
    assert list(public) == ["id", "name", "source", "dim", "created_at", "has_preview", "details", "default"]
    assert public == {
        "id": "v_1",
        "name": "Ada",
        "source": "blend",
        "dim": len(emb),
        "created_at": 1.5,
        "has_preview": True,
        "details": {"a": "v_2", "b": "v_3", "t": 0.5},
        "default": False,
    }
    public["details"]["t"] = 1.0  # the answer is the caller's: the voice keeps its own
    assert v.details["t"] == 0.5


def test_embedding_files_are_parsed_off_the_event_loop(tmp_path, monkeypatch):
    """An embedding file (`POST /v1/voices`, `/tts/speakers`, and `speaker_embedding_base64` of /tts/generate and
    /v1/audio/speech) is parsed in a worker thread: a 16 KB deflated .npz of 1024 x 2048 float64 rows inflates to
    16 MB and took ~55 ms of the event loop per request (hostile pass), every session's audio waiting."""
    import threading
    from types import SimpleNamespace

    from app.doors import reference
    from app.doors import voices as voice_doors

    threads: list[int] = []

    def spy(data, dim):
        threads.append(threading.get_ident())
        return parse_embedding_file(data, dim)

    monkeypatch.setattr(voice_doors, "parse_embedding_file", spy)
    monkeypatch.setattr(reference, "parse_embedding_file", spy)
    dim = 2048
    gw = SimpleNamespace(cfg=SimpleNamespace(speaker_embedding_dim=dim), voices=VoiceStore(tmp_path, dim))
    buf = io.BytesIO()
    np.savez_compressed(buf, emb=np.ones((4, dim)))
    data = buf.getvalue()

    async def go():
        stored = await voice_doors.store_embedding(gw, "", data, "Ada")  # type: ignore[arg-type]
        inline = await reference.speaker_source(
            gw,  # type: ignore[arg-type]
            {"speaker_embedding_base64": base64.b64encode(data).decode()},
            "",
        )
        return stored, inline, threading.get_ident()

    stored, inline, loop_thread = asyncio.run(go())
    assert stored.created and gw.voices.get("Ada", "").id == stored.voice.id
    assert inline is not None and np.allclose(inline.embedding, 1.0)
    assert len(threads) == 2 and loop_thread not in threads


def test_a_lone_surrogate_in_a_stored_meta_json_does_not_break_the_listing(tmp_path):
    """A folder written before the reference's speaker file names were checked (`"original_name":
    "e\\udfff.npy"`, valid JSON, no text) made every GET /v1/voices and /tts/speakers a 500 for everyone: the
    voice now loads with U+FFFD in its place, and its public form encodes as UTF-8."""
    from starlette.responses import JSONResponse

    store = VoiceStore(tmp_path, DIM)
    add(store, "v_old", "Old", seed=1)
    meta_file = tmp_path / "v_old" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["details"] = {"original_name": "e\udfff.npy", "clips": ["a\ud800", {"\udc00k": "v"}]}
    meta_file.write_text(json.dumps(meta))  # ensure_ascii: written as "\udfff" escapes, as the old build did

    reloaded = VoiceStore(tmp_path, DIM)
    (v,) = reloaded.list("")
    assert v.id == "v_old" and v.details == {"original_name": "e\ufffd.npy", "clips": ["a\ufffd", {"\ufffdk": "v"}]}
    body = JSONResponse({"voices": [x.public() for x in reloaded.list("")]}).body  # raised UnicodeEncodeError
    assert "e\ufffd.npy" in body.decode("utf-8")


def test_a_writer_stalled_in_another_process_does_not_stall_the_event_loop(tmp_path, monkeypatch):
    """--workers: `add` took the shared store's file lock, and rescanned every voice's folder under it, on the event
    loop: while another process held the lock (a stalled writer), every session of this one waited. It runs in a
    worker thread now: the loop serves others meanwhile, and the voice is stored once the lock is free."""
    import fcntl
    import threading
    from types import SimpleNamespace

    from app.doors import voices as voice_doors

    dim = 2048
    gw = SimpleNamespace(
        cfg=SimpleNamespace(speaker_embedding_dim=dim), voices=VoiceStore(tmp_path, dim, shared=True, max_per_owner=3)
    )
    elsewhere = open(tmp_path / ".lock", "a")  # noqa: SIM115 (another process's writer: flock, one holder a file)
    fcntl.flock(elsewhere, fcntl.LOCK_EX)
    released, at_lock = threading.Event(), threading.Event()
    flock = fcntl.flock

    def spy(f, op):
        at_lock.set()  # (the add is at the lock: on the event loop's thread before, blocking it)
        return flock(f, op)

    monkeypatch.setattr(voices_mod.fcntl, "flock", spy)

    def release() -> None:
        if not released.is_set():
            released.set()
            elsewhere.close()

    guard = threading.Timer(30, release)  # hang guard: the code before this fix waited here, the loop blocked
    guard.start()

    async def go():
        task = asyncio.create_task(voice_doors.store_embedding(gw, "", npy(rand(1, dim)), "Ada"))
        while not at_lock.is_set():
            await asyncio.sleep(0.01)
        served_while_held = not released.is_set()
        listing = gw.voices.list("")  # another request, served meanwhile
        release()
        return served_while_held, listing, await task

    try:
        served_while_held, listing, stored = asyncio.run(go())
    finally:
        release()
        guard.cancel()
    assert served_while_held and listing == []
    assert stored.created and gw.voices.get("Ada", "").id == stored.voice.id


def test_two_adds_of_one_key_at_once_are_counted_one_after_the_other(tmp_path, monkeypatch):
    """`add` runs in worker threads: two uploads of one key at once both counted the key's voices below
    --max-voices-per-key, then both wrote (on the event loop the count and the write were one step)."""
    import threading

    store = VoiceStore(tmp_path, DIM, max_per_owner=1)
    both_counted = threading.Barrier(2, timeout=2)
    write = store._write

    def slow_write(voice, preview_wav):
        with contextlib.suppress(threading.BrokenBarrierError):
            both_counted.wait()  # (with the writers one at a time, the other never counts meanwhile: 2 s)
        return write(voice, preview_wav)

    monkeypatch.setattr(store, "_write", slow_write)

    def voice(i: int) -> Voice:
        return Voice(id=f"v_{i}", name=f"n{i}", owner="k", source="embedding", dim=DIM)

    async def go():
        adds = (store.add_off_loop(voice(i), rand(i, DIM)) for i in range(2))
        return await asyncio.gather(*adds, return_exceptions=True)

    results = asyncio.run(go())
    assert sorted(type(r).__name__ for r in results) == ["Voice", "VoiceError"], results
    assert [r.code for r in results if isinstance(r, VoiceError)] == ["too_many_voices"]
    assert len(VoiceStore(tmp_path, DIM).list("k")) == 1


def test_a_rescan_listed_before_an_add_landed_does_not_drop_it(tmp_path, monkeypatch):
    """Shared store, `add` in a worker thread: a rescan that listed the folders before the add's write landed, and
    applied its listing after the add put the voice in memory, dropped it (until a rescan came due: a listing right
    after an upload lacked it). Rescans and the add's update take turns now."""
    import threading

    now = [1000.0]
    monkeypatch.setattr(voices_mod.time, "monotonic", lambda: now[0])  # no rescan comes due by itself
    store = VoiceStore(tmp_path, DIM, shared=True)
    listed, go_on = threading.Event(), threading.Event()
    scandir = os.scandir

    class SlowListing:
        def __init__(self, path):
            self.entries = list(scandir(path))

        def __enter__(self):
            listed.set()
            go_on.wait(30)  # (hang guard)
            return iter(self.entries)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(voices_mod.os, "scandir", SlowListing)
    scanner = threading.Thread(target=store._sync, kwargs={"force": True})
    scanner.start()
    assert listed.wait(30)
    monkeypatch.setattr(voices_mod.os, "scandir", scandir)
    adder = threading.Thread(target=add, args=(store, "v_new", "New"))
    adder.start()
    adder.join(1)  # (it waits for the rescan now; before, it was done: its voice in memory)
    go_on.set()
    scanner.join(30)
    adder.join(30)
    assert [v.id for v in store.list("")] == ["v_new"]


def test_a_name_uploaded_through_another_process_just_after_a_miss_is_found_at_its_first_lookup(tmp_path, monkeypatch):
    """A name looked up and not found through one process, then uploaded through another, then looked up again:
    the second lookup was unknown_voice until SHARED_MISS_LOOK_S had passed since the miss (measured with --workers
    2: 404 twice, 200 after 60 ms), the limit on how often a miss rescans. Now a miss within that limit still lists
    the folder's names when the folder changed (no stat per voice) and reads only the folders it has not seen: a new
    voice is found at once, a deleted one is gone from a listing at once, and misses of names that exist nowhere read
    no folder and list the folder only after a change (the clock stands still: no rescan comes due by itself). A
    voice renamed there within that limit still waits for it (its folder's name does not change: docs/scaling.md)."""
    now = [1000.0]
    monkeypatch.setattr(voices_mod.time, "monotonic", lambda: now[0])
    one, two = VoiceStore(tmp_path, DIM, shared=True), VoiceStore(tmp_path, DIM, shared=True)
    with pytest.raises(VoiceError):
        two.get("Later", "")  # the miss
    add(one, "v_later", "Later")  # the upload, through the other process
    assert two.get("Later", "").id == "v_later"  # (it was unknown_voice)
    add(one, "v_gone", "Gone")
    with pytest.raises(VoiceError):
        two.get("nobody", "")  # a miss that rescans: the folder changed since the last rescan
    add(one, "v_next", "Next")  # within the limit of that rescan
    assert two.get("Next", "").id == "v_next"
    one.delete("v_gone", "")
    add(one, "v_listed", "Listed")
    assert sorted(v.name for v in two.list("")) == ["Later", "Listed", "Next"]  # (it showed Gone, not Listed)
    listings, reads = [0], [0]
    scandir, listdir, read_folder = os.scandir, os.listdir, VoiceStore._read_folder

    def counted(listing):
        def counted_listing(path):
            listings[0] += 1
            return listing(path)

        return counted_listing

    def counted_read(self, d):
        reads[0] += 1
        return read_folder(self, d)

    monkeypatch.setattr(voices_mod.os, "scandir", counted(scandir))  # (a rescan's listing)
    monkeypatch.setattr(voices_mod.os, "listdir", counted(listdir))  # (a listing of names)
    monkeypatch.setattr(VoiceStore, "_read_folder", counted_read)
    for _ in range(20):  # a storm of misses, the folder unchanged
        with pytest.raises(VoiceError):
            two.get("nobody", "")
    assert (listings[0], reads[0]) == (0, 0)
    add(one, "v_more", "More")
    for _ in range(20):  # the same, the folder changed once: listed once, the new folder read once
        with pytest.raises(VoiceError):
            two.get("nobody", "")
    assert (listings[0], reads[0]) == (1, 1)
