"""A real ComfyUI server with the pack, for the browser tests: tiny models under the example workflows' file names,
the API workflows, the server.

The DiT checkpoint carries MiniMax H3's real key names at a tiny width, so ComfyUI's own ``model_detection`` builds
its ``MiniMaxH3Model`` from it through ``UNETLoader``. Its default text width is the one of the conditioning
``LotusConditioning`` outputs (a real ComfyUI node with no inputs: [1, 2, 1024]), so a workflow gets conditioning
without a text encoder. The text encoder is a random CLIP-L; the video and audio VAEs are H3's, built small
(``tests/small_h3_vae.py``: a test-only custom node shrinks ComfyUI's constructors' size defaults in the server, so
``VAELoader`` builds them from the small files). Each sits under the standard H3 file name the example workflows'
loaders name, so a workflow loaded in the frontend finds every model it names.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

from tests import comfy_tree
from tests.comfy_tree import main_py_command
from tests.example_workflows import AUDIO_VAE_FILE, DIT_FILE, TEXT_ENCODER_FILE, VIDEO_VAE_FILE

TEXT_DIM = 1024  # LotusConditioning's width
HIDDEN, HEADS, HEAD_DIM, FFN, T_IN, T_HID, T_DIM, ROPE = 64, 2, 32, 96, 32, 64, 64, 4
VIDEO_PATCH, AUDIO_DIM = 24 * 4, 32  # latent channels x patch 1x2x2; audio latent channels (fixed by the family)


def tiny_h3_state_dict(layers: int, seed: int = 0, text_dim: int = TEXT_DIM) -> dict:
    """Random fp32 weights under H3's key names: ``layers`` DiT blocks, one token-refiner block; ``text_dim``: the
    width of the conditioning it takes."""
    import torch
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, one: bool = False) -> torch.Tensor:
        t = torch.randn(*shape, generator=g) * 0.08
        return t + 1 if one else t

    def block(prefix: str, adaln: bool) -> dict:
        sd = {"norm1.weight": w(HIDDEN, one=True), "norm2.weight": w(HIDDEN, one=True),
              "attn.qkv_proj.weight": w(3 * HEADS * HEAD_DIM, HIDDEN),
              "attn.q_norm.weight": w(HEAD_DIM, one=True), "attn.k_norm.weight": w(HEAD_DIM, one=True),
              "attn.out_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
              "mlp.fc1.weight": w(2 * FFN, HIDDEN), "mlp.fc2.weight": w(HIDDEN, FFN)}
        if adaln:  # 6 modulations x 3 modalities
            sd |= {"adaln_proj.linear.weight": w(18 * HIDDEN, T_DIM), "adaln_proj.linear.bias": w(18 * HIDDEN)}
        return {prefix + k: v for k, v in sd.items()}

    sd = {"video_patch_proj.weight": w(HIDDEN, VIDEO_PATCH), "video_patch_proj.bias": w(HIDDEN),
          "audio_patch_proj.weight": w(HIDDEN, AUDIO_DIM), "audio_patch_proj.bias": w(HIDDEN),
          "condition_proj.weight": w(HIDDEN, text_dim), "condition_proj.bias": w(HIDDEN),
          "time_embedder.proj_in.weight": w(T_HID, T_IN), "time_embedder.proj_in.bias": w(T_HID),
          "time_embedder.proj_out.weight": w(T_DIM, T_HID), "time_embedder.proj_out.bias": w(T_DIM),
          "rope.inv_freq": 1.0 / (100.0 ** (torch.arange(ROPE, dtype=torch.float32) / ROPE)),
          "token_refiner.final_norm.weight": w(HIDDEN, one=True),
          "final_layer.norm.weight": w(HIDDEN, one=True),
          "final_layer.adaln_proj.linear.weight": w(2 * HIDDEN, T_DIM),
          "final_layer.adaln_proj.linear.bias": w(2 * HIDDEN),
          "final_layer.video_out.weight": w(VIDEO_PATCH, HIDDEN), "final_layer.video_out.bias": w(VIDEO_PATCH),
          "final_layer.audio_out.weight": w(AUDIO_DIM, HIDDEN), "final_layer.audio_out.bias": w(AUDIO_DIM)}
    sd |= block("token_refiner.blocks.0.", adaln=False)
    for i in range(layers):
        sd |= block(f"blocks.{i}.", adaln=True)
    return sd


#: The tests folder, for the script and the custom node that import the small models from it: the server of
#: :func:`write_models_dir`'s folder needs it in its environment.
TESTS_ENV = {"H3MS_TESTS_DIR": str(Path(__file__).parent)}

#: Writes the text encoder and the VAEs inside the tree (their classes are ComfyUI's).
MAKE_FILES = r'''
import os, sys, torch, safetensors.torch
sys.path.insert(0, os.environ["H3MS_TESTS_DIR"])
from small_h3_vae import small_h3_audio_vae_state_dict, small_h3_vae_state_dict
import comfy.sd1_clip
out = os.environ["MODELS"]
names = dict(item.split("=") for item in os.environ["NAMES"].split(","))
safetensors.torch.save_file(small_h3_vae_state_dict(), f"{out}/vae/{names['video']}")
safetensors.torch.save_file(small_h3_audio_vae_state_dict(), f"{out}/vae/{names['audio']}")
with torch.device("meta"):  # CLIP-L at its real geometry (the shapes only), random fp16 weights
    shapes = comfy.sd1_clip.SDClipModel(device="meta", dtype=torch.float16).transformer.state_dict()
g = torch.Generator().manual_seed(3)
sd = {k: (torch.randn(t.shape, generator=g) * 0.02 + (1.0 if k.endswith("norm1.weight") or k.endswith(
      "norm2.weight") or k.endswith("final_layer_norm.weight") else 0.0)).to(torch.float16)
      for k, t in shapes.items() if t.is_floating_point()}
safetensors.torch.save_file(sd, f"{out}/text_encoders/{names['clip']}")
'''

#: A test-only custom node: shrink the H3 VAE classes before any VAELoader runs in this server.
SHRINK_NODE = '''import os, sys
sys.path.insert(0, os.environ["H3MS_TESTS_DIR"])
from small_h3_vae import shrink_h3_vae_classes
shrink_h3_vae_classes()
NODE_CLASS_MAPPINGS = {}
'''


def write_models_dir(root: Path, layers: int = 2, text_dim: int = TEXT_DIM) -> Path:
    """The tiny models under the standard H3 file names in ``root`` (``diffusion_models/``, ``text_encoders/``,
    ``vae/``), the VAE-shrinking custom node (``custom_nodes/``) and an extra-model-paths YAML naming the folders;
    returns the YAML's path (its server needs :data:`TESTS_ENV`). ``text_dim``: the DiT's conditioning width."""
    import safetensors.torch
    for sub in ("diffusion_models", "vae", "text_encoders", "custom_nodes/h3ms_tiny_vaes"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tiny_h3_state_dict(layers, text_dim=text_dim),
                                str(root / "diffusion_models" / DIT_FILE))
    (root / "custom_nodes" / "h3ms_tiny_vaes" / "__init__.py").write_text(SHRINK_NODE)
    names = {"video": VIDEO_VAE_FILE, "audio": AUDIO_VAE_FILE, "clip": TEXT_ENCODER_FILE}
    made = comfy_tree.run_comfy_script(MAKE_FILES, ["--cpu"], env={
        **TESTS_ENV, "MODELS": str(root), "NAMES": ",".join(f"{k}={v}" for k, v in names.items())}, timeout_s=300)
    assert made.returncode == 0, made.stderr[-3000:]
    cfg = root / "extra_model_paths.yaml"
    cfg.write_text(f"h3ms_browser_test:\n  base_path: {root}\n  diffusion_models: diffusion_models\n"
                   "  vae: vae\n  text_encoders: text_encoders\n  custom_nodes: custom_nodes\n")
    return cfg


def sample_workflow(steps: int, seed: int, *, width: int = 256, height: int = 256, length: int = 22) -> dict:
    """API workflow: UNETLoader -> H3 MS GPU Set -> H3 MultiStream -> KSampler on an empty H3 AV latent."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": DIT_FILE, "weight_dtype": "default"}},
        "2": {"class_type": "H3MSGPUSetAsync", "inputs": {"gpus": "auto", "exclude": "", "shares": "",
                                                          "min_free_vram_gb": 0.0, "max_gpus": 2}},
        "3": {"class_type": "H3MultiStreamAsync", "inputs": {
            "model": ["1", 0], "gpus": ["2", 0], "enabled": True, "second_gpu": -1, "exchange": "host",
            "exchange_chunks": 0, "weight_cache": True, "cache_ram_reserve_gb": 0.0, "vram_residency": "auto"}},
        "4": {"class_type": "LotusConditioning", "inputs": {}},
        "5": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": width, "height": height,
                                                                 "length": length}},
        "6": {"class_type": "KSampler", "inputs": {
            "model": ["3", 0], "positive": ["4", 0], "negative": ["4", 0], "latent_image": ["5", 0],
            "seed": seed, "steps": steps, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
            "denoise": 1.0}},
        "7": {"class_type": "PreviewAny", "inputs": {"source": ["6", 0]}},
    }


