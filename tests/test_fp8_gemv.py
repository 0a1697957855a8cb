"""The one-row FP8 GEMV (dsv4_backend/kernels/fp8_gemv.py) against float64, and its dispatch.

On a machine without CUDA it runs under TRITON_INTERPRET=1 (tests/conftest.py). The float64
simulation is test_fp8_gemm's (e4m3 rounding and power-of-two scales written from the contract).
Bound: every product of an e4m3 weight and an e4m3 (or bf16) activation is exact in fp32 and the
power-of-two scales fold in exactly, so only the K-term fp32 sum rounds, in some order:
``gamma(K) sum |terms|``; a bf16 output adds half a bf16 step of the result.
"""

from __future__ import annotations

import pytest
import torch

from bounds import BF16_HALF, assert_within, gamma
from dsv4_backend.kernels import fp8_gemv
from dsv4_backend.kernels.fp8_gemm import act_quant_fp8, fp8_block_gemm, fp8_block_gemm_partials
from dsv4_backend.kernels.fp8_gemv import RowGemvConfig, W8A16Config, fp8_row_gemv, fp8_w8a16
from test_fp8_gemm import act_quant_sim, gemm_sim, random_weight

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def bound(y64, mag, K, out_dtype):
    b = gamma(K) * mag
    return b + BF16_HALF * (y64.abs() + b) if out_dtype == torch.bfloat16 else b


