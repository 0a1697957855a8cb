"""Byte layouts of the attention (584 B) and indexer (132 B) rows inside a page, and
vectorised read/write of rows at pool slots.

Attention row, FlashMLA "MODEL1" FP8 format (584 B per row)::

    one row's parts                       byte offset inside its part
    [ nope: 448 x e4m3 | rope: 64 x bf16 ]  0 .. 447 | 448 .. 575   (576 B, rope little-endian)
    [ 7 x ue8m0 tile exponent | pad 0 ]     0 .. 6   | 7            (8 B, byte = exponent + 127)

    a page of P rows (P * 584 B):
    0                                    P*576                        P*584
    | part 0 | part 1 | ... | part P-1   | scales 0 | ... | scales P-1 |
      row j's part at j*576                row j's scale group at P*576 + j*8

The page order (all P 576-byte parts first, then all P 8-byte scale groups) was checked against
deepseek-ai/FlashMLA (commit 9241ae3): ``tests/quant.py`` (``quantize_k_cache`` for
``MODEL1_FP8Sparse`` views a block as ``[P, 576]`` nope|rope followed by ``[P, 8]`` scale
bytes, 7 used), and the kernels ``csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh`` and
``csrc/sm100/decode/head64/kernel.cuh``, which read a token's nope|rope at
``block * block_stride + row * 576`` and its 8 scale bytes at
``block * block_stride + page_block_size * 576 + row * 8``, and assert a row stride of 584
(the cache is viewed ``[pages, P, 1, 584]``). FlashMLA's test allocates each block padded to a
multiple of 576 B (the sm100 kernel addresses blocks in 576-byte TMA steps); the pool helpers
below accept such padded pages (any tail shorter than one row is left alone).

Indexer row (132 B): 128 x e4m3 values and one float32 scale (a power of two)::

    0                      P*128               P*132
    | values 0 | ... | values P-1 | scale 0 | ... | scale P-1 |
      row j's values at j*128       row j's fp32 scale at P*128 + j*4 (little-endian)

This is the page order of the V3.2 indexer cache that DeepGEMM's ``fp8_paged_mqa_logits``
reads (deepseek-ai/DeepGEMM ``tests/test_attention.py``, ``kv_cache_cast_to_fp8``: a block is
``block_size * 128`` value bytes, then ``block_size`` fp32 scales) and that SGLang writes
(``python/sglang/srt/layers/attention/nsa/index_buf_accessor.py``: scales from byte
``page_size * 128`` of the page). Those scales are amax/448, not rounded to a power of two;
ours are (same bytes, different values).

Pools: an attention pool is uint8 ``[num_pages, page_bytes]`` with ``P = page_bytes // 584``;
an indexer pool likewise with 132. Slot ``s`` is row ``s % P`` of page ``s // P``. The pool
helpers check the slot range and raise ValueError on a bad slot (one host sync per call on
CUDA); with duplicate slots in one write, which row ends up stored is unspecified.
All functions are plain torch ops (CPU or CUDA); bytes are little-endian as on x86 and GPUs.
"""

from __future__ import annotations

import sys

import torch

from memory.quant import (
    INDEXER_DIM, KV_DIM, KV_NOPE_DIM, KV_NUM_TILES, IndexerRowQuant, KVRowQuant,
    indexer_dequantize, indexer_quantize, kv_dequantize, kv_quantize,
)

KV_NOPE_BYTES = 448
KV_ROPE_BYTES = 128
KV_PART_BYTES = KV_NOPE_BYTES + KV_ROPE_BYTES  # 576
KV_SCALE_BYTES = 8  # 7 tile exponents + 1 pad byte
KV_ROW_BYTES = KV_PART_BYTES + KV_SCALE_BYTES  # 584
INDEXER_VALUE_BYTES = 128
INDEXER_SCALE_BYTES = 4
INDEXER_ROW_BYTES = INDEXER_VALUE_BYTES + INDEXER_SCALE_BYTES  # 132

assert KV_ROW_BYTES == 584 and KV_PART_BYTES == 576
assert KV_NOPE_BYTES == KV_NOPE_DIM * 1 and KV_ROPE_BYTES == (KV_DIM - KV_NOPE_DIM) * 2
assert KV_SCALE_BYTES == KV_NUM_TILES + 1
assert INDEXER_ROW_BYTES == 132 and INDEXER_VALUE_BYTES == INDEXER_DIM
assert sys.byteorder == "little", "row layouts are little-endian; this host is not"


# ---- rows <-> bytes -------------------------------------------------------------------------

def _kv_to_bytes(q: KVRowQuant) -> tuple[torch.Tensor, torch.Tensor]:
    # -> parts uint8 [N, 576], scale groups uint8 [N, 8]
    parts = torch.cat([q.nope, q.rope.contiguous().view(torch.uint8)], dim=-1)
    pad = torch.zeros_like(q.scale_exp[..., :1])
    return parts, torch.cat([q.scale_exp, pad], dim=-1)


