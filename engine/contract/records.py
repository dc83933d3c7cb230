"""The records exchanged between the gateway and the engine process over the shared-memory rings.

Every record is one frozen class below: its `encode()` gives the wire form, a msgpack header dict (with
its "type") plus an optional raw payload (numpy arrays written straight into the ring; no pickling), and
`decode(header, payload)` (one dispatch on "type") rebuilds it, validating every field and the payload's
size: anything else is a `MalformedRecord`, which its reader logs and drops (the engine answers a request's
malformed record with `bad_request`), so neither process ever crashes on one.

gateway -> engine
  SubmitRequest  submit   {rid, prompt_frames, prompt_width, params,  payload: prompt int32 [P, 10]
                           max_frames, ignore_eos, speaker: none|        + uncond prompt int32 [U, 10]
                           embedding|clip, clip_sr?, hold, continues,    + emotion delta f32 [E]
                           keep_frames, uncond_frames, emotion_dim,      + uncond speaker f32 [S]
                           uncond_speaker_dim, first_samples?}           + (speaker f32 [D] | clip f32 [N])
                 emotion delta: 'proj' emotion, added to the projected speaker row (E = the model's hidden
                 size); uncond speaker: raw/lda emotion, the speaker embedding without it (the emotion-CFG
                 twin's voice); both optional (E, S = 0: none; engine/frontend/emotion.py, engine/guidance.py)
                 first_samples: 44.1 kHz samples the client's encoder takes in before it outputs anything
                 (its resampler's and codec's, app/io/audio_output.py): the stream's first DAC call is sized for it
  Cancel         cancel   {rid}
  End            end      {rid}                   the continuation of rid's stream ends: its held tail is flushed
  Embed          embed    {rid, clip_sr}          payload: clip f32 [N] (mono)
  Align          align    {rid, sample_rate, text} payload: int16 PCM [N] (mono): the aligner's word times of text
  Reset          reset    {}                      a new gateway process took this ring: the old one's requests are
                                                  cancelled, the engine says `ready` again on it
  Shutdown       shutdown {}

engine -> gateway
  Ready          ready     {device, slots, max_context, weights, warmup_s, ...}
  Started        started   {rid, queue_ms}
  Audio          audio     {rid, index, samples}  payload: int16 PCM at 44.1 kHz
  Kept           kept      {rid, frames, eos_frame} payload: int32 [frames, 9], a held request's kept (trimmed) frames,
                                                  or a final keep_frames request's frames up to its end of audio
  Finished       finished  {rid, reason, stats, freed}  reason: eos | max_frames | context | cancelled;
                           stats: RequestStats (a request that ran to its end), freed: CancelStats (a cancel's ack)
  Error          error     {rid, code, message, retry_after_ms}  code: an EngineError (engine/contract/errors.py)
  Embedding      embedding {rid, dim}             payload: f32 [dim]
  Aligned        aligned   {rid, words}           payload: f64 [len(words), 2] (start_s, end_s of each word)
  Stats          stats     the engine's state: `Stats`'s fields (every --stats-interval-s, 0.1 s by default)

`RequestStats` are measured once, in the engine, and reach the client unchanged as `audio.done`'s
`stats.engine`; the gateway adds only what it alone measures (app/core/stats.py, `UtteranceStats`).
"""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import MISSING, asdict, dataclass, fields
from enum import StrEnum
from typing import Any, ClassVar, TypeVar, Union, cast, dataclass_transform

import numpy as np

from engine.contract.constants import CODEBOOK_SIZE, N_CODEBOOKS, SAMPLE_RATE
from engine.contract.errors import EngineError

SUBMIT, CANCEL, END, EMBED, ALIGN, RESET, SHUTDOWN = "submit", "cancel", "end", "embed", "align", "reset", "shutdown"
READY, STARTED, AUDIO, KEPT, FINISHED, ERROR, EMBEDDING, ALIGNED, STATS = (
    "ready",
    "started",
    "audio",
    "kept",
    "finished",
    "error",
    "embedding",
    "aligned",
    "stats",
)
CANCELLED = "cancelled"  # the finish reason of a cancelled request (the others: eos, max_frames, context)

HISTORY = 256  # repetition ring length per slot; repetition_window is capped at it

