"""DAC codec wrapper and the streaming dac_decoder node (CPU, tiny random codec)."""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
import torch

from engine.dac.codec import HOP, Codec, CodecLoadError
from engine.dac.schedule import ChunkSchedule
from engine.dac.streaming import (
    StreamingDecoder,
    aligned_codes,
    crossfade_window,
    decode_offline,
    to_int16,
)
from engine.delay import shear, shear_up

# spec §5.3: 0.2 s of DAC silence (rows 2-15 repeat row 2) and its sheared prompt rows
SILENCE = [[568, 778, 338, 524, 967, 360, 728, 550, 90], [568, 778, 10, 674, 364, 981, 741, 378, 731]]
SILENCE += [[568, 804, 10, 674, 364, 981, 568, 378, 731]] * 14 + [[568, 778, 721, 842, 264, 974, 989, 507, 308]]
SHEARED_T3 = [568, 804, 10, 524, 1025, 1025, 1025, 1025, 1025]
SHEARED_T8 = [568, 804, 10, 674, 364, 981, 568, 378, 90]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # 2 shared cores: OpenMP threads fighting other processes make decodes 10x slower
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def codec() -> Codec:
    return Codec.random("tiny", seed=0)


def snr_db(ref: np.ndarray, x: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(ref**2) / max(np.sum((ref - x) ** 2), 1e-30)))


def random_frames(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1024, (n, 9))


def stream(codec: Codec, frames: np.ndarray, eos: int | None, schedule: ChunkSchedule | None = None,
           eos_at_push: bool = False) -> tuple[np.ndarray, int]:
    """Push one frame per step like the engine; return (float PCM, number of finals).

    eos_at_push: report eos with frame eos (the earliest step the engine can know it is
    eos + c, c <= 8); otherwise only at finish (the random codes carry no EOA).
    """
    dec = StreamingDecoder(codec, schedule)
    dec.open(7)
    out, finals = [], 0
    for k, f in enumerate(frames):
        dec.push(7, f, eos_frame=eos if eos_at_push and eos is not None and k >= eos else None)
        for rid, pcm, final in dec.step(as_float=True):
            assert rid == 7
            out.append(pcm)
            finals += final
    dec.finish(7, eos)
    for _, pcm, final in dec.step(as_float=True):
        out.append(pcm)
        finals += final
    assert dec.active() == 0 and not dec.pending()
    return np.concatenate(out), finals


# ---- delay pattern ---------------------------------------------------------------------------


def test_shear_matches_spec_silence_table():
    x = torch.tensor(SILENCE)
    s = shear(x)
    assert s.shape == x.shape
    assert s[0].tolist() == [568] + [1025] * 8
    assert s[3].tolist() == SHEARED_T3 and s[8].tolist() == SHEARED_T8
    assert s[16].tolist() == [568, 804, 10, 674, 364, 981, 568, 378, 731]  # tail truncated, not extended


def test_shear_up_inverts_shear():
    x = torch.randint(0, 1024, (3, 40, 9))
    back = shear_up(shear(x))
    assert torch.equal(back[:, :32], x[:, :32])  # the last 8 rows lost codebooks to truncation
    assert torch.equal(shear(shear_up(x))[:, 8:], x[:, 8:])
    up = shear_up(x[0])
    for r in range(40):
        for j in range(9):
            assert up[r, j] == (x[0, r + j, j] if r + j < 40 else 1025)
    assert shear_up(x[0, :3]).shape == (3, 9)  # fewer frames than codebooks


def test_aligned_codes_is_a_window_of_shear_up():
    d = random_frames(30)
    full = shear_up(torch.from_numpy(d)).numpy()
    for a, b in [(0, 30), (0, 22), (5, 17), (20, 30), (29, 30), (4, 4)]:
        assert np.array_equal(aligned_codes(d, a, b), full[a:b])


# ---- codec ------------------------------------------------------------------------------------


