"""Every error the engine (or the stream to it) reports for a request: the one place its codes are defined,
with the HTTP status each maps to. Over the WebSocket the code itself is what a client sees."""

from __future__ import annotations

from enum import StrEnum


class EngineError(StrEnum):
    PROMPT_TOO_LONG = "prompt_too_long"  # the prompt (after text normalization) does not fit the context
    BAD_REQUEST = "bad_request"  # a record outside the contract's bounds
    BAD_VOICE = "bad_voice"  # a speaker embedding (or an emotion vector) of the wrong size
    BAD_AUDIO = "bad_audio"  # a clip the speaker encoder cannot use
    QUEUE_FULL = "queue_full"
    CANNOT_FIT = "cannot_fit"  # the request needs more than this engine has at all (guidance's second slot)
    ENGINE_BUSY = "engine_busy"  # realtime admission: no room for another live stream within the wait
    ENGINE_RESTARTED = "engine_restarted"  # the engine process died; every request in flight ends with this
    ENGINE_START_FAILED = "engine_start_failed"
    SHUTDOWN = "shutdown"
    BACKPRESSURE = "backpressure"  # the gateway did not read the stream's audio: the engine cancelled it
    SLOW_CONSUMER = "slow_consumer"  # the client did not read it: the gateway cancelled it
    INTERNAL = "internal"  # a bug: the request fails, the engine lives

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS[self]

    @classmethod
    def of(cls, code: object) -> EngineError:
        """The member for a code read off a record; an unknown one is `internal` (a bug)."""
        try:
            return cls(str(code))
        except ValueError:
            return cls.INTERNAL


_HTTP_STATUS = {
    EngineError.PROMPT_TOO_LONG: 400,
    EngineError.BAD_REQUEST: 400,
    EngineError.BAD_VOICE: 400,
    EngineError.BAD_AUDIO: 400,
    EngineError.CANNOT_FIT: 400,
    EngineError.QUEUE_FULL: 503,
    EngineError.ENGINE_BUSY: 503,
    EngineError.ENGINE_RESTARTED: 503,
    EngineError.ENGINE_START_FAILED: 503,
    EngineError.SHUTDOWN: 503,
    EngineError.BACKPRESSURE: 503,
    EngineError.SLOW_CONSUMER: 503,
    EngineError.INTERNAL: 500,
}
