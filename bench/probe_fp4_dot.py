"""Probe: FP4-expert GEMMs on the tensor cores at decode sizes (one H200 call, ~1 min).

Three ways to stream one projection's selected FP4 experts (gate-up shape by default: N = 2I = 4096
rows, K = D = 4096) with swap-AB tiles (weights are the dot's M side, a request's <= 16 tokens its N):
  ds_w   tl.dot_scaled(weights e2m1 + e8m0 scales, activations bf16)
  ds_a   tl.dot_scaled(activations bf16, weights e2m1) (weights on the N side)
  f16    nibbles moved into fp16 bits in registers, one fp16 dot per 32-wide scale block
  load   the same tiles only loaded and summed: what the access pattern itself allows
(activations here are random bf16 with unit 1x128 scales: a speed probe, not the engine's path).
Each against the weight bytes / copy bandwidth of the same run, rotating the routed experts so no
step finds its weights in L2. Prints one line per (variant, T), and the max error against a float64
reference of the same (decoded) weights.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

R = 16  # token rows per expert tile (the dot's N side)


@triton.jit
def _program_tile(rows_ptr, exp_ptr, BN: tl.constexpr, RR: tl.constexpr):
    """Program (u, nb): its expert, its BN weight rows, the expert's RR token rows (-1 none)."""
    u = tl.program_id(0)
    e = tl.load(exp_ptr + u).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    r = tl.load(rows_ptr + u * RR + tl.arange(0, RR))
    return e, n, r


