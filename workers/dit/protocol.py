"""The messages of the transformer split: typed requests (``workers.runtime.protocol.Request``),
checked by the one decoder of ``workers.runtime.protocol``.

Both sides import this module: the coordinator (``h3ms_async.dit.split``) to send, the worker
(``workers.dit.rank``) to serve.  Field meanings:

``dit_load``    map the shared-memory weight store and prepare this rank's weights.
    store       name of the weight store's segment (its fill-progress word)
    manifest    list, one map per block: parameter name (as inside a ComfyUI block) -> tensor
                descriptor (each block's tensors in that block's own segment)
    config      {hidden, heads, head_dim, eps, layers, devices, attention, compute_dtype}; attention
                is "sdpa", "ck_int8" or "comfy" (the parent ComfyUI's selected function,
                ``workers.runtime.comfy_host``); the rank warms that attention up in compute_dtype
                before its first step
    heads       [g0, g1]: this rank's head group
    key         the store's key as text (logged, and a load with the same key is a no-op)
    progress    descriptor of the store's fill-progress word (``workers.runtime.fill_progress``):
                the load is sent while the store fills and takes block i in once the word passed
                i; it fails when the word says the fill failed, or when no new block is complete
                within deadline_s
    residency, tokens  (optional) the first step's residency and [tokens, this rank's tokens]: a
                CUDA rank decides with them which blocks stay in VRAM (as ``dit_step`` would) and
                uploads each of those as soon as the store has it, so the first step starts with
                them in place
    -> DitLoaded: the rank's device (as ``dit_describe``), when it took its first and last block in

``dit_describe`` the rank's device as the plan probe keys its verdicts: fingerprint, SM count, why
                the sparse kernel cannot run; no state, so it is answered while a load waits
    -> DitDevice

``dit_step``    run every block on this rank's token range, exchanging with the other ranks.
    job         step number (logs)
    x           descriptor of the residual stream [S, H]; rank r reads and finally writes rows [t0,
                t1)
    modulation  descriptor [L, M, 18·hidden]: every block's raw adaLN output for the step's M
                timestep rows, computed once by the model's owner (``workers.dit.ops.adaln_rows``;
                ranks hold no adaLN weights); in a small side segment with the per-token rows (M
                changes between steps, the step segment and the arena stay);  rope: descriptor [1,
                S, 1, P, 2, 2]
    segments    list of [a, b, row]; row is an int or a descriptor of an int64 [b - a] per-token row
                index
    tokens      [t0, t1]
    arena       exchange arena segment name ("" unless exchange is "host" or "cuda_ipc": for
                "cuda_ipc" the header page and handle slots, ``workers.transports.cuda_ipc``);
                layout: ArenaLayout.to_dict()
    exchange    a :class:`Transport` value: "host" | "cuda_ipc" | "nccl" | "gloo" | "none";
                chunks: pipelined chunks per exchange (0/1 = single shot).
    peer_devices  ("cuda_ipc") per rank, the CUDA device index under which this rank's worker
                sees that rank's GPU (its own is 0; the others through the pool's also_visible)
    ipc_sync    ("cuda_ipc") an :class:`IpcSync` value: "host" (copies waited for on the host) or
                "events" (ordered by CUDA IPC events between the ranks' streams)
    head_pieces dense attention in that many head pieces, each moved by the all-to-all while the
                next computes (0/1: one call; ``workers.dit.loop``)
    gather_overlap  dense steps: the qkv projection runs on each rank's gathered rows as they
                arrive (``workers.dit.loop``)
    gather_ahead  the gather pattern: each block's tail in that many row pieces, each followed by
                the next block's norm1 + modulation of those rows, published into the next block's
                gather (0: off; at most :data:`MAX_GATHER_AHEAD`; ``workers.dit.loop``)
    pattern     "gather" or "ulysses" (:data:`Pattern`; Ulysses needs a layout planned with qkv
                and weights loaded with every head's qkv rows)
    abort_gen   the pool's abort generation when the step was submitted
    start_at    (the "none" baseline of several ranks) the ``time.monotonic()`` instant, on the
                machine's one monotonic clock, at which every rank begins its blocks after its setup
                (it waits at most :data:`MAX_START_WAIT_S`), so the ranks share their GPU for the
                whole step as a split's ranks do; 0: begin at once
    deadline_s  per-exchange deadline
    blocks      [b0, b1): the blocks to run (normally all)
    residency   "auto" | "resident" | "stream": where block weights live on a CUDA rank (CPU ranks
                read shm); a change between steps re-places the weights from the same store
    sparse      None (dense attention), or :class:`SparseStepSettings` (config, sigma, branch):
                sparse attention over this rank's heads (``workers.dit.sparse``)
    trace       digest every op's output rows per block (``workers.dit.invariance.digest``) and
                answer them (the ``verify`` setting's localisation of a difference); off for normal
                steps
    -> DitStepped: the rank's timings (``start_wait_s`` apart: the wall excludes it), bytes moved,
                and what ``trace`` and ``sparse`` asked for

``dit_sparse_reset`` drop the pooled sparse-attention statistics (sampling ended).
    -> Dropped {dropped}: how many pooled entries went

``dit_probe``   measure on this rank's device whether shards give the unsplit call's bits
                (``workers.dit.invariance``): each linear of ``ops`` over ``tokens`` rows against
                each shard's ``candidates`` (a rank's token range in each candidate plan), the qkv
                projection and attention for its head group ``heads``; random data of the real
                shapes, in ``model``'s compute dtype, with its attention function (warmed up as
                ``dit_load`` does): no weights, so it runs while the store fills.  ``shards``: this
                rank's first, then the other ranks on the same GPU (each unsplit call is made once
                for all of them; logical ranks of one GPU would otherwise each make it)
    sparse      None (no sparse attention), or :class:`SparseProbeSettings`
                (``workers.dit.sparse.probe_wire``): also the group's qkv projection in the
                kernel's row chunks and the sparse kernel over the group, from fresh and from
                pooled statistics, against the same calls over every head (one shard only)
    -> ProbeReports: per shard, the device's fingerprint and one verdict per op

``dit_refresh`` the weight store this rank loaded was rewritten in place (a weight-patch change,
                ``h3ms_async.runtime.weight_store.WeightStore.rewrite``; no step runs meanwhile):
                take the named tensors in again where the rank holds copies of them.
    store       the store's segment name (the one the rank loaded)
    key         the store's new key as text (a later ``dit_load`` of it is a no-op)
    blocks      list of [block, [tensor names]], blocks ascending, each once, names as in the
                manifest
    -> DitRefreshed: the bytes this rank copied again, its seconds

``dit_release`` drop this rank's weights, exchange objects and process group.
    -> Released {released: True}
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass
from typing import Annotated, ClassVar, Literal

import msgspec

from workers.runtime import fill_progress
from workers.runtime.protocol import (
    Answer,
    Dropped,
    Plain,
    ProtocolError,
    Released,
    Request,
    TensorDesc,
)


class Transport(enum.StrEnum):
    """How the ranks of a split step exchange rows between blocks: the one vocabulary of the
    node input (``host``, ``nccl``, ``cuda_ipc``; its ``auto`` is resolved to one of these before
    a step, ``h3ms_async.dit.exchange_choice``), the wire (a step's ``exchange``), the step
    records and the status JSON.  The node's ``nccl`` means the collective transport; on CPU
    ranks it runs as ``gloo`` (:meth:`on`)."""

    #: shared-memory arena on the host plus eventfd doorbells (CPU and CUDA ranks)
    HOST = "host"
    #: torch.distributed collectives over NCCL (CUDA ranks)
    NCCL = "nccl"
    #: torch.distributed collectives over gloo: the CPU form of ``nccl``
    GLOO = "gloo"
    #: GPU-direct: the host exchange's protocol over the ranks' GPU buffers shared by CUDA IPC
    #: (``workers.transports.cuda_ipc``; CUDA ranks whose GPUs reach each other)
    CUDA_IPC = "cuda_ipc"
    #: benchmark baseline without exchange (each rank's compute alone; wrong output by design)
    NONE = "none"

    @property
    def collective(self) -> bool:
        """Whether this transport runs over a torch.distributed process group."""
        return self in (Transport.NCCL, Transport.GLOO)

    def on(self, cuda: bool) -> Transport:
        """This transport as it runs on CUDA (``cuda``) or CPU ranks: the collective one is NCCL
        on CUDA, gloo on the CPU."""
        if self.collective:
            return Transport.NCCL if cuda else Transport.GLOO
        return self


class Residency(enum.StrEnum):
    """Where a CUDA rank keeps its block weights: the one vocabulary of the node input
    (``vram_residency``), the options, the wire and the status JSON."""

    #: as many blocks resident in VRAM as fit beside the step's working set, the rest streamed
    AUTO = "auto"
    #: every block in VRAM
    RESIDENT = "resident"
    #: every block streamed from the pinned store through two device slots
    STREAM = "stream"


RESIDENCIES: tuple[str, ...] = tuple(r.value for r in Residency)


class IpcSync(enum.StrEnum):
    """How the GPU-direct exchange orders its copies (``workers.transports.cuda_ipc``): the one
    vocabulary of the options (which add "auto"), the wire, the step records and the status
    JSON."""

    #: each chunk's copy and each op's reads waited for on the host
    HOST = "host"
    #: CUDA IPC events between the ranks' copy streams; the host only keeps within a few ops of
    #: the GPU
    EVENTS = "events"


class DitDevice(Answer):
    """A rank's device as the plan probe keys its verdicts: its fingerprint
    (``workers.dit.invariance.fingerprint``), SM count (None on a CPU), and why the sparse kernel
    cannot run there (None: it can)."""

    sm_count: int | None
    fingerprint: dict[str, str]
    sparse_kernel: str | None


class DitDescribe(Request, tag="dit_describe"):
    ANSWER: ClassVar[type[Answer]] = DitDevice


class DitLoaded(Answer):
    """Whether this call mapped the weights (False: this key and head group were loaded
    already), their bytes, the load's seconds and the ``time.monotonic()`` stamps (one clock for
    every process of the host) when it took its first and last block in (when it loaded), and the
    rank's device."""

    loaded: bool
    bytes: int
    device: DitDevice
    seconds: float | None = None
    first_block_at: float | None = None
    last_block_at: float | None = None


