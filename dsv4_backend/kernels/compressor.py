"""Compressor: softmax pooling of a block's raw (C, Z) into one compressed row.

Completion events come as a list: each has a destination row (C4 / C128 / indexer pool) and
K candidate sources, indices into a state buffer ``[slots, 2 * coff * d]`` whose rows are
``[C (coff*d) | Z (coff*d)]`` (fp32 or bf16). Candidate j adds ``ape[j % m]`` to its score;
for m = 4 (coff = 2, K = 8) candidates 0..3 are the previous block's tokens and use channels
[0:d] (the b-half) of C, Z and ape, candidates 4..7 this block's tokens with channels [d:2d]
(the a-half); -1 masks a candidate (the first block has no previous one). For m = 128
(coff = 1, K = 128) every candidate uses all channels. Pooling is a per-channel softmax over
the candidates (fp32), then the row is normalised, rotated at the block's first position,
(Hadamard-rotated for the indexer,) quantised and written.

Launches:
- m = 4 (attention and indexer rows): one fused kernel, ``FusedCompressConfig.events`` events
  per program (one per program for small batches); each event's 8 candidates are pooled over
  all d channels at once and the row is finished in registers (no fp32 intermediate in
  memory, one launch per compression): the decode steps that complete blocks are
  launch-latency bound, so one launch fewer counts;
- m = 128: ``_pool_kernel``, one program per (event, ``CompressConfig.block_d`` channels), an
  online softmax over chunks of ``kc`` candidates -> fp32 [E, d]; then ``kv_store.finish_rows``.
  128 candidates x 512 channels is too much serial work for one program per event.
Both paths run the same chunk update (``_pool_step``) and the same finish helpers
(``kv_store.finish_attention_rows`` / ``finish_indexer_row``).

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

from dsv4_backend.kernels._common import check_device, native, round_bf16
from dsv4_backend.kernels.kv_store import (
    FinishConfig, any_written, finish_attention_rows, finish_indexer_row, finish_rows, load_hadamard,
    load_norm_weight, pool_args, sm_count,
)
from dsv4_backend.kernels import pdl
from dsv4_backend.kernels.pdl import wait as pdl_wait


class CompressEvents(NamedTuple):
    """Blocks completed in this step (one entry per event)."""
    dest_rows: torch.Tensor  # int [E]: row to write in the C4 / C128 / indexer pool
    sources: torch.Tensor  # int [E, K]: state-buffer slots of the candidates, -1 = masked
    cos: torch.Tensor  # fp32 [E, 32]: RoPE at the block's first position
    sin: torch.Tensor  # fp32 [E, 32]


class CompressConfig(NamedTuple):
    """Launch shape of the pooling kernel (the two-kernel path: C128)."""
    block_d: int = 128  # channels per program
    kc: int = 16  # candidates per online-softmax chunk (C4 uses its 8 in one chunk)
    num_warps: int = 4
    num_stages: int = 0  # 0: the chunk loop is unrolled; >= 1: a pipelined loop of that depth


class FusedCompressConfig(NamedTuple):
    """Launch shape of the fused C4 kernel."""
    # events per program (one after another: amortises the per-program loads of ape, the norm
    # weight and the 64 KB Hadamard matrix); taken only when there are at least events x SMs
    # events, so small (decode) batches keep one event per program
    events: int = 1
    num_warps: int = 4


POOL_DEFAULT = CompressConfig(64, 16, 2, 3)  # fastest on the H200 at 128 and 512 events
FUSED_DEFAULT = FusedCompressConfig(1, 4)  # attention rows, d = 512
FUSED_INDEXER_DEFAULT = FusedCompressConfig(2, 4)  # indexer rows: 2.3x faster than (1, 8) on the H200
# compress_c4_pair launches both defaults' programs together, so they share a warp count
assert FUSED_DEFAULT.num_warps == FUSED_INDEXER_DEFAULT.num_warps


@triton.jit
def _pool_step(m, s, acc, c, z):
    """One chunk of the online softmax over candidates (axis 0 of c and z, fp32 [KC, ...];
    z is -inf at masked candidates). Returns the new (max, sum, acc)."""
    m_new = tl.maximum(m, tl.max(z, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(z - tl.expand_dims(m_safe, 0))
    alpha = tl.exp(m - m_safe)
    s = s * alpha + tl.sum(p, axis=0)
    acc = acc * alpha + tl.sum(p * c, axis=0)
    return m_new, s, acc


@triton.jit
def _pool_chunk(m, s, acc, k0, e, ch, state_ptr, state_stride, src_ptr, src_stride,
                ape_ptr, ape_stride, RATIO: tl.constexpr, D: tl.constexpr, COFF: tl.constexpr,
                KC: tl.constexpr):
    j = k0 + tl.arange(0, KC)
    src = tl.load(src_ptr + e * src_stride + j).to(tl.int64)
    valid = src >= 0
    if COFF == 2:
        col = (j >= RATIO).to(tl.int32)[:, None] * D + ch[None, :]
    else:
        col = tl.zeros([KC], tl.int32)[:, None] + ch[None, :]
    row = state_ptr + tl.maximum(src, 0)[:, None] * state_stride
    c = tl.load(row + col, mask=valid[:, None], other=0.0).to(tl.float32)
    z = tl.load(row + COFF * D + col, mask=valid[:, None], other=0.0).to(tl.float32)
    z += tl.load(ape_ptr + (j % RATIO)[:, None] * ape_stride + col).to(tl.float32)
    z = tl.where(valid[:, None], z, float("-inf"))
    return _pool_step(m, s, acc, c, z)


@triton.jit
def _pool_kernel(state_ptr, state_stride, src_ptr, src_stride, ape_ptr, ape_stride,
                 out_ptr, out_stride, dest_ptr,
                 K: tl.constexpr, RATIO: tl.constexpr, D: tl.constexpr, COFF: tl.constexpr,
                 KC: tl.constexpr, BLOCK_D: tl.constexpr, SKIP: tl.constexpr,
                 NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    e = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = e >= 0
    if SKIP:  # a masked event (destination < 0) is never written: its program does no work
        live = tl.load(dest_ptr + e) >= 0
    if live:   # (a decode graph lists every request; most steps complete no C128 block)
        m = tl.full([BLOCK_D], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_D], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        if NUM_STAGES == 0:
            for k0 in tl.static_range(0, K, KC):
                m, s, acc = _pool_chunk(m, s, acc, k0, e, ch, state_ptr, state_stride, src_ptr,
                                        src_stride, ape_ptr, ape_stride, RATIO, D, COFF, KC)
        else:
            for k0 in tl.range(0, K, KC, num_stages=NUM_STAGES):
                m, s, acc = _pool_chunk(m, s, acc, k0, e, ch, state_ptr, state_stride, src_ptr,
                                        src_stride, ape_ptr, ape_stride, RATIO, D, COFF, KC)
        tl.store(out_ptr + e * out_stride + ch, acc / s, mask=ch < D)


def _check_pool_args(state, sources, ape, ratio, d) -> int:
    """Validates the pooling inputs; returns K."""
    if ratio not in (4, 128):
        raise ValueError(f"compress ratio must be 4 or 128, got {ratio}")
    coff = 2 if ratio == 4 else 1
    k = sources.shape[1]
    if k != coff * ratio:
        raise ValueError(f"ratio {ratio} takes {coff * ratio} candidates per event, got {k}")
    if state.dim() != 2 or state.shape[1] != 2 * coff * d or state.stride(1) != 1:
        raise ValueError(f"state must be [slots, {2 * coff * d}], got {tuple(state.shape)}")
    if ape.shape != (ratio, coff * d):
        raise ValueError(f"ape must be [{ratio}, {coff * d}], got {tuple(ape.shape)}")
    check_device(state, sources, ape)
    return k


def compress_pool(state: torch.Tensor, sources: torch.Tensor, ape: torch.Tensor, ratio: int,
                  d: int, dest_rows: torch.Tensor | None = None,
                  config: CompressConfig | None = None) -> torch.Tensor:
    """Pooled rows fp32 [E, d] (see the module docstring for the candidate layout).

    With ``dest_rows`` [E], events whose destination is < 0 are skipped (their rows are left
    unwritten): a CUDA-graph decode step lists every request as an event and masks the
    ones that complete no block this step. ``config``: launch shape (default POOL_DEFAULT)."""
    k = _check_pool_args(state, sources, ape, ratio, d)
    coff = 2 if ratio == 4 else 1
    e = sources.shape[0]
    cfg = config or POOL_DEFAULT
    out = torch.empty(e, d, dtype=torch.float32, device=state.device)
    if e == 0:
        return out
    if d % cfg.block_d or k % min(cfg.kc, k):
        raise ValueError(f"config {cfg}: block_d must divide d = {d} and kc must divide K = {k}")
    sources = sources.to(torch.int32).contiguous()
    ape = ape.float().contiguous()
    _pool_kernel[(e, d // cfg.block_d)](
        state, state.stride(0), sources, sources.stride(0), ape, ape.stride(0), out, out.stride(0),
        dest_rows if dest_rows is not None else sources,
        K=k, RATIO=ratio, D=d, COFF=coff, KC=min(cfg.kc, k), BLOCK_D=cfg.block_d,
        SKIP=dest_rows is not None, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps, **pdl.args(state.device))
    return out


# ---- fused C4: pool + finish, one launch ----------------------------------------------------

@triton.jit
def _fused_c4_kernel(state_ptr, state_stride, src_ptr, src_stride, ape_ptr, ape_stride,
                     w_ptr, cos_ptr, sin_ptr, cs_stride, dest_ptr, E,
                     pool_ptr, P, page_stride, had_ptr, out_ptr, out_stride, eps,
                     D: tl.constexpr, NT: tl.constexpr, EVENTS: tl.constexpr,
                     ROUND_BF16: tl.constexpr, INDEXER: tl.constexpr, WRITE_OUT: tl.constexpr,
                     NATIVE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    first = tl.program_id(0).to(tl.int64) * EVENTS
    if any_written(dest_ptr, first, E, EVENTS):   # else no event of mine completes a block: no work
        _fused_c4_events(state_ptr, state_stride, src_ptr, src_stride, ape_ptr, ape_stride, w_ptr, cos_ptr,
                         sin_ptr, cs_stride, dest_ptr, E, pool_ptr, P, page_stride, had_ptr, out_ptr, out_stride,
                         eps, first, D, NT, EVENTS, ROUND_BF16, INDEXER, WRITE_OUT, NATIVE)


@triton.jit
def _fused_c4_events(state_ptr, state_stride, src_ptr, src_stride, ape_ptr, ape_stride,
                     w_ptr, cos_ptr, sin_ptr, cs_stride, dest_ptr, E,
                     pool_ptr, P, page_stride, had_ptr, out_ptr, out_stride, eps, first,
                     D: tl.constexpr, NT: tl.constexpr, EVENTS: tl.constexpr,
                     ROUND_BF16: tl.constexpr, INDEXER: tl.constexpr, WRITE_OUT: tl.constexpr,
                     NATIVE: tl.constexpr):
    # channels in the layout the finish helpers take: nope tiles flattened [NT * 64] (the tail tile
    # masked off), rope even / odd [32]; candidates on axis 0
    j = tl.arange(0, 8)
    i = tl.arange(0, 32)
    chn = tl.arange(0, NT * 64)
    cmask = (chn < D - 64)[None, :]
    half = (j >= 4).to(tl.int32)[:, None] * D  # previous block: [0:d], this block: [d:2d]
    col_n = half + chn[None, :]
    col_e = half + (D - 64 + 2 * i)[None, :]
    col_o = col_e + 1
    # per-program set-up, shared by its events: ape rows, the norm weight, the Hadamard matrix
    ape_row = ape_ptr + (j % 4)[:, None] * ape_stride
    ape_n = tl.load(ape_row + col_n, mask=cmask, other=0.0).to(tl.float32)
    ape_e = tl.load(ape_row + col_e).to(tl.float32)
    ape_o = tl.load(ape_row + col_o).to(tl.float32)
    wn, we, wo = load_norm_weight(w_ptr, D, NT)
    h_nope, h_even, h_odd = load_hadamard(had_ptr, INDEXER)
    for ee in tl.static_range(EVENTS):
        e = first + ee
        dest = tl.load(dest_ptr + e, mask=e < E, other=-1).to(tl.int64)
        live = dest >= 0
        src = tl.load(src_ptr + e * src_stride + j, mask=live, other=-1).to(tl.int64)
        valid = (src >= 0)[:, None]
        row = state_ptr + tl.maximum(src, 0)[:, None] * state_stride
        x = _pool_c4(row, col_n, valid & cmask, valid, ape_n, 2 * D, NT * 64)
        xe = _pool_c4(row, col_e, valid, valid, ape_e, 2 * D, 32)
        xo = _pool_c4(row, col_o, valid, valid, ape_o, 2 * D, 32)
        x = tl.where(chn < D - 64, x, 0.0)
        cos = tl.load(cos_ptr + e * cs_stride + i, mask=live, other=0.0)
        sin = tl.load(sin_ptr + e * cs_stride + i, mask=live, other=0.0)
        if INDEXER:
            finish_indexer_row(tl.reshape(x, [NT, 64]), xe, xo, wn, we, wo, cos, sin, dest, live,
                               pool_ptr, P, page_stride, h_nope, h_even, h_odd,
                               out_ptr + e * out_stride, eps, ROUND_BF16, ROUND_BF16, WRITE_OUT, NATIVE)
        else:  # the finish kernel's [rows, 8, 64] form with one row
            one = tl.zeros([1], tl.int64)
            finish_attention_rows(tl.reshape(x, [1, NT, 64]), tl.expand_dims(xe, 0),
                                  tl.expand_dims(xo, 0), wn, we, wo, tl.expand_dims(cos, 0),
                                  tl.expand_dims(sin, 0), one + dest, (one + dest) >= 0, pool_ptr,
                                  P, page_stride, out_ptr + e * out_stride + one, eps,
                                  ROUND_BF16, ROUND_BF16, WRITE_OUT, NATIVE)


def _check_c4(pool: torch.Tensor, events: CompressEvents, state: torch.Tensor, ape: torch.Tensor,
              norm_weight: torch.Tensor, hadamard: torch.Tensor | None) -> int:
    """A fused C4 launch's arguments checked against its events; -> d (128 with a Hadamard matrix:
    the indexer's rows, else 512)."""
    d = 128 if hadamard is not None else 512
    _check_pool_args(state, events.sources, ape, 4, d)
    e = events.sources.shape[0]
    if events.dest_rows.shape != (e,) or events.cos.shape != (e, 32) or events.sin.shape != (e, 32):
        raise ValueError(f"dest_rows [E] and cos/sin [E, 32] expected for E={e}; got "
                         f"{tuple(events.dest_rows.shape)}, {tuple(events.cos.shape)}, "
                         f"{tuple(events.sin.shape)}")
    if norm_weight.shape != (d,):
        raise ValueError(f"norm_weight must be [{d}], got {tuple(norm_weight.shape)}")
    check_device(pool, events.dest_rows, state, norm_weight, events.cos, events.sin)
    return d


