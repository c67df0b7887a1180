"""Speed model of the DiT split: predicted step time and speed-up at N ranks from measured parts.

Per block every rank computes its 1/N shard and runs two collectives (``workers/dit/loop.py``): an
all-gather of the modulated block input (all tokens x hidden) and an all-to-all of the attention
output by head columns.  The Ulysses pattern instead all-to-alls q, k and v (each rank's tokens x
every head) and then the attention output.  The bytes each rank moves per op follow from the token
and head plan exactly as the transports move them:

* host exchange (``workers/transports/host.py``): an all-gather writes a rank's rows to the arena
  once for all peers and reads every peer's rows; an all-to-all writes each peer's rows of its
  columns and reads its own rows of every peer's columns.  A rank without peers moves nothing.
* NCCL (``workers/transports/dist.py``): an all-gather of uneven shards is padded to the largest
  shard, a rank sends and receives (N-1) padded shards; an all-to-all sends and receives exactly
  the rows and columns it owes.
* GPU-direct (``workers/transports/cuda_ipc.py``): a rank publishes its part in its own GPU buffer
  and every peer copies what it needs from there, peer to peer: a rank's link carries out exactly
  what its peers read of it and in what it reads of theirs (no padding, no host memory).

Times: a host-staged op takes each rank's device->host then host->device copies in sequence (the
default, ``exchange_chunks`` 0) at its link rate, bounded below by all ranks' bytes through host
memory; in pieces (the overlaps below) the two copies are two stages of the pipeline, a piece's
copy in running beside the next piece's copy out (``workers/dit/cuda.py`` queues them on two
copy streams); an NCCL op takes the larger of a rank's send and receive bytes at the
collective's bus bandwidth (for an all-gather that is the nccl-tests "busbw" convention); a
GPU-direct op the larger of a rank's out and in bytes at the peer-to-peer copy rate (on logical
ranks of one GPU, every rank's in bytes through that GPU's memory, one after another).  Ranks
on several hosts add the bytes each host must receive from the others over its network link,
after the intra-host part (no overlap of the two levels).

The schedule: by default every op waits for the compute before it and the next compute waits for its
bytes, so the exposed exchange is the whole exchange time.  The overlaps the split implements
(``SplitOptions.head_pieces``, ``gather_overlap``) are modelled as they run: attention in P head
pieces is a pipeline with the all-to-all's hops (piece j moves while piece j+1 computes; in the
Ulysses pattern with both all-to-alls': piece j+1's q, k and v move in and piece j-1's output
moves back while piece j computes, each hop of the two sharing its copy stream), the
qkv projection of a rank's own rows runs while the other ranks' rows travel, and the gather-ahead
(``gather_ahead`` row pieces) is a pipeline of a block's tail (out_proj, MLP: the block's work
besides attention and the qkv projection) with the next block's all-gather; with it, the
gather overlap no longer applies (the next block finds its rows gathered).  With any overlap on, a
rank's compute grows by the measured ``Parts.overlap_compute_frac`` (the pieces' smaller
kernels).  Over NCCL, which moves each op as one collective, they hide nothing.  ``overlap`` (0..1)
hides a further fraction of what stays exposed, for schedules not built yet.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, overload

from h3ms_async.dit.exactness import Overlap
from h3ms_async.runtime.plans import partition
from workers.dit.protocol import PATTERNS

TRANSPORTS = ("host", "nccl", "cuda_ipc")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

#: Stated link rates (GB/s per direction) and where they come from; the model marks them as
#: assumptions.
PCIE4_GBPS = 25.0
PCIE5_GBPS = 50.0
NVLINK_GBPS = 360.0
HOST_OP_LATENCY_S = 40e-6
NCCL_OP_LATENCY_S = 20e-6
NET_EFFICIENCY = 0.9
SOURCES = {
    "pcie4": "ASSUMED: PCIe Gen4 x16 is 32 GB/s raw per direction; ~25 GB/s achievable for pinned "
    "copies",
    "pcie5": "ASSUMED: PCIe Gen5 x16 is 64 GB/s raw per direction; ~50 GB/s achievable (the H200 "
    "host measured 51.9-55.0 GB/s pinned, docs/performance.md)",
    "nvlink": "ASSUMED: NVLink4 (H100/H200, 450 GB/s per direction raw); NCCL all-gather bus "
    "bandwidth ~350-400 GB/s achievable on 8 GPUs (nccl-tests); all-to-all taken at the same rate",
    "pcie4_p2p": "ASSUMED: peer-to-peer copies between GPUs under one PCIe Gen4 switch or root "
    "complex at the pinned-copy rate (~25 GB/s per direction); GPU-direct exchange (cuda_ipc)",
    "pcie5_p2p": "ASSUMED: peer-to-peer copies on PCIe Gen5 at ~50 GB/s per direction; GPU-direct "
    "exchange (cuda_ipc)",
    "nvlink_p2p": "ASSUMED: copy-engine peer copies over NVLink4 at the NCCL bus bandwidth figure "
    "(~360 GB/s per direction); GPU-direct exchange (cuda_ipc)",
    "host_latency": "per-op signalling of the host exchange: 31-43 us per doorbell measured on the "
    "2-core CPU box (docs/performance.md), taken as 40 us per op",
    "nccl_latency": "ASSUMED: ~20 us per NCCL collective launch on NVLink",
    "net": "ASSUMED: network line rate x 0.9 achievable, hierarchical collectives (each remote row "
    "crosses a host's link once), inter-host part after the intra-host part (no overlap)",
}
#: Each pattern's two ops per block, in block order: (name, op kind of :func:`traffic`).
_OPS = {
    "gather": (("all_gather_input", "gather"), ("all_to_all_attn", "a2a_out")),
    "ulysses": (("all_to_all_qkv", "a2a_qkv"), ("all_to_all_attn", "a2a_out")),
}
PARTS_SCHEMA = "h3ms_async.speed_parts/1"
#: The qkv projection's share of an H3 block (ASSUMED from the FLOPs of H3's shapes at 75794 tokens:
#: 3·H² of the linears' 12.6·H² multiply-adds per token, beside 2·S·H of attention).
QKV_FRACTION = 0.075


class PartsError(ValueError):
    """A parts document is malformed; the message names the field and what it must be."""


@dataclass(frozen=True)
class Shape:
    """The model and the step: packed tokens, block sizes, blocks per step, the residual stream's
    dtype."""

    tokens: int
    hidden: int
    heads: int
    head_dim: int
    layers: int
    dtype: str

    @property
    def columns(self) -> int:
        """Width of the attention output (heads x head_dim): the all-to-all's row width."""
        return self.heads * self.head_dim

    @property
    def elem(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Link:
    """How ranks exchange: ``transport`` host (staged through host memory) or nccl; ``gbps`` GB/s
    per direction per GPU (host: the PCIe link; nccl: the collective's bus bandwidth); ``net_gbps``
    the network link of each host when ranks span hosts of ``gpus_per_host`` GPUs (0: one host);
    ``shared``: every rank on one GPU and its link (logical ranks, ``--validate``); ``source`` says
    where each figure comes from."""

    name: str
    transport: str
    gbps: float
    op_latency_s: float
    source: str
    assumed: bool
    d2h_gbps: float | None = None
    net_gbps: float = 0.0
    gpus_per_host: int = 0
    shared: bool = False

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"link {self.name}: transport {self.transport!r} is not one of {TRANSPORTS}"
            )
        if not self.gbps > 0:
            raise ValueError(f"link {self.name}: gbps must be > 0, got {self.gbps}")