# The bounds of every sampling value, in this one place: the gateway checks them when a request arrives
# (every API and dialect, app/core/options.py parse_options), the engine again on submit (a record outside
# them is that request's `bad_request`). The sampler keeps each value in a float32 or int64 tensor; each
# bound lies well inside those (1e308 passed `isfinite` once and overflowed the sampler's float32 tensor,
# killing the engine) and past what still changes the sampling: logits are a few tens at most, so at
# temperature 100 every code is already about equally likely, and a penalty of 100 already rules a
# repeated code out. docs/reliability.md ("Bounds") lists them.
TEMPERATURE_MAX = 100.0
REPETITION_PENALTY_MAX = 100.0
TOP_K_MAX = CODEBOOK_SIZE  # a codebook's codes; top_k < 1 means all of them (the reference)
SEED_LIMIT = 2**63  # the sampler's int64 seed
# |cfg_scale|, |prefix_cfg_scale|, |emotion_cfg_scale| (engine/guidance.py): the reference takes any float;
# guided logits scale with it, and past this they are noise
CFG_SCALE_MAX = 100.0
# |each value of a speaker embedding| (a voice stored, uploaded or sent inline; the engine checks a submit's again,
# engine/runtime/job.py, that request's bad_voice): real x-vectors
# stay within a few hundred; a finite 3e38 overflowed the speaker projections (2048 -> 1024 -> 2048 in bf16) to inf,
# the prompt's first row became NaN, and the request sampled noise until its frame cap (988 frames for "Hello there.")
EMBEDDING_ABS_MAX = 1e6


def embedding_in_bounds(embedding: np.ndarray) -> bool:
    """Every value finite and within EMBEDDING_ABS_MAX (NaN and inf are not)."""
    with np.errstate(invalid="ignore"):
        return bool((np.abs(embedding) <= EMBEDDING_ABS_MAX).all())


# SubmitRequest.first_samples: what a client's encoder holds back before its first output (a resampler or a codec:
# up to ~0.5 s, /tts/generate's fade_out_ms up to 5 s)
FIRST_SAMPLES_MAX = 10 * SAMPLE_RATE


