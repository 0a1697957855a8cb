"""DeepSeek-V4 compressed-KV attention (CSA/HCA): model, backend, reference, tokenizer.

``from dsv4_backend import Engine`` is a lazy re-export of ``scheduler_hooks.engine.Engine``:
the scheduler layer sits above this package, so it is imported only when ``Engine`` is asked
for, never when ``dsv4_backend`` itself is loaded.
"""

from typing import Any

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from scheduler_hooks.engine import Engine

        return Engine
    raise AttributeError(f"module 'dsv4_backend' has no attribute {name!r}")
