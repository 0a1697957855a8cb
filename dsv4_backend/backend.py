"""DSV4 attention backends: a registry, the interface, and the CPU PyTorch backend.

A backend builds :class:`ForwardMetadata` once per step (``init_forward_metadata``) and then
runs ``forward`` once per attention layer. The metadata is plain int tensors so GPU kernels
can consume the same data (FlashMLA-style window indices, compressed-row tables with lengths).

Per layer, :meth:`TorchDSV4Backend.forward` does, in this order:

1. write the new tokens' KV rows (FP8, 584 B) into the SWA pool;
2. compression (ratio 4 / 128 layers): gather the ring candidates of every block completed in
   this step, write the new tokens' raw (C, Z) into the ring(s) (only the tail future blocks
   still need, and for C4 the block before each full-page boundary the step crosses, which a
   prefix-cache restore point there reads), compress each completed block from ring + new
   tokens, and write the row at
   ``full_slot // m`` (C4 KV + indexer row, or C128 KV). Online C128 updates a running
   (max, sum, kv) state per request instead of a ring;
3. CSA: indexer scores over the visible indexer rows (read from the pool), top-k row ids;
4. attention over keys read only from the pools: the query's window rows from the SWA pool,
   then the top-k C4 rows or every visible C128 row, one softmax with the sink.

A prefill chunk and a decode token run the same code (a decode is an extend of one token), so
a chunk boundary anywhere gives identical results. ``dense=True`` is the benchmark baseline:
every layer attends every previous token's stored row, nothing is compressed.

Ring addressing (docs/architecture.md): C4 (and indexer) ring slot of position ``p`` =
``(full_to_swa[full_slot(p)] // 128) * R4 + p % R4``; C128 ring row = ``req_slot * R128 + p % R128``
with the plan's ring sizes R4 = 8, R128 = 128 (16 and 256 in a speculative plan);
online C128 state slot = ``req_slot``; compressed row = ``full_slot(first token of block) // m``.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from memory.configurator import FULL_PAGE, SWA_PAGE
from memory.layout import read_indexer_rows, read_kv_rows, write_indexer_rows, write_kv_rows
from memory.upload import upload

from .config import DSV4Config
from .model import AttentionInputs, CompressorInput, hadamard, hi_dtype
from .online_history import OnlineHistory, history_host, record_online_history

# ---- registry -------------------------------------------------------------------------------

_BACKENDS: dict[str, type] = {}


def register_attention_backend(name: str) -> Callable[[type], type]:
    """Class decorator: make a backend constructible by ``get_attention_backend(name)``."""
    def deco(cls: type) -> type:
        if name in _BACKENDS and _BACKENDS[name] is not cls:
            raise ValueError(f"attention backend {name!r} is already registered by {_BACKENDS[name].__name__}")
        _BACKENDS[name] = cls
        return cls
    return deco


def get_attention_backend(name: str) -> type:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; registered: {sorted(_BACKENDS)}") from None


def attention_backends() -> list[str]:
    return sorted(_BACKENDS)


# ---- what a step looks like -----------------------------------------------------------------

@dataclass
class ForwardBatch:
    """One step as the runner sees it: per request its slot and the new tokens' span.

    Request r extends positions ``prefix_lens[r] .. prefix_lens[r] + extend_lens[r] - 1``;
    its new tokens are contiguous in the step's token order, requests in list order. The
    allocator must already map every new position (``req_to_token``, ``full_to_swa``)."""

    req_slots: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    # speculative verify: the shortest length each request may be rolled back to (None: its
    # seq_len). Ring writes then cover every token a rollback to that length still needs.
    rollback_lens: Optional[list[int]] = None

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


@dataclass
class CompressionEvents:
    """Blocks of one ratio ``m`` completed in this step (E of them), ring path.

    Candidate j of event e comes from ``ring[src_ring[e, j]]`` if that is >= 0, else from the
    new token ``src_new[e, j]`` if that is >= 0, else it is padding (C = 0, Z = -inf: the
    b-candidates of block 0). For m = 4 the 8 candidates are the previous block's 4 tokens
    (their b-halves, channels [0:d]) then the block's own 4 (a-halves, [d:2d]); for m = 128
    the block's 128 tokens."""

    req: torch.Tensor        # [E] request index in the batch
    block: torch.Tensor      # [E] block index i
    first_pos: torch.Tensor  # [E] i * m: the RoPE position of the row
    row: torch.Tensor        # [E] destination row full_slot(i * m) // m
    src_ring: torch.Tensor   # [E, 2m or m]
    src_new: torch.Tensor    # [E, 2m or m]
    # flat indices into src_ring.reshape(-1) of the candidates read from the ring (src_ring >= 0),
    # known on the host, so a kernel can gather them without a device-side nonzero
    ring_cand: Optional[torch.Tensor] = None  # [G]

    @property
    def num(self) -> int:
        return int(self.row.numel())


