"""Speculative decoding over the online C128 state (``SGLANG_OPT_USE_ONLINE_COMPRESS=1``), float64, CPU.

- ``record_online_history`` against a direct softmax over each history state's tokens (written
  out here from the definition): verifies starting inside a block, at a block start, at a block
  end, crossing 127 / 128, in one batch with different row counts;
- ``OnlineRollback.restore`` copies the last kept position's state into the main slot;
- greedy outputs with speculation equal plain decoding's (both online), token for token, and the
  logits of every kept position within 1e-9, with forced acceptance lengths whose verifies are
  checked to include every kind of 128-boundary (a rejected / an accepted position completing a
  block, a verify starting at a block end / a block start, the kept length ending a block),
  a batch mixing lengths with a sampled neighbour, K = 9 with prefill chunks of 7, retraction
  and an abort;
- the state after rejections (the online main slot, C128 / C4 / indexer rows, C4 rings) equals a
  plain decode's of the same tokens; without the rollback it does not (the control);
- the plan: draft_tokens history states per request, within SGLang's reservation, and the
  refusal when it has none.

The engine model is tests/test_speculative.py's tiny preset (window, CSA, HCA, CSA + MTP),
vocabulary 1024, seeded random weights.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dsv4_backend.config import DSV4Config
from dsv4_backend.online_history import OnlineHistory, OnlineRollback, history_slots, record_online_history
from dsv4_backend.rollback import MAX_DRAFT_TOKENS, VerifySnapshot
from memory import env
from memory.configurator import DSV4PoolConfigurator, PlanError
from memory.layout import read_indexer_rows, read_kv_rows
from scheduler_hooks.io import GenerateRequest, SamplingParams

from test_speculative import EXACT_TOL, GREEDY, V, _prompts, assert_pools_free, make_engine

K = 3


@pytest.fixture(autouse=True)
def _online(monkeypatch):
    monkeypatch.setenv(env.USE_ONLINE_COMPRESS, "1")


# ---- the history states -------------------------------------------------------------------------

def _direct(z: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """(max, sum, kv) over tokens [n, d] straight from the definition."""
    mx = z.max(dim=0).values
    e = (z - mx).exp()
    return torch.stack([mx, e.sum(dim=0), (e * c).sum(dim=0)])


def test_history_states_equal_the_definition():
    """State j = the softmax pool of position n + j's block over positions <= n + j (< n + j
    when it completes the block), the stored state standing for the block's positions < n."""
    d, g = 16, torch.Generator().manual_seed(0)
    plan = DSV4PoolConfigurator(DSV4Config.preset("tiny"), max_running_requests=6, speculative=True,
                                draft_tokens=5, online_compress=True,
                                state_dtype=torch.float64).plan_for_tokens(2048)
    slots = plan.online_state_slots * (1 + plan.online_history_size) + 1
    # (request slot, first position n, rows): inside a block, ending at 127, starting at 127,
    # starting at 128, crossing 255 / 256, a fresh request at 0, one row
    cases = [(0, 60, 4), (1, 124, 4), (2, 127, 5), (3, 128, 3), (4, 253, 5), (5, 0, 2), (1, 300, 1)]
    for batch in (cases[:6], cases[6:]):
        state = torch.randn(slots, 3, d, generator=g, dtype=torch.float64)
        before = state.clone()
        seqs, toks, pos, dest = {}, [], [], []
        T = 0
        for slot, n, q in batch:
            hi = n + q
            z = torch.randn(hi, d, generator=g, dtype=torch.float64) * 3
            c = torch.randn(hi, d, generator=g, dtype=torch.float64)
            seqs[slot] = (n, q, z, c, T)
            b0 = n // 128 * 128
            if n > b0:                        # the stored state: the block's positions before n
                state[slot] = _direct(z[b0:n], c[b0:n])
            toks.append(list(range(T, T + q)))
            pos.append(list(range(n, hi)))
            dest.append(history_slots(plan, slot, q))
            T += q
        qmax = max(q for _, _, q in batch)
        pad = lambda rows, v: torch.tensor([r + [v] * (qmax - len(r)) for r in rows])  # noqa: E731
        flat = [i * qmax + j for i, (_, _, q) in enumerate(batch) for j in range(q)]
        hist = OnlineHistory(torch.tensor([s for s, _, _ in batch]), pad(toks, -1), pad(pos, 0),
                             torch.tensor([n for _, n, _ in batch]), torch.tensor(flat),
                             torch.tensor([h for row in dest for h in row]))
        c_new = torch.cat([c[n:] for n, _, _, c, _ in seqs.values()])
        z_new = torch.cat([z[n:] for n, _, z, _, _ in seqs.values()])
        main = state[: plan.online_state_slots + 1].clone()
        record_online_history(state, hist, c_new, z_new)
        assert torch.equal(state[: plan.online_state_slots + 1], main)       # main slots untouched
        written = set()
        for slot, (n, q, z, c, _) in seqs.items():
            for j, h in enumerate(history_slots(plan, slot, q)):
                p = n + j
                b0 = p // 128 * 128
                hi = p if (p + 1) % 128 == 0 else p + 1
                want = _direct(z[b0:hi], c[b0:hi])
                got = state[h]
                assert torch.equal(got[0], want[0])                            # the max is exact
                assert torch.allclose(got[1:], want[1:], rtol=1e-13, atol=1e-13 * float(want[1].max())), (slot, n, j)
                written.add(h)
        untouched = [s for s in range(slots) if s not in written and s > plan.online_state_slots]
        assert torch.equal(state[untouched], before[untouched])


