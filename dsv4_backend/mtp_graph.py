"""CUDA graphs of the MTP layer's chained draft passes (speculative decoding).

A verify step is preceded by K - 1 draft passes, each the MTP block over one row per request
(its window-only attention, its MoE) and the head. Eagerly each pass is one layer's worth of
kernel launches from Python; like the target's decode steps (:class:`~dsv4_backend.cuda_graph.DecodeGraphs`,
whose buckets, capture and fallback this reuses) a pass replays a graph captured per (batch
bucket, context bucket). The static step is the target's one-row :class:`StaticDecode`; the
MTP block reads only its window, SWA slots and positions, and its SWA writes are masked on
padded rows. The graph's extra input is the hidden streams ``[bs, hc, D]`` (the previous pass's
output, or the target's streams); its outputs are the MTP's streams and logits.

The MTP pass over what a verify step kept replays graphs of the same kind with q = k + 1 rows
per request (:meth:`MTPDraftGraphs.rows`, keyed by (batch, context, q) beside the drafts' q = 1):
it runs over every verify row, not only the kept ones, so that its shapes do not depend on the
acceptance. Rows past a request's kept positions see only positions before them (causal
window), so the kept rows' outputs are those of a pass over the kept rows alone; their SWA
writes land at positions the allocator still maps (the pass runs before the truncation) and
past the request's new length, where nothing reads before that position's next real write.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .backend import ForwardBatch
from .cuda_graph import DecodeGraphs


class _Row:
    """The fields of a ``ForwardRequest`` that :meth:`DecodeGraphs.run` reads."""

    def __init__(self, req_slot: int, prefix_len: int, tokens: list[int]):
        self.req_slot, self.prefix_len, self.input_ids = req_slot, prefix_len, tokens


class MTPDraftGraphs(DecodeGraphs):
    """Replays the MTP draft passes of one :class:`~dsv4_backend.mtp.MTPDraftLayer`.
    ``capture=False`` runs the static path eagerly (the CPU tests). The MTP block is
    window-only: a pass builds and fills no compressed metadata (``window_only``)."""

    window_only = True

    def __init__(self, runner: Any, mtp: Any, max_bs: int, **kw: Any):
        super().__init__(runner, max_bs, **kw)
        self.mtp = mtp
        self._hidden_in: dict[tuple[int, int, int], torch.Tensor] = {}
        self._hidden: torch.Tensor | None = None
        self._ids: torch.Tensor | None = None

    def draft(self, hidden: torch.Tensor, ids: list[int] | torch.Tensor,
              batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft pass: hidden ``[B, hc, D]``, the tokens ``[B]`` at ``batch``'s positions (one
        row each; a list, or a device tensor such as the previous pass's argmax: nothing is read
        back) -> (the MTP's streams [B, hc, D], logits [B, V]), copies of the graph's buffers."""
        return self.rows(hidden, ids, batch)

    def rows(self, hidden: torch.Tensor, ids: list[int] | torch.Tensor,
             batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """A pass of q rows per request, q = ``batch.extend_lens`` (all equal): hidden
        ``[B * q, hc, D]`` and tokens ``[B * q]`` in request order, request i's rows at positions
        ``prefix_lens[i] ..`` -> (streams [B * q, hc, D], logits [B * q, V]), copies."""
        q = batch.extend_lens[0]
        if any(n != q for n in batch.extend_lens):
            raise ValueError(f"an MTP graph pass takes the same rows per request, got {batch.extend_lens}")
        self._hidden = hidden
        self._ids = ids if isinstance(ids, torch.Tensor) else None
        toks = [0] * (len(batch.req_slots) * q) if self._ids is not None else [int(t) for t in ids]
        reqs = [_Row(s, p, toks[i * q:(i + 1) * q]) for i, (s, p) in enumerate(zip(batch.req_slots, batch.prefix_lens))]
        try:
            logits, Y = self.run(reqs)
        finally:
            self._ids = None
        return Y.clone(), logits.clone()

    def _fill(self, step: Any, st: Any, count_tokens: bool = True) -> None:
        if self._ids is not None:    # the previous pass's argmax, on the device
            step = dataclasses.replace(step, input_ids=self._ids)
        super()._fill(step, st, count_tokens)
        key = (st.bs, st.ctx, st.q)
        buf = self._hidden_in.get(key)
        if buf is None:
            buf = self._hidden_in[key] = torch.zeros((st.bs * st.q,) + tuple(self._hidden.shape[1:]),
                                                     dtype=self._hidden.dtype, device=self._hidden.device)
        T = self._hidden.shape[0]
        ar = torch.arange(buf.shape[0], device=buf.device)
        buf.copy_(self._hidden[torch.where(ar < T, ar, 0)])    # padded rows repeat row 0 (their writes are masked)

    def _body(self, st: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.runner.backend.use_static_decode(st)
        Y = self.mtp.forward_meta(self._hidden_in[st.bs, st.ctx, st.q], st.input_ids, st.meta)
        return self.mtp.logits(Y), Y
