"""Timing sweep of the Triton kernels on a GPU, against the roofline floor measured in the same run.

    python bench/bench_kernels.py [--quick] [--out DIR]

For each kernel and shape two medians: "graph" (``do_bench_cudagraph``: CUDA-graph replays back
to back, no host overhead, each call on the next of several input sets that together span at
least 4x the L2) and "cold" (``do_bench``: one call after an L2 flush, host launch cost
included where it exceeds the flush; FlashMLA's reference figures were taken this way).
Achieved GB/s, TFLOP/s and the floor = max(bytes / copy bandwidth, FLOPs / bf16 matrix rate)
use the graph time; both ceilings are measured at the start of the run. Counting (issue 6):

- sparse decode: bytes = q + rows x 584 + out (bf16 q and out), FLOPs = 2 h rows 1024 per
  request (QK^T and PV over 512 dims each);
- indexer: bytes = rows x 132 + q (the score buffer written for top-k is reported apart),
  FLOPs = 2 x 64 x 128 per row;
- compressor: bytes = the candidates' C and Z halves read (fp32) + the row written;
- KV store: bytes = bf16 rows in + 584-byte rows out + cos/sin.
- verify attention (``--verify``: s_q = k + 1 rows per request, the one-row kernel over every
  row vs ``sparse_verify``): floor bytes = q + out + the request's distinct rows (its union
  window of 127 + s_q, each row's top-k for C4 taken as disjoint, one visible list for C128)
  x 584; ``gathered`` (note column) = the rows every program dequantises x 584.

``gpu_check.py`` imports this module; run alone it prints the table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import triton  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from dsv4_backend.kernels.compressor import CompressEvents, compress  # noqa: E402
from dsv4_backend.kernels.indexer import IndexerConfig, indexer_scores, topk_rows  # noqa: E402
from dsv4_backend.kernels.kv_store import kv_store  # noqa: E402
from dsv4_backend.kernels.reference import hadamard_matrix  # noqa: E402
from dsv4_backend.kernels.sparse_attention import DecodeAttentionConfig, sparse_decode  # noqa: E402
from dsv4_backend.kernels.verify_attention import VerifyAttentionConfig, sparse_verify, verify_tiling  # noqa: E402

KV_ROW = 584
IDX_ROW = 132
L2_BYTES = 50 << 20
DEV = "cuda"

# FlashMLA MODEL1 on an H200 (DSV4.md section 9), microseconds: (case, batch) -> time
FLASHMLA_US = {("flash_csa", 32): 30.3, ("flash_csa", 128): 53.6, ("pro_csa", 32): 50.7,
               ("pro_csa", 128): 110.9, ("flash_hca", 32): 131.0, ("flash_hca", 128): 445.0}


@dataclass
class Ceilings:
    copy_gbps: float  # device-to-device copy, bytes read + written
    bf16_tflops: float  # 8192^3 bf16 matmul on random data


@dataclass
class Result:
    kernel: str
    case: str
    batch: int
    context: int
    us: float
    bytes: float
    flops: float
    gbps: float = 0.0
    tflops: float = 0.0
    floor_us: float = 0.0
    pct_floor: float = 0.0
    pct_copy_bw: float = 0.0
    extra: dict = field(default_factory=dict)


def measure_ceilings(device=None) -> Ceilings:
    device = device or DEV
    n = 1 << 30  # 1 GiB copied
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    copy = 2 * n / (t * 1e-3) / 1e9
    del src, dst
    m = 8192
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    t = do_bench(lambda: a @ b, warmup=25, rep=300, return_mode="median")
    return Ceilings(copy, 2 * m ** 3 / (t * 1e-3) / 1e12)


def finish(r: Result, c: Ceilings) -> Result:
    s = r.us * 1e-6
    r.gbps = r.bytes / s / 1e9
    r.tflops = r.flops / s / 1e12
    r.floor_us = max(r.bytes / (c.copy_gbps * 1e9), r.flops / (c.bf16_tflops * 1e12)) * 1e6
    r.pct_floor = 100 * r.floor_us / r.us
    r.pct_copy_bw = 100 * r.gbps / c.copy_gbps
    return r


def n_sets(bytes_per_call: float, most: int = 64) -> int:
    """Input sets to cycle through so that one cycle touches at least 4x the L2."""
    return int(max(2, min(most, math.ceil(4 * L2_BYTES / max(bytes_per_call, 1)))))


def bench(fn) -> tuple[float, float]:
    """(graph, cold) median microseconds of fn(): CUDA-graph replays back to back (no host
    overhead; fn rotates its inputs), and single calls after an L2 flush (do_bench)."""
    fn()
    torch.cuda.synchronize()
    graph = do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3
    cold = do_bench(fn, warmup=5, rep=30, return_mode="median") * 1e3
    return graph, cold


def cold_replay_us(fn, rep: int = 30) -> float:
    """Median microseconds of one call replayed from a CUDA graph after an L2 flush: the
    kernels' cold time without the Python launch cost that ``bench``'s cold figure includes.
    One eager call first, so that compilation happens outside the capture."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return do_bench(graph.replay, warmup=5, rep=rep, return_mode="median") * 1e3


