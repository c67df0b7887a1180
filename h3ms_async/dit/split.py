"""The step driver: runs H3's block stack split across the rank workers, once per denoising step.

Synchronous callers (ComfyUI's prompt thread, the demo) use :class:`SplitEngine`; the engine's work
runs as coroutines on the coordinator loop.  Per step the engine

1. plans token and head ranges (largest remainder by shares, ``plans.make_split_plan``);
2. writes the residual stream and rope table into the step segment, t_emb and any per-token mod rows
   into the small side segment (shm), once;
3. sends ``dit_step`` to every rank (``workers.dit.rank``): each runs all blocks on its shard,
   exchanging through the arena (``exchange="host"``) or torch.distributed (``"nccl"``; gloo on CPU
   ranks);
4. reads the new residual stream back (each rank wrote its own rows) and records a step record for
   the status hub.

Any rank's failure fails the step on every rank at once (``WorkerPool.all``); an interrupt aborts
every rank's waits.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import cast

import msgspec
import torch

from h3ms_async.dit import exactness, speed_model
from h3ms_async.dit.exactness import MIN_SHARD_TOKENS, PlanVerdict
from h3ms_async.dit.reference import DiTConfig
from h3ms_async.dit.sparse import DenseFallback, step_wire
from h3ms_async.dit.step_buffers import StepBuffers, StepBufferSlot
from h3ms_async.log import get_logger
from h3ms_async.observability.records import RankRecord, StepRecord, now_iso
from h3ms_async.observability.status import get_hub, record_verdict
from h3ms_async.runtime import plans
from h3ms_async.runtime.coordinator import get_coordinator
from h3ms_async.runtime.engines import Engine, EngineRegistry
from h3ms_async.runtime.pool import WorkerPool
from h3ms_async.runtime.weight_store import BlockReader, WeightStore, fill
from workers.dit import invariance
from workers.dit import ops as dit_ops
from workers.dit import protocol as dit_protocol
from workers.dit.protocol import Transport
from workers.dit.sparse import SparseConfig

# the node layer's view
from workers.runtime.comfy_host import HEAD_SPLIT_SAFE, ComfyHost, subquad_unchunked  # noqa: F401
from workers.runtime.protocol import DropReleased, TensorDesc
from workers.runtime.shm import dtype_name
from workers.transports.arena import decode_seq
from workers.transports.dist import check_nccl_rank_map

log = get_logger("MultiStream")

#: The node input's exchange choices (:class:`Transport` values; ``nccl`` runs as gloo on CPUs).
EXCHANGES = (Transport.HOST.value, Transport.NCCL.value)
#: Benchmark-only transport: ranks compute their shards without exchanging (wrong output, timing
#: baseline).
BASELINE_EXCHANGE = Transport.NONE.value
#: Host-exchange ops per block (all-gather, all-to-all): a rank's op index / 2 = the blocks it has
#: reached.
EXCHANGE_OPS_PER_BLOCK = 2

#: ``progress(blocks_done, blocks_total)``: called from the caller's thread while a step runs
#: (progress bars).
StepProgress = Callable[[int, int], None]


class SplitError(RuntimeError):
    """A split step failed (a worker died, reported an error or missed its deadline)."""


class SplitInterrupted(SplitError):
    """The caller's interrupt probe turned true; every rank was aborted."""


class SplitUnsafe(SplitError):
    """This step cannot be split bit-exactly on these ranks (the caller should run it unsplit, or
    use fewer ranks).

    ``first`` is True the first time this plan is refused in this process: callers warn then, and
    only then."""

    def __init__(self, message: str, *, first: bool = True) -> None:
        super().__init__(message)
        self.first = first


#: The attention name that means "the parent ComfyUI's selected function"
#: (``SplitOptions.comfy_host``).
COMFY_ATTENTION = "comfy"


