"""What proves that a parity case ran the pack's split, not ComfyUI's own path.

A parity case compares the pack's output inside real ComfyUI with plain ComfyUI's, bit for bit. Wherever the split
falls back to ComfyUI's own path (a plan the invariance probe refused, an attention shape measured inexact, a VAE
worker the exactness probe dropped, a node that passed the model through) the two are equal trivially, so equality
alone proves nothing. :class:`SplitProof` wraps the case's split run inside the ComfyUI process: it counts the calls
ComfyUI's own H3 modules make inside the diffusion model's calls (global forward hooks) and takes the records the
engine kept for them:

* DiT split: one step record per model call (the split's ``StepRecord``): the expected ranks, each with a non-empty
  token range and head group, the ranges tiling the call's tokens and the model's heads;
* H3 Attention Parallel: one call record per attention call, the devices' head ranges tiling the call's heads;
* VAE split decode: a decode record of this decode: its chunks each decoded once, on the expected ranks (each
  worker's chunks came back with bytes), the dropped ranks none.

It fails, naming what ran unsplit and the probe's verdicts, unless all of that holds. A case that expects ComfyUI's own
path says so (``unsplit=True``): then the proof asserts that refusal instead (calls made, none split). The record
checks (:func:`dit_step_failure`, :func:`attention_call_failure`, :func:`vae_decode_failure`) also take records a
benchmark wrote (``bench vae``'s JSON: :func:`vae_decodes_failure`). Imported inside ComfyUI processes (``tests/`` on
``sys.path``); the pack's modules are imported when a proof starts, so after ComfyUI's loader loaded the pack.
"""
from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

PROGRAMS = ("dit", "attention", "vae")


def tiling_failure(ranges: Sequence[Sequence[int]], whole: int, what: str) -> str | None:
    """Why the ranks' ``[start, end)`` ``ranges`` (rank order) do not tile ``[0, whole)`` with every range non-empty;
    None when they do."""
    pos = 0
    for r, (a, b) in enumerate(ranges):
        if a != pos:
            return f"rank {r}'s {what} start at {a}, not {pos}: the ranks' {what} must tile [0, {whole})"
        if b <= a:
            return f"rank {r} computed no {what} ([{a}, {b}))"
        pos = b
    if pos != whole:
        return f"the ranks' {what} end at {pos}, not at {whole}: they do not cover the whole"
    return None


def _ranks_failure(ranks: Sequence[Mapping], devices: Sequence[str], what: str) -> str | None:
    got = [(r["rank"], r["device"]) for r in ranks]
    if got != list(enumerate(devices)):
        return f"{what} ran on ranks {got}, expected {list(enumerate(devices))}"
    return None


def dit_step_failure(step: Mapping, devices: Sequence[str], tokens: int | None = None, heads: int | None = None,
                     blocks: int | None = None) -> str | None:
    """Why the DiT step record ``step`` does not show ``devices`` computing the whole step (``tokens`` tokens,
    ``heads`` heads, ``blocks`` blocks where given), each rank a non-empty token range and head group; None when it
    does."""
    what = f"split step {step['seq']}"
    if step["devices"] != list(devices):
        return f"{what} ran on {step['devices']}, expected {list(devices)}"
    for name, want in (("tokens", tokens), ("blocks", blocks)):
        if want is not None and step[name] != want:
            return f"{what} has {step[name]} {name}, the model call {want}"
    ranks = step["ranks"]
    why = _ranks_failure(ranks, devices, what)
    why = why or tiling_failure([r["tokens"] for r in ranks], step["tokens"], "tokens")
    total = heads if heads is not None else ranks[-1]["heads"][1]
    return why or tiling_failure([r["heads"] for r in ranks], total, "heads")


def attention_call_failure(call: Mapping, devices: Sequence[str], tokens: int | None = None,
                           heads: int | None = None) -> str | None:
    """Why the H3 Attention Parallel call record ``call`` does not show ``devices`` computing the whole call
    (``tokens`` x ``heads`` where given), each a non-empty head range; None when it does."""
    what = f"attention call {call['call']}"
    for name, want in (("tokens", tokens), ("heads", heads)):
        if want is not None and call[name] != want:
            return f"{what} has {call[name]} {name}, the model's attention call {want}"
    return _ranks_failure(call["ranks"], devices, what) or tiling_failure(
        [r["heads"] for r in call["ranks"]], call["heads"], "heads")


