"""Turning one step's logits into tokens, one row per request.

The pipeline for a row (SGLang's order):

1. penalties on the raw logits: repetition (prompt and output tokens: positive logits divided
   by the penalty, negative ones multiplied), then frequency (minus ``f * count`` over output
   tokens) and presence (minus ``p`` for every token the output holds);
2. greedy (temperature 0 or top_k 1): argmax of the penalised logits;
3. otherwise ``probs = softmax(logits / temperature)`` and, all three judged on these probs,
   keep token ``t`` iff its rank (descending) is < top_k, the mass of the tokens ranked before
   it is <= top_p (so the token that crosses top_p stays), and ``probs[t] >= min_p * max(probs)``;
   draw from the renormalised survivors.

A request with a ``seed`` owns a ``torch.Generator`` (created by the scheduler, kept across
steps and retractions), so its samples do not depend on what else is in the batch. Each drawn
row takes one uniform number from its generator on the CPU (so a seed gives the same number on
any device); the token is then found on the logits' device for all drawn rows at once
(:func:`draw_tokens`: the inverse CDF of the filtered probabilities), and the step's token ids
come back to the host in one read (one device sync per step, whatever the batch's sampling
parameters). :func:`sample_async` queues all of it and returns a :class:`PendingSample` whose
device ids the next step can use before the host reads them (the overlap scheduler).

Logprobs are ``log_softmax`` of the raw logits (before penalties and temperature), as SGLang
reports them.

A row fails alone: a row of non-finite logits, or a row whose sampling raises, gets an error
in ``SampleOutput.errors`` (and no token) while the other rows are sampled as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from memory.upload import upload

from .io import SamplingParams


@dataclass
class SampleInput:
    """What sampling needs from one request."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator          # the request's own (seeded) or the engine's
    top_logprobs_num: int = 0
    return_logprob: bool = False


class TokenLogprob(NamedTuple):
    logprob: float
    token_id: int


class SampleOutput(NamedTuple):
    token_ids: list[int]                                  # meaningless where errors[i] is set
    logprobs: list[Optional[float]]                       # of the chosen token, None unless asked
    top_logprobs: list[Optional[list[TokenLogprob]]]      # None unless top_logprobs_num > 0
    errors: list[Optional[str]]                           # why row i has no token, else None


def apply_penalties(logits: torch.Tensor, params: SamplingParams,
                    prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """Penalised copy of one row of logits. logits: [V]."""
    rp, fp, pp = params.repetition_penalty, params.frequency_penalty, params.presence_penalty
    if not penalised(params, output_ids):
        return logits
    logits = logits.clone()
    V = logits.shape[-1]
    dev = logits.device
    if rp != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=dev)
        seen = seen[seen < V]
        if seen.numel():
            x = logits[seen]
            logits[seen] = torch.where(x > 0, x / rp, x * rp)
    if output_ids and (fp != 0.0 or pp != 0.0):
        out = torch.tensor(output_ids, dtype=torch.long, device=dev)
        counts = torch.bincount(out[out < V], minlength=V).to(logits.dtype)
        logits -= fp * counts + pp * (counts > 0).to(logits.dtype)
    return logits


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then the top-k / top-p / min-p mask, renormalised. logits: [V] -> probs [V]."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    sorted_p, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if params.top_k > 0:
        keep[params.top_k:] = False
    if params.top_p < 1.0:
        mass_before = sorted_p.cumsum(0) - sorted_p
        keep &= mass_before <= params.top_p
    if params.min_p > 0.0:
        keep &= sorted_p >= params.min_p * sorted_p[0]
    keep[0] = True  # the most likely token always survives
    out = torch.zeros_like(probs)
    out[order[keep]] = sorted_p[keep]
    return out / out.sum()


def penalised(params: SamplingParams, output_ids: list[int]) -> bool:
    """Whether :func:`apply_penalties` changes the logits (the condition it returns early on)."""
    rp, fp, pp = params.repetition_penalty, params.frequency_penalty, params.presence_penalty
    return not (rp == 1.0 and ((fp == 0.0 and pp == 0.0) or not output_ids))


