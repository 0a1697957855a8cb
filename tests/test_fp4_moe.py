"""FP4 routed experts (kernels/fp4_moe.py) against a float64 simulation of the contract.

Data are chosen so that the first projection is exact: x = n/8 with |n| <= 15 and one element of
magnitude 15/8 per 128-block (scale 2^-7, codes 16 n: exact e4m3), e2m1 weights with scales
2^-4..2^0, so every term is a multiple of 2^-8 below 2^4 and any fp32 sum of 256 of them is
exact. g and u then match bit for bit, and h (silu, products: a few fp32 roundings, under 2^-21
relative) rounds to the reference's bf16 value unless the float64 h lies within 2^-18 relative of
a bf16 rounding midpoint ("ambiguous"; decided from the reference alone). Unambiguous 128-blocks
of h must give the reference's e4m3 codes and scales exactly; ambiguous ones are bounded by the
re-quantisation error (derived in ``h_bound``). The down projection is checked against the
kernel's own hq, hs within the fp32 accumulation bound, and end to end with the ambiguous
blocks' bound carried through w2.
"""

import pytest
import torch

from dsv4_backend.kernels import fp4_moe as M
from test_fp8_gemm import U32, act_quant_sim

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
LIMIT = 10.0
# silu(g) = g / (1 + exp(-g)): exp overflows to inf for g << 0 and the quotient is the correct -0
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def fp4_dequant_sim(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C/2] nibbles (low = even index) and e8m0 [R, C/32] -> float64 [R, C]."""
    codes = torch.stack([w & 15, w >> 4], -1).reshape(w.shape[0], -1).long()
    v = E2M1[codes & 7] * torch.where((codes & 8) != 0, -1.0, 1.0).double()
    return v * torch.pow(2.0, s.double() - 127).repeat_interleave(32, 1)


def bf16(v: torch.Tensor) -> torch.Tensor:
    return v.float().to(torch.bfloat16).double()


def make_experts(E, D, I, gen):
    w13 = torch.randint(0, 256, (E, 2 * I, D // 2), dtype=torch.uint8, generator=gen)
    s13 = torch.randint(123, 128, (E, 2 * I, D // 32), dtype=torch.uint8, generator=gen)
    w2 = torch.randint(0, 256, (E, D, I // 2), dtype=torch.uint8, generator=gen)
    s2 = torch.randint(118, 126, (E, D, I // 32), dtype=torch.uint8, generator=gen)
    return w13, s13, w2, s2


def make_x(T, D, gen):
    n = torch.randint(-15, 16, (T, D), generator=gen).double()
    for b in range(0, D, 128):
        n[:, b] = 15.0 * torch.where(torch.rand(T, generator=gen) < 0.5, -1.0, 1.0).double()
    return (n / 8).to(torch.bfloat16)


def h_reference(x, ids, weights, w13, s13):
    """Per pair (t, j): float64 h, its bf16 value, its ambiguity mask; None for skipped pairs."""
    E, I2, _ = w13.shape
    I = I2 // 2
    q, s = act_quant_sim(x)
    xd = q * s.repeat_interleave(128, 1)[:, :x.shape[1]]
    out = {}
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < E:
                continue
            w = fp4_dequant_sim(w13[e], s13[e])
            gu = w @ xd[t]
            g, u = bf16(gu[:I]), bf16(gu[I:])
            g = g.clamp(max=LIMIT)
            h = g / (1 + torch.exp(-g)) * u.clamp(-LIMIT, LIMIT) * float(weights[t, j])
            amb = bf16(h * (1 + 2.0 ** -18)) != bf16(h * (1 - 2.0 ** -18))
            out[(t, j)] = (h, bf16(h), amb)
    return out


def h_bound(h, hb, I):
    """Per element bound on |kernel dequantised h - reference dequantised h|: zero in unambiguous
    blocks; in an ambiguous block both sides may round h to neighbouring bf16 values (2^-8
    relative each, plus 2^-18) and quantise with scales up to 2x apart: e4m3 half-steps 2^-4
    relative (normal) or s 2^-10 (subnormal) on each side -> 0.13 |h| + s_ref 2^-8."""
    q, s = act_quant_sim(hb[None])
    amb_block = (bf16(h * (1 + 2.0 ** -18)) != bf16(h * (1 - 2.0 ** -18))).view(-1, 128).any(1)
    bound = 0.13 * h.abs() + s[0].repeat_interleave(128) * 2.0 ** -8
    return torch.where(amb_block.repeat_interleave(128), bound, 0.0), q[0] * s[0].repeat_interleave(128)


def random_ids(T, k, E, gen):
    return torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])


def check_routing(r: M.Routing, ids, E, block_m):
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < E)
    P = flat.numel()
    assert sorted(r.order.tolist()) == list(range(P))
    key = torch.where(valid, flat, E)[r.order]
    assert bool((key[1:] >= key[:-1]).all())
    same = key[1:] == key[:-1]
    assert bool((r.order[1:][same] > r.order[:-1][same]).all())  # stable
    counts = torch.bincount(flat[valid], minlength=E)
    assert torch.equal(r.offsets[1:] - r.offsets[:-1], counts)
    covered = torch.zeros(P, dtype=torch.long)
    for b in range(r.block_expert.numel()):
        e = int(r.block_expert[b])
        if e >= E:
            continue
        r0 = int(r.block_row0[b])
        end = min(r0 + block_m, int(r.offsets[e + 1]))
        assert int(r.offsets[e]) <= r0 < end
        covered[r0:end] += 1
    assert torch.equal(covered[: int(r.offsets[E])], torch.ones(int(r.offsets[E]), dtype=torch.long))


CASES = {  # name: (T, k, E, D, I, ids rule, config)
    "t1": (1, 2, 8, 256, 256, "random", None),
    "empty_experts": (5, 3, 8, 256, 256, "random", None),
    "all_to_one": (20, 2, 8, 256, 256, "one", None),
    "padded_rows": (6, 3, 8, 256, 256, "padded", None),
    "d_tail_prefill_tiles": (20, 2, 4, 160, 256, "one", M.MoeConfig(32, 64, 64, 4, 2)),
}


def case_inputs(name):
    T, k, E, D, I, rule, cfg = CASES[name]
    gen = torch.Generator().manual_seed(len(name) * 31 + T)
    ids = random_ids(T, k, E, gen)
    if rule == "one":
        ids[:, 0] = 3 % E
        ids[:, 1] = (ids[:, 1] % (E - 1) + 4) % E  # any expert but 3
    if rule == "padded":
        ids[4, :] = -1  # a CUDA-graph padding row
        ids[1, 2] = E  # out of range: skipped too
        ids[2, 0] = -1
    weights = torch.rand(T, k, generator=gen) + 0.25
    return ids, weights, make_x(T, D, gen), make_experts(E, D, I, gen), cfg


@pytest.mark.parametrize("name", ["empty_experts", "all_to_one", "padded_rows"])
def test_gate_up_codes_exact(name):
    ids, weights, x, (w13, s13, w2, s2), cfg = case_inputs(name)
    T, k = ids.shape
    E, I = w13.shape[0], w13.shape[1] // 2
    cfg = cfg or M.pick_moe_config(T * k, E)
    r = M.route(ids, E, cfg.block_m)
    check_routing(r, ids, E, cfg.block_m)
    xq, xs = M.act_quant_fp8(x)
    hq, hs = M.moe_gate_up(xq, xs, weights, w13, s13, r, k, LIMIT, cfg)
    ref = h_reference(x, ids, weights, w13, s13)
    pos = {int(p): i for i, p in enumerate(r.order[: int(r.offsets[E])])}
    n_exact = 0
    for (t, j), (h, hb, amb) in ref.items():
        i = pos[t * k + j]
        q, s = act_quant_sim(hb[None])
        amb_block = amb.view(-1, 128).any(1)
        got_codes = hq[i].view(torch.uint8).view(-1, 128)
        want_codes = q[0].float().to(torch.float8_e4m3fn).view(torch.uint8).view(-1, 128)
        for b in range(I // 128):
            if amb_block[b]:
                continue
            n_exact += 1
            assert torch.equal(got_codes[b], want_codes[b]), (t, j, b)
            assert hs[i, b].item() == s[0, b].item(), (t, j, b)
        bound, deq_ref = h_bound(h, hb, I)
        deq = hq[i].double() * hs[i].double().repeat_interleave(128)
        assert bool(((deq - deq_ref).abs() <= bound).all()), (t, j)
    assert n_exact >= len(ref)  # at least one exact block per pair on average: the check bites


def y_reference(hdeq, bound, w2, s2, e):
    """float64 y of one pair, its sum|terms| and the carried bound of the ambiguous h blocks."""
    w = fp4_dequant_sim(w2[e], s2[e])
    return w @ hdeq, w.abs() @ hdeq.abs(), w.abs() @ bound


def combine_check(out, ids, E, parts):
    """out [T, D] against sum_j of the per-pair (y, tol) in parts (missing pairs: skipped)."""
    T, k = ids.shape
    D = out.shape[1]
    for t in range(T):
        ys = [parts[(t, j)] for j in range(k) if (t, j) in parts]
        y = sum((p[0] for p in ys), torch.zeros(D, dtype=torch.float64))
        tol = sum((p[1] for p in ys), torch.zeros(D, dtype=torch.float64)) * (1 + 2.0 ** -7)
        tol = tol + k * U32 * sum((p[0].abs() + p[1] for p in ys), torch.zeros(D, dtype=torch.float64))
        tol = tol + 2.0 ** -8 * (y.abs() + tol)
        err = (out[t].double() - y).abs()
        worst = int(torch.argmax(err - tol))
        assert bool((err <= tol).all()), (t, worst, out[t, worst].item(), y[worst].item(), tol[worst].item())


def y_tol(y, mag, carried, K):
    """bf16(y_kernel) vs float64 y: fp32 accumulation over K exact products, the carried bound,
    and half a bf16 ulp."""
    tol = (K + 2) * U32 * 1.01 * mag + carried
    return tol + 2.0 ** -8 * (y.abs() + tol)


@pytest.mark.parametrize("name", ["padded_rows", "d_tail_prefill_tiles"])
def test_down_and_combine_from_kernel_h(name):
    ids, weights, x, (w13, s13, w2, s2), cfg = case_inputs(name)
    T, k = ids.shape
    E, I = w13.shape[0], w13.shape[1] // 2
    cfg = cfg or M.pick_moe_config(T * k, E)
    r = M.route(ids, E, cfg.block_m)
    xq, xs = M.act_quant_fp8(x)
    hq, hs = M.moe_gate_up(xq, xs, weights, w13, s13, r, k, LIMIT, cfg)
    y = M.moe_down(hq, hs, w2, s2, r, cfg)
    out = M.moe_combine(y, ids, E)
    parts = {}
    for i in range(int(r.offsets[E])):
        p = int(r.order[i])
        t, j = divmod(p, k)
        hdeq = hq[i].double() * hs[i].double().repeat_interleave(128)
        yr, mag, _ = y_reference(hdeq, torch.zeros(I, dtype=torch.float64), w2, s2, int(ids[t, j]))
        tol = y_tol(yr, mag, 0.0, I)
        assert bool(((y[p].double() - yr).abs() <= tol).all()), (t, j)
        parts[(t, j)] = (y[p].double(), torch.zeros_like(yr))  # combine of the kernel's own y
    combine_check(out, ids, E, parts)
    if name == "padded_rows":
        assert torch.equal(out[4], torch.zeros_like(out[4]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_fp4_moe_end_to_end(name):
    ids, weights, x, (w13, s13, w2, s2), cfg = case_inputs(name)
    I = w13.shape[1] // 2
    E = w13.shape[0]
    out = M.fp4_moe(x, ids, weights, w13, s13, w2, s2, LIMIT, config=cfg)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    parts = {}
    for (t, j), (h, hb, _) in h_reference(x, ids, weights, w13, s13).items():
        bound, deq_ref = h_bound(h, hb, I)
        yr, mag, carried = y_reference(deq_ref, bound, w2, s2, int(ids[t, j]))
        parts[(t, j)] = (yr, y_tol(yr, mag, carried, I))
    combine_check(out, ids, E, parts)


def test_bad_inputs_name_the_tensor():
    ids, weights, x, (w13, s13, w2, s2), _ = case_inputs("t1")
    with pytest.raises(ValueError, match="w2_scale"):
        M.fp4_moe(x, ids, weights, w13, s13, w2, s2[:, :, :1], LIMIT)
    with pytest.raises(ValueError, match="weights"):
        M.fp4_moe(x, ids, weights.double(), w13, s13, w2, s2, LIMIT)
    with pytest.raises(ValueError, match="w13"):
        M.fp4_moe(x, ids, weights, w13[:, :, :4], s13, w2, s2, LIMIT)
