"""Continuous batching: which tokens of which requests go into the next forward.

A request is a list of ids (prompt, then its outputs) of which the first ``kv_len`` are in
the pools. Every step feeds each scheduled request the next ``n >= 1`` of its ids; when the
step reaches the end of its ids the last position's logits give a new token. A decode is the
case ``n == 1``; a prefill (fresh, continued, or the recompute after a retraction) is any
other, so one step mixes both freely.

Policy of ``step()``:

1. Decodes first, oldest request first. If a decode cannot get its pages, the newest running
   request is retracted (pages freed, put back at the head of the waiting queue with prompt +
   outputs so far, to be prefilled again: its outputs continue exactly where they stopped);
   repeat until the decode fits or the request itself was the one retracted.
2. Prefill chunks share a budget of ``chunked_prefill_size`` tokens per step (decodes do not
   count), or of ``mixed_chunk_tokens`` when the step also decodes (so a long prompt's chunks
   add at most that many tokens to the running requests' time per output token; 0: no cap):
   first requests whose prefill is under way, oldest first, then new admissions from
   the head of the queue while a request slot is free. A chunk may end anywhere; when the
   pools cannot hold a chunk it is halved until it fits (down to one token) or the request
   waits. Admission needs a request slot (which also addresses its C128 ring or online state)
   and the pages of its first chunk.
3. If nothing could be scheduled while requests are running (prefills that block each other),
   the newest running request is retracted and scheduling is tried again.

A failure stays with the request that caused it. A sampling failure (a row of non-finite
logits, a row whose sampling raises) or an exception while recording a request's token
finishes only that request, with an error. When the forward itself raises, the step cannot
say whose input broke it and the pools may hold half-written rows, so every request of the
batch is retracted (its outputs so far kept, as for a memory retraction) and becomes a
*suspect*: while suspects remain, each step runs one suspect alone, and a suspect whose solo
forward raises is finished with the error; one that passes runs normally again. A batch of
one fails its request directly.

With the overlap schedule (on unless the engine turns it off, ``scheduler_hooks/overlap.py``) a
step is launched before the previous step's tokens are read: a request's token sampled on the
device and not read yet is *in flight* (``Req.in_flight``); the request then decodes it as a
placeholder id, and the tokens a ``step()`` returns are the previous launch's. A request that
finishes on a token read this way drops the row launched after it (``truncate``) before it
finishes.

Finished, aborted and retracted requests give back everything at once (``hooks.release``);
SWA pages that left the window are given back after every forward (``hooks.after_forward``).
The allocator's ``check_integrity()`` runs whenever the scheduler becomes idle.

Synthetic requests (benchmarks only, ``add(greq, synthetic=True)``): at admission the request
takes its request slot and the pages of all its ids exactly as a chunked prefill would
(chunk by chunk, SWA pages that leave the window freed after each), but instead of a forward
the engine's ``synthetic_fill`` callback writes random valid rows and ring contents into the
slots it now holds, and its first output token is a stand-in (the last prompt id) instead of a
sample. From then on it decodes like any request (same batches, hooks, eviction, retraction:
a retracted synthetic request is re-admitted the same way). Its outputs are meaningless; the
cost of its decode steps is the real one.
"""

from __future__ import annotations

import collections
import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from dsv4_backend.model_runner import ForwardRequest
from dsv4_backend.tokenizer import IncrementalDetokenizer, Tokenizer

from .hooks import SchedulerHooks
from .io import GenerateRequest, LogprobEntry, RequestOutput
from .overlap import InFlightToken, LaunchedStep, OverlapSchedule
from .sampling import SampleInput, TokenLogprob, logprob_entries, sample_async

logger = logging.getLogger(__name__)


class ReqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SchedulerConfig:
    max_running_requests: int
    chunked_prefill_size: int
    context_length: int
    eos_token_id: int
    capture_logits: bool = False
    random_seed: int = 0
    # prefill tokens a step may add beside running decodes (0: chunked_prefill_size, no cap)
    mixed_chunk_tokens: int = 0

    def prefill_budget(self, decoding: bool) -> int:
        """Prefill tokens of a step: the chunk size, capped at ``mixed_chunk_tokens`` while decodes run."""
        if decoding and self.mixed_chunk_tokens > 0:
            return min(self.chunked_prefill_size, self.mixed_chunk_tokens)
        return self.chunked_prefill_size


