"""The static step's tables from one kernel (``kernels/static_tables.py``) against the ordinary step's.

The ordinary step's metadata (``init_forward_metadata``, the Triton backend's ``_step_plan``) is
built with torch ops from the same slot tables; it is the reference. Every entry a kernel reads
must agree exactly (these are integers): input ids (placeholders resolved), positions, SWA
slots, windows, the C4 indexer pages a row's visible count covers, the C128 row lists, and per
completed block its destination row, first position and ring candidates; each static row's ring
write slot is the ordinary step's for the same token. Rows past the step's requests repeat row
0 with every write masked. Requests of different lengths, some of whose SWA pages are evicted,
decode steps that complete C4 and C128 blocks, verify steps of several rows over a speculative
plan, the online C128 fold, dense mode and HiSparse's row owners. The kernel runs under the
interpreter here, natively on CUDA (a few seconds either way).
"""

from __future__ import annotations

import pytest
import torch

from dsv4_backend.backend import ForwardBatch
from dsv4_backend.config import DSV4Config
from dsv4_backend.input_ids import placeholder
from dsv4_backend.model_runner import ModelRunner
from memory.allocator import KVAllocator
from memory.configurator import DSV4PoolConfigurator
from memory.pools import DSV4KVPools
from dsv4_backend.weights import random_weights

CFG = DSV4Config.preset("tiny", vocab_size=512, num_hidden_layers=3, compress_ratios=(0, 4, 128, 0),
                        index_topk=4)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# prefix lengths: a C4 block (4k + 3) and a C128 block (128k + 127) completing, a short one,
# and a long one whose first SWA pages are evicted
LENS = {"a": 255, "b": 130, "c": 6, "d": 519}


def _runner(online=False, dense=False, speculative=False, hisparse=None):
    """A runner over pools for 4096 tokens; ``speculative``: a plan with doubled rings (steps of
    several rows per request)."""
    if not speculative:
        return ModelRunner.build(CFG, dtype=torch.float32, backend="triton", max_total_tokens=4096,
                                 max_running_requests=6, online_compress=online, dense=dense, cuda_graph=False,
                                 device=DEV, hisparse_config=hisparse)
    plan = DSV4PoolConfigurator(CFG, max_running_requests=6, swa_ratio=0.5, speculative=True,
                                draft_tokens=4).plan_for_tokens(4096)
    pools = DSV4KVPools(CFG, plan, device=DEV)
    alloc = KVAllocator(plan, max_context=plan.max_full_tokens, window=CFG.sliding_window, device=DEV)
    weights = random_weights(CFG, seed=0, dtype=torch.float32, device=DEV, include_mtp=False)
    return ModelRunner(CFG, weights, pools, alloc, dtype=torch.float32, backend="triton", cuda_graph=False,
                       device=DEV)


def _admit(alloc, q):
    """The requests of LENS, extended by chunks with out-of-window SWA pages freed as a
    scheduler would, then by the step's q rows."""
    for rid, n in LENS.items():
        alloc.admit(rid)
        for end in range(64, n + 64, 64):
            alloc.extend(rid, min(end, n))
            alloc.evict_swa(rid)
        assert alloc.extend(rid, n + q).ok
    return [alloc.req_slot(r) for r in LENS], list(LENS.values())


def _host(t):
    return t.cpu() if t is not None else None


