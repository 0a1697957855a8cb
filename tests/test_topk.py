"""The top-k kernels (dsv4_backend/kernels/topk.py) against an independent stable-sort reference.

On a machine without a GPU the kernels run under TRITON_INTERPRET=1 (set here and in conftest,
before triton is imported), at tiny shapes; small tiles and segments make even these rows span
several programs, tiles and both histogram branches. Every case draws fresh random scores (the
seed is in the failure message) with many exact ties, -0.0 next to +0.0 and -inf tails.
"""

import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import dsv4_backend.kernels.topk as topk_module  # noqa: E402
from dsv4_backend.kernels.indexer import topk_rows  # noqa: E402
from dsv4_backend.kernels.topk import TopKConfig, topk_positions, topk_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# several tiles and segments per row even at L ~ 1000, and the floor (step 1) at these sizes too;
# rank_all_max=0 keeps these short rows on the radix path (the all-pairs path has its own tests)
SMALL = TopKConfig(block=128, floor_min_elements=0, rank_all_max=0)


def _seed() -> int:
    return random.SystemRandom().randrange(1 << 31)


def _scores(b, L, g, *, levels=9, finite=None):
    """fp32 [b, L]: normal scores, about half snapped to a few levels (ties), some -0.0/+0.0,
    and row i finite only on its first ``finite[i]`` positions."""
    s = torch.randn(b, L, generator=g)
    snap = torch.rand(b, L, generator=g) < 0.5
    s = torch.where(snap, (s * levels / 4).round() / (levels / 4), s)
    zeros = torch.rand(b, L, generator=g) < 0.05
    s = torch.where(zeros, torch.where(torch.rand(b, L, generator=g) < 0.5, 0.0, -0.0), s)
    if finite is not None:
        s[torch.arange(L)[None, :] >= torch.as_tensor(finite)[:, None]] = float("-inf")
    return s


def _expected(s, k):
    """Stable descending sort in float64; -0.0 ranks just below +0.0 (bit order), -inf is a value"""
    v = s.double()
    v[(s == 0) & torch.signbit(s)] = -1e-300  # between -0.0's neighbours: below +0, above fp32 < 0
    return torch.sort(v, dim=1, descending=True, stable=True).indices[:, : min(k, s.shape[1])]


def _check(s, k, config=TopKConfig(), seed=None):
    got = topk_positions(s.to(DEV), k, config=config).cpu()
    exp = _expected(s, k)
    assert got.dtype == torch.int64 and got.shape == exp.shape, (got.shape, exp.shape)
    bad = (got != exp).nonzero()
    if bad.numel():
        r, c = bad[0].tolist()
        raise AssertionError(
            f"seed {seed}, {config}: {bad.shape[0]} positions differ; first row {r} rank {c}: "
            f"got {got[r, c].item()} (score {s[r, got[r, c]].item()}), "
            f"expected {exp[r, c].item()} (score {s[r, exp[r, c]].item()})")


@pytest.mark.parametrize("b,L,k", [
    (1, 300, 16), (3, 1000, 64), (2, 2048, 64), (4, 777, 32), (5, 129, 128), (2, 50, 64),
])
def test_matches_stable_sort(b, L, k):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    finite = torch.randint(1, L + 1, (b,), generator=g)
    finite[0] = L
    _check(_scores(b, L, g, finite=finite), k, SMALL, seed)


@pytest.mark.parametrize("config", [
    TopKConfig(block=128, sparse=0, floor_min_elements=0, rank_all_max=0),  # every live tile through tl.histogram
    TopKConfig(block=128, sparse=1 << 20, floor_min_elements=0, rank_all_max=0),  # every live tile through atomics
    TopKConfig(block=128, floor=False, rank_all_max=0),
    TopKConfig(block=256, num_warps=8, programs=3, floor_min_elements=0, rank_all_max=0),
    TopKConfig(block=128, floor_tile=64, floor_segments=3, floor_min_elements=0, rank_all_max=0),  # 3 segments of 4 tiles
    TopKConfig(rank_all_max=0),  # the radix path's default tile: one tile per row here; no floor at this size
    TopKConfig(),  # the default: a short row, every element ranked against the row in one launch
    TopKConfig(rank_all_compares=3 * 600 * 600 - 1),  # one compare over the budget: the radix path
], ids=["hist", "atomics", "no-floor", "few-programs", "floor-segments", "radix-default", "default",
        "over-budget"])
def test_configs(config):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    _check(_scores(3, 600, g, finite=[600, 400, 37]), 48, config, seed)


def test_fewer_than_k_finite_and_degenerate_rows():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    s = _scores(4, 500, g, finite=[10, 0, 500, 63])  # row 1 is all -inf
    s[2] = 0.75  # all equal: the k lowest positions
    _check(s, 64, SMALL, seed)
    _check(s, 500, SMALL, seed)  # k == L: the whole row in order


