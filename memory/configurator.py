"""DSV4PoolConfigurator: how a KV budget is split across the DeepSeek-V4 pools.

SGLang sizes every DSV4 pool from one number, the bytes one *full token* costs across all
pools (DSV4.md section 5). With L main layers (MTP excluded), L_c4 CSA and L_c128 HCA layers,
state element size S (4 for fp32, 2 for bf16):

    swa_kv          = swa_ratio * 584 * L                     SWA rows, every layer
    c4_kv           = 584 * L_c4 / (4 * c4_shrink_factor)     C4 compressed rows
    c128_kv         = 584 * L_c128 / 128                      C128 compressed rows
    c4_indexer_k    = 132 * L_c4 / 4                          indexer rows
    c4_state_rings  = swa_ratio * (ring/128) * (2*2*512*S + 2*2*128*S) * L_c4
    c128_state_ring = 0                                       request-scoped, see fixed_bytes

    bytes_per_full_token = sum(terms) * ((L + 1) / L if speculative else 1)

The C128 state (ring or online) grows with requests, not tokens, so it is reserved first
(``fixed_bytes``) and the rest of the budget is divided by ``bytes_per_full_token``.

Reads the model config by duck typing only (``num_hidden_layers``, ``compress_ratios``,
``num_nextn_predict_layers``, ``sliding_window``): memory/ never imports dsv4_backend.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch

from memory import env
from memory.layout import INDEXER_ROW_BYTES, KV_ROW_BYTES

HEAD_DIM = 512
INDEX_HEAD_DIM = 128
SWA_PAGE = 128  # tokens per SWA page
FULL_PAGE = 256  # tokens per full page (SGLang's DSV4 page size)
COMPRESSED_PAGE = 64  # rows per page of the C4 / C128 / indexer pools
C4_RING, C4_RING_SPEC = 8, 16  # ring slots per SWA page
C128_RING, C128_RING_SPEC = 128, 256  # ring slots per request
C4_STATE_WIDTH = 2 * 2 * HEAD_DIM  # one slot: [C (coff*d = 1024) | Z (1024)]
C4_INDEXER_STATE_WIDTH = 2 * 2 * INDEX_HEAD_DIM  # [C (256) | Z (256)]
C128_STATE_WIDTH = 2 * HEAD_DIM  # [C (512) | Z (512)]
ONLINE_STATE_SHAPE = (3, HEAD_DIM)  # (max, sum, kv)

TERM_NAMES = ("swa_kv", "c4_kv", "c128_kv", "c4_indexer_k", "c4_state_rings", "c128_state_ring")
CONTEXT_128K = 128 * 1024
CONTEXT_1M = 1024 * 1024
GIB = float(1 << 30)


class PlanError(ValueError):
    """A pool plan that cannot work; the message names the setting to change."""


class PoolShape(NamedTuple):
    """One pool kind: ``num_layers`` tensors of ``shape`` and ``dtype`` (dummy rows included)."""

    num_layers: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * math.prod(self.shape) * elem


def _floor_to(x: float, m: int) -> int:
    return int(x // m) * m


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.3f} {unit}"
    return f"{n:.0f} B"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class PoolPlan:
    """Pool sizes for one model, budget and serving setting (all counts are totals per layer).

    Built by :class:`DSV4PoolConfigurator`; :meth:`pool_shapes` is the one place the tensor
    shapes of :class:`memory.pools.DSV4KVPools` are written down.
    """

    num_layers: int  # L, MTP excluded
    num_c4_layers: int
    num_c128_layers: int
    sliding_window: int
    bytes_per_full_token: float
    per_token_terms: dict[str, float]  # the six terms, already times speculative_factor
    speculative_factor: float  # (L+1)/L with speculative decoding, else 1
    fixed_bytes: int  # request-scoped C128 state, reserved before the per-token split
    budget_bytes: int  # the budget given, or fixed + max_full_tokens * bytes_per_full_token
    max_full_tokens: int
    swa_tokens: int
    num_swa_pages: int
    c4_rows: int  # on the device: max_full_tokens / (4 * c4_shrink_factor)
    c128_rows: int
    c4_indexer_rows: int
    c4_ring_size: int  # ring slots per SWA page (8, 16 speculative)
    c4_ring_slots: int  # num_swa_pages * c4_ring_size (also the indexer ring)
    c128_ring_size: int  # ring slots per request (128, 256 speculative; 1 online)
    c128_ring_rows: int  # max_running_requests * c128_ring_size; 0 when online
    online_state_slots: int  # max_running_requests when online, else 0
    state_dtype: torch.dtype
    online_compress: bool
    speculative: bool
    max_running_requests: int
    swa_ratio: float
    c4_shrink_factor: float
    dense: bool
    full_page: int = FULL_PAGE
    swa_page: int = SWA_PAGE
    # online + speculative: states kept per request for the rollback (the draft tokens; 0 else),
    # in slots after the dummy: online_state_slots + 1 + req_slot * online_history_size + j
    online_history_size: int = 0

    @property
    def num_full_pages(self) -> int:
        return self.max_full_tokens // self.full_page

    @property
    def min_swa_tokens(self) -> int:
        """One window plus one SWA page per running request."""
        return _ceil_to(self.max_running_requests * (self.sliding_window + self.swa_page), self.swa_page)

    def pool_shapes(self) -> dict[str, PoolShape]:
        """Per pool kind, the per-layer tensor shape with one dummy page / slot at the end."""
        sdt = self.state_dtype
        shapes = {"swa_kv": PoolShape(self.num_layers, (self.num_swa_pages + 1, SWA_PAGE * KV_ROW_BYTES),
                                      torch.uint8)}
        if self.dense:
            return shapes
        c4_pages = -(-self.c4_rows // COMPRESSED_PAGE) + 1
        idx_pages = -(-self.c4_indexer_rows // COMPRESSED_PAGE) + 1
        c128_pages = -(-self.c128_rows // COMPRESSED_PAGE) + 1
        ring_rows = self.c4_ring_slots + self.c4_ring_size
        if self.num_c4_layers:
            shapes["c4_kv"] = PoolShape(self.num_c4_layers, (c4_pages, COMPRESSED_PAGE * KV_ROW_BYTES), torch.uint8)
            shapes["c4_indexer"] = PoolShape(self.num_c4_layers, (idx_pages, COMPRESSED_PAGE * INDEXER_ROW_BYTES),
                                             torch.uint8)
            shapes["c4_ring"] = PoolShape(self.num_c4_layers, (ring_rows, C4_STATE_WIDTH), sdt)
            shapes["c4_indexer_ring"] = PoolShape(self.num_c4_layers, (ring_rows, C4_INDEXER_STATE_WIDTH), sdt)
        if self.num_c128_layers:
            shapes["c128_kv"] = PoolShape(self.num_c128_layers, (c128_pages, COMPRESSED_PAGE * KV_ROW_BYTES),
                                          torch.uint8)
            if self.online_compress:
                slots = self.online_state_slots * (1 + self.online_history_size) + 1
                shapes["c128_online"] = PoolShape(self.num_c128_layers, (slots, *ONLINE_STATE_SHAPE), sdt)
            else:
                shapes["c128_ring"] = PoolShape(self.num_c128_layers,
                                                (self.c128_ring_rows + self.c128_ring_size, C128_STATE_WIDTH), sdt)
        return shapes

    def pool_bytes(self) -> dict[str, int]:
        """Bytes each pool kind allocates over all its layers (dummy rows included)."""
        return {kind: s.bytes for kind, s in self.pool_shapes().items()}

    @property
    def hisparse(self) -> bool:
        """Whether only 1 / c4_shrink_factor of the C4 rows stay on the device (HiSparse)."""
        return self.c4_shrink_factor != 1 and not self.dense and self.num_c4_layers > 0

    def host_pool_shapes(self) -> dict[str, PoolShape]:
        """HiSparse's host pool: every C4 row (``full / 4``), one dummy page; empty otherwise."""
        if not self.hisparse:
            return {}
        pages = -(-self.c4_indexer_rows // COMPRESSED_PAGE) + 1
        return {"c4_kv": PoolShape(self.num_c4_layers, (pages, COMPRESSED_PAGE * KV_ROW_BYTES), torch.uint8)}

    @property
    def host_bytes(self) -> int:
        return sum(s.bytes for s in self.host_pool_shapes().values())

    @property
    def total_bytes(self) -> int:
        return sum(self.pool_bytes().values())

    def requests_fit(self, context_len: int) -> int:
        """How many requests of ``context_len`` tokens the full-token pools hold at once."""
        return self.max_full_tokens // _ceil_to(context_len, self.full_page)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, plus pool bytes and the 128K / 1M request counts."""
        d = asdict(self)
        d["state_dtype"] = _dtype_name(self.state_dtype)
        d["num_full_pages"] = self.num_full_pages
        d["pool_bytes"] = self.pool_bytes()
        d["total_bytes"] = self.total_bytes
        d["requests_fit"] = {"128K": self.requests_fit(CONTEXT_128K), "1M": self.requests_fit(CONTEXT_1M)}
        d["host_pool_bytes"] = {kind: s.bytes for kind, s in self.host_pool_shapes().items()}
        d["host_bytes"] = self.host_bytes
        return d

    def table(self) -> str:
        """The human-readable plan the server logs at start-up."""
        L, l4, l128 = self.num_layers, self.num_c4_layers, self.num_c128_layers
        s = torch.empty((), dtype=self.state_dtype).element_size()
        r = self.swa_ratio
        if self.dense:
            how = {"swa_kv": f"584 x {L} (dense: every token, every layer)"}
        else:
            ring = f"{r:g} x {self.c4_ring_size}/128 x (2048 + 512) x {s} x {l4}"
            how = {
                "swa_kv": f"{r:g} x 584 x {L}",
                "c4_kv": f"584 x {l4} / (4 x {self.c4_shrink_factor:g})",
                "c128_kv": f"584 x {l128} / 128",
                "c4_indexer_k": f"132 x {l4} / 4",
                "c4_state_rings": ring,
                "c128_state_ring": "per request, in fixed bytes",
            }
        spec = f" x (L+1)/L = {self.speculative_factor:.5f}" if self.speculative else ""
        mode = "dense per-token KV" if self.dense else ("online C128 state" if self.online_compress
                                                         else "C128 ring")
        lines = [
            f"DSV4 pool plan: {L} layers ({L - l4 - l128} SWA-only, {l4} CSA, {l128} HCA), "
            f"state {_dtype_name(self.state_dtype)}, {mode}, speculative {'on' if self.speculative else 'off'}, "
            f"max_running_requests {self.max_running_requests}",
            f"  {'per-token term':<16} {'bytes/full token':>16} {'share':>7}   arithmetic{spec}",
        ]
        total = self.bytes_per_full_token or 1.0
        for name in TERM_NAMES:
            v = self.per_token_terms.get(name, 0.0)
            lines.append(f"  {name:<16} {v:>16.2f} {100 * v / total:>6.1f}%   {how.get(name, '-')}")
        lines.append(f"  {'total':<16} {self.bytes_per_full_token:>16.2f}")
        if self.online_compress:
            fixed_how = f"online state: {self.online_state_slots} slots + dummy"
            if self.online_history_size:
                fixed_how += f" + {self.online_history_size} rollback states per request"
        else:
            fixed_how = f"C128 ring, {self.c128_ring_size} slots per request"
        lines += [
            f"  fixed bytes (request-scoped): {self.fixed_bytes:,} B = {_fmt_bytes(self.fixed_bytes)} ({fixed_how})",
            f"  budget: {self.budget_bytes:,} B = {_fmt_bytes(self.budget_bytes)}; the pools allocate "
            f"{_fmt_bytes(self.total_bytes)} (dummy pages and page padding are outside the budget, as in SGLang)",
            f"  max full tokens: {self.max_full_tokens:,} ({self.num_full_pages:,} pages of {self.full_page})",
            f"  SWA: {self.swa_tokens:,} tokens = {self.num_swa_pages:,} pages of {self.swa_page} "
            f"(minimum {self.min_swa_tokens:,})",
        ]
        if not self.dense:
            lines.append("  prefix cache: no bytes of its own; it holds finished prompts' full pages and one SWA page "
                         "(+ its ring slots) per restore point inside these pools, given back LRU on demand")
            hist = f" (+ {self.online_history_size} each for rollback)" if self.online_history_size else ""
            c128_state = (f"{self.online_state_slots:,} online slots{hist}" if self.online_compress
                          else f"{self.c128_ring_rows:,} ring rows")
            lines += [
                f"  C4 rows: {self.c4_rows:,}   C4 indexer rows: {self.c4_indexer_rows:,}   "
                f"C128 rows: {self.c128_rows:,}",
                f"  C4 ring slots: {self.c4_ring_slots:,} ({self.c4_ring_size} per SWA page)   "
                f"C128 state: {c128_state}",
            ]
        if self.hisparse:
            lines.append(f"  HiSparse: device C4 hot pool {self.c4_rows:,} rows per layer "
                         f"({_fmt_bytes(self.pool_bytes()['c4_kv'])}), host C4 pool {self.c4_indexer_rows:,} rows "
                         f"per layer ({_fmt_bytes(self.host_bytes)} pinned host memory)")
        lines.append(f"  requests that fit: {self.requests_fit(CONTEXT_128K):,} at 128K tokens, "
                     f"{self.requests_fit(CONTEXT_1M):,} at 1M tokens")
        return "\n".join(lines)


class DSV4PoolConfigurator:
    """Sizes the DSV4 pools from a model config and either a byte budget or a token count.

    ``state_dtype`` / ``online_compress`` default to the env flags (memory/env.py).
    ``c4_shrink_factor`` is HiSparse's host-to-device ratio: only 1/shrink of the C4 rows stay
    on the device. ``dense=True`` is the benchmarks' baseline: every layer keeps every token's
    584-byte row, no compressed pools, no rings. ``draft_tokens`` only matters for the online
    state: SGLang's ``(1 + draft tokens)`` factor in the reservation, and with speculative
    decoding the ``draft_tokens`` extra states per request that its rollback picks from
    (``dsv4_backend/online_history.py``).
    """

    def __init__(self, model_config: Any, *, max_running_requests: int = 256, swa_ratio: float = 0.1,
                 speculative: bool = False, draft_tokens: int = 0, c4_shrink_factor: float = 1.0,
                 state_dtype: torch.dtype | None = None, online_compress: bool | None = None,
                 full_page: int = FULL_PAGE, dense: bool = False) -> None:
        L = int(model_config.num_hidden_layers)
        ratios = tuple(int(x) for x in model_config.compress_ratios)
        n_mtp = int(getattr(model_config, "num_nextn_predict_layers", 0))
        if len(ratios) < L:
            raise PlanError(f"compress_ratios has {len(ratios)} entries for num_hidden_layers={L} "
                            f"(+{n_mtp} MTP); it needs one per layer")
        self.layer_ratios = ratios[:L]  # MTP layers excluded
        self.num_layers = L
        self.num_c4_layers = sum(1 for x in self.layer_ratios if x == 4)
        self.num_c128_layers = sum(1 for x in self.layer_ratios if x == 128)
        self.sliding_window = int(model_config.sliding_window)

        self.state_dtype = env.compress_state_dtype() if state_dtype is None else state_dtype
        self.online_compress = env.use_online_compress() if online_compress is None else bool(online_compress)
        self.max_running_requests = int(max_running_requests)
        self.swa_ratio = float(swa_ratio)
        self.speculative = bool(speculative)
        self.draft_tokens = int(draft_tokens)
        self.c4_shrink_factor = float(c4_shrink_factor)
        self.full_page = int(full_page)
        self.dense = bool(dense)
        self._validate()

        self.c4_ring_size = C4_RING_SPEC if self.speculative else C4_RING
        if self.online_compress:
            self.c128_ring_size = 1
        else:
            self.c128_ring_size = C128_RING_SPEC if self.speculative else C128_RING
        self.speculative_factor = (L + 1) / L if self.speculative else 1.0

    def _validate(self) -> None:
        if self.c4_shrink_factor < 1:
            raise PlanError(f"c4_shrink_factor (HiSparse host-to-device ratio) is {self.c4_shrink_factor:g}; "
                            "it must be >= 1 (use 1 to keep every C4 row on the device)")
        if self.online_compress and self.speculative and self.draft_tokens < 2:
            raise PlanError(f"speculative decoding with online C128 compression ({env.USE_ONLINE_COMPRESS}=1) keeps "
                            f"1 + draft_tokens states per request, but draft_tokens is {self.draft_tokens}; give "
                            "the verify's draft tokens (speculative_num_draft_tokens = speculative_num_steps + 1)")
        if self.max_running_requests < 1:
            raise PlanError(f"max_running_requests is {self.max_running_requests}; it must be >= 1")
        if not 0 < self.swa_ratio <= 1:
            raise PlanError(f"swa_ratio is {self.swa_ratio:g}; it must be in (0, 1] (SGLang's default is 0.1)")
        if self.full_page <= 0 or self.full_page % SWA_PAGE:
            raise PlanError(f"full_page is {self.full_page}; it must be a positive multiple of {SWA_PAGE} so that "
                            "full_slot // 128 is unique per block")
        if self.draft_tokens < 0:
            raise PlanError(f"draft_tokens is {self.draft_tokens}; it must be >= 0")
        if self.state_dtype not in (torch.float32, torch.bfloat16, torch.float64):
            raise PlanError(f"state_dtype {self.state_dtype} is not a compressor state dtype; "
                            "use torch.float32 or torch.bfloat16 (float64 for exact tests)")
        if self.num_layers < 1:
            raise PlanError("num_hidden_layers must be >= 1")

    # ---- the formula ---------------------------------------------------------------

    @property
    def state_bytes(self) -> int:
        """S: bytes per compressor state element."""
        return torch.empty((), dtype=self.state_dtype).element_size()

    def per_token_terms(self) -> dict[str, float]:
        """The six terms of DSV4.md section 5, each already times the speculative factor."""
        L, l4, l128, r = self.num_layers, self.num_c4_layers, self.num_c128_layers, self.swa_ratio
        if self.dense:
            raw = dict.fromkeys(TERM_NAMES, 0.0)
            raw["swa_kv"] = float(KV_ROW_BYTES * L)
        else:
            S = self.state_bytes
            ring_per_swa_token = self.c4_ring_size / SWA_PAGE
            raw = {
                "swa_kv": r * KV_ROW_BYTES * L,
                "c4_kv": KV_ROW_BYTES * l4 / (4 * self.c4_shrink_factor),
                "c128_kv": KV_ROW_BYTES * l128 / 128,
                "c4_indexer_k": INDEXER_ROW_BYTES * l4 / 4,
                "c4_state_rings": r * ring_per_swa_token * (C4_STATE_WIDTH + C4_INDEXER_STATE_WIDTH) * S * l4,
                "c128_state_ring": 0.0,
            }
        return {k: v * self.speculative_factor for k, v in raw.items()}

    def bytes_per_full_token(self) -> float:
        return sum(self.per_token_terms().values())

    def _bytes_per_swa_token(self) -> float:
        """What one SWA token costs (its rows in every layer plus its C4 ring share)."""
        if self.dense:
            return 0.0
        ring = self.c4_ring_size / SWA_PAGE * (C4_STATE_WIDTH + C4_INDEXER_STATE_WIDTH) * self.state_bytes
        return (KV_ROW_BYTES * self.num_layers + ring * self.num_c4_layers) * self.speculative_factor

    def fixed_bytes(self) -> int:
        """Request-scoped C128 state reserved before the per-token split, as SGLang sizes it.

        Ring: SGLang's state pool has ``R + 1`` request slots of ``ring`` rows plus ``ring + 1``
        rows of padding, rounded up to 128 rows: ``ceil128((R + 1) * ring + ring + 1)`` rows of
        ``2 * 512 * S`` bytes per HCA layer, ring = 128 (256 with speculative decoding: the
        same formula with the doubled ring, i.e. ``ceil128((R + 1) * 256 + 257)`` rows).
        Online: ``(R + 1) + 1 + 1 = R + 3`` slots, times ``1 + draft_tokens``, of
        ``3 * 512 * S`` bytes per HCA layer. Dense plans and models without HCA layers reserve 0.
        """
        if self.dense or self.num_c128_layers == 0:
            return 0
        R, S = self.max_running_requests, self.state_bytes
        if self.online_compress:
            rows = (R + 3) * (1 + self.draft_tokens)
            width = ONLINE_STATE_SHAPE[0] * ONLINE_STATE_SHAPE[1]
        else:
            rows = _ceil_to((R + 1) * self.c128_ring_size + self.c128_ring_size + 1, 128)
            width = C128_STATE_WIDTH
        return rows * width * S * self.num_c128_layers

    # ---- plans ---------------------------------------------------------------------

    def _min_swa_tokens(self) -> int:
        return _ceil_to(self.max_running_requests * (self.sliding_window + SWA_PAGE), SWA_PAGE)

    def _min_full_tokens(self) -> int:
        return max(self.full_page, _ceil_to(self._min_swa_tokens(), self.full_page))

    def plan_for_budget(self, budget_bytes: int) -> PoolPlan:
        """Pools for a KV budget in bytes: reserve fixed_bytes, divide the rest per full token.

        ``max_full_tokens = floor_256((budget - fixed) / bytes_per_full_token)``. If
        ``swa_ratio`` would give fewer than one window plus a page of SWA tokens per request,
        the SWA pool is raised to that minimum and paid for out of the full tokens.
        """
        budget_bytes = int(budget_bytes)
        fixed = self.fixed_bytes()
        bpft = self.bytes_per_full_token()
        avail = budget_bytes - fixed
        full = _floor_to(max(avail, 0) / bpft, self.full_page)
        min_swa = self._min_swa_tokens()
        if not self.dense and _floor_to(full * self.swa_ratio, SWA_PAGE) < min_swa:
            # Hold SWA at its minimum and give the rest to the tokens' other pools.
            swa_cost = self._bytes_per_swa_token()
            rest = bpft - self.swa_ratio * swa_cost
            full = _floor_to(max(avail - min_swa * swa_cost, 0) / rest, self.full_page)
        if full < self._min_full_tokens():
            need = fixed + self._bytes_for(self._min_full_tokens())
            raise PlanError(
                f"KV budget {budget_bytes / GIB:.3f} GiB is too small: max_running_requests="
                f"{self.max_running_requests} needs one window ({self.sliding_window}) plus one SWA page "
                f"({SWA_PAGE}) per request = {min_swa:,} tokens, about {need / GIB:.3f} GiB including "
                f"{fixed / GIB:.3f} GiB of fixed C128 state. Raise the budget (--budget-gb, or --gpu-mem-gb / "
                f"--mem-fraction) or lower --max-running-requests")
        return self._plan(full, budget_bytes)

    def plan_for_tokens(self, max_total_tokens: int) -> PoolPlan:
        """Pools for ``max_total_tokens`` full tokens (floored to a page); bytes are derived."""
        full = _floor_to(int(max_total_tokens), self.full_page)
        if full < self._min_full_tokens():
            raise PlanError(
                f"max_total_tokens={max_total_tokens} is too small: max_running_requests="
                f"{self.max_running_requests} needs one window ({self.sliding_window}) plus one SWA page "
                f"({SWA_PAGE}) per request, at least {self._min_full_tokens():,} tokens. Raise "
                f"max_total_tokens or lower max_running_requests")
        return self._plan(full, self.fixed_bytes() + math.ceil(self._bytes_for(full)))

    def _bytes_for(self, full: int) -> float:
        """Per-token pool bytes of ``full`` tokens, SWA raised to its minimum where needed."""
        extra_swa = max(0.0, self._swa_tokens(full) - full * self.swa_ratio) if not self.dense else 0.0
        return full * self.bytes_per_full_token() + extra_swa * self._bytes_per_swa_token()

    def _swa_tokens(self, full: int) -> int:
        if self.dense:
            return full
        return max(_floor_to(full * self.swa_ratio, SWA_PAGE), self._min_swa_tokens())

    def _plan(self, full: int, budget_bytes: int) -> PoolPlan:
        R = self.max_running_requests
        swa = self._swa_tokens(full)
        pages = swa // SWA_PAGE
        compressed = not self.dense
        c4_layers = self.num_c4_layers if compressed else 0
        c128_layers = self.num_c128_layers if compressed else 0
        ring = compressed and not self.online_compress
        return PoolPlan(
            num_layers=self.num_layers,
            num_c4_layers=c4_layers,
            num_c128_layers=c128_layers,
            sliding_window=self.sliding_window,
            bytes_per_full_token=self.bytes_per_full_token(),
            per_token_terms=self.per_token_terms(),
            speculative_factor=self.speculative_factor,
            fixed_bytes=self.fixed_bytes(),
            budget_bytes=budget_bytes,
            max_full_tokens=full,
            swa_tokens=swa,
            num_swa_pages=pages,
            c4_rows=int(full // (4 * self.c4_shrink_factor)) if c4_layers else 0,
            c128_rows=full // 128 if c128_layers else 0,
            c4_indexer_rows=full // 4 if c4_layers else 0,
            c4_ring_size=self.c4_ring_size if compressed else 0,
            c4_ring_slots=pages * self.c4_ring_size if c4_layers else 0,
            c128_ring_size=self.c128_ring_size if compressed else 0,
            c128_ring_rows=R * self.c128_ring_size if ring and c128_layers else 0,
            online_state_slots=R if compressed and self.online_compress and c128_layers else 0,
            online_history_size=self.draft_tokens if compressed and self.online_compress and self.speculative
            and c128_layers else 0,
            state_dtype=self.state_dtype,
            online_compress=self.online_compress,
            speculative=self.speculative,
            max_running_requests=R,
            swa_ratio=self.swa_ratio,
            c4_shrink_factor=self.c4_shrink_factor,
            dense=self.dense,
            full_page=self.full_page,
        )
