"""GPU correctness of the quantised-weight kernels at DeepSeek-V4-Flash shapes.

    python3 bench/gpu_quant_check.py [--quick]

Runs on one CUDA device against the float64 simulations of tests/test_fp8_gemm.py and
tests/test_fp4_moe.py (the same code, run on the device):

- act_quant_fp8: codes and scales bit for bit (random rows over 2^-20..2^20 plus edge blocks);
- fp8_linear at every FP8 linear of Flash, M = 1, 8, 64, 256 and M = 8192 on three shapes, through
  the Triton kernel and, from M = TORCH_BLOCKWISE_MIN_M, through torch's blockwise GEMM too. Bound:
  Hopper's FP8 MMA keeps about 14 bits while it sums a 128-deep block (DeepSeek-V3 report, section
  3.3.2), over the four 32-deep steps of a block: 4 x 2^-13 = 2^-11 of the block's sum|terms|; then
  (blocks + 2) fp32 adds; then half a bf16 ulp;
- fp4_moe at E = 256, D = 4096, I = 2048, k = 6, T = 1, 8, 64 (random, all to one expert, padded
  rows) and T = 8192 (the first 256 tokens checked): the test's exact-first-projection data; the
  ambiguity window 2^-22 (|g| + 8) relative: Triton's exp is ex2.approx (2^-22) of g log2(e)
  rounded to fp32 (|g| 2^-24 after exponentiation), plus four fp32 roundings, times four for
  margin; the MMA's fp32 accumulation bound doubled (truncating adds);
- at T = 1 and 64 the grouped kernels beside the default (decode GEMVs up to MoeConfig.decode_max_pairs)
  and their switches (swap_ab + int_decode, split_nibbles + int_decode,
  the torch routing), and the one-launch routing equal to the torch routing bit for bit;
- determinism (two calls bit-identical) and CUDA-graph replay equal to the eager call.
Prints one line per check with the measured max error beside the bound; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from dsv4_backend.kernels.fp4_moe import (  # noqa: E402
    ROUTE_FUSED_MAX_PAIRS, Routing, fp4_moe, pick_moe_config, route, route_fused,
)
from dsv4_backend.kernels.fp8_gemm import (  # noqa: E402
    TORCH_BLOCKWISE_MIN_M, TORCH_ERRORS, act_quant_fp8, fp8_linear, torch_blockwise_form,
)
from test_fp4_moe import (  # noqa: E402
    combine_tol, h_bound, h_reference, make_experts, make_x, y_reference, y_tol,
)
from test_fp8_gemm import U32, act_quant_sim, gemm_sim  # noqa: E402

DEV = "cuda"
FLASH_FP8 = {  # name: (N, K)
    "wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_b": (4096, 8192),
    "indexer.wq_b": (8192, 1024), "shared.w13": (4096, 4096), "shared.w2": (4096, 2048),
}
PREFILL_SHAPES = ["wq_a", "wo_b", "shared.w2"]
MOE = dict(E=256, D=4096, I=2048, k=6)
LIMIT = 10.0
FAILS: list[str] = []


def report(name: str, ok: bool, detail: str) -> None:
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)
    if not ok:
        FAILS.append(name)


def ratio(got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor) -> tuple[float, float]:
    """(max |got - want|, max |got - want| / tol) over the elements."""
    err = (got.double() - want).abs()
    return err.max().item(), (err / tol.clamp_min(1e-300)).max().item()


def same_twice_and_in_graph(name: str, fn) -> None:
    a = fn()
    b = fn()
    report(f"{name} deterministic", torch.equal(a, b), "two eager calls bit-identical")
    if DEV != "cuda":
        return
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        c = fn()
    g.replay()
    torch.cuda.synchronize()
    report(f"{name} graph", torch.equal(a, c), "CUDA-graph replay equal to eager")


def act_quant_mismatches(x, xq, xs, q, s, limit: int = 5) -> list[str]:
    """The first ``limit`` elements whose code or block scale differs from the simulation, with
    torch's own e4m3 cast of x / s (s from the simulation) as a third opinion."""
    M, K = x.shape
    kcode = xq.view(torch.uint8).long()
    rcode = q.float().to(torch.float8_e4m3fn).view(torch.uint8).long()
    s_el = s.repeat_interleave(128, 1)[:, :K]
    ks_el = xs.double().repeat_interleave(128, 1)[:, :K]
    tcode = (x.double() / s_el).clamp(-448, 448).float().to(torch.float8_e4m3fn).view(torch.uint8).long()
    bad = ((kcode != rcode) | (ks_el != s_el)).nonzero()[:limit].tolist()
    return [f"x[{m},{k}]={x[m, k].item()!r}: kernel code 0x{kcode[m, k].item():02x} scale "
            f"{ks_el[m, k].item()!r}; reference code 0x{rcode[m, k].item():02x} scale {s_el[m, k].item()!r}; "
            f"torch cast of x/s 0x{tcode[m, k].item():02x}" for m, k in bad]


