"""Output formats for HTTP responses, all streamed as the audio is generated, through libsndfile (soundfile).

* `pcm` (16-bit little-endian), `mulaw` / `alaw` (G.711, one byte a sample): raw samples, no header.
* `wav`: 16-bit PCM with the 'unknown length' sizes (0xFFFFFFFF) that players accept for streams.
* `flac`, `mp3` (constant bit rate), `opus` (in Ogg, pages of ~50 ms): libsndfile's encoders write into
  a `StreamSink`, and every byte they append goes out as soon as it exists. At the end an encoder seeks
  back to fill in header fields that only the finished file knows (FLAC's STREAMINFO sample count and
  MD5, LAME's Info frame); those bytes were sent already, so a streamed file leaves them "unknown", as
  every streamed FLAC and MP3 does (`ffmpeg`, browsers and libFLAC decode them; python-soundfile's
  `sf.read` wants a sample count and refuses such a FLAC, read it with `sf.blocks` or libFLAC instead).

G.711 is libsndfile's codec too (its RAW format with the ULAW / ALAW subtype): a well-kept C library
instead of the `audioop` module that Python 3.13 removed.
"""

from __future__ import annotations

import io
import logging
import struct

import numpy as np
import soundfile as sf

log = logging.getLogger("gateway.audio")

# name -> (media type, soundfile format, subtype); every format streams.
FORMATS: dict[str, tuple[str, str | None, str | None]] = {
    "pcm": ("audio/pcm", None, None),
    "wav": ("audio/wav", "WAV", "PCM_16"),
    "flac": ("audio/flac", "FLAC", "PCM_16"),
    "mp3": ("audio/mpeg", "MP3", "MPEG_LAYER_III"),
    "opus": ("audio/ogg", "OGG", "OPUS"),
    "mulaw": ("audio/PCMU", "RAW", "ULAW"),
    "alaw": ("audio/PCMA", "RAW", "ALAW"),
}
FORMAT_ALIASES = {"ulaw": "mulaw", "pcmu": "mulaw", "pcma": "alaw"}
G711 = {"mulaw": "ULAW", "alaw": "ALAW"}
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
MP3_COMPRESSION = 0.6  # constant bit rate: 64 kbit/s at 16-24 kHz, 32 at 8 kHz, 160 at 44.1 kHz
OPUS_PAGE_MS = 50.0  # libsndfile's default Ogg page latency is 1 s: the first Opus bytes would wait for it
_SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302  # sndfile.h


def wav_stream_header(sample_rate: int, channels: int = 1, bits: int = 16) -> bytes:
    """RIFF/WAVE header for a stream of unknown length (sizes set to 0xFFFFFFFF)."""
    block = channels * bits // 8
    return (
        b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block, bits)
        + b"data" + struct.pack("<I", 0xFFFFFFFF)
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
    x, _ = sf.read(io.BytesIO(data), dtype="float32", samplerate=8000, channels=1, format="RAW",
                   subtype=G711[law])
    return x


class StreamSink(io.RawIOBase):
    """A seekable file for libsndfile that hands out what the encoder appends, as it appends it.

    Bytes are handed out once (`take`) and then forgotten. A write that lands on bytes already handed out
    (an encoder patching its header when it closes) can no longer reach the client and is dropped."""

    def __init__(self) -> None:
        super().__init__()
        self._sent = 0  # bytes handed out; the file offset of _pending[0]
        self._pending = bytearray()
        self._pos = 0
        self.dropped = 0  # bytes of late header patches that were not sent

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def _end(self) -> int:
        return self._sent + len(self._pending)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._end()}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def write(self, b) -> int:  # type: ignore[override]
        data = memoryview(b).cast("B")
        n = len(data)
        start = self._pos
        if start < self._sent:  # the part already handed out cannot change any more
            skip = min(n, self._sent - start)
            self.dropped += skip
            data, start = data[skip:], start + skip
        if len(data):
            offset = start - self._sent
            if offset > len(self._pending):
                self._pending.extend(bytes(offset - len(self._pending)))
            self._pending[offset:offset + len(data)] = data
        self._pos += n
        return n

    def read(self, size: int = -1) -> bytes:
        # Encoders do not read back what they wrote; what was handed out reads as nothing.
        offset = self._pos - self._sent
        if offset < 0:
            return b""
        end = len(self._pending) if size is None or size < 0 else offset + size
        data = bytes(self._pending[offset:end])
        self._pos += len(data)
        return data

    def take(self) -> bytes:
        data = bytes(self._pending)
        self._sent += len(data)
        self._pending.clear()
        return data


class StreamEncoder:
    """float32 mono samples in, the bytes of one HTTP format out, as soon as the encoder produces them:
    `write(samples)` returns what is ready (possibly nothing), `close()` the rest."""

    def __init__(self, fmt: str, sample_rate: int) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}")
        if fmt == "opus" and sample_rate not in OPUS_RATES:
            raise ValueError(f"opus takes the sample rates {OPUS_RATES}")
        self.fmt, self.sample_rate = fmt, sample_rate
        self._header = wav_stream_header(sample_rate) if fmt == "wav" else b""
        self._sink: StreamSink | None = None
        self._file: sf.SoundFile | None = None
        if fmt in ("flac", "mp3", "opus"):
            _, container, subtype = FORMATS[fmt]
            self._sink = StreamSink()
            extra = {"bitrate_mode": "CONSTANT", "compression_level": MP3_COMPRESSION} if fmt == "mp3" else {}
            self._file = sf.SoundFile(self._sink, "w", sample_rate, 1, format=container, subtype=subtype, **extra)
            if fmt == "opus":
                _set_ogg_page_latency(self._file, OPUS_PAGE_MS)

    def write(self, samples: np.ndarray) -> bytes:
        head, self._header = self._header, b""
        x = np.asarray(samples, dtype=np.float32)
        if self.fmt in ("pcm", "wav"):
            return head + np.clip(np.round(x * 32768.0), -32768, 32767).astype("<i2").tobytes()
        if self.fmt in G711:
            return g711_encode(x, self.fmt)
        assert self._file is not None and self._sink is not None
        if len(x):
            self._file.write(x)
        return self._sink.take()

    def close(self) -> bytes:
        if self._file is None:
            head, self._header = self._header, b""
            return head
        assert self._sink is not None
        self._file.close()
        self._file = None
        if self._sink.dropped:
            log.debug("%s stream: %d header bytes patched at the end were already sent", self.fmt, self._sink.dropped)
        return self._sink.take()


def _set_ogg_page_latency(f: sf.SoundFile, ms: float) -> None:
    """libsndfile >= 1.2 closes an Ogg page every `ms` of audio (soundfile has no wrapper for the command)."""
    try:
        from soundfile import _ffi, _snd  # type: ignore[attr-defined]

        value = _ffi.new("double*", float(ms))
        _snd.sf_command(f._file, _SFC_SET_OGG_PAGE_LATENCY_MS, value, _ffi.sizeof("double"))
    except Exception as e:  # an older libsndfile: pages of ~1 s, still a valid stream
        log.warning("could not set the Ogg page latency: %s", e)


def encode_file(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """Encode float32 mono samples into a whole file of the given format (what a stream of it holds)."""
    enc = StreamEncoder(fmt, sample_rate)
    return enc.write(samples) + enc.close()
