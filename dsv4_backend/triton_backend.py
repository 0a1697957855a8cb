"""The GPU attention backend: the Triton kernels behind the torch backend's metadata.

``TritonDSV4Backend`` (registered as ``"triton"``) subclasses :class:`TorchDSV4Backend` and
reuses its :meth:`init_forward_metadata`: the same :class:`ForwardMetadata` feeds both backends.
It derives its kernels' per-step tables (``_StepPlan``) from the metadata once per step, when the
metadata is built, so a layer's host work is argument plumbing and kernel launches, with no
device reads. Per attention layer it runs, in the torch backend's order:

1. ``kv_store_rows``: the new tokens' rows (normalised and rotated by the model) rounded to FP8
   into the SWA pool;
2. compression of the blocks completed in this step (ring path): the events' ring candidates are
   gathered into a small buffer together with this step's raw (C, Z) *before* the ring write
   (a chunk may overwrite slots its own events read), then ``compress`` pools, normalises,
   rotates (+ Hadamard for the indexer) and quantises each row; online C128 folds the tokens
   with ``online_c128_update`` and finishes the completed blocks with ``finish_rows``;
3. CSA: ``indexer_topk`` per query row over the request's visible indexer rows (page-table
   mode: a 256-token full page is one 64-row indexer page), in query chunks that bound the
   fp32 score buffer;
4. ``sparse_decode`` for every query row of the step: each row is one "request" with its own
   128 window slots and its own extra rows (top-k C4 rows, or every visible C128 row). A step
   whose requests all run the same s_q of 2 .. ``MAX_DRAFT_TOKENS + 1`` rows (a verify, the MTP's
   kept pass) goes through ``sparse_verify`` instead when ``DSV4_VERIFY_KERNEL=1`` (off by
   default: on the H200 it was no faster, docs/PERF.md "Session 8"): the same results, one launch of batch x s_q rows whose programs share window and C128
   reads between rows where the heads per GPU leave room (docs/kernels.md section 4b).

Step 4 is also the prefill path (issue 6 item 5, sparse variant): a prefill chunk of n tokens is
n independent decode rows. It is correct but not prefill-efficient: each row dequantises its
128 window rows itself (adjacent queries share 127 of them), so a chunk reads ~n x (128 + k)
rows where a prefill kernel sharing key tiles between query rows would read ~(n + 128 + k').
Inverse RoPE and the grouped output projection stay in torch (the model runs them); fusing the
inverse RoPE into the attention epilogue would save one [T, H, 64] pass, the grouped projection
is a plain batched GEMM already.

Precision: the kernels compute in fp32 (interpreter) or bf16 operands with fp32 accumulation
(GPU); the attention output comes back as bf16 on the GPU even in float32 engine mode. float64
is refused: use the torch backend for exact runs. Dense mode (the per-token-cache baseline)
attends each query's previous rows through the same kernel. A bf16 online-C128 state (the
kernel keeps fp32 state) falls back to the torch update for that step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from memory.configurator import COMPRESSED_PAGE, FULL_PAGE
from memory.upload import upload

from .backend import (
    CompressedMeta, ForwardMetadata, TorchDSV4Backend, register_attention_backend,
)
from .config import DSV4Config
from .model import AttentionInputs, CompressorInput, hadamard_matrix
from .online_history import record_online_history

# A CSA layer's attention and indexer compressors in one ring-write and one compress launch
# (``_compress_c4_pair``) instead of two each; DSV4_C4_PAIR=0 keeps four launches (A/B timing).
USE_C4_PAIR = os.environ.get("DSV4_C4_PAIR", "1") != "0"

logger = logging.getLogger(__name__)


def _kernels():
    """The kernels package, imported on first use (importing it pulls in triton)."""
    from . import kernels
    return kernels


@dataclass
class _RingPlan:
    """One ratio's ring events, re-addressed for the pooling kernel.

    The kernel reads every candidate from one state buffer: ``[ring[gather] ; new (C, Z)]``,
    so ``sources[e, j]`` is an index into that concatenation (-1 = masked candidate)."""

    dest_rows: torch.Tensor   # [E] (< 0: a masked event, static decode only)
    first_pos: torch.Tensor   # [E] RoPE position of each row
    gather: Optional[torch.Tensor]  # [G] ring slots the events read; None: sources are ring slots
    sources: torch.Tensor     # int32 [E, K]
    ring_token: torch.Tensor  # [W] new-token index of each ring write
    ring_slot: torch.Tensor   # [W]


def _state_buffer(rp: _RingPlan, ring: torch.Tensor, raw: CompressorInput, n_events: int) -> Optional[torch.Tensor]:
    """The buffer a compress launch reads its candidates from, built before the step's ring write
    (None when no event completes). A static decode step (StaticDecode) has one event per row,
    masked by dest_rows < 0, whose sources are ring slots: a decode token's slot held position
    p - 8 (C4) or p - 128 (C128), never a candidate of its block, so the ring is written first and
    then read in place. Otherwise the candidates are gathered from the ring, then the new (C, Z)
    appended, before the ring write can overwrite their slots."""
    if rp.gather is None:
        return ring
    if not n_events:
        return None
    return torch.cat([ring[rp.gather], torch.cat([raw.c, raw.z], dim=-1).to(ring.dtype)])


@dataclass
class _OnlinePlan:
    token_start: torch.Tensor  # int32 [R]
    token_count: torch.Tensor  # int32 [R]
    done_tokens: torch.Tensor  # [D] tokens at position % 128 == 127
    dest_rows: torch.Tensor    # [D]
    first_pos: torch.Tensor    # [D]


@dataclass
class _StepPlan:
    """Per-step tensors derived once from the metadata (shared by every layer)."""

    window_slots: torch.Tensor                 # int32 [T, W]
    # s_q when every request of the step runs s_q > 1 consecutive rows (a verify: k + 1) and the
    # s_q-row kernel may take them; 1: each row runs as its own decode row
    rows_per_request: int = 1
    rings: dict[int, _RingPlan] = field(default_factory=dict)
    online: Optional[_OnlinePlan] = None
    c4_pages: Optional[torch.Tensor] = None    # int32 [T, pages] indexer pages of each query's request
    c4_visible: Optional[torch.Tensor] = None  # int32 [T]
    c4_len: int = 0                            # longest request's C4 row count this step
    c128_rows: Optional[torch.Tensor] = None   # int32 [T, nb] visible C128 rows, -1 padded
    # HiSparse: each query row's request slot (-1: a padded static row), and whether every
    # request has one query row (decode: the rows go through request buffers, else staging)
    hs_owners: Optional[torch.Tensor] = None   # int64 [T]
    hs_decode: bool = False
    # fp32 RoPE (cos, sin) of the rows finished this step, per (ratio, rope frequencies)
    cos_sin: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


# ---- per-step tables shared by ordinary and static steps ------------------------------------

def _dense_window(meta: ForwardMetadata, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Dense mode's key list of query rows whose requests are ``meta``'s ``rows``, at positions
    ``pos``: every previous position's SWA slot, -1 padded."""
    col = torch.arange(meta.kv_slots.shape[1], device=pos.device)
    key_pos = meta.kv_start[rows][:, None] + col[None, :]
    return torch.where(key_pos <= pos[:, None], meta.kv_slots[rows], -1)


