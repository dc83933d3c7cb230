"""Voice library endpoints (`/v1/voices`): upload clips or embeddings, blend, rename, export, delete; and the
reference server's speaker routes (`/tts/speakers`: list, upload, preview) over the same library."""

from __future__ import annotations

import asyncio
import io
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from app.core.gateway import PREVIEW_S, Gateway, preview_wav
from app.doors.speech import error_response, read_json
from app.io.auth import require_key
from app.io.bodies import admit_body
from app.io.checks import base64_payload, check_text
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.io.json_input import check_fields
from app.voices.library import (
    Voice,
    VoiceError,
    VoiceStore,
    blend_t,
    derived_name,
    parse_embedding_file,
    slerp,
    validate_name,
)

MAX_CLIPS = 8
BLEND_FIELDS = frozenset({"a", "b", "t", "name"})  # POST /v1/voices/blend's JSON body
BLEND_BODY_BYTES = 65536
RENAME_FIELDS = frozenset({"name"})  # PATCH /v1/voices/{id}'s
RENAME_BODY_BYTES = 4096
UPLOAD_PARTS = frozenset({"file", "embedding", "name"})  # POST /v1/voices's form
FORM_OVERHEAD = 65536  # bytes of a multipart body besides its files (boundaries, part headers, the name)


def _name_from_filename(filename: str) -> str:
    """A default voice name from an upload's file name: the stem, with characters names cannot hold replaced."""
    return derived_name(re.split(r"[\\/]", filename)[-1].rsplit(".", 1)[0])


def string_or_none(value: object, key: str, code: str = G.BAD_NAME) -> str | None:
    """A JSON field that names something (a voice name, a label, a file name): a string, or None when null
    or absent. Anything else (null's cousins true, 12, {}) is refused, never turned into "True" or "12"."""
    if value is None or isinstance(value, str):
        return value
    raise VoiceError(code, f"{key} must be a string")


def _owner(request: Request) -> str:
    gw: Gateway = request.app.state.gateway
    return gw.owner_of(require_key(request))


async def create_voice(request: Request) -> Response:
    """multipart/form-data: `file` (1..8 reference clips, averaged) or `embedding` (.npy/.npz); `name`."""
    gw: Gateway = request.app.state.gateway
    lim = gw.settings.limits
    owner = _owner(request)
    most = lim.max_upload_bytes * MAX_CLIPS + FORM_OVERHEAD
    # a declared length past `most` is refused at once, a chunked body as soon as it passes it (Starlette's form parser
    # spools a file part of any size to disk); within the process's bound on bodies read at once, or 503
    # too_many_uploads
    admit_body(request, most, G.UPLOAD_TOO_LARGE, f"uploads are limited to {lim.max_upload_bytes} bytes per clip")
    # a media type's name is case-insensitive (RFC 9110 8.3.1), as Starlette's form parser reads it:
    # "Multipart/Form-Data" was refused here, then parsed fine
    if not request.headers.get("content-type", "").lstrip().lower().startswith("multipart/form-data"):
        raise RequestError(G.BAD_UPLOAD, "send multipart/form-data with a 'file' (clip) or 'embedding' part")
    try:
        form = await request.form(max_files=MAX_CLIPS + 1, max_fields=8, max_part_size=lim.max_upload_bytes)
    except RequestError:  # the body past the bound as it arrived (app/io/bodies.py)
        raise
    except ClientDisconnect:  # gone mid-body: no bad upload (nobody reads the answer)
        raise RequestError(G.CLIENT_GONE, "the client left before its upload was read") from None
    except Exception as e:  # starlette raises MultiPartException / HTTPException on limits and malformed bodies
        detail = str(getattr(e, "detail", e))
        # a part past its size is too large (413); a body that is not multipart (no boundary, broken) is bad (400)
        status = 413 if "maximum size" in detail else 400
        raise RequestError(G.BAD_UPLOAD, f"could not read the upload: {detail}", status) from None
    # every part is one the form takes, once where it is one thing: a misspelt or repeated part was dropped in
    # silence (a "voice_name" gave a voice named after the file, a second embedding was never read, of two names
    # the last was kept, a 'file' text field beside an embedding was ignored)
    check_fields(dict.fromkeys(form.keys()), UPLOAD_PARTS, G.BAD_UPLOAD, "form fields", name_known=True)
    for part in ("embedding", "name"):
        if len(form.getlist(part)) > 1:
            raise RequestError(G.BAD_UPLOAD, f"give one '{part}' part, not {len(form.getlist(part))}")
    for part in ("file", "embedding"):
        if not all(isinstance(f, UploadFile) for f in form.getlist(part)):
            raise RequestError(G.BAD_UPLOAD, f"'{part}' must be a file (a part with a filename), not a text field")
    clips = [f for f in form.getlist("file") if isinstance(f, UploadFile)]
    emb_file = form.get("embedding")
    name_field = form.get("name")
    if name_field is not None and not isinstance(name_field, str):
        raise RequestError(G.BAD_NAME, "name must be a form field, not a file")
    if (not clips) == (not isinstance(emb_file, UploadFile)):
        raise RequestError(G.BAD_UPLOAD, "give either 1-8 'file' clips or one 'embedding' file")
    if len(clips) > MAX_CLIPS:
        raise RequestError(G.BAD_UPLOAD, f"at most {MAX_CLIPS} clips per voice")
    datas = [await f.read() for f in clips]
    filename = (clips[0].filename if clips else emb_file.filename) or ""  # type: ignore[union-attr]
    name = validate_name(str(name_field) if name_field else _name_from_filename(filename))
    if clips:
        stored = await store_clips(gw, owner, datas, name, rename=bool(name_field))
    else:
        data = await emb_file.read()  # type: ignore[union-attr]
        if len(data) > lim.max_upload_bytes:
            raise RequestError(G.UPLOAD_TOO_LARGE, "embedding file too large", 413)
        stored = await store_embedding(gw, owner, data, name, rename=bool(name_field))
    return JSONResponse(stored.public(), status_code=201 if stored.created else 200)


