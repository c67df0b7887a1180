"""A rank program is a plug-in: a program written outside the pack runs on the real pool and engine base.

The ``tally`` program below lives in a temporary ``workers/tally/`` (declared messages + handlers, the layout of
``workers/dit``), and its coordinator side is a few lines on :class:`h3ms_async.runtime.engines.Engine`.  Nothing in
the pool, the transports, the worker entry or the release routes names it; the test checks that the workers import
only the runtime and this program, that a kind of another program is refused before it reaches the wire, that a
killed rank fails the job at once with its log lines, that an interrupt aborts every rank, and that the release
route stops it with every other engine.
"""
import os
import importlib
import signal
import textwrap
import threading
import time

import psutil
import pytest
import torch

import workers
from h3ms_async.observability.routes import action_release_workers
from h3ms_async.runtime.coordinator import get_coordinator
from h3ms_async.runtime.engines import Engine, EngineRegistry, live_engines, release_engines
from h3ms_async.runtime.pool import WorkerPool
from h3ms_async.runtime.worker_handle import WorkerError
from h3ms_async.status.hub import get_hub
from workers.runtime import protocol
from workers.runtime.shm import Arena, held_shm
from workers.testing import protocol as test_protocol
from workers.vae.protocol import VaeDrop

PROTOCOL = '''
from typing import ClassVar

from workers.runtime.protocol import Answer, Request, TensorDesc


class Tallied(Answer):
    total: int


class TallyAdd(Request, tag="tally_add"):
    x: TensorDesc
    ANSWER: ClassVar[type[Answer]] = Tallied


class Modules(Answer):
    modules: list[str]


class TallyModules(Request, tag="tally_modules"):
    ANSWER: ClassVar[type[Answer]] = Modules
'''

RANK = '''
import sys

from workers.runtime.handlers import handler
from workers.tally.protocol import Modules, Tallied, TallyAdd, TallyModules


@handler(TallyAdd)
async def _add(ctx, msg: TallyAdd):
    """Add the sum of a tensor in shared memory to this rank's resident total."""
    x = ctx.segment(msg.x.seg).tensor(msg.x)
    ctx.state["total"] = ctx.state.get("total", 0) + int(x.sum()) * (ctx.rank + 1)
    return Tallied(total=ctx.state["total"])


@handler(TallyModules)
async def _modules(ctx, msg: TallyModules):
    return Modules(modules=sorted(m for m in sys.modules if m.startswith("workers.")))
'''


class TallyError(RuntimeError):
    pass


class TallyInterrupted(TallyError):
    pass


TALLY = EngineRegistry("tally", "tally workers", {}, get_hub)


class TallyEngine(Engine):
    """The coordinator side: one shm input, and the ranks' running totals as resident state."""

    error = TallyError
    interrupted = TallyInterrupted

    def __init__(self, devices, program_path, messages):
        super().__init__(WorkerPool(devices, name="tally", program="tally", env={"PYTHONPATH": program_path}), TALLY)
        self.messages = messages  # the program's workers/tally/protocol.py
        self.arena = None

    def add(self, x: torch.Tensor) -> list[int]:
        with self.job():
            if self.arena is None:
                self.arena = Arena(self.pool.create_segment(1 << 16, "tally"))
                self.desc = self.arena.alloc("int64", [16])
            self.arena.segment.tensor(self.desc).copy_(x)
            add = self.messages.TallyAdd(x=self.desc)
            results = self.run(self.pool.all([add] * self.pool.world_size, 30), 60, "tally")
            return [r.total for r in results]

    def _drop_resident(self):
        self.arena = None  # the pool unlinked its segment


@pytest.fixture
def tally(tmp_path, monkeypatch):
    program = tmp_path / "workers" / "tally"
    program.mkdir(parents=True)
    (program / "protocol.py").write_text(textwrap.dedent(PROTOCOL))
    (program / "rank.py").write_text(textwrap.dedent(RANK))
    # the coordinator imports the program's messages only (as the engines import workers/<program>/protocol.py)
    monkeypatch.setattr(workers, "__path__", [*workers.__path__, str(tmp_path / "workers")])
    messages = importlib.import_module("workers.tally.protocol")
    engine = TALLY.get(("cpu", "cpu"), lambda: TallyEngine(["cpu", "cpu"], str(tmp_path), messages))
    yield engine
    TALLY.release_all()


def _run(coro, timeout=60):
    return get_coordinator().run(coro, timeout)


