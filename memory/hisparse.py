"""HiSparse: every C4 (CSA) row in host memory, a small device hot pool, the top-k swapped in.

A CSA layer attends only the ``index_topk`` C4 rows its indexer selects per query, yet the C4
pool is the largest pool that grows with context. As in SGLang's HiSparse, the rows of every
request live in a host pool (pinned memory on CUDA) addressed by the usual *full row*
``full_slot // 4``; the device keeps a hot pool of ``c4_rows = full / (4 * host_to_device_ratio)``
rows per CSA layer with its own row allocator, and before each CSA attention the selected rows
that are not resident are copied host -> device in one batched transfer. The attention kernel
is then handed *device* rows. The indexer pool (which scores every row) stays on the device.

Per CSA layer the bookkeeping is four device tensors::

    full_to_dev  int32 [host rows]   device row holding full row f, -1 when not resident
    dev_to_full  int32 [D]           full row held by device row d, -1 when free
    owner        int32 [D]           request slot owning device row d, -1 when free
    last_used    int32 [D]           tick of d's last use (one tick per placement call)

(12 B per device row and 4 B per host row and layer: about 21 B per full token of Flash at
ratio 4, outside the plan's budget like its dummy pages.)

Placement (:meth:`HiSparsePool.swap_in` before attention, :meth:`HiSparsePool.write_rows` on
compression) takes the rows a call needs, keeps the resident ones (pinned for the call), and
finds device rows for the others in this order: rows its own request must give up to stay
within ``device_buffer_size`` (per-request LRU, oldest first), free rows, then the least
recently used unpinned rows of any request. A request holds at most
``max(device_buffer_size, rows its last call needed)`` rows per layer. New rows from
compression are written into the hot pool and copied to the host at once (offload), so the
host pool is always complete and eviction never loses a row. A call may need at most ``D``
rows; :meth:`HiSparsePool.groups` splits a query set (a long prefill chunk) into groups that
fit. ``release(slot)`` drops a request's rows when the allocator frees it.

On the CPU (the exact tests) host and device pools are both CPU tensors and run the same
mapping, eviction and copy logic. Config names and defaults are SGLang's ``--hisparse-config``:
``top_k`` 2048, ``device_buffer_size`` 2 x top_k, ``host_to_device_ratio`` 2.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from memory.configurator import COMPRESSED_PAGE
from memory.layout import KV_ROW_BYTES, read_row_bytes, write_row_bytes

DEFAULT_TOP_K = 2048
DEFAULT_HOST_TO_DEVICE_RATIO = 2.0
_NEVER = torch.iinfo(torch.int64).max


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


class HiSparsePool:
    """The host C4 pool, the device hot pool and the mapping between them, per CSA layer.

    ``host_rows``: full C4 rows (``max_full_tokens // 4``); ``device_rows``: D, the hot pool's
    allocatable rows; ``num_req_slots``: request slots (owners); ``top_k``: the rows one query
    selects (the model's ``index_topk``). ``page_bytes``: bytes per 64-row page (aligned).
    """

    def __init__(self, layers: Iterable[int], host_rows: int, device_rows: int, num_req_slots: int,
                 config: HiSparseConfig, top_k: int, page_bytes: int,
                 device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.layers = list(layers)
        self.rows = int(device_rows)
        self.buffer_size = int(config.device_buffer_size)
        self.top_k = int(top_k)
        self.num_req_slots = int(num_req_slots)
        if self.top_k > self.buffer_size:
            raise HiSparseConfigError(f"hisparse_config.device_buffer_size ({self.buffer_size}) must be no smaller "
                                      f"than the model's index_topk ({self.top_k})")
        if self.rows < self.top_k:
            raise HiSparseConfigError(
                f"the HiSparse device pool holds {self.rows} C4 rows per layer, fewer than the {self.top_k} one "
                f"query selects; lower hisparse_config.host_to_device_ratio "
                f"({config.host_to_device_ratio:g}) or raise the token budget")
        pin = self.device.type == "cuda"
        dev, D = self.device, self.rows
        self.host: dict[int, torch.Tensor] = {
            i: torch.zeros(_pages(host_rows), page_bytes, dtype=torch.uint8, pin_memory=pin) for i in self.layers}
        self.device_kv: dict[int, torch.Tensor] = {
            i: torch.zeros(_pages(D), page_bytes, dtype=torch.uint8, device=dev) for i in self.layers}
        host_cap = _pages(host_rows) * COMPRESSED_PAGE
        self.full_to_dev = {i: torch.full((host_cap,), -1, dtype=torch.int32, device=dev) for i in self.layers}
        self.dev_to_full = {i: torch.full((D,), -1, dtype=torch.int32, device=dev) for i in self.layers}
        self.owner = {i: torch.full((D,), -1, dtype=torch.int32, device=dev) for i in self.layers}
        self.last_used = {i: torch.zeros(D, dtype=torch.int32, device=dev) for i in self.layers}
        # per owner the most rows it may hold: max(device_buffer_size, its last call's need)
        self.cap = {i: torch.full((self.num_req_slots,), self.buffer_size, dtype=torch.int64, device=dev)
                    for i in self.layers}
        self._arange = torch.arange(D, device=dev)
        self.tick = 0
        self.swapped_rows = 0      # host -> device row copies
        self.hit_rows = 0          # selected rows found resident
        self.offloaded_rows = 0    # device -> host row copies of new rows
        self.time_fetch = False    # benchmarks: synchronise around each swap-in copy and add it up
        self.fetch_seconds = 0.0
        self._copy_stream = torch.cuda.Stream(dev) if pin else None
        self._staging: Optional[torch.Tensor] = None
        self._staging_done = torch.cuda.Event() if pin else None

    # ---- sizes -----------------------------------------------------------------------

    def host_bytes(self) -> int:
        return sum(t.numel() for t in self.host.values())

    def device_bytes(self) -> int:
        """Hot pools plus the mapping tensors."""
        return sum(t.numel() * t.element_size() for d in (self.device_kv, self.full_to_dev, self.dev_to_full,
                                                            self.owner, self.last_used, self.cap) for t in d.values())

    # ---- the swap-in -----------------------------------------------------------------

    def groups(self, sel: torch.Tensor) -> list[tuple[int, int]]:
        """Consecutive query ranges of ``sel [N, k]`` (full rows, -1 none) whose distinct rows
        each fit the hot pool (a range of one query always does: k <= D)."""
        def fits(lo: int, hi: int) -> bool:
            part = sel[lo:hi]
            return torch.unique(part[part >= 0]).numel() <= self.rows

        out, stack = [], [(0, int(sel.shape[0]))]
        while stack:
            lo, hi = stack.pop()
            if hi - lo <= 1 or (hi - lo) * sel.shape[1] <= self.rows or fits(lo, hi):
                out.append((lo, hi))
            else:
                mid = (lo + hi) // 2
                stack += [(mid, hi), (lo, mid)]
        return [g for g in out if g[1] > g[0]] or [(0, 0)]

    def swap_in(self, layer: int, sel: torch.Tensor, owners: torch.Tensor) -> torch.Tensor:
        """Make the rows of ``sel [N, k]`` (full C4 rows, -1 none) resident; ``owners [N]`` is
        each query's request slot. Returns the device rows, same shape and dtype (-1 kept).
        The distinct rows must fit the hot pool (see :meth:`groups`)."""
        flat = sel.reshape(-1).to(torch.int64)
        valid = flat >= 0
        own = owners.to(torch.int64)[:, None].expand(sel.shape).reshape(-1)
        rows, inv = torch.unique(flat[valid], return_inverse=True)
        row_owner = torch.empty_like(rows).scatter_(0, inv, own[valid])
        self._place(layer, rows, row_owner, fetch=True)
        dev = self.full_to_dev[layer][flat.clamp_min(0)].to(torch.int64)
        return torch.where(valid, dev, -1).view(sel.shape).to(sel.dtype)

    def read(self, layer: int, sel: torch.Tensor, owner: int,
             reader: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``reader(pool, rows)`` of the selected rows ``sel [N, k]`` of one request, read from
        the hot pool group by group (each group swapped in before it is read)."""
        owners = torch.full((sel.shape[0],), owner, dtype=torch.int64, device=sel.device)
        parts = [reader(self.device_kv[layer], self.swap_in(layer, sel[lo:hi], owners[lo:hi]))
                 for lo, hi in self.groups(sel)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def write_rows(self, layer: int, rows: torch.Tensor, owners: torch.Tensor,
                   writer: Callable[[torch.Tensor, torch.Tensor, slice], None]) -> None:
        """New rows of this step: ``rows [E]`` (distinct full rows), ``owners [E]`` their request
        slots; ``writer(pool, device_rows, part)`` stores the rows ``part`` of the batch at
        ``device_rows`` of ``pool``. They go to the hot pool (at most D per placement) and are
        copied to the host pool at once."""
        rows, owners = rows.to(torch.int64), owners.to(torch.int64)
        for e0 in range(0, rows.numel(), self.rows):
            part = slice(e0, min(rows.numel(), e0 + self.rows))
            dev = self._place(layer, rows[part], owners[part], fetch=False)
            writer(self.device_kv[layer], dev, part)
            self._offload(layer, rows[part], dev)

    # ---- placement -------------------------------------------------------------------

    def _place(self, layer: int, rows: torch.Tensor, owners: torch.Tensor, fetch: bool) -> torch.Tensor:
        """Device rows for the distinct full ``rows`` (owners given); see the module docstring."""
        n = rows.numel()
        if n > self.rows:
            raise ValueError(f"a HiSparse placement of {n} rows does not fit the {self.rows}-row hot pool; "
                             "split it with groups()")
        if n == 0:
            return rows
        f2d, d2f, own, used = self.full_to_dev[layer], self.dev_to_full[layer], self.owner[layer], self.last_used[layer]
        D, S = self.rows, self.num_req_slots
        self.tick += 1
        dev = f2d[rows].to(torch.int64)
        hit = dev >= 0
        miss = ~hit
        miss_rows, miss_owner = rows[miss], owners[miss]
        m = miss_rows.numel()
        need = torch.bincount(owners, minlength=S)
        cap = torch.where(need > 0, need.clamp_min(self.buffer_size), self.cap[layer])
        held = torch.bincount(own[own >= 0], minlength=S)
        excess = (held + torch.bincount(miss_owner, minlength=S) - cap).clamp_min(0)
        forced = None
        if bool((excess > 0).any()):
            pinned = torch.zeros(D, dtype=torch.bool, device=rows.device)
            pinned[dev[hit]] = True
            c = torch.nonzero((own >= 0) & ~pinned & (excess[own.clamp_min(0)] > 0)).flatten()
            c = c[torch.argsort(used[c].to(torch.int64) * D + c)]       # oldest first
            c = c[torch.argsort(own[c], stable=True)]                   # grouped by owner, oldest first in each
            o = own[c]
            rank = torch.arange(c.numel(), device=c.device) - torch.searchsorted(o, o)
            forced = c[rank < excess[o]]
        if m:
            key = torch.where(own < 0, self._arange - 2 * D, used.to(torch.int64) * D + self._arange)
            if forced is not None:
                key[forced] = forced - 3 * D
            key[dev[hit]] = _NEVER
            victims = torch.topk(key, m, largest=False).indices
            self._unmap(layer, victims if forced is None else torch.unique(torch.cat([victims, forced])))
            d2f[victims] = miss_rows.to(d2f.dtype)
            own[victims] = miss_owner.to(own.dtype)
            f2d[miss_rows] = victims.to(f2d.dtype)
            dev[miss] = victims
            if fetch:
                self._fetch(layer, miss_rows, victims)
                self.swapped_rows += m
        elif forced is not None:
            self._unmap(layer, forced)
        if fetch:
            self.hit_rows += n - m
        used[dev] = self.tick
        self.cap[layer].copy_(cap)     # in place: release() may run outside the forward's inference mode
        return dev

    def _unmap(self, layer: int, dev_rows: torch.Tensor) -> None:
        d2f = self.dev_to_full[layer]
        old = d2f[dev_rows]
        self.full_to_dev[layer][old[old >= 0]] = -1
        d2f[dev_rows] = -1
        self.owner[layer][dev_rows] = -1

    def release(self, req_slot: int) -> None:
        """Drop every device row of request slot ``req_slot`` (the allocator freed it)."""
        for layer in self.layers:
            mine = torch.nonzero(self.owner[layer] == req_slot).flatten()
            if mine.numel():
                self._unmap(layer, mine)
            self.cap[layer][req_slot] = self.buffer_size

    # ---- copies ----------------------------------------------------------------------

    def _fetch(self, layer: int, rows: torch.Tensor, dev_rows: torch.Tensor) -> None:
        """Host rows ``rows`` -> device rows ``dev_rows``: one gather, one transfer, one scatter."""
        if not self.time_fetch:
            return self._copy_in(layer, rows, dev_rows)
        if self._copy_stream is not None:
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        self._copy_in(layer, rows, dev_rows)
        if self._copy_stream is not None:
            torch.cuda.synchronize(self.device)
        self.fetch_seconds += time.perf_counter() - t0

    def _copy_in(self, layer: int, rows: torch.Tensor, dev_rows: torch.Tensor) -> None:
        data = read_row_bytes(self.host[layer], rows.cpu())
        if self._copy_stream is None:
            write_row_bytes(self.device_kv[layer], dev_rows, data)
            return
        n = data.shape[0]
        if self._staging is None or self._staging.shape[0] < n:
            self._staging_done.synchronize()
            size = max(n, self.top_k)
            self._staging = torch.empty(size, KV_ROW_BYTES, dtype=torch.uint8, pin_memory=True)
        self._staging_done.synchronize()          # the previous transfer has left the buffer
        self._staging[:n].copy_(data)
        main = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(main)       # dev_rows were computed on the main stream
        with torch.cuda.stream(self._copy_stream):
            buf = self._staging[:n].to(self.device, non_blocking=True)
            write_row_bytes(self.device_kv[layer], dev_rows, buf)
            self._staging_done.record(self._copy_stream)
        dev_rows.record_stream(self._copy_stream)
        main.wait_stream(self._copy_stream)

    def _offload(self, layer: int, rows: torch.Tensor, dev_rows: torch.Tensor) -> None:
        data = read_row_bytes(self.device_kv[layer], dev_rows)
        write_row_bytes(self.host[layer], rows.cpu(), data.cpu())
        self.offloaded_rows += rows.numel()

    # ---- invariants and accounting ---------------------------------------------------

    def check_integrity(self, live_slots: Optional[Iterable[int]] = None) -> None:
        """AssertionError unless, in every layer, ``full_to_dev`` and ``dev_to_full`` are inverse,
        a device row is owned iff it is used, no request holds more than its cap, owners are live
        (when ``live_slots`` is given), and every resident row's bytes equal its host copy."""
        live = None if live_slots is None else set(int(s) for s in live_slots)
        for layer in self.layers:
            f2d, d2f, own = self.full_to_dev[layer], self.dev_to_full[layer], self.owner[layer]
            used = d2f >= 0
            assert torch.equal(used, own >= 0), f"layer {layer}: device rows used and owned disagree"
            dev_used = torch.nonzero(used).flatten()
            mapped = torch.nonzero(f2d >= 0).flatten()
            assert mapped.numel() == dev_used.numel(), (
                f"layer {layer}: {mapped.numel()} full rows mapped, {dev_used.numel()} device rows used")
            assert torch.equal(d2f[f2d[mapped]].to(torch.int64), mapped), f"layer {layer}: full_to_dev is not inverse"
            assert torch.equal(f2d[d2f[dev_used]].to(torch.int64), dev_used), f"layer {layer}: dev_to_full is not inverse"
            held = torch.bincount(own[dev_used], minlength=self.num_req_slots)
            over = torch.nonzero(held > self.cap[layer]).flatten().tolist()
            assert not over, f"layer {layer}: request slots {over[:8]} hold more device rows than their cap"
            if live is not None:
                stray = set(own[dev_used].tolist()) - live
                assert not stray, f"layer {layer}: device rows owned by request slots no longer live: {sorted(stray)[:8]}"
            if dev_used.numel():
                on_dev = read_row_bytes(self.device_kv[layer], dev_used).cpu()
                on_host = read_row_bytes(self.host[layer], d2f[dev_used].to(torch.int64).cpu())
                bad = torch.nonzero((on_dev != on_host).any(dim=1)).flatten()
                assert bad.numel() == 0, (f"layer {layer}: device rows {dev_used[bad[:8]].tolist()} differ from "
                                          "their host copies")

    def stats(self) -> dict[str, int]:
        """Hot-pool occupancy (rows, summed over layers) and the copy counters."""
        resident = sum(int((d >= 0).sum()) for d in self.dev_to_full.values())
        return {"device_rows": self.rows * len(self.layers), "resident_rows": resident,
                "swapped_rows": self.swapped_rows, "hit_rows": self.hit_rows,
                "offloaded_rows": self.offloaded_rows}
