"""The fused RMSNorm + RoPE kernel (dsv4_backend/kernels/norm_rope.py) against float64 formulas
and the model's torch path, at tiny shapes (TRITON_INTERPRET=1 on a machine without CUDA).

Bounds (tests/bounds.py ``norm_rope_bound``): the kernel and the float64 formula see the same
inputs, so the fp32 kernel is within the bound of one float32 evaluation; against the model's own
float32 torch ops (another fp32 evaluation) twice that. bfloat16 outputs add the rounding before
RoPE (``bf16_mid``: the torch path stores the norm's result in bf16 before rotating) and one bf16
step of the stored value (either side may round the other way).
"""

from __future__ import annotations

import pytest
import torch

from bounds import BF16_STEP, assert_within, norm_rope_bound
from dsv4_backend.kernels.norm_rope import norm_pair, norm_rope
from dsv4_backend.model import Rotary, rms_norm
from dsv4_backend.config import DSV4Config

CFG = DSV4Config.preset("tiny")
EPS = 1e-6
POSITIONS = torch.tensor([0, 7, 131_071, 1_048_575])       # up to 1M: fp32 angles matter there

interpreter_only = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="CPU tensors through Triton need the interpreter")
# the kernel runs on CUDA tensors on a GPU machine, on CPU tensors under the interpreter elsewhere
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def exact(x: torch.Tensor, w, pos, inv, norm: bool, inverse: bool) -> torch.Tensor:
    """float64 RMSNorm (weight optional) then interleaved RoPE at the release's fp32 angles."""
    h = x.double()
    if norm:
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + EPS)
        if w is not None:
            h = h * w.double()
    if inv is None:
        return h
    ang = (pos.to(torch.float32)[:, None] * inv[None, :]).double()            # [T, 32]
    ang = ang.view((ang.shape[0],) + (1,) * (h.dim() - 2) + (ang.shape[1],))
    c, s = ang.cos(), (-ang if inverse else ang).sin()
    rope = h[..., -2 * inv.numel():]
    e, o = rope[..., 0::2], rope[..., 1::2]
    rot = torch.stack([e * c - o * s, e * s + o * c], -1).flatten(-2)
    return torch.cat([h[..., :-2 * inv.numel()], rot], -1)


def inputs(shape, seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 4 + 0.01).to(dtype)
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(torch.bfloat16)
    return x, w


def bound(x, w, norm: bool, bf16: bool, factor: float) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).double()
    wt = w if (norm and w is not None) else torch.ones(x.shape[-1])
    if norm:
        b = factor * norm_rope_bound(rows, 0.0, wt, bf16_mid=bf16)
    else:   # RoPE alone: three roundings per rotated pair, no norm
        pair = rows.abs().unflatten(-1, (-1, 2)).sum(-1, keepdim=True).expand(-1, -1, 2).flatten(-2)
        b = factor * 3 * 2.0 ** -24 * pair
    return b.view(x.shape)


