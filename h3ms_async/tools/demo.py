"""``python -m h3ms_async demo``: the reference H3 DiT unsplit, then split across rank workers,
compared bit for bit.

The default model finishes in well under two minutes on 2 CPU cores.  ``--weights auto`` (the
default) picks what this machine computes fast: int8 on CUDA; on a CPU the fastest of int8 / bf16 /
fp32 linears, timed here (int8 GEMMs are slow on CPUs without VNNI).  On a CPU every format computes
in fp32, as ComfyUI computes bf16 and int8 checkpoints there (``reference.compute_dtype``): the
unsplit pass stands in for ComfyUI, and bf16 GEMMs, whose kernels (AMX, AVX-512-bf16) may round a
row differently with the row count, are never what it runs.  Every size is an option, up to the full
H3 width on CUDA ranks.

The step times compare like with like: the unsplit model's weights are generated once and kept on
its device, as ComfyUI keeps a loaded model (or no figures are printed when they do not fit), and
the summary averages the steps after the first, which pays both sides' one-time kernel loading.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from h3ms_async.log import above_bars, ensure_console_handler, get_logger

# Only light modules here: a mistyped option is answered before torch is imported (seconds on a busy
# 2-core box).
from h3ms_async.runtime import plans, rundir
from h3ms_async.tools.cli import ArgParser, UsageError, add_pattern_argument, port, positive_int
from workers.dit.protocol import MAX_HEAD_PIECES, Transport

if TYPE_CHECKING:
    import torch

    from h3ms_async.dit.reference import DiTConfig

log = get_logger("demo")

WEIGHT_KINDS = ("int8", "bf16", "fp32")  # reference_dit.WEIGHT_KINDS, which imports torch
#: ``--weights auto`` keeps int8 (H3's own format) on a CPU unless its linears are this much slower
#: than a float's.
INT8_SLOWDOWN_TOLERATED = 1.25
#: How often the bar redraws even when no block finished (a block can take seconds on a slow
#: machine).
TICK_S = 1.0
CPU_DEFAULT_TOKENS = 3000
#: Enough for 3 ranks of the demo's 8 heads on an H200 to stay on FlashAttention's exact schedule
#: (split.py).
CUDA_DEFAULT_TOKENS = 8000
#: The unsplit model is kept on its device only when it takes at most this share of the device's
#: free memory.
RESIDENT_SHARE = 0.5
MIN_HEAD_DIM = 6  # the rope rotates 3 axes, each needs at least one cos/sin pair


def build_parser() -> argparse.ArgumentParser:
    p = ArgParser(prog="python -m h3ms_async demo", description=__doc__.splitlines()[0])
    p.add_argument(
        "--ranks",
        default="cpu,cpu,cpu",
        help="one device per rank, e.g. cpu,cpu,cpu or cuda:0,cuda:0,cuda:1",
    )
    p.add_argument(
        "--device",
        default=None,
        help="device of the unsplit run (default: the first rank's device)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help=f"packed sequence length S (default 3000 on CPU ranks, {CUDA_DEFAULT_TOKENS} with a "
        "CUDA rank: fewer make CUDA attention's schedule depend on the head count, so the split "
        "refuses them)",
    )
    p.add_argument("--layers", type=positive_int, default=6, help="number of DiT blocks")
    p.add_argument("--hidden", type=positive_int, default=512, help="hidden size H (full H3: 5376)")
    p.add_argument("--heads", type=positive_int, default=8, help="attention heads (full H3: 56)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (full H3: 128)")
    p.add_argument(
        "--ffn",
        type=positive_int,
        default=None,
        help="MLP width (default: 8/3 of hidden, rounded to 64; H3: 14336)",
    )
    p.add_argument(
        "--weights",
        choices=("auto", *WEIGHT_KINDS),
        default="auto",
        help="block weight format; auto: int8 on CUDA, on a CPU the fastest format on this machine",
    )
    p.add_argument(
        "--exchange",
        choices=[Transport.HOST.value, Transport.NCCL.value],
        default="host",
        help="rank exchange transport (nccl: gloo on CPU ranks)",
    )
    p.add_argument(
        "--exchange-chunks",
        type=int,
        default=0,
        help="pipelined chunks per exchange, 0-32 (0/1: single shot)",
    )
    p.add_argument(
        "--head-pieces",
        type=int,
        default=0,
        help="attention in this many head pieces per rank, each moved while the next computes, "
        f"0-{MAX_HEAD_PIECES} (0/1: one call; used where the probe measures the pieces exact)",
    )
    add_pattern_argument(p)
    p.add_argument(
        "--gather-overlap",
        action="store_true",
        help="each rank's qkv projection runs on every rank's gathered rows as they arrive (used "
        "where the probe measures those row ranges exact)",
    )
    p.add_argument(
        "--shares", default="", help="relative speed per rank, e.g. 1,1,0.7 (default: equal)"
    )
    p.add_argument("--vram-residency", choices=["auto", "resident", "stream"], default="auto")
    p.add_argument(
        "--steps", type=positive_int, default=2, help="denoising steps to run (each compared)"
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--verify",
        action="store_true",
        help="also run the first split step unsplit on the first rank's device inside the engine "
        "and compare (the node's verify setting): logs 'bit-exact on <devices>' or where it "
        "differs",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument(
        "--serve",
        type=port,
        default=None,
        metavar="PORT",
        help="serve the status routes and live panel on 127.0.0.1:PORT while running (0: any free "
        "port)",
    )
    return p


def _devices(flag: str, spec: str) -> list[str]:
    """Parse a device list and check every CUDA index exists in this torch (imported only for CUDA
    devices)."""
    try:
        devices = plans.rank_map(spec)
    except plans.GPUSelectionError as exc:
        raise UsageError(f"{flag} {spec!r}: {exc}") from None
    cuda = [d for d in devices if d.startswith("cuda")]
    if not cuda:
        return devices
    import torch

    if not torch.cuda.is_available():
        raise UsageError(
            f"{flag} {spec!r}: this torch ({torch.__version__}) sees no CUDA GPU; use {flag} "
            "cpu,cpu,cpu or install a CUDA build of torch (H3MS_TORCH_SPEC)"
        )
    n = torch.cuda.device_count()
    missing = sorted({d for d in cuda if int(d.split(":")[1]) >= n})
    if missing:
        raise UsageError(
            f"{flag} {spec!r}: {', '.join(missing)} does not exist; this machine has {n} CUDA "
            f"GPU(s), cuda:0 to cuda:{n - 1}"
        )
    return devices


def _config(a: argparse.Namespace) -> DiTConfig:
    from h3ms_async.dit.reference import DiTConfig

    ffn = a.ffn or max(64, (a.hidden * 8 // 3) // 64 * 64)
    rope_pairs = min(48, (a.head_dim // 2) // 3 * 3)
    return DiTConfig(
        hidden=a.hidden,
        layers=a.layers,
        heads=a.heads,
        head_dim=a.head_dim,
        ffn=ffn,
        t_dim=max(16, a.hidden // 2),
        rope_pairs=rope_pairs,
    )


def _layout(tokens: int) -> Any:
    from h3ms_async.dit.layout import layout_for_tokens

    try:
        return layout_for_tokens(tokens)
    except ValueError:
        least = next(n for n in range(tokens + 1, 1 << 20) if _layout_fits(n))
        raise UsageError(
            f"--tokens {tokens}: too few for the demo's text+audio+video layout; use --tokens "
            f"{least} or more"
        ) from None


def _layout_fits(tokens: int) -> bool:
    from h3ms_async.dit.layout import layout_for_tokens

    try:
        layout_for_tokens(tokens)
        return True
    except ValueError:
        return False


def check_args(a: argparse.Namespace) -> dict:
    """Every input checked before anything heavy starts; raises ``UsageError`` naming the input and
    the fix.

    Only the CUDA-rank and token-layout checks import torch."""
    ranks = _devices("--ranks", a.ranks)
    device_name = _devices("--device", a.device)[0] if a.device else ranks[0]
    try:
        shares = plans.parse_shares(a.shares) or None
    except plans.GPUSelectionError as exc:
        raise UsageError(f"--shares {a.shares!r}: {exc}") from None
    if shares is not None and len(shares) != len(ranks):
        raise UsageError(
            f"--shares {a.shares!r} gives {len(shares)} value(s) for {len(ranks)} ranks; give one "
            "per rank or leave it out"
        )
    if not 0 <= a.exchange_chunks <= 32:
        raise UsageError(
            f"--exchange-chunks {a.exchange_chunks}: use 0 to 32 (0/1: single shot, 8 recommended)"
        )
    if not 0 <= a.head_pieces <= MAX_HEAD_PIECES:
        raise UsageError(
            f"--head-pieces {a.head_pieces}: use 0 to {MAX_HEAD_PIECES} (0/1: attention in one "
            "call)"
        )
    if a.head_dim < MIN_HEAD_DIM:
        raise UsageError(
            f"--head-dim {a.head_dim}: the rope needs at least {MIN_HEAD_DIM} dims per head (3 "
            f"axes x a cos/sin pair); use --head-dim {MIN_HEAD_DIM} or more (full H3: 128)"
        )
    if a.tokens is None:
        a.tokens = (
            CUDA_DEFAULT_TOKENS if any(r.startswith("cuda") for r in ranks) else CPU_DEFAULT_TOKENS
        )
    if a.tokens < 1:
        raise UsageError(
            f"--tokens {a.tokens}: the packed sequence needs a positive number of tokens; use e.g. "
            "--tokens 3000"
        )
    try:
        plans.make_split_plan(ranks, shares, a.tokens, a.heads)
    except plans.GPUSelectionError as exc:
        raise UsageError(
            f"--ranks {a.ranks!r} with --heads {a.heads} and --tokens {a.tokens}: {exc}"
        ) from None
    try:
        rundir.check_base()
    except rundir.RunDirError as exc:
        raise UsageError(str(exc)) from None
    return {"ranks": ranks, "device": device_name, "shares": shares, "layout": _layout(a.tokens)}


def _seconds_per_linear(kind: str, cfg: DiTConfig, device: torch.device) -> float:
    """Best of three timings of one qkv-sized linear over 512 rows in ``kind`` weights, computed as
    the demo computes them on ``device`` (dit_ops' own path)."""
    import torch

    from h3ms_async.dit.reference import compute_dtype, quantize_rowwise
    from workers.dit import ops as dit_ops

    gen = torch.Generator().manual_seed(0)
    stored = torch.float32 if kind == "fp32" else torch.bfloat16
    x = torch.randn(512, cfg.hidden, generator=gen).to(device, compute_dtype(kind, device.type))
    w = (0.02 * torch.randn(3 * cfg.heads * cfg.head_dim, cfg.hidden, generator=gen)).to(stored)
    scale = None
    if kind == "int8":
        w, scale = quantize_rowwise(w)
        scale = scale.to(device)
    w = w.to(device)
    best = float("inf")
    with torch.inference_mode():
        for i in range(4):
            t = time.perf_counter()
            dit_ops.linear(x, w, scale)
            if i:  # the first call warms the kernels up
                best = min(best, time.perf_counter() - t)
    return best


def pick_weights(device: torch.device, cfg: DiTConfig) -> tuple[str, str]:
    """``--weights auto``: ``(kind, why)``. int8 on CUDA; on a CPU the fastest format measured here,
    int8 kept unless it is more than ``INT8_SLOWDOWN_TOLERATED`` times slower."""
    if device.type == "cuda":
        return "int8", "int8 on CUDA"
    times = {k: _seconds_per_linear(k, cfg, device) for k in WEIGHT_KINDS}
    fastest = min(times, key=times.__getitem__)
    kind = "int8" if times["int8"] <= INT8_SLOWDOWN_TOLERATED * times[fastest] else fastest
    measured = ", ".join(f"{k} {t * 1e3:.1f} ms" for k, t in times.items())
    return (
        kind,
        f"fastest on this CPU (one linear: {measured}); --weights int8 forces H3's int8 format",
    )


def compute_note(weights: str, device: torch.device) -> str:
    """What the demo's log line says about the compute dtype, and why."""
    if device.type == "cpu":
        return (
            "computed in fp32: on a CPU ComfyUI casts bf16 and int8 checkpoints to fp32 per layer, "
            "and the split must give what ComfyUI gives"
        )
    dtype = "fp32" if weights == "fp32" else "bf16"
    return f"computed in {dtype} on {device.type}, as ComfyUI does there"


def model_nbytes(model: Any) -> int:
    """Bytes of all the model's blocks (block 0's tensors, times the blocks)."""
    return model.config.layers * sum(
        t.numel() * t.element_size() for t in model.block_weights(0).values()
    )


def keep_resident(model: Any, device: torch.device, nbytes: int) -> bool:
    """Generate the unsplit model's weights once and keep them on ``device`` (what ComfyUI holds
    between steps), when they take at most ``RESIDENT_SHARE`` of its free memory; otherwise every
    unsplit step generates them anew and its time is no comparison.  Returns whether they are
    kept."""
    import psutil
    import torch

    free = (
        torch.cuda.mem_get_info(device)[0]
        if device.type == "cuda"
        else psutil.virtual_memory().available
    )
    if nbytes > RESIDENT_SHARE * free:
        return False
    model.materialize()
    return True


class _Progress:
    """One bar over every block of every pass; redrawn each second so the clock moves even inside a
    slow block.  Log lines print above it while it lives."""

    def __init__(self, total: int, disable: bool) -> None:
        from tqdm import tqdm

        self._scope = contextlib.ExitStack()
        self._scope.enter_context(above_bars())
        self.bar = tqdm(
            total=total,
            desc="starting workers",
            unit="block",
            file=sys.stderr,
            disable=disable,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} blocks [{elapsed}]",
            # blocks take seconds: draw every one
            dynamic_ncols=True,
            mininterval=0,
            miniters=1,
        )
        self._base: float = 0  # tqdm counts in floats
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="h3ms-demo-bar", daemon=True)
        if not disable:
            self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            self.bar.refresh()

    def phase(self, desc: str) -> None:
        """A new pass starts; its blocks count from the bar's current position."""
        self._base = self.bar.n
        self.bar.set_description_str(desc)

    def blocks(self, done: int) -> None:
        """``done`` blocks of the current pass are finished."""
        self.bar.update(self._base + done - self.bar.n)

    def close(self) -> None:
        self._stop.set()
        if self._ticker.is_alive():
            self._ticker.join()
        self.bar.close()
        self._scope.close()


