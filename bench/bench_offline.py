"""Offline decode benchmark: compressed (CSA/HCA) KV vs a dense per-token cache, through the Engine.

For every (mode, context, batch): build an Engine on the tiny preset (seeded random weights,
the same in both modes), prefill ``batch`` requests of ``context`` random tokens, then time
``steps`` decode steps in which every request gains one token. Dense mode keeps every token's
584-byte row in every layer and attends all of them (the per-token cache that compression
replaces); compressed mode attends window + top-k C4 rows / all C128 rows from the pools.

    python bench/bench_offline.py                      # full sweep: 1K-64K, batch 1 and 8 (long)
    python bench/bench_offline.py --quick              # ~2 minutes on two cores
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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scheduler_hooks.engine import Engine  # noqa: E402
from scheduler_hooks.io import GenerateRequest, SamplingParams  # noqa: E402

FULL_CONTEXTS = [1024, 4096, 16384, 65536]
QUICK = dict(contexts=[1024, 2048], batches=[1, 8], steps=8)


@dataclass
class Result:
    mode: str
    context: int
    batch: int
    steps: int
    prefill_s: float
    decode_s: float
    ms_per_step: float
    tokens_per_s: float
    kv_bytes_held: int      # bytes of KV rows and compressor state the requests hold after prefill


def kv_bytes_held(eng: Engine) -> int:
    """What the live requests occupy in the pools (rows and ring slots in use, every layer)."""
    from memory.configurator import (C4_INDEXER_STATE_WIDTH, C4_STATE_WIDTH, C128_STATE_WIDTH,
                                     INDEXER_ROW_BYTES, KV_ROW_BYTES, ONLINE_STATE_SHAPE)
    cfg, pools = eng.config, eng.stats()["pools"]
    S = torch.empty((), dtype=eng.plan.state_dtype).element_size()
    used = {k: v["used"] for k, v in pools.items()}
    L, l4, l128 = cfg.num_hidden_layers, cfg.num_c4_layers, cfg.num_c128_layers
    return int(used["swa"] * KV_ROW_BYTES * L
               + used.get("c4_rows", 0) * KV_ROW_BYTES * l4
               + used.get("c4_indexer_rows", 0) * INDEXER_ROW_BYTES * l4
               + used.get("c4_ring_slots", 0) * (C4_STATE_WIDTH + C4_INDEXER_STATE_WIDTH) * S * l4
               + used.get("c128_rows", 0) * KV_ROW_BYTES * l128
               + used.get("c128_ring_rows", 0) * C128_STATE_WIDTH * S * l128
               + used.get("c128_online_slots", 0) * ONLINE_STATE_SHAPE[0] * ONLINE_STATE_SHAPE[1] * S * l128)


def run_one(mode: str, context: int, batch: int, steps: int, dtype: str, prefill_chunk: int, seed: int) -> Result:
    dense = mode == "dense"
    # Requests that finish their prefill decode while the others still prefill: give them room
    # (headroom) so none finishes before the timed steps, and an SWA pool that holds a whole
    # prefill chunk beside every request's window, so chunks are not cut by SWA pages.
    headroom = steps + batch * (-(-context // prefill_chunk) + 1) + 8
    total = batch * (context + headroom + 256)
    swa_ratio = min(1.0, max(0.1, batch * (prefill_chunk + 3 * 128) / total))
    eng = Engine(preset="tiny", dtype=dtype, dense=dense, skip_tokenizer_init=True, random_seed=seed,
                 max_running_requests=batch, max_total_tokens=total, context_length=context + headroom,
                 chunked_prefill_size=prefill_chunk, swa_ratio=swa_ratio)
    rng = random.Random(seed)
    sched = eng.scheduler
    for i in range(batch):
        ids = [rng.randrange(eng.vocab_size) for _ in range(context)]
        sched.add(GenerateRequest(ids, SamplingParams(max_new_tokens=headroom - 1, temperature=0.0,
                                                      ignore_eos=True), rid=f"b{i}"))
    t0 = time.perf_counter()
    while sched.waiting or any(r.remaining > 1 for r in sched.running):
        sched.step()
    prefill_s = time.perf_counter() - t0
    assert len(sched.running) == batch, "every request must be decoding before timing"
    held = kv_bytes_held(eng)

    t0 = time.perf_counter()
    for _ in range(steps):
        outs = sched.step()
        assert len(outs) == batch and not any(o.finished for o in outs)
    decode_s = time.perf_counter() - t0
    eng.shutdown()
    return Result(mode, context, batch, steps, prefill_s, decode_s, 1e3 * decode_s / steps,
                  batch * steps / decode_s, held)


def table(results: list[Result]) -> str:
    head = f"{'mode':<11} {'context':>8} {'batch':>5} {'ms/step':>9} {'tok/s':>9} {'prefill s':>10} {'KV held':>10}"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.mode:<11} {r.context:>8} {r.batch:>5} {r.ms_per_step:>9.1f} {r.tokens_per_s:>9.1f} "
                     f"{r.prefill_s:>10.1f} {r.kv_bytes_held / 2**20:>8.2f}Mi")
    by_key = {(r.mode, r.context, r.batch): r for r in results}
    for (mode, ctx, b), r in sorted(by_key.items()):
        d = by_key.get(("dense", ctx, b))
        if mode == "compressed" and d is not None:
            lines.append(f"compressed / dense decode speed at {ctx} x {b}: {r.tokens_per_s / d.tokens_per_s:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=FULL_CONTEXTS)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per configuration")
    ap.add_argument("--modes", nargs="+", choices=["compressed", "dense"], default=["compressed", "dense"])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--prefill-chunk", type=int, default=4096, help="chunked_prefill_size while filling the context")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help=f"contexts {QUICK['contexts']}, batches {QUICK['batches']}, "
                                                        f"{QUICK['steps']} steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "offline.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.batches, args.steps = QUICK["contexts"], QUICK["batches"], QUICK["steps"]
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("scheduler_hooks.engine").setLevel(logging.ERROR)

    results = []
    for ctx in args.contexts:
        for b in args.batches:
            for mode in args.modes:
                r = run_one(mode, ctx, b, args.steps, args.dtype, args.prefill_chunk, args.seed)
                print(f"{mode:<11} context {ctx:>6} batch {b}: {r.ms_per_step:8.1f} ms/step "
                      f"{r.tokens_per_s:8.1f} tok/s (prefill {r.prefill_s:.1f} s)", flush=True)
                results.append(r)
    print()
    print(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"preset": "tiny", "dtype": args.dtype, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.machine(), "processor": platform.processor(), "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.out.write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
