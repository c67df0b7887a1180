"""The ComfyUI layer (nodes/).

Node definitions are checked here as plain data. Everything that needs ComfyUI's objects runs inside the real
ComfyUI tree (``tests/comfy_tree.py``): :func:`test_node_layer_inside_real_comfyui` starts one ComfyUI process and runs
``tests/comfy_node_checks.py`` with pytest inside it (real ``ModelPatcher``, ``MiniMaxH3Model``, ``common_ksampler``,
``PromptServer``, the split on CPU rank workers).
"""
from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import comfy_tree  # noqa: E402


# --- node definitions -------------------------------------------------------------------------------------------

def _check_node_class(cls):
    spec = cls.INPUT_TYPES()
    assert set(spec) <= {"required", "optional", "hidden"} and "required" in spec
    for section in spec.values():
        for name, entry in section.items():
            assert isinstance(name, str) and isinstance(entry, tuple) and 1 <= len(entry) <= 2
            kind = entry[0]
            assert isinstance(kind, (str, list))
            opts = entry[1] if len(entry) == 2 else {}
            if kind in ("INT", "FLOAT"):
                assert opts["min"] <= opts["default"] <= opts["max"], name
            if isinstance(kind, list):
                assert opts.get("default", kind[0]) in kind, name
            if name != "model":
                assert opts.get("tooltip"), f"{cls.__name__}.{name} has no tooltip"
    assert isinstance(cls.RETURN_TYPES, tuple)
    assert callable(getattr(cls(), cls.FUNCTION))
    assert cls.CATEGORY == "advanced/model"
    assert cls.DESCRIPTION
    return spec


def test_multistream_node_inputs():
    from nodes.multistream_node import H3MultiStreamAsync as N
    spec = _check_node_class(N)
    req = spec["required"]
    assert list(req) == ["model", "enabled", "second_gpu", "exchange", "exchange_chunks", "weight_cache",
                         "cache_ram_reserve_gb", "vram_residency"]
    assert req["enabled"] == ("BOOLEAN", req["enabled"][1]) and req["enabled"][1]["default"] is True
    assert (req["second_gpu"][1]["default"], req["second_gpu"][1]["min"], req["second_gpu"][1]["max"]) == (-1, -1, 15)
    assert req["exchange"][0] == ["host", "nccl", "cuda_ipc", "auto"] and req["exchange"][1]["default"] == "auto"
    assert (req["exchange_chunks"][1]["default"], req["exchange_chunks"][1]["max"]) == (8, 32)
    assert "8" in req["exchange_chunks"][1]["tooltip"]
    reserve = req["cache_ram_reserve_gb"][1]
    assert (reserve["default"], reserve["min"], reserve["max"], reserve["step"]) == (0.0, 0.0, 512.0, 0.5)
    assert req["vram_residency"][0] == ["auto", "resident", "stream"]
    assert spec["optional"]["gpus"][0] == "H3MS_GPUS"
    assert spec["optional"]["sparse_attention"][0] == "H3MS_SPARSE_ATTENTION"
    overlaps = spec["optional"]["overlaps"]
    assert overlaps[0] == ["auto", "off", "head pieces", "gather", "both", "gather ahead", "all"]
    assert overlaps[1]["default"] == "auto"
    assert N.RETURN_TYPES == ("MODEL",)
    assert "dynamic_vram" in N.DESCRIPTION and "vram_block_cache" in N.DESCRIPTION


def test_gpu_set_and_release_node_inputs():
    from nodes.gpu_set_node import H3MSGPUSetAsync
    from nodes.release_node import H3MSReleaseResourcesAsync
    spec = _check_node_class(H3MSGPUSetAsync)
    assert list(spec["required"]) == ["gpus", "exclude", "shares", "min_free_vram_gb", "max_gpus"]
    assert H3MSGPUSetAsync.RETURN_TYPES == ("H3MS_GPUS",)
    spec = _check_node_class(H3MSReleaseResourcesAsync)
    assert list(spec["required"]) == ["release_workers", "clear_weight_store", "detach_hooks"]
    assert list(spec["optional"]) == ["release_vae_workers", "clear_text_cache"]
    assert H3MSReleaseResourcesAsync.OUTPUT_NODE is True and H3MSReleaseResourcesAsync.RETURN_TYPES == ()
    assert math.isnan(H3MSReleaseResourcesAsync.IS_CHANGED(release_workers=True))