def test_a_program_from_outside_the_pack_runs_on_the_pool(tally):
    shm_before = held_shm(os.getpid())
    x = torch.arange(16, dtype=torch.int64)
    assert tally.add(x) == [120, 240]
    assert tally.add(x) == [240, 480]  # the ranks' totals are resident
    assert TALLY.get(("cpu", "cpu"), lambda: pytest.fail("a second engine")) is tally and tally in live_engines()

    serves = tally.pool._workers[0].serves  # from the worker's answer to the admission ping
    assert {"tally_add", "tally_modules", "echo"} <= serves and "dit_step" not in serves
    # the kinds are listed once, not on every ping
    assert _run(tally.pool.request(0, protocol.Ping(), timeout=10)).serves is None
    modules = _run(tally.pool.request(1, tally.messages.TallyModules(), timeout=10)).modules
    assert "workers.tally.rank" in modules
    assert not [m for m in modules if m.split(".")[1] in ("dit", "vae", "attention")], modules

    # a kind of another program is refused here, before it can reach (and kill) a worker that does not know it
    with pytest.raises(ValueError, match=r"rank program tally\) does not serve 'vae_drop'"):
        _run(tally.pool.request(0, VaeDrop(job=1), timeout=10))
    assert [w["state"] for w in tally.pool.snapshot()] == ["ready", "ready"]

    # the release route stops every engine, this program's too
    pids = [w["pid"] for w in tally.pool.snapshot()]
    assert "tally workers released (1 engine(s))" in action_release_workers()["message"]
    assert not tally.pool.running and tally.arena is None and TALLY.cached() == []
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert held_shm(os.getpid()) <= shm_before


def test_a_killed_rank_fails_the_job_at_once_and_an_interrupt_aborts_it(tally):
    _run(tally.pool.start(), 120)
    pid = tally.pool.snapshot()[1]["pid"]
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(TallyError) as ei:
        tally.run(tally.pool.all([test_protocol.Sleep(seconds=60)] * 2, 90), 90, "a long tally")
    assert time.monotonic() - t0 < 5
    assert "worker rank 1 on cpu" in str(ei.value) and "killed by SIGKILL" in str(ei.value)
    assert "rank1 INFO rank 1/2 ready on cpu" in str(ei.value)  # the dead rank's own log lines

    # an interrupt aborts every rank's wait at once (after the restart the dead rank asks for)
    _run(tally.pool.start(), 120)
    fired = time.monotonic() + 0.5
    with pytest.raises(TallyInterrupted, match="a long tally interrupted; every rank was aborted"):
        tally.run(tally.pool.all([test_protocol.Sleep(seconds=60)] * 2, 90), 90, "a long tally",
                  interrupt=lambda: time.monotonic() > fired)
    assert time.monotonic() - fired < 4 and not tally.pool.busy
    assert tally.add(torch.ones(16, dtype=torch.int64)) == [16, 32]  # fresh workers: fresh totals


def test_an_unknown_program_fails_the_start_with_its_reason():
    pool = WorkerPool(["cpu"], name="nosuch", program="nosuch")
    with pytest.raises(WorkerError, match="exited with code 2 during start") as ei:
        _run(pool.start(), 120)
    assert "rank program 'nosuch': there is no module workers.nosuch.rank" in str(ei.value)
    with pytest.raises(ValueError, match="rank program 'No-Such'"):
        WorkerPool(["cpu"], program="No-Such")


def test_registries_key_engines_by_process_key_not_per_call_settings():
    from h3ms_async.attention import engine as ap
    from h3ms_async.vae import split as vae_split

    eng = ap.get_engine(["cpu", "cpu"], (1.0, 1.0))
    eng._splits[("shape",)] = [0, 1, 8]  # a split tuned under these shares
    assert ap.get_engine(["cpu", "cpu"], (1.0, 3.0)) is eng  # shares: per call, the helpers stay
    assert eng.shares == (1.0, 3.0) and eng._splits == {} and eng.head_bounds(8) == [0, 2, 8]
    with pytest.raises(ap.plans.GPUSelectionError, match="shares: 3 value"):
        ap.get_engine(["cpu", "cpu"], (1.0, 1.0, 1.0))
    three = ap.get_engine(["cpu", "cpu", "cpu"])  # other devices need other helpers: a new engine, the old one goes
    assert three is not eng and ap.ENGINES.cached() == [three]
    assert vae_split.get_vae_engine(["cpu", "cpu"]) is vae_split.get_vae_engine(["cpu", "cpu"])
    released = {reg.program: n for reg, n, _ in release_engines()}
    assert released["attention"] == 1 and released["vae"] == 1
    assert ap.ENGINES.cached() == [] and vae_split.ENGINES.cached() == []