class StepResult(TypedDict):
    """One step of the demo: its times and how the split output compares with the unsplit one
    (None: the step ran unsplit, nothing was compared)."""

    step: int
    unsplit_s: float | None
    split_s: float
    split: bool
    bit_exact: bool | None
    max_abs_diff: float | None


def run(a: argparse.Namespace, checked: dict | None = None) -> dict:
    """Run the demo; returns the result object (what ``--json`` prints)."""
    import psutil
    import torch

    from h3ms_async.dit.errors import SplitUnsafe
    from h3ms_async.dit.options import SplitOptions
    from h3ms_async.dit.reference import ReferenceDiT, make_step_inputs
    from h3ms_async.dit.split import get_engine
    from h3ms_async.dit.step import Step
    from h3ms_async.runtime.spawn import cpu_thread_env

    c = checked or check_args(a)
    ranks, device, layout, cfg = c["ranks"], torch.device(c["device"]), c["layout"], _config(a)
    if device.type == "cpu" and (rank_threads := cpu_thread_env(ranks).get("OMP_NUM_THREADS")):
        # The unsplit pass computes with a CPU rank's thread count: on a busy machine more OpenMP
        # threads than free cores stall on each other (the unsplit pass took 10x the split's on a
        # loaded 2-core box).
        torch.set_num_threads(int(rank_threads))
    weights, why = (
        (a.weights, "given by --weights") if a.weights != "auto" else pick_weights(device, cfg)
    )
    log.info("weights %s (%s); %s", weights, why, compute_note(weights, device))
    model = ReferenceDiT(cfg, weights=weights, seed=a.seed, device=device)
    dtype = model.compute_dtype
    # bf16 q/k norm weights on an fp32 stream: kitchen's rms_rope upcasts them unfused, as in
    # ComfyUI on a CPU (norm weights are moved, not cast: docs/comfyui_facts.md); torch's note about
    # the unfused path says nothing new here.
    warnings.filterwarnings(
        "ignore", message="Mismatch dtype between input and weight", category=UserWarning
    )
    nbytes = model_nbytes(model)
    timed = keep_resident(model, device, nbytes)
    if not timed:
        log.info(
            "no speed figures: the unsplit model (%.1f GiB) does not fit on %s at once, so each "
            "unsplit step generates its weights anew",
            nbytes / 2**30,
            device,
        )
    # The unsplit pass stands in for ComfyUI, whose process is long warm when a split starts; the
    # ranks warm up at load (dit_ops.warm_up), so must this side, or its first CUDA attention call
    # rounds differently.
    from workers.dit import ops as dit_ops

    dit_ops.warm_up(dit_ops.builtin_attend("sdpa"), device, [dtype])
    engine = get_engine(
        ranks,
        SplitOptions(
            exchange=a.exchange,
            exchange_chunks=a.exchange_chunks,
            head_pieces=a.head_pieces,
            gather_overlap=a.gather_overlap,
            pattern=a.pattern,
            vram_residency=a.vram_residency,
            shares=c["shares"],
            verify=a.verify,
        ),
    )
    bar = _Progress(a.steps * 2 * cfg.layers, disable=a.json)
    steps: list[StepResult] = []
    try:
        t = time.perf_counter()
        first = make_step_inputs(cfg, layout, a.seed, dtype)
        # as the node does: the first step's plan is probed on the ranks while the store fills
        engine.load_weights(
            ("demo", a.seed, weights, cfg),
            cfg,
            model.block_weights,
            compute_dtype=dtype,
            first_step=Step(
                first.x, model.modulation(first.t_emb), first.segments, first.rope_freqs, sigma=0.7
            ),
        )
        start_s = time.perf_counter() - t
        for s in range(a.steps):
            inp = make_step_inputs(cfg, layout, a.seed + s, dtype)
            bar.phase(f"step {s + 1}/{a.steps} unsplit")
            t = time.perf_counter()
            ref = model.forward_blocks(
                inp.x.clone().to(device),
                inp.t_emb.to(device),
                inp.segments,
                inp.rope_freqs.to(device),
                on_block=lambda i: bar.blocks(i + 1),
            ).cpu()
            unsplit_s = time.perf_counter() - t
            bar.phase(f"step {s + 1}/{a.steps} split on {len(ranks)} ranks")
            t = time.perf_counter()
            try:
                out = engine.run_blocks(
                    inp.x,
                    model.modulation(inp.t_emb),
                    inp.segments,
                    inp.rope_freqs,
                    sigma=0.7,
                    progress=lambda done, total: bar.blocks(done),
                )
            except SplitUnsafe as exc:
                # measured not bit-exact on these ranks: the step runs unsplit, as the node does
                # (warned once)
                if exc.first:
                    log.warning("%s; running this step unsplit", exc)
                out = ref
            split_s = time.perf_counter() - t
            ran_split = out is not ref
            # a step that ran unsplit compared nothing: no verdict, not a trivial "equal"
            steps.append(
                {
                    "step": s,
                    "unsplit_s": unsplit_s if timed else None,
                    "split_s": split_s,
                    "split": ran_split,
                    "bit_exact": bool(torch.equal(out, ref)) if ran_split else None,
                    "max_abs_diff": float((out.float() - ref.float()).abs().max())
                    if ran_split
                    else None,
                }
            )
    finally:
        bar.close()
    from h3ms_async.status.hub import get_hub

    last = (get_hub().recent_steps(1) or [{"ranks": []}])[-1]  # none when every step ran unsplit
    return {
        "config": {
            "tokens": layout.seq_len,
            "layers": cfg.layers,
            "hidden": cfg.hidden,
            "heads": cfg.heads,
            "head_dim": cfg.head_dim,
            "ffn": cfg.ffn,
            "weights": weights,
            "ranks": ranks,
            "exchange": engine.transport,
            "exchange_chunks": a.exchange_chunks,
            "head_pieces": a.head_pieces,
            "gather_overlap": a.gather_overlap,
            "shares": c["shares"],
            "unsplit_device": str(device),
            "compute_dtype": str(dtype).removeprefix("torch."),
        },
        "worker_start_and_load_s": start_s,
        "steps": steps,
        "ranks": last["ranks"],
        "bit_exact": split_verdict(steps),
        "max_abs_diff": max(
            (d for s in steps if (d := s["max_abs_diff"]) is not None), default=None
        ),
        # from the process start: what a user waits for, imports and worker start included
        "total_s": time.time() - psutil.Process().create_time(),
    }


