"""Modules that keep release weights quantised: ``Fp8Linear`` (W8A8), ``Fp8WeightOnlyLinear``
(``wo_a``, W8A16) and the FP4 routed-expert stack.

Both hold the stored bytes under the release's names (``<module>.weight`` and ``<module>.scale``,
as buffers, so ``load_state_dict`` and the loader fill them) and run the maths of
:mod:`dsv4_backend.layers.quant`: on CUDA through the Triton kernels (``kernels/fp8_gemm.py``,
``kernels/fp4_moe.py``, imported on first use), elsewhere (and when those kernels cannot be
imported) through the torch reference, which is also the float64 path. Off the GPU the torch
path keeps the weights it dequantised (in the compute dtype) until the stored bytes change: the
CPU only runs small models, and dequantising on every step would dominate their run time.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..weights import fp4_packed_shape, fp4_scale_shape, fp8_scale_shape
from .fp32_products import fp32_applies, fp32_linear
from .quant import act_fake_quant, compute_dtype, dequant_fp4, dequant_fp8, fp4_moe_ref, moe_act_quant

logger = logging.getLogger(__name__)
_KERNELS: dict[str, Optional[Callable]] = {}


def _kernel(module: str, name: str) -> Optional[Callable]:
    """``dsv4_backend.kernels.<module>.<name>``, or None (logged once) when it cannot be imported."""
    key = f"{module}.{name}"
    if key not in _KERNELS:
        try:
            _KERNELS[key] = getattr(importlib.import_module(f"dsv4_backend.kernels.{module}"), name)
        except (ImportError, AttributeError) as e:
            logger.warning("%s unavailable (%s): the torch reference runs instead", key, e)
            _KERNELS[key] = None
    return _KERNELS[key]


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float32)


class _DequantCache:
    """The last dequantisation of some stored tensors, valid while their bytes are unchanged."""

    def __init__(self):
        self.key, self.value = None, None

    def get(self, tensors: tuple[torch.Tensor, ...], dtype: torch.dtype, make: Callable[[], object]):
        key = (dtype,) + tuple((t.data_ptr(), t._version) for t in tensors)
        if key != self.key:
            self.key, self.value = key, make()
        return self.value


class _StoredFp8(nn.Module):
    """W e4m3 ``[out, in]`` with fp32 power-of-two block scales ``[ceil(out/128), ceil(in/128)]``
    (buffers ``weight`` and ``scale``, the release's names)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("scale", torch.empty(fp8_scale_shape((out_features, in_features)),
                                                  dtype=torch.float32))
        self._cache = _DequantCache()

    def dequantised(self, dtype: torch.dtype, on_gpu_tensor: bool) -> torch.Tensor:
        """The weight in ``dtype`` for the torch path (kept between calls off the GPU)."""
        deq = lambda: dequant_fp8(self.weight, self.scale, dtype)  # noqa: E731
        return deq() if on_gpu_tensor else self._cache.get((self.weight, self.scale), dtype, deq)


