"""H200 check of the engine on the Triton backend: tiny-preset correctness, Flash-shaped decode smoke.

(a) correctness: the tiny preset (4 layers: window, CSA, HCA, CSA) run by a ModelRunner on CUDA
    with the "triton" backend, in float32 and bfloat16, against the CPU torch backend at the same
    dtype on the same weights, teacher-forced (both consume the same tokens), over a small
    version of the engine correctness matrix: prompts crossing 4, 128 and the window, chunked
    prefill, decodes completing C4 and C128 blocks, online C128, a batch of three lengths. Per
    case: greedy (argmax) agreement over every position, max / median |logit diff|, the lowest
    per-position cosine.
(b) smoke timing: a Flash-shaped model (43 layers, Flash's attention shapes and layer pattern,
    random bf16 weights drawn on the GPU, the MoE cut to a few routed experts so it fits). A
    synthetic prefix is NOT computed: the allocator maps it, then every row of the SWA / C4 /
    C128 / indexer pools is filled with valid random FP8 rows (a superset of the slots the
    allocator assigned) and the rings with random (C, Z); then decode steps are timed at batch
    1 and 32 for a few contexts, and the torch backend on CUDA is timed and compared on one
    small case (same pools, the same step re-run). Not a benchmark: no CUDA graphs, the
    metadata is built on the CPU every step (its share is reported), Python launches dominate
    at batch 1.

    PYTHONUNBUFFERED=1 python3 bench/gpu_engine_check.py --out $OUT            # both parts
    python3 bench/gpu_engine_check.py --part a | --part b [--quick]

Prints a table at the end and writes gpu_engine_check.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4_backend.backend import AttentionBackend, TorchDSV4Backend  # noqa: E402
from dsv4_backend.config import DSV4Config  # noqa: E402
from dsv4_backend.model import hadamard_matrix  # noqa: E402
from dsv4_backend.model_runner import ForwardRequest, ModelRunner, run_schedule  # noqa: E402
from dsv4_backend.weights import WeightKind, param_dtype, random_weights, weight_specs  # noqa: E402
from memory.allocator import KVAllocator  # noqa: E402
from memory.configurator import DSV4PoolConfigurator  # noqa: E402
from memory.pools import DSV4KVPools  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# --dry-cpu: the whole script at toy sizes on the CPU (kernels under TRITON_INTERPRET=1), to
# check the script itself before spending device time.
DEV = "cuda"


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


# ---- (a) correctness on the tiny preset --------------------------------------------------------

@dataclass
class Case:
    name: str
    lengths: dict[str, int]               # request -> total tokens it will have
    steps: list[list[tuple[str, int]]]    # per step: (request, new tokens)
    online: bool = False


def decode_steps(rids: list[str], n: int) -> list[list[tuple[str, int]]]:
    return [[(r, 1) for r in rids] for _ in range(n)]


def tiny_cases() -> list[Case]:
    return [
        Case("p3+d6 (C4 at 4, 8)", {"a": 9}, [[("a", 3)]] + decode_steps(["a"], 6)),
        Case("p130+d10", {"a": 140}, [[("a", 130)]] + decode_steps(["a"], 10)),
        Case("p300 chunks 128/128/44 +d4", {"a": 304}, [[("a", 128)], [("a", 128)], [("a", 44)]]
             + decode_steps(["a"], 4)),
        Case("p250+d8 (C128 at 256)", {"a": 258}, [[("a", 250)]] + decode_steps(["a"], 8)),
        Case("online p250+d8", {"a": 258}, [[("a", 250)]] + decode_steps(["a"], 8), online=True),
        Case("batch 5/77/200 +d8", {"a": 13, "b": 85, "c": 208},
             [[("a", 5), ("b", 77), ("c", 200)]] + decode_steps(["a", "b", "c"], 8)),
        Case("p600 chunks of 200 +d8", {"a": 608}, [[("a", 200)]] * 3 + decode_steps(["a"], 8)),
    ]


def play(runner: ModelRunner, case: Case, seqs: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Run the case's schedule (see ``run_schedule``), free its requests, logits on the CPU."""
    out = run_schedule(runner, case.steps, seqs)
    for rid in case.lengths:
        runner.allocator.free(rid)
    return {r: v.float().cpu() for r, v in out.items()}


def compare_logits(ref: torch.Tensor, got: torch.Tensor) -> dict:
    diff = (ref - got).abs()
    cos = torch.nn.functional.cosine_similarity(ref.double(), got.double(), dim=-1)
    return dict(positions=int(ref.shape[0]), argmax_agree=float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
                max_abs=float(diff.max()), median_abs=float(diff.median()), min_cos=float(cos.min()),
                finite=bool(torch.isfinite(got).all()))