def _number(value: object) -> bool:
    """A JSON number (bool is an int in Python, not a number here)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Reference defaults (`message/tts.py`). top_k < 1 means every code (`top_k_codes`), as in the reference."""

    temperature: float = 1.15
    top_k: int = 106
    top_p: float = 0.0
    min_p: float = 0.18
    repetition_window: int = 50
    repetition_penalty: float = 1.2
    repetition_codebooks: int = 8
    seed: int | None = None
    # Classifier-free guidance, the reference's TTSSamplingParams fields (engine/guidance.py): 1.0 = off.
    cfg_scale: float = 1.0  # speaker CFG: a twin without the speaker
    prefix_cfg_scale: float = 1.0  # continuation chunks: a twin generating the chunk fresh
    emotion_cfg_scale: float = 1.0  # emotion: a twin without the emotion

    def top_k_codes(self) -> int:
        """The codes top-k keeps: top_k, or all of a codebook's when it is below 1."""
        return self.top_k if self.top_k >= 1 else CODEBOOK_SIZE

    def validate(self, n_codebooks: int = N_CODEBOOKS) -> None:
        """ValueError naming the first value outside its bounds (or of the wrong type)."""
        t, rp = self.temperature, self.repetition_penalty
        checks = [
            (_number(t) and 0.0 <= t <= TEMPERATURE_MAX, f"temperature must be a number in [0, {TEMPERATURE_MAX:g}]"),
            (_number(self.top_p) and 0.0 <= self.top_p <= 1.0, "top_p must be a number in [0, 1]"),
            (_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p must be a number in [0, 1]"),
            (
                _integer(self.repetition_window) and 0 <= self.repetition_window <= HISTORY,
                f"repetition_window must be an integer in 0..{HISTORY}",
            ),
            (
                _number(rp) and 1.0 <= rp <= REPETITION_PENALTY_MAX,
                f"repetition_penalty must be a number in [1, {REPETITION_PENALTY_MAX:g}]",
            ),
            (
                _integer(self.repetition_codebooks) and -1 <= self.repetition_codebooks <= n_codebooks,
                f"repetition_codebooks must be an integer in -1..{n_codebooks} (-1 = all)",
            ),
            (
                self.seed is None or (_integer(self.seed) and 0 <= self.seed < SEED_LIMIT),
                "seed must be a non-negative 63-bit integer",
            ),
            (
                _integer(self.top_k) and -1 <= self.top_k <= TOP_K_MAX,
                f"top_k must be an integer in -1..{TOP_K_MAX} (< 1 means all {CODEBOOK_SIZE})",
            ),
            *(
                (
                    _number(v) and abs(v) <= CFG_SCALE_MAX,
                    f"{name} must be a number in [-{CFG_SCALE_MAX:g}, {CFG_SCALE_MAX:g}] (1.0 = off)",
                )
                for name, v in (
                    ("cfg_scale", self.cfg_scale),
                    ("prefix_cfg_scale", self.prefix_cfg_scale),
                    ("emotion_cfg_scale", self.emotion_cfg_scale),
                )
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


# ---- the records' machinery ---------------------------------------------------------------------------


class MalformedRecord(ValueError):
    """A record off a ring that is none of the contract's: an unknown type, a field missing or of the wrong
    type, a payload of the wrong size. `rid`: the request it names, when it names one."""

    def __init__(self, message: str, rid: int | None = None) -> None:
        super().__init__(message)
        self.rid = rid


Payload = bytes | np.ndarray | None  # what `encode` hands the ring: a C-contiguous buffer, or none


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _conforms(value: object, hint: Any) -> bool:
    """value is of the (simple) annotated type: bool, int, float, str, dict, None, or a union of them."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        return any(_conforms(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return _integer(value)
    if hint is float:
        return _number(value)
    if hint is str:
        return isinstance(value, str)
    if hint is dict or typing.get_origin(hint) is dict:
        return isinstance(value, dict)
    return hint is Any


def _values(cls: type, data: object, where: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields of dataclass cls read off a msgpack dict, each checked against its annotation; a field
    with a default may be absent (it reads as its default), keys that are no field are ignored."""
    if not isinstance(data, dict):
        raise MalformedRecord(f"{where} is not a map")
    rid = data.get("rid") if _integer(data.get("rid")) else None
    hints, out = _hints(cls), {}
    for f in fields(cls):
        if f.name in skip or not f.init:
            continue
        if f.name not in data:
            if f.default is MISSING:
                raise MalformedRecord(f"{where} has no {f.name!r}", rid)
            out[f.name] = f.default
            continue
        value = data[f.name]
        if not _conforms(value, hints[f.name]):
            raise MalformedRecord(f"{where}: {f.name} must be {hints[f.name]}, not {value!r}", rid)
        out[f.name] = value
    return out


def _floats(payload: bytes | None, count: int | None, what: str, rid: int | None) -> np.ndarray:
    buf = payload or b""
    if len(buf) % 4 or (count is not None and len(buf) != count * 4):
        raise MalformedRecord(
            f"{what}: a payload of {len(buf)} bytes is not {count if count is not None else 'n'} float32 values", rid
        )
    return np.frombuffer(buf, dtype=np.float32).copy()


def _array_equal(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.shape == b.shape
            and bool(np.array_equal(a, b))
        )
    return a == b


class Record:
    """One message on a ring. A plain record's header is its fields (and "type"), with no payload; a record
    with arrays encodes them into the payload itself. Records that hold arrays compare them by value."""

    type: ClassVar[str]

    def encode(self) -> tuple[dict[str, Any], Payload]:
        return {"type": self.type, **{f.name: getattr(self, f.name) for f in fields(self)}}, None  # type: ignore[arg-type]

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes | None) -> Record:
        return cls(**_values(cls, header, f"a {cls.type} record"))

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(_array_equal(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))  # type: ignore[arg-type]

    __hash__ = None  # type: ignore[assignment]


_R = TypeVar("_R", bound=type)


@dataclass_transform(frozen_default=True, eq_default=False)
def record(cls: _R) -> _R:
    """A frozen record class (its equality is Record's: arrays by value)."""
    return cast(_R, dataclass(frozen=True, eq=False)(cls))


# ---- gateway -> engine --------------------------------------------------------------------------------


@record
class SubmitRequest(Record):
    type: ClassVar[str] = SUBMIT
    rid: int
    prompt: np.ndarray  # [P, n_codebooks + 1] int
    params: SamplingParams
    max_frames: int
    ignore_eos: bool = False
    speaker_embedding: np.ndarray | None = None  # [D] float32
    clip: np.ndarray | None = None  # [N] float32 mono, embedded by the speaker_encoder node
    clip_sr: int = 0
    # Continuation (engine/frontend/longform.py, docs/protocol.md). hold: a non-final chunk: at its end the engine
    # sends its kept frames (`kept`) and keeps its DAC stream open for the next chunk (or flushes it when
    # none comes in time, or on `end`). continues: the rid of the held request whose DAC stream this one
    # continues (0: a stream of its own); its prompt continues that request's kept frames.
    hold: bool = False
    continues: int = 0
    # keep_frames: a final request sends its frames up to its end of audio (`kept`) when it ends, before its
    # `finished`: what a later request continues (ElevenLabs request stitching, app/core/stitching.py)
    keep_frames: bool = False
    # prefix CFG (engine/guidance.py): the twin's prompt, the chunk generated fresh (the gateway builds it)
    uncond_prompt: np.ndarray | None = None
    # emotion (engine/frontend/emotion.py): 'proj' space, the delta [hidden] added to the projected speaker row;
    # raw/lda space (the speaker embedding carries the emotion), the embedding without it: the voice of the
    # emotion-CFG twin (engine/guidance.py), sent only when emotion_cfg_scale asks for that twin
    emotion_delta: np.ndarray | None = None
    uncond_speaker: np.ndarray | None = None
    # 44.1 kHz samples the client's encoder takes in before it outputs anything (0..FIRST_SAMPLES_MAX; None: not
    # said): the stream's first DAC call is the one that serves it soonest (engine/dac/schedule.py `first_size`)
    first_samples: int | None = None

    def encode(self) -> tuple[dict[str, Any], Payload]:
        prompt = np.ascontiguousarray(self.prompt, dtype=np.int32)
        header: dict[str, Any] = {
            "type": SUBMIT,
            "rid": self.rid,
            "prompt_frames": int(prompt.shape[0]),
            "prompt_width": int(prompt.shape[1]),
            "params": asdict(self.params),
            "max_frames": self.max_frames,
            "ignore_eos": self.ignore_eos,
            "speaker": "none",
            "hold": self.hold,
            "continues": self.continues,
            "keep_frames": self.keep_frames,
            "uncond_frames": 0,
        }
        if self.first_samples is not None:
            header["first_samples"] = self.first_samples
        parts = [prompt.tobytes()]
        if self.uncond_prompt is not None:
            uncond = np.ascontiguousarray(self.uncond_prompt, dtype=np.int32).reshape(-1, prompt.shape[1])
            header["uncond_frames"] = int(uncond.shape[0])
            parts.append(uncond.tobytes())
        for key, arr in (("emotion_dim", self.emotion_delta), ("uncond_speaker_dim", self.uncond_speaker)):
            if arr is not None:
                vec = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
                header[key] = int(vec.shape[0])
                parts.append(vec.tobytes())
        if self.speaker_embedding is not None:
            header["speaker"] = "embedding"
            parts.append(np.ascontiguousarray(self.speaker_embedding, dtype=np.float32).tobytes())
        elif self.clip is not None:
            header["speaker"] = "clip"
            header["clip_sr"] = self.clip_sr
            parts.append(np.ascontiguousarray(self.clip, dtype=np.float32).tobytes())
        return header, b"".join(parts)

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes | None) -> SubmitRequest:
        v = _values(_SubmitHeader, header, "a submit record")
        rid, p, w, u = v["rid"], v["prompt_frames"], v["prompt_width"], v["uncond_frames"]
        if min(p, w, u) < 0:
            raise MalformedRecord("a submit record's prompt sizes must not be negative", rid)
        if v["speaker"] not in ("none", "embedding", "clip"):
            raise MalformedRecord(
                f"a submit record's speaker must be none, embedding or clip, not {v['speaker']!r}", rid
            )
        params = v["params"]
        known = {f.name for f in fields(SamplingParams)}
        if not all(isinstance(k, str) and k in known for k in params):
            raise MalformedRecord(
                f"a submit record's params has unknown keys: {sorted(map(str, set(params) - known))}", rid
            )
        first = v["first_samples"]
        if first is not None and not 0 <= first <= FIRST_SAMPLES_MAX:
            raise MalformedRecord(
                f"a submit record's first_samples must be in 0..{FIRST_SAMPLES_MAX}, not {first}", rid
            )
        buf = payload or b""
        n_prompt = (p + u) * w * 4
        if len(buf) < n_prompt:
            raise MalformedRecord(f"a submit record's payload of {len(buf)} bytes holds no {p}+{u}-frame prompt", rid)
        prompt = np.frombuffer(buf, dtype=np.int32, count=p * w).reshape(p, w).astype(np.int64)
        uncond = (
            np.frombuffer(buf, dtype=np.int32, count=u * w, offset=p * w * 4).reshape(u, w).astype(np.int64)
            if u > 0
            else None
        )
        vectors = []  # emotion delta, uncond speaker
        for key in ("emotion_dim", "uncond_speaker_dim"):
            n = v[key]
            if n < 0 or n_prompt + 4 * n > len(buf):
                raise MalformedRecord(f"a submit record's {key} {n} does not fit its payload", rid)
            vectors.append(np.frombuffer(buf, dtype=np.float32, count=n, offset=n_prompt).copy() if n else None)
            n_prompt += 4 * n
        rest = _floats(buf[n_prompt:], None, "a submit record's voice", rid) if len(buf) > n_prompt else None
        kind = v["speaker"]
        return cls(
            rid=rid,
            prompt=prompt,
            params=SamplingParams(**params),
            max_frames=v["max_frames"],
            ignore_eos=v["ignore_eos"],
            speaker_embedding=rest if kind == "embedding" else None,
            clip=rest if kind == "clip" else None,
            clip_sr=v["clip_sr"],
            hold=v["hold"],
            continues=v["continues"],
            keep_frames=v["keep_frames"],
            uncond_prompt=uncond,
            emotion_delta=vectors[0],
            uncond_speaker=vectors[1],
            first_samples=first,
        )


@dataclass(frozen=True)
class _SubmitHeader:
    """A submit record's header fields (what `_values` checks)."""

    rid: int
    prompt_frames: int
    prompt_width: int
    params: dict[str, Any]
    max_frames: int
    ignore_eos: bool = False
    speaker: str = "none"
    clip_sr: int = 0
    hold: bool = False
    continues: int = 0
    keep_frames: bool = False
    uncond_frames: int = 0
    emotion_dim: int = 0
    uncond_speaker_dim: int = 0
    first_samples: int | None = None


@record
class Cancel(Record):
    type: ClassVar[str] = CANCEL
    rid: int


@record
class End(Record):
    """The continuation of rid's stream ends: its held tail is flushed."""

    type: ClassVar[str] = END
    rid: int


@record
class Embed(Record):
    """Run the speaker_encoder on one clip; answered with an `Embedding` (or an `Error`)."""

    type: ClassVar[str] = EMBED
    rid: int
    clip_sr: int
    clip: np.ndarray  # [N] float32 mono

    def encode(self) -> tuple[dict[str, Any], Payload]:
        return (
            {"type": EMBED, "rid": self.rid, "clip_sr": self.clip_sr},
            np.ascontiguousarray(self.clip, dtype=np.float32),
        )

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes | None) -> Embed:
        v = _values(cls, header, "an embed record", skip=("clip",))
        return cls(**v, clip=_floats(payload, None, "an embed record's clip", v["rid"]))