def _verify_kernel_wanted(device: torch.device) -> bool:
    """``DSV4_VERIFY_KERNEL=1``: steps of s_q > 1 rows per request run the s_q-row kernel
    (``kernels/verify_attention.py``); ``0`` (the default): every row through the one-row decode
    kernel, which the H200 measured as fast or faster at Flash's 64 heads per GPU (docs/PERF.md,
    "Session 8"; the interpreter runs either, the tests set it)."""
    value = os.environ.get("DSV4_VERIFY_KERNEL")
    if value is None:
        return False
    if value not in ("0", "1"):
        raise ValueError(f"DSV4_VERIFY_KERNEL must be 0 or 1, got {value!r}")
    return value == "1"


def _uniform_rows(extend_lens: list[int], dense: bool) -> int:
    """s_q for the s_q-row kernel: every request's row count when they are equal and 2 ..
    MAX_DRAFT_TOKENS + 1 (a verify's, not a prefill chunk's), else 1. Dense mode lists whole
    contexts, not windows: 1."""
    from .rollback import MAX_DRAFT_TOKENS
    if dense or not extend_lens or len(set(extend_lens)) != 1:
        return 1
    n = extend_lens[0]
    return n if 1 < n <= MAX_DRAFT_TOKENS + 1 else 1


def _indexer_fp8_wanted() -> bool:
    """``DSV4_INDEXER_FP8=1``: indexer scores on FP8 tensor cores (as DeepGEMM's logits kernel,
    which SGLang uses). The kernel is 1.45x faster at b32 1M and 2.3x on a prefill slice; on the
    H200 a 512K prefill took 150.6 s instead of 168.1 s, while 1M x 6 decode did not change
    (the per-layer FP8 re-encoding of q offsets the gain). Hopper keeps ~14 mantissa bits of
    each 128-deep sum, so scores differ from the CPU's by up to ~2^-16 of the summed magnitudes
    and a near-tie may select differently. Off by default: the bf16 path's sums are exact in fp32.
    Needs a GPU; under the interpreter the request is ignored with a warning."""
    if os.environ.get("DSV4_INDEXER_FP8", "0") != "1":
        return False
    from .kernels._common import interpreting
    if interpreting():
        logger.warning("DSV4_INDEXER_FP8=1 needs a GPU; the interpreter runs the bf16 indexer")
        return False
    return True


