"""How many intra-op threads a CPU rank runs with."""

from __future__ import annotations

import os
from collections.abc import Sequence


def cpu_thread_env(devices: Sequence[str]) -> dict[str, str]:
    """CPU ranks share the machine's cores: more intra-op threads than cores make OpenMP spin
    against itself."""
    n_cpu = sum(1 for d in devices if d == "cpu")
    if not n_cpu or "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n_cpu))}