def check_act_quant(gen) -> None:
    M, K = 64, 4096
    x = torch.randn(M, K, generator=gen, device=DEV)
    x = x * torch.pow(2.0, torch.randint(-20, 20, (M, 1), generator=gen, device=DEV).float())
    x[0, :128] = 0.0
    x[1, :128] = x[1, :128].clamp(-1, 1) * 56.0
    x[1, 5] = 56.0  # amax / 448 exactly a power of two
    x[2, :128] = x[1, :128]
    x[2, 6] = 56.0 * (1 + 2 ** -23)
    x[3, :128] = torch.randn(128, generator=gen, device=DEV) * 1e-3  # e4m3 subnormals
    x[4, :128] = torch.tensor([448.0] + [1.0 + (2 * i + 1) / 16 for i in range(8)] * 15 + [0.0] * 7,
                              device=DEV)  # ties at scale 1
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        xq, xs = act_quant_fp8(xd)
        q, s = act_quant_sim(xd)
        bad = act_quant_mismatches(xd, xq, xs, q, s)
        n_s = int((xs.double() != s).sum())
        n_q = int((xq.view(torch.uint8) != q.float().to(torch.float8_e4m3fn).view(torch.uint8)).sum())
        report(f"act_quant {dtype}", not bad,
               f"[{M}, {K}] codes and scales bit-exact ({n_q} codes, {n_s} scales differ)")
        for line in bad:
            print(f"    {line}", flush=True)