def test_codec_shapes_and_clamp(codec: Codec):
    assert (codec.sample_rate, codec.hop, codec.n_codebooks) == (44100, 512, 9)
    assert codec.kwargs["decoder_rates"] == [8, 8, 4, 2] and codec.kwargs["codebook_dim"] == 8
    codes = torch.randint(0, 1024, (2, 11, 9))
    for f in (0, 1, 11):
        out = codec.decode(codes[:, :f])
        assert out.shape == (2, f * HOP) and out.dtype == torch.float32
    assert codec.decode(codes[0]).shape == (11 * HOP,)
    eoa = codes.clone()
    eoa[:, 3, 2], eoa[:, 5, :] = 1024, 1025
    ref = eoa.clamp(max=1023)
    assert torch.equal(codec.decode(eoa), codec.decode(ref))
    assert not torch.equal(codec.decode(eoa), codec.decode(codes))


def test_random_is_deterministic():
    a, b = Codec.random("tiny", seed=3), Codec.random("tiny", seed=3)
    codes = torch.randint(0, 1024, (1, 6, 9))
    assert torch.equal(a.decode(codes), b.decode(codes))
    assert not torch.equal(a.decode(codes), Codec.random("tiny", seed=4).decode(codes))


@pytest.mark.filterwarnings("ignore::FutureWarning")  # dac.DAC's legacy weight_norm
def test_save_load_roundtrip_and_official_format(codec: Codec, tmp_path):
    path = tmp_path / "weights_44khz_8kbps_0.0.1.pth"
    codec.save(path)
    blob = torch.load(path, weights_only=True)
    assert set(blob) == {"state_dict", "metadata"} and set(blob["metadata"]) == {"kwargs"}
    assert any(k.endswith("weight_g") for k in blob["state_dict"])  # weight norm kept, as in the release
    loaded = Codec.load(path)
    codes = torch.randint(0, 1026, (2, 20, 9))
    assert torch.equal(loaded.decode(codes), codec.decode(codes))
    # the reference loader reads the same file and decodes the same PCM (our Snake is an eager
    # addcmul, theirs TorchScript: equal to float rounding)
    import dac

    ref = dac.DAC.load(str(path)).eval()
    with torch.inference_mode():
        z = ref.quantizer.from_codes(codes.clamp(max=1023).transpose(1, 2))[0]
        pcm = ref.decode(z).squeeze(1)
    torch.testing.assert_close(codec.decode(codes), pcm, rtol=0, atol=1e-6)


def _save_raw(path, state, kwargs) -> None:
    torch.save({"state_dict": state, "metadata": {"kwargs": kwargs}}, path)


def test_load_refuses_bad_files(codec: Codec, tmp_path):
    good = tmp_path / "good.pth"
    codec.save(good)
    blob = torch.load(good, weights_only=True)
    state, kwargs = blob["state_dict"], blob["metadata"]["kwargs"]

    def refused(name: str, match: str) -> None:
        with pytest.raises(CodecLoadError, match=match):
            Codec.load(tmp_path / name)

    with pytest.raises(FileNotFoundError):
        Codec.load(tmp_path / "nope.pth")
    for seed in range(4):  # random bytes fail in various ways inside torch.load
        (tmp_path / "noise.pth").write_bytes(np.random.default_rng(seed).bytes(4096))
        refused("noise.pth", "not a readable torch weights file")
    (tmp_path / "trunc.pth").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    refused("trunc.pth", "not a readable torch weights file")
    torch.save(torch.zeros(3), tmp_path / "tensor.pth")
    refused("tensor.pth", "expected a dict with 'state_dict' and 'metadata'")
    torch.save({"state_dict": state, "metadata": {}, "evil": pickle.PicklingError("x")}, tmp_path / "pickle.pth")
    refused("pickle.pth", r"weights_only=True.*GLOBAL pickle.PicklingError")
    _save_raw(tmp_path / "24k.pth", state, {**kwargs, "sample_rate": 24000, "encoder_rates": [2, 4, 5, 8]})
    refused("24k.pth", r"sample_rate=24000 \(need 44100\).*hop 320")
    _save_raw(tmp_path / "16kbps.pth", state, {**kwargs, "n_codebooks": 18})
    refused("16kbps.pth", "n_codebooks=18")
    _save_raw(tmp_path / "missing.pth", {k: v for k, v in state.items() if "decoder.model.1" not in k}, kwargs)
    refused("missing.pth", "decoder/quantizer tensors missing")
    _save_raw(tmp_path / "shape.pth", state, {**kwargs, "decoder_dim": 128})
    refused("shape.pth", "tensor shapes do not match")
    nan = dict(state)
    nan["decoder.model.0.bias"] = torch.full_like(state["decoder.model.0.bias"], float("nan"))
    _save_raw(tmp_path / "nan.pth", nan, kwargs)
    refused("nan.pth", "non-finite")


