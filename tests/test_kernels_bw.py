"""Launch-shape variants of the compressor and KV-store kernels vs the references.

The fused C4 compressor (pool + finish in one launch) and the two-kernel path (pool kernel,
then the finish kernel) must both match ``reference.compress_ref``; the multi-row finish / store
kernels must match the references for any rows-per-program, including a row count that is not
a multiple of it. Runs under TRITON_INTERPRET=1 at tiny shapes, like tests/test_kernels.py, with
its bounds (tests/bounds.py: float32 sums in any order; bytes exact where only given values are
quantised); pools start as random bytes and outputs as NaN, so stray or missing writes show.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4_backend.kernels import reference as R  # noqa: E402
from dsv4_backend.kernels.compressor import (  # noqa: E402
    CompressConfig, CompressEvents, FusedCompressConfig, compress, compress_pool,
)
from dsv4_backend.kernels.kv_store import FinishConfig, finish_rows, kv_store, kv_store_rows  # noqa: E402
from memory.layout import write_indexer_rows, write_kv_rows  # noqa: E402

from bounds import (  # noqa: E402
    assert_indexer_pools_close, assert_kv_pools_close, assert_within, compressed_row_bound,
    norm_rope_bound, softmax_pool_bound,
)
# the helpers of the kernels' main test file: device, generators, poisoned pools, bounds
from test_kernels import (  # noqa: E402
    DEV, _cos_sin, _gen, _poisoned_pool, assert_rows_are_stored, compress_bounds,
)


def _same_bytes(pool, want, what):
    diff = (pool.cpu() != want.cpu()).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} bytes differ, first {diff[:5].tolist()}"


def _c4_case(g, indexer, e=7):
    d = 128 if indexer else 512
    state = (torch.randn(300, 4 * d, generator=g) * 2).to(DEV)
    ape = torch.randn(4, 2 * d, generator=g).to(DEV)
    src = torch.randint(0, 300, (e, 8), generator=g)
    src[0, :4] = -1  # a first block: no previous block
    src[4, :4] = -1
    dest = torch.randperm(128, generator=g)[:e]
    dest[2] = -1  # CUDA-graph padding events
    dest[5] = -1
    cos, sin = _cos_sin(e, g)
    w = (torch.rand(d, generator=g) + 0.5).to(DEV)
    return CompressEvents(dest.to(DEV), src.to(DEV), cos, sin), state, ape, w, d


@pytest.mark.parametrize("indexer,round_bf16", [(False, True), (True, True), (False, False), (True, False)])
def test_fused_c4_equals_two_kernel_and_reference(indexer, round_bf16):
    g = _gen(100 + 2 * indexer + round_bf16)
    ev, state, ape, w, d = _c4_case(g, indexer)
    e = ev.dest_rows.shape[0]
    row_bytes = 132 if indexer else 584
    pool0 = _poisoned_pool(2, 64 * row_bytes, g)
    had = R.hadamard_matrix(128, device=DEV) if indexer else None

    def run(**kw):
        pool = pool0.clone()
        out = torch.full((e, d), float("nan"), device=DEV)
        compress(pool, ev, state, ape, w, 4, round_bf16=round_bf16, hadamard=had, out=out, **kw)
        return pool, out

    live = ev.dest_rows >= 0
    ref_pool = pool0.clone()
    R.compress_ref(ref_pool, ev.dest_rows[live], state, ev.sources[live], ape, w, ev.cos[live],
                   ev.sin[live], 4, round_bf16=round_bf16, indexer=indexer)
    pre = compress_bounds(state, ev.sources[live], ape, w, 4, d, indexer, round_bf16)
    close = assert_indexer_pools_close if indexer else assert_kv_pools_close
    runs = [("two-kernel", dict(fuse=False))] + [
        (f"fused {cfg}", dict(fuse=True, fused_config=cfg))
        for cfg in (FusedCompressConfig(1, 4), FusedCompressConfig(3, 2), FusedCompressConfig(8, 4))]
    for what, kw in runs:
        pool, out = run(**kw)
        assert torch.isnan(out[~live]).all(), f"{what}: a masked event's row was written"
        close(pool, ref_pool, ev.dest_rows[live], pre, f"{what} vs compress_ref")
        assert_rows_are_stored(out, pool, ev.dest_rows, what, indexer)


def test_pool_configs_match_float64_softmax():
    """The pooling kernel under non-default launch shapes (chunks, pipelined loop, narrow
    channel blocks) against a float64 softmax written here."""
    g = _gen(110)
    d, e = 128, 3
    state = (torch.randn(400, 2 * d, generator=g) * 3).to(DEV)
    ape = torch.randn(128, d, generator=g).to(DEV)
    src = torch.randint(0, 400, (e, 128), generator=g)
    src[1, 5:40] = -1
    rows = state[src.clamp_min(0)].double().cpu()
    c = rows[..., :d].masked_fill((src < 0)[..., None], 0.0)
    z = (rows[..., d:] + ape.double().cpu()[None]).masked_fill((src < 0)[..., None], float("-inf"))
    want = (torch.softmax(z, dim=1) * c).sum(1)
    bound = softmax_pool_bound(c, z)
    src = src.to(DEV)
    for cfg in (CompressConfig(), CompressConfig(64, 32, 2, 2), CompressConfig(128, 128, 4, 0)):
        got = compress_pool(state, src, ape, 128, d, config=cfg)
        assert_within(got, want, bound, str(cfg))


@pytest.mark.parametrize("cfg", [FinishConfig(4, 4), FinishConfig(8, 2), FinishConfig(1, 2),
                                 FinishConfig(2, 4)])
def test_multi_row_kv_store(cfg):
    g = _gen(120 + cfg.rows)
    n = 11  # not a multiple of rows
    pool = _poisoned_pool(2, 128 * 584, g)
    ref_pool = pool.clone()
    kv = (torch.randn(n, 512, generator=g) * 4).to(DEV)
    kv[3, 64:128] *= 1e-6  # a near-zero tile: the amax floor
    w = (torch.rand(512, generator=g) + 0.5).to(DEV)
    cos, sin = _cos_sin(n, g)
    slots = torch.randperm(256, generator=g)[:n]
    slots[[4, 10]] = -1
    slots = slots.to(DEV)
    out = torch.full((n, 512), float("nan"), device=DEV)
    kv_store(pool, slots, kv, w, cos, sin, out=out, config=cfg)
    R.kv_store_ref(ref_pool, slots, kv, w, cos, sin)
    keep = slots >= 0
    assert_kv_pools_close(pool, ref_pool, slots[keep], norm_rope_bound(kv[keep], 0.0, w, bf16_mid=True),
                          f"{cfg}: SWA pool")
    assert torch.isnan(out[~keep]).all(), "a skipped row was written"
    assert_rows_are_stored(out, pool, slots, f"{cfg}: rows")
    # the store-only kernel: rows already normalised and rotated: quantising given values is
    # order-free, so its bytes are exact
    rows = (torch.randn(n, 512, generator=g) * 3).to(DEV)
    got = _poisoned_pool(2, 128 * 584, g)
    want = got.clone()
    kv_store_rows(got, slots, rows, config=cfg)
    write_kv_rows(want, slots[keep].long(), rows[keep])
    _same_bytes(got, want, f"{cfg}: kv_store_rows bytes")


@pytest.mark.parametrize("cfg", [FinishConfig(2, 4), FinishConfig(4, 8)])
def test_multi_row_indexer_finish(cfg):
    g = _gen(130 + cfg.rows)
    n = 7
    pool = _poisoned_pool(2, 64 * 132, g)
    ref_pool = pool.clone()
    x = (torch.randn(n, 128, generator=g) * 2).to(DEV)
    w = (torch.rand(128, generator=g) + 0.5).to(DEV)
    cos, sin = _cos_sin(n, g)
    dest = torch.randperm(128, generator=g)[:n]
    dest[1] = -1
    dest = dest.to(DEV)
    out = torch.full((n, 128), float("nan"), device=DEV)
    finish_rows(pool, dest, x, w, cos, sin, 1e-6, round_in=True, round_bf16=True,
                hadamard=R.hadamard_matrix(128, device=DEV), out=out, config=cfg)
    rows = R.compress_rows_ref(x, w, cos, sin, indexer=True)
    keep = dest >= 0
    write_indexer_rows(ref_pool, dest[keep].long(), rows[keep])
    pre = compressed_row_bound(x[keep], 0.0, w, indexer=True)
    assert_indexer_pools_close(pool, ref_pool, dest[keep], pre, f"{cfg}: indexer pool")
    assert torch.isnan(out[~keep]).all(), "a skipped row was written"
    assert_rows_are_stored(out, pool, dest, f"{cfg}: rows", indexer=True)


def test_finish_config_rows_must_be_a_power_of_two():
    g = _gen(140)
    pool = _poisoned_pool(1, 128 * 584, g)
    kv = torch.randn(3, 512, generator=g).to(DEV)
    cos, sin = _cos_sin(3, g)
    with pytest.raises(ValueError, match="power of two"):
        kv_store(pool, torch.arange(3).to(DEV), kv, torch.ones(512, device=DEV), cos, sin,
                 config=FinishConfig(3, 4))