def split_verdict(steps: Sequence[StepResult]) -> bool | None:
    """Whether every step that ran split equals the unsplit step; None when none ran split (a plan
    the probe refused runs unsplit, so there is nothing to compare)."""
    compared = [s["bit_exact"] for s in steps if s["split"]]
    return all(compared) if compared else None


def summary_line(res: dict) -> str:
    """The demo's last line (the README quotes it): the verdict over the steps that ran split, and
    the mean step times of the warm split steps (all but the first, when there are more)."""
    n = len(res["steps"])
    split_steps = sum(s["split"] for s in res["steps"])
    unsplit_note = "the plan is not exact on these ranks: nothing to compare"
    if res["bit_exact"] is None:
        return f"bit-exact: not measured - all {n} steps ran unsplit ({unsplit_note})"
    warm = [s for s in res["steps"][1:] or res["steps"] if s["split"]]
    verdict = (
        "equal" if res["bit_exact"] else f"DIFFERENT (max abs difference {res['max_abs_diff']:g})"
    )
    where = f"on all {n} steps" if split_steps == n else f"on the {split_steps} split steps of {n}"
    if split_steps < n:
        where += f" ({n - split_steps} ran unsplit: {unsplit_note})"
    ranks = len(res["config"]["ranks"])
    if res["steps"][0]["unsplit_s"] is None:
        speed = (
            "no speed figures (the unsplit model does not fit on "
            f"{res['config']['unsplit_device']} at once)"
        )
    elif not warm:
        speed = "no speed figures (no warm step ran split)"
    else:
        unsplit = sum(s["unsplit_s"] for s in warm) / len(warm)
        split = sum(s["split_s"] for s in warm) / len(warm)
        speed = f"unsplit {unsplit:.2f} s/step, split {split:.2f} s/step on {ranks} ranks"
    return (
        f"bit-exact: {'yes' if res['bit_exact'] else 'no'} - split vs unsplit {verdict} {where}; "
        f"{speed}; demo {res['total_s']:.0f} s"
    )


