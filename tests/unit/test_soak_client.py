"""bench/soak.py's client: a WebSocket upgrade the door refuses (503, Retry-After) is a refused session, counted,
not a crash of the soak (it was: websockets' InvalidStatus ended the run at the server's first refusal)."""

from __future__ import annotations

import asyncio
import http
import sys
from pathlib import Path

from websockets.asyncio.server import serve

from tests.conftest import loopback_socket

ROOT = Path(__file__).resolve().parents[2]


def _soak_module():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import soak
    finally:
        sys.path.pop(0)
    return soak


def test_a_refused_upgrade_is_a_refused_session():
    soak = _soak_module()

    def refuse(connection, request):
        response = connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, "engine_busy\n")
        response.headers["Retry-After"] = "0.1"
        return response

    async def run() -> soak.Stats:
        async def never(ws) -> None:  # no upgrade is ever accepted
            raise AssertionError("upgraded")

        with loopback_socket() as sock:
            async with serve(never, sock=sock, process_request=refuse):
                port = sock.getsockname()[1]
                s = soak.Soak(soak.parse_args(["--url", f"http://127.0.0.1:{port}", "--server-pid", "1"]))
                for _ in range(3):
                    await s.session(0)
                return s.st

    st = asyncio.run(run())
    assert st.sessions_refused == 3 and st.sessions_opened == 0 and not st.unexpected
