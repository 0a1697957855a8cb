"""FP8 block-scaled GEMM and activation quantiser (kernels/fp8_gemm.py) against a float64 simulation.

The simulation is written here from the contract (QUANT_INTERFACE.md), independent of the kernel
helpers: e4m3 rounding from frexp + round-half-even, the power-of-two scale from frexp of
amax / 448. Codes and scales are compared bit for bit (quantisation is order-free); GEMM outputs
within the fp32 accumulation bound (terms per block + block adds) x 2^-24 x sum|terms|, plus half
a bf16 ulp (2^-8 relative) for bf16 outputs.
"""

import pytest
import torch

from dsv4_backend.kernels.fp8_gemm import (
    Fp8GemvConfig, GemmConfig, act_quant_fp8, fp8_block_gemm, fp8_block_gemm_partials, fp8_linear,
)

U32 = 2.0 ** -24


def exp2_exact(e: torch.Tensor) -> torch.Tensor:
    """2**e as float64 for integer-valued e in the normal range, built from the exponent bits
    (torch.pow on CUDA may be an ulp off; a reference must not be)."""
    return ((e.long() + 1023) << 52).view(torch.float64)


def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """float64 values in [-448, 448] -> nearest e4m3 value, ties to even (subnormal step 2^-9)."""
    a = v.abs()
    _, ex = torch.frexp(a)  # a = m 2^ex, m in [0.5, 1): floor(log2 a) = ex - 1
    e = torch.clamp(ex.double() - 1, min=-6)
    step = exp2_exact(e - 3)
    return torch.copysign(torch.round(a / step) * step, v)