@record
class Align(Record):
    """Run the aligner on one utterance: its audio and its text; answered with an `Aligned` (or an `Error`)."""

    type: ClassVar[str] = ALIGN
    rid: int
    pcm: np.ndarray  # [N] int16 mono
    sample_rate: int
    text: str

    def encode(self) -> tuple[dict[str, Any], Payload]:
        header = {"type": ALIGN, "rid": self.rid, "sample_rate": self.sample_rate, "text": self.text}
        return header, np.ascontiguousarray(self.pcm, dtype=np.int16).reshape(-1)

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes | None) -> Align:
        v = _values(cls, header, "an align record", skip=("pcm",))
        buf = payload or b""
        if len(buf) % 2:
            raise MalformedRecord(f"an align record's payload of {len(buf)} bytes is not int16 PCM", v["rid"])
        return cls(**v, pcm=np.frombuffer(buf, dtype=np.int16).copy())


@record
class Reset(Record):
    """The gateway process behind this ring was replaced (its supervisor writes this before the new one
    starts): the engine cancels the old process's requests and sends `ready` again on this channel."""

    type: ClassVar[str] = RESET


@record
class Shutdown(Record):
    type: ClassVar[str] = SHUTDOWN


# ---- engine -> gateway --------------------------------------------------------------------------------


