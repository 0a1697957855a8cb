"""The Triton backend against the torch backend on the same metadata (CPU, TRITON_INTERPRET=1).

Two checks on a 3-layer tiny model (window-only, CSA, HCA), float32:

- lock-step: one model run drives both backends with the same AttentionInputs at every layer
  (a wrapper returns the torch output, so no difference can compound), over a batch of two
  requests with chunked prefills crossing blocks of 4 and 128 and decode steps that complete
  C4 and C128 blocks. The SWA pool and the rings must be byte-identical (same inputs, same
  rounding); compressed rows (C4, indexer, C128) are pooled with a different summation order,
  so a byte may flip at an e4m3 rounding boundary: at most 0.1% of the rows' bytes, dequantised
  within one e4m3 step; attention outputs within 2e-5 (fp32, interpreter);
- end to end: a runner on the triton backend (online C128) against one on the torch backend,
  same weights, 128-token prefill in two chunks + 4 decodes: per-position max |logit diff|
  with median <= 1e-2 and max <= 0.5 (float32 noise can flip one FP8 / top-k decision, which
  the cache then carries), greedy tokens equal at >= 95% of positions.
Plus dense mode in lock-step, the store-only KV kernel against ``write_kv_rows`` byte for
byte, and the default backend choice.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_backend.backend import AttentionBackend, TorchDSV4Backend
from dsv4_backend.config import DSV4Config
from dsv4_backend.model_runner import ModelRunner, default_backend, run_schedule
from dsv4_backend.triton_backend import TritonDSV4Backend
from dsv4_backend.weights import random_weights
from memory.layout import read_indexer_rows, read_kv_rows
from memory.pools import DSV4KVPools

CFG = DSV4Config.preset("tiny", vocab_size=512, num_hidden_layers=3, compress_ratios=(0, 4, 128, 0),
                        index_topk=4)
ATT_TOL = 2e-5
# float32 noise (1e-6 at first) can move one FP8 rounding or top-k decision; the cache then
# carries it, as in the float32-vs-float64 bounds of test_model_runner (measured here: ~2e-6
# up to position 41, one 0.19 jump at 42, then a median of 2.3e-3).
LOGIT_MEDIAN_TOL = 1e-2
LOGIT_MAX_TOL = 0.5


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=3, dtype=torch.float32, include_mtp=False)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()


class LockStep(AttentionBackend):
    """Runs both backends on one metadata object and the same inputs; returns torch's output."""

    def __init__(self, ref: TorchDSV4Backend, test: TritonDSV4Backend):
        self.ref, self.test = ref, test
        self.max_diff = 0.0
        self.layers_seen: set[int] = set()

    def init_forward_metadata(self, batch):
        return self.ref.init_forward_metadata(batch)

    def forward(self, layer_id, layer, inputs, meta):
        o_ref = self.ref.forward(layer_id, layer, inputs, meta)
        o_test = self.test.forward(layer_id, layer, inputs, meta)
        assert torch.isfinite(o_test).all()
        self.max_diff = max(self.max_diff, float((o_ref - o_test).abs().max()))
        self.layers_seen.add(layer.ratio)
        return o_ref


def lockstep_runner(weights, dense=False, **kw) -> tuple[ModelRunner, LockStep]:
    runner = ModelRunner.build(CFG, dtype=torch.float32, weights=weights, backend="torch", dense=dense,
                               max_total_tokens=2048, max_running_requests=2, online_compress=False, **kw)
    pools_b = DSV4KVPools(CFG, runner.pools.plan, state_dtype=runner.pools.state_dtype)
    test = TritonDSV4Backend(CFG, pools_b, runner.allocator, dtype=torch.float32, dense=dense)
    runner.backend = LockStep(runner.backend, test)
    return runner, runner.backend


def compare_pools(a: DSV4KVPools, b: DSV4KVPools) -> None:
    for kind in ("swa_kv", "c4_ring", "c4_indexer_ring", "c128_ring"):
        for layer, t in getattr(a, kind).items():
            assert torch.equal(t, getattr(b, kind)[layer]), f"{kind}[{layer}] differs"
    for kind, read, rows_per_page in (("c4_kv", read_kv_rows, 64), ("c128_kv", read_kv_rows, 64),
                                      ("c4_indexer", read_indexer_rows, 64)):
        for layer, t in getattr(a, kind).items():
            u = getattr(b, kind)[layer]
            flipped = int((t != u).sum())
            assert flipped <= 1e-3 * t.numel(), f"{kind}[{layer}]: {flipped} bytes differ"
            if flipped:
                slots = torch.arange(t.shape[0] * rows_per_page)
                x, y = read(t, slots), read(u, slots)
                # one e4m3 step is at most 2^-3 relative to the value (2^-9 * scale below normal)
                assert torch.all((x - y).abs() <= x.abs().maximum(y.abs()) / 8 + 1e-6), kind
    assert any(bool(t.any()) for t in a.c4_kv.values()) and any(bool(t.any()) for t in a.c128_kv.values())


