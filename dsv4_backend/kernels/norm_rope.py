"""RMSNorm and RoPE of one row in one launch: the block norms, q / kv norms with their RoPE, and
the inverse RoPE of the attention output.

The torch path (``model.rms_norm`` then ``Rotary.apply``) costs ~6 small kernels per norm and
~15 per RoPE (angles, cos, sin, slices, stack, cat, casts); a decode step runs them in every
layer for q, kv, the indexer's q, the output and the two block norms. Here one program handles
one row of ``D`` values:

- ``NORM``: ``x * rsqrt(mean(x^2) + eps)`` in fp32, times ``weight`` when given (the block and
  q / kv norms; q's per-head norm has no weight);
- ``ROPE`` (64 or 0): interleaved RoPE on the last ``ROPE`` dims at the row's position,
  ``angle_i = float32(pos) * inv_freq_i`` in fp32 (the release's angles), ``-angle`` when
  ``INVERSE``, cos / sin from libdevice (exact argument reduction, as torch's); the pairs are loaded a second time as (even, odd) vectors and given the same norm
  factor, so no register shuffle is needed.

Rounding follows the torch path exactly: the normalised row is rounded to the output dtype
before RoPE (``RMSNorm`` returns the input dtype, ``Rotary.apply`` rotates those values in fp32),
and the result once more on the store. ``positions`` has one entry per ``rows_per_pos`` rows
(q: ``[T, H, D]`` -> H rows per token). ``norm_pair`` runs two such row sets in one launch (an
attention's q_lora norm beside its kv norm + RoPE).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dsv4_backend.kernels._common import KV_DIM, KV_ROW_BYTES, check_device, native, page_geometry, round_bf16, rope_pairs
from dsv4_backend.kernels.kv_store import _store_kv_rows
from dsv4_backend.kernels import pdl
from dsv4_backend.kernels.pdl import wait as pdl_wait


@triton.jit
def _round_to(x, BF16: tl.constexpr, NATIVE: tl.constexpr):
    # the value x takes once stored in the output dtype (bf16 rounds; fp32 is already there)
    if BF16:
        return round_bf16(x, NATIVE)
    else:
        return x


@triton.jit
def _cos_sin(a, NATIVE: tl.constexpr):
    # libdevice's cosf / sinf reduce the argument exactly: angles reach 1e6 rad at 1M positions,
    # where an approximate hardware sin / cos would be wrong; the interpreter has no libdevice
    if NATIVE:
        return libdevice.cos(a), libdevice.sin(a)
    else:
        return tl.cos(a), tl.sin(a)


@triton.jit
def _norm_rope_row(x_row, w_ptr, pos_ptr, inv_ptr, o_row, tok, D, eps, BLOCK: tl.constexpr, NORM: tl.constexpr,
                   HAS_W: tl.constexpr, ROPE: tl.constexpr, INVERSE: tl.constexpr, BF16: tl.constexpr,
                   NATIVE: tl.constexpr):
    """One row of D values at x_row (contiguous) -> o_row; ``tok`` indexes its position."""
    d = tl.arange(0, BLOCK)
    ok = d < D
    x = tl.load(x_row + d, mask=ok, other=0.0).to(tl.float32)
    f = 1.0
    if NORM:
        f = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        x = x * f
        if HAS_W:
            x = x * tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    y = _round_to(x, BF16, NATIVE)
    tl.store(o_row + d, y.to(o_row.dtype.element_ty), mask=d < D - ROPE)
    re = y    # (returned as is without RoPE)
    ro = y
    if ROPE > 0:
        i = tl.arange(0, ROPE // 2)
        ie = D - ROPE + 2 * i
        xe = tl.load(x_row + ie).to(tl.float32)
        xo = tl.load(x_row + ie + 1).to(tl.float32)
        if NORM:
            xe, xo = xe * f, xo * f
            if HAS_W:
                xe = xe * tl.load(w_ptr + ie).to(tl.float32)
                xo = xo * tl.load(w_ptr + ie + 1).to(tl.float32)
            xe, xo = _round_to(xe, BF16, NATIVE), _round_to(xo, BF16, NATIVE)
        pos = tl.load(pos_ptr + tok).to(tl.float32)
        ang = pos * tl.load(inv_ptr + i)
        c, s = _cos_sin(ang, NATIVE)
        if INVERSE:
            s = -s
        re, ro = rope_pairs(xe, xo, c, s)
        re, ro = _round_to(re, BF16, NATIVE), _round_to(ro, BF16, NATIVE)
        tl.store(o_row + ie, re.to(o_row.dtype.element_ty))
        tl.store(o_row + ie + 1, ro.to(o_row.dtype.element_ty))
    # the stored values: y (dims D - ROPE and up hold the normalised values before RoPE), and the
    # rotated pairs at dims D - ROPE + 2i, + 2i + 1
    return y, re, ro


@triton.jit
def _norm_rope_kernel(x_ptr, stride_t, stride_h, w_ptr, pos_ptr, inv_ptr, out_ptr, D, rows_per_pos, eps,
                      BLOCK: tl.constexpr, NORM: tl.constexpr, HAS_W: tl.constexpr, ROPE: tl.constexpr,
                      INVERSE: tl.constexpr, BF16: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    # row r = token r // rows_per_pos, head r % rows_per_pos of x [T, rows_per_pos, D] (any
    # token / head strides, last dim contiguous); out is contiguous [T * rows_per_pos, D]
    r = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + (r // rows_per_pos) * stride_t + (r % rows_per_pos) * stride_h
    _norm_rope_row(x_row, w_ptr, pos_ptr, inv_ptr, out_ptr + r * D, r // rows_per_pos, D, eps,
                   BLOCK, NORM, HAS_W, ROPE, INVERSE, BF16, NATIVE)


@triton.jit
def _norm_pair_kernel(a_ptr, a_stride, wa_ptr, oa_ptr, Da, eps_a, b_ptr, b_stride, wb_ptr, ob_ptr, Db, eps_b,
                      pos_ptr, inv_ptr, T, slot_ptr, pool_ptr, P, page_stride,
                      BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, ROPE_B: tl.constexpr,
                      BF16: tl.constexpr, STORE: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    # programs 0 .. T - 1: row t of a (weighted norm); T .. 2T - 1: row t of b (weighted norm + RoPE)
    r = tl.program_id(0).to(tl.int64)
    if r < T:
        _norm_rope_row(a_ptr + r * a_stride, wa_ptr, pos_ptr, inv_ptr, oa_ptr + r * Da, r, Da, eps_a,
                       BLOCK_A, True, True, 0, False, BF16, NATIVE)
    else:
        t = r - T
        y, re, ro = _norm_rope_row(b_ptr + t * b_stride, wb_ptr, pos_ptr, inv_ptr, ob_ptr + t * Db, t, Db, eps_b,
                                   BLOCK_B, True, True, ROPE_B, False, BF16, NATIVE)
        if STORE:    # the KV row into its SWA slot: kv_store_rows' bytes, from the values just stored
            dest = tl.load(slot_ptr + t + tl.arange(0, 1)).to(tl.int64)
            # tile 7 of y (the rope dims before RoPE) is not written: _store_kv_rows skips it
            _store_kv_rows(pool_ptr, dest, P, page_stride, tl.reshape(y, [1, 8, 64]),
                           tl.expand_dims(round_bf16(re, NATIVE), 0), tl.expand_dims(round_bf16(ro, NATIVE), 0),
                           dest >= 0, NATIVE)


def norm_rope(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, positions: Optional[torch.Tensor] = None,
              inv_freq: Optional[torch.Tensor] = None, norm: bool = True, inverse: bool = False,
              out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """RMS-normalise the last dim of ``x [T, D]`` or ``[T, H, D]`` (times ``weight [D]`` if given;
    skipped when ``norm=False``), then RoPE its last ``2 * len(inv_freq)`` dims at ``positions``
    (skipped when ``inv_freq`` is None); ``positions [T]``: every row of token t at positions[t].
    x may be a view with any token / head strides (a column slice of a stacked projection) as long
    as its last dim is contiguous. Arithmetic in fp32; out contiguous, in ``out_dtype`` (default
    x's: float32 or bfloat16)."""
    D = x.shape[-1]
    out_dtype = out_dtype or x.dtype
    if x.dtype not in (torch.float32, torch.bfloat16) or out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"norm_rope: x / out must be float32 or bfloat16, got {x.dtype} -> {out_dtype}")
    if x.dim() not in (2, 3):
        raise ValueError(f"norm_rope: x must be [T, D] or [T, H, D], got {tuple(x.shape)}")
    x3 = x if x.dim() == 3 else x[:, None, :]
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    rope = 0 if inv_freq is None else 2 * inv_freq.numel()
    if rope not in (0, 64) or rope > D:
        raise ValueError(f"norm_rope: RoPE needs 32 frequencies and D >= 64, got {rope // 2} and D = {D}")
    if weight is not None and weight.shape != (D,):
        raise ValueError(f"norm_rope: weight must be [{D}], got {tuple(weight.shape)}")
    T, R = x3.shape[0], x3.shape[1]
    if rope and (positions is None or positions.dim() != 1 or positions.numel() != T):
        raise ValueError(f"norm_rope: positions must be [T] for x of shape {tuple(x.shape)}, "
                         f"got {None if positions is None else tuple(positions.shape)}")
    check_device(*[t for t in (x3, weight, positions, inv_freq) if t is not None])
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if T * R:
        dummy = x3
        _norm_rope_kernel[(T * R,)](
            x3, x3.stride(0), x3.stride(1), weight if weight is not None else dummy,
            positions if rope else dummy, inv_freq.to(torch.float32).contiguous() if rope else dummy,
            out, D, R, float(eps),
            BLOCK=triton.next_power_of_2(D), NORM=norm, HAS_W=weight is not None and norm, ROPE=rope,
            INVERSE=inverse, BF16=out_dtype == torch.bfloat16, NATIVE=native(), **pdl.args(x3.device))
    return out


