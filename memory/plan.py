"""``python -m memory.plan``: print how a KV budget splits across the DeepSeek-V4 pools.

    python -m memory.plan --preset flash --budget-gb 100
    python -m memory.plan --preset pro --gpu-mem-gb 140 --mem-fraction 0.88 --weights-gb 80 --json
    python -m memory.plan --config path/to/config.json --speculative --plot split.png
    python -m memory.plan --model-path /models/DeepSeek-V4-Flash --gpu-mem-gb 139
    python -m memory.plan --preset flash --gpu-mem-gb 139 --tp-size 8 --ep-size 8
    python -m memory.plan --preset flash --enable-hisparse --hisparse-config '{"host_to_device_ratio": 4}' \
        --context-len 1048576

``--enable-hisparse`` (with SGLang's ``--hisparse-config`` JSON) keeps 1 / host_to_device_ratio
of the C4 rows on the device and all of them in host memory: the table then lists each pool's
device and host bytes, and ``--context-len N`` adds how many requests of N tokens fit.

``--model-path DIR`` reads the checkpoint's config.json and counts its weights as the server
keeps them on the GPU (bf16, an FP8 release kept quantised: its real e4m3 / e2m1 bytes plus
scales, ``wo_a`` included, MTP not loaded), from the safetensors headers alone.

``--tp-size`` / ``--ep-size``: the plan is one rank's (every rank holds the same pools), with that
rank's share of the weights (``dsv4_backend.parallel``'s split, unless ``--weights-gb`` gives it).

Sizes are GiB (2^30 bytes). The budget is ``--budget-gb``, or ``gpu_mem * mem_fraction - weights``
(SGLang's static fraction covers weights and KV). The env flags
(``SGLANG_DSV4_COMPRESS_STATE_DTYPE``, ``SGLANG_OPT_USE_ONLINE_COMPRESS``) apply.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from memory.configurator import (CONTEXT_1M, CONTEXT_128K, GIB, KV_ROW_BYTES, TERM_NAMES, DSV4PoolConfigurator,
                                 PlanError, PoolPlan)

DEFAULT_BUDGET_GB = 100.0
DEFAULT_MEM_FRACTION = 0.88


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m memory.plan", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=("flash", "pro", "tiny"), help="a built-in model shape")
    src.add_argument("--config", metavar="PATH", help="a Hugging Face config.json (or its directory)")
    src.add_argument("--model-path", metavar="DIR", help="a checkpoint directory: its config and its weights' "
                     "size as loaded (with --gpu-mem-gb, instead of --weights-gb)")
    p.add_argument("--budget-gb", type=float, help=f"KV budget in GiB (default {DEFAULT_BUDGET_GB:g} "
                   "unless --gpu-mem-gb is given)")
    p.add_argument("--gpu-mem-gb", type=float, help="GPU memory in GiB; budget = gpu_mem * mem_fraction - weights")
    p.add_argument("--mem-fraction", type=float, default=DEFAULT_MEM_FRACTION,
                   help="static memory fraction (weights + KV), with --gpu-mem-gb")
    p.add_argument("--weights-gb", type=float, default=None,
                   help="weights in GiB, with --gpu-mem-gb (default 0, or the checkpoint's with --model-path)")
    p.add_argument("--tp-size", type=int, default=None, help="tensor parallel ranks: plan one rank (its weights)")
    p.add_argument("--ep-size", type=int, default=None, help="expert parallel ranks: plan one rank (its weights)")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--swa-ratio", type=float, default=0.1, help="SWA tokens per full token")
    p.add_argument("--speculative", action="store_true", help="MTP speculative decoding (doubles the rings)")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=4, metavar="N",
                   help="with --speculative: draft tokens per verify (K + 1; default 4); with "
                        "SGLANG_OPT_USE_ONLINE_COMPRESS=1 each request keeps 1 + N online states")
    p.add_argument("--hisparse-ratio", type=float, default=1.0,
                   help="HiSparse host-to-device ratio: keep 1/K of the C4 rows on the GPU")
    p.add_argument("--enable-hisparse", action="store_true",
                   help="HiSparse: C4 rows in host memory, a device hot pool (ratio from --hisparse-config)")
    p.add_argument("--hisparse-config", default=None,
                   help='SGLang\'s JSON: {"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 2}')
    p.add_argument("--context-len", type=int, action="append", default=[], metavar="N",
                   help="also print how many requests of N tokens fit (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="draw the per-request split at 128K and 1M tokens")
    return p


def shrink_factor(args: argparse.Namespace) -> float:
    """The C4 host-to-device ratio the flags give (1: no HiSparse)."""
    if not args.enable_hisparse:
        if args.hisparse_config is not None:
            raise PlanError("--hisparse-config needs --enable-hisparse")
        return args.hisparse_ratio
    if args.hisparse_ratio != 1.0:
        raise PlanError("give the ratio once: --hisparse-config '{\"host_to_device_ratio\": K}' with "
                        "--enable-hisparse, or --hisparse-ratio K alone")
    from memory.hisparse import HiSparseConfig
    return HiSparseConfig.parse(args.hisparse_config).host_to_device_ratio


def pool_bytes_table(plan: PoolPlan) -> str:
    """Per pool kind, the bytes on the device and in host memory (HiSparse's C4 host pool)."""
    host = {kind: s.bytes for kind, s in plan.host_pool_shapes().items()}
    lines = [f"  {'pool':<16} {'device GiB':>12} {'host GiB':>12}"]
    for kind, n in plan.pool_bytes().items():
        lines.append(f"  {kind:<16} {n / GIB:>12.3f} {host.get(kind, 0) / GIB:>12.3f}")
    lines.append(f"  {'total':<16} {plan.total_bytes / GIB:>12.3f} {plan.host_bytes / GIB:>12.3f}")
    return "\n".join(lines)


def budget_bytes(args: argparse.Namespace) -> int:
    """The KV budget the flags describe, in bytes."""
    if args.gpu_mem_gb is not None:
        if args.budget_gb is not None:
            raise PlanError("give either --budget-gb or --gpu-mem-gb (with --mem-fraction / --weights-gb), not both")
        weights_gb = args.weights_gb or 0.0
        gb = args.gpu_mem_gb * args.mem_fraction - weights_gb
        if gb <= 0:
            raise PlanError(f"--gpu-mem-gb {args.gpu_mem_gb:g} x --mem-fraction {args.mem_fraction:g} leaves nothing "
                            f"after {weights_gb:g} GiB of weights; raise the fraction or the GPU memory")
        return int(gb * GIB)
    return int((DEFAULT_BUDGET_GB if args.budget_gb is None else args.budget_gb) * GIB)


def per_request_split(plan: PoolPlan, context_len: int) -> dict[str, float]:
    """Bytes one request of ``context_len`` tokens is charged, by term (plus its C128 state)."""
    split = {name: plan.per_token_terms[name] * context_len for name in TERM_NAMES}
    # The request-scoped reservation, shared evenly over the request slots.
    split["c128_state_ring"] += plan.fixed_bytes / plan.max_running_requests
    return split


def plot(plan: PoolPlan, path: str) -> None:
    """Stacked bars of the per-request split at 128K and 1M tokens, beside the dense per-token KV."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 5))
    colors = plt.get_cmap("tab10").colors
    for ax, (label, n) in zip(axes, (("128K tokens", CONTEXT_128K), ("1M tokens", CONTEXT_1M))):
        split = per_request_split(plan, n)
        bottom = 0.0
        for i, name in enumerate(TERM_NAMES):
            gib = split[name] / GIB
            ax.bar(0, gib, bottom=bottom, color=colors[i], label=name if ax is axes[0] else None)
            bottom += gib
        ax.text(0, bottom, f"{bottom:.2f}", ha="center", va="bottom")
        dense = KV_ROW_BYTES * plan.num_layers * n / GIB
        ax.bar(1, dense, color="0.6", label="dense per-token KV (584 B x L)" if ax is axes[0] else None)
        ax.text(1, dense, f"{dense:.2f}", ha="center", va="bottom")
        ax.set_xticks([0, 1], ["DSV4 pools", "dense KV"])
        ax.set_title(label)
        ax.set_ylabel("GiB per request")
    fig.suptitle(f"Pool bytes the budget split charges one request ({plan.num_layers} layers, state {plan.to_dict()['state_dtype']}, "
                 f"swa_ratio {plan.swa_ratio:g})")
    fig.legend(loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def checkpoint_weights(model_path: str):
    """A checkpoint's config and the device bytes of its weights as the server loads them (bf16,
    an FP8 release kept quantised, no MTP), from the headers alone."""
    import torch

    from dsv4_backend.checkpoint import CheckpointReader
    from dsv4_backend.config import DSV4Config

    fp8 = DSV4Config.from_json(Path(model_path) / "config.json").quantization == "fp8"
    reader = CheckpointReader(model_path, dtype=torch.bfloat16, include_mtp=False, keep_quantized=fp8)
    return reader.config, reader.nbytes


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # The one place memory/ imports dsv4_backend (with checkpoint_weights): resolving
    # --preset / --config / --model-path for this CLI.
    from dsv4_backend.config import DSV4Config

    weights_bytes = None
    try:
        if args.model_path:
            model, weights_bytes = checkpoint_weights(args.model_path)
            if args.weights_gb is None:
                args.weights_gb = weights_bytes / GIB
        elif args.preset:
            model = DSV4Config.preset(args.preset)
        else:
            model = DSV4Config.from_json(args.config)
        if args.tp_size is not None or args.ep_size is not None:
            from dsv4_backend.parallel import rank_weight_bytes
            weights_bytes = rank_weight_bytes(model, args.tp_size or 1, args.ep_size or 1)
            if args.weights_gb is None or args.model_path:
                args.weights_gb = weights_bytes / GIB
        configurator = DSV4PoolConfigurator(
            model, max_running_requests=args.max_running_requests, swa_ratio=args.swa_ratio,
            speculative=args.speculative, c4_shrink_factor=shrink_factor(args),
            draft_tokens=args.speculative_num_draft_tokens if args.speculative else 0)
        plan = configurator.plan_for_budget(budget_bytes(args))
    except (ValueError, OSError) as e:  # PlanError, a bad env flag, a config that is not DSV4's, a bad path
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        d = plan.to_dict()
        if weights_bytes is not None:
            d["weights_bytes"] = weights_bytes
        if args.context_len:
            d["requests_fit"].update({str(n): plan.requests_fit(n) for n in args.context_len})
        print(json.dumps(d, indent=2))
    else:
        if weights_bytes is not None:
            where = f"per rank (tp {args.tp_size or 1}, ep {args.ep_size or 1})" if args.tp_size or args.ep_size \
                else f"as loaded from {args.model_path}"
            print(f"weights: {weights_bytes / GIB:.3f} GiB {where}")
        print(plan.table())
        if plan.hisparse:
            print(pool_bytes_table(plan))
        for n in args.context_len:
            print(f"  requests of {n:,} tokens that fit: {plan.requests_fit(n):,}")
    if args.plot:
        plot(plan, args.plot)
        if not args.json:
            print(f"  plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
