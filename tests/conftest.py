"""Test-wide settings.

The golden tensors in ../shared/golden were recorded with ATen's AVX2 kernels; on an AVX-512 host the default
kernels round differently in the last bit.  The capability must be fixed before torch is imported, and worker
subprocesses inherit it through the environment.
"""
import os
import sys
from pathlib import Path

os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("MKL_CBWR", "AVX2")
os.environ.setdefault("H3MS_TEST_HOOKS", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GOLDEN_DIR = Path(os.environ.get("H3MS_GOLDEN_DIR", ROOT.parent / "shared" / "golden"))
