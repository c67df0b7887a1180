"""The ComfyUI layer (``nodes/``) checked inside ONE real ComfyUI process (``tests/comfy_tree.py``).

Not collected by the outer suite (no ``test_`` prefix): ``tests/test_nodes.py`` starts ComfyUI (``--cpu``, its default
sub-quadratic attention), creates a real ``server.PromptServer``, loads the pack with ComfyUI's own custom-node loader
(``comfy_h3.start``) and runs this module with pytest in that process, so dozens of checks share one ~12 s start.
Models are ComfyUI's own ``MiniMaxH3Model`` built from tiny H3 state dicts (``tests/comfy_h3.py``), sampled with
``nodes.common_ksampler``. Engine-level checks (interrupt timing, shares, leftovers) run the real split on CPU rank
workers (``H3MS_RANK_MAP``); nothing may be left behind: no worker process, shm segment or run dir.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import tempfile
import threading
import time

import comfy_h3
import psutil
import pytest
import torch
from split_proof import SplitProof
from torch.overrides import TorchFunctionMode

H, FFN = comfy_h3.HIDDEN, comfy_h3.FFN
MW = comfy_h3.pack_module("nodes.model_wrapper")
BP = comfy_h3.pack_module("nodes.block_patches")
CW = comfy_h3.pack_module("nodes.comfy_weights")
DETECT = comfy_h3.pack_module("nodes.h3_detect")
MultiStreamError = comfy_h3.pack_module("nodes.errors").MultiStreamError
NODE = comfy_h3.pack_module("nodes.multistream_node")
RELEASE = comfy_h3.pack_module("nodes.release_node")
ROUTES = comfy_h3.pack_module("nodes.routes")
PROGRESS = comfy_h3.pack_module("nodes.progress")


@pytest.fixture(autouse=True)
def clear_interrupt():
    import comfy.model_management as mm
    mm.interrupt_current_processing(False)
    yield
    mm.interrupt_current_processing(False)


def sample(model, **kw):
    """One KSampler run (1 step unless given) through ``nodes.common_ksampler``; the sampled streams."""
    return comfy_h3.ksample(model, steps=kw.pop("steps", 1), **kw)


def split_sample(model, devices=("cpu", "cpu"), unsplit: bool = False, **kw):
    """:func:`sample` of a split model under the split's proof (``tests/split_proof.py``): every model call ran split
    on ``devices`` (``unsplit``: the case expects ComfyUI's own path, and no call split)."""
    with SplitProof(list(devices), unsplit=unsplit):
        return sample(model, **kw)


def same(a, b) -> bool:
    return comfy_h3.same(a, b)[0]


def split_clone(patcher, devices=("cpu", "cpu"), reserve_gb: float = 0.0):
    clone = patcher.clone()
    return clone, MW.install_split(clone, list(devices), None, reserve_gb)


# --- pass-throughs ------------------------------------------------------------------------------------------------

def test_non_h3_model_passes_through_with_one_warning(caplog):
    import comfy.model_patcher
    other = torch.nn.Module()
    other.diffusion_model = torch.nn.Linear(4, 4)
    patcher = comfy.model_patcher.ModelPatcher(other, torch.device("cpu"), torch.device("cpu"))
    with caplog.at_level("WARNING", logger="h3_multistream"):
        (out,) = NODE.H3MultiStreamAsync().patch(patcher, True, -1, "host", 0, True, 0.0, "auto")
    assert out is patcher and not patcher.wrappers
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and r.name == "h3_multistream"]
    assert len(warnings) == 1 and "not MiniMax H3" in warnings[0].getMessage()


def test_model_off_cuda_runs_unsplit_without_wrapper(monkeypatch):
    monkeypatch.delenv(NODE.RANK_MAP_ENV, raising=False)
    patcher = comfy_h3.model(layers=2)
    (out,) = NODE.H3MultiStreamAsync().patch(patcher, True, -1, "host", 0, True, 0.0, "auto")
    assert out is patcher and not out.wrappers
    assert "patches_replace" not in out.model_options.get("transformer_options", {})
    assert NODE.H3MultiStreamAsync().patch(patcher, False, -1, "host", 0, True, 0.0, "auto")[0] is patcher


