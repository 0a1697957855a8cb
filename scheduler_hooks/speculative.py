"""Speculative decoding with the MTP layer as the draft model (SGLang's EAGLE, chain, top-1).

Flags (SGLang's names, the same on :class:`~scheduler_hooks.engine.Engine` and the server):
``speculative_algorithm="EAGLE"`` (``"NEXTN"`` is an alias, as in SGLang),
``speculative_num_steps=K``, ``speculative_eagle_topk=1``, ``speculative_num_draft_tokens=K+1``.

One decode step of a request with ``n = kv_len`` ids in the pools and its last token ``t_n``:

1. **draft**: draft 1 is already known (the MTP pass that ended the previous step gave it);
   drafts 2..k are k - 1 chained MTP decode passes at positions ``n .. n + k - 2``
   (:class:`dsv4_backend.mtp.MTPDraftLayer`), batched over the step's requests;
2. **verify**: the target model runs ``[t_n, d_1 .. d_k]`` at positions ``n .. n + k`` as one
   extend of k + 1 rows (mixed freely with other requests' prefill chunks), after the
   allocator reserved ``n + k + 1`` positions and :func:`dsv4_backend.rollback.snapshot_for_verify`
   saved what rejected rows could overwrite;
3. **accept**: row i is sampled exactly as a plain decode would sample it after
   ``d_1 .. d_i`` (penalties included); ``d_{i+1}`` is accepted iff it equals that token. The
   a accepted drafts and the next token ("bonus") are emitted, a + 1 tokens;
4. **roll back**: the compressed state of the rejected rows is put back
   (``VerifySnapshot.restore``);
5. **MTP extend**: the MTP layer runs over every position the target model kept this step
   (prefill chunks too), with the target's final streams and the next ids, writing its own
   KV rows; its last kept row gives draft 1 of the next step. When every request verified the
   same k it replays a graph over all k + 1 verify rows (``MTPDraftGraphs.rows``), so the
   allocator is truncated to ``n + a + 1`` only after it. Only then are SWA pages evicted (the
   MTP's positions lag the target's by the step's length).

Host reads per step (greedy requests, graphs on): two. The drafts once (draft 1, left on the
device by the previous step's MTP pass, with the chain's), the acceptance once (one ``sample``
over every greedy request's rows).

A request that samples (temperature > 0 and top_k != 1) verifies its drafts by rejection
sampling (``scheduler_hooks/rejection.py``): its tokens are distributed as without speculation,
though a seed's stream is consumed differently. A seeded greedy request does not consume its
generator, so step boundaries do not matter. Greedy outputs are therefore the plain ones token
for token; float64 logits of accepted rows equal plain decoding's to rounding (the verify is
an extend, which equals decoding position by position: docs/engine.md "Correctness").

Test and benchmark hooks (attributes of :class:`SpeculativeDecoder`, default None):
``draft_override(rid, n, drafts) -> drafts`` replaces the MTP's drafts (the tests feed the
known greedy continuation to force chosen acceptance lengths; random weights accept little);
``accept_override(rid, k) -> a`` forces a accepted drafts whatever they are (the benchmark's
step time at a forced acceptance length; the outputs then are not the greedy ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from dsv4_backend.backend import ForwardBatch
from dsv4_backend.cuda_graph import GraphUnavailable
from dsv4_backend.mtp import MTPDraftLayer
from dsv4_backend.mtp_graph import MTPDraftGraphs
from dsv4_backend.rollback import MAX_DRAFT_TOKENS, VerifySnapshot, snapshot_for_verify
from memory.upload import upload

from .rejection import accept_sampled
from .sampling import SampleInput, SampleOutput, sample

ALGORITHMS = ("EAGLE", "NEXTN")


@dataclass(frozen=True)
class SpeculativeConfig:
    """SGLang's speculative flags, validated; ``num_steps`` drafts per verify of ``num_steps + 1`` rows."""

    algorithm: str
    num_steps: int
    eagle_topk: int = 1
    num_draft_tokens: Optional[int] = None

    @classmethod
    def from_flags(cls, algorithm: Optional[str], num_steps: Optional[int], eagle_topk: Optional[int],
                   num_draft_tokens: Optional[int]) -> Optional["SpeculativeConfig"]:
        """None when ``algorithm`` is None (speculation off; the other flags must then be unset)."""
        if algorithm is None:
            given = [n for n, v in (("speculative_num_steps", num_steps), ("speculative_eagle_topk", eagle_topk),
                                    ("speculative_num_draft_tokens", num_draft_tokens)) if v is not None]
            if given:
                raise ValueError(f"{given[0]} is set but speculative_algorithm is not (use 'EAGLE')")
            return None
        algo = str(algorithm).upper()
        if algo not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm {algorithm!r} is not supported; use 'EAGLE' "
                             "(the MTP layer as the draft model; 'NEXTN' is an alias)")
        steps = 3 if num_steps is None else int(num_steps)
        if not 1 <= steps <= MAX_DRAFT_TOKENS:
            raise ValueError(f"speculative_num_steps is {steps}; it must be in 1..{MAX_DRAFT_TOKENS} (the "
                             "doubled C4 ring must hold every position a verify step writes)")
        topk = 1 if eagle_topk is None else int(eagle_topk)
        if topk != 1:
            raise ValueError(f"speculative_eagle_topk is {topk}; only chain drafts (1) are supported")
        drafts = steps + 1 if num_draft_tokens is None else int(num_draft_tokens)
        if drafts != steps + 1:
            raise ValueError(f"speculative_num_draft_tokens is {drafts}; with speculative_eagle_topk 1 it "
                             f"must be speculative_num_steps + 1 = {steps + 1}")
        return cls(algo, steps, topk, drafts)


