"""The engine: model, pools, scheduler and tokenizer behind an SGLang-shaped API.

Offline (the caller's thread drives the scheduler until its requests finish)::

    with Engine(preset="tiny") as eng:
        out = eng.generate("Hello", {"max_new_tokens": 16, "temperature": 0})
        out["text"], out["output_ids"], out["meta_info"]["finish_reason"]

Online (the HTTP server): ``start()`` runs the scheduler loop in a background thread;
``submit(req, callback)`` validates at once and the callback receives a ``RequestOutput``
from the engine thread after every step that produced tokens for the request, and once with
``finished=True``; ``abort(rid)`` finishes a request wherever it is. Request ids must be unique
among the requests in flight (``submit`` refuses a duplicate with ``InvalidRequest``).
``generate`` also works while the loop runs (it then goes through ``submit``).

Benchmarks: ``add_synthetic_request(context_len, ...)`` queues a request whose context is
admitted by the scheduler without a prefill (its pages taken as a prefill would take them,
filled with random valid rows by :class:`SyntheticContextFiller`); ``step()`` then drives it
through ordinary decode steps. See docs/engine.md, "Synthetic contexts".
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch

from dsv4_backend.checkpoint import CheckpointReader, WeightStream
from dsv4_backend.config import DSV4Config
from dsv4_backend.model_runner import ModelRunner, pool_page_align, resolve_attention_kernel
from dsv4_backend.tokenizer import Tokenizer, load_tokenizer
from dsv4_backend.parallel import RankShard
from dsv4_backend.weights import ModelTensor, RandomWeightStream, model_tensors, random_weights
from memory.allocator import KVAllocator
from memory.configurator import COMPRESSED_PAGE, SWA_PAGE, DSV4PoolConfigurator, PoolPlan
from memory.hisparse import HiSparseConfig, copy_rows_torch
from memory.layout import (INDEXER_ROW_BYTES, KV_ROW_BYTES, write_indexer_rows,
                           write_kv_rows)
from memory.pools import DSV4KVPools
from memory.prefix_cache import PrefixCache

from .hooks import SchedulerHooks
from .parallel_engine import launch_ranks
from .io import EngineOverloaded, GenerateRequest, InvalidRequest, RequestOutput, SamplingParams
from .scheduler import Scheduler, SchedulerConfig
from .speculative import SpeculativeConfig, SpeculativeDecoder

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
DEFAULT_GPU_MEM_FRACTION = 0.85
DEFAULT_CPU_MEM_FRACTION = 0.25
# prefill tokens a step may carry beside running decodes (docs/engine.md, "Scheduler policy")
DEFAULT_MIXED_CHUNK_TOKENS = 512

Callback = Callable[[RequestOutput], None]


class EngineStopped(RuntimeError):
    """The engine has been shut down."""


@dataclass
class _Add:
    req: GenerateRequest
    callback: Callback


@dataclass
class _Abort:
    rid: str
    error: Optional[str] = None     # set: the request is ended with this error (not by its client)


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        return total
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; pass max_total_tokens")


def weight_nbytes(weights: Union[dict[str, torch.Tensor], WeightStream], shard: Optional[RankShard] = None,
                  config: Optional[DSV4Config] = None, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes the model's weights take on the device (a checkpoint's as it will be kept); with
    ``shard`` (and the model's ``config``), one rank's part (a stream's tensors as
    ``model_tensors`` lists them for the compute ``dtype``)."""
    if shard is not None:
        if isinstance(weights, dict):
            tensors = [ModelTensor(n, tuple(t.shape), t.dtype) for n, t in weights.items()]
        else:
            tensors = model_tensors(config, dtype, weights.include_mtp, weights.quantized)
        return shard.local_nbytes(tensors, config.n_routed_experts)
    if not isinstance(weights, dict):
        return weights.nbytes
    return sum(t.numel() * t.element_size() for t in weights.values())


def _is_fp8(model_path: str) -> bool:
    """Whether config.json marks a quantised release (its FP8 / FP4 weights are then kept so)."""
    cfg = Path(model_path) / "config.json"   # a missing one is CheckpointReader's error to report
    return cfg.exists() and DSV4Config.from_json(cfg).quantization == "fp8"


