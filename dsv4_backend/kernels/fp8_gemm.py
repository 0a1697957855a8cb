"""FP8 block-scaled linear layers (W8A8, DeepSeek's recipe) for the checkpoint's FP8 weights.

Semantics (docs/kernels.md, QUANT_INTERFACE.md):

- ``act_quant_fp8(x [M, K])``: per row and per 128-wide block along K,
  ``s = 2^ceil(log2(max(amax, 1e-4) / 448))`` (exact: read from amax's exponent bits),
  ``xq = e4m3(clamp(x / s, +-448))`` rounded to nearest even -> (xq e4m3 [M, K], xs fp32 [M, ceil(K/128)]).
- ``fp8_block_gemm(xq, xs, w [N, K] e4m3, w_scale fp32 [ceil(N/128), ceil(K/128)])``:
  ``y[m, n] = sum_kb xs[m, kb] * w_scale[n // 128, kb] * sum_{k in kb} xq[m, k] w[n, k]``:
  each 128-deep block product is one tensor-core dot into a fresh fp32 accumulator, scaled and
  added to the fp32 running sum (the per-K-block promotion of DeepSeek's kernels).

Launch shapes: M = 1, the one-row streaming GEMV of ``fp8_gemv.py`` (no K split; one launch).
M <= ``GEMV_MAX_M`` (the shape rule; ``Fp8GemvConfig``) a GEMV on the CUDA
cores: a program per 32 weight rows and K split, each thread's 16 e4m3 bytes decoded and
multiplied in fp32, summed in the thread, the two block scales applied per 16 terms (no padding
of one token to a 16-row MMA tile). Otherwise (``GemmConfig``) prefill tiles ``[block_m, block_n]`` in L2-friendly groups of
``group_m`` rows; decode (small M) swaps the operands (``swap_ab``: the weight tile is the MMA's
M side, so a 16-row activation tile does not waste a 64-row wgmma) and splits K over
``split_k`` programs whose fp32 partials a second kernel sums in split order (deterministic, no
atomics). ``pick_config`` is the shape rule; ``bench/bench_quant_kernels.py`` sweeps it.

Backend rule (``fp8_block_gemm(backend="auto")``): on CUDA, for bf16 outputs with
``M >= TORCH_BLOCKWISE_MIN_M`` and no explicit ``config``, torch's cuBLAS blockwise FP8 GEMM
(the same 1x128 / 128x128 recipe, ``torch.nn.functional.scaled_mm``) is used when this torch runs
it; everything else, and every CPU test, runs the Triton kernel. ``DSV4_FP8_GEMM=triton|torch``
overrides the rule. Which scale layout this torch accepts is probed once per device, outside graph
capture, on a small random problem checked against the Triton kernel.
"""

from __future__ import annotations

import os
from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import (
    check_device, e4m3_decode, native, quant_block_e4m3, round_bf16,
)
from dsv4_backend.kernels.fp8_gemv import fp8_row_gemv, row_gemv_applies
from dsv4_backend.kernels import pdl
from dsv4_backend.kernels.pdl import wait as pdl_wait

QBLOCK = 128  # activation and weight scale block along K (and along N for weights)
NUM_SMS_DEFAULT = 132
TORCH_BLOCKWISE_MIN_M = 128  # H200 run 1: cuBLAS blockwise 1.3-3x faster from M = 256 up, mixed at 64


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    split_k: int = 1
    swap_ab: bool = False
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NUM_SMS_DEFAULT


