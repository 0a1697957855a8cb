"""Static (CUDA-graph) speculative verify steps against eager ones, on the CPU.

The graph runner with ``capture=False`` (tests/test_cuda_graph.py's approach) runs the static
path eagerly: ``k + 1`` rows per request in fixed buffers, each row a decode row of its
request with its own window, ring write, compression event and top-k. One schedule runs
twice on the Triton backend (TRITON_INTERPRET=1) over a speculative plan (doubled rings), once
ordinarily and once through the static path: verifies of 4 rows for three requests (blocks of
4 and the C128 block ending at 127 complete inside a verify), truncations to different accepted
lengths between them, and plain decode steps in between (a speculative engine keeps their
graphs too). Both runs do the same operations on the same values in the same order (the static
ring write precedes the in-place read only where no candidate is overwritten:
``static_max_rows``), so logits, final streams and every pool must be bit-identical. The MTP
draft passes' graphs (``MTPDraftGraphs``) are checked the same way. ~45 s CPU time (the
interpreter).
"""

from __future__ import annotations

import pytest
import torch

from dsv4_backend.backend import ForwardBatch, TorchDSV4Backend
from dsv4_backend.config import DSV4Config
from dsv4_backend.cuda_graph import DecodeGraphs
from dsv4_backend.model_runner import ForwardRequest, ModelRunner
from dsv4_backend.mtp import MTPDraftLayer
from dsv4_backend.mtp_graph import MTPDraftGraphs
from dsv4_backend.weights import random_weights
from memory.allocator import KVAllocator
from memory.configurator import DSV4PoolConfigurator
from memory.pools import DSV4KVPools

from test_cuda_graph import _compare_pools

CFG = DSV4Config.preset("tiny", vocab_size=512, num_hidden_layers=3, compress_ratios=(0, 4, 128, 0),
                        index_topk=4)
Q = 4                     # rows per verify: the last token and 3 drafts


def _runner(weights, static: bool, max_bs: int = 3) -> ModelRunner:
    plan = DSV4PoolConfigurator(CFG, max_running_requests=4, swa_ratio=0.5, speculative=True,
                                draft_tokens=Q).plan_for_tokens(2048)
    pools = DSV4KVPools(CFG, plan)
    alloc = KVAllocator(plan, max_context=plan.max_full_tokens, window=CFG.sliding_window)
    runner = ModelRunner(CFG, weights, pools, alloc, dtype=torch.float32, backend="triton", cuda_graph=False)
    if static:
        runner.cuda_graphs = DecodeGraphs(runner, max_bs=max_bs, capture=False, min_context=512)
    return runner


def _schedule(runner: ModelRunner):
    """Prefills (torch backend), then verify / decode steps; returns every step's logits and streams."""
    alloc = runner.allocator
    lens = {"a": 122, "b": 19, "c": 6}
    seqs = {rid: torch.randint(0, CFG.vocab_size, (n + 20,), generator=torch.Generator().manual_seed(i)).tolist()
            for i, (rid, n) in enumerate(lens.items())}
    triton = runner.backend
    runner.backend = TorchDSV4Backend(CFG, runner.pools, alloc, dtype=torch.float32)
    for rid, n in lens.items():
        alloc.admit(rid)
        alloc.extend(rid, n)
        runner.forward([ForwardRequest(alloc.req_slot(rid), 0, seqs[rid][:n], "none")])
    runner.backend = triton
    out = []
    # accepted drafts per request after each verify (None: a plain decode step)
    for accepted in [(3, 0, 1), None, (1, 2, 3)]:
        q = 1 if accepted is None else Q
        reqs = []
        for rid, n in lens.items():
            assert alloc.extend(rid, n + q).ok
            reqs.append(ForwardRequest(alloc.req_slot(rid), n, seqs[rid][n:n + q], "all" if q > 1 else "last",
                                       n + 1 if q > 1 else None))
        logits = runner.forward(reqs)
        out.append((torch.cat(logits), runner.last_hidden.clone()))
        for i, rid in enumerate(lens):
            lens[rid] += 1 if accepted is None else accepted[i] + 1
            alloc.truncate(rid, lens[rid])
            alloc.evict_swa(rid)
    return out


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=7, dtype=torch.float32, include_mtp=False)


