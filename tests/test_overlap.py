"""The overlap schedule (scheduler_hooks/overlap.py) against the synchronous one.

Each case runs the same requests (same ids, arrivals and aborts, by step) through two engines
that differ only in ``disable_overlap_schedule``, and compares them: every request's output ids,
finish reason and streamed pieces, and the raw logits of every position it computed
(``capture_logits``). Then the pools must be empty and ``check_integrity()`` must pass.

Tolerances. Where both schedules run the very same batches (finishes by length only, with
room for every request: the overlap schedule does not launch a row after a request's last
token, ``test_length_finishes_run_the_same_batches``) the arithmetic is the same, so logits
and logprobs are compared for equality, in float32 too. Where the overlap schedule's batches
differ (a row decoded after an EOS / stop, a request slot or pages given back one step later)
a row's arithmetic may depend on its batch (CPU matmul blocking), so float64 logits are
compared to the engine's float64 bound against the reference (1e-9, tests/test_engine.py) and
tokens for equality. The tiny preset, 1024-token vocabulary, seeded random weights, one thread.
"""

from __future__ import annotations

import random
from typing import Optional

import pytest
import torch

from dsv4_backend import Engine
from scheduler_hooks.io import GenerateRequest, SamplingParams
from scheduler_hooks.sampling import PendingSample

V = 1024
OVERRIDES = {"vocab_size": V}
EXACT_TOL = 1e-9      # float64: the engine's bound against the float64 reference


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_engine(overlap: bool, **kw) -> Engine:
    args = dict(preset="tiny", dtype="float64", skip_tokenizer_init=True, config_overrides=OVERRIDES,
                capture_logits=True, max_total_tokens=4096, max_running_requests=4, chunked_prefill_size=64,
                disable_overlap_schedule=not overlap)
    args.update(kw)
    return Engine(**args)


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(V) for _ in range(n)] for n in lengths]


class Run:
    """One engine's run of a case: finals, streamed pieces, captured logits, stats."""

    def __init__(self, eng: Engine, reqs: list[GenerateRequest], arrive: dict[str, int],
                 abort_at: dict[str, int]):
        self.finals, self.delta_ids, self.delta_text = {}, {r.rid: [] for r in reqs}, {r.rid: "" for r in reqs}
        self.logits: dict[str, torch.Tensor] = {}
        sched, step = eng.scheduler, 0
        while len(self.finals) < len(reqs):
            for r in reqs:
                if arrive.get(r.rid, 0) == step:
                    sched.add(r)
                if abort_at.get(r.rid) == step and r.rid not in self.finals:
                    out = sched.abort(r.rid)
                    if out is not None:
                        self._take(out)
            for out in eng.step():
                self._take(out)
            step += 1
            assert step < 2000, "the case does not finish"
        for rid, out in self.finals.items():
            if eng.scheduler.cfg.capture_logits and rid in eng.scheduler.captured:
                self.logits[rid] = eng.captured_logits(rid)
        self.stats = eng.stats()
        assert eng.scheduler.idle and eng.scheduler.overlap.in_flight is None
        eng.check_integrity()
        used = {k: v["used"] for k, v in self.stats["pools"].items() if v["used"]}
        assert not used, f"pools still in use: {used}"

    def _take(self, out) -> None:
        assert out.rid not in self.finals, f"{out.rid}: an output after its final one"
        self.delta_ids[out.rid] += out.delta_ids
        self.delta_text[out.rid] += out.delta_text
        if out.finished:
            self.finals[out.rid] = out

    def ids(self, rid: str) -> list[int]:
        return self.finals[rid].output_ids


