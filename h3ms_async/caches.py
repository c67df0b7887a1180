"""Pinned-RAM weight caches and the text-encoder output cache (``docs/comfyui_facts.md`` §9).

* :class:`WeightCache` keeps a copy of a model's weights in page-locked host memory (plain RAM without CUDA), one
  checkpoint per *group* (``te``, ``vae:<file>``): when ComfyUI has dropped the weights (evicted the model), they come
  back from RAM at copy bandwidth instead of from disk.  Filling honours a RAM reserve: a fill that would leave less
  than the reserve available is refused and the model runs without the cache.
* :class:`OutputCache` is an LRU of encoder outputs keyed by a digest of everything that changes an encoding
  (:func:`digest`), bounded by an entry count and by the same RAM reserve.  A hit returns copies of the stored
  tensors, equal bit for bit to what the miss computed.

Both are process-wide (:func:`weight_cache`, :func:`output_cache`) and report to the status route's ``caches`` and
``text_encoder_outputs`` sections.  This module never imports ComfyUI: it works on plain tensors and modules.
"""
from __future__ import annotations

import collections
import hashlib
import marshal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from h3ms_async.log import get_logger
from h3ms_async.observability.status import get_hub, ram_info

log = get_logger("Caches")
GIB = 1 << 30


class CacheRefused(RuntimeError):
    """Filling would break the RAM reserve; the caller runs without the cache."""


def _walk(h: "hashlib._Hash", obj: Any) -> None:
    # Every branch writes a distinct leading tag, so no two encodings of different values can run together.
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        # the array itself, not .tobytes(): hashlib reads its buffer, so a large embedding is not copied once more
        h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
        return
    if type(obj) in (list, tuple):
        # Token lists are long runs of (int, float) pairs: marshal encodes such plain builtins in C, exactly
        # (ints whole, floats as their 8 bytes) and without back-references at version 2, so equal values give
        # equal bytes.  Anything it cannot encode (a tensor, an object) takes the item-by-item walk below.
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
    else:
        h.update(b"R" + repr(obj).encode())


def digest(*parts: Any) -> str:
    """sha256 hex of ``parts``: tensors by dtype, shape and bytes; lists and tuples of plain builtins by their
    marshal encoding; maps by sorted key; other sequences item by item; anything else by ``repr``."""
    h = hashlib.sha256()
    for p in parts:
        _walk(h, p)
        h.update(b"|")
    return h.hexdigest()


def _copy_out(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors are clones (so a caller that edits a result cannot change the cache)."""
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
        self._items: "collections.OrderedDict[str, tuple[Any, int]]" = collections.OrderedDict()
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

    def fetch(self, key_parts: tuple, compute: Callable[[], Any], max_entries: int,
              reserve_gb: float = 0.0) -> tuple[Any, str, bool]:
        """The output for ``key_parts`` (digested with :func:`digest`): a stored copy on a hit, else ``compute()``'s
        result, stored.  Returns ``(output, key, hit)``.  A hit costs the digest plus one copy of the output."""
        key = digest(*key_parts)
        hit = self.get(key)
        if hit is not None:
            return hit, key, True
        out = compute()
        self.put(key, out, max_entries, reserve_gb)
        return out, key, False

    def put(self, key: str, value: Any, max_entries: int, reserve_gb: float = 0.0) -> bool:
        """Store a copy of ``value``; evict the oldest beyond ``max_entries`` or while the RAM reserve would be
        broken.  Returns whether it was stored."""
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
            return {"entries": len(self._items), "hits": self.hits, "misses": self.misses, "bytes": self._bytes,
                    "max_entries": self.max_entries}


# -- weight cache -------------------------------------------------------------------------------------------------
def _pin(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``, page-locked when CUDA is available (what makes host->GPU copies run at full speed)."""
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=torch.cuda.is_available())
    host.copy_(t.detach())
    return host


