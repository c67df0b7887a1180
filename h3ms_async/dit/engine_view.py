"""What the plan probe and ``verify`` use of a split engine (``h3ms_async.dit.split.SplitEngine``
implements it): its ranks, what they loaded, its options, waiting for the ranks and running a
planned step.  A protocol, so that the step driver imports them and not the reverse."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from h3ms_async.dit.loaded import LoadedWeights
from h3ms_async.dit.options import SplitOptions
from h3ms_async.dit.step import PlannedStep
from h3ms_async.runtime.pool import WorkerPool
from workers.dit import protocol as dit_protocol


class EngineView(Protocol):
    devices: list[str]
    options: SplitOptions
    loaded: LoadedWeights | None
    pool: WorkerPool
    #: per rank, from ``dit_load``: the device fingerprint and SM count (None on a CPU)
    fingerprints: list[dict]
    sm_counts: list[int | None]
    last_rank_results: list[dit_protocol.DitStepped]

    @property
    def ranks(self) -> int: ...

    def run(
        self,
        coro: Coroutine[Any, Any, Any],
        timeout: float,
        what: str,
        interrupt: Callable[[], bool] | None = None,
        poll: Callable[[], None] | None = None,
    ) -> Any: ...

    def job(self) -> AbstractContextManager[None]: ...

    async def ensure_loaded(self) -> None: ...

    def run_planned(self, planned: PlannedStep) -> torch.Tensor: ...

    def drop_sparse_stats(self) -> int: ...