def run_both(reqs_fn, arrive: Optional[dict[str, int]] = None, abort_at: Optional[dict[str, int]] = None,
             **engine_kw) -> tuple[Run, Run]:
    """(synchronous run, overlap run) of the requests ``reqs_fn()`` makes (fresh objects per run)."""
    runs = []
    for overlap in (False, True):
        with make_engine(overlap, **engine_kw) as eng:
            runs.append(Run(eng, reqs_fn(), arrive or {}, abort_at or {}))
    sync, ov = runs
    assert sync.stats["overlap_steps"] == 0 and ov.stats["overlap_steps"] > 0, ov.stats["overlap"]
    for run in runs:          # what was streamed is what the request ended with: nothing discarded leaked
        for rid, out in run.finals.items():
            assert run.delta_ids[rid] == out.output_ids, rid
            assert run.delta_text[rid] == out.text, rid
    return sync, ov


def assert_same(sync: Run, ov: Run, rids, tol: Optional[float]) -> None:
    """Equal tokens, finish reasons and logprobs; logits equal (tol None) or within tol."""
    for rid in rids:
        a, b = sync.finals[rid], ov.finals[rid]
        assert b.output_ids == a.output_ids, rid
        assert b.finish_reason == a.finish_reason, rid
        assert b.text == a.text, rid
        if tol is None:
            assert b.output_token_logprobs == a.output_token_logprobs, rid
        if rid in sync.logits:
            la, lb = sync.logits[rid], ov.logits[rid]
            assert la.shape == lb.shape, (rid, la.shape, lb.shape)
            if tol is None:
                assert torch.equal(la, lb), (rid, float((la - lb).abs().max()))
            else:
                d = float((la - lb).abs().max())
                assert d <= tol, (rid, d)


def greedy_ids(prompt: list[int], n: int, **kw) -> list[int]:
    with make_engine(False, capture_logits=False, **kw) as eng:
        return eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": n, "temperature": 0.0})["output_ids"]


def first_repeat_free(ids: list[int], start: int) -> int:
    """An index k >= start whose token does not occur before it (stopping on it stops at k)."""
    return next(k for k in range(start, len(ids)) if ids[k] not in ids[:k])


# ---- the same batches: equality ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_length_finishes_run_the_same_batches(dtype):
    """Finishes by max_new_tokens only and room for all: the overlap schedule launches exactly
    the synchronous batches (no row after a last token), so everything is equal, logprobs too."""
    ps = prompts([5, 40, 130, 17], seed=1)
    lens = [3, 9, 6, 1]

    def reqs():
        return [GenerateRequest(p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True), rid=f"r{i}",
                                return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
                for i, (p, n) in enumerate(zip(ps, lens))]

    logs = []
    for overlap in (False, True):
        with make_engine(overlap, dtype=dtype) as eng:
            steps, inner = [], eng.runner.forward
            eng.runner.forward = lambda fr, *a: steps.append([(r.req_slot, r.prefix_len, len(r.input_ids))
                                                              for r in fr]) or inner(fr, *a)
            run = Run(eng, reqs(), {"r3": 2}, {})
            logs.append((steps, run))
    (steps_a, sync), (steps_b, ov) = logs
    assert steps_a == steps_b
    assert ov.stats["overlap_steps"] > 0 and ov.stats["overlap"]["discarded_rows"] == 0
    assert [len(ov.ids(f"r{i}")) for i in range(4)] == lens
    assert_same(sync, ov, [f"r{i}" for i in range(4)], tol=None)
    for rid in sync.finals:
        a, b = sync.finals[rid], ov.finals[rid]
        assert (a.input_token_logprobs, a.output_top_logprobs) == (b.input_token_logprobs, b.output_top_logprobs)


def test_next_step_is_launched_before_the_tokens_are_read():
    """With overlap, step N + 1's forward is called before step N's sampled ids are read; without,
    every read comes before the next forward."""
    orders = {}
    real = PendingSample.result
    for overlap in (False, True):
        log = []

        def result(self, _log=log):
            if self._result is None:
                _log.append("read")
            return real(self)

        with make_engine(overlap, capture_logits=False) as eng:
            inner = eng.runner.forward
            eng.runner.forward = lambda fr, *a, _log=log: _log.append("forward") or inner(fr, *a)
            PendingSample.result = result
            try:
                eng.generate(input_ids=prompts([9], seed=2)[0], sampling_params={"max_new_tokens": 5,
                                                                                 "temperature": 0.0})
            finally:
                PendingSample.result = real
        orders[overlap] = log
    assert orders[False] == ["forward", "read"] * 5
    # the prefill, then 4 decodes each launched before the previous step's read
    assert orders[True] == ["forward"] + ["forward", "read"] * 4 + ["read"]


