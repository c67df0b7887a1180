"""The weight-store fill from a checkpoint, cold and cached, each way the store can take its bytes, side by side.

    python benchmarks/fill_readahead.py --layers 4 --out /tmp/fill.json          (CPU or GPU machine; no ComfyUI)

Writes an H3 checkpoint in ComfyUI's int8 format at full width (``tests/comfy_h3.py``: int8 linears, bf16 adaLN and
norms; ``--layers`` blocks) to ``--dir`` (default: beside this script's checkout, on the disk, not tmpfs), then, for
each variant, alternating (``--repeats`` rounds): drops the file from the page cache (``posix_fadvise`` DONTNEED;
not for ``cached``), maps it as ComfyUI's safetensors load does under DynamicVRAM (one read-only mapping, each
tensor a view of it, its file range known) and fills a real weight store (``size_store`` + ``StoreFill.run``, the
split's own code) with every block's weights but the adaLN projection:

* ``fault``: the copy faults the file's pages in as it reads them (no readahead);
* ``ahead``: :class:`BlockReadahead` reads the store's tensors of the block being read and the next ``BLOCKS_AHEAD``
  into the page cache, in the background, in large sequential reads;
* ``separate``: a first prompt as the node ran it before c6e4dad: every block's adaLN weights read first (what
  ComfyUI's modules read to compute the step's rows: one copy out of the mapping), then the ``ahead`` fill;
* ``interleaved``: block i's adaLN weights read just before block i's store tensors, the readahead asking for whole
  blocks;
* ``cached``: the fill from a file already in the page cache.

Each ends in ``_view`` (the views handed over as tensors: the store writes one block at a time, as it does for
tensors a host made) or ``_file`` (the views' file ranges, ``FileBytes``, what the node hands it for every tensor ComfyUI
maps unchanged: up to ``WRITERS`` blocks written at once, each into its own segment, from the fill's own
mapping of the file);
``interleaved_file`` is the node's first prompt now.
``separate`` and ``interleaved`` read the adaLN bytes too: their rate counts every byte they read (``read_bytes``),
the others' the store's. Beside them, the file's sequential read rate after a drop (``read()`` of 64 MiB pieces) and
a host memcpy's rate, into memory already written and into fresh pages (what a new store's fill writes into). Prints
one JSON document (also to ``--out``): per variant the seconds (``create_s`` of them sizing and creating the store)
and GB/s per round; each cold variant's best over the disk's rate, each ``cached`` one's over both memcpy rates, and
its copies' own rate past the store's creation (``cached_copy_best_gbps``).
"""
from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import comfy_h3  # noqa: E402
from page_cache import drop  # noqa: E402
from h3ms_async.runtime.file_bytes import FileBytes  # noqa: E402
from h3ms_async.runtime.readahead import BlockReadahead, read_header  # noqa: E402
from h3ms_async.runtime.weight_store import size_store  # noqa: E402
from workers.dit.ops import held_by_ranks  # noqa: E402

PREFIX = "blocks."
DTYPES = {"I8": torch.int8, "U8": torch.uint8, "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
VARIANTS = [f"{kind}_{how}" for kind in ("fault", "ahead", "separate", "interleaved", "cached")
            for how in ("view", "file")]


def disk_gbps(path: str) -> float:
    drop(path)
    n, t = 0, time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(64 << 20):
            n += len(chunk)
    return n / (time.perf_counter() - t) / 1e9


def memcpy_gbps(nbytes: int = 1 << 30, *, fresh: bool = False) -> float:
    """A host memcpy's rate into memory already written (``fresh``: into newly allocated pages, as
    a new store's fill must write: each page allocated on its first write)."""
    a = torch.ones(nbytes, dtype=torch.uint8)
    # allocated, never written: their pages come with the first write
    dst = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(3 if fresh else 1)]
    if not fresh:
        dst[0].copy_(a)
    t = time.perf_counter()
    for i in range(3):
        dst[i % len(dst)].copy_(a)
    return 3 * nbytes / (time.perf_counter() - t) / 1e9


def is_adaln(name: str) -> bool:
    return not held_by_ranks(name)


