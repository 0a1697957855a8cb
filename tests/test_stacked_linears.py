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