@dataclass(frozen=True)
class Parts:
    """Measured (or stated) inputs of the model; :func:`parts_from_dict` validates the JSON form.

    ``unsplit_block_s``: one dense block over all tokens on one GPU.  ``attention_fraction``: the
    attention's share of it (splits by heads; the rest by tokens).  ``shard_block_s``: measured
    compute of the slowest rank's 1/N shard per block, by N; an N without one is modelled as the
    share of the unsplit block plus ``rank_overhead_s``.  ``step_overhead_s``: what a split step
    adds once (staging, rank set-up, tail).  ``sparse_step_ratio``: measured dense / sparse unsplit
    step time (sets the sparse attention ratio).  ``overlap_compute_frac``: what a rank's compute
    grows by with overlaps on (their smaller kernels: head pieces, row pieces), as a fraction of
    it (``bench gpu``: compute per block with every overlap on against none, same ranks).
    """

    shape: Shape
    unsplit_block_s: float
    attention_fraction: float
    host_mem_gbps: float
    rank_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    shard_block_s: dict[int, float] = field(default_factory=dict)
    sparse_step_ratio: float | None = None
    overlap_compute_frac: float = 0.0
    pinned_h2d_gbps: float | None = None
    pinned_d2h_gbps: float | None = None
    sources: dict[str, str] = field(default_factory=dict)

    def sparse_attention_ratio(self) -> float | None:
        """Sparse / dense attention time implied by ``sparse_step_ratio`` when only attention
        changes."""
        if self.sparse_step_ratio is None:
            return None
        rho = 1.0 - (1.0 - 1.0 / self.sparse_step_ratio) / self.attention_fraction
        if rho <= 0:
            raise PartsError(
                f"sparse_step_ratio {self.sparse_step_ratio} with attention_fraction "
                f"{self.attention_fraction} leaves attention no time; raise attention_fraction"
            )
        return rho