@dataclass
class RingWrites:
    """New tokens whose raw (C, Z) future blocks still need, and where they go."""

    token: torch.Tensor  # [K] index into the step's new tokens
    slot: torch.Tensor   # [K] ring slot (C4) or ring row (C128)


@dataclass
class OnlineSegments:
    """Online C128: per (request, block) touched in this step, the new tokens it folds in.

    The running state ``online[state_slot[s]]`` holds (max, sum, kv) over the block's tokens
    seen so far (kv = sum of exp(z - max) * C). ``fresh`` segments start their block in this
    step and ignore the stored state; completed segments (``row >= 0``) write a row."""

    state_slot: torch.Tensor  # [S] = req_slot
    tokens: torch.Tensor      # [S, 128] new-token indices, -1 padded
    fresh: torch.Tensor       # [S] bool
    row: torch.Tensor         # [S] destination row, or -1 while the block is incomplete
    first_pos: torch.Tensor   # [S] block start position (RoPE position of the row)
    # the same split as index lists built on the host, so no layer needs a boolean mask
    done_idx: Optional[torch.Tensor] = None    # [D] segments with row >= 0, in order
    open_idx: Optional[torch.Tensor] = None    # [S - D] the others, in order
    done_token: Optional[torch.Tensor] = None  # [D] new-token index of each completed block's last token
    # speculative verify rows: the states after each of their positions, recorded for the
    # rollback (dsv4_backend/online_history.py); None without verify rows
    history: Optional[OnlineHistory] = None


@dataclass
class CompressedMeta:
    """Everything one ratio needs this step."""

    ratio: int
    rows: torch.Tensor            # [R, max_blocks] row of block i of request r (-1 padded)
    num_visible: torch.Tensor     # [T] compressed rows visible to each query: (p + 1) // m
    events: Optional[CompressionEvents]  # ring path
    ring_writes: Optional[RingWrites]    # ring path
    online: Optional[OnlineSegments] = None  # online C128 path


@dataclass
class ForwardMetadata:
    """Built once per step by :meth:`TorchDSV4Backend.init_forward_metadata`.

    Token tensors are in the step's order (requests concatenated); ``token_req`` maps a token
    to its request. The window of query t is positions ``max(0, p - W + 1) .. p`` (all of
    ``0 .. p`` in dense mode); ``window_slots`` lists their SWA slots (-1 padded, sparse mode
    only, FlashMLA's ``indices``), and ``kv_slots`` lists per request the SWA slots of
    positions ``kv_start[r] ..`` the union of its queries' windows (what the CPU path reads).
    ``host`` repeats the per-request fields as Python ints, so per-request loops (the CPU
    path's) never read a device tensor.
    """

    req_slots: torch.Tensor     # [R]
    prefix_lens: torch.Tensor   # [R]
    extend_lens: torch.Tensor   # [R]
    seq_lens: torch.Tensor      # [R] prefix + extend
    token_offsets: list[int]    # R + 1 boundaries of each request's new tokens
    token_req: torch.Tensor     # [T]
    positions: torch.Tensor     # [T]
    full_slots: torch.Tensor    # [T]
    swa_slots: torch.Tensor     # [T] where the new rows are written
    window: int                 # sliding window (dense: longest sequence of the step)
    window_slots: Optional[torch.Tensor]  # [T, W] SWA slots of each query's window, -1 padded
    kv_start: torch.Tensor      # [R] first position of kv_slots[r]
    kv_slots: torch.Tensor      # [R, max_kv] SWA slots of positions kv_start.., -1 padded
    compressed: dict[int, CompressedMeta] = field(default_factory=dict)
    dense: bool = False
    host: Optional["StepLists"] = None  # the per-request fields above as Python ints

    @property
    def compress(self) -> bool:
        """Whether layers need compressor inputs this step (never in dense mode)."""
        return not self.dense

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())


class AttentionBackend(ABC):
    """The small interface every DSV4 attention backend implements."""

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch, events: bool = True) -> ForwardMetadata:
        """The step's metadata: everything per step that does not depend on a layer (built once
        per step). ``events=False`` leaves out the compression events, ring writes and online
        segments (``CompressedMeta`` then has only ``rows`` and ``num_visible``)."""

    @abstractmethod
    def forward(self, layer_id: int, layer: Any, inputs: AttentionInputs, meta: ForwardMetadata) -> torch.Tensor:
        """One attention layer: writes the step's rows, compresses, attends; -> o [T, H, 512]."""

    def swa_store(self, layer_id: int, meta: ForwardMetadata) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """``(pool, slots)`` where the model's kv norm + RoPE launch may write the step's KV rows
        itself (``kernels.norm_rope.norm_pair``'s store: ``kv_store_rows``' bytes), or None: the
        backend stores ``inputs.kv`` in ``forward``. A backend that returns a target skips its
        store for inputs with ``kv_stored``."""
        return None


