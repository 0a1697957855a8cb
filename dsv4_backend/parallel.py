"""Tensor and expert parallelism: which slice of every tensor a rank holds, and the collectives.

A run of ``world = max(tp_size, ep_size)`` ranks (each of ``tp_size`` and ``ep_size`` is 1 or
``world``), one process per rank, joined by ``torch.distributed`` (NCCL on CUDA, gloo on the CPU).
Every rank runs the same forward over the same tokens; a rank holds (docs/parallel.md draws it):

    attention (tp)   query heads H / tp: wq_b rows, attn_sink, wo_a's groups G / tp and wo_b's
                     matching input columns (all-reduce of wo_b's output); the indexer's wq_b rows
                     (``Indexer.gather_heads`` all-gathers its q, so top-k scores every head on
                     every rank). wq_a, wkv,
                     the compressors, the norms and the KV pools are whole on every rank: the
                     512-d KV row is shared by all heads (MQA), so each rank writes the same rows.
    MoE (ep / tp)    ep > 1: routed experts E / ep, whole; ep = 1: every routed expert's
                     intermediate dim / tp. The shared expert's intermediate dim / world. One
                     all-reduce of the layer's output (partial sums of every rank's experts).
    vocabulary       embed and head rows V / world (all-reduce of the masked lookup; all-gather
                     of the logits).
    everything else  whole on every rank (gate, hash table, mHC, norms, MTP projections).

The split is a loader transform (gpt-fast's ``apply_tp``): :meth:`RankShard.shard` reshapes a
freshly built ``DSV4Model`` (local head / group counts, this rank's experts, the vocabulary
embedding, the indexer's gather, the all-reduces as forward hooks on ``wo_b``, the MoE and the
head, each a module its caller runs alone) before its tensors are allocated, and
:meth:`RankShard.shard_stream` cuts each release tensor (weights and their block scales alike)
on its way in. Names stay the release's, but routed experts renumber from 0 on each rank.
"""

from __future__ import annotations

import functools
import re
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from .weights import ModelTensor

