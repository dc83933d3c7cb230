"""The aligner node (engine/aligner/): torchaudio's MMS_FA wav2vec2 in plain torch, its batched Viterbi, and word
times from audio + text, on synthetic checkpoints of MMS_FA's format."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.aligner.align import tokenize, viterbi, word_times
from engine.aligner.model import (
    CONV_KERNELS,
    CONV_STRIDES,
    LABELS,
    STAR,
    AlignerConfig,
    Wav2Vec2Aligner,
    config_of,
    load_aligner,
    random_checkpoint,
)
from engine.aligner.model import SAMPLE_RATE as ALIGNER_RATE
from engine.aligner.worker import Aligner, AlignerWorker
from engine.contract.constants import SAMPLE_RATE
from tests.conftest import triton_on_cpu

triton_on_cpu()  # the Viterbi's Triton kernel in Triton's interpreter on a CPU

torchaudio = pytest.importorskip("torchaudio")


def torchaudio_model(cfg: AlignerConfig) -> torch.nn.Module:
    """torchaudio's own Wav2Vec2Model with MMS_FA's parameters (torchaudio.pipelines.MMS_FA._params), sized cfg."""
    return torchaudio.models.wav2vec2_model(
        extractor_mode="layer_norm",
        extractor_conv_layer_config=[(cfg.conv_dim, k, s) for k, s in zip(CONV_KERNELS, CONV_STRIDES, strict=True)],
        extractor_conv_bias=True,
        encoder_embed_dim=cfg.embed_dim,
        encoder_projection_dropout=0.0,
        encoder_pos_conv_kernel=cfg.pos_kernel,
        encoder_pos_conv_groups=cfg.pos_groups,
        encoder_num_layers=cfg.layers,
        encoder_num_heads=cfg.heads,
        encoder_attention_dropout=0.0,
        encoder_ff_interm_features=cfg.ff_dim,
        encoder_ff_interm_dropout=0.1,
        encoder_dropout=0.0,
        encoder_layer_norm_first=True,
        encoder_layer_drop=0.1,
        aux_num_out=len(LABELS) - 1,
    ).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_checkpoint(tmp_path_factory.mktemp("aligner") / "model.pt", AlignerConfig.tiny(), seed=1)


def test_the_full_config_and_labels_are_mms_fa():
    bundle = torchaudio.pipelines.MMS_FA
    assert bundle.get_labels() == LABELS and LABELS[STAR] == "*"
    p, full = bundle._params, AlignerConfig.mms_fa()
    assert [tuple(c) for c in p["extractor_conv_layer_config"]] == [
        (full.conv_dim, k, s) for k, s in zip(CONV_KERNELS, CONV_STRIDES, strict=True)
    ]
    assert (p["encoder_embed_dim"], p["encoder_num_layers"], p["encoder_num_heads"]) == (
        full.embed_dim,
        full.layers,
        full.heads,
    )
    assert (p["encoder_ff_interm_features"], p["encoder_pos_conv_kernel"], p["encoder_pos_conv_groups"]) == (
        full.ff_dim,
        full.pos_kernel,
        full.pos_groups,
    )
    assert p["aux_num_out"] == len(LABELS) - 1 and p["extractor_mode"] == "layer_norm" and bundle.sample_rate == 16000
    # the full-size state dict has torchaudio's keys and shapes exactly (built on the meta device: no memory)
    with torch.device("meta"):
        ours, theirs = Wav2Vec2Aligner(full).state_dict(), torchaudio_model(full).state_dict()
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert config_of(theirs) == full


def test_emissions_equal_torchaudios_on_a_padded_batch(tiny):
    cfg = config_of(torch.load(tiny))
    theirs = torchaudio_model(cfg)
    theirs.load_state_dict(torch.load(tiny))
    ours = load_aligner(tiny)
    wav = torch.randn(3, 16000, generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([16000, 12000, 7000])
    with torch.inference_mode():
        a, fa = theirs(wav, lengths)
        b, fb = ours.logits(wav, lengths)
        assert torch.equal(fa, fb)
        for i in range(3):
            assert torch.equal(a[i, : fa[i]], b[i, : fb[i]])
        # the bundle's whole forward (waveform norm, log_softmax, star column) on one utterance
        bundle = torchaudio.pipelines._wav2vec2.utils._extend_model(
            theirs, normalize_waveform=True, apply_log_softmax=True, append_star=True
        )
        ref, _ = bundle(wav[1:2, :12000])
        got, frames = ours(wav[1:2], torch.tensor([12000]))
    torch.testing.assert_close(got[:, : frames[0]], ref, rtol=0, atol=1e-5)


def test_the_older_weight_norm_names_load_too(tiny, tmp_path):
    state = torch.load(tiny)
    pre = "encoder.transformer.pos_conv_embed.conv."
    state[pre + "weight_g"] = state.pop(pre + "parametrizations.weight.original0")
    state[pre + "weight_v"] = state.pop(pre + "parametrizations.weight.original1")
    torch.save(state, tmp_path / "old.pt")
    wav = torch.randn(1, 8000)
    with torch.inference_mode():
        assert torch.equal(
            load_aligner(tmp_path / "old.pt")(wav, torch.tensor([8000]))[0],
            load_aligner(tiny)(wav, torch.tensor([8000]))[0],
        )


@pytest.mark.parametrize("bad", ["not a dict", {"aux.weight": torch.zeros(28, 64)}, b"garbage"])
def test_a_checkpoint_of_another_format_is_refused_clearly(tmp_path, bad):
    if isinstance(bad, bytes):
        (tmp_path / "x.pt").write_bytes(bad)
    else:
        torch.save(bad, tmp_path / "x.pt")
    with pytest.raises(ValueError, match=r"state dict|not an MMS_FA checkpoint"):
        load_aligner(tmp_path / "x.pt")


@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "triton"])
def test_viterbi_equals_torchaudios_forced_align_batched(use_kernel):
    if use_kernel and torch.cuda.is_available():
        pytest.skip("the kernel on a CPU tensor needs Triton's interpreter (tests/gpu/test_aligner.py runs it)")
    g = torch.Generator().manual_seed(3)
    emissions = torch.randn(3, 70, len(LABELS), generator=g).log_softmax(-1)
    targets = [[1, 2, 2, 3, 5, 1], [4, 4, 4], [7]]
    frames = torch.tensor([70, 31, 5])
    paths = viterbi(emissions, frames, targets, use_kernel=use_kernel)
    for i, target in enumerate(targets):
        ref, _ = torchaudio.functional.forced_align(
            emissions[i : i + 1, : frames[i]], torch.tensor([target], dtype=torch.int32), blank=0
        )
        ext = np.zeros(2 * len(target) + 1, dtype=np.int64)
        ext[1::2] = target
        assert np.array_equal(ext[paths[i]], ref[0].numpy())


def test_word_spans_follow_the_forced_path():
    # "Hello, world 42 ok": each letter emitted on known frames; "42" has nothing to align
    tok = tokenize("Hello, world 42 ok")
    assert tok.words == ["Hello,", "world", "42", "ok"] and tok.spans[2][0] == tok.spans[2][1]
    letters = [c for w in ("hello", "world", "ok") for c in w]
    at = [2, 3, 4, 6, 7, 12, 13, 14, 15, 16, 25, 27]  # the frame of each letter ("ll": two frames, a blank between)
    emissions = torch.full((1, 30, len(LABELS)), -20.0)
    emissions[0, :, 0] = 0.0
    for f, c in zip(at, letters, strict=True):
        emissions[0, f, :] = -20.0
        emissions[0, f, LABELS.index(c)] = 0.0
    emissions[0, 5, :] = -20.0
    emissions[0, 5, 0] = 0.0
    (states,) = viterbi(emissions, torch.tensor([30]), [tok.tokens])
    words = word_times(tok, states, 30 * 0.02)
    assert words == [("Hello,", 0.04, 0.16), ("world", 0.24, 0.34), ("42", 0.34, 0.5), ("ok", 0.5, 0.56)]


def test_text_is_read_as_mms_reads_it():
    tok = tokenize("Café’s  ÜBER-cool!")
    assert tok.words == ["Café’s", "ÜBER-cool!"]
    assert "".join(LABELS[t] for t in tok.tokens) == "cafe'subercool"
    with pytest.raises(ValueError, match="no letter"):
        tokenize("42 — 日本")


def crafted_checkpoint(path: Path) -> Path:
    """A checkpoint of MMS_FA's layout whose emissions are known: a frame of positive (normalised) audio emits "a",
    a negative one a blank. The feature extractor has two channels: the first sums the audio, the second is 0, so
    each layer norm turns a frame into a sign ([1, -1] or [-1, 1]), which the later convolutions carry on (their
    window's majority); the projection keeps that sign in one dimension, the transformer adds nothing (its output
    projections are zero), and the head reads the sign."""
    cfg = AlignerConfig(conv_dim=2, embed_dim=64, layers=1, ff_dim=64, pos_kernel=4, pos_groups=1)
    model = Wav2Vec2Aligner(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" not in name:
                p.zero_()
        model.encoder.transformer.pos_conv_embed.conv.parametrizations.weight.original1.fill_(1.0)
        for i, layer in enumerate(model.feature_extractor.conv_layers):
            layer.conv.weight[0, 0] = 1.0
            if i:
                layer.conv.weight[0, 1] = -1.0
        model.encoder.feature_projection.projection.weight[0] = torch.tensor([1.0, -1.0])
        model.aux.weight[0, 0], model.aux.weight[LABELS.index("a"), 0] = -1.0, 1.0
        model.aux.bias.fill_(-20.0)
        model.aux.bias[0] = model.aux.bias[LABELS.index("a")] = 0.0
    torch.save(model.state_dict(), path)
    return path


def square(segments: list[tuple[float, float]], total_s: float, sr: int = SAMPLE_RATE) -> np.ndarray:
    """int16 audio at sr: 0.3 full scale inside the segments, -0.3 outside."""
    t = np.arange(int(total_s * sr)) / sr
    on = np.zeros(len(t), dtype=bool)
    for a, b in segments:
        on |= (t >= a) & (t < b)
    return np.where(on, 0.3, -0.3).__mul__(32767).astype(np.int16)


SEGMENTS = [(0.3, 0.6), (1.0, 1.2), (1.7, 2.3)]


def assert_on_segments(words: list[tuple[str, float, float]], texts: list[str]) -> None:
    assert [w for w, _, _ in words] == texts
    for (_, start, end), (a, b) in zip(words, SEGMENTS, strict=True):
        assert abs(start - a) <= 0.04 and abs(end - b) <= 0.04, (words, SEGMENTS)


def test_the_node_aligns_44k_audio_to_known_word_spans_in_one_batch(tmp_path):
    aligner = Aligner(load_aligner(crafted_checkpoint(tmp_path / "crafted.pt")))
    long = aligner.prepare(square(SEGMENTS, 2.6, 44100), 44100, "A, a 42 a!")
    short = aligner.prepare(square(SEGMENTS[:2], 1.5, 44100), 44100, "a a")
    words = aligner.align([long, short])
    assert [w for w, _, _ in words[0]] == ["A,", "a", "42", "a!"]
    assert_on_segments([words[0][i] for i in (0, 1, 3)], ["A,", "a", "a!"])
    assert words[0][2][1:] == (words[0][1][2], words[0][3][1])  # nothing to align: the gap between its neighbours
    assert [w for w, _, _ in words[1]] == ["a", "a"] and all(
        type(t) is float for w in words for _, *ts in w for t in ts
    )
    for (_, start, end), (a, b) in zip(words[1], SEGMENTS[:2], strict=True):
        assert abs(start - a) <= 0.04 and abs(end - b) <= 0.04, words


@pytest.mark.parametrize(("n", "sr"), [(119345, 22050), (4513, 44100), (8007, 8000), (96001, 48000), (160001, 16000)])
def test_the_resampled_audio_never_outlasts_the_audio(n: int, sr: int):
    """soxr rounds its output's length up: at 22,050 Hz 119,345 samples became 5.4125 s at 16 kHz, 28 us past the
    audio, and the last word ended there. The aligner's audio is cut to the original's length."""
    wav, _ = Aligner.prepare(np.ones(n, np.int16), sr, "a")
    assert len(wav) / ALIGNER_RATE <= n / sr


@pytest.mark.parametrize(
    "pcm, sr, text, match",
    [
        (np.zeros(44100, np.int16), 44100, "42", "no letter"),
        (np.zeros(4410, np.int16), 44100, "a much longer text than a tenth of a second holds", "too short"),
        (np.zeros((2, 4410), np.int16), 44100, "a", "mono"),
        (np.full(4410, np.nan, np.float32), 44100, "a", "NaN"),
        (np.zeros(4410, np.int16), 0, "a", "sample rate"),
        (np.zeros(4410, np.int16), 44100.0, "a", "sample rate"),
    ],
)
def test_what_cannot_be_aligned_is_a_clear_error(pcm, sr, text, match):
    with pytest.raises(ValueError, match=match):
        Aligner.prepare(pcm, sr, text)


def _held(tmp_path) -> tuple[Aligner, threading.Event, threading.Event]:
    """An aligner whose batches wait for `gate` (`entered` says one has started): while the first is held, what
    is submitted queues behind it."""
    aligner = Aligner(load_aligner(crafted_checkpoint(tmp_path / "crafted.pt")))
    gate, entered = threading.Event(), threading.Event()
    real = aligner.align

    def held(batch):
        entered.set()
        gate.wait(30)
        return real(batch)

    aligner.align = held  # type: ignore[method-assign]
    return aligner, gate, entered


def _results(worker: AlignerWorker, n: int) -> dict[object, tuple]:
    """The worker's first `n` answers, key -> (words, error) (a guard bound, not a pace)."""
    done: dict[object, tuple] = {}
    for _ in range(600):
        done.update({k: (w, e) for k, w, e in worker.results()})
        if len(done) >= n:
            break
        threading.Event().wait(0.1)
    return done


