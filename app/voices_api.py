"""Voice library endpoints (`/v1/voices`): upload clips or embeddings, blend, rename, export, delete."""

from __future__ import annotations

import io
import re

import numpy as np
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.auth import require_key
from app.gateway import Gateway, wav_bytes
from app.http_api import read_json
from app.synthesis import RequestError
from app.voices import Voice, VoiceStore, parse_embedding_file, slerp, validate_name

MAX_CLIPS = 8


def _name_from_filename(filename: str) -> str:
    """A default voice name from an upload's file name: the stem, with characters names cannot hold replaced."""
    stem = re.split(r"[\\/]", filename)[-1].rsplit(".", 1)[0]
    return re.sub(r"[^\w .,'()+&\-]", "_", stem).strip()[:64].strip() or "voice"


def _owner(request: Request) -> str:
    gw: Gateway = request.app.state.gateway
    return gw.owner_of(require_key(request))


async def create_voice(request: Request) -> Response:
    """multipart/form-data: `file` (1..8 reference clips, averaged) or `embedding` (.npy/.npz); `name`."""
    gw: Gateway = request.app.state.gateway
    lim = gw.settings.limits
    owner = _owner(request)
    length = int(request.headers.get("content-length") or 0)
    if length > lim.max_upload_bytes * MAX_CLIPS + 65536:
        raise RequestError("upload_too_large", f"uploads are limited to {lim.max_upload_bytes} bytes per clip", 413)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise RequestError("bad_upload", "send multipart/form-data with a 'file' (clip) or 'embedding' part")
    try:
        form = await request.form(max_files=MAX_CLIPS + 1, max_fields=8, max_part_size=lim.max_upload_bytes)
    except Exception as e:  # starlette raises MultiPartException / HTTPException on limits
        raise RequestError("bad_upload", f"could not read the upload: {getattr(e, 'detail', e)}", 413) from None
    clips = [f for f in form.getlist("file") if isinstance(f, UploadFile)]
    emb_file = form.get("embedding")
    name_field = form.get("name")
    if (not clips) == (not isinstance(emb_file, UploadFile)):
        raise RequestError("bad_upload", "give either 1-8 'file' clips or one 'embedding' file")
    if len(clips) > MAX_CLIPS:
        raise RequestError("bad_upload", f"at most {MAX_CLIPS} clips per voice")
    datas = [await f.read() for f in clips]
    filename = (clips[0].filename if clips else emb_file.filename) or ""  # type: ignore[union-attr]
    name = validate_name(str(name_field) if name_field else _name_from_filename(filename))
    if clips:
        vid = VoiceStore.clip_id(owner, datas)
        existing = gw.voices.find(vid)
        if existing is not None:
            return JSONResponse(existing.public() | {"deduplicated": True}, status_code=200)
        decoded = [await gw.decode_clip(d) for d in datas]
        embs = [await gw.embed_samples(s, sr) for s, sr in decoded]
        voice = Voice(id=vid, name=name, owner=owner, source="clip" if len(embs) == 1 else "clips",
                      dim=gw.cfg.speaker_embedding_dim,
                      details={"clips": len(embs), "seconds": round(sum(len(s) / sr for s, sr in decoded), 2)})
        gw.voices.add(voice, np.mean(embs, axis=0), wav_bytes(*decoded[0]))
    else:
        data = await emb_file.read()  # type: ignore[union-attr]
        if len(data) > lim.max_upload_bytes:
            raise RequestError("upload_too_large", "embedding file too large", 413)
        emb = parse_embedding_file(data, gw.cfg.speaker_embedding_dim)
        vid = VoiceStore.clip_id(owner, [emb.tobytes()])
        voice = Voice(id=vid, name=name, owner=owner, source="embedding", dim=len(emb))
        gw.voices.add(voice, emb)
    return JSONResponse(voice.public(), status_code=201)


async def blend_voices(request: Request) -> Response:
    """JSON {a, b, t, name}: SLERP between two voices' embeddings."""
    gw: Gateway = request.app.state.gateway
    owner = _owner(request)
    data = await read_json(request, 65536)
    t = data.get("t", 0.5)
    if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t <= 1:
        raise RequestError("bad_blend", "t must be a number in [0, 1]")
    if not all(isinstance(data.get(k), str) and data[k] for k in ("a", "b")):
        raise RequestError("bad_blend", "a blend needs two voices: 'a' and 'b' (ids or names)")
    a, b = gw.voices.get(data["a"], owner), gw.voices.get(data["b"], owner)
    assert a.embedding is not None and b.embedding is not None
    name = validate_name(str(data.get("name") or f"{a.name} + {b.name}")[:64])
    emb = slerp(a.embedding, b.embedding, float(t))
    vid = VoiceStore.clip_id(owner, [a.id.encode(), b.id.encode(), np.float64(t).tobytes()])
    voice = Voice(id=vid, name=name, owner=owner, source="blend", dim=len(emb),
                  details={"a": a.id, "b": b.id, "t": float(t)})
    gw.voices.add(voice, emb)
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
    if request.method == "GET":
        return JSONResponse(gw.voices.get(ref, owner).public())
    if request.method == "PATCH":
        data = await read_json(request, 4096)
        return JSONResponse(gw.voices.rename(ref, owner, str(data.get("name", ""))).public())
    v = gw.voices.delete(ref, owner)
    return JSONResponse({"deleted": v.id})


async def voice_embedding(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    v = gw.voices.get(request.path_params["voice"], _owner(request))
    buf = io.BytesIO()
    np.save(buf, np.asarray(v.embedding, dtype=np.float32))
    return Response(buf.getvalue(), media_type="application/octet-stream",
                    headers={"Content-Disposition": f'attachment; filename="{v.id}.npy"'})


async def voice_preview(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    v = gw.voices.get(request.path_params["voice"], _owner(request))
    data = gw.voices.preview_bytes(v)
    if data is None:
        raise RequestError("no_preview", "this voice has no reference audio", 404)
    return Response(data, media_type="audio/wav", headers={"Cache-Control": "private, max-age=3600"})
