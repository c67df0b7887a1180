"""What the node (or the CLI) chose for a split, checked once: :class:`SplitOptions`, its status
form, the per-block option patches the workers honour, and which options need other worker
processes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from h3ms_async.dit import exchange_choice, tested_paths
from h3ms_async.dit.errors import SplitError
from h3ms_async.dit.exchange_choice import EXCHANGES
from workers.dit import ops as dit_ops
from workers.dit import protocol as dit_protocol
from workers.dit.protocol import Pattern, Residency, Transport
from workers.dit.sparse import SparseConfig
from workers.runtime.comfy_host import ComfyHost

#: Benchmark-only transport: ranks compute their shards without exchanging (wrong output, timing
#: baseline).
BASELINE_EXCHANGE = Transport.NONE.value
#: The attention name that means "the parent ComfyUI's selected function"
#: (``SplitOptions.comfy_host``).
COMFY_ATTENTION = "comfy"


def parse_pattern(raw: str) -> Pattern | Literal["auto"]:
    """A pattern setting as a user writes it ("gather", "ulysses", "auto")."""
    if raw == "auto":
        return "auto"
    try:
        return Pattern(raw)
    except ValueError:
        raise ValueError(
            f"pattern={raw!r} is not one of {(*dit_protocol.PATTERNS, 'auto')}"
        ) from None


@dataclass(frozen=True)
class SplitOptions:
    """What the node (or the CLI) chose.  ``shares`` = relative speed per rank (None: equal).

    Only ``shares``, ``attention`` and ``comfy_host`` need other worker processes
    (:func:`process_key`); exchange, chunks and residency travel with every step, and the RAM
    reserve applies when the store is filled. ``attention="comfy"`` runs ``comfy_host.attention``
    (ComfyUI's selected function) on the ranks; ``sparse`` runs attention through comfy-kitchen's
    sparse kernel where its settings say so (``workers.dit.sparse``).
    ``verify``: the first split step of each prompt (with sparse attention, its first step that
    runs the sparse kernel) also runs unsplit on rank 0's device and is compared
    (``h3ms_async.dit.verify``).  ``head_pieces`` > 1: each rank's dense attention runs in that
    many head pieces, each moved by the all-to-all while the next one computes, where the probe
    measures the pieces exact (``workers.dit.loop``).
    ``gather_overlap``: on dense steps each rank's qkv projection runs on every rank's rows as they
    arrive (its own first), where the probe measures those row ranges exact.
    ``gather_ahead`` > 0 (the gather pattern): each block's tail runs in that many row pieces, each
    followed by the next block's norm1 + modulation of those rows, published into the next
    block's gather while the next piece computes, where the probe measures the pieces exact.
    ``ipc_sync``: how the GPU-direct exchange orders its copies, "host", "events" or "auto" (host
    waits: ``exchange_choice.resolve_sync``).
    ``overlap_tuning``: ``head_pieces``, ``gather_overlap`` and ``gather_ahead`` name what the
    engine may use, not
    what it must: per plan it runs the exact ones that measured fastest, leaving out any without a
    passing test on the ranks' device kind (``h3ms_async.dit.overlap_tuner``).  ``pattern``: how
    attention gets its inputs, "gather" (all-gather of the block input), "ulysses" (every rank
    projects every head for its tokens, then an all-to-all of q, k, v; dense attention only) or
    "auto" (the one the speed model predicts faster at this N and transport with the overlaps
    these options let it run, ``speed_model.choose_pattern``; gather with sparse attention),
    fixed when weights load.
    """

    exchange: exchange_choice.Setting = Transport.HOST
    ipc_sync: exchange_choice.SyncSetting = "auto"
    exchange_chunks: int = 0
    vram_residency: Residency = Residency.AUTO
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
    gather_ahead: int = 0
    overlap_tuning: bool = False
    pattern: Pattern | Literal["auto"] = Pattern.GATHER

    def __post_init__(self) -> None:
        if self.exchange not in (*EXCHANGES, BASELINE_EXCHANGE):
            raise ValueError(f"exchange={self.exchange!r} is not one of {EXCHANGES}")
        # a caller's plain strings become the setting's one type
        object.__setattr__(
            self,
            "exchange",
            Transport.NONE
            if self.exchange == BASELINE_EXCHANGE
            else exchange_choice.parse(self.exchange),
        )
        object.__setattr__(self, "ipc_sync", exchange_choice.parse_sync(self.ipc_sync))
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
        if not 0 <= self.gather_ahead <= dit_protocol.MAX_GATHER_AHEAD:
            raise ValueError(
                f"gather_ahead={self.gather_ahead} must be between 0 (off) and "
                f"{dit_protocol.MAX_GATHER_AHEAD} row pieces"
            )
        object.__setattr__(self, "pattern", parse_pattern(self.pattern))
        if self.pattern == "ulysses" and self.sparse is not None:
            raise ValueError(
                "sparse attention runs with the all-gather pattern (its kernel needs the block "
                "input of every token); use pattern 'gather' or 'auto'"
            )
        if self.vram_residency not in dit_protocol.RESIDENCIES:
            raise ValueError(
                f"vram_residency={self.vram_residency!r} is not one of {dit_protocol.RESIDENCIES}"
            )
        object.__setattr__(self, "vram_residency", Residency(self.vram_residency))
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
        if self.sparse is not None and not isinstance(self.sparse, SparseConfig):
            raise ValueError(
                f"sparse={self.sparse!r} must be a SparseConfig (SparseSettings.resolve) or None"
            )

    def overlaps_on(
        self, devices: Sequence[str], pattern: str | None = None
    ) -> tuple[int, bool, int]:
        """``(head_pieces, gather_overlap, gather_ahead)`` these options ask for on ``devices``
        under ``pattern`` (the one the engine resolved; default: as set): as set, or with
        ``overlap_tuning`` only those with a passing test on the devices' kind (the engine leaves
        an untested one out instead of refusing the step)."""
        asked = (self.head_pieces, self.gather_overlap, self.gather_ahead)
        if self.overlap_tuning:
            return tested_paths.tested_overlap(devices, *asked, pattern=pattern or self.pattern)
        return asked


#: The options of an engine made without any.
DEFAULT_OPTIONS = SplitOptions()


def options_dict(o: SplitOptions) -> dict:
    """``o`` as plain data for the status document (what a user chose; the panel shows it as
    rows)."""
    return {
        "exchange": o.exchange,
        "exchange_chunks": o.exchange_chunks,
        "head_pieces": o.head_pieces,
        "gather_overlap": o.gather_overlap,
        "gather_ahead": o.gather_ahead,
        "overlap_tuning": o.overlap_tuning,
        "pattern": o.pattern,
        "vram_residency": o.vram_residency,
        "attention": o.comfy_host.attention if o.comfy_host else o.attention,
        "cache_ram_reserve_gb": o.cache_ram_reserve_gb,
        "sparse": o.sparse.as_json() if o.sparse else None,
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


def process_key(devices: Sequence[str], options: SplitOptions) -> tuple:
    """What needs other worker processes: the rank devices, the shares (head groups), the
    attention function and the GPUs the workers see (the GPU-direct exchange across GPUs opens the
    others' buffers: :func:`worker_gpus`)."""
    return (
        tuple(devices),
        options.shares,
        options.attention,
        options.comfy_host,
        worker_gpus(devices, options),
    )


def worker_gpus(devices: Sequence[str], options: SplitOptions) -> tuple[str, ...]:
    """The GPUs every worker sees besides its own for ``options.exchange`` on ``devices`` (raises
    ``exchange_choice``'s refusal for an exchange that cannot run there)."""
    transport = exchange_choice.resolve(options.exchange, devices)
    return exchange_choice.also_visible(transport, devices)
