"""The OpenAI-compatible HTTP server: ``python server.py`` / ``dsv4-serve`` / ``make serve``.

FastAPI + uvicorn over the offline ``Engine`` (scheduler_hooks/engine.py), which runs the
scheduler in its own thread. Each request gets an ``asyncio.Queue``; the engine's per-step
callback hands ``RequestOutput`` objects to the event loop with ``call_soon_threadsafe``, so
tokens leave as Server-Sent Events the moment a step decodes them.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text), ``POST /generate`` (SGLang's native shape),
plus ``GET /model_info`` and ``GET /server_info`` (also under SGLang's older ``/get_*`` names)
for SGLang tooling.
Errors follow OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (serving_protocol.py):
400 for an invalid parameter or a limit exceeded, 404 for an unknown model, 503 with
``Retry-After`` when the queue is full or the server is shutting down. Every refusal comes
before the first byte, streamed or not (a stream's requests are submitted before its response
starts); a failure after that ends the stream with an error event, a ``finish_reason`` and
``[DONE]``. A client that disconnects aborts its requests, which frees their pages. SIGTERM
drains: admission stops (503), running requests get ``--graceful-shutdown-timeout`` seconds to
finish, the rest are ended with an error event, the pools are freed and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Histogram, generate_latest, CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv4_backend.encoding import EncodingError, encode_messages, parse_message_from_completion_text
from dsv4_backend.encoding import EOS, THINK_END, TOOL_CALLS_START
from memory.hisparse import HiSparseConfig
from scheduler_hooks.io import EngineOverloaded, GenerateRequest, InvalidRequest, RequestOutput, SamplingParams
from scheduler_hooks.speculative import SpeculativeConfig
from serving_protocol import (SSE_DONE, APIError, ChatCompletionRequest, CompletionRequest, GenerateReqInput,
                              RequestLimits, SamplingFields, add_request_bodies, bad_request, read_body, sse,
                              validation_error)

logger = logging.getLogger("dsv4.server")

RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.5
SEED_LIMIT = 2 ** 63        # torch generators take 64-bit seeds
SHUTDOWN_ERROR = "the server is shutting down"
STREAM_END_GRACE_S = 5.0    # after ending the requests at shutdown: time for their streams to close


# ---- configuration ------------------------------------------------------------------------------

SPECULATIVE_FLAGS = ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                     "speculative_num_draft_tokens")


@dataclass(frozen=True)
class ServerArgs:
    """Launch flags (SGLang's names). Engine fields pass through to ``Engine(...)`` unchanged."""

    model_path: Optional[str] = None
    preset: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "cpu"
    dtype: str = "auto"
    served_model_name: Optional[str] = None
    max_running_requests: Optional[int] = None
    max_queued_requests: Optional[int] = None
    max_total_tokens: Optional[int] = None
    mem_fraction_static: Optional[float] = None
    context_length: Optional[int] = None
    chunked_prefill_size: Optional[int] = None
    mixed_chunk_tokens: Optional[int] = None
    random_seed: int = 0
    json_model_override_args: Optional[str] = None
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: Optional[int] = None
    attention_kernel: str = "auto"
    enable_hisparse: bool = False
    hisparse_config: Optional[str] = None
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    speculative_algorithm: Optional[str] = None
    speculative_num_steps: Optional[int] = None
    speculative_eagle_topk: Optional[int] = None
    speculative_num_draft_tokens: Optional[int] = None
    tp_size: int = 1
    ep_size: int = 1
    log_level: str = "info"
    # limits on one request (serving_protocol.RequestLimits; None: derived from the model)
    max_request_bytes: int = 32 * 2 ** 20
    max_json_depth: int = 64
    max_prompt_chars: Optional[int] = None      # None: the token limit x the longest token's length
    max_stop_strings: int = 16
    max_top_logprobs: int = 20
    max_top_k: Optional[int] = None             # None: the vocabulary size
    graceful_shutdown_timeout: float = 30.0

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model_path:
            return self.model_path
        return f"deepseek-v4-{self.preset}"

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``Engine``; unset optional flags keep the engine's defaults."""
        dtype = self.dtype if self.dtype != "auto" else ("float32" if self.device == "cpu" else "bfloat16")
        kw: dict[str, Any] = dict(model_path=self.model_path, preset=self.preset, device=self.device,
                                  dtype=dtype, random_seed=self.random_seed)
        for name in ("max_running_requests", "max_queued_requests", "max_total_tokens",
                     "mem_fraction_static", "context_length", "chunked_prefill_size", "mixed_chunk_tokens"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if self.json_model_override_args:
            kw["config_overrides"] = json.loads(self.json_model_override_args)
        if self.disable_cuda_graph:
            kw["cuda_graph"] = False
        if self.cuda_graph_max_bs is not None:
            kw["cuda_graph_max_bs"] = self.cuda_graph_max_bs
        if self.attention_kernel != "auto":
            kw["attention_kernel"] = self.attention_kernel
        if self.enable_hisparse:
            kw["enable_hisparse"] = True
            kw["hisparse_config"] = self.hisparse_config
        if self.disable_radix_cache:
            kw["disable_radix_cache"] = True
        if self.disable_overlap_schedule:
            kw["disable_overlap_schedule"] = True
        for name in SPECULATIVE_FLAGS:
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        if self.tp_size != 1 or self.ep_size != 1:
            kw.update(tp_size=self.tp_size, ep_size=self.ep_size)
        if self.model_path is None and self.device != "cpu":
            kw["random_weights_on_device"] = True  # a Flash-shaped preset draws ~30 GB: on the GPU, in seconds
        return kw


def parse_args(argv: Optional[list[str]] = None) -> ServerArgs:
    d = ServerArgs()
    p = argparse.ArgumentParser(description="Serve DeepSeek-V4 over an OpenAI-compatible HTTP API.")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model-path", default=d.model_path,
                       help="checkpoint directory (config.json, safetensors, tokenizer.json)")
    model.add_argument("--preset", default=d.preset, choices=["tiny", "flash", "pro"],
                       help="built-in shape with seeded random weights (default: tiny)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--device", default=d.device, help="cpu or cuda")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float64"],
                   help="activation dtype (auto: float32 on the CPU, bfloat16 on a GPU)")
    p.add_argument("--served-model-name", default=d.served_model_name)
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    p.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="requests beyond this many waiting are refused with 503")
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--mem-fraction-static", type=float, default=d.mem_fraction_static)
    mem.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens)
    p.add_argument("--context-length", type=int, default=d.context_length)
    p.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size)
    p.add_argument("--mixed-chunk-tokens", type=int, default=d.mixed_chunk_tokens,
                   help="prefill tokens per step while requests decode (default 512; 0: the whole "
                        "--chunked-prefill-size): smaller keeps their time per token low, larger a long prompt's TTFT")
    p.add_argument("--random-seed", type=int, default=d.random_seed)
    p.add_argument("--json-model-override-args", default=d.json_model_override_args,
                   help='JSON object of config.json keys that replace a --preset\'s values, e.g. '
                        '\'{"n_routed_experts": 8}\' for a Flash-shaped model that fits one GPU')
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="replay no decode step from a CUDA graph (on CUDA they are on by default)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=d.cuda_graph_max_bs,
                   help="largest decode batch replayed from a graph (default: --max-running-requests)")
    p.add_argument("--attention-kernel", default=d.attention_kernel, choices=["auto", "flashmla", "triton"],
                   help="GPU sparse attention: auto = FlashMLA on sm90/sm100 where flash_mla imports, else Triton")
    p.add_argument("--enable-hisparse", action="store_true",
                   help="C4 rows in host memory, a device hot pool, the top-k swapped in (HiSparse)")
    p.add_argument("--hisparse-config", default=d.hisparse_config,
                   help='JSON: {"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 2} (the defaults)')
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="turn the prefix cache off (every request is prefilled from its first token)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="read every step's sampled ids before scheduling the next (by default the next "
                        "step is launched first)")
    spec = p.add_argument_group("speculative decoding (the MTP layer drafts; chain, top-1)")
    spec.add_argument("--speculative-algorithm", default=d.speculative_algorithm,
                      help="EAGLE (NEXTN is an alias): draft with the MTP layer, verify in one step")
    spec.add_argument("--speculative-num-steps", type=int, default=d.speculative_num_steps,
                      help="K, draft tokens per step (default 3)")
    spec.add_argument("--speculative-eagle-topk", type=int, default=d.speculative_eagle_topk,
                      help="drafts per step kept per position: only 1 (a chain)")
    spec.add_argument("--speculative-num-draft-tokens", type=int, default=d.speculative_num_draft_tokens,
                      help="rows verified per request and step: K + 1")
    p.add_argument("--tp-size", type=int, default=d.tp_size,
                   help="tensor parallel ranks (attention heads, vocabulary; one process per GPU)")
    p.add_argument("--ep-size", type=int, default=d.ep_size,
                   help="expert parallel ranks (routed experts; 1 or --tp-size, or alone)")
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    lim = p.add_argument_group("limits on one request (each refusal is a 400 naming the field)")
    lim.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                     help="largest request body; larger ones get 413 before they are read")
    lim.add_argument("--max-json-depth", type=int, default=d.max_json_depth,
                     help="deepest nesting of the JSON body (the body object is level 1)")
    lim.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars,
                     help="longest prompt text, checked before tokenizing (default: the context length "
                          "times the longest token, so only text that cannot fit is refused)")
    lim.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings,
                     help="most entries in stop, and in stop_token_ids")
    lim.add_argument("--max-top-logprobs", type=int, default=d.max_top_logprobs,
                     help="largest top_logprobs / logprobs / top_logprobs_num")
    lim.add_argument("--max-top-k", type=int, default=d.max_top_k,
                     help="largest top_k (default: the vocabulary size)")
    p.add_argument("--graceful-shutdown-timeout", type=float, default=d.graceful_shutdown_timeout,
                   help="on SIGTERM: seconds running requests may take to finish before they are ended")
    ns = p.parse_args(argv)
    for name in ("max_request_bytes", "max_json_depth", "max_prompt_chars", "max_stop_strings", "max_top_k"):
        value = getattr(ns, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if ns.max_top_logprobs < 0 or ns.graceful_shutdown_timeout < 0:
        p.error("--max-top-logprobs and --graceful-shutdown-timeout must be >= 0")
    if ns.hisparse_config is not None:
        if not ns.enable_hisparse:
            p.error("--hisparse-config needs --enable-hisparse")
        try:
            HiSparseConfig.parse(ns.hisparse_config)
        except ValueError as e:
            p.error(f"--hisparse-config: {e}")
    try:
        SpeculativeConfig.from_flags(*(getattr(ns, name) for name in SPECULATIVE_FLAGS))
    except ValueError as e:
        p.error(str(e))
    if ns.json_model_override_args is not None:
        try:
            overrides = json.loads(ns.json_model_override_args)
        except json.JSONDecodeError as e:
            p.error(f"--json-model-override-args is not valid JSON: {e}")
        if not isinstance(overrides, dict):
            p.error("--json-model-override-args must be a JSON object of config keys")
        if ns.model_path is not None:
            p.error("--json-model-override-args applies to --preset models, not to a checkpoint")
    return ServerArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerArgs)})