def act_quant_sim(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (quantised values float64 [M, K] (codes x 1), scales float64 [M, ceil(K/128)])."""
    x = x.double()
    M, K = x.shape
    nb = -(-K // block)
    xp = torch.nn.functional.pad(x, (0, nb * block - K)).view(M, nb, block)
    amax = xp.abs().amax(-1).clamp_min(1e-4)
    m, ex = torch.frexp(amax / 448.0)  # amax / 448 = m 2^ex; ceil(log2) = ex - (m == 0.5)
    s = exp2_exact(ex - (m == 0.5).long())
    q = e4m3_round((xp / s[..., None]).clamp(-448, 448))
    return q.view(M, nb * block)[:, :K], s


def random_weight(N: int, K: int, gen: torch.Generator):
    w = (torch.randn(N, K, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    exps = torch.randint(-12, -4, (-(-N // 128), -(-K // 128)), generator=gen)
    return w, torch.pow(2.0, exps.float())


def gemm_sim(q, s, w, ws, block: int = 128):
    """float64 y [M, N] and sum|terms| [M, N] of the block-scaled product."""
    M, K = q.shape
    N = w.shape[0]
    a = q * s.repeat_interleave(block, 1)[:, :K]
    b = w.double() * ws.double().repeat_interleave(block, 0)[:N].repeat_interleave(block, 1)[:, :K]
    return a @ b.T, a.abs() @ b.abs().T


def assert_gemm_close(out, y, mag, K, out_dtype):
    gamma = (128 + -(-K // 128) + 2) * U32 * 1.01
    tol = gamma * mag
    if out_dtype == torch.bfloat16:
        tol = tol + 2.0 ** -8 * (y.abs() + tol)
    err = (out.double() - y).abs()
    worst = int(torch.argmax(err - tol))
    assert bool((err <= tol).all()), (
        f"worst element {worst}: got {out.flatten()[worst].item()}, want {y.flatten()[worst].item()}, "
        f"tol {tol.flatten()[worst].item()}")


def test_act_quant_codes_and_scales_exact():
    gen = torch.Generator().manual_seed(0)
    M, K = 12, 384
    x = torch.randn(M, K, generator=gen) * torch.pow(2.0, torch.randint(-20, 20, (M, 1), generator=gen).float())
    x[0, :128] = 0.0  # amax floor 1e-4
    x[1, :128] = torch.randn(128, generator=gen).clamp(-1, 1) * 56.0
    x[1, 5] = 56.0  # amax / 448 = 2^-3 exactly: scale 2^-3, the value maps to 448
    x[2, 128:256] = x[1, :128]
    x[2, 130] = 56.0 * (1 + 2 ** -23)  # just above: the next scale, 2^-2
    x[3, :128] = torch.randn(128, generator=gen) * 1e-3  # subnormal e4m3 codes after scaling
    x[4, :] = -x[4, :]
    x[5, 256:] = 1e30
    # ties between neighbouring e4m3 codes at scale 1 (amax 448 in the block)
    x[6, :128] = torch.tensor([448.0] + [1.0 + (2 * i + 1) / 16 for i in range(8)] * 15 + [0.0] * 7)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        xq, xs = act_quant_fp8(xd)
        q, s = act_quant_sim(xd)
        assert xq.dtype == torch.float8_e4m3fn and xs.shape == (M, 3)
        assert torch.equal(xs.double(), s), (xs, s)
        assert torch.equal(xq.view(torch.uint8), q.float().to(torch.float8_e4m3fn).view(torch.uint8))


def test_act_quant_partial_block_and_strided_rows():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(7, 400, generator=gen) * 3
    x = base[:, :200]  # K = 200: a 72-wide last block; rows strided
    xq, xs = act_quant_fp8(x)
    q, s = act_quant_sim(x)
    assert torch.equal(xs.double(), s)
    assert torch.equal(xq.view(torch.uint8), q.float().to(torch.float8_e4m3fn).view(torch.uint8))


CASES = [  # (M, N, K, config or None for the shape rule)
    (1, 64, 1024, None),  # decode: the one-row streaming GEMV (fp8_gemv.py), no K split
    (1, 64, 1024, Fp8GemvConfig(16, 2, 2, 2)),  # the split CUDA-core GEMV at one row, K in two
    (3, 200, 320, None),  # the GEMV over three rows, K and N tails
    (2, 96, 384, Fp8GemvConfig(64, 3, 4, 2)),  # the GEMV, 64-row tiles, three splits
    (5, 200, 320, None),  # K not a multiple of 128, N not a multiple of 128
    (3, 96, 384, GemmConfig(16, 32, 3, True, 4, 2)),  # swapped, three splits
    (70, 96, 256, None),  # mid M: 64 x 128 tiles
    (40, 160, 256, GemmConfig(32, 64, 2, False, 4, 2)),  # unswapped, split K
    (300, 130, 384, GemmConfig(128, 64, 1, False, 4, 2, 2)),  # prefill-style, grouped order
]


@pytest.mark.parametrize("M,N,K,cfg", CASES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_block_gemm(M, N, K, cfg, out_dtype):
    gen = torch.Generator().manual_seed(M * 1000 + N + K)
    w, ws = random_weight(N, K, gen)
    x = torch.randn(M, K, generator=gen) * 2
    xq, xs = act_quant_fp8(x)
    out = fp8_block_gemm(xq, xs, w, ws, out_dtype, config=cfg)
    assert out.dtype == out_dtype and out.shape == (M, N)
    y, mag = gemm_sim(xq.double(), xs.double(), w, ws)
    assert_gemm_close(out, y, mag, K, out_dtype)


@pytest.mark.parametrize("M,N,K,cfg", [CASES[0], CASES[1], CASES[3], CASES[5], CASES[7]])
def test_partials_summed_in_order_are_the_gemm(M, N, K, cfg):
    """fp8_block_gemm_partials leaves the K splits unsummed: added s = 0, 1, ... in fp32 they are
    the GEMM's fp32 output bit for bit, and rounded once its bf16 output (the split-sum kernel's
    own order; the consumers of the fused shared expert rely on it)."""
    gen = torch.Generator().manual_seed(M * 7 + N + K)
    w, ws = random_weight(N, K, gen)
    xq, xs = act_quant_fp8(torch.randn(M, K, generator=gen) * 2)
    part = fp8_block_gemm_partials(xq, xs, w, ws, config=cfg)
    assert part.dtype == torch.float32 and part.shape[1:] == (M, N)
    # the shape rule: no split at one row, K = 1024 split in two for more rows
    assert part.shape[0] == (cfg.split_k if cfg else 1 if M == 1 else 2)
    acc = part[0].clone()
    for sp in range(1, part.shape[0]):
        acc += part[sp]
    assert torch.equal(acc, fp8_block_gemm(xq, xs, w, ws, torch.float32, config=cfg, backend="triton"))
    assert torch.equal(acc.to(torch.bfloat16), fp8_block_gemm(xq, xs, w, ws, torch.bfloat16, config=cfg,
                                                              backend="triton"))


def test_fp8_linear_matches_simulation_from_x():
    gen = torch.Generator().manual_seed(7)
    w, ws = random_weight(192, 256, gen)
    x = (torch.randn(2, 3, 256, generator=gen) * 5).to(torch.bfloat16)
    out = fp8_linear(x, w, ws)
    assert out.shape == (2, 3, 192) and out.dtype == torch.bfloat16
    q, s = act_quant_sim(x.reshape(6, 256))
    y, mag = gemm_sim(q, s, w, ws)
    assert_gemm_close(out.reshape(6, 192), y, mag, 256, torch.bfloat16)


def test_bad_inputs_name_the_tensor():
    w, ws = random_weight(64, 128, torch.Generator().manual_seed(3))
    xq, xs = act_quant_fp8(torch.randn(2, 128))
    with pytest.raises(ValueError, match="w_scale"):
        fp8_block_gemm(xq, xs, w, ws[:, :0])
    with pytest.raises(ValueError, match="share K"):
        fp8_block_gemm(xq, xs, w[:, :64].contiguous(), ws)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_block_gemm(xq.view(torch.uint8), xs, w, ws)


def test_backend_choice_is_checked():
    """The torch (cuBLAS) backend exists on CUDA only; the CPU and an explicit config run Triton."""
    w, ws = random_weight(64, 128, torch.Generator().manual_seed(4))
    xq, xs = act_quant_fp8(torch.randn(2, 128))
    with pytest.raises(RuntimeError, match="unavailable"):
        fp8_block_gemm(xq, xs, w, ws, backend="torch")
    with pytest.raises(ValueError, match="backend"):
        fp8_block_gemm(xq, xs, w, ws, backend="cublas")