def _events_per_program(cfg: FusedCompressConfig, e: int, device: torch.device) -> int:
    """``cfg.events`` where there are that many events for every SM, else one (small batches)."""
    return cfg.events if e >= cfg.events * sm_count(device) else 1


@triton.jit
def _pool_c4(row, col, mask, valid, ape, Z_OFF: tl.constexpr, N: tl.constexpr):
    """Softmax pooling of one event's 8 candidates at channels ``col`` [8, N] -> fp32 [N]: the
    pooling kernel's single chunk (same operations, same order)."""
    c = tl.load(row + col, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(row + Z_OFF + col, mask=mask, other=0.0).to(tl.float32)
    z += ape
    z = tl.where(valid, z, float("-inf"))
    m = tl.full([N], float("-inf"), tl.float32)
    s = tl.zeros([N], tl.float32)
    acc = tl.zeros([N], tl.float32)
    m, s, acc = _pool_step(m, s, acc, c, z)
    return acc / s


def compress_c4_fused(pool: torch.Tensor, events: CompressEvents, state: torch.Tensor,
                      ape: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-6,
                      round_bf16: bool = True, hadamard: torch.Tensor | None = None,
                      out: torch.Tensor | None = None,
                      config: FusedCompressConfig | None = None) -> torch.Tensor | None:
    """``compress`` for ratio 4 in one launch (same arguments). The same operations in the same
    order as the two-kernel path, so the same bytes (bit for bit under the interpreter; on a GPU
    the compiler's reduction trees follow each kernel's layout and may round differently)."""
    indexer = hadamard is not None
    d = _check_c4(pool, events, state, ape, norm_weight, hadamard)
    P, page_stride, had = pool_args(pool, hadamard, norm_weight)
    cfg = config or (FUSED_INDEXER_DEFAULT if indexer else FUSED_DEFAULT)
    e = events.sources.shape[0]
    if e == 0:
        return out
    sources = events.sources.to(torch.int32).contiguous()
    ape = ape.float().contiguous()
    out_arg = out if out is not None else state
    per_program = _events_per_program(cfg, e, state.device)
    _fused_c4_kernel[(triton.cdiv(e, per_program),)](
        state, state.stride(0), sources, sources.stride(0), ape, ape.stride(0),
        norm_weight.contiguous(), events.cos.float().contiguous(), events.sin.float().contiguous(), 32,
        events.dest_rows.contiguous(), e, pool, P, page_stride, had, out_arg, out_arg.stride(0), eps,
        D=d, NT=8 if d == 512 else 2, EVENTS=per_program, ROUND_BF16=round_bf16, INDEXER=indexer,
        WRITE_OUT=out is not None, NATIVE=native(), num_warps=cfg.num_warps, **pdl.args(state.device))
    return out


# ---- a CSA layer's two C4 compressors in one launch ---------------------------------------------

class C4Target(NamedTuple):
    """One C4 compressor of a CSA layer: where its rows go and what it pools (``compress``'s
    arguments). ``hadamard`` given: the indexer's (d = 128), else the attention's (d = 512)."""
    pool: torch.Tensor
    state: torch.Tensor
    ape: torch.Tensor
    norm_weight: torch.Tensor
    hadamard: torch.Tensor | None = None


@triton.jit
def _fused_c4_pair_kernel(a_state, a_state_stride, a_ape, a_ape_stride, a_w, a_pool, a_P, a_page_stride,
                          b_state, b_state_stride, b_ape, b_ape_stride, b_w, b_pool, b_P, b_page_stride, b_had,
                          src_ptr, src_stride, cos_ptr, sin_ptr, cs_stride, dest_ptr, E, A_PROGRAMS, eps,
                          A_EVENTS: tl.constexpr, B_EVENTS: tl.constexpr, ROUND_BF16: tl.constexpr,
                          NATIVE: tl.constexpr, PDL: tl.constexpr):
    """Programs ``0 .. A_PROGRAMS - 1``: ``_fused_c4_kernel``'s attention programs (d = 512); the
    rest its indexer programs (d = 128): the same events, each program the code of its own launch."""
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    pid = tl.program_id(0)
    if pid < A_PROGRAMS:
        first = pid.to(tl.int64) * A_EVENTS
        if any_written(dest_ptr, first, E, A_EVENTS):
            _fused_c4_events(a_state, a_state_stride, src_ptr, src_stride, a_ape, a_ape_stride, a_w, cos_ptr,
                             sin_ptr, cs_stride, dest_ptr, E, a_pool, a_P, a_page_stride, a_w, a_state, 0,
                             eps, first, 512, 8, A_EVENTS, ROUND_BF16, False, False, NATIVE)
    else:
        first = (pid - A_PROGRAMS).to(tl.int64) * B_EVENTS
        if any_written(dest_ptr, first, E, B_EVENTS):
            _fused_c4_events(b_state, b_state_stride, src_ptr, src_stride, b_ape, b_ape_stride, b_w, cos_ptr,
                             sin_ptr, cs_stride, dest_ptr, E, b_pool, b_P, b_page_stride, b_had, b_state, 0,
                             eps, first, 128, 2, B_EVENTS, ROUND_BF16, True, False, NATIVE)


def compress_c4_pair(attention: C4Target, indexer: C4Target, events: CompressEvents, eps: float = 1e-6,
                     round_bf16: bool = True) -> None:
    """``compress`` of a CSA layer's attention and indexer compressors over the same events (one
    ring plan) in one launch: the programs and bytes of the two ``compress_c4_fused`` launches
    (their default launch shapes; no dequantised ``out``)."""
    if attention.hadamard is not None or indexer.hadamard is None:
        raise ValueError("compress_c4_pair: the attention target takes no Hadamard matrix, the indexer's does")
    for t in (attention, indexer):
        _check_c4(t.pool, events, t.state, t.ape, t.norm_weight, t.hadamard)
    e = events.sources.shape[0]
    if e == 0:
        return
    per = [_events_per_program(cfg, e, attention.state.device) for cfg in (FUSED_DEFAULT, FUSED_INDEXER_DEFAULT)]
    a_P, a_ps, _ = pool_args(attention.pool, None, attention.norm_weight)
    b_P, b_ps, b_had = pool_args(indexer.pool, indexer.hadamard, indexer.norm_weight)
    a_programs = triton.cdiv(e, per[0])
    a_ape, b_ape = attention.ape.float().contiguous(), indexer.ape.float().contiguous()
    sources = events.sources.to(torch.int32).contiguous()
    _fused_c4_pair_kernel[(a_programs + triton.cdiv(e, per[1]),)](
        attention.state, attention.state.stride(0), a_ape, a_ape.stride(0), attention.norm_weight.contiguous(),
        attention.pool, a_P, a_ps,
        indexer.state, indexer.state.stride(0), b_ape, b_ape.stride(0), indexer.norm_weight.contiguous(),
        indexer.pool, b_P, b_ps, b_had,
        sources, sources.stride(0), events.cos.float().contiguous(), events.sin.float().contiguous(), 32,
        events.dest_rows.contiguous(), e, a_programs, eps,
        A_EVENTS=per[0], B_EVENTS=per[1], ROUND_BF16=round_bf16, NATIVE=native(),
        num_warps=FUSED_DEFAULT.num_warps, **pdl.args(attention.state.device))


def compress(pool: torch.Tensor, events: CompressEvents, state: torch.Tensor, ape: torch.Tensor,
             norm_weight: torch.Tensor, ratio: int, eps: float = 1e-6, round_bf16: bool = True,
             hadamard: torch.Tensor | None = None, out: torch.Tensor | None = None,
             config: CompressConfig | None = None, finish_config: FinishConfig | None = None,
             fused_config: FusedCompressConfig | None = None, fuse: bool | None = None):
    """Pool, normalise, rotate, quantise and write one compressed row per event.

    pool: the C4 / C128 attention pool (uint8 [pages, 64 * 584]) or, with ``hadamard`` given
    ([128, 128] fp32, scaled Sylvester), the indexer pool (uint8 [pages, 64 * 132]);
    state: the ring ``[slots, 2 * coff * d]``; ape: fp32 [m, coff * d]; norm_weight: [d].
    ``out`` optionally receives the dequantised rows. Returns ``out``.
    ``fuse``: one fused launch (default: for ratio 4) or pool + finish (``config`` and
    ``finish_config`` set their launch shapes; ``fused_config`` the fused one's).
    """
    if fuse is None:
        fuse = ratio == 4
    if fuse:
        if ratio != 4:
            raise ValueError(f"the fused compressor handles ratio 4 only, got {ratio}")
        return compress_c4_fused(pool, events, state, ape, norm_weight, eps, round_bf16, hadamard,
                                 out, config=fused_config)
    d = 128 if hadamard is not None else 512
    pooled = compress_pool(state, events.sources, ape, ratio, d, dest_rows=events.dest_rows,
                           config=config)
    return finish_rows(pool, events.dest_rows, pooled, norm_weight, events.cos, events.sin, eps,
                       round_in=round_bf16, round_bf16=round_bf16, hadamard=hadamard, out=out,
                       config=finish_config)


# ---- ring writes ---------------------------------------------------------------------------

@triton.jit
def _ring_write_kernel(ring_ptr, ring_stride, slot_ptr, tok_ptr, c_ptr, c_stride, z_ptr, z_stride, N,
                       HAS_TOK: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    _ring_write_block(ring_ptr, ring_stride, slot_ptr, tok_ptr, c_ptr, c_stride, z_ptr, z_stride, N,
                      tl.program_id(1), HAS_TOK, BF16, BLOCK, NATIVE)


@triton.jit
def _ring_write_block(ring_ptr, ring_stride, slot_ptr, tok_ptr, c_ptr, c_stride, z_ptr, z_stride, N, block,
                      HAS_TOK: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr, NATIVE: tl.constexpr):
    """Columns ``block BLOCK ..`` of write ``program_id(0)``: its token's C and Z into its slot."""
    w = tl.program_id(0)
    col = block * BLOCK + tl.arange(0, BLOCK)
    ok = col < N
    if HAS_TOK:
        t = tl.load(tok_ptr + w).to(tl.int64)
    else:
        t = w.to(tl.int64)
    dest = ring_ptr + tl.load(slot_ptr + w).to(tl.int64) * ring_stride
    cv = tl.load(c_ptr + t * c_stride + col, mask=ok)
    zv = tl.load(z_ptr + t * z_stride + col, mask=ok)
    if BF16:    # nearest even (the interpreter's own cast truncates)
        cv, zv = round_bf16(cv.to(tl.float32), NATIVE), round_bf16(zv.to(tl.float32), NATIVE)
    ty = ring_ptr.dtype.element_ty
    tl.store(dest + col, cv.to(ty), mask=ok)
    tl.store(dest + N + col, zv.to(ty), mask=ok)


@triton.jit
def _ring_write_pair_kernel(a_ptr, a_stride, ac_ptr, ac_stride, az_ptr, az_stride, NA, A_BLOCKS,
                            b_ptr, b_stride, bc_ptr, bc_stride, bz_ptr, bz_stride, NB,
                            slot_ptr, tok_ptr, HAS_TOK: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr,
                            NATIVE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    block = tl.program_id(1)
    if block < A_BLOCKS:
        _ring_write_block(a_ptr, a_stride, slot_ptr, tok_ptr, ac_ptr, ac_stride, az_ptr, az_stride, NA, block,
                          HAS_TOK, BF16, BLOCK, NATIVE)
    else:
        _ring_write_block(b_ptr, b_stride, slot_ptr, tok_ptr, bc_ptr, bc_stride, bz_ptr, bz_stride, NB,
                          block - A_BLOCKS, HAS_TOK, BF16, BLOCK, NATIVE)


def _check_ring_write(ring: torch.Tensor, slots: torch.Tensor, c: torch.Tensor, z: torch.Tensor,
                      tokens: torch.Tensor | None) -> int:
    N = c.shape[-1]
    if c.dim() != 2 or z.shape != c.shape or c.stride(1) != 1 or z.stride(1) != 1:
        raise ValueError(f"ring_write: c, z must be [T, n] with unit column stride, got {tuple(c.shape)} "
                         f"{c.stride()} and {tuple(z.shape)} {z.stride()}")
    if ring.dim() != 2 or ring.shape[1] != 2 * N or ring.stride(1) != 1:
        raise ValueError(f"ring_write: ring must be [slots, {2 * N}], got {tuple(ring.shape)}")
    W = slots.numel()
    if (tokens.numel() if tokens is not None else c.shape[0]) != W:
        raise ValueError(f"ring_write: {W} slots for {c.shape[0] if tokens is None else tokens.numel()} tokens")
    check_device(ring, slots, c, z)
    return N


def ring_write_pair(rings: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor,
                    cs: tuple[torch.Tensor, torch.Tensor], zs: tuple[torch.Tensor, torch.Tensor],
                    tokens: torch.Tensor | None = None) -> None:
    """``ring_write`` into two rings of one dtype (a CSA layer's attention and indexer compressors)
    at the same slots, in one launch: the same programs' stores as two ``ring_write`` launches."""
    (ra, rb), (ca, cb), (za, zb) = rings, cs, zs
    na, nb = _check_ring_write(ra, slots, ca, za, tokens), _check_ring_write(rb, slots, cb, zb, tokens)
    if ra.dtype != rb.dtype:
        raise ValueError(f"ring_write_pair: rings of one dtype, got {ra.dtype} and {rb.dtype}")
    W = slots.numel()
    if W:
        block = min(1024, triton.next_power_of_2(max(na, nb)))
        a_blocks = triton.cdiv(na, block)
        _ring_write_pair_kernel[(W, a_blocks + triton.cdiv(nb, block))](
            ra, ra.stride(0), ca, ca.stride(0), za, za.stride(0), na, a_blocks,
            rb, rb.stride(0), cb, cb.stride(0), zb, zb.stride(0), nb,
            slots, tokens if tokens is not None else slots, HAS_TOK=tokens is not None,
            BF16=ra.dtype == torch.bfloat16, BLOCK=block, NATIVE=native(), num_warps=4, **pdl.args(ra.device))


def ring_write(ring: torch.Tensor, slots: torch.Tensor, c: torch.Tensor, z: torch.Tensor,
               tokens: torch.Tensor | None = None) -> None:
    """``ring[slots[w]] = [c[t] | z[t]]`` in the ring's dtype with ``t = tokens[w]`` (None: t = w):
    the tokens' raw (C, Z) into their ring slots in one launch, for the torch ops ``cat``,
    gather and ``index_put_`` (c, z may be column views of one stacked projection). Slots
    must be distinct (as a step's tokens' are); the cast rounds to nearest as ``Tensor.to``."""
    N = _check_ring_write(ring, slots, c, z, tokens)
    W = slots.numel()
    if W:
        block = min(1024, triton.next_power_of_2(N))
        _ring_write_kernel[(W, triton.cdiv(N, block))](
            ring, ring.stride(0), slots, tokens if tokens is not None else slots, c, c.stride(0), z, z.stride(0), N,
            HAS_TOK=tokens is not None, BF16=ring.dtype == torch.bfloat16, BLOCK=block, NATIVE=native(),
            num_warps=4, **pdl.args(ring.device))


# ---- online C128 ---------------------------------------------------------------------------

@triton.jit
def _online_kernel(state_ptr, slot_ptr, start_ptr, count_ptr, cz_ptr, cz_stride, pos_ptr,
                   ape_ptr, pooled_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
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
        D=d, BLOCK_D=block_d, num_warps=4, **pdl.args(state.device))
    return pooled
