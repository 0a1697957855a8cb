"""The quantised decode MoE at one to eight tokens on one GPU: what a plain read of the same bytes
costs, and the shared expert on a second stream.

    python3 bench/probe_moe_overlap.py [--tokens 1,2,4,8]
    ncu --clock-control none -k regex:"fp4_mma|_read|_row_gemv" python3 bench/probe_moe_overlap.py --profile

Flash's MoE (E = 256, D = 4096, I = 2048, top-6) with random release-format FP4 experts packed by
``fp4_mma.pack_fp4_mma`` and a random FP8 shared expert (w1 + w3 one row stack, w2).

1. The read floor: a Triton kernel that only reads the selected experts' packed words (and sums
   them, so that the loads stay), over the same experts and bytes as the MMA kernel, each launch
   shape tried, beside the MMA kernel and the copy floor (bytes / the 1 GiB copy's bandwidth,
   measured in the same run). Every time is a CUDA-graph replay after an L2 flush (median).
   If the plain read of those bytes is far from the copy floor too, the gap is the transfer's
   size and placement, not the kernel.
2. The decode MoE with the shared expert (``fp4_moe_mma(shared=...)``): its three launches queued on the
   caller's stream (before the routed ones), then on a second stream beside them
   (``side_stream.SHARED_EXPERT``); the outputs must be equal bit for bit.
``--profile``: only launches gate-up, down, the read kernel and the shared expert's w1 + w3 row
GEMV at T = 1, three times each after an L2 flush, for a profiler. Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import bench_kernels as bk  # noqa: E402
from _floor import copy_gbps  # noqa: E402
from dsv4_backend import side_stream  # noqa: E402
from dsv4_backend.kernels import fp4_mma as mma  # noqa: E402
from dsv4_backend.kernels.fp8_gemm import act_quant_fp8, fp8_block_gemm_partials  # noqa: E402
from probe_fp4_prefill import random_packs  # noqa: E402

E, D, I, TOP = 256, 4096, 2048, 6
LIMIT = 10.0
FAILS: list[str] = []


def log(msg: str) -> None:
    print(msg, flush=True)


@triton.jit
def _read_words(src, sel, out, per_expert, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Program (b, j) sums block b (BLOCK x ITERS int32) of expert sel[j]'s words."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    e = tl.load(sel + j).to(tl.int64)
    start = b * (BLOCK * ITERS)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.static_range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src + e * per_expert + offs, mask=offs < per_expert, other=0)
    tl.store(out + j * tl.num_programs(0) + b, tl.sum(acc, axis=0))


def read_words(words: torch.Tensor, sel: torch.Tensor, block: int, iters: int, warps: int) -> torch.Tensor:
    per = words[0].numel()
    n_blk = triton.cdiv(per, block * iters)
    out = torch.empty(sel.numel(), n_blk, dtype=torch.int32, device=words.device)
    _read_words[(n_blk, sel.numel())](words, sel, out, per, BLOCK=block, ITERS=iters, num_warps=warps)
    return out


READ_SHAPES = [(1024, 4, 4), (1024, 16, 4), (2048, 8, 8), (4096, 4, 8)]  # (BLOCK, ITERS, warps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    p13, p2 = random_packs(gen)

    def e4m3(n, k):
        return (torch.randn(n, k, generator=gen, device=dev) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)

    def scales(n, k):
        return torch.pow(2.0, torch.randint(-9, -5, (n // 128, k // 128), generator=gen, device=dev).float())
    shared = mma.SharedFp8(e4m3(2 * I, D), scales(2 * I, D), e4m3(D, I), scales(D, I))
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)

    if args.profile:
        ids = torch.rand(1, E, generator=gen, device=dev).topk(TOP, dim=1).indices
        flat = ids.reshape(-1).contiguous()
        sel = flat.to(torch.int32)
        x = torch.randn(1, D, generator=gen, device=dev).to(torch.bfloat16)
        xq, xs = act_quant_fp8(x)
        up, down = mma.pick_mma_configs(TOP)
        part = mma.fp4_gemv_mma(xq, xs, flat, p13, TOP, up)
        from dsv4_backend.kernels.fp4_moe_decode import swiglu_quant
        hq, hs = swiglu_quant(part, flat, torch.rand(TOP, generator=gen, device=dev), E, LIMIT)
        for _ in range(3):
            flush.zero_()
            mma.fp4_gemv_mma(xq, xs, flat, p13, TOP, up)
            flush.zero_()
            mma.fp4_gemv_mma(hq, hs, flat, p2, 1, down)
            flush.zero_()
            read_words(p13.words, sel, 1024, 16, 4)
            flush.zero_()
            fp8_block_gemm_partials(xq, xs, shared.w13, shared.w13_scale)   # the row GEMV, 4096 x 4096
        torch.cuda.synchronize()
        log("profile launches done")
        return

    bw = copy_gbps(dev)
    words_up, words_down = p13.words[0].numel() * 4, p2.words[0].numel() * 4
    with_scales = {"gate-up": words_up + p13.scales[0].numel() * 4, "down": words_down + p2.scales[0].numel() * 4}
    log(f"copy bandwidth {bw:.0f} GB/s (bytes read + written); per expert: gate-up words "
        f"{words_up / 2**20:.2f} MiB (+ scales {with_scales['gate-up'] / 2**20:.2f}), down {words_down / 2**20:.2f} MiB")

    log("\n== the read floor: the same experts' words, only read, us (% of the words' copy floor) ==")
    for T in [int(t) for t in args.tokens.split(",")]:
        ids = torch.rand(T, E, generator=gen, device=dev).topk(TOP, dim=1).indices
        flat = ids.reshape(-1).contiguous()
        sel = ids.unique().to(torch.int32)
        n = sel.numel()
        x = torch.randn(T, D, generator=gen, device=dev).to(torch.bfloat16)
        xq, xs = act_quant_fp8(x)
        up, down = mma.pick_mma_configs(T * TOP)
        from dsv4_backend.kernels.fp4_moe_decode import swiglu_quant
        part = mma.fp4_gemv_mma(xq, xs, flat, p13, TOP, up)
        hq, hs = swiglu_quant(part, flat, torch.rand(T * TOP, generator=gen, device=dev), E, LIMIT)
        for proj, pack, run in (("gate-up", p13, lambda: mma.fp4_gemv_mma(xq, xs, flat, p13, TOP, up)),
                                ("down", p2, lambda: mma.fp4_gemv_mma(hq, hs, flat, p2, 1, down))):
            fl_words = n * pack.words[0].numel() * 4 / (bw * 1e9) * 1e6
            fl_all = n * with_scales[proj] / (bw * 1e9) * 1e6
            reads = {s: bk.cold_replay_us(lambda s=s: read_words(pack.words, sel, *s)) for s in READ_SHAPES}
            best = min(reads, key=reads.get)
            t_mma = bk.cold_replay_us(run)
            cells = "  ".join(f"{b}x{it}/w{w} {t:6.1f}" for (b, it, w), t in reads.items())
            log(f"  T={T} {proj:7s} {n:2d} experts | words floor {fl_words:6.1f} | read best {reads[best]:6.1f} "
                f"({100 * fl_words / reads[best]:3.0f}%) [{cells}] | mma {t_mma:6.1f} "
                f"({100 * fl_all / t_mma:3.0f}% of words + scales floor {fl_all:6.1f})")

    log("\n== decode MoE + shared expert: the shared launches on the one stream / on a second stream, us ==")
    for T in [int(t) for t in args.tokens.split(",")]:
        ids = torch.rand(T, E, generator=gen, device=dev).topk(TOP, dim=1).indices
        x = torch.randn(T, D, generator=gen, device=dev).to(torch.bfloat16)
        wts = torch.rand(T, TOP, generator=gen, device=dev)
        n = int(ids.unique().numel())
        floor = (n * (with_scales["gate-up"] + with_scales["down"])
                 + sum(t.numel() * t.element_size() for t in shared)) / (bw * 1e9) * 1e6
        times, outs = {}, {}
        for side in (False, True):
            side_stream.SHARED_EXPERT = side
            outs[side] = mma.fp4_moe_mma(x, ids, wts, p13, p2, LIMIT, shared=shared)
            times[side] = bk.cold_replay_us(lambda: mma.fp4_moe_mma(x, ids, wts, p13, p2, LIMIT, shared=shared))
        side_stream.SHARED_EXPERT = False
        same = torch.equal(outs[False], outs[True])
        if not same:
            FAILS.append(f"side stream T={T}")
        log(f"  T={T} {n:2d} experts floor {floor:6.1f} | one stream {times[False]:6.1f} ({100 * floor / times[False]:3.0f}%) "
            f"| side stream {times[True]:6.1f} ({100 * floor / times[True]:3.0f}%) | equal bits: {same}")

    if FAILS:
        log(f"\nFAILED: {FAILS}")
        sys.exit(1)
    log("\nall checks passed")


if __name__ == "__main__":
    main()
