"""The prefill path of the packed FP4 experts (kernels/fp4_moe_prefill.py): the fragment-order
dequantisation bit for bit against the release format's, and the path end to end against
test_fp4_moe's float64 contract. On the CPU (the Triton interpreter, torch's grouped matmul) and,
where there is one, on CUDA."""

import pytest
import torch

from dsv4_backend.kernels._common import interpreting

from dsv4_backend.kernels import fp4_mma as F
from dsv4_backend.kernels import fp4_moe_prefill as P
from dsv4_backend.layers.quant import dequant_fp4
from test_fp4_moe import LIMIT, assert_within, case_inputs, combine_tol, fp4_dequant_sim, h_bound, h_reference, \
    y_reference, y_tol

# silu(g) = g / (1 + exp(-g)): exp overflows to inf for g << 0 and the quotient is the correct -0
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
# the CPU case runs the Triton kernels in the interpreter (a CUDA machine without it: CUDA only)
DEVICES = (["cpu"] if interpreting() or not torch.cuda.is_available() else []) + \
    (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_dequant_equals_the_release_format(device):
    """Three experts of 48 x 640 (three tiles; five chunks: a program with one past the end), every
    nibble code, scale bytes 2..240 (the range the kernels support) at some rows."""
    gen = torch.Generator().manual_seed(3)
    E, N, K = 3, 48, 640
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen)
    s = torch.randint(110, 131, (E, N, K // 32), dtype=torch.uint8, generator=gen)
    s[0, 0, 0], s[1, 5, 3], s[2, 47, 19] = 2, 240, 127
    pack = F.pack_fp4_mma(w.to(device), s.to(device))
    got = P.dequant_experts(pack, 1, 3).cpu()
    assert torch.equal(got, dequant_fp4(w[1:3], s[1:3], torch.bfloat16))
    want = torch.stack([fp4_dequant_sim(w[e], s[e]) for e in (1, 2)])
    assert torch.equal(got.double(), want)
    assert P.dequant_experts(pack, 2, 2).shape == (0, N, K)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,chunk", [("t1", 16), ("empty_experts", 3), ("all_to_one", 3), ("padded_rows", 16),
                                        ("grouped_padded_rows", 5)])
def test_prefill_path_meets_the_contract(name, chunk, device, monkeypatch):
    """Exact first projection, the ambiguity windows for h, the down projection's accumulation
    bound doubled (the library's fp32 sums in its own order), padded and out-of-range ids
    skipped; ``chunk``: experts dequantised at a time (3, 5: several chunks, some without rows)."""
    monkeypatch.setattr(P, "DEQUANT_EXPERTS", chunk)
    ids, weights, x, (w13, s13, w2, s2), _ = case_inputs(name)
    E, I = w13.shape[0], w13.shape[1] // 2
    c = lambda t: t.to(device)  # noqa: E731
    packs = F.pack_fp4_mma(c(w13), c(s13)), F.pack_fp4_mma(c(w2), c(s2))
    out = P.fp4_moe_prefill(c(x), c(ids), c(weights), *packs, LIMIT).cpu()
    bound, deq_ref = h_bound(*h_reference(x, ids, weights, w13, s13, LIMIT))
    yr, mag, carried = y_reference(deq_ref, bound, ids, w2, s2)
    ref, tol = combine_tol(yr, y_tol(yr, mag, carried, I, acc_ulps=2.0), ids, E)
    assert_within(out, ref, tol, f"fp4_moe_prefill {name} on {device}")


def test_the_token_rule(monkeypatch):
    monkeypatch.setattr(P, "PREFILL_MIN_TOKENS", 2048)
    assert P.applies(2048) and P.applies(8192) and not P.applies(2047)
    monkeypatch.setattr(P, "PREFILL_MIN_TOKENS", 0)  # DSV4_FP4_PREFILL_MIN_TOKENS=0: never
    assert not P.applies(1 << 20)
