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
from dsv4_backend.kernels import fp4_moe_decode as D
from test_fp8_gemm import U32, act_quant_sim

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
LIMIT = 10.0
# silu(g) = g / (1 + exp(-g)): exp overflows to inf for g << 0 and the quotient is the correct -0
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def fp4_dequant_sim(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C/2] nibbles (low = even index) and e8m0 [R, C/32] -> float64 [R, C]."""
    codes = torch.stack([w & 15, w >> 4], -1).reshape(w.shape[0], -1).long()
    v = E2M1.to(w.device)[codes & 7] * torch.where((codes & 8) != 0, -1.0, 1.0).double()
    return v * torch.pow(2.0, s.double() - 127).repeat_interleave(32, 1)


def bf16(v: torch.Tensor) -> torch.Tensor:
    return v.float().to(torch.bfloat16).double()


def make_experts(E, D, I, gen):
    """Random FP4 experts on gen's device: every nibble code, w13 scales 2^-4..2^0."""
    def r(lo, hi, shape):
        return torch.randint(lo, hi, shape, dtype=torch.uint8, generator=gen, device=gen.device)
    return (r(0, 256, (E, 2 * I, D // 2)), r(123, 128, (E, 2 * I, D // 32)),
            r(0, 256, (E, D, I // 2)), r(118, 126, (E, D, I // 32)))


def make_x(T, D, gen):
    """x = n/8, |n| <= 15, with a +-15/8 at the start of every 128-block (see the module doc)."""
    dev = gen.device
    n = torch.randint(-15, 16, (T, D), generator=gen, device=dev).double()
    for b in range(0, D, 128):
        n[:, b] = 15.0 * torch.where(torch.rand(T, generator=gen, device=dev) < 0.5, -1.0, 1.0).double()
    return (n / 8).to(torch.bfloat16)


def _per_expert(ids, E, fn):
    """Calls fn(e, pair indices routed to e) for each expert some pair uses."""
    flat = ids.reshape(-1)
    for e in flat[(flat >= 0) & (flat < E)].unique().tolist():
        fn(e, (flat == e).nonzero().squeeze(1))


def h_reference(x, ids, weights, w13, s13, limit, window=lambda g: 2.0 ** -18):
    """float64 h [P, I], its bf16 value and its ambiguity mask (within ``window(g)`` relative of
    a bf16 rounding midpoint, g the clamped gate) for every pair; rows of skipped pairs are 0 / False."""
    E, I2, _ = w13.shape
    I, k, D = I2 // 2, ids.shape[1], x.shape[1]
    q, s = act_quant_sim(x)
    xd = q * s.repeat_interleave(128, 1)[:, :D]
    gu = torch.zeros(ids.numel(), I2, dtype=torch.float64, device=x.device)

    def project(e, pairs):
        gu[pairs] = xd[pairs // k] @ fp4_dequant_sim(w13[e], s13[e]).T
    _per_expert(ids, E, project)
    g = bf16(gu[:, :I]).clamp(max=limit)
    u = bf16(gu[:, I:]).clamp(-limit, limit)
    h = g / (1 + torch.exp(-g)) * u * weights.reshape(-1, 1).double()
    w = window(g)
    amb = bf16(h * (1 + w)) != bf16(h * (1 - w))
    return h, bf16(h), amb


def h_bound(h, hb, amb):
    """(bound [P, I], reference dequantised h [P, I]): the bound on |kernel dequantised h -
    reference dequantised h| is zero in unambiguous blocks; in an ambiguous block both sides may
    round h to neighbouring bf16 values (2^-8 relative each, plus the window) and quantise with
    scales up to 2x apart: e4m3 half-steps 2^-4 relative (normal) or s 2^-10 (subnormal) on each
    side -> 0.13 |h| + s_ref 2^-8."""
    P, I = h.shape
    q, s = act_quant_sim(hb)
    srep = s.repeat_interleave(128, 1)[:, :I]
    amb_block = amb.view(P, -1, 128).any(2).repeat_interleave(128, 1)[:, :I]
    bound = torch.where(amb_block, 0.13 * h.abs() + srep * 2.0 ** -8, 0.0)
    return bound, q * srep


def y_reference(hdeq, bound, ids, w2, s2):
    """float64 y [P, D], sum|terms| [P, D] and the bound carried from h through |w2|."""
    E, D, _ = w2.shape
    y, mag, carried = (torch.zeros(ids.numel(), D, dtype=torch.float64, device=hdeq.device) for _ in range(3))

    def project(e, pairs):
        w = fp4_dequant_sim(w2[e], s2[e])
        y[pairs] = hdeq[pairs] @ w.T
        mag[pairs] = hdeq[pairs].abs() @ w.abs().T
        carried[pairs] = bound[pairs] @ w.abs().T
    _per_expert(ids, E, project)
    return y, mag, carried


def y_tol(y, mag, carried, K, acc_ulps=1.0):
    """bf16(y_kernel) vs float64 y: fp32 accumulation over K exact products (acc_ulps x the
    round-to-nearest bound), the carried bound, and half a bf16 ulp."""
    tol = acc_ulps * (K + 2) * U32 * 1.01 * mag + carried
    return tol + 2.0 ** -8 * (y.abs() + tol)


def combine_tol(y, tol, ids, E):
    """(float64 out [T, D], its bound) from per-pair y [P, D] and their bounds: the sum over the
    valid choices, fp32 adds of the k values, half a bf16 ulp."""
    T, k = ids.shape
    valid = ((ids >= 0) & (ids < E)).reshape(T, k, 1)
    y = torch.where(valid, y.view(T, k, -1), 0.0)
    tol = torch.where(valid, tol.view(T, k, -1), 0.0)
    out = y.sum(1)
    bound = tol.sum(1) * (1 + 2.0 ** -7) + k * U32 * (y.abs() + tol).sum(1)
    return out, bound + 2.0 ** -8 * (out.abs() + bound)


def assert_within(got, want, tol, what):
    err = (got.double() - want).abs()
    worst = int(torch.argmax(err - tol))
    assert bool((err <= tol).all()), (f"{what}: worst element {worst}: got {got.flatten()[worst].item()}, "
                                      f"want {want.flatten()[worst].item()}, tol {tol.flatten()[worst].item()}")


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


GROUPED = dict(decode_max_pairs=0)  # the grouped tensor-core kernels at any T k
G = M.GemvConfig
CASES = {  # name: (T, k, E, D, I, ids rule, config); None: the default rule (decode GEMVs here)
    "t1": (1, 2, 8, 256, 256, "random", None),
    "empty_experts": (5, 3, 8, 256, 256, "random", M.pick_moe_config(15, 8)._replace(**GROUPED)),
    "all_to_one": (20, 2, 8, 256, 256, "one", M.pick_moe_config(40, 8)._replace(**GROUPED)),
    # decode GEMVs (wide tiles: few interpreted programs), skipped pairs and a repeated expert
    "padded_rows": (6, 3, 8, 256, 256, "padded", M.MoeConfig(
        gemv_gate_up=G(128, 128, 1), gemv_down=G(256, 128, 1))),
    "grouped_padded_rows": (6, 3, 8, 256, 256, "padded", M.pick_moe_config(18, 8)._replace(**GROUPED)),
    "d_tail_prefill_tiles": (20, 2, 4, 160, 256, "one", M.MoeConfig(32, 64, 64, 4, 2, **GROUPED)),
    "split_nibbles": (20, 2, 4, 160, 256, "one", M.MoeConfig(16, 64, 64, 4, 2, True, **GROUPED)),
    # weights as the MMA's M side, decoded to bf16 bits by integer operations
    "swap_int_decode": (6, 3, 8, 256, 256, "padded", M.MoeConfig(16, 128, 64, 4, 2, False, True, True,
                                                                 **GROUPED)),
    "swap_split_int": (20, 2, 4, 160, 256, "one", M.MoeConfig(16, 64, 64, 4, 2, True, True, True, **GROUPED)),
    # decode GEMVs: a K tail in the last split (D = 160: splits of 128 and 32), N tails (block_n
    # 64 over D = 160), the e4m3 and table nibble routes, six rows of one expert, four down
    # splits, K steps of 256 (two activation scales per step)
    "gemv_tails_e4m3": (6, 2, 4, 160, 256, "one", M.MoeConfig(
        gemv_gate_up=G(128, 64, 2, decode="e4m3"), gemv_down=G(64, 64, 4, decode="lut"))),
    "gemv_split_padded": (6, 3, 8, 256, 256, "padded", M.MoeConfig(
        gemv_gate_up=G(256, 256, 1), gemv_down=G(256, 64, 4))),
}
DECODE_CASES = ["t1", "padded_rows", "gemv_tails_e4m3", "gemv_split_padded"]


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
        ids[3, 1] = ids[3, 0]  # one expert twice in a token's choices: two rows of one expert
    weights = torch.rand(T, k, generator=gen) + 0.25
    return ids, weights, make_x(T, D, gen), make_experts(E, D, I, gen), cfg


def run_gate_up(name):
    """A case through routing and the gate-up kernel: (inputs, routing, config, hq, hs)."""
    ids, weights, x, (w13, s13, w2, s2), cfg = case_inputs(name)
    T, k = ids.shape
    E = w13.shape[0]
    cfg = cfg or M.pick_moe_config(T * k, E)
    r = M.route(ids, E, cfg.block_m)
    check_routing(r, ids, E, cfg.block_m)
    xq, xs = M.act_quant_fp8(x)
    hq, hs = M.moe_gate_up(xq, xs, weights, w13, s13, r, k, LIMIT, cfg)
    return (ids, weights, x, (w13, s13, w2, s2)), r, cfg, hq, hs


@pytest.mark.parametrize("name", ["empty_experts", "all_to_one", "padded_rows", "split_nibbles",
                                  "swap_int_decode", "swap_split_int"])
def test_gate_up_codes_exact(name):
    (ids, weights, x, (w13, s13, w2, s2)), r, cfg, hq, hs = run_gate_up(name)
    E = w13.shape[0]
    h, hb, amb = h_reference(x, ids, weights, w13, s13, LIMIT)
    bound, deq_ref = h_bound(h, hb, amb)
    q, s = act_quant_sim(hb)
    n_valid = int(r.offsets[E])
    pairs = r.order[:n_valid]
    got_codes = hq[:n_valid].view(torch.uint8).view(n_valid, -1, 128)
    want_codes = q[pairs].float().to(torch.float8_e4m3fn).view(torch.uint8).view(n_valid, -1, 128)
    exact = ~amb[pairs].view(n_valid, -1, 128).any(2)  # [pairs, I / 128]
    assert bool((got_codes == want_codes).all(2)[exact].all())
    assert torch.equal(hs[:n_valid][exact].double(), s[pairs][exact])
    assert int(exact.sum()) >= n_valid  # on average one exact block per pair at least: the check bites
    deq = hq[:n_valid].double() * hs[:n_valid].double().repeat_interleave(128, 1)
    assert_within(deq, deq_ref[pairs], bound[pairs], "dequantised h")


@pytest.mark.parametrize("name", ["padded_rows", "d_tail_prefill_tiles", "split_nibbles",
                                  "swap_int_decode"])
def test_down_and_combine_from_kernel_h(name):
    (ids, weights, x, (w13, s13, w2, s2)), r, cfg, hq, hs = run_gate_up(name)
    T, k = ids.shape
    E, I = w13.shape[0], w13.shape[1] // 2
    y = M.moe_down(hq, hs, w2, s2, r, cfg)
    out = M.moe_combine(y, ids, E)
    n_valid = int(r.offsets[E])
    pairs = r.order[:n_valid]
    hdeq = torch.zeros(T * k, I, dtype=torch.float64)
    hdeq[pairs] = hq[:n_valid].double() * hs[:n_valid].double().repeat_interleave(128, 1)
    yr, mag, _ = y_reference(hdeq, torch.zeros_like(hdeq), ids, w2, s2)
    assert_within(y[pairs], yr[pairs], y_tol(yr, mag, 0.0, I)[pairs], "y")
    ref, tol = combine_tol(y.double(), torch.zeros_like(yr), ids, E)  # the kernel's own y, summed
    assert_within(out, ref, tol, "out")
    if name == "padded_rows":
        assert torch.equal(out[4], torch.zeros_like(out[4]))


def run_decode_gate_up(name):
    """A case through the decode gate-up GEMV and the SwiGLU + quant kernel: (inputs, configs, hq, hs)."""
    ids, weights, x, (w13, s13, w2, s2), cfg = case_inputs(name)
    T, k = ids.shape
    cfg = cfg or M.pick_moe_config(T * k, w13.shape[0])
    auto = D.pick_gemv_configs(T * k)
    up, down = cfg.gemv_gate_up or auto[0], cfg.gemv_down or auto[1]
    xq, xs = M.act_quant_fp8(x)
    flat = ids.reshape(-1)
    part = D.fp4_gemv(xq, xs, flat, w13, s13, k, up)
    assert part.shape[0] == D._splits(x.shape[1], up)[1]
    hq, hs = D.swiglu_quant(part, flat, weights.reshape(-1), w13.shape[0], LIMIT)
    return (ids, weights, x, (w13, s13, w2, s2)), down, hq, hs


@pytest.mark.parametrize("name", DECODE_CASES)
def test_decode_stages(name):
    """The GEMV path stage by stage. Gate-up + SwiGLU-quant as test_gate_up_codes_exact, at each
    pair's own row (a skipped pair's h is 0); then the down GEMV's split sums against float64
    from the kernel's own h, and the combine of those."""
    (ids, weights, x, (w13, s13, w2, s2)), down, hq, hs = run_decode_gate_up(name)
    T, k = ids.shape
    E, I = w13.shape[0], w13.shape[1] // 2
    h, hb, amb = h_reference(x, ids, weights, w13, s13, LIMIT)
    bound, deq_ref = h_bound(h, hb, amb)
    q, s = act_quant_sim(hb)
    flat = ids.reshape(-1)
    pairs = ((flat >= 0) & (flat < E)).nonzero().squeeze(1)
    n = pairs.numel()
    got = hq[pairs].view(torch.uint8).view(n, -1, 128)
    want = q[pairs].float().to(torch.float8_e4m3fn).view(torch.uint8).view(n, -1, 128)
    exact = ~amb[pairs].view(n, -1, 128).any(2)
    assert bool((got == want).all(2)[exact].all())
    assert torch.equal(hs[pairs][exact].double(), s[pairs][exact])
    assert int(exact.sum()) >= n
    hdeq = torch.zeros(T * k, I, dtype=torch.float64)
    hdeq[pairs] = hq[pairs].double() * hs[pairs].double().repeat_interleave(128, 1)
    assert_within(hdeq[pairs], deq_ref[pairs], bound[pairs], "dequantised h")
    skipped = ((flat < 0) | (flat >= E)).nonzero().squeeze(1)
    assert bool((hq[skipped].view(torch.uint8) == 0).all())

    part = D.fp4_gemv(hq, hs, flat, w2, s2, 1, down)
    assert part.shape[0] == D._splits(I, down)[1]
    y = part[0].clone()
    for sp in range(1, part.shape[0]):  # the kernels' order: fp32 adds, split by split
        y += part[sp]
    yr, mag, _ = y_reference(hdeq, torch.zeros_like(hdeq), ids, w2, s2)
    assert_within(y[pairs], yr[pairs], (I + 2) * U32 * 1.01 * mag[pairs], "y (fp32 split sums)")
    out = D.combine_splits(part, ids, E)
    ref, tol = combine_tol(bf16(y), torch.zeros_like(yr), ids, E)
    assert_within(out, ref, tol, "out")


@pytest.mark.parametrize("name", sorted(set(CASES) - {"padded_rows", "gemv_tails_e4m3", "gemv_split_padded"}))
def test_fp4_moe_end_to_end(name):
    ids, weights, x, (w13, s13, w2, s2), cfg = case_inputs(name)
    E, I = w13.shape[0], w13.shape[1] // 2
    out = M.fp4_moe(x, ids, weights, w13, s13, w2, s2, LIMIT, config=cfg)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    bound, deq_ref = h_bound(*h_reference(x, ids, weights, w13, s13, LIMIT))
    yr, mag, carried = y_reference(deq_ref, bound, ids, w2, s2)
    ref, tol = combine_tol(yr, y_tol(yr, mag, carried, I), ids, E)
    assert_within(out, ref, tol, "out")


def test_bad_inputs_name_the_tensor():
    ids, weights, x, (w13, s13, w2, s2), _ = case_inputs("t1")
    with pytest.raises(ValueError, match="w2_scale"):
        M.fp4_moe(x, ids, weights, w13, s13, w2, s2[:, :, :1], LIMIT)
    with pytest.raises(ValueError, match="weights"):
        M.fp4_moe(x, ids, weights.double(), w13, s13, w2, s2, LIMIT)
    with pytest.raises(ValueError, match="w13"):
        M.fp4_moe(x, ids, weights, w13[:, :, :4], s13, w2, s2, LIMIT)


@pytest.mark.parametrize("T,k,E,block_m", [(1, 6, 256, 16), (64, 6, 256, 16), (7, 3, 8, 4), (20, 2, 4, 64)])
def test_route_fused_equals_route(T, k, E, block_m):
    """The one-launch routing gives the torch routing's tensors bit for bit (skipped pairs too)."""
    gen = torch.Generator().manual_seed(T * 7 + E)
    ids = random_ids(T, k, E, gen)
    ids[0, -1] = -1
    if T > 2:
        ids[2, :] = E  # a whole row out of range
        ids[1, 0] = ids[T - 1, 0]  # two pairs of one expert in one column: the stable order matters
    want = M.route(ids, E, block_m)
    got = M.route_fused(ids, E, block_m)
    check_routing(got, ids, E, block_m)
    for name in M.Routing._fields:
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_unrouted_swiglu_and_the_shared_combine():
    """The shared expert's pieces of ``fp4_mma.fp4_moe_mma(shared=...)``: the SwiGLU + act-quant
    kernel without routing gives the codes and scales of expert 0 at weight 1 (an exact factor),
    and the combine with shared partials is bf16(bf16(their ordered sum) + the routed combine),
    the unfused ``shared + routed`` of two bf16 tensors, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    T, k, E, I, Dm = 3, 2, 4, 256, 384
    part = torch.randn(2, T, 2 * I, generator=gen) * 4
    hq, hs = D.swiglu_quant(part, None, None, 0, LIMIT)
    hq1, hs1 = D.swiglu_quant(part, torch.zeros(T, dtype=torch.int64), torch.ones(T), 1, LIMIT)
    assert torch.equal(hq.view(torch.uint8), hq1.view(torch.uint8)) and torch.equal(hs, hs1)
    assert bool((hq.view(torch.uint8) != 0).any())
    with pytest.raises(ValueError, match="together"):
        D.swiglu_quant(part, torch.zeros(T, dtype=torch.int64), None, 1, LIMIT)

    ids = torch.tensor([[0, 3], [-1, 1], [2, 2]])
    down = torch.randn(2, T * k, Dm, generator=gen)
    shared = torch.randn(3, T, Dm, generator=gen) * 8
    routed = D.combine_splits(down, ids, E)
    got = D.combine_splits(down, ids, E, shared)
    sh = shared[0].clone()
    for sp in (1, 2):
        sh += shared[sp]
    assert torch.equal(got, sh.to(torch.bfloat16) + routed)
    with pytest.raises(ValueError, match="shared"):
        D.combine_splits(down, ids, E, shared[:, :2])
