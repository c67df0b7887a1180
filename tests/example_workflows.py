"""The pack's example workflows (``example_workflows/*.json``, ComfyUI's template browser) and their tiny CPU
variants.

The workflows are built *by ComfyUI's own frontend* from the specs below (``LiteGraph.createNode``, widgets set by
name, ``connect``, ``graph.serialize()``), so every widget value sits where the frontend puts it; the thumbnail is
the frontend's canvas with that graph. Regenerate both after changing a spec or a node::

    H3MS_SHARED=/work/shared .venv/bin/python -m tests.example_workflows

``tests/test_example_workflows.py`` loads the saved files through ComfyUI's template route and queues
:func:`tiny_variant` of each (the same nodes and links; tiny models, a tiny latent, two steps).
"""
from __future__ import annotations

import html
import io
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests import comfy_tree

DIR = comfy_tree.ROOT / "example_workflows"

# The standard H3 model files (a user points the loaders at theirs).
DIT_FILE = "minimax_h3_fl2va_pruned_int8_convrot.safetensors"
TEXT_ENCODER_FILE = "minimax_h3_qwen3vl_32b_text_encoder.safetensors"
VIDEO_VAE_FILE = "minimax_h3_video_vae_int8_convrot.safetensors"
AUDIO_VAE_FILE = "minimax_h3_audio_vae.safetensors"
#: The tiny files the CPU variant loads instead (tests/test_example_workflows.py writes them).
TINY_FILES = {DIT_FILE: "h3ms_browser_tiny.safetensors", TEXT_ENCODER_FILE: "h3ms_tiny_clip_l.safetensors",
              VIDEO_VAE_FILE: "h3ms_tiny_video_vae.safetensors", AUDIO_VAE_FILE: "h3ms_tiny_audio_vae.safetensors"}
TINY_LATENT = {"width": 64, "height": 64, "length": 5}
TINY_STEPS = 2

PROMPT = ("A red fox trots through fresh snow in a pine forest at dawn, breath steaming; soft crunch of snow, "
          "distant birdsong.")
COLUMN = 380  # px between node columns


def _node(nid: int, type_: str, col: float, row: float, widgets: dict | None = None,
          inputs: dict | None = None, title: str | None = None, size: list | None = None) -> dict:
    """A node of a spec: ``inputs`` maps an input name to ``(source node id, output slot)``."""
    return {"id": nid, "type": type_, "pos": [col * COLUMN, row], "widgets": widgets or {},
            "inputs": inputs or {}, "title": title, "size": size}


