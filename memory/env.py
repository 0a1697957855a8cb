"""The environment switches named by the design note, typed and read in this one module.

Both are read at call time (never cached at import), so tests can monkeypatch them:

- ``SGLANG_DSV4_COMPRESS_STATE_DTYPE``: dtype of the compressor state rings.
  ``float32``/``fp32`` (default) or ``bf16``/``bfloat16``.
- ``SGLANG_OPT_USE_ONLINE_COMPRESS``: replace the C128 state ring (128 raw (C, Z) slots per
  request) by one running-softmax (max, sum, kv) slot per request. ``1``/``true``/``yes`` on;
  ``0``/``false``/empty off.
"""

from __future__ import annotations

import os

import torch

COMPRESS_STATE_DTYPE = "SGLANG_DSV4_COMPRESS_STATE_DTYPE"
USE_ONLINE_COMPRESS = "SGLANG_OPT_USE_ONLINE_COMPRESS"

_STATE_DTYPES = {"float32": torch.float32, "fp32": torch.float32,
                 "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
_TRUE = ("1", "true", "yes")
_FALSE = ("0", "", "false")


def compress_state_dtype() -> torch.dtype:
    """The compressor state dtype from ``SGLANG_DSV4_COMPRESS_STATE_DTYPE`` (float32 if unset)."""
    raw = os.environ.get(COMPRESS_STATE_DTYPE, "float32").strip().lower()
    try:
        return _STATE_DTYPES[raw]
    except KeyError:
        raise ValueError(f"{COMPRESS_STATE_DTYPE}={raw!r} is not a state dtype; "
                         f"allowed: {', '.join(_STATE_DTYPES)}") from None


def use_online_compress() -> bool:
    """Whether ``SGLANG_OPT_USE_ONLINE_COMPRESS`` turns on the online C128 state (off if unset)."""
    raw = os.environ.get(USE_ONLINE_COMPRESS, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{USE_ONLINE_COMPRESS}={raw!r} is not a switch; "
                     f"allowed: {', '.join(repr(v) for v in _TRUE + _FALSE)}")
