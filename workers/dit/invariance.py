"""Row and head invariance, measured on the device that runs the split (the probe behind
``dit_probe``).

A token split is exact only if every GEMM of the block gives a row the same bits whatever the number
of rows computed with it, and a head split only if attention gives a head the same bits whatever the
other heads in the call.  Kernel libraries choose kernels by shape and by CPU/GPU model, so the
engine measures it here, per device, before a plan is used: random data of the real shapes (kernel
choice does not depend on the values) through the unsplit call and the shard calls, compared with
``torch.equal``.  The calls are the ones the rank makes (``workers.dit.ops``: ``linear``,
``slice_qkv_weights``, ``qkv_views``/``attend_views`` with the rank's attention function), never
copies of them.

One random buffer per dtype is drawn once per probe and every op's inputs and weights are views of
it.  Its values repeat with a prime period from a fixed CPU seed, so every device computes on the
same numbers and the full products' digests (:func:`digest`) can be compared across ranks sitting on
different GPU models.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch

from workers.dit import ops as dit_ops
from workers.dit import sparse as dit_sparse
from workers.dit.protocol import (
    LinearOp,
    OpVerdict,
    ProbeReport,
    ProbeShard,
    SparseProbeSettings,
    Split,
)
from workers.dit.weights import BlockView
from workers.transports.arena import piece

#: Period of the random buffer's values (a prime, so no row of any H3 width repeats another).
_PERIOD = 65521
_SEED = 20260321
#: Elements per piece when digesting (bounds the int64 working copy).
_DIGEST_CHUNK = 1 << 24
#: Op names in block order (the order a verdict's first failing op is named in).
OP_ORDER = (
    "attn.qkv_proj",
    "attn.qkv_proj.rows",
    "attn.qkv_proj.chunks",
    "attention",
    "attention.pieces",
    "attention.sparse",
    "attn.out_proj",
    "attn.out_proj.tail",
    "mlp.fc1",
    "mlp.fc1.tail",
    "mlp.fc2",
    "mlp.fc2.tail",
)
#: The linears of a block's tail (``gather_ahead`` runs them in row pieces).
TAIL_LINEARS = ("attn.out_proj", "mlp.fc1", "mlp.fc2")


def fingerprint(device: torch.device) -> dict[str, str]:
    """What a kernel choice may depend on besides the shape: device model, runtime, torch,
    comfy-kitchen, CPU ISA."""
    from importlib import metadata

    try:
        kitchen = metadata.version("comfy-kitchen")
    except metadata.PackageNotFoundError:
        kitchen = "unknown"
    out = {"torch": str(torch.__version__), "comfy_kitchen": kitchen}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out["device"] = f"{device} {props.name}"
        out["runtime"] = (
            f"cuda {torch.version.cuda} sm_{props.major}{props.minor} cudnn "
            f"{torch.backends.cudnn.version()}"
        )
        out["driver"] = _nvidia_driver()
    else:
        out["device"] = f"cpu {_cpu_model()}"
        out["runtime"] = (
            f"{torch.backends.cpu.get_cpu_capability()} "
            f"onednn_isa={os.environ.get('ONEDNN_MAX_CPU_ISA', 'default')} "
            f"mkl_cbwr={os.environ.get('MKL_CBWR', 'default')}"
        )
    return out


def _nvidia_driver() -> str:
    """The kernel driver's version (a driver update may change which kernels a library picks)."""
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            first = f.readline()
    except OSError:
        return "unknown"
    return next((w for w in first.split() if w[:1].isdigit() and "." in w), "unknown")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def digest(t: torch.Tensor) -> str:
    """A checksum of ``t``'s bits computed on its device (no copy to the host): equal tensors give
    equal digests, and any bit flip changes it (a position-weighted integer sum, exact and
    order-free on every device)."""
    flat = t.detach().contiguous().view(-1)
    bits = flat.view(
        {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    )
    acc = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, bits.numel(), _DIGEST_CHUNK):
        piece = bits[start : start + _DIGEST_CHUNK].to(torch.int64)
        idx = torch.arange(start, start + piece.numel(), dtype=torch.int64, device=t.device)
        acc += (piece * (idx * 2654435761 % 2147483629 + 1)).sum()
    return f"{tuple(t.shape)}:{t.dtype}:{int(acc):x}"


