"""Routed FP4 experts at prefill sizes: the experts dequantised to bf16, a few at a time, then one
grouped bf16 GEMM per projection (``torch._grouped_mm``: CUTLASS's grouped GEMM on Hopper).

Why: at prefill every expert is selected by hundreds of rows, so the weights are read once per
step whatever the kernel, and the time is the multiply. The MMA kernels of ``fp4_mma`` (``mma.sync``
with the dequantisation in every warp's loop) run those sizes at ~100 TFLOP/s (docs/PERF.md:
T = 4096 in 13.0 ms on the H200, 12.4 ms on an H100), a dense bf16 grouped GEMM at several times that.
The cost is the bf16 copy: each expert's weights are written once as bf16 (4x their FP4 bytes)
and read by the GEMM, a time independent of T; the kernels alone are faster from ~6,700 tokens,
the model's prefill was not (``PREFILL_MIN_TOKENS``: opt-in).

Same contract and rounding points as ``fp4_moe`` (its module docstring): e2m1 x 2^s and e4m3 x 2^s
are exact in bf16, so the GEMM's products are the contract's, summed in fp32 in the library's
order (the bound of the other paths) and rounded once to bf16 (g, u; y); SwiGLU + act-quant and
the combine are ``fp4_moe_decode``'s kernels. Rows are sorted by expert (``fp4_moe.route``); one
host read of the expert offsets per call slices them, so this path runs eagerly, never inside a
CUDA-graph capture (``applies``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import native
from dsv4_backend.kernels.fp4_moe import e2m1_scaled_bits, route
from dsv4_backend.kernels.fp4_moe_decode import combine_splits, swiglu_quant
from dsv4_backend.kernels.fp8_gemm import act_quant_fp8

# tokens from which fp4_mma.fp4_moe_mma takes this path; 0 (the default): never. On an H100
# (docs/PERF.md, session 15) the MoE alone ran 0.67x the MMA kernels' speed at 4,096 tokens and
# 1.16x at 8,192 (22 against 27 ms a layer in the model's prefill), yet the 128K prefill of the
# 11-layer model was no faster with it (17,196 against 17,234 and 17,490 tok/s); why is not
# measured (a suspect: the host read of the offsets each layer idles the GPU until the launches
# after it are queued again)
PREFILL_MIN_TOKENS = int(os.environ.get("DSV4_FP4_PREFILL_MIN_TOKENS", "0"))
DEQUANT_EXPERTS = 16  # experts in bf16 at a time: 16 x 48 MiB (w13 + w2) at Flash's widths
CHUNKS_PER_PROGRAM = 4  # 128-deep chunks of one 16-row tile a dequant program writes


def applies(tokens: int) -> bool:
    """True from PREFILL_MIN_TOKENS tokens (0: never), never while a CUDA graph is captured (the
    host read of the offsets)."""
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    return 0 < PREFILL_MIN_TOKENS <= tokens and not capturing


@triton.jit
def _dequant_kernel(words_ptr, scales_ptr, out_ptr, e0, NT, KC, K, CB: tl.constexpr, NATIVE: tl.constexpr):
    """Program (expert e0 + i, tile, CB chunks): the [16, 128 CB] bf16 tile of w[e] from the
    fragment-order words (``fp4_mma``'s docstring: lane 4 g + t, word 2 G + h, nibble 4 bb + 2 rh + a
    holds row g + 8 rh, column 32 G + 8 t + 4 h + 2 bb + a; register p = rh + 2 bb keeps its e1 e0 m at
    MAG_BIT[p] + 16 a, its sign at SIGN_BIT[p] + 16 a) and the biased scale bytes. Each output
    element finds its word (an L1 gather), so the stores are whole rows."""
    i = tl.program_id(0)
    tile = tl.program_id(1)
    c0 = tl.program_id(2) * CB
    row = tl.arange(0, 16)[:, None]
    col = tl.arange(0, 128 * CB)[None, :]
    c = c0 + col // 128
    k = col % 128
    g, rh = row % 8, row // 8
    G, t, h, bb, a = k // 32, (k % 32) // 8, (k % 8) // 4, (k % 4) // 2, k % 2
    p = rh + 2 * bb
    ok = (c < KC) & (row >= 0)
    tc = ((e0 + i).to(tl.int64) * NT + tile) * KC + c  # the (expert, tile, chunk) index
    word = tl.load(words_ptr + tc * 256 + (4 * g + t) * 8 + 2 * G + h, mask=ok, other=0)
    mag_at = 9 - 3 * p + 16 * a
    sign_at = tl.where(p == 0, 15, tl.where(p == 1, 12, tl.where(p == 2, 14, 13))) + 16 * a
    code = ((word >> mag_at) & 7) | (((word >> sign_at) & 1) << 3)
    sbyte = tl.load(scales_ptr + tc * 64 + row * 4 + G, mask=ok, other=14).to(tl.int32) - 14
    v = e2m1_scaled_bits(code, sbyte, NATIVE)
    dst = out_ptr + (i.to(tl.int64) * NT * 16 + tile * 16 + row) * K + c * 128 + k
    tl.store(dst, v, mask=ok)


def dequant_experts(pack, e0: int, e1: int) -> torch.Tensor:
    """bf16 ``[e1 - e0, N, K]``: experts e0 .. e1-1 of an ``fp4_mma.Fp4MmaPack``, exact (scale bytes
    2..240, as the pack's check and the Triton kernels assume)."""
    N, K = pack.n, pack.k
    NT, KC = N // 16, K // 128
    out = torch.empty(e1 - e0, N, K, dtype=torch.bfloat16, device=pack.words.device)
    if e1 > e0:
        _dequant_kernel[(e1 - e0, NT, triton.cdiv(KC, CHUNKS_PER_PROGRAM))](
            pack.words, pack.scales.view(torch.uint8), out, e0, NT, KC, K, CB=CHUNKS_PER_PROGRAM,
            NATIVE=native(), num_warps=4)
    return out


def dequant_act(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """e4m3 ``[R, K]`` with 1x128 scales -> bf16 ``[R, K]`` (exact: 4 significant bits times a power of two)."""
    return (q.float() * s.repeat_interleave(128, dim=1)).to(torch.bfloat16)


def _grouped(a: torch.Tensor, pack, offsets: list[int], out_cols: int) -> torch.Tensor:
    """bf16 ``[rows, out_cols]``: each expert's sorted rows of ``a`` times its weights^T, the experts
    dequantised DEQUANT_EXPERTS at a time (experts without rows skipped)."""
    E = len(offsets) - 1
    out = torch.empty(a.shape[0], out_cols, dtype=torch.bfloat16, device=a.device)
    for e0 in range(0, E, DEQUANT_EXPERTS):
        e1 = min(E, e0 + DEQUANT_EXPERTS)
        r0, r1 = offsets[e0], offsets[e1]
        if r1 == r0:
            continue
        w = dequant_experts(pack, e0, e1)  # [C, N, K]
        ends = torch.tensor(offsets[e0 + 1:e1 + 1], dtype=torch.int32, device=a.device) - r0
        out[r0:r1] = torch._grouped_mm(a[r0:r1], w.transpose(1, 2), offs=ends, out_dtype=torch.bfloat16)
    return out


def fp4_moe_prefill(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13, w2,
                    limit: float) -> torch.Tensor:
    """``fp4_moe``'s contract over ``fp4_mma`` packs: x ``[T, D]`` bf16, ids ``[T, k]`` (outside
    ``[0, E)``: skipped), weights fp32 ``[T, k]`` -> ``[T, D]`` bf16."""
    T, k = ids.shape
    E = w13.words.shape[0]
    flat = ids.reshape(-1).contiguous()
    r = route(flat, E, 1)
    offsets = r.offsets.tolist()  # the one host read: row ranges of the expert chunks
    rows = offsets[E]             # valid pairs, sorted first
    order = r.order[:rows]
    xq, xs = act_quant_fp8(x)
    a = dequant_act(xq, xs)[order // k]                       # [rows, D], sorted by expert
    gu = _grouped(a, w13, offsets, w13.n)                     # bf16 g, u (the contract's rounding)
    del a
    hq, hs = swiglu_quant(gu[None], flat[order], weights.reshape(-1)[order].contiguous(), E, limit)
    del gu
    y = _grouped(dequant_act(hq, hs), w2, offsets, w2.n)     # bf16 y
    y_pairs = torch.empty(T * k, w2.n, dtype=torch.bfloat16, device=x.device)
    y_pairs[order] = y                                        # back at each pair's row t k + j
    return combine_splits(y_pairs[None], ids.contiguous(), E)
