"""FP8 block-scaled projections of one row (batch-1 decode) as one streaming launch.

At one token an FP8 linear is a read of its e4m3 weight: ``wq_b`` 32 MiB, ``wo_b`` 32 MiB, the
shared expert's ``w1 + w3`` 32 MiB and ``w2`` 8 MiB a layer. ``fp8_gemm``'s split-K GEMV read them
at 40-60% of copy bandwidth, behind a separate act-quant launch and, with K split, a split-sum
launch (docs/PERF.md, session 10). Here one program owns ``block_n`` weight rows and streams them
over all of K, ``blocks`` 128-wide blocks a step (pipelined, 16-byte loads), multiplying each
decoded weight by its activation element-wise into an fp32 register tile that is summed once at
the end, the pattern of the bf16 GEMV (``bf16_gemv.py``, ~85% of copy bandwidth). No split, so no
second launch. (Measured slower on the H200 and not kept, session 14: summing each thread's 16
products in the thread every step, 1.2-1.9x; a K split summed by the last program to arrive,
1-6 us a shape.)

The activation comes in three forms (``mode``):

- ``"quant"`` (W8A8, the release's FP8 linears): x bf16 / fp32 ``[1, K]`` is rounded to e4m3 in
  1 x 128 blocks inside the kernel, with ``act_quant_fp8``'s power-of-two scales and the same
  code bits (``_common.quant_block_e4m3``): every program re-derives the few blocks it needs,
  which costs far less than the launch it saves.
- ``"codes"`` (W8A8, already rounded): e4m3 codes ``[1, K]`` and their fp32 scales ``[1, K / 128]``
  (the MoE's shared expert reuses the routed experts' act-quant).
- ``"bf16"`` (W8A16): x bf16 as is, for a weight the release computes in bf16 from its FP8 bytes
  (``wo_a``: stored FP8, folded to bf16 by the release's converter). Each e4m3 weight times its
  block's power of two is that bf16 weight exactly, so the products are the bf16 GEMV's.

Numerics: an e4m3 weight times an e4m3 activation is exact in fp32 (4 x 4 significant bits), and
both block scales are powers of two, so each term is ``(w x) * (s_w s_x)`` exactly (``w x * s``
is representable unless it falls below fp32's normal range); the kernel folds the two scales into
the activation before the product. Only the fp32 sums round, in another order than the
per-block sums of ``fp8_block_gemm`` (bound in ``tests/test_fp8_gemv.py``).

``fp8_row.cu`` computes the same contract in CUDA C with more loads in flight a warp (the Triton
kernel is bound by its own latency: it reads a weight no faster from L2 than from HBM); it takes
the products it was measured faster on (``_preferred_config``; docs/kernels.md section 12).

Grouped (``groups`` > 1, ``wo_a``): W ``[G R, Kg]``; group g's R rows multiply x's columns
``g Kg .. (g + 1) Kg``. ``block_n`` divides 128 (a program's rows share one scale row) and R.

``fp8_w8a16``: ``wo_a`` at 1-64 rows, the row GEMV at one row, else one tensor-core launch that
decodes each 128-block of weights, scales it (exact in bf16) and feeds it to a bf16 MMA with
fp32 accumulation. Prefill chunks fold the weight to bf16 for cuBLAS (``model.Attention``).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import check_device, e4m3_decode, native, quant_block_e4m3, round_bf16
from dsv4_backend.kernels.kv_store import sm_count
from dsv4_backend.kernels import pdl
from dsv4_backend.kernels.pdl import wait as pdl_wait

QBLOCK = 128
MODES = {"quant": 0, "codes": 1, "bf16": 2}
# DSV4_FP8_ROW_GEMV=0 sends one-row FP8 linears back to act-quant + fp8_gemm's split GEMV (A/B timing)
ENABLED = os.environ.get("DSV4_FP8_ROW_GEMV", "1") != "0"


def row_gemv_applies(M: int, config=None) -> bool:
    """Whether an FP8 product of M activation rows (no explicit launch config) runs here."""
    return ENABLED and M == 1 and config is None


class RowGemvConfig(NamedTuple):
    block_n: int = 16      # weight rows a program (divides 128)
    blocks: int = 4        # 128-wide K blocks a step
    num_warps: int = 2
    num_stages: int = 4


def row_gemv_config(N: int, K: int, sms: int) -> RowGemvConfig:
    """The H200 probe's best on Flash's decode shapes (``bench/probe_fp8_row_gemv.py``, docs/PERF.md
    session 14): short rows (K <= 1024: ``wq_b``) 32 rows x one block a step; wide weights (at
    least one 16-row program per SM: ``wo_b``, the shared expert, ``wo_a``) 16 rows x 4 blocks;
    narrow ones (``wq_a + wkv``) 4 rows x 8 blocks on 4 warps."""
    if K <= 1024:
        return RowGemvConfig(32, 1, 2, 3)
    if triton.cdiv(N, 16) >= sms:
        return RowGemvConfig(16, 4, 2, 4)
    return RowGemvConfig(4, 8, 4, 3)


@triton.jit
def _row_gemv_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, N, K, NB, ws_sn, GROUP_ROWS,
                     MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
                     NUM_STAGES: tl.constexpr, OUT_BF16: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation access (pdl.py)
    # program i: rows [i BLOCK_N, (i + 1) BLOCK_N) of W (one 128-row scale row) over all of K
    n0 = tl.program_id(0) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < N
    group = n0 // GROUP_ROWS
    xg = x_ptr + group.to(tl.int64) * K
    xsg = xs_ptr + group * NB
    j = tl.arange(0, BLOCKS)
    c = tl.arange(0, 128)
    col = j[:, None] * 128 + c[None, :]                                   # [BLOCKS, 128]
    w_tile = w_ptr + n.to(tl.int64)[:, None, None] * K + col[None, :, :]
    ws_row = ws_ptr + (n0 // 128) * ws_sn
    acc = tl.zeros([BLOCK_N, BLOCKS, 128], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCKS * 128, num_stages=NUM_STAGES):
        kb = k0 // 128 + j
        k_ok = (k0 + col) < K
        w = tl.load(w_tile + k0, mask=n_ok[:, None, None] & k_ok[None, :, :], other=0)
        sw = tl.load(ws_row + kb, mask=kb < NB, other=0.0)
        if MODE == 0:       # round x to e4m3 in its 128-blocks, as act_quant_fp8 does
            x = tl.load(xg + k0 + col, mask=k_ok, other=0.0).to(tl.float32)
            codes, sx = quant_block_e4m3(x, NATIVE)
            a = e4m3_decode(codes, NATIVE) * (sx * sw)[:, None]
        elif MODE == 1:
            codes = tl.load(xg + k0 + col, mask=k_ok, other=0)
            sx = tl.load(xsg + kb, mask=kb < NB, other=0.0)
            a = e4m3_decode(codes, NATIVE) * (sx * sw)[:, None]
        else:
            a = tl.load(xg + k0 + col, mask=k_ok, other=0.0).to(tl.float32) * sw[:, None]
        acc += e4m3_decode(w, NATIVE) * a[None, :, :]
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if OUT_BF16:   # rounded here: the interpreter's bf16 store truncates
        y = round_bf16(y, NATIVE)
    tl.store(y_ptr + n, y, mask=n_ok)


def _check_weight(w: torch.Tensor, w_scale: torch.Tensor, what: str) -> tuple[int, int, int]:
    """(N, K, 128-blocks along K) of a contiguous e4m3 ``w [N, K]`` with its fp32 block scales
    ``[ceil(N / 128), ceil(K / 128)]`` dense along K; ValueError naming ``what`` otherwise."""
    if w.dim() != 2 or w.dtype != torch.float8_e4m3fn or not w.is_contiguous():
        raise ValueError(f"{what}: w must be a contiguous float8_e4m3fn [N, K], got {w.dtype} {tuple(w.shape)}")
    N, K = w.shape
    nb = triton.cdiv(K, QBLOCK)
    if tuple(w_scale.shape) != (triton.cdiv(N, QBLOCK), nb) or w_scale.dtype != torch.float32 \
            or w_scale.stride(1) != 1:
        raise ValueError(f"{what}: w_scale must be fp32 [{triton.cdiv(N, QBLOCK)}, {nb}] dense along K, "
                         f"got {w_scale.dtype} {tuple(w_scale.shape)}")
    return N, K, nb


# the activation dtypes each mode takes
_MODE_DTYPES = {"quant": (torch.bfloat16, torch.float32), "codes": (torch.float8_e4m3fn,), "bf16": (torch.bfloat16,)}


def fp8_row_gemv(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *, mode: str = "quant",
                 x_scale: torch.Tensor | None = None, groups: int = 1, out_dtype: torch.dtype | None = None,
                 config: "RowGemvConfig | CudaRowConfig | None" = None) -> torch.Tensor:
    """``y [1, N]`` of one row x against e4m3 ``w [N, Kg]`` with fp32 power-of-two block scales
    ``w_scale [ceil(N / 128), ceil(Kg / 128)]``; x ``[1, groups * Kg]``. ``mode`` as in the module
    docstring (``x_scale`` fp32 ``[1, ceil(K / 128)]`` for "codes"). ``out_dtype``: bf16 or fp32
    (default: x's dtype, bf16 for "codes"). ``config``: a ``RowGemvConfig`` runs the Triton
    kernel, a ``CudaRowConfig`` ``fp8_row.cu``; None picks (``_preferred_config``)."""
    if mode not in MODES:
        raise ValueError(f"fp8_row_gemv: mode must be one of {sorted(MODES)}, got {mode!r}")
    N, Kg, nb = _check_weight(w, w_scale, "fp8_row_gemv")
    if x.dim() != 2 or x.shape[0] != 1 or groups < 1 or x.shape[1] != groups * Kg or N % groups \
            or (groups > 1 and Kg % QBLOCK):
        raise ValueError(f"fp8_row_gemv: x {tuple(x.shape)} and w {tuple(w.shape)} do not fit one row and "
                         f"{groups} group(s) (grouped: 128-wide blocks within a group)")
    if x.dtype not in _MODE_DTYPES[mode]:
        raise ValueError(f"fp8_row_gemv: mode {mode!r} takes x in {_MODE_DTYPES[mode]}, got {x.dtype}")
    if mode == "codes":
        if x_scale is None or tuple(x_scale.shape) != (1, groups * nb) or x_scale.dtype != torch.float32:
            raise ValueError(f"fp8_row_gemv: mode 'codes' needs x_scale fp32 [1, {groups * nb}]")
    out_dtype = out_dtype or (torch.bfloat16 if mode == "codes" else x.dtype)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"fp8_row_gemv: out_dtype must be bf16 or fp32, got {out_dtype}")
    check_device(x, w, w_scale, *(() if x_scale is None else (x_scale,)))
    R = N // groups
    cuda = _cuda_config(x, N, Kg, R, mode, groups, config)
    if cuda is None:
        cfg = config or row_gemv_config(N, Kg, sm_count(x.device))
        if 128 % cfg.block_n or (groups > 1 and R % cfg.block_n):
            raise ValueError(f"fp8_row_gemv: block_n {cfg.block_n} must divide 128 and a group's {R} rows")
    x = x.contiguous()
    y = torch.empty(1, N, dtype=out_dtype, device=x.device)
    if N == 0:
        return y
    xs = x_scale.contiguous() if x_scale is not None else w_scale       # (unread unless "codes")
    if cuda is not None:
        pdl.launch_compiled(_cuda_kernel(x.device.index or 0, cuda), (N // cuda.rows, 1, 1), (32 * cuda.warps, 1, 1),
                            [w.view(torch.uint8), w_scale, x.view(torch.uint8), xs, y, N, Kg, nb, w_scale.stride(0),
                             R, MODES[mode], int(out_dtype == torch.bfloat16)],
                            x.device, shared_mem=4 * (Kg + cuda.k_warps * cuda.rows))
        return y
    _row_gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
        x.view(torch.uint8) if mode == "codes" else x, xs, w.view(torch.uint8), w_scale, y,
        N, Kg, nb, w_scale.stride(0), R if groups > 1 else max(N, 1),
        MODE=MODES[mode], BLOCK_N=cfg.block_n, BLOCKS=cfg.blocks, NUM_STAGES=cfg.num_stages,
        OUT_BF16=out_dtype == torch.bfloat16, NATIVE=native(), num_warps=cfg.num_warps, **pdl.args(x.device))
    return y


# ---- the same contract in CUDA C (fp8_row.cu) -------------------------------------------------

CUDA_SOURCE = Path(__file__).with_name("fp8_row.cu")
# DSV4_FP8_ROW_CUDA=0 keeps every one-row FP8 linear on the Triton kernel (A/B timing)
USE_CUDA = os.environ.get("DSV4_FP8_ROW_CUDA", "1") != "0"
CUDA_CHUNK = 512          # weight bytes a warp reads from one row per step (32 lanes x 16)
CUDA_SMEM_MAX = 48 * 1024  # the activations of a group, fp32, in shared memory
# the longest rows fp8_row.cu takes by default (DSV4_FP8_ROW_CUDA_MAX_K=4096 keeps wo_b on Triton: A/B timing)
CUDA_MAX_K = int(os.environ.get("DSV4_FP8_ROW_CUDA_MAX_K", "8192"))


class CudaRowConfig(NamedTuple):
    rows_per_warp: int = 2   # rows whose 16-byte loads a lane keeps in flight together
    row_groups: int = 8      # warps along N: a CTA owns row_groups x rows_per_warp rows
    k_warps: int = 1         # warps along K, their sums added in order
    unroll: int = 2          # 512-byte chunks a warp loads before it multiplies

    @property
    def rows(self) -> int:
        return self.row_groups * self.rows_per_warp

    @property
    def warps(self) -> int:
        return self.row_groups * self.k_warps


def cuda_row_config(N: int, K: int, sms: int) -> CudaRowConfig:
    """The H100 probe's best (``bench/probe_fp8_row_gemv.py --cuda``, docs/PERF.md session 20):
    16-row CTAs of 8 warps, each warp two rows over all of K, two chunks a load step; where that
    gives fewer CTAs than SMs (``wq_a + wkv``), 8-row CTAs, one row a warp, four chunks a step;
    rows past 4,096 (``wo_b``) two warps along K (session 23: after ``wo_a``, as the model chains
    them, 30.6 us a pair against 38.5 with ``wo_b`` on Triton)."""
    if triton.cdiv(N, 16) < sms:
        return CudaRowConfig(1, 8, 1, 4)
    if K > 4096:
        return CudaRowConfig(2, 8, 2, 2)
    return CudaRowConfig()


def cuda_row_applies(x: torch.Tensor, K: int, mode: str) -> bool:
    """Whether ``fp8_row.cu`` can take a one-row product: CUDA (compiled, not interpreted), bf16
    activations (or e4m3 codes), K a multiple of 512 whose fp32 activations fit shared memory."""
    return (x.is_cuda and native() and (mode == "codes" or x.dtype == torch.bfloat16)
            and K % CUDA_CHUNK == 0 and 4 * K + 4096 <= CUDA_SMEM_MAX)


def _preferred_config(x: torch.Tensor, N: int, K: int, mode: str, groups: int) -> CudaRowConfig | None:
    """The launch shape of a one-row product with no explicit config that goes to ``fp8_row.cu``,
    or None for the Triton kernel: where it can run, on ungrouped weights of rows up to CUDA_MAX_K
    whose N the launch rule's CTAs tile (H100, session 20: ``wq_b (+ indexer)``, ``wq_a + wkv`` and
    the shared expert faster by 0.8-2.3 us each; grouped ``wo_a`` 0.6-1.2 us slower, so it stays
    on Triton; session 23: ``wo_b`` (K = 8,192) 7 us a layer faster in the model)."""
    if not (USE_CUDA and groups == 1 and K <= CUDA_MAX_K and cuda_row_applies(x, K, mode)):
        return None
    cfg = cuda_row_config(N, K, sm_count(x.device))
    return cfg if N % cfg.rows == 0 else None


def cuda_row_preferred(x: torch.Tensor, N: int, K: int, mode: str, groups: int) -> bool:
    """Whether a one-row product with no explicit config goes to ``fp8_row.cu`` (``_preferred_config``)."""
    return _preferred_config(x, N, K, mode, groups) is not None


@lru_cache(maxsize=None)
def _cuda_kernel(device_index: int, cfg: CudaRowConfig):
    with torch.cuda.device(device_index):
        return torch.cuda._compile_kernel(
            CUDA_SOURCE.read_text(), "fp8_row_gemv_cu",
            nvcc_options=[f"-DRW={cfg.rows_per_warp}", f"-DRG={cfg.row_groups}", f"-DKW={cfg.k_warps}",
                          f"-DU={cfg.unroll}"])


def _cuda_config(x: torch.Tensor, N: int, K: int, R: int, mode: str, groups: int,
                 config: "RowGemvConfig | CudaRowConfig | None") -> CudaRowConfig | None:
    """``fp8_row.cu``'s launch shape for this product, or None for the Triton kernel: an explicit
    ``CudaRowConfig`` (checked: ValueError naming why it cannot run), else the preferred rule's."""
    if config is None:
        return _preferred_config(x, N, K, mode, groups)
    if not isinstance(config, CudaRowConfig):
        return None
    if not cuda_row_applies(x, K, mode):
        raise ValueError(f"fp8_row_gemv: the CUDA kernel takes bf16 x (or codes) on CUDA with K a multiple of "
                         f"{CUDA_CHUNK} up to {(CUDA_SMEM_MAX - 4096) // 4}; got {x.dtype} on {x.device}, K {K}")
    if 128 % config.rows or R % config.rows:
        raise ValueError(f"fp8_row_gemv: a CUDA CTA's {config.rows} rows must divide 128 and a group's {R} rows")
    return config


