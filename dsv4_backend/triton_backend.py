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
   128 window slots and its own extra rows (top-k C4 rows, or every visible C128 row).

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

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from memory.configurator import COMPRESSED_PAGE, FULL_PAGE

from .backend import (
    CompressedMeta, ForwardMetadata, TorchDSV4Backend, register_attention_backend,
)
from .config import DSV4Config
from .model import AttentionInputs, CompressorInput, hadamard_matrix


def _kernels():
    """The kernels package, imported on first use (importing it pulls in triton)."""
    from . import kernels
    return kernels


@dataclass
class _RingPlan:
    """One ratio's ring events, re-addressed for the pooling kernel.

    The kernel reads every candidate from one state buffer: ``[ring[gather] ; new (C, Z)]``,
    so ``sources[e, j]`` is an index into that concatenation (-1 = masked candidate)."""

    dest_rows: torch.Tensor   # [E]
    first_pos: torch.Tensor   # [E] RoPE position of each row
    gather: torch.Tensor      # [G] ring slots the events read
    sources: torch.Tensor     # int32 [E, K]
    ring_token: torch.Tensor  # [W] new-token index of each ring write
    ring_slot: torch.Tensor   # [W]


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
    rings: dict[int, _RingPlan] = field(default_factory=dict)
    online: Optional[_OnlinePlan] = None
    c4_pages: Optional[torch.Tensor] = None    # int32 [T, pages] indexer pages of each query's request
    c4_visible: Optional[torch.Tensor] = None  # int32 [T]
    c4_len: int = 0                            # longest request's C4 row count this step
    c128_rows: Optional[torch.Tensor] = None   # int32 [T, nb] visible C128 rows, -1 padded
    # fp32 RoPE (cos, sin) of the rows finished this step, per (ratio, rope frequencies)
    cos_sin: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@register_attention_backend("triton")
class TritonDSV4Backend(TorchDSV4Backend):
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
        self._plan_meta: Optional[ForwardMetadata] = None
        self._plan: Optional[_StepPlan] = None

    # ---- per step ------------------------------------------------------------------------

    def init_forward_metadata(self, batch: Any) -> ForwardMetadata:
        meta = super().init_forward_metadata(batch)
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
            col = torch.arange(meta.kv_slots.shape[1], device=pos.device)
            key_pos = meta.kv_start[treq][:, None] + col[None, :]
            window = torch.where(key_pos <= pos[:, None], meta.kv_slots[treq], -1).to(i32).contiguous()
        plan = _StepPlan(window)
        for m, cm in meta.compressed.items():
            if cm.online is not None:
                plan.online = self._online_plan(meta, cm)
            elif cm.events is not None:
                plan.rings[m] = self._ring_plan(cm)
            visible = cm.num_visible
            if m == 4:
                plan.c4_len = int(cm.rows.shape[1])
                pages = cm.rows[:, ::COMPRESSED_PAGE] // COMPRESSED_PAGE      # [R, pages]
                plan.c4_pages = pages[treq].to(i32).contiguous()
                plan.c4_visible = visible.to(i32).contiguous()
            else:
                nb = torch.arange(cm.rows.shape[1], device=pos.device)
                rows = cm.rows[treq]
                plan.c128_rows = torch.where(nb[None, :] < visible[:, None], rows, -1).to(i32).contiguous()
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
        K.kv_store_rows(pools.swa_kv[layer_id], meta.swa_slots, inputs.kv.contiguous())
        ratio = 0 if meta.dense else layer.ratio
        extra_pool = extra_rows = None
        if ratio == 4:
            ring = plan.rings[4]
            self._compress(plan, 4, layer, layer.compressor, inputs.compressor, ring, pools.c4_ring[layer_id],
                           pools.c4_kv[layer_id], None)
            self._compress(plan, 4, layer, layer.indexer.compressor, inputs.indexer.compressor, ring,
                           pools.c4_indexer_ring[layer_id], pools.c4_indexer[layer_id],
                           hadamard_matrix(128, torch.float32, inputs.q.device))
            extra_pool, extra_rows = pools.c4_kv[layer_id], self._select(layer_id, inputs, plan)
        elif ratio == 128:
            if plan.online is not None:
                self._compress_online_kernel(plan, layer, layer_id, inputs.compressor, meta, plan.online)
            else:
                self._compress(plan, 128, layer, layer.compressor, inputs.compressor, plan.rings[128],
                               pools.c128_ring[layer_id], pools.c128_kv[layer_id], None)
            extra_pool, extra_rows = pools.c128_kv[layer_id], plan.c128_rows
        q = inputs.q.to(torch.bfloat16) if inputs.q.is_cuda else inputs.q
        res = K.sparse_decode(q.contiguous(), pools.swa_kv[layer_id], plan.window_slots, extra_pool, extra_rows,
                              layer.attn_sink.float(), self.cfg.softmax_scale)
        return res.out.to(inputs.q.dtype)

    def _compress(self, plan: _StepPlan, m: int, layer: Any, compressor: Any, raw: CompressorInput,
                  ring_plan: _RingPlan, ring: torch.Tensor, pool: torch.Tensor,
                  hadamard: Optional[torch.Tensor]) -> None:
        """Ring path: pool the completed blocks, write the ring tail, finish the rows."""
        K = _kernels()
        rp = ring_plan
        cz = torch.cat([raw.c, raw.z], dim=-1).to(ring.dtype)                # [T, 2 * coff * d]
        n_events = int(rp.dest_rows.numel())
        if n_events:
            # the candidates, gathered before the ring write below can overwrite their slots
            buf = torch.cat([ring[rp.gather], cz])
        if rp.ring_token.numel() == cz.shape[0]:
            # ring_token is increasing, so writing every token means it is 0..T-1 (each decode step)
            ring[rp.ring_slot] = cz
        elif rp.ring_token.numel():
            ring[rp.ring_slot] = cz[rp.ring_token]
        if n_events:
            cos, sin = self._cos_sin(plan, m, layer.rope, rp.first_pos)
            K.compress(pool, K.CompressEvents(rp.dest_rows, rp.sources, cos, sin), buf, compressor.ape,
                       compressor.norm.weight, compressor.ratio, eps=compressor.norm.eps,
                       round_bf16=self.round_bf16, hadamard=hadamard)

    def _compress_online_kernel(self, plan: _StepPlan, layer: Any, layer_id: int, raw: CompressorInput,
                                meta: ForwardMetadata, op: _OnlinePlan) -> None:
        state = self.pools.c128_online[layer_id]
        if state.dtype != torch.float32:  # the kernel keeps an fp32 running state
            write = lambda rows, vals: self._write_c128(layer_id, rows, vals)  # noqa: E731
            self._compress_online(layer, raw, meta.compressed[128].online, state, meta.positions, write)
            return
        K = _kernels()
        comp = layer.compressor
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
                                        max_len=L).rows)
        return parts[0] if len(parts) == 1 else torch.cat(parts)
