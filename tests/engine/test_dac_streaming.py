"""DAC codec wrapper and the streaming dac_decoder node (CPU, tiny random codec)."""

from __future__ import annotations

import os
import pickle
import time

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # the fused Snake runs in Triton's interpreter (before anything imports it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.dac.codec import HOP, Codec, CodecLoadError
from engine.dac.incremental import UNBOUNDED, IncrementalDAC, mask_outside
from engine.dac.schedule import FIRST_AUDIO_FRAMES, ChunkSchedule
from engine.dac.streaming import (
    StreamingDecoder,
    aligned_codes,
    decode_offline,
    sheared,
    to_int16,
)
from engine.frontend.delay import shear, shear_up

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


def stream(
    codec: Codec,
    frames: np.ndarray,
    eos: int | None,
    schedule: ChunkSchedule | None = None,
    eos_at_push: bool = False,
    first_samples: int | None = None,
    as_float: bool = True,
) -> tuple[np.ndarray, int]:
    """Push one frame per step like the engine; return (PCM, number of finals).

    eos_at_push: report eos with frame eos (the earliest step the engine can know it is
    eos + c, c <= 8); otherwise only at finish (the random codes carry no EOA). first_samples: what the
    stream's client needs before its first output (StreamingDecoder.open).
    """
    dec = StreamingDecoder(codec, schedule)
    dec.open(7, first_samples=first_samples)
    out, finals = [], 0
    for k, f in enumerate(frames):
        dec.push(7, f, eos_frame=eos if eos_at_push and eos is not None and k >= eos else None)
        for rid, pcm, final in dec.step(as_float=as_float):
            assert rid == 7
            out.append(pcm)
            finals += final
    dec.finish(7, eos)
    for _, pcm, final in dec.step(as_float=as_float):
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


def test_the_sheared_view_is_aligned_codes_where_every_code_was_received():
    """The launch's fast path (`sheared`, a strided view) gives aligned_codes's rows wherever it applies, and
    refuses a window that reads past the frames (there aligned_codes pads)."""
    d = random_frames(40).astype(np.int32)
    for start in range(0, 32):
        for size in (1, 4, 10, 13, 16):
            if start + size + 8 <= len(d):
                view = sheared(d, start, size)
                assert np.array_equal(view, aligned_codes(d, start, start + size))
                assert not view.flags.writeable  # a view of the stream's buffer: never written through
            else:
                with pytest.raises(IndexError):
                    sheared(d, start, size)


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


# ---- incremental DAC ----------------------------------------------------------------------------

EXACT_DB = 100.0  # streamed vs one-shot, fp32 on CPU: float rounding only (measured ~128 dB)


