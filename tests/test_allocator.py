"""PagedAllocator, ReqToTokenPool and KVAllocator: slots, pages, windows, ownership.

The expected slot of every token is recomputed here from the allocator's page lists with plain
Python arithmetic (full slot = page * 256 + p % 256, SWA slot = page * 128 + p % 128), and the
window rule is written independently: after n tokens the next token sees positions >= n - 127.
"""

import random

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dsv4_backend.config import DSV4Config
from memory.allocator import AllocResult, KVAllocator, PagedAllocator, ReqToTokenPool
from memory.configurator import DSV4PoolConfigurator

TINY = DSV4Config.preset("tiny")


def make(tokens=4096, requests=4, max_context=2048, dense=False, **kw):
    plan = DSV4PoolConfigurator(TINY, max_running_requests=requests, dense=dense,
                                state_dtype=torch.float32, online_compress=False, **kw).plan_for_tokens(tokens)
    return KVAllocator(plan, max_context=max_context, dense=dense)


def held_swa_pages(n, window=128):
    """Pages k a request of n tokens must still hold: some position in [n - (window-1), n)."""
    first_visible = n - (window - 1)
    return {k for k in range((n + 127) // 128) if (k + 1) * 128 > first_visible}


def check_slots(a, rid):
    """req_to_token and full_to_swa of rid agree with its pages, position by position."""
    n, slot = a.seq_len(rid), a.req_slot(rid)
    req = a._reqs[rid]
    for p in range(n):
        full = req.full_pages[p // 256] * 256 + p % 256
        assert int(a.req_to_token[slot, p]) == full
        page = a.swa_page_of(rid, p // 128)
        assert int(a.full_to_swa[full]) == (-1 if page is None else page * 128 + p % 128)


def snapshot(a):
    return (a.req_to_token.clone(), a.full_to_swa.clone(), a.full.num_free, a.swa.num_free,
            {r: (q.seq_len, list(q.full_pages), dict(q.swa_pages)) for r, q in a._reqs.items()})


def same(s1, s2):
    return torch.equal(s1[0], s2[0]) and torch.equal(s1[1], s2[1]) and s1[2:] == s2[2:]


# ---- PagedAllocator / ReqToTokenPool --------------------------------------------------------

def test_paged_allocator_basics():
    pa = PagedAllocator(5)
    assert pa.alloc(2) == [0, 1] and (pa.num_free, pa.num_used, pa.capacity) == (3, 2, 5)
    assert pa.alloc(4) is None and pa.num_free == 3  # failure takes nothing
    assert pa.alloc(3) == [2, 3, 4] and pa.alloc(1) is None
    pa.free([1, 3])
    assert pa.num_free == 2
    with pytest.raises(ValueError, match="not allocated"):
        pa.free([1])
    with pytest.raises(ValueError):
        pa.free([0, 0])
    assert pa.num_used == 3  # a rejected free frees nothing
    assert sorted(pa.alloc(2)) == [1, 3]
    pa.check("test")


def test_req_to_token_pool():
    pool = ReqToTokenPool(2, 16)
    assert pool.req_to_token.shape == (2, 16) and pool.req_to_token.dtype == torch.int64
    assert pool.alloc() == 0 and pool.alloc() == 1 and pool.alloc() is None
    pool.free(0)
    assert pool.alloc() == 0


# ---- KVAllocator ----------------------------------------------------------------------------

def test_tables_shapes_and_dummy():
    a = make()
    assert a.full_to_swa.shape == (4096 + 1,) and a.full_to_swa.dtype == torch.int64
    assert a.req_to_token.shape == (4, 2048)
    # 4 requests: SWA = max(409 -> 384, 4 * 256) = 1024 tokens = 8 pages; dummy SWA page = 8
    assert a.dummy_full_slot == 4096 and int(a.full_to_swa[-1]) == 8 * 128
    assert (a.full_to_swa[:-1] == -1).all()


def test_extend_across_page_boundaries():
    a = make()
    assert a.admit("a") == 0 and a.admit("b") == 1
    lens = {"a": 0, "b": 0}
    # chunks that end on, before and after 128- and 256-token boundaries, interleaved
    for rid, n in [("a", 1), ("b", 127), ("a", 127), ("b", 1), ("a", 128), ("b", 130), ("a", 1), ("b", 255),
                   ("a", 2), ("b", 1)]:
        res = a.extend(rid, lens[rid] + n)
        assert res.ok, res
        lens[rid] += n
        assert a.seq_len(rid) == lens[rid]
        check_slots(a, rid)
        a.check_integrity()
    assert lens == {"a": 259, "b": 514}
    assert len(a._reqs["a"].full_pages) == 2 and len(a._reqs["b"].full_pages) == 3
    # full slots of different tokens never collide
    slots = torch.cat([a.req_to_token[a.req_slot(r), :lens[r]] for r in lens])
    assert slots.unique().numel() == slots.numel()


def test_compressed_rows_unique_per_block():
    a = make(tokens=4096, swa_ratio=1.0)
    lens = {i: n for i, n in enumerate([300, 517, 129, 1000])}
    for i in lens:
        a.admit(i)
    for cut in range(0, 1000, 97):  # ragged chunks, interleaved across requests
        for i, n in lens.items():
            if cut < n:
                assert a.extend(i, min(n, cut + 97)).ok
    seen = {4: {}, 128: {}}
    for i, n in lens.items():
        slots = a.req_to_token[a.req_slot(i), :n].tolist()
        for m in (4, 128):
            for blk in range(n // m):  # complete blocks
                rows = {s // m for s in slots[blk * m:(blk + 1) * m]}
                assert len(rows) == 1, f"request {i} block {blk} of ratio {m} spans rows {rows}"
                row = rows.pop()
                assert row not in seen[m], f"row {row} of ratio {m} used by {seen[m].get(row)} and {(i, blk)}"
                seen[m][row] = (i, blk)


def test_evict_frees_exactly_the_out_of_window_pages():
    a = make()
    a.admit("r")
    total_freed = 0
    for n in [1, 127, 128, 129, 130, 255, 256, 257, 383, 384, 385, 600, 601, 1000]:
        a.extend("r", n)
        before = set(a._reqs["r"].swa_pages)
        freed = a.evict_swa("r")
        after = set(a._reqs["r"].swa_pages)
        assert after == held_swa_pages(n), (n, after)
        assert freed == len(before - after)
        total_freed += freed
        check_slots(a, "r")
        # evicted positions map to -1, window positions to a live SWA slot
        full = a.req_to_token[0, :n]
        live = a.full_to_swa[full] >= 0
        assert live.tolist() == [p // 128 in after for p in range(n)]
        assert live[max(0, n - 127):].all()
        a.check_integrity()
    assert a.swa.num_used == len(held_swa_pages(1000))
    assert total_freed == (1000 + 127) // 128 - len(held_swa_pages(1000))


def test_evict_at_exact_boundary():
    a = make()
    a.admit("r")
    a.extend("r", 255)  # next token 255 sees 128..255: page 0 (0..127) is out
    assert a.evict_swa("r") == 1 and a.swa_page_of("r", 0) is None
    a.extend("r", 256)
    a.extend("r", 256 + 127)  # next token 383 sees 256..383: page 1 (128..255) is out
    assert a.evict_swa("r") == 1 and a.swa_page_of("r", 1) is None and a.swa_page_of("r", 2) is not None
    a2 = make()
    a2.admit("r")
    a2.extend("r", 254)  # next token 254 sees 127..254: page 0 still needed
    assert a2.evict_swa("r") == 0


def test_dense_never_evicts():
    a = make(tokens=2048, requests=2, dense=True)
    assert a.plan.num_swa_pages == 16
    a.admit("r")
    a.extend("r", 1500)
    assert a.evict_swa("r") == 0
    assert (a.full_to_swa[a.req_to_token[0, :1500]] >= 0).all()
    a.check_integrity()


def test_atomic_failure_swa():
    # 4 requests -> SWA = max(409, 4*256) = 1024 tokens = 8 pages; full = 16 pages.
    a = make(tokens=4096, requests=4)
    a.admit("a")
    assert a.extend("a", 6 * 128).ok  # 6 SWA pages, 3 full pages
    a.admit("b")
    snap = snapshot(a)
    res = a.extend("b", 3 * 128)  # 3 SWA pages needed, 2 free; full pages would fit
    assert res == AllocResult(False, "swa", 3, 2, 2, 3) and not res.ok
    assert same(snap, snapshot(a)), "a failed extend changed state"
    assert a.can_extend("b", 3 * 128) == res
    a.evict_swa("a")  # a at 768: keeps only page 5 -> 5 pages come back
    assert a.extend("b", 3 * 128).ok
    a.check_integrity()


def test_atomic_failure_full_and_context():
    a = make(tokens=2048, requests=4, max_context=2048)  # 8 full pages, 8 SWA pages
    a.admit("a")
    for n in range(250, 1501, 250):  # prefill in chunks, evicting as it goes
        assert a.extend("a", n).ok
        a.evict_swa("a")
    a.admit("b")
    snap = snapshot(a)
    res = a.extend("b", 600)  # 3 full pages, 2 free
    assert (res.ok, res.failed_pool, res.needed, res.free) == (False, "full", 3, 2)
    assert same(snap, snapshot(a))
    res = a.extend("a", 2049)
    assert (res.ok, res.failed_pool) == (False, "context")
    assert same(snap, snapshot(a))
    assert a.extend("b", 256).ok
    a.check_integrity()


def test_dry_run_matches_and_changes_nothing():
    a = make()
    a.admit("x")
    snap = snapshot(a)
    res = a.can_extend("x", 700)
    assert res.ok and (res.full_pages, res.swa_pages) == (3, 6)
    assert same(snap, snapshot(a))
    assert a.extend("x", 700) == res
    assert a.can_extend("x", 700) == AllocResult(True, None, 0, 0, 0, 0)


def test_free_returns_everything_and_slots_are_reused():
    a = make(swa_ratio=1.0)
    initial = {k: v.used for k, v in a.stats().items()}
    for r in "abcd":
        assert a.admit(r) is not None
        a.extend(r, 333)
    assert a.admit("e") is None  # all 4 request slots taken
    st = a.stats()
    assert st["req_slots"] == (4, 4) and st["full"].used == 4 * 512 and st["swa"].used == 4 * 3 * 128
    assert st["c4_rows"].used == 4 * 512 // 4 and st["c128_rows"].used == 4 * 512 // 128
    assert st["c4_ring_slots"].used == 4 * 3 * 8 and st["c128_ring_rows"] == (4 * 128, 4 * 128)
    for r in "abcd":
        a.free(r)
        a.check_integrity()
    assert {k: v.used for k, v in a.stats().items()} == initial
    assert (a.full_to_swa[:-1] == -1).all()
    assert a.admit("e") == 3  # the most recently freed slot is reused first


def test_misuse_raises():
    a = make()
    a.admit("a")
    with pytest.raises(ValueError, match="already admitted"):
        a.admit("a")
    with pytest.raises(KeyError, match="not admitted"):
        a.extend("zz", 5)
    a.extend("a", 10)
    with pytest.raises(ValueError, match="seq_len"):
        a.extend("a", 5)


def test_check_integrity_catches_corruption():
    a = make()
    a.admit("a")
    a.admit("b")
    a.extend("a", 300)
    a.extend("b", 300)
    a.check_integrity()
    saved = int(a.full_to_swa[5])
    a.full_to_swa[5] = 7
    with pytest.raises(AssertionError, match=r"full_to_swa\[5\]"):
        a.check_integrity()
    a.full_to_swa[5] = saved
    a._reqs["b"].full_pages.append(a._reqs["a"].full_pages[0])
    with pytest.raises(AssertionError, match="owned twice|full pages"):
        a.check_integrity()
    a._reqs["b"].full_pages.pop()
    a.full._free.append(a._reqs["a"].full_pages[0])  # a used page also on the free list
    with pytest.raises(AssertionError, match="both free and used|free list|capacity"):
        a.check_integrity()


# ---- property test ----------------------------------------------------------------------------

OPS = st.sampled_from(["admit", "extend", "decode", "evict", "finish", "abort"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), requests=st.integers(1, 4), extra_pages=st.integers(0, 4), dense=st.booleans())
def test_random_lifecycles_never_double_own_or_leak(data, requests, extra_pages, dense):
    # Small pools (SWA at its minimum of 2 pages per request) so that allocations do fail.
    a = make(tokens=256 * (requests + extra_pages), requests=requests, max_context=1024, dense=dense)
    initial = (a.full.num_free, a.swa.num_free, a.req_pool.slots.num_free)
    next_id = 0
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        op = data.draw(OPS, label="op")
        live = a.live_requests
        if op == "admit" or not live:
            got = a.admit(next_id)
            assert (got is None) == (len(live) == requests)
            next_id += 1
        else:
            rid = data.draw(st.sampled_from(live), label="rid")
            n = a.seq_len(rid)
            if op in ("extend", "decode"):
                new_len = n + (1 if op == "decode" else data.draw(st.integers(1, 600), label="chunk"))
                snap = snapshot(a)
                dry = a.can_extend(rid, new_len)
                res = a.extend(rid, new_len)
                event(f"{op}: {'ok' if res.ok else res.failed_pool}")
                assert res == dry
                if res.ok:
                    assert a.seq_len(rid) == new_len
                else:
                    assert same(snap, snapshot(a))
                    assert res.failed_pool in ("full", "swa", "context") and res.needed > res.free
            elif op == "evict":
                a.evict_swa(rid)
                if not dense:
                    assert set(a._reqs[rid].swa_pages) == held_swa_pages(n)
            else:  # finish or abort (or a retraction): everything goes back
                a.free(rid)
        a.check_integrity()
        owned_full = sum(len(q.full_pages) for q in a._reqs.values())
        owned_swa = sum(len(q.swa_pages) for q in a._reqs.values())
        assert a.full.num_free == initial[0] - owned_full and a.swa.num_free == initial[1] - owned_swa
    for rid in a.live_requests:
        a.free(rid)
    a.check_integrity()
    assert (a.full.num_free, a.swa.num_free, a.req_pool.slots.num_free) == initial
    assert (a.full_to_swa[:-1] == -1).all()


@pytest.mark.parametrize("seed", range(6))
def test_queued_table_writes_equal_one_by_one_writes(seed):
    """Table writes are queued until a table is read. Many operations with no read in between
    (extends, evictions, frees, then a new request reusing the freed pages: the same entries
    written several times) must leave the tables exactly as writing after every operation does."""
    rng = random.Random(seed)
    eager, lazy = (make(tokens=256 * 6, requests=3, max_context=2048) for _ in range(2))
    next_id = 0
    for _ in range(60):
        live = eager.live_requests
        op = rng.choice(["admit", "extend", "decode", "decode", "evict", "free"]) if live else "admit"
        if op == "admit":
            rid, next_id = next_id, next_id + 1
            assert (eager.admit(rid) is None) == (lazy.admit(rid) is None)
        else:
            rid = rng.choice(live)
            if op in ("extend", "decode"):
                new_len = eager.seq_len(rid) + (1 if op == "decode" else rng.randint(1, 300))
                assert eager.extend(rid, new_len) == lazy.extend(rid, new_len)
            elif op == "evict":
                assert eager.evict_swa(rid) == lazy.evict_swa(rid)
            else:
                eager.free(rid)
                lazy.free(rid)
        eager.flush()
    assert any(lazy._pending.values())                    # the lazy one really queued
    assert torch.equal(lazy.full_to_swa, eager.full_to_swa)
    assert torch.equal(lazy.req_to_token, eager.req_to_token)
    lazy.check_integrity()
