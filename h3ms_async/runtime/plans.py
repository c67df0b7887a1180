"""Which GPUs take part in a split, in which order, with which shares; how tokens and heads are
apportioned.

Rules as the node surface specifies them (``docs/comfyui_facts.md`` §7): the model's device is
always rank 0; explicit lists keep their order, ``auto`` takes ascending indices; excluded GPUs,
GPUs below the free VRAM floor and GPUs past ``max_gpus`` drop out with a note; shares default to
1.0.  Every error names the input and how to fix it.  Resolution is a pure function of the visible
device count and a free-memory probe, so it is tested without CUDA; ``resolve_cuda`` supplies those
from torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

MAX_GPUS = 8
DIT_MAX_RANKS = 8
_GIB = 1024**3
_AUTO = ("", "auto", "all")


class GPUSelectionError(ValueError):
    """A GPU-set input or the rank plan it leads to is invalid; the message names the input and the
    fix."""


def _parts(text: str) -> list[str]:
    return [p.strip() for p in text.replace(";", ",").split(",") if p.strip()]


def parse_index_list(text: str | None, what: str) -> tuple[int, ...] | None:
    """Parse a ``gpus``/``exclude`` field: ``"0,1,3"``, ``"cuda:0; cuda:2"``; empty/``auto``/``all``
    gives None."""
    norm = (text or "").strip().lower()
    if norm in _AUTO:
        return None
    out: list[int] = []
    for part in _parts(norm):
        token = part[len("cuda:") :].strip() if part.startswith("cuda:") else part
        try:
            idx = int(token)
        except ValueError:
            raise GPUSelectionError(
                f"{what}: {part!r} is not a CUDA index (use e.g. 0,1,3)"
            ) from None
        if idx < 0:
            raise GPUSelectionError(
                f"{what}: negative index {idx} (CUDA indices start at 0; use e.g. 0,1,3)"
            )
        if idx in out:
            raise GPUSelectionError(f"{what}: cuda:{idx} listed twice (list each GPU once)")
        out.append(idx)
    return tuple(out) if out else None


def parse_shares(text: str | None) -> tuple[float, ...]:
    """Parse ``shares``: relative work per GPU, e.g. ``"1,1,0.7"``; empty gives ()."""
    out: list[float] = []
    for part in _parts(text or ""):
        try:
            value = float(part)
        except ValueError:
            raise GPUSelectionError(
                f"shares: {part!r} is not a number (use e.g. 1,1,0.7)"
            ) from None
        if not math.isfinite(value) or value <= 0:
            raise GPUSelectionError(f"shares: {part!r} must be greater than 0 (use e.g. 1,1,0.7)")
        out.append(value)
    return tuple(out)


def _fmt_share(value: float) -> str:
    return f"{value:g}"


@dataclass(frozen=True)
class GPUSet:
    """A user's GPU selection, as the GPU Set node gives it (validated on construction).

    ``gpus`` None means all visible GPUs; ``shares`` follow the listed (or all visible) GPUs minus
    the excluded ones.  ``implicit_primary`` marks the legacy single-``second_gpu`` form, which adds
    the model GPU silently.
    """

    gpus: tuple[int, ...] | None = None
    exclude: tuple[int, ...] = ()
    shares: tuple[float, ...] = ()
    min_free_vram_gb: float = 0.0
    max_gpus: int = MAX_GPUS
    implicit_primary: bool = False

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_gpus, bool)
            or not isinstance(self.max_gpus, int)
            or not 1 <= self.max_gpus <= MAX_GPUS
        ):
            raise GPUSelectionError(
                f"max_gpus must be between 1 and {MAX_GPUS}, got {self.max_gpus!r}"
            )
        if not math.isfinite(self.min_free_vram_gb) or self.min_free_vram_gb < 0:
            raise GPUSelectionError(
                "min_free_vram_gb must be 0 or more (0 turns the check off), got "
                f"{self.min_free_vram_gb!r}"
            )
        if any(s <= 0 or not math.isfinite(s) for s in self.shares):
            raise GPUSelectionError(
                f"shares {self.shares} must all be greater than 0 (use e.g. 1,1,0.7)"
            )
        if self.gpus is not None and self.shares:
            listed = [g for g in self.gpus if g not in self.exclude]
            if len(self.shares) != len(listed):
                raise GPUSelectionError(_shares_mismatch(self.shares, listed))

    @classmethod
    def parse(
        cls,
        gpus: str = "auto",
        exclude: str = "",
        shares: str = "",
        min_free_vram_gb: float = 0.0,
        max_gpus: int = MAX_GPUS,
    ) -> GPUSet:
        """Build from the node's text fields."""
        return cls(
            parse_index_list(gpus, "gpus"),
            parse_index_list(exclude, "exclude") or (),
            parse_shares(shares),
            float(min_free_vram_gb),
            max_gpus,
        )

    @classmethod
    def legacy(cls, second_gpu: int) -> GPUSet:
        """The single ``second_gpu`` input: -1 is auto, N >= 0 is the model GPU plus cuda:N."""
        if second_gpu < -1:
            raise GPUSelectionError(
                f"second_gpu must be -1 (auto) or a CUDA index, got {second_gpu}"
            )
        return cls() if second_gpu == -1 else cls(gpus=(second_gpu,), implicit_primary=True)

    def describe(self) -> str:
        """One line, e.g. ``gpus 0,1,3, exclude 2, shares cuda:0=1,cuda:1=0.7, min free 4 GiB, max
        4``."""
        text = "gpus " + ("auto" if self.gpus is None else ",".join(map(str, self.gpus)))
        if self.exclude:
            text += ", exclude " + ",".join(map(str, self.exclude))
        if self.shares and self.gpus is not None:
            listed = [g for g in self.gpus if g not in self.exclude]
            text += ", shares " + ",".join(
                f"cuda:{g}={_fmt_share(s)}" for g, s in zip(listed, self.shares)
            )
        elif self.shares:
            text += ", shares " + ",".join(_fmt_share(s) for s in self.shares)
        if self.min_free_vram_gb > 0:
            text += f", min free {_fmt_share(self.min_free_vram_gb)} GiB"
        if self.max_gpus != MAX_GPUS:
            text += f", max {self.max_gpus}"
        return text


