"""Sparse decode attention over FP8 pools, with FlashMLA MODEL1 semantics.

Each request attends from its h query heads to a key list: its window (SWA slots into the SWA
pool) followed by its extra rows (C4 top-k or all visible C128 rows). Keys are 584-byte rows,
dequantised in the kernel; a row is both K and V (MQA). One softmax over all keys, with
exp(attn_sink[h]) added to the denominator. Outputs: ``out [b, h, 512]`` (bf16) and
``lse [b, h]`` (fp32, natural log of sum exp(scale * q.k), sink excluded; +inf and out = 0 for a
head with no key), as FlashMLA's ``flash_mla_with_kvcache`` returns them.

Launch: one program per (request, block of BLOCK_H heads, split). The heads are the M dimension
of both tensor-core products, S = Q K^T ([BLOCK_H, 512] x [512, BLOCK_N]) and O += P V
([BLOCK_H, BLOCK_N] x [BLOCK_N, 512]), so every dequantised row serves all heads of the block.
A key tile is gathered once (its list picks the pool), its scale bytes read as two words per
row, and (``halves``) dequantised and multiplied as two 256-dim halves, which halves the live
registers of the dequantisation. Long key lists (HCA at 1M context: 128 + 8192 rows) are split
over programs when that finishes sooner (``default_num_splits``); the partial (O, lse) pairs are
merged, with the sink, by a second kernel.

Few requests with short lists (batch 1-4 at any context for CSA, to ~114K for HCA, every
window-only layer) launch too few programs to hide the latency of a tile: there
``decode_launch_rule`` takes 16 heads a program, 32-key tiles and about one tile per split
(``bench/probe_batch1.py`` on the H200, docs/PERF.md session 11: 23 -> 13 us for a window-only
layer at batch 1, 27 -> 18 us for CSA at 4K).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import (
    KV_ROW_BYTES, bf16_from_bytes, check_device, dot_dtype, e4m3_decode, exp2_int, native,
    page_geometry,
)
from dsv4_backend.kernels import pdl
from dsv4_backend.kernels.pdl import wait as pdl_wait

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


class DecodeAttentionConfig(NamedTuple):
    block_h: int = 64  # heads per program (the M of both products; at least 16)
    block_n: int = 64  # keys per tile
    num_warps: int = 8
    num_stages: int = 1
    scales: str = "word"  # how a tile's scale bytes are read: "word" or "element"
    halves: bool = True  # dequantise and multiply a key tile as two 256-dim halves


SCALE_MODES = ("word", "element")


class DecodeAttentionOutput(NamedTuple):
    out: torch.Tensor  # bf16 [b, h, 512]
    lse: torch.Tensor  # fp32 [b, h]


@triton.jit
def _word(p, valid):
    """Four bytes at ``p`` (little-endian) as int32, from byte loads (the interpreter cannot
    load through a re-typed pointer)."""
    b0 = tl.load(p, mask=valid, other=0).to(tl.int32)
    b1 = tl.load(p + 1, mask=valid, other=0).to(tl.int32)
    b2 = tl.load(p + 2, mask=valid, other=0).to(tl.int32)
    b3 = tl.load(p + 3, mask=valid, other=0).to(tl.int32)
    return b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)


@triton.jit
def _scale_word(pool_ptr, group, valid, HI: tl.constexpr, NATIVE: tl.constexpr):
    """Scale bytes 0-3 (HI false) or 4-7 (HI true) of each row as one int32; 0 where not valid."""
    p = pool_ptr + group + 4 * HI
    if NATIVE:
        return tl.load(p.to(tl.pointer_type(tl.int32)), mask=valid, other=0)
    else:
        return _word(p, valid)


@triton.jit
def _load_rows(pool_ptr, slot, valid, P, page_stride, D0: tl.constexpr, W: tl.constexpr,
               BLOCK_N: tl.constexpr, WORD_SCALES: tl.constexpr, NATIVE: tl.constexpr,
               DOT_DTYPE: tl.constexpr):
    """Dims D0 .. D0 + W - 1 of the rows at ``slot`` (int64 [BLOCK_N]), dequantised, as
    DOT_DTYPE [BLOCK_N, W]; zeros where not ``valid``.

    The nope codes are scaled by their 64-dim tile's power of two, read one of two ways:
    WORD_SCALES ("word"): the row's scale bytes as int32 words, one load per row, each element's
    byte picked by a shift; otherwise ("element", 2.2x slower on the H200, kept as the plain
    form to compare with): a scale byte gathered for every element."""
    s = tl.maximum(slot, 0)
    page = s // P
    r = s % P
    part = page * page_stride + r * 576
    group = page * page_stride + P * 576 + r * 8
    d = D0 + tl.arange(0, W)
    is_nope = d < 448
    nmask = valid[:, None] & is_nope[None, :]
    codes = tl.load(pool_ptr + part[:, None] + d[None, :], mask=nmask, other=0)
    if WORD_SCALES:
        shift = ((d // 64) % 4) * 8
        if D0 + W <= 256:
            word = _scale_word(pool_ptr, group, valid, False, NATIVE)[:, None]
        elif D0 >= 256:
            word = _scale_word(pool_ptr, group, valid, True, NATIVE)[:, None]
        else:
            word = tl.where((d < 256)[None, :],
                            _scale_word(pool_ptr, group, valid, False, NATIVE)[:, None],
                            _scale_word(pool_ptr, group, valid, True, NATIVE)[:, None])
        # byte = exponent + 127, so byte << 23 is the power of two's fp32 bits
        scale = (((word >> shift[None, :]) & 255) << 23).to(tl.float32, bitcast=True)
    else:
        sexp = tl.load(pool_ptr + group[:, None] + (d // 64)[None, :], mask=nmask, other=127)
        scale = exp2_int(sexp.to(tl.int32) - 127)
    x = e4m3_decode(codes, NATIVE) * scale
    if D0 + W > 448:  # the tile holds rope dims: bf16 pairs after the 448 codes
        rmask = valid[:, None] & (d >= 448)[None, :]
        if NATIVE:  # bf16 element 224 + i of the part is rope dim 448 + i: contiguous in d
            rope_at = (pool_ptr + part).to(tl.pointer_type(tl.bfloat16))[:, None] + (d - 224)[None, :]
            rope = tl.load(rope_at, mask=rmask, other=0.0).to(tl.float32)
        else:
            rope_byte = pool_ptr + part[:, None] + (448 + 2 * (d - 448))[None, :]
            rope = bf16_from_bytes(tl.load(rope_byte, mask=rmask, other=0),
                                   tl.load(rope_byte + 1, mask=rmask, other=0))
        x = tl.where(is_nope[None, :], x, rope)
    return x.to(DOT_DTYPE)


@triton.jit
def _sparse_decode_kernel(
        q_ptr, q_sb, q_sh,
        swa_ptr, swa_P, swa_ps, win_ptr, win_sb, n_win,
        ext_ptr, ext_P, ext_ps, ext_idx_ptr, ext_sb, n_ext,
        sink_ptr, scale_log2, num_heads,
        out_ptr, out_sb, out_sh, lse_ptr,
        po_ptr, plse_ptr, num_splits, tiles_per_split,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HALVES: tl.constexpr,
        WORD_SCALES: tl.constexpr, NATIVE: tl.constexpr, DOT_DTYPE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    b = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    q_row = q_ptr + b * q_sb + heads[:, None] * q_sh
    if HALVES:  # two [BLOCK_H, 256] halves of q and of the accumulator
        dh = tl.arange(0, 256)
        q_lo = tl.load(q_row + dh[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
        q_hi = tl.load(q_row + 256 + dh[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
        acc_lo = tl.zeros([BLOCK_H, 256], tl.float32)
        acc_hi = tl.zeros([BLOCK_H, 256], tl.float32)
    else:
        d = tl.arange(0, 512)
        q = tl.load(q_row + d[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
        acc = tl.zeros([BLOCK_H, 512], tl.float32)

    n_win_tiles = tl.cdiv(n_win, BLOCK_N)
    n_tiles = n_win_tiles + tl.cdiv(n_ext, BLOCK_N)
    t_begin = sp * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, n_tiles)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    for t in range(t_begin, t_end):
        # window tiles first, then the extra rows: pick the list and its pool, load once
        if t < n_win_tiles:
            pool, P, page_stride = swa_ptr, swa_P, swa_ps
            idx, j0, nk = win_ptr + b * win_sb, t * BLOCK_N, n_win
        else:
            pool, P, page_stride = ext_ptr, ext_P, ext_ps
            idx, j0, nk = ext_idx_ptr + b * ext_sb, (t - n_win_tiles) * BLOCK_N, n_ext
        jn = j0 + tl.arange(0, BLOCK_N)
        slot = tl.load(idx + jn, mask=jn < nk, other=-1).to(tl.int64)
        valid = slot >= 0
        if HALVES:
            k_lo = _load_rows(pool, slot, valid, P, page_stride, 0, 256, BLOCK_N, WORD_SCALES, NATIVE, DOT_DTYPE)
            k_hi = _load_rows(pool, slot, valid, P, page_stride, 256, 256, BLOCK_N, WORD_SCALES, NATIVE, DOT_DTYPE)
            s = tl.dot(q_hi, tl.trans(k_hi), tl.dot(q_lo, tl.trans(k_lo)))
        else:
            k = _load_rows(pool, slot, valid, P, page_stride, 0, 512, BLOCK_N, WORD_SCALES, NATIVE, DOT_DTYPE)
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_N], log2 units
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
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))  # log2 of sum 2^s
    if SPLIT:
        row = (b * num_splits + sp) * num_heads + heads
        o_row = po_ptr + row[:, None] * 512
        if HALVES:
            tl.store(o_row + dh[None, :], acc_lo / l_safe[:, None], mask=hmask[:, None])
            tl.store(o_row + 256 + dh[None, :], acc_hi / l_safe[:, None], mask=hmask[:, None])
        else:
            tl.store(o_row + d[None, :], acc / l_safe[:, None], mask=hmask[:, None])
        tl.store(plse_ptr + row, lse2, mask=hmask)
    else:
        sink2 = tl.load(sink_ptr + heads, mask=hmask, other=0.0) * 1.4426950408889634
        top = tl.maximum(lse2, sink2)
        total = top + tl.log2(tl.exp2(lse2 - top) + tl.exp2(sink2 - top))
        w = tl.where(empty, 0.0, tl.exp2(m_i - total))[:, None]
        o_row = out_ptr + b * out_sb + heads[:, None] * out_sh
        if HALVES:
            tl.store(o_row + dh[None, :], (acc_lo * w).to(out_ptr.dtype.element_ty), mask=hmask[:, None])
            tl.store(o_row + 256 + dh[None, :], (acc_hi * w).to(out_ptr.dtype.element_ty), mask=hmask[:, None])
        else:
            tl.store(o_row + d[None, :], (acc * w).to(out_ptr.dtype.element_ty), mask=hmask[:, None])
        lse = tl.where(empty, float("inf"), lse2 * 0.6931471805599453)
        tl.store(lse_ptr + b * num_heads + heads, lse, mask=hmask)


@triton.jit
def _merge_kernel(po_ptr, plse_ptr, sink_ptr, out_ptr, out_sb, out_sh, lse_ptr, num_heads,
                  num_splits, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    """Combine the splits' normalised partial outputs of one (request, head), with the sink."""
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    first = b * num_splits * num_heads + h  # partial row of split 0; split s is s * num_heads on
    lse2 = tl.load(plse_ptr + first + sp * num_heads, mask=sp < num_splits, other=float("-inf"))
    top = tl.max(lse2, axis=0)
    empty = top == float("-inf")
    top_safe = tl.where(empty, 0.0, top)
    wsum = tl.sum(tl.exp2(lse2 - top_safe), axis=0)
    sink2 = tl.load(sink_ptr + h) * 1.4426950408889634
    denom = wsum + tl.exp2(sink2 - top_safe)
    d = tl.arange(0, 512)
    o = tl.zeros([512], tl.float32)
    for s in range(0, num_splits):
        row = first + s * num_heads
        w = tl.exp2(tl.load(plse_ptr + row) - top_safe) / denom
        o += tl.load(po_ptr + row * 512 + d) * w
    o = tl.where(empty, 0.0, o)
    tl.store(out_ptr + b * out_sb + h * out_sh + d, o.to(out_ptr.dtype.element_ty))
    lse = tl.where(empty, float("inf"), (top_safe + tl.log2(tl.where(empty, 1.0, wsum))) * 0.6931471805599453)
    tl.store(lse_ptr + b * num_heads + h, lse)