class Checkpoint:
    """The file mapped as ComfyUI's safetensors load maps it under DynamicVRAM (``comfy.utils.load_safetensors``):
    each tensor a view of one read-only mapping, its file range known."""

    def __init__(self, path: str) -> None:
        self.base, header = read_header(path)
        self.info = {k: v for k, v in header.items() if k.startswith(PREFIX)}
        self.fd = os.open(path, os.O_RDONLY)
        self.map = mmap.mmap(self.fd, 0, prot=mmap.PROT_READ)

    def view(self, name: str) -> torch.Tensor:
        info = self.info[name]
        a, b = info["data_offsets"]
        with warnings.catch_warnings():  # a read-only mapping, by design
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            dtype = DTYPES[info["dtype"]]
            flat = torch.frombuffer(self.map, dtype=dtype, count=(b - a) // dtype.itemsize, offset=self.base + a)
        return flat.view(info["shape"])

    def source(self, name: str, marked: bool):
        t = self.view(name)
        return FileBytes(t, self.fd, self.base + self.info[name]["data_offsets"][0]) if marked else t

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


def fill(path: str, layers: int, variant: str) -> tuple[float, float, int, int, int]:
    """One fill of a store as ``variant`` reads the file; (seconds, of them the store's sizing and creation, store
    bytes, bytes read, bytes the store took as the file's)."""
    kind, _, how = variant.partition("_")
    marked = how == "file"
    if kind != "cached":
        drop(path)
    ck = Checkpoint(path)
    try:
        wanted = (lambda _i, _n: True) if kind == "interleaved" else (lambda _i, name: held_by_ranks(name))
        readahead = BlockReadahead.of(path, wanted) if kind not in ("fault", "cached") else None
        adaln_bytes = [0]

        def names(i: int, keep) -> list[str]:
            p = f"{PREFIX}{i}."
            return [k for k in ck.info if k.startswith(p) and keep(k[len(p):])]

        def rows(i: int) -> None:  # what computing block i's adaLN rows reads: one copy out of the mapping
            adaln_bytes[0] += sum(ck.view(k).clone().nbytes for k in names(i, is_adaln))

        def read(i: int):
            if readahead is not None:
                readahead.reading(i)
            if kind == "interleaved":
                rows(i)
            p = len(f"{PREFIX}{i}.")
            return {k[p:]: ck.source(k, marked) for k in names(i, held_by_ranks)}

        t = time.perf_counter()
        if kind == "separate":
            for i in range(layers):
                rows(i)
        sized = size_store(("bench-fill", variant), layers, read)
        created = time.perf_counter() - t
        try:
            store = sized.run()
            return time.perf_counter() - t, created, store.nbytes, store.nbytes + adaln_bytes[0], store.file_bytes
        finally:
            if readahead is not None:
                readahead.close()
            sized.store.release()
    finally:
        gc.collect()  # the fill's views of the mapping, before it closes
        ck.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dir", default=ROOT, help="where the checkpoint is written (a disk, not tmpfs)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"some of {','.join(VARIANTS)}")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    variants = a.variants.split(",")
    if not variants or set(variants) - set(VARIANTS):
        p.error(f"--variants: each one of {', '.join(VARIANTS)}")
    path = os.path.join(a.dir, f".fill_readahead_{os.getpid()}.safetensors")
    try:
        t = time.perf_counter()
        save_file(comfy_h3.state_dict(layers=a.layers, int8=True, dtype=torch.bfloat16, dims=comfy_h3.FULL), path)
        write_s = time.perf_counter() - t
        disk = disk_gbps(path)
        rows: dict[str, list[dict]] = {v: [] for v in variants}
        for _ in range(a.repeats):
            for variant in rows:
                s, created, nbytes, read, from_file = fill(path, a.layers, variant)
                rows[variant].append({"fill_s": round(s, 3), "create_s": round(created, 3),
                                      "gbps": round(read / s / 1e9, 3), "bytes": nbytes, "read_bytes": read,
                                      "file_bytes": from_file})
        memcpy, fresh = memcpy_gbps(), memcpy_gbps(fresh=True)
        best = {v: max(r["gbps"] for r in rs) for v, rs in rows.items()}
        res = {
            "machine": os.uname().nodename, "cpus": os.cpu_count(), "layers": a.layers,
            "checkpoint_bytes": os.path.getsize(path), "write_s": round(write_s, 2),
            "disk_read_gbps": round(disk, 3), "host_memcpy_gbps": round(memcpy, 2),
            "host_memcpy_fresh_gbps": round(fresh, 2),
            "variants": rows,
            "best_over_disk": {v: round(g / disk, 3) for v, g in best.items() if not v.startswith("cached")},
            "cached_best_over_memcpy": {v: round(g / memcpy, 3) for v, g in best.items() if v.startswith("cached")},
            "cached_best_over_fresh_memcpy": {v: round(g / fresh, 3) for v, g in best.items()
                                              if v.startswith("cached")},
            # the writes alone, past the store's sizing (block 0 read, the segments made)
            "cached_copy_best_gbps": {v: round(max(r["bytes"] / (r["fill_s"] - r["create_s"]) for r in rs) / 1e9, 3)
                                      for v, rs in rows.items() if v.startswith("cached")},
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