def _to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor field of a metadata dataclass (nested, dict values too) to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            setattr(obj, f.name, _to_device(getattr(obj, f.name), device))
    return obj


@dataclass
class StepLists:
    """The step's per-request numbers as Python ints: what per-request loops read without
    touching a device tensor."""

    req_slots: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    seq_lens: list[int]
    kv_start: list[int]


@dataclass
class _StepHost:
    """The step's layout built on the host from the batch alone (sizes O(R + T))."""

    lists: StepLists
    offsets: list[int]          # R + 1 token boundaries
    per_req: torch.Tensor       # [6, R] slot, prefix, extend, seq_len, kv_start, first token
    token_req: torch.Tensor     # [T]
    positions: torch.Tensor     # [T]

    @staticmethod
    def build(batch: ForwardBatch, window: int, dense: bool) -> "_StepHost":
        slots, prefix, ext = [list(map(int, x)) for x in (batch.req_slots, batch.prefix_lens, batch.extend_lens)]
        for r, (slot, n) in enumerate(zip(slots, ext)):
            if n <= 0:
                raise ValueError(f"request {r} (slot {slot}) extends by {n} tokens; every request needs >= 1")
        seq = [p + n for p, n in zip(prefix, ext)]
        start = [0 if dense else max(0, p - window + 1) for p in prefix]
        offsets = [0]
        for n in ext:
            offsets.append(offsets[-1] + n)
        per_req = torch.tensor([slots, prefix, ext, seq, start, offsets[:-1]], dtype=torch.int64).view(6, -1)
        token_req = torch.repeat_interleave(torch.arange(len(slots)), per_req[2])
        positions = torch.arange(offsets[-1]) - per_req[5][token_req] + per_req[1][token_req]
        return _StepHost(StepLists(slots, prefix, ext, seq, start), offsets, per_req, token_req, positions)


