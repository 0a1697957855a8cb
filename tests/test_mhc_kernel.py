"""The mHC Triton kernels (dsv4_backend/kernels/mhc.py) against float64 torch formulas.

On a machine without CUDA they run under TRITON_INTERPRET=1 (tests/conftest.py).

Tolerances: the kernels compute in fp32, so they are compared with the same formulas in
float64 (``model.hc_sinkhorn`` on float64 logits, einsum for collapse / expand) at 2e-6 absolute
(pre, post, C are in [0, 2]; 20 Sinkhorn rounds of fp32 division stay within a few ulp of 1e-7
each, since the iteration contracts errors), and with the model's own fp32 torch path at the
same bound. Collapse and expand are sums of hc (+1) products: they are compared within
gamma(terms) of the terms' magnitudes (tests/bounds.py), plus the bf16 rounding of the streams
(half a step against float64, one step against another fp32 order), plus what a TOL difference
in the mix weights moves.

Mix weights from the streams (``mhc_mix_from_streams``, ``mhc_head_pre``) compute the logits
``m_n = dot_n r``, ``dot_n = sum_k x_k fn_nk`` over ``K = hc D``, ``r = rsqrt(ssq / K + rms_eps)``,
``ssq = sum_k x_k^2``, in fp32 (x: the streams' values, exact in fp32). The kernel sums each chunk
of ``c`` products in some order, then the ``S = ceil(K / c)`` partials in some order, so (Higham
3.1 at each level) ``|dot - dot64| <= g sum_k |x_k fn_nk|`` with ``g = gamma(c) + gamma(S) (1 +
gamma(c))``; one K-term sum in any order (the torch matmul) has ``g = gamma(K)``. ssq likewise
within ``g ssq``; the division and the add cost u each (the GPU's division 2u), halved by the
square root, and the rsqrt 8u (tests/bounds.py), so r is within ``rho = (g + 3u) / 2 + 8u`` of its
value relative, and the product ``dot r`` one more u:

    |m - m64| <= (g sum_k |x_k fn_nk| + (rho + u) |dot64|) r64 (1 + 2 rho),

the last factor for the products of the small terms. pre and post then move by at most
``|scale_0| / 4`` and ``|scale_1| / 2`` times that (sigmoid's slope is at most 1/4), C by
``2 |J| dm`` with J the float64 Jacobian of ``hc_sinkhorn``'s C at m64 (first order, doubled
for the higher-order terms, of order dm^2: dm is ~1e-3 of the logits' size or less here), plus
TOL for the fp32 evaluation of the mix from the kernel's own logits, as above. Against the
model's torch fp32 path both sides' bounds add.
"""

from __future__ import annotations

import math

import pytest
import torch

from bounds import BF16_HALF, BF16_STEP, U32, assert_within, gamma
from dsv4_backend import model as model_mod
from dsv4_backend.config import DSV4Config
from dsv4_backend.kernels import mhc as mhc_mod
from dsv4_backend.kernels.mhc import mhc_collapse, mhc_expand, mhc_head_pre, mhc_mix, mhc_mix_from_streams
from dsv4_backend.model import hc_collapse, hc_expand, hc_head_collapse, hc_mix_logits, hc_mix_weights, hc_sinkhorn

CFG = DSV4Config.preset("tiny")
TOL = 2e-6


def mix_inputs(cfg: DSV4Config, T: int, seed: int, spread: float):
    g = torch.Generator().manual_seed(seed)
    n = cfg.hc_mult * (2 + cfg.hc_mult)
    m = torch.randn(T, n, generator=g, dtype=torch.float64) * spread
    m[: T // 4] *= 8.0                                    # a quarter with large logits
    scale = torch.rand(3, generator=g, dtype=torch.float64) * 2 + 0.1
    base = torch.randn(n, generator=g, dtype=torch.float64)
    return m, scale, base


def check_mix(cfg: DSV4Config, T: int, seed: int, spread: float):
    m, scale, base = mix_inputs(cfg, T, seed, spread)
    got = mhc_mix(m.float(), scale.float(), base.float(), cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps)
    # the fp32 inputs, evaluated in float64
    ref = hc_sinkhorn(cfg, m.float().double(), scale.float().double(), base.float().double())
    torch32 = hc_sinkhorn(cfg, m.float(), scale.float(), base.float())
    for name in ("pre", "post", "C"):
        g, r, t32 = getattr(got, name), getattr(ref, name), getattr(torch32, name)
        assert g.dtype == torch.float32 and g.shape == r.shape, name
        assert torch.isfinite(g).all(), name
        err = (g.double() - r).abs().max().item()
        assert err <= TOL, f"{name}: max |kernel - float64| = {err:.3g}"
        err32 = (g - t32).abs().max().item()
        assert err32 <= TOL, f"{name}: max |kernel - torch fp32| = {err32:.3g}"
    return got, ref


# These launch the kernels on CPU tensors, which only the Triton interpreter can run; on a GPU
# machine the CUDA tests at the end of this file cover the same kernels.
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="CPU tensors through Triton need the interpreter")


@interpreter_only
def test_mix_matches_float64_reference():
    got, ref = check_mix(CFG, T=300, seed=1, spread=3.0)
    C = got.C.double()
    # the last Sinkhorn step normalises columns: they sum to 1 (up to eps); rows are as close
    # to 1 as the float64 reference gets them after the same rounds
    col = C.sum(-2)
    assert (col - 1).abs().max().item() < 1e-5
    row, row_ref = C.sum(-1), ref.C.sum(-1)
    assert (row - row_ref).abs().max().item() < 1e-5
    assert (row - 1).abs().median().item() < 1e-3
    assert (got.pre > 0).all() and (got.pre <= 1 + 2 * CFG.hc_eps).all()
    assert (got.post >= 0).all() and (got.post <= 2).all()