def _text_to_video_audio(model_chain: list[dict], model_out: int, clip_out: int, video_vae_out: int,
                         audio_vae_out: int, extra: list[dict], note: str) -> list[dict]:
    """The common H3 text-to-video+audio graph: loaders (ids 1-4), prompt, AV latent, sampler, separate, decode
    both streams, one video file with sound. ``model_chain``/``extra`` add the pack's nodes; ``*_out`` name the node
    each consumer reads (a loader, or a pack node after it)."""
    nodes = [
        _node(1, "UNETLoader", 0, 0, {"unet_name": DIT_FILE, "weight_dtype": "default"}),
        _node(2, "CLIPLoader", 0, 430, {"clip_name": TEXT_ENCODER_FILE, "type": "minimax"}),
        _node(3, "VAELoader", 0, 600, {"vae_name": VIDEO_VAE_FILE}, title="Load Video VAE"),
        _node(4, "VAELoader", 0, 700, {"vae_name": AUDIO_VAE_FILE}, title="Load Audio VAE"),
        _node(5, "MiniMaxH3SigmaShift", 1, 0, inputs={"model": (1, 0)}),
        _node(10, "CLIPTextEncode", 2, 330, {"text": PROMPT}, {"clip": (clip_out, 0)}, "Positive prompt",
              [360, 160]),
        _node(11, "CLIPTextEncode", 2, 530, {"text": ""}, {"clip": (clip_out, 0)}, "Negative prompt", [360, 110]),
        _node(12, "EmptyMiniMaxH3LatentAV", 2, 680, {"width": 1344, "height": 768, "length": 124}),
        _node(13, "KSampler", 3, 0, {"seed": 42, "control_after_generate": "fixed", "steps": 30, "cfg": 5.0,
                                     "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0},
              {"model": (model_out, 0), "positive": (10, 0), "negative": (11, 0), "latent_image": (12, 0)}),
        _node(14, "LTXVSeparateAVLatent", 4, 0, inputs={"av_latent": (13, 0)}),
        _node(15, "VAEDecode", 4, 130, inputs={"samples": (14, 0), "vae": (video_vae_out, 0)}),
        _node(16, "LTXVAudioVAEDecode", 4, 260, inputs={"samples": (14, 1), "audio_vae": (audio_vae_out, 0)}),
        _node(17, "CreateVideo", 5, 0, {"fps": 24.0}, {"images": (15, 0), "audio": (16, 0)}),
        _node(18, "SaveVideo", 5, 200, {"filename_prefix": "video/h3ms"}, {"video": (17, 0)}),
        _node(19, "Note", 3, 330, {"text": note}, title="Read me", size=[380, 300]),
    ]
    return nodes + model_chain + extra


MULTISTREAM_NOTE = (
    "H3 MultiStream splits every denoising step's blocks over the GPUs of the GPU Set (tokens and heads, one worker "
    "process per GPU); the output equals one GPU's bit for bit.\n\n"
    "GPU Set: gpus lists the CUDA indices (auto = every visible GPU; the model's GPU is rank 0). shares is the "
    "relative speed of each listed GPU (1,1 = even; 1,1,0.7 gives a slower third card less work).\n\n"
    "exchange: host works on any PCIe box (exchange_chunks 8 overlaps the copies); nccl for NVLink machines.\n\n"
    "Point the four loaders at your H3 files. The live panel is in the sidebar (H3 MultiStream tab).")
CACHES_NOTE = (
    "As the MultiStream workflow, plus:\n\n"
    "VAE Split Decode deals the video VAE's temporal chunks over the GPUs of the same GPU Set (bit-exact).\n\n"
    "Text Encoder Cache: a re-queued or repeated prompt skips the text encoder. VAE Cache (one per VAE): the VAE "
    "weights stay in pinned RAM between scenes. The weight caches stand aside under DynamicVRAM (ComfyUI's NVIDIA "
    "default): start ComfyUI with --disable-dynamic-vram to use them; the prompt cache works either way.")
ATTENTION_NOTE = (
    "H3 Attention Parallel: for an H3 that fits on one GPU. Only the attention moves: every call's heads are split "
    "over the GPUs (devices: auto, or 2-8 counting the model's GPU).\n\n"
    "IMPORTANT: start ComfyUI with --use-ck-attention (the node splits comfy-kitchen's INT8 attention and refuses "
    "to run without it). The output then equals ComfyUI's --use-ck-attention on one GPU bit for bit.\n\n"
    "Do not put H3 MultiStream on the same model (keep one of the two).")


def _gpu_set(nid: int, row: float) -> dict:
    return _node(nid, "H3MSGPUSetAsync", 0, row, {"gpus": "0,1", "exclude": "", "shares": "1,1",
                                                  "min_free_vram_gb": 0.0, "max_gpus": 8})


def _multistream(nid: int, model_in: int, gpus: int) -> dict:
    return _node(nid, "H3MultiStreamAsync", 2, 0, {"exchange": "host", "exchange_chunks": 8},
                 {"model": (model_in, 0), "gpus": (gpus, 0)})


def specs() -> dict[str, dict[str, Any]]:
    """Workflow file name (no extension) -> {"title", "nodes"}."""
    multistream = _text_to_video_audio([_gpu_set(20, 150), _multistream(21, 5, 20)], 21, 2, 3, 4, [],
                                       MULTISTREAM_NOTE)
    caches = _text_to_video_audio(
        [_gpu_set(20, 150), _multistream(21, 5, 20)], 21, 22, 24, 25,
        [_node(22, "H3MSTextEncoderCacheAsync", 1, 430, inputs={"clip": (2, 0)}),
         _node(23, "H3MSVAECacheAsync", 1, 600, inputs={"vae": (3, 0)}, title="H3 MS VAE Cache (video)"),
         _node(24, "H3MSVAESplitDecodeAsync", 2, 900, inputs={"vae": (23, 0), "gpus": (20, 0)}),
         _node(25, "H3MSVAECacheAsync", 1, 800, inputs={"vae": (4, 0)}, title="H3 MS VAE Cache (audio)")],
        CACHES_NOTE)
    attention = _text_to_video_audio(
        [_node(20, "H3AttentionParallelAsync", 2, 0, {"devices": "auto"}, {"model": (5, 0)})], 20, 2, 3, 4, [],
        ATTENTION_NOTE)
    return {"h3_text_to_video_audio_multistream": {"title": "H3 text to video+audio, H3 MultiStream",
                                                   "nodes": multistream},
            "h3_text_to_video_audio_vae_split_caches": {"title": "H3 text to video+audio, VAE split and caches",
                                                        "nodes": caches},
            "h3_attention_parallel": {"title": "H3 Attention Parallel (model fits one GPU)", "nodes": attention}}


#: Builds one spec in the page's graph with the frontend's own node classes and returns ``graph.serialize()``.
BUILD_JS = """async (spec) => {
  const app = window.app, LG = window.LiteGraph;
  app.graph.clear();
  const made = {};
  for (const n of [...spec.nodes].sort((a, b) => a.id - b.id)) {
    const node = LG.createNode(n.type);
    if (!node) throw new Error(`the frontend has no node type ${n.type}`);
    node.id = n.id;
    app.graph.add(node);
    if (n.title) node.title = n.title;
    node.pos = n.pos;
    for (const [name, value] of Object.entries(n.widgets)) {
      const w = (node.widgets || []).find((w) => w.name === name);
      if (!w) throw new Error(`${n.type} has no widget ${name}`);
      w.value = value;
    }
    if (n.size) node.size = n.size;
    made[n.id] = node;
  }
  for (const n of spec.nodes) {
    for (const [name, [src, slot]] of Object.entries(n.inputs)) {
      const idx = made[n.id].findInputSlot(name);
      if (idx < 0) throw new Error(`${n.type} has no input ${name}`);
      made[src].connect(slot, made[n.id], idx);
    }
  }
  app.canvas.setDirty(true, true);
  // a string: JSON.stringify drops the undefined fields a structured copy would turn into nulls
  return JSON.stringify({ graph: app.graph.serialize(),
                          titles: Object.fromEntries(app.graph._nodes.map((n) => [n.id, n.title])) });
}"""

THUMB_CSS = """
body { margin: 0; width: 800px; height: 500px; background: #15171c; color: #e4e6eb;
       font: 13px/1.3 system-ui, sans-serif; display: flex; flex-direction: column; }
h1 { font-size: 26px; margin: 22px 28px 4px; } .sub { color: #9aa0aa; margin: 0 28px 14px; font-size: 15px; }
.flow { display: flex; gap: 14px; padding: 0 28px; flex: 1; align-items: flex-start; }
.col { display: flex; flex-direction: column; gap: 8px; flex: 1; }
.box { background: #262a33; border: 1px solid #3a3f4a; border-radius: 6px; padding: 7px 8px; }
.box.pack { background: #1d3a5f; border-color: #4e9af1; font-weight: 600; }
.foot { color: #9aa0aa; margin: 0 28px 16px; }
"""


def tiny_variant(prompt: dict) -> dict:
    """An API prompt (``app.graphToPrompt()`` of a saved workflow) with tiny models, a tiny latent and two steps:
    the same nodes and links. The text encoder loads as a random CLIP-L (``stable_diffusion``): H3's own type
    (Qwen3-VL-32B) has a fixed geometry far too big for a test."""
    out = json.loads(json.dumps(prompt))
    for node in out.values():
        inputs, kind = node["inputs"], node["class_type"]
        for key in ("unet_name", "clip_name", "vae_name"):
            if key in inputs:
                inputs[key] = TINY_FILES[inputs[key]]
        if kind == "CLIPLoader":
            inputs["type"] = "stable_diffusion"
        elif kind == "EmptyMiniMaxH3LatentAV":
            inputs.update(TINY_LATENT)
        elif kind == "KSampler":
            inputs["steps"] = TINY_STEPS
    return out


def thumbnail_html(spec: dict, titles: dict[str, str]) -> str:
    """The template browser's card for ``spec``: its title and its nodes by column as the frontend names them, the
    pack's nodes highlighted (the note left out)."""
    cols: dict[float, list[dict]] = {}
    for n in sorted(spec["nodes"], key=lambda n: n["pos"][1]):
        if n["type"] != "Note":
            cols.setdefault(n["pos"][0], []).append(n)
    flow = "".join(
        '<div class="col">' + "".join(
            f'<div class="box{" pack" if n["type"].startswith("H3") else ""}">{html.escape(titles[str(n["id"])])}'
            "</div>" for n in nodes) + "</div>" for _, nodes in sorted(cols.items()))
    return (f"<!DOCTYPE html><html><head><style>{THUMB_CSS}</style></head><body>"
            f"<h1>{html.escape(spec['title'])}</h1><div class=\"sub\">MiniMax H3 · text → video with sound</div>"
            f"<div class=\"flow\">{flow}</div><div class=\"foot\">H3 MultiStream (async) · example workflow "
            "· blue: the pack's nodes</div></body></html>")


def main() -> None:
    """Build every spec in the real frontend, write ``example_workflows/<name>.json`` and its ``.jpg`` thumbnail."""
    from PIL import Image
    from playwright.sync_api import sync_playwright

    from tests.browser_comfy import ComfyServer
    from tests.test_browser_comfy import CHROMIUM

    DIR.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        user = Path(tmp) / "user" / "default"
        user.mkdir(parents=True)
        (user / "comfy.settings.json").write_text(json.dumps({"Comfy.TutorialCompleted": True}))
        server = ComfyServer(["--user-directory", str(Path(tmp) / "user")], {}, Path(tmp) / "comfy.log",
                             comfy_tree.ensure_tree())
        try:
            server.wait_ready(180)
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
                page = browser.new_page(viewport={"width": 1600, "height": 1000})
                page.set_default_timeout(90_000)
                page.goto(server.url)
                page.wait_for_function("window.app && window.app.graph && window.LiteGraph")
                card = browser.new_page(viewport={"width": 800, "height": 500})
                for name, spec in specs().items():
                    built = json.loads(page.evaluate(BUILD_JS, spec))
                    (DIR / f"{name}.json").write_text(json.dumps(built["graph"], indent=1) + "\n")
                    card.set_content(thumbnail_html(spec, built["titles"]))
                    shot = Image.open(io.BytesIO(card.screenshot()))
                    shot.convert("RGB").save(DIR / f"{name}.jpg", quality=88)
                    print(f"wrote {DIR / name}.json/.jpg", file=sys.stderr)
                browser.close()
        finally:
            server.stop()


if __name__ == "__main__":
    main()