class RandomPool:
    """One random buffer per dtype, grown to the largest view asked for; every op's tensors are
    views of it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: dict[torch.dtype, torch.Tensor] = {}

    def reserve(self, dtype: torch.dtype, numel: int) -> None:
        """Make the ``dtype`` buffer hold at least ``numel`` elements (drawn once, before the timed
        calls)."""
        buf = self._bufs.get(dtype)
        if buf is not None and buf.numel() >= numel:
            return
        gen = torch.Generator().manual_seed(_SEED)
        if dtype == torch.int8:
            base = torch.randint(-127, 128, (_PERIOD,), generator=gen, dtype=torch.int8)
        else:
            base = (torch.randn(_PERIOD, generator=gen) * 0.5).to(dtype)
        reps = -(-numel // _PERIOD)
        self._bufs[dtype] = base.to(self.device).repeat(reps)[:numel]

    def view(self, dtype: torch.dtype, *shape: int) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        self.reserve(dtype, n)
        return self._bufs[dtype][:n].view(*shape)


def _weights(
    pool: RandomPool, op: LinearOp, act: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, dit_ops.QuantInfo]:
    wdt = getattr(torch, op.weight_dtype)
    w = pool.view(wdt, op.out_features, op.in_features)
    scale = None
    if wdt == torch.int8:
        scale = torch.full(
            (op.scale_numel,) if op.scale_numel > 1 else (),
            1e-3,
            dtype=torch.float32,
            device=pool.device,
        )
    bias = pool.view(wdt if wdt != torch.int8 else act, op.out_features) if op.bias else None
    return w, scale, bias, dit_ops.QuantInfo(op.convrot, op.convrot_groupsize)


def _linear_dtype(op: LinearOp, act: torch.dtype) -> str:
    """A linear's dtype as a verdict names it: ``int8`` (``+convrot``) or the activation dtype."""
    if op.weight_dtype == "int8":
        return "int8" + ("+convrot" if op.convrot else "")
    return str(act).split(".")[-1]


def _in_features(op: LinearOp) -> int:
    return op.in_features * (2 if op.input_act == "swiglu" else 1)


class Clock:
    """Wall time of device work: synchronises a CUDA device before reading the clock."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> float:
        self.sync()
        return time.perf_counter()

    def ms(self, t0: float) -> float:
        self.sync()
        return round((time.perf_counter() - t0) * 1e3, 3)


def _compare(full_part: torch.Tensor, part: torch.Tensor) -> tuple[bool, float]:
    if torch.equal(full_part, part):
        return True, 0.0
    return False, float((full_part.float() - part.float()).abs().max())


class Variant(NamedTuple):
    """One verdict taken from an op's unsplit call: its name, how the call is split, and the
    ranges it is compared on (token ranges, or head groups for attention)."""

    name: str
    split: Split
    ranges: Sequence[tuple[int, int]]


class _Unsplit(NamedTuple):
    """A linear's unsplit call, made once for every shard's verdicts: its input, weights and
    output, the output's digest and the dtype a verdict names."""

    x: torch.Tensor
    w: torch.Tensor
    scale: torch.Tensor | None
    bias: torch.Tensor | None
    quant: dit_ops.QuantInfo
    full: torch.Tensor
    digest: str
    dtype: str


