"""H3 Attention Parallel, coordinator side: one attention call's heads split across the model's
device and helpers.

The model stays whole on its device (rank 0 of the plan); only attention moves.  Per call
(docs/attention_parallel.md):

1. the caller has quantized Q/K/V once, for all heads, with comfy-kitchen
   (``prequantize_int8_attention``);
2. the heads are split: at a call shape's first call by shares (``plans.partition``, largest
   remainder); from then on by the split that minimises the predicted critical path
   (``attention_schedule.best_split``), from the per-head compute times and link rates measured in
   that first call (with helpers already running) — the model GPU pays no transfer, so it takes more
   heads; the helpers keep their shares among themselves;
3. each helper's heads are cut into pieces of at most ``chunk_heads`` heads
   (``attention_schedule.pieces``); the pieces are staged round robin over the helpers into their
   slots: one shm segment (registered with CUDA, transport ``host``) or a buffer per helper in the
   model GPU's memory that the helper opened by CUDA IPC (``cuda_ipc``); a piece's ``attn_call``
   goes out the moment it is staged, and the helper pipelines its pieces (copy in, attention, copy
   out on three streams);
4. rank 0 attends its own range meanwhile (on CUDA on the caller's stream, concurrently with the
   copies; with CUDA IPC after the staging, which is then a copy inside the model GPU that would
   otherwise queue behind it);
5. each helper writes its BF16 (input-dtype) result into the piece's output slot; rank 0 copies each
   one into the right head slots of the output as soon as that piece is answered, while the rest
   still compute.

Heads are independent and the quantization happened once on the full tensors, so the result equals
the unsplit call bit for bit, whatever the split.  The engine owns its :class:`WorkerPool` (one
helper process per helper device) and its buffers; a helper that dies or errs fails the call with
its last log lines, and the call has a deadline.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

import torch

from h3ms_async.attention import schedule as attention_schedule
from h3ms_async.attention.buffers import Buffers, IpcBuffers, ShmBuffers
from h3ms_async.log import get_logger
from h3ms_async.runtime import plans
from h3ms_async.runtime.coordinator import get_coordinator
from h3ms_async.runtime.engines import Engine, EngineRegistry
from h3ms_async.runtime.pool import WorkerPool
from h3ms_async.status.hub import get_hub, record_verdict
from h3ms_async.status.records import now_iso
from workers.attention import ops as attn_ops
from workers.attention import protocol as attn_protocol
from workers.runtime import cuda_ipc

log = get_logger("AttentionParallel")

#: Calls kept per engine for the status route and the panel.
RECENT_CALLS = 32
#: How slices and results travel: through shared memory, or device to device by CUDA IPC (CUDA
#: devices only).
TRANSPORTS = ("host", "cuda_ipc")
#: Heads per piece a helper's range is cut into (0: one piece per helper).  Small pieces let a
#: helper start after its first piece is staged and let results come back while it computes; the
#: benchmark measures the cost of small slices (``bench attention --chunk-heads``).
CHUNK_HEADS = 2


class AttentionParallelError(RuntimeError):
    """A parallel attention call failed (a helper died, erred or missed the deadline); the message
    says which."""


@dataclass
class _Call:
    """One call in flight: its pieces (``attention_schedule.pieces``), rank 0's slice, the pieces'
    slices, the output, and per piece the coordinator's stage / take-back seconds, when it was sent
    and answered, and the helper's answer."""

    plan: list[tuple[int, int, int]]
    bounds: list[int]
    local: dict[str, torch.Tensor]
    slices: list[dict[str, torch.Tensor]]
    fields: dict
    out: torch.Tensor
    stage_s: list[float] = field(default_factory=list)
    return_s: list[float] = field(default_factory=list)
    sent: list[float] = field(default_factory=list)
    answered: list[float] = field(default_factory=list)
    answers: list[attn_protocol.AttnPiece | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.plan)
        self.stage_s, self.return_s, self.sent, self.answered = (
            [0.0] * n,
            [0.0] * n,
            [0.0] * n,
            [0.0] * n,
        )
        self.answers = [None] * n