@triton.jit
def _ds_w_kernel(w_ptr, ws_ptr, a_ptr, rows_ptr, exp_ptr, out_ptr, N, K, sw_e, sw_n, ss_e, ss_n, k_split,
                 BN: tl.constexpr, BK: tl.constexpr, RR: tl.constexpr):
    e, n, r = _program_tile(rows_ptr, exp_ptr, BN, RR)
    kk = tl.arange(0, BK // 2)
    kb = tl.arange(0, BK // 32)
    ka = tl.arange(0, BK)
    acc = tl.zeros((BN, RR), dtype=tl.float32)
    w_base = w_ptr + e * sw_e + n.to(tl.int64)[:, None] * sw_n + kk[None, :]
    s_base = ws_ptr + e * ss_e + n.to(tl.int64)[:, None] * ss_n + kb[None, :]
    a_base = a_ptr + tl.maximum(r, 0).to(tl.int64)[None, :] * K + ka[:, None]
    k_lo = tl.program_id(2) * k_split
    for k0 in range(k_lo, k_lo + k_split, BK):
        w = tl.load(w_base + k0 // 2)
        ws = tl.load(s_base + k0 // 32)
        a = tl.load(a_base + k0, mask=(r >= 0)[None, :], other=0.0)
        acc = tl.dot_scaled(w, ws, "e2m1", a, None, "bf16", acc)
    tl.atomic_add(out_ptr + tl.maximum(r, 0).to(tl.int64)[None, :] * N + n[:, None], acc, mask=(r >= 0)[None, :])


@triton.jit
def _ds_a_kernel(w_ptr, ws_ptr, a_ptr, rows_ptr, exp_ptr, out_ptr, N, K, sw_e, sw_n, ss_e, ss_n, k_split,
                 BN: tl.constexpr, BK: tl.constexpr, RR: tl.constexpr):
    e, n, r = _program_tile(rows_ptr, exp_ptr, BN, RR)
    kk = tl.arange(0, BK // 2)
    kb = tl.arange(0, BK // 32)
    ka = tl.arange(0, BK)
    acc = tl.zeros((RR, BN), dtype=tl.float32)
    w_base = w_ptr + e * sw_e + n.to(tl.int64)[None, :] * sw_n + kk[:, None]   # [BK/2, BN]
    s_base = ws_ptr + e * ss_e + n.to(tl.int64)[:, None] * ss_n + kb[None, :]
    a_base = a_ptr + tl.maximum(r, 0).to(tl.int64)[:, None] * K + ka[None, :]
    k_lo = tl.program_id(2) * k_split
    for k0 in range(k_lo, k_lo + k_split, BK):
        w = tl.load(w_base + k0 // 2)
        ws = tl.load(s_base + k0 // 32)
        a = tl.load(a_base + k0, mask=(r >= 0)[:, None], other=0.0)
        acc = tl.dot_scaled(a, None, "bf16", w, ws, "e2m1", acc)
    tl.atomic_add(out_ptr + tl.maximum(r, 0).to(tl.int64)[:, None] * N + n[None, :], acc, mask=(r >= 0)[:, None])


@triton.jit
def _f16_kernel(w_ptr, ws_ptr, a_ptr, as_ptr, rows_ptr, exp_ptr, out_ptr, N, K, sw_e, sw_n, ss_e, ss_n,
                BN: tl.constexpr, KB: tl.constexpr, RR: tl.constexpr):
    """a: fp16 e4m3 codes [T, K] (exact), as: fp32 per-128 scales [T, K/128]."""
    e, n, r = _program_tile(rows_ptr, exp_ptr, BN, RR)
    rr = tl.maximum(r, 0).to(tl.int64)
    c = tl.arange(0, 16)
    acc = tl.zeros((BN, RR), dtype=tl.float32)
    w_base = w_ptr + e * sw_e + n.to(tl.int64)[:, None] * sw_n + c[None, :]
    s_base = ws_ptr + e * ss_e + n.to(tl.int64) * ss_n
    a_base = a_ptr + rr[None, :] * K + 2 * c[:, None]   # [16, RR] even K of a 32-block
    for k0 in range(0, K, 32 * KB):
        for j in tl.static_range(KB):
            kj = k0 + 32 * j
            b = tl.load(w_base + kj // 2).to(tl.int16)                      # [BN, 16]
            lo = (((b & 7) << 9) | ((b & 8) << 12)).to(tl.float16, bitcast=True)
            hi = ((((b >> 4) & 7) << 9) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True)
            ae = tl.load(a_base + kj, mask=(r >= 0)[None, :], other=0.0)
            ao = tl.load(a_base + kj + 1, mask=(r >= 0)[None, :], other=0.0)
            d = tl.dot(hi, ao, tl.dot(lo, ae))
            s = tl.load(s_base + kj // 32).to(tl.int32)
            ws = ((s - 127 + 14 + 127) << 23).to(tl.float32, bitcast=True)   # 2^(s-127) x 2^14
            xs = tl.load(as_ptr + rr * (K // 128) + kj // 128)
            acc += d * (ws[:, None] * xs[None, :])
    tl.store(out_ptr + rr[None, :] * N + n[:, None], acc, mask=(r >= 0)[None, :])


@triton.jit
def _load_kernel(w_ptr, ws_ptr, a_ptr, rows_ptr, exp_ptr, out_ptr, N, K, sw_e, sw_n, ss_e, ss_n, k_split,
                 BN: tl.constexpr, BK: tl.constexpr, RR: tl.constexpr):
    """The same weight and scale tiles as ``_ds_w_kernel``, only summed: the access pattern's own speed."""
    e, n, r = _program_tile(rows_ptr, exp_ptr, BN, RR)
    kk = tl.arange(0, BK // 2)
    kb = tl.arange(0, BK // 32)
    acc = tl.zeros((BN, BK // 2), dtype=tl.int32)
    w_base = w_ptr + e * sw_e + n.to(tl.int64)[:, None] * sw_n + kk[None, :]
    s_base = ws_ptr + e * ss_e + n.to(tl.int64)[:, None] * ss_n + kb[None, :]
    k_lo = tl.program_id(2) * k_split
    for k0 in range(k_lo, k_lo + k_split, BK):
        acc += tl.load(w_base + k0 // 2).to(tl.int32)
        acc += tl.sum(tl.load(s_base + k0 // 32).to(tl.int32), axis=1)[:, None]
    r0 = tl.min(r, axis=0)   # >= -1: the store below never runs, it only keeps the loads alive
    tl.store(out_ptr + tl.maximum(r0, 0).to(tl.int64) * N + n, tl.sum(acc, axis=1).to(tl.float32), mask=(r0 < -1))


LUT = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def dequant(w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(LUT, dtype=torch.float64, device=w.device)
    vals = torch.stack([lut[(w & 15).long()], lut[(w >> 4).long()]], -1).flatten(-2)
    return vals * torch.pow(2.0, ws.double() - 127).repeat_interleave(32, -1)


def routing(T: int, E: int, topk: int, gen: torch.Generator):
    """Per used expert: its token rows (padded with -1 to R)."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:topk] for _ in range(T)])
    experts = ids.unique()
    rows = torch.full((len(experts), R), -1, dtype=torch.int32)
    for u, e in enumerate(experts.tolist()):
        t = (ids == e).any(1).nonzero().flatten()[:R]
        rows[u, : len(t)] = t.int()
    return experts.int(), rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,16,32,64")
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--K", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = "cuda"
    E, N, K = args.experts, args.N, args.K
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=dev)
    ws = torch.randint(118, 127, (E, N, K // 32), dtype=torch.uint8, device=dev)
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(True), torch.cuda.Event(True)
    big2 = torch.empty_like(big)
    for _ in range(3):
        big2.copy_(big)
    t0.record()
    for _ in range(10):
        big2.copy_(big)
    t1.record(); torch.cuda.synchronize()
    copy_bw = 2 * 10 * big.numel() / (t0.elapsed_time(t1) * 1e-3) / 1e9
    print(f"copy bandwidth (read + write) {copy_bw:.0f} GB/s")
    del big, big2
    results = []
    configs = {
        "load": [(64, 128, 4, 3, 1), (64, 256, 4, 4, 1), (128, 256, 4, 4, 1), (64, 256, 4, 4, 4)],
        "ds_w": [(128, 128, 4, 3, 1), (128, 128, 4, 5, 1), (128, 128, 4, 4, 4), (64, 128, 4, 5, 4)],
        "ds_a": [(64, 256, 4, 3, 1), (64, 256, 4, 5, 1), (64, 128, 4, 5, 1), (64, 256, 4, 4, 4),
                 (64, 128, 4, 4, 8), (32, 256, 4, 4, 4), (128, 256, 8, 4, 2)],
        "f16": [(128, 4, 4, 3, 1), (64, 4, 4, 4, 1)],
    }
    for T in [int(t) for t in args.tokens.split(",")]:
        sets = [routing(T, E, 6, gen) for _ in range(16)]
        a = (torch.randn(T, K, device=dev) * 0.5).to(torch.bfloat16)
        a16 = a.float().to(torch.float16)
        asc = torch.ones(T, K // 128, device=dev)
        out = torch.empty(T, N, device=dev)
        experts0, rows0 = (x.to(dev) for x in sets[0])
        ref = torch.zeros(T, N, dtype=torch.float64, device=dev)
        for u, e in enumerate(experts0.tolist()):
            W = dequant(w[e], ws[e])
            for t in rows0[u].tolist():
                if t >= 0:
                    ref[t] += W @ a[t].double()
        n_bytes = [len(s[0]) * N * (K // 2 + K // 32) for s in sets]
        floor_us = sum(n_bytes) / len(sets) / (copy_bw * 1e9) * 1e6   # weight bytes / copy bandwidth
        dsets = [(e.to(dev), r.to(dev)) for e, r in sets]
        for name, cfgs in configs.items():
            for cfg in cfgs:
                bn, bk, nw, ns, split = cfg
                strides = (w.stride(0), w.stride(1), ws.stride(0), ws.stride(1), K // split)

                def launch(e_, r_):
                    grid = (len(e_), N // bn, split)
                    if name == "load":
                        _load_kernel[grid](w, ws, a, r_, e_, out, N, K, *strides, BN=bn, BK=bk, RR=R, num_warps=nw, num_stages=ns)
                    elif name == "ds_w":
                        _ds_w_kernel[grid](w, ws, a, r_, e_, out, N, K, *strides, BN=bn, BK=bk, RR=R, num_warps=nw, num_stages=ns)
                    elif name == "ds_a":
                        _ds_a_kernel[grid](w, ws, a, r_, e_, out, N, K, *strides, BN=bn, BK=bk, RR=R, num_warps=nw, num_stages=ns)
                    else:
                        grid = (len(e_), N // bn)
                        _f16_kernel[grid](w, ws, a16, asc, r_, e_, out, N, K, *strides[:4], BN=bn, KB=bk, RR=R, num_warps=nw, num_stages=ns)
                try:
                    out.zero_()
                    # accumulate per-expert outputs to compare with the reference's sums
                    acc = torch.zeros(T, N, dtype=torch.float64, device=dev)
                    for u in range(len(experts0)):
                        out.zero_()
                        launch(experts0[u:u + 1], rows0[u:u + 1])
                        acc += out.double()
                    err = (float("nan") if name == "load"
                           else (acc - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30))
                    for e_, r_ in dsets:
                        launch(e_, r_)
                    torch.cuda.synchronize()
                    t0.record()
                    reps = 5
                    for _ in range(reps):
                        for e_, r_ in dsets:
                            launch(e_, r_)
                    t1.record(); torch.cuda.synchronize()
                    us = t0.elapsed_time(t1) * 1e3 / (reps * len(dsets))
                except Exception as ex:  # noqa: BLE001
                    print(f"{name} T={T} cfg={cfg}: FAILED {type(ex).__name__}: {str(ex)[:200]}")
                    continue
                row = dict(variant=name, T=T, cfg=cfg, us=us, floor_us=floor_us, pct=100 * floor_us / us, rel_err=err)
                results.append(row)
                print(f"{name:5s} T={T:3d} experts~{len(sets[0][0]):3d} cfg={cfg} {us:8.1f} us  floor {floor_us:6.1f} us "
                      f"({100 * floor_us / us:5.1f}%)  rel err {err:.2e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(copy_bw=copy_bw, results=results), f, indent=1)


if __name__ == "__main__":
    main()
