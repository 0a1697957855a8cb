"""DeepSeek-V4-Flash at full width over several GPUs (tensor / expert parallel) through the Engine.

The model has every Flash dimension and all 43 layers, its weights random in the release format
(FP8 e4m3 linears with 128 x 128 scales, FP4 e2m1 routed experts with e8m0 scales per 32, kept
quantised), made on each rank's GPU tensor by tensor (``bench_quant_model.synth_tensors``, one
seed per tensor name, so every rank draws the same replicated tensors) and cut by the loader's
split (``dsv4_backend/parallel.py``; a rank never makes another rank's experts). The Engine
starts one process per rank (``--tp-size`` / ``--ep-size``; NCCL, the step broadcast over gloo)
with bench_quant_model's arguments, and the decode / prefill rows are its too (``engine_kwargs``,
``decode_rows``, ``prefill_row``), with this rank's byte floor.

It prints, each beside its floor where one is defined:

- per-collective time (a separate NCCL run of ``world`` processes before the engine, CUDA
  events over eager calls) at the decode and prefill shapes: the hidden-state all-reduce (after
  attention and after each MoE, 86 per step), the indexer-q all-gather (21 CSA layers), the
  logits all-gather, and the collectives' sum per decode step (estimated from those counts);
- decode tokens/s at batch 1, 32 and the plan's maximum, at 4K, 128K and 1M context (synthetic
  contexts), beside the step's byte floor per rank (its weights read + KV read) / copy bandwidth;
- prefill tokens/s at 128K (a real chunked prefill, time-capped).

    # 8 GPUs, TP attention + EP MoE
    PYTHONUNBUFFERED=1 python bench/bench_parallel.py --tp-size 8 --ep-size 8 --out $OUT/tp8.json
    # one H200, the same code path (<= 6 min): NCCL with one rank, the layers that fit
    PYTHONUNBUFFERED=1 timeout 360 python bench/bench_parallel.py --tp-size 1 --nccl-one-rank \
        --time-budget 300 --prefill-max-seconds 60 --out $OUT/tp1.json
    # the code path on the CPU (gloo, 2 ranks, tiny shape)
    python bench/bench_parallel.py --preset tiny --device cpu --tp-size 2 --ep-size 2 \\
        --override '{"moe_intermediate_size": 256, "vocab_size": 1024}' --contexts 300 --batches 1,2 \\
        --prefill-context 600 --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Iterator, Optional

START = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._bench_common import fmt_bytes  # noqa: E402
from bench._floor import decode_step_floor  # noqa: E402
from bench.bench_quant_model import (DTYPE, Budget, _ints, add_budget_args, add_run_args, copy_gbps,  # noqa: E402
                                    decode_rows, engine_kwargs, layer_config, log, prefill_row, synth_tensors)
from dsv4_backend.config import DSV4Config  # noqa: E402
from dsv4_backend.parallel import ParallelConfig, close_ranks, free_port, init_ranks, rank_weight_bytes  # noqa: E402
from dsv4_backend.weights import model_tensors, weight_specs  # noqa: E402
from scheduler_hooks.engine import Engine  # noqa: E402
from scheduler_hooks.parallel_engine import join_as  # noqa: E402


class RankWeights:
    """A ``WeightStream`` of random release-format tensors, made on this rank's device: one
    generator seed per tensor name (the same tensor on every rank), other ranks' experts skipped."""

    quantized, include_mtp = True, False

    def __init__(self, cfg: DSV4Config, tp_size: int, ep_size: int, seed: int):
        self.config, self.tp_size, self.ep_size, self.seed = cfg, tp_size, ep_size, seed

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in model_tensors(self.config, DTYPE, False, True))

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        rank = dist.get_rank() if dist.is_initialized() else 0
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        lo, hi = ParallelConfig(self.tp_size, self.ep_size, rank).expert_range(self.config.n_routed_experts)
        gen = torch.Generator(device=device)
        for spec in weight_specs(self.config, include_mtp=False):
            parts = spec.name.split(".")
            if ".ffn.experts." in spec.name and not lo <= int(parts[parts.index("experts") + 1]) < hi:
                continue
            gen.manual_seed(self.seed * 1_000_003 + zlib.crc32(spec.name.encode()))
            yield from synth_tensors(self.config, spec, gen, device)


# ---- collectives -------------------------------------------------------------------------------