class _HelperTotals(TypedDict):
    """One helper's pieces added up (:meth:`AttentionParallelEngine._result`)."""

    compute_s: float
    compute_span_s: float
    h2d_s: float
    d2h_s: float
    pieces: int
    vram_peak_bytes: int | None
    wall_s: NotRequired[float]


class AttentionParallelEngine(Engine):
    """Head-parallel INT8 attention over ``devices``: ``devices[0]`` is the model's device (this
    process), the rest are helper devices, one worker process each (a device may repeat: logical
    helpers on one GPU).  ``transport`` is one of :data:`TRANSPORTS`; ``cuda_ipc`` needs CUDA
    devices that reach the model's GPU (the node checks).
    ``chunk_heads``: heads per piece of a helper's range (:data:`CHUNK_HEADS`; 0 = one piece per
    helper)."""

    error = AttentionParallelError
    interrupted = AttentionParallelError
    failure_prefix = "attention helper failed: "

    def __init__(
        self,
        devices: Sequence[str],
        shares: Sequence[float] | None = None,
        call_timeout_s: float = 120.0,
        transport: str = "host",
        chunk_heads: int = CHUNK_HEADS,
    ) -> None:
        if len(devices) < 2:
            raise ValueError(
                "devices: attention parallel needs the model's device and at least one helper, "
                f"got {list(devices)!r}"
            )
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r}: use one of {', '.join(TRANSPORTS)}")
        if transport == "cuda_ipc" and not all(str(d).startswith("cuda") for d in devices):
            raise ValueError(
                f"transport cuda_ipc needs CUDA devices, got {list(devices)!r}; use transport host"
            )
        if chunk_heads < 0:
            raise ValueError(
                f"chunk_heads {chunk_heads}: give 0 (one piece per helper) or a positive head count"
            )
        self.devices = list(devices)
        self.chunk_heads = int(chunk_heads)
        self.transport = transport
        self.call_timeout_s = float(call_timeout_s)
        self._buffers: Buffers | None = None
        self._splits: dict[tuple, list[int]] = {}
        self._tuning: dict[tuple, dict] = {}
        #: (shape key, pieces) -> None when measured exact, else why that shape's calls run unsplit
        self._verdicts: dict[tuple, str | None] = {}
        self.shares: tuple[float, ...] | None = None
        self._set_shares(shares)
        self._calls = 0
        self._recent: collections.deque[dict] = collections.deque(maxlen=RECENT_CALLS)
        self._streams: tuple[Any, Any] | None = None
        super().__init__(
            WorkerPool(
                self.devices[1:],
                name="attn",
                program="attention",
                also_visible=[self.devices[0]] if transport == "cuda_ipc" else (),
            ),
            ENGINES,
        )

    def set_shares(self, shares: Sequence[float] | None) -> None:
        """Use ``shares`` (one per device, the model's first; None: equal) from the next call on.
        The helpers hold no state, so they stay; the splits tuned for the old shares are
        forgotten."""
        with self._lock:
            self._set_shares(shares)

    def _set_shares(self, shares: Sequence[float] | None) -> None:
        if shares is not None and len(shares) != len(self.devices):
            raise plans.GPUSelectionError(
                f"shares: {len(shares)} value(s) for {len(self.devices)} device(s); give one share "
                "per device, the model's first"
            )
        new = tuple(float(s) for s in shares) if shares else None
        if new != self.shares:
            self.shares = new
            self._splits.clear()
            self._tuning.clear()

    def head_bounds(self, heads: int) -> list[int]:
        """Cumulative head bounds of a shape's first call, one range per device (largest remainder
        by shares; ties to later devices)."""
        if heads < len(self.devices):
            raise AttentionParallelError(
                f"cannot split {heads} attention heads over {len(self.devices)} devices; use at "
                f"most {heads}"
            )
        return plans.partition(heads, self.shares or [1.0] * len(self.devices), "attention heads")

    def split_for(self, pq: Any) -> list[int]:
        """The head bounds the next call of ``pq``'s shape runs: the tuned split once measured, else
        :meth:`head_bounds`."""
        return self._splits.get(_shape_key(pq)) or self.head_bounds(pq.q.shape[1])

    # -- one call ----------------------------------------------------------------------------------
    def attend(self, pq: Any) -> torch.Tensor:
        """``int8_attention_from_prequantized(pq)`` with the heads split over the devices: ``[B, H,
        Sq, D]`` in ``pq.input_dtype`` on ``pq.q``'s device, equal to the unsplit call."""
        fields = attn_ops.meta(pq)
        b, heads, sq, _ = pq.q.shape
        bounds = self.split_for(pq)
        device = pq.q.device
        with self.job():
            t_start = time.perf_counter()
            starts = self.pool.starts
            # a helper that died since the last call restarts the pool (helpers hold no state)
            self.run(self.pool.start(), self.pool.start_timeout + 10.0, "starting helpers")
            plan = attention_schedule.pieces(bounds, self.chunk_heads)
            if self._measure(pq, plan, bounds) is not None:
                return ck_attention_unsplit(pq)
            slices = [attn_ops.head_slice(pq, h0, h1) for _, h0, h1 in plan]
            buf = self._buffers_for(pq, plan, slices, device)
            call = _Call(
                plan,
                bounds,
                attn_ops.head_slice(pq, bounds[0], bounds[1]),
                slices,
                dict(fields),
                torch.empty(
                    (b, heads, sq, fields["original_head_dim"]), dtype=pq.input_dtype, device=device
                ),
            )
            self._calls += 1
            local_s = (self._call_cuda if device.type == "cuda" else self._call_cpu)(buf, call)
            result = self._result(call, local_s)
            self._record(result, bounds, sq, heads, time.perf_counter() - t_start)
            key = _shape_key(pq)
            if key not in self._splits and self.pool.starts == starts:
                # timings of a call with warm helpers
                self._tune(key, result, bounds)
            return call.out

    def _measure(self, pq: Any, plan: list[tuple[int, int, int]], bounds: list[int]) -> str | None:
        """Before a shape's pieces are first used: every helper probes its head ranges on its own
        device while the model's device probes its own range (``attn_ops.probe_ranges``); a range
        that differs from the whole call, or a whole call with other bits on a helper's device,
        makes that shape run unsplit (one warning). Returns None when exact, else why not (cached
        per shape and pieces)."""
        key = (_shape_key(pq), tuple(plan))
        if key in self._verdicts:
            return self._verdicts[key]
        b, heads, sq, _ = pq.q.shape
        shape = (int(b), int(heads), int(sq), int(pq.original_head_dim))
        dtype = str(pq.input_dtype).removeprefix("torch.")
        kv = int(pq.k.shape[2])
        futs = [
            get_coordinator().submit(
                self.pool.request(
                    r - 1,
                    attn_protocol.AttnProbe(
                        shape=shape,
                        kv_len=kv,
                        dtype=dtype,
                        ranges=[(h0, h1) for rr, h0, h1 in plan if rr == r],
                    ),
                    self.call_timeout_s,
                )
            )
            for r in range(1, len(self.devices))
        ]
        local = attn_ops.probe_ranges(
            shape, kv, pq.input_dtype, [(bounds[0], bounds[1])], pq.q.device
        )
        reports = [
            local,
            *self.wait(
                futs, self.call_timeout_s + 5.0, "probing the attention helpers' head ranges"
            ),
        ]
        ranges = [[(bounds[0], bounds[1])]] + [
            [(h0, h1) for rr, h0, h1 in plan if rr == r] for r in range(1, len(self.devices))
        ]
        why = None
        for rep, rr in zip(reports, ranges):
            bad = next(
                ((rng, d) for rng, ok, d in zip(rr, rep.exact, rep.max_abs_diff) if not ok), None
            )
            if bad is not None:
                why = (
                    f"heads [{bad[0][0]}, {bad[0][1]}) of {heads} at {sq} tokens differ from the "
                    f"whole call on {rep.fingerprint['device']} (max abs difference {bad[1]:g})"
                )
            elif rep.digest != local.digest:
                why = (
                    f"the whole call computes other bits on {rep.fingerprint['device']} than on "
                    f"{local.fingerprint['device']}"
                )
            if why is not None:
                break
        self._verdicts[key] = why
        devices = ", ".join(dict.fromkeys(rep.fingerprint["device"] for rep in reports))
        ms = max(rep.ms for rep in reports)
        record_verdict(
            "attention",
            "attention",
            devices,
            dtype,
            "x".join(map(str, shape)),
            [hi - lo for lo, hi in itertools.pairwise(bounds)],
            "exact" if why is None else "unsplit",
            "measured exact" if why is None else f"{why}; this shape's calls run unsplit",
            ms,
        )
        if why is None:
            log.info(
                "attention parallel: heads %s at %d tokens measured exact on %s (probe %.0f ms)",
                [hi - lo for lo, hi in itertools.pairwise(bounds)],
                sq,
                devices,
                ms,
            )
        else:
            log.warning(
                "H3 Attention Parallel: %s; calls of this shape run unsplit on the model's GPU", why
            )
        return why

    def _submit(self, buf: Buffers, call: _Call, p: int) -> cf.Future[attn_protocol.AttnPiece]:
        """Send piece ``p`` to its helper now."""
        r, h0, _ = call.plan[p]
        first = min(h for rr, h, _ in call.plan if rr == r)
        msg = attn_protocol.AttnCall(
            job=self._calls, meta=call.fields, first=h0 == first, **buf.fields(p)
        )
        call.sent[p] = time.perf_counter()
        return get_coordinator().submit(self._piece(r, msg))

    async def _piece(self, r: int, msg: attn_protocol.AttnCall) -> attn_protocol.AttnPiece:
        """Helper ``r``'s answer to one piece."""
        got = await self.pool.request(r - 1, msg, self.call_timeout_s)
        assert isinstance(got, attn_protocol.AttnPiece)  # the channel decodes msg.ANSWER
        return got

    def _gather(
        self,
        futs: list[cf.Future[attn_protocol.AttnPiece]],
        call: _Call,
        on_result: Callable[[int], None],
    ) -> None:
        """Each piece's answer (``futs[p]`` is piece p's) as it comes into ``call.answers``,
        ``on_result(p)`` taking it in at once; any failure or the deadline aborts every helper and
        fails the call."""

        def answer(p: int, result: attn_protocol.AttnPiece) -> None:
            call.answers[p] = result
            call.answered[p] = time.perf_counter()
            on_result(p)

        self.wait(
            futs,
            self.call_timeout_s + 5.0,
            f"attention call on helpers {','.join(self.devices[1:])}",
            on_result=answer,
        )

    def _call_cpu(self, buf: Buffers, call: _Call) -> float:
        """One call with the model on the CPU; returns rank 0's own seconds."""
        futs: list[cf.Future[attn_protocol.AttnPiece]] = []
        try:
            for p in range(len(call.plan)):  # each piece goes out as soon as it is staged
                t = time.perf_counter()
                for name, dst in buf.inputs(p).items():
                    dst.copy_(call.slices[p][name])
                call.stage_s[p] = time.perf_counter() - t
                futs.append(self._submit(buf, call, p))
            t = time.perf_counter()
            call.out[:, : call.bounds[1]].copy_(attn_ops.attend(call.local, call.fields))
            local_s = time.perf_counter() - t
        except BaseException:
            self.abandon(futs)
            raise

        def take(p: int) -> None:
            t0 = time.perf_counter()
            _, h0, h1 = call.plan[p]
            call.out[:, h0:h1].copy_(buf.output(p))
            call.return_s[p] = time.perf_counter() - t0

        self._gather(futs, call, take)
        return local_s

    def _side_streams(self, device: torch.device) -> tuple[Any, Any]:
        """The staging and take-back streams, at a higher priority than the caller's: their copies
        must not wait for rank 0's attention, which fills the GPU."""
        if self._streams is None or self._streams[0].device != device:
            self._streams = (
                torch.cuda.Stream(device, priority=-1),
                torch.cuda.Stream(device, priority=-1),
            )
        return self._streams

    def _call_cuda(self, buf: Buffers, call: _Call) -> float:
        """One call with the model on a GPU; returns rank 0's own seconds (event-timed)."""
        device = call.out.device
        main = torch.cuda.current_stream(device)
        copy, back = self._side_streams(device)
        ready = torch.cuda.Event()
        ready.record(main)
        copy.wait_event(ready)
        back.wait_event(ready)
        marks = []
        # Stage every piece in order on a side stream, concurrently with rank 0's own heads on the
        # caller's.
        with torch.cuda.stream(copy):
            for p in range(len(call.plan)):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(copy)
                for name, dst in buf.inputs(p).items():
                    dst.copy_(call.slices[p][name], non_blocking=True)
                e1.record(copy)
                marks.append((e0, e1))
        if self.transport == "cuda_ipc":
            # Staging into IPC buffers is a copy inside this GPU (about a millisecond); issued next
            # to rank 0's attention it queues behind that kernel and holds every helper back for its
            # whole duration (measured on the H200 as 2-3 GB/s of "staging").  So rank 0's heads
            # start once the pieces are out.
            main.wait_event(marks[-1][1])
        local = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        local[0].record(main)
        call.out[:, : call.bounds[1]].copy_(attn_ops.attend(call.local, call.fields))
        local[1].record(main)
        back_marks: dict[int, tuple] = {}

        def take(p: int) -> None:
            _, h0, h1 = call.plan[p]
            with torch.cuda.stream(back):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(back)
                call.out[:, h0:h1].copy_(buf.output(p), non_blocking=True)
                e1.record(back)
            back_marks[p] = (e0, e1)

        futs: list[cf.Future[attn_protocol.AttnPiece]] = []
        try:
            for p, (_, staged) in enumerate(marks):
                staged.synchronize()
                futs.append(self._submit(buf, call, p))
            self._gather(futs, call, take)
        except BaseException:
            self.abandon(futs)
            main.synchronize()
            raise
        main.wait_stream(back)
        main.synchronize()
        call.stage_s[:] = [a.elapsed_time(b) / 1e3 for a, b in marks]
        call.return_s[:] = [
            back_marks[p][0].elapsed_time(back_marks[p][1]) / 1e3 for p in range(len(call.plan))
        ]
        return local[0].elapsed_time(local[1]) / 1e3

    def _result(self, call: _Call, local_s: float) -> dict:
        """Per helper (its pieces added up): stage / copy in / compute / copy out / take-back
        seconds, bytes, its attention span (first piece's attention start to last piece's end: less
        than the compute seconds added up where consecutive pieces overlap on the helper's two
        compute streams) and its wall time from its first piece sent to its last answer."""
        n = len(self.devices) - 1
        helpers: list[_HelperTotals] = [
            {
                "compute_s": 0.0,
                "compute_span_s": 0.0,
                "h2d_s": 0.0,
                "d2h_s": 0.0,
                "pieces": 0,
                "vram_peak_bytes": None,
            }
            for _ in range(n)
        ]
        stage_s, return_s, staged, returned = [0.0] * n, [0.0] * n, [0] * n, [0] * n
        first_sent, last_answer = [float("inf")] * n, [0.0] * n
        for p, (r, h0, h1) in enumerate(call.plan):
            i, ans, h = r - 1, call.answers[p], helpers[r - 1]
            assert ans is not None  # _gather took in every piece's answer or raised
            h["compute_s"] += ans.compute_s
            h["h2d_s"] += ans.h2d_s
            h["d2h_s"] += ans.d2h_s
            h["compute_span_s"] = max(h["compute_span_s"], ans.compute_end_s)
            h["pieces"] += 1
            if ans.vram_peak_bytes is not None:
                h["vram_peak_bytes"] = max(h["vram_peak_bytes"] or 0, ans.vram_peak_bytes)
            stage_s[i] += call.stage_s[p]
            return_s[i] += call.return_s[p]
            staged[i] += sum(t.numel() * t.element_size() for t in call.slices[p].values())
            returned[i] += call.out[:, h0:h1].numel() * call.out.element_size()
            first_sent[i] = min(first_sent[i], call.sent[p])
            last_answer[i] = max(last_answer[i], call.answered[p])
        for i, h in enumerate(helpers):
            h["wall_s"] = last_answer[i] - first_sent[i]
        return {
            "local_s": local_s,
            "stage_s": stage_s,
            "return_s": return_s,
            "staged": staged,
            "returned": returned,
            "helpers": helpers,
        }

    def pipeline(self) -> attention_schedule.Pipeline:
        """This engine's schedule as :mod:`attention_schedule` models it."""
        return attention_schedule.Pipeline(
            self.chunk_heads, local_after_stage=self.transport == "cuda_ipc"
        )

    # -- the split ---------------------------------------------------------------------------------
    def _tune(self, key: tuple, result: dict, bounds: list[int]) -> None:
        """Choose this shape's split from this call's own timings (see ``attention_schedule``)."""
        sizes = [b - a for a, b in itertools.pairwise(bounds)]
        helpers = result["helpers"]
        # a helper's attention time is its span where its pieces overlapped, its pieces added up
        # where it waited for input between them (the span then holds idle time the schedule model
        # accounts for separately)
        per_head = [result["local_s"] / sizes[0]] + [
            min(h["compute_s"], h["compute_span_s"]) / s for h, s in zip(helpers, sizes[1:])
        ]
        in_bytes, out_bytes = sum(result["staged"]), sum(result["returned"])
        legs = attention_schedule.Legs(
            stage=sum(result["stage_s"]) / in_bytes,
            helper_in=sum(h["h2d_s"] for h in helpers) / in_bytes,
            helper_out=sum(h["d2h_s"] for h in helpers) / out_bytes,
            ret=sum(result["return_s"]) / out_bytes,
        )
        heads = sum(sizes)
        best = attention_schedule.best_split(
            heads,
            per_head,
            (self.shares or [1.0] * len(sizes))[1:],
            in_bytes / sum(sizes[1:]),
            out_bytes / sum(sizes[1:]),
            legs,
            self.pipeline(),
        )
        self._splits[key] = [0] + [sum(best["heads"][: i + 1]) for i in range(len(sizes))]
        self._tuning[key] = {
            "shape": list(key[0]),
            "measured_heads": sizes,
            "heads": best["heads"],
            "chunk_heads": self.chunk_heads,
            "per_head_s": per_head,
            "s_per_byte": vars(legs),
            "predicted_s": best["total_s"],
        }
        log.info(
            "attention split for %s: heads %s (was %s, pieces of <= %s heads); predicted %.1f ms "
            "from measured per-head %s ms and links %s GB/s",
            list(key[0]),
            best["heads"],
            sizes,
            self.chunk_heads or "all",
            best["total_s"] * 1e3,
            [round(c * 1e3, 2) for c in per_head],
            {k: round(1e-9 / v, 1) if v > 0 else "in place" for k, v in vars(legs).items()},
        )

    # -- buffers -----------------------------------------------------------------------------------
    def _buffers_for(
        self,
        pq: Any,
        plan: list[tuple[int, int, int]],
        slices: list[dict[str, torch.Tensor]],
        device: torch.device,
    ) -> Buffers:
        # the call's own slices: with batch > 1 a v slice is a copy, so slicing again just for the
        # shapes would copy every helper's v twice per call
        in_specs = [{name: (t.dtype, tuple(t.shape)) for name, t in s.items()} for s in slices]
        b, _, sq, _ = pq.q.shape
        out_specs = [
            (pq.input_dtype, (b, h1 - h0, sq, int(pq.original_head_dim))) for _, h0, h1 in plan
        ]
        key = (repr(plan), repr(in_specs), repr(out_specs), str(device))
        if self._buffers is not None and self._buffers.key == key:
            return self._buffers
        self._drop_buffers()
        if self.transport == "cuda_ipc":
            why = cuda_ipc.unavailable(str(device))
            if why:
                raise AttentionParallelError(f"transport cuda_ipc: {why}; or use transport host")
            index = [self.pool.local_index(r, str(device)) for r in range(len(self.devices) - 1)]
            self._buffers = IpcBuffers(
                key, in_specs, out_specs, device, [r - 1 for r, _, _ in plan], index
            )
        else:
            self._buffers = ShmBuffers(key, in_specs, out_specs, device)
        return self._buffers

    def _drop_buffers(self) -> None:
        if self._buffers is not None:
            self._buffers.close()
            self._buffers = None

    # -- records, status, release ------------------------------------------------------------------
    def _record(
        self, result: dict, bounds: list[int], tokens: int, heads: int, wall: float
    ) -> None:
        ranks = [
            {
                "rank": 0,
                "device": self.devices[0],
                "heads": [bounds[0], bounds[1]],
                "transport": "local",
                "compute_s": result["local_s"],
                "compute_span_s": result["local_s"],
                "stage_s": 0.0,
                "h2d_s": 0.0,
                "d2h_s": 0.0,
                "return_s": 0.0,
                "wall_s": result["local_s"],
                "pieces": 1,
                "vram_peak_bytes": None,
            }
        ]
        for r, res in enumerate(result["helpers"], start=1):
            ranks.append(
                {
                    "rank": r,
                    "device": self.devices[r],
                    "heads": [bounds[r], bounds[r + 1]],
                    "transport": self.transport,
                    "stage_s": result["stage_s"][r - 1],
                    **{
                        k: float(res[k])
                        for k in ("compute_s", "compute_span_s", "h2d_s", "d2h_s", "wall_s")
                    },
                    "return_s": result["return_s"][r - 1],
                    "pieces": res["pieces"],
                    "vram_peak_bytes": res["vram_peak_bytes"],
                }
            )
        staged, returned = sum(result["staged"]), sum(result["returned"])
        stage_s, return_s = sum(result["stage_s"]), sum(result["return_s"])
        transfer_s = stage_s + return_s
        rec = {
            "at": now_iso(),
            "call": self._calls,
            "tokens": tokens,
            "heads": heads,
            "transport": self.transport,
            "wall_s": wall,
            "stage_s": stage_s,
            "return_s": return_s,
            "moved_bytes": staged + returned,
            "staged_bytes": staged,
            "returned_bytes": returned,
            "gb_per_s": (staged + returned) / transfer_s / 1e9 if transfer_s > 0 else None,
            "ranks": ranks,
        }
        self._recent.append(rec)
        log.debug(
            "call %d: %d tokens x %d heads on %s in %.1f ms (%d MB moved)",
            self._calls,
            tokens,
            heads,
            ",".join(self.devices),
            wall * 1e3,
            (staged + returned) // 1_000_000,
        )

    def recent_calls(self) -> list[dict]:
        """The last calls' records (oldest first): per device its heads, transport and compute /
        copy seconds."""
        return list(self._recent)

    def snapshot(self) -> dict:
        """This engine for the status route: devices, shares, transport, helpers (worker rows), call
        count, the tuned splits and recent calls."""
        return {
            "devices": list(self.devices),
            "shares": list(self.shares) if self.shares else None,
            "transport": self.transport,
            "running": self._running,
            "calls": self._calls,
            "helpers": self.pool.snapshot(),
            "splits": list(self._tuning.values()),
            "recent_calls": self.recent_calls()[-8:],
        }

    def holds_resident(self) -> bool:
        return self.pool.running or self._buffers is not None

    def _drop_resident(self) -> None:
        self._drop_buffers()


