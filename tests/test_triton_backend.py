"""The Triton backend against the torch backend on the same metadata (CPU, TRITON_INTERPRET=1).

Lock-step runs on a 3-layer tiny model (window-only, CSA, HCA), float32: one model run drives
both backends with the same AttentionInputs at every layer, and the wrapper returns the torch
output, so no difference can compound. Each layer is checked in two halves, each from the torch
backend's pools so that a rounding the two backends land on differently never carries:

- writes: from the pools as they were before the layer, the Triton backend's stores must equal
  the torch backend's: SWA rows and rings byte for byte (given values, quantised: order-free),
  compressed rows (C4, indexer, C128: pooled in another float32 order) within one e4m3 step
  plus the bf16 steps before it (tests/bounds.py), every other byte identical;
- attention: from the torch backend's pools after the layer, with the Triton backend's own
  compression switched off, its output within the float32 bound of a softmax over n keys
  (tests/bounds.py), from the largest |score| and |value| the layer can see.

Each half runs only the kernels it checks (the writes half no attention, the attention half no
store or compression): under the interpreter a kernel not needed is time not spent.

Runs: chunked prefills crossing blocks of 4 and 128 with decode steps that complete C4 and C128
blocks (ring and online C128), and dense mode. Plus the store-only KV kernel against
``write_kv_rows`` byte for byte, and the default backend choice.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from dsv4_backend.backend import AttentionBackend, TorchDSV4Backend
from dsv4_backend.config import DSV4Config
from dsv4_backend.model_runner import ModelRunner, default_backend, run_schedule
from dsv4_backend import triton_backend
from dsv4_backend.triton_backend import TritonDSV4Backend
from dsv4_backend.weights import random_weights
from memory.layout import read_indexer_rows, read_kv_rows
from memory.pools import _KINDS, DSV4KVPools

from bounds import BF16_STEP, U32, gamma

CFG = DSV4Config.preset("tiny", vocab_size=512, num_hidden_layers=3, compress_ratios=(0, 4, 128, 0),
                        index_topk=4)
@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=3, dtype=torch.float32, include_mtp=False)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()


def _pools_of(pools: DSV4KVPools) -> dict[str, dict[int, torch.Tensor]]:
    return {kind: getattr(pools, kind) for kind in _KINDS}


def _copy_pools(dst: DSV4KVPools, src: DSV4KVPools) -> None:
    for kind, per_layer in _pools_of(src).items():
        for layer, t in per_layer.items():
            getattr(dst, kind)[layer].copy_(t)


# e4m3 keeps 3 mantissa bits: one step is at most 2^-3 of the value (2^-9 x scale below the
# normal range, which a 1e-4 amax floor puts below 1e-6); the rows pass two or three bf16
# roundings before it, each of which may land one step away
ROW_STEP = 2.0 ** -3 + 3 * BF16_STEP


def _open_block_slots(meta) -> list[int]:
    """Request slots whose C128 block is still open after this step (a completed block's state
    is dead: the next token starts a fresh one, and the backends need not store it)."""
    ends = meta.token_offsets[1:]
    last = [int(meta.positions[e - 1]) for e in ends]
    return [int(s) for s, p in zip(meta.req_slots.tolist(), last) if (p + 1) % 128]


def _compare_writes(ref: DSV4KVPools, test: DSV4KVPools, layer: int, inputs, meta) -> None:
    for kind in ("swa_kv", "c4_ring", "c4_indexer_ring", "c128_ring"):
        a, b = getattr(ref, kind), getattr(test, kind)
        if layer in a:
            assert torch.equal(a[layer], b[layer]), f"{kind}[{layer}] differs"
    if layer in ref.c128_online:
        # (max, sum, acc) per slot and channel after folding this step's T tokens into the same
        # state: the max is exact (one rounded add per score); the sum and the accumulator carry
        # gamma(T) plus one rescale (2u) per token, the accumulator relative to sum x max |C|
        live = _open_block_slots(meta)
        a, b = ref.c128_online[layer][live].double(), test.c128_online[layer][live].double()
        T = inputs.compressor.c.shape[0]
        rel = gamma(T) + (2 * T + 4) * U32
        c_max = float(inputs.compressor.c.abs().max())
        assert torch.equal(a[:, 0], b[:, 0]), f"c128_online[{layer}]: running max differs"
        assert torch.all((a[:, 1] - b[:, 1]).abs() <= rel * a[:, 1].abs()), f"c128_online[{layer}]: sum"
        assert torch.all((a[:, 2] - b[:, 2]).abs() <= rel * a[:, 1].abs() * c_max), f"c128_online[{layer}]: acc"
    for kind, read, row_bytes in (("c4_kv", read_kv_rows, 584), ("c128_kv", read_kv_rows, 584),
                                  ("c4_indexer", read_indexer_rows, 132)):
        a, b = getattr(ref, kind), getattr(test, kind)
        if layer not in a or torch.equal(a[layer], b[layer]):
            continue
        t, u = a[layer], b[layer]
        slots = torch.arange(t.shape[0] * (t.shape[1] // row_bytes))
        x, y = read(t, slots), read(u, slots)
        assert torch.all((x - y).abs() <= x.abs().maximum(y.abs()) * ROW_STEP + 1e-6), f"{kind}[{layer}]"


def _attention_bound(q: torch.Tensor, pools: DSV4KVPools, layer: int, ratio: int, n_keys: int,
                     scale: float) -> float:
    """The float32 bound of tests/bounds.attention_bound, from the layer's largest score
    magnitude (|q| |k| by Cauchy-Schwarz) and largest |value| instead of per-key terms."""
    rows = [read_kv_rows(pools.swa_kv[layer], torch.arange(pools.swa_kv[layer].shape[0] * 128))]
    extra = {4: pools.c4_kv, 128: pools.c128_kv}.get(ratio)
    if extra is not None:
        rows.append(read_kv_rows(extra[layer], torch.arange(extra[layer].shape[0] * 64)))
    keys = torch.cat(rows).double()
    s_max = scale * float(q.double().norm(dim=-1).max()) * float(keys.norm(dim=-1).max())
    v_max = float(keys.abs().max())
    eps_p = 2 * (gamma(512) * s_max + 2 * U32 * s_max) + 4 * U32 * (1 + s_max)
    return (eps_p + 2 * gamma(n_keys) + (n_keys + 4) * U32) * 2 * v_max


@contextlib.contextmanager
def _without(backend, **methods):
    """Replaces some of ``backend``'s methods for the duration of the block."""
    backend.__dict__.update(methods)
    try:
        yield
    finally:
        for name in methods:
            del backend.__dict__[name]


