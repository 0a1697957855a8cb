"""CUDA graphs for decode steps: capture a pure-decode step once per shape bucket, then replay.

An eager decode step of the Flash-shaped model launches thousands of kernels from Python, and
on an H200 the step is bound by that host work (docs/PERF.md), not by the GPU. As in SGLang's
CUDA graph runner, a step in which every request decodes one token is instead replayed from a
graph captured for its bucket:

- batch: the step's B requests are padded to the next captured batch size (1, 2, 4, 8, 12, 16,
  24, 32, then steps of 16 up to ``max_bs``); padded rows repeat request 0 with their writes
  masked (:class:`~dsv4_backend.triton_backend.StaticDecode`);
- context: the longest sequence is rounded up to a bucket of 4 steps per octave (4K, 5K, 6K,
  7K, 8K, 10K, ...): it sizes the C4 page tables, the indexer's score list (ctx / 4 rows, the
  rows past a request's visible count are masked) and the C128 row lists. A bucket costs at
  most 25% more indexer scan than the exact length, and a request growing from 4K to 1M
  crosses ~32 of them.

What runs outside the graph: one upload of the step's ints (request slots, prefix lengths, input
ids) and one kernel that fills the static buffers from them and the slot tables
(``kernels/static_tables.py``), the replay, and sampling. Mixed steps (any prefill chunk) run
eagerly.

Speculative verify steps (every request runs its last token and k drafts, k + 1 rows, as in
``scheduler_hooks/speculative.py``) replay graphs of their own, keyed by (batch, context,
k + 1): the static tables then hold k + 1 rows per request, each row one decode row of its
request (its own window, ring write, compression event and top-k), which is how the eager
extend computes them too. A step whose requests verify different numbers of drafts runs
eagerly. Each replay also leaves the final streams ``[T, hc, D]`` (the MTP layer's input).
The first step of a new bucket warms up (compiles the Triton kernels) and
captures; captures share one memory pool, and past ``max_graphs`` the cache is emptied.

Only the Triton backend can be captured (the torch backend loops over requests on the host),
with a bf16 model (the grouped MoE is sync-free only there) and, for online C128, an fp32
state. HiSparse steps are captured too: their swap-in is decided on the device
(memory/hisparse.py). ``DSV4_CUDA_GRAPH=0`` or ``--disable-cuda-graph`` turns graphs off.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from memory.configurator import FULL_PAGE


logger = logging.getLogger(__name__)

MIN_CONTEXT_BUCKET = 4096


def batch_buckets(max_bs: int) -> list[int]:
    """Captured batch sizes up to ``max_bs`` (always including it)."""
    sizes = [b for b in (1, 2, 4, 8, 12, 16, 24, 32) if b < max_bs]
    sizes += list(range(48, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


def context_bucket(n: int, minimum: int = MIN_CONTEXT_BUCKET) -> int:
    """The smallest ``k * 2^e`` with k in 4..7 that is >= max(n, minimum), in whole full pages."""
    n = max(n, minimum, 1)
    e = max(0, n.bit_length() - 3)
    k = -(-n // (1 << e))            # 4 <= k <= 8
    size = k << e
    return -(-size // FULL_PAGE) * FULL_PAGE


def graphs_supported(runner: Any) -> Optional[str]:
    """None when ``runner`` can replay decode graphs, else why not."""
    from .triton_backend import TritonDSV4Backend
    if runner.device.type != "cuda":
        return "not on CUDA"
    if not isinstance(runner.backend, TritonDSV4Backend):
        return f"the {runner.backend_name!r} backend is not capturable (only 'triton' is)"
    if runner.dtype != torch.bfloat16:
        return f"{runner.dtype} model (the sync-free grouped MoE needs bfloat16)"
    online = getattr(runner.pools, "c128_online", None)
    if online and any(t.dtype != torch.float32 for t in online.values()):
        return "bf16 online-C128 state (the capturable kernel keeps an fp32 state)"
    return None


def cuda_graph_default() -> bool:
    return os.environ.get("DSV4_CUDA_GRAPH", "1") != "0"


def _our_frame(e: BaseException) -> str:
    """The innermost line of this repository in ``e``'s traceback (where the uncapturable op was asked for)."""
    root = Path(__file__).resolve().parents[1]
    where = "?"
    for frame in traceback.extract_tb(e.__traceback__):
        path = Path(frame.filename).resolve()
        if root in path.parents and "site-packages" not in path.parts:
            where = f"{path.relative_to(root)}:{frame.lineno}"
    return where


