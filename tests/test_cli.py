"""The command line as a user meets it, each run as its own process: every input mistake exits 2 with one line on
stderr naming the input and the fix (no traceback) and leaves nothing behind; the demo runs to its summary line with a
moving bar; Ctrl-C stops it with one line and no leftovers."""
from __future__ import annotations

import concurrent.futures as cf
import glob
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--tokens", "300", "--layers", "2", "--hidden", "64", "--heads", "4", "--head-dim", "16"]


def _held_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


_HELD = _held_port()
_BUSY = str(_HELD.getsockname()[1])
_NO_CUDA_RANK = "cuda:0" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"

# (id, argv after `python -m h3ms_async`, extra env, words the one line must contain)
CASES = [
    ("demo-steps-0", ["demo", "--steps", "0"], {}, ["--steps", ">= 1"]),
    ("demo-tokens-0", ["demo", "--tokens", "0"], {}, ["--tokens 0", "--tokens 3000"]),
    ("demo-tokens-neg", ["demo", "--tokens", "-5"], {}, ["--tokens -5", "positive"]),
    ("demo-tokens-12", ["demo", "--tokens", "12"], {}, ["--tokens 12", "--tokens 276 or more"]),
    ("demo-head-dim-2", ["demo", "--head-dim", "2"], {}, ["--head-dim 2", "--head-dim 6 or more"]),
    ("demo-serve-neg", ["demo", "--serve", "-1"], {}, ["--serve", "1-65535"]),
    ("demo-serve-busy", ["demo", "--serve", _BUSY, *TINY], {}, [f"--serve {_BUSY}", "already in use"]),
    ("demo-ranks-cuda", ["demo", "--ranks", _NO_CUDA_RANK], {}, ["--ranks", "cpu,cpu,cpu" if _NO_CUDA_RANK ==
                                                                "cuda:0" else "does not exist"]),
    ("demo-ranks-word", ["demo", "--ranks", "cpu,gpu"], {}, ["--ranks", "'gpu' is not a device", "cuda:N"]),
    ("demo-ranks-heads", ["demo", "--heads", "2", "--head-dim", "64"], {}, ["--ranks", "--heads 2", "at most 2"]),
    ("demo-chunks", ["demo", "--exchange-chunks", "40"], {}, ["--exchange-chunks 40", "0 to 32"]),
    ("demo-shares", ["demo", "--shares", "1,x"], {}, ["--shares", "'x' is not a number"]),
    ("demo-shares-count", ["demo", "--shares", "1,1"], {}, ["--shares", "one per rank"]),
    ("demo-weights", ["demo", "--weights", "int4"], {}, ["--weights", "int8"]),
    ("demo-run-dir-missing", ["demo", *TINY], {"H3MS_RUN_DIR": "/nonexistent/h3ms"}, ["H3MS_RUN_DIR", "/tmp"]),
    ("demo-run-dir-file", ["demo", *TINY], {"H3MS_RUN_DIR": str(ROOT / "README.md")}, ["H3MS_RUN_DIR", "/tmp"]),
    ("demo-run-dir-long", ["demo", *TINY], {"H3MS_RUN_DIR": "{long}"}, ["H3MS_RUN_DIR", "short path"]),
    ("serve-port-big", ["serve", "--port", "99999"], {}, ["--port", "1-65535"]),
    ("serve-port-busy", ["serve", "--port", _BUSY], {}, [f"--port {_BUSY}", "already in use", "another --port"]),
    ("bench-ipc-sizes", ["bench", "ipc", "--pool-sizes", "abc"], {}, ["--pool-sizes", "'abc'", "1,4,8"]),
    ("bench-ipc-zero", ["bench", "ipc", "--pool-sizes", "0"], {}, ["--pool-sizes", ">= 1"]),
    ("bench-ipc-device", ["bench", "ipc", "--start-device", "gpu0"], {}, ["--start-device", "cpu, cuda or cuda:N"]),
    ("bench-ipc-program", ["bench", "ipc", "--program", "nope"], {}, ["--program", "workers.nope.rank", "e.g. dit"]),
    ("bench-split-chunks", ["bench", "split", "--chunks", "x"], {}, ["--chunks", "'x'"]),
    ("bench-exchange-world", ["bench", "exchange", "--world", "1"], {}, ["--world", "at least 2"]),
    ("bench-attention-helpers", ["bench", "attention", "--helpers", "x"], {}, ["--helpers", "e.g."]),
    ("bench-vae-ranks", ["bench", "vae", "--ranks", "9"], {}, ["--ranks", "2..8"]),
    ("bench-caches-int", ["bench", "caches", "--te-layers", "x"], {}, ["--te-layers", "'x'"]),
    ("bench-sparse-steps", ["bench", "sparse", "--steps", "1"], {}, ["--steps 1", "at least 2"]),
    ("bench-sparse-tau", ["bench", "sparse", "--tau", "9"], {}, ["tau=9", "between 0 and 4"]),
    ("bench-gpu-exchange", ["bench", "gpu", "--exchange", "host,cuda_ipc_event"], {},
     ["--exchange cuda_ipc_event", "host, cuda_ipc, cuda_ipc_events"]),
    ("bench-unknown", ["bench", "nope"], {}, ["'nope'", "bench {ipc|split|exchange|gpu|"]),
    ("command-unknown", ["nope"], {}, ["'nope'", "bench, demo, serve"]),
]
if not torch.cuda.is_available():
    CASES.append(("bench-gpu-no-cuda", ["bench", "gpu"], {}, ["bench gpu needs a CUDA GPU", "GPU machine"]))
    CASES.append(("bench-sparse-no-cuda", ["bench", "sparse"], {}, ["bench sparse needs a CUDA GPU",
                                                                    "no CPU sparse attention kernel"]))


