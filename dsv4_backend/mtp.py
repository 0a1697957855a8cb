"""The MTP module ``mtp.0`` as the engine's draft layer (speculative decoding, EAGLE-style).

DeepSeek-V4 ships one multi-token-prediction block: for position t it merges the main
model's final streams ``X_t [hc, D]`` with the embedding of token t+1 and predicts token t+2
(DSV4.md section 2, "MTP layer"). Here it runs over the paged pools like a main layer:

    e = e_proj(enorm(embed(next_id)))            [T, D]
    h = h_proj(hnorm(X))                         [T, hc, D]   (hnorm per stream)
    Y = Block(h + e)                             [T, hc, D]   window-only attention (ratio 0)
    logits = head(norm(hc_head(Y)))              [T, V]       its own hc_head and norm, the shared head

Its attention is window-only (the MTP entry of ``compress_ratios`` is 0), so its KV cache is
one SWA pool at its model index ``num_hidden_layers`` (``memory.pools``, speculative plans)
addressed by the same full / SWA slots as the main layers: MTP position t's row lives where
the main layers keep position t's. The backend is the engine's; nothing is compressed.

Chained drafts (``speculative_eagle_topk = 1``): draft step 1 runs at the last position whose
main-model streams are known; step j > 1 feeds the previous step's output streams ``Y`` as the
hidden input with the previous draft token, one position further (as SGLang's EAGLE worker
reuses the draft model's hidden state).
"""

from __future__ import annotations

from typing import Any

import torch

from .backend import ForwardBatch
from .model import DSV4Model, hc_head_collapse


class MTPDraftLayer:
    """``model.mtp[index]`` run over the pools through ``backend``.

    ``forward`` writes the layer's KV rows for the batch's positions and returns its output
    streams; ``logits`` turns streams into the draft distribution's logits."""

    def __init__(self, model: DSV4Model, backend: Any, index: int = 0):
        if model.mtp is None or len(model.mtp) <= index:
            raise ValueError(f"speculative decoding needs the MTP layer mtp.{index}: the model was built "
                             "without it (load the checkpoint or random weights with include_mtp=True)")
        self.model, self.backend = model, backend
        self.block = model.mtp[index]
        self.layer_id = self.block.attn.layer_id
        if self.layer_id not in backend.pools.swa_kv:
            raise ValueError(f"the pools have no SWA pool for the MTP layer {self.layer_id}: "
                             "plan them with speculative=True")

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """hidden ``[T, hc, D]`` (main-model streams, or the previous draft step's output),
        next_ids ``[T]`` (token t+1 of each position t) -> output streams ``[T, hc, D]``.

        The batch's positions must be mapped by the allocator (``req_to_token``, ``full_to_swa``)."""
        return self.forward_meta(hidden, next_ids, self.backend.init_forward_metadata(batch, events=False))

    def forward_meta(self, hidden: torch.Tensor, next_ids: torch.Tensor, meta: Any) -> torch.Tensor:
        """:meth:`forward` over a step's metadata (a static decode step's, under CUDA graphs)."""
        blk, dtype = self.block, self.model.dtype
        T, hc, D = hidden.shape
        e = blk.e_proj(blk.enorm(self.model.embed(next_ids).to(dtype)))                    # [T, D]
        h = blk.h_proj(blk.hnorm(hidden.to(dtype)).reshape(T * hc, D)).view(T, hc, D)
        X = (h + e[:, None, :]).to(dtype)
        return blk(X, next_ids, meta.positions.to(X.device), self.backend, meta)

    @torch.inference_mode()
    def logits(self, Y: torch.Tensor) -> torch.Tensor:
        """Streams ``[N, hc, D]`` -> logits ``[N, V]`` (float32; float64 in float64 mode)."""
        blk = self.block
        y = blk.norm(hc_head_collapse(self.model.cfg, Y, blk.hc_head_fn, blk.hc_head_scale, blk.hc_head_base))
        return self.model.head(y)
