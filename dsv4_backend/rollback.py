"""Rolling the compressed state back after a speculative verify step.

A verify step runs a request's last token and its k draft tokens as one extend of k + 1 rows
(positions ``n .. n + k``), and then keeps only the accepted ``a + 1`` (``a <= k``). What the
rejected positions ``n + a + 1 .. n + k`` wrote must end as if they had never run:

- **compressed rows** (C4 KV + indexer row, C128 KV): a block that a rejected position
  completed was compressed from rejected material. Its rows are put back to their bytes from
  before the step (they become complete, and are written again, when that position really is
  decoded);
- **ring slots** (C4 + indexer rings, C128 ring): each rejected position wrote its raw (C, Z)
  into its slot; the slots are put back to their previous contents.

What makes putting back enough: the verify writes *every* one of its tokens' (C, Z) into the
rings (``ForwardBatch.rollback_lens``: the ring tail is that of the shortest length it can be
rolled back to, ``n + 1``), so the accepted tokens' entries are there whatever the acceptance,
and the plan's doubled rings (DSV4.md section 5: 16 slots per SWA page, 256 rows per request)
give each of the at most ``k + 7`` C4 (``k + 128`` C128) positions a verify writes its own
slot, none of them the slot of a position still live afterwards. Hence
``MAX_DRAFT_TOKENS``. SWA rows of rejected positions are not restored: no query reads past its
request's length, and the position's next real decode overwrites them.

The online C128 state (a running (max, sum, kv) per request, ``SGLANG_OPT_USE_ONLINE_COMPRESS``)
has no ring: the verify records the state after each of its positions into the plan's extra
per-request slots and the restore picks the one after the last kept position
(``dsv4_backend/online_history.py``); its C128 rows are saved and put back as above.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from memory.configurator import C4_RING_SPEC, SWA_PAGE
from memory.layout import INDEXER_ROW_BYTES, INDEXER_VALUE_BYTES, KV_PART_BYTES, KV_ROW_BYTES, pool_page_size
from memory.upload import upload

from .online_history import OnlineRollback

# Drafts per verify the doubled C4 ring holds: a verify writes positions tail(n + 1) .. n + k,
# at most k + 7 of them, and each must keep a slot of its own among the 16 of its SWA page.
MAX_DRAFT_TOKENS = C4_RING_SPEC - 7


@dataclass
class _Saved:
    view: torch.Tensor                # [L, ...]: one pool kind (or a region of its pages) in L layers, a view
    index: tuple[torch.Tensor, ...]   # [N] each: the entries view[:, *index] a rejectable position writes
    data: torch.Tensor                # [L, N, ...]: their contents before the step
    position: torch.Tensor            # [N] the position that writes entry i
    req: torch.Tensor                 # [N] its request's index in the snapshot


@dataclass
class VerifySnapshot:
    """What a verify step may overwrite on behalf of positions that can be rejected.

    Everything stays on the device and is indexed by device tensors: neither taking the
    snapshot nor restoring it reads a value back to the host (no host synchronisation)."""

    rids: list[Any]
    saved: list[_Saved] = field(default_factory=list)
    online: Optional[OnlineRollback] = None   # the online C128 state's main slots, set from history

    def restore(self, keep_lens: dict[Any, int]) -> None:
        """Put back every entry written by a position ``>= keep_lens[rid]`` (requests missing
        from ``keep_lens`` are left alone: finished ones free everything anyway). A masked
        write of the whole snapshot (entries kept are written back with their current
        contents), so its kernels and shapes do not depend on the acceptance."""
        keep: torch.Tensor | None = None
        masks: dict[int, torch.Tensor] = {}
        for s in self.saved:
            if keep is None:
                keep = upload(torch.tensor([keep_lens.get(rid, -1) for rid in self.rids], dtype=torch.int64),
                              s.position.device)
            m = masks.get(id(s.position))
            if m is None:
                k = keep[s.req]
                m = masks[id(s.position)] = (k >= 0) & (s.position >= k)
            at = (slice(None),) + s.index
            cur = s.view[at]
            s.view[at] = torch.where(m.view((1, -1) + (1,) * (cur.dim() - 2)), s.data, cur)

        if self.online is not None:
            self.online.restore(keep_lens)

def _layer_views(pools: Any, kind: str) -> list[torch.Tensor]:
    """The kind's pools as ``[L, ...]`` views: the one stacked tensor of every layer
    (``DSV4KVPools.stacked``), else one ``[1, ...]`` view per layer."""
    stacked = getattr(pools, "stacked", {}).get(kind)
    if stacked is not None:
        return [stacked[0]]
    per_layer = getattr(pools, kind)
    return [per_layer[layer].unsqueeze(0) for layer in sorted(per_layer)]


def _row_regions(view: torch.Tensor, indexer: bool) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Rows per page P and the head / tail regions ``[L, pages, P, width]`` of a paged row pool
    ``[L, pages, page_bytes]`` (memory/layout.py's byte order: each page's heads, then its tails)."""
    row_bytes, head_width = (INDEXER_ROW_BYTES, INDEXER_VALUE_BYTES) if indexer else (KV_ROW_BYTES, KV_PART_BYTES)
    page_size = pool_page_size(view[0], row_bytes, "indexer" if indexer else "attention")
    split = page_size * head_width
    head = view[:, :, :split].unflatten(2, (page_size, head_width))
    tail = view[:, :, split:page_size * row_bytes].unflatten(2, (page_size, row_bytes - head_width))
    return page_size, head, tail