# -- the plan and its bytes
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Token and head bounds for N ranks (``plans.partition``, largest remainder by shares)."""

    tokens: tuple[int, ...]
    heads: tuple[int, ...]

    @property
    def world(self) -> int:
        return len(self.tokens) - 1

    def n(self, r: int) -> int:
        return self.tokens[r + 1] - self.tokens[r]

    def h(self, r: int) -> int:
        return self.heads[r + 1] - self.heads[r]


def make_plan(shape: Shape, world: int, shares: Sequence[float] | None = None) -> Plan:
    shares = list(shares) if shares else [1.0] * world
    return Plan(
        tuple(partition(shape.tokens, shares)),
        tuple(partition(shape.heads, shares, "attention heads")),
    )


def traffic(shape: Shape, plan: Plan, kind: str) -> list[list[int]]:
    """Bytes rank p's data that rank r needs, ``m[p][r]`` (p != r), for one op of ``kind``."""
    e, w, d = shape.elem, shape.hidden, shape.head_dim
    N = plan.world
    m = [[0] * N for _ in range(N)]
    for p in range(N):
        for r in range(N):
            if p == r:
                continue
            if kind == "gather":  # r gets p's rows of the block input
                m[p][r] = plan.n(p) * w * e
            elif kind == "a2a_out":
                # r gets p's head columns of the attention output, for r's tokens
                m[p][r] = plan.n(r) * plan.h(p) * d * e
            elif kind == "a2a_qkv":  # r gets q, k, v of r's heads for p's tokens
                m[p][r] = 3 * plan.n(p) * plan.h(r) * d * e
            else:
                raise ValueError(f"unknown op kind {kind!r}")
    return m


def host_bytes(shape: Shape, plan: Plan, kind: str) -> list[tuple[int, int]]:
    """Per rank (device->host written, host->device read) for one host-exchange op (an all-gather
    writes a rank's rows once for every peer)."""
    m = traffic(shape, plan, kind)
    N = plan.world
    out = []
    for r in range(N):
        peers = [q for q in range(N) if q != r]
        written = (
            (plan.n(r) * shape.hidden * shape.elem if peers else 0)
            if kind == "gather"
            else sum(m[r][q] for q in peers)
        )
        out.append((written, sum(m[p][r] for p in peers)))
    return out


