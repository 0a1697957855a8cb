"""HiSparse (memory/hisparse.py): the request buffers against a plain-Python model of them, the
row-copy kernel against the torch copy, and the model's logits with HiSparse on against off.

- config: SGLang's names and defaults, and each refusal names its field;
- pool: random decode swap-ins (distinct owners, padded rows), prefill staging, new-row writes
  and releases (hypothesis) with buffers of 3 rows; after every operation the buffers equal a
  list-based re-implementation (hits kept, then empty rows, then the request's least recently
  used unpinned row), the integrity check passes, and every device row handed out holds its
  host row's bytes;
- model (float64, torch backend, 3 layers: CSA, HCA, CSA): logits with buffers of exactly top-k
  rows and one query block of staging equal HiSparse off to 1e-12 over hypothesis schedules of
  chunked prefill and batched decode, with the online C128 and the bf16 state flags, and through
  the Engine across retraction and aborts;
- SGLang's failures: a prompt longer than the SWA pool is admitted (sglang#30401), and several
  concurrent requests whose C4 rows each exceed their buffers finish (sglang#26427);
- the Triton backend under the interpreter: HiSparse on gives the same logits bit for bit
  (the kernel reads the same bytes at other row indices; staging blocks are independent rows).
"""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_backend import Engine
from dsv4_backend.config import DSV4Config
from dsv4_backend.model_runner import ModelRunner, run_schedule
from dsv4_backend.weights import random_weights
from memory import env
from memory.configurator import DSV4PoolConfigurator
from memory.hisparse import HiSparseConfig, HiSparseConfigError, HiSparsePool
from memory.layout import read_row_bytes, write_kv_rows
from memory.pools import DSV4KVPools
from scheduler_hooks.io import GenerateRequest, SamplingParams

V = 1024
TOPK = 16
OVERRIDES = {"vocab_size": V, "num_hidden_layers": 3, "compress_ratios": (4, 128, 4, 0), "index_topk": TOPK}
CFG = DSV4Config.preset("tiny", **OVERRIDES)
EXACT = 1e-12
TOKENS = 1024                       # full tokens of the model tests' plans: 256 C4 rows per layer


def smallest(tokens: int = TOKENS, requests: int = 2) -> dict:
    """The smallest hot pool: a buffer of exactly top-k rows per request and top-k staging rows
    (a prefill block of one query), ``(requests + 1) * top_k`` rows per layer."""
    return {"top_k": TOPK, "device_buffer_size": TOPK, "host_to_device_ratio": tokens / (4 * (requests + 1) * TOPK)}


SMALLEST = smallest()


# ---- config ---------------------------------------------------------------------------------

def test_config_names_defaults_and_refusals():
    c = HiSparseConfig.parse(None)
    assert (c.top_k, c.device_buffer_size, c.host_to_device_ratio) == (2048, 4096, 2.0)
    c = HiSparseConfig.parse('{"top_k": 512, "host_to_device_ratio": 4}')
    assert (c.top_k, c.device_buffer_size, c.host_to_device_ratio) == (512, 1024, 4.0)
    for bad, field in [('{"top_k": 64, "device_buffer_size": 32}', "device_buffer_size"),
                       ('{"host_to_device_ratio": 0.5}', "host_to_device_ratio"),
                       ('{"top_k": "8"}', "top_k"), ('{"topk": 8}', "topk"), ("[1]", "JSON object"),
                       ("{", "not valid JSON")]:
        with pytest.raises(HiSparseConfigError, match=field):
            HiSparseConfig.parse(bad)
    plan = DSV4PoolConfigurator(CFG, max_running_requests=2, c4_shrink_factor=64).plan_for_tokens(TOKENS)
    with pytest.raises(ValueError, match="c4_shrink_factor"):
        DSV4KVPools(CFG, plan)                                   # a shrunk plan needs HiSparse
    with pytest.raises(HiSparseConfigError, match="fewer than the 48"):   # 4 rows < 2 buffers + staging
        DSV4KVPools(CFG, plan, hisparse=HiSparseConfig(16, 16, 64))
    with pytest.raises(HiSparseConfigError, match="index_topk"):
        DSV4KVPools(CFG, plan, hisparse=HiSparseConfig(4, 8, 64))


