"""`python -m engine ...` end to end: real subprocesses in temporary folders, on synthetic checkpoints the
tests write in the release formats (ZONOS2 params.json + model.pth, DAC .pth, ECAPA HF folder).

One subprocess per command (each costs a few seconds of imports); the variants of a command call
`engine.cli.main(argv)` in-process, which is the same code without the interpreter start.
The speaker-embed parity checks reuse the independent float64 NumPy ECAPA of tests/engine/test_speaker.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio
from safetensors.torch import load_file, save_file

from engine.cli import main
from engine.contract.records import SamplingParams
from engine.dac.codec import Codec
from engine.frontend.config import Zonos2Config, preset_params
from engine.frontend.prompt import Conditioning, PromptBuilder
from engine.model.checkpoint import load_checkpoint, random_model
from engine.offline import synthesize
from engine.speaker.encoder import EcapaConfig, SpeakerEncoder
from tests.engine.test_speaker import _ref_embed, _tone

ROOT = Path(__file__).resolve().parents[2]
SPK_SEED = 3  # not the no-weights default (seed 0), so a test can tell the two apart


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "engine", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, f"rc={r.returncode}\n{r.stderr[-3000:]}"
    return r


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def in_process(capsys, *args: str) -> tuple[int, str, str]:
    """engine.cli.main in this process -> (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = 0
    try:
        main(list(args))
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("cli")
    made = last_json(cli("make-checkpoint", "--preset", "tiny", "--out", str(d / "ckpt"), "--seed", "0").stdout)
    Codec.random("tiny", seed=1).save(d / "dac.pth")
    enc = SpeakerEncoder.random(EcapaConfig.tiny(), seed=SPK_SEED)
    enc.save_pretrained(d / "spk")
    sf.write(d / "clip24.wav", _tone(int(1.2 * 24_000), 24_000, seed=5), 24_000, subtype="FLOAT")
    stereo = np.stack([_tone(44_100, 44_100, seed=6), _tone(44_100, 44_100, seed=7, amp=0.1)], axis=1)
    sf.write(d / "clip44_stereo.wav", stereo, 44_100, subtype="PCM_16")
    sf.write(d / "clip44.wav", _tone(int(1.1 * 44_100), 44_100, seed=8), 44_100, subtype="FLOAT")
    return {"dir": d, "made": made, "ckpt": d / "ckpt", "dac": d / "dac.pth", "spk": d / "spk", "enc": enc}


# ---- make-checkpoint ---------------------------------------------------------------------------------


def test_make_checkpoint_writes_the_embedded_default(assets):
    made, ck = assets["made"], assets["ckpt"]
    assert Path(made["weights"]) == ck / "model.pth" and made["tensors"] > 0 and made["params"] > 0
    assert json.loads((ck / "params.json").read_text()) == json.loads(json.dumps(preset_params("tiny")))
    loaded = load_checkpoint(ck, "cpu", torch.float32).state_dict()
    default = random_model("tiny", seed=0, dtype=torch.float32).state_dict()
    assert loaded.keys() == default.keys()
    for k, v in loaded.items():
        assert torch.equal(v, default[k]), k  # the file is exactly the no-weights default


# ---- prompt ------------------------------------------------------------------------------------------


def test_prompt_matches_prompt_builder(assets, capsys):
    d, ck = assets["dir"], assets["ckpt"]
    text = "Hello there, how are you?"
    r = cli(
        "prompt", text, "--out", str(d / "p.npy"), "--model-path", str(ck), "--speaker", "--speaking-rate-bucket", "3"
    )
    ids = np.load(d / "p.npy")
    cfg = Zonos2Config.from_file(ck)
    want = PromptBuilder(cfg).build(text, Conditioning(speaker=True, speaking_rate_bucket=3))
    assert ids.ndim == 2 and ids.shape[1] == 10 and np.issubdtype(ids.dtype, np.integer)
    assert np.array_equal(ids, want) and last_json(r.stdout)["frames"] == len(ids)

    # Variants in-process: the defaults (full-size layout) and every switch off.
    full = PromptBuilder(Zonos2Config.from_dict(preset_params("full")))
    code, _, _ = in_process(capsys, "prompt", text, "--out", str(d / "p0.npy"))
    assert code == 0 and np.array_equal(np.load(d / "p0.npy"), full.build(text, Conditioning()))
    code, _, _ = in_process(
        capsys,
        "prompt",
        text,
        "--out",
        str(d / "p1.npy"),
        "--no-quality",
        "--expressive",
        "--clean-background",
        "--speaker",
    )
    want = full.build(
        text, Conditioning(speaker=True, clean_speaker_background=True, accurate_mode=False, quality_buckets=None)
    )
    assert code == 0 and np.array_equal(np.load(d / "p1.npy"), want)


def test_prompt_continuation(assets, capsys):
    """--context-text/--context-codes/--non-final write PromptBuilder.build_continuation's ids."""
    d = assets["dir"]
    full = PromptBuilder(Zonos2Config.from_dict(preset_params("full")))
    codes = np.random.default_rng(1).integers(0, 1024, size=(12, 9))
    np.save(d / "ctx.npy", codes)
    code, out, _ = in_process(
        capsys,
        "prompt",
        "And then.",
        "--out",
        str(d / "c.npy"),
        "--speaker",
        "--context-text",
        "It began.",
        "--context-codes",
        str(d / "ctx.npy"),
        "--non-final",
    )
    want = full.build_continuation("It began.", "And then.", codes, Conditioning(speaker=True), non_final=True)
    got = np.load(d / "c.npy")
    assert code == 0 and np.array_equal(got, want) and last_json(out)["frames"] == len(want)
    assert np.array_equal(got[-12:, :9], codes) and 511 not in got[:, 9]  # no trailing-silence token
    code, _, _ = in_process(capsys, "prompt", "Last.", "--out", str(d / "n.npy"), "--non-final")
    assert code == 0 and np.array_equal(np.load(d / "n.npy"), full.build("Last.", Conditioning(), non_final=True))
    code, _, err = in_process(capsys, "prompt", "x", "--out", str(d / "e.npy"), "--context-codes", str(d / "ctx.npy"))
    assert code == 2 and "--context-text" in err
    np.save(d / "bad.npy", codes[:, :5])
    code, _, err = in_process(
        capsys, "prompt", "x", "--out", str(d / "e.npy"), "--context-text", "y", "--context-codes", str(d / "bad.npy")
    )
    assert code == 2 and "[F, 9]" in err


# ---- logits ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_logits_match_forward_full(assets, capsys):
    d, ck = assets["dir"], assets["ckpt"]
    model = load_checkpoint(ck, "cpu", torch.float32)
    ids = PromptBuilder(model.cfg).build("Teacher forcing.", Conditioning(speaker=True))
    np.save(d / "ids.npy", ids)
    emb = np.random.default_rng(0).standard_normal(model.cfg.speaker_embedding_dim).astype(np.float32)
    np.save(d / "emb.npy", emb)
    r = cli(
        "logits",
        "--model-path",
        str(ck),
        "--input-ids",
        str(d / "ids.npy"),
        "--out",
        str(d / "l.npy"),
        "--speaker-embedding",
        str(d / "emb.npy"),
        "--device",
        "cpu",
    )
    got = np.load(d / "l.npy")
    assert got.shape == (len(ids), 9, 1026) and got.dtype == np.float32
    assert last_json(r.stdout)["shape"] == [len(ids), 9, 1026]
    with torch.inference_mode():
        want = model.forward_full(torch.from_numpy(ids.astype(np.int64)), speaker=torch.from_numpy(emb))
    np.testing.assert_allclose(got, want.float().numpy(), rtol=1e-4, atol=1e-4)

    # A speaker embedding of the wrong size is refused with a message, not a traceback.
    np.save(d / "bad.npy", emb[:100])
    code, _, err = in_process(
        capsys,
        "logits",
        "--model-path",
        str(ck),
        "--input-ids",
        str(d / "ids.npy"),
        "--out",
        str(d / "l2.npy"),
        "--speaker-embedding",
        str(d / "bad.npy"),
        "--device",
        "cpu",
    )
    assert code == 2 and "(2048,)" in err and "(100,)" in err


def _one_minus_cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return 1.0 - float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_logits_guidance_is_the_formula_on_plain_passes(assets, capsys):
    """--cfg-scale / --prefix-cfg-scale write uncond + s * (cond - uncond) of the last frame, where cond and
    uncond are two plain fp32 forward passes: speaker CFG drops the speaker from the same ids, prefix CFG
    runs the fresh prompt with the speaker."""
    d, ck = assets["dir"], assets["ckpt"]
    model = load_checkpoint(ck, "cpu", torch.float32)
    pb = PromptBuilder(model.cfg)
    cond_spk = Conditioning(speaker=True)
    ids = pb.build("Guided speech.", cond_spk)
    emb = np.random.default_rng(2).standard_normal(model.cfg.speaker_embedding_dim).astype(np.float32)
    np.save(d / "g_ids.npy", ids)
    np.save(d / "g_emb.npy", emb)
    common = ["--model-path", str(ck), "--device", "cpu", "--speaker-embedding", str(d / "g_emb.npy")]

    def plain(x: np.ndarray, spk: np.ndarray | None) -> np.ndarray:
        with torch.inference_mode():
            s = torch.from_numpy(spk) if spk is not None else None
            return model.forward_full(torch.from_numpy(x.astype(np.int64)), speaker=s)[-1].float().numpy()

    code, out, _ = in_process(
        capsys, "logits", *common, "--input-ids", str(d / "g_ids.npy"), "--out", str(d / "g.npy"), "--cfg-scale", "2.5"
    )
    got = np.load(d / "g.npy")
    c, u = plain(ids, emb), plain(ids, None)
    want = u + 2.5 * (c - u)
    assert code == 0 and got.shape == (9, 1026) and last_json(out)["guidance"] == "speaker"
    assert _one_minus_cos(got, want) < 1e-6 and np.allclose(got, want, atol=1e-4)
    assert not np.allclose(got, c, atol=1e-3)  # guidance changed the logits

    codes = np.random.default_rng(3).integers(0, 1024, size=(20, 9))
    cont = pb.build_continuation("Before.", "Guided speech.", codes, cond_spk)
    fresh = pb.build("Guided speech.", cond_spk)
    np.save(d / "p_ids.npy", cont)
    np.save(d / "p_unc.npy", fresh)
    code, out, _ = in_process(
        capsys,
        "logits",
        *common,
        "--input-ids",
        str(d / "p_ids.npy"),
        "--out",
        str(d / "p.npy"),
        "--uncond-input-ids",
        str(d / "p_unc.npy"),
        "--prefix-cfg-scale",
        "-0.5",
        "--cfg-scale",
        "3",
    )  # prefix CFG wins
    got = np.load(d / "p.npy")
    c, u = plain(cont, emb), plain(fresh, emb)
    want = u + -0.5 * (c - u)
    assert code == 0 and last_json(out)["guidance"] == "prefix"
    assert _one_minus_cos(got, want) < 1e-6 and np.allclose(got, want, atol=1e-4)

    for args, needle in (
        (["--cfg-scale", "nan"], "cfg_scale"),
        (["--prefix-cfg-scale", "2"], "--uncond-input-ids"),
        (["--uncond-input-ids", str(d / "p_unc.npy")], "--prefix-cfg-scale"),
    ):
        code, _, err = in_process(
            capsys, "logits", *common, "--input-ids", str(d / "g_ids.npy"), "--out", str(d / "x.npy"), *args
        )
        assert code == 2 and needle in err, err


# ---- synthesize --------------------------------------------------------------------------------------


def check_wav(path: Path) -> np.ndarray:
    info = sf.info(str(path))
    assert info.samplerate == 44_100 and info.subtype == "PCM_16" and info.channels == 1
    assert info.frames > 0 and info.frames % 512 == 0, info.frames
    audio, _ = sf.read(str(path), dtype="float32")
    assert np.isfinite(audio).all()
    return audio


@pytest.mark.slow
def test_synthesize_without_weights(tmp_path):
    r = cli(
        "synthesize",
        "Hello from the default model.",
        "-o",
        str(tmp_path / "out.wav"),
        "--max-frames",
        "16",
        "--seed",
        "1",
        "--device",
        "cpu",
    )
    audio = check_wav(tmp_path / "out.wav")
    out = last_json(r.stdout)
    assert out["frames"] == len(audio) // 512 <= 16
    assert out["weights"]["model"].startswith("random tiny") and out["weights"]["dac"].startswith("random tiny")


@pytest.mark.slow
def test_synthesize_with_checkpoints_and_voice_clip(assets, tmp_path):
    ck, dac, spk = assets["ckpt"], assets["dac"], assets["spk"]
    clip = assets["dir"] / "clip44_stereo.wav"
    r = cli(
        "synthesize",
        "Cloned voice.",
        "-o",
        str(tmp_path / "out.wav"),
        "--model-path",
        str(ck),
        "--dac-weights",
        str(dac),
        "--speaker-weights",
        str(spk),
        "--voice",
        str(clip),
        "--max-frames",
        "12",
        "--seed",
        "4",
        "--device",
        "cpu",
    )
    audio = check_wav(tmp_path / "out.wav")
    out = last_json(r.stdout)
    assert out["weights"] == {"model": str(ck), "dac": str(dac), "speaker_encoder": str(spk)}

    # The same request in-process, from the same files: same frames, same audio (up to 16-bit rounding).
    model = load_checkpoint(ck, "cpu")
    wav, sr = sf.read(str(clip), dtype="float32")
    speaker = SpeakerEncoder.from_pretrained(spk).embed(wav.T, sr)
    want = synthesize(model, Codec.load(dac), "Cloned voice.", SamplingParams(seed=4), speaker=speaker, max_frames=12)
    assert out["frames"] == len(want.frames) and len(audio) == len(want.audio)
    np.testing.assert_allclose(audio, np.clip(want.audio, -1, 1), atol=2 / 32768)


# ---- speaker-embed -----------------------------------------------------------------------------------


def reference_embedding(enc: SpeakerEncoder, wav: np.ndarray, sr: int) -> np.ndarray:
    """Independent float64 ECAPA (tests/engine/test_speaker.py) after the prescribed torchaudio resampler."""
    mono = wav.mean(axis=1) if wav.ndim == 2 else wav
    mono = torch.from_numpy(np.ascontiguousarray(mono, dtype=np.float32))
    wav24 = mono if sr == 24_000 else torchaudio.transforms.Resample(sr, 24_000)(mono)
    weights = {k: v.double().numpy() for k, v in enc.state_dict().items()}
    return _ref_embed(weights, enc.config, wav24.double().numpy())


def assert_parity(got: np.ndarray, ref: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == ref.shape == (2048,)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-5, f"max |diff| / max |ref| = {rel:.2e}"


def test_speaker_embed_cli_matches_independent_reference(assets):
    d, spk = assets["dir"], assets["spk"]
    clip = d / "clip44_stereo.wav"  # 44.1 kHz, stereo, 16-bit: mixdown + resampling + the float32 network
    r = cli(
        "speaker-embed",
        "--speaker-weights",
        str(spk),
        "--audio",
        str(clip),
        "--out",
        str(d / "e.npy"),
        "--device",
        "cpu",
    )
    out = last_json(r.stdout)
    assert out["dim"] == 2048 and out["sample_rate"] == 44_100 and out["encoder"] == str(spk)
    got = np.load(d / "e.npy")
    wav, sr = sf.read(str(clip), dtype="float32")
    assert_parity(got, reference_embedding(assets["enc"], wav, sr))


@pytest.mark.parametrize("name, sr", [("clip24.wav", 24_000), ("clip44.wav", 44_100)])
def test_speaker_embed_parity_per_rate(assets, capsys, name, sr):
    d, spk = assets["dir"], assets["spk"]
    code, out, err = in_process(
        capsys,
        "speaker-embed",
        "--speaker-weights",
        str(spk),
        "--audio",
        str(d / name),
        "--out",
        str(d / f"e-{sr}.npy"),
        "--dtype",
        "float32",
        "--device",
        "cpu",
    )
    assert code == 0, err
    assert last_json(out)["sample_rate"] == sr
    got = np.load(d / f"e-{sr}.npy")
    wav, file_sr = sf.read(str(d / name), dtype="float32")
    assert file_sr == sr
    assert_parity(got, reference_embedding(assets["enc"], wav, sr))
    # The loaded checkpoint, not the random default, did the work.
    default = SpeakerEncoder.random(EcapaConfig.tiny(), seed=0).embed(wav, sr).numpy()
    assert np.abs(got - default).max() > 1e-3


def test_speaker_embed_reduced_precision_still_writes_float32(assets, capsys):
    d, spk = assets["dir"], assets["spk"]
    code, _, err = in_process(
        capsys,
        "speaker-embed",
        "--speaker-weights",
        str(spk),
        "--audio",
        str(d / "clip24.wav"),
        "--out",
        str(d / "bf16.npy"),
        "--dtype",
        "bfloat16",
        "--device",
        "cpu",
    )
    assert code == 0, err
    got = np.load(d / "bf16.npy")
    assert got.dtype == np.float32 and got.shape == (2048,)
    wav, sr = sf.read(str(d / "clip24.wav"), dtype="float32")
    want = assets["enc"].embed(wav, sr).numpy()
    assert np.abs(got - want).max() / np.abs(want).max() < 0.05  # bf16 network, float32 log-mel


def broken_checkpoint(assets, tmp_path: Path, mutate) -> Path:
    d = tmp_path / "broken"
    assets["enc"].save_pretrained(d)
    state = load_file(str(d / "model.safetensors"))
    mutate(state)
    save_file(state, str(d / "model.safetensors"))
    return d


def test_speaker_embed_refuses_renamed_tensor(assets, tmp_path):
    def rename(s: dict) -> None:
        s["asp.tdnn.linear.weight"] = s.pop("asp.tdnn.conv.weight")

    ck = broken_checkpoint(assets, tmp_path, rename)
    r = cli(
        "speaker-embed",
        "--speaker-weights",
        str(ck),
        "--audio",
        str(assets["dir"] / "clip24.wav"),
        "--out",
        str(tmp_path / "e.npy"),
        "--device",
        "cpu",
        check=False,
    )
    assert r.returncode == 2, r.stderr
    assert "missing tensor(s): asp.tdnn.conv.weight" in r.stderr
    assert "unexpected tensor(s): asp.tdnn.linear.weight" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "e.npy").exists()


def _wrong_shape(s: dict) -> None:
    s["fc.weight"] = torch.zeros(1024, s["fc.weight"].shape[1], 1)


def _bad_config(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"architectures": ["Qwen3TTSForConditionalGeneration"]}))


