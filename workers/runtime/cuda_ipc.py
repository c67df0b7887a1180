"""CUDA IPC of device buffers between processes, as the attention helpers and the DiT split's
GPU-direct exchange use it: a buffer's handle (``UntypedStorage._share_cuda_()``), opening one in
another process, and whether this process can share at all.

A handle travels as the list ``_share_cuda_()`` returns (:data:`IpcHandle`): device, memory handle,
size, offset, reference counter file and offset, event handle, event sync flag.  Each opening
process needs a handle of its own (the owner's storage keeps a reference counter per share, and the
opener's storage gives its count back when it dies, so the owner's caching allocator reuses the
memory only after every opener let go).  An opened buffer belongs to the device index the opener
sees the owner's GPU under (``also_visible`` of ``h3ms_async.runtime.pool.WorkerPool``).
"""

from __future__ import annotations

import msgspec
import torch

#: One share of a buffer, as ``UntypedStorage._share_cuda_()`` returns it.
IpcHandle = tuple[int, bytes, int, int, bytes, int, bytes | None, bool]


def share(t: torch.Tensor) -> list:
    """A new CUDA IPC handle of ``t``'s storage for one opener (:data:`IpcHandle` as a list)."""
    return list(t.untyped_storage()._share_cuda_())


def open_storage(handle: list | tuple, device: int) -> torch.UntypedStorage:
    """The storage behind ``handle`` (a :data:`IpcHandle`, checked), on this process's CUDA device
    ``device``."""
    _, h, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = msgspec.convert(
        list(handle), IpcHandle
    )
    torch.cuda._lazy_init()
    return torch.UntypedStorage._new_shared_cuda(
        device, h, size, offset, rc_handle, rc_offset, ev_handle, ev_sync
    )


def bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """``storage`` as one flat uint8 tensor (views of it address the buffer by byte offset)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


def unavailable(device: str) -> str:
    """'' when this process can share memory of ``device`` by CUDA IPC, else why not (and the fix).
    PyTorch's ``backend:cudaMallocAsync`` (ComfyUI's default ``--cuda-malloc`` on recent GPUs) and
    pluggable allocators have no IPC handles, so a real share is tried."""
    try:
        share(torch.empty(1, dtype=torch.uint8, device=device))
    except Exception as exc:  # noqa: BLE001
        # any failure means: no IPC here, with torch's own reason
        return (
            f"this process cannot share {device} memory by CUDA IPC (allocator "
            f"{torch.cuda.get_allocator_backend()}: {str(exc).splitlines()[0]}); start ComfyUI "
            "with --disable-cuda-malloc for the GPU-direct path"
        )
    return ""
