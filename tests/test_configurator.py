"""DSV4PoolConfigurator, PoolPlan, the env flags and the pool tensors.

The references here are written out by hand from DSV4.md section 5 (layer counts as literals:
Flash 43 layers = 2 SWA-only + 21 CSA + 20 HCA, Pro 61 = 30 CSA + 31 HCA), independent of the
code's constants.
"""

import json
import math

import pytest
import torch

from dsv4_backend.config import DSV4Config
from memory import env
from memory.configurator import TERM_NAMES, DSV4PoolConfigurator, PlanError
from memory.pools import DSV4KVPools

FLASH = DSV4Config.preset("flash")
PRO = DSV4Config.preset("pro")
TINY = DSV4Config.preset("tiny")  # ratios (0, 4, 128, 4) + MTP 0
GiB = 1 << 30


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(env.COMPRESS_STATE_DTYPE, raising=False)
    monkeypatch.delenv(env.USE_ONLINE_COMPRESS, raising=False)


def ref_terms(L, l4, l128, *, S=4, swa_ratio=0.1, shrink=1.0, ring=8):
    """DSV4.md section 5, term by term, before the speculative factor."""
    return {
        "swa_kv": swa_ratio * 584 * L,
        "c4_kv": 584 * l4 / (4 * shrink),
        "c128_kv": 584 * l128 / 128,
        "c4_indexer_k": 132 * l4 / 4,
        "c4_state_rings": swa_ratio * (ring / 128) * (2 * 2 * 512 * S + 2 * 2 * 128 * S) * l4,
        "c128_state_ring": 0.0,
    }


# ---- the known figures ----------------------------------------------------------------

@pytest.mark.parametrize("model, kw, expected", [
    (FLASH, {}, 7705.45),
    (FLASH, {"state_dtype": torch.bfloat16}, 7033.45),
    (FLASH, {"c4_shrink_factor": 2}, 6172.45),
    (PRO, {}, 10993.84),
])
def test_known_bytes_per_full_token(model, kw, expected):
    assert DSV4PoolConfigurator(model, **kw).bytes_per_full_token() == pytest.approx(expected, abs=0.01)


def test_flash_terms_by_hand():
    terms = DSV4PoolConfigurator(FLASH).per_token_terms()
    assert tuple(terms) == TERM_NAMES
    # 0.1*584*43, 584*21/4, 584*20/128, 132*21/4, 0.1*(8/128)*(8192+2048)*21
    by_hand = {"swa_kv": 2511.2, "c4_kv": 3066.0, "c128_kv": 91.25, "c4_indexer_k": 693.0,
               "c4_state_rings": 1344.0, "c128_state_ring": 0.0}
    for name in TERM_NAMES:
        assert terms[name] == pytest.approx(by_hand[name], abs=1e-9), name
    assert terms == pytest.approx(ref_terms(43, 21, 20))


def test_pro_terms_match_reference():
    terms = DSV4PoolConfigurator(PRO).per_token_terms()
    assert terms == pytest.approx(ref_terms(61, 30, 31))


def test_speculative_doubles_the_c4_ring_and_scales_by_draft_layer():
    c = DSV4PoolConfigurator(FLASH, speculative=True)
    ref = ref_terms(43, 21, 20, ring=16)
    assert c.per_token_terms() == pytest.approx({k: v * 44 / 43 for k, v in ref.items()})
    assert c.bytes_per_full_token() == pytest.approx(sum(ref.values()) * 44 / 43)
    # (2511.2 + 3066 + 91.25 + 693 + 2688) * 44 / 43
    assert c.bytes_per_full_token() == pytest.approx(9259.90, abs=0.01)


def test_mtp_layer_is_not_counted():
    # Tiny: 4 main layers (0, 4, 128, 4) and one MTP layer (0).
    c = DSV4PoolConfigurator(TINY)
    assert (c.num_layers, c.num_c4_layers, c.num_c128_layers) == (4, 2, 1)
    assert c.bytes_per_full_token() == pytest.approx(sum(ref_terms(4, 2, 1).values()))


