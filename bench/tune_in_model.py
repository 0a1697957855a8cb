"""Launch shapes of the one-row FP8 products and the FP4 MoE, chosen inside the model rather than alone.

``probe_fp8_row_gemv.py`` times each of Flash's one-row FP8 products alone (``--chain``: ``wo_a``
then ``wo_b``). In the model each runs between other launches under PDL, and a launch shape that
is no faster alone can be faster there: in session 23 ``wo_b`` on ``fp8_row.cu`` with two warps
along K was as fast as the Triton kernel alone, 7.8 us faster after ``wo_a``, and 7 us a layer
faster in the 11-layer model (docs/PERF.md).

This builds the Flash-width quantised model once (``bench_quant_model.build_engine``), admits one
request at ``--context`` and records which one-row FP8 products a decode step runs. A candidate
is today's rule with one thing replaced: one product's launch shape (an ``fp8_row.cu`` CTA shape
or a Triton one), or the FP4 experts' (gate-up, down) K splits at one token
(``fp4_mma.MmaConfig``). For each candidate it captures batch-1 decode graphs under that rule;
then it replays every candidate's graphs in ``--rounds`` alternated rounds (a drift of the
clocks lands in all of them) and prints each one's median replay GPU time beside the default's,
per step and per layer that runs the product. It only times: the kernels' launch shapes are
checked against float64 by ``tests/test_fp8_gemv.py`` and ``tests/test_fp4_mma.py``.

    python3 bench/tune_in_model.py --layers 11 [--context 4096] [--rounds 5] [--steps 6] \
        [--only wo_b,wo_a] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import bench_quant_model as bqm  # noqa: E402
from bench._bench_common import admit_synthetic, finish_all  # noqa: E402
from dsv4_backend.cuda_graph import DecodeGraphs  # noqa: E402
from dsv4_backend.kernels import fp4_mma, fp8_gemv  # noqa: E402
from dsv4_backend.kernels.fp4_mma import MmaConfig  # noqa: E402
from dsv4_backend.kernels.fp8_gemv import CudaRowConfig, RowGemvConfig  # noqa: E402

Shape = tuple[int, int, int]   # (N, K per group, groups) as fp8_row_gemv sees them

# fp8_row.cu CTA shapes (rows a warp, warps along N, warps along K, chunks a load step) and
# Triton ones (rows a program, 128-blocks a step, warps, stages) tried for every product
CUDA_SHAPES = [CudaRowConfig(2, 8, 1, 2), CudaRowConfig(1, 8, 1, 4), CudaRowConfig(2, 8, 2, 2),
               CudaRowConfig(1, 8, 2, 4), CudaRowConfig(4, 8, 1, 2), CudaRowConfig(2, 4, 2, 2)]
TRITON_SHAPES = [RowGemvConfig(16, 4, 2, 4), RowGemvConfig(32, 1, 2, 3), RowGemvConfig(16, 2, 4, 4)]
PRODUCT_ORDER = ("wo_b", "wo_a", "wq_b+indexer.wq_b", "wq_b", "shared w1+w3", "shared w2", "wq_a+wkv")
# the FP4 experts' (gate-up, down) at one token: (gate-up K splits, down K splits, chunks in flight);
# the first is the default's own (fp4_mma.pick_mma_configs at one token), the control
MOE_SHAPES = [(MmaConfig(u, p), MmaConfig(d, p)) for u, d, p in
              ((2, 2, 1), (1, 1, 1), (1, 2, 1), (2, 1, 1), (4, 2, 1), (2, 4, 1), (4, 4, 1), (2, 2, 2))]
MOE = "moe"   # the candidates' key for the MoE's shapes


def product_names(cfg: Any) -> dict[Shape, str]:
    """Flash's one-row FP8 products as the engine stacks them, by shape."""
    H, hd, D = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    G, R, inter = cfg.o_groups, cfg.o_lora_rank, cfg.moe_intermediate_size * cfg.n_shared_experts
    return {(cfg.q_lora_rank + hd, D, 1): "wq_a+wkv", (H * hd, cfg.q_lora_rank, 1): "wq_b",
            (H * hd + cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, 1): "wq_b+indexer.wq_b",
            (G * R, H * hd // G, G): "wo_a", (D, G * R, 1): "wo_b", (2 * inter, D, 1): "shared w1+w3",
            (D, inter, 1): "shared w2"}


class Rule:
    """fp8_gemv's launch-shape choice with one product's shape replaced (``override``), or the FP4
    MoE's at one token (``moe``); the default rules everywhere else. ``seen`` counts the products
    the captures ran, by shape (the MoE under ``MOE``)."""

    def __init__(self) -> None:
        self.override: dict[Shape, Any] = {}
        self.moe: Optional[tuple[MmaConfig, MmaConfig]] = None
        self.seen: dict[Any, int] = {}
        self._cuda_config, self._row_config = fp8_gemv._cuda_config, fp8_gemv.row_gemv_config
        self._moe_configs = fp4_mma.pick_mma_configs

    def set(self, key: Any, value: Any) -> None:
        """One candidate's rule: ``key`` a product's shape or ``MOE``; None, None: the defaults."""
        self.override = {key: value} if key is not None and key != MOE else {}
        self.moe = value if key == MOE else None

    def install(self) -> None:
        def cuda_config(x, N, K, R, mode, groups, config):
            shape = (N, K, groups)
            self.seen[shape] = self.seen.get(shape, 0) + 1
            if config is None and shape in self.override:
                config = self.override[shape]           # checked by the real rule: ValueError if it cannot run
            return self._cuda_config(x, N, K, R, mode, groups, config)

        def row_config(N, K, sms):
            for (n, k, _), c in self.override.items():
                if (n, k) == (N, K) and isinstance(c, RowGemvConfig):
                    return c
            return self._row_config(N, K, sms)

        def moe_configs(num_pairs):
            picked = self._moe_configs(num_pairs)
            if not picked[0].routed:     # decode sizes (the CTAs find their pairs), as at one token
                self.seen[MOE] = self.seen.get(MOE, 0) + 1
                return self.moe or picked
            return picked
        fp8_gemv._cuda_config, fp8_gemv.row_gemv_config = cuda_config, row_config
        fp4_mma.pick_mma_configs = moe_configs

    def uninstall(self) -> None:
        fp8_gemv._cuda_config, fp8_gemv.row_gemv_config = self._cuda_config, self._row_config
        fp4_mma.pick_mma_configs = self._moe_configs


def candidates(seen: dict[Any, int], names: dict[Shape, str], only: Optional[set[str]]) -> list[tuple[str, Any, Any]]:
    """(label, shape, launch shape) for every product seen and every shape it can take, the
    largest weights first (``PRODUCT_ORDER``); the default's own shape is among them (a control:
    its difference from the default is the noise)."""
    order = {n: i for i, n in enumerate(PRODUCT_ORDER)}
    out = []
    if MOE in seen and (not only or MOE in only):
        out += [(f"moe gate-up / down split {u.split_k} / {d.split_k}, prefetch {u.prefetch}", MOE, (u, d))
                for u, d in MOE_SHAPES]
    for shape in sorted((s for s in seen if s != MOE), key=lambda sh: (order.get(names.get(sh, ""), len(order)), sh)):
        name = names.get(shape, f"{shape[0]}x{shape[1]} ({shape[2]} groups)")
        if only and name not in only:
            continue
        R = shape[0] // shape[2]
        for c in CUDA_SHAPES:
            if 128 % c.rows == 0 and R % c.rows == 0:
                out.append((f"{name} cuda {tuple(c)}", shape, c))
        for c in TRITON_SHAPES:
            if 128 % c.block_n == 0 and R % c.block_n == 0:
                out.append((f"{name} triton {tuple(c)}", shape, c))
    return out


def step_ms(eng: Any, graphs: Optional[DecodeGraphs], steps: int) -> Optional[float]:
    """``steps`` timed steps under ``graphs`` (``bench_quant_model.timed_graph_steps``): the replays'
    mean GPU time; eager (no graphs, the CPU): the step time; None where graphs were given but did
    not replay (a capture that failed turns them off and the engine steps eagerly: not a time of
    the candidate)."""
    ms, gpu = bqm.timed_graph_steps(eng, graphs, steps)
    return ms if graphs is None else gpu


# free GPU memory below which no more candidates are captured (each holds its own graph pool)
MIN_FREE_BYTES = 3 << 30


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=11)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--only", default="", help="comma-separated product names, or moe (default: every product seen)")
    p.add_argument("--preset", default="flash", choices=("flash", "tiny"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--attention-kernel", default="auto", choices=("auto", "flashmla", "triton"))
    p.add_argument("--capture-seconds", type=float, default=300.0,
                   help="stop capturing candidates after this many seconds from the start")
    p.add_argument("--out")
    a = p.parse_args(argv)
    rule = Rule()
    # the engine sized for one request of the context plus every capture and every timed and untimed step
    max_candidates = 80
    need = (max_candidates + 1) * (a.rounds * (a.steps + 1) + 2) + 64
    # every graph of the run in one context bucket, so that no graph is captured again as the
    # request grows (a recapture would also run under whatever rule is set then)
    min_context = a.context + need + 1
    args = bqm.parse_args(["--preset", a.preset, "--device", a.device, "--layers", str(a.layers), "--contexts",
                           str(a.context), "--batches", "1", "--prefill-context", str(a.context + need),
                           "--max-batch", "1", "--skip-kernels", "--attention-kernel", a.attention_kernel])
    rep: dict[str, Any] = {"meta": {"argv": sys.argv[1:], "device": a.device, "preset": a.preset,
                                    "graph_context_bucket_from": min_context}}
    eng, cfg, *_ = bqm.build_engine(args, rep)
    names = product_names(cfg)
    rids = admit_synthetic(eng, a.context, 1, need)
    runner = eng.runner
    default_graphs = runner.cuda_graphs
    cuda = default_graphs is not None
    new_graphs = (lambda: DecodeGraphs(runner, max_bs=1, min_context=min_context)) if cuda else (lambda: None)
    seen: dict[Any, int] = {}
    cands: list[tuple[str, Any, Any]] = []
    # (label, key, value, graphs): the default first; the rule is set again before each of its steps
    runs: list[tuple[str, Any, Any, Optional[DecodeGraphs]]] = []
    times: dict[str, list[float]] = {}

    def report() -> None:
        """What is measured so far, printed and (with --out) written: called after each round."""
        top = max(seen.values()) if seen else 1
        layers_of = lambda key: round(cfg.num_hidden_layers * seen.get(key, 0) / top)  # noqa: E731
        base = times.get("default") or [float("nan")]
        base_ms = statistics.median(base)
        print(f"\nproducts a step runs (one-row FP8, the FP4 MoE): "
              + ", ".join(f"{names.get(s, s)} in {layers_of(s)} layers" for s in seen)
              + f"\ndefault rule: {base_ms * 1e3:8.1f} us a step (median of {len(base)} rounds, "
              f"{min(base) * 1e3:.1f}-{max(base) * 1e3:.1f}; graphs of the context bucket from {min_context})")
        result = []
        for label, key, c, _ in runs[1:]:
            v = times.get(label)
            if not v:
                continue
            med, moe, n = statistics.median(v), key == MOE, layers_of(key)
            d = (med - base_ms) * 1e3
            result.append(dict(candidate=label, shape=key if moe else list(key),
                               config=[list(m) for m in c] if moe else list(c),
                               kernel="fp4_mma" if moe else type(c).__name__,
                               ms=med, ms_range=[min(v), max(v)], rounds=len(v), delta_us_step=d, layers=n))
            print(f"  {label:<46} {med * 1e3:8.1f} us ({min(v) * 1e3:.1f}-{max(v) * 1e3:.1f}), {d:+6.1f} a step, "
                  f"{d / max(n, 1):+5.2f} a layer that runs it")
        rep.update(default_ms=base_ms, default_ms_all=base, candidates=result,
                   seen={str(names.get(s, s)): n for s, n in seen.items()})
        if a.out:
            Path(a.out).write_text(json.dumps(rep, indent=1, default=str) + "\n")

    rule.install()
    try:
        # the default rule's graphs, captured first so that the products a step runs are counted
        runs.append(("default", None, None, new_graphs()))
        if step_ms(eng, runs[0][3], 1) is None:
            raise RuntimeError("the default rule's decode graphs did not capture (see the warning above)")
        seen.update(rule.seen)
        only = {s.strip() for s in a.only.split(",") if s.strip()} or None
        cands = candidates(seen, names, only)[:max_candidates]
        for label, key, c in cands:
            if time.time() - bqm.START > a.capture_seconds:
                bqm.log(f"capture time spent: {len(runs) - 1} of {len(cands)} candidates captured")
                break
            if cuda and torch.cuda.mem_get_info()[0] < MIN_FREE_BYTES:
                bqm.log(f"GPU memory below {MIN_FREE_BYTES >> 30} GiB: {len(runs) - 1} of {len(cands)} captured")
                break
            rule.set(key, c)
            g = new_graphs()
            try:
                ok = step_ms(eng, g, 1) is not None              # capture (and compile) under this rule
            except (ValueError, RuntimeError) as e:             # a shape that cannot run here is reported
                bqm.log(f"{label}: {type(e).__name__}: {str(e)[:160]}")
                continue
            if not ok:
                bqm.log(f"{label}: its graphs did not capture; skipped")
                continue
            runs.append((label, key, c, g))
        for r in range(a.rounds):
            for label, key, c, g in runs:
                rule.set(key, c)
                ms = step_ms(eng, g, a.steps)
                if ms is not None:
                    times.setdefault(label, []).append(ms)
            rule.set(None, None)
            bqm.log(f"round {r + 1} of {a.rounds}")
            if r + 1 < a.rounds:
                report()       # what the rounds so far give, in case a later one fails
        rep["recaptured"] = [label for label, _, _, g in runs if g is not None and g.captures != 1]
        if rep["recaptured"]:
            bqm.log(f"captured more than once (another context bucket?): {rep['recaptured']}")
        report()
    finally:
        rule.uninstall()
        runner.cuda_graphs = default_graphs
        finish_all(eng, rids)
    return rep


if __name__ == "__main__":
    main()
