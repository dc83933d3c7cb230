"""CTC forced alignment of an utterance's text against the aligner's emissions: per-word start and end seconds.

Text to tokens (MMS's normalisation, `tokenize`): a word is a whitespace-separated piece of the text as sent.
It is lower-cased, "’" read as an apostrophe, accents dropped (NFKD, combining marks removed: "café" -> "cafe"; a
light stand-in for the uroman romanisation MMS uses, enough for Latin scripts), and every character that is then
none of `LABELS`' 27 (a-z and the apostrophe) skipped, as MMS's `normalize_uroman` skips them. The star token
stays unused: a word with no letter left ("42", "—", a script MMS cannot read without uroman) is not aligned and
is given the gap between its neighbours' aligned spans; an utterance with no letter at all is an error.

The Viterbi (`viterbi`) is batched and vectorised over the CTC states (blank, token, blank, ... : 2L + 1 of them)
and runs where the emissions are: it steps over the frames (in plain torch, or on a GPU in one Triton launch,
engine/aligner/kernel.py), keeps one int8 back-pointer per state and frame, and backtracks (on a GPU in a second
launch, on the host otherwise). Its path equals torchaudio's `functional.forced_align`
(tests/engine/test_aligner.py).
"""

from __future__ import annotations

import itertools
import re
import unicodedata
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from engine.aligner.model import BLANK, FRAME_SAMPLES, LABELS, NEG, SAMPLE_RATE

_INDEX = {c: i for i, c in enumerate(LABELS) if i != BLANK and c != "*"}
_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class Tokens:
    words: list[str]  # the text's words, as written
    tokens: list[int]  # every word's letters, flattened
    spans: list[tuple[int, int]]  # each word's [first, last) token (empty: no letter to align)


def tokenize(text: str) -> Tokens:
    """The tokens of a text (module docstring); ValueError when it has no letter to align."""
    words: list[str] = []
    tokens: list[int] = []
    spans: list[tuple[int, int]] = []
    for match in _WORD.finditer(text):
        word = match.group()
        plain = unicodedata.normalize("NFKD", word.lower().replace("’", "'"))
        ids = [_INDEX[c] for c in plain if c in _INDEX]
        words.append(word)
        spans.append((len(tokens), len(tokens) + len(ids)))
        tokens += ids
    if not tokens:
        raise ValueError("the text has no letter the aligner can align (a-z or an apostrophe, after romanisation)")
    return Tokens(words, tokens, spans)


def min_frames(tokens: list[int]) -> int:
    """The frames a CTC path of these tokens needs: one each, and a blank between two equal neighbours."""
    return len(tokens) + sum(a == b for a, b in itertools.pairwise(tokens))


def _viterbi_loop(emit: Tensor, skip: Tensor, frames: Tensor) -> tuple[Tensor, Tensor]:
    """The recursion over the frames in plain torch (engine/aligner/kernel.py: the same in one Triton launch):
    back-pointers [T, B, S] int8 (0: stay, 1: from s - 1, 2: from s - 2) and the last frame's scores [B, S]."""
    b, t_max, s_max = emit.shape
    dev = emit.device
    score = torch.full((b, s_max), NEG, device=dev)
    score[:, :2] = emit[:, 0, :2]
    back = torch.zeros((t_max, b, s_max), dtype=torch.int8, device=dev)
    neg = torch.full((b, 1), NEG, device=dev)
    for t in range(1, t_max):
        stay = score
        step = torch.cat([neg, score[:, :-1]], 1)
        jump = torch.cat([neg, neg, score[:, :-2]], 1).masked_fill(~skip, NEG)
        best, arg = torch.stack([stay, step, jump]).max(0)
        running = (t < frames)[:, None]
        score = torch.where(running, best + emit[:, t], score)
        back[t] = torch.where(running, arg.to(torch.int8), 0)
    return back, score


