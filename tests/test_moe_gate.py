"""The MoE gate kernels (dsv4_backend/kernels/moe_gate.py) under the interpreter, against the
float64 value of ``model.Gate.forward``'s formula.

Bounds (tests/bounds.py): the score's fp32 dot is within ``gamma(D) sum |x w|`` of the exact one;
``sqrt(softplus(.))`` has slope at most 1/2 and adds a few roundings (exp, log, sqrt: 8u of s);
a routing weight ``s_j / sum s`` then carries both relative errors plus 4u. The chosen experts
must equal the reference's wherever the top-k margin (k-th against (k+1)-th key) exceeds twice
the score bound, which the test asserts of its inputs first, so an equality is not luck.
"""

from __future__ import annotations

import pytest
import torch

from bounds import U32, assert_within, gamma
from dsv4_backend.kernels.moe_gate import moe_gate, scores_block_e

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _gate(x, weight, bias, topk, scale, tid2eid=None, tokens=None, block_e=None):
    """moe_gate on DEV (the interpreter off the GPU), results back on the CPU."""
    dev = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    ids, w = moe_gate(dev(x), dev(weight), dev(bias), topk, scale, dev(tid2eid), dev(tokens), block_e=block_e)
    return ids.cpu(), w.cpu()


def _reference(x, weight, bias, topk, scale, tid2eid=None, tokens=None):
    z = x.double() @ weight.double().T
    s = torch.nn.functional.softplus(z).sqrt()
    ids = tid2eid[tokens] if bias is None else (s + bias.double()).topk(topk, dim=-1).indices
    w = s.gather(-1, ids)
    mag = (x.double().abs() @ weight.double().abs().T)
    return z, s, ids, w / w.sum(-1, keepdim=True) * scale, mag


@pytest.mark.parametrize("E,topk,dtype,block_e", [(8, 6, torch.bfloat16, None), (20, 2, torch.float32, 8),
                                                   (256, 6, torch.bfloat16, None), (256, 6, torch.bfloat16, 8)])
def test_scored_routing(E, topk, dtype, block_e):
    T, D, scale = 3, 96, 1.5
    g = torch.Generator().manual_seed(E)
    x = torch.randn(T, D, generator=g).to(dtype)
    weight = (torch.randn(E, D, generator=g) * 0.3).to(dtype)
    bias = (torch.randn(E, generator=g) * 0.1).float()
    z, s, ids_ref, w_ref, mag = _reference(x, weight, bias, topk, scale)
    tol_s = 0.5 * gamma(D) * mag + 8 * U32 * s
    key = (s + bias.double()).sort(-1, descending=True).values
    if topk < E:
        assert bool(((key[:, topk - 1] - key[:, topk]) > 2 * tol_s.max()).all()), "inputs with a near-tie"
    ids, w = _gate(x, weight, bias, topk, scale, block_e=block_e)
    assert torch.equal(ids, ids_ref)
    ts = tol_s.gather(-1, ids_ref)
    sj = s.gather(-1, ids_ref)
    tol_w = w_ref.abs() * (ts / sj + ts.sum(-1, keepdim=True) / sj.sum(-1, keepdim=True) + 4 * U32)
    assert_within(w, w_ref, tol_w, "routing weights")


def test_hash_routing():
    T, D, E, topk, V = 4, 64, 16, 6, 50
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    weight = (torch.randn(E, D, generator=g) * 0.3).to(torch.bfloat16)
    tid2eid = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(V)])
    tokens = torch.tensor([3, 49, 0, 3])
    z, s, ids_ref, w_ref, mag = _reference(x, weight, None, topk, 1.0, tid2eid, tokens)
    ids, w = _gate(x, weight, None, topk, 1.0, tid2eid, tokens)
    assert torch.equal(ids, ids_ref)
    tol_s = 0.5 * gamma(D) * mag + 8 * U32 * s
    ts, sj = tol_s.gather(-1, ids_ref), s.gather(-1, ids_ref)
    tol_w = w_ref.abs() * (ts / sj + ts.sum(-1, keepdim=True) / sj.sum(-1, keepdim=True) + 4 * U32)
    assert_within(w, w_ref, tol_w, "routing weights")


