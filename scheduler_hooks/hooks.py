"""What the scheduler calls around every forward, over ``memory.allocator.KVAllocator``.

    admit(rid)              -> request slot (row of req_to_token; also its C128 ring / online
                               state) or None when every slot is taken
    reserve(rid, new_len)   -> AllocResult: full pages and SWA pages (and with them the C4 rings)
                               for the tokens this step writes; on failure nothing is held and
                               ``failed_pool`` names the pool that ran out
    after_forward(rids)     -> frees the SWA pages that left the window of each request
    release(rid)            -> frees everything the request holds (finish, abort, retract)

The model runner reads slots through the allocator itself; the hooks only decide when memory
is taken and given back. The allocator knows nothing about tensors or requests' tokens.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional


class SchedulerHooks:
    def __init__(self, allocator: Any):
        self.allocator = allocator

    def admit(self, rid: str) -> Optional[int]:
        """A request slot for a new request, or None when none is free."""
        return self.allocator.admit(rid)

    def reserve(self, rid: str, new_len: int) -> Any:
        """Make room for the request's tokens up to ``new_len`` (total, not added). Returns AllocResult."""
        return self.allocator.extend(rid, new_len)

    def can_reserve(self, rid: str, new_len: int) -> bool:
        return bool(self.allocator.can_extend(rid, new_len))

    def after_forward(self, rids: Iterable[str]) -> None:
        """After a step: drop SWA pages no query of these requests can see any more."""
        for rid in rids:
            self.allocator.evict_swa(rid)

    def release(self, rid: str) -> None:
        """Give back every page and the request slot (finish, abort or retraction)."""
        self.allocator.free(rid)

    def req_slot(self, rid: str) -> int:
        return self.allocator.req_slot(rid)

    def seq_len(self, rid: str) -> int:
        return self.allocator.seq_len(rid)

    def check_integrity(self) -> None:
        self.allocator.check_integrity()

    def stats(self) -> Any:
        return self.allocator.stats()