def vae_decode_failure(rec: Mapping | None, devices: Sequence[str], dropped: Sequence[int] = ()) -> str | None:
    """Why the VAE split's decode record ``rec`` does not show ``devices`` less ``dropped`` decoding the whole latent:
    every chunk decoded once, by the ranks the round-robin deal over the kept ranks gives chunks (each worker's
    chunks came back with bytes), none by a dropped rank; None when it does."""
    if rec is None:
        return "no VAE decode record: the decode did not split"
    if rec["devices"] != list(devices):
        return f"the decode ran on {rec['devices']}, expected {list(devices)}"
    if rec["dropped_ranks"] != sorted(dropped):
        return (f"the exactness probe dropped ranks {rec['dropped_ranks']} (their chunks decoded on the others), "
                f"expected {sorted(dropped)}")
    chunks = rec["per_chunk"]
    if sorted(c["index"] for c in chunks) != list(range(rec["chunks"])):
        return f"the decode's chunks {[c['index'] for c in chunks]} are not each of its {rec['chunks']} chunks once"
    counts = [sum(c["rank"] == r for c in chunks) for r in range(len(devices))]
    if counts != rec["chunks_per_rank"]:
        return f"chunks per rank {rec['chunks_per_rank']} disagree with the chunks' ranks {counts}"
    kept = [r for r in range(len(devices)) if r not in dropped]
    working = kept[:min(rec["chunks"], len(kept))]
    idle = [r for r in range(len(devices)) if (counts[r] > 0) != (r in working)]
    if idle:
        return (f"chunks per rank {counts}: ranks {working} should each decode chunks of the {rec['chunks']} "
                f"(ranks {sorted(dropped)} none)")
    empty = [c["index"] for c in chunks if c["rank"] != 0 and not c.get("bytes")]
    if empty:
        return f"chunks {empty} came back from their workers without bytes"
    return None


def vae_decodes_failure(records: Sequence[Mapping | None], devices: Sequence[str],
                        dropped: Sequence[int] = ()) -> str | None:
    """:func:`vae_decode_failure` for the records a benchmark took after each of its consecutive decodes with one
    engine; they must be those decodes' own records (a decode that ran unsplit leaves none, so the record taken after
    it is the one before)."""
    if not records:
        return "no decode records"
    for i, rec in enumerate(records):
        why = vae_decode_failure(rec, devices, dropped)
        if why is not None:
            return f"decode {i}: {why}"
    jobs = [rec["job"] for rec in records if rec is not None]
    if jobs != list(range(jobs[0], jobs[0] + len(jobs))):
        return f"the records are of the engine's decodes {jobs}, not of {len(jobs)} consecutive ones: one ran unsplit"
    return None


