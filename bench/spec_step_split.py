"""Where a speculative engine step's time goes: drafts, snapshot, verify, acceptance, restore,
the MTP pass over the kept positions, truncation, the rest.

Each phase is a method the scheduler calls once per step (``SpeculativeDecoder.draft``,
``.snapshot``, ``.accept_all``, ``.extend_mtp``, ``ModelRunner.forward``,
``VerifySnapshot.restore``, ``KVAllocator.truncate``); while installed, each call is timed on the
host with a device synchronisation before and after it, so a phase's time is its host work plus
the device work it queued, with no overlap between phases. The synchronisations cost the
overlap the unsynchronised step has, so the phases add up to more than the plain step time:
read them as shares, beside the step time measured without this split. ``other`` is the step
(synchronised, with the split installed) minus the phases: scheduling, the outputs, plain decode
rows' sampling, SWA eviction.

    with SpecStepSplit(engine) as split:
        for _ in range(n):
            split.step()
    split.means()       # {"step": ms, "drafts": ms, ...} per step
"""

from __future__ import annotations

import time
from typing import Any, Callable

from bench._bench_common import sync
from dsv4_backend.rollback import VerifySnapshot

PHASES = (
    ("drafts", "MTP draft passes (K - 1 chained)"),
    ("snapshot", "rollback snapshot"),
    ("verify", "target forward (verify replay, metadata)"),
    ("accept", "sampling / acceptance"),
    ("restore", "rollback restore"),
    ("mtp_kept", "MTP pass over the kept positions"),
    ("truncate", "allocator truncate"),
    ("other", "rest of the step"),
)


class SpecStepSplit:
    """Per-phase host + device time of engine steps (see the module docstring)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.device = engine.runner.device
        self.spec = engine.scheduler.spec
        self._patched: list[tuple[Any, str, Any]] = []
        self._ms = {key: 0.0 for key, _ in PHASES}
        self._step_ms = 0.0
        self._steps = 0

    def _timed(self, key: str, fn: Callable) -> Callable:
        def run(*a: Any, **kw: Any) -> Any:
            sync(self.device)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                sync(self.device)
                self._ms[key] += 1e3 * (time.perf_counter() - t0)
        return run

    def _patch(self, obj: Any, name: str, key: str) -> None:
        had = name in vars(obj)
        self._patched.append((obj, name, vars(obj)[name] if had else None))
        setattr(obj, name, self._timed(key, getattr(obj, name)))

    def __enter__(self) -> "SpecStepSplit":
        runner = self.engine.runner
        self._patch(runner, "forward", "verify")
        if self.spec is not None:
            for name, key in (("draft", "drafts"), ("snapshot", "snapshot"), ("accept_all", "accept"),
                              ("extend_mtp", "mtp_kept")):
                self._patch(self.spec, name, key)
            self._patch(self.spec.allocator, "truncate", "truncate")
            self._patch(VerifySnapshot, "restore", "restore")      # a new snapshot every step
        return self

    def __exit__(self, *exc: Any) -> None:
        for obj, name, old in reversed(self._patched):
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self._patched = []

    def step(self) -> list[Any]:
        sync(self.device)
        t0 = time.perf_counter()
        before = sum(self._ms.values())
        outs = self.engine.step()
        sync(self.device)
        ms = 1e3 * (time.perf_counter() - t0)
        self._ms["other"] += ms - (sum(self._ms.values()) - before)
        self._step_ms += ms
        self._steps += 1
        return outs

    def means(self) -> dict[str, float]:
        n = max(self._steps, 1)
        return {"step": self._step_ms / n, **{k: v / n for k, v in self._ms.items()}}


def split_line(means: dict[str, float]) -> str:
    """One line: the synchronised step and its phases, ms."""
    return f"split (synced) {means['step']:.2f} ms: " + ", ".join(
        f"{key} {means[key]:.2f}" for key, _ in PHASES if means.get(key, 0.0) or key == "other")