def probe_linear(
    pool: RandomPool,
    op: LinearOp,
    rows: int,
    shards: Sequence[tuple[tuple[int, int], Sequence[Variant]]],
    act: torch.dtype,
    total_heads: int,
    head_dim: int,
    clock: Clock,
) -> list[list[OpVerdict]]:
    """One linear's unsplit call over ``rows`` rows, made once, against each shard's variants
    (``shards``: per rank, its head group and its variants): per token range
    (``split="tokens"``, or ``"tail"``: a rank's tail pieces), the head group's rows of the fused
    qkv weight over every row (``"heads"``) or on each token range (``"rows"``: every rank's
    range).  The first verdict's time includes the unsplit call."""
    t0 = clock.start()
    w, scale, bias, quant = _weights(pool, op, act)
    x = pool.view(act, rows, _in_features(op))
    full = dit_ops.linear(x, w, scale, bias, quant=quant, input_act=op.input_act)
    call = _Unsplit(x, w, scale, bias, quant, full, digest(full), _linear_dtype(op, act))
    out = []
    for heads, variants in shards:
        # the group's weight rows and unsplit columns, made once for its "heads" and "rows" verdicts
        group = functools.cache(functools.partial(_head_group, call, heads, total_heads, head_dim))
        verdicts = []
        for v in variants:
            verdicts.append(_linear_verdict(call, op, heads, v, group, clock, t0))
            t0 = clock.start()
        out.append(verdicts)
    return out


def _head_group(
    call: _Unsplit, heads: tuple[int, int], total_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The fused qkv weight's rows of head group ``heads`` (and their scale), and the unsplit
    call's columns of those rows."""
    g0, g1 = heads
    named = {"attn.qkv_proj.weight": call.w}  # the fused qkv's layout, whatever its name
    if call.scale is not None:
        named["attn.qkv_proj.weight_scale"] = call.scale
    w_g, s_g = dit_ops.slice_qkv_weights(named, g0, g1, total_heads, head_dim)
    rows_of = dit_ops.head_rows(g0, g1, total_heads, head_dim)
    return w_g, s_g, torch.cat([call.full[:, r.start : r.stop] for r in rows_of], dim=1)


def _linear_verdict(
    call: _Unsplit,
    op: LinearOp,
    heads: tuple[int, int],
    v: Variant,
    group: Callable[[], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]],
    clock: Clock,
    t0: float,
) -> OpVerdict:
    """One variant's verdict from the unsplit ``call`` (``group``: :func:`_head_group` of
    ``heads``; its time counted from ``t0``)."""
    x, w, scale, quant, full = call.x, call.w, call.scale, call.quant, call.full
    rows = x.shape[0]
    exact: list[bool] = []
    diffs: list[float] = []
    shards: list[list[int]] = []
    if v.split in ("tokens", "tail"):
        for a, b in v.ranges:
            part = dit_ops.linear(
                x[a:b].clone(), w, scale, call.bias, quant=quant, input_act=op.input_act
            )
            ok, d = _compare(full[a:b], part)
            exact.append(ok)
            diffs.append(d)
            shards.append([a, b])
    elif v.split in ("heads", "rows"):
        g0, g1 = heads
        w_g, s_g, cols = group()
        ranges = [(0, rows)] if v.split == "heads" else list(v.ranges)
        for a, b in ranges:
            xs = x if v.split == "heads" else x[a:b].clone()
            part = dit_ops.linear(xs, w_g, s_g, None, quant=quant)
            ok, d = _compare(cols[a:b], part)
            exact.append(ok)
            diffs.append(d)
            shards.append([g0, g1] if v.split == "heads" else [a, b])
    return OpVerdict(
        v.name,
        call.dtype,
        f"{rows}x{op.out_features}x{op.in_features}",
        v.split,
        shards,
        exact,
        diffs,
        call.digest,
        clock.ms(t0),
    )


class ProbeAborted(RuntimeError):
    """The coordinator aborted the probe (the step it was for was interrupted)."""


def _stop_if(stopped: Callable[[], bool] | None, before: str) -> None:
    if stopped is not None and stopped():
        raise ProbeAborted(f"plan probe aborted by the coordinator before {before}")


