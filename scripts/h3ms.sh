#!/usr/bin/env bash
# One entry point for a fresh Linux machine: sets up .venv (once) and runs the demo, the tests or a benchmark.
#   bash scripts/h3ms.sh demo [demo options]     the standalone demo (unsplit vs split across 3 CPU ranks)
#   bash scripts/h3ms.sh test                    CI: lint (ruff check, ruff format --check, mypy), the test
#                                                suite, then its exactness tests under AVX2 code paths
#   bash scripts/h3ms.sh test --fast [pytest opts] the fast tier: pure-function and in-process tests
#   bash scripts/h3ms.sh test [pytest options]   pytest with these options (one pass, no lint)
#   bash scripts/h3ms.sh lint                    only the lint step (settings: pyproject.toml)
#   bash scripts/h3ms.sh exactness [pytest opts] only the second pass: the exactness tests under AVX2 code paths
#   bash scripts/h3ms.sh bench ipc|split|exchange|gpu|attention
# Environment: H3MS_VENV (default .venv), H3MS_TORCH_SPEC (default torch==2.13.0), H3MS_PYTHON (default python3).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${H3MS_VENV:-$root/.venv}"
py="${H3MS_PYTHON:-python3}"
torch_spec="${H3MS_TORCH_SPEC:-torch==2.13.0}"
stamp="$venv/.h3ms-installed"
# lint tools, pinned: a new ruff or mypy release must not fail CI on unchanged code
lint_tools=("ruff==0.17.6" "mypy==2.4.1" "types-psutil==7.2.2.20261122" "types-tqdm==4.70.0.20261106")
want="$(cat requirements.txt pyproject.toml | sha256sum | cut -c1-16) $torch_spec ${lint_tools[*]}"

if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # torch first and pinned: an unpinned torch would pull a multi-GB CUDA build onto a CPU-only machine.
  "$venv/bin/python" -m pip install -q "$torch_spec"
  # ComfyUI's own packages, which requirements.txt (what a ComfyUI install adds) must not list
  "$venv/bin/python" -m pip install -q "comfy-kitchen>=0.2.36" "comfy-aimdo>=0.5.5"
  # the test tools (import-linter: tests/test_repo_map.py), the bench's msgpack: pyproject's test, bench extras
  "$venv/bin/python" -m pip install -q -r requirements.txt \
      "pytest>=8" "hypothesis>=6.100" "pytest-aiohttp>=1.0" "pytest-timeout>=2.3" "pytest-xdist>=3.6" "msgpack>=1.0" \
      "import-linter>=2.1" "${lint_tools[@]}"
  echo "$want" > "$stamp"
fi

# The tests run the pack inside a real ComfyUI tree (the archive in ../shared/comfyui, unpacked into the git-ignored
# .comfyui/) and drive ComfyUI's real frontend in a browser: they need ComfyUI's own requirements too.
comfy_archive="$(ls "${H3MS_SHARED:-$root/../shared}"/comfyui/ComfyUI-*.tar.xz 2>/dev/null | head -n 1 || true)"
comfy_stamp="$venv/.h3ms-comfy-installed"
comfy_want="$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)"
setup_comfy() {
  if [ "$(cat "$comfy_stamp" 2>/dev/null)" != "$comfy_want" ]; then
    "$venv/bin/python" -m pip install -q torchsde einops "transformers>=4.50.3" tokenizers sentencepiece \
        safetensors scipy pyyaml Pillow tqdm psutil "av>=16" alembic "SQLAlchemy>=2" filelock requests simpleeval \
        blake3 aiohttp yarl "pydantic~=2.0" "pydantic-settings~=2.0" kornia numpy "playwright>=1.40"
    "$venv/bin/python" -m pip install -q --no-deps spandrel comfyui-frontend-package
    echo "$comfy_want" > "$comfy_stamp"
  fi
  if [ -n "$comfy_archive" ] && [ ! -f "$root/.comfyui/main.py" ]; then
    rm -rf "$root/.comfyui" && mkdir -p "$root/.comfyui"
    tar -xJf "$comfy_archive" -C "$root/.comfyui"
  fi
}

# The split-vs-unsplit tests again with the GEMM libraries on the code paths of an AVX2 machine (oneDNN's bf16/int8
# kernels capped at AVX2, MKL's fp32 GEMMs on their AVX2 branch), whatever this CPU is: exactness must not depend on
# which kernels the machine CI lands on happens to pick. Both settings leave torch's bf16 attention working (a oneDNN
# cap below AMX turns its AMX packing off), unlike ATEN_CPU_CAPABILITY.
exactness_pass() {
  ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=AVX2 "$venv/bin/python" -m pytest -q -m exactness "$@"
}

# mypy runs in this venv, so it sees torch's and the other dependencies' own types
lint() {
  "$venv/bin/python" -m ruff check
  "$venv/bin/python" -m ruff format --check
  "$venv/bin/python" -m mypy
}

cmd="${1:-demo}"; shift || true
case "$cmd" in
  demo)  exec "$venv/bin/python" -m h3ms_async demo "$@" ;;
  bench) exec "$venv/bin/python" -m h3ms_async bench "$@" ;;
  serve) exec "$venv/bin/python" -m h3ms_async serve "$@" ;;
  test)
    # The fast tier needs neither the browser nor ComfyUI's tree.
    if [ "${1:-}" = "--fast" ]; then shift; exec "$venv/bin/python" -m pytest -q -m fast "$@"; fi
    # The web panel is tested in a real headless browser (Debian's chromium).
    if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
        || echo "warning: could not install chromium; the browser test will be skipped" >&2
    fi
    setup_comfy
    if [ "$#" -gt 0 ]; then exec "$venv/bin/python" -m pytest -q "$@"; fi
    # Lint and both passes must pass (set -e; pytest's 5, "no tests collected", fails too).
    lint
    # Two test files at a time: most of a test's time is spent starting processes (workers, ComfyUI, the browser)
    # and waiting on them, so two run in ~0.6x the time of one after the other on a 2-core machine. A file stays
    # on one runner (its module fixtures are made once); every test checks only its own processes, segments and
    # run dirs, so two never see each other's.
    "$venv/bin/python" -m pytest -q -n 2 --dist loadfile
    exactness_pass ;;
  lint) lint ;;
  exactness)
    setup_comfy
    exactness_pass "$@" ;;
  *) echo "usage: bash scripts/h3ms.sh demo|test [--fast]|lint|exactness|bench|serve [options]" >&2
     exit 2 ;;
esac