@dataclass
class Stored:
    voice: Voice
    created: bool  # False: these clips (or this array) were a voice already
    renamed_from: str | None = None  # ... which had this other name

    def public(self) -> dict:
        extra = {} if self.created else {"deduplicated": True}
        return self.voice.public() | extra | ({"renamed_from": self.renamed_from} if self.renamed_from else {})


def _dedup(gw: Gateway, existing: Voice, owner: str, name: str, rename: bool) -> Stored:
    """The same clip (or embedding) again is the voice it already is. Under another name given explicitly,
    that voice takes the new name, and the answer says what it was called (`renamed_from`)."""
    if rename and name != existing.name and existing.owner == owner and existing.source != "default":
        old = existing.name
        return Stored(gw.voices.rename(existing.id, owner, name), False, old)
    return Stored(existing, False)


async def store_clips(
    gw: Gateway, owner: str, datas: list[bytes], name: str, rename: bool = True, details: dict | None = None
) -> Stored:
    """Clips -> a library voice (their embeddings averaged), or the voice these same clips already are."""
    vid = await VoiceStore.clip_id_off_loop(owner, datas)  # (up to 80 MB: not on the event loop)
    existing = gw.voices.find(vid)
    if existing is not None:
        return _dedup(gw, existing, owner, name, rename)
    # one decoded clip at a time: 8 clips of 60 s at 192 kHz decode to 370 MB, from 20 MB of FLAC
    embs: list[np.ndarray] = []
    seconds, preview = 0.0, b""
    for data in datas:
        samples, sr = await gw.decode_clip(data)
        seconds += len(samples) / sr
        if not preview:  # the first clip's; its worker thread holds a copy of what it needs, not the whole clip
            preview = await asyncio.to_thread(preview_wav, samples[: int(PREVIEW_S * sr)].copy(), sr)
        embs.append(await gw.embed_samples(samples, sr))
        del samples
    voice = Voice(
        id=vid,
        name=name,
        owner=owner,
        source="clip" if len(embs) == 1 else "clips",
        dim=gw.cfg.speaker_embedding_dim,
        details={"clips": len(embs), "seconds": round(seconds, 2)} | (details or {}),
    )
    stored = await gw.voices.add_off_loop(voice, np.mean(embs, axis=0), preview)
    if stored is not voice:  # another request stored these clips first (meanwhile): as if it had come before
        return _dedup(gw, stored, owner, name, rename)
    return Stored(voice, True)


async def store_embedding(
    gw: Gateway, owner: str, data: bytes, name: str, rename: bool = True, details: dict | None = None
) -> Stored:
    """A .npy/.npz embedding file -> a library voice (the same array twice: the same voice). The file is parsed in a
    worker thread: a 16 KB deflated .npz inflates to 16 MB (~55 ms)."""
    emb = await asyncio.to_thread(parse_embedding_file, data, gw.cfg.speaker_embedding_dim)
    vid = VoiceStore.clip_id(owner, [emb.tobytes()])
    existing = gw.voices.find(vid)
    if existing is not None:
        return _dedup(gw, existing, owner, name, rename)
    voice = Voice(id=vid, name=name, owner=owner, source="embedding", dim=len(emb), details=details or {})
    stored = await gw.voices.add_off_loop(voice, emb)
    if stored is not voice:  # another request stored this array first (meanwhile): as if it had come before
        return _dedup(gw, stored, owner, name, rename)
    return Stored(voice, True)


