"""Write the pack's example workflows (``example_workflows/<name>.json``, ComfyUI's template
browser) from the node definitions: run ``python scripts/example_workflows.py`` after a node's
inputs change (``--thumbnails`` also renders the template cards, ``<name>.jpg``, in Debian's
chromium). ``tests/test_example_workflow_files.py`` fails while a committed workflow differs from
what this writes.

The definitions are ComfyUI's ``/object_info`` entries, the ones its frontend builds nodes from: a
process in the real ComfyUI tree (``tests/comfy_tree.py``) loads ComfyUI's nodes and the pack with
ComfyUI's own loader and asks that route for each node type the workflows use. Each node is written
as the frontend serializes it: its input slots (the sockets, then one slot per widget, each group in
``input_order``: required, then optional), its outputs, and ``widgets_values`` in the order of its
widget inputs (``control_after_generate`` right after an INT that has one), each the spec's value or
else the input's default. ``tests/test_example_workflows.py`` loads the files in the real frontend
and checks that the frontend serializes every node back to what the file holds.
"""

from __future__ import annotations

import argparse
import html
import io
import json
import math
import sys
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DIR = ROOT / "example_workflows"

# The standard H3 model files (a user points the loaders at theirs).
DIT_FILE = "minimax_h3_fl2va_pruned_int8_convrot.safetensors"
TEXT_ENCODER_FILE = "minimax_h3_qwen3vl_32b_text_encoder.safetensors"
VIDEO_VAE_FILE = "minimax_h3_video_vae_int8_convrot.safetensors"
AUDIO_VAE_FILE = "minimax_h3_audio_vae.safetensors"

PROMPT = (
    "A red fox trots through fresh snow in a pine forest at dawn, breath steaming; "
    "soft crunch of snow, distant birdsong."
)
COLUMN = 380  # px between node columns

Spec = dict[str, Any]
Definition = dict[str, Any]


def _node(
    nid: int,
    type_: str,
    col: float,
    row: float,
    widgets: dict | None = None,
    inputs: dict | None = None,
    title: str | None = None,
    size: list | None = None,
) -> Spec:
    """A node of a spec: ``widgets`` maps a widget to its value (the others keep their defaults),
    ``inputs`` an input socket to ``(source node id, output slot)``; ``size`` where the computed
    one is too small (a text box)."""
    return {
        "id": nid,
        "type": type_,
        "pos": [col * COLUMN, row],
        "widgets": widgets or {},
        "inputs": inputs or {},
        "title": title,
        "size": size,
    }


def _text_to_video_audio(
    model_chain: list[Spec],
    model_out: int,
    clip_out: int,
    video_vae_out: int,
    audio_vae_out: int,
    extra: list[Spec],
    note: str,
) -> list[Spec]:
    """The common H3 text-to-video+audio graph: loaders (ids 1-4), prompt, AV latent, sampler,
    separate, decode both streams, one video file with sound. ``model_chain``/``extra`` add the
    pack's nodes; ``*_out`` name the node each consumer reads (a loader, or a pack node after it).
    """
    sampler = {
        "seed": 42,
        "control_after_generate": "fixed",
        "steps": 30,
        "cfg": 5.0,
        "sampler_name": "euler",
        "scheduler": "simple",
        "denoise": 1.0,
    }
    sampler_in = {"model": (model_out, 0), "positive": (10, 0), "negative": (11, 0)}
    nodes = [
        _node(1, "UNETLoader", 0, 0, {"unet_name": DIT_FILE}),
        _node(2, "CLIPLoader", 0, 430, {"clip_name": TEXT_ENCODER_FILE, "type": "minimax"}),
        _node(3, "VAELoader", 0, 600, {"vae_name": VIDEO_VAE_FILE}, title="Load Video VAE"),
        _node(4, "VAELoader", 0, 700, {"vae_name": AUDIO_VAE_FILE}, title="Load Audio VAE"),
        _node(5, "MiniMaxH3SigmaShift", 1, 0, inputs={"model": (1, 0)}),
        _node(10, "CLIPTextEncode", 2, 330, {"text": PROMPT}, {"clip": (clip_out, 0)},
              "Positive prompt", [360, 160]),
        _node(11, "CLIPTextEncode", 2, 530, {"text": ""}, {"clip": (clip_out, 0)},
              "Negative prompt", [360, 110]),
        _node(12, "EmptyMiniMaxH3LatentAV", 2, 680, {"width": 1344, "height": 768, "length": 124}),
        _node(13, "KSampler", 3, 0, sampler, {**sampler_in, "latent_image": (12, 0)}),
        _node(14, "LTXVSeparateAVLatent", 4, 0, inputs={"av_latent": (13, 0)}),
        _node(15, "VAEDecode", 4, 130, inputs={"samples": (14, 0), "vae": (video_vae_out, 0)}),
        _node(16, "LTXVAudioVAEDecode", 4, 260,
              inputs={"samples": (14, 1), "audio_vae": (audio_vae_out, 0)}),
        _node(17, "CreateVideo", 5, 0, {"fps": 24.0}, {"images": (15, 0), "audio": (16, 0)}),
        _node(18, "SaveVideo", 5, 200, {"filename_prefix": "video/h3ms"}, {"video": (17, 0)}),
        _node(19, "Note", 3, 330, {"text": note}, title="Read me", size=[380, 300]),
    ]  # fmt: skip
    return nodes + model_chain + extra