def _kv_from_bytes(parts: torch.Tensor, groups: torch.Tensor) -> KVRowQuant:
    # parts: [..., 576], groups: [..., 8] (both contiguous)
    rope = parts[..., KV_NOPE_BYTES:].contiguous().view(torch.bfloat16)
    return KVRowQuant(parts[..., :KV_NOPE_BYTES], rope, groups[..., :KV_NUM_TILES])


def _indexer_to_bytes(q: IndexerRowQuant) -> tuple[torch.Tensor, torch.Tensor]:
    # -> values uint8 [N, 128], scales uint8 [N, 4]
    return q.values, q.scale.unsqueeze(-1).contiguous().view(torch.uint8)


def _indexer_from_bytes(values: torch.Tensor, scales: torch.Tensor) -> IndexerRowQuant:
    return IndexerRowQuant(values, scales.contiguous().view(torch.float32).squeeze(-1))


def _check_rows(rows: torch.Tensor, dim: int, what: str) -> None:
    if rows.dim() != 2 or rows.shape[1] != dim:
        raise ValueError(f"{what} rows must be [N, {dim}], got {tuple(rows.shape)}")


def _check_one_slot_per_row(slots: torch.Tensor, rows: torch.Tensor) -> None:
    if slots.shape != rows.shape[:1]:
        raise ValueError(f"need one slot per row: slots {tuple(slots.shape)}, "
                         f"rows {tuple(rows.shape)}")


def _check_page(page_bytes: torch.Tensor, page_size: int, row_bytes: int) -> None:
    if page_bytes.dtype != torch.uint8 or page_bytes.dim() != 1:
        raise ValueError(f"a page is a 1-D uint8 tensor, got {page_bytes.dtype} "
                         f"{tuple(page_bytes.shape)}")
    if page_bytes.numel() != page_size * row_bytes:
        raise ValueError(f"a page of {page_size} rows has {page_size * row_bytes} bytes, "
                         f"got {page_bytes.numel()}")


# ---- one page -------------------------------------------------------------------------------

def pack_kv_page(rows: torch.Tensor) -> torch.Tensor:
    """Attention rows ``[P, 512]`` -> one page, uint8 ``[P * 584]``."""
    _check_rows(rows, KV_DIM, "attention")
    parts, groups = _kv_to_bytes(kv_quantize(rows))
    return torch.cat([parts.reshape(-1), groups.reshape(-1)])


def unpack_kv_page(page_bytes: torch.Tensor, page_size: int) -> torch.Tensor:
    """One page uint8 ``[P * 584]`` -> float32 rows ``[P, 512]``."""
    _check_page(page_bytes, page_size, KV_ROW_BYTES)
    split = page_size * KV_PART_BYTES
    parts = page_bytes[:split].reshape(page_size, KV_PART_BYTES)
    groups = page_bytes[split:].reshape(page_size, KV_SCALE_BYTES)
    return kv_dequantize(_kv_from_bytes(parts, groups))


def pack_indexer_page(rows: torch.Tensor) -> torch.Tensor:
    """Indexer rows ``[P, 128]`` -> one page, uint8 ``[P * 132]``."""
    _check_rows(rows, INDEXER_DIM, "indexer")
    values, scales = _indexer_to_bytes(indexer_quantize(rows))
    return torch.cat([values.reshape(-1), scales.reshape(-1)])


def unpack_indexer_page(page_bytes: torch.Tensor, page_size: int) -> torch.Tensor:
    """One page uint8 ``[P * 132]`` -> float32 rows ``[P, 128]``."""
    _check_page(page_bytes, page_size, INDEXER_ROW_BYTES)
    split = page_size * INDEXER_VALUE_BYTES
    values = page_bytes[:split].reshape(page_size, INDEXER_VALUE_BYTES)
    scales = page_bytes[split:].reshape(page_size, INDEXER_SCALE_BYTES)
    return indexer_dequantize(_indexer_from_bytes(values, scales))


# ---- pools ----------------------------------------------------------------------------------

def pool_page_size(pool: torch.Tensor, row_bytes: int, what: str) -> int:
    """Rows per page P of a uint8 ``[num_pages, page_bytes]`` pool (a padded tail is allowed)."""
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.stride(1) != 1:
        raise ValueError(f"{what} pool must be uint8 [num_pages, page_bytes] with contiguous "
                         f"pages, got {pool.dtype} {tuple(pool.shape)}")
    page_size = pool.shape[1] // row_bytes
    if page_size == 0:
        raise ValueError(f"{what} pool pages of {pool.shape[1]} bytes hold no {row_bytes}-byte row")
    return page_size


def _pool_regions(pool: torch.Tensor, row_bytes: int, head_bytes: int, what: str):
    """Views ``[num_pages, P, head_bytes]`` and ``[num_pages, P, row_bytes - head_bytes]`` of a
    pool's two per-page regions; writes through them land in the pool."""
    page_size = pool_page_size(pool, row_bytes, what)
    split = page_size * head_bytes
    head = pool[:, :split].unflatten(1, (page_size, head_bytes))
    tail = pool[:, split:page_size * row_bytes].unflatten(1, (page_size, row_bytes - head_bytes))
    return page_size, head, tail


