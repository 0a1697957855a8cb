"""The physical pools: the only place in memory/ that holds KV bytes and compressor state.

Every pool is a dict ``{layer_id: tensor}`` keyed by the layer's index in the model. The
compressed kinds (every kind but ``swa_kv``) are allocated as one tensor per kind stacked over
their layers, ``stacked[kind]`` ``[num_layers, ...]`` in increasing layer order, and the dict holds
its per-layer views: a speculative step's rollback (dsv4_backend/rollback.py) reads and writes
one kind in all layers with one indexing kernel. A speculative plan adds one ``swa_kv`` tensor per MTP layer (window-only, the draft layer of
speculative decoding) at its model index ``num_hidden_layers + j``; other plans hold none.
Shapes come from :meth:`PoolPlan.pool_shapes`; each pool ends with
one dummy page / slot that padded writes may target (the ``dummy_*`` properties give its index):

    swa_kv[l]           uint8 [num_swa_pages + 1, 128 * 584]        every main layer (+ MTP if speculative)
    c4_kv[l]            uint8 [ceil(c4_rows / 64) + 1, 64 * 584]     CSA layers
    c4_indexer[l]       uint8 [ceil(c4_indexer_rows / 64) + 1, 64 * 132]
    c4_ring[l]          S     [c4_ring_slots + ring, 2048]           slot = [C (1024) | Z (1024)]
    c4_indexer_ring[l]  S     [c4_ring_slots + ring, 512]            slot = [C (256) | Z (256)]
    c128_kv[l]          uint8 [ceil(c128_rows / 64) + 1, 64 * 584]   HCA layers
    c128_ring[l]        S     [c128_ring_rows + ring, 1024]          slot = [C (512) | Z (512)]
    c128_online[l]      S     [online_state_slots + 1, 3, 512]       (max, sum, kv), online only

C and Z of a C4 slot keep the compressor's output channel order (the checkpoint's: the first
512 are the b-half, which serves the next block, the last 512 the a-half). The byte order
inside a KV or indexer page is memory/layout.py's. A dense plan has only ``swa_kv``, sized for
every token. S is the state dtype.

``page_align`` rounds the attention pools' page bytes (swa_kv, c4_kv, c128_kv) up to a multiple
of it: FlashMLA's kernels address a page in 576-byte TMA steps (``FLASHMLA_PAGE_ALIGN``), so its
backend needs pages of 65 x 576 B (64 rows) and 130 x 576 B (128 rows); the tail past the rows
and their scale groups is never read or written (memory/layout.py). Cost: 64 B of 37,376 and
128 B of 74,752 (0.17%), which the plan's byte accounting does not include.

HiSparse (``hisparse=HiSparseConfig(...)``, memory/hisparse.py): ``c4_kv`` is then the *host*
pool of every C4 row (``full / 4`` rows, pinned on CUDA), still addressed by ``full_slot // 4``,
and ``hisparse`` holds the device hot pool of the plan's ``c4_rows = full / (4 * shrink)`` rows
and the mapping. Without it (``hisparse`` None) a plan with ``c4_shrink_factor > 1`` is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from memory.configurator import COMPRESSED_PAGE, SWA_PAGE, PoolPlan
from memory.hisparse import HiSparseConfig, HiSparsePool

_KINDS = ("swa_kv", "c4_kv", "c4_indexer", "c4_ring", "c4_indexer_ring", "c128_kv", "c128_ring", "c128_online")
_KV_KINDS = ("swa_kv", "c4_kv", "c128_kv")
_LAYER_RATIO = {"swa_kv": None, "c4_kv": 4, "c4_indexer": 4, "c4_ring": 4, "c4_indexer_ring": 4,
                "c128_kv": 128, "c128_ring": 128, "c128_online": 128}


class DSV4KVPools:
    """Zero-initialised pool tensors for one plan.

    ``state_dtype`` overrides the plan's state dtype for the ring / online pools (the engine's
    exact float64 tests pass ``torch.float64``); KV pools are always uint8. ``page_align``: see
    the module docstring (1 = pages of exactly P * 584 bytes).
    """

    def __init__(self, model_config: Any, plan: PoolPlan, device: str | torch.device = "cpu",
                 state_dtype: torch.dtype | None = None, page_align: int = 1,
                 hisparse: HiSparseConfig | None = None) -> None:
        if page_align < 1:
            raise ValueError(f"page_align must be >= 1, got {page_align}")
        if plan.c4_shrink_factor != 1 and not plan.dense and hisparse is None:
            raise ValueError(f"c4_shrink_factor={plan.c4_shrink_factor:g} needs HiSparse: without it the device "
                             "C4 pool is addressed by full_slot // 4 and needs every row; pass "
                             "hisparse=HiSparseConfig(...) or plan with c4_shrink_factor=1")
        ratios = tuple(int(r) for r in model_config.compress_ratios[: model_config.num_hidden_layers])
        layers = {None: list(range(len(ratios))),
                  4: [i for i, r in enumerate(ratios) if r == 4],
                  128: [i for i, r in enumerate(ratios) if r == 128]}
        self.plan = plan
        self.page_align = page_align
        self.device = torch.device(device)
        self.state_dtype = plan.state_dtype if state_dtype is None else state_dtype
        shapes = plan.pool_shapes()
        # kind -> (tensor [num_layers, ...], its layer ids in order); the dict entries are its views
        self.stacked: dict[str, tuple[torch.Tensor, list[int]]] = {}
        for kind in _KINDS:
            pool: dict[int, torch.Tensor] = {}
            if kind in shapes:
                shape = shapes[kind]
                ids = layers[_LAYER_RATIO[kind]]
                if len(ids) != shape.num_layers:
                    raise ValueError(f"plan has {shape.num_layers} layers for pool {kind!r} but the model config "
                                     f"has {len(ids)}; build the plan from the same config")
                dtype = torch.uint8 if shape.dtype == torch.uint8 else self.state_dtype
                dims = shape.shape
                if kind in _KV_KINDS:
                    dims = (dims[0], -(-dims[1] // page_align) * page_align)
                if kind == "swa_kv":
                    pool = {i: torch.zeros(dims, dtype=dtype, device=self.device) for i in ids}
                else:
                    stack = torch.zeros((len(ids),) + tuple(dims), dtype=dtype, device=self.device)
                    self.stacked[kind] = (stack, list(ids))
                    pool = {i: stack[j] for j, i in enumerate(ids)}
                if kind == "swa_kv" and plan.speculative and not plan.dense:
                    # the MTP draft layers are window-only: an SWA pool each, at their model index
                    n_main, n_mtp = len(ratios), int(getattr(model_config, "num_nextn_predict_layers", 0))
                    pool.update({n_main + j: torch.zeros(dims, dtype=dtype, device=self.device)
                                 for j in range(n_mtp)})
            setattr(self, kind, pool)
        self.hisparse: HiSparsePool | None = None
        if hisparse is not None and self.c4_kv:
            page_bytes = next(iter(self.c4_kv.values())).shape[1]
            self.hisparse = HiSparsePool(self.c4_kv, plan.c4_indexer_rows, plan.c4_rows, plan.max_running_requests,
                                         hisparse, int(model_config.index_topk), page_bytes, self.device)
            self.c4_kv = self.hisparse.host   # every writer that addresses full rows writes the host copy
            self.stacked.pop("c4_kv", None)

    # ---- dummy targets for padded writes ---------------------------------------------

    @property
    def dummy_swa_slot(self) -> int:
        """First token slot of the dummy SWA page (``full_to_swa`` of the dummy full slot)."""
        return self.plan.num_swa_pages * SWA_PAGE

    @property
    def dummy_c4_row(self) -> int:
        rows = self.plan.c4_indexer_rows if self.hisparse is not None else self.plan.c4_rows
        return -(-rows // COMPRESSED_PAGE) * COMPRESSED_PAGE

    @property
    def dummy_c128_row(self) -> int:
        return -(-self.plan.c128_rows // COMPRESSED_PAGE) * COMPRESSED_PAGE

    @property
    def dummy_c4_ring_slot(self) -> int:
        return self.plan.c4_ring_slots

    @property
    def dummy_c128_ring_row(self) -> int:
        return self.plan.c128_ring_rows

    @property
    def dummy_online_slot(self) -> int:
        return self.plan.online_state_slots

    # ---- accounting ------------------------------------------------------------------

    def memory_usage(self) -> dict[str, int]:
        """Bytes held per pool kind, summed over layers (kinds this plan has no pool for omitted)."""
        usage = {}
        for kind in _KINDS:
            pool: dict[int, torch.Tensor] = getattr(self, kind)
            if pool:
                usage[kind] = sum(t.numel() * t.element_size() for t in pool.values())
        if self.hisparse is not None:
            usage["c4_kv"] = self.hisparse.device_bytes()    # hot pools and mapping
            usage["c4_kv_host"] = self.hisparse.host_bytes()
        return usage