MULTISTREAM_NOTE = (
    "H3 MultiStream splits every denoising step's blocks over the GPUs of the GPU Set (tokens and "
    "heads, one worker process per GPU); the output equals one GPU's bit for bit.\n\n"
    "GPU Set: gpus lists the CUDA indices (auto = every visible GPU; the model's GPU is rank 0). "
    "shares is the relative speed of each listed GPU (1,1 = even; 1,1,0.7 gives a slower third "
    "card less work).\n\n"
    "exchange: host works on any PCIe box (exchange_chunks 8 overlaps the copies); nccl for "
    "NVLink machines.\n\n"
    "Point the four loaders at your H3 files. The live panel is in the sidebar (H3 MultiStream "
    "tab)."
)
CACHES_NOTE = (
    "As the MultiStream workflow, plus:\n\n"
    "VAE Split Decode deals the video VAE's temporal chunks over the GPUs of the same GPU Set "
    "(bit-exact).\n\n"
    "Text Encoder Cache: a re-queued or repeated prompt skips the text encoder. VAE Cache (one per "
    "VAE): the VAE weights stay in pinned RAM between scenes. The weight caches stand aside under "
    "DynamicVRAM (ComfyUI's NVIDIA default): start ComfyUI with --disable-dynamic-vram to use "
    "them; the prompt cache works either way."
)
ATTENTION_NOTE = (
    "H3 Attention Parallel: for an H3 that fits on one GPU. Only the attention moves: every call's "
    "heads are split over the GPUs (devices: auto, or 2-8 counting the model's GPU).\n\n"
    "IMPORTANT: start ComfyUI with --use-ck-attention (the node splits comfy-kitchen's INT8 "
    "attention and refuses to run without it). The output then equals ComfyUI's "
    "--use-ck-attention on one GPU bit for bit.\n\n"
    "Do not put H3 MultiStream on the same model (keep one of the two)."
)


def _gpu_set(nid: int, row: float) -> Spec:
    return _node(nid, "H3MSGPUSetAsync", 0, row, {"gpus": "0,1", "shares": "1,1"})


def _multistream(nid: int, model_in: int, gpus: int) -> Spec:
    widgets = {"exchange": "host", "exchange_chunks": 8}
    return _node(
        nid, "H3MultiStreamAsync", 2, 0, widgets, {"model": (model_in, 0), "gpus": (gpus, 0)}
    )


def specs() -> dict[str, Spec]:
    """Workflow file name (no extension) -> {"title", "nodes"}."""
    split = [_gpu_set(20, 150), _multistream(21, 5, 20)]
    caches = [
        _node(22, "H3MSTextEncoderCacheAsync", 1, 430, inputs={"clip": (2, 0)}),
        _node(23, "H3MSVAECacheAsync", 1, 600, inputs={"vae": (3, 0)},
              title="H3 MS VAE Cache (video)"),
        _node(24, "H3MSVAESplitDecodeAsync", 2, 900, inputs={"vae": (23, 0), "gpus": (20, 0)}),
        _node(25, "H3MSVAECacheAsync", 1, 800, inputs={"vae": (4, 0)},
              title="H3 MS VAE Cache (audio)"),
    ]  # fmt: skip
    attention = [
        _node(20, "H3AttentionParallelAsync", 2, 0, {"devices": "auto"}, {"model": (5, 0)})
    ]
    return {
        "h3_text_to_video_audio_multistream": {
            "title": "H3 text to video+audio, H3 MultiStream",
            "nodes": _text_to_video_audio(split, 21, 2, 3, 4, [], MULTISTREAM_NOTE),
        },
        "h3_text_to_video_audio_vae_split_caches": {
            "title": "H3 text to video+audio, VAE split and caches",
            "nodes": _text_to_video_audio(split, 21, 22, 24, 25, caches, CACHES_NOTE),
        },
        "h3_attention_parallel": {
            "title": "H3 Attention Parallel (model fits one GPU)",
            "nodes": _text_to_video_audio(attention, 20, 2, 3, 4, [], ATTENTION_NOTE),
        },
    }


