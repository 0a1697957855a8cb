"""Shared pieces of the engine benchmarks: decode timing, a per-layer-type time breakdown, KV accounting.

Everything goes through an :class:`~scheduler_hooks.engine.Engine` (its scheduler, hooks and
pools); nothing here changes the engine. The breakdown instruments it from outside: forward
pre/post hooks on every block, its attention and its MoE module, and wrappers on the model
runner's ``forward`` and the backend's ``init_forward_metadata`` / top-k selection, installed on
the instances for the duration of a ``with LayerTimer(engine):`` block.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from memory.configurator import (C4_INDEXER_STATE_WIDTH, C4_STATE_WIDTH, C128_STATE_WIDTH,
                                 INDEXER_ROW_BYTES, KV_ROW_BYTES, ONLINE_STATE_SHAPE)

# Breakdown categories, in report order. "attn" categories are whole attention modules (q/kv
# projections, compressor and indexer inputs, the backend's pool writes, compression, top-k and
# attention, output projection) grouped by the layer's compress ratio.
CATEGORIES = (
    ("attn_window", "attention, window-only layers"),
    ("attn_csa", "attention, CSA layers (indexer incl.)"),
    ("attn_hca", "attention, HCA layers"),
    ("moe", "MoE (gate, shared + routed experts)"),
    ("mhc_norms", "mHC mixes + norms (block - attn - MoE)"),
    ("embed_head", "embedding + head/logits"),
    ("metadata", "step metadata (backend)"),
    ("sched_sampling", "sampling + scheduling (step - forward)"),
)
SUB_CATEGORIES = (("indexer_topk", "of which CSA top-k selection (indexer scan)"),)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graphed(fn: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph (warmed up on a side stream first); itself on the CPU."""
    if device.type != "cuda":
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


# ---- KV accounting ----------------------------------------------------------------------------

def kv_bytes_held(engine: Any) -> int:
    """Bytes the live requests occupy in the pools (rows and ring slots in use, all layers)."""
    cfg, plan = engine.config, engine.plan
    S = torch.empty((), dtype=engine.pools.state_dtype).element_size()
    used = {k: v["used"] for k, v in engine.pool_usage().items()}
    L, l4, l128 = cfg.num_hidden_layers, plan.num_c4_layers, plan.num_c128_layers
    return int(used["swa"] * KV_ROW_BYTES * L
               + used.get("c4_rows", 0) * KV_ROW_BYTES * l4
               + used.get("c4_indexer_rows", 0) * INDEXER_ROW_BYTES * l4
               + used.get("c4_ring_slots", 0) * (C4_STATE_WIDTH + C4_INDEXER_STATE_WIDTH) * S * l4
               + used.get("c128_rows", 0) * KV_ROW_BYTES * l128
               + used.get("c128_ring_rows", 0) * C128_STATE_WIDTH * S * l128
               + used.get("c128_online_slots", 0) * ONLINE_STATE_SHAPE[0] * ONLINE_STATE_SHAPE[1] * S * l128)


