"""The HTTP output formats without a server: G.711 against the standard's formulas, the streaming sink, AAC
decoded by FFmpeg (PyAV and the ffmpeg program), whole FLAC and WAV files that soundfile and wave open."""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
import tracemalloc
import wave

import av
import numpy as np
import pytest
import soundfile as sf

from app.io import audio_output
from app.io.audio_output import (
    COMPRESSED,
    ENCODINGS,
    FORMATS,
    MP3_BIT_RATE,
    NATIVE_RATE,
    OPUS_BIT_RATE_RANGE,
    OPUS_RATES,
    OUTPUT_RATES,
    RATES,
    WAV_ENCODINGS,
    Encoder,
    OutputFormat,
    StreamEncoder,
    check_encoding,
    default_rate,
    first_samples,
    g711_decode,
    g711_encode,
    warm_outputs,
    wav_header,
)
from app.io.errors import RequestError
from tests.system.test_gateway_http import EXTRA_SAMPLES, decode


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
    assert np.all(np.abs(back - x) <= np.maximum(np.abs(x) / 16, 2**-9))
    assert g711_encode(np.zeros(1, np.float32), law) == (b"\xff" if law == "mulaw" else b"\xd5")


@pytest.mark.parametrize("law", ["mulaw", "alaw"])
def test_g711_chunks_equal_the_whole(law):
    x = (0.5 * np.sin(np.arange(8000) / 7)).astype(np.float32)
    whole = g711_encode(x, law)
    assert b"".join(g711_encode(x[i : i + 333], law) for i in range(0, len(x), 333)) == whole
    pcm = np.round(x * 32767).astype(np.int16)
    enc = Encoder(law, 8000)
    assert len(enc.encode(pcm[:4410]) + enc.encode(pcm[4410:], last=True)) == pytest.approx(8000 * 8000 / 44100, abs=2)


