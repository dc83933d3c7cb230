"""Audio output: every encoding, format and rate table the gateway answers in, the sample conversions, and
the encoders from the engine's int16 PCM at 44.1 kHz to the bytes a client asked for.

* `Encoder` (below): one streaming encoder for every API. The streaming resampler (app/io/resample.py: no
  seams, and output from the engine's first DAC call on), then a sample encoding (`pcm_s16le`, `pcm_f32le`,
  `mulaw`, `alaw`: raw samples, optionally in a WAV container of unknown length) or a compressed format
  (`StreamEncoder`).
* `OutputFormat`: an encoding at a rate (and a container), checked against these tables; each API's door
  builds one from its own names (ours, OpenAI's, ElevenLabs' `pcm_24000`, Cartesia's, Deepgram's).
* `first_samples`: how much of the engine's audio an encoder takes in before it outputs anything, which the
  request tells the engine (SubmitRequest.first_samples) so that its first DAC call is no larger than needed.
* `codec_delay`: how much audio a listener's decoder plays before an encoder's first sample (MP3's and AAC's
  priming), which the word times sent with it are moved by (`Encoder.lead_s`, `Encoder.heard_s`:
  app/core/timestamps.py).

The HTTP file formats, streamed as the audio is generated, through LAME (lameenc) and FFmpeg's libraries (PyAV):

* `pcm` (16-bit little-endian), `mulaw` / `alaw` (G.711, one byte a sample): raw samples, no header.
* `wav`: 16-bit PCM (or any of the dialects' sample encodings, `wav_header`) with the 'unknown length'
  sizes (0xFFFFFFFF) that players accept for streams; soundfile, ffmpeg and Chromium read it.
* `flac`: 16-bit FLAC in frames of `FLAC_BLOCK` samples, FFmpeg's encoder through PyAV, each frame out as soon
  as it is encoded (libsndfile's 4,096-sample blocks held back up to 173 ms of a 24 kHz stream, and its first
  audio needed 7,728 input samples: 10 decode steps more). The header fields only the finished file knows
  (STREAMINFO's sample count and MD5) stay "unknown" in a stream, as in every streamed FLAC (`ffmpeg`,
  browsers and libFLAC decode it; python-soundfile's `sf.read` wants a sample count and refuses such a FLAC).
* `mp3`: MPEG audio frames at a constant bit rate (`MP3_BIT_RATE`) from LAME through lameenc, each frame out
  as soon as LAME has it, no header (none is needed). LAME at its usual quality (`MP3_QUALITY`) costs a
  quarter of the CPU that libsndfile's LAME setup did, for the same first frame.
* `aac`: AAC-LC in ADTS frames (a header on every frame, so a stream needs no file header), FFmpeg's
  native encoder through PyAV; the muxer flushes after every packet.
* `opus`: libopus in Ogg through PyAV, a page per 20 ms packet (`OPUS_BIT_RATE`, VBR): a third of the CPU
  of libsndfile's Opus encoder, whose setup had no way to ask for less, and its first page as soon. FFmpeg's Ogg
  muxer writes a packet's page when the next packet comes (PyAV has no call that flushes it sooner).
  Every stream begins with 20 ms of silence inside its pre-skip (`OPUS_LEAD_IN_MS`): a socket's utterances are a
  chain of streams, which FFmpeg's decoder plays without a reset between them.

`StreamEncoder(fmt, rate, whole=True)` encodes the same way and hands out the finished file at the end, its
header complete (FLAC's sample count and MD5, written into a seekable buffer; WAV's sizes): what a client gets
when it did not ask for a stream (app/doors/openai_speech.py).

G.711 is libsndfile's codec too (its RAW format with the ULAW / ALAW subtype): a well-kept C library
instead of the `audioop` module that Python 3.13 removed.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import io
import logging
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import soundfile as sf

from app.io.checks import check_sample_rate
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.io.resample import TELEPHONE_RATE, StreamResampler
from app.settings import usable_cpus
from engine.contract.constants import SAMPLE_RATE

log = logging.getLogger("gateway.audio")

NATIVE_RATE = SAMPLE_RATE  # what the engine sends; every other rate is resampled from it
# Our WebSocket's and OpenAI's rates; the dialects' (ElevenLabs pcm_8000 ... pcm_48000, Cartesia, Deepgram)
OUTPUT_RATES = (SAMPLE_RATE, 24000, 16000, 8000)
RATES = (8000, 16000, 22050, 24000, 32000, SAMPLE_RATE, 48000)
# the sample encodings (our names); G.711 (`mulaw`, `alaw`: one byte a sample, what telephony speaks) is
# usually wanted at 8000 Hz: a client that names one of them without a sample rate gets 8000 (`default_rate`)
ENCODINGS = ("pcm_s16le", "pcm_f32le", "mulaw", "alaw")
DEFAULT_ENCODING = ENCODINGS[0]  # our socket's, until a session.config names another
G711_RATE = TELEPHONE_RATE
COMPRESSED = ("mp3", "opus", "flac", "aac")  # through StreamEncoder

# name -> media type; every format streams.
FORMATS: dict[str, str] = {
    "pcm": "audio/pcm",
    "wav": "audio/wav",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "mulaw": "audio/PCMU",
    "alaw": "audio/PCMA",
    "aac": "audio/aac",  # ADTS
}
FORMAT_ALIASES = {"ulaw": "mulaw", "pcmu": "mulaw", "pcma": "alaw"}
# media type of each encoding sent raw (a WAV container is audio/wav)
MEDIA_TYPES = {
    "pcm_s16le": "audio/pcm",
    "pcm_f32le": "audio/pcm",
    "mulaw": FORMATS["mulaw"],
    "alaw": FORMATS["alaw"],
    **{k: FORMATS[k] for k in COMPRESSED},
}
G711 = {"mulaw": "ULAW", "alaw": "ALAW"}
# MP3 at a constant bit rate (kbit/s) a rate's MPEG version allows: enough for speech at each (the default)
MP3_BIT_RATE = {8000: 32, 16000: 64, 22050: 64, 24000: 64, 32000: 160, SAMPLE_RATE: 160, 48000: 160}
# the bit rates (kbit/s) each MPEG version defines: MPEG-1 at 32-48 kHz, MPEG-2 at 16-24 kHz, MPEG-2.5 below
MP3_BIT_RATES = {
    1: (32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    2: (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
    3: (8, 16, 24, 32, 40, 48, 56, 64),
}
OPUS_BIT_RATE_RANGE = (6000, 256000)  # what libopus takes for one channel (bit/s; its 510 kbit/s is for two)
# a bit rate a client may ask of MP3 or Opus (bit/s; the nearest the codec offers is used): from the lowest either
# offers to the highest (MP3's 320 kbit/s). Past it, a negative, a 0 or a 10**400 was taken as the nearest in silence
BIT_RATE_RANGE = (OPUS_BIT_RATE_RANGE[0], max(max(r) for r in MP3_BIT_RATES.values()) * 1000)
MP3_QUALITY = 5  # LAME's algorithm quality (0 best, 9 fastest): 5 is its command line's and FFmpeg's default
# Opus (libopus, VBR) bit rates: what libopus chose for speech at each rate on its own, set explicitly
OPUS_BIT_RATE = {8000: 20000, 12000: 24000, 16000: 28000, 24000: 36000, 48000: 60000}
OPUS_RATES = tuple(OPUS_BIT_RATE)
OPUS_GRANULE_RATE = 48000  # Ogg Opus counts samples (granule positions, its header's pre-skip) at 48 kHz at any rate
OPUS_PAGE_MS = 20  # an Ogg page per Opus packet: FFmpeg's default page of 1 s would hold the first audio back
# Every Ogg Opus stream begins with a packet of digital silence (one 20 ms frame, OPUS_PAGE_MS) inside its pre-skip: a
# socket sends a context's utterances as a chain of streams, one per utterance, and a decoder that is not reset at the
# next stream's header (FFmpeg's, native and libopus: ffmpeg, ffplay, PyAV) decoded that stream with the last one's
# state, its first 20 ms up to 10x too loud (CELT codes a band's energy as a change from the last frame's); a silent
# frame sets both the encoder's and any decoder's energies to the same floor, so the stream decodes sample for sample
# as it does alone. Every decoder drops the pre-skip (RFC 7845), this frame with it.
OPUS_LEAD_IN_MS = OPUS_PAGE_MS
# samples in a FLAC frame: a frame goes out whole, so a stream holds back up to one (26 ms at 44.1 kHz, 48 at 24 kHz;
# libsndfile's 4,096 held 93 / 171 ms); 576, FLAC's smallest standard size, would halve that for more frame overhead
FLAC_BLOCK = 1152
# AAC-LC bit rates (FFmpeg's native encoder): enough for speech at each rate, as OpenAI's AAC is ~64 kbit/s
AAC_BIT_RATE = {8000: 24000, 16000: 48000, 22050: 64000, 24000: 64000, 32000: 96000, SAMPLE_RATE: 128000, 48000: 128000}
# WAVE format tags and bits per sample of the sample encodings a WAV may carry
WAV_ENCODINGS = {"pcm_s16le": (1, 16), "pcm_f32le": (3, 32), "alaw": (6, 8), "mulaw": (7, 8)}
_UNKNOWN = 0xFFFFFFFF


def check_encoding(encoding: object) -> str:
    """A client's encoding name (`ulaw` is accepted for `mulaw`), or bad_params."""
    encoding = "mulaw" if encoding == "ulaw" else encoding
    if encoding not in ENCODINGS:
        raise RequestError(G.BAD_PARAMS, f"encoding must be one of {list(ENCODINGS)}")
    return str(encoding)