def node_types() -> set[str]:
    """Every node type the specs use."""
    return {n["type"] for s in specs().values() for n in s["nodes"]}


# --- the node definitions ------------------------------------------------------------------------

#: Runs in the ComfyUI tree after a line ``TYPES = [...]``: ComfyUI's nodes and the pack through
#: ComfyUI's own loader, then the ``/object_info/{node_class}`` route's answer for each of TYPES.
OBJECT_INFO = r'''
import asyncio, json
import nodes, server
from aiohttp.test_utils import make_mocked_request
loop = asyncio.new_event_loop()
asyncio.set_event_loop(loop)
instance = server.PromptServer(loop)
loop.run_until_complete(nodes.init_extra_nodes(init_custom_nodes=True, init_api_nodes=False))
route = next(r.handler for r in instance.routes
             if getattr(r, "path", None) == "/object_info/{node_class}")
out = {}
for name in TYPES:
    answer = loop.run_until_complete(route(make_mocked_request(
        "GET", f"/object_info/{name}", match_info={"node_class": name})))
    out.update(json.loads(answer.body))
print("OBJECT_INFO " + json.dumps(out))
'''

#: The nodes ComfyUI's frontend defines itself (no ``/object_info`` entry), in that entry's form.
FRONTEND_NODES: dict[str, Definition] = {
    "Note": {
        "input": {"required": {"text": ["STRING", {"multiline": True}]}},
        "input_order": {"required": ["text"]},
        "output": [],
        "output_name": [],
        "display_name": "Note",
    },
}
#: What the frontend's Note adds to its serialization (its yellow); its text box has no slot.
NOTE_EXTRA = {"color": "#432", "bgcolor": "#653"}


