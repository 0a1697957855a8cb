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