async def blend_voices(request: Request) -> Response:
    """JSON {a, b, t, name}: SLERP between two voices' embeddings."""
    gw: Gateway = request.app.state.gateway
    owner = _owner(request)
    data = await read_json(request, BLEND_BODY_BYTES)
    check_fields(data, BLEND_FIELDS, G.BAD_PARAMS)
    t = blend_t(data, "t", G.BAD_BLEND)
    if not all(isinstance(data.get(k), str) and data[k] for k in ("a", "b")):
        raise RequestError(G.BAD_BLEND, "a blend needs two voices: 'a' and 'b' (ids or names)")
    a, b = gw.voices.get(data["a"], owner), gw.voices.get(data["b"], owner)
    assert a.embedding is not None and b.embedding is not None
    given = string_or_none(data.get("name"), "name")
    # a name the client gives is checked as everywhere else (too long is refused, never cut); the default
    # name is ours to fit
    name = validate_name(given) if given is not None else derived_name(f"{a.name} + {b.name}", "blend")
    vid = VoiceStore.clip_id(owner, [a.id.encode(), b.id.encode(), np.float64(t).tobytes()])
    existing = gw.voices.find(vid)
    if existing is not None and gw.voices.visible(existing, owner):  # the same blend again: that voice
        if given is not None and existing.name != name:
            existing = gw.voices.rename(vid, owner, name)
        return JSONResponse(existing.public() | {"deduplicated": True}, status_code=200)
    emb = slerp(a.embedding, b.embedding, t)
    voice = Voice(id=vid, name=name, owner=owner, source="blend", dim=len(emb), details={"a": a.id, "b": b.id, "t": t})
    stored = await gw.voices.add_off_loop(voice, emb)
    if stored is not voice:  # the same blend, stored first by another request
        return JSONResponse(stored.public() | {"deduplicated": True}, status_code=200)
    return JSONResponse(voice.public(), status_code=201)


