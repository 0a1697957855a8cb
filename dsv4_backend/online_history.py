"""The online C128 state under speculative decoding: per-position states and their rollback.

With ``SGLANG_OPT_USE_ONLINE_COMPRESS=1`` an HCA layer keeps one running (max, sum, kv) per
request (the open block's tokens folded in; ``kv = sum exp(z + ape - max) * C``) instead of a
ring of raw (C, Z). A verify step folds all its ``k + 1`` positions ``n .. n + k`` in, but only
``n .. n + a`` are accepted, and a running state cannot take tokens back out.

So a speculative plan gives each request ``H = draft_tokens`` more state slots (the plan's
``online_history_size``; SGLang's reservation has ``1 + draft_tokens`` states per request), and
a verify records, per HCA layer, the state after each of its positions into them
(:func:`record_online_history`, called by both backends before their fold of the step):
history slot ``j`` of the request holds the state that decoding only ``n .. n + j`` would have
left in its main slot. :class:`OnlineRollback` then copies the slot of the last accepted
position, ``j = a``, into the main slot (``VerifySnapshot.restore`` calls it), for every
acceptance, all-accepted included.

"The state decoding would have left" follows the decode path's rules: a position at a block
start (``p % 128 == 0``) starts fresh (the stored state is ignored); a position completing a
block (``p % 128 == 127``) writes its compressed row and leaves the stored state as it was (the
next position starts fresh). So history ``j`` folds the tokens of position ``n + j``'s block
among ``n .. n + j`` (``n .. n + j - 1`` when ``n + j`` completes it), plus the stored state
when that block began before ``n``. Each prefix is one masked softmax over at most ``k + 1``
tokens, all ``j`` at once (``[V, q, q, d]``, q = k + 1 <= 10), so the slots are exact to
rounding whatever the order of the fold that wrote the main slot. C128 rows that rejected
positions completed are put back by the ordinary snapshot (``dsv4_backend/rollback.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

RATIO = 128


@dataclass
class OnlineHistory:
    """One step's verify requests whose online states are recorded (on the step's device)."""

    state_slot: torch.Tensor   # [V] the request's main slot (= req_slot)
    tokens: torch.Tensor       # [V, q] new-token index of positions first .. first + q - 1, -1 padded
    positions: torch.Tensor    # [V, q] those positions (0 where padded)
    first: torch.Tensor        # [V] first position of the verify (its prefix length n)
    rows: torch.Tensor         # [N] the real (not padded) entries of [V, q], flattened, in order
    dest: torch.Tensor         # [N] their history slots (built on the host: no mask on the device)


def history_base(plan: Any) -> int:
    """Slot of request slot 0's first history state: after the main slots and the dummy."""
    return plan.online_state_slots + 1


def history_slots(plan: Any, req_slot: int, count: int) -> list[int]:
    """The history slots of positions ``n .. n + count - 1`` of a verify of request ``req_slot``."""
    size = plan.online_history_size
    if count > size:
        raise ValueError(f"a verify of {count} rows needs {count} online C128 history states per request; "
                         f"the plan keeps {size} (plan with draft_tokens >= the verify's rows)")
    base = history_base(plan) + req_slot * size
    return list(range(base, base + count))


def history_host(plan: Any, req_slots: list[int], prefix_lens: list[int], extend_lens: list[int],
                 offsets: list[int], rollback_lens: Optional[list[int]]) -> Optional[dict[str, torch.Tensor]]:
    """Host int64 tensors of the step's :class:`OnlineHistory` (keys its field names), or None
    when no request of the step can be rolled back (``rollback_len < seq_len``)."""
    if not rollback_lens:
        return None
    verify = [r for r, (p, n, keep) in enumerate(zip(prefix_lens, extend_lens, rollback_lens)) if keep < p + n]
    if not verify:
        return None
    if not plan.online_history_size:
        raise ValueError("a speculative verify over the online C128 state needs the plan's history states "
                         "(plan with speculative=True and draft_tokens)")
    q = max(extend_lens[r] for r in verify)
    tokens = torch.full((len(verify), q), -1, dtype=torch.int64)
    positions = torch.zeros((len(verify), q), dtype=torch.int64)
    rows, dest = [], []
    for i, r in enumerate(verify):
        n = extend_lens[r]
        tokens[i, :n] = torch.arange(offsets[r], offsets[r] + n)
        positions[i, :n] = torch.arange(prefix_lens[r], prefix_lens[r] + n)
        rows += range(i * q, i * q + n)
        dest += history_slots(plan, req_slots[r], n)
    return {"state_slot": torch.tensor([req_slots[r] for r in verify], dtype=torch.int64), "tokens": tokens,
            "positions": positions, "first": torch.tensor([prefix_lens[r] for r in verify], dtype=torch.int64),
            "rows": torch.tensor(rows, dtype=torch.int64), "dest": torch.tensor(dest, dtype=torch.int64)}


