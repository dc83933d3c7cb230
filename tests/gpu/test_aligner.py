"""The aligner node at MMS_FA's full size on the GPU (skipped without CUDA): a synthetic checkpoint of the exact
format (engine/aligner/model.py `random_checkpoint`), loaded in bf16, aligns a batch of 44.1 kHz utterances on its
own thread and CUDA stream; fp32 emissions on the GPU equal the CPU's, the Viterbi's path on the GPU the CPU's."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TEXTS = [
    "Hello there, how are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "It's 42 degrees — café au lait, s'il vous plaît!",
    "Yes.",
    "A much longer sentence that goes on for a while, with commas, clauses and all the rest of it.",
    "No letters here: 123 456, then words.",
    "Short one.",
    "Another sentence of middling length for the batch.",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from engine.aligner.model import AlignerConfig, random_checkpoint

    return random_checkpoint(tmp_path_factory.mktemp("aligner") / "model.pt", AlignerConfig.mms_fa())


def audio(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 44100)) / 44100
    voiced = np.sin(2 * np.pi * 180 * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))  # a syllable-rate envelope
    return ((voiced + 0.05 * rng.standard_normal(len(t))) * 8000).astype(np.int16)


def test_full_size_aligner_batch_on_the_gpu(checkpoint):
    from engine.aligner.align import viterbi
    from engine.aligner.model import load_aligner
    from engine.aligner.worker import Aligner, AlignerWorker

    cpu = load_aligner(checkpoint, "cpu", torch.float32)
    assert cpu.cfg.embed_dim == 1024 and cpu.cfg.layers == 24 and cpu.cfg.heads == 16
    assert sum(p.numel() for p in cpu.parameters()) > 300e6  # MMS_FA's ~315M parameters

    # fp32 emissions on the GPU equal the CPU's (TF32 off), and the GPU's Viterbi takes the CPU's path
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        wav, tok = Aligner.prepare(audio(2.0, 0), 44100, TEXTS[0])
        x, n = torch.from_numpy(wav)[None], torch.tensor([len(wav)])
        with torch.inference_mode():
            ref, frames = cpu(x, n)
            got, _ = cpu.to("cuda")(x.cuda(), n.cuda())
        torch.testing.assert_close(got.cpu(), ref, rtol=0, atol=2e-3)
        (on_gpu,) = viterbi(got, frames, [tok.tokens])  # the Triton kernel
        (on_cpu,) = viterbi(got.cpu(), frames, [tok.tokens])  # the torch loop
        assert np.array_equal(on_gpu, on_cpu)
        # a batch of rows of other lengths (and a long text's many states): the kernel's paths are the loop's
        g = torch.Generator().manual_seed(0)
        emissions = torch.randn(3, 400, 29, generator=g).log_softmax(-1).cuda()
        targets = [list(torch.randint(1, 28, (n,), generator=g).tolist()) for n in (150, 7, 1)]
        lengths = torch.tensor([400, 90, 3])
        kernel = viterbi(emissions, lengths, targets)
        loop = viterbi(emissions, lengths, targets, use_kernel=False)
        assert all(np.array_equal(a, b) for a, b in zip(kernel, loop, strict=True))
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    del cpu

    # bf16, a batch of 8 utterances of 1-9 s through the node's thread and CUDA stream
    worker = AlignerWorker(Aligner(load_aligner(checkpoint, "cuda", torch.bfloat16)))
    try:
        lengths = [2.0, 3.0, 4.0, 1.0, 9.0, 3.0, 1.0, 3.5]
        clips = [audio(seconds, i) for i, seconds in enumerate(lengths)]  # made first: submitted back to back
        for i, (text, clip) in enumerate(zip(TEXTS, clips, strict=True)):
            worker.submit(i, clip, 44100, text)
        done: dict[int, list] = {}
        t0 = time.monotonic()
        while len(done) < len(TEXTS) and time.monotonic() - t0 < 300:
            for key, words, err in worker.results():
                assert err is None, (key, err)
                done[key] = words
            time.sleep(0.01)
        assert sorted(done) == list(range(len(TEXTS)))
        assert worker.batches <= 2  # what was queued went in one forward (the first may have been alone)
        for i, words in done.items():
            assert [w for w, _, _ in words] == TEXTS[i].split()
            starts = [s for _, s, _ in words]
            assert starts == sorted(starts) and all(0 <= s <= e <= lengths[i] + 1e-6 for _, s, e in words)
    finally:
        worker.close()
