"""Error bounds for results that two programs compute in different orders.

The Triton interpreter evaluates a kernel's float32 sums through numpy, whose summation order and
vector width depend on the CPU, and the GPU sums in yet another order: a kernel and its PyTorch
reference agree only up to rounding. Every bound here follows from the arithmetic, never from
what one machine printed:

- a sum of n terms in any order differs from the exact sum by at most ``gamma(n) * sum |terms|``
  (Higham, *Accuracy and Stability of Numerical Algorithms*, section 3.1), with
  ``gamma(n) = n u / (1 - n u)`` and u the unit roundoff: 2^-24 in float32, 2^-53 in float64;
- a correctly rounded operation (product, quotient, sqrt, numpy's exp within 1 ulp) moves its
  result by at most u (2u for exp) relative;
- two values that differ by d, each rounded to a format, differ afterwards by at most d plus one
  step of that format at their magnitude (one of them may round the other way): a bf16 step is at
  most 2^-7 |x|, an e4m3 step is ``2^(floor(log2 |x / s|) - 3) s`` at scale s (2^-9 s subnormal).

Bit-exact comparisons stay where the operations are order-free: byte layouts, quantiser codes
of given values, pool bytes that no row write touches.
"""

from __future__ import annotations

import math

import torch

U32 = 2.0 ** -24
U64 = 2.0 ** -53
BF16_STEP = 2.0 ** -7   # one bf16 step, relative to the value (7 stored mantissa bits)
BF16_HALF = 2.0 ** -8   # bf16 unit roundoff


def gamma(n: int, u: float = U32) -> float:
    """``n u / (1 - n u)``: the relative bound of an n-term sum or dot product."""
    return n * u / (1 - n * u)


def assert_within(got: torch.Tensor, want: torch.Tensor, bound, what: str) -> None:
    """``|got - want| <= bound`` elementwise (bound broadcasts); non-finite values must match.

    On failure: how many elements are off and the worst one, with its bound."""
    got, want = got.double().cpu(), want.double().cpu()
    bound = torch.as_tensor(bound, dtype=torch.float64).cpu().expand_as(want)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)), (
        f"{what}: non-finite at {(fin != torch.isfinite(got)).nonzero()[:5].tolist()}")
    assert torch.equal(got[~fin], want[~fin]), f"{what}: infinities differ"
    err = (got - want).abs().masked_fill(~fin, 0.0)
    ratio = err / bound.clamp_min(1e-300)
    bad = err > bound
    if bad.any():
        i = int(ratio.argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} elements off; worst at {i}: "
            f"{got.flatten()[i].item()!r} vs {want.flatten()[i].item()!r}, "
            f"|diff| {err.flatten()[i].item():.3e} > bound {bound.flatten()[i].item():.3e}")


