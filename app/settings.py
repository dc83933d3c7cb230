"""Gateway settings: every limit configurable, with defaults a public deployment can live with."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from engine.contract.flags import check, flag
from engine.contract.settings import EngineSettings, WeightSources, usable_cpus

_DAY = 86_400.0
_GIB = 1 << 30
# Text normalization workers by default: at most this many (each holds ~450 MB of grammars, and 16 normalize
# ~500 typical sentences a second, more than a host's streams ask for)
MAX_DEFAULT_NORMALIZATION_WORKERS = 16
MAX_WORKERS = 64  # --workers: gateway processes
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")  # --log-level: logging's and uvicorn's names alike
# Fixed companions of two limits below (their rules: app/io/bodies.py, app/core/door_policy.py `Conversation`):
SMALL_BODY = 64 << 10  # bytes: a request body this small is never refused by --max-body-bytes-in-flight (nor counted)
# seconds of held room each second of audio a session plays earns it, up to --conversation-hold-s: a conversation
# that speaks a third of the time keeps its room across its pauses; tiny utterances earn next to nothing
HOLD_PER_AUDIO_S = 2.0
# --refusal-storm-per-s's default: a client waiting its Retry-After (>= 1 s) never makes a process refuse this fast,
# while a few clients retrying at once make it refuse thousands of times a second (app/core/door_policy.py RefusalPace)
STORM_REFUSALS_PER_S = 100.0
# --refusal-budget-per-s's default: one process's refusals a second (~0.1 ms of CPU each: a quarter of a core) past
# which the door holds them longer (RefusalPace)
REFUSAL_BUDGET_PER_S = 2500.0
# The longest a refusal is held however hard the storm (or --refusal-hold-ms, if longer): a refused client is answered
# within the 50 ms it may expect to wait before it tries another replica (a storm's connect and loop lag add ~15 ms)
REFUSAL_HOLD_MAX_S = 0.03
# At --max-sessions, a newcomer takes the place of this process's session idle longest, if one has been idle (no
# message, nothing speaking, no turn open) this long: longer than a live conversation's pauses between turns (a user's
# reply, an LLM's answer), so only a pooled or forgotten socket is taken; a pooled client reconnects at its next turn.
# Without it, a client holding --max-sessions idle sockets locked every other client out for --idle-timeout (1 h).
EVICT_IDLE_AFTER_S = 30.0


def max_normalization_workers() -> int:
    """--normalization-workers' ceiling: one per usable CPU (at least the default's ceiling); each worker is a
    process holding ~450 MB, so thousands would exhaust the host's memory."""
    return max(usable_cpus(), MAX_DEFAULT_NORMALIZATION_WORKERS)


def _limit(help: str, hi: float, *, zero_ok: bool = False, aliases: tuple[str, ...] = ()) -> dict:
    """A Limits flag: above 0 unless `zero_ok`, at most `hi`."""
    return flag(help, lo=0, hi=hi, lo_open=not zero_ok, aliases=aliases)


