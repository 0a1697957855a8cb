"""Verify steps (s_q = k + 1 rows per request) through the Triton backend (TRITON_INTERPRET=1).

The lock-step harness of tests/test_triton_backend.py (each layer's writes and attention of the
Triton backend against the torch backend's, on the same metadata) over a speculative plan
(doubled rings: 16 C4 slots per SWA page, 256 C128 rows per request) and verify rows with a
``rollback_len``: the ring writes of the shorter tail, the row sets of 4 per request, block
completions at 127 (C4 and C128) inside a verify, a truncation to the accepted length and a
second verify reading what the first left in the rings; two requests' verifies in one step. Tiny 3-layer model, float32; the 125-token prefill before runs on the torch backend.
"""

from __future__ import annotations

import torch

from dsv4_backend.model_runner import ForwardRequest, ModelRunner
from dsv4_backend.triton_backend import TritonDSV4Backend
from dsv4_backend.weights import random_weights
from memory.allocator import KVAllocator
from memory.configurator import DSV4PoolConfigurator
from memory.pools import DSV4KVPools

from test_triton_backend import CFG, LockStep, tokens


def test_lockstep_verify_rows_with_doubled_rings():
    weights = random_weights(CFG, seed=3, dtype=torch.float32, include_mtp=False)
    plan = DSV4PoolConfigurator(CFG, max_running_requests=2, swa_ratio=0.5, speculative=True,
                                draft_tokens=4).plan_for_tokens(2048)
    assert (plan.c4_ring_size, plan.c128_ring_size) == (16, 256)
    pools = DSV4KVPools(CFG, plan)
    alloc = KVAllocator(plan, max_context=plan.max_full_tokens, window=CFG.sliding_window)
    runner = ModelRunner(CFG, weights, pools, alloc, backend="torch")
    test = TritonDSV4Backend(CFG, DSV4KVPools(CFG, plan, state_dtype=pools.state_dtype), alloc, dtype=torch.float32)
    lock = LockStep(runner.backend, test)
    seq = {"a": tokens(140, 1), "b": tokens(40, 2)}
    slot = {rid: alloc.admit(rid) for rid in seq}

    def step(parts):
        reqs = []
        for rid, start, n, rollback in parts:
            alloc.extend(rid, start + n)
            reqs.append(ForwardRequest(slot[rid], start, seq[rid][start:start + n], "all", rollback))
        runner.forward(reqs)

    step([("a", 0, 125, None), ("b", 0, 20, None)])    # the prefills on the torch backend alone
    runner.backend = lock
    step([("a", 125, 4, 126), ("b", 20, 4, 21)])       # a: verify 125..128, blocks end at 127 (C4, C128)
    alloc.truncate("a", 127)                           # one draft accepted
    step([("a", 127, 4, 128)])                         # reads the rings the first verify left
    assert lock.layers_seen == {0, 4, 128}
    assert lock.rows_written == {"c4_kv", "c128_kv"}
    for rid in seq:
        alloc.free(rid)
    alloc.check_integrity()


def test_lockstep_verify_rows_online_c128():
    """The online C128 state (SGLANG_OPT_USE_ONLINE_COMPRESS) under verify rows: the Triton
    backend's fold of a verify crossing 127 / 128 and the history states it records equal the
    torch backend's (the same function, so bit for bit); after the rollback to one kept draft
    (the state after 126) a second verify completes C128 block 0 from that state in both."""
    from dsv4_backend.online_history import history_slots
    from dsv4_backend.rollback import snapshot_for_verify

    weights = random_weights(CFG, seed=3, dtype=torch.float32, include_mtp=False)
    plan = DSV4PoolConfigurator(CFG, max_running_requests=2, swa_ratio=0.5, speculative=True, draft_tokens=4,
                                online_compress=True).plan_for_tokens(2048)
    assert plan.online_history_size == 4 and plan.c128_ring_rows == 0
    pools = DSV4KVPools(CFG, plan)
    alloc = KVAllocator(plan, max_context=plan.max_full_tokens, window=CFG.sliding_window)
    runner = ModelRunner(CFG, weights, pools, alloc, backend="torch")
    test = TritonDSV4Backend(CFG, DSV4KVPools(CFG, plan, state_dtype=pools.state_dtype), alloc, dtype=torch.float32)
    ref = runner.backend
    lock = LockStep(ref, test)
    seq = {"a": tokens(140, 1), "b": tokens(40, 2)}
    slot = {rid: alloc.admit(rid) for rid in seq}
    hist = [s for rid in seq for s in history_slots(plan, slot[rid], 4)]
    seen = []

    def compare_history(layer_id, layer, inputs, meta):
        # the history slots as each backend leaves them, from the same pools before the layer
        from test_triton_backend import _copy_pools
        _copy_pools(test.pools, ref.pools)
        before = {k: t.clone() for k, t in ref.pools.c128_online.items()}
        o = LockStep.forward(lock, layer_id, layer, inputs, meta)
        if layer_id in ref.pools.c128_online:
            want = ref.pools.c128_online[layer_id][hist].clone()
            ref.pools.c128_online[layer_id].copy_(before[layer_id])
            test.pools.c128_online[layer_id].copy_(before[layer_id])
            test._compress_online_kernel(test._step_plan(meta), layer, layer_id, inputs.compressor, meta,
                                         test._step_plan(meta).online)
            ref.forward(layer_id, layer, inputs, meta)
            assert torch.equal(test.pools.c128_online[layer_id][hist], want)
            assert torch.equal(ref.pools.c128_online[layer_id][hist], want)
            seen.append(bool((want != before[layer_id][hist]).any()))
        return o

    def step(parts):
        reqs = []
        for rid, start, n, rollback in parts:
            alloc.extend(rid, start + n)
            reqs.append(ForwardRequest(slot[rid], start, seq[rid][start:start + n], "all", rollback))
        runner.forward(reqs)

    step([("a", 0, 125, None), ("b", 0, 20, None)])    # the prefills on the torch backend alone
    lock.forward = compare_history
    runner.backend = lock
    snap = snapshot_for_verify(ref, alloc, [("a", slot["a"], 125, 3), ("b", slot["b"], 20, 3)])
    step([("a", 125, 4, 126), ("b", 20, 4, 21)])       # a: verify 125..128, C128 block 0 ends at 127
    assert seen and all(seen)
    snap.restore({"a": 127, "b": 24})                  # a keeps one draft, b all three
    for layer, t in ref.pools.c128_online.items():
        assert torch.equal(t[slot["a"]], t[history_slots(plan, slot["a"], 2)[1]])
    alloc.truncate("a", 127)
    alloc.truncate("b", 24)
    step([("a", 127, 4, 128)])                         # completes block 0 from the restored state
    assert lock.layers_seen == {0, 4, 128}
    assert "c128_kv" in lock.rows_written
    for rid in seq:
        alloc.free(rid)
    alloc.check_integrity()
