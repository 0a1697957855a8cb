"""FP4 routed experts at decode sizes with the weights in MMA fragment order, on one GPU.

    python3 bench/probe_fp4_mma.py [--tokens 1,4,8,16,32,64] [--splits 1,2,4,8]

Flash's MoE (E = 256, D = 4096, I = 2048, top-6), random release-format weights packed once by
``kernels/fp4_mma.pack_fp4_mma`` (the packing time is printed), random distinct experts per token.

1. Correctness: each projection's fp32 partial sums (``fp4_gemv_mma``, every split tried) against
   a float64 product of the release-format weights, within the fp32 accumulation bound doubled
   (the MMA's adds may truncate), at T = 1 and 16; and the whole decode MoE with the MMA GEMVs
   against the Triton decode path (same rounding points: they may differ where a sum order tips a
   bf16 rounding; the largest difference is printed, not judged).
2. Per projection and T: the MMA kernel at each split against the Triton decode GEMV
   (``pick_gemv_configs``), each a CUDA-graph replay after an L2 flush (median), beside its
   floor: the distinct selected experts' weight + scale bytes over the copy bandwidth measured in
   the same run.
3. The decode MoE end to end (act-quant, gate-up, SwiGLU + act-quant, down, combine) with the MMA
   GEMVs at the best splits against ``fp4_moe``'s default at that T, beside the floor.
Exits 1 when a correctness check fails.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import bench_kernels as bk  # noqa: E402
from _floor import copy_gbps  # noqa: E402
from dsv4_backend.kernels import fp4_mma as mma  # noqa: E402
from dsv4_backend.kernels import fp4_moe as moe  # noqa: E402
from dsv4_backend.kernels import fp4_moe_decode as dec  # noqa: E402
from dsv4_backend.kernels.fp8_gemm import act_quant_fp8  # noqa: E402

E, D, I, TOP = 256, 4096, 2048, 6
LIMIT = 10.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
FAILS: list[str] = []


def log(msg: str) -> None:
    print(msg, flush=True)


def dequant64(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([w & 15, w >> 4], -1).reshape(w.shape[0], -1).long()
    v = E2M1.to(w.device)[codes & 7] * torch.where((codes & 8) != 0, -1.0, 1.0).double()
    return v * torch.pow(2.0, s.double() - 127).repeat_interleave(32, 1)


def check_partials(name, part, act_q, act_s, ids, w, s, row_div) -> None:
    """part [splits, P, N] against the float64 product within (gamma(K, 2u) + gamma(splits)) sum|terms|."""
    K = w.shape[2] * 2
    x = act_q.float().double() * act_s.double().repeat_interleave(128, 1)
    got = part.double().sum(0)
    worst = 0.0
    for p, e in enumerate(ids.tolist()):
        wd = dequant64(w[e], s[e])
        want = wd @ x[p // row_div]
        mag = wd.abs() @ x[p // row_div].abs()
        u = 2.0 ** -23
        bound = (K * u / (1 - K * u) + part.shape[0] * 2.0 ** -24) * mag
        worst = max(worst, float(((got[p] - want).abs() / bound.clamp_min(1e-300)).max()))
    ok = worst <= 1.0
    if not ok:
        FAILS.append(name)
    log(f"  [{'ok' if ok else 'FAIL'}] {name}: worst |err| / bound = {worst:.3f}")


def moe_ref64(x, ids, wts, w13, s13, w2, s2) -> torch.Tensor:
    """The contract in float64 (fp4_moe's docstring): act-quant, fp32-free products, the bf16
    roundings of g, u, h and y (h = its fp32 product, rounded), h act-quantised, out = sum_j y_tj rounded to bf16."""
    def aq(v):  # 1x128 e4m3 with power-of-two scales, as act_quant_fp8
        q, sc = act_quant_fp8(v.to(torch.bfloat16) if v.dtype != torch.bfloat16 else v)
        return q.float().double() * sc.double().repeat_interleave(128, 1)
    bf = lambda v: v.float().to(torch.bfloat16).double()
    xd = aq(x)
    out = torch.zeros(x.shape[0], D, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for j in range(TOP):
            e = int(ids[t, j])
            gu = dequant64(w13[e], s13[e]) @ xd[t]
            g, u = bf(gu[:I]).clamp(max=LIMIT), bf(gu[I:]).clamp(-LIMIT, LIMIT)
            h = bf(g / (1 + torch.exp(-g)) * u * wts[t, j].double())
            out[t] += bf(dequant64(w2[e], s2[e]) @ aq(h[None].float())[0])
    return bf(out)


def routing(T: int, gen) -> torch.Tensor:
    return torch.rand(T, E, generator=gen, device="cuda").topk(TOP, dim=1).indices


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,4,8,16,32,64")
    ap.add_argument("--splits", default="1,2,4,8")
    ap.add_argument("--prefetch", default="1,2,3", help="prefetch distances (fp4_mma.cu PREFETCH) to try")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    splits = [int(s) for s in args.splits.split(",")]
    prefetch = [int(s) for s in args.prefetch.split(",")]
    shapes = [(sp, pf) for sp in splits for pf in prefetch]
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.device("cuda")

    def r(lo, hi, shape):
        return torch.randint(lo, hi, shape, dtype=torch.uint8, generator=gen, device=dev)
    w13, s13, w2, s2 = r(0, 256, (E, 2 * I, D // 2)), r(123, 128, (E, 2 * I, D // 32)), \
        r(0, 256, (E, D, I // 2)), r(118, 126, (E, D, I // 32))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    p13, p2 = mma.pack_fp4_mma(w13, s13), mma.pack_fp4_mma(w2, s2)
    torch.cuda.synchronize()
    log(f"packed {E} experts' w13 + w2 ({(w13.numel() + w2.numel()) / 2**30:.2f} GiB) in "
        f"{time.perf_counter() - t0:.2f} s")
    bw = copy_gbps(dev)
    b_up = w13[0].numel() + s13[0].numel()
    b_down = w2[0].numel() + s2[0].numel()
    log(f"copy bandwidth {bw:.0f} GB/s (bytes read + written); per expert: gate-up "
        f"{b_up / 2**20:.2f} MiB, down {b_down / 2**20:.2f} MiB")

    log("\n== correctness ==")
    for T in (1, 16):
        ids = routing(T, gen)
        flat = ids.reshape(-1).contiguous()
        x = torch.randn(T, D, generator=gen, device=dev).to(torch.bfloat16)
        xq, xs = act_quant_fp8(x)
        for sp, st in shapes:
            check_partials(f"gate-up T={T} split={sp} prefetch={st}",
                           mma.fp4_gemv_mma(xq, xs, flat, p13, TOP, mma.MmaConfig(sp, st)), xq, xs, flat, w13, s13, TOP)
        wts = torch.rand(T, TOP, generator=gen, device=dev)
        part = dec.fp4_gemv(xq, xs, flat, w13, s13, TOP, dec.pick_gemv_configs(T * TOP)[0])
        hq, hs = dec.swiglu_quant(part, flat, wts.reshape(-1).contiguous(), E, LIMIT)
        for sp, st in shapes:
            check_partials(f"down T={T} split={sp} prefetch={st}", mma.fp4_gemv_mma(hq, hs, flat, p2, 1, mma.MmaConfig(sp, st)),
                           hq, hs, flat, w2, s2, 1)
        y_mma = mma.fp4_moe_mma(x, ids, wts, p13, p2, LIMIT)
        y_ref = moe_ref64(x, ids, wts, w13, s13, w2, s2)
        log(f"  decode MoE T={T}: MMA path vs the float64 contract, max |diff| / max |y| = "
            f"{float((y_mma.double() - y_ref).abs().max() / y_ref.abs().max()):.2e}")
        y_tri = moe.fp4_moe(x, ids, wts, w13, s13, w2, s2, LIMIT,
                            config=moe.MoeConfig(decode_max_pairs=1 << 30))
        rel = float((y_mma.float() - y_tri.float()).abs().max() / y_tri.float().abs().max())
        log(f"  decode MoE T={T}: MMA path vs Triton decode path, max |diff| / max |y| = {rel:.2e}")
        a, b = y_mma.clone(), mma.fp4_moe_mma(x, ids, wts, p13, p2, LIMIT)
        if not torch.equal(a, b):
            FAILS.append(f"deterministic T={T}")
            log(f"  [FAIL] two calls differ at T={T}")

    log("\n== per projection: MMA kernel (each split) vs Triton decode GEMV, us (% of floor) ==")
    best_split = {}
    for T in tokens:
        ids = routing(T, gen)
        flat = ids.reshape(-1).contiguous()
        n_exp = int(ids.unique().numel())
        x = torch.randn(T, D, generator=gen, device=dev).to(torch.bfloat16)
        xq, xs = act_quant_fp8(x)
        wts = torch.rand(T, TOP, generator=gen, device=dev).reshape(-1).contiguous()
        up_cfg, down_cfg = dec.pick_gemv_configs(T * TOP)
        part = dec.fp4_gemv(xq, xs, flat, w13, s13, TOP, up_cfg)
        hq, hs = dec.swiglu_quant(part, flat, wts, E, LIMIT)
        for proj, fl_b, run_mma, run_tri in (
                ("gate-up", b_up, lambda sp, st: mma.fp4_gemv_mma(xq, xs, flat, p13, TOP, mma.MmaConfig(sp, st)),
                 lambda: dec.fp4_gemv(xq, xs, flat, w13, s13, TOP, up_cfg)),
                ("down", b_down, lambda sp, st: mma.fp4_gemv_mma(hq, hs, flat, p2, 1, mma.MmaConfig(sp, st)),
                 lambda: dec.fp4_gemv(hq, hs, flat, w2, s2, 1, down_cfg))):
            floor = n_exp * fl_b / (bw * 1e9) * 1e6
            t_tri = bk.cold_replay_us(run_tri)
            times = {sh: bk.cold_replay_us(lambda sh=sh: run_mma(*sh)) for sh in shapes}
            best = min(times, key=times.get)
            best_split[(T, proj)] = best
            cells = "  ".join(f"s{sp}/p{st} {t:6.1f} ({100 * floor / t:3.0f}%)" for (sp, st), t in times.items())
            log(f"  T={T:3d} {proj:7s} {n_exp:3d} experts floor {floor:6.1f} | triton {t_tri:7.1f} "
                f"({100 * floor / t_tri:3.0f}%) | mma {cells}")

    log("\n== decode MoE end to end (act-quant .. combine), us (% of floor) ==")
    for T in tokens:
        ids = routing(T, gen)
        n_exp = int(ids.unique().numel())
        x = torch.randn(T, D, generator=gen, device=dev).to(torch.bfloat16)
        wts = torch.rand(T, TOP, generator=gen, device=dev)
        floor = n_exp * (b_up + b_down) / (bw * 1e9) * 1e6
        su, sd = best_split[(T, "gate-up")], best_split[(T, "down")]
        t_mma = bk.cold_replay_us(lambda: mma.fp4_moe_mma(x, ids, wts, p13, p2, LIMIT, mma.MmaConfig(*su), mma.MmaConfig(*sd)))
        t_def = bk.cold_replay_us(lambda: moe.fp4_moe(x, ids, wts, w13, s13, w2, s2, LIMIT))
        log(f"  T={T:3d} {n_exp:3d} experts floor {floor:6.1f} | fp4_moe default {t_def:7.1f} "
            f"({100 * floor / t_def:3.0f}%) | mma path (split, prefetch: {su} {sd}) {t_mma:7.1f} "
            f"({100 * floor / t_mma:3.0f}%)")
    log("\n== routed mode (the prefill path): correctness at T=64, time at prefill sizes ==")
    ids = routing(64, gen)
    flat = ids.reshape(-1).contiguous()
    x = torch.randn(64, D, generator=gen, device=dev).to(torch.bfloat16)
    xq, xs = act_quant_fp8(x)
    for groups in (2, 4):
        cfg = mma.MmaConfig(1, mma.PREFETCH, groups, True)
        check_partials(f"gate-up routed T=64 groups={groups}", mma.fp4_gemv_mma(xq, xs, flat, p13, TOP, cfg),
                       xq, xs, flat, w13, s13, TOP)
    for T in (512, 4096):
        ids = routing(T, gen)
        x = torch.randn(T, D, generator=gen, device=dev).to(torch.bfloat16)
        wts = torch.rand(T, TOP, generator=gen, device=dev)
        flops = 2 * T * TOP * (2 * I * D + D * I)
        t_def = bk.cold_replay_us(lambda: moe.fp4_moe(x, ids, wts, w13, s13, w2, s2, LIMIT))
        cells = []
        for groups in (1, 2, 4):
            cfg = mma.MmaConfig(1, mma.PREFETCH, groups, True)
            t = bk.cold_replay_us(lambda: mma.fp4_moe_mma(x, ids, wts, p13, p2, LIMIT, cfg, cfg))
            cells.append(f"groups {groups}: {t:8.1f} us ({flops / t / 1e6:5.0f} TFLOP/s)")
        log(f"  T={T:5d}: fp4_moe grouped {t_def:8.1f} us ({flops / t_def / 1e6:5.0f} TFLOP/s) | mma " + " | ".join(cells))

    if FAILS:
        log(f"\nFAILED: {FAILS}")
        sys.exit(1)
    log("\nall checks passed")


if __name__ == "__main__":
    main()
