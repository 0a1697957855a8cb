"""Prefix cache benchmark: TTFT and throughput with and without the cache, through the Engine.

Two closed-loop workloads, each run on an engine with the cache and on one without
(``disable_radix_cache=True``), same weights, same requests:

- ``system``: ``--requests`` requests sharing one ``--system-len``-token system prompt, each
  with its own ``--question-len``-token question, ``--concurrency`` in flight at a time;
- ``chat``: ``--convs`` conversations of ``--turns`` turns run side by side; turn t's prompt is
  the whole history (the previous prompt, the previous answer, a new ``--user-len``-token
  message), as chat clients resend it; the first turn starts with a ``--chat-system-len`` prompt.

Every request decodes ``--new-tokens`` tokens greedily (ignore_eos). TTFT is wall time from a
request's admission into the queue to its first token (the engine is driven by this loop,
offline, so no HTTP or tokenizer time is in it); throughput is (prompt + generated tokens) /
wall time of the workload (with ``--repeats``, the fastest run of each). Also printed: prompt
tokens prefilled (not served from the cache), the cache's hit tokens, and whether the cached and
uncached runs produced the same greedy tokens.

    python bench/bench_prefix_cache.py                                   # CPU, tiny preset
    python bench/bench_prefix_cache.py --device cuda --preset flash --system-len 32768 \\
        --requests 4 --chat-system-len 4096 --convs 4 --turns 4 --user-len 512 --out $OUT/prefix.json

Writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from dsv4_backend.config import DSV4Config
from scheduler_hooks.engine import Engine
from scheduler_hooks.io import GenerateRequest, SamplingParams


def build_engine(args: argparse.Namespace, cache: bool) -> Engine:
    over: dict[str, Any] = {}
    if args.experts:
        base = DSV4Config.preset(args.preset)
        over.update(n_routed_experts=args.experts, num_experts_per_tok=min(args.experts, base.num_experts_per_tok))
    kw: dict[str, Any] = dict(preset=args.preset, device=args.device, dtype=args.dtype, skip_tokenizer_init=True,
                              random_seed=args.seed, max_running_requests=args.max_running,
                              chunked_prefill_size=args.chunk, disable_radix_cache=not cache,
                              config_overrides=over or None, context_length=args.context_length)
    # pools sized in tokens on both devices: a fraction of a GPU would also count the weights,
    # which the model holds twice while it stacks the experts
    kw["max_total_tokens"] = args.max_total_tokens or (16384 if args.device == "cpu" else 262144)
    if args.device == "cuda":
        kw["random_weights_on_device"] = True
    return Engine(**kw)


def sync(eng: Engine) -> None:
    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)


class Loop:
    """Drives ``eng`` offline; ``submit`` queues a request, ``run`` steps until all are done,
    calling ``on_finish(rid, output_ids)`` (which may submit more)."""

    def __init__(self, eng: Engine, new_tokens: int):
        self.eng, self.new_tokens = eng, new_tokens
        self.added: dict[str, float] = {}
        self.ttft: dict[str, float] = {}
        self.prompt_tokens = self.generated = self.cached = 0
        self.outputs: dict[str, list[int]] = {}
        self._n = 0

    def submit(self, ids: list[int], tag: str) -> str:
        rid = f"{tag}-{self._n}"
        self._n += 1
        p = SamplingParams(max_new_tokens=self.new_tokens, temperature=0.0, ignore_eos=True)
        self.eng.scheduler.add(GenerateRequest(list(ids), p, rid=rid))
        self.added[rid] = time.perf_counter()
        self.prompt_tokens += len(ids)
        return rid

    def run(self, on_finish) -> None:
        while not self.eng.scheduler.idle:
            outs = self.eng.step()
            sync(self.eng)
            now = time.perf_counter()
            for o in outs:
                if o.delta_ids and o.rid not in self.ttft:
                    self.ttft[o.rid] = now - self.added[o.rid]
                if o.finished:
                    if o.error:
                        raise RuntimeError(f"request {o.rid} failed: {o.error}")
                    self.generated += o.completion_tokens
                    self.cached += o.cached_tokens
                    self.outputs[o.rid] = list(o.output_ids)
                    on_finish(o.rid, o.output_ids)


def workload_system(eng: Engine, args: argparse.Namespace, rng: random.Random) -> Loop:
    system = [rng.randrange(eng.vocab_size) for _ in range(args.system_len)]
    questions = [[rng.randrange(eng.vocab_size) for _ in range(args.question_len)] for _ in range(args.requests)]
    loop, queue = Loop(eng, args.new_tokens), list(questions)

    def next_request(*_):
        if queue:
            loop.submit(system + queue.pop(0), "sys")

    for _ in range(min(args.concurrency, len(queue))):
        next_request()
    loop.run(next_request)
    return loop


def workload_chat(eng: Engine, args: argparse.Namespace, rng: random.Random) -> Loop:
    loop = Loop(eng, args.new_tokens)
    # one generator per conversation: its messages do not depend on the order turns finish in
    rngs = [random.Random(rng.randrange(2 ** 31)) for _ in range(args.convs)]
    history: dict[int, list[int]] = {}
    turn: dict[int, int] = {}
    conv_of: dict[str, int] = {}

    def start_turn(c: int) -> None:
        history[c] = history[c] + [rngs[c].randrange(eng.vocab_size) for _ in range(args.user_len)]
        conv_of[loop.submit(history[c], f"chat{c}")] = c

    def on_finish(rid: str, output_ids: list[int]) -> None:
        c = conv_of[rid]
        history[c] = history[c] + list(output_ids)
        turn[c] += 1
        if turn[c] < args.turns:
            start_turn(c)

    for c in range(args.convs):
        history[c] = [rngs[c].randrange(eng.vocab_size) for _ in range(args.chat_system_len)]
        turn[c] = 0
        start_turn(c)
    loop.run(on_finish)
    return loop


WORKLOADS = {"system": workload_system, "chat": workload_chat}


def ready_engine(args: argparse.Namespace, cache: bool) -> Engine:
    eng = build_engine(args, cache)
    # warm-up (Triton compiles its kernels here, not in the first timed request), then a clean cache
    eng.generate(input_ids=[1] * args.warmup_len, sampling_params={"max_new_tokens": 4, "temperature": 0})
    eng.flush_cache()
    return eng


def run_workload(eng: Engine, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One timed run of workload ``name`` from an empty cache."""
    eng.flush_cache()
    t0 = time.perf_counter()
    loop = WORKLOADS[name](eng, args, random.Random(args.seed))
    sync(eng)
    wall = time.perf_counter() - t0
    eng.check_integrity()
    ttfts = sorted(loop.ttft.values())
    return {"requests": len(loop.ttft), "wall_s": wall,
            "ttft_mean_s": statistics.fmean(ttfts), "ttft_median_s": statistics.median(ttfts),
            "ttft_max_s": ttfts[-1], "throughput_tok_s": (loop.prompt_tokens + loop.generated) / wall,
            "prompt_tokens": loop.prompt_tokens, "prefilled_tokens": loop.prompt_tokens - loop.cached,
            "cached_tokens": loop.cached, "generated_tokens": loop.generated,
            "outputs": [loop.outputs[r] for r in sorted(loop.outputs)]}


