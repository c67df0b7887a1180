"""Which pattern a split loads for: how each block's attention gets its inputs."""

from __future__ import annotations

from collections.abc import Sequence

from h3ms_async.dit import speed_model, tested_paths
from h3ms_async.dit.options import SplitOptions
from h3ms_async.dit.reference import DiTConfig
from workers.dit.protocol import Pattern, Transport


def pick_pattern(
    options: SplitOptions, devices: Sequence[str], transport: Transport, config: DiTConfig
) -> Pattern:
    """The option's pattern, or for "auto" the one whose exchange moves fewer bytes among those
    tested on these devices (the all-gather with sparse attention or one rank)."""
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
        "nccl" if transport.collective else transport.value,
        options.shares,
    )
    return Pattern(picked)