# ---- the bridge from the engine thread to asyncio -------------------------------------------------


class EngineBridge:
    """Submits requests and delivers their outputs into one asyncio.Queue as ``(index, output)``."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.loop = loop

    def submit(self, reqs: list[GenerateRequest]) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        submitted: list[str] = []
        try:
            for index, req in enumerate(reqs):
                self.engine.submit(req, self._callback(queue, index))
                submitted.append(req.rid)
        except BaseException as e:
            for rid in submitted:
                self.engine.abort(rid)
            raise self._translate(e) from e
        return queue

    def _callback(self, queue: asyncio.Queue, index: int) -> Callable[[RequestOutput], None]:
        def deliver(out: RequestOutput) -> None:
            try:
                self.loop.call_soon_threadsafe(queue.put_nowait, (index, out))
            except RuntimeError:
                pass  # the loop is closed: the server is shutting down
        return deliver

    def _translate(self, e: BaseException) -> BaseException:
        if isinstance(e, InvalidRequest):
            return bad_request(str(e), _OPENAI_PARAM.get(e.param or "", e.param))
        if isinstance(e, EngineOverloaded):
            retry = max(1, round(getattr(e, "retry_after_s", RETRY_AFTER_S)))
            return APIError(503, f"the server is overloaded: {e}", type="server_overloaded",
                            code="queue_full", headers={"Retry-After": str(retry)})
        return e

    def abort(self, rids: Iterable[str], error: Optional[str] = None) -> None:
        """Abort ``rids``; with ``error`` their final outputs carry it (the server ended them)."""
        for rid in rids:
            try:
                self.engine.abort(rid, error)
            except Exception:  # aborting a request that just finished is harmless
                logger.debug("abort(%s) failed", rid, exc_info=True)


# Engine (SGLang) parameter names -> the OpenAI field a client sent.
_OPENAI_PARAM = {"max_new_tokens": "max_tokens", "input_ids": "prompt", "top_logprobs_num": "top_logprobs"}


# ---- metrics -------------------------------------------------------------------------------------


class ServerMetrics:
    """Prometheus metrics: histograms observed here, engine gauges/counters read at scrape time."""

    def __init__(self, engine: Any):
        self.registry = CollectorRegistry()
        buckets_ttft = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        buckets_tpot = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
        self.ttft = Histogram("dsv4_time_to_first_token_seconds", "Time to first token.",
                              buckets=buckets_ttft, registry=self.registry)
        self.tpot = Histogram("dsv4_time_per_output_token_seconds", "Time per output token after the first.",
                              buckets=buckets_tpot, registry=self.registry)
        self.e2e = Histogram("dsv4_e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=buckets_ttft, registry=self.registry)
        self.registry.register(_EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Reads ``engine.stats()`` on every scrape: queue sizes, token counters, per-pool use."""

    def __init__(self, engine: Any):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        yield GaugeMetricFamily("dsv4_num_running_reqs", "Requests in the running batch.", value=s.get("num_running", 0))
        yield GaugeMetricFamily("dsv4_num_waiting_reqs", "Requests waiting in the queue.", value=s.get("num_waiting", 0))
        for key, name, doc in (("prompt_tokens", "dsv4_prompt_tokens", "Prompt tokens processed."),
                               ("generation_tokens", "dsv4_generation_tokens", "Tokens generated.")):
            value = _find_stat(s, key)
            if value is not None:
                yield CounterMetricFamily(name, doc, value=value)
        used = GaugeMetricFamily("dsv4_pool_used", "Used units of each pool (rows, pages or slots).", labels=["pool"])
        total = GaugeMetricFamily("dsv4_pool_total", "Capacity of each pool.", labels=["pool"])
        usage = GaugeMetricFamily("dsv4_pool_usage", "Used fraction of each pool.", labels=["pool"])
        for pool, (u, t) in sorted(pool_usage(s).items()):
            used.add_metric([pool], u)
            total.add_metric([pool], t)
            usage.add_metric([pool], u / t if t else 0.0)
        yield used
        yield total
        yield usage
        cached = GaugeMetricFamily("dsv4_pool_cached", "Units of each pool only the prefix cache holds "
                                   "(given back under pressure).", labels=["pool"])
        for pool, v in sorted((s.get("pools") or {}).items()):
            if isinstance(v, dict) and "cached" in v:
                cached.add_metric([pool], v["cached"])
        yield cached
        pc = s.get("prefix_cache")
        if isinstance(pc, dict):
            yield GaugeMetricFamily("dsv4_cache_hit_rate", "Prompt tokens served from the prefix cache / "
                                    "prompt tokens looked up.", value=pc["hit_rate"])
            yield CounterMetricFamily("dsv4_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
                                      value=pc["hit_tokens"])
            yield GaugeMetricFamily("dsv4_cache_restore_points", "Prefix-cache nodes a request can start at.",
                                    value=pc["restore_points"])
        if isinstance(s.get("speculative"), dict):
            yield from _speculative_metrics(s["speculative"])