# ---- streaming ----------------------------------------------------------------------------------


def test_schedule_sizes():
    assert ChunkSchedule().sizes(9) == [12, 6, 6, 7, 11, 16, 24, 32, 32] and ChunkSchedule().exact
    assert ChunkSchedule.low_latency().sizes(6) == [8, 4, 8, 16, 32, 32]
    assert ChunkSchedule.reference().sizes(3) == [16, 16, 16]
    with pytest.raises(ValueError):
        ChunkSchedule(context_frames=4, lookahead_frames=8)
    w = crossfade_window(5)
    assert w[0] == 0 and w[-1] == pytest.approx(1) and np.all(np.diff(w) > 0)


def test_first_audio_timing(codec: Codec):
    """Default: chunk 0 (12 aligned frames) is ready after 12 + 8 = 20 pushed frames."""
    for sched, steps, frames in [(ChunkSchedule(), 20, 3), (ChunkSchedule.low_latency(), 16, 4),
                                 (ChunkSchedule.reference(), 24, 12)]:
        dec = StreamingDecoder(codec, sched)
        d = random_frames(40)
        for k in range(40):
            dec.push(1, d[k])
            if dec.pending():
                assert k + 1 == steps
                ((_, pcm, final),) = dec.step()
                assert pcm.dtype == np.int16 and len(pcm) == frames * HOP and not final
                break
        else:
            pytest.fail("no chunk")


SNR_CASES = {  # schedule, min SNR dB asserted (measured on the tiny codec: see test output)
    "ctx4 (reference)": (ChunkSchedule.reference(), 15.0),
    "ctx4 ov4": (ChunkSchedule(first_chunk_frames=8, context_frames=4, overlap_frames=4, lookahead_frames=None), 16.0),
    "ctx16 ov4 (low_latency)": (ChunkSchedule.low_latency(), 20.0),
    "ctx18 hold9 (default)": (ChunkSchedule(), 90.0),
}


@pytest.mark.parametrize("eos", [None, 97])
def test_stream_matches_one_shot(codec: Codec, eos, capsys):
    frames = random_frames(150, seed=1)
    ref = decode_offline(codec, frames, eos)
    n = 150 if eos is None else eos
    assert len(ref) == n * HOP
    lines = []
    for name, (sched, floor) in SNR_CASES.items():
        x, finals = stream(codec, frames, eos, sched, eos_at_push=True)
        assert finals == 1
        assert len(x) == n * HOP, name
        snr = snr_db(ref, x)
        lines.append(f"  {name:26s} SNR {snr:6.1f} dB (asserted >= {floor})")
        assert snr >= floor, name
    with capsys.disabled():
        print(f"\nstream vs one-shot, tiny codec, 150 frames, eos={eos}:\n" + "\n".join(lines))


def test_eos_truncates_received_frames(codec: Codec):
    frames = random_frames(60, seed=2)
    dec = StreamingDecoder(codec)
    dec.push(3, frames)  # 60 frames at once, no step in between
    dec.finish(3, 20)
    ((rid, pcm, final),) = dec.step(as_float=True)
    assert rid == 3 and final and len(pcm) == 20 * HOP
    assert np.array_equal(pcm, decode_offline(codec, frames, 20))
    # eos_frame larger than the frames received is capped at N
    dec.push(4, frames[:10])
    dec.finish(4, 50)
    ((_, pcm, _),) = dec.step()
    assert len(pcm) == 10 * HOP
    # eos 0 and no frames at all still produce exactly one (empty) final
    dec.push(5, frames[:12])
    dec.finish(5, 0)
    dec.open(6)
    dec.finish(6, None)
    out = {rid: (len(p), f) for rid, p, f in dec.step()}
    assert out == {5: (0, True), 6: (0, True)} and dec.active() == 0


