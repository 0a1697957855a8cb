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
draft passes' graphs (``MTPDraftGraphs``) are checked the same way, and so is the MTP pass over
a verify's kept positions through its graph path (all k + 1 rows of each verify), with a float64
check that the rows past the kept ones change nothing kept; last, a whole speculative engine
through the static path against the same engine eager. ~45 s CPU time (the interpreter), plus
~100 s for the engine comparison.
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
from dsv4_backend.triton_backend import TritonDSV4Backend
from dsv4_backend.weights import random_weights
from memory.allocator import KVAllocator
from memory.configurator import DSV4PoolConfigurator
from memory.layout import read_row_bytes
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


# bit-for-bit comparisons of padded (static) and unpadded (eager) key lists: one decode launch shape
pytestmark = pytest.mark.usefixtures("default_decode_launch")


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


class _KeptReq:
    """What ``SpeculativeDecoder.extend_mtp`` reads of a request after a verify kept ``kv_len``."""

    def __init__(self, rid: str, ids: list[int], kv_len: int):
        self.rid, self.ids, self.kv_len = rid, ids, kv_len
        self.remaining = 1              # the bonus token is not in the pools yet

    def ids_between(self, a: int, b: int) -> list[int]:
        return self.ids[a:b]


def _kept_setup(runner, lens, accepted, seed):
    """Three requests after a verify of Q rows at ``lens`` that accepted ``accepted`` drafts:
    positions n .. n + Q - 1 mapped, target streams [3 * Q, hc, D] (random), the next ids."""
    g = torch.Generator().manual_seed(seed)
    H = torch.randn(len(lens) * Q, CFG.hc_mult, CFG.hidden_size, generator=g, dtype=runner.dtype)
    spans = []
    for i, (n, a) in enumerate(zip(lens, accepted)):
        slot = runner.allocator.admit(str(i))
        runner.allocator.extend(str(i), n + Q)
        ids = torch.randint(0, CFG.vocab_size, (n + Q + 1,), generator=g).tolist()
        spans.append((_KeptReq(str(i), ids, n + a + 1), slot, n, i * Q))
    return H, spans


def test_static_mtp_kept_pass_equals_eager_one():
    """``extend_mtp`` over three verifies of Q rows (accepted 3, 0, 1 drafts) through the
    graph path (``MTPDraftGraphs.rows``, capture=False: all Q rows of each verify) against the
    eager MTP layer over the same rows: each request's draft state (token, streams of its last
    kept row) and the MTP's SWA pool bit-identical. Without ``rows`` it takes the eager path
    over the kept rows only, which makes no graph replay."""
    from scheduler_hooks.speculative import SpeculativeConfig, SpeculativeDecoder
    weights = random_weights(CFG, seed=9, dtype=torch.float32, include_mtp=True)
    lens, accepted = [40, 9, 130], [3, 0, 1]
    cfg = SpeculativeConfig("EAGLE", Q - 1)

    runner = _runner(weights, static=True)
    spec = SpeculativeDecoder(cfg, runner, runner.allocator)
    assert spec.mtp_graphs is not None and not spec.mtp_graphs.capture
    H, spans = _kept_setup(runner, lens, accepted, seed=5)
    spec.extend_mtp(spans, H, [Q] * len(spans))
    assert spec.mtp_graphs.replays == 1

    ref = _runner(weights, static=False)
    mtp = MTPDraftLayer(ref.model, ref.backend)
    H_ref, spans_ref = _kept_setup(ref, lens, accepted, seed=5)
    ids = []
    for r, _, n, _ in spans_ref:
        kept = r.ids[n + 1:r.kv_len + 1]
        ids += kept + kept[-1:] * (Q - len(kept))
    Y = mtp.forward(H_ref, torch.tensor(ids), ForwardBatch([s[1] for s in spans_ref], lens, [Q] * len(lens)))
    last = Y[[i * Q + a for i, a in enumerate(accepted)]]
    toks = mtp.logits(last).argmax(-1).tolist()
    for i, (r, _, _, _) in enumerate(spans):
        st = spec.states[r.rid]
        assert int(st.token) == toks[i] and torch.equal(st.hidden, last[i]), r.rid
    assert torch.equal(runner.pools.swa_kv[mtp.layer_id], ref.pools.swa_kv[mtp.layer_id])

    eager = SpeculativeDecoder(cfg, ref, ref.allocator)     # no graphs on this runner
    assert eager.mtp_graphs is None
    eager.extend_mtp(spans_ref, H_ref, [Q] * len(spans_ref))
    assert set(eager.states) == {r.rid for r, _, _, _ in spans_ref}


