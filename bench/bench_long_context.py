"""Long-context throughput through the Engine: compressed (CSA/HCA) KV vs the dense per-token cache.

A model with Flash's attention shapes and layer pattern (43 layers: 2 window-only, 20 x (CSA,
HCA), CSA, window-only; 64 heads of 512, index_topk 512; random weights drawn on the device) with
the MoE cut to ``--experts`` routed experts so the weights fit beside the pools, run by the
Engine (scheduler, hooks, pools; on CUDA the kernel of ``--attention-kernel``). Per context:

- decode tokens/s at batch 1, at the largest batch the memory plan holds (capped by
  ``--max-batch``), and at the largest batch both modes hold, with a synthetic context
  (``Engine.add_synthetic_request``: the same admission, pages and eviction as a prefill, the
  pools filled with random valid rows instead of running the model over the context);
- the same weights in the dense mode (every layer attends every previous token's 584-byte row)
  until its plan cannot hold the batch: the table then shows the plan's refusal (or an OOM);
- memory per request from the plan (and what the requests actually hold in the pools);
- real chunked prefill throughput at ``--prefill-contexts``, and an attempt at ``--prefill-long``
  (1M) under ``--prefill-max-seconds``: the script prints how far it got, how long it took and at
  what rate; it never extrapolates;
- the per-layer-type time breakdown (window-only / CSA incl. indexer / HCA attention, MoE, mHC +
  norms, metadata, sampling + scheduling) at ``--breakdown-contexts``;
- beside every decode row and breakdown part, its byte floor (``bench/_floor.py``: the weights the
  step uses, routed experts as the expected distinct count under uniform routing, plus the KV
  rows it reads) at the copy bandwidth measured at the start of the run, and the step's ratio to it.

It ends with the issue's targets (1M vs 4K decode at batch 1; compressed vs dense at 128K at the
largest common batch; 1M where dense cannot run), writes JSON (``--out``, rewritten after every
measurement) and a plot of decode tokens/s against context (``--plot``). A time guard keeps the
whole run within ``--time-budget`` seconds (model builds included): what would overrun is
skipped or run with fewer steps, and the output says so.

    # one H200 (the default preset, contexts and budget: ~9 minutes)
    PYTHONUNBUFFERED=1 python3 bench/bench_long_context.py --out $OUT/long.json --plot $OUT/long_context.png
    # the code path on the CPU, tiny stand-in
    python bench/bench_long_context.py --preset tiny --device cpu --contexts 1024,4096 --steps 2
    # FlashMLA and Triton side by side (one run each, the budget split between them)
    python3 bench/bench_long_context.py --attention-kernel flashmla,triton --modes compressed

Decode steps run under the engine's overlap schedule (step N + 1 launched before step N's tokens
are read, scheduler_hooks/overlap.py); ``--disable-overlap-schedule`` times synchronous steps (the
JSON's ``meta.overlap_schedule`` says which; each decode row counts its overlapped steps).

``--attention-kernel`` takes one kernel or a comma list (``auto``, ``flashmla``, ``triton``); with
several, the whole measurement runs once per kernel within an equal share of ``--time-budget``
(JSON: ``--out`` gets a ``.<kernel>`` suffix per run), and a last table sets their decode
tokens/s and the breakdown's attention share side by side.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

START = time.time()

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._bench_common import (  # noqa: E402
    Breakdown, KernelBreakdown, LayerTimer, admit_synthetic, finish_all, fmt_bytes, fmt_tokens, graph_timing_text,
    kv_bytes_held, plan_bytes_per_request, sync, timed_decode_steps,
)
from bench._floor import EXPERTS_UNIFORM, copy_gbps, decode_step_floor  # noqa: E402
from bench.kernel_count import KernelCounter, report as kernel_report, report_text as kernel_text, syncs_per_step  # noqa: E402,E501
from dsv4_backend.config import DSV4Config  # noqa: E402
from dsv4_backend.weights import param_dtype, weight_specs  # noqa: E402
from memory.configurator import DSV4PoolConfigurator, PlanError, PoolPlan  # noqa: E402
from scheduler_hooks.engine import DEFAULT_MIXED_CHUNK_TOKENS, DTYPES, Engine  # noqa: E402
from scheduler_hooks.io import GenerateRequest, SamplingParams  # noqa: E402

MODES = ("compressed", "dense")


# ---- results ------------------------------------------------------------------------------------

@dataclass
class DecodeRow:
    mode: str
    context: int
    batch: int
    batch_kind: str                      # "1", "max" (this mode's plan), "common" (both modes' plans)
    status: str                          # "ok", "refused by plan", "OOM", "skipped (time guard)", "error"
    note: str = ""
    steps: int = 0
    ms_per_step: float = 0.0
    tokens_per_s: float = 0.0
    admit_s: float = 0.0
    plan_bytes_per_request: int = 0      # what the plan charges one request of this context
    held_bytes_per_request: int = 0      # what the admitted requests hold in the pools / batch
    breakdown: Optional[dict[str, Any]] = None
    graph: Optional[dict[str, float]] = None  # CUDA-graph steps: host prep and replay GPU ms / step
    floor: Optional[dict[str, Any]] = None    # bench/_floor.StepFloor.to_dict(copy GB/s): the byte floor
    kernels: Optional[dict[str, Any]] = None  # bench/kernel_count.report of one eager step
    overlap_steps: int = 0               # timed steps launched before the previous step's tokens were read
    sync_ms_per_step: Optional[float] = None  # --overlap-ab: the same row, same engine, synchronous steps
    timeline: Optional[dict[str, Any]] = None  # --timeline: bench/step_timeline.summarize of profiled steps

    @property
    def floor_ms(self) -> float:
        return self.floor["floor_ms"] if self.floor else 0.0

    @property
    def x_floor(self) -> float:
        """The step's ratio to its byte floor (0 when either is missing)."""
        return self.ms_per_step / self.floor_ms if self.floor_ms and self.status == "ok" else 0.0


@dataclass
class PrefillRow:
    mode: str
    context: int
    status: str                          # "complete", "stopped (time budget)", "skipped ...", "OOM", "error"
    tokens_done: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    last_chunk_tokens_per_s: float = 0.0
    chunk: int = 0
    note: str = ""
    warmup_seconds: float = 0.0          # the untimed two-chunk prefill before (first-use compiles)


@dataclass
class MixedRow:
    """Running decodes while another request prefills: their time per output token before the
    prefill arrives and during it (every step of the prefill also decodes them), under one
    policy: ``mixed_chunk_tokens`` prefill tokens per step beside decodes (0: the whole chunk)."""
    decode_context: int
    decode_batch: int
    prefill_context: int
    status: str
    mixed_chunk_tokens: int = 0
    note: str = ""
    chunk: int = 0                       # prefill tokens per step beside the decodes
    tpot_alone_ms: float = 0.0           # mean decode step before the prefill
    steps_mixed: int = 0                 # steps while the prefill ran
    tpot_mixed_ms: float = 0.0           # mean of those steps (each gave every decode a token)
    tpot_mixed_p50_ms: float = 0.0
    tpot_mixed_max_ms: float = 0.0
    stalled_steps: int = 0               # steps of the prefill in which a running decode got no token
    prefill_tokens_done: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0                  # the long prompt's first token (its prefill done), 0 if not reached


