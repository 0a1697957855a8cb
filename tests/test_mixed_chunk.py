"""The scheduler's cap on prefill tokens beside running decodes (``mixed_chunk_tokens``).

A request that is decoding when a long prompt arrives must keep getting a token every step,
and each such step may carry at most ``mixed_chunk_tokens`` of the prompt; steps without a
decode still prefill ``chunked_prefill_size``. Chunk boundaries anywhere are exact, so the
capped schedule's logits equal the float64 reference at every position (1e-9, as in
tests/test_engine.py). About 10 s on the shared two-core machine.
"""

from __future__ import annotations

import random

import pytest
import torch

from dsv4_backend import Engine
from dsv4_backend.config import DSV4Config
from dsv4_backend.reference import reference_forward
from dsv4_backend.weights import random_weights
from scheduler_hooks.io import GenerateRequest, SamplingParams
from server import parse_args

V = 1024
EXACT_TOL = 1e-9


def _engine(cap: int) -> Engine:
    return Engine(preset="tiny", dtype="float64", skip_tokenizer_init=True, config_overrides={"vocab_size": V},
                  capture_logits=True, max_total_tokens=4096, max_running_requests=2, chunked_prefill_size=4096,
                  mixed_chunk_tokens=cap)


def _run(cap: int, short: list[int], long: list[int]) -> tuple[Engine, list[list[tuple[int, int]]], dict, str]:
    """``short`` decodes; after its first token ``long`` arrives. Returns the engine, each step's
    (request slot, tokens) pairs from the long prompt's arrival on, the finished outputs and the
    short request's rid."""
    eng = _engine(cap)
    steps: list[list[tuple[int, int]]] = []
    inner = eng.runner.forward
    eng.runner.forward = lambda reqs, *a: steps.append([(r.req_slot, len(r.input_ids)) for r in reqs]) or inner(reqs, *a)
    a = GenerateRequest(short, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))
    b = GenerateRequest(long, SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
    eng.scheduler.add(a)
    finals = {o.rid: o for o in eng.step() if o.finished}
    steps.clear()
    eng.scheduler.add(b)
    while not eng.scheduler.idle:
        finals.update({o.rid: o for o in eng.step() if o.finished})
    return eng, steps, finals, a.rid


@pytest.fixture(scope="module")
def case():
    cfg = DSV4Config.preset("tiny", vocab_size=V)
    rng = random.Random(7)
    short, long = [rng.randrange(V) for _ in range(5)], [rng.randrange(V) for _ in range(300)]
    return cfg, random_weights(cfg, seed=0, dtype=torch.float64, include_mtp=False), short, long


def test_prefill_beside_decodes_is_capped_and_exact(case):
    cfg, weights, short, long = case
    eng, steps, finals, a = _run(48, short, long)
    try:
        a_slot = 0                                 # admitted first into empty pools
        beside = [s for s in steps if (a_slot, 1) in s and len(s) == 2]
        chunks = [n for s in beside for slot, n in s if slot != a_slot]
        # the long prompt went in 48-token chunks, each beside a decode of the short request
        assert chunks[:7] == [48] * 6 + [300 - 6 * 48]
        assert steps[:7] == beside[:7]             # every step of its prefill gave the short one a token
        for rid, out in finals.items():
            prompt = short if rid == a else long
            seq = prompt + out.output_ids
            ref = reference_forward(cfg, weights, seq[:-1], dtype=torch.float64)
            cap = eng.captured_logits(rid)
            d = (cap.double() - ref).abs()
            assert float(d.max()) <= EXACT_TOL, f"prompt {len(prompt)}: |engine - reference| = {float(d.max()):.3e}"
            assert out.output_ids == ref[len(prompt) - 1:].argmax(dim=1).tolist()
        assert [len(finals[r].output_ids) for r in sorted(finals, key=lambda r: r != a)] == [24, 3]
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_zero_is_the_old_policy_and_a_lone_prefill_is_not_capped(case):
    _, _, short, long = case
    eng, steps, _, _ = _run(0, short, long)
    eng.shutdown()
    assert steps[0] == [(0, 1), (1, 300)]          # the whole prompt beside the decode
    eng = _engine(48)
    try:   # no decode running: the full chunked_prefill_size
        seen = []
        inner = eng.runner.forward
        eng.runner.forward = lambda reqs, *a: seen.append([len(r.input_ids) for r in reqs]) or inner(reqs, *a)
        eng.generate(input_ids=long, sampling_params={"max_new_tokens": 1, "temperature": 0})
        assert seen == [[300]]
    finally:
        eng.shutdown()


def test_flag_and_validation():
    assert parse_args(["--mixed-chunk-tokens", "256"]).engine_kwargs()["mixed_chunk_tokens"] == 256
    assert "mixed_chunk_tokens" not in parse_args([]).engine_kwargs()
    with pytest.raises(ValueError, match="mixed_chunk_tokens"):
        Engine(preset="tiny", skip_tokenizer_init=True, config_overrides={"vocab_size": V}, max_total_tokens=512,
               mixed_chunk_tokens=-1)