def timed(r: "Result", times: tuple[float, float], ceil: "Ceilings") -> "Result":
    r.us, r.extra["cold_us"] = times
    return finish(r, ceil)


# ---- random pools with valid rows (fast, on the GPU) ----------------------------------------

def random_kv_pool(rows: int, page_rows: int, device=None) -> torch.Tensor:
    """uint8 [pages, P * 584] of valid MODEL1 rows, values like N(0, 1) after dequantisation."""
    device = device or DEV
    pages = triton.cdiv(rows, page_rows)
    pool = torch.empty(pages, page_rows * KV_ROW, dtype=torch.uint8, device=device)
    parts = pool[:, :page_rows * 576].view(pages, page_rows, 576)
    groups = pool[:, page_rows * 576:].view(pages, page_rows, 8)
    for p0 in range(0, pages, 4096):
        p1 = min(pages, p0 + 4096)
        nope = torch.randn(p1 - p0, page_rows, 448, device=device) * 64  # |x| / scale(2^-6)
        parts[p0:p1, :, :448] = nope.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        rope = torch.randn(p1 - p0, page_rows, 64, device=device).to(torch.bfloat16)
        parts[p0:p1, :, 448:] = rope.view(torch.uint8)
    groups[:, :, :7] = 127 - 6
    groups[:, :, 7] = 0
    return pool


def random_indexer_pool(rows: int, page_rows: int = 64, device=None) -> torch.Tensor:
    device = device or DEV
    pages = triton.cdiv(rows, page_rows)
    pool = torch.empty(pages, page_rows * IDX_ROW, dtype=torch.uint8, device=device)
    vals = pool[:, :page_rows * 128]
    for p0 in range(0, pages, 8192):
        p1 = min(pages, p0 + 8192)
        x = torch.randn(p1 - p0, page_rows * 128, device=device) * 64
        vals[p0:p1] = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.full((pages, page_rows), 2.0 ** -6, device=device)
    pool[:, page_rows * 128:] = scales.view(torch.uint8).view(pages, page_rows * 4)
    return pool


# ---- sparse decode -------------------------------------------------------------------------

