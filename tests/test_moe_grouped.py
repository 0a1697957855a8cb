"""The grouped bf16 MoE's element-wise kernels (dsv4_backend/kernels/moe_grouped.py).

On a machine without CUDA they run under TRITON_INTERPRET=1 (tests/conftest.py).

SwiGLU bound: from bf16 g and u (exact in fp32 and float64), the kernel computes
``h = bf16(g' / (1 + exp(-g')) * u' * w)`` in fp32, g' = min(g, limit), u' = clamp(u). Against
float64: exp moves by at most (4 + 2 |g'|) u relative (numpy's exp within 2u; the GPU's exp2 of
``g' log2 e``: the product's rounding moves the exponent by |g'| log2(e) u, i.e. the result by
|g'| ln 2 log2(e) u = |g'| u, and ex2.approx by under 2u), the add, the division and two
products u each, so the fp32 value is within ``d = (8 + 2 |g'|) u`` relative, and the bf16
rounding adds half a step: ``|h - h64| <= (d + BF16_HALF (1 + d)) |h64|`` (plus 2^-133 for fp32
subnormals). The combine's sums are fp32 adds of bf16 values in a fixed order: compared bit for bit
with the same adds done by torch.
"""

from __future__ import annotations

import pytest
import torch

from bounds import BF16_HALF, U32, assert_within
from dsv4_backend.kernels.moe_grouped import combine_pairs, swiglu_rows

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LIMIT = 7.0


def swiglu64(g, u, limit, w=None):
    g64 = g.double().clamp(max=limit)
    h = g64 / (1 + torch.exp(-g64)) * u.double().clamp(-limit, limit)
    return h if w is None else h * w.double()[:, None]


def swiglu_bound(g, h64, limit):
    d = (8 + 2 * g.double().clamp(max=limit).abs()) * U32
    return (d + BF16_HALF * (1 + d)) * h64.abs() + 2.0 ** -133


def gu_inputs(R: int, I: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    gu = (torch.randn(R, 2 * I, generator=gen) * 4).to(torch.bfloat16)   # past the limit now and then
    return gu.to(DEV)


@pytest.mark.parametrize("R, I", [(5, 128), (3, 200)])
def test_swiglu_rows_unweighted(R, I):
    gu = gu_inputs(R, I, seed=R)
    g, u = gu[:, :I], gu[:, I:]            # column views of one GEMM output, as the model passes
    h, inv = swiglu_rows(g, u, LIMIT)
    assert inv is None and h.dtype == torch.bfloat16 and h.shape == (R, I)
    h64 = swiglu64(g.cpu(), u.cpu(), LIMIT)
    assert_within(h.cpu(), h64, swiglu_bound(g.cpu(), h64, LIMIT), "swiglu")


def test_swiglu_rows_weighted_order_and_valid_rows():
    R, I = 9, 128
    gu = gu_inputs(R, I, seed=1)
    g, u = gu[:, :I], gu[:, I:]
    gen = torch.Generator().manual_seed(2)
    order = torch.randperm(R, generator=gen).to(DEV)
    w = torch.rand(R, generator=gen).to(DEV)
    valid = torch.tensor([7], device=DEV)
    h, inv = swiglu_rows(g, u, LIMIT, w, order, valid_rows=valid)
    assert torch.equal(inv[order], torch.arange(R, device=DEV))   # the inverse permutation
    assert (h[7:] == 0).all()
    h64 = swiglu64(g.cpu(), u.cpu(), LIMIT, w.cpu()[order.cpu()])
    assert_within(h[:7].cpu(), h64[:7], swiglu_bound(g.cpu(), h64, LIMIT)[:7], "weighted swiglu")
    # a weight of exactly 1 gives the unweighted bits
    ones = swiglu_rows(g, u, LIMIT, torch.ones(R, device=DEV), torch.arange(R, device=DEV))[0]
    assert torch.equal(ones, swiglu_rows(g, u, LIMIT)[0])


def test_combine_pairs_is_the_fixed_order_sum():
    T, k, D, E = 4, 3, 1100, 8
    gen = torch.Generator().manual_seed(3)
    y = torch.randn(T * k, D, generator=gen).to(torch.bfloat16)
    shared = torch.randn(T, D, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, E, (T, k), generator=gen)
    ids[1, 2] = -1            # another rank's expert
    ids[2, 0] = E             # out of range: skipped too
    inv = torch.randperm(T * k, generator=gen)
    out = combine_pairs(y.to(DEV), inv.to(DEV), ids.to(DEV), shared.to(DEV), E)
    acc = torch.zeros(T, D)
    for j in range(k):
        keep = ((ids[:, j] >= 0) & (ids[:, j] < E))[:, None]
        acc = acc + torch.where(keep, y[inv.view(T, k)[:, j]].float(), 0.0)
    want = (shared.float() + acc.to(torch.bfloat16).float()).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out.cpu(), want)


def test_bad_inputs_are_named():
    g = torch.zeros(2, 128, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="swiglu_rows: g and u must be bf16"):
        swiglu_rows(g, g.float(), LIMIT)
    with pytest.raises(ValueError, match="weights and order go together"):
        swiglu_rows(g, g, LIMIT, weights=torch.ones(2, device=DEV))
    with pytest.raises(ValueError, match="contiguous columns"):
        swiglu_rows(g.t().contiguous().t(), g, LIMIT)
    with pytest.raises(ValueError, match="combine_pairs: y"):
        combine_pairs(g, torch.zeros(3, dtype=torch.int64, device=DEV), torch.zeros(1, 3, dtype=torch.int64,
                      device=DEV), g[:1], 4)