class Fp8Linear(_StoredFp8):
    """``y = x @ W^T`` with x rounded to e4m3 in 1 x 128 blocks first (W8A8)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out] in x's dtype
        return shared_input(x, self)[0]


class Fp8WeightOnlyLinear(_StoredFp8):
    """A weight the release stores as e4m3 + 128 x 128 block scales but multiplies in bf16
    (``wo_a``: the release's converter folds the scales in and casts to bf16). Kept as stored,
    half the bytes of the fold; ``dequantised`` is that fold, exact (three mantissa bits times a
    power of two fit bf16), and ``kernels/fp8_gemv.py`` multiplies the same values from the bytes
    (W8A16). The activation is not rounded to e4m3."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantised(x.dtype, x.is_cuda))


class RowStack(NamedTuple):
    """Linears of one input whose weights are consecutive row slices of ``weight`` (and, for
    ``Fp8Linear``s, whose block scales are consecutive row slices of ``scale``)."""
    weight: torch.Tensor            # [sum of out_features, in_features]
    mods: tuple[nn.Module, ...]
    scale: Optional[torch.Tensor] = None    # Fp8Linear stacks: [sum of out_features / 128, in / 128]


def _restack(mods: tuple[nn.Module, ...], attr: str) -> torch.Tensor:
    """One tensor holding the modules' ``attr`` tensors as consecutive row slices (values not kept)."""
    ts = [getattr(m, attr) for m in mods]
    big = torch.empty(sum(t.shape[0] for t in ts), *ts[0].shape[1:], dtype=ts[0].dtype, device=ts[0].device)
    start = 0
    for m, t in zip(mods, ts):
        t.data = big[start:start + t.shape[0]]
        start += t.shape[0]
    return big


def stack_rows(*mods: nn.Module) -> RowStack:
    """Re-allocate the ``weight`` of linears of one input (same in_features, dtype, device; all
    plain or all ``Fp8Linear``) as consecutive row slices of one tensor, so :func:`shared_input`
    runs them as one matmul. ``Fp8Linear``s stack their block scales too, so every one but the
    last must have a multiple of 128 rows (its scale rows then cover exactly its weight rows).
    Values are not kept: call it before loading (``load_state_dict`` / ``load_stream`` copy into
    the slices in place)."""
    ws = [m.weight for m in mods]
    if len({(w.shape[1], w.dtype, w.device) for w in ws}) != 1:
        raise ValueError(f"stack_rows: weights differ in in_features / dtype / device: "
                         f"{[(tuple(w.shape), w.dtype, str(w.device)) for w in ws]}")
    fp8 = all(isinstance(m, Fp8Linear) for m in mods)     # (a plain weight never has FP8's dtype)
    if fp8 and any(w.shape[0] % 128 for w in ws[:-1]):
        raise ValueError(f"stack_rows: stacked FP8 weights need multiples of 128 rows (block scales), "
                         f"got {[w.shape[0] for w in ws]}")
    stack = RowStack(_restack(mods, "weight"), tuple(mods), _restack(mods, "scale") if fp8 else None)
    for m in mods:
        m.row_stack = stack
    return stack


def row_stack_of(mods: tuple[nn.Module, ...]) -> Optional[RowStack]:
    """The modules' stack if their weights (and scales) are still its slices, in this order (a
    ``.to()`` or a replaced tensor ends that)."""
    st = getattr(mods[0], "row_stack", None)
    if st is None or len(st.mods) != len(mods) or any(a is not b for a, b in zip(st.mods, mods)):
        return None
    start = s_start = 0
    for m in mods:
        if m.weight.data_ptr() != st.weight[start].data_ptr() or not m.weight.is_contiguous():
            return None
        if st.scale is not None and (m.scale.data_ptr() != st.scale[s_start].data_ptr()
                                     or not m.scale.is_contiguous()):
            return None
        start += m.weight.shape[0]
        s_start += m.scale.shape[0] if st.scale is not None else 0
    return st


def dense_linear(x: torch.Tensor, w: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x @ w^T`` in ``out_dtype`` (default x's), x and w cast to it first. A float32 product of a
    bf16 weight on CUDA (the head's logits, the compressors' projections) reads w as stored
    instead: :func:`.fp32_products.fp32_linear`, the same products without an fp32 copy of w."""
    out_dtype = out_dtype or x.dtype
    if gemv_applies(x, w, out_dtype, GEMV_MIN_FEATURES_FP32 if out_dtype == torch.float32 else GEMV_MIN_FEATURES):
        from dsv4_backend.kernels.bf16_gemv import bf16_gemv
        return bf16_gemv(x.reshape(1, -1), w, out_dtype=out_dtype).view(*x.shape[:-1], w.shape[0])
    if out_dtype == torch.float32 and fp32_applies(x, w):
        return fp32_linear(x, w)
    return F.linear(x.to(out_dtype), w.to(out_dtype))


# A bf16 projection of one row on CUDA, at least this many output features, runs as one Triton
# GEMV (kernels/bf16_gemv.py) instead of cuBLAS; DSV4_BF16_GEMV=0 keeps cuBLAS (for A/B timing).
# It also takes the one-row products cuBLAS would run outside programmatic dependent launch: the
# compressors' float32 projections (split-K GEMM + reduction) from GEMV_MIN_FEATURES_FP32 rows, and
# the indexer's scaled head weights (model.Attention); DSV4_BF16_GEMV_ALL=0 leaves those to cuBLAS
# (H100, 11 Flash-width layers at 4K x 1: graph replay 2.55-2.57 -> 2.54 ms, docs/PERF.md session 19).
USE_BF16_GEMV = os.environ.get("DSV4_BF16_GEMV", "1") != "0"
USE_BF16_GEMV_ALL = os.environ.get("DSV4_BF16_GEMV_ALL", "1") != "0"
GEMV_MIN_FEATURES = 1024
GEMV_MIN_FEATURES_FP32 = 256


def gemv_applies(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype, least: int = GEMV_MIN_FEATURES) -> bool:
    """Whether ``x @ w^T`` takes the one-row bf16 GEMV: CUDA, bf16 x and w, a bf16 output (or a
    float32 one, with USE_BF16_GEMV_ALL), one row of x, w row-contiguous with at least ``least`` rows."""
    out_ok = out_dtype == torch.bfloat16 or (USE_BF16_GEMV_ALL and out_dtype == torch.float32)
    return (USE_BF16_GEMV and out_ok and x.is_cuda and x.dtype == w.dtype == torch.bfloat16
            and x.numel() == x.shape[-1] and w.dim() == 2 and w.stride(1) == 1 and w.shape[0] >= least)


def shared_input(x: torch.Tensor, *mods: nn.Module, out_dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
    """``[m(x) for m in mods]`` for linears of one input (wq_a and wkv; an expert's w1 and w3; a
    compressor's wkv and wgate). When every module is an ``Fp8Linear``, x is rounded to e4m3 once
    for all of them: one act-quant (one launch on the GPU) instead of one per projection.
    Linears stacked by :func:`stack_rows` run as one matmul (x read once, one launch; on the GPU
    for ``Fp8Linear``s, the torch path runs them one by one); the outputs are then column views
    of its result. The fused paths run no forward hooks of ``mods``: a
    collective on one of these outputs is the caller's explicit call (``Indexer.gather_heads``).
    ``out_dtype`` (plain linears only): compute and return in it (the compressors' fp32 of a
    bf16 input), through :func:`dense_linear`."""
    if not all(isinstance(m, Fp8Linear) for m in mods):
        st = row_stack_of(mods)
        if st is None:
            if out_dtype is None:
                return [m(x) for m in mods]
            return [dense_linear(x, m.weight, out_dtype) for m in mods]
        y = dense_linear(x, st.weight, out_dtype)
        return list(y.split([m.weight.shape[0] for m in mods], dim=-1))
    if out_dtype is not None and out_dtype != x.dtype:
        raise ValueError("shared_input: out_dtype is for plain linears; Fp8Linear outputs are in x's dtype")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    quant = _kernel("fp8_gemm", "act_quant_fp8") if _on_gpu(x) else None
    gemm = _kernel("fp8_gemm", "fp8_block_gemm") if quant is not None else None
    if gemm is not None:
        from dsv4_backend.kernels.fp8_gemv import fp8_row_gemv, row_gemv_applies   # (imported with gemm)
        st = row_stack_of(mods) if len(mods) > 1 else None
        if row_gemv_applies(x2.shape[0]):   # one row: the GEMV rounds x itself (no act-quant launch)
            mm = lambda w, s: fp8_row_gemv(x2, w, s, mode="quant")   # noqa: E731
        else:
            xq, xs = quant(x2)
            mm = lambda w, s: gemm(xq, xs, w, s, x.dtype)   # noqa: E731
        if st is not None:      # one GEMM over the stacked rows; the outputs are its column views
            y = mm(st.weight, st.scale)
            ys = list(y.split([m.weight.shape[0] for m in mods], dim=-1))
        else:
            ys = [mm(m.weight, m.scale) for m in mods]
    else:
        c = compute_dtype(x.dtype)
        xa = act_fake_quant(x2)
        ys = [F.linear(xa, m.dequantised(c, x.is_cuda)).to(x.dtype) for m in mods]
    return [y.view(*lead, y.shape[-1]) for y in ys]


class Fp4Slot(nn.Module):
    """One routed expert projection's stored bytes, a view into its MoE layer's stack:
    ``weight uint8 [out, in/2]`` (e2m1 pairs), ``scale uint8 [out, in/32]`` (e8m0)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        shape = (out_features, in_features)
        self.register_buffer("weight", torch.empty(fp4_packed_shape(shape), dtype=torch.uint8))
        self.register_buffer("scale", torch.empty(fp4_scale_shape(shape), dtype=torch.uint8))


class Fp4Expert(nn.Module):
    """Names of one routed expert (``w1``, ``w3``, ``w2``); it runs only as part of the stack."""

    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.w1 = Fp4Slot(dim, inter)
        self.w3 = Fp4Slot(dim, inter)
        self.w2 = Fp4Slot(inter, dim)


# On CUDA the loaded experts are repacked into MMA fragment order (kernels/fp4_mma.py) and the
# release layout is freed; DSV4_FP4_MMA=0 keeps the release layout and the Triton kernels.
USE_FP4_MMA = os.environ.get("DSV4_FP4_MMA", "1") != "0"


class Fp4ExpertStack:
    """A MoE layer's routed experts as four stacked tensors, the per-expert buffers their slices:
    ``w13 [E, 2I, D/2]``, ``w13_scale [E, 2I, D/32]``, ``w2 [E, D, I/2]``, ``w2_scale [E, D, I/32]``.

    ``pack_for_mma`` (CUDA, after loading) replaces them with the fragment-order packs of
    ``kernels/fp4_mma.py``: from then on the stack serves forwards only (the per-expert buffers
    are emptied, so loading weights into the model again raises a shape error)."""

    def __init__(self, experts: nn.ModuleList, device: torch.device):
        E = len(experts)
        inter, half_d = experts[0].w1.weight.shape
        dim = experts[0].w2.weight.shape[0]
        u8 = dict(dtype=torch.uint8, device=device)
        self.w13 = torch.empty(E, 2 * inter, half_d, **u8)
        self.w13_scale = torch.empty(E, 2 * inter, 2 * half_d // 32, **u8)
        self.w2 = torch.empty(E, dim, inter // 2, **u8)
        self.w2_scale = torch.empty(E, dim, inter // 32, **u8)
        self.inter = inter
        self._cache = _DequantCache()
        self.mma = None  # (w13 pack, w2 pack) once pack_for_mma ran
        self._experts = experts
        for e, ex in enumerate(experts):
            ex.w1.weight, ex.w1.scale = self.w13[e, :inter], self.w13_scale[e, :inter]
            ex.w3.weight, ex.w3.scale = self.w13[e, inter:], self.w13_scale[e, inter:]
            ex.w2.weight, ex.w2.scale = self.w2[e], self.w2_scale[e]

    @torch.no_grad()
    def pack_for_mma(self) -> bool:
        """Repack the loaded experts for ``fp4_mma`` and free the release layout; True if done
        (CUDA, the kernels import, ``DSV4_FP4_MMA`` not 0)."""
        if self.mma is not None:
            return True
        pack = _kernel("fp4_mma", "pack_fp4_mma") if USE_FP4_MMA and self.w13.is_cuda else None
        if pack is None:
            return False
        self.mma = (pack(self.w13, self.w13_scale, 2), pack(self.w2, self.w2_scale, 2))
        empty = torch.empty(0, dtype=torch.uint8, device=self.w13.device)
        for ex in self._experts:
            for slot in (ex.w1, ex.w3, ex.w2):
                slot.weight, slot.scale = empty, empty
        self.w13 = self.w13_scale = self.w2 = self.w2_scale = None
        return True

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, limit: float,
                shared: Any = None, x_quant: Any = None) -> torch.Tensor:
        """Routed experts: ``x [T, D]``, ``ids [T, k]``, ``weights [T, k]`` -> ``[T, D]`` in x's dtype;
        with ``shared`` (an ``fp4_mma.SharedFp8``, MMA packs only) the shared expert's output added;
        ``x_quant``: ``act_quant_fp8(x)`` already computed (MMA packs only)."""
        if (shared is not None or x_quant is not None) and self.mma is None:
            raise ValueError("Fp4ExpertStack.forward: a fused shared expert or a given act-quant needs the MMA "
                             "packs (pack_for_mma)")
        if self.mma is not None:
            return _kernel("fp4_mma", "fp4_moe_mma")(x.to(torch.bfloat16), ids, weights.to(torch.float32),
                                                     *self.mma, limit, shared=shared, x_quant=x_quant).to(x.dtype)
        fn = _kernel("fp4_moe", "fp4_moe") if x.is_cuda and x.dtype == torch.bfloat16 else None
        if fn is not None:
            return fn(x, ids, weights.to(torch.float32), self.w13, self.w13_scale, self.w2, self.w2_scale, limit)
        if x.is_cuda:   # no dequantised copy of a GPU-sized stack
            return fp4_moe_ref(x, ids, weights, self.w13, self.w13_scale, self.w2, self.w2_scale, limit)
        c = compute_dtype(x.dtype)
        w13, w2 = self._cache.get((self.w13, self.w13_scale, self.w2, self.w2_scale), c, lambda: (
            dequant_fp4(self.w13, self.w13_scale, c), dequant_fp4(self.w2, self.w2_scale, c)))
        return moe_act_quant(x, ids, weights, w13.__getitem__, w2.__getitem__, limit)