@record
class Ready(Record):
    """The engine has loaded and warmed its nodes: what it runs (the gateway's /readyz shows `info()`)."""

    type: ClassVar[str] = READY
    device: str
    dac_device: str
    slots: int
    max_context: int
    load_s: float
    quantization: str
    weights: dict[str, Any]
    speaker_dim: int
    pid: int
    warmup_s: float
    aligner: bool = False  # an aligner is loaded: `align` records are answered
    cpus: str = ""  # the CPUs the engine process runs on (its affinity, as --engine-cpus set it); "": not Linux

    def info(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@record
class Started(Record):
    """A request was admitted: its generation starts."""

    type: ClassVar[str] = STARTED
    rid: int
    queue_ms: float


@record
class Audio(Record):
    """The next PCM chunk of a request (index counts them from 0)."""

    type: ClassVar[str] = AUDIO
    rid: int
    index: int
    pcm: np.ndarray  # int16 at 44.1 kHz

    def encode(self) -> tuple[dict[str, Any], Payload]:
        pcm = np.ascontiguousarray(self.pcm, dtype=np.int16)
        return {"type": AUDIO, "rid": self.rid, "index": self.index, "samples": len(pcm)}, pcm

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes | None) -> Audio:
        v = _values(_AudioHeader, header, "an audio record")
        buf = payload or b""
        if v["samples"] < 0 or len(buf) != 2 * v["samples"]:
            raise MalformedRecord(
                f"an audio record of {v['samples']} samples has a payload of {len(buf)} bytes", v["rid"]
            )
        return cls(rid=v["rid"], index=v["index"], pcm=np.frombuffer(buf, dtype=np.int16))


