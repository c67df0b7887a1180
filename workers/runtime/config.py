"""Every ``H3MS_*`` environment variable of the pack, declared once: name, type, default, one doc
line, one parser.

Workers and the core read the same declarations (this module lives under ``workers/`` because
workers never import ``h3ms_async``).  :meth:`EnvVar.get` reads the environment on every call, so a
variable a test sets between calls takes effect; modules that fix a value for the process's life
(the frame limit, the test hooks) call it once at import.  A bad value is one :class:`ConfigError`
line naming the variable, what is wrong and the fix.

The README's environment table is :func:`markdown_table` (``python -m workers.runtime.config``
prints it; a test checks the README matches).  Variables read only by ``scripts/h3ms.sh`` or the
test suite are declared here too (their ``where`` says so), so that the table and the check cover
every name the repository uses.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """An ``H3MS_*`` variable has a value its parser refuses; the message names the variable and the
    fix."""


def _flag(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError("is not 0 or 1")
    return raw == "1"


def _number(
    cast: Callable[[str], Any], what: str, ok: Callable[[Any], bool], bound: str
) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        try:
            value = cast(raw)
        except ValueError:
            raise ValueError(f"is not {what}") from None
        if not ok(value):  # NaN fails every bound
            raise ValueError(bound)
        return value

    return parse


_seconds = _number(float, "a number of seconds", lambda v: v > 0, "must be > 0 seconds")
_gib = _number(float, "a number of GiB", lambda v: v >= 0, "must be >= 0 GiB")
_frame_bytes = _number(int, "an integer byte count", lambda v: v >= 1024, "is below 1024 bytes")


_DEVICE = re.compile(r"^(cpu|cuda:\d+)$")


def _devices(raw: str) -> str:
    # The rank map's full rules (rank count, no mixed kinds) are the core's plans.rank_map; this
    # checks the syntax so that a worker-side reader gets the same one-line error.
    bad = [
        p.strip() for p in raw.lower().replace(";", ",").split(",") if not _DEVICE.match(p.strip())
    ]
    if bad:
        raise ValueError(f"has {bad[0]!r}, not a device (cpu or cuda:N)")
    return raw


def _text(raw: str) -> str:
    return raw


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One variable: ``get()`` gives the parsed value, or ``default`` when it is unset or empty."""

    name: str
    type: str  # as the README table shows it
    default: T
    shown_default: str  # the default as the README shows it
    doc: str
    fix: str  # what a user should do about a bad value
    parse: Callable[[str], T] = field(repr=False)  # raises ValueError("<what is wrong>")
    where: str = ""  # "" = read by the pack; else who reads it (shell script, test suite)
    choices: tuple[str, ...] = ()

    def raw(self) -> str:
        """The value as set, stripped ('' when unset)."""
        return os.environ.get(self.name, "").strip()

    def is_set(self) -> bool:
        """True when the variable has a non-empty value."""
        return bool(self.raw())

    def get(self, then: Callable[[T], Any] | None = None) -> Any:
        """The parsed value, read from the environment at this call.  ``then`` further parses a set
        value (e.g. the core's rank-map rules); its ValueError is re-raised, same type, with this
        variable named."""
        raw = self.raw()
        if not raw:
            return self.default
        try:
            value = self.parse(raw)
        except ValueError as e:
            raise ConfigError(f"{self.name}={raw!r} {e}; {self.fix}") from None
        if then is None:
            return value
        try:
            return then(value)
        except ValueError as e:
            raise type(e)(f"{self.name}={raw!r}: {e}") from None


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.lower()
        if value not in choices:
            raise ValueError(f"is not one of {', '.join(choices)}")
        return value

    return parse


def _var(
    name: str,
    type_: str,
    default: Any,
    shown: str,
    doc: str,
    fix: str,
    parse: Callable[[str], Any],
    where: str = "",
    choices: tuple[str, ...] = (),
) -> EnvVar:
    return EnvVar(name, type_, default, shown, doc, fix, parse, where, choices)


def _flag_var(name: str, doc: str, where: str = "") -> EnvVar:
    return _var(
        name, "flag", False, "unset", doc, "give 1 (on) or 0 (off), or unset it", _flag, where
    )


def _seconds_var(name: str, default: float, doc: str) -> EnvVar:
    return _var(
        name,
        "seconds",
        default,
        f"`{default:g}`",
        doc,
        f"unset it or give e.g. {default:g}",
        _seconds,
    )


