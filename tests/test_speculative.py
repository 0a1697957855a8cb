"""Speculative decoding with the MTP draft layer against plain decoding (float64, CPU).

- the engine's MTP layer (paged SWA KV, chunked) equals ``reference_mtp_forward``;
- greedy outputs with speculation equal those without, token for token, and the raw logits of
  every position the engine kept equal plain decoding's within 1e-9, with the MTP's own drafts
  (random weights accept almost none) and with drafts forced to chosen acceptance lengths
  (``draft_override`` feeds the known greedy continuation, then wrong tokens), across C4 / C128
  boundaries, chunked prefill, batches mixing acceptance lengths, a sampled neighbour, retraction
  and aborts;
- the compressed state after rejections (compressed rows, indexer rows, both rings of every
  held page) equals a plain decode's of the same tokens, also when a rejected token completed
  a C4 or C128 block; without the rollback it does not;
- the flags are validated and the accepted-length metrics add up.

The model is the tiny preset (4 layers: window, CSA, HCA, CSA + the MTP layer), vocabulary
1024, seeded random weights, one CPU thread. Whole file: ~35 s on the shared two-core machine.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dsv4_backend import Engine
from dsv4_backend.backend import ForwardBatch
from dsv4_backend.config import DSV4Config
from dsv4_backend.model_runner import ForwardRequest
from dsv4_backend.mtp import MTPDraftLayer
from dsv4_backend.reference import reference_forward, reference_mtp_forward
from dsv4_backend.rollback import MAX_DRAFT_TOKENS, VerifySnapshot
from dsv4_backend.weights import random_weights
from memory.layout import read_indexer_rows, read_kv_rows
from scheduler_hooks.io import GenerateRequest, SamplingParams
from scheduler_hooks.speculative import SpeculativeConfig

V = 1024
# float64 throughout: the engine's and the reference's sums differ by a few ulps of O(1)
# values (~1e-14); FP8 rounding then decides identically, so 1e-9 is far above the noise
# and far below any real difference (one e4m3 step of a KV element moves logits by ~1e-3).
EXACT_TOL = 1e-9
K = 3
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_engine(k: int | None = K, **kw) -> Engine:
    args = dict(preset="tiny", dtype="float64", config_overrides={"vocab_size": V}, skip_tokenizer_init=True,
                max_running_requests=4, max_total_tokens=4096, chunked_prefill_size=64, capture_logits=True)
    args.update(kw)
    if k is not None:
        args.update(speculative_algorithm="EAGLE", speculative_num_steps=k, speculative_eagle_topk=1,
                    speculative_num_draft_tokens=k + 1)
    return Engine(**args)


_PLAIN: dict[str, tuple] = {}


def run_plain(prompts, params, **kw):
    """Outputs and captured logits of plain decoding (no speculation), computed once per case."""
    key = repr((prompts, params, sorted(kw.items())))
    if key not in _PLAIN:
        with make_engine(None, **kw) as eng:
            outs = eng.generate(input_ids=prompts, sampling_params=params)
            _PLAIN[key] = ([o["output_ids"] for o in outs],
                           [eng.captured_logits(o["meta_info"]["id"]) for o in outs])
    return _PLAIN[key]


def oracle(eng: Engine, truth: dict[tuple, list[int]], lengths):
    """A draft_override feeding the true greedy continuation for the next acceptance length of
    ``lengths`` (accepted drafts), then wrong tokens: forces that acceptance exactly."""
    cycle = itertools.cycle(lengths)

    def override(rid: str, n: int, drafts: list[int]) -> list[int]:
        seq = truth[tuple(eng.scheduler.reqs[rid].prompt_ids)]
        a = next(cycle)
        true = seq[n + 1:n + 1 + len(drafts)]
        true += [0] * (len(drafts) - len(true))
        return [t if j < a else (t + 1) % V for j, t in enumerate(true)]
    return override


def assert_pools_free(eng: Engine) -> None:
    eng.check_integrity()
    assert all(v["used"] == 0 for v in eng.pool_usage().values()), eng.pool_usage()


# ---- the MTP layer ----------------------------------------------------------------------------

def test_mtp_layer_equals_reference():
    """Engine MTP pass (paged window KV, two chunks crossing the 128-token window) == reference."""
    cfg = DSV4Config.preset("tiny", vocab_size=V)
    ids = torch.randint(0, V, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    weights = random_weights(cfg, seed=0, dtype=torch.float64, include_mtp=True)
    ref = reference_forward(cfg, weights, ids, return_hidden=True)
    want = reference_mtp_forward(cfg, weights, ids, ref.hidden)                       # [T-1, V]
    with make_engine(max_running_requests=1, max_total_tokens=1024) as eng:
        alloc, runner = eng.allocator, eng.runner
        slot = alloc.admit("x")
        alloc.extend("x", len(ids))
        [lg] = runner.forward([ForwardRequest(slot, 0, ids, "all")])
        assert (lg - ref.logits).abs().max().item() <= EXACT_TOL
        hidden = runner.last_hidden
        mtp = MTPDraftLayer(runner.model, runner.backend)
        got = []
        for s, e in ((0, 97), (97, len(ids) - 1)):
            Y = mtp.forward(hidden[s:e], torch.tensor(ids[s + 1:e + 1]), ForwardBatch([slot], [s], [e - s]))
            got.append(mtp.logits(Y))
        alloc.free("x")
    assert (torch.cat(got) - want).abs().max().item() <= EXACT_TOL


# ---- outputs and logits ---------------------------------------------------------------------

BATCH_PROMPTS = [5, 122, 60]       # 122 + n completes a C128 block while decoding


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("forced", [None, (3, 0, 2, 1, 3, 3, 0)], ids=["mtp-drafts", "forced-acceptance"])
def test_greedy_equals_plain(forced):
    prompts = _prompts(BATCH_PROMPTS)
    params = [dict(GREEDY, max_new_tokens=n) for n in (20, 16, 9)]
    # a seeded sampled request rides along: it verifies drafts by rejection sampling
    # (tests/test_rejection.py checks its distribution), so only its greedy neighbours' outputs
    # are compared; it must not disturb them
    prompts.append(_prompts([40], seed=2)[0])
    params.append({"temperature": 0.8, "seed": 7, "max_new_tokens": 8, "ignore_eos": True})
    want, want_lg = run_plain(prompts, params, max_running_requests=3)
    with make_engine(max_running_requests=3) as eng:
        if forced:
            truth = {tuple(p): p + w for p, w in zip(prompts, want)}
            eng.scheduler.spec.draft_override = oracle(eng, truth, forced)
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert len(outs[-1]["output_ids"]) == 8
        for o, w, wl in zip(outs[:-1], want, want_lg):
            assert o["output_ids"] == w
            got = eng.captured_logits(o["meta_info"]["id"])
            assert got.shape == wl.shape
            assert (got - wl).abs().max().item() <= EXACT_TOL
        st = eng.stats()["speculative"]
        hist = {int(k): v for k, v in st["accept_length_histogram"].items()}
        assert sum(hist.values()) == st["num_verify"] > 0
        if forced:
            assert all(hist[n] > 0 for n in range(1, K + 2)), hist
            assert st["accepted_drafts_total"] == sum((n - 1) * c for n, c in hist.items())
        assert_pools_free(eng)


def test_eos_inside_an_accepted_chain():
    """EOS is the 6th greedy token and is accepted as a draft: the request stops there, with
    plain decoding's outputs and captured logits (nothing past the stop)."""
    prompts = _prompts([30], seed=8)
    free, _ = run_plain(prompts, dict(GREEDY, max_new_tokens=12))
    eos = free[0][5]
    stop_at = free[0].index(eos)
    params = {"temperature": 0, "max_new_tokens": 12}
    kw = dict(config_overrides={"vocab_size": V, "eos_token_id": eos})
    want, want_lg = run_plain(prompts, params, **kw)
    assert len(want[0]) == stop_at + 1
    with make_engine(**kw) as eng:
        eng.scheduler.spec.draft_override = oracle(eng, {tuple(prompts[0]): prompts[0] + free[0]}, (3,))
        [out] = eng.generate(input_ids=prompts, sampling_params=params)
        assert out["output_ids"] == want[0] and out["meta_info"]["finish_reason"]["type"] == "stop"
        got = eng.captured_logits(out["meta_info"]["id"])
        assert got.shape == want_lg[0].shape and (got - want_lg[0]).abs().max().item() <= EXACT_TOL
        assert_pools_free(eng)


