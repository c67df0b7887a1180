"""Test-wide settings.

The suite runs with the CPU's own kernels: no CPU-ISA setting here (on an AMX CPU ``ATEN_CPU_CAPABILITY=avx2`` breaks
torch's bf16 attention).  A test that needs another code path sets it for a process of its own
(``tests/cpu_paths.py``); ``scripts/h3ms.sh test`` runs the ``exactness`` tests a second time under other settings.
"""
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("H3MS_TEST_HOOKS", "1")
# Each test measures its plans as a first start would: no verdict from an earlier run on the user's disk.
os.environ.setdefault("H3MS_INVARIANCE_CACHE", "off")

ROOT = Path(__file__).resolve().parent.parent

# The signal tests press Ctrl-C on a demo as a terminal does.  A runner that starts the suite in the background of a
# non-interactive shell (``cmd &``) starts it with SIGINT ignored, which every process it spawns would inherit (a
# Python started so never raises KeyboardInterrupt); a handler of our own is reset to the default at exec instead.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: The project's shared folder (ComfyUI archive, golden tensors): ``$H3MS_SHARED``, else ``../shared`` next to the clone.
SHARED = Path(os.environ.get("H3MS_SHARED") or ROOT.parent / "shared")
GOLDEN_DIR = Path(os.environ.get("H3MS_GOLDEN_DIR") or SHARED / "golden")


import glob  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402
from workers.runtime.shm import held_shm  # noqa: E402


@pytest.fixture
def no_exchange_leaks():
    """After an exchange test: none of this process's shm segments, no probe run dirs, no child processes."""
    import gc

    import psutil
    yield
    gc.collect()  # an exception a test kept holds its frames' tensor views of a segment until the cycle is collected
    assert not held_shm(os.getpid()), "shm segments left behind"
    assert not glob.glob(f"/dev/shm/h3ms-{os.getpid()}-*"), "named probe arenas left behind"
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"h3ms-xch-{os.getpid()}-*")), "run dirs left behind"
    assert not psutil.Process().children(recursive=True), "child processes left behind"


def run_probe_cases(world: int, cases: list[dict], timeout_s: float = 120) -> list[dict]:
    """Run exchange probe ranks (workers.transports.probe) on ``cases``; every rank must finish without error and
    with all its comparisons equal.  Returns the per-rank records."""
    from h3ms_async.tools.bench.exchange import ProbeGroup
    with ProbeGroup(world, cases) as grp:
        grp.start()
        recs = grp.results(timeout_s=timeout_s)
    for rec in recs:
        assert rec["error"] is None, rec["error"]
        assert rec["ok"], [c["failures"] for c in rec["cases"]]
    return recs