def _devices_var(name: str, doc: str, example: str) -> EnvVar:
    return _var(name, "devices", "", "unset", doc, f"give {example}", _devices)


def _choice_var(name: str, choices: tuple[str, ...], doc: str) -> EnvVar:
    return _var(
        name,
        "choice",
        choices[0],
        f"`{choices[0]}`",
        doc,
        f"unset it for {choices[0]}",
        _choice(*choices),
        choices=choices,
    )


# -- runtime ---------------------------------------------------------------------------------------
RUN_DIR = _var(
    "H3MS_RUN_DIR",
    "directory",
    "",
    "the temp dir (`$TMPDIR`, else `/tmp`)",
    "Where each worker pool makes its private run dir `h3ms-<pid>-<random>` (sockets, worker logs, "
    "its owner lock); it goes with its owner. Set a short path if the AF_UNIX socket path limit "
    "(107 bytes) is hit.",
    "set it to a short writable directory such as /tmp",
    _text,
)
WORKER_START_TIMEOUT = _seconds_var(
    "H3MS_WORKER_START_TIMEOUT", 300.0, "How long a worker may take to start and authenticate."
)
HEARTBEAT_TIMEOUT = _seconds_var(
    "H3MS_HEARTBEAT_TIMEOUT",
    10.0,
    "A worker that misses heartbeats this long is treated as dead (the step fails on every rank).",
)
MAX_FRAME_BYTES = _var(
    "H3MS_MAX_FRAME_BYTES",
    "bytes",
    16 * 1024 * 1024,
    "`16777216` (16 MiB)",
    "Largest control frame either side accepts (tensors go through shared memory, not frames); "
    "read once per process.",
    "unset it or give e.g. 16777216",
    _frame_bytes,
)
DEBUG = _flag_var("H3MS_DEBUG", "`1` = DEBUG logging in ComfyUI's process and in the workers.")
# -- the DiT split ---------------------------------------------------------------------------------
RANK_MAP = _devices_var(
    "H3MS_RANK_MAP",
    "Replaces the GPU plan with an explicit rank map, one device per rank (`cpu,cpu,cpu`, "
    "`cuda:0,cuda:0,cuda:1`); for tests and verification (several ranks on one GPU). A connected "
    "GPU set's shares still apply, one per rank. The VAE split takes it too when "
    "`H3MS_VAE_RANK_MAP` is unset.",
    "one device per rank, e.g. cuda:0,cuda:1",
)
VRAM_RESERVE_GB = _var(
    "H3MS_VRAM_RESERVE_GB",
    "GiB",
    2.0,
    "`2`",
    "CUDA ranks with `vram_residency=auto`: VRAM left free beyond the step's working set when "
    "deciding how many blocks stay resident.",
    "unset it or give e.g. 2",
    _gib,
)
ENABLE_TRITON_BACKEND = _flag_var(
    "H3MS_ENABLE_TRITON_BACKEND",
    "`1` = allow comfy-kitchen's triton backend in the workers (ComfyUI's "
    "`--enable-triton-backend`; set it when ComfyUI runs with that flag, so ranks use the same "
    "kernels).",
)
ALLOW_UNTESTED_PATHS = _flag_var(
    "H3MS_ALLOW_UNTESTED_PATHS",
    "`1` = run split paths (Ulysses, head pieces, the gather overlap, gather ahead, the "
    "GPU-direct exchange) on a device kind where no test has passed for them yet "
    "(`h3ms_async/dit/tested_paths.py`); for the tests and benchmarks that measure them there.",
)
COMFY_HOST = _var(
    "H3MS_COMFY_HOST",
    "JSON",
    "",
    "set by the pool",
    "Internal, parent to worker: the ComfyUI root, argv and attention function a rank started from "
    "inside ComfyUI runs (`workers/runtime/comfy_host.py`).",
    "leave it to the pool",
    _text,
)
INVARIANCE_CACHE = _var(
    "H3MS_INVARIANCE_CACHE",
    "path",
    "",
    "`$XDG_CACHE_HOME/h3_multistream/invariance.json` (`~/.cache/...`)",
    "The JSON file keeping the split's measured plan verdicts across restarts (keyed by device, "
    "driver, runtime, torch, comfy-kitchen, dtype, shapes and shards), so a restarted ComfyUI "
    "probes nothing it measured before; `off`: each process measures its plans once.",
    "give a writable file path, `off`, or unset it",
    _text,
)
# -- H3 Attention Parallel -------------------------------------------------------------------------
ATTN_HELPERS = _devices_var(
    "H3MS_ATTN_HELPERS",
    "H3 Attention Parallel: explicit helper devices replacing the GPU plan (`cpu,cpu`, "
    "`cuda:0,cuda:0,cuda:0`; the model's device comes first on its own); for tests and "
    "verification.",
    "the helper devices, e.g. cuda:0,cuda:1",
)
ATTN_TRANSPORT = _choice_var(
    "H3MS_ATTN_TRANSPORT",
    ("auto", "host", "cuda_ipc"),
    "H3 Attention Parallel: `auto` = CUDA IPC where possible (one INFO line says why not), `host` "
    "= always pinned shared memory, `cuda_ipc` = fail where CUDA IPC cannot run.",
)
# -- the VAE split ---------------------------------------------------------------------------------
VAE_TRANSPORT = _choice_var(
    "H3MS_VAE_TRANSPORT",
    ("auto", "shm", "socket"),
    "How decoded chunks come back: `auto` (shared memory, the socket when /dev/shm has no room), "
    "`shm`, `socket`.",
)
VAE_CHUNK_TIMEOUT = _seconds_var(
    "H3MS_VAE_CHUNK_TIMEOUT",
    900.0,
    "Longest wait for one remote chunk (and for the workers to load the decoder).",
)
VAE_RANK_MAP = _devices_var(
    "H3MS_VAE_RANK_MAP",
    "The VAE split's rank map (`cpu,cpu,cpu`, `cuda:0,cuda:0`): rank 0 must be the VAE's own "
    "device (ComfyUI's process), each other entry is a worker. Replaces the GPU plan and wins over "
    "`H3MS_RANK_MAP` (which the VAE split obeys when this is unset); the node's `max_gpus` caps "
    "it. For tests and verification.",
    "one device per rank, the VAE's first, e.g. cuda:0,cuda:1",
)
# -- tests and tools -------------------------------------------------------------------------------
TEST_HOOKS = _flag_var(
    "H3MS_TEST_HOOKS",
    "`1` = workers load the test-only code of `workers/testing/` (request kinds that sleep or "
    "crash, fault hooks; its settings: the table below); read once per worker. Tests only.",
)
COMFY_ROOT = _var(
    "H3MS_COMFY_ROOT",
    "directory",
    "",
    "unset",
    "A ComfyUI checkout with MiniMax H3: `bench vae`'s default `--comfy-root`, and the tests' tree "
    "instead of the unpacked archive.",
    "set it to a ComfyUI root (it has main.py)",
    _text,
)
VAE_BENCH = _var(
    "H3MS_VAE_BENCH",
    "JSON",
    "",
    "set by `bench vae`",
    "Internal: `bench vae`'s configuration for its ComfyUI-side child "
    "(`benchmarks/vae_split_comfy.py`).",
    "leave it to bench vae",
    _text,
)
_SCRIPT = "scripts/h3ms.sh"
VENV = _var(
    "H3MS_VENV",
    "directory",
    "",
    "`.venv`",
    "Where `scripts/h3ms.sh` installs.",
    "give a directory",
    _text,
    where=_SCRIPT,
)
PYTHON = _var(
    "H3MS_PYTHON",
    "command",
    "",
    "`python3`",
    "Which Python `scripts/h3ms.sh` makes the venv with.",
    "give a Python command",
    _text,
    where=_SCRIPT,
)
TORCH_SPEC = _var(
    "H3MS_TORCH_SPEC",
    "pip spec",
    "",
    "`torch==2.13.0`",
    "Which torch build `scripts/h3ms.sh` installs (e.g. a CUDA build for the demo's GPU ranks).",
    "give a pip requirement",
    _text,
    where=_SCRIPT,
)
SHARED = _var(
    "H3MS_SHARED",
    "directory",
    "",
    "`../shared`",
    "The project's shared folder (ComfyUI archive, golden tensors) for the test suite and "
    "`scripts/h3ms.sh test`.",
    "give the shared folder",
    _text,
    where="tests, " + _SCRIPT,
)

ALL: tuple[EnvVar, ...] = tuple(v for v in globals().values() if isinstance(v, EnvVar))
BY_NAME: dict[str, EnvVar] = {v.name: v for v in ALL}


def markdown_table(variables: tuple[EnvVar, ...] = ALL) -> str:
    """The README's table of these variables (one row each, in declaration order)."""
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for v in variables:
        where = f" Read by {v.where} only." if v.where else ""
        rows.append(f"| `{v.name}` | {v.type} | {v.shown_default} | {v.doc}{where} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