@dataclass
class Limits:
    """Every field is a flag named after it (max_text_chars -> --max-text-chars; docs/reliability.md)."""

    max_text_chars: int = field(
        default=2000,
        metadata=_limit("characters of one utterance (sentences are cut to this many UTF-8 bytes)", 1_000_000),
    )
    max_buffer_chars: int = field(
        default=10_000, metadata=_limit("text buffered in one WebSocket session, not yet spoken", 10_000_000)
    )
    max_sessions: int = field(default=256, metadata=_limit("concurrent WebSocket sessions", 1_000_000))
    # One API key's share of them, every gateway process's together: without it one key (a tenant's runaway client,
    # or one that keeps its sockets busy with a message a minute) could hold every session of the server
    max_sessions_per_key: int = field(
        default=0,
        metadata=_limit(
            "concurrent WebSocket sessions of one API key (0: no limit but --max-sessions; without API keys every "
            "client is one, and --max-sessions applies)",
            1_000_000,
            zero_ok=True,
        ),
    )
    max_pending_utterances: int = field(
        default=32,
        metadata=_limit(
            "queued utterances per session (each a sentence becomes: its text between breaks and tags, each break)",
            100_000,
        ),
    )
    max_inflight_per_session: int = field(
        default=2, metadata=_limit("utterances generating at once per session (current + next)", 1024)
    )
    max_upload_bytes: int = field(default=10 << 20, metadata=_limit("bytes of an uploaded voice clip", _GIB))
    # every HTTP request body being read and decoded at once, per gateway process (app/io/bodies.py): a body is in
    # memory several times while it is handled (the bytes, the parsed text, the decoded clip)
    max_body_bytes_in_flight: int = field(
        default=64 << 20,
        metadata=_limit(
            "bytes of HTTP request bodies (voice uploads, JSON with base64 clips) one gateway process reads and "
            "decodes at once; a request past it is refused before its body is read, 503 too_many_uploads with "
            f"Retry-After (a body of at most {SMALL_BODY >> 10} KiB always passes; one larger than this bound is read "
            "alone)",
            64 * _GIB,
        ),
    )
    max_clip_seconds: float = field(default=60.0, metadata=_limit("seconds of a voice clip", 3600.0))
    max_voices_per_key: int = field(
        default=1000,
        metadata=_limit(
            "voices one API key (or, without keys, the server's public library) may store (0: no limit)",
            10_000_000,
            zero_ok=True,
        ),
    )
    min_clip_seconds: float = field(
        default=0.5, metadata=_limit("seconds a voice clip needs at least (0: any)", 3600.0, zero_ok=True)
    )
    max_ws_message_bytes: int = field(
        default=8 << 20,
        metadata=_limit("bytes of one WebSocket message (a session.config may carry a base64 clip)", _GIB),
    )
    # a socket with no message this long is closed; LiveKit's plugins keep pooled sockets up to 3600 s, and a
    # socket they reuse must still be open (pings keep the connection itself alive meanwhile)
    idle_timeout_s: float = field(
        default=3600.0,
        metadata=_limit(
            "seconds a WebSocket may go without a message before it is closed", _DAY, aliases=("--idle-timeout",)
        ),
    )
    evict_idle_after_s: float = field(
        default=EVICT_IDLE_AFTER_S,
        metadata=_limit(
            "seconds a WebSocket session must have been idle (no message, nothing speaking, no turn open) before a "
            "new session at --max-sessions may take its place (the one idle longest is closed, evicted_idle)",
            _DAY,
            aliases=("--evict-idle-after",),
        ),
    )
    send_timeout_s: float = field(
        default=30.0,
        metadata=_limit(
            "seconds one send (WebSocket message, HTTP answer) may make no progress before the client counts as gone",
            _DAY,
            aliases=("--send-timeout",),
        ),
    )
    # WebSocket keepalive (uvicorn's): a ping this long after the handshake and after each pong; a client that
    # has not answered one within --ws-ping-timeout is disconnected (ends sessions whose client vanished silently)
    ws_ping_interval_s: float = field(
        default=20.0,
        metadata=_limit(
            "seconds between WebSocket keepalive pings (a client that does not answer one within --ws-ping-timeout "
            "is disconnected)",
            _DAY,
            aliases=("--ws-ping-interval",),
        ),
    )
    # a pooled client socket (LiveKit's cartesia and deepgram plugins: aiohttp, which answers a ping only when it
    # reads, and a pooled socket is not read between turns) answers its pings at its next turn: the deadline for a
    # pong is the idle timeout's, so that such a socket lives as long as an idle one may
    ws_ping_timeout_s: float = field(
        default=0.0,
        metadata=_limit(
            "seconds a WebSocket client may take to answer a keepalive ping before it is disconnected (0: as long "
            "as --idle-timeout)",
            _DAY,
            zero_ok=True,
            aliases=("--ws-ping-timeout",),
        ),
    )
    # A SIGTERM (a rolling deploy, docs/reliability.md "Shutting down") first drains: new streams are refused (503,
    # /readyz 503), and each session is closed (1012) once it is quiet; the rest is cut after this long
    drain_timeout_s: float = field(
        default=20.0,
        metadata=_limit(
            "seconds a SIGTERM waits for sessions and requests in progress to finish before they are cut (0: cut "
            "at once)",
            3600.0,
            zero_ok=True,
        ),
    )
    head_timeout_s: float = field(
        default=30.0, metadata=_limit("seconds a request head (line and headers) may take before 408", _DAY)
    )
    # Every client connection holds a file descriptor until it closes, one that sends nothing for --head-timeout-s:
    # a client that kept ~20,000 of them open (reopening those closed) took every descriptor of a gateway process,
    # which then closed each new connection unanswered, /healthz included (app/io/http_protocol.py `connection_cap`)
    max_connections: int = field(
        default=0,
        metadata=_limit(
            "client connections one gateway process holds open at once (0: its open-file limit less a reserve for "
            "its own files, at most 32768); past it the connection that has waited longest for a request head is "
            "closed to make room, and with none waiting the newcomer gets 503 too_many_connections",
            10_000_000,
            zero_ok=True,
        ),
    )
    # The door (app/core/door_policy.py): a new stream predicted to wait longer than this for an engine is
    # refused at once (503, Retry-After) instead of queued
    max_queue_ms: float = field(
        default=250.0,
        metadata=_limit(
            "a new stream predicted to wait longer than this (ms) for an engine is refused at once (503, "
            "Retry-After); 0: no limit at the door",
            60_000.0,
            zero_ok=True,
        ),
    )
    # ... and one whose first audio (that wait plus the engines' recent start -> first audio) is predicted past
    # this: under a storm the queue holds only what can still start in time
    first_audio_budget_ms: float = field(
        default=250.0,
        metadata=_limit(
            "a new stream that must wait for an engine is refused at once (503, Retry-After) when its first "
            "audio is predicted later than this (ms: its wait plus the engines' recent first audio); 0: no budget",
            60_000.0,
            zero_ok=True,
        ),
    )
    # ... and under a retry storm (app/core/door_policy.py `RefusalPace`) the door answers its refusals after a hold
    refusal_hold_ms: float = field(
        default=20.0,
        metadata=_limit(
            "under a storm of refused clients that retry at once, the door answers each refusal after up to this "
            "long (ms), so that such a client retries tens of times a second instead of hundreds; 0: at once",
            1000.0,
            zero_ok=True,
        ),
    )
    refusal_storm_per_s: float = field(
        default=STORM_REFUSALS_PER_S,
        metadata=_limit(
            "refusals a second (one gateway process's, over the last quarter of a second) from which the door holds "
            "each refusal (--refusal-hold-ms); 0: every refusal is held",
            1_000_000.0,
            zero_ok=True,
        ),
    )
    refusal_budget_per_s: float = field(
        default=REFUSAL_BUDGET_PER_S,
        metadata=_limit(
            "refusals a second one gateway process answers at --refusal-hold-ms under a storm; while more clients "
            "retry than that, each refusal is held longer "
            f"(up to {REFUSAL_HOLD_MAX_S * 1e3:g} ms), so that refusals take no more of the CPU "
            "that the admitted streams' audio needs; 0: never longer than --refusal-hold-ms",
            1_000_000.0,
            zero_ok=True,
        ),
    )
    conversation_hold_s: float = field(
        default=10.0,
        metadata=_limit(
            "seconds room is held for an admitted session's next utterance after its audio has played (0: no "
            f"hold); a session earns it back at {HOLD_PER_AUDIO_S:g} s per second of audio it plays, never past this",
            3600.0,
            zero_ok=True,
        ),
    )
    max_frames: int = field(default=3000, metadata=_limit("frames per utterance (about 35 s of audio)", 1 << 20))
    max_buffered_audio_s: float = field(
        default=60.0,
        metadata=_limit(
            "seconds of generated but unread audio per request before slow_consumer",
            3600.0,
            aliases=("--max-buffered-audio",),
        ),
    )
    max_http_chars: int = field(
        default=4096, metadata=_limit("characters of one HTTP speech request's text (every speech route)", 1_000_000)
    )
    # an HTTP request speaks its whole text, however long each sentence runs (ignore_eos: to max_frames); this
    # bounds the decode slot and the client's download one request can take (4096 characters of speech: ~5 min)
    max_request_audio_s: float = field(
        default=900.0, metadata=_limit("seconds of audio one HTTP speech request may produce", _DAY)
    )
    # a whole-file HTTP answer (WAV, FLAC, /tts/generate stream:false) holds its audio until it is complete, up to
    # --max-request-audio-s of it: this bounds them all together (app/doors/speech.py AnswerHold)
    max_whole_answer_bytes: int = field(
        default=512 << 20,
        metadata=_limit(
            "bytes of audio the whole-file HTTP answers of one gateway process hold at once, each counted twice (the "
            "parts and the joined file); an answer past it gets 503 too_many_answers with Retry-After (one alone "
            "always passes)",
            64 * _GIB,
        ),
    )
    # ElevenLabs request stitching (app/core/stitching.py): what each owner's finished text-to-speech requests
    # leave in the data dir for a later request's `previous_request_ids`
    stitch_requests: int = field(
        default=10,
        metadata=_limit(
            "ElevenLabs HTTP requests per API key whose frames are kept for previous_request_ids (0: stitching off)",
            10_000,
            zero_ok=True,
        ),
    )
    stitch_ttl_s: float = field(
        default=600.0, metadata=_limit("seconds a request's kept frames can be continued (ElevenLabs: 2 h)", _DAY)
    )
    stitch_bytes: int = field(
        default=4 << 20, metadata=_limit("bytes of kept frames on disk per API key (the oldest go first)", _GIB)
    )
    # Text normalization (app/core/normalization.py): the CPU one utterance's text may take in its worker before
    # it fails with normalization_timeout (a typical sentence takes 20-60 ms), and the texts a worker
    # normalizes before it is replaced (its memory given back).
    normalization_cpu_s: float = field(
        default=5.0, metadata=_limit("CPU seconds one text may take in its normalization worker", 3600.0)
    )
    normalization_max_tasks: int = field(
        default=500,
        metadata=_limit("texts a normalization worker handles before it is replaced (0: never)", 1 << 30, zero_ok=True),
    )
    # Kernel send buffer of each client socket (SO_SNDBUF), 0 = the OS's autotuning (up to tcp_wmem's
    # max, 4 MiB by default: ~45 s of 44.1 kHz s16 audio that a non-reading client parks in the kernel
    # before the gateway sees backpressure and max_buffered_audio_s starts counting).
    tcp_send_buffer_bytes: int = field(
        default=0, metadata=_limit("SO_SNDBUF of each client socket (0: the OS's autotuning)", _GIB, zero_ok=True)
    )

    def __post_init__(self) -> None:
        check(self)

    @property
    def max_json_body_bytes(self) -> int:
        """A JSON request body that may carry a base64 clip (the speech routes' speaker fields, POST /tts/speakers):
        twice --max-upload-bytes (base64 is 4/3 of the clip)."""
        return 2 * self.max_upload_bytes


