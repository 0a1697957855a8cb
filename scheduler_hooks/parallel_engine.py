"""Rank processes of a tensor / expert parallel Engine: start, step broadcast, follow, stop.

``Engine(..., tp_size=N, ep_size=M)`` is rank 0: it starts one process per other rank
(``multiprocessing``, forked from a forkserver that has imported the engine), each of which
builds the same Engine (same config, seeded weights or checkpoint, memory plan and pools)
holding its own shard of the model, then follows.
Rank 0 alone owns the scheduler, the tokenizer and sampling. Every rank keeps its own copy of the
allocator and pools, changed by the same calls in the same order:

    rank 0 scheduler ── hooks (admit / reserve / after_forward / release / synthetic fill) ──┐
                     └─ runner.forward(reqs) ─ broadcast Step(ops since the last step, reqs) ┤
    rank k  follow():    replay the ops on its own hooks, then runner.forward(reqs)  <──────┘

so every rank builds the same ForwardMetadata from its own tables and writes the same KV rows
into its own (replicated) pools, and the forward's collectives pair up. Only the step's Python
objects cross (a few hundred bytes at decode): over gloo, on a group beside NCCL on CUDA.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from dsv4_backend.model_runner import ForwardRequest
from dsv4_backend.parallel import ParallelConfig, RankGroup, check_shardable, close_ranks, free_port, init_ranks

from .hooks import SchedulerHooks

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0

# Set while a process builds its Engine as a given rank (``launch_ranks`` then joins, not spawns).
_JOIN: Optional[tuple[ParallelConfig, int]] = None


@contextlib.contextmanager
def join_as(pc: ParallelConfig, port: Optional[int] = None) -> Iterator[None]:
    """Engines built inside join the run at ``port`` as rank ``pc.rank`` instead of starting
    processes. Rank processes use it; so does a one-rank run with a process group (NCCL with
    one rank: ``join_as(ParallelConfig())``, a free port), which runs every collective and the
    step broadcast on one GPU."""
    global _JOIN
    _JOIN = (pc, port if port is not None else free_port())
    try:
        yield
    finally:
        _JOIN = None


@dataclass
class Step:
    """What rank 0 sends before each forward: the hook calls since the last step (in order),
    the forward's requests; ``stop``: leave the loop."""

    ops: list[tuple[str, tuple]] = field(default_factory=list)
    reqs: Optional[list[ForwardRequest]] = None
    stop: bool = False


class RecordingHooks(SchedulerHooks):
    """Rank 0's hooks: each call that changes the allocator (or fills a synthetic context) is
    applied and logged for the followers, with the result they must reproduce."""

    def __init__(self, allocator: Any, fill: Callable[[str, int], None]):
        super().__init__(allocator)
        self._fill = fill
        self.log: list[tuple[str, tuple]] = []

    def admit(self, rid: str, *args: Any, **kw: Any) -> Optional[int]:
        slot = super().admit(rid, *args, **kw)   # no prefix cache under TP / EP: the ids are unused
        self.log.append(("admit", (rid, slot)))
        return slot

    def reserve(self, rid: str, new_len: int) -> Any:
        res = super().reserve(rid, new_len)
        self.log.append(("reserve", (rid, new_len, bool(res.ok))))
        return res

    def after_forward(self, rids) -> None:
        rids = list(rids)
        super().after_forward(rids)
        self.log.append(("after_forward", (rids,)))

    def release(self, rid: str) -> None:
        super().release(rid)
        self.log.append(("release", (rid,)))

    def fill(self, rid: str, num_tokens: int) -> None:
        """The scheduler's ``synthetic_fill``: random pool contents, drawn alike on every rank."""
        self._fill(rid, num_tokens)
        self.log.append(("fill", (rid, num_tokens)))

    def take_log(self) -> list[tuple[str, tuple]]:
        log, self.log = self.log, []
        return log


def replay(ops: list[tuple[str, tuple]], hooks: SchedulerHooks, fill: Callable[[str, int], None], rank: int) -> None:
    """Apply rank 0's logged calls to this rank's hooks; a different outcome is a divergence."""
    for name, args in ops:
        if name == "admit":
            got, want = hooks.admit(args[0]), args[1]
        elif name == "reserve":
            got, want = bool(hooks.reserve(args[0], args[1]).ok), args[2]
        elif name == "after_forward":
            got = want = hooks.after_forward(args[0])
        elif name == "release":
            got = want = hooks.release(args[0])
        else:
            got = want = fill(*args)
        if got != want:
            raise RuntimeError(f"rank {rank} diverged from rank 0: {name}{args[:2]} gave {got!r}, rank 0 {want!r}")


