"""One rank's worker process as its pool tracks it (:class:`WorkerHandle`): its state, process,
channel and last heartbeat, how it is marked dead (killed, its channel closed, a line in its log)
and the :class:`WorkerError` a failure raises, quoting the worker's log."""

from __future__ import annotations

import asyncio
import enum
import signal
import subprocess
import time
from dataclasses import dataclass, field

from h3ms_async.log import get_logger, tail_file
from h3ms_async.runtime.channel import Channel

log = get_logger("pool")

LOG_TAIL_LINES = 20


class WorkerState(enum.StrEnum):
    """Where one worker process is in its life (named by the string the status JSON shows)."""

    STARTING = "starting"  #: spawned; not yet answered its first ping
    READY = "ready"  #: serving requests
    BUSY = "busy"  #: ready with a request in flight (only in :meth:`WorkerPool.snapshot`)
    DEAD = "dead"  #: exited, broke the protocol or missed a deadline (and was killed)
    STOPPING = "stopping"  #: asked to shut down by a release
    STOPPED = "stopped"  #: gone after a release


@dataclass(frozen=True)
class StartTimes:
    """Where one worker's start went, in seconds: the interpreter's start and its first imports
    (``python_s``: from the spawn to the worker's answer to the challenge, less the phases it
    reports), a CUDA rank importing torch and pinning its device, importing its rank program,
    connecting, then from that answer to its answer of the first ping (``welcome_s``)."""

    python_s: float
    device_s: float
    program_s: float
    connect_s: float
    welcome_s: float

    @property
    def total_s(self) -> float:
        return self.python_s + self.device_s + self.program_s + self.connect_s + self.welcome_s

    def line(self) -> str:
        return (
            f"interpreter {self.python_s:.2f} s, torch and its device {self.device_s:.2f} s, rank "
            f"program {self.program_s:.2f} s, connecting {self.connect_s:.2f} s, first ping "
            f"{self.welcome_s:.2f} s"
        )


class WorkerError(RuntimeError):
    """A worker failed (error, death, deadline); the message names rank and device and quotes its
    log."""

    def __init__(self, message: str, rank: int, device: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.device = device


class WorkerTimeout(WorkerError, TimeoutError):
    """A worker did not answer (or start) within its deadline."""


def exit_text(code: int | None) -> str:
    """A process's exit status in words (``exited with code 1``, ``killed by SIGKILL``)."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class WorkerHandle:
    """One rank's worker process as its pool tracks it."""

    rank: int
    device: str
    log_path: str
    #: the pool's name (its log lines name it)
    pool: str
    #: the pool start's event: set when this worker becomes ready or dead
    changed: asyncio.Event
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
    #: where its start went, once it answered the first ping
    start: StartTimes | None = None
    #: open pidfd of ``proc`` while the loop watches it; -1 once it exited or is no longer watched
    pidfd: int = -1
    #: set once ``proc`` has exited and was reaped
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    hb_timer: asyncio.TimerHandle | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def note(self, text: str) -> None:
        """Append a coordinator line to the worker's log."""
        try:
            with open(self.log_path, "a", encoding="utf-8") as fh:
                fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} coordinator: {text}\n")
        except OSError:
            pass

    def mark_dead(self, reason: str) -> None:
        """Kill a starting or ready worker, close its channel and tell the pool; a dead or stopping
        one stays as it is."""
        if self.state in (WorkerState.DEAD, WorkerState.STOPPING, WorkerState.STOPPED):
            return
        self.state = WorkerState.DEAD
        self.death = reason
        if self.hb_timer is not None:
            self.hb_timer.cancel()
            self.hb_timer = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.channel is not None:
            self.channel.close(reason)
        log.error(
            "pool %r: rank %d on %s (pid %s) is dead: %s",
            self.pool,
            self.rank,
            self.device,
            self.pid,
            reason,
        )
        self.note(f"rank {self.rank} marked dead: {reason}")
        self.changed.set()

    def error(self, what: str, cls: type[WorkerError] = WorkerError, tb: str = "") -> WorkerError:
        """The error naming this worker, its exit status, ``what`` it did, the worker's traceback
        (when it sent one) and the last lines of its log."""
        status = exit_text(self.proc.poll()) if self.proc is not None else "not started"
        msg = f"worker rank {self.rank} on {self.device} (pid {self.pid}, {status}) {what}"
        if tb:
            msg += f"\n--- worker traceback ---\n{tb.rstrip()}"
        log_tail = "\n".join(tail_file(self.log_path, LOG_TAIL_LINES))
        msg += f"\n--- last lines of {self.log_path} ---\n{log_tail}"
        return cls(msg, self.rank, self.device)