@torch.no_grad()
def record_online_history(state: torch.Tensor, hist: OnlineHistory, c: torch.Tensor, z: torch.Tensor) -> None:
    """Write into ``state[hist.dest]`` the state after each verify position (module docstring).

    ``state``: one HCA layer's ``[slots, 3, d]`` (max, sum, kv), read before the step's fold;
    ``c`` / ``z``: the step's new tokens' ``[T, d]``, ``z`` with the ape added, in the dtype to
    compute in."""
    V, q = hist.tokens.shape
    valid = hist.tokens >= 0                                             # [V, q]
    idx = hist.tokens.clamp_min(0)
    ci, zi = c[idx], z[idx]                                              # [V, q, d]
    pos = hist.positions
    block = pos // RATIO
    done = (pos + 1) % RATIO == 0
    j = torch.arange(q, device=pos.device)
    # token i enters prefix j: i in j's block, i <= j (i < j when j completes its block)
    last = j[None, :] - done.to(j.dtype)                                  # [V, q]
    enters = (valid[:, None, :] & (block[:, None, :] == block[:, :, None])
              & (j[None, None, :] <= last[:, :, None]))                   # [V, q(j), q(i)]
    old = state[hist.state_slot].to(c.dtype)                             # [V, 3, d]
    old_in = (block * RATIO < hist.first[:, None])[..., None]            # [V, q, 1]: the block began before n
    zz = torch.where(enters[..., None], zi[:, None, :, :], float("-inf"))  # [V, q, q, d]
    old_max = torch.where(old_in, old[:, None, 0], float("-inf"))       # [V, q, d]
    new_max = torch.maximum(old_max, zz.amax(dim=2))
    new_max = torch.where(torch.isfinite(new_max), new_max, 0.0)        # padded rows only (never written)
    e = (zz - new_max[:, :, None]).exp()                                 # 0 where a token does not enter
    keep = torch.where(old_in, (old_max - new_max).exp(), 0.0)
    tot = torch.where(old_in, old[:, None, 1], 0.0) * keep + e.sum(dim=2)
    kv = torch.where(old_in, old[:, None, 2], 0.0) * keep + (e * ci[:, None, :, :]).sum(dim=2)
    out = torch.stack([new_max, tot, kv], dim=2).flatten(0, 1)          # [V * q, 3, d]
    state[hist.dest] = out[hist.rows].to(state.dtype)


@dataclass
class OnlineRollback:
    """The verifies' main slots and history slots: :meth:`restore` sets each request's main
    state to the one after its last kept position."""

    pools: Any
    rids: list[Any]
    slots: list[int]
    firsts: list[int]     # n: the verify's first position
    drafts: list[int]     # k

    @classmethod
    def for_verifies(cls, pools: Any, verifies: list[tuple[Any, int, int, int]]) -> Optional["OnlineRollback"]:
        """``verifies``: ``[(rid, req_slot, prefix n, drafts k), ...]`` as ``snapshot_for_verify``."""
        if not getattr(pools, "c128_online", None) or not verifies:
            return None
        for _, slot, _, k in verifies:
            history_slots(pools.plan, slot, k + 1)       # raises when the plan keeps too few
        return cls(pools, [v[0] for v in verifies], [v[1] for v in verifies], [v[2] for v in verifies],
                   [v[3] for v in verifies])

    def restore(self, keep_lens: dict[Any, int]) -> int:
        """For each verify whose request is in ``keep_lens`` (kept length ``n + a + 1``), copy
        history state ``a`` into the main slot in every HCA layer. Returns the requests done."""
        main, src = [], []
        for rid, slot, n, k in zip(self.rids, self.slots, self.firsts, self.drafts):
            if rid not in keep_lens:
                continue
            a = keep_lens[rid] - n - 1
            if not 0 <= a <= k:
                raise ValueError(f"request {rid!r}: kept length {keep_lens[rid]} is outside its verify "
                                 f"of positions {n} .. {n + k}")
            main.append(slot)
            src.append(history_slots(self.pools.plan, slot, a + 1)[a])
        if main:
            dev = self.pools.device
            main_t = torch.tensor(main, dtype=torch.int64, device=dev)
            src_t = torch.tensor(src, dtype=torch.int64, device=dev)
            for state in self.pools.c128_online.values():
                state[main_t] = state[src_t]
        return len(main)
