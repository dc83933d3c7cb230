"""The CTC Viterbi's frame loop and its backtrack, one Triton launch each (engine/aligner/align.py `viterbi`).

In plain torch the loop over frames is ~10 small launches a frame (5,000 for a batch of 10 s utterances): host
time and GIL hand-offs that the decode loop, sharing the interpreter, would feel. Here one program runs one row's
whole loop over its frames: its scores are a vector over the CTC states in registers; the shifted reads (state s
comes from s, s - 1 or s - 2) go through a two-slot scratch row in global memory, with a barrier between a
frame's writes and the next frame's reads. It writes the same int8 back-pointers and last scores as the torch
loop (a tie keeps the lower move, as torch's max does on a CPU). The backtrack follows those pointers from the
last frame to the first, one program a row, and only the path (a state a frame) crosses to the host: the
pointers stay on the device, and no Python loop over frames holds the interpreter the decode loop shares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.aligner.model import NEG

_NEG = tl.constexpr(NEG)  # the kernel reads only constexpr globals


@triton.jit
def _viterbi_kernel(
    emit_ptr,  # [B, T, S] float32: each frame's log-probability of each state's label (-1e30 past a row's states)
    skip_ptr,  # [B, S] int8: state s may come from s - 2
    frames_ptr,  # [B] int32
    scratch_ptr,  # [B, 2, S + 2] float32, the first two of each slot NEG
    back_ptr,  # [B, T, S] int8
    score_ptr,  # [B, S] float32: the last frame's scores
    T,
    S,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK)
    ok = s < S
    n = tl.load(frames_ptr + b)
    emit_row = emit_ptr + b * T * S
    skip = tl.load(skip_ptr + b * S + s, mask=ok, other=0) != 0
    slots = scratch_ptr + b * 2 * (S + 2)
    score = tl.load(emit_row + s, mask=ok & (s < 2), other=_NEG)
    score = tl.where(s < 2, score, _NEG)
    tl.store(slots + 2 + s, score, mask=ok)
    t = 1
    while t < T:  # every row steps over the batch's frames (a runtime bound); past its own, its scores stay
        tl.debug_barrier()  # the last frame's scores are all in its slot
        prev = slots + ((t - 1) % 2) * (S + 2)
        step = tl.load(prev + 1 + s, mask=ok, other=_NEG)
        jump = tl.where(skip, tl.load(prev + s, mask=ok, other=_NEG), _NEG)
        best = score
        arg = tl.zeros([BLOCK], dtype=tl.int8)
        arg = tl.where(step > best, 1, arg).to(tl.int8)
        best = tl.maximum(best, step)
        arg = tl.where(jump > best, 2, arg).to(tl.int8)
        best = tl.maximum(best, jump)
        running = (s * 0 + t) < n
        score = tl.where(running, best + tl.load(emit_row + t * S + s, mask=ok, other=_NEG), score)
        tl.store(back_ptr + b * T * S + t * S + s, arg, mask=ok & running)
        tl.store(slots + (t % 2) * (S + 2) + 2 + s, score, mask=ok)
        t += 1
    tl.store(score_ptr + b * S + s, score, mask=ok)


@triton.jit
def _backtrack_kernel(
    back_ptr,  # [B, T, S] int8, as _viterbi_kernel wrote them
    end_ptr,  # [B] int32: each row's state at its last frame
    frames_ptr,  # [B] int32
    path_ptr,  # [B, T] int32: each frame's state (frames past a row's own are left as they are)
    T,
    S,
):
    b = tl.program_id(0).to(tl.int64)
    state = tl.load(end_ptr + b)
    t = tl.load(frames_ptr + b) - 1
    while t >= 0:
        tl.store(path_ptr + b * T + t, state)
        state -= tl.load(back_ptr + b * T * S + t * S + state).to(tl.int32)
        t -= 1


def viterbi_loop(emit: Tensor, skip: Tensor, frames: Tensor) -> tuple[Tensor, Tensor]:
    """(back-pointers [T, B, S] int8, last scores [B, S]) of the CTC recursion over `emit` [B, T, S] (each
    state's label's log-probability, -1e30 past a row's states), `skip` [B, S] and `frames` [B]."""
    b, t, s = emit.shape
    emit = emit.float().contiguous()
    scratch = torch.full((b, 2, s + 2), NEG, device=emit.device)
    back = torch.zeros((b, t, s), dtype=torch.int8, device=emit.device)
    score = torch.empty((b, s), device=emit.device)
    block = triton.next_power_of_2(max(s, 16))
    _viterbi_kernel[(b,)](
        emit,
        skip.to(torch.int8).contiguous(),
        frames.to(device=emit.device, dtype=torch.int32),
        scratch,
        back,
        score,
        t,
        s,
        BLOCK=block,
        num_warps=min(16, max(4, block // 256)),  # a long text's states spread over more threads
    )
    return back.transpose(0, 1), score


def backtrack(back: Tensor, end: Tensor, frames: Tensor) -> Tensor:
    """Each row's path [B, T] int32 (-1 past its frames) through `viterbi_loop`'s back-pointers [T, B, S] from its
    `end` state [B] at its last frame."""
    t, b, s = back.shape
    rows = back.transpose(0, 1)  # the kernel's own [B, T, S] layout (viterbi_loop's result is a view of it)
    assert rows.is_contiguous()
    path = torch.full((b, t), -1, dtype=torch.int32, device=back.device)
    _backtrack_kernel[(b,)](
        rows,
        end.to(device=back.device, dtype=torch.int32),
        frames.to(device=back.device, dtype=torch.int32),
        path,
        t,
        s,
        num_warps=1,  # a scalar walk
    )
    return path
