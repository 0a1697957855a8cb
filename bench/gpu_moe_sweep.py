"""FP4 MoE at decode sizes on one GPU: correctness, the decode GEMVs against the grouped kernels, floors, a config sweep.

    python3 bench/gpu_moe_sweep.py [--out FILE.json] [--quick | --smoke]

One device call (about 4-5 min on an H200; --quick: T = 1, 16, 64 and a smaller sweep). Flash's
MoE: E = 256, D = 4096, I = 2048, top-6, random distinct experts per token.

1. Copy bandwidth (a 1 GiB device-to-device copy, bytes read + written; ``bench_kernels``).
2. Correctness at T = 1, 4, 16, 32, 64, 256 (random routing), T = 64 with every token's first
   choice on one expert, and T = 64 with padded rows: the decode path (forced at every T, with
   ``pick_gemv_configs``; and ``decode_max_pairs=0``, the grouped kernels, at T = 1 and 64) and the torch path
   (``layers.quant.fp4_moe_ref``, fp32; not on the padded case: it has no padding ids) each
   against the float64 simulation of
   tests/test_fp4_moe.py within the bound of bench/gpu_quant_check.py (exact first projection by
   construction; ambiguity window 2^-22 (|g| + 8); fp32 accumulation bound doubled); the kernel
   against the torch path within the sum of the two bounds; two calls bit-identical, a CUDA-graph
   replay equal to the eager call.
3. Timing (median of CUDA-graph replays, each after an L2 flush: weights come from HBM) at
   T = 1, 4, 16, 32, 64, 256: the grouped kernels (``decode_max_pairs=0``) and the decode path,
   end to end (act-quant and routing included) and per stage. Floor = bytes of the distinct
   selected experts' w13 + w2 + scales / copy bandwidth; per projection: that projection's bytes.
   Also T = 64 with every token's first choice on one expert (the decode path's worst case: it
   runs one expert's rows one after another).
4. Sweep of the GEMV launch shapes per projection and T (block_n, block_k, split_k, warps,
   stages, nibble decode f16 / e4m3 / lut): each projection's best beside its floor, then end to end with both
   bests; the last lines print a suggested ``pick_gemv_configs`` table.
5. The shared expert's FP8 linears (w1 + w3 4096 x 4096, w2 4096 x 2048) at M = 1, 4, 16, 64:
   the Triton shape rule (the CUDA-core GEMV up to ``GEMV_MAX_M``, then the swapped tensor-core
   kernel) and a sweep of both (tiles, splits, warps) against weight bytes / copy bandwidth.
Prints every figure beside its floor; exits 1 if a correctness check fails. ``--smoke``: the CPU
under TRITON_INTERPRET=1 at tiny shapes (E = 8, D = I = 256, top-2; host timers): checks that the
script runs, figures meaningless.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench", ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import bench_kernels as bk  # noqa: E402
from dsv4_backend.kernels import fp4_moe as moe  # noqa: E402
from dsv4_backend.kernels import fp4_moe_decode as dec  # noqa: E402
from dsv4_backend.kernels.fp8_gemm import (  # noqa: E402
    GEMV_MAX_M, Fp8GemvConfig, GemmConfig, act_quant_fp8, fp8_block_gemm, pick_config, pick_gemv_config,
)
from dsv4_backend.layers.quant import fp4_moe_ref  # noqa: E402
from test_fp4_moe import (  # noqa: E402
    combine_tol, h_bound, h_reference, make_experts, make_x, y_reference, y_tol,
)

DEV = "cuda"
E, D, I, K_TOP = 256, 4096, 2048, 6
SKEWED_T = 64  # tokens of the one-expert and padded correctness cases
SHARED = {"shared.w13": (4096, 4096), "shared.w2": (4096, 2048)}
FP8_M = (1, 4, 16, 64)
LIMIT = 10.0
GROUPED = dict(decode_max_pairs=0)
RESULTS: dict = {"checks": [], "timing": [], "sweep": [], "fp8": []}
FAILS: list[str] = []


def log(msg: str) -> None:
    print(msg, flush=True)


def us(fn) -> float:
    if DEV != "cuda":  # --smoke: one host-timed call after a warm one
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return bk.cold_replay_us(fn)


def num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 132


def try_us(fn) -> float | None:
    try:
        return us(fn)
    except Exception as e:  # a launch shape this GPU cannot compile is skipped, and says why
        log(f"    skipped: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
        if DEV == "cuda":
            torch.cuda.synchronize()
        return None


def check(name: str, ok: bool, detail: str) -> None:
    RESULTS["checks"].append(dict(name=name, ok=ok, detail=detail))
    if not ok:
        FAILS.append(name)
    log(f"  [{'ok' if ok else 'FAIL'}] {name}: {detail}")


def routing(T: int, rule: str, gen) -> torch.Tensor:
    ids = torch.rand(T, E, generator=gen, device=DEV).topk(K_TOP, dim=1).indices
    if rule == "one":
        one = 7 % (E - 1)  # expert 7 at Flash's E; its other choices move 7 to 8
        ids[:, 0] = one
        ids[:, 1:] = torch.where(ids[:, 1:] == one, one + 1, ids[:, 1:])
    if rule == "padded":
        ids[T - 4:] = -1
        ids[3, K_TOP - 1] = E
    return ids


def ratio(out, ref, tol) -> tuple[float, float]:
    """(max |out - ref|, max |out - ref| / tol); a zero bound (an all-padding row) admits only 0."""
    err = (out.double() - ref).abs()
    return float(err.max()), float((err / tol.clamp_min(1e-300)).max())


def check_correctness(experts, sizes, gen) -> None:
    w13, s13, w2, s2 = experts
    log("\n== correctness against the float64 simulation and the torch path ==")
    B = SKEWED_T
    cases = [(f"T={T}", T, "random") for T in sizes] + [(f"T={B} one expert", B, "one"), (f"T={B} padded", B, "padded")]
    for name, T, rule in cases:
        ids = routing(T, rule, gen)
        weights = torch.rand(T, K_TOP, generator=gen, device=DEV) + 0.25
        x = make_x(T, D, gen)
        h, hb, amb = h_reference(x, ids, weights, w13, s13, LIMIT, window=lambda g: 2.0 ** -22 * (g.abs() + 8))
        bound, deq_ref = h_bound(h, hb, amb)
        yr, mag, carried = y_reference(deq_ref, bound, ids, w2, s2)
        ref, tol = combine_tol(yr, y_tol(yr, mag, carried, I, acc_ulps=2.0), ids, E)
        del h, hb, bound, deq_ref, yr, mag, carried
        torch_out = None
        if rule != "padded":  # the torch path has no padding ids (the kernels' CUDA-graph rows)
            torch_out = fp4_moe_ref(x, ids, weights, w13, s13, w2, s2, LIMIT)
            err, r = ratio(torch_out, ref, tol)
            check(f"torch path {name}", r <= 1.0, f"max err {err:.3e}, err/bound {r:.3f}")
        variants = [("decode", moe.MoeConfig(decode_max_pairs=1 << 30))]  # default GEMV shapes, any T
        if T in (1, B):
            variants.append(("grouped", moe.pick_moe_config(T * K_TOP, E)._replace(**GROUPED)))
        for tag, cfg in variants:
            fn = lambda cfg=cfg: moe.fp4_moe(x, ids, weights, w13, s13, w2, s2, LIMIT, config=cfg)  # noqa: E731
            out = fn()
            err, r = ratio(out, ref, tol)
            ok = r <= 1.0 and bool(torch.isfinite(out).all())
            if rule == "padded":
                ok = ok and bool((out[T - 4:] == 0).all())
            check(f"{tag} {name}", ok, f"max err {err:.3e}, err/bound {r:.3f}")
            if torch_out is not None:
                e2, r2 = ratio(out, torch_out.double(), 2 * tol)
                check(f"{tag} {name} vs torch path", r2 <= 1.0,
                      f"max diff {e2:.3e}, diff/(both bounds) {r2:.3f}")
            if tag == "decode" and rule != "one" and DEV == "cuda":
                again = fn()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    captured = fn()
                g.replay()
                torch.cuda.synchronize()
                check(f"{tag} {name} deterministic", torch.equal(out, again) and torch.equal(out, captured),
                      "two eager calls and a graph replay bit-identical")
        del ref, tol, torch_out
        torch.cuda.empty_cache()


def expert_bytes(experts) -> tuple[int, int]:
    w13, s13, w2, s2 = experts
    return w13[0].numel() + s13[0].numel(), w2[0].numel() + s2[0].numel()


def sweep_candidates(quick: bool) -> list[dec.GemvConfig]:
    G = dec.GemvConfig
    if DEV != "cuda":
        return [G(128, 128, 1), G(256, 128, 2, decode="lut")]
    shapes = [G(bn, 128, 1, 4, 2, d) for bn in (16, 32, 64) for d in dec.DECODES]
    shapes += [G(32, 128, 1, 2, 2), G(32, 128, 1, 8, 2), G(32, 128, 1, 4, 1), G(32, 128, 1, 4, 3),
               G(32, 256, 1, 4, 2), G(64, 256, 1, 8, 2), G(128, 128, 1, 8, 2), G(16, 256, 1, 2, 2)]
    if quick:
        shapes = shapes[:9]
    return [c._replace(split_k=s) for c in shapes for s in (1, 2, 4)]


def bench_decode(experts, sizes, copy_gbps, quick, gen) -> None:
    w13, s13, w2, s2 = experts
    b_up, b_down = expert_bytes(experts)
    log(f"\n== FP4 MoE at decode: grouped kernels vs decode GEMVs (copy {copy_gbps:.0f} GB/s; "
        f"{(b_up + b_down) / 2**20:.2f} MiB per expert) ==")
    log(f"{'T':>4} {'exp':>4} {'floor':>7} | {'grouped':>8} {'%fl':>4} | {'decode':>8} {'%fl':>4} | decode stages us "
        f"(aq, gate-up [%fl], swiglu, down [%fl], combine) | configs")
    best_rule = []
    for T in sizes:
        ids = routing(T, "random", gen)
        weights = torch.rand(T, K_TOP, generator=gen, device=DEV)
        x = torch.randn(T, D, generator=gen, device=DEV).to(torch.bfloat16)
        n_exp = int(ids.unique().numel())
        f_up, f_down = (n_exp * b / (copy_gbps * 1e9) * 1e6 for b in (b_up, b_down))
        floor = f_up + f_down
        grouped = moe.pick_moe_config(T * K_TOP, E)._replace(**GROUPED)
        t_old = us(lambda: moe.fp4_moe(x, ids, weights, w13, s13, w2, s2, LIMIT, config=grouped))
        up, down = dec.pick_gemv_configs(T * K_TOP)
        cfg_new = moe.MoeConfig(decode_max_pairs=1 << 30, gemv_gate_up=up, gemv_down=down)
        t_new = us(lambda: moe.fp4_moe(x, ids, weights, w13, s13, w2, s2, LIMIT, config=cfg_new))
        flat = ids.reshape(-1).contiguous()
        wf = weights.reshape(-1).contiguous()
        xq, xs = act_quant_fp8(x)
        part = dec.fp4_gemv(xq, xs, flat, w13, s13, K_TOP, up)
        hq, hs = dec.swiglu_quant(part, flat, wf, E, LIMIT)
        part2 = dec.fp4_gemv(hq, hs, flat, w2, s2, 1, down)
        st = [us(lambda: act_quant_fp8(x)),
              us(lambda: dec.fp4_gemv(xq, xs, flat, w13, s13, K_TOP, up)),
              us(lambda: dec.swiglu_quant(part, flat, wf, E, LIMIT)),
              us(lambda: dec.fp4_gemv(hq, hs, flat, w2, s2, 1, down)),
              us(lambda: dec.combine_splits(part2, ids, E))]
        row = dict(T=T, experts=n_exp, floor_us=floor, floor_up_us=f_up, floor_down_us=f_down,
                   grouped_us=t_old, decode_us=t_new, stages_us=st, up=up._asdict(), down=down._asdict())
        log(f"{T:4d} {n_exp:4d} {floor:7.1f} | {t_old:8.1f} {100 * floor / t_old:3.0f}% | {t_new:8.1f} "
            f"{100 * floor / t_new:3.0f}% | {st[0]:.1f}, {st[1]:.1f} [{100 * f_up / st[1]:.0f}%], {st[2]:.1f}, "
            f"{st[3]:.1f} [{100 * f_down / st[3]:.0f}%], {st[4]:.1f} | up {tuple(up)} down {tuple(down)}")
        best = {}
        for proj, fl, run in (("gate_up", f_up, lambda c: dec.fp4_gemv(xq, xs, flat, w13, s13, K_TOP, c)),
                              ("down", f_down, lambda c: dec.fp4_gemv(hq, hs, flat, w2, s2, 1, c))):
            times = [(try_us(lambda c=c: run(c)), c) for c in sweep_candidates(quick)]
            times = [(t, c) for t, c in times if t is not None]
            times.sort(key=lambda p: p[0])
            RESULTS["sweep"].append(dict(T=T, projection=proj, floor_us=fl,
                                         configs=[(t, tuple(c)) for t, c in times]))
            top = ", ".join(f"{tuple(c)} {t:.1f}" for t, c in times[:3])
            log(f"      sweep {proj:7s} floor {fl:6.1f} us: best {times[0][0]:7.1f} us "
                f"({100 * fl / times[0][0]:.0f}% floor); top 3: {top}")
            best[proj] = times[0][1]
        cfg_best = moe.MoeConfig(decode_max_pairs=1 << 30, gemv_gate_up=best["gate_up"], gemv_down=best["down"])
        t_best = us(lambda: moe.fp4_moe(x, ids, weights, w13, s13, w2, s2, LIMIT, config=cfg_best))
        row.update(best_us=t_best, best_up=best["gate_up"]._asdict(), best_down=best["down"]._asdict())
        log(f"      end to end with both bests: {t_best:.1f} us ({100 * floor / t_best:.0f}% floor; "
            f"grouped {t_old:.1f}, decode default {t_new:.1f})")
        RESULTS["timing"].append(row)
        best_rule.append((T, t_old, t_best, best["gate_up"], best["down"]))
        del part, part2, hq, hs
        torch.cuda.empty_cache()
    B = SKEWED_T
    ids = routing(B, "one", gen)  # every token's first choice on one expert: B rows of it
    weights = torch.rand(B, K_TOP, generator=gen, device=DEV)
    x = torch.randn(B, D, generator=gen, device=DEV).to(torch.bfloat16)
    n_exp = int(ids.unique().numel())
    floor = n_exp * (b_up + b_down) / (copy_gbps * 1e9) * 1e6
    grouped = moe.pick_moe_config(B * K_TOP, E)._replace(**GROUPED)
    t_old = us(lambda: moe.fp4_moe(x, ids, weights, w13, s13, w2, s2, LIMIT, config=grouped))
    cfg_new = moe.MoeConfig(decode_max_pairs=1 << 30)
    t_new = us(lambda: moe.fp4_moe(x, ids, weights, w13, s13, w2, s2, LIMIT, config=cfg_new))
    RESULTS["timing"].append(dict(T=B, rule="one expert", experts=n_exp, floor_us=floor, grouped_us=t_old,
                                  decode_us=t_new))
    log(f"  T={B} with one expert in every token's choices ({B} rows of it; {n_exp} experts): floor "
        f"{floor:.1f} us, grouped {t_old:.1f} us, decode (default shapes) {t_new:.1f} us: the decode "
        f"path runs an expert's rows one after another")
    log("\n  suggested rule (T k <= decode_max_pairs while the decode path beats the grouped one):")
    for T, t_old, t_best, bu, bd in best_rule:
        log(f"    T={T:4d} (T k = {T * K_TOP:5d}): {'decode' if t_best < t_old else 'grouped'}; "
            f"gate_up {tuple(bu)}, down {tuple(bd)}")


def bench_shared_fp8(copy_gbps: float, gen) -> None:
    log("\n== shared expert FP8 linears at decode (Triton, act-quant excluded) ==")
    for name, (N, K) in SHARED.items():
        w = (torch.randn(N, K, generator=gen, device=DEV) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
        ws = torch.pow(2.0, torch.randint(-12, -4, (-(-N // 128), -(-K // 128)), generator=gen, device=DEV).float())
        for M in FP8_M:
            xq, xs = act_quant_fp8(torch.randn(M, K, generator=gen, device=DEV).to(torch.bfloat16))
            floor = (N * K + ws.numel() * 4) / (copy_gbps * 1e9) * 1e6
            sms = num_sms()
            rule = pick_gemv_config(N, K, sms, M) if M <= GEMV_MAX_M else pick_config(M, N, K, sms)
            t = us(lambda: fp8_block_gemm(xq, xs, w, ws, backend="triton"))
            bm = max(16, 1 << (M - 1).bit_length())
            cands = [GemmConfig(bm, bn, s, True, 4, 4) for bn in (64, 128) for s in (2, 4, 8, 16)]
            cands += [Fp8GemvConfig(bn, s, nw, st) for bn in (16, 32, 64) for s in (1, 2, 4, 8)
                      for nw, st in ((4, 2), (8, 3))]
            if DEV != "cuda":
                cands = [GemmConfig(bm, 64, 2, True, 4, 4), Fp8GemvConfig(64, 2)]
            times = [(try_us(lambda c=c: fp8_block_gemm(xq, xs, w, ws, config=c)), c) for c in cands]
            times = sorted([(tt, c) for tt, c in times if tt is not None], key=lambda p: p[0])
            RESULTS["fp8"].append(dict(shape=name, M=M, floor_us=floor, rule_us=t, rule=tuple(rule),
                                       sweep=[(tt, tuple(c)) for tt, c in times]))
            log(f"  {name:10s} M={M:3d} floor {floor:5.1f} us | rule {tuple(rule)} {t:6.1f} us "
                f"({100 * floor / t:.0f}%) | sweep best {tuple(times[0][1])} {times[0][0]:.1f} us "
                f"({100 * floor / times[0][0]:.0f}%)")
        del w, ws


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--quick", action="store_true", help="T = 1, 16, 64 and fewer sweep shapes")
    ap.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes: checks the script runs")
    args = ap.parse_args()
    t0 = time.time()
    sizes = (1, 16, 64) if args.quick else (1, 4, 16, 32, 64, 256)
    if args.smoke:
        global DEV, E, D, I, K_TOP, SKEWED_T, FP8_M
        DEV, E, D, I, K_TOP, SKEWED_T, FP8_M = "cpu", 8, 256, 256, 2, 6, (1,)
        SHARED.clear()
        SHARED["tiny"] = (64, 256)
        sizes = (1,)
        ceil = bk.Ceilings(1.0, 1.0)
        log("cpu (interpreter), tiny shapes: figures meaningless")
    else:
        ceil = bk.measure_ceilings(DEV)
        log(f"{torch.cuda.get_device_name()}: copy {ceil.copy_gbps:.0f} GB/s (1 GiB device copy, read + write)")
    gen = torch.Generator(device=DEV).manual_seed(0)
    experts = make_experts(E, D, I, gen)
    steps = (lambda: check_correctness(experts, sizes, gen),
             lambda: bench_decode(experts, sizes, ceil.copy_gbps, args.quick, gen),
             lambda: bench_shared_fp8(ceil.copy_gbps, gen))
    for step in steps:
        try:
            step()
        except Exception as e:  # report and go on: one broken part should not hide the others
            import traceback
            traceback.print_exc()
            check("exception", False, f"{type(e).__name__}: {e}")
        log(f"  ({time.time() - t0:.0f} s)")
        RESULTS.update(copy_gbps=ceil.copy_gbps, failures=FAILS)
        if args.out:  # after every part: a run cut short keeps what it measured
            args.out.write_text(json.dumps(RESULTS, indent=1))
    log(f"\n{'ALL CHECKS PASSED' if not FAILS else 'FAILED: ' + ', '.join(FAILS)} in {time.time() - t0:.0f} s")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