SMALL_BATCH_CONFIG = DecodeAttentionConfig(16, 32, 8, 1, "word", True)
SMALL_BATCH_MAX_REQUESTS = 4   # the probe's batches; larger ones keep the tuned default
SMALL_BATCH_MAX_KEYS = 1024    # window + extra rows; the 1M HCA list (8,320) ran faster on the default
SMALL_BATCH_MAX_SPLITS = 16


def decode_launch_rule(b: int, n_keys: int) -> tuple[DecodeAttentionConfig, int | None]:
    """(config, splits or None for ``default_num_splits``) for ``b`` requests of ``n_keys`` keys
    each (window slots + extra rows)."""
    if b <= SMALL_BATCH_MAX_REQUESTS and n_keys <= SMALL_BATCH_MAX_KEYS:
        tiles = triton.cdiv(n_keys, SMALL_BATCH_CONFIG.block_n)
        return SMALL_BATCH_CONFIG, max(1, min(SMALL_BATCH_MAX_SPLITS, tiles))
    return DecodeAttentionConfig(), None


@functools.lru_cache(maxsize=4096)
def default_num_splits(programs: int, n_tiles: int, num_sms: int) -> int:
    """Splits of the key list that finish soonest, counting in key tiles per SM.

    A launch of ``programs * splits`` programs runs in waves of ``num_sms`` (one resident
    program per SM: the accumulator fills the register file); each wave costs the tiles of one
    split. Splitting pays when programs leave SMs idle, but it adds the merge launch (taken as
    one tile) and a write and a read of every split's [h, 512] fp32 partial output (taken as a
    tile per partial per SM); and the count matters: 160 programs on 132 SMs take two full
    waves, 128 take one."""
    if n_tiles <= 1:
        return 1
    best, best_cost = 1, float(n_tiles * triton.cdiv(programs, num_sms))
    # at least two tiles per split; beyond two waves' worth of programs a split never pays (and
    # the search stays short for dense lists of 16K tiles)
    for splits in range(2, min(n_tiles // 2, 2 * triton.cdiv(num_sms, programs)) + 1):
        per = triton.cdiv(n_tiles, splits)
        used = triton.cdiv(n_tiles, per)
        cost = per * triton.cdiv(programs * used, num_sms) + 1.0 + programs * used / num_sms
        if cost < best_cost:
            best, best_cost = used, cost
    return best


def sparse_decode(q: torch.Tensor, swa_pool: torch.Tensor, window_slots: torch.Tensor,
                  extra_pool: torch.Tensor | None, extra_rows: torch.Tensor | None,
                  attn_sink: torch.Tensor, softmax_scale: float, num_splits: int | None = None,
                  config: DecodeAttentionConfig | None = None,
                  out: torch.Tensor | None = None) -> DecodeAttentionOutput:
    """Decode attention of one query token per request.

    q: [b, h, 512] (bf16 on the GPU); swa_pool: uint8 [pages, 128 * 584];
    window_slots: int32 [b, W] SWA slots, -1 = none; extra_pool: uint8 [pages, 64 * 584] or None;
    extra_rows: int32 [b, k] rows of extra_pool, -1 = none, or None; attn_sink: fp32 [h].
    num_splits: programs per (request, head block) along the key list (None: a heuristic).
    config: the launch shape (None: ``decode_launch_rule``, whose splits then apply too unless
    ``num_splits`` is given).
    """
    b, h, dim = q.shape
    if dim != 512 or q.stride(2) != 1:
        raise ValueError(f"q must be [b, h, 512] with unit last stride, got {tuple(q.shape)}")
    if window_slots.dim() != 2 or window_slots.shape[0] != b:
        raise ValueError(f"window_slots must be [b={b}, W], got {tuple(window_slots.shape)}")
    if attn_sink.shape != (h,):
        raise ValueError(f"attn_sink must be [h={h}], got {tuple(attn_sink.shape)}")
    swa_P, swa_ps = page_geometry(swa_pool, KV_ROW_BYTES, "SWA")
    if extra_rows is None or extra_rows.shape[1] == 0:
        extra_pool, extra_rows = swa_pool, window_slots[:, :0]
    if extra_rows.shape[0] != b:
        raise ValueError(f"extra_rows must be [b={b}, k], got {tuple(extra_rows.shape)}")
    ext_P, ext_ps = page_geometry(extra_pool, KV_ROW_BYTES, "extra (C4/C128)")
    check_device(q, swa_pool, window_slots, extra_pool, extra_rows, attn_sink)
    window_slots = window_slots.to(torch.int32).contiguous()
    extra_rows = extra_rows.to(torch.int32).contiguous()
    attn_sink = attn_sink.float().contiguous()

    n_win, n_ext = window_slots.shape[1], extra_rows.shape[1]
    if config is None:
        config, rule_splits = decode_launch_rule(b, n_win + n_ext)
        num_splits = rule_splits if num_splits is None else num_splits
    block_h = max(16, min(config.block_h, triton.next_power_of_2(h)))
    head_blocks = triton.cdiv(h, block_h)
    n_tiles = triton.cdiv(n_win, config.block_n) + triton.cdiv(n_ext, config.block_n)
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 132
        num_splits = default_num_splits(b * head_blocks, n_tiles, sms)
    num_splits = max(1, min(num_splits, max(n_tiles, 1)))
    tiles_per_split = triton.cdiv(max(n_tiles, 1), num_splits)
    num_splits = triton.cdiv(max(n_tiles, 1), tiles_per_split)
    if config.scales not in SCALE_MODES:
        raise ValueError(f"config.scales must be one of {sorted(SCALE_MODES)}, got {config.scales!r}")

    if out is None:
        out = torch.empty(b, h, 512, dtype=torch.bfloat16 if q.is_cuda else q.dtype, device=q.device)
    lse = torch.empty(b, h, dtype=torch.float32, device=q.device)
    split = num_splits > 1
    if split:
        po = torch.empty(b * num_splits * h, 512, dtype=torch.float32, device=q.device)
        plse = torch.empty(b * num_splits * h, dtype=torch.float32, device=q.device)
    else:
        po, plse = lse, lse
    dt = tl.float32 if dot_dtype() == torch.float32 else tl.bfloat16
    _sparse_decode_kernel[(b, head_blocks, num_splits)](
        q, q.stride(0), q.stride(1),
        swa_pool, swa_P, swa_ps, window_slots, window_slots.stride(0), n_win,
        extra_pool, ext_P, ext_ps, extra_rows, extra_rows.stride(0), n_ext,
        attn_sink, softmax_scale * LOG2E, h,
        out, out.stride(0), out.stride(1), lse,
        po, plse, num_splits, tiles_per_split,
        BLOCK_H=block_h, BLOCK_N=config.block_n, SPLIT=split, HALVES=config.halves,
        WORD_SCALES=config.scales == "word", NATIVE=native(), DOT_DTYPE=dt,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.args(q.device))
    if split:
        _merge_kernel[(b, h)](po, plse, attn_sink, out, out.stride(0), out.stride(1), lse, h,
                              num_splits, BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4, **pdl.args(po.device))
    return DecodeAttentionOutput(out, lse)
