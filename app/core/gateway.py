"""The gateway's shared state and the one path every API takes to the engine."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import io
import logging
import os
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import soundfile as sf
import soxr

from app.core.continuation import Chain, Link
from app.core.door_policy import Conversation, Conversations, Decision, RefusalPace, decide
from app.core.emotion import check_emotion, emotion_directions
from app.core.engine_client import (
    AttachedEngineClient,
    ControlLink,
    EngineClient,
    EngineRefused,
    EngineUnavailable,
    Event,
    Stream,
)
from app.core.engine_pool import EnginePool
from app.core.metrics import Metrics
from app.core.normalization import NormalizationPool, default_workers
from app.core.options import SynthesisOptions
from app.core.prompts import PromptFactory
from app.core.shared import HELD, Places, SessionCount
from app.core.stats import summed_stats
from app.core.stitching import StitchStore, model_identity
from app.core.text_buffer import split_to_budget, utf8_len
from app.io.bodies import BodyBudget
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.settings import GatewaySettings
from app.voices.lexicons import MAX_RULES, Aliases, LexiconStore, apply_rules, rules_from_json
from app.voices.library import AUDIO_SUFFIXES, INLINE_HASH, MAX_NAME, Voice, VoiceStore, parse_embedding_file
from engine.contract import records as m
from engine.contract.constants import HOP
from engine.contract.errors import EngineError as E
from engine.contract.rings import RecordTooLarge
from engine.contract.settings import EngineSettings
from engine.frontend.audio import AudioDecodeError, ClipTooLong, decode_audio
from engine.frontend.config import Zonos2Config, preset_params

MAX_LEXICON_ITEMS = 64  # dictionaries and inline rules one request names
METRICS_REFRESH_S = 1.0  # several gateway processes: how often each writes its gauges for the others
log = logging.getLogger("gateway")

CLIP_CACHE = 256  # embeddings of recent request/session clips kept (8 KiB each)
PREVIEW_S = 10.0  # of a voice's first clip kept as its preview
PREVIEW_MAX_RATE = 48000  # Hz: a preview of a clip at a higher rate is resampled to it
DOOR_MEMO_S = 0.005  # a refusal at the door stands this long before the door decides again


class LiveSession(Protocol):
    """A streaming session, as the gateway sees it (app/core/session.py)."""

    owner: str
    places: Places  # what it holds in the session counts (app/doors/handshake.py)
    conversation: Conversation  # the room held for its next utterance (the door counts it)

    def drain(self) -> None: ...
    def idle_s(self, now: float) -> float | None: ...
    def evict(self) -> None: ...


class Newcomer(NamedTuple):
    """A new session's places (`Gateway.take_places`): what it will hold, the idle session it takes some of them over
    from (None: none), and which."""

    places: Places
    victim: LiveSession | None
    takes: Places


# One utterance's text budget in UTF-8 bytes (the prompt takes one frame per byte). Its speech takes
# about 6 frames per byte at a neutral rate (14-17 bytes/s at 86.13 frames/s), and prompt plus audio
# share the engine's context; the prompt's other rows (conditioning, BOS/EOS, 17 frames of silence)
# take at most PROMPT_OVERHEAD frames.
AUDIO_FRAMES_PER_BYTE = 6
PROMPT_OVERHEAD = 32
MIN_UTTERANCE_BYTES = 64


def engine_context(gw: Gateway) -> int:
    """Frames of the engine's context (prompt + audio) per request."""
    return int(gw.engine.info.get("max_context") or gw.settings.engine.max_context or gw.cfg.max_seqlen)


def utterance_bytes(gw: Gateway) -> int:
    """The UTF-8 size of the longest utterance: at most --max-text-chars bytes, and small enough that its
    prompt and its speech fit the engine's context and --max-frames. Text is cut to it twice: as written
    (app/core/text_buffer.py, sentences) and as spoken, after normalization (Gateway.start_utterance)."""
    lim = gw.settings.limits
    context = engine_context(gw)
    fits_context = (context - PROMPT_OVERHEAD) // (1 + AUDIO_FRAMES_PER_BYTE)
    fits_frames = lim.max_frames // AUDIO_FRAMES_PER_BYTE
    return max(MIN_UTTERANCE_BYTES, min(lim.max_text_chars, fits_context, fits_frames))


def model_config(settings: GatewaySettings) -> Zonos2Config:
    if settings.weights.model_path:
        return Zonos2Config.from_file(settings.weights.model_path)
    return Zonos2Config.from_dict(preset_params(settings.weights.random_preset))


