"""The HTTP output formats without a server: G.711 against the standard's formulas, the streaming sink."""

from __future__ import annotations

import io

import numpy as np
import pytest

from app.audio_formats import FORMATS, StreamEncoder, StreamSink, g711_decode, g711_encode
from app.synthesis import PcmEncoder, RequestError, check_encoding, default_rate
from tests.test_gateway_http import EXTRA_SAMPLES, decode


def mulaw_byte(s: int) -> int:
    """G.711 mu-law of a 16-bit sample, written from the standard: the 14-bit magnitude plus the bias 33,
    its segment (exponent) and 4 mantissa bits, sign on top, all bits inverted."""
    sign = 0x80 if s < 0 else 0
    mag = min((abs(s) >> 2) + 33, 0x1FFF)
    seg = mag.bit_length() - 6
    return ~(sign | (seg << 4) | ((mag >> (seg + 1)) & 0xF)) & 0xFF


def alaw_byte(s: int) -> int:
    """G.711 A-law: the 13-bit magnitude, linear below 32 and logarithmic above, sign set for positive
    values, even bits inverted (xor 0x55)."""
    sign = 0x80 if s >= 0 else 0
    mag = min(abs(s) >> 3, 0xFFF)
    if mag < 32:
        code = mag >> 1
    else:
        seg = mag.bit_length() - 5
        code = (seg << 4) | ((mag >> seg) & 0xF)
    return (sign | code) ^ 0x55


@pytest.mark.parametrize("law, ref", [("mulaw", mulaw_byte), ("alaw", alaw_byte)])
def test_g711_matches_the_standard_on_every_16bit_value(law, ref):
    s16 = np.arange(-32768, 32768, dtype=np.int32)
    got = np.frombuffer(g711_encode((s16 / 32768).astype(np.float32), law), np.uint8)
    want = np.array([ref(int(v)) for v in s16], np.uint8)
    assert np.array_equal(got, want)
    # decoding gives each code's level: the round trip is within the step of the sample's segment
    back = g711_decode(got.tobytes(), law)
    x = s16 / 32768
    assert np.all(np.abs(back - x) <= np.maximum(np.abs(x) / 16, 2 ** -9))
    assert g711_encode(np.zeros(1, np.float32), law) == (b"\xff" if law == "mulaw" else b"\xd5")


@pytest.mark.parametrize("law", ["mulaw", "alaw"])
def test_g711_chunks_equal_the_whole(law):
    x = (0.5 * np.sin(np.arange(8000) / 7)).astype(np.float32)
    whole = g711_encode(x, law)
    assert b"".join(g711_encode(x[i:i + 333], law) for i in range(0, len(x), 333)) == whole
    pcm = np.round(x * 32767).astype(np.int16)
    enc = PcmEncoder(law, 8000)
    assert enc.bytes_per_sample == 1
    assert len(enc.encode(pcm[:4410]) + enc.encode(pcm[4410:], last=True)) == pytest.approx(8000 * 8000 / 44100, abs=2)


def test_encoding_names_and_default_rates():
    assert check_encoding("ulaw") == "mulaw" and check_encoding("alaw") == "alaw"
    with pytest.raises(RequestError):
        check_encoding("opus")
    assert default_rate("mulaw", 24000) == 8000 and default_rate("pcm_s16le", 24000) == 24000


def test_sink_hands_out_appends_and_drops_late_header_patches():
    sink = StreamSink()
    sink.write(b"HEADER--")
    sink.write(b"data1")
    assert sink.take() == b"HEADER--data1"
    sink.seek(0)
    sink.write(b"PATCH")  # an encoder filling in its header at the end: already sent
    sink.seek(0, io.SEEK_END)
    sink.write(b"data2")
    assert sink.take() == b"data2" and sink.dropped == 5
    sink.seek(10)  # a write that straddles what was sent keeps only its new part
    sink.write(b"xxxxxxxxYY")
    assert sink.take() == b"YY"
    assert sink.tell() == 20


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_stream_encoders_emit_while_encoding(fmt):
    """Every format gives bytes before its end (what lets HTTP stream it), and the pieces decode whole."""
    rate = 8000 if fmt in ("mulaw", "alaw") else 24000
    x = (0.3 * np.sin(2 * np.pi * 220 * np.arange(2 * rate) / rate)).astype(np.float32)
    enc = StreamEncoder(fmt, rate)
    pieces = [enc.write(x[i:i + rate // 10]) for i in range(0, len(x), rate // 10)]
    pieces.append(enc.close())
    first_half = b"".join(pieces[:10])
    assert len(first_half) > 0.2 * sum(map(len, pieces))  # the first second is out before the second one is in
    data = b"".join(pieces)
    if fmt in ("wav", "flac", "mp3", "opus"):
        y, sr = decode(data)
        assert sr == rate and len(x) <= len(y) <= len(x) + EXTRA_SAMPLES.get(fmt, 0)
    elif fmt == "pcm":
        assert len(data) == 2 * len(x)
    else:
        assert len(data) == len(x)
