"""A step's input ids on the device, some of them taken from the previous step's sampled ids.

With the overlap scheduler (``scheduler_hooks/overlap.py``) a decode row's input token may be the
token the previous step sampled, which the host has not read yet. Its host id is then a
*placeholder* ``-(i + 1)``: row ``i`` of that step's sampled ids ``prev_ids`` (a device tensor);
the placeholders are replaced on the device, so the eager path and the CUDA graph's static input
buffer both get the real ids without a host round trip. Real ids are ``>= 0``.
"""

from __future__ import annotations

from typing import Optional

import torch

from memory.upload import upload


def placeholder(row: int) -> int:
    """The host id standing for row ``row`` of the previous step's sampled ids."""
    return -(row + 1)


def device_input_ids(ids: list[int], device: torch.device, prev_ids: Optional[torch.Tensor] = None
                     ) -> torch.Tensor:
    """``ids`` (flattened over the step's requests) as an int64 tensor on ``device``, with every
    placeholder resolved from ``prev_ids`` [P] (on ``device``; None: there are none)."""
    t = upload(torch.tensor(ids, dtype=torch.int64), device)
    if prev_ids is None:
        return t
    rows = (-t - 1).clamp_(0, max(prev_ids.numel() - 1, 0))
    return torch.where(t >= 0, t, prev_ids.to(t.device)[rows])