def _shares_mismatch(shares: Sequence[float], gpus: Sequence[int]) -> str:
    names = ",".join(f"cuda:{g}" for g in gpus) or "none"
    return (
        f"shares: {len(shares)} value(s) for {len(gpus)} GPU(s) ({names}); give one share per GPU "
        "in that order, or leave shares empty"
    )


@dataclass(frozen=True)
class RankPlan:
    """Resolved ranks: ``devices[0]`` is the model's GPU; ``shares[r]`` is rank r's relative
    work."""

    devices: tuple[str, ...]
    shares: tuple[float, ...]
    notes: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        """E.g. ``3 rank(s): cuda:0 (primary), cuda:2 share 0.7, cuda:3 | note; note``."""
        parts = []
        for r, (dev, share) in enumerate(zip(self.devices, self.shares)):
            label = dev + (" (primary)" if r == 0 else "")
            if share != 1.0:
                label += f" share {_fmt_share(share)}"
            parts.append(label)
        text = f"{len(self.devices)} rank(s): " + ", ".join(parts)
        return text + (" | " + "; ".join(self.notes) if self.notes else "")

    def limited(self, n: int) -> RankPlan:
        """Keep the first ``n`` ranks, with a note naming what was dropped."""
        if n < 1:
            raise GPUSelectionError(f"rank limit must be at least 1, got {n}")
        if len(self.devices) <= n:
            return self
        dropped = ", ".join(self.devices[n:])
        return RankPlan(
            self.devices[:n],
            self.shares[:n],
            (*self.notes, f"at most {n} ranks: dropped {dropped}"),
        )


def _not_visible(idx: int, visible_count: int) -> GPUSelectionError:
    return GPUSelectionError(
        f"cuda:{idx} does not exist: {visible_count} CUDA device(s) visible (CUDA_VISIBLE_DEVICES "
        "/ --cuda-device limit what ComfyUI sees)"
    )