def nccl_bytes(
    shape: Shape, plan: Plan, kind: str, gpus_per_host: int = 0
) -> list[tuple[int, int]]:
    """Per rank (sent, received) for one torch.distributed op (all-gather padded to the largest
    shard); with ``gpus_per_host`` only the part between ranks of the same host (the network part
    is :func:`net_bytes`)."""
    N = plan.world
    local = min(gpus_per_host or N, N)
    same = [[p // local == r // local and p != r for r in range(N)] for p in range(N)]
    if kind == "gather":
        biggest = max(plan.n(r) for r in range(N)) * shape.hidden * shape.elem
        return [((local - 1) * biggest, (local - 1) * biggest)] * N
    m = traffic(shape, plan, kind)
    return [
        (sum(m[r][q] for q in range(N) if same[r][q]), sum(m[p][r] for p in range(N) if same[p][r]))
        for r in range(N)
    ]


def p2p_bytes(shape: Shape, plan: Plan, kind: str) -> list[tuple[int, int]]:
    """Per rank (read by its peers, read from its peers) for one GPU-direct op: exactly the bytes
    each pair owes."""
    m = traffic(shape, plan, kind)
    N = plan.world
    return [
        (sum(m[r][q] for q in range(N) if q != r), sum(m[p][r] for p in range(N) if p != r))
        for r in range(N)
    ]


def moved_bytes(transport: str) -> Callable[[Shape, Plan, str], list[tuple[int, int]]]:
    """Per rank (out, in) bytes of one op on ``transport``."""
    return {"host": host_bytes, "cuda_ipc": p2p_bytes}.get(transport, nccl_bytes)


def net_bytes(shape: Shape, plan: Plan, kind: str, gpus_per_host: int) -> int:
    """Largest bytes one host receives from the other hosts for one op (an all-gather brings each
    remote row once per host)."""
    N = plan.world
    host = [r // gpus_per_host for r in range(N)]
    m = traffic(shape, plan, kind)
    worst = 0
    for h in set(host):
        mine = [r for r in range(N) if host[r] == h]
        remote = [p for p in range(N) if host[p] != h]
        if kind == "gather":
            got = sum(plan.n(p) * shape.hidden * shape.elem for p in remote)
        else:
            got = sum(m[p][r] for p in remote for r in mine)
        worst = max(worst, got)
    return worst


# -- times
# --------------------------------------------------------------------------------------------------
def op_hops(
    shape: Shape, plan: Plan, kind: str, link: Link, host_mem_gbps: float
) -> tuple[float, ...]:
    """One op's wall time on ``link`` (the slowest rank's), latency included, as the hops its
    bytes take one after the other: host staging's device->host copy, then the peers'
    host->device copy (separate copy engines and link directions, so pieces run the two at once:
    :func:`pipelined`); one hop on the other transports."""
    if plan.world == 1:
        return (0.0,)
    if link.transport == "host":
        moved = host_bytes(shape, plan, kind)
        d2h = (link.d2h_gbps or link.gbps) * 1e9
        h2d = link.gbps * 1e9
        per_rank = [(w / d2h, r / h2d) for w, r in moved]
        if link.shared:
            out, into = sum(o for o, _ in per_rank), sum(i for _, i in per_rank)
        else:
            out, into = max(per_rank, key=sum)
        memory = sum(w + r for w, r in moved) / (host_mem_gbps * 1e9)
        # host memory, when it is the bound, slows both hops alike
        slow = max(1.0, memory / (out + into)) if out + into > 0 else 1.0
        return (out * slow, into * slow + link.op_latency_s)
    if link.transport == "cuda_ipc":
        moved = p2p_bytes(shape, plan, kind)
        if link.shared:
            t = sum(r for _, r in moved) / (link.gbps * 1e9)
        else:
            t = max(max(o, i) for o, i in moved) / (link.gbps * 1e9)
    elif link.net_gbps and link.gpus_per_host and plan.world > link.gpus_per_host:
        t = max(max(s, r) for s, r in nccl_bytes(shape, plan, kind, link.gpus_per_host)) / (
            link.gbps * 1e9
        ) + net_bytes(shape, plan, kind, link.gpus_per_host) / (link.net_gbps * 1e9)
    else:
        t = max(max(s, r) for s, r in nccl_bytes(shape, plan, kind)) / (link.gbps * 1e9)
    return (t + link.op_latency_s,)


def shard_seconds(parts: Parts, plan: Plan, attention_ratio: float = 1.0) -> list[float]:
    """Each rank's compute per block: tokens share of the non-attention work, heads share of the
    attention (times ``attention_ratio`` for sparse steps), plus the per-rank overhead at N > 1; a
    measured shard time for this N replaces the slowest rank's and scales the others alike."""
    s, a = parts.shape, parts.attention_fraction
    N = plan.world
    over = parts.rank_overhead_s if N > 1 else 0.0
    model = [
        parts.unsplit_block_s
        * ((1 - a) * plan.n(r) / s.tokens + a * attention_ratio * plan.h(r) / s.heads)
        + over
        for r in range(N)
    ]
    measured = parts.shard_block_s.get(N)
    if measured is None or N == 1:
        return model
    dense = [
        parts.unsplit_block_s * ((1 - a) * plan.n(r) / s.tokens + a * plan.h(r) / s.heads) + over
        for r in range(N)
    ]
    scale = measured / max(dense)
    return [m * scale for m in model]


@dataclass(frozen=True)
class Prediction:
    world: int
    link: str
    pattern: str
    attention: str
    compute_block_s: float
    exchange_block_s: float
    exposed_block_s: float
    block_s: float
    step_s: float
    unsplit_step_s: float
    speedup: float
    ops: dict[str, float]
    bytes_per_rank: list[dict[str, int]]
    schedule: str = "none"

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def pipelined(compute: float, hops: Sequence[float], pieces: int) -> float:
    """Wall time of ``pieces`` equal pieces of work, each computed then moved through ``hops``
    in order, every stage on its own engine: piece j+1 computes while piece j moves (one piece:
    compute, then each hop)."""
    p = max(1, pieces)
    return (compute + sum(hops) + (p - 1) * max(compute, *hops)) / p


def pipelined_both_ways(
    compute: float, hops_in: Sequence[float], hops_out: Sequence[float], pieces: int
) -> float:
    """Wall time of ``pieces`` equal pieces of work, each moved in through ``hops_in``, computed,
    then moved out through ``hops_out``; hop i of both ways runs on one engine (a copy stream),
    so a piece's hop i in and another's hop i out take turns on it."""
    p = max(1, pieces)
    engines = [a + b for a, b in itertools.zip_longest(hops_in, hops_out, fillvalue=0.0)]
    return (compute + sum(hops_in) + sum(hops_out) + (p - 1) * max(compute, *engines)) / p


def predict(
    parts: Parts,
    world: int,
    link: Link,
    *,
    pattern: str = "gather",
    sparse: bool = False,
    overlap: float = 0.0,
    head_pieces: int = 0,
    gather_overlap: bool = False,
    gather_ahead: int = 0,
    shares: Sequence[float] | None = None,
    compute_scale: float = 1.0,
    sparse_attention_ratio: float | None = None,
) -> Prediction:
    """Step time and speed-up of the split at ``world`` ranks on ``link`` against the unsplit step
    on one GPU of
    the same kind (``compute_scale`` multiplies every compute time, e.g. a slower GPU than the
    parts').  ``head_pieces``, ``gather_overlap`` and ``gather_ahead``: the split's overlaps
    (module doc); the gather overlap and the gather-ahead apply to the all-gather pattern only."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern {pattern!r} is not one of {PATTERNS}")
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap={overlap} must be between 0 (today: none) and 1 (fully hidden)")
    s = parts.shape
    plan = make_plan(s, world, shares)
    ratio = 1.0
    if sparse:
        given = sparse_attention_ratio
        given = given if given is not None else parts.sparse_attention_ratio()
        if given is None:
            raise PartsError(
                "sparse steps need sparse_step_ratio in the parts or --sparse-attention-ratio"
            )
        ratio = given
    ahead = gather_ahead if gather_ahead > 1 and pattern == "gather" else 0
    overlapped = world > 1 and (head_pieces > 1 or ahead > 0 or gather_overlap)
    # the overlaps' smaller kernels cost compute of their own
    scale = compute_scale * (1.0 + parts.overlap_compute_frac if overlapped else 1.0)
    compute = [c * scale for c in shard_seconds(parts, plan, ratio)]
    compute_block = sum(compute) if link.shared else max(compute)
    hops = {name: op_hops(s, plan, kind, link, parts.host_mem_gbps) for name, kind in _OPS[pattern]}
    ops = {name: sum(h) for name, h in hops.items()}
    exchange = sum(ops.values())
    a, unit = parts.attention_fraction, parts.unsplit_block_s * scale
    # each rank's attention (the pieces' compute) and the qkv projection of its own rows
    attn = [unit * a * ratio * plan.h(r) / s.heads for r in range(world)]
    own_qkv = [
        unit * QKV_FRACTION * plan.h(r) / s.heads * plan.n(r) / s.tokens for r in range(world)
    ]
    # each rank's block tail: what the gather-ahead pieces compute while the next gather moves
    tail = [unit * (1 - a - QKV_FRACTION) * plan.n(r) / s.tokens for r in range(world)]
    (first_name, _), (second_name, _) = _OPS[pattern]
    first = ops[first_name]
    if link.shared:  # logical ranks: one GPU computes every rank's work in turn
        attn, own_qkv, tail = [sum(attn)], [sum(own_qkv)], [sum(tail)]
        compute = [compute_block]
    # NCCL moves every op as one collective once its input is whole (workers/transports/dist.py):
    # the overlaps' pieces cost their compute there and hide nothing
    hides = link.transport != "nccl"
    block = 0.0
    for c, att, qkv, tl in zip(compute, attn, own_qkv, tail):
        # the pieces' pipeline: the output's all-to-all in the gather pattern, both all-to-alls in
        # the Ulysses pattern (workers/dit/loop.py)
        out_pieces = head_pieces if pattern == "gather" and hides else 0
        if world == 1:
            exposed = 0.0
        elif pattern == "ulysses" and head_pieces > 1 and hides:
            both = pipelined_both_ways(att, hops[first_name], hops[second_name], head_pieces)
            exposed = both - att
        else:
            if ahead and hides:
                exposed = pipelined(tl, hops[first_name], ahead) - tl
            else:
                beside = gather_overlap and pattern == "gather" and not ahead and hides
                exposed = first - (min(first, qkv) if beside else 0)
            exposed += pipelined(att, hops[second_name], out_pieces) - att
        block = max(block, c + exposed * (1.0 - overlap))
    exposed = block - compute_block
    unsplit_block = parts.unsplit_block_s * (
        (1 - parts.attention_fraction) + parts.attention_fraction * ratio
    )
    unsplit_step = s.layers * unsplit_block * compute_scale
    step = s.layers * block + (parts.step_overhead_s if world > 1 else 0.0)
    moved = moved_bytes(link.transport)
    per_rank = [{"rank": r, "tokens": plan.n(r), "heads": plan.h(r)} for r in range(world)]
    for name, kind in _OPS[pattern]:
        for r, (o, i) in enumerate(moved(s, plan, kind)):
            per_rank[r][f"{name}_out"] = o
            per_rank[r][f"{name}_in"] = i
    return Prediction(
        world,
        link.name,
        pattern,
        "sparse" if sparse else "dense",
        compute_block,
        exchange,
        exposed,
        block,
        step,
        unsplit_step,
        unsplit_step / step,
        ops,
        per_rank,
        Overlap(
            head_pieces if head_pieces > 1 else 0,
            gather_overlap and pattern == "gather" and not ahead,
            ahead,
        ).name,
    )


# -- parts documents
# ---------------------------------------------------------------------------------------------
@overload
def _num(
    d: dict, key: str, lo: float, hi: float = ..., *, optional: Literal[False] = ...
) -> float: ...
@overload
def _num(d: dict, key: str, lo: float, hi: float = ..., *, optional: bool) -> float | None: ...
def _num(
    d: dict, key: str, lo: float, hi: float = math.inf, *, optional: bool = False
) -> float | None:
    if key not in d and optional:
        return None
    if key not in d:
        raise PartsError(f"parts: {key!r} is missing (schema {PARTS_SCHEMA})")
    v = d[key]
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or not lo <= v <= hi
        or not math.isfinite(v)
    ):
        raise PartsError(f"parts: {key!r} must be a number in [{lo}, {hi}], got {v!r}")
    return float(v)


def parts_from_dict(d: dict) -> Parts:
    """Validate a parts document (``schema`` = :data:`PARTS_SCHEMA`); every error names the
    field."""
    if not isinstance(d, dict):
        raise PartsError("parts: the document must be a JSON object")
    if d.get("schema") != PARTS_SCHEMA:
        raise PartsError(f"parts: 'schema' must be {PARTS_SCHEMA!r}, got {d.get('schema')!r}")
    known = {
        "schema",
        "shape",
        "unsplit_block_s",
        "attention_fraction",
        "host_mem_gbps",
        "rank_overhead_s",
        "step_overhead_s",
        "shard_block_s",
        "sparse_step_ratio",
        "overlap_compute_frac",
        "pinned_h2d_gbps",
        "pinned_d2h_gbps",
        "sources",
    }
    unknown = sorted(set(d) - known)
    if unknown:
        raise PartsError(f"parts: unknown field(s) {unknown}; known: {sorted(known)}")
    sd = d.get("shape")
    if not isinstance(sd, dict):
        raise PartsError(
            "parts: 'shape' must be an object with tokens, hidden, heads, head_dim, layers, dtype"
        )
    ints = {}
    for k in ("tokens", "hidden", "heads", "head_dim", "layers"):
        v = sd.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PartsError(f"parts: shape.{k} must be a positive integer, got {v!r}")
        ints[k] = v
    if sd.get("dtype") not in DTYPE_BYTES:
        raise PartsError(
            f"parts: shape.dtype must be one of {sorted(DTYPE_BYTES)}, got {sd.get('dtype')!r}"
        )
    shards = d.get("shard_block_s", {})
    if not isinstance(shards, dict):
        raise PartsError("parts: 'shard_block_s' must be an object {\"N\": seconds}")
    shard = {}
    for k in shards:
        if not str(k).isdigit() or int(k) < 1:
            raise PartsError(f"parts: shard_block_s key {k!r} must be a rank count >= 1")
        shard[int(k)] = _num(shards, k, 1e-9)
    sources = d.get("sources", {})
    if not isinstance(sources, dict) or not all(isinstance(v, str) for v in sources.values()):
        raise PartsError(
            "parts: 'sources' must be an object of strings (where each figure comes from)"
        )
    parts = Parts(
        shape=Shape(dtype=sd["dtype"], **ints),
        unsplit_block_s=_num(d, "unsplit_block_s", 1e-9),
        attention_fraction=_num(d, "attention_fraction", 0.0, 1.0),
        host_mem_gbps=_num(d, "host_mem_gbps", 1e-3),
        rank_overhead_s=_num(d, "rank_overhead_s", 0.0, optional=True) or 0.0,
        step_overhead_s=_num(d, "step_overhead_s", 0.0, optional=True) or 0.0,
        shard_block_s=shard,
        sparse_step_ratio=_num(d, "sparse_step_ratio", 1.0, optional=True),
        overlap_compute_frac=_num(d, "overlap_compute_frac", 0.0, 1.0, optional=True) or 0.0,
        pinned_h2d_gbps=_num(d, "pinned_h2d_gbps", 1e-3, optional=True),
        pinned_d2h_gbps=_num(d, "pinned_d2h_gbps", 1e-3, optional=True),
        sources=dict(sources),
    )
    if parts.shape.heads * parts.shape.head_dim < 1:
        raise PartsError("parts: shape.heads x shape.head_dim must be >= 1")
    parts.sparse_attention_ratio()  # refuses a ratio the attention fraction cannot explain
    return parts


def parts_to_dict(p: Parts) -> dict:
    s = p.shape
    d = {
        "schema": PARTS_SCHEMA,
        "shape": {
            "tokens": s.tokens,
            "hidden": s.hidden,
            "heads": s.heads,
            "head_dim": s.head_dim,
            "layers": s.layers,
            "dtype": s.dtype,
        },
        "unsplit_block_s": p.unsplit_block_s,
        "attention_fraction": p.attention_fraction,
        "host_mem_gbps": p.host_mem_gbps,
        "rank_overhead_s": p.rank_overhead_s,
        "step_overhead_s": p.step_overhead_s,
        "overlap_compute_frac": p.overlap_compute_frac,
        "shard_block_s": {str(k): v for k, v in p.shard_block_s.items()},
        "sources": dict(p.sources),
    }
    for key in ("sparse_step_ratio", "pinned_h2d_gbps", "pinned_d2h_gbps"):
        if getattr(p, key) is not None:
            d[key] = getattr(p, key)
    return d


# -- the pattern ``pattern: auto`` loads
# -----------------------------------------------------------------------------------------------
#: The parts :func:`choose_pattern` predicts with: full H3 measured on one H100 (each figure's
#: source is in the file).
REFERENCE_PARTS = Path(__file__).with_name("speed_parts_h100.json")


@functools.cache
def reference_parts() -> Parts:
    return parts_from_dict(json.loads(REFERENCE_PARTS.read_text()))


def usual_link(transport: str) -> Link:
    """The link :func:`choose_pattern` assumes for ``transport``: host staging and the GPU-direct
    exchange over PCIe Gen4 (the slowest common link, where the choice matters most), NCCL over
    NVLink (where it is mostly used)."""
    if transport == "host":
        return Link("pcie4-host", "host", PCIE4_GBPS, HOST_OP_LATENCY_S, SOURCES["pcie4"], True)
    if transport == "cuda_ipc":
        return Link(
            "pcie4-p2p", "cuda_ipc", PCIE4_GBPS, HOST_OP_LATENCY_S, SOURCES["pcie4_p2p"], True
        )
    if transport == "nccl":
        return Link("nvlink-nccl", "nccl", NVLINK_GBPS, NCCL_OP_LATENCY_S, SOURCES["nvlink"], True)
    raise ValueError(f"transport {transport!r} is not one of {TRANSPORTS}")


def parts_for_width(parts: Parts, hidden: int, heads: int, head_dim: int) -> Parts:
    """``parts`` for a model of another width at the same token count: the linears' time scaled by
    hidden², attention's by heads x head_dim (their multiply-adds per token), every rank's shard
    alike."""
    s = parts.shape
    if (hidden, heads, head_dim) == (s.hidden, s.heads, s.head_dim):
        return parts
    linears = (hidden / s.hidden) ** 2
    attention = heads * head_dim / s.columns
    a = parts.attention_fraction
    scale = (1 - a) * linears + a * attention
    return replace(
        parts,
        shape=replace(s, hidden=hidden, heads=heads, head_dim=head_dim),
        unsplit_block_s=parts.unsplit_block_s * scale,
        attention_fraction=a * attention / scale,
        shard_block_s={n: t * scale for n, t in parts.shard_block_s.items()},
    )


def choose_pattern(
    hidden: int,
    heads: int,
    head_dim: int,
    world: int,
    transport: str,
    overlaps: dict[str, Overlap],
    shares: Sequence[float] | None = None,
) -> str:
    """The pattern the model predicts the faster dense step for, at ``world`` ranks on
    ``transport``'s :func:`usual_link`, each pattern with the overlaps the engine may run under
    it (``overlaps``; a pattern missing from it is not a choice), from :func:`reference_parts`
    scaled to this width; the all-gather on a tie.  For H3 with host staging: the all-gather up
    to N = 6 without overlaps, Ulysses from N = 4 with 8 head pieces (they hide most of its
    all-to-alls: docs/performance.md, "The pattern `auto` loads")."""
    parts = parts_for_width(reference_parts(), hidden, heads, head_dim)
    link = usual_link(transport)
    steps = {
        pattern: predict(
            parts,
            world,
            link,
            pattern=pattern,
            head_pieces=o.head_pieces,
            gather_overlap=o.gather,
            gather_ahead=o.ahead,
            shares=shares,
        ).step_s
        for pattern, o in overlaps.items()
    }
    return min(steps, key=lambda p: (steps[p], p != "gather"))
