"""The CPU maths of the quantised matmuls (dsv4_backend/layers/quant.py) against float64
simulations written here from the format definitions (DSV4.md section 4, docs/checkpoints.md).

Bounds: the simulations sum exactly within a 128-block (e4m3 x e4m3 products carry 8
significant bits, far inside float64) and in float64 across blocks; the code under test sums
the dequantised products in its compute dtype in another order, which costs at most
K * u * sum|terms| (u = 2^-53 in float64, 2^-24 in float32), plus half an ulp of the output
dtype (2^-8 relative for bf16). Activation codes are compared bit for bit (order-free).
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_backend.checkpoint import quantize_fp4, quantize_fp8_blockwise
from dsv4_backend.layers.linear import Fp8Linear
from dsv4_backend.layers.quant import act_quant, fp4_moe_ref, fp8_linear_ref

U64, U32 = 2.0 ** -53, 2.0 ** -24


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3fn value, ties to even, of float64 x (|x| <= 448): 3 mantissa bits, subnormal step 2^-9."""
    _, k = torch.frexp(x.abs())
    ulp = torch.exp2((k - 4).clamp_min(-9).double())
    return (torch.round(x / ulp) * ulp).clamp(-448, 448)


def sim_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 1 x 128 block: s = 2^ceil(log2(max(amax, 1e-4) / 448)), q = e4m3(x / s); float64."""
    M, K = x.shape
    b = x.double().view(M, K // 128, 128)
    amax = b.abs().amax(-1).clamp_min(1e-4).tolist()
    s = torch.tensor([[2.0 ** math.ceil(math.log2(a / 448)) for a in row] for row in amax], dtype=torch.float64)
    return e4m3_round(b / s[..., None]).view(M, K), s


def decode_e2m1(packed: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] pairs (low nibble = even K) and e8m0 bytes [N, K/32] -> float64 [N, K]."""
    nib = torch.stack([packed & 15, packed >> 4], -1).flatten(-2).long()
    e, m = (nib >> 1) & 3, (nib & 1).double()
    mag = torch.where(e == 0, m * 0.5, torch.exp2(e.double() - 1) * (1 + m / 2))
    val = torch.where(nib >= 8, -mag, mag)
    return val * torch.exp2(scale_bytes.double() - 127).repeat_interleave(32, -1)