def test_lag_of_the_44k_architecture(codec: Codec):
    net = IncrementalDAC(codec, slots=1)
    # conv0 3 frames; each block's transposed conv ceil(s/2) + its residual units 3 + 9 + 27, at its rate;
    # the last conv 3 samples
    assert net.lag == 3 * 512 + 43 * 64 + 43 * 8 + 41 * 2 + 40 + 3 == 4757
    assert -(-net.lag // HOP) == FIRST_AUDIO_FRAMES == ChunkSchedule().frames
    assert [ly.kind for ly in net.layers] == ["in"] + (["up"] + ["res"] * 3) * 4 + ["out"]


def feed(net: IncrementalDAC, codes: np.ndarray, slot: int, sizes) -> np.ndarray:
    """Stream aligned codes [T, 9] through one slot in calls of the given sizes (cycled) until the audio is
    complete; return the T * 512 samples of times [0, T * 512)."""
    t, a, out, k = len(codes), 0, [], 0
    while a * HOP - net.lag < t * HOP:
        f = sizes[k % len(sizes)]
        k += 1
        c = np.full((1, f, 9), 1025, dtype=np.int64)
        real = codes[a : a + f]
        c[0, : len(real)] = real
        p = net.pack(c, np.array([slot]), np.array([a]), np.array([t]))
        out.append(net.run(torch.from_numpy(p).to(net.state.device), f)[0].cpu().numpy())
        a += f
    return np.concatenate(out)[net.lag : net.lag + t * HOP]


@pytest.mark.parametrize("seed", range(4))
def test_incremental_equals_one_shot_for_any_call_sizes(codec: Codec, seed: int):
    rng = np.random.default_rng(seed)
    net = IncrementalDAC(codec, slots=3)
    t = int(rng.integers(1, 60))
    codes = rng.integers(0, 1024, (t, 9))
    ref = codec.decode(torch.from_numpy(codes)[None])[0].numpy()
    sizes = [int(x) for x in rng.integers(1, 24, 7)]
    x = feed(net, codes, int(rng.integers(0, 3)), sizes)
    assert len(x) == t * HOP
    assert snr_db(ref, x) > EXACT_DB, (t, sizes)


@pytest.mark.slow
def test_fused_passes_equal_the_plain_form_and_the_one_shot_decode(codec: Codec, monkeypatch):
    """The GPU's fused form (bias in the Snake, bias + residual + concatenation in one pass, NHWC windows;
    on a CPU in Triton's interpreter) decodes what the plain ops decode, for a first call and later ones."""
    from engine.dac import kernels
    from engine.dac.kernels import bias_residual

    gpu = torch.cuda.is_available()
    if gpu:
        codec = Codec.random("tiny", seed=0, device="cuda", dtype=torch.float32)
    else:
        # Triton's interpreter runs one Python call per program: 512 time steps per tile (a layer of 12 frames
        # is a few programs, not ~100 of 32). Each output element of these elementwise kernels is the same
        # whatever the tiles. The default tiles: test_masked_fused_snake_matches_reference (both layouts,
        # several tiles, edges) and the checks of bias_residual below
        default_tiles = kernels._tiles
        monkeypatch.setattr(kernels, "_tiles", lambda x: (default_tiles(x)[0], 512))
    rng = np.random.default_rng(11)
    codes = rng.integers(0, 1024, (12, 9))  # few frames: the interpreter's time is per frame
    # full fp32 convolutions on a GPU: with TF32 (which other tests may switch on) the two forms' cuDNN
    # algorithms (NCL, NHWC) round their inputs to 10 bits each, ~40 dB apart after the decoder's 40 layers;
    # and deterministic algorithms, chosen without timing them, so both forms get comparable ones
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True, allow_tf32=False):
        ref = codec.decode(torch.from_numpy(codes).to(codec.device)[None])[0].cpu().numpy()
        plain = feed(IncrementalDAC(codec, slots=2, fused=False, cudnn_benchmark=False), codes, 1, [7, 5])
        fused = feed(IncrementalDAC(codec, slots=2, fused=True, cudnn_benchmark=False), codes, 1, [7, 5])
    monkeypatch.undo()
    if gpu:
        print(f"fused vs plain SNR {snr_db(plain, fused):.1f} dB, vs one-shot {snr_db(ref, fused):.1f} dB")
        assert snr_db(plain, fused) > 60 and snr_db(ref, fused) > 60
    else:
        np.testing.assert_allclose(fused, plain, rtol=1e-5, atol=1e-6)
        assert snr_db(ref, fused) > EXACT_DB
    dev = codec.device
    h, skip, bias = torch.randn(2, 3, 5, device=dev), torch.randn(2, 3, 9, device=dev), torch.randn(3, device=dev)
    out = torch.zeros(2, 3, 8, device=dev)
    bias_residual(h, bias, out[..., 3:], skip[..., 2:7])
    torch.testing.assert_close(out[..., 3:], h + bias[:, None] + skip[..., 2:7])
    assert (out[..., :3] == 0).all()
    nlc = torch.zeros(2, 8, 3, device=dev).transpose(1, 2)  # channels contiguous, as the fused windows
    bias_residual(h, bias, nlc[..., 3:], skip[..., 2:7])
    torch.testing.assert_close(nlc, out)
    with pytest.raises(ValueError, match="not h's"):
        bias_residual(h, bias, torch.zeros(2, 3, 4, device=dev))


def test_incremental_rows_are_independent_and_a_reused_slot_starts_clean(codec: Codec):
    """Two streams in one batch at different offsets each equal their one-shot decode; a slot whose state is
    garbage (even NaN) is reset by its next stream's first call."""
    net = IncrementalDAC(codec, slots=2)
    rng = np.random.default_rng(5)
    a, b = rng.integers(0, 1024, (30, 9)), rng.integers(0, 1024, (17, 9))
    net.state[1] = float("nan")
    out: dict[int, list[np.ndarray]] = {0: [], 1: []}
    fed = {0: 0, 1: 0}
    for call in range(6):
        f = 8
        codes = np.full((2, f, 9), 1025, dtype=np.int64)
        for row, (c, start) in enumerate(((a, fed[0]), (b, fed[1]))):
            real = c[start : start + f]
            codes[row, : len(real)] = real
        start = np.array([fed[0], fed[1]])
        p = net.pack(codes, np.array([0, 1]), start, np.array([30, 17]))
        y = net.run(torch.from_numpy(p), f).numpy()
        for row in (0, 1):
            out[row].append(y[row])
            fed[row] += f
        if call == 0:
            fed[1] = 0  # stream b restarts (a new stream in slot 1): its second call is a first call again
            out[1] = []
    for row, c in ((0, a), (1, b)):
        x = np.concatenate(out[row])[net.lag : net.lag + len(c) * HOP]
        ref = codec.decode(torch.from_numpy(c)[None])[0].numpy()
        assert np.isfinite(x).all() and snr_db(ref, x) > EXACT_DB, row


