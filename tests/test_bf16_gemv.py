"""The one-row bf16 GEMV (dsv4_backend/kernels/bf16_gemv.py) against float64, and its dispatch.

On a machine without CUDA it runs under TRITON_INTERPRET=1 (tests/conftest.py). Bound: the
products of bf16 values are exact in fp32 and the K-term sum in any order is within
``gamma(K) sum |x w|`` of exact (tests/bounds.py); the bf16 store adds half a step of the result:
``|y - y64| <= gamma(K) sum |x w| (1 + BF16_HALF) + BF16_HALF |y64|``; a float32 output (the
compressors' projections) is the fp32 sum itself, within ``gamma(K) sum |x w|``.
"""

from __future__ import annotations

import pytest
import torch

from bounds import BF16_HALF, assert_within, gamma
from dsv4_backend.kernels.bf16_gemv import GemvConfig, bf16_gemv

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check(x, w, groups=1, config=None):
    y = bf16_gemv(x.to(DEV), w.to(DEV), groups=groups, config=config).cpu()
    xd, wd = x.double(), w.double()
    G = groups
    xg = xd.view(1, G, -1)
    wg = wd.view(G, -1, wd.shape[1])
    y64 = torch.einsum("tgi,gri->tgr", xg, wg).reshape(1, -1)
    mag = torch.einsum("tgi,gri->tgr", xg.abs(), wg.abs()).reshape(1, -1)
    K = w.shape[1]
    assert y.dtype == torch.bfloat16 and y.shape == (1, w.shape[0])
    assert_within(y, y64, gamma(K) * mag * (1 + BF16_HALF) + BF16_HALF * y64.abs(), "gemv")
    return y


@pytest.mark.parametrize("N, K, block_n", [(40, 200, 8), (64, 1024, 16)])
def test_one_row_against_float64(N, K, block_n):
    g = torch.Generator().manual_seed(N + K)
    x = torch.randn(1, K, generator=g).bfloat16()
    w = torch.randn(N, K, generator=g).bfloat16()
    check(x, w, config=GemvConfig(block_n=block_n, block_k=128))   # several K steps, a partial last block


@pytest.mark.parametrize("N, K, config", [(40, 200, GemvConfig(block_n=8, block_k=128)),
                                          (6, 300, GemvConfig(block_n=2, block_k=256, num_warps=2))])
def test_float32_output_against_float64(N, K, config):
    g = torch.Generator().manual_seed(3 * N + K)
    x = torch.randn(1, K, generator=g).bfloat16()
    w = torch.randn(N, K, generator=g).bfloat16()
    y = bf16_gemv(x.to(DEV), w.to(DEV), config=config, out_dtype=torch.float32).cpu()
    assert y.dtype == torch.float32 and y.shape == (1, N)
    mag = x.double().abs() @ w.double().abs().T
    assert_within(y, x.double() @ w.double().T, gamma(K) * mag, "gemv fp32 out")
    # the bf16 output is this sum rounded once
    assert torch.equal(bf16_gemv(x.to(DEV), w.to(DEV), config=config).cpu(), y.bfloat16())