@interpreter_only
@pytest.mark.parametrize("hc, iters, T", [(3, 5, 37), (4, 1, 65), (2, 7, 16)])
def test_mix_other_shapes(hc, iters, T):
    # hc not a power of two exercises the padded rows / columns; iters = 1 the column step only
    cfg = CFG.replace(hc_mult=hc, hc_sinkhorn_iters=iters)
    check_mix(cfg, T=T, seed=hc * 10 + iters, spread=2.0)


def test_mix_rejects_bad_shapes():
    with pytest.raises(ValueError, match="mhc_mix"):
        mhc_mix(torch.randn(5, 23), torch.ones(3), torch.zeros(24), 4, 20, 1e-6)
    with pytest.raises(ValueError, match="mhc_mix"):
        mhc_mix(torch.randn(5, 24), torch.ones(2), torch.zeros(24), 4, 20, 1e-6)


# ---- mix weights straight from the streams -----------------------------------------------------

def stream_inputs(T: int, hc: int, D: int, dtype: torch.dtype, seed: int, n: int | None = None):
    """Streams [T, hc, D] of uneven size per token (the rsqrt matters), fn at twice the release's
    init scale (logits of order 1), scale and base as the mix's (3, n) or the head's (1, hc)."""
    g = torch.Generator().manual_seed(seed)
    n = hc * (2 + hc) if n is None else n
    X = torch.randn(T, hc, D, generator=g) * torch.logspace(-2, 2, T)[:, None, None]
    fn = torch.randn(n, hc * D, generator=g) * 2 * (hc * D) ** -0.5
    scale = torch.rand(3 if n == hc * (2 + hc) else 1, generator=g) * 2 + 0.1
    return X.to(dtype), fn, scale, torch.randn(n, generator=g)


def logit_bound(X: torch.Tensor, fn: torch.Tensor, rms_eps: float, chunk: int | None) -> torch.Tensor:
    """Bound on |m - m64| of the fp32 logits [T, n] (module docstring); chunk: the kernel's
    split-K chunk, None for one K-term sum in any order (the torch matmul)."""
    x, f = X.double().cpu().flatten(1), fn.double().cpu()
    K = x.shape[1]
    g = gamma(K) if chunk is None else gamma(chunk) + gamma(math.ceil(K / chunk)) * (1 + gamma(chunk))
    rho = (g + 3 * U32) / 2 + 8 * U32
    r = torch.rsqrt(x.square().mean(-1, keepdim=True) + rms_eps)
    return (g * (x.abs() @ f.abs().t()) + (rho + U32) * (x @ f.t()).abs()) * r * (1 + 2 * rho)


def mix_shift_bound(cfg: DSV4Config, m: torch.Tensor, dm: torch.Tensor, scale, base):
    """How far the float64 (pre, post, C) can move when their logits m [T, n] move by at most dm."""
    hc, s = cfg.hc_mult, scale.double().cpu().abs()
    sc, b = scale.double().cpu(), base.double().cpu()
    J = torch.func.vmap(torch.func.jacrev(lambda z: hc_sinkhorn(cfg, z[None], sc, b).C[0]))(m)  # [T, hc, hc, n]
    return s[0] / 4 * dm[:, :hc], s[1] / 2 * dm[:, hc:2 * hc], 2 * (J.abs() * dm[:, None, None, :]).sum(-1)


def check_mix_from_streams(cfg: DSV4Config, X, fn, scale, base, chunk: int, **launch):
    """mhc_mix_from_streams against hc_sinkhorn(hc_mix_logits) in float64 and in the torch fp32 path."""
    got = mhc_mix_from_streams(X, fn, scale, base, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                               cfg.rms_norm_eps, chunk=chunk, **launch)
    Xc, fc, sc, bc = X.cpu(), fn.cpu(), scale.cpu(), base.cpu()
    m64 = hc_mix_logits(cfg, Xc.double(), fc.double())
    ref = hc_sinkhorn(cfg, m64, sc.double(), bc.double())
    dm = logit_bound(X, fn, cfg.rms_norm_eps, chunk)
    dm32 = logit_bound(X, fn, cfg.rms_norm_eps, None)
    torch32 = hc_sinkhorn(cfg, hc_mix_logits(cfg, Xc, fc), sc, bc)
    for name, g, r, t32, b, b2 in zip(("pre", "post", "C"), got, ref, torch32, mix_shift_bound(cfg, m64, dm, sc, bc),
                                      mix_shift_bound(cfg, m64, dm + dm32, sc, bc)):
        assert g.dtype == torch.float32 and g.shape == r.shape, name
        assert_within(g, r, TOL + b, f"{name}: streams kernel vs float64")
        assert_within(g, t32, 2 * TOL + b2, f"{name}: streams kernel vs torch fp32")
    return got


