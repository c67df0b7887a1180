"""Which transport a split's exchange runs over: the ``exchange`` setting (``auto``, ``host``,
``nccl``, ``cuda_ipc``) resolved for the rank devices, with one-line refusals naming the input and
the fix, and the CUDA devices every worker must see for it.

``auto`` takes the GPU-direct exchange (``cuda_ipc``, ``workers/transports/cuda_ipc.py``) where
every rank is on a GPU, the ranks are on one GPU or every pair of their GPUs has peer access both
ways, the workers are not on ``cudaMallocAsync`` (ComfyUI's ``--cuda-malloc``), and
``h3ms_async/dit/tested_paths.py`` lists it as tested on CUDA (on one GPU, and across GPUs when the
ranks use several); otherwise the host exchange.  ``nccl`` and ``host`` stay as
they are (GPUs without peer access keep host staging).  The ``ipc_sync`` setting says how the
GPU-direct exchange orders its copies (:func:`resolve_sync`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal, TypeVar

import torch

from h3ms_async.dit import tested_paths
from h3ms_async.runtime.visibility import canonical_device
from workers.dit.protocol import IpcSync, Transport

#: The setting that picks the transport for the devices.
AUTO: Literal["auto"] = "auto"
#: What the ``exchange`` setting takes (the node input's choices; ``nccl`` runs as gloo on CPUs).
EXCHANGES = (
    Transport.HOST.value,
    Transport.NCCL.value,
    Transport.CUDA_IPC.value,
    AUTO,
)

#: An ``exchange`` setting as the options hold it.
Setting = Transport | Literal["auto"]
#: An ``ipc_sync`` setting as the options hold it.
SyncSetting = IpcSync | Literal["auto"]
#: What the ``ipc_sync`` setting takes.
IPC_SYNCS = (*(s.value for s in IpcSync), AUTO)


class ExchangeRefused(ValueError):
    """The ``exchange`` setting cannot run on these rank devices (the message names the fix)."""


_E = TypeVar("_E", Transport, IpcSync)


def _parse(raw: str, kind: type[_E], name: str, choices: tuple[str, ...]) -> _E | Literal["auto"]:
    """Setting ``name`` as a user writes it: ``auto`` or a value of ``kind``."""
    if raw == AUTO:
        return AUTO
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not one of {choices}") from None


def parse(raw: str) -> Setting:
    """An exchange setting as a user writes it."""
    return _parse(raw, Transport, "exchange", EXCHANGES)


def _gpus(devices: Sequence[str]) -> list[str]:
    """The distinct GPUs of the rank map, in rank order (``cuda`` is ``cuda:0``)."""
    out: list[str] = []
    for d in devices:
        name = canonical_device(d)
        if name not in out:
            out.append(name)
    return out


def no_peer_access(devices: Sequence[str]) -> list[tuple[str, str]]:
    """The pairs of the ranks' distinct GPUs where one cannot reach the other's memory (every pair
    in a process without CUDA)."""
    gpus = _gpus(devices)
    cuda = torch.cuda.is_available()
    return [
        (a, b)
        for a in gpus
        for b in gpus
        if a != b
        and not (cuda and torch.cuda.can_device_access_peer(torch.device(a), torch.device(b)))
    ]


#: The allocator settings a worker inherits from this process (torch reads either name).
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def async_allocator() -> str | None:
    """The inherited allocator setting that puts the workers on ``cudaMallocAsync`` (ComfyUI's
    ``--cuda-malloc`` sets it at start-up), whose memory has no CUDA IPC handles; None without
    one."""
    for var in ALLOC_CONF_VARS:
        value = os.environ.get(var, "")
        if "cudaMallocAsync" in value:
            return f"{var}={value}"
    return None


def check_cuda_ipc(devices: Sequence[str]) -> None:
    """Refuse the GPU-direct exchange in one line naming the input and the fix where it cannot run
    on these rank devices: CPU ranks, workers on ``cudaMallocAsync``, no passing CUDA test
    (``tested_paths.UntestedPath``), GPUs without peer access both ways."""
    cpu = [d for d in devices if not d.startswith("cuda")]
    if cpu:
        raise ExchangeRefused(
            f"exchange cuda_ipc moves rows between GPUs and rank map {list(devices)} has CPU "
            "ranks; set exchange to host (or auto)"
        )
    conf = async_allocator()
    if conf:
        raise ExchangeRefused(
            f"exchange cuda_ipc shares GPU buffers by CUDA IPC and the workers inherit {conf} "
            "(ComfyUI's --cuda-malloc), whose memory cannot be shared; start ComfyUI with "
            "--disable-cuda-malloc, or set exchange to host (or auto)"
        )
    tested_paths.require(tested_paths.SplitPath.CUDA_IPC, devices)
    if len(_gpus(devices)) > 1:
        tested_paths.require(tested_paths.SplitPath.CUDA_IPC_P2P, devices)
    missing = no_peer_access(devices)
    if missing:
        a, b = missing[0]
        raise ExchangeRefused(
            f"exchange cuda_ipc needs peer access between the ranks' GPUs and {a} cannot reach "
            f"{b}'s memory; set exchange to host (or auto) for these GPUs"
        )


def resolve(exchange: Setting | str, devices: Sequence[str]) -> Transport:
    """The transport ``exchange`` runs as on ``devices`` (``auto``: the GPU-direct exchange where
    :func:`check_cuda_ipc` passes on more than one rank, else host); an explicit ``cuda_ipc`` that
    cannot run raises :func:`check_cuda_ipc`'s refusal."""
    cuda = bool(devices) and all(d.startswith("cuda") for d in devices)
    if exchange == AUTO:
        if len(devices) > 1 and cuda:
            try:
                check_cuda_ipc(devices)
            except ValueError:
                return Transport.HOST
            return Transport.CUDA_IPC
        return Transport.HOST
    transport = Transport(exchange)
    if transport is Transport.CUDA_IPC:
        check_cuda_ipc(devices)
    return transport.on(cuda)


def also_visible(transport: Transport, devices: Sequence[str]) -> tuple[str, ...]:
    """The GPUs every worker must see besides its own for ``transport``: the ranks' GPUs for the
    GPU-direct exchange across GPUs (it opens their buffers), none otherwise."""
    gpus = _gpus(devices)
    return tuple(gpus) if transport is Transport.CUDA_IPC and len(gpus) > 1 else ()


def parse_sync(raw: str) -> SyncSetting:
    """An ``ipc_sync`` setting as a user writes it."""
    return _parse(raw, IpcSync, "ipc_sync", IPC_SYNCS)


def resolve_sync(setting: SyncSetting, transport: Transport, devices: Sequence[str]) -> IpcSync:
    """How the GPU-direct exchange orders its copies on ``devices``: ``auto`` waits on the host
    (on one H100 the CUDA IPC events ordering measured no faster: docs/performance.md, "The
    GPU-direct exchange ordered by CUDA IPC events"); an explicit ``events`` without a passing test
    there is refused in one line.  Other transports: host (the field is unused)."""
    if transport is not Transport.CUDA_IPC or setting == AUTO:
        return IpcSync.HOST
    if setting is IpcSync.EVENTS:
        tested_paths.require(tested_paths.SplitPath.CUDA_IPC_EVENTS, devices)
    return IpcSync(setting)
