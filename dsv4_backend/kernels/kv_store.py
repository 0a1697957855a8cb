"""KV store: kv_norm, RoPE and FP8 quantisation of new tokens' rows, written into the SWA pool.

One program per row: read the pre-norm row, RMSNorm with the weight (fp32), RoPE on the last 64
dims (interleaved pairs, the caller's cos/sin for the row's position), then the row's bytes.
The same kernel finishes compressed rows (``dsv4_backend.kernels.compressor``): there the
input is the pooled row, rounded to bf16 first in bf16 mode, and the indexer variant (D = 128)
applies the 128-point Hadamard rotation and writes a 132-byte row instead of a 584-byte one.

bf16 mode (``round_bf16``) rounds where the release's bf16 tensors are rounded: the normed row
before RoPE, the rotated row (and, for the indexer, the Hadamard output); the rope dims of an
attention row are always stored as bf16. Rows whose destination is < 0 are skipped (padding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import (
    IDX_ROW_BYTES, KV_DIM, KV_ROW_BYTES, check_device, kv_row_offsets, native, page_geometry,
    rope_pairs, round_bf16, store_indexer_row, store_kv_row,
)


@triton.jit
def _finish_kernel(x_ptr, x_stride, w_ptr, cos_ptr, sin_ptr, cs_stride, dest_ptr,
                   pool_ptr, P, page_stride, had_ptr, out_ptr, out_stride, eps,
                   D: tl.constexpr, NT: tl.constexpr, ROUND_IN: tl.constexpr, ROUND_BF16: tl.constexpr,
                   INDEXER: tl.constexpr, WRITE_OUT: tl.constexpr, NATIVE: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    dest = tl.load(dest_ptr + n).to(tl.int64)
    if dest >= 0:
        t = tl.arange(0, NT)  # nope tiles of 64 dims, padded to a power of two
        c = tl.arange(0, 64)
        i = tl.arange(0, 32)
        nope_off = t[:, None] * 64 + c[None, :]
        nmask = t[:, None] < (D - 64) // 64
        row = x_ptr + n * x_stride
        x = tl.load(row + nope_off, mask=nmask, other=0.0).to(tl.float32)
        xe = tl.load(row + (D - 64) + 2 * i).to(tl.float32)
        xo = tl.load(row + (D - 63) + 2 * i).to(tl.float32)
        if ROUND_IN:
            x = round_bf16(x, NATIVE)
            xe = round_bf16(xe, NATIVE)
            xo = round_bf16(xo, NATIVE)
        ss = tl.sum(tl.sum(x * x, axis=1), axis=0) + tl.sum(xe * xe, axis=0) + tl.sum(xo * xo, axis=0)
        r = 1.0 / tl.sqrt(ss / D + eps)
        x = x * r * tl.load(w_ptr + nope_off, mask=nmask, other=0.0).to(tl.float32)
        xe = xe * r * tl.load(w_ptr + (D - 64) + 2 * i).to(tl.float32)
        xo = xo * r * tl.load(w_ptr + (D - 63) + 2 * i).to(tl.float32)
        if ROUND_BF16:
            x = round_bf16(x, NATIVE)
            xe = round_bf16(xe, NATIVE)
            xo = round_bf16(xo, NATIVE)
        cos = tl.load(cos_ptr + n * cs_stride + i)
        sin = tl.load(sin_ptr + n * cs_stride + i)
        re, ro = rope_pairs(xe, xo, cos, sin)
        if INDEXER:
            if ROUND_BF16:
                re = round_bf16(re, NATIVE)
                ro = round_bf16(ro, NATIVE)
            # y = x @ H with x split as nope dims [0:64] and the rope pairs (64 + 2i, 65 + 2i)
            kk = tl.arange(0, 128)
            h_nope = tl.load(had_ptr + c[:, None] * 128 + kk[None, :])
            h_even = tl.load(had_ptr + (64 + 2 * i)[:, None] * 128 + kk[None, :])
            h_odd = tl.load(had_ptr + (65 + 2 * i)[:, None] * 128 + kk[None, :])
            x0 = tl.sum(tl.where(t[:, None] == 0, x, 0.0), axis=0)  # the one nope tile, [64]
            y = (tl.sum(x0[:, None] * h_nope, axis=0) + tl.sum(re[:, None] * h_even, axis=0)
                 + tl.sum(ro[:, None] * h_odd, axis=0))
            if ROUND_BF16:
                y = round_bf16(y, NATIVE)
            deq = store_indexer_row(pool_ptr, dest, P, page_stride, y, NATIVE)
            if WRITE_OUT:
                tl.store(out_ptr + n * out_stride + kk, deq.to(out_ptr.dtype.element_ty))
        else:
            re = round_bf16(re, NATIVE)
            ro = round_bf16(ro, NATIVE)
            part, group = kv_row_offsets(dest, P, page_stride)
            deq = store_kv_row(pool_ptr, part, group, x, re, ro, NATIVE)
            if WRITE_OUT:
                o = out_ptr + n * out_stride
                tl.store(o + nope_off, deq.to(out_ptr.dtype.element_ty), mask=nmask)
                tl.store(o + 448 + 2 * i, re.to(out_ptr.dtype.element_ty))
                tl.store(o + 449 + 2 * i, ro.to(out_ptr.dtype.element_ty))


def finish_rows(pool: torch.Tensor, dest: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, eps: float, round_in: bool, round_bf16: bool,
                hadamard: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """RMSNorm + RoPE (+ Hadamard) + FP8 of rows ``x [N, D]`` into ``pool`` at rows ``dest``.

    D = 512: attention rows into a 584-byte pool; D = 128 with ``hadamard`` ([128, 128] fp32):
    indexer rows into a 132-byte pool. ``out`` [N, D] optionally receives the dequantised rows.
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
    if indexer:
        P, page_stride = page_geometry(pool, IDX_ROW_BYTES, "indexer")
        had = hadamard.float().contiguous()
    else:
        P, page_stride = page_geometry(pool, KV_ROW_BYTES, "attention")
        had = norm_weight
    if n == 0:
        return out
    cos = cos.float().contiguous()
    sin = sin.float().contiguous()
    out_arg = out if out is not None else x
    _finish_kernel[(n,)](
        x, x.stride(0), norm_weight.contiguous(), cos, sin, 32, dest.contiguous(),
        pool, P, page_stride, had, out_arg, out_arg.stride(0), eps,
        D=d, NT=8 if d == KV_DIM else 2, ROUND_IN=round_in, ROUND_BF16=round_bf16, INDEXER=indexer,
        WRITE_OUT=out is not None, NATIVE=native(), num_warps=4 if indexer else 2)
    return out