@interpreter_only
@pytest.mark.parametrize("T, hc, D, chunk, dtype", [
    (1, 4, 64, 64, torch.float32),        # K = 256: 4 chunks
    (3, 4, 64, 64, torch.bfloat16),
    (3, 4, 100, 64, torch.float32),       # K = 400: the 7th chunk is 16 wide
    (5, 3, 40, 32, torch.bfloat16),       # hc = 3 (padded), N = 15; a second, partial token block
    (2, 4, 64, 512, torch.float32),       # one chunk wider than K
])
def test_mix_from_streams_matches_float64(T, hc, D, chunk, dtype):
    cfg = CFG.replace(hc_mult=hc)
    X, fn, scale, base = stream_inputs(T, hc, D, dtype, seed=T * 100 + D)
    got = check_mix_from_streams(cfg, X, fn, scale, base, chunk)
    assert (got.C.sum(-2) - 1).abs().max().item() < 1e-5


@interpreter_only
@pytest.mark.parametrize("T, hc, D, chunk, block_t", [
    (1, 4, 64, 64, 16),      # one token in a 16-row dot tile
    (17, 4, 100, 32, 16),    # a second, partial token block; a 4-wide last chunk
    (5, 3, 40, 32, 32),      # hc = 3 (padded), N = 15
])
def test_mix_from_streams_dot_partials(T, hc, D, chunk, block_t):
    """The tl.dot partials sum each chunk's exact fp32 products in another order: the same bound."""
    cfg = CFG.replace(hc_mult=hc)
    X, fn, scale, base = stream_inputs(T, hc, D, torch.bfloat16, seed=T * 7 + D)
    check_mix_from_streams(cfg, X, fn, scale, base, chunk, dot=True, block_t=block_t)


def test_mix_launch_rule():
    """Below MIX_DOT_MIN_TOKENS the broadcast product in 128-value chunks, from it tl.dot in 64s;
    the finalize on one warp; a tl.dot launch needs 16 tokens a program."""
    small, big = mhc_mod.mix_launch(4, 24), mhc_mod.mix_launch(mhc_mod.MIX_DOT_MIN_TOKENS, 24)
    assert (small.dot, small.chunk, small.block_t, small.finalize_warps) == (False, 128, 4, 1)
    assert (big.dot, big.chunk, big.block_t) == (True, 64, 16)
    assert mhc_mod.mix_launch(64, 24).block_t == 32
    hc, D = 4, 16
    X, fn, scale, base = stream_inputs(2, hc, D, torch.float32, seed=0)
    with pytest.raises(ValueError, match="block_t >= 16"):
        mhc_mix_from_streams(X, fn, scale, base, hc, 20, 1e-6, 1e-6, dot=True, block_t=4)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_pre_from_streams(dtype):
    T, hc, D, chunk = 3, CFG.hc_mult, 100, 64
    X, fn, scale, base = stream_inputs(T, hc, D, dtype, seed=11, n=hc)
    pre = mhc_head_pre(X, fn, scale, base, CFG.hc_eps, CFG.rms_norm_eps, chunk=chunk)
    x = X.double().flatten(1)
    m64 = (x @ fn.double().t()) * torch.rsqrt(x.square().mean(-1, keepdim=True) + CFG.rms_norm_eps)
    ref = torch.sigmoid(m64 * scale.double() + base.double()) + CFG.hc_eps
    assert pre.dtype == torch.float32 and pre.shape == (T, hc)
    dm = logit_bound(X, fn, CFG.rms_norm_eps, chunk)
    assert_within(pre, ref, TOL + scale.double().abs() / 4 * dm, "head pre")


def test_mix_from_streams_rejects_bad_inputs():
    hc, D = 4, 16
    X, fn, scale, base = stream_inputs(2, hc, D, torch.float32, seed=0)
    mix = lambda **kw: mhc_mix_from_streams(**{**dict(X=X, fn=fn, scale=scale, base=base, hc=hc, sinkhorn_iters=20,
                                                      hc_eps=1e-6, rms_eps=1e-6), **kw})
    strided = X.transpose(1, 2).contiguous().transpose(1, 2)
    for bad in (dict(X=X.flatten(1)), dict(X=strided), dict(X=X.double()), dict(X=X[:, :3].contiguous()),
                dict(fn=fn[:, :-1]), dict(fn=fn.bfloat16()), dict(fn=fn.t().contiguous().t()), dict(fn=fn[:-1]),
                dict(scale=scale[:2]), dict(base=base[:-1]), dict(sinkhorn_iters=0), dict(chunk=100),
                dict(chunk=8)):
        with pytest.raises(ValueError, match="mhc_mix_from_streams"):
            mix(**bad)
    Xh, fnh, sh, bh = stream_inputs(2, hc, D, torch.float32, seed=0, n=hc)
    for args in ((Xh, fnh, scale, bh), (Xh, fnh, sh, bh[:-1]), (Xh, fn, sh, bh),
                 (Xh.bfloat16()[..., ::2], fnh, sh, bh)):
        with pytest.raises(ValueError, match="mhc_head_pre"):
            mhc_head_pre(*args, 1e-6, 1e-6)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collapse_and_expand(dtype):
    g = torch.Generator().manual_seed(7)
    T, hc, D = 9, CFG.hc_mult, 300                       # D not a multiple of the block
    X = torch.randn(T, hc, D, generator=g).to(dtype)
    f = torch.randn(T, D, generator=g).to(dtype)
    pre = torch.rand(T, hc, generator=g)
    post = torch.rand(T, hc, generator=g) * 2
    C = torch.rand(T, hc, hc, generator=g)

    y = mhc_collapse(X, pre)
    y_ref = torch.einsum("tj,tjd->td", pre.double(), X.double())
    assert y.dtype == torch.float32
    y_mag = torch.einsum("tj,tjd->td", pre.double(), X.double().abs())
    assert_within(y, y_ref, gamma(hc) * y_mag + U32 * y_ref.abs(), "collapse")

    out_ref = (post.double()[:, :, None] * f.double()[:, None, :]
               + torch.einsum("tjk,tjd->tkd", C.double(), X.double()))
    mag = (post.double()[:, :, None] * f.double().abs()[:, None, :]
           + torch.einsum("tjk,tjd->tkd", C.double(), X.double().abs()))
    bound = gamma(hc + 1) * mag + U32 * out_ref.abs()
    if dtype == torch.bfloat16:                       # the stored stream: half a bf16 step more
        bound = bound + BF16_HALF * (out_ref.abs() + bound)
    for block_d in (None, 256):                       # the few-token default (64) and the large-T one
        out = mhc_expand(X, f, post, C, block_d=block_d)
        assert out.dtype == dtype and out.shape == X.shape
        assert_within(out, out_ref, bound, f"expand (block_d {block_d})")