def _leftovers(pid: int, run_base: Path, mark: str) -> list[str]:
    """What a finished CLI process left: shm segments, run dirs, processes started with its marker."""
    left = glob.glob(f"/dev/shm/h3ms-{pid}-*") + [str(p) for p in run_base.glob("**/h3ms-*")]
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("H3MS_TEST_MARK") == mark:
                left.append(f"process {proc.pid}")
        except (psutil.Error, OSError):
            continue
    return left


def _run_cli(case: tuple, base: Path) -> dict:
    name, argv, env, _ = case
    run_base = base / name
    run_base.mkdir()
    mark = uuid.uuid4().hex
    long_dir = run_base / ("d" * 100)  # exists, but leaves no room for a 107-byte socket path
    long_dir.mkdir()
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "H3MS_RUN_DIR": str(run_base), "H3MS_TEST_MARK": mark,
                **{k: v.replace("{long}", str(long_dir)) for k, v in env.items()}}
    proc = subprocess.Popen([sys.executable, "-m", "h3ms_async", *argv], cwd=ROOT, env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=240)
    return {"rc": proc.returncode, "stderr": err, "stdout": out, "left": _leftovers(proc.pid, run_base, mark)}


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every case at once (each is a fresh interpreter importing torch: in parallel they take seconds, not minutes)."""
    base = tmp_path_factory.mktemp("cli")
    try:
        with cf.ThreadPoolExecutor(max_workers=4) as pool:
            futures = {c[0]: pool.submit(_run_cli, c, base) for c in CASES}
            return {k: f.result() for k, f in futures.items()}
    finally:
        _HELD.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_input_error_is_one_line_exit_2(case: tuple, cli_results: dict) -> None:
    name, argv, _, words = case
    res = cli_results[name]
    lines = res["stderr"].strip().splitlines()
    assert res["rc"] == 2, (argv, res)
    assert len(lines) == 1 and lines[0].startswith("error: "), res["stderr"]
    assert "Traceback" not in res["stderr"] + res["stdout"]
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert res["left"] == [], res["left"]


def _start_demo(args: list[str], tmp_path: Path) -> tuple[subprocess.Popen, list[str], threading.Thread]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "H3MS_RUN_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "h3ms_async", "demo", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    err: list[str] = []

    def read() -> None:  # tqdm redraws with \r: read characters, not lines
        assert proc.stderr is not None
        while ch := proc.stderr.read(1):
            err.append(ch)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return proc, err, reader


def _finish(proc: subprocess.Popen, reader: threading.Thread, timeout: float) -> str:
    """Wait for the demo; returns its stdout (stderr belongs to the reader thread)."""
    assert proc.stdout is not None
    out = proc.stdout.read()
    proc.wait(timeout)
    reader.join(5)
    return out


def _assert_nothing_left(proc: subprocess.Popen, tmp_path: Path, children: list[int]) -> None:
    assert glob.glob(f"/dev/shm/h3ms-{proc.pid}-*") == []
    assert list(tmp_path.glob("h3ms-*")) == []
    deadline = time.monotonic() + 5
    while any(psutil.pid_exists(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [c for c in children if psutil.pid_exists(c)]


@pytest.mark.exactness
@pytest.mark.timeout(300)
def test_demo_ends_with_the_summary_line_and_moves_its_bar(tmp_path: Path) -> None:
    proc, err, reader = _start_demo([*TINY, "--steps", "2"], tmp_path)
    out = _finish(proc, reader, 280)
    stderr = "".join(err)
    assert proc.returncode == 0, stderr[-2000:]
    last = out.strip().splitlines()[-1]
    # The engine measures the plan on this CPU first: where the tiny shards are not row-invariant (seen on an Intel
    # Xeon with AMX) both steps run unsplit, with the refusal logged once, and the demo claims nothing.
    refused = last.startswith("bit-exact: not measured")
    if refused:
        assert last == ("bit-exact: not measured - all 2 steps ran unsplit (the plan is not exact on these ranks: "
                        "nothing to compare)"), last
        assert stderr.count("; running this step unsplit") == 1, stderr[-2000:]
    else:
        assert last.startswith("bit-exact: yes - split vs unsplit equal on all 2 steps; unsplit "), last
        assert " s/step on 3 ranks; demo " in last, last
    # the bar moves per block: every unsplit block (positions 1-2 and 5-6 of 2 steps x unsplit+split x 2 blocks);
    # split blocks as the slowest rank reaches them (a tiny block can finish between two polls); log lines are never
    # glued to the bar
    for n in (1, 2) if refused else (1, 2, 5, 6, 8):
        assert f"| {n}/8 blocks" in stderr
    assert "step 2/2 split on 3 ranks" in stderr
    assert "weights " in stderr and "[demo]" in stderr
    assert not any("blocks [" in ln and "[H3 MultiStream]" in ln for ln in stderr.replace("\r", "\n").splitlines())
    assert "Traceback" not in stderr
    _assert_nothing_left(proc, tmp_path, [])


@pytest.mark.timeout(300)
def test_ctrl_c_during_the_demo_prints_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    proc, err, reader = _start_demo([*TINY, "--steps", "1000"], tmp_path)
    deadline = time.monotonic() + 90
    while "split on 3 ranks" not in "".join(err) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    workers = [c for c in psutil.Process(proc.pid).children(recursive=True) if "workers" in c.cmdline()]
    assert len(workers) == 3, "".join(err)[-2000:]  # the other child is the run dir's reaper (rundir.py)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    _finish(proc, reader, 30)
    stderr = "".join(err)
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr
    assert [ln for ln in stderr.replace("\r", "\n").splitlines() if "interrupted" in ln] == [
        "demo: interrupted (Ctrl-C); workers and shared memory released"]
    _assert_nothing_left(proc, tmp_path, children)


@pytest.mark.timeout(120)
def test_golden_tests_say_why_they_skip_without_the_shared_folder(tmp_path: Path) -> None:
    env = {**os.environ, "H3MS_SHARED": str(tmp_path / "no-shared")}
    env.pop("H3MS_GOLDEN_DIR", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_dit_golden.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-3000:]
    skipped = [ln for ln in proc.stdout.splitlines() if ln.startswith("SKIPPED")]
    assert skipped and all("set H3MS_SHARED to the project's shared/ folder" in ln for ln in skipped), proc.stdout
    assert str(tmp_path / "no-shared" / "golden") in skipped[0]


def test_demo_weight_formats_are_the_reference_models() -> None:
    """The demo names the formats without importing torch; they must stay the reference model's."""
    from h3ms_async.tools import demo
    from h3ms_async.dit import reference as reference_dit
    assert demo.WEIGHT_KINDS == reference_dit.WEIGHT_KINDS
    # as ComfyUI: every format computes in fp32 on a CPU, in its model dtype on a GPU
    assert {reference_dit.compute_dtype(k, "cpu") for k in demo.WEIGHT_KINDS} == {torch.float32}
    assert [reference_dit.compute_dtype(k, "cuda") for k in ("int8", "bf16", "fp32")] == [
        torch.bfloat16, torch.bfloat16, torch.float32]


