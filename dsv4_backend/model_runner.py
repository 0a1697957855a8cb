"""ModelRunner: one forward step of the engine model over the paged pools.

The scheduler decides what runs and extends the allocator first; the runner turns the step's
requests into a :class:`~dsv4_backend.backend.ForwardBatch`, lets the backend build its
metadata once, runs the model, and returns logits where each request asked for them.

    runner = ModelRunner.build(cfg, seed=0, dtype=torch.float64, max_total_tokens=4096)
    rid = "a"; runner.allocator.admit(rid); runner.allocator.extend(rid, len(prompt))
    [logits] = runner.forward([ForwardRequest(runner.allocator.req_slot(rid), 0, prompt, "all")])
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch

from memory.allocator import KVAllocator
from memory.configurator import DSV4PoolConfigurator
from memory.hisparse import HiSparseConfig
from memory.pools import DSV4KVPools
from memory.upload import upload

from . import triton_backend  # noqa: F401  (registers "triton"; triton itself loads on first use)
from .flashmla_backend import FLASHMLA_PAGE_ALIGN, resolve_attention_kernel  # registers "flashmla"
from .backend import ForwardBatch, get_attention_backend
from .checkpoint import WeightStream
from .input_ids import device_input_ids
from .cuda_graph import DecodeGraphs, GraphUnavailable, cuda_graph_default, graphs_supported
from .config import DSV4Config
from .model import DSV4Model, hi_dtype
from .parallel import RankShard
from .weights import random_weights

LogitsMode = Literal["last", "all", "none"]
logger = logging.getLogger(__name__)


@dataclass
class ForwardRequest:
    """One request's part of a step: the tokens at positions ``prefix_len ..``.

    The caller has already extended the allocator so ``req_to_token`` / ``full_to_swa`` cover
    ``prefix_len + len(input_ids)`` positions. A decode is ``len(input_ids) == 1``."""

    req_slot: int
    prefix_len: int
    input_ids: list[int]
    logits: LogitsMode = "last"
    rollback_len: Optional[int] = None   # speculative verify: the shortest length it may keep


def _sharded(shard: Optional[RankShard], tensors, config: DSV4Config):
    return tensors if shard is None else shard.shard_stream(tensors, config.n_routed_experts)


def default_backend(device: torch.device, dtype: torch.dtype) -> str:
    """The backend a runner gets when none is named: the Triton kernels on CUDA, the PyTorch
    path on the CPU and for exact float64 runs (the kernels compute in fp32 / bf16)."""
    return resolve_attention_kernel("triton", device, dtype)[0]


def pool_page_align(kernel: str) -> int:
    """The ``DSV4KVPools`` ``page_align`` an attention kernel needs."""
    return FLASHMLA_PAGE_ALIGN if kernel == "flashmla" else 1


class ModelRunner:
    """Owns the model and the attention backend; pools and allocator are the caller's.

    ``attention_kernel`` (``auto`` | ``flashmla`` | ``triton``) picks the GPU attention kernel when
    no ``backend`` is named: ``auto`` is FlashMLA where it imports on an sm90 / sm100 GPU and the
    pools were built with ``page_align=FLASHMLA_PAGE_ALIGN``, else Triton (on the CPU and in
    float64: the PyTorch path). ``attention_kernel`` / ``attention_kernel_reason`` say what ran and why.

    ``weights``: a dict of release names (a quantised model when it holds e4m3 tensors, as
    ``load_checkpoint(..., keep_quantized=True)`` gives) or a ``WeightStream`` (a ``CheckpointReader``),
    streamed into the model tensor by tensor.

    ``shard`` (``parallel.RankShard``): this process is one rank of a tensor / expert parallel
    run; the model holds its part and the weights are cut on their way in.

    ``forward`` returns per request logits ``[n, vocab]`` (float32, float64 in float64 mode):
    n = 1 for ``"last"``, ``len(input_ids)`` for ``"all"``, 0 for ``"none"``.
    """

    def __init__(self, config: DSV4Config, weights: dict[str, torch.Tensor] | WeightStream, pools: DSV4KVPools,
                 allocator: KVAllocator, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 backend: Optional[str] = None, dense: bool = False, cuda_graph: Optional[bool] = None,
                 cuda_graph_max_bs: Optional[int] = None, attention_kernel: str = "auto",
                 shard: Optional[RankShard] = None):
        self.config, self.pools, self.allocator = config, pools, allocator
        if getattr(pools, "hisparse", None) is not None:   # a freed request's hot rows go back
            allocator.on_free.append(pools.hisparse.release)
        self.device, self.dtype, self.dense = torch.device(device), dtype, dense
        if dense != bool(pools.plan.dense):
            raise ValueError(f"ModelRunner(dense={dense}) needs pools planned with dense={dense}")
        if not isinstance(weights, dict):
            # streamed into the model: no second copy of the weights at any time
            self.model = DSV4Model(config, dtype=dtype, device=self.device, include_mtp=weights.include_mtp,
                                   quantized=weights.quantized, shard=shard)
            self.model.load_stream(_sharded(shard, weights.stream(), config))
        else:
            include_mtp = any(name.startswith("mtp.") for name in weights)
            quantized = any(t.dtype == torch.float8_e4m3fn for t in weights.values())
            self.model = DSV4Model(config, dtype=dtype, device=self.device, include_mtp=include_mtp,
                                   quantized=quantized, shard=shard)
            if shard is None:
                self.model.load_state_dict(weights, strict=True)
            else:
                self.model.load_stream(_sharded(shard, weights.items(), config))
        self.model.eval()
        # FP4 experts into MMA fragment order once loaded (CUDA; DSV4_FP4_MMA=0 keeps the release layout)
        self.fp4_mma_layers = self.model.pack_experts_for_mma() if self.device.type == "cuda" else 0
        if self.fp4_mma_layers:
            logger.info("FP4 experts of %d layers repacked for the tensor-core MoE kernels", self.fp4_mma_layers)
        if backend is None:
            backend, why = resolve_attention_kernel(attention_kernel, self.device, dtype, config.num_attention_heads)
            align = getattr(pools, "page_align", 1)
            if backend == "flashmla" and align % FLASHMLA_PAGE_ALIGN:
                if attention_kernel == "flashmla":
                    raise ValueError(f"attention_kernel='flashmla' needs pools built with "
                                     f"page_align={FLASHMLA_PAGE_ALIGN}, these have {align}")
                backend, why = "triton", f"auto: the pools' pages are not {FLASHMLA_PAGE_ALIGN}-byte aligned"
        elif attention_kernel not in ("auto", backend):
            raise ValueError(f"backend={backend!r} and attention_kernel={attention_kernel!r} disagree")
        else:
            why = "backend named"
        self.backend_name = backend
        self.attention_kernel, self.attention_kernel_reason = backend, why
        self.backend = get_attention_backend(self.backend_name)(config, pools, allocator, dtype=dtype, dense=dense)
        # the last forward's final streams [T, hc, D] (the MTP draft layer's input)
        self.last_hidden: Optional[torch.Tensor] = None
        self.cuda_graphs: Optional[DecodeGraphs] = None
        if cuda_graph is None:
            cuda_graph = cuda_graph_default() and self.device.type == "cuda"
        if cuda_graph:
            why_not = graphs_supported(self)
            if why_not is None:
                max_bs = cuda_graph_max_bs or pools.plan.max_running_requests
                self.cuda_graphs = DecodeGraphs(self, max_bs=max_bs)
            else:
                logger.info("decode CUDA graphs off: %s", why_not)

    @property
    def memory_plan(self):
        return self.pools.plan

    @torch.inference_mode()
    def forward(self, reqs: list[ForwardRequest], prev_ids: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """``prev_ids``: the previous step's sampled ids on the device, for input ids that are
        placeholders (``dsv4_backend/input_ids.py``); None when there are none."""
        if not reqs:
            return []
        for r in reqs:
            if not r.input_ids:
                raise ValueError(f"request slot {r.req_slot}: a forward needs at least one new token")
            if r.logits not in ("last", "all", "none"):
                raise ValueError(f"request slot {r.req_slot}: logits must be 'last', 'all' or 'none', "
                                 f"got {r.logits!r}")
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(reqs):
            try:
                logits, hidden = self.cuda_graphs.run(reqs, prev_ids)
            except GraphUnavailable:
                pass     # logged; this step and the next run eagerly
            else:
                # the graph's output buffers are rewritten by the next replay: hand out copies
                self.last_hidden = hidden.clone()
                logits, q = logits.clone(), len(reqs[0].input_ids)
                rows = {"last": slice(q - 1, q), "all": slice(0, q), "none": slice(0, 0)}
                return [logits[i * q:(i + 1) * q][rows[r.logits]] for i, r in enumerate(reqs)]
        rollback = None
        if any(r.rollback_len is not None for r in reqs):
            rollback = [r.prefix_len + len(r.input_ids) if r.rollback_len is None else r.rollback_len
                        for r in reqs]
        batch = ForwardBatch([r.req_slot for r in reqs], [r.prefix_len for r in reqs],
                             [len(r.input_ids) for r in reqs], rollback)
        meta = self.backend.init_forward_metadata(batch)
        ids = device_input_ids([t for r in reqs for t in r.input_ids], self.device, prev_ids)
        X = self.model(ids, meta.positions.to(self.device), self.backend, meta)          # [T, hc, D]
        self.last_hidden = X
        pick, counts = [], []
        for r, start in zip(reqs, meta.token_offsets):
            n = len(r.input_ids)
            rows = {"last": [start + n - 1], "all": list(range(start, start + n)), "none": []}[r.logits]
            pick += rows
            counts.append(len(rows))
        if pick:
            logits = self.model.logits(X[upload(torch.tensor(pick, dtype=torch.int64), X.device)])
        else:
            logits = torch.empty(0, self.config.vocab_size, dtype=hi_dtype(self.dtype), device=X.device)
        return list(torch.split(logits, counts))

    # ---- construction for tests and tools --------------------------------------------------

    @classmethod
    def build(cls, config: DSV4Config | str = "tiny", *, seed: int = 0, dtype: torch.dtype = torch.float32,
              max_total_tokens: int = 4096, max_running_requests: int = 4, swa_ratio: float = 0.5,
              max_context: Optional[int] = None, online_compress: bool | None = None,
              state_dtype: Optional[torch.dtype] = None, dense: bool = False, backend: Optional[str] = None,
              weights: Optional[dict[str, torch.Tensor]] = None, device: str = "cpu",
              cuda_graph: Optional[bool] = None, attention_kernel: str = "auto",
              hisparse_config: Any = None, **preset_overrides: Any) -> "ModelRunner":
        """Config (or preset name), seeded random weights, a pool plan for ``max_total_tokens``,
        pools, allocator and runner in one call. State dtype: float64 in float64 mode, else the
        env flag's (``SGLANG_DSV4_COMPRESS_STATE_DTYPE``) unless given. ``hisparse_config``
        (a :class:`memory.hisparse.HiSparseConfig`, dict or JSON) turns HiSparse on."""
        cfg = DSV4Config.preset(config, **preset_overrides) if isinstance(config, str) else config
        if state_dtype is None and dtype == torch.float64:
            state_dtype = torch.float64
        hs = None if hisparse_config is None else HiSparseConfig.parse(hisparse_config)
        plan = DSV4PoolConfigurator(cfg, max_running_requests=max_running_requests, swa_ratio=swa_ratio,
                                    state_dtype=state_dtype, online_compress=online_compress, dense=dense,
                                    c4_shrink_factor=hs.host_to_device_ratio if hs else 1.0,
                                    ).plan_for_tokens(max_total_tokens)
        kernel = backend or resolve_attention_kernel(attention_kernel, torch.device(device), dtype,
                                                     cfg.num_attention_heads)[0]
        pools = DSV4KVPools(cfg, plan, device=device, state_dtype=state_dtype, page_align=pool_page_align(kernel),
                            hisparse=hs)
        allocator = KVAllocator(plan, max_context=max_context or plan.max_full_tokens,
                                window=cfg.sliding_window, dense=dense, device=device)
        if weights is None:
            weights = random_weights(cfg, seed=seed, dtype=dtype, device=device, include_mtp=False)
        return cls(cfg, weights, pools, allocator, device=device, dtype=dtype, backend=backend, dense=dense,
                   cuda_graph=cuda_graph, attention_kernel=attention_kernel)


def run_schedule(runner: ModelRunner, steps: list[list[tuple[str, int]]],
                 seqs: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """A scheduler stand-in for checks: run a fixed schedule and return every new position's logits.

    Each step is ``[(rid, n new tokens), ...]`` (one forward; requests join on first mention);
    tokens come from ``seqs[rid]``. Allocation and SWA eviction go through ``runner.allocator``
    exactly as the scheduler's hooks do; the requests stay admitted (the caller frees them).
    Returns ``{rid: logits [positions run, vocab]}``.
    """
    alloc, pos = runner.allocator, {}
    out: dict[str, list[torch.Tensor]] = {rid: [] for step in steps for rid, _ in step}
    for step in steps:
        reqs = []
        for rid, n in step:
            if rid not in alloc:
                if alloc.admit(rid) is None:
                    raise RuntimeError(f"no request slot for {rid!r}")
                pos[rid] = 0
            res = alloc.extend(rid, pos[rid] + n)
            if not res.ok:
                raise RuntimeError(f"cannot extend {rid!r} to {pos[rid] + n} tokens: {res}")
            reqs.append(ForwardRequest(alloc.req_slot(rid), pos[rid], seqs[rid][pos[rid]:pos[rid] + n], "all"))
        for (rid, n), logits in zip(step, runner.forward(reqs)):
            out[rid].append(logits)
            pos[rid] += n
            alloc.evict_swa(rid)
    return {rid: torch.cat(v) for rid, v in out.items()}
