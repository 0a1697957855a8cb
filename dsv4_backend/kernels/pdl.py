"""Programmatic dependent launch (PDL): a decode step's next kernel starts while this one drains.

A batch-1 decode layer is a chain of ~40 small launches. Between two of them, even inside a CUDA
graph, the GPU waits for the last program of the first to exit, flushes its writes, and only
then schedules the second's programs, which then spend their first microsecond on address
arithmetic and first loads. On Hopper a kernel launched with the programmatic-serialization
attribute (Triton's ``launch_pdl=True``) may be scheduled as soon as every program of the kernel
before it has run ``griddepcontrol.launch_dependents`` (or exited); it must then run
``griddepcontrol.wait`` (``gdc_wait``), which returns once that kernel has completed and its
writes are visible, before it touches anything the kernel before it may write or read.

The contract every kernel launched with ``args`` keeps, and why it is safe:

- ``wait(PDL)`` is the first statement of every program: before the first load of an activation,
  cache page, table or any other buffer a kernel of the step writes, before the first store, and
  before an early return (a kernel whose programs all returned without waiting could complete
  before the kernel it follows). Loading the first weight tile before the wait (the weights are
  written by no kernel of a step) was tried in the row GEMV and measured slower (docs/PERF.md,
  session 17).
- ``wait`` then signals ``launch_dependents``: the next kernel may be scheduled only once all of
  this kernel's programs are past their wait, so at most one kernel waits beside a running one.
- Because every PDL kernel waits for the kernel before it, its own completion implies that
  kernel's completion: order stays transitive along the stream. Launches without the attribute
  (torch ops, cuBLAS) keep the full ordering in both directions, and so do
  event edges between streams (``side_stream.py``); under graph capture the attribute becomes a
  programmatic edge of the graph.

The NVRTC kernels (``fp4_mma.cu``) keep the same contract with ``griddepcontrol`` in CUDA C and
are launched by ``launch_compiled``: ``cuLaunchKernelEx`` with the attribute when ``on``.

Off on the CPU, under the interpreter (no ``griddepcontrol``), before sm_90, and with
``DSV4_PDL=0`` (A/B timing): ``args`` then gives False and ``wait`` compiles to nothing.
The values computed do not change by a bit either way (``tests/test_pdl.py`` on CUDA).
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dsv4_backend.kernels._common import native

ENABLED = os.environ.get("DSV4_PDL", "1") != "0"


@lru_cache(maxsize=None)
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def on(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` use PDL (the ``PDL`` constexpr of their ``wait``)."""
    return ENABLED and device.type == "cuda" and native() and _hopper_or_later(device.index or 0)


def args(device: torch.device) -> dict:
    """A PDL kernel's launch arguments: ``kernel[grid](..., **pdl.args(dev))`` sets its ``PDL``
    constexpr and Triton's ``launch_pdl`` option together."""
    p = on(device)
    return {"PDL": p, "launch_pdl": p}


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the kernel before this one in the stream to complete, then let the next one be
    scheduled. A no-op unless ``PDL`` (the value of ``on(device)`` at the launch)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


# ---- NVRTC kernels (torch.cuda._compile_kernel) ---------------------------------------------

# cuda.h: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, and the driver's launch structs
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    # id (an enum), padding to 8 bytes, then the 64-byte value union (an int for this attribute)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_pad", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PDL_ATTRIBUTE = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)   # read by the driver only


def _c_arg(a):
    if isinstance(a, torch.Tensor):
        return ctypes.c_void_p(a.data_ptr())
    if isinstance(a, bool) or not isinstance(a, int):
        raise TypeError(f"launch_compiled: tensors and ints only, got {type(a).__name__}")
    return ctypes.c_int(a)


def launch_compiled(kernel, grid: tuple[int, int, int], block: tuple[int, int, int], args: list,
                    device: torch.device, shared_mem: int = 0) -> None:
    """Launch a ``torch.cuda._compile_kernel`` kernel on the current stream: with the PDL
    attribute through ``cuLaunchKernelEx`` when ``on(device)`` (the kernel must then begin with
    ``griddepcontrol.wait`` and ``launch_dependents``, as ``wait`` does), else as torch launches
    it. Arguments: CUDA tensors (passed as pointers) and Python ints (C ints); ``shared_mem``:
    dynamic shared memory bytes (below 48 KiB)."""
    if not on(device):
        kernel(grid=grid, block=block, args=args, shared_mem=shared_mem)
        return
    from torch.cuda._utils import _get_gpu_runtime_library
    values = [_c_arg(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
    config = _LaunchConfig(*grid, *block, shared_mem, ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream),
                           ctypes.pointer(_PDL_ATTRIBUTE), 1)
    lib = _get_gpu_runtime_library()
    err = lib.cuLaunchKernelEx(ctypes.byref(config), kernel.func, params, None)
    if err != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(err, ctypes.byref(msg))
        raise RuntimeError(f"cuLaunchKernelEx failed: {(msg.value or b'error %d' % err).decode()}")