class GraphUnavailable(RuntimeError):
    """A capture failed; graphs are now off and the caller runs the step eagerly. (The failed
    warm-up's writes are the step's own, and the online-C128 fold was off in it.)"""


@dataclass
class _Step:
    """What a static step is filled from: the requests' slots and prefix lengths, the rows' input
    ids (host ints, placeholders among them, or a device tensor) and the previous step's ids."""

    req_slots: list[int]
    prefix_lens: list[int]
    input_ids: Any
    prev_ids: Optional[torch.Tensor] = None


@dataclass
class _Captured:
    static: Any                          # StaticDecode
    graph: Optional[torch.cuda.CUDAGraph]
    logits: Optional[torch.Tensor]       # [bs * q, vocab], written by each replay
    hidden: Optional[torch.Tensor]       # [bs * q, hc, D], the final streams


class DecodeGraphs:
    """Replays pure-decode steps of one :class:`~dsv4_backend.model_runner.ModelRunner`.

    ``capture=False`` runs the same static path eagerly (no graph): how the CPU tests check
    the static tables against the ordinary step. ``window_only`` (a subclass's): the body runs
    window-only layers, so the step's compressed tables are not filled."""

    window_only = False

    def __init__(self, runner: Any, max_bs: int, capture: bool = True, max_graphs: int = 24,
                 min_context: int = MIN_CONTEXT_BUCKET):
        self.runner, self.capture = runner, capture
        self.max_bs, self.max_graphs, self.min_context = max_bs, max_graphs, min_context
        self.buckets = batch_buckets(max_bs)
        self.enabled = True
        # rows per request a static step takes (a backend with no static path replays nothing:
        # its first capture fails and turns graphs off)
        self.max_rows = getattr(runner.backend, "static_max_rows", lambda: 1)()
        self._graphs: dict[tuple[int, int, int], _Captured] = {}
        self._pool = None
        self.replays = 0
        self.captures = 0
        self.reset_stats()

    def can_run(self, reqs: list) -> bool:
        """A pure-decode step, or a step of speculative verifies all of one length (each request's
        rows are its last token and its drafts: ``rollback_len = prefix_len + 1``, every row's logits)."""
        if not (self.enabled and 0 < len(reqs) <= self.max_bs):
            return False
        q = len(reqs[0].input_ids)
        if q == 1:
            return all(len(r.input_ids) == 1 for r in reqs)
        return q <= self.max_rows and all(len(r.input_ids) == q and r.rollback_len == r.prefix_len + 1
                                          and r.logits == "all" for r in reqs)

    def reset_stats(self) -> None:
        self._prep_s, self._gpu_ms, self._timed = 0.0, 0.0, 0
        self._fill_ms, self._between_ms, self._betweens = 0.0, 0.0, 0
        self._pending: list[tuple[Any, Any, Any, Any]] = []   # (previous replay's end, fill, start, end)
        self._last_end: Any = None

    def _collect(self) -> None:
        """Fold the finished replays' event pairs into the totals (a served engine never asks
        for stats, so they must not pile up)."""
        still = []
        for prev, f, a, b in self._pending:
            if b.query():
                self._gpu_ms += a.elapsed_time(b)
                self._fill_ms += f.elapsed_time(a)
                if prev is not None:
                    self._between_ms += prev.elapsed_time(f)
                    self._betweens += 1
            else:
                still.append((prev, f, a, b))
        self._pending = still

    def stats(self) -> dict[str, float]:
        """Means over the replays since :meth:`reset_stats`: host preparation (the step's ints,
        their upload and the fill launch, ms), the replay's own GPU time (ms, between events around
        it), the GPU time from a step's first GPU work to its replay (``fill_gpu_ms``: the upload
        and the fill kernel, and any wait for the host to queue them) and from one replay's end to
        the next step's first GPU work (``between_replays_ms``: the sampling, the slot tables'
        updates and whatever else runs eagerly between, and idle time while the host is behind)."""
        for *_, b in self._pending:
            b.synchronize()
        self._collect()
        n = max(self._timed, 1)
        return {"replays": self._timed, "host_prep_ms": 1e3 * self._prep_s / n, "replay_gpu_ms": self._gpu_ms / n,
                "fill_gpu_ms": self._fill_ms / n, "between_replays_ms": self._between_ms / max(self._betweens, 1)}

    def run(self, reqs: list, prev_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of :meth:`can_run`'s kind: (logits [T, vocab], the final streams [T, hc, D]),
        T = B * q rows in request order; both buffers are the graph's own. ``prev_ids``: resolves
        placeholder input ids on the device (``input_ids.py``) as the static input buffer is filled."""
        t0 = time.perf_counter()
        self._collect()
        fill = None
        if self.capture and self.runner.device.type == "cuda":    # the step's first GPU work: its table fill follows
            fill = torch.cuda.Event(enable_timing=True)
            fill.record()
        q = len(reqs[0].input_ids)
        step = _Step([r.req_slot for r in reqs], [r.prefix_len for r in reqs],
                     [t for r in reqs for t in r.input_ids], prev_ids)
        bs = next(b for b in self.buckets if b >= len(reqs))
        ctx = context_bucket(max(step.prefix_lens) + q, self.min_context)
        entry = self._graphs.get((bs, ctx, q))
        if entry is None:
            try:
                entry = self._build(bs, ctx, q, step)
            except Exception as e:  # noqa: BLE001 (an op that cannot be captured: fall back, loudly)
                self.enabled = False
                self._graphs.clear()
                logger.warning("decode CUDA graphs disabled: capturing batch %d x %d rows, contexts <= %d failed "
                               "at %s (%s: %s); every step now runs eagerly", bs, q, ctx, _our_frame(e),
                               type(e).__name__, e)
                raise GraphUnavailable(str(e)) from e
        self._fill(step, entry.static)
        if entry.graph is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._prep_s += time.perf_counter() - t0
            self._timed += 1
            start.record()
            entry.graph.replay()
            end.record()
            self._pending.append((self._last_end, fill, start, end))
            self._last_end = end
            logits, hidden = entry.logits, entry.hidden
        else:
            self._last_end = None
            logits, hidden = self._body(entry.static)
        self.replays += 1
        T = len(reqs) * q
        return logits[:T], hidden[:T]

    def _fill(self, step: "_Step", st: Any, count_tokens: bool = True) -> None:
        self.runner.backend.fill_static_decode(step.req_slots, step.prefix_lens, step.input_ids, st, step.prev_ids,
                                               count_tokens=count_tokens, compressed=not self.window_only)

    def _body(self, st: Any) -> tuple[torch.Tensor, torch.Tensor]:
        model, backend = self.runner.model, self.runner.backend
        backend.use_static_decode(st)
        X = model(st.input_ids, st.meta.positions, backend, st.meta)
        return model.logits(X), X

    def _build(self, bs: int, ctx: int, q: int, step: "_Step") -> _Captured:
        backend = self.runner.backend
        st = backend.static_decode(bs, ctx, q)
        if not self.capture:
            entry = _Captured(st, None, None, None)
            self._graphs[bs, ctx, q] = entry
            return entry
        if len(self._graphs) >= self.max_graphs:
            logger.info("decode graphs: %d cached, dropping them", len(self._graphs))
            self._graphs.clear()
            self._pool = None
        # Warm-up on a side stream (compiles the kernels, sets up cuBLAS), with this step's own
        # values: every write it makes is the one the replay makes, except the online C128
        # fold, which a token count of 0 switches off.
        self._fill(step, st, count_tokens=False)
        stream = torch.cuda.Stream(device=self.runner.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._body(st)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, hidden = self._body(st)
        self.captures += 1
        logger.info("decode graph captured: batch %d x %d rows, contexts <= %d (%d cached)", bs, q, ctx,
                    len(self._graphs) + 1)
        entry = _Captured(st, graph, logits, hidden)
        self._graphs[bs, ctx, q] = entry
        return entry
