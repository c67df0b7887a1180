"""Helpers of the fault-campaign tests (tests/test_faults_*.py): a private /dev/shm, a tiny split model, leak probes.

A private tmpfs on /dev/shm (``unshare -m`` + ``mount -t tmpfs``) makes two things measurable that a shared
machine's /dev/shm cannot show: a full /dev/shm, and "every byte came back" (its used count returns to 0).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Prelude of every script these tests run: the pack on sys.path, /dev/shm's use, the result line.
BASE_PRELUDE = textwrap.dedent("""\
    import json, os, sys, time
    sys.path.insert(0, {root!r})

    def shm_used():
        st = os.statvfs("/dev/shm")
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def report(**fields):
        print("RESULT " + json.dumps(fields), flush=True)
    """).format(root=str(ROOT))

#: ... and a tiny split model with a bit-exact check.
MODEL_PRELUDE = BASE_PRELUDE + textwrap.dedent("""\
    import torch
    from h3ms_async.dit.layout import layout_for_tokens
    from h3ms_async.dit.reference import DiTConfig, ReferenceDiT, make_step_inputs
    from h3ms_async.dit.options import SplitOptions
    from h3ms_async.dit.split import SplitEngine

    CFG = DiTConfig(hidden=256, layers=1, heads=4, head_dim=64, ffn=640, t_dim=128, rope_pairs=30)
    MODEL = ReferenceDiT(CFG, weights="int8", seed=7)

    def make_engine(ranks=("cpu", "cpu")):
        engine = SplitEngine(list(ranks), SplitOptions())
        engine.load_weights(("faults", 7), CFG, MODEL.block_weights)
        return engine

    def step(engine, tokens, seed=1):
        inp = make_step_inputs(CFG, layout_for_tokens(tokens), seed, torch.bfloat16)
        out = engine.run_blocks(inp.x, MODEL.modulation(inp.t_emb), inp.segments, inp.rope_freqs)
        ref = MODEL.forward_blocks(inp.x.clone(), inp.t_emb, inp.segments, inp.rope_freqs)
        return bool(torch.equal(out, ref))
    """)


@lru_cache(maxsize=1)
def private_shm_refusal() -> str | None:
    """Why a private tmpfs cannot be mounted on /dev/shm here (None when it can)."""
    try:
        proc = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare is not usable here: {exc}"
    if proc.returncode != 0:
        return f"cannot mount a private tmpfs on /dev/shm (needs root or user namespaces): {proc.stderr.strip()}"
    return None


def run_with_private_shm(script: str, size_mb: int, env: dict[str, str], timeout_s: float = 540,
                         prelude: str = MODEL_PRELUDE) -> dict:
    """Run ``prelude + script`` with a fresh ``size_mb`` MiB tmpfs on /dev/shm; its RESULT."""
    body = prelude + textwrap.dedent(script)
    cmd = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size={size_mb}m tmpfs /dev/shm && exec "$0" -c "$1"',
           sys.executable, body]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **env},
                          stdin=subprocess.DEVNULL)
    results = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and results, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(results[-1])


def run_dirs(base: str | os.PathLike) -> list[str]:
    """The pack's run dirs in ``base``."""
    return sorted(n for n in os.listdir(base) if n.startswith("h3ms-"))
