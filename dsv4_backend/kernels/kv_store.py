"""KV store: kv_norm, RoPE and FP8 quantisation of new tokens' rows, written into the SWA pool.

Per row: read the pre-norm row, RMSNorm with the weight (fp32), RoPE on the last 64 dims
(interleaved pairs, the caller's cos/sin for the row's position), then the row's bytes. The same
kernel finishes compressed rows (``dsv4_backend.kernels.compressor``): there the input is the
pooled row, rounded to bf16 first in bf16 mode, and the indexer variant (D = 128) applies the
128-point Hadamard rotation and writes a 132-byte row instead of a 584-byte one.

Launch: ``FinishConfig.rows`` rows per program. Attention rows go as one [rows, 8, 64] tile
(every row's loads in flight together, one reduction pass for all of them); indexer rows one
after another, so the 64 KB Hadamard matrix is read once per program. Skipped and tail rows
are masked, not branched. The arithmetic is ``finish_attention_rows`` / ``finish_indexer_row``,
which the fused C4 compressor kernel calls too: both paths round the same way.

bf16 mode (``round_bf16``) rounds where the release's bf16 tensors are rounded: the normed row
before RoPE, the rotated row (and, for the indexer, the Hadamard output); the rope dims of an
attention row are always stored as bf16. Rows whose destination is < 0 are skipped (padding).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import (
    IDX_ROW_BYTES, KV_DIM, KV_ROW_BYTES, bf16_bits, check_device, e4m3_decode, e4m3_encode,
    exp2_int, native, page_geometry, pow2_scale_exp, rope_pairs, round_bf16,
)
from dsv4_backend.kernels import pdl
from dsv4_backend.kernels.pdl import wait as pdl_wait


class FinishConfig(NamedTuple):
    """Launch shape of the finish / store kernels."""
    rows: int = 4  # rows per program, a power of two
    num_warps: int = 4

    def check(self) -> "FinishConfig":
        if self.rows < 1 or self.rows & (self.rows - 1):
            raise ValueError(f"FinishConfig.rows must be a power of two, got {self.rows}")
        return self


FINISH_DEFAULT = FinishConfig(2, 2)  # attention rows (D = 512): fastest on the H200 at 65536 rows
FINISH_INDEXER_DEFAULT = FinishConfig(4, 8)  # indexer rows (D = 128 + Hadamard; 4 warps spill)


# ---- row writers: the pool formats of memory/layout.py, with a row mask so that several rows
# ---- per program need no branch -----------------------------------------------------------

@triton.jit
def _store_kv_rows(pool_ptr, dest, P, page_stride, nope, rope_even, rope_odd, live,
                   NATIVE: tl.constexpr):
    """Quantise R attention rows and write their 584 bytes at slots ``dest`` (int64 [R]) where
    ``live`` [R]. nope: fp32 [R, 8, 64] (tile 7 ignored); rope_even / rope_odd: fp32 [R, 32],
    dims 448 + 2i and 449 + 2i. Returns the dequantised nope tiles [R, 8, 64]."""
    t = tl.arange(0, 8)
    c = tl.arange(0, 64)
    i = tl.arange(0, 32)
    slot = tl.maximum(dest, 0)
    page = slot // P
    j = slot % P
    part = page * page_stride + j * 576  # [R]
    group = page * page_stride + P * 576 + j * 8
    k = pow2_scale_exp(tl.max(tl.abs(nope), axis=2))  # [R, 8]
    q = tl.minimum(tl.maximum(nope * exp2_int(-k)[:, :, None], -448.0), 448.0)
    codes = e4m3_encode(q, NATIVE)
    tl.store(pool_ptr + part[:, None, None] + (t[:, None] * 64 + c[None, :])[None, :, :], codes,
             mask=(t[:, None] < 7)[None, :, :] & live[:, None, None])
    tl.store(pool_ptr + group[:, None] + t[None, :], tl.where(t[None, :] < 7, k + 127, 0).to(tl.uint8),
             mask=live[:, None])
    be = bf16_bits(rope_even, NATIVE)
    bo = bf16_bits(rope_odd, NATIVE)
    rb = pool_ptr + part[:, None] + 448 + 4 * i[None, :]
    rmask = live[:, None]
    tl.store(rb, (be & 255).to(tl.uint8), mask=rmask)
    tl.store(rb + 1, (be >> 8).to(tl.uint8), mask=rmask)
    tl.store(rb + 2, (bo & 255).to(tl.uint8), mask=rmask)
    tl.store(rb + 3, (bo >> 8).to(tl.uint8), mask=rmask)
    return e4m3_decode(codes, NATIVE) * exp2_int(k)[:, :, None]


@triton.jit
def _store_indexer_row(pool_ptr, dest, P, page_stride, y, live, NATIVE: tl.constexpr):
    """Quantise one indexer row ``y`` (fp32 [128]) and write its 132 bytes at row ``dest``
    (int64) when ``live``. Returns the dequantised values."""
    k = pow2_scale_exp(tl.max(tl.abs(y), axis=0))
    codes = e4m3_encode(tl.minimum(tl.maximum(y * exp2_int(-k), -448.0), 448.0), NATIVE)
    row = tl.maximum(dest, 0)
    base = (row // P) * page_stride
    off = row % P
    tl.store(pool_ptr + base + off * 128 + tl.arange(0, 128), codes, mask=live)
    sbits = (k + 127) << 23
    b = tl.arange(0, 4)
    tl.store(pool_ptr + base + P * 128 + off * 4 + b, ((sbits >> (8 * b)) & 255).to(tl.uint8), mask=live)
    return e4m3_decode(codes, NATIVE) * exp2_int(k)


# ---- the per-row arithmetic --------------------------------------------------------------

@triton.jit
def finish_attention_rows(x, xe, xo, wn, we, wo, cos, sin, dest, live, pool_ptr, P, page_stride,
                          out_rows, eps, ROUND_IN: tl.constexpr, ROUND_BF16: tl.constexpr,
                          WRITE_OUT: tl.constexpr, NATIVE: tl.constexpr):
    """Norm, RoPE, quantise and write R attention rows (D = 512).

    x: fp32 [R, 8, 64] nope tiles (tile 7 zero); xe / xo: fp32 [R, 32], dims 448 + 2i and
    449 + 2i; wn [8, 64] / we / wo [32]: the norm weight split the same way; cos / sin: fp32
    [R, 32]; dest: int64 [R] slots, written where ``live`` [R]; out_rows: [R] row pointers of
    ``out`` (WRITE_OUT).
    """
    t = tl.arange(0, 8)
    c = tl.arange(0, 64)
    i = tl.arange(0, 32)
    if ROUND_IN:
        x = round_bf16(x, NATIVE)
        xe = round_bf16(xe, NATIVE)
        xo = round_bf16(xo, NATIVE)
    ss = tl.sum(tl.sum(x * x, axis=2), axis=1) + tl.sum(xe * xe, axis=1) + tl.sum(xo * xo, axis=1)
    r = 1.0 / tl.sqrt(ss / 512 + eps)  # [R]
    x = x * r[:, None, None] * wn[None, :, :]
    xe = xe * r[:, None] * we[None, :]
    xo = xo * r[:, None] * wo[None, :]
    if ROUND_BF16:
        x = round_bf16(x, NATIVE)
        xe = round_bf16(xe, NATIVE)
        xo = round_bf16(xo, NATIVE)
    re, ro = rope_pairs(xe, xo, cos, sin)
    re = round_bf16(re, NATIVE)
    ro = round_bf16(ro, NATIVE)
    deq = _store_kv_rows(pool_ptr, dest, P, page_stride, x, re, ro, live, NATIVE)
    if WRITE_OUT:
        ty = out_rows.dtype.element_ty
        o = out_rows[:, None]
        omask = live[:, None]
        tl.store(out_rows[:, None, None] + (t[:, None] * 64 + c[None, :])[None, :, :], deq.to(ty),
                 mask=(t[:, None] < 7)[None, :, :] & live[:, None, None])
        tl.store(o + 448 + 2 * i[None, :], re.to(ty), mask=omask)
        tl.store(o + 449 + 2 * i[None, :], ro.to(ty), mask=omask)


@triton.jit
def finish_indexer_row(x, xe, xo, wn, we, wo, cos, sin, dest, live, pool_ptr, P, page_stride,
                       h_nope, h_even, h_odd, out_row, eps, ROUND_IN: tl.constexpr,
                       ROUND_BF16: tl.constexpr, WRITE_OUT: tl.constexpr, NATIVE: tl.constexpr):
    """Norm, RoPE, Hadamard, quantise and write one indexer row (D = 128).

    x: fp32 [2, 64] (tile 0: dims 0..63, tile 1 zero); xe / xo: fp32 [32], dims 64 + 2i and
    65 + 2i; wn / we / wo: the norm weight split the same way; cos / sin: fp32 [32]; dest:
    int64, written when ``live``; h_*: the Hadamard rows (``load_hadamard``); out_row: the row
    of ``out`` (WRITE_OUT).
    """
    t = tl.arange(0, 2)
    if ROUND_IN:
        x = round_bf16(x, NATIVE)
        xe = round_bf16(xe, NATIVE)
        xo = round_bf16(xo, NATIVE)
    ss = tl.sum(tl.sum(x * x, axis=1), axis=0) + tl.sum(xe * xe, axis=0) + tl.sum(xo * xo, axis=0)
    r = 1.0 / tl.sqrt(ss / 128 + eps)
    x = x * r * wn
    xe = xe * r * we
    xo = xo * r * wo
    if ROUND_BF16:
        x = round_bf16(x, NATIVE)
        xe = round_bf16(xe, NATIVE)
        xo = round_bf16(xo, NATIVE)
    re, ro = rope_pairs(xe, xo, cos, sin)
    if ROUND_BF16:
        re = round_bf16(re, NATIVE)
        ro = round_bf16(ro, NATIVE)
    # y = x @ H with x split as nope dims [0:64] and the rope pairs (64 + 2i, 65 + 2i)
    x0 = tl.sum(tl.where(t[:, None] == 0, x, 0.0), axis=0)  # the one nope tile, [64]
    y = (tl.sum(x0[:, None] * h_nope, axis=0) + tl.sum(re[:, None] * h_even, axis=0)
         + tl.sum(ro[:, None] * h_odd, axis=0))
    if ROUND_BF16:
        y = round_bf16(y, NATIVE)
    deq = _store_indexer_row(pool_ptr, dest, P, page_stride, y, live, NATIVE)
    if WRITE_OUT:
        tl.store(out_row + tl.arange(0, 128), deq.to(out_row.dtype.element_ty), mask=live)


@triton.jit
def load_hadamard(had_ptr, INDEXER: tl.constexpr):
    """The Hadamard rows finish_indexer_row multiplies by: [0:64], [64 + 2i], [65 + 2i] (x 128 cols)."""
    if INDEXER:
        c = tl.arange(0, 64)
        i = tl.arange(0, 32)
        kk = tl.arange(0, 128)
        h_nope = tl.load(had_ptr + c[:, None] * 128 + kk[None, :])
        h_even = tl.load(had_ptr + (64 + 2 * i)[:, None] * 128 + kk[None, :])
        h_odd = tl.load(had_ptr + (65 + 2 * i)[:, None] * 128 + kk[None, :])
    else:  # unused
        h_nope = 0.0
        h_even = 0.0
        h_odd = 0.0
    return h_nope, h_even, h_odd


@triton.jit
def load_norm_weight(w_ptr, D: tl.constexpr, NT: tl.constexpr):
    """The norm weight split as the finish helpers take it: nope tiles [NT, 64], rope even / odd [32]."""
    t = tl.arange(0, NT)
    c = tl.arange(0, 64)
    i = tl.arange(0, 32)
    nmask = t[:, None] < (D - 64) // 64
    wn = tl.load(w_ptr + t[:, None] * 64 + c[None, :], mask=nmask, other=0.0).to(tl.float32)
    we = tl.load(w_ptr + (D - 64) + 2 * i).to(tl.float32)
    wo = tl.load(w_ptr + (D - 63) + 2 * i).to(tl.float32)
    return wn, we, wo


@triton.jit
def any_written(dest_ptr, first, N, COUNT: tl.constexpr):
    """Whether any of destinations ``first .. first + COUNT - 1`` (those below N; first < N) is >= 0:
    a program of a decode graph's masked events (destination -1) skips its work."""
    last = tl.load(dest_ptr + first)
    for i in tl.static_range(1, COUNT):
        last = tl.maximum(last, tl.load(dest_ptr + first + i, mask=first + i < N, other=-1))
    return last >= 0


