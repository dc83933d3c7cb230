"""Gateway settings: every limit configurable, with defaults a public deployment can live with."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from engine.contract.settings import EngineSettings, WeightSources


@dataclass
class Limits:
    max_text_chars: int = 2000  # one utterance (one engine request)
    max_buffer_chars: int = 10_000  # text buffered in one WebSocket session, not yet spoken
    max_sessions: int = 256  # concurrent WebSocket sessions
    max_pending_utterances: int = 32  # queued utterances per session
    max_inflight_per_session: int = 2  # utterances generating at once per session (current + next)
    max_upload_bytes: int = 10 << 20
    max_clip_seconds: float = 60.0
    min_clip_seconds: float = 0.5
    max_ws_message_bytes: int = 8 << 20  # a session.config may carry a base64 clip
    # a socket with no message this long is closed; LiveKit's plugins keep pooled sockets up to 3600 s, and a
    # socket they reuse must still be open (pings keep the connection itself alive meanwhile)
    idle_timeout_s: float = 3600.0
    send_timeout_s: float = 30.0  # one WebSocket send that makes no progress this long: the client is gone
    # WebSocket keepalive (uvicorn's): a ping this long after the handshake and after each pong; a client that
    # has not answered one within as long again is disconnected (ends sessions whose client vanished silently)
    ws_ping_interval_s: float = 20.0
    head_timeout_s: float = 30.0  # a request head (line and headers) not complete this long: 408, closed
    # The door (app/core/admission.py): a new stream predicted to wait longer than this for an engine is
    # refused at once (503, Retry-After) instead of queued; 0: no limit at the door (the engine alone)
    max_queue_ms: float = 250.0
    # room held for an admitted session's next utterance while it spoke within this long (or was just
    # admitted)
    conversation_hold_s: float = 10.0
    max_frames: int = 3000  # per utterance (about 35 s of audio)
    max_buffered_audio_s: float = 60.0  # generated but unread audio per request before slow_consumer
    max_http_chars: int = 4096  # /v1/audio/speech input, as OpenAI
    # Text normalization (app/core/normalization.py): the CPU one utterance's text may take in its worker before
    # it fails with normalization_timeout (a typical sentence takes 20-60 ms), and the texts a worker
    # normalizes before it is replaced (its memory given back).
    normalization_cpu_s: float = 5.0
    normalization_max_tasks: int = 500
    # Kernel send buffer of each client socket (SO_SNDBUF), 0 = the OS's autotuning (up to tcp_wmem's
    # max, 4 MiB by default: ~45 s of 44.1 kHz s16 audio that a non-reading client parks in the kernel
    # before the gateway sees backpressure and max_buffered_audio_s starts counting).
    tcp_send_buffer_bytes: int = 0


@dataclass
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8000
    weights: WeightSources = field(default_factory=WeightSources)
    engine: EngineSettings = field(default_factory=EngineSettings)
    # --devices: one engine process per entry (cpu, cuda:N; repeats allowed), placed by headroom
    # (docs/scaling.md). Empty: one engine on engine.device (--device).
    devices: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)
    data_dir: Path = field(default_factory=lambda: Path(os.environ.get("ZONOS_DATA_DIR", "data")))
    default_voices_dir: Path | None = None
    emotion_directions_dir: Path | None = None  # --emotion-directions-dir (engine/frontend/emotion.py folder format)
    shared_voices: bool = False  # --shared-voices: other gateways use the same voice folder (docs/scaling.md)
    api_keys: tuple[str, ...] = ()  # empty: no auth
    cors_origins: tuple[str, ...] = ()
    # --allowed-host: Host names served without an API key besides the loopback ones ("*": any); the host
    # rule (app/io/auth.py, docs/reliability.md "Host rule")
    allowed_hosts: tuple[str, ...] = ()
    text_normalization: bool = True
    normalization_workers: int = 0  # text normalization worker processes; 0: one per CPU (at most 16)
    log_level: str = "INFO"
    # --workers: gateway processes in front of the engines (app/workers.py); 0: one per four CPUs, at most 8
    workers: int = 0

    @property
    def voices_dir(self) -> Path:
        return self.data_dir / "voices"

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)


def loopback(host: str) -> bool:
    """A loopback name or address: localhost, 127.0.0.0/8, ::1 (also written [::1])."""
    host = host.strip().lower().removeprefix("[").removesuffix("]")
    if host in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
