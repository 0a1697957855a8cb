"""DSV4 attention backends: a registry, the interface, and the CPU PyTorch backend.

A backend builds :class:`ForwardMetadata` once per step (``init_forward_metadata``) and then
runs ``forward`` once per attention layer. The metadata is plain int tensors so GPU kernels
can consume the same data (FlashMLA-style window indices, compressed-row tables with lengths).

Per layer, :meth:`TorchDSV4Backend.forward` does, in this order:

1. write the new tokens' KV rows (FP8, 584 B) into the SWA pool;
2. compression (ratio 4 / 128 layers): gather the ring candidates of every block completed in
   this step, write the new tokens' raw (C, Z) into the ring(s) (only the tail future blocks
   still need), compress each completed block from ring + new tokens, and write the row at
   ``full_slot // m`` (C4 KV + indexer row, or C128 KV). Online C128 updates a running
   (max, sum, kv) state per request instead of a ring;
3. CSA: indexer scores over the visible indexer rows (read from the pool), top-k row ids;
4. attention over keys read only from the pools: the query's window rows from the SWA pool,
   then the top-k C4 rows or every visible C128 row, one softmax with the sink.

A prefill chunk and a decode token run the same code (a decode is an extend of one token), so
a chunk boundary anywhere gives identical results. ``dense=True`` is the benchmark baseline:
every layer attends every previous token's stored row, nothing is compressed.

Ring addressing (docs/architecture.md): C4 (and indexer) ring slot of position ``p`` =
``(full_to_swa[full_slot(p)] // 128) * 8 + p % 8``; C128 ring row = ``req_slot * 128 + p % 128``;
online C128 state slot = ``req_slot``; compressed row = ``full_slot(first token of block) // m``.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from memory.configurator import C4_RING, C128_RING, SWA_PAGE
from memory.layout import read_indexer_rows, read_kv_rows, write_indexer_rows, write_kv_rows

from .config import DSV4Config
from .model import AttentionInputs, CompressorInput, hadamard, hi_dtype

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
    def init_forward_metadata(self, batch: ForwardBatch) -> ForwardMetadata:
        """Everything per step that does not depend on a layer (built once per step)."""

    @abstractmethod
    def forward(self, layer_id: int, layer: Any, inputs: AttentionInputs, meta: ForwardMetadata) -> torch.Tensor:
        """One attention layer: writes the step's rows, compresses, attends; -> o [T, H, 512]."""