class SplitProof:
    """A context manager around a parity case's split run in the ComfyUI process (see the module doc): on exit,
    :attr:`failure` says why the run does not prove the split (None when it does) and, with ``strict`` (the default),
    an ``AssertionError`` carries it.

    ``devices``: the expected ranks (DiT: the rank map; Attention Parallel: the model's device, then the helpers';
    VAE: rank 0's, then the workers'). ``program``: ``dit``, ``attention`` or ``vae``. ``unsplit``: the case expects
    ComfyUI's own path (a refusal): the calls must be made and none split. ``dropped``: VAE ranks the exactness probe
    must drop. A VAE proof wraps one decode; a DiT or attention proof any number of diffusion-model calls."""

    def __init__(self, devices: Sequence[str], program: str = "dit", *, unsplit: bool = False,
                 dropped: Sequence[int] = (), strict: bool = True) -> None:
        if program not in PROGRAMS:
            raise ValueError(f"program {program!r}: use one of {', '.join(PROGRAMS)}")
        self.devices = list(devices)
        self.program = program
        self.unsplit = unsplit
        self.dropped = sorted(dropped)
        self.strict = strict
        self.failure: str | None = None
        #: the model's calls: DiT (tokens, heads, blocks) per diffusion-model call; attention (tokens, heads)
        self.calls: list[tuple[int, ...]] = []
        self.records: list[dict] = []
        self._model: tuple[int, int] = (0, 0)
        self._inside = 0
        self._h3: Any = None  # ComfyUI's H3 module, imported when the proof starts
        self._hooks: list[Any] = []
        self._before: Any = None

    # -- what the model asked for ------------------------------------------------------------------
    def _seen(self, module: Any, args: tuple) -> None:
        """Before a module call: a diffusion-model call starts (its heads and blocks), its final layer takes its
        tokens (DiT), or an attention call inside a diffusion-model call (not the text refiner's, which ComfyUI runs
        once per sampling before the calls, without ``transformer_options``: ComfyUI's own attention whatever the
        nodes)."""
        h3 = self._h3
        if isinstance(module, h3.MiniMaxH3Model):
            self._model = (int(module.blocks[0].attn.heads), len(module.blocks))
            self._inside += 1
        elif isinstance(module, h3.FinalLayer) and self.program == "dit":
            self.calls.append((int(args[0].shape[0]), *self._model))
        elif isinstance(module, h3.Attention) and self.program == "attention" and self._inside:
            self.calls.append((int(args[0].shape[0]), int(module.heads)))

    def _left(self, module: Any, args: tuple, out: Any) -> None:
        if isinstance(module, self._h3.MiniMaxH3Model):
            self._inside -= 1

    def __enter__(self) -> SplitProof:
        from comfy.ldm.minimax import model as h3
        from torch.nn.modules import module
        self._h3 = h3
        self._before = self._engine_state()
        if self.program != "vae":
            self._hooks = [module.register_module_forward_pre_hook(self._seen),
                           module.register_module_forward_hook(self._left)]
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        if exc_type is not None:
            return
        self.failure = self._failure()
        if self.failure is not None and self.strict:
            raise AssertionError(f"{self.program} split proof on {self.devices}: {self.failure}")

    # -- what the engine recorded ------------------------------------------------------------------
    def _engine_state(self) -> Any:
        """What each engine had recorded when the block started. Keyed weakly by the engine, not by ``id()``: making an
        engine for other devices releases the old one, and the new one can take the freed address (seen in CI: a 4-rank
        engine read as the released 2-rank one, its 8 split calls as none)."""
        if self.program == "dit":
            from h3ms_async.status.hub import get_hub
            return get_hub().next_seq() - 1
        if self.program == "attention":
            from h3ms_async.attention.engine import live_engines
            return weakref.WeakKeyDictionary({e: e.snapshot()["calls"] for e in live_engines()})
        return weakref.WeakKeyDictionary({e: e.last_record for e in self._vae_engines()})

    def _vae_engines(self) -> list:
        """Every live VAE engine on these devices: a released one can outlive its case (a traceback, a local name
        still holds it), so the engine that decoded is the one whose record changed, not the last one found."""
        from h3ms_async.vae.split import live_vae_engines
        return [e for e in live_vae_engines() if e.devices == self.devices]

    def _new_records(self) -> list[dict]:
        if self.program == "dit":
            from h3ms_async.status.hub import RING_SIZE, get_hub
            return get_hub().recent_steps(RING_SIZE, after=self._before)
        if self.program == "attention":
            from h3ms_async.attention.engine import live_engines
            out = []
            for e in live_engines():
                before = self._before.get(e, 0)
                out += [c for c in e.recent_calls() if c["call"] > before]
            return out
        return [e.last_record for e in self._vae_engines()
                if e.last_record is not None and e.last_record is not self._before.get(e)]

    def _records_kept(self) -> int:
        """How many of its latest records the engine keeps."""
        if self.program == "dit":
            from h3ms_async.status.hub import RING_SIZE
            return RING_SIZE
        if self.program == "attention":
            from h3ms_async.attention.engine import RECENT_CALLS
            return RECENT_CALLS
        return 1

    def _verdicts(self) -> str:
        """The probe's latest verdicts other than exact, for a failure message: the ops that differed (not the rows of
        the ops refused with them)."""
        from h3ms_async.status.hub import get_hub
        rows = [v for v in get_hub().exactness()["verdicts"]
                if v["program"] == self.program and v["verdict"] != "exact"]
        causes = [v for v in rows if "another op differs" not in v["detail"]] or rows
        return "; ".join(f"{v['verdict']}: {v['op']} on {v['device']}: {v['detail']}" for v in causes[-3:]) or "none"

    def _failure(self) -> str | None:
        self.records = self._new_records()
        made = len(self.calls) if self.program != "vae" else 1
        what = {"dit": "diffusion-model call(s)", "attention": "attention call(s)", "vae": "decode(s)"}[self.program]
        if not made:
            return f"the block made no {what}"
        kept = self._records_kept()
        if made > kept:
            return f"the block made {made} {what}; the engine keeps the records of its last {kept}: wrap fewer"
        if self.unsplit:
            if self.records:
                return f"{len(self.records)} of {made} {what} split where the case expects ComfyUI's own path"
            return None
        if len(self.records) != made:
            return (f"{made - len(self.records)} of {made} {what} ran ComfyUI's own path, not the split (a refused "
                    "plan runs unsplit and equals ComfyUI trivially; if the case expects that, say unsplit=True). "
                    f"The probe's latest non-exact verdicts: {self._verdicts()}")
        for rec, call in zip(self.records, self.calls or [()]):
            if self.program == "dit":
                why = dit_step_failure(rec, self.devices, *call)
            elif self.program == "attention":
                why = attention_call_failure(rec, self.devices, *call)
            else:
                why = vae_decode_failure(rec, self.devices, self.dropped)
            if why is not None:
                return why
        return None

    def summary(self) -> dict:
        """JSON for a case's report: the calls made, how many split, each rank's share of the last one, and
        :attr:`failure`."""
        last = self.records[-1] if self.records else None
        if last is None:
            share = None
        elif self.program == "vae":
            share = last["chunks_per_rank"]
        else:
            key = "tokens" if self.program == "dit" else "heads"
            share = [b - a for a, b in (r[key] for r in last["ranks"])]
        return {"program": self.program, "devices": self.devices, "unsplit": self.unsplit,
                "calls": len(self.calls) if self.program != "vae" else 1, "split": len(self.records),
                "share": share, "failure": self.failure}
