"""The batched rollback snapshot / restore (dsv4_backend/rollback.py) against the per-layer one.

The per-layer path the engine used before (one ``read_row_bytes`` / ``write_row_bytes`` and one
ring gather per layer and pool, the restore selecting rows with ``nonzero``) is kept here as the
reference. Every pool of a speculative plan (two CSA layers, one HCA layer) is filled with random
bits; both snapshots are taken; then every pool is overwritten with other random bits (what a
verify might write) and each path restores its own copy, with mixed acceptance: nothing
rejected, everything rejected, a rejection at a C4 block end and at the C128 block ending at
position 127, a request absent from ``keep_lens``. The pools must end bit-identical to the
reference's, and equal, entry by entry, to an independent expectation: the bits before the step
exactly where a rejected position writes, the overwritten bits elsewhere. Both layouts run: the
stacked pools (one tensor per kind, the engine's) and per-layer tensors (the fallback).

The snapshot and the restore read nothing back to the host (tests/test_host_syncs.py's
``DeviceMemory`` stands in for device memory). ~3 s on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_backend.backend import TorchDSV4Backend
from dsv4_backend.config import DSV4Config
from dsv4_backend.rollback import snapshot_for_verify
from memory.allocator import KVAllocator
from memory.configurator import SWA_PAGE, DSV4PoolConfigurator
from memory.layout import read_row_bytes, write_row_bytes
from memory.pools import DSV4KVPools

from test_host_syncs import DeviceMemory

CFG = DSV4Config.preset("tiny", vocab_size=512, num_hidden_layers=4, compress_ratios=(0, 4, 128, 4, 0),
                        index_topk=4)
KINDS = ("c4_kv", "c4_indexer", "c4_ring", "c4_indexer_ring", "c128_kv", "c128_ring")
# (rid, prefix n, drafts k, accepted a or None: absent from keep_lens)
VERIFIES = [("a", 126, 3, 0),     # rejects 127 .. 129: the C4 block and the C128 block ending at 127
            ("b", 2, 8, 3),       # rejects 6 .. 10: the C4 block ending at 7 (the one ending at 3 is kept)
            ("c", 61, 5, 5),      # all accepted: nothing restored
            ("d", 40, 4, 1),      # rejects 42 .. 44: the C4 block ending at 43
            ("e", 9, 2, None)]    # not in keep_lens: left alone


def _setup(stacked: bool):
    plan = DSV4PoolConfigurator(CFG, max_running_requests=8, swa_ratio=0.5, speculative=True,
                                draft_tokens=9).plan_for_tokens(4096)
    pools = DSV4KVPools(CFG, plan, state_dtype=torch.float64)
    alloc = KVAllocator(plan, max_context=plan.max_full_tokens, window=CFG.sliding_window)
    for rid, n, k, _ in VERIFIES:
        alloc.admit(rid)
        assert alloc.extend(rid, n + k + 1).ok
    if not stacked:   # the fallback: separate per-layer tensors, no stacks
        for kind in KINDS:
            setattr(pools, kind, {layer: t.clone() for layer, t in getattr(pools, kind).items()})
        pools.stacked = {}
    backend = TorchDSV4Backend(CFG, pools, alloc, dtype=torch.float64)
    return pools, alloc, backend


def _randomise(pools, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for kind in KINDS:
        for t in getattr(pools, kind).values():
            if t.dtype == torch.uint8:
                t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
            else:
                t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype))


def _state(pools) -> dict[tuple[str, int], torch.Tensor]:
    return {(kind, layer): t.clone() for kind in KINDS for layer, t in getattr(pools, kind).items()}


def _per_layer_snapshot(backend, tables, verifies):
    """The engine's former snapshot: per layer and pool, (pool, index, data, position, req, rows)."""
    pools, saved = backend.pools, []
    req_to_token, full_to_swa = tables.req_to_token, tables.full_to_swa
    reqs, slots, pos = [], [], []
    for i, (_, slot, n, k) in enumerate(verifies):
        reqs += [i] * k
        slots += [slot] * k
        pos += range(n + 1, n + k + 1)
    req, slot, p = (torch.tensor(x, dtype=torch.int64) for x in (reqs, slots, pos))
    full = req_to_token[slot, p]
    for m in backend.ratios:
        done = torch.nonzero((p + 1) % m == 0).flatten()
        row = full[done] // m
        if m == 4:
            ring = (full_to_swa[full] // SWA_PAGE) * backend.c4_ring + p % backend.c4_ring
            for layer in sorted(pools.c4_ring):
                saved += [(pools.c4_ring[layer], ring, pools.c4_ring[layer][ring].clone(), p, req, ""),
                          (pools.c4_indexer_ring[layer], ring, pools.c4_indexer_ring[layer][ring].clone(), p, req, ""),
                          (pools.c4_kv[layer], row, read_row_bytes(pools.c4_kv[layer], row), p[done], req[done], "kv"),
                          (pools.c4_indexer[layer], row, read_row_bytes(pools.c4_indexer[layer], row, indexer=True),
                           p[done], req[done], "indexer")]
        else:
            ring = slot * backend.c128_ring + p % backend.c128_ring
            for layer in sorted(pools.c128_kv):
                saved += [(pools.c128_ring[layer], ring, pools.c128_ring[layer][ring].clone(), p, req, ""),
                          (pools.c128_kv[layer], row, read_row_bytes(pools.c128_kv[layer], row), p[done], req[done],
                           "kv")]
    return saved


def _per_layer_restore(saved, rids, keep_lens) -> int:
    keep = torch.tensor([keep_lens.get(rid, -1) for rid in rids], dtype=torch.int64)
    n = 0
    for pool, index, data, position, req, rows in saved:
        k = keep[req]
        sel = torch.nonzero((k >= 0) & (position >= k)).flatten()
        if rows:
            write_row_bytes(pool, index[sel], data[sel], indexer=rows == "indexer")
        else:
            pool[index[sel]] = data[sel]
        n += int(sel.numel())
    return n


def _verifies(alloc):
    return [(rid, alloc.req_slot(rid), n, k) for rid, n, k, _ in VERIFIES]


def _keep_lens():
    return {rid: n + a + 1 for rid, n, _, a in VERIFIES if a is not None}


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked-pools", "per-layer-pools"])
def test_restore_equals_per_layer_path(stacked):
    pools, alloc, backend = _setup(stacked)
    assert bool(pools.stacked) == stacked
    _randomise(pools, 1)
    before = _state(pools)
    snap = snapshot_for_verify(backend, alloc, _verifies(alloc))
    ref = _per_layer_snapshot(backend, alloc, _verifies(alloc))
    _randomise(pools, 2)                          # what the verify might have written
    after = _state(pools)
    snap.restore(_keep_lens())
    got = _state(pools)
    for key, t in after.items():                  # the reference restores the same overwritten state
        getattr(pools, key[0])[key[1]].copy_(t)
    restored = _per_layer_restore(ref, [v[0] for v in VERIFIES], _keep_lens())
    want = _state(pools)
    # rows of the C4 blocks ending at 127, 7, 43 (x 2 CSA layers x kv / indexer), the C128 block
    # ending at 127, ring slots of the 3 + 5 + 3 rejected positions (x 2 CSA x 2 rings, x 1 HCA)
    assert restored == 3 * 2 * 2 + 1 + 11 * (2 * 2 + 1)
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key}: {int((got[key] != want[key]).sum())} elements differ"
    # independently: the bits before the step exactly at what a rejected position writes
    expect = {key: t.clone() for key, t in after.items()}
    r2t, f2s = alloc.req_to_token, alloc.full_to_swa
    for rid, n, k, a in VERIFIES:
        if a is None:
            continue
        slot = alloc.req_slot(rid)
        for p in range(n + a + 1, n + k + 1):
            full = int(r2t[slot, p])
            ring4 = int(f2s[full]) // SWA_PAGE * backend.c4_ring + p % backend.c4_ring
            ring128 = slot * backend.c128_ring + p % backend.c128_ring
            for (kind, layer), t in expect.items():
                if kind in ("c4_ring", "c4_indexer_ring"):
                    t[ring4] = before[kind, layer][ring4]
                elif kind == "c128_ring":
                    t[ring128] = before[kind, layer][ring128]
                else:
                    m = 128 if kind == "c128_kv" else 4
                    if (p + 1) % m == 0:
                        row, indexer = torch.tensor([full // m]), kind == "c4_indexer"
                        write_row_bytes(t, row, read_row_bytes(before[kind, layer], row, indexer=indexer),
                                        indexer=indexer)
    for key in expect:
        assert torch.equal(got[key], expect[key]), key
    assert any(not torch.equal(got[key], after[key]) for key in got)


def test_snapshot_and_restore_read_nothing_back():
    pools, alloc, backend = _setup(True)
    _randomise(pools, 3)
    alloc.req_pool.req_to_token = alloc.req_pool.req_to_token.as_subclass(DeviceMemory)
    alloc._full_to_swa = alloc._full_to_swa.as_subclass(DeviceMemory)
    pools.stacked = {kind: (t.as_subclass(DeviceMemory), ids) for kind, (t, ids) in pools.stacked.items()}
    DeviceMemory.reads = []
    snap = snapshot_for_verify(backend, alloc, _verifies(alloc))
    assert all(isinstance(s.data, DeviceMemory) for s in snap.saved)    # it did read the device pools
    # one entry per kind's view: the stacks, not one per layer
    assert len(snap.saved) == len(KINDS) + 3      # the paged row pools: a head and a tail view each
    snap.restore(_keep_lens())
    assert DeviceMemory.reads == []