def test_dense_is_one_row_per_token_per_layer():
    c = DSV4PoolConfigurator(FLASH, dense=True, max_running_requests=8)
    assert c.bytes_per_full_token() == 584 * 43
    assert c.fixed_bytes() == 0
    plan = c.plan_for_tokens(10_000)
    assert plan.max_full_tokens == 9984 and plan.swa_tokens == 9984
    assert plan.c4_rows == plan.c128_rows == plan.c4_ring_slots == plan.c128_ring_rows == 0
    assert set(plan.pool_shapes()) == {"swa_kv"}


# ---- fixed bytes (the request-scoped C128 state) ----------------------------------------

def test_fixed_c128_ring_bytes_by_hand():
    # R=1: (1+1)*128 + 129 = 385 rows -> 512 (ceil to 128); 512 rows * (2*512*4 B) * 20 layers.
    assert DSV4PoolConfigurator(FLASH, max_running_requests=1).fixed_bytes() == 512 * 4096 * 20 == 41_943_040
    # R=256: 257*128 + 129 = 33025 -> 33152 rows.
    assert DSV4PoolConfigurator(FLASH, max_running_requests=256).fixed_bytes() == 33152 * 4096 * 20
    # bf16 state halves each row: 33152 * 2048 * 20.
    assert DSV4PoolConfigurator(FLASH, state_dtype=torch.bfloat16).fixed_bytes() == 1_357_905_920
    # Pro, 31 HCA layers, R=10: 11*128 + 129 = 1537 -> 1664 rows.
    assert DSV4PoolConfigurator(PRO, max_running_requests=10).fixed_bytes() == 1664 * 4096 * 31
    # Tiny, one HCA layer, R=4: 5*128 + 129 = 769 -> 896 rows.
    assert DSV4PoolConfigurator(TINY, max_running_requests=4).fixed_bytes() == 896 * 4096


def test_fixed_bytes_speculative_ring_is_256_per_request():
    # R=1: (1+1)*256 + 257 = 769 -> 896 rows of 2*512*4 B, 20 layers.
    assert DSV4PoolConfigurator(FLASH, max_running_requests=1, speculative=True).fixed_bytes() == 896 * 4096 * 20


def test_fixed_bytes_online_state():
    # (R + 3) slots of (max, sum, kv) = 3*512*4 B, 20 layers; R=1 -> 4 slots.
    c = DSV4PoolConfigurator(FLASH, max_running_requests=1, online_compress=True)
    assert c.fixed_bytes() == 4 * 6144 * 20 == 491_520
    # times (1 + draft tokens)
    c = DSV4PoolConfigurator(FLASH, max_running_requests=1, online_compress=True, draft_tokens=2)
    assert c.fixed_bytes() == 3 * 4 * 6144 * 20
    # Online leaves the per-token formula alone (the C128 term is 0 either way).
    assert c.bytes_per_full_token() == pytest.approx(7705.45, abs=0.01)


def test_fixed_bytes_known_magnitudes():
    # ~10 MiB per request slot for Flash (512 KiB per HCA layer), ~5 GiB at 512 requests.
    per_slot = (DSV4PoolConfigurator(FLASH, max_running_requests=101).fixed_bytes()
                - DSV4PoolConfigurator(FLASH, max_running_requests=100).fixed_bytes())
    assert per_slot in (0, 128 * 4096 * 20, 2 * 128 * 4096 * 20)
    big = DSV4PoolConfigurator(FLASH, max_running_requests=512).fixed_bytes()
    assert 5.0 * GiB < big < 5.1 * GiB


# ---- env flags ----------------------------------------------------------------------------

@pytest.mark.parametrize("raw, dtype", [("float32", torch.float32), ("fp32", torch.float32),
                                        ("bf16", torch.bfloat16), ("BFloat16", torch.bfloat16)])
def test_env_state_dtype(monkeypatch, raw, dtype):
    monkeypatch.setenv(env.COMPRESS_STATE_DTYPE, raw)
    assert env.compress_state_dtype() == dtype


