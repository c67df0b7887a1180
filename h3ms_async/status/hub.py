"""The status hub: the ring of recent step records, the exactness lists, and the providers, actions
and busy probe behind the status routes.

Step records (``records.py``) are kept as their JSON form in a bounded ring, pushed to listeners
(ComfyUI websocket, the standalone event stream) and logged as one INFO line.
:meth:`StatusHub.status` builds the status document (``document.py``) from the hub's own records and
the sections its providers fill, each checked where it comes in.

The hub is a process-wide singleton (:func:`get_hub`); it is thread-safe because producers run on
the coordinator loop or the prompt thread while the HTTP routes run on the server loop.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from h3ms_async.log import get_logger
from h3ms_async.runtime.host_memory import ram_info
from h3ms_async.status.document import (
    OPTIONAL_SECTIONS,
    SECTIONS,
    SchemaError,
    Status,
    pack_version,
    validate_section,
)
from h3ms_async.status.records import (
    StepRecord,
    VerdictRecord,
    VerifyRecord,
    format_step_line,
    now_iso,
)

_log = get_logger("MultiStream")
_status_log = get_logger("Status")

RING_SIZE = 256
ACTIONS = ("release_workers", "clear_weights", "detach_hooks", "clear_text_cache")
#: Bounds of the exactness lists in the status document (newest last).
VERDICTS_KEPT = 64
VERIFY_KEPT = 16

_DEFAULTS: dict[str, Callable[[], Any]] = {
    "plans": dict,
    "workers": list,
    "weight_store": lambda: {"state": "empty"},
    "caches": list,
    "hooks": list,
    "vae_workers": list,
    "vae_split": lambda: {"engines": []},
    "text_encoder_outputs": lambda: {"entries": 0, "hits": 0, "misses": 0, "bytes": 0},
}


class StatusHub:
    """Ring of recent step records + the providers, actions and busy probe behind the status
    routes."""

    def __init__(self, ring_size: int = RING_SIZE) -> None:
        self._lock = threading.Lock()
        self._ring: collections.deque[dict] = collections.deque(maxlen=ring_size)
        self._recorded = 0
        self._last_seq = -1
        self._listeners: list[Callable[[dict], None]] = []
        self._busy_sources: list[Callable[[], bool]] = []
        self._providers: dict[str, Callable[[], Any]] = {}
        self._actions: dict[str, Callable[[], dict]] = {}
        self._busy_probe: Callable[[], bool] | None = None
        self._version = pack_version()
        self._verdicts: collections.deque[dict] = collections.deque(maxlen=VERDICTS_KEPT)
        self._verify: collections.deque[dict] = collections.deque(maxlen=VERIFY_KEPT)

    # ---- exactness verdicts (the invariance probe, the VAE chunk check, verify)

    def record_verdict(self, rec: VerdictRecord) -> dict:
        """Append one exactness verdict (``exactness.verdicts``); returns its JSON form."""
        return self._keep(self._verdicts, "verdict", rec, VerdictRecord)

    def record_verify(self, rec: VerifyRecord) -> dict:
        """Append one ``verify`` result (``exactness.verify``); returns its JSON form."""
        return self._keep(self._verify, "verify", rec, VerifyRecord)

    def _keep(
        self,
        ring: collections.deque[dict],
        what: str,
        rec: msgspec.Struct,
        cls: type[msgspec.Struct],
    ) -> dict:
        """Append ``rec``, which must be a ``cls``, to ``ring`` as its JSON form; returns that."""
        if not isinstance(rec, cls):
            raise SchemaError(f"{what}: got a {type(rec).__name__}; build a records.{cls.__name__}")
        out = msgspec.to_builtins(rec)
        with self._lock:
            ring.append(out)
        return out

    def exactness(self) -> dict[str, list[dict]]:
        """The ``exactness`` section: verdicts and verify results, oldest first."""
        with self._lock:
            return {"verdicts": list(self._verdicts), "verify": list(self._verify)}

    # ---- step records

    def next_seq(self) -> int:
        """A sequence number greater than every recorded one, for a producer building a record."""
        with self._lock:
            return self._last_seq + 1

    def record_step(self, rec: StepRecord, *, log: bool = True) -> dict:
        """Append a step record (as its JSON form) to the ring, log its INFO line and notify
        listeners.

        ``seq`` must be greater than the last recorded one (take it from :meth:`next_seq`): records
        from concurrent producers would otherwise interleave. A listener that raises is logged and
        skipped. Returns the stored JSON form. Raises :class:`SchemaError` for an out-of-order
        ``seq``.
        """
        if not isinstance(rec, StepRecord):
            raise SchemaError(
                f"step record: got a {type(rec).__name__}; build a records.StepRecord"
            )
        out = msgspec.to_builtins(rec)
        with self._lock:
            if rec.seq <= self._last_seq:
                raise SchemaError(
                    f"step record: field 'seq' must increase, got {rec.seq} after "
                    f"{self._last_seq}; take it from get_hub().next_seq()"
                )
            self._last_seq = rec.seq
            self._ring.append(out)
            self._recorded += 1
            listeners = list(self._listeners)
        if log:
            _log.info(format_step_line(out))
        for fn in listeners:
            try:
                fn(out)
            except Exception:  # noqa: BLE001
                # a broken panel/websocket must never fail a denoising step
                _status_log.exception("step listener %r failed; the record is kept", fn)
        return out

    def recent_steps(self, n: int = 50, *, after: int | None = None) -> list[dict]:
        """The last ``n`` records (oldest first), only those with ``seq > after`` when given."""
        with self._lock:
            items = list(self._ring)
        if after is not None:
            items = [r for r in items if r["seq"] > after]
        return items[-n:] if n > 0 else []

    def add_listener(self, fn: Callable[[dict], None]) -> Callable[[], None]:
        """Call ``fn(record)`` after each recorded step (on the recording thread); returns the
        remover."""
        with self._lock:
            self._listeners.append(fn)

        def remove() -> None:
            with self._lock:
                if fn in self._listeners:
                    self._listeners.remove(fn)

        return remove

    # ---- providers, actions, busy

    def register_provider(self, section: str, fn: Callable[[], Any]) -> None:
        """Let another module fill one section of the status JSON (last registration wins)."""
        if section not in SECTIONS + OPTIONAL_SECTIONS:
            raise ValueError(
                f"unknown status section {section!r}; use one of "
                f"{', '.join(SECTIONS + OPTIONAL_SECTIONS)}"
            )
        with self._lock:
            self._providers[section] = fn

    def unregister_provider(self, section: str, fn: Callable[[], Any] | None = None) -> None:
        """Drop a section's provider (only if it is still ``fn`` when given), e.g. when a pool
        stops."""
        with self._lock:
            if fn is None or self._providers.get(section) is fn:
                self._providers.pop(section, None)

    def register_action(self, name: str, fn: Callable[[], dict]) -> None:
        """The callable behind a mutating route (``release_workers``, ``clear_weights``,
        ``detach_hooks``)."""
        if name not in ACTIONS:
            raise ValueError(f"unknown action {name!r}; use one of {', '.join(ACTIONS)}")
        with self._lock:
            self._actions[name] = fn

    def action(self, name: str) -> Callable[[], dict] | None:
        """The registered callable for an action, or None."""
        with self._lock:
            return self._actions.get(name)

    def set_busy_probe(self, fn: Callable[[], bool] | None) -> None:
        """Whether a prompt/job is running; mutating routes refuse while it answers True."""
        with self._lock:
            self._busy_probe = fn

    def add_busy_source(self, fn: Callable[[], bool]) -> None:
        """Another reason to be busy besides the probe (the split engine's running job, also
        standalone)."""
        with self._lock:
            if fn not in self._busy_sources:
                self._busy_sources.append(fn)

    def busy(self) -> bool:
        """The busy probe's answer or any busy source's; one that raises counts as not busy (and is
        logged), like the reference pack."""
        with self._lock:
            probes = ([self._busy_probe] if self._busy_probe is not None else []) + list(
                self._busy_sources
            )
        for probe in probes:
            try:
                if probe():
                    return True
            except Exception:  # noqa: BLE001
                _status_log.exception("busy probe failed; treating as not busy")
        return False

    def section(self, section: str) -> Any:
        """One provider-filled section, validated; ``{"error": ...}`` when the provider fails or
        answers badly."""
        with self._lock:
            fn = self._providers.get(section)
        if fn is None:
            return _DEFAULTS[section]()
        try:
            return validate_section(section, fn())
        except Exception as exc:  # noqa: BLE001
            # one broken module must not hide the rest of the status
            _status_log.warning(
                "status section %r failed: %s: %s", section, type(exc).__name__, exc
            )
            return {"error": f"{type(exc).__name__}: {exc}"}

    def worker_log_path(self, rank: int) -> str | None:
        """The log file of ``rank`` as the workers provider reports it; KeyError when no such rank
        exists."""
        workers = self.section("workers")
        if isinstance(workers, list):
            for w in workers:
                if w["rank"] == rank:
                    return w.get("log")
        raise KeyError(rank)

    def status(self) -> dict:
        """The status JSON (:class:`Status`); each provider's section checked by
        :func:`validate_section`."""
        with self._lock:
            last = dict(self._ring[-1]) if self._ring else {}
            recorded = self._recorded
            optional = {s: None for s in OPTIONAL_SECTIONS if s in self._providers}
        sections = {s: self.section(s) for s in (*SECTIONS, *optional)}
        st = Status(
            version=self._version,
            running=self.busy(),
            last_step=last,
            steps_recorded=recorded,
            ram=ram_info(),
            exactness=self.exactness(),
            **sections,
        )
        return msgspec.to_builtins(st)


_hub: StatusHub | None = None
_hub_lock = threading.Lock()


def get_hub() -> StatusHub:
    """The process-wide hub."""
    global _hub  # noqa: PLW0603 - the hub is a lazily built process-wide singleton
    with _hub_lock:
        if _hub is None:
            _hub = StatusHub()
        return _hub


def record_verdict(
    program: str,
    op: str,
    device: str,
    dtype: str,
    shape: str,
    shards: Iterable[int],
    verdict: str,
    detail: str,
    probe_ms: float,
) -> dict:
    """Record one exactness verdict on the process-wide hub (stamped now); see
    :class:`VerdictRecord`."""
    try:
        rec = VerdictRecord(
            program=program,  # type: ignore[arg-type]  # checked by msgspec.convert below
            op=op,
            device=device,
            dtype=dtype,
            shape=shape,
            shards=[int(s) for s in shards],
            verdict=verdict,  # type: ignore[arg-type]  # checked by msgspec.convert below
            detail=detail,
            probe_ms=float(probe_ms),
            at=now_iso(),
        )
        msgspec.convert(msgspec.to_builtins(rec), VerdictRecord)
    except msgspec.ValidationError as exc:
        raise SchemaError(
            f"verdict: {exc}; program is dit|attention|vae, verdict exact|adjusted|unsplit"
        ) from None
    return get_hub().record_verdict(rec)
