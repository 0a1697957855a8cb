"""Page ids, free lists and ownership: which request holds which slots. No bytes live here.

Three address spaces (docs/architecture.md, glossary):

- full slot: a token's logical address, ``req_to_token[req_slot, pos]``. Allocated in pages of
  ``plan.full_page`` (256) tokens, page-aligned, so ``full_slot // 4`` and ``full_slot // 128``
  (the C4 / C128 compressed rows) are unique per block of a request.
- SWA slot: where the token's 584-byte row lives while inside a window. A request's positions
  ``[128k, 128k + 128)`` share one SWA page; position ``p`` is at ``swa_page * 128 + p % 128``.
  ``full_to_swa[full_slot]`` gives it, -1 once evicted; its last entry is the dummy full slot,
  mapped to the pools' dummy SWA page. The C4 ring slots hang off the SWA pages.
- request slot: the request's row in ``req_to_token`` and its C128 ring / online-state index.

Pages have holder counts: a request holds its own pages, and with the prefix cache
(``memory/prefix_cache.py``) a cache node and the requests that reuse its prefix hold them too.
A page returns to its free list when its last holder lets go; an SWA page's ``full_to_swa``
entries are cleared then, not before (another holder may still read them).

Allocation failure is a returned :class:`AllocResult` the scheduler acts on (retract, queue);
misuse (unknown request, shrinking a sequence, double free) raises.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable, Hashable, NamedTuple, Optional, Protocol

import torch

from memory.configurator import SWA_PAGE, PoolPlan
from memory.upload import upload


class PagedAllocator:
    """A free list of page ids ``0 .. num_pages - 1``: lowest ids first, freed ids reused first (LIFO).

    A used page has a holder count: ``alloc`` gives one holder, ``retain`` adds one (the prefix
    cache, a request reusing a cached prefix), ``free`` drops one and returns the page to the free
    list only when none is left.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.capacity = int(num_pages)
        self._free = list(range(self.capacity - 1, -1, -1))  # a stack: pop() gives the lowest id
        self._refs: dict[int, int] = {}                        # used page -> holders (>= 1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` page ids, or None (nothing taken) if fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:][::-1]
        del self._free[-n:]
        self._refs.update(dict.fromkeys(pages, 1))
        return pages

    def retain(self, pages: list[int]) -> None:
        """One more holder for each of ``pages`` (all must be in use)."""
        bad = [p for p in pages if p not in self._refs]
        if bad:
            raise ValueError(f"retaining pages that are not allocated: {sorted(set(bad))[:8]}")
        for p in pages:
            self._refs[p] += 1

    def free(self, pages: list[int]) -> list[int]:
        """Drop one holder of each of ``pages``; returns those that went back to the free list.
        Raises ValueError (and frees nothing) if any is not allocated or one is repeated."""
        bad = [p for p in pages if p not in self._refs]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"freeing pages that are not allocated or repeated: {sorted(set(bad)) or pages}")
        gone = []
        for p in pages:
            self._refs[p] -= 1
            if not self._refs[p]:
                del self._refs[p]
                gone.append(p)
        self._free.extend(gone)
        return gone

    def is_used(self, page: int) -> bool:
        return page in self._refs

    def refcount(self, page: int) -> int:
        """Holders of ``page`` (0 when free)."""
        return self._refs.get(page, 0)

    @property
    def used_pages(self) -> set[int]:
        return set(self._refs)

    def check(self, name: str) -> None:
        """free + used == capacity, no id both free and used, no id out of range."""
        free = set(self._free)
        used = set(self._refs)
        assert len(free) == len(self._free), f"{name}: a page is on the free list twice"
        assert not free & used, f"{name}: pages both free and used: {sorted(free & used)[:8]}"
        assert len(free) + len(used) == self.capacity, (
            f"{name}: free {len(free)} + used {len(used)} != capacity {self.capacity}")
        assert all(0 <= p < self.capacity for p in free | used), f"{name}: page id out of range"
        assert all(n >= 1 for n in self._refs.values()), f"{name}: a used page with no holder"


class ReqToTokenPool:
    """Request slots and the request -> full-slot table ``req_to_token`` int64 [max_requests, max_context]."""

    def __init__(self, max_requests: int, max_context: int, device: str | torch.device = "cpu") -> None:
        self.max_requests = int(max_requests)
        self.max_context = int(max_context)
        self.req_to_token = torch.zeros(self.max_requests, self.max_context, dtype=torch.int64, device=device)
        self.slots = PagedAllocator(self.max_requests)

    def alloc(self) -> int | None:
        got = self.slots.alloc(1)
        return got[0] if got else None

    def free(self, slot: int) -> None:
        self.slots.free([slot])