@pytest.mark.parametrize("N, K, cfg", [
    (256, 384, RowGemvConfig(16, 2, 4, 2)),   # two scale rows, two K steps, the second half empty
    (40, 200, RowGemvConfig(8, 1, 2, 2)),     # N and K tails (a 72-wide last block)
])
@pytest.mark.parametrize("x_dtype, out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)])
def test_quant_mode_against_float64(N, K, cfg, x_dtype, out_dtype):
    g = torch.Generator().manual_seed(N + K)
    w, ws = random_weight(N, K, g)
    x = (torch.randn(1, K, generator=g) * 3).to(x_dtype)
    x[0, :16] *= 300.0           # blocks of different scales
    y = fp8_row_gemv(x.to(DEV), w.to(DEV), ws.to(DEV), mode="quant", out_dtype=out_dtype, config=cfg).cpu()
    assert y.dtype == out_dtype and y.shape == (1, N)
    q, s = act_quant_sim(x)
    y64, mag = gemm_sim(q, s, w, ws)
    assert_within(y, y64, bound(y64, mag, K, out_dtype), "fp8 row gemv")


def test_in_kernel_rounding_is_act_quant_bit_for_bit():
    """The quant mode rounds x as act_quant_fp8 does: its output equals the codes mode fed with
    act_quant_fp8's codes and scales bit for bit (the same products summed in the same order)."""
    g = torch.Generator().manual_seed(3)
    w, ws = random_weight(128, 512, g)
    x = (torch.randn(1, 512, generator=g) * torch.tensor([1e-6, 1.0, 50.0, 1e4]).repeat_interleave(128)).bfloat16()
    x[0, 200:256] = 0.0
    w, ws, x = w.to(DEV), ws.to(DEV), x.to(DEV)
    cfg = RowGemvConfig(8, 2, 2, 2)
    xq, xs = act_quant_fp8(x)
    for out_dtype in (torch.float32, torch.bfloat16):
        a = fp8_row_gemv(x, w, ws, mode="quant", out_dtype=out_dtype, config=cfg)
        b = fp8_row_gemv(xq, w, ws, mode="codes", x_scale=xs, out_dtype=out_dtype, config=cfg)
        assert torch.equal(a, b)


def test_bf16_mode_grouped_is_the_folded_weight_product():
    """W8A16 (wo_a): each e4m3 weight times its block's power of two is the release's bf16 weight;
    group g's rows read x's g-th columns."""
    g = torch.Generator().manual_seed(5)
    G, R, Kg = 4, 32, 256
    w, ws = random_weight(G * R, Kg, g)
    x = torch.randn(1, G * Kg, generator=g).bfloat16()
    y = fp8_row_gemv(x.to(DEV), w.to(DEV), ws.to(DEV), mode="bf16", groups=G, config=RowGemvConfig(16, 1, 2, 2)).cpu()
    assert y.dtype == torch.bfloat16 and y.shape == (1, G * R)
    wd = w.double() * ws.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(wd.to(torch.bfloat16).double(), wd)        # the fold is exact in bf16
    xg, wg = x.double().view(1, G, Kg), wd.view(G, R, Kg)
    y64 = torch.einsum("tgi,gri->tgr", xg, wg).reshape(1, -1)
    mag = torch.einsum("tgi,gri->tgr", xg.abs(), wg.abs()).reshape(1, -1)
    assert_within(y, y64, bound(y64, mag, Kg, torch.bfloat16), "grouped W8A16 row gemv")


def test_one_row_dispatch(monkeypatch):
    """fp8_block_gemm and its partials take the row GEMV at M = 1 with no explicit config (one
    launch, one 'split'); DSV4_FP8_ROW_GEMV=0 (ENABLED) restores the split GEMV, within the bound."""
    g = torch.Generator().manual_seed(9)
    w, ws = random_weight(64, 1024, g)
    w, ws = w.to(DEV), ws.to(DEV)
    xq, xs = act_quant_fp8((torch.randn(1, 1024, generator=g) * 2).to(DEV))
    y = fp8_block_gemm(xq, xs, w, ws, torch.float32)
    assert torch.equal(y, fp8_row_gemv(xq, w, ws, mode="codes", x_scale=xs, out_dtype=torch.float32))
    part = fp8_block_gemm_partials(xq, xs, w, ws)
    assert part.shape == (1, 1, 64) and torch.equal(part[0], y)
    monkeypatch.setattr(fp8_gemv, "ENABLED", False)
    assert fp8_block_gemm_partials(xq, xs, w, ws).shape[0] == 2     # the split GEMV: K in two
    y_split = fp8_block_gemm(xq, xs, w, ws, torch.float32)
    y64, mag = gemm_sim(xq.cpu().double(), xs.cpu().double(), w.cpu(), ws.cpu())
    assert_within(y.cpu(), y64, bound(y64, mag, 1024, torch.float32), "row gemv")
    assert_within(y_split.cpu(), y64, bound(y64, mag, 1024, torch.float32), "split gemv")


def test_bad_inputs_are_named():
    w, ws = random_weight(64, 256, torch.Generator().manual_seed(1))
    w, ws = w.to(DEV), ws.to(DEV)
    x = torch.zeros(1, 256, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="mode"):
        fp8_row_gemv(x, w, ws, mode="int8")
    with pytest.raises(ValueError, match="one row"):
        fp8_row_gemv(torch.zeros(2, 256, dtype=torch.bfloat16, device=DEV), w, ws)
    with pytest.raises(ValueError, match="x_scale"):
        fp8_row_gemv(x.to(torch.float8_e4m3fn), w, ws, mode="codes")
    with pytest.raises(ValueError, match="w_scale"):
        fp8_row_gemv(x, w, ws[:, :1])
    with pytest.raises(ValueError, match="takes x"):
        fp8_row_gemv(x.float(), w, ws, mode="bf16")
    with pytest.raises(ValueError, match="divide 128"):
        fp8_row_gemv(x, w, ws, config=RowGemvConfig(block_n=48))


def folded(w, ws):
    return w.double() * ws.double().repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]


