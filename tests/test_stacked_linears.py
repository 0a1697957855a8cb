"""Linears of one input stacked into one weight (layers.linear.stack_rows): the model keeps the
release's names and values, and shared_input's single matmul equals the separate ones.

The stacking runs on CUDA; here ``model._stack_rows_for`` is forced on for a CPU model. One
output element is the same K-term dot product either way, summed in whatever order the matmul
blocks it: within gamma(K) of the sum of |terms| on each side (tests/bounds.py)."""

from __future__ import annotations

import pytest
import torch

from bounds import assert_within, gamma
from dsv4_backend import model as model_mod
from dsv4_backend.config import DSV4Config
from dsv4_backend.layers.linear import shared_input, stack_rows
from dsv4_backend.weights import random_weights

CFG = DSV4Config.preset("tiny", vocab_size=1024)


def test_stacked_model_loads_the_release_weights_and_runs_one_matmul(monkeypatch):
    monkeypatch.setattr(model_mod, "_stack_rows_for", lambda device, dtype: True)
    m = model_mod.DSV4Model(CFG, torch.float32, include_mtp=False)
    w = random_weights(CFG, seed=1, dtype=torch.float32, include_mtp=False)
    m.load_state_dict(w)
    sd = m.state_dict()
    assert set(sd) == set(w) and all(torch.equal(sd[k], w[k]) for k in w)
    attn, comp = m.layers[1].attn, m.layers[1].attn.compressor      # a CSA layer
    icomp, shared = attn.indexer.compressor, m.layers[1].ffn.shared_experts
    stacks = [(attn.wq_a, attn.wkv), (attn.wq_b, attn.indexer.wq_b), (comp.wkv, comp.wgate, icomp.wkv, icomp.wgate),
              (shared.w1, shared.w3)]
    for mods in stacks:
        for a, b in zip(mods, mods[1:]):
            assert a.row_stack is b.row_stack and a.row_stack.mods == mods
            assert b.weight.data_ptr() == a.weight.data_ptr() + a.weight.numel() * 4  # consecutive rows
    hca = m.layers[2].attn.compressor
    assert hca.wkv.row_stack.mods == (hca.wkv, hca.wgate)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, CFG.hidden_size, generator=g)
    calls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: calls.append(a[1].shape) or linear(*a))
    qa, kv = shared_input(x, attn.wq_a, attn.wkv)
    assert calls == [(CFG.q_lora_rank + CFG.head_dim, CFG.hidden_size)]             # one matmul for both
    K = CFG.hidden_size
    for got, mod in ((qa, attn.wq_a), (kv, attn.wkv)):
        want = x.double() @ mod.weight.double().t()
        mag = x.double().abs() @ mod.weight.double().abs().t()
        assert_within(got, want, gamma(K) * mag, "stacked projection")
    # a replaced parameter is no longer a slice of the stack: the modules run one by one again
    attn.wkv.weight.data = attn.wkv.weight.data.clone()
    calls.clear()
    shared_input(x, attn.wq_a, attn.wkv)
    assert len(calls) == 2


def test_stack_rows_refuses_mixed_weights():
    a, b = model_mod.Linear(8, 4), model_mod.Linear(6, 4)
    with pytest.raises(ValueError, match="in_features"):
        stack_rows(a, b)


