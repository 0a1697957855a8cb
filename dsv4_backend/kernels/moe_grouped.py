"""The element-wise steps of the grouped bf16 MoE (``model.MoE._grouped``) in one launch each.

Between and after its two grouped GEMMs the grouped path ran ~15 small torch launches a layer:
g and u copied to fp32, the clamps, SiLU, the products with u and the routing weight, the copy
back to bf16, the unsort permutation (arange, scatter), the gather back to (token, choice) order,
the sum over the k choices and the add to the shared expert's output. On the H200 at 128K x 17
they took ~1.3 ms of a 22.6 ms step (docs/PERF.md, session 12). Here:

- ``swiglu_rows``: ``h = bf16(silu(min(g, limit)) * clamp(u, -limit, limit) * weight)`` per row,
  from the bf16 g and u (the GEMM's outputs), in fp32 (Expert.forward's rounding points). With
  ``order`` (sorted row -> pair) the weight of a row is ``weights[order[row]]`` and the launch also
  writes the inverse permutation (pair -> sorted row) that the combine reads; rows from
  ``valid_rows`` on (another rank's experts, sorted last) get h = 0. Without weights, h carries
  no weight (Expert.forward without one: the shared expert).
- ``combine_pairs``: ``out[t] = bf16(shared[t] + bf16(sum_j y[inv[t k + j]]))`` over the valid
  choices j in order, in fp32 (``y[unsort].view(T, k, D).sum(1)`` on bf16, then ``out.add_``).

SiLU is ``g / (1 + exp(-g))`` with Triton's exp, where torch uses CUDA's expf: the last bits of h
may differ from the torch path's (``tests/test_moe_grouped.py`` bounds them); the sums over the
choices run in a fixed order, so a step gives the same bits every time.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import check_device, native, round_bf16
from dsv4_backend.kernels import pdl
from dsv4_backend.kernels.pdl import wait as pdl_wait

BLOCK_I = 128   # columns of h a program
BLOCK_D = 1024  # columns of out a program


@triton.jit
def _swiglu_rows_kernel(g_ptr, u_ptr, g_sr, u_sr, h_ptr, I, limit, order_ptr, wts_ptr, inv_ptr, valid_ptr,
                        WEIGHTED: tl.constexpr, BLOCK: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    r = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = col < I
    g = tl.minimum(tl.load(g_ptr + r * g_sr + col, mask=cm, other=0.0).to(tl.float32), limit)
    u = tl.load(u_ptr + r * u_sr + col, mask=cm, other=0.0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    h = g / (1.0 + tl.exp(-g)) * u
    if WEIGHTED:
        pair = tl.load(order_ptr + r)
        h = h * tl.load(wts_ptr + pair)
        h = tl.where(r < tl.load(valid_ptr), h, 0.0)
        if tl.program_id(1) == 0:
            tl.store(inv_ptr + pair, r)
    h = round_bf16(h, NATIVE)   # rounded here: the interpreter's cast truncates
    tl.store(h_ptr + r * I + col, h.to(tl.bfloat16), mask=cm)


def swiglu_rows(g: torch.Tensor, u: torch.Tensor, limit: float, weights: Optional[torch.Tensor] = None,
                order: Optional[torch.Tensor] = None,
                valid_rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """SwiGLU of bf16 ``g, u [R, I]`` (rows may be strided, columns contiguous) -> (h bf16 [R, I],
    the inverse of ``order`` int64 [R] or None).

    ``weights`` fp32 [R] per pair and ``order`` int [R] (sorted row -> pair index, a
    permutation) go together: row r is weighted by ``weights[order[r]]``; ``valid_rows`` (int
    tensor of one element, default R): rows from it on get h = 0."""
    R, I = g.shape
    if u.shape != (R, I) or g.dtype != torch.bfloat16 or u.dtype != torch.bfloat16:
        raise ValueError(f"swiglu_rows: g and u must be bf16 of one shape, got {g.dtype} {tuple(g.shape)} and "
                         f"{u.dtype} {tuple(u.shape)}")
    if g.stride(1) != 1 or u.stride(1) != 1:
        raise ValueError("swiglu_rows: g and u need contiguous columns")
    if (weights is None) != (order is None):
        raise ValueError("swiglu_rows: weights and order go together")
    h = torch.empty(R, I, dtype=torch.bfloat16, device=g.device)
    inv = None
    if weights is not None:
        if weights.shape != (R,) or order.shape != (R,):
            raise ValueError(f"swiglu_rows: weights and order must be [{R}], got {tuple(weights.shape)} and "
                             f"{tuple(order.shape)}")
        weights = weights.to(torch.float32).contiguous()
        order = order.contiguous()
        valid_rows = (torch.full((1,), R, dtype=torch.int64, device=g.device) if valid_rows is None
                      else valid_rows.reshape(1))
        inv = torch.empty(R, dtype=torch.int64, device=g.device)
        check_device(g, u, weights, order, valid_rows)
    else:
        check_device(g, u)
    if R:
        _swiglu_rows_kernel[(R, triton.cdiv(I, BLOCK_I))](
            g, u, g.stride(0), u.stride(0), h, I, float(limit),
            order if order is not None else h, weights if weights is not None else h,
            inv if inv is not None else h, valid_rows if valid_rows is not None else h,
            WEIGHTED=weights is not None, BLOCK=BLOCK_I, NATIVE=native(), num_warps=4, **pdl.args(g.device))
    return h, inv


@triton.jit
def _combine_pairs_kernel(y_ptr, inv_ptr, ids_ptr, sh_ptr, out_ptr, D, E, TOPK: tl.constexpr,
                          BLOCK: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dm = d < D
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        e = tl.load(ids_ptr + t * TOPK + j)
        row = tl.load(inv_ptr + t * TOPK + j)
        m = dm & (e >= 0) & (e < E)
        acc += tl.load(y_ptr + row * D + d, mask=m, other=0.0).to(tl.float32)
    routed = round_bf16(acc, NATIVE)
    sh = tl.load(sh_ptr + t * D + d, mask=dm, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + d, round_bf16(sh + routed, NATIVE).to(tl.bfloat16), mask=dm)


def combine_pairs(y: torch.Tensor, inv: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor,
                  num_experts: int) -> torch.Tensor:
    """``bf16(shared + bf16(sum over valid j of y[inv[t k + j]]))`` -> bf16 [T, D]: y bf16 [T k, D]
    (rows in sorted order), inv int64 [T k] (pair -> sorted row), ids int [T, k] (choices with an
    id outside 0 .. num_experts - 1 are skipped), shared bf16 [T, D]."""
    T, k = ids.shape
    D = shared.shape[-1]
    if y.shape != (T * k, D) or shared.shape != (T, D) or inv.shape != (T * k,):
        raise ValueError(f"combine_pairs: y {tuple(y.shape)}, inv {tuple(inv.shape)}, shared {tuple(shared.shape)} "
                         f"do not fit ids {tuple(ids.shape)}")
    if y.dtype != torch.bfloat16 or shared.dtype != torch.bfloat16:
        raise ValueError(f"combine_pairs: y and shared must be bf16, got {y.dtype} and {shared.dtype}")
    check_device(y, inv, ids, shared)
    out = torch.empty(T, D, dtype=torch.bfloat16, device=y.device)
    if T:
        _combine_pairs_kernel[(T, triton.cdiv(D, BLOCK_D))](
            y.contiguous(), inv.contiguous(), ids.contiguous(), shared.contiguous(), out, D, num_experts,
            TOPK=k, BLOCK=BLOCK_D, NATIVE=native(), num_warps=4, **pdl.args(y.contiguous().device))
    return out
