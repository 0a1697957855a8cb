"""Import stand-in for ``sgl_kernel`` (SGLang's CUDA kernel package): a test harness, not a kernel.

Only ``bench/sglang_stubs.py`` puts this folder on ``sys.path``, and only when the real
``sgl_kernel`` cannot be imported; ``bench/gpu_sglang_check.py`` and the CPU test of that
check use it. The engine, the server and the plugin never do.

Why: on CUDA, SGLang 0.5.23 imports ``sgl_kernel`` names at module level behind ``if is_cuda():``
with no fallback (``layers/quantization/gguf.py``, ``compressed_tensors_w8a8_int8.py``,
``w8a8_int8.py``, ``layers/layernorm.py``, ``layers/activation.py``,
``moe_runner/triton_utils/fused_moe.py``, ``mem_cache/hisparse_memory_pool.py``), and the
DeepSeek-V4 backend imports the quantisation package, so nothing of SGLang's DSV4 code imports
without the package. The wheel is too large to carry to the GPU machine.

What it does:

- every name of ``sgl_kernel`` and of any ``sgl_kernel.<sub>`` module resolves to a
  ``MissingKernel``; calling one raises ``MissingKernelError`` naming the function, so a real
  use of an SGLang CUDA kernel fails loudly, never silently. Attribute access on one gives
  another (``sgl_kernel.x.y``), for import-time code that only names things;
- ``sgl_kernel.scalar_type`` stays absent (``ModuleNotFoundError``): SGLang's
  ``quantization/utils.get_scalar_types`` has its own import-time fallback for that case, and
  its ``scalar_types.<name>`` attributes are used at import time as dict values;
- ``HANDED_OUT`` lists each name given out with its importer (file:line) and ``CALLED`` each
  name called, so a check can say which SGLang code reached for a missing kernel.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

IS_STAND_IN = True
ABSENT = frozenset({"sgl_kernel.scalar_type"})
HANDED_OUT: list[tuple[str, str]] = []
CALLED: list[str] = []


class MissingKernelError(RuntimeError):
    """An SGLang code path called a ``sgl_kernel`` function the stand-in answered for."""


class MissingKernel:
    """Stands for one ``sgl_kernel`` function; calling it raises ``MissingKernelError``."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "MissingKernel":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return MissingKernel(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        CALLED.append(self._name)
        raise MissingKernelError(
            f"{self._name} was called, but sgl_kernel is not installed: the import stand-in of "
            "bench/sgl_stubs answered for it (a test harness, not a kernel)")

    def __repr__(self) -> str:
        return f"<MissingKernel {self._name}>"


def _importer() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename.rsplit('site-packages/', 1)[-1]}:{frame.f_lineno}"


def _module_getattr(module_name: str):
    def getattr_(attr: str) -> MissingKernel:
        if attr.startswith("__"):
            raise AttributeError(attr)
        HANDED_OUT.append((f"{module_name}.{attr}", _importer()))
        return MissingKernel(f"{module_name}.{attr}")
    return getattr_


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``sgl_kernel.<sub>`` (any depth) as a module of ``MissingKernel`` names."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + ".") and fullname not in ABSENT:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name, "sgl_kernel stand-in: every name raises when called")
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module) -> None:
        pass


__getattr__ = _module_getattr(__name__)
if not any(isinstance(f, _SubmoduleFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _SubmoduleFinder())