def test_mtp_rows_past_the_kept_ones_change_nothing_kept():
    """Why the graph pass may run over all Q rows: the MTP layer over the kept rows of each
    verify vs over all Q rows (float64, torch backend): the kept rows' streams within 1e-9 (the
    two differ only in the GEMMs' row counts) and the MTP's SWA rows of the kept positions
    byte-identical."""
    cfg = DSV4Config.preset("tiny", vocab_size=512, num_hidden_layers=3, compress_ratios=(0, 4, 128, 0), index_topk=4)
    weights = random_weights(cfg, seed=9, dtype=torch.float64, include_mtp=True)
    lens, accepted = [40, 9, 130], [3, 0, 1]
    out = []
    for all_rows in (False, True):
        plan = DSV4PoolConfigurator(cfg, max_running_requests=4, swa_ratio=0.5, speculative=True,
                                    draft_tokens=Q).plan_for_tokens(2048)
        pools = DSV4KVPools(cfg, plan, state_dtype=torch.float64)
        alloc = KVAllocator(plan, max_context=plan.max_full_tokens, window=cfg.sliding_window)
        runner = ModelRunner(cfg, weights, pools, alloc, dtype=torch.float64, backend="torch", cuda_graph=False)
        mtp = MTPDraftLayer(runner.model, runner.backend)
        H, spans = _kept_setup(runner, lens, accepted, seed=6)
        q = [Q if all_rows else a + 1 for a in accepted]
        rows = torch.tensor([i * Q + j for i, n in enumerate(q) for j in range(n)])
        ids = torch.tensor([t for (r, _, n, _), m in zip(spans, q) for t in r.ids[n + 1:n + 1 + m]])
        Y = mtp.forward(H[rows], ids, ForwardBatch([s[1] for s in spans], lens, q))
        kept = [j for j, row in enumerate(rows.tolist()) if row % Q <= accepted[row // Q]]
        slots = [int(alloc.full_to_swa[int(alloc.req_to_token[s[1], n + j])]) for s, n, a in zip(spans, lens, accepted)
                 for j in range(a + 1)]
        out.append((Y[kept], pools.swa_kv[mtp.layer_id], slots))
    (Y_kept, pool_kept, slots), (Y_all, pool_all, _) = out
    assert (Y_kept - Y_all).abs().max().item() <= 1e-9
    idx = torch.tensor(slots)
    assert torch.equal(read_row_bytes(pool_kept, idx), read_row_bytes(pool_all, idx))
    assert not torch.equal(pool_kept, pool_all)      # the extra rows did write (past the kept positions)


def test_engine_through_the_static_path_equals_the_eager_engine():
    """A speculative engine (float32, Triton under the interpreter) whose verify steps, draft
    passes and kept-position MTP passes take the static path (``capture=False``) against the
    same engine run eagerly. ``accept_override`` forces acceptance lengths 4, 1, 3, 2 whatever the
    drafts are, so the emitted tokens are the MTP's own drafts: a wrong kept-pass row, a draft
    state given to the wrong request or a truncation before the kept pass changes them."""
    import itertools

    from dsv4_backend import Engine
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 9)]

    def run(static: bool):
        eng = Engine(preset="tiny", dtype="float32", config_overrides={"vocab_size": 512}, skip_tokenizer_init=True,
                     max_running_requests=2, max_total_tokens=2048, chunked_prefill_size=64,
                     speculative_algorithm="EAGLE", speculative_num_steps=Q - 1, speculative_eagle_topk=1,
                     speculative_num_draft_tokens=Q)
        with eng:
            spec = eng.scheduler.spec
            # the Triton backend in both runs (the engine picks the torch one on the CPU)
            eng.runner.backend = spec.mtp.backend = TritonDSV4Backend(eng.config, eng.pools, eng.allocator,
                                                                      dtype=torch.float32)
            if static:
                eng.runner.cuda_graphs = DecodeGraphs(eng.runner, max_bs=2, capture=False, min_context=512)
                spec.mtp_graphs = MTPDraftGraphs(eng.runner, spec.mtp, 2, capture=False, min_context=512)
            accepted = itertools.cycle([3, 0, 2, 1])
            spec.accept_override = lambda rid, k: next(accepted)
            outs = eng.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 11,
                                                                   "ignore_eos": True})
            graphs = (eng.runner.cuda_graphs, spec.mtp_graphs)
            return [o["output_ids"] for o in outs], graphs, spec.stats()

    ref, none, _ = run(False)
    assert none == (None, None)
    got, (target, mtp), stats = run(True)
    assert got == ref
    assert stats["num_verify"] >= 6 and target.replays >= 3
    assert {1, Q} <= {key[2] for key in mtp._graphs}        # draft passes and kept passes replayed
