"""The byte floor of one decode step: what it must read, divided by the copy bandwidth.

A decode step of ``batch`` requests, each with ``context`` tokens before the one it decodes (so
the new token sits at position ``p = context``), reads at least:

- weights actually used, in the form the model holds them (``weights.model_tensors``: compute
  dtype, or FP8 / FP4 bytes + scales when quantised): per layer the attention projections (wq_a,
  q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, attn_sink), the compressor and indexer projections
  (compressed mode only: dense steps skip them), the mHC mixes and the two block norms, the gate
  (plus one ``tid2eid`` row per token in hash layers), the shared expert, and the routed experts the
  batch selects: the EXPECTED number of distinct experts under uniform routing,
  ``E * (1 - (1 - k/E)^batch)`` (or a count the caller measured); outside the layers the embedding
  rows of the batch's tokens, the whole head, the final norm and hc_head;
- KV rows, per request and layer (DSV4.md section 9): the window ``min(p + 1, sliding_window)``
  rows of 584 B in every layer; CSA layers ``min(index_topk, visible)`` C4 rows of 584 B plus all
  ``visible = (p + 1) // 4`` indexer rows of 132 B (the scan); HCA layers all ``(p + 1) // 128``
  C128 rows. Dense mode: all ``p + 1`` rows of 584 B in every layer instead.

Left out (each well under 0.1% of a step at the benchmark's shapes): activations, the step's own
writes (a 584-byte row per layer, the ring's raw (C, Z)), the ring reads of a block completing
(amortised 1/m of 8 or 128 slots per step) and the step's metadata.

The floor is ``bytes / copy bandwidth``, the bandwidth counted as a device-to-device copy's bytes
read + written per second (:func:`copy_gbps`, as ``bench_kernels.py`` counts it), measured in the
same run as the step it judges.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from dsv4_backend.config import DSV4Config
from dsv4_backend.weights import model_tensors
from memory.configurator import INDEXER_ROW_BYTES, KV_ROW_BYTES

# Report order of the parts (weights first, then KV).
WEIGHT_PARTS = ("attention", "compressor_indexer", "mhc_norms", "gate", "shared_expert", "routed_experts",
                "embed_rows", "head")
KV_PARTS = ("kv_window", "kv_c4_topk", "kv_c128", "indexer_rows", "kv_dense")
EXPERTS_UNIFORM = "expected distinct under uniform routing"
# The breakdown's categories (bench/_bench_common.CATEGORIES) the bytes are also split by:
# attention weights and KV rows go to their layer's kind, the other parts as listed here.
CATEGORY_KEYS = ("attn_window", "attn_csa", "attn_hca", "moe", "mhc_norms", "embed_head")
PART_CATEGORY = {"mhc_norms": "mhc_norms", "gate": "moe", "shared_expert": "moe", "routed_experts": "moe",
                 "embed_rows": "embed_head", "head": "embed_head"}


def distinct_experts(n_experts: int, per_token: int, tokens: int) -> float:
    """Expected distinct experts ``tokens`` tokens touch when each picks ``per_token`` distinct
    ones uniformly: an expert is missed by one token with probability ``1 - per_token / n``."""
    return n_experts * (1.0 - (1.0 - per_token / n_experts) ** tokens)


@dataclass(frozen=True)
class StepFloor:
    """Bytes one decode step must read, by part (``WEIGHT_PARTS`` + ``KV_PARTS`` keys)."""

    parts: dict[str, float]
    categories: dict[str, float]         # the same bytes by the breakdown's categories (CATEGORIES)
    experts_per_layer: float             # distinct routed experts read per MoE layer
    experts_how: str                     # EXPERTS_UNIFORM or "measured"
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def weight_bytes(self) -> float:
        return sum(self.parts.get(k, 0.0) for k in WEIGHT_PARTS)

    @property
    def kv_bytes(self) -> float:
        return sum(self.parts.get(k, 0.0) for k in KV_PARTS)

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    def ms(self, gbps: float) -> float:
        """The floor in ms at ``gbps`` GB/s of copy bandwidth."""
        return self.total_bytes / (gbps * 1e9) * 1e3

    def to_dict(self, gbps: Optional[float] = None) -> dict[str, Any]:
        d = {"parts": dict(self.parts), "categories": dict(self.categories), "weight_bytes": self.weight_bytes, "kv_bytes": self.kv_bytes,
             "total_bytes": self.total_bytes, "experts_per_layer": self.experts_per_layer,
             "experts_how": self.experts_how}
        if gbps:
            d["copy_gbps"], d["floor_ms"] = gbps, self.ms(gbps)
        return d


def _weight_part(name: str) -> Optional[str]:
    """The floor part a tensor of ``model_tensors`` belongs to (None: not read by a decode step
    as a whole: the embedding, the hash table and routed experts are counted by rows / experts)."""
    if not name.startswith("layers."):
        return None if name.startswith("embed.") else "head"
    leaf = name.split(".", 2)[2]
    if leaf.startswith(("attn.compressor.", "attn.indexer.")):
        return "compressor_indexer"
    if leaf.startswith("attn."):
        return "attention"
    if leaf.startswith(("hc_", "attn_norm.", "ffn_norm.")):
        return "mhc_norms"
    if leaf.startswith("ffn.gate."):
        return None if leaf == "ffn.gate.tid2eid" else "gate"
    if leaf.startswith("ffn.shared_experts."):
        return "shared_expert"
    if leaf.startswith("ffn.experts."):
        return None
    raise ValueError(f"floor: no part for tensor {name!r}")


def decode_step_floor(cfg: DSV4Config, context: int, batch: int, dtype: torch.dtype = torch.bfloat16,
                      quantized: bool = False, dense: bool = False,
                      experts_per_layer: Optional[float] = None) -> StepFloor:
    """Bytes a decode step of ``batch`` requests at ``context`` must read (module docstring).

    ``experts_per_layer``: distinct routed experts read per MoE layer, if measured; default the
    expectation under uniform routing for ``batch`` tokens."""
    if context < 0 or batch < 1:
        raise ValueError(f"floor: context must be >= 0 and batch >= 1, got context={context}, batch={batch}")
    tensors = model_tensors(cfg, dtype, include_mtp=False, quantized=quantized)
    parts = {k: 0.0 for k in WEIGHT_PARTS + KV_PARTS}
    cats = {k: 0.0 for k in CATEGORY_KEYS}
    kind = {0: "attn_window", 4: "attn_csa", 128: "attn_hca"}
    layer_cat = [kind[r] for r in cfg.layer_ratios]

    def add(part: str, nbytes: float, layer: Optional[int]) -> None:
        parts[part] += nbytes
        cats[PART_CATEGORY.get(part) or layer_cat[layer]] += nbytes

    expert0 = "layers.0.ffn.experts.0."
    expert_bytes = sum(t.nbytes for t in tensors if t.name.startswith(expert0))
    for t in tensors:
        part = _weight_part(t.name)
        layer = int(t.name.split(".")[1]) if t.name.startswith("layers.") else None
        if part is not None and not (dense and part == "compressor_indexer"):
            add(part, t.nbytes, layer)
        elif t.name == "embed.weight":
            add("embed_rows", batch * t.nbytes / t.shape[0], None)
        elif t.name.endswith("ffn.gate.tid2eid"):
            add("gate", batch * t.nbytes / t.shape[0], layer)
    how = EXPERTS_UNIFORM if experts_per_layer is None else "measured"
    if experts_per_layer is None:
        experts_per_layer = distinct_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, batch)
    add("routed_experts", cfg.num_hidden_layers * experts_per_layer * expert_bytes, None)

    p = context
    visible_c4, visible_c128 = (p + 1) // 4, (p + 1) // 128
    for i, ratio in enumerate(cfg.layer_ratios):
        if dense:
            add("kv_dense", batch * (p + 1) * KV_ROW_BYTES, i)
            continue
        add("kv_window", batch * min(p + 1, cfg.sliding_window) * KV_ROW_BYTES, i)
        if ratio == 4:
            add("kv_c4_topk", batch * min(cfg.index_topk, visible_c4) * KV_ROW_BYTES, i)
            add("indexer_rows", batch * visible_c4 * INDEXER_ROW_BYTES, i)
        elif ratio == 128:
            add("kv_c128", batch * visible_c128 * KV_ROW_BYTES, i)
    notes = {"context": context, "batch": batch, "dense": dense, "quantized": quantized, "dtype": str(dtype)}
    return StepFloor(parts, cats, experts_per_layer, how, notes)


def copy_gbps(device: torch.device, nbytes: Optional[int] = None, iters: Optional[int] = None) -> float:
    """Device-to-device copy bandwidth in GB/s, bytes read + written: a 1 GiB copy on CUDA (64 MiB
    on the CPU), timed over ``iters`` copies after three untimed ones."""
    cuda = device.type == "cuda"
    n = nbytes or ((1 << 30) if cuda else (1 << 26))
    iters = iters or (50 if cuda else 5)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - t0) / iters
    return 2 * n / seconds / 1e9