def draw_tokens(logits: torch.Tensor, inputs: list[SampleInput]) -> torch.Tensor:
    """One drawn token per row, on the logits' device without a host sync: the batched form of
    :func:`filtered_probs` followed by a draw. logits: [N, V] (penalised) -> ids [N] int64.

    Row i's token is the first (in descending-probability order when a row filters, else in
    vocabulary order) whose cumulative kept probability exceeds ``u_i * total kept``, with
    ``u_i ~ U[0, 1)`` from the row's generator: a draw from the renormalised survivors."""
    dev, f64, V = logits.device, torch.float64, logits.shape[-1]

    def col(values: list[float], dtype: torch.dtype = f64) -> torch.Tensor:
        return upload(torch.tensor(values, dtype=dtype)[:, None], dev)

    u = col([float(torch.rand((), generator=inp.generator, dtype=f64)) for inp in inputs])
    probs = torch.softmax(logits.double() / col([inp.params.temperature for inp in inputs]), dim=-1)
    filtering = any(inp.params.top_k > 0 or inp.params.top_p < 1.0 or inp.params.min_p > 0.0 for inp in inputs)
    if filtering:
        probs, order = probs.sort(dim=-1, descending=True)
        top_k = col([inp.params.top_k for inp in inputs], torch.int64)
        top_p = col([inp.params.top_p for inp in inputs])
        rank = torch.arange(V, device=dev)[None, :]
        keep = (top_k <= 0) | (rank < top_k)
        keep &= (top_p >= 1.0) | (probs.cumsum(-1) - probs <= top_p)
        keep &= probs >= col([inp.params.min_p for inp in inputs]) * probs[:, :1]
        keep[:, 0] = True                       # the most likely token always survives
        probs = probs * keep
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=V - 1)   # [N, 1]
    return (order.gather(1, idx) if filtering else idx).squeeze(1)


def _logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, top_n: int
                     ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Device tensors of :func:`logprob_entries`: chosen [N], top values and ids [N, k] (None if top_n <= 0)."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    chosen = lp.gather(1, token_ids.view(-1, 1).to(lp.device)).squeeze(1)
    if top_n <= 0:
        return chosen, None, None
    vals, idx = lp.topk(min(top_n, lp.shape[-1]), dim=-1)
    return chosen, vals, idx


def _top_lists(vals: list[list[float]], idx: list[list[int]]) -> list[list[TokenLogprob]]:
    return [[TokenLogprob(v, i) for v, i in zip(vr, ir)] for vr, ir in zip(vals, idx)]


def logprob_entries(logits: torch.Tensor, token_ids: torch.Tensor, top_n: int
                    ) -> tuple[list[float], list[Optional[list[TokenLogprob]]]]:
    """Logprobs of ``token_ids`` under raw ``logits`` and the top ``top_n`` per row.

    logits: [N, V]; token_ids: [N] -> ([N] floats, [N] lists or Nones)
    """
    chosen, vals, idx = _logprob_tensors(logits, token_ids, top_n)
    if vals is None:
        return chosen.tolist(), [None] * chosen.shape[0]
    return chosen.tolist(), _top_lists(vals.tolist(), idx.tolist())


class PendingSample:
    """A step's sampling, queued on the logits' device; :meth:`result` reads it on the host.

    ``token_ids`` ([N] int64, on the device) is there at once: the next step may take its input
    ids from it without the host seeing them (``scheduler_hooks/overlap.py``). On CUDA the values
    the host needs (ids, non-finite flags, logprobs) are copied into page-locked buffers without
    a sync and an event marks their arrival; :meth:`result` waits for that event only, not for
    work queued after it."""

    def __init__(self, inputs: list[SampleInput], token_ids: torch.Tensor, packed: torch.Tensor,
                 errors: list[Optional[str]], want: list[int], logprobs: tuple) -> None:
        self.inputs, self.token_ids, self.errors, self.want = inputs, token_ids, errors, want
        self._host = [_to_host(t) for t in (packed, *logprobs)]
        self._event = None
        if token_ids.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        self._result: Optional[SampleOutput] = None

    def result(self) -> SampleOutput:
        if self._result is not None:
            return self._result
        if self._event is not None:
            self._event.synchronize()    # the host read of the step (its only sync)
        packed, *lp = self._host
        tokens, bad = packed.tolist()
        errors = list(self.errors)
        for i in range(len(self.inputs)):
            if bad[i] and errors[i] is None:
                errors[i] = "the model produced non-finite logits"
        logprobs: list[Optional[float]] = [None] * len(self.inputs)
        tops: list[Optional[list[TokenLogprob]]] = [None] * len(self.inputs)
        if self.want:
            chosen = lp[0].tolist()
            top = _top_lists(lp[1].tolist(), lp[2].tolist()) if len(lp) == 3 else None
            for j, i in enumerate(self.want):
                if errors[i] is not None:
                    continue
                logprobs[i] = chosen[j]
                n = self.inputs[i].top_logprobs_num
                tops[i] = top[j][:n] if n > 0 else None
        self._result = SampleOutput(tokens, logprobs, tops, errors)
        return self._result