def pick_config(M: int, N: int, K: int, num_sms: int = NUM_SMS_DEFAULT) -> GemmConfig:
    """The shape rule. Decode (M <= 64): operands swapped, 64-row weight tiles, K split until
    there are about two programs per SM (each split a whole number of 128-blocks). Mid M: 64 x 128
    tiles, split K when the tiles alone do not fill the SMs. Prefill: 128 x 64 tiles, 4 warps,
    4 stages (the H200 sweep of 2026-12-01: best at M = 8192 on every Flash shape, 35-40% of the
    FP8 peak against 30-35% for 128 x 128 on 8 warps; docs/PERF.md)."""
    kb = triton.cdiv(K, QBLOCK)
    if M <= 64:
        bm = max(16, triton.next_power_of_2(M))
        tiles = triton.cdiv(N, 64)
        split = max(1, min(kb, (2 * num_sms) // tiles))
        return GemmConfig(bm, 64, split, True, 4, 4)
    if M <= 256:
        tiles = triton.cdiv(M, 64) * triton.cdiv(N, 128)
        split = max(1, min(kb, num_sms // tiles))
        return GemmConfig(64, 128, split, False, 4, 4)
    return GemmConfig(128, 64, 1, False, 4, 4)


# ---- activation quantisation ----------------------------------------------------------------

@triton.jit
def _act_quant_kernel(x_ptr, x_sm, q_ptr, s_ptr, M, K, NB,
                      BLOCK_M: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1)
    cols = kb * 128 + tl.arange(0, 128)
    rmask = rows < M
    mask = rmask[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * x_sm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    codes, scale = quant_block_e4m3(x, NATIVE)
    tl.store(q_ptr + r64[:, None] * K + cols[None, :], codes, mask=mask)
    tl.store(s_ptr + r64 * NB + kb, scale, mask=rmask)


def act_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16 / fp16 / fp32, rows may be strided) -> (xq e4m3 [M, K], xs fp32 [M, ceil(K/128)])."""
    check_device(x)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"act_quant_fp8: x must be [M, K] with unit stride along K, got {tuple(x.shape)}")
    M, K = x.shape
    nb = triton.cdiv(K, QBLOCK)
    xq = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    xs = torch.empty(M, nb, dtype=torch.float32, device=x.device)
    if M == 0:
        return xq, xs
    block_m = 8
    _act_quant_kernel[(triton.cdiv(M, block_m), nb)](
        x, x.stride(0), xq.view(torch.uint8), xs, M, K, nb, BLOCK_M=block_m, NATIVE=native(),
        num_warps=4, **pdl.args(x.device))
    return xq, xs


# ---- the GEMM --------------------------------------------------------------------------------

@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, M, N, K, NB, a_sm, ws_sn, c_ss, c_sm,
                     kb_per_split,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                     SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, OUT_BF16: tl.constexpr,
                     NATIVE: tl.constexpr, PDL: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] output tile over K-blocks [split * kb_per_split, ...). The split's
    partial (or, unsplit, the result) goes to c + split * c_ss."""
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = offs_m < M
    nmask = offs_n < N
    m64 = offs_m.to(tl.int64)
    n64 = offs_n.to(tl.int64)
    kk = tl.arange(0, 128)
    a_rows = a_ptr + m64[:, None] * a_sm + kk[None, :]
    w_rows = w_ptr + n64[:, None] * K + kk[None, :]
    as_rows = as_ptr + m64 * NB
    ws_rows = ws_ptr + (offs_n // 128) * ws_sn

    kb0 = split * kb_per_split
    kb1 = tl.minimum(kb0 + kb_per_split, NB)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb0, kb1):
        k0 = kb * 128
        if EVEN_K:
            a = tl.load(a_rows + k0, mask=mmask[:, None], other=0)
            w = tl.load(w_rows + k0, mask=nmask[:, None], other=0)
        else:
            kmask = (k0 + kk) < K
            a = tl.load(a_rows + k0, mask=mmask[:, None] & kmask[None, :], other=0)
            w = tl.load(w_rows + k0, mask=nmask[:, None] & kmask[None, :], other=0)
        sa = tl.load(as_rows + kb, mask=mmask, other=0.0)
        sw = tl.load(ws_rows + kb, mask=nmask, other=0.0)
        a = a.to(tl.float8e4nv, bitcast=True)
        w = w.to(tl.float8e4nv, bitcast=True)
        if SWAP_AB:
            acc += tl.dot(w, tl.trans(a)) * (sw[:, None] * sa[None, :])
        else:
            acc += tl.dot(a, tl.trans(w)) * (sa[:, None] * sw[None, :])
    if SWAP_AB:
        acc = tl.trans(acc)
    if OUT_BF16:  # the interpreter's bf16 store truncates: round first, the store is then exact
        acc = round_bf16(acc, NATIVE)
    c = c_ptr + split.to(tl.int64) * c_ss + m64[:, None] * c_sm + offs_n[None, :]
    tl.store(c, acc, mask=mmask[:, None] & nmask[None, :])


# ---- decode GEMV -----------------------------------------------------------------------------

GEMV_MAX_M = 4  # the shape rule's CUDA-core GEMV for M <= this; larger M: the tensor-core kernel


class Fp8GemvConfig(NamedTuple):
    block_n: int = 32  # weight rows per program
    split_k: int = 1  # 128-blocks of K split over this many programs (partials summed in order)
    num_warps: int = 4
    num_stages: int = 2


def pick_gemv_config(N: int, K: int, num_sms: int = NUM_SMS_DEFAULT, M: int = 1) -> Fp8GemvConfig:
    """One row (M = 1): 16-row tiles on two warps, K split (a power of two) until there are about
    2,048 programs but no split shorter than four 128-blocks: the best of
    ``bench/probe_fp8_gemv.py``'s grid on each of Flash's six decode shapes on the H200
    (docs/PERF.md, session 10: 7-25% faster than the rule below). More rows: 32-row tiles,
    K split until there are about four programs per SM (there the grid's best varied by shape
    and gained 10-20%; not adopted)."""
    nb = triton.cdiv(K, QBLOCK)
    if M <= 1:
        tiles = triton.cdiv(N, 16)
        split = 1 << (min(max(1, nb // 4), max(1, 2048 // tiles)).bit_length() - 1)
        return Fp8GemvConfig(16, split, 2, 2)
    tiles = triton.cdiv(N, 32)
    return Fp8GemvConfig(32, max(1, min(nb, (4 * num_sms) // tiles)))


@triton.jit
def _fp8_gemv_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, M, N, K, NB, a_sm, ws_sn, c_ss, kb_per_split,
                     BLOCK_N: tl.constexpr, OUT_BF16: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    """Rows n of this program over K-blocks [split * kb_per_split, ...), for each of the M rows
    of a in turn (the second and later rows re-read the weight slice from L1 / L2). A block of
    128 is [8, 16] per weight row: each thread's 16-byte load is summed in the thread, the
    block's two scales applied to the eight partial sums, which meet only at the end."""
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    split = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    j = tl.arange(0, 8)
    c = tl.arange(0, 16)
    w_tile = w_ptr + n.to(tl.int64)[:, None, None] * K + (j * 16)[None, :, None] + c[None, None, :]
    ws_rows = ws_ptr + (n // 128) * ws_sn
    kb0 = split * kb_per_split
    kb1 = tl.minimum(kb0 + kb_per_split, NB)
    for m in range(0, M):
        a_row = a_ptr + m * a_sm + (j * 16)[:, None] + c[None, :]
        acc = tl.zeros((BLOCK_N, 8), dtype=tl.float32)
        for kb in range(kb0, kb1):
            k0 = tl.multiple_of(kb * 128, 128)
            kmask = (k0 + j[:, None] * 16 + c[None, :]) < K  # [8, 16]
            w = tl.load(w_tile + k0, mask=nmask[:, None, None] & kmask[None, :, :], other=0)
            a = tl.load(a_row + k0, mask=kmask, other=0)
            part = tl.sum(e4m3_decode(w, NATIVE) * e4m3_decode(a, NATIVE)[None, :, :], axis=2)
            s = tl.load(as_ptr + m * NB + kb) * tl.load(ws_rows + kb, mask=nmask, other=0.0)
            acc += part * s[:, None]
        y = tl.sum(acc, axis=1)
        if OUT_BF16:
            y = round_bf16(y, NATIVE)
        tl.store(c_ptr + split.to(tl.int64) * c_ss + m * N + n, y, mask=nmask)


@triton.jit
def _split_sum_kernel(p_ptr, c_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                      OUT_BF16: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    """c = sum over splits of the fp32 partials [SPLIT, MN], in split order."""
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
    if OUT_BF16:
        acc = round_bf16(acc, NATIVE)
    tl.store(c_ptr + offs, acc, mask=mask)


def _check_gemm_inputs(xq, xs, w, w_scale):
    if xq.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_block_gemm: xq and w must be float8_e4m3fn, got {xq.dtype} and {w.dtype}")
    if xq.dim() != 2 or w.dim() != 2 or xq.shape[1] != w.shape[1]:
        raise ValueError(f"fp8_block_gemm: xq [M, K] and w [N, K] must share K, got "
                         f"{tuple(xq.shape)} and {tuple(w.shape)}")
    M, K = xq.shape
    N = w.shape[0]
    nb = triton.cdiv(K, QBLOCK)
    if tuple(xs.shape) != (M, nb) or xs.dtype != torch.float32:
        raise ValueError(f"fp8_block_gemm: xs must be fp32 [{M}, {nb}], got {xs.dtype} {tuple(xs.shape)}")
    if tuple(w_scale.shape) != (triton.cdiv(N, QBLOCK), nb) or w_scale.dtype != torch.float32:
        raise ValueError(f"fp8_block_gemm: w_scale must be fp32 [{triton.cdiv(N, QBLOCK)}, {nb}], "
                         f"got {w_scale.dtype} {tuple(w_scale.shape)}")
    if xq.stride(1) != 1 or not w.is_contiguous() or not xs.is_contiguous() or w_scale.stride(1) != 1:
        raise ValueError("fp8_block_gemm: xq rows, w, xs and w_scale must be dense along K")


def fp8_block_gemm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                   out_dtype: torch.dtype = torch.bfloat16,
                   config: "GemmConfig | Fp8GemvConfig | None" = None, backend: str = "auto") -> torch.Tensor:
    """y [M, N] = block-scaled (xq * xs) @ (w * w_scale)^T in fp32, cast to ``out_dtype``
    (bf16 or fp32). ``backend``: "auto" (the module's backend rule), "triton" or "torch".
    ``config``: a ``GemmConfig`` (tensor cores), an ``Fp8GemvConfig`` (CUDA-core GEMV) or None
    (the shape rule: the GEMV for M <= GEMV_MAX_M, else ``pick_config``).
    No host synchronisation after the one-time probe; the grid depends only on the shapes."""
    check_device(xq, xs, w, w_scale)
    _check_gemm_inputs(xq, xs, w, w_scale)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"fp8_block_gemm: out_dtype must be bf16 or fp32, got {out_dtype}")
    M, K = xq.shape
    N = w.shape[0]
    if M > 0 and N > 0 and _use_torch(backend, M, out_dtype, config, xq.device):
        if out_dtype != torch.bfloat16:
            raise ValueError("fp8_block_gemm: the torch backend writes bf16 only")
        return torch_blockwise_gemm(xq, xs, w, w_scale)
    if N > 0 and row_gemv_applies(M, config):
        return fp8_row_gemv(xq, w, w_scale, mode="codes", x_scale=xs, out_dtype=out_dtype)
    out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if M == 0 or N == 0:
        return out
    cfg, kb_per_split, split = _launch_shape(M, N, K, config, xq.device)
    nat = native()
    if split == 1:
        _launch_gemm(xq, xs, w, w_scale, out, 0, cfg, kb_per_split, out_dtype == torch.bfloat16)
        return out
    part = torch.empty(split, M, N, dtype=torch.float32, device=xq.device)
    _launch_gemm(xq, xs, w, w_scale, part, M * N, cfg, kb_per_split, False)
    block = 1024
    _split_sum_kernel[(triton.cdiv(M * N, block),)](
        part, out, M * N, SPLIT=split, BLOCK=block, OUT_BF16=out_dtype == torch.bfloat16,
        NATIVE=nat, num_warps=4, **pdl.args(part.device))
    return out


def fp8_block_gemm_partials(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                            config: "GemmConfig | Fp8GemvConfig | None" = None) -> torch.Tensor:
    """The Triton kernel's K-split partial sums, fp32 ``[split, M, N]``, left unsummed for a
    consumer that sums them in split order itself (the SwiGLU + act-quant and the combine of
    ``fp4_mma.fp4_moe_mma``'s shared expert): summed s = 0, 1, ... in fp32 they are
    ``fp8_block_gemm(..., torch.float32, config, "triton")`` bit for bit, one launch fewer."""
    check_device(xq, xs, w, w_scale)
    _check_gemm_inputs(xq, xs, w, w_scale)
    M, K = xq.shape
    N = w.shape[0]
    if N > 0 and row_gemv_applies(M, config):    # one row: no K split, the sums are final
        return fp8_row_gemv(xq, w, w_scale, mode="codes", x_scale=xs, out_dtype=torch.float32)[None]
    cfg, kb_per_split, split = _launch_shape(M, N, K, config, xq.device)
    part = torch.empty(split, M, N, dtype=torch.float32, device=xq.device)
    if M and N:
        _launch_gemm(xq, xs, w, w_scale, part, M * N, cfg, kb_per_split, False)
    return part


def _launch_shape(M: int, N: int, K: int, config, device: torch.device):
    """(config, 128-blocks of K per split, splits) by the shape rule; no empty split."""
    if config is None and M <= GEMV_MAX_M:
        config = pick_gemv_config(N, K, _num_sms(device), M)
    cfg = config or pick_config(M, N, K, _num_sms(device))
    nb = triton.cdiv(K, QBLOCK)
    kb_per_split = triton.cdiv(nb, cfg.split_k)
    return cfg, kb_per_split, triton.cdiv(nb, kb_per_split)


def _launch_gemm(xq, xs, w, w_scale, dest, c_ss: int, cfg, kb_per_split: int, out_bf16: bool) -> None:
    """One launch of the GEMV or the tensor-core kernel writing split s's sums at dest + s * c_ss."""
    M, K = xq.shape
    N = w.shape[0]
    nb = triton.cdiv(K, QBLOCK)
    split = triton.cdiv(nb, kb_per_split)
    if isinstance(cfg, Fp8GemvConfig):
        _fp8_gemv_kernel[(triton.cdiv(N, cfg.block_n), split)](
            xq.view(torch.uint8), xs, w.view(torch.uint8), w_scale, dest, M, N, K, nb,
            xq.stride(0), w_scale.stride(0), c_ss, kb_per_split,
            BLOCK_N=cfg.block_n, OUT_BF16=out_bf16, NATIVE=native(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.args(xq.view(torch.uint8).device))
    else:
        grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), split)
        _fp8_gemm_kernel[grid](
            xq.view(torch.uint8), xs, w.view(torch.uint8), w_scale, dest, M, N, K, nb,
            xq.stride(0), w_scale.stride(0), c_ss, N, kb_per_split,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m, SWAP_AB=cfg.swap_ab,
            EVEN_K=K % QBLOCK == 0, OUT_BF16=out_bf16, NATIVE=native(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.args(xq.view(torch.uint8).device))


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
               config: GemmConfig | None = None, backend: str = "auto") -> torch.Tensor:
    """act_quant_fp8(x) then fp8_block_gemm, output in x.dtype (bf16 or fp32). x: [..., K]."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"fp8_linear: x must be bf16 or fp32, got {x.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = act_quant_fp8(x2)
    return fp8_block_gemm(xq, xs, w, w_scale, x.dtype, config, backend).reshape(*lead, w.shape[0])


# ---- torch's blockwise FP8 GEMM (cuBLAS), where it is faster --------------------------------

def _torch_forms(xq, xs, w, w_scale) -> list[Callable[[], torch.Tensor]]:
    """The call forms torch versions accept for 1x128 x 128x128 block scaling, in probe order:
    ``F.scaled_mm`` with the activation scales M-major or row-major and the weight scales as
    stored or transposed, then ``torch._scaled_mm`` inferring blockwise scaling from the scale
    shapes. mat_b is w^T: K-major, as cuBLAS wants."""
    F = torch.nn.functional
    forms: list[Callable[[], torch.Tensor]] = []
    st = getattr(F, "ScalingType", None)
    if st is not None and hasattr(F, "scaled_mm"):
        ra = getattr(st, "BlockWise1x128", None) or getattr(st, "Blockwise_1x128", None)
        rb = getattr(st, "BlockWise128x128", None) or getattr(st, "Blockwise_128x128", None)
        outer = xs.t().contiguous().t()
        for sa, sb in ((outer, w_scale), (xs, w_scale), (outer, w_scale.t()), (xs, w_scale.t())):
            forms.append(lambda sa=sa, sb=sb: F.scaled_mm(xq, w.t(), sa, ra, sb, rb,
                                                         output_dtype=torch.bfloat16))
    outer = xs.t().contiguous().t()
    for sb in (w_scale.t(), w_scale):
        forms.append(lambda sb=sb: torch._scaled_mm(xq, w.t(), scale_a=outer, scale_b=sb,
                                                    out_dtype=torch.bfloat16))
    return forms


_TORCH_FORM: dict[torch.device, int | None] = {}
TORCH_ERRORS: list[str] = []  # why each rejected form failed, for the bench to print


def torch_blockwise_form(device: torch.device) -> int | None:
    """Index into ``_torch_forms`` of the first form that runs here and agrees with the Triton
    kernel on a random block-scaled problem (wrong scale layouts give errors of order 1), or None.
    Probed once per device; not during graph capture (returns None there until probed)."""
    if device in _TORCH_FORM:
        return _TORCH_FORM[device]
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    gen = torch.Generator(device=device).manual_seed(0)
    M, N, K = 256, 384, 512
    xq, xs = act_quant_fp8(torch.randn(M, K, generator=gen, device=device)
                           * torch.rand(M, K // 128, generator=gen, device=device)
                           .repeat_interleave(128, 1) * 8)
    w = (torch.randn(N, K, generator=gen, device=device) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws = torch.pow(2.0, torch.randint(-12, -4, (N // 128, K // 128), generator=gen, device=device).float())
    ref = fp8_block_gemm(xq, xs, w, ws, torch.float32, backend="triton")
    found = None
    for i, fn in enumerate(_torch_forms(xq, xs, w, ws)):
        try:
            err = (fn().float() - ref).abs().max() / ref.abs().max()
            if float(err) <= 2.0 ** -6:  # bf16 rounding is 2^-9; a wrong scale layout is ~1
                found = i
                break
            TORCH_ERRORS.append(f"form {i}: relative error {float(err):.3g}")
        except Exception as e:  # this torch / GPU rejects the layout
            TORCH_ERRORS.append(f"form {i}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    _TORCH_FORM[device] = found
    return found


def torch_blockwise_gemm(xq, xs, w, w_scale) -> torch.Tensor:
    """The same block-scaled product through torch (bf16 output); raises if unavailable here."""
    form = torch_blockwise_form(xq.device)
    if form is None:
        raise RuntimeError("fp8_block_gemm: torch's blockwise FP8 GEMM is unavailable here: "
                           + "; ".join(TORCH_ERRORS[-6:]))
    return _torch_forms(xq, xs, w, w_scale)[form]()


def _use_torch(backend: str, M: int, out_dtype: torch.dtype, config, device) -> bool:
    if backend == "auto":
        backend = os.environ.get("DSV4_FP8_GEMM", "auto")
    if backend == "triton":
        return False
    if backend == "torch":
        return True
    if backend != "auto":
        raise ValueError(f"fp8_block_gemm: backend must be auto, triton or torch, got {backend!r}")
    return (device.type == "cuda" and config is None and out_dtype == torch.bfloat16
            and M >= TORCH_BLOCKWISE_MIN_M and torch_blockwise_form(device) is not None)
