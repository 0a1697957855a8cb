"""The model's tensors by their release names (DeepSeek-V4 checkpoint, no ``model.`` prefix).

``weight_specs(cfg)`` is the single list of every tensor a model of that config holds:
name, shape, and how the release stores it (``WeightKind``). The checkpoint loader, the
test-checkpoint writer, the random initialiser, the engine model and the reference
forward all read this list, so a name is spelled in exactly one place.

``random_weights(cfg, seed)`` gives seeded random weights: each tensor is drawn in fp32
from a generator seeded by (seed, name), so the float32 and float64 models of one seed
hold the same numbers, and adding a tensor never changes the others.

``model_tensors(cfg, dtype, quantized=...)`` is what a model holds in memory: every spec in its
compute dtype, or with ``quantized=True`` the FP8 kinds kept as e4m3 + an fp32 block scale and
the routed experts as e2m1 bytes + e8m0 scale bytes, under the release's names.
"""

from __future__ import annotations

import enum
import math
import zlib
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import torch

from .config import DSV4Config


class WeightKind(enum.Enum):
    FP8 = "fp8"      # e4m3 with a `.scale` tensor per 128x128 block (ue8m0), in quantised releases
    FP4 = "fp4"      # routed experts: int8-packed e2m1 pairs with a ue8m0 scale per 32 along K
    BF16 = "bf16"    # matrices stored in bf16 without a scale (embed, head, compressors, gate, ...)
    FP32 = "fp32"    # small parameters kept in fp32 (norm weights are bf16 in the release; see below)
    INT64 = "int64"  # the hash-routing table


FP8_BLOCK = 128         # FP8 weight scale block (128 x 128)
FP4_BLOCK = 32          # FP4 weight scale block along K

# Parameters that stay fp32 whatever the compute dtype (float64 runs promote them to float64).
FP32_PARAMS = ("attn_sink", "ape", "gate.bias", "hc_")


@dataclass(frozen=True)
class WeightSpec:
    name: str
    shape: tuple[int, ...]
    kind: WeightKind
    init_std: float = 0.0   # 0 -> see _init
    init_mean: float = 0.0