def engine_device(device: str, pooled: bool) -> tuple[str, dict[str, str]]:
    """The device an engine process is told, and the environment it gets. In a pool (--devices) an engine
    on cuda:N sees only that GPU (CUDA_VISIBLE_DEVICES, mapped through ours when it is set), as cuda:0:
    every kernel, graph and allocation of the process is then on its own GPU whatever the current device."""
    if not pooled or not device.startswith("cuda"):
        return device, {}
    index = int(device.partition(":")[2] or 0)
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        if index >= len(visible):
            raise ValueError(
                f"{device}: CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} has {len(visible)} device(s)"
            )
        return "cuda:0", {"CUDA_VISIBLE_DEVICES": visible[index]}
    return "cuda:0", {"CUDA_VISIBLE_DEVICES": str(index)}


def engine_settings(settings: GatewaySettings) -> list[tuple[str, EngineSettings, dict[str, str]]]:
    """Each engine process's device as the operator named it, its settings and its environment: one per
    device of --devices (one on --device without it)."""
    pooled = bool(settings.devices)
    out = []
    for device in settings.devices or (settings.engine.device,):
        child_device, env = engine_device(device, pooled)
        out.append((device, dataclasses.replace(settings.engine, device=child_device), env))
    return out


def engine_pool(settings: GatewaySettings, link: ControlLink | None = None) -> EnginePool:
    """One client per engine process, each supervised alone: by this process, or with several gateway
    processes by their supervisor (app/workers.py), which hands this one its channel (`link`)."""
    engines: list[EngineClient] = []
    for i, (device, engine, env) in enumerate(engine_settings(settings)):
        common: dict[str, Any] = dict(
            max_buffered_s=settings.limits.max_buffered_audio_s,
            log_level=settings.log_level,
            name=str(i),
            device=device,
        )
        engines.append(
            AttachedEngineClient(settings.weights, engine, link, i, **common)
            if link is not None
            else EngineClient(settings.weights, engine, env=env, **common)
        )
    return EnginePool(engines)