async def list_voices(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    owner = _owner(request)
    return JSONResponse({"voices": [v.public() for v in gw.voices.list(owner)]})


async def voice_detail(request: Request) -> Response:
    """GET a voice, PATCH {name} to rename, DELETE it."""
    gw: Gateway = request.app.state.gateway
    ref = request.path_params["voice"]
    owner = _owner(request)
    if request.method == "PATCH":
        data = await read_json(request, RENAME_BODY_BYTES)
        check_fields(data, RENAME_FIELDS, G.BAD_PARAMS)
        return JSONResponse(gw.voices.rename(ref, owner, string_or_none(data.get("name"), "name") or "").public())
    if request.method == "DELETE":
        v = gw.voices.delete(ref, owner)
        return JSONResponse({"deleted": v.id})
    # GET, and HEAD, which Starlette routes wherever GET is allowed (it used to fall through to the delete:
    # `curl -I`, a link checker or a proxy's HEAD deleted the voice)
    return JSONResponse(gw.voices.get(ref, owner).public())


async def voice_embedding(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    v = gw.voices.get(request.path_params["voice"], _owner(request))
    buf = io.BytesIO()
    np.save(buf, np.asarray(v.embedding, dtype=np.float32))
    return Response(
        buf.getvalue(),
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="{v.id}.npy"'},
    )


async def voice_preview(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    v = gw.voices.get(request.path_params["voice"], _owner(request))
    data = gw.voices.preview_bytes(v)
    if data is None:
        raise RequestError(G.NO_PREVIEW, "this voice has no reference audio", 404)
    return Response(data, media_type="audio/wav", headers={"Cache-Control": "private, max-age=3600"})


# ---- the ZONOS2 reference server's speaker routes (/tts/speakers), over the voice library ------------------
# Same request and answer shapes as the reference, so its web UI can upload, list, preview and blend. Its
# speakers live in one browser session's memory (the client-chosen X-TTS-Session-ID); here an upload is a
# library voice like any other (kept on disk, visible to the same API key, usable by every API), which
# remembers the session that uploaded it: `scope` is "session" for that session, "library" otherwise.
SESSION_HEADER = "x-tts-session-id"
_SPEAKER_UPLOAD_FIELDS = {
    "label",
    "speaker_audio_base64",
    "speaker_wav_base64",
    "speaker_audio_name",
    "speaker_embedding_base64",
    "speaker_embedding_name",
}
_SOURCE_TYPES = {"clip": "audio", "clips": "audio", "embedding": "embedding_file", "blend": "blend"}


def _tts_session(request: Request, required: bool) -> str | None:
    sid = request.headers.get(SESSION_HEADER, "").strip()[:128]
    if not sid and required:
        raise RequestError(G.MISSING_SESSION, "Cached speaker operations require the X-TTS-Session-ID header.")
    return sid or None


def speaker_record(v: Voice, session: str | None) -> dict:
    """A voice in the reference's speaker shape."""
    d = {
        "id": v.id,
        "label": v.name,
        "source_type": ("audio" if v.has_preview else "embedding_file")
        if v.source == "default"
        else _SOURCE_TYPES.get(v.source, v.source),
        "original_name": v.details.get("original_name") or v.details.get("file"),
        "dimension": v.dim,
        "created_at": v.created_at,
        "has_preview": v.has_preview,
    }
    if v.source == "default":
        return d | {"scope": "default", "is_default": True}
    mine = session is not None and v.details.get("tts_session") == session
    return d | {"scope": "session" if mine else "library", "is_default": False}


async def tts_list_speakers(request: Request) -> Response:
    """The default voices (by label), then the caller's library voices, newest first."""
    gw: Gateway = request.app.state.gateway
    try:
        owner = _owner(request)
        sid = _tts_session(request, required=False)
    except RequestError as e:
        return error_response(e, detail=True)
    voices = gw.voices.list(owner)
    defaults = sorted((v for v in voices if v.source == "default"), key=lambda v: v.name.lower())
    others = [v for v in voices if v.source != "default"]
    return JSONResponse({"speakers": [speaker_record(v, sid) for v in defaults + others]})


async def tts_cache_speaker(request: Request) -> Response:
    """JSON {label?, speaker_audio_base64 | speaker_wav_base64, speaker_audio_name?} or
    {label?, speaker_embedding_base64, speaker_embedding_name?}; base64 or data: URLs."""
    gw: Gateway = request.app.state.gateway
    try:
        owner = _owner(request)
        sid = _tts_session(request, required=True)
        data = await read_json(request, gw.settings.limits.max_json_body_bytes)
        check_fields(data, _SPEAKER_UPLOAD_FIELDS, G.BAD_PARAMS)
        audio = data.get("speaker_audio_base64") or data.get("speaker_wav_base64")
        emb = data.get("speaker_embedding_base64")
        if not audio and not emb:
            raise RequestError(G.BAD_PARAMS, "Provide an audio file or saved embedding file to cache.")
        if audio and emb:
            raise RequestError(
                G.BAD_PARAMS, "Provide either a reference audio file or a saved embedding file, not both."
            )
        name_key = "speaker_audio_name" if audio else "speaker_embedding_name"
        file_name = string_or_none(data.get(name_key), name_key, G.BAD_PARAMS) or None
        if file_name is not None:  # kept in the voice's details, written and answered as UTF-8 ever after
            check_text(file_name, name_key, G.BAD_PARAMS)
        label = string_or_none(data.get("label"), "label", G.BAD_PARAMS)
        label = validate_name(label) if label and label.strip() else None  # checked as every name is
        name = (
            label
            or (_name_from_filename(file_name) if file_name else "")
            or ("Speaker audio" if audio else "Speaker embedding")
        )
        details = {"tts_session": sid, **({"original_name": file_name[:256]} if file_name else {})}
        if audio:
            raw = await base64_payload(audio, "speaker_audio_base64")
            stored = await store_clips(gw, owner, [raw], name, rename=bool(label), details=details)
        else:
            raw = await base64_payload(emb, "speaker_embedding_base64")
            if len(raw) > gw.settings.limits.max_upload_bytes:
                raise RequestError(G.UPLOAD_TOO_LARGE, "embedding file too large", 413)
            stored = await store_embedding(gw, owner, raw, name, rename=bool(label), details=details)
    except RequestError as e:
        return error_response(e, detail=True)
    extra: dict[str, Any] = {} if stored.created else {"deduplicated": True}
    if stored.renamed_from:
        extra["renamed_from"] = stored.renamed_from
    return JSONResponse(speaker_record(stored.voice, sid) | extra, status_code=201 if stored.created else 200)


async def tts_speaker_preview(request: Request) -> Response:
    """The reference clip as WAV. As in the reference, a non-default voice needs the session header."""
    gw: Gateway = request.app.state.gateway
    try:
        owner = _owner(request)
        v = gw.voices.get(request.path_params["speaker"], owner)
        if v.source != "default":
            _tts_session(request, required=True)
        data = gw.voices.preview_bytes(v)
        if data is None:
            raise RequestError(G.NO_PREVIEW, "Cached speaker preview audio is not available.", 404)
    except RequestError as e:
        return error_response(e, detail=True)
    return Response(data, media_type="audio/wav", headers={"Cache-Control": "private, max-age=3600"})
