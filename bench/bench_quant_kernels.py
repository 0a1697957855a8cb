"""Timing of the FP8 block-scaled GEMM and the FP4 MoE on one GPU, against floors measured in the same run.

    python3 bench/bench_quant_kernels.py [--quick] [--out FILE.json]

Ceilings, measured first: device copy bandwidth (1 GiB copy), bf16 matmul rate (8192^3) and the
FP8 rate (``torch._scaled_mm`` 8192^3, per-tensor scales). Every time is the median of CUDA-graph
replays each after an L2 flush (``bench_kernels.cold_replay_us``): weights come from HBM.

- FP8 GEMM (``fp8_block_gemm``, act-quant excluded and timed apart) at every FP8 linear of Flash,
  M = 1, 8, 32, 64, 128, 256, 8192. Floor = max(bytes / copy bandwidth, FLOPs / FP8 rate), bytes
  = weights + their scales + activations + scales + bf16 output. Beside it: ``torch`` FP8
  (the DeepSeek blockwise recipe through ``torch.nn.functional.scaled_mm`` where this torch runs
  it on this GPU, else per-row scales through ``torch._scaled_mm``; the line says which) and a
  bf16 ``torch.matmul`` on the dequantised weight.
- A sweep of launch configurations at M = 1, 64, 256, 8192 per shape (at 8192: 128 x 128 on 8
  warps, 64 x 128 / 128 x 64 on 4, 3-5 stages, group 8 / 16): prints each shape's winner beside
  the shape rule's (``fp8_gemm.pick_config``) so that the rule can be updated; the torch column
  is the cuBLAS blockwise GEMM that ``fp8_block_gemm``'s backend rule uses from
  ``TORCH_BLOCKWISE_MIN_M``.
- FP4 MoE (``fp4_moe``, E = 256, D = 4096, I = 2048, top-6, random distinct experts per token) at
  T = 1, 8, 32, 64, 8192: floor at decode = bytes of the distinct selected experts' w13 + w2 +
  scales / copy bandwidth; at prefill = FLOPs / bf16 rate (the products run on bf16 tensor cores).
  Stage times (routing, act-quant, gate-up, down, combine; the one-launch routing beside the torch
  one) and a sweep of the MoeConfig switches (split_nibbles, swap_ab, int_decode) and tiles at
  every T, --quick included.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import bench_kernels as bk  # noqa: E402
from dsv4_backend.kernels import fp4_moe as moe  # noqa: E402
from dsv4_backend.kernels.fp8_gemm import (  # noqa: E402
    TORCH_BLOCKWISE_MIN_M, TORCH_ERRORS, GemmConfig, act_quant_fp8, fp8_block_gemm, pick_config,
    torch_blockwise_form, torch_blockwise_gemm,
)

DEV = "cuda"
FLASH_FP8 = {  # name: (N, K)
    "wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_b": (4096, 8192),
    "indexer.wq_b": (8192, 1024), "shared.w13": (4096, 4096), "shared.w2": (4096, 2048),
}
MOE = dict(E=256, D=4096, I=2048, k=6)
RESULTS: list[dict] = []


def log(msg: str) -> None:
    print(msg, flush=True)


def us(fn) -> float:
    """Median microseconds of fn replayed from a CUDA graph after an L2 flush (fn warmed first)."""
    fn()
    torch.cuda.synchronize()
    return bk.cold_replay_us(fn)


def try_us(fn) -> float | None:
    try:
        return us(fn)
    except Exception as e:  # a config this GPU cannot compile (e.g. out of shared memory) is skipped
        log(f"    skipped: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
        torch.cuda.synchronize()
        return None


def fp8_peak_tflops() -> float:
    m = 8192
    a = torch.randn(m, m, device=DEV).to(torch.float8_e4m3fn)
    b = torch.randn(m, m, device=DEV).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=DEV)
    t = bk.do_bench(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                    warmup=25, rep=200, return_mode="median")
    return 2 * m ** 3 / (t * 1e-3) / 1e12


def torch_fp8(xq, xs, w, ws):
    """(callable, recipe name) of torch's FP8 GEMM for these operands: the blockwise recipe
    (``fp8_gemm.torch_blockwise_gemm``, the form probed once) where this torch runs it at this M,
    else per-row scales through ``torch._scaled_mm`` (speed reference only). Errors are printed."""
    if torch_blockwise_form(xq.device) is not None:
        try:
            torch_blockwise_gemm(xq, xs, w, ws)
            return (lambda: torch_blockwise_gemm(xq, xs, w, ws)), "blockwise 1x128/128x128"
        except Exception as e:
            log(f"    torch blockwise at M={xq.shape[0]}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    sa = xs[:, :1].contiguous()
    sb = ws[:1, :1].expand(1, w.shape[0]).contiguous()
    try:
        def fn():
            return torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        fn()
        return fn, "per-row scales (speed reference only)"
    except Exception as e:
        log(f"    torch per-row: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return None, "unavailable"


def sweep_configs(M: int, nb: int) -> list[GemmConfig]:
    if M <= 64:
        bm = max(16, 1 << (M - 1).bit_length())
        cands = [GemmConfig(bm, 64, s, True, 4, 4) for s in (1, 2, 4, 8, 16)]
        cands += [GemmConfig(bm, 128, s, True, 4, 3) for s in (2, 4, 8)]
        cands += [GemmConfig(bm, 32, s, True, 4, 4) for s in (1, 4)]
    elif M <= 256:
        cands = [GemmConfig(64, 128, s, False, 4, 4) for s in (1, 2, 4)]
        cands += [GemmConfig(128, 128, s, False, 8, 3) for s in (1, 2)]
        cands += [GemmConfig(128, 64, s, True, 4, 3) for s in (1, 4)]
    else:  # Hopper FP8 GEMM shapes: 128 x 128 (x 128 deep) on 8 warps, or 64/128-wide on 4
        cands = [GemmConfig(128, 128, 1, False, 8, st, g) for st in (3, 4, 5) for g in (8, 16)]
        cands += [GemmConfig(64, 128, 1, False, 4, st) for st in (3, 4, 5)]
        cands += [GemmConfig(128, 64, 1, False, 4, st) for st in (3, 4, 5)]
        cands += [GemmConfig(128, 256, 1, False, 8, 3), GemmConfig(256, 128, 1, False, 8, 3),
                  GemmConfig(64, 256, 1, False, 8, 3), GemmConfig(128, 128, 1, False, 4, 4)]
    return [c for c in cands if c.split_k <= nb]


def bench_fp8(quick: bool, copy_gbps: float, fp8_tflops: float, bf16_tflops: float) -> None:
    sizes = (1, 64, 256, 8192) if quick else (1, 8, 32, 64, 128, 256, 8192)
    sweep_at = (1, 64, 256, 8192)
    gen = torch.Generator(device=DEV).manual_seed(0)
    log("\n== FP8 block-scaled GEMM (act-quant excluded) ==")
    form = torch_blockwise_form(torch.device(DEV))
    log(f"torch blockwise form {form} (fp8_gemm._torch_forms); rejected: " + ("; ".join(TORCH_ERRORS) or "none"))
    log(f"'us' is the Triton kernel under the shape rule; 'auto' (the backend rule) uses torch from "
        f"M = {TORCH_BLOCKWISE_MIN_M} when the form above is not None")
    log(f"{'shape':>13} {'M':>5} {'us':>8} {'floor':>8} {'%floor':>6} | {'torch fp8':>9} {'bf16':>8} | config")
    for name, (N, K) in FLASH_FP8.items():
        w = (torch.randn(N, K, generator=gen, device=DEV) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
        ws = torch.pow(2.0, torch.randint(-12, -4, (-(-N // 128), -(-K // 128)), generator=gen, device=DEV).float())
        wbf = (w.float() * ws.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]).to(torch.bfloat16)
        nb = -(-K // 128)
        for M in sizes:
            x = torch.randn(M, K, generator=gen, device=DEV).to(torch.bfloat16)
            xq, xs = act_quant_fp8(x)
            rule = pick_config(M, N, K, torch.cuda.get_device_properties(0).multi_processor_count)
            t = us(lambda: fp8_block_gemm(xq, xs, w, ws, backend="triton"))
            nbytes = N * K + ws.numel() * 4 + M * K + xs.numel() * 4 + M * N * 2
            flops = 2 * M * N * K
            floor = max(nbytes / (copy_gbps * 1e9), flops / (fp8_tflops * 1e12)) * 1e6
            tfn, recipe = torch_fp8(xq, xs, w, ws)
            t_torch = try_us(tfn) if tfn else None
            t_bf16 = try_us(lambda: x @ wbf.t())
            t_aq = us(lambda: act_quant_fp8(x)) if M in (1, 8192) else None
            row = dict(kind="fp8_gemm", shape=name, N=N, K=K, M=M, us=t, floor_us=floor,
                       pct_floor=100 * floor / t, torch_fp8_us=t_torch, torch_recipe=recipe,
                       bf16_us=t_bf16, act_quant_us=t_aq, config=rule._asdict())
            if M in sweep_at:
                times = [(try_us(lambda c=c: fp8_block_gemm(xq, xs, w, ws, config=c)), c)
                         for c in sweep_configs(M, nb)]
                times = [(tt, c) for tt, c in times if tt is not None]
                best_t, best = min(times, key=lambda p: p[0])
                row.update(sweep_best_us=best_t, sweep_best=best._asdict(),
                           sweep=[(tt, tuple(c)) for tt, c in times])
            RESULTS.append(row)
            ts = f"{t_torch:9.1f}" if t_torch else f"{'n/a':>9}"
            tb = f"{t_bf16:8.1f}" if t_bf16 else f"{'n/a':>8}"
            extra = f" [{recipe}]" if M == sizes[0] else ""
            if "sweep_best" in row:
                extra += f" | sweep best {tuple(best)} {best_t:.1f} us ({100 * floor / best_t:.0f}% floor)"
            if t_aq is not None:
                extra += f" | act_quant {t_aq:.1f} us"
            log(f"{name:>13} {M:5d} {t:8.1f} {floor:8.1f} {100 * floor / t:5.0f}% | {ts} {tb} | "
                f"{tuple(rule)}{extra}")
        del w, ws, wbf
        torch.cuda.empty_cache()


def moe_sweep_configs(T: int) -> list[moe.MoeConfig]:
    """Decode: the switches (split_nibbles, swap_ab, int_decode) on the rule's tiles, then tile
    and pipeline variants of the best-guess combination. Prefill: tiles x int_decode. All on the
    grouped kernels (``decode_max_pairs=0``; the decode GEMVs are swept by gpu_moe_sweep.py)."""
    C = functools.partial(moe.MoeConfig, decode_max_pairs=0)
    if T <= 64:
        bm = 16 if T <= 16 else 32 if T <= 32 else 64
        cands = [C(bm, 128, 128, 4, 3, sn, sw, idc) for sn in (False, True) for sw in (False, True)
                 for idc in (False, True)]
        cands += [C(bm, 128, 64, 4, 3, False, True, True), C(bm, 64, 128, 4, 3, False, True, True),
                  C(bm, 128, 128, 8, 2, False, True, True), C(bm, 128, 128, 4, 4, False, True, True)]
        if bm != 16:
            cands += [C(16, 128, 128, 4, 3, False, True, True)]
        return cands
    return [C(64, 64, 128, 8, 3), C(128, 64, 128, 8, 3), C(128, 32, 128, 8, 3),
            C(128, 64, 128, 8, 3, False, False, True), C(128, 32, 128, 8, 3, False, False, True),
            C(64, 64, 128, 8, 3, False, False, True), C(128, 64, 64, 8, 4, False, False, True),
            C(128, 64, 128, 8, 3, True, False, True)]


def bench_moe(copy_gbps: float, bf16_tflops: float) -> None:
    E, D, I, k = MOE["E"], MOE["D"], MOE["I"], MOE["k"]
    gen = torch.Generator(device=DEV).manual_seed(1)
    w13 = torch.randint(0, 256, (E, 2 * I, D // 2), dtype=torch.uint8, generator=gen, device=DEV)
    s13 = torch.randint(118, 126, (E, 2 * I, D // 32), dtype=torch.uint8, generator=gen, device=DEV)
    w2 = torch.randint(0, 256, (E, D, I // 2), dtype=torch.uint8, generator=gen, device=DEV)
    s2 = torch.randint(118, 126, (E, D, I // 32), dtype=torch.uint8, generator=gen, device=DEV)
    per_expert = (w13[0].numel() + s13[0].numel() + w2[0].numel() + s2[0].numel())
    log(f"\n== FP4 MoE (E={E}, D={D}, I={I}, top-{k}; {per_expert / 2**20:.2f} MiB per expert) ==")
    log(f"{'T':>5} {'experts':>7} {'us':>9} {'floor':>8} {'%floor':>6} | stages us: route(torch) aq gate_up down "
        f"combine | config (block_m, block_k, block_n, warps, stages, split_nibbles, swap_ab, int_decode, "
        f"fused_route); 'us' includes the fused routing where T k <= {moe.ROUTE_FUSED_MAX_PAIRS}")
    for T in (1, 8, 32, 64, 8192):
        ids = torch.rand(T, E, generator=gen, device=DEV).topk(k, dim=1).indices
        weights = torch.rand(T, k, generator=gen, device=DEV)
        x = torch.randn(T, D, generator=gen, device=DEV).to(torch.bfloat16)
        n_exp = int(ids.unique().numel())
        nbytes = n_exp * per_expert + T * D * 4
        flops = 2 * T * k * (2 * I * D + D * I)
        floor = max(nbytes / (copy_gbps * 1e9), flops / (bf16_tflops * 1e12)) * 1e6
        cfg = moe.pick_moe_config(T * k, E)
        t = us(lambda: moe.fp4_moe(x, ids, weights, w13, s13, w2, s2, 10.0))
        r = moe.route(ids, E, cfg.block_m)
        xq, xs = act_quant_fp8(x)
        hq, hs = moe.moe_gate_up(xq, xs, weights, w13, s13, r, k, 10.0, cfg)
        y = moe.moe_down(hq, hs, w2, s2, r, cfg)
        t_fused = us(lambda: moe.route_fused(ids, E, cfg.block_m)) if T * k <= moe.ROUTE_FUSED_MAX_PAIRS else None
        stages = [us(lambda: moe.route(ids, E, cfg.block_m)), us(lambda: act_quant_fp8(x)),
                  us(lambda: moe.moe_gate_up(xq, xs, weights, w13, s13, r, k, 10.0, cfg)),
                  us(lambda: moe.moe_down(hq, hs, w2, s2, r, cfg)), us(lambda: moe.moe_combine(y, ids, E))]
        row = dict(kind="fp4_moe", T=T, experts=n_exp, us=t, floor_us=floor, pct_floor=100 * floor / t,
                   stages_us=stages, route_fused_us=t_fused, config=cfg._asdict())
        extra = f" | route_fused {t_fused:.1f} us" if t_fused is not None else ""
        times = [(try_us(lambda c=c: moe.fp4_moe(x, ids, weights, w13, s13, w2, s2, 10.0, config=c)), c)
                 for c in moe_sweep_configs(T)]
        times = [(tt, c) for tt, c in times if tt is not None]
        best_t, best = min(times, key=lambda p: p[0])
        row.update(sweep_best_us=best_t, sweep_best=best._asdict(), sweep=[(tt, tuple(c)) for tt, c in times])
        extra += f" | sweep best {tuple(best)} {best_t:.1f} us ({100 * floor / best_t:.0f}% floor)"
        RESULTS.append(row)
        log(f"{T:5d} {n_exp:7d} {t:9.1f} {floor:8.1f} {100 * floor / t:5.0f}% | "
            + " ".join(f"{s:.1f}" for s in stages) + f" | {tuple(cfg)}{extra}")
        del hq, hs, y
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer FP8 sizes (M = 1, 64, 256, 8192); the MoE part is the same")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--only", choices=("all", "fp8", "moe"), default="all", help="one half of the run")
    args = ap.parse_args()
    t0 = time.time()
    ceil = bk.measure_ceilings(DEV)
    fp8 = fp8_peak_tflops()
    log(f"{torch.cuda.get_device_name()}: copy {ceil.copy_gbps:.0f} GB/s, bf16 {ceil.bf16_tflops:.0f} TFLOP/s, "
        f"fp8 (_scaled_mm 8192^3) {fp8:.0f} TFLOP/s")
    if args.only in ("all", "fp8"):
        bench_fp8(args.quick, ceil.copy_gbps, fp8, ceil.bf16_tflops)
    if args.only in ("all", "moe"):
        bench_moe(ceil.copy_gbps, ceil.bf16_tflops)
    log(f"\ndone in {time.time() - t0:.0f} s")
    if args.out:
        args.out.write_text(json.dumps(dict(copy_gbps=ceil.copy_gbps, bf16_tflops=ceil.bf16_tflops,
                                            fp8_tflops=fp8, results=RESULTS), indent=1))


if __name__ == "__main__":
    main()
