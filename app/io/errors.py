"""Every error code the gateway itself answers with, defined once with its HTTP status, and `RequestError`,
the one exception every API raises for a refused request. The engine's codes (engine_busy, prompt_too_long,
internal, ...) are engine/contract/errors.py's `EngineError` and are not repeated here.

The HTTP layers answer `RequestError.status` (app/doors/speech.py `error_response`, the dialects' `errors_as`);
the WebSocket layers send `RequestError.code` in their dialect's shape (app/core/session.py `render_error`).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from engine.contract.errors import EngineError


class GatewayError(StrEnum):
    # requests and messages
    BAD_MESSAGE = "bad_message"  # a WebSocket message that is not one of the dialect's
    BAD_PARAMS = "bad_params"  # a field of a request out of its type or bounds
    BAD_TEXT = "bad_text"  # text with no UTF-8 form (a lone surrogate)
    BAD_JSON = "bad_json"  # an HTTP body that is not a JSON object
    BODY_TOO_LARGE = "body_too_large"
    EMPTY_TEXT = "empty_text"
    TEXT_TOO_LONG = "text_too_long"
    AUDIO_TOO_LONG = "audio_too_long"  # an HTTP request's audio past --max-request-audio-s
    UNSUPPORTED_FORMAT = "unsupported_format"  # an output format or rate no encoder offers
    NORMALIZATION_TIMEOUT = "normalization_timeout"
    # a streaming session's limits
    BUFFER_FULL = "buffer_full"
    TOO_MANY_UTTERANCES = "too_many_utterances"
    TOO_MANY_CONTEXTS = "too_many_contexts"
    TOO_MANY_SESSIONS = "too_many_sessions"
    # a gateway process holds --max-connections client connections: one waiting for its request head made room, or,
    # with none waiting, the newcomer is refused (app/io/http_protocol.py)
    TOO_MANY_CONNECTIONS = "too_many_connections"
    IDLE_TIMEOUT = "idle_timeout"
    # an idle session closed at the session limit to make room for a new one (app/core/gateway.py `idle_longest`)
    EVICTED_IDLE = "evicted_idle"
    CLIENT_STALLED = "client_stalled"  # counted only: the client reads nothing, so it is told nothing
    CLIENT_GONE = "client_gone"  # counted only: an HTTP client left before its audio began (its work is dropped)
    SHUTTING_DOWN = "shutting_down"  # a new stream while the server drains (a SIGTERM): retry elsewhere
    # who may call
    UNAUTHORIZED = "unauthorized"
    ORIGIN_NOT_ALLOWED = "origin_not_allowed"
    HOST_NOT_ALLOWED = "host_not_allowed"
    CORS_REFUSED = "cors_refused"
    # routes and request heads (app/server.py, app/io/http_protocol.py)
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    UPGRADE_REQUIRED = "upgrade_required"  # a plain HTTP request to a WebSocket endpoint
    REQUEST_TIMEOUT = "request_timeout"
    URI_TOO_LONG = "uri_too_long"
    HEADERS_TOO_LARGE = "headers_too_large"
    # clips and voices
    UPLOAD_TOO_LARGE = "upload_too_large"
    TOO_MANY_UPLOADS = "too_many_uploads"  # bodies read at once past --max-body-bytes-in-flight (app/io/bodies.py)
    TOO_MANY_ANSWERS = "too_many_answers"  # whole-file audio held past --max-whole-answer-bytes (app/doors/speech.py)
    BAD_UPLOAD = "bad_upload"
    CLIP_TOO_LONG = "clip_too_long"
    CLIP_TOO_SHORT = "clip_too_short"
    BAD_NAME = "bad_name"
    BAD_EMBEDDING = "bad_embedding"
    BAD_BLEND = "bad_blend"
    UNKNOWN_VOICE = "unknown_voice"
    NO_PREVIEW = "no_preview"
    TOO_MANY_VOICES = "too_many_voices"  # the key stores --max-voices-per-key voices already
    MISSING_SESSION = "missing_session"  # the reference's cached-speaker routes without X-TTS-Session-ID
    READ_ONLY = "read_only"
    FORBIDDEN = "forbidden"
    VOICE_STORE_UNAVAILABLE = "voice_store_unavailable"
    BAD_LEXICON = "bad_lexicon"  # a pronunciation dictionary that cannot be taken (a phoneme rule, bad PLS)
    UNKNOWN_LEXICON = "unknown_lexicon"
    UNSUPPORTED_TAG = "unsupported_tag"  # a style tag the server cannot apply (app/core/style_tags.py)
    # the dialects' own codes, as those services spell them
    ELEVENLABS_INVALID_OUTPUT_FORMAT = "invalid_output_format"
    ELEVENLABS_MAX_ACTIVE_CONVERSATIONS = "max_active_conversations"
    ELEVENLABS_VOICE_NOT_FOUND = "voice_not_found"
    DEEPGRAM_UNSUPPORTED_ENCODING = "UNSUPPORTED_ENCODING"
    DEEPGRAM_UNSUPPORTED_SAMPLE_RATE = "UNSUPPORTED_SAMPLE_RATE"
    DEEPGRAM_UNSUPPORTED_CONTAINER = "UNSUPPORTED_CONTAINER"
    DEEPGRAM_INVALID_QUERY_PARAMETER = "INVALID_QUERY_PARAMETER"
    DEEPGRAM_INVALID_MESSAGE = "INVALID_MESSAGE"

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS.get(self, 400)


_HTTP_STATUS = {
    GatewayError.BODY_TOO_LARGE: 413,
    GatewayError.TOO_MANY_SESSIONS: 429,
    GatewayError.TOO_MANY_CONNECTIONS: 503,
    GatewayError.UNAUTHORIZED: 401,
    GatewayError.ORIGIN_NOT_ALLOWED: 403,
    GatewayError.HOST_NOT_ALLOWED: 403,
    GatewayError.NOT_FOUND: 404,
    GatewayError.METHOD_NOT_ALLOWED: 405,
    GatewayError.UPGRADE_REQUIRED: 426,
    GatewayError.REQUEST_TIMEOUT: 408,
    GatewayError.URI_TOO_LONG: 414,
    GatewayError.HEADERS_TOO_LARGE: 431,
    GatewayError.UPLOAD_TOO_LARGE: 413,
    GatewayError.TOO_MANY_UPLOADS: 503,
    GatewayError.TOO_MANY_ANSWERS: 503,
    GatewayError.UNKNOWN_VOICE: 404,
    GatewayError.NO_PREVIEW: 404,
    GatewayError.TOO_MANY_VOICES: 409,
    GatewayError.READ_ONLY: 403,
    GatewayError.FORBIDDEN: 403,
    GatewayError.VOICE_STORE_UNAVAILABLE: 503,
    GatewayError.CLIENT_GONE: 499,
    GatewayError.SHUTTING_DOWN: 503,
    GatewayError.UNKNOWN_LEXICON: 404,
}


def http_status(code: str) -> int:
    """The HTTP status of a gateway or engine code (400 for any other: a dialect's own)."""
    for enum in (GatewayError, EngineError):
        try:
            return enum(code).http_status
        except ValueError:
            continue
    return 400


def error_body(code: str, message: str, status: int = 0) -> dict[str, Any]:
    """Our JSON error shape, {"error": {"code", "message"}}, built here alone: every HTTP answer of ours (the routes',
    Starlette's 404 and 405, the request head's refusals in app/io/http_protocol.py, a WebSocket's HTTP denial).
    `status` is unused: the signature of a SessionRoute's / SpeechRoute's refusal body (app/server.py), which a
    dialect's shape may need."""
    return {"error": {"code": code, "message": message}}


class RequestError(ValueError):
    """A refused request: its code (a GatewayError or EngineError member) and the HTTP status that code maps
    to, unless `status` says otherwise (a 413 for an upload the form parser refused, a 507 for a full disk);
    `headers`: what its HTTP answer carries besides (`Retry-After` of a refusal at the door)."""

    def __init__(
        self, code: str, message: str, status: int | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.code: str = code
        self.status: int = http_status(code) if status is None else status
        self.headers: dict[str, str] = headers or {}
        # in zonos_errors_total already: an utterance's error, counted by its pipeline, that its HTTP request's answer
        # then carries (Metrics.count_error counts each error once)
        self.counted = False
