"""The one configuration module: every H3MS_* name the repository uses is declared there, the README table is its
output, and a bad value is one line naming the variable and the fix."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from h3ms_async.runtime.plans import GPUSelectionError, rank_map
from workers.runtime import config
from workers.testing import settings

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
#: H3MS_* words that are not environment variables: the GPU set's and the sparse settings' ComfyUI socket types.
NOT_VARIABLES = {"H3MS_GPUS", "H3MS_SPARSE_ATTENTION"}
_NAME = re.compile(r"\bH3MS_[A-Z0-9_]+\b")


def _tracked(*suffixes: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / p for p in out if p.endswith(suffixes) and (ROOT / p).is_file()]


def test_every_name_in_the_repository_is_declared() -> None:
    texts = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8", errors="replace")
             for p in _tracked(".py", ".sh", ".js")}
    used = {name: path for path, text in texts.items() for name in _NAME.findall(text)}
    declared = {**config.BY_NAME, **settings.BY_NAME}
    undeclared = {n: p for n, p in used.items() if n not in declared and n not in NOT_VARIABLES}
    assert not undeclared, ("declare these in workers/runtime/config.py (tests only: "
                            f"workers/testing/settings.py): {undeclared}")
    homes = {"workers/runtime/config.py", "workers/testing/settings.py"}
    elsewhere = "\n".join(text for path, text in texts.items() if path not in homes)
    attr = {v.name: f"{mod.__name__.rpartition('.')[2]}.{a}" for mod in (config, settings)
            for a, v in vars(mod).items() if isinstance(v, config.EnvVar)}
    unused = [n for n in declared if n not in elsewhere and attr[n] not in elsewhere]
    assert not unused, f"declared but read nowhere: {unused}"


@pytest.mark.parametrize("marker, variables, module", [
    ("env-table", config.ALL, "workers.runtime.config"),
    ("test-env-table", settings.ALL, "workers.testing.settings")])
def test_readme_tables_are_the_declarations(marker: str, variables: tuple, module: str) -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(rf"<!-- {marker}: start -->\n(.*?)\n<!-- {marker}: end -->", text, re.S)
    assert m, f"README.md lost its {marker} markers"
    assert m.group(1) == config.markdown_table(variables), \
        f"README's {marker} is stale: paste `python -m {module}` between its markers"


@pytest.mark.parametrize("var,raw,why", [
    (config.WORKER_START_TIMEOUT, "soon", "is not a number of seconds"),
    (config.HEARTBEAT_TIMEOUT, "0", "must be > 0 seconds"),
    (config.VRAM_RESERVE_GB, "-1", "must be >= 0 GiB"),
    (config.MAX_FRAME_BYTES, "100", "is below 1024 bytes"),
    (config.DEBUG, "yes", "is not 0 or 1"),
    (config.VAE_TRANSPORT, "pipe", "is not one of auto, shm, socket"),
    (config.RANK_MAP, "cpu,gpu1", "has 'gpu1', not a device (cpu or cuda:N)"),
])
def test_bad_value_is_one_line_naming_variable_and_fix(monkeypatch: pytest.MonkeyPatch, var: config.EnvVar,
                                                       raw: str, why: str) -> None:
    monkeypatch.setenv(var.name, raw)
    with pytest.raises(config.ConfigError) as err:
        var.get()
    msg = str(err.value)
    assert msg == f"{var.name}={raw!r} {why}; {var.fix}" and "\n" not in msg


def test_read_per_call_default_when_unset_or_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(config.VAE_CHUNK_TIMEOUT.name, raising=False)
    assert config.VAE_CHUNK_TIMEOUT.get() == 900.0
    monkeypatch.setenv(config.VAE_CHUNK_TIMEOUT.name, " 2.5 ")
    assert config.VAE_CHUNK_TIMEOUT.get() == 2.5
    monkeypatch.setenv(config.VAE_CHUNK_TIMEOUT.name, "")
    assert config.VAE_CHUNK_TIMEOUT.get() == 900.0
    monkeypatch.setenv(config.VAE_TRANSPORT.name, "SHM")
    assert config.VAE_TRANSPORT.get() == "shm"


def test_core_rule_errors_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A set value the core refuses (here: a rank map mixing cpu and cuda) keeps the core's error type, named."""
    monkeypatch.setenv(config.RANK_MAP.name, "cpu,cuda:0")
    with pytest.raises(GPUSelectionError, match=r"^H3MS_RANK_MAP='cpu,cuda:0': rank map 'cpu,cuda:0' mixes cpu"):
        config.RANK_MAP.get(rank_map)
    monkeypatch.setenv(config.RANK_MAP.name, "cpu,cpu")
    assert config.RANK_MAP.get(rank_map) == ["cpu", "cpu"]


def test_process_wide_value_fails_at_import_with_its_line() -> None:
    """The frame limit is fixed at import (both sides must agree); a bad one stops the process with that line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), config.MAX_FRAME_BYTES.name: "lots"}
    proc = subprocess.run([sys.executable, "-c", "import workers.runtime.protocol"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "workers.runtime.config.ConfigError: H3MS_MAX_FRAME_BYTES='lots' is not an integer byte count; "
        "unset it or give e.g. 16777216")