def _save(snap: VerifySnapshot, view: torch.Tensor, index: tuple[torch.Tensor, ...], position: torch.Tensor,
          req: torch.Tensor) -> None:
    snap.saved.append(_Saved(view, index, view[(slice(None),) + index], position, req))


def snapshot_for_verify(backend: Any, tables: Any, verifies: list[tuple[Any, int, int, int]]) -> VerifySnapshot:
    """Save what the verify rows ``[(rid, req_slot, prefix n, drafts k), ...]`` may roll back:
    the ring slots of positions ``n + 1 .. n + k`` and the compressed rows of blocks they
    complete, in every CSA / HCA layer. The allocator must already map those positions.

    Which positions complete a block is known on the host (n and k are the scheduler's ints);
    the slots and rows come from the allocator's device tables, and each pool kind is read in
    all its layers at once (one gather per kind, two for a paged row pool's head and tail)."""
    snap = VerifySnapshot([v[0] for v in verifies])
    pools, ratios = backend.pools, getattr(backend, "ratios", ())
    if not ratios or not verifies:
        return snap
    online = bool(getattr(backend, "online_compress", False))
    if online:
        snap.online = OnlineRollback.for_verifies(pools, verifies)
    req_to_token, full_to_swa = tables.req_to_token, tables.full_to_swa
    reqs, slots, pos = [], [], []
    for i, (_, slot, n, k) in enumerate(verifies):
        reqs += [i] * k
        slots += [slot] * k
        pos += range(n + 1, n + k + 1)
    N = len(pos)
    ms = sorted({int(m) for m in ratios if m})
    done = {m: [i for i, q in enumerate(pos) if (q + 1) % m == 0] for m in ms}    # positions completing a block
    flat = upload(torch.tensor(reqs + slots + pos + [i for m in ms for i in done[m]], dtype=torch.int64),
                  req_to_token.device)
    req, slot, p = flat[:N], flat[N:2 * N], flat[2 * N:3 * N]
    full = req_to_token[slot, p]
    at = 3 * N
    for m in ms:
        d = flat[at:at + len(done[m])]
        at += len(done[m])
        if m == 4:
            swa = full_to_swa[full]
            ring_slot = (swa // SWA_PAGE) * backend.c4_ring + p % backend.c4_ring
            rings, rows = ("c4_ring", "c4_indexer_ring"), (("c4_kv", False), ("c4_indexer", True))
        else:
            ring_slot = slot * backend.c128_ring + p % backend.c128_ring
            rings = () if online else ("c128_ring",)      # online C128: no ring (its state: snap.online)
            rows = (("c128_kv", False),)
        for kind in rings:
            for view in _layer_views(pools, kind):
                _save(snap, view, (ring_slot,), p, req)
        if not len(done[m]):
            continue
        row, p_done, req_done = full[d] // m, p[d], req[d]
        for kind, indexer in rows:
            for view in _layer_views(pools, kind):
                page_size, head, tail = _row_regions(view, indexer)
                index = (row // page_size, row % page_size)
                _save(snap, head, index, p_done, req_done)
                _save(snap, tail, index, p_done, req_done)
    return snap