def resolve(
    gpu_set: GPUSet,
    primary_index: int | None,
    *,
    visible_count: int,
    free_vram: Callable[[int], int | None],
) -> RankPlan:
    """The rank plan of ``gpu_set`` for a model on ``cuda:primary_index`` (None means 0).

    ``free_vram(i)`` returns free bytes of cuda:i or None when unknown; it is only asked when a
    floor is set, and never about the primary.
    """
    if visible_count < 1:
        raise GPUSelectionError(
            "no CUDA device is visible; the split needs the model on a CUDA GPU"
        )
    p = 0 if primary_index is None else primary_index
    if not 0 <= p < visible_count:
        raise _not_visible(p, visible_count)
    for idx in (*(gpu_set.gpus or ()), *gpu_set.exclude):
        if idx >= visible_count:
            raise _not_visible(idx, visible_count)
    if p in gpu_set.exclude:
        raise GPUSelectionError(
            f"exclude: the model's device cuda:{p} is excluded; it must take part (it runs the H3 "
            "forward). Remove it from exclude or move the model to another GPU"
        )
    listed = list(gpu_set.gpus) if gpu_set.gpus is not None else list(range(visible_count))
    candidates = [g for g in listed if g not in gpu_set.exclude]
    if gpu_set.shares and len(gpu_set.shares) != len(candidates):
        raise GPUSelectionError(_shares_mismatch(gpu_set.shares, candidates))
    share_of = dict(zip(candidates, gpu_set.shares)) if gpu_set.shares else {}

    notes: list[str] = []
    if p in candidates:
        candidates.remove(p)
    elif gpu_set.gpus is not None and not gpu_set.implicit_primary:
        notes.append(f"added the model's device cuda:{p} as rank 0 (not in the gpus list)")

    chosen = [p]
    floor = gpu_set.min_free_vram_gb
    for g in candidates:
        if floor > 0:
            free = free_vram(g)
            if free is not None and free < floor * _GIB:
                notes.append(
                    f"skipped cuda:{g}: {free / _GIB:.1f} GiB free < min_free_vram_gb "
                    f"{_fmt_share(floor)}"
                )
                continue
        chosen.append(g)
    if len(chosen) > gpu_set.max_gpus:
        dropped = ", ".join(f"cuda:{g}" for g in chosen[gpu_set.max_gpus :])
        notes.append(f"max_gpus {gpu_set.max_gpus}: dropped {dropped}")
        chosen = chosen[: gpu_set.max_gpus]
    return RankPlan(
        tuple(f"cuda:{g}" for g in chosen),
        tuple(share_of.get(g, 1.0) for g in chosen),
        tuple(notes),
    )


def resolve_cuda(gpu_set: GPUSet, primary: str | int | None) -> RankPlan:
    """``resolve`` with the visible devices and free memory from ``torch.cuda`` (primary:
    ``cuda:N``, N or None)."""
    import torch

    if isinstance(primary, str):
        dev = torch.device(primary)
        if dev.type != "cuda":
            raise GPUSelectionError(f"the model is on {primary}; the split needs it on a CUDA GPU")
        primary = dev.index
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0

    def free_vram(i: int) -> int | None:
        try:
            return int(torch.cuda.mem_get_info(i)[0])
        except RuntimeError:
            return None

    return resolve(gpu_set, primary, visible_count=count, free_vram=free_vram)


