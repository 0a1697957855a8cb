"""The one-row FP8 GEMV (kernels/fp8_gemv.py) against the path it replaces, on Flash's decode shapes.

At batch 1 each FP8 linear used to be act-quant + ``fp8_gemm``'s split CUDA-core GEMV + (with K
split) a split-sum launch; ``fp8_row_gemv`` is one launch. Each shape as the engine stacks it is
timed as a CUDA graph of 8 calls over 8 copies of the weight (every call reads its weight from
HBM), us a call, against the weight + scale bytes over the copy bandwidth measured in the same
run: the old path end to end, the new default, and a grid of rows-a-program x blocks-a-step x
warps x stages. ``wo_a`` (grouped, W8A16) is timed against the bf16 GEMV on its folded bf16
weight, the path it replaces. Every output is checked against the old path's within twice the
fp32 bound of the sums plus a bf16 step.

``--cuda`` adds ``fp8_row.cu`` (``CudaRowConfig``: its default rule and a grid of CTA shapes)
beside the Triton kernel on every shape, under the same bound.

``--chain`` times ``wo_a -> wo_b`` as the model runs them (``wo_b`` reads ``wo_a``'s output; 8
pairs over 8 weight copies in one graph) for several kernel choices of each, beside each alone: in
the model ``wo_b`` took 24 us after ``wo_a`` against 17 us alone (docs/PERF.md, session 21).

    python3 bench/probe_fp8_row_gemv.py [--quick] [--cuda] [--chain] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
for p in (ROOT, ROOT.parent):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_kernels import measure_ceilings  # noqa: E402
from probe_gemv_bf16 import graph_us  # noqa: E402

from dsv4_backend.kernels.bf16_gemv import bf16_gemv  # noqa: E402
from dsv4_backend.kernels.fp8_gemm import act_quant_fp8, fp8_block_gemm, pick_gemv_config  # noqa: E402
from dsv4_backend.kernels.fp8_gemv import (CudaRowConfig, RowGemvConfig, W8A16Config, cuda_row_config,  # noqa: E402
                                           fp8_row_gemv, fp8_w8a16)
from dsv4_backend.kernels.kv_store import sm_count  # noqa: E402

# (name, N, K per group, groups): Flash's FP8 linears at one token, stacked as the engine runs them
SHAPES = (("wo_a (W8A16)", 8192, 4096, 8), ("wq_a+wkv", 1536, 4096, 1), ("wq_b", 32768, 1024, 1), ("wq_b+indexer.wq_b", 40960, 1024, 1),
          ("wo_b", 4096, 8192, 1), ("shared w1+w3", 4096, 4096, 1), ("shared w2", 4096, 2048, 1))
COPIES = 8


def fp8_weight(N: int, K: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random e4m3 weight [N, K] and its power-of-two 128 x 128 block scales."""
    w = (torch.randn(N, K, device="cuda", generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.pow(2.0, torch.randint(-12, -4, (-(-N // 128), -(-K // 128)), device="cuda", generator=gen).float())
    return w, s


def grid(quick: bool):
    if quick:
        return [RowGemvConfig(bn, bl, nw, 4) for bn, bl, nw in itertools.product((16, 32), (2, 4), (2, 4))]
    # 16 to 256 weight bytes a thread a step (one to sixteen 16-byte loads)
    return [RowGemvConfig(bn, bl, nw, st) for bn, bl, nw, st in
            itertools.product((4, 8, 16, 32), (1, 2, 4, 8), (2, 4, 8), (3, 4)) if 16 <= bn * bl * 4 // nw <= 256]


def cuda_grid(R: int) -> list[CudaRowConfig]:
    """CTA shapes of fp8_row.cu whose rows divide 128 and a group's R rows: 4 or 8 warps, 2-8
    16-byte loads in flight a lane."""
    out = []
    for rw, rg, kw, u in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4), (1, 2, 4)):
        c = CudaRowConfig(rw, rg, kw, u)
        if c.warps in (4, 8) and 128 % c.rows == 0 and R % c.rows == 0 and 2 <= rw * u <= 8:
            out.append(c)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="an 8-config grid instead of ~50")
    ap.add_argument("--cuda", action="store_true", help="fp8_row.cu's grid beside the Triton kernel")
    ap.add_argument("--skip-w8a16", action="store_true", help="no W8A16 rows at 2-64 activation rows")
    ap.add_argument("--chain", action="store_true", help="only wo_a -> wo_b as the model chains them")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    bw = measure_ceilings().copy_gbps
    sms = sm_count(torch.device("cuda"))
    print(f"copy {bw:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.chain:
        rows = chain_rows(bw, gen)
        if args.out:
            args.out.write_text(json.dumps(dict(copy_gbps=bw, chain=rows), indent=1))
        return
    results = []
    for name, N, K, G in SHAPES:
        ws, ss = zip(*(fp8_weight(N, K, gen) for _ in range(COPIES)))
        x = (torch.randn(1, K * G, device="cuda", generator=gen) * 2).bfloat16()
        floor = (N * K + ss[0].numel() * 4) / bw / 1e3
        mode = "bf16" if G > 1 else "quant"
        if G > 1:   # the path replaced: the bf16 GEMV over the folded weight (twice the bytes)
            folded = [(w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)).bfloat16()
                      for w, s in zip(ws, ss)]
            old_calls = [lambda f=f: bf16_gemv(x, f, groups=G) for f in folded]
            ref = old_calls[0]().float()
        else:
            cfg = pick_gemv_config(N, K, sms, 1)
            old_calls = [lambda w=w, s=s: fp8_block_gemm(*act_quant_fp8(x), w, s, torch.bfloat16, cfg, "triton")
                         for w, s in zip(ws, ss)]
            ref = old_calls[0]().float()
        xq, xs = act_quant_fp8(x)
        wd = ws[0].float() * ss[0].repeat_interleave(128, 0).repeat_interleave(128, 1)
        a = (x.float() if G > 1 else xq.float() * xs.repeat_interleave(128, 1)).view(1, G, K).abs()
        mag = torch.einsum("tgi,gri->tgr", a, wd.abs().view(G, N // G, K)).reshape(1, N)
        bound = 2 * K * 2.0 ** -24 * mag + 2.0 ** -7 * ref.abs() + 1e-30
        del wd
        rows = [dict(shape=name, kernel="old", us=graph_us(old_calls))]
        for cfg in [None] + grid(args.quick):
            try:
                y = fp8_row_gemv(x, ws[0], ss[0], mode=mode, groups=G, config=cfg)
                ratio = float(((y.float() - ref).abs() / bound).max())
                us = graph_us([lambda w=w, s=s: fp8_row_gemv(x, w, s, mode=mode, groups=G, config=cfg)
                               for w, s in zip(ws, ss)])
            except Exception as e:  # noqa: BLE001 (a launch shape that does not compile is reported)
                print(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            rows.append(dict(shape=name, kernel="row", config=None if cfg is None else list(cfg), us=us,
                             ratio=ratio, ok=ratio <= 1))
        if args.cuda:
            for cfg in [None] + cuda_grid(N // G):
                cc = cfg or "cuda-default"
                try:
                    call = (lambda w, s, c=cfg or cuda_row_config(N, K, sms):
                            fp8_row_gemv(x, w, s, mode=mode, groups=G, config=c))
                    y = call(ws[0], ss[0])
                    ratio = float(((y.float() - ref).abs() / bound).max())
                    us = graph_us([lambda w=w, s=s: call(w, s) for w, s in zip(ws, ss)])
                except Exception as e:  # noqa: BLE001
                    print(f"  {name} cuda {cc}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                rows.append(dict(shape=name, kernel="cuda", config=None if cfg is None else list(cfg), us=us,
                                 ratio=ratio, ok=ratio <= 1))
        for r in rows:
            r.update(floor_us=floor, pct_copy=100 * floor / r["us"])
        results.extend(rows)
        row = [r for r in rows if r["kernel"] == "row"]
        best = min(row, key=lambda r: r["us"])
        default = next(r for r in row if r["config"] is None)
        print(f"{name:18s} N {N:6d} K {K:5d} G {G}: floor {floor:6.2f} us | old {rows[0]['us']:6.2f} "
              f"({rows[0]['pct_copy']:4.1f}%) | row default {default['us']:6.2f} ({default['pct_copy']:4.1f}%) "
              f"| best {best['us']:6.2f} ({best['pct_copy']:4.1f}%) {best['config']} | worst ratio to bound "
              f"{max(r['ratio'] for r in row):.3f}", flush=True)
        for r in sorted(row, key=lambda r: r["us"])[1:5]:
            print(f"      next: {r['config']} {r['us']:6.2f} us", flush=True)
        cu = [r for r in rows if r["kernel"] == "cuda"]
        if cu:
            cdef = next((r for r in cu if r["config"] is None), None)
            line = [f"  fp8_row.cu: worst ratio to bound {max(r['ratio'] for r in cu):.3f}"]
            if cdef:
                line.append(f"default {cdef['us']:6.2f} ({cdef['pct_copy']:4.1f}%)")
            line += [f"{r['config']} {r['us']:6.2f} ({r['pct_copy']:4.1f}%)" for r in sorted(cu, key=lambda r: r["us"])[:5]]
            print(" | ".join(line), flush=True)
        del ws, ss
        torch.cuda.empty_cache()
    if not args.skip_w8a16:
        results += w8a16_rows(bw, gen)
    if args.out:
        args.out.write_text(json.dumps(dict(copy_gbps=bw, rows=results), indent=1))


def chain_rows(bw: float, gen: torch.Generator) -> list[dict]:
    """``wo_a`` (W8A16, 8 groups) then ``wo_b`` on its output, us a pair and each alone, for the
    Triton kernel's default and a few ``fp8_row.cu`` shapes of each."""
    (_, Na, Ka, G), (_, Nb, Kb, _) = SHAPES[0], SHAPES[4]
    wa = [fp8_weight(Na, Ka, gen) for _ in range(COPIES)]
    wb = [fp8_weight(Nb, Kb, gen) for _ in range(COPIES)]
    o = (torch.randn(1, Ka * G, device="cuda", generator=gen) * 2).bfloat16()
    za = fp8_row_gemv(o, *wa[0], mode="bf16", groups=G)
    choices_a = [None, CudaRowConfig(2, 8, 1, 2), CudaRowConfig(4, 8, 1, 2)]
    choices_b = [None, CudaRowConfig(2, 8, 1, 2), CudaRowConfig(1, 8, 2, 4), CudaRowConfig(2, 8, 2, 2),
                 CudaRowConfig(4, 4, 2, 2)]
    floor_a = (Na * Ka + wa[0][1].numel() * 4) / bw / 1e3
    floor_b = (Nb * Kb + wb[0][1].numel() * 4) / bw / 1e3
    rows = []

    def timed(what, calls, floor):
        try:
            us = graph_us(calls)
        except Exception as e:  # noqa: BLE001 (a launch shape that cannot run is reported)
            print(f"  {what}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            return
        rows.append(dict(what=what, us=us, floor_us=floor))
        print(f"  {what:58s} {us:7.2f} us (floor {floor:6.2f})", flush=True)

    for ca in choices_a:
        timed(f"wo_a alone {ca}", [lambda w=w: fp8_row_gemv(o, *w, mode="bf16", groups=G, config=ca) for w in wa],
              floor_a)
    for cb in choices_b:
        timed(f"wo_b alone {cb}", [lambda w=w: fp8_row_gemv(za, *w, config=cb) for w in wb], floor_b)
    for ca, cb in itertools.product(choices_a, choices_b):
        timed(f"wo_a {ca} -> wo_b {cb}",
              [lambda a=a, b=b: fp8_row_gemv(fp8_row_gemv(o, *a, mode="bf16", groups=G, config=ca), *b, config=cb)
               for a, b in zip(wa, wb)], floor_a + floor_b)
    return rows


def w8a16_rows(bw: float, gen: torch.Generator) -> list[dict]:
    """wo_a at 2-64 rows: the W8A16 tensor-core kernel (default and a few tiles) against the
    einsum over the folded bf16 weight that the quantised model ran before (its weight was bf16)."""
    N, K, G = 8192, 4096, 8
    ws, ss = zip(*(fp8_weight(N, K, gen) for _ in range(COPIES)))
    folded = [(w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)).bfloat16() for w, s in zip(ws, ss)]
    floor = (N * K + N * K // 16384 * 4) / bw / 1e3
    out = []
    for M in (2, 8, 32, 64):
        x = torch.randn(M, G * K, device="cuda", generator=gen).bfloat16()
        ein = [lambda f=f: torch.einsum("tgi,gri->tgr", x.view(M, G, K), f.view(G, N // G, K)) for f in folded]
        ref = ein[0]().reshape(M, N).float()
        line = [f"wo_a W8A16 M={M:2d}: floor {floor:5.2f} us | bf16 einsum {graph_us(ein):6.2f}"]
        for cfg in (None, W8A16Config(32, 16, 4, 3), W8A16Config(64, 16, 4, 4), W8A16Config(32, 32, 4, 4),
                    W8A16Config(64, 64, 4, 3), W8A16Config(16, 16, 2, 4)):
            if cfg is not None and cfg.block_m < min(M, 16):
                continue
            try:
                y = fp8_w8a16(x, ws[0], ss[0], groups=G, config=cfg).float()
                rel = float(((y - ref).abs() / (ref.abs() + 1e-2)).max())
                us = graph_us([lambda w=w, s=s: fp8_w8a16(x, w, s, groups=G, config=cfg) for w, s in zip(ws, ss)])
            except Exception as e:  # noqa: BLE001
                line.append(f"{cfg}: {type(e).__name__}")
                continue
            out.append(dict(shape="wo_a W8A16", M=M, config=None if cfg is None else list(cfg), us=us,
                            floor_us=floor, max_rel_vs_einsum=rel))
            line.append(f"{'default' if cfg is None else list(cfg)} {us:6.2f} ({100 * floor / us:4.1f}%, rel {rel:.1e})")
        print(" | ".join(line), flush=True)
    return out


if __name__ == "__main__":
    main()
