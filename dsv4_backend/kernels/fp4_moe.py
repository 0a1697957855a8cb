"""Routed experts with FP4 (e2m1) weights: grouped gate-up + SwiGLU, grouped down projection, combine.

At decode sizes (T k <= ``MoeConfig.decode_max_pairs``) ``fp4_moe`` runs the split-K GEMVs of
``fp4_moe_decode`` instead (same contract); what follows is the grouped tensor-core path.

Semantics (QUANT_INTERFACE.md; ``docs/kernels.md``): x is act-quantised (1x128 e4m3 blocks); per
(token t, choice j) with expert e = ids[t, j]:
g, u = (xq xs) . w13[e] (fp32 sums, rounded to bf16); h = silu(min(g, limit)) clamp(u, +-limit)
weights[t, j] (fp32, rounded to bf16); h is act-quantised; y_tj = (hq hs) . w2[e] (fp32, bf16);
out[t] = sum_j y_tj in fp32, j = 0..k-1 in order, cast to bf16.
ids outside [0, E) (CUDA-graph padding) are skipped: their y_tj counts as 0.

Weights (e2m1 nibbles, low nibble = even K index; e8m0 scale per 32 along K) are converted in
registers to bf16 with the scale applied: e2m1 x 2^s and e4m3 x 2^s are exact in bf16, so every
product is exact in the fp32 accumulator (W4A16 on the tensor cores, activations dequantised
from their e4m3 codes). At decode the weight bytes and their conversion, not the MMA rate, set
the time (not yet measured: see docs/kernels.md).

Routing, on the device (no host sync, CUDA-graph capturable): the (t, j) pairs are sorted by
expert (stable), per-expert row ranges come from ``searchsorted``, and the rows of each expert
are cut into blocks of ``block_m``. The grid is the worst case, ``cdiv(P, block_m) + min(E, P)``
blocks x N-tiles; blocks past the last one used run no K step and store nothing. A program owns
one (row block, N-tile), so at decode every selected expert's weight tile is read once per step.

1. ``_gate_up_kernel``: a program per (row block, 128 columns of I) computes the g and u tiles,
   the SwiGLU, the routing weight and the 1x128 act-quant of h in its epilogue (128 columns =
   one quantisation block) -> hq e4m3 [P, I], hs fp32 [P, I/128] in sorted row order.
2. ``_down_kernel``: a program per (row block, block_n columns of D) -> y bf16 [P, D] at the
   pair's own position t * k + j.
3. ``moe_combine`` (``fp4_moe_decode``'s combine, one split): out[t] = sum_j y[t * k + j] in
   order (deterministic, no atomics).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import (
    check_device, dot_dtype, e2m1_times_2m14, e4m3_decode, exp2_int, interpreting, native, quant_block_e4m3,
    round_bf16,
)
from dsv4_backend.kernels.fp4_moe_decode import GemvConfig, combine_splits, fp4_moe_decode, pick_gemv_configs
from dsv4_backend.kernels.fp8_gemm import act_quant_fp8


class MoeConfig(NamedTuple):
    block_m: int = 16  # routed rows per program (one expert's)
    block_k: int = 128  # K step (a multiple of 32 dividing 128)
    block_n: int = 128  # down projection: D columns per program (gate-up: always 128 of I)
    num_warps: int = 4
    num_stages: int = 3
    # the K tile as two half-depth products, even K (low nibbles) and odd K (high nibbles): no
    # nibble interleave in registers; False: one product on the interleaved tile
    split_nibbles: bool = False
    # the weight tile is the MMA's M side (128 weight rows x block_m token columns): at decode no
    # MMA work goes to padded token rows
    swap_ab: bool = False
    # weights decoded straight to bf16 bit patterns with the scale added to the exponent (integer
    # operations only); False: via fp16, times the scale in fp32, converted to bf16
    int_decode: bool = False
    # routing in one Triton launch (``route_fused``) when T k <= ROUTE_FUSED_MAX_PAIRS
    fused_route: bool = True
    # T k <= decode_max_pairs: the split-K GEMVs of ``fp4_moe_decode`` instead of the grouped
    # tensor-core kernels (the fields above then do not apply); None: ``pick_gemv_configs``.
    # 24 = four tokens of top-6: on the H200 the GEMVs were faster up to T = 4 (108 vs 192 us at
    # T = 1) and slower from T = 16 (1291 vs 1088 us), docs/PERF.md
    decode_max_pairs: int = 24
    gemv_gate_up: GemvConfig | None = None
    gemv_down: GemvConfig | None = None


def pick_moe_config(num_pairs: int, num_experts: int) -> MoeConfig:
    """Shape rule: rows per expert ~ pairs / experts; tiles just cover that (16 at decode)."""
    rows = num_pairs / max(num_experts, 1)
    if rows <= 16:
        return MoeConfig(16, 128, 128, 4, 3)
    if rows <= 64:
        return MoeConfig(64, 64, 128, 8, 3)
    return MoeConfig(128, 64, 128, 8, 3)


class Routing(NamedTuple):
    order: torch.Tensor  # int64 [P]: pair index (t * k + j) of each sorted row
    offsets: torch.Tensor  # int64 [E + 1]: expert e's sorted rows are offsets[e] .. offsets[e+1]-1
    block_expert: torch.Tensor  # int64 [G]: expert of each row block (>= E: unused block)
    block_row0: torch.Tensor  # int64 [G]: first sorted row of each row block


def route(ids: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """Sort the (token, choice) pairs by expert and cut each expert's rows into blocks, on the device."""
    flat = ids.reshape(-1)
    P = flat.numel()
    dev = flat.device
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    sorted_key, order = torch.sort(key, stable=True)
    experts = torch.arange(num_experts + 1, device=dev, dtype=sorted_key.dtype)
    offsets = torch.searchsorted(sorted_key, experts)
    nblk = (offsets[1:] - offsets[:-1] + block_m - 1) // block_m
    blk_end = torch.cumsum(nblk, 0)
    G = triton.cdiv(P, block_m) + min(num_experts, P)
    blocks = torch.arange(G, device=dev, dtype=blk_end.dtype)
    block_expert = torch.searchsorted(blk_end, blocks, right=True)
    e = block_expert.clamp(max=num_experts - 1)
    block_row0 = offsets[e] + (blocks - (blk_end[e] - nblk[e])) * block_m
    return Routing(order, offsets, block_expert, block_row0)