def default_rate(encoding: str, current: int = NATIVE_RATE) -> int:
    """The sample rate a client gets when it names an encoding and no rate: 8000 for G.711."""
    return G711_RATE if encoding in G711 else current


def int16_bytes(x: np.ndarray) -> bytes:
    """float32 samples in [-1, 1] -> 16-bit little-endian PCM (clipped, rounded)."""
    return np.clip(np.round(x * 32768.0), -32768, 32767).astype("<i2").tobytes()


def sample_bytes(x: np.ndarray, encoding: str) -> bytes:
    """float32 samples -> the bytes of one of ENCODINGS."""
    if encoding == "pcm_f32le":
        return x.astype("<f4", copy=False).tobytes()
    if encoding in G711:
        return g711_encode(x, encoding)
    return int16_bytes(x)


def wav_header(sample_rate: int, encoding: str = "pcm_s16le", data_bytes: int | None = None) -> bytes:
    """RIFF/WAVE header of mono audio in one of WAV_ENCODINGS; without `data_bytes`, for a stream of unknown
    length (both sizes 0xFFFFFFFF)."""
    tag, bits = WAV_ENCODINGS[encoding]
    block = bits // 8
    riff = _UNKNOWN if data_bytes is None else 36 + data_bytes
    data = _UNKNOWN if data_bytes is None else data_bytes
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<IHHIIHH", 16, tag, 1, sample_rate, sample_rate * block, block, bits)
        + b"data"
        + struct.pack("<I", data)
    )