@dataclass(frozen=True)
class SplitOptions:
    """What the node (or the CLI) chose.  ``shares`` = relative speed per rank (None: equal).

    Only ``shares``, ``attention`` and ``comfy_host`` need other worker processes
    (:func:`process_key`); exchange, chunks and residency travel with every step, and the RAM
    reserve applies when the store is filled. ``attention="comfy"`` runs ``comfy_host.attention``
    (ComfyUI's selected function) on the ranks; ``sparse`` runs attention through comfy-kitchen's
    sparse kernel where its settings say so (``workers.dit.sparse``).
    ``verify``: the first split step of each prompt also runs unsplit on rank 0's device and is
    compared (``h3ms_async.dit.verify``, dense attention only).  ``head_pieces`` > 1: each rank's
    dense attention runs in that many head pieces, each moved by the all-to-all while the next one
    computes, where the probe measures the pieces exact (``workers.dit.loop``).
    ``gather_overlap``: on dense steps each rank's qkv projection runs on every rank's rows as they
    arrive (its own first), where the probe measures those row ranges exact.  ``pattern``: how
    attention gets its inputs, "gather" (all-gather of the block input), "ulysses" (every rank
    projects every head for its tokens, then an all-to-all of q, k, v; dense attention only) or
    "auto" (the one whose exchange moves fewer bytes at this N and transport,
    ``speed_model.choose_pattern``; gather with sparse attention), fixed when weights load.
    """

    exchange: str = "host"
    exchange_chunks: int = 0
    vram_residency: str = "auto"
    cache_ram_reserve_gb: float = 0.0
    shares: tuple[float, ...] | None = None
    attention: str = "sdpa"
    comfy_host: ComfyHost | None = None
    step_timeout_s: float = 600.0
    exchange_deadline_s: float = 120.0
    verify: bool = False
    sparse: SparseConfig | None = None
    head_pieces: int = 0
    gather_overlap: bool = False
    pattern: str = "gather"

    def __post_init__(self) -> None:
        if self.exchange not in (*EXCHANGES, BASELINE_EXCHANGE):
            raise ValueError(f"exchange={self.exchange!r} is not one of {EXCHANGES}")
        if not 0 <= self.exchange_chunks <= 32:
            raise ValueError(
                f"exchange_chunks={self.exchange_chunks} must be between 0 and 32 (0/1: single "
                "shot)"
            )
        if not 0 <= self.head_pieces <= dit_protocol.MAX_HEAD_PIECES:
            raise ValueError(
                f"head_pieces={self.head_pieces} must be between 0 and "
                f"{dit_protocol.MAX_HEAD_PIECES} (0/1: "
                "attention in one call)"
            )
        if self.pattern not in (*dit_protocol.PATTERNS, "auto"):
            raise ValueError(
                f"pattern={self.pattern!r} is not one of {(*dit_protocol.PATTERNS, 'auto')}"
            )
        if self.pattern == "ulysses" and self.sparse is not None:
            raise ValueError(
                "sparse attention runs with the all-gather pattern (its kernel needs the block "
                "input of every token); use pattern 'gather' or 'auto'"
            )
        if self.vram_residency not in dit_protocol.RESIDENCIES:
            raise ValueError(
                f"vram_residency={self.vram_residency!r} is not one of {dit_protocol.RESIDENCIES}"
            )
        if self.attention not in (*dit_ops.ATTENTION_BACKENDS, COMFY_ATTENTION):
            raise ValueError(
                f"attention={self.attention!r} is not one of {dit_ops.ATTENTION_BACKENDS} or "
                f"{COMFY_ATTENTION!r}"
            )
        if (self.attention == COMFY_ATTENTION) != (self.comfy_host is not None):
            raise ValueError(
                "attention='comfy' and comfy_host go together: the ranks need the parent ComfyUI "
                "to run its attention function"
            )
        if self.cache_ram_reserve_gb < 0:
            raise ValueError(f"cache_ram_reserve_gb={self.cache_ram_reserve_gb} must be >= 0")
        if self.verify and self.sparse is not None:
            raise ValueError(
                "verify compares the split with a dense unsplit step; disconnect sparse_attention "
                "(or turn verify off) to verify this model"
            )
        if self.sparse is not None and not isinstance(self.sparse, SparseConfig):
            raise ValueError(
                f"sparse={self.sparse!r} must be a SparseConfig (SparseSettings.resolve) or None"
            )


@dataclass(frozen=True)
class LoadTimes:
    """Where a weight load's wall time went (``SplitEngine.last_load``): the workers start while
    the store fills, so ``wall_s`` is about ``fill_s + start_wait_s + ranks_load_s``."""

    #: the pool's start (0 when the workers were already up)
    workers_start_s: float
    fill_s: float
    fill_bytes: int
    #: the wait for the workers after the fill (the part of their start the fill did not hide)
    start_wait_s: float
    #: every rank mapping the store and placing its weights (``dit_load``)
    ranks_load_s: float
    wall_s: float

    @property
    def fill_gbps(self) -> float:
        return self.fill_bytes / max(self.fill_s, 1e-9) / 1e9

    def line(self) -> str:
        return (
            f"weights loaded in {self.wall_s:.2f}s: store filled {self.fill_bytes / 1e9:.2f} GB in "
            f"{self.fill_s:.2f}s ({self.fill_gbps:.2f} GB/s), workers started in "
            f"{self.workers_start_s:.2f}s beside it ({self.start_wait_s:.2f}s waited after the "
            f"fill), ranks loaded in {self.ranks_load_s:.2f}s"
        )


@dataclass
class _Loaded:
    store: WeightStore
    config: DiTConfig
    head_bounds: tuple[int, ...]
    compute_dtype: str
    pattern: dit_protocol.Pattern = "gather"
    # the block stack's distinct linears, for the probe (lazily)
    ops: list[dit_protocol.LinearOp] | None = None


