"""Where a decode step's wall time goes on the GPU: graph kernels, eager kernels, copies, idle.

At batch 1 the quantised 28-layer step was 7.79 ms of which its CUDA graph's replay took 6.98 ms of
GPU time (docs/PERF.md, session 11): this finds out what the rest is. It runs decode steps of an
engine (graphs on, the overlap schedule as configured) under ``torch.profiler``, exports the trace
and classifies every GPU activity by the runtime call that launched it (kineto's correlation ids):
a ``cudaGraphLaunch`` -> the graph; any other launch -> an eager kernel; copies and memsets by
their category. Reported per step: the wall time, GPU busy time by class, the idle time, the eager
kernels and copies by name, the graph's kernels by name, and the largest idle gaps with the activities on either side.

    from step_timeline import profile_steps
    report = profile_steps(eng, context=4096, batch=1, steps=6)
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch

from dsv4_backend.kernels import pdl

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def summarize(trace: dict[str, Any], steps: int, wall_s: float, top: int = 12) -> dict[str, Any]:
    """The chrome trace of ``steps`` profiled steps taking ``wall_s`` -> per-step figures (ms)."""
    events = trace.get("traceEvents", [])
    launched_by = {}
    for e in events:
        corr = (e.get("args") or {}).get("correlation")
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and corr is not None:
            launched_by[corr] = e.get("name", "")
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES and "dur" in e), key=lambda e: e["ts"])
    busy = defaultdict(float)
    count = defaultdict(int)
    eager_names: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    graph_names: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    added: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])   # graph kernels: span they add
    by_launch: dict[Any, list[tuple[str, float, float, float]]] = defaultdict(list)   # a replay's kernels
    gaps: list[tuple[float, str, str]] = []
    end, last = None, ""
    for e in gpu:
        corr = (e.get("args") or {}).get("correlation")
        if e["cat"] == "kernel":
            kind = "graph" if launched_by.get(corr, "").startswith("cudaGraphLaunch") else "eager_kernel"
        else:
            kind = "memcpy" if e["cat"] == "gpu_memcpy" else "memset"
        busy[kind] += e["dur"]
        count[kind] += 1
        n = graph_names[e.get("name", "?")[:90]] if kind == "graph" else eager_names[f"{kind}: {e.get('name', '?')[:90]}"]
        n[0] += 1
        n[1] += e["dur"]
        if end is not None and e["ts"] > end:
            gaps.append((e["ts"] - end, last, e.get("name", "?")[:60]))
        if kind == "graph":   # how far this kernel pushes the GPU's end of work (idle before it included)
            a = added[e.get("name", "?")[:90]]
            a[0] += 1
            push = max(0.0, e["ts"] + e["dur"] - (e["ts"] if end is None else end))
            a[1] += push
            by_launch[corr].append((e.get("name", "?")[:60], e["ts"], e["dur"], push))
        end = max(end or e["ts"], e["ts"] + e["dur"])
        last = e.get("name", "?")[:60]
    span = (end - gpu[0]["ts"]) if gpu else 0.0
    idle = sum(g for g, _, _ in gaps)
    per = max(steps, 1) * 1e3   # us over all steps -> ms per step
    return {
        "steps": steps,
        "wall_ms_per_step": wall_s * 1e3 / max(steps, 1),
        "gpu_span_ms_per_step": span / per,
        "busy_ms_per_step": {k: v / per for k, v in busy.items()},
        "activities_per_step": {k: v / max(steps, 1) for k, v in count.items()},
        "idle_ms_per_step": idle / per,
        "idle_gaps_over_5us_per_step": sum(1 for g, _, _ in gaps if g > 5) / max(steps, 1),
        "largest_gaps_us": [(round(g, 1), a, b) for g, a, b in sorted(gaps, reverse=True)[:top]],
        "outside_graph_by_name": _by_time(eager_names, steps, top),
        "graph_kernels_by_name": _by_time(graph_names, steps, len(graph_names)),   # all: which launch is whose
        # what each graph kernel adds to the span (its end past every earlier activity's): these sum to
        # the graph's share of the span and, unlike the durations, do not overlap under PDL
        "graph_kernels_by_added_span": _by_time(added, steps, len(added)),
        "classified": bool(launched_by),
        # the last replay's kernels in order: (name, start us from the replay's first kernel, duration, span added)
        "last_replay_sequence": _sequence(by_launch),
    }


def _sequence(by_launch: dict[Any, list[tuple[str, float, float, float]]]) -> list[tuple[str, float, float, float]]:
    if not by_launch:
        return []
    kernels = max(by_launch.values(), key=lambda ks: ks[0][1])   # the replay that started last
    t0 = kernels[0][1]
    return [(name, round(ts - t0, 2), round(dur, 2), round(push, 2)) for name, ts, dur, push in kernels]


def _by_time(names: dict[str, list[float]], steps: int, top: int) -> list[tuple[str, float, float]]:
    """(name, launches per step, ms per step), the most time first."""
    rows = ((name, n / max(steps, 1), t / (max(steps, 1) * 1e3)) for name, (n, t) in names.items())
    return sorted(rows, key=lambda r: -r[2])[:top]


def profile_steps(eng: Any, context: int, batch: int, steps: int = 6, warmup: int = 3) -> dict[str, Any]:
    """Admit ``batch`` synthetic requests of ``context`` tokens, run ``warmup`` steps, then profile
    ``steps`` steps; the requests are finished afterwards."""
    from bench._bench_common import admit_synthetic, finish_all
    from torch.profiler import ProfilerActivity, profile

    rids = admit_synthetic(eng, context, batch, warmup + steps + 4)
    path = os.path.join(tempfile.mkdtemp(prefix="dsv4_timeline_"), "trace.json")
    try:
        for _ in range(warmup):
            eng.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        finish_all(eng, rids)
    return summarize(trace, steps, wall)


# Under PDL (dsv4_backend/kernels/pdl.py) a kernel starts before the one it follows has finished and
# waits: the profiler's durations then overlap, and only the GPU span is the step's cost.
_PDL_NOTE = " (PDL on: each duration includes its wait for the kernel before, so they overlap)"


def print_sequence(rep: dict[str, Any], first: int = 0, count: int = 120, indent: str = "  ") -> None:
    """Kernels ``first .. first + count - 1`` of the last profiled replay, in launch order."""
    seq = rep.get("last_replay_sequence", [])
    print(f"{indent}the last replay's kernels {first}..{min(len(seq), first + count) - 1} of {len(seq)} "
          "(start us, duration us, span added us):")
    for i, (name, start, dur, push) in enumerate(seq[first:first + count], first):
        print(f"{indent}  {i:4d} {start:9.2f} {dur:8.2f} {push:7.2f}  {name}")


def print_timeline(rep: dict[str, Any], indent: str = "  ") -> None:
    busy = rep["busy_ms_per_step"]
    acts = rep["activities_per_step"]
    print(f"{indent}step timeline ({rep['steps']} profiled steps{'' if rep['classified'] else ', launches not classified'}): "
          f"wall {rep['wall_ms_per_step']:.2f} ms/step, GPU span {rep['gpu_span_ms_per_step']:.2f}, idle "
          f"{rep['idle_ms_per_step']:.3f} ms in {rep['idle_gaps_over_5us_per_step']:.1f} gaps > 5 us")
    print(f"{indent}  busy per step: " + ", ".join(f"{k} {v:.3f} ms ({acts.get(k, 0):.0f})" for k, v in sorted(busy.items())))
    print(f"{indent}  graph kernels by name, per step{_PDL_NOTE if pdl.ENABLED else ''}:")
    for name, n, ms in rep.get("graph_kernels_by_name", []):
        print(f"{indent}    {ms * 1e3:8.1f} us  x{n:<5.1f} {name}")
    print(f"{indent}  graph kernels by the span each adds (its end past all earlier work), per step:")
    for name, n, ms in rep.get("graph_kernels_by_added_span", []):
        print(f"{indent}    {ms * 1e3:8.1f} us  x{n:<5.1f} {name}")
    print(f"{indent}  outside the graph, per step:")
    for name, n, ms in rep["outside_graph_by_name"]:
        print(f"{indent}    {ms * 1e3:8.1f} us  x{n:<5.1f} {name}")
    print(f"{indent}  largest idle gaps:")
    for g, a, b in rep["largest_gaps_us"]:
        print(f"{indent}    {g:8.1f} us  after {a}  before {b}")