def probe_attention(
    pool: RandomPool,
    seq: int,
    shards: Sequence[Sequence[Variant]],
    total_heads: int,
    head_dim: int,
    act: torch.dtype,
    attend: dit_ops.Attend,
    clock: Clock,
    stopped: Callable[[], bool] | None = None,
) -> list[list[OpVerdict]]:
    """Attention over all ``seq`` tokens: every head in one call, made once, against each head
    group of each shard's variants called alone, as a rank lays its q, k, v out (a packed
    projection of the group's heads only; ``dit_ops.attend_head_piece`` lays a head piece out the
    same way).  The first verdict's time includes the whole call.  Between calls it raises
    :class:`ProbeAborted` once ``stopped()``."""
    t0 = clock.start()
    qkv = pool.view(act, seq, 3 * total_heads * head_dim)
    full = dit_ops.attend_views(*dit_ops.qkv_views(qkv, total_heads, head_dim), attend)
    dig = digest(full)
    per_shard: list[list[OpVerdict]] = []
    for variants in shards:
        out: list[OpVerdict] = []
        for v in variants:
            _stop_if(stopped, v.name)
            out.append(
                _attention_verdict(qkv, full, dig, v, total_heads, head_dim, act, attend, clock, t0)
            )
            t0 = clock.start()
        per_shard.append(out)
    return per_shard


def _attention_verdict(
    qkv: torch.Tensor,
    full: torch.Tensor,
    dig: str,
    v: Variant,
    total_heads: int,
    head_dim: int,
    act: torch.dtype,
    attend: dit_ops.Attend,
    clock: Clock,
    t0: float,
) -> OpVerdict:
    """One variant's verdict from the all-heads call ``full`` of ``qkv`` (its time counted from
    ``t0``)."""
    exact: list[bool] = []
    diffs: list[float] = []
    for g0, g1 in v.ranges:
        if (g0, g1) == (0, total_heads):
            continue  # the whole model's heads: the unsplit call itself
        grp = torch.cat(
            [qkv[:, r.start : r.stop] for r in dit_ops.head_rows(g0, g1, total_heads, head_dim)],
            dim=1,
        )
        part = dit_ops.attend_views(*dit_ops.qkv_views(grp, g1 - g0, head_dim), attend)
        ok, d = _compare(full[:, g0 * head_dim : g1 * head_dim], part)
        exact.append(ok)
        diffs.append(d)
    return OpVerdict(
        v.name,
        str(act).split(".")[-1],
        f"{qkv.shape[0]}x{total_heads}x{head_dim}",
        v.split,
        [[g0, g1] for g0, g1 in v.ranges],
        exact,
        diffs,
        dig,
        clock.ms(t0),
    )