@pytest.mark.parametrize("M, N, Kg, G, cfg", [
    (3, 48, 200, 1, None),                          # N and K tails, one row tile
    (20, 128, 256, 2, W8A16Config(32, 16, 4, 2)),   # two row tiles, two groups of 64 rows
])
def test_w8a16_rows_against_float64(M, N, Kg, G, cfg):
    g = torch.Generator().manual_seed(M + N)
    w, ws = random_weight(N, Kg, g)
    x = torch.randn(M, G * Kg, generator=g).bfloat16()
    y = fp8_w8a16(x.to(DEV), w.to(DEV), ws.to(DEV), groups=G, config=cfg).cpu()
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    xg, wg = x.double().view(M, G, Kg), folded(w, ws).view(G, N // G, Kg)
    y64 = torch.einsum("tgi,gri->tgr", xg, wg).reshape(M, N)
    mag = torch.einsum("tgi,gri->tgr", xg.abs(), wg.abs()).reshape(M, N)
    assert_within(y, y64, bound(y64, mag, Kg, torch.bfloat16), "W8A16 rows")


def test_w8a16_one_row_is_the_row_gemv():
    g = torch.Generator().manual_seed(2)
    w, ws = random_weight(128, 256, g)
    x = torch.randn(1, 512, generator=g).bfloat16().to(DEV)
    w, ws = w.to(DEV), ws.to(DEV)
    assert torch.equal(fp8_w8a16(x, w, ws, groups=2), fp8_row_gemv(x, w, ws, mode="bf16", groups=2))
    with pytest.raises(ValueError, match="bf16"):
        fp8_w8a16(torch.zeros(65, 512, dtype=torch.bfloat16, device=DEV), w, ws, groups=2)


def test_quantised_wo_a_dispatch(monkeypatch):
    """The quantised model's wo_a keeps its e4m3 bytes: at decode sizes the W8A16 kernel, else
    the fold through the einsum; both within the bound of the float64 fold's product."""
    from types import SimpleNamespace

    from dsv4_backend import model as model_mod
    from dsv4_backend.layers.linear import Fp8WeightOnlyLinear
    g = torch.Generator().manual_seed(11)
    G, R, Kg, T = 2, 64, 128, 3
    wo_a = Fp8WeightOnlyLinear(Kg, G * R)
    w, ws = random_weight(G * R, Kg, g)
    wo_a.weight.copy_(w)
    wo_a.scale.copy_(ws)
    wo_a = wo_a.to(DEV)
    attn = SimpleNamespace(o_groups=G, cfg=SimpleNamespace(o_lora_rank=R), wo_a=wo_a, wo_b=lambda z: z)
    o = torch.randn(T, 4, G * Kg // 4, generator=g).bfloat16().to(DEV)
    monkeypatch.setattr(model_mod, "_w8a16_kernel_applies", lambda o, r: True)
    z_kernel = model_mod.Attention._project_out(attn, o)
    assert torch.equal(z_kernel, fp8_w8a16(o.reshape(T, -1), wo_a.weight, wo_a.scale, groups=G))
    monkeypatch.setattr(model_mod, "_w8a16_kernel_applies", lambda o, r: False)
    z_fold = model_mod.Attention._project_out(attn, o)
    xg, wg = o.reshape(T, G, Kg).double().cpu(), folded(w, ws).view(G, R, Kg)
    y64 = torch.einsum("tgi,gri->tgr", xg, wg).reshape(T, -1)
    mag = torch.einsum("tgi,gri->tgr", xg.abs(), wg.abs()).reshape(T, -1)
    for z in (z_kernel, z_fold):
        assert_within(z.cpu(), y64, bound(y64, mag, Kg, torch.bfloat16), "wo_a")


# ---- fp8_row.cu (CUDA only: NVRTC has no interpreter) ------------------------------------------

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="fp8_row.cu needs CUDA")
CUDA_CONFIGS = [fp8_gemv.CudaRowConfig(), fp8_gemv.CudaRowConfig(1, 8, 1, 4), fp8_gemv.CudaRowConfig(2, 2, 4, 2),
                fp8_gemv.CudaRowConfig(4, 2, 4, 4), fp8_gemv.CudaRowConfig(1, 4, 2, 1),
                fp8_gemv.CudaRowConfig(2, 8, 2, 2)]


@cuda_only
@pytest.mark.parametrize("cfg", CUDA_CONFIGS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("N, K", [(256, 1536), (128, 512), (384, 4096), (256, 8192)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_cuda_quant_mode_against_float64(N, K, cfg, out_dtype):
    """fp8_row.cu's W8A8 product within the float64 bound (K = 512 and 1,536: fewer chunks than
    the warps along K times the unroll, so some warps load nothing), and equal bit for bit to
    the codes mode fed with act_quant_fp8's output (its in-kernel rounding is act-quant's)."""
    g = torch.Generator().manual_seed(N + K)
    w, ws = random_weight(N, K, g)
    x = (torch.randn(1, K, generator=g) * torch.logspace(-5, 4, K // 128).repeat_interleave(128)).bfloat16()
    x[0, 130:200] = 0.0
    y = fp8_row_gemv(x.to(DEV), w.to(DEV), ws.to(DEV), mode="quant", out_dtype=out_dtype, config=cfg).cpu()
    assert y.dtype == out_dtype and y.shape == (1, N)
    q, s = act_quant_sim(x)
    y64, mag = gemm_sim(q, s, w, ws)
    assert_within(y, y64, bound(y64, mag, K, out_dtype), f"fp8_row.cu {cfg}")
    xq, xs = act_quant_fp8(x.to(DEV))
    codes = fp8_row_gemv(xq, w.to(DEV), ws.to(DEV), mode="codes", x_scale=xs, out_dtype=out_dtype, config=cfg)
    assert torch.equal(codes.cpu(), y)
    again = fp8_row_gemv(x.to(DEV), w.to(DEV), ws.to(DEV), mode="quant", out_dtype=out_dtype, config=cfg).cpu()
    assert torch.equal(again, y)          # a fixed summation order


@cuda_only
@pytest.mark.parametrize("cfg", CUDA_CONFIGS[:3], ids=lambda c: "x".join(map(str, c)))
def test_cuda_bf16_mode_grouped(cfg):
    """W8A16, groups of 64 rows: the CUDA kernel against the float64 product of the folded weight."""
    g = torch.Generator().manual_seed(7)
    G, R, Kg = 4, 64, 1024
    w, ws = random_weight(G * R, Kg, g)
    x = torch.randn(1, G * Kg, generator=g).bfloat16()
    y = fp8_row_gemv(x.to(DEV), w.to(DEV), ws.to(DEV), mode="bf16", groups=G, config=cfg).cpu()
    wd = w.double() * ws.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    xg, wg = x.double().view(1, G, Kg), wd.view(G, R, Kg)
    y64 = torch.einsum("tgi,gri->tgr", xg, wg).reshape(1, -1)
    mag = torch.einsum("tgi,gri->tgr", xg.abs(), wg.abs()).reshape(1, -1)
    assert_within(y, y64, bound(y64, mag, Kg, torch.bfloat16), f"grouped fp8_row.cu {cfg}")


def test_cuda_kernel_dispatch_and_refusals(monkeypatch):
    """With no config, one-row products that fp8_row.cu can take and was measured faster on go
    there (ungrouped, K <= CUDA_MAX_K, N in whole CTAs); the rest (K not a multiple of 512, fp32 x,
    grouped, rows past CUDA_MAX_K, no CUDA) stay on the Triton kernel; an explicit CudaRowConfig that cannot run is refused
    with the reason."""
    g = torch.Generator().manual_seed(11)
    w, ws = random_weight(64, 384, g)
    x = torch.randn(1, 384, generator=g).bfloat16()
    assert not fp8_gemv.cuda_row_applies(x.to(DEV), 384, "quant")            # K % 512
    assert not fp8_gemv.cuda_row_applies(x.float().to(DEV), 1024, "quant")   # fp32 activations
    assert fp8_gemv.cuda_row_applies(x.to(DEV), 1024, "quant") == (DEV.type == "cuda")
    monkeypatch.setattr(fp8_gemv, "USE_CUDA", True)
    on_cuda = DEV.type == "cuda"
    assert fp8_gemv.cuda_row_preferred(x.to(DEV), 4096, 4096, "quant", 1) == on_cuda
    assert fp8_gemv.cuda_row_preferred(x.to(DEV), 4096, 8192, "quant", 1) == on_cuda   # wo_b's rows
    assert fp8_gemv.cuda_row_config(4096, 8192, 132) == fp8_gemv.CudaRowConfig(2, 8, 2, 2)  # two warps along K
    assert not fp8_gemv.cuda_row_preferred(x.to(DEV), 4096, 16384, "quant", 1)     # rows past CUDA_MAX_K
    assert not fp8_gemv.cuda_row_preferred(x.to(DEV), 8192, 4096, "bf16", 8)       # grouped wo_a
    assert not fp8_gemv.cuda_row_preferred(x.to(DEV), 4100, 4096, "quant", 1)      # N not whole CTAs
    y = fp8_row_gemv(x.to(DEV), w.to(DEV), ws.to(DEV))                      # Triton: K = 384
    assert torch.equal(y, fp8_row_gemv(x.to(DEV), w.to(DEV), ws.to(DEV), config=RowGemvConfig()))
    with pytest.raises(ValueError, match="CUDA kernel takes"):
        fp8_row_gemv(x.to(DEV), w.to(DEV), ws.to(DEV), config=fp8_gemv.CudaRowConfig())
    monkeypatch.setattr(fp8_gemv, "USE_CUDA", False)
    assert not fp8_gemv.cuda_row_preferred(x.to(DEV), 4096, 4096, "quant", 1)