def g711_encode(samples: np.ndarray, law: str) -> bytes:
    """float32 samples in [-1, 1] -> G.711 bytes (`law` is "mulaw" or "alaw"). Sample by sample, so
    chunks encoded one after another are the same bytes as the whole signal encoded at once."""
    if not len(samples):
        return b""
    pcm16 = np.clip(np.round(np.asarray(samples, dtype=np.float32) * 32768.0), -32768, 32767).astype(np.int16)
    buf = io.BytesIO()
    # 16-bit in (libsndfile's float path scales by 32767, not 32768); the rate means nothing to a memoryless
    # codec, libsndfile only wants a valid one
    sf.write(buf, pcm16, 8000, format="RAW", subtype=G711[law])
    return buf.getvalue()


def g711_decode(data: bytes, law: str) -> np.ndarray:
    """G.711 bytes -> float32 samples (tests and clients that want to check what they got)."""
    if not data:
        return np.zeros(0, np.float32)
    x, _ = sf.read(io.BytesIO(data), dtype="float32", samplerate=8000, channels=1, format="RAW", subtype=G711[law])
    return x


class _MuxSink(io.RawIOBase):
    """Where a PyAV muxer writes: collects the bytes until they are taken."""

    def __init__(self) -> None:
        super().__init__()
        self._pending = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self._pending += memoryview(b).cast("B")
        return len(b)

    @property
    def pending(self) -> bytearray:
        return self._pending

    def take(self) -> bytes:
        data = bytes(self._pending)
        self._pending.clear()
        return data