def test_quantised_model_stacks_fp8_weights_with_their_scales(monkeypatch, tmp_path):
    """A quantised model: wq_a + wkv, wq_b + indexer.wq_b and the shared expert's w1 + w3 stack
    their e4m3 rows and their block-scale rows; the bf16 compressors stack as plain linears. The
    release's names and bytes load unchanged, and on the GPU path (the kernels stood in for by
    the torch W8A8 reference) one act-quant and one GEMM over the stack give each projection
    exactly what its own GEMM gives."""
    from dsv4_backend.checkpoint import CheckpointReader, save_checkpoint
    from dsv4_backend.layers import linear
    from dsv4_backend.layers.quant import act_quant, dequant_fp8

    monkeypatch.setattr(model_mod, "_stack_rows_for", lambda device, dtype: True)
    save_checkpoint(tmp_path, CFG, random_weights(CFG, seed=3), fmt="fp8", max_shard_bytes=1 << 20)
    items = dict(CheckpointReader(tmp_path, dtype=torch.float32, include_mtp=False, keep_quantized=True).stream())
    m = model_mod.DSV4Model(CFG, torch.float32, include_mtp=False, quantized=True)
    m.load_state_dict(items)
    sd = m.state_dict()
    assert all(torch.equal(sd[k].view(torch.uint8), v.view(torch.uint8)) if v.dtype.itemsize == 1
               else torch.equal(sd[k], v) for k, v in items.items())
    attn, shared = m.layers[1].attn, m.layers[1].ffn.shared_experts
    for mods in ((attn.wq_a, attn.wkv), (attn.wq_b, attn.indexer.wq_b), (shared.w1, shared.w3)):
        st = linear.row_stack_of(mods)
        assert st is not None and st.scale is not None
        assert st.weight.shape[0] == sum(x.weight.shape[0] for x in mods)
        assert st.scale.shape[0] == sum(x.scale.shape[0] for x in mods)
    assert linear.row_stack_of((attn.compressor.wkv, attn.compressor.wgate, attn.indexer.compressor.wkv,
                                attn.indexer.compressor.wgate)).scale is None

    def gemm(xq, xs, w, s, dtype):          # the W8A8 product of the kernel, in float64
        calls.append(tuple(w.shape))
        xd = (xq.double().unflatten(-1, (-1, 128)) * xs.double()[..., None]).flatten(-2)
        return (xd @ dequant_fp8(w, s, torch.float64).t()).to(dtype)

    calls: list = []
    kernels = {"fp8_gemm.act_quant_fp8": act_quant, "fp8_gemm.fp8_block_gemm": gemm}
    monkeypatch.setattr(linear, "_on_gpu", lambda x: True)
    monkeypatch.setattr(linear, "_kernel", lambda module, name: kernels[f"{module}.{name}"])
    x = torch.randn(3, CFG.hidden_size, generator=torch.Generator().manual_seed(4))
    qa, kv = linear.shared_input(x, attn.wq_a, attn.wkv)
    assert calls == [(CFG.q_lora_rank + CFG.head_dim, CFG.hidden_size)]            # one GEMM for both
    for got, mod in ((qa, attn.wq_a), (kv, attn.wkv)):
        calls.clear()
        assert torch.equal(got, linear.shared_input(x, mod)[0]) and len(calls) == 1


def test_stack_rows_refuses_fp8_blocks_it_cannot_split():
    from dsv4_backend.layers.linear import Fp8Linear
    with pytest.raises(ValueError, match="multiples of 128"):
        stack_rows(Fp8Linear(256, 64), Fp8Linear(256, 128))
    with pytest.raises(ValueError, match="dtype"):
        stack_rows(Fp8Linear(256, 128), model_mod.Linear(256, 128))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the FP8 GEMM kernels run on CUDA")
@pytest.mark.parametrize("M", [1, 64, 256])
def test_cuda_fp8_stack_equals_the_separate_gemms(M):
    """On the GPU, one W8A8 GEMM over stacked rows against each projection's own GEMM (over its
    slice): the same K-term sums of the same e4m3 products, so within gamma(K) of the sum of
    |terms| (the kernel may tile a wider N differently), plus one bf16 step of |y| for the two
    outputs' roundings."""
    from dsv4_backend.checkpoint import quantize_fp8_blockwise
    from dsv4_backend.layers import linear
    from dsv4_backend.layers.quant import act_fake_quant, dequant_fp8

    K, dev = 1024, torch.device("cuda")
    mods = (linear.Fp8Linear(K, 512).to(dev), linear.Fp8Linear(K, 256).to(dev))
    st = stack_rows(*mods)
    g = torch.Generator().manual_seed(M)
    for m in mods:
        w, s = quantize_fp8_blockwise(torch.randn(m.weight.shape, generator=g) * 0.05)
        m.weight.copy_(w), m.scale.copy_(s.float())
    assert linear.row_stack_of(mods) is st and st.scale is not None
    x = torch.randn(M, K, generator=g).to(dev, torch.bfloat16)
    stacked = shared_input(x, *mods)
    separate = [shared_input(x, m)[0] for m in mods]      # one module: its own GEMM
    xa = act_fake_quant(x.double())
    for got, want, m in zip(stacked, separate, mods):
        wd = dequant_fp8(m.weight, m.scale, torch.float64)
        bound = gamma(K) * (xa.abs() @ wd.abs().t()) + 2.0 ** -8 * (xa @ wd.t()).abs()
        assert_within(got, want, bound, "stacked FP8 GEMM")
