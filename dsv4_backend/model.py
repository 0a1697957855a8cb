"""The engine's DeepSeek-V4 model: every tensor under its release name, attention delegated.

``DSV4Model(cfg, dtype)`` holds exactly the tensors of ``weights.weight_specs(cfg)`` (so
``model.load_state_dict(random_weights(cfg, seed, dtype))`` loads a model), and runs the
token-parallel maths of DSV4.md section 2: mHC streams with Sinkhorn mixing, low-rank Q with
the weightless per-head norm, RoPE / YaRN per layer type, the grouped output projection, MoE
with hash routing and the shared expert, and the hc_head.

The attention layers stay thin: they compute q, the new KV row, the compressors' raw (C, Z)
and the indexer's q and head weights, and hand them to an attention backend
(``backend.forward(layer_id, layer, AttentionInputs, metadata)``), which owns every pool, ring
and compression. This module never imports the backend; the backend reads the layer's
compressor norms, ``rope`` and ``attn_sink`` through the layer object it is given.

On CUDA (float32 / bfloat16) the mHC mix, collapse and expand run as fused Triton kernels
(``kernels/mhc.py``; at decode sizes the mix straight from the streams; ``DSV4_MHC_KERNELS=0``
turns them off), and in bfloat16 the routed experts
are allocated as stacked slices and run as two ``torch._grouped_mm`` calls without a host sync
(``DSV4_GROUPED_MOE=0`` keeps the per-expert loop). The CPU and float64 always take the torch
code below, which is the reference for both.

Precision: in float64 and float32 every intermediate stays in the compute dtype; in bfloat16
mode activations and the residual streams are bf16 while the norms, mHC maths, RoPE, gate,
SwiGLU, compressors and logits run in float32 (the release's precision notes).

Quantised (``DSV4Model(..., quantized=True)``, what a release FP8 checkpoint loads into): the FP8
linears are ``layers.linear.Fp8Linear`` (e4m3 + block scales, activations rounded to e4m3 per
1 x 128 block) and each MoE's routed experts one ``Fp4ExpertStack`` (e2m1 bytes, W4A8); ``wo_a``
is an ``Fp8WeightOnlyLinear`` (its e4m3 bytes and scales kept, multiplied in the compute dtype as
the release does). Names stay the release's (``model_tensors(cfg, quantized=True)``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from memory.quant import indexer_fake_quant

from . import side_stream
from .config import DSV4Config, RopeScaling
from .layers.head import LogitsHead
from .layers.linear import (
    Fp4Expert, Fp4ExpertStack, Fp8Linear, Fp8WeightOnlyLinear, dense_linear, gemv_applies, row_stack_of,
    USE_BF16_GEMV_ALL, shared_input, stack_rows,
)
from .side_stream import SideBranch
from .weights import model_tensors


def hi_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision the release keeps norms / mixes / gates in: float32, or float64 if asked."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- small pieces ---------------------------------------------------------------------------

class Linear(nn.Module):
    """``y = x @ W^T`` with the weight cast to the input dtype (no bias anywhere in DSV4)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight)


def fp8_linear(in_features: int, out_features: int, quantized: bool) -> nn.Module:
    """A linear the release stores in FP8: kept quantised (W8A8) or in the compute dtype."""
    return Fp8Linear(in_features, out_features) if quantized else Linear(in_features, out_features)


# On CUDA (float32 / bfloat16) RMSNorm and RMSNorm + RoPE run as one Triton kernel per call
# (kernels/norm_rope.py); DSV4_NORM_ROPE_KERNEL=0 keeps the torch ops (for A/B timing).
USE_NORM_ROPE_KERNEL = os.environ.get("DSV4_NORM_ROPE_KERNEL", "1") != "0"


def _w8a16_kernel_applies(o: torch.Tensor, rows_per_group: int) -> bool:
    """Whether ``wo_a``'s W8A16 product of o ``[T, H, hd]`` runs in ``kernels/fp8_gemv.py``
    (decode sizes on CUDA; prefill chunks fold the weight to bf16 for cuBLAS)."""
    if not o.is_cuda:
        return False
    from .kernels.fp8_gemv import w8a16_applies
    return w8a16_applies(o.reshape(o.shape[0], -1), rows_per_group)


# An attention's q_lora norm and its kv norm + RoPE in one launch on CUDA (kernels/norm_rope.py,
# norm_pair; the same bits as two). DSV4_NORM_PAIR=0 keeps two launches (A/B timing).
USE_NORM_PAIR = os.environ.get("DSV4_NORM_PAIR", "1") != "0"
# ... and the kv rows written to the SWA pool by that launch, where the backend names its pool
# (AttentionBackend.swa_store): one launch fewer a layer. Off until a GPU run measures it
# (DSV4_NORM_PAIR_STORE=1 turns it on).
USE_NORM_PAIR_STORE = os.environ.get("DSV4_NORM_PAIR_STORE", "0") == "1"


