"""The bf16 MoE of a decode step (routed experts and the shared expert) in four launches.

At decode sizes the bf16 MoE of ``model.MoE._grouped`` is ~40 small launches per layer (a sort,
group ends, two grouped GEMMs, the SwiGLU's element-wise ops, an unsort, the sum over the k
choices) plus ~8 for the shared expert; at batch 1 they cost more than the weights they read.
Here, for ``T`` tokens with ``k`` routed choices each, the ``P = T k + T`` (token, expert) pairs
(the last ``T`` are the shared expert's) run as:

1. **gate-up GEMV** (grid: pairs x ``2I / BLOCK_N`` rows x K splits): a program owns ``BLOCK_N``
   rows of one expert's ``[w1; w3]`` over one K split and streams them once. As in
   ``fp4_moe_decode``, routing is read inside the GEMV: the program of the first pair routed to an
   expert runs every pair of that expert (the later pairs' programs exit), so an expert chosen
   by several tokens is read from HBM once per step. A shared pair is its own expert. fp32
   partial sums per split at the pair's row;
2. **SwiGLU** (grid: pairs x 128 columns): the splits added in order, g and u rounded to bf16 (the
   grouped GEMM's output dtype), ``h = bf16(silu(min(g, limit)) * clamp(u, +-limit) * weight)``
   (weight 1 for the shared expert: the same bits as no weight);
3. **down GEMV**: the same kernel over ``w2`` with each pair's own ``h`` row;
4. **combine** (grid: tokens x 1024 columns): per routed pair ``bf16(sum of its splits)``, the k
   choices added in order in fp32 and rounded once (``y.view(T, k, D).sum(1)`` on bf16), then
   ``bf16(shared + routed)`` (the ``out.add_`` of the grouped path).

So the rounding points are those of the grouped path; only the order of the fp32 sums inside a
dot product differs (``tests/test_moe_bf16_decode.py`` holds it to the bound of that). Fixed
grids for a given ``T`` and no host reads: a decode graph captures it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import native, round_bf16
from dsv4_backend.kernels.fp4_moe_decode import _combine_splits_kernel, _count_same, _nth_pair
from dsv4_backend.kernels import pdl

ID_CHUNK = 64


class Bf16GemvConfig(NamedTuple):
    block_n: int = 16  # weight rows per program
    block_k: int = 256  # K step
    split_k: int = 2  # K splits (whole K steps each); partials added in split order
    num_warps: int = 4
    num_stages: int = 3


# from the H200 sweep at T = 1 (bench/probe_moe_bf16.py --sweep, docs/PERF.md session 7)
GATE_UP = Bf16GemvConfig(16, 512, 1, 4, 3)
DOWN = Bf16GemvConfig(32, 256, 2, 4, 3)


@triton.jit
def _bf16_gemv_kernel(a_ptr, ids_ptr, w_ptr, ws_ptr, part_ptr, PR, P, E, N, K, a_sr, w_se, w_sr, ws_sr,
                      k_per_split, TOPK: tl.constexpr, GATE_UP: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, CH: tl.constexpr):
    """part[split, pair, n] = act[row(pair)] . w(pair)[n] over this split's K (fp32). Pairs
    ``< PR`` are routed (expert ``ids[pair]``, weights ``w[e]``); the rest shared (``ws``). The
    activation row of a pair: gate-up, its token (``pair // TOPK`` routed, ``pair - PR`` shared);
    down, the pair itself."""
    b = tl.program_id(0)
    split = tl.program_id(2)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    kk = tl.arange(0, BLOCK_K)
    if b < PR:
        e = tl.load(ids_ptr + b).to(tl.int32)
        valid = (e >= 0) & (e < E)
        first = valid & (_count_same(ids_ptr, e, 0, tl.where(valid, b, 0), CH) == 0)
        n_rows = _count_same(ids_ptr, e, b, tl.where(first, PR, b), CH)
        w_rows = w_ptr + tl.minimum(tl.maximum(e, 0), E - 1).to(tl.int64) * w_se + n.to(tl.int64)[:, None] * w_sr
    else:
        e = b * 0 - 1
        n_rows = b * 0 + 1
        w_rows = ws_ptr + n.to(tl.int64)[:, None] * ws_sr
    for r in range(0, n_rows):
        if b < PR:
            pair = _nth_pair(ids_ptr, b, PR, e, r, CH)
        else:
            pair = b
        if GATE_UP:
            row = tl.where(pair < PR, pair // TOPK, pair - PR).to(tl.int64)
        else:
            row = pair.to(tl.int64)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kmask = (k0 + kk) < k_hi
            w = tl.load(w_rows + (k0 + kk)[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            a = tl.load(a_ptr + row * a_sr + k0 + kk, mask=kmask, other=0.0)
            acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
        tl.store(part_ptr + (split * P + pair).to(tl.int64) * N + n, tl.sum(acc, axis=1), mask=nmask)


@triton.jit
def _swiglu_kernel(part_ptr, ids_ptr, wts_ptr, h_ptr, PR, P, E, I, limit, SPLIT: tl.constexpr,
                   NATIVE: tl.constexpr):
    """Per (pair, 128 columns of I): h = bf16(silu(min(g, limit)) clamp(u, +-limit) weight), g and u
    the split sums in order rounded to bf16; 0 for a skipped routed pair."""
    pair = tl.program_id(0)
    col = tl.program_id(1) * 128 + tl.arange(0, 128)
    routed = pair < PR
    e = tl.load(ids_ptr + pair, mask=routed, other=0)
    ok = ((e >= 0) & (e < E)) | ~routed
    cm = ok & (col < I)
    base = part_ptr + pair.to(tl.int64) * (2 * I) + col
    g = tl.load(base, mask=cm, other=0.0)
    u = tl.load(base + I, mask=cm, other=0.0)
    for s in tl.static_range(1, SPLIT):
        g += tl.load(base + s * P * (2 * I), mask=cm, other=0.0)
        u += tl.load(base + s * P * (2 * I) + I, mask=cm, other=0.0)
    g = tl.minimum(round_bf16(g, NATIVE), limit)
    u = tl.minimum(tl.maximum(round_bf16(u, NATIVE), -limit), limit)
    wt = tl.load(wts_ptr + pair, mask=routed, other=1.0)
    h = round_bf16(g / (1.0 + tl.exp(-g)) * u * wt, NATIVE)   # rounded here: the interpreter's cast truncates
    tl.store(h_ptr + pair.to(tl.int64) * I + col, tl.where(cm, h, 0.0).to(tl.bfloat16), mask=col < I)


def _splits(K: int, cfg: Bf16GemvConfig) -> tuple[int, int]:
    """(K per split, number of splits): whole K steps per split, no empty split."""
    for name in ("block_n", "block_k"):
        v = getattr(cfg, name)
        if v <= 0 or v & (v - 1):
            raise ValueError(f"moe_bf16_decode: {name}={v} must be a power of two")
    steps = triton.cdiv(K, cfg.block_k)
    per = triton.cdiv(steps, max(1, cfg.split_k)) * cfg.block_k
    return per, triton.cdiv(K, per)


def _gemv(act: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, PR: int, topk: int,
          gate_up: bool, cfg: Bf16GemvConfig) -> torch.Tensor:
    E, N, K = w.shape
    P = PR + (act.shape[0] if gate_up else act.shape[0] - PR)
    per, split = _splits(K, cfg)
    part = torch.empty(split, P, N, dtype=torch.float32, device=w.device)
    _bf16_gemv_kernel[(P, triton.cdiv(N, cfg.block_n), split)](
        act, ids, w, ws, part, PR, P, E, N, K, act.stride(0), w.stride(0), w.stride(1), ws.stride(0), per,
        TOPK=topk, GATE_UP=gate_up, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, CH=ID_CHUNK,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return part


def moe_bf16_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, shared13: torch.Tensor, shared2: torch.Tensor, limit: float,
                    gate_up: Optional[Bf16GemvConfig] = None, down: Optional[Bf16GemvConfig] = None) -> torch.Tensor:
    """Routed + shared experts of ``T`` tokens: x bf16 [T, D]; ids int [T, k] (routed experts,
    < 0 or >= E skipped); weights fp32 [T, k]; w13 bf16 [E, 2I, D] (w1 rows, then w3 rows), w2
    [E, D, I]; shared13 [2I, D], shared2 [D, I] (rows contiguous). -> [T, D] bf16."""
    T, k = ids.shape
    E, I2, D = w13.shape
    I = I2 // 2
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("shared13", shared13), ("shared2", shared2)):
        if t.dtype != torch.bfloat16 or t.stride(-1) != 1:
            raise ValueError(f"moe_bf16_decode: {name} must be bf16 with contiguous rows, got {t.dtype} "
                             f"strides {t.stride()}")
    if tuple(w2.shape) != (E, D, I) or tuple(shared13.shape) != (I2, D) or tuple(shared2.shape) != (D, I):
        raise ValueError(f"moe_bf16_decode: shapes w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, shared13 "
                         f"{tuple(shared13.shape)}, shared2 {tuple(shared2.shape)} do not fit [E, 2I, D] / [E, D, I]")
    if I % 128 or x.shape != (T, D):
        raise ValueError(f"moe_bf16_decode: x {tuple(x.shape)} must be [T, {D}] and I = {I} a multiple of 128")
    PR = T * k
    P = PR + T
    flat = ids.reshape(-1).contiguous()
    wts = weights.reshape(-1).to(torch.float32).contiguous()
    part = _gemv(x, flat, w13, shared13, PR, k, True, gate_up or GATE_UP)
    h = torch.empty(P, I, dtype=torch.bfloat16, device=x.device)
    _swiglu_kernel[(P, I // 128)](part, flat, wts, h, PR, P, E, I, float(limit), SPLIT=part.shape[0],
                                  NATIVE=native(), num_warps=4)
    part = _gemv(h, flat, w2, shared2, PR, k, False, down or DOWN)
    out = torch.empty(T, D, dtype=torch.bfloat16, device=x.device)
    split = part.shape[0]
    _combine_splits_kernel[(T, triton.cdiv(D, 1024))](part, flat, out, part[0, PR:], P * D, P, D, E, TOPK=k,
                                                      SPLIT=split, SHARED=True, SH_SPLIT=split, BLOCK_D=1024,
                                                      NATIVE=native(), num_warps=4, **pdl.args(part.device))
    return out
