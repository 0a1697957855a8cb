"""Does an L2 prefetch on a side stream, launched as a chain of small launches starts, shorten the
FP8 row GEMV that follows the chain? (Issue 13's batch-1 layer; measured no: docs/PERF.md session 20.)

At one token a layer alternates between launches that stream weights and chains of small
dependent launches during which HBM idles; a prefetch on a side stream could fill L2 with the
weight the chain's end reads. Prefetch modes: ``bulk`` (``cp.async.bulk.prefetch.L2``, sm_90, one
instruction per 64 KiB from one warp a program), ``line`` / ``line_last`` (``prefetch.global.L2``
per 128-byte line, default or ``evict_last`` policy), ``load`` (plain loads with ``evict_last``).

Each case is a CUDA graph, repeated ``REPS`` times in it: a read of 4x the L2 (its contents
evicted), then a fork: the side stream prefetches the first ``frac`` of the weight while the main
stream runs ``chain`` one-program launches (each a few us, like a layer's norms / RoPE / top-k)
and then the GEMV; the side stream joins after the GEMV. us per repetition, median of
``do_bench``. "GEMV after the chain" = case - (flush + chain alone). "hot" = the GEMV replayed
with its weight already in L2 (the best a prefetch can give).

    python3 bench/probe_l2_prefetch.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parent
for p in (ROOT, ROOT.parent):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_kernels import measure_ceilings  # noqa: E402
from probe_gemv_bf16 import graph_us  # noqa: E402

from dsv4_backend.kernels.fp8_gemv import fp8_row_gemv  # noqa: E402

MODES = ("bulk", "line", "line_last", "load")
BULK_CHUNK = 64 * 1024      # bytes per bulk instruction
BULK_PER_PROGRAM = 32       # instructions per program (one warp, one each)
LINES_PER_PROGRAM = 2048    # 128-byte lines per program (256 KiB)
LOAD_BLOCK = 1024           # int32 words a load step
LOAD_STEPS = 64             # steps a program (256 KiB)


@triton.jit
def _bulk_kernel(base, nbytes, CHUNK: tl.constexpr, PER: tl.constexpr):
    off = (tl.program_id(0) * PER + tl.arange(0, PER)).to(tl.int64) * CHUNK
    size = tl.maximum(tl.minimum(nbytes - off, CHUNK), 0) // 16 * 16   # multiples of 16 bytes
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [base + off, size.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _line_kernel(base, nbytes, LINES: tl.constexpr, LAST: tl.constexpr):
    off = (tl.program_id(0) * LINES + tl.arange(0, LINES)).to(tl.int64) * 128
    ok = (off < nbytes).to(tl.int32)
    if LAST:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [base + off, ok], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [base + off, ok], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _load_kernel(words, n, sink, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for s in range(STEPS):
        offs = (tl.program_id(0) * STEPS + s).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(words + offs, mask=offs < n, other=0, eviction_policy="evict_last")
    tl.store(sink + tl.program_id(0), tl.sum(acc, axis=0))


def prefetch_l2(t: torch.Tensor, nbytes: int | None = None, mode: str = "bulk") -> None:
    """Ask L2 for the first ``nbytes`` (default all) of contiguous CUDA ``t``'s storage, on the
    current stream."""
    if mode not in MODES:
        raise ValueError(f"prefetch_l2: mode must be one of {MODES}, got {mode!r}")
    if not t.is_contiguous():
        raise ValueError("prefetch_l2: the tensor must be contiguous")
    total = t.numel() * t.element_size()
    nbytes = total if nbytes is None else max(0, min(int(nbytes), total))
    if nbytes == 0:
        return
    raw = t.view(-1).view(torch.uint8)
    if mode == "bulk":
        _bulk_kernel[(triton.cdiv(nbytes, BULK_CHUNK * BULK_PER_PROGRAM),)](
            raw, nbytes, CHUNK=BULK_CHUNK, PER=BULK_PER_PROGRAM, num_warps=1)
    elif mode in ("line", "line_last"):
        _line_kernel[(triton.cdiv(nbytes, 128 * LINES_PER_PROGRAM),)](
            raw, nbytes, LINES=LINES_PER_PROGRAM, LAST=mode == "line_last", num_warps=4)
    else:
        words = raw[: nbytes // 4 * 4].view(torch.int32)
        grid = triton.cdiv(words.numel(), LOAD_BLOCK * LOAD_STEPS)
        sink = torch.empty(max(grid, 1), dtype=torch.int32, device=t.device)
        if grid:
            _load_kernel[(grid,)](words, words.numel(), sink, BLOCK=LOAD_BLOCK, STEPS=LOAD_STEPS, num_warps=4)


REPS = 4
# (name, N, K per group, groups, mode)
SHAPES = (("wo_b", 4096, 8192, 1, "quant"), ("wq_b+indexer", 40960, 1024, 1, "quant"),
          ("shared w1+w3", 4096, 4096, 1, "quant"), ("wo_a W8A16", 8192, 4096, 8, "bf16"))
CHAINS = (0, 8, 16, 32)
FRACS = (0.5, 1.0)


@triton.jit
def _tick_kernel(x_ptr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(x_ptr + o, tl.load(x_ptr + o) * 0.5 + 1.0)


def timed(body) -> float:
    """us per repetition of ``body`` from a graph of REPS of them (probe_gemv_bf16.graph_us)."""
    return graph_us([body] * REPS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    modes = args.modes.split(",")
    bw = measure_ceilings().copy_gbps
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name(0)}: copy {bw:.0f} GB/s, L2 {l2 / 2**20:.0f} MiB", flush=True)
    flush_buf = torch.empty(4 * l2 // 4, dtype=torch.float32, device="cuda").normal_()
    flush_out = torch.empty((), dtype=torch.float32, device="cuda")
    tick = torch.ones(1024, device="cuda")
    side = torch.cuda.Stream()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def flush():
        torch.sum(flush_buf, dim=0, out=flush_out)

    def chain(n):
        for _ in range(n):
            _tick_kernel[(1,)](tick, BLOCK=1024, num_warps=4)

    rows = []
    for name, N, K, G, gmode in SHAPES:
        w = (torch.randn(N, K, device="cuda", generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
        s = torch.pow(2.0, torch.randint(-12, -4, (N // 128, K // 128), device="cuda", generator=gen).float())
        x = (torch.randn(1, K * G, device="cuda", generator=gen) * 2).bfloat16()
        wbytes = w.numel()
        ref = fp8_row_gemv(x, w, s, mode=gmode, groups=G)

        def gemv():
            return fp8_row_gemv(x, w, s, mode=gmode, groups=G)

        def case(n, mode=None, frac=1.0):
            def body():
                flush()
                main = torch.cuda.current_stream()
                if mode is not None:
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        prefetch_l2(w, int(frac * wbytes), mode)
                chain(n)
                y = gemv()
                if mode is not None:
                    main.wait_stream(side)
                return y
            return body

        t_flush = timed(flush)
        hot = timed(gemv)
        cold = timed(case(0)) - t_flush
        floor = (wbytes + s.numel() * 4) / bw / 1e3
        print(f"{name}: {wbytes / 2**20:.0f} MiB, floor {floor:.2f} us; GEMV after a flush {cold:.2f} us, "
              f"hot (in L2) {hot:.2f} us; flush {t_flush:.1f} us", flush=True)
        for n in CHAINS:
            t_chain = timed(lambda: (flush(), chain(n))) - t_flush
            base = timed(case(n)) - t_flush - t_chain
            line = [f"  chain {n:2d} ({t_chain:5.1f} us): GEMV after it {base:6.2f}"]
            row = dict(shape=name, chain=n, chain_us=t_chain, gemv_us=base, floor_us=floor, hot_us=hot, cases={})
            for mode in modes:
                for frac in FRACS:
                    y = case(n, mode, frac)()
                    torch.cuda.synchronize()
                    same = bool(torch.equal(y, ref))
                    t = timed(case(n, mode, frac)) - t_flush - t_chain
                    row["cases"][f"{mode}@{frac}"] = dict(gemv_us=t, same=same)
                    line.append(f"{mode}@{frac} {t:6.2f}{'' if same else ' DIFFERS'}")
            rows.append(row)
            print(" | ".join(line), flush=True)
        del w, s
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(dict(copy_gbps=bw, l2_bytes=l2, reps=REPS, rows=rows), indent=1))


if __name__ == "__main__":
    main()
