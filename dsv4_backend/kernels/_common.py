"""Byte-format helpers shared by the Triton kernels.

The pools' formats are documented once, in ``memory/layout.py``; this module restates the
offsets the kernels compute and gives ``@triton.jit`` helpers for the number formats:

- attention pool (584-byte rows, page of P rows): row ``j`` of page ``p`` has its
  ``[448 x e4m3 | 64 x bf16]`` part at ``p * page_stride + j * 576`` and its 8 scale bytes
  (7 x ue8m0 exponent + 127, 1 pad) at ``p * page_stride + P * 576 + j * 8``;
- indexer pool (132-byte rows): values at ``p * page_stride + j * 128``, fp32 scale at
  ``p * page_stride + P * 128 + j * 4``.

Every helper takes ``NATIVE``: on a GPU the hardware conversions are used (e4m3 and bf16 round
to nearest even there); under ``TRITON_INTERPRET=1`` the interpreter truncates float->bf16 and
float->e4m3 and cannot load through re-typed pointers, so the same results are built from
integer operations on the bit patterns. Both paths give identical bits.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# The byte layouts are written down once, in memory/layout.py; the kernels read them from there.
from memory.layout import INDEXER_ROW_BYTES as IDX_ROW_BYTES  # noqa: F401
from memory.layout import KV_ROW_BYTES, pool_page_size  # noqa: F401
from memory.quant import KV_DIM  # noqa: F401


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def native() -> bool:
    return not interpreting()


def dot_dtype() -> torch.dtype:
    """The interpreter computes bf16 dots and sums wrongly, so it gets fp32 operands."""
    return torch.float32 if interpreting() else torch.bfloat16


def page_geometry(pool: torch.Tensor, row_bytes: int, what: str) -> tuple[int, int]:
    """(rows per page P, page stride in bytes) of a uint8 ``[num_pages, page_bytes]`` pool."""
    return pool_page_size(pool, row_bytes, what), pool.stride(0)


def check_device(*tensors: torch.Tensor) -> None:
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"all kernel inputs must be on one device; got {t.device} and {dev}")
    if dev.type != "cuda" and not interpreting():
        raise RuntimeError("Triton kernels need a CUDA tensor, or TRITON_INTERPRET=1 for the CPU")


# ---- number formats -------------------------------------------------------------------------

@triton.jit
def exp2_int(k):
    """2**k as fp32 for an int32 k in the normal range (built from the exponent field)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def pow2_scale_exp(amax):
    """k with 2**k = 2**ceil(log2(max(amax, 1e-4) / 448)), read from amax's bits (no division:
    amax = m * 2**E, 448 = 1.75 * 2**8, so k = E - 8, plus 1 when m > 1.75)."""
    a = tl.maximum(amax, 1e-4)
    bits = a.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 255) - 127
    return e - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)


@triton.jit
def round_bf16(x, NATIVE: tl.constexpr):
    """fp32 -> nearest-even bf16 value, returned as fp32."""
    if NATIVE:
        return x.to(tl.bfloat16).to(tl.float32)
    else:
        bits = x.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return (r << 16).to(tl.float32, bitcast=True)


@triton.jit
def bf16_bits(x, NATIVE: tl.constexpr):
    """fp32 -> the 16 bits of its nearest-even bf16, as int32 in [0, 65536)."""
    if NATIVE:
        return x.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int32)
    else:
        bits = x.to(tl.int32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


@triton.jit
def bf16_from_bytes(lo, hi):
    """Two uint8 bytes (little-endian) of a bf16 -> fp32."""
    return ((hi.to(tl.int32) << 24) | (lo.to(tl.int32) << 16)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_encode(x, NATIVE: tl.constexpr):
    """fp32 already clamped to [-448, 448] -> e4m3 bits (round to nearest even), uint8."""
    if NATIVE:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        bits = x.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 128
        mag = bits & 0x7FFFFFFF
        # normal range: keep 3 mantissa bits with round-half-even; the carry may bump the exponent
        normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
        # subnormals are multiples of 2**-9; rounding 8 * 2**-9 up gives code 8 = 2**-6, exact
        v = tl.abs(x) * 512.0
        f = v.to(tl.int32)
        frac = v - f.to(tl.float32)
        up = (frac > 0.5) | ((frac == 0.5) & ((f & 1) == 1))
        sub = f + up.to(tl.int32)
        code = tl.where(tl.abs(x) < 0.015625, sub, normal)
        return (code | sign).to(tl.uint8)


FP8_MAX = 448.0
FP8_MAX_C = tl.constexpr(FP8_MAX)


@triton.jit
def quant_block_e4m3(x, NATIVE: tl.constexpr):
    """x fp32 [R, 128] (one 128-wide block per row) -> (e4m3 bits uint8 [R, 128], fp32 scale [R]),
    the activation rounding of DeepSeek's FP8 linears (``fp8_gemm.act_quant_fp8``). x / s is x
    times an exact power of two, so no rounding happens before the e4m3 cast."""
    k = pow2_scale_exp(tl.max(tl.abs(x), axis=1))
    v = tl.minimum(tl.maximum(x * exp2_int(-k)[:, None], -FP8_MAX_C), FP8_MAX_C)
    return e4m3_encode(v, NATIVE), exp2_int(k)


@triton.jit
def e4m3_decode(bits, NATIVE: tl.constexpr):
    """e4m3 bits (uint8) -> fp32 (exact)."""
    if NATIVE:
        return bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        b = bits.to(tl.int32)
        e = (b >> 3) & 15
        m = b & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
        return tl.where((b & 128) != 0, -v, v)


@triton.jit
def e2m1_times_2m14(code):
    """e2m1 nibble (int32: bit 3 sign, magnitudes 0 .5 1 1.5 2 3 4 6) -> fp32 value x 2^-14, exact.
    The nibble's exponent and mantissa bits, moved to an fp16's exponent (bits 11..10) and top
    mantissa bit (9), read as fp16 give the value x 2^-14 for every code, 0.5 (an fp16
    subnormal) included: five integer operations, no table, no select."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


# ---- rows ---------------------------------------------------------------------------------

@triton.jit
def rope_pairs(even, odd, cos, sin):
    """Interleaved RoPE on pairs (2i, 2i+1), all fp32 [32]: returns the rotated (even, odd)."""
    return even * cos - odd * sin, even * sin + odd * cos