def test_scaled_output_is_the_bf16_product_times_the_scale():
    """``scale`` gives what the indexer's ``weights_proj(x) * scale`` gives: the bf16 result times
    the scalar in fp32, rounded to bf16 again."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(1, 192, generator=g).bfloat16().to(DEV)
    w = torch.randn(12, 192, generator=g).bfloat16().to(DEV)
    scale = 128 ** -0.5 * 64 ** -0.5
    cfg = GemvConfig(block_n=4, block_k=64)
    want = (bf16_gemv(x, w, config=cfg).float() * torch.tensor(scale, dtype=torch.float32)).bfloat16()
    assert torch.equal(bf16_gemv(x, w, config=cfg, scale=scale), want)
    # in a float32 output: the same bf16 values, stored exactly
    assert torch.equal(bf16_gemv(x, w, config=cfg, scale=scale, out_dtype=torch.float32), want.float())


def test_grouped_rows_read_their_group_of_columns():
    g = torch.Generator().manual_seed(5)
    G, R, Kg = 4, 16, 96
    x = torch.randn(1, G * Kg, generator=g).bfloat16()
    w = torch.randn(G * R, Kg, generator=g).bfloat16()
    y = check(x, w, groups=G, config=GemvConfig(block_n=8, block_k=64))
    # group 2 alone: the same rows against its own columns
    y2 = bf16_gemv(x[:, 2 * Kg:3 * Kg].to(DEV), w[2 * R:3 * R].to(DEV), config=GemvConfig(block_n=8, block_k=64))
    assert torch.equal(y[:, 2 * R:3 * R], y2.cpu())


def test_bad_inputs_are_named():
    x = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEV)
    w = torch.zeros(32, 64, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="one row"):
        bf16_gemv(x, w)
    with pytest.raises(ValueError, match="2-D bf16"):
        bf16_gemv(x[:1].float(), w)
    with pytest.raises(ValueError, match="bf16 or float32"):
        bf16_gemv(x[:1], w, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="must divide"):
        bf16_gemv(torch.zeros(1, 4 * 16, dtype=torch.bfloat16, device=DEV), w[:24, :16], groups=4,
                  config=GemvConfig(block_n=4))


def test_model_dispatch(monkeypatch):
    """dense_linear and the grouped output projection take the GEMV where it applies (forced on
    CPU tensors here) and give its result; other shapes keep F.linear / the einsum."""
    from dsv4_backend.layers import linear as lin
    calls = []
    real = lin.gemv_applies
    monkeypatch.setattr(lin, "gemv_applies", lambda x, w, dt, least=None: calls.append(x.shape) or (
        x.dtype == w.dtype == torch.bfloat16 and dt in (torch.bfloat16, torch.float32)
        and x.numel() == x.shape[-1] and w.shape[0] >= 32))
    g = torch.Generator().manual_seed(9)
    w = torch.randn(48, 64, generator=g).bfloat16().to(DEV)
    x = torch.randn(1, 64, generator=g).bfloat16().to(DEV)
    assert torch.equal(lin.dense_linear(x, w), bf16_gemv(x, w))
    x3 = torch.randn(3, 64, generator=g).bfloat16().to(DEV)
    assert torch.equal(lin.dense_linear(x3, w), torch.nn.functional.linear(x3, w))
    assert len(calls) == 2 and real is not lin.gemv_applies
    # float32 out (a compressor's projections of a bf16 row): the GEMV's fp32 sums
    assert torch.equal(lin.dense_linear(x, w, torch.float32), bf16_gemv(x, w, out_dtype=torch.float32))
    # more rows: the fp32 path dense_linear takes without the GEMV (on CUDA the bf16 weight read as stored)
    rows_ref = lin.fp32_linear(x3, w) if lin.fp32_applies(x3, w) else torch.nn.functional.linear(x3.float(), w.float())
    assert torch.equal(lin.dense_linear(x3, w, torch.float32), rows_ref)

    # the grouped output projection: wo_a by the GEMV, then wo_b, against the einsum path's bound
    from types import SimpleNamespace

    from dsv4_backend import model as model_mod
    G, R, Kg = 4, 16, 32
    wo_a = model_mod.Linear(Kg, G * R).to(DEV)
    wo_a.weight.data = torch.randn(G * R, Kg, generator=g).bfloat16().to(DEV)
    wo_b = model_mod.Linear(G * R, 24).to(DEV)
    wo_b.weight.data = torch.randn(24, G * R, generator=g).bfloat16().to(DEV)
    attn = SimpleNamespace(o_groups=G, cfg=SimpleNamespace(o_lora_rank=R), wo_a=wo_a, wo_b=wo_b)
    o = torch.randn(1, 8, G * Kg // 8, generator=g).bfloat16().to(DEV)
    monkeypatch.setattr(model_mod, "gemv_applies", lambda x, w, dt: x.numel() == x.shape[-1])
    z_gemv = bf16_gemv(o.reshape(1, -1), wo_a.weight, groups=G)
    assert torch.equal(model_mod.Attention._project_out(attn, o), wo_b(z_gemv))
    monkeypatch.setattr(model_mod, "gemv_applies", lambda x, w, dt: False)
    z = torch.einsum("tgi,gri->tgr", o.reshape(1, G, Kg), wo_a.weight.view(G, R, Kg)).reshape(1, -1)
    mag = torch.einsum("tgi,gri->tgr", o.reshape(1, G, Kg).double().abs(),
                       wo_a.weight.view(G, R, Kg).double().abs()).reshape(1, -1)
    # both products within gamma(Kg) of exact, each rounded to bf16 once: one bf16 step apart at most
    assert_within(z_gemv.cpu(), z.cpu(), (2 * gamma(Kg) * mag).cpu() + 2 * BF16_HALF * z.double().abs().cpu()
                  + BF16_HALF * z_gemv.double().abs().cpu(), "grouped gemv vs einsum")