def test_encoding_names_and_default_rates():
    assert check_encoding("ulaw") == "mulaw" and check_encoding("alaw") == "alaw"
    with pytest.raises(RequestError):
        check_encoding("opus")
    assert default_rate("mulaw", 24000) == 8000 and default_rate("pcm_s16le", 24000) == 24000


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_stream_with_no_audio_closes_without_an_error(fmt):
    """A text of breaks that round to no sample hands an encoder nothing: every format closes (LAME refused a flush
    before any encode, which ended the HTTP answer with a traceback and an ElevenLabs socket with 1011)."""
    rate = 8000 if fmt in ("mulaw", "alaw") else 24000
    enc = StreamEncoder(fmt, rate)
    assert isinstance(enc.write(np.zeros(0, np.float32)) + enc.close(), bytes)
    assert isinstance(Encoder(fmt, rate).encode(np.zeros(0, np.int16), last=True), bytes)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_stream_encoders_emit_while_encoding(fmt):
    """Every format gives bytes before its end (what lets HTTP stream it), and the pieces decode whole."""
    rate = 8000 if fmt in ("mulaw", "alaw") else 24000
    x = (0.3 * np.sin(2 * np.pi * 220 * np.arange(2 * rate) / rate)).astype(np.float32)
    enc = StreamEncoder(fmt, rate)
    pieces = [enc.write(x[i : i + rate // 10]) for i in range(0, len(x), rate // 10)]
    pieces.append(enc.close())
    first_half = b"".join(pieces[:10])
    assert len(first_half) > 0.2 * sum(map(len, pieces))  # the first second is out before the second one is in
    data = b"".join(pieces)
    if fmt == "aac":
        y, sr = decode_aac(data)
        assert sr == rate and len(x) <= len(y) <= len(x) + AAC_EXTRA
    elif fmt in ("wav", "flac", "mp3", "opus"):
        y, sr = decode(data)
        assert sr == rate and len(x) <= len(y) <= len(x) + EXTRA_SAMPLES.get(fmt, 0)
    elif fmt == "pcm":
        assert len(data) == 2 * len(x)
    else:
        assert len(data) == len(x)


# FFmpeg's AAC encoder starts with 1024 samples of priming and pads the last frame to 1024
AAC_EXTRA = 2 * 1024


def decode_aac(data: bytes) -> tuple[np.ndarray, int]:
    """ADTS -> float32 samples, rate, through FFmpeg's decoder (PyAV)."""
    with av.open(io.BytesIO(data), format="adts") as f:
        frames = [fr.to_ndarray().reshape(-1) for fr in f.decode(audio=0)]
        rate = f.streams.audio[0].rate
    return np.concatenate(frames), rate


def stream_encode(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """What a stream of `fmt` holds: every byte StreamEncoder hands out, as an HTTP answer sends them."""
    enc = StreamEncoder(fmt, sample_rate)
    return enc.write(samples) + enc.close()


def tone(rate: int, seconds: float = 1.0) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * 220 * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


@pytest.mark.parametrize("rate", [8000, 16000, 24000, 44100])
def test_aac_is_adts_that_ffmpeg_decodes_to_the_signal(rate):
    """AAC-LC in ADTS frames (sync word on every frame), decoded back to the tone it encoded."""
    x = tone(rate)
    data = stream_encode(x, rate, "aac")
    assert data[:2] == b"\xff\xf1"  # ADTS sync, MPEG-4, no CRC
    y, sr = decode_aac(data)
    assert sr == rate and len(x) <= len(y) <= len(x) + AAC_EXTRA
    # the encoder's delay is its 1024 priming samples: the tone is there, in phase, after them
    ref, got = x[rate // 10 : rate // 2], y[1024 + rate // 10 : 1024 + rate // 2]
    assert np.corrcoef(ref, got)[0, 1] > 0.98


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="no ffmpeg program")
def test_aac_stream_decodes_in_the_ffmpeg_program():
    data = stream_encode(tone(24000), 24000, "aac")
    out = subprocess.run(
        ["ffmpeg", "-v", "error", "-f", "aac", "-i", "-", "-f", "s16le", "-ac", "1", "-"],
        input=data,
        capture_output=True,
        timeout=60,
    )
    assert out.returncode == 0 and not out.stderr, out.stderr
    assert 24000 <= len(out.stdout) // 2 <= 24000 + AAC_EXTRA


@pytest.mark.parametrize("fmt", ["flac", "wav"])
def test_whole_files_carry_their_length(fmt):
    """A streamed FLAC has no sample count and sf.read refuses it; a streamed WAV says
    0xFFFFFFFF (wave reports 2**31 frames). The whole file says how long it is, to every reader."""
    x = tone(24000)
    enc = StreamEncoder(fmt, 24000, whole=True)
    assert all(enc.write(x[i : i + 2400]) == b"" for i in range(0, len(x), 2400))  # nothing before the end
    data = enc.close()
    y, sr = sf.read(io.BytesIO(data), dtype="float32")
    assert sr == 24000 and len(y) == len(x) and np.abs(y - x).max() < 1e-3
    assert sf.info(io.BytesIO(data)).frames == len(x)
    if fmt == "wav":
        with wave.open(io.BytesIO(data)) as w:
            assert w.getnframes() == len(x)
    streamed = stream_encode(x, 24000, fmt)
    if fmt == "flac":
        with pytest.raises(Exception, match="too big"):  # what the issue saw: why a whole file is needed
            sf.read(io.BytesIO(streamed))


@pytest.mark.parametrize("encoding", sorted(WAV_ENCODINGS))
def test_wav_header_of_every_sample_encoding(encoding):
    """The dialects' WAV containers (Deepgram's container=wav, Cartesia's wav): soundfile reads the header
    of each sample encoding, with and without a length."""
    x = tone(8000, 0.25)
    enc = {
        "pcm_s16le": lambda v: np.round(v * 32767).astype("<i2").tobytes(),
        "pcm_f32le": lambda v: v.astype("<f4").tobytes(),
        "mulaw": lambda v: g711_encode(v, "mulaw"),
        "alaw": lambda v: g711_encode(v, "alaw"),
    }[encoding]
    body = enc(x)
    for header in (wav_header(8000, encoding, len(body)), wav_header(8000, encoding)):
        y, sr = sf.read(io.BytesIO(header + body), dtype="float32")
        assert sr == 8000 and len(y) == len(x) and np.abs(y - x).max() < 0.02


# ---- what an encoder takes in before its first output, which sizes the engine's first DAC call -----------------
DAC_LAG = 4757  # samples between the frames a DAC call feeds and the audio it returns (engine/dac/incremental.py)
OUTPUTS = [
    (encoding, rate)
    for encoding in (*ENCODINGS, *COMPRESSED)
    for rate in RATES
    if (encoding != "opus" or rate in OPUS_RATES) and (encoding in COMPRESSED or rate in OUTPUT_RATES)
]


def _speech(n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 3000).astype(np.int16)


def _has_audio(encoding: str, data: bytes) -> bool:
    """Does what an encoder put out so far hold audio? A decoder's answer for MP3 (frames parsed and decoded as
    a streaming player does: FFmpeg's file demuxer wants a few frames before it believes a stream is MP3, and a
    frame cut short at the end waits for its rest, which LAME hands out long after its first bytes), Ogg
    Opus and FLAC (their first bytes are headers); the bytes themselves for raw samples and AAC (ADTS frames,
    each audio)."""
    if encoding == "mp3":
        ctx = av.CodecContext.create("mp3", "r")
        return sum(fr.samples for p in ctx.parse(data) for fr in ctx.decode(p)) > 0
    if encoding not in ("opus", "flac"):
        return bool(data)
    try:
        with av.open(io.BytesIO(data), format={"opus": "ogg"}.get(encoding, encoding)) as f:
            return sum(fr.samples for fr in f.decode(audio=0)) > 0
    except av.error.FFmpegError:  # headers alone, or a frame cut short
        return False


@pytest.mark.parametrize(("encoding", "rate"), OUTPUTS)
def test_an_encoder_outputs_audio_once_it_has_first_samples(encoding: str, rate: int):
    """first_samples is the encoders' own threshold (pinned soxr at the Encoder's quality, the pinned codecs):
    an Encoder fed one sample fewer has no audio out, fed that many (or more) it has."""
    need = first_samples(encoding, rate)
    assert Encoder(encoding, rate).first_samples == need
    assert not _has_audio(encoding, Encoder(encoding, rate).encode(_speech(need - 1))) or need == 1
    for n in range(need, need + 6000, 1201):
        assert _has_audio(encoding, Encoder(encoding, rate).encode(_speech(n, seed=n))), n


def test_each_output_needs_its_own_first_samples():
    """The rule is a table by output, not 'resampled or not': the resampler's start (app/io/resample.py) needs
    more input the lower the rate, all within the 363 samples of the engine's first 10-frame call; MP3 at
    44.1 kHz its first whole frame (2,528) and FLAC a block (1,152). At the native rate a sample encoding holds
    nothing back."""
    got = {rate: first_samples("pcm_s16le", rate) for rate in OUTPUT_RATES}
    assert got == {NATIVE_RATE: 1, 24000: 86, 16000: 128, 8000: 108}
    assert first_samples("mulaw", 24000) == first_samples("pcm_f32le", 24000) == 86
    assert (first_samples("mp3", NATIVE_RATE), first_samples("flac", NATIVE_RATE)) == (2528, 1152)


def test_start_asks_every_output_its_first_samples():
    """warm_outputs (the gateway's start) leaves no output's first_samples for a request to search for on the
    event loop: every encoding at every rate an encoder offers is asked."""
    first_samples.cache_clear()
    warm_outputs()
    asked = first_samples.cache_info().misses
    offered = 0
    for encoding in ENCODINGS + COMPRESSED:
        for rate in RATES:
            with contextlib.suppress(RequestError):
                first_samples(encoding, OutputFormat(encoding, rate).check().sample_rate)
                offered += 1
    assert first_samples.cache_info().misses == asked and offered >= len(OUTPUTS)


@pytest.mark.parametrize("seen", [1000, 2529, None])
def test_first_samples_searches_again_where_the_codec_differs_from_what_was_seen(monkeypatch, seen):
    """A value seen with the pinned codecs that does not hold for this build (too few, too many, or none) is
    searched for again: first_samples is always the encoder's own threshold."""
    table = dict(audio_output._FIRST_SAMPLES_SEEN)
    table.pop(("mp3", NATIVE_RATE))
    if seen is not None:
        table[("mp3", NATIVE_RATE)] = seen
    monkeypatch.setattr(audio_output, "_FIRST_SAMPLES_SEEN", table)
    first_samples.cache_clear()
    try:
        assert first_samples("mp3", NATIVE_RATE) == 2528
    finally:
        first_samples.cache_clear()


def _first_output_step(encoding: str, rate: int, first: int) -> int:
    """The decode step at which a client of `encoding` at `rate` has its first audio when the stream's call 0
    feeds `first` frames and every later call 10 (call k is ready after its frames + 8, the codebook delay)."""
    enc, data, fed, emitted = Encoder(encoding, rate), b"", first, 0
    while True:
        out = fed * 512 - DAC_LAG
        data += enc.encode(_speech(out - emitted, seed=fed))
        emitted = out
        if _has_audio(encoding, data):
            return fed + 8
        fed += 10


@pytest.mark.parametrize(("encoding", "rate"), OUTPUTS)
def test_the_first_call_sized_for_the_client_brings_its_first_audio_soonest(encoding: str, rate: int):
    """Feed an Encoder the PCM a stream emits call by call: the first call the engine picks for the client's
    first_samples (engine/dac/schedule.py) gets it its first audio as early as any first call size the engine
    has (10, 13 or 16 frames), and with call 0 itself where one can bring it."""
    from engine.dac.schedule import ChunkSchedule

    need = first_samples(encoding, rate)
    first = ChunkSchedule().first_size(need, DAC_LAG)
    steps = {f: _first_output_step(encoding, rate, f) for f in ChunkSchedule().call_sizes()}
    assert steps[first] == min(steps.values()), (need, first, steps)
    if need <= max(ChunkSchedule().call_sizes()) * 512 - DAC_LAG:
        assert steps[first] == first + 8  # its first chunk already has audio out (44.1 kHz PCM: after 18 steps)
    if encoding in ENCODINGS:  # a sample encoding at any rate: the resampler's start holds back < 363 samples
        assert first == 10 and steps[first] == 18


@pytest.mark.parametrize("fmt", ["wav", "pcm", "mulaw"])
def test_a_whole_file_is_finished_without_copies_of_its_audio(fmt):
    """A whole-file answer's audio is held until it is complete (minutes of it): finishing the file allocates
    the file once, so it is in memory at most twice (what app/doors/speech.py AnswerHold counts)."""
    import tracemalloc

    from app.io.audio_output import StreamEncoder

    x = np.sin(np.arange(44100 * 20, dtype=np.float32) / 7) * 0.1
    enc = StreamEncoder(fmt, 44100, whole=True)
    for i in range(0, len(x), 4410):
        enc.write(x[i : i + 4410])
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        out = enc.close()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < 1.2 * len(out), (peak, len(out))


@pytest.mark.parametrize("rate", RATES)
def test_mp3_is_constant_bit_rate_at_the_rate_asked(rate: int):
    """MP3 frames at the table's constant bit rate and at the client's rate itself (LAME resamples nothing),
    whole or streamed; a streamed answer is the same bytes as the whole one (frames out as LAME makes them)."""
    x = (np.random.default_rng(rate).standard_normal(rate * 2) * 0.1).astype(np.float32)
    streamed = StreamEncoder("mp3", rate)
    parts = [streamed.write(x[i : i + 4000]) for i in range(0, len(x), 4000)]
    data = b"".join(parts) + streamed.close()
    whole = StreamEncoder("mp3", rate, whole=True)
    assert whole.write(x) == b"" and whole.close() == data
    with av.open(io.BytesIO(data), format="mp3") as f:
        stream = f.streams.audio[0]
        assert stream.sample_rate == rate and stream.bit_rate == MP3_BIT_RATE[rate] * 1000
        assert sum(fr.samples for fr in f.decode(audio=0)) >= len(x)


def test_the_encoder_cpu_bench_measures_every_output_and_the_word_clock(tmp_path):
    """bench/encoder_cpu.py: a figure (CPU ms per audio-second) for each output it lists and the word clock."""
    import json

    from bench.encoder_cpu import OUTPUTS, main

    main(["--seconds", "0.5", "--json", str(tmp_path / "cpu.json")])
    got = json.loads((tmp_path / "cpu.json").read_text())
    assert set(got) == {f"{e}@{r}" for e, r in OUTPUTS} | {"word clock"}
    assert all(v >= 0 for v in got.values())


def test_the_encoder_lead_bench_gives_what_each_encoder_holds_back_from_a_player(tmp_path):
    """bench/encoder_lead.py: at 44.1 kHz raw samples nothing is held back (the player has what the engine counts);
    a resampler or a codec holds some back, never all of the lead at a steady 9.7 ms iteration; an MP3 listener's
    first audio is a whole frame, which the 16-frame call 0 brings (24 steps) while iterations leave room (7 ms),
    and call 1 of a 10-frame call 0 past that (28 steps at 10.5 ms: admission.py `first_call_samples`)."""
    import json

    from bench.encoder_lead import OUTPUTS, lead, main

    raw = lead("pcm_s16le", 44100, 0.0097, 2.0, 0.15)
    assert raw["most_held_ms"] == 0 and raw["client_min_lead_ms"] == raw["engine_min_lead_ms"]
    assert raw["first_audio_steps"] == 18
    mp3 = lead("mp3", 24000, 0.007, 2.0, 0.15)
    assert mp3["first_audio_steps"] == 24 and mp3["most_held_ms"] > 0
    assert lead("mp3", 24000, 0.0097, 2.0, 0.15)["first_audio_steps"] == 24
    assert lead("mp3", 24000, 0.0105, 2.0, 0.15)["first_audio_steps"] == 28
    main(["--periods", "9.7", "--seconds", "2", "--json", str(tmp_path / "lead.json")])
    rows = json.loads((tmp_path / "lead.json").read_text())
    assert len(rows) == len(OUTPUTS) and all(r["client_min_lead_ms"] > 0 for r in rows)


@pytest.mark.parametrize(
    ("rate", "asked", "kbps"),
    [
        (44100, 128000, 128),
        (44100, 32000, 32),
        (22050, 32000, 32),
        (24000, 128000, 128),
        (24000, 192000, 160),
        (8000, 128000, 64),
        (16000, 70000, 64),
        (48000, 1, 32),
    ],
)
def test_mp3_takes_the_bit_rate_asked_or_the_nearest_its_version_defines(rate: int, asked: int, kbps: int):
    """An MP3 at the bit rate a client asks (ElevenLabs' mp3_44100_128, Cartesia's bit_rate): the nearest one the
    rate's MPEG version defines, and still at the rate asked (LAME would pick another rate for some bit rates)."""
    x = (np.random.default_rng(rate).standard_normal(rate) * 0.1).astype(np.float32)
    enc = StreamEncoder("mp3", rate, bit_rate=asked)
    data = enc.write(x) + enc.close()
    with av.open(io.BytesIO(data), format="mp3") as f:
        assert f.streams.audio[0].sample_rate == rate and f.streams.audio[0].bit_rate == kbps * 1000


def test_opus_opens_at_every_bit_rate_asked_at_every_rate():
    """A bit rate outside what libopus takes for one channel is brought into its range, not handed to it (an
    encoder that fails to open is a failed answer): the range's ends and beyond, at every Opus rate."""
    lo, hi = OPUS_BIT_RATE_RANGE
    for rate in OPUS_RATES:
        for bits in (1, lo, hi, hi + 1, 510_000, 10**9):
            enc = StreamEncoder("opus", rate, bit_rate=bits)
            assert enc.write(np.zeros(rate // 10, np.float32)) + enc.close()


def test_opus_takes_the_bit_rate_asked():
    """Opus at the bit rate a client asks (ElevenLabs' opus_48000_32 ... _192): VBR, so about it on average."""
    x = (np.random.default_rng(0).standard_normal(48000 * 4) * 0.1).astype(np.float32)
    sizes = {}
    for kbps in (32, 128):
        enc = StreamEncoder("opus", 48000, bit_rate=kbps * 1000)
        sizes[kbps] = len(enc.write(x) + enc.close()) * 8 / 4 / 1000
        assert 0.7 * kbps <= sizes[kbps] <= 1.3 * kbps, sizes


def _ogg_decode(data: bytes, decoder: str) -> np.ndarray:
    """An Ogg Opus stream, or a chain of them, through FFmpeg's demuxer and one decoder (`opus`, FFmpeg's own, or
    `libopus`) for all of it, as ffmpeg, ffplay and PyAV play a socket's bytes: float32 at 48 kHz, each stream's
    pre-skip trimmed (the demuxer marks it on the stream's first packets)."""
    pieces = []
    with av.open(io.BytesIO(data), format="ogg") as f:
        stream = f.streams.audio[0]
        ctx = av.CodecContext.create(decoder, "r")
        ctx.extradata = stream.codec_context.extradata
        for packet in f.demux(stream):
            for frame in ctx.decode(packet):
                x = frame.to_ndarray().reshape(-1)
                pieces.append(x.astype(np.float32) / 32768 if x.dtype == np.int16 else x.astype(np.float32))
    return np.concatenate(pieces)


@pytest.mark.parametrize("decoder", ["opus", "libopus"])
@pytest.mark.parametrize("cut", [False, True], ids=["whole", "cut"])
@pytest.mark.parametrize("rate", OPUS_RATES)
def test_an_opus_stream_after_another_decodes_as_it_does_alone(rate: int, cut: bool, decoder: str):
    """A socket's context sends each utterance as an Ogg Opus stream of its own, one after another (a chain), and
    ffmpeg, ffplay and PyAV play them with one decoder that the next stream's header does not reset (FFmpeg's own and
    its libopus). Each stream begins with a packet of silence inside its pre-skip (OPUS_LEAD_IN_MS), so the next one
    decodes sample for sample as it does alone, after a whole stream or one cut off (a barge-in). (Without it, at
    48 kHz its first 20 ms decoded at ~10x the level they have alone, RMS 0.8 against 0.085, and differed for
    ~200 ms; at 24 and 8 kHz 2-6x.)"""
    from app.io.audio_output import OPUS_GRANULE_RATE, OPUS_LEAD_IN_MS, opus_pre_skip

    first = Encoder("opus", rate)
    if cut:  # (the stream stops where a message did: no end-of-stream page)
        a = b"".join(first.encode(piece) for piece in np.array_split(_speech(30870, seed=7), 6))
    else:
        a = first.encode(_speech(30870, seed=7), last=True)
    b = Encoder("opus", rate).encode(_speech(30870, seed=8), last=True)
    assert opus_pre_skip(b) == 312 + OPUS_GRANULE_RATE * OPUS_LEAD_IN_MS // 1000  # (libopus's look-ahead, the lead-in)
    both, alone_a, alone_b = _ogg_decode(a + b, decoder), _ogg_decode(a, decoder), _ogg_decode(b, decoder)
    assert len(alone_b) == round(0.7 * 48000)  # (the lead-in is all dropped with the pre-skip)
    assert np.array_equal(both[: len(alone_a)], alone_a)
    assert np.array_equal(both[len(alone_a) :], alone_b)


def test_libsndfile_reads_an_opus_stream_and_only_the_first_of_a_chain():
    """libsndfile (python-soundfile) is a second reader of our Ogg Opus: it trims the longer pre-skip (the lead-in) as
    FFmpeg does, the same samples; and it reads only the first stream of a chain, so a client of a socket that decodes
    with it must split a context's bytes at each stream's first page (docs/protocol.md, "Codec delay")."""
    a = Encoder("opus", 48000).encode(_speech(30870, seed=7), last=True)
    b = Encoder("opus", 48000).encode(_speech(30870, seed=8), last=True)
    x, rate = sf.read(io.BytesIO(b), dtype="float32")
    assert rate == 48000 and len(x) == round(0.7 * 48000)
    assert np.max(np.abs(x - _ogg_decode(b, "opus"))) < 1e-5
    assert len(sf.read(io.BytesIO(a + b), dtype="float32")[0]) == len(x)


def _flac_metadata_blocks(data: bytes) -> list[tuple[int, int]]:
    """(type, length) of each metadata block of a FLAC file (after 'fLaC'), up to the last one."""
    assert data[:4] == b"fLaC"
    blocks, pos, last = [], 4, False
    while not last:
        head = data[pos]
        last, kind, size = bool(head & 0x80), head & 0x7F, int.from_bytes(data[pos + 1 : pos + 4], "big")
        blocks.append((kind, size))
        pos += 4 + size
    return blocks


@pytest.mark.parametrize("whole", [False, True])
def test_flac_has_no_padding_before_its_audio(whole):
    """FFmpeg's FLAC muxer reserves an 8 KiB PADDING block (type 1) for tag editors unless told not to: every
    answer began with 8,288 bytes of header, more than a second of 24 kHz speech. STREAMINFO and the encoder's
    VORBIS_COMMENT only, as libsndfile wrote; the whole file still says its length."""
    x = tone(24000, 0.2)
    enc = StreamEncoder("flac", 24000, whole=whole)
    data = enc.write(x) + enc.close()
    blocks = _flac_metadata_blocks(data)
    assert 1 not in [kind for kind, _ in blocks], blocks
    assert 4 + sum(4 + size for _, size in blocks) < 200
    if whole:
        assert sf.info(io.BytesIO(data)).frames == len(x)


def test_a_whole_flac_is_not_copied_at_the_end():
    """A whole FLAC is written into the encoder's seekable buffer and handed out as it is: joining it to the (empty)
    bytes held for the other formats copied it twice more: a 10-minute 48 kHz answer (50 MB) took 150 MB more at its
    end, not the 'at most twice' the join promises."""
    rate, seconds = 48000, 60
    x = (np.random.default_rng(0).standard_normal(rate) * 0.1).astype(np.float32)
    enc = StreamEncoder("flac", rate, whole=True)
    for _ in range(seconds):
        enc.write(x)
    tracemalloc.start()
    try:
        data = enc.close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sf.info(io.BytesIO(data)).frames == rate * seconds
    assert peak < 1.5 * len(data), (peak, len(data))  # getvalue()'s one copy


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("rate", RATES)
def test_flac_is_the_16_bit_samples_at_every_rate(rate: int, whole: bool):
    """FFmpeg's FLAC (through PyAV's float -> s16 conversion) is lossless against our own 16-bit rounding
    (int16_bytes, clipped), streamed or whole, whatever the writes' sizes, a partial last frame included."""
    n = 3 * 1152 + 17
    x = (np.random.default_rng(rate).standard_normal(n) * 0.4).clip(-1.1, 1.1).astype(np.float32)
    enc = StreamEncoder("flac", rate, whole=whole)
    data = b"".join(enc.write(x[i : i + 777]) for i in range(0, n, 777)) + enc.close()
    with av.open(io.BytesIO(data), format="flac") as f:
        y = np.concatenate([fr.to_ndarray().reshape(-1) for fr in f.decode(audio=0)])
        assert f.streams.audio[0].rate == rate
    assert y.dtype == np.int16 and np.array_equal(y, np.frombuffer(audio_output.int16_bytes(x), "<i2"))
