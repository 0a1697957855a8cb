"""What the scheduler calls around every forward, over ``memory.allocator.KVAllocator``.

    admit(rid, ids, ...)    -> request slot (row of req_to_token; also its C128 ring / online
                               state) or None when every slot is taken; with the prefix cache,
                               the request starts at the cached prefix (``seq_len(rid)``)
    reserve(rid, new_len)   -> AllocResult: full pages and SWA pages (and with them the C4 rings)
                               for the tokens this step writes; on failure nothing is held and
                               ``failed_pool`` names the pool that ran out (the prefix cache's
                               least recently used pages are evicted first)
    after_forward(rids)     -> records restore points, then frees the SWA pages that left the
                               window of each request
    truncate(rid, new_len)  -> drops the request's positions from new_len on (a row the overlap
                               schedule launched after the request's last token)
    finish(rid)             -> a normal finish: the request's pages go to the prefix cache, then
                               it releases them
    release(rid)            -> frees everything the request holds (abort, retract, failure)

The model runner reads slots through the allocator itself; the hooks only decide when memory
is taken and given back. The allocator knows nothing about tensors or requests' tokens.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from .prefix_hooks import IdsFn, PrefixHooks


class SchedulerHooks:
    def __init__(self, allocator: Any, prefix_cache: Any = None):
        self.allocator = allocator
        self.prefix = PrefixHooks(allocator, prefix_cache) if prefix_cache is not None else None

    def admit(self, rid: str, ids: Optional[IdsFn] = None, num_ids: int = 0, max_cached: int = 0) -> Optional[int]:
        """A request slot for a new request, or None when none is free. ``ids(start, end)`` gives
        the request's ids (None: no prefix cache for it, e.g. a synthetic request); at most
        ``max_cached`` of its ``num_ids`` ids may be taken from the cache."""
        slot = self.allocator.admit(rid)
        if slot is not None and self.prefix is not None and ids is not None:
            self.prefix.on_admit(rid, ids, num_ids, max_cached)
        return slot

    def cached_tokens(self, rid: str) -> int:
        """Ids the request took from the prefix cache at its (latest) admission."""
        return self.prefix.cached_tokens(rid) if self.prefix is not None else 0

    def reserve(self, rid: str, new_len: int) -> Any:
        """Make room for the request's tokens up to ``new_len`` (total, not added). Returns AllocResult."""
        res = self.allocator.extend(rid, new_len)
        while not res.ok and self.prefix is not None and self.prefix.make_room(res):
            res = self.allocator.extend(rid, new_len)
        return res

    def can_reserve(self, rid: str, new_len: int) -> bool:
        return bool(self.allocator.can_extend(rid, new_len))

    def after_forward(self, rids: Iterable[str]) -> None:
        """After a step: keep restore points, drop SWA pages no query of these requests can see any more."""
        for rid in rids:
            if self.prefix is not None:
                self.prefix.after_forward(rid)
            self.allocator.evict_swa(rid)

    def truncate(self, rid: str, new_len: int) -> None:
        """Give back the pages of ``rid``'s positions from ``new_len`` on (none a restore point holds:
        restore points are made after a step, at lengths the request had then)."""
        self.allocator.truncate(rid, new_len)

    def finish(self, rid: str) -> None:
        """A request completed: its pages stay in the prefix cache; it gives back its own hold."""
        if self.prefix is not None:
            self.prefix.on_finish(rid)
        self.release(rid)

    def release(self, rid: str) -> None:
        """Give back every page and the request slot (finish, abort or retraction)."""
        if self.prefix is not None:
            self.prefix.forget(rid)
        self.allocator.free(rid)

    def req_slot(self, rid: str) -> int:
        return self.allocator.req_slot(rid)

    def seq_len(self, rid: str) -> int:
        return self.allocator.seq_len(rid)

    def check_integrity(self) -> None:
        self.allocator.check_integrity()

    def stats(self) -> Any:
        return self.allocator.stats()
