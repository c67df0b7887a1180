"""H3 Attention Parallel's transfer slots, per call shape: each piece's packed input slice and its
output, in shared memory (transport ``host``) or in the model GPU's memory that each helper opened
by CUDA IPC (``cuda_ipc``); reused while the call shape stays the same, as the DiT split's step
buffers are (``h3ms_async/dit/step_buffers.py``)."""

from __future__ import annotations

import abc

import torch

from workers.attention import protocol as attn_protocol
from workers.runtime import cuda_ipc
from workers.runtime.shm import Arena, Segment, dtype_name, register_cuda, slot_bytes


class Buffers(abc.ABC):
    """One call shape's transfer slots, per piece its packed input slice and its output; reused
    while shapes match."""

    key: tuple

    @abc.abstractmethod
    def inputs(self, p: int) -> dict[str, torch.Tensor]:
        """Piece ``p``'s input slots by name, where the coordinator stages its slice."""

    @abc.abstractmethod
    def output(self, p: int) -> torch.Tensor:
        """Piece ``p``'s output slot."""

    @abc.abstractmethod
    def fields(self, p: int) -> dict:
        """The ``attn_call`` fields that point a helper at piece ``p``'s slots."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free the slots."""


class ShmBuffers(Buffers):
    """Slots in two shm segments (inputs, outputs), registered with CUDA when the model is on a
    GPU."""

    def __init__(
        self, key: tuple, in_specs: list[dict], out_specs: list[tuple], device: torch.device
    ) -> None:
        self.key = key
        self.inputs_seg = Segment.create(
            sum(slot_bytes(dtype_name(dt), shp) for s in in_specs for dt, shp in s.values()),
            "attn_in",
        )
        try:
            self.outputs_seg = Segment.create(
                sum(slot_bytes(dtype_name(dt), shp) for dt, shp in out_specs), "attn_out"
            )
        except BaseException:
            self.inputs_seg.close()
            self.inputs_seg.unlink()
            raise
        try:
            a_in, a_out = Arena(self.inputs_seg), Arena(self.outputs_seg)
            self.in_descs = [
                {name: a_in.alloc(dtype_name(dt), shp) for name, (dt, shp) in s.items()}
                for s in in_specs
            ]
            self.out_descs = [a_out.alloc(dtype_name(dt), shp) for dt, shp in out_specs]
            if device.type == "cuda":
                register_cuda(self.inputs_seg, str(device))
                register_cuda(self.outputs_seg, str(device))
        except BaseException:
            self.close()
            raise

    def inputs(self, p: int) -> dict[str, torch.Tensor]:
        return {name: self.inputs_seg.tensor(d) for name, d in self.in_descs[p].items()}

    def output(self, p: int) -> torch.Tensor:
        return self.outputs_seg.tensor(self.out_descs[p])

    def fields(self, p: int) -> dict:
        return {"tensors": self.in_descs[p], "out": self.out_descs[p]}

    def close(self) -> None:
        for seg in (self.inputs_seg, getattr(self, "outputs_seg", None)):
            if seg is not None:
                seg.close()
                seg.unlink()


class IpcBuffers(Buffers):
    """Slots in the model GPU's memory, one input and one output buffer per helper (its pieces at
    offsets inside), shared once by CUDA IPC handles (``UntypedStorage._share_cuda_``): a helper
    keeps the same two buffers open for all its pieces.  ``helper[p]`` is piece p's helper
    (0-based), ``local_index[r]`` the index under which helper r sees the model's GPU."""

    def __init__(
        self,
        key: tuple,
        in_specs: list[dict],
        out_specs: list[tuple],
        device: torch.device,
        helper: list[int],
        local_index: list[int],
    ) -> None:
        self.key = key
        self._helper = helper
        sizes_in, sizes_out = [0] * len(local_index), [0] * len(local_index)
        self._in_layout, self._out_layout = [], []
        for spec, (out_dt, out_shp), r in zip(in_specs, out_specs, helper):
            layout = {}
            for name, (dt, shp) in spec.items():
                layout[name] = {"off": sizes_in[r], "dtype": dtype_name(dt), "shape": list(shp)}
                sizes_in[r] += slot_bytes(dtype_name(dt), shp)
            self._in_layout.append(layout)
            self._out_layout.append(
                {"off": sizes_out[r], "dtype": dtype_name(out_dt), "shape": list(out_shp)}
            )
            sizes_out[r] += slot_bytes(dtype_name(out_dt), out_shp)
        self._in, self._out, self._handles = [], [], []
        for size_in, size_out, index in zip(sizes_in, sizes_out, local_index):
            with torch.inference_mode(False):
                # normal tensors: writable in and outside inference mode
                flat_in = torch.empty(max(size_in, 1), dtype=torch.uint8, device=device)
                flat_out = torch.empty(max(size_out, 1), dtype=torch.uint8, device=device)
            self._in.append(flat_in)
            self._out.append(flat_out)
            self._handles.append(
                {"device": index, "in": cuda_ipc.share(flat_in), "out": cuda_ipc.share(flat_out)}
            )

    def inputs(self, p: int) -> dict[str, torch.Tensor]:
        return {
            name: attn_protocol.ipc_view(self._in[self._helper[p]], d)
            for name, d in self._in_layout[p].items()
        }

    def output(self, p: int) -> torch.Tensor:
        return attn_protocol.ipc_view(self._out[self._helper[p]], self._out_layout[p])

    def fields(self, p: int) -> dict:
        return {
            "tensors": {},
            "out": None,
            "ipc": dict(
                self._handles[self._helper[p]],
                tensors=self._in_layout[p],
                result=self._out_layout[p],
            ),
        }

    def close(self) -> None:
        self._in.clear()
        self._out.clear()