@dataclass
class CachedWeights:
    """One group's checkpoint: every cached tensor by parameter/buffer name, in pinned RAM."""

    group: str
    key: tuple
    tensors: dict[str, torch.Tensor]
    nbytes: int
    fill_seconds: float
    restores: int = 0
    restore_seconds: float = 0.0

    def summary(self) -> dict:
        return {"group": self.group, "key": [str(k) for k in self.key], "tensors": len(self.tensors),
                "bytes": self.nbytes, "fill_seconds": round(self.fill_seconds, 3), "restores": self.restores,
                "restore_seconds": round(self.restore_seconds, 3), "pinned": torch.cuda.is_available()}


def named_tensors(module: torch.nn.Module, prefixes: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """A module's parameters and buffers by name (only those under ``prefixes`` when given)."""
    pre = tuple(prefixes) if prefixes is not None else None
    return {n: t for n, t in [*module.named_parameters(), *module.named_buffers()]
            if pre is None or n.startswith(pre)}


class WeightCache:
    """Pinned weight copies per group, one checkpoint (key) per group; see the module doc.  Thread-safe."""

    def __init__(self) -> None:
        self._groups: dict[str, CachedWeights] = {}
        self._lock = threading.Lock()
        self.refusals = 0

    def get(self, group: str, key: tuple) -> CachedWeights | None:
        with self._lock:
            entry = self._groups.get(group)
            return entry if entry is not None and entry.key == key else None

    def fill(self, group: str, key: tuple, tensors: Mapping[str, torch.Tensor],
             reserve_gb: float = 0.0) -> CachedWeights:
        """Copy ``tensors`` into pinned RAM as ``group``'s checkpoint ``key`` (a different key in the group is
        dropped first).  Raises :class:`CacheRefused` when the copy would leave less than ``reserve_gb`` available."""
        hit = self.get(group, key)
        if hit is not None:
            return hit
        self.release(group)
        need = sum(t.numel() * t.element_size() for t in tensors.values())
        if not _reserve_allows(need, reserve_gb):
            self.refusals += 1
            raise CacheRefused(
                f"weight cache {group}: needs {need / GIB:.2f} GiB but only {ram_info().available_bytes / GIB:.2f} "
                f"GiB RAM is available and cache_ram_reserve_gb={reserve_gb:g} must stay free; running without the "
                "cache (lower the reserve or free RAM)")
        t = time.perf_counter()
        pinned = {n: _pin(v) for n, v in tensors.items()}
        entry = CachedWeights(group, key, pinned, need, time.perf_counter() - t)
        with self._lock:
            self._groups[group] = entry
        log.info("weight cache %s filled: %.2f GiB %s in %.2f s (%s)", group, need / GIB,
                 "pinned" if torch.cuda.is_available() else "in RAM", entry.fill_seconds, ram_info().text)
        return entry

    def restore(self, entry: CachedWeights, module: torch.nn.Module) -> int:
        """Copy the cached tensors back into ``module``'s same-named parameters and buffers (on their devices);
        returns the bytes copied.  A name missing in the module, or another shape or dtype, is an error."""
        targets = named_tensors(module)
        t = time.perf_counter()
        copied = 0
        with torch.no_grad():
            for name, src in entry.tensors.items():
                dst = targets.get(name)
                if dst is None or dst.shape != src.shape or dst.dtype != src.dtype:
                    raise ValueError(f"weight cache {entry.group}: {name} no longer matches the model "
                                     f"({None if dst is None else (dst.dtype, tuple(dst.shape))}); clear the cache")
                dst.copy_(src, non_blocking=True)
                copied += src.numel() * src.element_size()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        entry.restores += 1
        entry.restore_seconds += time.perf_counter() - t
        return copied

    def release(self, group: str) -> int:
        """Drop ``group``'s checkpoint; returns the bytes freed."""
        with self._lock:
            entry = self._groups.pop(group, None)
        return entry.nbytes if entry is not None else 0

    def clear(self) -> int:
        """Drop every group; returns the bytes freed."""
        with self._lock:
            groups = list(self._groups)
        return sum(self.release(g) for g in groups)

    def summaries(self) -> list[dict]:
        """The status route's ``caches`` rows."""
        with self._lock:
            return [e.summary() for e in self._groups.values()]


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
