"""Static decode steps (the tables a CUDA graph replays) against ordinary steps.

A CUDA graph cannot be captured on the CPU, but everything it replays can run here: the
``DecodeGraphs`` runner with ``capture=False`` executes the static decode path eagerly (the
Triton kernels under TRITON_INTERPRET=1), with the same padded batch, masked events, ring-slot
sources and bucketed tables the graph reads. Each case runs one schedule twice on the Triton
backend with the same weights (the prefill on the torch backend), once ordinarily and once with
static decode steps, three
requests (so the batch is padded to 4), through decode steps that complete C4 and C128
blocks. Unpadded static steps run the ordinary steps' arithmetic, so logits and every pool
must be bit-identical; a padded batch's GEMMs have one row more, so its steps are compared, bit
for bit, with ordinary steps of a batch holding the same four rows (a twin of request a).
"""

from __future__ import annotations

import pytest
import torch

from dsv4_backend.backend import TorchDSV4Backend
from dsv4_backend.config import DSV4Config
from dsv4_backend.cuda_graph import DecodeGraphs, batch_buckets, context_bucket
from dsv4_backend.input_ids import placeholder
from dsv4_backend.model_runner import ModelRunner, ForwardRequest
from dsv4_backend.weights import random_weights

CFG = DSV4Config.preset("tiny", vocab_size=512, num_hidden_layers=3, compress_ratios=(0, 4, 128, 0),
                        index_topk=4)


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(64) == [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]
    assert batch_buckets(100)[-3:] == [80, 96, 100]
    for n in [1, 4096, 4097, 5000, 7168, 8191, 8192, 100_000, 1 << 20, (1 << 20) + 1]:
        c = context_bucket(n)
        assert c >= max(n, 4096) and c % 256 == 0
        assert c <= max(4096, n) * 1.25 + 256            # at most a quarter octave above
    assert context_bucket(1 << 20) == 1 << 20 and context_bucket(5000) == 5120


