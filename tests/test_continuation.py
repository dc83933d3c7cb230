"""Continuation across sentences (issue 22.1): one DAC stream for a reply of several chunks, the kept
frames the engine returns, the continued prompt, the held tail's flush, cancel in the middle (CPU, tiny)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # the fused Snake runs in Triton's interpreter (before anything imports it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.dac.codec import HOP, Codec
from engine.dac.schedule import DELAY, ChunkSchedule
from engine.dac.streaming import StreamingDecoder, decode_offline
from engine.longform import BOUNDARY_TRIM, trim_chunk_codes

EXACT_DB = 100.0  # streamed vs one-shot, fp32 on CPU: float rounding only (as tests/test_dac_streaming.py)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def codec() -> Codec:
    return Codec.random("tiny", seed=0)


def snr_db(ref: np.ndarray, x: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(ref**2) / max(np.sum((ref - x) ** 2), 1e-30)))


def chunk(rng: np.random.Generator, eos: int, c: int) -> tuple[np.ndarray, int, int]:
    """A chunk as the engine generates it: an EOA in codebook c at step eos + c fixes its end at `eos`
    (engine/llm/eos.py) and generation stops 9 frames later. (frames, eos, the step the EOS is known)."""
    frames = rng.integers(0, 1024, (eos + c + 10, 9))
    return frames, eos, eos + c


def run_chunks(dec: StreamingDecoder, rid: int, chunks: list[tuple[np.ndarray, int, int]],
               final_last: bool) -> tuple[list[np.ndarray], list[int]]:
    """Stream the chunks into one stream as the scheduler does: frame by frame, the EOS when the engine
    knows it; every chunk but the last (or all, final_last False) held. Returns (PCM pieces, kept lengths).
    Checks after every step that nothing past a chunk's eventual kept end was fed to the decoder."""
    out: list[np.ndarray] = []
    kept: list[int] = []
    offset = 0
    for i, (frames, eos, known) in enumerate(chunks):
        last = i == len(chunks) - 1
        hold = not (last and final_last)
        if i == 0:
            dec.open(rid, hold=hold)
        else:
            dec.resume(rid, hold=hold)
        bound = offset + eos - BOUNDARY_TRIM - DELAY  # the chunk's kept end, in complete aligned frames
        for k, f in enumerate(frames):
            dec.push(rid, f, eos_frame=eos if k >= known else None)
            out += [pcm for _, pcm, _ in dec.step(as_float=True)]
            if hold:
                assert dec._reqs[rid].fed <= max(0, bound)
        if hold:
            kept.append(dec.hold(rid, eos))
            assert kept[-1] == eos - BOUNDARY_TRIM and dec.held(rid)
            out += [pcm for _, pcm, _ in dec.step(as_float=True)]
            assert dec._reqs[rid].fed <= max(0, offset + kept[-1] - DELAY)
            offset += kept[-1]
        else:
            dec.finish(rid, eos)
    return out, kept


def expected(codec: Codec, chunks: list[tuple[np.ndarray, int, int]]) -> np.ndarray:
    """One-shot decode of the kept frames of every chunk but the last, then the last chunk's frames, to
    the last chunk's end of audio: what the reference's one vocoder stream plays."""
    parts = [trim_chunk_codes(f, e, BOUNDARY_TRIM) for f, e, _ in chunks[:-1]]
    offset = sum(len(p) for p in parts)
    frames, eos, _ = chunks[-1]
    return decode_offline(codec, np.concatenate([*parts, frames]), offset + eos)


@pytest.mark.parametrize("schedule", [ChunkSchedule(), ChunkSchedule(frames=7, first_frames=3)],
                         ids=["default", "3 then 7"])
def test_five_chunks_are_one_stream_equal_to_one_shot(codec: Codec, schedule: ChunkSchedule):
    rng = np.random.default_rng(5)
    chunks = [chunk(rng, eos, c) for eos, c in [(40, 8), (31, 0), (25, 4), (60, 2), (33, 8)]]
    dec = StreamingDecoder(codec, schedule, slots=4)
    out, kept = run_chunks(dec, 9, chunks, final_last=True)
    out += [pcm for _, pcm, _ in dec.step(as_float=True)]
    x = np.concatenate(out)
    ref = expected(codec, chunks)
    assert kept == [e - BOUNDARY_TRIM for _, e, _ in chunks[:-1]]
    assert len(x) == len(ref) == (sum(kept) + chunks[-1][1]) * HOP
    assert snr_db(ref, x) >= EXACT_DB
    assert dec.active() == 0 and len(dec._free) == 4  # the one slot is back


def test_a_held_stream_flushed_ends_at_its_last_chunks_end_of_audio(codec: Codec):
    rng = np.random.default_rng(6)
    chunks = [chunk(rng, eos, c) for eos, c in [(30, 3), (45, 8)]]
    dec = StreamingDecoder(codec, slots=2)
    out, _ = run_chunks(dec, 1, chunks, final_last=False)
    assert dec.held(1) and not dec.pending()  # the tail waits for a next chunk
    dec.flush(1)
    finals = dec.step(as_float=True)
    assert [f for _, _, f in finals] == [True]
    x = np.concatenate(out + [pcm for _, pcm, _ in finals])
    ref = expected(codec, chunks)  # the flushed last chunk ends as a final one would: at its EOS
    assert len(x) == len(ref) and snr_db(ref, x) >= EXACT_DB
    assert dec.active() == 0


def test_a_held_chunk_without_end_of_audio_keeps_all_but_the_trim(codec: Codec):
    frames = np.random.default_rng(7).integers(0, 1024, (50, 9))
    dec = StreamingDecoder(codec, slots=2)
    dec.open(2, hold=True, track_eos=False)  # ignore_eos: the chunk ends at max_frames
    for f in frames:
        dec.push(2, f)
        dec.step()
        assert dec._reqs[2].fed <= 50 - BOUNDARY_TRIM - DELAY
    assert dec.hold(2, None) == 50 - BOUNDARY_TRIM


def test_drop_in_the_middle_of_a_continued_stream_frees_its_slot(codec: Codec):
    rng = np.random.default_rng(8)
    chunks = [chunk(rng, 30, 2), chunk(rng, 40, 5)]
    dec = StreamingDecoder(codec, slots=2)
    run_chunks(dec, 4, chunks[:1], final_last=False)
    dec.resume(4, hold=True)
    for f in chunks[1][0][:20]:
        dec.push(4, f)
        dec.step()
    dec.drop(4)
    assert dec.step() == [] and dec.active() == 0 and len(dec._free) == 2