def _speculative_metrics(spec: dict[str, Any]):
    """Accepted length per verify (accepted drafts + 1): its mean and its histogram."""
    yield GaugeMetricFamily("dsv4_spec_accept_length", "Mean accepted length per speculative verify.",
                            value=spec["accept_length_mean"])
    hist = sorted((int(k), v) for k, v in spec["accept_length_histogram"].items())
    buckets, cum = [], 0
    for length, count in hist:
        cum += count
        buckets.append((str(length), cum))
    buckets.append(("+Inf", cum))
    total = sum(length * count for length, count in hist)
    yield HistogramMetricFamily("dsv4_spec_accept_length_per_step", "Accepted length of each speculative verify.",
                                buckets=buckets, sum_value=total)
    yield CounterMetricFamily("dsv4_spec_verify_steps", "Speculative verifies (request-steps with drafts).",
                              value=spec["num_verify"])


def _find_stat(stats: dict[str, Any], key: str) -> Optional[float]:
    """A cumulative counter under any of the spellings an engine may use."""
    for k in (key, f"{key}_total", f"cumulative_{key}", f"num_{key}"):
        v = stats.get(k)
        if isinstance(v, (int, float)):
            return float(v)
    return None


def pool_usage(stats: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """``{pool: (used, total)}`` from engine stats: a ``pools`` mapping or flat ``<pool>_used`` keys."""
    out: dict[str, tuple[float, float]] = {}
    pools = stats.get("pools")
    if isinstance(pools, dict):
        for name, v in pools.items():
            if isinstance(v, dict) and "used" in v and "total" in v:
                out[str(name)] = (float(v["used"]), float(v["total"]))
            elif isinstance(v, (tuple, list)) and len(v) == 2:
                out[str(name)] = (float(v[0]), float(v[1]))
    for k, v in stats.items():
        if k.endswith("_used") and isinstance(v, (int, float)):
            name = k[: -len("_used")]
            t = stats.get(f"{name}_total")
            if isinstance(t, (int, float)):
                out.setdefault(name, (float(v), float(t)))
    return out


# ---- response building (pure functions) -----------------------------------------------------------


def _now() -> int:
    return int(time.time())


def finish_reason_of(out: RequestOutput) -> Optional[str]:
    fr = out.finish_reason
    if not out.finished:
        return None
    kind = fr.get("type") if isinstance(fr, dict) else fr
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(kind, "stop") if kind else "stop"


def _token_text(tokenizer: Any, token_id: int, text: Optional[str]) -> str:
    if text is not None:
        return text
    return tokenizer.decode([token_id], skip_special_tokens=False)


def new_entries(entries: Optional[list], total_len: int, delta_len: int) -> list:
    """The entries this step added, whether the engine reports them cumulatively or per step."""
    if not entries:
        return []
    if len(entries) >= total_len and total_len > 0:
        return entries[total_len - delta_len: total_len]
    return entries[-delta_len:] if delta_len else []


def chat_logprob_items(tokenizer: Any, entries: list, tops: Optional[list], n_top: int) -> list[dict[str, Any]]:
    """OpenAI chat ``logprobs.content`` items for output tokens."""
    items = []
    for k, (lp, tid, text) in enumerate(entries):
        tok = _token_text(tokenizer, tid, text)
        top = (tops[k] if tops and k < len(tops) and tops[k] else [])[:n_top]
        items.append({
            "token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")),
            "top_logprobs": [{"token": (t := _token_text(tokenizer, i, s)), "logprob": l,
                              "bytes": list(t.encode("utf-8"))} for l, i, s in top],
        })
    return items


