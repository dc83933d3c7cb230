"""ElevenLabs request stitching across HTTP calls (`previous_request_ids`).

A text-to-speech request whose audio was all sent leaves the window its voice would go on from
(app/core/continuation.py `Chain.state`: the spoken text and the frames the engine kept of its last chunks,
the pinned first chunk included) under the `request-id` its response carried, for its owner (the API key,
or everyone without keys). A later request of the same owner, voice and model that names it is generated as
the continuation of that window, exactly as a context's next utterance continues the one before (the
reference's continuation prompt); it still has a DAC stream and an audio file of its own. Of several ids
the last is continued (ElevenLabs' order: oldest first); each must be such a request. A request whose last
sentence took several engine requests (its spoken text over the utterance budget) keeps nothing, as such an
utterance ends a context's chain. A request of breaks alone keeps the state it continued (a break does not
reset the voice).

Kept on disk, so that every gateway process (app/workers.py) sees what another kept:
`<data dir>/stitching/<owner>/<request id>.npz` (the texts and settings as JSON, the frames int16), written
under a temporary name and renamed into place. Bounds (app/settings.py Limits): a file older than
--stitch-ttl-s is refused (and deleted); after each write an owner keeps its newest --stitch-requests files
within --stitch-bytes.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import secrets
import time
import zipfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.settings import GatewaySettings, Limits
from app.voices.library import replace_file
from engine.frontend.longform import Continuation, LongFormOptions, context_chunks

log = logging.getLogger("gateway.stitching")

MAX_REQUEST_IDS = 3  # ElevenLabs' limit on previous_request_ids (and next_request_ids)
_REQUEST_ID = re.compile(r"[0-9a-f]{32}")
_ANONYMOUS = "_anonymous"  # the owner without API keys (owners are hex digests: no clash)


def new_request_id() -> str:
    """A fresh `request-id`: unguessable, so an id is only ever known to the client it was sent to."""
    return secrets.token_hex(16)


def model_identity(settings: GatewaySettings) -> str:
    """The model kept frames belong to: frames of another checkpoint are not continued."""
    w = settings.weights
    return str(w.model_path) if w.model_path else f"random:{w.random_preset}:{w.seed}"


@dataclass
class Kept:
    """One finished request's continuation state (engine/frontend/longform.py `Continuation`) and what it
    was spoken with."""

    voice: str
    model: str
    index: int  # chunks it and the requests it continued had generated
    anchor: tuple[str, np.ndarray] | None  # the pinned first chunk
    tail: list[tuple[str, np.ndarray]]

    @classmethod
    def of(cls, cont: Continuation, voice: str, model: str) -> Kept:
        anchor = (cont.anchor_text, cont.anchor_codes) if cont.anchor_codes is not None else None
        return cls(voice, model, cont.index, anchor, list(cont.tail))

    def continuation(self, opts: LongFormOptions) -> Continuation:
        """The state a request with these long-form options continues from (its own window size and pin)."""
        cont = Continuation(window_chunks=opts.window_chunks, pin_anchor=opts.pin_anchor, index=self.index)
        if opts.pin_anchor and self.anchor is not None:
            cont.anchor_text, cont.anchor_codes = self.anchor
        n = context_chunks(opts.window_chunks)
        cont.tail = self.tail[-n:] if n else []
        return cont

    def dump(self) -> bytes:
        meta = {
            "voice": self.voice,
            "model": self.model,
            "index": self.index,
            "anchor": self.anchor[0] if self.anchor is not None else None,
            "tail": [text for text, _ in self.tail],
        }
        arrays = {"meta": np.array(json.dumps(meta))}
        if self.anchor is not None:
            arrays["anchor"] = np.asarray(self.anchor[1]).astype(np.int16)  # codes are 0..1025
        for i, (_, codes) in enumerate(self.tail):
            arrays[f"tail_{i}"] = np.asarray(codes).astype(np.int16)
        buf = io.BytesIO()
        np.savez(buf, **arrays)  # type: ignore[arg-type]
        return buf.getvalue()

    @classmethod
    def load(cls, data: bytes) -> Kept:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            anchor = (meta["anchor"], z["anchor"].astype(np.int64)) if meta["anchor"] is not None else None
            tail = [(text, z[f"tail_{i}"].astype(np.int64)) for i, text in enumerate(meta["tail"])]
        return cls(str(meta["voice"]), str(meta["model"]), int(meta["index"]), anchor, tail)


@dataclass
class Stitch:
    """An HTTP request's part in stitching: the state it continues (None: it starts fresh) and what to do
    with its own once all its audio was sent (app/core/pipeline.py `speak`)."""

    seed: Continuation | None
    done: Callable[[Continuation], Awaitable[None]]


class StitchStore:
    """Every owner's kept requests, in the data dir (see the module docstring)."""

    def __init__(self, root: Path, limits: Limits, model: str) -> None:
        self.root = root
        self.limits = limits
        self.model = model

    @property
    def on(self) -> bool:
        return self.limits.stitch_requests > 0

    def _dir(self, owner: str) -> Path:
        return self.root / (owner or _ANONYMOUS)

    def _expired(self, mtime: float) -> bool:
        return time.time() - mtime > self.limits.stitch_ttl_s

    def put(self, owner: str, request_id: str, kept: Kept) -> None:
        data = kept.dump()
        if len(data) > self.limits.stitch_bytes:
            log.info("request %s: %d bytes of kept frames, over --stitch-bytes: not kept", request_id, len(data))
            return
        folder = self._dir(owner)
        folder.mkdir(parents=True, exist_ok=True)
        replace_file(folder / f"{request_id}.npz", data)
        self._prune(folder)

    def _prune(self, folder: Path) -> None:
        """The owner's newest --stitch-requests files within --stitch-bytes, none expired (another process
        may prune at the same time: a file already gone is fine)."""
        files = []
        for path in folder.iterdir():
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            if path.name.startswith(".tmp-"):  # a write in progress, or one a crash left behind
                if self._expired(st.st_mtime):
                    path.unlink(missing_ok=True)
                continue
            files.append((st.st_mtime, st.st_size, path))
        total = 0
        for i, (mtime, size, path) in enumerate(sorted(files, key=lambda f: f[0], reverse=True)):
            total += size
            if i >= self.limits.stitch_requests or total > self.limits.stitch_bytes or self._expired(mtime):
                path.unlink(missing_ok=True)

    def get(self, owner: str, request_id: str) -> Kept | None:
        """The owner's kept request of that id; None: unknown, expired, another owner's or unreadable."""
        if not _REQUEST_ID.fullmatch(request_id):
            return None
        path = self._dir(owner) / f"{request_id}.npz"
        try:
            mtime = path.stat().st_mtime
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if self._expired(mtime):
            path.unlink(missing_ok=True)
            return None
        try:
            return Kept.load(data)
        except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile):
            log.warning("kept request %s is unreadable: ignored", path)
            return None

    def previous(self, ids: list[str], owner: str, voice: str) -> Kept:
        """The last of `ids`, each a kept request of this owner spoken by this voice and model; otherwise
        a 400 naming the id."""
        found = None
        for rid in ids:
            kept = self.get(owner, rid)
            if kept is None:
                raise RequestError(
                    G.BAD_PARAMS,
                    f"previous_request_ids: no request {rid[:64]!r} of this API key whose audio was all sent in the "
                    f"last {self.limits.stitch_ttl_s:g} s (unknown, expired, another key's, or cut off)",
                )
            if kept.voice != voice or kept.model != self.model:
                raise RequestError(
                    G.BAD_PARAMS,
                    f"previous_request_ids: request {rid!r} was spoken by another voice; stitching continues one voice",
                )
            found = kept
        assert found is not None
        return found

    async def stitch(
        self, ids: list[str], owner: str, voice: str, opts: LongFormOptions, request_id: str
    ) -> Stitch | None:
        """A request's stitching: it continues the last of `ids` (none: fresh), and keeps its own state under
        `request_id`. None: stitching is off (a request naming ids is refused)."""
        why_off = (
            "request stitching is off on this server (--stitch-requests 0)"
            if not self.on
            else "previous_request_ids continues the voice, which zonos_params long_form false turns off"
            if opts.long_form is False
            else None
        )
        if why_off is not None:
            if ids:
                raise RequestError(G.BAD_PARAMS, why_off)
            return None
        seed = (await asyncio.to_thread(self.previous, ids, owner, voice)).continuation(opts) if ids else None

        async def done(state: Continuation) -> None:
            try:
                await asyncio.to_thread(self.put, owner, request_id, Kept.of(state, voice, self.model))
            except OSError as e:  # the audio was sent whole: only a later request naming this one loses
                log.warning("request %s: its kept frames could not be stored: %s", request_id, e)

        return Stitch(seed, done)
