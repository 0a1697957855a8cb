"""The torch maths of the release's quantised matmuls: the spec the GPU kernels must match.

Weights (docs/checkpoints.md): FP8 linears are ``float8_e4m3fn [N, K]`` with one fp32
power-of-two scale per 128 x 128 block ``[ceil(N/128), ceil(K/128)]``; the routed experts of a
MoE layer are stacked e2m1 bytes ``w13 uint8 [E, 2I, D/2]`` (rows 0..I-1 = w1, I..2I-1 = w3),
``w2 uint8 [E, D, I/2]`` (byte k: K index 2k in the low nibble, 2k+1 in the high one) with e8m0
scale bytes ``[E, 2I, D/32]`` and ``[E, D, I/32]`` (value 2^(byte - 127)).

Activations (DSV4.md section 4): the input of every FP8/FP4 matmul is rounded per row in
1 x 128 blocks along K: ``s = 2^ceil(log2(max(amax, 1e-4) / 448))``, ``e4m3(a / s)``
(nearest even, clamped to +-448). The e4m3 rounding always goes through float32 (torch's
``float64 -> float8_e4m3fn`` cast does too, and so do the KV rows of ``memory.quant``): a
float64 value within ~1e-8 relative of an e4m3 midpoint may round differently than exact
rounding would. That is the one rule of this project, in every dtype.

Compute dtype: float64 inputs compute in float64, everything else in float32, and results are
cast to the input dtype. Because every scale is a power of two, ``sum_kb xs * ws * sum_k xq*w``
equals ``(xq*xs) @ (w*ws)^T`` in exact arithmetic, so the torch path multiplies dequantised
operands (one matmul, no per-block partial sums); the two orders differ only by the rounding
of the accumulation (float32: at most ~K * 2^-24 * sum|x*w|; float64: exact within a block,
since e4m3 x e4m3 products have 8 significant bits).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from memory.quant import e4m3_bits_to, pow2_scale, to_e4m3_bits

from ..checkpoint import dequantize_fp4, dequantize_fp8_blockwise
from ..weights import FP4_BLOCK

ACT_BLOCK = 128  # activation scale block along K


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[..., K]`` (K a multiple of 128) -> e4m3 values ``[..., K]`` and power-of-two scales
    ``[..., K/128]`` (float64 for float64 input, float32 otherwise)."""
    K = x.shape[-1]
    if K % ACT_BLOCK:
        raise ValueError(f"act_quant: K = {K} is not a multiple of {ACT_BLOCK}")
    blocks = x.to(compute_dtype(x.dtype)).unflatten(-1, (K // ACT_BLOCK, ACT_BLOCK))
    s = pow2_scale(blocks.abs().amax(-1, keepdim=True)).scale
    q = to_e4m3_bits(blocks / s).view(torch.float8_e4m3fn).flatten(-2)
    return q, s.squeeze(-1)


def act_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """``act_quant`` dequantised, in the compute dtype (exact: e4m3 times a power of two)."""
    q, s = act_quant(x)
    c = s.dtype
    return (e4m3_bits_to(q.view(torch.uint8), c).unflatten(-1, (-1, ACT_BLOCK)) * s[..., None]).flatten(-2)


def dequant_fp8(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 ``[N, K]`` with fp32 block scales ``[ceil(N/128), ceil(K/128)]`` -> ``dtype`` (exact)."""
    return dequantize_fp8_blockwise(w, scale, dtype)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e2m1 bytes ``[..., N, K/2]`` with e8m0 scale bytes ``[..., N, K/32]`` -> ``dtype [..., N, K]``."""
    lead, (n, half) = packed.shape[:-2], packed.shape[-2:]
    x = dequantize_fp4(packed.reshape(-1, half).view(torch.int8),
                       scale.reshape(-1, 2 * half // FP4_BLOCK).view(torch.float8_e8m0fnu), dtype)
    return x.view(*lead, n, 2 * half)


def fp8_linear_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """W8A8 block-scaled linear: ``x [M, K] -> [M, N]`` in x's dtype (see the module docstring)."""
    return linear_act_quant(x, dequant_fp8(w, w_scale, compute_dtype(x.dtype)))


def linear_act_quant(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``act(x) @ w^T`` with w already dequantised to the compute dtype; result in x's dtype."""
    return F.linear(act_fake_quant(x), w).to(x.dtype)


def _swiglu(g: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit) * weight[:, None]


def fp4_moe_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, limit: float) -> torch.Tensor:
    """The routed experts over FP4 weights (W4A8): ``x [T, D]``, ``ids, weights [T, k]`` -> ``[T, D]``.

    Per (t, j) with e = ids[t, j]: g, u = act(x) . w1[e], w3[e] (cast to x's dtype, the GEMM
    output); h = silu(min(g, limit)) * clamp(u, +-limit) * weights[t, j] in the compute dtype,
    cast to x's dtype; y = act(h) . w2[e] (cast to x's dtype); out[t] = sum over j in order.
    """
    c = compute_dtype(x.dtype)
    return moe_act_quant(x, ids, weights, lambda e: dequant_fp4(w13[e], w13_scale[e], c),
                         lambda e: dequant_fp4(w2[e], w2_scale[e], c), limit)


def moe_act_quant(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  w13_of: Callable[[int], torch.Tensor], w2_of: Callable[[int], torch.Tensor],
                  limit: float) -> torch.Tensor:
    """:func:`fp4_moe_ref` with expert e's dequantised weights from ``w13_of(e) [2I, D]`` and
    ``w2_of(e) [D, I]`` (in the compute dtype)."""
    T, k = ids.shape
    c = compute_dtype(x.dtype)
    xa = act_fake_quant(x)                                                   # [T, D]
    y = torch.zeros(T, k, x.shape[1], dtype=x.dtype, device=x.device)
    for e in torch.unique(ids).tolist():
        if e < 0:       # another rank's expert (expert parallelism): counts as 0
            continue
        t, j = (ids == e).nonzero(as_tuple=True)
        w13e = w13_of(e)                                                     # [2I, D]
        inter = w13e.shape[0] // 2
        gu = F.linear(xa[t], w13e).to(x.dtype).to(c)
        h = _swiglu(gu[:, :inter], gu[:, inter:], weights[t, j].to(c), limit).to(x.dtype)
        y[t, j] = linear_act_quant(h, w2_of(e))
    return y.to(c).sum(1).to(x.dtype)
