"""This host's RAM as the process may use it: psutil's figures capped by the memory cgroup.

The weight store, the caches and the node layer check their RAM reserve against :func:`ram_info`;
the status document shows it as its ``ram`` section.  :func:`fmt_bytes` writes byte counts for
people.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import psutil

GIB = 1024**3


def fmt_bytes(n: int | float | None) -> str:
    """Human bytes for log lines and the status text: GiB at >= 1 GiB, else MiB (KiB for tiny
    amounts)."""
    if n is None:
        return "n/a"
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= 1024**2:
        return f"{n / 1024**2:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


class RamInfo(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Available and total RAM as the reserve checks see them (:func:`ram_info`)."""

    available_bytes: int
    total_bytes: int
    text: str
    container_limit: bool


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

    Page cache counts as available (the kernel drops it under pressure) except dirty and writeback
    pages, minus a margin of 5% of the limit because reclaim starts before the limit is hit.
    """
    candidates = [(root / "memory.max", root / "memory.current", root / "memory.stat", "")]
    v1 = root / "memory"
    candidates.append(
        (v1 / "memory.limit_in_bytes", v1 / "memory.usage_in_bytes", v1 / "memory.stat", "total_")
    )
    for limit_p, cur_p, stat_p, prefix in candidates:
        limit = _read_int(limit_p)
        current = _read_int(cur_p)
        if limit is None or current is None:
            continue
        stat = _read_stat(stat_p)
        active, inactive, dirty, writeback = (
            stat.get(prefix + k, stat.get(k, 0))
            for k in ("active_file", "inactive_file", "dirty", "writeback")
        )
        reclaimable = active + inactive - dirty - writeback
        reclaimable = max(0, reclaimable - int(0.05 * limit))
        return limit, max(0, limit - current + reclaimable)
    return None


def ram_info(cgroup_root: str | os.PathLike = "/sys/fs/cgroup") -> RamInfo:
    """``{available_bytes, total_bytes, text, container_limit}``: psutil's figures capped by the
    memory cgroup (v2 or v1 under ``cgroup_root``), so the weight store's reserve is checked against
    a container limit below the host's RAM.
    """
    vm = psutil.virtual_memory()
    avail, total, limited = int(vm.available), int(vm.total), False
    cont = _container_memory(Path(cgroup_root))
    if cont is not None and cont[0] < total:
        total, avail, limited = cont[0], min(avail, cont[1]), True
    text = f"RAM available {avail / GIB:.1f} of {total / GIB:.1f} GiB" + (
        " (container limit)" if limited else ""
    )
    return RamInfo(available_bytes=avail, total_bytes=total, text=text, container_limit=limited)