def plan_bytes_per_request(plan: Any, context: int) -> int:
    """What the plan charges one request of ``context`` tokens: its full pages times the bytes
    per full token (window share and ring share included), plus its share of the fixed C128 state."""
    pages = -(-context // plan.full_page)
    return int(pages * plan.full_page * plan.bytes_per_full_token + plan.fixed_bytes / plan.max_running_requests)


# ---- the breakdown ----------------------------------------------------------------------------

class _Clock:
    """Marks on the CPU (perf_counter) or on the current CUDA stream (events)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else 1e3 * (b - a)


@dataclass
class Breakdown:
    """Mean ms per step per category (``CATEGORIES`` + ``SUB_CATEGORIES`` keys) over ``steps`` steps."""

    steps: int = 0
    step_ms: float = 0.0
    ms: dict[str, float] = field(default_factory=dict)

    def pct(self, key: str) -> float:
        return 100.0 * self.ms.get(key, 0.0) / self.step_ms if self.step_ms else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "step_ms": self.step_ms, "ms": dict(self.ms),
                "pct": {k: self.pct(k) for k in self.ms}}

    def table(self, title: str = "", floor_ms: Optional[dict[str, float]] = None) -> str:
        """The parts, ms and share of the step; with ``floor_ms`` (category -> ms) each part's
        byte floor and its ratio to it beside."""
        lines = [title] if title else []
        f_head = f" {'floor ms':>9} {'x floor':>8}" if floor_ms else ""
        lines.append(f"  {'part':<44} {'ms/step':>9} {'%':>6}" + f_head)
        for key, label in CATEGORIES + SUB_CATEGORIES:
            if key in self.ms:
                pad = "    " if (key, label) in SUB_CATEGORIES else ""
                line = f"  {pad + label:<44} {self.ms[key]:>9.2f} {self.pct(key):>5.1f}%"
                fl = (floor_ms or {}).get(key)
                if fl:
                    line += f" {fl:>9.3f} {self.ms[key] / fl:>7.1f}x"
                lines.append(line)
        step = f"  {'step':<44} {self.step_ms:>9.2f} {100.0:>5.1f}%"
        if floor_ms:
            total = sum(floor_ms.get(k, 0.0) for k, _ in CATEGORIES)
            step += f" {total:>9.3f} {self.step_ms / total:>7.1f}x"
        lines.append(step)
        return "\n".join(lines)


class _LabelledRanges:
    """Labels the parts of an engine step: each block, its attention (by kind) and its MoE
    (module hooks), the runner's forward, the backend's metadata and the CSA selection (wrapped
    methods). Subclasses say what opening and closing a range does; ``with`` installs and
    removes the instrumentation."""

    def __init__(self, engine: Any):
        self.engine = engine
        runner = engine.runner
        self.runner, self.model, self.backend = runner, runner.model, runner.backend
        self.device = runner.device
        self._handles: list[Any] = []
        self._patched: list[tuple[Any, str]] = []
        self._open: dict[int, Any] = {}

    def _enter_range(self, key: str) -> Any:
        raise NotImplementedError

    def _exit_range(self, key: str, token: Any) -> None:
        raise NotImplementedError

    def _module_hooks(self, module: torch.nn.Module, key: str) -> None:
        def pre(mod: Any, args: Any) -> None:
            self._open[id(mod)] = self._enter_range(key)

        def post(mod: Any, args: Any, out: Any) -> None:
            self._exit_range(key, self._open.pop(id(mod)))

        self._handles.append(module.register_forward_pre_hook(pre))
        self._handles.append(module.register_forward_hook(post))

    def _wrap(self, obj: Any, name: str, key: str) -> None:
        fn: Optional[Callable] = getattr(obj, name, None)
        if fn is None:
            return

        def labelled(*a: Any, **kw: Any) -> Any:
            token = self._enter_range(key)
            try:
                return fn(*a, **kw)
            finally:
                self._exit_range(key, token)

        setattr(obj, name, labelled)       # an instance attribute shadows the class's method
        self._patched.append((obj, name))

    def __enter__(self):
        self._instrument()
        return self

    def _instrument(self) -> None:
        """Install the ranges: per block, its attention (by kind) and MoE; the forward, the metadata
        and the CSA selection."""
        kinds = {0: "attn_window", 4: "attn_csa", 128: "attn_hca"}
        for block in self.model.layers:
            self._module_hooks(block, "block")
            self._module_hooks(block.attn, kinds[block.attn.ratio])
            self._module_hooks(block.ffn, "moe")
        self._wrap(self.runner, "forward", "forward")
        self._wrap(self.backend, "init_forward_metadata", "metadata")
        # the CSA selection: "_select" in the Triton backend, "_topk" in the torch one
        for name in ("_select", "_topk"):
            if hasattr(self.backend, name):
                self._wrap(self.backend, name, "indexer_topk")
                break

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        for obj, name in self._patched:
            delattr(obj, name)
        self._handles, self._patched = [], []


class LayerTimer(_LabelledRanges):
    """Time one engine step at a time, split by layer type.

        with LayerTimer(engine) as lt:
            for _ in range(n):
                lt.step()           # engine.step(), timed
        lt.breakdown()              # -> Breakdown (means over the timed steps)

    CPU: wall time around each module. CUDA: events recorded at each hook, read after a
    synchronize at the end of the step (so the numbers are the GPU timeline's; gaps where the
    GPU waits for the CPU count towards the module running at the time).
    """

    def __init__(self, engine: Any):
        super().__init__(engine)
        self.clock = _Clock(self.device)
        self._intervals: list[tuple[str, Any, Any]] = []
        self._totals: dict[str, float] = {}
        self._steps = 0
        self._step_ms = 0.0

    def _enter_range(self, key: str) -> Any:
        return self.clock.mark()

    def _exit_range(self, key: str, token: Any) -> None:
        self._intervals.append((key, token, self.clock.mark()))

    # ---- measuring ----------------------------------------------------------------------

    def step(self) -> list[Any]:
        """One ``engine.step()``, timed and split; returns its outputs."""
        self._intervals.clear()
        sync(self.device)
        start = self.clock.mark()
        outs = self.engine.step()
        end = self.clock.mark()
        sync(self.device)
        step_ms = self.clock.ms(start, end)
        sums: dict[str, float] = {}
        for key, a, b in self._intervals:
            sums[key] = sums.get(key, 0.0) + self.clock.ms(a, b)
        attn = sum(sums.get(k, 0.0) for k in ("attn_window", "attn_csa", "attn_hca"))
        parts = {k: sums.get(k, 0.0) for k in ("attn_window", "attn_csa", "attn_hca", "moe", "metadata")}
        parts["mhc_norms"] = sums.get("block", 0.0) - attn - sums.get("moe", 0.0)
        parts["embed_head"] = sums.get("forward", 0.0) - sums.get("metadata", 0.0) - sums.get("block", 0.0)
        parts["sched_sampling"] = step_ms - sums.get("forward", 0.0)
        if "indexer_topk" in sums:
            parts["indexer_topk"] = sums["indexer_topk"]
        for k, v in parts.items():
            self._totals[k] = self._totals.get(k, 0.0) + v
        self._steps += 1
        self._step_ms += step_ms
        return outs

    def breakdown(self) -> Breakdown:
        n = max(self._steps, 1)
        return Breakdown(self._steps, self._step_ms / n, {k: v / n for k, v in self._totals.items()})


class _ProfiledRanges(_LabelledRanges):
    """Ranges as ``torch.profiler`` marks for charging GPU kernels to the range that ran them.

    Each boundary synchronizes the device, so every kernel of a range runs inside the range's
    host interval (Triton's launches included: they are not torch ops, so the profiler links them
    to no op). While installed, decode CUDA graphs are off: module hooks do not fire in a replay,
    and a graph replays the same kernels the eager step launches."""

    def __init__(self, engine: Any):
        super().__init__(engine)
        self._graphs_were: Optional[bool] = None

    def _enter_range(self, key: str) -> Any:
        sync(self.device)
        rf = torch.profiler.record_function(key)
        rf.__enter__()
        return rf

    def _exit_range(self, key: str, token: Any) -> None:
        sync(self.device)
        token.__exit__(None, None, None)

    def __enter__(self):
        graphs = getattr(self.runner, "cuda_graphs", None)
        if graphs is not None:
            self._graphs_were, graphs.enabled = graphs.enabled, False
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._graphs_were is not None:
            self.runner.cuda_graphs.enabled = self._graphs_were

    def _profiled_step(self) -> tuple[list[Any], Any]:
        """One ``engine.step()`` under the profiler (CUDA activity too on a GPU): (outputs, events)."""
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        sync(self.device)
        with profile(activities=acts) as prof:
            outs = self.engine.step()
            sync(self.device)
        return outs, prof.events()


class KernelBreakdown(_ProfiledRanges):
    """GPU kernel time of decode steps, split by layer type (CUDA).

        with KernelBreakdown(engine) as kb:
            for _ in range(n):
                kb.step()
        kb.breakdown(step_ms)      # -> Breakdown; step_ms: the measured (graph) step

    With decode CUDA graphs the step has no host gaps left to split, and module hooks do not
    fire in a replay. So the steps run eagerly under the profiler (:class:`_ProfiledRanges`) and
    each GPU kernel is charged to the innermost labelled range (a block, its attention by kind,
    its MoE, the CSA selection; outside the blocks: embedding and head) whose host interval
    contains the kernel's GPU interval. A graph replays
    the same kernels, so their sum is the GPU work of a graph step; ``step_ms`` minus that sum
    ("sched_sampling" here) is what the graph does not remove: the host's metadata, the copies
    into the graph's buffers, sampling and scheduling, and idle gaps. ``kernels()`` lists the
    costliest kernels by name.
    """

    LABELS = ("block", "attn_window", "attn_csa", "attn_hca", "moe", "indexer_topk", "forward", "metadata")

    def __init__(self, engine: Any):
        super().__init__(engine)
        self._totals: dict[str, float] = {}
        self._by_kernel: dict[str, float] = {}
        self._steps = 0

    def step(self) -> list[Any]:
        outs, events = self._profiled_step()
        sums: dict[str, float] = {}
        ranges, kernels = [], []
        for ev in events:
            tr = ev.time_range
            if ev.device_type.name == "CUDA":          # kernels, copies and memsets
                # (a labelled range shows up on the GPU timeline too, as an annotation: skip it)
                if tr.end > tr.start and ev.name not in self.LABELS:
                    kernels.append((ev.name, tr.start, tr.end))
            elif ev.name in self.LABELS:
                ranges.append((tr.end - tr.start, tr.start, tr.end, ev.name))
        ranges.sort()                                   # innermost (shortest) first
        for name, k0, k1 in kernels:
            label = next((lab for _, r0, r1, lab in ranges if r0 <= k0 and k1 <= r1), "other")
            ms = (k1 - k0) / 1e3
            sums[label] = sums.get(label, 0.0) + ms
            self._by_kernel[name] = self._by_kernel.get(name, 0.0) + ms
        parts = {k: sums.get(k, 0.0) for k in ("attn_window", "attn_hca", "moe")}
        parts["attn_csa"] = sums.get("attn_csa", 0.0) + sums.get("indexer_topk", 0.0)
        parts["indexer_topk"] = sums.get("indexer_topk", 0.0)
        parts["mhc_norms"] = sums.get("block", 0.0)
        parts["embed_head"] = sums.get("forward", 0.0)
        parts["metadata"] = sums.get("metadata", 0.0) + sums.get("other", 0.0)  # + sampling's
        for k, v in parts.items():
            self._totals[k] = self._totals.get(k, 0.0) + v
        self._steps += 1
        return outs

    def kernel_ms(self) -> float:
        """Mean GPU kernel time per profiled step."""
        keys = ("attn_window", "attn_csa", "attn_hca", "moe", "mhc_norms", "embed_head", "metadata")
        return sum(self._totals.get(k, 0.0) for k in keys) / max(self._steps, 1)

    def breakdown(self, step_ms: float) -> Breakdown:
        n = max(self._steps, 1)
        ms = {k: v / n for k, v in self._totals.items()}
        ms["sched_sampling"] = step_ms - self.kernel_ms()
        return Breakdown(self._steps, step_ms, ms)

    def kernels(self, top: int = 15) -> list[tuple[str, float]]:
        """The ``top`` kernels by mean GPU ms per step: (name, ms)."""
        n = max(self._steps, 1)
        rows = sorted(self._by_kernel.items(), key=lambda kv: -kv[1])[:top]
        return [(name[:80], ms / n) for name, ms in rows]


# ---- decode timing ----------------------------------------------------------------------------

@dataclass
class DecodeTiming:
    steps: int
    seconds: float
    tokens: int

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.seconds / max(self.steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def tokens_in_flight(engine: Any) -> int:
    """Tokens sampled by the step the overlap schedule has in flight (launched, not read yet)."""
    step = getattr(getattr(engine.scheduler, "overlap", None), "in_flight", None)
    return len(step.sampled) if step is not None else 0


def timed_decode_steps(engine: Any, steps: int, batch: int) -> DecodeTiming:
    """Run ``steps`` engine steps in which each of the ``batch`` running requests gains a token.
    With the overlap schedule a step returns the previous step's tokens: the tokens counted are
    those the timed steps sampled (read ones, plus those in flight at the end, minus those in
    flight at the start)."""
    sync(engine.device)
    before = tokens_in_flight(engine)
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        outs = engine.step()
        tokens += sum(len(o.delta_ids) for o in outs)
    sync(engine.device)
    dt = time.perf_counter() - t0
    tokens += tokens_in_flight(engine) - before
    if tokens != steps * batch:
        raise RuntimeError(f"expected {steps * batch} tokens from {steps} decode steps of batch {batch}, "
                           f"got {tokens}: a request finished, was retracted or never decoded")
    return DecodeTiming(steps, dt, tokens)


def admit_synthetic(engine: Any, context: int, batch: int, max_new_tokens: int) -> list[str]:
    """Queue ``batch`` synthetic requests of ``context`` tokens and run the admission step(s);
    every one must then be running (decoding). Returns their ids."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    rids = [engine.add_synthetic_request(context, params) for _ in range(batch)]
    sched = engine.scheduler
    for _ in range(batch + 1):
        if all(r in sched.reqs and sched.reqs[r].remaining == 1 for r in rids) and not sched.waiting:
            break
        engine.step()
    running = sum(1 for r in rids if r in sched.reqs and sched.reqs[r].remaining == 1)
    if running != batch:
        finish_all(engine, rids)
        raise RuntimeError(f"only {running} of {batch} synthetic requests of {context} tokens were admitted")
    return rids


def finish_all(engine: Any, rids: list[str]) -> None:
    """Abort whatever of ``rids`` is still in the engine; the pools must then balance."""
    for rid in rids:
        engine.abort(rid)
    engine.check_integrity()


def fmt_tokens(n: int) -> str:
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n >> 10}K"
    return str(n)


def graph_timing_text(g: dict) -> str:
    """A decode row's ``DecodeGraphs.stats()`` in words: the replay's GPU time, the GPU time before
    it (the static tables' upload and fill, and waits for the host), between replays (sampling),
    host preparation."""
    return (f"graph replay {g['replay_gpu_ms']:.2f} ms GPU, before it (table fill) "
            f"{g.get('fill_gpu_ms', 0):.2f} ms, between replays {g.get('between_replays_ms', 0):.2f} ms, "
            f"host prep {g['host_prep_ms']:.2f} ms")


def fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"
