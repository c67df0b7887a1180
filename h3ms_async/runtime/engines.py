"""The coordinator side of a rank program: one engine base and one registry per program.

An engine (the DiT split, the VAE split decode, attention parallel) owns a :class:`WorkerPool`
running its rank program and the state that outlives one call (the workers, loaded weights, step
buffers).  What every engine needs is here, once:

* :class:`Engine`: a caller thread runs one job at a time (:meth:`Engine.job`); it waits for the
  ranks' futures with a deadline while polling the caller's interrupt probe (:meth:`Engine.wait`),
  and any failure, the interrupt or the deadline aborts every rank before it raises the engine's own
  error; :meth:`Engine.release` stops the workers and drops the resident state.
* :class:`EngineRegistry`: per program, the engines alive in this process, the cached one per
  *process key* (what needs other worker processes; per-call settings are not part of it), releasing
  all of them, and the program's status sections and busy source on the status hub (which the
  program passes in: the hub sits above the runtime).

:func:`release_engines` and :func:`live_engines` reach every program's engines (the release routes
use them), so a new rank program adds its engine class and registry and nothing else.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from typing import (
    Any,
    ClassVar,
    Generic,
    Protocol,
    TypeVar,
)

from h3ms_async.log import get_logger
from h3ms_async.runtime.coordinator import get_coordinator
from h3ms_async.runtime.pool import WorkerPool
from h3ms_async.runtime.worker_handle import WorkerError

log = get_logger("engines")

#: How often a waiting caller thread checks its interrupt probe and runs its progress poll.
INTERRUPT_POLL_S = 0.05
#: Deadline for stopping an engine's workers.
RELEASE_TIMEOUT_S = 60.0


class Engine:
    """Base of every rank program's coordinator-side engine.

    A subclass sets :attr:`error` (and :attr:`interrupted`, a subclass of it), makes its pool, calls
    ``super().__init__(pool, registry)``, runs each job inside :meth:`job` and overrides
    :meth:`_drop_resident` (and :meth:`holds_resident` when it keeps state besides its workers).
    """

    #: What a failed, timed-out job raises (a worker's :class:`WorkerError` becomes one, with its
    #: message).
    error: ClassVar[type[Exception]] = RuntimeError
    #: What a job stopped by the caller's interrupt probe raises.
    interrupted: ClassVar[type[Exception]] = RuntimeError
    #: Appended to a deadline's error message: the setting that allows longer.
    deadline_hint: ClassVar[str] = ""
    #: Put before a worker's error message when it becomes :attr:`error`.
    failure_prefix: ClassVar[str] = ""

    def __init__(self, pool: WorkerPool, registry: EngineRegistry) -> None:
        self.pool = pool
        self._lock = threading.Lock()
        self._running = False
        registry.add(self)

    @property
    def running(self) -> bool:
        """Whether a job runs now."""
        return self._running

    @contextlib.contextmanager
    def job(self) -> Iterator[None]:
        """Hold the engine for one job (jobs of one engine run one after another); :attr:`running`
        meanwhile."""
        with self._lock:
            self._running = True
            try:
                yield
            finally:
                self._running = False

    def start_workers(self) -> None:
        """Start the workers in the background unless they are up: a caller with slow work of its
        own before its first job (ComfyUI reading the adaLN weights from disk for the modulation
        rows) starts them first, beside it.  The job's own start waits for this one; a start that
        fails here is logged and tried again, and raised, by the job."""
        if self.pool.running and not self.pool.any_dead:
            return
        fut = get_coordinator().submit(self.pool.start())
        fut.add_done_callback(_log_early_start)

    # -- waiting for the ranks ---------------------------------------------------------------------
    def run(
        self,
        coro: Coroutine[Any, Any, Any],
        timeout: float,
        what: str,
        interrupt: Callable[[], bool] | None = None,
        poll: Callable[[], None] | None = None,
    ) -> Any:
        """Run ``coro`` on the coordinator loop and return its result; see :meth:`wait`."""
        return self.wait(
            [get_coordinator().submit(coro)], timeout, what, interrupt=interrupt, poll=poll
        )[0]

    def wait(
        self,
        futs: Sequence[cf.Future[Any]],
        timeout: float,
        what: str,
        *,
        interrupt: Callable[[], bool] | None = None,
        poll: Callable[[], None] | None = None,
        on_result: Callable[[int, Any], None] | None = None,
        abandon: Iterable[cf.Future[Any]] | None = None,
    ) -> list[Any]:
        """The results of ``futs`` (coordinator futures of this engine's rank requests), in their
        order.

        Waits at most ``timeout`` s in all.  ``on_result(i, result)`` runs in this thread as each
        future finishes (in finishing order), so the caller takes a rank's result in while the
        others still work.  ``interrupt`` and ``poll`` (progress) run in this thread every
        :data:`INTERRUPT_POLL_S` s while futures are pending.

        Any failure (a rank's :class:`WorkerError`, the interrupt, the deadline, an exception of
        ``on_result`` or ``poll``, a KeyboardInterrupt) aborts every rank and cancels the futures of
        ``abandon`` (default: ``futs``) before it propagates as :attr:`error` / :attr:`interrupted`.
        """
        futs = list(futs)
        index = {f: i for i, f in enumerate(futs)}
        results: list[Any] = [None] * len(futs)
        pending = set(futs)
        deadline = time.monotonic() + timeout
        tick = INTERRUPT_POLL_S if interrupt is not None or poll is not None else None
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    hint = f" ({self.deadline_hint})" if self.deadline_hint else ""
                    raise self.error(
                        f"{what} did not finish within {timeout:g} s{hint}; every rank was aborted"
                    )
                done, pending = cf.wait(
                    pending,
                    timeout=left if tick is None else min(left, tick),
                    return_when=cf.FIRST_COMPLETED,
                )
                for fut in sorted(done, key=index.__getitem__):
                    i = index[fut]
                    results[i] = fut.result()
                    if on_result is not None:
                        on_result(i, results[i])
                if pending:
                    if poll is not None:
                        poll()
                    if interrupt is not None and interrupt():
                        raise self.interrupted(f"{what} interrupted; every rank was aborted")
        except WorkerError as exc:
            self.abandon(futs if abandon is None else abandon)
            raise self.error(self.failure_prefix + str(exc)) from exc
        except BaseException:
            self.abandon(futs if abandon is None else abandon)
            raise
        return results

    def abandon(self, futs: Iterable[cf.Future[Any]]) -> None:
        """Abort every rank's current work and cancel ``futs``, when any of them is still
        pending."""
        futs = list(futs)
        if all(f.done() for f in futs):
            return
        self.pool.abort()
        coord = get_coordinator()
        for fut in futs:
            coord.cancel(fut, wait=2.0)

    # -- resident state ----------------------------------------------------------------------------
    def holds_resident(self) -> bool:
        """Whether this engine holds anything to release: running workers, or state a subclass
        keeps."""
        return self.pool.running

    def release(self) -> None:
        """Stop the workers (waiting for a running job first), then drop the resident state."""
        with self._lock:
            try:
                if self.pool.running:
                    get_coordinator().run(
                        self.pool.release(force=True),
                        RELEASE_TIMEOUT_S,
                        f"releasing the {self.pool.program or self.pool.name} workers",
                    )
            finally:
                self._drop_resident()

    def _drop_resident(self) -> None:
        """Drop what the engine keeps besides its workers (called by :meth:`release`, with the job
        lock held)."""

    def release_weights(self) -> bool:
        """Drop loaded weights but keep the workers; returns whether any were held (engines that
        keep none: False)."""
        return False


def _log_early_start(fut: cf.Future[None]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.info("an early start of the workers failed (the job starts them): %s", fut.exception())


E = TypeVar("E", bound=Engine)
#: section name -> provider of that status section from the registry's live engines
StatusProviders = Mapping[str, Callable[[list], Any]]


class StatusSink(Protocol):
    """Where a registry puts its status sections and busy source (the status hub)."""

    def register_provider(self, section: str, fn: Callable[[], Any]) -> None: ...

    def add_busy_source(self, fn: Callable[[], bool]) -> None: ...


class EngineRegistry(Generic[E]):
    """One rank program's engines: every live one, and the cached one of the current process key.

    ``label`` names the program's workers in release messages ("split workers").  ``status`` maps
    status sections to functions of the live engines; they and a busy source ("any live engine is
    running") go on ``hub()`` (the status hub's ``get_hub``) when the first engine is made.
    """

    def __init__(
        self, program: str, label: str, status: StatusProviders, hub: Callable[[], StatusSink]
    ) -> None:
        self.program = program
        self.label = label
        self._status = dict(status)
        self._hub = hub
        self._live: weakref.WeakSet[E] = weakref.WeakSet()
        self._cached: dict[tuple, E] = {}
        self._lock = threading.RLock()
        self._on_hub = False
        with _REGISTRIES_LOCK:
            if program in _REGISTRIES:
                raise ValueError(f"rank program {program!r} already has an engine registry")
            _REGISTRIES[program] = self

    def add(self, engine: E) -> None:
        """Count ``engine`` as live (what the status sections and :meth:`release_all` see)."""
        with self._lock:
            self._live.add(engine)
            if not self._on_hub:
                hub = self._hub()
                for section, fn in self._status.items():
                    hub.register_provider(section, self._provider(fn))
                hub.add_busy_source(lambda: any(e.running for e in self.live()))
                self._on_hub = True

    def _provider(self, fn: Callable[[list], Any]) -> Callable[[], Any]:
        """The status provider that applies ``fn`` to the live engines at each read."""
        return lambda: fn(self.live())

    def get(
        self,
        key: tuple,
        make: Callable[[], E],
        before_release: Callable[[E], None] | None = None,
    ) -> E:
        """The cached engine for ``key``, made by ``make()`` the first time.  Engines cached for
        another key are released first: one runs at a time, and each one's workers and resident
        state hold memory.  ``before_release(old)`` runs on each of them first (what it hands to
        the new engine, ``make`` takes)."""
        with self._lock:
            eng = self._cached.get(key)
            if eng is None:
                for old_key in list(self._cached):
                    old = self._cached.pop(old_key)
                    try:
                        if before_release is not None:
                            before_release(old)
                    finally:
                        old.release()
                eng = self._cached[key] = make()
            return eng

    def cached(self) -> list[E]:
        """The engines made by :meth:`get`."""
        with self._lock:
            return list(self._cached.values())

    def live(self) -> list[E]:
        """Every engine alive in this process (also ones made directly)."""
        with self._lock:
            return list(self._live)

    def release_all(self, force: bool = True) -> tuple[int, int]:
        """Release the cached engines and every other live engine that still holds resident state; a
        running one only with ``force`` (it waits for the job).  Returns ``(released, busy)``."""
        with self._lock:
            live = self.live()
            busy = [e for e in live if e.running and not force]
            cached = [e for e in self._cached.values() if e not in busy]
            self._cached = {k: e for k, e in self._cached.items() if e in busy}
        todo = cached + [
            e for e in live if e not in cached and e not in busy and e.holds_resident()
        ]
        for eng in todo:
            eng.release()
        return len(todo), len(busy)


_REGISTRIES: dict[str, EngineRegistry] = {}
_REGISTRIES_LOCK = threading.Lock()


def registries() -> list[EngineRegistry]:
    """Every rank program's registry, in the order the programs were imported."""
    with _REGISTRIES_LOCK:
        return list(_REGISTRIES.values())


def live_engines() -> list[Engine]:
    """Every engine of every rank program alive in this process."""
    return [e for reg in registries() for e in reg.live()]


def release_engines(force: bool = True) -> list[tuple[EngineRegistry, int, int]]:
    """Release every program's engines (:meth:`EngineRegistry.release_all`); per registry
    ``(registry, released, busy)``."""
    return [(reg, *reg.release_all(force)) for reg in registries()]
