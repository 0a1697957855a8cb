"""Rejection sampling of a verify step's drafts for a request that samples (temperature > 0).

The drafts are a chain from a deterministic draft (the MTP layer's argmax), so the draft
distribution q at each position is one-hot on its draft token d. The standard speculative rule
(Leviathan et al. / Chen et al.) — accept d with probability min(1, p(d) / q(d)), else draw from
the normalised residual max(0, p - q) — then reads: accept d with probability p(d); on a
rejection draw from p with d removed, renormalised. If every draft is accepted, the bonus token
is drawn from the last row's p. Each emitted token is then distributed exactly as the target's
own sample after the tokens before it: P(d) = p(d), and for t != d,
P(t) = (1 - p(d)) * p(t) / (1 - p(d)) = p(t).

Row i's p is what plain sampling would use after the first i drafts: penalties over the outputs
including those drafts, temperature, top-k / top-p / min-p (``sampling.filtered_probs``). The
random numbers come from the request's generator (a seed gives reproducible outputs, though not
the outputs of decoding without speculation: the stream is consumed differently). One device
read for the acceptance tests, one for the final draw.
"""

from __future__ import annotations

import torch

from .sampling import (SampleInput, SampleOutput, apply_penalties, filtered_probs, logprob_entries)


def chain_accept(probs: torch.Tensor, drafts: list[int], generator: torch.Generator) -> list[int]:
    """Tokens to emit: the accepted drafts and one more. probs ``[k + 1, V]`` (row i: the target
    distribution after the first i drafts, rows summing to 1), drafts ``[k]``."""
    k = len(drafts)
    u = torch.rand(k + 1, generator=generator, dtype=torch.float64)       # k tests and the draw
    if k:
        p_draft = probs[torch.arange(k, device=probs.device), torch.tensor(drafts, device=probs.device)]
        a = next((i for i, pd in enumerate(p_draft.tolist()) if not u[i] < pd), k)
    else:
        a = 0
    p = probs[a]
    if a < k:                        # rejected at row a: the residual max(0, p - onehot(d)) = p without d
        p = p.clone()
        p[drafts[a]] = 0.0
    cdf = p.cumsum(0)
    tok = int(torch.searchsorted(cdf, (u[k] * cdf[-1]).to(cdf.device), right=True).clamp(max=p.numel() - 1))
    return list(drafts[:a]) + [tok]


def accept_sampled(logits: torch.Tensor, drafts: list[int], inputs: list[SampleInput]) -> tuple[list[int], SampleOutput]:
    """Verify rows ``logits [k + 1, V]`` of a sampling request (``inputs[i]``: row i's sampling
    input, outputs extended by the first i drafts) -> (tokens to emit, the rows' ``SampleOutput``
    with the logprobs of those tokens; a row of non-finite logits has an error and ends the chain)."""
    k = len(drafts)
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    rows = next((i for i, ok in enumerate(finite) if not ok), k + 1)   # the chain stops at a bad row
    errors = [None if i < rows else "the model produced non-finite logits" for i in range(k + 1)]
    if rows == 0:
        return [0], SampleOutput([0] * (k + 1), [None] * (k + 1), [None] * (k + 1), errors)
    probs = torch.stack([filtered_probs(apply_penalties(logits[i], inp.params, inp.prompt_ids, inp.output_ids),
                                        inp.params) for i, inp in enumerate(inputs[:rows])])
    toks = chain_accept(probs, drafts[:rows - 1], inputs[0].generator)
    n = len(toks)
    logprobs, tops = [None] * (k + 1), [None] * (k + 1)
    if inputs[0].return_logprob:
        top_n = inputs[0].top_logprobs_num
        chosen, top = logprob_entries(logits[:n], torch.tensor(toks), top_n)
        logprobs[:n] = chosen
        if top_n > 0:
            tops[:n] = top
    return toks, SampleOutput(toks + [0] * (k + 1 - n), logprobs, tops, errors)
