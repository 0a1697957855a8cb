"""Exactness and timing of the CSA top-k paths (``dsv4_backend/kernels/topk.py``) on a GPU.

    python3 bench/bench_topk.py [--quick | --floor-sweep] [--out DIR]
    TRITON_INTERPRET=1 python bench/bench_topk.py --smoke   # CPU dry run of this script

For every shape (b, L, k) and every variant: exactness against one ``torch.topk`` on the packed
key (the reference) on two fresh inputs, random normal scores and a tie-heavy one (scores
snapped to 17 levels, a -inf tail of random length per row, some rows with fewer than k finite
scores); then two medians, "eager" (``do_bench``: launches included) and "graph"
(``do_bench_cudagraph``: replays of a captured graph, as in the decode step). The scores of one
call fit in L2 up to b * L * 4 B = 60 MB, as they do right after the scores kernel wrote them.
The default path is also timed on the tie-heavy input ("@ties"). Also checks that
``topk_positions`` replays correctly from a captured graph on new inputs, that ``topk_rows``
gives the same rows through the kernels as through ``torch.topk``, and prints a per-kernel
breakdown (torch profiler). The table printed last gives, per shape, the reference, the default
and the fastest exact variant; every number also goes to ``DIR/bench_topk.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dsv4_backend.kernels.topk import TopKConfig, topk_positions, topk_reference  # noqa: E402

def radix(**kw) -> TopKConfig:
    """The radix path at every row length (the all-pairs ranking of short rows off)."""
    return TopKConfig(rank_all_max=0, **kw)


VARIANTS = {
    "torch": TopKConfig(method="torch"),
    "torch2/16K": TopKConfig(method="torch2", segment=16384),
    "default": TopKConfig(),  # short rows ranked all against all (rank_all_max), the radix path above
    "radix": radix(),  # the radix path at every length
    "radix/2K-w8": radix(block=2048, num_warps=8),
    "radix/8xSM": radix(programs=8 * 132),
    "radix/2xSM": radix(programs=2 * 132),
    "radix/no-floor": radix(floor=False),
    "radix/hist-only": radix(sparse=0),
    "radix/plain": radix(floor=False, sparse=0),  # no floor, always tl.histogram
    "radix/sparse512": radix(sparse=512),
    # the floor with a program per 1,024 elements (at b = 1 the floor launch before session 12)
    "radix/floor-1K": radix(floor_tile=1024, floor_segments=1 << 20),
    # every row of up to 2,048 scores (CSA at contexts up to 8K) ranked all against all, whatever b
    "rank-all-2K/any-b": TopKConfig(rank_all_compares=1 << 62),
}
DEFAULT = "default"


def applicable(name: str, L: int, k: int) -> bool:
    if name.startswith("torch2/"):
        return L > VARIANTS[name].segment
    return True


def random_scores(b, L, g, dev):
    return torch.randn(b, L, generator=g).to(dev)


def tie_scores(b, L, k, g, dev):
    s = (torch.randn(b, L, generator=g) * 4).round() / 4
    s.clamp_(-2, 2)  # 17 levels: ties everywhere
    visible = torch.randint(1, L + 1, (b,), generator=g)
    visible[0] = min(L, max(1, k // 2))  # fewer than k finite scores
    s[torch.arange(L)[None, :] >= visible[:, None]] = float("-inf")
    return s.to(dev)


def check(cfg, s, k):
    got = topk_positions(s, k, config=cfg)
    ref = topk_reference(s, k)
    return bool(got.shape == ref.shape and torch.equal(got, ref))


def graph_replay_ok(b, L, k, g, dev) -> bool:
    """Capture topk_positions (default) once, refill the static input, replay, compare."""
    static = random_scores(b, L, g, dev)
    topk_positions(static, k)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = topk_positions(static, k)
    ok = True
    for fresh in (random_scores(b, L, g, dev), tie_scores(b, L, k, g, dev)):
        static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        ok &= torch.equal(out, topk_reference(fresh, k))
    return ok


def topk_rows_ok(g, dev, b=8, L=32768, k=512, P=64) -> bool:
    """indexer.topk_rows through the kernels on ``dev`` == the torch path on CPU copies."""
    import dsv4_backend.kernels.topk as topk_module
    from dsv4_backend.kernels.indexer import topk_rows
    s = tie_scores(b, L, k, g, "cpu")
    table = torch.randperm(2 * b * L // P, generator=g)[: b * L // P].view(b, L // P)
    ids = torch.randint(0, 1 << 20, (b, L), generator=g)
    flag = topk_module.INTERPRET_KERNELS
    try:
        topk_module.INTERPRET_KERNELS = False
        refs = (topk_rows(s, k, page_table=table, page_size=P), topk_rows(s, k, row_ids=ids))
        topk_module.INTERPRET_KERNELS = dev == "cpu"  # CPU: the kernels through the interpreter
        gots = (topk_rows(s.to(dev), k, page_table=table.to(dev), page_size=P),
                topk_rows(s.to(dev), k, row_ids=ids.to(dev)))
    finally:
        topk_module.INTERPRET_KERNELS = flag
    return all(torch.equal(got.cpu(), ref) for got, ref in zip(gots, refs))


def kernel_breakdown(b, L, k, g, dev) -> str:
    """Per-kernel device time of the default path (torch profiler, 10 calls)."""
    from torch.profiler import ProfilerActivity, profile
    s = random_scores(b, L, g, dev)
    topk_positions(s, k)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            topk_positions(s, k)
        torch.cuda.synchronize()
    lines = [f"kernels of topk_positions, b={b} L={L} k={k} (us per call):"]
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if e.device_time_total > 0:
            lines.append(f"  {e.device_time_total / 10:8.1f}  {e.key[:70]}")
    return "\n".join(lines[:12])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (CPU ok)")
    ap.add_argument("--floor-sweep", action="store_true",
                    help="the default against no floor at b 1..64, L 1K..256K, k 512 (where the floor pays)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    if args.smoke:
        shapes = [(2, 300, 16), (1, 1000, 64)]
        variants = {n: c._replace(block=min(c.block, 256), segment=min(c.segment, 128),
                                  sparse=min(c.sparse, 16)) for n, c in VARIANTS.items()}
    elif args.floor_sweep:
        shapes = [(b, L, 512) for L in (1024, 8192, 32768, 262144) for b in (1, 2, 4, 8, 16, 32, 64)]
        variants = {n: VARIANTS[n] for n in ("radix", "radix/no-floor")}
    else:
        bs, Ls, ks = ([1, 32], [1024, 2048, 262144], [512]) if args.quick else \
            ([1, 8, 32, 128], [1024, 2048, 32768, 262144], [512, 1024])
        shapes = [(b, L, k) for L in Ls for b in bs for k in ks]
        variants = VARIANTS
    if dev == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows = []
    if dev == "cuda":
        print(f"topk_rows kernel path == torch path: {topk_rows_ok(g, dev)}", flush=True)
    else:
        print(f"topk_rows kernel path == torch path: {topk_rows_ok(g, dev, 2, 640, 64)}")
    for b, L, k in shapes:
        rs, ts = random_scores(b, L, g, dev), tie_scores(b, L, k, g, dev)
        row = {"b": b, "L": L, "k": k, "exact": {}, "eager_us": {}, "graph_us": {}, "errors": {}}
        for name, cfg in variants.items():
            if not applicable(name, L, k):
                continue
            try:
                row["exact"][name] = check(cfg, rs, k) and check(cfg, ts, k)
                if dev == "cuda":
                    fn = lambda: topk_positions(rs, k, config=cfg)  # noqa: E731
                    row["eager_us"][name] = 1e3 * do_bench(fn, warmup=5, rep=20,
                                                           return_mode="median")
                    row["graph_us"][name] = 1e3 * do_bench_cudagraph(fn, rep=20,
                                                                     return_mode="median")
                    if name == DEFAULT:  # the same code on the tie-heavy input (-inf tails)
                        fn = lambda: topk_positions(ts, k, config=cfg)  # noqa: E731
                        row["graph_us"][name + "@ties"] = 1e3 * do_bench_cudagraph(
                            fn, rep=20, return_mode="median")
            except Exception as e:  # one broken variant must not hide the others
                row["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
        if dev == "cuda" and L in (2048, 262144) and k == 512 and b in (1, 32):
            row["graph_replay_ok"] = graph_replay_ok(b, L, k, g, dev)
        rows.append(row)
        bad = [n for n, ok in row["exact"].items() if not ok]
        print(f"b={b:4d} L={L:7d} k={k:5d} inexact={bad} errors={list(row['errors'])} "
              + " ".join(f"{n}={t:.1f}" for n, t in row["graph_us"].items()), flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_topk.json").write_text(json.dumps(rows, indent=1))
    for r in rows:
        for n, e in r["errors"].items():
            print(f"ERROR b={r['b']} L={r['L']} k={r['k']} {n}: {e}")
    if dev == "cuda" and not (args.quick or args.floor_sweep):
        for b, L in ((1, 262144), (128, 262144)):
            try:
                print(kernel_breakdown(b, L, 512, g, dev))
            except Exception as e:  # the profiler is optional
                print(f"profiler failed: {type(e).__name__}: {e}")
    if dev != "cuda":
        print("smoke:", "all exact" if all(all(r["exact"].values()) for r in rows) else "MISMATCH")
        return
    print_table(rows)


def print_table(rows) -> None:
    print("\nus, median; graph = CUDA-graph replay, eager = launches included; "
          "best = fastest exact variant (graph)")
    print(f"{'b':>4} {'L':>7} {'k':>5} | {'torch g':>8} {'torch e':>8} |"
          f" {'radix g':>7} {'radix e':>7}"
          f" {'@ties g':>7} | {'best':>15} {'us':>7} | {'speedup':>7} | replay")
    nan = float("nan")
    for r in rows:
        g_us, e_us = r["graph_us"], r["eager_us"]
        exact = [n for n, ok in r["exact"].items() if ok and n in g_us and n != "torch"]
        best = min(exact, key=g_us.get) if exact else "-"
        ref = g_us.get("torch", nan)
        print(f"{r['b']:4d} {r['L']:7d} {r['k']:5d} | {ref:8.1f} {e_us.get('torch', nan):8.1f} |"
              f" {g_us.get(DEFAULT, nan):7.1f} {e_us.get(DEFAULT, nan):7.1f}"
              f" {g_us.get(DEFAULT + '@ties', nan):7.1f} | {best:>15} {g_us.get(best, nan):7.1f} |"
              f" {ref / g_us.get(DEFAULT, nan):6.1f}x | {r.get('graph_replay_ok', '')}")


if __name__ == "__main__":
    main()