def completion_logprobs(tokenizer: Any, entries: list, tops: Optional[list], text_offset0: int) -> dict[str, Any]:
    """OpenAI completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, lps, top_lps, offsets = [], [], [], []
    offset = text_offset0
    for k, (lp, tid, text) in enumerate(entries):
        tok = _token_text(tokenizer, tid, text)
        tokens.append(tok)
        lps.append(lp)
        top = tops[k] if tops and k < len(tops) else None
        top_lps.append({_token_text(tokenizer, i, s): l for l, i, s in top} if top else None)
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_lps, "text_offset": offsets}


def build_chat_message(text: str, thinking: bool, tools_enabled: bool) -> tuple[dict[str, Any], bool]:
    """The OpenAI assistant message for generated ``text``; also whether it made tool calls.

    Reasoning (thinking mode) goes to ``reasoning_content``; DSML tool calls become OpenAI
    ``tool_calls`` when the request offered tools, otherwise the text is left as content.
    """
    parsed = parse_message_from_completion_text(text, "thinking" if thinking else "chat")
    content = parsed["content"]
    calls = parsed["tool_calls"] if tools_enabled else []
    if not tools_enabled:  # DSML the client did not ask for stays visible as text
        after = text.split(THINK_END, 1)[1] if thinking and THINK_END in text else ("" if thinking else text)
        content = after.split(EOS, 1)[0]
    msg: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
    if thinking:
        msg["reasoning_content"] = parsed["reasoning_content"]
    if calls:
        msg["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    return msg, bool(calls)


class StreamSplitter:
    """Splits streamed completion text into reasoning and content deltas.

    Holds back any tail that might be the start of ``</think>`` (while reasoning) or of the
    DSML tool-call block (when tools are on), so a marker is never leaked half-written; once the
    tool-call block starts, nothing more streams as content (the calls are sent at the end).
    """

    def __init__(self, thinking: bool, tools_enabled: bool):
        self.in_reasoning = thinking
        self.tools_enabled = tools_enabled
        self.in_tools = False
        self.pending = ""

    @staticmethod
    def _held(text: str, marker: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-k:]):
                return k
        return 0

    def feed(self, delta: str) -> tuple[str, str]:
        """-> (reasoning delta, content delta)."""
        self.pending += delta
        reasoning = content = ""
        if self.in_reasoning:
            end = self.pending.find(THINK_END)
            if end < 0:
                keep = self._held(self.pending, THINK_END)
                reasoning, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep:]
                return reasoning, ""
            reasoning, self.pending = self.pending[:end], self.pending[end + len(THINK_END):]
            self.in_reasoning = False
        if self.in_tools:
            self.pending = ""
            return reasoning, ""
        if self.tools_enabled:
            marker = "\n\n" + TOOL_CALLS_START
            start = self.pending.find(TOOL_CALLS_START)
            if start >= 0:
                content = self.pending[:start]
                if content.endswith("\n\n"):
                    content = content[:-2]
                self.in_tools, self.pending = True, ""
                return reasoning, content
            keep = max(self._held(self.pending, marker), self._held(self.pending, TOOL_CALLS_START))
        else:
            keep = 0
        content, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """At the end: whatever is held back (a marker that never completed is plain text)."""
        rest, self.pending = self.pending, ""
        if self.in_tools:
            return "", ""
        return (rest, "") if self.in_reasoning else ("", rest)


def engine_error(out: RequestOutput) -> APIError:
    if out.error == SHUTDOWN_ERROR:
        return shutting_down()
    return APIError(500, f"generation failed: {out.error}", type="internal_server_error")


def shutting_down() -> APIError:
    return APIError(503, SHUTDOWN_ERROR, type="server_overloaded", code="shutting_down",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def stream_failure(e: Exception, unfinished: Iterable[int], finish_chunk: Callable[[int], str]) -> Iterable[str]:
    """The end of a stream that failed after it started: an error event, a final chunk with
    ``finish_reason`` for every choice still open, ``[DONE]``."""
    logger.exception("stream failed after it started")
    yield sse(APIError(500, f"internal server error: {type(e).__name__}: {e}", type="internal_server_error").body())
    for index in unfinished:
        yield finish_chunk(index)
    yield SSE_DONE


def check_finished(finals: dict[int, RequestOutput], n: int) -> None:
    """Raise for a request the engine failed, or when the client left before all finished."""
    for out in finals.values():
        if out.error:
            raise engine_error(out)
    if len(finals) < n:
        raise APIError(499, "the client closed the request", type="client_closed_request")


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI usage; ``cached_tokens``: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _cached_per_prompt(finals: dict[int, RequestOutput], n: int) -> int:
    """Cached prompt tokens counted once per prompt (as prompt_tokens is): its first generation's."""
    return sum(out.cached_tokens for i, out in finals.items() if i % n == 0)


