#!/usr/bin/env bash
# One entry point for a fresh Linux machine: sets up .venv (once) and runs the demo, the tests or a benchmark.
#   bash scripts/h3ms.sh demo [demo options]     the standalone demo (unsplit vs split across 3 CPU ranks)
#   bash scripts/h3ms.sh test [pytest options]   the test suite
#   bash scripts/h3ms.sh bench ipc|split|exchange
# Environment: H3MS_VENV (default .venv), H3MS_TORCH_SPEC (default torch==2.13.0), H3MS_PYTHON (default python3).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${H3MS_VENV:-$root/.venv}"
py="${H3MS_PYTHON:-python3}"
torch_spec="${H3MS_TORCH_SPEC:-torch==2.13.0}"
stamp="$venv/.h3ms-installed"
want="$(cat requirements.txt pyproject.toml | sha256sum | cut -c1-16) $torch_spec"

if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # torch first and pinned: an unpinned torch would pull a multi-GB CUDA build onto a CPU-only machine.
  "$venv/bin/python" -m pip install -q "$torch_spec"
  "$venv/bin/python" -m pip install -q -r requirements.txt \
      "pytest>=8" "hypothesis>=6.100" "pytest-aiohttp>=1.0" "pytest-timeout>=2.3"
  echo "$want" > "$stamp"
fi

cmd="${1:-demo}"; shift || true
case "$cmd" in
  demo)  exec "$venv/bin/python" -m h3ms_async demo "$@" ;;
  bench) exec "$venv/bin/python" -m h3ms_async bench "$@" ;;
  serve) exec "$venv/bin/python" -m h3ms_async serve "$@" ;;
  test)
    # The web panel is tested in a real headless browser (Debian's chromium).
    if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
        || echo "warning: could not install chromium; the browser test will be skipped" >&2
    fi
    exec "$venv/bin/python" -m pytest -q "$@" ;;
  *) echo "usage: bash scripts/h3ms.sh demo|test|bench|serve [options]" >&2; exit 2 ;;
esac