def test_eos_from_push_finalizes_early(codec: Codec):
    frames = random_frames(80, seed=3)
    eos = 40
    dec = StreamingDecoder(codec)
    got, final_at = [], None
    for k in range(80):
        dec.push(1, frames[k], eos_frame=eos if k == eos + 2 else None)
        for _, pcm, final in dec.step(as_float=True):
            got.append(pcm)
            if final:
                final_at = k
    assert final_at == eos + 8 - 1  # all frames < eos complete: no need to wait for finish
    assert dec.active() == 1  # tombstone until finish(): late pushes are ignored
    dec.finish(1, eos)
    assert dec.active() == 0 and dec.step() == []
    x = np.concatenate(got)
    assert len(x) == eos * HOP and snr_db(decode_offline(codec, frames, eos), x) > 90


def test_known_eos_caps_streaming_while_frames_keep_coming(codec: Codec):
    """The LLM node knows the audio ends at frame 67 when the EOA appears in delayed frame 70 (codebook 3)
    and says so with that frame; frames still arrive until its countdown ends 9 frames later. Nothing
    past the EOS is ever emitted, and without an EOS (ignore_eos) every frame is."""
    frames = random_frames(120, seed=4)
    frames[70, 3] = 1024
    eos = 67
    for eos_at_70, total in [(eos, eos), (None, 120)]:
        dec = StreamingDecoder(codec)
        dec.open(1)
        emitted = 0
        for k in range(79):
            dec.push(1, frames[k], eos_frame=eos_at_70 if k >= 70 else None)
            emitted += sum(len(p) for _, p, _ in dec.step())
            assert emitted <= total * HOP
        if eos_at_70 is None:
            dec.push(1, frames[79:])
        dec.finish(1, eos_at_70)
        emitted += sum(len(p) for _, p, _ in dec.step())
        assert emitted == total * HOP


class CountingCodec:
    """Delegates to a Codec (or returns silence if None) and records every call's shape."""

    sample_rate = 44100

    def __init__(self, codec: Codec | None) -> None:
        self.codec, self.calls = codec, []

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        self.calls.append(tuple(codes.shape))
        if self.codec is None:
            return torch.zeros(codes.shape[0], codes.shape[1] * HOP)
        return self.codec.decode(codes)


def test_batching_equals_alone(codec: Codec):
    frames = {rid: random_frames(90, seed=10 + rid) for rid in range(4)}
    eos = {0: None, 1: 70, 2: None, 3: 55}
    lag = {0: 0, 1: 0, 2: 0, 3: 31}  # rid 3 starts late: another chunk phase
    alone, n_alone_calls = {}, 0
    for rid in frames:
        cc = CountingCodec(codec)
        alone[rid] = stream(cc, frames[rid], eos[rid], eos_at_push=True)[0]  # type: ignore[arg-type]
        n_alone_calls += len(cc.calls)

    cc = CountingCodec(codec)
    dec = StreamingDecoder(cc)  # type: ignore[arg-type]
    out: dict[int, list[np.ndarray]] = {rid: [] for rid in frames}
    for t in range(130):
        for rid in frames:
            k = t - lag[rid]
            if k == 0:
                dec.open(rid)
            if 0 <= k < 90:
                e = eos[rid]
                dec.push(rid, frames[rid][k], eos_frame=e if e is not None and k >= e else None)
            elif k == 90:
                dec.finish(rid, eos[rid])
        if 40 <= t < 70:
            continue  # the consumer stalls: requests pile up several ready chunks each
        for rid, pcm, _ in dec.step(as_float=True):
            out[rid].append(pcm)
    assert dec.active() == 0
    for rid in frames:
        x = np.concatenate(out[rid])
        assert len(x) == len(alone[rid])
        assert np.abs(to_int16(x).astype(int) - to_int16(alone[rid]).astype(int)).max() <= 1
    assert max(b for b, _, _ in cc.calls) >= 3  # lockstep chunks really share DAC calls
    assert len(cc.calls) <= 0.6 * n_alone_calls  # measured: 12 calls vs 22 decoding alone