@dataclass
class _DraftState:
    """What the last MTP pass left for a request: draft 1 and the streams that continue the chain.
    The token stays on the device (a 0-d tensor) until the next step's drafts are read back
    with it; a benchmark's stand-in state holds an int."""

    token: int | torch.Tensor
    hidden: torch.Tensor   # [hc, D]


class SpeculativeDecoder:
    """Drafting, acceptance, rollback and the MTP passes of one engine (see the module docstring).

    The scheduler calls :meth:`num_drafts` while scheduling, :meth:`draft` and
    :meth:`snapshot` before the target forward and :meth:`finish_step` after it."""

    def __init__(self, cfg: SpeculativeConfig, runner: Any, allocator: Any):
        self.cfg, self.runner, self.allocator = cfg, runner, allocator
        self.mtp = MTPDraftLayer(runner.model, runner.backend)
        # the draft passes replay CUDA graphs where the target's steps do
        graphs = getattr(runner, "cuda_graphs", None)
        self.mtp_graphs: Optional[MTPDraftGraphs] = (
            None if graphs is None else MTPDraftGraphs(runner, self.mtp, graphs.max_bs, capture=graphs.capture,
                                                       min_context=graphs.min_context))
        self.states: dict[str, _DraftState] = {}
        self.draft_override: Optional[Callable[[str, int, list[int]], list[int]]] = None
        self.accept_override: Optional[Callable[[str, int], int]] = None
        # accepted length (accepted drafts + 1) of every verify with >= 1 draft
        self.accept_hist = [0] * (cfg.num_steps + 2)
        self.num_verify = 0
        self.num_draft_tokens = 0
        self.num_plain_decodes = 0      # decode rows with no drafts (the limits, no draft state yet)

    # ---- scheduling ----------------------------------------------------------------

    def num_drafts(self, r: Any, context_length: int) -> int:
        """Drafts for request ``r``'s next decode: K, fewer near its limits."""
        if r.rid not in self.states:
            if not r.synthetic:
                return 0
            # a benchmark context has no MTP pass behind it: a stand-in state (costs are real)
            D, hc = self.runner.config.hidden_size, self.runner.config.hc_mult
            self.states[r.rid] = _DraftState(r.all_ids[-1], torch.zeros(hc, D, dtype=self.runner.dtype,
                                                                            device=self.runner.device))
        left = r.params.max_new_tokens - len(r.output_ids) - 1
        room = min(context_length, self.allocator.max_context) - r.num_ids - 1
        return max(0, min(self.cfg.num_steps, left, room))

    # ---- before the forward ----------------------------------------------------------

    @torch.inference_mode()
    def draft(self, verifies: list[tuple[Any, int, int]]) -> dict[str, list[int]]:
        """Chained drafts for ``[(r, req_slot, k), ...]`` (k >= 1): ``{rid: [d_1 .. d_k]}``.
        Draft 1 (left on the device by the last MTP pass) and each pass's argmax stay on the
        device as the next pass's tokens; all drafts come back to the host in one read after
        the last pass."""
        dev = self.runner.device
        first = [self.states[r.rid].token for r, _, _ in verifies]
        if all(isinstance(t, torch.Tensor) for t in first):
            d1 = torch.stack(first)
        else:   # stand-in states (ints), possibly beside real ones
            host = upload(torch.tensor([t if isinstance(t, int) else 0 for t in first], dtype=torch.int64), dev)
            d1 = torch.stack([t if isinstance(t, torch.Tensor) else host[i] for i, t in enumerate(first)])
        hidden = {r.rid: self.states[r.rid].hidden for r, _, _ in verifies}
        chain: dict[str, list[torch.Tensor]] = {r.rid: [d1[i]] for i, (r, _, _) in enumerate(verifies)}
        prev: Optional[tuple[list[str], torch.Tensor]] = None     # the last pass's requests and tokens
        for j in range(2, max((k for _, _, k in verifies), default=0) + 1):
            step = [(r, slot) for r, slot, k in verifies if k >= j]
            batch = ForwardBatch([slot for _, slot in step], [r.kv_len + j - 2 for r, _ in step], [1] * len(step))
            rids = [r.rid for r, _ in step]
            if j == 2 and len(step) == len(verifies):
                ids = d1
            elif prev is not None and prev[0] == rids:
                ids = prev[1]
            else:
                ids = torch.stack([chain[rid][-1] for rid in rids])
            Y, lg = self._draft_pass(torch.stack([hidden[rid] for rid in rids]), ids, batch)
            toks = lg.argmax(dim=-1)
            prev = (rids, toks)
            for i, rid in enumerate(rids):
                chain[rid].append(toks[i])
                hidden[rid] = Y[i]
        got = iter(torch.stack([t for r, _, _ in verifies for t in chain[r.rid]]).tolist())
        drafts = {r.rid: [int(next(got)) for _ in chain[r.rid]] for r, _, _ in verifies}
        if self.draft_override is not None:
            for r, _, k in verifies:
                drafts[r.rid] = [int(t) for t in self.draft_override(r.rid, r.kv_len, list(drafts[r.rid]))][:k]
                if len(drafts[r.rid]) != k:
                    raise ValueError(f"draft_override gave {len(drafts[r.rid])} drafts for {r.rid}, expected {k}")
        return drafts

    def _draft_pass(self, hidden: torch.Tensor, ids: torch.Tensor,
                    batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """One chained MTP pass, one row per request, ``ids`` on the device: (streams, logits);
        a graph replay where it can."""
        graphs = self.mtp_graphs
        if graphs is not None and graphs.enabled and len(batch.req_slots) <= graphs.max_bs:
            try:
                return graphs.draft(hidden, ids, batch)
            except GraphUnavailable:
                pass     # logged; eager from now on
        Y = self.mtp.forward(hidden, ids, batch)
        return Y, self.mtp.logits(Y)

    def snapshot(self, verifies: list[tuple[Any, int, int]]) -> VerifySnapshot:
        return snapshot_for_verify(self.runner.backend, self.allocator,
                                   [(r.rid, slot, r.kv_len, k) for r, slot, k in verifies])

    # ---- after the forward -----------------------------------------------------------

    def accept(self, r: Any, drafts: list[int], logits: torch.Tensor) -> tuple[list[int], Any]:
        """Tokens to emit from verify rows ``logits [k + 1, V]``: the accepted drafts and the
        bonus token, plus the ``SampleOutput`` of the rows (logprobs, errors). Greedy requests
        accept a draft iff it is row i's argmax; sampling ones by rejection sampling
        (``scheduler_hooks/rejection.py``)."""
        return self.accept_all([(r, drafts, logits)])[0]

    def accept_all(self, verifies: list[tuple[Any, list[int], torch.Tensor]]) -> list[tuple[list[int], Any]]:
        """:meth:`accept` for a step's verifies ``[(r, drafts, logits [k + 1, V]), ...]``. The
        rows of every greedy request (and of every request under ``accept_override``) are
        sampled by one ``sample`` call: one device read for all of them; a sampling request
        runs its rejection sampling alone (its own reads)."""
        out: list[Any] = [None] * len(verifies)
        plain = [i for i, (r, _, _) in enumerate(verifies) if self.accept_override is not None or r.params.greedy]
        if plain:
            inputs = [SampleInput(r.params, r.prompt_ids, r.output_ids + drafts[:j], r.generator,
                                  r.greq.top_logprobs_num, r.greq.return_logprob)
                      for r, drafts, _ in (verifies[i] for i in plain) for j in range(len(drafts) + 1)]
            lgs = [verifies[i][2] for i in plain]
            res = sample(lgs[0] if len(lgs) == 1 else torch.cat(lgs), inputs)
            at = 0
            for i in plain:
                r, drafts, _ = verifies[i]
                k = len(drafts)
                rows = SampleOutput(*(field[at:at + k + 1] for field in res))
                at += k + 1
                if self.accept_override is not None:
                    a = max(0, min(k, int(self.accept_override(r.rid, k))))
                    toks = drafts[:a] + [rows.token_ids[a]]
                else:
                    toks = []
                    for j in range(k + 1):
                        toks.append(rows.token_ids[j])
                        if rows.errors[j] is not None or j == k or rows.token_ids[j] != drafts[j]:
                            break
                out[i] = (toks, rows)
        for i, (r, drafts, logits) in enumerate(verifies):
            if out[i] is None:
                inputs = [SampleInput(r.params, r.prompt_ids, r.output_ids + drafts[:j], r.generator,
                                      r.greq.top_logprobs_num, r.greq.return_logprob) for j in range(len(drafts) + 1)]
                out[i] = accept_sampled(logits, drafts, inputs)
        for (_, drafts, _), (toks, _) in zip(verifies, out):
            self.num_verify += 1
            self.num_draft_tokens += len(drafts)
            self.accept_hist[len(toks)] += 1
        return out

    @torch.inference_mode()
    def extend_mtp(self, spans: list[tuple[Any, int, int, int]], hidden: torch.Tensor,
                   rows: Optional[list[int]] = None) -> None:
        """The MTP pass over what the target kept: ``[(r, req_slot, start, token offset), ...]``
        covers positions ``start .. r.kv_len - 1`` whose target streams are ``hidden[offset ..]``.
        Requests now ready to decode get their next draft state (nothing is read back: draft 1
        stays on the device).

        ``rows`` (one per span): how many rows span i ran in the target step (its verify's
        k + 1; positions ``start .. start + rows - 1`` must still be mapped). When every span
        is a verify of the same k + 1 rows the pass replays an MTP graph over all of them
        (:meth:`MTPDraftGraphs.rows`), its shapes independent of the acceptance."""
        keep = [i for i, s in enumerate(spans) if s[0].kv_len > s[2]]
        spans = [spans[i] for i in keep]
        if not spans:
            return
        dev = hidden.device
        q = rows[keep[0]] if rows is not None else 0
        if q > 1 and all(rows[i] == q for i in keep) and self._kept_pass_graph(spans, hidden, q):
            return
        index = upload(torch.tensor([o + j for r, _, s, o in spans for j in range(r.kv_len - s)], dtype=torch.int64),
                       dev)
        ids = [t for r, _, s, _ in spans for t in r.ids_between(s + 1, r.kv_len + 1)]
        batch = ForwardBatch([slot for _, slot, _, _ in spans], [s for _, _, s, _ in spans],
                             [r.kv_len - s for r, _, s, _ in spans])
        Y = self.mtp.forward(hidden[index], upload(torch.tensor(ids, dtype=torch.int64), dev), batch)
        ends = torch.cumsum(torch.tensor(batch.extend_lens), 0) - 1
        self._set_states([(r, int(ends[i])) for i, (r, _, _, _) in enumerate(spans)], Y)

    def _kept_pass_graph(self, spans: list[tuple[Any, int, int, int]], hidden: torch.Tensor, q: int) -> bool:
        """:meth:`extend_mtp` as one graph replay over all q rows of each verify; False where
        there is no graph for it (then the eager pass runs)."""
        graphs = self.mtp_graphs
        if graphs is None or not graphs.enabled or len(spans) > graphs.max_bs or q > graphs.max_rows:
            return False
        index = upload(torch.tensor([o + j for _, _, _, o in spans for j in range(q)], dtype=torch.int64),
                       hidden.device)
        ids = []
        for r, _, s, _ in spans:
            kept = r.ids_between(s + 1, r.kv_len + 1)
            ids += kept + kept[-1:] * (q - len(kept))    # rows past the kept ones: any token
        batch = ForwardBatch([slot for _, slot, _, _ in spans], [s for _, _, s, _ in spans], [q] * len(spans))
        try:
            Y, logits = graphs.rows(hidden[index], ids, batch)
        except GraphUnavailable:
            return False     # logged; eager from now on
        self._set_states([(r, i * q + r.kv_len - s - 1) for i, (r, _, s, _) in enumerate(spans)], Y, logits)
        return True

    def _set_states(self, last_rows: list[tuple[Any, int]], Y: torch.Tensor,
                    logits: Optional[torch.Tensor] = None) -> None:
        """Draft 1 and its streams for the requests now ready to decode: row ``last_rows[i][1]``
        of the pass's streams ``Y`` (and logits, computed here when not given)."""
        ready = [(r, row) for r, row in last_rows if r.remaining == 1]
        if not ready:
            return
        at = upload(torch.tensor([row for _, row in ready], dtype=torch.int64), Y.device)
        last = Y[at]
        lg = self.mtp.logits(last) if logits is None else logits[at]
        toks = lg.argmax(dim=-1)           # stays on the device: read with the next step's drafts
        for j, (r, _) in enumerate(ready):
            self.states[r.rid] = _DraftState(toks[j], last[j])

    def forget(self, live: set[str]) -> None:
        """Drop the draft state of requests that left the running set."""
        for rid in [rid for rid in self.states if rid not in live]:
            del self.states[rid]

    # ---- metrics -------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Accepted length per verify (accepted drafts + 1): mean and histogram (1 .. K + 1)."""
        n = self.num_verify
        total = sum(length * c for length, c in enumerate(self.accept_hist))
        return {"algorithm": self.cfg.algorithm, "num_steps": self.cfg.num_steps,
                "num_draft_tokens": self.cfg.num_draft_tokens, "num_verify": n,
                "draft_tokens_total": self.num_draft_tokens, "accepted_drafts_total": total - n,
                "accept_length_mean": total / n if n else 0.0,
                "accept_length_histogram": {str(length): self.accept_hist[length]
                                            for length in range(1, len(self.accept_hist))},
                "plain_decodes": self.num_plain_decodes}
