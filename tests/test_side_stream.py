"""The side-stream branches of a layer (``dsv4_backend/side_stream.py``) change no bit of a decode.

With ``COMPRESSOR`` and ``SHARED_EXPERT`` on, the compressors' projections and (quantised model)
the shared expert run on a second stream, in eager prefill and in the replayed decode graphs; the
same launches read the same inputs, so greedy tokens and their logprobs must equal the one-stream
run's exactly. CUDA only: on the CPU a ``SideBranch`` has no stream and its body runs inline,
which every other test exercises.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_backend import side_stream
from dsv4_backend.checkpoint import save_checkpoint
from dsv4_backend.weights import random_weights
from scheduler_hooks.engine import Engine
from test_model_runner import CFG

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="side streams are CUDA streams")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8_side")
    save_checkpoint(d, CFG, random_weights(CFG, seed=3), fmt="fp8", max_shard_bytes=1 << 22)
    return d


def _greedy(monkeypatch, on: bool, model_path=None) -> tuple[list, list, int]:
    monkeypatch.setattr(side_stream, "COMPRESSOR", on)
    monkeypatch.setattr(side_stream, "SHARED_EXPERT", on)
    forks = []
    enter = side_stream.SideBranch.__enter__

    def counting(self):
        if self.stream is not None:
            forks.append(1)
        return enter(self)
    monkeypatch.setattr(side_stream.SideBranch, "__enter__", counting)
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
    return ([o["output_ids"] for o in outs], [o["meta_info"]["output_token_logprobs"] for o in outs], len(forks))


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "fp8-fp4"])
def test_decode_on_two_streams_equals_one_stream(quantized, monkeypatch, request):
    path = request.getfixturevalue("fp8_dir") if quantized else None
    ids1, lp1, forks1 = _greedy(monkeypatch, False, path)
    ids2, lp2, forks2 = _greedy(monkeypatch, True, path)
    assert forks1 == 0 and forks2 > 0
    assert ids1 == ids2
    assert lp1 == lp2