def test_rollback_copies_the_last_kept_state():
    plan = DSV4PoolConfigurator(DSV4Config.preset("tiny"), max_running_requests=2, speculative=True,
                                draft_tokens=4, online_compress=True,
                                state_dtype=torch.float64).plan_for_tokens(2048)

    class Pools:
        device = torch.device("cpu")
    pools = Pools()
    pools.plan = plan
    n_slots = plan.online_state_slots * (1 + plan.online_history_size) + 1
    pools.c128_online = {2: torch.randn(n_slots, 3, 8, dtype=torch.float64)}
    ref = pools.c128_online[2].clone()
    rb = OnlineRollback.for_verifies(pools, [("a", 0, 50, 3), ("b", 1, 126, 2)])
    assert rb.restore({"a": 50 + 2, "b": 126 + 3}) == 2              # a: one draft kept; b: all
    got = pools.c128_online[2]
    assert torch.equal(got[0], ref[history_slots(plan, 0, 2)[1]])
    assert torch.equal(got[1], ref[history_slots(plan, 1, 3)[2]])
    assert torch.equal(got[2:], ref[2:])
    assert rb.restore({}) == 0
    with pytest.raises(ValueError, match="'a'"):
        rb.restore({"a": 55})
    with pytest.raises(ValueError, match="history states"):
        OnlineRollback.for_verifies(pools, [("c", 0, 10, 4)])           # 5 rows, 4 states


# ---- outputs and logits ---------------------------------------------------------------------

_PLAIN: dict[str, tuple] = {}


def run_plain(prompts, params, **kw):
    """Plain decoding's outputs and captured logits, online C128 too (the fixture's flag)."""
    key = repr((prompts, params, sorted(kw.items())))
    if key not in _PLAIN:
        with make_engine(None, **kw) as eng:
            assert eng.pools.c128_online and not eng.pools.c128_ring
            outs = eng.generate(input_ids=prompts, sampling_params=params)
            _PLAIN[key] = ([o["output_ids"] for o in outs],
                           [eng.captured_logits(o["meta_info"]["id"]) for o in outs])
    return _PLAIN[key]


def forcing(eng, truth: dict[tuple, list[int]], lengths, log: list):
    """draft_override: the true continuation for the next of ``lengths`` drafts, then wrong
    tokens; logs each verify's (first position n, drafts k, accepted a)."""
    cycle = itertools.cycle(lengths)

    def override(rid: str, n: int, drafts: list[int]) -> list[int]:
        seq = truth[tuple(eng.scheduler.reqs[rid].prompt_ids)]
        k, a = len(drafts), next(cycle)
        true = seq[n + 1:n + 1 + k]
        true += [0] * (k - len(true))
        log.append((n, k, min(a, k)))
        return [t if j < a else (t + 1) % V for j, t in enumerate(true)]
    return override


def boundary_cases(log) -> set[str]:
    """Which kinds of 128-boundary the logged verifies (n, k, a) hit."""
    seen = set()
    for n, k, a in log:
        if any(p % 128 == 127 for p in range(n + a + 1, n + k + 1)):
            seen.add("rejected completes")
        if any(p % 128 == 127 for p in range(n + 1, n + a + 1)):
            seen.add("accepted draft completes")
        if n % 128 == 127:
            seen.add("first row completes")
        if n % 128 == 0:
            seen.add("first row starts a block")
        if a < k and (n + a + 1) % 128 == 0:
            seen.add("kept length ends a block")
    return seen


ALL_CASES = {"rejected completes", "accepted draft completes", "first row completes", "first row starts a block",
             "kept length ends a block"}


def _check_outputs(eng, outs, want, want_lg):
    for o, w, wl in zip(outs, want, want_lg):
        assert o["output_ids"] == w
        got = eng.captured_logits(o["meta_info"]["id"])
        assert got.shape == wl.shape
        assert (got - wl).abs().max().item() <= EXACT_TOL