def _norm_rope_kernel_applies(x: torch.Tensor) -> bool:
    return USE_NORM_ROPE_KERNEL and x.is_cuda and x.dtype in (torch.float32, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
             out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """RMS normalisation over the last dim in hi precision, times ``weight`` if given (None: the
    weightless per-head q norm); out in ``out_dtype`` (default x's)."""
    out_dtype = out_dtype or x.dtype
    if _norm_rope_kernel_applies(x) and out_dtype in (torch.float32, torch.bfloat16):
        from .kernels.norm_rope import norm_rope
        return norm_rope(x, weight, eps, out_dtype=out_dtype)
    h = x.to(hi_dtype(x.dtype))
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    return (h if weight is None else h * weight.to(h.dtype)).to(out_dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, out_dtype)


def yarn_inv_freq(theta: float, rope_dim: int, scaling: Optional[RopeScaling]) -> torch.Tensor:
    """float32 inverse frequencies ``theta^(-2i/rope_dim)``, YaRN-corrected when ``scaling``."""
    inv = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if scaling is None:
        return inv

    def corr(rotations: float) -> float:
        return rope_dim * math.log(scaling.original_max_position_embeddings
                                   / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo = max(math.floor(corr(scaling.beta_fast)), 0)
    hi = min(math.ceil(corr(scaling.beta_slow)), rope_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    return inv * (1 - ramp) + (inv / scaling.factor) * ramp


class Rotary:
    """Interleaved RoPE (pairs 2i, 2i+1) on the last ``rope_dim`` dims; angles in float32."""

    def __init__(self, theta: float, scaling: Optional[RopeScaling], rope_dim: int = 64):
        self.rope_dim = rope_dim
        self.inv_freq = yarn_inv_freq(theta, rope_dim, scaling)  # [rope_dim / 2] float32
        self._inv_on: dict[torch.device, torch.Tensor] = {}

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """``inv_freq`` on ``device``, copied there once (a copy per call would be a host-to-device
        transfer in every layer, which a CUDA graph cannot capture)."""
        if device.type == "cpu":
            return self.inv_freq
        if device not in self._inv_on:
            self._inv_on[device] = self.inv_freq.to(device)
        return self._inv_on[device]

    def norm_apply(self, x: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                   positions: torch.Tensor) -> torch.Tensor:
        """``apply(rms_norm(x, weight, eps), positions)``: one kernel on CUDA."""
        if _norm_rope_kernel_applies(x):
            from .kernels.norm_rope import norm_rope
            return norm_rope(x, weight, eps, positions, self.inv_freq_on(x.device))
        return self.apply(rms_norm(x, weight, eps), positions)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] int -> cos, sin [T, rope_dim / 2] in dtype
        angles = positions.to(torch.float32)[:, None] * self.inv_freq_on(positions.device)[None, :]
        angles = angles.to(dtype)
        return angles.cos(), angles.sin()

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate ``x [T, ..., D]`` at ``positions [T]`` (by minus the angle when ``inverse``)."""
        if _norm_rope_kernel_applies(x):
            from .kernels.norm_rope import norm_rope
            return norm_rope(x, None, 0.0, positions, self.inv_freq_on(x.device), norm=False, inverse=inverse)
        cos, sin = self.cos_sin(positions, hi_dtype(x.dtype))  # bf16 rotates in float32
        if inverse:
            sin = -sin
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        cos, sin = cos.view(shape), sin.view(shape)
        nope, rope = x[..., : -self.rope_dim], x[..., -self.rope_dim:].to(cos.dtype)
        x0, x1 = rope[..., 0::2], rope[..., 1::2]
        rot = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
        return torch.cat([nope, rot.to(x.dtype)], dim=-1)


_HADAMARD: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def hadamard_matrix(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Sylvester (natural order) Hadamard matrix of size n, scaled by n^-0.5 (symmetric)."""
    key = (n, dtype, torch.device(device))
    if key not in _HADAMARD:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _HADAMARD[key] = (h * n ** -0.5).to(dtype=dtype, device=device)
    return _HADAMARD[key]


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Apply the scaled 128-point (or last-dim-sized) Hadamard rotation to the last dim."""
    return x @ hadamard_matrix(x.shape[-1], x.dtype, x.device)


# ---- what attention layers hand to the backend ----------------------------------------------

@dataclass
class CompressorInput:
    """Raw per-token compressor material: content ``wkv(x)`` and score ``wgate(x)`` in the
    checkpoint's channel order; ``ape`` is added by whoever pools (the ring stores these raw
    values, as the kernels' state buffers do)."""

    c: torch.Tensor  # [T, coff * d]
    z: torch.Tensor  # [T, coff * d]


@dataclass
class IndexerInput:
    q: torch.Tensor          # [T, index_heads, 128], roped, rotated, quantised
    weights: torch.Tensor    # [T, index_heads], head weights with both scales applied
    compressor: CompressorInput  # the indexer's own compressor (d = 128)


@dataclass
class AttentionInputs:
    q: torch.Tensor                         # [T, H, 512] roped, per-head normalised
    kv: torch.Tensor                        # [T, 512] roped, NOT yet FP8-rounded (the pool does it)
    compressor: Optional[CompressorInput]   # ratio 4 / 128 layers (None if no compression runs)
    indexer: Optional[IndexerInput]         # ratio 4 layers
    kv_stored: bool = False                 # kv already written to the backend's SWA pool (swa_store)


# ---- attention ------------------------------------------------------------------------------

class Compressor(nn.Module):
    def __init__(self, dim: int, d: int, ratio: int, eps: float):
        super().__init__()
        coff = 2 if ratio == 4 else 1
        self.ratio, self.d = ratio, d
        self.wkv = Linear(dim, coff * d)
        self.wgate = Linear(dim, coff * d)
        self.ape = nn.Parameter(torch.empty(ratio, coff * d), requires_grad=False)
        self.norm = RMSNorm(d, eps)


class Indexer(nn.Module):
    def __init__(self, cfg: DSV4Config, quantized: bool = False):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = fp8_linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, quantized)
        self.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads)
        self.compressor = Compressor(cfg.hidden_size, cfg.index_head_dim, 4, cfg.rms_norm_eps)
        self.head_comm: Any = None   # tensor parallelism: wq_b holds this rank's heads (parallel.py)

    def gather_heads(self, iq: torch.Tensor) -> torch.Tensor:
        """``wq_b``'s output ``[T, local heads * head_dim]`` -> ``[T, n_heads * head_dim]``: under
        tensor parallelism every rank projects its heads and all-gathers the rest (heads in rank
        order), so every rank scores every head and picks the same top-k."""
        return iq if self.head_comm is None else self.head_comm.all_gather(iq, -1)


