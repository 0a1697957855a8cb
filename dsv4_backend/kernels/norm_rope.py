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
  ``INVERSE``; the pairs are loaded a second time as (even, odd) vectors and given the same norm
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

from dsv4_backend.kernels._common import check_device, native, round_bf16, rope_pairs


@triton.jit
def _round_to(x, BF16: tl.constexpr, NATIVE: tl.constexpr):
    # the value x takes once stored in the output dtype (bf16 rounds; fp32 is already there)
    if BF16:
        return round_bf16(x, NATIVE)
    else:
        return x


@triton.jit
def _norm_rope_kernel(x_ptr, x_stride, w_ptr, pos_ptr, inv_ptr, out_ptr, out_stride, D, rows_per_pos, eps,
                      BLOCK: tl.constexpr, NORM: tl.constexpr, HAS_W: tl.constexpr, ROPE: tl.constexpr,
                      INVERSE: tl.constexpr, BF16: tl.constexpr, NATIVE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    ok = d < D
    x_row, o_row = x_ptr + r * x_stride, out_ptr + r * out_stride
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
        HALF: tl.constexpr = ROPE // 2
        i = tl.arange(0, HALF)
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
        c, s = tl.cos(ang), tl.sin(ang)
        if INVERSE:
            s = -s
        re, ro = rope_pairs(xe, xo, c, s)
        tl.store(o_row + ie, _round_to(re, BF16, NATIVE).to(out_ptr.dtype.element_ty))
        tl.store(o_row + ie + 1, _round_to(ro, BF16, NATIVE).to(out_ptr.dtype.element_ty))


def norm_rope(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, positions: Optional[torch.Tensor] = None,
              inv_freq: Optional[torch.Tensor] = None, norm: bool = True, inverse: bool = False,
              out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """RMS-normalise the last dim of ``x [..., D]`` (times ``weight [D]`` if given; skipped when
    ``norm=False``), then RoPE its last ``2 * len(inv_freq)`` dims at ``positions`` (skipped when
    ``inv_freq`` is None). ``positions [T]`` covers ``x.shape[0] = T`` tokens, every row of a token
    at its position. Arithmetic in fp32; out in ``out_dtype`` (default x's: float32 or bfloat16)."""
    D = x.shape[-1]
    out_dtype = out_dtype or x.dtype
    if x.dtype not in (torch.float32, torch.bfloat16) or out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"norm_rope: x / out must be float32 or bfloat16, got {x.dtype} -> {out_dtype}")
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rope = 0 if inv_freq is None else 2 * inv_freq.numel()
    if rope not in (0, 64) or rope > D:
        raise ValueError(f"norm_rope: RoPE needs 32 frequencies and D >= 64, got {rope // 2} and D = {D}")
    if weight is not None and weight.shape != (D,):
        raise ValueError(f"norm_rope: weight must be [{D}], got {tuple(weight.shape)}")
    rows_per_pos = 1
    if rope:
        if positions is None or positions.dim() != 1 or x2.shape[0] % max(positions.numel(), 1):
            raise ValueError(f"norm_rope: positions must be [T] with T dividing the {x2.shape[0]} rows, "
                             f"got {None if positions is None else tuple(positions.shape)}")
        rows_per_pos = x2.shape[0] // max(positions.numel(), 1)
    check_device(*[t for t in (x2, weight, positions, inv_freq) if t is not None])
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    n = x2.shape[0]
    if n:
        dummy = x2
        _norm_rope_kernel[(n,)](
            x2, x2.stride(0), weight if weight is not None else dummy,
            positions if rope else dummy, inv_freq.to(torch.float32).contiguous() if rope else dummy,
            out, D, D, max(rows_per_pos, 1), float(eps),
            BLOCK=triton.next_power_of_2(D), NORM=norm, HAS_W=weight is not None and norm, ROPE=rope,
            INVERSE=inverse, BF16=out_dtype == torch.bfloat16, NATIVE=native())
    return out