def test_greedy_equals_plain_across_c128_boundaries():
    """Prompts ending just before 128 and 256, decoded through their block ends
    with acceptance lengths cycling 3, 0, 2, 1, 3, 3, 0; a seeded sampled request beside them."""
    prompts = _prompts([124, 126, 127, 250])
    params = [dict(GREEDY, max_new_tokens=n) for n in (14, 12, 10, 14)]
    prompts.append(_prompts([40], seed=2)[0])
    params.append({"temperature": 0.8, "seed": 7, "max_new_tokens": 8, "ignore_eos": True})
    want, want_lg = run_plain(prompts, params)
    log: list = []
    with make_engine() as eng:
        assert eng.plan.online_history_size == K + 1
        truth = {tuple(p): p + w for p, w in zip(prompts, want)}
        eng.scheduler.spec.draft_override = forcing(eng, truth, (3, 0, 2, 1, 3, 3, 0), log)
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert len(outs[-1]["output_ids"]) == 8
        _check_outputs(eng, outs[:-1], want, want_lg)
        hist = {int(k): v for k, v in eng.stats()["speculative"]["accept_length_histogram"].items()}
        assert all(hist[n] > 0 for n in range(1, K + 2)), hist
        assert_pools_free(eng)
    assert boundary_cases(log) == ALL_CASES, log


def test_max_drafts_chunk_of_seven():
    """K = 9, prefill chunks of 7 (the chunk boundaries fall inside C128 block 0), decoding
    through 127 with acceptance lengths 10, 1, 5, 9, 2."""
    k = MAX_DRAFT_TOKENS
    prompts = _prompts([108, 9], seed=5)
    params = dict(GREEDY, max_new_tokens=30)
    want, want_lg = run_plain(prompts, params, chunked_prefill_size=7)
    log: list = []
    with make_engine(k, chunked_prefill_size=7) as eng:
        truth = {tuple(p): p + w for p, w in zip(prompts, want)}
        eng.scheduler.spec.draft_override = forcing(eng, truth, (9, 0, 4, 8, 1), log)
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        _check_outputs(eng, outs, want, want_lg)
        assert_pools_free(eng)
    assert {"rejected completes", "accepted draft completes"} <= boundary_cases(log), log


def test_retraction_and_abort():
    """Two full pages: the newer request is retracted mid-verify and recomputed (its online
    state rebuilt by the re-prefill), both decode through 255; then an abort while decoding."""
    prompts = _prompts([240, 236], seed=4)
    params = [dict(GREEDY, max_new_tokens=24), dict(GREEDY, max_new_tokens=26)]
    kw = dict(max_running_requests=2, max_total_tokens=512, chunked_prefill_size=128)
    want, want_lg = run_plain(prompts, params, **kw)
    log: list = []
    with make_engine(**kw) as eng:
        truth = {tuple(p): p + w for p, w in zip(prompts, want)}
        eng.scheduler.spec.draft_override = forcing(eng, truth, (3, 1, 3, 2), log)
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert eng.scheduler.num_retractions >= 1
        _check_outputs(eng, outs, want, want_lg)
        assert_pools_free(eng)
        eng.scheduler.spec.draft_override = None
        eng.scheduler.add(GenerateRequest(prompts[0][:125], SamplingParams(max_new_tokens=30, temperature=0),
                                          rid="gone"))
        while not eng.scheduler.reqs["gone"].output_ids[5:]:
            eng.step()
        assert eng.scheduler.abort("gone").finish_reason["type"] == "abort"
        eng.step()
        assert "gone" not in eng.scheduler.spec.states
        assert_pools_free(eng)
    assert any(n < 255 <= n + k for n, k, _ in log)


# ---- the state after rollback ---------------------------------------------------------------------