class EventStream(StreamingResponse):
    """An SSE response over already submitted requests that always lets go of them.

    Starlette stops iterating when a send fails but leaves the generator suspended (or never
    started, if the client left before the first byte); closing it and then ``running``
    aborts whatever is still running.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], running: "Running"):
        super().__init__(content, media_type=self.media_type)
        self.running = running

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()
            self.running.close()


# ---- request preparation --------------------------------------------------------------------------


def _sampling_params(body: SamplingFields, max_new_tokens: int, seed_offset: int = 0) -> SamplingParams:
    """OpenAI fields -> SamplingParams (validated; an invalid field becomes a 400 naming it)."""
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    kw: dict[str, Any] = {"max_new_tokens": max_new_tokens, "ignore_eos": body.ignore_eos,
                          "skip_special_tokens": body.skip_special_tokens, "no_stop_trim": body.no_stop_trim}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "stop_token_ids"):
        value = getattr(body, name)
        if value is not None:
            kw[name] = value
    if body.stop is not None:
        kw["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
        if any(not s for s in kw["stop"]):
            raise bad_request("stop strings must be non-empty", "stop")
    if body.seed is not None:
        if not -SEED_LIMIT <= body.seed < SEED_LIMIT - 16:
            raise bad_request(f"seed must be a 64-bit signed integer, got {body.seed}", "seed")
        kw["seed"] = body.seed + seed_offset
    try:
        return SamplingParams.from_dict(kw)
    except InvalidRequest as e:
        raise bad_request(str(e).replace("max_new_tokens", "max_tokens"), _OPENAI_PARAM.get(e.param or "", e.param))


def check_sampling_types(p: SamplingParams) -> None:
    """Reject wrongly typed native sampling parameters here, before they reach the engine loop."""
    for f in dataclasses.fields(SamplingParams):
        v, default = getattr(p, f.name), getattr(SamplingParams(), f.name)
        if isinstance(default, bool) or isinstance(default, list):
            want = type(default)
        elif isinstance(default, float):
            want = (int, float)
        elif isinstance(default, int) or f.name == "seed":
            want = int
        else:
            continue
        ok = isinstance(v, want) and not (isinstance(v, bool) and want is not bool)
        if f.name == "seed":
            ok = v is None or (ok and -SEED_LIMIT <= v < SEED_LIMIT)
        if ok and f.name == "stop":
            ok = all(isinstance(x, str) and x for x in v)
        if ok and f.name == "stop_token_ids":
            ok = all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        if not ok:
            raise InvalidRequest(f"{f.name} has the wrong type: {v!r}", param=f.name)


class ServerState:
    """Everything the routes share: the engine, its bridge, metrics and the served name."""

    def __init__(self, engine: Any, args: ServerArgs):
        self.engine = engine
        self.args = args
        self.tokenizer = engine.tokenizer
        # the directory of the tokenizer.json in use, for clients that load it (sglang.bench_serving)
        source = getattr(engine.tokenizer, "source", "")
        self.tokenizer_path = str(Path(source).parent) if source else None
        self.context_length = int(engine.context_length)
        # The longest prompt + output one request may have: the context, or the pools if smaller.
        self.token_limit = min(self.context_length, int(getattr(engine, "max_total_tokens", None) or self.context_length))
        self.vocab_size = int(engine.vocab_size)
        self.limits = request_limits(args, self.token_limit, self.vocab_size, self.tokenizer)
        self.metrics = ServerMetrics(engine)
        self.bridge: Optional[EngineBridge] = None
        self.created = _now()
        self.live: set[Running] = set()     # submitted groups not yet closed
        self.draining = False               # SIGTERM came: admit nothing more

    # -- checks shared by the routes --

    def check_model(self, model: Optional[str]) -> None:
        names = {self.args.model_name}
        if self.args.model_path:
            names.add(self.args.model_path)
        if model is not None and model not in names:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.args.model_name}`",
                           param="model", code="model_not_found")

    def check_n(self, n: int) -> None:
        if not isinstance(n, int) or n < 1 or n > 16:
            raise bad_request(f"n must be an integer in [1, 16], got {n!r}", "n")

    def check_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise bad_request("the prompt is empty", param)
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad!r} is outside the vocabulary [0, {self.vocab_size})", param)

    def max_new_tokens(self, prompt_len: int, requested: Optional[int], default: int, param: str = "max_tokens",
                       prompt_param: str = "messages") -> int:
        """The request's output budget; the prompt plus it must fit the context length."""
        room = self.token_limit - prompt_len
        if requested is not None and (not isinstance(requested, int) or requested < 1):
            raise bad_request(f"{param} must be a positive integer, got {requested!r}", param)
        if room < 1:
            raise bad_request(f"the prompt has {prompt_len} tokens; the limit is {self.token_limit}",
                              prompt_param)
        if requested is None:
            return min(default, room)
        if prompt_len + requested > self.token_limit:
            raise bad_request(f"the prompt ({prompt_len} tokens) plus {param} ({requested}) exceeds the "
                              f"context length of {self.token_limit} tokens", param)
        return requested

    def check_sampling(self, p: SamplingParams, prefix: str = "") -> SamplingParams:
        self.limits.check_sampling(p, prefix)
        return p

    # -- running requests --

    def start(self, reqs: list[GenerateRequest], param: str = "n") -> "Running":
        """Submit ``reqs`` now: every refusal (400, 503) is raised here, before a response starts.
        ``param`` names the field that made the group (n, or a batch of prompts)."""
        if self.draining:
            raise shutting_down()
        queue_size = getattr(self.engine, "max_queued_requests", None)
        if queue_size is not None and len(reqs) > queue_size:  # a retry could never succeed: 400, not 503
            raise bad_request(f"the request makes {len(reqs)} generations (n x prompts) but at most {queue_size} "
                              f"can wait (--max-queued-requests)", param)
        if self.bridge is None:
            self.bridge = EngineBridge(self.engine, asyncio.get_running_loop())
        running = Running(self, reqs, self.bridge.submit(reqs))
        self.live.add(running)
        return running

    async def drain(self, timeout: float) -> None:
        """Stop admission; let running requests finish for ``timeout`` s, then end the rest with
        ``SHUTDOWN_ERROR`` and give their streams a moment to send it."""
        self.draining = True
        loop = asyncio.get_running_loop()
        logger.warning("shutting down: refusing new requests; %d running get up to %.1f s to finish",
                       len(self.live), timeout)
        deadline = loop.time() + timeout
        while self.live and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.live:
            logger.warning("ending %d request group(s) still running", len(self.live))
            for running in list(self.live):
                running.end(SHUTDOWN_ERROR)
            deadline = loop.time() + STREAM_END_GRACE_S
            while self.live and loop.time() < deadline:
                await asyncio.sleep(0.05)


