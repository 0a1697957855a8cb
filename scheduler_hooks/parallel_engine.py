"""Rank processes of a tensor / expert parallel Engine: start, step broadcast, follow, stop.

``Engine(..., tp_size=N, ep_size=M)`` is rank 0: it starts one process per other rank
(``multiprocessing``, forked from a forkserver that has imported the engine), each of which
builds the same Engine (same config, seeded weights or checkpoint, memory plan and pools)
holding its own shard of the model, then follows.
Rank 0 alone owns the scheduler, the tokenizer and sampling. Every rank keeps its own copy of the
allocator and pools, changed by the same calls in the same order:

    rank 0 scheduler ── hooks, prefix cache ── allocator calls (logged) + synthetic fills ──┐
                     └─ runner.forward(reqs) ─ broadcast Step(ops since the last step, reqs) ┤
    rank k  follow():    replay the ops on its own allocator, then runner.forward(reqs) <────┘

so every rank builds the same ForwardMetadata from its own tables and writes the same KV rows
into its own (replicated) pools, and the forward's collectives pair up. The prefix cache lives on
rank 0 only: the followers replay its page operations (a hit's ``attach_prefix``, an insert's
``retain``, an eviction's ``release``) among the scheduler's, so their holder counts match too.
Only the step's Python objects cross (the log: about 60 pickled bytes per decoding request):
over gloo, on a group beside NCCL on CUDA.

Under ``torchrun --nproc-per-node N`` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
set) the launcher has started the processes: every one builds ``Engine(tp_size=N)``, none spawns,
they join at MASTER_ADDR:MASTER_PORT, rank RANK on ``cuda:LOCAL_RANK``; on ranks other than 0 the
Engine's construction follows rank 0 until it shuts down and returns the engine closed
(``Engine.is_leader`` is False there).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from dsv4_backend.model_runner import ForwardRequest
from dsv4_backend.parallel import ParallelConfig, RankGroup, check_shardable, close_ranks, free_port, init_ranks

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
    """What rank 0 sends before each forward: its allocator's changes since the last step (in
    order, :class:`AllocatorLog`), the forward's requests; ``stop``: leave the loop."""

    ops: list[tuple[str, tuple, Any]] = field(default_factory=list)
    reqs: Optional[list[ForwardRequest]] = None
    stop: bool = False
    check: bool = False      # every rank reports its allocator_state (Ranks.check_allocators)


# The KVAllocator methods that change its state (its other public methods only read it).
ALLOCATOR_CHANGES = ("admit", "extend", "evict_swa", "truncate", "free", "attach_prefix", "retain", "release")


class AllocatorLog:
    """Rank 0's record, in call order, of every call that changes its allocator, whoever makes it
    (the scheduler's hooks, the prefix cache and its hooks), with the result the followers must
    reproduce; and of the synthetic fills (random pool contents, drawn alike on every rank).

    It wraps the allocator's methods on the instance, so the prefix cache's page operations
    (``attach_prefix`` at a hit, ``retain`` at an insert, ``release`` at an eviction or a flush)
    are logged as they happen, between the scheduler's own calls."""

    def __init__(self, allocator: Any, fill: Callable[[str, int], None]):
        self._fill = fill
        self.ops: list[tuple[str, tuple, Any]] = []
        for name in ALLOCATOR_CHANGES:   # an instance attribute shadows the class's method
            setattr(allocator, name, self._logged(name, getattr(allocator, name)))

    def _logged(self, name: str, method: Callable) -> Callable:
        def call(*args: Any) -> Any:
            out = method(*args)
            # the page lists / maps are copied: the caller may change them before the step is sent
            self.ops.append((name, tuple(type(a)(a) if isinstance(a, (list, dict)) else a for a in args), out))
            return out
        return call

    def fill(self, rid: str, num_tokens: int) -> None:
        """The scheduler's ``synthetic_fill``."""
        self._fill(rid, num_tokens)
        self.ops.append(("fill", (rid, num_tokens), None))

    def take(self) -> list[tuple[str, tuple, Any]]:
        ops, self.ops = self.ops, []
        return ops


def allocator_state(allocator: Any) -> tuple:
    """What the same calls must leave equal on every rank: each live request's slot, length and
    full pages, every used page's holder count (the prefix cache's holds included) and a CRC of
    each table (``req_to_token``, ``full_to_swa``)."""
    reqs = sorted((str(r), allocator.req_slot(r), allocator.seq_len(r), tuple(allocator.full_pages_of(r)))
                  for r in allocator.live_requests)
    holders = tuple(tuple(sorted((p, pool.refcount(p)) for p in pool.used_pages))
                    for pool in (allocator.full, allocator.swa))
    tables = tuple(zlib.crc32(t.cpu().numpy().tobytes()) for t in (allocator.req_to_token, allocator.full_to_swa))
    return reqs, holders, tables