def test_the_worker_batches_what_is_queued_and_fails_only_the_bad_utterance(tmp_path):
    aligner, gate, entered = _held(tmp_path)  # the first batch waits until the rest is queued: they make one
    worker = AlignerWorker(aligner)
    try:
        worker.submit("first", square(SEGMENTS, 2.6), SAMPLE_RATE, "a a a")
        assert entered.wait(30)
        for k in range(3):
            worker.submit(k, square(SEGMENTS, 2.6), SAMPLE_RATE, "a a a")
        worker.submit("bad", np.zeros(100, np.int16), SAMPLE_RATE, "a")
        gate.set()
        done = _results(worker, 5)
        assert set(done) == {"first", 0, 1, 2, "bad"}
        assert isinstance(done["bad"][1], ValueError) and done["bad"][0] is None
        for k in ("first", 0, 1, 2):
            words, err = done[k]
            assert err is None
            assert_on_segments(words, ["a", "a", "a"])
        assert worker.batches == 2  # the first alone, the other three together
    finally:
        worker.close()


COMPILE_FOR_H200 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.aligner import kernel

ptr = {"emit_ptr": "*fp32", "skip_ptr": "*i8", "frames_ptr": "*i32", "scratch_ptr": "*fp32", "back_ptr": "*i8"}
sig = {**ptr, "score_ptr": "*fp32", "T": "i32", "S": "i32", "BLOCK": "constexpr"}
for block, warps in ((128, 4), (4096, 16)):
    src = ASTSource(kernel._viterbi_kernel, sig, constexprs={"BLOCK": block})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert "bar.sync" in compiled.asm["ptx"]  # the barrier between a frame's writes and the next's reads