def sim_fp8_linear(x: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_kb xs * ws * (sum_k xq * w) block by block; also sum |terms| for the bound."""
    q, xs = sim_act(x)
    w = w8.double()
    N, K = w.shape
    y = torch.zeros(x.shape[0], N, dtype=torch.float64)
    mag = torch.zeros_like(y)
    for kb in range(K // 128):
        cols = slice(kb * 128, (kb + 1) * 128)
        wsc = ws.double()[torch.arange(N) // 128, kb]                               # [N]
        y += (q[:, cols] @ w[:, cols].T) * xs[:, kb:kb + 1] * wsc
        mag += (q[:, cols].abs() @ w[:, cols].abs().T) * xs[:, kb:kb + 1] * wsc
    return y, mag


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_act_quant_codes_and_scales():
    g = _gen(0)
    x = (torch.randn(6, 512, generator=g) * torch.logspace(-3, 3, 6)[:, None]).double()  # float32 values
    x[2, 128:256] = 0.0                                   # amax floored at 1e-4: scale 2^-22
    x[3, :128] *= 1e-7
    x[4, 5] = 3.0e4                                       # one large value sets its block's scale
    q, s = act_quant(x)
    want_q, want_s = sim_act(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float64
    assert torch.equal(s, want_s)
    assert s[2, 1] == 2.0 ** -22
    assert torch.equal(q.double(), want_q)
    q32, s32 = act_quant(x.float())
    assert torch.equal(q32.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s32.double(), s)
    with pytest.raises(ValueError, match="multiple of 128"):
        act_quant(torch.ones(2, 100))


@pytest.mark.parametrize("dtype, u_acc, u_out", [(torch.float64, U64, 0.0), (torch.float32, U32, 0.0),
                                                 (torch.bfloat16, U32, 2.0 ** -8)])
def test_fp8_linear_against_block_simulation(dtype, u_acc, u_out):
    g = _gen(1)
    M, N, K = 5, 320, 384                                 # a partial 128-row block of the weight
    w = quantize_fp8_blockwise(torch.randn(N, K, generator=g) * torch.logspace(-2, 1, K) / 8)
    ws = w.scale.float()
    x = (torch.randn(M, K, generator=g) * 3).to(dtype)
    y = fp8_linear_ref(x, w.weight, ws)
    assert y.dtype == dtype and y.shape == (M, N)
    want, mag = sim_fp8_linear(x.double(), w.weight, ws)
    bound = K * u_acc * mag + u_out * want.abs() + 1e-300
    err = (y.double() - want).abs()
    i = int((err / bound).argmax())
    assert bool((err <= bound).all()), f"worst at {i}: {err.flatten()[i]:.3e} > {bound.flatten()[i]:.3e}"


def test_fp4_moe_against_simulation():
    g = _gen(2)
    E, T, k, D, inter, limit = 5, 7, 3, 256, 128, 2.0     # a small limit so both clamps act
    w1 = quantize_fp4(torch.randn(E * inter, D, generator=g) * 0.1)
    w3 = quantize_fp4(torch.randn(E * inter, D, generator=g) * 0.1)
    w2 = quantize_fp4(torch.randn(E * D, inter, generator=g) * 0.1)
    u8 = lambda t: t.view(torch.uint8)  # noqa: E731
    w13 = torch.cat([u8(w1.packed).view(E, inter, -1), u8(w3.packed).view(E, inter, -1)], 1)
    w13s = torch.cat([u8(w1.scale).view(E, inter, -1), u8(w3.scale).view(E, inter, -1)], 1)
    w2p, w2s = u8(w2.packed).view(E, D, -1), u8(w2.scale).view(E, D, -1)
    x = torch.randn(T, D, generator=g, dtype=torch.float64) * 2
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g, dtype=torch.float64) + 0.1
    out = fp4_moe_ref(x, ids, wts, w13, w13s, w2p, w2s, limit)

    q, xs = sim_act(x)
    xa = (q.view(T, -1, 128) * xs[..., None]).view(T, D)
    want = torch.zeros(T, D, dtype=torch.float64)
    mag = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            gu = decode_e2m1(w13[e], w13s[e]) @ xa[t]
            gt, ut = gu[:inter], gu[inter:]
            h = gt.clamp(max=limit) * torch.sigmoid(gt.clamp(max=limit)) * ut.clamp(-limit, limit) * wts[t, j]
            hq, hs = sim_act(h[None])
            ha = (hq.view(-1, 128) * hs.view(-1, 1)).view(inter)
            w2e = decode_e2m1(w2p[e], w2s[e])
            want[t] += w2e @ ha
            mag[t] += w2e.abs() @ ha.abs()
    # sums of inter products per choice, then k choices; the activation codes of h agree unless
    # a float64 difference of an ulp straddles an e4m3 midpoint (odds ~2^-48 per element)
    bound = 4 * (inter + k) * U64 * mag
    err = (out - want).abs()
    assert bool((err <= bound).all()), f"worst {float((err - bound).max()):.3e} over the bound"
    assert float(mag.min()) > 0


def test_fp8_linear_module_dequantises_again_when_its_bytes_change():
    g = _gen(3)
    m = Fp8Linear(256, 128)
    for _ in range(2):
        w = quantize_fp8_blockwise(torch.randn(128, 256, generator=g) * 0.1)
        m.weight.copy_(w.weight)
        m.scale.copy_(w.scale.float())
        x = torch.randn(3, 2, 256, generator=g, dtype=torch.float64)
        y = m(x)
        assert y.shape == (3, 2, 128)
        assert torch.equal(y.view(6, 128), fp8_linear_ref(x.view(6, 256), w.weight, w.scale.float()))


def test_reference_activation_rounding_is_the_same_rule():
    """reference.act_fake_quant (the oracle's own code) rounds like the simulation, in float64
    and (computing in float32, result cast back) in bf16."""
    from dsv4_backend.reference import act_fake_quant
    g = _gen(4)
    x = (torch.randn(5, 384, generator=g) * 7).double()
    q, s = sim_act(x)
    want = (q.view(5, 3, 128) * s[..., None]).view(5, 384)
    assert torch.equal(act_fake_quant(x), want)
    xb = x.to(torch.bfloat16)
    qb, sb = sim_act(xb.double())
    got = act_fake_quant(xb)
    assert got.dtype == torch.bfloat16 and torch.equal(got.double(), (qb.view(5, 3, 128) * sb[..., None]).view(5, 384))