def test_pool_shapes_and_bytes():
    plan = DSV4PoolConfigurator(CFG, max_running_requests=2, c4_shrink_factor=4).plan_for_tokens(TOKENS)
    pools = DSV4KVPools(CFG, plan, hisparse=HiSparseConfig.parse(SMALLEST | {"host_to_device_ratio": 4}))
    hs = pools.hisparse
    assert set(pools.c4_kv) == {0, 2} and pools.c4_kv is hs.host
    assert tuple(pools.c4_kv[0].shape) == (256 // 64 + 1, 64 * 584)         # every C4 row, one dummy page
    assert tuple(hs.device_kv[2].shape) == (64 // 64 + 1, 64 * 584) and hs.rows == plan.c4_rows == 64
    assert plan.host_bytes == 2 * 5 * 64 * 584 == pools.memory_usage()["c4_kv_host"]
    assert plan.pool_bytes()["c4_kv"] == 2 * 2 * 64 * 584
    assert pools.dummy_c4_row == 256


# ---- the placement policy -------------------------------------------------------------------

class RefPolicy:
    """The request buffers in plain Python: buffer s, row j holds (full row, tick) or None."""

    def __init__(self, B: int, S: int):
        self.B = B
        self.buf: list[list] = [[None] * B for _ in range(S)]
        self.tick = 0

    def where(self) -> dict[tuple[int, int], int]:
        """(owner, full row) -> device row."""
        return {(s, r[0]): s * self.B + j for s, b in enumerate(self.buf) for j, r in enumerate(b) if r is not None}

    def swap_in(self, sel: list[list[int]], owners: list[int]) -> list[list[int]]:
        self.tick += 1
        out = []
        for q, s in zip(sel, owners):
            if s < 0:
                out.append([-1] * len(q))
                continue
            b = self.buf[s]
            at = {r[0]: j for j, r in enumerate(b) if r is not None}
            pinned = {at[f] for f in q if f in at}
            free = [j for j in range(self.B) if b[j] is None]
            lru = [j for _, j in sorted((r[1], j) for j, r in enumerate(b) if r is not None and j not in pinned)]
            victims = iter(free + lru)
            rows = []
            for f in q:
                if f < 0:
                    rows.append(-1)
                    continue
                j = at[f] if f in at else next(victims)
                b[j] = (f, self.tick)
                rows.append(s * self.B + j)
            out.append(rows)
        return out

    def release(self, slot: int) -> None:
        self.buf[slot] = [None] * self.B


def _mapping(hs: HiSparsePool) -> dict[tuple[int, int], int]:
    t = hs.table[0][:-1].tolist()
    return {(d // hs.buffer_size, f): d for d, f in enumerate(t) if f >= 0}


ROWS_PER_OWNER = 20


def _pool(D: int, B: int, S: int, K: int) -> HiSparsePool:
    return HiSparsePool([0], host_rows=S * ROWS_PER_OWNER, device_rows=D, num_req_slots=S,
                        config=HiSparseConfig(K, B, 8), top_k=K, page_bytes=64 * 584)


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "lookup-kernel"])
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_policy_matches_reference(kernel, data):
    """Random decode swap-ins (distinct owners, some padded rows), prefill staging, new-row writes
    and releases against the list model: the same device rows handed out, the same buffers,
    each handed-out row holding its host row's bytes, and the integrity check after each step;
    with the torch lookup and with the lookup kernel (interpreter)."""
    B, S, K = 3, 3, 2
    hs = _pool(S * B + 2 * K, B, S, K)
    if kernel:
        from dsv4_backend.kernels import hisparse_lookup
        hs.lookup = hisparse_lookup
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    write_kv_rows(hs.host[0], torch.arange(S * ROWS_PER_OWNER), torch.randn(S * ROWS_PER_OWNER, 512, generator=g))
    ref = RefPolicy(B, S)
    live = set(range(S))
    evicted, written = 0, set()
    for _ in range(data.draw(st.integers(1, 12), label="ops")):
        op = data.draw(st.sampled_from(["swap", "swap", "swap", "stage", "write", "release"]))
        if op == "release":
            slot = data.draw(st.integers(0, S - 1))
            hs.release(slot)
            ref.release(slot)
        elif op in ("swap", "stage"):
            if op == "swap":
                owners = data.draw(st.lists(st.integers(-1, S - 1), min_size=1, max_size=S + 1)
                                   .filter(lambda o: len([x for x in o if x >= 0]) == len({x for x in o if x >= 0})))
            else:
                owners = [data.draw(st.integers(0, S - 1))] * data.draw(st.integers(1, 2))
            sel = []
            for o in owners:   # a query's rows are distinct (top-k), -1 padded at the end
                span = range(max(o, 0) * ROWS_PER_OWNER, max(o, 0) * ROWS_PER_OWNER + 6)
                q = data.draw(st.lists(st.sampled_from(list(span)), min_size=0, max_size=K, unique=True))
                sel.append(q + [-1] * (K - len(q)))
            sel_t, own_t = torch.tensor(sel), torch.tensor(owners)
            before = _mapping(hs)
            got = hs.swap_in(0, sel_t, own_t) if op == "swap" else hs.stage(0, sel_t)
            if op == "swap":
                assert got.tolist() == ref.swap_in(sel, owners)
                evicted += len(set(before.items()) - set(_mapping(hs).items()))
            else:          # staged rows: in staging, one device row per distinct full row
                v = sel_t >= 0
                assert bool((got[v] >= hs.staging_base).all()) and bool((got[v] < hs.rows).all())
                pairs = set(zip(sel_t[v].tolist(), got[v].tolist()))
                assert len(pairs) == len(set(sel_t[v].tolist())) == len(set(got[v].tolist()))
                assert _mapping(hs) == before
            assert torch.equal(got < 0, (sel_t < 0) | (own_t < 0)[:, None])
            v = got >= 0
            assert torch.equal(read_row_bytes(hs.device_kv[0], got[v]), read_row_bytes(hs.host[0], sel_t[v]))
        else:              # new rows (a C4 row is written once): rows past the selectable 6
            o = data.draw(st.integers(0, S - 1))
            fresh = [r for r in range(o * ROWS_PER_OWNER + 6, (o + 1) * ROWS_PER_OWNER) if r not in written]
            if not fresh:
                continue
            rows = sorted(data.draw(st.lists(st.sampled_from(fresh), min_size=1, max_size=10, unique=True)))
            written.update(rows)
            vals = torch.randn(len(rows), 512, generator=g, dtype=torch.float64)
            hs.write_rows(0, torch.tensor(rows), lambda pool, dev, part: write_kv_rows(pool, dev, vals[part]))
            want = torch.zeros(1, 64 * 584, dtype=torch.uint8)
            write_kv_rows(want, torch.arange(len(rows)), vals)
            assert torch.equal(read_row_bytes(hs.host[0], torch.tensor(rows)),
                               read_row_bytes(want, torch.arange(len(rows))))
        assert _mapping(hs) == ref.where(), op
        hs.check_integrity(live)
    assert hs.evicted_rows == evicted


def test_lookup_kernel_equals_torch_lookup():
    """The lookup kernel (interpreter) leaves the tables, ``last_used``, the tick and the
    counters exactly as the torch ops do, and hands out the same device rows, over steps with
    hits, evictions of empty and used rows, padded owners and -1 selections (B and k not powers
    of two, k > the kernel's chunk of 16 selected rows)."""
    from dsv4_backend.kernels import hisparse_lookup
    B, S, K, rows = 40, 3, 19, 90
    pools = [_pool(S * B + K, B, S, K) for _ in range(2)]
    pools[1].lookup = hisparse_lookup
    for hs in pools:      # no copy: the decisions alone are compared
        hs.copy_rows = lambda *a: None
    rng = random.Random(5)
    prev: dict[int, list[int]] = {}
    for step in range(8):
        owners = rng.sample(range(S), rng.randint(1, S)) + [-1] * rng.randint(0, 1)
        sel = []
        for o in owners:
            keep = [r for r in prev.get(o, []) if rng.random() < 0.6]          # some hits
            fresh = [r for r in rng.sample(range(rows), K) if r not in keep]
            q = (keep + fresh)[:rng.randint(K - 4, K)]
            sel.append(q + [-1] * (K - len(q)))
            if o >= 0:
                prev[o] = q
        sel_t, own_t = torch.tensor(sel), torch.tensor(owners)
        got = [hs.swap_in(0, sel_t, own_t) for hs in pools]
        assert torch.equal(got[0], got[1]), step
        a, b = pools
        # (the torch path also dumps writes into the last entry, the sink; the kernel masks them)
        assert torch.equal(a.table[0], b.table[0]) and torch.equal(a.last_used[0][:-1], b.last_used[0][:-1]), step
        assert torch.equal(a.counts, b.counts) and int(a.tick) == int(b.tick), step
    assert pools[0].evicted_rows > 0 and pools[0].hit_rows > 0


def test_integrity_check_catches_corruption():
    hs = _pool(2 * 4 + 2, 4, 2, 2)
    write_kv_rows(hs.host[0], torch.arange(40), torch.randn(40, 512, generator=torch.Generator().manual_seed(0)))
    got = hs.swap_in(0, torch.tensor([[3, 5], [27, -1]]), torch.tensor([0, 1]))
    hs.check_integrity([0, 1])
    with pytest.raises(AssertionError, match="no longer live"):
        hs.check_integrity([0])
    d = int(got[0, 1])
    hs.device_kv[0][0, d * 576] ^= 1                       # a device byte that differs from the host
    with pytest.raises(AssertionError, match="differ from their host copies"):
        hs.check_integrity()
    hs.device_kv[0][0, d * 576] ^= 1
    hs.table[0][2] = 3                                     # full row 3 twice in request 0's buffer
    with pytest.raises(AssertionError, match="twice"):
        hs.check_integrity()


@pytest.mark.parametrize("rows_per_program", [0, 4])
def test_copy_kernel_equals_torch_copy(rows_per_program):
    """The row-copy kernel (interpreter; one row per program, and 4 rows per program with a
    partial last program) writes the bytes the torch copy writes, skips rows whose destination
    is < 0, and touches nothing else (pools of 64-row pages, an aligned page too)."""
    from functools import partial

    from dsv4_backend.kernels import copy_rows
    from memory.hisparse import copy_rows_torch
    g = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (3, 64 * 584 + 64), dtype=torch.uint8, generator=g)
    src_rows = torch.tensor([5, 130, 64, 0, 77, 191])
    dst_rows = torch.tensor([1, -1, 70, 127, -1, 64])
    out = []
    for fn in (partial(copy_rows, rows_per_program=rows_per_program), copy_rows_torch):
        dst = torch.randint(0, 256, (3, 64 * 584), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
        fn(src, src_rows, dst, dst_rows)
        out.append(dst)
    assert torch.equal(out[0], out[1])
    keep = dst_rows >= 0
    assert torch.equal(read_row_bytes(out[0], dst_rows[keep]), read_row_bytes(src, src_rows[keep]))
    fresh = torch.randint(0, 256, (3, 64 * 584), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    others = torch.tensor([r for r in range(192) if r not in dst_rows.tolist()])
    assert torch.equal(read_row_bytes(out[0], others), read_row_bytes(fresh, others))


# ---- the model: HiSparse on == HiSparse off -------------------------------------------------

@pytest.fixture(scope="module")
def weights64():
    return random_weights(CFG, seed=0, dtype=torch.float64, include_mtp=False)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(V) for _ in range(n)]


def _runner(weights, hisparse, **kw) -> ModelRunner:
    return ModelRunner.build(CFG, dtype=torch.float64, weights=weights, backend="torch", max_total_tokens=TOKENS,
                             max_running_requests=2, hisparse_config=hisparse, **kw)


SEQS = {"a": _tokens(110, 1), "b": _tokens(90, 2)}
_OFF: dict = {}


def _logits_off(weights, rid: str, flags: tuple) -> torch.Tensor:
    """HiSparse off: every position of SEQS[rid] in one prefill (a chunk boundary anywhere gives
    the same float64 logits, docs/backend.md), cached per env-flag setting."""
    if (rid, flags) not in _OFF:
        r = _runner(weights, None, state_dtype=flags[1])
        _OFF[rid, flags] = run_schedule(r, [[(rid, len(SEQS[rid]))]], SEQS)[rid]
    return _OFF[rid, flags]


@pytest.mark.parametrize("online, state", [(False, torch.float64), (True, torch.float64), (False, torch.bfloat16)])
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_logits_equal_hisparse_off(weights64, monkeypatch, online, state, data):
    """Hot pool of exactly top-k rows (16): 110 and 90 tokens have 27 and 22 C4 rows; in every
    step where both requests decode past 16 rows, each one's swap-in evicts all of the other's."""
    monkeypatch.setenv(env.USE_ONLINE_COMPRESS, "1" if online else "0")
    pieces = {}
    for rid in SEQS:   # drawn chunks, a chunk up to position 72, 10 decodes, then the rest at once
        drawn = data.draw(st.lists(st.integers(1, 70), min_size=0, max_size=2), label=f"{rid} chunks")
        p, out = 0, []
        for n in drawn + [72]:
            n = min(n, 72 - p)
            if n > 0:
                out.append(n)
                p += n
        pieces[rid] = out + [1] * 10 + [len(SEQS[rid]) - p - 10]
    b_start = data.draw(st.integers(0, 3), label="b joins at step")
    steps = [[(rid, pieces[rid][i - start]) for rid, start in (("a", 0), ("b", b_start))
              if 0 <= i - start < len(pieces[rid])] for i in range(b_start + max(map(len, pieces.values())))]
    steps = [s_ for s_ in steps if s_]
    runner = _runner(weights64, SMALLEST, state_dtype=state)
    hs = runner.pools.hisparse
    assert hs.rows == 3 * TOPK and hs.buffer_size == TOPK
    evicted = []

    def forward(reqs, inner=runner.forward):
        out = inner(reqs)
        evicted.append(hs.evicted_rows)
        hs.check_integrity()          # (liveness: the Engine tests below, through release)
        return out

    runner.forward = forward
    got = run_schedule(runner, steps, SEQS)
    for rid in got:
        diff = float((got[rid] - _logits_off(weights64, rid, (online, state))).abs().max())
        assert diff <= EXACT, f"{rid}: |HiSparse on - off| = {diff:.3e} (steps {steps})"
    assert hs.offloaded_rows == (110 // 4 + 90 // 4) * 2 and hs.staged_rows > 0
    # the buffers hold exactly top-k rows: once a request has more C4 rows than that, a decode
    # step that selects a row the buffer lacks (a new row, at the latest) evicts one
    pos = Counter()
    for i, s_ in enumerate(steps):
        pos.update(dict(s_))
        if all(n == 1 for _, n in s_) and any(pos[rid] // 4 > TOPK for rid, _ in s_):
            break
    else:
        raise AssertionError(f"no decode step past top-k rows in {steps}")
    assert hs.swapped_rows > 0 and evicted[-1] > evicted[i - 1], (i, evicted)


# ---- through the Engine: retraction, aborts, SGLang's failures --------------------------------

def _engine(hisparse, **kw) -> Engine:
    # the overlap schedule on both sides (the engine's default; on the CPU HiSparse's rows move
    # by torch copies between CPU tensors, in program order)
    args = dict(preset="tiny", dtype="float64", skip_tokenizer_init=True, config_overrides=OVERRIDES,
                capture_logits=True, max_total_tokens=TOKENS, max_running_requests=2, chunked_prefill_size=64)
    args.update(kw)
    if hisparse is not None:
        args.update(enable_hisparse=True, hisparse_config=hisparse)
    return Engine(**args)


def _drive(eng: Engine, prompts, new, abort_at=None) -> dict:
    """Add every request, step until all finish (aborting ``abort_at = {rid: step}``); -> finals."""
    finals, step = {}, 0
    for i, p in enumerate(prompts):
        req = GenerateRequest(p, SamplingParams(max_new_tokens=new[i], temperature=0.0), rid=f"r{i}")
        eng._validate(req)
        eng.scheduler.add(req)
    while len(finals) < len(prompts):
        for rid, at in (abort_at or {}).items():
            if at == step and rid not in finals:
                out = eng.scheduler.abort(rid)
                if out is not None:
                    finals[rid] = out
        for out in eng.scheduler.step():
            if out.finished:
                finals[out.rid] = out
        if eng.pools.hisparse is not None:
            eng.check_integrity()
        step += 1
        assert step < 500, "the engine wedged"
    return finals


def _same_logits(on: Engine, off: Engine, finals_on: dict, finals_off: dict) -> None:
    for rid, out in finals_off.items():
        assert finals_on[rid].output_ids == out.output_ids, rid
        a, b = on.captured_logits(rid), off.captured_logits(rid)
        assert a.shape == b.shape and float((a - b).abs().max()) <= EXACT, rid


def _all_free(eng: Engine) -> None:
    assert eng.scheduler.idle
    eng.check_integrity()
    assert eng.stats()["hisparse"]["resident_rows"] == 0


def test_engine_retraction_and_abort(weights64):
    """Retraction: two requests growing past one 256-token page in a pool of two pages (the newer
    is retracted and recomputed). Abort: r1 is aborted while decoding, r2 takes its request slot,
    whose hot rows must have gone back (a stale mapping would hand r2 r1's rows)."""
    cases = [([_tokens(240, 3), _tokens(236, 4)], [24, 26], None, 512),
             ([_tokens(70, 5), _tokens(80, 6), _tokens(75, 7)], [6, 30, 4], {"r1": 6}, 1024)]
    for prompts, new, abort_at, tokens in cases:
        runs = []
        for hs in (None, smallest(tokens)):
            eng = _engine(hs, max_total_tokens=tokens)
            runs.append((eng, _drive(eng, prompts, new, abort_at=abort_at)))
        (off, f_off), (on, f_on) = runs
        if abort_at is None:
            assert on.scheduler.num_retractions >= 1
        else:
            assert f_on["r1"].finish_reason["type"] == "abort" and 0 < len(f_on["r1"].output_ids) < 30
        assert on.scheduler.num_retractions == off.scheduler.num_retractions
        _same_logits(on, off, f_on, f_off)
        assert on.stats()["hisparse"]["swapped_rows"] > 0
        assert on.stats()["overlap"]["enabled"] and on.stats()["overlap_steps"] > 0
        _all_free(on)


def test_prompt_longer_than_the_swa_pool_is_admitted(weights64):
    """sglang#30401 capped prompts at the SWA pool's size under HiSparse. Here the SWA pool holds
    256 tokens (the minimum for 1 request) and a 300-token prompt runs and matches HiSparse off."""
    prompts = [_tokens(300, 6)]
    runs = []
    for hs in (None, smallest(1024, requests=1)):
        eng = _engine(hs, max_total_tokens=1024, swa_ratio=0.01, chunked_prefill_size=256, max_running_requests=1)
        assert eng.plan.swa_tokens == 256 < len(prompts[0])
        runs.append((eng, _drive(eng, prompts, [4])))
    (off, f_off), (on, f_on) = runs
    _same_logits(on, off, f_on, f_off)
    assert len(f_on["r0"].output_ids) == 4
    _all_free(on)


def test_concurrent_long_requests_finish(weights64):
    """sglang#26427: concurrent long-context requests crashed or wedged under HiSparse. Three
    requests of 200-260 tokens (50-65 C4 rows each) have buffers of 16 rows per layer and share
    16 staging rows."""
    prompts = [_tokens(n, 10 + n) for n in (260, 200, 230)]
    eng = _engine(smallest(1536, requests=3), max_total_tokens=1536, max_running_requests=3, chunked_prefill_size=128)
    assert eng.pools.hisparse.rows == 4 * TOPK
    finals = _drive(eng, prompts, [6, 6, 6])
    assert all(len(f.output_ids) == 6 and f.finish_reason["type"] == "length" for f in finals.values())
    _all_free(eng)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU path: Triton kernels, CUDA graphs, pinned host pool")
@pytest.mark.parametrize("attention_kernel", ["triton", "auto"])
def test_engine_bit_identical_on_cuda(attention_kernel):
    """On the GPU (bf16, CUDA graphs, the overlap schedule, rows moved by the copy kernel from the
    pinned host pool): HiSparse on with buffers of top-k rows gives the logits of HiSparse off bit
    for bit, across batched chunked prefill, decode past top-k rows, a retraction and an abort."""
    prompts = [_tokens(240, 3), _tokens(236, 4), _tokens(90, 5)]
    new, abort_at = [24, 26, 8], {"r2": 5}
    runs = []
    for hs in (None, smallest(1024, requests=3)):
        eng = _engine(hs, device="cuda", dtype="bfloat16", max_total_tokens=1024, max_running_requests=3,
                      attention_kernel=attention_kernel)
        runs.append((eng, _drive(eng, prompts, new, abort_at=abort_at)))
    (off, f_off), (on, f_on) = runs
    for rid, out in f_off.items():
        assert f_on[rid].output_ids == out.output_ids, rid
        assert torch.equal(on.captured_logits(rid), off.captured_logits(rid)), rid
    assert on.stats()["hisparse"]["swapped_rows"] > 0
    _all_free(on)


# ---- the Triton backend (interpreter) -------------------------------------------------------

@pytest.mark.usefixtures("default_decode_launch")   # query blocks of 2 rows against one pass of 12
def test_triton_backend_bit_identical():
    """One CSA layer, top-2 of 3 rows, buffers of 2 rows and 4 staging rows: the 12-query prefill
    runs in 6 staging blocks, the decode swaps rows into its buffer (rows moved by the copy kernel)."""
    cfg = DSV4Config.preset("tiny", vocab_size=512, num_hidden_layers=1, compress_ratios=(4, 0), index_topk=2)
    w = random_weights(cfg, seed=1, dtype=torch.float32, include_mtp=False)
    seqs = {"a": [t % 512 for t in _tokens(13, 7)]}
    out = []
    for hs in (None, {"top_k": 2, "device_buffer_size": 2, "host_to_device_ratio": 32}):
        r = ModelRunner.build(cfg, dtype=torch.float32, weights=w, backend="triton", max_total_tokens=1024,
                              max_running_requests=2, hisparse_config=hs)
        out.append(run_schedule(r, [[("a", 12)], [("a", 1)]], seqs)["a"])
    hs = r.pools.hisparse
    assert hs.rows == 8 and hs.blocks(12, 2) == [(i, i + 2) for i in range(0, 12, 2)]
    assert hs.swapped_rows > 0 and hs.staged_rows > 0
    assert torch.equal(out[0], out[1])
    hs.check_integrity([0])


# ---- the flags: memory.plan, server, Engine ---------------------------------------------------

def test_plan_cli_device_and_host_bytes(capsys):
    from memory.plan import main
    assert main(["--preset", "flash", "--budget-gb", "100", "--enable-hisparse", "--hisparse-config",
                 '{"host_to_device_ratio": 4}', "--context-len", "1048576", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    full = d["max_full_tokens"]
    assert d["c4_shrink_factor"] == 4 and d["c4_rows"] == full // 16 and d["c4_indexer_rows"] == full // 4
    # host: every C4 row of the 21 CSA layers in 64-row pages plus a dummy page
    assert d["host_bytes"] == d["host_pool_bytes"]["c4_kv"] == 21 * (-(-full // 4 // 64) + 1) * 64 * 584
    assert d["pool_bytes"]["c4_kv"] == 21 * (-(-full // 16 // 64) + 1) * 64 * 584
    assert d["requests_fit"]["1048576"] == full // 1048576
    off = DSV4PoolConfigurator(DSV4Config.preset("flash")).plan_for_budget(100 * 2**30)
    assert full // 1048576 >= 1.4 * off.requests_fit(1048576)       # 18 against 12
    assert main(["--preset", "flash", "--enable-hisparse", "--context-len", "131072"]) == 0
    out = capsys.readouterr().out
    assert "device GiB" in out and "host GiB" in out and "requests of 131,072 tokens that fit" in out
    assert main(["--preset", "flash", "--hisparse-config", "{}"]) == 2
    assert "--enable-hisparse" in capsys.readouterr().err


def test_server_and_engine_flags():
    from server import parse_args
    kw = parse_args(["--enable-hisparse", "--hisparse-config", '{"top_k": 16, "device_buffer_size": 32}']).engine_kwargs()
    assert kw["enable_hisparse"] and json.loads(kw["hisparse_config"])["device_buffer_size"] == 32
    assert "enable_hisparse" not in parse_args([]).engine_kwargs()
    for bad in (["--hisparse-config", "{}"], ["--enable-hisparse", "--hisparse-config", '{"top_k": 0}']):
        with pytest.raises(SystemExit):
            parse_args(bad)
    with pytest.raises(ValueError, match="enable_hisparse"):
        _engine(None, hisparse_config="{}")
    eng = _engine(smallest())
    assert eng.pools.hisparse.rows == 3 * TOPK and eng.plan.c4_shrink_factor == TOKENS / (4 * 3 * TOPK)
