"""The step driver: runs H3's block stack split across the rank workers, once per denoising step.

Synchronous callers (ComfyUI's prompt thread, the demo) use :class:`SplitEngine`; the engine's work
runs as coroutines on the coordinator loop.  Per step the engine

1. plans token and head ranges (largest remainder by shares, ``plans.make_split_plan``);
2. writes the residual stream and rope table into the step segment, every block's adaLN rows (the
   step's modulation, computed by the model's owner) and any per-token mod rows into the side
   segment (shm), once;
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
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import msgspec
import torch

from h3ms_async.dit import exchange_choice, tested_paths
from h3ms_async.dit.errors import SplitError, SplitInterrupted
from h3ms_async.dit.exactness import Overlap
from h3ms_async.dit.loaded import LoadedWeights, LoadTimes, PatchRefill, Placing, ProbeAhead
from h3ms_async.dit.options import (
    DEFAULT_OPTIONS,
    SplitOptions,
    check_block_options,
    options_dict,
    process_key,
    worker_gpus,
)
from h3ms_async.dit.overlap_tuner import OverlapTuner, PlanKey
from h3ms_async.dit.pattern import pick_pattern
from h3ms_async.dit.plan_probe import PlanProbe
from h3ms_async.dit.reference import DiTConfig
from h3ms_async.dit.sparse import DenseFallback, probe_settings
from h3ms_async.dit.step import PlannedStep, Step, StepProgress, record_step
from h3ms_async.dit.step_buffers import StepBuffers, StepBufferSlot
from h3ms_async.log import get_logger
from h3ms_async.runtime import plans
from h3ms_async.runtime.coordinator import get_coordinator
from h3ms_async.runtime.engines import Engine, EngineRegistry
from h3ms_async.runtime.file_bytes import tensor_of
from h3ms_async.runtime.pool import WorkerPool
from h3ms_async.runtime.spawn import cpu_thread_env
from h3ms_async.runtime.weight_store import (
    BlockReader,
    LayoutChanged,
    PatchedKey,
    StoreKey,
    patch_change,
    size_store,
)
from h3ms_async.status.hub import get_hub
from workers.dit import ops as dit_ops
from workers.dit import protocol as dit_protocol
from workers.dit.protocol import SparseConfig, SparseProbeSettings, SparseStepSettings, Transport
from workers.runtime.protocol import DropReleased, TensorDesc
from workers.runtime.shm import dtype_name
from workers.transports.arena import decode_seq
from workers.transports.dist import check_nccl_rank_map

log = get_logger("MultiStream")

#: How long a failed load waits for the ranks' loads and the plan probe to stop before it drops the
#: store (a failed fill stops every rank's wait at once).
SETTLE_S = 60.0
#: How far ahead the no-exchange baseline's common start lies (``DitStep.start_at``): past every
#: rank's setup, so its ranks begin their blocks together and share their GPU for the whole step,
#: as a split's ranks (meeting at every exchange) do, rather than drifting apart.
BASELINE_START_LEAD_S = 0.25
#: Host-exchange ops per block (all-gather, all-to-all): a rank's op index / 2 = the blocks it has
#: reached.
EXCHANGE_OPS_PER_BLOCK = 2


class SplitEngine(Engine):
    """One rank map's workers, weight store and step buffers."""

    error = SplitError
    interrupted = SplitInterrupted

    def __init__(
        self,
        devices: Sequence[str],
        options: SplitOptions = DEFAULT_OPTIONS,
        weights: LoadedWeights | None = None,
    ) -> None:
        """``weights``: a filled store handed over by the engine this one replaces
        (:meth:`hand_over`); the first load of its key takes it instead of filling anew."""
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
        tested_paths.check(devices, options.pattern, *options.overlaps_on(devices))
        self.devices = list(devices)
        self.options = options
        env = cpu_thread_env(self.devices)
        if options.comfy_host is not None:
            env.update(options.comfy_host.to_env())
        #: The filled weight store the ranks loaded (None until a load; a store handed over by
        #: another engine before this one's first load).
        self.loaded: LoadedWeights | None = weights
        #: The shm buffers steps run in (``h3ms_async/dit/step_buffers.py``).
        self.step_buffers = StepBufferSlot(self._unmap_released)
        self._steps = 0
        self._rank_starts = -1  # pool.starts when the ranks last loaded the weights
        #: per rank, from dit_load: SM count (None on CPU), device fingerprint
        #: (``invariance.fingerprint``)
        self.sm_counts: list[int | None] = []
        self.fingerprints: list[dict] = []
        self._verify_due = True  # the next split step is a prompt's first (SplitOptions.verify)
        # per rank, from dit_load: why the sparse kernel cannot run
        self._sparse_kernel: list[str | None] = []
        self._sparse_fallback = DenseFallback()
        self._sparse_ran = False  # a step has sent sparse settings since the last end_sampling
        #: The GPUs each worker sees besides its own (the GPU-direct exchange across GPUs).
        self.worker_gpus = worker_gpus(self.devices, options)
        pool = WorkerPool(
            self.devices, name="dit", program="dit", env=env, also_visible=self.worker_gpus
        )
        super().__init__(pool, ENGINES)
        #: The invariance probe's orchestration (which plan a step runs with).
        self.probe = PlanProbe(self)
        #: The overlaps each plan runs when the options let the engine pick them.
        self.overlaps = OverlapTuner()
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
        return self.loaded.store.describe() if self.loaded else "empty"

    @property
    def transport(self) -> Transport:
        """The configured transport as it runs here: host, nccl, or gloo (nccl on CPU ranks)."""
        return self._transport(self.options.exchange)

    def _transport(self, exchange: str) -> Transport:
        transport = exchange_choice.resolve(exchange, self.devices)
        if not set(exchange_choice.also_visible(transport, self.devices)) <= set(self.worker_gpus):
            raise SplitError(
                f"exchange {exchange} runs as {transport}, whose workers must see every rank's "
                f"GPU, and these were started for exchange {self.options.exchange}: set exchange "
                "on the node (or SplitOptions) instead of per step"
            )
        return transport

    # -- weights ---------------------------------------------------------------------------------
    def load_weights(
        self,
        key: StoreKey,
        config: DiTConfig,
        block_weights: BlockReader,
        n_blocks: int | None = None,
        *,
        compute_dtype: torch.dtype | None = None,
        first_step: Step | None = None,
        patched_weights: BlockReader | None = None,
    ) -> bool:
        """Fill the weight store for ``key`` (no-op when it already holds ``key``) and load every
        rank.

        Beside the fill (in this thread) the workers start, each rank takes every block in as soon
        as it is complete, and with ``first_step`` (the step about to run: its shapes and controls,
        not its modulation) that step's plan is probed on the ranks
        (:meth:`PlanProbe.probe_ahead`), so the step finds its verdict.
        ``compute_dtype``: the residual stream's dtype (ranks warm their attention up in it before
        the first step); default: the stored norm weights' dtype.  ``patched_weights``: what a
        weight-patch change (a LoRA's strength) rewrites the patched tensors from, which reads
        only what it hands over (default ``block_weights``, whose reads may serve a whole fill).
        Returns whether anything was (re)loaded.  Raises ``WeightStoreRefused`` when the RAM
        reserve forbids it, and a failed fill's own error once every rank has stopped its load.
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
        pattern = pick_pattern(self.options, self.devices, self.transport, config)
        with self._lock:
            ld = self.loaded
            same_plan = ld is not None and ld.head_bounds == head_bounds and ld.pattern == pattern
            ranks_took = self._rank_starts >= 0  # not a store handed over, still unloaded
            if ld is not None and same_plan and ld.store.key == key and ranks_took:
                return False
            full_because = None
            if (
                ld is not None
                and same_plan
                and patch_change(ld.store.key, key)
                and len(ld.store.manifest) == n
                and ld.config == config
                and (compute_dtype is None or dtype_name(compute_dtype) == ld.compute_dtype)
            ):
                assert isinstance(key, PatchedKey)
                try:
                    self._refill_patched(key, patched_weights or block_weights)
                    return True
                except LayoutChanged as exc:
                    full_because = f"full refill: {exc}"
                    log.info("weights: LoRA change, %s", full_because)
            kept = self._keep_store(key, n, config)
            if kept is None:
                self._drop_store()
            t0 = time.monotonic()
            sized = None
            if kept is not None:
                store = kept.store
                dtype = dtype_name(compute_dtype) if compute_dtype else kept.compute_dtype
            else:
                sized = size_store(
                    key,
                    n,
                    lambda i: dit_ops.rank_weights(block_weights(i)),  # adaLN stays with the owner
                    reserve_gb=self.options.cache_ram_reserve_gb,
                )
                store = sized.store
                dtype = dtype_name(compute_dtype or sized.first["norm1.weight"].dtype)
            started: list[cf.Future[Any]] = []
            try:
                self.loaded = LoadedWeights(store, config, head_bounds, dtype, pattern)
                # Once the store passed its RAM and /dev/shm checks, before the blocks are copied:
                # a CUDA worker's start takes seconds, a whole H3's fill tens.
                loading = get_coordinator().submit(self._start_and_load(self._placing(first_step)))
                started.append(loading)
                ahead = None
                if first_step is not None and self.ranks > 1:
                    first = (
                        store.block(0)
                        if sized is None
                        else {n: tensor_of(t) for n, t in sized.first.items()}
                    )
                    ahead = self._probe_ahead(first_step, self.probe.block0_ops(first), t0)
                    started.append(ahead)
                if sized is not None:
                    sized.run()
            except BaseException:
                self._settle(started)
                if self.loaded is None:
                    store.release()
                self._drop_store()
                raise
            # a kept store was complete before this load began
            filled_at = t0 if sized is None else store.filled_at
            assert filled_at is not None
            try:
                probed = None
                if ahead is not None:
                    probed = ahead.result(
                        timeout=self.pool.start_timeout + 2 * self.options.step_timeout_s
                    )
                started_s, started_at, loaded = self.wait(
                    [loading],
                    self.pool.start_timeout + self.options.step_timeout_s,
                    "loading weights on the ranks",
                )[0]
            except BaseException:
                self._settle([loading])
                self._drop_store()
                raise
            t_end = time.monotonic()
            firsts = [r.first_block_at for r in loaded if r.first_block_at is not None]
            lasts = [r.last_block_at for r in loaded if r.last_block_at is not None]
            filled = sized is not None
            self.last_load = LoadTimes(
                workers_start_s=started_s,
                fill_s=store.fill_seconds if filled else 0.0,
                fill_bytes=store.nbytes if filled else 0,
                start_wait_s=max(0.0, started_at - filled_at),
                ranks_load_s=t_end - max(started_at, filled_at),
                wall_s=t_end - t0,
                fill_end_s=filled_at - t0,
                fill_read_s=store.read_seconds if filled else 0.0,
                fill_copy_s=store.copy_seconds if filled else 0.0,
                fill_file_bytes=store.file_bytes if filled else 0,
                ranks_first_block_s=max(firsts) - t0 if firsts else None,
                ranks_last_block_s=max(lasts) - t0 if lasts else None,
                probe=probed,
                full_because=full_because,
                kept_bytes=0 if filled else store.nbytes,
            )
            log.info("%s", self.last_load.line())
            return True

    def _refill_patched(self, key: PatchedKey, block_weights: BlockReader) -> None:
        """Take ``key``, another weight-patch set on the held store's base, in place: the store
        rewrites the tensors either patch set touches (``WeightStore.rewrite``), then ranks that
        hold the store take those in again (``dit_refresh``); ranks that do not (none started yet,
        or a restarted pool) load the whole store at the next step.  Under the engine lock, so no
        step reads the store meanwhile.  Raises ``LayoutChanged`` when the blocks would change
        layout (the caller fills anew, dropping this store first); any other failure drops the
        store."""
        ld = self.loaded
        assert ld is not None
        t0 = time.monotonic()
        try:
            rewrite = ld.store.rewrite(key, lambda i: dit_ops.rank_weights(block_weights(i)))
        except LayoutChanged:
            raise  # the full fill that follows drops the store first
        except BaseException:
            self._drop_store()
            raise
        t_store = time.monotonic()
        refreshed: list[dit_protocol.DitRefreshed] = []
        if self.pool.running and not self.pool.any_dead and self._rank_starts == self.pool.starts:
            msg = dit_protocol.DitRefresh(
                store=ld.store.segment.name,
                key=ld.store.key_text,
                blocks=[(i, list(names)) for i, names in rewrite.blocks],
            )
            try:
                refreshed = self.run(
                    self.pool.all([msg] * self.ranks, self.options.step_timeout_s),
                    self.options.step_timeout_s + 30.0,
                    "refreshing the ranks' weights",
                )
            except BaseException:
                self._drop_store()
                raise
        t_end = time.monotonic()
        self.last_load = LoadTimes(
            workers_start_s=0.0,
            fill_s=rewrite.seconds,
            fill_bytes=rewrite.bytes,
            start_wait_s=0.0,
            ranks_load_s=t_end - t_store,
            wall_s=t_end - t0,
            fill_end_s=t_store - t0,
            refill=PatchRefill(
                rewrite, t_end - t_store, max((r.bytes for r in refreshed), default=0)
            ),
        )
        log.info("%s", self.last_load.line())

    def _probe_ahead(
        self, step: Step, ops: list[dit_protocol.LinearOp], t0: float
    ) -> cf.Future[ProbeAhead | None]:
        """Probe ``step``'s plan on the ranks in a thread of its own while this one fills the
        store: once the workers are up it asks their devices (the verdict's key), then probes
        unless the verdict is known (None: no plan can be made for the step; the step says
        why)."""
        done: cf.Future[ProbeAhead | None] = cf.Future()

        def run() -> None:
            try:
                devices = self.run(
                    self._describe(),
                    self.pool.start_timeout + self.options.step_timeout_s,
                    "asking the ranks' devices",
                )
                self._take_devices(devices)
                try:
                    plan, asked, _, sparse = self._probe_inputs(step, step.options(self.options))
                except Exception as exc:  # noqa: BLE001 - the step itself raises it
                    log.debug("no plan probe at the load: %s", exc)
                    done.set_result(None)
                    return
                start = time.monotonic() - t0
                probed = self.probe.probe_ahead(plan, asked, sparse, ops)
                done.set_result(ProbeAhead(start, time.monotonic() - t0, probed))
            except BaseException as exc:  # noqa: BLE001 - handed to the load, which raises it
                done.set_exception(exc)

        threading.Thread(target=run, name="h3ms-probe-ahead", daemon=True).start()
        return done

    @staticmethod
    def _settle(futs: Sequence[cf.Future[Any]]) -> None:
        """Wait (bounded) for a failed load's rank requests and probe to end, whatever their
        outcome (a fill that failed is marked so in the store: every waiting rank stops at once).
        The pool answers the first rank's failure at once; the release that follows
        (``_drop_store``) is answered by each rank only after its own load let go of the store."""
        cf.wait(futs, timeout=SETTLE_S)

    async def _describe(self) -> list[dit_protocol.DitDevice]:
        return await self.pool.all([dit_protocol.DitDescribe()] * self.ranks, 60.0)

    def _take_devices(self, devices: Sequence[dit_protocol.DitDevice]) -> None:
        self.sm_counts = [d.sm_count for d in devices]
        self.fingerprints = [d.fingerprint for d in devices]
        self._sparse_kernel = [d.sparse_kernel for d in devices]

    def _placing(self, step: Step | None) -> Placing | None:
        """What the ranks place in VRAM for ``step`` as the store fills: its residency and, per
        rank, [tokens, the rank's tokens in the nominal plan] (the estimate of its working set);
        None without a step (the first step decides)."""
        if step is None:
            return None
        opts = step.options(self.options)
        tokens = int(step.x.shape[0])
        if tokens < self.ranks:
            return None
        bounds = plans.partition(tokens, opts.shares or [1.0] * self.ranks)
        per_rank = [(tokens, b - a) for a, b in itertools.pairwise(bounds)]
        return Placing(opts.vram_residency, per_rank)

    async def _start_and_load(
        self, placing: Placing | None = None
    ) -> tuple[float, float, list[dit_protocol.DitLoaded]]:
        """Start the pool (a no-op when it runs) and load the ranks; returns the seconds of the
        start this load waited for (the whole start, also one begun earlier by
        :meth:`start_workers`; 0 when the workers were up already), the ``time.monotonic()`` when
        the workers were up, and the ranks' answers."""
        t = time.monotonic()
        await self.pool.start()
        up = time.monotonic()
        waited = self.pool.up_at >= t
        return (self.pool.start_s if waited else 0.0), up, await self._load_ranks(placing)

    async def _load_ranks(self, placing: Placing | None = None) -> list[dit_protocol.DitLoaded]:
        ld = self.loaded
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
        wait_s = self.options.step_timeout_s
        loads = [
            dit_protocol.DitLoad(
                store=ld.store.segment.name,
                manifest=ld.store.manifest,
                config=cfg,
                heads=(ld.head_bounds[r], ld.head_bounds[r + 1]),
                key=ld.store.key_text,
                progress=ld.store.progress,
                deadline_s=wait_s,
                qkv_heads=(0, ld.config.heads) if ld.pattern == "ulysses" else None,
                residency=placing.residency if placing else None,
                tokens=placing.tokens[r] if placing else None,
            )
            for r in range(self.ranks)
        ]
        await self.pool.start()
        # sent while the store may still fill: each block may take up to a rank's wait
        results = await self.pool.all(loads, wait_s * (len(ld.store.manifest) + 1))
        self._rank_starts = self.pool.starts
        self._take_devices([r.device for r in results])
        return results

    def _drop_store(self) -> None:
        ld = self._let_go()
        if ld is not None:
            ld.store.release()
            log.info("weight store released")

    def _keep_store(self, key: StoreKey, n: int, config: DiTConfig) -> LoadedWeights | None:
        """The weights held (loaded for another plan: other head groups or pattern; or handed over
        by another engine) when their store holds ``key``'s ``n`` blocks of ``config``: the store's
        content depends on nothing else, so the ranks let go of it and it stays for the new plan
        (None: it does not, and stays held)."""
        ld = self.loaded
        if ld is None or ld.store.key != key or len(ld.store.manifest) != n or ld.config != config:
            return None
        return self._let_go()

    def hand_over(self) -> LoadedWeights | None:
        """The weights this engine holds, for the engine replacing it (another GPU set, shares or
        attention function: :func:`get_engine`): its ranks let go of the store, which this engine
        then no longer holds (its release leaves it alone)."""
        with self._lock:
            return self._let_go()

    def _let_go(self) -> LoadedWeights | None:
        """The ranks drop their views of the store (which stays mapped here) and the step buffers
        go; returns what was held."""
        if self.loaded is None:
            return None
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
                # dead workers hold no views; the store is let go anyway
                log.warning(
                    "releasing rank weights failed (%s); letting go of the store anyway", exc
                )
        ld, self.loaded = self.loaded, None
        self._rank_starts = -1
        return ld

    # -- steps -------------------------------------------------------------------------------------
    def run_blocks(
        self,
        x: torch.Tensor,
        modulation: torch.Tensor,
        mod_segments: Sequence[tuple],
        rope_freqs: torch.Tensor,
        **controls: Any,
    ) -> torch.Tensor:
        """:meth:`run_step` of ``Step(x, modulation, mod_segments, rope_freqs, **controls)`` (the
        benchmarks' and tests' shorthand; ``controls`` are :class:`Step`'s other fields)."""
        return self.run_step(Step(x, modulation, mod_segments, rope_freqs, **controls))

    def run_step(self, step: Step) -> torch.Tensor:
        """Run every loaded block on the ranks; returns the new residual stream on ``step.x``'s
        device, in its dtype (``step.x`` itself with ``in_place``).  With the host exchange
        ``step.progress`` follows the slowest rank block by block (read from the arena's sequence
        words), otherwise it is called once, when the step is done."""
        opts = step.options(self.options)
        if opts.exchange == "nccl" and all(d.startswith("cuda") for d in self.devices):
            check_nccl_rank_map(self.devices)
        ld = self.loaded
        if ld is None:
            raise SplitError("run_blocks before load_weights: fill the weight store first")
        tested_paths.check(self.devices, ld.pattern, *opts.overlaps_on(self.devices, ld.pattern))
        check_block_options(step.block_options)
        x = step.x
        if x.dim() != 2 or x.shape[1] != ld.config.hidden:
            raise ValueError(
                f"x must be [S, {ld.config.hidden}] (the residual stream), got {tuple(x.shape)}"
            )
        blocks = len(ld.store.manifest)
        mod = step.modulation
        width = dit_ops.adaln_width(ld.config.hidden)
        if mod.dim() != 3 or mod.shape[0] != blocks or mod.shape[2] != width:
            raise ValueError(
                f"modulation must be [{blocks}, M, {width}] (every block's adaLN output for the "
                f"step's timestep rows), got {tuple(mod.shape)}"
            )
        plan, asked, sparse_cfg, probe = self._probe_inputs(step, opts)
        if tuple(plan.head_bounds) != ld.head_bounds:
            raise SplitError(
                "head plan changed since the weights were loaded; call load_weights again"
            )
        transport = self._transport(opts.exchange)
        ipc_sync = exchange_choice.resolve_sync(opts.ipc_sync, transport, self.devices)
        self.step_buffers.check_room(
            PlannedStep(step, plan, opts, ld.pattern, transport, ipc_sync=ipc_sync), ld
        )
        plan, ran, sparse_off = self.probe.measured_plan(plan, asked, probe, step.interrupt)
        sparse_step = (
            None
            if sparse_cfg is None or sparse_off
            else SparseStepSettings(sparse_cfg, step.sigma, step.sparse_branch)
        )
        phase = None
        if opts.overlap_tuning:
            tune_key = PlanKey(
                tuple(plan.token_bounds),
                tuple(plan.head_bounds),
                ld.pattern.value,
                transport.value,
                sparse_step is not None,
            )
            ran, phase = self.overlaps.choose(tune_key, ran)
        planned = PlannedStep(
            step,
            plan,
            replace(
                opts,
                head_pieces=ran.head_pieces,
                gather_overlap=ran.gather,
                gather_ahead=ran.ahead,
            ),
            ld.pattern,
            transport,
            sparse_step,
            overlap_phase=phase,
            ipc_sync=ipc_sync,
        )
        with self.job():
            if opts.verify and self._verify_due:
                from h3ms_async.dit import verify

                if verify.due(planned.sparse, step.sigma, x.shape[0], blocks):
                    out = verify.verify_step(self, planned)
                    self._verify_due = False
                    return out
            t_start = time.perf_counter()
            out = self.run_planned(planned)
            if phase is not None:
                per_block = (time.perf_counter() - t_start) / blocks
                self.overlaps.record(tune_key, ran, phase, per_block)
            return out

    def _probe_inputs(
        self, step: Step, opts: SplitOptions
    ) -> tuple[plans.SplitPlan, Overlap, SparseConfig | None, SparseProbeSettings | None]:
        """What ``step``'s plan is measured with: the plan as made, the overlap asked for, the
        sparse attention it runs (None: dense) and the probe's sparse settings."""
        ld = self.loaded
        assert ld is not None
        x = step.x
        plan = plans.make_split_plan(self.devices, self.options.shares, x.shape[0], ld.config.heads)
        pieces, gather, ahead = opts.overlaps_on(self.devices, ld.pattern)
        on_gather = ld.pattern == "gather"
        asked = Overlap(
            pieces if pieces > 1 else 0, gather and on_gather, ahead if on_gather else 0
        )
        sparse_cfg = opts.sparse
        if sparse_cfg is not None and self._sparse_fallback.blocked(
            x.dtype, ld.config.head_dim, self._sparse_kernel
        ):
            sparse_cfg = None  # the kernel cannot run: every rank runs the step dense
        probe = (
            None
            if sparse_cfg is None
            else probe_settings(
                sparse_cfg, x.shape[0], len(ld.store.manifest), step.mod_segments, step.rope_freqs
            )
        )
        return plan, asked, sparse_cfg, probe

    def new_prompt(self) -> None:
        """A new prompt starts sampling: with ``SplitOptions.verify`` its first split step (with
        sparse attention, its first step that runs the kernel: ``verify.due``) is verified."""
        self._verify_due = True

    def run_planned(self, planned: PlannedStep) -> torch.Tensor:
        """Run ``planned`` on the ranks (one round trip through the coordinator) and record it;
        with ``planned.trace`` the ranks also digest each op's output (``last_rank_results``)."""
        step, plan, opts = planned.step, planned.plan, planned.options
        x = step.x
        ld = self.loaded
        assert ld is not None
        t_wall = time.perf_counter()
        before = self.step_buffers.current
        side_before = before.side if before is not None else None
        buf = self.step_buffers.for_step(planned, ld)
        t_staged = time.perf_counter()
        seg, side = buf.step, buf.side
        assert side is not None
        seg.tensor(buf.descs["x"]).copy_(x)
        side.tensor(buf.descs["modulation"]).copy_(step.modulation)
        seg.tensor(buf.descs["rope"]).copy_(step.rope_freqs)
        segments: list[tuple[int, int, int | TensorDesc]] = []
        for i, (a, b, row) in enumerate(step.mod_segments):
            entry: int | TensorDesc = row
            if isinstance(row, torch.Tensor):
                entry = buf.descs[f"row{i}"]
                side.tensor(entry).copy_(row.to(torch.int64))
            segments.append((int(a), int(b), entry))
        self._steps += 1
        blocks = len(ld.store.manifest)
        layout = buf.layout.to_dict()
        if planned.sparse:
            self._sparse_ran = True
        baseline = planned.transport is Transport.NONE and self.ranks > 1
        start_at = time.monotonic() + BASELINE_START_LEAD_S if baseline else 0.0
        steps = [
            dit_protocol.DitStep(
                job=self._steps,
                x=buf.descs["x"],
                modulation=buf.descs["modulation"],
                rope=buf.descs["rope"],
                segments=segments,
                tokens=(plan.token_bounds[r], plan.token_bounds[r + 1]),
                arena=buf.arena.name if buf.arena is not None else "",
                layout=layout,
                exchange=planned.transport,
                chunks=opts.exchange_chunks,
                abort_gen=0,
                deadline_s=opts.exchange_deadline_s,
                blocks=(0, blocks),
                # __post_init__ checked vram_residency against RESIDENCIES
                residency=opts.vram_residency,
                trace=planned.trace,
                sparse=planned.sparse,
                head_pieces=opts.head_pieces,
                gather_overlap=opts.gather_overlap,
                gather_ahead=opts.gather_ahead,
                pattern=planned.pattern,
                peer_devices=self._peer_devices(r, planned.transport),
                ipc_sync=planned.ipc_sync,
                start_at=start_at,
            )
            for r in range(self.ranks)
        ]
        t_sent = time.perf_counter()
        try:
            results = self.run(
                self._dispatch(steps),
                self.options.step_timeout_s,
                "split step",
                step.interrupt,
                self._block_probe(buf, blocks, step.progress),
            )
        except BaseException:
            # A failed or aborted job leaves sequence words mid-op: the next step gets a fresh
            # arena.
            self.step_buffers.drop()
            raise
        result = seg.tensor(buf.descs["x"])
        # The step segment is registered pinned memory when x lives on a GPU: the copy back is
        # queued on x's stream (ordered before H3's final layer) without a host-side sync; the
        # segment is next written only after the next step's device-to-host copy of its input, which
        # that stream orders after this one.
        t_back = time.perf_counter()
        out = x if step.in_place else torch.empty_like(x)
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
        wall = time.perf_counter() - t_wall
        record_step(planned, self.devices, results, wall, blocks, self.weight_state)
        if step.progress is not None:
            step.progress(blocks, blocks)
        return out

    def _peer_devices(self, rank: int, transport: Transport) -> tuple[int, ...]:
        """The GPU-direct exchange's ``peer_devices`` for ``rank``: its worker's index of each
        rank's GPU."""
        if transport is not Transport.CUDA_IPC:
            return ()
        return tuple(self.pool.local_index(rank, d) for d in self.devices)

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

    async def ensure_loaded(self) -> None:
        """(Re)start the pool and load the ranks: a crashed worker restarts the whole pool, whose
        fresh workers hold no weights yet."""
        await self.pool.start()
        if self._rank_starts != self.pool.starts:
            await self._load_ranks()

    async def _dispatch(self, steps: list[dit_protocol.DitStep]) -> list[dit_protocol.DitStepped]:
        await self.ensure_loaded()
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

    def end_sampling(self) -> int:
        """Sampling ended: the ranks drop sparse attention's pooled statistics (the next prompt
        starts afresh). Returns how many entries the ranks dropped (0, sending nothing, when no step
        ran sparse)."""
        with self.job():
            return self.drop_sparse_stats()

    def drop_sparse_stats(self) -> int:
        """Have the ranks drop their sparse attention statistics (inside a job); returns how many
        entries they dropped (0, sending nothing, when no step ran sparse since the last drop)."""
        # fresh workers after a crash hold no statistics; a dead rank would first restart the whole
        # pool
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
        return self.pool.running or self.loaded is not None or self.step_buffers.current is not None

    def _drop_resident(self) -> None:
        """Unlink the store and the step buffers (the workers that viewed them are gone)."""
        self._drop_store()
        self.step_buffers.drop()

    def release_weights(self) -> bool:
        """Drop only the weight store (the workers stay up).  Returns whether one was held."""
        with self._lock:
            held = self.loaded is not None
            self._drop_store()
            return held

    def snapshot(self) -> dict:
        """Plans/weights summary for the status route."""
        return {
            "devices": list(self.devices),
            "options": options_dict(self.options),
            "weight_store": self.loaded.store.summary() if self.loaded else {"state": "empty"},
            "running": self._running,
            "steps": self._steps,
            "overlaps": self.overlaps.snapshot(),
        }


# -- engine registry -------------------------------------------------------------------------------
ENGINES: EngineRegistry[SplitEngine] = EngineRegistry(
    "dit",
    "split workers",
    {
        "workers": lambda live: [w for e in live if e.pool.running for w in e.pool.snapshot()],
        "weight_store": lambda live: next(
            (e.loaded.store.summary() for e in live if e.loaded), {"state": "empty"}
        ),
        "plans": lambda live: {"dit": [e.snapshot() for e in live]},
    },
    get_hub,
)


def get_engine(devices: Sequence[str], options: SplitOptions = DEFAULT_OPTIONS) -> SplitEngine:
    """The engine for this rank map (created once; its workers start on first use).

    An engine is keyed on :func:`process_key`; other options (exchange, chunks, residency, RAM
    reserve, deadlines) are replaced in place, so switching them keeps the workers and the filled
    weight store. Engines for another process key are released first: one split runs at a time, and
    each engine's workers and store hold memory. Their filled store passes to the new engine, whose
    first load keeps it when it holds that load's weights (:meth:`SplitEngine.hand_over`).
    """
    tested_paths.check(devices, options.pattern, *options.overlaps_on(devices))
    handed: list[LoadedWeights] = []

    def hand_over(old: SplitEngine) -> None:
        ld = old.hand_over()
        if ld is not None:
            handed.append(ld)

    def make() -> SplitEngine:
        eng = SplitEngine(devices, options, handed[0] if handed else None)
        del handed[:1]  # taken
        return eng

    try:
        eng = ENGINES.get(process_key(devices, options), make, before_release=hand_over)
    finally:
        for ld in handed:  # handed over, not taken: the old engine's release or the new one failed
            ld.store.release()
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