class SplitEngine(Engine):
    """One rank map's workers, weight store and step buffers."""

    error = SplitError
    interrupted = SplitInterrupted

    def __init__(self, devices: Sequence[str], options: SplitOptions = SplitOptions()) -> None:
        if not devices:
            raise ValueError(
                "devices: the split needs at least one rank device (e.g. ['cpu','cpu'] or "
                "['cuda:0','cuda:1'])"
            )
        if options.shares is not None and len(options.shares) != len(devices):
            raise plans.GPUSelectionError(
                f"shares: {len(options.shares)} value(s) for {len(devices)} rank(s); give one "
                "share per rank"
            )
        if options.exchange == "nccl" and all(d.startswith("cuda") for d in devices):
            check_nccl_rank_map(list(devices))
        self.devices = list(devices)
        self.options = options
        env = _cpu_thread_env(self.devices)
        if options.comfy_host is not None:
            env.update(options.comfy_host.to_env())
        self._loaded: _Loaded | None = None
        #: The shm buffers steps run in (``h3ms_async/dit/step_buffers.py``).
        self.step_buffers = StepBufferSlot(self._unmap_released)
        self._steps = 0
        self._rank_starts = -1  # pool.starts when the ranks last loaded the weights
        self._sm_counts: list[int | None] = []  # per rank, from dit_load (None on CPU)
        self._fingerprints: list[dict] = []  # per rank, from dit_load (invariance.fingerprint)
        self._verify_due = True  # the next split step is a prompt's first (SplitOptions.verify)
        # per rank, from dit_load: why the sparse kernel cannot run
        self._sparse_kernel: list[str | None] = []
        self._sparse_fallback = DenseFallback()
        self._sparse_ran = False  # a step has sent sparse settings since the last end_sampling
        super().__init__(WorkerPool(self.devices, name="dit", program="dit", env=env), ENGINES)
        #: The last successful step's per-rank answers (rank order), including fields the hub's
        #: step record leaves out (``signals``, ``wall_s``, ``weights``, ``setup_s``, ``tail_s``,
        #: ``cuda_alloc``); benchmarks read it.
        self.last_rank_results: list[dit_protocol.DitStepped] = []
        #: Where the last successful step's wall time went on this side: new step buffers
        #: (``new_buffers``), a new side segment (``new_side``) and their creation (``buffers_s``),
        #: staging the inputs into shm, the ranks' job, queuing the copy back.
        self.last_phases: dict = {}
        #: The last weight load's phases (None until one ran).
        self.last_load: LoadTimes | None = None

    # -- properties --------------------------------------------------------------------------------
    @property
    def ranks(self) -> int:
        return len(self.devices)

    @property
    def weight_state(self) -> str:
        return self._loaded.store.describe() if self._loaded else "empty"

    @property
    def transport(self) -> Transport:
        """The configured transport as it runs here: host, nccl, or gloo (nccl on CPU ranks)."""
        return self._transport(self.options.exchange)

    def _transport(self, exchange: str) -> Transport:
        return Transport(exchange).on(self.devices[0].startswith("cuda"))

    # -- weights -----------------------------------------------------------------------------------
    def load_weights(
        self,
        key: tuple,
        config: DiTConfig,
        block_weights: BlockReader,
        n_blocks: int | None = None,
        *,
        compute_dtype: torch.dtype | None = None,
    ) -> bool:
        """Fill the weight store for ``key`` (no-op when it already holds ``key``) and load every
        rank.

        ``compute_dtype``: the residual stream's dtype (ranks warm their attention up in it before
        the first step); default: the stored norm weights' dtype. Returns whether anything was
        (re)loaded.  Raises ``WeightStoreRefused`` when the RAM reserve forbids it.
        """
        n = config.layers if n_blocks is None else n_blocks
        if self.ranks > config.heads:
            raise plans.GPUSelectionError(
                f"{self.ranks} ranks but the model has only {config.heads} attention heads; use at "
                f"most {config.heads} ranks"
            )
        head_bounds = tuple(
            plans.partition(
                config.heads, self.options.shares or [1.0] * self.ranks, "attention heads"
            )
        )
        pattern = self._pattern(config)
        with self._lock:
            if (
                self._loaded
                and self._loaded.store.key == key
                and self._loaded.head_bounds == head_bounds
                and self._loaded.pattern == pattern
            ):
                return False
            self._drop_store()
            t0 = time.perf_counter()
            starting: list[cf.Future[float]] = []

            def start_workers() -> None:
                # The workers start while the blocks are copied (once the store passed its RAM and
                # /dev/shm checks): a CUDA worker's start takes seconds, a whole H3's fill tens.
                starting.append(get_coordinator().submit(self._start_workers()))

            store = fill(
                key,
                n,
                block_weights,
                reserve_gb=self.options.cache_ram_reserve_gb,
                on_sized=start_workers,
            )
            t_filled = time.perf_counter()
            dtype = compute_dtype or store.block(0)["norm1.weight"].dtype
            self._loaded = _Loaded(store, config, head_bounds, dtype_name(dtype), pattern)
            try:
                started_s = self.wait(
                    starting, self.pool.start_timeout + 30.0, "starting the workers"
                )[0]
                t_started = time.perf_counter()
                self.run(
                    self._load_ranks(), self.options.step_timeout_s, "loading weights on the ranks"
                )
            except BaseException:
                self._drop_store()
                raise
            t_end = time.perf_counter()
            self.last_load = LoadTimes(
                workers_start_s=started_s,
                fill_s=store.fill_seconds,
                fill_bytes=store.nbytes,
                start_wait_s=t_started - t_filled,
                ranks_load_s=t_end - t_started,
                wall_s=t_end - t0,
            )
            log.info("%s", self.last_load.line())
            return True

    async def _start_workers(self) -> float:
        """Start the pool (a no-op when it runs); returns the seconds it took."""
        t = time.perf_counter()
        await self.pool.start()
        return time.perf_counter() - t

    def _pattern(self, config: DiTConfig) -> dit_protocol.Pattern:
        """The pattern to load for: the option's, or for "auto" the one whose exchange moves fewer
        bytes (the all-gather with sparse attention)."""
        choice = self.options.pattern
        if choice != "auto":
            return cast(dit_protocol.Pattern, choice)
        if self.options.sparse is not None or self.ranks == 1:
            return "gather"
        picked = speed_model.choose_pattern(
            config.hidden,
            config.heads,
            config.head_dim,
            self.ranks,
            "host" if self.transport == "host" else "nccl",
            self.options.shares,
        )
        return cast(dit_protocol.Pattern, picked)

    async def _load_ranks(self) -> None:
        ld = self._loaded
        assert ld is not None
        cfg = {
            "hidden": ld.config.hidden,
            "heads": ld.config.heads,
            "head_dim": ld.config.head_dim,
            "eps": ld.config.eps,
            "layers": len(ld.store.manifest),
            "devices": self.devices,
            "attention": self.options.attention,
            "compute_dtype": ld.compute_dtype,
        }
        loads = [
            dit_protocol.DitLoad(
                store=ld.store.segment.name,
                manifest=ld.store.manifest,
                config=cfg,
                heads=(ld.head_bounds[r], ld.head_bounds[r + 1]),
                key=ld.store.key_text,
                qkv_heads=(0, ld.config.heads) if ld.pattern == "ulysses" else None,
            )
            for r in range(self.ranks)
        ]
        await self.pool.start()
        results = await self.pool.all(loads, self.options.step_timeout_s)
        self._rank_starts = self.pool.starts
        self._sm_counts = [r.sm_count for r in results]
        self._fingerprints = [r.fingerprint for r in results]
        self._sparse_kernel = [r.sparse_kernel for r in results]

    def _drop_store(self) -> None:
        if self._loaded is None:
            return
        # dit_release closes the ranks' exchanges; a fresh exchange on the old arena would read its
        # stale sequence words as "ready", so the next step must get new step buffers.
        self.step_buffers.drop()
        # With a dead rank, pool.all would first restart the whole pool just to hear this; fresh
        # workers hold no views, and the survivors' go with their pool (a release) or their restart
        # (the next step).
        if self.pool.running and not self.pool.any_dead:
            try:
                self.run(
                    self.pool.all([dit_protocol.DitRelease()] * self.ranks, 60.0),
                    90.0,
                    "releasing rank weights",
                )
            except Exception as exc:  # noqa: BLE001
                # dead workers hold no views; the store goes anyway
                log.warning("releasing rank weights failed (%s); unlinking the store anyway", exc)
        self._loaded.store.release()
        self._loaded = None
        log.info("weight store released")

    # -- steps -------------------------------------------------------------------------------------
    def run_blocks(
        self,
        x: torch.Tensor,
        t_emb: torch.Tensor,
        mod_segments: Sequence[tuple],
        rope_freqs: torch.Tensor,
        *,
        block_options: list[dict] | None = None,
        interrupt: Callable[[], bool] | None = None,
        sigma: float | None = None,
        exchange: str | None = None,
        exchange_chunks: int | None = None,
        head_pieces: int | None = None,
        gather_overlap: bool | None = None,
        progress: StepProgress | None = None,
        in_place: bool = False,
        sparse_branch: str = "",
    ) -> torch.Tensor:
        """Run every loaded block on the ranks; returns the new residual stream on ``x``'s device,
        in its dtype.

        ``block_options``: per-block transformer_options adjustments captured from user patches;
        only plain data is accepted (the workers cannot run ComfyUI callables).  ``exchange``,
        ``exchange_chunks``, ``head_pieces`` and ``gather_overlap`` override the engine's options
        for this step (benchmarks compare them side by side on the same workers).
        ``progress``: see :data:`StepProgress`; with the host exchange it follows the slowest rank
        block by block (read from the arena's sequence words), otherwise it is called once, when the
        step is done.
        ``in_place``: write the result into ``x`` and return ``x`` (H3's blocks update the stream in
        place too), so a CUDA stream gets one host-to-device copy from the step segment and no new
        tensor; otherwise a new tensor.
        ``sparse_branch``: the conditioning branch (``h3ms_async.dit.sparse.branch_key``) whose
        pooled statistics a sparse step reuses; ``sigma`` decides the sparse window.
        """
        opts = self.options
        opts = replace(
            opts,
            exchange=opts.exchange if exchange is None else exchange,
            exchange_chunks=opts.exchange_chunks if exchange_chunks is None else exchange_chunks,
            head_pieces=opts.head_pieces if head_pieces is None else head_pieces,
            gather_overlap=opts.gather_overlap if gather_overlap is None else gather_overlap,
        )
        if opts.exchange == "nccl" and all(d.startswith("cuda") for d in self.devices):
            check_nccl_rank_map(self.devices)
        ld = self._loaded
        if ld is None:
            raise SplitError("run_blocks before load_weights: fill the weight store first")
        check_block_options(block_options)
        if x.dim() != 2 or x.shape[1] != ld.config.hidden:
            raise ValueError(
                f"x must be [S, {ld.config.hidden}] (the residual stream), got {tuple(x.shape)}"
            )
        plan = plans.make_split_plan(self.devices, self.options.shares, x.shape[0], ld.config.heads)
        if tuple(plan.head_bounds) != ld.head_bounds:
            raise SplitError(
                "head plan changed since the weights were loaded; call load_weights again"
            )
        gather = opts.gather_overlap and ld.pattern == "gather"
        asked = exactness.Overlap(opts.head_pieces if opts.head_pieces > 1 else 0, gather)
        plan, ran = self._measured_plan(plan, int(t_emb.shape[0]), asked)
        opts = replace(opts, head_pieces=ran.head_pieces, gather_overlap=ran.gather)
        with self.job():
            if opts.verify and self._verify_due:  # never with sparse (SplitOptions refuses both)
                from h3ms_async.dit.verify import verify_step

                out = verify_step(
                    self,
                    plan,
                    opts,
                    x,
                    t_emb,
                    mod_segments,
                    rope_freqs,
                    interrupt,
                    sigma,
                    progress,
                    in_place,
                )
                self._verify_due = False
                return out
            return self._step(
                plan,
                opts,
                x,
                t_emb,
                mod_segments,
                rope_freqs,
                interrupt,
                sigma,
                progress,
                in_place,
                sparse_branch,
            )

    def new_prompt(self) -> None:
        """A new prompt starts sampling: with ``SplitOptions.verify`` its first split step is
        verified."""
        self._verify_due = True

    # -- exactness ---------------------------------------------------------------------------------
    def _measured_plan(
        self, plan: plans.SplitPlan, t_rows: int, asked: exactness.Overlap
    ) -> tuple[plans.SplitPlan, exactness.Overlap]:
        """The plan to run, as measured on the ranks (``h3ms_async.dit.exactness``): as made, with
        its token bounds adjusted, or refused (``SplitUnsafe``, ``first`` only the first time); and
        the overlap it runs with (``asked`` less what measured inexact).  Probed once per new plan
        and overlap."""
        if self.ranks == 1:
            return plan, exactness.NO_OVERLAP
        ld = self._loaded
        assert ld is not None
        self.run(self._ensure_loaded(), self.options.step_timeout_s, "starting the ranks")
        key = exactness.verdict_key(
            self._fingerprints,
            ld.compute_dtype,
            self._ops(),
            self._attention_name(),
            plan.token_bounds,
            plan.head_bounds,
            ld.config.head_dim,
            asked,
        )
        verdict = exactness.VERDICTS.get(key)
        first = verdict is None
        if verdict is None:
            with self.job():
                verdict = self._probe_plan(plan, t_rows, asked)
            exactness.VERDICTS.put(key, verdict)
        if verdict.token_bounds is None:
            raise SplitUnsafe(verdict.detail, first=first)
        return replace(plan, token_bounds=verdict.token_bounds), verdict.overlap

    def _ops(self) -> list[dit_protocol.LinearOp]:
        ld = self._loaded
        assert ld is not None
        if ld.ops is None:
            man = [
                {n: (d.dtype, tuple(d.shape)) for n, d in blk.items()} for blk in ld.store.manifest
            ]
            ops = invariance.block_ops(man, lambda i: dit_ops.block_quant(ld.store.block(i)))
            if ld.pattern == "ulysses":  # every head's qkv rows on each rank's own tokens
                ops = [
                    msgspec.structs.replace(op, split="tokens")
                    if op.name == "attn.qkv_proj"
                    else op
                    for op in ops
                ]
            ld.ops = ops
        return ld.ops

    def _attention_name(self) -> str:
        host = self.options.comfy_host
        return f"comfy:{host.attention}" if host is not None else self.options.attention

    def _prior_refusal(self, plan: plans.SplitPlan) -> str | None:
        """What the fixed rules (the priors) say about ``plan``: a reason to refuse, or None."""
        small = min(plan.tokens_per_rank())
        if small < MIN_SHARD_TOKENS:
            return f"a {small}-row shard is under the {MIN_SHARD_TOKENS}-row prior"
        heads, tokens = plan.head_bounds[-1], plan.token_bounds[-1]
        for r, sms in enumerate(self._sm_counts):
            h = plan.head_bounds[r + 1] - plan.head_bounds[r]
            if sms is not None and not dit_ops.flash_tiles_ok(h, heads, tokens, sms):
                return f"rank {r}'s {h} heads have too few query tiles by the flash-tiles prior"
        return None

    def _probe_plan(
        self, plan: plans.SplitPlan, t_rows: int, asked: exactness.Overlap
    ) -> PlanVerdict:
        """Probe ``plan`` (and the overlap ``asked`` for) on every rank (concurrently); on a
        token-split failure probe the adjusted candidates."""
        ld = self._loaded
        assert ld is not None
        tokens = plan.token_bounds[-1]
        reports = self._probe_round([plan.token_bounds], plan, t_rows, asked)
        rounds = [reports]
        failing = exactness.fixed_failure(reports)
        if failing is not None:
            verdict = PlanVerdict(
                None,
                "unsplit",
                f"{failing}; this step runs unsplit there",
                exactness.slowest_ms(*rounds),
            )
        elif (failing := exactness.token_failure(reports)) is None:
            verdict = PlanVerdict(
                tuple(plan.token_bounds), "exact", "measured exact", exactness.slowest_ms(*rounds)
            )
        else:
            cands = exactness.adjusted_bounds(plan.token_bounds)
            pick = None
            if cands:
                rounds.append(self._probe_round(cands, plan, t_rows, exactness.NO_OVERLAP))
                pick = exactness.first_exact(rounds[-1], len(cands))
            ms = exactness.slowest_ms(*rounds)
            if pick is None:
                verdict = PlanVerdict(
                    None,
                    "unsplit",
                    f"{failing}, and no adjusted plan (shards moved to multiples or minimums of "
                    f"{'/'.join(map(str, exactness.ADJUST_MULTIPLES))} rows) is exact there; this "
                    "step runs unsplit",
                    ms,
                )
            else:
                verdict = PlanVerdict(
                    cands[pick],
                    "adjusted",
                    f"{failing}; shards moved from {exactness.sizes(plan.token_bounds)} to "
                    f"{exactness.sizes(cands[pick])} rows, measured exact",
                    ms,
                )
        ran, off = exactness.measured_overlap(reports, verdict, asked)
        for why in off.values():
            log.warning("%s", why)
        verdict = replace(verdict, overlap=ran)
        for row in exactness.op_rows(reports, verdict, failing, off):
            record_verdict("dit", **row)
        prior = self._prior_refusal(plan)
        devices = ", ".join(sorted({fp["device"] for fp in self._fingerprints}))
        note = ""
        if prior is not None and verdict.verdict == "exact":
            note = f" (the prior would have refused it: {prior})"
        elif prior is None and verdict.verdict != "exact":
            note = " (the prior accepted it; the measurement overrides)"
        if verdict.token_bounds is not None:
            log.info(
                "plan %d tokens %s x heads %s on %s: %s (%s; probe %.0f ms)%s",
                tokens,
                exactness.sizes(verdict.token_bounds),
                plan.heads_per_rank(),
                devices,
                verdict.verdict,
                verdict.detail,
                verdict.probe_ms,
                note,
            )
        else:
            log.info(
                "plan %d tokens %s x heads %s on %s: unsplit (probe %.0f ms)%s",
                tokens,
                exactness.sizes(plan.token_bounds),
                plan.heads_per_rank(),
                devices,
                verdict.probe_ms,
                note,
            )
        return verdict

    def _probe_round(
        self,
        candidates: Sequence[Sequence[int]],
        plan: plans.SplitPlan,
        t_rows: int,
        overlap: exactness.Overlap,
    ) -> list[dit_protocol.ProbeReport]:
        hb, tb0 = plan.head_bounds, plan.token_bounds
        every_rank = (
            [(int(a), int(b)) for a, b in itertools.pairwise(tb0)] if overlap.gather else []
        )
        msgs = [
            dit_protocol.DitProbe(
                ops=self._ops(),
                tokens=plan.token_bounds[-1],
                candidates=[(int(tb[r]), int(tb[r + 1])) for tb in candidates],
                heads=(hb[r], hb[r + 1]),
                t_rows=t_rows,
                pieces=overlap.head_pieces,
                gather_ranges=every_rank,
            )
            for r in range(self.ranks)
        ]
        return self.run(
            self._probe_all(msgs), self.options.step_timeout_s, "measuring the plan's invariance"
        )

    async def _ensure_loaded(self) -> None:
        # (Re)start first: a crashed worker restarts the whole pool, whose fresh workers hold no
        # weights yet.
        await self.pool.start()
        if self._rank_starts != self.pool.starts:
            await self._load_ranks()

    async def _probe_all(self, msgs: list[dit_protocol.DitProbe]) -> list[dit_protocol.ProbeReport]:
        await self._ensure_loaded()
        return await self.pool.all(msgs, self.options.step_timeout_s)

    def _step(
        self,
        plan: plans.SplitPlan,
        opts: SplitOptions,
        x: torch.Tensor,
        t_emb: torch.Tensor,
        mod_segments: Sequence[tuple],
        rope_freqs: torch.Tensor,
        interrupt: Callable[[], bool] | None,
        sigma: float | None,
        progress: StepProgress | None,
        in_place: bool,
        sparse_branch: str = "",
        *,
        trace: bool = False,
    ) -> torch.Tensor:
        """One step on the ranks; ``trace``: the ranks also digest each op's output
        (``last_rank_results``)."""
        ld = self._loaded
        assert ld is not None
        t_wall = time.perf_counter()
        before = self.step_buffers.current
        side_before = before.side if before is not None else None
        buf = self.step_buffers.for_step(
            plan,
            ld.head_bounds,
            ld.config.head_dim,
            ld.config.hidden,
            opts.exchange,
            x,
            t_emb,
            rope_freqs,
            mod_segments,
            qkv=ld.pattern == "ulysses",
        )
        t_staged = time.perf_counter()
        step, side = buf.step, buf.side
        assert side is not None
        step.tensor(buf.descs["x"]).copy_(x)
        side.tensor(buf.descs["t_emb"]).copy_(t_emb)
        step.tensor(buf.descs["rope"]).copy_(rope_freqs)
        segments: list[tuple[int, int, int | TensorDesc]] = []
        for i, (a, b, row) in enumerate(mod_segments):
            entry: int | TensorDesc = row
            if isinstance(row, torch.Tensor):
                entry = buf.descs[f"row{i}"]
                side.tensor(entry).copy_(row.to(torch.int64))
            segments.append((int(a), int(b), entry))
        self._steps += 1
        blocks = len(ld.store.manifest)
        layout = buf.layout.to_dict()
        sparse = {}
        if opts.sparse is not None and not self._sparse_fallback.blocked(
            x.dtype, ld.config.head_dim, self._sparse_kernel
        ):
            sparse = step_wire(opts.sparse, sigma, sparse_branch)
            self._sparse_ran = True
        steps = [
            dit_protocol.DitStep(
                job=self._steps,
                x=buf.descs["x"],
                t_emb=buf.descs["t_emb"],
                rope=buf.descs["rope"],
                segments=segments,
                tokens=(plan.token_bounds[r], plan.token_bounds[r + 1]),
                arena=buf.arena.name if buf.arena is not None else "",
                layout=layout,
                exchange=self._transport(opts.exchange),
                chunks=opts.exchange_chunks,
                abort_gen=0,
                deadline_s=opts.exchange_deadline_s,
                blocks=(0, blocks),
                # __post_init__ checked vram_residency against RESIDENCIES
                residency=cast(dit_protocol.Residency, opts.vram_residency),
                trace=trace,
                sparse=sparse,
                head_pieces=opts.head_pieces,
                gather_overlap=opts.gather_overlap,
                pattern=ld.pattern,
            )
            for r in range(self.ranks)
        ]
        t_sent = time.perf_counter()
        try:
            results = self.run(
                self._dispatch(steps),
                self.options.step_timeout_s,
                "split step",
                interrupt,
                self._block_probe(buf, blocks, progress),
            )
        except BaseException:
            # A failed or aborted job leaves sequence words mid-op: the next step gets a fresh
            # arena.
            self.step_buffers.drop()
            raise
        result = step.tensor(buf.descs["x"])
        # The step segment is registered pinned memory when x lives on a GPU: the copy back is
        # queued on x's stream (ordered before H3's final layer) without a host-side sync; the
        # segment is next written only after the next step's device-to-host copy of its input, which
        # that stream orders after this one.
        t_back = time.perf_counter()
        out = x if in_place else torch.empty_like(x)
        out.copy_(result, non_blocking=buf.pinned)
        self.last_rank_results = results
        self.last_phases = {
            "new_buffers": buf is not before,
            "new_side": buf.side is not side_before,
            "buffers_s": t_staged - t_wall,
            "stage_s": t_sent - t_staged,
            "ranks_s": t_back - t_sent,
            "return_s": time.perf_counter() - t_back,
        }
        self._record(plan, opts, results, time.perf_counter() - t_wall, x.shape[0], blocks, sigma)
        if progress is not None:
            progress(blocks, blocks)
        return out

    @staticmethod
    def _block_probe(
        buf: StepBuffers, blocks: int, progress: StepProgress | None
    ) -> Callable[[], None] | None:
        """A poll that reports the blocks every rank has reached, from the arena's sequence words.

        The words are snapshotted before the job is sent: until a rank begins this job its word
        still shows the previous job's last op, which must read as 0 blocks, not as a finished
        step."""
        if progress is None or buf.arena is None:
            return None
        arena = buf.arena.base_tensor()
        before = buf.layout.seq_words(arena)
        last = -1

        def poll() -> None:
            nonlocal last
            ops = [
                0 if w == b else decode_seq(w)[2]
                for w, b in zip(buf.layout.seq_words(arena), before)
            ]
            done = min(blocks - 1, min(ops) // EXCHANGE_OPS_PER_BLOCK)
            if done > last:
                last = done
                progress(done, blocks)

        return poll

    async def _dispatch(self, steps: list[dit_protocol.DitStep]) -> list[dit_protocol.DitStepped]:
        await self._ensure_loaded()
        # The abort generation is read on the loop right before the job is sent, so an abort between
        # steps cannot leave ranks disagreeing about it.
        gen = self.pool.abort_generation
        return await self.pool.all(
            [msgspec.structs.replace(m, abort_gen=gen) for m in steps], self.options.step_timeout_s
        )

    def _unmap_released(self) -> None:
        """Have the ranks unmap the buffers dropped so far, so that a tight /dev/shm gets their
        pages back before new ones are reserved.  A rank that dies or stops answering here fails the
        step, as it would mid-step (the next step restarts the pool)."""
        if self.pool.running:
            self.run(
                self.pool.all([DropReleased()] * self.ranks, 30.0),
                60.0,
                "unmapping the old step buffers on the ranks",
            )

    def _record(
        self,
        plan: plans.SplitPlan,
        opts: SplitOptions,
        results: list[dit_protocol.DitStepped],
        wall: float,
        tokens: int,
        blocks: int,
        sigma: float | None,
    ) -> None:
        hub = get_hub()
        ranks = [
            RankRecord(
                rank=r,
                device=self.devices[r],
                tokens=[plan.token_bounds[r], plan.token_bounds[r + 1]],
                heads=[plan.head_bounds[r], plan.head_bounds[r + 1]],
                compute_s=res.compute_s,
                exchange_s=res.exchange_s,
                wait_s=res.wait_s,
                moved_bytes=res.moved_bytes,
                vram_peak_bytes=res.vram_peak_bytes,
            )
            for r, res in enumerate(results)
        ]
        chunks = opts.exchange_chunks if opts.exchange == "host" else 0
        hub.record_step(
            StepRecord(
                at=now_iso(),
                seq=hub.next_seq(),
                sigma=sigma,
                tokens=tokens,
                blocks=blocks,
                devices=list(self.devices),
                exchange=self._transport(opts.exchange),
                chunks=max(chunks, 1),
                head_pieces=opts.head_pieces,
                gather_overlap=opts.gather_overlap,
                pattern=self._loaded.pattern if self._loaded is not None else "gather",
                wall_s=wall,
                moved_bytes=sum(r.moved_bytes for r in ranks),
                weight_store=self.weight_state,
                ranks=ranks,
            )
        )

    def end_sampling(self) -> int:
        """Sampling ended: the ranks drop sparse attention's pooled statistics (the next prompt
        starts afresh). Returns how many entries the ranks dropped (0, sending nothing, when no step
        ran sparse)."""
        with self.job():
            # fresh workers after a crash hold no statistics; a dead rank would first restart the
            # whole pool
            dead = self.pool.any_dead
            if not self._sparse_ran or not self.pool.running or dead:
                self._sparse_ran = False
                return 0
            self._sparse_ran = False
            results = self.run(
                self.pool.all([dit_protocol.DitSparseReset()] * self.ranks, 30.0),
                60.0,
                "dropping the sparse attention statistics",
            )
            return sum(r.dropped for r in results)

    # -- resident state ----------------------------------------------------------------------------
    def holds_resident(self) -> bool:
        return (
            self.pool.running or self._loaded is not None or self.step_buffers.current is not None
        )

    def _drop_resident(self) -> None:
        """Unlink the store and the step buffers (the workers that viewed them are gone)."""
        self._drop_store()
        self.step_buffers.drop()

    def release_weights(self) -> bool:
        """Drop only the weight store (the workers stay up).  Returns whether one was held."""
        with self._lock:
            held = self._loaded is not None
            self._drop_store()
            return held

    def snapshot(self) -> dict:
        """Plans/weights summary for the status route."""
        return {
            "devices": list(self.devices),
            "options": options_dict(self.options),
            "weight_store": self._loaded.store.summary() if self._loaded else {"state": "empty"},
            "running": self._running,
            "steps": self._steps,
        }


def _cpu_thread_env(devices: Sequence[str]) -> dict[str, str]:
    """CPU ranks share the machine's cores: more intra-op threads than cores make OpenMP spin
    against itself."""
    n_cpu = sum(1 for d in devices if d == "cpu")
    if not n_cpu or "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n_cpu))}


def options_dict(o: SplitOptions) -> dict:
    """``o`` as plain data for the status document (what a user chose; the panel shows it as
    rows)."""
    return {
        "exchange": o.exchange,
        "exchange_chunks": o.exchange_chunks,
        "head_pieces": o.head_pieces,
        "gather_overlap": o.gather_overlap,
        "pattern": o.pattern,
        "vram_residency": o.vram_residency,
        "attention": o.comfy_host.attention if o.comfy_host else o.attention,
        "cache_ram_reserve_gb": o.cache_ram_reserve_gb,
        "sparse": o.sparse.to_wire() if o.sparse else None,
        "shares": list(o.shares) if o.shares else None,
    }


def check_block_options(block_options: list[dict] | None) -> None:
    """Per-block option patches travel to the workers as data; a callable (e.g. an attention
    override) cannot.

    Raises :class:`SplitError` naming the block, the key and the fix.  Public so that a caller (the
    ComfyUI layer) can refuse a patch before it fills the weight store or starts workers.
    """
    for i, opts in enumerate(block_options or []):
        for k, v in (opts or {}).items():
            if callable(v):
                raise SplitError(
                    f"block {i}: the patch sets transformer_options[{k!r}] to a callable "
                    f"({type(v).__name__}); the rank workers cannot run ComfyUI callables. Remove "
                    "that patch, or disable H3 MultiStream for it"
                )
            if k not in _WORKER_OPTIONS:
                raise SplitError(
                    f"block {i}: transformer_options[{k!r}] set by a block patch has no meaning on "
                    f"the rank workers; supported keys: {sorted(_WORKER_OPTIONS) or 'none'}. "
                    "Remove the patch or disable H3 MultiStream"
                )


#: transformer_options keys a per-block patch may set that the workers honour (none change H3's math
#: today).
_WORKER_OPTIONS: frozenset[str] = frozenset({"block_index"})

# -- engine registry -------------------------------------------------------------------------------
ENGINES: EngineRegistry[SplitEngine] = EngineRegistry(
    "dit",
    "split workers",
    {
        "workers": lambda live: [w for e in live if e.pool.running for w in e.pool.snapshot()],
        "weight_store": lambda live: next(
            (e._loaded.store.summary() for e in live if e._loaded), {"state": "empty"}
        ),
        "plans": lambda live: {"dit": [e.snapshot() for e in live]},
    },
)


def process_key(devices: Sequence[str], options: SplitOptions) -> tuple:
    """What needs other worker processes: the rank devices, the shares (head groups) and the
    attention function."""
    return tuple(devices), options.shares, options.attention, options.comfy_host


def get_engine(devices: Sequence[str], options: SplitOptions = SplitOptions()) -> SplitEngine:
    """The engine for this rank map (created once; its workers start on first use).

    An engine is keyed on :func:`process_key`; other options (exchange, chunks, residency, RAM
    reserve, deadlines) are replaced in place, so switching them keeps the workers and the filled
    weight store. Engines for another process key are released first: one split runs at a time, and
    each engine's workers and store hold memory.
    """
    eng = ENGINES.get(process_key(devices, options), lambda: SplitEngine(devices, options))
    eng.options = options
    return eng


def engines() -> list[SplitEngine]:
    """The engines made by :func:`get_engine` (the node and CLI cache)."""
    return ENGINES.cached()


def live_engines() -> list[SplitEngine]:
    """Every split engine alive in this process (also ones made directly)."""
    return ENGINES.live()


def release_all_engines() -> int:
    """Release every split engine (workers, weight stores, buffers); returns how many were
    released."""
    return ENGINES.release_all()[0]


def end_sampling() -> int:
    """Sampling ended: every engine's ranks drop their sparse attention statistics; returns the
    entries dropped."""
    return sum(eng.end_sampling() for eng in engines())


def clear_weight_stores() -> int:
    """Drop every engine's weight store, keeping the workers; returns how many stores were
    dropped."""
    return sum(eng.release_weights() for eng in engines())
