"""Churn: a bounded storm of mixed requests against a local server, then a check that nothing leaked.

    python bench/churn.py --launch --requests 10000                      # starts its own server
    python bench/churn.py --port 30000 --requests 2000                    # a server already running

Every request is drawn from a seeded mix: ``/v1/completions`` (token-id or text prompts),
``/v1/chat/completions`` and ``/generate``, streamed or not, with ``n`` up to 3, stop strings,
logprobs / top_logprobs; some streams are dropped after their first event and some
non-streamed requests are given up by the client after a few milliseconds (both abort
server-side); some bodies are invalid (bad values, a lone surrogate, deep JSON, broken JSON,
limits exceeded) and must be 4xx. Loopback only; it stops after ``--requests`` or
``--time-limit`` seconds, whichever comes first.

Printed: requests sent, answers by status, 5xx, client aborts, streams that ended without
``[DONE]`` (a cut connection), and, once the server is idle, the units still held in every
pool (``dsv4_pool_used`` from /metrics: the leaked slots). With ``--launch`` the server is then
sent SIGTERM and its exit code printed. Exit status 1 if any of 5xx, cut streams or leaks is
non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SERVER_FLAGS = ["--max-running-requests", "64", "--max-queued-requests", "256", "--context-length", "256",
                "--max-total-tokens", "16384", "--chunked-prefill-size", "512", "--log-level", "warning"]
WORDS = "the a of churn server token stream stop page pool request alpha beta gamma delta".split()
INVALID = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 1e-320}),
    ("/v1/completions", {"prompt": [5, 6], "top_k": 10 ** 12}),
    ("/v1/completions", {"prompt": [5, 6], "logprobs": 10 ** 6}),
    ("/generate", {"input_ids": [5, 6], "top_logprobs_num": -1, "stream": True}),
    ("/generate", {"input_ids": [5, 6], "sampling_params": {"stop": ["s"] * 1000}}),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 10 ** 9, "stream": True}),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    ("/v1/chat/completions", b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("/v1/completions", b'{"prompt": [1, 2'),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Tally:
    def __init__(self):
        self.status: collections.Counter = collections.Counter()
        self.sent = self.client_aborts = self.cut_streams = self.stream_errors = self.done_streams = 0
        self.transport_errors: collections.Counter = collections.Counter()


def draw(rng: random.Random, max_tokens: int) -> tuple[str, object, str]:
    """(path, body, how): how is 'plain', 'stream', 'drop' (leave after the first event) or 'giveup'."""
    if rng.random() < 0.10:
        path, body = rng.choice(INVALID)
        return path, body, "plain"
    stream = rng.random() < 0.5
    how = ("drop" if rng.random() < 0.2 else "stream") if stream else ("giveup" if rng.random() < 0.1 else "plain")
    n = rng.choice([1, 1, 1, 2, 3])
    common = {"max_tokens": rng.randint(1, max_tokens), "n": n, "stream": stream,
              "temperature": rng.choice([0, 0.7, 1.0]), "seed": rng.randrange(1000)}
    if rng.random() < 0.3:
        common["stop"] = rng.sample(WORDS, rng.randint(1, 3))
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
    kind = rng.random()
    if kind < 0.4:
        prompt = text if rng.random() < 0.5 else [rng.randrange(100, 120000) for _ in range(rng.randint(1, 60))]
        body = {"prompt": prompt, **common}
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 5)
        return "/v1/completions", body, how
    if kind < 0.8:
        body = {"messages": [{"role": "user", "content": text}], **common}
        if rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
        return "/v1/chat/completions", body, how
    sp = {"max_new_tokens": common["max_tokens"], "temperature": common["temperature"]}
    if "stop" in common:
        sp["stop"] = common["stop"]
    body = {"text": text, "sampling_params": sp, "stream": stream, "return_logprob": rng.random() < 0.3,
            "top_logprobs_num": rng.randint(0, 3)}
    return "/generate", body, how


async def one(c: httpx.AsyncClient, path: str, body, how: str, t: Tally) -> None:
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    t.sent += 1
    try:
        if how == "giveup":
            try:
                r = await c.post(path, timeout=0.05, **kw)
                t.status[r.status_code] += 1
            except httpx.TimeoutException:
                t.client_aborts += 1
            return
        async with c.stream("POST", path, **kw) as r:
            t.status[r.status_code] += 1
            if r.status_code != 200 or not r.headers.get("content-type", "").startswith("text/event-stream"):
                await r.aread()
                return
            last = None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if how == "drop":
                    t.client_aborts += 1
                    return
                last = line[6:]
                if '"error"' in last and last.startswith('{"error"'):
                    t.stream_errors += 1
            if last == "[DONE]":
                t.done_streams += 1
            else:
                t.cut_streams += 1
    except httpx.HTTPError as e:
        t.transport_errors[type(e).__name__] += 1


async def churn(url: str, requests: int, concurrency: int, max_tokens: int, seed: int, time_limit: float) -> Tally:
    rng = random.Random(seed)
    t = Tally()
    deadline = time.monotonic() + time_limit
    jobs = iter([draw(rng, max_tokens) for _ in range(requests)])
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        async def worker():
            for path, body, how in jobs:
                if time.monotonic() > deadline:
                    return
                await one(c, path, body, how, t)
        await asyncio.gather(*[worker() for _ in range(concurrency)])
    return t


def pool_use(url: str, timeout: float = 60) -> tuple[dict[str, float], float, float]:
    """({pool: used}, running, waiting) once idle (or after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        m = {}
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                m[k] = float(v)
        used = {k[len('dsv4_pool_used{pool="'):-2]: v for k, v in m.items() if k.startswith("dsv4_pool_used{")}
        running, waiting = m["dsv4_num_running_reqs"], m["dsv4_num_waiting_reqs"]
        if (running == waiting == 0 and not any(used.values())) or time.monotonic() > deadline:
            return used, running, waiting
        time.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", choices=["127.0.0.1", "localhost"], help="loopback only")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--launch", action="store_true", help="start python server.py on a free port, SIGTERM it after")
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=3000.0, help="stop sending after this many seconds")
    args = p.parse_args()

    proc = None
    port = free_port() if args.launch else args.port
    url = f"http://{args.host}:{port}"
    if args.launch:
        proc = subprocess.Popen([sys.executable, "server.py", "--port", str(port), *SERVER_FLAGS], cwd=ROOT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            proc.kill()
            raise SystemExit("the server did not come up in 180 s")
    try:
        t0 = time.monotonic()
        t = asyncio.run(churn(url, args.requests, args.concurrency, args.max_tokens, args.seed, args.time_limit))
        elapsed = time.monotonic() - t0
        used, running, waiting = pool_use(url)
    finally:
        exit_code = None
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            exit_code = proc.wait(timeout=120)
    five_xx = sum(v for k, v in t.status.items() if k >= 500)
    leaked = sum(used.values())
    report = {"requests": t.sent, "seconds": round(elapsed, 1), "status": dict(sorted(t.status.items())),
              "5xx": five_xx, "client_aborts": t.client_aborts, "streams_done": t.done_streams,
              "stream_error_events": t.stream_errors, "cut_streams": t.cut_streams,
              "transport_errors": dict(t.transport_errors), "running_after": running, "waiting_after": waiting,
              "leaked_pool_units": leaked, "pool_used_after": used, "server_exit_code": exit_code}
    print(json.dumps(report, indent=1))
    bad = five_xx or t.cut_streams or leaked or running or waiting or t.transport_errors or exit_code not in (None, 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