def e4m3_step(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One e4m3 step at |x| (a dequantised value) and the power-of-two ``scale`` it was stored at."""
    m = (x.double().abs() / scale).clamp_min(2.0 ** -6)          # below 2^-6: subnormal, step 2^-9
    return torch.exp2(torch.floor(torch.log2(m)) - 3) * scale


def softmax_pool_abs(c: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``sum_j softmax_j(z) |c_j|`` over dim 1 (float64): the magnitude a pooled sum's error is
    relative to. c, z: [E, K, d], z = -inf for masked candidates."""
    return (torch.softmax(z.double(), dim=1) * c.double().abs()).sum(1)


def softmax_pool_bound(c: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Bound on a float32 softmax pooling ``sum_j softmax_j(z) c_j`` computed in any order, any
    online rescaling: each weight carries the exp and the max subtraction (3u), the K-term
    denominator and numerator gamma(K) each, one rescale per candidate (2u), the division (u)."""
    k = c.shape[1]
    return (2 * gamma(k) + (2 * k + 6) * U32) * softmax_pool_abs(c, z)


def attention_bound(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                    scale: float, bf16_p: bool = False, bf16_out: bool = False):
    """Bounds on FlashMLA-style decode attention (one softmax over keys + sink) computed in
    float32 in any order, against the exact (float64) result. Returns (out bound [b, h, 512],
    lse bound [b, h]).

    q [b, h, 512] and keys [b, n, 512] hold the exact operand values (keys dequantised); valid
    [b, n]. A score carries gamma(512) of its products' magnitudes plus the scale product; a
    weight exp(s - m) carries its score's error (and the max's), exp2's argument product and the
    exp itself; the output sums n weights twice (numerator, denominator) and divides. Split-K
    merges rescale a few more times (counted as n extra roundings: one per key is generous).
    ``bf16_p``: the weights are rounded to bf16 before the value product (the GPU's tensor-core
    path); ``bf16_out``: the output is stored in bf16.
    """
    q, keys = q.double().cpu(), keys.double().cpu()
    valid = valid.cpu()
    n = keys.shape[1]
    s = torch.einsum("bhd,bnd->bhn", q, keys) * scale
    s_abs = torch.einsum("bhd,bnd->bhn", q.abs(), keys.abs()) * scale
    ds = gamma(512) * s_abs + 2 * U32 * s.abs()
    ds = ds.masked_fill(~valid[:, None, :], 0.0)
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = torch.maximum(s.amax(-1), sink.double().cpu()[None, :])
    eps_p = 2 * ds.amax(-1) + 4 * U32 * (1 + m.abs().clamp(max=1e30))           # [b, h]
    p = torch.exp(s - m[..., None])
    z = p.sum(-1) + torch.exp(sink.double().cpu()[None, :] - m)
    a = torch.einsum("bhn,bnd->bhd", p, keys.abs()) / z[..., None]            # sum p |v| / Z
    o = (torch.einsum("bhn,bnd->bhd", p, keys) / z[..., None]).abs()
    rel = eps_p[..., None] + 2 * gamma(n) + (n + 4) * U32
    out = rel * (a + o)
    if bf16_p:
        out = out + BF16_HALF * a
    if bf16_out:
        out = out + BF16_STEP * (o + out)
    lse_sum = p.masked_fill(~valid[:, None, :], 0.0).sum(-1)
    lse = eps_p + gamma(n) + (n + 4) * U32 + U32 * (m.abs() + lse_sum.clamp_min(1e-300).log().abs())
    return out, lse


def _page_row_bytes(pool: torch.Tensor, slots: torch.Tensor, row_bytes: int, head_bytes: int):
    """Byte masks of rows ``slots`` in a pool of pages laid out [all heads | all tails]."""
    page_rows = pool.shape[1] // row_bytes
    mask = torch.zeros(pool.shape, dtype=torch.bool)
    for s in slots.tolist():
        page, r = divmod(int(s), page_rows)
        mask[page, r * head_bytes:(r + 1) * head_bytes] = True
        tail = page_rows * head_bytes + r * (row_bytes - head_bytes)
        mask[page, tail:tail + row_bytes - head_bytes] = True
    return mask


def _checked_tails(pool, ref_pool, slots, row_bytes: int, head_bytes: int, what: str):
    """Checks every byte outside the rows at ``slots`` is untouched; returns each row's tail
    bytes (the scale group after the page's heads) of both pools, uint8 [n, tail]."""
    _assert_untouched_bytes(pool, ref_pool, _page_row_bytes(pool, slots, row_bytes, head_bytes), what)
    page_rows = pool.shape[1] // row_bytes
    page, r = slots // page_rows, slots % page_rows
    tail_bytes = row_bytes - head_bytes
    cols = page_rows * head_bytes + r[:, None] * tail_bytes + torch.arange(tail_bytes)
    return pool.cpu()[page[:, None], cols], ref_pool.cpu()[page[:, None], cols]


def _assert_untouched_bytes(pool, ref_pool, mask, what):
    pool, ref_pool = pool.cpu(), ref_pool.cpu()
    diff = ((pool != ref_pool) & ~mask).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} bytes outside the written rows differ, first {diff[:5].tolist()}"


def assert_kv_pools_close(pool, ref_pool, slots, pre_bound, what: str) -> None:
    """Two pools of 584-byte rows after writing the same rows at ``slots``, each computed in its
    own float32 order. Bytes outside the rows: identical. Each stored row: the 7 scale exponents
    within one of each other (a tile's amax may cross a power of two), the 448 e4m3 values
    within ``pre_bound`` (the bound on the pre-rounding values' difference) plus one e4m3 step at
    the larger scale, the 64 bf16 rope dims within ``pre_bound`` plus one bf16 step. The pad
    byte: identical. ``pre_bound``: [n, 512] or broadcastable."""
    from memory.layout import read_kv_rows

    slots = slots[slots >= 0].long().cpu()
    if slots.numel() == 0:
        return
    ga, gb = (t.long() for t in _checked_tails(pool, ref_pool, slots, 584, 576, what))
    assert torch.equal(ga[:, 7], gb[:, 7]), f"{what}: pad bytes differ"
    assert (ga[:, :7] - gb[:, :7]).abs().max() <= 1, f"{what}: scale exponents differ by more than one"
    got, want = read_kv_rows(pool.cpu(), slots).double(), read_kv_rows(ref_pool.cpu(), slots).double()
    scale = torch.exp2(torch.maximum(ga[:, :7], gb[:, :7]).double() - 127).repeat_interleave(64, 1)
    mag = torch.maximum(got.abs(), want.abs())
    pre = torch.as_tensor(pre_bound, dtype=torch.float64).cpu().expand(got.shape[0], 512)
    bound = torch.cat([pre[:, :448] + e4m3_step(mag[:, :448], scale),
                       pre[:, 448:] + BF16_STEP * mag[:, 448:]], 1)
    assert_within(got, want, bound, what)


def assert_indexer_pools_close(pool, ref_pool, slots, pre_bound, what: str) -> None:
    """As :func:`assert_kv_pools_close` for 132-byte indexer rows (128 e4m3 values + one fp32
    power-of-two scale): scales within a factor of two, values within ``pre_bound`` plus one
    e4m3 step at the larger scale."""
    from memory.layout import read_indexer_rows

    slots = slots[slots >= 0].long().cpu()
    if slots.numel() == 0:
        return
    sa, sb = (t.contiguous().view(torch.float32).double() for t in _checked_tails(pool, ref_pool, slots, 132, 128, what))
    assert ((sa / sb).log2().abs() <= 1).all(), f"{what}: row scales differ by more than a factor of two"
    got, want = read_indexer_rows(pool.cpu(), slots).double(), read_indexer_rows(ref_pool.cpu(), slots).double()
    mag = torch.maximum(got.abs(), want.abs())
    pre = torch.as_tensor(pre_bound, dtype=torch.float64).cpu().expand(got.shape[0], 128)
    assert_within(got, want, pre + e4m3_step(mag, torch.maximum(sa, sb)), what)


def norm_rope_bound(x: torch.Tensor, dx: torch.Tensor, weight: torch.Tensor, d_rope: int = 64,
                    bf16_in: bool = False, bf16_mid: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """Bound on ``rope(bf16?(rmsnorm(bf16?(x))))`` computed in float32 in any order, where the
    inputs of two computations differ by at most ``dx`` (elementwise, abs). Rows x [n, d].

    The rms of a row carries gamma(d) of the sum of squares plus the input differences
    (sum 2|x| dx / sum x^2, halved by the square root) and the rsqrt (2u); the normalised value its
    own input difference; each optional bf16 rounding adds one step; RoPE mixes each rope pair
    (|cos| + |sin| <= sqrt 2) with three roundings. The rsqrt is given 8u: the GPU's approximate
    rsqrt is within about 5u. Returns the bound on the rotated values, before the caller's
    storage rounding."""
    x, dx, w = x.double().cpu(), torch.as_tensor(dx, dtype=torch.float64).cpu().expand(x.shape), weight.double().cpu()
    if bf16_in:
        dx = dx + BF16_STEP * x.abs()
    d = x.shape[-1]
    ms = x.square().mean(-1, keepdim=True)
    rel_rms = (gamma(d) + ((2 * x.abs() + dx) * dx).sum(-1, keepdim=True) / (d * ms + eps)) / 2 + 8 * U32
    inv = torch.rsqrt(ms + eps)
    y = x * inv * w
    dy = (dx + x.abs() * rel_rms) * inv * w.abs() + 2 * U32 * y.abs()
    if bf16_mid:
        dy = dy + BF16_STEP * y.abs()
    pair = dy[:, -d_rope:].unflatten(-1, (d_rope // 2, 2))
    ypair = y[:, -d_rope:].unflatten(-1, (d_rope // 2, 2)).abs()
    rot = math.sqrt(2) * pair.amax(-1, keepdim=True) + 3 * U32 * ypair.sum(-1, keepdim=True)
    return torch.cat([dy[:, :-d_rope], rot.expand_as(pair).flatten(-2)], -1)


def compressed_row_bound(pooled: torch.Tensor, d_pooled, weight: torch.Tensor, indexer: bool,
                         round_bf16: bool = True) -> torch.Tensor:
    """Bound on a compressed row before its storage rounding: the pooled values (differing by at
    most ``d_pooled``) go through (bf16), RMSNorm, (bf16), RoPE, and for the indexer (bf16), the
    orthonormal 128-point Hadamard (an output moves by at most the input differences' sum over
    sqrt(128), plus gamma(128) of its terms), (bf16)."""
    b = norm_rope_bound(pooled, d_pooled, weight, bf16_in=round_bf16, bf16_mid=round_bf16)
    if not indexer:
        return b
    x = pooled.double().cpu()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * weight.double().cpu()
    if round_bf16:
        b = b + BF16_STEP * y.abs()
    n = y.shape[-1]
    mass = math.sqrt(2) * y.abs().sum(-1, keepdim=True)     # >= sum |rope(y)|: a pair rotates by |cos| + |sin| <= sqrt 2
    h = (b.sum(-1, keepdim=True) + gamma(n) * mass) / math.sqrt(n)
    if round_bf16:
        h = h + BF16_STEP * (mass / math.sqrt(n) + h)
    return h.expand_as(y)


def indexer_score_bound(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Bound on ``sum_h w_h relu(q_h . k)`` in float32, any order: gamma(d) of each dot product's
    magnitudes (relu only shrinks an error), times |w_h|, plus gamma(H) of the head sum's terms
    and the final rounding. q [b, H, d], w [b, H], keys [b, L, d] (exact values)."""
    q, w, keys = q.double().cpu(), w.double().cpu(), keys.double().cpu()
    dots = torch.einsum("bhd,bld->bhl", q, keys)
    dots_abs = torch.einsum("bhd,bld->bhl", q.abs(), keys.abs())
    terms = (w.abs()[:, :, None] * dots.clamp_min(0)).sum(1)
    err = (w.abs()[:, :, None] * (gamma(q.shape[-1]) * dots_abs + U32 * dots.abs())).sum(1)
    return err * (1 + gamma(q.shape[1])) + (gamma(q.shape[1]) + U32) * terms


def compress_bounds(state, sources, ape, w, ratio, d, indexer, round_bf16=True):
    """Bound on each compression event's row before storage (the pooling of
    ``reference.compress_candidates_ref`` in float32, then :func:`compressed_row_bound`)."""
    from dsv4_backend.kernels import reference as R
    c, z = R.compress_candidates_ref(state.cpu(), sources.cpu(), ape.cpu(), ratio, d)
    pooled = (torch.softmax(z.double(), dim=1) * c.double()).sum(1)
    return compressed_row_bound(pooled, softmax_pool_bound(c, z), w, indexer, round_bf16)