DECODE_CASES = {  # name: (heads, extra rows as a function of context)
    "flash_csa": (64, lambda ctx: min(512, ctx // 4)),
    "pro_csa": (128, lambda ctx: min(1024, ctx // 4)),
    "flash_hca": (64, lambda ctx: ctx // 128),
    "pro_hca": (128, lambda ctx: ctx // 128),
}


def decode_inputs(case: str, batch: int, ctx: int, device=None, rotate=None, q_scale=1.0):
    """Pools of N(0, 1)-like rows and q ~ N(0, q_scale^2) per element: q_scale 1 is the model's
    scale (q and the rows are RMS-normalised per head / row), larger makes softmax peakier."""
    device = device or DEV
    h, extra_fn = DECODE_CASES[case]
    k = extra_fn(ctx)
    rotate = rotate or n_sets(batch * (128 + k) * KV_ROW)
    extra_rows_total = min(max(batch * (ctx // (4 if "csa" in case else 128)), 4 * k), 1 << 22)
    swa_rows = max(batch * 128 * 2, 4096)
    swa = random_kv_pool(swa_rows, 128, device)
    extra = random_kv_pool(extra_rows_total, 64, device)
    q = (torch.randn(batch, h, 512, device=device) * q_scale).to(torch.bfloat16)
    sink = torch.randn(h, device=device)
    sets = []
    for _ in range(rotate):
        win = torch.randint(0, swa.shape[0] * 128, (batch, 128), device=device, dtype=torch.int32)
        ext = torch.randint(0, extra.shape[0] * 64, (batch, k), device=device, dtype=torch.int32)
        sets.append((win, ext))
    return dict(q=q, swa=swa, extra=extra, sink=sink, sets=sets, h=h, k=k)


def time_decode(case, batch, ctx, ceil: Ceilings, config=DecodeAttentionConfig(), inputs=None) -> Result:
    x = inputs or decode_inputs(case, batch, ctx)
    it = [0]

    def run():
        win, ext = x["sets"][it[0] % len(x["sets"])]
        it[0] += 1
        sparse_decode(x["q"], x["swa"], win, x["extra"], ext, x["sink"], 512 ** -0.5, config=config)

    times = bench(run)
    h, rows = x["h"], 128 + x["k"]
    nbytes = batch * (h * 512 * 2 * 2 + rows * KV_ROW)
    flops = batch * 2 * h * rows * 1024
    r = timed(Result("sparse_decode", case, batch, ctx, 0.0, nbytes, flops), times, ceil)
    r.extra["cold_replay_us"] = cold_replay_us(run)
    ref = FLASHMLA_US.get((case, batch))
    if ref is not None and ctx == (1 << 20 if "hca" in case else ctx):
        r.extra["flashmla_us"] = ref  # cold L2, one call
        r.extra["x_flashmla"] = r.extra["cold_replay_us"] / ref  # kernels only
        r.extra["x_flashmla_eager"] = r.extra["cold_us"] / ref  # with our Python launch
    r.extra["config"] = list(config)
    return r


# ---- verify steps: s_q rows per request ----------------------------------------------------

VERIFY_CASES = {"flash_swa": 0, "flash_csa": 4, "flash_hca": 128}   # name: ratio (64 heads)


def verify_inputs(case: str, batch: int, ctx: int, s_q: int, device=None):
    """A verify step's tables: each request's s_q rows at positions ctx - s_q .. ctx - 1 with
    windows from its own page table of 128-row SWA pages (shifted by one row to row), C4: a
    top-k list of min(512, ctx / 4) random rows per row, C128: one list of ctx / 128 rows per
    request (every row sees them all), rotated over enough sets to span 4x the L2."""
    device = device or DEV
    ratio, h, W = VERIFY_CASES[case], 64, 128
    k = 0 if ratio == 0 else (min(512, ctx // 4) if ratio == 4 else ctx // 128)
    T = batch * s_q
    pages = triton.cdiv(ctx, 128) + 1
    swa = random_kv_pool(batch * pages * 128, 128, device)
    extra = random_kv_pool(max(batch * ctx // max(ratio, 1), 4 * k, 64), 64, device) if k else None
    q = torch.randn(T, h, 512, device=device).to(torch.bfloat16)
    sink = torch.randn(h, device=device)
    per_set = batch * (W + s_q + (s_q if ratio == 4 else 1) * k) * KV_ROW
    sets = []
    pos = (ctx - s_q + torch.arange(s_q, device=device))[:, None] - W + 1 + torch.arange(W, device=device)
    for _ in range(n_sets(per_set)):
        table = torch.randperm(batch * pages, device=device).view(batch, pages)
        p = pos.clamp_min(0)[None].expand(batch, s_q, W)
        slot = table.gather(1, (p // 128).reshape(batch, -1)).view(batch, s_q, W) * 128 + p % 128
        win = torch.where(pos[None] >= 0, slot, -1).reshape(T, W).to(torch.int32)
        ext = None
        if ratio == 4:
            ext = torch.randint(0, extra.shape[0] * 64, (T, k), device=device, dtype=torch.int32)
        elif ratio == 128:
            ext = torch.randint(0, extra.shape[0] * 64, (batch, 1, k), device=device, dtype=torch.int32)
            ext = ext.expand(batch, s_q, k).reshape(T, k).contiguous()
        sets.append((win, ext))
    return dict(q=q, swa=swa, extra=extra, sink=sink, sets=sets, h=h, k=k, ratio=ratio, s_q=s_q, W=W)


def time_verify(case: str, batch: int, ctx: int, s_q: int, ceil: Ceilings, kernel: str = "verify",
                config: VerifyAttentionConfig = VerifyAttentionConfig(), inputs=None) -> Result:
    """One verify step's attention in one layer: ``kernel`` "row" (sparse_decode over the
    batch x s_q rows, today's path) or "verify" (sparse_verify, ``config.rows`` rows per program)."""
    x = inputs or verify_inputs(case, batch, ctx, s_q)
    h, k, W, ratio = x["h"], x["k"], x["W"], x["ratio"]
    it = [0]

    def run():
        win, ext = x["sets"][it[0] % len(x["sets"])]
        it[0] += 1
        if kernel == "row":
            sparse_decode(x["q"], x["swa"], win, x["extra"], ext, x["sink"], 512 ** -0.5)
        else:
            sparse_verify(x["q"], x["swa"], win, x["extra"], ext, x["sink"], 512 ** -0.5, s_q,
                          shared_extra=ratio == 128, config=config)

    times = bench(run)
    T = batch * s_q
    distinct = W + s_q - 1 + (s_q * k if ratio == 4 else k)          # per request
    nbytes = T * h * 512 * 2 * 2 + batch * distinct * KV_ROW
    flops = T * 2 * h * (W + k) * 1024
    if kernel == "row":
        gathered = T * triton.cdiv(h, 64) * (W + k)
        name = "verify_row_kernel"
    else:
        rows, block_h = verify_tiling(h, s_q, config)
        groups = triton.cdiv(s_q, rows)
        gathered = batch * groups * triton.cdiv(h, block_h) * (W + rows - 1 + (rows * k if ratio == 4 else k))
        name = f"verify_sq_rows{rows}"
    r = timed(Result(name, case, batch, ctx, 0.0, nbytes, flops), times, ceil)
    r.extra["cold_replay_us"] = cold_replay_us(run)
    r.extra.update(s_q=s_q, gathered_bytes=gathered * KV_ROW, config=list(config) if kernel != "row" else None)
    return r


def verify_sweep(ceil: Ceilings, log=print, k: int = 3) -> list[Result]:
    """Per-row vs s_q kernel at batch 1 and 32, s_q = k + 1, Flash dims (64 heads, top-k 512):
    the default tiling (one row per program at 64 heads) and four rows per program (16 heads)."""
    results = []
    for case, ctx in (("flash_swa", 1 << 12), ("flash_csa", 1 << 12), ("flash_hca", 1 << 12),
                      ("flash_csa", 1 << 17), ("flash_hca", 1 << 17)):
        for b in (1, 32):
            x = verify_inputs(case, b, ctx, k + 1)
            for kernel, cfg in (("row", VerifyAttentionConfig()), ("verify", VerifyAttentionConfig()),
                                ("verify", VerifyAttentionConfig(rows=4))):
                try:
                    r = time_verify(case, b, ctx, k + 1, ceil, kernel, cfg, inputs=x)
                    results.append(r)
                    log(row(r))
                except Exception as e:
                    log(f"  time_verify({case}, {b}, {ctx}, {kernel}, {cfg.rows}) failed: {type(e).__name__}: {str(e)[:300]}")
            del x
            torch.cuda.empty_cache()
    return results


# ---- indexer -------------------------------------------------------------------------------

def indexer_inputs(batch, ctx, device=None):
    device = device or DEV
    L = ctx // 4
    pages_per_req = triton.cdiv(L, 64)
    sets = n_sets(batch * L * IDX_ROW, most=16)
    pool = random_indexer_pool(sets * batch * pages_per_req * 64, 64, device)
    perm = torch.randperm(sets * batch * pages_per_req, device=device, dtype=torch.int64)
    tables = list(perm.to(torch.int32).view(sets, batch, pages_per_req).unbind(0))
    q = (torch.randn(batch, 64, 128, device=device) * 64).clamp(-448, 448)
    q = q.to(torch.float8_e4m3fn).to(torch.float32) * 2.0 ** -6
    w = torch.randn(batch, 64, device=device)
    nvis = torch.full((batch,), L, device=device, dtype=torch.int32)
    return dict(pool=pool, tables=tables, table=tables[0], q=q.to(torch.bfloat16), w=w, nvis=nvis, L=L)


def time_indexer(batch, ctx, ceil: Ceilings, q_fp8=False, topk=None, inputs=None,
                 config=IndexerConfig()) -> list[Result]:
    x = inputs or indexer_inputs(batch, ctx)
    it = [0]

    def scores():
        table = x["tables"][it[0] % len(x["tables"])]
        it[0] += 1
        return indexer_scores(x["q"], x["w"], x["pool"], page_table=table,
                              num_visible=x["nvis"], q_fp8=q_fp8, config=config)

    L = x["L"]
    times = bench(scores)
    nbytes = batch * (L * IDX_ROW + 64 * 128 * 2)
    flops = batch * L * 2 * 64 * 128
    name = "indexer_scores_fp8" if q_fp8 else "indexer_scores"
    out = [timed(Result(name, "h64", batch, ctx, 0.0, nbytes, flops,
                        extra={"score_buffer_bytes": batch * L * 4, "config": list(config)}), times, ceil)]
    if topk:
        s = scores()
        t_k = bench(lambda: topk_rows(s, topk, page_table=x["table"]))
        out.append(timed(Result(f"topk{topk}", "torch.topk", batch, ctx, 0.0, batch * L * 4, 0), t_k, ceil))
    return out


def prefill_indexer_inputs(rows, ctx, device=None):
    """One request's ``rows`` query rows (a prefill slice) over a ``ctx``-token context: its
    C4 list of ctx / 4 rows in shuffled pages, causal visible counts ending at the last row."""
    device = device or DEV
    L = ctx // 4
    pages = triton.cdiv(L, 64)
    pool = random_indexer_pool(pages * 64, 64, device)
    table = torch.randperm(pages, device=device, dtype=torch.int64).to(torch.int32)[None].expand(rows, pages)
    q = (torch.randn(rows, 64, 128, device=device) * 64).clamp(-448, 448)
    q = (q.to(torch.float8_e4m3fn).to(torch.float32) * 2.0 ** -6).to(torch.bfloat16)
    w = torch.randn(rows, 64, device=device)
    nvis = (L - rows + 1 + torch.arange(rows, device=device)).clamp_min(0).to(torch.int32)
    return dict(pool=pool, table=table.contiguous(), q=q, w=w, nvis=nvis, L=L)


def time_prefill_indexer(rows, ctx, ceil: Ceilings, q_fp8=False, config=IndexerConfig()) -> Result:
    """The indexer on ``rows`` query rows of one request (one INDEXER_SCORE_BUDGET slice of a
    prefill chunk): the rows read the same pages, so beyond one row the pages come from L2 and
    the kernel is bound by the tensor cores (FLOPs = rows x L x 2 x 64 x 128)."""
    x = prefill_indexer_inputs(rows, ctx)
    L = x["L"]
    t = bench(lambda: indexer_scores(x["q"], x["w"], x["pool"], page_table=x["table"], num_visible=x["nvis"],
                                     q_fp8=q_fp8, config=config))
    name = "indexer_prefill" + ("_fp8" if q_fp8 else "")
    return timed(Result(name, f"{rows} rows", 1, ctx, 0.0, rows * L * IDX_ROW, rows * L * 2 * 64 * 128), t, ceil)


def pick_indexer_config(ceil: Ceilings, q_fp8: bool, log=print) -> tuple[IndexerConfig, list[Result]]:
    """Time a few launch configurations at batch 32, 1M context; keep the fastest."""
    x = indexer_inputs(32, 1 << 20)
    tried = []
    C = IndexerConfig
    for cfg in (C(64, 4, 2, None, True, 1), C(64, 4, 3, None, True, 1), C(64, 4, 2, None, True, 4),
                C(64, 4, 3, None, True, 4), C(64, 4, 2, 1024, True, 4), C(64, 4, 2, None, False, 1)):
        try:
            r = time_indexer(32, 1 << 20, ceil, q_fp8, inputs=x, config=cfg)[0]
            tried.append(r)
            log(f"  indexer{' fp8' if q_fp8 else ''} config {tuple(cfg)}: {r.us:.1f} us")
        except Exception as e:
            log(f"  indexer config {tuple(cfg)}: failed: {type(e).__name__}: {str(e)[:200]}")
    best = min(tried, key=lambda r: r.us)
    return IndexerConfig(*best.extra["config"]), tried


# ---- compressor and KV store ---------------------------------------------------------------

from typing import NamedTuple  # noqa: E402

from dsv4_backend.kernels.compressor import CompressConfig, FusedCompressConfig  # noqa: E402
from dsv4_backend.kernels.kv_store import FinishConfig  # noqa: E402


class CompressorConfigs(NamedTuple):
    """Launch shapes for the compressor / KV-store timings (the picks of one GPU run)."""
    fused: FusedCompressConfig = FusedCompressConfig()  # C4 attention rows
    fused_indexer: FusedCompressConfig = FusedCompressConfig()  # C4 indexer rows
    pool: CompressConfig = CompressConfig()  # C128 pooling kernel
    finish: FinishConfig = FinishConfig()  # KV store and the C128 finish


def time_compress(ratio, indexer, batch, ceil: Ceilings, device=None, config=None,
                  fused_config=None, finish_config=None, fuse=None) -> Result:
    """One compress() call per event set; ``fuse`` None: compress()'s choice (fused for C4)."""
    device = device or DEV
    d = 128 if indexer else 512
    coff = 2 if ratio == 4 else 1
    k = coff * ratio
    rot = n_sets(batch * k * 2 * d * 4)
    slots = max(batch * k * rot, 4096)
    state = torch.randn(slots, 2 * coff * d, device=device)
    ape = torch.randn(ratio, coff * d, device=device)
    w = torch.rand(d, device=device) + 0.5
    cos, sin = torch.rand(batch, 32, device=device), torch.rand(batch, 32, device=device)
    row_bytes = IDX_ROW if indexer else KV_ROW
    pool = torch.zeros(triton.cdiv(batch * rot, 64) + 1, 64 * row_bytes, dtype=torch.uint8, device=device)
    had = hadamard_matrix(128, device=device) if indexer else None
    sets = [CompressEvents(torch.arange(batch, device=device) + i * batch,
                           torch.randperm(slots, device=device)[:batch * k].view(batch, k),
                           cos, sin) for i in range(rot)]
    fused = ratio == 4 if fuse is None else fuse
    it = [0]

    def run():
        ev = sets[it[0] % rot]
        it[0] += 1
        compress(pool, ev, state, ape, w, ratio, hadamard=had, config=config, fused_config=fused_config,
                 finish_config=finish_config, fuse=fuse)

    times = bench(run)
    nbytes = batch * (k * 2 * d * 4 + row_bytes + 32 * 8) + ape.numel() * 4
    name = f"compress_c{ratio}" + ("_indexer" if indexer else "")
    if fused:
        cfg = list(fused_config or FusedCompressConfig())
    else:
        cfg = list(config or CompressConfig()) + list(finish_config or FinishConfig())
    case = f"d={d}" + ("" if fused or ratio != 4 else ",2k")  # 2k: pool + finish launches
    return timed(Result(name, case, batch, 0, 0.0, nbytes, 0.0, extra={"config": cfg}), times, ceil)


def time_kv_store(n_tokens, ceil: Ceilings, device=None, config=None) -> Result:
    device = device or DEV
    rot = n_sets(n_tokens * (1024 + KV_ROW), most=16)
    pool = torch.zeros(triton.cdiv(n_tokens * rot, 128), 128 * KV_ROW, dtype=torch.uint8, device=device)
    kv = torch.randn(rot, n_tokens, 512, device=device).to(torch.bfloat16)
    w = torch.rand(512, device=device) + 0.5
    cos, sin = torch.rand(n_tokens, 32, device=device), torch.rand(n_tokens, 32, device=device)
    slots = [torch.randperm(n_tokens * rot, device=device)[:n_tokens] for _ in range(rot)]
    it = [0]

    def run():
        i = it[0] % rot
        it[0] += 1
        kv_store(pool, slots[i], kv[i], w, cos, sin, config=config)

    times = bench(run)
    nbytes = n_tokens * (512 * 2 + KV_ROW + 32 * 8 + 8)
    return timed(Result("kv_store", "bf16 in", n_tokens, 0, 0.0, nbytes, 0.0,
                        extra={"config": list(config or FinishConfig())}), times, ceil)


def _fastest(configs, time_one, label, log):
    """Time each config (skipping ones that fail to compile); (fastest config, results)."""
    tried = []
    for cfg in configs:
        try:
            r = time_one(cfg)
            r.extra["pick"] = label
            tried.append((cfg, r))
            log(f"  {label} config {tuple(cfg)}: {r.us:.1f} us ({r.pct_copy_bw:.0f}% of copy)")
        except Exception as e:  # e.g. out of registers / shared memory
            log(f"  {label} config {tuple(cfg)}: failed: {type(e).__name__}: {str(e)[:200]}")
        torch.cuda.empty_cache()
    if not tried:
        return configs[0], []
    best = min(tried, key=lambda t: t[1].us)
    return best[0], [r for _, r in tried]


def pick_fused_config(ceil: Ceilings, indexer: bool, log=print):
    """Fused C4 kernel at 2048 events (one 8192-token prefill chunk)."""
    F = FusedCompressConfig
    configs = (F(1, 8), F(4, 8), F(8, 8), F(2, 4)) if indexer else (F(1, 4), F(1, 8), F(2, 8), F(2, 4))
    return _fastest(configs,
                    lambda c: time_compress(4, indexer, 2048, ceil, fused_config=c),
                    "fused c4" + (" indexer" if indexer else ""), log)


def pick_compress_config(ceil: Ceilings, log=print):
    """C128 pooling kernel at 512 events (one 64K-token prefill chunk), default finish."""
    C = CompressConfig
    return _fastest((C(128, 16, 4, 0), C(128, 16, 4, 1), C(128, 16, 4, 3), C(128, 16, 8, 3),
                     C(64, 16, 2, 3), C(128, 8, 4, 4)),
                    lambda c: time_compress(128, False, 512, ceil, config=c), "c128 pool", log)


def pick_finish_config(ceil: Ceilings, log=print):
    """Finish / store kernel at 65536 rows (KV store of a 64K-token prefill)."""
    F = FinishConfig
    return _fastest((F(4, 4), F(2, 2), F(8, 4), F(16, 8)),
                    lambda c: time_kv_store(65536, ceil, config=c), "finish", log)


def pick_compressor_configs(ceil: Ceilings, results: list, log=print) -> CompressorConfigs:
    """All four picks (about 23 timings, mostly compile time); their timings go to results."""
    picks = []
    for pick in (lambda: pick_fused_config(ceil, False, log), lambda: pick_fused_config(ceil, True, log),
                 lambda: pick_compress_config(ceil, log), lambda: pick_finish_config(ceil, log)):
        cfg, tried = pick()
        results.extend(tried)
        picks.append(cfg)
    cfgs = CompressorConfigs(*picks)
    log(f"compressor / KV-store configs: {cfgs}")
    return cfgs


# ---- the sweep -----------------------------------------------------------------------------

_C = DecodeAttentionConfig
DECODE_CONFIGS = (  # (block_h, block_n, num_warps, num_stages, scales, halves)
    _C(64, 64, 8, 1, "word", True), _C(64, 64, 8, 2, "word", False), _C(64, 64, 8, 1, "word", False),
    _C(64, 128, 8, 1, "word", True), _C(64, 32, 8, 1, "word", True), _C(64, 64, 8, 1, "element", False))


def pick_decode_config(ceil: Ceilings, log=print) -> tuple[DecodeAttentionConfig, list[Result]]:
    """Time a few launch configurations on Flash CSA at batch 128; keep the fastest."""
    x = decode_inputs("flash_csa", 128, 1 << 17)
    tried = []
    for cfg in DECODE_CONFIGS:
        try:
            r = time_decode("flash_csa", 128, 1 << 17, ceil, cfg, inputs=x)
            tried.append(r)
            log(f"  config {tuple(cfg)}: {r.us:.1f} us")
        except Exception as e:  # a config that fails to compile (e.g. out of resources)
            log(f"  config {tuple(cfg)}: failed: {type(e).__name__}: {str(e)[:200]}")
    best = min(tried, key=lambda r: r.us)
    return DecodeAttentionConfig(*best.extra["config"]), tried


def indexer_sweep(ceil: Ceilings, log=print) -> list[Result]:
    """The indexer alone: both configuration picks, then batch 8 and 32 at 128K and 1M."""
    results = []
    picks = {}
    for fp8 in (False, True):
        picks[fp8], tried = pick_indexer_config(ceil, fp8, log)
        results.extend(tried)
    for ctx in (1 << 17, 1 << 20):
        for b in (8, 32):
            for fp8 in (False, True):
                rs = time_indexer(b, ctx, ceil, fp8, config=picks[fp8])
                results.extend(rs)
                for r in rs:
                    log(row(r))
    return results


def sweep(ceil: Ceilings, quick=False, log=print, deadline=None) -> list[Result]:
    results: list[Result] = []

    def guard(fn, *a, **kw):
        if deadline is not None and time.time() > deadline:
            return
        try:
            r = fn(*a, **kw)
            rs = r if isinstance(r, list) else [r]
            results.extend(rs)
            for x in rs:
                log(row(x))
        except Exception as e:
            log(f"  {fn.__name__}{a[:3]} failed: {type(e).__name__}: {str(e)[:300]}")
        torch.cuda.empty_cache()

    cfg, tried = pick_decode_config(ceil, log)
    results.extend(tried)
    log(f"decode config: {tuple(cfg)}")
    icfg, tried = pick_indexer_config(ceil, False, log)
    results.extend(tried)
    icfg8, tried = pick_indexer_config(ceil, True, log)
    results.extend(tried)
    log(f"indexer configs: bf16 {tuple(icfg)}, fp8 {tuple(icfg8)}")
    torch.cuda.empty_cache()
    batches = [1, 32, 128] if quick else [1, 8, 32, 128]
    for case in DECODE_CASES:
        ctxs = [1 << 20] if quick else ([1 << 13, 1 << 17, 1 << 20] if "hca" in case else [1 << 17])
        for ctx in ctxs:
            for b in batches:
                guard(time_decode, case, b, ctx, ceil, cfg)
    for ctx in ([1 << 17, 1 << 20] if quick else [1 << 13, 1 << 17, 1 << 20]):
        for b in ([1, 8, 32] if quick else [1, 8, 32, 128]):
            guard(time_indexer, b, ctx, ceil, False, 512 if b <= 32 else None, config=icfg)
            guard(time_indexer, b, ctx, ceil, True, config=icfg8)
    for ctx, rows in ((1 << 17, 2048), (1 << 20, 256)):  # one INDEXER_SCORE_BUDGET slice of rows
        guard(time_prefill_indexer, rows, ctx, ceil, False, config=icfg)
        guard(time_prefill_indexer, rows, ctx, ceil, True, config=icfg8)
    cc = pick_compressor_configs(ceil, results, log)
    for b in ([1, 128, 2048] if quick else [1, 8, 32, 128, 2048]):  # 2048 events: an 8192-token chunk
        guard(time_compress, 4, False, b, ceil, fused_config=cc.fused)
        guard(time_compress, 4, True, b, ceil, fused_config=cc.fused_indexer)
    for b in (128, 2048):  # the two-kernel C4 path, for comparison with the fused one
        guard(time_compress, 4, False, b, ceil, finish_config=cc.finish, fuse=False)
    for b in ([1, 128, 512] if quick else [1, 8, 32, 64, 128, 512]):
        guard(time_compress, 128, False, b, ceil, config=cc.pool, finish_config=cc.finish)
    for n in ([128, 8192, 65536] if quick else [1, 128, 8192, 65536]):
        guard(time_kv_store, n, ceil, config=cc.finish)
    return results


HEADER = (f"{'kernel':<20} {'case':<10} {'batch':>6} {'ctx':>6} {'graph us':>9} {'cold us':>9} "
          f"{'GB/s':>6} {'TFLOP/s':>7} {'floor us':>8} {'%floor':>7} {'%copy':>6}  note")


def row(r: Result) -> str:
    note = ""
    if "cold_replay_us" in r.extra:
        note = f"replay {r.extra['cold_replay_us']:.1f} "
    if "x_flashmla" in r.extra:
        note += (f"{r.extra['x_flashmla']:.2f}x FlashMLA ({r.extra['flashmla_us']} us; eager "
                 f"{r.extra['x_flashmla_eager']:.2f}x)")
    if "gathered_bytes" in r.extra:
        note += f"gathered {r.extra['gathered_bytes'] / 1e6:.2f} MB "
    if r.extra.get("config"):
        note += f" cfg={tuple(r.extra['config'])}"
    ctx = f"{r.context // 1024}K" if r.context else "-"
    return (f"{r.kernel:<20} {r.case:<10} {r.batch:>6} {ctx:>6} {r.us:>9.1f} "
            f"{r.extra.get('cold_us', float('nan')):>9.1f} {r.gbps:>6.0f} {r.tflops:>7.1f} "
            f"{r.floor_us:>8.1f} {r.pct_floor:>6.1f}% {r.pct_copy_bw:>5.1f}%  {note}")


def table(results: list[Result]) -> str:
    return "\n".join([HEADER] + [row(r) for r in results])


def write_outputs(out_dir: Path, ceil: Ceilings, results: list[Result], extra: dict | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "ceilings": asdict(ceil), "results": [asdict(r) for r in results]}
    if extra:
        payload.update(extra)
    (out_dir / "bench_kernels.json").write_text(json.dumps(payload, indent=1))
    (out_dir / "bench_kernels.txt").write_text(
        f"{payload['gpu']}  {payload['date']}  copy {ceil.copy_gbps:.0f} GB/s  "
        f"bf16 {ceil.bf16_tflops:.0f} TFLOP/s\n" + table(results) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--indexer-only", action="store_true", help="the indexer's configuration picks and shapes")
    ap.add_argument("--verify", action="store_true",
                    help="only verify-step attention: one-row kernel vs s_q-row kernel, batch 1 and 32, k = 3")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    ceil = measure_ceilings()
    print(f"copy {ceil.copy_gbps:.0f} GB/s, bf16 matmul {ceil.bf16_tflops:.0f} TFLOP/s", flush=True)
    if args.verify:
        results = verify_sweep(ceil)
    else:
        results = indexer_sweep(ceil) if args.indexer_only else sweep(ceil, quick=args.quick)
    write_outputs(Path(args.out), ceil, results)
    print(table(results))


if __name__ == "__main__":
    main()
