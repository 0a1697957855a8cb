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

import pytest
import torch

from bench._bench_common import admit_synthetic, finish_all
from bench.kernel_count import count_syncs
from dsv4_backend.backend import ForwardBatch, TorchDSV4Backend
from dsv4_backend.config import DSV4Config
from dsv4_backend.model_runner import ModelRunner
from scheduler_hooks.io import SamplingParams
from scheduler_hooks.sampling import SampleInput, sample

CFG = DSV4Config.preset("tiny", vocab_size=512, num_hidden_layers=3, compress_ratios=(0, 4, 128, 0), index_topk=4)
HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero",
              "argwhere", "unique", "unique_consecutive", "masked_select", "repeat_interleave"}


class DeviceMemory(torch.Tensor):
    """A CPU tensor standing for one in device memory; ``reads`` lists the host reads of it."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        bool_index = name in ("__getitem__", "__setitem__") and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool
            for a in (args[1] if isinstance(args[1], tuple) else (args[1],)))
        if name in HOST_READS or bool_index:
            cls.reads.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


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


def test_decode_metadata_reads_nothing_back(runner):
    alloc, backend = runner.allocator, runner.backend
    lens = {"a": 300, "b": 131, "c": 7}
    _requests(alloc, lens)
    for rid, n in lens.items():             # the decode step's reservation
        alloc.extend(rid, n + 1)
    batch = ForwardBatch([alloc.req_slot(r) for r in lens], list(lens.values()), [1, 1, 1])
    DeviceMemory.reads = []
    meta = TorchDSV4Backend.init_forward_metadata(backend, batch, events=False)    # the graph path's
    assert isinstance(meta.window_slots, DeviceMemory)                              # it did read the tables
    st = backend.static_decode(4, 512)
    backend.fill_static_decode(meta, torch.tensor([1, 2, 3]), st)
    eager = TorchDSV4Backend.init_forward_metadata(backend, batch)                  # with events
    assert isinstance(eager.compressed[4].events.src_ring, DeviceMemory)
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
