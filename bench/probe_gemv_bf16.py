"""The one-row bf16 GEMV (kernels/bf16_gemv.py) against cuBLAS on the bf16 benchmark model's projections.

Flash's attention projections at one token (bf16 weights): ``wq_b`` 32,768 x 1,024, CSA's
``wq_b`` + ``indexer.wq_b`` 40,960 x 1,024, ``wo_a`` 8 groups of 1,024 x 4,096, ``wo_b`` 4,096 x
8,192, ``wq_a`` + ``wkv`` 1,536 x 4,096. Each is timed as a CUDA graph of 8 calls over 8 copies of
the weight (512 MB at most: every call reads its weight from HBM), us a call, against the weight's
bytes over the copy bandwidth measured in the same run; cuBLAS is ``F.linear`` (the einsum for
``wo_a``), the GEMV the default launch and each rows-a-program x columns-a-step; every output is
checked against cuBLAS's within one bf16 step.

    python3 bench/probe_gemv_bf16.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parent
for p in (ROOT, ROOT.parent):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_kernels import measure_ceilings  # noqa: E402

from dsv4_backend.kernels.bf16_gemv import GemvConfig, bf16_gemv  # noqa: E402

SHAPES = (("wq_b", 32768, 1024, 1), ("wq_b+indexer", 40960, 1024, 1), ("wo_a", 8192, 4096, 8),
          ("wo_b", 4096, 8192, 1), ("wq_a+wkv", 1536, 4096, 1))
COPIES = 8


def graph_us(calls) -> float:
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    return do_bench(graph.replay, warmup=5, rep=50, return_mode="median") * 1e3 / len(calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    bw = measure_ceilings().copy_gbps
    print(f"copy {bw:.0f} GB/s", flush=True)
    results = []
    for name, N, K, G in SHAPES:
        ws = [torch.randn(N, K, device="cuda").bfloat16() for _ in range(COPIES)]
        x = torch.randn(1, K * G, device="cuda").bfloat16()
        floor = N * K * 2 / bw / 1e3
        if G == 1:
            ref = F.linear(x, ws[0])
            cublas = [lambda w=w: F.linear(x, w) for w in ws]
        else:
            ref = torch.einsum("tgi,gri->tgr", x.view(1, G, K), ws[0].view(G, N // G, K)).reshape(1, N)
            cublas = [lambda w=w: torch.einsum("tgi,gri->tgr", x.view(1, G, K), w.view(G, N // G, K)) for w in ws]
        rows = [dict(shape=name, kernel="cublas", us=graph_us(cublas))]
        configs = [None] + [GemvConfig(bn, bk) for bn, bk in itertools.product((8, 16, 32), (256, 512, 1024))]
        for cfg in configs:
            try:
                y = bf16_gemv(x, ws[0], groups=G, config=cfg)
                ok = bool(((y.float() - ref.float()).abs() <= 2 ** -7 * ref.float().abs() + 1e-2).all())
                us = graph_us([lambda w=w: bf16_gemv(x, w, groups=G, config=cfg) for w in ws])
            except Exception as e:  # noqa: BLE001 (a launch shape that does not compile is reported)
                print(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            rows.append(dict(shape=name, kernel="gemv", config=None if cfg is None else list(cfg), us=us, ok=ok))
        for r in rows:
            r.update(floor_us=floor, pct_copy=100 * floor / r["us"])
        results.extend(rows)
        best = min((r for r in rows if r["kernel"] == "gemv"), key=lambda r: r["us"])
        default = next(r for r in rows if r["kernel"] == "gemv" and r["config"] is None)
        print(f"{name:13s} N {N:6d} K {K:5d} G {G}: floor {floor:6.2f} us | cuBLAS {rows[0]['us']:6.2f} "
              f"({rows[0]['pct_copy']:4.1f}%) | GEMV default {default['us']:6.2f} ({default['pct_copy']:4.1f}%, "
              f"{'ok' if default['ok'] else 'DIFFERS'}) | best {best['us']:6.2f} {best['config']}", flush=True)
        del ws
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