class Running:
    """Submitted requests (the ``n`` choices, or a batch's prompts) and the queue of their outputs."""

    def __init__(self, state: ServerState, reqs: list[GenerateRequest], queue: asyncio.Queue):
        self.state, self.reqs, self.queue = state, reqs, queue
        self.remaining = set(range(len(reqs)))

    async def outputs(self, request: Request) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield ``(index, output)`` until all finish; abort the rest if the client leaves."""
        metrics = self.state.metrics
        t0 = time.perf_counter()
        first: dict[int, float] = {}
        next_check = t0 + DISCONNECT_POLL_S
        try:
            while self.remaining:
                try:
                    index, out = await asyncio.wait_for(self.queue.get(), timeout=DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    out = None
                now = time.perf_counter()
                if now >= next_check:  # outputs may arrive every step: check the client on a clock
                    next_check = now + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        return
                if out is None:
                    continue
                if out.delta_ids and index not in first:
                    first[index] = now
                    metrics.ttft.observe(now - t0)
                if out.finished:
                    self.remaining.discard(index)
                    metrics.e2e.observe(now - t0)
                    if index in first and out.completion_tokens > 1:
                        metrics.tpot.observe((now - first[index]) / (out.completion_tokens - 1))
                yield index, out
        finally:
            self.close()

    def close(self) -> None:
        """Abort what has not finished (its client is gone); idempotent."""
        if self.remaining:
            self.state.bridge.abort(self.reqs[i].rid for i in self.remaining)
            self.remaining = set()
        self.state.live.discard(self)

    def end(self, error: str) -> None:
        """The server ends the unfinished requests: their final outputs arrive carrying ``error``."""
        self.state.bridge.abort((self.reqs[i].rid for i in self.remaining), error)


def request_limits(args: ServerArgs, token_limit: int, vocab_size: int, tokenizer: Any) -> RequestLimits:
    """The limits from the flags; unset ones from the model (a token covers at most as many
    characters as its longest vocabulary entry has bytes, so longer text cannot fit)."""
    max_chars = args.max_prompt_chars
    if max_chars is None:
        vocab = tokenizer.hf.get_vocab(with_added_tokens=True) if hasattr(tokenizer, "hf") else {}
        max_chars = token_limit * max((len(t) for t in vocab), default=64)
    return RequestLimits(max_request_bytes=args.max_request_bytes, max_json_depth=args.max_json_depth,
                         max_prompt_chars=max_chars, max_stop_strings=args.max_stop_strings,
                         max_top_logprobs=args.max_top_logprobs, max_top_k=args.max_top_k or vocab_size)


# ---- the app --------------------------------------------------------------------------------------


def create_app(engine: Any, args: ServerArgs) -> FastAPI:
    """The FastAPI app over a started (or startable) engine."""
    state = ServerState(engine, args)
    app = FastAPI(title="dsv4-backend", version="0.1.0")
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        return validation_error(e.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return APIError(e.status_code, str(e.detail), type=kind, headers=e.headers).response()  # 405: Allow

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception):
        logger.exception("internal error")
        return APIError(500, f"internal server error: {type(e).__name__}: {e}", type="internal_server_error").response()

    # -- informational routes --

    @app.get("/health")
    async def health():
        if state.draining:
            raise shutting_down()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": args.model_name, "object": "model", "created": state.created, "owned_by": "dsv4-backend",
            "root": args.model_name, "max_model_len": state.context_length,
        }]}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/flush_cache")
    async def flush_cache():
        """SGLang's route: empty the prefix cache (running requests keep their own pages)."""
        await asyncio.to_thread(state.engine.flush_cache)
        return PlainTextResponse("Cache flushed.\n")

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return {"model_path": args.model_path or f"preset:{args.preset}", "served_model_name": args.model_name,
                "tokenizer_path": state.tokenizer_path, "is_generation": True,
                "context_length": state.context_length, "vocab_size": state.vocab_size}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return {**dataclasses.asdict(args), "context_length": state.context_length, "engine": _jsonable(engine.stats())}

    # -- generation routes --

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _chat(state, await read_body(request, ChatCompletionRequest, state.limits), request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _completions(state, await read_body(request, CompletionRequest, state.limits), request)

    @app.post("/generate")
    async def generate(request: Request):
        return await _generate(state, await read_body(request, GenerateReqInput, state.limits), request)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = add_request_bodies(
                get_openapi(title=app.title, version=app.version, routes=app.routes),
                {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                 "/generate": GenerateReqInput})
        return app.openapi_schema

    app.openapi = openapi
    return app


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


# ---- /v1/chat/completions -------------------------------------------------------------------------


@dataclass
class _ChatPlan:
    prompt_ids: list[int]
    thinking: bool
    tools_enabled: bool


def _plan_chat(state: ServerState, body: ChatCompletionRequest) -> _ChatPlan:
    if not body.messages:
        raise bad_request("messages must be a non-empty list", "messages")
    if body.response_format and body.response_format.get("type") not in (None, "text"):
        raise bad_request("response_format other than {'type': 'text'} is not supported", "response_format")
    kwargs = body.chat_template_kwargs or {}
    thinking = bool(kwargs.get("thinking", kwargs.get("enable_thinking", False)))
    effort = kwargs.get("reasoning_effort", body.reasoning_effort)
    effort_map = {None: None, "minimal": None, "low": None, "medium": None, "high": "high", "max": "max"}
    if effort not in effort_map:
        raise bad_request(f"reasoning_effort must be one of low, medium, high, max; got {effort!r}", "reasoning_effort")
    tools = body.tools or None
    choice = body.tool_choice
    if tools is not None:
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict) \
                    or not isinstance(t["function"].get("name"), str):
                raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        named = [t for t in (tools or []) if t["function"]["name"] == name]
        if not named:
            raise bad_request(f"tool_choice names a function {name!r} that is not in tools", "tool_choice")
        tools = named
    elif choice not in (None, "auto", "none", "required"):
        raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}", "tool_choice")
    elif choice == "required" and not tools:
        raise bad_request("tool_choice 'required' needs tools", "tool_choice")
    if choice == "none":
        tools = None
    for i, m in enumerate(body.messages):
        if not isinstance(m, dict) or "role" not in m:
            raise bad_request(f"messages[{i}] must be an object with a role", "messages")
    try:
        prompt = encode_messages(body.messages, thinking_mode="thinking" if thinking else "chat",
                                 drop_thinking=bool(kwargs.get("drop_thinking", True)),
                                 reasoning_effort=effort_map[effort], tools=tools)
    except EncodingError as e:
        raise bad_request(str(e), "messages")
    state.limits.check_prompt_chars(len(prompt), "messages")
    return _ChatPlan(state.tokenizer.encode(prompt), thinking, tools is not None)


async def _chat(state: ServerState, body: ChatCompletionRequest, request: Request):
    state.check_model(body.model)
    state.check_n(body.n)
    state.limits.check_top_logprobs(body.top_logprobs, "top_logprobs")
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    plan = _plan_chat(state, body)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_new = state.max_new_tokens(len(plan.prompt_ids), requested, SamplingParams().max_new_tokens, param)
    n_top = body.top_logprobs or 0
    reqs = [GenerateRequest(input_ids=list(plan.prompt_ids),
                            sampling_params=state.check_sampling(_sampling_params(body, max_new, i)),
                            rid=f"chatcmpl-{uuid.uuid4().hex}", return_logprob=body.logprobs,
                            top_logprobs_num=n_top, stream=body.stream) for i in range(body.n)]
    rid = reqs[0].rid
    created = _now()
    running = state.start(reqs)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStream(_chat_stream(state, request, running, plan, body.model or state.args.model_name,
                                        created, include_usage, n_top, body.logprobs), running)
    finals: dict[int, RequestOutput] = {}
    lp_items: dict[int, list] = {i: [] for i in range(body.n)}
    async with aclosing(running.outputs(request)) as outputs:
        async for index, out in outputs:
            if body.logprobs and out.delta_ids:
                total = len(out.output_ids)
                lp_items[index] += chat_logprob_items(
                    state.tokenizer, new_entries(out.output_token_logprobs, total, len(out.delta_ids)),
                    new_entries(out.output_top_logprobs, total, len(out.delta_ids)), n_top)
            if out.finished:
                finals[index] = out
    check_finished(finals, len(reqs))
    choices = []
    for i in range(body.n):
        out = finals[i]
        msg, called = build_chat_message(out.text, plan.thinking, plan.tools_enabled)
        reason = "tool_calls" if called else finish_reason_of(out)
        choices.append({"index": i, "message": msg, "finish_reason": reason,
                        "logprobs": {"content": lp_items[i]} if body.logprobs else None})
    completion_tokens = sum(o.completion_tokens for o in finals.values())
    return {"id": rid, "object": "chat.completion", "created": created, "model": body.model or state.args.model_name,
            "choices": choices, "usage": usage_of(finals[0].prompt_tokens, completion_tokens, finals[0].cached_tokens)}