class Attention(nn.Module):
    def __init__(self, cfg: DSV4Config, layer_id: int, ratio: int, quantized: bool = False):
        super().__init__()
        D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.cfg, self.layer_id, self.ratio = cfg, layer_id, ratio
        self.n_heads, self.head_dim, self.o_groups = H, hd, cfg.o_groups   # this rank's (parallel.py)
        self.wq_a = fp8_linear(D, cfg.q_lora_rank, quantized)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = fp8_linear(cfg.q_lora_rank, H * hd, quantized)
        self.wkv = fp8_linear(D, hd, quantized)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps)
        wo_a = Fp8WeightOnlyLinear if quantized else Linear
        self.wo_a = wo_a(H * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = fp8_linear(cfg.o_groups * cfg.o_lora_rank, D, quantized)
        self.attn_sink = nn.Parameter(torch.empty(H), requires_grad=False)
        self.compressor = Compressor(D, hd, ratio, cfg.rms_norm_eps) if ratio else None
        self.indexer = Indexer(cfg, quantized) if ratio == 4 else None
        if ratio:
            self.rope = Rotary(cfg.compress_rope_theta, cfg.rope_scaling, cfg.qk_rope_head_dim)
        else:
            self.rope = Rotary(cfg.rope_theta, None, cfg.qk_rope_head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, backend: Any, meta: Any) -> torch.Tensor:
        # x: [T, D] -> [T, D]
        T, H, hd, eps = x.shape[0], self.n_heads, self.head_dim, self.cfg.rms_norm_eps
        compress = self.ratio and getattr(meta, "compress", True)
        index = compress and self.indexer is not None
        comp = idx_in = head_w = None
        if compress:    # projections of x alone: on a side stream beside the query path (side_stream.py)
            branch = SideBranch(x.device, side_stream.COMPRESSOR and T <= SIDE_STREAM_MAX_TOKENS)
            with branch:
                raws = self._compressor_inputs(x)
                head_w = self._indexer_head_weights(x) if index else None
        qa, kv = shared_input(x, self.wq_a, self.wkv)
        kv_stored = False
        if USE_NORM_PAIR and _norm_rope_kernel_applies(qa):    # q_lora norm, kv norm + RoPE: one launch
            from .kernels.norm_rope import norm_pair
            # the KV rows' store too, where the backend names its pool and slots (AttentionBackend.swa_store)
            store = backend.swa_store(self.layer_id, meta) if USE_NORM_PAIR_STORE else None
            qr, kv = norm_pair(qa, self.q_norm.weight, self.q_norm.eps, kv, self.kv_norm.weight, eps, positions,
                               self.rope.inv_freq_on(x.device), store=store)
            kv_stored = store is not None
        else:
            qr = self.q_norm(qa)
            kv = self.rope.norm_apply(kv, self.kv_norm.weight, eps, positions)
        qb, iq = shared_input(qr, self.wq_b, self.indexer.wq_b) if index else (self.wq_b(qr), None)
        q = self.rope.norm_apply(qb.view(T, H, hd), None, eps, positions)
        if compress:
            branch.join()    # x, the branch's input, is still referenced here
            comp = raws[0]
            idx_in = self._indexer_inputs(x, iq, head_w, raws[1], positions) if index else None
        o = backend.forward(self.layer_id, self, AttentionInputs(q, kv, comp, idx_in, kv_stored), meta)  # [T, H, hd]
        o = self.rope.apply(o, positions, inverse=True)
        return self._project_out(o)

    def _compressor_inputs(self, x: torch.Tensor) -> list[CompressorInput]:
        """Raw (C, Z) of the attention compressor and, in CSA layers, the indexer's: the four
        (or two) projections of x through one shared_input (one matmul where they are stacked)."""
        comps = [self.compressor] + ([self.indexer.compressor] if self.indexer is not None else [])
        # the compressors run in fp32 (or float64): x and the weights taken up to it exactly
        ys = shared_input(x, *[lin for c in comps for lin in (c.wkv, c.wgate)], out_dtype=hi_dtype(x.dtype))
        return [CompressorInput(ys[2 * i], ys[2 * i + 1]) for i in range(len(comps))]

    def _indexer_head_weights(self, x: torch.Tensor) -> torch.Tensor:
        ix = self.indexer
        scale = ix.head_dim ** -0.5 * ix.n_heads ** -0.5
        w = ix.weights_proj.weight
        if USE_BF16_GEMV_ALL and gemv_applies(x, w, x.dtype, least=1):
            # one row: product and scale in one launch, the bf16 values stored as the fp32 the indexer reads
            from .kernels.bf16_gemv import bf16_gemv
            return bf16_gemv(x.reshape(1, -1), w, scale=scale, out_dtype=torch.float32).view(*x.shape[:-1], w.shape[0])
        return ix.weights_proj(x) * scale

    def _indexer_inputs(self, x: torch.Tensor, iq: torch.Tensor, w: torch.Tensor, comp: CompressorInput,
                        positions: torch.Tensor) -> IndexerInput:
        # iq: indexer.wq_b(qr) [T, local index_heads * 128]; w: _indexer_head_weights(x)
        ix, T = self.indexer, x.shape[0]
        iq = ix.gather_heads(iq).view(T, ix.n_heads, ix.head_dim)
        if _norm_rope_kernel_applies(iq) and iq.dtype == torch.bfloat16 and ix.head_dim == 128:
            from .kernels.indexer_q import indexer_q     # RoPE, Hadamard and FP8 rounding: one launch
            q = indexer_q(iq, positions, self.rope.inv_freq_on(x.device), hadamard_matrix(128, iq.dtype, x.device))
        else:
            q = indexer_fake_quant(hadamard(self.rope.apply(iq, positions)))
        return IndexerInput(q, w, comp)

    def _project_out(self, o: torch.Tensor) -> torch.Tensor:
        # o: [T, H, hd]; group g = heads g*H/G .. (g+1)*H/G - 1, concatenated head by head.
        G, R = self.o_groups, self.cfg.o_lora_rank
        og = o.reshape(o.shape[0], G, -1)                                   # [T, G, H/G * hd]
        if isinstance(self.wo_a, Fp8WeightOnlyLinear):      # the release's FP8 bytes, W8A16
            if _w8a16_kernel_applies(o, R):
                from .kernels.fp8_gemv import fp8_w8a16
                return self.wo_b(fp8_w8a16(o.reshape(o.shape[0], -1), self.wo_a.weight, self.wo_a.scale, groups=G))
            wa = self.wo_a.dequantised(o.dtype, o.is_cuda)
        else:
            wa = self.wo_a.weight
            if gemv_applies(og[:, 0], wa, o.dtype) and R % 16 == 0:   # one row: one GEMV launch
                from .kernels.bf16_gemv import bf16_gemv
                return self.wo_b(bf16_gemv(o.reshape(1, -1), wa, groups=G))
        wa = wa.to(o.dtype).view(G, R, og.shape[-1])                         # [G, R, H/G * hd]
        z = torch.einsum("tgi,gri->tgr", og, wa)                            # [T, G, R]
        return self.wo_b(z.reshape(o.shape[0], G * R))


# ---- MoE ------------------------------------------------------------------------------------

class Expert(nn.Module):
    def __init__(self, dim: int, inter: int, limit: float, quantized: bool = False):
        super().__init__()
        self.limit = limit
        self.w1 = fp8_linear(dim, inter, quantized)
        self.w3 = fp8_linear(dim, inter, quantized)
        self.w2 = fp8_linear(inter, dim, quantized)

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        # x: [N, D]; weight: [N] routing weight applied before w2
        g, u = shared_input(x, self.w1, self.w3)
        if weight is None and x.is_cuda and _glue_kernels_apply(x) and g.dim() == 2 and g.dtype == torch.bfloat16:
            from .kernels.moe_grouped import swiglu_rows
            return self.w2(swiglu_rows(g, u, self.limit)[0])
        hi = hi_dtype(x.dtype)
        g, u = g.to(hi), u.to(hi)
        h = F.silu(g.clamp(max=self.limit)) * u.clamp(-self.limit, self.limit)
        if weight is not None:
            h = h * weight.to(h.dtype)[:, None]
        return self.w2(h.to(x.dtype))


class Gate(nn.Module):
    def __init__(self, cfg: DSV4Config, hash_routed: bool):
        super().__init__()
        self.topk, self.scale = cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size), requires_grad=False)
        if hash_routed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int64))
            self.bias = None
        else:
            self.bias = nn.Parameter(torch.empty(cfg.n_routed_experts), requires_grad=False)

    def kernel_applies(self, x: torch.Tensor) -> bool:
        """Whether ``forward`` runs the gate kernels (``kernels/moe_gate.py``) on ``x``."""
        return USE_GATE_KERNEL and x.is_cuda and x.shape[0] <= GATE_KERNEL_MAX_TOKENS and not self._forward_hooks

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, quantize: bool = False) -> tuple[torch.Tensor, ...]:
        """-> expert ids [T, k] and routing weights [T, k] (normalised, times the scaling factor);
        ``quantize`` (the kernels only, ``kernel_applies``): also ``act_quant_fp8(x)``, from the same launch."""
        if self.kernel_applies(x):
            from .kernels.moe_gate import moe_gate
            return moe_gate(x.contiguous(), self.weight, self.bias, self.topk, self.scale,
                            getattr(self, "tid2eid", None) if self.bias is None else None, input_ids,
                            quantize=quantize)
        if quantize:
            raise ValueError("Gate.forward: quantize needs the gate kernels (Gate.kernel_applies)")
        h = x.to(hi_dtype(x.dtype))
        s = F.softplus(F.linear(h, self.weight.to(h.dtype))).sqrt()
        if self.bias is None:
            ids = self.tid2eid[input_ids]
        else:
            ids = (s + self.bias.to(s.dtype)).topk(self.topk, dim=-1).indices
        w = s.gather(-1, ids)
        return ids, w / w.sum(-1, keepdim=True) * self.scale


