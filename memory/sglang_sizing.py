"""The DSV4 pool formula (DSV4.md section 5) on SGLang's page geometry.

``memory.configurator`` sizes our own pools: 128-token SWA pages and rows counted at 584 B.
SGLang 0.5.23 builds its DSV4 pools differently, and a configurator that serves SGLang has to
size SGLang's pools, so the same six terms are priced here on SGLang's geometry:

- one page size ``page`` (256) for the full, SWA and ring addressing; a ratio-m pool has
  ``page / m`` rows per page;
- an attention page of ``r`` rows is ``ceil(r * 584 / 576) * 576`` bytes (FlashMLA's 576-byte
  blocks): 149,760 B for SWA (585 B a token), 37,440 B for C4 (64 rows), 1,728 B for C128
  (2 rows, 864 B a row); an indexer page is ``r * 132`` bytes (8,448 B for 64 rows);
- the C4 rings hold 8 slots (16 speculative) per *256-token* SWA page, half our per-token share;
- the C128 state has ``max_running_requests + 1`` request slots (one spare, SGLang's
  ``_get_num_req_slots``), padded by ``ring + 1`` rows and rounded up to 128 rows;
- the SWA pool is either a share of the full tokens (``swa_ratio``) or, in SGLang's cap mode,
  a fixed token count the caller gives (``swa_cap_tokens``, SGLang's scheduler policy).

Pure arithmetic on plain numbers: nothing here imports SGLang (``dsv4_backend.sglang_adapter``
gathers the inputs from SGLang and returns SGLang's ``MemoryPoolConfig``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memory.configurator import (
    C4_INDEXER_STATE_WIDTH, C4_RING, C4_RING_SPEC, C4_STATE_WIDTH, C128_RING, C128_RING_SPEC,
    C128_STATE_WIDTH, HEAD_DIM, ONLINE_STATE_SHAPE, PlanError,
)
from memory.layout import INDEXER_ROW_BYTES, KV_PART_BYTES, KV_ROW_BYTES

SGLANG_PAGE = 256  # SGLang's DSV4 page size (tokens)


def attention_page_bytes(rows: int) -> int:
    """Bytes of an attention page of ``rows`` 584-byte rows, padded to 576-byte blocks."""
    return math.ceil(rows * KV_ROW_BYTES / KV_PART_BYTES) * KV_PART_BYTES


def indexer_page_bytes(rows: int) -> int:
    return rows * INDEXER_ROW_BYTES


@dataclass(frozen=True)
class SGLangPoolInputs:
    """What the sizes depend on. ``layer_ratios``: this rank's main layers (MTP excluded).

    ``max_running_requests`` is per attention-DP worker. ``swa_cap_tokens`` (page-aligned)
    replaces ``swa_ratio`` sizing when given. ``draft_tokens`` only enters the online state.
    """
    layer_ratios: tuple[int, ...]
    sliding_window: int
    max_running_requests: int
    state_bytes: int = 4
    swa_ratio: float = 0.1
    swa_cap_tokens: int | None = None
    speculative: bool = False
    draft_tokens: int = 0
    online_compress: bool = False
    c4_shrink_factor: int = 1
    page: int = SGLANG_PAGE

    @property
    def num_layers(self) -> int:
        return len(self.layer_ratios)

    def count(self, ratio: int) -> int:
        return sum(1 for r in self.layer_ratios if r == ratio)


@dataclass(frozen=True)
class SGLangPoolSizes:
    """Token and slot counts in SGLang's ``MemoryPoolConfig`` field names."""
    full_max_total_num_tokens: int
    swa_max_total_num_tokens: int
    c4_max_total_num_tokens: int
    c128_max_total_num_tokens: int
    c4_state_pool_size: int
    c128_state_pool_size: int
    bytes_per_full_token: float
    fixed_bytes: int


