"""What the dialects' HTTP routes share (ElevenLabs' `/v1/text-to-speech/{voice}[/stream]`, Cartesia's
`/tts/bytes` and `/tts/sse`, Deepgram's `POST /v1/speak`): one request is one text, spoken through the
utterance pipeline as /v1/audio/speech is (app/core/pipeline.speak: every sentence in order, the next one
generating while the current one streams; the client going away stops the GPU work), its audio sent as it is
generated, and every refusal in the vendor's own error shape.

The first sentence is started before the answer begins, so a refused request (bad voice, text too long for
the engine) still gets its 4xx; an error after the audio began cuts the response off (or, on an event
stream, is an error event), as on /v1/audio/speech.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.core.gateway import Gateway
from app.doors.speech import read_json
from app.io.auth import require_key
from app.io.errors import RequestError

ErrorBody = Callable[[str, str, int], dict[str, Any]]  # (code, message, status) -> the vendor's error body


# ---- requests ---------------------------------------------------------------------------------------------
def errors_as(
    body: ErrorBody,
) -> Callable[[Callable[[Request], Awaitable[Response]]], Callable[[Request], Awaitable[Response]]]:
    """A route whose RequestErrors answer in the vendor's error shape (and status) instead of ours."""

    def wrap(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        @functools.wraps(endpoint)
        async def route(request: Request) -> Response:
            try:
                return await endpoint(request)
            except RequestError as e:
                gw: Gateway = request.app.state.gateway
                gw.metrics.count_error(e)
                return JSONResponse(body(e.code, str(e), e.status), status_code=e.status, headers=e.headers)

        return route

    return wrap


async def open_request(request: Request) -> tuple[Gateway, str, dict[str, Any]]:
    """The caller's key (every dialect's header: `xi-api-key`, `X-API-Key`, `Authorization: Token|Bearer`,
    `?api_key=`), its owner id, and the JSON body."""
    gw: Gateway = request.app.state.gateway
    key = require_key(request)
    await gw.admit()  # before the body is read: a refused request costs no parsing
    owner = gw.owner_of(key)
    data = await read_json(request, gw.settings.limits.max_json_body_bytes)
    return gw, owner, data