class Engine:
    """A DeepSeek-V4 model served with paged compressed-KV pools and continuous batching.

    Pools are sized by ``max_total_tokens`` or by ``mem_fraction_static`` of the device's
    memory (the CPU: of the available RAM) minus the weights; with neither, the CPU default
    is ``max_total_tokens = context_length`` and the GPU default a fraction of 0.85.
    ``dtype="float64"`` (CPU only) also keeps the compressor state in float64: the exact mode
    of the tests. ``capture_logits=True`` keeps every computed position's raw logits per
    request (``captured_logits(rid)``) for comparisons with the reference.
    The prefix cache (``memory/prefix_cache.py``) is on unless ``disable_radix_cache=True``
    (SGLang's name) or ``dense=True``: a request whose ids start with a cached restore point
    prefills only the rest (``meta_info["cached_tokens"]``); ``flush_cache()`` empties it.
    On CUDA (bf16, the Triton backend) pure-decode steps and speculative verify steps replay
    CUDA graphs (``dsv4_backend/cuda_graph.py``) up to ``cuda_graph_max_bs`` requests;
    ``cuda_graph=False`` (or ``DSV4_CUDA_GRAPH=0``) runs every step eagerly.
    ``attention_kernel``: ``auto`` (FlashMLA on an sm90 / sm100 GPU where ``flash_mla`` imports,
    else Triton), ``flashmla`` or ``triton``; the one chosen is logged and in :meth:`stats`.
    A checkpoint (``model_path``) is checked, then streamed into the model tensor by tensor; an
    FP8 release (``quantization_config`` in its config.json) stays quantised (FP8 linears, FP4
    experts). ``weight_stream`` gives any such stream instead (benchmarks that synthesise weights).
    ``disable_overlap_schedule=True`` (SGLang's name) turns the overlap schedule off: by default step
    N + 1 is scheduled and launched before the host reads step N's tokens (scheduler_hooks/overlap.py;
    ``stats()["overlap"]`` counts the steps and says why it is off where it is).
    ``enable_hisparse`` keeps every C4 row in host memory and a hot pool of ``1 / host_to_device_ratio``
    of them on the device (memory/hisparse.py); ``hisparse_config`` is SGLang's JSON (or a dict).
    """

    def __init__(
        self,
        model_path: Optional[str] = None,
        preset: str = "tiny",
        device: str = "cpu",
        dtype: str = "float32",
        max_running_requests: int = 16,
        max_total_tokens: Optional[int] = None,
        mem_fraction_static: Optional[float] = None,
        chunked_prefill_size: int = 512,
        context_length: Optional[int] = None,
        skip_tokenizer_init: bool = False,
        random_seed: int = 0,
        swa_ratio: Optional[float] = None,
        dense: bool = False,
        max_queued_requests: int = 256,
        capture_logits: bool = False,
        config_overrides: Optional[dict[str, Any]] = None,
        random_weights_on_device: bool = False,
        cuda_graph: Optional[bool] = None,
        cuda_graph_max_bs: Optional[int] = None,
        attention_kernel: str = "auto",
        weight_stream: Optional[WeightStream] = None,
        enable_hisparse: bool = False,
        hisparse_config: Union[None, str, dict[str, Any], HiSparseConfig] = None,
        disable_radix_cache: bool = False,
        speculative_algorithm: Optional[str] = None,
        speculative_num_steps: Optional[int] = None,
        speculative_eagle_topk: Optional[int] = None,
        speculative_num_draft_tokens: Optional[int] = None,
        tp_size: int = 1,
        ep_size: int = 1,
        mixed_chunk_tokens: int = DEFAULT_MIXED_CHUNK_TOKENS,
        disable_overlap_schedule: bool = False,
    ):
        engine_args = {k: v for k, v in locals().items() if k != "self"}   # what each rank process rebuilds
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.device = torch.device(device)
        if dtype == "float64" and self.device.type != "cpu":
            raise ValueError("dtype='float64' is the CPU-only exact mode")
        if chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {chunked_prefill_size}")
        if mixed_chunk_tokens < 0:
            raise ValueError(f"mixed_chunk_tokens must be >= 0 (0: no cap), got {mixed_chunk_tokens}")
        self.mixed_chunk_tokens = mixed_chunk_tokens
        self.disable_overlap_schedule = disable_overlap_schedule
        self.dtype = DTYPES[dtype]
        torch.manual_seed(random_seed)
        self.speculative = SpeculativeConfig.from_flags(speculative_algorithm, speculative_num_steps,
                                                        speculative_eagle_topk, speculative_num_draft_tokens)
        if self.speculative is not None and dense:
            raise ValueError("speculative decoding needs the compressed pools; dense=True is the baseline without")
        if self.speculative is not None and max(tp_size, ep_size) > 1:
            raise ValueError("speculative decoding runs on one rank only: tp_size and ep_size must be 1 with "
                             "speculative_algorithm")

        if hisparse_config is not None and not enable_hisparse:
            raise ValueError("hisparse_config is given but HiSparse is off; pass enable_hisparse=True "
                             "(--enable-hisparse) as well")
        self.hisparse_config = HiSparseConfig.parse(hisparse_config) if enable_hisparse else None
        if self.hisparse_config is not None and (self.speculative is not None or max(tp_size, ep_size) > 1):
            # neither the speculative rollback nor the ranks' replay of rank 0's calls knows the hot pool yet
            raise ValueError("enable_hisparse runs without speculative decoding and on one rank (tp_size = "
                             "ep_size = 1) for now")
        self._weights_on_device = random_weights_on_device
        if weight_stream is not None and model_path is not None:
            raise ValueError("pass model_path or weight_stream, not both")
        self._weight_stream = weight_stream
        self._ranked = max(tp_size, ep_size) > 1
        self.config, weights = self._load_model(model_path, preset, random_seed, config_overrides or {})
        self.ranks = launch_ranks(self.config, tp_size, ep_size, self.device, engine_args)
        try:
            self._build(model_path, preset, weights, max_running_requests, max_total_tokens, mem_fraction_static,
                        chunked_prefill_size, context_length, skip_tokenizer_init, random_seed, swa_ratio, dense,
                        max_queued_requests, capture_logits, cuda_graph, cuda_graph_max_bs, attention_kernel,
                        disable_radix_cache)
        except Exception as e:
            if self.ranks is not None:
                self.ranks.ready(f"{type(e).__name__}: {e}")
            raise
        if self.ranks is not None:
            self.ranks.ready()
            if self.ranks.torchrun and not self.ranks.leader:
                # torchrun started this rank: it follows rank 0 until that shuts down (docs/parallel.md)
                try:
                    self.ranks.follow(self)
                finally:
                    self.shutdown()

    @property
    def is_leader(self) -> bool:
        """Whether this process owns the scheduler: False only on a torchrun rank other than 0,
        whose Engine() returns, shut down, once rank 0's has."""
        return self.ranks is None or self.ranks.leader

    def _build(self, model_path, preset, weights, max_running_requests, max_total_tokens, mem_fraction_static,
               chunked_prefill_size, context_length, skip_tokenizer_init, random_seed, swa_ratio, dense,
               max_queued_requests, capture_logits, cuda_graph, cuda_graph_max_bs, attention_kernel,
               disable_radix_cache) -> None:
        shard = self.ranks.shard if self.ranks is not None else None
        self.model_name = str(model_path) if model_path else f"dsv4-{preset}"
        self.context_length = int(context_length or self.config.max_position_embeddings)
        self.tokenizer: Optional[Tokenizer] = None if skip_tokenizer_init else load_tokenizer(model_path)
        self.vocab_size = self.config.vocab_size
        if self.tokenizer is not None:
            self.vocab_size = min(self.vocab_size, self.tokenizer.vocab_size)

        state_dtype = torch.float64 if self.dtype == torch.float64 else None
        spec = self.speculative
        if spec is not None and self.config.num_nextn_predict_layers < 1:
            raise ValueError("speculative decoding drafts with the MTP layer; this config has "
                             "num_nextn_predict_layers = 0")
        conf = DSV4PoolConfigurator(self.config, max_running_requests=max_running_requests,
                                    swa_ratio=0.1 if swa_ratio is None else swa_ratio,
                                    state_dtype=state_dtype, dense=dense, speculative=spec is not None,
                                    draft_tokens=spec.num_draft_tokens if spec else 0,
                                    c4_shrink_factor=self.hisparse_config.host_to_device_ratio
                                    if self.hisparse_config else 1.0)
        self.plan = self._plan(conf, weights, max_total_tokens, mem_fraction_static)
        self.max_total_tokens = self.plan.max_full_tokens
        kernel, _ = resolve_attention_kernel(attention_kernel, self.device, self.dtype,
                                             self.config.num_attention_heads)
        self.pools = DSV4KVPools(self.config, self.plan, self.device, state_dtype,
                                 page_align=pool_page_align(kernel), hisparse=self.hisparse_config)
        self.allocator = KVAllocator(self.plan, max_context=self.context_length,
                                     window=self.config.sliding_window, dense=dense, device=self.device)
        self.runner = ModelRunner(self.config, weights, self.pools, self.allocator, self.device, self.dtype,
                                  dense=dense, cuda_graph=cuda_graph,
                                  cuda_graph_max_bs=min(cuda_graph_max_bs or max_running_requests,
                                                        max_running_requests),
                                  attention_kernel=attention_kernel, shard=shard)
        self.attention_kernel = self.runner.attention_kernel
        logger.info("attention kernel: %s (%s)", self.attention_kernel, self.runner.attention_kernel_reason)
        # under TP / EP the prefix cache is rank 0's: the other ranks replay its page operations
        follower = self.ranks is not None and not self.ranks.leader
        self.prefix_cache = (None if (disable_radix_cache or dense or follower)
                             else PrefixCache(self.allocator))
        self.synthetic_filler = SyntheticContextFiller(self.pools, self.allocator, seed=random_seed)
        self.hooks = SchedulerHooks(self.allocator, self.prefix_cache)
        runner, fill = self.runner, self.synthetic_filler.fill
        if self.ranks is not None and self.ranks.leader:
            # its allocator's changes logged for the other ranks, each step broadcast with them
            runner, fill = self.ranks.scheduler_parts(self.allocator, runner, fill)
        self.scheduler = Scheduler(runner, self.hooks, SchedulerConfig(
            max_running_requests=max_running_requests, chunked_prefill_size=chunked_prefill_size,
            context_length=self.context_length, eos_token_id=self.config.eos_token_id,
            capture_logits=capture_logits, random_seed=random_seed,
            mixed_chunk_tokens=self.mixed_chunk_tokens), self.tokenizer,
            overlap=not self.disable_overlap_schedule)
        self.max_queued_requests = max_queued_requests
        self.dense = dense
        self.scheduler.synthetic_fill = fill
        if spec is not None:
            self.scheduler.spec = SpeculativeDecoder(spec, self.runner, self.allocator)
        # where the host needs every step's tokens before the next launch (scheduler_hooks/overlap.py).
        # HiSparse overlaps where its rows move by kernel (stream-ordered, like every other pool
        # write); its host-side torch copy on a GPU (no mapped pinned memory) reads and writes the
        # pinned pool from the host at launch time, before a step in flight has finished.
        hs = self.pools.hisparse
        hs_host_copy = hs is not None and hs.device.type == "cuda" and hs.copy_rows is copy_rows_torch
        for reason, on in (("speculative decoding", spec is not None),
                           ("HiSparse with the host-side row copy", hs_host_copy),
                           ("tensor / expert parallel ranks", self.ranks is not None)):
            if on and self.scheduler.overlap.enabled:
                self.scheduler.overlap.turn_off(reason)
        self._synthetic_ids = torch.Generator(device="cpu").manual_seed(random_seed + 1)

        self._lock = threading.RLock()           # the scheduler is driven by one thread at a time
        self._inbox: "queue.Queue[Union[_Add, _Abort]]" = queue.Queue()
        self._callbacks: dict[str, Callback] = {}
        self._in_flight: set[str] = set()       # rids submitted and not yet delivered finished
        self._submit_lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._closed = False
        logger.debug("memory plan:\n%s", self.plan.table())

    # ---- construction ---------------------------------------------------------------

    def _load_model(self, model_path: Optional[str], preset: str, seed: int, overrides: dict[str, Any]
                    ) -> tuple[DSV4Config, Union[dict[str, torch.Tensor], WeightStream]]:
        if self._weight_stream is not None:
            return self._weight_stream.config, self._weight_stream
        if model_path is not None:
            if overrides:
                raise ValueError("config_overrides apply to presets only, not to a checkpoint")
            # checked now, streamed into the model by the runner; an FP8 release stays quantised
            reader = CheckpointReader(model_path, dtype=self.dtype, device=self.device,
                                      include_mtp=self.speculative is not None, keep_quantized=_is_fp8(model_path))
            return reader.config, reader
        cfg = DSV4Config.preset(preset, **overrides)
        logger.warning("no model path: the built-in %r preset has SEEDED RANDOM WEIGHTS (seed %d), so its "
                       "output is meaningless text; pass a real DeepSeek-V4 checkpoint (model_path / "
                       "--model-path DIR) for real answers", preset, seed)
        draw = dict(seed=seed, dtype=self.dtype, device=self.device, include_mtp=self.speculative is not None,
                    draw_on_device=self._weights_on_device)
        if self._ranked:   # every rank keeps only its slices: draw tensor by tensor as they stream in
            return cfg, RandomWeightStream(cfg, **draw)
        return cfg, random_weights(cfg, **draw)

    def _plan(self, conf: DSV4PoolConfigurator, weights: Union[dict[str, torch.Tensor], WeightStream],
              max_total_tokens: Optional[int], mem_fraction_static: Optional[float]) -> PoolPlan:
        if max_total_tokens is not None and mem_fraction_static is not None:
            raise ValueError("pass max_total_tokens or mem_fraction_static, not both")
        if max_total_tokens is None and mem_fraction_static is None:
            if self.device.type == "cpu":
                max_total_tokens = self.context_length
            else:
                mem_fraction_static = DEFAULT_GPU_MEM_FRACTION
        if max_total_tokens is not None:
            return conf.plan_for_tokens(max_total_tokens)
        shard = self.ranks.shard if self.ranks is not None else None
        weight_bytes = weight_nbytes(weights, shard, self.config, self.dtype)
        budget = int(_available_bytes(self.device) * mem_fraction_static) - weight_bytes
        if budget <= 0:
            raise ValueError(f"mem_fraction_static={mem_fraction_static} leaves no memory for the KV pools "
                             f"after {weight_bytes / 2**30:.2f} GiB of weights")
        return conf.plan_for_budget(budget)

    def memory_plan_table(self) -> str:
        return self.plan.table()

    # ---- validation -----------------------------------------------------------------

    def _validate(self, req: GenerateRequest) -> None:
        ids = req.input_ids
        if not ids:
            raise InvalidRequest("the prompt is empty", param="input_ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequest("input_ids must be integers", param="input_ids")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                                 param="input_ids")
        p = req.sampling_params
        p.validate()
        p.normalize(self.vocab_size)
        n, limit = len(ids), min(self.context_length, self.max_total_tokens)
        what = "context length" if limit == self.context_length else "KV pool capacity (max_total_tokens)"
        if n + p.max_new_tokens > limit:
            raise InvalidRequest(
                f"the prompt ({n} tokens) plus max_new_tokens ({p.max_new_tokens}) = {n + p.max_new_tokens} "
                f"exceeds the {what} of {limit} tokens", param="max_new_tokens" if n < limit else "input_ids")
        if p.stop and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer (the engine runs with skip_tokenizer_init)",
                                 param="stop")
        if any(not isinstance(t, int) or t < 0 for t in p.stop_token_ids):
            raise InvalidRequest("stop_token_ids must be non-negative integers", param="stop_token_ids")
        if isinstance(req.top_logprobs_num, bool) or not isinstance(req.top_logprobs_num, int) \
                or req.top_logprobs_num < 0:
            raise InvalidRequest(f"top_logprobs_num must be an integer >= 0, got {req.top_logprobs_num!r}",
                                 param="top_logprobs_num")

    def _make_request(self, prompt: Optional[str], input_ids: Optional[list[int]],
                      sampling_params: Union[None, dict, SamplingParams], return_logprob: bool,
                      logprob_start_len: Optional[int], top_logprobs_num: int, stream: bool) -> GenerateRequest:
        if input_ids is None:
            if prompt is None:
                raise InvalidRequest("give a prompt or input_ids", param="prompt")
            if self.tokenizer is None:
                raise InvalidRequest("text prompts need a tokenizer (the engine runs with skip_tokenizer_init); "
                                     "pass input_ids", param="prompt")
            input_ids = self.tokenizer.encode(prompt)
        params = (sampling_params if isinstance(sampling_params, SamplingParams)
                  else SamplingParams.from_dict(sampling_params))
        return GenerateRequest(input_ids=list(input_ids), sampling_params=params, return_logprob=return_logprob,
                               logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
                               top_logprobs_num=top_logprobs_num, stream=stream)

    # ---- offline API ----------------------------------------------------------------

    def generate(self, prompt: Union[None, str, list[str]] = None,
                 input_ids: Union[None, list[int], list[list[int]]] = None,
                 sampling_params: Union[None, dict, SamplingParams, list] = None,
                 return_logprob: bool = False, logprob_start_len: Optional[int] = None,
                 top_logprobs_num: int = 0, stream: bool = False) -> Any:
        """One request (a dict back) or a list (a list of dicts back, in order).

        Each dict: ``{"text", "output_ids", "meta_info"}`` with ``prompt_tokens``,
        ``completion_tokens``, ``finish_reason`` and, with ``return_logprob``, the logprob lists.
        ``stream=True`` returns an iterator of incremental dicts (``text`` and ``output_ids`` hold
        only what is new; with a list of requests each dict also carries ``index``).
        As in SGLang, ``generate(prompt, {"temperature": 0})`` also works: a dict (or
        SamplingParams) given in the ``input_ids`` place is taken as the sampling parameters.
        """
        if isinstance(input_ids, (dict, SamplingParams)) or (
                isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], (dict, SamplingParams))):
            if sampling_params is not None:
                raise InvalidRequest("sampling parameters given twice", param="sampling_params")
            input_ids, sampling_params = None, input_ids
        batch = isinstance(prompt, list) or (isinstance(input_ids, list) and input_ids
                                             and isinstance(input_ids[0], list))
        if batch:
            n = len(prompt) if isinstance(prompt, list) else len(input_ids)
            prompts = prompt if isinstance(prompt, list) else [None] * n
            ids = input_ids if input_ids is not None else [None] * n
            sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
            reqs = [self._make_request(prompts[i], ids[i], sps[i], return_logprob, logprob_start_len,
                                       top_logprobs_num, stream) for i in range(n)]
        else:
            reqs = [self._make_request(prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
                                       top_logprobs_num, stream)]
        for r in reqs:
            self._validate(r)
        if stream:
            return self._stream(reqs, batch)
        finals: dict[str, RequestOutput] = {}
        for out in self._run(reqs):
            if out.finished:
                finals[out.rid] = out
        results = [finals[r.rid].to_dict() for r in reqs]
        return results if batch else results[0]

    def _stream(self, reqs: list[GenerateRequest], batch: bool) -> Iterator[dict[str, Any]]:
        index = {r.rid: i for i, r in enumerate(reqs)}
        for out in self._run(reqs):
            d = {"text": out.delta_text, "output_ids": list(out.delta_ids), "meta_info": out.meta_info(),
                 "finished": out.finished}
            if batch:
                d["index"] = index[out.rid]
            yield d

    def _run(self, reqs: list[GenerateRequest]) -> Iterator[RequestOutput]:
        """Outputs of ``reqs`` as they are produced, until all have finished."""
        if self._closed:
            raise EngineStopped("the engine has been shut down")
        pending = {r.rid for r in reqs}
        if self._thread is not None:
            q: "queue.Queue[RequestOutput]" = queue.Queue()
            for r in reqs:
                self.submit(r, q.put, check_load=False)
            try:
                while pending:
                    out = q.get()
                    if out.finished:
                        pending.discard(out.rid)
                    yield out
            finally:
                for rid in pending:
                    self.abort(rid)
            return
        with self._lock:
            for r in reqs:
                self.scheduler.add(r)
            try:
                while pending:
                    outs = self.scheduler.step() + self.scheduler.take_rejections()
                    if not outs and self.scheduler.idle and pending:
                        raise RuntimeError(f"scheduler went idle with requests unfinished: {sorted(pending)}")
                    for out in outs:
                        if out.rid in pending:
                            if out.finished:
                                pending.discard(out.rid)
                            yield out
            finally:
                for rid in list(pending):
                    self.scheduler.abort(rid, "the caller stopped reading the stream")

    # ---- benchmarks -----------------------------------------------------------------

    def add_synthetic_request(self, context_len: int,
                              sampling_params: Union[None, dict, SamplingParams] = None,
                              rid: Optional[str] = None) -> str:
        """Queue a benchmark request whose ``context_len``-token context is synthetic; returns its id.

        The scheduler admits it through the same hooks as any request (request slot, the full and
        SWA pages of ``context_len`` tokens taken chunk by chunk with SWA eviction, as a prefill
        would), fills those slots with random valid rows instead of running the model, and emits a
        stand-in first token; it then decodes normally. Its prompt is ``context_len`` random ids.
        Offline only: drive it with :meth:`step` (or ``generate`` of other requests)."""
        if self._thread is not None:
            raise RuntimeError("add_synthetic_request is for offline benchmarks; stop the loop first")
        if context_len < 1:
            raise InvalidRequest(f"context_len must be >= 1, got {context_len}", param="context_len")
        ids = torch.randint(0, self.vocab_size, (context_len,), generator=self._synthetic_ids).tolist()
        req = self._make_request(None, ids, sampling_params, False, None, 0, False)
        if rid is not None:
            req.rid = rid
        self._validate(req)
        with self._lock:
            self.scheduler.add(req, synthetic=True)
        return req.rid

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step (offline): a forward over the next batch, or admissions only."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is running; step() is for offline use")
        with self._lock:
            return self.scheduler.step() + self.scheduler.take_rejections()

    # ---- online API -----------------------------------------------------------------

    def start(self) -> None:
        """Run the scheduler loop in a background thread (for ``submit``)."""
        if self._thread is not None:
            return
        if self._closed:
            raise EngineStopped("the engine has been shut down")
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="dsv4-engine", daemon=True)
        self._thread.start()

    def submit(self, req: GenerateRequest, callback: Callback, check_load: bool = True) -> None:
        """Validate now (InvalidRequest, EngineOverloaded) and queue; outputs go to ``callback``.

        A rid already in flight is refused (``param="rid"``); the request holding it is untouched."""
        if self._thread is None:
            raise EngineStopped("call start() before submit()")
        self._validate(req)
        with self._submit_lock:
            if req.rid in self._in_flight:
                raise InvalidRequest(f"request id {req.rid!r} is already in use by a request in flight",
                                     param="rid")
            if check_load and len(self.scheduler.waiting) + self._inbox.qsize() >= self.max_queued_requests:
                raise EngineOverloaded(f"{self.max_queued_requests} requests are already waiting; retry later")
            self._in_flight.add(req.rid)
        self._inbox.put(_Add(req, callback))

    def abort(self, rid: str, error: Optional[str] = None) -> None:
        """Finish ``rid`` (waiting, prefilling or decoding) and free its pages; unknown ids are ignored.

        ``error``: the request is ended by the server, not its client; its final output carries
        this message in ``error`` (and in the finish reason)."""
        if self._thread is not None:
            self._inbox.put(_Abort(rid, error))
        else:
            with self._lock:
                self.scheduler.abort(rid, error or "aborted")

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox(block=self.scheduler.idle)
            try:
                with self._lock:
                    outs = self.scheduler.step() + self.scheduler.take_rejections()
            except Exception:
                logger.exception("engine step failed; aborting every request")
                outs = self._abort_all("internal error in the engine step")
            for out in outs:
                self._deliver(out)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            with self._lock:
                if isinstance(item, _Add):
                    self._callbacks[item.req.rid] = item.callback
                    try:
                        self.scheduler.add(item.req)
                    except Exception as e:  # never let one request take the engine thread down
                        logger.exception("could not queue request %s", item.req.rid)
                        self._deliver(self._rejected(item.req, f"request rejected: {e}"))
                else:
                    out = self.scheduler.abort(item.rid, item.error or "aborted")
                    if out is not None:
                        out.error = item.error
                        self._deliver(out)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _abort_all(self, message: str) -> list[RequestOutput]:
        outs = []
        with self._lock:
            for rid in list(self.scheduler.reqs):
                out = self.scheduler.abort(rid, message)
                if out is not None:
                    out.error = message
                    outs.append(out)
        return outs

    @staticmethod
    def _rejected(req: GenerateRequest, message: str) -> RequestOutput:
        return RequestOutput(
            rid=req.rid, output_ids=[], delta_ids=[], text="", delta_text="", finished=True,
            finish_reason={"type": "abort", "message": message}, prompt_tokens=len(req.input_ids),
            completion_tokens=0, error=message)

    def _deliver(self, out: RequestOutput) -> None:
        if out.finished:
            with self._submit_lock:
                self._in_flight.discard(out.rid)
        cb = self._callbacks.pop(out.rid, None) if out.finished else self._callbacks.get(out.rid)
        if cb is None:
            return
        try:
            cb(out)
        except Exception:
            logger.exception("callback of request %s raised; aborting it", out.rid)
            if not out.finished:
                self._inbox.put(_Abort(out.rid))

    # ---- introspection --------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Running / waiting requests, cumulative token counts, and every pool's use."""
        s = self.scheduler
        return {
            "num_running": len(s.running),
            "num_waiting": len(s.waiting) + self._inbox.qsize(),
            "prompt_tokens_total": s.num_prompt_tokens,
            "generation_tokens_total": s.num_generated_tokens,
            "num_retractions": s.num_retractions,
            "attention_kernel": self.attention_kernel,
            "num_failed": s.num_failed,
            "overlap_steps": s.overlap.overlap_steps,
            "overlap": s.overlap.stats(),
            "pools": self.pool_usage(),
            **({"hisparse": self.pools.hisparse.stats()} if self.pools.hisparse is not None else {}),
            "prefix_cache": self.prefix_cache.stats() if self.prefix_cache is not None else None,
            **({"speculative": s.spec.stats()} if s.spec is not None else {}),
        }

    def pool_usage(self) -> dict[str, dict[str, int]]:
        """{pool: {"used", "total", "cached"}}: full / swa in tokens, req_slots, c4_rows,
        c4_indexer_rows, c4_ring_slots, c128_rows, c128_ring_rows or c128_online_slots (the
        allocator's accounting). ``used``: held by requests; ``cached``: held by the prefix cache
        alone (given back under pressure); free = total - used - cached."""
        cached = self.allocator.cached_stats()
        return {name: {**u, "cached": int(cached.get(name, 0))}
                for name, u in _pool_usage(self.allocator.stats()).items()}

    def flush_cache(self) -> None:
        """Empty the prefix cache (running requests keep what they hold)."""
        if self.prefix_cache is not None:
            with self._lock:
                self.prefix_cache.flush()

    def captured_logits(self, rid: str) -> torch.Tensor:
        """Raw logits of every position computed for a finished request: [n, V] (capture_logits
        only), from position ``captured_from(rid)`` (0 unless a cached prefix was not recomputed)."""
        return self.scheduler.captured[rid]

    def captured_from(self, rid: str) -> int:
        """The position of ``captured_logits(rid)[0]``."""
        return self.scheduler.captured_from[rid]

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        if self.ranks is not None and not self._closed:   # and every other rank's allocator is in rank 0's
            with self._lock:
                self.ranks.check_allocators(self.allocator)
        if self.pools.hisparse is not None:
            live = [self.allocator.req_slot(rid) for rid in self.allocator.live_requests]
            self.pools.hisparse.check_integrity(live)

    # ---- lifetime -------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the loop (unfinished requests are aborted) and drop the pools."""
        if self._closed:
            return
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        for out in self._abort_all("the engine shut down"):
            self._deliver(out)
        if self.ranks is not None:
            self.ranks.close()
        self._closed = True

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