@dataclass
class Report:
    meta: dict[str, Any] = field(default_factory=dict)
    plans: dict[str, Any] = field(default_factory=dict)
    decode: list[DecodeRow] = field(default_factory=list)
    prefill: list[PrefillRow] = field(default_factory=list)
    mixed: list[MixedRow] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"meta": self.meta, "plans": self.plans, "decode": [asdict(r) | {"floor_ms": r.floor_ms, "x_floor": r.x_floor}
                                                               for r in self.decode],
                "prefill": [asdict(r) for r in self.prefill], "mixed": [asdict(r) for r in self.mixed],
                "summary": self.summary, "log": self.log}


# ---- the clock ----------------------------------------------------------------------------------

class Guard:
    """Seconds left of the run's budget (counted from process start)."""

    def __init__(self, budget_s: float):
        self.budget_s = budget_s

    @property
    def elapsed(self) -> float:
        return time.time() - START

    @property
    def left(self) -> float:
        return self.budget_s - self.elapsed


# ---- model and memory ---------------------------------------------------------------------------

def model_config(args: argparse.Namespace) -> DSV4Config:
    over: dict[str, Any] = {}
    if args.experts:
        over["n_routed_experts"] = args.experts
        base = DSV4Config.preset(args.preset)
        over["num_experts_per_tok"] = min(base.num_experts_per_tok, args.experts)
    return DSV4Config.preset(args.preset, **over)


def weight_bytes(cfg: DSV4Config, dtype: torch.dtype) -> int:
    """Bytes of the engine model's weights (MTP excluded), without making them."""
    return sum(math.prod(s.shape) * torch.empty((), dtype=param_dtype(s.name, s.kind, dtype)).element_size()
               for s in weight_specs(cfg, include_mtp=False))


@dataclass
class MemorySetup:
    """How the engines are sized: one pool budget for both modes, so the comparison is fair."""

    pool_budget: int                     # bytes for the KV pools, the same in both modes
    max_running: int
    context_length: int
    mem_fraction: Optional[float]        # what the Engine is given on CUDA
    notes: list[str]


def conf_for(cfg: DSV4Config, mode: str, max_running: int) -> DSV4PoolConfigurator:
    return DSV4PoolConfigurator(cfg, max_running_requests=max_running, swa_ratio=0.1, dense=mode == "dense")


def plan_for(cfg: DSV4Config, mode: str, mem: MemorySetup) -> PoolPlan:
    return conf_for(cfg, mode, mem.max_running).plan_for_budget(mem.pool_budget)


def model_defaults(args: argparse.Namespace) -> bool:
    """The benchmark model's defaults where the flags left them open (bf16 on CUDA, float32 on
    the CPU; 8 routed experts for the Flash / Pro presets); returns whether the device is CUDA."""
    cuda = torch.device(args.device).type == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.experts is None and args.preset != "tiny":
        args.experts = 8
    return cuda


def memory_setup(cfg: DSV4Config, args: argparse.Namespace, device: torch.device, headroom: int) -> MemorySetup:
    dtype = DTYPES[args.dtype]
    context_length = max(args.contexts + args.prefill_contexts + [args.prefill_long, args.mixed_prefill]) \
        + headroom + 256
    notes = []
    W = weight_bytes(cfg, dtype)
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
        # Engine construction holds the weights twice (the drawn dict and the model's copy);
        # request tables are outside the plan; activations need a reserve.
        table_bytes = args.max_batch * context_length * 8
        pool_budget = int(total * args.mem_fraction - 2 * W - table_bytes - args.reserve_gb * 2**30)
        if pool_budget <= 0:
            raise SystemExit(f"no room for pools: {fmt_bytes(total)} x {args.mem_fraction} - 2 x weights "
                             f"{fmt_bytes(W)} - tables {fmt_bytes(table_bytes)} - reserve {args.reserve_gb} GiB")
        notes.append(f"device memory {fmt_bytes(total)}; weights {fmt_bytes(W)} (held twice while an engine is "
                     f"built); request tables {fmt_bytes(table_bytes)}; activation reserve {args.reserve_gb} GiB; "
                     f"KV pool budget {fmt_bytes(pool_budget)} for either mode")
        mem = MemorySetup(pool_budget, args.max_batch, context_length, None, notes)
    else:
        # the budget of a compressed plan for this many tokens, given to either mode
        tokens = args.cpu_pool_tokens or 8 * (max(args.contexts + [args.mixed_prefill]) + headroom + 256)
        budget = conf_for(cfg, "compressed", args.max_batch).plan_for_tokens(tokens).budget_bytes
        notes.append(f"CPU: weights {fmt_bytes(W)}; KV pool budget {fmt_bytes(budget)} for either mode "
                     f"(a compressed plan of {tokens:,} tokens)")
        mem = MemorySetup(budget, args.max_batch, context_length, None, notes)
    # max_running_requests: no more than the compressed plan holds at the smallest context
    fits = plan_for(cfg, "compressed", mem).requests_fit(min(args.contexts) + headroom)
    mem.max_running = max(1, min(args.max_batch, fits))
    if device.type == "cuda":
        mem.mem_fraction = (mem.pool_budget + W) / torch.cuda.mem_get_info(device)[1]
    return mem


