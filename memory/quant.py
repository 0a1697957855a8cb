"""FP8 rounding of attention rows and indexer rows (values only; bytes live in layout.py).

Attention row (512 dims): the 448 "nope" dims are cut into 7 tiles of 64. Each tile gets one
power-of-two scale ``2^ceil(log2(max(amax, 1e-4) / 448))`` and its values divided by the scale
round to nearest-even e4m3 (saturating at +-448). The 64 rope dims are rounded to bf16.
Indexer row (128 dims): one power-of-two scale for the whole row by the same rule.

Because every scale is a power of two, ``e4m3 * scale`` is exact in float32 and float64, so
dequantising stored bytes gives exactly what :func:`kv_fake_quant` computes on the fly.

Compute dtype: float64 inputs are rounded in float64; every other input dtype (float32, bf16,
fp16) in float32, the precision the release's quantiser works in, and the result is cast back
to the input dtype (exact: e4m3 times a power of two fits in bf16).
Inputs must be finite; NaN or inf give undefined rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
SCALE_EXP_BIAS = 127  # ue8m0: the stored byte is the exponent + 127

KV_DIM = 512
KV_NOPE_DIM = 448
KV_ROPE_DIM = 64
KV_TILE = 64
KV_NUM_TILES = KV_NOPE_DIM // KV_TILE  # 7
INDEXER_DIM = 128

assert KV_NOPE_DIM + KV_ROPE_DIM == KV_DIM and KV_NUM_TILES * KV_TILE == KV_NOPE_DIM


class Pow2Scale(NamedTuple):
    scale: torch.Tensor  # same dtype and shape as amax, an exact power of two
    exponent: torch.Tensor  # int32, scale == 2**exponent


class KVRowQuant(NamedTuple):
    nope: torch.Tensor  # uint8 [..., 448], e4m3 bit patterns
    rope: torch.Tensor  # bfloat16 [..., 64]
    scale_exp: torch.Tensor  # uint8 [..., 7], tile exponent + 127


class IndexerRowQuant(NamedTuple):
    values: torch.Tensor  # uint8 [..., 128], e4m3 bit patterns
    scale: torch.Tensor  # float32 [...], a power of two


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _exp2_exact(exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2**exponent built from the IEEE exponent field (no pow, so exact by construction)."""
    if dtype == torch.float64:
        return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)
    if dtype == torch.float32:
        return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)
    raise TypeError(f"exact power-of-two scales are built in float32 or float64, not {dtype}")


def pow2_scale(amax: torch.Tensor, max_value: float = E4M3_MAX,
               floor: float = AMAX_FLOOR) -> Pow2Scale:
    """The smallest power of two ``s`` with ``max(amax, floor) / max_value <= s``.

    ``amax`` is float32 or float64; the division happens in that dtype and the ceil(log2) is
    read exactly from frexp: for ``r = mant * 2^e`` with mant in [0.5, 1), ceil(log2 r) is
    ``e - 1`` when mant == 0.5 (r is a power of two) and ``e`` otherwise.
    """
    ratio = amax.clamp_min(floor) / max_value
    mant, e = torch.frexp(ratio)
    exponent = torch.where(mant == 0.5, e - 1, e)
    return Pow2Scale(_exp2_exact(exponent, amax.dtype), exponent)