@dataclass
class Req:
    """A request inside the scheduler."""

    rid: str
    prompt_ids: list[int]
    greq: GenerateRequest
    generator: torch.Generator
    detok: Optional[IncrementalDetokenizer]
    output_ids: list[int] = field(default_factory=list)
    state: ReqState = ReqState.WAITING
    kv_len: int = 0                      # ids whose KV rows are in the pools
    num_retractions: int = 0
    finish_reason: Optional[dict[str, Any]] = None
    text: str = ""                       # final text once finished
    text_sent: int = 0                   # characters already delivered
    logprob_start: int = 0
    input_logprobs: dict[int, tuple[Optional[float], Optional[list[TokenLogprob]]]] = field(default_factory=dict)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[TokenLogprob]] = field(default_factory=list)
    captured: dict[int, torch.Tensor] = field(default_factory=dict)   # position -> logits [V]
    synthetic: bool = False              # benchmark request: admitted without a prefill forward
    cached_tokens: int = 0               # ids taken from the prefix cache at the latest admission
    in_flight: Optional[InFlightToken] = None   # a token sampled on the device, not read yet (overlap.py)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids_between(self, start: int, end: int) -> list[int]:
        """``all_ids[start:end]`` without building the whole list (prompts may be 1M ids long)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def num_ids(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_ids_sampled(self) -> int:
        """Ids including a token in flight (sampled on the device, not read yet)."""
        return self.num_ids + (self.in_flight is not None)

    @property
    def remaining(self) -> int:
        """Ids not yet in the pools; 1 means the next step is a decode."""
        return self.num_ids_sampled - self.kv_len

    @property
    def params(self):
        return self.greq.sampling_params

    def input_logprobs_pending(self) -> bool:
        return self.greq.return_logprob and len(self.input_logprobs) < len(self.prompt_ids) - self.logprob_start


@dataclass
class ScheduledChunk:
    req: Req
    num_tokens: int
    num_drafts: int = 0     # speculative verify: the last num_drafts of num_tokens are drafts

    @property
    def completes(self) -> bool:
        return self.req.kv_len + self.num_tokens - self.num_drafts == self.req.num_ids_sampled


class Scheduler:
    """Owns the waiting queue and the running set; ``step()`` runs one forward."""

    def __init__(self, runner: Any, hooks: SchedulerHooks, cfg: SchedulerConfig,
                 tokenizer: Optional[Tokenizer] = None, overlap: bool = True):
        self.runner = runner
        self.hooks = hooks
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []          # in admission order: retraction takes the last
        self.reqs: dict[str, Req] = {}
        self._default_gen = torch.Generator(device="cpu").manual_seed(cfg.random_seed)
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_retractions = 0
        self.num_steps = 0
        self._was_busy = False
        self._retracted_this_step = False
        self._pending_rejections: list[RequestOutput] = []
        self.suspects: set[str] = set()       # retracted after a failed forward; run one at a time
        self.num_failed = 0                   # requests finished with an error
        # rid -> logits [n, V] of every computed position (capture_logits only), kept after finish
        self.captured: dict[str, torch.Tensor] = {}
        self.captured_from: dict[str, int] = {}   # rid -> position of captured[rid][0] (after a cached prefix)
        # (rid, num_tokens) -> None: writes random valid pool contents for a synthetic request's
        # first num_tokens positions (set by the engine; see the module docstring)
        self.synthetic_fill: Optional[Callable[[str, int], None]] = None
        self._synthetic_outputs: list[RequestOutput] = []
        # speculative decoding (scheduler_hooks/speculative.py), set by the engine; None: off
        self.spec: Optional[Any] = None
        # the overlap schedule (scheduler_hooks/overlap.py); the engine turns it off where it cannot be exact
        self.overlap = OverlapSchedule(overlap)

    # ---- requests in and out --------------------------------------------------------

    def add(self, greq: GenerateRequest, synthetic: bool = False) -> None:
        """Queue a validated request (the engine checks ids and lengths). ``synthetic=True``: a
        benchmark request whose context is filled with random rows instead of prefilled."""
        if greq.rid in self.reqs:
            raise ValueError(f"request id {greq.rid!r} is already in the scheduler")
        if synthetic and self.synthetic_fill is None:
            raise ValueError("synthetic requests need the engine's synthetic_fill callback")
        if synthetic and (greq.return_logprob or self.cfg.capture_logits):
            raise ValueError("a synthetic request has no prefill logits: logprobs / captured logits are undefined")
        p = greq.sampling_params
        gen = (torch.Generator(device="cpu").manual_seed(p.seed) if p.seed is not None
               else self._default_gen)
        detok = IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens) if self.tokenizer else None
        req = Req(greq.rid, list(greq.input_ids), greq, gen, detok, synthetic=synthetic)
        n = len(req.prompt_ids)
        start = greq.logprob_start_len
        req.logprob_start = n - 1 if start is None or start < 0 else min(start, n - 1)
        self.reqs[req.rid] = req
        self.waiting.append(req)
        self.num_prompt_tokens += n

    def abort(self, rid: str, message: str = "aborted") -> Optional[RequestOutput]:
        """Finish a request wherever it is; returns its final output (None if unknown or done)."""
        req = self.reqs.get(rid)
        if req is None or req.state is ReqState.FINISHED:
            return None
        if req.state is ReqState.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
            self.hooks.release(rid)
        self._finish(req, {"type": "abort", "message": message})
        out = self._output(req, [])
        del self.reqs[rid]
        self.suspects.discard(rid)
        if self.spec is not None:
            self.spec.forget({r.rid for r in self.running})
        self._maybe_idle_check()
        return out

    def _fail(self, r: Req, message: str) -> RequestOutput:
        """Finish a request with an error; it gives back everything it holds. (A waiting one: a
        request retracted while its token was in flight, failing when that token is read.)"""
        logger.error("request %s failed: %s", r.rid, message)
        running = r.state is ReqState.RUNNING
        self._finish(r, {"type": "abort", "message": message})
        self._remove(r, running, completed=False)
        out = self._output(r, [])
        out.error = message
        self.suspects.discard(r.rid)
        self.num_failed += 1
        return out

    def _remove(self, r: Req, running: bool, completed: bool) -> None:
        """Take a finished request out: a running one gives back its pages (``completed``: to the
        prefix cache first, without a row launched after its last token), a waiting one holds none."""
        if running:
            self.running.remove(r)
            if completed:
                if r.in_flight is not None:    # the overlap schedule decoded its final token: cut it
                    r.kv_len -= 1
                    self.hooks.truncate(r.rid, r.kv_len)
                    self.overlap.discarded += 1
                self.hooks.finish(r.rid)
            else:
                self.hooks.release(r.rid)
        else:
            self.waiting.remove(r)
        r.in_flight = None
        del self.reqs[r.rid]

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # ---- one step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one forward and its sampling, then read a step's tokens: the
        previous step's while this one runs (the overlap schedule, scheduler_hooks/overlap.py),
        else this one's. Returns an output for every request that moved."""
        ov = self.overlap
        outputs: list[RequestOutput] = []
        if ov.in_flight is not None and (why := ov.must_read_first()) is not None:
            ov.fallbacks[why] += 1
            outputs += self._read(ov.take())
        batch = self._schedule()
        outputs = self._synthetic_outputs + outputs
        self._synthetic_outputs = []
        if not batch:
            if ov.in_flight is not None:
                outputs += self._read(ov.take())
            self._maybe_idle_check()
            return outputs
        self._was_busy = True
        self.num_steps += 1
        overlapped = ov.in_flight is not None
        try:
            launched = self._launch(batch)
        except Exception as e:
            if ov.in_flight is not None:
                outputs += self._read(ov.take())
            live = [ch for ch in batch if ch.req.state is ReqState.RUNNING]
            return outputs + (self._forward_failed(live, e) if live else [])
        if overlapped:
            ov.overlap_steps += 1
            outputs += self._read(ov.take())       # step N's tokens, while step N + 1 runs
        else:
            ov.sync_steps += 1
        if self.spec is None:
            self.hooks.after_forward(ch.req.rid for ch in batch if ch.req.state is ReqState.RUNNING)
        if ov.may_stay_in_flight(bool(self.suspects)):
            ov.in_flight = launched
        else:
            outputs += self._read(launched)
        self._maybe_idle_check()
        return outputs

    def _launch(self, batch: list[ScheduledChunk]) -> LaunchedStep:
        """Queue the forward over ``batch`` and the sampling of the requests it completes."""
        ov = self.overlap
        starts = [ch.req.kv_len for ch in batch]
        slots = [self.hooks.req_slot(ch.req.rid) for ch in batch]
        verifies = [(ch.req, slot, ch.num_drafts) for ch, slot in zip(batch, slots) if ch.num_drafts]
        drafts = self.spec.draft(verifies) if verifies else {}
        fwd, placeholders = [], False
        for ch, slot in zip(batch, slots):
            r = ch.req
            end = r.kv_len + ch.num_tokens - ch.num_drafts
            ids = r.ids_between(r.kv_len, min(end, r.num_ids))
            if end > r.num_ids:                    # its token in flight: taken on the device
                ids.append(ov.input_id(r))
                placeholders = True
            fwd.append(ForwardRequest(req_slot=slot, prefix_len=r.kv_len, input_ids=ids + drafts.get(r.rid, []),
                                      logits=self._logits_mode(ch),
                                      rollback_len=r.kv_len + 1 if ch.num_drafts else None))
        snapshot = self.spec.snapshot(verifies) if verifies else None
        logits = self.runner.forward(fwd, ov.prev_ids()) if placeholders else self.runner.forward(fwd)
        self.suspects.difference_update(ch.req.rid for ch in batch)
        sampled = []
        for ch in batch:
            if ch.num_drafts:
                continue       # a speculative verify: accepted when the step is read
            if ch.completes:
                sampled.append(ch)
            ch.req.kv_len += ch.num_tokens
        number = self.num_steps
        sample = None
        if sampled:
            rows = {id(ch): i for i, ch in enumerate(sampled)}
            inputs = [SampleInput(ch.req.params, ch.req.prompt_ids, ch.req.output_ids, ch.req.generator,
                                  ch.req.greq.top_logprobs_num, ch.req.greq.return_logprob) for ch in sampled]
            sample = sample_async(torch.stack([lg[-1] for ch, lg in zip(batch, logits) if id(ch) in rows]), inputs)
            for i, ch in enumerate(sampled):
                ch.req.in_flight = InFlightToken(number, i)
        return LaunchedStep(number, batch, starts, slots, drafts, snapshot, logits, sampled, sample)

    def _read(self, step: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens on the host and process them. A request finished since
        the launch (its row decoded a token after its last) is skipped: that token is never shown;
        one retracted since keeps its token (and records no logits: its recompute does)."""
        outputs: list[RequestOutput] = []
        for ch, lg, start in zip(step.batch, step.logits, step.starts):
            r = ch.req
            if ch.num_drafts or r.state is not ReqState.RUNNING or lg.shape[0] != ch.num_tokens:
                continue
            try:
                self._record_positions(r, start, lg)     # every position's logits came back
            except Exception as e:
                outputs.append(self._fail(r, f"computing input logprobs failed: {type(e).__name__}: {e}"))
        if step.sample is not None:
            res = step.sample.result()
            for i, ch in enumerate(step.sampled):
                r = ch.req
                if r.in_flight == InFlightToken(step.number, i):
                    r.in_flight = None
                if r.state is ReqState.FINISHED:
                    continue
                if res.errors[i] is not None:
                    outputs.append(self._fail(r, res.errors[i]))
                    continue
                try:
                    outputs.append(self._append_token(r, res.token_ids[i], res.logprobs[i], res.top_logprobs[i]))
                except Exception as e:
                    outputs.append(self._fail(r, f"processing the new token failed: {type(e).__name__}: {e}"))
        if self.spec is not None:
            outputs += self._finish_speculative(step.batch, step.logits, step.starts, step.slots, step.drafts,
                                                step.snapshot)
        return outputs

    def _finish_speculative(self, batch: list[ScheduledChunk], logits: list[torch.Tensor], starts: list[int],
                            slots: list[int], drafts: dict[str, list[int]], snapshot: Any) -> list[RequestOutput]:
        """Speculative steps: accept the verifies' tokens, roll back what their rejected rows
        wrote, run the MTP layer over what the target kept, then evict SWA pages."""
        spec, outputs, keep = self.spec, [], {}
        verified = [(ch.req, drafts[ch.req.rid], lg) for ch, lg in zip(batch, logits) if ch.num_drafts]
        for (r, _, lg), (toks, res) in zip(verified, spec.accept_all(verified)):
            bad = next((e for e in res.errors[:len(toks)] if e is not None), None)
            if bad is not None:
                outputs.append(self._fail(r, bad))
                continue
            start = r.kv_len
            keep[r.rid] = r.kv_len = start + len(toks)
            try:
                outputs.append(self._append_tokens(r, toks, res.logprobs, res.top_logprobs, (start, lg)))
            except Exception as e:
                outputs.append(self._fail(r, f"processing the new tokens failed: {type(e).__name__}: {e}"))
        if snapshot is not None:
            snapshot.restore(keep)
        token_offsets = torch.cumsum(torch.tensor([0] + [ch.num_tokens for ch in batch]), 0).tolist()
        running = [i for i, ch in enumerate(batch) if ch.req.state is ReqState.RUNNING]
        live = [(batch[i].req, slots[i], starts[i], token_offsets[i]) for i in running]
        # before the truncation: a graph pass runs over every verify row (they stay mapped)
        rows = [batch[i].num_tokens if batch[i].num_drafts else 0 for i in running]
        try:
            spec.extend_mtp(live, self.runner.last_hidden, rows)
        except Exception:
            # drafts only decide speed, never tokens: these requests decode without drafts until
            # a later MTP pass succeeds
            logger.exception("the MTP pass failed; its requests decode without drafts for now")
            spec.forget({r.rid for r in self.running} - {r.rid for r, _, _, _ in live})
        alloc = self.hooks.allocator
        for rid, n in keep.items():
            if rid in alloc:
                alloc.truncate(rid, n)
        self.hooks.after_forward(r.rid for r, _, _, _ in live)
        spec.forget({r.rid for r in self.running})
        return outputs

    def _forward_failed(self, batch: list[ScheduledChunk], e: Exception) -> list[RequestOutput]:
        """The forward over ``batch`` raised: fail a lone request, else retract all as suspects."""
        if len(batch) == 1:
            r = batch[0].req
            logger.exception("forward of request %s failed", r.rid)
            out = self._fail(r, f"the forward step failed: {type(e).__name__}: {e}")
            self._maybe_idle_check()
            return [out]
        logger.exception("forward of a batch of %d failed; retrying its requests one at a time", len(batch))
        in_batch = {ch.req.rid for ch in batch}
        for r in reversed(list(self.running)):      # newest first: the oldest ends at the queue head
            if r.rid in in_batch:
                self._retract(r)
        # a synthetic request has no forward of its own to retry: it is re-admitted as before
        self.suspects |= {rid for rid in in_batch if not self.reqs[rid].synthetic}
        return []

    def _logits_mode(self, ch: ScheduledChunk) -> str:
        r = ch.req
        if ch.num_drafts:
            return "all"
        if self.cfg.capture_logits or (r.input_logprobs_pending()
                                       and r.kv_len + ch.num_tokens > r.logprob_start - 1):
            return "all"
        return "last" if ch.completes else "none"

    def _record_positions(self, r: Req, start: int, lg: torch.Tensor) -> None:
        """Keep captured logits and input logprobs of positions start .. start + len(lg) - 1."""
        if self.cfg.capture_logits:
            for j in range(lg.shape[0]):
                r.captured[start + j] = lg[j].detach().to("cpu", copy=True)
        if not r.input_logprobs_pending():
            return
        n_prompt = len(r.prompt_ids)
        # the logits at position q give the logprob of prompt token q + 1
        qs = [q for q in range(start, start + lg.shape[0]) if r.logprob_start <= q + 1 < n_prompt]
        if r.logprob_start == 0:
            r.input_logprobs[0] = (None, None)
        if not qs:
            return
        rows = lg[[q - start for q in qs]]
        targets = torch.tensor([r.prompt_ids[q + 1] for q in qs])
        chosen, tops = logprob_entries(rows, targets, r.greq.top_logprobs_num)
        for q, c, t in zip(qs, chosen, tops):
            r.input_logprobs[q + 1] = (c, t)

    # ---- scheduling -----------------------------------------------------------------

    def _schedule(self) -> list[ScheduledChunk]:
        self._retracted_this_step = False
        while True:
            batch = self._try_schedule()
            if batch or self._synthetic_outputs or self.overlap.in_flight is not None:
                return batch       # (with a step in flight: read it, then schedule again)
            if self.running:
                # running requests exist but none could move: prefills block each other
                self._retract(self.running[-1])
                continue
            if self.waiting and not self._retracted_this_step:
                self._reject_unrunnable_head()
            return batch

    def _try_schedule(self) -> list[ScheduledChunk]:
        if self.suspects:
            return self._schedule_suspect()
        batch: list[ScheduledChunk] = []
        decodes = [r for r in self.running if r.remaining == 1 and not self._last_token_in_flight(r)]
        for r in decodes:
            if r.state is not ReqState.RUNNING:
                continue   # retracted while making room for an older one
            k = self.spec.num_drafts(r, self.cfg.context_length) if self.spec is not None else 0
            while not (res := self.hooks.reserve(r.rid, r.kv_len + 1 + k)).ok:
                if k:
                    k = 0      # no room for the drafts: a plain decode first
                    continue
                if res.failed_pool == "context":
                    raise RuntimeError(f"request {r.rid} reached the allocator's max_context; "
                                       "the engine's context check should have stopped it")
                victim = self.running[-1]
                self._retract(victim)
                if victim is r:
                    break
            else:
                batch.append(ScheduledChunk(r, 1 + k, k))
                if self.spec is not None and not k:
                    self.spec.num_plain_decodes += 1

        budget = self.cfg.prefill_budget(decoding=bool(batch))
        for r in [r for r in self.running if r.remaining > 1]:
            if budget <= 0:
                break
            n = self._reserve_chunk(r, min(r.remaining, budget))
            if n:
                batch.append(ScheduledChunk(r, n))
                budget -= n

        # no admissions right after a retraction: the pages it freed are for the running requests
        while (self.waiting and budget > 0 and not self._retracted_this_step
               and len(self.running) < self.cfg.max_running_requests):
            r = self.waiting[0]
            if r.synthetic:
                if self.hooks.admit(r.rid) is None or not self._admit_synthetic(r):
                    break
                continue
            if self.hooks.admit(r.rid, r.ids_between, r.num_ids, self._max_cached(r)) is None:
                break
            r.kv_len = r.cached_tokens = self.hooks.seq_len(r.rid)
            n = self._reserve_chunk(r, min(r.remaining, budget))
            if not n:
                self.hooks.release(r.rid)
                r.kv_len = r.cached_tokens = 0
                break
            self.waiting.popleft()
            r.state = ReqState.RUNNING
            self.running.append(r)
            batch.append(ScheduledChunk(r, n))
            budget -= n
        return batch

    def _schedule_suspect(self) -> list[ScheduledChunk]:
        """A batch of the oldest suspect alone (suspects wait: they were retracted)."""
        r = next(r for r in self.waiting if r.rid in self.suspects)
        if len(self.running) >= self.cfg.max_running_requests or self.hooks.admit(r.rid) is None:
            return []
        n = self._reserve_chunk(r, min(r.remaining, self.cfg.chunked_prefill_size))
        if not n:
            self.hooks.release(r.rid)
            return []
        self.waiting.remove(r)
        r.state = ReqState.RUNNING
        self.running.append(r)
        return [ScheduledChunk(r, n)]

    def _last_token_in_flight(self, r: Req) -> bool:
        """Whether ``r``'s token in flight finishes it by length (known without reading it)."""
        return r.in_flight is not None and (len(r.output_ids) + 1 >= r.params.max_new_tokens
                                            or r.num_ids + 1 >= self.cfg.context_length)

    def _max_cached(self, r: Req) -> int:
        """Ids of ``r`` that may come from the prefix cache: all but the last (its logits give the
        next token), and none whose input logprobs are still wanted."""
        limit = r.num_ids - 1
        if r.input_logprobs_pending():
            limit = min(limit, max(0, r.logprob_start - 1))
        return limit

    def _reserve_chunk(self, r: Req, n: int) -> int:
        """Reserve pages for the next ``n`` ids of ``r``, halving ``n`` until it fits; 0 if none does."""
        while n >= 1:
            if self.hooks.reserve(r.rid, r.kv_len + n).ok:
                return n
            n //= 2
        return 0

    def _admit_synthetic(self, r: Req) -> bool:
        """Take the pages of all of ``r``'s ids as a chunked prefill would, fill them, emit a
        stand-in first token. ``r`` already holds its request slot; on failure it holds nothing."""
        chunk = max(1, self.cfg.chunked_prefill_size)
        while r.kv_len < r.num_ids:
            n = self._reserve_chunk(r, min(r.num_ids - r.kv_len, chunk))
            if not n:
                self.hooks.release(r.rid)
                r.kv_len = 0
                return False
            r.kv_len += n
            self.hooks.after_forward([r.rid])
        self.synthetic_fill(r.rid, r.kv_len)
        self.waiting.popleft()
        r.state = ReqState.RUNNING
        self.running.append(r)
        self._was_busy = True
        stand_in = r.output_ids[-1] if r.output_ids else r.prompt_ids[-1]
        self._synthetic_outputs.append(self._append_token(r, stand_in, None, None))
        return True

    def _retract(self, r: Req) -> None:
        """Free everything ``r`` holds and put it back at the head of the queue for recompute."""
        self.running.remove(r)
        self.hooks.release(r.rid)
        r.kv_len = r.cached_tokens = 0
        r.captured.clear()          # its recompute may start from a cached prefix
        r.state = ReqState.WAITING
        r.num_retractions += 1
        self.num_retractions += 1
        self._retracted_this_step = True
        self.waiting.appendleft(r)
        logger.info("retracted request %s (%d ids) to free pages", r.rid, r.num_ids)

    def _reject_unrunnable_head(self) -> None:
        """Nothing runs and the head of the queue cannot be admitted: it never will be."""
        r = self.waiting[0]
        logger.error("request %s (%d ids) does not fit in the empty pools; aborting it", r.rid, r.num_ids)
        self.waiting.popleft()
        self._finish(r, {"type": "abort", "message": "request does not fit in the KV pools"})
        self._pending_rejections.append(self._output(r, []))
        del self.reqs[r.rid]

    def take_rejections(self) -> list[RequestOutput]:
        out, self._pending_rejections = self._pending_rejections, []
        return out

    # ---- tokens, stop conditions, outputs -------------------------------------------

    def _append_token(self, r: Req, tok: int, logprob: Optional[float],
                      top: Optional[list[TokenLogprob]]) -> RequestOutput:
        return self._append_tokens(r, [tok], [logprob], [top])

    def _append_tokens(self, r: Req, toks: list[int], logprobs: list[Optional[float]],
                       tops: list[Optional[list[TokenLogprob]]],
                       rows: Optional[tuple[int, torch.Tensor]] = None) -> RequestOutput:
        """Append tokens in order until one finishes the request; one output for all of them.
        ``rows = (position, logits [n, V])``: token i came from the logits of position + i,
        recorded (captured logits) only for the tokens appended."""
        done, running = [], r.state is ReqState.RUNNING
        for i, (tok, lp, top) in enumerate(zip(toks, logprobs, tops)):
            if rows is not None:
                self._record_positions(r, rows[0] + i, rows[1][i:i + 1])
            self._push_token(r, tok, lp, top)
            done.append(tok)
            if r.state is ReqState.FINISHED:
                break
        out = self._output(r, done)
        if r.state is ReqState.FINISHED:
            self._remove(r, running, completed=True)
        return out

    def _push_token(self, r: Req, tok: int, logprob: Optional[float], top: Optional[list[TokenLogprob]]) -> None:
        r.output_ids.append(tok)
        self.num_generated_tokens += 1
        if r.greq.return_logprob:
            r.output_logprobs.append(logprob)
            if r.greq.top_logprobs_num > 0:
                r.output_top.append(top or [])
        p = r.params
        stop_tok = (tok == self.cfg.eos_token_id and not p.ignore_eos) or tok in p.stop_token_ids
        if r.detok is not None and not (stop_tok and not p.no_stop_trim):
            r.detok.push([tok])
        if stop_tok:
            self._finish(r, {"type": "stop", "matched": tok})
        elif (hit := self._match_stop_string(r)) is not None:
            self._finish(r, {"type": "stop", "matched": hit[0]}, text_end=hit[1])
        elif len(r.output_ids) >= p.max_new_tokens:
            self._finish(r, {"type": "length", "length": p.max_new_tokens})
        elif r.num_ids >= self.cfg.context_length:
            self._finish(r, {"type": "length", "length": len(r.output_ids)})

    def _match_stop_string(self, r: Req) -> Optional[tuple[str, int]]:
        """(stop string, where the text ends) for the earliest stop string in the text, if any."""
        if r.detok is None or not r.params.stop:
            return None
        text = r.detok.text
        best: Optional[tuple[str, int]] = None
        for s in r.params.stop:
            i = text.find(s, max(0, r.text_sent - len(s)))
            if i >= 0 and (best is None or i < best[1]):
                best = (s, i)
        if best is None:
            return None
        s, i = best
        return s, (i + len(s) if r.params.no_stop_trim else i)

    def _visible_text(self, r: Req) -> str:
        """Text that may be sent now: all of it once finished, else minus a possible stop-string start."""
        if r.detok is None:
            return ""
        if r.state is ReqState.FINISHED:
            return r.text
        text = r.detok.text
        hold = 0
        for s in r.params.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return text[:len(text) - hold]

    def _finish(self, r: Req, reason: dict[str, Any], text_end: Optional[int] = None) -> None:
        r.state = ReqState.FINISHED
        r.finish_reason = reason
        if self.cfg.capture_logits:
            pos = sorted(r.captured)   # from the first computed one (a cached prefix is not computed)
            first = pos[0] if pos else 0
            assert pos == list(range(first, first + len(pos))), f"captured positions of {r.rid} are not contiguous"
            self.captured[r.rid] = torch.stack([r.captured[p] for p in pos]) if pos else torch.empty(0)
            self.captured_from[r.rid] = first
            r.captured.clear()
        if r.detok is not None:
            if text_end is None:
                r.detok.flush()
                r.text = r.detok.text
            else:
                r.text = r.detok.text[:text_end]

    def _output(self, r: Req, delta_ids: list[int]) -> RequestOutput:
        visible = self._visible_text(r)
        delta_text = visible[r.text_sent:] if len(visible) > r.text_sent else ""
        r.text_sent = max(r.text_sent, len(visible))
        out = RequestOutput(
            rid=r.rid, output_ids=list(r.output_ids), delta_ids=list(delta_ids),
            text=visible, delta_text=delta_text, finished=r.state is ReqState.FINISHED,
            finish_reason=r.finish_reason, prompt_tokens=len(r.prompt_ids),
            completion_tokens=len(r.output_ids),
            cached_tokens=min(r.cached_tokens, len(r.prompt_ids)),   # a recompute may reuse outputs too
        )
        if r.greq.return_logprob:
            self._fill_logprobs(r, out)
        return out

    def _fill_logprobs(self, r: Req, out: RequestOutput) -> None:
        def entries(pairs: list[TokenLogprob]) -> list[LogprobEntry]:
            return [(lp, tid, None) for lp, tid in pairs]

        positions = range(r.logprob_start, len(r.prompt_ids))
        ilp = [r.input_logprobs.get(p, (None, None)) for p in positions]
        out.input_token_logprobs = [(lp, r.prompt_ids[p], None) for p, (lp, _) in zip(positions, ilp)]
        out.output_token_logprobs = [(lp, tid, None) for lp, tid in zip(r.output_logprobs, r.output_ids)]
        if r.greq.top_logprobs_num > 0:
            out.input_top_logprobs = [entries(t) if t is not None else None for _, t in ilp]
            out.output_top_logprobs = [entries(t) for t in r.output_top]

    def _maybe_idle_check(self) -> None:
        if self.idle:
            self.overlap.in_flight = None    # only rows of finished requests can be left in it
        if self._was_busy and self.idle:
            self.hooks.check_integrity()
            self._was_busy = False
