"""FlashMLA against our Triton sparse decode and an fp64 reference, on one GPU (sm90 / sm100).

    PYTHONPATH=/tmp/site:. python3 bench/gpu_flashmla_check.py [--quick] [--out DIR]

1. install: flash_mla's version, legacy kernels, the device and its compute capability;
2. layout and agreement: random pools whose rows carry random per-tile scale exponents (so a
   misplaced scale group or a wrong page stride changes the result by factors of 2), read by
   ``flash_mla_with_kvcache`` through :func:`flashmla_cache`, by ``sparse_decode`` and by the
   fp64 reference; per shape the engine uses (Flash h64 CSA top-k 512 + window, Pro h128 top-k
   1024, HCA over many rows, SWA-only, the tiny preset's h8 / top-k 16, holes and -1 entries,
   an empty request, pools with and without the 576-byte page alignment) it prints the max
   errors of out and lse against the bound below, and on a mismatch the first bad element and
   which byte-layout hypothesis FlashMLA's output matches;
3. timing: both kernels replayed from a CUDA graph after an L2 flush (median), FlashMLA with
   its scheduling metadata already computed ("kernel") and computed in the graph ("+ sched"),
   and the ratio; prefill chunks (consecutive query rows sharing their windows) through
   ``flash_mla_sparse_fwd`` on a bf16 workspace (checked against the reference, then timed
   eagerly after an L2 flush, workspace build included) against the decode kernels' b = T rows;
4. the engine: greedy tokens with ``attention_kernel="flashmla"`` and ``"triton"`` (CUDA graphs
   on, and FlashMLA eager), tiny preset prompts and synthetic long contexts.

Bound (elementwise, derived from the arithmetic): both kernels read the same exact values (q is
bf16, a dequantised key is e4m3 x 2^k or bf16, exact in bf16), accumulate in fp32, round P to
bf16 before P.V (2^-8 per term, either rounding mode) and the output to bf16 (one ulp, 2^-7), so
``|out - ref| <= 2^-7 |ref| + 2^-8 sum_n p_n |v_n| + 2^-20``; the scores are 512-term fp32 sums
(Hopper's tensor cores keep >= 2^-14 of each partial sum), so
``|lse - ref| <= 2^-13 max_n scale sum_d |q_d k_nd| + 2^-20 (1 + |lse|)``. FlashMLA vs Triton is
held to the sum of both bounds. ``--quick`` finishes in < 4 minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dsv4_backend.flashmla_backend import (  # noqa: E402
    FLASHMLA_PAGE_ALIGN, flashmla_cache, flashmla_prefill_attention, flashmla_sparse_attention,
    flashmla_unavailable, list_lengths, pad_indices,
)
from memory.layout import KV_ROW_BYTES  # noqa: E402

DEV = "cuda"
SCALE = 512 ** -0.5
CHECKS: list[dict] = []
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def record(name: str, ok: bool, **info) -> None:
    CHECKS.append({"check": name, "ok": bool(ok), **info})
    log(f"[{'PASS' if ok else 'FAIL'}] {name} " + " ".join(f"{k}={v}" for k, v in info.items()))


def guarded(name: str, fn, *a, **kw):
    try:
        return fn(name, *a, **kw)
    except Exception as e:  # noqa: BLE001 (recorded, the run goes on)
        record(name, False, error=f"{type(e).__name__}: {e}"[:2000], tb=traceback.format_exc()[-2500:])
    finally:
        torch.cuda.empty_cache()


def describe(t) -> str:
    if t is None:
        return "None"
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} strides {tuple(t.stride())}"


# ---- random pools (valid rows, random scales) ---------------------------------------------

def random_pool(rows: int, P: int, align: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [pages, ceil(P * 584 / align) * align] of valid rows with random nope codes, random
    per-tile exponents in 2^-9 .. 2^-3 (so dequantised values ~N(0, 1) times 2^-3 .. 2^3) and
    bf16 rope ~N(0, 1); the page tail past P * 584 is filled with 0xFF (e4m3 NaN) so that a
    reader that strays into it poisons its output."""
    pages = -(-rows // P) + 1
    width = -(-(P * KV_ROW_BYTES) // align) * align
    pool = torch.full((pages, width), 255, dtype=torch.uint8, device=DEV)
    parts = pool[:, :P * 576].view(pages, P, 576)
    groups = pool[:, P * 576:P * KV_ROW_BYTES].view(pages, P, 8)
    step = max(1, (1 << 22) // (P * 448))
    for p0 in range(0, pages, step):
        p1 = min(pages, p0 + step)
        nope = torch.randn(p1 - p0, P, 448, device=DEV, generator=gen) * 64
        parts[p0:p1, :, :448] = nope.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        rope = torch.randn(p1 - p0, P, 64, device=DEV, generator=gen).to(torch.bfloat16)
        parts[p0:p1, :, 448:] = rope.view(torch.uint8)
    groups[:, :, :7] = torch.randint(127 - 9, 127 - 2, (pages, P, 7), device=DEV, generator=gen,
                                     dtype=torch.int32).to(torch.uint8)
    groups[:, :, 7] = 0
    return pool


def capacity(pool: torch.Tensor) -> int:
    """Usable rows (the last page is left out, like the pools' dummy page)."""
    return (pool.shape[0] - 1) * (pool.shape[1] // KV_ROW_BYTES)


# ---- the reference and byte-layout hypotheses ---------------------------------------------

def read_rows(pool: torch.Tensor, slots: torch.Tensor, layout: str) -> torch.Tensor:
    """float64 [..., 512] of the rows at ``slots`` (-1: zeros) read under a layout hypothesis:
    ``ours`` (P parts of 576 B, then P scale groups of 8 B, page stride = stride(0)),
    ``interleaved`` (584 B per row: part then its scales), ``unpadded`` (ours with the page
    stride P * 584, ignoring the alignment tail)."""
    P = pool.shape[1] // KV_ROW_BYTES
    flat = pool.reshape(-1)
    s = slots.long().clamp_min(0)
    page, r = s // P, s % P
    stride = P * KV_ROW_BYTES if layout == "unpadded" else pool.stride(0)
    base = page * stride
    if layout == "interleaved":
        part, group = base + r * KV_ROW_BYTES, base + r * KV_ROW_BYTES + 576
    else:
        part, group = base + r * 576, base + P * 576 + r * 8
    ar576 = torch.arange(576, device=pool.device)
    bytes_ = flat[(part[..., None] + ar576).clamp(max=flat.numel() - 1)]
    exps = flat[(group[..., None] + torch.arange(7, device=pool.device)).clamp(max=flat.numel() - 1)]
    nope = bytes_[..., :448].view(torch.float8_e4m3fn).double()
    scale = torch.exp2(exps.double() - 127).repeat_interleave(64, dim=-1)
    rope = bytes_[..., 448:].contiguous().view(torch.bfloat16).double()
    rows = torch.cat([nope * scale, rope], dim=-1)
    return rows.masked_fill((slots < 0)[..., None], 0.0)


def reference(q, swa, win, extra, ext, sink, layout="ours"):
    """fp64 MODEL1 decode: (out [b, h, 512], lse [b, h] sink excluded, sum_n p_n |v_n| [b, h, 512],
    max_n scale sum_d |q_d k_nd| [b, h]); empty rows: out 0, lse +inf."""
    keys = read_rows(swa, win, layout)
    valid = win >= 0
    if ext is not None and ext.shape[1]:
        keys = torch.cat([keys, read_rows(extra, ext, layout)], 1)
        valid = torch.cat([valid, ext >= 0], 1)
    qd = q.double()
    s = torch.einsum("bhd,bnd->bhn", qd, keys) * SCALE
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    total = torch.logaddexp(lse, sink.double()[None, :])
    p = torch.exp(s - total[..., None])
    out = torch.einsum("bhn,bnd->bhd", p, keys)
    absv = torch.einsum("bhn,bnd->bhd", p, keys.abs())
    qk_abs = (torch.einsum("bhd,bnd->bhn", qd.abs(), keys.abs()) * SCALE).masked_fill(~valid[:, None, :], 0).amax(-1)
    lonely = torch.isneginf(lse)
    return (out.masked_fill(lonely[..., None], 0.0), lse.masked_fill(lonely, float("inf")), absv, qk_abs)


def bounds(ref):
    out, lse, absv, qk_abs = ref
    ob = 2.0 ** -7 * out.abs() + 2.0 ** -8 * absv + 2.0 ** -20
    lb = 2.0 ** -13 * qk_abs + 2.0 ** -20 * (1 + lse.abs().nan_to_num(posinf=0.0))
    return ob, lb


def against(got, want, bound, what: str) -> dict:
    """Max error, max error / bound, the first element over the bound (index, got, want)."""
    g, w = got.double(), want.double()
    both_inf = torch.isinf(g) & torch.isinf(w) & (torch.sign(g) == torch.sign(w))
    err = torch.where(both_inf, torch.zeros_like(g), (g - w).abs()).nan_to_num(nan=float("inf"))
    over = err > bound
    info = {"max_err": float(err.max()), "max_err_over_bound": float((err / bound).max()),
            "n_over": int(over.sum()), "of": over.numel()}
    if over.any():
        idx = tuple(int(i) for i in torch.nonzero(over)[0])
        info["first_bad"] = {"index": idx, "got": float(g[idx]), "want": float(w[idx]), "bound": float(bound[idx])}
    flat_g, flat_w = g[~both_inf].nan_to_num(), w[~both_inf].nan_to_num()
    if flat_g.numel():
        info["cos"] = round(float(torch.nn.functional.cosine_similarity(flat_g.flatten(), flat_w.flatten(), 0)), 9)
    info["what"] = what
    return info


# ---- one shape -------------------------------------------------------------------------------

SHAPES = {  # name: (heads, window width, extra kind, extra width as a function of context)
    "flash_csa": (64, 128, "c4", lambda ctx: 512),
    "pro_csa": (128, 128, "c4", lambda ctx: 1024),
    "flash_hca": (64, 128, "c128", lambda ctx: ctx // 128),
    "pro_hca": (128, 128, "c128", lambda ctx: ctx // 128),
    "swa_only": (64, 128, None, lambda ctx: 0),
    "tiny_csa": (8, 128, "c4", lambda ctx: 16),
    "tiny_hca": (8, 128, "c128", lambda ctx: ctx // 128),
}


def make_inputs(shape: str, batch: int, ctx: int, align: int, seed: int, holes: bool = False,
                empty_row: bool = False, rows_cap: int = 1 << 21):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    h, W, kind, kfn = SHAPES[shape]
    k = kfn(ctx)
    swa = random_pool(max(batch * W, 1024), 128, align, gen)
    extra = random_pool(max(min(batch * max(k, 1), rows_cap), 256), 64, align, gen) if kind else None
    q = torch.randn(batch, h, 512, device=DEV, generator=gen).to(torch.bfloat16)
    sink = torch.randn(h, device=DEV, generator=gen)
    win = torch.randint(0, capacity(swa), (batch, W), device=DEV, generator=gen, dtype=torch.int32)
    ext = None
    if kind:
        if kind == "c128":   # HCA: every visible row in order, -1 past each request's count
            base = torch.randint(0, max(1, capacity(extra) - k), (batch, 1), device=DEV, generator=gen)
            ext = (base + torch.arange(k, device=DEV)).to(torch.int32)
            vis = torch.randint(max(1, k // 2), k + 1, (batch, 1), device=DEV, generator=gen)
            ext = torch.where(torch.arange(k, device=DEV) < vis, ext, -1).to(torch.int32)
        else:
            ext = torch.randint(0, capacity(extra), (batch, k), device=DEV, generator=gen, dtype=torch.int32)
    if holes:
        win[0, : W // 2] = -1                  # a young request: the window's start is empty
        win[:, 5::17] = -1
        if ext is not None:
            ext[:, ::3] = -1
    if empty_row:
        win[-1] = -1
        if ext is not None:
            ext[-1] = -1
    return dict(q=q, swa=swa, extra=extra, win=win, ext=ext, sink=sink, h=h, k=k, kind=kind)


def run_flashmla(fm, x, sched=None):
    win = pad_indices(x["win"])
    rows = lengths = cache = None
    if x["ext"] is not None and x["ext"].shape[1]:
        rows = pad_indices(x["ext"])
        lengths = list_lengths(rows) if x["kind"] == "c128" else None
        cache = flashmla_cache(x["extra"], "extra")
    sched = sched if sched is not None else fm.get_mla_metadata()[0]
    out, lse = flashmla_sparse_attention(fm, x["q"], flashmla_cache(x["swa"], "SWA"), win, cache, rows, lengths,
                                         x["sink"], SCALE, sched)
    return out, lse, sched


def run_triton(x):
    from dsv4_backend.kernels.sparse_attention import sparse_decode
    res = sparse_decode(x["q"], x["swa"], x["win"], x["extra"], x["ext"], x["sink"], SCALE)
    return res.out, res.lse


def check_shape(name, fm, shape, batch, ctx, align=FLASHMLA_PAGE_ALIGN, holes=False, empty_row=False, seed=0):
    x = make_inputs(shape, batch, ctx, align, seed, holes=holes, empty_row=empty_row)
    log(f"{name}: q {describe(x['q'])}; SWA pool {describe(x['swa'])} -> cache "
        f"{describe(flashmla_cache(x['swa'], 'SWA'))}; window {describe(pad_indices(x['win']))}; extra pool "
        f"{describe(x['extra'])}; extra indices {describe(None if x['ext'] is None else pad_indices(x['ext']))}")
    f_out, f_lse, _ = run_flashmla(fm, x)
    t_out, t_lse = run_triton(x)
    ref = reference(x["q"], x["swa"], x["win"], x["extra"], x["ext"], x["sink"])
    ob, lb = bounds(ref)
    res = {"flashmla_out": against(f_out, ref[0], ob, "FlashMLA out vs fp64"),
           "flashmla_lse": against(f_lse, ref[1], lb, "FlashMLA lse vs fp64"),
           "triton_out": against(t_out, ref[0], ob, "Triton out vs fp64"),
           "triton_lse": against(t_lse, ref[1], lb, "Triton lse vs fp64"),
           "flashmla_vs_triton_out": against(f_out, t_out, 2 * ob, "FlashMLA vs Triton out")}
    ok = all(v["n_over"] == 0 for v in res.values())
    if empty_row:
        res["empty_row"] = {"flashmla_out_zero": bool((f_out[-1] == 0).all()),
                            "flashmla_lse": [float(v) for v in f_lse[-1, :4]],
                            "triton_lse": [float(v) for v in t_lse[-1, :4]]}
    if res["flashmla_out"]["n_over"]:
        res["layout_hypotheses"] = layout_probe(x, f_out)
    record(name, ok, out_bound="2^-7|ref| + 2^-8 sum p|v| + 2^-20",
           lse_bound="2^-13 max scale sum|q k| + 2^-20 (1 + |lse|)", **res)


def layout_probe(x, f_out) -> dict:
    """Cosine of FlashMLA's output with the reference computed under each byte-layout hypothesis."""
    out = {}
    for layout in ("ours", "interleaved", "unpadded"):
        r = reference(x["q"], x["swa"], x["win"], x["extra"], x["ext"], x["sink"], layout)[0]
        out[layout] = round(float(torch.nn.functional.cosine_similarity(
            f_out.double().flatten().nan_to_num(), r.flatten(), 0)), 6)
    return out


def check_unaligned(name, fm):
    """Pools of exactly P * 584 bytes per page (no 576 alignment): FlashMLA's answer (the sm100
    kernels assert; the sm90 one may accept them)."""
    x = make_inputs("flash_csa", 8, 65536, 1, seed=3)
    try:
        f_out, _, _ = run_flashmla(fm, x)
    except Exception as e:  # noqa: BLE001
        record(name, True, accepted=False, error=f"{type(e).__name__}: {e}"[:600])
        return
    ref = reference(x["q"], x["swa"], x["win"], x["extra"], x["ext"], x["sink"])
    ob, _ = bounds(ref)
    res = against(f_out, ref[0], ob, "FlashMLA out vs fp64, unaligned pages")
    record(name, res["n_over"] == 0, accepted=True, out=res)


def check_sched_reuse(name, fm):
    """One scheduling metadata for two calls of the same kind (as the layers of a step share it):
    the second call's result equals a call with fresh metadata."""
    x = make_inputs("flash_hca", 32, 131072, FLASHMLA_PAGE_ALIGN, seed=5)
    _, _, sched = run_flashmla(fm, x)
    y = dict(x, q=torch.randn_like(x["q"].float()).to(torch.bfloat16))
    reused, _, _ = run_flashmla(fm, y, sched)
    fresh, _, _ = run_flashmla(fm, y)
    record(name, bool(torch.equal(reused, fresh)), max_diff=float((reused.float() - fresh.float()).abs().max()))


# ---- timing ----------------------------------------------------------------------------------

def cold_replay_us(fn) -> float:
    from triton.testing import do_bench
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return do_bench(graph.replay, warmup=5, rep=100, return_mode="median") * 1e3


def time_shape(name, fm, shape, batch, ctx):
    x = make_inputs(shape, batch, ctx, FLASHMLA_PAGE_ALIGN, seed=7, rows_cap=1 << 22)
    _, _, sched = run_flashmla(fm, x)   # metadata computed once, outside the graph
    us_f = cold_replay_us(lambda: run_flashmla(fm, x, sched))
    us_fs = cold_replay_us(lambda: run_flashmla(fm, x))
    us_t = cold_replay_us(lambda: run_triton(x))
    record(name, True, keys=128 + x["k"], flashmla_us=round(us_f, 1), flashmla_with_sched_us=round(us_fs, 1),
           triton_us=round(us_t, 1), triton_over_flashmla=round(us_t / us_f, 2))


def prefill_inputs(shape: str, T: int, ctx: int, seed: int):
    """A prefill chunk: T consecutive query rows whose windows slide over consecutive slots."""
    x = make_inputs(shape, T, ctx, FLASHMLA_PAGE_ALIGN, seed, rows_cap=1 << 22)
    start = 128 + int(torch.randint(0, capacity(x["swa"]) - T - 256, (1,)))
    x["win"] = (start + torch.arange(T, device=DEV)[:, None] + torch.arange(-127, 1, device=DEV)[None, :]).to(torch.int32)
    return x


def check_prefill(name, fm, shape, T, ctx):
    x = prefill_inputs(shape, T, ctx, seed=11)
    out = flashmla_prefill_attention(fm, x["q"], x["swa"], x["win"], x["extra"], x["ext"], x["sink"], SCALE)
    ref = reference(x["q"], x["swa"], x["win"], x["extra"], x["ext"], x["sink"])
    ob, _ = bounds(ref)
    res = against(out, ref[0], ob, "flash_mla_sparse_fwd out vs fp64")
    record(name, res["n_over"] == 0, out=res, q=describe(x["q"]))


def time_prefill(name, fm, shape, T, ctx):
    from triton.testing import do_bench
    x = prefill_inputs(shape, T, ctx, seed=13)
    us = lambda fn: do_bench(fn, warmup=3, rep=20, return_mode="median") * 1e3  # noqa: E731
    us_p = us(lambda: flashmla_prefill_attention(fm, x["q"], x["swa"], x["win"], x["extra"], x["ext"], x["sink"],
                                                 SCALE))
    us_d = us(lambda: run_flashmla(fm, x))
    us_t = us(lambda: run_triton(x))
    record(name, True, rows=T, keys_per_row=128 + x["k"], sparse_fwd_us=round(us_p, 1),
           decode_kernel_rows_us=round(us_d, 1), triton_us=round(us_t, 1),
           sparse_fwd_over_decode=round(us_p / us_d, 2))


# ---- the engine ------------------------------------------------------------------------------

def engine_tokens(kernel: str, preset: str, prompts, synthetic, new_tokens: int, cuda_graph: bool,
                  overrides=None):
    from scheduler_hooks.engine import Engine
    ctx_len = max([len(p) for p in prompts] + [c for c in synthetic] + [0]) + new_tokens + 64
    eng = Engine(preset=preset, device=DEV, dtype="bfloat16", max_running_requests=8, skip_tokenizer_init=True,
                 max_total_tokens=max(8192, 2 * ctx_len * max(1, len(synthetic))), context_length=ctx_len,
                 chunked_prefill_size=2048, random_seed=0, attention_kernel=kernel, cuda_graph=cuda_graph,
                 config_overrides=overrides, random_weights_on_device=True)
    assert eng.attention_kernel == kernel, (eng.attention_kernel, eng.runner.attention_kernel_reason)
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    out = [r["output_ids"] for r in eng.generate(input_ids=prompts, sampling_params=[params] * len(prompts))] \
        if prompts else []
    rids = [eng.add_synthetic_request(c, params) for c in synthetic]
    done: dict[str, list[int]] = {}
    while len(done) < len(rids):
        for r in eng.step():
            if r.finished:
                done[r.rid] = r.output_ids
    out += [done[r] for r in rids]
    info = {"backend": eng.runner.backend_name, "graphs": None}
    if eng.runner.cuda_graphs is not None:
        info["graphs"] = {"captures": eng.runner.cuda_graphs.captures, "replays": eng.runner.cuda_graphs.replays}
    eng.shutdown()
    del eng
    torch.cuda.empty_cache()
    return out, info


def check_engine(name, preset, prompts, synthetic, new_tokens, overrides=None):
    t, ti = engine_tokens("triton", preset, prompts, synthetic, new_tokens, True, overrides)
    f, fi = engine_tokens("flashmla", preset, prompts, synthetic, new_tokens, True, overrides)
    fe, _ = engine_tokens("flashmla", preset, prompts, synthetic, new_tokens, False, overrides)
    first = []
    for i, (a, b) in enumerate(zip(t, f)):
        d = next((j for j, (u, v) in enumerate(zip(a, b)) if u != v), None)
        if d is not None:
            first.append({"request": i, "position": d, "triton": a[d:d + 4], "flashmla": b[d:d + 4]})
    same = sum(a == b for a, b in zip(t, f))
    # graph replays pad the batch to a bucket, which may change FlashMLA's split plan: informative only
    record(name, same == len(t), requests=len(t), identical=same, first_divergence=first[:4],
           flashmla_graph_equals_eager=fe == f, triton_info=ti, flashmla_info=fi)


# ---- main ------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer shapes and timings: < 4 minutes")
    ap.add_argument("--out", type=Path, default=None, help="directory for flashmla_check.json")
    args = ap.parse_args()

    gpu = (f"device {torch.cuda.get_device_name()} capability {torch.cuda.get_device_capability()}"
           if torch.cuda.is_available() else "no CUDA device")
    log(f"torch {torch.__version__}, cuda {torch.version.cuda}, {gpu}")
    why = flashmla_unavailable(DEV, 128)
    if why is not None:
        record("install", False, why=why)
        return finish(args)
    import flash_mla as fm
    record("install", True, version=fm.__version__, has_legacy=fm.has_legacy(), path=fm.__file__)

    q = args.quick
    guarded("sched_reuse", check_sched_reuse, fm)
    guarded("unaligned_pages", check_unaligned, fm)
    shapes = [("flash_csa", 1, 65536), ("flash_csa", 8, 1 << 20), ("flash_csa", 32, 1 << 20),
              ("pro_csa", 32, 131072), ("flash_hca", 8, 1 << 20), ("swa_only", 32, 4096),
              ("tiny_csa", 8, 4096), ("tiny_hca", 8, 65536), ("flash_hca", 4, 2048)]
    if not q:
        shapes += [("flash_csa", 128, 1 << 20), ("pro_csa", 128, 131072), ("flash_hca", 32, 1 << 20),
                   ("pro_hca", 32, 131072), ("swa_only", 128, 4096), ("flash_hca", 128, 262144)]
    for shape, b, ctx in shapes:
        guarded(f"agree {shape} b{b} ctx{ctx}", check_shape, fm, shape, b, ctx)
    guarded("agree flash_csa b8 holes + empty request", check_shape, fm, "flash_csa", 8, 1 << 20, holes=True,
            empty_row=True)
    guarded("agree flash_hca b8 holes + empty request", check_shape, fm, "flash_hca", 8, 1 << 18, holes=True,
            empty_row=True)
    guarded("agree swa_only b4 empty request", check_shape, fm, "swa_only", 4, 4096, empty_row=True)

    timings = [("flash_csa", 32, 1 << 20), ("pro_csa", 32, 131072), ("flash_hca", 32, 1 << 20)]
    if not q:
        timings = [("flash_csa", b, 1 << 20) for b in (1, 8, 32, 128)] + \
                  [("pro_csa", b, 131072) for b in (32, 128)] + [("flash_hca", b, 1 << 20) for b in (32, 128)]
    for shape, b, ctx in timings:
        guarded(f"time {shape} b{b} ctx{ctx}", time_shape, fm, shape, b, ctx)

    guarded("prefill flash_csa T512 ctx128K", check_prefill, fm, "flash_csa", 512, 131072)
    guarded("prefill flash_hca T256 ctx128K", check_prefill, fm, "flash_hca", 256, 131072)
    for shape, T in ([("flash_csa", 2048)] if q else [("flash_csa", 2048), ("flash_csa", 8192), ("flash_hca", 8192)]):
        guarded(f"time prefill {shape} T{T} ctx128K", time_prefill, fm, shape, T, 131072)

    prompts = [[(7 * i + 3 * j) % 1000 + 1 for j in range(n)] for i, n in enumerate((40, 300, 700, 1100))]
    guarded("engine tiny greedy", check_engine, "tiny", prompts, [4096] if q else [4096, 16384], 16)
    if not q:
        guarded("engine flash (8 experts) greedy, synthetic 4K / 128K", check_engine, "flash", [], [4096, 131072], 8,
                {"n_routed_experts": 8, "num_experts_per_tok": 6})
    finish(args)


def finish(args) -> None:
    n_fail = sum(not c["ok"] for c in CHECKS)
    log(f"{len(CHECKS) - n_fail} passed, {n_fail} failed, {time.time() - T0:.0f} s")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "flashmla_check.json").write_text(json.dumps(CHECKS, indent=1, default=str))


if __name__ == "__main__":
    main()
