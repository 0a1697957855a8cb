"""The few-row GEMV over a bf16 weight (dsv4_backend/kernels/gemv.py) under the interpreter,
against float64, and the compressor projections that use it.

Bound: every product of a bf16 weight and an fp32 (or bf16) input is exact in float64, and the
kernel's fp32 sum of K of them, in any order (splits included), is within ``gamma(K) sum |x w|``
of the exact dot; a bf16 output adds half a bf16 step at its magnitude.
"""

from __future__ import annotations

import pytest
import torch

from bounds import BF16_HALF, assert_within, gamma
from dsv4_backend.kernels.gemv import GemvConfig, gemv, pick_gemv_config

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(M, N, K, x_dtype, seed, stride_pad=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(M, K + stride_pad, generator=g).to(x_dtype)
    x = base[:, :K]                       # rows strided when stride_pad > 0
    w = (torch.randn(N, K, generator=g) * 0.2).to(torch.bfloat16)
    return x, w


@pytest.mark.parametrize("M,N,K,x_dtype,out_dtype,config", [
    (1, 40, 600, torch.float32, torch.float32, GemvConfig(16, 256, 1, 2)),      # ragged N and K, one split
    (3, 33, 1000, torch.float32, torch.float32, GemvConfig(16, 256, 3, 2)),     # three splits, the last short
    (4, 64, 512, torch.bfloat16, torch.float32, GemvConfig(32, 128, 2, 4)),     # bf16 input, fp32 out
    (2, 48, 768, torch.bfloat16, torch.bfloat16, GemvConfig(16, 256, 2, 2)),    # bf16 out through the split sum
    (1, 24, 300, torch.float32, torch.bfloat16, GemvConfig(16, 256, 1, 2)),     # bf16 out from the kernel itself
    (2, 20, 512, torch.float32, torch.float32, None),                            # the shape rule
])
def test_gemv_against_float64(M, N, K, x_dtype, out_dtype, config):
    x, w = _inputs(M, N, K, x_dtype, seed=M * 1000 + N, stride_pad=8)
    ref = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    y = gemv(x.to(DEV), w.to(DEV), out_dtype, config)
    assert y.dtype == out_dtype and y.shape == (M, N)
    bound = gamma(K) * mag
    if out_dtype == torch.bfloat16:
        bound = bound + BF16_HALF * (ref.abs() + bound)
    assert_within(y, ref, bound, "gemv")


def test_rule_splits_k_to_about_2048_programs():
    # a CSA layer's stacked compressor projections: 160 tiles of 16 rows, 16 steps of 256
    assert pick_gemv_config(2560, 4096) == GemvConfig(16, 256, 8, 2)
    # a short K is never split below two steps
    assert pick_gemv_config(64, 512).split_k == 1
    assert pick_gemv_config(1 << 16, 4096).split_k == 1


def test_bad_inputs():
    with pytest.raises(ValueError, match="share K"):
        gemv(torch.zeros(1, 8, device=DEV), torch.zeros(4, 9, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="out_dtype"):
        gemv(torch.zeros(1, 8, device=DEV), torch.zeros(4, 8, dtype=torch.bfloat16, device=DEV), torch.float16)
    with pytest.raises(ValueError, match="dense along K"):
        gemv(torch.zeros(8, 2, device=DEV).T, torch.zeros(4, 8, dtype=torch.bfloat16, device=DEV))


def test_compressor_projections_keep_their_cpu_values():
    """Off the GPU ``shared_input(..., out_dtype=fp32)`` is the fp32 matmul of the upcast input and
    weights, as the compressors computed before the GEMV existed: bit for bit."""
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
    """A CSA layer's stacked compressor weights (2,560 x 4,096 bf16) against float64: the GEMV up
    to four rows, the library matmul beyond (both fp32 products and sums)."""
    from dsv4_backend.layers.linear import dense_linear
    x, w = _inputs(M, 2560, 4096, torch.bfloat16, seed=M)
    x, w = x.cuda(), w.cuda()
    y = dense_linear(x, w, torch.float32)
    ref = x.double() @ w.double().T
    assert_within(y, ref, gamma(4096) * (x.double().abs() @ w.double().abs().T), "dense_linear")
