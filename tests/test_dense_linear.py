"""``layers.linear.dense_linear``: float32 products of the compressors' bf16 weights.

Bound: every product of a bf16 weight and a bf16 (or float32, split exactly into bf16 parts)
input is exact in float32, and a float32 sum of K of them, in any order, is within
``gamma(K) sum |x w|`` of the exact dot.
"""

from __future__ import annotations

import pytest
import torch

from bounds import assert_within, gamma


def _inputs(M, N, K, x_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(x_dtype)
    w = (torch.randn(N, K, generator=g) * 0.2).to(torch.bfloat16)
    return x, w


def test_compressor_projections_keep_their_cpu_values():
    """Off the GPU ``shared_input(..., out_dtype=fp32)`` is the fp32 matmul of the upcast input and
    weights, as the compressors computed before the float32 path existed: bit for bit."""
    from dsv4_backend.layers.linear import row_stack_of, shared_input, stack_rows
    from dsv4_backend.model import Linear
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    for stacked in (False, True):
        mods = [Linear(64, 32).to(torch.bfloat16), Linear(64, 16).to(torch.bfloat16)]
        if stacked:
            stack_rows(*mods)
        for m in mods:
            m.weight.data.copy_(torch.randn(m.weight.shape, generator=g))
        assert (row_stack_of(tuple(mods)) is not None) == stacked
        ys = shared_input(x, *mods, out_dtype=torch.float32)
        for y, m in zip(ys, mods):
            assert y.dtype == torch.float32
            assert torch.equal(y, torch.nn.functional.linear(x.float(), m.weight.float()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
@pytest.mark.parametrize("M", [1, 4, 9])
def test_dense_linear_on_cuda_at_flash_shapes(M):
    """A CSA layer's stacked compressor weights (2,560 x 4,096 bf16) against float64, at decode
    and larger row counts (one bf16 GEMM with float32 output)."""
    from dsv4_backend.layers.linear import dense_linear
    x, w = _inputs(M, 2560, 4096, torch.bfloat16, seed=M)
    x, w = x.cuda(), w.cuda()
    y = dense_linear(x, w, torch.float32)
    ref = x.double() @ w.double().T
    assert_within(y, ref, gamma(4096) * (x.double().abs() @ w.double().abs().T), "dense_linear")