def test_max_drafts_chunk_of_seven():
    """K = 9 (the most the doubled ring holds), prefill chunks of 7, every length accepted."""
    k = MAX_DRAFT_TOKENS
    prompts = _prompts([20, 9], seed=5)
    params = dict(GREEDY, max_new_tokens=30)
    want, want_lg = run_plain(prompts, params, chunked_prefill_size=7)
    with make_engine(k, chunked_prefill_size=7) as eng:
        truth = {tuple(p): p + w for p, w in zip(prompts, want)}
        eng.scheduler.spec.draft_override = oracle(eng, truth, (9, 0, 4, 8, 1))
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        for o, w, wl in zip(outs, want, want_lg):
            assert o["output_ids"] == w
            assert (eng.captured_logits(o["meta_info"]["id"]) - wl).abs().max().item() <= EXACT_TOL
        assert_pools_free(eng)


def test_retraction_and_abort():
    """Pools of two full pages: the newer request is retracted mid-verify and recomputed; a
    third is aborted while decoding. Outputs and logits still equal plain decoding's."""
    prompts = _prompts([240, 236], seed=4)
    params = [dict(GREEDY, max_new_tokens=24), dict(GREEDY, max_new_tokens=26)]
    kw = dict(max_running_requests=2, max_total_tokens=512, chunked_prefill_size=128)
    want, want_lg = run_plain(prompts, params, **kw)
    with make_engine(**kw) as eng:
        truth = {tuple(p): p + w for p, w in zip(prompts, want)}
        eng.scheduler.spec.draft_override = oracle(eng, truth, (3, 1, 3, 2))
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert eng.scheduler.num_retractions >= 1
        for o, w, wl in zip(outs, want, want_lg):
            assert o["output_ids"] == w
            assert (eng.captured_logits(o["meta_info"]["id"]) - wl).abs().max().item() <= EXACT_TOL
        assert_pools_free(eng)
        # abort while decoding with drafts in flight
        eng.scheduler.spec.draft_override = None
        eng.scheduler.add(GenerateRequest(prompts[0][:50], SamplingParams(max_new_tokens=30, temperature=0),
                                          rid="gone"))
        while not (eng.scheduler.reqs["gone"].output_ids[3:]):
            eng.step()
        assert eng.scheduler.abort("gone").finish_reason["type"] == "abort"
        eng.step()
        assert "gone" not in eng.scheduler.spec.states
        assert_pools_free(eng)


