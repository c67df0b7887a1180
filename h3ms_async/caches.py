"""Pinned-RAM weight caches and the text-encoder output cache (``docs/comfyui_facts.md`` §9).

* :class:`WeightCache` keeps a model's host weights in page-locked memory (plain RAM without CUDA),
  one checkpoint per *group* (``te:<file>``, ``vae:<file>``): after ComfyUI's unload moved them to
  host RAM they become the cache's pinned buffers, so the next load copies them at full bandwidth; a
  group where ComfyUI never moves them holds nothing and keeps the reason.  Filling honours a RAM
  reserve: a fill that would leave less than the reserve available is refused and the model runs
  without the cache.  Releasing gives back what nothing else uses (:class:`Freed`): while ComfyUI
  has the model unloaded the buffers *are* its host weights, so they stay in RAM with the model.
* :class:`OutputCache` is an LRU of encoder outputs keyed by a digest of everything that changes an
  encoding (:func:`digest`), bounded by an entry count and by the same RAM reserve.  A hit returns
  copies of the stored tensors, equal bit for bit to what the miss computed.

Both are process-wide (:func:`weight_cache`, :func:`output_cache`) and report to the status route's
``caches`` and ``text_encoder_outputs`` sections.  This module never imports ComfyUI: it works on
plain tensors and modules.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import enum
import hashlib
import marshal
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from h3ms_async.log import get_logger
from h3ms_async.runtime.host_memory import GIB, fmt_bytes, ram_info
from h3ms_async.status.hub import get_hub

log = get_logger("Caches")


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


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj`` (nested lists, tuples and dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


def _reserve_allows(nbytes: int, reserve_gb: float) -> bool:
    return ram_info().available_bytes - nbytes >= reserve_gb * GIB


# -- what a release gives back ---------------------------------------------------------------------
@dataclass(frozen=True)
class Freed:
    """What dropping a cache's tensors gave back to the OS (the release routes' JSON fields).

    * ``freed_bytes``: host RAM returned; the process's RSS drops by this much.  It counts the
      host storages that died with the release (no other live tensor used them), pinned ones at the
      size torch's pinned allocator held for them (it rounds blocks up to a power of two), less the
      pageable copies made for a model that still used the cache's pinned buffers.
    * ``pinned_freed_bytes``: page-locked memory returned (0 without CUDA).  It is part of
      ``freed_bytes`` except where it was replaced by those pageable copies.
    * ``kept_bytes``: cached bytes that stay in RAM because a live model or tensor still uses them.
      While ComfyUI has a model unloaded the weight cache's buffers *are* its host weights; they
      go when ComfyUI loads the model onto the GPU again or drops it.
    """

    freed_bytes: int = 0
    pinned_freed_bytes: int = 0
    kept_bytes: int = 0

    def __add__(self, other: Freed) -> Freed:
        return Freed(
            self.freed_bytes + other.freed_bytes,
            self.pinned_freed_bytes + other.pinned_freed_bytes,
            self.kept_bytes + other.kept_bytes,
        )

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def text(self) -> str:
        """The release messages' words for it, e.g. ``12.0 MiB of RAM freed (268.0 MiB pinned
        memory returned); 256.0 MiB kept in RAM: ...``."""
        out = f"{fmt_bytes(self.freed_bytes)} of RAM freed"
        if self.pinned_freed_bytes:
            out += f" ({fmt_bytes(self.pinned_freed_bytes)} pinned memory returned)"
        if self.kept_bytes:
            out += (
                f"; {fmt_bytes(self.kept_bytes)} kept in RAM: a live model or tensor still uses "
                "it (while ComfyUI has a model unloaded, its cached weights are its host weights; "
                "they go when ComfyUI loads or drops it)"
            )
        return out


def _pinned_pool_bytes() -> int | None:
    """Page-locked bytes torch's pinned allocator holds from CUDA (blocks in use or cached, at
    their rounded size); 0 without CUDA, None where this torch cannot say."""
    if not torch.cuda.is_available():
        return 0
    stats = getattr(torch.cuda, "host_memory_stats", None)
    value = stats().get("allocated_bytes.current") if callable(stats) else None
    return None if value is None else int(value)


def _free_pinned_pool() -> None:
    """Give freed page-locked blocks back to the OS (torch's host allocator keeps them for reuse
    otherwise)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if torch.cuda.is_available() and callable(empty):
        empty()


