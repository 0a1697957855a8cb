"""float32 products of a bf16 weight without a float32 copy of it.

The release computes some products of bf16 weights in float32: the logits (docs/model.md,
"Precision") and the compressors' projections. Written as ``F.linear(x32, W.float())`` that casts
the whole weight on every call: for Flash's 129,280 x 4,096 head a 1.06 GB read and a 2.1 GB
write, then the 2.1 GB float32 GEMV, about 2 ms of a batch-1 decode step on an H200 (docs/PERF.md,
"Session 9"), where the weight read alone is 0.25 ms; in a CSA layer's stacked compressor
projections 21 MB read, 42 MB written and read again, every step.

On CUDA :func:`fp32_linear` runs one bf16 GEMM with float32 output and float32 accumulation
(``torch.mm(..., out_dtype=float32)``). A bf16 input goes in as it is. A float32 input is first
split exactly into three bf16 parts, ``x = hi + mid + lo`` (:func:`split_bf16x3`: each part the
bf16 rounding of what the parts before it left; float32 carries 24 significand bits and each bf16
part 8), and the stacked ``[3N, D]`` parts go through the one GEMM. A bf16 x bf16 product is
exact in float32, so each output is the float32 GEMM's sum of exact products, in a different
order: the same error bound, ``~ D * 2^-24 * sum_d |W x|`` (``tests/test_head.py`` and
``tests/test_dense_linear.py`` check it against float64 on the GPU). W is read once, in bf16.
Elsewhere (the CPU, float64, a float32 weight, a torch without ``out_dtype``) the callers keep
``F.linear`` with the weight cast up, as before.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)
_MM_OUT_DTYPE: dict[str, bool] = {}


def split_bf16x3(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x [N, D]`` -> bf16 ``[3, N, D]`` whose parts sum to x exactly (in real arithmetic)
    for every x whose residuals stay in bf16's normal range (|x| above ~2^-110, or 0).

    Each subtraction is exact: the part removed is x's leading bits rounded, so the residual is a
    float32 with fewer significand bits (at most 16 after ``hi``, at most 8 after ``mid``), the
    last of which bf16 holds exactly."""
    if x.dtype != torch.float32:
        raise ValueError(f"split_bf16x3: x must be float32, got {x.dtype}")
    hi = x.to(torch.bfloat16)
    r = x - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    return torch.stack((hi, mid, lo))


def mm_out_fp32_works(device: torch.device) -> bool:
    """Whether this torch has the bf16 -> float32 ``torch.mm(out_dtype=)`` on ``device`` (probed once)."""
    key = str(device)
    if key not in _MM_OUT_DTYPE:
        try:
            a = torch.ones(2, 8, dtype=torch.bfloat16, device=device)
            ok = torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError) as e:
            logger.warning("torch.mm(out_dtype=float32) unavailable on %s (%s): float32 products of bf16 "
                           "weights cast the weight to float32 on every call", device, e)
            ok = False
        _MM_OUT_DTYPE[key] = ok
    return _MM_OUT_DTYPE[key]


def fp32_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`fp32_linear` runs ``x @ w^T`` here (a CUDA bf16 weight, a float32 or bf16 x)."""
    return (x.is_cuda and w.dtype == torch.bfloat16 and x.dtype in (torch.float32, torch.bfloat16)
            and mm_out_fp32_works(x.device))


def fp32_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 ``x [..., D] @ w [N, D]^T`` from the bf16 ``w`` as stored (see the module docstring);
    the caller checks :func:`fp32_applies` first."""
    lead, D = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, D)
    if x.dtype == torch.bfloat16:
        y = torch.mm(x2, w.t(), out_dtype=torch.float32)
    else:
        n = x2.shape[0]
        parts = split_bf16x3(x2).view(3 * n, D)
        y3 = torch.mm(parts, w.t(), out_dtype=torch.float32).view(3, n, w.shape[0])
        y = y3[0] + (y3[1] + y3[2])          # the small parts first
    return y.view(*lead, w.shape[0])
