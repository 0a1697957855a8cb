"""One bf16 MoE layer of the long-context benchmark's model at decode sizes, on one GPU: the
decode kernels (dsv4_backend/kernels/moe_bf16_decode.py) against the grouped path.

A Flash-width MoE (hidden 4096, expert width 2048, ``--experts`` routed + 1 shared, top-6) with
random bf16 weights; for each T, ``MoE.forward`` with the decode kernels and with the grouped
path (``torch._grouped_mm``), each timed as a CUDA-graph replay (median of ``--reps``), its
launches counted in one eager call, and the byte floor: the weights of the distinct selected
experts and the shared expert over the copy bandwidth measured in the same run. The two outputs
are compared (max |diff| over max |value|; the kernels keep the grouped path's rounding points,
so they differ only where a sum order tips a rounding).

    python bench/probe_moe_bf16.py --tokens 1,2,4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench._bench_common import graphed  # noqa: E402
from dsv4_backend import model as M  # noqa: E402
from dsv4_backend.config import DSV4Config  # noqa: E402
from dsv4_backend.layers.linear import stack_rows  # noqa: E402


def copy_gbps(dev: torch.device, mb: int = 1024) -> float:
    src = torch.empty(mb << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b))
    return 2 * src.numel() / best / 1e6   # read + write


def replay_ms(fn, reps: int) -> float:
    """Median ms of one CUDA-graph replay of ``fn``."""
    replay = graphed(fn, torch.device("cuda"))
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def launches(fn) -> int:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sweep", action="store_true", help="also sweep the T = 1 launch shapes")
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = DSV4Config.preset("flash", n_routed_experts=args.experts)
    torch.manual_seed(0)
    moe = M.MoE(cfg, hash_routed=False).to(torch.bfloat16)
    moe.stack_experts(torch.bfloat16, dev)
    se = moe.shared_experts
    moe.to(dev)
    stack_rows(se.w1, se.w3)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_((torch.randn(p.shape, device=dev) * 0.02).to(p.dtype))
    gbps = copy_gbps(dev)
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    expert_bytes = 3 * D * I * 2
    print(f"MoE layer: hidden {D}, expert width {I}, {args.experts} routed + 1 shared, top-{cfg.num_experts_per_tok}, "
          f"bf16; copy {gbps:,.0f} GB/s")
    print("| T | distinct experts | floor us | decode kernels us (launches) | grouped path us (launches) | "
          "kernels / grouped | max diff / max |out| |")
    print("|---|---|---|---|---|---|---|")
    for T in [int(t) for t in args.tokens.split(",")]:
        x = (torch.randn(T, D, device=dev)).to(torch.bfloat16)
        tok = torch.zeros(T, dtype=torch.int64, device=dev)
        ids, _ = moe.gate(x, tok)
        n_exp = len(set(ids.reshape(-1).tolist())) + 1
        floor_us = n_exp * expert_bytes / gbps / 1e3
        M.MOE_DECODE_MAX_PAIRS = 1 << 20
        M.USE_MOE_DECODE_KERNEL = True
        assert moe._decode_kernel_applies(x, ids), "the decode kernels do not apply"
        with torch.no_grad():
            k_out = moe(x, tok)
            k_ms, k_n = replay_ms(lambda: moe(x, tok), args.reps), launches(lambda: moe(x, tok))
            M.USE_MOE_DECODE_KERNEL = False
            g_out = moe(x, tok)
            g_ms, g_n = replay_ms(lambda: moe(x, tok), args.reps), launches(lambda: moe(x, tok))
        diff = (k_out.float() - g_out.float()).abs().max().item() / g_out.float().abs().max().item()
        print(f"| {T} | {n_exp} | {floor_us:.1f} | {k_ms * 1e3:.1f} ({k_n}) | {g_ms * 1e3:.1f} ({g_n}) | "
              f"{k_ms / g_ms:.2f} | {diff:.2e} |")
    M.USE_MOE_DECODE_KERNEL = True
    if args.sweep:
        sweep(moe, cfg, dev, args.reps)


def sweep(moe, cfg, dev, reps: int) -> None:
    """T = 1: the decode kernels' launch shapes (gate-up and down swept one at a time)."""
    from dsv4_backend.kernels.moe_bf16_decode import DOWN, GATE_UP, Bf16GemvConfig, moe_bf16_decode
    x = torch.randn(1, cfg.hidden_size, device=dev).to(torch.bfloat16)
    ids, w = moe.gate(x, torch.zeros(1, dtype=torch.int64, device=dev))
    se = moe.shared_experts
    run = lambda gu, dn: moe_bf16_decode(x, ids, w, moe._w13, moe._w2, se.w1.row_stack.weight,  # noqa: E731
                                         se.w2.weight, moe.limit, gu, dn)
    shapes = [Bf16GemvConfig(bn, bk, sk, 4, 3) for bn in (8, 16, 32) for bk in (128, 256, 512) for sk in (1, 2, 4)]
    for name, fixed in (("gate-up", DOWN), ("down", GATE_UP)):
        res = []
        for c in shapes:
            try:
                ms = replay_ms(lambda: run(c, fixed) if name == "gate-up" else run(fixed, c), max(5, reps // 3))
            except Exception as e:  # noqa: BLE001 (a shape that does not compile: skipped)
                print(f"  {name} {c}: {type(e).__name__}")
                continue
            res.append((ms, c))
        res.sort(key=lambda r: r[0])
        print(f"{name}, T = 1, best 5 (whole MoE us with the other stage at its default):")
        for ms, c in res[:5]:
            print(f"  {ms * 1e3:7.1f}  {c}")


if __name__ == "__main__":
    main()
