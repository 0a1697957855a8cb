"""The decode step's byte floor (bench/_floor.py) against bytes counted by hand from DSV4.md.

The tiny preset: hidden 256, 4 layers (window-only, CSA, HCA, CSA), 8 heads of 512, q_lora 128,
2 output groups of rank 128, indexer 8 x 128, top-k 16, 8 routed experts (top 2) of 128 + one
shared, layer 0 hash-routed, vocab 129280. Every count below is written out from the shapes of
DSV4.md section 3, not taken from weights.py.
"""

from __future__ import annotations

import pytest
import torch

from bench._floor import KV_PARTS, WEIGHT_PARTS, decode_step_floor, distinct_experts
from dsv4_backend.config import DSV4Config

TINY = DSV4Config.preset("tiny")
F32 = 4
D, V = 256, 129280

ATTN = 128 * D + 128 + 4096 * 128 + 512 * D + 512 + 256 * 2048 + D * 256 + 8   # wq_a .. attn_sink
MHC = 2 * (24 * 4 * D + 24 + 3) + 2 * D                                          # hc_{attn,ffn}_*, 2 norms
CSA_EXTRA = (2 * 1024 * D + 4 * 1024 + 512                                       # compressor (coff 2)
             + 1024 * 128 + 8 * D + 2 * 256 * D + 4 * 256 + 128)                 # indexer + its compressor
HCA_EXTRA = 2 * 512 * D + 128 * 512 + 512                                        # compressor (coff 1)
EXPERT = 3 * 128 * D                                                             # w1, w3, w2
HEAD = V * D + D + 4 * 4 * D + 4 + 1                                             # head, norm, hc_head


def test_compressed_step_bytes_by_hand():
    ctx, B = 1000, 3
    f = decode_step_floor(TINY, ctx, B, torch.float32)
    experts = 8 * (1 - (1 - 2 / 8) ** B)                 # 4.625 expected distinct per layer
    want = {
        "attention": 4 * ATTN * F32,
        "compressor_indexer": (2 * CSA_EXTRA + HCA_EXTRA) * F32,
        "mhc_norms": 4 * MHC * F32,
        "gate": (4 * 8 * D + 3 * 8) * F32 + B * 2 * 8,    # weights, 3 biases, B tid2eid rows (int64)
        "shared_expert": 4 * EXPERT * F32,
        "routed_experts": 4 * experts * EXPERT * F32,
        "embed_rows": B * D * F32,
        "head": HEAD * F32,
        # position 1000: 1001 tokens visible; 250 C4 rows, 7 C128 rows
        "kv_window": B * 4 * 128 * 584,
        "kv_c4_topk": B * 2 * 16 * 584,
        "indexer_rows": B * 2 * 250 * 132,
        "kv_c128": B * 1 * 7 * 584,
        "kv_dense": 0,
    }
    assert set(f.parts) == set(WEIGHT_PARTS + KV_PARTS)
    for k, v in want.items():
        assert f.parts[k] == pytest.approx(v, rel=1e-12), k
    assert f.experts_per_layer == pytest.approx(4.625)
    assert f.total_bytes == pytest.approx(sum(want.values()), rel=1e-12)
    # the breakdown's categories: the HCA layer's attention + compressor weights + its KV rows
    assert f.categories["attn_hca"] == (ATTN + HCA_EXTRA) * F32 + B * (128 + 7) * 584
    assert f.categories["moe"] == pytest.approx(want["gate"] + want["shared_expert"] + want["routed_experts"])
    assert sum(f.categories.values()) == pytest.approx(f.total_bytes, rel=1e-12)
    assert f.ms(1000.0) == pytest.approx(sum(want.values()) / 1e12 * 1e3, rel=1e-12)


def test_dense_short_context_bytes_by_hand():
    # dense: every layer reads all p + 1 rows and no compressor / indexer weights; at position 10
    # the window and the compressed pools would not even be full
    f = decode_step_floor(TINY, 10, 1, torch.float32, dense=True)
    assert f.parts["compressor_indexer"] == 0
    assert f.parts["kv_dense"] == 4 * 11 * 584
    assert f.kv_bytes == 4 * 11 * 584
    sparse = decode_step_floor(TINY, 10, 1, torch.float32)
    assert sparse.parts["kv_window"] == 4 * 11 * 584
    assert sparse.parts["kv_c4_topk"] == 2 * 2 * 584 and sparse.parts["indexer_rows"] == 2 * 2 * 132
    assert sparse.parts["kv_c128"] == 0


def test_quantised_experts_and_measured_count():
    # FP4 expert: e2m1 pairs [out, in/2] + one e8m0 byte per 32 along K, for w1, w3 [128, 256], w2 [256, 128]
    fp4 = 2 * (128 * 128 + 128 * 8) + (256 * 64 + 256 * 4)
    f = decode_step_floor(TINY, 0, 1, torch.bfloat16, quantized=True, experts_per_layer=3)
    assert f.experts_how == "measured"
    assert f.parts["routed_experts"] == 4 * 3 * fp4
    # FP8 wq_a: e4m3 [128, 256] + fp32 scales [1, 2]; wo_a [2048, 256] kept FP8 too (W8A16)
    bf16_attn = 2 * (128 + 512) + 8 * 4           # norms bf16, sink fp32
    fp8_attn = sum(o * i + 4 * (-(-o // 128)) * (-(-i // 128))
                   for o, i in ((128, D), (4096, 128), (512, D), (2048, 256), (D, 256)))
    assert f.parts["attention"] == 4 * (bf16_attn + fp8_attn)


def test_distinct_experts_limits_and_errors():
    assert distinct_experts(256, 6, 1) == pytest.approx(6)
    assert distinct_experts(8, 2, 1000) == pytest.approx(8)
    with pytest.raises(ValueError, match="batch"):
        decode_step_floor(TINY, 10, 0)
