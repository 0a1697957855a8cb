"""Offline churn of the prefix cache: random requests with shared prefixes, aborts, retractions
and cache evictions through one Engine, then a check that nothing leaked.

    python bench/churn_offline.py --requests 10000              # the long run (tiny preset, CPU)
    python bench/churn_offline.py --requests 200 --seed 1 --json out.json

Each request is one of a few shared "system prompts" (longer than a full page, so restore
points exist) or a random prompt, plus a random tail; a third of them is aborted at a random
step (waiting, prefilling or decoding). The pools are small (a few full pages per running
request), so the cache is evicted and requests are retracted. The allocator's integrity check
(every page free, held by a request or held by the cache, with the right holder counts) runs
every ``--check-every`` steps and at the end; then the cache is flushed and every pool must be
empty. Printed: requests, finished, aborted, cache hits and hit tokens, evicted pages,
retractions, steps, wall time, and the units left in any pool (the leak). Exit status 1 on a leak.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Optional

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from scheduler_hooks.engine import Engine
from scheduler_hooks.io import GenerateRequest, SamplingParams

VOCAB = 1024


def churn(num_requests: int, seed: int = 0, max_running: int = 4, max_total_tokens: int = 2048,
          check_every: int = 25, system_len: tuple[int, int] = (260, 600),
          engine: Optional[Engine] = None, progress_every: int = 0) -> dict[str, Any]:
    """Run the churn; returns the report (``leaked``: {pool: units} still held after the flush).
    ``system_len``: the range of the shared prompts' lengths; ``progress_every``: print a line
    every that many requests added (0: none)."""
    rng = random.Random(seed)
    eng = engine or Engine(preset="tiny", skip_tokenizer_init=True, max_total_tokens=max_total_tokens,
                           max_running_requests=max_running, chunked_prefill_size=256,
                           config_overrides={"vocab_size": VOCAB, "num_hidden_layers": 2,
                                             "compress_ratios": (4, 128, 0)})
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randrange(*system_len))] for _ in range(3)]
    sched = eng.scheduler
    t0 = time.perf_counter()
    added = finished = aborted = steps = 0
    abort_at: dict[str, int] = {}
    while added < num_requests or not sched.idle:
        while added < num_requests and len(sched.waiting) < 2 * max_running:
            head = rng.choice(systems) if rng.random() < 0.8 else []
            prompt = head + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
            rid = f"c{added}"
            sched.add(GenerateRequest(prompt, SamplingParams(max_new_tokens=rng.randrange(1, 6), temperature=0.0,
                                                              ignore_eos=True), rid=rid))
            if rng.random() < 1 / 3:
                abort_at[rid] = steps + rng.randrange(0, 6)
            added += 1
            if progress_every and added % progress_every == 0:
                print(f"{added} requests added, {finished} finished, {aborted} aborted, {steps} steps, "
                      f"{time.perf_counter() - t0:.0f} s; integrity checked every {check_every} steps", flush=True)
        finished += sum(o.finished for o in eng.step())
        steps += 1
        for rid in [r for r, s in abort_at.items() if s <= steps]:
            del abort_at[rid]
            if sched.abort(rid) is not None:
                aborted += 1
        if steps % check_every == 0:
            eng.check_integrity()
    eng.check_integrity()
    cache = eng.stats()["prefix_cache"] or {}
    eng.flush_cache()
    eng.check_integrity()
    leaked = {k: v["used"] + v["cached"] for k, v in eng.pool_usage().items() if v["used"] or v["cached"]}
    return {"requests": added, "finished": finished, "aborted": aborted, "steps": steps,
            "hits": cache.get("hits", 0), "hit_tokens": cache.get("hit_tokens", 0),
            "hit_rate": cache.get("hit_rate", 0.0), "evicted_pages": cache.get("evicted_pages", 0),
            "retractions": sched.num_retractions, "wall_s": time.perf_counter() - t0, "leaked": leaked}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-running-requests", type=int, default=4)
    p.add_argument("--max-total-tokens", type=int, default=2048)
    p.add_argument("--check-every", type=int, default=25, help="steps between integrity checks")
    p.add_argument("--progress-every", type=int, default=500, help="requests between progress lines (0: none)")
    p.add_argument("--json", help="write the report here")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    report = churn(a.requests, a.seed, a.max_running_requests, a.max_total_tokens, a.check_every,
                   progress_every=a.progress_every)
    for k, v in report.items():
        print(f"{k:>14}: {v:.3f}" if isinstance(v, float) else f"{k:>14}: {v}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2))
    return 1 if report["leaked"] else 0


if __name__ == "__main__":
    sys.exit(main())