RANK_ALL = TopKConfig(rank_all_max=4096)


@pytest.mark.parametrize("b,L,k", [(1, 300, 16), (2, 1000, 512), (3, 129, 128), (2, 50, 64), (1, 257, 257)])
def test_rank_all_matches_stable_sort(b, L, k):
    """The all-pairs path: ties, signed zeros, -inf tails, rows with fewer than k finite scores,
    k above L, partial last blocks of 64 and 256."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    finite = torch.randint(1, L + 1, (b,), generator=g)
    finite[0] = L
    _check(_scores(b, L, g, finite=finite), k, RANK_ALL, seed)
    s = torch.tensor([[0.0, -0.0, 1.0, -0.0, 0.0, float("-inf"), 1.0, -1.0]])
    assert topk_positions(s.to(DEV), 8, config=RANK_ALL).cpu().tolist() == [[2, 6, 0, 4, 1, 3, 7, 5]]


def test_rank_all_takes_short_rows_within_its_compare_budget(monkeypatch):
    """The default sends a row of at most rank_all_max scores to the all-pairs launch while the
    launch's b * L^2 compares stay within rank_all_compares, and everything else to the radix path."""
    calls = []
    real = topk_module._rank_all
    monkeypatch.setattr(topk_module, "_rank_all", lambda bits, kk: calls.append(tuple(bits.shape)) or real(bits, kk))
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    s = _scores(2, 300, g)
    _check(s, 32, TopKConfig(), seed)
    assert calls == [(2, 300)]
    _check(s, 32, TopKConfig(rank_all_compares=2 * 300 * 300 - 1), seed)
    _check(s, 32, TopKConfig(rank_all_max=299), seed)
    assert calls == [(2, 300)]


def test_k_above_length_and_empty():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    _check(_scores(2, 37, g), 64, SMALL, seed)
    for shape, k in (((3, 0), 8), ((0, 50), 8), ((2, 50), 0)):
        out = topk_positions(torch.randn(shape).to(DEV), k)
        assert out.shape == (shape[0], min(k, shape[1])) and out.dtype == torch.int64


def test_signed_zero_and_lower_position_first():
    s = torch.tensor([[0.0, -0.0, 1.0, -0.0, 0.0, float("-inf"), 1.0, -1.0]])
    got = topk_positions(s.to(DEV), 8, config=SMALL).cpu()
    assert got.tolist() == [[2, 6, 0, 4, 1, 3, 7, 5]]


def test_torch_paths_equal_reference():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    s = _scores(3, 5000, g, finite=[5000, 3000, 20])
    exp = _expected(s, 64)
    assert torch.equal(topk_reference(s, 64), exp), seed
    two_stage = topk_positions(s, 64, config=TopKConfig(method="torch2", segment=512))
    assert torch.equal(two_stage, exp), seed
    big = topk_positions(s.to(DEV), 4097).cpu()  # k above MAX_KERNEL_K: torch.topk
    assert torch.equal(big, _expected(s, 4097)), seed


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="fp32"):
        topk_positions(torch.randn(2, 8, dtype=torch.float64), 4)
    with pytest.raises(ValueError, match="k must be"):
        topk_positions(torch.randn(2, 8), -1)
    with pytest.raises(ValueError, match="unknown top-k method"):
        topk_positions(torch.randn(2, 8).to(DEV), 4, config=TopKConfig(method="bogus"))


@pytest.mark.parametrize("use_table,L", [(False, 640), (True, 640), (True, 64), (False, 64)])
def test_topk_rows_kernel_path(monkeypatch, use_table, L):
    """topk_rows through topk_positions == topk_rows through torch.topk, -1 padding included
    (L = 64 < k: the rows past L are padding too)."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    b, k, P = 3, 96, 64
    s = _scores(b, L, g, finite=[L, 50, min(301, L - 3)])
    if use_table:
        table = torch.randperm(4 * L // P, generator=g)[: b * L // P].view(b, L // P)
        kw = dict(page_table=table, page_size=P)
        kw_dev = dict(page_table=table.to(DEV), page_size=P)
    else:
        ids = torch.randint(0, 1 << 20, (b, L), generator=g)
        kw, kw_dev = dict(row_ids=ids), dict(row_ids=ids.to(DEV))
    ref = topk_rows(s, k, **kw)  # CPU, flag off: torch.topk
    monkeypatch.setattr(topk_module, "INTERPRET_KERNELS", True)
    assert topk_module.kernels_wanted(s.to(DEV))
    got = topk_rows(s.to(DEV), k, **kw_dev).cpu()
    assert torch.equal(got, ref), seed
    assert (got[1, 50:] == -1).all() and (got[1, :50] >= 0).all()
    no_rows = torch.empty(b, 0, dtype=torch.long).to(DEV)
    empty = topk_rows(torch.empty(b, 0).to(DEV), k, row_ids=no_rows)
    assert empty.shape == (b, k) and (empty == -1).all()
