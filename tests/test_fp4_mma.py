"""FP4 experts in MMA fragment order (kernels/fp4_mma.py).

On the CPU: the packed order, the kernel's bit moves and its addressing, recomputed register by
register in float64 (``emulate_fp4_mma``), equal a float64 product of the release-format weights
(the sums differ only in order: within ``gamma(K, U64)`` of the absolute terms). On CUDA: the
kernel against that emulation within the fp32 accumulation bound (the MMA's fp32 adds may
truncate instead of rounding to nearest, hence two units), and the decode MoE with it against the
Triton decode path.
"""

import pytest
import torch

from bounds import U32, U64, assert_within, gamma
from dsv4_backend import side_stream
from dsv4_backend.kernels import fp4_mma as F
from test_fp4_moe import fp4_dequant_sim

E, N, K = 3, 32, 256


def _weights(gen, n=N, k=K, experts=E):
    w = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, generator=gen, device=gen.device)
    s = torch.randint(110, 131, (experts, n, k // 32), dtype=torch.uint8, generator=gen, device=gen.device)
    return w, s


def _acts(rows, k, gen):
    """Random e4m3 codes (no NaN) and power-of-two 1x128 scales."""
    codes = torch.randint(0, 256, (rows, k), dtype=torch.uint8, generator=gen, device=gen.device)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)
    scales = torch.pow(2.0, torch.randint(-6, 3, (rows, k // 128), generator=gen, device=gen.device).float())
    return codes.view(torch.float8_e4m3fn), scales


def _reference(act_q, act_s, ids, w, s, row_div):
    """float64 [P, N] and the sums of |terms| (for bounds); rows of invalid pairs 0."""
    x = act_q.view(torch.uint8).cpu().view(torch.float8_e4m3fn).double() \
        * act_s.cpu().double().repeat_interleave(128, 1)
    flat = ids.reshape(-1).cpu()
    out = torch.zeros(flat.numel(), w.shape[1], dtype=torch.float64)
    mag = torch.zeros_like(out)
    for p, e in enumerate(flat.tolist()):
        if 0 <= e < w.shape[0]:
            wd = fp4_dequant_sim(w[e].cpu(), s[e].cpu())
            out[p] = wd @ x[p // row_div]
            mag[p] = wd.abs() @ x[p // row_div].abs()
    return out, mag


@pytest.mark.parametrize("row_div", [1, 2])
def test_emulation_equals_release_format_product(row_div):
    gen = torch.Generator().manual_seed(7)
    w, s = _weights(gen)
    pack = F.pack_fp4_mma(w, s, experts_per_step=2)
    ids = torch.tensor([2, 0, -1, 2, 5, 1], dtype=torch.int64)  # -1 and 5: skipped pairs
    act_q, act_s = _acts(ids.numel() // row_div, K, gen)
    got = F.emulate_fp4_mma(act_q, act_s, ids, pack, row_div)
    want, mag = _reference(act_q, act_s, ids, w, s, row_div)
    assert_within(got, want, gamma(2 * K, U64) * mag, "emulated fragment-order product")
    assert (want[2] == 0).all() and (got[2] == 0).all() and (got[4] == 0).all()


def test_pack_is_a_permutation_of_the_nibbles_and_scales():
    gen = torch.Generator().manual_seed(3)
    w, s = _weights(gen, experts=1)
    pack = F.pack_fp4_mma(w, s)
    words = pack.words.to(torch.int64) & 0xFFFFFFFF
    codes = [((words >> (m + 16 * a)) & 7) | (((words >> (g + 16 * a)) & 1) << 3)
             for m, g in zip(F.MAG_BIT, F.SIGN_BIT) for a in (0, 1)]
    got = torch.cat([c.flatten() for c in codes])
    want = torch.stack((w & 15, w >> 4), -1).flatten().long()
    assert torch.equal(torch.bincount(got, minlength=16), torch.bincount(want, minlength=16))
    biased = pack.scales.view(torch.uint8).flatten().long() - F.SCALE_BIAS
    assert torch.equal(biased.sort().values, s.flatten().long().sort().values)
    uw, us = F.unpack_fp4_mma(pack)
    assert torch.equal(uw, w) and torch.equal(us, s)
    # one changed nibble changes exactly one packed word
    w2 = w.clone()
    w2[0, 17, 45] ^= 0x30
    diff = (F.pack_fp4_mma(w2, s).words != pack.words)
    assert int(diff.sum()) == 1


def test_pack_refuses_out_of_range_inputs():
    gen = torch.Generator().manual_seed(1)
    w, s = _weights(gen, experts=1)
    s[0, 3, 1] = F.MAX_SCALE_BYTE + 1
    with pytest.raises(ValueError, match="scale byte is 241"):
        F.pack_fp4_mma(w, s)
    with pytest.raises(ValueError, match="multiple of 16"):
        F.pack_fp4_mma(w[:, :24], s[:, :24])
    with pytest.raises(ValueError, match="uint8"):
        F.pack_fp4_mma(w.to(torch.int16), s)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel needs CUDA")


@cuda
@pytest.mark.parametrize("pairs,config", [
    (6, F.MmaConfig(1)), (6, F.MmaConfig(4, 2)), (40, F.MmaConfig(2, 3)), (40, F.MmaConfig(1, 6)),
    (40, F.MmaConfig(1, 4, 4)), (40, F.MmaConfig(2, 4, 4, True)), (300, F.MmaConfig(1, 4, 2, True))])
def test_kernel_equals_emulation(pairs, config):
    gen = torch.Generator(device="cuda").manual_seed(11)
    n, k, experts = 128, 512, 8
    w, s = _weights(gen, n, k, experts)
    pack = F.pack_fp4_mma(w, s)
    ids = torch.randint(-1, experts, (pairs,), generator=gen, device="cuda")
    ids[0] = 3
    ids[1:40:2] = 3  # 21 pairs of one expert: several MMA column groups, passes, routed blocks
    act_q, act_s = _acts(pairs, k, gen)
    part = F.fp4_gemv_mma(act_q, act_s, ids, pack, row_div=1, config=config)
    split = part.shape[0]
    got = part.double().sum(0).cpu()
    want, mag = _reference(act_q, act_s, ids, w, s, 1)
    valid = ((ids >= 0) & (ids < experts)).cpu()
    assert_within(got[valid], want[valid], (gamma(k, 2 * U32) + gamma(split)) * mag[valid],
                  "fp4_gemv_mma against the float64 product")
    if pairs > 40:
        return  # the emulation is slow; the float64 product above already decides
    emu = F.emulate_fp4_mma(act_q, act_s, ids, pack, 1)
    assert_within(got[valid], emu[valid], (gamma(k, 2 * U32) + gamma(split)) * mag[valid],
                  "fp4_gemv_mma against its emulation")


@cuda
@pytest.mark.parametrize("name", ["t1", "empty_experts", "all_to_one", "padded_rows"])
@pytest.mark.parametrize("routed", [False, True])
def test_moe_on_packed_weights_meets_the_contract(name, routed):
    """fp4_moe_mma end to end against test_fp4_moe's float64 contract (exact first projection,
    ambiguity windows for h, the accumulation bound of the down projection doubled)."""
    from test_fp4_moe import LIMIT, case_inputs, combine_tol, h_bound, h_reference, y_reference, y_tol

    ids, weights, x, (w13, s13, w2, s2), _ = case_inputs(name)
    E, I = w13.shape[0], w13.shape[1] // 2
    c = lambda t: t.cuda()
    packs = F.pack_fp4_mma(c(w13), c(s13)), F.pack_fp4_mma(c(w2), c(s2))
    cfg = F.MmaConfig(1, F.PREFETCH, 2, True) if routed else F.MmaConfig(2)
    out = F.fp4_moe_mma(c(x), c(ids), c(weights), *packs, LIMIT, cfg, cfg).cpu()
    bound, deq_ref = h_bound(*h_reference(x, ids, weights, w13, s13, LIMIT))
    yr, mag, carried = y_reference(deq_ref, bound, ids, w2, s2)
    ref, tol = combine_tol(yr, y_tol(yr, mag, carried, I, acc_ulps=2.0), ids, E)
    from test_fp4_moe import assert_within as moe_within
    moe_within(out, ref, tol, f"fp4_moe_mma {name}")


def _shared_expert_case(T):
    """A quantised shared expert (FP8 w1 + w3 row-stacked, w2) beside 8 packed FP4 experts, top-2."""
    from test_fp4_moe import LIMIT, make_experts, make_x, random_ids
    from dsv4_backend.layers.linear import row_stack_of, stack_rows
    from dsv4_backend.model import Expert

    gen = torch.Generator().manual_seed(100 + T)
    k, experts, dim, inter = 2, 8, 256, 256
    w13, s13, w2, s2 = (t.cuda() for t in make_experts(experts, dim, inter, gen))
    packs = F.pack_fp4_mma(w13, s13), F.pack_fp4_mma(w2, s2)
    with torch.device("cuda"):
        ex = Expert(dim, inter, LIMIT, quantized=True)
    stack_rows(ex.w1, ex.w3)
    for lin in (ex.w1, ex.w3, ex.w2):
        n, kk = lin.weight.shape
        lin.weight.copy_((torch.randn(n, kk, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn))
        lin.scale.copy_(torch.pow(2.0, torch.randint(-9, -5, tuple(lin.scale.shape), generator=gen).float()))
    st = row_stack_of((ex.w1, ex.w3))
    assert st is not None and st.scale is not None
    x = make_x(T, dim, gen).cuda()
    ids = random_ids(T, k, experts, gen).cuda()
    wts = (torch.rand(T, k, generator=gen) + 0.25).cuda()
    return x, ids, wts, packs, ex, F.SharedFp8(st.weight, st.scale, ex.w2.weight, ex.w2.scale)


@cuda
@pytest.mark.parametrize("T", [1, 3, 8, 64])
def test_fused_shared_expert_equals_the_unfused_sum(T):
    """``fp4_moe_mma(shared=...)`` against the quantised ``Expert`` run alone plus the routed MoE.

    Both run the same FP8 GEMM kernels and the same roundings (bf16 g and u, bf16 h, e4m3 h
    in 1x128 blocks, bf16 output, one bf16 add); they part only where silu's exp (the kernel's
    against torch's) tips h's bf16 rounding. Such an h moves by at most one bf16 step (2^-7 |h|)
    and its block scale at most doubles, so its dequantised e4m3 value moves by at most
    (2^-4 + 2^-7 + 2^-4) |h| + 3 s 2^-10 (normal half-steps 2^-4 relative, subnormal 2^-10 s):
    through w2 that is sum_k |w2| of it, plus both sides' fp32 accumulation (gamma(I + 2) of
    sum_k |w2| |h|), and each side's two bf16 roundings (the expert's output, the add) add 2^-8
    of |y| and |out| each."""
    from test_fp4_moe import LIMIT
    from dsv4_backend.layers.linear import shared_input

    x, ids, wts, packs, ex, shared = _shared_expert_case(T)
    inter = ex.w2.weight.shape[1]
    routed = F.fp4_moe_mma(x, ids, wts, *packs, LIMIT)
    shared_alone = ex(x)
    unfused = shared_alone + routed
    fused = F.fp4_moe_mma(x, ids, wts, *packs, LIMIT, shared=shared)
    assert fused.shape == unfused.shape and fused.dtype == torch.bfloat16

    g, u = (y.float() for y in shared_input(x, ex.w1, ex.w3))
    h = (torch.nn.functional.silu(g.clamp(max=LIMIT)) * u.clamp(-LIMIT, LIMIT)).to(torch.bfloat16)
    _, hs = F.act_quant_fp8(h)
    hd = h.double().abs().cpu()
    s = hs.double().cpu().repeat_interleave(128, 1)
    dh = (2.0 ** -3 + 2.0 ** -7) * hd + 3 * 2.0 ** -10 * s
    w2d = ex.w2.weight.double().cpu() * ex.w2.scale.double().cpu().repeat_interleave(128, 0).repeat_interleave(128, 1)
    mag = ((1 + 2.0 ** -3) * hd + 2.0 ** -9 * s) @ w2d.abs().T      # sum_k |w2| |e4m3 h|, either side
    tol = dh @ w2d.abs().T + 2 * gamma(inter + 2, U32) * mag + 2.0 ** -8 * (2 * shared_alone.double().abs().cpu() + fused.double().abs().cpu()
                                           + unfused.double().abs().cpu()) * 1.01
    assert_within(fused.cpu(), unfused.double().cpu(), tol, "fused shared expert")


@cuda
@pytest.mark.parametrize("T", [1, 8])
def test_shared_expert_on_a_second_stream_changes_no_bit(T, monkeypatch):
    """The shared expert's launches on a side stream (forked after the act-quant, joined before the
    combine) compute what they compute on one stream, eagerly and replayed from a CUDA graph."""
    from test_fp4_moe import LIMIT

    x, ids, wts, packs, _, shared = _shared_expert_case(T)
    monkeypatch.setattr(side_stream, "SHARED_EXPERT", False)
    one = F.fp4_moe_mma(x, ids, wts, *packs, LIMIT, shared=shared)
    monkeypatch.setattr(side_stream, "SHARED_EXPERT", True)
    two = F.fp4_moe_mma(x, ids, wts, *packs, LIMIT, shared=shared)
    assert torch.equal(one, two)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = F.fp4_moe_mma(x, ids, wts, *packs, LIMIT, shared=shared)
    x.neg_()    # a new input for the replay: the graph must read it, not the captured values
    graph.replay()
    monkeypatch.setattr(side_stream, "SHARED_EXPERT", False)
    assert torch.equal(replayed, F.fp4_moe_mma(x, ids, wts, *packs, LIMIT, shared=shared))
