"""Host synchronisations of a decode step: one, the read of the sampled ids.

On the CPU there is no device to wait for, so the allocator's tables stand in for device
memory as :class:`DeviceMemory` tensors: every tensor computed from them is one too, and each
operation that needs their values on the host (``item``, ``tolist``, ``bool``, a boolean-mask
index, ``nonzero``, ...: on a GPU each waits for the stream) is recorded. The step's metadata
(the allocator's table updates, ``init_forward_metadata``, the static decode tables a CUDA
graph reads) must record none and sampling exactly one. Host-to-device copies cannot be told
apart on the CPU; on CUDA the last test counts the synchronising calls of whole engine steps
with ``torch.cuda.set_sync_debug_mode`` (``bench/kernel_count.count_syncs``): none but the wait
for the sampled ids, which the overlap schedule makes after the next step's launch.

The missing-SWA-slot check, formerly a device read, now runs on the allocator's page
bookkeeping: it is compared here with what ``full_to_swa`` itself says. About 5 s on the CPU.
"""

from __future__ import annotations

import random
import traceback
from pathlib import Path

import pytest
import torch

from bench._bench_common import admit_synthetic, finish_all
from bench.kernel_count import count_syncs
from dsv4_backend.backend import ForwardBatch
from dsv4_backend.config import DSV4Config
from dsv4_backend.model_runner import ModelRunner
from scheduler_hooks.io import SamplingParams
from scheduler_hooks.sampling import SampleInput, sample

CFG = DSV4Config.preset("tiny", vocab_size=512, num_hidden_layers=3, compress_ratios=(0, 4, 128, 0), index_topk=4)
ROOT = Path(__file__).resolve().parents[1]
HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero",
              "argwhere", "unique", "unique_consecutive", "masked_select", "repeat_interleave"}


class DeviceMemory(torch.Tensor):
    """A CPU tensor standing for one in device memory; ``reads`` lists the host reads of it,
    ``where`` the innermost line of this repository (outside tests/) that asked for each."""

    reads: list[str] = []
    where: list[str] = []
    paused = False          # True while a stand-in for a graph replay runs (its own reads are not counted)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if cls.paused:
            return super().__torch_function__(func, types, args, kwargs or {})
        name = getattr(func, "__name__", "")
        bool_index = name in ("__getitem__", "__setitem__") and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool
            for a in (args[1] if isinstance(args[1], tuple) else (args[1],)))
        if name in HOST_READS or bool_index:
            cls.reads.append(name)
            cls.where.append(_caller())
        return super().__torch_function__(func, types, args, kwargs or {})


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = Path(frame.filename).resolve()
        if ROOT in path.parents and "site-packages" not in path.parts and path.parent.name != "tests":
            return f"{path.relative_to(ROOT)}:{frame.lineno}"
    return "?"


@pytest.fixture
def runner():
    r = ModelRunner.build(CFG, dtype=torch.float32, backend="triton", max_total_tokens=2048, max_running_requests=4,
                          swa_ratio=0.5, cuda_graph=False)
    alloc = r.allocator
    alloc.req_pool.req_to_token = alloc.req_pool.req_to_token.as_subclass(DeviceMemory)
    alloc._full_to_swa = alloc._full_to_swa.as_subclass(DeviceMemory)
    DeviceMemory.reads = []
    return r


def _requests(alloc, lens: dict[str, int]) -> None:
    """Admit and extend as a chunked prefill would (SWA pages leaving the window freed)."""
    for rid, n in lens.items():
        alloc.admit(rid)
        for end in range(64, n + 64, 64):
            alloc.extend(rid, min(end, n))
            alloc.evict_swa(rid)


def test_decode_metadata_reads_nothing_back(runner, monkeypatch):
    alloc, backend = runner.allocator, runner.backend
    lens = {"a": 300, "b": 131, "c": 7}
    _requests(alloc, lens)
    for rid, n in lens.items():             # the decode step's reservation
        alloc.extend(rid, n + 1)
    slots = [alloc.req_slot(r) for r in lens]
    batch = ForwardBatch(slots, list(lens.values()), [1, 1, 1])
    DeviceMemory.reads = []
    meta = backend.init_forward_metadata(batch)                                    # the eager step's
    assert isinstance(meta.compressed[4].events.src_ring, DeviceMemory)             # it did read the tables
    # the graph path's fill: its host part reads nothing; its kernel reads the tables on the
    # device (the interpreter's own reads are not counted), and it did get them
    from dsv4_backend.kernels import static_tables as module
    from dsv4_backend.kernels._common import interpreting
    kernel, launched = module.static_fill, []

    def on_device(*args, **kwargs):
        launched.append(all(isinstance(t, DeviceMemory) for t in args[3:5]))
        if interpreting():     # the CPU stands in for the device only under the interpreter
            DeviceMemory.paused = True
            try:
                kernel(*args, **kwargs)
            finally:
                DeviceMemory.paused = False

    monkeypatch.setattr(module, "static_fill", on_device)
    st = backend.static_decode(4, 512)
    backend.fill_static_decode(slots, list(lens.values()), [1, 2, 3], st)
    assert launched == [True]
    assert DeviceMemory.reads == []