def test_several_ready_chunks_of_one_request_share_a_call(codec: Codec):
    cc = CountingCodec(codec)
    dec = StreamingDecoder(cc, ChunkSchedule(first_chunk_frames=16, chunk_frames=16, pace=1e9))  # type: ignore[arg-type]
    dec.push(1, random_frames(8 + 64))  # 64 aligned frames = 4 chunks of 16, all ready
    ((_, pcm, final),) = dec.step()
    assert not final and len(pcm) == (64 - 9) * HOP
    # chunk 0 has no left context, chunk 1 has 16 frames of it, chunks 2 and 3 the full 18
    assert cc.calls == [(1, 16, 9), (1, 32, 9), (2, 34, 9)]


def test_max_frames_budget_defers_requests(codec: Codec):
    frames = {rid: random_frames(60, seed=20 + rid) for rid in range(3)}
    budget_dec, free_dec = StreamingDecoder(codec), StreamingDecoder(codec)
    out: dict[int, list[np.ndarray]] = {rid: [] for rid in frames}
    for k in range(60):
        for rid in frames:
            budget_dec.push(rid, frames[rid][k])
        got = budget_dec.step(as_float=True, max_frames=12)
        assert len(got) <= 1  # one 12-frame chunk fills the budget
        for rid, p, _ in got:
            out[rid].append(p)
    for rid in frames:
        budget_dec.finish(rid, None)
    while budget_dec.pending():
        for rid, p, _ in budget_dec.step(as_float=True, max_frames=12):
            out[rid].append(p)
    assert budget_dec.active() == 0
    for rid in frames:
        free_dec.push(rid, frames[rid])
        free_dec.finish(rid, None)
    alone = {rid: p for rid, p, _ in free_dec.step(as_float=True)}
    for rid in frames:  # deferring changes when audio leaves, never what it is
        assert snr_db(alone[rid], np.concatenate(out[rid])) > 90


@pytest.mark.parametrize("schedule", [ChunkSchedule(), ChunkSchedule.low_latency()], ids=["default", "low_latency"])
def test_warmup_covers_every_shape_step_uses(schedule: ChunkSchedule):
    """cuDNN plans are per (batch, length): a served request must never meet a cold shape."""
    cc = CountingCodec(None)
    dec = StreamingDecoder(cc, schedule)  # type: ignore[arg-type]
    dec.warmup(max_batch=8)
    warm, cc.calls = set(cc.calls), []
    rng = np.random.default_rng(7)
    lengths = {rid: int(rng.integers(1, 120)) for rid in range(24)}  # short and long utterances
    starts = {rid: int(rng.integers(0, 60)) for rid in lengths}
    eos = {rid: (int(rng.integers(0, n + 1)) if rid % 3 else None) for rid, n in lengths.items()}
    total = {rid: 0 for rid in lengths}
    for t in range(200):
        for rid, n in lengths.items():
            k = t - starts[rid]
            if 0 <= k < n:
                e = eos[rid]
                dec.push(rid, random_frames(1, seed=1000 * rid + k), eos_frame=e if e is not None and k >= e else None)
            elif k == n:
                dec.finish(rid, eos[rid])
        for rid, pcm, _ in dec.step(max_batch=8):
            total[rid] += len(pcm)
    assert dec.active() == 0
    assert total == {rid: (n if eos[rid] is None else min(eos[rid], n)) * HOP for rid, n in lengths.items()}
    assert set(cc.calls) <= warm, sorted(set(cc.calls) - warm)


def test_drop_mid_stream(codec: Codec):
    frames = random_frames(60, seed=5)
    dec = StreamingDecoder(codec)
    for k in range(40):
        dec.push(1, frames[k])
        dec.push(2, frames[k])
        dec.step()
    dec.drop(1)
    dec.drop(1)  # idempotent
    dec.drop(99)
    assert dec.active() == 1
    for k in range(40, 60):
        dec.push(2, frames[k])
        assert all(rid == 2 for rid, _, _ in dec.step())
    dec.finish(2, None)
    assert [rid for rid, _, f in dec.step() if f] == [2]
    assert dec.active() == 0 and not dec.pending()
    dec.open(1)  # the id is free again
    with pytest.raises(KeyError):
        dec.finish(42)
    with pytest.raises(ValueError, match="audio codes"):
        dec.push(1, np.zeros((1, 10), dtype=np.int64))  # a frame with its text column