class Gateway:
    def __init__(self, settings: GatewaySettings, link: ControlLink | None = None) -> None:
        self.settings = settings
        self.cfg = model_config(settings)
        self.metrics = Metrics()
        # `engine` places every request on one of `engines` (one process per device, docs/scaling.md)
        self.engine = engine_pool(settings, link)
        self.engines = self.engine.engines
        self.metrics.engines = lambda: self.engines
        self.engine.on_placed.append(lambda e, kind: self.metrics.engine_requests.labels(e.name, kind).inc())
        lim = settings.limits
        # text normalization runs in worker processes (app/core/normalization.py); prompts get the spoken text
        self.normalizer = (
            NormalizationPool(
                # several gateway processes split the CPUs' share of normalization between them
                settings.normalization_workers or max(1, default_workers() // (link.channels if link else 1)),
                lim.normalization_cpu_s,
                lim.normalization_max_tasks,
                warm=("en_us", *settings.normalization_languages),
            )
            if settings.text_normalization
            else None
        )
        self.prompts = PromptFactory(self.cfg, emotion_directions(settings.emotion_directions_dir))
        if self.normalizer is not None:
            turns = self.normalizer.turns
            self.metrics.track(self.metrics.normalizing, lambda: turns.active)
            self.metrics.track(self.metrics.normalization_waiting, lambda: turns.waiting)
        self.lexicons = LexiconStore(settings.data_dir / "lexicons")
        self.stitching = StitchStore(settings.data_dir / "stitching", settings.limits, model_identity(settings))
        self.voices = VoiceStore(
            settings.voices_dir,
            self.cfg.speaker_embedding_dim,
            shared=settings.shared_voices or link is not None,  # other processes' voices too
            max_per_owner=lim.max_voices_per_key,
        )
        self.bodies = BodyBudget(lim.max_body_bytes_in_flight, self.metrics.body_bytes.set)  # app/io/bodies.py
        self.answers = BodyBudget(lim.max_whole_answer_bytes, self.metrics.answer_bytes.set)  # app/doors/speech.py
        self.sessions = SessionCount(link.counts, link.channel) if link is not None else SessionCount()
        self._key_slots = {k: i for i, k in enumerate(settings.api_keys)}  # an API key -> its number (its counts)
        self.started_at = time.time()
        self._defaults_task: asyncio.Task[None] | None = None
        # --default-voices-dir's voices are in the library (set at once without it): /readyz waits for them, or a
        # client told "ready" would get unknown_voice for a voice the server ships (app/doors/service.py)
        self.defaults_loaded = asyncio.Event()
        self.link = link
        self._metrics_task: asyncio.Task[None] | None = None
        self._clip_embeddings: OrderedDict[bytes, np.ndarray] = OrderedDict()  # sha256 of a clip -> embedding
        # admitted streaming sessions (app/core/door_policy.py); the other gateway processes read how many are held
        self.conversations = Conversations(None if link is None else lambda n: link.counts.set(link.channel, HELD, n))
        self._refused: Decision | None = None  # the door's last refusal, and until when it stands
        self._refused_until = 0.0
        # every refusal of this process counts (at the request head and in the routes)
        self.refusal_pace = RefusalPace(
            settings.limits.refusal_hold_ms / 1e3,
            settings.limits.refusal_storm_per_s,
            settings.limits.refusal_budget_per_s,
        )
        # a SIGTERM (app/server.py DrainingServer, `start_drain`): new streams are refused, each session ends once quiet
        self.draining = False
        self.live: set[LiveSession] = set()  # this process's streaming sessions (app/doors/handshake.py)

    async def start(self) -> None:
        await self.engine.start()
        if self.normalizer is not None and self.normalizer.available:
            # each worker loads the English grammars as it starts (~1 s from the cache, ~1 min to compile
            # the first time): not on a request
            self.normalizer.start()
        if self.settings.default_voices_dir:
            self._defaults_task = asyncio.create_task(self._load_default_voices(self.settings.default_voices_dir))
        else:
            self.defaults_loaded.set()
        if self.link is not None:  # the other gateway processes render this one's gauges from its files
            self._metrics_task = asyncio.create_task(self._refresh_metrics())

    async def _refresh_metrics(self) -> None:
        while True:
            await asyncio.sleep(METRICS_REFRESH_S)
            self.metrics.refresh()

    async def close(self) -> None:
        if self._metrics_task:
            self._metrics_task.cancel()
        if self._defaults_task:
            self._defaults_task.cancel()
        if self.normalizer is not None:
            await asyncio.to_thread(self.normalizer.close)
        await self.engine.close()

    # ---- auth scope ------------------------------------------------------------------------------
    @staticmethod
    def owner_of(api_key: str | None) -> str:
        return hashlib.sha256(api_key.encode()).hexdigest()[:16] if api_key else ""

    # ---- the door --------------------------------------------------------------------------------
    def admission(self) -> Decision:
        """Whether a new stream may start now (app/core/door_policy.py), from the ready engines' loads and the
        room held for admitted conversations (every gateway process's)."""
        loads = [e.load() for e in self.engines if e.ready.is_set()]
        limits = self.settings.limits
        return decide(loads, self.held(), limits.max_queue_ms / 1e3, limits.first_audio_budget_ms / 1e3)

    def start_drain(self) -> None:
        """The server is shutting down: refuse new streams, and end each session once it is quiet."""
        self.draining = True
        for s in list(self.live):
            s.drain()

    def idle_longest(self, owner: str | None = None) -> LiveSession | None:
        """At the session limit (app/doors/handshake.py), the session whose place a newcomer may take (`evict`): this
        process's session idle longest (of `owner`'s, when given), if it has been idle for --evict-idle-after
        (app/settings.py EVICT_IDLE_AFTER_S). None when none has: a session speaking or with a turn open is never
        taken."""
        now, least = time.monotonic(), self.settings.limits.evict_idle_after_s
        idle = [
            (t, s)
            for s in self.live
            if (owner is None or s.owner == owner) and (t := s.idle_s(now)) is not None and t >= least
        ]
        return max(idle, key=lambda ts: ts[0])[1] if idle else None

    def take_places(self, key: str | None) -> Newcomer:
        """The places in the session counts a new session takes (app/doors/handshake.py): with --max-sessions-per-key
        and API keys, one of its key's (every gateway process's sessions of that key count), then one of the server's
        (--max-sessions). Where none is left, it takes over those of this process's session idle longest (one of its
        own key's, at its key's limit: both of that one's places), if one has been idle for --evict-idle-after: to be
        evicted (`evict`) once the new session is made; `give_back` if it is not. Raises too_many_sessions when there
        is none to take."""
        lim = self.settings.limits
        slot = self._key_slots.get(key) if lim.max_sessions_per_key and key is not None else None
        places = Places(server=False)
        if slot is not None:
            if not self.sessions.try_open_key(slot, lim.max_sessions_per_key):
                victim = self.idle_longest(self.owner_of(key))
                if victim is None:
                    raise RequestError(
                        G.TOO_MANY_SESSIONS,
                        f"this API key holds {lim.max_sessions_per_key} sessions, its limit (--max-sessions-per-key); "
                        "close one, or retry later",
                    )
                both = Places(server=True, key=slot)  # (it is of this key: it holds both)
                return Newcomer(both, victim, Places(server=True, key=slot))
            places.key = slot
        if self.sessions.try_open(lim.max_sessions):
            places.server = True
            return Newcomer(places, None, Places(server=False))
        victim = self.idle_longest()
        if victim is None:
            self.sessions.release(places)
            raise RequestError(G.TOO_MANY_SESSIONS, "the server is at its session limit; retry later")
        places.server = True  # taken over (a place of its key, if it holds one, it gives back as it ends)
        return Newcomer(places, victim, Places(server=True))

    def session_closed(self, session: LiveSession, places: Places) -> None:
        """A session's socket is closed (app/doors/handshake.py: as soon as its client can see it, again as the session
        ends): its `places` given back, so a client that reconnects at once takes them, and no newcomer takes them over
        (it is idle no more, `idle_longest`); the room held for its conversation's next utterance too, as it has none
        (the door refused a client that reconnected at once for a closed session's room). Once: it holds none after."""
        self.live.discard(session)
        self.conversations.discard(session.conversation)
        self.sessions.release(places)

    def give_back(self, newcomer: Newcomer) -> None:
        """A new session that was not made gives back the places it took (not those it was to take over)."""
        places, takes = newcomer.places, newcomer.takes
        self.sessions.release(
            Places(server=places.server and not takes.server, key=None if takes.key is not None else places.key)
        )

    def evict(self, session: LiveSession, takes: Places | None = None) -> None:
        """End an idle session (`idle_longest`, in the same step of the event loop) whose places in the session
        counts a newcomer takes over (`takes`, from `take_places`; default: its server place): they are not given back
        when it ends, what else it holds is."""
        takes = takes if takes is not None else Places()
        if takes.server:
            session.places.server = False
        if takes.key is not None and session.places.key == takes.key:
            session.places.key = None
        self.live.discard(session)
        session.evict()
        self.metrics.evictions.inc()

    def held(self) -> int:
        """Admitted conversations whose room is held: this process's now, and what the others published."""
        held = self.conversations.held()
        link = self.link
        if link is not None:
            held += link.counts.total(HELD) - link.counts.get(link.channel, HELD)
        return held

    def refusal(self, at: str = "app") -> RequestError | None:
        """The door's answer to a new stream now: None (admitted), or the refusal, engine_busy (503) with
        Retry-After, counted `at` where it was made ("head": the connection's request head, before the app ran;
        "app": in a route). A refusal is kept for DOOR_MEMO_S: a storm of refused clients costs one decision
        per interval, not one per client."""
        if self.draining:
            self.metrics.door_refusals.labels(at).inc()
            return RequestError(
                G.SHUTTING_DOWN,
                "the server is shutting down: retry (another replica)",
                headers={"Retry-After": "1"},
            )
        now = time.monotonic()
        if now < self._refused_until and self._refused is not None:
            d = self._refused
        else:
            d = self.admission()
            if d.admitted:
                self._refused = None
                return None
            self._refused, self._refused_until = d, now + DOOR_MEMO_S
        self.metrics.door_refusals.labels(at).inc()
        limits = self.settings.limits
        wait = (
            "no engine is ready"
            if not self.engine.ready.is_set()
            else (
                "its first audio could not start in time"
                if d.wait_s == float("inf")
                else f"it would wait about {d.wait_s * 1e3:.0f} ms for the engine (limit {limits.max_queue_ms:g} "
                f"ms, first audio within {limits.first_audio_budget_ms:g} ms)"
            )
        )
        return RequestError(
            E.ENGINE_BUSY,
            f"the server is at capacity: {wait}; retry in {d.retry_after_s} s",
            headers={"Retry-After": str(d.retry_after_s)},
        )

    async def admit(self) -> None:
        """Refuse a new stream that could not start within --max-queue-ms (`refusal`), before anything of the
        request is read; under a retry storm after the hold the door's refusals at the request head get too
        (`RefusalPace`: a browser's requests, which carry `Origin`, are refused here, not there)."""
        refused = self.refusal()
        if refused is not None:
            hold = self.refusal_pace.hold()
            if hold > 0:
                self.metrics.door_refusals_held.inc()
                await asyncio.sleep(hold)
            raise refused

    # ---- audio in --------------------------------------------------------------------------------
    async def decode_clip(self, data: bytes) -> tuple[np.ndarray, int]:
        """Decode an uploaded reference clip in a worker thread and apply the size limits."""
        lim = self.settings.limits
        if len(data) > lim.max_upload_bytes:
            raise RequestError(G.UPLOAD_TOO_LARGE, f"clips are limited to {lim.max_upload_bytes} bytes")
        if not data:
            raise RequestError(E.BAD_AUDIO, "the clip is empty")
        try:
            samples, sr = await asyncio.to_thread(decode_audio, data, lim.max_clip_seconds)
        except ClipTooLong as e:
            raise RequestError(G.CLIP_TOO_LONG, str(e)) from None
        except AudioDecodeError as e:
            raise RequestError(E.BAD_AUDIO, str(e)) from None
        seconds = len(samples) / sr
        if seconds > lim.max_clip_seconds:
            raise RequestError(
                G.CLIP_TOO_LONG, f"clips are limited to {lim.max_clip_seconds:g} s (got {seconds:.1f} s)"
            )
        if seconds < lim.min_clip_seconds:
            raise RequestError(G.CLIP_TOO_SHORT, f"clips need at least {lim.min_clip_seconds:g} s of audio")
        return samples, sr

    async def embed_samples(self, samples: np.ndarray, sr: int) -> np.ndarray:
        """One speaker_encoder run in the engine: decoded clip -> embedding."""
        try:
            return await self.engine.embed(samples, sr)
        except EngineUnavailable as e:
            raise RequestError(E.ENGINE_BUSY, str(e)) from None
        except EngineRefused as e:  # its speaker encoder is behind: retry later (a bad clip is bad_audio, below)
            if e.code != E.ENGINE_BUSY:
                raise RequestError(E.BAD_AUDIO, str(e)) from None
            raise RequestError(E.ENGINE_BUSY, str(e)) from None
        except RecordTooLarge:
            raise RequestError(
                G.CLIP_TOO_LONG,
                f"this clip decodes to {samples.nbytes >> 20} MiB, more than the "
                "engine takes in one piece: send a shorter clip or a lower sample rate",
            ) from None
        except ValueError as e:
            raise RequestError(E.BAD_AUDIO, str(e)) from None

    def check_emotion(self, opts: SynthesisOptions, voice: Voice | None, clip: bool = False) -> None:
        """A request's emotion fields that its voice (or a clip) would refuse, refused at the door
        (app/core/emotion.py), against this server's --emotion-directions-dir."""
        check_emotion(self.prompts.emotion, opts, voice, self.cfg.dim, clip)

    async def embed_clip(self, raw: bytes, owner: str) -> Voice:
        """A reference clip sent with a request or a session (not stored) as a voice: decoded and embedded
        once, so the session keeps 2048 floats instead of the decoded audio, and its utterances skip the
        speaker encoder. The embedding is a function of the bytes alone: a clip sent again is not re-run."""
        # hashlib releases the GIL for large inputs: a clip's digest runs beside the event loop
        digest = (await asyncio.to_thread(_sha256, raw)) if len(raw) > INLINE_HASH else _sha256(raw)
        emb = self._clip_embeddings.get(digest)
        if emb is None:
            samples, sr = await self.decode_clip(raw)
            emb = await self.embed_samples(samples, sr)
            del samples
            self._clip_embeddings[digest] = emb
            while len(self._clip_embeddings) > CLIP_CACHE:
                self._clip_embeddings.popitem(last=False)
        else:
            self._clip_embeddings.move_to_end(digest)
        return Voice(id="clip", name="clip", owner=owner, source="clip", dim=len(emb), embedding=emb)

    # ---- the path to the engine ------------------------------------------------------------------
    async def start_utterance(
        self,
        text: str,
        opts: SynthesisOptions,
        voice: Voice | None = None,
        clip: tuple[np.ndarray, int] | None = None,
        owner: object = None,
        chain: Chain | None = None,
        link: Link | None = None,
    ) -> Stream | PieceStream | None:
        """One utterance's engine work. Its text is normalized (in a worker process, in `owner`'s turn: a
        session or an HTTP request), and the spoken text, which can be several times longer ("$1,234,567.89"
        is 13 bytes written, 95 spoken), is cut to the utterance budget again: the model gets every byte of
        it, in one engine request or in a few, one after another (PieceStream). chain, link: its place in
        its context's continuation chain (app/core/continuation.py). None: its pronunciation rules (or its
        normalization) left no text to speak (an empty prompt would have the model babble to its frame limit):
        an utterance of no audio."""
        if len(text) > self.settings.limits.max_text_chars:
            raise RequestError(
                G.TEXT_TOO_LONG, f"an utterance is limited to {self.settings.limits.max_text_chars} characters"
            )
        if opts.lexicon:  # pronunciation dictionaries, before normalization: the aliases are written text too
            text = await asyncio.to_thread(self.aliased, text, opts.lexicon)  # (thousands of rules: ms of lookups)
        if opts.text_normalization and self.normalizer is not None:
            text = await self.normalizer.normalize(text, opts.language, owner)
        if not text.strip():  # the rules left nothing to say ("Um" read as ""): no engine work, no audio
            if chain is not None and link is not None:  # the chain goes on through it, as through a break
                await chain.pass_over(link)
            return None
        budget = utterance_bytes(self)
        pieces = split_to_budget(text, budget, spoken_only=False) if utf8_len(text) > budget else [text]
        embedding = voice.embedding if voice is not None else None
        if chain is not None and link is not None and len(pieces) == 1:
            return await self._continue(chain, link, pieces[0], opts, embedding, clip)
        if chain is not None and link is not None:
            chain.leave(link)  # an utterance of several requests is no chain member: the next starts fresh
        limit = opts.max_frames or self.settings.limits.max_frames  # the utterance's, however many requests
        # (a method, not a closure: a closure's cells would live as long as this coroutine, which waits for the
        # chain's turn above while the utterances before it play, objects the collector's full passes walk)
        submit = functools.partial(self._submit, opts, embedding, clip)
        return submit(pieces[0], limit) if len(pieces) == 1 else PieceStream(submit, pieces, limit)

    def aliased(self, text: str, lexicon: Aliases) -> str:
        """An utterance's text with its pronunciation rules applied, or text_too_long when they make it longer than an
        utterance may be (`start_utterance`; an HTTP text checks each of its utterances so before any engine work:
        app/core/pipeline.py `speak`). Run it in a worker thread."""
        text = apply_rules(text, lexicon)
        if len(text) > self.settings.limits.max_text_chars:
            raise RequestError(
                G.TEXT_TOO_LONG,
                f"the pronunciation rules make this utterance {len(text)} characters, more than the "
                f"{self.settings.limits.max_text_chars} an utterance may have",
            )
        return text

    def _submit(
        self,
        opts: SynthesisOptions,
        embedding: np.ndarray | None,
        clip: tuple[np.ndarray, int] | None,
        piece: str,
        max_frames: int,
    ) -> Stream:
        """One engine request of an utterance that is no chain member (`start_utterance`)."""
        prompt = self.prompts.build(piece, opts, embedding is not None or clip is not None)
        req = dataclasses.replace(
            self.prompts.request(prompt, opts, max_frames, embedding, clip), max_frames=max_frames
        )
        try:
            return self.engine.submit(req)
        except EngineUnavailable as e:
            raise RequestError(E.ENGINE_BUSY, str(e)) from None

    async def _continue(
        self,
        chain: Chain,
        link: Link,
        text: str,
        opts: SynthesisOptions,
        embedding: np.ndarray | None,
        clip: tuple[np.ndarray, int] | None,
    ) -> Stream:
        """One utterance of a continuation chain (app/core/continuation.py): it continues the chunks before it
        and their DAC stream, on the engine that holds that stream."""
        try:
            ctx = await chain.context(link)
            speaker = embedding is not None or clip is not None
            # the prompt and the chunk's speech must fit the engine's context (as utterance_bytes reckons)
            room = engine_context(self) - PROMPT_OVERHEAD - AUDIO_FRAMES_PER_BYTE * utf8_len(text)
            # no await from reading link.final to settling the link: Chain.end sees either a final link or
            # its stream
            for ctx_text, ctx_codes in [(ctx.text, ctx.codes), *ctx.smaller]:
                prompt = self.prompts.build(text, opts, speaker, (ctx_text, ctx_codes), not link.final)
                if len(prompt) <= room:
                    break
            req = dataclasses.replace(
                self.prompts.request(prompt, opts, self.settings.limits.max_frames, embedding, clip),
                hold=not link.final,
                continues=ctx.prev.rid if ctx.prev is not None else 0,
                keep_frames=link.final and chain.keep,
            )
            if opts.sampling.prefix_cfg_scale != 1.0 and len(ctx_codes):  # the prefix twin: the chunk fresh
                req = dataclasses.replace(
                    req, uncond_prompt=self.prompts.build(text, opts, speaker, None, not link.final)
                )
            try:  # the stream it continues lives on one engine
                stream = ctx.prev.client.submit(req) if ctx.prev is not None else self.engine.submit(req)
            except EngineUnavailable as e:
                raise RequestError(E.ENGINE_BUSY, str(e)) from None
            link.settle(text, stream)
            return stream
        finally:
            link.settle()

    async def lexicon(self, spec: object, owner: str) -> Aliases:
        """Pronunciation rules from a request: a list of stored dictionaries (an id, or ElevenLabs' locator
        `{pronunciation_dictionary_id, version_id}`) and inline rules (`{grapheme, alias}` or
        `{string_to_replace, alias}`), in order (an earlier rule for the same text wins). A stored dictionary is
        read in a worker thread: one the store has not kept parsed is up to 1 MB of JSON (~15 ms), and a client
        naming a different one in each of a run of pipelined messages held every session's audio (the event loop
        ran them back to back: up to 1 s; the store keeps RULES_CACHE of them, an owner may have MAX_PER_OWNER)."""
        if spec is None:
            return Aliases()
        if not isinstance(spec, list) or len(spec) > MAX_LEXICON_ITEMS:
            raise RequestError(
                G.BAD_LEXICON, f"a lexicon is a list of at most {MAX_LEXICON_ITEMS} dictionary ids, locators or rules"
            )
        parts: list[Aliases] = []
        named = 0
        for item in spec:
            if isinstance(item, dict) and "pronunciation_dictionary_id" in item:
                item = item["pronunciation_dictionary_id"]
            if isinstance(item, str):
                part = await asyncio.to_thread(self.lexicons.aliases, item, owner)
            elif isinstance(item, dict):
                part = Aliases(rules_from_json([item]))
            else:
                raise RequestError(G.BAD_LEXICON, "a lexicon item is a dictionary id, a locator or a rule")
            named += len(part)  # (a dictionary named twice counts twice: the merge below walks each part)
            if named > MAX_RULES:  # every text the request speaks looks its words up in all of them
                raise RequestError(G.BAD_LEXICON, f"a request's dictionaries hold at most {MAX_RULES} rules in all")
            parts.append(part)
        if len(parts) == 1:  # one stored dictionary (the usual case): the store's own, shared by every session
            return parts[0]
        return Aliases(rule for part in parts for rule in part.items())

    def resolve_voice(self, ref: str | None, owner: str) -> Voice | None:
        if ref is None or ref == "":
            return None
        return self.voices.get(ref, owner)  # VoiceError is a RequestError: unknown_voice, 404

    # ---- default voices --------------------------------------------------------------------------
    async def _load_default_voices(self, folder: Path) -> None:
        await self.engine.ready.wait()
        try:
            await self._load_defaults(folder)
        finally:  # loaded or skipped, each: readiness waits for no more
            self.defaults_loaded.set()

    async def _load_defaults(self, folder: Path) -> None:
        files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES | {".npy", ".npz"})
        for path in files:
            try:
                data = await asyncio.to_thread(path.read_bytes)
                name = re.sub(r"[_\-]+", " ", path.stem).strip()[:MAX_NAME] or path.stem
                vid = "default_" + hashlib.sha1(str(path.relative_to(folder)).encode()).hexdigest()[:16]
                preview = None
                if path.suffix.lower() in {".npy", ".npz"}:
                    emb = parse_embedding_file(data, self.cfg.speaker_embedding_dim)
                else:
                    samples, sr = await self.decode_clip(data)
                    emb = await self.embed_samples(samples, sr)
                    preview = await asyncio.to_thread(preview_wav, samples, sr)
                voice = Voice(id=vid, name=name, owner="", source="default", dim=len(emb), details={"file": path.name})
                self.voices.remember_default(voice, emb, preview)
                log.info("default voice %r ready (%s)", name, vid)
            except (RequestError, OSError) as e:
                log.warning("default voice %s skipped: %s", path, e)