def _compare(runner, q=1, bs=8, ctx=1024, placeholders=False):
    backend, alloc = runner.backend, runner.allocator
    slots, prefix = _admit(alloc, q)
    B, T = len(slots), len(slots) * q
    ids = list(range(3, 3 + T))
    prev = None
    if placeholders:    # every other row's id stands for a row of the "previous step's" ids
        prev = torch.tensor([900 + i for i in range(T)], device=DEV)
        ids = [placeholder(T - 1 - i) if i % 2 else t for i, t in enumerate(ids)]
    st = backend.static_decode(bs, ctx, q)
    backend.fill_static_decode(slots, prefix, ids, st, prev)
    meta = backend.init_forward_metadata(ForwardBatch(slots, prefix, [q] * B))
    plan, sp, sm = backend._step_plan(meta), st.plan, st.meta
    pad = torch.arange(bs * q) >= T

    want_ids = torch.tensor([900 + T - 1 - i if placeholders and i % 2 else t for i, t in enumerate(ids)])
    assert torch.equal(_host(st.input_ids)[:T], want_ids)
    assert torch.equal(_host(st.input_ids)[pad], want_ids[0].repeat(int(pad.sum())))
    assert torch.equal(_host(sm.positions)[:T], _host(meta.positions))
    assert torch.equal(_host(sm.req_slots)[:B], torch.tensor(slots))
    assert torch.equal(_host(sm.swa_slots)[:T], _host(meta.swa_slots))
    assert (_host(sm.swa_slots)[pad] == -1).all()
    window = _host(sp.window_slots)
    assert torch.equal(window[:T, : plan.window_slots.shape[1]], _host(plan.window_slots))
    assert (window[:T, plan.window_slots.shape[1]:] == -1).all()
    assert torch.equal(window[pad], window[0].expand(int(pad.sum()), -1))
    if sp.hs_owners is not None:
        assert torch.equal(_host(sp.hs_owners), torch.tensor([slots[i // q] if i < T else -1 for i in range(bs * q)]))
    for m in backend.ratios:
        _compare_ratio(backend, m, meta, plan, sp, T, q, pad)
    return st


def _compare_ratio(backend, m, meta, plan, sp, T, q, pad):
    cm = meta.compressed[m]
    pos = _host(meta.positions)
    if m == 4:
        vis = _host(sp.c4_visible)[:T]
        assert torch.equal(vis, _host(plan.c4_visible))
        nb4 = torch.tensor([p + q for p in meta.host.prefix_lens])[_host(meta.token_req)] // 4
        pages = _host(sp.c4_pages)[:T, : plan.c4_pages.shape[1]]
        held = torch.arange(pages.shape[1])[None, :] * 64 < nb4[:, None]       # the pages with complete blocks
        assert torch.equal(pages[held], _host(plan.c4_pages)[held])
    else:
        rows = _host(sp.c128_rows)[:T]
        nb = plan.c128_rows.shape[1]
        assert torch.equal(rows[:, :nb], _host(plan.c128_rows)) and (rows[:, nb:] == -1).all()
    if cm.online is not None:
        op = sp.online
        done = _host(cm.online.done_token)
        dest = _host(op.dest_rows)[:T]
        assert torch.equal(torch.nonzero(dest >= 0).flatten(), done)
        assert torch.equal(dest[done], _host(plan.online.dest_rows))
        assert torch.equal(_host(op.first_pos)[:T][done], _host(plan.online.first_pos))
        assert torch.equal(_host(op.token_count), (~pad).to(torch.int32))
        return
    rp, ev, wr = sp.rings[m], cm.events, cm.ring_writes
    dest = _host(rp.dest_rows)[:T]
    done = torch.nonzero(dest >= 0).flatten()
    # one event per completed block, in token order: the ordinary events are in request order too
    assert torch.equal(dest[done], _host(ev.row)) and torch.equal(_host(rp.first_pos)[:T][done], _host(ev.first_pos))
    assert (_host(rp.dest_rows)[pad] == -1).all()
    assert torch.equal(_host(rp.first_pos)[:T], pos // m * m)
    # ring writes: each static row's slot is the ordinary step's write of that token
    ring_slot = _host(rp.ring_slot)[:T]
    w_tok, w_slot = _host(wr.token), _host(wr.slot)
    assert w_tok.numel() and torch.equal(ring_slot[w_tok], w_slot)
    assert torch.equal(_host(rp.ring_token), torch.where(pad, 0, torch.arange(pad.numel())))
    # candidates: from the ring where the ordinary event reads the ring, else the new token's
    # ring slot (a static step writes the ring before it compresses)
    # ring slot (a static step writes the ring before it compresses; an ordinary C128 step does
    # not write the token that completes its block, whose slot is the request's ring row
    # slot * R + pos % R)
    unwritten = torch.ones(T, dtype=torch.bool)
    unwritten[w_tok] = False
    if m == 128:
        slot = _host(meta.req_slots)[_host(meta.token_req)]
        assert torch.equal(ring_slot[unwritten], (slot * backend.c128_ring + pos % backend.c128_ring)[unwritten])
    else:
        assert not unwritten.any()
    src_ring, src_new = _host(ev.src_ring), _host(ev.src_new)
    want = torch.where(src_ring >= 0, src_ring, torch.where(src_new >= 0, ring_slot[src_new.clamp_min(0)], -1))
    assert torch.equal(_host(rp.sources)[:T][done].to(torch.int64), want)


@pytest.mark.parametrize("placeholders", [False, True], ids=["ids", "placeholders"])
def test_decode_tables(placeholders):
    _compare(_runner(), placeholders=placeholders)


def test_lists_shared_by_several_programs(monkeypatch):
    """A row's C4 page and C128 row lists split over 4 programs (8-entry chunks, interleaved), as
    the 8,192-row lists of a 1M request are split over 16."""
    from dsv4_backend.kernels import static_tables
    monkeypatch.setattr(static_tables, "_CHUNK", 8)
    monkeypatch.setattr(static_tables, "_ROWS_A_PART", 8)
    _compare(_runner())


def test_verify_tables_several_rows_per_request():
    _compare(_runner(speculative=True), q=4, bs=6)


def test_online_c128_tables():
    _compare(_runner(online=True))


def test_dense_tables():
    _compare(_runner(dense=True))


def test_hisparse_row_owners():
    _compare(_runner(hisparse={"top_k": 4, "device_buffer_size": 4, "host_to_device_ratio": 16}))


def test_a_step_that_does_not_fit_is_refused():
    runner = _runner()
    slots, prefix = _admit(runner.allocator, 1)
    st = runner.backend.static_decode(2, 1024)
    with pytest.raises(ValueError, match="does not fit a static step of 2 requests"):
        runner.backend.fill_static_decode(slots, prefix, [1] * len(slots), st)
    st = runner.backend.static_decode(8, 512)
    with pytest.raises(ValueError, match="contexts <= 520"):
        runner.backend.fill_static_decode(slots, prefix, [1] * len(slots), st)