# bit-for-bit comparisons of padded (static) and unpadded (eager) key lists: one decode launch shape.
# The runners are built on the CPU (Triton under the interpreter, which conftest sets only where
# there is no CUDA); on a GPU machine the graphs themselves are checked by tests/test_host_syncs.py
# and bench/gpu_graph_check.py.
pytestmark = [pytest.mark.usefixtures("default_decode_launch"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tests (see above)")]


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=5, dtype=torch.float32, include_mtp=False)


def _prompt(n, seed):
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(weights, static: bool, dense=False, online=False, max_bs=4, capture=False, twin=False, hisparse=None,
         placeholders=False):
    """One schedule of three requests; ``twin`` adds a fourth, "a2", a copy of "a" (same prompt,
    same steps): an ordinary batch with the rows a padded static batch has. ``placeholders``: each
    decode's input id is a placeholder for a row of a stand-in "previous step's sampled ids" (the
    rows reversed, one extra), as the overlap schedule passes them."""
    runner = ModelRunner.build(CFG, dtype=torch.float32, weights=weights, backend="triton", dense=dense,
                               max_total_tokens=2048, max_running_requests=4, online_compress=online,
                               cuda_graph=False, hisparse_config=hisparse)
    if static:
        runner.cuda_graphs = DecodeGraphs(runner, max_bs=max_bs, capture=capture, min_context=512)
    alloc = runner.allocator
    lens = {"a": 125, "b": 21, "c": 5}
    seqs = {rid: _prompt(n + 9, i) for i, (rid, n) in enumerate(lens.items())}
    if twin:
        lens["a2"], seqs["a2"] = lens["a"], seqs["a"]
    out = {rid: [] for rid in lens}
    # prefill on the torch backend over the same pools (the interpreter would take ~25 s per run
    # for it): both runs start their decode steps from identical pools
    triton = runner.backend
    runner.backend = TorchDSV4Backend(CFG, runner.pools, alloc, dtype=torch.float32, dense=dense)
    for rid, n in lens.items():
        alloc.admit(rid)
        alloc.extend(rid, n)
        [lg] = runner.forward([ForwardRequest(alloc.req_slot(rid), 0, seqs[rid][:n], "last")])
        out[rid].append(lg)
    runner.backend = triton
    for step in range(5):                             # decode: crosses 128 (a) and blocks of 4
        reqs = []
        for rid, n in lens.items():
            p = n + step
            assert alloc.extend(rid, p + 1).ok
            reqs.append(ForwardRequest(alloc.req_slot(rid), p, [seqs[rid][p]], "last"))
        prev = None
        if placeholders:
            real = [r.input_ids[0] for r in reqs]
            prev = torch.tensor(real[::-1] + [CFG.vocab_size - 1])
            for i, r in enumerate(reqs):
                r.input_ids = [placeholder(len(reqs) - 1 - i)]
        for rid, lg in zip(lens, runner.forward(reqs, prev)):
            out[rid].append(lg)
        for rid in lens:
            alloc.evict_swa(rid)
    if static and not capture:
        assert runner.cuda_graphs.replays == 5
    return runner, {rid: torch.cat(v) for rid, v in out.items()}


_EAGER: dict = {}


def _eager(weights, dense=False, online=False):
    """The ordinary run (no HiSparse), once per module and flag setting."""
    if (dense, online) not in _EAGER:
        _EAGER[dense, online] = _run(weights, static=False, dense=dense, online=online)
    return _EAGER[dense, online]


def _pool_bytes(runner):
    p = runner.pools
    named = {}
    for name in ("swa_kv", "c4_kv", "c4_indexer", "c128_kv", "c4_ring", "c4_indexer_ring", "c128_ring",
                 "c128_online"):
        for layer, t in (getattr(p, name, None) or {}).items():
            named[f"{name}[{layer}]"] = t
    return named


def _compare_pools(eager, static):
    a, b = _pool_bytes(eager), _pool_bytes(static)
    assert a.keys() == b.keys() and a
    for name in a:
        x, y = a[name], b[name]
        if name.startswith("c128_ring"):
            # the static step also stores the (C, Z) of a token that completes its C128 block,
            # which the ordinary step skips (nothing reads it before position p + 128 does)
            keep = (x != 0).any(-1)
            assert int((~keep).sum()) < x.shape[0]
            x, y = x[keep], y[keep]
        assert torch.equal(x, y), f"{name}: {int((x != y).sum())} elements differ"


@pytest.mark.parametrize("dense,online", [(False, False), (False, True), (True, False)],
                         ids=["ring", "online-c128", "dense"])
def test_static_decode_equals_ordinary_steps(weights, dense, online, monkeypatch):
    if dense:
        # dense mode pads its window list to the context bucket; with the key list in one split,
        # the padded tiles (all masked: exp(-inf) = 0, the running max unchanged) leave every
        # float32 sum as it was, so padded and unpadded lists agree bit for bit
        from dsv4_backend.kernels import sparse_attention
        monkeypatch.setattr(sparse_attention, "default_num_splits", lambda *a: 1)
    eager, ref = _eager(weights, dense, online)
    # captured batch sizes 1, 2, 3: no padding, so the same arithmetic: bit-identical
    static, got = _run(weights, static=True, dense=dense, online=online, max_bs=3)
    for rid in ref:
        assert torch.equal(got[rid], ref[rid]), f"request {rid}: logits differ"
    _compare_pools(eager, static)
    # padded to 4 rows (row 0 repeated, its writes masked): the float32 GEMMs of 4 rows may round
    # differently from those of 3, so the padded steps are compared with ordinary steps of the
    # same 4 rows (a twin of request a as the fourth), bit for bit
    static, got = _run(weights, static=True, dense=dense, online=online, max_bs=4)
    twin_eager, twin_ref = _run(weights, static=False, dense=dense, online=online, twin=True)
    for rid in ref:
        assert torch.equal(got[rid], twin_ref[rid]), f"request {rid}: logits differ"
    assert torch.equal(twin_ref["a2"], twin_ref["a"])


def test_placeholder_input_ids_resolve_on_the_device(weights):
    """Decode input ids given as placeholders for rows of the previous step's ids: the static
    path (the ids land in the graph's input buffer) and the eager path compute what real ids give."""
    eager, ref = _eager(weights)
    for static in (True, False):
        _, got = _run(weights, static=static, max_bs=3, placeholders=True)
        for rid in ref:
            assert torch.equal(got[rid], ref[rid]), f"static={static}, request {rid}: logits differ"


def test_failed_capture_falls_back_to_eager_steps(weights, caplog):
    """A capture that fails (here: no CUDA at all) turns graphs off with a warning and the step
    runs eagerly: the same logits as a runner that never had graphs."""
    eager, ref = _eager(weights)
    with caplog.at_level("WARNING", logger="dsv4_backend.cuda_graph"):
        runner, got = _run(weights, static=True, capture=True)
    assert not runner.cuda_graphs.enabled and runner.cuda_graphs.replays == 0
    assert "decode CUDA graphs disabled" in caplog.text
    for rid in ref:
        assert torch.equal(got[rid], ref[rid])



# HiSparse: buffers of top-k (4) rows for 4 request slots and 16 staging rows, 32 of 512 C4 rows
HISPARSE = {"top_k": 4, "device_buffer_size": 4, "host_to_device_ratio": 16}


def _buffers(runner):
    """Per CSA layer, each request buffer's full rows and their bytes in the hot pool."""
    from memory.layout import read_row_bytes
    hs = runner.pools.hisparse
    n = hs.num_req_slots * hs.buffer_size
    return {layer: (hs.table[layer][:n].clone(), read_row_bytes(hs.device_kv[layer], torch.arange(n)))
            for layer in hs.layers}


def test_static_decode_with_hisparse(weights):
    """HiSparse's decode swap-in on the static path (what a graph captures: no host decision)
    gives the ordinary HiSparse steps' logits, pools and request buffers bit for bit, and those
    equal HiSparse off. Padded to 4 rows, the padded row leaves every buffer as it was."""
    _, off = _eager(weights)
    eager, ref = _run(weights, static=False, hisparse=HISPARSE)
    hs = eager.pools.hisparse
    assert hs.rows == 32 and hs.swapped_rows > 0 and hs.evicted_rows > 0
    static, got = _run(weights, static=True, max_bs=3, hisparse=HISPARSE)
    assert static.cuda_graphs.replays == 5 and static.pools.hisparse.swapped_rows == hs.swapped_rows
    for rid in ref:
        assert torch.equal(ref[rid], off[rid]), f"request {rid}: HiSparse changed the logits"
        assert torch.equal(got[rid], ref[rid]), f"request {rid}: logits differ"
    _compare_pools(eager, static)
    want = _buffers(eager)
    for layer, (table, data) in _buffers(static).items():
        assert torch.equal(table, want[layer][0]) and torch.equal(data, want[layer][1])
    static.pools.hisparse.check_integrity([0, 1, 2])
    padded, _ = _run(weights, static=True, max_bs=4, hisparse=HISPARSE)
    assert padded.pools.hisparse.swapped_rows == hs.swapped_rows
    for layer, (table, _) in _buffers(padded).items():
        assert torch.equal(table, want[layer][0])
