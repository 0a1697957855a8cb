"""Where one CSA layer's HiSparse decode swap-in spends its time (issue 21), on one GPU.

Builds a ``HiSparsePool`` of one layer alone (no model): ``--batch`` requests of ``--context``
tokens each in the pinned host pool, request buffers of ``--buffer`` rows, and times, per layer
and step, between CUDA events (median of ``--reps`` CUDA-graph replays, fresh selections each):

- ``swap_in``: the whole decode swap-in (lookup, eviction, copy) at a hit rate of 0 (every
  selected row new) and of ``--hit`` (that share of each request's rows kept from the previous
  step), each with every row-copy variant;
- ``lookup``: the same with the copy left out (the table work alone);
- ``copy``: the row-copy kernel alone over the step's rows (one row per program, and ``R`` rows
  per program with 16-byte loads), against a plain pinned host -> device ``copy_`` of the same
  bytes (contiguous: the link's rate);
- an eager profile of one swap-in: its kernels and their device times.

    python bench/probe_hisparse.py --batch 10 --context 1048576          # one H200
    python bench/probe_hisparse.py --device cpu --batch 2 --context 8192 --top-k 64 --reps 2   # code path only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench._bench_common import graphed  # noqa: E402
from memory.hisparse import HiSparseConfig, HiSparsePool, copy_rows_torch  # noqa: E402
from memory.layout import KV_ROW_BYTES  # noqa: E402

PAGE_BYTES = 64 * KV_ROW_BYTES


def selections(g: torch.Generator, batch: int, k: int, host_rows: int, prev: torch.Tensor | None,
               hit: float, device: torch.device) -> torch.Tensor:
    """``[batch, k]`` distinct rows per request; a share ``hit`` of them taken from ``prev``."""
    fresh = torch.stack([torch.randperm(host_rows, generator=g)[:k] for _ in range(batch)])
    if prev is not None and hit > 0:
        keep = int(round(hit * k))
        old = prev.cpu()[:, :keep]
        fresh = torch.stack([torch.cat([old[b], fresh[b][~torch.isin(fresh[b], old[b])][:k - keep]])
                             for b in range(batch)])
    return fresh.to(device)


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], None]) -> float:
        """ms of one call of ``fn``."""
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--context", type=int, default=1 << 20)
    ap.add_argument("--top-k", type=int, default=512, help="rows selected per query (Flash: index_topk 512)")
    ap.add_argument("--buffer", type=int, default=0, help="device_buffer_size (0: 2 x top-k)")
    ap.add_argument("--hit", type=float, default=0.9)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows-per-program", default="4,8,16")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device(args.device)
    k, T = args.top_k, args.batch
    B = args.buffer or 2 * k
    host_rows = T * args.context // 4
    cfg = HiSparseConfig(top_k=k, device_buffer_size=B, host_to_device_ratio=4)
    hs = HiSparsePool([0], host_rows, T * B + T * k, T, cfg, k, PAGE_BYTES, dev)
    if dev.type == "cuda":
        from dsv4_backend.kernels import copy_rows
        variants: dict[str, Any] = {"row kernel, 1 row / program": copy_rows}
        for r in [int(x) for x in args.rows_per_program.split(",") if x]:
            variants[f"row kernel, {r} rows / program"] = partial(copy_rows, rows_per_program=r)
        # the host pool's bytes: not zeros, so that a wrong copy would show
        hs.host[0].view(torch.int32)[: min(hs.host[0].numel() // 4, 1 << 26)].random_()
    else:
        variants = {"torch copy": copy_rows_torch}
    timer = Timer(dev)
    g = torch.Generator().manual_seed(0)
    owners = torch.arange(T, device=dev)
    sel_buf = torch.zeros(T, k, dtype=torch.int64, device=dev)
    res: dict[str, Any] = {"batch": T, "context": args.context, "top_k": k, "buffer": B,
                           "bytes_per_step_all_miss": T * k * KV_ROW_BYTES, "rows": {}}
    step_mb = T * k * KV_ROW_BYTES / 1e6
    print(f"one CSA layer, batch {T} x {args.context} tokens, top-k {k}, buffer {B}: {T * k} rows "
          f"= {step_mb:.2f} MB per step when every row is new")

    # the link: a contiguous pinned host -> device copy of one step's bytes
    if dev.type == "cuda":
        n = T * k * KV_ROW_BYTES
        src = torch.empty(n, dtype=torch.uint8).pin_memory()
        dst = torch.empty(n, dtype=torch.uint8, device=dev)
        ms = statistics.median(timer(lambda: dst.copy_(src, non_blocking=True)) for _ in range(args.reps))
        res["rows"]["pinned copy_, contiguous"] = {"ms": ms, "gb_per_s": n / ms / 1e6}
        print(f"  pinned host -> device copy_, {n / 1e6:.2f} MB contiguous: {ms * 1e3:8.1f} us  "
              f"{n / ms / 1e6:6.1f} GB/s")

    # the copy alone: the step's rows, random host rows -> consecutive device rows
    dst_rows = torch.arange(T * k, device=dev)
    for name, fn in variants.items():
        src_rows = selections(g, T, k, host_rows, None, 0, dev).reshape(-1)
        run = graphed(lambda: fn(hs.host[0], src_rows, hs.device_kv[0], dst_rows), dev)
        ms = statistics.median(timer(run) for _ in range(args.reps))
        want = hs.host[0].new_zeros(0)
        got_ok = True
        if dev.type == "cuda":
            from memory.layout import read_row_bytes
            pick = torch.arange(0, T * k, max(1, T * k // 64), device=dev)
            got_ok = torch.equal(read_row_bytes(hs.device_kv[0], dst_rows[pick]).cpu(),
                                 read_row_bytes(hs.host[0], src_rows[pick].cpu()))
        del want
        res["rows"][f"copy: {name}"] = {"ms": ms, "gb_per_s": step_mb / ms, "bytes_ok": got_ok}
        print(f"  copy only, {name:28s}: {ms * 1e3:8.1f} us  {step_mb / ms:6.1f} GB/s  bytes equal: {got_ok}")

    # the swap-in: lookup + eviction + copy, and the lookup alone
    def swap_row(label: str, copy: Any, hit: float, lookup: Any = None) -> None:
        hs.copy_rows, hs.lookup = copy, lookup
        for s in range(T):
            hs.release(s)
        prev = selections(g, T, k, host_rows, None, 0, dev)
        sel_buf.copy_(prev)
        run = graphed(lambda: hs.swap_in(0, sel_buf, owners), dev)
        times = []
        for _ in range(args.reps):
            prev = selections(g, T, k, host_rows, prev, hit, dev)
            sel_buf.copy_(prev)
            times.append(timer(run))
        ms = statistics.median(times)
        label = f"{'lookup kernel' if lookup else 'torch lookup'}, {label}"
        res["rows"][f"swap_in: {label}, hit {hit:g}"] = {"ms": ms}
        print(f"  swap_in, hit rate {hit:4.2f}, {label:44s}: {ms * 1e3:8.1f} us")

    lookups: list[Any] = [None]
    if dev.type == "cuda":
        from dsv4_backend.kernels import hisparse_lookup
        lookups.append(hisparse_lookup)
    for hit in (0.0, args.hit):
        for lookup in lookups:
            swap_row("no copy", lambda *a: None, hit, lookup)
            for name, fn in variants.items():
                swap_row(name, fn, hit, lookup)
            hs.copy_rows = next(iter(variants.values()))
            for s in range(T):
                hs.release(s)
            hs.swap_in(0, sel_buf, owners)
            hs.check_integrity()

    if dev.type == "cuda":
        from torch.profiler import ProfilerActivity, profile
        hs.copy_rows, hs.lookup = next(iter(variants.values())), None
        sel_buf.copy_(selections(g, T, k, host_rows, None, 0, dev))
        hs.swap_in(0, sel_buf, owners)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            hs.swap_in(0, sel_buf, owners)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
