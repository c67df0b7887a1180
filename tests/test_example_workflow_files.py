"""The committed example workflows (``example_workflows/*.json``) are what
``scripts/example_workflows.py`` writes from the node definitions (ComfyUI's ``/object_info`` in the
real ComfyUI tree, the pack loaded by ComfyUI's own loader): a node that gains, loses or reorders an
input fails here until the workflows are regenerated. The generator refuses a spec that names a
widget or a socket its node does not have.
"""

from __future__ import annotations

import json

import pytest

from tests import comfy_tree
from tests.example_workflows import DIR, generator

pytestmark = pytest.mark.skipif(
    comfy_tree.skip_reason() is not None, reason=str(comfy_tree.skip_reason())
)

REGENERATE = "run `python scripts/example_workflows.py` and commit example_workflows/"


@pytest.fixture(scope="module")
def definitions() -> dict:
    return generator.node_definitions(generator.node_types())


def _stale_nodes(saved: dict, want: dict) -> list[str]:
    """Per node that differs: its id, type and what differs (by widget name where widgets do)."""
    found = []
    saved_nodes = {n["id"]: n for n in saved["nodes"]}
    for node in want["nodes"]:
        old = saved_nodes.get(node["id"], {})
        keys = [k for k in node if k not in ("size", "order") and old.get(k) != node[k]]
        if not keys:
            continue
        named = set(node.get("widgets_values_named", {}))
        old_named = set(old.get("widgets_values_named", {}))
        widgets = ""
        if named != old_named:
            widgets = (
                f" (widgets missing {sorted(named - old_named)}, extra {sorted(old_named - named)})"
            )
        found.append(f"node {node['id']} {node['type']}: {keys}{widgets}")
    return found


def test_committed_workflows_are_what_the_generator_writes(definitions):
    want = generator.expected(definitions)
    assert sorted(p.name for p in DIR.glob("*.json")) == sorted(want), REGENERATE
    for name, text in want.items():
        saved = (DIR / name).read_text(encoding="utf-8")
        if saved != text:
            stale = _stale_nodes(json.loads(saved), json.loads(text)) or ["its layout or links"]
            pytest.fail(f"example_workflows/{name} is stale: {'; '.join(stale)}. {REGENERATE}")


def test_a_spec_naming_what_its_node_lacks_is_refused(definitions):
    spec = generator.specs()["h3_attention_parallel"]
    node = next(n for n in spec["nodes"] if n["type"] == "H3AttentionParallelAsync")
    node["widgets"]["device"] = "auto"  # the widget is devices
    refused = r"H3AttentionParallelAsync has no widget \['device'\]; its widgets: \['devices', "
    with pytest.raises(ValueError, match=refused):
        generator.build("h3_attention_parallel", spec, definitions)
    del node["widgets"]["device"]
    node["inputs"]["gpu"] = (1, 0)  # the socket is gpus
    refused = r"\(node 20\) has no input socket \['gpu'\]; its sockets: \['model', "
    with pytest.raises(ValueError, match=refused):
        generator.build("h3_attention_parallel", spec, definitions)