def to_e4m3_bits(scaled: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to e4m3 (nearest even, clamped to +-448); uint8 bit patterns."""
    clamped = scaled.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX)
    return clamped.to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_bits_to(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Decode uint8 e4m3 bit patterns to ``dtype`` (exact for float32 / float64)."""
    return bits.view(torch.float8_e4m3fn).to(dtype)


def _check_float32_range(x: torch.Tensor) -> None:
    # Rows above float32 range would need scales the ue8m0 byte cannot hold (and a float32 read
    # could not represent); only float64 inputs can get there.
    if x.dtype == torch.float64 and bool((x.abs() > torch.finfo(torch.float32).max).any()):
        raise ValueError("FP8 rows hold magnitudes up to float32 max only; got a larger value")


def _check_last_dim(x: torch.Tensor, dim: int, what: str) -> None:
    if x.shape[-1] != dim:
        raise ValueError(f"{what} rows must have last dim {dim}, got shape {tuple(x.shape)}")


def _nope_tiles(rows: torch.Tensor) -> torch.Tensor:
    # rows: [..., 512] -> nope tiles [..., 7, 64] in the compute dtype
    nope = rows[..., :KV_NOPE_DIM].to(_compute_dtype(rows.dtype))
    return nope.reshape(*rows.shape[:-1], KV_NUM_TILES, KV_TILE)


def kv_quantize(rows: torch.Tensor) -> KVRowQuant:
    """Quantise attention rows ``[..., 512]`` to the stored FP8 form."""
    _check_last_dim(rows, KV_DIM, "attention")
    _check_float32_range(rows)
    tiles = _nope_tiles(rows)  # [..., 7, 64]
    scale, exponent = pow2_scale(tiles.abs().amax(dim=-1, keepdim=True))
    nope = to_e4m3_bits(tiles / scale).reshape(*rows.shape[:-1], KV_NOPE_DIM)
    rope = rows[..., KV_NOPE_DIM:].to(torch.bfloat16)
    scale_exp = (exponent.squeeze(-1) + SCALE_EXP_BIAS).to(torch.uint8)
    return KVRowQuant(nope, rope, scale_exp)


def kv_dequantize(q: KVRowQuant, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored FP8 form back to rows ``[..., 512]`` in ``dtype`` (float32 or float64)."""
    lead = q.nope.shape[:-1]
    scale = _exp2_exact(q.scale_exp.to(torch.int32) - SCALE_EXP_BIAS, dtype).unsqueeze(-1)
    nope = e4m3_bits_to(q.nope, dtype).reshape(*lead, KV_NUM_TILES, KV_TILE) * scale
    return torch.cat([nope.reshape(*lead, KV_NOPE_DIM), q.rope.to(dtype)], dim=-1)


def kv_fake_quant(rows: torch.Tensor) -> torch.Tensor:
    """``kv_dequantize(kv_quantize(rows))`` computed directly; same dtype and shape as ``rows``."""
    _check_last_dim(rows, KV_DIM, "attention")
    _check_float32_range(rows)
    tiles = _nope_tiles(rows)
    scale = pow2_scale(tiles.abs().amax(dim=-1, keepdim=True)).scale
    nope = e4m3_bits_to(to_e4m3_bits(tiles / scale), tiles.dtype) * scale
    nope = nope.reshape(*rows.shape[:-1], KV_NOPE_DIM).to(rows.dtype)
    rope = rows[..., KV_NOPE_DIM:].to(torch.bfloat16).to(rows.dtype)
    return torch.cat([nope, rope], dim=-1)


def indexer_quantize(rows: torch.Tensor) -> IndexerRowQuant:
    """Quantise indexer rows ``[..., 128]``: one power-of-two scale per row."""
    _check_last_dim(rows, INDEXER_DIM, "indexer")
    _check_float32_range(rows)
    x = rows.to(_compute_dtype(rows.dtype))
    scale = pow2_scale(x.abs().amax(dim=-1, keepdim=True)).scale
    return IndexerRowQuant(to_e4m3_bits(x / scale), scale.squeeze(-1).to(torch.float32))


def indexer_dequantize(q: IndexerRowQuant, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored indexer form back to rows ``[..., 128]`` in ``dtype`` (float32 or float64)."""
    return e4m3_bits_to(q.values, dtype) * q.scale.to(dtype).unsqueeze(-1)


def indexer_fake_quant(rows: torch.Tensor) -> torch.Tensor:
    """``indexer_dequantize(indexer_quantize(rows))`` computed directly, in the input dtype."""
    _check_last_dim(rows, INDEXER_DIM, "indexer")
    _check_float32_range(rows)
    x = rows.to(_compute_dtype(rows.dtype))
    scale = pow2_scale(x.abs().amax(dim=-1, keepdim=True)).scale
    return (e4m3_bits_to(to_e4m3_bits(x / scale), x.dtype) * scale).to(rows.dtype)