def release_workflow() -> dict:
    """API workflow: H3 MS Release Resources alone (an output node)."""
    return {"1": {"class_type": "H3MSReleaseResourcesAsync", "inputs": {
        "release_workers": True, "clear_weight_store": True, "detach_hooks": False,
        "release_vae_workers": True, "clear_text_cache": False}}}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    """``main.py`` in its own process group, with its log in a file; :meth:`stop` ends it and its workers."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path, cwd: Path, prelude: str = ""):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        # PyTorch's attention unless ``args`` choose another (ComfyUI takes one attention flag)
        attention = [] if any(a.startswith("--use-") and a.endswith("-attention") for a in args) else [
            "--use-pytorch-cross-attention"]
        full = ["--cpu", *attention, "--disable-api-nodes", "--listen", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(main_py_command(full, prelude), cwd=cwd, env={**os.environ, **env},
                                     stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    def log_tail(self, n: int = 60) -> str:
        """The last ``n`` lines of ComfyUI's output (for failure messages)."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until the pack's status route answers (ComfyUI has loaded the pack and serves)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"ComfyUI exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                self.get("/h3multistream/status", timeout=2)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.3)
        raise AssertionError(f"ComfyUI did not answer within {timeout_s:g} s:\n{self.log_tail()}")

    def request(self, path: str, body: Any = None, timeout: float = 10) -> Any:
        """GET ``path`` (``body`` None) or POST ``body`` as JSON; returns the decoded JSON answer."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"null")

    def get(self, path: str, timeout: float = 10) -> Any:
        """GET ``path``; the decoded JSON answer."""
        return self.request(path, timeout=timeout)

    def queue(self, workflow: dict, client_id: str) -> str:
        """``POST /prompt`` for the websocket client ``client_id`` (it gets the prompt's progress and errors);
        returns the prompt id (a refused workflow fails with ComfyUI's node errors)."""
        try:
            return self.request("/prompt", {"prompt": workflow, "client_id": client_id})["prompt_id"]
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"ComfyUI refused the workflow: {exc.read().decode()[:2000]}") from None

    def wait_done(self, prompt_id: str, timeout_s: float) -> dict:
        """The prompt's history entry once it finished (successfully or not)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None and (
                    entry["status"]["completed"] or entry["status"].get("status_str") == "error"):
                return entry
            time.sleep(0.25)
        raise AssertionError(f"prompt {prompt_id} did not finish within {timeout_s:g} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 20) -> None:
        """SIGINT (ComfyUI's Ctrl-C: atexit releases the workers), then SIGKILL to the whole group if it lingers."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


@contextlib.contextmanager
def comfy_server(tmp_path: Path, models_cfg: Path, env: dict[str, str], log_path: Path,
                 args: tuple[str, ...] = (), prelude: str = "") -> Iterator[ComfyServer]:
    """A real ComfyUI ``main.py`` with the pack (``models_cfg``: its extra-model-paths YAML; ``prelude``: code run
    before ``main.py``), in a private user dir (no first-run template browser over the canvas), output dir and
    run-dir base; on exit it stops, and no worker process, shm segment or run dir of it may be left."""
    import psutil
    root = comfy_tree.ensure_tree()
    user = tmp_path / "user" / "default"
    user.mkdir(parents=True)
    (user / "comfy.settings.json").write_text(json.dumps({"Comfy.TutorialCompleted": True}))
    run_base = tmp_path / "run"
    run_base.mkdir()
    server = ComfyServer(
        ["--extra-model-paths-config", str(models_cfg), "--user-directory", str(tmp_path / "user"),
         "--output-directory", str(tmp_path / "output"), "--temp-directory", str(tmp_path / "temp"), *args],
        {"H3MS_RUN_DIR": str(run_base), **env}, log_path, root, prelude)
    children: list = []
    try:
        server.wait_ready(120)
        yield server
    finally:
        if server.proc.poll() is None:
            children = psutil.Process(server.proc.pid).children(recursive=True)
        server.stop()
    log = server.log_tail(40)
    left = [p.pid for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for pid in left:  # fail, but leave nothing running
        os.kill(pid, signal.SIGKILL)
    assert not left, f"worker processes left behind: {left}\n{log}"
    assert not list(run_base.iterdir()), f"run dirs left behind: {list(run_base.iterdir())}\n{log}"