@triton.jit
def _finish_kernel(x_ptr, x_stride, w_ptr, cos_ptr, sin_ptr, cs_stride, dest_ptr, N,
                   pool_ptr, P, page_stride, had_ptr, out_ptr, out_stride, eps,
                   D: tl.constexpr, NT: tl.constexpr, ROWS: tl.constexpr,
                   ROUND_IN: tl.constexpr, ROUND_BF16: tl.constexpr, INDEXER: tl.constexpr,
                   WRITE_OUT: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    first = tl.program_id(0).to(tl.int64) * ROWS
    if any_written(dest_ptr, first, N, ROWS):   # else (a decode graph's masked events) no work
        _finish_rows(x_ptr, x_stride, w_ptr, cos_ptr, sin_ptr, cs_stride, dest_ptr, N, pool_ptr, P, page_stride,
                     had_ptr, out_ptr, out_stride, eps, first, D, NT, ROWS, ROUND_IN, ROUND_BF16, INDEXER,
                     WRITE_OUT, NATIVE)


@triton.jit
def _finish_rows(x_ptr, x_stride, w_ptr, cos_ptr, sin_ptr, cs_stride, dest_ptr, N,
                 pool_ptr, P, page_stride, had_ptr, out_ptr, out_stride, eps, first,
                 D: tl.constexpr, NT: tl.constexpr, ROWS: tl.constexpr,
                 ROUND_IN: tl.constexpr, ROUND_BF16: tl.constexpr, INDEXER: tl.constexpr,
                 WRITE_OUT: tl.constexpr, NATIVE: tl.constexpr):
    t = tl.arange(0, NT)  # nope tiles of 64 dims, padded to a power of two
    c = tl.arange(0, 64)
    i = tl.arange(0, 32)
    nope_off = t[:, None] * 64 + c[None, :]
    nmask = t[:, None] < (D - 64) // 64
    wn, we, wo = load_norm_weight(w_ptr, D, NT)
    h_nope, h_even, h_odd = load_hadamard(had_ptr, INDEXER)
    if INDEXER:  # a row at a time: the Hadamard product is [64 or 32, 128] per row already
        for rr in tl.static_range(ROWS):
            n = first + rr
            dest = tl.load(dest_ptr + n, mask=n < N, other=-1).to(tl.int64)
            live = dest >= 0
            row = x_ptr + n * x_stride
            x = tl.load(row + nope_off, mask=nmask & live, other=0.0).to(tl.float32)
            xe = tl.load(row + (D - 64) + 2 * i, mask=live, other=0.0).to(tl.float32)
            xo = tl.load(row + (D - 63) + 2 * i, mask=live, other=0.0).to(tl.float32)
            cos = tl.load(cos_ptr + n * cs_stride + i, mask=live, other=0.0)
            sin = tl.load(sin_ptr + n * cs_stride + i, mask=live, other=0.0)
            finish_indexer_row(x, xe, xo, wn, we, wo, cos, sin, dest, live, pool_ptr, P, page_stride,
                               h_nope, h_even, h_odd, out_ptr + n * out_stride, eps,
                               ROUND_IN, ROUND_BF16, WRITE_OUT, NATIVE)
    else:  # one group of ROWS rows per program, as one [ROWS, 8, 64] tile
        n, dest, live, x, xe, xo = _load_attention_rows(x_ptr, x_stride, dest_ptr, N, first // ROWS, ROWS)
        cos = tl.load(cos_ptr + n[:, None] * cs_stride + i[None, :], mask=live[:, None], other=0.0)
        sin = tl.load(sin_ptr + n[:, None] * cs_stride + i[None, :], mask=live[:, None], other=0.0)
        finish_attention_rows(x, xe, xo, wn, we, wo, cos, sin, dest, live, pool_ptr, P, page_stride,
                              out_ptr + n * out_stride, eps, ROUND_IN, ROUND_BF16, WRITE_OUT, NATIVE)


@triton.jit
def _load_attention_rows(x_ptr, x_stride, dest_ptr, N, g, ROWS: tl.constexpr):
    """Rows [g * ROWS, (g + 1) * ROWS) of ``x [N, 512]`` and their destinations, all loads in
    flight together: (row ids int64 [ROWS], dest int64 [ROWS], live [ROWS], nope fp32
    [ROWS, 8, 64] (tile 7 zero), rope even / odd fp32 [ROWS, 32]); rows past N or with
    dest < 0 are not live and load zeros."""
    t = tl.arange(0, 8)
    c = tl.arange(0, 64)
    i = tl.arange(0, 32)
    n = (g * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    dest = tl.load(dest_ptr + n, mask=n < N, other=-1).to(tl.int64)
    live = dest >= 0
    row = x_ptr + n * x_stride
    x = tl.load(row[:, None, None] + (t[:, None] * 64 + c[None, :])[None, :, :],
                mask=(t[:, None] < 7)[None, :, :] & live[:, None, None], other=0.0).to(tl.float32)
    xe = tl.load(row[:, None] + 448 + 2 * i[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    xo = tl.load(row[:, None] + 449 + 2 * i[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    return n, dest, live, x, xe, xo


def finish_rows(pool: torch.Tensor, dest: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, eps: float, round_in: bool, round_bf16: bool,
                hadamard: torch.Tensor | None = None, out: torch.Tensor | None = None,
                config: FinishConfig | None = None) -> torch.Tensor | None:
    """RMSNorm + RoPE (+ Hadamard) + FP8 of rows ``x [N, D]`` into ``pool`` at rows ``dest``.

    D = 512: attention rows into a 584-byte pool; D = 128 with ``hadamard`` ([128, 128] fp32):
    indexer rows into a 132-byte pool. ``out`` [N, D] optionally receives the dequantised rows.
    ``config``: launch shape (default FINISH_DEFAULT / FINISH_INDEXER_DEFAULT).
    """
    n, d = x.shape
    indexer = hadamard is not None
    if d != (128 if indexer else KV_DIM) or x.stride(1) != 1:
        raise ValueError(f"rows must be [N, {128 if indexer else KV_DIM}] with unit column "
                         f"stride, got {tuple(x.shape)}")
    if dest.shape != (n,) or cos.shape != (n, 32) or sin.shape != (n, 32):
        raise ValueError(f"dest [N] and cos/sin [N, 32] expected for N={n}; got "
                         f"{tuple(dest.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    check_device(pool, dest, x, norm_weight, cos, sin)
    P, page_stride, had = pool_args(pool, hadamard, norm_weight)
    cfg = (config or (FINISH_INDEXER_DEFAULT if indexer else FINISH_DEFAULT)).check()
    if n == 0:
        return out
    cos = cos.float().contiguous()
    sin = sin.float().contiguous()
    out_arg = out if out is not None else x
    _finish_kernel[(triton.cdiv(n, cfg.rows),)](
        x, x.stride(0), norm_weight.contiguous(), cos, sin, 32, dest.contiguous(), n,
        pool, P, page_stride, had, out_arg, out_arg.stride(0), eps,
        D=d, NT=8 if d == KV_DIM else 2, ROWS=cfg.rows,
        ROUND_IN=round_in, ROUND_BF16=round_bf16,
        INDEXER=indexer, WRITE_OUT=out is not None, NATIVE=native(), num_warps=cfg.num_warps, **pdl.args(x.device))
    return out


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def pool_args(pool: torch.Tensor, hadamard: torch.Tensor | None, placeholder: torch.Tensor):
    """(rows per page, page stride, Hadamard matrix or a placeholder pointer) for a finish launch."""
    if hadamard is not None:
        if hadamard.shape != (128, 128):
            raise ValueError(f"hadamard must be [128, 128], got {tuple(hadamard.shape)}")
        P, page_stride = page_geometry(pool, IDX_ROW_BYTES, "indexer")
        return P, page_stride, hadamard.float().contiguous()
    P, page_stride = page_geometry(pool, KV_ROW_BYTES, "attention")
    return P, page_stride, placeholder


def kv_store(pool: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6, round_bf16: bool = True,
             out: torch.Tensor | None = None, config: FinishConfig | None = None) -> torch.Tensor | None:
    """Normalise, rotate and quantise new KV rows into the SWA pool.

    pool: uint8 [num_pages, P * 584]; slots: int [N] (SWA slots, < 0 = skip);
    kv: [N, 512] pre-norm rows (wkv output, any float dtype); norm_weight: [512];
    cos, sin: fp32 [N, 32] for each token's position (the layer's frequencies);
    round_bf16: round the normed row to bf16 before RoPE (bf16 engine mode).
    out: optional [N, 512] (bf16 or fp32) receiving the dequantised rows (exact in bf16).
    Returns ``out``.
    """
    return finish_rows(pool, slots, kv, norm_weight, cos, sin, eps, round_in=False,
                       round_bf16=round_bf16, out=out, config=config)


# ---- store-only: rows already normalised and rotated ---------------------------------------

@triton.jit
def _store_kernel(x_ptr, x_stride, dest_ptr, N, pool_ptr, P, page_stride, ROWS: tl.constexpr,
                  NATIVE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    n, dest, live, x, re, ro = _load_attention_rows(x_ptr, x_stride, dest_ptr, N, tl.program_id(0), ROWS)
    _store_kv_rows(pool_ptr, dest, P, page_stride, x, round_bf16(re, NATIVE), round_bf16(ro, NATIVE),
                   live, NATIVE)


def kv_store_rows(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                  config: FinishConfig | None = None) -> None:
    """Quantise finished attention rows into the pool (no norm, no RoPE).

    The engine model hands the backend rows already normalised and rotated (``kv_norm`` and
    RoPE run with the rest of the layer's projections), so the store only rounds: nope dims to
    e4m3 with the tile scale, rope dims to bf16; the same bytes as ``memory.layout.write_kv_rows``.
    pool: uint8 [num_pages, P * 584]; slots: int [N] (< 0 = skip); rows: [N, 512] any float dtype.
    """
    n = rows.shape[0]
    if rows.dim() != 2 or rows.shape[1] != KV_DIM or rows.stride(1) != 1:
        raise ValueError(f"rows must be [N, {KV_DIM}] with unit column stride, got {tuple(rows.shape)}")
    if slots.shape != (n,):
        raise ValueError(f"slots must be [N={n}], got {tuple(slots.shape)}")
    check_device(pool, slots, rows)
    P, page_stride = page_geometry(pool, KV_ROW_BYTES, "attention")
    cfg = (config or FINISH_DEFAULT).check()
    if n == 0:
        return
    _store_kernel[(triton.cdiv(n, cfg.rows),)](rows, rows.stride(0), slots.contiguous(), n, pool, P,
                                               page_stride, ROWS=cfg.rows, NATIVE=native(),
                                               num_warps=cfg.num_warps, **pdl.args(rows.device))
