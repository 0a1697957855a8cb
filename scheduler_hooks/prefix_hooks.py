"""When the prefix cache (``memory/prefix_cache.py``) is read, filled and evicted, per request.

- admission: the longest cached restore point within the ids that must not be recomputed is
  taken over (the request starts there); the request then gets *checkpoint targets*: the
  full-page boundary where its ids leave the cached tree (where a later request with the same
  prefix would diverge) and the last full-page boundary of its ids. Its prefill chunks are cut
  to end on them.
- after a step: a request whose step ended exactly on a full-page boundary (a target, or a
  decode crossing one) becomes a restore point there: its pages up to the boundary and its window
  pages are inserted (the C4 rings of the window page hold the last block only right after such
  a step: a step writes ring slots for its tail blocks only).
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
        t = _Tracked(ids, m.length)
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

    def chunk_limit(self, rid: str, start: int, n: int) -> int:
        """``n`` cut so that a chunk from ``start`` ends on the next checkpoint target it would cross."""
        t = self._reqs.get(rid)
        if t is None:
            return n
        ends = [x - start for x in t.targets if start < x < start + n]
        return min(ends, default=n)

    def after_forward(self, rid: str) -> None:
        """Before the window eviction: make the request a restore point if its step ended on a page boundary."""
        t = self._reqs.get(rid)
        if t is None:
            return
        n = self.allocator.seq_len(rid)
        if n == 0 or n % self.page:
            return
        t.targets = {x for x in t.targets if x > n}
        swa = {k: self.allocator.swa_page_of(rid, k) for k in self.cache.window_keys(n)}
        if any(p is None for p in swa.values()):
            return
        self.cache.insert(t.ids(0, n), self.allocator.full_pages_of(rid)[:n // self.page], swa)

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
