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
from memory.layout import read_row_bytes, write_row_bytes

from .online_history import OnlineRollback

# Drafts per verify the doubled C4 ring holds: a verify writes positions tail(n + 1) .. n + k,
# at most k + 7 of them, and each must keep a slot of its own among the 16 of its SWA page.
MAX_DRAFT_TOKENS = C4_RING_SPEC - 7


@dataclass
class _Saved:
    pool: torch.Tensor        # the pool tensor (one layer's)
    index: torch.Tensor       # [N] slot / row written by a rejectable position
    data: torch.Tensor        # [N, ...] its contents before the step
    position: torch.Tensor    # [N] the position that writes it
    req: torch.Tensor         # [N] request index in the snapshot
    rows: str = ""            # "kv" / "indexer": a paged row pool; "": a state tensor indexed by slot


@dataclass
class VerifySnapshot:
    """What a verify step may overwrite on behalf of positions that can be rejected."""

    rids: list[Any]
    saved: list[_Saved] = field(default_factory=list)
    online: Optional[OnlineRollback] = None   # the online C128 state's main slots, set from history

    def restore(self, keep_lens: dict[Any, int]) -> int:
        """Put back every entry written by a position ``>= keep_lens[rid]`` (requests missing
        from ``keep_lens`` are left alone: finished ones free everything anyway). Returns how
        many entries were restored."""
        keep = torch.tensor([keep_lens.get(rid, -1) for rid in self.rids], dtype=torch.int64)
        n = 0
        for s in self.saved:
            k = keep.to(s.position.device)[s.req]
            sel = torch.nonzero((k >= 0) & (s.position >= k)).flatten()
            if not sel.numel():
                continue
            idx, data = s.index[sel], s.data[sel]
            if s.rows:
                write_row_bytes(s.pool, idx, data, indexer=s.rows == "indexer")
            else:
                s.pool[idx] = data
            n += int(sel.numel())
        if self.online is not None:
            n += self.online.restore(keep_lens)
        return n


def snapshot_for_verify(backend: Any, tables: Any, verifies: list[tuple[Any, int, int, int]]) -> VerifySnapshot:
    """Save what the verify rows ``[(rid, req_slot, prefix n, drafts k), ...]`` may roll back:
    the ring slots of positions ``n + 1 .. n + k`` and the compressed rows of blocks they
    complete, in every CSA / HCA layer. The allocator must already map those positions."""
    snap = VerifySnapshot([v[0] for v in verifies])
    pools, ratios = backend.pools, getattr(backend, "ratios", ())
    if not ratios or not verifies:
        return snap
    online = bool(getattr(backend, "online_compress", False))
    if online:
        snap.online = OnlineRollback.for_verifies(pools, verifies)
    req_to_token, full_to_swa = tables.req_to_token, tables.full_to_swa
    dev = req_to_token.device
    reqs, slots, pos = [], [], []
    for i, (_, slot, n, k) in enumerate(verifies):
        reqs += [i] * k
        slots += [slot] * k
        pos += range(n + 1, n + k + 1)
    req = torch.tensor(reqs, dtype=torch.int64, device=dev)
    slot = torch.tensor(slots, dtype=torch.int64, device=dev)
    p = torch.tensor(pos, dtype=torch.int64, device=dev)
    full = req_to_token[slot, p]
    for m in ratios:
        done = torch.nonzero((p + 1) % m == 0).flatten()      # positions that complete a block
        row = full[done] // m
        if m == 4:
            swa = full_to_swa[full]
            ring_slot = (swa // SWA_PAGE) * backend.c4_ring + p % backend.c4_ring
            for layer in sorted(pools.c4_ring):
                snap.saved += [
                    _Saved(pools.c4_ring[layer], ring_slot, pools.c4_ring[layer][ring_slot].clone(), p, req),
                    _Saved(pools.c4_indexer_ring[layer], ring_slot,
                           pools.c4_indexer_ring[layer][ring_slot].clone(), p, req),
                    _Saved(pools.c4_kv[layer], row, read_row_bytes(pools.c4_kv[layer], row), p[done],
                           req[done], "kv"),
                    _Saved(pools.c4_indexer[layer], row, read_row_bytes(pools.c4_indexer[layer], row, indexer=True),
                           p[done], req[done], "indexer")]
        else:
            ring_row = slot * backend.c128_ring + p % backend.c128_ring
            for layer in sorted(pools.c128_kv):
                if not online:
                    snap.saved.append(_Saved(pools.c128_ring[layer], ring_row, pools.c128_ring[layer][ring_row].clone(),
                                             p, req))
                snap.saved.append(_Saved(pools.c128_kv[layer], row, read_row_bytes(pools.c128_kv[layer], row), p[done],
                                         req[done], "kv"))
    return snap