# ---- the compressed state after rollback --------------------------------------------------------

def _live_state(eng: Engine, rid: str) -> dict[str, torch.Tensor]:
    """Per held position / page, in position order: every C4, indexer and C128 row of the
    request's full pages, and every ring slot of its held SWA pages and its C128 ring rows."""
    alloc, pools, plan = eng.allocator, eng.pools, eng.plan
    req = alloc._req(rid)
    full = torch.tensor(req.full_pages, dtype=torch.int64)
    c4_rows = (full[:, None] * (plan.full_page // 4) + torch.arange(plan.full_page // 4)).reshape(-1)
    c128_rows = (full[:, None] * (plan.full_page // 128) + torch.arange(plan.full_page // 128)).reshape(-1)
    pages = torch.tensor([req.swa_pages[k] for k in sorted(req.swa_pages)], dtype=torch.int64)
    R4, R128 = plan.c4_ring_size, plan.c128_ring_size
    ring_slots = (pages[:, None] * R4 + torch.arange(R4)).reshape(-1)
    ring_rows = req.slot * R128 + torch.arange(R128)
    out = {"swa_pages": torch.tensor(sorted(req.swa_pages))}
    for layer in pools.c4_kv:
        out[f"c4.{layer}"] = read_kv_rows(pools.c4_kv[layer], c4_rows)
        out[f"idx.{layer}"] = read_indexer_rows(pools.c4_indexer[layer], c4_rows)
        out[f"ring4.{layer}"] = pools.c4_ring[layer][ring_slots]
        out[f"iring4.{layer}"] = pools.c4_indexer_ring[layer][ring_slots]
    for layer in pools.c128_kv:
        out[f"c128.{layer}"] = read_kv_rows(pools.c128_kv[layer], c128_rows)
        out[f"ring128.{layer}"] = pools.c128_ring[layer][ring_rows]
    return out


def _run_to(eng: Engine, prompt: list[int], stop_len: int, new: int) -> None:
    eng.scheduler.add(GenerateRequest(prompt, SamplingParams(max_new_tokens=new, temperature=0,
                                                             ignore_eos=True), rid="r"))
    while eng.scheduler.reqs["r"].kv_len < stop_len:
        eng.step()


@pytest.mark.parametrize("restore", [True, False], ids=["rollback", "no-rollback-control"])
def test_state_after_rollback_equals_plain(restore, monkeypatch):
    """A speculative run whose verifies reject tokens completing C4 blocks and the C128 block
    ending at position 127 leaves the state a plain decode of the same tokens leaves (zeroed
    pools, one request: the same pages). Without the rollback it differs (the control)."""
    prompt = _prompts([110], seed=6)[0]
    new = 40
    want, _ = run_plain([prompt], dict(GREEDY, max_new_tokens=new))
    truth = {tuple(prompt): prompt + want[0]}
    seq = truth[tuple(prompt)]
    stop = 110 + 28
    rejected_ends: set[int] = set()     # positions of rejected rows that complete a C4 block
    if not restore:
        monkeypatch.setattr(VerifySnapshot, "restore", lambda self, keep: 0)
    with make_engine(max_running_requests=1) as spec_eng, make_engine(max_running_requests=1) as plain:
        plain.scheduler.spec.num_drafts = lambda r, ctx: 0
        pattern = itertools.cycle((0, 1, 0, 2, 3, 3))

        def override(rid, n, drafts):
            k = len(drafts)
            a = next(pattern)
            if n < 127 <= n + k:
                a = min(a, 126 - n)         # reject from position 127 on: its row completes C128 block 0
            if n + k + 1 >= stop:
                a = 0                       # the last step rejects: its writes are the control's difference
            rejected_ends.update(p for p in range(n + a + 1, n + k + 1) if (p + 1) % 4 == 0)
            return [t if j < a else (t + 1) % V for j, t in enumerate(seq[n + 1:n + 1 + k])]
        spec_eng.scheduler.spec.draft_override = override
        _run_to(spec_eng, prompt, stop, new)
        L = spec_eng.scheduler.reqs["r"].kv_len
        _run_to(plain, prompt, L, new)
        assert plain.scheduler.reqs["r"].kv_len == L
        assert 127 in rejected_ends and len(rejected_ends) > 3       # blocks of 4 and 128 rejected
        got, ref = _live_state(spec_eng, "r"), _live_state(plain, "r")
        same = all(got[k].shape == ref[k].shape and (got[k] - ref[k]).abs().max().item() <= EXACT_TOL
                   for k in ref)
        assert same == restore


# ---- flags --------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, field", [
    (("MEDUSA", 3, 1, 4), "speculative_algorithm"),
    (("EAGLE", 3, 2, 4), "speculative_eagle_topk"),
    (("EAGLE", 3, 1, 5), "speculative_num_draft_tokens"),
    (("EAGLE", MAX_DRAFT_TOKENS + 1, 1, None), "speculative_num_steps"),
    ((None, 3, None, None), "speculative_num_steps"),
])
def test_flags_validated(flags, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_flags(*flags)


def test_flags_defaults_and_refusals():
    assert SpeculativeConfig.from_flags("nextn", None, None, None) == SpeculativeConfig("NEXTN", 3, 1, 4)
    assert SpeculativeConfig.from_flags(None, None, None, None) is None
    with pytest.raises(ValueError, match="dense"):
        make_engine(dense=True)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        make_engine(config_overrides={"vocab_size": V, "num_nextn_predict_layers": 0,
                                      "compress_ratios": (0, 4, 128, 4)})
    # online C128 is not refused: tests/test_spec_online.py


def test_plan_doubles_rings_and_adds_the_draft_pool():
    with make_engine(max_running_requests=2, max_total_tokens=1024) as eng, \
            make_engine(None, max_running_requests=2, max_total_tokens=1024) as plain:
        assert (eng.plan.c4_ring_size, eng.plan.c128_ring_size) == (16, 256)
        assert (plain.plan.c4_ring_size, plain.plan.c128_ring_size) == (8, 128)
        n = eng.config.num_hidden_layers
        assert sorted(eng.pools.swa_kv) == list(range(n + 1)) and sorted(plain.pools.swa_kv) == list(range(n))
        assert eng.plan.speculative_factor == (n + 1) / n


def test_allocator_truncate_frees_the_rejected_pages():
    """truncate gives back full and SWA pages wholly past the kept length and unmaps its slots;
    the allocator then balances and extends again from there; a bad length names the request."""
    from memory.allocator import KVAllocator
    from memory.configurator import DSV4PoolConfigurator
    plan = DSV4PoolConfigurator(DSV4Config.preset("tiny"), max_running_requests=2, swa_ratio=0.5,
                                speculative=True).plan_for_tokens(2048)
    alloc = KVAllocator(plan, max_context=1024, window=128)
    alloc.admit("a")
    alloc.extend("a", 250)
    full0, swa0 = alloc.full.num_used, alloc.swa.num_used
    alloc.extend("a", 260)                          # crosses a full page (256) and an SWA page
    assert (alloc.full.num_used, alloc.swa.num_used) == (full0 + 1, swa0 + 1)
    alloc.truncate("a", 252)
    assert (alloc.full.num_used, alloc.swa.num_used, alloc.seq_len("a")) == (full0, swa0, 252)
    alloc.check_integrity()
    slot = alloc.req_slot("a")
    assert int(alloc.full_to_swa[alloc.req_to_token[slot, 251]]) >= 0
    assert int(alloc.full_to_swa[alloc.req_to_token[slot, 252]]) == -1
    alloc.extend("a", 257)
    alloc.check_integrity()
    with pytest.raises(ValueError, match="'a'"):
        alloc.truncate("a", 300)
    alloc.free("a")
    alloc.check_integrity()
