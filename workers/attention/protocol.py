"""The messages of H3 Attention Parallel: typed requests (``workers.runtime.protocol.Request``),
checked by the one decoder of ``workers.runtime.protocol``.

Both sides import this module: the coordinator (``h3ms_async.attention.engine``) to send, the helper
(``workers.attention.rank``) to serve.  Field meanings:

``attn_call``    run comfy-kitchen's ``int8_attention_from_prequantized`` on one piece (a head
                 slice) of a call; a helper gets its pieces in order, several may be in flight, and
                 it pipelines them
    job          call number (logs)
    first        True on the helper's first piece of this call (its peak-memory counter restarts)
    tensors      {q, k, v, q_scale, k_scale, v_scale}: descriptors of this helper's packed INT8 head
                 slice in shm, in kitchen's layout (``workers.attention.ops.PACKED``); empty with
                 ``ipc``
    meta         {original_head_dim, input_dtype, attention_scale, cta_k}: the rest of kitchen's
                 ``PrequantizedInt8Attention``, the same for every slice of one call
    out          descriptor of the slice's output [B, h, Sq, D] in shm, where the helper writes its
                 result; None with ``ipc``
    ipc          (transport ``cuda_ipc``) the slice and the output slot in device memory of the
                 model's GPU, shared by CUDA IPC instead of shm: {device: the helper's own index of
                 that GPU, in / out: the helper's two buffers' ``UntypedStorage._share_cuda_()``
                 handles (the same for all its pieces), tensors: {name: {off, dtype, shape}} inside
                 ``in``, result: {off, dtype, shape} inside ``out``}
    -> AttnPiece: the piece's seconds per phase, bytes in and out, peak VRAM, wall time

``attn_probe``   measure on this helper's device whether its head ranges give the whole call's bits
                 (``workers.attention.ops.probe_ranges``): random data of ``shape`` [B, H, S, D] in
                 ``dtype``, keys and values of ``kv_len`` tokens
    ranges       the head ranges [h0, h1) this helper runs for that shape (its pieces)
    -> AttnProbed: per range exact / max_abs_diff, the call's digest, device fingerprint, ms

``attn_release`` drop this helper's shm mappings and cached device memory (it keeps running).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from workers.runtime.protocol import Answer, Plain, Released, Request, TensorDesc, tensor_nbytes
from workers.runtime.shm import torch_dtype

if TYPE_CHECKING:
    import torch


class AttnPiece(Answer):
    """One piece on a helper: its copy in, attention and copy out seconds (CUDA: event-timed,
    each phase's own), ``compute_end_s`` (from the call's first attention start on this helper
    to this piece's attention end), the bytes it read and wrote, the helper's peak VRAM (None
    on a CPU), and the request's wall seconds."""

    h2d_s: float
    compute_s: float
    d2h_s: float
    compute_end_s: float
    bytes_in: int
    bytes_out: int
    vram_peak_bytes: int | None
    wall_s: float = 0.0


class AttnCall(Request, tag="attn_call"):
    job: int
    first: bool
    tensors: dict[str, TensorDesc]
    meta: Plain
    out: TensorDesc | None
    ipc: Plain | None = None
    PLAIN: ClassVar[tuple[str, ...]] = ("meta", "ipc")
    ANSWER: ClassVar[type[Answer]] = AttnPiece


class AttnProbed(Answer):
    """Per probed head range ``exact`` and ``max_abs_diff``, the whole call's ``digest``
    (compared across devices), the device ``fingerprint``
    (``workers.dit.invariance.fingerprint``) and the probe's ``ms``."""

    fingerprint: dict[str, str]
    exact: list[bool]
    max_abs_diff: list[float]
    digest: str
    ms: float


class AttnProbe(Request, tag="attn_probe"):
    shape: tuple[int, int, int, int]
    kv_len: int
    dtype: str
    ranges: list[tuple[int, int]]
    ANSWER: ClassVar[type[Answer]] = AttnProbed


class AttnRelease(Request, tag="attn_release"):
    ANSWER: ClassVar[type[Answer]] = Released


def ipc_view(flat: torch.Tensor, d: Plain) -> torch.Tensor:
    """The tensor an ``ipc`` layout entry ``{off, dtype, shape}`` names inside the flat uint8 buffer
    ``flat``; the coordinator and the helper both read the layout through this, so they agree on
    every byte."""
    n = tensor_nbytes(d["dtype"], d["shape"])
    return flat[d["off"] : d["off"] + n].view(torch_dtype(d["dtype"])).view(d["shape"])