def test_softplus_tails():
    """Scores far below zero (where 1 + e^z rounds to 1 in fp32) and past the threshold of 20."""
    D = 1
    x = torch.ones(1, D)
    weight = torch.tensor([[-30.0], [-12.0], [-3.0], [0.0], [5.0], [25.0]])
    bias = torch.zeros(6)
    z, s, ids_ref, w_ref, _ = _reference(x, weight, bias, 6, 1.0)
    ids, w = _gate(x, weight, bias, 6, 1.0)
    assert torch.equal(ids, ids_ref)
    assert_within(w, w_ref, 1e-6 * w_ref.abs() + 1e-12, "routing weights")


def test_scores_block_e_covers_the_sms():
    """Eight experts a program while that leaves two programs per SM; one token of Flash's 256
    experts gets one a program (256 programs on 132 SMs), never fewer than one."""
    assert scores_block_e(64, 256, 132) == 8
    assert scores_block_e(1, 256, 132) == 1
    assert scores_block_e(4, 256, 132) == 2
    assert scores_block_e(1, 8, 132) == 1
    assert scores_block_e(1000, 4, 132) == 4


def test_bad_inputs():
    x = torch.zeros(2, 8, device=DEV)
    with pytest.raises(ValueError, match="bias"):
        moe_gate(x, torch.zeros(4, 8, device=DEV), None, 2, 1.0)
    with pytest.raises(ValueError, match="share D"):
        moe_gate(x, torch.zeros(4, 9, device=DEV), torch.zeros(4, device=DEV), 2, 1.0)


@pytest.mark.parametrize("D", [512, 200])     # whole 128-blocks, and a 72-wide tail block
def test_quantize_is_act_quant_and_changes_no_route(D):
    """``quantize=True``: the extra programs' codes and scales equal ``act_quant_fp8(x)`` bit for bit
    (the same rounding per 128-block), and the ids and weights equal the two-output launch's."""
    from dsv4_backend.kernels.fp8_gemm import act_quant_fp8
    T, E, topk = 3, 16, 4
    g = torch.Generator().manual_seed(D)
    x = (torch.randn(T, D, generator=g) * torch.linspace(1e-3, 1e3, D)).to(torch.bfloat16).to(DEV)
    weight = (torch.randn(E, D, generator=g) * 0.3).to(torch.bfloat16).to(DEV)
    bias = (torch.randn(E, generator=g) * 0.1).float().to(DEV)
    ids, w, xq, xs = moe_gate(x, weight, bias, topk, 1.5, quantize=True)
    ids0, w0 = moe_gate(x, weight, bias, topk, 1.5)
    assert torch.equal(ids, ids0) and torch.equal(w, w0)
    q_ref, s_ref = act_quant_fp8(x)
    assert xq.dtype == torch.float8_e4m3fn and xq.shape == (T, D) and xs.shape == (T, -(-D // 128))
    assert torch.equal(xq.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(xs, s_ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the FP4 MMA experts need CUDA")
def test_engine_with_gate_quant_equals_without(tmp_path, monkeypatch):
    """An FP8/FP4 Engine (FP4 MMA experts, fused shared expert, decode graphs) gives the same
    greedy tokens and logprobs whether the experts' act-quant comes from the gate's launch or
    from their own: the same codes, so the same bits."""
    from cuda_decode import greedy_decode, write_fp8_checkpoint
    from dsv4_backend import model
    from dsv4_backend.kernels import moe_gate as gate_mod
    path = write_fp8_checkpoint(tmp_path)
    monkeypatch.setattr(model, "USE_GATE_QUANT", False)
    want = greedy_decode(path)
    monkeypatch.setattr(model, "USE_GATE_QUANT", True)
    quantized = []

    def counting(*args, quantize=False, **kw):
        quantized.append(quantize)
        return moe_gate(*args, quantize=quantize, **kw)
    monkeypatch.setattr(gate_mod, "moe_gate", counting)
    assert greedy_decode(path) == want
    assert any(quantized), "the gate's act-quant programs never ran"