@pytest.mark.parametrize(
    "case, needle",
    [
        ("wrong_shape", "fc.weight: checkpoint (1024, 192, 1) vs expected (2048, 192, 1)"),
        ("no_config", "has no config.json"),
        ("bad_architecture", "unsupported speaker encoder architecture"),
        ("no_such_dir", "does not exist"),
        ("not_audio", "could not decode audio"),
        ("empty_clip", "zero samples"),
        ("too_short", "too short"),
    ],
)
def test_speaker_embed_refusals(assets, capsys, tmp_path, case, needle):
    ck, audio = assets["spk"], assets["dir"] / "clip24.wav"
    if case == "wrong_shape":
        ck = broken_checkpoint(assets, tmp_path, _wrong_shape)
    elif case in ("no_config", "bad_architecture"):
        ck = broken_checkpoint(assets, tmp_path, lambda s: None)
        if case == "no_config":
            (ck / "config.json").unlink()
        else:
            _bad_config(ck)
    elif case == "no_such_dir":
        ck = tmp_path / "nowhere"
    elif case == "not_audio":
        audio = tmp_path / "x.wav"
        audio.write_text("definitely not a RIFF file")
    elif case == "empty_clip":
        audio = tmp_path / "empty.wav"
        sf.write(audio, np.zeros(0, np.float32), 24_000)
    elif case == "too_short":
        audio = tmp_path / "short.wav"
        sf.write(audio, _tone(600, 24_000), 24_000)  # 25 ms: fewer mel frames than the kernels need
    code, _, err = in_process(
        capsys,
        "speaker-embed",
        "--speaker-weights",
        str(ck),
        "--audio",
        str(audio),
        "--out",
        str(tmp_path / "e.npy"),
        "--device",
        "cpu",
    )
    assert code == 2 and err.startswith("error: ") and needle in err, err
    assert not (tmp_path / "e.npy").exists()