class SyntheticContextFiller:
    """Writes random but valid contents into the pool slots a request holds (benchmarks only).

    KV and indexer pages are copied from a small bank of pages packed by ``memory.layout``'s
    writers from random rows (so every FP8 byte and scale is a real quantised value); C128 rows,
    which share pages with other requests, are written row by row; ring slots and the online
    C128 state get random state values (positive sums). The stored values do not change the cost
    of a decode step: top-k runs over the same number of rows whatever they hold.
    """

    BANK_PAGES = 8
    COPY_PAGES = 1024   # pages copied per indexing op (bounds the temporary)

    def __init__(self, pools: DSV4KVPools, allocator: KVAllocator, seed: int = 0):
        self.pools, self.allocator = pools, allocator
        self.device = pools.device
        self.gen = torch.Generator(device=self.device).manual_seed(seed + 2)
        self._banks: dict[tuple[str, int], torch.Tensor] = {}

    def _randn(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=self.device).to(dtype)

    def _bank(self, kind: str, page_bytes: int, device: torch.device) -> torch.Tensor:
        key = (kind, page_bytes, device)
        if key not in self._banks:
            indexer = kind == "c4_indexer"
            row_bytes, dim = (INDEXER_ROW_BYTES, 128) if indexer else (KV_ROW_BYTES, 512)
            bank = torch.zeros(self.BANK_PAGES, page_bytes, dtype=torch.uint8, device=self.device)
            n = self.BANK_PAGES * (page_bytes // row_bytes)
            slots = torch.arange(n, device=self.device)
            (write_indexer_rows if indexer else write_kv_rows)(bank, slots, self._randn(n, dim))
            self._banks[key] = bank.to(device)
        return self._banks[key]

    def _copy_pages(self, kind: str, pages: torch.Tensor) -> None:
        for pool in getattr(self.pools, kind).values():
            bank = self._bank(kind, pool.shape[1], pool.device)
            for i in range(0, pages.numel(), self.COPY_PAGES):
                part = pages[i:i + self.COPY_PAGES]
                pick = torch.randint(0, self.BANK_PAGES, (part.numel(),), generator=self.gen, device=self.device)
                pool[part.to(pool.device)] = bank[pick.to(pool.device)]   # HiSparse: c4_kv is the host pool

    @torch.inference_mode()
    def fill(self, rid: str, num_tokens: int) -> None:
        """Fill what ``rid`` holds for its positions ``0 .. num_tokens - 1``."""
        alloc, pools, plan = self.allocator, self.pools, self.pools.plan
        slot, dev = alloc.req_slot(rid), self.device
        if pools.hisparse is not None and dev.type == "cuda":
            # the host pool is written from the host below; under the overlap schedule a step may
            # still be in flight whose kernels write rows of pages just freed and reused here
            torch.cuda.synchronize(dev)
        full_slots = alloc.req_to_token[slot, :num_tokens].to(dev)
        swa_pages = [p for k in range(-(-num_tokens // SWA_PAGE)) if (p := alloc.swa_page_of(rid, k)) is not None]
        swa_pages_t = torch.tensor(swa_pages, dtype=torch.int64, device=dev)
        self._copy_pages("swa_kv", swa_pages_t)
        if plan.dense:
            return
        if pools.c4_kv:
            if plan.full_page == 4 * COMPRESSED_PAGE:   # one full page <-> one C4 page: owned by rid
                self._copy_pages("c4_kv", full_slots[::plan.full_page] // plan.full_page)
                self._copy_pages("c4_indexer", full_slots[::plan.full_page] // plan.full_page)
            else:
                rows = full_slots[::4] // 4
                for layer in pools.c4_kv:
                    c4 = pools.c4_kv[layer]     # on the host under HiSparse
                    write_kv_rows(c4, rows.to(c4.device), self._randn(rows.numel(), 512).to(c4.device))
                    write_indexer_rows(pools.c4_indexer[layer], rows, self._randn(rows.numel(), 128))
            ring = (swa_pages_t[:, None] * plan.c4_ring_size
                    + torch.arange(plan.c4_ring_size, device=dev)[None, :]).flatten()
            for kind in ("c4_ring", "c4_indexer_ring"):
                for t in getattr(pools, kind).values():
                    t[ring] = self._randn(ring.numel(), t.shape[1], dtype=t.dtype)
        if pools.c128_kv:
            rows = full_slots[::128] // 128
            for t in pools.c128_kv.values():
                write_kv_rows(t, rows, self._randn(rows.numel(), 512))
            for t in pools.c128_ring.values():
                ring = slot * plan.c128_ring_size + torch.arange(plan.c128_ring_size, device=dev)
                t[ring] = self._randn(ring.numel(), t.shape[1], dtype=t.dtype)
            for t in pools.c128_online.values():
                state = self._randn(*t.shape[1:], dtype=t.dtype)       # (max, sum, kv)
                state[1] = state[1].abs() + 0.5
                t[slot] = state


def _pool_usage(raw: dict[str, Any]) -> dict[str, dict[str, int]]:
    return {name: {"used": int(st.used), "total": int(st.total)} for name, st in raw.items()}