def viterbi(
    emissions: Tensor, frames: Tensor, targets: list[list[int]], use_kernel: bool | None = None
) -> list[np.ndarray]:
    """The most likely CTC path of each row: emissions [B, T, C] log-probabilities, frames [B] valid frames,
    targets per row (each must fit: `min_frames` <= its frames). Returns per row the CTC state of each valid frame
    (2k + 1: the row's k-th token; even: a blank), which tells two equal neighbouring tokens apart. The loop over
    the frames is one Triton launch on a GPU (`use_kernel`, default: on CUDA), plain torch otherwise."""
    b, t_max, _ = emissions.shape
    dev = emissions.device
    s_max = 2 * max(len(x) for x in targets) + 1
    ext = torch.full((b, s_max), BLANK, dtype=torch.long)
    n_states = torch.tensor([2 * len(x) + 1 for x in targets])
    skip = torch.zeros((b, s_max), dtype=torch.bool)  # s may come from s - 2: a token unlike the one before
    for i, x in enumerate(targets):
        tok = torch.tensor(x, dtype=torch.long)
        ext[i, 1 : 2 * len(x) : 2] = tok
        skip[i, 3 : 2 * len(x) : 2] = tok[1:] != tok[:-1]
    ext, skip, n_dev = ext.to(dev), skip.to(dev), n_states.to(dev)
    states = torch.arange(s_max, device=dev)
    live = states[None, :] < n_dev[:, None]
    emit = emissions.float().gather(2, ext[:, None, :].expand(b, t_max, s_max))  # [B, T, S]
    emit = emit.masked_fill(~live[:, None, :], NEG)
    frames_dev = frames.to(dev)
    kernel = emissions.is_cuda if use_kernel is None else use_kernel
    if kernel:
        from engine.aligner.kernel import backtrack, viterbi_loop

        back, score = viterbi_loop(emit, skip, frames_dev)
    else:
        back, score = _viterbi_loop(emit, skip, frames_dev)
    last = torch.stack([score.gather(1, (n_dev - 1)[:, None]), score.gather(1, (n_dev - 2).clamp(min=0)[:, None])])
    end = n_dev - 1 - last[:, :, 0].argmax(0)  # the last token's state or the final blank, whichever scores more
    frames_h = frames.cpu().numpy()
    if kernel:  # the walk back on the device: only the path crosses (kernel.py)
        walked = backtrack(back, end, frames_dev).cpu().numpy().astype(np.int64)
        return [walked[i, : int(frames_h[i])] for i in range(b)]
    back_h, end_h = back.cpu().numpy(), end.cpu().numpy()
    paths = []
    for i in range(b):
        s = int(end_h[i])
        path = np.empty(int(frames_h[i]), dtype=np.int64)
        for t in range(len(path) - 1, -1, -1):
            path[t] = s
            s -= int(back_h[t, i, s])
        paths.append(path)
    return paths


def word_times(tok: Tokens, states: np.ndarray, audio_s: float) -> list[tuple[str, float, float]]:
    """(word, start s, end s) of every word, from each frame's CTC state (`viterbi`). A frame is
    FRAME_SAMPLES of 16 kHz audio (20 ms); a word spans its first token's first frame to its last token's last
    frame; a word with nothing to align gets the gap between its neighbours (module docstring)."""
    n_tok = len(tok.tokens)
    states = np.asarray(states)
    at = np.flatnonzero(states % 2 == 1)  # the frames that emit a token
    k = states[at] // 2  # which token: a CTC path never goes back, so k never decreases along `at`
    first = np.full(n_tok, -1, dtype=np.int64)
    last = np.full(n_tok, -1, dtype=np.int64)
    if len(at):
        starts = np.flatnonzero(np.diff(k, prepend=-1))  # where each token's run begins
        ends = np.flatnonzero(np.diff(k, append=n_tok))  # and where it ends
        first[k[starts]] = at[starts]
        last[k[ends]] = at[ends]
    sec = FRAME_SAMPLES / SAMPLE_RATE
    spans: list[tuple[float, float] | None] = []
    for a, b in tok.spans:
        spans.append((float(first[a] * sec), float(min(audio_s, (last[b - 1] + 1) * sec))) if b > a else None)
    out = []
    for i, word in enumerate(tok.words):
        span = spans[i]
        if span is None:
            before = next((s[1] for s in reversed(spans[:i]) if s is not None), 0.0)
            after = next((s[0] for s in spans[i + 1 :] if s is not None), audio_s)
            span = (before, max(before, after))
        out.append((word, round(span[0], 4), round(span[1], 4)))
    return out
