"""WorkerPool: one ``python -m workers`` subprocess per rank, driven from the coordinator loop.

A rank map (``["cpu", "cpu"]``, ``["cuda:0", "cuda:0", "cuda:1"]``) gives each rank its device, and
a rank program (``program="dit"``) what the workers serve: each imports the worker runtime and
``workers.<program>.rank``, found by name, so a new program needs no change here.  Workers start in
parallel, authenticate on the pool's socket, and then serve requests until released.

Liveness is event-driven: the loop watches each worker's pidfd (readable the moment the process
exits), its channel (EOF, protocol errors) and a heartbeat deadline timer (a hung loop); a request
has its own deadline.  A worker that exits, closes its channel, breaks the protocol, misses
heartbeats or misses a request deadline is marked dead (and killed); the job it was part of fails at
once with its last log lines, and the next job restarts the whole pool.

Every public coroutine must run on the coordinator loop (``get_coordinator().run(pool.start(),
timeout=...)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import re
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from h3ms_async import PACK_ROOT
from h3ms_async.log import get_logger, tail_file
from h3ms_async.runtime import rundir
from h3ms_async.runtime.channel import (
    Channel,
    ChannelClosed,
    RemoteError,
    authenticate,
    peer_credentials,
)
from h3ms_async.runtime.coordinator import get_coordinator
from workers.runtime import auth, config, protocol
from workers.runtime.shm import ABORT_WORD, CONTROL_SIZE, Segment

log = get_logger("pool")

HB_INTERVAL = 1.0
LOG_TAIL_LINES = 20
#: Unauthenticated connections the pool serves at once, per rank; more are closed at once.
MAX_HANDSHAKES_PER_RANK = 2
#: How long a request whose channel closed waits for its worker's exit, so the error can name the
#: exit status.
EXIT_REPORT_WAIT_S = 1.0
#: How long a connecting peer has to answer the auth challenge before it is refused.
AUTH_TIMEOUT_S = 10.0
_DEVICE_RE = re.compile(r"^(cpu|cuda(?::(\d+))?)$")
_PROGRAM_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")


class _State(enum.StrEnum):
    """A state named by its string (what the status JSON and messages show)."""


class WorkerState(_State):
    """Where one worker process is in its life."""

    STARTING = "starting"  #: spawned; not yet answered its first ping
    READY = "ready"  #: serving requests
    BUSY = "busy"  #: ready with a request in flight (only in :meth:`WorkerPool.snapshot`)
    DEAD = "dead"  #: exited, broke the protocol or missed a deadline (and was killed)
    STOPPING = "stopping"  #: asked to shut down by a release
    STOPPED = "stopped"  #: gone after a release


class PoolState(_State):
    """Where a pool is between start and release."""

    STOPPED = "stopped"  #: no workers
    STARTING = "starting"  #: spawning workers, waiting for their first pings
    RUNNING = "running"  #: every worker answered its first ping
    STOPPING = "stopping"  #: releasing its workers


class WorkerError(RuntimeError):
    """A worker failed (error, death, deadline); the message names rank and device and quotes its
    log."""

    def __init__(self, message: str, rank: int, device: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.device = device


class WorkerTimeout(WorkerError, TimeoutError):
    """A worker did not answer (or start) within its deadline."""


class PoolBusy(RuntimeError):
    """The pool is running a job and cannot be released now."""


def cuda_visible_for(device: str, parent_visible: str | None) -> str:
    """The CUDA_VISIBLE_DEVICES a worker on ``device`` gets: the parent's own entry for that
    index."""
    m = _DEVICE_RE.match(device)
    if not m or not device.startswith("cuda"):
        raise ValueError(f"{device!r} is not a CUDA device (cuda or cuda:N)")
    index = int(m.group(2) or 0)
    if parent_visible is None:
        return str(index)
    entries = [e.strip() for e in parent_visible.split(",") if e.strip()]
    if index >= len(entries):
        raise ValueError(
            f"device {device} is not visible to this process: "
            f"CUDA_VISIBLE_DEVICES={parent_visible!r} lists {len(entries)} device(s); use "
            f"cuda:0..cuda:{max(len(entries) - 1, 0)} or widen CUDA_VISIBLE_DEVICES"
        )
    return entries[index]


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class _Worker:
    rank: int
    device: str
    log_path: str
    proc: subprocess.Popen | None = None
    channel: Channel | None = None
    state: WorkerState = WorkerState.STARTING
    death: str | None = None
    started_at: float = field(default_factory=time.monotonic)
    last_hb: float = field(default_factory=time.monotonic)
    rss: int | None = None
    vram: int | None = None
    inflight: int = 0
    jobs_done: int = 0
    #: the kinds this worker serves (its answer to the first ping)
    serves: frozenset[str] = frozenset()
    #: open pidfd of ``proc`` while the loop watches it; -1 once it exited or is no longer watched
    pidfd: int = -1
    #: set once ``proc`` has exited and was reaped
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    hb_timer: asyncio.TimerHandle | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


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
        if isinstance(devices, str) or not devices:
            raise ValueError(
                "devices must be a non-empty list like ['cpu', 'cpu'] or ['cuda:0', 'cuda:1'], "
                f"got {devices!r}"
            )
        bad = [d for d in devices if not isinstance(d, str) or not _DEVICE_RE.match(d)]
        if bad:
            raise ValueError(f"devices {bad!r} are not 'cpu', 'cuda' or 'cuda:N'")
        if not re.fullmatch(r"[A-Za-z0-9_]{1,24}", name):
            raise ValueError(f"pool name {name!r} must be 1-24 letters, digits or '_'")
        if program is not None and not _PROGRAM_RE.fullmatch(program):
            raise ValueError(
                f"rank program {program!r} must be a package name under workers/ (lower-case "
                "letters, digits, '_'), e.g. 'dit'"
            )
        self.name = name
        self.program = program
        self._devices = [("cuda:0" if d == "cuda" else d) for d in devices]
        self._also_visible = [("cuda:0" if d == "cuda" else d) for d in also_visible]
        bad = [d for d in self._also_visible if not d.startswith("cuda") or not _DEVICE_RE.match(d)]
        if bad:
            raise ValueError(f"also_visible {bad!r} are not CUDA devices 'cuda' or 'cuda:N'")
        for d in self._cuda_devices() + self._also_visible:
            # fail on a bad device list now, not in a worker
            cuda_visible_for(d, os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.start_timeout = (
            float(start_timeout) if start_timeout else config.WORKER_START_TIMEOUT.get()
        )
        self.hb_timeout = config.HEARTBEAT_TIMEOUT.get()
        self._env = dict(env or {})
        self._workers: list[_Worker] = []
        self._state = PoolState.STOPPED
        self._run_dir: str | None = None
        self._socket_path: str | None = None
        self._server: asyncio.AbstractServer | None = None
        self._key: bytes | None = None
        self._doorbells: list[int] = []
        self._control: Segment | None = None
        self._owned: list[Segment] = []
        #: set whenever a worker becomes ready or dead (what a start waits for)
        self._changed: asyncio.Event | None = None
        self._life_lock = asyncio.Lock()
        self._jobs = 0
        self._handshakes = 0
        self.starts = 0

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
                    raise self._error(
                        w, f"is dead ({w.death}); the pool restarts when the running job ends"
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
        self._state = PoolState.STARTING
        self._changed = asyncio.Event()
        self._run_dir = rundir.create()
        try:
            self._socket_path = rundir.socket_path(self._run_dir, "ctl.sock")
            self._key = auth.new_key()
            self._control = Segment.create(CONTROL_SIZE, f"{self.name}_ctl")
            self._doorbells = [
                os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in self._devices
            ]
            self._server = await asyncio.start_unix_server(
                self._on_connect, path=self._socket_path, limit=1 << 20
            )
            os.chmod(self._socket_path, 0o600)
            self._workers = [_Worker(r, d, self.log_path(r)) for r, d in enumerate(self._devices)]
            for w in self._workers:
                self._spawn(w)
            await self._wait_ready(t0 + self.start_timeout)
        except BaseException:
            await self._stop(grace=0.5, final=False)
            raise
        self._state = PoolState.RUNNING
        self.starts += 1
        get_coordinator().register_pool(self)
        log.info(
            "pool %r started: %d worker(s) on %s in %.2f s (run dir %s)",
            self.name,
            self.world_size,
            ",".join(self._devices),
            loop.time() - t0,
            self._run_dir,
        )

    def _worker_env(self, w: _Worker) -> dict:
        env = dict(os.environ)
        env.update(self._env)
        old = env.get("PYTHONPATH")
        env["PYTHONPATH"] = str(PACK_ROOT) + (os.pathsep + old if old else "")
        env["PYTHONUNBUFFERED"] = "1"
        if w.device.startswith("cuda"):
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self._visible_entries(w.device))
        return env

    def _visible_entries(self, device: str) -> list[str]:
        """CUDA_VISIBLE_DEVICES entries of a worker on ``device``: its own first, then
        ``also_visible`` (no repeats)."""
        parent = os.environ.get("CUDA_VISIBLE_DEVICES")
        entries: list[str] = []
        for d in [device, *self._also_visible]:
            entry = cuda_visible_for(d, parent)
            if entry not in entries:
                entries.append(entry)
        return entries

    def local_index(self, rank: int, device: str) -> int:
        """The index under which the worker of ``rank`` sees ``device`` (its own device or one of
        ``also_visible``)."""
        own = self._devices[rank]
        entries = self._visible_entries(own)
        entry = cuda_visible_for(device, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if not own.startswith("cuda") or entry not in entries:
            raise ValueError(
                f"rank {rank} on {own} does not see {device}; add it to the pool's also_visible"
            )
        return entries.index(entry)

    def _spawn(self, w: _Worker) -> None:
        assert self._socket_path is not None and self._key is not None  # set by _start first
        local_device = "cuda:0" if w.device.startswith("cuda") else "cpu"
        cmd = [
            sys.executable,
            "-m",
            "workers",
            "--rank",
            str(w.rank),
            "--world-size",
            str(self.world_size),
            "--socket",
            self._socket_path,
            "--parent-pid",
            str(os.getpid()),
            "--device",
            local_device,
        ]
        if self.program is not None:
            cmd += ["--program", self.program]
        with open(w.log_path, "ab") as logf:
            logf.write(
                f"{time.strftime('%Y-%m-%d %H:%M:%S')} coordinator: starting rank {w.rank} on "
                f"{w.device} (pool {self.name!r}, program {self.program or 'none'}, parent pid "
                f"{os.getpid()})\n".encode()
            )
            logf.flush()
            # New session: a terminal's Ctrl-C goes to the parent, which stops the workers itself.
            w.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=self._worker_env(w),
                cwd=self._run_dir,
                pass_fds=self._doorbells,
                start_new_session=True,
            )
        w.started_at = time.monotonic()
        self._watch_exit(w)
        stdin = w.proc.stdin
        assert stdin is not None  # spawned with stdin=PIPE
        # a broken pipe means it died at once: its pidfd reports the exit, _wait_ready the log
        with contextlib.suppress(BrokenPipeError):
            stdin.write(auth.key_line(self._key))
            stdin.close()

    def _watch_exit(self, w: _Worker) -> None:
        """Have the loop call :meth:`_on_exit` the moment ``w``'s process exits (its pidfd turns
        readable)."""
        assert w.proc is not None  # called right after _spawn started it
        try:
            w.pidfd = os.pidfd_open(w.proc.pid)
        except OSError as exc:
            w.proc.kill()
            raise RuntimeError(
                f"pidfd_open failed ({exc}): H3 MultiStream watches its workers through pidfds, "
                "which need Linux 5.3 or newer (and, in a container, a seccomp profile that "
                "allows pidfd_open)"
            ) from None
        asyncio.get_running_loop().add_reader(w.pidfd, self._on_exit, w)

    def _unwatch_exit(self, w: _Worker) -> None:
        if w.pidfd >= 0:
            asyncio.get_running_loop().remove_reader(w.pidfd)
            os.close(w.pidfd)
            w.pidfd = -1

    def _on_exit(self, w: _Worker) -> None:
        # A pidfd turns readable only once its process has exited, so poll() reaps it here.
        assert w.proc is not None  # only a spawned worker's pidfd is watched
        code = w.proc.poll()
        if code is None:
            return
        self._unwatch_exit(w)
        w.exited.set()
        if w.state in (WorkerState.STARTING, WorkerState.READY):
            during = " during start" if w.state == WorkerState.STARTING else ""
            self._mark_dead(w, _exit_text(code) + during)

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
                    raise self._error(w, f"failed to start: {w.death}")
            left = deadline - loop.time()
            if left <= 0:
                w = next(w for w in self._workers if w.state != WorkerState.READY)
                self._mark_dead(w, "did not start in time")
                raise self._error(
                    w,
                    f"did not start within {self.start_timeout:g} s (set "
                    f"{config.WORKER_START_TIMEOUT.name} to allow longer)",
                    cls=WorkerTimeout,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        workers = self._workers
        if self._handshakes >= MAX_HANDSHAKES_PER_RANK * max(1, len(workers)):
            log.error(
                "pool %r refused a connection on %s: %d handshakes already pending",
                self.name,
                self._socket_path,
                self._handshakes,
            )
            writer.close()
            return
        self._handshakes += 1
        try:
            await self._admit(reader, writer, workers)
        finally:
            self._handshakes -= 1

    async def _admit(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, workers: list[_Worker]
    ) -> None:
        key = self._key
        assert key is not None  # set by _start before its server accepts connections
        try:
            rank, _pid = await authenticate(reader, writer, key, timeout=AUTH_TIMEOUT_S)
            if not 0 <= rank < len(workers):
                raise auth.AuthError(f"rank {rank} is not in this pool of {len(workers)}")
            w = workers[rank]
            peer_pid = peer_credentials(writer)[0]
            if w.proc is None or peer_pid != w.proc.pid:
                raise auth.AuthError(
                    f"rank {rank} connected from pid {peer_pid}, but its worker is pid {w.pid}"
                )
            if w.state != WorkerState.STARTING or w.channel is not None:
                raise auth.AuthError(f"rank {rank} is already connected")
        except (TimeoutError, protocol.ProtocolError, auth.AuthError, EOFError, OSError) as exc:
            log.error(
                "pool %r refused a connection on %s: %s: %s",
                self.name,
                self._socket_path,
                type(exc).__name__,
                exc,
            )
            # the peer may already be gone
            with contextlib.suppress(Exception):
                writer.write(
                    protocol.encode(protocol.Refused(error=f"{type(exc).__name__}: {exc}"[:400]))
                )
            writer.close()
            return
        ch = Channel(
            reader,
            writer,
            f"rank {rank} ({w.device})",
            on_heartbeat=partial(self._on_heartbeat, w),
            on_close=partial(self._on_channel_close, w),
        )
        w.channel = ch
        ch.start()
        run_dir, control = self._run_dir, self._control
        assert run_dir is not None and control is not None  # the pool is started (not released)
        try:
            await ch.send(
                protocol.Welcome(
                    world_size=self.world_size,
                    device="cuda:0" if w.device.startswith("cuda") else "cpu",
                    run_dir=run_dir,
                    doorbell_fds=list(self._doorbells),
                    control=control.name,
                    hb_interval=HB_INTERVAL,
                )
            )
            pong = await ch.request(protocol.Ping(), timeout=self.start_timeout)
            assert isinstance(pong, protocol.Pong)  # decoded as Ping's ANSWER
        except (ChannelClosed, RemoteError, TimeoutError, OSError) as exc:
            self._mark_dead(w, f"failed its first ping: {exc}")
            return
        if w.state == WorkerState.STARTING:
            w.state = WorkerState.READY
            w.serves = frozenset(pong.serves or ())
            w.last_hb = time.monotonic()
            self._watch_heartbeat(w)
            assert self._changed is not None  # set by _start before its server accepts connections
            self._changed.set()

    def _on_heartbeat(self, w: _Worker, msg: protocol.Heartbeat) -> None:
        w.last_hb = time.monotonic()
        w.rss = msg.rss
        w.vram = msg.vram

    def _watch_heartbeat(self, w: _Worker) -> None:
        """A timer due when ``w``'s heartbeats are ``hb_timeout`` late: it marks a silent worker
        dead (a hung loop sends none, though its process and channel live on), or re-arms for the
        latest heartbeat's deadline."""
        w.hb_timer = None
        if w.state != WorkerState.READY:
            return
        late = time.monotonic() - w.last_hb
        if late > self.hb_timeout:
            self._mark_dead(
                w,
                f"no heartbeat for {late:.1f} s "
                f"({config.HEARTBEAT_TIMEOUT.name}={self.hb_timeout:g}); killed it",
            )
            return
        w.hb_timer = asyncio.get_running_loop().call_later(
            self.hb_timeout - late + 0.01, self._watch_heartbeat, w
        )

    def _on_channel_close(self, w: _Worker, reason: str) -> None:
        if w.state in (WorkerState.STARTING, WorkerState.READY):
            self._mark_dead(w, f"channel closed: {reason}")

    def _note(self, w: _Worker, text: str) -> None:
        try:
            with open(w.log_path, "a", encoding="utf-8") as fh:
                fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} coordinator: {text}\n")
        except OSError:
            pass

    def _mark_dead(self, w: _Worker, reason: str) -> None:
        if w.state in (WorkerState.DEAD, WorkerState.STOPPING, WorkerState.STOPPED):
            return
        w.state = WorkerState.DEAD
        w.death = reason
        if w.hb_timer is not None:
            w.hb_timer.cancel()
            w.hb_timer = None
        if w.proc is not None and w.proc.poll() is None:
            w.proc.kill()
        if w.channel is not None:
            w.channel.close(reason)
        log.error(
            "pool %r: rank %d on %s (pid %s) is dead: %s",
            self.name,
            w.rank,
            w.device,
            w.pid,
            reason,
        )
        self._note(w, f"rank {w.rank} marked dead: {reason}")
        if self._changed is not None:
            self._changed.set()

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
        live = [
            w.channel
            for w in self._workers
            if w.state == WorkerState.READY and w.channel is not None
        ]
        for w in self._workers:
            if w.hb_timer is not None:
                w.hb_timer.cancel()
                w.hb_timer = None
            if w.state != WorkerState.DEAD:
                w.state = WorkerState.STOPPING

        async def _ask(ch: Channel) -> None:
            with contextlib.suppress(ChannelClosed, RemoteError, TimeoutError, OSError):
                await ch.request(protocol.Shutdown(), timeout=grace)

        if live:
            await asyncio.gather(*(_ask(ch) for ch in live))
        await self._exits(grace)
        for w in self._workers:
            if w.proc is not None and w.proc.poll() is None:
                log.warning(
                    "pool %r: rank %d (pid %d) did not exit within %g s; killing it",
                    self.name,
                    w.rank,
                    w.pid,
                    grace,
                )
                w.proc.kill()
        await self._exits(5.0)
        for w in self._workers:
            self._unwatch_exit(w)
            if w.channel is not None:
                w.channel.close("pool released")
            w.state = WorkerState.STOPPED
        if self._server is not None:
            self._server.close()
            self._server = None
        for fd in self._doorbells:
            os.close(fd)
        self._doorbells = []
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

    async def _exits(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for every spawned worker's exit (reported by its pidfd)."""
        waits = [asyncio.ensure_future(w.exited.wait()) for w in self._workers if w.pidfd >= 0]
        if not waits:
            return
        try:
            await asyncio.wait(waits, timeout=timeout)
        finally:
            for t in waits:
                t.cancel()

    # -- control block -----------------------------------------------------------------------------
    def abort(self) -> None:
        """Tell every rank to stop its current exchange: bump the abort generation, ring every
        doorbell.

        Thread-safe and cheap; a no-op on a stopped pool.
        """
        ctl, bells = self._control, list(self._doorbells)
        if ctl is None:
            return
        with ctl.buffer(ABORT_WORD * 8, 8) as word:
            (gen,) = struct.unpack("=q", word)
            struct.pack_into("=q", word, 0, gen + 1)
        for fd in bells:
            # counter full or fd closed by a concurrent release: the generation word still tells
            with contextlib.suppress(OSError):
                os.eventfd_write(fd, 1)
        log.info("pool %r: abort (generation %d)", self.name, gen + 1)

    @property
    def abort_generation(self) -> int:
        """Current abort generation (0 before the first abort of this start)."""
        if self._control is None:
            return 0
        with self._control.buffer(ABORT_WORD * 8, 8) as word:
            return struct.unpack("=q", word)[0]

    def create_segment(self, size: int, tag: str) -> Segment:
        """A shm segment owned by this pool: unlinked when the pool is released."""
        seg = Segment.create(size, tag)
        self._owned.append(seg)
        return seg

    # -- jobs --------------------------------------------------------------------------------------
    def _error(
        self, w: _Worker, what: str, cls: type[WorkerError] = WorkerError, tb: str = ""
    ) -> WorkerError:
        status = _exit_text(w.proc.poll()) if w.proc is not None else "not started"
        msg = f"worker rank {w.rank} on {w.device} (pid {w.pid}, {status}) {what}"
        if tb:
            msg += f"\n--- worker traceback ---\n{tb.rstrip()}"
        log_tail = "\n".join(tail_file(w.log_path, LOG_TAIL_LINES))
        msg += f"\n--- last lines of {w.log_path} ---\n{log_tail}"
        return cls(msg, w.rank, w.device)

    async def _ensure_ready(self) -> None:
        self._check_loop()
        if self._state != PoolState.RUNNING or self.any_dead:
            await self.start()

    async def _request(self, w: _Worker, msg: protocol.Request, timeout: float) -> protocol.Answer:
        kind = msg.kind
        if w.state != WorkerState.READY or w.channel is None:
            raise self._error(
                w, f"cannot take {kind!r}: it is {w.state}" + (f" ({w.death})" if w.death else "")
            )
        if kind not in w.serves:
            raise ValueError(
                f"pool {self.name!r} (rank program {self.program or 'none'}) does not serve "
                f"{kind!r}; it serves {', '.join(sorted(w.serves))}: send it to its own program's "
                "pool"
            )
        w.inflight += 1
        try:
            result = await w.channel.request(msg, timeout)
        except RemoteError as exc:
            raise self._error(w, f"failed {kind!r}: {exc.error}", tb=exc.tb) from None
        except ChannelClosed as exc:
            # The exit usually follows the EOF within milliseconds: wait for it, so the message
            # names the status.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(w.exited.wait(), EXIT_REPORT_WAIT_S)
            self._mark_dead(w, f"channel closed ({exc})")
            raise self._error(w, f"died during {kind!r}: {w.death}") from None
        except TimeoutError:
            self._mark_dead(w, f"no answer to {kind!r} within {timeout:g} s; killed it")
            raise self._error(
                w, f"did not answer {kind!r} within {timeout:g} s", cls=WorkerTimeout
            ) from None
        finally:
            w.inflight -= 1
        w.jobs_done += 1
        return result

    async def request(
        self, rank: int, msg: protocol.Request, timeout: float = 60.0
    ) -> protocol.Answer:
        """Send one request to one rank; return its answer (a ``msg.ANSWER`` struct) or raise
        :class:`WorkerError`."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} is not in 0..{self.world_size - 1}")
        await self._ensure_ready()
        self._jobs += 1
        try:
            return await self._request(self._workers[rank], msg, timeout)
        finally:
            self._jobs -= 1

    async def all(self, per_rank: Sequence[protocol.Request], timeout: float) -> list[Any]:
        """Send ``per_rank[r]`` to rank r, for every rank; return their answers (``ANSWER``
        structs) in rank order.

        Fail fast: the first error or death aborts the other ranks (:meth:`abort`) and raises its
        :class:`WorkerError` at once; cancellation aborts them too.
        """
        if len(per_rank) != self.world_size:
            kinds = sorted({m.kind for m in per_rank})
            raise ValueError(
                f"{'/'.join(kinds)}: got {len(per_rank)} requests for {self.world_size} ranks"
            )
        await self._ensure_ready()
        first_failure = True

        async def one_rank(w: _Worker, msg: protocol.Request) -> Any:
            nonlocal first_failure
            try:
                return await self._request(w, msg, timeout)
            except Exception:
                if first_failure:  # the other ranks stop at once (their errors need no abort)
                    first_failure = False
                    self.abort()
                raise

        self._jobs += 1
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one_rank(w, m)) for w, m in zip(self._workers, per_rank)]
        except ExceptionGroup as failed:
            # In failure order; a dead worker is the cause (another rank's error may be its abort).
            errors = sorted(failed.exceptions, key=self._not_dead)
            raise errors[0] from None
        except asyncio.CancelledError:
            self.abort()
            raise
        finally:
            self._jobs -= 1
        return [t.result() for t in tasks]

    def _not_dead(self, error: Exception) -> bool:
        rank = getattr(error, "rank", None)
        return rank is None or self._workers[rank].state is not WorkerState.DEAD

    def worker_pids(self) -> list[int | None]:
        """Each worker's process id by rank (None: not started)."""
        return [w.pid for w in self._workers] if self._workers else [None] * len(self._devices)

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