def _pad_rows(rows: list[torch.Tensor], width: int = 0) -> torch.Tensor:
    """Stack 1-D int64 tensors into [len(rows), max(width, longest)], -1 padded."""
    width = max([width] + [int(r.numel()) for r in rows])
    out = torch.full((len(rows), width), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


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
class _RequestView:
    """The CPU copy of one request's table rows that metadata building reads."""

    slot: int
    prefix: int
    seq_len: int
    offset: int                # first new token's index in the step
    kv_start: int              # first position of ``swa``
    full: torch.Tensor         # [seq_len] full slots of positions 0..
    swa: torch.Tensor          # [seq_len - kv_start] SWA slots of positions kv_start..

    def ring_slot(self, p: torch.Tensor, m: int) -> torch.Tensor:
        """Ring slot (C4: per SWA page) or ring row (C128: per request) of positions ``p``."""
        if m == 128:
            return self.slot * C128_RING + p % C128_RING
        if p.numel() and int(p.min()) < self.kv_start:
            raise RuntimeError(f"request slot {self.slot}: the C4 ring needs position {int(p.min())}, "
                               f"outside the window starting at {self.kv_start}")
        swa = self.swa[(p - self.kv_start).clamp_min(0)]
        return (swa // SWA_PAGE) * C4_RING + p % C4_RING


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
        self.state_dtype = pools.state_dtype
        self.device = pools.device
        ratios = set(cfg.layer_ratios) - {0}
        self.ratios = () if dense else tuple(sorted(ratios))

    # ---- metadata ------------------------------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> ForwardMetadata:
        # Built on the CPU from the rows of the allocator's tables this step touches, then moved
        # to the pools' device in one go.
        req_to_token, full_to_swa = self.tables.req_to_token, self.tables.full_to_swa
        offsets = [0]
        for n in batch.extend_lens:
            offsets.append(offsets[-1] + n)
        views, positions, full, swa, token_req, kv_start, kv_slots = [], [], [], [], [], [], []
        for r, (slot, prefix, n) in enumerate(zip(batch.req_slots, batch.prefix_lens, batch.extend_lens)):
            if n <= 0:
                raise ValueError(f"request {r} (slot {slot}) extends by {n} tokens; every request needs >= 1")
            L = prefix + n
            start = 0 if self.dense else max(0, prefix - self.window + 1)
            f_all = req_to_token[slot, :L].to(torch.int64).cpu()
            ks = full_to_swa[req_to_token[slot, start:L]].to(torch.int64).cpu()   # SWA slots of start..L-1
            if bool((ks < 0).any()):
                missing = (torch.nonzero(ks < 0).flatten() + start).tolist()[:8]
                raise RuntimeError(f"request slot {slot}: positions {missing} of the step's windows have no "
                                   "SWA slot (evicted, or the allocator was not extended before the forward)")
            views.append(_RequestView(slot, prefix, L, offsets[r], start, f_all, ks))
            positions.append(torch.arange(prefix, L, dtype=torch.int64))
            full.append(f_all[prefix:])
            swa.append(ks[prefix - start:])
            token_req.append(torch.full((n,), r, dtype=torch.int64))
            kv_start.append(start)
            kv_slots.append(ks)
        positions_t = torch.cat(positions)
        token_req_t = torch.cat(token_req)
        kv_start_t = torch.tensor(kv_start, dtype=torch.int64)
        kv_slots_t = _pad_rows(kv_slots)
        seq_lens = [v.seq_len for v in views]
        if self.dense:
            window, window_slots = max(seq_lens), None
        else:
            window = self.window
            # query t's window, positions p - W + 1 .. p, as columns of its request's kv_slots row
            col = (positions_t - kv_start_t[token_req_t])[:, None] + torch.arange(-window + 1, 1)[None, :]
            window_slots = torch.where(col >= 0, kv_slots_t[token_req_t[:, None], col.clamp_min(0)], -1)
        meta = ForwardMetadata(
            req_slots=torch.tensor(batch.req_slots, dtype=torch.int64),
            prefix_lens=torch.tensor(batch.prefix_lens, dtype=torch.int64),
            extend_lens=torch.tensor(batch.extend_lens, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            token_offsets=offsets, token_req=token_req_t, positions=positions_t,
            full_slots=torch.cat(full), swa_slots=torch.cat(swa), window=window,
            window_slots=window_slots, kv_start=kv_start_t, kv_slots=kv_slots_t, dense=self.dense,
        )
        for m in self.ratios:
            meta.compressed[m] = self._compressed_meta(m, views, positions_t)
        return _to_device(meta, self.device)

    def _compressed_meta(self, m: int, views: list["_RequestView"], positions: torch.Tensor) -> CompressedMeta:
        online = m == 128 and self.online_compress
        rows, ev_req, ev_block, src_ring, src_new, ring_tok, ring_slot, segs = [], [], [], [], [], [], [], []
        cand = torch.arange(-m, m) if m == 4 else torch.arange(m)   # candidate offsets from i * m
        for r, v in enumerate(views):
            nb = v.seq_len // m
            rows.append(v.full[: nb * m: m] // m)
            if online:
                for b in range(v.prefix // m, (v.seq_len - 1) // m + 1):
                    lo, hi = max(v.prefix, b * m), min(v.seq_len, (b + 1) * m)
                    done = (b + 1) * m <= v.seq_len
                    segs.append((v.slot, torch.arange(lo, hi) - v.prefix + v.offset, b * m >= v.prefix,
                                 int(rows[-1][b]) if done else -1, b * m))
                continue
            blocks = torch.arange(v.prefix // m, nb)
            P = blocks[:, None] * m + cand[None, :]                          # [E_r, n] candidate positions
            old = (P >= 0) & (P < v.prefix)
            src_ring.append(torch.where(old, v.ring_slot(torch.where(old, P, v.seq_len - 1), m), -1))
            src_new.append(torch.where(P >= v.prefix, P - v.prefix + v.offset, -1))
            ev_req.append(torch.full_like(blocks, r))
            ev_block.append(blocks)
            # the tail future blocks read: the open block (and for m = 4 the last complete one)
            tail = max(0, (nb - (1 if m == 4 else 0)) * m)
            p = torch.arange(max(v.prefix, tail), v.seq_len)
            ring_tok.append(p - v.prefix + v.offset)
            ring_slot.append(v.ring_slot(p, m))
        num_visible = (positions + 1) // m
        if online:
            toks = _pad_rows([s[1] for s in segs], width=m)
            seg = OnlineSegments(
                state_slot=torch.tensor([s[0] for s in segs], dtype=torch.int64), tokens=toks,
                fresh=torch.tensor([s[2] for s in segs], dtype=torch.bool),
                row=torch.tensor([s[3] for s in segs], dtype=torch.int64),
                first_pos=torch.tensor([s[4] for s in segs], dtype=torch.int64))
            return CompressedMeta(m, _pad_rows(rows), num_visible, None, None, seg)
        block = torch.cat(ev_block)
        req = torch.cat(ev_req)
        first_row = torch.cat([r_[b] if b.numel() else b for r_, b in zip(rows, ev_block)])
        events = CompressionEvents(req=req, block=block, first_pos=block * m, row=first_row,
                                   src_ring=torch.cat(src_ring), src_new=torch.cat(src_new))
        return CompressedMeta(m, _pad_rows(rows), num_visible, events,
                              RingWrites(torch.cat(ring_tok), torch.cat(ring_slot)))

    # ---- per layer -----------------------------------------------------------------------

    def forward(self, layer_id: int, layer: Any, inputs: AttentionInputs, meta: ForwardMetadata) -> torch.Tensor:
        pools = self.pools
        write_kv_rows(pools.swa_kv[layer_id], meta.swa_slots, inputs.kv)
        ratio = 0 if meta.dense else layer.ratio
        if ratio == 4:
            cm = meta.compressed[4]
            self._compress_ring(layer, layer.compressor, inputs.compressor, cm, pools.c4_ring[layer_id],
                                lambda rows, vals: write_kv_rows(pools.c4_kv[layer_id], rows, vals))
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
        done = seg.row >= 0
        # Only a request's open block carries over (a completed block's successor starts fresh);
        # storing just those keeps the write free of duplicate slots.
        state[seg.state_slot[~done]] = torch.stack([new_max, tot, kv], dim=1)[~done].to(state.dtype)
        if bool(done.any()):
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
            prefix, start = int(meta.prefix_lens[r]), int(meta.kv_start[r])
            seq_len = prefix + t1 - t0
            keys = read_kv_rows(pools.swa_kv[layer_id], meta.kv_slots[r, :seq_len - start]).to(q.dtype)
            comp = None
            if ratio == 128:
                rows = meta.compressed[128].rows[r, :seq_len // 128]
                comp = read_kv_rows(pools.c128_kv[layer_id], rows).to(q.dtype)          # [nb, 512]
            elif ratio == 4:
                sel = self._topk(layer_id, layer, inputs, meta, r)                     # [n, k]
                comp = read_kv_rows(pools.c4_kv[layer_id], sel).to(q.dtype)            # [n, k, 512]
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
        nb = int(meta.seq_lens[r]) // 4
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