def _block_specs(cfg: DSV4Config, prefix: str, ratio: int, hash_routed: bool) -> list[WeightSpec]:
    D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    G, R, QR = cfg.o_groups, cfg.o_lora_rank, cfg.q_lora_rank
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    hc = cfg.hc_mult
    n_mix = hc * (2 + hc)
    F8, F4, B16, F32 = WeightKind.FP8, WeightKind.FP4, WeightKind.BF16, WeightKind.FP32
    s: list[WeightSpec] = []
    for sub in ("attn", "ffn"):
        s += [
            WeightSpec(f"{prefix}hc_{sub}_fn", (n_mix, hc * D), F32, (hc * D) ** -0.5),
            WeightSpec(f"{prefix}hc_{sub}_base", (n_mix,), F32, 0.5),
            WeightSpec(f"{prefix}hc_{sub}_scale", (3,), F32, 0.1, 0.5),
        ]
    a = f"{prefix}attn."
    s += [
        WeightSpec(f"{prefix}attn_norm.weight", (D,), B16, 0.05, 1.0),
        WeightSpec(f"{prefix}ffn_norm.weight", (D,), B16, 0.05, 1.0),
        WeightSpec(a + "wq_a.weight", (QR, D), F8, D ** -0.5),
        WeightSpec(a + "q_norm.weight", (QR,), B16, 0.05, 1.0),
        WeightSpec(a + "wq_b.weight", (H * hd, QR), F8, QR ** -0.5),
        WeightSpec(a + "wkv.weight", (hd, D), F8, D ** -0.5),
        WeightSpec(a + "kv_norm.weight", (hd,), B16, 0.05, 1.0),
        WeightSpec(a + "wo_a.weight", (G * R, H * hd // G), F8, (H * hd // G) ** -0.5),
        WeightSpec(a + "wo_b.weight", (D, G * R), F8, (G * R) ** -0.5),
        WeightSpec(a + "attn_sink", (H,), F32, 1.0),
    ]
    if ratio:
        coff = 2 if ratio == 4 else 1
        c = a + "compressor."
        s += [
            WeightSpec(c + "wkv.weight", (coff * hd, D), B16, D ** -0.5),
            WeightSpec(c + "wgate.weight", (coff * hd, D), B16, D ** -0.5),
            WeightSpec(c + "ape", (ratio, coff * hd), F32, 0.5),
            WeightSpec(c + "norm.weight", (hd,), B16, 0.05, 1.0),
        ]
    if ratio == 4:
        ih, idd = cfg.index_n_heads, cfg.index_head_dim
        ix = a + "indexer."
        s += [
            WeightSpec(ix + "wq_b.weight", (ih * idd, QR), F8, QR ** -0.5),
            WeightSpec(ix + "weights_proj.weight", (ih, D), B16, D ** -0.5),
            WeightSpec(ix + "compressor.wkv.weight", (2 * idd, D), B16, D ** -0.5),
            WeightSpec(ix + "compressor.wgate.weight", (2 * idd, D), B16, D ** -0.5),
            WeightSpec(ix + "compressor.ape", (4, 2 * idd), F32, 0.5),
            WeightSpec(ix + "compressor.norm.weight", (idd,), B16, 0.05, 1.0),
        ]
    f = f"{prefix}ffn."
    s.append(WeightSpec(f + "gate.weight", (E, D), B16, D ** -0.5))
    if hash_routed:
        s.append(WeightSpec(f + "gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), WeightKind.INT64))
    else:
        s.append(WeightSpec(f + "gate.bias", (E,), F32, 0.1))
    for e in range(E):
        x = f"{f}experts.{e}."
        s += [
            WeightSpec(x + "w1.weight", (I, D), F4, D ** -0.5),
            WeightSpec(x + "w3.weight", (I, D), F4, D ** -0.5),
            WeightSpec(x + "w2.weight", (D, I), F4, I ** -0.5),
        ]
    SI = I * cfg.n_shared_experts
    x = f + "shared_experts."
    s += [
        WeightSpec(x + "w1.weight", (SI, D), F8, D ** -0.5),
        WeightSpec(x + "w3.weight", (SI, D), F8, D ** -0.5),
        WeightSpec(x + "w2.weight", (D, SI), F8, SI ** -0.5),
    ]
    return s


def weight_specs(cfg: DSV4Config, include_mtp: bool = True) -> list[WeightSpec]:
    """Every tensor of the model, in a stable order (no quantisation scales: see checkpoint.py)."""
    D, V, hc = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    B16, F32 = WeightKind.BF16, WeightKind.FP32
    s = [
        WeightSpec("embed.weight", (V, D), B16, 1.0),
        WeightSpec("head.weight", (V, D), B16, D ** -0.5),
        WeightSpec("norm.weight", (D,), B16, 0.05, 1.0),
        WeightSpec("hc_head_fn", (hc, hc * D), F32, (hc * D) ** -0.5),
        WeightSpec("hc_head_base", (hc,), F32, 0.5),
        WeightSpec("hc_head_scale", (1,), F32, 0.1, 0.5),
    ]
    for i, ratio in enumerate(cfg.layer_ratios):
        s += _block_specs(cfg, f"layers.{i}.", ratio, cfg.is_hash_layer(i))
    if include_mtp:
        for j, ratio in enumerate(cfg.mtp_ratios):
            p = f"mtp.{j}."
            s += [
                WeightSpec(p + "e_proj.weight", (D, D), WeightKind.FP8, D ** -0.5),
                WeightSpec(p + "h_proj.weight", (D, D), WeightKind.FP8, D ** -0.5),
                WeightSpec(p + "enorm.weight", (D,), B16, 0.05, 1.0),
                WeightSpec(p + "hnorm.weight", (D,), B16, 0.05, 1.0),
                WeightSpec(p + "norm.weight", (D,), B16, 0.05, 1.0),
                WeightSpec(p + "hc_head_fn", (hc, hc * D), F32, (hc * D) ** -0.5),
                WeightSpec(p + "hc_head_base", (hc,), F32, 0.5),
                WeightSpec(p + "hc_head_scale", (1,), F32, 0.1, 0.5),
            ]
            s += _block_specs(cfg, p, ratio, hash_routed=False)
    return s


def is_fp32_param(name: str) -> bool:
    """Parameters the model keeps in (at least) fp32 whatever the compute dtype."""
    leaf = name.split(".", 2)[-1] if name.startswith(("layers.", "mtp.")) else name
    return any(tag in leaf for tag in FP32_PARAMS)


def param_dtype(name: str, kind: WeightKind, compute_dtype: torch.dtype) -> torch.dtype:
    if kind is WeightKind.INT64:
        return torch.int64
    if compute_dtype == torch.float64:
        return torch.float64
    if kind is WeightKind.FP32 or is_fp32_param(name):
        return torch.float32
    return compute_dtype


def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


def random_weights(
    cfg: DSV4Config,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    include_mtp: bool = True,
    draw_on_device: bool = False,
) -> dict[str, torch.Tensor]:
    """Seeded random weights for every spec, in the compute dtype (fp32 params kept fp32).

    ``draw_on_device=True`` draws each tensor with a generator on ``device`` itself (a model
    of tens of GiB is then made in seconds on a GPU instead of minutes on the CPU). The numbers
    are as seeded and reproducible, but a device's generator gives different ones than the
    CPU's, so only weights drawn the same way are "the same weights".
    """
    return dict(iter_random_weights(cfg, seed, dtype, device, include_mtp, draw_on_device))


def iter_random_weights(cfg: DSV4Config, seed: int = 0, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", include_mtp: bool = True,
                        draw_on_device: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`random_weights` one ``(name, tensor)`` at a time (each drawn when asked for)."""
    gen_device = torch.device(device) if draw_on_device else torch.device("cpu")
    for spec in weight_specs(cfg, include_mtp):
        g = torch.Generator(device=gen_device).manual_seed(_seed_for(seed, spec.name))
        if spec.kind is WeightKind.INT64:
            # each token gets num_experts_per_tok distinct experts
            r = torch.rand(spec.shape[0], cfg.n_routed_experts, generator=g, device=gen_device)
            t = r.argsort(dim=-1)[:, : spec.shape[1]].contiguous()
        else:
            t = torch.randn(spec.shape, generator=g, dtype=torch.float32, device=gen_device)
            t = t.mul_(spec.init_std).add_(spec.init_mean)
        yield spec.name, t.to(device=device, dtype=param_dtype(spec.name, spec.kind, dtype))


@dataclass
class RandomWeightStream:
    """A ``WeightStream`` of :func:`random_weights`' tensors, drawn as they are streamed (a
    rank of a parallel run keeps only its slice of each; the whole model never exists at once)."""

    config: DSV4Config
    seed: int
    dtype: torch.dtype
    device: str | torch.device
    draw_on_device: bool = False
    include_mtp: bool = False
    quantized: bool = False

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in model_tensors(self.config, self.dtype, self.include_mtp))

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter_random_weights(self.config, self.seed, self.dtype, self.device, self.include_mtp,
                                   self.draw_on_device)


# ---- the quantised in-memory layout ------------------------------------------------------------

def scale_name(weight_name: str) -> str:
    """Scales are named after the module: ``a.b.wq_a.weight`` -> ``a.b.wq_a.scale``."""
    return weight_name.removesuffix(".weight") + ".scale"


def fp8_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    out, inn = shape
    return (math.ceil(out / FP8_BLOCK), math.ceil(inn / FP8_BLOCK))


def fp4_packed_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    out, inn = shape
    return (out, inn // 2)


def fp4_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    out, inn = shape
    return (out, inn // FP4_BLOCK)


def keeps_quantized(spec: WeightSpec) -> bool:
    """Whether a quantised model keeps this weight in its stored FP8 / FP4 form: all of them.
    (``wo_a``, which the release multiplies in bf16 after folding its scales in, is kept as e4m3 +
    scales too and multiplied as that fold: ``layers.linear.Fp8WeightOnlyLinear``.)"""
    return spec.kind in (WeightKind.FP8, WeightKind.FP4)


class ModelTensor(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def model_tensors(cfg: DSV4Config, dtype: torch.dtype, include_mtp: bool = True,
                  quantized: bool = False) -> list[ModelTensor]:
    """Every tensor a model of compute dtype ``dtype`` holds, with the dtype it holds it in.

    ``quantized=False``: the specs, dtypes per :func:`param_dtype`. ``quantized=True``: FP8
    kinds (``wo_a`` included: W8A16) as ``float8_e4m3fn [out, in]`` + ``<module>.scale float32
    [ceil(out/128), ceil(in/128)]``; routed experts as ``uint8 [out, in/2]`` e2m1 pairs +
    ``<module>.scale uint8 [out, in/32]`` e8m0 bytes; the rest as without quantisation.
    """
    out: list[ModelTensor] = []
    for spec in weight_specs(cfg, include_mtp):
        if quantized and keeps_quantized(spec) and spec.kind is WeightKind.FP8:
            out += [ModelTensor(spec.name, spec.shape, torch.float8_e4m3fn),
                    ModelTensor(scale_name(spec.name), fp8_scale_shape(spec.shape), torch.float32)]
        elif quantized and keeps_quantized(spec):
            out += [ModelTensor(spec.name, fp4_packed_shape(spec.shape), torch.uint8),
                    ModelTensor(scale_name(spec.name), fp4_scale_shape(spec.shape), torch.uint8)]
        else:
            out.append(ModelTensor(spec.name, spec.shape, param_dtype(spec.name, spec.kind, dtype)))
    return out
