"""The packed FP4 experts' kernel with L2 prefetch hints, at decode sizes, on one GPU.

    python3 bench/probe_fp4_l2.py [--tokens 1,2,4,8,16,64] [--ahead 0,2,4,8,16]

At one to four tokens the MMA kernel of ``kernels/fp4_mma.cu`` streams too few bytes per warp to
hide the memory latency (docs/PERF.md, session 8: gate-up 46%, down 38% of copy bandwidth at
T = 1). Two hints, both ``cp.async.bulk.prefetch.L2`` (one instruction asks for a whole range):

- ``l2_ahead`` = n: each warp asks the L2 for its own tile's chunks n ahead of its loads;
- ``next_at`` = 1 / 2: the gate-up CTAs of each selected expert ask for that expert's down
  weights before / after their own K loop, so the down kernel reads them from the L2.

Flash's MoE (E = 256, D = 4096, I = 2048, top-6), random release-format weights packed once,
random distinct experts per token, the shared expert in the same launches as the model runs it
(``fp4_moe_mma(shared=...)``, random e4m3 weights). Each figure is a CUDA-graph replay after an
L2 flush (median, ``bench_kernels.cold_replay_us``) beside its floor: the bytes of the distinct
selected experts (and of the shared expert, end to end) over the copy bandwidth measured in the
same run. A hint changes no arithmetic: every variant's output must equal the variant without
hints bit for bit, else the probe exits 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import bench_kernels as bk  # noqa: E402
from _floor import copy_gbps  # noqa: E402
from dsv4_backend.kernels import fp4_mma as mma  # noqa: E402
from dsv4_backend.kernels.fp8_gemm import act_quant_fp8  # noqa: E402
from dsv4_backend.kernels.fp4_moe_decode import swiglu_quant  # noqa: E402

E, D, I, TOP = 256, 4096, 2048, 6
LIMIT = 10.0
FAILS: list[str] = []


def log(msg: str) -> None:
    print(msg, flush=True)


def same(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if not torch.equal(a, b):
        FAILS.append(name)
        log(f"  [FAIL] {name}: output differs from the run without hints")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,2,4,8,16,64")
    ap.add_argument("--ahead", default="0,2,4,8,16", help="l2_ahead values (chunks) to try")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    aheads = [int(a) for a in args.ahead.split(",")]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def r(lo, hi, shape):
        return torch.randint(lo, hi, shape, dtype=torch.uint8, generator=gen, device=dev)

    w13, s13, w2, s2 = r(0, 256, (E, 2 * I, D // 2)), r(123, 128, (E, 2 * I, D // 32)), \
        r(0, 256, (E, D, I // 2)), r(118, 126, (E, D, I // 32))
    p13, p2 = mma.pack_fp4_mma(w13, s13), mma.pack_fp4_mma(w2, s2)
    del w13, s13, w2, s2

    def e4m3(shape):  # random finite e4m3 codes (0x7F / 0xFF are NaN)
        return (r(0, 255, shape) & 0xFE).view(torch.float8_e4m3fn)
    shared = mma.SharedFp8(e4m3((2 * I, D)), torch.full((2 * I // 128, D // 128), 2.0 ** -7, device=dev),
                           e4m3((D, I)), torch.full((D // 128, I // 128), 2.0 ** -7, device=dev))
    bw = copy_gbps(dev)
    b_up = p13.words[0].numel() * 4 + p13.scales[0].numel() * 4
    b_down = p2.words[0].numel() * 4 + p2.scales[0].numel() * 4
    b_shared = shared.w13.numel() + shared.w2.numel() + 4 * (shared.w13_scale.numel() + shared.w2_scale.numel())
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    log(f"{torch.cuda.get_device_name(dev)}: copy bandwidth {bw:.0f} GB/s, L2 {l2 / 2**20:.0f} MiB; per expert "
        f"gate-up {b_up / 2**20:.2f} MiB, down {b_down / 2**20:.2f} MiB; shared expert {b_shared / 2**20:.2f} MiB")

    for T in tokens:
        ids = torch.rand(T, E, generator=gen, device=dev).topk(TOP, dim=1).indices
        flat = ids.reshape(-1).contiguous()
        n_exp = int(ids.unique().numel())
        x = torch.randn(T, D, generator=gen, device=dev).to(torch.bfloat16)
        wts = torch.rand(T, TOP, generator=gen, device=dev)
        xq, xs = act_quant_fp8(x)
        split = mma.pick_mma_configs(T * TOP)[0].split_k
        hq, hs = swiglu_quant(mma.fp4_gemv_mma(xq, xs, flat, p13, TOP, mma.MmaConfig(split)), flat,
                              wts.reshape(-1).contiguous(), E, LIMIT)
        log(f"\nT={T} ({n_exp} experts, K split {split}), us (% of floor):")
        best = {}
        for proj, b, run in (
                ("gate-up", b_up, lambda c: mma.fp4_gemv_mma(xq, xs, flat, p13, TOP, c)),
                ("down", b_down, lambda c: mma.fp4_gemv_mma(hq, hs, flat, p2, 1, c))):
            floor = n_exp * b / (bw * 1e9) * 1e6
            cells = []
            times = {}
            for sp in sorted({1, 2, split}):
                plain = run(mma.MmaConfig(sp)).clone()
                for a in aheads:
                    cfg = mma.MmaConfig(sp, l2_ahead=a)
                    same(f"T={T} {proj} split {sp} ahead {a}", run(cfg), plain)
                    times[(sp, a)] = bk.cold_replay_us(lambda cfg=cfg: run(cfg))
                    cells.append(f"s{sp}/a{a} {times[(sp, a)]:6.1f} ({100 * floor / times[(sp, a)]:3.0f}%)")
            best[proj] = min(times, key=times.get)
            log(f"  {proj:7s} floor {floor:6.1f} | " + "  ".join(cells))
        floor = (n_exp * (b_up + b_down) + b_shared) / (bw * 1e9) * 1e6
        (su, au), (sd, ad) = best["gate-up"], best["down"]
        base = mma.fp4_moe_mma(x, ids, wts, p13, p2, LIMIT, mma.MmaConfig(split), mma.MmaConfig(split), shared=shared)
        cells = []
        variants = [("no hints", mma.MmaConfig(split), mma.MmaConfig(split))]
        for nx in (0, 1, 2):
            variants.append((f"best ahead ({su}/{au}, {sd}/{ad}) next {nx}",
                             mma.MmaConfig(su, l2_ahead=au, next_at=nx), mma.MmaConfig(sd, l2_ahead=ad)))
            variants.append((f"split ahead 0 next {nx}", mma.MmaConfig(split, next_at=nx), mma.MmaConfig(split)))
        for name, cu, cd in variants:
            fn = lambda cu=cu, cd=cd: mma.fp4_moe_mma(x, ids, wts, p13, p2, LIMIT, cu, cd, shared=shared)  # noqa: E731
            same(f"T={T} end to end {name}", fn(), base)
            t = bk.cold_replay_us(fn)
            cells.append(f"{name}: {t:6.1f} ({100 * floor / t:3.0f}%)")
        log(f"  end to end with the shared expert, floor {floor:6.1f}:\n    " + "\n    ".join(cells))

    if FAILS:
        log(f"\nFAILED: {FAILS}")
        sys.exit(1)
    log("\nall outputs equal bit for bit with and without hints")


if __name__ == "__main__":
    main()
