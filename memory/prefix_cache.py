"""Prefix cache over the compressed state: a page-granular radix tree of token prefixes whose
nodes hold full pages and, at restore points, the SWA window pages (docs/memory.md, "Prefix cache").

A node is one full page (256 tokens) of some prefix: its key is those 256 token ids, its path
from the root spells the prefix, and it holds a reference to the full page whose compressed
rows (C4, C4 indexer, C128: rows ``full_slot // m``) were written for exactly that prefix. A
node may also hold the SWA pages of the window ending at its last token, which carry that
window's KV rows and the C4 / indexer ring slots (8 per SWA page) the next C4 block reads: the
node is then a *restore point*, and a request whose ids start with the path's ids can begin at
``depth * 256`` and prefill only the rest. The C128 ring and online state are per request and
empty at a multiple of 128, so a restore point needs nothing else.

Restore points are made by the scheduler hooks (``scheduler_hooks/prefix_hooks.py``) right after
a step, at the full-page boundaries it crossed that are the request's checkpoint targets and at
its end if that is one (the step wrote the ring slots of the last C4 block before each boundary;
its window pages are still held); a finished request's full pages are added without a window
(they only lengthen matches and mark where prompts diverge). The
cache holds pages through :class:`memory.allocator.KVAllocator`'s holder counts; eviction drops
least recently used nodes whose pages no running request holds, so it always frees memory.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Sequence

from memory.configurator import SWA_PAGE


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]                      # the 256 ids of this page (() for the root)
    page: int                                 # full page id (-1 for the root)
    parent: Optional["_Node"]
    depth: int                                # pages from the root: the node ends at depth * 256
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    swa: dict[int, int] = field(default_factory=dict)   # k -> SWA page of [128k, 128k + 128): restore point
    last_use: int = 0


class PrefixMatch(NamedTuple):
    """What :meth:`PrefixCache.match` found.

    ``length``: tokens a request can start at (a restore point, 0 if none); ``full_pages`` /
    ``swa_pages``: what it takes over (:meth:`KVAllocator.attach_prefix`); ``matched``: tokens
    of the longest page-aligned path that matches, restore point or not."""

    length: int
    full_pages: list[int]
    swa_pages: dict[int, int]
    matched: int


class PrefixCache:
    """A radix tree of full pages over ``allocator``'s pools (which it registers with as holder).

    ``allocator``: a :class:`memory.allocator.KVAllocator`. All lengths are tokens; every
    cached length is a multiple of the full page (256)."""

    def __init__(self, allocator: Any) -> None:
        if allocator.dense:
            raise ValueError("the prefix cache needs the compressed pools (dense=False)")
        self.alloc = allocator
        self.page = allocator.full_page
        self.window = allocator.window
        if self.page % SWA_PAGE or self.window - 1 > self.page:
            raise ValueError(f"a restore point keeps the window inside its last full page: needs window - 1 "
                             f"<= {self.page} and full pages of whole SWA pages (window {self.window})")
        self.root = _Node((), -1, None, 0)
        self._clock = itertools.count(1)
        self.num_nodes = 0
        self.num_swa_nodes = 0
        self.hit_tokens = 0          # tokens requests started from, summed over admissions
        self.query_tokens = 0        # tokens of the ids looked up
        self.num_queries = 0
        self.num_hits = 0
        self.evicted_pages = 0
        # the pages held, kept beside the tree so that stats() from another thread copies them
        # in one step (list(dict) holds the GIL) instead of walking a tree being changed
        self._full: dict[int, None] = {}
        self._swa: dict[int, None] = {}
        allocator.holder = self

    # ---- lookup ------------------------------------------------------------------------

    def _key(self, ids: Sequence[int], i: int) -> tuple[int, ...]:
        return tuple(ids[i * self.page:(i + 1) * self.page])

    def _walk(self, ids: Sequence[int], limit: int) -> list[_Node]:
        """The matching path (root excluded) over the first ``limit`` ids, whole pages only."""
        node, path = self.root, []
        for i in range(min(limit, len(ids)) // self.page):
            node = node.children.get(self._key(ids, i))
            if node is None:
                break
            path.append(node)
        return path

    def window_keys(self, length: int) -> list[int]:
        """The SWA page indices ``k`` a request starting at ``length`` needs: the window of its
        first token, positions ``length - (window - 1) .. length - 1``."""
        first = max(0, length - (self.window - 1))
        return list(range(first // SWA_PAGE, -(-length // SWA_PAGE))) if length else []

    def match(self, ids: Sequence[int], num_ids: Optional[int] = None) -> PrefixMatch:
        """The deepest restore point whose path is a prefix of ``ids``; marks it used. ``num_ids``:
        the request's whole length for the hit rate (default ``len(ids)``)."""
        path = self._walk(ids, len(ids))
        best = max((n for n in path if n.swa), key=lambda n: n.depth, default=None)
        self.num_queries += 1
        self.query_tokens += len(ids) if num_ids is None else num_ids
        if best is None:
            return PrefixMatch(0, [], {}, len(path) * self.page)
        now = next(self._clock)
        for n in path[:best.depth]:
            n.last_use = now
        self.num_hits += 1
        self.hit_tokens += best.depth * self.page
        return PrefixMatch(best.depth * self.page, [n.page for n in path[:best.depth]], dict(best.swa),
                           len(path) * self.page)

    # ---- insertion ---------------------------------------------------------------------

    def insert(self, ids: Sequence[int], full_pages: Sequence[int], swa_pages: Optional[dict[int, int]] = None) -> None:
        """Add the prefix ``ids`` (whole pages; ``full_pages[i]`` holds page i's rows, written by
        the caller for exactly these ids). Existing nodes keep their pages; new ones take a
        holder on the caller's. ``swa_pages`` (k -> SWA page, the window ending at ``len(ids)``,
        homed in ``full_pages[-1]``) makes the last node a restore point if it is not one yet;
        its full page is then switched to ``full_pages[-1]``, the page those SWA rows belong to."""
        n = len(ids) // self.page
        if len(ids) % self.page or len(full_pages) < n:
            raise ValueError(f"insert takes whole full pages: {len(ids)} ids, {len(full_pages)} pages")
        node, now = self.root, next(self._clock)
        for i in range(n):
            key = self._key(ids, i)
            child = node.children.get(key)
            if child is None:
                self._retain([full_pages[i]], [])
                child = _Node(key, full_pages[i], node, node.depth + 1)
                node.children[key] = child
                self.num_nodes += 1
            child.last_use = now
            node = child
        if not swa_pages or node is self.root or node.swa:
            return
        if sorted(swa_pages) != self.window_keys(len(ids)):
            raise ValueError(f"a restore point at {len(ids)} needs the SWA pages {self.window_keys(len(ids))}")
        home = full_pages[n - 1]
        if any(self.alloc.swa_home(p) // self.page != home for p in swa_pages.values()):
            raise ValueError("the SWA pages of a restore point must map tokens of its last full page")
        self._retain([], list(swa_pages.values()))
        if node.page != home:          # the SWA rows' full_to_swa entries are the caller's page's
            self._retain([home], [])
            self._release([node.page], [])
            node.page = home
        node.swa = dict(swa_pages)
        self.num_swa_nodes += 1

    # ---- eviction ----------------------------------------------------------------------

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def _only_cache_holds(self, n: _Node) -> bool:
        return self.alloc.full.refcount(n.page) == 1 and all(self.alloc.swa.refcount(p) == 1 for p in n.swa.values())

    def _retain(self, full: list[int], swa: list[int]) -> None:
        self.alloc.retain(full, swa)
        self._full.update(dict.fromkeys(full))
        self._swa.update(dict.fromkeys(swa))

    def _release(self, full: list[int], swa: list[int]) -> None:
        for p in full:
            del self._full[p]
        for p in swa:
            del self._swa[p]
        self.alloc.release(full, swa)

    def _drop_swa(self, n: _Node) -> int:
        freed = sum(self.alloc.swa.refcount(p) == 1 for p in n.swa.values())
        self._release([], list(n.swa.values()))
        n.swa = {}
        self.num_swa_nodes -= 1
        return freed

    def evict(self, full_pages: int = 0, swa_pages: int = 0) -> tuple[int, int]:
        """Give back at least ``full_pages`` full and ``swa_pages`` SWA pages if the cache can:
        SWA first by dropping the window of least recently used restore points (the node stays,
        without a window), full pages by removing least recently used leaves (with their window).
        Only nodes whose pages no running request holds are touched. Returns (full, SWA) freed."""
        got_full = got_swa = 0
        if swa_pages > 0:
            heap = [(n.last_use, id(n), n) for n in self._nodes() if n.swa and all(
                self.alloc.swa.refcount(p) == 1 for p in n.swa.values())]
            heapq.heapify(heap)
            while heap and got_swa < swa_pages:
                got_swa += self._drop_swa(heapq.heappop(heap)[2])
        if full_pages > 0:
            heap = [(n.last_use, id(n), n) for n in self._nodes() if not n.children and self._only_cache_holds(n)]
            heapq.heapify(heap)
            while heap and got_full < full_pages:
                n = heapq.heappop(heap)[2]
                if n.swa:
                    got_swa += self._drop_swa(n)
                self._release([n.page], [])
                got_full += 1
                self.evicted_pages += 1
                self._unlink(n)
                p = n.parent
                if p is not self.root and not p.children and self._only_cache_holds(p):
                    heapq.heappush(heap, (p.last_use, id(p), p))
        return got_full, got_swa

    def _unlink(self, n: _Node) -> None:
        del n.parent.children[n.key]
        self.num_nodes -= 1

    def flush(self) -> None:
        """Drop every node (running requests keep what they hold themselves)."""
        full, swa = self.held_pages()
        self._release(full, swa)
        self.root.children.clear()
        self.num_nodes = self.num_swa_nodes = 0

    # ---- accounting --------------------------------------------------------------------

    def held_pages(self) -> tuple[list[int], list[int]]:
        """(full pages, SWA pages) the cache holds, each once (the allocator's integrity check and
        accounting; safe to call from another thread)."""
        return list(self._full), list(self._swa)

    def check(self) -> None:
        """AssertionError unless the page lists agree with the tree."""
        nodes = self._nodes()
        assert sorted(self._full) == sorted(n.page for n in nodes), "prefix cache: full page list != tree"
        assert sorted(self._swa) == sorted(p for n in nodes for p in n.swa.values()), "prefix cache: SWA list != tree"

    def stats(self) -> dict[str, Any]:
        """Lookups, hits, the token hit rate (tokens started from a cached prefix / tokens looked
        up), and the tree's size."""
        return {"queries": self.num_queries, "hits": self.num_hits, "hit_tokens": self.hit_tokens,
                "query_tokens": self.query_tokens,
                "hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
                "nodes": self.num_nodes, "restore_points": self.num_swa_nodes,
                "evicted_pages": self.evicted_pages}
