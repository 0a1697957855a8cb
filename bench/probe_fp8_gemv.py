"""Launch shapes of the FP8 CUDA-core GEMV (``fp8_gemm._fp8_gemv_kernel``) at decode sizes.

At batch 1 the FP8 linears of a layer are five GEMVs of 1-32 MB each, and they ran at 5-47% of
copy bandwidth (docs/PERF.md, session 10): too few bytes in flight per SM. This times every
``Fp8GemvConfig`` of a grid (rows per program, K splits, warps, stages) on each of Flash's FP8
shapes as the engine runs them (the stacked ``wq_a + wkv`` and shared ``w1 + w3`` included), end
to end (the GEMV and, with K split, the split-sum launch), as CUDA-graph replays after an L2
flush, beside the shape rule's pick; floor = weight + scale bytes / copy bandwidth of the same
run. Every timed config's fp32 output is checked against the shape rule's: both sum the same
products, only the split points move, so they agree within twice the fp32 bound of the sums
((128 + blocks + 2) 2^-24 of the absolute terms); the worst ratio to it is printed.

    python3 bench/probe_fp8_gemv.py [--m 1,4] [--out FILE.json]
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

from bench_kernels import cold_replay_us  # noqa: E402
from dsv4_backend.kernels.fp8_gemm import (  # noqa: E402
    QBLOCK, Fp8GemvConfig, act_quant_fp8, fp8_block_gemm, pick_gemv_config,
)

# Flash's FP8 linears at decode, as the engine stacks them: (name, N, K)
SHAPES = [("wq_a+wkv", 1024 + 512, 4096), ("wq_b", 32768, 1024), ("wq_b+indexer.wq_b", 32768 + 8192, 1024),
          ("wo_b", 4096, 8192), ("shared w1+w3", 4096, 4096), ("shared w2", 4096, 2048)]


def copy_gbps() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = cold_replay_us(lambda: b.copy_(a), rep=10)
    return 2 * a.numel() / us / 1e3


def configs(N: int, K: int):
    nb = -(-K // QBLOCK)
    for block_n, split, warps, stages in itertools.product((16, 32, 64, 128), (1, 2, 4, 8, 16, 32), (2, 4, 8),
                                                           (2, 3, 4)):
        if split <= nb and block_n * 8 * 16 // (32 * warps) >= 16:   # >= 16 bytes per thread
            yield Fp8GemvConfig(block_n, split, warps, stages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1", help="activation rows (comma-separated)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    bw = copy_gbps()
    print(f"copy bandwidth {bw:.0f} GB/s")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for M in (int(m) for m in args.m.split(",")):
        for name, N, K in SHAPES:
            w = (torch.randn(N, K, device="cuda", generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
            ws = torch.pow(2.0, torch.randint(-12, -4, (-(-N // 128), -(-K // 128)), device="cuda",
                                              generator=gen).float())
            xq, xs = act_quant_fp8(torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16))
            floor_us = (w.numel() + ws.numel() * 4) / bw / 1e3
            rule = pick_gemv_config(N, K, torch.cuda.get_device_properties(0).multi_processor_count, M)
            ref = fp8_block_gemm(xq, xs, w, ws, torch.float32, rule, "triton")
            nb = -(-K // QBLOCK)
            a_abs = xq.float().abs() * xs.repeat_interleave(QBLOCK, 1)[:, :K]
            w_abs = w.float().abs() * ws.repeat_interleave(QBLOCK, 0)[:N].repeat_interleave(QBLOCK, 1)[:, :K]
            bound = 2 * (QBLOCK + nb + 2) * 2.0 ** -24 * (a_abs @ w_abs.T)    # two fp32 sums of the same terms
            del w_abs
            timed = []
            for cfg in configs(N, K):
                try:
                    us = cold_replay_us(lambda cfg=cfg: fp8_block_gemm(xq, xs, w, ws, torch.bfloat16, cfg, "triton"),
                                        rep=20)
                except Exception as e:   # a config the compiler refuses (registers, shared memory)
                    print(f"  {name} {cfg}: {type(e).__name__}")
                    continue
                out = fp8_block_gemm(xq, xs, w, ws, torch.float32, cfg, "triton")
                ratio = float(((out - ref).abs() / bound.clamp_min(1e-30)).max())
                timed.append((us, cfg, ratio))
            timed.sort(key=lambda r: r[0])
            rule_us = next(us for us, cfg, _ in timed if cfg == rule) if any(c == rule for _, c, _ in timed) \
                else cold_replay_us(lambda: fp8_block_gemm(xq, xs, w, ws, torch.bfloat16, rule, "triton"), rep=20)
            best_us, best, best_ratio = timed[0]
            print(f"M={M} {name:20s} N={N:6d} K={K:5d} floor {floor_us:6.2f} us | rule {rule} {rule_us:6.2f} us "
                  f"({100 * floor_us / rule_us:4.1f}%) | best {best} {best_us:6.2f} us ({100 * floor_us / best_us:4.1f}%)"
                  f" | worst split-order ratio {max(r for _, _, r in timed):.3f}")
            for us, cfg, _ in timed[1:6]:
                print(f"      next: {cfg} {us:6.2f} us")
            rows.append({"M": M, "name": name, "N": N, "K": K, "floor_us": floor_us, "rule": list(rule),
                         "rule_us": rule_us, "best": list(best), "best_us": best_us,
                         "top": [[list(c), us] for us, c, _ in timed[:10]]})
    if args.out:
        args.out.write_text(json.dumps({"copy_gbps": bw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
