"""The pack's status model: step records, the status JSON, and the hub that holds them.

Two records live here, each a typed struct built by the code that fills it (so the hub never re-validates its own
output):

* the **step record** (:class:`StepRecord`) — one per split denoising step, built by the step driver, kept in a
  bounded ring (as its JSON form), pushed to listeners (ComfyUI websocket, the standalone event stream) and logged as
  one INFO line (:func:`format_step_line`);
* the **status JSON** (:class:`Status`) — what ``GET /h3multistream/status`` answers. Sections other modules own
  (plans, workers, weight store, caches, hooks, ...) come from providers registered on the hub; they are checked at
  that boundary (:func:`validate_section`): a provider that raises or returns a malformed section shows
  ``{"error": ...}`` in that section instead of breaking the route.

The hub is a process-wide singleton (:func:`get_hub`); it is thread-safe because producers run on the coordinator
loop or the prompt thread while the HTTP routes run on the server loop.
"""
from __future__ import annotations

import collections
import datetime as _dt
import json
import math
import os
import threading
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Literal, Mapping

import msgspec
import psutil

from h3ms_async import PACK_ROOT
from h3ms_async.log import get_logger
from workers.dit.protocol import Transport

_log = get_logger("MultiStream")
_status_log = get_logger("Status")

RING_SIZE = 256
#: A step record's ``exchange``: the transport as it ran (``workers.dit.protocol.Transport``).
Exchange = Transport
EXCHANGE_MODES: tuple[str, ...] = tuple(t.value for t in Transport)
SECTIONS = ("plans", "workers", "weight_store", "caches", "hooks", "vae_workers", "vae_split", "text_encoder_outputs")
#: Sections present only while a module provides them: "attention" (H3 Attention Parallel: its engines, each with
#: ``devices``, ``helpers`` as worker rows, ``splits`` (the tuned head splits) and ``recent_calls`` with per-device
#: transport and timings).
OPTIONAL_SECTIONS = ("attention",)
ACTIONS = ("release_workers", "clear_weights", "detach_hooks", "clear_text_cache")
GIB = 1024 ** 3


class SchemaError(ValueError):
    """A step record or status object does not match its schema; the message names the field and the fix."""


# --------------------------------------------------------------------------------------------------------------------
# small typed checks; every message names the field path so a producer can find its bug


def _fail(what: str, path: str, msg: str) -> None:
    raise SchemaError(f"{what}: field '{path}' {msg}")


def _req_int(what: str, path: str, v: Any, *, minimum: int | None = 0) -> int:
    # bool is an int subclass; True as a token count is always a producer bug
    if isinstance(v, bool) or not isinstance(v, int):
        _fail(what, path, f"must be an int, got {type(v).__name__} {v!r}")
    if minimum is not None and v < minimum:
        _fail(what, path, f"must be >= {minimum}, got {v}")
    return v


