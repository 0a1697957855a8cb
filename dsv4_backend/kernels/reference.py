"""Plain-PyTorch references with each kernel's exact semantics (CPU or CUDA, any batch).

They read and write the pools through ``memory.layout`` (the one owner of the byte formats) and
round through ``memory.quant``, so a kernel that matches them matches the pools' contract. All
arithmetic is float32 unless a caller passes float64 inputs where noted; bf16 rounding points
follow the release (``round_bf16=True``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from memory.layout import read_indexer_rows, read_kv_rows, write_indexer_rows, write_kv_rows
from memory.quant import indexer_fake_quant, kv_fake_quant


class AttentionOutput(NamedTuple):
    out: torch.Tensor  # [b, h, 512]
    lse: torch.Tensor  # [b, h] fp32, log-sum-exp of the scaled scores (sink excluded); +inf if no key


class TopK(NamedTuple):
    rows: torch.Tensor  # int32 [b, k] physical C4 row ids, -1 padded
    scores: torch.Tensor  # fp32 [b, k], -inf where padded


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the last 64 dims of x [..., D], pairs (2i, 2i+1); cos, sin [..., 32]."""
    head, tail = x[..., :-64], x[..., -64:].unflatten(-1, (32, 2))
    e, o = tail[..., 0], tail[..., 1]
    rot = torch.stack([e * cos - o * sin, e * sin + o * cos], dim=-1).flatten(-2)
    return torch.cat([head, rot], dim=-1)


def hadamard_matrix(n: int = 128, dtype=torch.float32, device=None) -> torch.Tensor:
    """Sylvester (natural order) Hadamard matrix scaled by n**-0.5."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * n ** -0.5).to(dtype=dtype, device=device)


# ---- 1. KV store ---------------------------------------------------------------------------

def kv_rows_ref(kv, norm_weight, cos, sin, eps=1e-6, round_bf16=True) -> torch.Tensor:
    """Pre-quantisation rows fp32 [N, 512]: RMSNorm, (bf16), RoPE, rope dims to bf16."""
    x = rms_norm(kv, norm_weight, eps)
    if round_bf16:
        x = _bf16(x)
    x = rope_interleaved(x, cos.float(), sin.float())
    return torch.cat([x[:, :448], _bf16(x[:, 448:])], dim=-1)


def kv_store_ref(pool, slots, kv, norm_weight, cos, sin, eps=1e-6, round_bf16=True) -> torch.Tensor:
    """Writes the rows at ``slots`` (< 0 skipped); returns the dequantised rows fp32 [N, 512]."""
    rows = kv_rows_ref(kv, norm_weight, cos, sin, eps, round_bf16)
    keep = slots >= 0
    write_kv_rows(pool, slots[keep].long(), rows[keep])
    return kv_fake_quant(rows)


# ---- 2. compressor -------------------------------------------------------------------------

def compress_candidates_ref(state, sources, ape, ratio: int, d: int):
    """Each event's candidates -> (content c, score z), fp32 [E, K, d]: z has the ape row added
    and is -inf for a masked candidate (whose c is 0).

    state: [slots, 2 * coff * d] rows laid out [C | Z]; sources: int [E, K] (K = 2m for m = 4,
    m for m = 128), -1 = masked candidate; ape: fp32 [m, coff * d]. For m = 4, candidate j < 4 is
    the previous block's token j (channels [0:d] of C, Z and ape), j >= 4 this block's token
    j - 4 (channels [d:2d]).
    """
    coff = 2 if ratio == 4 else 1
    e, k = sources.shape
    j = torch.arange(k, device=sources.device)
    half = (j >= ratio).long() if coff == 2 else torch.zeros_like(j)
    ch = half[:, None] * d + torch.arange(d, device=sources.device)[None, :]  # [K, d]
    rows = state[sources.clamp_min(0).long()].float()  # [E, K, 2*coff*d]
    c = torch.gather(rows, 2, ch.expand(e, k, d))
    z = torch.gather(rows, 2, (ch + coff * d).expand(e, k, d))
    z = z + ape.float()[j % ratio][torch.arange(k, device=ape.device)[:, None], ch]
    z = z.masked_fill((sources < 0)[..., None], float("-inf"))
    c = c.masked_fill((sources < 0)[..., None], 0.0)
    return c, z


def compress_pool_ref(state, sources, ape, ratio: int, d: int) -> torch.Tensor:
    """Softmax pooling of each event's candidates (:func:`compress_candidates_ref`) -> fp32 [E, d]."""
    c, z = compress_candidates_ref(state, sources, ape, ratio, d)
    return (torch.softmax(z, dim=1) * c).sum(1)


def compress_rows_ref(pooled, norm_weight, cos, sin, eps=1e-6, round_bf16=True,
                      indexer=False) -> torch.Tensor:
    """pooled fp32 [E, d] -> pre-quantisation rows: (bf16), RMSNorm, (bf16), RoPE, (Hadamard)."""
    x = _bf16(pooled) if round_bf16 else pooled
    x = rms_norm(x, norm_weight, eps)
    if round_bf16:
        x = _bf16(x)
    x = rope_interleaved(x, cos.float(), sin.float())
    if indexer:
        if round_bf16:
            x = _bf16(x)
        x = x @ hadamard_matrix(x.shape[-1], device=x.device)
        return _bf16(x) if round_bf16 else x
    return torch.cat([x[:, :-64], _bf16(x[:, -64:])], dim=-1)


