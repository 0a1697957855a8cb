"""Load generator for the HTTP server: random token-id prompts against ``/v1/completions``.

    python bench/bench_serving.py --port 30000 --num-prompts 64 --input-len 128 --output-len 32 \\
        --concurrency 16 --out bench/results/serving.json

Each request streams (``stream_options.include_usage``) with ``ignore_eos`` so it produces exactly
its output length. Arrivals are all at once (``--request-rate inf``, the default) or a Poisson
process of the given rate; ``--concurrency`` caps requests in flight. Reports request throughput,
input / output tokens per second, and time to first token (TTFT), time per output token after the
first (TPOT), inter-token latency (ITL) and end-to-end latency percentiles, as a table and JSON.

SGLang's own client works against the same server too (see docs/server.md):
``python -m sglang.bench_serving --backend sglang-oai --dataset-name random-ids ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx
from tqdm import tqdm


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int               # requested
    ok: bool = False
    error: str = ""
    completion_tokens: int = 0    # reported by the server's usage
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)   # gaps between streamed chunks after the first

    @property
    def tpot(self) -> Optional[float]:
        if self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


def make_prompts(n: int, input_len: int, output_len: int, range_ratio: float, vocab: tuple[int, int],
                 seed: int) -> list[tuple[list[int], int]]:
    """``n`` (token ids, output length) pairs; lengths uniform in [range_ratio * len, len]."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        out.append(([rng.randrange(*vocab) for _ in range(n_in)], n_out))
    return out


async def one_request(client: httpx.AsyncClient, model: str, ids: list[int], n_out: int) -> RequestResult:
    res = RequestResult(prompt_len=len(ids), output_len=n_out)
    body = {"model": model, "prompt": ids, "max_tokens": n_out, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.completion_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - t0
        res.ok = res.completion_tokens > 0
        if not res.ok:
            res.error = "no usage in the stream"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run(args: argparse.Namespace) -> dict:
    base = args.base_url or f"http://{args.host}:{args.port}"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, timeout=args.timeout, limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        prompts = make_prompts(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                               (args.vocab_low, args.vocab_high), args.seed)
        sem = asyncio.Semaphore(args.concurrency) if args.concurrency else None
        bar = tqdm(total=len(prompts), disable=args.disable_tqdm, desc="requests")
        rng = random.Random(args.seed + 1)

        async def limited(ids: list[int], n_out: int) -> RequestResult:
            if sem is None:
                r = await one_request(client, model, ids, n_out)
            else:
                async with sem:
                    r = await one_request(client, model, ids, n_out)
            bar.update(1)
            return r

        t0 = time.perf_counter()
        tasks = []
        for ids, n_out in prompts:
            tasks.append(asyncio.create_task(limited(ids, n_out)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    return summarize(results, duration, args, model, base)


def _pcts(xs: list[float]) -> dict[str, Optional[float]]:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(xs)

    def q(p: float) -> float:  # nearest-rank percentile
        return s[min(len(s) - 1, max(0, int(round(p / 100 * len(s) + 0.5)) - 1))]

    return {"mean": statistics.fmean(s), "p50": q(50), "p90": q(90), "p99": q(99)}


def summarize(results: list[RequestResult], duration: float, args: argparse.Namespace, model: str,
              base: str) -> dict:
    ok = [r for r in results if r.ok]
    in_tok = sum(r.prompt_len for r in ok)
    out_tok = sum(r.completion_tokens for r in ok)
    return {
        "config": {"base_url": base, "model": model, "num_prompts": args.num_prompts, "input_len": args.input_len,
                   "output_len": args.output_len, "range_ratio": args.range_ratio,
                   "concurrency": args.concurrency, "seed": args.seed,
                   "request_rate": args.request_rate if args.request_rate != float("inf") else "inf"},
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "input_tokens": in_tok,
        "output_tokens": out_tok,
        "request_throughput": len(ok) / duration,
        "input_tokens_per_s": in_tok / duration,
        "output_tokens_per_s": out_tok / duration,
        "ttft_s": _pcts([r.ttft for r in ok]),
        "tpot_s": _pcts([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": _pcts([g for r in ok for g in r.itl]),
        "e2e_s": _pcts([r.e2e for r in ok]),
    }


def table(s: dict) -> str:
    lines = [
        f"{'requests completed / failed':<34}{s['completed']} / {s['failed']}",
        f"{'duration (s)':<34}{s['duration_s']:.2f}",
        f"{'input / output tokens':<34}{s['input_tokens']} / {s['output_tokens']}",
        f"{'request throughput (req/s)':<34}{s['request_throughput']:.3f}",
        f"{'input tokens/s':<34}{s['input_tokens_per_s']:.1f}",
        f"{'output tokens/s':<34}{s['output_tokens_per_s']:.1f}",
        f"{'latency (ms)':<18}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        row = [s[key][k] for k in ("mean", "p50", "p90", "p99")]
        lines.append(f"{name:<18}" + "".join(f"{v * 1e3:>10.1f}" if v is not None else f"{'-':>10}" for v in row))
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--base-url", default=None, help="overrides --host/--port, e.g. http://10.0.0.2:30000")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=1.0,
                   help="lengths are drawn uniformly from [ratio * len, len] (1.0: fixed lengths)")
    p.add_argument("--concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in requests/s (default inf: all at once)")
    p.add_argument("--vocab-low", type=int, default=1000)
    p.add_argument("--vocab-high", type=int, default=100000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--out", default=None, help="write the summary JSON here")
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("--num-prompts, --input-len and --output-len must be >= 1")
    if not 0 < args.range_ratio <= 1:
        p.error("--range-ratio must be in (0, 1]")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    summary = asyncio.run(run(args))
    print(table(summary))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2))
        print(f"wrote {args.out}")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
