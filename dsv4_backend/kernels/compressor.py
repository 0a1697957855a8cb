"""Compressor: softmax pooling of a block's raw (C, Z) into one compressed row.

Completion events come as a list: each has a destination row (C4 / C128 / indexer pool) and
K candidate sources, indices into a state buffer ``[slots, 2 * coff * d]`` whose rows are
``[C (coff*d) | Z (coff*d)]`` (fp32 or bf16). Candidate j adds ``ape[j % m]`` to its score;
for m = 4 (coff = 2, K = 8) candidates 0..3 are the previous block's tokens and use channels
[0:d] (the b-half) of C, Z and ape, candidates 4..7 this block's tokens with channels [d:2d]
(the a-half); -1 masks a candidate (the first block has no previous one). For m = 128
(coff = 1, K = 128) every candidate uses all channels. Pooling is a per-channel softmax over
the candidates (fp32), then ``kv_store.finish_rows`` normalises, rotates at the block's first
position, (Hadamard-rotates for the indexer,) quantises and writes.

Launches: the pooling kernel, one program per (event, block of channels), an online softmax
over chunks of candidates; then the finish kernel, one program per event.

Online C128 (``SGLANG_OPT_USE_ONLINE_COMPRESS``): ``online_c128_update`` folds each new
token into its request's running (max, sum, acc) state ``[slots, 3, d]`` fp32 (restarting at
every block start) and emits ``acc / sum`` for the tokens that complete a block; those pooled
rows go through ``finish_rows`` like the ring's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import check_device
from dsv4_backend.kernels.kv_store import finish_rows


class CompressEvents(NamedTuple):
    """Blocks completed in this step (one entry per event)."""
    dest_rows: torch.Tensor  # int [E]: row to write in the C4 / C128 / indexer pool
    sources: torch.Tensor  # int [E, K]: state-buffer slots of the candidates, -1 = masked
    cos: torch.Tensor  # fp32 [E, 32]: RoPE at the block's first position
    sin: torch.Tensor  # fp32 [E, 32]


@triton.jit
def _pool_kernel(state_ptr, state_stride, src_ptr, src_stride, ape_ptr, ape_stride,
                 out_ptr, out_stride, dest_ptr,
                 K: tl.constexpr, RATIO: tl.constexpr, D: tl.constexpr, COFF: tl.constexpr,
                 KC: tl.constexpr, BLOCK_D: tl.constexpr, SKIP: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = e >= 0
    if SKIP:  # a masked event (destination < 0) is never written: its loads are masked off
        live = tl.load(dest_ptr + e) >= 0
    m = tl.full([BLOCK_D], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for k0 in tl.static_range(0, K, KC):
        j = k0 + tl.arange(0, KC)
        src = tl.load(src_ptr + e * src_stride + j).to(tl.int64)
        valid = (src >= 0) & live
        if COFF == 2:
            col = (j >= RATIO).to(tl.int32)[:, None] * D + ch[None, :]
        else:
            col = tl.zeros([KC], tl.int32)[:, None] + ch[None, :]
        row = state_ptr + tl.maximum(src, 0)[:, None] * state_stride
        c = tl.load(row + col, mask=valid[:, None], other=0.0).to(tl.float32)
        z = tl.load(row + COFF * D + col, mask=valid[:, None], other=0.0).to(tl.float32)
        z += tl.load(ape_ptr + (j % RATIO)[:, None] * ape_stride + col).to(tl.float32)
        z = tl.where(valid[:, None], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(z - m_safe[None, :])
        alpha = tl.exp(m - m_safe)
        s = s * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p * c, axis=0)
        m = m_new
    tl.store(out_ptr + e * out_stride + ch, acc / tl.where(live, s, 1.0), mask=(ch < D) & live)


def compress_pool(state: torch.Tensor, sources: torch.Tensor, ape: torch.Tensor, ratio: int,
                  d: int, dest_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Pooled rows fp32 [E, d] (see the module docstring for the candidate layout).

    With ``dest_rows`` [E], events whose destination is < 0 are skipped (their rows are left
    unwritten): a CUDA-graph decode step lists every request as an event and masks the
    ones that complete no block this step."""
    coff = 2 if ratio == 4 else 1
    if ratio not in (4, 128):
        raise ValueError(f"compress ratio must be 4 or 128, got {ratio}")
    e, k = sources.shape
    if k != coff * ratio:
        raise ValueError(f"ratio {ratio} takes {coff * ratio} candidates per event, got {k}")
    if state.dim() != 2 or state.shape[1] != 2 * coff * d or state.stride(1) != 1:
        raise ValueError(f"state must be [slots, {2 * coff * d}], got {tuple(state.shape)}")
    if ape.shape != (ratio, coff * d):
        raise ValueError(f"ape must be [{ratio}, {coff * d}], got {tuple(ape.shape)}")
    check_device(state, sources, ape)
    out = torch.empty(e, d, dtype=torch.float32, device=state.device)
    if e == 0:
        return out
    sources = sources.to(torch.int32).contiguous()
    ape = ape.float().contiguous()
    block_d = 128
    kc = 8 if ratio == 4 else 16
    _pool_kernel[(e, d // block_d)](
        state, state.stride(0), sources, sources.stride(0), ape, ape.stride(0), out, out.stride(0),
        dest_rows if dest_rows is not None else sources,
        K=k, RATIO=ratio, D=d, COFF=coff, KC=kc, BLOCK_D=block_d, SKIP=dest_rows is not None, num_warps=4)
    return out


def compress(pool: torch.Tensor, events: CompressEvents, state: torch.Tensor, ape: torch.Tensor,
             norm_weight: torch.Tensor, ratio: int, eps: float = 1e-6, round_bf16: bool = True,
             hadamard: torch.Tensor | None = None, out: torch.Tensor | None = None):
    """Pool, normalise, rotate, quantise and write one compressed row per event.

    pool: the C4 / C128 attention pool (uint8 [pages, 64 * 584]) or, with ``hadamard`` given
    ([128, 128] fp32, scaled Sylvester), the indexer pool (uint8 [pages, 64 * 132]);
    state: the ring ``[slots, 2 * coff * d]``; ape: fp32 [m, coff * d]; norm_weight: [d].
    ``out`` optionally receives the dequantised rows. Returns ``out``.
    """
    d = 128 if hadamard is not None else 512
    pooled = compress_pool(state, events.sources, ape, ratio, d, dest_rows=events.dest_rows)
    return finish_rows(pool, events.dest_rows, pooled, norm_weight, events.cos, events.sin, eps,
                       round_in=round_bf16, round_bf16=round_bf16, hadamard=hadamard, out=out)


# ---- online C128 ---------------------------------------------------------------------------

@triton.jit
def _online_kernel(state_ptr, slot_ptr, start_ptr, count_ptr, cz_ptr, cz_stride, pos_ptr,
                   ape_ptr, pooled_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    st = state_ptr + tl.load(slot_ptr + r).to(tl.int64) * (3 * D)
    m = tl.load(st + ch)
    s = tl.load(st + D + ch)
    acc = tl.load(st + 2 * D + ch)
    start = tl.load(start_ptr + r).to(tl.int64)
    cz_row = cz_ptr + start * cz_stride
    pos_at = pos_ptr + start
    out_row = pooled_ptr + start * D
    count = tl.load(count_ptr + r)
    for _ in range(0, count):
        p = tl.load(pos_at) % 128
        fresh = p == 0
        m = tl.where(fresh, float("-inf"), m)
        s = tl.where(fresh, 0.0, s)
        acc = tl.where(fresh, 0.0, acc)
        c = tl.load(cz_row + ch).to(tl.float32)
        z = tl.load(cz_row + D + ch).to(tl.float32) + tl.load(ape_ptr + p * D + ch)
        m_new = tl.maximum(m, z)
        alpha = tl.exp(m - m_new)
        w = tl.exp(z - m_new)
        s = s * alpha + w
        acc = acc * alpha + w * c
        m = m_new
        tl.store(out_row + ch, acc / s, mask=(tl.zeros([BLOCK_D], tl.int32) + p) == 127)
        cz_row += cz_stride
        pos_at += 1
        out_row += D
    # a request with no token this step (a padded CUDA-graph row) leaves the state alone: its
    # slot may be a real request's, updated by another program of this launch
    if count > 0:
        tl.store(st + ch, m)
        tl.store(st + D + ch, s)
        tl.store(st + 2 * D + ch, acc)


def online_c128_update(state: torch.Tensor, req_slots: torch.Tensor, token_start: torch.Tensor,
                       token_count: torch.Tensor, cz: torch.Tensor, positions: torch.Tensor,
                       ape: torch.Tensor, pooled: torch.Tensor | None = None) -> torch.Tensor:
    """Fold new tokens into the running C128 softmax state.

    state: fp32 [slots, 3, d] (max, sum, acc) per request slot; req_slots: int [R];
    token_start / token_count: int [R], each request's tokens as a contiguous range of rows of
    cz [N, 2d] (= [C | Z] of each new token, before ape) and positions int [N], in order;
    ape: fp32 [128, d]. Returns ``pooled`` fp32 [N, d], written only at tokens with
    position % 128 == 127 (the block's pooled row, ready for ``finish_rows``).
    """
    if state.dim() != 3 or state.shape[1] != 3 or not state.is_contiguous() or state.dtype != torch.float32:
        raise ValueError(f"online state must be contiguous fp32 [slots, 3, d], got {state.dtype} "
                         f"{tuple(state.shape)}")
    d = state.shape[2]
    n = cz.shape[0]
    if cz.shape != (n, 2 * d) or cz.stride(1) != 1 or positions.shape != (n,):
        raise ValueError(f"cz must be [N, {2 * d}] and positions [N]; got {tuple(cz.shape)}, "
                         f"{tuple(positions.shape)}")
    if ape.shape != (128, d):
        raise ValueError(f"ape must be [128, {d}], got {tuple(ape.shape)}")
    check_device(state, req_slots, cz, positions, ape)
    if pooled is None:
        pooled = torch.empty(n, d, dtype=torch.float32, device=state.device)
    r = req_slots.shape[0]
    if r == 0:
        return pooled
    block_d = 128
    _online_kernel[(r, d // block_d)](
        state, req_slots.to(torch.int32).contiguous(), token_start.to(torch.int32).contiguous(),
        token_count.to(torch.int32).contiguous(), cz, cz.stride(0),
        positions.to(torch.int32).contiguous(), ape.float().contiguous(), pooled,
        D=d, BLOCK_D=block_d, num_warps=4)
    return pooled
