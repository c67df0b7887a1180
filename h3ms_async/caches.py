"""Pinned-RAM weight caches and the text-encoder output cache (``docs/comfyui_facts.md`` §9).

* :class:`WeightCache` keeps a model's host weights in page-locked memory (plain RAM without CUDA),
  one checkpoint per *group* (``te:<file>``, ``vae:<file>``): after ComfyUI's unload moved them to
  host RAM they become the cache's pinned buffers, so the next load copies them at full bandwidth; a
  group where ComfyUI never moves them holds nothing and keeps the reason.  Filling honours a RAM
  reserve: a fill that would leave less than the reserve available is refused and the model runs
  without the cache.  Releasing gives the bytes back.
* :class:`OutputCache` is an LRU of encoder outputs keyed by a digest of everything that changes an
  encoding (:func:`digest`), bounded by an entry count and by the same RAM reserve.  A hit returns
  copies of the stored tensors, equal bit for bit to what the miss computed.

Both are process-wide (:func:`weight_cache`, :func:`output_cache`) and report to the status route's
``caches`` and ``text_encoder_outputs`` sections.  This module never imports ComfyUI: it works on
plain tensors and modules.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import marshal
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from h3ms_async.log import get_logger
from h3ms_async.runtime.host_memory import ram_info
from h3ms_async.status.hub import get_hub

log = get_logger("Caches")
GIB = 1 << 30


class CacheRefused(RuntimeError):
    """Filling would break the RAM reserve; the caller runs without the cache."""


def _walk(h: hashlib._Hash, obj: Any) -> None:
    # Every branch writes a distinct leading tag, so no two encodings of different values can run
    # together.
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        # the array itself, not .tobytes(): hashlib reads its buffer, so a large embedding is not
        # copied once more
        h.update(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")
        return
    if type(obj) in (list, tuple):
        # Token lists are long runs of (int, float) pairs: marshal encodes such plain builtins in C,
        # exactly (ints whole, floats as their 8 bytes) and without back-references at version 2, so
        # equal values give equal bytes.  Anything it cannot encode (a tensor, an object) takes the
        # item-by-item walk below.
        try:
            blob = marshal.dumps(obj, 2)
        except ValueError:
            blob = None
        if blob is not None:
            h.update(b"M%d:" % len(blob))
            h.update(blob)
            return
    if isinstance(obj, (dict, Mapping)):
        h.update(b"{")
        for k in sorted(obj, key=str):
            h.update(b"R" + repr(k).encode() + b":")
            _walk(h, obj[k])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[" if isinstance(obj, list) else b"(")
        for item in obj:
            _walk(h, item)
            h.update(b",")
        h.update(b"]")
    elif isinstance(obj, _PLAIN):
        h.update(b"R" + type(obj).__name__.encode() + b":" + repr(obj).encode())
    else:
        # repr of an arbitrary object may hold its address (reused after it dies) or omit its state:
        # never a key
        raise TypeError(f"cannot key a {type(obj).__module__}.{type(obj).__qualname__} by content")


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)


def digest(*parts: Any) -> str:
    """sha256 hex of ``parts``: tensors by dtype, shape and bytes; lists and tuples of plain
    builtins by their marshal encoding; maps by sorted key; other sequences item by item; numbers,
    strings, dtypes, devices and enum members by ``repr``.  Anything else raises TypeError (it has
    no content key)."""
    h = hashlib.sha256()
    for p in parts:
        _walk(h, p)
        h.update(b"|")
    return h.hexdigest()


def _copy_out(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors are clones (so a caller that edits a result cannot change the
    cache)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _copy_out(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_copy_out(v) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _reserve_allows(nbytes: int, reserve_gb: float) -> bool:
    return ram_info().available_bytes - nbytes >= reserve_gb * GIB


class OutputCache:
    """LRU of encoder outputs; see the module doc.  Thread-safe."""

    def __init__(self) -> None:
        self._items: collections.OrderedDict[str, tuple[Any, int]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.max_entries = 0
        self._bytes = 0

    def get(self, key: str) -> Any | None:
        """A copy of the stored output (counted as a hit), or None (a miss)."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            value = item[0]
        return _copy_out(value)

    def fetch(
        self,
        key_parts: tuple,
        compute: Callable[[], Any],
        max_entries: int,
        reserve_gb: float = 0.0,
    ) -> tuple[Any, str, bool]:
        """The output for ``key_parts`` (digested with :func:`digest`): a stored copy on a hit, else
        ``compute()``'s result, stored.  Returns ``(output, key, hit)``.  A hit costs the digest
        plus one copy of the output."""
        key = digest(*key_parts)
        hit = self.get(key)
        if hit is not None:
            return hit, key, True
        out = compute()
        self.put(key, out, max_entries, reserve_gb)
        return out, key, False

    def put(self, key: str, value: Any, max_entries: int, reserve_gb: float = 0.0) -> bool:
        """Store a copy of ``value``; evict the oldest beyond ``max_entries`` or while the RAM
        reserve would be broken.  Returns whether it was stored."""
        n = _nbytes(value)
        with self._lock:
            self.max_entries = max_entries
            self._evict(max_entries - 1)
            while self._items and not _reserve_allows(n, reserve_gb):
                self._pop_oldest()
            if max_entries < 1 or not _reserve_allows(n, reserve_gb):
                return False
            self._items[key] = (_copy_out(value), n)
            self._bytes += n
            return True

    def _pop_oldest(self) -> None:
        _, (_, n) = self._items.popitem(last=False)
        self._bytes -= n

    def _evict(self, keep: int) -> None:
        while len(self._items) > max(keep, 0):
            self._pop_oldest()

    def clear(self) -> int:
        """Drop every entry (counters stay); returns how many there were."""
        with self._lock:
            n = len(self._items)
            self._items.clear()
            self._bytes = 0
            return n

    def stats(self) -> dict:
        """The status route's ``text_encoder_outputs`` section."""
        with self._lock:
            return {
                "entries": len(self._items),
                "hits": self.hits,
                "misses": self.misses,
                "bytes": self._bytes,
                "max_entries": self.max_entries,
            }