def _greedy_and_flags(work: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """int64 [2, B]: ``argmax(work, -1)`` and 1 where a row of ``logits`` is not all finite; on
    CUDA two launches (``kernels/greedy.py``), elsewhere the torch ops."""
    if work.is_cuda and work.dim() == 2 and work.stride(1) == 1 and logits.stride(1) == 1 and work.shape[1]:
        from dsv4_backend.kernels.greedy import greedy_and_flags
        return greedy_and_flags(work, logits)
    token_ids = torch.argmax(work, dim=-1)
    return torch.stack([token_ids, (~torch.isfinite(logits).all(dim=-1)).to(token_ids.dtype)])


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host: itself on the CPU, else a page-locked copy queued without a sync."""
    if t.device.type == "cpu":
        return t
    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    buf.copy_(t, non_blocking=True)
    return buf


def _rows(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row indices on ``device`` (a list index would be copied there from pageable memory: a sync)."""
    return upload(torch.tensor(rows, dtype=torch.int64), device)


def sample_async(logits: torch.Tensor, inputs: list[SampleInput]) -> PendingSample:
    """Queue one token per request. logits: [B, V] raw (one row per entry of ``inputs``)."""
    assert logits.shape[0] == len(inputs), (logits.shape, len(inputs))
    errors: list[Optional[str]] = [None] * len(inputs)
    work = logits
    pen = [i for i, inp in enumerate(inputs) if penalised(inp.params, inp.output_ids)]
    if pen:
        work = logits.clone()
        for i in pen:
            try:
                work[i] = apply_penalties(logits[i], inputs[i].params, inputs[i].prompt_ids, inputs[i].output_ids)
            except Exception as e:  # only this request fails
                errors[i] = f"sampling failed: {type(e).__name__}: {e}"
    # greedy rows take the batch argmax, drawn rows draw_tokens; the ids and the per-row
    # finiteness flag come back in one device read (a read is a device sync on the GPU)
    packed = _greedy_and_flags(work, logits)    # [2, B]: the argmax, then the non-finite flag
    token_ids = packed[0]
    drawn = [i for i, inp in enumerate(inputs) if not inp.params.greedy and errors[i] is None]
    if drawn:
        try:
            rows = _rows(drawn, token_ids.device)
            token_ids[rows] = draw_tokens(work[rows], [inputs[i] for i in drawn])
        except Exception:  # find the rows that fail and fail only them
            for i in drawn:
                try:
                    token_ids[i] = draw_tokens(work[i:i + 1], [inputs[i]])[0]
                except Exception as e:
                    errors[i] = f"sampling failed: {type(e).__name__}: {e}"
    # logprobs of the rows that ask, from the device ids (rows found non-finite are dropped on reading)
    want = [i for i, inp in enumerate(inputs) if inp.return_logprob and errors[i] is None]
    logprobs: tuple = ()
    if want:
        top_n = max(inputs[i].top_logprobs_num for i in want)
        rows = _rows(want, token_ids.device)
        chosen, vals, idx = _logprob_tensors(logits[rows], token_ids[rows], top_n)
        logprobs = (chosen,) if vals is None else (chosen, vals, idx)
    return PendingSample(inputs, token_ids, packed, errors, want, logprobs)


def sample(logits: torch.Tensor, inputs: list[SampleInput]) -> SampleOutput:
    """One token per request. logits: [B, V] raw (one row per entry of ``inputs``)."""
    return sample_async(logits, inputs).result()