class MoE(nn.Module):
    def __init__(self, cfg: DSV4Config, hash_routed: bool, quantized: bool = False):
        super().__init__()
        D, inter, limit = cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit
        self.gate = Gate(cfg, hash_routed)
        self.limit = limit
        self.experts = nn.ModuleList(
            Fp4Expert(D, inter) if quantized else Expert(D, inter, limit) for _ in range(cfg.n_routed_experts))
        self.shared_experts = Expert(D, inter * cfg.n_shared_experts, limit, quantized)
        self.fp4: Optional[Fp4ExpertStack] = None  # set by DSV4Model._place when quantized
        self._w13: Optional[torch.Tensor] = None  # [E, 2 * inter, D]: w1 rows, then w3 rows
        self._w2: Optional[torch.Tensor] = None   # [E, D, inter]
        self._aligned = False
        # expert parallelism: this rank holds global experts lo .. hi - 1 (parallel.RankShard)
        self.expert_range: Optional[tuple[int, int]] = None

    def stack_experts(self, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the routed experts' weights as slices of two stacked tensors.

        Names and values are unchanged (``load_state_dict`` copies into the slices in place);
        the stacks let :meth:`_grouped` run every expert in one grouped GEMM with the
        per-expert row counts kept on the device (no host sync)."""
        inter, dim = self.experts[0].w1.weight.shape
        E = len(self.experts)
        # the grouped GEMM's operands need 16-byte-aligned rows
        self._aligned = (inter * dtype.itemsize) % 16 == 0 and (dim * dtype.itemsize) % 16 == 0
        self._w13 = torch.empty(E, 2 * inter, dim, dtype=dtype, device=device)
        self._w2 = torch.empty(E, dim, inter, dtype=dtype, device=device)
        for e, ex in enumerate(self.experts):
            ex.w1.weight.data = self._w13[e, :inter]
            ex.w3.weight.data = self._w13[e, inter:]
            ex.w2.weight.data = self._w2[e]

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        shared = self._shared_fp8_fused(x) if self.fp4 is not None else None
        if (shared is not None and USE_GATE_QUANT and self.expert_range is None and self.gate.kernel_applies(x)
                and not self.gate._forward_pre_hooks):    # the experts' act-quant of x from the gate's launch
            ids, w, xq, xs = self.gate(x, input_ids, quantize=True)
            return self.fp4.forward(x, ids, w, self.limit, shared, x_quant=(xq, xs))
        ids, w = self.gate(x, input_ids)                                    # [T, k]
        if self.expert_range is not None:     # local ids; -1: another rank's expert (skipped)
            lo, hi = self.expert_range
            ids = torch.where((ids >= lo) & (ids < hi), ids - lo, -1)
        if self.fp4 is None and self._decode_kernel_applies(x, ids):
            from .kernels.moe_bf16_decode import moe_bf16_decode
            se = self.shared_experts
            return moe_bf16_decode(x, ids, w, self._w13, self._w2, se.w1.row_stack.weight, se.w2.weight, self.limit)
        if self.fp4 is not None:
            if shared is not None:    # the shared expert inside the routed kernels' launches
                return self.fp4.forward(x, ids, w, self.limit, shared)
            return self.shared_experts(x) + self.fp4.forward(x, ids, w, self.limit)
        out = self.shared_experts(x)
        if self._grouped_applies(x):
            return self._grouped(x, ids, w, out)
        flat_ids = ids.reshape(-1)
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids + 1, minlength=len(self.experts) + 1).tolist()
        token = order // ids.shape[1]
        weight = w.reshape(-1)[order]
        start = counts[0]    # the -1s (other ranks' experts) sort first
        for e, n in enumerate(counts[1:]):
            if n:
                t, wt = token[start:start + n], weight[start:start + n]
                out.index_add_(0, t, self.experts[e](x[t], wt))
            start += n
        return out

    def _decode_kernel_applies(self, x: torch.Tensor, ids: torch.Tensor) -> bool:
        """Whether the bf16 decode kernels (``kernels/moe_bf16_decode.py``) run this step: few
        (token, expert) pairs, the grouped path's stacks intact, the shared expert as one
        ``[w1; w3]`` row stack of the routed experts' width, no hooks on its linears."""
        if not (USE_MOE_DECODE_KERNEL and ids.numel() <= MOE_DECODE_MAX_PAIRS and self._stacks_intact(x)):
            return False
        if not (x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"):
            return False
        se = self.shared_experts
        st = row_stack_of((se.w1, se.w3))
        return (st is not None and st.weight.shape == self._w13.shape[1:] and se.w2.weight.shape == self._w2.shape[1:]
                and se.w2.weight.dtype == torch.bfloat16 and se.w2.weight.is_contiguous()
                and not self._shared_hooked())

    def _shared_fp8_fused(self, x: torch.Tensor) -> Optional[Any]:
        """The shared expert's FP8 weights for ``fp4_mma.fp4_moe_mma`` to run beside the routed
        experts (``SharedFp8``), or None for the module's own forward: CUDA, bf16, at most
        SHARED_FUSED_MAX_TOKENS tokens (where the unfused expert runs the same Triton GEMMs), the
        FP4 experts packed for MMA, ``[w1; w3]`` still one FP8 row stack, no hooks."""
        if not (USE_FUSED_SHARED and x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] <= SHARED_FUSED_MAX_TOKENS
                and self.fp4.mma is not None):
            return None
        se = self.shared_experts
        st = row_stack_of((se.w1, se.w3))
        if (st is None or st.scale is None or not isinstance(se.w2, Fp8Linear) or se.w2.weight.shape[1] % 128
                or self._shared_hooked()):
            return None
        from .kernels.fp4_mma import SharedFp8
        return SharedFp8(st.weight, st.scale, se.w2.weight, se.w2.scale)

    def _shared_hooked(self) -> bool:
        """Whether the shared expert or its linears carry hooks (the fused kernels would skip them)."""
        se = self.shared_experts
        return any(m._forward_hooks or m._forward_pre_hooks for m in (se, se.w1, se.w3, se.w2))

    def _stacks_intact(self, x: torch.Tensor) -> bool:
        """The routed experts' parameters are still slices of the bf16 stacks, on x's device."""
        if not (x.dtype == torch.bfloat16 and self._w13 is not None and self._w13.dtype == torch.bfloat16
                and self._w13.device == x.device):
            return False
        ex0, exn = self.experts[0], self.experts[-1]
        return (ex0.w1.weight.data_ptr() == self._w13.data_ptr()
                and exn.w3.weight.data_ptr() == self._w13[-1, exn.w1.weight.shape[0]:].data_ptr()
                and exn.w2.weight.data_ptr() == self._w2[-1].data_ptr())

    def _grouped_applies(self, x: torch.Tensor) -> bool:
        # torch._grouped_mm is sync-free only in its bf16 CUTLASS path (sm90 / sm100); anything
        # else (and stacks that no longer back the parameters, e.g. after .to()) takes the loop.
        if not (USE_GROUPED_MOE and x.is_cuda):
            return False
        return self._aligned and _grouped_mm_device(x.device) and self._stacks_intact(x)

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """All routed experts as two grouped GEMMs over the (token, expert) pairs sorted by
        expert, the group ends found on the device: no host sync, no launch per expert, and
        each expert's weights read once per tile of its own rows only. The maths is
        Expert.forward's: projections in x's dtype, SwiGLU and the routing weight in fp32."""
        T, k = ids.shape
        E, inter, limit = len(self.experts), self._w2.shape[2], self.experts[0].limit
        order, ends = self._sort_pairs(ids, E)
        token = order // k
        gu = torch._grouped_mm(x[token], self._w13.transpose(-2, -1), offs=ends)  # [T*k, 2*inter]
        if _glue_kernels_apply(x):   # SwiGLU + weight, then the sum over the choices: a launch each
            from .kernels.moe_grouped import combine_pairs, swiglu_rows
            h, inv = swiglu_rows(gu[:, :inter], gu[:, inter:], limit, w.reshape(-1), order, valid_rows=ends[-1:])
            y = torch._grouped_mm(h, self._w2.transpose(-2, -1), offs=ends)  # [T*k, D]
            return combine_pairs(y, inv, ids, out, E)
        hi = hi_dtype(x.dtype)
        g, u = gu[:, :inter].to(hi), gu[:, inter:].to(hi)
        h = F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit) * w.reshape(-1)[order].to(hi)[:, None]
        y = torch._grouped_mm(h.to(x.dtype), self._w2.transpose(-2, -1), offs=ends)  # [T*k, D]
        if self.expert_range is not None:      # rows past the last group (ends[-1]) are not written
            y = torch.where((torch.arange(T * k, device=y.device) < ends[-1])[:, None], y, 0)
        # back to (token, choice) order and a sum over the k choices: a fixed summation order,
        # where index_add_ on CUDA accumulates with atomics in whatever order they land (the
        # same step would then give different bits from run to run)
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(order.numel(), device=order.device)
        return out.add_(y[unsort].view(T, k, -1).sum(dim=1))


    def _sort_pairs(self, ids: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (token, choice) pairs in a stable order by expert, other ranks' experts (-1) last:
        (order [T k], each expert's end in that order int32 [E]; the last end counts this rank's
        rows), by the FP4 path's routing (``kernels/fp4_moe.route_pairs``: one launch up to 512
        pairs, where a stable sort of 102 pair ids alone took 27 us on the H200, docs/PERF.md
        session 12; a sort beyond)."""
        from .kernels.fp4_moe import route_pairs
        r = route_pairs(ids.reshape(-1), E, 64)          # offsets: each expert's first row, then the end
        return r.order, r.offsets[1:].to(torch.int32)


# torch._grouped_mm on CUDA, bfloat16, routed experts stacked (see MoE.stack_experts);
# DSV4_GROUPED_MOE=0 keeps the per-expert loop (for A/B timing).
USE_GROUPED_MOE = os.environ.get("DSV4_GROUPED_MOE", "1") != "0"
# The grouped path's SwiGLU and its sum over the choices as one Triton launch each
# (kernels/moe_grouped.py), and the bf16 experts' SwiGLU (Expert.forward: the shared expert) as
# one; DSV4_MOE_GLUE_KERNELS=0 keeps the torch ops (for A/B timing).
USE_MOE_GLUE_KERNELS = os.environ.get("DSV4_MOE_GLUE_KERNELS", "1") != "0"


def _glue_kernels_apply(x: torch.Tensor) -> bool:
    return (USE_MOE_GLUE_KERNELS and x.dtype == torch.bfloat16
            and (x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"))
# The bf16 decode kernels (routed + shared experts in four launches) for steps of at most this
# many routed (token, expert) pairs: each pair's program re-reads its expert's rows only from
# cache, but a token's pairs do not share a weight tile, so past a few tokens the grouped GEMMs
# read less. DSV4_MOE_DECODE_KERNEL=0 keeps the grouped path (for A/B timing).
USE_MOE_DECODE_KERNEL = os.environ.get("DSV4_MOE_DECODE_KERNEL", "1") != "0"
# The gate's scores and top-k in two Triton launches (kernels/moe_gate.py) for steps of at most
# this many tokens, on CUDA; DSV4_GATE_KERNEL=0 keeps the torch ops.
USE_GATE_KERNEL = os.environ.get("DSV4_GATE_KERNEL", "1") != "0"
GATE_KERNEL_MAX_TOKENS = 64
# With the FP4 MMA experts and their fused shared expert, the gate's launch also rounds x to e4m3
# for them (moe_gate(quantize=True)); DSV4_GATE_QUANT=0 leaves it to fp4_moe_mma's own act-quant.
USE_GATE_QUANT = os.environ.get("DSV4_GATE_QUANT", "1") != "0"
MOE_DECODE_MAX_PAIRS = int(os.environ.get("DSV4_MOE_DECODE_MAX_PAIRS", "24"))
# A quantised MoE's shared expert runs inside the FP4 experts' decode launches (one act-quant of
# x, its SwiGLU in the routed SwiGLU + act-quant kernel, its down projection summed in the routed
# combine) for steps of at most this many tokens on CUDA; DSV4_FUSE_SHARED_EXPERT=0 runs it alone.
USE_FUSED_SHARED = os.environ.get("DSV4_FUSE_SHARED_EXPERT", "1") != "0"
SHARED_FUSED_MAX_TOKENS = 127   # from 128 tokens the unfused expert's GEMMs are cuBLAS's (fp8_gemm)
# Steps of at most this many tokens may run a layer's independent projections on a side stream
# (side_stream.py: DSV4_COMPRESSOR_STREAM, DSV4_SHARED_EXPERT_STREAM): decode sizes, where the
# launches are too small to fill the GPU alone.
SIDE_STREAM_MAX_TOKENS = 64
_GROUPED_MM_OK: dict[int, bool] = {}


def _stack_experts_for(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether DSV4Model allocates routed experts as stacks (where MoE._grouped can run)."""
    return device.type == "cuda" and dtype == torch.bfloat16


