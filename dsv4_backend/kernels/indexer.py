"""Indexer: scores of every visible C4 row, then top-k.

``score[b, j] = sum_h w[b, h] * relu(q[b, h] . K_j)`` over the request's visible indexer rows
(132-byte rows: 128 e4m3 values + fp32 scale, dequantised in the kernel), then the
``min(k, visible)`` best rows per request as physical C4 row ids, -1 padded, ties toward the
lower list position.

The request's rows are given either as row ids ``[b, L]`` (-1 = not visible) or, as the
allocator lays them out, as a page table ``[b, pages]`` of indexer pages plus a visible count
``[b]``: list position j is row ``table[b, j // P] * P + j % P``. Full pages of 256 tokens hold
exactly 64 C4 rows, so one indexer page (P = 64) is one full page's rows.

Launch: one program per (request, chunk of ``chunk`` list positions); each tile of BLOCK_N rows
is one tensor-core product K [BLOCK_N, 128] x q^T [128, H]; the weighted relu sum runs on the
accumulator. Scores go to an fp32 buffer; top-k is ``torch.topk`` on an int64 key that packs the
order-preserving bits of the score above the complemented position, so ties cannot occur and
the lower position wins.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dsv4_backend.kernels._common import (
    IDX_ROW_BYTES, check_device, dot_dtype, e4m3_decode, exp2_int, native, page_geometry, pow2_scale_exp,
)
from dsv4_backend.kernels import pdl
from dsv4_backend.kernels.pdl import wait as pdl_wait


class IndexerConfig(NamedTuple):
    block_n: int = 64  # rows per tensor-core product (one page when 64)
    num_warps: int = 4
    num_stages: int = 2
    # rows per program; None: the power of two nearest above b L / (12 SMs), 8 tiles to 4096 rows:
    # on the H200 (probe_indexer.py, fp16 products) 15.4 against 17.3 us at 1 x 1M (512 rows against
    # 256), 31.1 against 43.1 us at 17 x 128K (512 against 320), 60.0 against 67.2 at 39 x 128K
    chunk: int | None = None
    tma: bool = True  # page-table lists: one bulk tensor copy per page (needs block_n == P)
    # bulk-copy kernel: page ids read this many at a time (None: 4 for bf16 products, where it
    # kept more copies in flight, 51% -> 59% of copy bandwidth on the H200; 1 for FP8, where 4
    # measured slower)
    group: int | None = None
    # tensor-core input type of the exact (non-FP8) products: "bf16", or "f16": each head's q is
    # divided by a power of two 2^k (its FP8 rule's scale: q / 2^k are then e4m3 values) and 2^k
    # moves into the head weight, so both operands are exact in fp16 and e4m3 -> fp16 is one
    # conversion per two codes, where e4m3 -> bf16 takes several instructions
    products: str = "f16"


class IndexerTopK(NamedTuple):
    rows: torch.Tensor  # int32 [b, k]: physical C4 row ids, best first, -1 padded
    scores: torch.Tensor  # fp32 [b, L]: every list position's score, -inf where not visible


@triton.jit
def _load_queries(q_ptr, q_sb, q_sh, w_ptr, w_sb, qs_ptr, b, H: tl.constexpr, BLOCK_H: tl.constexpr,
                  Q_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, Q_POW2: tl.constexpr):
    """Request ``b``'s heads: q [BLOCK_H, 128] (e4m3 bits seen as FP8, or DOT_DTYPE) and the
    fp32 head weights [BLOCK_H] (times q's per-head scale for FP8); padded heads are zero.
    Q_POW2: q / 2^k and w 2^k per head, 2^k = q's FP8 scale (exact: powers of two)."""
    hh = tl.arange(0, BLOCK_H)
    hmask = hh < H
    d = tl.arange(0, 128)
    w = tl.load(w_ptr + b * w_sb + hh, mask=hmask, other=0.0).to(tl.float32)
    if Q_FP8:
        q = tl.load(q_ptr + b * q_sb + hh[:, None] * q_sh + d[None, :], mask=hmask[:, None], other=0)
        q = q.to(tl.float8e4nv, bitcast=True)
        w = w * tl.load(qs_ptr + b * H + hh, mask=hmask, other=0.0)
    else:
        q = tl.load(q_ptr + b * q_sb + hh[:, None] * q_sh + d[None, :], mask=hmask[:, None], other=0.0)
        if Q_POW2:
            q = q.to(tl.float32)
            k = pow2_scale_exp(tl.max(tl.abs(q), axis=1))
            q = q * exp2_int(-k)[:, None]
            w = w * exp2_int(k)
        q = q.to(DOT_DTYPE)
    return q, w


@triton.jit
def _indexer_scores_kernel(
        q_ptr, q_sb, q_sh, w_ptr, w_sb, qs_ptr,
        pool_ptr, P, page_stride, ids_ptr, ids_sb, nvis_ptr, L,
        score_ptr, score_sb, chunk,
        H: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        USE_TABLE: tl.constexpr, Q_FP8: tl.constexpr, NATIVE: tl.constexpr,
        DOT_DTYPE: tl.constexpr, Q_POW2: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    b = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * chunk
    q, w = _load_queries(q_ptr, q_sb, q_sh, w_ptr, w_sb, qs_ptr, b, H, BLOCK_H, Q_FP8, DOT_DTYPE, Q_POW2)
    d = tl.arange(0, 128)
    if USE_TABLE:
        n_valid = tl.load(nvis_ptr + b)
    else:
        n_valid = L
    end = tl.minimum(c0 + chunk, L)
    for j0 in range(c0, end, BLOCK_N):
        jn = j0 + tl.arange(0, BLOCK_N)
        in_list = jn < end
        if USE_TABLE:
            valid = in_list & (jn < n_valid)
            page = tl.load(ids_ptr + b * ids_sb + jn // P, mask=valid, other=0).to(tl.int64)
            row = page * P + jn % P
        else:
            row = tl.load(ids_ptr + b * ids_sb + jn, mask=in_list, other=-1).to(tl.int64)
            valid = row >= 0
        r = tl.maximum(row, 0)
        base = (r // P) * page_stride
        off = r % P
        codes = tl.load(pool_ptr + (base + off * 128)[:, None] + d[None, :], mask=valid[:, None], other=0)
        sbyte = pool_ptr + base + P * 128 + off * 4
        if NATIVE:
            kscale = tl.load(sbyte.to(tl.pointer_type(tl.float32)), mask=valid, other=0.0)
        else:
            b0 = tl.load(sbyte, mask=valid, other=0).to(tl.int32)
            b1 = tl.load(sbyte + 1, mask=valid, other=0).to(tl.int32)
            b2 = tl.load(sbyte + 2, mask=valid, other=0).to(tl.int32)
            b3 = tl.load(sbyte + 3, mask=valid, other=0).to(tl.int32)
            kscale = (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)
        if Q_FP8:
            k = codes.to(tl.float8e4nv, bitcast=True)
        else:
            k = e4m3_decode(codes, NATIVE).to(DOT_DTYPE)
        logits = tl.dot(k, tl.trans(q))  # [BLOCK_N, BLOCK_H]
        s = tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1) * kscale
        s = tl.where(valid, s, float("-inf"))
        tl.store(score_ptr + b * score_sb + jn, s, mask=in_list)


@triton.jit
def _indexer_paged_kernel(
        q_ptr, q_sb, q_sh, w_ptr, w_sb, qs_ptr,
        codes, scales, table_ptr, table_sb, nvis_ptr, L,
        score_ptr, score_sb, pages_per_prog,
        H: tl.constexpr, BLOCK_H: tl.constexpr, P: tl.constexpr, PAGE_ROWS_2D: tl.constexpr,
        Q_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, NUM_STAGES: tl.constexpr, GROUP: tl.constexpr,
        Q_POW2: tl.constexpr, PDL: tl.constexpr):
    """One program per (request, run of ``pages_per_prog`` table entries). A page is two
    tensor-memory-accelerator copies straight into shared memory, pipelined NUM_STAGES deep:
    its [P, 128] codes (``codes``: the pool seen as [pages * PAGE_ROWS_2D, 128] e4m3) and the P
    fp32 scales that follow them (``scales``: the pool seen as fp32 [pages, 33 P])."""
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    b = tl.program_id(0).to(tl.int64)
    g0 = tl.program_id(1) * pages_per_prog
    q, w = _load_queries(q_ptr, q_sb, q_sh, w_ptr, w_sb, qs_ptr, b, H, BLOCK_H, Q_FP8, DOT_DTYPE, Q_POW2)
    n_valid = tl.minimum(tl.load(nvis_ptr + b), L)
    g_end = tl.minimum(g0 + pages_per_prog, tl.cdiv(L, P))
    g_vis = tl.minimum(g_end, tl.cdiv(n_valid, P))  # pages holding at least one visible row
    r = tl.arange(0, P)
    table = table_ptr + b * table_sb
    if GROUP == 1:
        for g in tl.range(g0, g_vis, num_stages=NUM_STAGES):
            page = tl.load(table + g).to(tl.int32)
            tile = codes.load([page * PAGE_ROWS_2D, 0])  # [P, 128] e4m3
            kscale = tl.reshape(scales.load([page, P * 32]), (P,))
            s = _page_scores(tile, q, w, kscale, Q_FP8, DOT_DTYPE)
            jn = g * P + r
            tl.store(score_ptr + b * score_sb + jn, tl.where(jn < n_valid, s, float("-inf")), mask=jn < L)
    else:  # GROUP page ids in one load, so that no copy waits on a page-id load of its own
        gi = tl.arange(0, GROUP)
        for gg in tl.range(g0, g_vis, GROUP, num_stages=NUM_STAGES):
            ids = tl.load(table + gg + gi, mask=gg + gi < g_vis, other=0).to(tl.int32)
            for i in tl.static_range(GROUP):
                page = tl.sum(tl.where(gi == i, ids, 0), axis=0)
                tile = codes.load([page * PAGE_ROWS_2D, 0])
                kscale = tl.reshape(scales.load([page, P * 32]), (P,))
                s = _page_scores(tile, q, w, kscale, Q_FP8, DOT_DTYPE)
                jn = (gg + i) * P + r
                tl.store(score_ptr + b * score_sb + jn, tl.where(jn < n_valid, s, float("-inf")),
                         mask=(jn < L) & (gg + i < g_vis))
    for g in range(tl.maximum(g_vis, g0), g_end):  # list positions past the visible pages
        jn = g * P + r
        tl.store(score_ptr + b * score_sb + jn, tl.full([P], float("-inf"), tl.float32), mask=jn < L)


@triton.jit
def _page_scores(tile, q, w, kscale, Q_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """sum_h w_h relu(q_h . K_j) * scale_j for the P rows of one page: fp32 [P]."""
    if Q_FP8:  # Hopper accumulates the 128-deep FP8 product with ~14 mantissa bits
        logits = tl.dot(tile, tl.trans(q))  # [P, BLOCK_H]
    else:
        logits = tl.dot(tile.to(DOT_DTYPE), tl.trans(q))
    return tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1) * kscale


def _tma_ok(pool: torch.Tensor, P: int, block_n: int) -> bool:
    """A page's codes are one [P, 128] box of the pool seen as rows of 128 bytes: the page must
    be a whole number of such rows, the pool dense and 16-byte aligned, one page per tile."""
    return (block_n == P and (P * IDX_ROW_BYTES) % 128 == 0 and pool.is_contiguous()
            and pool.data_ptr() % 16 == 0 and P <= 256)


def _fp8_heads(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, H, 128] of FP8-rounded values -> (e4m3 bits uint8, fp32 per-head scale [b, H])."""
    from memory.quant import indexer_quantize
    qq = indexer_quantize(q.float())
    return qq.values.contiguous(), qq.scale.contiguous()


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, *,
                   row_ids: torch.Tensor | None = None, page_table: torch.Tensor | None = None,
                   num_visible: torch.Tensor | None = None, max_len: int | None = None,
                   q_fp8: bool = False, config: IndexerConfig = IndexerConfig()) -> torch.Tensor:
    """Scores fp32 [b, L] (-inf where not visible).

    q: [b, H, 128] RoPE'd, Hadamard-rotated and FP8-rounded indexer queries; weights: fp32
    [b, H] head weights (w = weights_proj(x) * 128^-0.5 * H^-0.5); pool: uint8
    [pages, P * 132]. Rows by ``row_ids`` int [b, L], or by ``page_table`` int [b, pages] +
    ``num_visible`` int [b] (L = ``max_len``, default pages * P).
    q_fp8: run the products on FP8 tensor cores (GPU only; q re-encoded per head, exact
    inputs; Hopper keeps ~14 mantissa bits of each 128-deep sum, so a score may differ by up
    to ~2^-16 of the magnitudes summed, sum_h |w_h| (|q_h| . |K|) x scale).
    Otherwise the products are exact on the tensor cores and summed in fp32, in fp16
    (``config.products="f16"``, the default: q over its power-of-two FP8 scale, exact in fp16 for
    the FP8-rounded q the model passes) or in bf16; both give the same scores.
    """
    b, H, dim = q.shape
    if dim != 128:
        raise ValueError(f"indexer q must be [b, H, 128], got {tuple(q.shape)}")
    if weights.shape != (b, H):
        raise ValueError(f"weights must be [b={b}, H={H}], got {tuple(weights.shape)}")
    P, page_stride = page_geometry(pool, IDX_ROW_BYTES, "indexer")
    use_table = page_table is not None
    if use_table == (row_ids is not None):
        raise ValueError("give exactly one of row_ids or page_table (+ num_visible)")
    if use_table:
        if num_visible is None or num_visible.shape != (b,):
            raise ValueError("page_table needs num_visible [b]")
        ids = page_table.to(torch.int32).contiguous()
        L = max_len if max_len is not None else ids.shape[1] * P
        nvis = num_visible.to(torch.int32).contiguous()
    else:
        ids = row_ids.to(torch.int32).contiguous()
        L = ids.shape[1]
        nvis = ids  # unused
    check_device(q, weights, pool, ids)
    scores = torch.empty(b, max(L, 1), dtype=torch.float32, device=q.device)[:, :L]
    if L == 0 or b == 0:
        return scores
    weights = weights.float().contiguous()
    if q_fp8:
        if not native():
            raise RuntimeError("the FP8 tensor-core path needs a GPU")
        qv, qs = _fp8_heads(q)
    else:
        qv, qs = q.to(dot_dtype()).contiguous(), weights
    if config.products not in ("bf16", "f16"):
        raise ValueError(f"IndexerConfig.products must be 'bf16' or 'f16', got {config.products!r}")
    q_pow2 = config.products == "f16" and not q_fp8
    dt = tl.float32 if dot_dtype() == torch.float32 else tl.float16 if q_pow2 else tl.bfloat16
    block_n = config.block_n
    chunk = config.chunk
    if chunk is None:   # about 12 programs per SM, each at least 8 tiles (bench/probe_indexer.py)
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        chunk = min(4096, max(8 * block_n, triton.next_power_of_2(triton.cdiv(b * L, 12 * sms))))
    chunk = triton.cdiv(chunk, block_n) * block_n
    H_block = max(16, triton.next_power_of_2(H))
    if use_table and config.tma and _tma_ok(pool, P, block_n):
        codes = TensorDescriptor.from_tensor(pool.view(torch.float8_e4m3fn).view(-1, 128), [P, 128])
        scales = TensorDescriptor.from_tensor(pool.view(torch.float32), [1, P])
        _indexer_paged_kernel[(b, triton.cdiv(L, chunk))](
            qv, qv.stride(0), qv.stride(1), weights, weights.stride(0), qs,
            codes, scales, ids, ids.stride(0), nvis, L,
            scores, scores.stride(0), chunk // P,
            H=H, BLOCK_H=H_block, P=P, PAGE_ROWS_2D=page_stride // 128, Q_FP8=q_fp8,
            DOT_DTYPE=dt, NUM_STAGES=config.num_stages,
            GROUP=config.group or (1 if q_fp8 else 4), Q_POW2=q_pow2, num_warps=config.num_warps, **pdl.args(qv.device))
        return scores
    _indexer_scores_kernel[(b, triton.cdiv(L, chunk))](
        qv, qv.stride(0), qv.stride(1), weights, weights.stride(0), qs,
        pool, P, page_stride, ids, ids.stride(0), nvis, L,
        scores, scores.stride(0), chunk,
        H=H, BLOCK_H=H_block, BLOCK_N=block_n,
        USE_TABLE=use_table, Q_FP8=q_fp8, NATIVE=native(), DOT_DTYPE=dt, Q_POW2=q_pow2,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.args(qv.device))
    return scores


@triton.jit(do_not_specialize=["kk", "k"])
def _rows_kernel(top_ptr, top_sb, kk, score_ptr, score_sb, map_ptr, map_sb, P, out_ptr, k,
                 USE_TABLE: tl.constexpr, BLOCK: tl.constexpr):
    """List positions ``top [b, kk]`` -> physical row ids int32 ``[b, k]``: -1 where the score is
    -inf (not visible) and past kk; through the page table or the row ids."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    have = j < kk
    p = tl.load(top_ptr + b * top_sb + j, mask=have, other=0)
    s = tl.load(score_ptr + b * score_sb + p, mask=have, other=float("-inf"))
    vis = have & (s > float("-inf"))
    if USE_TABLE:
        page = tl.load(map_ptr + b * map_sb + p // P, mask=vis, other=0).to(tl.int64)
        row = page * P + p % P
    else:
        row = tl.load(map_ptr + b * map_sb + p, mask=vis, other=-1).to(tl.int64)
    tl.store(out_ptr + b * k + j, tl.where(vis, row, -1).to(tl.int32), mask=j < k)


def topk_rows(scores: torch.Tensor, k: int, *, row_ids: torch.Tensor | None = None,
              page_table: torch.Tensor | None = None, page_size: int = 64) -> torch.Tensor:
    """The best ``min(k, visible)`` positions of ``scores [b, L]`` as physical row ids int32
    [b, k], best first, -1 padded; equal scores go to the lower position. Where the top-k
    kernels run, positions become rows in one launch (``_rows_kernel``)."""
    from dsv4_backend.kernels.topk import kernels_wanted, topk_positions

    b, L = scores.shape
    kk = min(k, L)
    if kernels_wanted(scores) and b > 0 and kk > 0:
        top = topk_positions(scores, kk)  # [b, kk] positions, same as the torch.topk below
        rows = torch.empty(b, k, dtype=torch.int32, device=scores.device)
        mapping = (page_table if row_ids is None else row_ids).contiguous()
        scores = scores.contiguous()
        block = min(1024, triton.next_power_of_2(k))
        _rows_kernel[(b, triton.cdiv(k, block))](
            top, top.stride(0), kk, scores, scores.stride(0), mapping, mapping.stride(0), page_size,
            rows, k, USE_TABLE=row_ids is None, BLOCK=block, num_warps=4)
        return rows
    bits = scores.contiguous().view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # int32 order == float order
    pos = torch.arange(L, device=scores.device, dtype=torch.int64)
    key = (ordered.to(torch.int64) << 32) | (0xFFFFFFFF - pos)[None, :]
    top = torch.topk(key, kk, dim=1).indices  # [b, kk] positions
    visible = torch.gather(scores, 1, top) > float("-inf")
    if row_ids is not None:
        rows = torch.gather(row_ids.long(), 1, top)
    else:
        page = torch.gather(page_table.long(), 1, top // page_size)
        rows = page * page_size + top % page_size
    rows = rows.masked_fill(~visible, -1).to(torch.int32)
    if kk < k:
        rows = torch.cat([rows, rows.new_full((b, k - kk), -1)], dim=1)
    return rows


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, k: int, *,
                 row_ids: torch.Tensor | None = None, page_table: torch.Tensor | None = None,
                 num_visible: torch.Tensor | None = None, max_len: int | None = None,
                 q_fp8: bool = False, config: IndexerConfig = IndexerConfig()) -> IndexerTopK:
    """Scores then top-k: see :func:`indexer_scores` and :func:`topk_rows`."""
    scores = indexer_scores(q, weights, pool, row_ids=row_ids, page_table=page_table,
                            num_visible=num_visible, max_len=max_len, q_fp8=q_fp8, config=config)
    P, _ = page_geometry(pool, IDX_ROW_BYTES, "indexer")
    rows = topk_rows(scores, k, row_ids=row_ids, page_table=page_table, page_size=P)
    return IndexerTopK(rows, scores)
