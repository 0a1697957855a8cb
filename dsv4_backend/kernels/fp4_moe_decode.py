"""Routed FP4 experts at decode sizes: weight-streaming GEMVs on the CUDA cores, split along K.

The same contract as ``fp4_moe`` (its module docstring; ``docs/kernels.md``), for few (token,
choice) pairs: at T = 1 each selected expert has one row, and the grouped tensor-core kernels'
one program per (row block, 128 columns) leaves most SMs idle while each program walks all of K.
Here a program owns ``block_n`` weight rows of one expert over one K split, so the grid is
(pairs, N / block_n, splits): thousands of programs at T = 1, each streaming its rows once.

- Routing is inside the GEMV: program (b, ., .) reads the flat ids; it works only if pair b is the
  first pair routed to its expert (so every selected expert is read by one program column), and
  then runs once per pair of that expert (the row loop is outside the K loop: the second and
  later rows re-read the program's weight slice, ``block_n x K / (2 split)`` bytes, from L1 / L2,
  not from HBM). No sort, no routing launch; pairs outside [0, E) are skipped.
- A weight tile is ``[block_n, block_k / 32, 16]`` bytes: each thread's 16 bytes are the 32
  nibbles of one e8m0 scale block, so the 32-term dot is summed in the thread and the scale (times
  the activation's 1x128 scale) is applied once per 32 terms. Nibbles are decoded in registers
  (``decode="f16"``: bits moved into an fp16, value x 2^-14; ``"e4m3"``: into an e4m3, value x
  2^-6, then the hardware's conversion; ``"lut"``: a load from a 16-entry fp32 table that stays
  in L1) and multiplied with the e4m3 activation codes in fp32 (exact: at most 6 significant
  bits); only the fp32 sums round.
- Each split writes its fp32 partial sums ``[split, P, N]`` at the pair's own row; the next
  kernel adds the splits in split order (deterministic, no atomics): ``_swiglu_quant_kernel``
  (g, u -> bf16, SwiGLU, routing weight, bf16 h, 1x128 act-quant) after gate-up,
  ``_combine_splits_kernel`` (y -> bf16 per pair, then the k choices in order) after down.

Launches: act-quant, gate-up GEMV, SwiGLU + quant, down GEMV, combine.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import (
    e2m1_times_2m14, e4m3_decode, exp2_int, native, quant_block_e4m3, round_bf16,
)
from dsv4_backend.kernels.fp8_gemm import act_quant_fp8
from dsv4_backend.kernels import pdl
from dsv4_backend.kernels.pdl import wait as pdl_wait

ID_CHUNK = 64  # ids scanned per step when a program looks for its expert's pairs


class GemvConfig(NamedTuple):
    block_n: int = 32  # weight rows per program
    block_k: int = 128  # K step, a multiple of 32 (one scale block per thread and row)
    split_k: int = 1  # K splits (each a whole number of K steps); partials summed in order
    num_warps: int = 4
    num_stages: int = 2
    decode: str = "f16"  # nibble -> fp32: "f16" / "e4m3" (bit moves + a hardware conversion), "lut"


DECODES = {"f16": 0, "e4m3": 1, "lut": 2}


def pick_gemv_configs(num_pairs: int) -> tuple[GemvConfig, GemvConfig]:
    """(gate-up, down) launch shapes, from the H200 sweep of ``bench/gpu_moe_sweep.py``
    (docs/PERF.md): one token (6 pairs) streams best with K split in four for gate-up (16-row
    tiles, 256-deep K steps) and in two for down; up to four tokens, 256-deep steps split in two."""
    if num_pairs <= 12:
        return GemvConfig(16, 256, 4, 2, 2), GemvConfig(32, 128, 2, 2, 2)
    return GemvConfig(32, 256, 2, 4, 2), GemvConfig(32, 256, 2, 4, 2)


# ---- pieces --------------------------------------------------------------------------------

@triton.jit
def _count_same(ids_ptr, e, lo, hi, CH: tl.constexpr):
    """Number of pairs j in [lo, hi) with ids[j] == e."""
    count = 0
    for j0 in range(lo, hi, CH):
        j = j0 + tl.arange(0, CH)
        same = (tl.load(ids_ptr + j, mask=j < hi, other=-1).to(tl.int32) == e) & (j < hi)
        count += tl.sum(same.to(tl.int32), axis=0)
    return count


@triton.jit
def _expert_of_program(ids_ptr, P, E, CH: tl.constexpr):
    """This program's pair b = program_id(0): (its expert e, clamped into [0, E); the number of
    pairs routed to e if b is the first of them and e is valid, else 0)."""
    b = tl.program_id(0)
    e = tl.load(ids_ptr + b).to(tl.int32)
    valid = (e >= 0) & (e < E)
    first = valid & (_count_same(ids_ptr, e, 0, tl.where(valid, b, 0), CH) == 0)
    n_rows = _count_same(ids_ptr, e, b, tl.where(first, P, b), CH)
    return tl.minimum(tl.maximum(e, 0), E - 1), n_rows


@triton.jit
def _nth_pair(ids_ptr, lo, P, e, r, CH: tl.constexpr):
    """Flat index of the r-th pair (in pair order, from pair lo on) routed to expert e."""
    seen = 0
    found = 0
    for j0 in range(lo, P, CH):
        j = j0 + tl.arange(0, CH)
        same = (tl.load(ids_ptr + j, mask=j < P, other=-1).to(tl.int32) == e) & (j < P)
        rank = seen + tl.cumsum(same.to(tl.int32), axis=0) - 1
        found += tl.sum(tl.where(same & (rank == r), j, 0), axis=0)
        seen += tl.sum(same.to(tl.int32), axis=0)
    return found


@triton.jit
def _nibbles(b, lut_ptr, DECODE: tl.constexpr, NATIVE: tl.constexpr):
    """Bytes (int32) -> (low, high) nibble values in fp32 times 2^-14 (DECODE 0: the nibble's
    exponent and mantissa bits moved to an fp16's), 2^-6 (1: to an e4m3's, 0.5 its subnormal) or
    1 (2: read from the 16-entry table at lut_ptr, one 64-byte line that stays in L1)."""
    if DECODE == 0:
        lo = e2m1_times_2m14(b & 15)
        hi = e2m1_times_2m14(b >> 4)
    elif DECODE == 1:
        lo = e4m3_decode((((b & 7) << 2) | ((b & 8) << 4)).to(tl.uint8), NATIVE)
        hi = e4m3_decode((((b >> 2) & 0x1C) | (b & 0x80)).to(tl.uint8), NATIVE)
    else:
        lo = tl.load(lut_ptr + (b & 15))
        hi = tl.load(lut_ptr + (b >> 4))
    return lo, hi


@triton.jit
def _fp4_gemv_kernel(a_ptr, as_ptr, ids_ptr, w_ptr, ws_ptr, lut_ptr, part_ptr,
                     P, E, N, K, a_sr, as_sr, w_se, w_sr, ws_se, ws_sr, k_per_split,
                     ROW_DIV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DECODE: tl.constexpr, NATIVE: tl.constexpr, CH: tl.constexpr, PDL: tl.constexpr):
    """part[split, pair, n] = sum over this split's K of act[pair // ROW_DIV] . w[e][n] (fp32),
    for every pair routed to this program's expert e (the activation row of a pair is its token
    for gate-up, ROW_DIV = k, and its own row for down, ROW_DIV = 1)."""
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    e, n_rows = _expert_of_program(ids_ptr, P, E, CH)
    e64 = e.to(tl.int64)
    split = tl.program_id(2)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    KB: tl.constexpr = BLOCK_K // 32
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    kb = tl.arange(0, KB)
    c = tl.arange(0, 16)
    w_tile = (w_ptr + e64 * w_se + n.to(tl.int64)[:, None, None] * w_sr
              + (kb * 16)[None, :, None] + c[None, None, :])   # [BLOCK_N, KB, 16] bytes at K = 0
    s_tile = ws_ptr + e64 * ws_se + n.to(tl.int64)[:, None] * ws_sr + kb[None, :]   # [BLOCK_N, KB]
    if DECODE == 0:  # the e8m0 bias less the decode's offset
        s_bias = 127 - 14
    elif DECODE == 1:
        s_bias = 127 - 6
    else:
        s_bias = 127
    for r in range(0, n_rows):
        pair = _nth_pair(ids_ptr, tl.program_id(0), P, e, r, CH)
        row = (pair // ROW_DIV).to(tl.int64)
        a_row = a_ptr + row * a_sr + (kb * 32)[:, None] + 2 * c[None, :]   # [KB, 16] even K
        acc = tl.zeros((BLOCK_N, KB), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kmask = (k0 + kb * 32) < k_hi
            m3 = nmask[:, None, None] & kmask[None, :, None]
            b = tl.load(w_tile + tl.multiple_of(k0 // 2, 16), mask=m3, other=0).to(tl.int32)
            sb = tl.load(s_tile + k0 // 32, mask=nmask[:, None] & kmask[None, :], other=127).to(tl.int32)
            ae = e4m3_decode(tl.load(a_row + k0, mask=kmask[:, None], other=0), NATIVE)
            ao = e4m3_decode(tl.load(a_row + k0 + 1, mask=kmask[:, None], other=0), NATIVE)
            xs = tl.load(as_ptr + row * as_sr + (k0 + kb * 32) // 128, mask=kmask, other=0.0)
            lo, hi = _nibbles(b, lut_ptr, DECODE, NATIVE)
            dot32 = tl.sum(lo * ae[None, :, :] + hi * ao[None, :, :], axis=2)   # [BLOCK_N, KB]
            acc += dot32 * (exp2_int(sb - s_bias) * xs[None, :])
        dest = part_ptr + (split * P + pair).to(tl.int64) * N + n
        tl.store(dest, tl.sum(acc, axis=1), mask=nmask)


@triton.jit
def _swiglu_quant_kernel(part_ptr, ids_ptr, wts_ptr, hq_ptr, hs_ptr, P, E, I, limit,
                         SPLIT: tl.constexpr, ROUTED: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    """Per (pair, 128 columns of I): g, u = the split sums in order, rounded to bf16; h =
    bf16(silu(min(g, limit)) clamp(u, +-limit) weight) and its 1x128 act-quant (0 for a skipped pair;
    not ROUTED: every row valid, weight 1)."""
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    pair = tl.program_id(0)
    col = tl.program_id(1) * 128 + tl.arange(0, 128)
    if ROUTED:
        e = tl.load(ids_ptr + pair)
        ok = (e >= 0) & (e < E)
    else:
        ok = pair >= 0
    base = part_ptr + pair.to(tl.int64) * (2 * I) + col
    g = tl.load(base, mask=ok & (col < I), other=0.0).to(tl.float32)
    u = tl.load(base + I, mask=ok & (col < I), other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLIT):
        g += tl.load(base + s * P * (2 * I), mask=ok & (col < I), other=0.0).to(tl.float32)
        u += tl.load(base + s * P * (2 * I) + I, mask=ok & (col < I), other=0.0).to(tl.float32)
    g = tl.minimum(round_bf16(g, NATIVE), limit)
    u = tl.minimum(tl.maximum(round_bf16(u, NATIVE), -limit), limit)
    h = g / (1.0 + tl.exp(-g)) * u
    if ROUTED:
        h = h * tl.load(wts_ptr + pair)
    h = round_bf16(h, NATIVE)
    h = tl.where(ok & (col < I), h, 0.0)
    codes, scale = quant_block_e4m3(h[None, :], NATIVE)
    tl.store(hq_ptr + pair.to(tl.int64) * I + col[None, :], codes, mask=(col < I)[None, :])
    tl.store(hs_ptr + pair * (I // 128) + tl.program_id(1) + tl.arange(0, 1), scale)


@triton.jit
def _combine_splits_kernel(part_ptr, ids_ptr, out_ptr, sh_ptr, sh_ss, P, D, E, TOPK: tl.constexpr,
                           SPLIT: tl.constexpr, SHARED: tl.constexpr, SH_SPLIT: tl.constexpr,
                           BLOCK_D: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    """out[t] = bf16 of the sum over valid j, in order, of bf16(sum over splits, in order, of
    part[s, t k + j]); with SHARED, the shared expert's row t of ``sh`` (fp32 partials, split
    stride ``sh_ss``: rows of ``part`` itself in ``moe_bf16_decode``, the FP8 GEMM's partials in
    ``fp4_mma.fp4_moe_mma``) is summed over its SH_SPLIT splits too and out[t] =
    bf16(bf16(shared) + that routed sum)."""
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        e = tl.load(ids_ptr + t * TOPK + j)
        m = dmask & (e >= 0) & (e < E)
        base = part_ptr + (t * TOPK + j) * D + d
        y = tl.load(base, mask=m, other=0.0).to(tl.float32)
        for s in tl.static_range(1, SPLIT):
            y += tl.load(base + s * P * D, mask=m, other=0.0).to(tl.float32)
        acc += round_bf16(y, NATIVE)
    out = round_bf16(acc, NATIVE)
    if SHARED:
        base = sh_ptr + t * D + d
        y = tl.load(base, mask=dmask, other=0.0).to(tl.float32)
        for s in tl.static_range(1, SH_SPLIT):
            y += tl.load(base + s * sh_ss, mask=dmask, other=0.0).to(tl.float32)
        out = round_bf16(round_bf16(y, NATIVE) + out, NATIVE)
    tl.store(out_ptr + t * D + d, out.to(tl.bfloat16), mask=dmask)


# ---- entry points --------------------------------------------------------------------------

_TABLES: dict[torch.device, torch.Tensor] = {}


def e2m1_table(device: torch.device) -> torch.Tensor:
    """fp32 [16]: the e2m1 value of each nibble code (bit 3 the sign), made with device ops only
    (no host copy, so a first call inside CUDA-graph capture works) and kept per device."""
    if device not in _TABLES:
        code = torch.arange(16, device=device)
        mag = code & 7
        e, m = mag >> 1, (mag & 1).float()
        p2 = (torch.ones_like(e) << (e - 1).clamp(min=0)).float()  # 2^(e-1), exact (no torch.pow)
        v = torch.where(e == 0, 0.5 * m, p2 * (1 + 0.5 * m))
        _TABLES[device] = torch.where(code >= 8, -v, v).contiguous()
    return _TABLES[device]


def _splits(K: int, cfg: GemvConfig) -> tuple[int, int]:
    """(K per split, number of splits): whole K steps per split, no empty split."""
    if cfg.decode not in DECODES:
        raise ValueError(f"fp4_moe decode: decode={cfg.decode!r}, one of {sorted(DECODES)}")
    if cfg.block_k % 32 or cfg.block_k <= 0:
        raise ValueError(f"fp4_moe decode: block_k={cfg.block_k} must be a positive multiple of 32")
    if cfg.block_n <= 0 or cfg.block_n & (cfg.block_n - 1):
        raise ValueError(f"fp4_moe decode: block_n={cfg.block_n} must be a power of two")
    if cfg.block_k & (cfg.block_k - 1):
        raise ValueError(f"fp4_moe decode: block_k={cfg.block_k} must be a power of two")
    steps = triton.cdiv(K, cfg.block_k)
    per = triton.cdiv(steps, max(1, cfg.split_k)) * cfg.block_k
    return per, triton.cdiv(K, per)


def fp4_gemv(act_q: torch.Tensor, act_s: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
             w_scale: torch.Tensor, row_div: int, cfg: GemvConfig) -> torch.Tensor:
    """fp32 partials [splits, P, N] of act . w[e]^T for every valid pair (rows of skipped pairs
    unset): act_q e4m3 [R, K] with 1x128 scales act_s fp32 [R, K/128], pair p's activation row
    p // row_div; ids int [P] (flat); w uint8 [E, N, K/2], w_scale uint8 [E, N, K/32]."""
    E, N, half = w.shape
    K = 2 * half
    P = ids.numel()
    per, split = _splits(K, cfg)
    part = torch.empty(split, P, N, dtype=torch.float32, device=w.device)
    grid = (P, triton.cdiv(N, cfg.block_n), split)
    _fp4_gemv_kernel[grid](
        act_q.view(torch.uint8), act_s, ids, w, w_scale, e2m1_table(w.device), part, P, E, N, K,
        act_q.stride(0), act_s.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1), per,
        ROW_DIV=row_div, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DECODE=DECODES[cfg.decode], NATIVE=native(),
        CH=ID_CHUNK, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.args(act_q.view(torch.uint8).device))
    return part