CASES = [  # (shape [T, ..., D], weight, rope, inverse, what)
    ((4, 2, 512), False, True, False, "q: per-head norm (no weight) + RoPE"),
    ((4, 512), True, True, False, "kv: kv_norm + RoPE"),
    ((4, 3, 128), False, True, False, "indexer q: RoPE only on 128-wide heads"),
    ((4, 2, 512), False, True, True, "attention output: inverse RoPE only"),
    ((4, 256), True, False, False, "block / q_lora norm: RMSNorm only"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,has_w,rope,inverse,what", CASES)
def test_norm_rope_matches_float64_and_the_torch_path(shape, has_w, rope, inverse, what, dtype):
    norm = what != "indexer q: RoPE only on 128-wide heads" and not inverse
    x, w = inputs(shape, hash(what) % 1000, dtype)
    w = w if has_w else None
    rot = Rotary(CFG.compress_rope_theta, CFG.rope_scaling)
    inv = rot.inv_freq if rope else None
    dev = KERNEL_DEVICE
    got = norm_rope(x.to(dev), None if w is None else w.to(dev), EPS, POSITIONS.to(dev) if rope else None,
                    None if inv is None else inv.to(dev), norm=norm, inverse=inverse).cpu()
    assert got.dtype == dtype and got.shape == x.shape
    # the model's torch path on the CPU (what the kernel replaces on CUDA)
    h = rms_norm(x, w, EPS) if norm else x
    torch_path = rot.apply(h, POSITIONS, inverse=inverse) if rope else h
    bf16 = dtype == torch.bfloat16
    if not bf16:
        assert_within(got, exact(x, w, POSITIONS, inv, norm, inverse), bound(x, w, norm, False, 1.0),
                      f"{what}: kernel vs float64")
    b = bound(x, w, norm, bf16, 2.0)
    if bf16:
        b = b + BF16_STEP * torch_path.double().abs()
    assert_within(got, torch_path, b, f"{what}: kernel vs the torch path ({dtype})")


@interpreter_only
def test_norm_rope_fp32_in_bf16_out_is_the_block_norms_cast():
    # the block norms read the fp32 mHC collapse and hand bf16 to the projections
    x, w = inputs((3, 256), 5, torch.float32)
    got = norm_rope(x, w, EPS, out_dtype=torch.bfloat16)
    want = rms_norm(x, w, EPS, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert_within(got, want, 2 * bound(x, w, True, False, 1.0) + BF16_STEP * want.double().abs(),
                  "fp32 -> bf16 norm")


@interpreter_only
def test_norm_rope_refuses_bad_inputs():
    x, w = inputs((2, 512), 1, torch.float32)
    inv = Rotary(CFG.rope_theta, None).inv_freq
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        norm_rope(x.double(), None, EPS)
    with pytest.raises(ValueError, match="weight"):
        norm_rope(x, w[:100], EPS)
    with pytest.raises(ValueError, match="positions"):
        norm_rope(x, None, EPS, torch.tensor([0, 1, 2]), inv)
    with pytest.raises(ValueError, match="32 frequencies"):
        norm_rope(x, None, EPS, POSITIONS[:2], inv[:8])


@interpreter_only
def test_model_routes_its_norms_and_ropes_to_the_kernel(monkeypatch):
    """With the CUDA condition forced on, one engine step sends every norm and RoPE of the layers
    through the kernel: q (per-head norm + RoPE), kv (kv_norm + RoPE), the inverse RoPE of the
    output, the indexer's q RoPE, and the weighted norms (block, q_lora, final); the q_lora norm
    and the kv norm + RoPE of a layer share one launch (norm_pair)."""
    from dsv4_backend import model as model_mod
    from dsv4_backend.kernels import norm_rope as kernel_mod
    from scheduler_hooks.engine import Engine

    calls = []

    def counting(x, weight, eps, positions=None, inv_freq=None, norm=True, inverse=False, out_dtype=None):
        calls.append((x.shape[-1], x.dim(), weight is not None, inv_freq is not None, norm, inverse))
        return norm_rope(x, weight, eps, positions, inv_freq, norm, inverse, out_dtype)

    def counting_pair(a, wa, eps_a, b, wb, eps_b, positions, inv_freq, store=None):
        calls.append((a.shape[-1], 2, True, False, True, False))
        calls.append((b.shape[-1], 2, True, True, True, False))
        pairs.append(a.shape[-1])
        return norm_pair(a, wa, eps_a, b, wb, eps_b, positions, inv_freq, store=store)

    pairs = []
    monkeypatch.setattr(model_mod, "_norm_rope_kernel_applies", lambda x: x.dtype != torch.float64)
    monkeypatch.setattr(kernel_mod, "norm_rope", counting)
    monkeypatch.setattr(kernel_mod, "norm_pair", counting_pair)
    eng = Engine(preset="tiny", skip_tokenizer_init=True, max_total_tokens=2048, chunked_prefill_size=256,
                 max_running_requests=1, config_overrides={"vocab_size": 1024})
    out = eng.generate(input_ids=[[5, 6, 7]],
                       sampling_params={"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True})
    eng.shutdown()
    assert len(out[0]["output_ids"]) == 1
    kinds = set(calls)
    L, n_csa = CFG.num_hidden_layers, CFG.num_c4_layers
    hd, D, QR, idx = CFG.head_dim, CFG.hidden_size, CFG.q_lora_rank, CFG.index_head_dim
    assert (hd, 3, False, True, True, False) in kinds          # q: [T, H, 512], no weight, RoPE
    assert (hd, 2, True, True, True, False) in kinds           # kv: [T, 512], kv_norm, RoPE
    assert (hd, 3, False, True, False, True) in kinds          # o: inverse RoPE only
    assert (idx, 3, False, True, False, False) in kinds        # indexer q: RoPE only
    assert calls.count((D, 2, True, False, True, False)) >= 2 * L + 1      # block norms + final norm
    assert calls.count((QR, 2, True, False, True, False)) >= L             # q_norm (+ indexer compressor norms)
    assert calls.count((idx, 3, False, True, False, False)) == n_csa
    assert pairs and set(pairs) == {QR}                        # q_lora norm beside kv norm + RoPE, one launch


def test_norm_rope_reads_strided_views_like_their_copies():
    """q comes as a column slice of the stacked wq_b | indexer.wq_b output viewed [T, H, D]:
    the kernel reads it through its strides and computes exactly what it does on a copy."""
    dev = KERNEL_DEVICE
    T, H, D = 3, 2, 512
    big, _ = inputs((T, H * D + 256), 9, torch.bfloat16)
    view = big.to(dev)[:, :H * D].view(T, H, D)
    assert not view.is_contiguous()
    inv = Rotary(CFG.compress_rope_theta, CFG.rope_scaling).inv_freq.to(dev)
    pos = POSITIONS[:T].to(dev)
    assert torch.equal(norm_rope(view, None, EPS, pos, inv), norm_rope(view.contiguous(), None, EPS, pos, inv))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mhc_collapse_norm_is_collapse_then_norm(dtype):
    """kernels.mhc.mhc_collapse_norm against float64 (collapse, then RMSNorm) and the model's torch
    path: the collapse of hc terms carries gamma(hc) of sum_j |pre_j X_j|, which enters the norm's
    bound as its input difference; the bf16 store adds one step."""
    from bounds import gamma
    from dsv4_backend.kernels.mhc import mhc_collapse_norm
    from dsv4_backend.model import hc_collapse
    T, hc, D = 3, CFG.hc_mult, CFG.hidden_size
    g = torch.Generator().manual_seed(11)
    X = (torch.randn(T, hc, D, generator=g) * 3).to(dtype)
    pre = torch.rand(T, hc, generator=g) + 0.05
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(torch.bfloat16)
    dev = KERNEL_DEVICE
    got = mhc_collapse_norm(X.to(dev), pre.to(dev), w.to(dev), EPS, torch.bfloat16 if dtype == torch.bfloat16
                            else torch.float32).cpu()
    y64 = torch.einsum("tj,tjd->td", pre.double(), X.double())
    dx = gamma(hc) * torch.einsum("tj,tjd->td", pre.double(), X.double().abs())
    b = norm_rope_bound(y64, dx, w)
    want64 = y64 * torch.rsqrt(y64.square().mean(-1, keepdim=True) + EPS) * w.double()
    torch_path = rms_norm(hc_collapse(X, pre), w, EPS, got.dtype)
    if dtype == torch.float32:
        assert_within(got, want64, b, "collapse + norm vs float64")
        assert_within(got, torch_path, 2 * b, "collapse + norm vs the torch path")
    else:
        assert_within(got, torch_path, 2 * b + BF16_STEP * torch_path.double().abs(), "collapse + norm (bf16)")
    with pytest.raises(ValueError, match="pre must be fp32"):
        mhc_collapse_norm(X.to(dev), pre.double().to(dev), w.to(dev), EPS, torch.float32)


def pair_inputs(T: int, seed: int, dtype: torch.dtype):
    """norm_pair's inputs as the model passes them: a [T, 192] and b [T, 512], column slices of one
    projection's output, their norm weights, the compressed layers' RoPE frequencies, positions,
    and the generator that drew the weights (seed + 1) for further draws."""
    dev = KERNEL_DEVICE
    big, _ = inputs((T, 192 + 512), seed, dtype)
    big = big.to(dev)
    g = torch.Generator().manual_seed(seed + 1)
    wa, wb = (torch.rand(n, generator=g).to(dev) + 0.5 for n in (192, 512))
    inv = Rotary(CFG.compress_rope_theta, CFG.rope_scaling).inv_freq.to(dev)
    return big[:, :192], big[:, 192:], wa, wb, inv, POSITIONS[:T].to(dev), g


def test_norm_pair_is_two_norm_ropes():
    """norm_pair computes each of its two row sets exactly as norm_rope does alone (the same row
    code), from strided column slices of one projection's output as the model passes them."""
    a, b, wa, wb, inv, pos, _ = pair_inputs(3, 21, torch.bfloat16)
    got_a, got_b = norm_pair(a, wa, 1e-6, b, wb, 2e-6, pos, inv)
    assert torch.equal(got_a, norm_rope(a, wa, 1e-6))
    assert torch.equal(got_b, norm_rope(b, wb, 2e-6, pos, inv))
    with pytest.raises(ValueError, match="norm_pair"):
        norm_pair(a, wa, 1e-6, b[:2], wb, 2e-6, pos, inv)
    with pytest.raises(ValueError, match="norm_pair"):
        norm_pair(a, wa, 1e-6, b, wb, 2e-6, pos, inv[:8])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_pair_store_is_kv_store_rows(dtype):
    """With ``store``, norm_pair's rows are unchanged and the SWA pool holds the bytes that
    kv_store_rows writes from its b output, every other byte untouched (a slot of -1 skipped)."""
    from dsv4_backend.kernels.kv_store import kv_store_rows
    dev = KERNEL_DEVICE
    a, b, wa, wb, inv, pos, g = pair_inputs(4, 23, dtype)
    slots = torch.tensor([5, -1, 64, 127]).to(dev)
    pool = torch.randint(0, 256, (2, 64 * 584), generator=g, dtype=torch.uint8).to(dev)   # 64 rows a page
    want = pool.clone()
    want_a, want_b = norm_pair(a, wa, 1e-6, b, wb, 2e-6, pos, inv)
    kv_store_rows(want, slots, want_b)
    got_a, got_b = norm_pair(a, wa, 1e-6, b, wb, 2e-6, pos, inv, store=(pool, slots))
    assert torch.equal(got_a, want_a) and torch.equal(got_b, want_b)
    assert torch.equal(pool, want)
    with pytest.raises(ValueError, match="a store takes"):
        norm_pair(a, wa, 1e-6, b, wb, 2e-6, pos, inv, store=(pool, slots[:2]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="an Engine on CUDA (decode graphs)")
def test_engine_with_kv_store_in_norm_pair_equals_without(tmp_path, monkeypatch):
    """A CUDA Engine (decode graphs, FP8/FP4 checkpoint) gives the same greedy tokens and logprobs
    whether norm_pair writes the SWA rows or the backend's store launch does."""
    from cuda_decode import greedy_decode, write_fp8_checkpoint
    from dsv4_backend import model
    from dsv4_backend.triton_backend import TritonDSV4Backend
    path = write_fp8_checkpoint(tmp_path)
    monkeypatch.setattr(model, "USE_NORM_PAIR_STORE", False)
    want = greedy_decode(path)
    monkeypatch.setattr(model, "USE_NORM_PAIR_STORE", True)
    targets = []
    swa_store = TritonDSV4Backend.swa_store
    monkeypatch.setattr(TritonDSV4Backend, "swa_store", lambda self, *a: targets.append(1) or swa_store(self, *a))
    assert greedy_decode(path) == want
    assert targets, "the kv norm + RoPE launch never stored"