def test_static_verify_equals_eager_verify(weights):
    eager = _runner(weights, static=False)
    ref = _schedule(eager)
    static = _runner(weights, static=True)
    got = _schedule(static)
    assert static.cuda_graphs.replays == 3 and len(static.cuda_graphs._graphs) == 2   # q = 4 and q = 1
    for step, ((lg, X), (lg_ref, X_ref)) in enumerate(zip(got, ref)):
        assert lg.shape == lg_ref.shape and torch.equal(lg, lg_ref), f"step {step}: logits differ"
        assert torch.equal(X, X_ref), f"step {step}: final streams differ"
    _compare_pools(eager, static)


def test_static_rows_limit(weights):
    """The doubled rings take 9 rows a request (8 drafts); the plain plan's rings one."""
    runner = _runner(weights, static=False)
    assert runner.backend.static_max_rows() == 16 - 7
    with pytest.raises(ValueError, match="q=10"):
        runner.backend.static_decode(1, 512, 10)
    plain = ModelRunner.build(CFG, dtype=torch.float32, weights=weights, backend="triton", max_total_tokens=1024,
                              cuda_graph=False)
    assert plain.backend.static_max_rows() == 1
    graphs = DecodeGraphs(runner, max_bs=4, capture=False)
    verify = [ForwardRequest(0, 10, [1] * Q, "all", 11)]
    assert graphs.can_run(verify)
    assert not graphs.can_run([ForwardRequest(0, 10, [1] * Q, "all", None)])       # a prefill chunk
    assert not graphs.can_run(verify + [ForwardRequest(1, 10, [1] * 3, "all", 11)])  # mixed lengths
    assert not graphs.can_run([ForwardRequest(0, 10, [1] * 10, "all", 11)])          # past the rings


def test_static_mtp_draft_passes_equal_eager_ones():
    """Two chained MTP draft passes of three requests through the static path vs eagerly:
    streams, logits and the MTP layer's SWA pool bit-identical. Padded to a batch of 4 (row 0
    repeated, its writes masked; its GEMMs have a row more, so values are not compared) it
    writes the same SWA rows as the eager passes and no other."""
    weights = random_weights(CFG, seed=9, dtype=torch.float32, include_mtp=True)
    g = torch.Generator().manual_seed(4)
    lens = [40, 9, 130]
    H0 = torch.randn(len(lens), CFG.hc_mult, CFG.hidden_size, generator=g)
    first = torch.randint(0, CFG.vocab_size, (len(lens),), generator=g).tolist()

    def passes(max_bs):
        runner = _runner(weights, static=False)
        mtp = MTPDraftLayer(runner.model, runner.backend)
        graphs = None if max_bs is None else MTPDraftGraphs(runner, mtp, max_bs, capture=False, min_context=512)
        slots = []
        for i, n in enumerate(lens):
            slots.append(runner.allocator.admit(str(i)))
            runner.allocator.extend(str(i), n + 2)
        H, ids, out = H0, first, []
        for j in range(2):
            batch = ForwardBatch(slots, [n + j for n in lens], [1] * len(lens))
            if graphs is None:
                Y = mtp.forward(H, torch.tensor(ids), batch)
                lg = mtp.logits(Y)
            else:
                Y, lg = graphs.draft(H, ids, batch)
            out.append((Y, lg))
            H, ids = Y, lg.argmax(-1).tolist()
        if graphs is not None:
            assert graphs.replays == 2
        return out, runner.pools.swa_kv[mtp.layer_id]

    ref, pool_ref = passes(None)
    got, pool = passes(3)
    assert torch.equal(pool, pool_ref), "the MTP's SWA pool differs"
    for (Y, lg), (Y_ref, lg_ref) in zip(got, ref):
        assert torch.equal(Y, Y_ref) and torch.equal(lg, lg_ref)
    _, pool = passes(4)
    written = lambda p: (p.view(p.shape[0] * 128, -1) != 0).any(-1)     # noqa: E731 (rows written to)
    assert written(pool_ref).any() and torch.equal(written(pool), written(pool_ref))
