"""h3ms_async/dit/exchange_choice.py: the exchange setting resolved for the rank devices. ``auto`` takes the GPU-direct
exchange only where every rank is on a GPU, the GPUs reach each other and tested_paths lists it on CUDA (not yet:
host staging today); an explicit ``cuda_ipc`` that cannot run is refused in one line naming the input and the fix;
the workers of a GPU-direct split across GPUs see every rank's GPU (a process key of their own)."""
from __future__ import annotations

import pytest
import torch

from h3ms_async.dit import exchange_choice, tested_paths
from h3ms_async.dit.errors import SplitError
from h3ms_async.dit.exchange_choice import ExchangeRefused, resolve
from h3ms_async.dit.options import SplitOptions, process_key
from h3ms_async.dit.split import SplitEngine
from h3ms_async.dit.tested_paths import SplitPath, UntestedPath
from workers.dit.protocol import Transport

pytestmark = pytest.mark.fast

ONE_GPU = ["cuda:0", "cuda:0"]
TWO_GPUS = ["cuda:0", "cuda:1"]


@pytest.fixture
def untested(monkeypatch):
    """The table as it stands: the GPU-direct exchange has no passing CUDA test."""
    monkeypatch.delenv("H3MS_ALLOW_UNTESTED_PATHS", raising=False)
    monkeypatch.setitem(tested_paths.TESTED, "cuda", {})


