"""HiSparse on one GPU: how many long requests the plan holds, and how fast they decode, with and without.

The model is bench_long_context.py's (Flash attention shapes and layer pattern, ``--experts``
routed experts, random weights drawn on the device), run by the Engine. Two modes share one KV
budget: ``compressed`` (every C4 row on the device) and ``hisparse`` (every C4 row in pinned host
memory, a device hot pool of 1 / ``--ratio`` of them, the selected rows swapped in per CSA layer).
Per mode and context:

- the plan: requests that fit, device and host bytes;
- decode tokens/s at the mode's largest batch (the plan's fit, capped by ``--max-batch``), with
  synthetic contexts (``Engine.add_synthetic_request``);
- hisparse: rows swapped in per step (and per CSA layer and request), rows found resident, and the
  host -> device bandwidth of one layer's decode swap-in of the batch (all misses) and of its
  row-copy kernel alone, beside a plain pinned host -> device copy of ``--copy-mb`` measured in
  the same run.

It ends with the issue's targets (1M requests held: hisparse >= 1.4 x compressed at ratio 4;
decode tokens/s at hisparse's largest 1M batch >= 1.25 x compressed's) and writes JSON (``--out``).
Decode CUDA graphs run in both modes where the engine can capture them (HiSparse's swap-in is
decided on the device). A guard keeps the run within
``--time-budget`` seconds; what would overrun is skipped and says so.

    # one H200 (~5 minutes)
    PYTHONUNBUFFERED=1 python3 bench/bench_hisparse.py --out $OUT/hisparse.json
    # the code path on the CPU, tiny stand-in
    python bench/bench_hisparse.py --preset tiny --device cpu --contexts 1024,2048 --steps 2 --ratio 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._bench_common import admit_synthetic, finish_all, fmt_bytes, fmt_tokens, sync, timed_decode_steps  # noqa: E402
from bench.bench_long_context import free_device_memory, memory_setup, model_config, model_defaults, weight_bytes  # noqa: E402
from memory.configurator import DSV4PoolConfigurator, PoolPlan  # noqa: E402
from memory.layout import KV_ROW_BYTES  # noqa: E402
from scheduler_hooks.engine import DTYPES, Engine  # noqa: E402

HEADROOM = 64          # decode tokens a request may add beyond its context
MODES = ("compressed", "hisparse")


def log(msg: str) -> None:
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def plan_for(cfg: Any, mode: str, budget: int, max_running: int, ratio: float) -> PoolPlan:
    return DSV4PoolConfigurator(cfg, max_running_requests=max_running, swa_ratio=0.1,
                                c4_shrink_factor=ratio if mode == "hisparse" else 1.0).plan_for_budget(budget)


def host_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def copy_bandwidth(device: torch.device, mb: int, reps: int = 5) -> Optional[float]:
    """GB/s of one pinned host -> device copy of ``mb`` MiB (the best of ``reps``)."""
    if device.type != "cuda":
        return None
    src = torch.empty(mb << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=device)
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return src.numel() / best / 1e9


def swap_in_bandwidth(hs: Any, batch: int, device: torch.device, reps: int = 5) -> dict[str, Any]:
    """GB/s of one CSA layer's decode swap-in (lookup, eviction and copy) of ``batch`` requests
    selecting ``top_k`` rows each, all misses (random host rows), and of its row-copy kernel
    alone; the best of ``reps``, between CUDA events. Run after the timed steps: it leaves foreign
    rows in the requests' buffers (harmless: they are never selected, and go at release)."""
    if device.type != "cuda":
        return {}
    layer, k = hs.layers[0], hs.top_k
    host_rows = hs.host[layer].shape[0] * 64 - 64
    owners = torch.arange(batch, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    best_swap = best_copy = float("inf")
    for _ in range(reps):
        sel = torch.randint(0, host_rows, (batch, k), device=device, generator=g).sort(dim=1).values
        sel = torch.where(torch.cat([torch.ones_like(sel[:, :1]), (sel[:, 1:] != sel[:, :-1]).long()], 1) > 0, sel, -1)
        n0 = hs.swapped_rows
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        hs.swap_in(layer, sel, owners)
        b.record()
        b.synchronize()
        moved = (hs.swapped_rows - n0) * KV_ROW_BYTES
        best_swap = min(best_swap, a.elapsed_time(b) / 1e3 / max(moved, 1))
        dst = hs.staging_base + torch.arange(min(sel.numel(), hs.staging_rows), device=device)
        src = sel.reshape(-1)[: dst.numel()].clamp_min(0)
        a.record()
        hs.copy_rows(hs.host[layer], src, hs.device_kv[layer], dst)
        b.record()
        b.synchronize()
        best_copy = min(best_copy, a.elapsed_time(b) / 1e3 / (dst.numel() * KV_ROW_BYTES))
    return {"swap_in_gb_per_s": round(1 / best_swap / 1e9, 2), "row_copy_kernel_gb_per_s": round(1 / best_copy / 1e9, 2)}


def build(cfg: Any, mode: str, mem: Any, max_running: int, plan: PoolPlan, args: argparse.Namespace) -> Engine:
    overrides = {"n_routed_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok}
    kw: dict[str, Any] = dict(preset=args.preset, device=args.device, dtype=args.dtype, skip_tokenizer_init=True,
                              random_seed=args.seed, max_running_requests=max_running, chunked_prefill_size=8192,
                              context_length=mem.context_length, swa_ratio=0.1, config_overrides=overrides,
                              attention_kernel=args.attention_kernel,
                              random_weights_on_device=torch.device(args.device).type == "cuda")
    if mode == "hisparse":
        kw.update(enable_hisparse=True, hisparse_config={
            "top_k": args.top_k or cfg.index_topk, "device_buffer_size": args.device_buffer_size,
            "host_to_device_ratio": args.ratio})
    if mem.mem_fraction is not None:
        kw["mem_fraction_static"] = mem.mem_fraction
    else:
        kw["max_total_tokens"] = plan.max_full_tokens
    return Engine(**kw)


def measure(eng: Engine, ctx: int, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """Decode tokens/s of ``batch`` synthetic requests of ``ctx`` tokens; HiSparse copy figures."""
    row: dict[str, Any] = {"context": ctx, "batch": batch}
    hs = eng.pools.hisparse
    t0 = time.perf_counter()
    rids = admit_synthetic(eng, ctx, batch, args.warmup + args.steps + 3)
    try:
        sync(eng.device)
        row["admit_s"] = round(time.perf_counter() - t0, 2)
        if args.warmup:
            timed_decode_steps(eng, args.warmup, batch)
        before = hs.stats() if hs is not None else None
        timing = timed_decode_steps(eng, args.steps, batch)
        row.update(steps=args.steps, ms_per_step=round(timing.ms_per_step, 2), tokens_per_s=round(timing.tokens_per_s, 1))
        graphs = getattr(eng.runner, "cuda_graphs", None)
        row["cuda_graphs"] = graphs is not None
        if hs is not None:
            after = hs.stats()
            swapped = (after["swapped_rows"] - before["swapped_rows"]) / args.steps
            hits = (after["hit_rows"] - before["hit_rows"]) / args.steps
            layers = len(hs.layers)
            row.update(rows_swapped_per_step=round(swapped, 1),
                       rows_swapped_per_layer_request=round(swapped / (layers * batch), 1),
                       resident_share_of_selected=round(hits / max(hits + swapped, 1), 3),
                       swap_bytes_per_step=int(swapped * KV_ROW_BYTES))
            row.update(swap_in_bandwidth(hs, batch, eng.device))
        row["status"] = "ok"
    finally:
        finish_all(eng, rids)
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = model_config(args)
    device = torch.device(args.device)
    ns = argparse.Namespace(**vars(args), prefill_contexts=[], prefill_long=0, mixed_prefill=0)
    mem = memory_setup(cfg, ns, device, HEADROOM)
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "notes": mem.notes,
                              "weights_bytes": weight_bytes(cfg, DTYPES[args.dtype]), "plans": {}, "decode": [],
                              "copy_gb_per_s": copy_bandwidth(device, args.copy_mb)}
    for note in mem.notes:
        log(note)
    if report["copy_gb_per_s"]:
        log(f"plain pinned host -> device copy of {args.copy_mb} MiB: {report['copy_gb_per_s']:.1f} GB/s")
    small = min(args.contexts) + HEADROOM
    for mode in args.modes:
        plan = plan_for(cfg, mode, mem.pool_budget, args.max_batch, args.ratio)
        running = max(1, min(args.max_batch, plan.requests_fit(small)))
        plan = plan_for(cfg, mode, mem.pool_budget, running, args.ratio)
        fit = {ctx: min(running, plan.requests_fit(ctx + HEADROOM)) for ctx in args.contexts}
        report["plans"][mode] = {"max_running": running, "device_bytes": plan.total_bytes, "host_bytes": plan.host_bytes,
                                 "max_full_tokens": plan.max_full_tokens,
                                 "requests_fit": {str(c): plan.requests_fit(c + HEADROOM) for c in args.contexts}}
        log(f"{mode}: plan holds {plan.max_full_tokens:,} tokens; device {fmt_bytes(plan.total_bytes)}, host "
            f"{fmt_bytes(plan.host_bytes)}; requests that fit: "
            + ", ".join(f"{fmt_tokens(c)}: {plan.requests_fit(c + HEADROOM)}" for c in args.contexts))
        if mode == "hisparse" and plan.host_bytes > 0.85 * host_available():
            log(f"hisparse: skipped, its host pool ({fmt_bytes(plan.host_bytes)}) exceeds 85% of the available "
                f"host memory ({fmt_bytes(host_available())})")
            continue
        if time.time() - START > args.time_budget - args.build_seconds:
            log(f"{mode}: skipped by the time guard")
            continue
        eng = build(cfg, mode, mem, running, plan, args)
        log(f"{mode}: engine built ({eng.attention_kernel}); cuda graphs "
            f"{'on' if getattr(eng.runner, 'cuda_graphs', None) is not None else 'off'}")
        for ctx in sorted(args.contexts, reverse=True):
            if fit[ctx] < 1:
                report["decode"].append({"mode": mode, "context": ctx, "status": "does not fit"})
                continue
            if time.time() - START > args.time_budget - args.guard_margin:
                report["decode"].append({"mode": mode, "context": ctx, "status": "skipped: time guard"})
                log(f"{mode} {fmt_tokens(ctx)}: skipped by the time guard")
                continue
            try:
                row = {"mode": mode, **measure(eng, ctx, fit[ctx], args)}
            except (RuntimeError, torch.OutOfMemoryError) as e:
                row = {"mode": mode, "context": ctx, "batch": fit[ctx], "status": f"failed: {str(e)[:200]}"}
            report["decode"].append(row)
            log(f"{mode} {fmt_tokens(ctx)} x {row.get('batch')}: " + ", ".join(
                f"{k} {v}" for k, v in row.items() if k not in ("mode", "context", "batch")))
            save(report, args.out)
        del eng
        free_device_memory()
    report["targets"] = targets(report, args)
    for line in report["targets"]:
        log(line)
    save(report, args.out)
    return report


def targets(report: dict[str, Any], args: argparse.Namespace) -> list[str]:
    out = []
    big = max(args.contexts)
    plans = report["plans"]
    if "compressed" in plans and "hisparse" in plans:
        a, b = plans["compressed"]["requests_fit"][str(big)], plans["hisparse"]["requests_fit"][str(big)]
        out.append(f"{fmt_tokens(big)} requests the plan holds: compressed {a}, hisparse {b} "
                   f"({b / a if a else float('inf'):.2f}x; target >= 1.40x at ratio 4)")
    rows = {(r["mode"], r["context"]): r for r in report["decode"] if r.get("status") == "ok"}
    for ctx in args.contexts:
        a, b = rows.get(("compressed", ctx)), rows.get(("hisparse", ctx))
        if a and b:
            out.append(f"{fmt_tokens(ctx)} decode at each mode's largest batch: compressed {a['tokens_per_s']} tok/s "
                       f"(b{a['batch']}), hisparse {b['tokens_per_s']} tok/s (b{b['batch']}): "
                       f"{b['tokens_per_s'] / a['tokens_per_s']:.2f}x" + ("; target >= 1.25x" if ctx == big else ""))
        else:
            out.append(f"{fmt_tokens(ctx)} decode: not measured in both modes")
    if report.get("copy_gb_per_s"):
        swaps = [r.get("swap_in_gb_per_s") for r in rows.values() if r.get("swap_in_gb_per_s")]
        if swaps:
            kern = [r.get("row_copy_kernel_gb_per_s") for r in rows.values() if r.get("row_copy_kernel_gb_per_s")]
            out.append(f"swap-in reached {max(swaps):.2f} GB/s (its row-copy kernel {max(kern):.2f} GB/s) against "
                       f"a plain pinned copy's {report['copy_gb_per_s']:.1f} GB/s")
    return out


def save(report: dict[str, Any], path: Optional[Path]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="flash", choices=["flash", "pro", "tiny"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    ap.add_argument("--experts", type=int, default=None, help="routed experts (default 8; the tiny preset's own)")
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[131072, 1048576])
    ap.add_argument("--modes", type=lambda s: [m for m in s.split(",") if m], default=list(MODES))
    ap.add_argument("--ratio", type=float, default=4.0, help="hisparse host_to_device_ratio")
    ap.add_argument("--top-k", type=int, default=0, help="hisparse top_k (default: the model's index_topk)")
    ap.add_argument("--device-buffer-size", type=int, default=0, help="hisparse device_buffer_size (0: 2 x top_k)")
    ap.add_argument("--max-batch", type=int, default=None, help="cap on the batch (default 96 on CUDA, 8 on the CPU)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--mem-fraction", type=float, default=0.92)
    ap.add_argument("--reserve-gb", type=float, default=14.0)
    ap.add_argument("--cpu-pool-tokens", type=int, default=0)
    ap.add_argument("--copy-mb", type=int, default=1024)
    ap.add_argument("--attention-kernel", default="auto", choices=["auto", "flashmla", "triton"])
    ap.add_argument("--time-budget", type=float, default=330.0, help="seconds for the whole run")
    ap.add_argument("--build-seconds", type=float, default=60.0, help="what an engine build is assumed to take")
    ap.add_argument("--guard-margin", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    cuda = model_defaults(args)
    args.max_batch = args.max_batch or (96 if cuda else 8)
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; choose from {list(MODES)}")
    return args


START = time.time()

if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    run(parse_args())