class AllocResult(NamedTuple):
    """Outcome of :meth:`KVAllocator.extend` / ``can_extend``.

    ``full_pages`` / ``swa_pages``: pages the extension takes (or would take). On failure
    ``failed_pool`` is ``"full"``, ``"swa"`` or ``"context"`` (past ``max_context``) and
    ``needed`` / ``free`` are that pool's pages (tokens for ``"context"``).
    """

    ok: bool
    failed_pool: str | None = None
    needed: int = 0
    free: int = 0
    full_pages: int = 0
    swa_pages: int = 0


class PoolStat(NamedTuple):
    used: int
    total: int


class PageHolder(Protocol):
    """Something besides the requests that holds pages (the prefix cache)."""

    def held_pages(self) -> tuple[list[int], list[int]]:
        """(full pages, SWA pages) it holds, each at most once."""

    def check(self) -> None:
        """AssertionError if its own bookkeeping is inconsistent."""


@dataclass
class _Request:
    slot: int
    seq_len: int = 0
    full_pages: list[int] = field(default_factory=list)  # full page of positions [i*fp, (i+1)*fp)
    swa_pages: dict[int, int] = field(default_factory=dict)  # k -> SWA page of positions [128k, 128k+128)


class KVAllocator:
    """Request slots, full pages and SWA pages of one plan, and the tables tying them.

    ``req_to_token``: int64 [max_running_requests, max_context];
    ``full_to_swa``: int64 [max_full_tokens + 1] (last entry: the dummy full slot).
    ``dense=True`` (or a dense plan) never evicts: the SWA pool then holds every token.

    Table writes are queued on the host and applied together, in order, when a table is next
    read (both accessors flush): a decode step's ``extend`` of B requests then costs one upload
    and one scatter per table instead of 2 B of each; on a GPU the upload is queued without a
    host sync (``memory/upload.py``). The page bookkeeping itself is immediate.
    """

    def __init__(self, plan: PoolPlan, max_context: int, window: int = 128, dense: bool = False,
                 device: str | torch.device = "cpu") -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.plan = plan
        self.window = int(window)
        self.dense = bool(dense or plan.dense)
        self.full_page = plan.full_page
        self.max_full_tokens = plan.max_full_tokens
        self.full = PagedAllocator(plan.max_full_tokens // plan.full_page)
        self.swa = PagedAllocator(plan.num_swa_pages)
        self.req_pool = ReqToTokenPool(plan.max_running_requests, max_context, device)
        self._full_to_swa = torch.full((plan.max_full_tokens + 1,), -1, dtype=torch.int64, device=device)
        self._full_to_swa[-1] = plan.num_swa_pages * SWA_PAGE  # dummy full slot -> dummy SWA page
        self._reqs: dict[Hashable, _Request] = {}
        self._by_slot: dict[int, _Request] = {}            # request slot -> its request
        self.on_free: list[Callable[[int], None]] = []   # called with the request slot in free() (HiSparse)
        # SWA page -> full slot of the first of its 128 tokens: the entries of full_to_swa it fills
        self._swa_home: dict[int, int] = {}
        self.holder: Optional[PageHolder] = None   # the prefix cache, when one is attached
        # queued writes per table: (flat indices, values) host tensors, in the order made
        self._pending: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {"req_to_token": [], "full_to_swa": []}

    # ---- accessors -------------------------------------------------------------------

    @property
    def req_to_token(self) -> torch.Tensor:
        self.flush()
        return self.req_pool.req_to_token

    @property
    def full_to_swa(self) -> torch.Tensor:
        self.flush()
        return self._full_to_swa

    def flush(self) -> None:
        """Apply the queued table writes: per table one upload and one scatter; where an entry
        was written more than once, the last write wins, as if they had been made one by one."""
        for name, table in (("req_to_token", self.req_pool.req_to_token), ("full_to_swa", self._full_to_swa)):
            queued = self._pending[name]
            if not queued:
                continue
            idx = torch.cat([i for i, _ in queued])
            val = torch.cat([v for _, v in queued])
            queued.clear()
            uniq, inv = torch.unique(idx, return_inverse=True)
            if uniq.numel() < idx.numel():
                order = torch.arange(idx.numel())
                last = torch.full((uniq.numel(),), -1, dtype=torch.int64).scatter_reduce_(0, inv, order, "amax")
                idx, val = uniq, val[last]
            both = upload(torch.stack([idx, val]), table.device)
            table.view(-1)[both[0]] = both[1]

    def _queue(self, name: str, idx: torch.Tensor, val: torch.Tensor) -> None:
        self._pending[name].append((idx.to(torch.int64), val.to(torch.int64)))

    @property
    def max_context(self) -> int:
        return self.req_pool.max_context

    @property
    def dummy_full_slot(self) -> int:
        return self.max_full_tokens

    @property
    def live_requests(self) -> list[Hashable]:
        return list(self._reqs)

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._reqs

    def _req(self, rid: Hashable) -> _Request:
        try:
            return self._reqs[rid]
        except KeyError:
            raise KeyError(f"request {rid!r} is not admitted") from None

    def seq_len(self, rid: Hashable) -> int:
        return self._req(rid).seq_len

    def req_slot(self, rid: Hashable) -> int:
        return self._req(rid).slot

    def unmapped(self, slot: int, start: int, end: int) -> list[int]:
        """Positions in ``[start, end)`` of the request in ``slot`` that have no SWA slot (evicted,
        or not extended to yet): from the page bookkeeping, without reading ``full_to_swa``."""
        req = self._by_slot.get(slot)
        if req is None:
            return list(range(start, end))
        held = min(end, req.seq_len)
        k0, k1 = start // SWA_PAGE, -(-held // SWA_PAGE)
        if k0 == 0 and held == req.seq_len and len(req.swa_pages) == k1:
            gone = []      # its pages are keys below k1 (check_integrity), so these k1 are all of them
        else:
            gone = [k for k in range(k0, k1) if k not in req.swa_pages]
        out = [p for k in gone for p in range(max(start, k * SWA_PAGE), min(held, (k + 1) * SWA_PAGE))]
        return out + list(range(max(start, held), end))

    def swa_page_of(self, rid: Hashable, k: int) -> int | None:
        """The SWA page holding positions ``[128k, 128k + 128)`` of ``rid``; None if evicted or never allocated."""
        return self._req(rid).swa_pages.get(k)

    # ---- lifecycle -------------------------------------------------------------------

    def admit(self, rid: Hashable) -> int | None:
        """Give ``rid`` a request slot (returned), or None when every slot is taken."""
        if rid in self._reqs:
            raise ValueError(f"request {rid!r} is already admitted")
        slot = self.req_pool.alloc()
        if slot is not None:
            self._reqs[rid] = self._by_slot[slot] = _Request(slot)
        return slot

    def can_extend(self, rid: Hashable, new_len: int) -> AllocResult:
        """Dry run of :meth:`extend`: what it would take, and whether it fits now."""
        req = self._req(rid)
        if new_len < req.seq_len:
            raise ValueError(f"request {rid!r}: new_len {new_len} < seq_len {req.seq_len}")
        if new_len > self.max_context:
            return AllocResult(False, "context", new_len, self.max_context)
        n_full = -(-new_len // self.full_page) - len(req.full_pages)
        n_swa = len(self._new_swa_keys(req, new_len))
        if n_full > self.full.num_free:
            return AllocResult(False, "full", n_full, self.full.num_free, n_full, n_swa)
        if n_swa > self.swa.num_free:
            return AllocResult(False, "swa", n_swa, self.swa.num_free, n_full, n_swa)
        return AllocResult(True, None, 0, 0, n_full, n_swa)

    def extend(self, rid: Hashable, new_len: int) -> AllocResult:
        """Allocate and map positions ``[seq_len, new_len)`` of ``rid``; all or nothing."""
        req = self._req(rid)
        res = self.can_extend(rid, new_len)
        if not res.ok or new_len == req.seq_len:
            return res
        keys = self._new_swa_keys(req, new_len)
        req.full_pages += self.full.alloc(res.full_pages)
        new_swa = self.swa.alloc(res.swa_pages)
        req.swa_pages.update(zip(keys, new_swa))
        if keys:
            homes = self._full_slots(req, torch.tensor(keys, dtype=torch.int64) * SWA_PAGE).tolist()
            self._swa_home.update(zip(new_swa, homes))

        pos = torch.arange(req.seq_len, new_len)
        full_slots = self._full_slots(req, pos)
        self._queue("req_to_token", req.slot * self.max_context + pos, full_slots)
        k0 = req.seq_len // SWA_PAGE
        swa_table = torch.tensor([req.swa_pages[k] for k in range(k0, (new_len - 1) // SWA_PAGE + 1)])
        swa_slots = swa_table[pos // SWA_PAGE - k0] * SWA_PAGE + pos % SWA_PAGE
        self._queue("full_to_swa", full_slots, swa_slots)
        req.seq_len = new_len
        return res

    def truncate(self, rid: Hashable, new_len: int) -> None:
        """Shrink ``rid`` to its first ``new_len`` positions (speculative decoding's rollback of
        rejected draft tokens): full and SWA pages past them are freed and unmapped; the rows the
        kept positions' pages hold past ``new_len`` are stale and rewritten before any read."""
        req = self._req(rid)
        if not 0 <= new_len <= req.seq_len:
            raise ValueError(f"request {rid!r}: truncate to {new_len} outside [0, {req.seq_len}]")
        if new_len == req.seq_len:
            return
        pos = torch.arange(new_len, req.seq_len)
        self._queue("full_to_swa", self._full_slots(req, pos), torch.full_like(pos, -1))
        keep_full = -(-new_len // self.full_page)
        self.full.free(req.full_pages[keep_full:])
        del req.full_pages[keep_full:]
        gone = [k for k in req.swa_pages if k * SWA_PAGE >= new_len]
        self._release_swa([req.swa_pages.pop(k) for k in gone])
        req.seq_len = new_len

    def evict_swa(self, rid: Hashable) -> int:
        """Free ``rid``'s SWA pages that no future token can see; returns how many.

        The next token (position ``seq_len``) sees positions ``>= seq_len - (window - 1)``; a page
        whose every position is below that is freed and its tokens' ``full_to_swa`` set to -1.
        """
        req = self._req(rid)
        if self.dense:
            return 0
        first_visible = req.seq_len - (self.window - 1)
        gone = [k for k in req.swa_pages if (k + 1) * SWA_PAGE <= first_visible]
        if not gone:
            return 0
        self._release_swa([req.swa_pages.pop(k) for k in gone])
        return len(gone)

    def free(self, rid: Hashable) -> None:
        """Release everything ``rid`` holds (finish, abort or retraction); pages another holder
        (the prefix cache, a request sharing its prefix) still holds stay allocated."""
        req = self._req(rid)
        self.full.free(req.full_pages)
        self._release_swa(list(req.swa_pages.values()))
        self.req_pool.free(req.slot)
        del self._reqs[rid], self._by_slot[req.slot]
        for hook in self.on_free:
            hook(req.slot)

    # ---- sharing (the prefix cache) ------------------------------------------------------

    def attach_prefix(self, rid: Hashable, full_pages: list[int], swa_pages: dict[int, int], seq_len: int) -> None:
        """Make ``rid`` (admitted, empty) start at ``seq_len`` over already written pages: it takes
        a holder on each. ``full_pages`` cover ``[0, seq_len)`` (``seq_len`` a whole number of full
        pages, so the request never writes into them); ``swa_pages`` maps ``k`` to the SWA page of
        positions ``[128k, 128k + 128)`` and must cover the window of position ``seq_len``."""
        req = self._req(rid)
        if req.seq_len or req.full_pages:
            raise ValueError(f"request {rid!r} already holds {req.seq_len} tokens")
        if seq_len % self.full_page or len(full_pages) != seq_len // self.full_page:
            raise ValueError(f"a shared prefix is whole full pages: {len(full_pages)} pages for {seq_len} tokens")
        if seq_len > self.max_context:
            raise ValueError(f"a shared prefix of {seq_len} tokens exceeds max_context {self.max_context}")
        need = {k for k in range(seq_len // SWA_PAGE) if (k + 1) * SWA_PAGE > seq_len - (self.window - 1)}
        if not self.dense and not need <= set(swa_pages):
            raise ValueError(f"the SWA pages {sorted(need - set(swa_pages))} of the window at {seq_len} are missing")
        self.full.retain(list(full_pages))
        self.swa.retain(list(swa_pages.values()))
        req.full_pages = list(full_pages)
        req.swa_pages = dict(swa_pages)
        req.seq_len = seq_len
        if seq_len:
            pos = torch.arange(seq_len)
            self._queue("req_to_token", req.slot * self.max_context + pos, self._full_slots(req, pos))

    def full_pages_of(self, rid: Hashable) -> list[int]:
        """``rid``'s full pages, in position order (page i holds positions ``[256 i, 256 (i + 1))``)."""
        return list(self._req(rid).full_pages)

    def retain(self, full_pages: list[int], swa_pages: list[int]) -> None:
        """A holder besides the requests (the prefix cache) takes these pages."""
        self.full.retain(full_pages)
        self.swa.retain(swa_pages)

    def release(self, full_pages: list[int], swa_pages: list[int]) -> None:
        """That holder lets go; pages no one else holds are freed."""
        self.full.free(full_pages)
        self._release_swa(swa_pages)

    def swa_home(self, page: int) -> int:
        """Full slot of the first token whose row SWA page ``page`` holds."""
        return self._swa_home[page]

    def _release_swa(self, pages: list[int]) -> None:
        """Drop a holder of each SWA page; a freed page's tokens no longer have an SWA slot."""
        gone = self.swa.free(pages)
        if gone:
            homes = torch.tensor([self._swa_home.pop(p) for p in gone], dtype=torch.int64)
            slots = (homes[:, None] + torch.arange(SWA_PAGE)[None, :]).reshape(-1)
            self._queue("full_to_swa", slots, torch.full_like(slots, -1))

    # ---- helpers ---------------------------------------------------------------------

    def _new_swa_keys(self, req: _Request, new_len: int) -> list[int]:
        if new_len <= req.seq_len:
            return []
        ks = range(req.seq_len // SWA_PAGE, (new_len - 1) // SWA_PAGE + 1)
        return [k for k in ks if k not in req.swa_pages]

    def _full_slots(self, req: _Request, pos: torch.Tensor) -> torch.Tensor:
        pages = torch.tensor(req.full_pages, dtype=torch.int64)
        return pages[pos // self.full_page] * self.full_page + pos % self.full_page

    # ---- invariants and accounting ---------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless every pool balances, no page has two owners, and every
        live token's ``req_to_token`` / ``full_to_swa`` entries agree with its pages."""
        self.full.check("full pool")
        self.swa.check("SWA pool")
        self.req_pool.slots.check("request slots")
        cache_full, cache_swa = self.holder.held_pages() if self.holder is not None else ([], [])
        if self.holder is not None:
            self.holder.check()
        reqs = list(self._reqs.values())
        for name, pool, held in (
            ("full", self.full, [r.full_pages for r in reqs] + [cache_full]),
            ("SWA", self.swa, [list(r.swa_pages.values()) for r in reqs] + [cache_swa]),
            ("request slot", self.req_pool.slots, [[r.slot] for r in reqs]),
        ):
            for pages in held:   # each holder (a request, the cache) holds a page once
                assert len(set(pages)) == len(pages), f"{name} pages held twice by one holder: {pages[:8]}"
            counts = collections.Counter(p for pages in held for p in pages)
            if name == "request slot":
                assert all(n == 1 for n in counts.values()), "request slots owned twice"
            assert set(counts) == pool.used_pages, (
                f"{name} pool: pages in use but held by no request or cache {sorted(pool.used_pages - set(counts))[:8]}, "
                f"held but marked free {sorted(set(counts) - pool.used_pages)[:8]}")
            wrong = [p for p, n in counts.items() if pool.refcount(p) != n]
            assert not wrong, (f"{name} pages owned twice or more than counted: page {wrong[0]} is held "
                               f"{counts[wrong[0]]} times, its holder count is {pool.refcount(wrong[0])}")
        assert set(self._swa_home) == self.swa.used_pages, "SWA pages without a home full slot (or freed ones with one)"
        live_full = {p * self.full_page for p in self.full.used_pages}
        orphans = [p for p, h in self._swa_home.items() if h - h % self.full_page not in live_full]
        assert not orphans, f"SWA pages {orphans[:8]} map tokens of a freed full page"

        expect = torch.full_like(self.full_to_swa, -1, device="cpu")
        expect[-1] = self.plan.num_swa_pages * SWA_PAGE
        for page in cache_swa:   # a cached window page maps all its 128 tokens
            home = self._swa_home[page]
            expect[home:home + SWA_PAGE] = page * SWA_PAGE + torch.arange(SWA_PAGE)
        for rid, req in self._reqs.items():
            n = req.seq_len
            assert len(req.full_pages) == -(-n // self.full_page), (
                f"request {rid!r}: {len(req.full_pages)} full pages for {n} tokens")
            if n == 0:
                continue
            pos = torch.arange(n)
            slots = self._full_slots(req, pos)
            got = self.req_to_token[req.slot, :n].cpu()
            if not torch.equal(got, slots):
                bad = int((got != slots).nonzero()[0])
                raise AssertionError(f"request {rid!r}: req_to_token[{req.slot}, {bad}] = {int(got[bad])}, "
                                     f"its full page says {int(slots[bad])}")
            first_visible = n - (self.window - 1)
            for k in range(n // SWA_PAGE + (n % SWA_PAGE > 0)):
                if (k + 1) * SWA_PAGE > first_visible:
                    assert k in req.swa_pages, f"request {rid!r}: SWA page {k} is inside the window but not held"
            assert all(0 <= k * SWA_PAGE < n for k in req.swa_pages), (
                f"request {rid!r}: holds an SWA page past its {n} tokens")
            for k, page in req.swa_pages.items():
                sel = pos[k * SWA_PAGE:(k + 1) * SWA_PAGE]
                assert self._swa_home[page] == int(slots[k * SWA_PAGE]), (
                    f"request {rid!r}: SWA page {page} (positions from {k * SWA_PAGE}) maps another request's tokens")
                expect[slots[sel]] = page * SWA_PAGE + sel % SWA_PAGE
        actual = self.full_to_swa.cpu()
        if not torch.equal(actual, expect):
            bad = int((actual != expect).nonzero()[0])
            raise AssertionError(f"full_to_swa[{bad}] = {int(actual[bad])}, its pages say {int(expect[bad])}")

    def cache_only_pages(self) -> tuple[int, int]:
        """(full, SWA) pages the prefix cache alone holds: freed if it let go of them."""
        if self.holder is None:
            return 0, 0
        full, swa = self.holder.held_pages()
        return (sum(self.full.refcount(p) == 1 for p in full), sum(self.swa.refcount(p) == 1 for p in swa))

    def stats(self) -> dict[str, PoolStat]:
        """(used, total) per pool: full / SWA in token slots, request slots, and the rows and ring
        slots implied by them (compressed rows per full page, ring slots per SWA page / request).
        ``used`` counts what running requests hold; pages only the prefix cache holds are not
        used but :meth:`cached_stats` (they are given back on demand)."""
        full_only, swa_only = self.cache_only_pages()
        used = self._units(self.full.num_used - full_only, self.swa.num_used - swa_only,
                           self.req_pool.slots.num_used)
        return {k: PoolStat(u, self._units_total[k]) for k, u in used.items()}

    def cached_stats(self) -> dict[str, int]:
        """Per pool (the keys of :meth:`stats`), the units only the prefix cache holds."""
        full_only, swa_only = self.cache_only_pages()
        return self._units(full_only, swa_only, 0)

    @property
    def _units_total(self) -> dict[str, int]:
        plan = self.plan
        totals = {"full": self.full.capacity * self.full_page, "swa": self.swa.capacity * SWA_PAGE,
                  "req_slots": self.req_pool.max_requests, "c4_rows": plan.c4_rows,
                  "c4_indexer_rows": plan.c4_indexer_rows, "c4_ring_slots": plan.c4_ring_slots,
                  "c128_rows": plan.c128_rows, "c128_online_slots": plan.online_state_slots,
                  "c128_ring_rows": plan.c128_ring_rows}
        return totals

    def _units(self, full_pages: int, swa_pages: int, reqs: int) -> dict[str, int]:
        """The units of every pool that ``full_pages`` full pages, ``swa_pages`` SWA pages and
        ``reqs`` request slots take."""
        plan = self.plan
        full = full_pages * self.full_page
        out = {"full": full, "swa": swa_pages * SWA_PAGE, "req_slots": reqs}
        if plan.dense:
            return out
        if plan.num_c4_layers:
            out["c4_rows"] = min(full // 4, plan.c4_rows)
            out["c4_indexer_rows"] = full // 4
            out["c4_ring_slots"] = swa_pages * plan.c4_ring_size
        if plan.num_c128_layers:
            out["c128_rows"] = full // 128
            if plan.online_compress:
                out["c128_online_slots"] = reqs
            else:
                out["c128_ring_rows"] = reqs * plan.c128_ring_size
        return out