def check_fp8(gen, quick: bool) -> None:
    """Both GEMM backends where the rule could pick either (M >= TORCH_BLOCKWISE_MIN_M)."""
    form = torch_blockwise_form(torch.device(DEV)) if DEV == "cuda" else None
    print(f"torch blockwise FP8 form: {form}" + "".join(f"\n    {e}" for e in TORCH_ERRORS), flush=True)
    for name, (N, K) in FLASH_FP8.items():
        w = (torch.randn(N, K, generator=gen, device=DEV) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
        ws = torch.pow(2.0, torch.randint(-12, -4, (-(-N // 128), -(-K // 128)), generator=gen, device=DEV).float())
        sizes = (1, 64, 256) if quick else (1, 8, 64, 256)
        if name in PREFILL_SHAPES and (not quick or name == "shared.w2"):
            sizes = sizes + (8192,)
        for M in sizes:
            x = (torch.randn(M, K, generator=gen, device=DEV) * 2).to(torch.bfloat16)
            q, s = act_quant_sim(x)
            y, mag = gemm_sim(q, s, w, ws)
            nb = -(-K // 128)
            tol = (2.0 ** -11 + (nb + 2) * U32) * mag
            tol = tol + 2.0 ** -8 * (y.abs() + tol)
            backends = ["triton"] + (["torch"] if form is not None and M >= TORCH_BLOCKWISE_MIN_M else [])
            for be in backends:
                out = fp8_linear(x, w, ws, backend=be)
                err, r = ratio(out, y, tol)
                report(f"fp8_linear[{be}] {name} M={M}", r <= 1.0 and bool(torch.isfinite(out).all()),
                       f"max err {err:.3e}, max err/bound {r:.3f}")
            del y, mag, q, s
        x64 = x[:64] if x.shape[0] >= 64 else x
        same_twice_and_in_graph(f"fp8_linear[triton] {name} M=64", lambda: fp8_linear(x64, w, ws))
        if form is not None and name == "shared.w2":
            x256 = (torch.randn(256, K, generator=gen, device=DEV) * 2).to(torch.bfloat16)
            same_twice_and_in_graph(f"fp8_linear[torch] {name} M=256",
                                    lambda: fp8_linear(x256, w, ws, backend="torch"))


def check_moe(gen, quick: bool) -> None:
    E, D, I, k = MOE["E"], MOE["D"], MOE["I"], MOE["k"]
    w13, s13, w2, s2 = make_experts(E, D, I, gen)
    cases = [("T=1", 1, "random"), ("T=64 all-to-one", 64, "one"), ("T=64 padded", 64, "padded")]
    if not quick:
        cases += [("T=8", 8, "random"), ("T=64", 64, "random"), ("T=8192", 8192, "random")]
    for name, T, rule in cases:
        ids = torch.rand(T, E, generator=gen, device=DEV).topk(k, dim=1).indices
        if rule == "one":
            ids[:, 0] = 7
            ids[:, 1:] = torch.where(ids[:, 1:] == 7, 8, ids[:, 1:])
        if rule == "padded":
            ids[60:] = -1
            ids[3, 2] = E
        weights = torch.rand(T, k, generator=gen, device=DEV) + 0.25
        x = make_x(T, D, gen)
        base = pick_moe_config(T * k, E)._replace(decode_max_pairs=0)  # the grouped kernels
        variants = [("", None)]
        if name in ("T=1", "T=64 padded", "T=64"):
            variants += [(" [grouped]", base),
                         (" [swap_ab int_decode]", base._replace(swap_ab=True, int_decode=True)),
                         (" [split_nibbles int_decode]", base._replace(split_nibbles=True, int_decode=True)),
                         (" [torch route]", base._replace(fused_route=False))]
            if T * k <= ROUTE_FUSED_MAX_PAIRS:
                want, got = route(ids, E, base.block_m), route_fused(ids, E, base.block_m)
                same = all(torch.equal(getattr(got, f), getattr(want, f)) for f in Routing._fields)
                report(f"route_fused {name}", same, "equal to the torch routing bit for bit")
        S = min(T, 256)
        h, hb, amb = h_reference(x[:S], ids[:S], weights[:S], w13, s13, LIMIT,
                                  window=lambda g: 2.0 ** -22 * (g.abs() + 8))
        bound, deq_ref = h_bound(h, hb, amb)
        yr, mag, carried = y_reference(deq_ref, bound, ids[:S], w2, s2)
        ref, tol = combine_tol(yr, y_tol(yr, mag, carried, I, acc_ulps=2.0), ids[:S], E)
        n_amb = int(amb.view(amb.shape[0], -1, 128).any(2).sum())
        for tag, cfg in variants:
            out = fp4_moe(x, ids, weights, w13, s13, w2, s2, LIMIT, config=cfg)
            err, r = ratio(out[:S], ref, tol)
            ok = r <= 1.0 and bool(torch.isfinite(out).all())
            if rule == "padded":
                ok = ok and bool((out[60:] == 0).all())
            report(f"fp4_moe {name}{tag}", ok, f"max err {err:.3e}, max err/bound {r:.3f} "
                   f"({S} tokens checked; {n_amb} ambiguous h blocks of {amb.numel() // 128})")
        del h, hb, amb, bound, deq_ref, yr, mag, carried
        if name in ("T=1", "T=64", "T=64 padded", "T=8192"):
            same_twice_and_in_graph(f"fp4_moe {name}",
                                    lambda: fp4_moe(x, ids, weights, w13, s13, w2, s2, LIMIT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU under TRITON_INTERPRET=1 at tiny shapes: checks this script runs")
    args = ap.parse_args()
    t0 = time.time()
    if args.smoke:
        global DEV
        DEV = "cpu"
        FLASH_FP8.clear()
        FLASH_FP8.update({"tiny": (96, 256)})
        PREFILL_SHAPES.clear()
        MOE.update(E=8, D=256, I=256, k=3)
        args.quick = True
    gen = torch.Generator(device=DEV).manual_seed(0)
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)"
    print(f"device {name}, torch {torch.__version__}", flush=True)
    for step in (check_act_quant, lambda g: check_fp8(g, args.quick), lambda g: check_moe(g, args.quick)):
        try:
            step(gen)
        except Exception as e:  # report and go on: one broken kernel should not hide the others
            import traceback
            traceback.print_exc()
            report("exception", False, f"{type(e).__name__}: {e}")
        torch.cuda.empty_cache()
    print(f"{len(FAILS)} failed; {time.time() - t0:.0f} s", flush=True)
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
