"""The example workflows in a running ComfyUI, through its template route and its real frontend.

A real ``main.py`` (``tests/comfy_tree.py``) with the pack, two CPU ranks and tiny models under the standard H3 file
names the workflows' loaders name (``tests/browser_comfy.write_models_dir``): the H3 DiT at CLIP-L's conditioning
width, a random CLIP-L, and H3's video and audio VAEs built small. ComfyUI runs with ``--use-ck-attention`` as the
Attention Parallel workflow says (on CPU ComfyUI falls back to its other attention and the node runs on the model's
device alone). For each workflow the template route lists, the frontend (Playwright, Debian's chromium) loads the
served file: every node type resolves, no node is marked (every model it names is there), and the frontend
serializes every node back to what the file holds (``scripts/example_workflows.py`` writes what the frontend would);
``app.graphToPrompt()`` gives the prompt the frontend's Run would queue, and its tiny variant (the same nodes, links
and files; a tiny latent, two steps, the text encoder as CLIP-L) runs through ``/prompt`` to a video with sound.
Then every pack node in the shape of its first release (``tests/node_history.py``) validates and runs.
"""
from __future__ import annotations

import json

import pytest

from tests import comfy_tree
from tests.browser_comfy import TESTS_ENV, comfy_server, write_models_dir
from tests.example_workflows import DIR, specs, tiny_variant
from tests.node_history import FIRST_RELEASE
from tests.test_browser_comfy import CHROMIUM, OUT, sync_playwright

pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(600),
    pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed: apt-get install -y chromium"),
    pytest.mark.skipif(sync_playwright is None, reason="playwright is not installed: run `bash scripts/h3ms.sh test`"),
    pytest.mark.skipif(comfy_tree.skip_reason() is not None, reason=str(comfy_tree.skip_reason())),
]

PACK = comfy_tree.PACK_NAME  # the pack's folder in custom_nodes/: the template browser's group
CLIP_L_TEXT_DIM = 768
ATTENTION = "h3_attention_parallel.json"
#: Loads a served template in the page: unresolved node types, then the graph, the frontend's serialization of its
#: nodes and the prompt Run would queue.
LOAD_JS = """async ([pack, name]) => {
  const app = window.app, LG = window.LiteGraph;
  const resp = await fetch(`/api/workflow_templates/${pack}/${name}.json`);
  if (!resp.ok) throw new Error(`template ${name}: ${resp.status}`);
  const wf = await resp.json();
  const missing = wf.nodes.map((n) => n.type).filter((t) => !LG.registered_node_types[t]);
  await app.loadGraphData(wf, true, true, name);
  const loaded = app.graph._nodes.map((n) => [n.id, n.type, n.has_errors === true]);
  const serialized = app.graph.serialize().nodes;
  const { output } = await app.graphToPrompt();
  return JSON.stringify({ missing, loaded, serialized, output, saved: wf.nodes });
}"""
#: What the frontend's serialization of a loaded node keeps from the file (its position and size it may move: it
#: grows a node to fit its content, and numbers the execution order itself).
KEPT = ("type", "title", "mode", "flags", "inputs", "outputs", "properties", "widgets_values", "widgets_values_named",
        "color", "bgcolor")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """The extra-model-paths YAML of the tiny models under the workflows' file names."""
    cfg = write_models_dir(tmp_path_factory.mktemp("models"), text_dim=CLIP_L_TEXT_DIM)
    OUT.mkdir(parents=True, exist_ok=True)
    return cfg


@pytest.fixture
def comfy(tmp_path, tiny_models):
    """ComfyUI as a user of H3 MultiStream runs it (PyTorch attention), two CPU ranks."""
    with comfy_server(tmp_path, tiny_models, {"H3MS_RANK_MAP": "cpu,cpu", **TESTS_ENV},
                      OUT / "comfyui_workflows.log") as server:
        yield server


@pytest.fixture
def comfy_ck(tmp_path, tiny_models):
    """ComfyUI with ``--use-ck-attention``, as the Attention Parallel workflow says (kitchen's INT8 attention on the
    CPU through the pack's stand-in, ``tests/comfy_tree.py``: ComfyUI exits without one)."""
    env = {**TESTS_ENV, "H3MS_PACK": str(comfy_tree.ROOT), "H3MS_TEST_HOOKS": "1", "H3MS_CK_ATTENTION_CPU": "1"}
    with comfy_server(tmp_path, tiny_models, env, OUT / "comfyui_workflows_ck.log", ("--use-ck-attention",),
                      comfy_tree.CK_CPU_HOOK) as server:
        yield server


