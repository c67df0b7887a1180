"""Which devices a worker sees: the device strings a pool takes (``cpu``, ``cuda``, ``cuda:N``) and
the CUDA_VISIBLE_DEVICES each worker gets (its own device first, so it is the worker's cuda:0, then
the pool's ``also_visible`` devices)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

DEVICE_RE = re.compile(r"^(cpu|cuda(?::(\d+))?)$")


def rank_devices(devices: Sequence[str]) -> list[str]:
    """A pool's rank map checked, with ``cuda`` written as ``cuda:0``."""
    if isinstance(devices, str) or not devices:
        raise ValueError(
            "devices must be a non-empty list like ['cpu', 'cpu'] or ['cuda:0', 'cuda:1'], "
            f"got {devices!r}"
        )
    bad = [d for d in devices if not isinstance(d, str) or not DEVICE_RE.match(d)]
    if bad:
        raise ValueError(f"devices {bad!r} are not 'cpu', 'cuda' or 'cuda:N'")
    return [canonical_device(d) for d in devices]


def extra_devices(also_visible: Sequence[str]) -> list[str]:
    """A pool's ``also_visible`` checked (CUDA devices only), with ``cuda`` written as
    ``cuda:0``."""
    extra = [canonical_device(d) for d in also_visible]
    bad = [d for d in extra if not d.startswith("cuda") or not DEVICE_RE.match(d)]
    if bad:
        raise ValueError(f"also_visible {bad!r} are not CUDA devices 'cuda' or 'cuda:N'")
    return extra


def canonical_device(device: str) -> str:
    """``device`` as one GPU is named everywhere: ``cuda`` is ``cuda:0``."""
    return "cuda:0" if device == "cuda" else device


def cuda_visible_for(device: str, parent_visible: str | None) -> str:
    """The CUDA_VISIBLE_DEVICES a worker on ``device`` gets: the parent's own entry for that
    index."""
    m = DEVICE_RE.match(device)
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


def check_visible(devices: Sequence[str]) -> None:
    """Raise ValueError now for a CUDA device this process does not see, not later in a worker."""
    for d in devices:
        cuda_visible_for(d, os.environ.get("CUDA_VISIBLE_DEVICES"))


def visible_entries(device: str, also_visible: Sequence[str]) -> list[str]:
    """CUDA_VISIBLE_DEVICES entries of a worker on ``device``: its own first, then
    ``also_visible`` (no repeats)."""
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries: list[str] = []
    for d in [device, *also_visible]:
        entry = cuda_visible_for(d, parent)
        if entry not in entries:
            entries.append(entry)
    return entries


def local_index(rank: int, own: str, device: str, also_visible: Sequence[str]) -> int:
    """The index under which the worker of ``rank`` (on ``own``) sees ``device``: its own device
    or one of ``also_visible``."""
    entries = visible_entries(own, also_visible)
    entry = cuda_visible_for(device, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if not own.startswith("cuda") or entry not in entries:
        raise ValueError(
            f"rank {rank} on {own} does not see {device}; add it to the pool's also_visible"
        )
    return entries.index(entry)