@pytest.fixture
def peers(monkeypatch):
    """GPUs 0 and 1 reach each other (what the GPU machines with NVLink or PCIe P2P report)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


def test_auto_keeps_host_staging_until_the_gpu_direct_exchange_is_tested(untested):
    for devices in (["cpu", "cpu"], ONE_GPU, TWO_GPUS, ["cuda:0"]):
        assert resolve("auto", devices) is Transport.HOST, devices
    assert SplitEngine(ONE_GPU, SplitOptions(exchange="auto")).transport is Transport.HOST


def test_auto_takes_the_gpu_direct_exchange_once_tested_where_the_gpus_reach_each_other(monkeypatch):
    monkeypatch.delenv("H3MS_ALLOW_UNTESTED_PATHS", raising=False)
    monkeypatch.setitem(tested_paths.TESTED, "cuda", {SplitPath.CUDA_IPC: "tests/test_cuda.py::x"})
    assert resolve("auto", ONE_GPU) is Transport.CUDA_IPC  # logical ranks of one GPU: plain device copies
    assert resolve("auto", ["cuda:0"]) is Transport.HOST  # one rank exchanges nothing
    assert resolve("auto", ["cpu", "cpu"]) is Transport.HOST
    # this machine has no CUDA, so no pair of GPUs reaches the other: host staging stays
    assert resolve("auto", TWO_GPUS) is Transport.HOST
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: torch.device(b).index != 2)
    # tested on one GPU only: between GPUs (peer-to-peer copies) it waits for its own test
    assert resolve("auto", TWO_GPUS) is Transport.HOST
    with pytest.raises(UntestedPath) as exc:
        resolve(Transport.CUDA_IPC, TWO_GPUS)
    assert _one_line(exc).startswith("the GPU-direct exchange across GPUs (cuda_ipc, peer to peer) has no passing")
    monkeypatch.setitem(tested_paths.TESTED["cuda"], SplitPath.CUDA_IPC_P2P, "tests/test_cuda.py::y")
    assert resolve("auto", TWO_GPUS) is Transport.CUDA_IPC
    assert resolve("auto", ["cuda:0", "cuda:2"]) is Transport.HOST  # cuda:0 cannot reach cuda:2


def test_workers_on_the_async_allocator_keep_host_staging(monkeypatch):
    """ComfyUI's --cuda-malloc puts PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync in its environment, which the
    workers inherit; that memory has no CUDA IPC handles: auto keeps host staging, cuda_ipc is refused in one line."""
    monkeypatch.delenv("H3MS_ALLOW_UNTESTED_PATHS", raising=False)
    monkeypatch.setitem(tested_paths.TESTED, "cuda", {SplitPath.CUDA_IPC: "tests/test_cuda.py::x"})
    assert resolve("auto", ONE_GPU) is Transport.CUDA_IPC
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    assert resolve("auto", ONE_GPU) is Transport.HOST
    with pytest.raises(ExchangeRefused) as exc:
        SplitEngine(ONE_GPU, SplitOptions(exchange="cuda_ipc"))
    msg = _one_line(exc)
    assert "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync" in msg and "--disable-cuda-malloc" in msg, msg
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert resolve("auto", ONE_GPU) is Transport.CUDA_IPC


def test_cuda_ipc_on_cpu_ranks_is_refused_naming_the_input_and_the_fix(untested):
    with pytest.raises(ExchangeRefused) as exc:
        SplitEngine(["cpu", "cpu"], SplitOptions(exchange="cuda_ipc"))
    msg = _one_line(exc)
    assert "exchange cuda_ipc" in msg and "CPU ranks" in msg and "set exchange to host" in msg, msg
    with pytest.raises(ExchangeRefused, match="CPU ranks"):
        resolve(Transport.CUDA_IPC, ["cuda:0", "cpu"])


def test_cuda_ipc_untested_on_cuda_is_refused_in_one_line(untested):
    with pytest.raises(UntestedPath) as exc:
        SplitEngine(ONE_GPU, SplitOptions(exchange="cuda_ipc"))
    msg = _one_line(exc)
    assert msg.startswith("the GPU-direct exchange (cuda_ipc) has no passing bit-exactness test on cuda"), msg
    assert msg.endswith("set exchange to host (or auto)"), msg


def test_cuda_ipc_between_gpus_without_peer_access_is_refused(monkeypatch):
    monkeypatch.setenv("H3MS_ALLOW_UNTESTED_PATHS", "1")
    with pytest.raises(ExchangeRefused) as exc:
        SplitEngine(TWO_GPUS, SplitOptions(exchange="cuda_ipc"))
    msg = _one_line(exc)
    assert "cuda:0 cannot reach cuda:1's memory" in msg and "set exchange to host" in msg, msg


def test_gpu_direct_workers_see_every_rank_gpu_and_others_only_their_own(monkeypatch, peers):
    monkeypatch.setenv("H3MS_ALLOW_UNTESTED_PATHS", "1")
    host, ipc = SplitOptions(exchange="host"), SplitOptions(exchange="cuda_ipc")
    # logical ranks of one GPU need no other GPU: the same workers serve host and GPU-direct steps
    assert process_key(ONE_GPU, host) == process_key(ONE_GPU, ipc)
    assert process_key(TWO_GPUS, host) != process_key(TWO_GPUS, ipc)
    eng = SplitEngine(TWO_GPUS, ipc)
    assert eng.worker_gpus == ("cuda:0", "cuda:1") and eng.transport is Transport.CUDA_IPC
    assert [eng._peer_devices(r, Transport.CUDA_IPC) for r in range(2)] == [(0, 1), (1, 0)]
    assert eng._peer_devices(0, Transport.HOST) == ()
    staged = SplitEngine(TWO_GPUS, host)
    assert staged.worker_gpus == ()
    with pytest.raises(SplitError, match="workers must see every rank's GPU"):
        staged._transport("cuda_ipc")  # a per-step override cannot widen running workers' view
    logical = SplitEngine(ONE_GPU, host)
    assert logical._transport("cuda_ipc") is Transport.CUDA_IPC
    assert [logical._peer_devices(r, Transport.CUDA_IPC) for r in range(2)] == [(0, 0), (0, 0)]


def test_the_setting_has_one_vocabulary():
    assert exchange_choice.EXCHANGES == ("host", "nccl", "cuda_ipc", "auto")
    assert exchange_choice.parse("cuda_ipc") is Transport.CUDA_IPC
    assert SplitOptions(exchange="auto").exchange == "auto"
    with pytest.raises(ValueError, match="exchange='p2p' is not one of"):
        SplitOptions(exchange="p2p")


def test_ipc_sync_waits_on_the_host_unless_events_are_asked_and_tested(untested):
    """How the GPU-direct exchange orders its copies: ``auto`` waits on the host (the events ordering measured no
    faster), tested or not; an explicit ``events`` is refused in one line naming the setting and the fix until the
    event ordering has a passing CUDA test, then taken; other transports ignore it."""
    from h3ms_async.dit.exchange_choice import resolve_sync
    from workers.dit.protocol import IpcSync

    assert resolve_sync("auto", Transport.CUDA_IPC, ONE_GPU) is IpcSync.HOST
    assert resolve_sync(IpcSync.HOST, Transport.CUDA_IPC, ONE_GPU) is IpcSync.HOST
    with pytest.raises(UntestedPath) as exc:
        resolve_sync(IpcSync.EVENTS, Transport.CUDA_IPC, ONE_GPU)
    assert _one_line(exc).endswith("set ipc_sync to host (or auto)")
    assert "ordered by CUDA IPC events" in str(exc.value)
    assert resolve_sync(IpcSync.EVENTS, Transport.HOST, ONE_GPU) is IpcSync.HOST
    tested_paths.TESTED["cuda"][SplitPath.CUDA_IPC_EVENTS] = "tests/test_cuda.py::x"  # the fixture restores it
    assert resolve_sync("auto", Transport.CUDA_IPC, ONE_GPU) is IpcSync.HOST
    assert resolve_sync(IpcSync.EVENTS, Transport.CUDA_IPC, ONE_GPU) is IpcSync.EVENTS
    assert SplitOptions(ipc_sync="events").ipc_sync is IpcSync.EVENTS
    with pytest.raises(ValueError, match="ipc_sync='gpu' is not one of"):
        SplitOptions(ipc_sync="gpu")