QUANT_BLOCK = 128   # the activation quantisation block: split input dims keep it whole


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks split attention (``tp_size``) and the routed experts (``ep_size``), and
    which rank this process is. ``world_size = max(tp_size, ep_size)``."""

    tp_size: int = 1
    ep_size: int = 1
    rank: int = 0

    def __post_init__(self):
        for name in ("tp_size", "ep_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.tp_size not in (1, self.world_size) or self.ep_size not in (1, self.world_size):
            raise ValueError(f"tp_size={self.tp_size}, ep_size={self.ep_size}: each must be 1 or the other "
                             f"(one group of max(tp, ep) ranks)")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside 0 .. {self.world_size - 1}")

    @property
    def world_size(self) -> int:
        return max(self.tp_size, self.ep_size)

    def parts(self, axis: str) -> int:
        """Ranks a tensor of split ``axis`` is cut into: tp (attention), world (vocabulary, the
        shared expert) or moe (a routed expert's intermediate dim: tp when experts are whole)."""
        if axis == "tp":
            return self.tp_size
        if axis == "world":
            return self.world_size
        return 1 if self.ep_size > 1 else self.tp_size

    def expert_range(self, n_experts: int) -> tuple[int, int]:
        """Global ids ``lo .. hi - 1`` of the routed experts this rank holds."""
        if self.ep_size == 1:
            return 0, n_experts
        n = n_experts // self.ep_size
        return self.rank * n, (self.rank + 1) * n


@dataclass(frozen=True)
class Split:
    """A rank's slice: part ``index`` of ``parts`` equal parts along ``dim``."""

    dim: int
    parts: int
    index: int

    def size(self, name: str, shape: tuple[int, ...]) -> int:
        n = shape[self.dim]
        if n % self.parts:
            raise ValueError(f"{name}: dim {self.dim} of size {n} does not split into {self.parts} ranks")
        return n // self.parts

    def local_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        out = list(shape)
        out[self.dim] = self.size(name, shape)
        return tuple(out)

    def take(self, name: str, t: torch.Tensor) -> torch.Tensor:
        n = self.size(name, tuple(t.shape))
        return t.narrow(self.dim, self.index * n, n)


# (name pattern, dim, axis); names are the release's (``layers.i.`` or ``mtp.j.`` prefixed)
_RULES = [
    (r"^embed\.weight$", 0, "world"),
    (r"^head\.weight$", 0, "world"),
    (r"\.attn\.wq_b\.(weight|scale)$", 0, "tp"),
    (r"\.attn\.attn_sink$", 0, "tp"),
    (r"\.attn\.wo_a\.(weight|scale)$", 0, "tp"),
    (r"\.attn\.wo_b\.(weight|scale)$", 1, "tp"),
    (r"\.attn\.indexer\.wq_b\.(weight|scale)$", 0, "tp"),
    (r"\.ffn\.shared_experts\.w[13]\.(weight|scale)$", 0, "world"),
    (r"\.ffn\.shared_experts\.w2\.(weight|scale)$", 1, "world"),
    (r"\.ffn\.experts\.\d+\.w[13]\.(weight|scale)$", 0, "moe"),
    (r"\.ffn\.experts\.\d+\.w2\.(weight|scale)$", 1, "moe"),
]
_RULES_RE = [(re.compile(p), dim, axis) for p, dim, axis in _RULES]
EXPERT_NAME = re.compile(r"^(.*\.ffn\.experts\.)(\d+)(\..*)$")


_INDEX = re.compile(r"\.\d+\.")


@functools.lru_cache(maxsize=None)
def _rule(shape_name: str) -> Optional[tuple[int, str]]:
    for pattern, dim, axis in _RULES_RE:
        if pattern.search(shape_name):
            return dim, axis
    return None


def split_of(name: str, pc: ParallelConfig) -> Optional[Split]:
    """The slice of tensor ``name`` rank ``pc.rank`` holds (None: the whole tensor)."""
    rule = _rule(_INDEX.sub(".0.", name))   # one lookup per kind of tensor, not per layer / expert
    if rule is None:
        return None
    parts = pc.parts(rule[1])
    return Split(rule[0], parts, pc.rank) if parts > 1 else None


def local_name(name: str, pc: ParallelConfig, n_experts: int) -> Optional[str]:
    """``name`` as this rank's model calls it (routed experts renumbered from this rank's first),
    or None when the tensor belongs to another rank's expert."""
    m = EXPERT_NAME.match(name)
    if m is None or pc.ep_size == 1:
        return name
    lo, hi = pc.expert_range(n_experts)
    e = int(m.group(2))
    return f"{m.group(1)}{e - lo}{m.group(3)}" if lo <= e < hi else None


def check_shardable(cfg: Any, pc: ParallelConfig) -> None:
    """Raise ValueError naming the config field a split cannot divide."""
    w = pc.world_size
    if w == 1:
        return
    checks = [("vocab_size", cfg.vocab_size, w), ("moe_intermediate_size x n_shared_experts",
                                                  cfg.moe_intermediate_size * cfg.n_shared_experts, w)]
    if pc.tp_size > 1:
        checks += [("num_attention_heads", cfg.num_attention_heads, pc.tp_size),
                   ("o_groups", cfg.o_groups, pc.tp_size), ("index_n_heads", cfg.index_n_heads, pc.tp_size)]
    if pc.ep_size > 1:
        checks.append(("n_routed_experts", cfg.n_routed_experts, pc.ep_size))
    else:
        checks.append(("moe_intermediate_size", cfg.moe_intermediate_size, pc.tp_size))
    for field, n, parts in checks:
        if n % parts:
            raise ValueError(f"{field} = {n} does not split into {parts} ranks "
                             f"(tp_size={pc.tp_size}, ep_size={pc.ep_size})")


def _check_blocks(tensors: list[ModelTensor], pc: ParallelConfig) -> None:
    """A quantised weight and its block scale must split on block boundaries, and a split input
    dim must keep whole 1 x 128 activation-quantisation blocks (so every rank rounds exactly the
    values one rank would)."""
    by_name = {t.name: t for t in tensors}
    for t in tensors:
        if not t.name.endswith(".scale") or (s := split_of(t.name, pc)) is None:
            continue
        w = by_name[t.name[: -len("scale")] + "weight"]
        packed = 2 if w.dtype == torch.uint8 and s.dim == 1 else 1    # e2m1 pairs along the input dim
        values = w.shape[s.dim] * packed
        block = values // t.shape[s.dim]
        need = max(block, QUANT_BLOCK) if s.dim == 1 else block
        if values % s.parts or (values // s.parts) % need:
            raise ValueError(f"{w.name}: its {values} values along dim {s.dim} do not split into {s.parts} "
                             f"ranks of whole {need}-value blocks")


class Comm:
    """The collectives the sharded model calls, over one process group (None: the default)."""

    def __init__(self, world_size: int, group: Any = None):
        self.world_size, self.group = world_size, group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (every rank gets the same bits)."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Rank-ordered concatenation of every rank's ``x`` along ``dim``."""
        x = x.contiguous()
        if x.is_cuda:   # one output buffer: capturable in a CUDA graph
            out = torch.empty((self.world_size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


class VocabParallelEmbedding(nn.Module):
    """``embed.weight`` rows ``lo .. lo + n - 1``: a token another rank holds looks up zeros here,
    and the all-reduce adds the one rank's row to zeros (exact in any dtype)."""

    def __init__(self, vocab: int, dim: int, lo: int, comm: Comm):
        super().__init__()
        self.lo, self.comm = lo, comm
        self.weight = nn.Parameter(torch.empty(vocab, dim), requires_grad=False)   # cut by RankShard.shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = self.weight.shape[0]
        local = ids - self.lo
        mine = (local >= 0) & (local < n)
        rows = self.weight[local.clamp(0, n - 1)]
        return self.comm.all_reduce(torch.where(mine[:, None], rows, torch.zeros_like(rows)))


class RankShard:
    """One rank's view of the model: the split rules applied to modules, tensor lists and streams."""

    def __init__(self, pc: ParallelConfig, comm: Comm):
        self.config, self.comm = pc, comm

    def _reduce(self, _module: nn.Module, _inputs: Any, out: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(out)

    def _gather(self, _module: nn.Module, _inputs: Any, out: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(out, -1)

    def shard(self, model: nn.Module) -> None:
        """Reshape a just-built ``DSV4Model`` (its tensors not yet placed) into this rank's part.

        With one rank the model is left alone, unless a process group is up (NCCL with one
        rank, e.g. a one-GPU benchmark of this code path): then every collective still runs."""
        pc, cfg = self.config, model.cfg
        check_shardable(cfg, pc)
        if pc.world_size == 1 and not dist.is_initialized():
            return
        for block in list(model.layers) + list(model.mtp or []):
            attn, moe = block.attn, block.ffn
            if pc.tp_size == pc.world_size:
                attn.n_heads //= pc.tp_size
                attn.o_groups //= pc.tp_size
                attn.wo_b.register_forward_hook(self._reduce)
                if attn.indexer is not None:
                    attn.indexer.head_comm = self.comm
            if pc.ep_size > 1:
                lo, hi = pc.expert_range(len(moe.experts))
                moe.experts = nn.ModuleList(list(moe.experts)[lo:hi])
                moe.expert_range = (lo, hi)
            moe.register_forward_hook(self._reduce)
        V, D = model.embed.weight.shape
        model.embed = VocabParallelEmbedding(V, D, pc.rank * (V // pc.world_size), self.comm)
        model.head.register_forward_hook(self._gather)
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            s = split_of(name, pc)
            if s is not None:
                t.data = torch.empty(s.local_shape(name, tuple(t.shape)), dtype=t.dtype)

    def local_tensors(self, tensors: list[ModelTensor], n_experts: int) -> list[ModelTensor]:
        """``weights.model_tensors`` as this rank holds them (names, shapes)."""
        pc, out = self.config, []
        _check_blocks(tensors, pc)
        for t in tensors:
            name = local_name(t.name, pc, n_experts)
            if name is None:
                continue
            s = split_of(t.name, pc)
            out.append(ModelTensor(name, s.local_shape(t.name, t.shape) if s else t.shape, t.dtype))
        return out

    def shard_stream(self, tensors: Iterable[tuple[str, torch.Tensor]], n_experts: int
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """Release ``(name, tensor)`` pairs -> this rank's ``(local name, slice)`` (a view)."""
        pc = self.config
        for name, t in tensors:
            local = local_name(name, pc, n_experts)
            if local is None:
                continue
            s = split_of(name, pc)
            yield local, (s.take(name, t) if s else t)

    def local_nbytes(self, tensors: list[ModelTensor], n_experts: int) -> int:
        """Device bytes of this rank's part of ``tensors``."""
        return sum(t.nbytes for t in self.local_tensors(tensors, n_experts))


def free_port() -> int:
    """A TCP port free on this host now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankGroup:
    """This process's membership: its shard (rules + collectives over the model's group) and a
    gloo group for Python objects (the step broadcast; on the CPU, the same group). ``owned``:
    this process made the default group (and so leaves it at the end), not its launcher."""

    shard: RankShard
    objects: Any
    owned: bool = True

    @property
    def config(self) -> ParallelConfig:
        return self.shard.config


def init_ranks(pc: ParallelConfig, port: Optional[int], device: torch.device, timeout_s: float = 600.0) -> RankGroup:
    """Join the ``pc.world_size`` ranks at ``127.0.0.1:port``, or, with ``port`` None, where
    torchrun's MASTER_ADDR / MASTER_PORT say (``env://``); a default group its launcher already
    made is used as it is. NCCL when ``device`` is CUDA (with a gloo group beside it for
    objects), gloo otherwise. On CUDA the rank's device is set first."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device.index if device.index is not None else pc.rank)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl" if cuda else "gloo",
                                init_method="env://" if port is None else f"tcp://127.0.0.1:{port}",
                                rank=pc.rank, world_size=pc.world_size, timeout=timedelta(seconds=timeout_s))
    elif (dist.get_rank(), dist.get_world_size()) != (pc.rank, pc.world_size):
        raise ValueError(f"the process group has rank {dist.get_rank()} of {dist.get_world_size()}, "
                         f"the engine wants rank {pc.rank} of {pc.world_size}")
    objects = dist.new_group(backend="gloo") if cuda else None
    if cuda:   # NCCL sets its communicator up on the first collective: eagerly, not inside a graph capture
        dist.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())))
    return RankGroup(RankShard(pc, Comm(pc.world_size)), objects, owned)


def close_ranks(group: Optional[RankGroup] = None) -> None:
    """Leave the default group, unless ``group`` joined one its launcher made (the launcher
    owns it)."""
    if dist.is_initialized() and (group is None or group.owned):
        dist.destroy_process_group()


def rank_weight_bytes(cfg: Any, tp_size: int, ep_size: int, dtype: torch.dtype = torch.bfloat16,
                      quantized: Optional[bool] = None) -> int:
    """Device bytes of one rank's weights as the server keeps them (no MTP; quantised when
    ``quantized``, by default when the config is an FP8 release): what the memory plan subtracts
    per GPU. Every split is into equal parts, so every rank holds the same bytes."""
    from .weights import model_tensors

    quantized = cfg.quantization == "fp8" if quantized is None else quantized
    tensors = model_tensors(cfg, dtype, include_mtp=False, quantized=quantized)
    pc = ParallelConfig(tp_size, ep_size)
    check_shardable(cfg, pc)
    return RankShard(pc, Comm(pc.world_size)).local_nbytes(tensors, cfg.n_routed_experts)