def test_pack_bounds_mask_outside_the_stream(codec: Codec):
    net = IncrementalDAC(codec, slots=1)
    p = net.pack(np.zeros((2, 10, 9), dtype=np.int64), np.array([0, 0]), np.array([0, 20]), np.array([UNBOUNDED, 25]))
    bounds = p[:, 10 * 9 + 2 :].reshape(2, -1, 2)
    first = net.layers[0]  # the latent: 6 frames of state + 10 new
    assert bounds[0, 0].tolist() == [first.keep, first.keep + 10]  # the first call: state is left padding
    assert bounds[1, 0].tolist() == [0, first.keep + 5]  # frames 20..29 of a 25-frame stream: 5 are real
    x = torch.ones(2, 1, 7)
    y = mask_outside(x, torch.tensor([2, 0]), torch.tensor([4, 7]))
    assert y[0, 0].tolist() == [0, 0, 1, 1, 0, 0, 0] and y[1].sum() == 7


@pytest.mark.parametrize("t", [1, 777])
def test_masked_fused_snake_matches_reference(t: int):
    from engine.dac.kernels import snake, snake_reference

    torch.manual_seed(3)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(3, 5, t, device=dev) * 3
    alpha = torch.rand(1, 5, 1, device=dev) * 2 + 0.05
    inv = (alpha + 1e-9).reciprocal()
    bounds = torch.tensor([[0, t], [t // 3, t // 2 + 1], [t, t]], device=dev)  # strided columns, as in a call
    ref = mask_outside(snake_reference(x, alpha, inv), bounds[:, 0], bounds[:, 1])
    out = snake(x, alpha, inv, bounds[:, 0], bounds[:, 1])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(snake(x, alpha, inv), snake_reference(x, alpha, inv), rtol=1e-5, atol=1e-5)
    assert (out[2] == 0).all() and (out[0] != 0).any()
    bias = torch.randn(5, device=dev)
    torch.testing.assert_close(
        snake(x, alpha, inv, bias=bias), snake_reference(x + bias[:, None], alpha, inv), rtol=1e-5, atol=1e-5
    )
    nlc = x.transpose(1, 2).contiguous().transpose(1, 2)  # channels contiguous (the decoder's NHWC windows)
    y = snake(nlc, alpha, inv, bounds[:, 0], bounds[:, 1])
    assert y.stride() == nlc.stride()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


# ---- streaming ----------------------------------------------------------------------------------


def test_schedule_sizes():
    assert ChunkSchedule().sizes(4) == [13, 10, 10, 10] and ChunkSchedule().call_sizes() == (10, 13, 16)
    assert ChunkSchedule.low_latency().sizes(3) == [13, 4, 4] and ChunkSchedule.low_latency().call_sizes() == (4, 13)
    assert ChunkSchedule.reference().sizes(2) == [16, 16]
    with pytest.raises(ValueError):
        ChunkSchedule(frames=0)


def test_first_audio_timing(codec: Codec):
    """Call 0 of F frames is ready after F + 8 pushed frames and emits F * 512 - 4757 samples."""
    for sched, steps in [(ChunkSchedule(), 21), (ChunkSchedule.low_latency(), 21), (ChunkSchedule.reference(), 24)]:
        dec = StreamingDecoder(codec, sched)
        d = random_frames(40)
        for k in range(40):
            dec.push(1, d[k])
            if dec.pending():
                assert k + 1 == steps
                ((_, pcm, final),) = dec.step()
                assert pcm.dtype == np.int16 and len(pcm) == (steps - 8) * HOP - 4757 and not final
                break
        else:
            pytest.fail("no chunk")


def test_the_first_call_is_the_one_that_serves_the_client_soonest():
    """first_size: among the schedule's sizes (no new shape), the call 0 whose calls bring what the client
    needs before its first output after the fewest frames: call 0 itself where one can (the smallest that
    does: up to 363 samples 10 frames, to 1,899 13, to 3,435 16), else the size whose call 1 can (3,436-5,483
    samples: 10 frames; 5,484-7,019: 13; from 7,020: 16)."""
    lag, default = 4757, ChunkSchedule()
    needs = (None, 0, 1, 363, 364, 1899, 1900, 3435, 3436, 5483, 5484, 7019, 7020)
    assert [default.first_size(n, lag) for n in needs] == [13, 10, 10, 10, 13, 13, 16, 16, 10, 10, 13, 13, 16]
    assert ChunkSchedule(first_choices=()).first_size(1900, lag) == 10  # without the codec size: call 1 of 10
    assert ChunkSchedule.low_latency().first_size(1, lag) == 13  # 4-frame calls emit nothing; 10 is no shape
    assert ChunkSchedule.reference().first_size(1, lag) == 16
    assert ChunkSchedule(frames=2, first_frames=2, first_choices=()).first_size(1, lag) == 2  # none past the lag


@pytest.mark.parametrize(
    ("first_samples", "steps", "samples"), [(None, 21, 1899), (1, 18, 363), (1701, 21, 1899), (3208, 24, 3435)]
)
def test_first_audio_timing_follows_what_the_client_needs(codec: Codec, first_samples, steps: int, samples: int):
    """A client that outputs from its first sample (44.1 kHz, no resampler) gets its first audio 3 steps
    sooner: call 0 of 10 frames after 18 pushed frames, 363 samples; one that needs 1,701 keeps the 13-frame
    call; an MP3 client at 24 kHz (3,208: LAME's first whole frame) gets the 16-frame call after 24."""
    dec = StreamingDecoder(codec)
    dec.open(1, first_samples=first_samples)
    assert dec.frames_to_next(1) == steps - 8  # what admission's slack reads: call 0's size
    d = random_frames(40)
    for k in range(40):
        dec.push(1, d[k])
        if dec.pending():
            assert k + 1 == steps
            ((_, pcm, final),) = dec.step()
            assert len(pcm) == samples and not final
            break
    else:
        pytest.fail("no chunk")


@pytest.mark.parametrize("eos", [None, 57])
def test_a_smaller_first_call_streams_the_same_samples(codec: Codec, eos):
    """The first call's size changes when audio leaves, never what it is: int16 PCM of a stream with a 10-frame
    call 0 equals the same frames' with 13 and the one-shot decode, to float rounding (a call's shape may pick
    another convolution kernel on some CPUs: ~1e-7 apart, one int16 step where a sample sits on a rounding edge)."""
    frames = random_frames(120, seed=4)
    x13, _ = stream(codec, frames, eos, eos_at_push=True, as_float=False)
    x10, _ = stream(codec, frames, eos, eos_at_push=True, first_samples=1, as_float=False)
    ref = decode_offline(codec, frames, eos)
    assert x10.dtype == np.int16 and len(x10) == len(x13) and np.abs(x10.astype(np.int32) - x13).max() <= 1
    assert np.abs(x10.astype(np.int32) - to_int16(ref)).max() <= 1  # float rounding may cross a rounding edge
    f10, _ = stream(codec, frames, eos, eos_at_push=True, first_samples=1)
    assert len(f10) == len(ref) and snr_db(ref, f10) > EXACT_DB


def test_a_10_frame_first_call_batches_with_steady_calls(codec: Codec):
    """A stream whose call 0 has 10 frames shares the DAC call of a running stream's steady 10-frame call."""
    dec = StreamingDecoder(codec)
    calls = record_calls(dec)
    a, b = random_frames(60, seed=1), random_frames(60, seed=2)
    dec.open(1)  # 13, then 10 per call: calls at 21 and 31 pushed frames
    dec.open(2, first_samples=1)  # 10 frames in call 0: ready after 18 of its frames
    for k in range(31):
        dec.push(1, a[k])
        if k >= 13:  # stream 2 starts 13 steps later: its call 0 is ready with stream 1's call 1
            dec.push(2, b[k - 13])
        dec.step()
    assert calls == [(1, 13), (2, 10)]


@pytest.mark.parametrize("rate", [24000, 16000])
def test_the_first_call_gives_a_streaming_resampler_audio_to_send(rate: int):
    """Call 0 of the default schedule emits enough samples that the gateway's streaming resampler
    (app/io/audio_output.py, soxr HQ) already has output for a 24 or 16 kHz client: its first audio leaves with
    call 0, not ten iterations later with call 1."""
    import soxr

    first = ChunkSchedule().next_size(0) * HOP - 4757
    out = soxr.ResampleStream(44100, rate, 1, dtype="float32", quality="HQ").resample_chunk(np.zeros(first, np.float32))
    assert len(out) > 0


def test_steady_calls_wait_for_a_larger_batch_but_first_and_final_calls_never_do(codec: Codec):
    """launch(min_batch, max_hold): a ready steady call (a stream's third or later) waits up to max_hold
    launches while fewer than min_batch are ready; first, second and final calls go at once."""
    dec = StreamingDecoder(codec, ChunkSchedule(frames=2, first_frames=2))
    d = random_frames(60)
    dec.push(1, d[:10])  # 10 delayed frames: 2 aligned ready -> call 0
    assert dec.launch(min_batch=4, max_hold=3) == 1  # the first call never waits
    dec.collect(wait=True)
    dec.push(1, d[10:12])
    assert dec.launch(min_batch=4, max_hold=3) == 1  # nor the second
    dec.collect(wait=True)
    dec.push(1, d[12:14])  # a steady call is ready: it waits 3 launches for others, then goes
    assert [dec.launch(min_batch=4, max_hold=3) for _ in range(4)] == [0, 0, 0, 1]
    dec.collect(wait=True)
    dec.finish(1, None)  # the final calls never wait
    assert dec.launch(min_batch=4, max_hold=3) >= 1


def test_held_steady_calls_ride_along_with_a_launch_of_their_size(codec: Codec):
    """A launch that runs a DAC call anyway (first, second or final calls, which never wait) takes the held
    steady calls of the same size along (a call's cost is mostly fixed): 9 first calls take one held call,
    the call fills its bucket of 10 with no padding row, and the held stream's audio is still exact."""
    dec = StreamingDecoder(codec, ChunkSchedule(frames=2, first_frames=2))
    d = {rid: random_frames(40, seed=rid) for rid in range(10)}
    out: list[np.ndarray] = []

    def collect() -> None:
        out.extend(pcm for rid, pcm, _ in dec.collect(as_float=True, wait=True) if rid == 0)

    for k in (10, 12):  # stream 0: calls 0 and 1, then a steady call ready
        dec.push(0, d[0][k - (10 if k == 10 else 2) : k])
        assert dec.launch(min_batch=20, max_hold=5) == 1
        collect()
    dec.push(0, d[0][12:14])
    assert dec.launch(min_batch=20, max_hold=5) == 0  # held: fewer than min_batch ready
    for rid in range(1, 10):
        dec.push(rid, d[rid][:10])  # 9 first calls, which never wait
    before = dict(dec.counts)
    assert dec.launch(min_batch=20, max_hold=5) == 10  # the held call rode along in the padding row
    assert dec.counts["pad_rows"] == before.get("pad_rows", 0) and dec.counts["calls 10x2"] == 1
    collect()
    dec.push(0, d[0][14:])
    dec.finish(0, None)
    while dec.pending():
        dec.launch()
        collect()
    x = np.concatenate(out)
    assert len(x) == 40 * HOP and snr_db(decode_offline(codec, d[0]), x) > EXACT_DB


SCHEDULES = {
    "default": ChunkSchedule(),
    "low_latency": ChunkSchedule.low_latency(),
    "reference": ChunkSchedule.reference(),
    "1 frame": ChunkSchedule(frames=1),
    "3 then 7": ChunkSchedule(frames=7, first_frames=3),
    "32 then 5": ChunkSchedule(frames=5, first_frames=32),
}


@pytest.mark.parametrize("eos", [None, 97, 3])
def test_stream_matches_one_shot(codec: Codec, eos, capsys):
    """Any schedule, with or without EOS (eos=None: ignore_eos keeps every frame, the last 8 padded)."""
    frames = random_frames(150, seed=1)
    ref = decode_offline(codec, frames, eos)
    n = 150 if eos is None else eos
    assert len(ref) == n * HOP
    lines = []
    for name, sched in SCHEDULES.items():
        x, finals = stream(codec, frames, eos, sched, eos_at_push=True)
        assert finals == 1
        assert len(x) == n * HOP, name
        snr = snr_db(ref, x)
        lines.append(f"  {name:12s} SNR {snr:6.1f} dB")
        assert snr >= EXACT_DB, name
    with capsys.disabled():
        print(f"\nstream vs one-shot, tiny codec, 150 frames, eos={eos}:\n" + "\n".join(lines))


def test_eos_truncates_received_frames(codec: Codec):
    frames = random_frames(60, seed=2)
    dec = StreamingDecoder(codec)
    dec.push(3, frames)  # 60 frames at once, no step in between
    dec.finish(3, 20)
    ((rid, pcm, final),) = dec.step(as_float=True)
    assert rid == 3 and final and len(pcm) == 20 * HOP
    assert snr_db(decode_offline(codec, frames, 20), pcm) > EXACT_DB
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
    assert len(x) == eos * HOP and snr_db(decode_offline(codec, frames, eos), x) > EXACT_DB


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
        out = []
        for k in range(79):
            dec.push(1, frames[k], eos_frame=eos_at_70 if k >= 70 else None)
            out += [p for _, p, _ in dec.step(as_float=True)]
            assert sum(map(len, out)) <= total * HOP
        if eos_at_70 is None:
            dec.push(1, frames[79:])
        dec.finish(1, eos_at_70)
        out += [p for _, p, _ in dec.step(as_float=True)]
        x = np.concatenate(out)
        assert len(x) == total * HOP and snr_db(decode_offline(codec, frames, eos_at_70), x) > EXACT_DB


def record_calls(dec: StreamingDecoder, fail_first: bool = False) -> list[tuple[int, int]]:
    """Record the (batch, frames) of every DAC call the decoder runs (optionally raising on the first, as a
    CUDA OOM would); the real IncrementalDAC still runs them."""
    calls: list[tuple[int, int]] = []
    run = dec.net.run
    fail = [fail_first]

    def recorded(packed: torch.Tensor, frames: int) -> torch.Tensor:
        if fail[0]:
            fail[0] = False
            raise RuntimeError("CUDA out of memory (simulated)")
        calls.append((packed.shape[0], frames))
        return run(packed, frames)

    dec.net.run = recorded  # type: ignore[method-assign]
    return calls


def test_batching_equals_alone(codec: Codec):
    frames = {rid: random_frames(90, seed=10 + rid) for rid in range(4)}
    eos = {0: None, 1: 70, 2: None, 3: 55}
    lag = {0: 0, 1: 0, 2: 5, 3: 31}  # rids 2 and 3 start late: other call phases
    dec = StreamingDecoder(codec)
    calls = record_calls(dec)
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
            continue  # the consumer stalls: requests pile up several ready calls each
        for rid, pcm, _ in dec.step(as_float=True):
            out[rid].append(pcm)
    assert dec.active() == 0
    for rid in frames:
        x = np.concatenate(out[rid])
        assert len(x) == (90 if eos[rid] is None else eos[rid]) * HOP
        assert snr_db(decode_offline(codec, frames[rid], eos[rid]), x) > EXACT_DB, rid
    assert max(b for b, _ in calls) >= 4  # streams in different phases still share DAC calls
    assert sum(b for b, _ in calls) < 2 * len(calls)  # most calls carry several streams


def test_a_stream_that_fell_behind_catches_up_in_one_launch(codec: Codec):
    dec = StreamingDecoder(codec, ChunkSchedule(frames=10, first_frames=None))  # 10 frames in every call
    calls = record_calls(dec)
    frames = random_frames(8 + 64, seed=8)
    dec.push(1, frames)  # 64 aligned frames complete: 6 calls of 10 ready, in rounds of one launch
    assert dec.queued_frames() == 64  # the backlog admission reads
    assert dec.launch() == 6 and dec.in_flight() == 1 and dec.queued_frames() == 0  # 4 left: not a call yet
    ((_, pcm, final),) = dec.collect(as_float=True)
    assert not final and len(pcm) == 60 * HOP - 4757
    assert calls == [(1, 10)] * 6
    dec.finish(1, None)
    pcm2 = np.concatenate([p for _, p, _ in dec.step(as_float=True)])
    assert snr_db(decode_offline(codec, frames), np.concatenate([pcm, pcm2])) > EXACT_DB


def test_max_frames_budget_defers_requests(codec: Codec):
    frames = {rid: random_frames(60, seed=20 + rid) for rid in range(3)}
    budget_dec, free_dec = StreamingDecoder(codec), StreamingDecoder(codec)
    out: dict[int, list[np.ndarray]] = {rid: [] for rid in frames}
    for k in range(60):
        for rid in frames:
            budget_dec.push(rid, frames[rid][k])
        got = budget_dec.step(as_float=True, max_frames=10)
        assert len(got) <= 1  # one 10-frame call fills the budget
        for rid, p, _ in got:
            out[rid].append(p)
    for rid in frames:
        budget_dec.finish(rid, None)
    while budget_dec.pending():
        for rid, p, _ in budget_dec.step(as_float=True, max_frames=10):
            out[rid].append(p)
    assert budget_dec.active() == 0
    for rid in frames:
        free_dec.push(rid, frames[rid])
        free_dec.finish(rid, None)
    alone = {rid: p for rid, p, _ in free_dec.step(as_float=True)}
    for rid in frames:  # deferring changes when audio leaves, never what it is
        assert snr_db(alone[rid], np.concatenate(out[rid])) > EXACT_DB


@pytest.mark.parametrize("schedule", [ChunkSchedule(), ChunkSchedule.low_latency()], ids=["default", "low_latency"])
def test_warmup_covers_every_shape_step_uses(codec: Codec, schedule: ChunkSchedule):
    """cuDNN plans (and graphs) are per (batch, frames): a served request must never meet a cold shape, whatever
    its client's first call."""
    dec = StreamingDecoder(codec, schedule)
    calls = record_calls(dec)
    dec.warmup(max_batch=8)
    warm, served = set(calls), len(calls)
    assert warm == dec.warm_shapes(max_batch=8)
    rng = np.random.default_rng(7)
    lengths = {rid: int(rng.integers(1, 120)) for rid in range(24)}  # short and long utterances
    starts = {rid: int(rng.integers(0, 60)) for rid in lengths}
    eos = {rid: (int(rng.integers(0, n + 1)) if rid % 3 else None) for rid, n in lengths.items()}
    total = {rid: 0 for rid in lengths}
    for t in range(200):
        for rid, n in lengths.items():
            k = t - starts[rid]
            if k == 0:  # clients of every kind: no resampler, 24 kHz, 8 kHz (more than call 0 emits), not said
                dec.open(rid, first_samples=(1, 1701, 3525, None)[rid % 4])
            if 0 <= k < n:
                e = eos[rid]
                dec.push(rid, random_frames(1, seed=1000 * rid + k), eos_frame=e if e is not None and k >= e else None)
            elif k == n:
                dec.finish(rid, eos[rid])
        for rid, pcm, _ in dec.step(max_batch=8):
            total[rid] += len(pcm)
    assert dec.active() == 0
    assert total == {rid: (n if eos[rid] is None else min(eos[rid], n)) * HOP for rid, n in lengths.items()}
    assert set(calls[served:]) <= warm, sorted(set(calls[served:]) - warm)


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


def test_slots_are_reused_after_finish_and_drop_and_streams_wait_for_one(codec: Codec):
    """Two slots, six streams: each new stream takes a slot a finished or dropped one left (its state
    reset), a third concurrent stream waits for a slot, and every stream that is not dropped equals its
    one-shot decode."""
    dec = StreamingDecoder(codec, slots=2)
    frames = {rid: random_frames(50 + 7 * rid, seed=70 + rid) for rid in range(6)}
    starts = {0: 0, 1: 3, 2: 6, 3: 40, 4: 45, 5: 50}
    out: dict[int, list[np.ndarray]] = {rid: [] for rid in frames}
    used: set[int] = set()
    waited = False
    for t in range(400):
        for rid, f in frames.items():
            k = t - starts[rid]
            if 0 <= k < len(f):
                dec.push(rid, f[k])
            elif k == len(f):
                dec.finish(rid, None)
        if t == 30:
            dec.drop(1)  # cancel one mid-stream: its slot goes to a waiting stream
        waited |= any(r.slot < 0 and r.available() >= 10 for r in dec._reqs.values())
        for rid, pcm, _ in dec.step(as_float=True):
            out[rid].append(pcm)
        used |= {r.slot for r in dec._reqs.values() if r.slot >= 0}
        if t > 60 and not dec.active():
            break
    assert dec.active() == 0 and used == {0, 1} and waited and sorted(dec._free) == [0, 1]
    for rid, f in frames.items():
        if rid == 1:
            continue
        x = np.concatenate(out[rid])
        assert len(x) == len(f) * HOP and snr_db(decode_offline(codec, f), x) > EXACT_DB, rid


def test_failed_decode_can_be_retried(codec: Codec):
    frames = random_frames(70, seed=6)
    dec = StreamingDecoder(codec)
    record_calls(dec, fail_first=True)
    dec.push(1, frames[:40])
    with pytest.raises(RuntimeError, match="simulated"):
        dec.step()
    assert dec.pending() and dec._reqs[1].fed == 0
    out = [p for _, p, _ in dec.step(as_float=True)]
    dec.push(1, frames[40:])
    dec.finish(1, None)
    out += [p for _, p, _ in dec.step(as_float=True)]
    assert snr_db(decode_offline(codec, frames), np.concatenate(out)) > EXACT_DB


def test_to_int16():
    x = np.array([-2.0, -1.0, -0.5, 0.0, 1 / 32767 * 0.49, 0.5, 1.0, 3.0], dtype=np.float32)
    assert to_int16(x).tolist() == [-32767, -32767, -16384, 0, 0, 16384, 32767, 32767]


@pytest.mark.slow
def test_full_size_codec_streams_exactly(capsys):
    """Full 44.1 kHz architecture (random weights, 54 M decoder params), fp32 on CPU."""
    from bench.dac_seams import measure

    schedules = {
        "default": ChunkSchedule(),
        "low_latency": ChunkSchedule.low_latency(),
        "3 then 7": ChunkSchedule(frames=7, first_frames=3),
    }
    t0 = time.perf_counter()
    res = measure("full", schedules, n_frames=48, seeds=1)
    with capsys.disabled():
        print(f"\nfull-size random codec, 48 frames ({time.perf_counter() - t0:.0f} s):")
        for k, (snr, worst) in res.items():
            print(f"  {k:12s} SNR {snr:6.1f} dB, worst frame {worst:6.1f} dB")
    for k, (snr, worst) in res.items():
        assert snr > EXACT_DB and worst > EXACT_DB - 10, k


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
        assert snr_db(decode_offline(codec, f), x) > EXACT_DB


def test_drop_while_in_flight_discards_its_audio_and_the_slot_is_reused_cleanly(codec: Codec):
    dec = StreamingDecoder(codec, slots=2)
    a, b, c = random_frames(40, seed=1), random_frames(40, seed=2), random_frames(30, seed=3)
    for k in range(40):
        dec.push_rows([1, 2], np.stack([a[k], b[k]]))
    assert dec.launch() > 0
    dec._flights[-1].done = LateEvent(1)  # type: ignore[assignment]
    dec.drop(1)
    dec.push(3, c)  # takes rid 1's slot while rid 1's calls are still in flight
    dec.finish(3, None)
    dec.launch()
    got = dec.collect(wait=True, as_float=True)
    assert [rid for rid, _, _ in got] == [2, 3]
    assert snr_db(decode_offline(codec, c), got[1][1]) > EXACT_DB


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
    """Streams that become ready together are spread over launches: a launch feeds at most the budget
    (plus one call that starts below it); every stream still gets all its audio, in order, exactly."""
    dec = StreamingDecoder(codec)
    n, budget = 8, 40
    frames = {rid: random_frames(120, seed=60 + rid) for rid in range(n)}
    out: dict[int, list[np.ndarray]] = {rid: [] for rid in frames}
    spread = 0
    for k in range(120):
        dec.push_rows(list(frames), np.stack([frames[rid][k] for rid in frames]))
        ready = sum(dec._next(r, True) is not None for r in dec._reqs.values())
        if dec.launch(max_batch=8, max_frames=budget):
            launched = dec._flights[-1].calls
            assert sum(c.size for c in launched) < budget + max(dec.schedule.call_sizes())
            spread += len({c.rid for c in launched}) < ready
        for rid, pcm, _ in dec.collect(as_float=True):
            out[rid].append(pcm)
    for rid in frames:
        dec.finish(rid, None)
    while dec.pending():
        dec.launch(max_batch=8, max_frames=budget)
        for rid, pcm, _ in dec.collect(as_float=True):
            out[rid].append(pcm)
    assert spread  # streams ready together really were deferred to later launches
    for rid, f in frames.items():
        x = np.concatenate(out[rid])
        assert len(x) == 120 * HOP and snr_db(decode_offline(codec, f), x) > EXACT_DB


def _player_stalls(
    schedule: ChunkSchedule,
    step_ms: float,
    frames: int = 292,
    prebuffer_ms: float = 150.0,
    dac_ms: float = 10.0,
    lag: int = 4757,
) -> list[float]:
    """Stalls (ms) of a player that starts prebuffer_ms after the first audio, when one frame is generated
    every step_ms and each call lands dac_ms after its last frame (its 8 delayed codebooks included)."""
    frame_ms = HOP / 44.1
    events, fed, n = [], 0, 0
    while fed + schedule.next_size(n) + 8 <= frames:
        fed += schedule.next_size(n)
        n += 1
        events.append(((fed + 8) * step_ms + dac_ms, (fed * HOP - lag) / HOP))
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


def test_default_schedule_feeds_a_player_until_steps_reach_real_time():
    """10 frames per call from the first audio on: a 150 ms prebuffer covers a generator running up to real
    time (11.6 ms per step)."""
    for step_ms in (2.5, 5.0, 8.0, 11.0, 11.5):
        assert _player_stalls(ChunkSchedule(), step_ms) == [], step_ms
        assert _player_stalls(ChunkSchedule.low_latency(), step_ms) == [], step_ms
    assert _player_stalls(ChunkSchedule(), 12.5)  # slower than real time: every player stalls eventually
