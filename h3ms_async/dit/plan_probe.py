"""The split's invariance probe, orchestrated: which plan a step runs with, as measured on the
ranks (``h3ms_async.dit.exactness`` keeps the verdicts, ``workers.dit.invariance`` measures).

A verdict is looked up by everything it depends on; a new plan is probed on every rank at once,
then its adjusted candidates when a token split differs; the overlap asked for runs less what
measured inexact, and sparse attention asked for is off on the plan where it measured inexact.
The lookup costs no round trip to the ranks once they have loaded.  The load probes the first
step's plan ahead (:meth:`PlanProbe.probe_ahead`), on the ranks while the store fills: the probe
needs the ranks' devices and the blocks' structure, not their weights.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace

import msgspec
import torch

from h3ms_async.dit import exactness
from h3ms_async.dit.engine_view import EngineView
from h3ms_async.dit.errors import SplitUnsafe
from h3ms_async.dit.exactness import MIN_SHARD_TOKENS, PlanVerdict
from h3ms_async.log import get_logger
from h3ms_async.runtime import plans
from h3ms_async.runtime.visibility import canonical_device
from h3ms_async.status.hub import record_verdict
from workers.dit import invariance
from workers.dit import ops as dit_ops
from workers.dit import protocol as dit_protocol
from workers.runtime.shm import dtype_name
from workers.transports.arena import piece

log = get_logger("MultiStream")


def tail_pieces(token_bounds: Sequence[int], rank: int, pieces: int) -> list[tuple[int, int]]:
    """Rank ``rank``'s row pieces of ``gather_ahead`` (``pieces``; 0: none) in sequence
    coordinates, as ``Exchange.all_gather_rows_produced`` cuts its rows (the non-empty ones)."""
    if pieces < 2:
        return []
    t0, t1 = int(token_bounds[rank]), int(token_bounds[rank + 1])
    cuts = (piece(t1 - t0, pieces, j) for j in range(pieces))
    return [(t0 + a, t0 + b) for a, b in cuts if b > a]


def probe_groups(devices: Sequence[str], sparse: bool) -> list[list[int]]:
    """The ranks that share one probe request, each group's first rank running it: the logical
    ranks of one GPU (each unsplit call is made once for all of them, where each rank would make it
    on the same time-sliced GPU); every other rank alone (CPU ranks have cores of their own, each
    GPU its own probe), and every rank alone with ``sparse`` attention (its probe is per head
    group)."""
    groups: dict[str, list[int]] = {}
    alone: list[list[int]] = []
    for r, d in enumerate(devices):
        if d.startswith("cuda") and not sparse:
            groups.setdefault(canonical_device(d), []).append(r)
        else:
            alone.append([r])
    return sorted([*groups.values(), *alone])


class PlanProbe:
    """The probe of one engine's plans (its ranks, its loaded weights, its options)."""

    def __init__(self, engine: EngineView) -> None:
        self.engine = engine
        #: probe rounds sent to the ranks so far (each one round trip)
        self.rounds = 0
        # verdicts measured ahead of their first step (probe_ahead) that no step has used yet: that
        # step still warns about a refusal (SplitUnsafe.first)
        self._ahead: set[str] = set()

    def measured_plan(
        self,
        plan: plans.SplitPlan,
        asked: exactness.Overlap,
        sparse: dit_protocol.SparseProbeSettings | None = None,
        interrupt: Callable[[], bool] | None = None,
    ) -> tuple[plans.SplitPlan, exactness.Overlap, bool]:
        """The plan to run, as measured on the ranks (``h3ms_async.dit.exactness``): as made, with
        its token bounds adjusted, or refused (``SplitUnsafe``, ``first`` only the first time); the
        overlap it runs with (``asked`` less what measured inexact); and whether sparse attention,
        asked for with the probe settings ``sparse`` (``h3ms_async.dit.sparse.probe_settings``), is
        off on it.  Probed once per new plan, overlap and sparse settings; ``interrupt`` (the
        step's) ends a probe on every rank, keeping no verdict (``SplitInterrupted``)."""
        if self.engine.ranks == 1:
            return plan, exactness.NO_OVERLAP, False
        ld = self.engine.loaded
        assert ld is not None
        if not self.engine.fingerprints:  # the ranks never loaded: the key needs their devices
            self.engine.run(
                self.engine.ensure_loaded(),
                self.engine.options.step_timeout_s,
                "starting the ranks",
            )
        ops = self.ops()
        key = self._key(plan, asked, sparse, ops)
        verdict = exactness.VERDICTS.get(key)
        first = verdict is None or key in self._ahead
        self._ahead.discard(key)
        if verdict is None:
            with self.engine.job():
                verdict = self._probe_plan(plan, asked, sparse, ops, interrupt)
            exactness.VERDICTS.put(key, verdict)
        if verdict.token_bounds is None:
            raise SplitUnsafe(verdict.detail, first=first)
        bounds = verdict.token_bounds
        return replace(plan, token_bounds=bounds), verdict.overlap, verdict.sparse_off

    def probe_ahead(
        self,
        plan: plans.SplitPlan,
        asked: exactness.Overlap,
        sparse: dit_protocol.SparseProbeSettings | None,
        ops: list[dit_protocol.LinearOp],
    ) -> bool:
        """Measure ``plan`` before its first step (the load runs it beside the store's fill, the
        engine held by the load), with ``ops`` (:meth:`block0_ops`); the step then finds the
        verdict.  Returns whether it probed (False: the verdict was known)."""
        key = self._key(plan, asked, sparse, ops)
        if exactness.VERDICTS.get(key) is not None:
            return False
        exactness.VERDICTS.put(key, self._probe_plan(plan, asked, sparse, ops))
        self._ahead.add(key)
        return True

    def _key(
        self,
        plan: plans.SplitPlan,
        asked: exactness.Overlap,
        sparse: dit_protocol.SparseProbeSettings | None,
        ops: list[dit_protocol.LinearOp],
    ) -> str:
        ld = self.engine.loaded
        assert ld is not None
        return exactness.verdict_key(
            self.engine.fingerprints,
            ld.compute_dtype,
            ops,
            self._attention_name(),
            plan.token_bounds,
            plan.head_bounds,
            ld.config.head_dim,
            asked,
            sparse,
        )

    def ops(self) -> list[dit_protocol.LinearOp]:
        """The loaded block stack's distinct linears (every block of the filled store)."""
        ld = self.engine.loaded
        assert ld is not None
        if ld.ops is None:
            man = [
                {n: (d.dtype, tuple(d.shape)) for n, d in blk.items()} for blk in ld.store.manifest
            ]
            ld.ops = self._pattern_ops(
                invariance.block_ops(man, lambda i: dit_ops.block_quant(ld.store.block(i)))
            )
        return ld.ops

    def block0_ops(self, first: dict[str, torch.Tensor]) -> list[dit_protocol.LinearOp]:
        """The distinct linears of a stack of blocks like block 0 (``first``: its tensors), before
        the store holds them: :meth:`ops` once the store is filled, unless a later block's int8
        settings differ (then the verdict keys differ and the first step probes again)."""
        man = [{n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in first.items()}]
        return self._pattern_ops(invariance.block_ops(man, lambda _i: dit_ops.block_quant(first)))

    def _pattern_ops(self, ops: list[dit_protocol.LinearOp]) -> list[dit_protocol.LinearOp]:
        ld = self.engine.loaded
        assert ld is not None
        if ld.pattern == "ulysses":  # every head's qkv rows on each rank's own tokens
            return [
                msgspec.structs.replace(op, split="tokens") if op.name == "attn.qkv_proj" else op
                for op in ops
            ]
        return ops

    def _model(self) -> dit_protocol.ProbeModel:
        ld = self.engine.loaded
        assert ld is not None
        return dit_protocol.ProbeModel(
            heads=ld.config.heads,
            head_dim=ld.config.head_dim,
            eps=ld.config.eps,
            compute_dtype=ld.compute_dtype,
            attention=self.engine.options.attention,
        )

    def _attention_name(self) -> str:
        host = self.engine.options.comfy_host
        return f"comfy:{host.attention}" if host is not None else self.engine.options.attention

    def _prior_refusal(self, plan: plans.SplitPlan) -> str | None:
        """What the fixed rules (the priors) say about ``plan``: a reason to refuse, or None."""
        small = min(plan.tokens_per_rank())
        if small < MIN_SHARD_TOKENS:
            return f"a {small}-row shard is under the {MIN_SHARD_TOKENS}-row prior"
        heads, tokens = plan.head_bounds[-1], plan.token_bounds[-1]
        for r, sms in enumerate(self.engine.sm_counts):
            h = plan.head_bounds[r + 1] - plan.head_bounds[r]
            if sms is not None and not dit_ops.flash_tiles_ok(h, heads, tokens, sms):
                return f"rank {r}'s {h} heads have too few query tiles by the flash-tiles prior"
        return None

    def _probe_plan(
        self,
        plan: plans.SplitPlan,
        asked: exactness.Overlap,
        sparse: dit_protocol.SparseProbeSettings | None,
        ops: list[dit_protocol.LinearOp],
        interrupt: Callable[[], bool] | None = None,
    ) -> PlanVerdict:
        """Probe ``plan`` (and the overlap ``asked`` for, and sparse attention with the probe
        settings ``sparse``) on every rank (concurrently); on a token-split failure probe the
        adjusted candidates."""
        ld = self.engine.loaded
        assert ld is not None
        tokens = plan.token_bounds[-1]
        reports = self._probe_round([plan.token_bounds], plan, ops, asked, sparse, interrupt)
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
                rounds.append(
                    self._probe_round(cands, plan, ops, exactness.NO_OVERLAP, None, interrupt)
                )
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
        sparse_off, sparse_why = exactness.measured_sparse(reports, verdict, sparse is not None)
        off.update(sparse_why)
        for why in off.values():
            log.warning("%s", why)
        verdict = replace(verdict, overlap=ran, sparse_off=sparse_off)
        for row in exactness.op_rows(reports, verdict, failing, off):
            record_verdict("dit", **row)
        prior = self._prior_refusal(plan)
        devices = ", ".join(sorted({fp["device"] for fp in self.engine.fingerprints}))
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
        ops: list[dit_protocol.LinearOp],
        overlap: exactness.Overlap,
        sparse: dit_protocol.SparseProbeSettings | None = None,
        interrupt: Callable[[], bool] | None = None,
    ) -> list[dit_protocol.ProbeReport]:
        self.rounds += 1
        hb, tb0 = plan.head_bounds, plan.token_bounds
        every_rank = (
            [(int(a), int(b)) for a, b in itertools.pairwise(tb0)] if overlap.gather else []
        )
        model = self._model()
        shards = [
            dit_protocol.ProbeShard(
                candidates=[(int(tb[r]), int(tb[r + 1])) for tb in candidates],
                heads=(hb[r], hb[r + 1]),
                tail_ranges=tail_pieces(tb0, r, overlap.ahead),
            )
            for r in range(self.engine.ranks)
        ]
        groups = probe_groups(self.engine.devices, sparse is not None)
        msgs: list[dit_protocol.DitProbe | None] = [None] * self.engine.ranks
        for group in groups:
            msgs[group[0]] = dit_protocol.DitProbe(
                ops=ops,
                model=model,
                tokens=plan.token_bounds[-1],
                shards=[shards[r] for r in group],
                pieces=overlap.head_pieces,
                gather_ranges=every_rank,
                sparse=sparse,
            )
        pool = self.engine.pool

        async def send() -> list[dit_protocol.ProbeReports]:
            # the abort generation read on the loop right before the probe is sent, as a step's,
            # once the pool is up: a restart (a dead rank) begins a new generation count
            await pool.start()
            gen = pool.abort_generation
            sent = [m and msgspec.structs.replace(m, abort_gen=gen) for m in msgs]
            return await pool.all(sent, self.engine.options.step_timeout_s)

        # the probe needs no weights: fresh workers (a restarted pool) answer it as they are
        answers = self.engine.run(
            send(),
            self.engine.options.step_timeout_s,
            "measuring the plan's invariance",
            interrupt=interrupt,
        )
        by_rank = {
            r: rep
            for group in groups
            for r, rep in zip(group, answers[group[0]].reports, strict=True)
        }
        return [by_rank[r] for r in range(self.engine.ranks)]