def swiglu_quant(part: torch.Tensor, ids: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                 num_experts: int, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate-up partials [splits, P, 2I] (fp32, or bf16 rows with one split) -> (hq e4m3 [P, I],
    hs fp32 [P, I/128]) at each pair's row.
    ``ids`` and ``weights`` None: rows of one unrouted expert (the shared expert), every row
    valid and weight 1 (an exact factor: the same codes as ids 0 and weights 1)."""
    split, P, I2 = part.shape
    I = I2 // 2
    routed = ids is not None
    if routed != (weights is not None):
        raise ValueError("swiglu_quant: ids and weights are given together or not at all")
    hq = torch.empty(P, I, dtype=torch.float8_e4m3fn, device=part.device)
    hs = torch.empty(P, I // 128, dtype=torch.float32, device=part.device)
    _swiglu_quant_kernel[(P, I // 128)](
        part, ids if routed else part, weights if routed else part, hq.view(torch.uint8), hs, P, num_experts, I,
        float(limit), SPLIT=split, ROUTED=routed, NATIVE=native(), num_warps=4, **pdl.args(part.device))
    return hq, hs


def combine_splits(part: torch.Tensor, ids: torch.Tensor, num_experts: int,
                   shared: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Down partials [splits, T k, D] (fp32, or bf16 rows with one split) -> out [T, D] bf16
    (the contract's combine); ``shared``: a shared expert's fp32 down partials [splits', T, D],
    added as ``bf16(bf16(shared) + routed)`` (the unfused ``shared + routed`` of two bf16s)."""
    split, P, D = part.shape
    T, k = ids.shape
    if shared is not None and (shared.dim() != 3 or shared.shape[1:] != (T, D) or shared.dtype != torch.float32
                               or not shared.is_contiguous()):
        raise ValueError(f"combine_splits: shared must be contiguous fp32 [splits, {T}, {D}], got "
                         f"{shared.dtype} {tuple(shared.shape)}")
    out = torch.empty(T, D, dtype=torch.bfloat16, device=part.device)
    block_d = 1024
    sh = part if shared is None else shared
    _combine_splits_kernel[(T, triton.cdiv(D, block_d))](
        part, ids, out, sh, T * D, P, D, num_experts, TOPK=k, SPLIT=split, SHARED=shared is not None,
        SH_SPLIT=sh.shape[0], BLOCK_D=block_d, NATIVE=native(), num_warps=4, **pdl.args(part.device))
    return out


def fp4_moe_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                   w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, limit: float,
                   gate_up: GemvConfig, down: GemvConfig) -> torch.Tensor:
    """``fp4_moe`` for decode sizes (inputs already checked by it): x [T, D] bf16, ids [T, k],
    weights fp32 [T, k] -> [T, D] bf16. No host synchronisation; the grids depend on T k only."""
    E = w13.shape[0]
    flat = ids.reshape(-1).contiguous()
    xq, xs = act_quant_fp8(x)
    part = fp4_gemv(xq, xs, flat, w13, w13_scale, ids.shape[1], gate_up)
    hq, hs = swiglu_quant(part, flat, weights.reshape(-1).contiguous(), E, limit)
    part = fp4_gemv(hq, hs, flat, w2, w2_scale, 1, down)
    return combine_splits(part, ids.contiguous(), E)