# ---- late finishes: a row decoded after the last token, discarded -----------------------------

@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_eos_and_stop_tokens_mid_batch(dtype):
    ps = prompts([6, 33, 129, 20], seed=3)
    g1, g2 = greedy_ids(ps[1], 12, dtype=dtype), greedy_ids(ps[2], 12, dtype=dtype)
    k1, k2 = first_repeat_free(g1, 3), first_repeat_free(g2, 5)
    eos = g2[k2]
    assert eos not in g1[:k1 + 1]          # b stops on its stop token, not on c's EOS

    def reqs():
        return [GenerateRequest(ps[0], SamplingParams(max_new_tokens=10, temperature=0.0), rid="a"),
                GenerateRequest(ps[1], SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[g1[k1]]),
                                rid="b"),
                GenerateRequest(ps[2], SamplingParams(max_new_tokens=12, temperature=0.0), rid="c"),
                GenerateRequest(ps[3], SamplingParams(max_new_tokens=7, temperature=0.0, ignore_eos=True), rid="d")]

    sync, ov = run_both(reqs, dtype=dtype, config_overrides={**OVERRIDES, "eos_token_id": eos})
    assert sync.ids("b") == g1[:k1 + 1] and sync.finals["b"].finish_reason == {"type": "stop", "matched": g1[k1]}
    assert sync.ids("c") == g2[:k2 + 1] and sync.finals["c"].finish_reason == {"type": "stop", "matched": eos}
    assert ov.stats["overlap"]["discarded_rows"] >= 2      # b's and c's rows after their stop
    # float32: the tokens are the synchronous run's; the logits of a batch of other rows may round
    # differently, and an e4m3 rounding that flips moves a logit by up to F32 bounds: not compared
    assert_same(sync, ov, "abcd", tol=EXACT_TOL if dtype == "float64" else float("inf"))


def test_stop_strings():
    def make(overlap: bool) -> Engine:
        return Engine(preset="tiny", dtype="float32", config_overrides=OVERRIDES, max_total_tokens=2048,
                      max_running_requests=3, disable_overlap_schedule=not overlap)

    prompt = "x = 1 + 2;"                      # every token id of it is < 1024
    with make(False) as eng:
        text = eng.generate(prompt, {"max_new_tokens": 24, "temperature": 0.0})["text"]
        ids = eng.tokenizer.encode(prompt)
        other = ids[::-1]                      # another prompt of ids < 1024
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert len(stop) == 3

    def reqs():
        sp = dict(max_new_tokens=24, temperature=0.0)
        return [GenerateRequest(ids, SamplingParams(**sp, stop=[stop]), rid="trim"),
                GenerateRequest(ids, SamplingParams(**sp, stop=[stop], no_stop_trim=True), rid="keep"),
                GenerateRequest(other, SamplingParams(max_new_tokens=20, temperature=0.0), rid="other")]

    runs = []
    for overlap in (False, True):
        with make(overlap) as eng:
            runs.append(Run(eng, reqs(), {}, {}))
    sync, ov = runs
    assert sync.finals["trim"].text == text[:text.find(stop)]
    assert sync.finals["keep"].finish_reason == {"type": "stop", "matched": stop}
    assert ov.stats["overlap_steps"] > 0 and ov.stats["overlap"]["discarded_rows"] >= 2
    for run in runs:
        for rid, out in run.finals.items():
            assert run.delta_ids[rid] == out.output_ids and run.delta_text[rid] == out.text, rid
    assert_same(sync, ov, ["trim", "keep", "other"], tol=float("inf"))