def test_failed_decode_can_be_retried(codec: Codec):
    class Flaky(CountingCodec):
        fail = True

        def decode(self, codes: torch.Tensor) -> torch.Tensor:
            if self.fail:
                self.fail = False
                raise RuntimeError("CUDA out of memory (simulated)")
            return super().decode(codes)

    frames = random_frames(70, seed=6)
    dec = StreamingDecoder(Flaky(codec))  # type: ignore[arg-type]
    dec.push(1, frames[:40])
    with pytest.raises(RuntimeError, match="simulated"):
        dec.step()
    assert dec.pending()
    out = [p for _, p, _ in dec.step(as_float=True)]
    dec.push(1, frames[40:])
    dec.finish(1, None)
    out += [p for _, p, _ in dec.step(as_float=True)]
    assert snr_db(decode_offline(codec, frames), np.concatenate(out)) > 90


def test_to_int16():
    x = np.array([-2.0, -1.0, -0.5, 0.0, 1 / 32767 * 0.49, 0.5, 1.0, 3.0], dtype=np.float32)
    assert to_int16(x).tolist() == [-32767, -32767, -16384, 0, 0, 16384, 32767, 32767]


@pytest.mark.slow
def test_full_size_codec_seams(capsys):
    """Full 44.1 kHz architecture (random weights, 54 M decoder params): ~20 s on CPU."""
    from bench.dac_seams import measure

    schedules = {
        "ctx4 ov4": ChunkSchedule(first_chunk_frames=8, context_frames=4, overlap_frames=4, lookahead_frames=None),
        "ctx16 ov4": ChunkSchedule.low_latency(),
        "ctx18 hold9": ChunkSchedule(),
    }
    t0 = time.perf_counter()
    res = measure("full", schedules, n_frames=64, seeds=1)
    with capsys.disabled():
        print(f"\nfull-size random codec, 64 frames ({time.perf_counter() - t0:.0f} s):")
        for k, (snr, worst) in res.items():
            print(f"  {k:12s} SNR {snr:6.1f} dB, worst frame {worst:6.1f} dB")
    # measured (CPU fp32, 80 frames): 15.3 / 18.6 / 119.9 dB
    assert res["ctx4 ov4"][0] > 10 and res["ctx16 ov4"][0] > 14
    assert res["ctx18 hold9"][0] > 90


class LateEvent:
    """Stands in for a CUDA event that has not passed yet: the launch it marks lands after n queries."""

    def __init__(self, n: int) -> None:
        self.n = n

    def query(self) -> bool:
        self.n -= 1
        return self.n < 0

    def synchronize(self) -> None:
        self.n = -1


def test_calls_in_flight_land_in_launch_order_and_equal_one_shot(codec: Codec):
    """The engine launches DAC calls and collects them iterations later; several calls of one request
    may be in flight at once. Landing order (FIFO) keeps its stream exactly the one-shot decode."""
    frames = {rid: random_frames(150, seed=40 + rid) for rid in range(3)}
    dec = StreamingDecoder(codec)
    out: dict[int, list[np.ndarray]] = {rid: [] for rid in frames}
    most_in_flight = 0
    for k in range(150):
        dec.push_rows(list(frames), np.stack([frames[rid][k] for rid in frames]))
        if dec.launch(max_batch=4):
            dec._flights[-1].done = LateEvent(20)  # type: ignore[assignment]
        most_in_flight = max(most_in_flight, dec.in_flight())
        for rid, pcm, _ in dec.collect(as_float=True):
            out[rid].append(pcm)
    for rid in frames:
        dec.finish(rid, None)
    dec.launch()
    for rid, pcm, _ in dec.collect(as_float=True, wait=True):
        out[rid].append(pcm)
    assert dec.active() == 0 and dec.in_flight() == 0 and most_in_flight >= 2
    for rid, f in frames.items():
        x = np.concatenate(out[rid])
        assert len(x) == 150 * HOP
        assert snr_db(decode_offline(codec, f), x) > 90