async def _chat_stream(state: ServerState, request: Request, running: Running, plan: _ChatPlan,
                       model: str, created: int, include_usage: bool, n_top: int, logprobs: bool):
    reqs = running.reqs
    rid = reqs[0].rid
    splitters = [StreamSplitter(plan.thinking, plan.tools_enabled) for _ in reqs]

    def chunk(index: int, delta: dict[str, Any], finish: Optional[str] = None, lp: Optional[list] = None) -> str:
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": index, "delta": delta, "logprobs": {"content": lp} if lp is not None else None,
                                 "finish_reason": finish}], "usage": None})

    finals: dict[int, RequestOutput] = {}
    try:
        for i in range(len(reqs)):
            yield chunk(i, {"role": "assistant", "content": ""})
        async with aclosing(running.outputs(request)) as outputs:
            async for index, out in outputs:
                reasoning, content = splitters[index].feed(out.delta_text)
                lp = None
                if logprobs and out.delta_ids:
                    total = len(out.output_ids)
                    lp = chat_logprob_items(state.tokenizer,
                                            new_entries(out.output_token_logprobs, total, len(out.delta_ids)),
                                            new_entries(out.output_top_logprobs, total, len(out.delta_ids)), n_top)
                if reasoning:
                    yield chunk(index, {"reasoning_content": reasoning})
                if content or lp:
                    yield chunk(index, {"content": content}, lp=lp)
                if out.finished:
                    finals[index] = out
                    if out.error:
                        yield sse(engine_error(out).body())
                    reasoning, content = splitters[index].flush()
                    if reasoning:
                        yield chunk(index, {"reasoning_content": reasoning})
                    if content:
                        yield chunk(index, {"content": content})
                    msg, called = build_chat_message(out.text, plan.thinking, plan.tools_enabled)
                    if called:
                        calls = [{"index": k, **c} for k, c in enumerate(msg["tool_calls"])]
                        yield chunk(index, {"tool_calls": calls})
                    yield chunk(index, {}, "tool_calls" if called else finish_reason_of(out))
        if include_usage and len(finals) == len(reqs):
            completion_tokens = sum(o.completion_tokens for o in finals.values())
            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": usage_of(finals[0].prompt_tokens, completion_tokens,
                                                        finals[0].cached_tokens)})
    except Exception as e:
        for event in stream_failure(e, [i for i in range(len(reqs)) if i not in finals],
                                    lambda i: chunk(i, {}, "abort")):
            yield event
        return
    yield SSE_DONE


# ---- /v1/completions ------------------------------------------------------------------------------


def _prompts_of(state: ServerState, prompt: Any, param: str = "prompt") -> list[list[int]]:
    """Token ids of each prompt: a string, a list of strings, a list of ids or a list of id lists."""
    bos = state.tokenizer.bos_token_id if hasattr(state.tokenizer, "bos_token_id") else None

    def text_ids(s: str) -> list[int]:
        if not s:
            raise bad_request("the prompt is empty", param)
        ids = state.tokenizer.encode(s)
        return ([bos] if bos is not None else []) + ids

    if isinstance(prompt, str):
        state.limits.check_prompt_chars(len(prompt), param)
        return [text_ids(prompt)]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("prompt must be a non-empty string, list of strings, list of token ids or list of lists", param)
    if all(isinstance(p, str) for p in prompt):
        state.limits.check_prompt_chars(sum(len(p) for p in prompt), param)
        return [text_ids(p) for p in prompt]
    if all(isinstance(p, int) for p in prompt):
        state.check_ids(prompt, param)
        return [list(prompt)]
    if all(isinstance(p, list) for p in prompt):
        for p in prompt:
            state.check_ids(p, param)
        return [list(p) for p in prompt]
    raise bad_request("prompt mixes strings, token ids and lists", param)


async def _completions(state: ServerState, body: CompletionRequest, request: Request):
    state.check_model(body.model)
    state.check_n(body.n)
    if body.suffix:
        raise bad_request("suffix is not supported by this model (no fill-in-the-middle)", "suffix")
    if body.best_of not in (None, 1) and body.best_of != body.n:
        raise bad_request("best_of other than n is not supported", "best_of")
    state.limits.check_top_logprobs(body.logprobs, "logprobs")
    prompts = _prompts_of(state, body.prompt)
    want_lp = body.logprobs is not None
    reqs: list[GenerateRequest] = []
    for ids in prompts:
        max_new = state.max_new_tokens(len(ids), body.max_tokens, 16, "max_tokens", "prompt")
        for j in range(body.n):
            reqs.append(GenerateRequest(
                input_ids=list(ids), sampling_params=state.check_sampling(_sampling_params(body, max_new, j)),
                rid=f"cmpl-{uuid.uuid4().hex}", return_logprob=want_lp,
                logprob_start_len=0 if (want_lp and body.echo) else -1,
                top_logprobs_num=body.logprobs or 0, stream=body.stream))
    prompt_of = [prompts[i // body.n] for i in range(len(reqs))]
    created = _now()
    model = body.model or state.args.model_name
    rid = reqs[0].rid
    prompt_tokens = sum(len(p) for p in prompts)
    running = state.start(reqs, "n" if body.n > 1 else "prompt")
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStream(_completion_stream(state, request, running, prompt_of, body, model, created,
                                              include_usage, prompt_tokens), running)
    finals: dict[int, RequestOutput] = {}
    async with aclosing(running.outputs(request)) as outputs:
        async for index, out in outputs:
            if out.finished:
                finals[index] = out
    check_finished(finals, len(reqs))
    choices = []
    for i, out in sorted(finals.items()):
        text, lp = out.text, None
        echo_text = state.tokenizer.decode(prompt_of[i]) if body.echo else ""
        if want_lp:
            entries = list(out.output_token_logprobs or [])
            tops = list(out.output_top_logprobs or [])
            if body.echo:
                entries = list(out.input_token_logprobs or []) + entries
                tops = list(out.input_top_logprobs or []) + tops
            lp = completion_logprobs(state.tokenizer, entries, tops if body.logprobs else None, 0)
        choices.append({"index": i, "text": echo_text + text, "logprobs": lp, "finish_reason": finish_reason_of(out)})
    completion_tokens = sum(o.completion_tokens for o in finals.values())
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage_of(prompt_tokens, completion_tokens, _cached_per_prompt(finals, body.n))}


async def _completion_stream(state: ServerState, request: Request, running: Running, prompt_of: list,
                             body: CompletionRequest, model: str, created: int, include_usage: bool,
                             prompt_tokens: int):
    reqs = running.reqs
    rid = reqs[0].rid
    want_lp = body.logprobs is not None

    def chunk(index: int, text: str, finish: Optional[str], lp: Optional[dict]) -> str:
        return sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish}], "usage": None})

    finals: dict[int, RequestOutput] = {}
    try:
        if body.echo:
            for i in range(len(reqs)):
                yield chunk(i, state.tokenizer.decode(prompt_of[i]), None, None)
        offsets = [len(state.tokenizer.decode(p)) if body.echo else 0 for p in prompt_of]  # text_offset so far
        async with aclosing(running.outputs(request)) as outputs:
            async for index, out in outputs:
                lp = None
                if want_lp and out.delta_ids:
                    total = len(out.output_ids)
                    lp = completion_logprobs(state.tokenizer,
                                             new_entries(out.output_token_logprobs, total, len(out.delta_ids)),
                                             new_entries(out.output_top_logprobs, total, len(out.delta_ids))
                                             if body.logprobs else None, offsets[index])
                    offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else offsets[index]
                if out.finished:
                    finals[index] = out
                    if out.error:
                        yield sse(engine_error(out).body())
                if out.delta_text or out.finished or lp:
                    yield chunk(index, out.delta_text, finish_reason_of(out), lp)
        if include_usage and len(finals) == len(reqs):
            completion_tokens = sum(o.completion_tokens for o in finals.values())
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                       "usage": usage_of(prompt_tokens, completion_tokens, _cached_per_prompt(finals, body.n))})
    except Exception as e:
        for event in stream_failure(e, [i for i in range(len(reqs)) if i not in finals],
                                    lambda i: chunk(i, "", "abort", None)):
            yield event
        return
    yield SSE_DONE


