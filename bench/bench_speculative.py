"""Speculative decoding (the MTP layer drafting K tokens, one verify of K + 1 rows) vs plain decoding.

The Flash-shaped model of bench_long_context.py (43 layers + the MTP layer, Flash's attention
shapes, MoE cut to ``--experts`` routed experts, random bf16 weights drawn on the GPU) through
the Engine, with synthetic contexts (``Engine.add_synthetic_request``). Random weights make the
MTP's real acceptance rate meaningless, so the speculative engine's step is timed at every
*forced* acceptance length L = 1 .. K + 1 (``SpeculativeDecoder.accept_override``: L - 1
drafts accepted whatever they are): a step then drafts K tokens (K - 1 MTP passes), verifies
K + 1 rows per request, rolls back, and runs the MTP pass over the L kept positions. Each row
reports ms per step and the tokens/s that acceptance length gives (batch x L per step), beside
plain decoding; both with CUDA graphs on (the engine's default: plain decode steps and verify
steps replay graphs, so do the MTP draft passes and the MTP pass over the kept positions; the
snapshot, the restore and sampling run eagerly), and the speculative engine once more with
graphs off at L = 1 and K + 1 (what the graphs save). Each row says how many target-forward
graph replays a step made (1.00: every step's verify or decode replayed) and how many MTP
replays (K with graphs: K - 1 drafts and the kept pass). Per context and
batch it also prints the break-even acceptance length (the smallest L whose tokens/s beats
plain decoding with graphs).

    # one H200, ~5-6 minutes (two model builds, 4K and 128K x batch 1 and 32, K = 3; a time guard
    # skips what would start after --time-budget seconds, default 260, and lists it)
    PYTHONUNBUFFERED=1 python3 bench/bench_speculative.py --out $OUT/spec.json
    # the code path on the CPU, tiny stand-in
    python bench/bench_speculative.py --preset tiny --device cpu --contexts 512 --batches 1,2 --steps 2

What is measured: wall time of ``Engine.step()`` (synchronised) over ``--steps`` steps after
``--warmup`` untimed ones (Triton compiles and graphs are captured there), per configuration.
Then, per row, ``--split-steps`` more steps (default 3; 0: none) with the step split
(bench/spec_step_split.py: each phase timed between device synchronisations: MTP drafts,
snapshot, the target forward (the verify replay), sampling / acceptance, restore, the MTP pass
over the kept positions, truncation, the rest; shares, since the synchronisations remove the
overlap), the target and MTP graphs' own host preparation and replay GPU time, and on CUDA the
host synchronisations per step by source line (``kernel_count.count_syncs``, 2 steps).
Not measured: a real acceptance rate (needs the release's weights).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

START = time.time()

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._bench_common import admit_synthetic, finish_all, fmt_tokens, sync  # noqa: E402
from bench.bench_long_context import memory_setup, model_config, model_defaults, plan_for  # noqa: E402
from bench.kernel_count import count_syncs  # noqa: E402
from bench.spec_step_split import SpecStepSplit, split_line  # noqa: E402
from dsv4_backend import Engine  # noqa: E402


def build(cfg: Any, args: argparse.Namespace, mem: Any, k: Optional[int]) -> Engine:
    kw: dict[str, Any] = dict(
        preset=args.preset, device=args.device, dtype=args.dtype, skip_tokenizer_init=True, random_seed=0,
        max_running_requests=mem.max_running, chunked_prefill_size=8192, context_length=mem.context_length,
        swa_ratio=0.1, config_overrides={"n_routed_experts": cfg.n_routed_experts,
                                         "num_experts_per_tok": cfg.num_experts_per_tok},
        random_weights_on_device=torch.device(args.device).type == "cuda")
    if mem.mem_fraction is not None:
        kw["mem_fraction_static"] = mem.mem_fraction
    else:
        kw["max_total_tokens"] = plan_for(cfg, "compressed", mem).max_full_tokens
    if k is not None:
        kw.update(speculative_algorithm="EAGLE", speculative_num_steps=k, speculative_eagle_topk=1,
                  speculative_num_draft_tokens=k + 1)
    return Engine(**kw)


def timed(eng: Engine, steps: int) -> tuple[float, int]:
    """(ms per step, tokens emitted) over ``steps`` engine steps."""
    sync(eng.device)
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        tokens += sum(len(o.delta_ids) for o in eng.step())
    sync(eng.device)
    return 1e3 * (time.perf_counter() - t0) / steps, tokens


SYNC_STEPS = 2       # steps whose host synchronisations are counted (CUDA)


def steps_per_row(args: argparse.Namespace) -> int:
    """Engine steps one row runs: warm-up, timed, split, synchronisation count."""
    return args.warmup + args.steps + args.split_steps + SYNC_STEPS


def graph_stats(graphs: Any) -> Optional[dict]:
    return None if graphs is None else graphs.stats()


def measure(eng: Engine, ctx: int, batch: int, args: argparse.Namespace, lengths: list[Optional[int]]) -> list[dict]:
    """One row per forced acceptance length (None: plain decoding / the MTP's own drafts)."""
    k = args.k
    per = steps_per_row(args)
    rids = admit_synthetic(eng, ctx, batch, max_new_tokens=per * (k + 1) * len(lengths) + 8)
    rows = []
    graphs = eng.runner.cuda_graphs
    try:
        spec = eng.scheduler.spec
        for L in lengths:
            if spec is not None:
                spec.accept_override = None if L is None else (lambda rid, n, a=L - 1: a)
            timed(eng, args.warmup)
            replays = graphs.replays if graphs is not None else 0
            mtp_graphs = spec.mtp_graphs if spec is not None else None
            mtp_replays = mtp_graphs.replays if mtp_graphs is not None else 0
            for g in (graphs, mtp_graphs):
                if g is not None:
                    g.reset_stats()
            ms, tokens = timed(eng, args.steps)
            row = {"context": ctx, "batch": batch, "accept_length": L, "ms_per_step": ms,
                   "tokens_per_step": tokens / args.steps, "tokens_per_s": tokens / (ms * args.steps) * 1e3,
                   "graph_replays_per_step": ((graphs.replays if graphs is not None else 0) - replays)
                   / args.steps,
                   "mtp_replays_per_step": ((mtp_graphs.replays if mtp_graphs is not None else 0) - mtp_replays)
                   / args.steps,
                   # means per replay over the timed steps: host preparation, the replay's GPU time
                   "target_graph_stats": graph_stats(graphs), "mtp_graph_stats": graph_stats(mtp_graphs)}
            if args.split_steps:
                with SpecStepSplit(eng) as split:
                    for _ in range(args.split_steps):
                        split.step()
                row["split_ms"] = split.means()
            syncs = count_syncs(eng, SYNC_STEPS)
            row["syncs_per_step"] = sum(syncs.values()) / SYNC_STEPS if eng.device.type == "cuda" else None
            row["syncs_by_line"] = syncs
            rows.append(row)
    finally:
        finish_all(eng, rids)
    return rows


def graph_agreement(eng: Engine, n_prompt: int = 300, n_new: int = 24) -> dict:
    """Greedy tokens of one request with the MTP's own drafts, graphs on vs off (the same
    engine). bf16 on a GPU: the bucketed static tables tile some kernels differently, so the two
    may part at a near-tie of random weights; reported (the index of the first difference), not
    asserted."""
    ids = torch.randint(0, eng.config.vocab_size, (n_prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    params = {"temperature": 0, "max_new_tokens": n_new, "ignore_eos": True}
    spec, runner = eng.scheduler.spec, eng.runner
    spec.accept_override = None
    kept = runner.cuda_graphs, spec.mtp_graphs
    replays = kept[0].replays if kept[0] is not None else 0
    with_graphs = eng.generate(input_ids=[ids], sampling_params=params)[0]["output_ids"]
    replays = (kept[0].replays if kept[0] is not None else 0) - replays
    runner.cuda_graphs, spec.mtp_graphs = None, None
    try:
        eager = eng.generate(input_ids=[ids], sampling_params=params)[0]["output_ids"]
    finally:
        runner.cuda_graphs, spec.mtp_graphs = kept
    first = next((i for i, (a, b) in enumerate(zip(with_graphs, eager)) if a != b), None)
    return {"tokens": n_new, "graph_replays": replays, "first_difference": first}


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash", choices=["flash", "pro", "tiny"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    ap.add_argument("--experts", type=int, default=None, help="routed experts (default 8; the preset's for tiny)")
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 131072])
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    ap.add_argument("--k", type=int, default=3, help="speculative_num_steps (drafts per verify)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--split-steps", type=int, default=3,
                    help="steps per row timed phase by phase (bench/spec_step_split.py); 0: no split")
    ap.add_argument("--mem-fraction", type=float, default=0.92)
    ap.add_argument("--reserve-gb", type=float, default=14.0)
    ap.add_argument("--time-budget", type=float, default=260.0,
                    help="seconds for the whole run; configurations that would start later are skipped (and listed)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    cuda = model_defaults(args)
    if not cuda:
        torch.set_num_threads(1)
    # what bench_long_context.memory_setup reads
    args.prefill_contexts, args.prefill_long, args.max_batch, args.cpu_pool_tokens = [], 0, max(args.batches), 0
    args.mixed_prefill = 0
    cfg = model_config(args)
    headroom = steps_per_row(args) * (args.k + 1) * (args.k + 2) + 64
    mem = memory_setup(cfg, args, torch.device(args.device), headroom)
    print("\n".join(mem.notes), flush=True)
    report: dict[str, Any] = {"k": args.k, "preset": args.preset, "experts": cfg.n_routed_experts,
                              "device": torch.cuda.get_device_name() if cuda else "cpu", "rows": []}
    lengths = list(range(1, args.k + 2))
    report["skipped"] = []
    # (engine, mode name, graphs on, acceptance lengths): plain and speculative engines with
    # their CUDA graphs, then the speculative one with graphs switched off
    runs = [(None, "plain, graphs", True, [None]), (args.k, f"EAGLE K={args.k}, graphs", True, lengths + [None]),
            (args.k, f"EAGLE K={args.k}, eager", False, [1, args.k + 1])]
    eng, built_for = None, "none"
    for k, name, graphs, ls in runs:
        if not cuda and not graphs:
            continue    # no graphs on the CPU: the rows above ran eagerly already
        if built_for != ("plain" if k is None else "spec"):
            eng = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            t = time.time()
            eng = build(cfg, args, mem, k)
            built_for = "plain" if k is None else "spec"
            print(f"[{time.time() - START:6.1f}s] built {built_for} engine in {time.time() - t:.1f}s", flush=True)
        if k is not None and graphs:
            try:
                report["graph_agreement"] = g = graph_agreement(eng)
                print(f"[{time.time() - START:6.1f}s] greedy with MTP drafts, graphs vs eager: {g['tokens']} tokens, "
                      f"{g['graph_replays']} replays, first difference at "
                      f"{'none' if g['first_difference'] is None else g['first_difference']}", flush=True)
            except Exception as e:  # noqa: BLE001 (a check, not the benchmark: report and go on)
                report["graph_agreement"] = f"failed: {type(e).__name__}: {e}"
                print(f"  graph agreement check failed: {type(e).__name__}: {e}", flush=True)
        if not graphs:
            eng.runner.cuda_graphs = None
            if eng.scheduler.spec is not None:
                eng.scheduler.spec.mtp_graphs = None
        for ctx in args.contexts:
            for b in args.batches:
                if b > eng.scheduler.cfg.max_running_requests:
                    report["skipped"].append(f"{name} ctx {ctx} b {b}: above max_running_requests")
                    continue
                if time.time() - START > args.time_budget:
                    report["skipped"].append(f"{name} ctx {ctx} b {b}: past the time budget")
                    print(f"  skipped {name} ctx {fmt_tokens(ctx)} b {b}: past --time-budget", flush=True)
                    continue
                for row in measure(eng, ctx, b, args, ls):
                    row["mode"] = name
                    report["rows"].append(row)
                    L = row["accept_length"]
                    what = "plain" if k is None else ("MTP drafts" if L is None else f"L={L}")
                    print(f"[{time.time() - START:6.1f}s] {name:<20} ctx {fmt_tokens(ctx):>5} b {b:>3} {what:<10} "
                          f"{row['ms_per_step']:8.2f} ms/step  {row['tokens_per_s']:9.1f} tok/s  "
                          f"replays/step {row['graph_replays_per_step']:.2f} target, {row['mtp_replays_per_step']:.2f} MTP",
                          flush=True)
                    syncs = "" if row["syncs_per_step"] is None else f"; {row['syncs_per_step']:.1f} host syncs/step"
                    if "split_ms" in row or syncs:
                        split = split_line(row["split_ms"]) if "split_ms" in row else ""
                        print(f"{'':>9}{split}{syncs}", flush=True)
                if args.out:
                    args.out.write_text(json.dumps(report, indent=1))
        if k is not None and graphs:
            report["accept_stats_mtp_drafts"] = eng.stats()["speculative"]
    print("\nbreak-even: smallest forced acceptance length whose tok/s beats plain decoding (graphs on)")
    for ctx in args.contexts:
        for b in args.batches:
            base = [r for r in report["rows"] if r["mode"] == runs[0][1] and (r["context"], r["batch"]) == (ctx, b)]
            spec = [r for r in report["rows"] if r["mode"] == runs[1][1] and (r["context"], r["batch"]) == (ctx, b)
                    and r["accept_length"] is not None]
            if base and spec:
                win = [r["accept_length"] for r in spec if r["tokens_per_s"] > base[0]["tokens_per_s"]]
                print(f"  ctx {fmt_tokens(ctx):>5} b {b:>3}: plain {base[0]['tokens_per_s']:.1f} tok/s; "
                      f"L = {min(win) if win else 'none up to K+1'}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
