"""A decode step's greedy tokens and non-finite flags in two launches.

``scheduler_hooks.sampling`` needs, per row of the step's logits ``[B, V]``, the argmax (the
lowest index of the largest value, as ``torch.argmax``) and whether the row holds a NaN or an
infinity. As torch ops that is an argmax (one program a row: 27 us for Flash's 129,280-entry
vocabulary at one row on the H200), ``isfinite``, ``all``, a negation, a cast and a stack, ~45 us
between two decode graphs (docs/PERF.md, session 12). Here a split kernel reduces chunks of
``BLOCK`` columns of every row at once (largest value, its lowest column, any non-finite) and a
second launch combines each row's chunks the same way, writing ``[2, B]`` int64: the tokens, then
the flags. Max and min are exact, so the result is ``torch.argmax``'s on every row without a
NaN (a row with one is flagged, and its token is not used).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import check_device

BLOCK = 4096


@triton.jit
def _chunk_kernel(work_ptr, w_sr, logit_ptr, l_sr, val_ptr, idx_ptr, bad_ptr, V, S, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    col = s * BLOCK + tl.arange(0, BLOCK)
    ok = col < V
    x = tl.load(work_ptr + b * w_sr + col, mask=ok, other=float("-inf")).to(tl.float32)
    best = tl.max(x, axis=0)
    first = tl.min(tl.where(x == best, col, V), axis=0)
    y = tl.load(logit_ptr + b * l_sr + col, mask=ok, other=0.0).to(tl.float32)
    bad = tl.max(((y != y) | (tl.abs(y) == float("inf"))).to(tl.int32), axis=0)
    tl.store(val_ptr + b * S + s, best)
    tl.store(idx_ptr + b * S + s, first)
    tl.store(bad_ptr + b * S + s, bad)


@triton.jit
def _rows_kernel(val_ptr, idx_ptr, bad_ptr, out_ptr, B, S, V, SP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SP)
    ok = s < S
    v = tl.load(val_ptr + b * S + s, mask=ok, other=float("-inf"))
    i = tl.load(idx_ptr + b * S + s, mask=ok, other=V)
    best = tl.max(v, axis=0)
    # (V - 1 caps a NaN row's token, which the flag already marks unused)
    tl.store(out_ptr + b, tl.minimum(tl.min(tl.where(v == best, i, V), axis=0), V - 1).to(tl.int64))
    tl.store(out_ptr + B + b, tl.max(tl.load(bad_ptr + b * S + s, mask=ok, other=0), axis=0).to(tl.int64))


def greedy_and_flags(work: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """int64 ``[2, B]``: row 0 ``argmax(work, -1)`` (lowest index of the largest value), row 1 1
    where ``logits`` holds a NaN or an infinity, else 0. work, logits: float ``[B, V]`` of one
    shape (the same tensor when no row is penalised), columns contiguous."""
    if work.dim() != 2 or work.shape != logits.shape:
        raise ValueError(f"greedy_and_flags: work {tuple(work.shape)} and logits {tuple(logits.shape)} must be "
                         f"one [B, V] shape")
    if not (work.is_floating_point() and logits.is_floating_point()) or work.stride(1) != 1 or logits.stride(1) != 1:
        raise ValueError("greedy_and_flags: work and logits must be float with contiguous columns")
    check_device(work, logits)
    B, V = work.shape
    out = torch.empty(2, B, dtype=torch.int64, device=work.device)
    if B == 0:
        return out
    if V == 0:
        raise ValueError("greedy_and_flags: an empty vocabulary has no argmax")
    S = triton.cdiv(V, BLOCK)
    val = torch.empty(B, S, dtype=torch.float32, device=work.device)
    idx = torch.empty(B, S, dtype=torch.int32, device=work.device)
    bad = torch.empty(B, S, dtype=torch.int32, device=work.device)
    _chunk_kernel[(B, S)](work, work.stride(0), logits, logits.stride(0), val, idx, bad, V, S, BLOCK=BLOCK,
                          num_warps=8)
    _rows_kernel[(B,)](val, idx, bad, out, B, S, V, SP=max(16, triton.next_power_of_2(S)), num_warps=1)
    return out