def _live_state(eng, rid: str) -> dict[str, torch.Tensor]:
    """Every C4, indexer and C128 row of the request's full pages, every C4 ring slot of its SWA
    pages, and its online main slot (live: its kept length is inside an open block)."""
    alloc, pools, plan = eng.allocator, eng.pools, eng.plan
    req = alloc._req(rid)
    full = torch.tensor(req.full_pages, dtype=torch.int64)
    c4_rows = (full[:, None] * (plan.full_page // 4) + torch.arange(plan.full_page // 4)).reshape(-1)
    c128_rows = (full[:, None] * (plan.full_page // 128) + torch.arange(plan.full_page // 128)).reshape(-1)
    pages = torch.tensor([req.swa_pages[k] for k in sorted(req.swa_pages)], dtype=torch.int64)
    R4 = plan.c4_ring_size
    ring_slots = (pages[:, None] * R4 + torch.arange(R4)).reshape(-1)
    out = {}
    for layer in pools.c4_kv:
        out[f"c4.{layer}"] = read_kv_rows(pools.c4_kv[layer], c4_rows)
        out[f"idx.{layer}"] = read_indexer_rows(pools.c4_indexer[layer], c4_rows)
        out[f"ring4.{layer}"] = pools.c4_ring[layer][ring_slots]
        out[f"iring4.{layer}"] = pools.c4_indexer_ring[layer][ring_slots]
    for layer in pools.c128_kv:
        out[f"c128.{layer}"] = read_kv_rows(pools.c128_kv[layer], c128_rows)
        out[f"online.{layer}"] = pools.c128_online[layer][req.slot]
    return out


@pytest.mark.parametrize("restore", [True, False], ids=["rollback", "no-rollback-control"])
def test_state_after_rollback_equals_plain(restore, monkeypatch):
    """Verifies rejecting the position completing C128 block 0 (127) and positions of block 1;
    the run stops on a verify that rejects inside block 1. The online main slot and every row
    then equal a plain decode's of the kept tokens; with the restore off they do not."""
    prompt = _prompts([110], seed=6)[0]
    new = 40
    want, _ = run_plain([prompt], dict(GREEDY, max_new_tokens=new))
    seq = prompt + want[0]
    stop = 110 + 27
    log: list = []
    if not restore:
        monkeypatch.setattr(VerifySnapshot, "restore", lambda self, keep: 0)
    with make_engine(max_running_requests=1) as spec_eng, make_engine(max_running_requests=1) as plain:
        plain.scheduler.spec.num_drafts = lambda r, ctx: 0
        pattern = itertools.cycle((0, 1, 0, 2, 3, 1))

        def override(rid, n, drafts):
            k = len(drafts)
            a = next(pattern)
            if n < 127 <= n + k:
                a = min(a, 126 - n)         # reject from 127 on: its row completes C128 block 0
            if n + k + 1 >= stop:
                a = 0                       # the last verify rejects
            log.append((n, k, a))
            return [t if j < a else (t + 1) % V for j, t in enumerate(seq[n + 1:n + 1 + k])]
        spec_eng.scheduler.spec.draft_override = override

        for eng, length in ((spec_eng, stop), (plain, None)):
            eng.scheduler.add(GenerateRequest(prompt, SamplingParams(max_new_tokens=new, temperature=0,
                                                                     ignore_eos=True), rid="r"))
            length = length or spec_eng.scheduler.reqs["r"].kv_len
            while eng.scheduler.reqs["r"].kv_len < length:
                eng.step()
        L = spec_eng.scheduler.reqs["r"].kv_len
        assert plain.scheduler.reqs["r"].kv_len == L and L % 128
        assert "rejected completes" in boundary_cases(log)
        n, k, a = log[-1]
        assert a == 0 and n // 128 == 1          # the last verify's rejected rows are in the live block
        got, ref = _live_state(spec_eng, "r"), _live_state(plain, "r")
        same = {key: got[key].shape == ref[key].shape and (got[key] - ref[key]).abs().max().item() <= EXACT_TOL
                for key in ref}
        if restore:
            assert all(same.values()), [key for key, ok in same.items() if not ok]
        else:
            assert not all(same[key] for key in same if key.startswith("online."))


# ---- the plan -----------------------------------------------------------------------------------

def test_plan_keeps_draft_token_states_per_request():
    """An online speculative plan: ``draft_tokens`` history states per request after the main
    slots and the dummy, inside SGLang's (R + 3)(1 + draft_tokens) reservation; the engine's
    plan has K + 1; without draft_tokens it is refused."""
    R, D = 3, 4
    conf = DSV4PoolConfigurator(DSV4Config.preset("tiny"), max_running_requests=R, speculative=True,
                                draft_tokens=D)
    plan = conf.plan_for_tokens(2048)
    assert plan.online_compress and plan.online_state_slots == R and plan.online_history_size == D
    shape = plan.pool_shapes()["c128_online"]
    assert shape.shape == (R * (1 + D) + 1, 3, 512)
    assert plan.fixed_bytes == (R + 3) * (1 + D) * 3 * 512 * 4 * 1 >= plan.pool_bytes()["c128_online"]
    assert history_slots(plan, R - 1, D)[-1] == R * (1 + D)                 # the last slot of the pool
    assert DSV4PoolConfigurator(DSV4Config.preset("tiny"), max_running_requests=R,
                                draft_tokens=D).plan_for_tokens(2048).online_history_size == 0
    with pytest.raises(PlanError, match="draft_tokens"):
        DSV4PoolConfigurator(DSV4Config.preset("tiny"), max_running_requests=R, speculative=True)
    with make_engine(max_running_requests=2, max_total_tokens=1024) as eng:
        assert eng.plan.online_history_size == K + 1
        assert {t.shape for t in eng.pools.c128_online.values()} == {(2 * (K + 2) + 1, 3, 512)}