def test_drop_while_in_flight_discards_its_audio(codec: Codec):
    dec = StreamingDecoder(codec)
    a, b = random_frames(40, seed=1), random_frames(40, seed=2)
    for k in range(40):
        dec.push_rows([1, 2], np.stack([a[k], b[k]]))
    assert dec.launch() > 0
    dec._flights[-1].done = LateEvent(1)  # type: ignore[assignment]
    dec.drop(1)
    got = dec.collect(wait=True)
    assert [rid for rid, _, _ in got] == [2]


def test_push_rows_equals_push(codec: Codec):
    rows = random_frames(100, seed=5)  # past the first buffer (64 rows): the batched path grows it too
    a, b = StreamingDecoder(codec), StreamingDecoder(codec)
    for k in range(100):
        a.push(9, rows[k])
        b.push_rows([9], rows[k][None])
    ra, rb = a._reqs[9], b._reqs[9]
    assert ra.n == rb.n == 100
    assert np.array_equal(ra.buf[:100], rb.buf[:100])


def test_frame_budget_bounds_each_launch(codec: Codec):
    """Streams that cut chunks in lockstep are spread over launches: a launch carries at most the
    budget, or one request's ready chunks when those alone exceed it; every stream still gets all its
    audio, in order, exactly."""
    dec = StreamingDecoder(codec)
    n, budget = 8, 40
    frames = {rid: random_frames(120, seed=60 + rid) for rid in range(n)}
    out: dict[int, list[np.ndarray]] = {rid: [] for rid in frames}
    longest_chunk = max(dec.length_buckets)
    spread = 0
    for k in range(120):
        dec.push_rows(list(frames), np.stack([frames[rid][k] for rid in frames]))
        ready = sum(dec._ready(r) for r in dec._reqs.values())
        if dec.launch(max_batch=8, max_frames=budget):
            launched = dec._flights[-1].chunks
            assert sum(c.end - c.start for c in launched) <= budget + longest_chunk
            spread += len({c.rid for c in launched}) < ready
        for rid, pcm, _ in dec.collect(as_float=True):
            out[rid].append(pcm)
    for rid in frames:
        dec.finish(rid, None)
    while dec.pending():
        dec.launch(max_batch=8, max_frames=budget)
        for rid, pcm, _ in dec.collect(as_float=True):
            out[rid].append(pcm)
    assert spread  # lockstep chunks really were deferred to later launches
    for rid, f in frames.items():
        x = np.concatenate(out[rid])
        assert len(x) == 120 * HOP and snr_db(decode_offline(codec, f), x) > 90


def _player_stalls(schedule: ChunkSchedule, step_ms: float, frames: int = 292, prebuffer_ms: float = 150.0,
                   dac_ms: float = 10.0) -> list[float]:
    """Stalls (ms) of a player that starts prebuffer_ms after the first chunk, when one frame is generated
    every step_ms and each chunk lands dac_ms after its last frame (its 8 delayed codebooks included)."""
    frame_ms = HOP / 44.1
    events, planned, n = [], 0, 0
    while planned + schedule.next_size(n, planned) + 8 <= frames:
        planned += schedule.next_size(n, planned)
        n += 1
        events.append(((planned + 8) * step_ms + dac_ms, planned - schedule.holdback))
    events.append((frames * step_ms + dac_ms, frames))
    runs_out = events[0][0] + prebuffer_ms + events[0][1] * frame_ms
    stalls, emitted = [], events[0][1]
    for t, total in events[1:]:
        if t > runs_out:
            stalls.append(t - runs_out)
            runs_out = t
        runs_out += (total - emitted) * frame_ms
        emitted = total
    return stalls


def test_default_schedule_feeds_a_player_until_steps_near_real_time():
    """Chunks grow with the audio the client holds, at half its rate: a 150 ms prebuffer then covers a
    generator running down to ~1.16x real time (10 ms per step), which is where a loaded GPU runs."""
    for step_ms in (2.5, 5.0, 8.0, 9.5):
        assert _player_stalls(ChunkSchedule(), step_ms) == [], step_ms
    assert _player_stalls(ChunkSchedule(pace=1.0), 9.5)  # growing as fast as the buffer: a stall
    assert _player_stalls(ChunkSchedule(chunk_frames=64, pace=1.0), 8.0)