def test_sampling_reads_once():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 64, generator=gen, dtype=torch.float64).as_subclass(DeviceMemory)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.5, repetition_penalty=1.3)]
    inputs = [SampleInput(p, [1, 2, 3], [4], torch.Generator().manual_seed(i)) for i, p in enumerate(params)]
    DeviceMemory.reads = []
    out = sample(logits, inputs)
    assert DeviceMemory.reads == ["tolist"]
    assert out.errors == [None] * 4 and out.token_ids[0] == int(torch.as_tensor(logits[0]).argmax())


def test_unmapped_agrees_with_full_to_swa(runner):
    alloc = runner.allocator
    rng = random.Random(3)
    lens = {f"r{i}": rng.randrange(1, 600) for i in range(4)}
    _requests(alloc, lens)
    alloc.free("r2")                        # a freed slot: every position unmapped
    f2s = torch.as_tensor(alloc.full_to_swa)
    r2t = torch.as_tensor(alloc.req_to_token)
    for rid, n in lens.items():
        slot = 2 if rid == "r2" else alloc.req_slot(rid)
        for _ in range(20):
            a = rng.randrange(0, n + 40)
            b = rng.randrange(a, n + 80)
            want = [p for p in range(a, b) if rid == "r2" or p >= n or int(f2s[int(r2t[slot, p])]) < 0]
            assert alloc.unmapped(slot, a, b) == want, (rid, n, a, b)


def test_a_window_position_without_an_swa_slot_is_named(runner):
    alloc = runner.allocator
    _requests(alloc, {"a": 200})
    slot = alloc.req_slot("a")
    with pytest.raises(RuntimeError, match=rf"request slot {slot}: positions \[200\] .* no SWA slot"):
        runner.backend.init_forward_metadata(ForwardBatch([slot], [200], [1]))     # position 200: not extended


def _replay_stand_in(obj, name: str) -> None:
    """``obj.name`` with its reads uncounted and its tensor outputs in device memory: on CUDA
    it is a graph replay (the verify, the MTP passes), which reads nothing back."""
    fn = getattr(obj, name)

    def wrapped(*a, **kw):
        DeviceMemory.paused = True
        try:
            out = fn(*a, **kw)
        finally:
            DeviceMemory.paused = False
        dev = lambda t: t.as_subclass(DeviceMemory) if isinstance(t, torch.Tensor) else t   # noqa: E731
        return [dev(t) for t in out] if isinstance(out, list) else dev(out)
    setattr(obj, name, wrapped)


def test_speculative_step_reads_twice():
    """A speculative step of three greedy verifies (K = 3, forced acceptance 1, 3, 4) outside its
    graph replays: the drafts once (after the chain, draft 1 from the previous step's MTP pass
    with them), the acceptance once (all requests' rows in one sampling call); the MTP pass over
    the kept positions, the snapshot and the restore of every CSA / HCA layer none. (Before, commit 5cd467a, this test
    counted 30 a step: the row pools' slot checks 24 (4 per row read or write and layer), the
    acceptance 3 (once per request), the drafts 2 (once per pass), the MTP pass 1; plus, not
    visible here (their index tensors were made on the host), one ``nonzero`` per ratio in the
    snapshot and per saved entry in the restore: 8 more a step on a GPU; with Flash's 21 CSA
    and 20 HCA layers 126 of these and up to 252 slot checks.)"""
    from dsv4_backend import Engine
    eng = Engine(preset="tiny", device="cpu", dtype="float32", skip_tokenizer_init=True,
                 config_overrides={"vocab_size": 512}, max_total_tokens=4096, max_running_requests=4,
                 speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1,
                 speculative_num_draft_tokens=4)
    try:
        rids = admit_synthetic(eng, 300, 3, 40)
        spec, alloc, pools = eng.scheduler.spec, eng.allocator, eng.runner.pools
        accepted = iter([0, 2, 3] * 4)
        spec.accept_override = lambda rid, k: next(accepted)
        eng.step()
        alloc.req_pool.req_to_token = alloc.req_pool.req_to_token.as_subclass(DeviceMemory)
        alloc._full_to_swa = alloc._full_to_swa.as_subclass(DeviceMemory)
        for kind in ("c4_kv", "c4_indexer", "c4_ring", "c4_indexer_ring", "c128_kv", "c128_ring"):
            pool = getattr(pools, kind)
            for layer in pool:
                pool[layer] = pool[layer].as_subclass(DeviceMemory)
        stacked = getattr(pools, "stacked", {})
        for kind, (t, ids) in list(stacked.items()):
            stacked[kind] = (t.as_subclass(DeviceMemory), ids)
        _replay_stand_in(eng.runner, "forward")
        _replay_stand_in(spec.mtp, "forward")
        _replay_stand_in(spec.mtp, "logits")
        DeviceMemory.reads, DeviceMemory.where = [], []
        for _ in range(2):
            before = spec.num_verify
            eng.step()
            assert spec.num_verify == before + 3
        where = list(DeviceMemory.where)
        finish_all(eng, rids)
    finally:
        DeviceMemory.paused = False
        eng.shutdown()
    assert len(where) == 2 * 2, where
    assert all(w.startswith(("scheduler_hooks/speculative.py", "scheduler_hooks/sampling.py")) for w in where), where