def _c4_pages(rows: torch.Tensor) -> torch.Tensor:
    """Indexer page table from C4 block rows [R, blocks]: a 256-token full page is one 64-row page."""
    return rows[:, ::COMPRESSED_PAGE] // COMPRESSED_PAGE


def _visible_rows(rows: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Block rows [N, blocks] with the entries past each row's ``visible`` count set to -1."""
    nb = torch.arange(rows.shape[1], device=rows.device)
    return torch.where(nb[None, :] < visible[:, None], rows, -1)


# ---- static decode steps (CUDA graphs) ------------------------------------------------------

@dataclass
class StaticDecode:
    """Fixed-address buffers of a step of ``bs`` requests with ``q`` rows each (q = 1: a decode;
    q = k + 1: a speculative verify of k drafts) over contexts up to ``ctx``.

    A captured CUDA graph reads only these, so a replay is: :meth:`TritonDSV4Backend.fill_static_decode`
    copies the step's values in, then the graph runs. Rows past the step's tokens repeat token 0
    with every write masked (SWA slot -1, compressed destination -1, online token count 0)
    except the ring write, which stores token 0's own value at token 0's slot again."""

    bs: int
    ctx: int
    input_ids: torch.Tensor     # int64 [bs * q]
    meta: ForwardMetadata       # positions, req_slots, swa_slots: static tensors
    plan: _StepPlan             # the per-layer tables, static tensors
    q: int = 1


class _StaticDecodeMixin:
    """StaticDecode construction and filling for :class:`TritonDSV4Backend`."""

    def static_max_rows(self) -> int:
        """The most rows per request a static step takes. Its ring write comes before the
        compression reads the ring in place, so a row at position w (overwriting position
        w - R's slot) must not clobber a candidate p - 7 .. p (C4) or p - 127 .. p (C128) of an
        event at p >= n: n + q - 1 - R < n - span, i.e. q <= R - span (R the ring per request /
        SWA page; 1 without speculation's doubled rings, 9 with them). The online C128 fold and
        dense mode take one row."""
        if self.dense or self.online_compress:
            return 1
        spans = {4: (self.c4_ring, 7), 128: (self.c128_ring, 127)}
        return min([ring - span for m, (ring, span) in spans.items() if m in self.ratios] or [1 << 10])

    def static_decode(self, bs: int, ctx: int, q: int = 1) -> StaticDecode:
        """Allocate the buffers of a step of ``bs`` requests of ``q`` rows, contexts <= ``ctx``
        (a multiple of 256): C4 page tables of ctx / 256 pages, C128 row lists of ctx / 128
        rows, and in dense mode a window of ctx slots."""
        if ctx % FULL_PAGE:
            raise ValueError(f"ctx must be a multiple of {FULL_PAGE}, got {ctx}")
        if not 1 <= q <= self.static_max_rows():
            raise ValueError(f"a static step takes 1..{self.static_max_rows()} rows per request here, got q={q}")
        dev, i32, i64 = self.device, torch.int32, torch.int64
        zeros = lambda *shape, dtype=i64: torch.zeros(shape, dtype=dtype, device=dev)  # noqa: E731
        T = bs * q
        rows = torch.arange(bs, device=dev)
        width = ctx if self.dense else self.window
        plan = _StepPlan(zeros(T, width, dtype=i32), rows_per_request=_uniform_rows([q] * bs, self.dense))
        meta = ForwardMetadata(
            req_slots=zeros(bs), prefix_lens=zeros(bs), extend_lens=torch.full((bs,), q, dtype=i64, device=dev),
            seq_lens=zeros(bs), token_offsets=list(range(0, T + 1, q)),
            token_req=rows.repeat_interleave(q), positions=zeros(T),
            full_slots=zeros(T), swa_slots=zeros(T), window=width,
            window_slots=None if self.dense else plan.window_slots,   # one buffer: the plan's
            kv_start=zeros(bs), kv_slots=zeros(bs, 0), dense=self.dense)
        for m in self.ratios:
            if m == 128 and self.online_compress:     # q == 1: a token per request
                plan.online = _OnlinePlan(rows.to(i32), zeros(bs, dtype=i32), rows, zeros(bs), zeros(bs))
            else:
                k = 2 * m if m == 4 else m
                plan.rings[m] = _RingPlan(zeros(T), zeros(T), None, zeros(T, k, dtype=i32), zeros(T), zeros(T))
            if m == 4:
                plan.c4_len = ctx // 4
                plan.c4_pages = zeros(T, ctx // FULL_PAGE, dtype=i32)
                plan.c4_visible = zeros(T, dtype=i32)
            else:
                plan.c128_rows = zeros(T, ctx // 128, dtype=i32)
        if self.hisparse is not None:
            plan.hs_owners, plan.hs_decode = zeros(T), True
        return StaticDecode(bs, ctx, zeros(T), meta, plan, q)

    def use_static_decode(self, st: StaticDecode) -> None:
        """Make ``forward`` read ``st``'s tables (for the warm-up and the capture); clears the
        per-step RoPE cache so a capture records its computation instead of a stale result."""
        st.plan.cos_sin.clear()
        self._plan_meta, self._plan = st.meta, st.plan

    @torch.no_grad()
    def fill_static_decode(self, req_slots: list[int], prefix_lens: list[int], input_ids: list[int] | torch.Tensor,
                           st: StaticDecode, prev_ids: Optional[torch.Tensor] = None, count_tokens: bool = True,
                           compressed: bool = True) -> None:
        """Fill ``st`` for a step in which request ``req_slots[i]`` runs ``st.q`` rows from
        position ``prefix_lens[i]``: one upload of the step's ints and one kernel
        (``kernels/static_tables.py``), which reads the slot tables on the device. ``input_ids``:
        the rows' ids, host ints (placeholders ``-(i + 1)`` for ``prev_ids[i]``) or a device
        tensor. ``count_tokens=False`` gives every row an online-C128 token count of 0: the
        warm-up before a capture then leaves the online state untouched (every other write of
        the step is idempotent). ``compressed=False`` fills only the window part (the MTP
        layer's static steps; the compressed tables keep what they held and must not be read)."""
        B, q = len(req_slots), st.q
        seqs = [p + q for p in prefix_lens]
        if not 0 < B <= st.bs or min(prefix_lens) < 0 or max(seqs) > st.ctx:
            raise ValueError(f"a step of {B} requests x {q} rows, contexts <= {max(seqs, default=0)}, does not fit "
                             f"a static step of {st.bs} requests x {q} rows, contexts <= {st.ctx}")
        starts = [0 if self.dense else max(0, p - self.window + 1) for p in prefix_lens]
        self.check_windows(req_slots, starts, seqs)
        host = [req_slots, prefix_lens]
        if not isinstance(input_ids, torch.Tensor):
            host.append(list(input_ids))
        packed = upload(torch.tensor([v for part in host for v in part], dtype=torch.int64), self.device)
        ids = input_ids if isinstance(input_ids, torch.Tensor) else packed[2 * B:]
        plan, sm = st.plan, st.meta
        out = {"input_ids": st.input_ids, "positions": sm.positions, "req_slots": sm.req_slots,
               "swa_slots": sm.swa_slots, "window_slots": plan.window_slots, "hs_owners": plan.hs_owners}
        for m in self.ratios if compressed else ():
            if m == 128 and self.online_compress:
                out["online"] = (plan.online.token_count, plan.online.dest_rows, plan.online.first_pos)
            else:
                rp = plan.rings[m]
                out[f"c{m}"] = (rp.dest_rows, rp.first_pos, rp.sources, rp.ring_token, rp.ring_slot)
            if m == 4:
                out["c4_pages"], out["c4_visible"] = plan.c4_pages, plan.c4_visible
            else:
                out["c128_rows"] = plan.c128_rows
        _kernels().static_fill(packed[:2 * B].view(2, B), ids.reshape(-1), prev_ids, self.tables.req_to_token,
                               self.tables.full_to_swa, q, out, self.window, dense=self.dense, c4_ring=self.c4_ring,
                               c128_ring=self.c128_ring, count_tokens=count_tokens)


@register_attention_backend("triton")
class TritonDSV4Backend(_StaticDecodeMixin, TorchDSV4Backend):
    """DSV4 attention through the Triton kernels (CUDA, or the CPU under ``TRITON_INTERPRET=1``)."""

    # fp32 score elements per indexer launch: bounds the [rows, L] buffer at long context
    INDEXER_SCORE_BUDGET = 1 << 26

    def __init__(self, cfg: DSV4Config, pools: Any, tables: Any, dtype: torch.dtype = torch.float32,
                 dense: bool = False):
        if dtype == torch.float64:
            raise ValueError("the triton backend computes in fp32 / bf16; use backend='torch' for float64")
        super().__init__(cfg, pools, tables, dtype=dtype, dense=dense)
        plan = pools.plan
        if getattr(plan, "full_page", FULL_PAGE) != 4 * COMPRESSED_PAGE and 4 in self.ratios:
            raise ValueError(f"the indexer kernel reads C4 rows by page: it needs full pages of "
                             f"{4 * COMPRESSED_PAGE} tokens, the plan has {plan.full_page}")
        self.round_bf16 = dtype == torch.bfloat16
        self.indexer_fp8 = _indexer_fp8_wanted()
        self.verify_kernel = _verify_kernel_wanted(self.device)
        if self.hisparse is not None:   # rows move by kernel: on CUDA it reads pinned host memory in place
            from .kernels.row_copy import host_copy_works
            if self.device.type != "cuda" or host_copy_works(self.device):
                self.hisparse.copy_rows = _kernels().copy_rows
            self.hisparse.lookup = _kernels().hisparse_lookup
        self._plan_meta: Optional[ForwardMetadata] = None
        self._plan: Optional[_StepPlan] = None

    # ---- per step ------------------------------------------------------------------------

    def init_forward_metadata(self, batch: Any, events: bool = True) -> ForwardMetadata:
        meta = super().init_forward_metadata(batch, events)
        self._step_plan(meta)
        return meta

    def _step_plan(self, meta: ForwardMetadata) -> _StepPlan:
        if self._plan_meta is meta:
            return self._plan
        i32 = torch.int32
        pos, treq = meta.positions, meta.token_req
        if meta.window_slots is not None:
            window = meta.window_slots.to(i32).contiguous()
        else:  # dense: every previous position of the request
            window = _dense_window(meta, treq, pos).to(i32).contiguous()
        plan = _StepPlan(window, rows_per_request=_uniform_rows(meta.host.extend_lens, self.dense)
                         if meta.host is not None else 1)
        for m, cm in meta.compressed.items():
            if cm.online is not None:
                plan.online = self._online_plan(meta, cm)
            elif cm.events is not None:
                plan.rings[m] = self._ring_plan(cm)
            visible = cm.num_visible
            if m == 4:
                plan.c4_len = int(cm.rows.shape[1])
                plan.c4_pages = _c4_pages(cm.rows)[treq].to(i32).contiguous()
                plan.c4_visible = visible.to(i32).contiguous()
            else:
                plan.c128_rows = _visible_rows(cm.rows[treq], visible).to(i32).contiguous()
        if self.hisparse is not None:
            plan.hs_owners = meta.req_slots[treq]
            plan.hs_decode = len(meta.token_offsets) - 1 == pos.shape[0]
        self._plan_meta, self._plan = meta, plan
        return plan

    @staticmethod
    def _ring_plan(cm: CompressedMeta) -> _RingPlan:
        ev, wr = cm.events, cm.ring_writes
        flat_ring, flat_new = ev.src_ring.reshape(-1), ev.src_new.reshape(-1)
        from_ring = flat_ring >= 0
        # host-built candidate list when present: a boolean-mask gather would read the device
        gather = flat_ring[ev.ring_cand] if ev.ring_cand is not None else flat_ring[from_ring]
        in_buf = torch.cumsum(from_ring.to(torch.int64), 0) - 1
        sources = torch.where(from_ring, in_buf,
                              torch.where(flat_new >= 0, gather.numel() + flat_new, -1))
        return _RingPlan(ev.row, ev.first_pos, gather, sources.view(ev.src_ring.shape).to(torch.int32),
                         wr.token, wr.slot)

    @staticmethod
    def _online_plan(meta: ForwardMetadata, cm: CompressedMeta) -> _OnlinePlan:
        ext = meta.extend_lens
        starts = (torch.cumsum(ext, 0) - ext).to(torch.int32)
        seg = cm.online
        if seg.done_token is not None:   # host-built: tokens at position % 128 == 127, in order
            return _OnlinePlan(starts, ext.to(torch.int32), seg.done_token, seg.row[seg.done_idx],
                               seg.first_pos[seg.done_idx])
        pos = meta.positions
        done = torch.nonzero((pos + 1) % 128 == 0).flatten()
        dest = cm.rows[meta.token_req[done], pos[done] // 128]
        return _OnlinePlan(starts, ext.to(torch.int32), done, dest, pos[done] - 127)

    @staticmethod
    def _cos_sin(plan: _StepPlan, m: int, rope: Any, first_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 RoPE of this step's finished rows, computed once per step for every layer whose
        rope has the same frequencies (every compressed layer shares one)."""
        inv = rope.inv_freq
        # reading a CPU tensor's values costs no device sync; a device one is keyed by identity
        key = (m, tuple(inv.tolist())) if inv.device.type == "cpu" else (m, id(rope))
        if key not in plan.cos_sin:
            plan.cos_sin[key] = rope.cos_sin(first_pos, torch.float32)
        return plan.cos_sin[key]

    # ---- per layer -----------------------------------------------------------------------

    def forward(self, layer_id: int, layer: Any, inputs: AttentionInputs, meta: ForwardMetadata) -> torch.Tensor:
        K = _kernels()
        pools = self.pools
        plan = self._step_plan(meta)
        if not inputs.kv_stored:
            K.kv_store_rows(pools.swa_kv[layer_id], meta.swa_slots, inputs.kv.contiguous())
        ratio = 0 if meta.dense else layer.ratio
        extra_pool = extra_rows = None
        if ratio == 4:
            ring = plan.rings[4]
            hadamard = hadamard_matrix(128, torch.float32, inputs.q.device)
            if self.hisparse is None and self._c4_pair_applies(layer, layer_id):
                self._compress_c4_pair(plan, layer, layer_id, inputs, hadamard)
            else:
                self._compress(plan, 4, layer, layer.compressor, inputs.compressor, ring, pools.c4_ring[layer_id],
                               pools.c4_kv[layer_id], None,
                               hisparse_layer=None if self.hisparse is None else layer_id)
                self._compress(plan, 4, layer, layer.indexer.compressor, inputs.indexer.compressor, ring,
                               pools.c4_indexer_ring[layer_id], pools.c4_indexer[layer_id], hadamard)
            extra_pool, extra_rows = pools.c4_kv[layer_id], self._select(layer_id, inputs, plan)
            if self.hisparse is not None:
                return self._hisparse_attention(layer_id, layer, inputs, meta, plan, extra_rows)
        elif ratio == 128:
            if plan.online is not None:
                self._compress_online_kernel(plan, layer, layer_id, inputs.compressor, meta, plan.online)
            else:
                self._compress(plan, 128, layer, layer.compressor, inputs.compressor, plan.rings[128],
                               pools.c128_ring[layer_id], pools.c128_kv[layer_id], None)
            extra_pool, extra_rows = pools.c128_kv[layer_id], plan.c128_rows
        q = inputs.q.to(torch.bfloat16) if inputs.q.is_cuda else inputs.q
        out = self._sparse_attention(ratio, q.contiguous(), pools.swa_kv[layer_id], plan, extra_pool, extra_rows,
                                     layer.attn_sink.float())
        return out.to(inputs.q.dtype)

    def _sparse_attention(self, ratio: int, q: torch.Tensor, swa_pool: torch.Tensor, plan: _StepPlan,
                          extra_pool: Optional[torch.Tensor], extra_rows: Optional[torch.Tensor],
                          attn_sink: torch.Tensor) -> torch.Tensor:
        """Attention of every query row ``q [T, h, 512]`` over its window and extra rows: [T, h, 512].
        ``ratio`` (0 SWA-only, 4, 128) names the layer kind; subclasses swap the kernel here.
        Steps of s_q rows per request (``plan.rows_per_request``) take the s_q-row kernel when
        ``verify_kernel``; a C128 layer's rows share their list (visible rows, -1 past each row's)."""
        s_q = plan.rows_per_request
        if self.verify_kernel and s_q > 1 and q.shape[0] % s_q == 0:
            return _kernels().sparse_verify(q, swa_pool, plan.window_slots, extra_pool, extra_rows, attn_sink,
                                            self.cfg.softmax_scale, s_q, shared_extra=ratio == 128).out
        return _kernels().sparse_decode(q, swa_pool, plan.window_slots, extra_pool, extra_rows, attn_sink,
                                        self.cfg.softmax_scale).out

    def _hisparse_attention(self, layer_id: int, layer: Any, inputs: AttentionInputs, meta: ForwardMetadata,
                            plan: _StepPlan, sel: torch.Tensor) -> torch.Tensor:
        """CSA attention under HiSparse: the selected full rows ``sel [T, k]`` made resident, the
        kernel handed device rows. Decode swaps into the request buffers; other steps stage the
        rows in query blocks that run one after another (query rows are independent, so the
        results are those of one pass)."""
        hs = self.hisparse
        q = inputs.q.to(torch.bfloat16) if inputs.q.is_cuda else inputs.q
        q, sink, swa = q.contiguous(), layer.attn_sink.float(), self.pools.swa_kv[layer_id]
        blocks = hs.blocks(sel.shape[0], sel.shape[1])
        if plan.hs_decode or len(blocks) == 1:
            rows = hs.swap_in(layer_id, sel, plan.hs_owners) if plan.hs_decode else hs.stage(layer_id, sel)
            out = self._sparse_attention(4, q, swa, plan, hs.device_kv[layer_id], rows, sink)
        else:
            parts = []
            for lo, hi in blocks:
                rows = hs.stage(layer_id, sel[lo:hi])
                # (a block may cut a request's rows: each row its own decode row)
                part = dataclasses.replace(plan, window_slots=plan.window_slots[lo:hi], rows_per_request=1)
                # the Triton kernel itself: a subclass's per-step caches are sized for the whole step
                parts.append(TritonDSV4Backend._sparse_attention(self, 4, q[lo:hi], swa, part,
                                                                 hs.device_kv[layer_id], rows, sink))
            out = torch.cat(parts)
        return out.to(inputs.q.dtype)

    def _compress(self, plan: _StepPlan, m: int, layer: Any, compressor: Any, raw: CompressorInput,
                  ring_plan: _RingPlan, ring: torch.Tensor, pool: torch.Tensor,
                  hadamard: Optional[torch.Tensor], hisparse_layer: Optional[int] = None) -> None:
        """Ring path: pool the completed blocks, write the ring tail, finish the rows.
        ``hisparse_layer``: the rows go through the HiSparse hot pool to the host pool."""
        K = _kernels()
        rp = ring_plan
        n_events = int(rp.dest_rows.numel())
        buf = _state_buffer(rp, ring, raw, n_events)
        if rp.ring_token.numel():
            K.ring_write(ring, rp.ring_slot, raw.c, raw.z, rp.ring_token)
        if n_events:
            cos, sin = self._cos_sin(plan, m, layer.rope, rp.first_pos)

            def run(dest_pool: torch.Tensor, dest: torch.Tensor, part: slice = slice(None)) -> None:
                K.compress(dest_pool, K.CompressEvents(dest, rp.sources[part], cos[part], sin[part]), buf,
                           compressor.ape, compressor.norm.weight, compressor.ratio, eps=compressor.norm.eps,
                           round_bf16=self.round_bf16, hadamard=hadamard)

            if hisparse_layer is None:
                run(pool, rp.dest_rows)
            else:
                self.hisparse.write_rows(hisparse_layer, rp.dest_rows, run)

    def swa_store(self, layer_id: int, meta: ForwardMetadata) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        return self.pools.swa_kv[layer_id], meta.swa_slots

    def _c4_pair_applies(self, layer: Any, layer_id: int) -> bool:
        """Whether a CSA layer's two compressors run as one ring write and one compress launch:
        ``USE_C4_PAIR``, rings of one dtype and norms of one epsilon (as in every DeepSeek-V4 config)."""
        a, b = layer.compressor, layer.indexer.compressor
        return (USE_C4_PAIR and a.norm.eps == b.norm.eps
                and self.pools.c4_ring[layer_id].dtype == self.pools.c4_indexer_ring[layer_id].dtype)

    def _compress_c4_pair(self, plan: _StepPlan, layer: Any, layer_id: int, inputs: AttentionInputs,
                          hadamard: torch.Tensor) -> None:
        """``_compress`` of the attention and the indexer compressor (one ring plan) in two launches
        instead of four: ``ring_write_pair`` and ``compress_c4_pair``, the same programs' work."""
        K, pools, rp = _kernels(), self.pools, plan.rings[4]
        a, b = layer.compressor, layer.indexer.compressor
        raw_a, raw_b = inputs.compressor, inputs.indexer.compressor
        ring_a, ring_b = pools.c4_ring[layer_id], pools.c4_indexer_ring[layer_id]
        n_events = int(rp.dest_rows.numel())
        buf_a, buf_b = _state_buffer(rp, ring_a, raw_a, n_events), _state_buffer(rp, ring_b, raw_b, n_events)
        if rp.ring_token.numel():
            K.ring_write_pair((ring_a, ring_b), rp.ring_slot, (raw_a.c, raw_b.c), (raw_a.z, raw_b.z), rp.ring_token)
        if n_events:
            cos, sin = self._cos_sin(plan, 4, layer.rope, rp.first_pos)
            K.compress_c4_pair(K.C4Target(pools.c4_kv[layer_id], buf_a, a.ape, a.norm.weight),
                               K.C4Target(pools.c4_indexer[layer_id], buf_b, b.ape, b.norm.weight, hadamard),
                               K.CompressEvents(rp.dest_rows, rp.sources, cos, sin), eps=a.norm.eps,
                               round_bf16=self.round_bf16)

    def _compress_online_kernel(self, plan: _StepPlan, layer: Any, layer_id: int, raw: CompressorInput,
                                meta: ForwardMetadata, op: _OnlinePlan) -> None:
        state = self.pools.c128_online[layer_id]
        if state.dtype != torch.float32:  # the kernel keeps an fp32 running state
            write = lambda rows, vals: self._write_c128(layer_id, rows, vals)  # noqa: E731
            self._compress_online(layer, raw, meta.compressed[128].online, state, meta.positions, write)
            return
        K = _kernels()
        comp = layer.compressor
        cm = meta.compressed.get(128)
        hist = cm.online.history if cm is not None and cm.online is not None else None   # None when static
        if hist is not None:    # a verify: the states after each of its positions, before the kernel's fold
            record_online_history(state, hist, raw.c.float(),
                                  raw.z.float() + comp.ape.float()[meta.positions % 128])
        cz = torch.cat([raw.c, raw.z], dim=-1).float()
        pooled = K.online_c128_update(state, meta.req_slots, op.token_start, op.token_count, cz,
                                      meta.positions, comp.ape)
        if op.done_tokens.numel():
            cos, sin = self._cos_sin(plan, 128, layer.rope, op.first_pos)
            K.finish_rows(self.pools.c128_kv[layer_id], op.dest_rows, pooled[op.done_tokens],
                          comp.norm.weight, cos, sin, comp.norm.eps, round_in=self.round_bf16,
                          round_bf16=self.round_bf16)

    def _write_c128(self, layer_id: int, rows: torch.Tensor, vals: torch.Tensor) -> None:
        from memory.layout import write_kv_rows
        write_kv_rows(self.pools.c128_kv[layer_id], rows, vals)

    def _select(self, layer_id: int, inputs: AttentionInputs, plan: _StepPlan) -> torch.Tensor:
        """CSA top-k C4 rows per query row: int32 [T, index_topk], -1 padded."""
        K = _kernels()
        k, L = self.cfg.index_topk, plan.c4_len
        iq, w = inputs.indexer.q, inputs.indexer.weights.float()
        T = iq.shape[0]
        if L == 0:
            return torch.full((T, k), -1, dtype=torch.int32, device=iq.device)
        pool = self.pools.c4_indexer[layer_id]
        step = max(1, self.INDEXER_SCORE_BUDGET // L)
        parts = []
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            parts.append(K.indexer_topk(iq[t0:t1].contiguous(), w[t0:t1], pool, k,
                                        page_table=plan.c4_pages[t0:t1], num_visible=plan.c4_visible[t0:t1],
                                        max_len=L, q_fp8=self.indexer_fp8).rows)
        return parts[0] if len(parts) == 1 else torch.cat(parts)