class FfmpegEncoder:
    """float32 mono samples -> one codec's packets in a container, through PyAV (FFmpeg's libraries, loaded by
    the first such answer, not by every gateway), each packet out as soon as the muxer writes it; `whole`: into a
    seekable buffer, the finished file (its header completed by the muxer) out at `close`. `codec` options and the
    samples' `sample_format` in the file (None: the codec's own)."""

    def __init__(
        self,
        container: str,
        codec: str,
        sample_rate: int,
        bit_rate: int | None = None,
        whole: bool = False,
        codec_options: dict[str, str] | None = None,
        sample_format: str | None = None,
        **muxer: str,
    ) -> None:
        import av

        self._av = av
        self.sample_rate = sample_rate
        self._sink: _MuxSink | io.BytesIO = io.BytesIO() if whole else _MuxSink()
        # flush_packets: the muxer's I/O buffer (32 KiB) would otherwise hold seconds of audio back
        self._out = av.open(self._sink, "w", format=container, options={"flush_packets": "1", **muxer})
        stream = self._out.add_stream(codec, rate=sample_rate, layout="mono", options=codec_options or {})
        assert isinstance(stream, av.AudioStream)
        self._stream = stream
        if bit_rate is not None:
            self._stream.bit_rate = bit_rate
        if sample_format is not None:
            self._stream.codec_context.format = sample_format
        self._out.start_encoding()  # the container's header (Ogg's first pages) now: the first write hands it out
        # What a decoder plays of the bytes out (`played`): the samples (at `sample_rate`) of the packets out. FLAC's
        # muxer writes each packet as it comes; Ogg's holds the last one until the next (it closes a page when the next
        # packet would overfill it), so an Ogg packet is out once its page is: the pages out are read for it
        self._ogg = _OggPackets(2) if container == "ogg" else None  # (Ogg Opus's header packets: OpusHead, OpusTags)
        self._queued: collections.deque[int] = collections.deque()  # the durations of the packets muxed, not yet out
        self.played = 0
        if codec == "libopus":  # (the silent lead-in, OPUS_LEAD_IN_MS)
            self._lead_in()
        head = self._sink.getvalue() if isinstance(self._sink, io.BytesIO) else bytes(self._sink.pending)
        # the samples of the first packets a decoder drops (Opus's pre-skip, in its header)
        self.trimmed = opus_pre_skip(head) * sample_rate / OPUS_GRANULE_RATE if codec == "libopus" else 0.0

    def _lead_in(self) -> None:
        """Encode OPUS_LEAD_IN_MS of silence (its packet held by the muxer until the first audio's comes) and add it
        to the pre-skip of the header the muxer wrote (not taken yet), so that decoders drop it."""
        assert isinstance(self._sink, _MuxSink)
        self._encode(np.zeros(self.sample_rate * OPUS_LEAD_IN_MS // 1000, np.float32))
        pages, _ = ogg_pages(bytes(self._sink.pending))
        head = bytearray(pages[0])  # (OpusHead, alone on the stream's first page)
        at = head.index(b"OpusHead") + _OPUS_HEAD_PRE_SKIP
        pre_skip = struct.unpack_from("<H", head, at)[0] + OPUS_GRANULE_RATE * OPUS_LEAD_IN_MS // 1000
        struct.pack_into("<H", head, at, pre_skip)
        ogg_checksum(head)
        self._sink.pending[: len(head)] = head

    def write(self, samples: np.ndarray) -> bytes:
        self._encode(samples)
        return self._take()

    def _encode(self, samples: np.ndarray) -> None:
        if len(samples):
            frame = self._av.AudioFrame.from_ndarray(
                np.ascontiguousarray(samples, np.float32)[None, :], format="flt", layout="mono"
            )
            frame.sample_rate = self.sample_rate
            self._mux(self._stream.encode(frame))  # PyAV regroups the samples into the codec's frames

    def _mux(self, packets: list) -> None:  # (av.Packet, in the codec's time base: 1 / sample_rate)
        if isinstance(self._sink, _MuxSink):  # (a whole file's bytes are all out at the end)
            self._queued.extend(p.duration or 0 for p in packets)
        self._out.mux(packets)

    def _take(self) -> bytes:
        if not isinstance(self._sink, _MuxSink):
            return b""
        data = self._sink.take()
        for _ in range(self._ogg.ended(data) if self._ogg is not None else len(self._queued)):
            self.played += self._queued.popleft()
        return data

    def close(self) -> bytes:
        self._mux(self._stream.encode(None))
        self._out.close()
        return self._take() if isinstance(self._sink, _MuxSink) else self._sink.getvalue()


def ogg_pages(data: bytes) -> tuple[list[bytes], bytes]:
    """The whole Ogg pages `data` begins with (each: a 27-byte header, its segment table of lacing values, their
    bytes) and the rest, a page cut short (ValueError where a page does not begin where the last one ended)."""
    pages, at = [], 0
    while len(data) - at >= 27:
        if data[at : at + 4] != b"OggS":
            raise ValueError("an Ogg page does not begin where the last one ended")
        count = data[at + 26]
        lacing = data[at + 27 : at + 27 + count]
        size = 27 + count + sum(lacing)
        if len(lacing) < count or len(data) - at < size:
            break
        pages.append(data[at : at + size])
        at += size
    return pages, data[at:]


@functools.cache
def _ogg_crc_table() -> tuple[int, ...]:
    """Ogg's page checksum: CRC-32 with the polynomial 0x04C11DB7, neither reflected nor inverted (RFC 3533)."""
    table = []
    for i in range(256):
        c = i << 24
        for _ in range(8):
            c = ((c << 1) ^ 0x04C11DB7) if c & 0x80000000 else c << 1
        table.append(c & 0xFFFFFFFF)
    return tuple(table)


def ogg_checksum(page: bytearray) -> None:
    """Set an Ogg page's checksum field (bytes 22-25) to the checksum of the page with that field zero (a page whose
    bytes were changed: libogg and FFmpeg's demuxer drop a page whose checksum is wrong)."""
    table = _ogg_crc_table()
    page[22:26] = bytes(4)
    crc = 0
    for b in page:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ table[(crc >> 24) ^ b]
    struct.pack_into("<I", page, 22, crc)


class _OggPackets:
    """Counts the packets that end in an Ogg stream's pages as its bytes come (a packet ends at a lacing value below
    255), past the stream's first `headers` packets."""

    def __init__(self, headers: int) -> None:
        self._headers = headers
        self._rest = b""  # a page not whole yet (the muxer writes whole pages: none)

    def ended(self, data: bytes) -> int:
        pages, self._rest = ogg_pages(self._rest + data)
        count = sum(1 for page in pages for n in page[27 : 27 + page[26]] if n < 255)
        skipped = min(count, self._headers)
        self._headers -= skipped
        return count - skipped


def aac_encoder(sample_rate: int) -> FfmpegEncoder:
    """AAC-LC in ADTS frames (FFmpeg's native encoder: it holds about 2048 samples back, its look-ahead)."""
    if sample_rate not in AAC_BIT_RATE:
        raise ValueError(f"aac takes the sample rates {sorted(AAC_BIT_RATE)}")
    return FfmpegEncoder("adts", "aac", sample_rate, AAC_BIT_RATE[sample_rate])


def flac_encoder(sample_rate: int, whole: bool = False) -> FfmpegEncoder:
    """16-bit FLAC in frames of FLAC_BLOCK samples (FFmpeg's encoder; its first audio after ~FLAC_BLOCK samples).
    No PADDING block: FFmpeg's muxer reserves 8 KiB of zeros for tag editors by default, which put 8,288 bytes
    before every answer's first audio (86 with libsndfile), more than a second of 24 kHz speech."""
    return FfmpegEncoder(
        "flac",
        "flac",
        sample_rate,
        whole=whole,
        codec_options={"frame_size": str(FLAC_BLOCK)},
        sample_format="s16",
        metadata_header_padding="0",
    )


def opus_encoder(sample_rate: int, bit_rate: int | None = None) -> FfmpegEncoder:
    """Opus (libopus) in Ogg, pages of at most 20 ms (`first_samples` has what libopus's look-ahead and FFmpeg's
    encoder and muxer hold back before the first audio page)."""
    if sample_rate not in OPUS_BIT_RATE:
        raise ValueError(f"opus takes the sample rates {OPUS_RATES}")
    lo, hi = OPUS_BIT_RATE_RANGE
    bits = OPUS_BIT_RATE[sample_rate] if bit_rate is None else min(max(bit_rate, lo), hi)
    return FfmpegEncoder("ogg", "libopus", sample_rate, bits, page_duration=str(OPUS_PAGE_MS * 1000))


_OPUS_HEAD_PRE_SKIP = 10  # where OpusHead's 16-bit pre-skip is (RFC 7845 5.1: the magic, the version, the channels)


def opus_pre_skip(head: bytes) -> int:
    """The pre-skip of an Ogg Opus stream's header (its OpusHead, in the first page): the samples at 48 kHz of its first
    packets that a decoder drops (libopus's look-ahead, 312, and the silent lead-in, OPUS_LEAD_IN_MS: 1,272)."""
    at = head.find(b"OpusHead")
    if at < 0 or len(head) < at + _OPUS_HEAD_PRE_SKIP + 2:
        raise ValueError("no OpusHead in the Ogg stream's first bytes")
    return int(struct.unpack_from("<H", head, at + _OPUS_HEAD_PRE_SKIP)[0])


def mp3_bit_rate(sample_rate: int, bit_rate: int | None = None) -> int:
    """The MP3 bit rate (kbit/s) for a client that asked for `bit_rate` bit/s (None: the default for the rate):
    the nearest one the rate's MPEG version defines."""
    if bit_rate is None:
        return MP3_BIT_RATE[sample_rate]
    allowed = MP3_BIT_RATES[1 if sample_rate >= 32000 else 2 if sample_rate >= 16000 else 3]
    return min(allowed, key=lambda kbps: (abs(kbps * 1000 - bit_rate), kbps))


class Mp3Encoder:
    """float32 mono samples -> MPEG audio frames at a constant bit rate (LAME, through lameenc, which releases
    the GIL while it encodes), each frame out as soon as LAME has it."""

    def __init__(self, sample_rate: int, bit_rate: int | None = None) -> None:
        if sample_rate not in MP3_BIT_RATE:
            raise ValueError(f"mp3 takes the sample rates {sorted(MP3_BIT_RATE)}")
        import lameenc

        self._lame = lameenc.Encoder()
        self._lame.set_bit_rate(mp3_bit_rate(sample_rate, bit_rate))
        self._lame.set_in_sample_rate(sample_rate)
        self._lame.set_out_sample_rate(sample_rate)  # else LAME may pick another rate for the bit rate
        self._lame.set_channels(1)
        self._lame.set_quality(MP3_QUALITY)
        self._fed = False  # LAME refuses a flush before any encode ("Not currently encoding")

    def write(self, samples: np.ndarray) -> bytes:
        if not len(samples):
            return b""
        self._fed = True
        return bytes(self._lame.encode(int16_bytes(samples)))

    def close(self) -> bytes:
        """The frames LAME still holds; none for a stream that never had audio (a text of breaks that round to no
        sample: an empty answer, not an encoder error that ended the answer or the socket)."""
        return bytes(self._lame.flush()) if self._fed else b""


class StreamEncoder:
    """float32 mono samples in, the bytes of one HTTP format out, as soon as the encoder produces them:
    `write(samples)` returns what is ready (possibly nothing), `close()` the rest. With `whole=True` every
    byte comes from `close()`: the finished file, its header complete (see the module docstring)."""

    def __init__(self, fmt: str, sample_rate: int, whole: bool = False, bit_rate: int | None = None) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}")
        self.fmt, self.sample_rate, self.whole = fmt, sample_rate, whole
        self._header = wav_header(sample_rate) if fmt == "wav" and not whole else b""
        self._held = bytearray()  # whole: everything so far (wav's samples; the others' output)
        self._frames: FfmpegEncoder | Mp3Encoder | None = None  # the codecs
        if fmt == "aac":
            self._frames = aac_encoder(sample_rate)
        elif fmt == "opus":
            self._frames = opus_encoder(sample_rate, bit_rate)
        elif fmt == "mp3":
            self._frames = Mp3Encoder(sample_rate, bit_rate)
        elif fmt == "flac":  # a whole file is written into a seekable buffer: the muxer completes its header
            self._frames = flac_encoder(sample_rate, whole)

    def write(self, samples: np.ndarray) -> bytes:
        data = self._encode(np.asarray(samples, dtype=np.float32))
        if self.whole:
            self._held += data
            return b""
        return data

    def _encode(self, x: np.ndarray) -> bytes:
        head, self._header = self._header, b""
        if self.fmt in ("pcm", "wav"):
            return head + int16_bytes(x)
        if self.fmt in G711:
            return g711_encode(x, self.fmt)
        assert self._frames is not None
        return self._frames.write(x)

    @property
    def played(self) -> float:
        """FLAC's and Opus's (FfmpegEncoder's packets): the samples a decoder plays of the bytes out so far, the stream
        not closed: its packets' samples less Opus's pre-skip (its end trimming is in the last page only)."""
        assert isinstance(self._frames, FfmpegEncoder)
        return max(0.0, self._frames.played - self._frames.trimmed)

    def close(self) -> bytes:
        if self._frames is not None:
            tail = self._frames.close()
        else:
            tail, self._header = self._header, b""
        if not self.whole or (self.fmt != "wav" and not self._held):
            return tail  # a stream's rest, or the finished file a seekable encoder wrote (FLAC's): as it is, no copy
        # joined in place: the finished file is in memory at most twice (the samples and the bytes returned)
        data, self._held = self._held, bytearray()
        data += tail
        if self.fmt == "wav":
            data[:0] = wav_header(self.sample_rate, data_bytes=len(data))
        return bytes(data)


@dataclass(frozen=True)
class OutputFormat:
    """An encoding (one of ENCODINGS or COMPRESSED) at a rate; the sample encodings optionally in a WAV
    container of unknown length (a stream's)."""

    encoding: str
    sample_rate: int
    wav: bool = False
    bit_rate: int | None = None  # bit/s a client asked of MP3 or Opus (the nearest the codec offers); None: ours

    def check(self, rates: tuple[int, ...] = RATES, code: str = G.UNSUPPORTED_FORMAT) -> OutputFormat:
        """Refused with `code` unless an encoder offers it at one of `rates`."""
        if self.encoding not in ENCODINGS + COMPRESSED:
            raise RequestError(code, f"unsupported encoding {self.encoding!r}")
        if self.wav and self.encoding not in ENCODINGS:
            raise RequestError(code, f"{self.encoding} does not go in a WAV container")
        if self.encoding == "opus":
            rates = tuple(r for r in rates if r in OPUS_RATES)
        elif self.encoding == "aac":
            rates = tuple(r for r in rates if r in AAC_BIT_RATE)
        what = (
            f"{self.encoding} takes the sample rates"
            if self.encoding in ("opus", "aac")
            else "sample rate must be one of"
        )
        check_sample_rate(self.sample_rate, rates, code, what, f", not {self.sample_rate}")
        lo, hi = BIT_RATE_RANGE
        if self.bit_rate is not None and not lo <= self.bit_rate <= hi:
            shown = str(self.bit_rate)[:40]
            raise RequestError(code, f"bit_rate must be in {lo}..{hi} bit/s (the nearest a codec offers), not {shown}")
        return self

    @property
    def media_type(self) -> str:
        return "audio/wav" if self.wav else MEDIA_TYPES[self.encoding]

    def encoder(self, whole: bool = False) -> Encoder:
        return Encoder(self.encoding, self.sample_rate, wav=self.wav, whole=whole, bit_rate=self.bit_rate)


class Encoder:
    """int16 PCM at 44.1 kHz from the engine -> one output format, chunk by chunk: `encode(pcm16)` returns
    what is ready, `encode(..., last=True)` the rest. `whole` (a compressed format, or a WAV): every byte at
    the end, the file's header complete (StreamEncoder). `threaded`: its encoder is worth a worker thread."""

    def __init__(
        self,
        encoding: str = "pcm_s16le",
        sample_rate: int = NATIVE_RATE,
        wav: bool = False,
        whole: bool = False,
        bit_rate: int | None = None,
    ) -> None:
        self.encoding, self.sample_rate = encoding, sample_rate
        self._rs = StreamResampler(sample_rate) if sample_rate != NATIVE_RATE else None
        self._file: StreamEncoder | None = None
        if encoding in COMPRESSED:
            self._file = StreamEncoder(encoding, sample_rate, whole, bit_rate)
        elif wav and whole:  # the finished file: its sizes are known at the end
            if encoding != "pcm_s16le":
                raise ValueError("a whole WAV file holds pcm_s16le")
            self._file = StreamEncoder("wav", sample_rate, whole=True)
        self._header = wav_header(sample_rate, encoding) if wav and self._file is None else b""
        self.threaded = encoding in COMPRESSED
        self._in = 0  # 44.1 kHz samples taken in
        self._out = 0  # samples at the output rate put out (to the file encoder, for a compressed format)
        # MP3's and AAC's frames out, counted by FFmpeg's parser of the format (`heard_s`) once `follow` asks
        self._parser = None
        self._frames = 0
        self._made = 0  # samples at the output rate the resampler made (`_out` counts them all out at the last call)
        self._closed = False  # the last call came

    @property
    def native_out(self) -> int:
        """How many of the 44.1 kHz samples taken in are out of the resampler (all of them without one; the
        resampler holds back its last block, up to ~40 ms, until more comes or the last call)."""
        if self._rs is None:
            return self._in
        return min(self._in, self._out * NATIVE_RATE // self.sample_rate)

    @property
    def first_samples(self) -> int:
        """What the engine's first audio must bring for this encoder to output any (`first_samples`)."""
        return first_samples(self.encoding, self.sample_rate)

    @property
    def lead_s(self) -> float:
        """Seconds of audio a listener's decoder plays before the stream's first sample (`codec_delay`: MP3's and
        AAC's priming, ~0 for the others): the word times of what this encoder sends are that much later."""
        return codec_delay(self.encoding, self.sample_rate) / self.sample_rate

    def follow(self) -> None:
        """Count the frames put out, for `heard_s`: asked (before the first `encode`) by a timeline whose word times
        follow this encoder's decoded audio (app/core/timestamps.py AudioTimeline's `heard`); its MP3 or AAC then
        comes out in whole frames, each as soon as it is complete. Only then: FFmpeg's frame parser and the frames'
        copies cost 3-11 us a 5,120-sample MP3 chunk, 1-3 % of its encoding (4-11 % in end-to-end runs on a busy
        machine), which an answer without word times (most of them) has no use for."""
        if self.encoding not in FRAME_SAMPLES or self._parser is not None:
            return
        if self._in:
            raise RuntimeError("an encoder's frames are counted from its first one: follow() it before encode()")
        self._parser = _frame_parser(self.encoding)

    @property
    def heard_s(self) -> float:
        """Seconds of audio a decoder makes of the bytes out so far, the lead included: MP3's and AAC's whole frames
        (each a fixed count of samples, `FRAME_SAMPLES`; once closed, the lead, the audio and the last frame's
        padding); FLAC's and Opus's packets out (`PACKETS_PLAYED`: up to a frame or two less than the samples taken in;
        Opus's less its pre-skip; once closed, the audio itself: Opus's last page trims its last packet's padding); the
        samples themselves for the others."""
        if self.encoding in FRAME_SAMPLES:
            if self._parser is None:
                raise RuntimeError("the frames of an encoder nothing follows are not counted: follow() it first")
            return self._frames * frame_samples(self.encoding, self.sample_rate) / self.sample_rate
        if self.encoding in PACKETS_PLAYED and not self._closed:
            assert self._file is not None
            return self._file.played / self.sample_rate + self.lead_s
        return (self._in if self._rs is None else self._made) / self.sample_rate + self.lead_s

    @property
    def native_heard(self) -> int:
        """How many of the 44.1 kHz samples taken in a decoder has played from the bytes out so far (`heard_s`
        less the lead; at most `native_out`)."""
        return min(self.native_out, max(0, int((self.heard_s - self.lead_s) * NATIVE_RATE + 1e-6)))

    def float32(self, pcm16: np.ndarray, last: bool = False) -> np.ndarray:
        """int16 at 44.1 kHz -> float32 at the output rate (the streaming resampler)."""
        x = pcm16.astype(np.float32) / 32768.0
        if self._rs is not None:
            x = self._rs(x, last=last)
        return x

    def encode(self, pcm16: np.ndarray, last: bool = False) -> bytes:
        head, self._header = self._header, b""
        self._in += len(pcm16)
        if self._rs is None and self.encoding == "pcm_s16le" and self._file is None:
            return head + pcm16.astype("<i2", copy=False).tobytes()
        x = self.float32(pcm16, last)
        self._out += len(x)
        self._made += len(x)
        if last:
            self._out = max(self._out, -(-self._in * self.sample_rate // NATIVE_RATE))  # all of it is out
            self._closed = True
        if self._file is not None:
            data = self._file.write(x)
            if last:
                data += self._file.close()
            if self._parser is not None and (data or last):
                # whole frames only (LAME hands out a frame's first bytes long before the rest): what is sent is
                # what a decoder plays, and a stream cut off (a barge-in) ends on a frame, not with a piece of one
                # that a decoder fed the next stream too reads with that stream's first frame
                frames = self._parser.parse(data) if data else []
                if last:
                    frames += self._parser.parse(None)  # (the parser's buffer: nothing, the last frame is whole)
                self._frames += len(frames)
                data = b"".join(bytes(f) for f in frames)
            return head + data
        return head + sample_bytes(x, self.encoding)


# What `first_samples` found with the pinned resampler and codecs (requirements.txt): each is checked when asked
# (it holds where an encoder fed that many samples has audio out and one fed one fewer has none) and searched for
# again where it does not (another codec build)
_RESAMPLER_FIRST = {8000: 108, 16000: 128, 22050: 93, 24000: 86, 32000: 65, 48000: 48}
_FIRST_SAMPLES_SEEN = {
    **{(e, rate): n for e in ENCODINGS for rate, n in _RESAMPLER_FIRST.items()},
    **{("mp3", r): n for r, n in zip(RATES, (9103, 4744, 3514, 3208, 3860, 2528, 2562), strict=True)},
    **{("flac", r): n for r, n in zip(RATES, (7311, 4744, 3514, 3208, 2372, 1152, 1742), strict=True)},
    **{("aac", r): n for r, n in zip(RATES, (12687, 6232, 5174, 4714, 3116, 2048, 2562), strict=True)},
    ("opus", 8000): 1866,
    ("opus", 16000): 3256,
    ("opus", 24000): 3208,
    ("opus", 48000): 2562,
}


def _mp3_frames(data: bytes) -> int:
    """The whole MPEG audio frames at the start of `data` (FFmpeg's parser, which knows a frame's length from its
    header; the frame cut short at the end is not counted)."""
    import av

    return len(av.CodecContext.create("mp3", "r").parse(data))


# The samples each frame of a format decodes to: MP3's (MPEG-1 Layer III at 32-48 kHz; MPEG-2 and 2.5 below, half as
# many) and ADTS AAC-LC's (FFmpeg's encoder writes one raw block a frame)
FRAME_SAMPLES = {"mp3": 1152, "aac": 1024}
# The formats whose encoders hold back up to a frame of the samples taken in (FLAC's FLAC_BLOCK; Opus's 20 ms packet,
# and Ogg's muxer the last packet until the next) and put out whole frames or pages: a decoder has their packets'
# samples out (`heard_s`)
PACKETS_PLAYED = ("flac", "opus")
# The formats' demuxers (FFmpeg's, through PyAV) that `decode_output` reads a stream with
_DEMUXERS = {"mp3": "mp3", "aac": "aac", "opus": "ogg", "flac": "flac"}


def frame_samples(encoding: str, sample_rate: int) -> int:
    """The samples one frame of `encoding` (one of FRAME_SAMPLES) at `sample_rate` decodes to."""
    n = FRAME_SAMPLES[encoding]
    return n // 2 if encoding == "mp3" and sample_rate < 32000 else n


def _frame_parser(encoding: str):  # -> av.CodecContext (PyAV is loaded by the first compressed answer)
    import av

    return av.CodecContext.create(encoding, "r")


def decode_output(data: bytes, encoding: str, sample_rate: int) -> tuple[np.ndarray, int]:
    """An encoder's output (one of ENCODINGS, raw, or COMPRESSED) as a listener's decoder makes it: float32 samples
    and their rate. A compressed stream goes through FFmpeg's demuxer and decoder (PyAV), as a streaming player
    plays it: nothing trimmed but what the stream itself says (Ogg Opus's pre-skip; MP3 and ADTS carry no such
    field here); libopus decodes at 48 kHz whatever the stream's rate."""
    if encoding == "pcm_f32le":
        return np.frombuffer(data, "<f4").astype(np.float32), sample_rate
    if encoding in G711:
        return g711_decode(data, encoding).astype(np.float32), sample_rate
    if encoding not in COMPRESSED:
        return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0, sample_rate
    if not data:
        return np.zeros(0, np.float32), sample_rate
    import av

    pieces, rate = [], sample_rate
    with av.open(io.BytesIO(data), "r", format=_DEMUXERS[encoding]) as container:
        for frame in container.decode(audio=0):
            pieces.append(frame.to_ndarray().astype(np.float32).reshape(-1))  # (mono: one plane or one row)
            rate = frame.sample_rate
    return (np.concatenate(pieces) if pieces else np.zeros(0, np.float32)), rate


# What `codec_delay` found with the pinned codecs (requirements.txt), in samples at the output's rate: LAME's encoder
# delay (576) and the MP3 decoder's (529) at every rate; FFmpeg's AAC priming (1,024), which ADTS cannot tell a
# decoder to skip; 0 for Opus (Ogg's pre-skip is in its header: FFmpeg and browsers trim it), FLAC and the samples
# (the resampler is aligned: app/io/resample.py). Each is compared with what is measured (a difference is logged:
# another codec build), and the measurement is what is used.
_DELAY_SEEN = {("mp3", r): 1105 for r in RATES} | {("aac", r): 1024 for r in AAC_BIT_RATE}


def _xcorr_lag(x: np.ndarray, ref: np.ndarray) -> int:
    """The lag (>= 0) at which `ref` best matches `x` (FFT cross-correlation)."""
    n = 1 << (len(x) + len(ref)).bit_length()
    corr = np.fft.irfft(np.fft.rfft(x, n) * np.conj(np.fft.rfft(ref, n)), n)
    return int(np.argmax(corr[: max(1, len(x))]))


@functools.cache
def codec_delay(encoding: str, sample_rate: int) -> int:
    """The samples (at `sample_rate`) a listener's decoder plays before the first sample of an `Encoder`'s stream:
    its codec's delay as a decoder sees it (MP3's 1,105: 25 ms at 44.1 kHz, 46 ms at 24 kHz; AAC's 1,024) and the
    resampler's (none). Asked of the encoders themselves, once per output: a fresh encoder's stream of a noise burst
    after 50 ms of silence, decoded (`decode_output`), against the burst resampled to the decoder's rate in one call
    (soxr VHQ: aligned); the lag of their best match. A stream of several utterances has it at each: every utterance
    has its own encoder (app/core/playback.py), a new stream whose decoded audio begins with it again."""
    if encoding not in COMPRESSED and sample_rate == NATIVE_RATE:
        return 0
    import soxr

    rng = np.random.default_rng(0)
    burst = np.convolve(rng.standard_normal(NATIVE_RATE // 8), np.ones(4) / 4, "same") * 0.1  # (speech-like band)
    signal = np.concatenate([np.zeros(NATIVE_RATE // 20), burst]).astype(np.float32)  # (the last call flushes it all)
    pcm16 = np.round(signal * 32768).astype(np.int16)
    decoded, rate = decode_output(Encoder(encoding, sample_rate).encode(pcm16, last=True), encoding, sample_rate)
    ref = pcm16.astype(np.float32) / 32768.0
    if rate != NATIVE_RATE:
        ref = soxr.resample(ref, NATIVE_RATE, rate, "VHQ")
    delay = round(_xcorr_lag(decoded, ref) * sample_rate / rate)
    seen = _DELAY_SEEN.get((encoding, sample_rate), 0)
    if delay != seen:
        log.warning(
            "%s at %d Hz: a decoder's delay is %d samples, not the %d seen (another codec build)",
            encoding,
            sample_rate,
            delay,
            seen,
        )
    return delay


@functools.cache
def first_samples(encoding: str, sample_rate: int) -> int:
    """The fewest 44.1 kHz samples after which an `Encoder` of `encoding` at `sample_rate` has output audio:
    what its resampler holds back (48 for 48 kHz, 86 for 24 kHz, 128 for 16 kHz, 108 for 8 kHz: the bridge
    at its start, app/io/resample.py; all within the engine's first 10-frame DAC call) and, for a compressed
    format, its codec (LAME's and AAC's frames and look-ahead, FLAC's blocks (FLAC_BLOCK), Opus's Ogg
    pages). Asked of the encoders themselves, once per output: fresh encoders fed more and more (more input
    never gives less output). Audio means bytes a decoder plays: FLAC's and Opus's packets past their headers
    (`Encoder.native_heard`: Opus's first page past its header is its silent lead-in, which decoders drop with the
    pre-skip), AAC's frames, and for MP3 a whole frame: LAME hands out the first bytes of a frame long before the
    rest (at 24 kHz 157 of the first frame's 192 bytes after 1,554 samples, the rest after 3,208), which no
    streaming player can play, so a first call sized for those bytes left an MP3 listener's first audio to the next
    call, 10 steps later; 1 at the native rate in a sample encoding (nothing held back)."""
    if encoding not in COMPRESSED and sample_rate == NATIVE_RATE:
        return 1
    header = len(StreamEncoder(encoding, sample_rate).write(np.zeros(1, np.float32))) if encoding in COMPRESSED else 0
    signal = (np.random.default_rng(0).standard_normal(NATIVE_RATE) * 3000).astype(np.int16)

    def outputs(n: int) -> bool:
        enc = Encoder(encoding, sample_rate)
        data = enc.encode(signal[:n])
        if encoding in PACKETS_PLAYED:  # (Opus's first page past its header is its silent lead-in, all pre-skip)
            return enc.native_heard > 0
        return bool(_mp3_frames(data)) if encoding == "mp3" else len(data) > header

    seen = _FIRST_SAMPLES_SEEN.get((encoding, sample_rate))
    if seen is not None and outputs(seen) and not outputs(seen - 1):  # two encoders, not a search of ~16
        return seen
    lo, hi = 1, NATIVE_RATE  # a second of audio always has output
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if outputs(mid) else (mid + 1, hi)
    return lo


def warm_outputs() -> None:
    """Ask `first_samples` and `codec_delay` of every output an encoder offers, once, at start (in a worker thread;
    ~0.5 s). Asked by a request, a new output's search (a few ms; AAC's 0.1-0.2 s) held the event loop, every socket's
    audio, and
    the codec libraries it loads first (PyAV, soxr, libsamplerate) stayed outside the startup heap that is
    frozen out of the collector's passes: ~8,000 objects that every full collection walked."""
    for encoding in ENCODINGS + COMPRESSED:
        for rate in RATES:
            try:
                OutputFormat(encoding, rate).check()
            except RequestError:
                continue
            first_samples(encoding, rate)
            codec_delay(encoding, rate)


# The codecs' own threads: audio on its way to a listener never waits behind the bulk work of the loop's default
# executor (a flood of uploads decoding clips can hold every thread there)
_CODEC_THREADS = ThreadPoolExecutor(max_workers=min(32, usable_cpus() + 4), thread_name_prefix="codec")


async def encode(enc: Encoder, pcm16: np.ndarray, last: bool = False) -> bytes:
    """`enc.encode` off the event loop where it is heavy: a compressed format's codec (LAME, libopus, libFLAC,
    FFmpeg's AAC) runs in one of the codec threads, with the GIL released; raw samples are encoded inline."""
    if not enc.threaded:
        return enc.encode(pcm16, last)
    return await asyncio.get_running_loop().run_in_executor(_CODEC_THREADS, enc.encode, pcm16, last)
