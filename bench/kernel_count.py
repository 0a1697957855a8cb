"""Kernels per layer of a decode step: how many launches each layer kind costs, and which.

A CUDA graph replays every kernel of the step back to back, each waiting for the one before, so
a step's gaps grow with the number of kernels, not with their work: this counts them. One decode
step runs eagerly (graphs off) under ``torch.profiler`` with a device synchronize at every range
boundary (``_bench_common._ProfiledRanges``, shared with ``KernelBreakdown``), and each GPU
kernel, copy and memset is charged to the innermost range whose host interval contains its GPU
interval: a layer's attention, its MoE, or
the layer itself (mHC mixes, the two block norms); outside the layers the embedding / head and the
backend's metadata. The graph replays the same kernels, so these are the graph's nodes per layer.

Off CUDA there are no kernels: the same ranges count the top-level torch ops instead, views and
other ops that launch nothing left out, so the tool's code path runs on the CPU; read those as ops.
``bench_long_context.py --kernel-count`` runs the same count inside its decode rows.

    # one H200: Flash's attention shapes, 8 routed experts, a 4K context at batch 1
    PYTHONUNBUFFERED=1 python3 bench/kernel_count.py --context 4096 --out $OUT/kernels.json
    # the code path on the CPU
    python bench/kernel_count.py --preset tiny --device cpu --context 300
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._bench_common import _ProfiledRanges, admit_synthetic, finish_all  # noqa: E402

KINDS = {0: "window-only", 4: "CSA", 128: "HCA"}
# torch ops that launch nothing (views, metadata): not counted on the CPU
NO_KERNEL_OPS = {"aten::" + n for n in ("view", "slice", "reshape", "unsqueeze", "squeeze", "select", "expand",
                                         "t", "flatten", "unflatten", "resolve_conj", "resolve_neg", "alias",
                                         "as_strided", "transpose", "permute", "unbind", "split", "chunk")}


class KernelCounter(_ProfiledRanges):
    """Kernels (CUDA) or top-level torch ops (CPU) of engine steps, per layer and part.

        with KernelCounter(engine) as kc:
            kc.step()               # one engine.step(), eager, profiled
        kc.per_kind()               # {kind: {"layers", "total", "attention", "moe", "mhc_norms"}}
    """

    def __init__(self, engine: Any):
        super().__init__(engine)
        self.cuda = self.device.type == "cuda"
        self.counts: Counter = Counter()          # range label -> kernels in it (innermost)
        self.names: dict[str, Counter] = {}       # range label -> kernel name -> count

    def _instrument(self) -> None:
        for i, block in enumerate(self.model.layers):
            self._module_hooks(block, f"layer.{i}")
            self._module_hooks(block.attn, f"layer.{i}.attention")
            self._module_hooks(block.ffn, f"layer.{i}.moe")
        self._wrap(self.runner, "forward", "forward")
        self._wrap(self.backend, "init_forward_metadata", "metadata")

    def _labels(self) -> set[str]:
        return ({f"layer.{i}{p}" for i in range(len(self.model.layers)) for p in ("", ".attention", ".moe")}
                | {"forward", "metadata"})

    def step(self) -> list[Any]:
        """One engine step, profiled; its kernels are added to ``counts`` / ``names``."""
        labels = self._labels()
        outs, events = self._profiled_step()
        ranges, items = [], []
        for ev in events:
            tr = ev.time_range
            if ev.name in labels and ev.device_type.name == "CPU":
                ranges.append((tr.end - tr.start, tr.start, tr.end, ev.name))
            elif self.cuda and ev.device_type.name == "CUDA" and ev.name not in labels:
                items.append((ev.name, tr.start, tr.end))
            elif not self.cuda and ev.name.startswith("aten::") and ev.name not in NO_KERNEL_OPS \
                    and ev.cpu_parent is not None and ev.cpu_parent.name in labels:
                items.append((ev.name, tr.start, tr.end))      # a top-level op of a range
        ranges.sort()                                           # innermost (shortest) first
        for name, a, b in items:
            label = next((lab for _, r0, r1, lab in ranges if r0 <= a and b <= r1), "outside")
            self.counts[label] += 1
            self.names.setdefault(label, Counter())[name] += 1
        return outs

    def layer(self, i: int) -> dict[str, int]:
        """Kernels of layer i by part; ``mhc_norms`` is what the layer runs outside its attention and MoE."""
        att, moe, rest = (self.counts[f"layer.{i}{p}"] for p in (".attention", ".moe", ""))
        return {"total": att + moe + rest, "attention": att, "moe": moe, "mhc_norms": rest}

    def per_kind(self) -> dict[str, dict[str, float]]:
        """Mean kernels per layer of each layer kind, by part (per profiled step)."""
        out: dict[str, dict[str, float]] = {}
        by_kind: dict[str, list[int]] = {}
        for i, block in enumerate(self.model.layers):
            by_kind.setdefault(KINDS[block.attn.ratio], []).append(i)
        for kind, ids in by_kind.items():
            rows = [self.layer(i) for i in ids]
            out[kind] = {"layers": len(ids)} | {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
        return out

    def outside_layers(self) -> dict[str, int]:
        return {"embedding + head": self.counts["forward"], "metadata": self.counts["metadata"],
                "outside the forward (sampling, copies)": self.counts["outside"]}

    def layer_kernels(self, i: int) -> dict[str, list[tuple[str, int]]]:
        """Layer i's kernel names with their counts, by part."""
        return {part: sorted(self.names.get(f"layer.{i}{p}", Counter()).items(), key=lambda kv: -kv[1])
                for part, p in (("attention", ".attention"), ("moe", ".moe"), ("mhc_norms", ""))}


