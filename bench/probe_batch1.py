"""Launch shapes of the small-batch kernels a decode step at batch 1 spends its latency in.

Sparse decode: at batch 1 a window-only layer launches one program (64 heads in one block, two
key tiles, no split) and took ~20 us per layer in the 4-layer breakdown (docs/PERF.md, session
10). This times every ``DecodeAttentionConfig`` of a grid (heads per program, keys per tile,
warps) at every split count on Flash's key lists at 4K and 1M (window only; HCA 4K: 128 + 32;
CSA: 128 + 512; HCA 1M: 128 + 8192) at batch 1 and 4, as CUDA-graph replays after an L2 flush,
beside what ``sparse_decode`` picks by itself (``decode_launch_rule``); each output is checked against the default
config's (bf16 outputs of the same softmax: relative L2 error under 1e-2, a wrong index gives
order 1).

MoE gate scores: one token against 256 experts x 4,096 (bf16), at each experts-per-program
count, beside ``scores_block_e``'s pick.

The mHC kernels' launch shapes have their own probe, bench/probe_mhc.py.

Compressor projections: one token through a layer's stacked bf16 compressor weights (CSA: C4
and indexer compressors, 2,560 x 4,096; HCA: 1,024 x 4,096) as the model runs them, one cuBLAS
GEMM with float32 output (``layers/fp32_products.py``), the same products as ``W x^T``, and a
bf16-output GEMV (the weight read's speed), beside the weight read at the copy bandwidth.

    python3 bench/probe_batch1.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_kernels import cold_replay_us, decode_inputs  # noqa: E402
from dsv4_backend.kernels import moe_gate as gate_mod  # noqa: E402
from dsv4_backend.kernels.sparse_attention import DecodeAttentionConfig, sparse_decode  # noqa: E402

# (name, decode_inputs case, context): the extra list of each layer kind at batch 1
LISTS = [("window", "flash_hca", 0), ("hca_4k", "flash_hca", 4096), ("csa_4k", "flash_csa", 4096),
         ("hca_1m", "flash_hca", 1 << 20)]


def decode_cases(batch: int):
    for name, case, ctx in LISTS:
        x = decode_inputs(case, batch, ctx or 8192, rotate=1)   # (window only: no extra list)
        yield name, x, 0 if ctx == 0 else x["k"]


def run_decode(x, k: int, config, splits):
    """One launch on the case's inputs (window only when k is 0). The timings replay it from a
    CUDA graph after an L2 flush, so one input set serves."""
    win, ext = x["sets"][0]
    return sparse_decode(x["q"], x["swa"], win, x["extra"] if k else None, ext[:, :k] if k else None, x["sink"],
                         512 ** -0.5, num_splits=splits, config=config).out


def probe_decode(batch: int, results: list) -> None:
    grid = [DecodeAttentionConfig(bh, bn, w, 1, "word", True)
            for bh, bn, w in itertools.product((16, 32, 64), (32, 64), (4, 8))]
    for name, x, k in decode_cases(batch):
        tiles = -(-128 // 64) + -(-k // 64)
        ref = run_decode(x, k, DecodeAttentionConfig(), None).float()
        auto = cold_replay_us(lambda: run_decode(x, k, None, None))
        rows = []
        for cfg in grid:
            n_tiles = -(-128 // cfg.block_n) + -(-k // cfg.block_n)
            for splits in sorted({1, 2, 4, 8, 16, 32} & set(range(1, n_tiles + 1))):
                try:
                    out = run_decode(x, k, cfg, splits).float()
                    err = float((out - ref).norm() / ref.norm())
                    us = cold_replay_us(lambda: run_decode(x, k, cfg, splits))
                except Exception as e:  # a config that does not compile (out of resources)
                    print(f"  {name} b{batch} {tuple(cfg)[:3]} s{splits}: failed {type(e).__name__}", flush=True)
                    continue
                rows.append(dict(list=name, batch=batch, k=k, block_h=cfg.block_h, block_n=cfg.block_n,
                                 warps=cfg.num_warps, splits=splits, us=us, rel_err=err, ok=err < 1e-2))
        rows.sort(key=lambda r: r["us"])
        results.extend(rows)
        bad = [r for r in rows if not r["ok"]]
        print(f"decode {name:7s} b{batch} (128 + {k} keys, {tiles} tiles of 64): sparse_decode's own pick "
              f"{auto:.2f} us; best:", flush=True)
        for r in rows[:5]:
            print(f"    {r['us']:7.2f} us  block_h {r['block_h']:2d} block_n {r['block_n']:2d} warps "
                  f"{r['warps']} splits {r['splits']:2d}  (err {r['rel_err']:.1e})", flush=True)
        if bad:
            print(f"    {len(bad)} configs off the default's output (worst {max(r['rel_err'] for r in bad):.2e})")


def probe_gate(results: list) -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
    w = (torch.randn(256, 4096, device="cuda") * 0.02).to(torch.bfloat16)
    bias = torch.randn(256, device="cuda") * 0.01
    ref = gate_mod.moe_gate(x, w, bias, 6, 1.5, block_e=8)
    pick = gate_mod.scores_block_e(1, 256, torch.cuda.get_device_properties(0).multi_processor_count)
    for be in (1, 2, 4, 8):
        ids, wt = gate_mod.moe_gate(x, w, bias, 6, 1.5, block_e=be)
        same = bool(torch.equal(ids, ref[0]))
        us = cold_replay_us(lambda: gate_mod.moe_gate(x, w, bias, 6, 1.5, block_e=be))
        results.append(dict(kernel="moe_gate", tokens=1, block_e=be, us=us, same_ids=same))
        print(f"gate T=1 block_e {be}: {us:.2f} us (scores + select){'  <- scores_block_e' if be == pick else ''}"
              f"; ids {'same' if same else 'DIFFER'}", flush=True)


def probe_compressor(results: list) -> None:
    from dsv4_backend.layers.fp32_products import fp32_linear
    from _floor import copy_gbps
    bw = copy_gbps(torch.device("cuda")) * 1e9
    torch.manual_seed(2)
    x = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
    for name, n in (("csa", 2560), ("hca", 1024)):
        w = (torch.randn(n, 4096, device="cuda") * 0.02).to(torch.bfloat16)
        ref = fp32_linear(x, w)
        floor = w.numel() * 2 / bw * 1e6
        # the model's call, then the same products as W x^T (cuBLAS sees N = 1), and a bf16-output
        # GEMV for the speed of the weight read alone (not exact in fp32: not a candidate)
        ways = {"fp32_linear": lambda: fp32_linear(x, w),
                "W @ x^T fp32": lambda: torch.mm(w, x.t(), out_dtype=torch.float32).t(),
                "bf16 out (F.linear)": lambda: torch.nn.functional.linear(x, w)}
        for how, fn in ways.items():
            err = float((fn().float() - ref).abs().max() / ref.abs().max())
            us = cold_replay_us(fn)
            results.append(dict(kernel="compressor_proj", layer=name, rows=n, how=how, us=us, floor_us=floor,
                                max_rel_diff=err))
            print(f"compressor projection {name} ({n} x 4096 bf16, T=1) {how:20s}: {us:6.2f} us, weight read at "
                  f"{bw / 1e9:,.0f} GB/s {floor:.2f} us ({floor / us:.0%}); max diff {err:.1e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4", help="sparse decode batches ('' for none)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results: list = []
    probe_gate(results)
    probe_compressor(results)
    for b in (int(v) for v in args.batches.split(",") if v):
        probe_decode(b, results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
