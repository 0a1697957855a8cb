"""SGLang's CUDA import branch on a CPU: a smoke of bench/gpu_sglang_check.py's imports (a test harness).

SGLang 0.5.23 picks its CUDA imports at module import time (``sglang.srt.utils.is_cuda()``:
``torch.cuda.is_available() and torch.version.cuda is not None``, copied into module globals
such as ``_is_cuda``), and a few of those imports probe the device (its platform resolution
reads ``torch.cuda.get_device_name()``, kernel choices ``get_device_capability()``). ``forced()``
makes torch answer as one H200 would while SGLang is imported, then puts torch back, so the
modules keep their CUDA branch and the check's own tensors stay on the CPU.

    python bench/sglang_cuda_branch.py --imports-only   # the check's imports, JSON on stdout
    python bench/sglang_cuda_branch.py                  # then gpu_sglang_check.py --tiny

It runs in a process of its own: the modules it imports stay on the CUDA branch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

H200 = NS(name="NVIDIA H200 (CUDA branch forced on a CPU)", major=9, minor=0, total_memory=140 << 30,
          multi_processor_count=132)
_ANSWERS = dict(is_available=True, device_count=1, current_device=0, get_device_name=H200.name,
                get_device_capability=(9, 0), get_device_properties=H200)


@contextlib.contextmanager
def forced():
    """torch.cuda answers as one H200 inside the block (torch.version.cuda "12.8" if unset)."""
    saved = {name: getattr(torch.cuda, name) for name in _ANSWERS}
    cuda_version = torch.version.cuda
    try:
        for name, answer in _ANSWERS.items():
            setattr(torch.cuda, name, lambda *args, _answer=answer, **kwargs: _answer)
        torch.version.cuda = cuda_version or "12.8"
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)
        torch.version.cuda = cuda_version


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--imports-only", action="store_true", help="import, print JSON, stop")
    args, rest = ap.parse_known_args()
    import gpu_sglang_check as G  # first: its device is the real one (the CPU here)
    import sglang_stubs
    with forced():
        imports = G.import_sglang()
    if args.imports_only:
        print(json.dumps({**imports, "stand_in_use": sglang_stubs.report(), "device": G.DEV}))
        return 0
    sys.argv = [sys.argv[0], "--tiny", *rest]
    return G.main()


if __name__ == "__main__":
    sys.exit(main())