def boundary_inputs(T: int, hc: int, D: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    """A sub-layer boundary's inputs: streams X, the sub-layer's output f, its post and C, and the
    next mix's fn, scale, base and norm weight."""
    g = torch.Generator().manual_seed(seed)
    X, fn, scale, base = stream_inputs(T, hc, D, dtype, seed)
    f = (torch.randn(T, D, generator=g) * 3).to(dtype)
    post, C = torch.rand(T, hc, generator=g) * 2, torch.rand(T, hc, hc, generator=g)
    w = torch.rand(D, generator=g) + 0.5
    return [t.to(device) for t in (X, f, post, C, fn, scale, base, w)]


def check_expand_partials(T, hc, D, dtype, device):
    """mhc_expand_partials: the new streams within the expand's float64 bound, and the partials
    within gamma(chunk) of the float64 chunk sums of the streams as stored; under the interpreter
    both equal the separate launches' (mhc_expand, then the mix's partials) bit for bit."""
    X, f, post, C, fn, *_ = boundary_inputs(T, hc, D, dtype, seed=T + D, device=device)
    out, part = mhc_mod.mhc_expand_partials(X, f, post, C, fn)
    Xd, fd, pd, Cd = X.double().cpu(), f.double().cpu(), post.double().cpu(), C.double().cpu()
    out_ref = pd[:, :, None] * fd[:, None, :] + torch.einsum("tjk,tjd->tkd", Cd, Xd)
    mag = pd[:, :, None] * fd.abs()[:, None, :] + torch.einsum("tjk,tjd->tkd", Cd, Xd.abs())
    bound = gamma(hc + 1) * mag + U32 * out_ref.abs()
    if dtype == torch.bfloat16:
        bound = bound + BF16_HALF * (out_ref.abs() + bound)
    assert out.dtype == dtype and out.shape == X.shape
    assert_within(out, out_ref, bound, "expand of expand_partials")
    chunk = mhc_mod.mix_launch(T, fn.shape[0]).chunk
    S = hc * D // chunk
    x = out.double().cpu().flatten(1).view(T, S, chunk)                     # the streams as stored
    fc = fn.double().cpu().view(-1, S, chunk)
    dots = torch.einsum("tsc,nsc->tsn", x, fc)
    dots_mag = torch.einsum("tsc,nsc->tsn", x.abs(), fc.abs())
    assert part.shape == (T, S, fn.shape[0] + 1) and part.dtype == torch.float32
    assert_within(part[..., :-1], dots, gamma(chunk) * dots_mag, "partial dots")
    ssq = x.square().sum(-1)
    assert_within(part[..., -1], ssq, gamma(chunk) * ssq, "partial sums of squares")
    if device == "cpu":
        assert torch.equal(out, mhc_expand(X, f, post, C))
        assert torch.equal(part, mhc_mod._launch_partials(out, fn, mhc_mod.mix_launch(T, fn.shape[0])))


def check_finalize(T, hc, D, dtype, device):
    """mhc_mix_finalize of the expand's partials: the mix mhc_mix_from_streams gives for the new
    streams, bit for bit under the interpreter (the same partials, the same finalize), within the
    fp32 evaluation's TOL on a GPU."""
    cfg = CFG.replace(hc_mult=hc)
    X, f, post, C, fn, scale, base, _ = boundary_inputs(T, hc, D, dtype, seed=3 * T + D, device=device)
    out, part = mhc_mod.mhc_expand_partials(X, f, post, C, fn)
    mix = mhc_mod.mhc_mix_finalize(part, hc * D, scale, base, hc, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    two = mhc_mix_from_streams(out, fn, scale, base, hc, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    for name, a, b in zip(("pre", "post", "C"), mix, two):
        if device == "cpu":
            assert torch.equal(a, b), name
        else:
            assert_within(a, b, torch.full(a.shape, 2 * TOL, dtype=torch.float64), name)


@interpreter_only
@pytest.mark.parametrize("T, dtype", [(1, torch.bfloat16), (3, torch.float32), (17, torch.bfloat16)])
def test_expand_partials(T, dtype):
    """One token, a partial token block, and the tl.dot partials from 16 tokens."""
    check_expand_partials(T, CFG.hc_mult, 256, dtype, "cpu")


@interpreter_only
@pytest.mark.parametrize("T, hc, dtype", [(1, 4, torch.bfloat16), (3, 3, torch.float32), (5, 4, torch.bfloat16)])
def test_mix_finalize_of_expand_partials(T, hc, dtype):
    check_finalize(T, hc, 256, dtype, "cpu")


def test_fused_boundary_kernels_reject_bad_inputs():
    X, f, post, C, fn, scale, base, w = boundary_inputs(2, 4, 128, torch.float32, seed=0)
    assert mhc_mod.expand_partials_apply(X, fn)
    assert not mhc_mod.expand_partials_apply(X[..., :120].contiguous(), fn[:, :480].contiguous())
    with pytest.raises(ValueError, match="mhc_expand_partials: D=120"):
        mhc_mod.mhc_expand_partials(X[..., :120].contiguous(), f[:, :120], post, C, fn[:, :480].contiguous())
    with pytest.raises(ValueError, match="mhc_expand_partials: shapes"):
        mhc_mod.mhc_expand_partials(X, f[:1], post, C, fn)
    part = torch.zeros(2, 2, 25)
    with pytest.raises(ValueError, match="mhc_mix_finalize: want"):
        mhc_mod.mhc_mix_finalize(part[..., :24], 4 * 128, scale, base, 4, 20, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="mhc_mix_finalize: scale"):
        mhc_mod.mhc_mix_finalize(part, 4 * 128, scale[:2], base, 4, 20, 1e-6, 1e-6)


@interpreter_only
def test_model_blocks_carry_the_fused_boundaries(monkeypatch):
    """The tiny model's forward with the mHC kernels on (the CUDA condition forced): the fused
    boundaries (an expand with the next mix's partials, the last expand of one block feeding the
    next block's mix) give the same streams, bit for bit, as the separate launches; from the tl.dot
    threshold (20 tokens) every boundary keeps the separate launches."""
    from dsv4_backend.weights import random_weights

    class Sublayer(torch.nn.Module):     # an elementwise stand-in for attention / the MoE
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, x, *_):
            return self.fn(x)

    cfg = CFG.replace(vocab_size=512)
    model = model_mod.DSV4Model(cfg, dtype=torch.bfloat16, include_mtp=False)
    model.load_stream(random_weights(cfg, seed=1, dtype=torch.bfloat16, include_mtp=False).items())
    for layer in model.layers:
        layer.attn, layer.ffn = Sublayer(lambda x: torch.tanh(x) * 2), Sublayer(torch.sin)
    monkeypatch.setattr(model_mod, "_mhc_kernels_apply", lambda t: t.dtype != torch.float64)
    monkeypatch.setattr(model_mod, "_norm_rope_kernel_applies", lambda t: t.dtype in (torch.float32, torch.bfloat16))
    launches = []
    for name in ("mhc_expand_partials", "mhc_mix_finalize", "mhc_mix_from_streams", "mhc_expand"):
        real = getattr(mhc_mod, name)
        monkeypatch.setattr(mhc_mod, name, lambda *a, _r=real, _n=name, **k: launches.append(_n) or _r(*a, **k))
    for T in (1, 20):
        g = torch.Generator().manual_seed(T)
        ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
        outs = {}
        for fused in (True, False):
            monkeypatch.setattr(model_mod, "USE_MHC_FUSED", fused)
            launches.clear()
            outs[fused] = model(ids, torch.arange(T), None, None)
            n = len(model.layers)
            want = ({"mhc_expand_partials": 2 * n - 1, "mhc_mix_finalize": 2 * n - 1, "mhc_mix_from_streams": 1,
                     "mhc_expand": 1} if fused and T < mhc_mod.MIX_DOT_MIN_TOKENS
                    else {"mhc_expand": 2 * n, "mhc_mix_from_streams": 2 * n})
            assert {k: launches.count(k) for k in set(launches)} == want, (fused, launches)
        assert torch.equal(outs[True], outs[False])


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_tokens", [256, 0])
def test_model_dispatch_uses_kernels(monkeypatch, dtype, max_tokens):
    """With the CUDA condition forced on, the model's mHC functions route to the kernels and
    agree with their torch path (which the CPU keeps): at most MHC_MIX_FROM_STREAMS_MAX_TOKENS
    tokens take the mix from the streams, more (here: a limit of 0) the matmul's logits."""
    g = torch.Generator().manual_seed(3)
    T, hc, D = 50, CFG.hc_mult, CFG.hidden_size
    X = torch.randn(T, hc, D, generator=g).to(dtype)
    fn = torch.randn(hc * (2 + hc), hc * D, generator=g) * 0.05
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(hc * (2 + hc), generator=g)
    f = torch.randn(T, D, generator=g).to(dtype)

    torch_mix = hc_mix_weights(CFG, X, fn, scale, base)
    torch_y = hc_collapse(X, torch_mix.pre)
    torch_out = hc_expand(X, f, torch_mix.post, torch_mix.C)

    calls, streams = [], []
    monkeypatch.setattr(model_mod, "_mhc_kernels_apply",
                        lambda t: calls.append(t.dtype) or t.dtype != torch.float64)
    monkeypatch.setattr(model_mod, "MHC_MIX_FROM_STREAMS_MAX_TOKENS", max_tokens)
    monkeypatch.setattr(mhc_mod, "mhc_mix_from_streams",
                        lambda *a, **k: streams.append(1) or mhc_mix_from_streams(*a, **k))
    mix = hc_mix_weights(CFG, X, fn, scale, base)
    y = hc_collapse(X, mix.pre)
    out = hc_expand(X, f, mix.post, mix.C)
    assert len(calls) == 3 and len(streams) == (1 if max_tokens else 0)
    if max_tokens:     # both sides' logits bounds (module docstring), and TOL each for the mix
        m64 = hc_mix_logits(CFG, X.double(), fn.double())
        chunk = mhc_mod.mix_launch(T, hc * (2 + hc)).chunk   # 50 tokens: the tl.dot partials
        dm = logit_bound(X, fn, CFG.rms_norm_eps, chunk) + logit_bound(X, fn, CFG.rms_norm_eps, None)
        dmix = [2 * TOL + b for b in mix_shift_bound(CFG, m64, dm, scale, base)]
    else:              # the same logits: TOL
        dmix = [torch.full(a.shape, TOL, dtype=torch.float64) for a in mix]
    for name, a, b, d in zip(("pre", "post", "C"), mix, torch_mix, dmix):
        assert_within(a, b, d, f"mix {name}")
    # two fp32 orders (2 gamma), and the mixes' own difference times what they weigh
    dpre, dpost, dC = dmix
    Xa, fa = X.double().abs(), f.double().abs()
    y_mag = torch.einsum("tj,tjd->td", torch_mix.pre.double(), Xa)
    assert_within(y, torch_y, 2 * gamma(hc) * y_mag + torch.einsum("tj,tjd->td", dpre, Xa)
                  + 2 * U32 * torch_y.double().abs(), "collapse")
    mag = (torch_mix.post.double()[:, :, None] * fa[:, None, :]
           + torch.einsum("tjk,tjd->tkd", torch_mix.C.double(), Xa))
    bound = 2 * gamma(hc + 1) * mag + (dpost[:, :, None] * fa[:, None, :]
                                       + torch.einsum("tjk,tjd->tkd", dC, Xa)) * (1 + 1e-6)
    if dtype == torch.bfloat16:                       # both sides round to bf16: one step apart
        bound = bound + BF16_STEP * (torch_out.double().abs() + bound)
    assert_within(out, torch_out, bound, "expand")


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_head_collapse_uses_kernels(monkeypatch, dtype):
    """hc_head_collapse on the kernel path (its pre from the streams, then the collapse kernel)
    agrees with its torch path within both sides' logits bounds through sigmoid's slope."""
    T, hc, D = 3, CFG.hc_mult, CFG.hidden_size
    X, fn, scale, base = stream_inputs(T, hc, D, dtype, seed=5, n=hc)
    torch_y = hc_head_collapse(CFG, X, fn, scale, base)
    heads = []
    monkeypatch.setattr(model_mod, "_mhc_kernels_apply", lambda t: t.dtype != torch.float64)
    monkeypatch.setattr(mhc_mod, "mhc_head_pre", lambda *a, **k: heads.append(1) or mhc_head_pre(*a, **k))
    y = hc_head_collapse(CFG, X, fn, scale, base)
    assert heads == [1] and y.dtype == torch.float32
    dm = logit_bound(X, fn, CFG.rms_norm_eps, 128) + logit_bound(X, fn, CFG.rms_norm_eps, None)
    dpre = 2 * TOL + scale.double().abs() / 4 * dm
    Xa = X.double().abs()
    x = X.double().flatten(1)
    pre64 = torch.sigmoid((x @ fn.double().t()) * torch.rsqrt(x.square().mean(-1, keepdim=True) + CFG.rms_norm_eps)
                          * scale.double() + base.double()) + CFG.hc_eps
    y_mag = torch.einsum("tj,tjd->td", pre64 + dpre, Xa)
    assert_within(y, torch_y, 2 * gamma(hc) * y_mag + torch.einsum("tj,tjd->td", dpre, Xa)
                  + 2 * U32 * torch_y.double().abs(), "head collapse")


def test_float64_path_stays_torch(monkeypatch):
    """float64 never reaches a kernel (the engine's exactness tests rely on it)."""
    X = torch.randn(4, CFG.hc_mult, 16, dtype=torch.float64)
    assert not model_mod._mhc_kernels_apply(X)
    assert not model_mod._mhc_kernels_apply(X.float())        # CPU tensors: torch path


# ---- MoE: the grouped (sync-free) routed-expert path ------------------------------------------

def make_moe(cfg: DSV4Config, seed: int, dtype: torch.dtype, stacked: bool) -> model_mod.MoE:
    g = torch.Generator().manual_seed(seed)
    moe = model_mod.MoE(cfg, hash_routed=False)
    if stacked:
        moe.stack_experts(dtype, torch.device("cpu"))
    for name, p in moe.named_parameters():
        fan_in = p.shape[-1] if p.dim() == 2 else 1
        val = torch.randn(p.shape, generator=g) * fan_in ** -0.5
        if name.startswith("gate."):
            p.data = val.float() * (0.01 if name == "gate.bias" else 1.0)  # no expert starved
        elif ".experts." in "." + name and stacked:
            p.data.copy_(val.to(dtype))          # in place: the stacks see it
        else:
            p.data = val.to(dtype)
    return moe


@pytest.mark.parametrize("T", [3, 200])
def test_grouped_moe_matches_expert_loop(monkeypatch, T):
    """The grouped path (forced on; torch._grouped_mm's CPU version stands in for the CUDA
    kernel, its SwiGLU and combine kernels under the interpreter) gives the per-expert loop's
    output, with experts that get no token (T = 3) and many tokens per expert (T = 200)."""
    cfg = CFG.replace(n_routed_experts=16, num_experts_per_tok=3)
    moe = make_moe(cfg, seed=T, dtype=torch.bfloat16, stacked=True)
    g = torch.Generator().manual_seed(T + 1)
    x = torch.randn(T, cfg.hidden_size, generator=g).to(torch.bfloat16)
    ids = torch.zeros(T, dtype=torch.int64)
    ids_used, _ = moe.gate(x, ids)
    used = torch.bincount(ids_used.reshape(-1), minlength=16)
    assert (used == 0).any() if T == 3 else (used > 1).all()

    monkeypatch.setattr(model_mod.MoE, "_grouped_applies", lambda self, x: False)
    loop = moe(x, ids)
    calls = []
    monkeypatch.setattr(model_mod.MoE, "_grouped_applies", lambda self, x: calls.append(1) or True)
    grouped = moe(x, ids)
    assert calls and grouped.dtype == torch.bfloat16
    # T = 3: its 9 pairs ordered by the one-launch route (kernels/fp4_moe.route_fused; under the
    # interpreter: on a CUDA machine these CPU tensors take the sort); the sort it replaces gives
    # the same order, so the same bits (T = 200, 600 pairs, takes the sort)
    from dsv4_backend.kernels import fp4_moe
    with monkeypatch.context() as m:
        m.setattr(fp4_moe, "ROUTE_FUSED_MAX_PAIRS", 0)
        assert torch.equal(moe(x, ids), grouped)
    # float64 reference of the same maths (projections rounded to bf16 as both paths do)
    xd, out = x.double(), moe.shared_experts(x).double()
    wts = moe.gate(x, ids)[1].double()
    for t in range(T):
        for j in range(cfg.num_experts_per_tok):
            ex = moe.experts[int(ids_used[t, j])]
            gt = (xd[t] @ ex.w1.weight.double().t()).to(torch.bfloat16).double()
            ut = (xd[t] @ ex.w3.weight.double().t()).to(torch.bfloat16).double()
            h = torch.nn.functional.silu(gt.clamp(max=ex.limit)) * ut.clamp(-ex.limit, ex.limit) * wts[t, j]
            out[t] += h.to(torch.bfloat16).double() @ ex.w2.weight.double().t()
    scale = out.abs().max().item()
    assert (grouped.double() - loop.double()).abs().max().item() <= 2 ** -6 * scale
    assert (grouped.double() - out).abs().max().item() <= 2 ** -6 * scale
    # the SwiGLU and the sum over the choices by torch ops (kernels/moe_grouped.py off): the same maths
    with monkeypatch.context() as m:
        m.setattr(model_mod, "USE_MOE_GLUE_KERNELS", False)
        assert (moe(x, ids).double() - out).abs().max().item() <= 2 ** -6 * scale
    # an expert range (as a rank of expert parallelism holds): the pairs of ids 0, 1 are another
    # rank's (-1), sorted past every group and left out; both routes, the same bits
    moe.expert_range = (2, 2 + cfg.n_routed_experts)
    ranged = moe(x, ids)
    with monkeypatch.context() as m:
        m.setattr(fp4_moe, "ROUTE_FUSED_MAX_PAIRS", 0)
        assert torch.equal(moe(x, ids), ranged)
    monkeypatch.setattr(model_mod.MoE, "_grouped_applies", lambda self, x: False)
    assert (ranged.double() - moe(x, ids).double()).abs().max().item() <= 2 ** -6 * scale
    assert not torch.equal(ranged, grouped)


def test_stacked_experts_keep_names_and_values():
    cfg = CFG.replace(n_routed_experts=4)
    moe = make_moe(cfg, seed=5, dtype=torch.bfloat16, stacked=True)
    inter = cfg.moe_intermediate_size
    for e, ex in enumerate(moe.experts):
        assert torch.equal(moe._w13[e, :inter], ex.w1.weight) and torch.equal(moe._w13[e, inter:], ex.w3.weight)
        assert torch.equal(moe._w2[e], ex.w2.weight)
    assert "_w13" not in dict(moe.state_dict()) and len(moe.state_dict()) == len(make_moe(
        cfg, seed=5, dtype=torch.bfloat16, stacked=False).state_dict())
    assert moe._aligned   # 128 / 256-wide bf16 rows are 16-byte multiples
    # CPU tensors never take the grouped path
    assert not moe._grouped_applies(torch.zeros(2, cfg.hidden_size, dtype=torch.bfloat16))


def test_model_with_stacked_experts_loads_the_release_weights(monkeypatch):
    """DSV4Model's stacked allocation (CUDA bf16 only; forced here) keeps every name and
    loads every expert tensor into its stack slice."""
    from dsv4_backend.model import DSV4Model
    from dsv4_backend.weights import random_weights
    monkeypatch.setattr(model_mod, "_stack_experts_for", lambda device, dtype: True)
    weights = random_weights(CFG, seed=11, dtype=torch.bfloat16, include_mtp=True)
    model = DSV4Model(CFG, dtype=torch.bfloat16, include_mtp=True)
    model.load_state_dict(weights, strict=True)
    state = model.state_dict()
    assert set(state) == set(weights)
    moes = [m for m in model.modules() if isinstance(m, model_mod.MoE)]
    assert len(moes) == CFG.num_hidden_layers + len(CFG.mtp_ratios)
    inter = CFG.moe_intermediate_size
    for prefix, moe in [(n, m) for n, m in model.named_modules() if isinstance(m, model_mod.MoE)]:
        for e in (0, len(moe.experts) - 1):
            name = f"{prefix}.experts.{e}"
            assert torch.equal(moe._w13[e, :inter], weights[f"{name}.w1.weight"])
            assert torch.equal(moe._w13[e, inter:], weights[f"{name}.w3.weight"])
            assert torch.equal(moe._w2[e], weights[f"{name}.w2.weight"])
            assert state[f"{name}.w2.weight"].data_ptr() == moe._w2[e].data_ptr()
        assert torch.equal(moe.shared_experts.w1.weight, weights[f"{prefix}.shared_experts.w1.weight"])


# ---- on a GPU only: the real CUDA paths (skipped on the CPU) ----------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_mix_collapse_expand_match_torch():
    dev = torch.device("cuda")
    m, scale, base = mix_inputs(CFG, 1000, 21, 3.0)
    got = mhc_mix(m.float().to(dev), scale.float().to(dev), base.float().to(dev),
                  CFG.hc_mult, CFG.hc_sinkhorn_iters, CFG.hc_eps)
    ref = hc_sinkhorn(CFG, m.float().double(), scale.float().double(), base.float().double())
    for a, b in zip(got, ref):
        assert (a.double().cpu() - b).abs().max().item() <= TOL
    X = torch.randn(64, CFG.hc_mult, 4096, device=dev).bfloat16()
    f = torch.randn(64, 4096, device=dev).bfloat16()
    pre, post, C = (t[:64].to(dev) for t in got)
    y_ref = torch.einsum("tj,tjd->td", pre.double(), X.double())
    assert (mhc_collapse(X, pre).double() - y_ref).abs().max().item() < 1e-4
    out_ref = post.double()[:, :, None] * f.double()[:, None, :] + torch.einsum("tjk,tjd->tkd", C.double(), X.double())
    rel = ((mhc_expand(X, f, post, C).double() - out_ref).abs() / out_ref.abs().clamp(min=1e-2)).max().item()
    assert rel <= 2 ** -8 * 1.01


@cuda
@pytest.mark.parametrize("T", [1, 33, 1024])
def test_cuda_grouped_moe_matches_expert_loop(monkeypatch, T):
    if not model_mod._grouped_mm_device(torch.device("cuda")):
        pytest.skip("torch._grouped_mm has no sync-free bf16 kernel on this GPU")
    cfg = CFG.replace(hidden_size=1024, moe_intermediate_size=512, n_routed_experts=256,
                      num_experts_per_tok=6)
    moe = make_moe(cfg, seed=T, dtype=torch.bfloat16, stacked=True).cuda()
    moe.stack_experts(torch.bfloat16, torch.device("cuda"))   # .cuda() moved the params off the stacks
    ref = make_moe(cfg, seed=T, dtype=torch.bfloat16, stacked=False)
    moe.load_state_dict(ref.state_dict())
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(T)).bfloat16().cuda()
    ids = torch.zeros(T, dtype=torch.int64, device="cuda")
    assert moe._grouped_applies(x)
    grouped = moe(x, ids)
    monkeypatch.setattr(model_mod, "USE_GROUPED_MOE", False)
    assert not moe._grouped_applies(x)
    loop = moe(x, ids)
    scale = loop.abs().max().item()
    assert (grouped.double() - loop.double()).abs().max().item() <= 2 ** -6 * scale


@cuda
@pytest.mark.parametrize("T", [1, 3, 17, 64, 256])
def test_cuda_mix_from_streams_at_flash_shape(T):
    """Flash's streams (hc = 4, D = 4096: K = 16384) through the two launches at the default
    launch (tl.dot partials from 16 tokens), against float64, the CPU's torch fp32 path and the
    GPU's matmul path (hc_mix_logits, then mhc_mix)."""
    dev = torch.device("cuda")
    hc, D = CFG.hc_mult, 4096
    X, fn, scale, base = (t.to(dev) for t in stream_inputs(T, hc, D, torch.bfloat16, seed=T))
    chunk = mhc_mod.mix_launch(T, hc * (2 + hc)).chunk
    got = check_mix_from_streams(CFG, X, fn, scale, base, chunk=chunk)
    matmul = mhc_mix(hc_mix_logits(CFG, X, fn), scale, base, hc, CFG.hc_sinkhorn_iters, CFG.hc_eps)
    m64 = hc_mix_logits(CFG, X.double().cpu(), fn.double().cpu())
    dm = logit_bound(X, fn, CFG.rms_norm_eps, chunk) + logit_bound(X, fn, CFG.rms_norm_eps, None)
    for name, a, b, d in zip(("pre", "post", "C"), got, matmul, mix_shift_bound(CFG, m64, dm, scale, base)):
        assert_within(a, b, 2 * TOL + d, f"{name}: streams vs matmul path")

    Xh, fnh, sh, bh = (t.to(dev) for t in stream_inputs(T, hc, D, torch.bfloat16, seed=T, n=hc))
    pre = mhc_head_pre(Xh, fnh, sh, bh, CFG.hc_eps, CFG.rms_norm_eps)
    x = Xh.double().cpu().flatten(1)
    m64 = (x @ fnh.double().cpu().t()) * torch.rsqrt(x.square().mean(-1, keepdim=True) + CFG.rms_norm_eps)
    ref = torch.sigmoid(m64 * sh.double().cpu() + bh.double().cpu()) + CFG.hc_eps
    assert_within(pre, ref, TOL + sh.double().cpu().abs() / 4 * logit_bound(Xh, fnh, CFG.rms_norm_eps, 128),
                  "head pre")


@cuda
@pytest.mark.parametrize("T", [1, 3, 15])
def test_cuda_fused_boundaries_at_flash_shape(T):
    """The fused boundary on Flash's streams (hc = 4, D = 4096): the expand and partials within
    their float64 bounds, the finalized mix against the separate launches'."""
    check_expand_partials(T, CFG.hc_mult, 4096, torch.bfloat16, "cuda")
    check_finalize(T, CFG.hc_mult, 4096, torch.bfloat16, "cuda")