# ---- W8A16 at a few rows (wo_a at decode batch sizes) ------------------------------------------

W8A16_MAX_M = 64   # more rows (prefill chunks): the folded bf16 weight through cuBLAS is faster


class W8A16Config(NamedTuple):
    block_n: int = 32      # weight rows a program (the MMA's M side)
    block_m: int = 16      # activation rows a program (the MMA's N side, at least 16)
    num_warps: int = 4
    num_stages: int = 4


def w8a16_config(M: int) -> W8A16Config:
    """The H200 probe's best for wo_a (8 groups of 1,024 x 4,096) by rows: one 16-row MMA tile to
    16 rows, then 32 x 32 and 64 x 64 tiles (docs/PERF.md, session 14)."""
    if M <= 16:
        return W8A16Config(32, 16, 4, 4)
    if M <= 32:
        return W8A16Config(32, 32, 4, 4)
    return W8A16Config(64, 64, 4, 3)


def w8a16_applies(x: torch.Tensor, rows_per_group: int) -> bool:
    """Whether ``fp8_w8a16`` takes x ``[M, K]`` against groups of ``rows_per_group`` weight rows:
    CUDA (or the interpreter), bf16, 1 <= M <= W8A16_MAX_M, groups of whole 64-row tiles (the
    largest tile of either launch rule)."""
    return (ENABLED and x.dtype == torch.bfloat16 and 1 <= x.shape[0] <= W8A16_MAX_M
            and (x.is_cuda or not native()) and rows_per_group % 64 == 0)