def part_a(args) -> list[dict]:
    cfg = DSV4Config.preset("tiny", vocab_size=4096)
    g = torch.Generator().manual_seed(11)
    rows = []
    for dname, dtype in DTYPES.items():
        weights = random_weights(cfg, seed=5, dtype=dtype, include_mtp=False)
        for case in (tiny_cases() if DEV == "cuda" else tiny_cases()[:1]):
            seqs = {r: torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for r, n in case.lengths.items()}
            out = {}
            for dev in ("cpu", DEV if DEV == "cuda" else "gpu-standin"):
                d = "cpu" if dev == "gpu-standin" else dev
                runner = ModelRunner.build(cfg, dtype=dtype, weights={k: v.to(d) for k, v in weights.items()},
                                           device=d, max_total_tokens=4096, max_running_requests=4,
                                           online_compress=case.online,
                                           backend=None if dev == "cpu" else "triton")  # FlashMLA: gpu_flashmla_check.py
                want = "torch" if dev == "cpu" else "triton"
                assert runner.backend_name == want, (dev, runner.backend_name)
                t0 = time.perf_counter()
                out[dev] = play(runner, case, seqs)
                sync()
                out[dev + "_s"] = time.perf_counter() - t0
            out["cuda"], out["cuda_s"] = out[dev], out[dev + "_s"]
            ref = torch.cat([out["cpu"][r] for r in case.lengths])
            got = torch.cat([out["cuda"][r] for r in case.lengths])
            row = dict(dtype=dname, case=case.name, **compare_logits(ref, got),
                       cpu_s=round(out["cpu_s"], 3), gpu_s=round(out["cuda_s"], 3))
            rows.append(row)
            print(f"[a] {dname:8s} {case.name:28s} agree {row['argmax_agree']:.4f} max {row['max_abs']:.3e} "
                  f"median {row['median_abs']:.3e} min cos {row['min_cos']:.6f}", flush=True)
    return rows


# ---- (b) Flash-shaped decode smoke -------------------------------------------------------------