def _trim_heap() -> None:
    """Give the C heap's free pages back to the OS: glibc keeps freed chunks below its mmap
    threshold (up to 32 MiB) for reuse, so a freed small tensor would otherwise stay in the RSS.
    Nothing to do with another C library."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):
        return
    trim(0)


def _weak_storages(tensors: Iterable[torch.Tensor]) -> dict[int, tuple[StorageWeakRef, int, bool]]:
    """The distinct host storages under ``tensors``: a weak reference, the byte size and whether it
    is pinned (device tensors hold no RAM and are left out)."""
    out: dict[int, tuple[StorageWeakRef, int, bool]] = {}
    for t in tensors:
        if t.device.type != "cpu":
            continue
        s = t.untyped_storage()
        if s.data_ptr() not in out:
            out[s.data_ptr()] = (StorageWeakRef(s), s.nbytes(), t.is_pinned())
    return out


def _release(held: list[torch.Tensor], copied: int = 0) -> Freed:
    """Drop the references in ``held`` (the list is emptied; the caller keeps none of its own),
    give the freed memory back to the OS and report it: a storage counts as freed only when it died,
    so one that a live model or another tensor still uses is kept.  ``copied``: bytes of pageable
    copies the caller made in place of pinned buffers a live model used."""
    storages = _weak_storages(held)
    _free_pinned_pool()  # blocks freed before this release go first: the drop below is its own
    pinned_before = _pinned_pool_bytes()
    held.clear()
    _free_pinned_pool()
    _trim_heap()
    pinned_after = _pinned_pool_bytes()
    died = [(n, pinned) for ref, n, pinned in storages.values() if ref.expired()]
    died_bytes = sum(n for n, _ in died)
    pinned_freed = (
        pinned_before - pinned_after
        if pinned_before is not None and pinned_after is not None
        else sum(n for n, pinned in died if pinned)
    )
    pageable_freed = sum(n for n, pinned in died if not pinned)
    total = sum(n for _, n, _ in storages.values())
    return Freed(pageable_freed + pinned_freed - copied, pinned_freed, total - died_bytes + copied)


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

    def clear(self) -> tuple[int, Freed]:
        """Drop every entry (counters stay); returns how many there were and what that gave back
        (the stored outputs are the cache's own copies, so all of it unless a caller kept a
        tensor of one)."""
        with self._lock:
            n = len(self._items)
            held = [t for value, _ in self._items.values() for t in _tensors(value)]
            self._items.clear()
            self._bytes = 0
        return n, _release(held)

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


def _unpin(module: torch.nn.Module, buffers: Mapping[str, torch.Tensor]) -> int:
    """Give ``module``'s tensors that are pinned ``buffers`` pageable copies (the buffers are its
    host weights: the bytes stay, page-locked no more); returns the bytes copied."""
    copied = 0
    with torch.no_grad():
        for name, t in named_tensors(module).items():
            src = buffers.get(name)
            if src is not None and src.is_pinned() and t.data_ptr() == src.data_ptr():
                t.data = torch.empty(src.shape, dtype=src.dtype, device="cpu").copy_(src)
                copied += src.nbytes
    return copied


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

    def release(self, group: str) -> Freed:
        """Drop ``group``'s copy; returns what that gave back.  Buffers a live module still uses as
        its host weights (ComfyUI has it unloaded) stay in RAM with the module, as ``kept_bytes``;
        pinned ones are first swapped for pageable copies, so the page-locked memory goes back."""
        with self._lock:
            entry = self._groups.pop(group, None)
            self._asides.pop(group, None)
        if entry is None:
            return Freed()
        owner = entry.owner() if entry.owner is not None else None
        copied = _unpin(owner, entry.tensors) if owner is not None else 0
        held = list(entry.tensors.values())
        entry.tensors.clear()
        freed = _release(held, copied)
        log.info("weight cache %s released: %s", group, freed.text())
        return freed

    def clear(self) -> Freed:
        """Drop every group; returns what that gave back."""
        with self._lock:
            groups = list(self._groups)
        return sum((self.release(g) for g in groups), Freed())

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