def free_device_memory() -> None:
    """After the caller dropped its last reference to an engine: its weights and pools go back
    (on a GPU the next engine needs them; the caller's own name would keep them alive)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """{mode: {workload: the fastest of --repeats runs}}. On the CPU both engines live at once and
    the modes alternate run by run (a shared machine's load drifts); on a GPU, one after the other."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {m: {w: [] for w in args.workloads} for m in ("off", "on")}
    if args.device == "cpu":
        engines = {m: ready_engine(args, m == "on") for m in ("off", "on")}
        for _ in range(args.repeats):
            for w in args.workloads:
                for m in ("off", "on"):
                    runs[m][w].append(run_workload(engines[m], w, args))
        for eng in engines.values():
            eng.shutdown()
        del engines, eng
        free_device_memory()
    else:
        for m in ("off", "on"):
            eng = ready_engine(args, m == "on")
            for _ in range(args.repeats):
                for w in args.workloads:
                    runs[m][w].append(run_workload(eng, w, args))
            eng.shutdown()
            del eng
            free_device_memory()
    return {m: {w: min(rs, key=lambda r: r["wall_s"]) for w, rs in by.items()} for m, by in runs.items()}


def main(argv: Optional[list[str]] = None) -> int:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--preset", default="tiny", choices=["tiny", "flash", "pro"])
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    ap.add_argument("--experts", type=int, default=None, help="routed experts (default 8 for flash/pro)")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--chat-system-len", type=int, default=1024)
    ap.add_argument("--convs", type=int, default=2)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-len", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=None, help="chunked_prefill_size (CPU 2048, CUDA 8192)")
    ap.add_argument("--max-running", type=int, default=4)
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help="pool size in full tokens (default 16384 on the CPU, 262144 on CUDA)")
    ap.add_argument("--context-length", type=int, default=65536)
    ap.add_argument("--warmup-len", type=int, default=None,
                    help="ids of the untimed warm-up request (CPU 300; CUDA one chunk + 300)")
    ap.add_argument("--threads", type=int, default=1, help="CPU torch threads")
    ap.add_argument("--repeats", type=int, default=1, help="runs per workload and mode; the fastest is shown")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not cuda:
        ap.error("--device cuda but no GPU is visible")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.chunk = args.chunk or (8192 if args.device == "cuda" else 2048)
    args.warmup_len = args.warmup_len or (args.chunk + 300 if args.device == "cuda" else 300)
    if args.experts is None and args.preset != "tiny":
        args.experts = 8
    if args.device == "cpu":
        torch.set_num_threads(args.threads)

    res: dict[str, Any] = measure(args)
    print(f"prefix cache, {args.preset} preset on {args.device} ({args.dtype}), chunk {args.chunk}")
    print(f"{'workload':<8} {'cache':<5} {'reqs':>4} {'TTFT mean':>10} {'TTFT med':>9} {'TTFT max':>9} "
          f"{'tok/s':>9} {'prefilled':>10} {'cached':>8} {'wall s':>7}")
    for name in args.workloads:
        for mode in ("off", "on"):
            r = res[mode][name]
            print(f"{name:<8} {mode:<5} {r['requests']:>4} {r['ttft_mean_s']:>9.3f}s {r['ttft_median_s']:>8.3f}s "
                  f"{r['ttft_max_s']:>8.3f}s {r['throughput_tok_s']:>9.1f} {r['prefilled_tokens']:>10} "
                  f"{r['cached_tokens']:>8} {r['wall_s']:>7.2f}")
        on, off = res["on"][name], res["off"][name]
        same = on["outputs"] == off["outputs"]
        print(f"{name:<8} speed-up: TTFT mean x{off['ttft_mean_s'] / on['ttft_mean_s']:.2f}, throughput "
              f"x{on['throughput_tok_s'] / off['throughput_tok_s']:.2f}; same greedy tokens with and without: {same}")
        res[f"{name}_same_tokens"] = same
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.out.write_text(json.dumps({"args": meta, **res}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
