"""Test-wide settings.

Triton kernels run under the interpreter on machines without a GPU. The variable must be
set before triton is first imported anywhere, so it is set here, at collection start.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Test vectors that ship with the repository (tests/data/README.md says where each came from):
# the released config.json files and the chat-encoding golden cases.
TESTDATA = ROOT / "tests" / "data"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The engine tests run many small ops: one torch thread avoids oversubscribing 2 shared cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def default_decode_launch(monkeypatch):
    """Sparse decode with its tuned default launch at every batch size. Tests that compare, bit
    for bit, steps whose key lists are padded or batched differently (a static step against an
    eager one, HiSparse's query blocks against one pass) need one launch shape for both: the
    small-batch rule (``sparse_attention.decode_launch_rule``) picks its splits by list length
    and batch size, and another split sums in another order. The rule itself is checked against
    float64 in tests/test_kernels.py."""
    from dsv4_backend.kernels import sparse_attention
    monkeypatch.setattr(sparse_attention, "SMALL_BATCH_MAX_REQUESTS", 0)
