"""CUDA graphs of the MTP layer's chained draft passes (speculative decoding).

A verify step is preceded by K - 1 draft passes, each the MTP block over one row per request
(its window-only attention, its MoE) and the head. Eagerly each pass is one layer's worth of
kernel launches from Python; like the target's decode steps (:class:`~dsv4_backend.cuda_graph.DecodeGraphs`,
whose buckets, capture and fallback this reuses) a pass replays a graph captured per (batch
bucket, context bucket). The static step is the target's one-row :class:`StaticDecode`; the
MTP block reads only its window, SWA slots and positions, and its SWA writes are masked on
padded rows. The graph's extra input is the hidden streams ``[bs, hc, D]`` (the previous pass's
output, or the target's streams); its outputs are the MTP's streams and logits.
"""

from __future__ import annotations

from typing import Any

import torch

from .backend import ForwardBatch
from .cuda_graph import DecodeGraphs


class _Row:
    """The fields of a ``ForwardRequest`` that :meth:`DecodeGraphs.run` reads."""

    def __init__(self, req_slot: int, prefix_len: int, token: int):
        self.req_slot, self.prefix_len, self.input_ids = req_slot, prefix_len, [token]


class MTPDraftGraphs(DecodeGraphs):
    """Replays the MTP draft passes of one :class:`~dsv4_backend.mtp.MTPDraftLayer`.
    ``capture=False`` runs the static path eagerly (the CPU tests)."""

    def __init__(self, runner: Any, mtp: Any, max_bs: int, **kw: Any):
        super().__init__(runner, max_bs, **kw)
        self.mtp = mtp
        self._hidden_in: dict[tuple[int, int], torch.Tensor] = {}
        self._hidden: torch.Tensor | None = None

    def draft(self, hidden: torch.Tensor, ids: list[int], batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft pass: hidden ``[B, hc, D]``, the tokens ``[B]`` at ``batch``'s positions (one
        row each) -> (the MTP's streams [B, hc, D], logits [B, V]), copies of the graph's buffers."""
        self._hidden = hidden
        rows = [_Row(s, p, t) for s, p, t in zip(batch.req_slots, batch.prefix_lens, ids)]
        _, logits, Y = self.run(rows)
        return Y.clone(), logits.clone()

    def _fill(self, meta: Any, ids: torch.Tensor, st: Any, count_tokens: bool = True) -> None:
        super()._fill(meta, ids, st, count_tokens)
        buf = self._hidden_in.get((st.bs, st.ctx))
        if buf is None:
            buf = self._hidden_in[st.bs, st.ctx] = torch.zeros((st.bs,) + tuple(self._hidden.shape[1:]),
                                                               dtype=self._hidden.dtype, device=self._hidden.device)
        B = self._hidden.shape[0]
        g = torch.where(torch.arange(st.bs, device=buf.device) < B, torch.arange(st.bs, device=buf.device), 0)
        buf.copy_(self._hidden[g])             # padded rows repeat row 0 (their writes are masked)

    def _body(self, st: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.runner.backend.use_static_decode(st)
        Y = self.mtp.forward_meta(self._hidden_in[st.bs, st.ctx], st.input_ids, st.meta)
        return self.mtp.logits(Y), Y