def _event_wait_line() -> str:
    """``sampling.py:N``, the line where a step's sampled ids are waited for (``PendingSample.result``)."""
    import inspect
    from scheduler_hooks import sampling
    lines, start = inspect.getsourcelines(sampling.PendingSample.result)
    n = next(start + i for i, text in enumerate(lines) if "self._event.synchronize()" in text)
    return f"sampling.py:{n}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts CUDA synchronisations")
@pytest.mark.parametrize("overlap", [True, False])
def test_cuda_decode_step_syncs_once(overlap):
    """Graph decode steps synchronise nowhere but where the host waits for a step's sampled ids
    (an event, after page-locked copies: the debug mode may or may not report it), at most once a
    step; with the overlap schedule that wait comes after the next step's launch."""
    from dsv4_backend import Engine
    eng = Engine(preset="tiny", device="cuda", dtype="bfloat16", skip_tokenizer_init=True,
                 config_overrides={"vocab_size": 1024}, max_total_tokens=8192, max_running_requests=2,
                 random_weights_on_device=True, disable_overlap_schedule=not overlap)
    try:
        assert eng.runner.cuda_graphs is not None
        rids = admit_synthetic(eng, 300, 2, 12)
        eng.step()
        eng.step()                          # captured and replayed once
        before = eng.scheduler.overlap.overlap_steps
        syncs = count_syncs(eng, 4)
        overlapped = eng.scheduler.overlap.overlap_steps - before
        finish_all(eng, rids)
    finally:
        eng.shutdown()
    assert set(syncs) <= {_event_wait_line()} and sum(syncs.values()) <= 4, syncs
    assert overlapped == (4 if overlap else 0)



@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts CUDA synchronisations")
def test_cuda_speculative_step_syncs_twice():
    """On CUDA with graphs (verify, drafts and the kept pass replayed): the two reads per
    speculative step of test_speculative_step_reads_twice. The drafts' read is a synchronising
    copy (reported once a step); the acceptance's sampled ids come back through page-locked
    copies and an event (``sampling.PendingSample``), which the debug mode may not report (on the
    H200 of session 7 it did not: 2 reports in 2 steps, all at the drafts' read)."""
    from dsv4_backend import Engine
    eng = Engine(preset="tiny", device="cuda", dtype="bfloat16", skip_tokenizer_init=True,
                 config_overrides={"vocab_size": 1024}, max_total_tokens=8192, max_running_requests=2,
                 random_weights_on_device=True, speculative_algorithm="EAGLE", speculative_num_steps=3,
                 speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    try:
        spec = eng.scheduler.spec
        accepted = iter([0, 2, 3, 1] * 8)
        spec.accept_override = lambda rid, k: next(accepted)
        rids = admit_synthetic(eng, 300, 2, 40)
        for _ in range(3):
            eng.step()                      # captures (verify, drafts, kept pass), then replays
        replays = eng.runner.cuda_graphs.replays, spec.mtp_graphs.replays
        syncs = count_syncs(eng, 2)
        replays = eng.runner.cuda_graphs.replays - replays[0], spec.mtp_graphs.replays - replays[1]
        finish_all(eng, rids)
    finally:
        eng.shutdown()
    assert replays == (2, 2 * 3), replays   # per step: the verify; 2 draft passes and the kept pass
    assert all(k.startswith(("sampling.py", "speculative.py")) for k in syncs), syncs
    drafts = sum(v for k, v in syncs.items() if k.startswith("speculative.py"))
    assert drafts == 2 and sum(syncs.values()) <= 2 * 2, syncs
