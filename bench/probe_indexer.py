"""The indexer's scores at decode shapes: bf16 products, fp16 products, FP8 products, launch shapes.

The benchmark model's decode step scans every visible C4 indexer row of each CSA layer: at
1M x 1 a 34.6 MB scan took 19.7 us (42% of copy bandwidth), at 128K x 17 48.5 us (36%)
(docs/PERF.md, session 12). The exact products up-convert the e4m3 rows to bf16, several
instructions per code; ``IndexerConfig(products="f16")`` divides each head's q by its
power-of-two FP8 scale instead, so the rows convert to fp16 (one instruction per two codes)
and every product and sum is the bf16 path's times that power of two: the same scores.

This times, at the benchmark rows' shapes (batch x context: 1 x 1M, 4 x 1M, 17 x 128K, 39 x 128K,
1 x 4K), each kind of product at its default launch, then the fp16 products at each rows-a-program x
page-ids-a-load x pipeline depth, each against the copy-bandwidth floor of its bytes (rows x 132 +
q, measured in the same run); and checks that the fp16 scores equal the bf16 ones bit for bit.

    python3 bench/probe_indexer.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
for p in (ROOT, ROOT.parent):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_kernels import indexer_inputs, measure_ceilings, time_indexer  # noqa: E402

from dsv4_backend.kernels.indexer import IndexerConfig, indexer_scores  # noqa: E402

SHAPES = ((1, 1 << 20), (4, 1 << 20), (17, 1 << 17), (39, 1 << 17), (1, 1 << 12))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--no-sweep", action="store_true", help="only the default launches and the check")
    args = ap.parse_args()
    ceil = measure_ceilings()
    print(f"copy {ceil.copy_gbps:.0f} GB/s", flush=True)
    results = []

    def run(b, ctx, what, x, fp8=False, **cfg):
        try:
            r = time_indexer(b, ctx, ceil, fp8, inputs=x, config=IndexerConfig(**cfg))[0]
        except Exception as e:  # noqa: BLE001 (a launch shape that does not compile is reported)
            print(f"  {what} {cfg}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            return None
        results.append(dict(batch=b, context=ctx, variant=what, **cfg, us=r.us, floor_us=r.floor_us,
                            pct_copy_bw=r.pct_copy_bw))
        print(f"  b {b:2d} ctx {ctx // 1024:5d}K {what:5s} {cfg}: {r.us:7.2f} us, floor {r.floor_us:6.2f} "
              f"({r.pct_copy_bw:5.1f}% of copy)", flush=True)
        return r.us

    for b, ctx in SHAPES:
        x = indexer_inputs(b, ctx)
        kw = dict(page_table=x["table"], num_visible=x["nvis"])
        s16 = indexer_scores(x["q"], x["w"], x["pool"], config=IndexerConfig(products="f16"), **kw)
        sbf = indexer_scores(x["q"], x["w"], x["pool"], config=IndexerConfig(products="bf16"), **kw)
        same = bool(torch.equal(s16, sbf))
        diff = float((s16 - sbf).abs().max())
        print(f"b {b} ctx {ctx // 1024}K: fp16 scores {'== bf16 scores bit for bit' if same else 'DIFFER'} "
              f"(max |diff| {diff:.3g})", flush=True)
        results.append(dict(batch=b, context=ctx, check="f16 == bf16", same=same, max_diff=diff))
        run(b, ctx, "bf16", x, products="bf16")
        run(b, ctx, "f16", x, products="f16")
        run(b, ctx, "fp8", x, fp8=True)
        if args.no_sweep or ctx < (1 << 17):
            continue
        for chunk, group, stages, warps in itertools.product((512, 1024, 2048, 4096), (1, 4), (2, 3), (4, 8)):
            if warps == 8 and (group, stages) != (4, 2):
                continue
            run(b, ctx, "f16", x, products="f16", chunk=chunk, group=group, num_stages=stages, num_warps=warps)
        del x
        torch.cuda.empty_cache()
    best = {}
    for r in results:
        if "us" in r and r["variant"] == "f16":
            key = (r["batch"], r["context"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    for (b, ctx), r in best.items():
        print(f"fastest f16 at b {b} ctx {ctx // 1024}K: {r['us']:.2f} us ({r['pct_copy_bw']:.1f}%) "
              f"chunk {r.get('chunk')} group {r.get('group')} stages {r.get('num_stages')} warps {r.get('num_warps')}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