class SGLangPoolSizing:
    """Per-token and fixed bytes of SGLang's DSV4 pools, and the sizes for a budget."""

    def __init__(self, inputs: SGLangPoolInputs) -> None:
        self.x = x = inputs
        if x.page % 128:
            raise PlanError(f"page size {x.page} must be a multiple of 128 for compressed attention")
        if x.c4_shrink_factor < 1:
            raise PlanError(f"c4_shrink_factor is {x.c4_shrink_factor}; it must be >= 1")
        if x.online_compress and x.speculative:
            raise PlanError("online C128 compression cannot be combined with speculative decoding")
        self.c4_ring = C4_RING_SPEC if x.speculative else C4_RING
        self.c128_ring = 1 if x.online_compress else (C128_RING_SPEC if x.speculative else C128_RING)
        self.spec_factor = (x.num_layers + 1) / x.num_layers if x.speculative else 1.0

    def kv_bytes_per_row(self, ratio: int) -> float:
        """Attention-pool bytes per row of a ratio-``ratio`` pool (0 = SWA), padding included."""
        rows = self.x.page // max(ratio, 1)
        return attention_page_bytes(rows) / rows

    def bytes_per_swa_token(self) -> float:
        x = self.x
        ring = self.c4_ring / x.page * (C4_STATE_WIDTH + C4_INDEXER_STATE_WIDTH) * x.state_bytes
        return (self.kv_bytes_per_row(0) * x.num_layers + ring * x.count(4)) * self.spec_factor

    def per_token_terms(self) -> dict[str, float]:
        """DSV4.md's six terms on this geometry, each times the speculative factor."""
        x = self.x
        swa_share = 0.0 if x.swa_cap_tokens is not None else x.swa_ratio
        ring = self.c4_ring / x.page * (C4_STATE_WIDTH + C4_INDEXER_STATE_WIDTH) * x.state_bytes
        raw = {
            "swa_kv": swa_share * self.kv_bytes_per_row(0) * x.num_layers,
            "c4_kv": self.kv_bytes_per_row(4) * x.count(4) / (4 * x.c4_shrink_factor),
            "c128_kv": self.kv_bytes_per_row(128) * x.count(128) / 128,
            "c4_indexer_k": INDEXER_ROW_BYTES * x.count(4) / 4,
            "c4_state_rings": swa_share * ring * x.count(4),
            "c128_state_ring": 0.0,
        }
        return {k: v * self.spec_factor for k, v in raw.items()}

    def bytes_per_full_token(self) -> float:
        return sum(self.per_token_terms().values())

    def num_req_slots(self) -> int:
        return self.x.max_running_requests + 1

    def fixed_bytes(self) -> int:
        """C128 state (request-scoped) plus, in cap mode, the capped SWA pool."""
        x = self.x
        fixed = 0
        if x.count(128):
            if x.online_compress:
                rows = (self.num_req_slots() + self.c128_ring + 1) * (1 + x.draft_tokens)
                width = ONLINE_STATE_SHAPE[0] * ONLINE_STATE_SHAPE[1]
            else:
                rows = self.num_req_slots() * self.c128_ring + self.c128_ring + 1
                rows = math.ceil(rows / 128) * 128
                width = C128_STATE_WIDTH
            fixed += rows * width * x.state_bytes * x.count(128)
        if x.swa_cap_tokens is not None:
            fixed += x.swa_cap_tokens * self.bytes_per_swa_token()
        return fixed

    def sizes_for_tokens(self, full: int) -> SGLangPoolSizes:
        x = self.x
        full = full // x.page * x.page
        if x.swa_cap_tokens is not None:
            swa = x.swa_cap_tokens
        else:
            swa = int(full * x.swa_ratio) // x.page * x.page
            if x.sliding_window + x.page >= swa:
                raise PlanError(f"SWA pool ({swa} tokens) cannot hold one request: it needs more than "
                                f"sliding_window ({x.sliding_window}) + page ({x.page}); raise the "
                                "budget or swa_full_tokens_ratio")
        return SGLangPoolSizes(
            full_max_total_num_tokens=full,
            swa_max_total_num_tokens=swa,
            c4_max_total_num_tokens=full // (4 * x.c4_shrink_factor),
            c128_max_total_num_tokens=full // 128,
            c4_state_pool_size=swa // x.page * self.c4_ring if x.count(4) else 0,
            c128_state_pool_size=self.num_req_slots() * self.c128_ring if x.count(128) else 0,
            bytes_per_full_token=self.bytes_per_full_token(),
            fixed_bytes=int(self.fixed_bytes()),
        )

    def sizes_for_budget(self, available_bytes: int) -> SGLangPoolSizes:
        """``full = floor_page((budget - fixed) / bytes_per_full_token)``, then the pools."""
        avail = max(int(available_bytes) - self.fixed_bytes(), 0)
        full = int(avail / self.bytes_per_full_token()) // self.x.page * self.x.page
        if full <= 0 and self.x.swa_cap_tokens is not None:
            raise PlanError(f"the SWA pool cap ({self.x.swa_cap_tokens} tokens) leaves no room for the full "
                            f"pool in {available_bytes / (1 << 30):.2f} GiB: lower max_running_requests "
                            "or raise the budget")
        return self.sizes_for_tokens(full)


assert attention_page_bytes(256) == 149_760 and attention_page_bytes(64) == 37_440
assert attention_page_bytes(2) == 1_728 and indexer_page_bytes(64) == 8_448
assert HEAD_DIM == 512