def test_lockstep_chunked_prefill_and_decode(weights):
    seqs = {"a": tokens(140, 1), "b": tokens(40, 2)}
    # a: 130-token prefill in chunks of 70 + 60 (crossing 4 and 128), then decodes to 140
    # (block 4 completes at 131 and 135; a's C128 block 0 completed in the prefill);
    # b joins mid-way with a 30-token chunk and decodes alongside.
    plan = [[("a", 70)], [("a", 60), ("b", 30)]] + [[("a", 1), ("b", 1)]] * 6
    runner, lock = lockstep_runner(weights)
    run_schedule(runner, plan, seqs)
    assert lock.layers_seen == {0, 4, 128}
    assert lock.max_diff <= ATT_TOL, lock.max_diff
    compare_pools(lock.ref.pools, lock.test.pools)


def test_lockstep_dense(weights):
    seqs = {"a": tokens(24, 5)}
    runner, lock = lockstep_runner(weights, dense=True)
    run_schedule(runner, [[("a", 20)], [("a", 1)], [("a", 1)]], seqs)
    assert lock.max_diff <= ATT_TOL, lock.max_diff
    for layer, t in lock.ref.pools.swa_kv.items():
        assert torch.equal(t, lock.test.pools.swa_kv[layer])


def test_end_to_end_online_c128(weights):
    seqs = {"a": tokens(132, 7)}
    plan = [[("a", 64)], [("a", 64)]] + [[("a", 1)]] * 4          # C128 block 0 ends at decode 128
    out = {}
    for name in ("torch", "triton"):
        runner = ModelRunner.build(CFG, dtype=torch.float32, weights=weights, backend=name,
                                   max_total_tokens=2048, max_running_requests=2, online_compress=True)
        assert type(runner.backend).__name__ == {"torch": "TorchDSV4Backend", "triton": "TritonDSV4Backend"}[name]
        out[name] = run_schedule(runner, plan, seqs)["a"]
    ref, got = out["torch"], out["triton"]
    assert torch.isfinite(got).all()
    per_pos = (ref - got).abs().amax(-1)                                  # [132]
    assert float(per_pos.median()) <= LOGIT_MEDIAN_TOL, per_pos
    assert float(per_pos.max()) <= LOGIT_MAX_TOL, per_pos
    assert float((ref.argmax(-1) == got.argmax(-1)).float().mean()) >= 0.95


def test_kv_store_rows_equals_pool_write():
    """The store-only kernel writes write_kv_rows' bytes; a -1 slot leaves the pool untouched."""
    from dsv4_backend.kernels import kv_store_rows
    from memory.layout import write_kv_rows
    g = torch.Generator().manual_seed(9)
    rows = torch.randn(5, 512, generator=g) * torch.logspace(-3, 2, 5)[:, None]
    rows[2, 64:128] = 1e-6                                   # a tile under the 1e-4 amax floor
    slots = torch.tensor([3, 130, 7, -1, 255])
    base = torch.randint(0, 256, (2, 128 * 584), generator=g, dtype=torch.uint8)
    want, got = base.clone(), base.clone()
    keep = slots >= 0
    write_kv_rows(want, slots[keep], rows[keep])
    kv_store_rows(got, slots, rows)
    assert torch.equal(got, want)
    kv_store_rows(got, slots, rows.to(torch.bfloat16))      # bf16 rows: same bytes as their values
    write_kv_rows(want, slots[keep], rows.to(torch.bfloat16).float()[keep])
    assert torch.equal(got, want)


def test_default_backend_and_float64():
    assert default_backend(torch.device("cpu"), torch.float32) == "torch"
    assert default_backend(torch.device("cuda"), torch.bfloat16) == "triton"
    assert default_backend(torch.device("cuda"), torch.float64) == "torch"
    runner = ModelRunner.build(CFG, dtype=torch.float32, max_total_tokens=1024, max_running_requests=1)
    with pytest.raises(ValueError, match="float64"):
        TritonDSV4Backend(CFG, runner.pools, runner.allocator, dtype=torch.float64)


def test_indexer_fp8_flag(monkeypatch, caplog):
    """DSV4_INDEXER_FP8=1 asks for FP8 indexer products; the interpreter cannot run them, so
    there the request is refused with a warning and the bf16 path stays."""
    from dsv4_backend.triton_backend import _indexer_fp8_wanted

    monkeypatch.delenv("DSV4_INDEXER_FP8", raising=False)
    assert _indexer_fp8_wanted() is False
    monkeypatch.setenv("DSV4_INDEXER_FP8", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with caplog.at_level("WARNING"):
        assert _indexer_fp8_wanted() is False
    assert "needs a GPU" in caplog.text
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert _indexer_fp8_wanted() is True