def gpu_random_weights(cfg: DSV4Config, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """weights.random_weights' distributions, drawn directly on the GPU (the CPU generator would
    take minutes for ~15 G parameters); not the same values as the seeded CPU weights."""
    torch.manual_seed(0)
    out = {}
    for spec in weight_specs(cfg, include_mtp=False):
        if spec.kind is WeightKind.INT64:
            r = torch.rand(spec.shape[0], cfg.n_routed_experts, device=device)
            out[spec.name] = r.argsort(dim=-1)[:, : spec.shape[1]].contiguous()
            continue
        t = torch.empty(spec.shape, dtype=param_dtype(spec.name, spec.kind, dtype), device=device)
        out[spec.name] = t.normal_(spec.init_mean, spec.init_std) if spec.init_std else t.fill_(spec.init_mean)
    return out


def _template_pages(pool: torch.Tensor, n_pages: int, indexer: bool) -> torch.Tensor:
    """n_pages of valid random rows in ``pool``'s page format (rows written by the kernels)."""
    from dsv4_backend.kernels import finish_rows, kv_store_rows
    tmp = torch.zeros(n_pages, pool.shape[1], dtype=torch.uint8, device=pool.device)
    rows_per_page = pool.shape[1] // (132 if indexer else 584)
    n = n_pages * rows_per_page
    slots = torch.arange(n, device=pool.device)
    if indexer:
        x = torch.randn(n, 128, device=pool.device)
        ones = torch.ones(128, device=pool.device)
        cos, sin = torch.ones(n, 32, device=pool.device), torch.zeros(n, 32, device=pool.device)
        finish_rows(tmp, slots, x, ones, cos, sin, 1e-6, False, False,
                    hadamard=hadamard_matrix(128, torch.float32, pool.device))
    else:
        kv_store_rows(tmp, slots, torch.randn(n, 512, device=pool.device, dtype=torch.bfloat16))
    return tmp


def fill_pools(pools: DSV4KVPools) -> dict:
    """Every row of every KV / indexer pool: valid random FP8 rows (16 template pages tiled);
    rings: random (C, Z). Returns what was filled, in bytes."""
    filled = {}
    for kind, indexer in (("swa_kv", False), ("c4_kv", False), ("c128_kv", False), ("c4_indexer", True)):
        total = 0
        for pool in getattr(pools, kind).values():
            n_tmpl = 16 if DEV == "cuda" else 1       # the interpreter writes ~100 rows/s
            tmpl = _template_pages(pool, n_tmpl, indexer)
            for p0 in range(0, pool.shape[0], n_tmpl):
                p1 = min(pool.shape[0], p0 + n_tmpl)
                pool[p0:p1] = tmpl[: p1 - p0]
            total += pool.numel()
        filled[kind] = total
    for kind in ("c4_ring", "c4_indexer_ring", "c128_ring"):
        for ring in getattr(pools, kind).values():
            ring.normal_()
        filled[kind] = sum(t.numel() * t.element_size() for t in getattr(pools, kind).values())
    return filled


class MetaTimer:
    """Wraps a backend's init_forward_metadata to record how long each call takes (host side)."""

    def __init__(self, backend):
        self.backend, self.times = backend, []
        self._orig = backend.init_forward_metadata
        backend.init_forward_metadata = self

    def __call__(self, batch):
        t0 = time.perf_counter()
        meta = self._orig(batch)
        sync()
        self.times.append(time.perf_counter() - t0)
        return meta


class AttnCompare(AttentionBackend):
    """Backend wrapper: every layer runs ``test`` then ``ref`` on the same inputs and pools (both
    write the same rows to the same slots) and records how far the outputs are apart; returns
    ``ref``'s output. Isolates the backends from the model's discrete choices (MoE routing). Each
    backend stores its own KV rows (``swa_store`` stays the base's None)."""

    def __init__(self, ref, test):
        self.ref, self.test = ref, test
        self.max_abs, self.min_cos = 0.0, 1.0

    def init_forward_metadata(self, batch, events=True):
        return self.ref.init_forward_metadata(batch, events)

    def forward(self, layer_id, layer, inputs, meta):
        o_test = self.test.forward(layer_id, layer, inputs, meta).float()
        o_ref = self.ref.forward(layer_id, layer, inputs, meta)
        r = o_ref.float()
        self.max_abs = max(self.max_abs, float((r - o_test).abs().max()))
        cos = torch.nn.functional.cosine_similarity(r.flatten(1), o_test.flatten(1), dim=-1)
        self.min_cos = min(self.min_cos, float(cos.min()))
        return o_ref


def synth_prefix(runner: ModelRunner, rids: list[str], ctx: int, chunk: int = 16384) -> None:
    alloc = runner.allocator
    for rid in rids:
        alloc.admit(rid)
        for n in range(min(chunk, ctx), ctx + chunk, chunk):
            res = alloc.extend(rid, min(n, ctx))
            if not res.ok:
                raise RuntimeError(f"synthetic prefix: allocator refused {rid} at {min(n, ctx)}: {res}")
            alloc.evict_swa(rid)


def decode_step(runner: ModelRunner, rids: list[str], toks: list[int], logits="last") -> list[torch.Tensor]:
    alloc = runner.allocator
    reqs = []
    for rid, tok in zip(rids, toks):
        L = alloc.seq_len(rid)
        alloc.extend(rid, L + 1)
        reqs.append(ForwardRequest(alloc.req_slot(rid), L, [tok], logits))
    out = runner.forward(reqs)
    for rid in rids:
        alloc.evict_swa(rid)
    return out


def rerun_last(runner: ModelRunner, rids: list[str], reqs_tokens: dict[str, list[int]]) -> list[torch.Tensor]:
    """Run the last step's tokens again at the same positions (idempotent on the pools)."""
    alloc = runner.allocator
    reqs = []
    for rid in rids:
        toks = reqs_tokens[rid]
        reqs.append(ForwardRequest(alloc.req_slot(rid), alloc.seq_len(rid) - len(toks), toks, "last"))
    return runner.forward(reqs)


def timed(fn, n_warm: int, n: int) -> tuple[list[float], list]:
    outs, times = [], []
    for i in range(n_warm + n):
        sync()
        t0 = time.perf_counter()
        o = fn()
        sync()
        if i >= n_warm:
            times.append(time.perf_counter() - t0)
            outs.append(o)
    return times, outs


def part_b(args) -> dict:
    dev = DEV
    experts = 8
    cfg = DSV4Config.preset("flash", n_routed_experts=experts)
    dtype = torch.bfloat16
    cases = [(1, 8192), (32, 8192)] if args.quick else [(1, 8192), (1, 65536), (1, 262144), (1, 1048576),
                                                        (32, 8192), (32, 65536)]
    if dev == "cpu":  # --dry-cpu: Flash's pattern on a toy model
        cfg = DSV4Config.preset("tiny", vocab_size=512)
        cases = [(1, 600), (2, 300)]
    max_tokens = max(b * (c + 256) for b, c in cases) + 65536
    max_ctx = max(c for _, c in cases) + 4096
    t0 = time.perf_counter()
    weights = gpu_random_weights(cfg, dtype, dev)
    n_params = sum(t.numel() for t in weights.values())
    plan = DSV4PoolConfigurator(cfg, max_running_requests=33, swa_ratio=0.02, online_compress=False
                                ).plan_for_tokens(max_tokens)
    pools = DSV4KVPools(cfg, plan, device=dev)
    alloc = KVAllocator(plan, max_context=max_ctx, window=cfg.sliding_window, device=dev)
    runner = ModelRunner(cfg, weights, pools, alloc, device=dev, dtype=dtype,
                         backend=None if dev == "cuda" else "triton")
    del weights
    if dev == "cuda":
        torch.cuda.empty_cache()
    filled = fill_pools(pools)
    sync()
    setup_s = time.perf_counter() - t0
    info = dict(model=f"Flash shapes: {cfg.num_hidden_layers} layers, ratios {list(cfg.layer_ratios)}, "
                      f"{cfg.num_attention_heads} heads, topk {cfg.index_topk}, MoE cut to {experts} routed "
                      f"experts ({cfg.num_experts_per_tok} per token) + shared; random bf16 weights drawn on the GPU",
                params=n_params, backend=runner.backend_name, pool_bytes=pools.memory_usage(),
                pool_fill="every KV/indexer pool row filled with valid random FP8 rows (tiled template pages), "
                          "rings random: the synthetic prefix is mapped by the allocator but never computed",
                filled_bytes=filled, setup_s=round(setup_s, 1),
                gpu_mem_gb=round(torch.cuda.max_memory_allocated() / 2**30, 1) if dev == "cuda" else 0.0)
    print(f"[b] setup {setup_s:.1f} s, {n_params / 1e9:.2f} G params, peak {info['gpu_mem_gb']} GiB", flush=True)
    triton_backend = runner.backend
    meta_t = MetaTimer(triton_backend)
    rows = []
    gen = torch.Generator().manual_seed(3)
    for batch, ctx in cases:
        rids = [f"r{i}" for i in range(batch)]
        synth_prefix(runner, rids, ctx)
        toks = lambda: torch.randint(0, cfg.vocab_size, (batch,), generator=gen).tolist()  # noqa: E731
        meta_t.times.clear()
        times, _ = timed(lambda: decode_step(runner, rids, toks()), 2, args.steps)
        mt = statistics.median(meta_t.times[2:])
        step = statistics.median(times)
        row = dict(backend="triton", batch=batch, context=ctx, step_ms=round(step * 1e3, 2),
                   metadata_ms=round(mt * 1e3, 2), tok_s=round(batch / step, 1))
        extra = []
        if (batch, ctx) == cases[0]:
            # torch backend on the same pools: compare one decode step and one prefill chunk
            last = toks()
            [lt] = decode_step(runner, rids[:1], last[:1])
            torch_backend = TorchDSV4Backend(cfg, pools, alloc, dtype=dtype)
            runner.backend = torch_backend
            [lr] = rerun_last(runner, rids[:1], {rids[0]: last[:1]})
            row["vs_torch_decode"] = compare_logits(lr.float().cpu(), lt.float().cpu())
            both = AttnCompare(torch_backend, triton_backend)
            runner.backend = both
            rerun_last(runner, rids[:1], {rids[0]: last[:1]})
            row["vs_torch_decode"].update(attn_max_abs=both.max_abs, attn_min_cos=both.min_cos)
            runner.backend = torch_backend
            ttimes, _ = timed(lambda: decode_step(runner, rids, toks()), 1, max(2, args.steps // 2))
            extra.append(dict(backend="torch", batch=batch, context=ctx,
                              step_ms=round(statistics.median(ttimes) * 1e3, 2)))
            n_chunk = 1024 if dev == "cuda" else 16
            chunk = torch.randint(0, cfg.vocab_size, (n_chunk,), generator=gen).tolist()
            L = alloc.seq_len(rids[0])
            alloc.extend(rids[0], L + n_chunk)
            req = [ForwardRequest(alloc.req_slot(rids[0]), L, chunk, "last")]
            pt_torch, [[lr]] = timed(lambda: runner.forward(req), 0, 1)        # [1, V]
            runner.backend = triton_backend
            pt_triton, [[lt]] = timed(lambda: runner.forward(req), 1, 1)       # same positions again
            both = AttnCompare(torch_backend, triton_backend)
            runner.backend = both
            runner.forward(req)
            runner.backend = triton_backend
            alloc.evict_swa(rids[0])
            row["prefill_chunk"] = dict(tokens=n_chunk, triton_ms=round(pt_triton[0] * 1e3, 1),
                                        torch_ms=round(pt_torch[0] * 1e3, 1),
                                        **compare_logits(lr.float().cpu(), lt.float().cpu()),
                                        attn_max_abs=both.max_abs, attn_min_cos=both.min_cos)
        rows += [row] + extra
        print(f"[b] batch {batch:3d} ctx {ctx:8d}: step {row['step_ms']} ms (metadata {row['metadata_ms']} ms), "
              f"{row['tok_s']} tok/s", flush=True)
        for rid in rids:
            alloc.free(rid)
    info["rows"] = rows
    return info


# ---- main --------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("a", "b", "all"), default="all")
    ap.add_argument("--quick", action="store_true", help="part b: two small cases only")
    ap.add_argument("--steps", type=int, default=5, help="timed decode steps per case")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dry-cpu", action="store_true", help="toy sizes on the CPU under TRITON_INTERPRET=1")
    args = ap.parse_args()
    global DEV
    if args.dry_cpu:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--dry-cpu needs TRITON_INTERPRET=1 in the environment")
        DEV = "cpu"
    elif not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --dry-cpu with TRITON_INTERPRET=1)")
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    result = dict(gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)", torch=torch.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    try:
        import triton
        result["triton"] = triton.__version__
    except ImportError:
        pass
    Path(args.out).mkdir(parents=True, exist_ok=True)

    def save() -> None:
        with open(Path(args.out) / "gpu_engine_check.json", "w") as f:
            json.dump(result, f, indent=1)

    if args.part in ("a", "all"):
        result["a"] = part_a(args)
        save()
    if args.part in ("b", "all"):
        try:
            result["b"] = part_b(args)
        except Exception as e:  # keep (a)'s table; the traceback is in the log
            import traceback
            traceback.print_exc()
            result["b_error"] = f"{type(e).__name__}: {e}"
        save()

    print(f"\n{result['gpu']}  torch {result['torch']}  triton {result.get('triton')}  {result['date']}")
    if "a" in result:
        print("\n(a) tiny preset: CUDA triton backend vs CPU torch backend, teacher-forced, every position")
        print(f"{'dtype':9s} {'case':30s} {'pos':>4s} {'argmax':>7s} {'max|d|':>9s} {'med|d|':>9s} {'min cos':>9s}")
        for r in result["a"]:
            print(f"{r['dtype']:9s} {r['case']:30s} {r['positions']:4d} {r['argmax_agree']:7.4f} "
                  f"{r['max_abs']:9.2e} {r['median_abs']:9.2e} {r['min_cos']:9.6f}"
                  + ("" if r["finite"] else "  NON-FINITE"))
    if "b_error" in result:
        print(f"\n(b) FAILED: {result['b_error']}")
    if "b" in result:
        b = result["b"]
        print(f"\n(b) {b['model']}\n    {b['pool_fill']}")
        print(f"{'backend':8s} {'batch':>5s} {'context':>8s} {'step ms':>9s} {'meta ms':>8s} {'tok/s':>8s}")
        for r in b["rows"]:
            print(f"{r['backend']:8s} {r['batch']:5d} {r['context']:8d} {r['step_ms']:9.2f} "
                  f"{r.get('metadata_ms', float('nan')):8.2f} {r.get('tok_s', float('nan')):8.1f}")
            if "vs_torch_decode" in r:
                c = r["vs_torch_decode"]
                print(f"    decode, triton vs torch backend: attention out (same inputs, every layer) max|d| "
                      f"{c['attn_max_abs']:.3e} min cos {c['attn_min_cos']:.6f}; logits max|d| {c['max_abs']:.3e} "
                      f"cos {c['min_cos']:.6f} argmax same {c['argmax_agree'] == 1.0}")
                p = r["prefill_chunk"]
                print(f"    {p['tokens']}-token prefill chunk: triton {p['triton_ms']} ms, torch {p['torch_ms']} ms; "
                      f"attention out max|d| {p['attn_max_abs']:.3e} min cos {p['attn_min_cos']:.6f}; "
                      f"last logits max|d| {p['max_abs']:.3e} cos {p['min_cos']:.6f}")


if __name__ == "__main__":
    main()
