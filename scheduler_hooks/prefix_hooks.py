"""When the prefix cache (``memory/prefix_cache.py``) is read, filled and evicted, per request.

- admission: the longest cached restore point within the ids that may come from the cache is
  taken over (the request starts there); the request then gets *checkpoint targets*: the
  full-page boundary where its ids leave the cached tree (where a later request with the same
  prefix diverges) and the last full-page boundary of its ids.
- after a step, before the window eviction: at every target the step crossed, and at its end if
  that is a full-page boundary (a decode crossing one, a chunk ending on one), the request
  becomes a restore point: its pages up to the boundary and the window's SWA pages are inserted.
  Those pages are all still held then (a chunk's SWA pages are evicted after its forward), and
  the step wrote the C4 ring slots of the last block before each boundary it crossed
  (``dsv4_backend/backend.py``), so the state at the boundary is complete.
- finish: the request's whole full pages are inserted (no window: they lengthen later matches
  and mark where prompts diverge), then it releases what it holds.
- a reservation that does not fit evicts least recently used cache nodes first.

Requests are known by id; their ids are read through the ``ids(start, end)`` callable given at
admission (the scheduler's request grows by its outputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from memory.allocator import AllocResult
from memory.prefix_cache import PrefixCache

IdsFn = Callable[[int, int], list[int]]


@dataclass
class _Tracked:
    ids: IdsFn
    cached: int                          # tokens taken over from the cache at admission
    seen: int                            # seq_len after the last step (restore points up to it are made)
    targets: set[int] = field(default_factory=set)


class PrefixHooks:
    """The prefix cache's side of :class:`scheduler_hooks.hooks.SchedulerHooks`."""

    def __init__(self, allocator: Any, cache: PrefixCache) -> None:
        self.allocator, self.cache = allocator, cache
        self.page = cache.page
        self._reqs: dict[str, _Tracked] = {}

    def on_admit(self, rid: str, ids: IdsFn, num_ids: int, max_cached: int) -> int:
        """Attach the deepest restore point within ``ids(0, max_cached)``; returns its length."""
        limit = max(0, min(max_cached, num_ids))
        head = ids(0, limit - limit % self.page)
        m = self.cache.match(head, num_ids)
        if m.length:
            self.allocator.attach_prefix(rid, m.full_pages, m.swa_pages, m.length)
        t = _Tracked(ids, m.length, m.length)
        if m.matched > m.length:
            t.targets.add(m.matched)
        last = (num_ids - 1) // self.page * self.page
        if last > m.length:
            t.targets.add(last)
        self._reqs[rid] = t
        return m.length

    def cached_tokens(self, rid: str) -> int:
        t = self._reqs.get(rid)
        return t.cached if t is not None else 0

    def after_forward(self, rid: str) -> None:
        """Before the window eviction: restore points at the targets the step crossed and at its
        end if that is a full-page boundary."""
        t = self._reqs.get(rid)
        if t is None:
            return
        n = self.allocator.seq_len(rid)
        points = {x for x in t.targets if t.seen < x <= n}
        if n > t.seen and n % self.page == 0:
            points.add(n)
        t.targets -= points
        t.seen = n
        if not points:
            return
        ids, pages = t.ids(0, max(points)), self.allocator.full_pages_of(rid)
        for b in sorted(points):
            swa = {k: self.allocator.swa_page_of(rid, k) for k in self.cache.window_keys(b)}
            if all(p is not None for p in swa.values()):
                self.cache.insert(ids[:b], pages[:b // self.page], swa)

    def on_finish(self, rid: str) -> None:
        """A request that completed normally leaves its whole pages in the cache."""
        t = self._reqs.get(rid)
        if t is None:
            return
        n = self.allocator.seq_len(rid) // self.page * self.page
        if n:
            self.cache.insert(t.ids(0, n), self.allocator.full_pages_of(rid)[:n // self.page])

    def forget(self, rid: str) -> None:
        self._reqs.pop(rid, None)

    def make_room(self, res: AllocResult) -> bool:
        """Evict for a failed reservation; whether anything was freed."""
        if res.failed_pool not in ("full", "swa"):
            return False
        full = max(0, res.full_pages - self.allocator.full.num_free)
        swa = max(0, res.swa_pages - self.allocator.swa.num_free)
        got_full, got_swa = self.cache.evict(full, swa)
        return bool(got_full or got_swa)
