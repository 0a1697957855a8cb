"""The indexer's query heads in one launch: RoPE, the 128-point Hadamard rotation, FP8 rounding.

``model.Attention._indexer_inputs`` turns ``indexer.wq_b(qr)`` into the heads the scores read:
``indexer_fake_quant(hadamard(rope(iq)))``. As torch ops on a decode step that is a RoPE launch,
a bf16 GEMM with the Hadamard matrix and ~15 elementwise launches of the fake quantisation
(amax, scale, divide, the e4m3 rounding's integer steps, the product back), in every CSA layer.
Here one program takes 16 heads of one token:

- the head's last 64 dims rotated at the token's position in fp32 and rounded to bf16 (what
  ``Rotary.apply`` stores; its first 64 dims pass unchanged), cos / sin as ``norm_rope``'s;
- ``y = x @ H`` with H the model's bf16 Hadamard matrix (``model.hadamard_matrix``), three
  tensor-core products (the unrotated half, the rotated even and odd dims against the matching
  rows of H) accumulated in fp32, then rounded to bf16 (the GEMM's output dtype);
- per head, the KV rule's power-of-two scale ``2^ceil(log2(max(amax, 1e-4) / 448))`` and the
  e4m3 rounding of ``y / scale``, stored as ``e4m3 * scale`` in bf16 (exact: 3 mantissa bits).

Only the fp32 summation order of the Hadamard product differs from the torch path (and the
hardware's cos / sin against torch's by an ulp), so a head's y can differ by one bf16 rounding
and its e4m3 value by one step; ``tests/test_indexer_q.py`` bounds the output against float64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import (
    check_device, dot_dtype, e4m3_decode, e4m3_encode, exp2_int, native, pow2_scale_exp, round_bf16, rope_pairs,
)
from dsv4_backend.kernels.norm_rope import _cos_sin
from dsv4_backend.kernels import pdl
from dsv4_backend.kernels.pdl import wait as pdl_wait

HEAD_DIM = 128
ROPE_DIM = 64
HEADS_PER_PROGRAM = 16  # the tensor-core product's smallest M


@triton.jit
def _indexer_q_kernel(x_ptr, stride_t, pos_ptr, inv_ptr, h_ptr, out_ptr, H,
                      BH: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = (head < H)[:, None]
    row = x_ptr + t * stride_t + head[:, None].to(tl.int64) * 128
    c64 = tl.arange(0, 64)
    i = tl.arange(0, 32)
    n = tl.arange(0, 128)
    dot_t = h_ptr.dtype.element_ty            # bf16 natively; fp32 under the interpreter
    x_nope = tl.load(row + c64[None, :], mask=ok, other=0.0)
    xe = tl.load(row + 64 + 2 * i[None, :], mask=ok, other=0.0).to(tl.float32)
    xo = tl.load(row + 65 + 2 * i[None, :], mask=ok, other=0.0).to(tl.float32)
    ang = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_ptr + i)
    c, s = _cos_sin(ang, NATIVE)
    re, ro = rope_pairs(xe, xo, c[None, :], s[None, :])
    re, ro = round_bf16(re, NATIVE), round_bf16(ro, NATIVE)
    h_top = tl.load(h_ptr + c64[:, None] * 128 + n[None, :])
    h_even = tl.load(h_ptr + (64 + 2 * i)[:, None] * 128 + n[None, :])
    h_odd = tl.load(h_ptr + (65 + 2 * i)[:, None] * 128 + n[None, :])
    y = tl.dot(x_nope.to(dot_t), h_top)
    y += tl.dot(re.to(dot_t), h_even)
    y += tl.dot(ro.to(dot_t), h_odd)
    y = round_bf16(y, NATIVE)
    k = pow2_scale_exp(tl.max(tl.abs(y), axis=1))[:, None]
    codes = e4m3_encode(tl.minimum(tl.maximum(y * exp2_int(-k), -448.0), 448.0), NATIVE)
    q = e4m3_decode(codes, NATIVE) * exp2_int(k)
    tl.store(out_ptr + (t * H + head[:, None]) * 128 + n[None, :], q.to(tl.bfloat16), mask=ok)


def indexer_q(iq: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
              hadamard: torch.Tensor) -> torch.Tensor:
    """``indexer_fake_quant(hadamard(rope(iq)))`` for bf16 heads ``iq [T, H, 128]`` (rows of any
    token stride, heads contiguous: a column slice of a stacked projection); ``positions [T]``,
    ``inv_freq [32]`` the indexer's RoPE frequencies, ``hadamard [128, 128]`` the model's bf16
    matrix. -> contiguous bf16 ``[T, H, 128]``."""
    if iq.dim() != 3 or iq.shape[2] != HEAD_DIM or iq.dtype != torch.bfloat16:
        raise ValueError(f"indexer_q: iq must be bf16 [T, H, {HEAD_DIM}], got {iq.dtype} {tuple(iq.shape)}")
    if iq.stride(2) != 1 or iq.stride(1) != HEAD_DIM:
        raise ValueError(f"indexer_q: iq's heads must be contiguous rows of {HEAD_DIM}, strides {iq.stride()}")
    T, H, _ = iq.shape
    if positions.dim() != 1 or positions.numel() != T:
        raise ValueError(f"indexer_q: positions must be [{T}], got {tuple(positions.shape)}")
    if inv_freq.numel() != ROPE_DIM // 2:
        raise ValueError(f"indexer_q: inv_freq must have {ROPE_DIM // 2} entries, got {inv_freq.numel()}")
    if hadamard.shape != (HEAD_DIM, HEAD_DIM) or hadamard.dtype != torch.bfloat16:
        raise ValueError(f"indexer_q: hadamard must be bf16 [{HEAD_DIM}, {HEAD_DIM}], got "
                         f"{hadamard.dtype} {tuple(hadamard.shape)}")
    check_device(iq, positions, inv_freq, hadamard)
    out = torch.empty(T, H, HEAD_DIM, dtype=torch.bfloat16, device=iq.device)
    if T and H:
        _indexer_q_kernel[(T, triton.cdiv(H, HEADS_PER_PROGRAM))](
            iq, iq.stride(0), positions, inv_freq.to(torch.float32).contiguous(),
            hadamard.to(dot_dtype()).contiguous(), out, H, BH=HEADS_PER_PROGRAM, NATIVE=native(), num_warps=4, **pdl.args(iq.device))
    return out