def probe_sparse(
    pool: RandomPool,
    op: LinearOp,
    tokens: int,
    heads: tuple[int, int],
    total_heads: int,
    head_dim: int,
    act: torch.dtype,
    eps: float,
    sparse: SparseProbeSettings,
    clock: Clock,
) -> list[OpVerdict]:
    """Sparse attention as a rank runs it (``workers.dit.sparse.SparseStep.attention``, the
    ``dit_probe``'s ``sparse`` settings: ``workers.dit.sparse.probe_wire``) over the head group,
    against the same call over every head: twice, from fresh statistics and then from the ones the
    first call pooled.  Two verdicts: ``attn.qkv_proj.chunks``, each of the kernel's row chunks of
    the group's qkv projection against the whole weight's projection of the same rows, and
    ``attention.sparse``, the group's output and statistics against the whole call's (one entry
    per call).  The first verdict's time includes the whole calls."""
    t0 = clock.start()
    g0, g1 = heads
    w, scale, _, quant = _weights(pool, op, act)
    x = pool.view(act, tokens, op.in_features)
    norm = pool.view(act, head_dim)
    weights = {"attn.q_norm.weight": norm, "attn.k_norm.weight": norm}
    pairs = sparse.rope_pairs
    angle = pool.view(torch.float32, tokens, pairs)
    cos, sin = torch.cos(angle), torch.sin(angle)
    rope = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)
    rope = rope[None, :, None].to(getattr(torch, sparse.rope_dtype))
    named = {"attn.qkv_proj.weight": w}  # the fused qkv's layout, whatever its name
    if scale is not None:
        named["attn.qkv_proj.weight_scale"] = scale
    w_g, s_g = dit_ops.slice_qkv_weights(named, g0, g1, total_heads, head_dim)
    q = {"attn.qkv_proj": quant}

    def calls(blk: BlockView, group: tuple[int, int]) -> list[dict[str, torch.Tensor]]:
        step = dit_sparse.probe_step(sparse, group)
        seen: list[dict[str, torch.Tensor]] = []
        for call in range(2):
            got: dict[str, torch.Tensor] = {}
            step.attention(0, x, blk, rope, group[1] - group[0], head_dim, eps, got.__setitem__)
            if call:  # the same projection again: only the first call's is compared
                del got["attn.qkv_proj"]
            seen.append(got)
        return seen

    full = calls(BlockView(weights, w, scale, q), (0, total_heads))
    part = calls(BlockView(weights, w_g, s_g, q), heads)
    rows_of = dit_ops.head_rows(g0, g1, total_heads, head_dim)
    qkv_full = torch.cat([full[0]["attn.qkv_proj"][:, r.start : r.stop] for r in rows_of], dim=1)
    chunks = [
        (a, min(a + dit_sparse.PRODUCER_CHUNK, tokens))
        for a in range(0, tokens, dit_sparse.PRODUCER_CHUNK)
    ]
    chunk_verdicts = [_compare(qkv_full[a:b], part[0]["attn.qkv_proj"][a:b]) for a, b in chunks]
    group_of = {
        "attention": lambda t: t[:, g0 * head_dim : g1 * head_dim],
        "attention.kmean": lambda t: t[g0:g1],
        "attention.vscale": lambda t: t[g0:g1],
    }
    call_verdicts = []
    for f, p in zip(full, part):
        got = [_compare(cut(f[op]), p[op]) for op, cut in group_of.items()]
        call_verdicts.append((all(ok for ok, _ in got), max(d for _, d in got)))
    shape = f"{tokens}x{total_heads}x{head_dim}"
    out = [
        OpVerdict(
            "attn.qkv_proj.chunks",
            _linear_dtype(op, act),
            f"{tokens}x{op.out_features}x{op.in_features}",
            "chunks",
            [[a, b] for a, b in chunks],
            [ok for ok, _ in chunk_verdicts],
            [d for _, d in chunk_verdicts],
            digest(full[0]["attn.qkv_proj"]),
            clock.ms(t0),
        )
    ]
    t0 = clock.start()
    out.append(
        OpVerdict(
            "attention.sparse",
            "bfloat16",
            shape,
            "heads",
            [[g0, g1]] * len(call_verdicts),
            [ok for ok, _ in call_verdicts],
            [d for _, d in call_verdicts],
            digest(full[0]["attention"]),
            clock.ms(t0),
        )
    )
    return out


