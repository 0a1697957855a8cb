"""Independent launches of one layer on a second CUDA stream.

At decode sizes a layer is a chain of small launches, each streaming its weights while its first
and last waves leave most of the GPU idle. Where two chains share only their input, the second
can run beside the first: the shared expert beside the routed experts (``kernels/fp4_mma.py``),
the compressors' projections of x beside the query path (``model.Attention``). A ``SideBranch``
forks a side stream after everything already queued on the caller's stream, runs its ``with``
body there, and ``join()`` makes the caller's stream wait for it. Under CUDA-graph capture the
fork and join are event edges: the graph gets two branches, which the GPU may run concurrently.
The values computed are the same launches on the same inputs, so the outputs do not change by a
bit (``tests/test_fp4_mma.py`` checks it on CUDA); on the CPU, or switched off, the body runs
inline on the caller's stream.

The caching allocator's reuse rules hold because of the fork and the join:
- a block allocated in the body belongs to the side stream; once the caller drops it, the side
  stream can reuse it only inside a later body, which starts with a fork, after every launch the
  caller queued before it (the ones that read the block included);
- a block the body reads but the caller allocated (its input) must stay referenced until
  ``join()``: the caller's stream may reuse it only after the join, which orders the reuse after
  the side work. The call sites keep their inputs in local variables across the join.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Optional

import torch

# Which branches run on the side stream; "0" switches one off for A/B timing. Both on by default
# since measured on one H100 (docs/PERF.md, session 16): the shared expert beside the routed
# experts took Flash's decode MoE at one token from 73.1 to 64.7 us; with the compressors' branch
# too, an 11-layer Flash-width decode step at 4K x 1 went from 0.213 to 0.205 ms per layer (the
# compressors' branch alone gained nothing measurable, but on top of the shared expert's ~3 us).
SHARED_EXPERT = os.environ.get("DSV4_SHARED_EXPERT_STREAM", "1") != "0"
COMPRESSOR = os.environ.get("DSV4_COMPRESSOR_STREAM", "1") != "0"


@lru_cache(maxsize=None)
def _stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device)


class SideBranch:
    """``with SideBranch(device, on) as branch: <side launches>``, then ``branch.join()`` before
    the caller reads what they wrote. Inline (no stream, join a no-op) unless ``on`` and CUDA."""

    def __init__(self, device: torch.device, on: bool) -> None:
        self.stream: Optional[torch.cuda.Stream] = _stream(device) if on and device.type == "cuda" else None
        self._main: Optional[torch.cuda.Stream] = None
        self._ctx = None

    def __enter__(self) -> "SideBranch":
        if self.stream is not None:
            self._main = torch.cuda.current_stream(self.stream.device)
            self.stream.wait_stream(self._main)
            self._ctx = torch.cuda.stream(self.stream)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
            self._ctx = None

    def join(self) -> None:
        if self._main is not None:
            self._main.wait_stream(self.stream)
            self._main = None