def print_table(res: dict) -> None:
    c = res["config"]
    print(
        f"\nreference H3 DiT: {c['tokens']} tokens x {c['layers']} blocks, hidden {c['hidden']}, "
        f"{c['heads']} heads x {c['head_dim']}, ffn {c['ffn']}, {c['weights']} weights computed in "
        f"{c['compute_dtype']}"
    )
    pieces = c["head_pieces"]
    print(
        f"split over {len(c['ranks'])} ranks ({','.join(c['ranks'])}), exchange {c['exchange']}"
        f"{' x' + str(c['exchange_chunks']) if c['exchange_chunks'] > 1 else ''}"
        f"{f', attention in {pieces} head pieces' if pieces > 1 else ''}"
        f"{', qkv as the rows arrive' if c['gather_overlap'] else ''}; "
        f"workers started and weights loaded in {res['worker_start_and_load_s']:.1f}s\n"
    )
    for s in res["steps"]:
        unsplit = "not timed" if s["unsplit_s"] is None else f"{s['unsplit_s']:.3f}s"
        print(
            f"step {s['step']}: unsplit {unsplit}   split {s['split_s']:.3f}s   "
            + (
                ("equal" if s["bit_exact"] else "DIFFERENT")
                if s["split"]
                else "ran unsplit (the plan is not exact here): nothing to compare"
            )
        )
    print("\nlast split step, per rank:")
    print(
        f"{'rank':>4} {'device':>8} {'tokens':>13} {'heads':>7} {'compute s':>10} "
        f"{'exchange s':>11} "
        f"{'wait s':>8} {'MB moved':>9}"
    )
    for r in res["ranks"]:
        print(
            f"{r['rank']:>4} {r['device']:>8} {r['tokens'][0]:>6}-{r['tokens'][1]:<6} "
            f"{r['heads'][0]:>3}-{r['heads'][1]:<3} {r['compute_s']:>10.3f} "
            f"{r['exchange_s']:>11.3f} {r['wait_s']:>8.3f} {r['moved_bytes'] / 1e6:>9.2f}"
        )
    print()
    print(summary_line(res))


