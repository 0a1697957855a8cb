"""Full-sequence reference forward of DeepSeek-V4: the project's oracle.

One sequence, prefill from position 0, dense masks over the whole sequence, every piece of
DSV4.md section 2 written out plainly. It shares no code with the paged engine
(``dsv4_backend/model.py``, ``memory/``) on purpose: the two are independent implementations
of the same maths, and tests compare them.

Precision. In float64 and float32 every intermediate stays in the compute dtype (the shared
numerical conventions). bfloat16 follows the release's precision notes (DSV4.md section 4):
activations and residual streams in bf16, while norms, mHC maths, RoPE, the compressor pool,
the gate, SwiGLU, the attention softmax and the logits run in float32. Whatever the dtype,
RoPE angles are float32 products ``t * inv_freq`` and the FP8 / FP4 roundings are simulated
exactly (dequantised values equal what a real FP8 cache returns).

``act_quant=True`` also rounds the input of every FP8/FP4-weight matmul as the release does
(DSV4.md section 4): wq_a, wkv, wq_b, indexer.wq_b, wo_b, every expert's w1/w3 (their input) and
w2 (the SwiGLU output after the routing weight), routed and shared, mtp e_proj / h_proj; to e4m3
per 1 x 128 block along K with a power-of-two scale (amax floored at 1e-4). Not wo_a, the
compressors, weights_proj, the gate or the head. Every e4m3 rounding here (KV rows, indexer
rows, activations) goes through float32, as torch's float64 -> e4m3 cast does: one rule.

Public entry points: ``reference_forward`` (logits, optionally the hidden streams) and
``reference_mtp_forward`` (the MTP module's logits). The building blocks below are module-level
functions so tests can check each one against a direct formula.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

from .config import DSV4Config
from .weights import WeightKind, param_dtype, weight_specs

FP8_MAX = 448.0           # largest e4m3 value
FP4_MAX = 6.0             # largest e2m1 value
KV_TILE = 64              # nope dims per FP8 scale in the attention row
AMAX_FLOOR = 1e-4         # the release's floor on a tile's amax before computing its scale
INDEXER_QUANT_MODES = ("fp8", "fp4")


class ReferenceOutput(NamedTuple):
    logits: torch.Tensor   # [T, vocab]
    hidden: torch.Tensor   # [T, hc, D]: residual streams after the last layer, before hc_head


class HCMix(NamedTuple):
    """The per-token mHC mixing parameters of one sub-layer."""
    pre: torch.Tensor      # [T, hc]      weights that collapse the streams into the sub-layer input
    post: torch.Tensor     # [T, hc]      weights of the sub-layer output added to each stream
    comb: torch.Tensor     # [T, hc, hc]  comb[t, j, k]: stream j -> stream k (near doubly stochastic)


class TopK(NamedTuple):
    """Selected compressed rows per query, best first (ties toward the lower row index)."""
    indices: torch.Tensor  # [T, k] int64, k = min(index_topk, rows)
    valid: torch.Tensor    # [T, k] bool: False where the query sees fewer than k rows


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the float32 'islands': the dtype itself for float32/float64, float32 for bf16."""
    return torch.promote_types(dtype, torch.float32)


