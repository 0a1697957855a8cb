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
(q: ``[T, H, D]`` -> H rows per token).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dsv4_backend.kernels._common import check_device, native, round_bf16, rope_pairs
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
def _norm_rope_kernel(x_ptr, stride_t, stride_h, w_ptr, pos_ptr, inv_ptr, out_ptr, D, rows_per_pos, eps,
                      BLOCK: tl.constexpr, NORM: tl.constexpr, HAS_W: tl.constexpr, ROPE: tl.constexpr,
                      INVERSE: tl.constexpr, BF16: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    # row r = token r // rows_per_pos, head r % rows_per_pos of x [T, rows_per_pos, D] (any
    # token / head strides, last dim contiguous); out is contiguous [T * rows_per_pos, D]
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    ok = d < D
    x_row = x_ptr + (r // rows_per_pos) * stride_t + (r % rows_per_pos) * stride_h
    o_row = out_ptr + r * D
    x = tl.load(x_row + d, mask=ok, other=0.0).to(tl.float32)
    f = 1.0
    if NORM:
        f = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        x = x * f
        if HAS_W:
            x = x * tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    y = _round_to(x, BF16, NATIVE)
    tl.store(o_row + d, y.to(out_ptr.dtype.element_ty), mask=d < D - ROPE)
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
        pos = tl.load(pos_ptr + r // rows_per_pos).to(tl.float32)
        ang = pos * tl.load(inv_ptr + i)
        c, s = _cos_sin(ang, NATIVE)
        if INVERSE:
            s = -s
        re, ro = rope_pairs(xe, xo, c, s)
        tl.store(o_row + ie, _round_to(re, BF16, NATIVE).to(out_ptr.dtype.element_ty))
        tl.store(o_row + ie + 1, _round_to(ro, BF16, NATIVE).to(out_ptr.dtype.element_ty))


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