@triton.jit
def _w8a16_dot_kernel(x_ptr, x_sm, w_ptr, ws_ptr, y_ptr, M, N, K, NB, ws_sn, GROUP_ROWS,
                      BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, NUM_STAGES: tl.constexpr,
                      NATIVE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    # program (i, j): weight rows [i BLOCK_N, ...) (one group's) times activation rows [j BLOCK_M, ...);
    # each 128-block of weights is decoded, scaled (exact in bf16) and fed to one MMA
    n0 = tl.program_id(0) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = n < N
    m_ok = m < M
    kk = tl.arange(0, 128)
    group = n0 // GROUP_ROWS
    x_rows = x_ptr + m.to(tl.int64)[:, None] * x_sm + group.to(tl.int64) * K + kk[None, :]
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K + kk[None, :]
    ws_rows = ws_ptr + (n // 128) * ws_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for kb in tl.range(0, NB, num_stages=NUM_STAGES):
        k_ok = (kb * 128 + kk) < K
        w = tl.load(w_rows + kb * 128, mask=n_ok[:, None] & k_ok[None, :], other=0)
        sw = tl.load(ws_rows + kb, mask=n_ok, other=0.0)
        wv = e4m3_decode(w, NATIVE) * sw[:, None]
        x = tl.load(x_rows + kb * 128, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if NATIVE:
            acc = tl.dot(wv.to(tl.bfloat16), tl.trans(x), acc)
        else:       # the interpreter's bf16 dot is wrong; the values are bf16-exact either way
            acc = tl.dot(wv, tl.trans(x.to(tl.float32)), acc)
    y = round_bf16(tl.trans(acc), NATIVE)
    tl.store(y_ptr + m.to(tl.int64)[:, None] * N + n[None, :], y, mask=m_ok[:, None] & n_ok[None, :])


def fp8_w8a16(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, groups: int = 1,
              config: W8A16Config | RowGemvConfig | None = None) -> torch.Tensor:
    """``[M, N]`` bf16: x bf16 ``[M, groups * Kg]`` (1 <= M <= W8A16_MAX_M) against e4m3 ``w [N, Kg]``
    with its block scales, the weights multiplied as their bf16 folds (W8A16), group g's rows
    against x's g-th Kg columns. One row: ``fp8_row_gemv(mode="bf16")``; more: one tensor-core
    launch (fp32 accumulation)."""
    if x.dim() == 2 and x.shape[0] == 1 and not isinstance(config, W8A16Config):
        return fp8_row_gemv(x, w, w_scale, mode="bf16", groups=groups, config=config)
    if x.dim() != 2 or x.dtype != torch.bfloat16 or not 1 <= x.shape[0] <= W8A16_MAX_M:
        raise ValueError(f"fp8_w8a16: x must be bf16 [1..{W8A16_MAX_M}, K], got {x.dtype} {tuple(x.shape)}")
    M = x.shape[0]
    N, Kg, nb = _check_weight(w, w_scale, "fp8_w8a16")
    cfg = config or w8a16_config(M)
    R = N // max(groups, 1)
    if groups < 1 or x.shape[1] != groups * Kg or N % groups or (groups > 1 and (Kg % QBLOCK or R % cfg.block_n)):
        raise ValueError(f"fp8_w8a16: x {tuple(x.shape)} and w {tuple(w.shape)} do not fit {groups} group(s) "
                         f"of {cfg.block_n}-row tiles")
    check_device(x, w, w_scale)
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    if N:
        _w8a16_dot_kernel[(triton.cdiv(N, cfg.block_n), triton.cdiv(M, cfg.block_m))](
            x, x.stride(0), w.view(torch.uint8), w_scale, y, M, N, Kg, nb, w_scale.stride(0),
            R if groups > 1 else max(N, 1), BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m,
            NUM_STAGES=cfg.num_stages, NATIVE=native(), num_warps=cfg.num_warps, **pdl.args(x.device))
    return y
