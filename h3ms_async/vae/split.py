"""The VAE split decode engine: H3 video-VAE temporal chunks dealt across worker processes, blended
in order here.

Rank 0 is the calling process (ComfyUI's, which decodes on the VAE's own device); ranks 1..N-1 are
the workers of this engine's :class:`~h3ms_async.runtime.pool.WorkerPool` (``workers.vae.rank``).
Chunk i goes to the ``i mod N``-th of the N ranks that decode exactly (``vae_plan.deal``).  Per
decode the engine

1. ships the decoder's weights once per weight key (a one-block shared-memory weight store, dropped
   once every worker has copied it in; a restarted pool gets them again);
2. checks, once per rank and chunk shape, that a worker decodes a chunk as rank 0 does
   (``h3ms_async.vae.exactness``) and deals the chunks over the ranks that do;
3. writes the remote chunks' latent slices into one input segment and asks each worker for its
   chunks, all at once (a worker decodes them in order on its compute thread);
4. decodes its own chunks meanwhile, and feeds every chunk to the ordered blend/write
   (``vae_plan.Assembler``) in chunk order, waiting for a remote chunk only when its turn comes.

Remote chunks come back through one output segment in POSIX shared memory; when /dev/shm has no room
(containers mount 64 MB) they come back over the worker's socket in pieces, with one warning.
``H3MS_VAE_TRANSPORT`` forces ``shm`` or ``socket`` (default ``auto``).  Any worker's failure fails
the decode at once with its last log lines.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from h3ms_async.log import get_logger
from h3ms_async.runtime.coordinator import get_coordinator
from h3ms_async.runtime.engines import Engine, EngineRegistry
from h3ms_async.runtime.plans import GPUSelectionError, rank_map
from h3ms_async.runtime.pool import WorkerPool
from h3ms_async.runtime.spawn import cpu_thread_env
from h3ms_async.runtime.weight_store import fill
from h3ms_async.status.hub import get_hub
from h3ms_async.status.records import now_iso
from h3ms_async.vae import exactness
from h3ms_async.vae import plan as vae_plan
from workers.runtime import config
from workers.runtime.protocol import TensorDesc
from workers.runtime.shm import Arena, Segment, ShmError, dtype_name, slot_bytes
from workers.vae import protocol as vae_protocol

log = get_logger("VAE split")

TRANSPORT_ENV = config.VAE_TRANSPORT.name
CHUNK_TIMEOUT_ENV = config.VAE_CHUNK_TIMEOUT.name
#: Most ranks a VAE split uses (the node's max_gpus cap).
VAE_MAX_RANKS = 8


class VaeSplitError(RuntimeError):
    """A split decode failed (a worker died, reported an error, or missed its deadline)."""


class VaeSplitInterrupted(VaeSplitError):
    """The caller's interrupt probe turned true; the workers' outstanding chunks were abandoned."""


class VaeSplitUnsupported(VaeSplitError):
    """This VAE cannot be split exactly (the caller decodes it unsplit); the message says why."""


@dataclass(frozen=True)
class DecoderSpec:
    """What a worker needs to rebuild the VAE's decoder: weight key, architecture, dtype, ComfyUI to
    import."""

    key: tuple
    arch: dict
    dtype: str
    comfy: dict
    read_tensors: Callable[[], dict[str, torch.Tensor]]


def describe_decoder(model: Any, compute_dtype: torch.dtype) -> tuple[dict, str]:
    """``(arch, dtype)`` of a live ``MiniMaxH3VideoVAE`` for ``workers.vae.rank.build_decoder``;
    ``dtype`` is the dtype the decode computes in (the latent's, ComfyUI's ``vae_dtype``).

    A quantized decoder (an int8 "convrot" checkpoint: ComfyUI builds its block linears with
    ``comfy.ops.mixed_precision_ops``) is described by that factory's arguments, so a worker builds
    the same class and loads the same stored parts.  The stored dtypes travel with the tensors (a
    worker keeps each one's dtype) and ``arch["cast_flags"]`` names the ``comfy.ops`` modules whose
    per-layer cast differs from their class's: under DynamicVRAM ComfyUI keeps a bf16 checkpoint's
    weights in bf16 and casts each layer's to the fp16 input, and the workers must run that same
    cast.  Raises :class:`VaeSplitUnsupported` for linears of any other custom class, tensors of an
    unknown kind or patched weights (a LoRA on the VAE): the workers could not rebuild those bit for
    bit.
    """
    dec = model.decoder
    blk = dec.transformer_blocks[0]
    lin = type(blk.attn.to_qkv)
    qual = lin.__qualname__
    quantized = lin.__module__ == "comfy.ops" and qual.startswith("mixed_precision_ops.")
    if not quantized and (
        lin.__module__ != "comfy.ops" or qual.count(".") != 1 or "<locals>" in qual
    ):
        raise VaeSplitUnsupported(
            f"the decoder's linears are {lin.__module__}.{qual} (custom operations); only "
            "comfy.ops decoders (plain or int8-quantized) split exactly"
        )
    tensors = decoder_tensors(model)
    odd = sorted(n for n, t in tensors.items() if type(t.data) is not torch.Tensor)
    if odd:
        raise VaeSplitUnsupported(
            f"decoder tensors {odd[:3]} are {type(tensors[odd[0]].data).__name__}, not plain "
            "tensors"
        )
    cast_flags: dict[str, bool] = {}
    for prefix in vae_protocol.DECODE_PREFIXES:
        for name, mod in getattr(model, prefix[:-1]).named_modules(prefix=prefix[:-1]):
            if not hasattr(mod, "comfy_cast_weights"):
                continue
            if any(
                getattr(mod, f"{p}_function", None)
                or getattr(mod, f"{p}_lowvram_function", None) is not None
                for p in ("weight", "bias")
            ):
                raise VaeSplitUnsupported(
                    f"{name}'s weights are patched (a LoRA or weight function on the VAE); the "
                    "workers decode the stored weights only"
                )
            if bool(mod.comfy_cast_weights) != bool(
                getattr(type(mod), "comfy_cast_weights", False)
            ):
                cast_flags[name] = bool(mod.comfy_cast_weights)
    arch = {
        "decoder": {
            "patch_size": int(dec.patch_size),
            "patch_size_t": int(dec.patch_size_t),
            "in_channels": int(dec.x_embedder.in_features),
            "out_channels": int(dec.out_channels),
            "num_layers": len(dec.transformer_blocks),
            "heads": int(blk.attn.heads),
            "dim_head": int(blk.attn.dim_head),
            "bias": blk.attn.to_qkv.bias is not None,
            "eps": float(blk.norm1.eps),
            "num_register_tokens": int(dec.num_register_tokens),
        },
        "operations": qual.split(".")[0],
        "cast_flags": cast_flags,
        "z_channels": int(model.post_quant_conv.out_channels),
        "embed_dim": int(model.post_quant_conv.in_channels),
        "tile_size": int(model.tile_size),
        "tile_overlap_min": int(model.tile_overlap_min),
        "tiling": bool(model.tiling),
        "vae_ratio": int(model.vae_ratio),
        "vae_ratio_t": int(model.vae_ratio_t),
        "clip_length": int(model.clip_length),
        "token_drop": int(model.token_drop),
    }
    if quantized:
        # mixed_precision_ops(quant_config, compute_dtype, full_precision_mm): the worker takes
        # quant_config from the shipped tensors' names, as ComfyUI's VAE loader takes it from the
        # checkpoint's
        arch["mixed_precision"] = {
            "compute_dtype": dtype_name(blk.attn.to_qkv.factory_kwargs["dtype"]),
            "full_precision_mm": bool(blk.attn.to_qkv._full_precision_mm),
        }
    return arch, dtype_name(compute_dtype)


def decoder_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The decode path's tensors by name: its state dict as ComfyUI's loader reads a checkpoint (a
    quantized linear as its stored parts: int8 weight, scale, ``comfy_quant`` metadata) plus its
    non-persistent buffers, which no state dict holds."""
    out: dict[str, torch.Tensor] = {}
    for prefix in vae_protocol.DECODE_PREFIXES:
        out.update(getattr(model, prefix[:-1]).state_dict(prefix=prefix))
    out.update(
        {
            n: b
            for n, b in model.named_buffers()
            if n.startswith(vae_protocol.DECODE_PREFIXES) and n not in out
        }
    )
    return out


def layout_digest(model: Any, arch: dict) -> str:
    """A short digest of what a worker builds besides the weights' values: ``arch`` and every decode
    tensor's dtype. Part of the weight key, so a decoder whose layout changed (DynamicVRAM casts the
    non-``comfy.ops`` parameters and turns the per-layer casts on at its first load, after the node
    already shipped it) is shipped again."""
    dtypes = sorted((n, dtype_name(t.dtype)) for n, t in decoder_tensors(model).items())
    return hashlib.sha1(json.dumps([arch, dtypes], sort_keys=True).encode()).hexdigest()[:12]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class VaeSplitEngine(Engine):
    """Rank 0 = this process on ``devices[0]``; a worker per other device.  See the module doc."""

    error = VaeSplitError
    interrupted = VaeSplitInterrupted
    deadline_hint = f"raise {CHUNK_TIMEOUT_ENV} to allow longer"

    def __init__(self, devices: Sequence[str]) -> None:
        if len(devices) < 2:
            raise ValueError(
                f"a VAE split needs at least 2 ranks (this process + a worker), got {list(devices)}"
            )
        if len(devices) > VAE_MAX_RANKS:
            raise GPUSelectionError(
                f"{len(devices)} VAE ranks; at most {VAE_MAX_RANKS} are supported"
            )
        self.devices = list(devices)
        self._loaded_key: tuple | None = None
        self._loaded_starts = -1
        self._jobs = 0
        self._warned_socket = False
        self._load_lock = asyncio.Lock()
        self.last_record: dict | None = None
        super().__init__(
            WorkerPool(
                self.devices[1:], name="vae", program="vae", env=cpu_thread_env(self.devices)
            ),
            ENGINES,
        )

    @property
    def ranks(self) -> int:
        return len(self.devices)

    def prestart(self, spec: DecoderSpec | None = None) -> None:
        """Start the workers in the background, and ship ``spec``'s decoder when given (the node
        calls this when it executes); a failure is logged and the next decode tries again."""
        fut = get_coordinator().submit(
            self._ensure_loaded(spec) if spec is not None else self.pool.start()
        )

        def _done(f: cf.Future) -> None:
            if not f.cancelled() and f.exception() is not None:
                log.warning(
                    "background start of the VAE workers failed (retried at decode): %s",
                    f.exception(),
                )

        fut.add_done_callback(_done)

    # -- the decode --------------------------------------------------------------------------------
    def decode(
        self,
        z_padded: torch.Tensor,
        plan: vae_plan.ChunkPlan,
        spec: DecoderSpec,
        decode_local: Callable[[torch.Tensor], torch.Tensor],
        out: torch.Tensor,
        blend_fn: vae_plan.BlendFn,
        finalize_fn: vae_plan.FinalizeFn,
        interrupt: Callable[[], bool] | None = None,
    ) -> dict:
        """Decode ``z_padded`` (already padded per ``plan``) into ``out``; returns the decode
        record.

        ``decode_local(z_slice)`` decodes one chunk in this process (the VAE's own method);
        ``blend_fn`` and ``finalize_fn`` are the ordered part's math (see ``vae_plan.Assembler``).
        """
        with self.job():
            return self._decode(
                z_padded, plan, spec, decode_local, out, blend_fn, finalize_fn, interrupt
            )

    def _decode(
        self, z_padded, plan, spec, decode_local, out, blend_fn, finalize_fn, interrupt
    ) -> dict:
        t_start = time.perf_counter()
        coord = get_coordinator()
        timeout = config.VAE_CHUNK_TIMEOUT.get()
        self.run(
            self._ensure_loaded(spec),
            self.pool.start_timeout + timeout,
            "loading the VAE workers",
            interrupt,
        )
        t_load = time.perf_counter() - t_start
        active, probe_ms = self._exact_ranks(z_padded, plan, spec, decode_local, interrupt, timeout)
        self._jobs += 1
        job = self._jobs
        owners = [active[r] for r in vae_plan.deal(plan.num_chunks, len(active))]
        remote = [i for i, r in enumerate(owners) if r != 0]
        dev0 = z_padded.device
        dtype = z_padded.dtype
        b, _, _, h, w = z_padded.shape
        out_ch = spec.arch["decoder"]["out_channels"]
        ratio = spec.arch["vae_ratio"]

        def raw_shape(i: int) -> list[int]:
            return [b, out_ch, plan.raw_frames(i), h * ratio, w * ratio]

        segs: list[Segment] = []
        futures: dict[int, cf.Future] = {}
        chunks: list[dict] = []
        transport = "none"
        moved = 0
        try:
            in_descs: dict[int, TensorDesc] = {}
            out_descs: dict[int, TensorDesc | None] = dict.fromkeys(remote)
            if remote:
                z_cpu = z_padded.to("cpu")
                seg_in = Segment.create(
                    sum(
                        slot_bytes(dtype_name(dtype), z_cpu[:, :, a:b_].shape)
                        for a, b_ in (plan.spans[i] for i in remote)
                    ),
                    "vae_in",
                )
                segs.append(seg_in)
                arena = Arena(seg_in)
                for i in remote:
                    a, e = plan.spans[i]
                    piece = z_cpu[:, :, a:e]
                    desc = arena.alloc(dtype_name(dtype), list(piece.shape))
                    seg_in.tensor(desc).copy_(piece)
                    in_descs[i] = desc
                    moved += _nbytes(piece)
                transport, seg_out = self._output_segment(remote, raw_shape, dtype)
                if seg_out is not None:
                    segs.append(seg_out)
                    arena = Arena(seg_out)
                    for i in remote:
                        out_descs[i] = arena.alloc(dtype_name(dtype), raw_shape(i))
                for i in remote:
                    futures[i] = coord.submit(
                        self._remote_chunk(
                            job,
                            i,
                            owners[i] - 1,
                            in_descs[i],
                            out_descs[i],
                            raw_shape(i),
                            dtype,
                            timeout,
                        )
                    )
            asm = vae_plan.Assembler(plan, out, blend_fn, finalize_fn)
            local_s = wait_s = assemble_s = 0.0
            for i, (a, e) in enumerate(plan.spans):
                if interrupt is not None and interrupt():
                    raise VaeSplitInterrupted(f"VAE decode interrupted before chunk {i}")
                t = time.perf_counter()
                if owners[i] == 0:
                    raw = decode_local(z_padded[:, :, a:e])
                    took = time.perf_counter() - t
                    local_s += took
                    chunks.append({"index": i, "rank": 0, "decode_s": round(took, 4)})
                else:
                    [(res, host, fetch_s)] = self.wait(
                        [futures[i]],
                        timeout,
                        f"waiting for chunk {i}",
                        interrupt=interrupt,
                        abandon=futures.values(),
                    )
                    if host is None:  # shm: the worker wrote the chunk into the output segment
                        out_desc = out_descs[i]
                        assert out_desc is not None  # no tensor back means an out desc was given
                        host = segs[1].tensor(out_desc)
                    raw = host.to(dev0, copy=True)
                    waited = time.perf_counter() - t
                    wait_s += waited
                    moved += res.nbytes
                    chunks.append(
                        {
                            "index": i,
                            "rank": owners[i],
                            "decode_s": round(res.seconds, 4),
                            "copy_s": round(res.copy_s + fetch_s, 4),
                            "waited_s": round(waited, 4),
                            "bytes": res.nbytes,
                        }
                    )
                t = time.perf_counter()
                asm.add(raw)
                del raw
                assemble_s += time.perf_counter() - t
        except BaseException:
            self.abandon(futures.values())
            raise
        finally:
            self._drop_job(job)
            for seg in segs:
                seg.close()
                seg.unlink()
        record = {
            "at": now_iso(),
            "job": job,
            "T": plan.T,
            "chunks": plan.num_chunks,
            "ranks": self.ranks,
            "devices": list(self.devices),
            "transport": transport,
            "dtype": dtype_name(dtype),
            "chunks_per_rank": [owners.count(r) for r in range(self.ranks)],
            "dropped_ranks": [r for r in range(self.ranks) if r not in active],
            "probe_ms": round(probe_ms, 1),
            "wall_s": round(time.perf_counter() - t_start, 4),
            "load_s": round(t_load, 4),
            "local_decode_s": round(local_s, 4),
            "wait_s": round(wait_s, 4),
            "assemble_s": round(assemble_s, 4),
            "moved_bytes": moved,
            "per_chunk": chunks,
        }
        self.last_record = record
        log.info(
            "decoded T=%d: %d chunks on %d ranks %s (%s), %.2f s: own decode %.2f s, waited %.2f s "
            "for workers, blend/write %.2f s, %.1f MiB moved",
            plan.T,
            plan.num_chunks,
            self.ranks,
            record["chunks_per_rank"],
            transport,
            record["wall_s"],
            local_s,
            wait_s,
            assemble_s,
            moved / 2**20,
        )
        return record

    def _exact_ranks(
        self,
        z_padded: torch.Tensor,
        plan: vae_plan.ChunkPlan,
        spec: DecoderSpec,
        decode_local: Callable[[torch.Tensor], torch.Tensor],
        interrupt: Callable[[], bool] | None,
        timeout: float,
    ) -> tuple[list[int], float]:
        """The ranks (0 first) whose decode equals rank 0's for every chunk shape of ``plan``, after
        probing the ranks without a verdict (``h3ms_async.vae.exactness``), and the probe's
        milliseconds (0: all known)."""
        dtype = z_padded.dtype
        shapes = sorted({tuple(z_padded[:, :, a:e].shape) for a, e in plan.spans})
        pids = self.pool.worker_pids()
        keys = {
            (r, s): exactness.verdict_key(r, self.devices, dtype, s, spec.key, pids[r - 1])
            for r in range(1, self.ranks)
            for s in shapes
        }
        t = time.perf_counter()
        dev0 = z_padded.device
        outcomes: list[exactness.Outcome] = []
        for shape in shapes:
            todo = [r for r in range(1, self.ranks) if exactness.known(keys[(r, shape)]) is None]
            if not todo:
                continue
            first = self._probe(shape, dtype, todo, decode_local, dev0, interrupt, timeout)
            again = [o.rank for o in first if not o.equal]
            if again:
                # a kernel's first call in a fresh process may differ from its later ones and the
                # real chunks come after the probe: a rank is judged by its second decode
                redo = self._probe(shape, dtype, again, decode_local, dev0, interrupt, timeout)
                by_rank = {o.rank: o for o in redo}
                first = [
                    o
                    if o.equal
                    else replace(
                        by_rank[o.rank],
                        retried=True,
                        probe_ms=o.probe_ms + by_rank[o.rank].probe_ms,
                    )
                    for o in first
                ]
            outcomes += first
        differing = {o.rank for o in outcomes if not o.equal} | {
            r for (r, _s), key in keys.items() if exactness.known(key) is False
        }
        if outcomes:
            shards = [
                vae_plan.deal(plan.num_chunks, self.ranks).count(r) for r in range(self.ranks)
            ]
            exactness.settle(
                outcomes, keys, self.devices, dtype, shards, self.ranks - 1 - len(differing)
            )
            log.info(
                "exactness probe: %d rank(s) x %d chunk shape(s) in %.0f ms",
                len({o.rank for o in outcomes}),
                len({o.shape for o in outcomes}),
                (time.perf_counter() - t) * 1000,
            )
        active = [r for r in range(self.ranks) if r not in differing]
        return active, (time.perf_counter() - t) * 1000 if outcomes else 0.0

    def _probe(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        ranks: list[int],
        decode_local: Callable[[torch.Tensor], torch.Tensor],
        dev0: torch.device,
        interrupt: Callable[[], bool] | None,
        timeout: float,
    ) -> list[exactness.Outcome]:
        """``ranks`` and rank 0 decode the probe latent of ``shape`` at once; one outcome per
        rank."""
        t = time.perf_counter()
        z = exactness.probe_latent(shape, dtype)
        seg = Segment.create(slot_bytes(dtype_name(dtype), list(shape)), "vae_probe")
        futs: list[cf.Future] = []
        try:
            desc = Arena(seg).alloc(dtype_name(dtype), list(shape))
            seg.tensor(desc).copy_(z)
            coord = get_coordinator()
            futs = [
                coord.submit(self.pool.request(r - 1, vae_protocol.VaeProbe(z=desc), timeout))
                for r in ranks
            ]
            ref = vae_protocol.chunk_digest(decode_local(z.to(dev0)))
            results = self.wait(
                futs, timeout, f"the exactness probe of a {list(shape)} chunk", interrupt=interrupt
            )
        except BaseException:
            self.abandon(futs)
            raise
        finally:
            seg.close()
            seg.unlink()
        ms = (time.perf_counter() - t) * 1000
        return [
            exactness.Outcome(r, self.devices[r], shape, res.digest == ref, ms)
            for r, res in zip(ranks, results)
        ]

    def _output_segment(
        self, remote: list[int], raw_shape: Callable[[int], list[int]], dtype: torch.dtype
    ) -> tuple[str, Segment | None]:
        """``(transport, segment)``: one segment for every remote chunk's output, or None for the
        socket path."""
        choice = config.VAE_TRANSPORT.get()
        if choice == "socket":
            return "socket", None
        total = sum(slot_bytes(dtype_name(dtype), raw_shape(i)) for i in remote)
        try:
            return "shm", Segment.create(total, "vae_out")
        except ShmError as exc:
            if choice == "shm":
                raise VaeSplitError(
                    f"{TRANSPORT_ENV}=shm but the chunk outputs do not fit: {exc}"
                ) from None
            if not self._warned_socket:
                log.warning(
                    "decoded chunks return over the worker sockets instead of shared memory "
                    "(slower, still exact): %s",
                    exc,
                )
                self._warned_socket = True
            return "socket", None

    async def _remote_chunk(
        self,
        job: int,
        i: int,
        worker: int,
        z_desc: TensorDesc,
        out_desc: TensorDesc | None,
        shape: list[int],
        dtype: torch.dtype,
        timeout: float,
    ) -> tuple[vae_protocol.VaeChunkDone, torch.Tensor | None, float]:
        """The worker's chunk answer, the chunk itself when it came over the socket (else None: it
        is in ``out_desc``), and the seconds its fetch took."""
        res = await self.pool.request(
            worker, vae_protocol.VaeChunk(job=job, index=i, z=z_desc, out=out_desc), timeout
        )
        assert isinstance(res, vae_protocol.VaeChunkDone)  # decoded as the request's ANSWER
        if res.shape != list(shape) or res.dtype != dtype_name(dtype):
            raise VaeSplitError(
                f"worker rank {worker + 1} decoded chunk {i} as {res.dtype} {res.shape}; expected "
                f"{dtype_name(dtype)} {shape} (does it run another ComfyUI?)"
            )
        if out_desc is not None:
            return res, None, 0.0
        t = time.perf_counter()
        host = torch.empty(res.nbytes, dtype=torch.uint8)
        # the bytes go straight into the chunk's memory (a bytearray for torch.frombuffer would copy
        # each piece twice)
        view = host.numpy().data
        piece = vae_protocol.FETCH_PIECE_BYTES
        for off in range(0, res.nbytes, piece):
            n = min(piece, res.nbytes - off)
            got = await self.pool.request(
                worker, vae_protocol.VaeFetch(job=job, index=i, off=off, n=n), timeout
            )
            assert isinstance(got, vae_protocol.VaeFetched)  # decoded as the request's ANSWER
            view[off : off + n] = got.data
        return res, host.view(dtype).view(shape), time.perf_counter() - t

    async def _ensure_loaded(self, spec: DecoderSpec) -> None:
        async with self._load_lock:
            await self._load(spec)

    async def _load(self, spec: DecoderSpec) -> None:
        await self.pool.start()
        if self._loaded_key == spec.key and self._loaded_starts == self.pool.starts:
            return
        t = time.perf_counter()
        # A thread: copying gigabytes must not stall the coordinator loop (other pools' heartbeats
        # run on it).
        store = await asyncio.get_running_loop().run_in_executor(
            None, fill, spec.key, 1, lambda _i: spec.read_tensors()
        )
        try:
            load = vae_protocol.VaeLoad(
                manifest=store.manifest[0],
                key=repr(spec.key),
                arch=spec.arch,
                dtype=spec.dtype,
                comfy=spec.comfy,
            )
            await self.pool.all([load] * (self.ranks - 1), self.pool.start_timeout)
        finally:
            store.release()
        self._loaded_key, self._loaded_starts = spec.key, self.pool.starts
        log.info(
            "VAE decoder shipped to %d worker(s): %.1f MiB in %.2f s (key %s)",
            self.ranks - 1,
            store.nbytes / 2**20,
            time.perf_counter() - t,
            spec.key,
        )

    def _drop_job(self, job: int) -> None:
        if not self.pool.running:
            return

        async def drop() -> None:
            await asyncio.gather(
                *(
                    self.pool.request(r, vae_protocol.VaeDrop(job=job), 30.0)
                    for r in range(self.ranks - 1)
                ),
                return_exceptions=True,
            )

        try:
            get_coordinator().run(drop(), 35.0, "ending the VAE decode")
        except Exception as exc:  # noqa: BLE001 - a dead worker is reported by the decode itself
            log.debug("vae_drop after job %d: %s", job, exc)

    # -- lifecycle ---------------------------------------------------------------------------------
    def _drop_resident(self) -> None:
        # The workers took their decoder with them: the next decode ships it again.
        self._loaded_key = None

    def snapshot(self) -> dict:
        """The status route's view of this engine."""
        return {
            "devices": list(self.devices),
            "weights": "loaded" if self._loaded_key else "none",
            "key": [str(k) for k in self._loaded_key] if self._loaded_key else None,
            "running": self._running,
            "decodes": self._jobs,
            "last_decode": self.last_record,
        }


# -- the rank plan ---------------------------------------------------------------------------------
RANK_MAP_ENV = config.VAE_RANK_MAP.name
#: The rank maps a VAE split obeys, first set wins: its own, then the DiT split's (so a test that
#: sets only the DiT's map splits the decode too).  Both replace the GPU plan, as ``H3MS_RANK_MAP``
#: does for the DiT.
FORCING_VARS = (config.VAE_RANK_MAP, config.RANK_MAP)


def forced_devices(vae_device: torch.device) -> tuple[list[str], str] | None:
    """``(ranks, "VAR=value")`` of the first set rank map of :data:`FORCING_VARS` (None when neither
    is set); its rank 0 must be the VAE's device."""
    var = next((v for v in FORCING_VARS if v.is_set()), None)
    if var is None:
        return None
    spec = var.raw()
    devices = var.get(rank_map)
    here = "cpu" if vae_device.type == "cpu" else f"cuda:{vae_device.index or 0}"
    if devices[0] != here:
        fix = (
            f"start the map with {here}"
            if var is config.VAE_RANK_MAP
            else (
                f"set {RANK_MAP_ENV} to the VAE's ranks (it wins over {var.name}), starting with "
                f"{here}"
            )
        )
        raise GPUSelectionError(
            f"{var.name}={spec}: rank 0 is {devices[0]} but the VAE decodes on {here}; {fix}"
        )
    return devices, f"{var.name}={spec}"


# -- engine registry -------------------------------------------------------------------------------
ENGINES: EngineRegistry[VaeSplitEngine] = EngineRegistry(
    "vae",
    "VAE workers",
    {
        # rank 0 is this process: the workers are ranks 1..N-1
        "vae_workers": lambda live: [
            {**w, "rank": w["rank"] + 1} for e in live if e.pool.running for w in e.pool.snapshot()
        ],
        "vae_split": lambda live: {"engines": [e.snapshot() for e in live]},
    },
    get_hub,
)


def get_vae_engine(devices: Sequence[str]) -> VaeSplitEngine:
    """The engine for this rank map (made once); an engine for another map is released first."""
    return ENGINES.get(tuple(devices), lambda: VaeSplitEngine(devices))


def release_vae_engines(force: bool = False) -> tuple[int, int]:
    """Release every VAE engine that is not decoding (all of them with ``force``); returns
    (released, busy)."""
    return ENGINES.release_all(force)


def live_vae_engines() -> list[VaeSplitEngine]:
    """Every VAE engine alive in this process."""
    return ENGINES.live()
