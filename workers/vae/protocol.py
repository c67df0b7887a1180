"""The messages of the VAE split decode: typed requests (``workers.runtime.protocol.Request``),
checked by the one decoder of ``workers.runtime.protocol``.

Both sides import this module: the coordinator (``h3ms_async.vae.split``) to send, the worker
(``workers.vae.rank``) to serve.  Field meanings:

``vae_load``    build the video VAE's decoder in this worker and copy its weights in (once per
                weight key).
    manifest    name -> tensor descriptor: the decode path's state dict as a checkpoint holds it (a
                quantized linear as its stored parts: int8 weight, scale, ``comfy_quant``) plus its
                non-persistent buffers, named as in ``MiniMaxH3VideoVAE``
    key         the weight key as text; a load with the key already loaded is a no-op
    arch        the decoder's architecture (see ``workers.vae.rank.build_decoder``)
    dtype       the VAE's compute dtype ("float16", "float32", ...)
    comfy       {root, sys_path, argv}: the ComfyUI root whose ``comfy`` package runs the decode,
                the parent's ``sys.path`` entries to add, and ComfyUI's command-line flags
                (attention choice, precision flags)
    -> VaeLoaded {loaded, key, bytes, seconds, import_s}

``vae_chunk``   decode one temporal chunk.
    job         decode number (logs, and the key of chunks held for ``vae_fetch``)
    index       chunk index
    z           descriptor of the chunk's padded, denormalised latent slice [B, C, t, h, w] in the
                VAE dtype
    out         descriptor where the raw decoder output goes (shm return), or None: the worker keeps
                the output and the coordinator reads it with ``vae_fetch`` (socket return)
    -> VaeChunkDone {index, seconds, copy_s, shape, dtype, nbytes, held}

``vae_probe``   the exactness probe: decode one random chunk of a plan's chunk shape, answer its
                digest (compared with rank 0's decode of the same latent by
                ``h3ms_async.vae.exactness``).
    z           descriptor of the probe latent [B, C, t, h, w] in the VAE dtype
    -> VaeProbed {digest, seconds, shape, dtype}

``vae_fetch``   read ``n`` bytes at ``off`` of a held chunk output (socket return); the last read
                frees it.
    -> VaeFetched {data}

``vae_drop``    end of ``job``: forget its held chunk outputs (an abandoned decode) and unmap its
                segments.
    -> Dropped {dropped}: how many held chunk outputs it forgot
``vae_release`` drop the decoder (the worker stays up).
    -> Released {released}: whether a decoder was loaded
"""

from __future__ import annotations

import hashlib
from typing import ClassVar

import torch

from workers.runtime import protocol
from workers.runtime.protocol import Answer, Dropped, Plain, Released, Request, TensorDesc


class VaeLoaded(Answer):
    """Whether this call built the decoder (False: ``key`` was loaded already); then its bytes and
    the seconds of the load and of ComfyUI's import."""

    loaded: bool
    key: str
    bytes: int | None = None
    seconds: float | None = None
    import_s: float | None = None


class VaeLoad(Request, tag="vae_load"):
    manifest: dict[str, TensorDesc]
    key: str
    arch: Plain
    dtype: str
    comfy: Plain
    PLAIN: ClassVar[tuple[str, ...]] = ("arch", "comfy")
    ANSWER: ClassVar[type[Answer]] = VaeLoaded


class VaeChunkDone(Answer):
    """One decoded chunk: its decode and copy seconds, raw output shape, dtype and bytes, and
    whether the worker holds it for ``vae_fetch`` (socket return) instead of having written it to
    ``out``."""

    index: int
    seconds: float
    copy_s: float
    shape: list[int]
    dtype: str
    nbytes: int
    held: bool


class VaeChunk(Request, tag="vae_chunk"):
    job: int
    index: int
    z: TensorDesc
    out: TensorDesc | None
    ANSWER: ClassVar[type[Answer]] = VaeChunkDone


class VaeProbed(Answer):
    """The probe chunk's digest (:func:`chunk_digest`), decode seconds, shape and dtype."""

    digest: str
    seconds: float
    shape: list[int]
    dtype: str


class VaeProbe(Request, tag="vae_probe"):
    z: TensorDesc
    ANSWER: ClassVar[type[Answer]] = VaeProbed


class VaeFetched(Answer):
    """One piece of a held chunk output."""

    data: bytes


class VaeFetch(Request, tag="vae_fetch"):
    job: int
    index: int
    off: int
    n: int
    ANSWER: ClassVar[type[Answer]] = VaeFetched


class VaeDrop(Request, tag="vae_drop"):
    job: int
    ANSWER: ClassVar[type[Answer]] = Dropped


class VaeRelease(Request, tag="vae_release"):
    ANSWER: ClassVar[type[Answer]] = Released


#: The parameter/buffer prefixes of ``MiniMaxH3VideoVAE`` that a decode uses; the encoder never
#: travels.
DECODE_PREFIXES = ("decoder.", "post_quant_conv.")
#: Largest piece one ``vae_fetch`` answer carries (well under the frame limit, leaving room for the
#: envelope).
FETCH_PIECE_BYTES = min(8 * 1024 * 1024, protocol.MAX_FRAME_BYTES // 2)


def chunk_digest(raw: torch.Tensor) -> str:
    """SHA-256 of a decoded chunk's bytes (shape and dtype are compared apart): equal digests, equal
    bits."""
    flat = raw.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(flat.numpy().data).hexdigest()