def _req_float(what: str, path: str, v: Any, *, nonneg: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        _fail(what, path, f"must be a number, got {type(v).__name__} {v!r}")
    if not math.isfinite(v):
        _fail(what, path, f"must be finite, got {v!r}")
    if nonneg and v < 0:
        _fail(what, path, f"must be >= 0, got {v}")
    return float(v)


def _req_str(what: str, path: str, v: Any, *, nonempty: bool = True) -> str:
    if not isinstance(v, str):
        _fail(what, path, f"must be a string, got {type(v).__name__} {v!r}")
    if nonempty and not v:
        _fail(what, path, "must be a non-empty string")
    return v


def _req_keys(what: str, path: str, obj: Any, required: Iterable[str], optional: Iterable[str] = ()) -> Mapping:
    if not isinstance(obj, Mapping):
        _fail(what, path, f"must be an object, got {type(obj).__name__}")
    required = tuple(required)
    allowed = set(required) | set(optional)
    missing = [k for k in required if k not in obj]
    if missing:
        _fail(what, path, f"is missing {', '.join(repr(k) for k in missing)}")
    extra = sorted(str(k) for k in obj if k not in allowed)
    if extra:
        _fail(what, path, f"has unknown key(s) {', '.join(repr(k) for k in extra)}; allowed: {', '.join(sorted(allowed))}")
    return obj


# --------------------------------------------------------------------------------------------------------------------
# step record


#: ``[start, end)``, a JSON array of two ints.
Range = Annotated[list[int], msgspec.Meta(min_length=2, max_length=2)]


class RankRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One rank's share of a step: its token range and head group (``[start, end)``), its seconds and bytes."""

    rank: int
    device: str
    tokens: Range
    heads: Range
    compute_s: float
    exchange_s: float
    wait_s: float
    moved_bytes: int
    vram_peak_bytes: int | None


class StepRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One split denoising step.  The ranks are listed 0..N-1; their token ranges tile ``[0, tokens)`` and their
    head groups tile ``[0, H)``, in order (the split plan's invariants; tests check them)."""

    at: str
    seq: int
    kind: Literal["dit"] = "dit"
    sigma: float | None
    tokens: int
    blocks: int
    devices: list[str]
    exchange: Exchange
    chunks: int
    wall_s: float
    moved_bytes: int
    weight_store: str
    ranks: list[RankRecord]


#: Bounds of the exactness lists in the status JSON (newest last).
VERDICTS_KEPT = 64
VERIFY_KEPT = 16


class VerdictRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One measured exactness verdict of a plan's op on one device (``exactness.verdicts``): ``shards`` are the
    plan's shard sizes (tokens, heads or chunks) as probed; ``detail`` one sentence (what was adjusted, or why
    unsplit)."""

    program: Literal["dit", "attention", "vae"]
    op: str
    device: str
    dtype: str
    shape: str
    shards: list[int]
    verdict: Literal["exact", "adjusted", "unsplit"]
    detail: str
    probe_ms: float
    at: str


class VerifyRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One result of the opt-in ``verify`` setting (``exactness.verify``): a split step against the same step run
    unsplit on the model's device; ``first_difference`` e.g. ``"block 3 mlp.fc2"`` (None when bit-exact)."""

    at: str
    devices: list[str]
    bit_exact: bool
    max_abs_diff: float
    first_difference: str | None
    steps_checked: int


def now_iso() -> str:
    """The ``at`` field of a step record: local time, second precision, ISO-8601."""
    return _dt.datetime.now().isoformat(timespec="seconds")


def fmt_bytes(n: int | float | None) -> str:
    """Human bytes for log lines and the status text: GiB at >= 1 GiB, else MiB (KiB for tiny amounts)."""
    if n is None:
        return "n/a"
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    if n >= 1024 ** 2:
        return f"{n / 1024 ** 2:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def _joined(values: Iterable[float]) -> str:
    return "/".join(f"{v:.3f}" for v in values)


def format_step_line(rec: Mapping) -> str:
    """The one INFO line per split step (the logger adds ``[H3 MultiStream] [MultiStream]``).

    Example: ``sigma 0.9375 step 12: 45000 tokens x 50 blocks on cuda:0+cuda:1, 3.214s (exchange host x4;
    compute 2.100/2.050s, exchange 0.410/0.430s, wait 0.020/0.050s; 1.23 GiB moved), weight store warm, 18.5 GiB,
    VRAM peak cuda:0 12.30 GiB / cuda:1 11.90 GiB``. Ranks that share a device add up (they are separate processes
    on one GPU); the VRAM clause is left out when no rank reports a peak (CPU runs).
    """
    ranks = rec["ranks"]
    sigma = f"sigma {rec['sigma']:.4f} " if rec.get("sigma") is not None else ""
    chunks = f" x{rec['chunks']}" if rec["chunks"] > 1 else ""
    line = (
        f"{sigma}step {rec['seq']}: {rec['tokens']} tokens x {rec['blocks']} blocks on "
        f"{'+'.join(r['device'] for r in ranks)}, {rec['wall_s']:.3f}s "
        f"(exchange {rec['exchange']}{chunks}; compute {_joined(r['compute_s'] for r in ranks)}s, "
        f"exchange {_joined(r['exchange_s'] for r in ranks)}s, wait {_joined(r['wait_s'] for r in ranks)}s; "
        f"{fmt_bytes(rec['moved_bytes'])} moved), weight store {rec['weight_store']}"
    )
    peaks: dict[str, int] = {}
    for r in ranks:
        if r["vram_peak_bytes"] is not None:
            peaks[r["device"]] = peaks.get(r["device"], 0) + r["vram_peak_bytes"]
    if peaks:
        line += ", VRAM peak " + " / ".join(f"{d} {fmt_bytes(b)}" for d, b in peaks.items())
    return line


# --------------------------------------------------------------------------------------------------------------------
# status JSON

WORKER_FIELDS = ("rank", "device", "pid", "state")
WORKER_OPTIONAL = ("uptime_s", "rss_bytes", "vram_bytes", "jobs_done", "log", "error")


class RamInfo(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``ram`` section: psutil's figures capped by the memory cgroup (:func:`ram_info`)."""

    available_bytes: int
    total_bytes: int
    text: str
    container_limit: bool


class Status(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """The status JSON.  The provider-filled sections are plain JSON values, checked by :func:`validate_section`
    when they come in; ``attention`` is present only while H3 Attention Parallel provides it."""

    version: str
    running: bool
    last_step: dict[str, Any]  # a StepRecord's JSON form, or {} before the first step
    steps_recorded: int
    ram: RamInfo
    plans: Any
    workers: Any
    weight_store: Any
    caches: Any
    hooks: Any
    vae_workers: Any
    vae_split: Any
    text_encoder_outputs: Any
    exactness: dict[str, list[Any]]
    attention: Any = msgspec.UNSET


def _is_error_section(v: Any) -> bool:
    return isinstance(v, Mapping) and set(v) == {"error"} and isinstance(v["error"], str)


def validate_worker_entry(w: Any, path: str = "workers[i]") -> None:
    """One row of the status's ``workers`` list, as the pool's provider must return it.

    Required: ``rank`` (int), ``device`` (str), ``pid`` (int|None), ``state`` (str, e.g. "ready", "busy",
    "exited(1)").  Optional: ``uptime_s`` (float|None), ``rss_bytes`` / ``vram_bytes`` (int|None), ``jobs_done``
    (int), ``log`` (path str|None), ``error`` (str).
    """
    what = "status"
    _req_keys(what, path, w, WORKER_FIELDS, WORKER_OPTIONAL)
    _req_int(what, f"{path}.rank", w["rank"])
    _req_str(what, f"{path}.device", w["device"])
    if w["pid"] is not None:
        _req_int(what, f"{path}.pid", w["pid"], minimum=1)
    _req_str(what, f"{path}.state", w["state"])
    for k in ("rss_bytes", "vram_bytes"):
        if w.get(k) is not None:
            _req_int(what, f"{path}.{k}", w[k])
    if w.get("uptime_s") is not None:
        _req_float(what, f"{path}.uptime_s", w["uptime_s"])
    if "jobs_done" in w:
        _req_int(what, f"{path}.jobs_done", w["jobs_done"])
    if w.get("log") is not None:
        _req_str(what, f"{path}.log", w["log"])


def validate_section(section: str, value: Any) -> Any:
    """Check one provider-filled section of the status JSON; raises :class:`SchemaError`.

    ``plans``, ``weight_store``, ``vae_split`` and ``text_encoder_outputs`` are objects, ``workers``,
    ``vae_workers``, ``caches`` and ``hooks`` are lists (worker rows per :func:`validate_worker_entry`, the others
    lists of objects).  Every section must be JSON-serialisable, since it goes straight into the HTTP answer.
    """
    what = "status"
    if section not in SECTIONS + OPTIONAL_SECTIONS:
        raise SchemaError(f"status: unknown section {section!r}; known sections: "
                          f"{', '.join(SECTIONS + OPTIONAL_SECTIONS)}")
    if _is_error_section(value):
        return value
    if section == "attention":
        engines = _req_keys(what, section, value, ("engines",))["engines"]
        if not isinstance(engines, list):
            _fail(what, "attention.engines", f"must be a list, got {type(engines).__name__}")
        for i, eng in enumerate(engines):
            _req_keys(what, f"attention.engines[{i}]", eng, ("devices", "helpers", "calls", "recent_calls"),
                      ("shares", "transport", "running", "splits"))
            for j, w in enumerate(eng["helpers"]):
                validate_worker_entry(w, f"attention.engines[{i}].helpers[{j}]")
    elif section in ("plans", "weight_store", "vae_split", "text_encoder_outputs"):
        if not isinstance(value, Mapping):
            _fail(what, section, f"must be an object, got {type(value).__name__}")
    else:
        if not isinstance(value, list):
            _fail(what, section, f"must be a list, got {type(value).__name__}")
        for i, item in enumerate(value):
            if section in ("workers", "vae_workers"):
                validate_worker_entry(item, f"{section}[{i}]")
            elif not isinstance(item, Mapping):
                _fail(what, f"{section}[{i}]", f"must be an object, got {type(item).__name__}")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        _fail(what, section, f"is not JSON-serialisable ({exc}); return plain dicts/lists/str/numbers")
    return value


# --------------------------------------------------------------------------------------------------------------------
# RAM, cgroup-aware

_NO_LIMIT = 1 << 60  # cgroup v1 reports "unlimited" as a page-rounded 2**63-1


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        v = int(text)
    except ValueError:
        return None
    return None if v >= _NO_LIMIT else v


def _read_stat(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if v.strip().isdigit():
                out[k] = int(v)
    except OSError:
        pass
    return out


def _container_memory(root: Path) -> tuple[int, int] | None:
    """(limit, available) of the memory cgroup we run in, or None without a limit.

    Page cache counts as available (the kernel drops it under pressure) except dirty and writeback pages, minus a
    margin of 5% of the limit because reclaim starts before the limit is hit.
    """
    candidates = [(root / "memory.max", root / "memory.current", root / "memory.stat", "")]
    v1 = root / "memory"
    candidates.append((v1 / "memory.limit_in_bytes", v1 / "memory.usage_in_bytes", v1 / "memory.stat", "total_"))
    for limit_p, cur_p, stat_p, prefix in candidates:
        limit = _read_int(limit_p)
        current = _read_int(cur_p)
        if limit is None or current is None:
            continue
        stat = _read_stat(stat_p)

        def g(k: str) -> int:
            return stat.get(prefix + k, stat.get(k, 0))
        reclaimable = g("active_file") + g("inactive_file") - g("dirty") - g("writeback")
        reclaimable = max(0, reclaimable - int(0.05 * limit))
        return limit, max(0, limit - current + reclaimable)
    return None


def ram_info(cgroup_root: str | os.PathLike = "/sys/fs/cgroup") -> RamInfo:
    """``{available_bytes, total_bytes, text, container_limit}``: psutil's figures capped by the memory cgroup.

    Reads cgroup v2 (``memory.max``/``memory.current``/``memory.stat`` under ``cgroup_root``), falling back to v1
    (``cgroup_root/memory/memory.limit_in_bytes`` ...). Available RAM is the smaller of the host and container
    figures, so a container limit below the host's RAM is what the weight store's reserve is checked against.
    """
    vm = psutil.virtual_memory()
    avail, total, limited = int(vm.available), int(vm.total), False
    cont = _container_memory(Path(cgroup_root))
    if cont is not None and cont[0] < total:
        total, avail, limited = cont[0], min(avail, cont[1]), True
    text = f"RAM available {avail / GIB:.1f} of {total / GIB:.1f} GiB" + (" (container limit)" if limited else "")
    return RamInfo(available_bytes=avail, total_bytes=total, text=text, container_limit=limited)


# --------------------------------------------------------------------------------------------------------------------
# version


def _pack_version() -> str:
    try:
        import tomllib
        data = tomllib.loads((PACK_ROOT / "pyproject.toml").read_text())
        return str(data["project"]["version"])
    except Exception:  # noqa: BLE001 - an installed wheel has no pyproject beside it
        pass
    try:
        from importlib.metadata import version
        return version("comfyui-h3-multistream-async")
    except Exception:  # noqa: BLE001
        return "unknown"


# --------------------------------------------------------------------------------------------------------------------
# the hub

_DEFAULTS: dict[str, Callable[[], Any]] = {
    "plans": dict, "workers": list, "weight_store": lambda: {"state": "empty"}, "caches": list, "hooks": list,
    "vae_workers": list, "vae_split": lambda: {"engines": []},
    "text_encoder_outputs": lambda: {"entries": 0, "hits": 0, "misses": 0, "bytes": 0},
}


class StatusHub:
    """Ring of recent step records + the providers, actions and busy probe behind the status routes."""

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
        self._version = _pack_version()
        self._verdicts: collections.deque[dict] = collections.deque(maxlen=VERDICTS_KEPT)
        self._verify: collections.deque[dict] = collections.deque(maxlen=VERIFY_KEPT)

    # ---- exactness verdicts (the invariance probe, the VAE chunk check, verify)

    def record_verdict(self, rec: VerdictRecord) -> dict:
        """Append one exactness verdict (``exactness.verdicts``); returns its JSON form."""
        if not isinstance(rec, VerdictRecord):
            raise SchemaError(f"verdict: got a {type(rec).__name__}; build a status.VerdictRecord")
        out = msgspec.to_builtins(rec)
        with self._lock:
            self._verdicts.append(out)
        return out

    def record_verify(self, rec: VerifyRecord) -> dict:
        """Append one ``verify`` result (``exactness.verify``); returns its JSON form."""
        if not isinstance(rec, VerifyRecord):
            raise SchemaError(f"verify: got a {type(rec).__name__}; build a status.VerifyRecord")
        out = msgspec.to_builtins(rec)
        with self._lock:
            self._verify.append(out)
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
        """Append a step record (as its JSON form) to the ring, log its INFO line and notify listeners.

        ``seq`` must be greater than the last recorded one (take it from :meth:`next_seq`): records from concurrent
        producers would otherwise interleave. A listener that raises is logged and skipped. Returns the stored JSON
        form. Raises :class:`SchemaError` for an out-of-order ``seq``.
        """
        if not isinstance(rec, StepRecord):
            raise SchemaError(f"step record: got a {type(rec).__name__}; build a status.StepRecord")
        out = msgspec.to_builtins(rec)
        with self._lock:
            if rec.seq <= self._last_seq:
                raise SchemaError(f"step record: field 'seq' must increase, got {rec.seq} after {self._last_seq}; "
                                  "take it from get_hub().next_seq()")
            self._last_seq = rec.seq
            self._ring.append(out)
            self._recorded += 1
            listeners = list(self._listeners)
        if log:
            _log.info(format_step_line(out))
        for fn in listeners:
            try:
                fn(out)
            except Exception:  # noqa: BLE001 - a broken panel/websocket must never fail a denoising step
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
        """Call ``fn(record)`` after each recorded step (on the recording thread); returns the remover."""
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
            raise ValueError(f"unknown status section {section!r}; use one of {', '.join(SECTIONS + OPTIONAL_SECTIONS)}")
        with self._lock:
            self._providers[section] = fn

    def unregister_provider(self, section: str, fn: Callable[[], Any] | None = None) -> None:
        """Drop a section's provider (only if it is still ``fn`` when given), e.g. when a pool stops."""
        with self._lock:
            if fn is None or self._providers.get(section) is fn:
                self._providers.pop(section, None)

    def register_action(self, name: str, fn: Callable[[], dict]) -> None:
        """The callable behind a mutating route (``release_workers``, ``clear_weights``, ``detach_hooks``)."""
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
        """Another reason to be busy besides the probe (the split engine's running job, also standalone)."""
        with self._lock:
            if fn not in self._busy_sources:
                self._busy_sources.append(fn)

    def busy(self) -> bool:
        """The busy probe's answer or any busy source's; one that raises counts as not busy (and is logged), like the
        reference pack."""
        with self._lock:
            probes = ([self._busy_probe] if self._busy_probe is not None else []) + list(self._busy_sources)
        for probe in probes:
            try:
                if probe():
                    return True
            except Exception:  # noqa: BLE001
                _status_log.exception("busy probe failed; treating as not busy")
        return False

    def section(self, section: str) -> Any:
        """One provider-filled section, validated; ``{"error": ...}`` when the provider fails or answers badly."""
        with self._lock:
            fn = self._providers.get(section)
        if fn is None:
            return _DEFAULTS[section]()
        try:
            return validate_section(section, fn())
        except Exception as exc:  # noqa: BLE001 - one broken module must not hide the rest of the status
            _status_log.warning("status section %r failed: %s: %s", section, type(exc).__name__, exc)
            return {"error": f"{type(exc).__name__}: {exc}"}

    def worker_log_path(self, rank: int) -> str | None:
        """The log file of ``rank`` as the workers provider reports it; KeyError when no such rank exists."""
        workers = self.section("workers")
        if isinstance(workers, list):
            for w in workers:
                if w["rank"] == rank:
                    return w.get("log")
        raise KeyError(rank)

    def status(self) -> dict:
        """The status JSON (:class:`Status`); each provider's section checked by :func:`validate_section`."""
        with self._lock:
            last = dict(self._ring[-1]) if self._ring else {}
            recorded = self._recorded
            optional = {s: None for s in OPTIONAL_SECTIONS if s in self._providers}
        sections = {s: self.section(s) for s in (*SECTIONS, *optional)}
        st = Status(version=self._version, running=self.busy(), last_step=last, steps_recorded=recorded,
                    ram=ram_info(), exactness=self.exactness(), **sections)
        return msgspec.to_builtins(st)


_hub: StatusHub | None = None
_hub_lock = threading.Lock()


def get_hub() -> StatusHub:
    """The process-wide hub."""
    global _hub
    with _hub_lock:
        if _hub is None:
            _hub = StatusHub()
        return _hub


def record_verdict(program: str, op: str, device: str, dtype: str, shape: str, shards: Iterable[int], verdict: str,
                   detail: str, probe_ms: float) -> dict:
    """Record one exactness verdict on the process-wide hub (stamped now); see :class:`VerdictRecord`."""
    try:
        rec = VerdictRecord(program=program, op=op, device=device, dtype=dtype, shape=shape,  # type: ignore[arg-type]
                            shards=[int(s) for s in shards], verdict=verdict, detail=detail,  # type: ignore[arg-type]
                            probe_ms=float(probe_ms), at=now_iso())
        msgspec.convert(msgspec.to_builtins(rec), VerdictRecord)
    except msgspec.ValidationError as exc:
        raise SchemaError(f"verdict: {exc}; program is dit|attention|vae, verdict exact|adjusted|unsplit") from None
    return get_hub().record_verdict(rec)