def report(kc: KernelCounter, steps: int) -> dict[str, Any]:
    """The counts per step as a JSON-able dict (per kind, outside the layers, one layer of each kind named)."""
    what = "kernels" if kc.cuda else "top-level torch ops (CPU: no kernels)"
    per_kind = {k: {f: v / steps if f != "layers" else v for f, v in d.items()} for k, d in kc.per_kind().items()}
    first = {}
    for i, block in enumerate(kc.model.layers):
        first.setdefault(KINDS[block.attn.ratio], i)
    total = sum(kc.counts.values()) / steps
    return {"counted": what, "per_step_total": total, "per_kind": per_kind,
            "outside_layers": {k: v / steps for k, v in kc.outside_layers().items()},
            "named": {kind: {"layer": i, "kernels": kc.layer_kernels(i)} for kind, i in first.items()}}


def report_text(rep: dict[str, Any], names: bool = True) -> str:
    lines = [f"{rep['counted']} per decode step: {rep['per_step_total']:.0f}",
             f"  {'layer kind':<12} {'layers':>6} {'per layer':>10} {'attention':>10} {'MoE':>6} {'mHC+norms':>10}"]
    for kind, d in rep["per_kind"].items():
        lines.append(f"  {kind:<12} {d['layers']:>6} {d['total']:>10.0f} {d['attention']:>10.0f} {d['moe']:>6.0f} "
                     f"{d['mhc_norms']:>10.0f}")
    for k, v in rep["outside_layers"].items():
        lines.append(f"  {k:<40} {v:>6.0f}")
    if rep.get("host_syncs") is not None:
        syncs = rep["host_syncs"]
        lines.append(f"  host syncs per decode step: {sum(syncs.values()):.0f}"
                     + (" (" + ", ".join(f"{k} x{v:g}" for k, v in syncs.items()) + ")" if syncs else ""))
    if names:
        for kind, d in rep["named"].items():
            lines.append(f"  layer {d['layer']} ({kind}):")
            for part, rows in d["kernels"].items():
                lines.append(f"    {part}: " + ", ".join(f"{n[:60]} x{c}" for n, c in rows))
    return "\n".join(lines)


