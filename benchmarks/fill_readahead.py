"""The weight-store fill from a cold checkpoint, with and without the readahead, side by side in one run.

    python benchmarks/fill_readahead.py --layers 4 --out /tmp/fill.json          (CPU or GPU machine; no ComfyUI)

Writes an H3 checkpoint in ComfyUI's int8 format at full width (``tests/comfy_h3.py``: int8 linears, bf16 adaLN and
norms; ``--layers`` blocks) to ``--dir`` (default: beside this script's checkout, on the disk, not tmpfs), then, for
each variant, alternating (``--repeats`` rounds): drops the file from the page cache (``posix_fadvise`` DONTNEED),
maps it as ComfyUI does (``safetensors.safe_open``: each tensor a view of the file's mapping) and fills a real weight
store (``size_store`` + ``StoreFill.run``, the split's own code) with every block's weights but the adaLN projection:

* ``fault``: the copy faults the file's pages in as it reads them (the fill before the readahead);
* ``ahead``: :class:`BlockReadahead` asks the kernel for the block being read and the next two
  (what ``nodes/comfy_weights.py::block_reader`` does).

Beside them, the file's sequential read rate after a drop (``read()`` of 64 MiB pieces) and a host memcpy's rate.
Prints one JSON document (also to ``--out``): per variant the fill's seconds and GB/s per round, and each best over
the disk's rate.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import comfy_h3  # noqa: E402
from h3ms_async.runtime.readahead import BlockReadahead  # noqa: E402
from h3ms_async.runtime.weight_store import size_store  # noqa: E402
from workers.dit.ops import held_by_ranks  # noqa: E402

PREFIX = "blocks."


def drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_gbps(path: str) -> float:
    drop(path)
    n, t = 0, time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(64 << 20):
            n += len(chunk)
    return n / (time.perf_counter() - t) / 1e9


def memcpy_gbps(nbytes: int = 1 << 30) -> float:
    a, b = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    b.copy_(a)
    t = time.perf_counter()
    for _ in range(3):
        b.copy_(a)
    return 3 * nbytes / (time.perf_counter() - t) / 1e9


def fill(path: str, layers: int, ahead: bool) -> tuple[float, int]:
    """One fill of a store from the dropped file; (seconds, bytes)."""
    drop(path)
    with safe_open(path, framework="pt") as f:
        names = [k for k in f.keys() if k.startswith(PREFIX)]
        readahead = BlockReadahead.of(path, held_by_ranks) if ahead else None

        def read(i: int) -> dict[str, torch.Tensor]:
            if readahead is not None:
                readahead.reading(i)
            p = f"{PREFIX}{i}."
            return {k[len(p):]: f.get_tensor(k) for k in names if k.startswith(p) and held_by_ranks(k[len(p):])}

        t = time.perf_counter()
        sized = size_store(("bench-fill", ahead), layers, read)
        try:
            store = sized.run()
            return time.perf_counter() - t, store.nbytes
        finally:
            sized.store.release()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dir", default=ROOT, help="where the checkpoint is written (a disk, not tmpfs)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    path = os.path.join(a.dir, f".fill_readahead_{os.getpid()}.safetensors")
    try:
        t = time.perf_counter()
        save_file(comfy_h3.state_dict(layers=a.layers, int8=True, dtype=torch.bfloat16, dims=comfy_h3.FULL), path)
        write_s = time.perf_counter() - t
        disk = disk_gbps(path)
        rows: dict[str, list[dict]] = {"fault": [], "ahead": []}
        for _ in range(a.repeats):
            for variant in rows:
                s, nbytes = fill(path, a.layers, variant == "ahead")
                rows[variant].append({"fill_s": round(s, 3), "gbps": round(nbytes / s / 1e9, 3), "bytes": nbytes})
        res = {
            "machine": os.uname().nodename, "cpus": os.cpu_count(), "layers": a.layers,
            "checkpoint_bytes": os.path.getsize(path), "write_s": round(write_s, 2),
            "disk_read_gbps": round(disk, 3), "host_memcpy_gbps": round(memcpy_gbps(), 2),
            "variants": rows,
            "best_over_disk": {v: round(max(r["gbps"] for r in rs) / disk, 3) for v, rs in rows.items()},
        }
    finally:
        if os.path.exists(path):
            os.remove(path)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
