"""The greedy tokens and non-finite flags kernel (dsv4_backend/kernels/greedy.py) against torch.

On a machine without CUDA it runs under TRITON_INTERPRET=1 (tests/conftest.py). Max and min are
exact, so the tokens equal ``torch.argmax`` (lowest index of the largest value) bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_backend.kernels import greedy
from dsv4_backend.kernels.greedy import greedy_and_flags

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_and_flags_match_torch(monkeypatch, dtype):
    monkeypatch.setattr(greedy, "BLOCK", 64)          # several chunks per row at a small vocabulary
    g = torch.Generator().manual_seed(0)
    B, V = 6, 300                                     # 5 chunks, the last one partial
    logits = torch.randn(B, V, generator=g).to(dtype)
    logits[1, [7, 150, 299]] = 9.0                    # a tie across chunks: the lowest index wins
    logits[2] = float("-inf")                         # every entry -inf: index 0, as torch.argmax
    logits[3, 40] = float("nan")                      # flagged
    logits[4, 200] = float("inf")                     # flagged (and its token is the +inf's)
    logits[5, 63:65] = 5.0                            # a tie across a chunk boundary
    out = greedy_and_flags(logits.to(DEV), logits.to(DEV)).cpu()
    ref = torch.argmax(logits, dim=-1)
    flags = (~torch.isfinite(logits).all(dim=-1)).long()
    assert torch.equal(out[1], flags)
    keep = flags == 0
    assert torch.equal(out[0][keep], ref[keep]) and out[0, 1] == 7 and out[0, 2] == 0 and out[0, 5] == 63
    assert out[0, 4] == 200 and 0 <= out[0, 3] < V


def test_penalised_work_and_raw_logits_are_separate():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 100, generator=g)
    work = logits.clone()
    work[0, 5] = 50.0                                  # a row the penalties changed
    logits[2, 9] = float("inf")                        # the flag reads the raw logits
    out = greedy_and_flags(work.to(DEV), logits.to(DEV)).cpu()
    assert torch.equal(out[0], torch.argmax(work, -1))   # work's row 2 stayed finite
    assert out[0, 0] == 5 and out[1].tolist() == [0, 0, 1]


def test_bad_inputs_are_named():
    x = torch.zeros(2, 8, device=DEV)
    with pytest.raises(ValueError, match="one \\[B, V\\] shape"):
        greedy_and_flags(x, x[:1])
    with pytest.raises(ValueError, match="contiguous columns"):
        greedy_and_flags(x.t().contiguous().t(), x)
    with pytest.raises(ValueError, match="empty vocabulary"):
        greedy_and_flags(x[:, :0], x[:, :0])
