"""Rejection sampling of chain drafts (scheduler_hooks/rejection.py): the emitted tokens are
distributed as the target's own samples.

Each emitted token's frequency is checked against the target's probability, independently
computed here in float64 (softmax of logits / temperature, top-k applied by hand). Bound per
cell, over n draws of a Bernoulli(p) count: |f - p| <= Z * sqrt(p (1 - p) / n) + 1 / n with
Z = 5 (a two-sided normal tail of 5.7e-7 per cell; under 2e-5 over the cells checked, so a
correct sampler fails with negligible probability whatever the seed). The seed only makes the
run repeatable.
"""

from __future__ import annotations

import math

import torch

from scheduler_hooks.io import SamplingParams
from scheduler_hooks.rejection import accept_sampled, chain_accept
from scheduler_hooks.sampling import SampleInput

Z = 5.0
V = 6
N = 20_000


def _check(counts: torch.Tensor, p: torch.Tensor, what: str) -> None:
    n = int(counts.sum())
    assert n > 1000, f"{what}: only {n} draws"
    f = counts.double() / n
    bound = Z * torch.sqrt(p * (1 - p) / n) + 1.0 / n
    bad = (f - p).abs() > bound
    assert not bad.any(), f"{what}: frequencies {f.tolist()} vs probabilities {p.tolist()}"
    assert torch.all(counts[p == 0] == 0), f"{what}: a token of probability 0 was emitted"


def _target(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    p = torch.softmax(logits.double() / temperature, dim=-1)
    cut = p.sort(dim=-1, descending=True).values[:, top_k - 1: top_k]
    p = torch.where(p >= cut, p, 0.0)
    return p / p.sum(-1, keepdim=True)


def test_chain_accept_matches_the_target_distribution():
    """Drafts 2 then 4 (two rows favour them, one does not): the first token follows p0, the
    second (given the first draft accepted) p1, the third (given both) p2."""
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.10, 0.05, 0.55, 0.10, 0.20, 0.00],
                          [0.02, 0.08, 0.10, 0.00, 0.70, 0.10],
                          [0.30, 0.25, 0.05, 0.20, 0.10, 0.10]], dtype=torch.float64)
    drafts = [2, 4]
    first, second, third = (torch.zeros(V, dtype=torch.int64) for _ in range(3))
    lengths = torch.zeros(4, dtype=torch.int64)
    for _ in range(N):
        toks = chain_accept(probs, drafts, g)
        lengths[len(toks)] += 1
        assert toks[:-1] == drafts[:len(toks) - 1]
        first[toks[0]] += 1
        if len(toks) >= 2:
            second[toks[1]] += 1
        if len(toks) == 3:
            third[toks[2]] += 1
    _check(first, probs[0], "first token")
    _check(second, probs[1], "second token after the first draft")
    _check(third, probs[2], "bonus token after both drafts")
    # acceptance lengths: P(len 1) = 1 - p0(2), P(len 2) = p0(2) (1 - p1(4)), P(len 3) = p0(2) p1(4)
    a, b = float(probs[0, 2]), float(probs[1, 4])
    _check(lengths[1:], torch.tensor([1 - a, a * (1 - b), a * b], dtype=torch.float64), "acceptance lengths")


def test_accept_sampled_uses_the_sampling_parameters():
    """Through the verify rows' logits: temperature 0.7 and top-k 4 (a draft outside the top 4
    is always rejected), penalties absent; the first emitted token follows row 0's filtered
    distribution, and the logprobs returned are those of the emitted tokens."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    params = SamplingParams(temperature=0.7, top_k=4, max_new_tokens=8)
    want = _target(logits, 0.7, 4)
    outside = int(want[0].argmin())               # filtered out of row 0: its draft never survives
    for drafts, row0 in ([int(want[0].argmax()), int(want[1].argmax())], True), ([outside, 0], False):
        counts = torch.zeros(V, dtype=torch.int64)
        for _ in range(N // 4):
            inputs = [SampleInput(params, [1, 2], drafts[:i], g, 0, True) for i in range(3)]
            toks, res = accept_sampled(logits, drafts, inputs)
            counts[toks[0]] += 1
            if not row0:
                assert len(toks) == 1
            lp = torch.log_softmax(logits[: len(toks)], dim=-1)
            for i, t in enumerate(toks):
                assert math.isclose(res.logprobs[i], float(lp[i, t]), rel_tol=1e-12, abs_tol=1e-12)
            assert res.errors == [None] * 3
        _check(counts, want[0], f"first token, drafts {drafts}")


def test_non_finite_row_ends_the_chain():
    logits = torch.zeros(3, V, dtype=torch.float64)
    logits[1, 0] = float("nan")
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    g = torch.Generator().manual_seed(3)
    inputs = [SampleInput(params, [], [5] * i, g) for i in range(3)]
    toks, res = accept_sampled(logits, [5, 5], inputs)
    assert len(toks) == 1 and res.errors[0] is None and res.errors[1] is not None
    logits[0, 0] = float("inf")
    toks, res = accept_sampled(logits, [5, 5], inputs)
    assert res.errors[0] is not None
