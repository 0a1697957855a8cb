"""The prefix cache: a request started from a cached prefix computes what a from-scratch
prefill computes.

Exactness: float64 engines (torch backend, tiny preset shrunk to one CSA and one HCA layer,
vocabulary 1024, seeded random weights) with the cache on and off; for a request that starts
from a cached prefix of B tokens, its logits at positions B .. end must equal the uncached
engine's at the same positions to 1e-9. Both sides then run the same float64 operations on the
same FP8-rounded pool rows and the same ring state; chunk shapes differ, which moves float64
sums by ~k * 2^-52 * sum|terms| (k <= 10^4 terms of size <= 10^2: about 1e-10), far from an FP8
rounding boundary except with probability ~1e-12 per element, so 1e-9 holds. Every kind of
restore point is reached: the last page boundary of a prompt crossed inside a chunk, a chunk
ending on a boundary, a decode step crossing one, the point where prompts with a shared system
prompt diverge; with the ring and the online C128 state (SGLANG_OPT_USE_ONLINE_COMPRESS).
The bf16 state flag is not a float64 mode (a float64 engine keeps its state in float64): it is
checked in float32, where the cached run repeats the uncached run's last chunk on the same bytes
and must give identical logits. After every test the pools balance (``check_integrity``, which
counts the cache's holders) and flushing the cache leaves every pool empty.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_backend import Engine
from memory.allocator import KVAllocator
from memory.configurator import DSV4PoolConfigurator
from memory.layout import read_kv_rows
from memory.prefix_cache import PrefixCache
from scheduler_hooks.io import GenerateRequest, SamplingParams

V = 1024
TOL = 1e-9
# one CSA and one HCA layer (+ the window-only MTP entry): both compressed kinds at half the cost
OVERRIDES = {"vocab_size": V, "num_hidden_layers": 2, "compress_ratios": (4, 128, 0)}


def make_engine(**kw) -> Engine:
    args = dict(preset="tiny", dtype="float64", skip_tokenizer_init=True, config_overrides=OVERRIDES,
                capture_logits=True, max_total_tokens=4096, max_running_requests=3, chunked_prefill_size=192)
    args.update(kw)
    return Engine(**args)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(V) for _ in range(n)]


def greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


def run(eng: Engine, prompt: list[int], new: int) -> dict:
    return eng.generate(input_ids=prompt, sampling_params=greedy(new))


def assert_same_as_scratch(eng: Engine, scratch: Engine, prompt: list[int], out: dict) -> None:
    """``out`` (from ``eng``) against the same request on the uncached engine: tokens, and logits
    from the first position ``eng`` computed."""
    ref = run(scratch, prompt, out["meta_info"]["completion_tokens"])
    assert out["output_ids"] == ref["output_ids"]
    rid, ref_rid = out["meta_info"]["id"], ref["meta_info"]["id"]
    start = eng.captured_from(rid)
    assert start == out["meta_info"]["cached_tokens"]
    got, want = eng.captured_logits(rid), scratch.captured_logits(ref_rid)[start:]
    assert got.shape == want.shape
    d = float((got - want).abs().max())
    assert d <= TOL, f"cached from {start}: |logits - scratch| = {d:.3e}"


def assert_no_leak(eng: Engine) -> None:
    eng.check_integrity()
    eng.flush_cache()
    eng.check_integrity()
    usage = eng.pool_usage()
    assert all(u["used"] == 0 and u["cached"] == 0 for u in usage.values()), usage
    assert eng.allocator.full.num_free == eng.allocator.full.capacity
    assert eng.allocator.swa.num_free == eng.allocator.swa.capacity


@pytest.fixture(params=[False, True], ids=["ring", "online"])
def engines(request, monkeypatch):
    monkeypatch.setenv("SGLANG_OPT_USE_ONLINE_COMPRESS", "1" if request.param else "0")
    eng, scratch = make_engine(), make_engine(disable_radix_cache=True)
    assert eng.plan.online_compress == request.param and scratch.prefix_cache is None
    yield eng, scratch
    assert_no_leak(eng)


# ---- exactness at every kind of restore point ---------------------------------------------------

def test_shared_system_prompt_restores_where_prompts_diverge(engines):
    eng, scratch = engines
    system = ids(300, 1)
    a = run(eng, system + ids(300, 2), 2)      # last page boundary 512 lies past the system prompt
    assert a["meta_info"]["cached_tokens"] == 0
    b_prompt = system + ids(40, 3)
    b = run(eng, b_prompt, 2)                  # matches a's first page, no restore point there yet
    assert b["meta_info"]["cached_tokens"] == 0
    c_prompt = system + ids(30, 4)
    c = run(eng, c_prompt, 3)                  # b made one where it left a's path: 256
    assert c["meta_info"]["cached_tokens"] == 256
    assert_same_as_scratch(eng, scratch, c_prompt, c)


def shared_bytes(eng: Engine, full_pages: list[int], swa_pages: list[int]) -> list[torch.Tensor]:
    """Copies of every byte and state slot that these pages hold, in every layer: the C4 KV and
    indexer pages (one per full page), the two C128 rows of each full page, the SWA pages and
    their C4 / indexer ring slots."""
    pools, f = eng.pools, torch.tensor(full_pages)
    s = torch.tensor(swa_pages)
    ring = (s[:, None] * eng.plan.c4_ring_size + torch.arange(eng.plan.c4_ring_size)).flatten()
    c128 = torch.stack([2 * f, 2 * f + 1]).flatten()
    out = [t[s].clone() for t in pools.swa_kv.values()]
    for kind in ("c4_kv", "c4_indexer"):
        out += [t[f].clone() for t in getattr(pools, kind).values()]
    for kind in ("c4_ring", "c4_indexer_ring"):
        out += [t[ring].clone() for t in getattr(pools, kind).values()]
    out += [read_kv_rows(t, c128) for t in pools.c128_kv.values()]
    return out


def test_restore_point_crossed_inside_a_chunk_and_never_written():
    eng, scratch = make_engine(), make_engine(disable_radix_cache=True)
    base = ids(600, 5)
    run(eng, base, 1)              # chunks of 192: 512 (its last page boundary) is crossed inside one
    p = base[:560] + ids(20, 6)
    m = eng.prefix_cache.match(p[:512])
    assert m.length == 512
    before = shared_bytes(eng, m.full_pages, list(m.swa_pages.values()))
    out = run(eng, p, 3)
    assert out["meta_info"]["cached_tokens"] == 512
    after = shared_bytes(eng, m.full_pages, list(m.swa_pages.values()))
    assert all(torch.equal(x, y) for x, y in zip(before, after)), "a restored request wrote a shared page"
    assert_same_as_scratch(eng, scratch, p, out)
    assert_no_leak(eng)


def test_multi_turn_restores_where_a_decode_crossed_a_page(engines):
    eng, scratch = engines
    turn1 = ids(250, 8)
    first = run(eng, turn1, 10)                # decoding crosses position 256
    turn2 = turn1 + first["output_ids"] + ids(20, 9)
    second = run(eng, turn2, 3)
    assert second["meta_info"]["cached_tokens"] == 256
    assert_same_as_scratch(eng, scratch, turn2, second)


def test_bf16_state_restores_the_same_bytes(monkeypatch):
    # float32, chunks of 512: the uncached run computes [0, 512) then [512, 700); the cached run
    # starts at 512 (a chunk that ended on a page boundary) and computes [512, 700) as one chunk
    # over the same stored bytes
    monkeypatch.setenv("SGLANG_DSV4_COMPRESS_STATE_DTYPE", "bf16")
    kw = dict(dtype="float32", chunked_prefill_size=512)
    eng = make_engine(**kw)
    assert eng.pools.state_dtype == torch.bfloat16
    p = ids(700, 10)
    cold, hot = run(eng, p, 3), run(eng, p, 3)
    assert (cold["meta_info"]["cached_tokens"], hot["meta_info"]["cached_tokens"]) == (0, 512)
    assert hot["output_ids"] == cold["output_ids"]
    assert torch.equal(eng.captured_logits(hot["meta_info"]["id"]),
                       eng.captured_logits(cold["meta_info"]["id"])[512:])
    assert_no_leak(eng)


def test_eviction_under_pressure_keeps_hits_exact():
    # three full pages; a 300-token request needs two, so the cache must give pages back
    eng, scratch = make_engine(max_total_tokens=768), make_engine(max_total_tokens=768, disable_radix_cache=True)
    ps = [ids(300, 20 + i) for i in range(3)]
    for p in ps:
        run(eng, p, 1)
    # each left its first page (a restore point at 256); the third needed the oldest one's page
    assert eng.stats()["prefix_cache"]["evicted_pages"] == 1
    assert eng.pool_usage()["full"]["cached"] == 2 * 256
    eng.check_integrity()
    assert eng.prefix_cache.match(ps[0][:280]).length == 0      # the least recently used one went
    p = ps[-1][:280] + ids(8, 30)
    out = run(eng, p, 2)
    assert out["meta_info"]["cached_tokens"] == 256
    assert_same_as_scratch(eng, scratch, p, out)
    assert_no_leak(eng)


def test_logprob_start_limits_the_cached_prefix():
    eng = make_engine()
    p = ids(300, 40)
    run(eng, p, 1)                                   # a restore point at 256
    for start, cached in ((200, 0), (280, 256)):      # logits from position start - 1 on are needed
        out = eng.generate(input_ids=p, sampling_params=greedy(1), return_logprob=True, logprob_start_len=start)
        assert out["meta_info"]["cached_tokens"] == cached
        lp = out["meta_info"]["input_token_logprobs"]
        assert len(lp) == 300 - start and all(v is not None for v, _, _ in lp)
    assert_no_leak(eng)


# ---- random arrivals, aborts and finishes --------------------------------------------------------

SYSTEMS = [ids(280, 50), ids(300, 51)]
RIDS = itertools.count()


@pytest.fixture(scope="module")
def churn_engines():
    # three running requests, pools of 5 full pages: the cache is evicted and requests retracted
    return (make_engine(max_total_tokens=1280, chunked_prefill_size=128),
            make_engine(max_total_tokens=4096, disable_radix_cache=True))


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_arrivals_aborts_finishes(churn_engines, data):
    eng, scratch = churn_engines
    sched = eng.scheduler
    prompts: dict[str, list[int]] = {}
    done: dict[str, dict] = {}
    aborted: set[str] = set()
    for i in range(data.draw(st.integers(2, 5), label="requests")):
        sys_ids = SYSTEMS[data.draw(st.integers(0, 1), label="system")]
        tail = ids(data.draw(st.integers(1, 16), label="tail"), data.draw(st.integers(0, 3), label="seed"))
        rid = f"r{next(RIDS)}"
        prompts[rid] = sys_ids + tail
        sched.add(GenerateRequest(prompts[rid], SamplingParams(**greedy(data.draw(st.integers(1, 3)))), rid=rid))
        for _ in range(data.draw(st.integers(0, 4), label="steps")):
            for out in eng.step():
                if out.finished:
                    done[out.rid] = out.to_dict()
        if data.draw(st.booleans(), label="abort") and sched.reqs:
            victim = data.draw(st.sampled_from(sorted(sched.reqs)), label="victim")
            sched.abort(victim)
            aborted.add(victim)
        eng.check_integrity()
    while not sched.idle:
        for out in eng.step():
            if out.finished:
                done[out.rid] = out.to_dict()
    eng.check_integrity()
    for rid, out in done.items():
        if rid not in aborted and out["meta_info"]["cached_tokens"]:
            assert_same_as_scratch(eng, scratch, prompts[rid], out)


def test_churn_script_leaves_no_leak():
    from bench.churn_offline import churn
    report = churn(num_requests=16, seed=3, system_len=(260, 300))
    assert report["leaked"] == {} and report["hits"] > 0 and report["aborted"] > 0


# ---- the tree and the holder counts, without a model ---------------------------------------------

def small_allocator(tokens: int = 2048, requests: int = 4) -> KVAllocator:
    from dsv4_backend.config import DSV4Config
    plan = DSV4PoolConfigurator(DSV4Config.preset("tiny"), max_running_requests=requests).plan_for_tokens(tokens)
    return KVAllocator(plan, max_context=2048)


def test_pages_are_freed_only_when_no_request_and_no_node_holds_them():
    a = small_allocator()
    cache = PrefixCache(a)
    toks = ids(600, 60)
    a.admit("x")
    a.extend("x", 512)
    pages, swa = a.full_pages_of("x"), {3: a.swa_page_of("x", 3)}
    cache.insert(toks[:512], pages, swa)
    a.evict_swa("x")
    a.extend("x", 700)
    a.evict_swa("x")                       # page 3 has left x's window; the cache keeps it
    assert a.swa.is_used(swa[3]) and int(a.full_to_swa[pages[1] * 256 + 128]) == swa[3] * 128
    a.free("x")
    assert all(a.full.refcount(p) == 1 for p in pages) and a.swa.refcount(swa[3]) == 1
    a.check_integrity()
    m = cache.match(toks[:600])
    assert (m.length, m.full_pages, m.swa_pages) == (512, pages, swa)
    a.admit("y")
    a.attach_prefix("y", m.full_pages, m.swa_pages, m.length)
    assert cache.evict(full_pages=2, swa_pages=1) == (0, 0)     # y holds every page of the path
    a.check_integrity()
    a.free("y")
    assert cache.evict(full_pages=2) == (2, 1)
    assert a.full.num_free == a.full.capacity and a.swa.num_free == a.swa.capacity
    a.check_integrity()
    assert int((a.full_to_swa[:-1] >= 0).sum()) == 0


def test_integrity_check_sees_a_cache_leak_and_bad_restore_points():
    a = small_allocator()
    cache = PrefixCache(a)
    a.admit("x")
    a.extend("x", 512)
    cache.insert(ids(512, 61), a.full_pages_of("x"), {3: a.swa_page_of("x", 3)})
    a.free("x")
    a.check_integrity()
    node = cache.root.children[next(iter(cache.root.children))]
    real = node.page
    node.page = a.full._free[-1]                   # the tree and the cache's page list disagree
    with pytest.raises(AssertionError, match="list != tree"):
        a.check_integrity()
    node.page = real
    held = cache.held_pages()
    cache.root.children.clear()                    # nodes dropped without giving their pages back
    cache._full.clear()
    cache._swa.clear()
    with pytest.raises(AssertionError, match="held by no request or cache"):
        a.check_integrity()
    a.release(*held)
    a.admit("z")
    with pytest.raises(ValueError, match="whole full pages"):
        a.attach_prefix("z", [real], {}, 300)
    with pytest.raises(ValueError, match="SWA pages .* missing"):
        a.attach_prefix("z", [real], {}, 256)
    a.free("z")
    a.check_integrity()