def test_env_state_dtype_default_and_error(monkeypatch):
    assert env.compress_state_dtype() == torch.float32
    monkeypatch.setenv(env.COMPRESS_STATE_DTYPE, "fp16")
    with pytest.raises(ValueError, match="SGLANG_DSV4_COMPRESS_STATE_DTYPE.*bf16"):
        env.compress_state_dtype()


@pytest.mark.parametrize("raw, on", [("1", True), ("true", True), ("YES", True),
                                     ("0", False), ("", False), ("false", False)])
def test_env_online(monkeypatch, raw, on):
    monkeypatch.setenv(env.USE_ONLINE_COMPRESS, raw)
    assert env.use_online_compress() is on


def test_env_online_default_and_error(monkeypatch):
    assert env.use_online_compress() is False
    monkeypatch.setenv(env.USE_ONLINE_COMPRESS, "2")
    with pytest.raises(ValueError, match="SGLANG_OPT_USE_ONLINE_COMPRESS"):
        env.use_online_compress()


def test_configurator_reads_env_at_call_time(monkeypatch):
    monkeypatch.setenv(env.COMPRESS_STATE_DTYPE, "bf16")
    monkeypatch.setenv(env.USE_ONLINE_COMPRESS, "1")
    c = DSV4PoolConfigurator(FLASH, max_running_requests=1)
    assert c.state_dtype == torch.bfloat16 and c.online_compress
    assert c.bytes_per_full_token() == pytest.approx(7033.45, abs=0.01)
    assert c.fixed_bytes() == 4 * 3 * 512 * 2 * 20
    # Explicit arguments win over the env.
    c = DSV4PoolConfigurator(FLASH, state_dtype=torch.float32, online_compress=False)
    assert c.state_dtype == torch.float32 and not c.online_compress


# ---- rejections -----------------------------------------------------------------------------

def test_rejects_shrink_below_one():
    with pytest.raises(PlanError, match=r"c4_shrink_factor.*>= 1"):
        DSV4PoolConfigurator(FLASH, c4_shrink_factor=0.5)


def test_rejects_online_with_speculative(monkeypatch):
    with pytest.raises(PlanError, match="SGLANG_OPT_USE_ONLINE_COMPRESS.*speculative"):
        DSV4PoolConfigurator(FLASH, speculative=True, online_compress=True)
    monkeypatch.setenv(env.USE_ONLINE_COMPRESS, "1")
    with pytest.raises(PlanError, match="speculative"):
        DSV4PoolConfigurator(FLASH, speculative=True)


def test_rejects_budget_below_window_plus_page_per_request():
    c = DSV4PoolConfigurator(FLASH, max_running_requests=256)
    # 256 * (128 + 128) = 65536 SWA tokens cost ~1.6 GiB on top of 2.5 GiB of C128 rings.
    with pytest.raises(PlanError, match=r"(?s)65,536 tokens.*budget.*--max-running-requests"):
        c.plan_for_budget(3 * GiB)
    # Below the fixed reservation alone.
    with pytest.raises(PlanError, match="too small"):
        c.plan_for_budget(GiB)
    with pytest.raises(PlanError, match="max_running_requests"):
        DSV4PoolConfigurator(TINY, max_running_requests=16).plan_for_tokens(4095)


def test_rejects_bad_settings():
    with pytest.raises(PlanError, match="swa_ratio"):
        DSV4PoolConfigurator(FLASH, swa_ratio=0)
    with pytest.raises(PlanError, match="max_running_requests"):
        DSV4PoolConfigurator(FLASH, max_running_requests=0)
    with pytest.raises(PlanError, match="full_page"):
        DSV4PoolConfigurator(FLASH, full_page=200)


# ---- plans ------------------------------------------------------------------------------------

