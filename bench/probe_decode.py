"""Decode-attention launch configurations side by side, on the cases FlashMLA was timed on.

    python3 bench/probe_decode.py [--out DIR] [--configs all|default]
    python3 bench/probe_decode.py --profile-once CASE BATCH    # one call per config, for ncu

For each configuration of ``bench_kernels.DECODE_CONFIGS``: a correctness check against the
PyTorch reference (batch 4, holes in the lists, an empty request) and the graph/cold times of
Flash CSA at batch 32 and 128, Pro CSA at 128 and Flash HCA (1M context) at 32 and 128. The
best configuration per case and overall is printed; ``bench_kernels.py`` times the full sweep.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import bench_kernels as bk  # noqa: E402
import gpu_check as gc  # noqa: E402
from dsv4_backend.kernels.sparse_attention import DecodeAttentionConfig, sparse_decode  # noqa: E402

CASES = [("flash_csa", 32, 1 << 17), ("flash_csa", 128, 1 << 17), ("pro_csa", 32, 1 << 17),
         ("pro_csa", 128, 1 << 17), ("flash_hca", 32, 1 << 20), ("flash_hca", 128, 1 << 20)]


def profile_once(case: str, batch: int) -> None:
    """Three calls of each configuration (compile, warm, profiled) and nothing else."""
    x = bk.decode_inputs(case, batch, 1 << 20 if "hca" in case else 1 << 17, rotate=2)
    for cfg in bk.DECODE_CONFIGS:
        for _ in range(3):
            win, ext = x["sets"][0]
            sparse_decode(x["q"], x["swa"], win, x["extra"], ext, x["sink"], 512 ** -0.5, config=cfg)
        torch.cuda.synchronize()
        print("profiled", tuple(cfg), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "probe_out"))
    ap.add_argument("--profile-once", nargs=2, metavar=("CASE", "BATCH"))
    args = ap.parse_args()
    if args.profile_once:
        profile_once(args.profile_once[0], int(args.profile_once[1]))
        return
    t0 = time.time()
    ceil = bk.measure_ceilings()
    print(f"copy {ceil.copy_gbps:.0f} GB/s, bf16 {ceil.bf16_tflops:.0f} TFLOP/s", flush=True)
    inputs = {c: bk.decode_inputs(*c) for c in CASES}
    results = []
    for cfg in bk.DECODE_CONFIGS:
        gc.check(f"decode flash_csa b4 holes cfg {tuple(cfg)}",
                 gc.check_decode("flash_csa", 4, 1 << 17, config=cfg, holes=True))
        gc.check(f"decode pro_hca b2 1M cfg {tuple(cfg)}", gc.check_decode("pro_hca", 2, 1 << 20, config=cfg))
        for c in CASES:
            try:
                r = bk.time_decode(*c, ceil, cfg, inputs=inputs[c])
                results.append(r)
                print(bk.row(r), flush=True)
            except Exception as e:
                print(f"  {c} {tuple(cfg)} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    print(f"\nchecks {sum(c['ok'] for c in gc.CHECKS)}/{len(gc.CHECKS)} passed; failed: "
          + ", ".join(c["check"] for c in gc.CHECKS if not c["ok"]))
    print("best per case (graph us):")
    for c in CASES:
        rs = [r for r in results if (r.case, r.batch, r.context) == c]
        if rs:
            b = min(rs, key=lambda r: r.us)
            print(f"  {c}: graph {b.us:.1f} us, cold replay {b.extra['cold_replay_us']:.1f}, cold eager "
                  f"{b.extra['cold_us']:.1f}; {b.extra.get('x_flashmla', float('nan')):.2f}x FlashMLA "
                  f"(eager {b.extra.get('x_flashmla_eager', float('nan')):.2f}x) cfg={tuple(b.extra['config'])}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_decode.json").write_text(json.dumps(
        {"ceilings": vars(ceil), "checks": gc.CHECKS, "results": [vars(r) for r in results]}, indent=1,
        default=str))
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
