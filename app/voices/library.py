"""Voices: speaker embeddings with a name, an owner, a preview clip, kept on disk.

Layout: `<root>/<voice id>/{meta.json, embedding.npy, preview.wav}`. A voice is written into a
temporary folder and renamed into place, so a crash or a full disk never leaves half a voice. Ids of
clip voices derive from a hash of (owner, clips), so uploading the same clip twice gives the same
voice without running the speaker encoder again. Default voices come from a folder of clips or
`.npy` files and belong to everyone; they cannot be deleted.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import copy
import errno
import fcntl
import hashlib
import io
import json
import logging
import math
import os
import re
import shutil
import stat
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np

from app.io.checks import check_number
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from engine.contract.records import EMBEDDING_ABS_MAX, embedding_in_bounds

log = logging.getLogger("gateway.voices")
MAX_REF_QUOTED = 80  # characters of an unknown voice's name or id that its error quotes
EMBEDDING_VALUES = f"each value finite and within ±{EMBEDDING_ABS_MAX:g}"  # (the engine's bound, `embedding_in_bounds`)

AUDIO_SUFFIXES = {".wav", ".flac", ".ogg", ".mp3", ".oga", ".opus"}
MAX_NAME = 64
# bytes hashed on the event loop; more are hashed in a worker thread (hashlib releases the GIL for large inputs): a
# request's clips are up to 8 of --max-upload-bytes, 80 MB, ~40-150 ms of sha256 during which every session waited
INLINE_HASH = 1 << 16
_NAME_CHARS = r"\w .,'()+&\-"
_NAME_OK = re.compile(rf"^[{_NAME_CHARS}]{{1,{MAX_NAME}}}$", re.UNICODE)


class VoiceError(RequestError):
    """A RequestError, so every API that parses or resolves voices answers it as a clean 4xx/5xx JSON error."""


@dataclass
class Voice:
    id: str
    name: str
    owner: str  # "" = public (default voices and voices made without an API key)
    source: str  # clip | clips | embedding | blend | default
    dim: int
    created_at: float = field(default_factory=time.time)
    has_preview: bool = False
    details: dict = field(default_factory=dict)
    embedding: np.ndarray | None = field(default=None, repr=False)

    def public(self) -> dict:
        """What a client sees of it (every listing builds 1000 of these on the event loop: not `asdict`, which
        deep-copied the embedding of each only to drop it, ~18 ms a listing)."""
        return {
            "id": self.id,
            "name": self.name,
            "source": self.source,
            "dim": self.dim,
            "created_at": self.created_at,
            "has_preview": self.has_preview,
            "details": copy.deepcopy(self.details),  # small: a blend's ids, a clip's names
            "default": self.source == "default",
        }


def validate_name(name: str) -> str:
    """A name a client gave (upload, rename, blend, speaker label): kept as given, less outer spaces, or refused;
    never cut or changed."""
    name = name.strip()
    if not _NAME_OK.match(name):
        raise VoiceError(G.BAD_NAME, f"voice names are 1-{MAX_NAME} letters, digits, spaces and . , ' ( ) + & - _")
    return name


def derived_name(text: str, fallback: str = "voice") -> str:
    """A name the server makes up (from a file name, or two voices' names): characters names cannot hold become
    '_' and it is cut to the longest a name may be."""
    return re.sub(rf"[^{_NAME_CHARS}]", "_", text).strip()[:MAX_NAME].strip() or fallback


# An uploaded (N, D) array may hold at most this many float64 rows (as many bytes in any dtype). The limit is
# checked from the .npy header, before any data is read, so a small .npz cannot inflate into gigabytes.
MAX_EMBEDDING_ROWS = 1024
_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
# An .npz holds an array or a few. zipfile reads its whole central directory (an entry per member) in Python before
# any member is opened: an upload of 120,000 empty members (10 MB) held the event loop, every session's audio, ~1 s.
# The directory's size is read from the archive's end record first, and one past this is refused.
MAX_NPZ_DIRECTORY_BYTES = 16 << 10  # a hundred members or so; np.savez writes ~100 bytes per array
_ZIP_END = b"PK\x05\x06"  # the end of central directory record (22 bytes and a comment of up to 64 KiB)
_ZIP64_LOCATOR = b"PK\x06\x07"  # 20 bytes just before it: its sizes are then the zip64 record's


def _zip_directory_bytes(data: bytes) -> int | None:
    """The size of a zip archive's central directory as its end record declares it, as zipfile finds that record
    (the last one in the archive's last 64 KiB); None when it has none. A zip64 archive (whose directory sizes
    zipfile takes from another record; np.savez writes one only past 4 GiB or 65,535 members) counts as too large."""
    at = data.rfind(_ZIP_END, max(0, len(data) - 22 - 0xFFFF))
    if at < 0 or len(data) < at + 22:
        return None
    if at >= 20 and data[at - 20 : at - 16] == _ZIP64_LOCATOR:
        return 1 << 64
    return int.from_bytes(data[at + 12 : at + 16], "little")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _valid_text(obj: dict[str, Any]) -> dict[str, Any]:
    """A JSON object of meta.json with every lone surrogate in its keys and strings replaced by U+FFFD."""

    def fix(x: Any) -> Any:
        if isinstance(x, str):
            return _SURROGATE.sub("\ufffd", x)
        if isinstance(x, list):
            return [fix(i) for i in x]
        return x

    return {fix(k): fix(v) for k, v in obj.items()}


def _read_npy(fp: BinaryIO, max_bytes: int) -> np.ndarray:
    """One `.npy` stream; its header is checked (no objects, bounded size) before the data is read."""
    fmt = np.lib.format
    version = fmt.read_magic(fp)
    if version == (1, 0):
        shape, fortran, dtype = fmt.read_array_header_1_0(fp)
    elif version == (2, 0):
        shape, fortran, dtype = fmt.read_array_header_2_0(fp)
    else:
        raise VoiceError(G.BAD_EMBEDDING, f"unsupported .npy format version {version[0]}.{version[1]}")
    if dtype.hasobject:
        raise VoiceError(G.BAD_EMBEDDING, "object arrays (pickles) are not accepted; save plain float32 numbers")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > max_bytes:
        raise VoiceError(G.BAD_EMBEDDING, f"array of shape {shape} ({dtype}) is too large for a speaker embedding")
    raw = fp.read(nbytes)
    if len(raw) != nbytes:
        raise VoiceError(G.BAD_EMBEDDING, f"truncated array data ({len(raw)} of {nbytes} bytes)")
    return np.frombuffer(raw, dtype=dtype).reshape(shape, order="F" if fortran else "C")


def _load_array(data: bytes, max_bytes: int) -> np.ndarray:
    if data.startswith(_NPY_MAGIC):
        return _read_npy(io.BytesIO(data), max_bytes)
    if not data.startswith(_ZIP_MAGIC):
        raise VoiceError(G.BAD_EMBEDDING, "not a .npy/.npz array file")
    directory = _zip_directory_bytes(data)
    if directory is not None and directory > MAX_NPZ_DIRECTORY_BYTES:
        raise VoiceError(
            G.BAD_EMBEDDING,
            f".npz holds too many members for a speaker embedding (its directory is past {MAX_NPZ_DIRECTORY_BYTES} "
            "bytes): save one array, or an 'emb' array",
        )
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        members = {n.removesuffix(".npy"): n for n in zf.namelist()}
        key = "emb" if "emb" in members else (next(iter(members)) if len(members) == 1 else None)
        if key is None:
            shown = sorted(members)[:8]
            more = f" and {len(members) - len(shown)} more" if len(members) > len(shown) else ""
            raise VoiceError(G.BAD_EMBEDDING, f".npz must hold one array or an 'emb' array, found {shown}{more}")
        with zf.open(members[key]) as fp:
            return _read_npy(cast(BinaryIO, fp), max_bytes)


def parse_embedding_file(data: bytes, dim: int) -> np.ndarray:
    """A `.npy` / `.npz` speaker embedding: (D,) or (N, D) averaged; real numbers only, no pickles.

    An `.npz` gives its `emb` array, or its only array; a structured array gives its `emb` field.
    """
    try:
        arr = _load_array(bytes(data), MAX_EMBEDDING_ROWS * dim * 8)
    except VoiceError:
        raise
    except Exception as e:  # bad zip, bad header, unreadable member...
        detail = str(e)
        if re.search(r"object at 0x[0-9a-fA-F]+", detail):  # numpy's header parser quotes Python objects
            detail = "the array header is damaged"
        raise VoiceError(G.BAD_EMBEDDING, f"not a readable .npy/.npz array file: {detail}") from None
    if arr.dtype.names:
        if "emb" not in arr.dtype.names:
            raise VoiceError(G.BAD_EMBEDDING, f"structured array without an 'emb' field (fields {arr.dtype.names})")
        arr = arr["emb"]
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise VoiceError(G.BAD_EMBEDDING, f"embedding must hold real numbers (float or int), got {arr.dtype}")
    shape = arr.shape
    with np.errstate(over="ignore", invalid="ignore"):
        arr = np.asarray(arr, dtype=np.float32).squeeze()
        if arr.ndim == 2 and arr.shape[1] == dim:
            if arr.shape[0] == 0:
                raise VoiceError(G.BAD_EMBEDDING, f"embedding array of shape {shape} holds no rows")
            arr = arr.mean(axis=0)
    if arr.shape != (dim,):
        raise VoiceError(G.BAD_EMBEDDING, f"embedding must have shape ({dim},) or (N, {dim}), got {shape}")
    if not embedding_in_bounds(arr):
        raise VoiceError(G.BAD_EMBEDDING, EMBEDDING_VALUES)
    return np.array(arr, dtype=np.float32)  # a writable copy, not a view of the upload


BLEND_T = 0.5  # a blend's position between its two voices when the request leaves it out


def blend_t(data: dict[str, Any], key: str, code: str) -> float:
    """A blend's position between its voices, `data[key]` (`/v1/voices/blend`'s `t`, `/tts/generate`'s
    `speaker_blend_t`): a number in 0..1, else RequestError(code); left out or null, BLEND_T (null is the field left
    out, on both routes: `"t": null` was refused by one and halfway on the other)."""
    t = check_number(data, key, 0, 1, code)
    return BLEND_T if t is None else t


def slerp(a: np.ndarray, b: np.ndarray, t: float) -> np.ndarray:
    """Spherical interpolation of directions, linear interpolation of norms (the reference's blend). A blend out of the
    engine's bounds (`embedding_in_bounds`) is refused (bad_blend): two voices within them may blend past them (one at
    the bound on every axis, one on one axis: 1.6e7 at t=0.5), which every door would refuse as an embedding the
    client never gave."""
    if not 0.0 <= t <= 1.0:
        raise VoiceError(G.BAD_BLEND, "t must be in [0, 1]")
    a, b = a.astype(np.float64), b.astype(np.float64)  # (float32's dot left opposite voices 3e-4 rad apart)
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0 or nb == 0:
        return ((1 - t) * a + t * b).astype(np.float32)
    ua, ub = a / na, b / nb
    dot = float(np.clip(np.dot(ua, ub), -1.0, 1.0))
    omega = np.arccos(dot)
    if omega > np.pi - 1e-4 and 0.0 < t < 1.0:  # every great circle joins them: sin(omega) ~ 0 gave noise or inf
        raise VoiceError(G.BAD_BLEND, "the two voices point in opposite directions: no blend between them is defined")
    if omega < 1e-4:  # nearly parallel: lerp is exact enough and avoids 0/0
        direction = (1 - t) * ua + t * ub
    else:
        direction = (np.sin((1 - t) * omega) * ua + np.sin(t * omega) * ub) / np.sin(omega)
    blend = (direction * ((1 - t) * na + t * nb)).astype(np.float32)
    if not embedding_in_bounds(blend):
        raise VoiceError(G.BAD_BLEND, f"the blend of these voices is out of an embedding's bounds ({EMBEDDING_VALUES})")
    return blend


def _folder_mark(d: Path | os.DirEntry[str]) -> tuple[int, int]:
    st = d.stat()  # (a DirEntry of a listing: one stat, its kind known from the listing)
    return st.st_ino, st.st_mtime_ns


def _safe_id(voice_id: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9_\-]{1,80}", voice_id))


def replace_file(path: Path, data: bytes, prefix: str = ".tmp-") -> None:
    """`path` replaced by a file of `data` in one step: written beside it under a temporary name (`prefix`...),
    then renamed over it, so that a reader (this process or another) finds the old file or the new one, never
    part of one; the temporary file goes when the write fails."""
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _store_error(what: str, e: OSError) -> VoiceError:
    """507 Insufficient Storage when the disk or quota is full, 503 for any other I/O failure."""
    full = e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    return VoiceError(G.VOICE_STORE_UNAVAILABLE, f"{what}: {e.strerror or e}", 507 if full else 503)


SHARED_RECOVER_AGE_S = 600.0  # shared store: a write or delete in progress elsewhere is far younger than this
SHARED_RESCAN_S = 10.0  # shared store: rescanned at least this often (a coarse mtime can hide a change)
# shared store: rescanned at most this often when the folder changes (a rescan looks at every voice's folder: a
# client renaming a voice in a loop would make every lookup of every other process one, 65 ms with 3000 voices)
SHARED_MIN_RESCAN_S = 1.0
# shared store: a name not found here, or a listing, rescans the folder (if it changed since the last rescan) at most
# this often; meanwhile it lists the folder's names, if it changed since the last listing (`_take_listed`)
SHARED_MISS_LOOK_S = 0.05


class VoiceStore:
    def __init__(self, root: Path, dim: int, shared: bool = False, max_per_owner: int = 0) -> None:
        """`max_per_owner`: voices one owner (an API key, or "" without keys) may store (0: no limit), so that
        a key cannot fill the disk. `shared`: other gateways (Ray Serve replicas, other hosts) use the same
        folder. Reads then pick up their changes (the folder is rescanned when its mtime moves, and an id not
        known here is looked up on disk), and the crash recovery at start leaves alone what is younger than
        SHARED_RECOVER_AGE_S, which may be another gateway's write in progress (docs/scaling.md)."""
        self.root = root
        self.dim = dim
        self.shared = shared
        self.max_per_owner = max_per_owner
        # Locks, always taken in this order: `_write_lock` (one writer of a voice at a time in this process, so
        # that counting an owner's voices and writing a new one are one step: `add` runs in worker threads),
        # the store's file lock (every process's writers, `_writer`), `_scan_lock` (one rescan at a time, listing
        # to applying: an older listing applied after a newer one, or after `add` put a voice in memory, undid
        # it until the next rescan), `_lock` (the dicts). The event loop takes only the last two, for as long as
        # a scan takes, never the file lock: a stalled writer in another process stalls only its writers.
        self._write_lock = threading.Lock()
        self._scan_lock = threading.Lock()
        self._lock = threading.Lock()
        self._voices: dict[str, Voice] = {}
        self._seen: dict[str, tuple[int, int]] = {}  # shared: voice id -> (inode, mtime_ns) of the folder loaded
        self._root_seen: tuple[int, int] | None = None  # shared: the folder's (inode, mtime_ns) at the last rescan
        self._root_listed: tuple[int, int] | None = None  # and at the last rescan or listing of its names
        self._scanned_at = 0.0
        self._missed_at = -SHARED_MISS_LOOK_S  # shared: when a name not found here last rescanned
        self._default_previews: dict[str, bytes | None] = {}
        self.error: str | None = None
        try:
            root.mkdir(parents=True, exist_ok=True)
            self._load()
        except OSError as e:
            self.error = f"voice store at {root} is unusable: {e}"
            log.error(self.error)

    def _load(self) -> None:
        self._recover()
        if self.shared:
            self._sync(force=True)
            return
        for d in sorted(self.root.iterdir()):
            if not d.is_dir() or d.name.startswith("."):
                continue
            v = self._read_folder(d)
            if v is not None:
                self._voices[v.id] = v

    def _read_folder(self, d: Path) -> Voice | None:
        try:
            # "\\ud800" escapes are valid JSON but no text: a folder written before the names in `details` were
            # checked (or by hand) would make every listing of the library fail to encode; they read as U+FFFD
            meta = json.loads((d / "meta.json").read_text(), object_hook=_valid_text)
            if not isinstance(meta, dict) or meta.get("id") != d.name:
                raise ValueError(f"meta.json names voice {meta.get('id') if isinstance(meta, dict) else meta!r}")
            emb = np.load(d / "embedding.npy", allow_pickle=False).astype(np.float32)
            if emb.shape != (self.dim,):
                log.warning("voice %s has dimension %s, this model needs %d: skipped", d.name, emb.shape, self.dim)
                return None
            if not embedding_in_bounds(emb):
                raise ValueError(f"embedding.npy: {EMBEDDING_VALUES}")
            return Voice(**meta, embedding=emb)
        except Exception as e:  # a damaged voice folder must not stop the server
            log.warning("skipping unreadable voice folder %s: %s", d, e)
            return None

    def _sync(self, force: bool = False, voice_id: str | None = None, changed: bool = False) -> tuple[int, int] | None:
        """Shared store: take in what other gateways added, replaced or deleted since the last look (one
        stat of the folder when nothing changed; when it did, a look at every voice's folder, at most every
        SHARED_MIN_RESCAN_S, or SHARED_MISS_LOOK_S with `changed`, and a listing of its names meanwhile:
        `_take_listed`); `voice_id`, unknown here, is looked up on disk as well (a network filesystem may show a new
        entry before the folder's mtime moves, and a rescan may not be due). Returns the folder's (inode, mtime_ns)
        as this look found it (None: not shared, or unreadable)."""
        if not self.shared:
            return None
        try:
            st = os.stat(self.root)
            mark = (st.st_ino, st.st_mtime_ns)
            since = time.monotonic() - self._scanned_at
            due = (
                SHARED_RESCAN_S
                if mark == self._root_seen
                else min(SHARED_MISS_LOOK_S, SHARED_MIN_RESCAN_S)
                if changed
                else SHARED_MIN_RESCAN_S
            )
            if not force and since < due:
                if changed:
                    self._take_listed(mark)
                if voice_id is None or self._voices.get(voice_id) is not None or not _safe_id(voice_id):
                    return mark
                d = self.root / voice_id
                if d.is_dir() and (v := self._read_folder(d)) is not None:
                    with self._lock:
                        self._voices[v.id] = v
                        self._seen[v.id] = _folder_mark(d)
                return mark
        except OSError as e:
            log.warning("voice store at %s: could not look for other gateways' changes: %s", self.root, e)
            return None
        with self._scan_lock:
            self._rescan(mark)
        return mark

    def _rescan(self, mark: tuple[int, int]) -> None:
        """Every voice's folder looked at, changed ones read, the memory made what the disk holds (under
        `_scan_lock`); `mark`: the folder's (inode, mtime) before the listing."""
        try:
            self._root_seen = self._root_listed = mark
            self._scanned_at = time.monotonic()
            # (one stat per folder: a listing's entries know their kind; Path.iterdir, is_dir and stat took two,
            # ~35 ms for 3000 voices against ~6)
            with os.scandir(self.root) as listing:
                on_disk = {d.name: _folder_mark(d) for d in listing if not d.name.startswith(".") and d.is_dir()}
        except OSError as e:
            log.warning("voice store at %s: could not look for other gateways' changes: %s", self.root, e)
            return
        fresh: dict[str, tuple[Voice | None, tuple[int, int]]] = {}
        for vid, mark in on_disk.items():
            if self._seen.get(vid) != mark:  # (an unreadable folder is read once, until it changes)
                fresh[vid] = (self._read_folder(self.root / vid), mark)
        with self._lock:
            for vid in [k for k, v in self._voices.items() if v.source != "default" and k not in on_disk]:
                del self._voices[vid]
            for vid in [k for k in self._seen if k not in on_disk]:
                del self._seen[vid]
            for vid, (v, mark) in fresh.items():
                if v is not None:
                    self._voices[vid] = v
                    self._seen[vid] = mark
                elif vid not in self._voices:  # a folder never readable here: not read again until it changes
                    self._seen[vid] = mark

    def _take_new(self, mark: tuple[int, int] | None) -> None:
        """Shared store, a name not found here; `mark`: the folder's (inode, mtime) as this lookup found it (`_sync`).
        If the folder changed since the last rescan, rescan it now, not when the next one is due: a voice uploaded, or
        renamed, through one process and used by its name through another a moment later was unknown_voice there
        until then (up to SHARED_MIN_RESCAN_S; a rename, measured with --workers 2: 10 of 10). Rescans (one stat per
        voice's folder, only changed folders read) come at most every SHARED_MISS_LOOK_S: a client looking up unknown
        names while another renames a voice in a loop made each lookup one. Meanwhile a miss lists the folder's names
        if it changed since the last listing (`_take_listed`): a voice uploaded through another process just after
        a miss here that rescanned was unknown_voice until SHARED_MISS_LOOK_S had passed (--workers 2: 404 twice, 200
        after 60 ms). Unknown names in a loop cost nothing more than the stat `_sync` made while the folder does not
        change."""
        if not self.shared or mark is None or mark == self._root_seen:
            return
        now = time.monotonic()
        if now - self._missed_at >= SHARED_MISS_LOOK_S:
            self._missed_at = now
            self._sync(force=True)
        else:
            self._take_listed(mark)

    def _take_listed(self, mark: tuple[int, int]) -> None:
        """Shared store, a rescan not due: if the folder changed since the last rescan or listing (`mark`: its
        (inode, mtime) as the caller found it), what its names show is taken in: a folder not seen here is read (a
        voice uploaded through another process), a voice whose folder is gone is dropped (deleted there). One listing
        of names (no stat per voice: ~1.4 ms for 3000 voices, a rescan ~10) and a stat and a read of each new folder
        only; a voice renamed in place waits for the next rescan (its folder's name does not change)."""
        if mark == self._root_listed:
            return
        with self._scan_lock:  # (one listing applied at a time, and never over a voice `add` just put in memory)
            try:
                # (names only: the folder holds voices' folders and dot-named work in progress; a DirEntry each, to
                # ask its kind, made the listing 1.8 ms for 3000 voices against 1.4)
                on_disk = {name for name in os.listdir(self.root) if not name.startswith(".")}
            except OSError as e:
                log.warning("voice store at %s: could not look for other gateways' changes: %s", self.root, e)
                return
            self._root_listed = mark
            with self._lock:
                new = on_disk.difference(self._seen, self._voices)
            fresh: dict[str, tuple[Voice | None, tuple[int, int]]] = {}
            for vid in new:
                with contextlib.suppress(OSError):  # (deleted meanwhile)
                    st = os.stat(self.root / vid)  # (before the read: a change after it is seen later)
                    if stat.S_ISDIR(st.st_mode):  # (a stray file is no voice)
                        fresh[vid] = (self._read_folder(self.root / vid), (st.st_ino, st.st_mtime_ns))
            with self._lock:
                for vid in self._voices.keys() - on_disk:
                    if self._voices[vid].source != "default":
                        del self._voices[vid]
                for vid in self._seen.keys() - on_disk:
                    del self._seen[vid]
                for vid, (v, folder_mark) in fresh.items():
                    if v is not None:
                        self._voices[vid] = v
                    self._seen[vid] = folder_mark  # (an unreadable one: not read again until it changes)

    def _recover(self) -> None:
        """Finish what a crash interrupted: `.tmp-*` (unfinished writes), `.del-*` (deletes) and a voice's `.meta-*`
        (renames) go away; a `.old-<id>-*` folder (the previous version during a replace) comes back if the new one
        never landed.
        Shared: only what is older than SHARED_RECOVER_AGE_S (younger may be another gateway's work)."""
        now = time.time()
        for d in sorted(self.root.iterdir()):
            if not d.is_dir():
                continue
            with contextlib.suppress(OSError):
                if self.shared and d.name.startswith(".") and now - d.stat().st_mtime < SHARED_RECOVER_AGE_S:
                    continue
                if d.name.startswith(".old-"):
                    final = self.root / d.name[len(".old-") :].rsplit("-", 2)[0]
                    if not final.exists():
                        os.replace(d, final)
                        log.warning("restored voice %s after an interrupted update", final.name)
                        continue
                if d.name.startswith((".tmp-", ".old-", ".del-")):
                    shutil.rmtree(d)
                    continue
                for f in d.glob(".meta-*"):  # a rename's meta.json that never landed (`_write_meta`)
                    if not self.shared or now - f.stat().st_mtime >= SHARED_RECOVER_AGE_S:
                        f.unlink()

    # ---- queries ---------------------------------------------------------------------------------
    def visible(self, voice: Voice, owner: str) -> bool:
        return voice.owner in ("", owner)

    def list(self, owner: str) -> list[Voice]:
        """`owner`'s voices and the public ones. Shared store: rescanned first if the folder changed since the last
        rescan (at most every SHARED_MISS_LOOK_S): a listing through one gateway process just after an upload, rename
        or delete through another (a page that lists its voices after changing one) showed the library as it was
        until the next rescan due (up to SHARED_MIN_RESCAN_S; measured with --workers 2). A rescan costs a stat per
        voice's folder, less than a listing of the voices (a dict each)."""
        self._sync(changed=True)
        with self._lock:
            vs = [v for v in self._voices.values() if self.visible(v, owner)]
        return sorted(vs, key=lambda v: (v.source != "default", -v.created_at))

    def get(self, ref: str, owner: str) -> Voice:
        """By id, else by name (newest wins)."""
        mark = self._sync(voice_id=ref)
        v = self._lookup(ref, owner)
        # deleted or renamed by another process: perhaps another voice has this name (one renamed, or stored since)
        while v is not None and self._changed(v):
            v = self._lookup(ref, owner)
        if v is None and self.shared:  # perhaps a voice another gateway has just added
            self._take_new(mark)
            v = self._lookup(ref, owner)
        if v is None:
            # (a name of any length may be asked for: the answer quotes its start, not 100 KB of it)
            more = "…" if len(ref) > MAX_REF_QUOTED else ""
            raise VoiceError(G.UNKNOWN_VOICE, f"no voice {ref[:MAX_REF_QUOTED]!r}{more}")
        return v

    def _lookup(self, ref: str, owner: str) -> Voice | None:
        with self._lock:
            v = self._voices.get(ref)
            if v is None or not self.visible(v, owner):
                named = [x for x in self._voices.values() if x.name == ref and self.visible(x, owner)]
                v = max(named, key=lambda x: x.created_at) if named else None
        return v

    def preview_path(self, voice: Voice) -> Path:
        return self.root / voice.id / "preview.wav"

    # ---- changes ---------------------------------------------------------------------------------
    @staticmethod
    def clip_id(owner: str, clips: builtins.list[bytes]) -> str:
        h = hashlib.sha256(owner.encode())
        for c in clips:
            h.update(hashlib.sha256(c).digest())
        return "v_" + h.hexdigest()[:16]

    @staticmethod
    async def clip_id_off_loop(owner: str, clips: builtins.list[bytes]) -> str:
        """`clip_id`, in a worker thread when the clips are more than INLINE_HASH bytes (an upload's)."""
        if sum(map(len, clips)) <= INLINE_HASH:
            return VoiceStore.clip_id(owner, clips)
        return await asyncio.to_thread(VoiceStore.clip_id, owner, clips)

    def find(self, voice_id: str) -> Voice | None:
        self._sync(voice_id=voice_id)
        with self._lock:
            v = self._voices.get(voice_id)
        while v is not None and self._changed(v):
            with self._lock:
                v = self._voices.get(voice_id)
        return v

    def _changed(self, voice: Voice) -> bool:
        """Shared store: whether `voice`, in this process's memory, was deleted or renamed on disk by another process
        since this one read it (its folder gone, or changed: one stat); if so memory is made what the disk holds at
        once (the voice dropped, or read again), and the caller looks again. Without the look, for up to
        SHARED_RESCAN_S after a delete through one process, the other used the deleted voice, and an upload of the same
        clip or array through it answered 200 `deduplicated` with the voice's id from memory and wrote nothing: the
        voice the client was told it has was gone (404) in every process at their next rescans. And for up to
        SHARED_MIN_RESCAN_S after a rename, the other answered the old name with the renamed voice, also when a new
        voice had been stored under that name: speech in the wrong voice."""
        if not self.shared or voice.source == "default":
            return False
        folder = self.root / voice.id
        try:
            st = os.stat(folder)
            mark: tuple[int, int] | None = (st.st_ino, st.st_mtime_ns)
        except OSError:  # deleted (set aside, then removed)
            mark = None
        if mark is not None and self._seen.get(voice.id) == mark:
            return False
        fresh = self._read_folder(folder) if mark is not None else None
        with self._lock:
            if self._voices.get(voice.id) is voice:
                if fresh is not None and mark is not None:
                    self._voices[voice.id] = fresh
                    self._seen[voice.id] = mark
                else:
                    del self._voices[voice.id]
                    self._seen.pop(voice.id, None)
        return True

    async def add_off_loop(self, voice: Voice, embedding: np.ndarray, preview_wav: bytes | None = None) -> Voice:
        """`add` in a worker thread: its file lock (a shared store with --max-voices-per-key) waits on every other
        gateway process's writer, and the rescan under it reads a stat per voice (~8 ms at 3,000 voices): on the
        event loop, every session's audio waited with it, for as long as a stalled writer elsewhere held the lock.
        A request cancelled meanwhile leaves the write to finish: the voice is stored (an upload of it again is
        `deduplicated`)."""
        return await asyncio.to_thread(self.add, voice, embedding, preview_wav)

    def add(self, voice: Voice, embedding: np.ndarray, preview_wav: bytes | None = None) -> Voice:
        """Store `voice`; returns the voice stored under its id, which is another's when a request for the same id (the
        same clips, array or blend) landed it first, here or in another gateway process. Blocking (the routes call
        `add_off_loop`); safe in several threads at once (the locks: __init__)."""
        if self.error:
            raise VoiceError(G.VOICE_STORE_UNAVAILABLE, self.error)
        embedding = np.asarray(embedding, dtype=np.float32)
        if embedding.shape != (self.dim,) or not embedding_in_bounds(embedding):
            raise VoiceError(G.BAD_EMBEDDING, f"embedding must be {self.dim} values: {EMBEDDING_VALUES}")
        with self._writer():
            if self.max_per_owner:
                self._sync(force=True)  # (shared: what every process stored, read under the lock)
                with self._lock:
                    new = voice.id not in self._voices  # not one stored again
                    owned = sum(1 for v in self._voices.values() if v.owner == voice.owner and v.source != "default")
                if new and owned >= self.max_per_owner:
                    raise VoiceError(
                        G.TOO_MANY_VOICES,
                        f"this key stores {owned} voices, the most allowed (--max-voices-per-key): delete one first",
                    )
            voice.embedding = embedding
            voice.dim = self.dim
            voice.has_preview = preview_wav is not None
            voice = self._write(voice, preview_wav)
        with self._scan_lock, self._lock:  # (a rescan listed before the write lands must not drop it after)
            self._voices[voice.id] = voice
        return voice

    @contextlib.contextmanager
    def _writer(self) -> Iterator[None]:
        """Shared store with --max-voices-per-key: one writer of a voice at a time in every gateway process (an
        advisory lock on `<root>/.lock`, released when its file closes, by a killed process too), so that counting an
        owner's voices and writing a new one are one step. Each process counted only the voices its memory held (a
        rescan is due at most every SHARED_MIN_RESCAN_S): with --workers 2 and a limit of 3, a key stored 6. With a
        limit, this process's writers (worker threads) take `_write_lock` first, any store: two adds of one key at
        once both counted below the limit, then both wrote."""
        if not self.max_per_owner:
            yield
            return
        with self._write_lock:
            if not self.shared:
                yield
                return
            with open(self.root / ".lock", "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                yield

    def _write(self, voice: Voice, preview_wav: bytes | None) -> Voice:
        """The voice's folder written aside, then renamed into place; returns the voice now stored under its id. A
        folder of that id already there is the same voice landed by another request first (two uploads of one clip
        at once, in one gateway process or two): that voice, left in place. Renaming it aside to put this one in
        made the second writer's rename fail (503 voice_store_unavailable, "Directory not empty", measured with 2
        processes) and left the other processes a moment with no voice of that id. Only a folder that does not
        read as a voice (damaged) is replaced."""
        final = self.root / voice.id
        try:
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))
            try:
                meta = voice.public() | {"owner": voice.owner}
                meta.pop("default")
                (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
                assert voice.embedding is not None  # a stored voice always has one
                np.save(tmp / "embedding.npy", voice.embedding)
                if preview_wav is not None:
                    (tmp / "preview.wav").write_bytes(preview_wav)
                # (a few tries: the folder found in the way may be deleted by another process while it is read, and
                # then this one lands; it was 503 voice_store_unavailable, the set-aside finding no folder to move)
                for _ in range(3):
                    try:
                        os.rename(tmp, final)  # (a folder onto one that holds files fails: nothing is replaced here)
                        return voice
                    except OSError as e:
                        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                            raise
                    landed = self._read_folder(final)
                    if landed is not None:
                        return landed
                    # a damaged folder of this id: set aside first (restored at the next start if this one never
                    # lands), then replaced
                    old = self.root / f".old-{voice.id}-{os.getpid()}-{time.monotonic_ns()}"
                    try:
                        os.replace(final, old)
                    except FileNotFoundError:  # deleted meanwhile: try again to land this one
                        continue
                    os.replace(tmp, final)
                    shutil.rmtree(old, ignore_errors=True)
                    return voice
                os.rename(tmp, final)  # (a folder there still: its error is the answer)
                return voice
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        except OSError as e:
            raise _store_error("could not save the voice", e) from e

    def rename(self, ref: str, owner: str, name: str) -> Voice:
        v = self.get(ref, owner)
        if v.source == "default":
            raise VoiceError(G.READ_ONLY, "default voices cannot be renamed")
        if v.owner != owner:
            raise VoiceError(G.FORBIDDEN, "this voice belongs to another key")
        name = validate_name(name)
        self._write_meta(replace(v, name=name))  # the voice in memory changes only once it is on disk
        v.name = name
        return v

    def _write_meta(self, voice: Voice) -> None:
        """A stored voice's meta.json replaced in place (atomically): its folder never leaves, so another gateway
        process (a shared store) never finds the voice missing, nor its preview, while it is renamed (a whole new
        folder swapped in left a moment without one: its lookups answered unknown_voice, and a rename there at the
        same moment voice_store_unavailable). A voice deleted meanwhile stays deleted: unknown_voice."""
        folder = self.root / voice.id
        meta = voice.public() | {"owner": voice.owner}
        meta.pop("default")
        try:
            replace_file(folder / "meta.json", json.dumps(meta, indent=1).encode(), prefix=".meta-")
            with contextlib.suppress(OSError):
                os.utime(self.root)  # the library changed: other processes' next look rescans it
        except FileNotFoundError:  # deleted meanwhile (its folder set aside, by this process or another)
            raise VoiceError(G.UNKNOWN_VOICE, f"no voice {voice.id!r}") from None
        except OSError as e:
            raise _store_error("could not save the voice", e) from e

    def delete(self, ref: str, owner: str) -> Voice:
        v = self.get(ref, owner)
        if v.source == "default":
            raise VoiceError(G.READ_ONLY, "default voices cannot be deleted")
        if v.owner != owner:
            raise VoiceError(G.FORBIDDEN, "this voice belongs to another key")
        # Renamed aside first (atomic), so a failed or interrupted delete never leaves half a voice to reload.
        gone = self.root / f".del-{v.id}-{os.getpid()}-{time.monotonic_ns()}"
        try:
            os.replace(self.root / v.id, gone)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _store_error("could not delete the voice", e) from e
        with self._lock:
            self._voices.pop(v.id, None)
        shutil.rmtree(gone, ignore_errors=True)
        return v

    def remember_default(self, voice: Voice, embedding: np.ndarray, preview_wav: bytes | None) -> None:
        """Default voices live in memory only; their source folder is the truth."""
        voice.embedding = np.asarray(embedding, dtype=np.float32)
        voice.has_preview = preview_wav is not None
        with self._lock:
            self._voices[voice.id] = voice
        self._default_previews[voice.id] = preview_wav

    def preview_bytes(self, voice: Voice) -> bytes | None:
        if voice.source == "default":
            return self._default_previews.get(voice.id)
        try:
            return self.preview_path(voice).read_bytes()
        except FileNotFoundError:  # none, or the voice deleted meanwhile (by another process)
            return None
