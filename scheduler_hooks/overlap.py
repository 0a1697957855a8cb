"""The overlap schedule: step N + 1 is scheduled and launched before the host reads step N's tokens.

A synchronous step schedules, builds the metadata, launches the forward and the sampling, then
reads the sampled ids (the step's one host sync) and only then can the next step be scheduled:
the device idles while the host does its part. With the overlap schedule (on unless
``disable_overlap_schedule``) ``Scheduler.step`` instead

1. schedules step N + 1 while step N is still *in flight* (launched, its tokens unread): a request
   whose step-N row sampled a token decodes that token in step N + 1, its input id a placeholder
   (``dsv4_backend/input_ids.py``) replaced on the device by step N's sampled id;
2. launches step N + 1's forward and sampling (queued: the host does not wait);
3. reads step N's tokens (page-locked copies and an event, ``sampling.PendingSample``) while step
   N + 1 runs, and processes them as a synchronous step would: tokens appended, stop checks,
   streamed outputs, logprobs, captured logits;
4. only then does step N + 1's host bookkeeping (prefix-cache restore points, SWA eviction),
   which reads the requests' ids up to their new length.

Consequences, handled exactly:

- a request that finishes on step N's token (EOS, a stop token or a stop string) already has a
  row in step N + 1: that row's token is never read, and its position is cut from the request
  (``truncate``) before it finishes, so it gives back every page it took and the prefix cache
  sees what a synchronous finish leaves; a request failed or aborted meanwhile releases it all;
- a request whose token in flight is its last by length (``max_new_tokens``, the context
  length) is not scheduled again: the host knows that without reading the token;
- a request retracted while its token is in flight keeps that token (appended when read, before
  it can be readmitted: a step that retracts admits nobody);
- an aborted request's token in flight is dropped (the abort's output has the tokens read so far).

A step falls back to the synchronous order (reads the step in flight first, or reads its own at
once) where the host needs the token before the next launch, decided per step:

- a request with a token in flight samples with repetition / frequency / presence penalties,
  built from its host-side output ids (``penalties``);
- always, under speculative decoding (drafts, verification and the MTP pass need the accepted
  tokens), HiSparse where its rows move by the host-side torch copy on a GPU (that copy reads
  and writes the pinned host pool at launch time, not in stream order; with the row-copy kernel,
  the default on CUDA, every pool write is a kernel on the stream and HiSparse overlaps),
  tensor / expert parallel ranks (rank 0 broadcasts each step's host ids), and
  while suspects of a failed forward run alone.

Unseeded drawn requests share the engine's generator, so a discarded row's draw moves the other
unseeded requests' draws: their tokens are equally distributed but not those of a synchronous run.
Greedy and seeded requests get exactly the synchronous run's tokens.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from dsv4_backend.input_ids import placeholder

from .sampling import PendingSample


class InFlightToken(NamedTuple):
    """A request's token sampled on the device and not read yet: row ``row`` of step ``step``'s samples."""

    step: int
    row: int


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued; what reading it needs."""

    number: int
    batch: list[Any]                  # ScheduledChunk, in forward order
    starts: list[int]                 # each request's kv_len before the step
    slots: list[int]
    drafts: dict[str, list[int]]
    snapshot: Any                     # speculative rollback snapshot (None without verifies)
    logits: list[torch.Tensor]        # per request, as the runner returned them
    sampled: list[Any]                # ScheduledChunk whose last position samples: row i of `sample`
    sample: Optional[PendingSample]


class OverlapSchedule:
    """Which step is in flight, whether the next may overlap it, and counts for ``stats()``."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.off_reason: Optional[str] = None if enabled else "disable_overlap_schedule"
        self.in_flight: Optional[LaunchedStep] = None
        self.overlap_steps = 0            # launched while the previous step's tokens were unread
        self.sync_steps = 0               # launched with nothing in flight
        self.discarded = 0                # rows launched for requests that had finished
        self.fallbacks: Counter[str] = Counter()

    def turn_off(self, reason: str) -> None:
        """Every step synchronous (a feature that needs the tokens on the host)."""
        self.enabled, self.off_reason = False, reason

    def take(self) -> LaunchedStep:
        step, self.in_flight = self.in_flight, None
        return step

    def may_stay_in_flight(self, suspects: bool) -> bool:
        """Whether a launched step may be left unread until the next step is launched."""
        return self.enabled and not suspects

    def must_read_first(self) -> Optional[str]:
        """Why the step in flight must be read before the next is scheduled (None: it need not)."""
        step = self.in_flight
        for ch in step.sampled:
            p = ch.req.params
            if ch.req.in_flight is not None and (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                                                  or p.presence_penalty != 0.0):
                return "penalties"
        return None

    def input_id(self, req: Any) -> int:
        """The placeholder for ``req``'s token in flight (a row of the step in flight's samples)."""
        assert self.in_flight is not None and req.in_flight.step == self.in_flight.number, (req.rid, req.in_flight)
        return placeholder(req.in_flight.row)

    def prev_ids(self) -> torch.Tensor:
        """The step in flight's sampled ids, on the device."""
        return self.in_flight.sample.token_ids

    def stats(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "off_reason": self.off_reason, "overlap_steps": self.overlap_steps,
                "sync_steps": self.sync_steps, "discarded_rows": self.discarded,
                "fallbacks": dict(self.fallbacks)}