def norm_pair(a: torch.Tensor, weight_a: torch.Tensor, eps_a: float, b: torch.Tensor, weight_b: torch.Tensor,
              eps_b: float, positions: torch.Tensor, inv_freq: torch.Tensor,
              store: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm_rope(a, weight_a, eps_a)`` and ``norm_rope(b, weight_b, eps_b, positions, inv_freq)`` in one
    launch (an attention's q_lora norm and its kv norm + RoPE: both rows come from one projection
    and neither waits for the other); each row computed as ``norm_rope`` computes it. a, b:
    ``[T, Da]``, ``[T, Db]`` of one dtype (float32 / bfloat16), any token stride, last dim contiguous.
    ``store = (pool, slots)``: b's rows (Db = 512) also go into the SWA pool at ``slots [T]`` (< 0:
    skipped), the bytes ``kv_store_rows(pool, slots, out_b)`` writes, so the store needs no launch."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0] or a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError(f"norm_pair: a and b must be [T, D] with a contiguous last dim and one T, got "
                         f"{tuple(a.shape)} {a.stride()} and {tuple(b.shape)} {b.stride()}")
    if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"norm_pair: a and b must share a float32 / bfloat16 dtype, got {a.dtype}, {b.dtype}")
    T, Da, Db = a.shape[0], a.shape[1], b.shape[1]
    if weight_a.shape != (Da,) or weight_b.shape != (Db,):
        raise ValueError(f"norm_pair: weights must be [{Da}] and [{Db}], got {tuple(weight_a.shape)} "
                         f"and {tuple(weight_b.shape)}")
    rope = 2 * inv_freq.numel()
    if rope != 64 or rope > Db or positions.dim() != 1 or positions.numel() != T:
        raise ValueError(f"norm_pair: b's RoPE needs 32 frequencies, Db >= 64 and positions [T], got "
                         f"{rope // 2}, Db = {Db}, positions {tuple(positions.shape)}")
    check_device(a, b, weight_a, weight_b, positions, inv_freq)
    out_a = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    out_b = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    pool, slots, P, page_stride = out_b, positions, 0, 0    # (unread without a store)
    if store is not None:
        pool, slots = store
        if Db != KV_DIM or slots.shape != (T,):
            raise ValueError(f"norm_pair: a store takes b rows of {KV_DIM} and slots [T={T}], got Db = {Db} and "
                             f"slots {tuple(slots.shape)}")
        check_device(a, pool, slots)
        slots = slots.contiguous()
        P, page_stride = page_geometry(pool, KV_ROW_BYTES, "attention")
    if T:
        _norm_pair_kernel[(2 * T,)](
            a, a.stride(0), weight_a, out_a, Da, float(eps_a), b, b.stride(0), weight_b, out_b, Db, float(eps_b),
            positions, inv_freq.to(torch.float32).contiguous(), T, slots, pool, P, page_stride,
            BLOCK_A=triton.next_power_of_2(Da), BLOCK_B=triton.next_power_of_2(Db), ROPE_B=rope,
            BF16=a.dtype == torch.bfloat16, STORE=store is not None, NATIVE=native(), **pdl.args(a.device))
    return out_a, out_b