sig = {"back_ptr": "*i8", "end_ptr": "*i32", "frames_ptr": "*i32", "path_ptr": "*i32", "T": "i32", "S": "i32"}
triton.compile(ASTSource(kernel._backtrack_kernel, sig), target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
print("compiled")
"""


def test_the_kernels_compile_for_the_h200(tmp_path):
    """Triton's compiler (not its interpreter) takes both kernels down to sm_90 cubins, on any machine: what the
    interpreter lets pass (a plain global, a scalar that is no constexpr) fails there. In a process of its own:
    the interpreter, once chosen (triton_on_cpu), takes over the compiler's front end too, and a fresh cache
    (a compile that succeeded once elsewhere must not stand in for this one)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_H200], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def test_the_worker_gathers_utterances_that_arrive_within_its_window(tmp_path):
    """A forward waits for what arrives within `gather_s` of its first utterance (one forward's launches for
    many utterances), and a full batch runs at once without waiting out the window."""
    worker = AlignerWorker(Aligner(load_aligner(crafted_checkpoint(tmp_path / "crafted.pt"))), max_batch=3, gather_s=60)
    try:
        worker.submit(0, square(SEGMENTS, 2.6), SAMPLE_RATE, "a a a")
        threading.Event().wait(0.2)  # the worker has taken the first one and waits for more
        for k in (1, 2):
            worker.submit(k, square(SEGMENTS, 2.6), SAMPLE_RATE, "a a a")
        done = _results(worker, 3)
        assert set(done) == {0, 1, 2} and all(e is None for _, e in done.values())
        assert worker.batches == 1
    finally:
        worker.close()


