"""Sparse decode attention of s_q query rows per request (a speculative verify step).

A verify of k drafts runs ``s_q = k + 1`` rows per request at consecutive positions
``n .. n + k``. Row i attends exactly as the one-row decode kernel (``sparse_attention.py``)
would: its causal window ``n + i - 127 .. n + i`` and its extra rows, one softmax with the
attention sink; the outputs (``out [T, h, 512]``, ``lse [T, h]``, T = requests x s_q, rows of a
request adjacent) are those of running every row through ``sparse_decode``, up to summation order.

Launch: one program per (request, group of ROWS query rows, block of BLOCK_H heads, split). The
M dimension of both tensor-core products is ROWS x BLOCK_H (query row major), so one
dequantised key tile serves every (row, head) pair of the group:

- **window**: the group's union window, positions ``n + i0 - 127 .. n + i0 + ROWS - 1`` (127 +
  ROWS columns), is read once; column c is row r's key when ``r <= c < r + 128``. Its slots
  come straight from the rows' own window tables (row i0's 128 columns, then the last row's
  newest ROWS - 1), which is exact because row i's window is row i0's shifted by i - i0;
- **C128 / HCA** (``shared_extra``): every row of a request lists the same visible rows, a row
  that does not see a block yet having -1 there, so the group's last row's list is read once
  and row r keeps column j when its own entry equals that one;
- **C4 / CSA**: each row has its own top-k list. They are read per row, each tile scoring only
  its own row's M lanes (the union of the lists would need a sort per layer; not done).

How many rows share a program: ROWS = min(s_q, BLOCK_M / BLOCK_H), with BLOCK_M = 64 the most
(row, head) pairs whose fp32 ``[M, 512]`` accumulator stays in registers. With 64 heads (Flash
on one GPU) that is ROWS = 1: the one-row kernel's tiling, every tile already serving 64 pairs,
and the rows do not share reads (sharing would need M = 64 s_q). Rows share where the heads
per GPU are fewer (tensor parallelism: 8 or 16 heads), and ``VerifyAttentionConfig.rows``
forces a grouping (a bench knob). docs/kernels.md has the bytes each way.

Long key lists are split over programs as in the one-row kernel, and merged by its merge
kernel (one (query row, head) per program).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import KV_ROW_BYTES, check_device, dot_dtype, native, page_geometry
from dsv4_backend.kernels.sparse_attention import (
    LOG2E, SCALE_MODES, DecodeAttentionOutput, _load_rows, _merge_kernel, default_num_splits,
)
from dsv4_backend.kernels import pdl


class VerifyAttentionConfig(NamedTuple):
    block_m: int = 64  # (query row, head) pairs per program: the M of both products (>= 16)
    block_n: int = 64  # keys per tile
    num_warps: int = 8
    num_stages: int = 1
    scales: str = "word"  # as DecodeAttentionConfig.scales
    halves: bool = True  # as DecodeAttentionConfig.halves
    rows: Optional[int] = None  # query rows per program (a power of two); None: as many as fit


def verify_tiling(h: int, s_q: int, config: VerifyAttentionConfig = VerifyAttentionConfig()) -> tuple[int, int]:
    """(ROWS, BLOCK_H): query rows and heads per program. Heads fill M first (a request's heads
    in one program), then rows; tl.dot needs M >= 16, so tiny head counts get padded heads."""
    if config.rows is None:
        block_h = max(1, min(config.block_m, triton.next_power_of_2(h)))
        rows = max(1, min(triton.next_power_of_2(s_q), config.block_m // block_h))
    else:
        if config.rows < 1 or config.rows & (config.rows - 1):
            raise ValueError(f"config.rows must be a power of two, got {config.rows}")
        rows = min(config.rows, triton.next_power_of_2(s_q))
        block_h = max(1, min(max(1, config.block_m // rows), triton.next_power_of_2(h)))
    return rows, max(block_h, triton.cdiv(16, rows))


@triton.jit
def _sparse_verify_kernel(
        q_ptr, q_st, q_sh,
        swa_ptr, swa_P, swa_ps, win_ptr, win_st, n_win,
        ext_ptr, ext_P, ext_ps, ext_idx_ptr, ext_st, n_ext,
        sink_ptr, scale_log2, num_heads, s_q, groups,
        out_ptr, out_st, out_sh, lse_ptr,
        po_ptr, plse_ptr, num_splits, tiles_per_split,
        ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SHARED_EXT: tl.constexpr,
        SPLIT: tl.constexpr, HALVES: tl.constexpr, WORD_SCALES: tl.constexpr, NATIVE: tl.constexpr,
        DOT_DTYPE: tl.constexpr):
    pid = tl.program_id(0)
    req = (pid // groups).to(tl.int64)
    i0 = (pid % groups) * ROWS                       # the group's first query row
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    last = tl.minimum(ROWS, s_q - i0) - 1            # the group's last real row, relative to i0
    t0 = req * s_q + i0                              # its first row's index in q / the tables
    m = tl.arange(0, ROWS * BLOCK_H)
    r = m // BLOCK_H                                 # each M lane's query row (relative) ...
    heads = hb * BLOCK_H + m % BLOCK_H               # ... and head
    mmask = (heads < num_heads) & (r <= last)
    t = t0 + r                                       # each lane's query row index
    q_row = q_ptr + t[:, None] * q_st + heads[:, None] * q_sh
    if HALVES:
        dh = tl.arange(0, 256)
        q_lo = tl.load(q_row + dh[None, :], mask=mmask[:, None], other=0.0).to(DOT_DTYPE)
        q_hi = tl.load(q_row + 256 + dh[None, :], mask=mmask[:, None], other=0.0).to(DOT_DTYPE)
        acc_lo = tl.zeros([ROWS * BLOCK_H, 256], tl.float32)
        acc_hi = tl.zeros([ROWS * BLOCK_H, 256], tl.float32)
    else:
        d = tl.arange(0, 512)
        q = tl.load(q_row + d[None, :], mask=mmask[:, None], other=0.0).to(DOT_DTYPE)
        acc = tl.zeros([ROWS * BLOCK_H, 512], tl.float32)

    n_union = n_win + last                           # the group's union window, in columns
    n_win_tiles = tl.cdiv(n_union, BLOCK_N)
    tiles_per_list = tl.cdiv(n_ext, BLOCK_N)
    if SHARED_EXT:
        n_tiles = n_win_tiles + tiles_per_list
    else:
        n_tiles = n_win_tiles + (last + 1) * tiles_per_list
    t_begin = sp * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, n_tiles)

    m_i = tl.full([ROWS * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS * BLOCK_H], tl.float32)
    jb = tl.arange(0, BLOCK_N)
    for tile in range(t_begin, t_end):
        if tile < n_win_tiles:
            pool, P, page_stride = swa_ptr, swa_P, swa_ps
            c = tile * BLOCK_N + jb
            # union column c: row i0's column c, then the last row's columns past row i0's
            src = tl.where(c < n_win, t0 * win_st + c, (t0 + last) * win_st + c - last)
            slot = tl.load(win_ptr + src, mask=c < n_union, other=-1).to(tl.int64)
            rel = c[None, :] - r[:, None]            # the column in lane's own window
            see = (rel >= 0) & (rel < n_win)
        elif SHARED_EXT:
            pool, P, page_stride = ext_ptr, ext_P, ext_ps
            j = (tile - n_win_tiles) * BLOCK_N + jb
            slot = tl.load(ext_idx_ptr + (t0 + last) * ext_st + j, mask=j < n_ext, other=-1).to(tl.int64)
            own = tl.load(ext_idx_ptr + t[:, None] * ext_st + j[None, :],
                          mask=mmask[:, None] & (j < n_ext)[None, :], other=-1)
            see = own.to(tl.int64) == slot[None, :]
        else:
            pool, P, page_stride = ext_ptr, ext_P, ext_ps
            u = tile - n_win_tiles
            row = u // tiles_per_list                # the query row whose list this tile is
            j = (u % tiles_per_list) * BLOCK_N + jb
            slot = tl.load(ext_idx_ptr + (t0 + row) * ext_st + j, mask=j < n_ext, other=-1).to(tl.int64)
            see = (r == row)[:, None] & (j >= 0)[None, :]
        valid = slot >= 0
        see = see & valid[None, :] & mmask[:, None]
        if HALVES:
            k_lo = _load_rows(pool, slot, valid, P, page_stride, 0, 256, BLOCK_N, WORD_SCALES, NATIVE, DOT_DTYPE)
            k_hi = _load_rows(pool, slot, valid, P, page_stride, 256, 256, BLOCK_N, WORD_SCALES, NATIVE, DOT_DTYPE)
            s = tl.dot(q_hi, tl.trans(k_hi), tl.dot(q_lo, tl.trans(k_lo)))
        else:
            k = _load_rows(pool, slot, valid, P, page_stride, 0, 512, BLOCK_N, WORD_SCALES, NATIVE, DOT_DTYPE)
            s = tl.dot(q, tl.trans(k))
        s = tl.where(see, s * scale_log2, float("-inf"))   # [M, BLOCK_N], log2 units
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
        l_i = l_i * alpha
        if HALVES:
            acc_lo = acc_lo * alpha[:, None]
            acc_hi = acc_hi * alpha[:, None]
        else:
            acc = acc * alpha[:, None]
        m_i = m_new
        p = tl.exp2(s - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
        l_i = l_i + tl.sum(p, axis=1)
        p = p.to(DOT_DTYPE)
        if HALVES:
            acc_lo = tl.dot(p, k_lo, acc_lo)
            acc_hi = tl.dot(p, k_hi, acc_hi)
        else:
            acc = tl.dot(p, k, acc)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
    if SPLIT:   # partial rows laid out as the one-row kernel's, so its merge kernel combines them
        prow = (t * num_splits + sp) * num_heads + heads
        o_row = po_ptr + prow[:, None] * 512
        if HALVES:
            tl.store(o_row + dh[None, :], acc_lo / l_safe[:, None], mask=mmask[:, None])
            tl.store(o_row + 256 + dh[None, :], acc_hi / l_safe[:, None], mask=mmask[:, None])
        else:
            tl.store(o_row + d[None, :], acc / l_safe[:, None], mask=mmask[:, None])
        tl.store(plse_ptr + prow, lse2, mask=mmask)
    else:
        sink2 = tl.load(sink_ptr + heads, mask=mmask, other=0.0) * 1.4426950408889634
        top = tl.maximum(lse2, sink2)
        total = top + tl.log2(tl.exp2(lse2 - top) + tl.exp2(sink2 - top))
        w = tl.where(empty, 0.0, tl.exp2(m_i - total))[:, None]
        o_row = out_ptr + t[:, None] * out_st + heads[:, None] * out_sh
        if HALVES:
            tl.store(o_row + dh[None, :], (acc_lo * w).to(out_ptr.dtype.element_ty), mask=mmask[:, None])
            tl.store(o_row + 256 + dh[None, :], (acc_hi * w).to(out_ptr.dtype.element_ty), mask=mmask[:, None])
        else:
            tl.store(o_row + d[None, :], (acc * w).to(out_ptr.dtype.element_ty), mask=mmask[:, None])
        lse = tl.where(empty, float("inf"), lse2 * 0.6931471805599453)
        tl.store(lse_ptr + t * num_heads + heads, lse, mask=mmask)


def sparse_verify(q: torch.Tensor, swa_pool: torch.Tensor, window_slots: torch.Tensor,
                  extra_pool: Optional[torch.Tensor], extra_rows: Optional[torch.Tensor],
                  attn_sink: torch.Tensor, softmax_scale: float, s_q: int, shared_extra: bool = False,
                  num_splits: Optional[int] = None, config: VerifyAttentionConfig = VerifyAttentionConfig(),
                  out: Optional[torch.Tensor] = None) -> DecodeAttentionOutput:
    """Decode attention of ``s_q`` consecutive query rows per request.

    q: [T, h, 512], T = requests x s_q, a request's rows adjacent in position order;
    window_slots: int32 [T, W], row t's window (positions p_t - W + 1 .. p_t), -1 = none; each
    row's window is its predecessor's shifted by one (what the metadata builds for an extend);
    extra_rows: int32 [T, k] or None. ``shared_extra``: the rows of a request list the same extra
    rows, -1 where a row does not see one yet (C128's visible rows); else each row's list is its
    own (C4 top-k). The rest as ``sparse_decode``.
    """
    T, h, dim = q.shape
    if dim != 512 or q.stride(2) != 1:
        raise ValueError(f"q must be [T, h, 512] with unit last stride, got {tuple(q.shape)}")
    if s_q < 1 or T % s_q:
        raise ValueError(f"{T} query rows are not requests of s_q={s_q} rows")
    if window_slots.dim() != 2 or window_slots.shape[0] != T:
        raise ValueError(f"window_slots must be [T={T}, W], got {tuple(window_slots.shape)}")
    if attn_sink.shape != (h,):
        raise ValueError(f"attn_sink must be [h={h}], got {tuple(attn_sink.shape)}")
    if config.scales not in SCALE_MODES:
        raise ValueError(f"config.scales must be one of {sorted(SCALE_MODES)}, got {config.scales!r}")
    swa_P, swa_ps = page_geometry(swa_pool, KV_ROW_BYTES, "SWA")
    if extra_rows is None or extra_rows.shape[1] == 0:
        extra_pool, extra_rows = swa_pool, window_slots[:, :0]
    if extra_rows.shape[0] != T:
        raise ValueError(f"extra_rows must be [T={T}, k], got {tuple(extra_rows.shape)}")
    ext_P, ext_ps = page_geometry(extra_pool, KV_ROW_BYTES, "extra (C4/C128)")
    check_device(q, swa_pool, window_slots, extra_pool, extra_rows, attn_sink)
    window_slots = window_slots.to(torch.int32).contiguous()
    extra_rows = extra_rows.to(torch.int32).contiguous()
    attn_sink = attn_sink.float().contiguous()

    rows, block_h = verify_tiling(h, s_q, config)
    groups = triton.cdiv(s_q, rows)
    head_blocks = triton.cdiv(h, block_h)
    n_win, n_ext = window_slots.shape[1], extra_rows.shape[1]
    ext_tiles = triton.cdiv(n_ext, config.block_n) * (1 if shared_extra else rows)
    n_tiles = triton.cdiv(n_win + rows - 1, config.block_n) + ext_tiles      # a full group's
    programs = T // s_q * groups * head_blocks
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 132
        num_splits = default_num_splits(programs, n_tiles, sms)
    num_splits = max(1, min(num_splits, max(n_tiles, 1)))
    tiles_per_split = triton.cdiv(max(n_tiles, 1), num_splits)
    num_splits = triton.cdiv(max(n_tiles, 1), tiles_per_split)

    if out is None:
        out = torch.empty(T, h, 512, dtype=torch.bfloat16 if q.is_cuda else q.dtype, device=q.device)
    lse = torch.empty(T, h, dtype=torch.float32, device=q.device)
    split = num_splits > 1
    if split:
        po = torch.empty(T * num_splits * h, 512, dtype=torch.float32, device=q.device)
        plse = torch.empty(T * num_splits * h, dtype=torch.float32, device=q.device)
    else:
        po, plse = lse, lse
    dt = tl.float32 if dot_dtype() == torch.float32 else tl.bfloat16
    _sparse_verify_kernel[(T // s_q * groups, head_blocks, num_splits)](
        q, q.stride(0), q.stride(1),
        swa_pool, swa_P, swa_ps, window_slots, window_slots.stride(0), n_win,
        extra_pool, ext_P, ext_ps, extra_rows, extra_rows.stride(0), n_ext,
        attn_sink, softmax_scale * LOG2E, h, s_q, groups,
        out, out.stride(0), out.stride(1), lse,
        po, plse, num_splits, tiles_per_split,
        ROWS=rows, BLOCK_H=block_h, BLOCK_N=config.block_n, SHARED_EXT=shared_extra, SPLIT=split,
        HALVES=config.halves, WORD_SCALES=config.scales == "word", NATIVE=native(), DOT_DTYPE=dt,
        num_warps=config.num_warps, num_stages=config.num_stages)
    if split:
        _merge_kernel[(T, h)](po, plse, attn_sink, out, out.stride(0), out.stride(1), lse, h,
                              num_splits, BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4, **pdl.args(po.device))
    return DecodeAttentionOutput(out, lse)