def run_probe(
    ops: Sequence[LinearOp],
    *,
    tokens: int,
    shards: Sequence[ProbeShard],
    total_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    attend: dit_ops.Attend,
    device: torch.device,
    pieces: int = 0,
    gather_ranges: Sequence[tuple[int, int]] = (),
    eps: float = 1e-5,
    sparse: SparseProbeSettings | None = None,
    stopped: Callable[[], bool] | None = None,
) -> list[ProbeReport]:
    """Probe every op of ``ops`` and attention on ``device`` for each shard (see the module
    docstring); one report per shard, in order.

    A shard's ``candidates``: its rank's token range in each candidate plan; ``heads``: its head
    group of ``total_heads``; ``tail_ranges``: also the tail's linears on each of these token
    ranges (the rank's row pieces of ``gather_ahead``, ops ``<linear>.tail``).  ``pieces`` > 1:
    also each group's head pieces against the whole call (op ``attention.pieces``);
    ``gather_ranges``: also each group's qkv rows on each of these token ranges (every rank's)
    against the unsplit call (op ``attn.qkv_proj.rows``); ``sparse`` (``dit_probe``'s settings,
    one shard only): also sparse attention as the rank runs it, with the blocks' epsilon ``eps``
    (:func:`probe_sparse`).  Each op's unsplit call is made once for all the verdicts of every
    shard taken from it.  Runs under inference mode and :func:`workers.dit.ops.probing`; the
    random buffers go when it returns.  Every report's ``ms`` is the whole probe's.  Between its
    calls it raises :class:`ProbeAborted` once ``stopped()`` (the coordinator's abort).
    """
    if sparse is not None and len(shards) != 1:
        raise ValueError(f"a sparse probe takes one shard, got {len(shards)}")
    clock = Clock(device)
    reports = [ProbeReport(fingerprint=fingerprint(device)) for _ in shards]
    pool = RandomPool(device)
    t0 = clock.start()
    with torch.inference_mode(), dit_ops.probing():
        for op in ops:
            _stop_if(stopped, op.name)
            asked = []
            for sh in shards:
                variants = [Variant(op.name, op.split, sh.candidates)]
                if gather_ranges and op.name == "attn.qkv_proj":
                    variants.append(Variant("attn.qkv_proj.rows", "rows", gather_ranges))
                if sh.tail_ranges and op.name in TAIL_LINEARS:
                    variants.append(Variant(f"{op.name}.tail", "tail", sh.tail_ranges))
                asked.append((sh.heads, variants))
            got = probe_linear(pool, op, tokens, asked, dtype, total_heads, head_dim, clock)
            for rep, verdicts in zip(reports, got):
                rep.ops += verdicts
        groups = []
        for sh in shards:
            g0, g1 = sh.heads
            mine = [Variant("attention", "heads", [(g0, g1)])]
            if pieces > 1:
                bounds = (piece(g1 - g0, pieces, j) for j in range(pieces))
                parts = [(g0 + a, g0 + b) for a, b in bounds if b > a]
                mine.append(Variant("attention.pieces", "pieces", parts))
            groups.append(mine)
        _stop_if(stopped, "attention")
        got = probe_attention(
            pool, tokens, groups, total_heads, head_dim, dtype, attend, clock, stopped
        )
        for rep, verdicts in zip(reports, got):
            rep.ops += verdicts
        if sparse:
            _stop_if(stopped, "sparse attention")
            qkv = next(op for op in ops if op.name == "attn.qkv_proj")
            reports[0].ops += probe_sparse(
                pool, qkv, tokens, shards[0].heads, total_heads, head_dim, dtype, eps, sparse, clock
            )
    ms = clock.ms(t0)
    for rep in reports:
        rep.ops.sort(key=lambda v: OP_ORDER.index(v.op) if v.op in OP_ORDER else len(OP_ORDER))
        rep.ms = ms
    return reports


def block_ops(
    manifest: Sequence[Mapping[str, tuple[str, Sequence[int]]]],
    quant: Callable[[int], Mapping[str, dit_ops.QuantInfo]],
) -> list[LinearOp]:
    """The distinct linears of a block stack, from each block's ``{name: (dtype, shape)}`` and its
    int8 settings (``quant(i)``, e.g. ``dit_ops.block_quant`` of block i; read only for blocks with
    an int8 linear)."""
    out: dict[LinearOp, None] = {}
    for i, block in enumerate(manifest):
        q = (
            quant(i)
            if any(block.get(f"{n}.weight", ("", ()))[0] == "int8" for n in dit_ops.INT8_LINEARS)
            else {}
        )
        linears: tuple[tuple[str, Split, str | None], ...] = (
            ("attn.qkv_proj", "heads", None),
            ("attn.out_proj", "tokens", None),
            ("mlp.fc1", "tokens", None),
            ("mlp.fc2", "tokens", "swiglu"),
        )
        for name, split, act in linears:
            dt, shape = block[f"{name}.weight"]
            scale = block.get(f"{name}.weight_scale")
            qi = q.get(name, dit_ops.QuantInfo()) if dt == "int8" else dit_ops.QuantInfo()
            n_scale = 0
            if scale is not None:
                n_scale = 1
                for s in scale[1]:
                    n_scale *= int(s)
            out[
                LinearOp(
                    name,
                    int(shape[0]),
                    int(shape[1]),
                    dt,
                    n_scale,
                    dt != "int8" and f"{name}.bias" in block,
                    qi.convrot,
                    qi.convrot_groupsize,
                    act,
                    split,
                )
            ] = None
    return list(out)
