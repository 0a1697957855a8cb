"""One launch that fills a static decode step's tables: the buffers a CUDA graph replays.

A replayed decode step reads fixed-address tables (``triton_backend.StaticDecode``): per static
row its input id, position, SWA slot and window of SWA slots, and per compression ratio the
event of the block the row completes (destination row, first position, ring candidates), its
ring write, and the compressed rows it may attend (C4 indexer pages, C128 rows). Built from the
ordinary metadata with torch ops they cost about 120 small kernels and copies a step, which the
GPU runs one after another before each replay (docs/PERF.md, "Session 11": 0.67 ms of a 7.24 ms
step at batch 1). Every entry is a function of the request's slot and position and of the two
slot tables, so this kernel computes them all in one launch from one upload of the step's
per-request ints: a row's own entries in one program, its C4 page and C128 row lists (thousands of
entries at 1M) shared by up to 16 programs of the row.

Row ``t`` of a step of B requests x q rows (T = B * q real rows) reads request ``g // q`` at
position ``prefix + g % q``, g = t for real rows and g = 0 for the padded rows, which repeat
row 0 with every write masked: SWA slot -1, destination row -1, online token count 0; their
ring write stores row 0's own value at row 0's slot again. With ``swa(p)`` the SWA slot of the
request's position p (``full_to_swa[req_to_token[slot, p]]``):

- window (W slots): ``swa(p - W + 1 + i)`` for the positions >= 0, else -1; dense mode lists
  every position <= p (ctx slots);
- ratio m's event: the row completes block ``p // m`` when ``(p + 1) % m == 0``; its row is
  ``req_to_token[slot, block * m] / m`` (-1 otherwise). C4 candidates are positions p - 7 .. p,
  each at ring slot ``(swa // SWA_PAGE) * R4 + pos % R4`` of its own SWA page (-1 if < 0 or
  evicted); C128 candidates are the block's 128 slots ``slot * R128 + pos % R128``;
- C4 indexer pages: page j of the request is ``req_to_token[slot, 256 j] / 256`` for the pages
  holding complete C4 blocks (0 past them; the indexer reads only the row's visible count,
  ``(p + 1) // 4``); C128 rows: ``req_to_token[slot, 128 b] / 128`` for b < (p + 1) // 128, -1 after.

The ordinary step's metadata (``TorchDSV4Backend.init_forward_metadata`` with the Triton
backend's ``_step_plan``) is the reference: ``tests/test_static_tables.py`` compares every entry a
kernel reads, and ``tests/test_cuda_graph.py`` whole static steps against ordinary ones.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from memory.configurator import SWA_PAGE

from ._common import check_device

# the C4 and C128 tables are filled in chunks of this many entries per loop step
_CHUNK = 256
# A row's C4 page and C128 row lists (4,096 and 8,192 entries at 1M) are shared by up to this many
# programs, each at least _ROWS_A_PART entries: one program walking a 1M request's lists took 34 us
# before a batch-1 replay on the H200 (docs/PERF.md, session 12).
_MAX_PARTS = 16
_ROWS_A_PART = 512


@triton.jit
def _swa_of(r2t_row, f2s_ptr, p, ok):
    """SWA slots of positions ``p`` (-1 where not ``ok`` or evicted)."""
    full = tl.load(r2t_row + p, mask=ok, other=0)
    return tl.load(f2s_ptr + full, mask=ok, other=-1)


@triton.jit
def _static_fill_kernel(
    req_ptr, ids_ptr, prev_ptr, n_prev, r2t_ptr, r2t_stride, f2s_ptr, B, T, Q,
    ids_out, pos_out, req_out, swa_out, win_out, win_width, hs_out,
    c4_dest, c4_first, c4_src, c4_tok, c4_slot, c4_pages, c4_vis, n_pages, R4,
    c128_dest, c128_first, c128_src, c128_tok, c128_slot, c128_rows, n_c128, R128,
    on_count, count_tokens,
    W: tl.constexpr, BLOCK_W: tl.constexpr, DENSE: tl.constexpr, PLACEHOLDERS: tl.constexpr,
    HS: tl.constexpr, C4: tl.constexpr, C128: tl.constexpr, ONLINE: tl.constexpr,
    SWA_PAGE_: tl.constexpr, CHUNK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)          # this program's share of the C4 page and C128 row lists
    parts = tl.num_programs(1)
    real = t < T
    g = tl.where(real, t, 0)
    r = g // Q
    slot = tl.load(req_ptr + r)
    prefix = tl.load(req_ptr + B + r)
    pos = prefix + g % Q
    row = r2t_ptr + slot * r2t_stride

    if part == 0:      # the row's own entries; every program of the row writes a share of its lists
        tok = tl.load(ids_ptr + g)
        if PLACEHOLDERS:   # -(i + 1) stands for row i of the previous step's sampled ids
            k = tl.minimum(tl.maximum(-tok - 1, 0), n_prev - 1)
            tok = tl.where(tok >= 0, tok, tl.load(prev_ptr + k))
        tl.store(ids_out + t, tok)
        tl.store(pos_out + t, pos)
        tl.store(req_out + t // Q, slot, mask=t % Q == 0)
        own = tl.load(f2s_ptr + tl.load(row + pos))           # this row's SWA slot
        tl.store(swa_out + t, tl.where(real, own, -1))
        if HS:
            tl.store(hs_out + t, tl.where(real, slot, -1))

        if DENSE:          # every position <= pos, in win_width columns
            for c0 in range(0, win_width, CHUNK):
                c = c0 + tl.arange(0, CHUNK)
                ok = c <= pos
                s = _swa_of(row, f2s_ptr, c, ok)
                tl.store(win_out + t * win_width + c, tl.where(ok, s, -1).to(tl.int32), mask=c < win_width)
        else:
            i = tl.arange(0, BLOCK_W)
            p = pos - W + 1 + i
            ok = (p >= 0) & (i < W)
            s = _swa_of(row, f2s_ptr, p, ok)
            tl.store(win_out + t * W + i, tl.where(ok, s, -1).to(tl.int32), mask=i < W)

        if C4:
            block = pos // 4
            done = real & ((pos + 1) % 4 == 0)
            dest = tl.load(row + block * 4, mask=done, other=0) // 4
            tl.store(c4_dest + t, tl.where(done, dest, -1))
            tl.store(c4_first + t, block * 4)
            tl.store(c4_tok + t, g)
            k8 = tl.arange(0, 8)
            cand = pos - 7 + k8
            okc = cand >= 0
            sc = _swa_of(row, f2s_ptr, cand, okc)
            src = tl.where(okc & (sc >= 0), (sc // SWA_PAGE_) * R4 + cand % R4, -1)
            tl.store(c4_src + t * 8 + k8, src.to(tl.int32))
            tl.store(c4_slot + t, (own // SWA_PAGE_) * R4 + pos % R4)
            tl.store(c4_vis + t, ((pos + 1) // 4).to(tl.int32))

        if C128:
            block = pos // 128
            done = real & ((pos + 1) % 128 == 0)
            dest = tl.where(done, tl.load(row + block * 128, mask=done, other=0) // 128, -1)
            tl.store(c128_dest + t, dest)
            tl.store(c128_first + t, block * 128)
            if ONLINE:     # one row per request (q = 1)
                tl.store(on_count + t, tl.where(real, count_tokens, 0).to(tl.int32))
            else:
                tl.store(c128_tok + t, g)
                k = tl.arange(0, 128)
                tl.store(c128_src + t * 128 + k, (slot * R128 + (block * 128 + k) % R128).to(tl.int32))
                tl.store(c128_slot + t, slot * R128 + pos % R128)
    if C4:
        nb4 = (prefix + Q) // 4     # complete C4 blocks of the request
        for j0 in range(part * CHUNK, n_pages, parts * CHUNK):
            j = j0 + tl.arange(0, CHUNK)
            okp = j * 64 < nb4
            full = tl.load(row + j * 256, mask=okp, other=0)
            tl.store(c4_pages + t * n_pages + j, tl.where(okp, full // 256, 0).to(tl.int32), mask=j < n_pages)
    if C128:
        vis = (pos + 1) // 128
        for b0 in range(part * CHUNK, n_c128, parts * CHUNK):
            b = b0 + tl.arange(0, CHUNK)
            okb = b < vis
            full = tl.load(row + b * 128, mask=okb, other=0)
            tl.store(c128_rows + t * n_c128 + b, tl.where(okb, full // 128, -1).to(tl.int32), mask=b < n_c128)


def static_fill(requests: torch.Tensor, ids: torch.Tensor, prev_ids: Optional[torch.Tensor],
                req_to_token: torch.Tensor, full_to_swa: torch.Tensor, q: int, out: dict,
                window: int, dense: bool = False, c4_ring: int = 1, c128_ring: int = 1,
                count_tokens: bool = True) -> None:
    """Fill a static step's tables in one launch.

    ``requests``: int64 [2, B], the step's request slots and prefix lengths (each request runs
    rows prefix .. prefix + q - 1); ``ids``: int64 [B * q] input ids, where ``-(i + 1)`` stands
    for ``prev_ids[i]`` when ``prev_ids`` is given. ``out``: the destination tensors, each with
    ``bs * q`` rows (bs >= B; its size is the grid): ``input_ids``, ``positions``, ``req_slots``
    [bs], ``swa_slots``, ``window_slots`` [rows, W or ctx], optionally ``hs_owners``; per ratio
    present ``c4`` / ``c128``: ``(dest_rows, first_pos, sources, ring_token, ring_slot)``, and
    ``c4_pages``, ``c4_visible``, ``c128_rows``; for the online C128 fold ``online``:
    ``(token_count, dest_rows, first_pos)`` in place of ``c128``."""
    rows = out["positions"].shape[0]
    B = requests.shape[1]
    if rows % q or rows < B * q or ids.shape[0] != B * q:
        raise ValueError(f"static_fill: {B} requests x {q} rows with {ids.shape[0]} ids do not fit {rows} rows")
    check_device(requests, ids, req_to_token, full_to_swa, out["positions"])
    if req_to_token.stride(1) != 1:
        raise ValueError("static_fill: req_to_token rows must be contiguous")
    win = out["window_slots"]
    dummy = out["positions"]
    c4 = out.get("c4")
    c128 = out.get("c128")
    online = out.get("online")
    if c128 is not None and online is not None:
        raise ValueError("static_fill: a ratio-128 ring plan and an online fold are exclusive")
    if online is not None and q != 1:
        raise ValueError(f"static_fill: the online C128 fold takes one row per request, got q={q}")
    c4_args = (*c4, out["c4_pages"], out["c4_visible"], out["c4_pages"].shape[1]) if c4 else (dummy,) * 7 + (0,)
    if c128 is not None:
        c128_args = (*c128, out["c128_rows"], out["c128_rows"].shape[1])
    elif online is not None:      # (token_count, dest_rows, first_pos): the count goes in its own argument
        c128_args = (*online[1:], dummy, dummy, dummy, out["c128_rows"], out["c128_rows"].shape[1])
    else:
        c128_args = (dummy,) * 6 + (0,)
    hs = out.get("hs_owners")
    longest = max(out["c4_pages"].shape[1] if c4 else 0, out["c128_rows"].shape[1] if c128_args[-1] else 0)
    parts = max(1, min(_MAX_PARTS, triton.cdiv(longest, _ROWS_A_PART)))
    _static_fill_kernel[(rows, parts)](
        requests, ids, dummy if prev_ids is None else prev_ids, 0 if prev_ids is None else prev_ids.numel(),
        req_to_token, req_to_token.stride(0), full_to_swa, B, B * q, q,
        out["input_ids"], out["positions"], out["req_slots"], out["swa_slots"], win, win.shape[1],
        dummy if hs is None else hs,
        *c4_args, c4_ring, *c128_args, c128_ring,
        dummy if online is None else online[0], 1 if count_tokens else 0,
        W=window, BLOCK_W=triton.next_power_of_2(window), DENSE=dense, PLACEHOLDERS=prev_ids is not None,
        HS=hs is not None, C4=c4 is not None, C128=c128 is not None or online is not None,
        ONLINE=online is not None, SWA_PAGE_=SWA_PAGE, CHUNK=_CHUNK)
