"""The indexer's query heads in one launch (kernels/indexer_q.py) against float64.

The reference is the model's chain in float64: RoPE at the fp32 angle the kernels use, the
model's bf16 Hadamard matrix, no roundings. The kernel's output may be off it by

- the rotated dims' bf16 rounding (2^-8 relative) and their fp32 arithmetic (six units of
  |x_even| + |x_odd|: two products, a sum, cos / sin within an ulp each), carried through |H|;
- the Hadamard product's fp32 sum of 128 exact products, gamma(128) of sum |x| |H|, and its
  bf16 rounding (2^-8 of |y|);
- the e4m3 rounding: half a step, 2^-4 of |y| for normal codes and 2^-10 s for subnormal ones,
  s the head's power-of-two scale (taken at the largest amax the errors above allow).

Each head's output must also be e4m3 values times one power of two, the format's structure.
"""

import pytest
import torch

from bounds import U32, assert_within, gamma
from dsv4_backend.kernels.indexer_q import indexer_q
from dsv4_backend.model import Rotary, hadamard_matrix

THETA = 10000.0
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # the interpreter on the CPU


def reference(iq, positions, inv_freq):
    """float64 y = rope(iq) @ H and its bound before the e4m3 rounding."""
    x = iq.double()
    ang = (positions.float()[:, None] * inv_freq.float()[None, :]).double()[:, None, :]
    xe, xo = x[..., 64::2], x[..., 65::2]
    re, ro = xe * ang.cos() - xo * ang.sin(), xe * ang.sin() + xo * ang.cos()
    xr = x.clone()
    xr[..., 64::2], xr[..., 65::2] = re, ro
    err = torch.zeros_like(x)
    arith = 6 * U32 * (xe.abs() + xo.abs())
    err[..., 64::2] = 2.0 ** -8 * re.abs() + arith
    err[..., 65::2] = 2.0 ** -8 * ro.abs() + arith
    H = hadamard_matrix(128, torch.bfloat16, iq.device).double()
    y = xr @ H
    pre = err @ H.abs() + gamma(128, U32) * ((xr.abs() + err) @ H.abs())
    eps = pre + 2.0 ** -8 * (y.abs() + pre)
    return y, eps


def pow2_scale(amax):
    r = amax.clamp_min(1e-4) / 448.0
    m, e = torch.frexp(r)
    return torch.pow(2.0, (e - (m == 0.5).long()).double())


def check(iq, positions, inv_freq):
    out = indexer_q(iq, positions, inv_freq, hadamard_matrix(128, torch.bfloat16, iq.device))
    assert out.dtype == torch.bfloat16 and out.shape == iq.shape and out.is_contiguous()
    y, eps = reference(iq.cpu(), positions.cpu(), inv_freq.cpu())
    s_hi = pow2_scale((y.abs() + eps).amax(-1, keepdim=True))
    tol = eps + 2.0 ** -4 * (y.abs() + eps) + 2.0 ** -10 * s_hi
    got = out.double().cpu()
    assert_within(got, y, tol, "indexer q")
    # every head: e4m3 codes times one power of two (s_hi or, if the amax rounded down, half of it)
    def codes_times(s):
        v = got / s
        return ((v.float().to(torch.float8_e4m3fn).double() == v) & (v.abs() <= 448)).all(-1)
    assert bool((codes_times(s_hi) | codes_times(s_hi / 2)).all())
    return out


def test_heads_tails_and_positions():
    gen = torch.Generator().manual_seed(0)
    T, H = 3, 20                                    # 20 heads: a partial second block of 16
    big = torch.randn(T, H * 128 + 64, generator=gen) * 3
    big[1, :128] *= 1e-6                            # a head below the amax floor
    iq = big.to(torch.bfloat16)[:, 64:].view(T, H, 128)    # a column slice: token stride 2624
    positions = torch.tensor([0, 7, 1_000_003])
    check(iq.to(DEV), positions.to(DEV), Rotary(THETA, None, 64).inv_freq.to(DEV))


def test_bad_inputs_are_named():
    iq = torch.zeros(2, 16, 128, dtype=torch.bfloat16, device=DEV)
    pos, inv = torch.zeros(2, dtype=torch.int64, device=DEV), torch.ones(32, device=DEV)
    H = hadamard_matrix(128, torch.bfloat16, iq.device)
    with pytest.raises(ValueError, match="bf16"):
        indexer_q(iq.float(), pos, inv, H)
    with pytest.raises(ValueError, match="positions"):
        indexer_q(iq, pos[:1], inv, H)
    with pytest.raises(ValueError, match="inv_freq"):
        indexer_q(iq, pos, inv[:16], H)
    with pytest.raises(ValueError, match="hadamard"):
        indexer_q(iq, pos, inv, H.float())
    with pytest.raises(ValueError, match="contiguous"):
        indexer_q(iq.transpose(0, 1), pos[:1].expand(16), inv, H)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_flash_heads():
    """Flash's 64 heads at decode and verify sizes on the GPU, within the same bound."""
    gen = torch.Generator().manual_seed(1)
    for T in (1, 4, 33):
        iq = (torch.randn(T, 64 * 128, generator=gen) * 2).to(torch.bfloat16).view(T, 64, 128).cuda()
        positions = torch.randint(0, 1 << 20, (T,), generator=gen).cuda()
        check(iq, positions, Rotary(THETA, None, 64).inv_freq.cuda())