# ---- norms, RoPE --------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, last dim) + eps) * weight``, computed in at least float32.

    ``weight=None`` gives the weightless normalisation used on each query head.
    Returns ``x``'s dtype.
    """
    a = x.to(_acc(x.dtype))
    y = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


def rope_inv_freq(cfg: DSV4Config, compressed: bool) -> torch.Tensor:
    """The 32 inverse frequencies of a layer, float32 ``[32]``.

    Window-only layers (``compressed=False``): ``rope_theta ** (-2i/64)``, no YaRN.
    Layers with ratio 4 or 128 (``compressed=True``): ``compress_rope_theta`` with YaRN
    ``inv' = inv * (1 - ramp) + (inv / factor) * ramp`` (DSV4.md section 2), for the whole layer.
    """
    dim = cfg.qk_rope_head_dim
    theta = cfg.compress_rope_theta if compressed else cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if not compressed:
        return inv
    rs = cfg.rope_scaling

    def corr(n_rot: float) -> float:
        return dim * math.log(rs.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    lo = max(math.floor(corr(rs.beta_fast)), 0)
    hi = min(math.ceil(corr(rs.beta_slow)), dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    return inv * (1 - ramp) + (inv / rs.factor) * ramp


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
               inverse: bool = False) -> torch.Tensor:
    """Interleaved RoPE on the LAST ``2 * len(inv_freq)`` dims of ``x``; the rest pass through.

    x: ``[T, ..., dim]`` with ``T == len(positions)``. Pair ``(2i, 2i+1)`` is rotated by the
    angle ``positions * inv_freq[i]``, a float32 product (as the release computes it), cast to
    the working dtype before cos/sin. ``inverse=True`` rotates by the negative angle.
    """
    r = 2 * inv_freq.numel()
    work = _acc(x.dtype)
    ang = (positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]).to(work)  # [T, 32]
    ang = ang.view(ang.shape[0], *([1] * (x.dim() - 2)), ang.shape[1])
    cos, sin = ang.cos(), ang.sin()
    if inverse:
        sin = -sin
    rot = x[..., -r:].to(work)
    x0, x1 = rot[..., 0::2], rot[..., 1::2]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-r], out.to(x.dtype)), dim=-1)


# ---- FP8 / FP4 roundings, Hadamard ---------------------------------------------------------


def _pow2_scale(amax: torch.Tensor, qmax: float, floor: float) -> torch.Tensor:
    """``2 ** ceil(log2(max(amax, floor) / qmax))``, exact (frexp, no floating-point log2)."""
    r = amax.clamp_min(floor) / qmax
    mant, exp = torch.frexp(r)                       # r = mant * 2**exp, mant in [0.5, 1)
    exp = torch.where(mant == 0.5, exp - 1, exp)     # r an exact power of two: log2 is exp - 1
    return torch.ldexp(torch.ones_like(r), exp)


def _e4m3_round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    q = (x / scale).to(torch.float32).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.to(x.dtype) * scale


def act_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """A quantised matmul's input rounded as the release does: e4m3 per 1 x 128 block along the
    last dim, scale ``2^ceil(log2(max(amax, 1e-4) / 448))``; same dtype and shape."""
    blocks = x.unflatten(-1, (-1, 128)).to(_acc(x.dtype))
    scale = _pow2_scale(blocks.abs().amax(-1, keepdim=True), FP8_MAX, AMAX_FLOOR)
    return _e4m3_round(blocks, scale).flatten(-2).to(x.dtype)


def _qmm(x: torch.Tensor, w: torch.Tensor, act_quant: bool) -> torch.Tensor:
    """``x @ w^T`` of an FP8/FP4-weight matmul, its input rounded when ``act_quant``."""
    return (act_fake_quant(x) if act_quant else x) @ w.T


def kv_fake_quant(kv: torch.Tensor) -> torch.Tensor:
    """Round attention rows exactly as the 584-byte FP8 cache stores them.

    kv: ``[..., 512]``. Nope dims [0:448] in 7 tiles of 64: scale = power of two
    ``2^ceil(log2(max(amax, 1e-4) / 448))`` per tile, values to e4m3 (nearest even, clamped to
    +-448), dequantised in kv's dtype. Rope dims [448:512] rounded to bf16.
    """
    nope_dim = kv.shape[-1] - 64
    nope = kv[..., :nope_dim].to(_acc(kv.dtype)).unflatten(-1, (nope_dim // KV_TILE, KV_TILE))
    scale = _pow2_scale(nope.abs().amax(-1, keepdim=True), FP8_MAX, AMAX_FLOOR)
    nope = _e4m3_round(nope, scale).flatten(-2).to(kv.dtype)   # exact: e4m3 * 2^k fits bf16
    rope = kv[..., nope_dim:].to(torch.bfloat16).to(kv.dtype)
    return torch.cat((nope, rope), dim=-1)


def _e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Round to the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (signed), nearest, ties to even code."""
    a = v.abs().clamp(max=FP4_MAX)
    # (upper bound of the interval, whether the bound itself rounds down, value)
    steps = ((0.25, True, 0.0), (0.75, False, 0.5), (1.25, True, 1.0), (1.75, False, 1.5),
             (2.5, True, 2.0), (3.5, False, 3.0), (5.0, True, 4.0))
    out = torch.full_like(a, FP4_MAX)
    for bound, inclusive, value in reversed(steps):
        below = a <= bound if inclusive else a < bound
        out = torch.where(below, torch.full_like(a, value), out)
    return out * v.sign()


