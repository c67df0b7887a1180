"""The test-only settings: what a worker's test hooks read (with ``H3MS_TEST_HOOKS=1``) and what
the test suite reads.  Declared as ``workers/runtime/config.py`` declares the pack's; the README's
second table is ``python -m workers.testing.settings``."""

from __future__ import annotations

from workers.runtime.config import EnvVar, _flag_var, _number, _text, _var, markdown_table

CK_ATTENTION_CPU = _flag_var(
    "H3MS_CK_ATTENTION_CPU",
    "With `H3MS_TEST_HOOKS=1`: attention helpers run kitchen's INT8 attention API on the CPU "
    "through the pack's test hook (`workers/testing/ck_cpu.py`). Tests only.",
)
CK_SPARSE_CPU = _flag_var(
    "H3MS_CK_SPARSE_CPU",
    "With `H3MS_TEST_HOOKS=1`: DiT ranks run kitchen's chunked sparse attention "
    "(`sol_attn_chunked`) on the CPU through the pack's test hook (`workers/testing/"
    "ck_sparse_cpu.py`, over kitchen's eager `sol_attn`). Tests only.",
)
CUDA_IPC_CPU = _flag_var(
    "H3MS_CUDA_IPC_CPU",
    "With `H3MS_TEST_HOOKS=1`: the exchange probe runs `cuda_ipc` cases on CPU ranks, each rank's "
    "send buffer a shm segment in place of GPU memory shared by CUDA IPC (the pack's stand-in "
    "`workers/testing/ipc_cpu.py`). Tests only.",
)
TEST_IPC_WITHHOLD_RANK = _var(
    "H3MS_TEST_IPC_WITHHOLD_RANK",
    "integer",
    -1,
    "unset",
    "With `H3MS_CUDA_IPC_CPU=1`: this exchange rank (0 = the first) never hands its send buffer to "
    "its peers (its handle slots stay empty), so tests show that they fail at the op's deadline "
    "or on abort. Tests only.",
    "give a rank (0 or more) or unset it",
    _number(int, "an integer rank", lambda v: v >= 0, "must be >= 0"),
)
TEST_IPC_UNRECORDED_RANK = _var(
    "H3MS_TEST_IPC_UNRECORDED_RANK",
    "integer",
    -1,
    "unset",
    "With `H3MS_CUDA_IPC_CPU=1` and the exchange ordered by events: this exchange rank (0 = the "
    "first) never records its events, so tests show that its peers' waits catch it. Tests only.",
    "give a rank (0 or more) or unset it",
    _number(int, "an integer rank", lambda v: v >= 0, "must be >= 0"),
)
TEST_SHAPE_FAULT = _var(
    "H3MS_TEST_SHAPE_FAULT",
    "text",
    "",
    "unset",
    "With `H3MS_TEST_HOOKS=1`: one call shape rounds differently on purpose "
    "(`linear:ROWS:IN_FEATURES[:OUT_FEATURES]`, `attention:HEADS` or `sparse:HEADS`, `:step` "
    "appended = the invariance probe does not see it), so tests show the probe and `verify` "
    "catch it; read once per process. Tests only.",
    "give e.g. linear:10:64, attention:1:step or sparse:2, or unset it",
    _text,
)
TEST_MODULATION_FAULT = _var(
    "H3MS_TEST_MODULATION_FAULT",
    "integer",
    -1,
    "unset",
    "With `H3MS_TEST_HOOKS=1`: DiT ranks move every value of this block's adaLN rows (the step's "
    "modulation, computed by the model's owner) one unit in the last place before using them, so "
    "tests show that parity and `verify` catch rows that differ from the model's own; read once "
    "per process. Tests only.",
    "give a block index (0 or more) or unset it",
    _number(int, "an integer block index", lambda v: v >= 0, "must be >= 0"),
)
TEST_VAE_CRASH_FILE = _var(
    "H3MS_TEST_VAE_CRASH_FILE",
    "path",
    "",
    "unset",
    "With `H3MS_TEST_HOOKS=1`: a VAE worker that finds this file deletes it and dies at its next "
    "chunk. Tests only.",
    "give a file path or unset it",
    _text,
)
TEST_VAE_SKEW_RANK = _var(
    "H3MS_TEST_VAE_SKEW_RANK",
    "integer",
    0,
    "unset",
    "With `H3MS_TEST_HOOKS=1`: the VAE worker of this rank (1 = the first worker) adds one unit in "
    "the last place to every value of every chunk it decodes, so its decode differs from rank 0's "
    "and the exactness probe must drop it. Tests only.",
    "give a worker rank (1 or more) or unset it",
    _number(int, "an integer rank", lambda v: v >= 1, "must be >= 1"),
)
TEST_VAE_COLD_SKEW_RANK = _var(
    "H3MS_TEST_VAE_COLD_SKEW_RANK",
    "integer",
    0,
    "unset",
    "With `H3MS_TEST_HOOKS=1`: the VAE worker of this rank adds one unit in the last place to the "
    "first chunk it decodes after it started, as a kernel whose first call takes another path "
    "would; the exactness probe must keep the rank. Tests only.",
    "give a worker rank (1 or more) or unset it",
    _number(int, "an integer rank", lambda v: v >= 1, "must be >= 1"),
)
_TESTS = "tests"
COMFY_ARCHIVE = _var(
    "H3MS_COMFY_ARCHIVE",
    "path",
    "",
    "the archive in `$H3MS_SHARED/comfyui`",
    "The ComfyUI source archive `tests/comfy_tree.py` unpacks.",
    "give a .tar.xz path",
    _text,
    where=_TESTS,
)
EXTRA_SHIMS = _var(
    "H3MS_EXTRA_SHIMS",
    "path",
    "",
    "unset",
    "Extra import shims `tests/comfy_tree.py` puts on a ComfyUI process's path (device runs).",
    "give a directory",
    _text,
    where=_TESTS,
)
GOLDEN_DIR = _var(
    "H3MS_GOLDEN_DIR",
    "directory",
    "",
    "`$H3MS_SHARED/golden`",
    "Golden tensors recorded from ComfyUI's own H3 code.",
    "give a directory",
    _text,
    where=_TESTS,
)
PANEL_SCREENSHOT = _var(
    "H3MS_PANEL_SCREENSHOT",
    "path",
    "",
    "a temp file",
    "The standalone panel test's screenshot path.",
    "give a file path",
    _text,
    where=_TESTS,
)
BROWSER_OUT = _var(
    "H3MS_BROWSER_OUT",
    "directory",
    "",
    "`.out/browser_comfy`",
    "Where the browser test in ComfyUI writes its screenshots and ComfyUI's log.",
    "give a directory",
    _text,
    where=_TESTS,
)
DOCS_SCREENSHOTS = _flag_var(
    "H3MS_DOCS_SCREENSHOTS",
    "`1` = the browser test also refreshes `docs/panel_*.png`.",
    where=_TESTS,
)