@pytest.mark.timeout(300)
def test_demo_without_room_for_its_shared_memory_ends_with_one_line_exit_2(tmp_path: Path) -> None:
    """A shared-memory segment that cannot be reserved ends the demo with one error line naming the limit and the fix,
    exit 2, nothing left.  The limit is the process's file-size limit (RLIMIT_FSIZE, 128 KiB: below the demo's
    larger segments, a weight-store block's 0.2 MiB among them): the segment's page reservation or write then fails
    as on a full /dev/shm (EFBIG instead of ENOSPC),
    without root or a private mount; the /dev/shm message itself is tested on a private tmpfs
    (tests/test_faults_shm.py)."""
    import resource

    env = {**os.environ, "PYTHONPATH": str(ROOT), "H3MS_RUN_DIR": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"}
    limit = 128 << 10
    proc = subprocess.Popen([sys.executable, "-m", "h3ms_async", "demo", *TINY, "--weights", "fp32"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    out, err = proc.communicate(timeout=240)
    errors = [ln for ln in err.replace("\r", "\n").splitlines() if ln.startswith("error: ")]
    assert proc.returncode == 2, err[-3000:]
    assert "Traceback" not in err + out, err[-3000:]
    assert len(errors) == 1 and "/dev/shm" in errors[0] and "ulimit -f" in errors[0], err[-3000:]
    assert err.rstrip().endswith(errors[0]), "the error line is the demo's last word"
    assert glob.glob(f"/dev/shm/h3ms-{proc.pid}-*") == [] and list(tmp_path.glob("h3ms-*")) == []


@pytest.mark.fast
def test_demo_claims_bit_exact_only_for_split_steps() -> None:
    """The verdict covers the steps that ran split; a step the probe sent unsplit compared nothing, so a demo whose
    every step ran unsplit says so instead of "yes", and one unequal split step makes it "no"."""
    from h3ms_async.tools.demo import split_verdict, summary_line

    def step(i: int, split: bool, exact: bool | None) -> dict:
        return {"step": i, "unsplit_s": 1.0, "split_s": 0.5, "split": split, "bit_exact": exact,
                "max_abs_diff": (0.0 if exact else 0.25) if split else None}

    def res(steps: list[dict]) -> dict:
        diffs = [s["max_abs_diff"] for s in steps if s["split"]]
        return {"steps": steps, "bit_exact": split_verdict(steps), "max_abs_diff": max(diffs, default=None),
                "config": {"ranks": ["cpu", "cpu"], "unsplit_device": "cpu"}, "total_s": 3.0}

    none_split = res([step(0, False, None), step(1, False, None)])
    assert none_split["bit_exact"] is None
    assert summary_line(none_split).startswith("bit-exact: not measured - all 2 steps ran unsplit")
    mixed = res([step(0, True, True), step(1, False, None), step(2, True, True)])
    assert summary_line(mixed).startswith(
        "bit-exact: yes - split vs unsplit equal on the 2 split steps of 3 (1 ran unsplit: ")
    differs = res([step(0, True, True), step(1, True, False)])
    assert summary_line(differs).startswith("bit-exact: no - split vs unsplit DIFFERENT (max abs difference 0.25)")