class PieceStream:
    """An utterance whose spoken text takes more than one engine request, read as one Stream: the pieces
    play in order, the next one submitted when the one before starts to be read (so one generates ahead,
    as in the pipeline); one `finished` at the end with the stats of all (app/core/stats.py `summed_stats`), or
    the first error. The frame limit is the utterance's: each piece may take what the pieces before it left, and
    the audio stops at the limit (`max_frames`, `_end_at_limit`)."""

    def __init__(self, submit: Callable[[str, int], Stream], pieces: list[str], max_frames: int) -> None:
        self._submit = submit
        self._pending = deque(pieces[1:])
        self._left = max_frames * HOP  # samples the utterance may still play
        self.current: Stream = submit(pieces[0], max_frames)
        self.ahead: Stream | None = None
        # the frames the one playing and the one ahead were submitted with, and the samples read of the one playing
        self._current_limit, self._ahead_limit, self._current_read = max_frames, 0, 0
        self.done = False
        self._stats: list[m.RequestStats] = []  # of the pieces ended so far, in order
        self._cut_samples = 0  # the audio played of a piece cancelled at the utterance's limit (no stats of its own)
        self._reason: str | None = None  # the first piece that did not end on its own (max_frames)
        self._at_limit = False  # the audio reached the limit: nothing more plays; the one playing ends
        self._on_end: Callable[[], None] | None = None  # (`when_ended`)

    def when_ended(self, told: Callable[[], None]) -> None:
        """`told()` once its engine work has ended (its last piece read, or it was cancelled; at once if it has)."""
        if self.done:
            told()
        else:
            self._on_end = told

    def _ended(self) -> None:
        self.done = True
        told, self._on_end = self._on_end, None
        if told is not None:
            told()

    def __aiter__(self) -> PieceStream:
        return self

    async def __anext__(self) -> Event:
        while not self.done:
            if self.ahead is None and self._pending:
                self._ahead_limit = max(1, self._left // HOP)
                try:
                    self.ahead = self._submit(self._pending.popleft(), self._ahead_limit)
                except RequestError as e:
                    self.cancel()
                    return m.Error(self.current.rid, E.of(e.code), str(e))
            try:
                ev = await self.current.__anext__()
            except StopAsyncIteration:  # (a stream always ends with an event; this is the guard)
                ev = m.Finished(self.current.rid, m.CANCELLED)
            if isinstance(ev, m.Finished):
                if ev.stats is not None:
                    self._stats.append(ev.stats)
                if ev.reason != "eos" and self._reason is None:
                    self._reason = ev.reason
                if self.ahead is not None and ev.reason != m.CANCELLED:
                    self.current, self.ahead = self.ahead, None
                    self._current_limit, self._current_read = self._ahead_limit, 0
                    continue
                self._ended()
                stats = summed_stats(self._stats, self._cut_samples)
                return dataclasses.replace(ev, reason=self._reason or ev.reason, stats=stats)
            if isinstance(ev, m.Error):
                self.cancel()
            elif isinstance(ev, m.Audio):
                if self._at_limit:  # (the engine stops a piece at its own limit; this is the guard)
                    continue
                if len(ev.pcm) >= self._left:  # the utterance's limit: this much of this piece, nothing after
                    ev = dataclasses.replace(ev, pcm=ev.pcm[: self._left])
                    self._current_read += len(ev.pcm)
                    self._left = 0
                    self._end_at_limit()
                else:
                    self._left -= len(ev.pcm)
                    self._current_read += len(ev.pcm)
            return ev
        raise StopAsyncIteration

    def _end_at_limit(self) -> None:
        """The utterance reached its frame limit: nothing more plays, the piece ahead and those not sent are dropped,
        and it finishes as max_frames once the one playing has ended, with the stats of all. A piece that reached
        its own limit there (the first always does: it was sent with the utterance's) ends on the engine right
        after this audio, with its stats; one sent with more (while the one before it played) is cancelled, and the
        audio played of it counts as its frames."""
        self._at_limit, self._reason = True, "max_frames"
        self._pending.clear()
        if self.ahead is not None:
            self.ahead.cancel()
            self.ahead = None
        if self._current_read < self._current_limit * HOP:
            self._cut_samples = self._current_read
            self.current.cancel()

    def cancel(self) -> None:
        self._ended()
        self._pending.clear()
        self.current.cancel()
        if self.ahead is not None:
            self.ahead.cancel()


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def preview_wav(samples: np.ndarray, sr: int) -> bytes:
    """A voice's preview: its clip's first PREVIEW_S at most PREVIEW_MAX_RATE, 16-bit WAV. Bounded so that a
    stored voice costs the disk at most ~1 MB whatever its clip decodes to (60 s of silence at 192 kHz is a
    34 KB FLAC and a 23 MB WAV)."""
    x = samples[: int(PREVIEW_S * sr)]
    if sr > PREVIEW_MAX_RATE:
        x, sr = soxr.resample(x, sr, PREVIEW_MAX_RATE), PREVIEW_MAX_RATE
    buf = io.BytesIO()
    sf.write(buf, x, sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()