@dataclass(frozen=True)
class _AudioHeader:
    rid: int
    index: int
    samples: int


@record
class Kept(Record):
    """A held request's kept (trimmed) frames: what the next chunk of its stream continues; or a final
    `keep_frames` request's frames up to its end of audio: what a later request continues."""

    type: ClassVar[str] = KEPT
    rid: int
    frames: np.ndarray  # int [F, N_CODEBOOKS]
    eos_frame: int | None

    def encode(self) -> tuple[dict[str, Any], Payload]:
        frames = np.ascontiguousarray(self.frames, dtype=np.int32).reshape(-1, N_CODEBOOKS)
        return {"type": KEPT, "rid": self.rid, "frames": len(frames), "eos_frame": self.eos_frame}, frames.reshape(-1)

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes | None) -> Kept:
        v = _values(_KeptHeader, header, "a kept record")
        buf = payload or b""
        if v["frames"] < 0 or len(buf) != v["frames"] * N_CODEBOOKS * 4:
            raise MalformedRecord(f"a kept record of {v['frames']} frames has a payload of {len(buf)} bytes", v["rid"])
        frames = np.frombuffer(buf, dtype=np.int32).reshape(-1, N_CODEBOOKS).astype(np.int64)
        return cls(rid=v["rid"], frames=frames, eos_frame=v["eos_frame"])


@dataclass(frozen=True)
class _KeptHeader:
    rid: int
    frames: int
    eos_frame: int | None


@dataclass(frozen=True)
class RequestStats:
    """What the engine measured of one request that ran to its end, in the order its first audio was spent
    (ms; `audio.done`'s `stats.engine`, unchanged). Its clock starts when the submit record was read off
    the inbox, so the gateway's own queueing and the client's play-out are not in it."""

    queue_ms: float  # read -> admitted (a clone request's speaker encoder included)
    prefill_wait_ms: float  # admitted -> its first prompt chunk went into a prefill call
    prefill_ms: float  # -> its first frame was sampled
    first_chunk_ms: float | None  # -> its first audio left: steps + the first DAC call (None: no audio of its own,
    # a continued chunk that handed its stream on before it)
    ttfa_ms: float | None  # read -> its first audio left (the sum of the four above)
    e2e_ms: float  # read -> its last audio left
    prompt_frames: int
    frames: int  # frames generated
    eos_frame: int | None
    audio_s: float  # the audio it sent
    rtf: float | None  # e2e / audio_s
    speaker_encoder_ms: float  # a clone request's speaker encoder (queue included)
    continued: bool  # its stream went on with the next chunk (continuation)
    engine_id: str | None = None  # the engine of the pool that ran it (set by the gateway, --devices)

    def as_dict(self) -> dict[str, Any]:
        """The JSON clients see (engine_id only in a pool)."""
        d = asdict(self)
        if d["engine_id"] is None:
            del d["engine_id"]
        return d


