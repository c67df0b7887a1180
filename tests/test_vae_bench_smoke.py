"""The VAE-split and cache benchmarks at minimal sizes on CPU: their JSON and their exactness checks (the GPU runs
use the same code at full size: docs/performance.md)."""
from __future__ import annotations

import json

import pytest

import comfy_tree
from split_proof import vae_decodes_failure
from h3ms_async.tools.bench.caches import main as bench_caches_main
from h3ms_async.tools.bench.vae import main as bench_vae_main


@pytest.mark.skipif(comfy_tree.skip_reason() is not None, reason=comfy_tree.skip_reason() or "")
def test_bench_vae_tiny_on_cpu_ranks(tmp_path, capsys) -> None:
    root = comfy_tree.ensure_tree()
    shims = [arg for d in comfy_tree.shim_dirs() for arg in ("--extra-path", d)]
    rc = bench_vae_main(["--comfy-root", str(root), *shims,
                         "--comfy-args", "--cpu --disable-api-nodes", "--device", "cpu", "--dtype", "fp32",
                         "--ranks", "2", "--T", "12", "--height", "2", "--width", "3", "--layers", "1", "--heads", "2",
                         "--out", str(tmp_path)])
    rep = json.loads((tmp_path / "bench_vae_fp32.json").read_text())
    assert rc == 0 and rep["output"] == [1, 3, 39, 32, 48]
    [run] = rep["runs"]
    assert run["equal"] and run["equal_first"] and run["ranks"] == 2
    # both compared decodes split: each has its own record, both ranks decoding (tests/split_proof.py)
    assert vae_decodes_failure([run["first_record"], run["record"]], ["cpu", "cpu"]) is None, run
    rec = run["record"]
    assert rec["chunks_per_rank"] == [1, 1] and rec["moved_bytes"] > 0 and rec["transport"] == "shm"
    assert {"local_decode_s", "wait_s", "assemble_s", "per_chunk"} <= set(rec)
    assert [c["rank"] for c in rec["per_chunk"]] == [0, 1] and rec["per_chunk"][1]["bytes"] == 3 * 28 * 32 * 48 * 4


def test_bench_vae_refuses_a_missing_comfy_root(tmp_path) -> None:
    with pytest.raises(SystemExit):
        bench_vae_main(["--comfy-root", str(tmp_path)])


def test_bench_caches_tiny(tmp_path) -> None:
    bench_caches_main(["--device", "cpu", "--te-layers", "1", "--te-hidden", "128", "--tokens", "64",
                       "--repeats", "2", "--weights-gb", "0.07", "--dtype", "fp32", "--out", str(tmp_path)])
    rep = json.loads((tmp_path / "bench_caches.json").read_text())
    out = rep["outputs"]
    assert out["hit_equals_miss"] and out["stats"]["hits"] == 2
    assert out["hit_s"] < out["miss_s"] and out["hit_key_s"] > 0
    assert out["hit_fraction_of_miss"] == pytest.approx(out["hit_s"] / out["miss_s"], rel=0.02, abs=2e-6)
    assert out["output_bytes"] == (64 * 128 + 128) * 4  # the hidden states and the pooled output, fp32
    assert rep["weights"]["restore_exact"] and rep["weights"]["bytes"] == 64 * 2**20