def test_a_behind_aligner_refuses_more_and_skips_what_waited_too_long(tmp_path, monkeypatch):
    """Word times nobody waits for any more are not worth a forward: while a batch runs, the queue takes at
    most MAX_QUEUED_S of audio (then AlignerBehind at submit: the engine answers engine_busy and the gateway
    keeps its estimate), and an utterance that waited longer than ALIGN_WAIT_S is answered AlignerBehind
    without being aligned (here both bounds are small; the batch in flight is held until they are passed)."""
    from engine.aligner import worker as worker_mod

    monkeypatch.setattr(worker_mod, "MAX_QUEUED_S", 6.0)
    monkeypatch.setattr(worker_mod, "ALIGN_WAIT_S", 0.05)
    aligner, gate, entered = _held(tmp_path)
    worker = AlignerWorker(aligner, gather_s=0)
    try:
        worker.submit("first", square(SEGMENTS, 2.6), SAMPLE_RATE, "a a a")
        assert entered.wait(30)  # taken: the queue is empty again
        worker.submit("queued", square(SEGMENTS, 2.6), SAMPLE_RATE, "a a a")
        worker.submit("also", square(SEGMENTS, 2.6), SAMPLE_RATE, "a a a")
        with pytest.raises(worker_mod.AlignerBehind):  # 7.8 s would wait: past the 6 s bound
            worker.submit("refused", square(SEGMENTS, 2.6), SAMPLE_RATE, "a a a")
        threading.Event().wait(0.2)  # the two queued ones are older than ALIGN_WAIT_S now, whatever the pace
        gate.set()
        done = _results(worker, 3)
        assert done["first"][1] is None
        assert all(isinstance(done[k][1], worker_mod.AlignerBehind) and done[k][0] is None for k in ("queued", "also"))
        assert worker.batches == 1
        worker.submit("after", square(SEGMENTS, 2.6), SAMPLE_RATE, "a a a")  # the queue's count went back down
    finally:
        worker.close()