@dataclass(frozen=True)
class CancelStats:
    """A cancel's acknowledgement: the slot is free (already so when the request had ended)."""

    free_ms: float  # the engine's time to free it
    free_slots: int  # the engine's free slots after it
    frames: int | None = None  # what the request had generated (None: it had already ended, or was unknown)


@record
class Finished(Record):
    """A request ended: the last record of its rid (or an `Error`). `stats`: a request that ran to its end;
    `freed`: the engine's acknowledgement of a cancel."""

    type: ClassVar[str] = FINISHED
    rid: int
    reason: str  # eos | max_frames | context | cancelled
    stats: RequestStats | None = None
    freed: CancelStats | None = None

    def encode(self) -> tuple[dict[str, Any], Payload]:
        return {
            "type": FINISHED,
            "rid": self.rid,
            "reason": self.reason,
            "stats": None if self.stats is None else asdict(self.stats),
            "freed": None if self.freed is None else asdict(self.freed),
        }, None

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes | None) -> Finished:
        v = _values(_FinishedHeader, header, "a finished record")
        stats, freed = v["stats"], v["freed"]
        return cls(
            rid=v["rid"],
            reason=v["reason"],
            stats=None if stats is None else RequestStats(**_values(RequestStats, stats, "finished stats")),
            freed=None if freed is None else CancelStats(**_values(CancelStats, freed, "finished freed")),
        )


@dataclass(frozen=True)
class _FinishedHeader:
    rid: int
    reason: str
    stats: dict[str, Any] | None = None
    freed: dict[str, Any] | None = None


@record
class Error(Record):
    """A request failed (rid None: the engine itself, e.g. it could not start). An unknown code reads as
    `internal` (a bug)."""

    type: ClassVar[str] = ERROR
    rid: int | None
    code: EngineError
    message: str
    retry_after_ms: int | None = None  # engine_busy: when to try again

    def encode(self) -> tuple[dict[str, Any], Payload]:
        return {
            "type": ERROR,
            "rid": self.rid,
            "code": self.code.value,
            "message": self.message,
            "retry_after_ms": self.retry_after_ms,
        }, None

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes | None) -> Error:
        v = _values(_ErrorHeader, header, "an error record")
        return cls(
            rid=v["rid"], code=EngineError.of(v["code"]), message=v["message"], retry_after_ms=v["retry_after_ms"]
        )


@dataclass(frozen=True)
class _ErrorHeader:
    rid: int | None
    code: str
    message: str
    retry_after_ms: int | None = None


@record
class Embedding(Record):
    """The speaker_encoder's voice for an `Embed`."""

    type: ClassVar[str] = EMBEDDING
    rid: int
    embedding: np.ndarray  # [dim] float32

    def encode(self) -> tuple[dict[str, Any], Payload]:
        emb = np.ascontiguousarray(self.embedding, dtype=np.float32).reshape(-1)
        return {"type": EMBEDDING, "rid": self.rid, "dim": len(emb)}, emb

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes | None) -> Embedding:
        v = _values(_EmbeddingHeader, header, "an embedding record")
        return cls(rid=v["rid"], embedding=_floats(payload, v["dim"], "an embedding record", v["rid"]))


@dataclass(frozen=True)
class _EmbeddingHeader:
    rid: int
    dim: int


@record
class Aligned(Record):
    """The aligner's word times for an `Align`: each word of its text as written, with its start and end (s from
    the audio's first sample)."""

    type: ClassVar[str] = ALIGNED
    rid: int
    words: tuple[tuple[str, float, float], ...]

    def encode(self) -> tuple[dict[str, Any], Payload]:
        times = np.array([(s, e) for _, s, e in self.words], dtype=np.float64).reshape(-1)
        return {"type": ALIGNED, "rid": self.rid, "words": [w for w, _, _ in self.words]}, times

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes | None) -> Aligned:
        v = _values(_AlignedHeader, header, "an aligned record")
        words = v["words"]
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise MalformedRecord("an aligned record's words must be a list of strings", v["rid"])
        buf = payload or b""
        if len(buf) != 16 * len(words):
            raise MalformedRecord(
                f"an aligned record of {len(words)} words has a payload of {len(buf)} bytes, not 2 float64 each",
                v["rid"],
            )
        times = np.frombuffer(buf, dtype=np.float64).reshape(-1, 2)
        if not (np.isfinite(times).all() and (times >= 0).all() and (times[:, 0] <= times[:, 1]).all()):
            raise MalformedRecord("an aligned record's times must be finite, >= 0 and start <= end", v["rid"])
        return cls(rid=v["rid"], words=tuple((w, float(s), float(e)) for w, (s, e) in zip(words, times, strict=True)))


