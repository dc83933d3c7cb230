"""Optional API keys: `Authorization: Bearer KEY`, `X-API-Key: KEY`, or `?api_key=KEY` (browsers)."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from starlette.requests import Request

from app.synthesis import RequestError


def api_key_from(headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return headers.get("x-api-key") or query.get("api_key") or None


def key_ok(key: str | None, keys: tuple[str, ...]) -> bool:
    if not keys:
        return True
    return key is not None and any(hmac.compare_digest(key, k) for k in keys)


def require_key(request: Request) -> str | None:
    """The caller's key (None without auth); raises 401 when auth is on and the key is wrong."""
    keys = request.app.state.gateway.settings.api_keys
    key = api_key_from(request.headers, request.query_params)
    if not key_ok(key, keys):
        raise RequestError("unauthorized", "missing or wrong API key", 401)
    return key if keys else None