def _ranges(lo: list[int], hi: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenated ``range(lo[r], hi[r])`` (empty where hi <= lo): (owner r, value), each [N]."""
    counts = torch.tensor([max(0, h - l) for l, h in zip(lo, hi)], dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(len(lo)), counts)
    first = torch.cumsum(counts, 0) - counts
    value = torch.arange(owner.numel()) - first[owner] + torch.tensor(lo, dtype=torch.int64)[owner]
    return owner, value


def _events_host(m: int, step: _StepHost, c128_ring: int, keep_lens: list[int]) -> dict:
    """Ring path, ratio m: the events' and ring writes' host-computable parts (keys ``(m, name)``).
    ``c128_ring``: ring rows per request; ``keep_lens``: per request the shortest length the
    step may be rolled back to (its seq_len outside speculative verification)."""
    L = step.lists
    slot, prefix, offset, start = step.per_req[0], step.per_req[1], step.per_req[5], step.per_req[4]
    ev_req, ev_block = _ranges([p // m for p in L.prefix_lens], [s // m for s in L.seq_lens])
    cand = torch.arange(-m, m) if m == 4 else torch.arange(m)          # candidate offsets from i * m
    P = ev_block[:, None] * m + cand[None, :]                             # [E, n] candidate positions
    pre = prefix[ev_req][:, None]
    old = (P >= 0) & (P < pre)                                            # read from the ring
    out = {(m, "ev_req"): ev_req, (m, "ev_block"): ev_block,
           (m, "ev_new"): torch.where(P >= pre, P - pre + offset[ev_req][:, None], -1),
           (m, "ev_cand"): torch.nonzero(old.reshape(-1)).flatten()}
    # the tail future blocks read: the open block (and for m = 4 the last complete one)
    tail = [max(0, (s // m - (1 if m == 4 else 0)) * m) for s in keep_lens]
    lo, hi = [max(p, t) for p, t in zip(L.prefix_lens, tail)], list(L.seq_lens)
    owner = list(range(len(lo)))
    if m == 4:
        # also the last C4 block before every full-page boundary the step crosses: the prefix
        # cache can restore at such a boundary while its window page (and these slots) is held
        for r, (p, t) in enumerate(zip(L.prefix_lens, tail)):
            for b in range((p // FULL_PAGE + 1) * FULL_PAGE, t + 1, FULL_PAGE):
                lo.append(max(p, b - m))
                hi.append(b)
                owner.append(r)
    w_req, w_pos = _ranges(lo, hi)
    w_req = torch.tensor(owner, dtype=torch.int64)[w_req]
    out[m, "w_tok"] = w_pos - prefix[w_req] + offset[w_req]
    if m == 128:
        out[m, "ev_ring"] = torch.where(old, slot[ev_req][:, None] * c128_ring + P % c128_ring, -1)
        out[m, "w_slot"] = slot[w_req] * c128_ring + w_pos % c128_ring
        return out
    col = P - start[ev_req][:, None]                                      # column in the request's kv_slots
    outside = old & (col < 0)
    if bool(outside.any()):
        e = int(torch.nonzero(outside)[0, 0])
        first = int(P[e][outside[e]].min())
        raise RuntimeError(f"request slot {L.req_slots[int(ev_req[e])]}: the C4 ring needs position {first}, "
                           f"outside the window starting at {L.kv_start[int(ev_req[e])]}")
    out.update({(m, "ev_col"): torch.where(old, col, -1), (m, "ev_pos"): P, (m, "w_req"): w_req, (m, "w_pos"): w_pos})
    return out


def _segments_host(m: int, step: _StepHost) -> dict:
    """Online C128: per (request, block) touched, its new tokens and flags (keys ``(m, name)``)."""
    L = step.lists
    prefix, seq, offset = step.per_req[1], step.per_req[3], step.per_req[5]
    seg_req, seg_block = _ranges([p // m for p in L.prefix_lens], [(s - 1) // m + 1 for s in L.seq_lens])
    lo = torch.maximum(prefix[seg_req], seg_block * m)
    hi = torch.minimum(seq[seg_req], (seg_block + 1) * m)
    pos = lo[:, None] + torch.arange(m)[None, :]
    base = (offset - prefix)[seg_req]                                     # new-token index = position + base
    done = (seg_block + 1) * m <= seq[seg_req]
    return {(m, "seg_req"): seg_req, (m, "seg_block"): seg_block,
            (m, "seg_tokens"): torch.where(pos < hi[:, None], pos + base[:, None], -1),
            (m, "seg_fresh"): (seg_block * m >= prefix[seg_req]).to(torch.int64),
            (m, "seg_done"): done.to(torch.int64),
            (m, "seg_done_idx"): torch.nonzero(done).flatten(),
            (m, "seg_open_idx"): torch.nonzero(~done).flatten(),
            (m, "seg_done_token"): (hi - 1 + base)[done]}


def _upload(host: dict, device: torch.device) -> dict:
    """Move a dict of small int64 host tensors to ``device`` in one copy (views of one buffer),
    queued without a host sync."""
    if device.type == "cpu":
        return dict(host)
    keys = list(host)
    flat = upload(torch.cat([host[k].reshape(-1) for k in keys]), device)
    out, i = {}, 0
    for k in keys:
        n = host[k].numel()
        out[k] = flat[i:i + n].view(host[k].shape)
        i += n
    return out


def _host_int(meta: ForwardMetadata, name: str, r: int) -> int:
    """Per-request field ``name`` of request r, from the host lists when the metadata has them."""
    return getattr(meta.host, name)[r] if meta.host is not None else int(getattr(meta, name)[r])


def _online_split(seg: OnlineSegments) -> tuple[torch.Tensor, torch.Tensor]:
    """(completed, open) segment indices; from the host-built lists when present."""
    if seg.done_idx is not None:
        return seg.done_idx, seg.open_idx
    done = seg.row >= 0
    return torch.nonzero(done).flatten(), torch.nonzero(~done).flatten()


# ---- the CPU PyTorch backend ----------------------------------------------------------------

@register_attention_backend("torch")
class TorchDSV4Backend(AttentionBackend):
    """Plain PyTorch DSV4 attention over the paged pools (CPU or any device).

    ``tables`` gives ``req_to_token`` (int64 ``[req_slots, max_context]``, full slots) and
    ``full_to_swa`` (int64 ``[full_slots]``, -1 when evicted), read at every
    ``init_forward_metadata``. ``online_compress`` is the pools' (``c128_online`` present).
    """

    # Query rows attended at once. A block of n queries reads n + window - 1 window keys, so
    # small blocks waste little in sparse mode; dense mode bounds its [n, H, keys] scores.
    QUERY_BLOCK = 64
    DENSE_QUERY_BLOCK = 256

    def __init__(self, cfg: DSV4Config, pools: Any, tables: Any, dtype: torch.dtype = torch.float32,
                 dense: bool = False):
        self.cfg, self.pools, self.tables = cfg, pools, tables
        self.dtype, self.dense = dtype, dense
        self.window = cfg.sliding_window
        self.online_compress = bool(getattr(pools, "c128_online", None))
        self.hisparse = getattr(pools, "hisparse", None)   # memory/hisparse.py, or None
        self.state_dtype = pools.state_dtype
        self.device = pools.device
        ratios = set(cfg.layer_ratios) - {0}
        self.ratios = () if dense else tuple(sorted(ratios))
        # ring slots per SWA page / per request: the plan's (doubled for speculative decoding)
        self.c4_ring = pools.plan.c4_ring_size or 1
        self.c128_ring = pools.plan.c128_ring_size or 1

    # ---- metadata ------------------------------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch, events: bool = True) -> ForwardMetadata:
        """The step's metadata. ``events=False`` leaves out the compression events, ring writes
        and online segments (``CompressedMeta`` then has only ``rows`` and ``num_visible``): a
        step whose layers compress nothing (the eager MTP pass)."""
        # Everything whose size is the step's (tokens, events, ring writes) is laid out on the host
        # from the batch's ints and moved in one copy; everything read from the tables (full and
        # SWA slots, compressed rows) is gathered on the tables' device, so no context-length row
        # ever goes through the host, and nothing is read back from the device.
        tables = self.tables
        dev = tables.req_to_token.device
        step = _StepHost.build(batch, self.window, self.dense)
        host = {"req": step.per_req, "token_req": step.token_req, "positions": step.positions}
        keep = batch.rollback_lens or step.lists.seq_lens
        for m in self.ratios if events else ():
            online = m == 128 and self.online_compress
            host.update(_segments_host(m, step) if online else _events_host(m, step, self.c128_ring, keep))
            if online:
                L = step.lists
                hist = history_host(self.pools.plan, L.req_slots, L.prefix_lens, L.extend_lens, step.offsets,
                                    batch.rollback_lens)
                host.update({("hist", k): v for k, v in (hist or {}).items()})
        d = _upload(host, dev)
        per_req, token_req, positions = d["req"], d["token_req"], d["positions"]
        slots, seq, start = per_req[0], per_req[3], per_req[4]
        lists = step.lists
        kv_slots = self._kv_slots(lists, slots, seq, start)
        tok_col = positions - start[token_req]                     # column of each new token in kv_slots
        if self.dense:
            window, window_slots = max(lists.seq_lens), None
        else:
            window = self.window
            # query t's window, positions p - W + 1 .. p, as columns of its request's kv_slots row
            col = tok_col[:, None] + torch.arange(-window + 1, 1, device=dev)[None, :]
            window_slots = torch.where(col >= 0, kv_slots[token_req[:, None], col.clamp_min(0)], -1)
        meta = ForwardMetadata(
            req_slots=slots, prefix_lens=per_req[1], extend_lens=per_req[2], seq_lens=seq,
            token_offsets=step.offsets, token_req=token_req, positions=positions,
            full_slots=tables.req_to_token[slots[token_req], positions].to(torch.int64),
            swa_slots=kv_slots[token_req, tok_col], window=window,
            window_slots=window_slots, kv_start=start, kv_slots=kv_slots, dense=self.dense, host=lists,
        )
        for m in self.ratios:
            if events:
                meta.compressed[m] = self._compressed_meta(m, d, meta)
            else:
                meta.compressed[m] = CompressedMeta(m, *self._block_rows(m, meta), None, None)
        return _to_device(meta, self.device)

    def _kv_slots(self, lists: "StepLists", slots: torch.Tensor, seq: torch.Tensor,
                  start: torch.Tensor) -> torch.Tensor:
        """[R, max_kv] SWA slots of positions kv_start[r] .. seq_len[r] - 1, -1 padded (device)."""
        req_to_token, full_to_swa = self.tables.req_to_token, self.tables.full_to_swa
        width = max(s - k for s, k in zip(lists.seq_lens, lists.kv_start))
        pos = start[:, None] + torch.arange(width, device=slots.device)[None, :]
        valid = pos < seq[:, None]
        if any(lists.kv_start):
            full = req_to_token[slots[:, None], torch.where(valid, pos, 0)]
        else:   # every row starts at position 0 (dense mode, short requests): a row copy
            full = req_to_token[:, :width].index_select(0, slots)
        self.check_windows(lists.req_slots, lists.kv_start, lists.seq_lens)
        ks = full_to_swa[full].to(torch.int64)
        return torch.where(valid, ks, -1)

    def check_windows(self, req_slots: list[int], starts: list[int], seq_lens: list[int]) -> None:
        """Every position ``starts[r] .. seq_lens[r] - 1`` of each request must have an SWA slot:
        checked on the allocator's page bookkeeping (reading full_to_swa back would be a host
        sync per step)."""
        for slot, k, s in zip(req_slots, starts, seq_lens):
            if gone := self.tables.unmapped(slot, k, s):
                raise RuntimeError(f"request slot {slot}: positions {gone[:8]} of the step's windows have no "
                                   "SWA slot (evicted, or the allocator was not extended before the forward)")

    def _block_rows(self, m: int, meta: ForwardMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Ratio m's row of every complete block of each request, [R, max blocks] (-1 padded),
        and the rows visible to each query, [T]."""
        nbw = max(meta.host.seq_lens) // m
        # full slot of each block's first position: a strided view of the table, rows copied
        full = self.tables.req_to_token[:, : nbw * m: m].index_select(0, meta.req_slots).to(torch.int64)
        shift = m.bit_length() - 1
        rows = full >> shift if 1 << shift == m else full // m    # the same integers, shift is cheaper
        if any(s // m < nbw for s in meta.host.seq_lens):
            blocks = torch.arange(nbw, device=rows.device)
            rows.masked_fill_(blocks[None, :] >= (meta.seq_lens // m)[:, None], -1)       # [R, nbw]
        return rows, (meta.positions + 1) // m

    def _compressed_meta(self, m: int, d: dict, meta: ForwardMetadata) -> CompressedMeta:
        """One ratio's tables from the uploaded host layout ``d`` and the device tables."""
        rows, num_visible = self._block_rows(m, meta)
        nbw = rows.shape[1]
        if (m, "seg_req") in d:
            seg_req, seg_block = d[m, "seg_req"], d[m, "seg_block"]
            done = d[m, "seg_done"] != 0
            if nbw:
                row = torch.where(done, rows[seg_req, seg_block.clamp(max=nbw - 1)], -1)
            else:
                row = torch.full_like(seg_block, -1)
            seg = OnlineSegments(
                state_slot=meta.req_slots[seg_req], tokens=d[m, "seg_tokens"], fresh=d[m, "seg_fresh"] != 0,
                row=row, first_pos=seg_block * m, done_idx=d[m, "seg_done_idx"],
                open_idx=d[m, "seg_open_idx"], done_token=d[m, "seg_done_token"])
            if ("hist", "dest") in d:
                seg.history = OnlineHistory(**{f: d["hist", f] for f in ("state_slot", "tokens", "positions",
                                                                         "first", "rows", "dest")})
            return CompressedMeta(m, rows, num_visible, None, None, seg)
        ev_req, ev_block = d[m, "ev_req"], d[m, "ev_block"]
        if m == 4:   # ring slots hang off the candidates' SWA pages
            col = d[m, "ev_col"]
            swa = meta.kv_slots[ev_req[:, None], col.clamp_min(0)]
            src_ring = torch.where(col >= 0, (swa // SWA_PAGE) * self.c4_ring + d[m, "ev_pos"] % self.c4_ring, -1)
            w_req, w_pos = d[m, "w_req"], d[m, "w_pos"]
            swa = meta.kv_slots[w_req, w_pos - meta.kv_start[w_req]]
            ring_slot = (swa // SWA_PAGE) * self.c4_ring + w_pos % self.c4_ring
        else:
            src_ring, ring_slot = d[m, "ev_ring"], d[m, "w_slot"]
        events = CompressionEvents(req=ev_req, block=ev_block, first_pos=ev_block * m, row=rows[ev_req, ev_block],
                                   src_ring=src_ring, src_new=d[m, "ev_new"], ring_cand=d[m, "ev_cand"])
        return CompressedMeta(m, rows, num_visible, events, RingWrites(d[m, "w_tok"], ring_slot))

    # ---- per layer -----------------------------------------------------------------------

    def forward(self, layer_id: int, layer: Any, inputs: AttentionInputs, meta: ForwardMetadata) -> torch.Tensor:
        pools = self.pools
        write_kv_rows(pools.swa_kv[layer_id], meta.swa_slots, inputs.kv)
        ratio = 0 if meta.dense else layer.ratio
        if ratio == 4:
            cm = meta.compressed[4]
            self._compress_ring(layer, layer.compressor, inputs.compressor, cm, pools.c4_ring[layer_id],
                                self._c4_writer(layer_id, meta))
            self._compress_ring(layer, layer.indexer.compressor, inputs.indexer.compressor, cm,
                                pools.c4_indexer_ring[layer_id],
                                lambda rows, vals: write_indexer_rows(pools.c4_indexer[layer_id], rows,
                                                                      hadamard(vals)))
        elif ratio == 128:
            cm = meta.compressed[128]
            write = lambda rows, vals: write_kv_rows(pools.c128_kv[layer_id], rows, vals)  # noqa: E731
            if cm.online is not None:
                self._compress_online(layer, inputs.compressor, cm.online, pools.c128_online[layer_id],
                                      meta.positions, write)
            else:
                self._compress_ring(layer, layer.compressor, inputs.compressor, cm, pools.c128_ring[layer_id], write)
        return self._attend(layer_id, layer, inputs, meta, ratio)

    # ---- compression ---------------------------------------------------------------------

    def _c4_writer(self, layer_id: int, meta: ForwardMetadata) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """Where a CSA layer's new C4 rows go: the pool at their full rows, or under HiSparse the
        hot pool (and from there the host pool)."""
        pools, hs = self.pools, self.hisparse
        if hs is None:
            return lambda rows, vals: write_kv_rows(pools.c4_kv[layer_id], rows, vals)
        return lambda rows, vals: hs.write_rows(layer_id, rows,
                                                lambda pool, dev, part: write_kv_rows(pool, dev, vals[part]))

    def _state(self, x: torch.Tensor) -> torch.Tensor:
        """Round fresh (C, Z) to the state dtype, so ring-read and fresh candidates agree."""
        return x.to(self.state_dtype).to(x.dtype)

    def _finish_rows(self, layer: Any, compressor: Any, pooled: torch.Tensor, first_pos: torch.Tensor,
                     write: Callable[[torch.Tensor, torch.Tensor], None], rows: torch.Tensor) -> None:
        # pooled: [E, d] -> RMSNorm -> RoPE at the block's first position -> pool (which rounds)
        normed = compressor.norm(pooled.to(self.dtype))  # bf16 mode: the release casts before the norm
        write(rows, layer.rope.apply(normed, first_pos))

    def _compress_ring(self, layer: Any, compressor: Any, raw: CompressorInput, cm: CompressedMeta,
                       ring: torch.Tensor, write: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        ev, wr = cm.events, cm.ring_writes
        m, d = compressor.ratio, compressor.d
        width = raw.c.shape[-1]                       # coff * d
        if ev.num:
            # Gather candidates before the ring write below may overwrite their slots.
            c_new, z_new = self._state(raw.c), self._state(raw.z)
            from_ring = ring[ev.src_ring.clamp_min(0)].to(c_new.dtype)    # [E, n, 2 * width]
            new = (ev.src_new >= 0)[..., None]
            idx = ev.src_new.clamp_min(0)
            c = torch.where(new, c_new[idx], from_ring[..., :width])
            z = torch.where(new, z_new[idx], from_ring[..., width:])
            pad = ((ev.src_new < 0) & (ev.src_ring < 0))[..., None]
            c = c.masked_fill(pad, 0.0)
            z = z.masked_fill(pad, float("-inf"))
            ape = compressor.ape.to(z.dtype)          # candidate j sits at position j mod m of its block
            if m == 4:  # previous block's b-halves [0:d], then this block's a-halves [d:2d]
                c = torch.cat([c[:, :m, :d], c[:, m:, d:]], dim=1)
                z = torch.cat([z[:, :m, :d] + ape[:, :d], z[:, m:, d:] + ape[:, d:]], dim=1)
            else:
                z = z + ape
            pooled = (z.softmax(dim=1) * c).sum(dim=1)                       # [E, d]
        if wr.token.numel():
            ring[wr.slot] = torch.cat([raw.c[wr.token], raw.z[wr.token]], dim=-1).to(ring.dtype)
        if ev.num:
            self._finish_rows(layer, compressor, pooled, ev.first_pos, write, ev.row)

    def _compress_online(self, layer: Any, raw: CompressorInput, seg: OnlineSegments, state: torch.Tensor,
                         positions: torch.Tensor, write: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        # state: [slots, 3, 512] = (max, sum, kv) with kv = sum_j exp(z_j + ape - max) * C_j
        c_new, z_new = self._state(raw.c), self._state(raw.z)
        z_new = z_new + layer.compressor.ape.to(z_new.dtype)[positions % 128]
        if seg.history is not None:    # a verify: the states after each of its positions, before the fold
            record_online_history(state, seg.history, c_new, z_new)
        valid = (seg.tokens >= 0)[..., None]
        idx = seg.tokens.clamp_min(0)
        c = c_new[idx].masked_fill(~valid, 0.0)                              # [S, 128, 512]
        z = z_new[idx].masked_fill(~valid, float("-inf"))
        old = state[seg.state_slot].to(c.dtype)                              # [S, 3, 512]
        fresh = seg.fresh[:, None]
        old_max = torch.where(fresh, float("-inf"), old[:, 0])
        new_max = torch.maximum(old_max, z.amax(dim=1))                      # [S, 512]
        e = (z - new_max[:, None]).exp()
        keep = torch.where(fresh, 0.0, (old_max - new_max).exp())
        tot = torch.where(fresh, 0.0, old[:, 1]) * keep + e.sum(dim=1)
        kv = torch.where(fresh, 0.0, old[:, 2]) * keep + (e * c).sum(dim=1)
        done, keep_open = _online_split(seg)
        # Only a request's open block carries over (a completed block's successor starts fresh);
        # storing just those keeps the write free of duplicate slots.
        state[seg.state_slot[keep_open]] = torch.stack([new_max, tot, kv], dim=1)[keep_open].to(state.dtype)
        if done.numel():
            pooled = kv[done] / tot[done]
            self._finish_rows(layer, layer.compressor, pooled, seg.first_pos[done], write, seg.row[done])

    # ---- attention -----------------------------------------------------------------------

    def _attend(self, layer_id: int, layer: Any, inputs: AttentionInputs, meta: ForwardMetadata,
                ratio: int) -> torch.Tensor:
        q = inputs.q.to(hi_dtype(inputs.q.dtype))                             # [T, H, 512]
        out = torch.empty_like(q)
        sink = layer.attn_sink.to(q.dtype)                                    # [H]
        pools = self.pools
        for r in range(len(meta.token_offsets) - 1):
            t0, t1 = meta.token_offsets[r], meta.token_offsets[r + 1]
            prefix, start = _host_int(meta, "prefix_lens", r), _host_int(meta, "kv_start", r)
            seq_len = prefix + t1 - t0
            keys = read_kv_rows(pools.swa_kv[layer_id], meta.kv_slots[r, :seq_len - start]).to(q.dtype)
            comp = None
            if ratio == 128:
                rows = meta.compressed[128].rows[r, :seq_len // 128]
                comp = read_kv_rows(pools.c128_kv[layer_id], rows).to(q.dtype)          # [nb, 512]
            elif ratio == 4:
                sel = self._topk(layer_id, layer, inputs, meta, r)                     # [n, k]
                if self.hisparse is not None:   # the selected rows swapped into the hot pool, read there
                    comp = self.hisparse.read(layer_id, sel, _host_int(meta, "req_slots", r), read_kv_rows)
                else:
                    comp = read_kv_rows(pools.c4_kv[layer_id], sel)
                comp = comp.to(q.dtype)                                                # [n, k, 512]
            step = self.DENSE_QUERY_BLOCK if meta.dense else self.QUERY_BLOCK
            for b0 in range(t0, t1, step):
                b1 = min(t1, b0 + step)
                p0, p1 = prefix + b0 - t0, prefix + b1 - t0                           # positions p0 .. p1-1
                # only the keys some query of the block can see
                k0 = 0 if meta.dense else max(0, p0 - self.window + 1 - start)
                k1 = p1 - start
                pos = meta.positions[b0:b1, None]
                key_pos = start + torch.arange(k0, k1, device=q.device)[None, :]
                ok = key_pos <= pos
                if not meta.dense:
                    ok &= key_pos > pos - self.window
                extra = extra_ok = None
                if ratio == 128:
                    extra = comp[: p1 // 128]
                    extra_ok = torch.arange(extra.shape[0], device=q.device)[None, :] < (pos + 1) // 128
                elif ratio == 4:
                    extra, extra_ok = comp[b0 - t0:b1 - t0], sel[b0 - t0:b1 - t0] >= 0
                out[b0:b1] = self._sink_softmax(q[b0:b1], keys[k0:k1], ok, extra, extra_ok, sink)
        return out.to(inputs.q.dtype)

    def _sink_softmax(self, q: torch.Tensor, keys: torch.Tensor, ok: torch.Tensor, extra: Optional[torch.Tensor],
                      extra_ok: Optional[torch.Tensor], sink: torch.Tensor) -> torch.Tensor:
        """One softmax over window keys, compressed keys and the sink; rows are keys and values.

        q [n, H, 512]; keys [k, 512] with ok [n, k]; extra [e, 512] shared or [n, e, 512] per
        query, with extra_ok [n, e]; sink [H] (an unscaled logit with no value)."""
        neg = float("-inf")
        parts = [torch.einsum("thd,kd->thk", q, keys).masked_fill(~ok[:, None, :], neg)]
        if extra is not None:
            spec = "thd,kd->thk" if extra.dim() == 2 else "thd,tkd->thk"
            parts.append(torch.einsum(spec, q, extra).masked_fill(~extra_ok[:, None, :], neg))
        logits = torch.cat(parts, dim=-1) * self.cfg.softmax_scale
        logits = torch.cat([logits, sink[None, :, None].expand(q.shape[0], -1, 1)], dim=-1)
        p = logits.softmax(dim=-1)
        n = keys.shape[0]
        o = torch.einsum("thk,kd->thd", p[..., :n], keys)
        if extra is not None:
            spec = "thk,kd->thd" if extra.dim() == 2 else "thk,tkd->thd"
            o = o + torch.einsum(spec, p[..., n:-1], extra)
        return o

    def _topk(self, layer_id: int, layer: Any, inputs: AttentionInputs, meta: ForwardMetadata,
              r: int) -> torch.Tensor:
        """CSA selection for request r's queries: C4 row ids [n, k] (-1 where fewer are visible)."""
        cm = meta.compressed[4]
        t0, t1 = meta.token_offsets[r], meta.token_offsets[r + 1]
        nb = _host_int(meta, "seq_lens", r) // 4
        k = min(self.cfg.index_topk, nb)
        if k == 0:
            return torch.full((t1 - t0, 0), -1, dtype=torch.int64, device=inputs.q.device)
        rows = cm.rows[r, :nb]
        work = hi_dtype(inputs.q.dtype)
        idx_keys = read_indexer_rows(self.pools.c4_indexer[layer_id], rows).to(work)           # [nb, 128]
        iq, w = inputs.indexer.q[t0:t1].to(work), inputs.indexer.weights[t0:t1].to(work)       # [n, h, 128], [n, h]
        score = (torch.einsum("thd,sd->ths", iq, idx_keys).relu() * w[..., None]).sum(dim=1)   # [n, nb]
        vis = cm.num_visible[t0:t1, None]
        score = score.masked_fill(torch.arange(nb, device=score.device)[None, :] >= vis, float("-inf"))
        order = score.sort(dim=-1, descending=True, stable=True).indices[:, :k]                # ties -> lower i
        return torch.where(order < vis, rows[order], -1)