def kv_store(pool: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6, round_bf16: bool = True,
             out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Normalise, rotate and quantise new KV rows into the SWA pool.

    pool: uint8 [num_pages, P * 584]; slots: int [N] (SWA slots, < 0 = skip);
    kv: [N, 512] pre-norm rows (wkv output, any float dtype); norm_weight: [512];
    cos, sin: fp32 [N, 32] for each token's position (the layer's frequencies);
    round_bf16: round the normed row to bf16 before RoPE (bf16 engine mode).
    out: optional [N, 512] (bf16 or fp32) receiving the dequantised rows (exact in bf16).
    Returns ``out``.
    """
    return finish_rows(pool, slots, kv, norm_weight, cos, sin, eps, round_in=False,
                       round_bf16=round_bf16, out=out)


# ---- store-only: rows already normalised and rotated ---------------------------------------

@triton.jit
def _store_kernel(x_ptr, x_stride, dest_ptr, pool_ptr, P, page_stride, NATIVE: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    dest = tl.load(dest_ptr + n).to(tl.int64)
    if dest >= 0:
        t = tl.arange(0, 8)
        c = tl.arange(0, 64)
        i = tl.arange(0, 32)
        row = x_ptr + n * x_stride
        x = tl.load(row + t[:, None] * 64 + c[None, :], mask=t[:, None] < 7, other=0.0).to(tl.float32)
        re = round_bf16(tl.load(row + 448 + 2 * i).to(tl.float32), NATIVE)
        ro = round_bf16(tl.load(row + 449 + 2 * i).to(tl.float32), NATIVE)
        part, group = kv_row_offsets(dest, P, page_stride)
        store_kv_row(pool_ptr, part, group, x, re, ro, NATIVE)


def kv_store_rows(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
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
    if n == 0:
        return
    _store_kernel[(n,)](rows, rows.stride(0), slots.contiguous(), pool, P, page_stride,
                        NATIVE=native(), num_warps=2)