ROUTE_FUSED_MAX_PAIRS = 512  # route_fused keeps every pair's key in each program's registers
ROUTE_CHUNK = 32


@triton.jit
def _route_kernel(ids_ptr, order_ptr, off_ptr, blk_e_ptr, blk_r0_ptr, P, E, G,
                  BLOCK_M: tl.constexpr, PP: tl.constexpr, EP: tl.constexpr, CH: tl.constexpr):
    """Program p: the sorted positions of pairs [p CH, (p + 1) CH) (stable rank by key), row
    blocks [p CH, (p + 1) CH), and (p = 0) the offsets. Keys: the expert, E for a skipped pair,
    EP - 1 past P (a bin no real key uses: EP >= E + 2)."""
    j = tl.arange(0, PP)
    raw = tl.load(ids_ptr + j, mask=j < P, other=0)
    key = tl.where((raw >= 0) & (raw < E), raw, E).to(tl.int32)
    key = tl.where(j < P, key, EP - 1)
    ev = tl.arange(0, EP)
    counts = tl.histogram(key, EP)
    offsets = tl.cumsum(counts, axis=0) - counts  # exclusive: offsets[e] = #(key < e)
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(off_ptr + ev, offsets.to(tl.int64), mask=ev <= E)
    i = pid * CH + tl.arange(0, CH)
    ki = tl.load(ids_ptr + i, mask=i < P, other=0)
    ki = tl.where((ki >= 0) & (ki < E), ki, E).to(tl.int32)
    ahead = (key[None, :] < ki[:, None]) | ((key[None, :] == ki[:, None]) & (j[None, :] < i[:, None]))
    rank = tl.sum(ahead.to(tl.int32), axis=1)
    tl.store(order_ptr + rank, i.to(tl.int64), mask=i < P)
    nblk = tl.where(ev < E, (counts + BLOCK_M - 1) // BLOCK_M, 0)
    blk_end = tl.cumsum(nblk, axis=0)
    b = pid * CH + tl.arange(0, CH)
    be = tl.sum(((blk_end[None, :] <= b[:, None]) & (ev < E)[None, :]).to(tl.int32), axis=1)
    sel = ev[None, :] == tl.minimum(be, E - 1)[:, None]
    first_row = tl.sum(tl.where(sel, offsets[None, :], 0), axis=1)
    first_blk = tl.sum(tl.where(sel, (blk_end - nblk)[None, :], 0), axis=1)
    r0 = first_row.to(tl.int64) + (b - first_blk).to(tl.int64) * BLOCK_M
    tl.store(blk_e_ptr + b, be.to(tl.int64), mask=b < G)
    tl.store(blk_r0_ptr + b, r0, mask=b < G)


def route_fused(ids: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """``route`` in one launch, the same tensors bit for bit, for T k <= ROUTE_FUSED_MAX_PAIRS:
    a pair's sorted position is the number of pairs with a smaller key or an equal key and a
    smaller index (stable), offsets are the exclusive prefix sum of the key histogram."""
    flat = ids.reshape(-1)
    P = flat.numel()
    if P > ROUTE_FUSED_MAX_PAIRS:
        raise ValueError(f"route_fused: {P} pairs, at most {ROUTE_FUSED_MAX_PAIRS}")
    E = num_experts
    G = triton.cdiv(P, block_m) + min(E, P)
    dev = flat.device
    order = torch.empty(P, dtype=torch.int64, device=dev)
    offsets = torch.empty(E + 1, dtype=torch.int64, device=dev)
    block_expert = torch.empty(G, dtype=torch.int64, device=dev)
    block_row0 = torch.empty(G, dtype=torch.int64, device=dev)
    CH = ROUTE_CHUNK
    _route_kernel[(triton.cdiv(max(P, G), CH),)](
        flat, order, offsets, block_expert, block_row0, P, E, G, BLOCK_M=block_m,
        PP=max(triton.next_power_of_2(P), 16), EP=triton.next_power_of_2(E + 2), CH=CH, num_warps=8)
    return Routing(order, offsets, block_expert, block_row0)


def route_pairs(ids: torch.Tensor, num_experts: int, block_m: int, fused: bool = True) -> Routing:
    """``route_fused`` where it applies (``fused``, 1 .. ROUTE_FUSED_MAX_PAIRS pairs, tensors the
    kernel can read: CUDA, or the CPU under the interpreter), else ``route``: the same tensors."""
    P = ids.numel()
    if fused and 0 < P <= ROUTE_FUSED_MAX_PAIRS and (ids.is_cuda or interpreting()):
        return route_fused(ids, num_experts, block_m)
    return route(ids, num_experts, block_m)


# ---- in-register conversions --------------------------------------------------------------

@triton.jit
def e2m1_scaled_bits(code, sbyte, NATIVE: tl.constexpr):
    """e2m1 nibble (int32) times the e8m0 scale 2^(sbyte - 127), exact, built as the bf16 bit
    pattern: a normal code 2^(e2 - 1) (1 + m / 2) gets exponent field sbyte - 1 + e2 and
    mantissa bit m; code 1 (0.5) exponent sbyte - 1, no mantissa; code 0 is zero. Valid for
    scale bytes 2..251 (the result stays a normal bf16); returns DOT_DTYPE-ready values (bf16
    on the GPU, fp32 of the same value under the interpreter)."""
    mag = code & 7
    e2 = mag >> 1
    bits = ((sbyte - 1 + e2) << 7) | (tl.where(e2 > 0, mag & 1, 0) << 6)
    bits = tl.where(mag == 0, 0, bits) | ((code & 8) << 12)
    if NATIVE:
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def fp4_weight_tile(w_ptr, w_sr, s_ptr, s_sr, rows, rmask, k0, K,
                    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                    INT_DECODE: tl.constexpr, NATIVE: tl.constexpr):
    """Rows ``rows`` x K indices [k0, k0 + BLOCK_K) of an FP4 matrix (bytes [R, K/2], e8m0
    scales [R, K/32]) -> [BLOCK_R, BLOCK_K] in DOT_DTYPE, scale applied; past K: 0."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    r64 = rows.to(tl.int64)
    b = tl.load(w_ptr + r64[:, None] * w_sr + kb[None, :],
                mask=rmask[:, None] & (kb < K // 2)[None, :], other=0).to(tl.int32)
    codes = tl.reshape(tl.join(b & 15, b >> 4), (BLOCK_R, BLOCK_K))
    ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    sb = tl.load(s_ptr + r64[:, None] * s_sr + ks[None, :],
                 mask=rmask[:, None] & (ks < K // 32)[None, :], other=127).to(tl.int32)
    # one return after an if / else: Triton 3.6 keeps generating the statements after a return
    # inside a constexpr if, so an early return there compiled the other path on its variables
    if INT_DECODE:
        sb_k = tl.reshape(tl.broadcast_to(sb[:, :, None], (BLOCK_R, BLOCK_K // 32, 32)), (BLOCK_R, BLOCK_K))
        tile = e2m1_scaled_bits(codes, sb_k, NATIVE).to(DOT_DTYPE)
    else:
        scale = exp2_int(sb - 127 + 14)  # the e8m0 scale times the 2^14 the decode leaves out
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_R, BLOCK_K // 32, 32)), (BLOCK_R, BLOCK_K))
        tile = (e2m1_times_2m14(codes) * scale).to(DOT_DTYPE)
    return tile


@triton.jit
def fp4_weight_halves(w_ptr, w_sr, s_ptr, s_sr, rows, rmask, k0, K,
                      BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                      INT_DECODE: tl.constexpr, NATIVE: tl.constexpr):
    """The same tile as two [BLOCK_R, BLOCK_K / 2] halves, no shuffle: (even K indices = low
    nibbles, odd = high nibbles); each byte's scale is loaded at its own column (repeated
    addresses, served by L1) instead of being broadcast in registers."""
    c = tl.arange(0, BLOCK_K // 2)
    kb = k0 // 2 + c
    r64 = rows.to(tl.int64)
    mask = rmask[:, None] & (kb < K // 2)[None, :]
    b = tl.load(w_ptr + r64[:, None] * w_sr + kb[None, :], mask=mask, other=0).to(tl.int32)
    sb = tl.load(s_ptr + r64[:, None] * s_sr + (k0 // 32 + c // 16)[None, :], mask=mask, other=127)
    if INT_DECODE:
        lo = e2m1_scaled_bits(b & 15, sb.to(tl.int32), NATIVE).to(DOT_DTYPE)
        hi = e2m1_scaled_bits(b >> 4, sb.to(tl.int32), NATIVE).to(DOT_DTYPE)
    else:
        scale = exp2_int(sb.to(tl.int32) - 127 + 14)
        lo = (e2m1_times_2m14(b & 15) * scale).to(DOT_DTYPE)
        hi = (e2m1_times_2m14(b >> 4) * scale).to(DOT_DTYPE)
    return lo, hi


@triton.jit
def fp8_act_tile(q_ptr, q_sr, s_ptr, s_sr, rows, rmask, k0, K,
                 BLOCK_K: tl.constexpr, STEP: tl.constexpr, OFF: tl.constexpr,
                 NATIVE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Rows x K indices k0 + OFF + STEP * i, i < BLOCK_K / STEP, of e4m3 activations with 1x128
    scales -> DOT_DTYPE values (exact in bf16); past K: 0."""
    kk = k0 + OFF + STEP * tl.arange(0, BLOCK_K // STEP)
    r64 = rows.to(tl.int64)
    q = tl.load(q_ptr + r64[:, None] * q_sr + kk[None, :], mask=rmask[:, None] & (kk < K)[None, :], other=0)
    s = tl.load(s_ptr + r64 * s_sr + k0 // 128, mask=rmask, other=0.0)
    return (e4m3_decode(q, NATIVE) * s[:, None]).to(DOT_DTYPE)


# ---- kernels ------------------------------------------------------------------------------

@triton.jit
def _mma(a, w, acc, SWAP_AB: tl.constexpr):
    """acc += a [M, K] . w [N, K]^T, held as [M, N] or, swapped, as [N, M] (w the MMA's M side)."""
    if SWAP_AB:
        return tl.dot(w, tl.trans(a), acc)
    else:
        return tl.dot(a, tl.trans(w), acc)


@triton.jit
def _acc_tile(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    if SWAP_AB:
        return tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def _as_rows(acc, SWAP_AB: tl.constexpr):
    if SWAP_AB:
        return tl.trans(acc)
    else:
        return acc


@triton.jit
def _block_rows(order_ptr, blk_e_ptr, blk_r0_ptr, off_ptr, E, BLOCK_M: tl.constexpr):
    """This program's expert, its sorted rows [BLOCK_M], their mask and their pair indices."""
    b = tl.program_id(0)
    e = tl.load(blk_e_ptr + b)
    e_c = tl.minimum(e, E - 1)
    r0 = tl.load(blk_r0_ptr + b)
    end = tl.load(off_ptr + e_c + 1)
    rows = r0 + tl.arange(0, BLOCK_M)
    rmask = (rows < end) & (e < E)
    pairs = tl.load(order_ptr + rows, mask=rmask, other=0)
    return e, e_c.to(tl.int64), rows, rmask, pairs


@triton.jit
def _gate_up_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, wts_ptr, order_ptr, blk_e_ptr, blk_r0_ptr, off_ptr,
                    hq_ptr, hs_ptr, E, D, I, TOPK, limit,
                    w_se, w_sr, ws_se, ws_sr, xs_sr, hs_sr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_NIBBLES: tl.constexpr,
                    SWAP_AB: tl.constexpr, INT_DECODE: tl.constexpr,
                    NATIVE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    e, e64, rows, rmask, pairs = _block_rows(order_ptr, blk_e_ptr, blk_r0_ptr, off_ptr, E, BLOCK_M)
    k_end = tl.where(e < E, D, 0)  # an unused block runs no K step; its stores are masked
    tok = pairs // TOPK
    n = tl.program_id(1) * 128 + tl.arange(0, 128)
    nmask = n < I
    w = w_ptr + e64 * w_se
    ws = ws_ptr + e64 * ws_se
    acc_g = _acc_tile(BLOCK_M, 128, SWAP_AB)
    acc_u = _acc_tile(BLOCK_M, 128, SWAP_AB)
    for k0 in range(0, k_end, BLOCK_K):
        if SPLIT_NIBBLES:
            a_e = fp8_act_tile(xq_ptr, D, xs_ptr, xs_sr, tok, rmask, k0, D, BLOCK_K, 2, 0, NATIVE, DOT_DTYPE)
            a_o = fp8_act_tile(xq_ptr, D, xs_ptr, xs_sr, tok, rmask, k0, D, BLOCK_K, 2, 1, NATIVE, DOT_DTYPE)
            g_e, g_o = fp4_weight_halves(w, w_sr, ws, ws_sr, n, nmask, k0, D, 128, BLOCK_K, DOT_DTYPE,
                                         INT_DECODE, NATIVE)
            u_e, u_o = fp4_weight_halves(w, w_sr, ws, ws_sr, n + I, nmask, k0, D, 128, BLOCK_K, DOT_DTYPE,
                                         INT_DECODE, NATIVE)
            acc_g = _mma(a_o, g_o, _mma(a_e, g_e, acc_g, SWAP_AB), SWAP_AB)
            acc_u = _mma(a_o, u_o, _mma(a_e, u_e, acc_u, SWAP_AB), SWAP_AB)
        else:
            a = fp8_act_tile(xq_ptr, D, xs_ptr, xs_sr, tok, rmask, k0, D, BLOCK_K, 1, 0, NATIVE, DOT_DTYPE)
            wg = fp4_weight_tile(w, w_sr, ws, ws_sr, n, nmask, k0, D, 128, BLOCK_K, DOT_DTYPE,
                                 INT_DECODE, NATIVE)
            wu = fp4_weight_tile(w, w_sr, ws, ws_sr, n + I, nmask, k0, D, 128, BLOCK_K, DOT_DTYPE,
                                 INT_DECODE, NATIVE)
            acc_g = _mma(a, wg, acc_g, SWAP_AB)
            acc_u = _mma(a, wu, acc_u, SWAP_AB)
    g = tl.minimum(round_bf16(_as_rows(acc_g, SWAP_AB), NATIVE), limit)
    u = tl.minimum(tl.maximum(round_bf16(_as_rows(acc_u, SWAP_AB), NATIVE), -limit), limit)
    wt = tl.load(wts_ptr + pairs, mask=rmask, other=0.0)
    h = round_bf16(g / (1.0 + tl.exp(-g)) * u * wt[:, None], NATIVE)
    h = tl.where(nmask[None, :], h, 0.0)
    codes, scale = quant_block_e4m3(h, NATIVE)
    r64 = rows.to(tl.int64)
    tl.store(hq_ptr + r64[:, None] * I + n[None, :], codes, mask=rmask[:, None] & nmask[None, :])
    tl.store(hs_ptr + r64 * hs_sr + tl.program_id(1), scale, mask=rmask)


@triton.jit
def _down_kernel(hq_ptr, hs_ptr, w_ptr, ws_ptr, order_ptr, blk_e_ptr, blk_r0_ptr, off_ptr, y_ptr,
                 E, D, I, w_se, w_sr, ws_se, ws_sr, hs_sr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_NIBBLES: tl.constexpr, SWAP_AB: tl.constexpr, INT_DECODE: tl.constexpr,
                 NATIVE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    e, e64, rows, rmask, pairs = _block_rows(order_ptr, blk_e_ptr, blk_r0_ptr, off_ptr, E, BLOCK_M)
    k_end = tl.where(e < E, I, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < D
    w = w_ptr + e64 * w_se
    ws = ws_ptr + e64 * ws_se
    acc = _acc_tile(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in range(0, k_end, BLOCK_K):
        if SPLIT_NIBBLES:
            a_e = fp8_act_tile(hq_ptr, I, hs_ptr, hs_sr, rows, rmask, k0, I, BLOCK_K, 2, 0, NATIVE, DOT_DTYPE)
            a_o = fp8_act_tile(hq_ptr, I, hs_ptr, hs_sr, rows, rmask, k0, I, BLOCK_K, 2, 1, NATIVE, DOT_DTYPE)
            w_e, w_o = fp4_weight_halves(w, w_sr, ws, ws_sr, n, nmask, k0, I, BLOCK_N, BLOCK_K, DOT_DTYPE,
                                         INT_DECODE, NATIVE)
            acc = _mma(a_o, w_o, _mma(a_e, w_e, acc, SWAP_AB), SWAP_AB)
        else:
            a = fp8_act_tile(hq_ptr, I, hs_ptr, hs_sr, rows, rmask, k0, I, BLOCK_K, 1, 0, NATIVE, DOT_DTYPE)
            wd = fp4_weight_tile(w, w_sr, ws, ws_sr, n, nmask, k0, I, BLOCK_N, BLOCK_K, DOT_DTYPE,
                                 INT_DECODE, NATIVE)
            acc = _mma(a, wd, acc, SWAP_AB)
    y = round_bf16(_as_rows(acc, SWAP_AB), NATIVE)
    p64 = pairs.to(tl.int64)
    tl.store(y_ptr + p64[:, None] * D + n[None, :], y, mask=rmask[:, None] & nmask[None, :])


# ---- entry points -------------------------------------------------------------------------

def _check_moe_inputs(x, ids, weights, w13, w13_scale, w2, w2_scale):
    T, D = x.shape
    if ids.dim() != 2 or ids.shape[0] != T or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"fp4_moe: ids and weights must be [T={T}, k], got {tuple(ids.shape)} "
                         f"and {tuple(weights.shape)}")
    if weights.dtype != torch.float32:
        raise ValueError(f"fp4_moe: weights must be fp32, got {weights.dtype}")
    if D % 32 != 0:
        raise ValueError(f"fp4_moe: x's width D={D} must be a multiple of 32 (the FP4 scale block)")
    if w13.dim() != 3 or w13.dtype != torch.uint8 or w13.shape[2] * 2 != D or w13.shape[1] % 2:
        raise ValueError(f"fp4_moe: w13 must be uint8 [E, 2I, D/2={D // 2}], got {w13.dtype} {tuple(w13.shape)}")
    E, I2, _ = w13.shape
    I = I2 // 2
    if I % 128 != 0:
        raise ValueError(f"fp4_moe: the expert width I={I} must be a multiple of 128")
    if tuple(w13_scale.shape) != (E, I2, D // 32) or w13_scale.dtype != torch.uint8:
        raise ValueError(f"fp4_moe: w13_scale must be uint8 [{E}, {I2}, {D // 32}], got "
                         f"{w13_scale.dtype} {tuple(w13_scale.shape)}")
    if tuple(w2.shape) != (E, D, I // 2) or w2.dtype != torch.uint8:
        raise ValueError(f"fp4_moe: w2 must be uint8 [{E}, {D}, {I // 2}], got {w2.dtype} {tuple(w2.shape)}")
    if tuple(w2_scale.shape) != (E, D, I // 32) or w2_scale.dtype != torch.uint8:
        raise ValueError(f"fp4_moe: w2_scale must be uint8 [{E}, {D}, {I // 32}], got "
                         f"{w2_scale.dtype} {tuple(w2_scale.shape)}")
    for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        if t.stride(2) != 1:
            raise ValueError(f"fp4_moe: {name} must be dense along its last dimension")
    return E, I


def moe_gate_up(xq, xs, weights, w13, w13_scale, routing: Routing, topk: int, limit: float,
                config: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1: (hq e4m3 [P, I], hs fp32 [P, I/128]) in sorted row order (rows of skipped pairs unset)."""
    E, I2, _ = w13.shape
    I = I2 // 2
    D = xq.shape[1]
    P = routing.order.numel()
    hq = torch.empty(P, I, dtype=torch.float8_e4m3fn, device=xq.device)
    hs = torch.empty(P, I // 128, dtype=torch.float32, device=xq.device)
    grid = (routing.block_expert.numel(), I // 128)
    _gate_up_kernel[grid](
        xq.view(torch.uint8), xs, w13, w13_scale, weights.reshape(-1), routing.order,
        routing.block_expert, routing.block_row0, routing.offsets, hq.view(torch.uint8), hs,
        E, D, I, topk, float(limit),
        w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), xs.stride(0), hs.stride(0),
        BLOCK_M=config.block_m, BLOCK_K=config.block_k, SPLIT_NIBBLES=config.split_nibbles,
        SWAP_AB=config.swap_ab, INT_DECODE=config.int_decode, NATIVE=native(), DOT_DTYPE=_tl_dot_dtype(),
        num_warps=config.num_warps, num_stages=config.num_stages)
    return hq, hs


def moe_down(hq, hs, w2, w2_scale, routing: Routing, config: MoeConfig) -> torch.Tensor:
    """Stage 2: y bf16 [P, D] at each pair's position t * k + j (rows of skipped pairs unset)."""
    E, D, _ = w2.shape
    P, I = hq.shape
    y = torch.empty(P, D, dtype=torch.bfloat16, device=hq.device)
    grid = (routing.block_expert.numel(), triton.cdiv(D, config.block_n))
    _down_kernel[grid](
        hq.view(torch.uint8), hs, w2, w2_scale, routing.order, routing.block_expert,
        routing.block_row0, routing.offsets, y, E, D, I,
        w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), hs.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_NIBBLES=config.split_nibbles, SWAP_AB=config.swap_ab, INT_DECODE=config.int_decode,
        NATIVE=native(), DOT_DTYPE=_tl_dot_dtype(), num_warps=config.num_warps, num_stages=config.num_stages)
    return y


def moe_combine(y: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Stage 3: out [T, D] bf16 = sum_j y[t * k + j] over valid choices, in order j = 0..k-1
    (the decode path's combine with one split)."""
    return combine_splits(y.unsqueeze(0), ids.contiguous(), num_experts)


def _tl_dot_dtype():
    return tl.float32 if dot_dtype() == torch.float32 else tl.bfloat16


def fp4_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
            w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, limit: float,
            config: MoeConfig | None = None) -> torch.Tensor:
    """Routed experts of one MoE layer. x [T, D] bf16, ids int [T, k] (outside [0, E): skipped),
    weights fp32 [T, k], w13 uint8 [E, 2I, D/2] (+ e8m0 scales [E, 2I, D/32]), w2 uint8
    [E, D, I/2] (+ [E, D, I/32]) -> [T, D] bf16. No host synchronisation."""
    check_device(x, ids, weights, w13, w13_scale, w2, w2_scale)
    if x.dim() != 2:
        raise ValueError(f"fp4_moe: x must be [T, D], got {tuple(x.shape)}")
    E, _ = _check_moe_inputs(x, ids, weights, w13, w13_scale, w2, w2_scale)
    T, k = ids.shape
    if T == 0:
        return torch.empty(0, x.shape[1], dtype=torch.bfloat16, device=x.device)
    cfg = config or pick_moe_config(T * k, E)
    if T * k <= cfg.decode_max_pairs:
        auto_up, auto_down = pick_gemv_configs(T * k)
        return fp4_moe_decode(x, ids, weights, w13, w13_scale, w2, w2_scale, limit,
                              cfg.gemv_gate_up or auto_up, cfg.gemv_down or auto_down)
    if 128 % cfg.block_k or cfg.block_k % 32:
        raise ValueError(f"fp4_moe: block_k={cfg.block_k} must be a multiple of 32 dividing 128")
    routing = route_pairs(ids, E, cfg.block_m, cfg.fused_route)
    xq, xs = act_quant_fp8(x)
    hq, hs = moe_gate_up(xq, xs, weights.contiguous(), w13, w13_scale, routing, k, limit, cfg)
    y = moe_down(hq, hs, w2, w2_scale, routing, cfg)
    return moe_combine(y, ids, E)
