"""HiSparse: every C4 (CSA) row in host memory, a small device hot pool, the top-k swapped in.

A CSA layer attends only the ``index_topk`` C4 rows its indexer selects per query, yet the C4
pool is the largest pool that grows with context. As in SGLang's HiSparse, the rows of every
request live in a host pool (pinned memory on CUDA) addressed by the usual *full row*
``full_slot // 4``; the device keeps a hot pool of ``D = c4_rows = full / (4 * host_to_device_ratio)``
rows per CSA layer, and before each CSA attention the selected rows that are not resident are
copied host -> device. The attention kernel is then handed *device* rows. The indexer pool
(which scores every row) stays on the device.

The hot pool of a layer is split in two::

    rows [0, S * B)        request buffers: request slot s owns rows s * B .. s * B + B - 1
                           (B = device_buffer_size, S = request slots), a per-request LRU cache
    rows [S * B, D)        staging: this step's new rows on their way to the host, and the
                           rows of a prefill block (read once, not cached)

with two device tensors per layer for the buffers, ``table`` (int64 [S * B + 1], the full row
held by each buffer row, -1 empty; the last entry is a write sink) and ``last_used`` (int64, the
tick of the row's last use), and one device tick counter.

Everything is decided on the device, with fixed shapes (the step's ``[T, k]`` selection), so a
decode step is captured by a CUDA graph:

- decode (:meth:`HiSparsePool.swap_in`, every query row its own request): each request's
  buffer row list is sorted and the selected rows looked up in it (``searchsorted``); the hits
  are pinned for the step, and the misses take, in order, the request's empty buffer rows and
  then its least recently used unpinned ones (ranks from a ``cumsum`` over the misses, victims
  from an ``argsort`` of the buffer's keys). ``B >= k`` guarantees enough unpinned rows, so a
  row selected in this step is never evicted by it. The misses are copied from the host pool by
  a gather kernel that reads pinned memory through its mapped address
  (``dsv4_backend/kernels/row_copy.py``);
- prefill and mixed steps (:meth:`HiSparsePool.stage`, in blocks of queries whose ``n * k``
  selections fit the staging rows, :meth:`HiSparsePool.blocks`): the block's selections are
  sorted, each distinct row copied once into staging, and every query handed its row's staged
  index;
- new rows (:meth:`HiSparsePool.write_rows`): written into staging (by the caller's writer:
  ``write_kv_rows`` or the compress kernel) and copied to the host pool at once (offload), so
  the host pool is always complete and eviction is only an overwrite;
- ``release(slot)`` empties a request's buffer when the allocator frees it.

On the CPU (the exact tests) host and device pools are both CPU tensors and run the same
lookup, eviction and copy logic (the copy is a torch gather / scatter there, the kernel on
the Triton backend). Config names and defaults are SGLang's ``--hisparse-config``: ``top_k``
2048, ``device_buffer_size`` 2 x top_k, ``host_to_device_ratio`` 2.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from memory.configurator import COMPRESSED_PAGE
from memory.layout import read_row_bytes, write_row_bytes

DEFAULT_TOP_K = 2048
DEFAULT_HOST_TO_DEVICE_RATIO = 2.0
_NEVER = torch.iinfo(torch.int64).max
_SWAPPED, _HITS, _EVICTED, _STAGED, _OFFLOADED = range(5)   # HiSparsePool.counts


class HiSparseConfigError(ValueError):
    """A ``--hisparse-config`` that cannot work; the message names the field."""


@dataclass(frozen=True)
class HiSparseConfig:
    """SGLang's ``--hisparse-config`` fields. ``device_buffer_size`` 0 means 2 x ``top_k``.

    ``top_k`` sizes the default buffer; the rows a query selects are the model's
    ``index_topk`` (as SGLang takes the model's top-k), which must fit ``device_buffer_size``.
    ``host_to_device_ratio`` is the plan's ``c4_shrink_factor``."""

    top_k: int = DEFAULT_TOP_K
    device_buffer_size: int = 0
    host_to_device_ratio: float = DEFAULT_HOST_TO_DEVICE_RATIO

    def __post_init__(self) -> None:
        for name in ("top_k", "device_buffer_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise HiSparseConfigError(f"hisparse_config.{name} must be an integer, got {v!r}")
        r = self.host_to_device_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)):
            raise HiSparseConfigError(f"hisparse_config.host_to_device_ratio must be a number, got {r!r}")
        if self.top_k < 1:
            raise HiSparseConfigError(f"hisparse_config.top_k must be >= 1, got {self.top_k}")
        if self.device_buffer_size == 0:
            object.__setattr__(self, "device_buffer_size", 2 * self.top_k)
        if self.device_buffer_size < self.top_k:
            raise HiSparseConfigError(f"hisparse_config.device_buffer_size ({self.device_buffer_size}) must be "
                                      f"no smaller than top_k ({self.top_k})")
        if not r >= 1:
            raise HiSparseConfigError(f"hisparse_config.host_to_device_ratio must be >= 1 (1 keeps every C4 row on "
                                      f"the device), got {r!r}")
        object.__setattr__(self, "host_to_device_ratio", float(r))

    @classmethod
    def parse(cls, value: Any) -> "HiSparseConfig":
        """From None (the defaults), a dict, a JSON object string or a HiSparseConfig."""
        if isinstance(value, cls):
            return value
        if value is None or value == "":
            return cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise HiSparseConfigError(f"hisparse_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise HiSparseConfigError(f"hisparse_config must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - {"top_k", "device_buffer_size", "host_to_device_ratio"})
        if unknown:
            raise HiSparseConfigError(f"hisparse_config has unknown field(s) {unknown}; known: top_k, "
                                      "device_buffer_size, host_to_device_ratio")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pages(rows: int) -> int:
    """Pages of a row pool of ``rows`` rows, plus the dummy page."""
    return -(-rows // COMPRESSED_PAGE) + 1



CopyRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def copy_rows_torch(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """Row ``src_rows[i]`` of attention pool ``src`` -> row ``dst_rows[i]`` of ``dst`` where
    ``dst_rows[i] >= 0``: the torch form of ``dsv4_backend.kernels.copy_rows`` (same bytes)."""
    keep = dst_rows >= 0
    if src.device != dst.device:      # the torch backend on a GPU: host-side indices (syncs)
        keep = keep.cpu()
    data = read_row_bytes(src, src_rows.reshape(-1).to(src.device, torch.int64)[keep.to(src.device)])
    write_row_bytes(dst, dst_rows.reshape(-1).to(dst.device, torch.int64)[keep.to(dst.device)], data.to(dst.device))


class HiSparsePool:
    """The host C4 pool, the device hot pool (request buffers and staging) and the buffer
    tables, per CSA layer.

    ``host_rows``: full C4 rows (``max_full_tokens // 4``); ``device_rows``: D, the hot pool's
    rows; ``num_req_slots``: S, request slots; ``top_k``: the rows one query selects (the
    model's ``index_topk``). ``page_bytes``: bytes per 64-row page (aligned). ``copy_rows`` moves
    rows between pools (:func:`copy_rows_torch`; the Triton backend installs its kernel).
    """

    def __init__(self, layers: Iterable[int], host_rows: int, device_rows: int, num_req_slots: int,
                 config: HiSparseConfig, top_k: int, page_bytes: int,
                 device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.layers = list(layers)
        self.rows = int(device_rows)
        self.buffer_size = B = int(config.device_buffer_size)
        self.top_k = int(top_k)
        self.num_req_slots = S = int(num_req_slots)
        if self.top_k > B:
            raise HiSparseConfigError(f"hisparse_config.device_buffer_size ({B}) must be no smaller "
                                      f"than the model's index_topk ({self.top_k})")
        self.staging_base = S * B
        self.staging_rows = self.rows - S * B
        if self.staging_rows < self.top_k:
            raise HiSparseConfigError(
                f"the HiSparse device pool holds {self.rows} C4 rows per layer, fewer than the {S * B + self.top_k} "
                f"its {S} request buffers of hisparse_config.device_buffer_size {B} and {self.top_k} staging rows "
                f"(index_topk) need; lower hisparse_config.host_to_device_ratio ({config.host_to_device_ratio:g}) "
                f"or device_buffer_size, or raise the token budget")
        pin = self.device.type == "cuda"
        dev = self.device
        self.host: dict[int, torch.Tensor] = {
            i: torch.zeros(_pages(host_rows), page_bytes, dtype=torch.uint8, pin_memory=pin) for i in self.layers}
        self.device_kv: dict[int, torch.Tensor] = {
            i: torch.zeros(_pages(self.rows), page_bytes, dtype=torch.uint8, device=dev) for i in self.layers}
        self.table = {i: torch.full((S * B + 1,), -1, dtype=torch.int64, device=dev) for i in self.layers}
        self.last_used = {i: torch.zeros(S * B + 1, dtype=torch.int64, device=dev) for i in self.layers}
        self.tick = torch.zeros((), dtype=torch.int64, device=dev)
        self.counts = torch.zeros(5, dtype=torch.int64, device=dev)   # swapped, hits, evicted, staged, offloaded
        self._cols = torch.arange(B, device=dev)
        self.copy_rows: CopyRows = copy_rows_torch
        # the decode lookup in one kernel (dsv4_backend/kernels/hisparse_table.py; the Triton
        # backend installs it), else the torch ops below
        self.lookup: Optional[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = None

    # ---- sizes and counters -------------------------------------------------------------

    def host_bytes(self) -> int:
        return sum(t.numel() for t in self.host.values())

    def device_bytes(self) -> int:
        """Hot pools plus the buffer tables."""
        return sum(t.numel() * t.element_size() for d in (self.device_kv, self.table, self.last_used)
                   for t in d.values())

    @property
    def swapped_rows(self) -> int:
        """Rows copied host -> device into request buffers (decode misses)."""
        return int(self.counts[_SWAPPED])

    @property
    def staged_rows(self) -> int:
        """Rows copied host -> device into staging (prefill blocks)."""
        return int(self.counts[_STAGED])

    @property
    def hit_rows(self) -> int:
        return int(self.counts[_HITS])

    @property
    def evicted_rows(self) -> int:
        return int(self.counts[_EVICTED])

    @property
    def offloaded_rows(self) -> int:
        return int(self.counts[_OFFLOADED])

    # ---- the swap-in -----------------------------------------------------------------

    def swap_in(self, layer: int, sel: torch.Tensor, owners: torch.Tensor) -> torch.Tensor:
        """Decode: make the rows of ``sel [T, k]`` (full C4 rows, -1 none; a query's rows distinct)
        resident in the buffers of ``owners [T]`` (request slots, each at most once; -1: a
        padded row, skipped). Returns the device rows, same shape and dtype (-1 kept)."""
        if self.lookup is not None:      # the same decisions in one kernel
            dest, copy_dst = self.lookup(self.table[layer], self.last_used[layer], sel, owners, self.tick,
                                         self.counts, self.buffer_size)
            # the row-copy kernel clamps a -1 source itself, and reads int32 or int64 rows
            self.copy_rows(self.host[layer], sel.reshape(-1), self.device_kv[layer], copy_dst.reshape(-1))
            return dest.to(sel.dtype)
        B, cols = self.buffer_size, self._cols
        table, used = self.table[layer], self.last_used[layer]
        rows = sel.to(torch.int64)
        owners = owners.to(torch.int64)
        base = owners.clamp_min(0)[:, None] * B                              # [T, 1]
        valid = (rows >= 0) & (owners >= 0)[:, None]                         # [T, k]
        held = table[base + cols]                                            # [T, B]
        ordered, order = torch.where(held >= 0, held, _NEVER).sort(dim=1)
        at = torch.searchsorted(ordered, rows).clamp_max(B - 1)
        hit = valid & (ordered.gather(1, at) == rows)
        slot = order.gather(1, at)
        miss = valid & ~hit
        pinned = torch.zeros(rows.shape[0], B + 1, dtype=torch.bool, device=rows.device)
        pinned.scatter_(1, torch.where(hit, slot, B), True)
        # victims: empty rows first (in order), then the least recently used; never a pinned one
        key = torch.where(held < 0, cols - B, used[base + cols] * B + cols)
        key = torch.where(pinned[:, :B], _NEVER, key)
        victims = key.argsort(dim=1)
        victim = victims.gather(1, (miss.cumsum(1) - 1).clamp(0, B - 1))
        dest = base + torch.where(hit, slot, victim)                         # [T, k] device rows
        sink = table.numel() - 1
        taken = torch.where(miss, dest, sink).reshape(-1)        # the sink takes every non-miss write
        self.counts[_EVICTED] += (table[taken] >= 0).sum()        # the sink is empty between calls
        self.tick += 1
        table.scatter_(0, taken, rows.reshape(-1))
        used.scatter_(0, torch.where(valid, dest, sink).reshape(-1), self.tick.expand(rows.numel()))
        table.narrow(0, sink, 1).fill_(-1)    # a kernel: an indexed scalar store is a host copy, which no graph can hold
        self.copy_rows(self.host[layer], rows.clamp_min(0).reshape(-1), self.device_kv[layer],
                       torch.where(miss, dest, -1).reshape(-1))
        self.counts[_SWAPPED] += miss.sum()
        self.counts[_HITS] += hit.sum()
        return torch.where(valid, dest, -1).to(sel.dtype)

    def blocks(self, n: int, k: int) -> list[tuple[int, int]]:
        """Consecutive query ranges of ``n`` queries of ``k`` rows whose selections fit staging."""
        step = max(1, self.staging_rows // max(k, 1))
        return [(lo, min(n, lo + step)) for lo in range(0, n, step)] or [(0, 0)]

    def stage(self, layer: int, sel: torch.Tensor) -> torch.Tensor:
        """Prefill: copy each distinct row of ``sel [n, k]`` (full C4 rows, -1 none; ``n * k`` at
        most the staging rows, see :meth:`blocks`) into staging once. Returns the device rows."""
        flat = sel.reshape(-1).to(torch.int64)
        if flat.numel() > self.staging_rows:
            raise ValueError(f"a HiSparse staging block of {flat.numel()} rows exceeds the {self.staging_rows} "
                             "staging rows; split it with blocks()")
        valid = flat >= 0
        ordered, order = torch.where(valid, flat, _NEVER).sort()
        prev = torch.cat([ordered.new_full((1,), -2), ordered[:-1]])
        first = (ordered != prev) & (ordered != _NEVER)
        dest = self.staging_base + (first.cumsum(0) - 1).clamp_min(0)
        self.copy_rows(self.host[layer], torch.where(first, ordered, 0), self.device_kv[layer],
                       torch.where(first, dest, -1))
        self.counts[_STAGED] += first.sum()
        out = torch.empty_like(flat).scatter_(0, order, dest)
        return torch.where(valid, out, -1).view(sel.shape).to(sel.dtype)

    def read(self, layer: int, sel: torch.Tensor, owner: int,
             reader: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``reader(pool, rows)`` of the selected rows ``sel [N, k]`` of one request (the torch
        backend): one query through its request buffer, several block by block through staging."""
        if sel.shape[0] == 1:
            owners = torch.full((1,), owner, dtype=torch.int64, device=sel.device)
            return reader(self.device_kv[layer], self.swap_in(layer, sel, owners))
        parts = [reader(self.device_kv[layer], self.stage(layer, sel[lo:hi]))
                 for lo, hi in self.blocks(sel.shape[0], sel.shape[1])]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def write_rows(self, layer: int, rows: torch.Tensor,
                   writer: Callable[[torch.Tensor, torch.Tensor, slice], None]) -> None:
        """New rows of this step: ``rows [E]`` (distinct full rows; < 0: a masked event);
        ``writer(pool, device_rows, part)`` stores the rows ``part`` of the batch at
        ``device_rows`` of ``pool``. They go to staging and are copied to the host pool at once."""
        rows = rows.to(torch.int64)
        n, step = rows.numel(), self.staging_rows
        for e0 in range(0, n, step):
            part = slice(e0, min(n, e0 + step))
            full = rows[part]
            dev = torch.where(full >= 0, self.staging_base + torch.arange(full.numel(), device=full.device), -1)
            writer(self.device_kv[layer], dev, part)
            self.copy_rows(self.device_kv[layer], dev, self.host[layer], full)
            self.counts[_OFFLOADED] += (full >= 0).sum()

    def release(self, req_slot: int) -> None:
        """Empty the buffer of request slot ``req_slot`` (the allocator freed it)."""
        B = self.buffer_size
        for layer in self.layers:
            self.table[layer][req_slot * B:(req_slot + 1) * B] = -1
            self.last_used[layer][req_slot * B:(req_slot + 1) * B] = 0

    # ---- invariants and accounting ---------------------------------------------------

    def check_integrity(self, live_slots: Optional[Iterable[int]] = None) -> None:
        """AssertionError unless, in every layer, no request buffer holds a full row twice, the
        buffers of request slots not in ``live_slots`` (when given) are empty, and every buffered
        row's bytes equal its host copy."""
        live = None if live_slots is None else set(int(s) for s in live_slots)
        S, B = self.num_req_slots, self.buffer_size
        for layer in self.layers:
            table = self.table[layer][:S * B].view(S, B)
            assert int(self.table[layer][-1]) == -1, f"layer {layer}: the write sink holds a row"
            ordered = table.sort(dim=1).values
            dup = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(dim=1)
            assert not bool(dup.any()), (f"layer {layer}: request slots {torch.nonzero(dup).flatten().tolist()[:8]} "
                                         "hold a full row twice")
            if live is not None:
                stray = sorted(set(torch.nonzero((table >= 0).any(dim=1)).flatten().tolist()) - live)
                assert not stray, f"layer {layer}: device rows owned by request slots no longer live: {stray[:8]}"
            dev = torch.nonzero(table.reshape(-1) >= 0).flatten()
            if dev.numel():
                on_dev = read_row_bytes(self.device_kv[layer], dev).cpu()
                on_host = read_row_bytes(self.host[layer], table.reshape(-1)[dev].cpu())
                bad = torch.nonzero((on_dev != on_host).any(dim=1)).flatten()
                assert bad.numel() == 0, (f"layer {layer}: device rows {dev[bad[:8]].tolist()} differ from "
                                          "their host copies")

    def stats(self) -> dict[str, int]:
        """Buffer occupancy (rows, summed over layers) and the copy counters."""
        S, B = self.num_req_slots, self.buffer_size
        resident = sum(int((t[:S * B] >= 0).sum()) for t in self.table.values())
        c = self.counts.tolist()
        return {"device_rows": self.rows * len(self.layers), "buffer_rows": S * B * len(self.layers),
                "resident_rows": resident, "swapped_rows": c[_SWAPPED], "hit_rows": c[_HITS],
                "evicted_rows": c[_EVICTED], "staged_rows": c[_STAGED], "offloaded_rows": c[_OFFLOADED]}
