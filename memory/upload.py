"""Host -> device copies that do not make the host wait.

``tensor.to("cuda")`` from ordinary (pageable) host memory queues the copy and then blocks the
host until the stream has drained: a host synchronisation in the middle of preparing a step.
From page-locked memory with ``non_blocking=True`` the copy is only queued; PyTorch's caching
host allocator keeps the page-locked block out of reuse until the copy has run, so the source
may be dropped at once. Per step the tables' updates and the step's metadata go this way.
"""

from __future__ import annotations

import torch


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (a host tensor) on ``device``, queued on the current stream without a host sync;
    ``t`` itself when ``device`` is the CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