def indexer_fake_quant(x: torch.Tensor, mode: str = "fp8") -> torch.Tensor:
    """Round indexer vectors (K rows and q heads, after the Hadamard) as the indexer stores them.

    x: ``[..., 128]``. ``"fp8"`` (default, the 132-byte row): one power-of-two scale per 128
    values by the KV rule (amax floored at 1e-4, /448), values to e4m3. ``"fp4"`` (the release's
    training-time simulation): blocks of 32, scale ``2^ceil(log2(amax/6))`` with amax floored
    at ``6 * 2^-126``, values rounded to e2m1 (nearest even, clamped to +-6).
    """
    a = x.to(_acc(x.dtype))
    if mode == "fp8":
        scale = _pow2_scale(a.abs().amax(-1, keepdim=True), FP8_MAX, AMAX_FLOOR)
        return _e4m3_round(a, scale).to(x.dtype)
    if mode == "fp4":
        blocks = a.unflatten(-1, (a.shape[-1] // 32, 32))
        scale = _pow2_scale(blocks.abs().amax(-1, keepdim=True), FP4_MAX, FP4_MAX * 2.0 ** -126)
        return (_e2m1_round(blocks / scale) * scale).flatten(-2).to(x.dtype)
    raise ValueError(f"indexer_quant must be one of {INDEXER_QUANT_MODES}, got {mode!r}")


def hadamard_128(x: torch.Tensor) -> torch.Tensor:
    """The 128-point Sylvester Hadamard rotation (natural order, scaled 128^-0.5) on the last dim."""
    h = torch.ones(1, 1, dtype=x.dtype)
    while h.shape[0] < 128:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return x @ (h * 128 ** -0.5)   # symmetric, so x @ H == (H x^T)^T


# ---- compressor, indexer -------------------------------------------------------------------


def compress(cfg: DSV4Config, C: torch.Tensor, Z: torch.Tensor, ape: torch.Tensor, ratio: int) -> torch.Tensor:
    """Per-channel softmax pooling of a whole sequence's projections into ``T // ratio`` rows.

    C, Z: ``[T, coff*d]`` content and score projections (``Z`` without ``ape``); ape:
    ``[ratio, coff*d]``. Returns ``[T // ratio, d]`` before norm / RoPE; the incomplete tail
    block has no row. ratio 128 (coff 1): row i pools block i's 128 tokens. ratio 4 (coff 2,
    overlap): row i pools the a-halves (channels [d:2d]) of block i and the b-halves
    (channels [0:d]) of block i-1, each score plus its own ``ape`` half, one softmax per channel
    over the 8 candidates; for row 0 the b-candidates are C = 0, Z = -inf. ``d`` is read from
    the shapes (512 for attention, 128 for the indexer); ``cfg`` is taken for a uniform API.
    """
    if ratio not in (4, 128):
        raise ValueError(f"compress: ratio must be 4 or 128, got {ratio}")
    m, n = ratio, C.shape[0] // ratio
    c = C[: n * m].unflatten(0, (n, m))                 # [n, m, coff*d]
    z = Z[: n * m].unflatten(0, (n, m)) + ape.to(Z.dtype)
    if ratio == 4:
        d = C.shape[-1] // 2
        ca, za = c[..., d:], z[..., d:]
        cb = torch.cat((torch.zeros_like(c[:1, :, :d]), c[:-1, :, :d]), 0)
        zb = torch.cat((torch.full_like(z[:1, :, :d], -math.inf), z[:-1, :, :d]), 0)
        c, z = torch.cat((ca, cb), 1), torch.cat((za, zb), 1)   # [n, 2m, d]
    return (torch.softmax(z, dim=1) * c).sum(1)


def visible_rows(num_tokens: int, num_rows: int, ratio: int) -> torch.Tensor:
    """``[T, rows]`` bool: row i is visible to position p iff ``(i + 1) * ratio - 1 <= p``."""
    p = torch.arange(num_tokens)[:, None]
    i = torch.arange(num_rows)[None, :]
    return (i + 1) * ratio - 1 <= p


def window_mask(num_tokens: int, window: int) -> torch.Tensor:
    """``[T, T]`` bool: key s is in query p's window iff ``p - window < s <= p``."""
    d = torch.arange(num_tokens)[:, None] - torch.arange(num_tokens)[None, :]
    return (d >= 0) & (d < window)


def indexer_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])``, no other scale, no masking.

    q: ``[T, Hi, 128]``, w: ``[T, Hi]``, k: ``[S, 128]`` -> ``[T, S]``.
    """
    return (torch.relu(torch.einsum("thd,sd->ths", q, k)) * w[:, :, None]).sum(1)


def topk_indices(scores: torch.Tensor, visible: torch.Tensor, k: int) -> TopK:
    """Keep ``min(k, visible rows)`` rows per query by score, ties toward the lower row index.

    scores, visible: ``[T, S]``. A stable descending sort keeps equal scores in row order;
    invisible rows sort last (score -inf) and are marked invalid.
    """
    k = min(k, scores.shape[1])
    masked = scores.masked_fill(~visible, -math.inf)
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]
    rank = torch.arange(k)[None, :]
    return TopK(order, rank < visible.sum(-1, keepdim=True))


def topk_mask(topk: TopK, num_rows: int) -> torch.Tensor:
    """``[T, rows]`` bool mask of the valid selected rows."""
    mask = torch.zeros(topk.indices.shape[0], num_rows, dtype=torch.bool)
    return mask.scatter_(1, topk.indices, topk.valid) if num_rows else mask


# ---- attention -----------------------------------------------------------------------------


def sink_attention(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """MQA attention with one softmax over the allowed keys plus a per-head sink.

    q: ``[T, H, d]``, kv: ``[S, d]`` (each row is both key and value), mask: ``[T, S]`` bool,
    sink: ``[H]``. Weights are ``exp(scale * q.k) / (sum_allowed exp(scale * q.k) + exp(sink_h))``;
    the sink is not scaled and carries no value, so the weights sum to less than 1.
    Returns ``[T, H, d]``. Every query must see at least one key.
    """
    work = _acc(q.dtype)
    s = torch.einsum("thd,sd->hts", q.to(work), kv.to(work)) * scale         # [H, T, S]
    s = s.masked_fill(~mask[None], -math.inf)
    sink_col = sink.to(work)[:, None, None].expand(-1, s.shape[1], 1)
    p = torch.softmax(torch.cat((s, sink_col), -1), dim=-1)[..., :-1]
    return torch.einsum("hts,sd->thd", p, kv.to(work)).to(q.dtype)


def grouped_output_projection(o: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor | None,
                              groups: int) -> torch.Tensor:
    """Grouped low-rank output projection.

    o: ``[T, H, 512]``; wo_a: ``[G*R, H*512/G]`` (rows g*R..(g+1)*R-1 are group g's); wo_b:
    ``[D, G*R]``. Group g maps its heads' concatenated outputs to R dims with its own block of
    wo_a (no mixing between groups); the G results, concatenated group-major, go through wo_b
    (``wo_b=None``: the ``[T, G*R]`` input of wo_b).
    """
    T = o.shape[0]
    og = o.reshape(T, groups, -1)                             # [T, G, H/G*512]
    wa = wo_a.view(groups, -1, og.shape[-1])                   # [G, R, H/G*512]
    z = torch.einsum("tgk,grk->tgr", og, wa).flatten(1)
    return z if wo_b is None else z @ wo_b.T


def _attention(cfg: DSV4Config, w: dict, p: str, ratio: int, x: torch.Tensor, pos: torch.Tensor,
               indexer_quant: str, aq: bool = False) -> torch.Tensor:
    """One attention sub-layer over a whole sequence. x: ``[T, D]`` -> ``[T, D]``."""
    T, H, hd, eps = x.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    a = p + "attn."
    inv = rope_inv_freq(cfg, compressed=ratio != 0)

    qr = rms_norm(_qmm(x, w[a + "wq_a.weight"], aq), w[a + "q_norm.weight"], eps)  # [T, q_lora]
    q = _qmm(qr, w[a + "wq_b.weight"], aq).view(T, H, hd)
    q = apply_rope(rms_norm(q, None, eps), pos, inv)                              # [T, H, 512]

    kv = rms_norm(_qmm(x, w[a + "wkv.weight"], aq), w[a + "kv_norm.weight"], eps)  # [T, 512]
    kv = kv_fake_quant(apply_rope(kv, pos, inv))

    keys, mask = kv, window_mask(T, cfg.sliding_window)
    if ratio:
        rows = _compressed_rows(cfg, w, a + "compressor.", ratio, x, inv)          # [n, 512]
        rows = kv_fake_quant(rows)
        seen = visible_rows(T, rows.shape[0], ratio)
        if ratio == 4:
            seen = _indexer_select(cfg, w, a + "indexer.", x, qr, pos, inv, seen, indexer_quant, aq)
        keys, mask = torch.cat((kv, rows)), torch.cat((mask, seen), 1)

    o = sink_attention(q, keys, mask, w[a + "attn_sink"], cfg.softmax_scale)     # [T, H, 512]
    o = apply_rope(o, pos, inv, inverse=True)
    if not aq:
        return grouped_output_projection(o, w[a + "wo_a.weight"], w[a + "wo_b.weight"], cfg.o_groups)
    z = grouped_output_projection(o, w[a + "wo_a.weight"], None, cfg.o_groups)
    return _qmm(z, w[a + "wo_b.weight"], aq)


def _compressed_rows(cfg: DSV4Config, w: dict, c: str, ratio: int, x: torch.Tensor,
                     inv: torch.Tensor) -> torch.Tensor:
    """Compressor projections (in float32 or wider) -> pooled rows -> norm -> RoPE at i*m."""
    work = _acc(x.dtype)
    xs = x.to(work)
    C = xs @ w[c + "wkv.weight"].to(work).T
    Z = xs @ w[c + "wgate.weight"].to(work).T
    rows = compress(cfg, C, Z, w[c + "ape"], ratio).to(x.dtype)
    rows = rms_norm(rows, w[c + "norm.weight"], cfg.rms_norm_eps)
    return apply_rope(rows, torch.arange(rows.shape[0]) * ratio, inv)


def _indexer_select(cfg: DSV4Config, w: dict, ix: str, x: torch.Tensor, qr: torch.Tensor,
                    pos: torch.Tensor, inv: torch.Tensor, visible: torch.Tensor, mode: str,
                    aq: bool = False) -> torch.Tensor:
    """The CSA indexer: ``[T, n]`` mask of the top-k visible compressed rows per query."""
    T, Hi, di = x.shape[0], cfg.index_n_heads, cfg.index_head_dim
    k = indexer_fake_quant(hadamard_128(_compressed_rows(cfg, w, ix + "compressor.", 4, x, inv)), mode)
    q = _qmm(qr, w[ix + "wq_b.weight"], aq).view(T, Hi, di)
    q = indexer_fake_quant(hadamard_128(apply_rope(q, pos, inv)), mode)         # [T, Hi, 128]
    hw = (x @ w[ix + "weights_proj.weight"].T) * (di ** -0.5 * Hi ** -0.5)     # [T, Hi]
    work = _acc(x.dtype)
    scores = indexer_scores(q.to(work), hw.to(work), k.to(work))               # [T, n]
    return topk_mask(topk_indices(scores, visible, cfg.index_topk), k.shape[0])


# ---- mHC -----------------------------------------------------------------------------------


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Near doubly stochastic matrix from ``[..., hc, hc]`` logits (DSV4.md section 2).

    softmax over the last dim (+eps), one column normalisation, then ``iters - 1`` rounds of
    row then column normalisation; every divisor carries ``+ eps``.
    """
    c = torch.softmax(logits, dim=-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def _hc_logits(X: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    xf = X.flatten(1).to(_acc(X.dtype))                                       # [T, hc*D], stream-major
    return (xf @ fn.to(xf.dtype).T) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def mhc_mix_params(cfg: DSV4Config, X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                   scale: torch.Tensor) -> HCMix:
    """mHC mixing parameters of one sub-layer from the streams X ``[T, hc, D]``.

    fn ``[hc*(2+hc), hc*D]``, base ``[hc*(2+hc)]``, scale ``[3]``. Computed in at least float32.
    """
    hc, eps = cfg.hc_mult, cfg.hc_eps
    m = _hc_logits(X, fn, cfg.rms_norm_eps)                                   # [T, hc*(2+hc)]
    base, scale = base.to(m.dtype), scale.to(m.dtype)
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc)
    return HCMix(pre, post, sinkhorn(comb, cfg.hc_sinkhorn_iters, eps))


def _hc_sublayer(cfg: DSV4Config, w: dict, p: str, sub: str, norm: str, X: torch.Tensor, f) -> torch.Tensor:
    """``X'_k = post_k * f(RMSNorm(sum_j pre_j X_j)) + sum_j comb[j, k] X_j``; X: ``[T, hc, D]``."""
    mix = mhc_mix_params(cfg, X, w[f"{p}hc_{sub}_fn"], w[f"{p}hc_{sub}_base"], w[f"{p}hc_{sub}_scale"])
    Xa = X.to(mix.pre.dtype)
    y = rms_norm((mix.pre[:, :, None] * Xa).sum(1), w[p + norm], cfg.rms_norm_eps).to(X.dtype)
    out = f(y).to(Xa.dtype)                                                   # [T, D]
    mixed = mix.post[:, :, None] * out[:, None, :] + torch.einsum("tjk,tjd->tkd", mix.comb, Xa)
    return mixed.to(X.dtype)


# ---- MoE -----------------------------------------------------------------------------------


def _expert(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float,
            weight: torch.Tensor | None, aq: bool = False) -> torch.Tensor:
    """Clamped SwiGLU (float32 or wider), routing weight applied before w2."""
    work = _acc(x.dtype)
    g = _qmm(x, w1, aq).to(work)
    u = _qmm(x, w3, aq).to(work)
    h = F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)
    if weight is not None:
        h = h * weight[:, None].to(work)
    return _qmm(h.to(x.dtype), w2, aq)


def moe(cfg: DSV4Config, weights: dict, prefix: str, x: torch.Tensor,
        input_ids: torch.Tensor | None = None, act_quant: bool = False) -> torch.Tensor:
    """The MoE sub-layer of the block at ``prefix`` (e.g. ``"layers.0."``). x: ``[T, D]`` -> ``[T, D]``.

    Scores ``s = sqrt(softplus(x Wg^T))`` (float32 or wider). A block holding ``ffn.gate.tid2eid``
    (the first ``num_hash_layers`` layers) routes token t to the experts ``tid2eid[input_ids[t]]``;
    the others take the top ``num_experts_per_tok`` of ``s + gate.bias`` (bias for selection
    only). Routing weights are ``s`` at the chosen experts, normalised to sum 1, times
    ``routed_scaling_factor``. Plus one shared expert with weight 1.
    """
    f = prefix + "ffn."
    work = _acc(x.dtype)
    s = torch.sqrt(F.softplus(x.to(work) @ weights[f + "gate.weight"].to(work).T))   # [T, E]
    if f + "gate.tid2eid" in weights:
        if input_ids is None:
            raise ValueError(f"moe: {prefix} is hash-routed and needs input_ids")
        chosen = weights[f + "gate.tid2eid"][input_ids]                               # [T, k]
    else:
        bias = weights[f + "gate.bias"].to(work)
        chosen = torch.topk(s + bias, cfg.num_experts_per_tok, dim=-1).indices
    gw = s.gather(1, chosen)
    gw = gw / gw.sum(-1, keepdim=True) * cfg.routed_scaling_factor                    # [T, k]

    limit = cfg.swiglu_limit
    out = torch.zeros_like(x)
    for e in range(cfg.n_routed_experts):
        tok, slot = (chosen == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        ew = f"{f}experts.{e}."
        y = _expert(x[tok], weights[ew + "w1.weight"], weights[ew + "w3.weight"], weights[ew + "w2.weight"],
                    limit, gw[tok, slot], act_quant)
        out = out.index_add(0, tok, y)
    sh = f + "shared_experts."
    return out + _expert(x, weights[sh + "w1.weight"], weights[sh + "w3.weight"], weights[sh + "w2.weight"],
                         limit, None, act_quant)


# ---- blocks, heads, entry points -----------------------------------------------------------


def _block(cfg: DSV4Config, w: dict, p: str, ratio: int, X: torch.Tensor, ids: torch.Tensor,
           pos: torch.Tensor, indexer_quant: str, aq: bool = False) -> torch.Tensor:
    X = _hc_sublayer(cfg, w, p, "attn", "attn_norm.weight", X,
                     lambda y: _attention(cfg, w, p, ratio, y, pos, indexer_quant, aq))
    return _hc_sublayer(cfg, w, p, "ffn", "ffn_norm.weight", X, lambda y: moe(cfg, w, p, y, ids, aq))


def _lm_head(cfg: DSV4Config, w: dict, p: str, X: torch.Tensor) -> torch.Tensor:
    """hc_head (sigmoid weights, no Sinkhorn) -> norm -> head; logits in at least float32."""
    m = _hc_logits(X, w[p + "hc_head_fn"], cfg.rms_norm_eps)                  # [T, hc]
    pre = torch.sigmoid(m * w[p + "hc_head_scale"].to(m.dtype) + w[p + "hc_head_base"].to(m.dtype)) + cfg.hc_eps
    h = rms_norm((pre[:, :, None] * X.to(m.dtype)).sum(1), w[p + "norm.weight"], cfg.rms_norm_eps)
    return h @ w["head.weight"].to(m.dtype).T


def _prepare(weights: dict, dtype: torch.dtype, names: Sequence[tuple[str, WeightKind]]) -> dict:
    """The named tensors cast to the compute dtype (fp32 parameters stay fp32 in bf16 mode)."""
    if dtype not in (torch.float64, torch.float32, torch.bfloat16):
        raise ValueError(f"reference: dtype must be float64, float32 or bfloat16, got {dtype}")
    missing = [n for n, _ in names if n not in weights]
    if missing:
        raise KeyError(f"reference: weights dict lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    return {n: weights[n].to(param_dtype(n, kind, dtype)) for n, kind in names}


def _check_ids(cfg: DSV4Config, input_ids) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}")
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise ValueError(f"input_ids out of range [0, {cfg.vocab_size})")
    return ids


def reference_forward(cfg: DSV4Config, weights: dict, input_ids, *, dtype: torch.dtype = torch.float64,
                      indexer_quant: str = "fp8", return_hidden: bool = False, act_quant: bool = False):
    """Logits of the main model for one sequence starting at position 0.

    weights: names from ``weights.weight_specs`` (dequantised tensors, e.g. ``random_weights``);
    float tensors are cast to ``dtype`` (fp32 parameters stay fp32 in bf16 mode), int tables kept.
    input_ids: ``[T]``. indexer_quant: ``"fp8"`` (default) or ``"fp4"``. act_quant: round the
    inputs of the FP8/FP4 matmuls (see the module docstring), as a quantised checkpoint runs.
    Returns logits ``[T, vocab]`` in ``dtype`` (float32 in bf16 mode, as the release's head), or
    with ``return_hidden=True`` a ``ReferenceOutput(logits, hidden [T, hc, D])``.
    """
    if indexer_quant not in INDEXER_QUANT_MODES:
        raise ValueError(f"indexer_quant must be one of {INDEXER_QUANT_MODES}, got {indexer_quant!r}")
    ids = _check_ids(cfg, input_ids)
    names = [(s.name, s.kind) for s in weight_specs(cfg, include_mtp=False)]
    w = _prepare(weights, dtype, names)
    T, pos = ids.numel(), torch.arange(ids.numel())

    X = w["embed.weight"][ids][:, None, :].expand(T, cfg.hc_mult, cfg.hidden_size).clone()  # [T, hc, D]
    for i, ratio in enumerate(cfg.layer_ratios):
        X = _block(cfg, w, f"layers.{i}.", ratio, X, ids, pos, indexer_quant, act_quant)
    logits = _lm_head(cfg, w, "", X)
    if dtype != torch.bfloat16:
        logits = logits.to(dtype)
    return ReferenceOutput(logits, X) if return_hidden else logits


def reference_mtp_forward(cfg: DSV4Config, weights: dict, input_ids, hidden_streams: torch.Tensor, *,
                          dtype: torch.dtype = torch.float64, indexer_quant: str = "fp8",
                          act_quant: bool = False) -> torch.Tensor:
    """Logits of the MTP module ``mtp.0``: ``[T-1, vocab]``, position t predicting token t+2.

    hidden_streams: the main model's ``[T, hc, D]`` (``reference_forward(..., return_hidden=True)``).
    Position t combines ``e_proj(enorm(embed(token t+1)))``, added to every stream, with
    ``h_proj(hnorm(X_t))`` (hnorm per stream), then runs one block (window-only, bias routing) at
    positions 0..T-2, its own hc_head and norm, and the shared head.
    """
    if cfg.num_nextn_predict_layers < 1:
        raise ValueError("reference_mtp_forward: the config has no MTP layer")
    ids = _check_ids(cfg, input_ids)
    T = ids.numel()
    if T < 2:
        raise ValueError("reference_mtp_forward needs at least 2 tokens")
    if hidden_streams.shape != (T, cfg.hc_mult, cfg.hidden_size):
        raise ValueError(f"hidden_streams must be [{T}, {cfg.hc_mult}, {cfg.hidden_size}], "
                         f"got {tuple(hidden_streams.shape)}")
    p = "mtp.0."
    keep = ("embed.weight", "head.weight")
    names = [(s.name, s.kind) for s in weight_specs(cfg) if s.name.startswith(p) or s.name in keep]
    w = _prepare(weights, dtype, names)
    eps = cfg.rms_norm_eps

    e = _qmm(rms_norm(w["embed.weight"][ids[1:]], w[p + "enorm.weight"], eps), w[p + "e_proj.weight"],
             act_quant)                                                         # [T-1, D]
    h = _qmm(rms_norm(hidden_streams[:-1].to(dtype), w[p + "hnorm.weight"], eps), w[p + "h_proj.weight"],
             act_quant)
    X = h + e[:, None, :]                                                       # [T-1, hc, D]
    X = _block(cfg, w, p, cfg.mtp_ratios[0], X, ids[1:], torch.arange(T - 1), indexer_quant, act_quant)
    logits = _lm_head(cfg, w, p, X)
    return logits if dtype == torch.bfloat16 else logits.to(dtype)