def test_single_visible_gpu_runs_unsplit_without_wrapper(monkeypatch, caplog):
    """One CUDA GPU (torch's device count answers 1) gives a one-rank plan: plain ComfyUI."""
    monkeypatch.delenv(NODE.RANK_MAP_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    patcher = comfy_h3.model(layers=2).clone()
    patcher.load_device = torch.device("cuda", 0)
    with caplog.at_level("INFO", logger="h3_multistream"):
        (out,) = NODE.H3MultiStreamAsync().patch(patcher, True, -1, "host", 0, True, 0.0, "auto")
    assert out is patcher and not out.wrappers
    assert any("running unsplit (one usable GPU (cuda:0" in r.getMessage() for r in caplog.records)


# --- installation ----------------------------------------------------------------------------------------------

def test_install_puts_wrapper_and_patches_on_a_clone_only():
    from comfy.patcher_extension import WrappersMP
    patcher = comfy_h3.model(layers=3)

    def upstream(args, extra):
        return extra["original_block"](args)
    patcher.set_model_patch_replace(upstream, "dit", "double_block", 2)
    clone, state = split_clone(patcher)
    assert not patcher.wrappers
    assert patcher.model_options["transformer_options"]["patches_replace"]["dit"][("double_block", 2)] is upstream
    assert len(clone.wrappers[WrappersMP.DIFFUSION_MODEL][MW.WRAPPER_KEY]) == 1
    dit = clone.model_options["transformer_options"]["patches_replace"]["dit"]
    assert isinstance(dit[("double_block", 0)], BP.StackPatch)
    assert all(isinstance(dit[("double_block", i)], BP.PassThroughPatch) for i in (1, 2))
    assert dit[("double_block", 2)].displaced is upstream  # kept, and captured at run time
    again, _ = split_clone(clone)  # a second H3 MultiStream node replaces the first, never stacks
    assert len(again.wrappers[WrappersMP.DIFFUSION_MODEL][MW.WRAPPER_KEY]) == 1
    assert again.model_options["transformer_options"]["patches_replace"]["dit"][("double_block", 2)].displaced \
        is upstream
    # ComfyUI's pre_run (every sampling) points the split at the patcher actually sampled, e.g. a LoRA clone
    assert state.patcher() is clone
    lora = clone.clone()
    lora.add_patches({"diffusion_model.blocks.0.norm1.weight": torch.ones(H)})
    lora.pre_run()
    assert state.patcher() is lora


# --- unsupported patches ------------------------------------------------------------------------------------------

def _run_with_patch(patch, key=("double_block", 1)):
    clone, _ = split_clone(comfy_h3.model(layers=3))
    user = clone.clone()
    user.set_model_patch_replace(patch, "dit", *key)
    return sample(user)


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
    with pytest.raises(MultiStreamError, match=r"block 1 carries a patch that replaces the block computation") \
            as ei:
        _run_with_patch(patch)
    assert re.search(why, str(ei.value)), str(ei.value)
    assert "transformer_options" in str(ei.value)


def test_other_dit_keys_are_refused():
    with pytest.raises(MultiStreamError, match="unsupported dit patches"):
        _run_with_patch(lambda args, extra: extra["original_block"](args), key=("single_block", 0))


def test_option_only_patches_are_captured_as_data():
    marker = object()

    def set_backend(args, extra):
        to = dict(args["transformer_options"])
        to["optimized_attention_override"] = marker
        to["seen_block"] = to["block_index"]
        return extra["original_block"](dict(args, transformer_options=to))

    def in_place(args, extra):
        args["transformer_options"]["h3_flag"] = True
        return extra["original_block"](args)

    patcher = comfy_h3.model(layers=3)
    patcher.set_model_patch_replace(set_backend, "dit", "double_block", 0)
    clone, _ = split_clone(patcher)
    clone.set_model_patch_replace(in_place, "dit", "double_block", 2)
    user = BP.collect_user_patches(clone.model_options["transformer_options"], 3)
    assert user == {0: set_backend, 2: in_place}
    img = torch.zeros(10, H)
    args = {"img": img, "t_emb": torch.zeros(2, comfy_h3.T_DIM), "mod_segments": [(0, 10, 1)],
            "rope_freqs": torch.zeros(1), "transformer_options": {"block_index": 0, "keep": 1}}
    opts = BP.capture_block_options(user, args, 3)
    assert opts == [{"optimized_attention_override": marker, "seen_block": 0}, {}, {"h3_flag": True}]
    assert args["transformer_options"] == {"block_index": 0, "keep": 1}  # the live options are not touched
    assert torch.equal(img, torch.zeros(10, H))
    assert BP.capture_block_options({}, args, 3) is None


# --- weights through ComfyUI's patch path -------------------------------------------------------------------------

def test_block_tensors_are_what_comfyui_patches_in_without_double_applying():
    """A weight patch read before a full load equals what ComfyUI's own full load bakes into the live weight; after
    that load, reading again takes the live weight as it is (never patched twice) and the unpatched model's weight
    comes from ComfyUI's backup."""
    patcher = comfy_h3.model(layers=2, dtype=torch.bfloat16, weight_dtype=torch.bfloat16)
    dm = patcher.model.diffusion_model
    cfg = DETECT.read_config(dm)
    assert (cfg.hidden, cfg.layers, cfg.heads, cfg.head_dim, cfg.ffn) == (H, 2, comfy_h3.HEADS, comfy_h3.HEAD_DIM, FFN)
    plain = CW.block_tensors(patcher, 1, torch.bfloat16)
    from workers.dit.ops import held_by_ranks
    # every block weight the ranks hold; the adaLN projection stays in ComfyUI's model (nodes/modulation.py)
    assert {k: tuple(v.shape) for k, v in plain.items()} == {
        k: s for k, s in cfg.block_shapes().items() if held_by_ranks(k)}
    assert torch.equal(plain["mlp.fc1.weight"], dm.blocks[1].mlp.fc1.weight)

    lora = patcher.clone()
    lora.add_patches({"diffusion_model.blocks.1.mlp.fc1.weight": (torch.full((2 * FFN, H), 0.25),)})
    lora.add_weight_wrapper("diffusion_model.blocks.1.norm1.weight", lambda w: w * 2)
    got = CW.block_tensors(lora, 1, torch.bfloat16)
    assert not torch.equal(got["mlp.fc1.weight"], plain["mlp.fc1.weight"])
    assert torch.equal(got["norm1.weight"], dm.blocks[1].norm1.weight * 2)
    with torch.inference_mode():
        lora.patch_model()  # ComfyUI's full load bakes the patch into the live weight
    try:
        assert torch.equal(dm.blocks[1].mlp.fc1.weight, got["mlp.fc1.weight"])
        assert torch.equal(CW.block_tensors(lora, 1, torch.bfloat16)["mlp.fc1.weight"], got["mlp.fc1.weight"])
        assert torch.equal(CW.block_tensors(patcher, 1, torch.bfloat16)["mlp.fc1.weight"], plain["mlp.fc1.weight"])
    finally:
        lora.unpatch_model()
    assert torch.equal(CW.block_tensors(patcher, 1, torch.bfloat16)["mlp.fc1.weight"], plain["mlp.fc1.weight"])


def test_the_readahead_leaves_out_what_comfyuis_cast_reads_itself(tmp_path):
    """A module ComfyUI patches in its cast is read by that cast (comfy-aimdo reads an aligned range past the page
    cache), so the fill's readahead leaves its bytes out of the blocks it streams; the rest of each block, the adaLN
    projection included when the fill computes the rows, stays in."""
    import comfy.sd
    from safetensors.torch import save_file
    from h3ms_async.runtime.readahead import block_ranges, read_header

    sd = comfy_h3.state_dict(layers=2, dtype=torch.bfloat16, int8=True, scale_2d=True)
    path = str(tmp_path / "h3.safetensors")
    save_file({k: v.contiguous() for k, v in sd.items()}, path)
    with torch.inference_mode():
        patcher = comfy.sd.load_diffusion_model_state_dict(sd, model_options={"dtype": torch.bfloat16})
        lora = comfy.sd.load_lora_for_models(patcher, None, comfy_h3.lora_state_dict(2), 0.8, 0)[0]
        lora.load(torch.device("cpu"), lowvram_model_memory=1)  # every layer casts and patches on the fly
    try:
        dm = lora.get_model_object("diffusion_model")
        assert CW._patched_in_cast(dm.blocks[1].mlp.fc1) and not CW._patched_in_cast(dm.blocks[1].mlp.fc2)
        base, header = read_header(path)

        def covered(i: int, name: str, ranges) -> bool:
            a, b = header[f"blocks.{i}.{name}"]["data_offsets"]
            return any(off <= base + a and base + b <= off + n for off, n in ranges[i])

        for adaln in (True, False):
            ranges = block_ranges(path, CW._read_ahead(lora, adaln=adaln))
            for i in (0, 1):
                assert not covered(i, "mlp.fc1.weight", ranges) and not covered(i, "attn.qkv_proj.weight", ranges)
                assert covered(i, "mlp.fc2.weight", ranges) and covered(i, "attn.out_proj.weight", ranges)
                assert covered(i, "adaln_proj.linear.weight", ranges) == adaln
    finally:
        lora.unpatch_model(torch.device("cpu"))


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
def test_modules_that_patch_in_the_cast_ship_what_the_cast_gives(int8):
    """A module ComfyUI leaves offloaded (``--lowvram``, a partial load) applies its LoRA inside ``comfy.ops``' cast
    (a ``LowVramPatch`` in its weight functions, as ``ModelPatcherDynamic``'s on-the-fly patch does): the split ships
    exactly the tensors that forward computes with (same output, bit for bit), and leaves the module's own storage
    untouched (under DynamicVRAM that storage is a read-only file mapping: writing it killed ComfyUI's process)."""
    import comfy.sd
    sd = comfy_h3.state_dict(layers=2, dtype=torch.bfloat16, int8=int8, scale_2d=True)
    with torch.inference_mode():
        patcher = comfy.sd.load_diffusion_model_state_dict(sd, model_options={"dtype": torch.bfloat16})
        lora = comfy.sd.load_lora_for_models(patcher, None, comfy_h3.lora_state_dict(2), 0.8, 0)[0]
    block = patcher.model.diffusion_model.blocks[1]
    stored = {k: (v._qdata if CW._is_quantized(v) else v).clone() for k, v in block.state_dict().items()
              if isinstance(v, torch.Tensor)}
    with torch.inference_mode():
        lora.load(torch.device("cpu"), lowvram_model_memory=1)  # nothing fits: every layer casts, patches on the fly
    try:
        assert CW._patched_in_cast(block.mlp.fc1) and CW._patched_in_cast(block.attn.qkv_proj)
        got = CW.block_tensors(lora, 1, torch.bfloat16)
        x = torch.randn(5, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        with torch.inference_mode():
            for name in ("mlp.fc1", "attn.qkv_proj"):
                w = got[f"{name}.weight"]
                assert w.dtype == torch.bfloat16, name  # the LoRA left the int8 layer dequantized, as ComfyUI runs it
                want = block.get_submodule(name)(x)
                assert torch.equal(torch.nn.functional.linear(x, w, got.get(f"{name}.bias")), want), name
        after = {k: (v._qdata if CW._is_quantized(v) else v) for k, v in block.state_dict().items()
                 if isinstance(v, torch.Tensor)}
        assert all(torch.equal(after[k], v) for k, v in stored.items())
    finally:
        lora.unpatch_model(torch.device("cpu"))


def test_int8_weights_come_out_as_qdata_scale_and_convrot_tag():
    from comfy_kitchen.tensor import QuantizedTensor, TensorWiseINT8Layout
    sd = comfy_h3.state_dict(layers=1, int8=True)
    patcher = comfy_h3.model(layers=1, int8=True)
    got = CW.block_tensors(patcher, 0, torch.float32)
    assert got["mlp.fc1.weight"].dtype == torch.int8
    assert torch.equal(got["mlp.fc1.weight"], sd["blocks.0.mlp.fc1.weight"])
    assert torch.equal(got["mlp.fc1.weight_scale"].flatten(), sd["blocks.0.mlp.fc1.weight_scale"].flatten())
    assert "mlp.fc1.comfy_quant" not in got  # a plain tensorwise layer needs no tag
    assert "norm1.weight_scale" not in got and got["norm1.weight"].dtype == torch.float32
    assert not [k for k in got if k.startswith("adaln_proj.")]  # its rows are computed in ComfyUI, not read
    block = patcher.model.diffusion_model.blocks[0]  # a convrot layer carries its group size in the tag
    q = torch.randint(-127, 128, (3 * H, H), dtype=torch.int8)
    params = TensorWiseINT8Layout.Params(scale=torch.rand(3 * H, 1) / 100, orig_dtype=torch.float32,
                                         orig_shape=(3 * H, H), convrot=True, convrot_groupsize=256)
    block.attn.qkv_proj.weight = torch.nn.Parameter(QuantizedTensor(q, "TensorWiseINT8Layout", params),
                                                    requires_grad=False)
    got = CW.block_tensors(patcher, 0, torch.float32)
    assert torch.equal(got["attn.qkv_proj.weight"], q)
    assert json.loads(bytes(got["attn.qkv_proj.comfy_quant"].numpy())) == {
        "format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}
    assert CW.block_nbytes(patcher.model.diffusion_model, 0) == sum(
        v.numel() * v.element_size() for k, v in got.items() if not k.endswith(("_scale", "comfy_quant")))


@contextlib.contextmanager
def _comfy_mapped(raw: bytes, offset: int, dtype: torch.dtype, shape: tuple[int, ...], *, writable: bool = False):
    """``raw`` written to a file on disk (where direct I/O works) and mapped as ComfyUI's DynamicVRAM load maps a
    checkpoint: yields ``(path, fd, view)``, ``view`` the tensor at ``offset``, whose storage carries ComfyUI's own
    file-range record (``comfy.memory_management.TensorFileSlice``, as ``comfy.utils.load_safetensors`` sets it).
    ``writable``: a private writable mapping (in-place writes stay in memory). The caller drops its views before the
    block ends, so the mapping can close."""
    import gc
    import mmap
    import warnings

    import comfy.memory_management as mm_
    with tempfile.NamedTemporaryFile(suffix=".bin", dir=comfy_h3.checkpoint_dir()) as f:
        f.write(raw)
        f.flush()
        fd = os.open(f.name, os.O_RDONLY)
        mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY) if writable else mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        view = None
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                view = torch.frombuffer(mapping, dtype=dtype, count=torch.Size(shape).numel(), offset=offset)
            view = view.view(shape)
            view.untyped_storage()._comfy_tensor_file_slice = mm_.TensorFileSlice(fd, threading.Lock(), offset,
                                                                                 view.nbytes)
            yield f.name, fd, view
        finally:
            view = None
            gc.collect()
            mapping.close()
            os.close(fd)


def test_a_tensor_comfyui_maps_from_its_checkpoint_is_marked_as_the_files_bytes():
    """``file_source`` on the file-range record ComfyUI's DynamicVRAM load puts on a mapped tensor's storage
    (DynamicVRAM itself needs CUDA, so the GPU cold-start bench shows the whole path: ``fill_file_bytes``): a whole
    tensor becomes its file range, the same view; a part of one and a tensor without the record stay tensors."""
    from h3ms_async.runtime.file_bytes import FileBytes

    data = torch.randint(-127, 128, (64, 96), dtype=torch.int8)
    with _comfy_mapped(b"\0" * 100 + data.numpy().tobytes(), 100, torch.int8, (64, 96)) as (_path, fd, t):
        src = CW.file_source(torch.nn.Parameter(t, requires_grad=False))
        assert isinstance(src, FileBytes) and (src.fd, src.offset) == (fd, 100)
        assert src.tensor.data_ptr() == t.data_ptr()
        assert torch.equal(src.tensor, data)
        assert not isinstance(CW.file_source(t[1:]), FileBytes)
        assert not isinstance(CW.file_source(data), FileBytes)
        del t, src


def test_a_weight_comfyui_patched_in_place_is_not_read_from_the_file():
    """A block weight that maps its checkpoint (a private, writable mapping, with ComfyUI's file-range record) is read
    from the file; once ComfyUI's own patch load has written a LoRA into it in place (``weight_inplace_update``; the
    original in ``backup``), its bytes are no longer the file's: its module's tensors are copied as they are, and the
    readahead leaves it out."""
    from h3ms_async.runtime.file_bytes import FileBytes

    patcher = comfy_h3.model(layers=1, dtype=torch.bfloat16, weight_dtype=torch.bfloat16)
    fc1 = patcher.model.diffusion_model.blocks[0].mlp.fc1
    raw = fc1.weight.detach().view(torch.uint8).numpy().tobytes()
    with _comfy_mapped(raw, 0, torch.bfloat16, tuple(fc1.weight.shape), writable=True) as (_path, _fd, view):
        fc1.weight = torch.nn.Parameter(view, requires_grad=False)
        assert isinstance(CW.block_reader(patcher, 0.0, torch.bfloat16)(0)["mlp.fc1.weight"], FileBytes)
        assert CW._read_ahead(patcher, adaln=True)(0, "mlp.fc1.weight")
        lora = patcher.clone()
        lora.add_patches({"diffusion_model.blocks.0.mlp.fc1.weight": (torch.full(tuple(view.shape), 0.25),)})
        lora.weight_inplace_update = True
        with torch.inference_mode():
            lora.patch_model()
        try:
            assert fc1.weight.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()  # in place
            got = CW.block_reader(lora, 0.0, torch.bfloat16)(0)["mlp.fc1.weight"]
            ahead = CW._read_ahead(lora, adaln=True)  # nothing reads that module from the file: not read ahead
            assert not ahead(0, "mlp.fc1.weight") and ahead(0, "mlp.fc2.weight")
            assert not isinstance(got, FileBytes) and torch.equal(got, fc1.weight)
            assert not torch.equal(got, lora.backup["diffusion_model.blocks.0.mlp.fc1.weight"].weight)
        finally:
            lora.unpatch_model()
        del view, got, lora
        fc1.weight = torch.nn.Parameter(torch.zeros(1), requires_grad=False)


def test_ram_reserve_refuses_to_fill():
    patcher = comfy_h3.model(layers=1)
    need = CW.block_nbytes(patcher.model.diffusion_model, 0)
    gib = 1024 ** 3
    with pytest.raises(MultiStreamError, match="cache_ram_reserve_gb"):
        CW.block_reader(patcher, 1.0, torch.float32, ram=lambda: gib + need - 1)(0)
    assert set(CW.block_reader(patcher, 1.0, torch.float32, ram=lambda: gib + need)(0)) >= {"norm1.weight"}


def test_weight_key_from_loader_file_or_object():
    patcher = comfy_h3.model(layers=1)
    key, warning = CW.weight_key(patcher)
    assert warning and "cached_patcher_init" in warning and key.base[0] == "dit-object"
    name = f"h3key-{os.getpid()}.safetensors"
    path = comfy_h3.write_checkpoint(os.path.join(comfy_h3.checkpoint_dir(), name), layers=1)
    try:
        loaded = comfy_h3.load(name)  # UNETLoader registers ComfyUI's reload factory (cached_patcher_init)
        key, warning = CW.weight_key(loaded)
        st = os.stat(path)
        assert warning is None and key.base[:4] == ("dit", os.path.realpath(path), st.st_size, st.st_mtime_ns)
        assert key.patched == frozenset()
        lora = loaded.clone()
        lora.add_patches({"diffusion_model.blocks.0.norm1.weight": (torch.ones(H),),
                          "diffusion_model.blocks.0.adaln_proj.linear.weight": (torch.ones(1),),
                          "diffusion_model.final_layer.norm.weight": (torch.ones(H),)})
        patched = CW.weight_key(lora)[0]
        assert patched != key and patched.base == key.base and CW.weight_key(loaded.clone())[0] == key
        assert patched.patched == {(0, "norm1.weight")}  # the ranks hold no adaLN and no final layer
    finally:
        os.unlink(path)


class _DeviceWatch(TorchFunctionMode):
    """Records every torch call in this process that names a CUDA device (``device=``, ``Tensor.to``) and runs it
    on the CPU instead (there is no GPU here), so the path can run to the end and be counted."""

    def __init__(self):
        super().__init__()
        self.cuda_calls: list[str] = []

    @staticmethod
    def _is_cuda(v) -> bool:
        return isinstance(v, (str, torch.device)) and torch.device(v).type == "cuda"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", str(func))
        if name == "cuda":
            raise AssertionError("Tensor.cuda() called in the ComfyUI process")
        if self._is_cuda(kwargs.get("device")):
            self.cuda_calls.append(f"{name}(device={kwargs['device']})")
            kwargs["device"] = "cpu"
        if name == "to" and any(self._is_cuda(a) for a in args[1:]):
            self.cuda_calls.append(f"to({next(a for a in args[1:] if self._is_cuda(a))})")
            args = tuple("cpu" if self._is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def test_filling_the_store_never_puts_block_weights_on_the_model_gpu():
    """Reading the blocks into the host store names no CUDA device for an unpatched weight; a patched weight is
    computed on the model's device (where ComfyUI computes patches), one tensor at a time, straight back to the
    host."""
    lora = comfy_h3.model(layers=2).clone()
    lora.load_device = torch.device("cuda", 0)  # what ComfyUI gives an H3 model on a GPU machine
    keys = ["diffusion_model.blocks.0.norm1.weight", "diffusion_model.blocks.1.attn.q_norm.weight"]
    sd = lora.model.state_dict()
    lora.add_patches({k: (torch.full_like(sd[k], 0.01),) for k in keys})
    read = CW.block_reader(lora, 0.0, torch.float32)
    watch = _DeviceWatch()
    with watch:
        blocks = [read(i) for i in range(2)]
    assert watch.cuda_calls and all(c.startswith("to(") or "device=" in c for c in watch.cuda_calls)
    assert all(t.device.type == "cpu" for b in blocks for t in b.values())
    unpatched = CW.block_reader(comfy_h3.model(layers=2).clone(), 0.0, torch.float32)
    watch = _DeviceWatch()
    with watch:
        unpatched(0)
    assert watch.cuda_calls == []


# --- interrupt bridge, release, detach ------------------------------------------------------------------------------

def test_interrupt_bridge_reads_and_clears_comfy_flag():
    import comfy.model_management as mm
    probe = PROGRESS.interrupt_probe()
    assert probe() is False
    mm.interrupt_current_processing(True)
    assert probe() is True
    with pytest.raises(mm.InterruptProcessingException):
        PROGRESS.raise_interrupted(RuntimeError("aborted"))
    assert probe() is False


def test_release_node_detaches_and_a_detached_split_runs_plain_comfyui():
    """After detach, the split model gives what the unpatched one gives; the user's own patches still run."""
    calls = []

    def counting(args, extra):
        calls.append(1)
        return extra["original_block"](args)
    patcher = comfy_h3.model(layers=2)
    patcher.set_model_patch_replace(counting, "dit", "double_block", 1)
    reference = sample(patcher)
    n = len(calls)
    clone, state = split_clone(patcher)
    out = RELEASE.H3MSReleaseResourcesAsync().run(False, False, True, release_vae_workers=False)
    assert state.detached and "detached" in out["ui"]["text"][0] and "RAM available" in out["ui"]["text"][-1]
    nothing = RELEASE.H3MSReleaseResourcesAsync().run(False, False, False, release_vae_workers=False)
    assert nothing["ui"]["text"][0] == "nothing selected"
    assert same(reference, split_sample(clone, unsplit=True))
    assert n > 0 and calls == [1] * (2 * n)


# --- the real split engine on CPU rank workers ----------------------------------------------------------------------

def _leftovers() -> list[str]:
    kids = [k for k in psutil.Process().children(recursive=True)
            if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]
    from workers.runtime.shm import held_shm  # the pack's own module, loaded by ComfyUI's custom-node loader
    mine = f"h3ms-{os.getpid()}-"
    segments = sorted(held_shm(os.getpid()))
    run_dirs = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(mine)]
    return [f"pid {k.pid}" for k in kids] + segments + run_dirs


@pytest.fixture
def split(monkeypatch):
    """The split engine module; every engine is released afterwards and nothing may be left behind."""
    from h3ms_async.dit import split as split_module
    monkeypatch.delenv(NODE.RANK_MAP_ENV, raising=False)
    yield split_module
    split_module.release_all_engines()
    deadline = time.monotonic() + 5.0
    while (left := _leftovers()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"left behind: {left}"


def _patch_node(patcher, ranks: str, monkeypatch, gpus=None):
    monkeypatch.setenv(NODE.RANK_MAP_ENV, ranks)
    (patched,) = NODE.H3MultiStreamAsync().patch(patcher, True, -1, "host", 0, True, 0.0, "auto", gpus)
    assert patched is not patcher
    return patched


def test_split_step_is_recorded_and_gpu_set_shares_reach_the_engine(split, monkeypatch):
    from h3ms_async.runtime.plans import GPUSelectionError, GPUSet
    from h3ms_async.status.hub import get_hub
    patcher = comfy_h3.model(layers=3, int8=True)
    reference = sample(patcher)
    patched = _patch_node(patcher, "cpu,cpu", monkeypatch, gpus=GPUSet.parse("0,1", "", "1,0.5"))
    assert same(reference, split_sample(patched))
    (engine,) = split.engines()
    assert engine.options.shares == (1.0, 0.5)
    rec = get_hub().recent_steps(1)[-1]
    sigma_max = float(patcher.get_model_object("model_sampling").sigma_max)
    assert rec["devices"] == ["cpu", "cpu"] and rec["blocks"] == 3 and rec["sigma"] == pytest.approx(sigma_max)
    tokens = [b - a for a, b in (r["tokens"] for r in rec["ranks"])]
    assert abs(tokens[0] - 2 * tokens[1]) <= 2, tokens
    with pytest.raises(GPUSelectionError, match="shares: 3 value"):
        _patch_node(patcher, "cpu,cpu", monkeypatch, gpus=GPUSet.parse("0,1,2", "", "1,1,0.5"))


@pytest.mark.parametrize("value, why", [(lambda *a: None, "to a callable"), ("sage", "no meaning on the rank")])
def test_block_option_the_workers_cannot_run_is_refused_first(split, value, why, monkeypatch):
    def set_option(args, extra):
        to = dict(args["transformer_options"], optimized_attention_override=value)
        return extra["original_block"](dict(args, transformer_options=to))
    patcher = comfy_h3.model(layers=2)
    patcher.set_model_patch_replace(set_option, "dit", "double_block", 1)
    patched = _patch_node(patcher, "cpu,cpu", monkeypatch)
    with pytest.raises(MultiStreamError, match=r"block 1: .*optimized_attention_override") as ei:
        sample(patched)
    msg = str(ei.value)
    assert why in msg and "Remove" in msg and "disable H3 MultiStream" in msg  # the cause and what to do
    assert split.engines() == []  # refused before a weight store or a worker existed


def test_cancel_aborts_every_rank_within_two_seconds(split, monkeypatch):
    import comfy.model_management as mm
    patcher = comfy_h3.model(layers=16)
    patched = _patch_node(patcher, "cpu,cpu", monkeypatch)
    sample(patched)  # workers up and weights loaded
    (engine,) = split.engines()
    fired: list[float] = []

    def cancel_mid_step() -> None:
        deadline = time.monotonic() + 60.0
        while not engine.running and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.2)
        fired.append(time.monotonic())
        mm.interrupt_current_processing(True)

    canceller = threading.Thread(target=cancel_mid_step)
    canceller.start()
    with pytest.raises(mm.InterruptProcessingException) as ei:
        sample(patched, width=384, height=384, length=25)  # ~3.5k tokens x 16 blocks: over a second per step
    took = time.monotonic() - fired[0]
    canceller.join(5.0)
    assert isinstance(ei.value.__cause__, split.SplitInterrupted)  # aborted inside the step, not after it
    assert took < 2.0, f"cancel took {took:.2f}s"
    assert not mm.processing_interrupted()
    while (states := [w["state"] for w in engine.pool.snapshot()]) != ["ready", "ready"]:
        assert time.monotonic() < fired[0] + 2.0, f"ranks still {states} 2 s after the cancel"
        time.sleep(0.01)
    steps = engine.snapshot()["steps"]
    mm.interrupt_current_processing(True)  # cancelled between steps: nothing is sent to the ranks
    with pytest.raises(mm.InterruptProcessingException):
        sample(patched)
    assert engine.snapshot()["steps"] == steps
    assert same(sample(patcher), split_sample(patched))


def test_release_node_clears_store_keeps_workers_then_releases(split, monkeypatch):
    patcher = comfy_h3.model(layers=2)
    patched = _patch_node(patcher, "cpu,cpu", monkeypatch)
    reference = sample(patcher)
    sample(patched)
    (engine,) = split.engines()
    pids = [w["pid"] for w in engine.pool.snapshot()]
    text = RELEASE.H3MSReleaseResourcesAsync().run(False, True, False, release_vae_workers=False)["ui"]["text"]
    assert "weight store cleared" in text[0] and engine.weight_state == "empty"
    assert [w["pid"] for w in engine.pool.snapshot()] == pids  # workers kept
    assert same(reference, split_sample(patched))  # refilled on the next step, same workers
    assert [w["pid"] for w in engine.pool.snapshot()] == pids
    text = RELEASE.H3MSReleaseResourcesAsync().run(True, False, False, release_vae_workers=False)["ui"]["text"]
    assert "released (1 engine" in text[0] and split.engines() == []
    assert same(reference, split_sample(patched))  # a new engine starts on demand


@pytest.mark.parametrize("cache", [True, False], ids=["weight_cache-on", "weight_cache-off"])
def test_weight_cache_keeps_or_releases_the_store_after_sampling(split, monkeypatch, cache):
    """What weight_cache's tooltip says: on, the filled store outlives the prompt; off, it is released when sampling
    ends (ComfyUI's ON_CLEANUP). The workers stay either way, and the next prompt is still exact."""
    patcher = comfy_h3.model(layers=2)
    reference = sample(patcher)
    monkeypatch.setenv(NODE.RANK_MAP_ENV, "cpu,cpu")
    (patched,) = NODE.H3MultiStreamAsync().patch(patcher, True, -1, "host", 0, cache, 0.0, "auto", None)
    assert same(reference, split_sample(patched))
    (engine,) = split.engines()
    pids = [w["pid"] for w in engine.pool.snapshot()]
    assert engine.weight_state.startswith("warm") if cache else engine.weight_state == "empty"
    assert same(reference, split_sample(patched))
    assert [w["pid"] for w in engine.pool.snapshot()] == pids


def test_step_measured_not_exact_runs_unsplit_with_one_warning(split, monkeypatch, caplog):
    """A plan the ranks measure not bit-exact is refused by the engine (SplitUnsafe) and the node runs that step in
    ComfyUI, unsplit: same bits as the unpatched model, one warning for the plan, not one per step. The test hook
    makes fc2 round differently at the second rank's 2 rows (the smallest H3 latent packs 19 tokens; shares
    1 : 0.15 leave that rank 2 of them), too few tokens for any adjusted plan."""
    from h3ms_async.runtime.plans import GPUSet
    from h3ms_async.dit import exactness
    exactness.VERDICTS.clear()  # this process may have measured the plan before, without the fault
    patcher = comfy_h3.model(layers=2, int8=True)
    ffn = int(patcher.get_model_object("diffusion_model").blocks[0].mlp.fc2.weight.shape[1])
    monkeypatch.setenv("H3MS_TEST_SHAPE_FAULT", f"linear:2:{ffn}")  # read by the rank workers at their start
    tiny = dict(width=32, height=32, length=5, text_len=1)
    reference = sample(patcher, **tiny)
    patched = _patch_node(patcher, "cpu,cpu", monkeypatch, gpus=GPUSet.parse("0,1", "", "1,0.15"))
    with caplog.at_level("WARNING", logger="h3_multistream"):
        out = split_sample(patched, unsplit=True, **tiny)  # no split step is recorded
    assert same(reference, out)
    warned = [r.getMessage() for r in caplog.records if "running this step unsplit" in r.getMessage()]
    assert len(warned) == 1 and "mlp.fc2" in warned[0] and "2-row shard" in warned[0] and "cpu " in warned[0]
    inputs = dict(width=128, height=128, length=5)  # a larger step on the same patched model still splits
    assert same(sample(patcher, **inputs), split_sample(patched, **inputs))


def test_verify_input_checks_the_first_split_step_of_each_prompt(split, monkeypatch, caplog):
    """verify=True: each prompt's first split step also runs unsplit on the model's device and is compared; the
    log says bit-exact and the status's exactness.verify gets one result per prompt."""
    from h3ms_async.status.hub import get_hub
    patcher = comfy_h3.model(layers=2, int8=True)
    reference = sample(patcher)
    monkeypatch.setenv(NODE.RANK_MAP_ENV, "cpu,cpu")
    (patched,) = NODE.H3MultiStreamAsync().patch(patcher, True, -1, "host", 0, True, 0.0, "auto", None, True)
    n0 = len(get_hub().exactness()["verify"])
    with caplog.at_level("INFO", logger="h3_multistream"):
        assert same(reference, split_sample(patched))
        assert same(reference, split_sample(patched))
    got = get_hub().exactness()["verify"][n0:]
    assert len(got) == 2 and all(v["bit_exact"] and v["first_difference"] is None for v in got)
    assert "verify: bit-exact on cpu " in caplog.text


# --- sparse attention ---------------------------------------------------------------------------------------------

SPARSE_NODE = comfy_h3.pack_module("nodes.sparse_attention_node")


def _comfy_sparse_patch(patcher, marks=("callbacks", "override", "blocks")):
    """What ComfyUI's Model Sparse Attention node (ComfyUI 0.35+, comfy_extras/nodes_sparse_attention.py; not in this
    0.33.0 tree) leaves on a model, through ComfyUI's own ModelPatcher API: callbacks keyed 'block_sparse_attention',
    an attention override and one ('double_block', i) patch per H3 block, defined in that module. ``marks``: which of
    the three to leave (each alone must be refused)."""
    from comfy.patcher_extension import CallbacksMP

    def override(func, *args, **kwargs):
        return func(*args, **kwargs)

    def block_patch(args, extra):  # it passes the call through on anything but a CUDA bf16 stream
        return extra["original_block"](args)
    for fn in (override, block_patch):
        fn.__module__ = "comfy_extras.nodes_sparse_attention"
    m = patcher.clone()
    if "override" in marks:
        m.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = override
    if "callbacks" in marks:
        m.add_callback_with_key(CallbacksMP.ON_PREPARE_STATE, "block_sparse_attention", lambda *a: None)
        m.add_callback_with_key(CallbacksMP.ON_CLEANUP, "block_sparse_attention", lambda *a: None)
    if "blocks" in marks:
        for i in range(len(m.get_model_object("diffusion_model").blocks)):
            m.set_model_patch_replace(block_patch, "dit", "double_block", i)
    return m


@pytest.mark.parametrize("marks", [("callbacks", "override", "blocks"), ("callbacks",), ("override",), ("blocks",)])
def test_comfy_model_sparse_attention_is_refused_naming_our_node(split, monkeypatch, marks):
    """Before H3 MultiStream in the chain: refused when the node runs; after it: refused when sampling starts (a
    split that ignored it would silently attend dense)."""
    patcher = comfy_h3.model(layers=2)
    monkeypatch.setenv(NODE.RANK_MAP_ENV, "cpu,cpu")
    with pytest.raises(MultiStreamError, match="Model Sparse Attention patch") as ei:
        NODE.H3MultiStreamAsync().patch(_comfy_sparse_patch(patcher, marks), True, -1, "host", 0, True, 0.0, "auto")
    assert "H3 MS Sparse Attention" in str(ei.value) and "sparse_attention input" in str(ei.value)
    after = _comfy_sparse_patch(_patch_node(patcher, "cpu,cpu", monkeypatch), marks)
    with pytest.raises(MultiStreamError, match="H3 MS Sparse Attention"):
        sample(after)
    assert NODE.H3MultiStreamAsync().patch(_comfy_sparse_patch(patcher, marks), False, -1, "host", 0, True, 0.0,
                                           "auto")[0] is not None  # enabled=false keeps ComfyUI's node


def test_comfys_multigpu_cfg_split_is_refused_naming_both_nodes(split, monkeypatch, tmp_path):
    """ComfyUI's MultiGPU CFG Split makes its model copies (this CPU process is shown a second device, ``cpu:1``:
    ComfyUI's node copies onto every device it lists); before H3 MultiStream in the chain the node refuses, after it
    sampling does, before a rank starts; enabled=false keeps ComfyUI's node."""
    import comfy.model_management as mm
    import comfy.sd
    from comfy_extras.nodes_multigpu import MultiGPUCFGSplitNode

    path = comfy_h3.write_checkpoint(str(tmp_path / "h3-multigpu.safetensors"), layers=2)
    patcher = comfy.sd.load_diffusion_model(path)  # a core loader: ComfyUI's node can reload it per device
    monkeypatch.setattr(mm, "get_all_torch_devices",
                        lambda exclude_current=False: [torch.device("cpu"), torch.device("cpu", 1)])

    def cfg_split(m):
        out = MultiGPUCFGSplitNode.execute(m, 2)[0]
        assert [c.load_device for c in out.get_additional_models_with_key("multigpu")] == [torch.device("cpu", 1)]
        return out

    monkeypatch.setenv(NODE.RANK_MAP_ENV, "cpu,cpu")
    with pytest.raises(MultiStreamError, match=r"MultiGPU CFG Split \(model copies on cpu:1\)") as ei:
        NODE.H3MultiStreamAsync().patch(cfg_split(patcher), True, -1, "host", 0, True, 0.0, "auto")
    assert "enabled=false" in str(ei.value)
    after = cfg_split(_patch_node(patcher, "cpu,cpu", monkeypatch))
    with pytest.raises(MultiStreamError, match="Remove the MultiGPU CFG Split node"):
        sample(after)
    assert split.engines() == []  # refused before a weight store or a worker existed
    kept = NODE.H3MultiStreamAsync().patch(cfg_split(patcher), False, -1, "host", 0, True, 0.0, "auto")[0]
    reference = sample(kept)  # ComfyUI's node runs as it would without ours
    from comfy.patcher_extension import WrappersMP
    (wrapper,) = after.wrappers[WrappersMP.DIFFUSION_MODEL][MW.WRAPPER_KEY]  # ComfyUI's node kept ours
    wrapper.state.detached = True  # what H3 MS Release Resources' detach does: plain ComfyUI, its node included
    assert same(reference, sample(after)) and split.engines() == []


def test_sparse_settings_reach_the_ranks_and_cpu_runs_dense_with_one_line(split, monkeypatch, caplog):
    """The settings node's output on H3 MultiStream's sparse_attention input: the window becomes the model's own
    sigmas, the ranks (CPU: comfy-kitchen has no CPU sparse kernel) report the kernel cannot run, the split runs
    dense with ONE log line over several steps and two prompts, and equals plain ComfyUI."""
    patcher = comfy_h3.model(layers=3, int8=True)
    reference = sample(patcher, steps=2)
    (settings,) = SPARSE_NODE.H3MSSparseAttentionAsync().build("top-k", 1.3, 20.0, 0.25, 1.0, dense_blocks="2",
                                                               min_tokens=0)
    monkeypatch.setenv(NODE.RANK_MAP_ENV, "cpu,cpu")
    (patched,) = NODE.H3MultiStreamAsync().patch(patcher, True, -1, "host", 0, True, 0.0, "auto", None,
                                                 sparse_attention=settings)
    with caplog.at_level("WARNING", logger="h3_multistream"):
        assert same(reference, split_sample(patched, steps=2))
        assert same(reference, split_sample(patched, steps=2))
    (engine,) = split.engines()
    cfg = engine.options.sparse
    sampling = patcher.get_model_object("model_sampling")
    assert (cfg.topk_ratio, cfg.dense_blocks, cfg.min_tokens) == (0.2, (2,), 0)
    assert cfg.sigma_start == pytest.approx(float(sampling.percent_to_sigma(0.25))) and cfg.sigma_end == 0.0
    lines = [r.getMessage() for r in caplog.records if "sparse attention cannot run" in r.getMessage()]
    assert len(lines) == 1 and "not a CUDA device" in lines[0], lines
    with pytest.raises(MultiStreamError, match=r"H3 MS Sparse Attention: dense_blocks: block\(s\) \[3\]"):
        bad = SPARSE_NODE.H3MSSparseAttentionAsync().build("sol-attn", 1.3, 10.0, 0.2, 1.0, dense_blocks="3")[0]
        NODE.H3MultiStreamAsync().patch(patcher, True, -1, "host", 0, True, 0.0, "auto", None, sparse_attention=bad)
    with pytest.raises(MultiStreamError, match="exchange_pattern 'ulysses' cannot run sparse attention.*gather or auto"):
        NODE.H3MultiStreamAsync().patch(patcher, True, -1, "host", 0, True, 0.0, "auto", None,
                                        sparse_attention=settings, exchange_pattern="ulysses")


def test_one_gpu_with_sparse_attention_runs_the_blocks_on_one_rank(monkeypatch):
    """Plain ComfyUI here has no sparse attention: with one usable GPU and the settings connected, the blocks run on
    one worker rank (the same sparse attention as a split); without the settings the model stays unsplit, and then
    ComfyUI's own Model Sparse Attention is left alone."""
    monkeypatch.delenv(NODE.RANK_MAP_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    patcher = comfy_h3.model(layers=2).clone()
    patcher.load_device = torch.device("cuda", 0)
    settings = SPARSE_NODE.H3MSSparseAttentionAsync().build("sol-attn", 1.3, 10.0, 0.2, 1.0)[0]
    (out,) = NODE.H3MultiStreamAsync().patch(patcher, True, -1, "host", 0, True, 0.0, "auto", None,
                                             sparse_attention=settings)
    assert out is not patcher and out.wrappers
    state = next(s for s in MW.live_states() if s.patcher() is out)
    assert state.devices == ["cuda:0"] and state.options.sparse is not None
    # ComfyUI's own Model Sparse Attention on a model this node leaves unsplit is not refused: it runs as without us
    theirs = _comfy_sparse_patch(patcher)
    assert NODE.H3MultiStreamAsync().patch(theirs, True, -1, "host", 0, True, 0.0, "auto")[0] is theirs


# --- routes on ComfyUI's real PromptServer ---------------------------------------------------------------------------

OUR_ROUTES = {("GET", "/h3multistream/status"), ("GET", "/h3multistream/steps"),
              ("GET", "/h3multistream/workers/{rank}/log"), ("POST", "/h3multistream/workers/release"),
              ("POST", "/h3multistream/cache/clear_weights"), ("POST", "/h3multistream/hooks/detach"),
              ("POST", "/h3multistream/cache/clear_text"), ("GET", "/h3multistream/panel"),
              ("GET", "/h3multistream/web/{name}")}


@pytest.fixture
def prompt_server():
    import server
    instance = server.PromptServer.instance
    assert instance is not None, "the runner creates ComfyUI's PromptServer before loading the pack"
    return instance


def _ours(instance) -> list[tuple[str, str]]:
    return [(r.method, r.path) for r in instance.routes if r.path.startswith("/h3multistream")]


def test_loader_registered_routes_once_and_busy_follows_the_prompt_queue(prompt_server):
    from h3ms_async.status.hub import get_hub
    got = _ours(prompt_server)
    assert set(got) == OUR_ROUTES and len(got) == len(OUR_ROUTES)
    assert ROUTES.register(prompt_server) is False and len(_ours(prompt_server)) == len(OUR_ROUTES)
    hub = get_hub()
    q = prompt_server.prompt_queue
    assert hub.busy() is False
    q.put((0, "prompt-1", {}, {}, []))
    assert hub.busy() is False  # only a running prompt holds the split
    _item, running_id = q.get(timeout=1)
    try:
        assert hub.busy() is True and ROUTES.queue_busy(prompt_server) is True
    finally:
        q.task_done(running_id, {}, None)
    assert hub.busy() is False


def _drain_steps(instance) -> list[dict]:
    """The ``h3multistream.step`` pushes ComfyUI's ``send_sync`` queued for its websocket clients."""
    instance.loop.run_until_complete(asyncio.sleep(0))
    out = []
    while not instance.messages.empty():
        event, data, _sid = instance.messages.get_nowait()
        if event == ROUTES.STEP_EVENT:
            out.append(data)
    return out


def test_routes_over_a_running_split(prompt_server, split, monkeypatch):
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer
    app = web.Application()
    app.add_routes([r for r in prompt_server.routes if r.path.startswith("/h3multistream")])
    patcher = comfy_h3.model(layers=3)
    patched = _patch_node(patcher, "cpu,cpu", monkeypatch)
    _drain_steps(prompt_server)
    sample(patched)
    sample(patched)
    pushed = _drain_steps(prompt_server)  # one record per split model call (cond and uncond: one call each here)
    from h3ms_async.status.hub import get_hub
    assert len(pushed) >= 2 and [r["seq"] for r in pushed] == [r["seq"] for r in get_hub().recent_steps(len(pushed))]
    assert all(rec["kind"] == "dit" and rec["devices"] == ["cpu", "cpu"] for rec in pushed)
    q = prompt_server.prompt_queue

    async def check() -> None:
        client = TestClient(TestServer(app))
        await client.start_server()
        try:
            async def get(path: str, status: int = 200) -> dict:
                r = await client.get(path)
                assert r.status == status, await r.text()
                return await r.json()

            async def post(path: str) -> dict:
                r = await client.post(path)
                assert r.status == 200, await r.text()
                return await r.json()

            st = await get("/h3multistream/status")
            assert st["running"] is False and st["last_step"]["seq"] == pushed[-1]["seq"]
            assert [(w["rank"], w["state"]) for w in st["workers"]] == [(0, "ready"), (1, "ready")]
            pids = [w["pid"] for w in st["workers"]]
            assert st["weight_store"]["state"] == "warm" and st["weight_store"]["blocks"] == 3
            assert any(h["devices"] == ["cpu", "cpu"] and not h["detached"] for h in st["hooks"])
            assert [s["seq"] for s in (await get("/h3multistream/steps?n=1"))["steps"]] == [pushed[-1]["seq"]]
            log = await get("/h3multistream/workers/1/log?lines=50")
            assert log["rank"] == 1 and any("rank 1: weights" in line for line in log["lines"])
            assert "no worker with rank 7" in (await get("/h3multistream/workers/7/log", 404))["error"]
            r = await client.get("/h3multistream/panel")
            assert r.status == 200 and r.content_type == "text/html"

            q.put((0, "prompt-2", {}, {}, []))  # while ComfyUI runs a prompt every mutating route refuses
            _item, running_id = q.get(timeout=1)
            try:
                for path in ("/h3multistream/workers/release", "/h3multistream/cache/clear_weights",
                             "/h3multistream/hooks/detach", "/h3multistream/cache/clear_text"):
                    answer = await post(path)
                    assert answer["busy"] is True and "a prompt is running" in answer["message"]
                st = await get("/h3multistream/status")
                assert st["running"] is True and [w["pid"] for w in st["workers"]] == pids
                assert st["weight_store"]["state"] == "warm"
            finally:
                q.task_done(running_id, {}, None)

            answer = await post("/h3multistream/cache/clear_weights")
            assert answer["busy"] is False and "weight store cleared" in answer["message"]
            assert "weight caches: 0.0 KiB of RAM freed" in answer["message"]
            assert answer["caches"] == {"freed_bytes": 0, "pinned_freed_bytes": 0, "kept_bytes": 0}, answer
            answer = await post("/h3multistream/cache/clear_text")
            assert answer["busy"] is False and "text-encoder output cache cleared" in answer["message"]
            assert set(answer["text_encoder_outputs"]) == {"entries", "freed_bytes", "pinned_freed_bytes",
                                                           "kept_bytes"}, answer
            st = await get("/h3multistream/status")
            assert st["weight_store"]["state"] == "empty" and [w["pid"] for w in st["workers"]] == pids
            answer = await post("/h3multistream/hooks/detach")
            assert answer["busy"] is False and "detached" in answer["message"]
            assert all(h["detached"] for h in (await get("/h3multistream/status"))["hooks"])
            assert same(sample(patcher), split_sample(patched, unsplit=True))
            answer = await post("/h3multistream/workers/release")
            assert answer["busy"] is False and "released (1 engine" in answer["message"]
            assert (await get("/h3multistream/status"))["workers"] == []
        finally:
            await client.close()

    prompt_server.loop.run_until_complete(check())
    assert _drain_steps(prompt_server) == []  # detached: plain ComfyUI, no split step pushed
