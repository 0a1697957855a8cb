"""HiSparse decode lookup: one kernel per CSA layer for the buffer table work of a swap-in.

``memory.hisparse.HiSparsePool.swap_in`` decides, for each decoding request, which of the rows
its query selected are already in the request's buffer (hits), which buffer rows the others
take (empty rows first, then the least recently used row not selected in this step), and where
every selected row is on the device. In torch that is ~30 small kernels per layer (two sorts
of the ``[T, B]`` buffers among them), ~220 us per layer at batch 10 on an H200 where the copy
itself takes ~80 us. Here two kernels do the same in registers:

1. membership without sorting (program per request and 128 buffer rows): the ``k`` selected
   rows against the buffer rows, ``KC`` selected rows at a time (a ``[KC, 128]`` equality tile):
   per selected row its buffer slot (else the -1 it was filled with; kept in the output until
   step 3), per buffer row whether this step selected it (pinned);
2. victims (program per request): each buffer row's key (empty rows ``j - B``, in order, before every used row's
   ``last_used * B + j``; pinned rows and padding never) sorted once; the ``r``-th miss takes
   the ``r``-th smallest key (``r`` from a cumulative sum over the misses), whose buffer row is
   the key modulo ``B``;
3. the table, ``last_used`` and the counters are written, and the copy list handed back: the
   device row of every miss (else -1) for the row-copy kernel.

The choice is the torch path's, row for row (same keys, same order; keys are distinct), so the
two give the same tables and device rows; ``tests/test_hisparse.py`` compares them under the
interpreter. Fixed shapes, no host work: a decode graph captures it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NEVER = tl.constexpr(2 ** 62)


@triton.jit
def _membership_kernel(table, sel, owners, slot_out, pinned, k, B,
                       KC: tl.constexpr, BC: tl.constexpr, BPAD: tl.constexpr):
    """Program (t, c): buffer rows ``c * BC ..`` of request row t against all its selected rows."""
    t, c = tl.program_id(0), tl.program_id(1)
    owner = tl.load(owners + t).to(tl.int64)
    cols = c * BC + tl.arange(0, BC)
    in_buf = cols < B
    held = tl.load(table + tl.maximum(owner, 0) * B + cols, mask=in_buf & (owner >= 0), other=-1)
    hit_col = tl.zeros([BC], dtype=tl.int32)
    for c0 in range(0, k, KC):
        i = c0 + tl.arange(0, KC)
        s = tl.load(sel + t * k + i, mask=(i < k) & (owner >= 0), other=-1).to(tl.int64)
        eq = (s[:, None] == held[None, :]) & (s[:, None] >= 0) & in_buf[None, :]
        hit_col = tl.maximum(hit_col, tl.max(eq.to(tl.int32), axis=0))
        slot = tl.max(tl.where(eq, cols[None, :], -1), axis=1)
        tl.store(slot_out + t * k + i, slot.to(tl.int64), mask=(i < k) & (slot >= 0))   # one program finds it
    tl.store(pinned + t * BPAD + cols, hit_col, mask=cols < BPAD)


@triton.jit
def _victim_kernel(table, used, sel, owners, tick, counts, pinned, dest, copy_dst, k, B,
                   KP: tl.constexpr, BP: tl.constexpr):
    """Program t: request row t's victims, its table and ``last_used`` writes, the copy list."""
    t = tl.program_id(0)
    owner = tl.load(owners + t).to(tl.int64)
    cols = tl.arange(0, BP)
    base = tl.maximum(owner, 0) * B
    live = owner >= 0
    in_buf = cols < B
    held = tl.load(table + base + cols, mask=in_buf & live, other=-1)
    last = tl.load(used + base + cols, mask=in_buf & live, other=0)
    pin = tl.load(pinned + t * BP + cols, mask=in_buf, other=1)
    now = tl.load(tick) + 1
    ii = tl.arange(0, KP)
    ok = ii < k
    s = tl.load(sel + t * k + ii, mask=ok & live, other=-1).to(tl.int64)
    slot = tl.load(dest + t * k + ii, mask=ok, other=-1)
    valid = ok & (s >= 0) & live
    hit = valid & (slot >= 0)
    miss = valid & (slot < 0)
    key = tl.where(held < 0, cols.to(tl.int64) - B, last * B + cols)
    key = tl.where((pin > 0) | ~in_buf, _NEVER, key)
    ordered = tl.sort(key, dim=0)
    rank = tl.maximum(tl.cumsum(miss.to(tl.int32), axis=0) - 1, 0)
    vkey = tl.gather(ordered, rank, axis=0)
    victim = tl.where(vkey < 0, vkey + B, vkey % B)
    row = tl.where(hit, slot, victim)
    evicted = tl.sum((miss & (tl.gather(held, victim.to(tl.int32), axis=0) >= 0)).to(tl.int64), axis=0)
    tl.store(table + base + victim, s, mask=miss)
    tl.store(used + base + row, tl.zeros([KP], dtype=tl.int64) + now, mask=valid)
    tl.store(dest + t * k + ii, tl.where(valid, base + row, -1), mask=ok)
    tl.store(copy_dst + t * k + ii, tl.where(miss, base + row, -1), mask=ok)
    tl.atomic_add(counts + 0, tl.sum(miss.to(tl.int64), axis=0))
    tl.atomic_add(counts + 1, tl.sum(hit.to(tl.int64), axis=0))
    tl.atomic_add(counts + 2, evicted)


def hisparse_lookup(table: torch.Tensor, used: torch.Tensor, sel: torch.Tensor, owners: torch.Tensor,
                    tick: torch.Tensor, counts: torch.Tensor, buffer_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The table work of one layer's decode swap-in (see the module docstring): ``sel [T, k]``
    (full C4 rows, -1 none, a query's rows distinct), ``owners [T]`` (request slots, -1 padded).
    Updates ``table``, ``used`` (int64 ``[S * B + 1]``) and ``counts[0:3]`` (swapped, hits,
    evicted) in place, and advances ``tick``. Returns ``(dest, copy_dst)``: int64 ``[T, k]``
    device rows of every selected row (-1 kept), and the device row of every miss (else -1)."""
    T, k = sel.shape
    dest = torch.full((T, k), -1, dtype=torch.int64, device=sel.device)
    copy_dst = torch.empty_like(dest)
    if T == 0 or k == 0:
        return dest, copy_dst
    sel = sel.contiguous()
    owners = owners.to(torch.int64).contiguous()
    BP = triton.next_power_of_2(buffer_size)
    BC = min(BP, 128)
    pinned = torch.empty(T, BP, dtype=torch.int32, device=sel.device)
    _membership_kernel[(T, BP // BC)](table, sel, owners, dest, pinned, k, buffer_size, KC=32, BC=BC, BPAD=BP,
                                      num_warps=4)
    _victim_kernel[(T,)](table, used, sel, owners, tick, counts, pinned, dest, copy_dst, k, buffer_size,
                         KP=triton.next_power_of_2(k), BP=BP, num_warps=8)
    tick += 1
    return dest, copy_dst
