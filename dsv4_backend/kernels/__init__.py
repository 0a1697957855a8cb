"""Fused Triton kernels for the KV store, the compressor, the indexer and sparse decode attention.

They read and write the pools' own byte formats (``memory/layout.py``); ``reference.py`` holds a
plain-PyTorch reference with each kernel's exact semantics. See ``docs/kernels.md``.

Importing this package does not import triton; the names below load their module on first use,
so CPU-only code paths never pay for (or depend on) a Triton import.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "kv_store": "kv_store", "kv_store_rows": "kv_store", "finish_rows": "kv_store",
    "compress": "compressor", "compress_pool": "compressor", "CompressEvents": "compressor",
    "online_c128_update": "compressor", "ring_write": "compressor", "ring_write_pair": "compressor",
    "compress_c4_pair": "compressor", "C4Target": "compressor",
    "indexer_scores": "indexer", "indexer_topk": "indexer", "topk_rows": "indexer",
    "IndexerConfig": "indexer", "IndexerTopK": "indexer",
    "sparse_decode": "sparse_attention", "DecodeAttentionConfig": "sparse_attention",
    "DecodeAttentionOutput": "sparse_attention",
    "sparse_verify": "verify_attention", "VerifyAttentionConfig": "verify_attention",
    "static_fill": "static_tables", "copy_rows": "row_copy", "hisparse_lookup": "hisparse_table",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dsv4_backend.kernels' has no attribute {name!r}")
    return getattr(import_module(f"dsv4_backend.kernels.{module}"), name)