# ---- `python -m app` flags: generated from the settings fields ------------------------------------------
@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--max-batch", "0"], "--max-batch must be an integer in 1..4096, got 0"),
        (["--max-batch", "-3"], "--max-batch must be an integer in 1..4096, got -3"),
        (["--normalization-workers", "100000"], "--normalization-workers must be an integer in 0.."),
        (["--workers", "65"], "--workers must be an integer in 0..64"),
        (["--port", "70000"], "--port must be an integer in 0..65535"),
        (["--admission-headroom", "0"], "--admission-headroom must be a number in (0, 1]"),
        (["--dac-max-in-flight", "0"], "--dac-max-in-flight must be an integer in 1..64"),
        (["--idle-timeout", "-1"], "--idle-timeout-s must be a number in (0, 86400]"),
        (["--max-sessions", "0"], "--max-sessions must be an integer in 1..1000000"),
        (["--prefill-group-wait-ms", "nan"], "--prefill-group-wait-ms must be a number in [0, 60000]"),
        (["--engine-cpus", "3-1"], "--engine-cpus: '3-1' is not a range of CPUs"),
        (["--engine-cpus", "0-"], "--engine-cpus must be a CPU list such as 3, 0-1 or 2,5-6, got '0-'"),
        (["--device", "gpu"], "--device: 'gpu' is not cpu, cuda or cuda:N"),
        (["--device", "cuda:x"], "--device: 'cuda:x' is not cpu, cuda or cuda:N"),
        (["--dac-device", "auto"], "--dac-device: 'auto' is not cpu, cuda or cuda:N"),
        (["--api-key", ""], "--api-key must not be empty"),
        (["--api-key", "k1", "--api-key", ""], "--api-key must not be empty"),
        (["--log-level", "verbose"], "--log-level (or LOG_LEVEL) must be one of debug, info, warning, error, critical"),
    ],
)
def test_app_flags_out_of_bounds_are_refused_naming_flag_and_range(capsys, argv, needle):
    from app.__main__ import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_the_devices_a_flag_names_are_taken():
    from app.__main__ import parse_args

    assert parse_args(["--device", "cpu"]).engine.device == "cpu"
    assert parse_args(["--device", "auto", "--dac-device", "cpu"]).engine.dac_device == "cpu"
    assert parse_args(["--device", "cuda:1", "--dac-device", "cuda"]).engine.device == "cuda:1"