def frontend_prompts(server, names: list[str]) -> dict[str, dict]:
    """Load each template the server lists in ComfyUI's frontend: every node type resolves and loads without
    errors; returns the prompt ``app.graphToPrompt()`` makes of each (what the frontend's Run queues)."""
    listed = server.get("/api/workflow_templates")
    assert set(names) <= set(listed.get(PACK, [])), listed
    prompts = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(90_000)
            page.goto(server.url)
            page.wait_for_function("window.app && window.app.graph && window.LiteGraph")
            for name in names:
                got = json.loads(page.evaluate(LOAD_JS, [PACK, name]))
                assert got["missing"] == [], f"{name}: node types the frontend does not know: {got['missing']}"
                saved = [[str(n["id"]), n["type"]] for n in got["saved"]]
                assert sorted(saved) == sorted([str(i), t] for i, t, _ in got["loaded"]), got["loaded"]
                # the loaders name the standard H3 files, which this server has: the frontend marks no node
                assert [t for _, t, err in got["loaded"] if err] == [], got["loaded"]
                by_id = {str(n["id"]): n for n in got["serialized"]}
                for node in got["saved"]:
                    back = by_id[str(node["id"])]
                    diff = [k for k in KEPT if node.get(k) != back.get(k)]
                    assert not diff, (f"{name}: the frontend serializes node {node['id']} ({node['type']}) "
                                      f"otherwise in {diff}: "
                                      f"{json.dumps({k: [node.get(k), back.get(k)] for k in diff})[:3000]}")
                # every node but the note is in the prompt
                assert sorted(int(k) for k in got["output"]) == sorted(
                    n["id"] for n in got["saved"] if n["type"] != "Note")
                prompts[name] = got["output"]
        finally:
            browser.close()
    return prompts


def old_format(prompt: dict) -> dict:
    """``prompt`` with each pack node reduced to the inputs of its first release (a workflow saved back then)."""
    out = json.loads(json.dumps(prompt))
    for node in out.values():
        if node["class_type"] in FIRST_RELEASE:
            node["inputs"] = {k: v for k, v in node["inputs"].items() if k in FIRST_RELEASE[node["class_type"]]}
    return out


def run(server, prompt: dict, what: str) -> dict:
    """Queue ``prompt``; its history entry once it succeeded."""
    done = server.wait_done(server.queue(prompt, "h3ms-workflow-test"), 300)
    assert done["status"]["status_str"] == "success", f"{what}: {json.dumps(done['status'])[:3000]}\n" \
                                                      f"{server.log_tail()}"
    return done


def run_workflows(server, prompts: dict[str, dict]) -> None:
    """Each prompt's tiny variant runs to a saved video; then the same with every pack node reduced to its
    first-release inputs (a workflow saved back then) validates and runs."""
    for name, prompt in prompts.items():
        done = run(server, tiny_variant(prompt), name)
        assert any(o.get("images") or o.get("videos") or o.get("animated") for o in done["outputs"].values()), \
            f"{name}: no video saved: {done['outputs']}"
    for name, prompt in prompts.items():
        run(server, old_format(tiny_variant(prompt)), f"{name} (first-release inputs)")


def test_every_workflow_has_a_thumbnail_and_is_listed():
    names = sorted(specs())
    assert sorted(p.stem for p in DIR.glob("*.json")) == names
    assert all((DIR / f"{n}.jpg").stat().st_size > 10_000 for n in names), "a thumbnail per workflow"
    note = next(n for n in json.loads((DIR / ATTENTION).read_text())["nodes"] if n["type"] == "Note")
    assert "--use-ck-attention" in note["widgets_values"][0], "the Attention Parallel workflow names the flag"


def test_multistream_workflows_load_in_the_frontend_and_run(comfy):
    names = sorted(n for n in specs() if f"{n}.json" != ATTENTION)
    prompts = frontend_prompts(comfy, names)
    run_workflows(comfy, prompts)
    # Release Resources as saved before it grew: release_vae_workers' default (true) applies
    release = {"1": {"class_type": "H3MSReleaseResourcesAsync", "inputs": {
        "release_workers": True, "clear_weight_store": True, "detach_hooks": True}}}
    assert set(release["1"]["inputs"]) == set(FIRST_RELEASE["H3MSReleaseResourcesAsync"])
    text = json.dumps(run(comfy, release, "Release Resources (first-release inputs)")["outputs"])
    assert "VAE workers" in text, text
    covered = {n["class_type"] for p in prompts.values() for n in p.values()} | {"H3MSReleaseResourcesAsync"}
    # Attention Parallel has its own workflow; the sparse settings node is in none (dense is the default)
    assert set(FIRST_RELEASE) - covered == {"H3AttentionParallelAsync", "H3MSSparseAttentionAsync"}, covered


def test_attention_parallel_workflow_loads_in_the_frontend_and_runs(comfy_ck):
    prompts = frontend_prompts(comfy_ck, [ATTENTION.removesuffix(".json")])
    assert any(n["class_type"] == "H3AttentionParallelAsync" for p in prompts.values() for n in p.values())
    run_workflows(comfy_ck, prompts)
