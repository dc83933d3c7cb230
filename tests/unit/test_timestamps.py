"""Estimated word times (app/core/timestamps.py): every word gets one, in order, inside the voiced audio,
never past the audio fed when it is given."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from app.core.timestamps import (
    AudioTimeline,
    WordClock,
    WordTime,
    aligned_words,
    char_alignment,
    char_alignment_seconds,
    char_times,
    run_to,
    syllables,
)
from engine.contract.constants import SAMPLE_RATE

TEXT = "Hello there, how are you today? Fine, thanks."


def speech(seconds: float, lead_s: float = 0.0, tail_s: float = 0.0, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    voiced = (rng.standard_normal(int(seconds * SAMPLE_RATE)) * 3000).astype(np.int16)
    return np.concatenate(
        [np.zeros(int(lead_s * SAMPLE_RATE), np.int16), voiced, np.zeros(int(tail_s * SAMPLE_RATE), np.int16)]
    )


@pytest.mark.parametrize("chunk", [512, 4096, 30000])
@pytest.mark.parametrize("seconds", [0.4, 2.5, 9.0])
def test_every_word_in_order_within_the_audio_fed(chunk, seconds):
    audio = speech(seconds, lead_s=0.2, tail_s=0.5)
    clock = WordClock(TEXT)
    words, fed = [], 0
    for i in range(0, len(audio), chunk):
        piece = audio[i : i + chunk]
        fed += len(piece)
        new = clock.feed(piece)
        assert all(w.end_s <= fed / SAMPLE_RATE + 1e-9 for w in new)
        words += new
    words += clock.finish()
    assert [w.word for w in words] == TEXT.split()
    assert [TEXT[w.char_start : w.char_end] for w in words] == TEXT.split()
    starts = [w.start_s for w in words]
    assert starts == sorted(starts) and all(w.end_s >= w.start_s for w in words)
    assert all(b.start_s >= a.end_s - 1e-9 for a, b in itertools.pairwise(words))
    assert words[0].start_s >= 0.2 - 0.011  # the leading silence is no word's
    assert words[-1].end_s <= 0.2 + seconds + 0.011  # nor is the trailing one


def test_longer_words_and_pauses_take_longer():
    assert syllables("information") > syllables("cat")
    assert syllables("end.") > syllables("end")
    clock = WordClock("a extraordinary b")
    words = clock.feed(speech(3.0)) + clock.finish()
    spans = [w.end_s - w.start_s for w in words]
    assert spans[1] > spans[0] and spans[1] > spans[2]


def test_what_was_heard_before_a_barge_in():
    clock = WordClock(TEXT)
    clock.feed(speech(4.0))
    assert clock.spoken(0.0) == []
    heard = clock.spoken(1.0)
    assert heard == TEXT.split()[: len(heard)] and 0 < len(heard) < len(TEXT.split())
    assert clock.spoken(100.0) == TEXT.split()


def test_an_elevenlabs_alignment_runs_to_its_message_end():
    clock = WordClock(TEXT)
    words = clock.feed(speech(3.0)) + clock.finish()
    a = char_alignment(words, 0.0, 3.0)
    assert a is not None
    assert len(a["chars"]) == len(a["charStartTimesMs"]) == len(a["charDurationsMs"])
    assert "".join(a["chars"]).split() == TEXT.split()
    assert abs(a["charStartTimesMs"][-1] + a["charDurationsMs"][-1] - 3000.0) < 0.2
    empty = char_alignment([], 1.0, 1.5)  # a message that completes no word still advances the clock
    assert empty is not None and empty["chars"] == [" "] and empty["charDurationsMs"] == [500.0]


def test_an_elevenlabs_alignment_on_the_contexts_clock():
    """sync_alignment=true (LiveKit): the words' own characters on the context's audio clock (the utterance
    starts 2 s into it), no padding, nothing for a message that completes no word."""
    clock = WordClock(TEXT)
    words = clock.feed(speech(3.0)) + clock.finish()
    message = char_alignment(words, 2.5, 3.0)  # the message clock: relative to 2.5 s
    context = char_alignment(words, 2.5, 3.0, timeline_s=2.0)
    assert message is not None and context is not None
    assert "".join(context["chars"]).split() == TEXT.split() and context["chars"][-1] == " "
    assert len(context["chars"]) == len(message["chars"]) - (message["chars"][-2:] == [" ", " "])
    for m, c in zip(message["charStartTimesMs"], context["charStartTimesMs"], strict=False):
        assert abs(c - (m + 4500.0)) < 0.2  # 2.5 s of message offset + 2 s of context offset
    assert context["charStartTimesMs"] == sorted(context["charStartTimesMs"]) and context["charStartTimesMs"][0] >= 2000
    assert char_alignment([], 1.0, 1.5, timeline_s=2.0) is None


def test_the_aligners_words_carry_their_place_in_the_text():
    text = " Hello,  wörld\t42! "
    got = aligned_words(text, (("Hello,", 0.1, 0.4), ("wörld", 0.4, 0.9), ("42!", 0.9, 0.9)))
    assert got is not None
    assert [(w.word, text[w.char_start : w.char_end], w.start_s, w.end_s) for w in got] == [
        ("Hello,", "Hello,", 0.1, 0.4),
        ("wörld", "wörld", 0.4, 0.9),
        ("42!", "42!", 0.9, 0.9),
    ]
    # not the text's words (a different text, a word missing): the estimate stands
    assert aligned_words(text, (("Hello,", 0.1, 0.4), ("world", 0.4, 0.9), ("42!", 0.9, 0.9))) is None
    assert aligned_words(text, (("Hello,", 0.1, 0.4),)) is None


def test_a_timeline_of_several_utterances_times_every_word_on_one_clock():
    """Two utterances and a break on one stream (an HTTP answer): every word once, in order, on the stream's
    clock (the second utterance's words after the first's audio), each piece's span where the last ended, and
    the characters of ElevenLabs' HTTP alignment monotonic, running to the audio's end."""
    texts = ["Hello there, how are you?", "", "Fine, thanks."]
    audio = [speech(1.5, 0.1, 0.3, seed=1), np.zeros(SAMPLE_RATE // 2, np.int16), speech(1.0, 0.1, 0.2, seed=2)]
    timeline = AudioTimeline()
    chunks = []
    for text, pcm in zip(texts, audio, strict=True):
        timeline.begin(text)
        for i in range(0, len(pcm), 3000):
            timeline.feed(pcm[i : i + 3000])
            chunks.append(timeline.take())
        timeline.end()
    chunks.append(timeline.take())
    words = [w for c in chunks for w in c.words]
    assert [w.word for w in words] == " ".join(texts).split()
    assert all(b.start_s >= a.end_s - 1e-9 for a, b in itertools.pairwise(words))
    first_len = len(audio[0]) / SAMPLE_RATE
    assert words[5].start_s >= first_len + 0.5 + 0.1 - 0.011  # after the first utterance, the break, the lead-in
    assert all(b.start_s == a.end_s for a, b in itertools.pairwise(chunks))
    assert chunks[-1].end_s == sum(len(a) for a in audio) / SAMPLE_RATE
    chars = run_to([c for chunk in chunks for c in char_times(chunk.words)], timeline.sent_s, 0.0)
    a = char_alignment_seconds(chars)
    assert a is not None and "".join(a["characters"]).split() == " ".join(texts).split()
    starts, ends = a["character_start_times_seconds"], a["character_end_times_seconds"]
    assert starts == sorted(starts) and all(e >= s for s, e in zip(starts, ends, strict=True))
    assert ends[-1] == round(timeline.sent_s, 4)
    assert char_alignment_seconds([]) is None


def test_cartesia_words_go_out_in_the_order_spoken_whatever_order_the_aligner_answers():
    """A context's timestamps: an utterance waiting for the aligner holds back its own and every later
    utterance's words; the aligner answering a later one first (a text with nothing to align answers at once)
    lets nothing out of order."""
    from app.doors.dialects.cartesia import WordsInOrder

    def w(word: str) -> WordTime:
        return WordTime(word, 0.0, 0.1, 0, len(word))

    due = WordsInOrder()
    due.aligning("hello", 0.0)
    due.aligning("42", 1.0)
    assert due.aligned("42", [w("42.")]) == []  # "Hello there." still aligning
    assert due.add("how", 2.0, [w("How")]) == []  # estimated words wait behind it too
    out = due.aligned("hello", [w("Hello"), w("there.")])
    assert [(t0, [x.word for x in ws]) for t0, ws in out] == [
        (0.0, ["Hello", "there."]),
        (1.0, ["42."]),
        (2.0, ["How"]),
    ]
    assert due.add("how", 2.0, [w("are")]) != []  # nothing waits now: sent at once


def test_the_silence_threshold_is_the_loud_frames_percentile():
    """WordClock's threshold: QUIET_DB under the 90th percentile of the frames' energy (numpy's linear
    percentile, found by a partition), whatever the count of frames, and found again as frames come."""
    from app.core.timestamps import QUIET_DB

    clock = WordClock("Hello there.")
    for n in (1, 2, 3, 10, 101, 999):
        clock._energy = np.random.default_rng(n).random(n).astype(np.float32)
        want = float(np.percentile(clock._energy, 90)) * 10 ** (-QUIET_DB / 20)
        assert clock._threshold() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("rate", [8000, 16000, 24000])
def test_no_word_is_reported_before_its_audio_has_left_the_resampler(rate):
    """A resampled socket: its resampler holds back its last block (up to ~40 ms) until the next chunk, so the words
    of a chunk are those that end within the audio sent, not the audio handed to the encoder (the hostile pass: a
    first word ending at 238 ms came after 205 ms of 24 kHz audio, at every resampled rate)."""
    import asyncio

    from engine.contract import records as m
    from tests.unit.test_pipeline import engine_stats, open_session, shut

    async def go():
        _session, ws, engine, task = await open_session()
        ws.send(type="session.config", timestamps="estimated", sample_rate=rate)
        ws.send(type="text", text="Hi there my good old friend, how are you?", flush=True)
        stream = await engine.started(1)
        audio = speech(2.0, seed=3)
        for at in range(0, len(audio), 4410):
            stream._deliver(m.Audio(stream.rid, 0, audio[at : at + 4410]))
        stream._deliver(m.Finished(stream.rid, "eos", stats=engine_stats(1)))
        seen, sent, late = [], 0, []
        async with asyncio.timeout(10):
            while not seen or seen[-1] != "flushed":
                msg = await ws.out.get()
                if isinstance(msg, bytes):
                    sent += len(msg) // 2
                    continue
                seen.append(msg["type"])
                if msg["type"] == "audio.words":
                    late += [
                        (w["word"], w["end_ms"], sent * 1e3 / rate)
                        for w in msg["words"]
                        if w["end_ms"] > sent * 1e3 / rate + 0.05
                    ]
        await shut(ws, task)
        return seen, late

    seen, late = asyncio.run(go())
    assert seen.count("audio.words") >= 2 and not late, (seen, late)


def test_a_barge_in_on_a_resampled_socket_reports_the_audio_sent():
    """`cancelled.heard`'s audio_ms (and its words) are of the audio that left the resampler, not the ~40 ms it still
    held when the cancel came (it said 2,000 ms of a reply of which 1,9xx ms had been sent at 16 kHz)."""
    import asyncio

    from engine.contract import records as m
    from tests.unit.test_pipeline import open_session, shut

    async def go():
        _session, ws, engine, task = await open_session()
        ws.send(type="session.config", sample_rate=16000)
        ws.send(type="text", text="Hi there my good old friend, how are you?", flush=True)
        stream = await engine.started(1)
        audio = speech(2.0, seed=3)
        for at in range(0, len(audio), 4410):
            stream._deliver(m.Audio(stream.rid, 0, audio[at : at + 4410]))
        sent = 0
        async with asyncio.timeout(10):
            while sent < 31000:  # (2 s at 16 kHz is 32,000 samples, its last block held back)
                msg = await ws.out.get()
                sent += len(msg) // 2 if isinstance(msg, bytes) else 0
        await asyncio.sleep(0.1)
        while not ws.out.empty():
            msg = ws.out.get_nowait()
            sent += len(msg) // 2 if isinstance(msg, bytes) else 0
        ws.send(type="cancel")
        cancelled = await ws.until("cancelled")
        await shut(ws, task)
        return cancelled[-1], sent

    cancelled, sent = asyncio.run(go())
    heard = cancelled["heard"][0]
    assert sent < 32000 and heard["audio_ms"] <= sent / 16 + 0.1, (heard, sent / 16)


def _lag(x: np.ndarray, ref: np.ndarray) -> int:
    """Where `ref` lies in `x` (samples): the best match of a cross-correlation."""
    n = 1 << (len(x) + len(ref)).bit_length()
    corr = np.fft.irfft(np.fft.rfft(x, n) * np.conj(np.fft.rfft(ref, n)), n)
    return int(np.argmax(corr[: len(x)]))


def _outputs() -> list[tuple[str, int]]:
    from app.io.audio_output import COMPRESSED, RATES, OutputFormat
    from app.io.errors import RequestError

    out = [("pcm_s16le", r) for r in RATES if r != SAMPLE_RATE] + [("mulaw", 8000)]
    for encoding, rate in itertools.product(COMPRESSED, RATES):
        try:
            out.append((OutputFormat(encoding, rate).check().encoding, rate))
        except RequestError:
            continue
    return out


@pytest.mark.parametrize(("encoding", "rate"), _outputs())
def test_word_times_are_on_the_decoded_audio(encoding, rate):
    """Each output's stream, decoded as a listener's player decodes it (PyAV: FFmpeg's demuxers and decoders): the
    audio lies as late in it as the codec's delay (MP3 1,105 samples at every rate: 25 ms at 44.1 kHz, 46 ms at
    24 kHz; AAC 1,024; Opus, FLAC and the resampler 0), found here by cross-correlation; the timeline's word times
    are moved by just that, its messages' spans run on to the decoded audio's end (the last frame's padding), and
    no word is given before the decoded audio sent reaches it. (The times were on the samples handed in: MP3's and
    AAC's were early by the delay.)"""
    import soxr

    from app.io.audio_output import Encoder, codec_delay, decode_output

    audio = speech(0.6, lead_s=0.2, tail_s=0.2, seed=3)
    enc = Encoder(encoding, rate)
    timeline = AudioTimeline(heard=enc)
    plain = AudioTimeline()  # the same audio's times on the samples handed in (given as far as the same audio)
    timeline.begin(TEXT), plain.begin(TEXT)
    data, chunks = b"", []
    for piece in np.array_split(audio, 9):  # (as app/core/playback.py: encoded, then fed up to what is heard)
        data += enc.encode(piece)
        timeline.feed(piece, enc.native_heard)
        plain.feed(piece, enc.native_heard)
        chunks.append(timeline.take())
        assert all(w.end_s <= chunks[-1].end_s + 1e-9 for w in chunks[-1].words)  # within the audio out
    data += enc.encode(np.zeros(0, np.int16), last=True)
    timeline.end(), plain.end()
    chunks.append(timeline.take())
    words, estimate = [w for c in chunks for w in c.words], plain.take().words

    heard, heard_rate = decode_output(data, encoding, rate)
    ref = soxr.resample(audio.astype(np.float32) / 32768, SAMPLE_RATE, heard_rate, "VHQ")
    lag = _lag(heard, ref) * rate / heard_rate  # (Opus decodes at 48 kHz)
    assert lag == codec_delay(encoding, rate) == {"mp3": 1105, "aac": 1024}.get(encoding, 0)
    assert [w.word for w in words] == [w.word for w in estimate] == TEXT.split()
    for w, e in zip(words, estimate, strict=True):
        assert w.start_s - e.start_s == pytest.approx(lag / rate, abs=1e-9)
        assert w.end_s - e.end_s == pytest.approx(lag / rate, abs=1e-9)
    assert words[0].start_s == pytest.approx(0.2 + lag / rate, abs=0.011)  # where the decoded audio's voice begins
    assert chunks[0].start_s == 0 and all(a.end_s == b.start_s for a, b in itertools.pairwise(chunks))
    assert chunks[-1].end_s == pytest.approx(len(heard) / heard_rate, abs=1e-9)  # the decoded audio's end


@pytest.mark.parametrize(
    ("encoding", "rate", "bit_rate"),
    [("mp3", 44100, 32000), ("mp3", 44100, 192000), ("mp3", 22050, 32000), ("opus", 48000, 192000)],
)
def test_the_codec_delay_is_the_same_at_every_bit_rate(encoding, rate, bit_rate):
    """`codec_delay` is measured at each rate's own bit rate; a client's (ElevenLabs' mp3_44100_32 ... _192,
    opus_48000_32 ... _192) decodes with the same delay."""
    import soxr

    from app.io.audio_output import Encoder, codec_delay, decode_output

    audio = speech(0.3, lead_s=0.05, seed=4)
    enc = Encoder(encoding, rate, bit_rate=bit_rate)
    enc.follow()  # (its frames counted: heard_s)
    heard, heard_rate = decode_output(enc.encode(audio, last=True), encoding, rate)
    ref = soxr.resample(audio.astype(np.float32) / 32768, SAMPLE_RATE, heard_rate, "VHQ")
    assert _lag(heard, ref) * rate / heard_rate == codec_delay(encoding, rate)
    assert enc.heard_s == pytest.approx(len(heard) / heard_rate, abs=1e-9)


@pytest.mark.parametrize(("encoding", "rate"), [("mp3", 8000), ("mp3", 22050), ("mp3", 44100), ("aac", 16000)])
@pytest.mark.parametrize("samples", [0, 1])
def test_an_utterance_with_no_audio_out_has_no_word_past_its_end(encoding, rate, samples):
    """An utterance whose audio is empty, or too short for its encoder to put any frame out (one sample at
    mp3_8000 or aac_16000: the resampler makes none of it): its stream decodes to nothing, so its words,
    which share no audio, are at its end (0), as on a sample encoding. (They were at the codec's delay, 138 ms at
    mp3_8000, past the end of an empty stream: a client that adds up the messages' alignments ran ahead.)"""
    from app.io.audio_output import Encoder, decode_output

    enc = Encoder(encoding, rate)
    timeline = AudioTimeline(heard=enc)
    timeline.begin("Hello there.")
    pcm = speech(samples / SAMPLE_RATE)
    data = enc.encode(pcm)
    timeline.feed(pcm, enc.native_heard)
    data += enc.encode(np.zeros(0, np.int16), last=True)
    timeline.end()
    chunk = timeline.take(final=True)  # (as app/core/playback.py takes an utterance's last message)
    heard = len(decode_output(data, encoding, rate)[0]) if data else 0
    assert chunk.end_s == enc.heard_s == heard / rate
    assert [w.word for w in chunk.words] == ["Hello", "there."]
    assert all(0 <= w.start_s <= w.end_s <= chunk.end_s for w in chunk.words), (chunk, heard)


def test_an_utterance_shorter_than_a_frame_ends_on_its_padded_frames():
    """A hundred samples (2 ms) at mp3_8000: its stream is whole frames (576 samples each, MPEG-2.5), the delay
    (1,105 samples) and the padding included; its words lie in it, the delay later."""
    from app.io.audio_output import Encoder, codec_delay, decode_output, frame_samples

    assert [frame_samples("mp3", r) for r in (8000, 16000, 22050, 24000, 32000, 44100, 48000)] == [576] * 4 + [1152] * 3
    enc = Encoder("mp3", 8000)
    timeline = AudioTimeline(heard=enc)
    timeline.begin("Hi.")
    pcm = speech(100 / SAMPLE_RATE)
    data = enc.encode(pcm)
    timeline.feed(pcm, enc.native_heard)
    data += enc.encode(np.zeros(0, np.int16), last=True)
    timeline.end()
    chunk = timeline.take(final=True)
    decoded, rate = decode_output(data, "mp3", 8000)
    assert len(decoded) % 576 == 0 and len(decoded) >= codec_delay("mp3", 8000) + 18
    assert chunk.end_s == pytest.approx(len(decoded) / rate, abs=1e-9)
    (word,) = chunk.words
    assert codec_delay("mp3", 8000) / 8000 <= word.start_s <= word.end_s <= chunk.end_s


def test_only_an_encoder_whose_decoded_audio_is_followed_counts_its_frames(monkeypatch):
    """FFmpeg's frame parser costs 1-3 % of an MP3 chunk's encoding (5,120 samples): only an encoder a
    timeline follows (AudioTimeline's `heard`: a socket's utterance, an HTTP answer with word times) runs it; a plain
    MP3 or AAC answer (most of them) does not. A followed one counts from its first frame: `heard_s` is its decoded
    length."""
    import app.io.audio_output as audio_output
    from app.io.audio_output import Encoder, decode_output

    made: list[str] = []
    real = audio_output._frame_parser

    def counting(encoding: str):  # (-> av.CodecContext)
        made.append(encoding)
        return real(encoding)

    monkeypatch.setattr(audio_output, "_frame_parser", counting)
    audio = speech(0.3, seed=5)
    for encoding in ("mp3", "aac"):
        Encoder(encoding, 24000).encode(audio, last=True)
    assert made == []
    enc = Encoder("mp3", 24000)
    AudioTimeline(heard=enc)
    data = enc.encode(audio[:5120]) + enc.encode(audio[5120:], last=True)
    assert made == ["mp3"]
    assert enc.heard_s == len(decode_output(data, "mp3", 24000)[0]) / 24000
    late = Encoder("mp3", 24000)
    late.encode(audio[:5120])
    with pytest.raises(RuntimeError):  # its frames are counted from its first, or not at all
        AudioTimeline(heard=late)
    with pytest.raises(RuntimeError):
        late.heard_s  # noqa: B018


@pytest.mark.parametrize(
    ("encoding", "rate", "bit_rate"),
    [("mp3", r, None) for r in (8000, 16000, 22050, 24000, 32000, 44100, 48000)]
    + [("mp3", 22050, 32000), ("mp3", 44100, 128000), ("aac", 24000, None)],
)
def test_a_followed_encoder_puts_out_whole_frames(encoding, rate, bit_rate):
    """An encoder a timeline follows (a socket's utterance, an HTTP answer with word times) puts out whole frames
    only, each as soon as it is complete: every piece a message carries is what a decoder plays of it (`heard_s`
    grows by it), and the stream is the bytes a plain encoder makes. (LAME hands out a frame's first bytes long
    before the rest: every 5,120-sample piece ended with 20-360 bytes of a frame, which a barge-in left a decoder.)"""
    import av

    from app.io.audio_output import Encoder, frame_samples

    audio = speech(1.2, seed=6)
    plain, enc = Encoder(encoding, rate, bit_rate=bit_rate), Encoder(encoding, rate, bit_rate=bit_rate)
    enc.follow()
    ours, theirs = b"", b""
    pieces = [*np.array_split(audio, 10), np.zeros(0, np.int16)]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        before = enc.heard_s
        data = enc.encode(piece, last=last)
        frames = av.CodecContext.create(encoding, "r").parse(data)
        assert sum(f.size for f in frames) == len(data), i
        assert enc.heard_s - before == pytest.approx(len(frames) * frame_samples(encoding, rate) / rate, abs=1e-9)
        ours, theirs = ours + data, theirs + plain.encode(piece, last=last)
    assert ours == theirs


def test_a_stream_cut_off_then_the_next_one_decode_as_one():
    """A barge-in at mp3_22050_32: the utterance's stream stops where its last message did (no last call), and the
    next context's stream follows on the socket. A decoder fed both as one plays each whole (the cut one's frames,
    then the next one's): the cut one ended on a frame. (It ended with a piece of a frame, which FFmpeg's decoder
    read with the next stream's first bytes and refused: "Invalid data found".)"""
    from app.io.audio_output import Encoder, decode_output

    audio = speech(0.7, seed=7)
    cut = Encoder("mp3", 22050, bit_rate=32000)
    AudioTimeline(heard=cut)  # (a socket's utterance: followed)
    first = b"".join(cut.encode(piece) for piece in np.array_split(audio, 6))
    nxt = Encoder("mp3", 22050, bit_rate=32000)
    AudioTimeline(heard=nxt)
    second = nxt.encode(audio, last=True)
    both, rate = decode_output(first + second, "mp3", 22050)
    assert len(both) / rate == pytest.approx(cut.heard_s + nxt.heard_s, abs=1e-9)


@pytest.mark.parametrize(
    ("encoding", "rate"),
    [("opus", r) for r in (8000, 16000, 24000, 48000)] + [("flac", r) for r in (8000, 22050, 24000, 44100, 48000)],
)
def test_flac_and_opus_are_heard_as_far_as_their_bytes_out_decode(encoding, rate):
    """FLAC's and Opus's encoders hold back up to a frame (FLAC_BLOCK samples; a 20 ms Opus packet, and the Ogg muxer
    its last packet until the next one): after every piece `heard_s` is what a decoder (PyAV) makes of the bytes out
    so far (Opus's pre-skip trimmed), closed the whole audio; every piece is whole pages (Ogg) or frames (FLAC), and
    no word a message gives lies past it. (`heard_s` was the samples taken in: up to a FLAC frame ahead of the bytes,
    48 ms at 24 kHz, 144 at 8 kHz, and up to 46 ms at Opus, so a word came before its audio, and a barge-in's
    messages said more audio than the client got.)"""
    import av

    from app.io.audio_output import FLAC_BLOCK, Encoder, decode_output, ogg_pages

    audio = speech(0.8, lead_s=0.1, seed=8)
    enc = Encoder(encoding, rate)
    timeline = AudioTimeline(heard=enc)
    timeline.begin(TEXT)
    data = b""
    pieces = [*np.array_split(audio, 11), np.zeros(0, np.int16)]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out = enc.encode(piece, last=last)
        if encoding == "opus":
            assert ogg_pages(out)[1] == b"", i  # (whole pages)
        elif i:  # (the first piece: the stream's header, then frames)
            assert not out or out[:2] in (b"\xff\xf8", b"\xff\xf9"), i
        data += out
        if last:
            timeline.end()
        else:
            timeline.feed(piece, enc.native_heard)
        chunk = timeline.take(final=last)
        try:
            decoded, decoded_rate = decode_output(data, encoding, rate)
        except av.error.EOFError:  # (FFmpeg's demuxer finds no audio packet after the header: nothing to play)
            decoded, decoded_rate = np.zeros(0, np.float32), rate
        assert enc.heard_s == pytest.approx(len(decoded) / decoded_rate, abs=1e-9), i
        assert chunk.end_s == pytest.approx(enc.heard_s, abs=1e-9)
        assert all(w.end_s <= chunk.end_s + 1e-9 for w in chunk.words), (i, chunk)
        if encoding == "flac" and not last:
            assert len(decoded) % FLAC_BLOCK == 0
    assert len(decoded) / decoded_rate == pytest.approx(len(audio) / SAMPLE_RATE, abs=1.5 / rate)


def test_an_opus_stream_cut_off_then_the_next_one_decode_as_one():
    """A barge-in at opus_48000_64 (ElevenLabs' socket): the utterance's Ogg stream stops where its last message did
    (whole pages, no end-of-stream page), and the next context's stream follows on the socket. A decoder fed both as
    one plays each (FFmpeg's demuxer takes the next stream's header pages as such): the cut one's packets less its
    pre-skip, then the next one's, as long as `heard_s` said of each. (It said the samples taken in: 34 ms more of the
    cut one than a decoder plays: the part of a packet its encoder held, the packet the Ogg muxer held, the pre-skip.)
    FFmpeg's Opus decoder is not reset at the next stream's header, yet the next one decodes as it does alone, sample
    for sample: it begins with a silent packet inside its pre-skip (OPUS_LEAD_IN_MS). (Without it, its first 20 ms
    decoded at ~8x their level alone.)"""
    from app.io.audio_output import Encoder, decode_output, ogg_pages

    audio = speech(0.7, seed=7)
    cut = Encoder("opus", 48000, bit_rate=64000)
    AudioTimeline(heard=cut)
    first = b"".join(cut.encode(piece) for piece in np.array_split(audio, 6))
    nxt = Encoder("opus", 48000, bit_rate=64000)
    AudioTimeline(heard=nxt)
    second = nxt.encode(audio, last=True)
    assert ogg_pages(first)[1] == b""
    cut_alone, rate = decode_output(first, "opus", 48000)
    both, rate = decode_output(first + second, "opus", 48000)
    assert len(cut_alone) / rate == pytest.approx(cut.heard_s, abs=1e-9)
    assert len(both) / rate == pytest.approx(cut.heard_s + nxt.heard_s, abs=1e-9)
    assert np.array_equal(both[len(cut_alone) :], decode_output(second, "opus", 48000)[0])


def test_the_words_an_utterance_leaves_wait_for_their_audio():
    """An HTTP answer is one stream: its encoder (mp3_22050_32) still holds the end of a sentence when the next one
    begins, so the words that sentence's end placed come in the first message whose decoded audio reaches them, not
    before (they came with the next message whatever it held: a word 130 ms past its line's audio); the last message
    has every word left."""
    from app.io.audio_output import Encoder

    enc = Encoder("mp3", 22050, bit_rate=32000)
    timeline = AudioTimeline(heard=enc)
    timeline.begin("Hello there, my friend.")
    first = speech(0.5, seed=9)
    enc.encode(first)
    timeline.feed(first, enc.native_heard)
    taken = timeline.take().words
    timeline.end()  # (the sentence's audio is all handed in; its last ~1,700 samples are in LAME)
    timeline.begin("How are you?")
    chunks = []
    for piece in np.array_split(speech(0.6, seed=10), 12):
        enc.encode(piece)
        timeline.feed(piece, enc.native_heard)
        chunks.append(timeline.take())
        assert all(w.end_s <= chunks[-1].end_s + 1e-9 for w in chunks[-1].words), len(chunks)
    enc.encode(np.zeros(0, np.int16), last=True)
    timeline.end()
    chunks.append(timeline.take(final=True))
    words = [w.word for w in taken] + [w.word for c in chunks for w in c.words]
    assert words == ["Hello", "there,", "my", "friend.", "How", "are", "you?"]
    assert "friend." not in [w.word for w in chunks[0].words]  # (its audio not out of LAME yet: in a later message)