def replay(ops: list[tuple[str, tuple, Any]], allocator: Any, fill: Callable[[str, int], None], rank: int) -> None:
    """Apply rank 0's logged calls to this rank's allocator; a different result is a divergence."""
    for name, args, want in ops:
        got = fill(*args) if name == "fill" else getattr(allocator, name)(*args)
        if got != want:
            raise RuntimeError(f"rank {rank} diverged from rank 0: {name}{args[:2]} gave {got!r}, rank 0 {want!r}")


class BroadcastingRunner:
    """Rank 0's runner as the scheduler sees it: each forward is first sent to the followers."""

    def __init__(self, runner: Any, ranks: "Ranks"):
        self._runner, self._ranks = runner, ranks

    def forward(self, reqs: list[ForwardRequest]) -> list[torch.Tensor]:
        self._ranks.send(Step(self._ranks.ops_since_last_step(), reqs))
        return self._runner.forward(reqs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


class Ranks:
    """This process's place in the run; on rank 0 also the follower processes."""

    def __init__(self, group: RankGroup, procs: list[Any], torchrun: bool = False):
        self.group, self.procs = group, procs
        self.torchrun = torchrun     # the processes are torchrun's: rank k > 0 follows inside its Engine()
        self._log: Optional[AllocatorLog] = None
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
                        ) -> tuple[Any, Callable[[str, int], None]]:
        """Rank 0: the runner and synthetic fill its scheduler uses: a runner that broadcasts each
        step with the allocator's changes since the last (from now on logged), and a logged fill."""
        self._log = AllocatorLog(allocator, fill)
        return BroadcastingRunner(runner, self), self._log.fill

    def ops_since_last_step(self) -> list[tuple[str, tuple, Any]]:
        return self._log.take() if self._log is not None else []

    def send(self, step: Step) -> None:
        dist.broadcast_object_list([step], src=0, group=self.group.objects)

    def check_allocators(self, allocator: Any) -> None:
        """Rank 0, between steps: AssertionError unless every rank's allocator, once the calls
        logged so far are replayed, is in rank 0's state (:func:`allocator_state`)."""
        self.send(Step(self.ops_since_last_step(), check=True))
        states = self._gather_states(allocator)
        for r, st in enumerate(states):
            diff = [name for name, a, b in zip(("requests", "page holders", "tables"), st, states[0]) if a != b]
            if diff:
                raise AssertionError(f"rank {r}'s allocator differs from rank 0's: its {' and '.join(diff)}")

    def _gather_states(self, allocator: Any) -> list[Any]:
        states: list[Any] = [None] * self.config.world_size
        dist.all_gather_object(states, allocator_state(allocator), group=self.group.objects)
        return states

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
        close_ranks(self.group)

    # ---- other ranks ------------------------------------------------------------------

    def follow(self, engine: Any) -> None:
        """Replay rank 0's steps on ``engine`` (this rank's) until told to stop."""
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=self.group.objects)
            step: Step = box[0]
            replay(step.ops, engine.allocator, engine.synthetic_filler.fill, self.config.rank)
            if step.stop:
                return
            if step.check:
                self._gather_states(engine.allocator)
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
    launched = torchrun_rank(tp_size, ep_size)
    if launched is not None:
        return _join_torchrun(config, launched, local_rank=int(os.environ.get("LOCAL_RANK", launched.rank)),
                              device=device)
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


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_rank(tp_size: int, ep_size: int) -> Optional[ParallelConfig]:
    """This process's rank when torchrun started it (its variables all set; a default group the
    script made from them is joined as it is); None otherwise, and for a one-process launch of a
    one-rank engine. ValueError, before any group is joined, when the launch's world size is not
    the engine's ``max(tp_size, ep_size)``."""
    if not all(v in os.environ for v in TORCHRUN_VARS):
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    want = ParallelConfig(tp_size, ep_size).world_size
    if world != want:
        raise ValueError(f"torchrun started WORLD_SIZE={world} processes, but tp_size={tp_size}, "
                         f"ep_size={ep_size} run max(tp_size, ep_size) = {want} ranks: launch with "
                         f"--nproc-per-node {want} or pass tp_size={world}")
    return None if world == 1 else ParallelConfig(tp_size, ep_size, rank)


def _join_torchrun(config: Any, pc: ParallelConfig, local_rank: int, device: torch.device) -> Ranks:
    """Join the launcher's ranks (``env://``) on ``cuda:LOCAL_RANK`` (CUDA) or the CPU (gloo).
    Rank 0 tells the others to stop at exit if its Engine was not shut down."""
    check_shardable(config, pc)
    if device.type == "cuda" and not local_rank < torch.cuda.device_count():
        raise ValueError(f"LOCAL_RANK={local_rank} needs cuda:{local_rank}, but "
                         f"{torch.cuda.device_count()} GPUs are visible")
    ranks = Ranks(init_ranks(pc, None, _rank_device(device, local_rank)), [], torchrun=True)
    if ranks.leader:
        atexit.register(ranks.close)
    return ranks


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