@contextlib.contextmanager
def _kv_store_off():
    """The Triton backend's KV-row store as a no-op for the duration of the block."""
    kernels = triton_backend._kernels()

    class NoStore:
        def __getattr__(self, name):
            return getattr(kernels, name)

        @staticmethod
        def kv_store_rows(*args, **kw):
            return None

    saved = triton_backend._kernels
    triton_backend._kernels = lambda: NoStore()
    try:
        yield
    finally:
        triton_backend._kernels = saved


class LockStep(AttentionBackend):
    """Runs both backends on one metadata object and the same inputs; returns torch's output.

    The Triton backend runs each layer twice: from the torch backend's pools before the layer
    (its writes are compared), then from the torch pools after the layer with its compression
    off (its attention is compared)."""

    def __init__(self, ref: TorchDSV4Backend, test: TritonDSV4Backend):
        self.ref, self.test = ref, test
        self.worst = 0.0               # largest |diff| / bound of any attention output
        self.layers_seen: set[int] = set()
        self.rows_written: set[str] = set()

    def init_forward_metadata(self, batch):
        return self.ref.init_forward_metadata(batch)

    def forward(self, layer_id, layer, inputs, meta):
        _copy_pools(self.test.pools, self.ref.pools)
        o_ref = self.ref.forward(layer_id, layer, inputs, meta)
        test = self.test
        # writes half: the attention kernel's output is not looked at, so it does not run
        # (under the interpreter it is most of a layer's time)
        with _without(test, _sparse_attention=lambda ratio, q, *a: torch.zeros_like(q)):
            test.forward(layer_id, layer, inputs, meta)
        _compare_writes(self.ref.pools, self.test.pools, layer_id, inputs, meta)
        for kind in ("c4_kv", "c128_kv"):
            if layer_id in getattr(self.ref.pools, kind) and getattr(self.ref.pools, kind)[layer_id].any():
                self.rows_written.add(kind)
        # attention half: the pools already hold the layer's writes (torch's), so neither the
        # store nor the compression runs
        _copy_pools(self.test.pools, self.ref.pools)
        with _without(test, _compress=lambda *a, **k: None, _compress_c4_pair=lambda *a, **k: None,
                      _compress_online_kernel=lambda *a, **k: None), \
                _kv_store_off():
            o_test = test.forward(layer_id, layer, inputs, meta)
        assert torch.isfinite(o_test).all()
        ratio = 0 if meta.dense else layer.ratio
        n_keys = {0: 128, 4: 128 + CFG.index_topk}.get(ratio, 128 + 2048 // 128)
        if meta.dense:
            n_keys = 2048
        bound = _attention_bound(inputs.q, self.ref.pools, layer_id, ratio, n_keys, CFG.softmax_scale)
        diff = float((o_ref - o_test).abs().max())
        assert diff <= bound, f"layer {layer_id}: attention differs by {diff:.3e} > {bound:.3e}"
        self.worst = max(self.worst, diff / bound)
        self.layers_seen.add(layer.ratio)
        return o_ref


def lockstep_runner(weights, dense=False, online=False, **kw) -> tuple[ModelRunner, LockStep]:
    runner = ModelRunner.build(CFG, dtype=torch.float32, weights=weights, backend="torch", dense=dense,
                               max_total_tokens=2048, max_running_requests=2, online_compress=online, **kw)
    pools_b = DSV4KVPools(CFG, runner.pools.plan, state_dtype=runner.pools.state_dtype)
    test = TritonDSV4Backend(CFG, pools_b, runner.allocator, dtype=torch.float32, dense=dense)
    runner.backend = LockStep(runner.backend, test)
    return runner, runner.backend


def test_lockstep_chunked_prefill_and_decode(weights):
    seqs = {"a": tokens(140, 1), "b": tokens(40, 2)}
    # a: 130-token prefill in chunks of 70 + 60 (crossing 4 and 128), then decodes to 140
    # (block 4 completes at 131 and 135; a's C128 block 0 completed in the prefill);
    # b joins mid-way with a 30-token chunk and decodes alongside.
    plan = [[("a", 70)], [("a", 60), ("b", 30)]] + [[("a", 1), ("b", 1)]] * 6
    runner, lock = lockstep_runner(weights)
    run_schedule(runner, plan, seqs)
    assert lock.layers_seen == {0, 4, 128}
    assert lock.rows_written == {"c4_kv", "c128_kv"}


def test_lockstep_dense(weights):
    seqs = {"a": tokens(24, 5)}
    runner, lock = lockstep_runner(weights, dense=True)
    run_schedule(runner, [[("a", 20)], [("a", 1)], [("a", 1)]], seqs)
    assert lock.layers_seen == {0, 4, 128}


def test_lockstep_online_c128(weights):
    """The online C128 state (a running max / sum / accumulator per request) instead of the ring:
    one prefill in two chunks, then decodes, the C128 block completing at decode 128."""
    seqs = {"a": tokens(132, 7)}
    plan = [[("a", 64)], [("a", 64)]] + [[("a", 1)]] * 4
    runner, lock = lockstep_runner(weights, online=True)
    assert lock.test.pools.c128_online
    run_schedule(runner, plan, seqs)
    assert lock.layers_seen == {0, 4, 128}
    assert "c128_kv" in lock.rows_written


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


def test_kv_store_in_norm_pair_changes_no_byte(weights, monkeypatch):
    """With the kv norm + RoPE launch writing the SWA rows itself (``norm_pair``'s store, the
    backend's ``swa_store``), a prefill and decodes leave every pool byte and logit as the
    backend's own store does (the kernels forced on under the interpreter)."""
    from dsv4_backend import model as model_mod
    monkeypatch.setattr(model_mod, "_norm_rope_kernel_applies", lambda x: x.dtype != torch.float64)
    seqs = {"a": tokens(12, 11)}
    plan = [[("a", 10)], [("a", 1)], [("a", 1)]]
    runs = []
    kernels = triton_backend._kernels()
    for on in (False, True):
        monkeypatch.setattr(model_mod, "USE_NORM_PAIR_STORE", on)
        runner = ModelRunner.build(CFG, dtype=torch.float32, weights=weights, backend="triton",
                                   max_total_tokens=2048, max_running_requests=1)
        stored, backend_stores = [], []
        swa_store = runner.backend.swa_store
        monkeypatch.setattr(runner.backend, "swa_store", lambda *a: stored.append(1) or swa_store(*a))

        class CountingStore:    # the kernels package, its SWA store counted
            def __getattr__(self, name):
                return getattr(kernels, name)

            @staticmethod
            def kv_store_rows(*args, **kw):
                backend_stores.append(1)
                return kernels.kv_store_rows(*args, **kw)

        monkeypatch.setattr(triton_backend, "_kernels", lambda: CountingStore())
        logits = run_schedule(runner, plan, seqs)["a"]
        assert bool(stored) == on
        assert bool(backend_stores) != on      # on: the backend's own store launch is gone
        runs.append((logits, _pools_of(runner.pools)))
    (l0, p0), (l1, p1) = runs
    assert torch.equal(l0, l1)
    for kind in p0:
        for layer in p0[kind]:
            assert torch.equal(p0[kind][layer], p1[kind][layer]), f"{kind}[{layer}]"