def test_seeded_sampling():
    ps = prompts([8, 50, 21], seed=4)
    g = greedy_ids(ps[0], 10)

    def reqs():
        return [GenerateRequest(ps[0], SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=11,
                                                      stop_token_ids=[g[3]]), rid="p"),
                GenerateRequest(ps[1], SamplingParams(max_new_tokens=9, temperature=1.1, top_k=20, seed=12), rid="k"),
                GenerateRequest(ps[2], SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.8, top_k=50,
                                                      min_p=0.05, seed=13), rid="m"),
                GenerateRequest(ps[1], SamplingParams(max_new_tokens=6, temperature=0.0), rid="g")]

    sync, ov = run_both(reqs)
    assert len(set(tuple(sync.ids(r)) for r in "pkm")) == 3
    assert_same(sync, ov, ["p", "k", "m", "g"], tol=EXACT_TOL)


def test_chunked_prefill_mixed_with_decodes():
    """Long prompts prefill in chunks of 32 (16 beside decodes) while others decode; requests arrive
    at different steps; their first tokens come from chunks that complete while others decode."""
    ps = prompts([300, 7, 140, 45, 260], seed=5)
    g = greedy_ids(ps[1], 16)
    k = first_repeat_free(g, 6)

    def reqs():
        return [GenerateRequest(ps[0], SamplingParams(max_new_tokens=6, temperature=0.0), rid="long"),
                GenerateRequest(ps[1], SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=[g[k]]),
                                rid="short"),
                GenerateRequest(ps[2], SamplingParams(max_new_tokens=8, temperature=0.0), rid="mid"),
                GenerateRequest(ps[3], SamplingParams(max_new_tokens=11, temperature=0.9, seed=3), rid="seeded"),
                GenerateRequest(ps[4], SamplingParams(max_new_tokens=5, temperature=0.0), rid="late")]

    sync, ov = run_both(reqs, {"long": 2, "mid": 3, "seeded": 5, "late": 9}, chunked_prefill_size=32,
                        mixed_chunk_tokens=16, max_running_requests=3)
    assert sync.ids("short") == g[:k + 1]
    assert_same(sync, ov, ["long", "short", "mid", "seeded", "late"], tol=EXACT_TOL)


def test_a_late_finish_leaves_the_prefix_cache_as_a_synchronous_one():
    """The row decoded after the stop token is the position that completes a full page (256): cut
    before the finish, the cache gets the pages a synchronous finish leaves, not one more."""
    for n in range(250, 240, -1):                 # a prompt whose greedy token at 255 - n is new
        prompt = prompts([n], seed=n)[0]
        g = greedy_ids(prompt, 256 - n)
        k = 255 - n                               # the stop token's position is n + k = 255
        if g[k] not in g[:k]:
            break
    else:
        pytest.fail("no prompt length found")

    def reqs():
        return [GenerateRequest(prompt, SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[g[k]]),
                                rid="a")]

    cached = []
    for overlap in (False, True):
        with make_engine(overlap) as eng:
            run = Run(eng, reqs(), {}, {})
            cached.append(eng.pool_usage()["full"]["cached"])
            eng.flush_cache()
            eng.check_integrity()
        runs = run if overlap else None
    assert runs.ids("a") == g[:k + 1] and runs.stats["overlap"]["discarded_rows"] == 1
    assert cached[1] == cached[0] == 0, cached     # seq_len 255 at the finish: no whole page


# ---- aborts and retraction -----------------------------------------------------------------------