# -- weight cache ----------------------------------------------------------------------------------
def _pin(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``, page-locked when CUDA is available (what makes host->GPU copies run at
    full speed)."""
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=torch.cuda.is_available())
    host.copy_(t.detach())
    return host


def _free_pinned_pool() -> None:
    """Give freed page-locked blocks back to the OS (torch's host allocator keeps them for reuse
    otherwise)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if torch.cuda.is_available() and callable(empty):
        empty()


@dataclass
class CachedWeights:
    """One group's checkpoint: every cached tensor by parameter/buffer name, in pinned RAM, and the
    module whose host weights they are while ComfyUI has it unloaded (``owner``, weakly)."""

    group: str
    key: tuple
    tensors: dict[str, torch.Tensor]
    nbytes: int
    fill_seconds: float
    owner: weakref.ref[torch.nn.Module] | None = None
    homed: bool = False
    homes: int = 0
    restores: int = 0

    def summary(self) -> dict:
        return {
            "group": self.group,
            "key": [str(k) for k in self.key],
            "state": "held",
            "tensors": len(self.tensors),
            "bytes": self.nbytes,
            "fill_seconds": round(self.fill_seconds, 3),
            "homes": self.homes,
            "restores": self.restores,
            "pinned": torch.cuda.is_available(),
            "reason": None,
        }


def named_tensors(
    module: torch.nn.Module, prefixes: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """A module's parameters and buffers by name (only those under ``prefixes`` when given)."""
    pre = tuple(prefixes) if prefixes is not None else None
    return {
        n: t
        for n, t in [*module.named_parameters(), *module.named_buffers()]
        if pre is None or n.startswith(pre)
    }


class WeightCache:
    """Pinned host weights per group, one checkpoint (key) per group.  Thread-safe.

    ComfyUI itself moves a model's weights: its unload copies them to the offload device (host RAM),
    its next load copies them back to the GPU.  :meth:`home` runs right after such an unload: it
    copies the host weights into the group's pinned buffers and makes the module's tensors *be*
    those buffers, so ComfyUI's own next load reads page-locked memory (and no second host copy
    exists).  :meth:`note_loaded` counts that load as a restore.
    :meth:`stand_aside` records why a group holds nothing (ComfyUI never unloads that model's
    weights, or owns their host copy itself).
    """

    def __init__(self) -> None:
        self._groups: dict[str, CachedWeights] = {}
        self._asides: dict[str, str] = {}
        self._lock = threading.Lock()
        self.refusals = 0

    def get(self, group: str, key: tuple) -> CachedWeights | None:
        with self._lock:
            entry = self._groups.get(group)
            return entry if entry is not None and entry.key == key else None

    def home(self, group: str, key: tuple, module: torch.nn.Module, reserve_gb: float = 0.0) -> str:
        """Make ``module``'s host (CPU) tensors ``group``'s pinned copy (filled the first time);
        returns "homed", or "partial" when some tensors are not on the host (nothing done).  Raises
        :class:`CacheRefused` when a fill would leave less than ``reserve_gb`` available."""
        tensors = named_tensors(module)
        if not tensors or any(t.device.type != "cpu" for t in tensors.values()):
            return "partial"
        entry = self.get(group, key)
        owner = entry.owner() if entry is not None and entry.owner is not None else None
        if (
            entry is None
            or owner is not module
            or set(entry.tensors) != set(tensors)
            or any(
                entry.tensors[n].shape != t.shape or entry.tensors[n].dtype != t.dtype
                for n, t in tensors.items()
            )
        ):
            self.release(group)
            need = sum(t.numel() * t.element_size() for t in tensors.values())
            if not _reserve_allows(need, reserve_gb):
                self.refusals += 1
                raise CacheRefused(
                    f"weight cache {group}: needs {need / GIB:.2f} GiB but only "
                    f"{ram_info().available_bytes / GIB:.2f} GiB RAM is available and "
                    f"cache_ram_reserve_gb={reserve_gb:g} must stay free; running without the "
                    "cache (lower the reserve or free RAM)"
                )
            t0 = time.perf_counter()
            entry = CachedWeights(
                group,
                key,
                {n: _pin(t) for n, t in tensors.items()},
                need,
                time.perf_counter() - t0,
                weakref.ref(module),
            )
            with self._lock:
                self._groups[group] = entry
                self._asides.pop(group, None)
            log.info(
                "weight cache %s filled: %.2f GiB %s in %.2f s (%s)",
                group,
                need / GIB,
                "pinned" if torch.cuda.is_available() else "in RAM",
                entry.fill_seconds,
                ram_info().text,
            )
        with torch.no_grad():
            for name, t in tensors.items():
                dst = entry.tensors[name]
                if t.data_ptr() != dst.data_ptr():
                    dst.copy_(t)
                    t.data = dst
        entry.homed = True
        entry.homes += 1
        return "homed"

    def note_loaded(self, group: str, module: torch.nn.Module) -> bool:
        """After a call that made ComfyUI load ``module``: if its weights had been homed and ComfyUI
        has since moved them out of the pinned copy (to the GPU), count one restore.  Returns
        whether it counted."""
        with self._lock:
            entry = self._groups.get(group)
            if (
                entry is None
                or not entry.homed
                or entry.owner is None
                or entry.owner() is not module
            ):
                return False
            moved = any(
                t.data_ptr() != entry.tensors[n].data_ptr()
                for n, t in named_tensors(module).items()
                if n in entry.tensors
            )
            if moved:
                entry.homed = False
                entry.restores += 1
            return moved

    def stand_aside(self, group: str, reason: str) -> None:
        """Hold nothing for ``group`` and report ``reason`` (logged once per group and reason)."""
        self.release(group)
        with self._lock:
            new = self._asides.get(group) != reason
            self._asides[group] = reason
        if new:
            log.warning("weight cache %s holds nothing: %s", group, reason)

    def release(self, group: str) -> int:
        """Drop ``group``'s copy (a module still using it as its host weights gets plain RAM copies
        first); returns the pinned bytes freed."""
        with self._lock:
            entry = self._groups.pop(group, None)
            self._asides.pop(group, None)
        if entry is None:
            return 0
        owner = entry.owner() if entry.owner is not None else None
        if owner is not None:
            with torch.no_grad():
                for name, t in named_tensors(owner).items():
                    src = entry.tensors.get(name)
                    if src is not None and t.data_ptr() == src.data_ptr():
                        t.data = torch.empty(src.shape, dtype=src.dtype, device="cpu").copy_(src)
        freed = entry.nbytes
        entry.tensors.clear()
        _free_pinned_pool()
        log.info("weight cache %s released: %.2f GiB", group, freed / GIB)
        return freed

    def clear(self) -> int:
        """Drop every group; returns the bytes freed."""
        with self._lock:
            groups = list(self._groups)
        return sum(self.release(g) for g in groups)

    def bytes_held(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._groups.values())

    def summaries(self) -> list[dict]:
        """The status route's ``caches`` rows: held groups with their bytes, and groups standing
        aside with why."""
        with self._lock:
            rows = [e.summary() for e in self._groups.values()]
            rows += [
                {"group": g, "state": "aside", "bytes": 0, "reason": r}
                for g, r in self._asides.items()
            ]
            return rows


_OUTPUTS = OutputCache()
_WEIGHTS = WeightCache()


def output_cache() -> OutputCache:
    """The process-wide text-encoder output cache."""
    return _OUTPUTS


def weight_cache() -> WeightCache:
    """The process-wide weight cache."""
    return _WEIGHTS


def register_status() -> None:
    """Report both caches on the status hub (idempotent: the last registration wins)."""
    hub = get_hub()
    hub.register_provider("caches", _WEIGHTS.summaries)
    hub.register_provider("text_encoder_outputs", _OUTPUTS.stats)