def _check_slots(slots: torch.Tensor, capacity: int, allow_negative: bool) -> None:
    if slots.dtype != torch.int64:
        raise ValueError(f"slots must be int64, got {slots.dtype}")
    if slots.numel() == 0:
        return
    low, high = int(slots.min()), int(slots.max())
    if high >= capacity or (low < 0 and not allow_negative):
        allowed = "-1 (no row) or " if allow_negative else ""
        raise ValueError(f"slots must be {allowed}in [0, {capacity}); got range [{low}, {high}]")


def _write(pool, slots, head_bytes, tail_bytes, row_bytes, what):
    # head_bytes: [N, head], tail_bytes: [N, tail]
    page_size, head, tail = _pool_regions(pool, row_bytes, head_bytes.shape[-1], what)
    _check_slots(slots, pool.shape[0] * page_size, allow_negative=False)
    page, offset = slots // page_size, slots % page_size
    head[page, offset] = head_bytes
    tail[page, offset] = tail_bytes


def _read(pool, slots, row_bytes, head_width, what):
    # -> head bytes [..., head_width], tail bytes [..., row_bytes - head_width], valid [...]
    page_size, head, tail = _pool_regions(pool, row_bytes, head_width, what)
    _check_slots(slots, pool.shape[0] * page_size, allow_negative=True)
    valid = slots >= 0
    safe = slots.clamp_min(0)
    page, offset = safe // page_size, safe % page_size
    return head[page, offset], tail[page, offset], valid


def write_kv_rows(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Quantise ``rows [N, 512]`` and store row i at ``slots[i]`` (int64 ``[N]``, each in
    ``[0, num_pages * P)``) of the attention pool uint8 ``[num_pages, >= P * 584]``."""
    _check_rows(rows, KV_DIM, "attention")
    _check_one_slot_per_row(slots, rows)
    parts, groups = _kv_to_bytes(kv_quantize(rows))
    _write(pool, slots, parts, groups, KV_ROW_BYTES, "attention")


def read_kv_rows(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Gather and dequantise the attention rows at ``slots`` (int64, any shape ``[...]``);
    returns float32 ``[..., 512]``, zeros where a slot is negative."""
    parts, groups, valid = _read(pool, slots, KV_ROW_BYTES, KV_PART_BYTES, "attention")
    rows = kv_dequantize(_kv_from_bytes(parts, groups))
    return rows.masked_fill(~valid.unsqueeze(-1), 0.0)


def write_indexer_rows(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Quantise ``rows [N, 128]`` and store row i at ``slots[i]`` of the indexer pool
    uint8 ``[num_pages, >= P * 132]``."""
    _check_rows(rows, INDEXER_DIM, "indexer")
    _check_one_slot_per_row(slots, rows)
    values, scales = _indexer_to_bytes(indexer_quantize(rows))
    _write(pool, slots, values, scales, INDEXER_ROW_BYTES, "indexer")


def read_indexer_rows(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Gather and dequantise the indexer rows at ``slots`` (int64, any shape ``[...]``);
    returns float32 ``[..., 128]``, zeros where a slot is negative."""
    values, scales, valid = _read(pool, slots, INDEXER_ROW_BYTES, INDEXER_VALUE_BYTES, "indexer")
    rows = indexer_dequantize(_indexer_from_bytes(values, scales))
    return rows.masked_fill(~valid.unsqueeze(-1), 0.0)


def _row_format(indexer: bool) -> tuple[int, int, str]:
    return (INDEXER_ROW_BYTES, INDEXER_VALUE_BYTES, "indexer") if indexer else (KV_ROW_BYTES, KV_PART_BYTES, "attention")


def read_row_bytes(pool: torch.Tensor, slots: torch.Tensor, indexer: bool = False) -> torch.Tensor:
    """The stored bytes of the rows at ``slots`` (int64 ``[N]``, each >= 0), uint8 ``[N, row_bytes]``
    (head part then scale part): a copy that :func:`write_row_bytes` puts back bit for bit."""
    row_bytes, head_width, what = _row_format(indexer)
    _check_slots(slots, pool.shape[0] * pool_page_size(pool, row_bytes, what), allow_negative=False)
    head, tail, _ = _read(pool, slots, row_bytes, head_width, what)
    return torch.cat([head, tail], dim=-1)


def write_row_bytes(pool: torch.Tensor, slots: torch.Tensor, raw: torch.Tensor, indexer: bool = False) -> None:
    """Store rows' bytes ``raw [N, row_bytes]`` (from :func:`read_row_bytes`) at ``slots``."""
    row_bytes, head_width, what = _row_format(indexer)
    _check_one_slot_per_row(slots, raw)
    _write(pool, slots, raw[:, :head_width], raw[:, head_width:], row_bytes, what)
