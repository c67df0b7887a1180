"""The pack's example workflows (``example_workflows/*.json``, ComfyUI's template browser) for the
tests: their generator, ``scripts/example_workflows.py`` (the specs and the standard H3 file names
the loaders name), and the tiny CPU variant of a workflow's prompt.

``tests/test_example_workflow_files.py`` checks that the committed files are what the generator
writes; ``tests/test_example_workflows.py`` loads them through ComfyUI's template route in the real
frontend and queues :func:`tiny_variant` of each.
"""

from __future__ import annotations

import importlib.util
import json
from types import ModuleType

from tests import comfy_tree


def _generator() -> ModuleType:
    """``scripts/example_workflows.py`` as a module (``scripts/`` is no package)."""
    path = comfy_tree.ROOT / "scripts" / "example_workflows.py"
    spec = importlib.util.spec_from_file_location("h3ms_example_workflows", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generator = _generator()
DIR = generator.DIR
DIT_FILE, TEXT_ENCODER_FILE = generator.DIT_FILE, generator.TEXT_ENCODER_FILE
VIDEO_VAE_FILE, AUDIO_VAE_FILE = generator.VIDEO_VAE_FILE, generator.AUDIO_VAE_FILE
specs = generator.specs

TINY_LATENT = {"width": 64, "height": 64, "length": 5}
TINY_STEPS = 2


def tiny_variant(prompt: dict) -> dict:
    """An API prompt (``app.graphToPrompt()`` of a saved workflow) with a tiny latent, two steps
    and its text encoder loaded as CLIP-L (``stable_diffusion``): the same nodes, links and model
    files (the tests' server holds tiny models under the standard names,
    ``tests/browser_comfy.write_models_dir``). H3's own text encoder type (Qwen3-VL-32B) has a
    fixed geometry far too big for a test."""
    out = json.loads(json.dumps(prompt))
    for node in out.values():
        inputs, kind = node["inputs"], node["class_type"]
        if kind == "CLIPLoader":
            inputs["type"] = "stable_diffusion"
        elif kind == "EmptyMiniMaxH3LatentAV":
            inputs.update(TINY_LATENT)
        elif kind == "KSampler":
            inputs["steps"] = TINY_STEPS
    return out