# Linears of one input (wq_a + wkv, a compressor's wkv + wgate, the shared expert's w1 + w3)
# allocated as one stacked weight and run as one matmul on CUDA (layers.linear.stack_rows);
# DSV4_STACK_LINEARS=0 keeps them apart (for A/B timing).
USE_STACKED_LINEARS = os.environ.get("DSV4_STACK_LINEARS", "1") != "0"


def _stack_rows_for(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether DSV4Model allocates the linears of one input as row stacks (bf16 weights, or FP8
    weights with their block scales: layers.linear.stack_rows)."""
    return USE_STACKED_LINEARS and device.type == "cuda" and dtype in (torch.float32, torch.bfloat16)


def _grouped_mm_device(device: torch.device) -> bool:
    """Whether torch._grouped_mm has its sync-free bf16 kernel on this GPU (sm90 / sm100)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _GROUPED_MM_OK:
        major = torch.cuda.get_device_capability(idx)[0]
        _GROUPED_MM_OK[idx] = hasattr(torch, "_grouped_mm") and major in (9, 10)
    return _GROUPED_MM_OK[idx]


# ---- mHC ------------------------------------------------------------------------------------

class HCMix(NamedTuple):
    """One mHC mix: pre [T, hc], post [T, hc], C [T, hc, hc] (C[t, j, k]: stream j -> k)."""
    pre: torch.Tensor
    post: torch.Tensor
    C: torch.Tensor


# The fused Triton mHC kernels (kernels/mhc.py) run on CUDA for float32 / bfloat16 models;
# DSV4_MHC_KERNELS=0 keeps the torch ops there too (for A/B timing).
USE_MHC_KERNELS = os.environ.get("DSV4_MHC_KERNELS", "1") != "0"


def _mhc_kernels_apply(X: torch.Tensor) -> bool:
    return USE_MHC_KERNELS and X.is_cuda and X.dtype != torch.float64


# Up to this many tokens (decode and verify steps) the kernel path computes the mix logits from
# the streams itself (kernels.mhc.mhc_mix_from_streams: split-K over fn, two launches per mix
# instead of the fp32 copy, matmul, norm ops and mhc_mix); above it one matmul reads fn once for
# all tokens and feeds mhc_mix. 0 keeps the matmul path at every size (A/B timing).
MHC_MIX_FROM_STREAMS_MAX_TOKENS = 256


def _mix_from_streams(X: torch.Tensor, fn: torch.Tensor) -> bool:
    return X.shape[0] <= MHC_MIX_FROM_STREAMS_MAX_TOKENS and fn.dtype == torch.float32 and X.is_contiguous()


def hc_mix_logits(cfg: DSV4Config, X: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """The 2 * hc + hc * hc mix logits of streams ``X [T, hc, D]``, RMS-scaled, in hi precision."""
    h = X.reshape(X.shape[0], -1).to(hi_dtype(X.dtype))
    return (h @ fn.to(h.dtype).t()) * torch.rsqrt(h.square().mean(-1, keepdim=True) + cfg.rms_norm_eps)


def hc_sinkhorn(cfg: DSV4Config, m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor) -> HCMix:
    """Gates and the Sinkhorn-normalised C from logits ``m [T, hc * (2 + hc)]`` (torch ops;
    the reference for ``kernels.mhc.mhc_mix``)."""
    hc, eps = cfg.hc_mult, cfg.hc_eps
    scale, base = scale.to(m.dtype), base.to(m.dtype)
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    C = (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc)        # C[j, k]: j -> k
    C = C.softmax(-1) + eps
    C = C / (C.sum(-2, keepdim=True) + eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        C = C / (C.sum(-1, keepdim=True) + eps)
        C = C / (C.sum(-2, keepdim=True) + eps)
    return HCMix(pre, post, C)


def hc_mix_weights(cfg: DSV4Config, X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
                   base: torch.Tensor) -> HCMix:
    """mHC mixes for streams ``X [T, hc, D]``: pre [T, hc], post [T, hc], C [T, hc, hc]."""
    if _mhc_kernels_apply(X):
        from .kernels import mhc
        if _mix_from_streams(X, fn):
            return HCMix(*mhc.mhc_mix_from_streams(X, fn, scale, base, cfg.hc_mult, cfg.hc_sinkhorn_iters,
                                                   cfg.hc_eps, cfg.rms_norm_eps))
        return HCMix(*mhc.mhc_mix(hc_mix_logits(cfg, X, fn), scale, base, cfg.hc_mult, cfg.hc_sinkhorn_iters,
                                  cfg.hc_eps))
    return hc_sinkhorn(cfg, hc_mix_logits(cfg, X, fn), scale, base)


def hc_collapse(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    # sum_j pre_j X_j: [T, hc, D] -> [T, D], in pre's (float32 or float64) precision
    if _mhc_kernels_apply(X) and pre.dtype == torch.float32:
        from .kernels.mhc import mhc_collapse
        return mhc_collapse(X.contiguous(), pre)
    return torch.einsum("tj,tjd->td", pre, X.to(pre.dtype))


def hc_collapse_norm(X: torch.Tensor, pre: torch.Tensor, norm: RMSNorm, out_dtype: torch.dtype) -> torch.Tensor:
    """A sub-layer's input ``norm(sum_j pre_j X_j)`` in ``out_dtype``; one kernel on CUDA."""
    if (_mhc_kernels_apply(X) and _norm_rope_kernel_applies(X) and pre.dtype == torch.float32
            and out_dtype in (torch.float32, torch.bfloat16)):
        from .kernels.mhc import mhc_collapse_norm
        return mhc_collapse_norm(X.contiguous(), pre, norm.weight, norm.eps, out_dtype)
    return norm(hc_collapse(X, pre), out_dtype)


# At decode sizes (below the mix's tl.dot threshold) a sub-layer boundary's expand on CUDA also
# computes the next mix's split-K partials of the streams it writes (kernels/mhc.py,
# mhc_expand_partials): three launches (expand + partials, finalize, collapse + norm) where there
# were four. DSV4_MHC_FUSED=0 keeps the four (A/B timing).
USE_MHC_FUSED = os.environ.get("DSV4_MHC_FUSED", "1") != "0"


def hc_sublayer_input(cfg: DSV4Config, X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
                      base: torch.Tensor, norm: RMSNorm,
                      part: Optional[torch.Tensor] = None) -> tuple[HCMix, torch.Tensor]:
    """A sub-layer's mix of the streams ``X [T, hc, D]`` and its input ``norm(sum_j pre_j X_j)`` in
    X's dtype. ``part``: the mix's split-K partials of X, where the expand that wrote X computed
    them (``hc_expand_partials``)."""
    if part is not None:
        from .kernels.mhc import mhc_mix_finalize
        mix = HCMix(*mhc_mix_finalize(part, X.shape[1] * X.shape[2], scale, base, cfg.hc_mult,
                                      cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps))
    else:
        mix = hc_mix_weights(cfg, X, fn, scale, base)
    return mix, hc_collapse_norm(X, mix.pre, norm, X.dtype)


def hc_expand_partials(X: torch.Tensor, f: torch.Tensor, post: torch.Tensor, C: torch.Tensor,
                       next_fn: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``hc_expand``, and the split-K partials of the next mix (``next_fn``: its fn; None: no mix
    follows) from the same launch where ``mhc.expand_partials_apply`` says so; else None for them."""
    if (next_fn is not None and USE_MHC_FUSED and C.dtype == torch.float32 and _mhc_kernels_apply(X)
            and _mix_from_streams(X, next_fn)):
        from .kernels import mhc
        if mhc.expand_partials_apply(X, next_fn):
            return mhc.mhc_expand_partials(X, f, post, C, next_fn)
    return hc_expand(X, f, post, C), None


def hc_expand(X: torch.Tensor, f: torch.Tensor, post: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    # X'_k = post_k f + sum_j C[j, k] X_j, mixed in C's precision; the streams keep X's dtype
    if _mhc_kernels_apply(X) and C.dtype == torch.float32:
        from .kernels.mhc import mhc_expand
        return mhc_expand(X.contiguous(), f, post, C)
    mixed = torch.einsum("tjk,tjd->tkd", C, X.to(C.dtype))
    return (post[:, :, None] * f.to(C.dtype)[:, None, :] + mixed).to(X.dtype)


class Block(nn.Module):
    def __init__(self, cfg: DSV4Config, layer_id: int, ratio: int, hash_routed: bool, quantized: bool = False):
        super().__init__()
        hc, D = cfg.hc_mult, cfg.hidden_size
        n_mix = hc * (2 + hc)
        self.cfg = cfg
        for sub in ("attn", "ffn"):
            self.register_parameter(f"hc_{sub}_fn", nn.Parameter(torch.empty(n_mix, hc * D), requires_grad=False))
            self.register_parameter(f"hc_{sub}_base", nn.Parameter(torch.empty(n_mix), requires_grad=False))
            self.register_parameter(f"hc_{sub}_scale", nn.Parameter(torch.empty(3), requires_grad=False))
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_id, ratio, quantized)
        self.ffn = MoE(cfg, hash_routed, quantized)

    def forward(self, X, input_ids, positions, backend, meta, carry: Optional["HCCarry"] = None):
        """Streams ``X [T, hc, D]`` -> the block's new streams. ``carry`` (DSV4Model.forward): the
        attention mix's split-K partials of X where the block before computed them, replaced by the
        next block's (``hc_expand_partials``)."""
        cfg = self.cfg
        part = carry.part if carry is not None else None
        mix, x = hc_sublayer_input(cfg, X, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, self.attn_norm, part)
        f = self.attn(x, positions, backend, meta)
        X, part = hc_expand_partials(X, f, mix.post, mix.C, self.hc_ffn_fn)
        mix, x = hc_sublayer_input(cfg, X, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, self.ffn_norm, part)
        f = self.ffn(x, input_ids)
        X, part = hc_expand_partials(X, f, mix.post, mix.C, carry.next_fn if carry is not None else None)
        if carry is not None:
            carry.part = part
        return X


class HCCarry:
    """What one block hands the next across their boundary: ``part``, the split-K partials of the
    streams it returns for the next block's attention mix (None: not computed), and ``next_fn``,
    that mix's fn, which the block's last expand multiplies into ``part``."""
    __slots__ = ("part", "next_fn")

    def __init__(self) -> None:
        self.part: Optional[torch.Tensor] = None
        self.next_fn: Optional[torch.Tensor] = None


def hc_head_collapse(cfg: DSV4Config, X: torch.Tensor, fn, scale, base) -> torch.Tensor:
    if _mhc_kernels_apply(X) and _mix_from_streams(X, fn):
        from .kernels.mhc import mhc_head_pre
        pre = mhc_head_pre(X, fn, scale, base, cfg.hc_eps, cfg.rms_norm_eps)
    else:
        m = hc_mix_logits(cfg, X, fn)
        pre = torch.sigmoid(m * scale.to(m.dtype) + base.to(m.dtype)) + cfg.hc_eps
    return hc_collapse(X, pre)


class MTPBlock(Block):
    """``mtp.j``: a window-only block with its own embedding merge, hc_head and norm.

    Its weights load with the model; :meth:`DSV4Model.forward` never calls it: speculative
    decoding runs it as the draft layer over its own window KV (``dsv4_backend/mtp.py``)."""

    def __init__(self, cfg: DSV4Config, layer_id: int, ratio: int, quantized: bool = False):
        super().__init__(cfg, layer_id, ratio, hash_routed=False, quantized=quantized)
        D, hc = cfg.hidden_size, cfg.hc_mult
        self.e_proj = fp8_linear(D, D, quantized)
        self.h_proj = fp8_linear(D, D, quantized)
        self.enorm = RMSNorm(D, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps)
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.empty(hc, hc * D), requires_grad=False)
        self.hc_head_base = nn.Parameter(torch.empty(hc), requires_grad=False)
        self.hc_head_scale = nn.Parameter(torch.empty(1), requires_grad=False)


# ---- the model ------------------------------------------------------------------------------

class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class DSV4Model(nn.Module):
    """The whole model; ``forward`` runs the main layers over a step's new tokens.

    ``dtype`` is the compute dtype (float64, float32 or bfloat16); parameters take the dtype
    ``weights.param_dtype`` gives their name (fp32 parameters stay fp32 unless float64).
    ``quantized=True`` keeps the FP8 / FP4 weights in their stored form (``weights.model_tensors``).
    ``shard`` (a ``parallel.RankShard``): build this rank's part of a tensor / expert parallel model
    (load it through ``shard.shard_stream``).
    """

    def __init__(self, cfg: DSV4Config, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", include_mtp: bool = True, quantized: bool = False,
                 shard: Any = None):
        super().__init__()
        D, V, hc = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
        self.cfg, self.dtype, self.quantized, self.shard = cfg, dtype, quantized, shard
        self.embed = Embedding(V, D)
        self.head = LogitsHead(D, V)
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.empty(hc, hc * D), requires_grad=False)
        self.hc_head_base = nn.Parameter(torch.empty(hc), requires_grad=False)
        self.hc_head_scale = nn.Parameter(torch.empty(1), requires_grad=False)
        self.layers = nn.ModuleList(
            Block(cfg, i, r, cfg.is_hash_layer(i), quantized) for i, r in enumerate(cfg.layer_ratios))
        n_main = cfg.num_hidden_layers
        self.mtp = nn.ModuleList(
            MTPBlock(cfg, n_main + j, r, quantized) for j, r in enumerate(cfg.mtp_ratios)) if include_mtp else None
        if shard is not None:
            shard.shard(self)
        self._place(include_mtp, dtype, torch.device(device))

    def _place(self, include_mtp: bool, dtype: torch.dtype, device: torch.device) -> None:
        """Give every tensor its spec's shape check and dtype; names must equal the specs'."""
        tensors = model_tensors(self.cfg, dtype, include_mtp, self.quantized)
        if self.shard is not None:
            tensors = self.shard.local_tensors(tensors, self.cfg.n_routed_experts)
        specs = {s.name: s for s in tensors}
        own = dict(self.named_parameters())
        own.update(dict(self.named_buffers()))
        missing, extra = sorted(set(specs) - set(own)), sorted(set(own) - set(specs))
        if missing or extra:
            raise RuntimeError(f"DSV4Model tensor names differ from weight_specs: "
                               f"missing {missing[:8]}, unexpected {extra[:8]}")
        stack = self.quantized or _stack_experts_for(device, dtype)
        rows = _stack_rows_for(device, dtype)
        for name, t in own.items():
            spec = specs[name]
            if tuple(t.shape) != spec.shape:
                raise RuntimeError(f"{name}: model shape {tuple(t.shape)} != spec {spec.shape}")
            if stack and ".ffn.experts." in name:
                continue  # allocated below, as slices of the stacks
            t.data = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        if stack:
            for mod_name, mod in self.named_modules():
                if isinstance(mod, MoE) and self.quantized:
                    mod.fp4 = Fp4ExpertStack(mod.experts, device)
                elif isinstance(mod, MoE):
                    mod.stack_experts(specs[f"{mod_name}.experts.0.w1.weight"].dtype, device)
        if rows:
            for mod in self.modules():
                if isinstance(mod, Attention):
                    stack_rows(mod.wq_a, mod.wkv)
                    comps = [mod.compressor] + ([mod.indexer.compressor] if mod.indexer is not None else [])
                    if mod.compressor is not None:
                        stack_rows(*[lin for c in comps for lin in (c.wkv, c.wgate)])
                    if mod.indexer is not None:
                        stack_rows(mod.wq_b, mod.indexer.wq_b)
                elif isinstance(mod, MoE):
                    stack_rows(mod.shared_experts.w1, mod.shared_experts.w3)

    def pack_experts_for_mma(self) -> int:
        """After loading, on CUDA: every quantised MoE's routed experts repacked for the tensor-core
        decode kernels (``Fp4ExpertStack.pack_for_mma``); returns how many layers were packed."""
        return sum(mod.fp4.pack_for_mma() for mod in self.modules() if isinstance(mod, MoE) and mod.fp4 is not None)

    @torch.no_grad()
    def load_stream(self, tensors) -> None:
        """Copy ``(name, tensor)`` pairs (e.g. ``CheckpointReader.stream()``) into the model one at a
        time, so only one loaded tensor exists beside the model; every tensor must come exactly once."""
        own = dict(self.named_parameters())
        own.update(dict(self.named_buffers()))
        seen: set[str] = set()
        for name, t in tensors:
            if name not in own or name in seen:
                raise KeyError(f"load_stream: {'duplicate' if name in seen else 'unexpected'} tensor {name}")
            dst = own[name]
            if tuple(dst.shape) != tuple(t.shape):
                raise ValueError(f"load_stream: {name} has shape {list(t.shape)}, the model {list(dst.shape)}")
            dst.copy_(t)
            seen.add(name)
        missing = sorted(set(own) - seen)
        if missing:
            raise KeyError(f"load_stream: {len(missing)} tensor(s) never came, e.g. {missing[:4]}")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: Any, meta: Any) -> torch.Tensor:
        """Run the main layers over the step's tokens. ``input_ids, positions: [T]``;
        returns the final mHC streams ``[T, hc, D]`` (feed rows of it to :meth:`logits`)."""
        x = self.embed(input_ids).to(self.dtype)
        X = x[:, None, :].expand(-1, self.cfg.hc_mult, -1).contiguous()
        carry, n = HCCarry(), len(self.layers)
        for i, layer in enumerate(self.layers):
            carry.next_fn = self.layers[i + 1].hc_attn_fn if i + 1 < n else None
            X = layer(X, input_ids, positions, backend, meta, carry)
        return X

    def logits(self, X: torch.Tensor) -> torch.Tensor:
        """Streams ``[N, hc, D]`` -> logits ``[N, V]`` (float32; float64 in float64 mode)."""
        y = hc_head_collapse(self.cfg, X, self.hc_head_fn, self.hc_head_scale, self.hc_head_base)
        return self.head(self.norm(y))
