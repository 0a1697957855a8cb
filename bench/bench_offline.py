"""Offline decode benchmark on the CPU: compressed (CSA/HCA) KV vs a dense per-token cache, through the Engine.

For every (context, batch, mode): an Engine on the tiny preset (float32, seeded random weights,
the same in both modes), ``batch`` requests whose ``context`` tokens are in the pools, then
``--steps`` timed decode steps in which every request gains one token, then ``--breakdown-steps``
steps split by layer type (bench/_bench_common.py). Dense mode keeps every token's 584-byte row
in every layer and attends all of them (the per-token cache that compression replaces);
compressed mode attends window + top-k C4 rows / all C128 rows from the pools.

How the context gets into the pools (the ``via`` column):
- ``prefill``: a real chunked prefill through the scheduler (used while ``batch x context`` is
  at most ``--real-prefill-max-tokens``);
- ``synthetic``: ``Engine.add_synthetic_request``: the same admission, pages and eviction, but
  the pools are filled with random valid rows instead of running the model over the context.
  A decode step costs the same either way (``--check-synthetic`` times one configuration both
  ways to show it).

    python bench/bench_offline.py                      # the sweep: 1K, 4K, 16K, 64K x batch 1, 8
    python bench/bench_offline.py --quick              # 1K and 4K, a few steps (~1 minute)
    python bench/bench_offline.py --contexts 4096 --batches 1 8 --steps 16 --modes compressed

Prints a table and writes JSON (``--out``, default bench/results/offline.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._bench_common import (  # noqa: E402
    LayerTimer, finish_all, fmt_tokens, kv_bytes_held, admit_synthetic, timed_decode_steps,
)
from scheduler_hooks.engine import Engine  # noqa: E402
from scheduler_hooks.io import GenerateRequest, SamplingParams  # noqa: E402

FULL_CONTEXTS = [1024, 4096, 16384, 65536]
QUICK = dict(contexts=[1024, 4096], batches=[1, 8], steps=4)


@dataclass
class Result:
    mode: str
    context: int
    batch: int
    via: str                # "prefill" or "synthetic"
    steps: int
    fill_s: float           # prefill or synthetic admission time
    decode_s: float
    ms_per_step: float
    tokens_per_s: float
    kv_bytes_held: int      # bytes of KV rows and compressor state the requests hold after admission
    breakdown: Optional[dict[str, Any]] = field(default=None)


def build_engine(mode: str, context: int, batch: int, steps: int, dtype: str, chunk: int, seed: int) -> Engine:
    """An engine whose pools hold ``batch`` requests of ``context`` tokens plus their decode steps,
    and whose SWA pool holds a prefill chunk beside every request's window."""
    per_req = context + steps + 64
    total = batch * (-(-per_req // 256) + 1) * 256
    swa_ratio = min(1.0, max(0.1, (chunk + batch * 3 * 128) / total))
    return Engine(preset="tiny", dtype=dtype, dense=mode == "dense", skip_tokenizer_init=True, random_seed=seed,
                  max_running_requests=batch, max_total_tokens=total, context_length=per_req + 256,
                  chunked_prefill_size=chunk, swa_ratio=swa_ratio)


def fill_by_prefill(eng: Engine, context: int, batch: int, max_new_tokens: int, seed: int) -> list[str]:
    """Real chunked prefill of ``batch`` random prompts; returns once every request decodes.
    Requests whose prefill ends early decode meanwhile (up to ``batch`` chunks' worth of steps),
    which is why ``max_new_tokens`` carries that headroom."""
    rng = random.Random(seed)
    sched = eng.scheduler
    rids = []
    for i in range(batch):
        ids = [rng.randrange(eng.vocab_size) for _ in range(context)]
        req = GenerateRequest(ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True))
        sched.add(req)
        rids.append(req.rid)
    while sched.waiting or any(r.remaining > 1 for r in sched.running):
        eng.step()
    if len(sched.running) != batch:
        raise RuntimeError(f"{len(sched.running)} of {batch} requests are decoding after prefill")
    return rids


def run_one(mode: str, context: int, batch: int, via: str, args: argparse.Namespace) -> Result:
    prefill_headroom = batch * (-(-context // args.prefill_chunk) + 1)
    max_new = args.steps + args.breakdown_steps + prefill_headroom + 4
    eng = build_engine(mode, context, batch, max_new, args.dtype, args.prefill_chunk, args.seed)
    try:
        t0 = time.perf_counter()
        if via == "prefill":
            rids = fill_by_prefill(eng, context, batch, max_new, args.seed)
        else:
            rids = admit_synthetic(eng, context, batch, max_new)
        fill_s = time.perf_counter() - t0
        held = kv_bytes_held(eng)
        timing = timed_decode_steps(eng, args.steps, batch)
        bd = None
        if args.breakdown_steps:
            with LayerTimer(eng) as lt:
                for _ in range(args.breakdown_steps):
                    lt.step()
            bd = lt.breakdown().to_dict()
        finish_all(eng, rids)
    finally:
        eng.shutdown()
    return Result(mode, context, batch, via, args.steps, fill_s, timing.seconds, timing.ms_per_step,
                  timing.tokens_per_s, held, bd)


def table(results: list[Result]) -> str:
    head = (f"| {'mode':<10} | {'context':>7} | {'batch':>5} | {'context via':<11} | {'ms / step':>9} | "
            f"{'tokens / s':>10} | {'KV held / req':>13} | {'attn %':>6} | {'fill s':>7} |")
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in results:
        attn = ""
        if r.breakdown:
            pct = r.breakdown["pct"]
            attn = f"{pct.get('attn_window', 0) + pct.get('attn_csa', 0) + pct.get('attn_hca', 0):.0f}"
        lines.append(f"| {r.mode:<10} | {fmt_tokens(r.context):>7} | {r.batch:>5} | {r.via:<11} | "
                     f"{r.ms_per_step:>9.1f} | {r.tokens_per_s:>10.1f} | "
                     f"{r.kv_bytes_held / r.batch / 2**20:>10.2f} Mi | {attn:>6} | {r.fill_s:>7.1f} |")
    return "\n".join(lines)


def speedups(results: list[Result]) -> list[str]:
    by = {(r.mode, r.context, r.batch, r.via): r for r in results}
    lines = []
    for (mode, ctx, b, via), r in by.items():
        d = by.get(("dense", ctx, b, via))
        if mode == "compressed" and d is not None:
            lines.append(f"compressed / dense decode tokens/s at {fmt_tokens(ctx)} x {b} ({via}): "
                         f"{r.tokens_per_s / d.tokens_per_s:.2f}x")
    return lines


def plan_configs(args: argparse.Namespace) -> list[tuple[str, int, int, str]]:
    """(mode, context, batch, via) in run order. With ``--check-synthetic`` the largest really
    prefilled configuration is followed at once by the same one with a synthetic context, so the
    two run under the same machine load."""
    def via_of(ctx: int, b: int) -> str:
        return "prefill" if b * ctx <= args.real_prefill_max_tokens else "synthetic"

    real = [(ctx, b) for ctx in args.contexts for b in args.batches if via_of(ctx, b) == "prefill"]
    check = max(real, key=lambda cb: (cb[0] * cb[1], cb[0])) if (real and args.check_synthetic) else None
    configs = []
    for ctx in args.contexts:
        for b in args.batches:
            for mode in args.modes:
                configs.append((mode, ctx, b, via_of(ctx, b)))
                if (ctx, b) == check:
                    configs.append((mode, ctx, b, "synthetic"))
    return configs


def main(argv: list[str] | None = None) -> list[Result]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=FULL_CONTEXTS)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per configuration")
    ap.add_argument("--breakdown-steps", type=int, default=2, help="extra steps split by layer type (0: none)")
    ap.add_argument("--modes", nargs="+", choices=["compressed", "dense"], default=["compressed", "dense"])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--prefill-chunk", type=int, default=2048, help="chunked_prefill_size of real prefills")
    ap.add_argument("--real-prefill-max-tokens", type=int, default=4096,
                    help="prefill for real while batch x context <= this; synthetic contexts beyond")
    ap.add_argument("--no-check-synthetic", dest="check_synthetic", action="store_false",
                    help="skip timing the largest real-prefill configuration again with a synthetic context")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: on a shared machine more threads are much slower)")
    ap.add_argument("--quick", action="store_true",
                    help=f"contexts {QUICK['contexts']}, batches {QUICK['batches']}, {QUICK['steps']} steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "offline.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.batches, args.steps = QUICK["contexts"], QUICK["batches"], QUICK["steps"]
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("scheduler_hooks.engine").setLevel(logging.ERROR)

    from tqdm import tqdm
    configs = plan_configs(args)
    results = []
    bar = tqdm(configs, desc="bench_offline", unit="cfg", disable=args.no_progress, file=sys.stderr)
    start = time.time()
    for mode, ctx, b, via in bar:
        bar.set_postfix_str(f"{mode} {fmt_tokens(ctx)} x {b} {via}")
        r = run_one(mode, ctx, b, via, args)
        tqdm.write(f"{mode:<10} {fmt_tokens(ctx):>4} x {b:<2} {via:<9}: {r.ms_per_step:8.1f} ms/step "
                   f"{r.tokens_per_s:8.1f} tok/s (fill {r.fill_s:.1f} s)", file=sys.stderr)
        results.append(r)
    wall = time.time() - start
    print()
    print(table(results))
    for line in speedups(results):
        print(line)
    longest = max(args.contexts)
    for r in results:
        if r.breakdown and r.context == longest and r.batch == min(args.batches):
            from bench._bench_common import Breakdown
            bd = Breakdown(r.breakdown["steps"], r.breakdown["step_ms"], r.breakdown["ms"])
            print(bd.table(f"\nper-layer-type breakdown, {r.mode}, {fmt_tokens(r.context)} x {r.batch} ({r.via}):"))
    print(f"\nsweep wall time {wall:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"preset": "tiny", "dtype": args.dtype, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.machine(), "processor": platform.processor(), "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv[1:] if argv is None else argv,
            "wall_s": wall}
    args.out.write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=2))
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
