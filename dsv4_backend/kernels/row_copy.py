"""Row copy: 584-byte attention rows from one pool to another, either of them in pinned host memory.

HiSparse (memory/hisparse.py) keeps every C4 row in a pinned host pool and copies the rows a
step selects into the device hot pool, and a step's new rows the other way. Pinned memory from
``cudaHostAlloc`` is mapped into the device's address space (UVA), so a kernel can load and
store it directly: one program per row reads the row's 576-byte part and 8 scale bytes at its
source page and writes them at its destination page. Nothing is decided on the host, so the
copy is captured by a CUDA graph like any other kernel; rows whose destination is < 0 are
skipped (masked, not branched), which is how a fixed-shape launch copies only the misses.

The pools are read as int32 words (576 = 144 x 4, 8 = 2 x 4; page strides are whole words), so
a program moves its row in two masked 4-byte-word loads, under the interpreter too.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import KV_ROW_BYTES, page_geometry

logger = logging.getLogger(__name__)

HEAD_WORDS = 576 // 4
TAIL_WORDS = (KV_ROW_BYTES - 576) // 4


@triton.jit
def _copy_rows_kernel(src, src_rows, dst, dst_rows, SRC_P, SRC_STRIDE, DST_P, DST_STRIDE,
                      HEAD: tl.constexpr, TAIL: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    d = tl.load(dst_rows + i).to(tl.int64)
    s = tl.maximum(tl.load(src_rows + i).to(tl.int64), 0)
    w = tl.arange(0, BLOCK)
    live = (w < HEAD + TAIL) & (d >= 0)
    d = tl.maximum(d, 0)
    head = w < HEAD
    tail_w = tl.maximum(w - HEAD, 0)
    s_off = (s // SRC_P) * SRC_STRIDE + tl.where(head, (s % SRC_P) * HEAD + w, SRC_P * HEAD + (s % SRC_P) * TAIL + tail_w)
    d_off = (d // DST_P) * DST_STRIDE + tl.where(head, (d % DST_P) * HEAD + w, DST_P * HEAD + (d % DST_P) * TAIL + tail_w)
    tl.store(dst + d_off, tl.load(src + s_off, mask=live), mask=live)


@triton.jit
def _copy_rows_block_kernel(src, src_rows, dst, dst_rows, n, SRC_P, SRC_STRIDE, DST_P, DST_STRIDE,
                            HEAD: tl.constexpr, TAIL: tl.constexpr, ROWS: tl.constexpr,
                            HEAD_A: tl.constexpr, HEAD_B: tl.constexpr):
    """``ROWS`` rows per program, each row's 576-byte part as 16-byte vectors (its words start
    at a multiple of 4: pages and the 576-byte parts are whole 16-byte units), so a warp's
    loads are whole 128-byte lines, many rows in flight per program."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    inside = r < n
    d = tl.load(dst_rows + r, mask=inside, other=-1).to(tl.int64)
    s = tl.maximum(tl.load(src_rows + r, mask=inside, other=0).to(tl.int64), 0)
    live = (d >= 0)[:, None]
    d = tl.maximum(d, 0)
    s_head = tl.multiple_of((s // SRC_P) * SRC_STRIDE + (s % SRC_P) * HEAD, 4)
    d_head = tl.multiple_of((d // DST_P) * DST_STRIDE + (d % DST_P) * HEAD, 4)
    wa = tl.arange(0, HEAD_A)[None, :]
    tl.store(dst + d_head[:, None] + wa, tl.load(src + s_head[:, None] + wa, mask=live), mask=live)
    wb = HEAD_A + tl.arange(0, HEAD_B)[None, :]
    tl.store(dst + d_head[:, None] + wb, tl.load(src + s_head[:, None] + wb, mask=live), mask=live)
    s_tail = (s // SRC_P) * SRC_STRIDE + SRC_P * HEAD + (s % SRC_P) * TAIL
    d_tail = (d // DST_P) * DST_STRIDE + DST_P * HEAD + (d % DST_P) * TAIL
    wt = tl.arange(0, TAIL)[None, :]
    tl.store(dst + d_tail[:, None] + wt, tl.load(src + s_tail[:, None] + wt, mask=live), mask=live)


def _words(pool: torch.Tensor, what: str) -> tuple[torch.Tensor, int, int]:
    """The pool as int32 words, its rows per page and page stride in words."""
    P, stride = page_geometry(pool, KV_ROW_BYTES, what)
    if stride % 4 or pool.shape[1] % 4 or pool.data_ptr() % 4:
        raise ValueError(f"{what} pool pages must be whole 4-byte words, got stride {stride}")
    return pool.view(torch.int32), P, stride // 4


def copy_rows(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor,
              rows_per_program: int = 0) -> None:
    """Copy row ``src_rows[i]`` of attention pool ``src`` to row ``dst_rows[i]`` of ``dst`` for
    every i with ``dst_rows[i] >= 0`` (int32/int64 ``[N]``, on the kernel's device; distinct
    destinations). Either pool may be pinned host memory. ``rows_per_program`` 0: one program
    per row; a power of two: that many rows per program, 16-byte loads (the pools' page strides
    in whole 16-byte units)."""
    n = int(dst_rows.numel())
    if src_rows.shape != dst_rows.shape:
        raise ValueError(f"src_rows {tuple(src_rows.shape)} and dst_rows {tuple(dst_rows.shape)} differ")
    if n == 0:
        return
    s, sp, ss = _words(src, "source")
    d, dp, ds = _words(dst, "destination")
    if rows_per_program and ss % 4 == 0 and ds % 4 == 0 and s.data_ptr() % 16 == 0 and d.data_ptr() % 16 == 0:
        _copy_rows_block_kernel[(triton.cdiv(n, rows_per_program),)](
            s, src_rows.reshape(-1), d, dst_rows.reshape(-1), n, sp, ss, dp, ds, HEAD=HEAD_WORDS,
            TAIL=TAIL_WORDS, ROWS=rows_per_program, HEAD_A=128, HEAD_B=HEAD_WORDS - 128, num_warps=4)
        return
    _copy_rows_kernel[(n,)](s, src_rows.reshape(-1), d, dst_rows.reshape(-1), sp, ss, dp, ds,
                            HEAD=HEAD_WORDS, TAIL=TAIL_WORDS, BLOCK=256, num_warps=2)


def host_copy_works(device: torch.device) -> bool:
    """Whether the kernel can read pinned host memory on ``device`` (UVA): one row copied from
    a pinned page to a device page and compared. False (with the reason) when it cannot."""
    page = 64 * KV_ROW_BYTES
    src = torch.arange(page, dtype=torch.int64).remainder(251).to(torch.uint8).view(1, page).pin_memory()
    dst = torch.zeros(1, page, dtype=torch.uint8, device=device)
    rows = torch.tensor([3], device=device)
    try:
        copy_rows(src, rows, dst, rows)
        got = dst.cpu()
    except Exception as e:  # noqa: BLE001 (the launcher refuses a host pointer: report, fall back)
        return _refused(f"{type(e).__name__}: {e}")
    want = torch.zeros_like(got)
    want[0, 3 * 576:4 * 576] = src[0, 3 * 576:4 * 576]
    want[0, 64 * 576 + 3 * 8:64 * 576 + 4 * 8] = src[0, 64 * 576 + 3 * 8:64 * 576 + 4 * 8]
    return torch.equal(got, want) or _refused("the copied bytes differ")


def _refused(why: str) -> bool:
    logger.warning("row copy from pinned host memory does not work here (%s); HiSparse "
                                        "copies through the host instead (one sync per CSA layer, no graphs)", why)
    return False
