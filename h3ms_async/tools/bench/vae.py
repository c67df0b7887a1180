"""``python -m h3ms_async bench vae``: the VAE split decode on one GPU's logical ranks vs ComfyUI's
unsplit decode.

ComfyUI's H3 VAE code runs in a child process started in the given ComfyUI root (this process never
imports ComfyUI); the child runs ``benchmarks/vae_split_comfy.py``.  Output: one JSON (also written
to ``--out``) with, per rank count, whether the split equals the unsplit decode bit for bit, wall
times, and the engine's decode record: per chunk rank, decode/copy/wait seconds and bytes, bytes
moved, and the ComfyUI process's own decode time against the time it waited for workers.  Defaults:
full-size H3 VAE, latent T=72 (243 frames) of 1344x768 (48x84 latent).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from h3ms_async import PACK_ROOT
from h3ms_async.tools.cli import ArgParser
from workers.runtime import config

BODY = PACK_ROOT / "benchmarks" / "vae_split_comfy.py"

_PRELUDE = """\
import sys, runpy
sys.path.insert(0, {root!r})
sys.path.extend({extra!r})
sys.argv = ["main.py"] + {argv!r}
import comfy.options
comfy.options.enable_args_parsing()
runpy.run_path({body!r}, run_name="__main__")
"""


def _ranks(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ranks {text!r}: give rank counts like 2,4") from None
    if not values or any(not 2 <= v <= 8 for v in values):
        raise argparse.ArgumentTypeError(f"--ranks {text!r}: every count must be 2..8")
    return values


def main(argv: Sequence[str]) -> int:
    p = ArgParser(prog="python -m h3ms_async bench vae", description=__doc__)
    p.add_argument(
        "--comfy-root",
        default=config.COMFY_ROOT.get(),
        help="ComfyUI root with MiniMax H3 (default: $H3MS_COMFY_ROOT)",
    )
    p.add_argument(
        "--extra-path", action="append", default=[], help="more sys.path entries, last (e.g. shims)"
    )
    p.add_argument(
        "--comfy-args", default="--disable-api-nodes", help="ComfyUI flags for both sides"
    )
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16")
    p.add_argument(
        "--ranks", type=_ranks, default=[2, 4], help="logical rank counts on the device, e.g. 2,4"
    )
    p.add_argument("--T", type=int, default=72, help="latent frames (72 -> 243 video frames)")
    p.add_argument("--height", type=int, default=48, help="latent height (48 -> 768 px)")
    p.add_argument("--width", type=int, default=84, help="latent width (84 -> 1344 px)")
    p.add_argument("--device", choices=("cuda:0", "cpu"), default="cuda:0", help="cpu: a smoke run")
    p.add_argument("--layers", type=int, default=36, help="decoder layers (H3: 36)")
    p.add_argument("--heads", type=int, default=32, help="decoder heads of 64 (H3: 32)")
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--timeout", type=float, default=3000.0)
    p.add_argument("--out", default="", help="folder for bench_vae_<dtype>.json")
    a = p.parse_args(list(argv))
    root = Path(a.comfy_root).resolve() if a.comfy_root else None
    if root is None or not (root / "comfy" / "ldm" / "minimax" / "vae.py").is_file():
        p.error(
            f"--comfy-root {a.comfy_root!r} is not a ComfyUI root with comfy/ldm/minimax/vae.py; "
            "give one"
        )
    cfg = {
        "pack": str(PACK_ROOT),
        "device": a.device,
        "dtype": a.dtype,
        "ranks": a.ranks,
        "T": a.T,
        "height": a.height,
        "width": a.width,
        "layers": a.layers,
        "heads": a.heads,
        "seed": a.seed,
    }
    code = _PRELUDE.format(
        root=str(root),
        extra=[str(Path(x).resolve()) for x in a.extra_path],
        argv=a.comfy_args.split(),
        body=str(BODY),
    )
    env = dict(os.environ, **{config.VAE_BENCH.name: json.dumps(cfg)}, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=a.timeout,
        stdin=subprocess.DEVNULL,
        check=False,  # a failed child is reported below with its output
    )
    sys.stderr.write(proc.stderr[-20000:])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(proc.stdout[-5000:], file=sys.stderr)
        print(f"bench vae: the ComfyUI child failed (exit {proc.returncode})", file=sys.stderr)
        return 1
    result = json.loads(lines[-1][len("RESULT ") :])
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / f"bench_vae_{a.dtype}.json").write_text(text)
    return 0 if all(r["equal"] and r["equal_first"] for r in result["runs"]) else 1