def compress_ref(pool, dest_rows, state, sources, ape, norm_weight, cos, sin, ratio: int,
                 eps=1e-6, round_bf16=True, indexer=False) -> torch.Tensor:
    """Pools, normalises, rotates and writes each event's row; returns the dequantised rows."""
    d = 128 if indexer else 512
    rows = compress_rows_ref(compress_pool_ref(state, sources, ape, ratio, d), norm_weight,
                             cos, sin, eps, round_bf16, indexer)
    if indexer:
        write_indexer_rows(pool, dest_rows.long(), rows)
        return indexer_fake_quant(rows)
    write_kv_rows(pool, dest_rows.long(), rows)
    return kv_fake_quant(rows)


def online_c128_ref(cz: torch.Tensor, positions: torch.Tensor, ape: torch.Tensor):
    """Running (max, sum, acc) after the tokens of one request, fp32 [3, d] (d = cz.shape[1]//2).

    The state restarts at every block start (position % 128 == 0); acc is unnormalised
    (pooled = acc / sum).
    """
    d = cz.shape[1] // 2
    m = torch.full((d,), float("-inf"))
    s = torch.zeros(d)
    acc = torch.zeros(d)
    for t in range(cz.shape[0]):
        p = int(positions[t])
        if p % 128 == 0:
            m, s, acc = torch.full((d,), float("-inf")), torch.zeros(d), torch.zeros(d)
        c = cz[t, :d].float().cpu()
        z = cz[t, d:].float().cpu() + ape[p % 128].float().cpu()
        m_new = torch.maximum(m, z)
        alpha = torch.exp(m - m_new)
        w = torch.exp(z - m_new)
        s = s * alpha + w
        acc = acc * alpha + w * c
        m = m_new
    return torch.stack([m, s, acc])


# ---- 3. indexer ----------------------------------------------------------------------------

def indexer_scores_ref(q, weights, pool, row_ids) -> torch.Tensor:
    """scores fp32 [b, L]: sum_h w_h relu(q_h . K_s); -inf where row_ids < 0.

    q: [b, H, 128] (already rounded values); weights: [b, H]; row_ids: int [b, L] into the
    indexer pool (-1 = not visible).
    """
    k = read_indexer_rows(pool, row_ids.long())  # [b, L, 128] fp32
    logits = torch.einsum("bhd,bld->bhl", q.double(), k.double())
    s = (weights.double()[:, :, None] * logits.clamp_min(0)).sum(1)
    return s.float().masked_fill(row_ids < 0, float("-inf"))


def topk_ref(scores: torch.Tensor, row_ids: torch.Tensor, k: int) -> TopK:
    """Largest ``min(k, visible)`` scores per request, ties to the lower position; the result
    holds physical row ids (row_ids at the chosen positions), -1 padded, in descending order."""
    b, L = scores.shape
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    if order.shape[1] < k:
        order = torch.cat([order, order.new_zeros(b, k - order.shape[1])], 1)
    top_scores = torch.gather(scores, 1, order)
    rows = torch.gather(row_ids.long(), 1, order)
    n_vis = (row_ids >= 0).sum(1, keepdim=True)
    pad = torch.arange(k, device=scores.device)[None, :] >= torch.clamp(n_vis, max=min(k, L))
    return TopK(rows.masked_fill(pad, -1).int(), top_scores.masked_fill(pad, float("-inf")))


# ---- 4. sparse decode attention ------------------------------------------------------------

def sparse_decode_ref(q, swa_pool, window_slots, extra_pool, extra_rows, attn_sink,
                      softmax_scale, dtype=torch.float64) -> AttentionOutput:
    """FlashMLA MODEL1 decode semantics.

    q: [b, h, 512]; window_slots: int [b, W] into the SWA pool; extra_rows: int [b, k] into
    extra_pool (C4 or C128) or None; -1 = no key. One softmax over all keys plus
    exp(attn_sink[h]) in the denominator (the sink adds no value). out is 0 and lse +inf for a
    head with no key.
    """
    keys = read_kv_rows(swa_pool, window_slots.long())
    valid = window_slots >= 0
    if extra_rows is not None and extra_rows.shape[1] > 0:
        keys = torch.cat([keys, read_kv_rows(extra_pool, extra_rows.long())], 1)
        valid = torch.cat([valid, extra_rows >= 0], 1)
    keys = keys.to(dtype)  # [b, n, 512]
    s = torch.einsum("bhd,bnd->bhn", q.to(dtype), keys) * softmax_scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [b, h]
    total = torch.logaddexp(lse, attn_sink.to(dtype)[None, :])
    p = torch.exp(s - total[..., None])
    out = torch.einsum("bhn,bnd->bhd", p, keys)
    lonely = torch.isneginf(lse)
    out = out.masked_fill(lonely[..., None], 0.0)
    lse = lse.masked_fill(lonely, float("inf"))
    return AttentionOutput(out, lse.float())