def test_gpu_set_node_validates():
    from h3ms_async.runtime.plans import GPUSelectionError
    from nodes.gpu_set_node import H3MSGPUSetAsync
    (gs,) = H3MSGPUSetAsync().build("0,1,3", "", "1,1,0.7", 4.0, 3)
    assert gs.gpus == (0, 1, 3) and gs.shares == (1.0, 1.0, 0.7) and gs.max_gpus == 3
    with pytest.raises(GPUSelectionError, match="shares"):
        H3MSGPUSetAsync().build("0,1", "", "1,1,1", 0.0, 8)
    with pytest.raises(GPUSelectionError, match="not a CUDA index"):
        H3MSGPUSetAsync().build("0,x", "", "", 0.0, 8)


def test_sparse_attention_node_inputs_and_validation():
    from h3ms_async.dit.sparse import SparseSettings
    from nodes.sparse_attention_node import H3MSSparseAttentionAsync as S
    spec = _check_node_class(S)
    assert list(spec["required"]) == ["method", "tau", "keep_percent", "start_percent", "end_percent"]
    assert list(spec["optional"]) == ["dense_blocks", "min_tokens", "extra_tokens", "sink_conditioning"]
    assert spec["required"]["method"][0] == ["sol-attn", "top-k"]
    assert S.RETURN_TYPES == ("H3MS_SPARSE_ATTENTION",) and "Model Sparse Attention" in S.DESCRIPTION
    # the optional inputs' defaults are the build defaults (an old workflow without them behaves the same)
    defaults = {k: v[1]["default"] for k, v in spec["optional"].items()}
    (built,) = S().build("sol-attn", 1.3, 10.0, 0.2, 1.0)
    assert built == S().build("sol-attn", 1.3, 10.0, 0.2, 1.0, **defaults)[0] == SparseSettings()
    (topk,) = S().build("top-k", 1.3, 12.5, 0.1, 0.9, dense_blocks="0, 1, 47-49", min_tokens=0, extra_tokens=0,
                        sink_conditioning="exact_kv")
    assert topk.resolve(None, 50).topk_ratio == 0.125 and topk.resolve(None, 50).dense_blocks == (0, 1, 47, 48, 49)
    with pytest.raises(ValueError, match="dense_blocks: 'x' is not a block index"):
        S().build("sol-attn", 1.3, 10.0, 0.2, 1.0, dense_blocks="1, x")
    with pytest.raises(ValueError, match="end_percent=0.1 is before start_percent=0.2"):
        S().build("sol-attn", 1.3, 10.0, 0.2, 0.1)


# --- everything that needs ComfyUI: one real ComfyUI process -----------------------------------------------------

_RUNNER = r'''
import os, sys
sys.path.insert(0, {tests!r})
import comfy_h3, pytest
comfy_h3.start()
# pytest imports every package above a test file, and the pack root is one (its __init__ would run, and register
# routes, a second time): a link from a plain temp folder keeps the collection tree outside the pack
run_dir = {run_dir!r}
checks = os.path.join(run_dir, "comfy_node_checks.py")
os.symlink({checks!r}, checks)
os.chdir(run_dir)
rc = pytest.main(["-q", "-p", "no:cacheprovider", "--noconftest", "-c", "/dev/null", "--rootdir", run_dir,
                  "--timeout=240", "-W", "ignore::DeprecationWarning", "--durations=12", checks] + {select!r})
print("INNER_PYTEST_RC", int(rc), flush=True)
'''


@pytest.mark.timeout(900)
@pytest.mark.skipif(comfy_tree.skip_reason() is not None, reason=str(comfy_tree.skip_reason()))
def test_node_layer_inside_real_comfyui():
    """``tests/comfy_node_checks.py`` inside ComfyUI started with ``--cpu`` (its default CPU attention); set
    ``H3MS_NODE_CHECKS=-k <expr>`` to run a subset while working on it."""
    tests = os.path.dirname(os.path.abspath(__file__))
    select = os.environ.get("H3MS_NODE_CHECKS", "").split()
    # made and removed here, so it goes even when the ComfyUI process is killed (a timeout)
    run_dir = tempfile.mkdtemp(prefix="h3ms-checks-")
    try:
        body = _RUNNER.format(tests=tests, checks=os.path.join(tests, "comfy_node_checks.py"), select=select,
                              run_dir=run_dir)
        r = comfy_tree.run_comfy_script(body, ["--cpu", "--disable-api-nodes"], timeout_s=880)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    summary = [line for line in r.stdout.splitlines() if line.startswith("INNER_PYTEST_RC")]
    assert summary == ["INNER_PYTEST_RC 0"], f"checks inside ComfyUI failed:\n{r.stdout[-12000:]}\n{r.stderr[-4000:]}"
    print(r.stdout[-600:])