def test_aborts_mid_stream():
    """Aborted in prefill, while decoding (its token in flight) and while waiting; the others are
    unchanged. An aborted request's token in flight is dropped: its output is the synchronous one's
    or one token shorter."""
    ps = prompts([200, 10, 30, 60, 12], seed=6)

    def reqs():
        sp = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (8, 20, 20, 9, 7)]
        return [GenerateRequest(p, s, rid=f"r{i}") for i, (p, s) in enumerate(zip(ps, sp))]

    aborts = {"r0": 1, "r1": 5, "r2": 9, "r4": 1}     # r0: in its prefill; r4: still waiting
    sync, ov = run_both(reqs, {"r4": 0}, aborts, chunked_prefill_size=64, max_running_requests=3)
    assert_same(sync, ov, ["r3"], tol=EXACT_TOL)
    for rid in aborts:
        a, b = sync.ids(rid), ov.ids(rid)
        assert b == a[:len(b)] and len(a) - 1 <= len(b) <= len(a), (rid, a, b)
        assert ov.finals[rid].finish_reason["type"] == "abort"
    assert len(sync.ids("r1")) > 0 and len(sync.ids("r2")) > len(sync.ids("r1"))


def test_retraction_under_a_small_pool(monkeypatch):
    """Two full pages for two requests that outgrow them: the newer one is retracted while decoding
    (its token in flight with the overlap schedule) and recomputed; a third waits for room."""
    from scheduler_hooks.scheduler import Scheduler
    ps = prompts([240, 236, 20], seed=7)
    retracted, real = [], Scheduler._retract
    monkeypatch.setattr(Scheduler, "_retract",
                        lambda self, r: retracted.append((self.overlap.enabled, r.in_flight is not None))
                        or real(self, r))

    def reqs():
        return [GenerateRequest(ps[0], SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True), rid="a"),
                GenerateRequest(ps[1], SamplingParams(max_new_tokens=26, temperature=0.0, ignore_eos=True), rid="b"),
                GenerateRequest(ps[2], SamplingParams(max_new_tokens=6, temperature=0.7, seed=5), rid="c")]

    sync, ov = run_both(reqs, {"c": 4}, max_total_tokens=512, chunked_prefill_size=64, max_running_requests=2)
    assert sync.stats["num_retractions"] >= 1 and ov.stats["num_retractions"] >= 1
    assert (True, True) in retracted          # the overlap run retracted a request with its token in flight
    assert_same(sync, ov, "abc", tol=EXACT_TOL)


# ---- falling back to synchronous steps --------------------------------------------------------

def test_penalties_fall_back():
    ps = prompts([12, 30], seed=8)

    def reqs():
        return [GenerateRequest(ps[0], SamplingParams(max_new_tokens=8, temperature=0.0, repetition_penalty=1.3),
                                rid="rep"),
                GenerateRequest(ps[1], SamplingParams(max_new_tokens=6, temperature=0.9, seed=2,
                                                      frequency_penalty=0.5, presence_penalty=0.3), rid="freq")]

    runs = []
    for overlap in (False, True):
        with make_engine(overlap) as eng:
            runs.append(Run(eng, reqs(), {}, {}))
    sync, ov = runs
    st = ov.stats["overlap"]
    assert st["enabled"] and st["overlap_steps"] == 0 and st["fallbacks"].get("penalties", 0) > 0, st
    assert_same(sync, ov, ["rep", "freq"], tol=None)      # synchronous steps: the same arithmetic


def test_speculative_decoding_turns_it_off():
    with make_engine(True, speculative_algorithm="EAGLE", speculative_num_steps=2, speculative_eagle_topk=1,
                     speculative_num_draft_tokens=3) as eng:
        out = eng.generate(input_ids=prompts([20], seed=9)[0], sampling_params={"max_new_tokens": 6,
                                                                                "temperature": 0.0})
        st = eng.stats()["overlap"]
        assert len(out["output_ids"]) == 6
        assert not st["enabled"] and st["off_reason"] == "speculative decoding" and st["overlap_steps"] == 0
        assert eng.scheduler.overlap.in_flight is None
        eng.check_integrity()


def test_flag_through_server_args():
    from server import parse_args
    assert parse_args(["--disable-overlap-schedule"]).engine_kwargs()["disable_overlap_schedule"] is True
    assert "disable_overlap_schedule" not in parse_args([]).engine_kwargs()