def build_engine(cfg: DSV4Config, mode: str, mem: MemorySetup, args: argparse.Namespace) -> Engine:
    overrides = {"n_routed_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok}
    kw: dict[str, Any] = dict(preset=args.preset, device=args.device, dtype=args.dtype, dense=mode == "dense",
                              skip_tokenizer_init=True, random_seed=args.seed, max_running_requests=mem.max_running,
                              chunked_prefill_size=args.prefill_chunk, context_length=mem.context_length,
                              swa_ratio=0.1, config_overrides=overrides, attention_kernel=args.attention_kernel,
                              random_weights_on_device=torch.device(args.device).type == "cuda",
                              disable_overlap_schedule=args.disable_overlap_schedule)
    if mem.mem_fraction is not None:
        kw["mem_fraction_static"] = mem.mem_fraction
    else:   # the CPU: the same plan by its token count
        kw["max_total_tokens"] = plan_for(cfg, mode, mem).max_full_tokens
    return Engine(**kw)


def free_device_memory() -> None:
    """After the last reference to an engine is gone: collect cycles, return cached blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- measurements -------------------------------------------------------------------------------

def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def measure_decode(eng: Engine, row: DecodeRow, args: argparse.Namespace, guard: Guard,
                   breakdown: bool) -> None:
    """Admit ``row.batch`` synthetic requests, warm up, time decode steps, optionally split one."""
    bd_steps = args.breakdown_steps if breakdown else 0
    count = breakdown and args.kernel_count
    ab = getattr(args, "overlap_ab", False)      # callers' namespaces may lack it (bench_quant_model)
    max_new = args.warmup + args.steps + bd_steps + 3 * count + 4 + (args.steps + 1 if ab else 0)
    t0 = time.perf_counter()
    rids = admit_synthetic(eng, row.context, row.batch, max_new)
    try:
        sync(eng.device)
        row.admit_s = time.perf_counter() - t0
        row.held_bytes_per_request = kv_bytes_held(eng) // row.batch
        warm = timed_decode_steps(eng, args.warmup, row.batch) if args.warmup else None
        steps = args.steps
        if warm is not None:
            # time guard: as many timed steps as fit (at least 2), keeping a margin for what follows
            per_step = warm.seconds / max(warm.steps, 1)
            affordable = int((guard.left - args.guard_margin) / max(per_step, 1e-6)) - bd_steps
            if affordable < steps:
                steps = max(2, affordable)
                row.note = (row.note + "; " if row.note else "") + f"steps cut to {steps} by the time guard"
        graphs = getattr(eng.runner, "cuda_graphs", None)
        if graphs is not None:
            graphs.stats()
            graphs.reset_stats()
        overlapped = eng.scheduler.overlap.overlap_steps
        timing = timed_decode_steps(eng, steps, row.batch)
        row.steps, row.ms_per_step, row.tokens_per_s = steps, timing.ms_per_step, timing.tokens_per_s
        row.overlap_steps = eng.scheduler.overlap.overlap_steps - overlapped
        ov = eng.scheduler.overlap
        if ab and ov.enabled:
            # the same requests, synchronous steps: one step to drain the one in flight, then timed
            ov.enabled = False
            try:
                timed_decode_steps(eng, 1, row.batch)
                row.sync_ms_per_step = timed_decode_steps(eng, steps, row.batch).ms_per_step
            finally:
                ov.enabled = True
        if graphs is not None:
            st = graphs.stats()
            if st["replays"]:
                row.graph = st
        if bd_steps and guard.left > args.guard_margin:
            if getattr(eng.runner, "cuda_graphs", None) is not None:
                # graph steps: the GPU kernel time of eager steps under the profiler, by layer type
                with KernelBreakdown(eng) as kb:
                    for _ in range(bd_steps):
                        kb.step()
                row.breakdown = kb.breakdown(row.ms_per_step).to_dict()
                row.breakdown["kernel_ms"] = kb.kernel_ms()
                row.breakdown["top_kernels"] = kb.kernels(top=30)
            else:
                with LayerTimer(eng) as lt:
                    for _ in range(bd_steps):
                        lt.step()
                row.breakdown = lt.breakdown().to_dict()
        if count and guard.left > args.guard_margin:
            with KernelCounter(eng) as kc:
                kc.step()
            row.kernels = kernel_report(kc, 1)
            row.kernels["host_syncs"] = syncs_per_step(eng, 2)       # graph steps, as timed
        row.status = "ok"
    finally:
        finish_all(eng, rids)


def measure_prefill(eng: Engine, row: PrefillRow, max_seconds: float,
                    progress: Optional[Callable[[str], None]] = None) -> None:
    """A real chunked prefill of ``row.context`` random ids through the scheduler, for at most
    ``max_seconds``; records how far it got and the rates. An untimed prefill of two chunks of
    other ids runs first (a chunk without and one with a prefix: the kernels' first-use compiles,
    which a cold Triton cache makes take tens of seconds, stay out of the rate)."""
    sched = eng.scheduler
    row.chunk = sched.cfg.chunked_prefill_size
    t_warm = time.perf_counter()
    g = torch.Generator().manual_seed(row.context + 7)
    warm = GenerateRequest(torch.randint(0, eng.vocab_size, (min(row.context, 2 * row.chunk),), generator=g).tolist(),
                           SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
    sched.add(warm)
    try:
        for _ in range(64 + 4 * len(warm.input_ids) // max(1, row.chunk)):   # a few steps a chunk at most
            if warm.rid not in sched.reqs or sched.reqs[warm.rid].kv_len >= len(warm.input_ids):
                break
            eng.step()
        sync(eng.device)
    finally:
        eng.abort(warm.rid)
    row.warmup_seconds = time.perf_counter() - t_warm
    g = torch.Generator().manual_seed(row.context)
    ids = torch.randint(0, eng.vocab_size, (row.context,), generator=g).tolist()
    req = GenerateRequest(ids, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
    sched.add(req)
    done, steps, t_start = 0, 0, time.perf_counter()
    try:
        while True:
            sync(eng.device)
            t0 = time.perf_counter()
            eng.step()
            sync(eng.device)
            dt = time.perf_counter() - t0
            r = sched.reqs.get(req.rid)
            now = row.context if r is None else r.kv_len
            if now > done:
                row.last_chunk_tokens_per_s = (now - done) / dt
            done = now
            row.tokens_done, row.seconds = done, time.perf_counter() - t_start
            steps += 1
            if progress is not None and steps % 16 == 0:
                progress(f"  prefill {fmt_tokens(row.context)}: {done:,} tokens in {row.seconds:.1f} s "
                         f"(last chunk {row.last_chunk_tokens_per_s:,.0f} tok/s)")
            if r is None or done >= row.context:
                row.status = "complete"
                break
            if row.seconds >= max_seconds:
                row.status = "stopped (time budget)"
                row.note = (f"{done:,} of {row.context:,} tokens in {row.seconds:.1f} s, budget "
                            f"{max_seconds:.0f} s; not extrapolated")
                break
    finally:
        eng.abort(req.rid)
        eng.check_integrity()
    row.tokens_per_s = row.tokens_done / row.seconds if row.seconds else 0.0


def measure_mixed(eng: Engine, row: MixedRow, args: argparse.Namespace, max_seconds: float) -> None:
    """``row.decode_batch`` synthetic decodes of ``row.decode_context`` tokens: timed alone, then
    while a real prefill of ``row.prefill_context`` random ids runs chunk by chunk beside them (for
    at most ``max_seconds``); each step's wall time is one output token of every running decode.
    The scheduler runs under ``row.mixed_chunk_tokens`` for the measurement (restored after)."""
    if row.decode_batch + 1 > eng.scheduler.cfg.max_running_requests:
        row.status = "refused"
        row.note = (f"{row.decode_batch} decodes + the prefill exceed max_running_requests "
                    f"{eng.scheduler.cfg.max_running_requests}")
        return
    sched = eng.scheduler
    policy_was, sched.cfg.mixed_chunk_tokens = sched.cfg.mixed_chunk_tokens, row.mixed_chunk_tokens
    row.chunk = sched.cfg.prefill_budget(decoding=True)
    chunks = -(-row.prefill_context // row.chunk)
    rids = admit_synthetic(eng, row.decode_context, row.decode_batch, args.warmup + args.steps + chunks + 8)
    # ids of its own per policy: the prefix cache must not serve one row's prompt to the next
    g = torch.Generator().manual_seed(row.prefill_context + 1 + row.mixed_chunk_tokens)
    ids = torch.randint(0, eng.vocab_size, (row.prefill_context,), generator=g).tolist()
    req = GenerateRequest(ids, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
    try:
        if args.warmup:
            timed_decode_steps(eng, args.warmup, row.decode_batch)
        row.tpot_alone_ms = timed_decode_steps(eng, args.steps, row.decode_batch).ms_per_step
        sched.add(req)
        decoding, times, t_start = set(rids), [], time.perf_counter()
        while True:
            sync(eng.device)
            t0 = time.perf_counter()
            outs = eng.step()
            sync(eng.device)
            times.append(1e3 * (time.perf_counter() - t0))
            got = {o.rid for o in outs if o.delta_ids}
            row.stalled_steps += len(decoding - got) > 0
            r = sched.reqs.get(req.rid)
            row.prefill_tokens_done = row.prefill_context if r is None else r.kv_len
            row.prefill_s = time.perf_counter() - t_start
            if r is None or row.prefill_tokens_done >= row.prefill_context:
                row.status = "complete"
                row.ttft_s = row.prefill_s
                break
            if row.prefill_s >= max_seconds:
                row.status = "stopped (time budget)"
                row.note = f"{row.prefill_tokens_done:,} of {row.prefill_context:,} prompt tokens in {row.prefill_s:.1f} s"
                break
        ts = sorted(times)
        row.steps_mixed = len(ts)
        row.tpot_mixed_ms, row.tpot_mixed_p50_ms, row.tpot_mixed_max_ms = sum(ts) / len(ts), ts[len(ts) // 2], ts[-1]
    finally:
        eng.abort(req.rid)
        finish_all(eng, rids)
        sched.cfg.mixed_chunk_tokens = policy_was


# ---- the run ------------------------------------------------------------------------------------

def batch_plan(cfg: DSV4Config, mem: MemorySetup, ctx: int, headroom: int, modes: list[str]) -> dict[str, int]:
    """Largest batch each mode's plan holds at ``ctx`` (capped by max_running_requests)."""
    out = {}
    for mode in modes:
        try:
            fits = plan_for(cfg, mode, mem).requests_fit(ctx + headroom)
        except PlanError:
            fits = 0
        out[mode] = min(fits, mem.max_running)
    return out


def decode_rows(cfg: DSV4Config, mem: MemorySetup, args: argparse.Namespace, headroom: int) -> list[DecodeRow]:
    rows = []
    for ctx in args.contexts:
        fit = batch_plan(cfg, mem, ctx, headroom, args.modes)
        common = min(fit.values()) if len(fit) > 1 else 0
        for mode in args.modes:
            wanted: dict[int, str] = {}
            for b in args.batches:
                if b == "max":
                    wanted.setdefault(max(fit[mode], 1), "max")
                    if common >= 1 and common != fit[mode]:
                        wanted.setdefault(common, "common")
                    if mode == "dense" and fit.get("compressed", 0) > fit[mode]:
                        wanted.setdefault(fit["compressed"], "compressed max")
                else:
                    wanted.setdefault(int(b), str(b))
            for b, kind in sorted(wanted.items()):
                row = DecodeRow(mode, ctx, b, kind, "pending")
                try:
                    row.plan_bytes_per_request = plan_bytes_per_request(plan_for(cfg, mode, mem), ctx)
                except PlanError:
                    pass
                if b > fit[mode]:
                    plan_fit = plan_for(cfg, mode, mem).requests_fit(ctx + headroom)
                    row.status = "refused by plan"
                    row.note = (f"the {mode} plan holds {plan_fit} request(s) of {fmt_tokens(ctx)} "
                                f"({fmt_bytes(row.plan_bytes_per_request)} each)")
                rows.append(row)
    return rows


def run(args: argparse.Namespace) -> Report:
    from tqdm import tqdm

    device = torch.device(args.device)
    guard = Guard(args.time_budget)
    cfg = model_config(args)
    headroom = args.warmup + args.steps + args.breakdown_steps + 8
    mem = memory_setup(cfg, args, device, headroom)
    rep = Report()
    gbps = copy_gbps(device)
    rep.meta = {
        "preset": args.preset, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype, "attention_kernel": args.attention_kernel,
        "overlap_schedule": not args.disable_overlap_schedule, "torch": torch.__version__, "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv[1:],
        "layers": cfg.num_hidden_layers, "compress_ratios": list(cfg.layer_ratios),
        "n_routed_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "weight_bytes": weight_bytes(cfg, DTYPES[args.dtype]), "memory": mem.notes,
        "max_running_requests": mem.max_running, "context_length": mem.context_length,
        "copy_gbps": gbps, "floor_experts": EXPERTS_UNIFORM,
    }
    try:
        import triton
        rep.meta["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 (the CPU path does not need triton)
        pass
    say = lambda msg: (rep.log.append(msg), tqdm.write(msg, file=sys.stderr))  # noqa: E731
    say(f"model: {cfg.num_hidden_layers} layers {list(cfg.layer_ratios)}, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} heads, index_topk {cfg.index_topk}; MoE reduced to {cfg.n_routed_experts} routed "
        f"experts (top-{cfg.num_experts_per_tok}) + shared; weights {fmt_bytes(rep.meta['weight_bytes'])} "
        f"{args.dtype}, random, drawn on {device.type}")
    for n in mem.notes:
        say(n)
    say(f"copy bandwidth {gbps:.0f} GB/s (read + write, a device-to-device copy): the floors' divisor")
    for mode in args.modes:
        p = plan_for(cfg, mode, mem)
        rep.plans[mode] = {"table": p.table(), "bytes_per_full_token": p.bytes_per_full_token,
                           "max_full_tokens": p.max_full_tokens, "total_bytes": p.total_bytes,
                           "requests_fit": {fmt_tokens(c): p.requests_fit(c + headroom) for c in args.contexts}}
        say(f"\n[{mode}] " + p.table())

    drows = decode_rows(cfg, mem, args, headroom)
    rep.decode = drows
    long_ctx = args.prefill_long if args.prefill_long and args.prefill_long not in args.prefill_contexts else 0
    prefill_ctxs = [c for c in args.prefill_contexts if c <= mem.context_length] + ([long_ctx] if long_ctx else [])
    prows = [PrefillRow("compressed", c, "pending") for c in prefill_ctxs if "compressed" in args.modes]
    if args.dense_prefill and "dense" in args.modes:
        prows += [PrefillRow("dense", c, "pending") for c in args.prefill_contexts]
    rep.prefill = prows
    if args.mixed_prefill and "compressed" in args.modes:
        # before: the prefill chunk shares the step whole (mixed_chunk_tokens 0); after: capped
        rep.mixed = [MixedRow(args.mixed_decode_context, args.mixed_decode_batch, args.mixed_prefill, "pending", cap)
                     for cap in dict.fromkeys([0, args.mixed_chunk_tokens])]
    todo = [r for r in drows if r.status == "pending"]
    if args.dry_run:
        say("\ndry run: would measure")
        for r in drows:
            say(f"  decode {r.mode} {fmt_tokens(r.context)} x {r.batch} ({r.batch_kind}): {r.status}"
                + (f" ({r.note})" if r.note else ""))
        for p in prows:
            say(f"  prefill {p.mode} {fmt_tokens(p.context)}"
                + (f" (attempt, {args.prefill_max_seconds:.0f} s budget)" if p.context == long_ctx else ""))
        return rep
    bar = tqdm(total=len(todo) + len(prows), desc="long-context bench", unit="run",
               disable=args.no_progress, file=sys.stderr)

    def save() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(rep.to_json(), indent=2))

    # dense first, within its share of the budget; the compressed phase ends with the long prefill
    order = [m for m in ("dense", "compressed") if m in args.modes]
    for mode in order:
        phase_end = (START + args.time_budget * args.dense_share) if (mode == "dense" and len(order) > 1) \
            else (START + args.time_budget)
        mine = [r for r in todo if r.mode == mode]
        mine_prefill = [r for r in prows if r.mode == mode]
        if not mine and not mine_prefill:
            continue
        eng = None
        try:
            say(f"\nbuilding the {mode} engine ({guard.elapsed:.0f} s elapsed)")
            t0 = time.perf_counter()
            eng = build_engine(cfg, mode, mem, args)
            sync(device)
            say(f"  built in {time.perf_counter() - t0:.1f} s, backend {eng.runner.backend_name} "
                f"({eng.runner.attention_kernel_reason}), pools "
                f"{fmt_bytes(eng.plan.total_bytes)}, max_total_tokens {eng.max_total_tokens:,}, overlap schedule "
                f"{'on' if eng.scheduler.overlap.enabled else 'off (' + str(eng.scheduler.overlap.off_reason) + ')'}")
            for row in mine:
                bar.set_postfix_str(f"{mode} {fmt_tokens(row.context)} x {row.batch}")
                row.floor = decode_step_floor(cfg, row.context, row.batch, DTYPES[args.dtype],
                                              eng.runner.model.quantized, mode == "dense").to_dict(gbps)
                if time.time() > phase_end - args.guard_margin or guard.left < args.guard_margin:
                    row.status = "skipped (time guard)"
                    row.note = f"{guard.elapsed:.0f} s elapsed of {args.time_budget:.0f}"
                else:
                    try:
                        measure_decode(eng, row, args, guard, row.context in args.breakdown_contexts
                                       and row.batch <= args.breakdown_max_batch)
                    except Exception as e:  # noqa: BLE001 (recorded as a fact, the run goes on)
                        row.status, row.note = ("OOM" if is_oom(e) else "error"), f"{type(e).__name__}: {e}"[:300]
                        if is_oom(e):
                            torch.cuda.empty_cache()
                say(f"decode {mode:<10} {fmt_tokens(row.context):>5} x {row.batch:<4} ({row.batch_kind}): "
                    + (f"{row.ms_per_step:9.2f} ms/step {row.tokens_per_s:10.1f} tok/s"
                       if row.status == "ok" else row.status)
                    + (f"  floor {row.floor_ms:.2f} ms = {row.floor['weight_bytes'] / 1e9:.2f} GB weights + "
                       f"{row.floor['kv_bytes'] / 1e9:.3f} GB KV ({row.x_floor:.1f}x)" if row.x_floor else "")
                    + (f"  [{row.note}]" if row.note else "")
                    + (f"  (overlap {row.overlap_steps}/{row.steps} steps)" if row.status == "ok" else "")
                    + (f"  synchronous steps {row.sync_ms_per_step:.2f} ms/step "
                       f"(overlap / synchronous {row.ms_per_step / row.sync_ms_per_step:.2f})"
                       if row.sync_ms_per_step else "")
                    + (f"  ({graph_timing_text(row.graph)})" if row.graph else ""))
                if (args.timeline and row.status == "ok" and device.type == "cuda" and mode == "compressed"
                        and guard.left > args.guard_margin + 10):
                    from bench.step_timeline import print_timeline, profile_steps
                    row.timeline = profile_steps(eng, row.context, row.batch, args.timeline)
                    print_timeline(row.timeline)
                if row.breakdown:
                    say(breakdown_text(row, "  "))
                if row.kernels:
                    say(kernel_text(row.kernels, names=False))
                bar.update(1)
                save()
            for mrow in (rep.mixed if mode == "compressed" else []):
                left = phase_end - time.time() - args.guard_margin
                if left < 1:
                    mrow.status = "skipped (time guard)"
                else:
                    try:
                        measure_mixed(eng, mrow, args, min(args.mixed_max_seconds, left))
                    except Exception as e:  # noqa: BLE001
                        mrow.status, mrow.note = ("OOM" if is_oom(e) else "error"), f"{type(e).__name__}: {e}"[:300]
                say(mixed_text(mrow))
                save()
            for prow in mine_prefill:
                bar.set_postfix_str(f"prefill {mode} {fmt_tokens(prow.context)}")
                left = phase_end - time.time() - args.guard_margin
                # the long attempt has its own budget; the others run to completion unless the guard stops them
                budget = min(args.prefill_max_seconds, left) if prow.context == long_ctx else left
                if left < 1:
                    prow.status = "skipped (time guard)"
                else:
                    try:
                        measure_prefill(eng, prow, budget, progress=say)
                    except Exception as e:  # noqa: BLE001
                        prow.status, prow.note = ("OOM" if is_oom(e) else "error"), f"{type(e).__name__}: {e}"[:300]
                say(f"prefill {mode:<10} {fmt_tokens(prow.context):>5}: {prow.status}, {prow.tokens_done:,} tokens "
                    f"in {prow.seconds:.1f} s = {prow.tokens_per_s:,.0f} tok/s (last chunk "
                    f"{prow.last_chunk_tokens_per_s:,.0f} tok/s)" + (f"  [{prow.note}]" if prow.note else ""))
                bar.update(1)
                save()
        except Exception as e:  # noqa: BLE001 (an engine that cannot be built is a fact too)
            say(f"the {mode} engine failed: {type(e).__name__}: {e}")
            for row in mine:
                if row.status == "pending":
                    row.status, row.note = ("OOM" if is_oom(e) else "error"), f"{type(e).__name__}: {e}"[:300]
            for prow in mine_prefill:
                if prow.status == "pending":
                    prow.status, prow.note = ("OOM" if is_oom(e) else "error"), f"{type(e).__name__}: {e}"[:300]
        finally:
            if eng is not None:
                eng.shutdown()
            eng = None          # the last reference: the pools and weights go before the next build
            free_device_memory()
    bar.close()
    rep.summary = summarize(rep, args)
    rep.meta["wall_s"] = guard.elapsed
    save()
    return rep


# ---- reporting ----------------------------------------------------------------------------------

def breakdown_text(r: DecodeRow, indent: str = "") -> str:
    b = r.breakdown
    title = f"{indent}{r.mode}, {fmt_tokens(r.context)} x {r.batch}"
    if "kernel_ms" in b:
        replay = f"graph replay {r.graph['replay_gpu_ms']:.2f} ms GPU; " if r.graph else ""
        title += (f" (graph step {b['step_ms']:.2f} ms; {replay}GPU kernels of an eager step under the "
                  f"profiler {b['kernel_ms']:.2f} ms; 'sampling + scheduling' = step - kernels)")
    floors = None
    if r.floor:
        per_ms = r.floor["floor_ms"] / r.floor["total_bytes"]
        floors = {k: v * per_ms for k, v in r.floor["categories"].items()}
        floors["indexer_topk"] = r.floor["parts"]["indexer_rows"] * per_ms   # the scan, inside attn_csa
        title += f"; byte floor {r.floor['floor_ms']:.2f} ms at {r.floor['copy_gbps']:.0f} GB/s"
    lines = [Breakdown(b["steps"], b["step_ms"], b["ms"]).table(title + ":", floors)]
    for name, ms in b.get("top_kernels", [])[:10]:
        lines.append(f"{indent}    {ms:8.3f} ms  {name}")
    return "\n".join(lines)


def mixed_text(r: MixedRow) -> str:
    policy = (f"mixed_chunk_tokens {r.mixed_chunk_tokens}" if r.mixed_chunk_tokens
              else "mixed_chunk_tokens 0 (the old policy: the whole chunk)")
    head = (f"mixed, {policy}: {r.decode_batch} decodes of {fmt_tokens(r.decode_context)} while "
            f"{fmt_tokens(r.prefill_context)} prefills ({r.chunk}-token chunks beside them): {r.status}")
    if r.status not in ("complete", "stopped (time budget)"):
        return head + (f" ({r.note})" if r.note else "")
    ttft = f"TTFT of the long prompt {r.ttft_s:.1f} s" if r.ttft_s else "no TTFT (prefill not finished)"
    return (head + f"; TPOT alone {r.tpot_alone_ms:.2f} ms, during the prefill mean {r.tpot_mixed_ms:.2f} / p50 "
            f"{r.tpot_mixed_p50_ms:.2f} / max {r.tpot_mixed_max_ms:.2f} ms over {r.steps_mixed} steps "
            f"({r.tpot_mixed_ms / r.tpot_alone_ms:.1f}x); steps where a decode got no token: {r.stalled_steps}; "
            f"{r.prefill_tokens_done:,} prompt tokens in {r.prefill_s:.1f} s; {ttft}" + (f" [{r.note}]" if r.note else ""))


def mixed_table(rows: list[MixedRow]) -> str:
    """Before / after side by side: the running decodes' TPOT and the long prompt's TTFT per policy."""
    lines = ["| mixed_chunk_tokens | chunk beside decodes | TPOT alone ms | TPOT mean ms | p50 | max | x alone | "
             "TTFT s | status |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = r.status in ("complete", "stopped (time budget)") and r.tpot_alone_ms
        cells = ([f"{r.tpot_alone_ms:.2f}", f"{r.tpot_mixed_ms:.2f}", f"{r.tpot_mixed_p50_ms:.2f}",
                  f"{r.tpot_mixed_max_ms:.2f}", f"{r.tpot_mixed_ms / r.tpot_alone_ms:.1f}",
                  f"{r.ttft_s:.1f}" if r.ttft_s else "-"] if ok else ["-"] * 6)
        lines.append(f"| {r.mixed_chunk_tokens or '0 (old)'} | {r.chunk} | " + " | ".join(cells) + f" | {r.status} |")
    return "\n".join(lines)


def floor_gb(r: DecodeRow) -> str:
    if not r.floor:
        return "-"
    return f"{r.floor['weight_bytes'] / 1e9:.2f} + {r.floor['kv_bytes'] / 1e9:.3f}"


def decode_table(rows: list[DecodeRow]) -> str:
    head = ("| mode | context | batch | ms / step | tokens / s | floor GB (weights + KV) | floor ms | x floor | "
            "graph GPU ms | plan bytes / request | held / request | status |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = r.status == "ok"
        gpu = f"{r.graph['replay_gpu_ms']:.2f}" if r.graph else "-"
        lines.append(f"| {r.mode} | {fmt_tokens(r.context)} | {r.batch} ({r.batch_kind}) | "
                     f"{f'{r.ms_per_step:.2f}' if ok else '-'} | {f'{r.tokens_per_s:.1f}' if ok else '-'} | "
                     f"{floor_gb(r)} | {f'{r.floor_ms:.2f}' if r.floor else '-'} | "
                     f"{f'{r.x_floor:.2f}' if r.x_floor else '-'} | {gpu} | "
                     f"{fmt_bytes(r.plan_bytes_per_request) if r.plan_bytes_per_request else '-'} | "
                     f"{fmt_bytes(r.held_bytes_per_request) if r.held_bytes_per_request else '-'} | "
                     f"{r.status}{': ' + r.note if r.note else ''} |")
    return "\n".join(lines)


def prefill_table(rows: list[PrefillRow]) -> str:
    lines = ["| mode | context | chunk | tokens done | seconds | tokens / s | last chunk tokens / s | status |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.mode} | {fmt_tokens(r.context)} | {r.chunk} | {r.tokens_done:,} | {r.seconds:.1f} | "
                     f"{r.tokens_per_s:,.0f} | {r.last_chunk_tokens_per_s:,.0f} | "
                     f"{r.status}{': ' + r.note if r.note else ''} |")
    return "\n".join(lines)


def _find(rows: list[DecodeRow], mode: str, ctx: int, kind: Optional[str] = None,
          batch: Optional[int] = None) -> Optional[DecodeRow]:
    for r in rows:
        if r.mode == mode and r.context == ctx and (kind is None or r.batch_kind == kind) \
                and (batch is None or r.batch == batch):
            return r
    return None


def summarize(rep: Report, args: argparse.Namespace) -> list[str]:
    out = []
    rows = rep.decode
    lo, hi = min(args.contexts), max(args.contexts)
    a, b = _find(rows, "compressed", hi, batch=1), _find(rows, "compressed", lo, batch=1)
    if a and b and a.status == b.status == "ok":
        ratio = a.tokens_per_s / b.tokens_per_s
        verdict = "met" if ratio >= 0.8 else f"MISSED by {100 * (0.8 - ratio):.0f} points"
        out.append(f"decode at {fmt_tokens(hi)} vs {fmt_tokens(lo)}, batch 1 (compressed): {a.tokens_per_s:.1f} / "
                   f"{b.tokens_per_s:.1f} tok/s = {100 * ratio:.0f}% (target >= 80%: {verdict})")
    else:
        out.append(f"decode {fmt_tokens(hi)} vs {fmt_tokens(lo)} at batch 1: not measured "
                   f"({a.status if a else 'absent'} / {b.status if b else 'absent'})")
    mid = 131072 if 131072 in args.contexts else None
    if mid and "dense" in args.modes:
        d_ok = [r for r in rows if r.mode == "dense" and r.context == mid and r.status == "ok"]
        pairs = [(d, _find(rows, "compressed", mid, batch=d.batch)) for d in d_ok]
        pairs = [(d, c) for d, c in pairs if c is not None and c.status == "ok"]
        if pairs:
            d, c = max(pairs, key=lambda p: p[0].batch)
            sp = c.tokens_per_s / d.tokens_per_s
            verdict = "met" if sp >= 4 else f"MISSED: {sp:.2f}x of 4x"
            out.append(f"128K at batch {d.batch} (largest both measured): compressed {c.tokens_per_s:.1f} vs dense "
                       f"{d.tokens_per_s:.1f} tok/s = {sp:.2f}x (target >= 4x: {verdict})")
        else:
            out.append("128K compressed vs dense: no batch measured in both modes")
    if "dense" in args.modes:
        c_max = [r for r in rows if r.mode == "compressed" and r.context == hi and r.status == "ok"]
        d_all = [r for r in rows if r.mode == "dense" and r.context == hi]
        if c_max:
            cm = max(c_max, key=lambda r: r.batch)
            d_ok = [r.batch for r in d_all if r.status == "ok"]
            d_no = [f"batch {r.batch}: {r.status}" + (f" ({r.note})" if r.note else "")
                    for r in d_all if r.status != "ok"]
            out.append(f"{fmt_tokens(hi)}: compressed decodes at batch {cm.batch} ({cm.tokens_per_s:.1f} tok/s); dense "
                       + (f"runs at batch {', '.join(map(str, d_ok))}" if d_ok else "does not run")
                       + (f"; dense {'; '.join(d_no)}" if d_no else ""))
    for r in rows:
        if r.breakdown and r.mode == "compressed" and r.context == hi:
            ms = r.breakdown["ms"]
            top = max((k for k in ms if k != "indexer_topk"), key=lambda k: ms[k])
            idx = ms.get("indexer_topk")
            out.append(f"{fmt_tokens(hi)} x {r.batch} compressed: largest part {top} "
                       f"({r.breakdown['pct'][top]:.0f}% of the step)"
                       + (f"; CSA top-k selection (indexer scan) {r.breakdown['pct']['indexer_topk']:.0f}%"
                          if idx is not None else ""))
    for r in rows:
        if r.mode == "compressed" and r.batch == 1 and r.context in (lo, hi) and r.x_floor:
            verdict = "met" if r.x_floor <= 2 else "MISSED"
            out.append(f"{fmt_tokens(r.context)} x 1 compressed: step {r.ms_per_step:.2f} ms = {r.x_floor:.2f}x its "
                       f"byte floor {r.floor_ms:.2f} ms (target <= 2x: {verdict})")
    for p in rep.prefill:
        if p.context == args.prefill_long:
            out.append(f"{fmt_tokens(p.context)} chunked prefill ({p.mode}): {p.status}, {p.tokens_done:,} tokens in "
                       f"{p.seconds:.1f} s ({p.tokens_per_s:,.0f} tok/s; last chunk {p.last_chunk_tokens_per_s:,.0f} "
                       "tok/s)")
    skipped = [r for r in rows if r.status.startswith("skipped")] + \
              [p for p in rep.prefill if p.status.startswith("skipped")]
    if skipped:
        out.append(f"{len(skipped)} measurement(s) skipped by the time guard (see the tables)")
    return out


def plot(rep: Report, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    styles = {"compressed": "-", "dense": "--"}
    for mode in MODES:
        for kind, marker in (("1", "o"), ("max", "s")):
            pts = sorted((r.context, r.tokens_per_s, r.batch) for r in rep.decode
                         if r.mode == mode and r.status == "ok" and (r.batch_kind == kind
                                                                      or (kind == "1" and r.batch == 1)))
            pts = list({c: (c, t, b) for c, t, b in pts}.values())
            if not pts:
                continue
            label = f"{mode}, batch {'1' if kind == '1' else 'max (plan)'}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[mode] + marker, label=label)
            if kind == "max":
                for c, t, b in pts:
                    ax.annotate(str(b), (c, t), textcoords="offset points", xytext=(4, 4), fontsize=7)
    refused = sorted({r.context for r in rep.decode if r.mode == "dense" and r.batch_kind == "max"
                      and r.status != "ok"})
    for c in refused:
        ax.axvline(c, color="grey", lw=0.8, ls=":")
        ax.annotate("dense: plan refuses", (c, 0.02), xycoords=("data", "axes fraction"), rotation=90,
                    fontsize=7, color="grey", ha="right")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens / s")
    ctxs = sorted({r.context for r in rep.decode})
    ax.set_xticks(ctxs, [fmt_tokens(c) for c in ctxs])
    ax.set_title(f"DSV4 decode through the Engine, {rep.meta.get('device')} ({rep.meta.get('layers')} layers, "
                 f"{rep.meta.get('n_routed_experts')} experts, {rep.meta.get('dtype')})\nnumbers: batch size",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- command line -------------------------------------------------------------------------------

def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _batches(s: str) -> list[Any]:
    return [x if x == "max" else int(x) for x in s.split(",") if x]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash", choices=["flash", "pro", "tiny"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                    help="default bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--experts", type=int, default=None,
                    help="routed experts of the stand-in MoE (default 8 for flash/pro, the preset's for tiny)")
    ap.add_argument("--contexts", type=_ints, default=[4096, 32768, 131072, 524288, 1048576])
    ap.add_argument("--batches", type=_batches, default=[1, "max"], help="ints and/or 'max' (default 1,max)")
    ap.add_argument("--modes", type=lambda s: [m for m in s.split(",") if m], default=list(MODES))
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per configuration")
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps first (Triton compiles here)")
    ap.add_argument("--breakdown-contexts", type=_ints, default=[131072, 1048576])
    ap.add_argument("--breakdown-steps", type=int, default=2)
    ap.add_argument("--breakdown-max-batch", type=int, default=1 << 30,
                    help="break down (and count kernels of) only rows of at most this batch")
    ap.add_argument("--timeline", type=int, default=0, metavar="STEPS",
                    help="after each compressed decode row, profile STEPS more steps: GPU time in and out of the "
                         "graph, the graph's kernels by name, idle gaps (bench/step_timeline.py)")
    ap.add_argument("--kernel-count", action="store_true",
                    help="at --breakdown-contexts also count kernels per layer (bench/kernel_count.py)")
    ap.add_argument("--prefill-contexts", type=_ints, default=None,
                    help="real chunked prefills timed to completion (default 4K,32K,128K up to the largest context)")
    ap.add_argument("--prefill-long", type=int, default=None,
                    help="a prefill attempted under --prefill-max-seconds (default: the largest context; 0: none)")
    ap.add_argument("--prefill-max-seconds", type=float, default=60.0,
                    help="time budget of the --prefill-long attempt (the others are bounded by the run's guard)")
    ap.add_argument("--prefill-chunk", type=int, default=8192, help="chunked_prefill_size")
    ap.add_argument("--mixed-prefill", type=int, default=0,
                    help="prompt length of a prefill run beside running decodes, to time their TPOT (0: none)")
    ap.add_argument("--mixed-decode-context", type=int, default=4096, help="context of those decodes")
    ap.add_argument("--mixed-decode-batch", type=int, default=8, help="how many decodes run beside the prefill")
    ap.add_argument("--mixed-max-seconds", type=float, default=120.0, help="time limit of each mixed prefill")
    ap.add_argument("--mixed-chunk-tokens", type=int, default=DEFAULT_MIXED_CHUNK_TOKENS,
                    help="the capped policy timed after the old one (0 first: the whole chunk beside the decodes)")
    ap.add_argument("--dense-prefill", action="store_true", help="also time the dense mode's prefills")
    ap.add_argument("--max-batch", type=int, default=None,
                    help="cap on the batch (max_running_requests; default 256 on CUDA, 16 on the CPU)")
    ap.add_argument("--mem-fraction", type=float, default=0.92,
                    help="of device memory: 2 x weights + request tables + reserve + pools (CUDA)")
    ap.add_argument("--reserve-gb", type=float, default=14.0, help="activation reserve outside the pools (CUDA)")
    ap.add_argument("--cpu-pool-tokens", type=int, default=0, help="pool size in full tokens on the CPU")
    ap.add_argument("--time-budget", type=float, default=510.0, help="seconds for the whole run, builds included")
    ap.add_argument("--dense-share", type=float, default=0.4, help="share of the budget the dense phase may use")
    ap.add_argument("--guard-margin", type=float, default=15.0, help="seconds kept free after each measurement")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU runs)")
    ap.add_argument("--attention-kernel", type=lambda v: [k for k in v.split(",") if k], default=["auto"],
                    help="auto, flashmla, triton, or a comma list run one after the other (default auto)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--disable-overlap-schedule", action="store_true",
                    help="synchronous steps: read each step's sampled ids before scheduling the next "
                         "(default: the overlap schedule, as the engine's)")
    ap.add_argument("--overlap-ab", action="store_true",
                    help="time each decode row again with synchronous steps, same engine and requests")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="print the memory setup, plans and runs; measure nothing")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args(argv)
    cuda = model_defaults(args)
    args.max_batch = args.max_batch or (256 if cuda else 16)
    if args.prefill_contexts is None:
        args.prefill_contexts = [c for c in (4096, 32768, 131072) if c <= max(args.contexts)]
    if args.prefill_long is None:
        args.prefill_long = max(args.contexts)
    bad_kernels = [k for k in args.attention_kernel if k not in ("auto", "flashmla", "triton")]
    if bad_kernels or not args.attention_kernel:
        ap.error(f"unknown attention kernel(s) {bad_kernels}; choose from auto, flashmla, triton")
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; choose from {list(MODES)}")
    return args


def main(argv: Optional[list[str]] = None) -> Report:
    global START
    args = parse_args(argv)
    if torch.device(args.device).type == "cpu":
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("scheduler_hooks.engine").setLevel(logging.ERROR)
    kernels, out, plot_path, budget = args.attention_kernel, args.out, args.plot, args.time_budget
    reports = {}
    for kernel in kernels:
        if len(kernels) > 1:
            print(f"\n# attention kernel: {kernel}\n", flush=True)
            args.out = out.with_suffix(f".{kernel}{out.suffix}") if out else None
            args.plot = plot_path.with_suffix(f".{kernel}{plot_path.suffix}") if plot_path else None
        # each kernel's run: an equal share of the budget, its guard counted from its own start
        START = time.time()
        args.time_budget = budget / len(kernels)
        args.attention_kernel = kernel
        rep = reports[kernel] = run(args)
        report_text(rep, args)
    args.attention_kernel, args.out, args.plot, args.time_budget = kernels, out, plot_path, budget
    if len(kernels) > 1:
        print("\n## kernels side by side\n")
        print(kernels_table(reports))
    return rep


def kernels_table(reports: dict[str, Report]) -> str:
    """Decode tokens/s of each kernel's run per (mode, context, batch), the ratio of the first two,
    and the attention share of the step where the breakdown ran (window-only + CSA + HCA rows)."""
    names = list(reports)
    keyed = {k: {(r.mode, r.context, r.batch): r for r in rep.decode} for k, rep in reports.items()}
    keys = sorted({key for rows in keyed.values() for key in rows}, key=lambda t: (t[0], t[1], t[2]))
    head = "| mode | context | batch | " + " | ".join(f"{k} tok/s | {k} attention share" for k in names)
    head += f" | {names[0]} / {names[1]} |" if len(names) > 1 else " |"
    lines = [head, "|" + "---|" * (3 + 2 * len(names) + (len(names) > 1))]
    for key in keys:
        cells, tps = [], []
        for k in names:
            r = keyed[k].get(key)
            ok = r is not None and r.status == "ok"
            tps.append(r.tokens_per_s if ok else None)
            cells += [f"{r.tokens_per_s:.1f}" if ok else (r.status if r else "-"), attention_share(r)]
        ratio = f" | {tps[0] / tps[1]:.2f}" if len(names) > 1 and tps[0] and tps[1] else (" | -" if len(names) > 1 else "")
        lines.append(f"| {key[0]} | {fmt_tokens(key[1])} | {key[2]} | " + " | ".join(cells) + ratio + " |")
    return "\n".join(lines)


def attention_share(row: Optional[DecodeRow]) -> str:
    """The breakdown's attention categories (``attn_*``: window-only, CSA incl. indexer, HCA) as a
    share of the step."""
    pct = (row.breakdown or {}).get("pct") if row is not None else None
    if not pct:
        return "-"
    return f"{sum(v for k, v in pct.items() if k.startswith('attn_')):.0f}%"


def report_text(rep: Report, args: argparse.Namespace) -> None:
    print("\n## decode (synthetic contexts)\n")
    print(decode_table(rep.decode))
    print("\n## prefill (real, chunked)\n")
    print(prefill_table(rep.prefill))
    bds = [r for r in rep.decode if r.breakdown]
    if bds:
        print("\n## per-layer-type breakdown\n")
        for r in bds:
            print(breakdown_text(r))
    counted = [r for r in rep.decode if r.kernels]
    if counted:
        print("\n## kernels per layer (one eager decode step)\n")
        for r in counted:
            print(f"{r.mode}, {fmt_tokens(r.context)} x {r.batch}: " + kernel_text(r.kernels, names=r is counted[0]))
    if rep.mixed:
        print("\n## decodes beside a prefill\n")
        for r in rep.mixed:
            print(mixed_text(r))
        print("\n" + mixed_table(rep.mixed))
    print("\n## targets\n")
    for line in rep.summary:
        print("- " + line)
    if args.plot:
        plot(rep, args.plot)
        print(f"\nwrote {args.plot}")
    if args.out:
        print(f"wrote {args.out}")
    print(f"total wall time {time.time() - START:.0f} s", flush=True)


if __name__ == "__main__":
    main()
