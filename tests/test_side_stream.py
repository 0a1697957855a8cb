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

from cuda_decode import greedy_decode, write_fp8_checkpoint
from dsv4_backend import side_stream

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="side streams are CUDA streams")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return write_fp8_checkpoint(tmp_path_factory.mktemp("fp8_side"))


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
    ids, logprobs = greedy_decode(model_path)
    return ids, logprobs, len(forks)


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "fp8-fp4"])
def test_decode_on_two_streams_equals_one_stream(quantized, monkeypatch, request):
    path = request.getfixturevalue("fp8_dir") if quantized else None
    ids1, lp1, forks1 = _greedy(monkeypatch, False, path)
    ids2, lp2, forks2 = _greedy(monkeypatch, True, path)
    assert forks1 == 0 and forks2 > 0
    assert ids1 == ids2
    assert lp1 == lp2