class DitLoad(Request, tag="dit_load"):
    store: str
    manifest: list[dict[str, TensorDesc]]
    config: Plain
    heads: tuple[int, int]
    key: str
    progress: TensorDesc
    #: the longest wait for the next block while the store fills
    deadline_s: float
    #: the heads whose qkv rows the rank holds: its own group (None) or every head (Ulysses)
    qkv_heads: tuple[int, int] | None = None
    #: the step about to run, when the caller knows it: its residency and [tokens, this rank's
    #: tokens]; a CUDA rank then places its resident blocks in VRAM as the store fills
    residency: Residency | None = None
    tokens: tuple[int, int] | None = None
    PLAIN: ClassVar[tuple[str, ...]] = ("config",)
    ANSWER: ClassVar[type[Answer]] = DitLoaded

    def __post_init__(self) -> None:
        super().__post_init__()
        fill_progress.check_desc(self.progress, self.store)
        if not self.deadline_s > 0:
            raise ProtocolError(f"dit_load deadline_s must be > 0, got {self.deadline_s}")
        if self.tokens is not None and not 0 <= self.tokens[1] <= self.tokens[0]:
            raise ProtocolError(
                f"dit_load tokens must be [tokens, this rank's tokens <= tokens], got "
                f"{list(self.tokens)}"
            )


