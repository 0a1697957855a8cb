"""Few-row products ``x @ W^T`` that read a bf16 weight as stored and compute in fp32.

The compressors project the attention input in fp32 (the release's precision, docs/model.md), but
their weights are stored in bf16. ``F.linear(x.float(), W.float())`` first writes an fp32 copy
of W and then reads it back, every decode step: in a CSA layer 2,560 x 4,096 weights, 21 MB read,
42 MB written and 42 MB read again where 21 MB would do. Here each program converts its bf16
weight tile in registers (exact: every bf16 value is an fp32 value), multiplies by x in fp32 and
sums in fp32. The products are those of the copy-then-matmul; only the order of the sums differs.

Launch: one program per ``BLOCK_N`` weight rows and K split; a thread's loads are 8 consecutive
bf16 (16 bytes). The rows of x run one after another in the program (the second and later rows
re-read the weight tile from L1 / L2). Split partials land in fp32 ``[split, M, N]`` and
``fp8_gemm``'s split-sum kernel adds them in split order: deterministic, no atomics.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import check_device, native, round_bf16
from dsv4_backend.kernels.fp8_gemm import _split_sum_kernel

GEMV_MAX_M = 4  # rows of x this kernel is for; more rows: a library matmul


class GemvConfig(NamedTuple):
    block_n: int = 16   # weight rows per program
    block_k: int = 256  # K elements per inner step
    split_k: int = 1    # programs along K (each a whole number of block_k steps)
    num_warps: int = 2


def pick_gemv_config(N: int, K: int) -> GemvConfig:
    """16 weight rows a program on two warps (the FP8 GEMV's best at one row, docs/PERF.md
    session 10), K split (a power of two) until there are about 2,048 programs, no split shorter
    than two steps of 256."""
    steps = triton.cdiv(K, 256)
    tiles = triton.cdiv(N, 16)
    split = 1 << (min(max(1, steps // 2), max(1, 2048 // tiles)).bit_length() - 1)
    return GemvConfig(16, 256, split, 2)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, c_ptr, M, N, K, x_sm, w_sn, c_ss, k_per_split,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT_BF16: tl.constexpr, NATIVE: tl.constexpr):
    split = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    kk = tl.arange(0, BLOCK_K)
    k0 = split * k_per_split
    k1 = tl.minimum(k0 + k_per_split, K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * w_sn + kk[None, :]
    for m in range(0, M):
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(k0, k1, BLOCK_K):
            kmask = (k + kk) < k1
            w = tl.load(w_rows + k, mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            a = tl.load(x_ptr + m * x_sm + k + kk, mask=kmask, other=0.0).to(tl.float32)
            acc += w * a[None, :]
        y = tl.sum(acc, axis=1)
        if OUT_BF16:  # the interpreter's bf16 store truncates: round first, the store is then exact
            y = round_bf16(y, NATIVE)
        tl.store(c_ptr + split.to(tl.int64) * c_ss + m * N + n, y, mask=nmask)


def gemv(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """``x [M, K] @ w [N, K]^T`` with fp32 products and sums, stored in ``out_dtype`` (default
    x's; fp32 or bf16). x: fp32 or bf16, rows may be strided; w: bf16, fp16 or fp32, dense rows."""
    check_device(x, w)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemv: x [M, K] and w [N, K] must share K, got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("gemv: x and w must be dense along K")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"gemv: out_dtype must be float32 or bfloat16, got {out_dtype}")
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    cfg = config or pick_gemv_config(N, K)
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.block_k), cfg.split_k) * cfg.block_k
    split = triton.cdiv(K, k_per_split)
    out_bf16 = out_dtype == torch.bfloat16
    dest = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    _gemv_kernel[(triton.cdiv(N, cfg.block_n), split)](
        x, w, dest, M, N, K, x.stride(0), w.stride(0), M * N, k_per_split,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, OUT_BF16=out_bf16 and split == 1, NATIVE=native(),
        num_warps=cfg.num_warps)
    if split > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(M * N, block),)](
            dest, out, M * N, SPLIT=split, BLOCK=block, OUT_BF16=out_bf16, NATIVE=native(), num_warps=4)
    return out