def _released(action: Callable[[], Any]) -> None:
    """Run a release step; one failing (already gone) must not hide the demo's own outcome."""
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - reported, and the other release steps still run
        log.warning("release: %s", exc)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m h3ms_async demo``; returns 0 when every split step is bit-exact (or none ran
    split), 1 when one is not, 2 on a bad input (one line on stderr), 130 / 143 when Ctrl-C /
    SIGTERM ended it (one line, everything released: ``lifetime.run_guarded``)."""
    a = build_parser().parse_args(argv)
    checked = check_args(a)
    from h3ms_async.dit.split import release_all_engines
    from h3ms_async.runtime.weight_store import WeightStoreRefused
    from h3ms_async.tools.lifetime import run_guarded
    from workers.runtime.shm import ShmError

    stop = None

    def body() -> int:
        nonlocal stop
        if a.serve is not None:
            # before the console handler: a bind error is then the only line printed
            from h3ms_async.observability.serve import start_background_server
            from h3ms_async.tools.serve import bind_error_text

            try:
                url, stop = start_background_server(port=a.serve)
            except OSError as exc:
                raise UsageError(bind_error_text("--serve", "127.0.0.1", a.serve, exc)) from None
            print(f"live panel: {url}/h3multistream/panel", file=sys.stderr)
        if not a.json:
            ensure_console_handler()
        try:
            res = run(a, checked)
        except (WeightStoreRefused, ShmError) as exc:
            # the machine's limits: the message names them and the fix
            raise UsageError(str(exc)) from None
        if a.json:
            print(json.dumps(res, indent=2))
        else:
            print_table(res)
        sys.stdout.flush()
        return 1 if res["bit_exact"] is False else 0

    def release() -> None:
        _released(release_all_engines)
        if stop is not None:
            _released(stop)

    return run_guarded(body, release, "demo")
