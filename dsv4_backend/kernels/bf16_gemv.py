"""bf16 projections of one row (batch-1 decode steps) as one streaming GEMV launch, plain or grouped.

At one row a bf16 linear ``x @ W^T`` is a read of W: the bf16 benchmark model's attention
projections (``wq_b`` 64 MB, ``wo_a`` 64 MB grouped, ``wo_b`` 64 MB a layer) took 18.5-22 us each
in cuBLAS at batch 1 on the H200 (~80% of copy bandwidth), plus a split-K reduction launch for
some of them (docs/PERF.md, session 13). Here one program owns ``BLOCK_N`` rows of W and streams
them over all of K (``BLOCK_K`` columns a step, pipelined), accumulating the products with x
element-wise in fp32 registers (the bf16 MoE decode GEMV's pattern, ~89% of copy bandwidth at batch
1); the sum is rounded to bf16 once, as a bf16 GEMM with fp32 accumulation stores it.
Only the order of the fp32 sum differs from cuBLAS (``tests/test_bf16_gemv.py`` bounds it).

float32 out (``out_dtype``): the fp32 sum stored as it is, what ``torch.mm(..., out_dtype=float32)``
computes for the compressors' projections of a bf16 row (``layers/fp32_products.py``); cuBLAS
runs those at one row as a split-K GEMM and a reduction, two launches that take no programmatic
dependent launch (``pdl.py``), this one launch does.

``scale`` (bf16 out): ``y`` rounded to bf16, times the scalar in fp32 and rounded again, what
``bf16_linear(x) * scale`` gives in torch (the indexer's head weights) without the extra launch.

Grouped (``wo_a``): W ``[G * R, Kg]`` holds G groups of R rows; group g's rows multiply x's
columns ``g Kg .. (g + 1) Kg`` (``einsum("tgi,gri->tgr")`` with x viewed ``[1, G, Kg]``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import check_device, native, round_bf16
from dsv4_backend.kernels.kv_store import sm_count
from dsv4_backend.kernels import pdl
from dsv4_backend.kernels.pdl import wait as pdl_wait


class GemvConfig(NamedTuple):
    block_n: int = 16   # W rows a program (gemv_config: 8 for narrow W)
    block_k: int = 512  # K columns a step
    num_warps: int = 4
    num_stages: int = 3


def gemv_config(N: int, sms: int) -> GemvConfig:
    """16 rows a program where that still gives two programs per SM, else 8; fewer below 1024
    rows (a compressor's narrow projections, the indexer's 64 head weights), for more programs
    streaming."""
    if N < 256:
        return GemvConfig(block_n=2, block_k=256, num_warps=2)
    return GemvConfig(block_n=16 if N >= 32 * sms else 8 if N >= 1024 else 4)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, w_sr, y_ptr, N, K, GROUP_ROWS, scale,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, NATIVE: tl.constexpr,
                 OUT_FP32: tl.constexpr, SCALED: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    # program i: rows [i BLOCK_N, (i + 1) BLOCK_N) of W times x's columns of their group; the
    # products accumulate element-wise in fp32 and are summed once at the end
    n0 = tl.program_id(0) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < N
    xg = x_ptr + (n0 // GROUP_ROWS).to(tl.int64) * K
    rows = w_ptr + n.to(tl.int64)[:, None] * w_sr
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = (k0 + kk) < K
        w = tl.load(rows + (k0 + kk)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(xg + k0 + kk, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if SCALED:    # the bf16 product times scale, rounded to bf16 again (stored exactly in either dtype)
        y = round_bf16(round_bf16(y, NATIVE) * scale, NATIVE)
    elif not OUT_FP32:
        y = round_bf16(y, NATIVE)   # rounded here: the interpreter's cast truncates
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def bf16_gemv(x: torch.Tensor, w: torch.Tensor, groups: int = 1, config: GemvConfig | None = None,
              out_dtype: torch.dtype = torch.bfloat16, scale: float | None = None) -> torch.Tensor:
    """``x @ w^T`` for one row (``groups`` = 1), or the grouped product (x ``[1, groups * Kg]``, w
    ``[groups * R, Kg]`` -> ``[1, groups * R]``: group g's rows times x's g-th Kg columns), bf16
    in, fp32 sums, out in ``out_dtype`` (bf16 or float32). w: row-contiguous. ``scale``: the bf16
    result times it, rounded to bf16 again (in a float32 output too: the same values, no cast
    launch for a caller that wants them in fp32)."""
    if x.dim() != 2 or w.dim() != 2 or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise ValueError(f"bf16_gemv: x and w must be 2-D bf16, got {x.dtype} {tuple(x.shape)} and "
                         f"{w.dtype} {tuple(w.shape)}")
    M, K = x.shape
    N, Kg = w.shape
    if M != 1 or groups < 1 or K != groups * Kg or N % groups:
        raise ValueError(f"bf16_gemv: x {tuple(x.shape)} and w {tuple(w.shape)} do not fit one row and "
                         f"{groups} group(s)")
    if w.stride(1) != 1:
        raise ValueError("bf16_gemv: w needs contiguous rows")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"bf16_gemv: out_dtype must be bf16 or float32, got {out_dtype}")
    check_device(x, w)
    if config is None:
        config = gemv_config(N, sm_count(x.device))
    R = N // groups
    if groups > 1 and R % config.block_n:
        raise ValueError(f"bf16_gemv: block_n {config.block_n} must divide a group's {R} rows")
    x = x.contiguous()
    y = torch.empty(1, N, dtype=out_dtype, device=x.device)
    if N:
        _gemv_kernel[(triton.cdiv(N, config.block_n),)](
            x, w, w.stride(0), y, N, Kg, R if groups > 1 else max(N, 1), 1.0 if scale is None else float(scale),
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, NUM_STAGES=config.num_stages, NATIVE=native(),
            OUT_FP32=out_dtype == torch.float32, SCALED=scale is not None, num_warps=config.num_warps, **pdl.args(x.device))
    return y