def test_folders_that_are_not_folders_are_refused_at_start(tmp_path, capsys):
    from app.__main__ import parse_args

    (tmp_path / "a-file").touch()
    for argv, needle in (
        (["--data-dir", str(tmp_path / "a-file")], "a-file: not a directory"),
        (["--data-dir", str(tmp_path), "--default-voices-dir", str(tmp_path / "nope")], "nope: no such directory"),
    ):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2 and needle in capsys.readouterr().err
    # a data dir that is not there yet is made at start; a voices folder that is there is taken
    settings = parse_args(["--data-dir", str(tmp_path / "new"), "--default-voices-dir", str(tmp_path)])
    assert settings.default_voices_dir == tmp_path


def test_a_log_level_is_a_logging_level_from_the_flag_or_the_environment(monkeypatch, capsys):
    """`--log-level bogus` (or LOG_LEVEL=bogus) is a usage error naming the flag, not logging's traceback at start;
    a level in any case is taken."""
    from app.__main__ import parse_args

    assert parse_args(["--log-level", "debug"]).log_level == "DEBUG"
    monkeypatch.setenv("LOG_LEVEL", "Warning")
    assert parse_args([]).log_level == "WARNING"
    monkeypatch.setenv("LOG_LEVEL", "bogus")
    with pytest.raises(SystemExit) as e:
        parse_args([])
    assert e.value.code == 2 and "got 'BOGUS'" in capsys.readouterr().err


