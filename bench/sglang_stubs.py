"""Import stand-ins for SGLang's CUDA packages that the GPU check's machine lacks (a test harness).

``install()`` runs before SGLang is imported, in ``bench/gpu_sglang_check.py`` and its CPU test
only. For each package of ``STUBS`` that does not import, it puts ``bench/sgl_stubs`` first on
``sys.path``, so that the stand-in in that folder is what SGLang imports; a package that
imports is left alone. ``report()`` says what was stood in for, which names SGLang took from a
stand-in (and where), and which it called (each such call raised).

Only ``sgl_kernel`` needs one: forcing SGLang 0.5.23's CUDA branch (``is_cuda()``) and importing
the plugin, SGLang's DeepSeek-V4 pools, backend and indexer, every other missing CUDA package
(flashinfer, deep_gemm, flash_mla, triton_kernels, ...) is imported behind a fallback or lazily
inside the function that uses it (``tests/test_sglang_adapter.py``,
``test_cuda_import_path_with_sgl_kernel_stand_in``).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

STUB_DIR = Path(__file__).resolve().parent / "sgl_stubs"
STUBS = ("sgl_kernel",)


def _stand_in(name: str):
    module = sys.modules.get(name)
    return module if getattr(module, "IS_STAND_IN", False) else None


def install() -> dict[str, str]:
    """Stand in for each package of ``STUBS`` that does not import: {package: why}."""
    installed = {}
    for name in STUBS:
        if _stand_in(name) is not None:
            installed[name] = "stand-in already imported"
            continue
        try:
            importlib.import_module(name)
            continue
        except (ImportError, OSError) as e:  # absent, or a build that does not load here
            why = f"{type(e).__name__}: {e}"[:200]
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
        if str(STUB_DIR) not in sys.path:
            sys.path.insert(0, str(STUB_DIR))
        module = importlib.import_module(name)
        assert getattr(module, "IS_STAND_IN", False), f"{name} did not resolve to {STUB_DIR}"
        installed[name] = why
    return installed


def report() -> dict[str, dict]:
    """{package: {"handed_out": {name: [importers]}, "called": [names]}} for the stand-ins in use."""
    out = {}
    for name in STUBS:
        module = _stand_in(name)
        if module is None:
            continue
        handed: dict[str, list[str]] = {}
        for attr, where in module.HANDED_OUT:
            handed.setdefault(attr, [])
            if where not in handed[attr]:
                handed[attr].append(where)
        out[name] = {"handed_out": handed, "called": sorted(set(module.CALLED))}
    return out