def node_definitions(types: set[str]) -> dict[str, Definition]:
    """The ``/object_info`` entry of every node type in ``types`` (:data:`FRONTEND_NODES` for the
    frontend's own)."""
    sys.path.insert(0, str(ROOT))
    from tests import comfy_tree

    asked = sorted(types - set(FRONTEND_NODES))
    done = comfy_tree.run_comfy_script(
        f"TYPES = {asked!r}\n{OBJECT_INFO}", ["--cpu"], timeout_s=300
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("OBJECT_INFO ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(
            f"ComfyUI did not list its node definitions (exit {done.returncode}):\n"
            f"{done.stderr[-3000:]}"
        )
    found = json.loads(line.removeprefix("OBJECT_INFO "))
    missing = [t for t in asked if t not in found]
    if missing:
        raise RuntimeError(f"ComfyUI has no node type {missing}: a spec names an unknown node")
    return {**found, **{t: FRONTEND_NODES[t] for t in types & set(FRONTEND_NODES)}}


# --- one node as the frontend serializes it ------------------------------------------------------

#: Input types the frontend gives a widget (any other type is a socket). The dynamic combo is a
#: combo whose options can carry sub-inputs (an option with none is all this writes).
WIDGET_TYPES = {"INT", "FLOAT", "BOOLEAN", "STRING", "COMBO", "COMFY_DYNAMICCOMBO_V3"}
CONTROL = "control_after_generate"
CONTROL_MODES = ("fixed", "increment", "decrement", "randomize")
# litegraph's layout constants (LiteGraphGlobal, BaseWidget), for a node's initial size
SLOT_H, WIDGET_H, TEXT_SIZE, TITLE_H, MIN_W = 20, 20, 14, 30, 140
WIDGET_PADDING = 42 + 2 * (15 + 6 + 10)  # minValueWidth + 2 x (margin + arrowMargin + arrowWidth)
WIDGET_VALUE_PAD = 60  # the frontend widens a node with widgets by this, to show the values


def _inputs(definition: Definition) -> list[tuple[str, str, dict[str, Any], bool]]:
    """``(name, type, options, optional)`` of every input in ``input_order``: required, then
    optional (a combo's options list goes under ``options``)."""
    out = []
    for part in ("required", "optional"):
        for name in definition.get("input_order", {}).get(part, []):
            entry = definition["input"][part][name]
            opts = dict(entry[1]) if len(entry) > 1 else {}
            kind = entry[0]
            if isinstance(kind, list):
                kind, opts["options"] = "COMBO", kind
            out.append((name, kind, opts, part == "optional"))
    return out


def _is_widget(kind: str, opts: dict[str, Any]) -> bool:
    return kind in WIDGET_TYPES and not opts.get("forceInput")


def _default(where: str, kind: str, opts: dict[str, Any]) -> Any:
    """The value the frontend gives a new widget (None: none, the spec must give one)."""
    if kind == "COMBO" and opts.get("multiselect"):
        raise ValueError(f"{where} is a multi-select combo: teach scripts/example_workflows.py it")
    if kind == "COMFY_DYNAMICCOMBO_V3":
        keys = [o["key"] for o in opts["options"]]
        return opts.get("default", keys[0] if keys else None)
    if kind == "COMBO":
        return opts.get("default", opts["options"][0] if opts["options"] else None)
    return opts.get("default", {"INT": 0, "FLOAT": 0, "BOOLEAN": False, "STRING": ""}[kind])


def _check_value(where: str, kind: str, opts: dict[str, Any], value: Any) -> None:
    """A value the frontend can show as is: set, and for a dynamic combo an option without
    sub-inputs. A plain combo's value is not checked: its options can be the server's model
    files, which the user chooses."""
    if value is None:
        raise ValueError(f"{where} has no default: give it a value in the spec")
    if kind == "COMFY_DYNAMICCOMBO_V3":
        plain = [o["key"] for o in opts["options"] if not any(o["inputs"].values())]
        if value not in plain:
            raise ValueError(f"{where}={value!r}: one of its options without sub-inputs {plain}")


def _control_mode(where: str, kind: str, name: str, opts: dict[str, Any], given: Any) -> Any:
    """The ``control_after_generate`` widget's value after this widget, or None where the frontend
    adds none (an INT gets one where its options ask, or where it is named seed or noise_seed)."""
    control = opts.get(CONTROL)
    if kind != "INT":
        if control:
            raise ValueError(
                f"{where}: {CONTROL} on a {kind}: teach scripts/example_workflows.py it"
            )
        return None
    if control is None:
        control = name in ("seed", "noise_seed")
    if not control:
        return None
    if control is not True and control not in CONTROL_MODES:
        raise ValueError(f"{where}: {CONTROL}={control!r} renames the widget; not written here")
    mode = control if control in CONTROL_MODES else "randomize"
    mode = mode if given is None else given
    if mode not in CONTROL_MODES:
        raise ValueError(f"{where}.{CONTROL}={mode!r}: one of {CONTROL_MODES}")
    return mode


def widget_values(type_: str, definition: Definition, given: dict[str, Any]) -> dict[str, Any]:
    """Widget name -> value in the frontend's widget order: ``given`` (the spec's), else the
    default."""
    values: dict[str, Any] = {}
    for name, kind, opts, _ in _inputs(definition):
        if not _is_widget(kind, opts):
            continue
        where = f"{type_}.{name}"
        value = given[name] if name in given else _default(where, kind, opts)
        _check_value(where, kind, opts, value)
        values[name] = value
        mode = _control_mode(where, kind, name, opts, given.get(CONTROL))
        if mode is not None:
            values[CONTROL] = mode
    unknown = sorted(set(given) - set(values))
    if unknown:
        raise ValueError(f"{type_} has no widget {unknown}; its widgets: {list(values)}")
    return {k: _json_number(v) for k, v in values.items()}


def _json_number(value: Any) -> Any:
    """A number as JavaScript writes it (``5.0`` -> ``5``)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _text_width(text: str) -> float:
    """The frontend's text width where it cannot measure: font size x 0.6 per character."""
    return TEXT_SIZE * len(text) * 0.6


def _size(title: str, sockets: list[dict], outputs: list[dict], widgets: list[str]) -> list[int]:
    """The node's initial size as the frontend's ``computeSize`` and ``setInitialSize`` make it,
    with its unmeasured text widths (the frontend grows a node too small for its content when it
    loads the workflow)."""
    in_w = max((_text_width(s["localized_name"]) for s in sockets), default=0.0)
    out_w = max((_text_width(o["localized_name"]) for o in outputs), default=0.0)
    slots_w = in_w + out_w + 2 * SLOT_H + (5 if in_w and out_w else 0)
    widget_w = max((_text_width(w) + WIDGET_PADDING for w in widgets), default=0.0)
    title_w = TITLE_H + _text_width(title) + TITLE_H * 0.33
    width = max(slots_w, widget_w, title_w, MIN_W * (1.5 if widgets else 1))
    rows = max(len(sockets), len(outputs), 1)
    widgets_h = (WIDGET_H + 4) * len(widgets) + 8 if widgets else 0
    return [math.ceil(width + (WIDGET_VALUE_PAD if widgets else 0)), rows * SLOT_H + widgets_h + 6]


def _slots(definition: Definition, links_in: dict[str, int]) -> tuple[list[dict], list[dict]]:
    """The node's input slots: its sockets (with their links) and its widgets' slots."""
    sockets, widget_slots = [], []
    for name, kind, opts, optional in _inputs(definition):
        slot: dict[str, Any] = {"localized_name": opts.get("display_name", name), "name": name}
        if optional:
            slot["shape"] = 7  # litegraph's hollow circle
        slot["type"] = kind
        if _is_widget(kind, opts):
            slot.update({"widget": {"name": name}, "link": None})
            widget_slots.append(slot)
        else:
            slot["link"] = links_in.get(name)
            sockets.append(slot)
    return sockets, widget_slots


def serialize_node(
    spec: Spec,
    definition: Definition,
    links_in: dict[str, int],
    links_out: dict[int, list[int]],
    order: int,
) -> dict[str, Any]:
    """One node of ``graph.serialize()``: ``links_in`` maps an input socket to its link id,
    ``links_out`` an output slot to its link ids."""
    type_ = spec["type"]
    sockets, widget_slots = _slots(definition, links_in)
    unknown = sorted(set(links_in) - {s["name"] for s in sockets})
    if unknown:
        where = f"{type_} (node {spec['id']})"
        names = [s["name"] for s in sockets]
        raise ValueError(f"{where} has no input socket {unknown}; its sockets: {names}")
    outputs = []
    for i, (kind, name) in enumerate(zip(definition["output"], definition["output_name"])):
        out = {"localized_name": name, "name": name, "type": kind, "links": links_out.get(i)}
        if definition.get("output_is_list", [False] * (i + 1))[i]:
            out["shape"] = 6  # litegraph's grid
        outputs.append(out)
    values = widget_values(type_, definition, spec["widgets"])
    labels = [s["localized_name"] for s in widget_slots] + [k for k in values if k == CONTROL]
    title = spec["title"] or definition["display_name"]
    frontend_only = type_ in FRONTEND_NODES
    node: dict[str, Any] = {
        "id": spec["id"],
        "type": type_,
        "pos": spec["pos"],
        "size": spec["size"] or _size(title, sockets, outputs, labels),
        "flags": {},
        "order": order,
        "mode": 0,
        "inputs": [] if frontend_only else sockets + widget_slots,
        "outputs": outputs,
    }
    if spec["title"]:
        node["title"] = spec["title"]
    node["properties"] = {} if frontend_only else {"Node name for S&R": type_}
    if values:
        node["widgets_values"] = list(values.values())
        node["widgets_values_named"] = values
    if type_ == "Note":
        node.update(NOTE_EXTRA)
    return node


def build(name: str, spec: Spec, definitions: dict[str, Definition]) -> dict[str, Any]:
    """The workflow ``name`` as ``graph.serialize()`` writes it; links are numbered in the spec's
    node order, each node's inputs in the spec's order."""
    by_id = {n["id"]: n for n in spec["nodes"]}
    links: list[list[Any]] = []
    links_in: dict[int, dict[str, int]] = {nid: {} for nid in by_id}
    links_out: dict[int, dict[int, list[int]]] = {nid: {} for nid in by_id}
    for n in spec["nodes"]:
        for input_name, (src, slot) in n["inputs"].items():
            outputs = definitions[by_id[src]["type"]]["output"]
            if slot >= len(outputs):
                raise ValueError(f"{name}: node {src} ({by_id[src]['type']}) has no output {slot}")
            link = len(links) + 1
            links.append([link, src, slot, n["id"], input_name, outputs[slot]])
            links_in[n["id"]][input_name] = link
            links_out[src].setdefault(slot, []).append(link)
    ordered = sorted(spec["nodes"], key=lambda n: n["id"])
    nodes = {
        n["id"]: serialize_node(n, definitions[n["type"]], links_in[n["id"]], links_out[n["id"]], i)
        for i, n in enumerate(ordered)
    }
    for link in links:  # the target slot: the input's index among the node's slots
        target = nodes[link[3]]
        link[4] = next(i for i, s in enumerate(target["inputs"]) if s["name"] == link[4])
        takes = target["inputs"][link[4]]["type"]
        if takes not in (link[5], "*"):
            raise ValueError(
                f"{name}: link {link[0]} gives {link[5]} to {target['type']}."
                f"{target['inputs'][link[4]]['name']}, which takes {takes}"
            )
    return {
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"h3ms-async/example_workflows/{name}")),
        "revision": 0,
        "last_node_id": max(by_id),
        "last_link_id": len(links),
        "nodes": list(nodes.values()),
        "links": links,
        "groups": [],
        "config": {},
        "extra": {"ds": {"scale": 0.9, "offset": [416, 110]}},
        "version": 0.4,
    }