# ---- /generate (SGLang native) --------------------------------------------------------------------


async def _generate(state: ServerState, body: GenerateReqInput, request: Request):
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("give exactly one of text or input_ids", "text")
    batched = isinstance(body.text, list) or (isinstance(body.input_ids, list) and body.input_ids
                                              and isinstance(body.input_ids[0], list))
    state.limits.check_top_logprobs(body.top_logprobs_num, "top_logprobs_num")
    prompts = _prompts_of(state, body.text if body.text is not None else body.input_ids,
                          "text" if body.text is not None else "input_ids")
    if batched and body.stream:
        raise bad_request("streaming a batch is not supported; send one request per prompt", "stream")
    sp = dict(body.sampling_params or {})
    try:
        params = [SamplingParams.from_dict(sp) for _ in prompts]
        for p in params:
            check_sampling_types(p)
    except InvalidRequest as e:
        raise bad_request(str(e), f"sampling_params.{e.param}" if e.param else "sampling_params")
    except TypeError as e:
        raise bad_request(f"invalid sampling_params: {e}", "sampling_params")
    reqs = []
    for ids, p in zip(prompts, params):
        state.check_sampling(p, "sampling_params.")
        p.max_new_tokens = state.max_new_tokens(len(ids), sp.get("max_new_tokens"), p.max_new_tokens,
                                                "sampling_params.max_new_tokens", "input_ids")
        reqs.append(GenerateRequest(input_ids=list(ids), sampling_params=p,
                                    rid=body.rid if (body.rid and not batched) else uuid.uuid4().hex,
                                    return_logprob=body.return_logprob, logprob_start_len=body.logprob_start_len,
                                    top_logprobs_num=body.top_logprobs_num, stream=body.stream))
    running = state.start(reqs, "text" if body.text is not None else "input_ids")
    if body.stream:
        async def stream():
            rid, done = reqs[0].rid, False
            try:
                async with aclosing(running.outputs(request)) as outputs:
                    async for _, out in outputs:
                        if out.finished and out.error:
                            yield sse(engine_error(out).body())
                        done = out.finished
                        yield sse(out.to_dict())
            except Exception as e:
                final = {"text": "", "output_ids": [], "meta_info": {
                    "id": rid, "finish_reason": {"type": "abort", "message": f"{type(e).__name__}: {e}"}}}
                for event in stream_failure(e, [] if done else [0], lambda _: sse(final)):
                    yield event
                return
            yield SSE_DONE
        return EventStream(stream(), running)
    finals: dict[int, RequestOutput] = {}
    async with aclosing(running.outputs(request)) as outputs:
        async for index, out in outputs:
            if out.finished:
                finals[index] = out
    check_finished(finals, len(reqs))
    results = [finals[i].to_dict() for i in range(len(reqs))]
    return results if batched else results[0]


# ---- entry point ----------------------------------------------------------------------------------


def build_engine(args: ServerArgs):
    from scheduler_hooks.engine import Engine

    return Engine(**args.engine_kwargs())


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    engine = build_engine(args)
    if not engine.is_leader:   # a torchrun rank > 0: its Engine() followed rank 0 until that shut down
        return
    logger.info("memory plan:\n%s", engine.memory_plan_table())
    # (the engine itself warns, once, when it serves a preset's seeded random weights)
    logger.info("tokenizer: %s", getattr(engine.tokenizer, "source", type(engine.tokenizer).__name__))
    engine.start()
    app = create_app(engine, args)
    logger.info("serving %s on http://%s:%d (context length %d)", args.model_name, args.host, args.port,
                engine.context_length)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=STREAM_END_GRACE_S)
    try:
        DrainingServer(config, app.state.server, args.graceful_shutdown_timeout).run()
    finally:
        engine.shutdown()
    engine.check_integrity()
    used = {pool: u["used"] for pool, u in engine.pool_usage().items() if u["used"]}
    if used:
        raise SystemExit(f"pools still in use after shutdown: {used}")
    logger.info("shut down; every pool is free")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with the first SIGTERM / SIGINT draining the engine before uvicorn stops
    (``ServerState.drain``); a second signal stops at once, as uvicorn does."""

    def __init__(self, config: uvicorn.Config, state: ServerState, timeout: float):
        super().__init__(config)
        self.state, self.timeout = state, timeout
        self.loop: Optional[asyncio.AbstractEventLoop] = None

    async def startup(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.state.draining or self.loop is None:
            return super().handle_exit(sig, frame)
        # a signal handler runs between bytecodes of the loop's thread: schedule, do not await
        self.state.draining = True
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain()))

    async def _drain(self) -> None:
        await self.state.drain(self.timeout)
        self.should_exit = True


if __name__ == "__main__":
    main()