Seconds = Annotated[float, msgspec.Meta(ge=0)]


class BlockTiming(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where one block's time went on one rank (``workers.dit.block_clock``), the one form of it on
    the wire, in the step records and the status JSON.

    ``compute_s``: the rank's compute stream (CPU: its compute thread) was working;
    ``exposed_s``: it stood still waiting for the exchange (copies on its own thread, peers'
    data), so ``compute_s + exposed_s`` is the block's time on that stream; ``copy_s``: the
    exchange's copies (CUDA: on the copy streams, event-timed; CPU: on the compute thread);
    ``hidden_s``: the part of ``copy_s`` that ran while the rank computed (0 where copies run on
    the compute thread), never more than ``copy_s``."""

    compute_s: Seconds
    copy_s: Seconds
    hidden_s: Seconds
    exposed_s: Seconds

    def __post_init__(self) -> None:
        if self.hidden_s > self.copy_s:
            raise ValueError(
                f"hidden_s {self.hidden_s} exceeds copy_s {self.copy_s}: only copy time can be "
                "hidden behind compute"
            )


class DitStepped(Answer):
    """One rank's step: wall, compute, exchange-copy and wait seconds, bytes moved, doorbell
    signals, peak VRAM (None on a CPU); on CUDA the copies' own GPU seconds and the host's waits
    for compute; the weights' residency timings (None where weights do not move); per block its
    :class:`BlockTiming`; the seconds outside the blocks before (``setup_s``: mapping
    segments, input copies, weight placement, exchange setup) and after (``tail_s``: the copy
    back); the wait for ``DitStep.start_at`` after the setup (``start_wait_s``, outside
    ``wall_s``); the CUDA caching allocator's growth (``new_segments``, ``retries``,
    ``reserved_bytes``; None on a CPU); with ``trace`` "block:op" -> digest of this rank's
    output of that op; with sparse attention the blocks run sparse / dense and how many reused
    the pooled statistics (None without)."""

    wall_s: float
    compute_s: float
    exchange_s: float
    wait_s: float
    moved_bytes: int
    signals: int
    vram_peak_bytes: int | None
    copy_gpu_s: float
    compute_wait_s: float
    weights: Plain | None
    per_block: list[BlockTiming]
    setup_s: float
    tail_s: float
    cuda_alloc: dict[str, int] | None
    trace: dict[str, str]
    sparse: dict[str, int] | None
    start_wait_s: float = 0.0
    PLAIN: ClassVar[tuple[str, ...]] = ("weights",)


#: Longest a rank waits for ``DitStep.start_at`` after its setup (a later instant is a
#: coordinator's mistake, not a reason to hang).
MAX_START_WAIT_S = 2.0
#: Most head pieces a step's attention may run in (``DitStep.head_pieces``).
MAX_HEAD_PIECES = 16
#: Most row pieces a block's tail may run in for the cross-block overlap (``DitStep.gather_ahead``).
MAX_GATHER_AHEAD = 16


class Pattern(enum.StrEnum):
    """How a block's attention gets its inputs: the one vocabulary of the node input
    (``exchange_pattern``, which adds "auto"), the options, the wire, the step records and the
    status JSON."""

    #: the all-gather of the block input; each rank projects its heads for every token
    GATHER = "gather"
    #: each rank projects every head for its tokens, then an all-to-all of q, k, v
    ULYSSES = "ulysses"


PATTERNS: tuple[str, ...] = tuple(p.value for p in Pattern)


#: Sparse attention: the kernel's query/key block length.
BLOCK = 64
SINK_MODES = ("exact_kv_and_rows", "exact_kv", "off")
#: ``token_aug`` of the kernel: extra tokens per query block, a multiple of 64 up to 256.
EXTRA_TOKENS_MAX = 256


@dataclass(frozen=True)
class SparseConfig:
    """What a rank needs to decide and run sparse attention; validated on construction (both sides).

    ``topk_ratio`` > 0 selects top-k (``tau`` is then ignored); attention is sparse while
    ``sigma_end <= sigma <= sigma_start``, the sequence has at least ``min_tokens`` tokens and the
    block is not in ``dense_blocks``.
    """

    tau: float = 1.3
    topk_ratio: float = 0.0
    sigma_start: float = math.inf
    sigma_end: float = 0.0
    min_tokens: int = 12288
    dense_blocks: tuple[int, ...] = ()
    sink_conditioning: str = "exact_kv_and_rows"
    extra_tokens: int = 256

    def __post_init__(self) -> None:
        if not 0.0 <= self.tau <= 16.0:
            raise ValueError(
                f"tau={self.tau}: must be between 0 and 16 (higher is sparser; 1.3 is the default)"
            )
        if not 0.0 <= self.topk_ratio < 1.0:
            raise ValueError(
                f"topk_ratio={self.topk_ratio}: must be 0 (Sol-Attn threshold) or in (0, 1) "
                "(top-k: the fraction of key blocks kept); set keep_percent below 100"
            )
        if (
            math.isnan(self.sigma_start)
            or math.isnan(self.sigma_end)
            or self.sigma_end > self.sigma_start
        ):
            raise ValueError(
                f"sigma window [{self.sigma_end}, {self.sigma_start}] is empty: the end sigma must "
                "not exceed the start sigma; set end_percent >= start_percent"
            )
        if (
            isinstance(self.min_tokens, bool)
            or not isinstance(self.min_tokens, int)
            or self.min_tokens < 0
        ):
            raise ValueError(f"min_tokens={self.min_tokens!r}: must be an integer >= 0")
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in self.dense_blocks):
            raise ValueError(
                f"dense_blocks={list(self.dense_blocks)}: block indices must be integers >= 0"
            )
        if self.sink_conditioning not in SINK_MODES:
            raise ValueError(
                f"sink_conditioning={self.sink_conditioning!r}: must be one of "
                f"{', '.join(SINK_MODES)}"
            )
        if not 0 <= self.extra_tokens <= EXTRA_TOKENS_MAX or self.extra_tokens % BLOCK:
            raise ValueError(
                f"extra_tokens={self.extra_tokens}: must be 0, 64, 128, 192 or 256 (the kernel "
                "routes tokens in 64-token tiles)"
            )

    @property
    def method(self) -> str:
        return "top-k" if self.topk_ratio else "sol-attn"

    def as_json(self) -> dict:
        """The settings as JSON data (the status document, benchmark output): an open start
        (+inf) is null."""
        d = asdict(self)
        d["dense_blocks"] = list(self.dense_blocks)
        d["sigma_start"] = None if math.isinf(self.sigma_start) else self.sigma_start
        return d


class SparseStepSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A ``dit_step``'s sparse attention: the settings, the step's sigma (decides the window) and
    the conditioning branch whose pooled statistics the step reuses."""

    config: SparseConfig
    sigma: float | None
    branch: str


class SparseProbeSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A ``dit_probe``'s sparse attention: what the kernel's calls depend on besides the shapes
    (the settings with the per-step decisions left out, the sinks of this stream's segments) and
    the rope table's pairs and dtype."""

    config: SparseConfig
    sink_blocks: tuple[int, int]
    sink_q: tuple[int, int]
    rope_pairs: int
    rope_dtype: str


class DitStep(Request, tag="dit_step"):
    job: int
    x: TensorDesc
    modulation: TensorDesc
    rope: TensorDesc
    segments: list[tuple[int, int, int | TensorDesc]]
    tokens: tuple[int, int]
    arena: str
    layout: Plain
    exchange: Transport
    chunks: int
    abort_gen: int
    deadline_s: float
    blocks: tuple[int, int]
    residency: Residency
    trace: bool = False
    sparse: SparseStepSettings | None = None
    head_pieces: int = 0
    gather_overlap: bool = False
    gather_ahead: int = 0
    pattern: Pattern = Pattern.GATHER
    peer_devices: tuple[int, ...] = ()
    ipc_sync: IpcSync = IpcSync.HOST
    start_at: float = 0.0
    PLAIN: ClassVar[tuple[str, ...]] = ("layout",)
    ANSWER: ClassVar[type[Answer]] = DitStepped


class DitSparseReset(Request, tag="dit_sparse_reset"):
    ANSWER: ClassVar[type[Answer]] = Dropped


#: How an op's calls are cut: by token rows, by head groups, by head pieces within a group
#: (``head_pieces``), a head group's rows by every rank's token range (``gather_overlap``), by the
#: sparse kernel's row chunks (compared with the whole weight's call on the same rows) or by the row
#: pieces of a rank's block tail (``gather_ahead``).
Split = Literal["tokens", "heads", "pieces", "rows", "chunks", "tail"]


class LinearOp(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One linear of the block as the ranks call it: its name, weight shape and storage, int8
    settings.

    ``in_features`` is the weight's; ``mlp.fc2`` (``input_act="swiglu"``) sees twice that many input
    columns."""

    name: str
    out_features: int
    in_features: int
    weight_dtype: str
    scale_numel: int = 0
    bias: bool = False
    convrot: bool = False
    convrot_groupsize: int = 256
    input_act: str | None = None
    split: Split = "tokens"


class OpVerdict(msgspec.Struct, forbid_unknown_fields=True):
    """One op on one rank: ``exact[c]`` for candidate ``c`` (token-split ops), one entry for
    head-split ops; ``digest`` of the unsplit call's
    output; ``max_abs_diff`` per candidate."""

    op: str
    dtype: str
    shape: str
    split: Split
    shards: list[list[int]]
    exact: list[bool]
    max_abs_diff: list[float]
    digest: str
    ms: float


class ProbeReport(Answer):
    """What ``dit_probe`` answers: the device's fingerprint, one verdict per op, and the probe's
    wall time."""

    fingerprint: dict[str, str]
    ops: list[OpVerdict] = msgspec.field(default_factory=list)
    ms: float = 0.0


class ProbeModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a probe needs of the model besides its linears: every head, their width, the blocks'
    epsilon, the compute dtype (a torch dtype's name) and the attention function (as ``dit_load``'s
    config names it)."""

    heads: int
    head_dim: int
    eps: float
    compute_dtype: str
    attention: str


class ProbeShard(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One rank's part of a probe: its token range in each candidate plan, its head group and its
    tail's row pieces (``gather_ahead``)."""

    candidates: list[tuple[int, int]]
    heads: tuple[int, int]
    tail_ranges: list[tuple[int, int]] = msgspec.field(default_factory=list)


class ProbeReports(Answer):
    """What ``dit_probe`` answers: one report per shard asked for, in order."""

    reports: list[ProbeReport]


class DitProbe(Request, tag="dit_probe"):
    ops: list[LinearOp]
    model: ProbeModel
    tokens: int
    shards: list[ProbeShard]
    pieces: int = 0
    gather_ranges: list[tuple[int, int]] = msgspec.field(default_factory=list)
    sparse: SparseProbeSettings | None = None
    #: the pool's abort generation when the probe was sent: a later one ends it between two calls
    abort_gen: int = 0
    ANSWER: ClassVar[type[Answer]] = ProbeReports

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.shards:
            raise ProtocolError("dit_probe needs at least one shard (this rank's)")
        if self.sparse is not None and len(self.shards) > 1:
            raise ProtocolError(
                "dit_probe with sparse settings probes one shard: each rank probes its own"
            )


class DitRelease(Request, tag="dit_release"):
    ANSWER: ClassVar[type[Answer]] = Released


class DitRefreshed(Answer):
    """The bytes a rank copied again for a ``dit_refresh`` (VRAM copies, sliced qkv rows; store
    views need none) and its seconds."""

    bytes: int
    seconds: float


class DitRefresh(Request, tag="dit_refresh"):
    store: str
    key: str
    blocks: list[tuple[int, list[str]]]
    ANSWER: ClassVar[type[Answer]] = DitRefreshed

    def __post_init__(self) -> None:
        super().__post_init__()
        order = [i for i, _ in self.blocks]
        if any(i < 0 for i in order) or order != sorted(set(order)):
            raise ProtocolError(
                f"dit_refresh blocks {order!r:.80} must be block indices >= 0, ascending, each once"
            )
        if any(not names or not all(names) for _, names in self.blocks):
            raise ProtocolError("dit_refresh: every block names at least one tensor, none empty")
