"""The weight store's and a rank's bytes for full-width H3 (int8 linears, bf16 rest), from the block
manifest alone (nothing is filled): per block, the store before and after the adaLN weights left it,
and what a CUDA rank keeps per block at N ranks (its head group's qkv rows, every other weight).

    PYTHONPATH=. python benchmarks/store_bytes.py   # JSON on stdout (docs/performance.md, "Modulation
                                                    # computed once")
"""
from __future__ import annotations

import json
import math

from h3ms_async.dit.reference import DiTConfig
from workers.dit import ops
from workers.runtime.shm import slot_bytes

GIB = 1 << 30
SIZES = {"int8": 1, "bfloat16": 2, "float32": 4}


def manifest(cfg: DiTConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """One block as an int8 checkpoint stores it: the four linears int8 with a tensorwise fp32 scale, the rest bf16."""
    out = {}
    for name, shape in cfg.block_shapes().items():
        linear = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and linear in ops.INT8_LINEARS:
            out[name] = ("int8", shape)
            out[f"{linear}.weight_scale"] = ("float32", (1,))
        else:
            out[name] = ("bfloat16", shape)
    return out


def main() -> None:
    cfg = DiTConfig()
    man = manifest(cfg)
    store = {n: slot_bytes(d, s) for n, (d, s) in man.items()}  # 4 KiB-aligned, as the store lays them out
    before = sum(store.values())
    after = sum(b for n, b in store.items() if ops.held_by_ranks(n))
    qkv = math.prod(man["attn.qkv_proj.weight"][1]) * SIZES["int8"]
    ranks = {}
    for n in (1, 2, 4, 8):
        # a rank copies its head group's qkv rows (the largest group: ceil) and views every other weight
        per = after - store["attn.qkv_proj.weight"] + qkv * math.ceil(cfg.heads / n) // cfg.heads
        ranks[n] = {"per_block_gib": per / GIB, "blocks_gib": per * cfg.layers / GIB,
                    "before_per_block_gib": (per + before - after) / GIB,
                    "before_blocks_gib": (per + before - after) * cfg.layers / GIB}
    print(json.dumps({"config": cfg.__dict__, "per_block_bytes": {"before": before, "after": after,
                      "adaln": before - after}, "store_gib": {"before": before * cfg.layers / GIB,
                      "after": after * cfg.layers / GIB}, "rank": ranks,
                      "modulation_rows_mb_per_timestep_row": cfg.layers * ops.adaln_width(cfg.hidden) * 2 / 1e6},
                     indent=1))


if __name__ == "__main__":
    main()
