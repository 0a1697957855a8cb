"""The bf16 decode MoE kernels (dsv4_backend/kernels/moe_bf16_decode.py) under the interpreter.

Stage by stage, each from the kernel's own previous output, so every bound is one step of
arithmetic (tests/bounds.py):

- the GEMVs (gate-up over ``[w1; w3]``, down over ``w2``; routed pairs with repeated, skipped and
  out-of-range experts, and the shared pairs): fp32 partial sums per K split against the float64
  dot of the same split, within ``gamma(terms) * sum |terms|``;
- SwiGLU: from the kernel's partials, g and u are the same fp32 sums rounded to bf16 (the same
  correctly rounded operations as torch's, so equal), and h within the fp32 ops' error plus one
  bf16 step of the float64 value;
- combine: exact (the same fp32 additions in the same order, the same roundings);
- ``MoE.forward`` runs these kernels when it may (bf16 stacks, few pairs) and its result is
  theirs, and it keeps the torch path otherwise.
"""

from __future__ import annotations

import torch

from bounds import BF16_STEP, U32, assert_within, gamma
from dsv4_backend.kernels import moe_bf16_decode as K

T, TOPK, E, D, I = 3, 2, 4, 64, 128
LIMIT = 2.5
CFG = K.Bf16GemvConfig(block_n=16, block_k=16, split_k=2, num_warps=4, num_stages=1)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    bf = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(torch.bfloat16)  # noqa: E731
    x = bf(T, D)
    w13, w2 = bf(E, 2 * I, D, scale=0.2), bf(E, D, I, scale=0.2)
    s13, s2 = bf(2 * I, D, scale=0.2), bf(D, I, scale=0.2)
    # token 0 and 1 share expert 1; token 2 has a skipped (-1) and an out-of-range (E) choice
    ids = torch.tensor([[1, 3], [2, 1], [-1, E]])
    wts = torch.rand(T, TOPK, generator=g) + 0.1
    return x, ids, wts, w13, w2, s13, s2


def _pairs(ids):
    """(routed pair -> expert or None) list, then the T shared pairs."""
    return [int(e) if 0 <= e < E else None for e in ids.reshape(-1)] + ["shared"] * T


def _split_dots(act64, rows, wmat, per):
    """float64 dots per K split: act64 [K], wmat [N, K] -> ([splits, N] sums, [splits, N] sum|terms|)."""
    sums, mags = [], []
    for lo in range(0, act64.numel(), per):
        terms = wmat[:, lo:lo + per].double() * act64[lo:lo + per]
        sums.append(terms.sum(1))
        mags.append(terms.abs().sum(1))
    return torch.stack(sums), torch.stack(mags)


