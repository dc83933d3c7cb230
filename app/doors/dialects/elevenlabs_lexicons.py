"""ElevenLabs' pronunciation-dictionary routes (app/voices/lexicons.py holds the dictionaries):

* `POST /v1/pronunciation-dictionaries/add-from-file`: multipart `name`, `file` (a W3C PLS lexicon),
  `description`;
* `POST /v1/pronunciation-dictionaries/add-from-rules`: JSON `{name, rules: [{type: "alias",
  string_to_replace, alias}], description}`;
* `GET /v1/pronunciation-dictionaries`, `GET` and `DELETE /v1/pronunciation-dictionaries/{id}`.

A phoneme rule is refused with 400 (ZONOS2 reads text). The store is read and written in a worker thread: a
dictionary of thousands of rules is MB of JSON (a listing reads only metadata).
A dictionary is used through `pronunciation_dictionary_locators` on the speech routes and sockets, Cartesia's
`pronunciation_dict_id`, or our session.config `lexicon`.
"""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from app.core.gateway import Gateway
from app.doors.dialects.elevenlabs import refusal_body as elevenlabs_error
from app.doors.dialects.http import errors_as
from app.doors.speech import read_json
from app.doors.voices import FORM_OVERHEAD
from app.io.auth import require_key
from app.io.bodies import admit_body
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.voices.lexicons import rules_from_json, rules_from_pls

MAX_PLS_BYTES = 1 << 20


def _owner(request: Request) -> tuple[Gateway, str]:
    gw: Gateway = request.app.state.gateway
    return gw, gw.owner_of(require_key(request))


@errors_as(elevenlabs_error)
async def add_from_file(request: Request) -> Response:
    gw, owner = _owner(request)
    admit_body(request, MAX_PLS_BYTES + FORM_OVERHEAD)
    try:
        async with request.form(max_files=1, max_fields=8, max_part_size=MAX_PLS_BYTES) as form:
            upload = form.get("file")
            if upload is None or isinstance(upload, str):
                raise RequestError(G.BAD_LEXICON, "file must be a PLS lexicon file")
            data = await upload.read(MAX_PLS_BYTES + 1)
            name, description = form.get("name"), form.get("description")
    except RequestError:
        raise
    except ClientDisconnect:  # gone mid-body: no bad upload (nobody reads the answer)
        raise RequestError(G.CLIENT_GONE, "the client left before its upload was read") from None
    except Exception as e:  # a malformed multipart body
        raise RequestError(G.BAD_UPLOAD, f"a multipart form with name and file is expected: {str(e)[:120]}") from None
    if len(data) > MAX_PLS_BYTES:
        raise RequestError(G.UPLOAD_TOO_LARGE, f"a lexicon file is at most {MAX_PLS_BYTES} bytes")
    lex = await asyncio.to_thread(lambda: gw.lexicons.add(owner, name, rules_from_pls(data), description))
    return JSONResponse(lex.public())


@errors_as(elevenlabs_error)
async def add_from_rules(request: Request) -> Response:
    gw, owner = _owner(request)
    data = await read_json(request, MAX_PLS_BYTES)
    # 5000 rules are checked in ~15 ms: in the worker thread with the store's write, not on the event loop
    lex = await asyncio.to_thread(
        lambda: gw.lexicons.add(owner, data.get("name"), rules_from_json(data.get("rules")), data.get("description"))
    )
    return JSONResponse(lex.public())


@errors_as(elevenlabs_error)
async def list_dictionaries(request: Request) -> Response:
    gw, owner = _owner(request)
    return JSONResponse(
        {
            "pronunciation_dictionaries": [x.public() for x in await asyncio.to_thread(gw.lexicons.list, owner)],
            "has_more": False,
            "next_cursor": None,
        }
    )


@errors_as(elevenlabs_error)
async def dictionary(request: Request) -> Response:
    gw, owner = _owner(request)
    lid = request.path_params["dictionary_id"]
    if request.method == "DELETE":
        return JSONResponse({"deleted": (await asyncio.to_thread(gw.lexicons.delete, lid, owner)).id})
    lex = await asyncio.to_thread(gw.lexicons.get, lid, owner)
    return JSONResponse(
        lex.public()
        | {"rules": [{"type": "alias", "string_to_replace": r.grapheme, "alias": r.alias} for r in lex.rules]}
    )
