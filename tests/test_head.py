"""The output head (dsv4_backend/layers/head.py): the exact three-part bf16 split of float32
activations, and float32 logits from the bf16 weight against float64."""

import pytest
import torch
import torch.nn.functional as F

from dsv4_backend.layers.head import LogitsHead, logits_fp32, split_bf16x3

CUDA = torch.cuda.is_available()


def _spread(n: int, d: int, seed: int) -> torch.Tensor:
    """float32 values over a wide exponent range (2^-60 .. 2^60), both signs, a few zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-60, 61, (n, d), generator=g).double())
    x[0, :3] = 0.0
    return x.float()


def test_three_bf16_parts_sum_to_the_float32_exactly():
    x = _spread(64, 257, 0)
    parts = split_bf16x3(x)
    assert parts.shape == (3, 64, 257) and parts.dtype == torch.bfloat16
    total = parts[0].double() + parts[1].double() + parts[2].double()   # exact in float64
    assert torch.equal(total, x.double())
    # two parts are not enough: the test can fail
    assert not torch.equal(parts[0].double() + parts[1].double(), x.double())


def test_split_refuses_other_dtypes():
    with pytest.raises(ValueError, match="float32"):
        split_bf16x3(torch.ones(2, 2, dtype=torch.bfloat16))


def test_head_off_cuda_is_the_linear_with_the_cast_weight():
    g = torch.Generator().manual_seed(1)
    head = LogitsHead(32, 50)
    head.weight.data = torch.randn(50, 32, generator=g).to(torch.bfloat16)
    x = torch.randn(2, 3, 32, generator=g)
    y = head(x)
    assert y.shape == (2, 3, 50) and y.dtype == torch.float32
    assert torch.equal(y, F.linear(x, head.weight.float()))


@pytest.mark.skipif(not CUDA, reason="the split GEMM runs on CUDA")
@pytest.mark.parametrize("n", [1, 7, 64])
def test_cuda_logits_within_the_float32_bound(n):
    """Against float64: each logit sums D exact products in float32 (three GEMMs and two adds),
    so |err| <= (D + 2) * 2^-24 * sum_d |W x|, the float32 GEMM's own bound."""
    D, V = 4096, 4099
    g = torch.Generator().manual_seed(n)
    w = (torch.randn(V, D, generator=g) * 0.02).to(torch.bfloat16).cuda()
    x = torch.randn(n, D, generator=g).cuda()
    y = logits_fp32(x, w)
    ref = x.double() @ w.double().t()
    bound = (D + 2) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())
    assert y.dtype == torch.float32 and y.shape == (n, V)
    assert ((y.double() - ref).abs() <= bound).all()
