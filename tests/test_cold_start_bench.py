"""``benchmarks/comfy_cold_start.py`` at a tiny size on CPU ranks inside real ComfyUI: plain ComfyUI's and the node's
cold cost from the same checkpoint file, the node's load phases (the workers start while the store fills), a second
prompt that refills nothing, and another rank map that loads the store already filled (the GPU run uses the same
script at full size: docs/performance.md)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import comfy_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(comfy_tree.skip_reason() is not None, reason=comfy_tree.skip_reason() or "")
def test_cold_start_tiny_on_cpu_ranks(tmp_path) -> None:
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "comfy_cold_start.py"), "--dims", "tiny",
                        "--layers", "3", "--ranks", "cpu,cpu", "--width", "64", "--height", "64", "--tokens", "1",
                        "--timeout", "240", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((tmp_path / "comfy_cold_start.json").read_text())
    assert rep["patcher"] == "ModelPatcher" and rep["devices"] == ["cpu", "cpu"] and rep["layers"] == 3
    assert rep["checkpoint_bytes"] > 0 and rep["copies"]["host_memcpy_gbps"] > 0
    assert rep["disk_read_gbps"] > 0 and rep["disk_read_whole_gbps"] > 0
    for side in ("plain", "node_first_prompt"):  # at this size plain ComfyUI's cold cost is noise around 0
        load, (stack, steady) = rep[side]["load_s"], rep[side]["block_stack_s"]
        assert rep[side]["cold_s"] == pytest.approx(load + stack - steady, abs=2e-4), side
    first = rep["node_first_prompt"]
    assert first["cold_s"] > 0  # the node's load (a worker start at least) is never noise
    w = first["weights"]
    # the workers started beside the fill, so after it the wait is at most the start itself
    assert w["fill_bytes"] > 0 and w["workers_start_s"] > 0 and w["start_wait_s"] <= w["workers_start_s"]
    assert w["wall_s"] >= w["fill_s"] + w["ranks_load_s"]
    assert first["probe_ms"] > 0
    assert 0 < first["rows_s"] < w["fill_s"]  # the adaLN rows are computed inside the fill, block by block
    # no patches: no weight is read through ComfyUI's cast
    assert first["cast_calls"] == 0 and first["cast_s"] == first["cast_pin_s"] == first["cast_read_s"] == 0
    # the load probed the first step's plan (at this size the fill ends before the workers are up, so not beside it)
    probe = w["probe"]
    assert probe["probed"] and 0 < probe["start_s"] < probe["end_s"] <= w["wall_s"]
    assert probe["overlapped"] == (probe["start_s"] < w["fill_end_s"])
    assert 0 < w["ranks_first_block_s"] <= w["ranks_last_block_s"] <= w["wall_s"]
    assert rep["split_proof"] == [None, None, None]  # every model call of every prompt split on every rank
    assert rep["node_second_prompt"]["refilled"] is False and rep["bit_exact"] is True
    # one rank more: new workers on the store already filled, the samples still plain ComfyUI's
    more = rep["node_other_rank_map"]
    assert more["devices"] == ["cpu"] * 3 and more["same_store"] and more["fill_bytes"] == 0, more
    assert more["kept_bytes"] == w["fill_bytes"] and more["workers_start_s"] > 0 and more["bit_exact"] is True
    plain_cold = rep["plain"]["cold_s"]  # noise around 0 here, so at times not above it: no ratio then
    expected = pytest.approx(first["cold_s"] / plain_cold, rel=0.01) if plain_cold > 0 else None
    assert rep["node_cold_over_comfy_cold"] == expected
    assert not (comfy_tree.COMFY_ROOT / "models" / "diffusion_models" / "h3ms_cold_start.safetensors").exists()


@pytest.mark.skipif(comfy_tree.skip_reason() is not None, reason=comfy_tree.skip_reason() or "")
def test_a_failed_cold_start_run_leaves_no_checkpoint_behind(tmp_path) -> None:
    """The checkpoint (tens of GB at full size) goes when the run fails after writing it, here at the node's rank map:
    on the GPU machine a failed run's file once filled the disk for the next one."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "comfy_cold_start.py"), "--dims", "tiny",
                        "--layers", "3", "--ranks", "cpu,nope", "--width", "64", "--height", "64", "--tokens", "1",
                        "--timeout", "240", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    log = (tmp_path / "comfy_cold_start_comfyui.log").read_text()
    assert r.returncode == 1 and "H3MS_RANK_MAP='cpu,nope'" in log
    assert "checkpoint_write_s" not in r.stdout
    written = re.findall(r"^checkpoint written: (.+)$", log, re.M)
    assert len(written) == 1 and written[0].endswith("h3ms_cold_start.safetensors"), log[-2000:]
    assert not os.path.exists(written[0])
