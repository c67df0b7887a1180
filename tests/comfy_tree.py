"""The real ComfyUI tree the pack is tested in.

The archive in ``../shared/comfyui`` (a real ComfyUI source tree with native MiniMax H3) is unpacked once into the
git-ignored ``.comfyui/`` of the checkout; the pack is linked into its ``custom_nodes/``. ComfyUI keeps process-wide
state (parsed command-line flags, the selected attention function, the model patcher class), so every configuration
runs in a fresh Python process started here: :func:`run_comfy_script` for in-process use of ComfyUI's own functions,
:func:`main_py_command` for a real ComfyUI server.

The placeholder ``shims/`` (torchvision, torchaudio: ComfyUI imports them for other model families only) go LAST on
``sys.path``, so a real package wins where installed.
"""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("H3MS_SHARED") or ROOT.parent / "shared")
COMFY_ROOT = Path(os.environ.get("H3MS_COMFY_ROOT", ROOT / ".comfyui"))
PACK_NAME = "h3_multistream_async"


def _archive() -> Path | None:
    if os.environ.get("H3MS_COMFY_ARCHIVE"):  # the GPU machine: the archive travels inside the checkout
        return Path(os.environ["H3MS_COMFY_ARCHIVE"])
    found = sorted((SHARED / "comfyui").glob("ComfyUI-*.tar.xz"))
    return found[0] if found else None


def shim_dirs() -> list[str]:
    """The folders of placeholder packages that go last on ``sys.path`` (``H3MS_EXTRA_SHIMS`` adds one: the GPU
    machine lacks PyAV, whose wheel is too big to carry)."""
    dirs = [str(SHARED / "comfyui" / "shims")]
    if os.environ.get("H3MS_EXTRA_SHIMS"):
        dirs.append(os.environ["H3MS_EXTRA_SHIMS"])
    return dirs


def skip_reason() -> str | None:
    """Why the real-ComfyUI tests cannot run here, or None when they can (the tree is unpacked on demand)."""
    if not (COMFY_ROOT / "main.py").is_file() and _archive() is None:
        return (f"no real ComfyUI: neither {COMFY_ROOT}/main.py nor {SHARED}/comfyui/ComfyUI-*.tar.xz exists "
                "(set H3MS_SHARED to the shared/ folder or H3MS_COMFY_ROOT to a ComfyUI checkout)")
    for mod in ("torchsde", "transformers", "sqlalchemy", "comfy_kitchen"):
        try:
            __import__(mod)
        except ImportError:
            return f"ComfyUI's requirement {mod!r} is not installed; run the tests through `bash scripts/h3ms.sh test`"
    return None


def ensure_tree() -> Path:
    """Unpack the archive (once, under a lock) and link the pack into ``custom_nodes/``; returns the tree's root."""
    COMFY_ROOT.mkdir(parents=True, exist_ok=True)
    with open(COMFY_ROOT.parent / ".comfyui.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (COMFY_ROOT / "main.py").is_file():
            archive = _archive()
            if archive is None:
                raise RuntimeError(skip_reason() or "no ComfyUI archive")
            with tarfile.open(archive) as tar:
                tar.extractall(COMFY_ROOT, filter="data")
        link = COMFY_ROOT / "custom_nodes" / PACK_NAME
        if not link.is_symlink() or link.resolve() != ROOT:
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(ROOT, target_is_directory=True)
    return COMFY_ROOT


_PRELUDE = """\
import sys
sys.path.insert(0, {root!r})
sys.path.extend({shims!r})
sys.argv = ["main.py"] + {argv!r}
"""


#: Code that installs the pack's CPU stand-in for kitchen's INT8 attention
#: (``workers/testing/ck_cpu.py``) before
#: ComfyUI's attention module asks kitchen whether it is available (``--use-ck-attention`` on a CPU); needs
#: ``H3MS_PACK`` (the pack root) in the environment.
CK_CPU_HOOK = r'''
import importlib.util, os
spec = importlib.util.spec_from_file_location(
    "h3ms_ck_cpu_hook", os.path.join(os.environ["H3MS_PACK"], "workers", "testing", "ck_cpu.py"))
hook = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hook)
hook.install()  # before ComfyUI's attention module asks kitchen whether INT8 attention is available
'''


def main_py_command(comfy_args: list[str], prelude: str = "") -> list[str]:
    """The command that starts ComfyUI's ``main.py`` with ``comfy_args``, shims last on ``sys.path`` (cwd: the
    tree's root), after ``prelude`` (code run first, e.g. :data:`CK_CPU_HOOK`)."""
    root = ensure_tree()
    code = _PRELUDE.format(root=str(root), shims=shim_dirs(), argv=list(comfy_args)) + prelude + (
        "import runpy\nrunpy.run_path('main.py', run_name='__main__')\n")
    return [sys.executable, "-c", code]


def run_comfy_script(body: str, comfy_args: list[str], env: dict[str, str] | None = None,
                     timeout_s: float = 600) -> subprocess.CompletedProcess:
    """Run ``body`` in a fresh Python process inside the tree, after ComfyUI's flags are parsed from ``comfy_args``
    (as ``main.py`` would get them). ``body`` imports what it needs (``comfy.*``, ``nodes``, ``execution``)."""
    root = ensure_tree()
    code = _PRELUDE.format(root=str(root), shims=shim_dirs(), argv=list(comfy_args)) + (
        "import comfy.options\ncomfy.options.enable_args_parsing()\n") + body
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=full_env, capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)


#: The start of a benchmark script for :func:`run_comfy_result` (``str.format`` fields: ``tests``, this folder):
#: ComfyUI started as ``main.py`` starts (``import main``: DynamicVRAM on where CUDA is), its loader run on the pack
#: (``comfy_h3.start``), ``N`` its node mappings.
BENCH_PRELUDE = r'''
import gc, json, os, sys, time, torch
sys.path.insert(0, {tests!r})
import main  # noqa: F401
import comfy_h3, nodes
comfy_h3.start()
N = nodes.NODE_CLASS_MAPPINGS
'''


def run_comfy_result(body: str, comfy_args: list[str], log_path: str, timeout_s: float) -> dict | None:
    """:func:`run_comfy_script` for a benchmark: ComfyUI without its frontend package (not on the GPU machine), the
    process's output kept at ``log_path``, and the dict ``body`` printed on its ``RESULT <json>`` line (None, with
    the error tail on stderr, when it failed)."""
    import json
    import tempfile
    with tempfile.TemporaryDirectory() as web_root:
        r = run_comfy_script(body, [*comfy_args, "--front-end-root", web_root], timeout_s=timeout_s)
    with open(log_path, "w") as fh:
        fh.write(r.stdout + "\n" + r.stderr)
    found = [json.loads(x[7:]) for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode != 0 or not found:
        print(f"ComfyUI run failed (rc {r.returncode}):\n{r.stderr[-4000:]}", file=sys.stderr)
        return None
    return found[0]