@dataclass
class GatewaySettings:
    """The flag fields here, in Limits, EngineSettings and WeightSources are `python -m app`'s flags."""

    host: str = field(default="127.0.0.1", metadata=flag("address to bind"))
    port: int = field(default=8000, metadata=flag("port to bind (0: any free one)", lo=0, hi=65535))
    weights: WeightSources = field(default_factory=WeightSources)
    engine: EngineSettings = field(default_factory=EngineSettings)
    # --devices: one engine process per entry (cpu, cuda:N; repeats allowed), placed by headroom
    # (docs/scaling.md). Empty: one engine on engine.device (--device).
    devices: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)
    data_dir: Path = field(
        default_factory=lambda: Path(os.environ.get("ZONOS_DATA_DIR", "data")),
        metadata=flag("voices are kept here (env ZONOS_DATA_DIR)"),
    )
    default_voices_dir: Path | None = field(
        default=None, metadata=flag("folder of clips / .npy embeddings offered to everyone")
    )
    emotion_directions_dir: Path | None = field(
        default=None,
        metadata=flag(
            "emotion directions in the reference's emotion_directions/ format (manifest.json, calibration.json, "
            "NAME.npy): the emotion_* request fields"
        ),
    )
    shared_voices: bool = field(
        default=False,
        metadata=flag(
            "other gateways use the same --data-dir (a shared folder: Ray Serve replicas, several hosts): see "
            "their voices; docs/scaling.md"
        ),
    )
    api_keys: tuple[str, ...] = field(
        default=(),
        metadata=flag("require this key (repeatable); env ZONOS_API_KEYS=k1,k2", name="api-key", metavar="KEY"),
    )  # empty: no auth
    cors_origins: tuple[str, ...] = field(
        default=(), metadata=flag("allowed browser origin (repeatable)", name="cors-origin", metavar="ORIGIN")
    )
    # the host rule (app/io/auth.py, docs/reliability.md "Host rule")
    allowed_hosts: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "without an API key, serve this Host name too besides the loopback ones (repeatable; '*': any); "
            "docs/reliability.md, Host rule",
            name="allowed-host",
            metavar="NAME",
        ),
    )
    text_normalization: bool = field(
        default=True,
        metadata=flag("numbers, dates, currency... read as words (NeMo grammars, if installed); default on"),
    )
    normalization_workers: int = field(
        default=0,
        metadata=flag(
            f"worker processes that normalize text (default 0: one per CPU this process may use, at most "
            f"{MAX_DEFAULT_NORMALIZATION_WORKERS})",
            lo=0,
            hi=max_normalization_workers,
            metavar="N",
        ),
    )
    normalization_languages: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "a language whose grammars every text-normalization worker loads at start, besides English "
            "(repeatable, e.g. fr_fr). A worker loads any other on its first text (up to ~12 s; the first compile "
            "on a machine takes minutes); with one worker such texts are spoken as written instead "
            "(docs/reliability.md)",
            name="normalization-language",
            metavar="CODE",
        ),
    )
    log_level: str = field(
        default_factory=lambda: os.environ.get("LOG_LEVEL", "INFO").upper(),
        metadata=flag(f"{', '.join(LOG_LEVELS)} (env LOG_LEVEL)"),
    )
    workers: int = field(
        default=0,
        metadata=flag(
            "gateway processes on the one port, in front of the engines (default 0: one per four CPUs, at most 8; "
            "docs/architecture.md)",
            lo=0,
            hi=MAX_WORKERS,
            metavar="N",
        ),
    )

    def __post_init__(self) -> None:
        check(self)
        # logging and uvicorn refuse another name, with a traceback at start (logging.basicConfig's ValueError)
        if not isinstance(self.log_level, str) or self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(
                f"--log-level (or LOG_LEVEL) must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            )
        self.log_level = self.log_level.upper()
        # an empty key (`--api-key "$KEY"` with KEY unset) turned auth on with a key no client can send: every request
        # 401, and a non-loopback bind allowed as if keyed
        if any(not key for key in self.api_keys):
            raise ValueError("--api-key must not be empty (no client can send an empty key)")
        from engine.frontend.textnorm import normalize_language  # (its NeMo is imported only when it normalizes)

        try:
            self.normalization_languages = tuple(normalize_language(c) for c in self.normalization_languages)
        except ValueError as e:
            raise ValueError(f"--normalization-language: {e}") from None

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
