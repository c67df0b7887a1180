"""Which pattern a split loads for: how each block's attention gets its inputs."""

from __future__ import annotations

from collections.abc import Sequence

from h3ms_async.dit import speed_model, tested_paths
from h3ms_async.dit.exactness import Overlap
from h3ms_async.dit.options import SplitOptions
from h3ms_async.dit.reference import DiTConfig
from workers.dit.protocol import PATTERNS, Pattern, Transport


def pick_pattern(
    options: SplitOptions, devices: Sequence[str], transport: Transport, config: DiTConfig
) -> Pattern:
    """The option's pattern, or for "auto" the one the speed model predicts faster among those
    tested on these devices, each with the overlaps these options let it run there (the all-gather
    with sparse attention or one rank)."""
    if options.pattern != "auto":
        return Pattern(options.pattern)
    if (
        options.sparse is not None
        or len(devices) == 1
        or not tested_paths.is_tested(tested_paths.SplitPath.ULYSSES, devices)
    ):
        return Pattern.GATHER
    picked = speed_model.choose_pattern(
        config.hidden,
        config.heads,
        config.head_dim,
        len(devices),
        _modelled(transport),
        {p: Overlap(*options.overlaps_on(devices, p)) for p in PATTERNS},
        options.shares,
    )
    return Pattern(picked)


def _modelled(transport: Transport) -> str:
    """The speed model's name for ``transport`` (gloo is the CPU form of NCCL; the no-exchange
    baseline loads the pattern host staging would)."""
    if transport.collective:
        return "nccl"
    return "host" if transport == Transport.NONE else transport.value
