"""Isolation in the engine: whatever one request carries, only that request can fail.

The engine runs its loop thread (the server's path: ``submit`` + callbacks) in float64, where a
request's tokens do not depend on what else is in its batch or on a recompute after a
retraction (docs/engine.md, "Correctness"), so "the others are untouched" is checked as
"the others produce exactly the tokens of a run without the failing request". Failures are
injected into one request mid-batch by wrapping the model runner's forward: NaN logits for
its row (a sampling failure) or an exception from the whole forward.
Whole file: about 5 s.
"""

from __future__ import annotations

import queue
import random

import pytest

from dsv4_backend import Engine
from scheduler_hooks.io import GenerateRequest, InvalidRequest, RequestOutput, SamplingParams

V = 1024
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def eng():
    e = Engine(preset="tiny", dtype="float64", skip_tokenizer_init=True, config_overrides={"vocab_size": V},
               max_total_tokens=4096, max_running_requests=4, chunked_prefill_size=64)
    e.start()
    yield e
    e.shutdown()


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(V) for _ in range(rng.randint(5, 40))] for _ in range(n)]


def run(eng: Engine, reqs: list[GenerateRequest]) -> dict[str, RequestOutput]:
    """Submit all, wait for every final output."""
    q: "queue.Queue[RequestOutput]" = queue.Queue()
    for r in reqs:
        eng.submit(r, q.put)
    finals: dict[str, RequestOutput] = {}
    while len(finals) < len(reqs):
        out = q.get(timeout=TIMEOUT_S)
        if out.finished:
            finals[out.rid] = out
    return finals


def greedy_req(rid: str, ids: list[int], n: int = 8, **params) -> GenerateRequest:
    return GenerateRequest(input_ids=ids, rid=rid, sampling_params=SamplingParams(
        max_new_tokens=n, temperature=0.0, ignore_eos=True, **params))


def assert_pools_free(eng: Engine) -> None:
    eng.check_integrity()
    used = {k: v["used"] for k, v in eng.pool_usage().items() if v["used"]}
    assert not used, f"pages still held: {used}"


class Injector:
    """Wraps ``eng.runner.forward``: once the victim's forward covers position ``at`` (its
    second output token), poison its logits row (``mode="nan"``) or raise (``mode="raise"``)."""

    def __init__(self, eng: Engine, victim: str, at: int, mode: str):
        self.eng, self.victim, self.at, self.mode = eng, victim, at, mode
        self.real = eng.runner.forward
        self.hits = 0

    def __enter__(self):
        self.eng.runner.forward = self.forward
        return self

    def __exit__(self, *exc):
        self.eng.runner.forward = self.real

    def forward(self, reqs, *args):
        try:
            slot = self.eng.allocator.req_slot(self.victim)
        except Exception:
            slot = None
        mine = [i for i, fr in enumerate(reqs)
                if fr.req_slot == slot and fr.prefix_len + len(fr.input_ids) > self.at]
        if mine and self.mode == "raise":
            self.hits += 1
            raise RuntimeError("injected forward failure")
        logits = self.real(reqs, *args)
        for i in mine:
            self.hits += 1
            logits[i][-1] = float("nan")
        return logits


@pytest.mark.parametrize("mode", ["nan", "raise"])
def test_a_failure_in_one_request_leaves_the_batch_untouched(eng, mode):
    ps = prompts(4, seed=11)
    innocent = {f"ok{i}": ps[i] for i in (0, 1, 3)}
    baseline = run(eng, [greedy_req(f"{rid}-base", ids) for rid, ids in innocent.items()])
    victim = f"victim-{mode}"
    with Injector(eng, victim, at=len(ps[2]) + 1, mode=mode) as inj:
        got = run(eng, [greedy_req(rid, ids) for rid, ids in innocent.items()]
                  + [greedy_req(victim, ps[2])])
    assert inj.hits >= 1
    bad = got[victim]
    assert bad.error and bad.finish_reason["type"] == "abort", bad
    assert bad.error in bad.finish_reason["message"]
    assert len(bad.output_ids) < 8
    for rid in innocent:
        out = got[rid]
        assert out.error is None and out.finish_reason["type"] == "length", out
        assert out.output_ids == baseline[f"{rid}-base"].output_ids, rid
    assert eng.stats()["num_failed"] >= 1
    assert_pools_free(eng)


def test_extreme_sampling_values_are_normalised_or_refused(eng):
    p = prompts(1, seed=5)[0]
    # a denormal temperature is greedy (SGLang: below 1e-5), not a division by ~0
    tiny_t = GenerateRequest(input_ids=p, rid="tiny-t", sampling_params=SamplingParams(
        max_new_tokens=6, temperature=5e-324, ignore_eos=True))
    got = run(eng, [tiny_t, greedy_req("zero-t", p, n=6)])
    assert got["tiny-t"].error is None and got["tiny-t"].output_ids == got["zero-t"].output_ids
    assert tiny_t.sampling_params.temperature == 0.0
    # top_k of the whole vocabulary or more is off
    big_k = GenerateRequest(input_ids=p, rid="big-k", sampling_params=SamplingParams(max_new_tokens=2, top_k=10 ** 12))
    run(eng, [big_k])
    assert big_k.sampling_params.top_k == -1
    # a repetition penalty that would overflow the logits is refused at submission
    with pytest.raises(InvalidRequest) as e:
        eng.submit(greedy_req("tiny-rp", p, repetition_penalty=1e-320), lambda out: None)
    assert e.value.param == "repetition_penalty"
    assert_pools_free(eng)


def test_duplicate_rid_is_refused_and_the_first_is_untouched(eng):
    p = prompts(1, seed=6)[0]
    q: "queue.Queue[RequestOutput]" = queue.Queue()
    eng.submit(greedy_req("same", p, n=6), q.put)
    with pytest.raises(InvalidRequest) as e:
        eng.submit(greedy_req("same", p, n=6), q.put)
    assert e.value.param == "rid"
    outs = []
    while not (outs and outs[-1].finished):
        outs.append(q.get(timeout=TIMEOUT_S))
    assert outs[-1].error is None and len(outs[-1].output_ids) == 6
    assert all(o.rid == "same" for o in outs)
    run(eng, [greedy_req("same", p, n=1)])      # finished: the id is free again
    assert_pools_free(eng)
