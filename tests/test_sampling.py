"""Sampling against direct formulas written here in plain Python (float64, math module)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from scheduler_hooks.io import SamplingParams
from scheduler_hooks.sampling import SampleInput, apply_penalties, filtered_probs, logprob_entries, sample


def _rand_logits(V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g, dtype=torch.float64) * 2.5


def _penalised(logits: list[float], prompt: list[int], output: list[int], rp: float, fp: float, pp: float):
    out = []
    seen = set(prompt) | set(output)
    for v, x in enumerate(logits):
        if v in seen:
            x = x / rp if x > 0 else x * rp
        c = output.count(v)
        x -= fp * c + pp * (1 if c else 0)
        out.append(x)
    return out


def _filtered(logits: list[float], T: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    m = max(x / T for x in logits)
    e = [math.exp(x / T - m) for x in logits]
    s = sum(e)
    p = [x / s for x in e]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep, before = set(), 0.0
    for rank, i in enumerate(order):
        ok = (top_k < 0 or rank < top_k) and before <= top_p and p[i] >= min_p * p[order[0]]
        if ok or rank == 0:
            keep.add(i)
        before += p[i]
    z = sum(p[i] for i in keep)
    return [p[i] / z if i in keep else 0.0 for i in range(len(p))]


@pytest.mark.parametrize("rp,fp,pp", [(1.3, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, 0.6, 0.0), (1.0, -0.4, 0.9),
                                      (1.5, 0.5, -0.3)])
def test_penalties_match_formula(rp, fp, pp):
    V = 50
    rng = random.Random(int(rp * 100 + fp * 10 + pp))
    logits = _rand_logits(V, 3)
    prompt = [rng.randrange(V) for _ in range(12)]
    output = [rng.randrange(V) for _ in range(20)]   # with repeats: counts matter
    params = SamplingParams(repetition_penalty=rp, frequency_penalty=fp, presence_penalty=pp)
    got = apply_penalties(logits, params, prompt, output)
    want = torch.tensor(_penalised(logits.tolist(), prompt, output, rp, fp, pp), dtype=torch.float64)
    assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()
    assert not torch.equal(got, logits)          # the case is not trivial
    assert torch.equal(logits, _rand_logits(V, 3))  # the input row is not modified


@pytest.mark.parametrize("T,top_k,top_p,min_p", [(1.0, -1, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, -1, 0.6, 0.0),
                                                 (1.0, -1, 1.0, 0.08), (0.9, 7, 0.8, 0.05), (2.0, 3, 0.3, 0.5)])
def test_filtered_probs_match_formula(T, top_k, top_p, min_p):
    V = 40
    logits = _rand_logits(V, 11)
    params = SamplingParams(temperature=T, top_k=top_k, top_p=top_p, min_p=min_p)
    got = filtered_probs(logits, params)
    want = torch.tensor(_filtered(logits.tolist(), T, top_k, top_p, min_p), dtype=torch.float64)
    assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()
    assert (got > 0).sum() == (want > 0).sum()


def test_top_p_keeps_the_crossing_token():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64))
    p = filtered_probs(logits, SamplingParams(top_p=0.6))
    assert (p > 0).tolist() == [True, True, False, False]   # 0.5 < 0.6, so 0.3 is needed to reach it
    assert abs(float(p[0]) - 0.5 / 0.8) < 1e-12


def test_greedy_is_argmax_of_penalised_logits():
    V = 30
    logits = _rand_logits(V, 5)
    top = int(logits.argmax())
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    gen = torch.Generator().manual_seed(0)
    tok = sample(logits[None], [SampleInput(p, [top], [], gen)]).token_ids[0]
    pen = _penalised(logits.tolist(), [top], [], 2.0, 0.0, 0.0)
    assert tok == max(range(V), key=lambda i: pen[i])
    assert tok != top or logits[top] < 0


def test_batched_greedy_equals_row_by_row():
    """The batched argmax of plain greedy rows picks what each row's own argmax picks (first
    maximum on ties), and rows with penalties or temperature keep their own path."""
    V, B = 40, 9
    g = torch.Generator().manual_seed(7)
    logits = torch.randint(-3, 4, (B, V), generator=g).double()    # many exact ties
    params = [SamplingParams(temperature=0.0)] * 5 + [SamplingParams(temperature=0.0, repetition_penalty=1.5),
                                                      SamplingParams(temperature=0.0, presence_penalty=0.5),
                                                      SamplingParams(temperature=0.8, seed=3),
                                                      SamplingParams(temperature=0.0)]
    outs = [[1, 2], [], [5], [], [0, 0, 0], [4], [9, 9], [], [3]]
    ins = [SampleInput(p, [2, 3], o, torch.Generator().manual_seed(i)) for i, (p, o) in enumerate(zip(params, outs))]
    got = sample(logits, ins).token_ids
    for i in (0, 1, 2, 3, 4, 8):
        row = logits[i].tolist()
        assert got[i] == row.index(max(row))                          # the first maximum
    for i in (5, 6):
        pen = _penalised(logits[i].tolist(), [2, 3], outs[i], params[i].repetition_penalty,
                         params[i].frequency_penalty, params[i].presence_penalty)
        assert got[i] == pen.index(max(pen))
    solo = sample(logits[7:8], [SampleInput(params[7], [2, 3], [], torch.Generator().manual_seed(7))]).token_ids[0]
    assert got[7] == solo


def test_seeded_sampling_ignores_batch_composition():
    V = 64
    row = _rand_logits(V, 21)
    p = SamplingParams(temperature=1.0, seed=1234)

    def draws(batch_extra: int) -> list[int]:
        gen = torch.Generator().manual_seed(1234)
        other = torch.Generator().manual_seed(99)
        toks = []
        for step in range(25):
            rows = [row] + [_rand_logits(V, 100 + step * 7 + j) for j in range(batch_extra)]
            ins = [SampleInput(p, [], toks, gen)] + [SampleInput(SamplingParams(), [], [], other)
                                                        for _ in range(batch_extra)]
            toks.append(sample(torch.stack(rows), ins).token_ids[0])
        return toks

    a, b, c = draws(0), draws(3), draws(1)
    assert a == b == c
    assert len(set(a)) > 3   # really sampling, not argmax


def test_sampling_frequencies_follow_filtered_probs():
    V = 6
    logits = _rand_logits(V, 2)
    params = SamplingParams(temperature=0.8, top_k=4, min_p=0.02)
    want = filtered_probs(logits, params)
    gen = torch.Generator().manual_seed(7)
    n = 6000
    batch = logits[None].expand(n, V)
    toks = sample(batch, [SampleInput(params, [], [], gen)] * n).token_ids
    freq = torch.bincount(torch.tensor(toks), minlength=V).double() / n
    assert freq[want == 0].sum() == 0
    assert (freq - want).abs().max() < 0.03, (freq, want)


def test_logprobs_are_of_raw_logits():
    V = 20
    rows = torch.stack([_rand_logits(V, s) for s in (1, 2, 3)])
    ids = torch.tensor([4, 0, 19])
    chosen, tops = logprob_entries(rows, ids, top_n=3)
    for r in range(3):
        xs = rows[r].tolist()
        lse = math.log(sum(math.exp(x) for x in xs))
        assert abs(chosen[r] - (xs[int(ids[r])] - lse)) < 1e-12
        best = sorted(range(V), key=lambda i: -xs[i])[:3]
        assert [t.token_id for t in tops[r]] == best
        assert all(abs(t.logprob - (xs[t.token_id] - lse)) < 1e-12 for t in tops[r])
    # penalties and temperature do not change the reported logprob
    p = SamplingParams(temperature=0.5, repetition_penalty=1.8, seed=3)
    gen = torch.Generator().manual_seed(3)
    out = sample(rows[:1], [SampleInput(p, [1, 2], [3], gen, top_logprobs_num=2, return_logprob=True)])
    lp_direct, _ = logprob_entries(rows[:1], torch.tensor(out.token_ids), 0)
    assert out.logprobs == lp_direct and len(out.top_logprobs[0]) == 2


def test_mixed_batch_draws_follow_each_rows_filtered_probs():
    """One batch of rows with different temperature / top-k / top-p / min-p (and a penalised
    one): every draw lies in its row's support, and each row's frequencies follow the plain-Python
    formula within 5 binomial standard deviations (sqrt(p (1 - p) / n)) plus the float64 rounding."""
    V, n = 12, 3000
    base = _rand_logits(V, 31)
    rows = [SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.3, top_p=0.5),
            SamplingParams(temperature=1.0, min_p=0.2), SamplingParams(temperature=0.9),
            SamplingParams(temperature=1.1, top_k=5, repetition_penalty=1.4)]
    outs = [[], [], [], [], [1, 4]]
    gens = [torch.Generator().manual_seed(40 + i) for i in range(len(rows))]
    ins = [SampleInput(rows[j], [2], outs[j], gens[j]) for _ in range(n) for j in range(len(rows))]
    got = torch.tensor(sample(base[None].expand(n * len(rows), V).clone(), ins).token_ids).view(n, len(rows))
    for j, p in enumerate(rows):
        lg = _penalised(base.tolist(), [2], outs[j], p.repetition_penalty, 0.0, 0.0)
        want = torch.tensor(_filtered(lg, p.temperature, p.top_k, p.top_p, p.min_p), dtype=torch.float64)
        freq = torch.bincount(got[:, j], minlength=V).double() / n
        assert freq[want == 0].sum() == 0, (j, freq, want)
        tol = 5 * (want * (1 - want) / n).sqrt() + 1e-12
        assert ((freq - want).abs() <= tol).all(), (j, freq, want)


@pytest.mark.parametrize("dev", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_one_device_read_per_step_whatever_the_parameters(monkeypatch, dev):
    """Greedy, penalised, temperature and filtered rows together: the token ids come back in one
    ``tolist`` and no row is read on its own (no ``item`` / ``cpu``)."""
    V = 30
    logits = torch.stack([_rand_logits(V, s) for s in range(6)]).to(dev)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, presence_penalty=0.5),
              SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.0, top_k=4),
              SamplingParams(temperature=1.0, top_p=0.3, repetition_penalty=1.2), SamplingParams(min_p=0.1)]
    ins = [SampleInput(p, [1], [3, 3], torch.Generator().manual_seed(i)) for i, p in enumerate(params)]
    reads = []
    for name in ("tolist", "item", "cpu"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _r=real, **k: reads.append(_n) or _r(self, *a, **k))
    out = sample(logits, ins)
    monkeypatch.undo()
    assert reads == ["tolist"]
    assert all(e is None for e in out.errors) and all(0 <= t < V for t in out.token_ids)