def _check_gemv(part, act, ids, w, ws, gate_up):
    per, split = K._splits(w.shape[2], CFG)
    assert part.shape[0] == split == 2
    for p, kind in enumerate(_pairs(ids)):
        if kind is None:
            continue                                   # a skipped pair: its row is not written
        row = (p // TOPK if p < T * TOPK else p - T * TOPK) if gate_up else p
        wmat = ws if kind == "shared" else w[kind]
        want, mag = _split_dots(act[row].double(), row, wmat, per)
        assert_within(part[:, p], want, gamma(per) * mag, f"pair {p} partials")


def test_stages_against_float64():
    x, ids, wts, w13, w2, s13, s2 = _inputs()
    flat = ids.reshape(-1).contiguous()
    PR, P = T * TOPK, T * TOPK + T
    part = K._gemv(x, flat, w13, s13, PR, TOPK, True, CFG)
    _check_gemv(part, x, ids, w13, s13, gate_up=True)

    # SwiGLU from the kernel's partials
    h = torch.empty(P, I, dtype=torch.bfloat16)
    K._swiglu_kernel[(P, I // 128)](part, flat, wts.reshape(-1).contiguous(), h, PR, P, E, I, LIMIT,
                                    SPLIT=2, NATIVE=False)
    gu = (part[0] + part[1]).to(torch.bfloat16).double()            # fp32 add, then bf16: as the kernel
    gg, uu = gu[:, :I].clamp(max=LIMIT), gu[:, I:].clamp(-LIMIT, LIMIT)
    wt = torch.cat([wts.reshape(-1), torch.ones(T)]).double()[:, None]
    want = gg * torch.sigmoid(gg) * uu * wt
    skipped = torch.tensor([k is None for k in _pairs(ids)])
    want[skipped] = 0
    # fp32: exp (2u), 1 + ., the division, two products (u each): <= 8u relative; then one bf16 step
    assert_within(h, want, (8 * U32 + BF16_STEP) * want.abs(), "h")

    part2 = K._gemv(h, flat, w2, s2, PR, TOPK, False, CFG)
    _check_gemv(part2, h, ids, w2, s2, gate_up=False)

    out = torch.empty(T, D, dtype=torch.bfloat16)
    K._combine_splits_kernel[(T, 1)](part2, flat, out, part2[0, PR:], P * D, P, D, E, TOPK=TOPK, SPLIT=2,
                                     SHARED=True, SH_SPLIT=2, BLOCK_D=1024, NATIVE=False, PDL=False)
    y = (part2[0] + part2[1]).to(torch.bfloat16).float()              # [P, D], rounded per pair
    want = torch.empty(T, D)
    for t in range(T):
        acc = torch.zeros(D)
        for j in range(TOPK):
            if _pairs(ids)[t * TOPK + j] is not None:
                acc = acc + y[t * TOPK + j]
        want[t] = y[PR + t] + acc.to(torch.bfloat16).float()
    assert torch.equal(out, want.to(torch.bfloat16))

    # the entry point chains exactly these launches
    got = K.moe_bf16_decode(x, ids, wts, w13, w2, s13, s2, LIMIT, CFG, CFG)
    assert torch.equal(got, out)


def test_bad_inputs_name_the_tensor():
    x, ids, wts, w13, w2, s13, s2 = _inputs()
    import pytest
    with pytest.raises(ValueError, match="w2"):
        K.moe_bf16_decode(x, ids, wts, w13, w2.float(), s13, s2, LIMIT)
    with pytest.raises(ValueError, match="shapes"):
        K.moe_bf16_decode(x, ids, wts, w13, w2[:, :, :64].contiguous(), s13, s2, LIMIT)


def test_moe_forward_dispatches_to_the_kernels(monkeypatch):
    """With bf16 stacks (as on CUDA) and few pairs MoE.forward returns the kernels' result; with
    more pairs than MOE_DECODE_MAX_PAIRS, or the kernel off, it keeps the torch path."""
    from dsv4_backend import model as M
    from dsv4_backend.config import DSV4Config
    from dsv4_backend.layers.linear import stack_rows
    cfg = DSV4Config.preset("tiny", vocab_size=64)
    moe = M.MoE(cfg, hash_routed=False).to(torch.bfloat16)
    dim, inter = cfg.hidden_size, cfg.moe_intermediate_size
    moe.stack_experts(torch.bfloat16, torch.device("cpu"))
    stack_rows(moe.shared_experts.w1, moe.shared_experts.w3)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_((torch.randn(p.shape, generator=g) * 0.1).to(p.dtype))
    x = (torch.randn(1, dim, generator=g)).to(torch.bfloat16)
    tok = torch.zeros(1, dtype=torch.int64)
    calls = []
    real = K.moe_bf16_decode
    monkeypatch.setattr(K, "moe_bf16_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    if inter % 128 or moe.shared_experts.w1.row_stack is None:
        raise AssertionError("the tiny preset no longer fits the kernel's shape rules")
    ids, w = moe.gate(x, tok)
    want = real(x, ids, w, moe._w13, moe._w2, moe.shared_experts.w1.row_stack.weight,
                moe.shared_experts.w2.weight, moe.limit)
    got = moe(x, tok)
    assert calls and torch.equal(got, want)
    calls.clear()
    monkeypatch.setattr(M, "MOE_DECODE_MAX_PAIRS", 0)
    moe(x, tok)
    assert not calls