def count_syncs(engine: Any, steps: int) -> dict[str, int]:
    """Host synchronisations in ``steps`` engine steps, by the source line that asked for them
    (``torch.cuda.set_sync_debug_mode("warn")``: every synchronizing CUDA call warns). A decode
    step should have at most one: waiting for the sampled ids (an event after page-locked copies,
    ``sampling.PendingSample``; with the overlap schedule after the next step's launch). Empty off CUDA."""
    import traceback
    import warnings
    if engine.device.type != "cuda":
        return {}
    where: Counter = Counter()
    root = Path(__file__).resolve().parents[1]

    def record(message, category, filename, lineno, file=None, line=None):
        """Name the innermost line of this repository below the warning (a torch helper's own
        line, e.g. inside torch/cuda/__init__.py, says nothing about who asked). A sync whose
        innermost line is this counter's own is the counter's, not the step's: the H200 showed
        one such per process, on the first use of the debug mode, and it is not counted."""
        if "synchroniz" not in str(message):
            return
        for frame in reversed(traceback.extract_stack()[:-1]):
            path = Path(frame.filename).resolve()
            if root in path.parents and "site-packages" not in path.parts:
                if path.name != "kernel_count.py":
                    where[f"{path.name}:{frame.lineno}"] += 1
                return
        where[f"{Path(filename).name}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(where)


def syncs_per_step(engine: Any, steps: int) -> Optional[dict[str, float]]:
    """:func:`count_syncs` per step; None off CUDA (nothing to count)."""
    if engine.device.type != "cuda":
        return None
    return {k: v / steps for k, v in count_syncs(engine, steps).items()}


def count_decode_kernels(engine: Any, context: int, batch: int, steps: int = 1) -> dict[str, Any]:
    """Admit ``batch`` synthetic requests of ``context`` tokens, run one warm-up decode step,
    then count ``steps`` decode steps' kernels, then the host syncs of ``steps`` more (graphs on,
    if the engine has them); the requests are aborted afterwards."""
    rids = admit_synthetic(engine, context, batch, 2 * steps + 4)
    try:
        engine.step()
        with KernelCounter(engine) as kc:
            for _ in range(steps):
                kc.step()
        rep = report(kc, steps)
        rep["host_syncs"] = syncs_per_step(engine, steps)
        return rep
    finally:
        finish_all(engine, rids)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    from bench.bench_long_context import model_config, model_defaults
    from scheduler_hooks.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash", choices=["flash", "pro", "tiny"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    ap.add_argument("--experts", type=int, default=None, help="routed experts (default 8 for flash/pro)")
    ap.add_argument("--layers", type=int, default=None, help="first N layers only (default all)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    cuda = model_defaults(args)
    cfg = model_config(args)
    over: dict[str, Any] = {"n_routed_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok}
    if args.layers:
        over["num_hidden_layers"] = args.layers
        over["compress_ratios"] = cfg.compress_ratios[:args.layers] + cfg.mtp_ratios
    tokens = 4 * (args.context + 512) * args.batch
    eng = Engine(preset=args.preset, device=args.device, dtype=args.dtype, skip_tokenizer_init=True,
                 max_running_requests=args.batch, context_length=args.context + 512, max_total_tokens=tokens,
                 config_overrides=over, random_weights_on_device=cuda)
    try:
        rep = count_decode_kernels(eng, args.context, args.batch, args.steps)
    finally:
        eng.shutdown()
    rep["meta"] = {"preset": args.preset, "device": args.device, "dtype": args.dtype, "context": args.context,
                   "batch": args.batch, "layers": eng.config.num_hidden_layers, "backend": eng.runner.backend_name}
    print(report_text(rep))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rep, indent=2))
    return rep


if __name__ == "__main__":
    main()