def test_plan_for_budget_flash():
    budget = 100 * GiB
    c = DSV4PoolConfigurator(FLASH, max_running_requests=256)
    plan = c.plan_for_budget(budget)
    bpft = sum(ref_terms(43, 21, 20).values())
    fixed = 33152 * 4096 * 20
    full = math.floor((budget - fixed) / bpft / 256) * 256
    assert plan.max_full_tokens == full
    assert plan.fixed_bytes == fixed and plan.budget_bytes == budget
    assert plan.swa_tokens == math.floor(full * 0.1 / 128) * 128
    assert plan.num_swa_pages == plan.swa_tokens // 128
    assert plan.c4_rows == plan.c4_indexer_rows == full // 4
    assert plan.c128_rows == full // 128
    assert plan.c4_ring_slots == plan.num_swa_pages * 8
    assert plan.c128_ring_rows == 256 * 128 and plan.online_state_slots == 0
    assert plan.requests_fit(128 * 1024) == full // (128 * 1024)
    # What the pools hold fits the budget up to the dummy pages (< 0.1%).
    assert plan.total_bytes < budget * 1.001
    assert plan.bytes_per_full_token == pytest.approx(bpft)
    assert sum(plan.per_token_terms.values()) == pytest.approx(plan.bytes_per_full_token)


def test_plan_for_budget_raises_swa_to_its_minimum():
    # Tiny, 8 requests: minimum SWA = 8 * (128 + 128) = 2048 tokens; at ~16K full tokens 10% of
    # them (1536 after page alignment) falls short, so SWA is held at 2048 and paid for.
    c = DSV4PoolConfigurator(TINY, max_running_requests=8)
    fixed = c.fixed_bytes()
    bpft = c.bytes_per_full_token()
    budget = fixed + int(16_000 * bpft)
    plan = c.plan_for_budget(budget)
    assert plan.swa_tokens == 2048
    swa_cost = 584 * 4 + (8 / 128) * (2048 + 512) * 4 * 2  # a row in 4 layers + 2 CSA layers' ring share
    rest = bpft - 0.1 * swa_cost
    spent = plan.max_full_tokens * rest + 2048 * swa_cost
    assert spent <= budget - fixed < spent + 256 * rest
    assert plan.max_full_tokens < math.floor((budget - fixed) / bpft / 256) * 256


def test_plan_for_tokens():
    c = DSV4PoolConfigurator(TINY, max_running_requests=4)
    plan = c.plan_for_tokens(5000)
    assert plan.max_full_tokens == 4864  # floored to 256
    assert plan.swa_tokens == max(math.floor(486.4 / 128) * 128, 4 * 256) == 1024
    assert plan.c4_rows == 1216 and plan.c128_rows == 38 and plan.c4_ring_slots == 64
    assert plan.c128_ring_rows == 4 * 128
    bpft = sum(ref_terms(4, 2, 1).values())
    swa_cost = 584 * 4 + (8 / 128) * (2048 + 512) * 4 * 2
    derived = c.fixed_bytes() + 4864 * bpft + (1024 - 486.4) * swa_cost
    assert plan.budget_bytes == pytest.approx(derived, abs=1)
    # Round trip: the derived budget gives back the same token count.
    assert c.plan_for_budget(plan.budget_bytes).max_full_tokens == 4864


def test_plan_shrink_and_speculative_sizes():
    plan = DSV4PoolConfigurator(FLASH, c4_shrink_factor=2, max_running_requests=8).plan_for_tokens(1 << 20)
    assert plan.c4_rows == (1 << 20) // 8 and plan.c4_indexer_rows == (1 << 20) // 4
    plan = DSV4PoolConfigurator(FLASH, speculative=True, max_running_requests=8).plan_for_tokens(1 << 20)
    assert plan.c4_ring_size == 16 and plan.c4_ring_slots == plan.num_swa_pages * 16
    assert plan.c128_ring_size == 256 and plan.c128_ring_rows == 8 * 256
    assert plan.speculative_factor == pytest.approx(44 / 43)


def test_plan_table_and_dict():
    plan = DSV4PoolConfigurator(FLASH).plan_for_budget(100 * GiB)
    text = plan.table()
    for name in TERM_NAMES:
        assert name in text
    assert "7705.45" in text and "2511.20" in text and f"{plan.max_full_tokens:,}" in text
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["bytes_per_full_token"] == pytest.approx(7705.45, abs=0.01)
    assert d["state_dtype"] == "float32" and set(d["per_token_terms"]) == set(TERM_NAMES)
    assert d["requests_fit"]["1M"] == plan.max_full_tokens // (1 << 20)