def collective_shapes(cfg: DSV4Config, pc: ParallelConfig, tokens: list[int]) -> list[tuple[str, str, tuple, int]]:
    """(name, op, per-rank tensor shape, calls per step) at each token count."""
    csa = sum(1 for r in cfg.layer_ratios if r == 4)
    L = cfg.num_hidden_layers
    out = []
    for t in tokens:
        attn_calls = L if pc.tp_size == pc.world_size else 0
        out.append((f"hidden all-reduce T={t}", "all_reduce", (t, cfg.hidden_size), attn_calls + L + 1))
        if pc.tp_size == pc.world_size:
            out.append((f"indexer q all-gather T={t}", "all_gather",
                        (t, cfg.index_n_heads // pc.tp_size * cfg.index_head_dim), csa))
        out.append((f"logits all-gather T={min(t, 256)}", "all_gather",
                    (min(t, 256), cfg.vocab_size // pc.world_size), 1))
    return out


def _collective_worker(rank: int, pc_args: tuple, port: int, device_type: str, shapes: list, iters: int, q) -> None:
    tp, ep = pc_args
    pc = ParallelConfig(tp, ep, rank)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    group = init_ranks(pc, port, device)
    comm = group.shard.comm
    res = []
    for name, op, shape, calls in shapes:
        dtype = torch.float32 if name.startswith("logits") else DTYPE
        x = torch.randn(shape, device=device).to(dtype)
        fn = (lambda: comm.all_reduce(x)) if op == "all_reduce" else (lambda: comm.all_gather(x, -1))
        for _ in range(5):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize(device)
            ms = start.elapsed_time(end) / iters
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            ms = (time.perf_counter() - t0) * 1e3 / iters
        res.append({"collective": name, "shape": list(shape), "dtype": str(dtype), "calls_per_step": calls,
                    "ms": ms, "bytes": x.numel() * x.element_size()})
    if rank == 0:
        q.put(res)
    close_ranks()


def time_collectives(cfg: DSV4Config, pc: ParallelConfig, device: torch.device, tokens: list[int],
                     iters: int) -> list[dict[str, Any]]:
    shapes = collective_shapes(cfg, pc, tokens)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_collective_worker,
                         args=(r, (pc.tp_size, pc.ep_size), port, device.type, shapes, iters, q))
             for r in range(pc.world_size)]
    for p in procs:
        p.start()
    try:
        return q.get(timeout=300)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.terminate()


# ---- the run -----------------------------------------------------------------------------------

def rank_step_bytes(cfg: DSV4Config, pc: ParallelConfig, batch: int, context: int) -> float:
    """One rank's bytes read per decode step, a floor estimate: the one-GPU weight reads of
    ``bench._floor.decode_step_floor`` divided by the ranks (the small replicated tensors,
    wq_a, wkv, compressors, gate, are counted as split too, so the floor is a little low),
    plus the whole KV read (every rank attends over its full pools)."""
    floor = decode_step_floor(cfg, context, batch, DTYPE, quantized=True)
    return floor.weight_bytes / pc.world_size + floor.kv_bytes


def fitting_layers(base: DSV4Config, pc: ParallelConfig, total: int, args: argparse.Namespace) -> int:
    room = total * args.mem_fraction - (args.kv_gb + args.reserve_gb) * 2 ** 30
    n = base.num_hidden_layers
    while n > 2 and rank_weight_bytes(layer_config(base, n), pc.tp_size, pc.ep_size, quantized=True) > room:
        n -= 1
    return n


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    guard = Budget(args.time_budget)
    pc = ParallelConfig(args.tp_size, args.ep_size)
    base = DSV4Config.preset(args.preset, **json.loads(args.override or "{}"))
    rep: dict[str, Any] = {"meta": {"argv": sys.argv[1:], "device": str(device), "preset": args.preset,
                                    "tp_size": pc.tp_size, "ep_size": pc.ep_size, "nccl_one_rank": args.nccl_one_rank}}
    total = torch.cuda.mem_get_info(0)[1] if device.type == "cuda" else 0
    if device.type == "cuda":
        rep["meta"]["gpu"] = torch.cuda.get_device_name(0)
    n_layers = args.layers or (fitting_layers(base, pc, total, args) if device.type == "cuda"
                               else base.num_hidden_layers)
    cfg = layer_config(base, min(n_layers, base.num_hidden_layers))
    rank_bytes = rank_weight_bytes(cfg, pc.tp_size, pc.ep_size, quantized=True)
    log(f"model: {args.preset} dims, {cfg.num_hidden_layers} of {base.num_hidden_layers} layers, "
        f"{cfg.n_routed_experts} routed experts; {pc.world_size} rank(s) (tp {pc.tp_size}, ep {pc.ep_size}); "
        f"weights {fmt_bytes(sum(t.nbytes for t in model_tensors(cfg, DTYPE, False, True)))} kept quantised, "
        f"{fmt_bytes(rank_bytes)} on the largest rank")
    rep["weights"] = {"layers": cfg.num_hidden_layers, "rank_bytes": rank_bytes}
    bw = copy_gbps(device)
    rep["ceilings"] = {"copy_gbps": bw}
    log(f"copy bandwidth {bw:.0f} GB/s (read + write, one GPU)")

    rep["collectives"] = []
    if (pc.world_size > 1 or args.nccl_one_rank) and not args.skip_collectives:
        rows = time_collectives(cfg, pc, device, args.collective_tokens, args.collective_iters)
        rep["collectives"] = rows
        print("\ncollective                         shape            ms/call   GB/s (algo)  calls/step  ms/step")
        for r in rows:
            print(f"{r['collective']:<34} {str(r['shape']):<16} {r['ms']:8.4f} {r['bytes'] / r['ms'] / 1e6:11.1f} "
                  f"{r['calls_per_step']:10d} {r['ms'] * r['calls_per_step']:8.3f}")
        for t in args.collective_tokens:
            step = sum(r["ms"] * r["calls_per_step"] for r in rows
                       if r["collective"].endswith(f"T={t}") or (r["collective"].startswith("logits")
                                                                 and r["collective"].endswith(f"T={min(t, 256)}")))
            print(f"  collectives per step at T={t}: {step:.3f} ms (estimated from the counts above)")

    kw, headroom = engine_kwargs(args, RankWeights(cfg, pc.tp_size, pc.ep_size, args.seed), rank_bytes, total)
    kw.update(tp_size=pc.tp_size, ep_size=pc.ep_size)
    t0 = time.perf_counter()
    one_rank = join_as(ParallelConfig()) if args.nccl_one_rank else contextlib.nullcontext()
    with one_rank:
        eng = Engine(**kw)
    try:
        build_s = time.perf_counter() - t0
        rep["weights"]["engine_build_s"] = build_s
        plan = eng.plan
        rep["plan"] = {"max_full_tokens": plan.max_full_tokens, "budget_bytes": plan.budget_bytes,
                       "max_running_requests": plan.max_running_requests}
        log(f"engine built in {build_s:.1f} s (weights made on every rank); KV plan per rank: "
            f"{fmt_bytes(plan.budget_bytes)}, {plan.max_full_tokens:,} full tokens; "
            f"CUDA graphs {'on' if getattr(eng.runner, 'cuda_graphs', None) is not None else 'off'}")
        rep["decode"] = decode_rows(eng, args, guard, headroom, bw,
                                    lambda ctx, b: (rank_step_bytes(cfg, pc, b, ctx), {}))
        rep["prefill"] = prefill_row(eng, args, guard)
    finally:
        eng.shutdown()
    return rep


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="flash", choices=("flash", "pro", "tiny"))
    p.add_argument("--override", help="JSON of config keys replacing the preset's (CPU smoke runs)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tp-size", type=int, default=8)
    p.add_argument("--ep-size", type=int, default=None, help="default: --tp-size")
    p.add_argument("--nccl-one-rank", action="store_true",
                   help="with --tp-size 1: a one-rank process group, so every collective and the step broadcast run")
    p.add_argument("--layers", type=int, default=0, help="layers (0: all, or with one GPU as many as fit)")
    add_run_args(p, prefill_max_seconds=90.0)
    p.add_argument("--collective-tokens", type=_ints, default=[1, 32, 64, 8192])
    p.add_argument("--collective-iters", type=int, default=50)
    p.add_argument("--skip-collectives", action="store_true")
    add_budget_args(p)
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args(argv)
    if args.ep_size is None:
        args.ep_size = args.tp_size
    if args.nccl_one_rank and max(args.tp_size, args.ep_size) != 1:
        p.error("--nccl-one-rank is the one-rank run (--tp-size 1)")
    return args


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    rep = run(args)
    rep["meta"]["seconds"] = time.time() - START
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rep, indent=2, default=str))
        log(f"wrote {args.out}")
    return rep


if __name__ == "__main__":
    # run as bench.bench_parallel, so the rank processes can unpickle RankWeights by that name
    from bench.bench_parallel import main as package_main
    package_main()
