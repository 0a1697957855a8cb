"""The output head: float32 logits from the bf16 ``head.weight`` without a float32 copy of it.

The release computes logits in float32 (docs/model.md, "Precision") from a bf16 weight ``[V, D]``;
on CUDA that product runs as :mod:`.fp32_products` describes (the weight read once in bf16, the
float32 input split exactly into three bf16 parts, one GEMM with float32 output). Elsewhere (the
CPU, float64, a float32 weight, a torch without ``out_dtype``) the head is ``F.linear`` with the
weight cast to the input's dtype, as before.
"""

from __future__ import annotations

import torch
from torch import nn

from .fp32_products import split_bf16x3  # noqa: F401 (the head's tests use it from here)
from .linear import dense_linear


def logits_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` in x's dtype; float32 x on a bf16 CUDA weight through the exact split."""
    return dense_linear(x, weight)


class LogitsHead(nn.Module):
    """``head``: ``[N, D]`` -> logits ``[N, V]`` in the input's dtype (float32 from the bf16 model)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        return logits_fp32(x.reshape(-1, x.shape[-1]), self.weight).view(*lead, self.weight.shape[0])
