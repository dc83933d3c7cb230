"""Speaker encoder (ECAPA-TDNN) and audio input helpers.

The parity test at the bottom checks ``SpeakerEncoder.embed`` against an independent float64
NumPy implementation written from spec §4.1 (explicit framing/DFT, a hand-written slaney
filterbank, convolutions as sums of dilated taps). Only torchaudio's resampler is shared,
because the spec prescribes that exact resampler.
"""

from __future__ import annotations

import io
import json
import math
import threading

import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio
from safetensors.torch import load_file, save_file

from engine.frontend.audio import AudioDecodeError, decode_audio
from engine.speaker.encoder import EcapaConfig, SpeakerCheckpointError, SpeakerEncoder
from engine.speaker.resample import resample
from engine.speaker.worker import SpeakerWorker

SR = 24_000


def _tone(n: int, sr: int, seed: int = 0, amp: float = 0.3) -> np.ndarray:
    """Voiced-ish test signal: a few harmonics with vibrato plus a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / sr
    f0 = 140.0 + 15.0 * np.sin(2 * np.pi * 3.0 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    x = sum(np.sin(k * phase + k) / k for k in range(1, 8))
    x = x / np.abs(x).max() * amp + 0.01 * rng.standard_normal(n)
    return x.astype(np.float32)


def _encode(samples: np.ndarray, sr: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------
# Audio decoding
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "subtype", "exact"),
    [("WAV", "PCM_16", True), ("WAV", "FLOAT", True), ("FLAC", "PCM_16", True), ("OGG", "VORBIS", False)],
)
def test_decode_formats(fmt: str, subtype: str, exact: bool) -> None:
    x = _tone(16_000, 16_000)
    got, sr = decode_audio(_encode(x, 16_000, fmt, subtype))
    assert sr == 16_000
    assert got.dtype == np.float32 and got.ndim == 1
    if exact:
        assert got.shape == x.shape
        np.testing.assert_allclose(got, x, atol=1.0 / 32768 + 1e-7)
    else:  # lossy codec: same duration (up to codec padding) and strongly correlated
        assert abs(len(got) - len(x)) < 2048
        n = min(len(got), len(x))
        assert np.corrcoef(got[:n], x[:n])[0, 1] > 0.9


def test_decode_mp3() -> None:
    x = _tone(44_100, 44_100)
    try:
        data = _encode(x, 44_100, "MP3", "MPEG_LAYER_III")
    except (sf.LibsndfileError, RuntimeError, ValueError, TypeError) as exc:
        pytest.skip(f"this libsndfile ({sf.__libsndfile_version__}) cannot write MP3: {exc}")
    got, sr = decode_audio(data)
    assert sr == 44_100
    assert abs(len(got) - len(x)) < 4096  # encoder delay/padding
    # MP3 adds a decoder delay, so compare spectra rather than samples.
    spec_in = np.abs(np.fft.rfft(x[:32768]))
    spec_out = np.abs(np.fft.rfft(got[:32768]))
    assert np.corrcoef(spec_in, spec_out)[0, 1] > 0.9


def test_decode_stereo_mixdown() -> None:
    left, right = _tone(8000, 16_000, seed=1), _tone(8000, 16_000, seed=2, amp=0.1)
    data = _encode(np.stack([left, right], axis=1), 16_000, "WAV", "FLOAT")
    got, sr = decode_audio(data)
    assert sr == 16_000 and got.shape == (8000,)
    np.testing.assert_allclose(got, (left + right) / 2, atol=1e-7)


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (b"", "empty"),
        (b"this is definitely not audio, just some text" * 10, "could not decode"),
        (b"RIFF\x00\x00\x00\x00WAVEjunk", "could not decode"),
    ],
)
def test_decode_refuses_non_audio(payload: bytes, needle: str) -> None:
    with pytest.raises(AudioDecodeError, match=needle):
        decode_audio(payload)


def test_decode_refuses_zero_length_clip() -> None:
    data = _encode(np.zeros((0,), np.float32), 16_000, "WAV", "PCM_16")
    with pytest.raises(AudioDecodeError, match="zero samples"):
        decode_audio(data)
    assert issubclass(AudioDecodeError, ValueError)


def test_resample_matches_reference_transform_and_batches() -> None:
    x = torch.from_numpy(_tone(4410, 44_100))
    ref = torchaudio.transforms.Resample(44_100, SR)(x)  # what the reference server calls
    got = resample(x, 44_100, SR)
    assert torch.equal(got, ref)
    batch = torch.stack([x, -x, 0.5 * x]).reshape(3, 1, -1)  # [..., T]
    out = resample(batch, 44_100, 16_000)
    assert out.shape == (3, 1, math.ceil(4410 * 160 / 441))
    torch.testing.assert_close(out[1, 0], -out[0, 0])
    assert resample(x, SR, SR) is x
    assert resample(x.double(), 44_100, 8000).dtype == torch.float64
    with pytest.raises(TypeError):
        resample(torch.zeros(10, dtype=torch.int16), 16_000, SR)
    with pytest.raises(ValueError, match="sample-rate"):
        resample(x, 44_101, SR)  # gcd 1 -> gigantic kernel: refused instead of eating memory


# ------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------

RELEASE_JSON = {
    "architectures": ["EcapaTdnnSpeakerEncoder"],
    "model_type": "ecapa_tdnn_speaker_encoder",
    "mel_dim": 128,
    "enc_dim": 2048,
    "enc_channels": [512, 512, 512, 512, 1536],
    "enc_kernel_sizes": [5, 3, 3, 3, 1],
    "enc_dilations": [1, 2, 3, 4, 1],
    "enc_attention_channels": 128,
    "enc_res2net_scale": 8,
    "enc_se_channels": 128,
    "sample_rate": 24000,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.0",
}


def test_config_from_json_release_and_tiny() -> None:
    cfg = EcapaConfig.from_json(RELEASE_JSON)
    assert cfg == EcapaConfig() == EcapaConfig.release()
    no_rate = {k: v for k, v in RELEASE_JSON.items() if k != "sample_rate"}
    assert EcapaConfig.from_json(no_rate) == cfg
    tiny = EcapaConfig.tiny()
    assert tiny.enc_dim == 2048 and tiny.mel_dim == 128
    assert EcapaConfig.from_json(json.loads(json.dumps(tiny.to_json()))) == tiny


def test_release_layout_is_76_tensors_12m_params() -> None:
    state = SpeakerEncoder(EcapaConfig()).state_dict()
    assert len(state) == 76
    assert sum(v.numel() for v in state.values()) == 12_001_088
    assert "blocks.3.res2net_block.blocks.6.conv.weight" in state
    assert {"mfa.conv.weight", "asp.tdnn.conv.weight", "asp.conv.bias", "fc.weight"} <= set(state)
    assert not any("frontend" in k for k in state)  # DSP buffers are not checkpoint tensors


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"architectures": ["Qwen3TTSForConditionalGeneration"]}, "unsupported speaker encoder architecture"),
        ({"model_type": "qwen3_tts"}, "model_type"),
        ({"enc_channels": [512, 512, 512, 1536]}, "same length"),
        ({"enc_channels": [512, 512, 512, 512, 1024]}, "MFA input width"),
        ({"enc_res2net_scale": 7}, "divisible"),
        ({"enc_kernel_sizes": [5, 3, 4, 3, 1]}, "odd"),
        ({"mel_dim": 80}, "mel_dim"),
        ({"sample_rate": 16000}, "sample_rate"),
        ({"enc_dim": "big"}, "enc_dim"),
    ],
)
def test_config_refuses_bad_values(patch: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        EcapaConfig.from_json({**RELEASE_JSON, **patch})


def test_config_refuses_missing_field() -> None:
    data = {k: v for k, v in RELEASE_JSON.items() if k != "enc_dim"}
    with pytest.raises(ValueError, match="enc_dim"):
        EcapaConfig.from_json(data)


# ------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> SpeakerEncoder:
    return SpeakerEncoder.random()


def test_random_is_deterministic_and_leaves_global_rng_alone(tiny: SpeakerEncoder) -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    again = SpeakerEncoder.random(seed=0)
    assert torch.equal(torch.get_rng_state(), before)
    for (k, a), b in zip(tiny.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    other = SpeakerEncoder.random(seed=1)
    assert not torch.equal(other.fc.weight, tiny.fc.weight)


def test_save_load_round_trip(tiny: SpeakerEncoder, tmp_path) -> None:
    tiny.save_pretrained(tmp_path / "enc")
    cfg = json.loads((tmp_path / "enc" / "config.json").read_text())
    assert cfg["architectures"] == ["EcapaTdnnSpeakerEncoder"] and cfg["enc_dim"] == 2048
    assert set(load_file(str(tmp_path / "enc" / "model.safetensors"))) == set(tiny.state_dict())
    loaded = SpeakerEncoder.from_pretrained(tmp_path / "enc")
    wav = _tone(SR, SR)
    assert torch.equal(loaded.embed(wav, SR), tiny.embed(wav, SR))


def test_load_prefixed_bf16_checkpoint(tiny: SpeakerEncoder, tmp_path) -> None:
    # The release stores bf16 weights; the full Qwen3-TTS checkpoint prefixes "speaker_encoder.".
    d = tmp_path / "pref"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny.config.to_json()))
    state = {f"speaker_encoder.{k}": v.to(torch.bfloat16) for k, v in tiny.state_dict().items()}
    save_file(state, str(d / "model.safetensors"))
    loaded = SpeakerEncoder.from_pretrained(d)
    assert loaded.fc.weight.dtype == torch.float32
    torch.testing.assert_close(loaded.fc.weight, tiny.fc.weight.to(torch.bfloat16).float())


def _write_broken(tiny: SpeakerEncoder, tmp_path, mutate) -> str:
    d = tmp_path / "broken"
    tiny.save_pretrained(d)
    state = load_file(str(d / "model.safetensors"))
    mutate(state)
    save_file(state, str(d / "model.safetensors"))
    return str(d)


def test_renamed_tensor_refused(tiny: SpeakerEncoder, tmp_path) -> None:
    def rename(s: dict) -> None:
        s["asp.tdnn.linear.weight"] = s.pop("asp.tdnn.conv.weight")

    with pytest.raises(SpeakerCheckpointError) as err:
        SpeakerEncoder.from_pretrained(_write_broken(tiny, tmp_path, rename))
    assert "missing tensor(s): asp.tdnn.conv.weight" in str(err.value)
    assert "unexpected tensor(s): asp.tdnn.linear.weight" in str(err.value)


def test_missing_tensor_refused(tiny: SpeakerEncoder, tmp_path) -> None:
    with pytest.raises(SpeakerCheckpointError, match=r"missing tensor\(s\): blocks\.2\.se_block\.conv2\.bias"):
        SpeakerEncoder.from_pretrained(_write_broken(tiny, tmp_path, lambda s: s.pop("blocks.2.se_block.conv2.bias")))


def test_wrong_shape_refused(tiny: SpeakerEncoder, tmp_path) -> None:
    def reshape(s: dict) -> None:
        s["fc.weight"] = torch.zeros(1024, 192, 1)

    with pytest.raises(
        SpeakerCheckpointError, match=r"fc\.weight: checkpoint \(1024, 192, 1\) vs expected \(2048, 192, 1\)"
    ):
        SpeakerEncoder.from_pretrained(_write_broken(tiny, tmp_path, reshape))


def test_missing_files_refused(tmp_path) -> None:
    with pytest.raises(SpeakerCheckpointError, match=r"config\.json"):
        SpeakerEncoder.from_pretrained(tmp_path)


# ------------------------------------------------------------------------------------------
# Input validation
# ------------------------------------------------------------------------------------------


def test_too_short_and_bad_inputs_refused(tiny: SpeakerEncoder) -> None:
    with pytest.raises(ValueError, match="empty"):
        tiny.embed(np.zeros(0, np.float32), SR)
    with pytest.raises(ValueError, match="too short"):
        tiny.embed(_tone(300, SR), SR)  # not even one mel frame
    with pytest.raises(ValueError, match="too short"):
        tiny.embed(_tone(800, 16_000), 16_000)  # 50 ms -> 1200 samples at 24 kHz, 4 frames < 5
    with pytest.raises(ValueError, match="NaN"):
        tiny.embed(np.full(SR, np.nan, np.float32), SR)
    with pytest.raises(ValueError, match="sample_rate"):
        tiny.embed(_tone(SR, SR), 0)
    with pytest.raises(ValueError, match="far outside"):  # finite samples whose power spectrum overflows
        tiny.embed(_tone(SR, SR, amp=3e38), SR)
    min_n = tiny.config.min_samples()
    assert tiny.embed(_tone(min_n, SR), SR).shape == (2048,)
    with pytest.raises(ValueError, match="too short"):
        tiny.embed(_tone(min_n - 1, SR), SR)


def test_stereo_channels_first_is_mixed_down(tiny: SpeakerEncoder) -> None:
    a, b = _tone(SR, SR, seed=3), _tone(SR, SR, seed=4)
    got = tiny.embed(np.stack([a, b]), SR)
    torch.testing.assert_close(got, tiny.embed((a + b) / 2, SR), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# Independent reference implementation (float64 NumPy, written from the spec)
# ------------------------------------------------------------------------------------------


def _hz_to_mel_slaney(f: np.ndarray) -> np.ndarray:
    f = np.asarray(f, np.float64)
    lin = f / (200.0 / 3.0)
    logstep = math.log(6.4) / 27.0
    return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / logstep, lin)


def _mel_to_hz_slaney(m: np.ndarray) -> np.ndarray:
    logstep = math.log(6.4) / 27.0
    return np.where(m >= 15.0, 1000.0 * np.exp(logstep * (m - 15.0)), m * (200.0 / 3.0))


def _slaney_filterbank(sr: int = SR, n_fft: int = 1024, n_mels: int = 128, fmax: float = 12000.0) -> np.ndarray:
    """[n_mels, n_fft//2+1] triangular filters on the slaney mel scale, area-normalised."""
    freqs = np.linspace(0.0, sr / 2, n_fft // 2 + 1)
    pts = _mel_to_hz_slaney(np.linspace(_hz_to_mel_slaney(0.0), _hz_to_mel_slaney(fmax), n_mels + 2))
    fb = np.zeros((n_mels, freqs.size))
    for m in range(n_mels):
        lo, mid, hi = pts[m], pts[m + 1], pts[m + 2]
        rising = (freqs - lo) / (mid - lo)
        falling = (hi - freqs) / (hi - mid)
        fb[m] = np.maximum(0.0, np.minimum(rising, falling)) * (2.0 / (hi - lo))
    return fb


def _ref_logmel(wav24: np.ndarray) -> np.ndarray:
    n_fft, hop, pad = 1024, 256, 384
    x = np.pad(wav24.astype(np.float64), (pad, pad), mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)  # periodic Hann
    n_frames = 1 + (len(x) - n_fft) // hop
    frames = np.stack([x[i * hop : i * hop + n_fft] * window for i in range(n_frames)])
    k = np.arange(n_fft // 2 + 1)[:, None] * np.arange(n_fft)[None, :]
    dft = np.exp(-2j * np.pi * k / n_fft)
    mag = np.abs(frames @ dft.T)  # [T, 513]
    mel = mag @ _slaney_filterbank().T  # [T, 128]
    return np.log(np.maximum(mel, 1e-5))


def _ref_conv(x: np.ndarray, w: np.ndarray, b: np.ndarray, dilation: int = 1) -> np.ndarray:
    """x [C_in, T], w [C_out, C_in, K]: 'same' output with reflect padding."""
    k = w.shape[2]
    p = dilation * (k - 1) // 2
    xp = np.pad(x, ((0, 0), (p, p)), mode="reflect") if p else x
    t = x.shape[1]
    out = np.zeros((w.shape[0], t))
    for j in range(k):
        out += w[:, :, j] @ xp[:, j * dilation : j * dilation + t]
    return out + b[:, None]


def _ref_embed(weights: dict[str, np.ndarray], cfg: EcapaConfig, wav24: np.ndarray) -> np.ndarray:
    def conv(x: np.ndarray, name: str, dilation: int = 1) -> np.ndarray:
        return _ref_conv(x, weights[name + ".weight"], weights[name + ".bias"], dilation)

    def relu(x: np.ndarray) -> np.ndarray:
        return np.maximum(x, 0.0)

    h = relu(conv(_ref_logmel(wav24).T, "blocks.0.conv", cfg.enc_dilations[0]))
    block_outs = []
    for i in range(1, len(cfg.enc_channels) - 1):
        p, d, s = f"blocks.{i}", cfg.enc_dilations[i], cfg.enc_res2net_scale
        y = relu(conv(h, f"{p}.tdnn1.conv"))
        parts = np.split(y, s, axis=0)
        outs = [parts[0]]
        for j in range(1, s):
            inp = parts[j] if j == 1 else parts[j] + outs[-1]
            outs.append(relu(conv(inp, f"{p}.res2net_block.blocks.{j - 1}.conv", d)))
        y = relu(conv(np.concatenate(outs), f"{p}.tdnn2.conv"))
        gate = y.mean(axis=1, keepdims=True)
        gate = relu(conv(gate, f"{p}.se_block.conv1"))
        gate = 1.0 / (1.0 + np.exp(-conv(gate, f"{p}.se_block.conv2")))
        h = y * gate + h
        block_outs.append(h)
    h = relu(conv(np.concatenate(block_outs), "mfa.conv", cfg.enc_dilations[-1]))

    t = h.shape[1]
    mu = h.mean(axis=1)
    sd = np.sqrt(np.maximum(((h - mu[:, None]) ** 2).mean(axis=1), 1e-12))
    ctx = np.concatenate([h, np.repeat(mu[:, None], t, 1), np.repeat(sd[:, None], t, 1)])
    a = conv(np.tanh(relu(conv(ctx, "asp.tdnn.conv"))), "asp.conv")
    a = np.exp(a - a.max(axis=1, keepdims=True))
    a /= a.sum(axis=1, keepdims=True)
    mean = (a * h).sum(axis=1)
    std = np.sqrt(np.maximum((a * (h - mean[:, None]) ** 2).sum(axis=1), 1e-12))
    pooled = np.concatenate([mean, std])[:, None]
    return conv(pooled, "fc")[:, 0]


SCALE8 = EcapaConfig(
    enc_channels=[32, 32, 32, 32, 96], enc_attention_channels=16, enc_res2net_scale=8, enc_se_channels=16
)


@pytest.mark.parametrize("cfg", [EcapaConfig.tiny(), SCALE8], ids=["tiny-scale4", "tiny-scale8"])
@pytest.mark.parametrize("sr", [24_000, 44_100])
def test_embed_matches_independent_reference(cfg: EcapaConfig, sr: int) -> None:
    model = SpeakerEncoder.random(cfg, seed=7)
    weights = {k: v.double().numpy() for k, v in model.state_dict().items()}
    wav = _tone(int(1.2 * sr), sr, seed=5)
    wav24 = wav if sr == SR else torchaudio.transforms.Resample(sr, SR)(torch.from_numpy(wav)).numpy()

    ref = _ref_embed(weights, cfg, wav24)
    got = model.embed(wav, sr).double().numpy()
    assert got.shape == ref.shape == (2048,)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-5, f"max abs diff relative to max |ref| = {rel:.2e}"

    # The frontend alone agrees too (log domain, so absolute).
    mel = model.frontend(torch.from_numpy(wav24)[None])[0].double().numpy()
    np.testing.assert_allclose(mel, _ref_logmel(wav24), atol=2e-4)


def test_decode_refuses_long_clips_from_the_header_before_decoding(monkeypatch):
    import engine.frontend.audio as audio

    buf = io.BytesIO()
    sf.write(buf, np.zeros(44100 * 5, np.float32), 44100, format="FLAC")
    data = buf.getvalue()
    calls = []
    monkeypatch.setattr(audio.sf, "read", lambda *a, **k: calls.append(1))  # must not be reached
    with pytest.raises(audio.ClipTooLong, match="limited to 3 s"):
        audio.decode_audio(data, max_seconds=3)
    assert calls == []
    monkeypatch.undo()
    samples, sr = audio.decode_audio(data, max_seconds=10)
    assert sr == 44100 and len(samples) == 44100 * 5


def _speaker_results(worker: SpeakerWorker, n: int) -> dict[object, tuple]:
    """The worker's first `n` answers, key -> (embedding, error) (a guard bound, not a pace)."""
    done: dict[object, tuple] = {}
    for _ in range(600):
        done.update({k: (emb, err) for k, emb, err in worker.results()})
        if len(done) >= n:
            break
        threading.Event().wait(0.1)
    return done


def test_a_behind_speaker_encoder_refuses_more_and_skips_what_waited_too_long(tiny, monkeypatch):
    """Clips waiting for the speaker encoder hold their samples: while one is embedded, the queue takes at most
    MAX_QUEUED_BYTES (then SpeakerBehind at submit: the engine answers engine_busy), and a clip that waited past
    its wait (the gateway's EMBED_WAIT_S; never for a request's own clip) is answered SpeakerBehind without being
    embedded. Both bounds are small here; the clip in the encoder is held until they are passed."""
    from engine.speaker import worker as worker_mod

    clip = _tone(SR, SR, seed=1)
    monkeypatch.setattr(worker_mod, "MAX_QUEUED_BYTES", 2 * clip.nbytes)
    gate, entered = threading.Event(), threading.Event()

    class Held:  # the real encoder, its first embedding held at `gate`
        device = "cpu"

        def embed(self, x: np.ndarray, sr: int) -> torch.Tensor:
            entered.set()
            gate.wait(30)
            return tiny.embed(x, sr)

    worker = SpeakerWorker(Held())
    try:
        worker.submit("first", clip, SR)
        assert entered.wait(30)  # taken: the queue is empty again
        worker.submit("queued", clip, SR, wait_s=0.05)
        worker.submit("job", clip, SR)  # a request's own clip: no wait bound
        with pytest.raises(worker_mod.SpeakerBehind):  # a third clip would pass the bound
            worker.submit("refused", clip, SR, wait_s=0.05)
        threading.Event().wait(0.2)  # "queued" waited past its 50 ms now, whatever the pace
        gate.set()
        done = _speaker_results(worker, 3)
        assert done["first"][1] is None and done["first"][0].shape == (2048,)
        assert done["queued"][0] is None and isinstance(done["queued"][1], worker_mod.SpeakerBehind)
        assert done["job"][1] is None and done["job"][0].shape == (2048,)
        worker.submit("after", clip, SR, wait_s=30)  # the queue's count went back down
        assert _speaker_results(worker, 1)["after"][1] is None
    finally:
        worker.close()