def test_normalization_workers_ceiling_follows_the_cpus(monkeypatch, capsys):
    from app import settings
    from app.__main__ import parse_args

    monkeypatch.setattr(settings, "usable_cpus", lambda: 40)
    assert parse_args(["--normalization-workers", "40"]).normalization_workers == 40
    with pytest.raises(SystemExit):
        parse_args(["--normalization-workers", "41"])
    assert "--normalization-workers must be an integer in 0..40, got 41" in capsys.readouterr().err


def test_settings_built_in_code_are_checked_as_the_flags_are():
    from app.settings import GatewaySettings, Limits
    from engine.contract.settings import EngineSettings, WeightSources

    for build in (
        lambda: EngineSettings(max_batch=0),
        lambda: EngineSettings(chunk_schedule="fast"),
        lambda: EngineSettings(dac_max_batch=True),
        lambda: Limits(max_frames=0),
        lambda: WeightSources(random_preset="huge"),
        lambda: GatewaySettings(workers=-1),
        lambda: EngineSettings(cpus="0,x"),
    ):
        with pytest.raises(ValueError, match=r"^--"):
            build()
    assert EngineSettings(max_batch=None).max_batch is None  # None: the engine picks


def test_every_settings_field_is_a_flag_and_a_new_field_is_one():
    """Each flag field of the settings is a `python -m app` flag whose value lands in that field; a field
    added to a settings class is a flag with nothing else written."""
    import dataclasses

    from app.__main__ import build_parser, parse_args
    from app.settings import GatewaySettings, Limits
    from engine.contract import flags
    from engine.contract.settings import EngineSettings, WeightSources

    options = build_parser()._option_string_actions
    for cls in (GatewaySettings, Limits, EngineSettings, WeightSources):
        for f in dataclasses.fields(cls):
            assert flags.flag_of(f) is not None or f.name in ("weights", "engine", "limits", "devices"), f.name
            if flags.flag_of(f):
                assert flags.option(f) in options, f.name
                if f.type in ("int", "float", "int | None", "float | None"):  # every number is bounded
                    assert flags.flag_of(f).lo is not None and flags.flag_of(f).hi is not None, f.name
    s = parse_args(
        [
            "--dac-max-in-flight",
            "5",
            "--stats-interval-s",
            "0.5",
            "--chunk-schedule",
            "low_latency",
            "--prefill-group-frames",
            "64",
            "--random-weights-seed",
            "7",
            "--no-compile",
            "--no-cuda-graphs",
            "--cors-origin",
            "a",
            "--cors-origin",
            "b",
            "--log-level",
            "debug",
        ]
    )
    assert (
        s.engine.dac_max_in_flight,
        s.engine.stats_interval_s,
        s.engine.chunk_schedule,
        s.engine.prefill_group_frames,
        s.weights.seed,
    ) == (5, 0.5, "low_latency", 64, 7)
    assert not s.engine.compile and not s.engine.cuda_graphs
    assert s.cors_origins == ("a", "b") and s.log_level == "DEBUG"
    assert parse_args([]).engine == EngineSettings() and parse_args([]).limits == Limits()

    @dataclasses.dataclass
    class Extended(EngineSettings):
        new_knob: int = dataclasses.field(default=3, metadata=flags.flag("a new setting", lo=1, hi=9))

    import argparse

    p = argparse.ArgumentParser()
    flags.add_flags(p, Extended)
    assert "--new-knob" in p.format_help() and "range 1..9" in p.format_help()
    assert Extended(**flags.values(p.parse_args(["--new-knob", "4"]), Extended)).new_knob == 4
    with pytest.raises(ValueError, match=r"--new-knob must be an integer in 1\.\.9, got 10"):
        Extended(**flags.values(p.parse_args(["--new-knob", "10"]), Extended))


def test_app_help_lists_every_flag():
    r = subprocess.run([sys.executable, "-m", "app", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    for name in (
        "--max-batch",
        "--normalization-workers",
        "--idle-timeout",
        "--no-batch-invariant",
        "--devices",
        "--no-auth",
        "--api-key",
        "--dac-max-in-flight",
        "--outbox-bytes-per-request",
        "--engine-cpus",
    ):
        assert name in r.stdout, name
    assert "decode slots (default: 256 on a GPU" in " ".join(r.stdout.split())
    # the real entry point refuses before it starts any process
    r = subprocess.run(
        [sys.executable, "-m", "app", "--normalization-workers", "100000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--normalization-workers must be an integer in 0.." in r.stderr
