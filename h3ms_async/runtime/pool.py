"""WorkerPool: one ``python -m workers`` subprocess per rank, driven from the coordinator loop.

A rank map (``["cpu", "cpu"]``, ``["cuda:0", "cuda:0", "cuda:1"]``) gives each rank its device, and
a rank program (``program="dit"``) what the workers serve: each imports the worker runtime and
``workers.<program>.rank``, found by name, so a new program needs no change here.  Workers start in
parallel (:mod:`~h3ms_async.runtime.spawn`), authenticate on the pool's socket
(:mod:`~h3ms_async.runtime.admission`), and then serve requests
(:mod:`~h3ms_async.runtime.requests`) until released (:mod:`~h3ms_async.runtime.shutdown`).

Liveness is event-driven: the loop watches each worker's pidfd
(:mod:`~h3ms_async.runtime.exit_watch`: readable the moment the process exits), its channel (EOF,
protocol errors) and a heartbeat deadline timer (:mod:`~h3ms_async.runtime.heartbeat`: a hung
loop); a request has its own deadline.  A worker that exits, closes its channel, breaks the
protocol, misses heartbeats or misses a request deadline is marked dead (and killed); the job it
was part of fails at once with its last log lines, and the next job restarts the whole pool.

Every public coroutine must run on the coordinator loop (``get_coordinator().run(pool.start(),
timeout=...)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import re
import time
from collections.abc import Sequence
from typing import Any

from h3ms_async.log import get_logger
from h3ms_async.runtime import rundir, visibility
from h3ms_async.runtime.admission import Admission
from h3ms_async.runtime.control_block import ControlBlock
from h3ms_async.runtime.coordinator import get_coordinator
from h3ms_async.runtime.requests import request_all, request_one
from h3ms_async.runtime.shutdown import stop_workers
from h3ms_async.runtime.spawn import spawn, worker_env
from h3ms_async.runtime.worker_handle import (
    StartTimes,
    WorkerHandle,
    WorkerState,
    WorkerTimeout,
)
from workers.runtime import auth, config, protocol
from workers.runtime.shm import Segment

log = get_logger("pool")

_PROGRAM_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")


class PoolState(enum.StrEnum):
    """Where a pool is between start and release (named by the string the status JSON shows)."""

    STOPPED = "stopped"  #: no workers
    STARTING = "starting"  #: spawning workers, waiting for their first pings
    RUNNING = "running"  #: every worker answered its first ping
    STOPPING = "stopping"  #: releasing its workers


class PoolBusy(RuntimeError):
    """The pool is running a job and cannot be released now."""


class WorkerPool:
    """One worker process per rank; see the module doc."""

    def __init__(
        self,
        devices: Sequence[str],
        *,
        name: str = "dit",
        program: str | None = None,
        start_timeout: float | None = None,
        env: dict | None = None,
        also_visible: Sequence[str] = (),
    ) -> None:
        """``program``: the rank program the workers run (``workers.<program>.rank``); None serves
        only the runtime's own kinds (ping, echo, ...).  ``also_visible``: CUDA devices every worker
        sees besides its own (after it, as cuda:1, cuda:2, ...; its own device stays cuda:0), for
        rank programs that reach another GPU's memory (e.g. through CUDA IPC)."""
        self._devices = visibility.rank_devices(devices)
        if not re.fullmatch(r"[A-Za-z0-9_]{1,24}", name):
            raise ValueError(f"pool name {name!r} must be 1-24 letters, digits or '_'")
        if program is not None and not _PROGRAM_RE.fullmatch(program):
            raise ValueError(
                f"rank program {program!r} must be a package name under workers/ (lower-case "
                "letters, digits, '_'), e.g. 'dit'"
            )
        self.name = name
        self.program = program
        self._also_visible = visibility.extra_devices(also_visible)
        # fail on a bad device list now, not in a worker
        visibility.check_visible(self._cuda_devices() + self._also_visible)
        self.start_timeout = (
            float(start_timeout) if start_timeout else config.WORKER_START_TIMEOUT.get()
        )
        self.hb_timeout = config.HEARTBEAT_TIMEOUT.get()
        self._env = dict(env or {})
        self._workers: list[WorkerHandle] = []
        self._state = PoolState.STOPPED
        self._run_dir: str | None = None
        self._socket_path: str | None = None
        self._server: asyncio.AbstractServer | None = None
        self._control: ControlBlock | None = None
        self._owned: list[Segment] = []
        #: set whenever a worker becomes ready or dead (what a start waits for)
        self._changed: asyncio.Event | None = None
        self._life_lock = asyncio.Lock()
        self._jobs = 0
        self.starts = 0
        #: the last start's seconds and ``time.monotonic()`` when its workers were all up
        self.start_s = 0.0
        self.up_at = 0.0

    # -- properties --------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self._devices)

    @property
    def devices(self) -> list[str]:
        return list(self._devices)

    @property
    def run_dir(self) -> str | None:
        return self._run_dir

    @property
    def socket_path(self) -> str | None:
        return self._socket_path

    @property
    def busy(self) -> bool:
        return self._jobs > 0

    @property
    def state(self) -> PoolState:
        return self._state

    @property
    def running(self) -> bool:
        return self._state is PoolState.RUNNING

    @property
    def any_dead(self) -> bool:
        """Whether a worker of this start is dead (the next job restarts the pool)."""
        return any(w.state is WorkerState.DEAD for w in self._workers)

    def __repr__(self) -> str:
        return (
            f"WorkerPool({self.name!r}, {self._devices}, program={self.program!r}, "
            f"state={self._state})"
        )

    def log_path(self, rank: int) -> str:
        """The log file of ``rank`` (in the run dir; gone after release)."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} is not in 0..{self.world_size - 1}")
        if self._run_dir is None:
            raise RuntimeError(f"pool {self.name!r} is not started: it has no run dir and no logs")
        return os.path.join(self._run_dir, f"rank{rank}.log")

    def local_index(self, rank: int, device: str) -> int:
        """The index under which the worker of ``rank`` sees ``device`` (its own device or one of
        ``also_visible``)."""
        return visibility.local_index(rank, self._devices[rank], device, self._also_visible)

    def _cuda_devices(self) -> list[str]:
        return [d for d in self._devices if d.startswith("cuda")]

    # -- lifecycle ---------------------------------------------------------------------------------
    def _check_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if loop is not get_coordinator().loop:
            raise RuntimeError(
                "WorkerPool runs on the coordinator loop: use get_coordinator().run(pool.<call>, "
                "timeout)"
            )
        return loop

    async def start(self) -> None:
        """Start every worker (no-op if all are ready; restarts the pool if one is dead)."""
        self._check_loop()
        async with self._life_lock:
            if self._state == PoolState.RUNNING:
                dead = [w for w in self._workers if w.state == WorkerState.DEAD]
                if not dead:
                    return
                if self.busy:
                    w = dead[0]
                    raise w.error(
                        f"is dead ({w.death}); the pool restarts when the running job ends"
                    )
                log.warning(
                    "restarting pool %r (%d ranks): %s",
                    self.name,
                    self.world_size,
                    "; ".join(f"rank {w.rank} {w.death}" for w in dead),
                )
                await self._stop(grace=1.0, final=False)
            await self._start()

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        began = time.monotonic()  # (the loop's clock is uvloop's, cached per iteration)
        self._state = PoolState.STARTING
        changed = self._changed = asyncio.Event()
        run_dir = self._run_dir = rundir.create()
        try:
            socket_path = self._socket_path = rundir.socket_path(run_dir, "ctl.sock")
            key = auth.new_key()
            control = self._control = ControlBlock(f"{self.name}_ctl", self.world_size)
            self._workers = [
                WorkerHandle(r, d, self.log_path(r), self.name, changed)
                for r, d in enumerate(self._devices)
            ]
            admission = Admission(
                pool=self.name,
                workers=self._workers,
                socket_path=socket_path,
                key=key,
                run_dir=run_dir,
                control=control,
                start_timeout=self.start_timeout,
                hb_timeout=self.hb_timeout,
            )
            self._server = await asyncio.start_unix_server(
                admission.on_connect, path=socket_path, limit=1 << 20
            )
            os.chmod(socket_path, 0o600)
            for w in self._workers:
                spawn(
                    w,
                    program=self.program,
                    world_size=self.world_size,
                    socket_path=socket_path,
                    key=key,
                    run_dir=run_dir,
                    doorbells=control.doorbells,
                    env=worker_env(w.device, self._env, self._also_visible),
                )
            await self._wait_ready(t0 + self.start_timeout)
        except BaseException:
            await self._stop(grace=0.5, final=False)
            raise
        self._state = PoolState.RUNNING
        self.starts += 1
        self.up_at = time.monotonic()
        self.start_s = self.up_at - began
        get_coordinator().register_pool(self)
        slowest = max(self._workers, key=lambda w: w.start.total_s if w.start else 0.0)
        log.info(
            "pool %r started: %d worker(s) on %s in %.2f s (run dir %s; the slowest, rank %d: %s)",
            self.name,
            self.world_size,
            ",".join(self._devices),
            loop.time() - t0,
            self._run_dir,
            slowest.rank,
            slowest.start.line() if slowest.start else "no start times",
        )

    async def _wait_ready(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        changed = self._changed
        assert changed is not None  # set by _start before it spawns
        while True:
            changed.clear()
            if all(w.state == WorkerState.READY for w in self._workers):
                return
            for w in self._workers:
                if w.state == WorkerState.DEAD:
                    raise w.error(f"failed to start: {w.death}")
            left = deadline - loop.time()
            if left <= 0:
                w = next(w for w in self._workers if w.state != WorkerState.READY)
                w.mark_dead("did not start in time")
                raise w.error(
                    f"did not start within {self.start_timeout:g} s (set "
                    f"{config.WORKER_START_TIMEOUT.name} to allow longer)",
                    cls=WorkerTimeout,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)

    async def release(self, grace: float = 5.0, force: bool = False) -> None:
        """Stop every worker (shutdown, then kill after ``grace`` s), remove the run dir, unlink
        segments.

        Raises :class:`PoolBusy` while a job runs, unless ``force``.
        """
        self._check_loop()
        if self.busy and not force:
            raise PoolBusy(
                f"pool {self.name!r} is running a job; wait for it to finish or release with "
                "force=True"
            )
        async with self._life_lock:
            await self._stop(grace, final=True)
        get_coordinator().unregister_pool(self)

    async def _stop(self, grace: float, final: bool) -> None:
        if self._state != PoolState.STOPPED or self._workers:
            self._state = PoolState.STOPPING
        await stop_workers(self._workers, grace, self.name)
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._control is not None:
            self._control.close()
            self._control = None
        if final:
            for seg in self._owned:
                seg.close()
            self._owned.clear()
        if self._run_dir is not None:
            rundir.remove(self._run_dir)
            self._run_dir = None
            self._socket_path = None
        self._state = PoolState.STOPPED

    # -- control block -----------------------------------------------------------------------------
    def abort(self) -> None:
        """Tell every rank to stop its current exchange: bump the abort generation, ring every
        doorbell.

        Thread-safe and cheap; a no-op on a stopped pool.
        """
        ctl = self._control
        if ctl is None:
            return
        log.info("pool %r: abort (generation %d)", self.name, ctl.abort())

    @property
    def abort_generation(self) -> int:
        """Current abort generation (0 before the first abort of this start)."""
        ctl = self._control
        return ctl.generation if ctl is not None else 0

    def create_segment(self, size: int, tag: str) -> Segment:
        """A shm segment owned by this pool: unlinked when the pool is released."""
        seg = Segment.create(size, tag)
        self._owned.append(seg)
        return seg

    # -- jobs --------------------------------------------------------------------------------------
    async def _ensure_ready(self) -> None:
        self._check_loop()
        if self._state != PoolState.RUNNING or self.any_dead:
            await self.start()

    async def request(
        self, rank: int, msg: protocol.Request, timeout: float = 60.0
    ) -> protocol.Answer:
        """Send one request to one rank; return its answer (a ``msg.ANSWER`` struct) or raise
        :class:`~h3ms_async.runtime.worker_handle.WorkerError`."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} is not in 0..{self.world_size - 1}")
        await self._ensure_ready()
        self._jobs += 1
        try:
            return await request_one(self._workers[rank], msg, timeout, self.program)
        finally:
            self._jobs -= 1

    async def all(self, per_rank: Sequence[protocol.Request | None], timeout: float) -> list[Any]:
        """Send ``per_rank[r]`` to rank r, for every rank (None: nothing to that rank, whose
        answer is None); return their answers (``ANSWER`` structs) in rank order.

        Fail fast: the first error or death aborts the other ranks (:meth:`abort`) and raises its
        :class:`~h3ms_async.runtime.worker_handle.WorkerError` at once; cancellation aborts them
        too.
        """
        if len(per_rank) != self.world_size:
            kinds = sorted({m.kind for m in per_rank if m is not None})
            raise ValueError(
                f"{'/'.join(kinds)}: got {len(per_rank)} requests for {self.world_size} ranks"
            )
        await self._ensure_ready()
        self._jobs += 1
        try:
            return await request_all(self._workers, per_rank, timeout, self.program, self.abort)
        finally:
            self._jobs -= 1

    # -- status ------------------------------------------------------------------------------------
    def worker_pids(self) -> list[int | None]:
        """Each worker's process id by rank (None: not started)."""
        return [w.pid for w in self._workers] if self._workers else [None] * len(self._devices)

    def start_times(self) -> list[StartTimes | None]:
        """Where each rank's worker start went (None: not started, or not yet ready)."""
        return [w.start for w in self._workers] if self._workers else [None] * len(self._devices)

    def snapshot(self) -> list[dict[str, Any]]:
        """Per worker: rank, device, pid, state (a :class:`WorkerState` value), uptime_s,
        rss_bytes, vram_bytes, log, jobs_done."""
        now = time.monotonic()
        if not self._workers:
            return [
                {
                    "rank": r,
                    "device": d,
                    "pid": None,
                    "state": WorkerState.STOPPED.value,
                    "uptime_s": 0.0,
                    "rss_bytes": None,
                    "vram_bytes": None,
                    "log": None,
                    "jobs_done": 0,
                }
                for r, d in enumerate(self._devices)
            ]
        out = []
        for w in self._workers:
            state = WorkerState.STOPPED if w.state is WorkerState.STOPPING else w.state
            if state is WorkerState.READY and w.inflight > 0:
                state = WorkerState.BUSY
            alive = state in (WorkerState.STARTING, WorkerState.READY, WorkerState.BUSY)
            out.append(
                {
                    "rank": w.rank,
                    "device": w.device,
                    "pid": w.pid,
                    "state": state.value,
                    "uptime_s": round(now - w.started_at, 3) if alive else 0.0,
                    "rss_bytes": w.rss if alive else None,
                    "vram_bytes": w.vram if alive and w.device.startswith("cuda") else None,
                    "log": w.log_path if self._run_dir else None,
                    "jobs_done": w.jobs_done,
                }
            )
        return out
