"""Programmatic dependent launch (``dsv4_backend/kernels/pdl.py``) changes no bit.

With PDL on, a kernel may be scheduled while the one before it drains; a wait placed too late
would read the producer's output before it is written: a chain of row GEMVs, each reading the one before's fresh ``torch.empty`` output,
eager and replayed from a CUDA graph, must equal the chain without PDL bit for bit, and so must an
Engine's greedy tokens and logprobs (bf16 and FP8/FP4 checkpoints: every decode kernel that takes
PDL runs in them). CUDA (sm_90+) only: on the CPU and under the interpreter PDL is off.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_backend.checkpoint import save_checkpoint
from dsv4_backend.kernels import pdl
from dsv4_backend.weights import random_weights
from scheduler_hooks.engine import Engine
from test_model_runner import CFG

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


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8_pdl")
    save_checkpoint(d, CFG, random_weights(CFG, seed=3), fmt="fp8", max_shard_bytes=1 << 22)
    return d


def _greedy(monkeypatch, on: bool, model_path=None) -> tuple[list, list]:
    monkeypatch.setattr(pdl, "ENABLED", on)
    kw = {"model_path": str(model_path)} if model_path else {"preset": "tiny", "config_overrides": {"vocab_size": 1024},
                                                            "random_weights_on_device": True}
    eng = Engine(device="cuda", dtype="bfloat16", skip_tokenizer_init=True, max_total_tokens=8192,
                 max_running_requests=2, **kw)
    try:
        assert eng.runner.cuda_graphs is not None
        g = torch.Generator().manual_seed(11)
        prompts = [torch.randint(2, CFG.vocab_size, (n,), generator=g).tolist() for n in (250, 61)]
        outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 14, "temperature": 0.0,
                                                                "ignore_eos": True}, return_logprob=True)
    finally:
        eng.shutdown()
    return [o["output_ids"] for o in outs], [o["meta_info"]["output_token_logprobs"] for o in outs]


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "fp8-fp4"])
def test_decode_with_pdl_equals_without(quantized, monkeypatch, request):
    path = request.getfixturevalue("fp8_dir") if quantized else None
    ids1, lp1 = _greedy(monkeypatch, False, path)
    ids2, lp2 = _greedy(monkeypatch, True, path)
    assert ids1 == ids2
    assert lp1 == lp2