def expected(definitions: dict[str, Definition]) -> dict[str, str]:
    """File name -> content of every example workflow, from :func:`node_definitions`' answer."""
    return {
        f"{name}.json": json.dumps(build(name, spec, definitions), indent=1) + "\n"
        for name, spec in specs().items()
    }


# --- the template cards --------------------------------------------------------------------------

THUMB_CSS = """
body { margin: 0; width: 800px; height: 500px; background: #15171c; color: #e4e6eb;
       font: 13px/1.3 system-ui, sans-serif; display: flex; flex-direction: column; }
h1 { font-size: 26px; margin: 22px 28px 4px; }
.sub { color: #9aa0aa; margin: 0 28px 14px; font-size: 15px; }
.flow { display: flex; gap: 14px; padding: 0 28px; flex: 1; align-items: flex-start; }
.col { display: flex; flex-direction: column; gap: 8px; flex: 1; }
.box { background: #262a33; border: 1px solid #3a3f4a; border-radius: 6px; padding: 7px 8px; }
.box.pack { background: #1d3a5f; border-color: #4e9af1; font-weight: 600; }
.foot { color: #9aa0aa; margin: 0 28px 16px; }
"""


def thumbnail_html(spec: Spec, definitions: dict[str, Definition]) -> str:
    """The template browser's card for ``spec``: its title and its nodes by column under the
    titles the frontend shows, the pack's nodes highlighted (the note left out)."""
    cols: dict[float, list[Spec]] = {}
    for n in sorted(spec["nodes"], key=lambda n: n["pos"][1]):
        if n["type"] not in FRONTEND_NODES:
            cols.setdefault(n["pos"][0], []).append(n)

    def box(n: Spec) -> str:
        title = html.escape(n["title"] or definitions[n["type"]]["display_name"])
        return f'<div class="box{" pack" if n["type"].startswith("H3") else ""}">{title}</div>'

    flow = "".join(
        '<div class="col">' + "".join(box(n) for n in nodes) + "</div>"
        for _, nodes in sorted(cols.items())
    )
    return (
        f"<!DOCTYPE html><html><head><style>{THUMB_CSS}</style></head><body>"
        f"<h1>{html.escape(spec['title'])}</h1>"
        '<div class="sub">MiniMax H3 · text → video with sound</div>'
        f'<div class="flow">{flow}</div>'
        '<div class="foot">H3 MultiStream (async) · example workflow · '
        "blue: the pack's nodes</div>"
        "</body></html>"
    )


def write_thumbnails(definitions: dict[str, Definition]) -> None:
    """``example_workflows/<name>.jpg`` for every spec: its card rendered in Debian's chromium."""
    import shutil

    from PIL import Image
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("--thumbnails needs Debian's chromium: apt-get install -y chromium")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=chromium, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            card = browser.new_page(viewport={"width": 800, "height": 500})
            for name, spec in specs().items():
                card.set_content(thumbnail_html(spec, definitions))
                shot = Image.open(io.BytesIO(card.screenshot()))
                shot.convert("RGB").save(DIR / f"{name}.jpg", quality=88)
                print(f"wrote {DIR / name}.jpg", file=sys.stderr)
        finally:
            browser.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write example_workflows/ from the nodes.")
    parser.add_argument("--thumbnails", action="store_true", help="also render the cards (.jpg)")
    args = parser.parse_args(argv)
    definitions = node_definitions(node_types())
    DIR.mkdir(exist_ok=True)
    for name, text in expected(definitions).items():
        (DIR / name).write_text(text, encoding="utf-8")
        print(f"wrote {DIR / name}", file=sys.stderr)
    if args.thumbnails:
        write_thumbnails(definitions)
    return 0


if __name__ == "__main__":
    sys.exit(main())