class BroadcastingRunner:
    """Rank 0's runner as the scheduler sees it: each forward is first sent to the followers."""

    def __init__(self, runner: Any, ranks: "Ranks"):
        self._runner, self._ranks = runner, ranks

    def forward(self, reqs: list[ForwardRequest]) -> list[torch.Tensor]:
        self._ranks.send(Step(self._ranks.hooks_log(), reqs))
        return self._runner.forward(reqs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


class Ranks:
    """This process's place in the run; on rank 0 also the follower processes."""

    def __init__(self, group: RankGroup, procs: list[Any]):
        self.group, self.procs = group, procs
        self._hooks: Optional[RecordingHooks] = None
        self._closed = False

    @property
    def config(self) -> ParallelConfig:
        return self.group.config

    @property
    def shard(self):
        return self.group.shard

    @property
    def leader(self) -> bool:
        return self.config.rank == 0

    # ---- rank 0 -----------------------------------------------------------------------

    def scheduler_parts(self, allocator: Any, runner: Any, fill: Callable[[str, int], None]
                        ) -> tuple[SchedulerHooks, Any, Callable[[str, int], None]]:
        """The scheduler's hooks, runner and synthetic fill on this rank: on rank 0 hooks that log
        each call (the fill too) and a runner that broadcasts each step; elsewhere the plain ones
        (a follower's scheduler never runs)."""
        if not self.leader:
            return SchedulerHooks(allocator), runner, fill
        self._hooks = RecordingHooks(allocator, fill)
        return self._hooks, BroadcastingRunner(runner, self), self._hooks.fill

    def hooks_log(self) -> list[tuple[str, tuple]]:
        return self._hooks.take_log() if self._hooks is not None else []

    def send(self, step: Step) -> None:
        dist.broadcast_object_list([step], src=0, group=self.group.objects)

    def ready(self, error: Optional[str] = None) -> None:
        """Every rank reports whether it built its engine; if any failed, all raise (and rank 0
        stops the processes)."""
        status: list[Optional[str]] = [None] * self.config.world_size
        dist.all_gather_object(status, error, group=self.group.objects)
        failed = [f"rank {r}: {e}" for r, e in enumerate(status) if e is not None]
        if failed:
            self.close(send_stop=False)
            raise RuntimeError("parallel engine start failed: " + "; ".join(failed))

    def close(self, send_stop: bool = True) -> None:
        """Rank 0: stop the followers and wait for them; every rank: leave the process group."""
        if self._closed:
            return
        self._closed = True
        if self.leader and send_stop:
            try:
                self.send(Step(stop=True))
            except Exception:    # a follower already gone: the join below still ends the rest
                logger.exception("could not tell the followers to stop")
        for p in self.procs:
            p.join(JOIN_TIMEOUT_S)
            if p.is_alive():
                logger.warning("rank process %d did not stop; terminating it", p.pid)
                p.terminate()
                p.join(JOIN_TIMEOUT_S)
        close_ranks()

    # ---- other ranks ------------------------------------------------------------------

    def follow(self, engine: Any) -> None:
        """Replay rank 0's steps on ``engine`` (this rank's) until told to stop."""
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=self.group.objects)
            step: Step = box[0]
            replay(step.ops, engine.hooks, engine.synthetic_filler.fill, self.config.rank)
            if step.stop:
                return
            if step.reqs:
                try:
                    engine.runner.forward(step.reqs)
                except Exception:   # rank 0 met the same input and reports it to its caller
                    logger.exception("rank %d: forward failed", self.config.rank)


def launch_ranks(config: Any, tp_size: int, ep_size: int, device: torch.device,
                 engine_args: dict[str, Any]) -> Optional[Ranks]:
    """None for one rank. In rank 0: check that ``config`` splits, start the other ranks'
    processes (each builds ``Engine(**engine_args)``) and join them; in a rank process: join
    as that rank."""
    if _JOIN is not None:
        pc, port = _JOIN
        return Ranks(init_ranks(pc, port, _rank_device(device, pc.rank)), [])
    pc = ParallelConfig(tp_size, ep_size, 0)
    if pc.world_size == 1:
        return None
    check_shardable(config, pc)
    if device.type == "cuda" and torch.cuda.device_count() < pc.world_size:
        raise ValueError(f"tp_size={tp_size}, ep_size={ep_size} needs {pc.world_size} GPUs, "
                         f"{torch.cuda.device_count()} visible")
    port = free_port()
    ctx = _context()
    procs = []
    for rank in range(1, pc.world_size):
        p = ctx.Process(target=_rank_main, args=(ParallelConfig(tp_size, ep_size, rank), port, engine_args,
                                                 torch.get_num_threads()),
                        name=f"dsv4-rank{rank}", daemon=True)
        p.start()
        procs.append(p)
    try:
        group = init_ranks(pc, port, _rank_device(device, 0))
    except Exception:
        for p in procs:
            p.terminate()
        raise
    return Ranks(group, procs)


def _context() -> Any:
    """Rank processes fork from a server that imported the engine once (forkserver): a rank
    starts in well under a second instead of importing torch anew, and never inherits the
    threads (or a CUDA context) of the process that made the Engine."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["scheduler_hooks.engine"])
    return ctx


def _rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _rank_main(pc: ParallelConfig, port: int, engine_args: dict[str, Any], threads: int) -> None:
    """A rank process: build this rank's Engine (its __init__ joins the group), then follow.
    It runs rank 0's number of torch threads (ranks sharing a few CPU cores must not oversubscribe)."""
    from .engine import Engine

    torch.set_num_threads(threads)
    with join_as(pc, port):
        engine = Engine(**engine_args)
    try:
        engine.ranks.follow(engine)
    finally:
        engine.ranks.close()
