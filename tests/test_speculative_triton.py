"""Verify steps (s_q = k + 1 rows per request) through the Triton backend (TRITON_INTERPRET=1).

The lock-step harness of tests/test_triton_backend.py (each layer's writes and attention of the
Triton backend against the torch backend's, on the same metadata) over a speculative plan
(doubled rings: 16 C4 slots per SWA page, 256 C128 rows per request) and verify rows with a
``rollback_len``: the ring writes of the shorter tail, the row sets of 4 per request, block
completions at 127 (C4 and C128) inside a verify, a truncation to the accepted length and a
second verify reading what the first left in the rings; two requests' verifies in one step. Tiny 3-layer model, float32; the 125-token prefill before runs on the torch backend.
The verify steps run with the s_q-row kernel (``DSV4_VERIFY_KERNEL=1``) and without it, and an
engine's speculative greedy output with that kernel equals plain decoding's.
"""

from __future__ import annotations

import os

import pytest
import torch

from dsv4_backend import kernels
from dsv4_backend.model_runner import ForwardRequest, ModelRunner
from dsv4_backend.triton_backend import TritonDSV4Backend
from dsv4_backend.weights import random_weights
from memory.allocator import KVAllocator
from memory.configurator import DSV4PoolConfigurator
from memory.pools import DSV4KVPools

from test_triton_backend import CFG, LockStep, tokens


def _count_verify_calls(monkeypatch) -> list:
    """Wrap the s_q-row kernel the backend looks up: returns the list of s_q of each call."""
    from dsv4_backend.kernels.verify_attention import sparse_verify
    calls = []

    def counted(*args, **kw):
        calls.append(args[7])
        return sparse_verify(*args, **kw)
    monkeypatch.setattr(kernels, "sparse_verify", counted, raising=False)
    return calls


@pytest.mark.parametrize("verify_kernel", ["0", "1"], ids=["row-kernel", "verify-kernel"])
def test_lockstep_verify_rows_with_doubled_rings(verify_kernel, monkeypatch):
    monkeypatch.setenv("DSV4_VERIFY_KERNEL", verify_kernel)
    calls = _count_verify_calls(monkeypatch)
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
    # the s_q-row kernel ran every layer of both verify steps, and only when switched on
    assert calls == ([4] * 2 * CFG.num_hidden_layers if verify_kernel == "1" else [])
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


@pytest.mark.skipif(os.environ.get("DSV4_SLOW_TESTS") != "1",
                    reason="~5 min under the interpreter; DSV4_SLOW_TESTS=1 runs it (the lock-step tests above "
                           "check the s_q-row kernel in every layer of verify steps in make test's time)")
def test_speculative_greedy_with_the_verify_kernel_equals_plain(monkeypatch):
    """An engine on the Triton backend (float32, the interpreter) decoding greedily, and the same
    engine with speculation (K = 3) whose verify steps take the s_q-row kernel: drafts fed from
    the plain run's tokens with forced acceptance lengths 4, 1, 3, 2, so the verifies accept and
    reject at known places (a 122-token prompt: verifies across the C4 and C128 block ends at
    127). The outputs are equal token for token."""
    import itertools

    from dsv4_backend import Engine

    monkeypatch.setenv("DSV4_VERIFY_KERNEL", "1")
    calls = _count_verify_calls(monkeypatch)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (122, 9)]
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}

    def engine(spec: bool) -> Engine:
        kw = dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1,
                  speculative_num_draft_tokens=4) if spec else {}
        eng = Engine(preset="tiny", dtype="float32", config_overrides={"vocab_size": 512}, skip_tokenizer_init=True,
                     max_running_requests=2, max_total_tokens=2048, chunked_prefill_size=64, **kw)
        backend = TritonDSV4Backend(eng.config, eng.pools, eng.allocator, dtype=torch.float32)
        eng.runner.backend = backend
        if spec:
            eng.scheduler.spec.mtp.backend = backend
        return eng

    with engine(False) as eng:
        plain = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    assert calls == []
    truth = {tuple(p): p + o for p, o in zip(prompts, plain)}
    with engine(True) as eng:
        lengths = itertools.cycle([3, 0, 2, 1])

        def override(rid, n, drafts):
            seq, a = truth[tuple(eng.scheduler.reqs[rid].prompt_ids)], next(lengths)
            true = seq[n + 1:n + 1 + len(drafts)]
            true += [0] * (len(drafts) - len(true))
            return [t if j < a else (t + 1) % 512 for j, t in enumerate(true)]
        eng.scheduler.spec.draft_override = override
        got = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
        stats = eng.scheduler.spec.stats()
    assert got == plain
    assert stats["num_verify"] >= 4 and stats["accepted_drafts_total"] > 0
    assert 4 in calls
