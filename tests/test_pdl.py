"""Programmatic dependent launch (``dsv4_backend/kernels/pdl.py``) changes no bit.

With PDL on, a kernel may be scheduled while the one before it drains; a wait placed too late
would read the producer's output before it is written: a chain of row GEMVs, each reading the one before's fresh ``torch.empty`` output,
eager and replayed from a CUDA graph, must equal the chain without PDL bit for bit, and so must an
Engine's greedy tokens and logprobs (bf16 and FP8/FP4 checkpoints: every decode kernel that takes
PDL runs in them). The NVRTC FP4 MMA kernel, launched through ``pdl.launch_compiled``, inside the
decode MoE (act-quant -> MMA -> SwiGLU -> MMA -> combine, the shared expert beside it): equal with
and without PDL, eager and replayed on a new input each time. CUDA (sm_90+) only: on the CPU and under the interpreter PDL is off.
"""

from __future__ import annotations

import pytest
import torch

from cuda_decode import greedy_decode, write_fp8_checkpoint
from dsv4_backend.kernels import pdl

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                                reason="PDL needs an sm_90+ GPU")


def _fp8_weight(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = (torch.randn(n, k, generator=g) * 0.5).to(torch.float8_e4m3fn).cuda()
    s = torch.exp2(torch.randint(-8, -4, ((n + 127) // 128, (k + 127) // 128), generator=g).float()).cuda()
    return w, s


def _chain(x: torch.Tensor, weights) -> list[torch.Tensor]:
    from dsv4_backend.kernels.fp8_gemv import fp8_row_gemv
    outs = []
    for w, s in weights:
        x = fp8_row_gemv(x, w, s)       # [1, N] bf16, read by the next launch
        outs.append(x)
    return outs


def test_row_gemv_chain_with_pdl_equals_without(monkeypatch):
    g = torch.Generator().manual_seed(5)
    dims = [4096, 8192, 1024, 4096, 2048, 4096, 512, 4096]      # wide and narrow steps in turn
    weights = [_fp8_weight(dims[(i + 1) % len(dims)], dims[i], g) for i in range(len(dims))]
    x = torch.randn(1, dims[0], generator=g).to(torch.bfloat16).cuda()
    monkeypatch.setattr(pdl, "ENABLED", False)
    want = _chain(x, weights)
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.on(x.device)
    eager = _chain(x, weights)
    for a, b in zip(eager, want):
        assert torch.equal(a, b)
    _chain(x, weights)                       # compiled; then captured and replayed
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = _chain(x, weights)
    for _ in range(3):
        for out in replayed:
            out.fill_(float("nan"))          # a read before its producer finished would keep a NaN
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(replayed, want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("T", [1, 8])
def test_fp4_mma_moe_with_pdl_equals_without(T, monkeypatch):
    from dsv4_backend.kernels import fp4_mma as F
    from test_fp4_mma import _shared_expert_case
    from test_fp4_moe import LIMIT

    x, ids, wts, packs, _, shared = _shared_expert_case(T)

    def moe():
        return F.fp4_moe_mma(x, ids, wts, *packs, LIMIT, shared=shared)
    monkeypatch.setattr(pdl, "ENABLED", False)
    want = moe()
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert torch.equal(moe(), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = moe()
    g = torch.Generator(device="cuda").manual_seed(T)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=g, device="cuda") * 3)   # a stale read would show
        graph.replay()
        monkeypatch.setattr(pdl, "ENABLED", False)
        assert torch.equal(replayed, moe())
        monkeypatch.setattr(pdl, "ENABLED", True)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return write_fp8_checkpoint(tmp_path_factory.mktemp("fp8_pdl"))


def _greedy(monkeypatch, on: bool, model_path=None) -> tuple[list, list]:
    monkeypatch.setattr(pdl, "ENABLED", on)
    return greedy_decode(model_path)


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "fp8-fp4"])
def test_decode_with_pdl_equals_without(quantized, monkeypatch, request):
    path = request.getfixturevalue("fp8_dir") if quantized else None
    ids1, lp1 = _greedy(monkeypatch, False, path)
    ids2, lp2 = _greedy(monkeypatch, True, path)
    assert ids1 == ids2
    assert lp1 == lp2