@dataclass(frozen=True)
class _AlignedHeader:
    rid: int
    words: Any


@record
class Stats(Record):
    """The engine's state, every --stats-interval-s (the gateway's door, placement and metrics read the last one). The
    defaults stand for an engine not heard from (yet, or since it restarted)."""

    type: ClassVar[str] = STATS
    active: int = 0  # requests admitted and not finished
    waiting: int = 0
    free_slots: int = 0
    step_ms_p50: float | None = None
    period_ms: float = 0.0  # the measured iteration period
    min_slack_ms: float | None = None  # the smallest slack over the streams playing (engine/runtime/admission.py)
    prefill_cost_ms: float = 0.0  # what a prefill adds to its iteration (admission charges it to every stream)
    # a first-audio sprint runs while plain_period_ms + sprint_cost_ms stays under the realtime bound (and saves the
    # newcomers enough of their wait: admission.py `may_sprint`): the median iteration with neither a prefill nor a
    # sprint, and what a sprint step adds to its iteration, as measured
    plain_period_ms: float = 0.0
    sprint_cost_ms: float = 0.0
    admissible: int | None = None  # streams that may start now (None: not known)
    starting: int = 0  # admitted streams whose players have not started (admission's slow start counts them)
    dac_in_flight: int = 0
    outbox_bytes: int = 0
    steps: int = 0
    paced: int = 0  # iterations that launched no decode step: the dac_decoder was behind (admission.py)
    # iterations longer than three frames while streams ran (admission.py LATE_PERIOD_S), and how often the OS took
    # the engine loop's core from it: slips, and whether the host's CPUs caused them (both since start)
    late_iterations: int = 0
    loop_preempted: int = 0
    prefill_frames: int = 0
    mixed_frames: int = 0  # of those, prompt frames that rode along with a decode step (one pass over the weights)
    decode_frames: int = 0
    sprint_frames: int = 0  # of those, frames of first-audio sprint steps (EngineSettings.first_audio_sprints)
    # requests since the engine started: admitted into a slot (the door's start rate), finished, and cancelled
    # (waiting or running: a cancel in the queue is no start)
    started: int = 0
    finished: int = 0
    cancelled: int = 0
    # iterations in which a waiting newcomer was held back, by the admission gate that held it (since start)
    held_starting: int = 0
    held_dac_behind: int = 0
    held_slack: int = 0
    held_period: int = 0
    held_cold_start: int = 0


class AdmissionGate(StrEnum):
    """What holds a newcomer back under realtime admission (engine/runtime/admission.py); `Stats.held_<value>`
    counts the iterations each held one."""

    STARTING = "starting"  # slow start: streams whose cost is not seen yet (RealtimeAdmission.starting_limit)
    DAC_BEHIND = "dac_behind"  # the audio decoder is behind the LLM
    SLACK = "slack"  # a playing stream's slack, less the prefill, is under the floor
    PERIOD = "period"  # the predicted iteration period is over headroom x the frame
    COLD_START = "cold_start"  # nothing measured yet: cold_start streams per iteration


REQUESTS: tuple[type[Record], ...] = (SubmitRequest, Cancel, End, Embed, Align, Reset, Shutdown)  # gateway -> engine
EVENTS: tuple[type[Record], ...] = (  # engine -> gateway
    Ready,
    Started,
    Audio,
    Kept,
    Finished,
    Error,
    Embedding,
    Aligned,
    Stats,
)
_BY_TYPE: dict[str, type[Record]] = {cls.type: cls for cls in REQUESTS + EVENTS}


def decode(header: object, payload: bytes | None = None) -> Record:
    """The record a ring held; MalformedRecord when it is none of the contract's."""
    if not isinstance(header, dict):
        raise MalformedRecord(f"a record header must be a map, not {type(header).__name__}")
    kind = header.get("type")
    cls = _BY_TYPE.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MalformedRecord(f"unknown record type {kind!r}"[:200])
    try:
        return cls.decode(header, payload)
    except MalformedRecord:
        raise
    except (TypeError, ValueError) as e:  # e.g. a SamplingParams value msgpack cannot hold
        raise MalformedRecord(
            f"a {cls.type} record: {e}", header.get("rid") if _integer(header.get("rid")) else None
        ) from e