# ---- pools ----------------------------------------------------------------------------------------

def test_pool_shapes_and_dtypes_tiny():
    plan = DSV4PoolConfigurator(TINY, max_running_requests=4).plan_for_tokens(4096)
    pools = DSV4KVPools(TINY, plan)
    assert sorted(pools.swa_kv) == [0, 1, 2, 3]
    assert sorted(pools.c4_kv) == sorted(pools.c4_indexer) == sorted(pools.c4_ring) == [1, 3]
    assert sorted(pools.c4_indexer_ring) == [1, 3]
    assert sorted(pools.c128_kv) == sorted(pools.c128_ring) == [2] and pools.c128_online == {}
    # 4096 full tokens: SWA 1024 tokens = 8 pages; C4 1024 rows = 16 pages of 64; C128 32 rows = 1 page.
    expect = {
        "swa_kv": ((9, 128 * 584), torch.uint8),
        "c4_kv": ((17, 64 * 584), torch.uint8),
        "c4_indexer": ((17, 64 * 132), torch.uint8),
        "c4_ring": ((64 + 8, 2048), torch.float32),
        "c4_indexer_ring": ((64 + 8, 512), torch.float32),
        "c128_kv": ((2, 64 * 584), torch.uint8),
        "c128_ring": ((4 * 128 + 128, 1024), torch.float32),
    }
    for kind, (shape, dtype) in expect.items():
        for t in getattr(pools, kind).values():
            assert tuple(t.shape) == shape and t.dtype == dtype, kind
            assert not t.any(), f"{kind} not zeroed"
    usage = pools.memory_usage()
    by_hand = {"swa_kv": 4 * 9 * 74752, "c4_kv": 2 * 17 * 37376, "c4_indexer": 2 * 17 * 8448,
               "c4_ring": 2 * 72 * 2048 * 4, "c4_indexer_ring": 2 * 72 * 512 * 4, "c128_kv": 2 * 37376,
               "c128_ring": 640 * 1024 * 4}
    assert usage == by_hand == plan.pool_bytes()
    assert pools.dummy_swa_slot == 8 * 128 and pools.dummy_c4_row == 1024 and pools.dummy_c128_row == 64
    assert pools.dummy_c4_ring_slot == 64 and pools.dummy_c128_ring_row == 512


def test_pools_online_float64_and_bf16(monkeypatch):
    plan = DSV4PoolConfigurator(TINY, max_running_requests=3, online_compress=True).plan_for_tokens(2048)
    pools = DSV4KVPools(TINY, plan, state_dtype=torch.float64)
    assert pools.c128_ring == {} and sorted(pools.c128_online) == [2]
    assert tuple(pools.c128_online[2].shape) == (4, 3, 512) and pools.c128_online[2].dtype == torch.float64
    assert pools.c4_ring[1].dtype == torch.float64 and pools.swa_kv[0].dtype == torch.uint8
    monkeypatch.setenv(env.COMPRESS_STATE_DTYPE, "bfloat16")
    plan = DSV4PoolConfigurator(TINY, max_running_requests=3).plan_for_tokens(2048)
    pools = DSV4KVPools(TINY, plan)
    assert pools.c4_indexer_ring[3].dtype == torch.bfloat16 and pools.c128_ring[2].dtype == torch.bfloat16
    assert pools.memory_usage()["c128_ring"] == (3 * 128 + 128) * 1024 * 2


def test_pools_dense_and_hisparse():
    plan = DSV4PoolConfigurator(TINY, max_running_requests=2, dense=True).plan_for_tokens(1024)
    pools = DSV4KVPools(TINY, plan)
    assert set(pools.memory_usage()) == {"swa_kv"}
    assert tuple(pools.swa_kv[2].shape) == (1024 // 128 + 1, 128 * 584)
    plan = DSV4PoolConfigurator(TINY, max_running_requests=2, c4_shrink_factor=2).plan_for_tokens(1024)
    with pytest.raises(ValueError, match="c4_shrink_factor"):
        DSV4KVPools(TINY, plan)
