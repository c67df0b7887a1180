"""The ComfyUI layer (nodes/) against the ComfyUI stand-in in tests/comfy_standin (see its README).

Tests named ``test_integration_*`` run the real split engine on CPU rank workers (rank maps through the node's
``H3MS_RANK_MAP`` hook) and check that nothing is left behind: no worker process, no shm segment, no run dir.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch.overrides import TorchFunctionMode

STANDIN = Path(__file__).resolve().parent / "comfy_standin"


@pytest.fixture(scope="module", autouse=True)
def comfy_standin():
    """Put the stand-in ``comfy`` package on the path for this module only."""
    sys.path.insert(0, str(STANDIN))
    yield
    sys.path.remove(str(STANDIN))
    for name in [m for m in sys.modules if m == "comfy" or m.startswith("comfy.") or m == "server"]:
        del sys.modules[name]


@pytest.fixture(autouse=True)
def clear_interrupt():
    import comfy.model_management as mm
    mm.interrupt_current_processing(False)
    yield
    mm.interrupt_current_processing(False)


# --- helpers -------------------------------------------------------------------------------------------------

def h3_patcher(layers: int = 3, seed: int = 0, dtype=torch.bfloat16):
    from comfy.ldm.minimax.model import MiniMaxH3Model
    from comfy.model_base import MiniMaxH3
    from comfy.model_patcher import ModelPatcher
    dm = MiniMaxH3Model(layers=layers, dtype=dtype, seed=seed)
    return ModelPatcher(MiniMaxH3(dm), torch.device("cpu"), torch.device("cpu"))


def h3_inputs(dtype=torch.bfloat16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(1, 4, 2, 4, 6, generator=g)
    audio = torch.randn(1, 8, 2, 5, generator=g)
    context = torch.randn(1, 7, 64, generator=g).to(dtype)
    return [video, audio], torch.tensor([700.0]), context


def sample(patcher, x, timestep, context):
    """One diffusion-model call the way sampling makes it: wrappers copied in, pre_run, apply_model."""
    from comfy.sampler_helpers import prepare_model_patcher
    from comfy.patcher_extension import copy_nested_dicts
    options = copy_nested_dicts(patcher.model_options)
    prepare_model_patcher(patcher, None, options)
    options["transformer_options"]["sigmas"] = timestep / 1000.0  # what ComfyUI's _calc_cond_batch puts there
    with torch.inference_mode():
        return patcher.model.apply_model(x, timestep, context, options["transformer_options"])


def split_clone(patcher, devices=("cpu", "cpu"), reserve_gb: float = 0.0):
    from nodes.model_adapter import install_split
    clone = patcher.clone()
    state = install_split(clone, list(devices), None, reserve_gb)
    return clone, state


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
    assert req["exchange"][0] == ["host", "nccl"]
    assert (req["exchange_chunks"][1]["default"], req["exchange_chunks"][1]["max"]) == (0, 32)
    assert "8" in req["exchange_chunks"][1]["tooltip"]
    reserve = req["cache_ram_reserve_gb"][1]
    assert (reserve["default"], reserve["min"], reserve["max"], reserve["step"]) == (0.0, 0.0, 512.0, 0.5)
    assert req["vram_residency"][0] == ["auto", "resident", "stream"]
    assert spec["optional"]["gpus"][0] == "H3MS_GPUS"
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
    assert H3MSReleaseResourcesAsync.OUTPUT_NODE is True and H3MSReleaseResourcesAsync.RETURN_TYPES == ()
    assert math.isnan(H3MSReleaseResourcesAsync.IS_CHANGED(release_workers=True))


def test_gpu_set_node_validates():
    from h3ms_async.plans import GPUSelectionError
    from nodes.gpu_set_node import H3MSGPUSetAsync
    (gs,) = H3MSGPUSetAsync().build("0,1,3", "", "1,1,0.7", 4.0, 3)
    assert gs.gpus == (0, 1, 3) and gs.shares == (1.0, 1.0, 0.7) and gs.max_gpus == 3
    with pytest.raises(GPUSelectionError, match="shares"):
        H3MSGPUSetAsync().build("0,1", "", "1,1,1", 0.0, 8)
    with pytest.raises(GPUSelectionError, match="not a CUDA index"):
        H3MSGPUSetAsync().build("0,x", "", "", 0.0, 8)


# --- pass-throughs ------------------------------------------------------------------------------------------------

def test_non_h3_model_passes_through_with_one_warning(caplog):
    from comfy.model_base import OtherModel
    from comfy.model_patcher import ModelPatcher
    from nodes.multistream_node import H3MultiStreamAsync
    patcher = ModelPatcher(OtherModel(torch.nn.Linear(4, 4)), torch.device("cpu"), torch.device("cpu"))
    with caplog.at_level("WARNING", logger="h3_multistream"):
        (out,) = H3MultiStreamAsync().patch(patcher, True, -1, "host", 0, True, 0.0, "auto")
    assert out is patcher and patcher.wrappers == {}
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "not MiniMax H3" in warnings[0].getMessage()


def test_model_off_cuda_runs_unsplit_without_wrapper(monkeypatch):
    from nodes.multistream_node import RANK_MAP_ENV, H3MultiStreamAsync
    monkeypatch.delenv(RANK_MAP_ENV, raising=False)
    patcher = h3_patcher()
    (out,) = H3MultiStreamAsync().patch(patcher, True, -1, "host", 0, True, 0.0, "auto")
    assert out is patcher and out.wrappers == {} and "patches_replace" not in out.model_options["transformer_options"]


def test_single_visible_gpu_runs_unsplit_without_wrapper(monkeypatch, caplog):
    """One CUDA GPU (the machine is simulated: torch's device count answers 1) gives a one-rank plan: plain ComfyUI."""
    from nodes.multistream_node import RANK_MAP_ENV, H3MultiStreamAsync
    monkeypatch.delenv(RANK_MAP_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    patcher = h3_patcher()
    patcher.load_device = torch.device("cuda", 0)
    with caplog.at_level("INFO", logger="h3_multistream"):
        (out,) = H3MultiStreamAsync().patch(patcher, True, -1, "host", 0, True, 0.0, "auto")
    assert out is patcher and out.wrappers == {}
    assert any("running unsplit (one usable GPU (cuda:0" in r.getMessage() for r in caplog.records)


def test_disabled_returns_model_untouched():
    from nodes.multistream_node import H3MultiStreamAsync
    patcher = h3_patcher()
    assert H3MultiStreamAsync().patch(patcher, False, -1, "host", 0, True, 0.0, "auto")[0] is patcher


# --- installation ----------------------------------------------------------------------------------------------

def test_install_puts_wrapper_and_patches_on_a_clone_only():
    from comfy.patcher_extension import WrappersMP
    from nodes.model_adapter import WRAPPER_KEY, PassThroughPatch, StackPatch
    patcher = h3_patcher(layers=3)

    def upstream(args, extra):
        return extra["original_block"](args)
    patcher.set_model_patch_replace(upstream, "dit", "double_block", 2)
    clone, state = split_clone(patcher)
    assert patcher.wrappers == {}
    assert patcher.model_options["transformer_options"]["patches_replace"]["dit"][("double_block", 2)] is upstream
    assert len(clone.wrappers[WrappersMP.DIFFUSION_MODEL][WRAPPER_KEY]) == 1
    dit = clone.model_options["transformer_options"]["patches_replace"]["dit"]
    assert isinstance(dit[("double_block", 0)], StackPatch)
    assert all(isinstance(dit[("double_block", i)], PassThroughPatch) for i in (1, 2))
    assert dit[("double_block", 2)].displaced is upstream  # kept, and captured at run time
    again, _ = split_clone(clone)  # a second H3 MultiStream node replaces the first, never stacks
    assert len(again.wrappers[WrappersMP.DIFFUSION_MODEL][WRAPPER_KEY]) == 1
    assert again.model_options["transformer_options"]["patches_replace"]["dit"][("double_block", 2)].displaced \
        is upstream


def test_pre_run_points_the_split_at_the_sampled_patcher():
    patcher = h3_patcher()
    clone, state = split_clone(patcher)
    assert state.patcher() is clone
    lora = clone.clone()
    lora.add_patches({"diffusion_model.blocks.0.norm1.weight": torch.ones(64)})
    lora.pre_run()
    assert state.patcher() is lora


# --- unsupported patches ------------------------------------------------------------------------------------------

def _run_with_patch(patch, key=("double_block", 1)):
    patcher = h3_patcher()
    clone, _ = split_clone(patcher)
    user = clone.clone()
    user.set_model_patch_replace(patch, "dit", *key)
    return sample(user, *h3_inputs())


@pytest.mark.parametrize("patch, why", [
    (lambda args, extra: {"img": args["img"] * 2}, "called original_block 0 times"),
    (lambda args, extra: {"img": args["img"].float().sum().item() * args["img"]}, "failed on a data-free probe"),
    (lambda args, extra: {"img": extra["original_block"](args)["img"].clone()}, "does not return"),
    (lambda args, extra: extra["original_block"](dict(args, attention=torch.nn.Identity())), "own attention"),
    (lambda args, extra: [extra["original_block"](args), extra["original_block"](args)][1], "2 times"),
    (lambda args, extra: {"img": args["img"]}, "called original_block 0 times"),
    (lambda args, extra: extra["original_block"](dict(args, t_emb=args["t_emb"] + 1)), "changes args"),
])
def test_block_replacing_patch_is_refused_naming_the_block(patch, why):
    from nodes.model_adapter import MultiStreamError
    with pytest.raises(MultiStreamError, match=r"block 1 carries a patch that replaces the block computation") as ei:
        _run_with_patch(patch)
    assert re.search(why, str(ei.value)), str(ei.value)
    assert "transformer_options" in str(ei.value)


def test_other_dit_keys_are_refused():
    from nodes.model_adapter import MultiStreamError
    with pytest.raises(MultiStreamError, match="unsupported dit patches"):
        _run_with_patch(lambda args, extra: extra["original_block"](args), key=("single_block", 0))


def test_option_only_patches_are_captured_as_data():
    from nodes.model_adapter import capture_block_options, collect_user_patches
    marker = object()

    def set_backend(args, extra):
        to = dict(args["transformer_options"])
        to["optimized_attention_override"] = marker
        to["seen_block"] = to["block_index"]
        return extra["original_block"](dict(args, transformer_options=to))

    def in_place(args, extra):
        args["transformer_options"]["h3_flag"] = True
        return extra["original_block"](args)

    patcher = h3_patcher(layers=3)
    patcher.set_model_patch_replace(set_backend, "dit", "double_block", 0)
    clone, _ = split_clone(patcher)
    clone.set_model_patch_replace(in_place, "dit", "double_block", 2)
    to = clone.model_options["transformer_options"]
    user = collect_user_patches(to, 3)
    assert user == {0: set_backend, 2: in_place}
    img = torch.zeros(10, 64, dtype=torch.bfloat16)
    args = {"img": img, "t_emb": torch.zeros(2, 32), "mod_segments": [(0, 10, 1)], "rope_freqs": torch.zeros(1),
            "layout": None, "transformer_options": {"block_index": 0, "keep": 1}}
    opts = capture_block_options(user, args, 3)
    assert opts == [{"optimized_attention_override": marker, "seen_block": 0}, {}, {"h3_flag": True}]
    assert args["transformer_options"] == {"block_index": 0, "keep": 1}  # the live options are not touched
    assert torch.equal(img, torch.zeros(10, 64, dtype=torch.bfloat16))
    assert capture_block_options({}, args, 3) is None


# --- weights through ComfyUI's patch path -------------------------------------------------------------------------

def test_block_tensors_follow_patches_without_double_applying():
    from h3ms_async.reference_dit import DiTConfig
    from nodes.model_adapter import block_tensors, read_config
    patcher = h3_patcher(layers=2)
    dm = patcher.model.diffusion_model
    cfg = read_config(dm)
    assert cfg == DiTConfig(hidden=64, layers=2, heads=4, head_dim=16, ffn=96, t_dim=32, rope_pairs=6, eps=1e-5)
    plain = block_tensors(patcher, 1, torch.bfloat16)
    assert {k: tuple(v.shape) for k, v in plain.items()} == cfg.block_shapes()
    assert torch.equal(plain["mlp.fc1.weight"], dm.blocks[1].mlp.fc1.weight)

    diff = torch.full((2 * 96, 64), 0.25)
    lora = patcher.clone()
    lora.add_patches({"diffusion_model.blocks.1.mlp.fc1.weight": diff})
    lora.add_weight_wrapper("diffusion_model.blocks.1.norm1.weight", lambda w: w * 2)
    expected = (dm.blocks[1].mlp.fc1.weight.float() + diff).to(torch.bfloat16)
    got = block_tensors(lora, 1, torch.bfloat16)
    assert torch.equal(got["mlp.fc1.weight"], expected)
    assert torch.equal(got["norm1.weight"], dm.blocks[1].norm1.weight * 2)
    lora.patch_model()  # a full load bakes the patch in; reading again must not add it twice
    try:
        assert torch.equal(block_tensors(lora, 1, torch.bfloat16)["mlp.fc1.weight"], expected)
        assert torch.equal(block_tensors(patcher, 1, torch.bfloat16)["mlp.fc1.weight"], plain["mlp.fc1.weight"])  # from backup
    finally:
        lora.unpatch_model()
    assert torch.equal(block_tensors(patcher, 1, torch.bfloat16)["mlp.fc1.weight"], plain["mlp.fc1.weight"])


def test_int8_weights_come_out_as_qdata_scale_and_convrot_tag():
    from comfy_kitchen.tensor import QuantizedTensor, TensorWiseINT8Layout
    from nodes.model_adapter import block_nbytes, block_tensors
    patcher = h3_patcher(layers=1)
    block = patcher.model.diffusion_model.blocks[0]
    q = torch.randint(-127, 128, (3 * 64, 64), dtype=torch.int8)
    scale = torch.rand(3 * 64, 1) / 100
    params = TensorWiseINT8Layout.Params(scale=scale, orig_dtype=torch.bfloat16, orig_shape=(3 * 64, 64),
                                         convrot=True, convrot_groupsize=256)
    block.attn.qkv_proj.weight = torch.nn.Parameter(QuantizedTensor(q, "TensorWiseINT8Layout", params),
                                                    requires_grad=False)
    got = block_tensors(patcher, 0, torch.bfloat16)
    assert got["attn.qkv_proj.weight"].dtype == torch.int8 and torch.equal(got["attn.qkv_proj.weight"], q)
    assert torch.equal(got["attn.qkv_proj.weight_scale"], scale)
    assert json.loads(bytes(got["attn.qkv_proj.comfy_quant"].numpy())) == {
        "format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}
    assert "attn.out_proj.comfy_quant" not in got
    assert block_nbytes(patcher.model.diffusion_model, 0) == sum(
        v.numel() * v.element_size() for k, v in got.items() if not k.endswith(("_scale", "comfy_quant")))


def test_ram_reserve_refuses_to_fill():
    from nodes.model_adapter import MultiStreamError, block_nbytes, block_reader
    patcher = h3_patcher(layers=1)
    need = block_nbytes(patcher.model.diffusion_model, 0)
    gib = 1024 ** 3
    read = block_reader(patcher, 1.0, ram=lambda: gib + need - 1)
    with pytest.raises(MultiStreamError, match="cache_ram_reserve_gb"):
        read(0)
    assert set(block_reader(patcher, 1.0, ram=lambda: gib + need)(0)) >= {"norm1.weight"}


def test_weight_key_from_loader_file_or_object(tmp_path):
    from nodes.model_adapter import weight_key
    ckpt = tmp_path / "h3.safetensors"
    ckpt.write_bytes(b"x" * 10)
    patcher = h3_patcher(layers=1)
    key, warning = weight_key(patcher)
    assert warning and "cached_patcher_init" in warning and key[0] == "dit-object"
    patcher.cached_patcher_init = (lambda *a: None, (str(ckpt), {"dtype": None}))
    key, warning = weight_key(patcher)
    st = ckpt.stat()
    assert warning is None and key[:4] == ("dit", str(ckpt.resolve()), 10, st.st_mtime_ns)
    lora = patcher.clone()
    lora.add_patches({"diffusion_model.blocks.0.norm1.weight": torch.ones(64)})
    assert weight_key(lora)[0] != key and weight_key(patcher.clone())[0] == key


# --- interrupt bridge and release -----------------------------------------------------------------------------------

def test_interrupt_bridge_reads_and_clears_comfy_flag():
    import comfy.model_management as mm
    from nodes import progress
    probe = progress.interrupt_probe()
    assert probe() is False
    mm.interrupt_current_processing(True)
    assert probe() is True
    with pytest.raises(mm.InterruptProcessingException):
        progress.raise_interrupted(RuntimeError("aborted"))
    assert probe() is False


def test_release_node_detaches_split_wrappers():
    from nodes.release_node import H3MSReleaseResourcesAsync
    patcher = h3_patcher()
    clone, state = split_clone(patcher)
    out = H3MSReleaseResourcesAsync().run(False, False, True)
    assert state.detached and "detached" in out["ui"]["text"][0] and "RAM available" in out["ui"]["text"][-1]
    assert H3MSReleaseResourcesAsync().run(False, False, False)["ui"]["text"][0] == "nothing selected"


def test_detached_split_runs_plain_comfy():
    """After detach, the patched model gives what the unpatched one gives (the user's own patches still run)."""
    from nodes.model_adapter import detach_all
    calls = []

    def counting(args, extra):
        calls.append(args["transformer_options"]["block_index"])
        return extra["original_block"](args)
    patcher = h3_patcher()
    patcher.set_model_patch_replace(counting, "dit", "double_block", 1)
    inputs = h3_inputs()
    reference = sample(patcher, *inputs)
    clone, state = split_clone(patcher)
    assert detach_all() >= 1 and state.detached
    out = sample(clone, *inputs)
    assert calls == [1, 1]
    assert all(torch.equal(a, b) for a, b in zip(reference, out))


# --- integration: the real split engine on CPU rank workers ----------------------------------------------------------

def _leftovers() -> list[str]:
    """Worker processes, shm segments and run dirs this process still owns."""
    kids = [k for k in psutil.Process().children(recursive=True)
            if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]
    mine = f"h3ms-{os.getpid()}-"
    segments = [n for n in os.listdir("/dev/shm") if n.startswith(mine)]
    run_dirs = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(mine)]
    return [f"pid {k.pid}" for k in kids] + segments + run_dirs


@pytest.fixture
def split(monkeypatch):
    """The split engine module; every engine is released afterwards and nothing may be left behind."""
    from h3ms_async import split as split_module
    monkeypatch.delenv("H3MS_RANK_MAP", raising=False)
    yield split_module
    split_module.release_all_engines()
    deadline = time.monotonic() + 5.0
    while (left := _leftovers()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"left behind: {left}"


def _reference_patcher(weights: str, layers: int = 3):
    """A stand-in H3 model carrying ReferenceDiT block weights (int8 linears as QuantizedTensor, like ComfyUI)."""
    from comfy_kitchen.tensor import QuantizedTensor, TensorWiseINT8Layout
    from h3ms_async.reference_dit import ReferenceDiT
    from nodes.model_adapter import read_config
    patcher = h3_patcher(layers=layers)
    dm = patcher.model.diffusion_model
    ref = ReferenceDiT(read_config(dm), weights, seed=5)
    for i, block in enumerate(dm.blocks):
        w = ref.block_weights(i)
        for name, tensor in w.items():
            if name.endswith("_scale"):
                continue
            owner, attr = name.rsplit(".", 1)
            module = block.get_submodule(owner)
            if tensor.dtype == torch.int8:
                params = TensorWiseINT8Layout.Params(scale=w[name + "_scale"], orig_dtype=torch.bfloat16,
                                                     orig_shape=tuple(tensor.shape))
                tensor = QuantizedTensor(tensor, "TensorWiseINT8Layout", params)
            setattr(module, attr, torch.nn.Parameter(tensor, requires_grad=False))
    return patcher


def _patch_node(patcher, ranks: str, monkeypatch, gpus=None):
    from nodes.multistream_node import RANK_MAP_ENV, H3MultiStreamAsync
    monkeypatch.setenv(RANK_MAP_ENV, ranks)
    (patched,) = H3MultiStreamAsync().patch(patcher, True, -1, "host", 0, True, 0.0, "auto", gpus)
    assert patched is not patcher
    return patched


def _same(a, b) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("weights", ["bf16", "int8"])
@pytest.mark.parametrize("ranks", ["cpu", "cpu,cpu", "cpu,cpu,cpu"])
def test_integration_split_equals_unpatched_reference_bit_for_bit(split, weights, ranks, monkeypatch):
    from h3ms_async.status import get_hub
    patcher = _reference_patcher(weights)
    inputs = h3_inputs()
    reference = sample(patcher, *inputs)
    patched = _patch_node(patcher, ranks, monkeypatch)
    out = sample(patched, *inputs)
    again = sample(patched, *inputs)  # second step: store already filled, same answer
    assert _same(reference, out) and _same(reference, again)
    rec = get_hub().recent_steps(1)[-1]
    assert rec["devices"] == ranks.split(",") and rec["blocks"] == 3 and rec["sigma"] == pytest.approx(0.7)


def test_integration_gpu_set_shares_reach_the_engine(split, monkeypatch):
    from h3ms_async.plans import GPUSelectionError, GPUSet
    from h3ms_async.status import get_hub
    patcher = _reference_patcher("int8")
    inputs = h3_inputs()
    reference = sample(patcher, *inputs)
    patched = _patch_node(patcher, "cpu,cpu", monkeypatch, gpus=GPUSet.parse("0,1", "", "1,0.5"))
    assert _same(reference, sample(patched, *inputs))
    (engine,) = split.engines()
    assert engine.options.shares == (1.0, 0.5)
    tokens = [b - a for a, b in (r["tokens"] for r in get_hub().recent_steps(1)[-1]["ranks"])]
    assert tokens[0] == 2 * tokens[1] or abs(tokens[0] - 2 * tokens[1]) <= 2, tokens
    with pytest.raises(GPUSelectionError, match="shares: 3 value"):
        _patch_node(patcher, "cpu,cpu", monkeypatch, gpus=GPUSet.parse("0,1,2", "", "1,1,0.5"))


def test_integration_lora_patched_weights_are_exact(split, monkeypatch):
    """A LoRA-style weight patch reaches the workers through ComfyUI's patch path, the same value ComfyUI uses."""
    patcher = _reference_patcher("bf16")
    lora = patcher.clone()
    lora.add_patches({"diffusion_model.blocks.1.mlp.fc1.weight": torch.full((2 * 96, 64), 0.03),
                      "diffusion_model.blocks.2.attn.out_proj.weight": torch.full((64, 64), -0.02)})
    inputs = h3_inputs()
    lora.patch_model()  # plain ComfyUI computes with the patched live weights
    try:
        reference = sample(lora, *inputs)
    finally:
        lora.unpatch_model()
    assert not _same(reference, sample(patcher, *inputs))  # the patch changes the result
    assert _same(reference, sample(_patch_node(lora, "cpu,cpu", monkeypatch), *inputs))


class _DeviceWatch(TorchFunctionMode):
    """Records every device a torch call in this process names (``device=``, ``Tensor.to``/``cuda``).

    ``redirect``: run a call that names a CUDA device on the CPU instead (there is no GPU here), so that a path
    which is allowed a transient GPU tensor can still run to the end and be counted.
    """

    def __init__(self, redirect: bool = False):
        super().__init__()
        self.redirect = redirect
        self.cuda_calls: list[str] = []

    @staticmethod
    def _is_cuda(v) -> bool:
        return isinstance(v, (str, torch.device)) and torch.device(v).type == "cuda" or (
            isinstance(v, int) and not isinstance(v, bool))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", str(func))
        if name == "cuda":
            self.cuda_calls.append(name)
            raise AssertionError("Tensor.cuda() called in the ComfyUI process")
        if self._is_cuda(kwargs.get("device")):
            self.cuda_calls.append(f"{name}(device={kwargs['device']})")
            kwargs["device"] = "cpu"
        if name == "to":
            found = [a for a in args[1:] if self._is_cuda(a)]
            if found:
                self.cuda_calls.append(f"to({found[0]})")
                args = tuple("cpu" if self._is_cuda(a) else a for a in args)
        if self.cuda_calls and not self.redirect:
            raise AssertionError(f"the ComfyUI process named a CUDA device: {self.cuda_calls}")
        return func(*args, **kwargs)


def test_integration_fill_and_steps_never_put_block_weights_on_a_gpu(split, monkeypatch):
    """The model GPU holds no second copy of the blocks: the ComfyUI process reads them from the ModelPatcher into
    the host's shm store, ships steps through shm, and never names a CUDA device; only a patched weight is
    computed on the model's device (as ComfyUI computes it), one tensor at a time, straight back to the host."""
    patcher = _reference_patcher("int8")
    inputs = h3_inputs()
    reference = sample(patcher, *inputs)
    patcher.load_device = torch.device("cuda", 0)  # what ComfyUI gives an H3 model; nothing may move there
    patched = _patch_node(patcher, "cpu,cpu", monkeypatch)
    with _DeviceWatch():
        out = sample(patched, *inputs)
    assert _same(reference, out)
    (engine,) = split.engines()
    store = engine.snapshot()["weight_store"]
    assert store["state"] == "warm" and store["segment"].startswith(f"h3ms-{os.getpid()}-")

    lora = patched.clone()
    keys = ["diffusion_model.blocks.0.norm1.weight", "diffusion_model.blocks.2.attn.q_norm.weight"]
    lora.add_patches({k: torch.full_like(patcher.model.state_dict()[k], 0.01, dtype=torch.float32)
                      for k in keys})
    watch = _DeviceWatch(redirect=True)
    with watch:
        sample(lora, *inputs)
    assert watch.cuda_calls == ["to(cuda:0)"] * len(keys), watch.cuda_calls  # one transient per patched weight
    assert all(t.device.type == "cpu" for i in range(3) for t in engine._loaded.store.block(i).values())


@pytest.mark.parametrize("value, why", [(lambda *a: None, "to a callable"), ("sage", "no meaning on the rank")])
def test_integration_block_option_the_workers_cannot_run_is_refused_first(split, value, why, monkeypatch):
    from nodes.model_adapter import MultiStreamError

    def set_option(args, extra):
        to = dict(args["transformer_options"], optimized_attention_override=value)
        return extra["original_block"](dict(args, transformer_options=to))
    patcher = _reference_patcher("bf16")
    patcher.set_model_patch_replace(set_option, "dit", "double_block", 1)
    patched = _patch_node(patcher, "cpu,cpu", monkeypatch)
    with pytest.raises(MultiStreamError, match=r"block 1: .*optimized_attention_override") as ei:
        sample(patched, *h3_inputs())
    msg = str(ei.value)
    assert why in msg and "Remove" in msg and "disable H3 MultiStream" in msg  # the cause and what to do
    assert split.engines() == []  # refused before a weight store or a worker existed


def _long_inputs():
    """4608 video tokens: a 12-block step takes over a second on two CPU ranks, so a cancel lands mid-step."""
    g = torch.Generator().manual_seed(3)
    return ([torch.randn(1, 4, 8, 48, 48, generator=g), torch.randn(1, 8, 2, 5, generator=g)],
            torch.tensor([700.0]), torch.randn(1, 7, 64, generator=g).to(torch.bfloat16))


def test_integration_cancel_aborts_every_rank_within_two_seconds(split, monkeypatch):
    import comfy.model_management as mm
    patcher = _reference_patcher("bf16", layers=12)
    patched = _patch_node(patcher, "cpu,cpu", monkeypatch)
    inputs = h3_inputs()
    sample(patched, *inputs)  # workers up and weights loaded
    (engine,) = split.engines()
    fired: list[float] = []

    def cancel_mid_step() -> None:
        deadline = time.monotonic() + 30.0
        while not engine.running and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.3)
        fired.append(time.monotonic())
        mm.interrupt_current_processing(True)

    canceller = threading.Thread(target=cancel_mid_step)
    canceller.start()
    with pytest.raises(mm.InterruptProcessingException) as ei:
        sample(patched, *_long_inputs())
    took = time.monotonic() - fired[0]
    canceller.join(5.0)
    assert isinstance(ei.value.__cause__, split.SplitInterrupted)  # aborted inside the step, not after it
    assert took < 2.0, f"cancel took {took:.2f}s"
    assert not mm.processing_interrupted()
    # every rank has stopped working on the step by then, and none was killed for it
    while (states := [w["state"] for w in engine.pool.snapshot()]) != ["ready", "ready"]:
        assert time.monotonic() < fired[0] + 2.0, f"ranks still {states} 2 s after the cancel"
        time.sleep(0.01)

    steps = engine.snapshot()["steps"]
    mm.interrupt_current_processing(True)  # cancelled between steps: nothing is sent to the ranks
    with pytest.raises(mm.InterruptProcessingException) as ei:
        sample(patched, *inputs)
    assert ei.value.__cause__ is None and engine.snapshot()["steps"] == steps
    assert _same(sample(patcher, *inputs), sample(patched, *inputs))


def test_integration_release_node_clears_store_keeps_workers_then_releases(split, monkeypatch):
    from nodes.release_node import H3MSReleaseResourcesAsync
    patcher = _reference_patcher("bf16")
    patched = _patch_node(patcher, "cpu,cpu", monkeypatch)
    inputs = h3_inputs()
    reference = sample(patcher, *inputs)
    sample(patched, *inputs)
    (engine,) = split.engines()
    pids = [w["pid"] for w in engine.pool.snapshot()]
    text = H3MSReleaseResourcesAsync().run(False, True, False)["ui"]["text"]
    assert "weight store cleared" in text[0] and engine.weight_state == "empty"
    assert [w["pid"] for w in engine.pool.snapshot()] == pids  # workers kept
    assert _same(reference, sample(patched, *inputs))  # refilled on the next step, same workers
    assert [w["pid"] for w in engine.pool.snapshot()] == pids
    text = H3MSReleaseResourcesAsync().run(True, False, False)["ui"]["text"]
    assert "released (1 engine" in text[0] and split.engines() == []
    assert _same(reference, sample(patched, *inputs))  # a new engine starts on demand


def test_integration_step_too_short_to_split_exactly_runs_unsplit(split, monkeypatch, caplog):
    """A sequence that would leave a rank fewer than 4 tokens is refused by the engine (SplitUnsafe, a real check,
    not a stub) and the node runs that step in ComfyUI, unsplit: same bits as the unpatched model."""
    from h3ms_async.status import get_hub
    patcher = _reference_patcher("int8")
    g = torch.Generator().manual_seed(3)
    tiny = ([torch.randn(1, 4, 1, 2, 2, generator=g), torch.randn(1, 8, 2, 1, generator=g)], torch.tensor([700.0]),
            torch.randn(1, 5, 64, generator=g).to(torch.bfloat16))
    reference = sample(patcher, *tiny)
    patched = _patch_node(patcher, "cpu,cpu,cpu", monkeypatch)
    before = get_hub().next_seq()
    with caplog.at_level("WARNING", logger="h3_multistream"):
        out = sample(patched, *tiny)
    assert _same(reference, out)
    assert "running this step unsplit" in caplog.text and "fewer than 4" in caplog.text
    assert get_hub().next_seq() == before  # no split step was recorded
    # a normal-sized step on the same patched model still splits
    inputs = h3_inputs()
    assert _same(sample(patcher, *inputs), sample(patched, *inputs))
    assert get_hub().next_seq() == before + 1
