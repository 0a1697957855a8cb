"""The output head: float32 logits from the bf16 ``head.weight`` without a float32 copy of it.

The release computes logits in float32 (docs/model.md, "Precision") from a bf16 weight ``[V, D]``. Written as ``F.linear(x32, W.float())`` that casts the whole
weight on every call: for Flash's 129,280 x 4,096 head a 1.06 GB read and a 2.1 GB write, then
the 2.1 GB float32 GEMV, about 2 ms of a batch-1 decode step on an H200 (docs/PERF.md,
"Session 9"), where the weight read alone is 0.25 ms.

On CUDA :class:`LogitsHead` splits the float32 input exactly into three bf16 parts,
``x = hi + mid + lo`` (:func:`split_bf16x3`: each part the bf16 rounding of what the parts before
it left; float32 carries 24 significand bits and each bf16 part 8), and runs one bf16 GEMM of the
stacked ``[3N, D]`` parts against W with float32 output (``torch.mm(..., out_dtype=float32)``,
accumulating in float32). A bf16 x bf16 product is exact in float32, so each logit is the float32
GEMM's sum of exact products, in a different order: the same error bound, ``~ D * 2^-24 *
sum_d |W x|`` (``tests/test_head.py`` checks it against float64 on the GPU). W is read once, in
bf16. Elsewhere (the CPU, float64, a float32 weight, a torch without ``out_dtype``) the head is
``F.linear`` with the weight cast to the input's dtype, as before.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

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


def _mm_out_dtype_works(device: torch.device) -> bool:
    """Whether this torch has the bf16 -> float32 ``torch.mm(out_dtype=)`` on ``device`` (probed once)."""
    key = str(device)
    if key not in _MM_OUT_DTYPE:
        try:
            a = torch.ones(2, 8, dtype=torch.bfloat16, device=device)
            ok = torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError) as e:
            logger.warning("torch.mm(out_dtype=float32) unavailable on %s (%s): the head casts its "
                           "weight to float32 on every call", device, e)
            ok = False
        _MM_OUT_DTYPE[key] = ok
    return _MM_OUT_DTYPE[key]


def logits_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` in x's dtype; float32 x on a bf16 CUDA weight through the exact split."""
    if (x.is_cuda and x.dtype == torch.float32 and weight.dtype == torch.bfloat16 and x.dim() == 2
            and _mm_out_dtype_works(x.device)):
        n = x.shape[0]
        parts = split_bf16x3(x).view(3 * n, x.shape[1])
        y = torch.mm(parts, weight.t(), out_dtype=torch.float32).view(3, n, weight.shape[0])
        return y[0] + (y[1] + y[2])          # the small parts first
    return F.linear(x, weight.to(x.dtype))


class LogitsHead(nn.Module):
    """``head``: ``[N, D]`` -> logits ``[N, V]`` in the input's dtype (float32 from the bf16 model)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        return logits_fp32(x.reshape(-1, x.shape[-1]), self.weight).view(*lead, self.weight.shape[0])