def ck_attention_unsplit(pq: Any) -> torch.Tensor:
    """The whole call on the model's device, as ComfyUI makes it (a shape whose head ranges are not
    exact)."""
    import comfy_kitchen as ck

    return ck.int8_attention_from_prequantized(pq)


def _shape_key(pq: Any) -> tuple:
    """What a tuned split is kept for: the packed shapes and the device."""
    return (tuple(pq.q.shape), tuple(pq.k.shape), str(pq.q.device))


# -- engine registry -------------------------------------------------------------------------------
ENGINES: EngineRegistry[AttentionParallelEngine] = EngineRegistry(
    "attention",
    "attention helpers",
    {
        "attention": lambda live: {"engines": [e.snapshot() for e in live]},
    },
    get_hub,
)


def get_engine(
    devices: Sequence[str], shares: Sequence[float] | None = None, transport: str = "host"
) -> AttentionParallelEngine:
    """The engine for these devices and transport (made once; helpers start on the first call),
    using ``shares``.

    Only the devices and the transport (which GPUs a helper sees) need other helper processes; the
    shares are a per-call setting, changed in place (:meth:`AttentionParallelEngine.set_shares`).
    Engines for other devices or transports are released first: their helpers hold GPU memory."""
    eng = ENGINES.get(
        (tuple(devices), transport),
        lambda: AttentionParallelEngine(devices, shares, transport=transport),
    )
    eng.set_shares(shares)
    return eng


def release_all_engines() -> int:
    """Release every attention-parallel engine; returns how many were released."""
    return ENGINES.release_all()[0]


def live_engines() -> list[AttentionParallelEngine]:
    """Every engine alive in this process (also ones made directly)."""
    return ENGINES.live()