def partition(total: int, shares: Sequence[float], what: str = "tokens") -> list[int]:
    """Bounds ``[0, b1, ..., total]`` giving rank r the items ``[b_r, b_{r+1})`` in proportion to
    ``shares``.

    Largest remainder: ``raw_r = total*share_r/sum``, ``size_r = max(1, floor(raw_r))``; while
    short, +1 to the largest ``raw - size``; while over, -1 (among sizes > 1) from the largest
    ``size - raw``; ties go to the higher rank.  56 heads on 3 equal ranks → 18/19/19; shares
    1,1,0.7 → 21/21/14.
    """
    n = len(shares)
    if n < 1:
        raise GPUSelectionError("partition needs at least one rank share")
    if any(not math.isfinite(s) or s <= 0 for s in shares):
        raise GPUSelectionError(
            f"shares {list(shares)} must all be greater than 0 (use e.g. 1,1,0.7)"
        )
    if total < n:
        raise GPUSelectionError(
            f"cannot split {total} {what} across {n} ranks; use at most {total} ranks"
        )
    total_share = float(sum(shares))
    raw = [total * s / total_share for s in shares]
    size = [max(1, math.floor(r)) for r in raw]
    while sum(size) < total:
        r = max(range(n), key=lambda i: (raw[i] - size[i], i))
        size[r] += 1
    while sum(size) > total:
        r = max((i for i in range(n) if size[i] > 1), key=lambda i: (size[i] - raw[i], i))
        size[r] -= 1
    bounds = [0]
    for s in size:
        bounds.append(bounds[-1] + s)
    return bounds


def rank_map(spec: str) -> list[str]:
    """Parse a rank map, one device per rank: ``"cpu,cpu,cpu"`` or ``"cuda:0,cuda:0,cuda:1"`` (1..8
    ranks)."""
    devices = []
    for part in _parts((spec or "").lower()):
        if part == "cpu":
            devices.append("cpu")
            continue
        idx = part[len("cuda:") :] if part.startswith("cuda:") else None
        if idx is None or not idx.isdigit():
            raise GPUSelectionError(
                f"rank map: {part!r} is not a device; use cpu or cuda:N (e.g. cuda:0,cuda:0,cuda:1)"
            )
        devices.append(f"cuda:{int(idx)}")
    if not devices:
        raise GPUSelectionError(
            "rank map is empty; give one device per rank, e.g. cpu,cpu or cuda:0,cuda:1"
        )
    if len(devices) > DIT_MAX_RANKS:
        raise GPUSelectionError(
            f"rank map has {len(devices)} ranks; at most {DIT_MAX_RANKS} are supported"
        )
    if len({d.split(":")[0] for d in devices}) > 1:
        raise GPUSelectionError(
            f"rank map {spec!r} mixes cpu and cuda ranks; use one kind for all ranks"
        )
    return devices


@dataclass(frozen=True)
class SplitPlan:
    """Rank r runs on ``devices[r]`` and owns tokens ``[token_bounds[r], token_bounds[r+1])`` and
    heads ``[head_bounds[r], head_bounds[r+1])``."""

    devices: tuple[str, ...]
    token_bounds: tuple[int, ...]
    head_bounds: tuple[int, ...]

    @property
    def ranks(self) -> int:
        return len(self.devices)

    def heads_per_rank(self) -> list[int]:
        return [b - a for a, b in zip(self.head_bounds, self.head_bounds[1:])]

    def tokens_per_rank(self) -> list[int]:
        return [b - a for a, b in zip(self.token_bounds, self.token_bounds[1:])]


def make_split_plan(
    devices: Sequence[str], shares: Sequence[float] | None, tokens: int, heads: int
) -> SplitPlan:
    """Apportion ``tokens`` and ``heads`` over the ranks by ``shares`` (None: equal)."""
    n = len(devices)
    if n < 1:
        raise GPUSelectionError("the split needs at least one rank device")
    if shares is None:
        shares = [1.0] * n
    if len(shares) != n:
        raise GPUSelectionError(_shares_mismatch_ranks(shares, devices))
    if n > heads:
        raise GPUSelectionError(
            f"{n} ranks but the model has only {heads} attention heads; use at most {heads} ranks"
        )
    if tokens < n:
        raise GPUSelectionError(
            f"cannot split {tokens} tokens across {n} ranks; use at most {tokens} ranks"
        )
    return SplitPlan(
        tuple(devices),
        tuple(partition(tokens, shares, "tokens")),
        tuple(partition(heads, shares, "attention heads")),
    )


def _shares_mismatch_ranks(shares: Sequence[float], devices: Sequence[str]) -> str:
    return (
        f"shares: {len(shares)} value(s) for {len(devices)} rank(s) ({','.join(devices)}); give "
        "one share per rank"
    )