NODE_CHECKS = _var(
    "H3MS_NODE_CHECKS",
    "pytest args",
    "",
    "unset",
    "`tests/test_nodes.py`: extra pytest arguments for the node checks inside ComfyUI (e.g. `-k "
    "cache`).",
    "give pytest arguments",
    _text,
    where=_TESTS,
)
TEST_HEADS = _var(
    "H3MS_TEST_HEADS",
    "integer",
    "",
    "`8`",
    "The attention tests' tiny H3: its head count.",
    "give an integer",
    _text,
    where=_TESTS,
)
TEST_LATENT = _var(
    "H3MS_TEST_LATENT",
    "width,height,length",
    "",
    "`64,96,5`",
    "The attention tests' latent size.",
    "give three integers",
    _text,
    where=_TESTS,
)
TEST_MARK = _var(
    "H3MS_TEST_MARK",
    "text",
    "",
    "set by the test",
    "Internal: `tests/test_cli.py` marks the processes it starts, to find them.",
    "leave it to the test",
    _text,
    where=_TESTS,
)
TESTS_DIR = _var(
    "H3MS_TESTS_DIR",
    "directory",
    "",
    "set by the test",
    "Internal: the tests folder, put on the path of a ComfyUI process the VAE/cache tests start "
    "(their small models live there).",
    "leave it to the test",
    _text,
    where=_TESTS,
)
PACK = _var(
    "H3MS_PACK",
    "directory",
    "",
    "set by the test",
    "Internal: the pack root, passed to a ComfyUI process the attention tests start.",
    "leave it to the test",
    _text,
    where=_TESTS,
)

ALL: tuple[EnvVar, ...] = tuple(v for v in globals().values() if isinstance(v, EnvVar))
BY_NAME: dict[str, EnvVar] = {v.name: v for v in ALL}

if __name__ == "__main__":
    print(markdown_table(ALL))
