"""Every exchange against the spec (``workers.transports.exchange``): each collective of each
implementation, one shot, chunked (more chunks than a rank has rows included), in head pieces and in
produced row pieces, on
uneven shares (a rank of one row, a rank without rows, a rank without heads), on 1 to 8 ranks, in
bf16 and fp32, with and without the q/k/v all-to-all, each result checked with ``torch.equal`` by
the exchange probe (``workers.transports.probe.run_case``).

An implementation is one line of ``IMPLEMENTATIONS``: its name and either how one rank builds it in
a thread of this process (over a :class:`Rig`: the shm arena, abort word and doorbells of the host
exchange, the shared buffers of the in-process one) or the probe transport whose rank processes run
it (``ProbeGroup``).  The CUDA ones skip without a GPU (``nccl``: without one GPU per rank);
``cuda-ipc`` (the GPU-direct exchange) spreads its ranks over the GPUs when every pair reaches the
other by peer access, else puts them all on one GPU as logical ranks.  ``cuda-ipc-cpu`` runs the same
exchange on CPU rank processes through the test stand-in (``workers/testing/ipc_cpu.py``: each rank's
send buffer a shm segment, its "IPC handle" the segment's id), so all of it but the CUDA calls runs
without a GPU; the tests after the matrix add send-buffer parts larger than a page, a rank that never
shares its buffer (the others fail at the op's deadline) and an abort while they wait for it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from h3ms_async.runtime.plans import partition
from h3ms_async.tools.bench.exchange import ProbeGroup
from workers.runtime.shm import Segment
from workers.transports.arena import ArenaLayout
from workers.transports.exchange import Exchange, ExchangeBase, IdentityExchange, NoExchange
from workers.transports.host import HostExchange
from workers.transports.local import LocalArena, LocalExchange
from workers.transports.probe import case_layout, run_case

pytestmark = pytest.mark.usefixtures("no_exchange_leaks")

WORLDS = (1, 2, 3, 5, 8)
#: The worlds of the implementations that start rank processes (seconds per world): 5 ranks add no case that 3
#: (uneven, a one-row rank) and 8 (ranks without rows or heads) do not already hold.
PROCESS_WORLDS = (1, 2, 3, 8)
HEAD_DIM = 2
#: Uneven token bounds per world: a rank of one row from 2 ranks on, one without rows at 8.
TOKENS = {
    1: [0, 9],
    2: [0, 1, 12],
    3: [0, 7, 8, 17],
    5: [0, 5, 9, 10, 16, 21],
    8: [0, 3, 7, 8, 12, 12, 17, 20, 25],
}
#: Head bounds per world: uneven groups, a rank without heads at 8.
HEADS = {
    1: [0, 3],
    2: [0, 2, 3],
    3: [0, 2, 3, 5],
    5: [0, 2, 3, 4, 6, 7],
    8: [0, 1, 2, 3, 3, 4, 5, 6, 7],
}
DEADLINE_S = 30.0
#: The probe ranks' environment for the GPU-direct exchange on CPU ranks (``workers/testing/ipc_cpu.py``).
IPC_CPU = (("H3MS_TEST_HOOKS", "1"), ("H3MS_CUDA_IPC_CPU", "1"))
#: A probe case's GPU-direct exchange ordered by CUDA IPC events.
EVENTS = (("ipc_sync", "events"),)


def _cases(world: int, full: bool) -> list[dict]:
    """The cases every implementation of ``world`` ranks runs: the uneven bf16 plan with the q/k/v
    blocks in 0, 3 and 13 chunks (13: more than any rank has rows), and a partitioned fp32 plan
    without them in 2.  ``full`` False (an exchange without a layout): gather and all-to-all
    only."""
    shares = [(1.0, 1.0, 0.7)[r % 3] for r in range(world)]
    uneven = ArenaLayout.plan(
        world, TOKENS[world], [h * HEAD_DIM for h in HEADS[world]], 6, "bfloat16", HEAD_DIM, full
    )
    even = ArenaLayout.plan(
        world,
        partition(4 * world + 3, shares),
        [h * HEAD_DIM for h in partition(world + 2, shares)],
        5,
        "float32",
        HEAD_DIM,
    )
    common = {"rounds": 2, "blocks": 2, "seed": world, "deadline_s": DEADLINE_S, "overlap": full}
    return [
        {"name": "uneven", "layout": uneven, "chunks": [0, 3, 13], **common},
        {"name": "partitioned", "layout": even, "chunks": [2], **common},
    ]


class Rig:
    """What the rank threads of one case share: the host exchange's arena, abort word and doorbells,
    and the in-process exchange's buffers (each made when first asked for)."""

    def __init__(self, layout: ArenaLayout, device: Callable[[int], torch.device]) -> None:
        self.layout, self.device = layout, device
        self._shm: Segment | None = None
        self.fds: list[int] = []
        self._local: LocalArena | None = None
        self._lock = threading.Lock()
        self.barrier = threading.Barrier(layout.world, timeout=DEADLINE_S)

    def host_args(self, rank: int) -> tuple:
        """``HostExchange``'s positional arguments for ``rank``."""
        with self._lock:
            if self._shm is None:
                self._shm = Segment.create(self.layout.nbytes + 4096, "xconf")
                self.layout.init_header(self._shm.base_tensor()[: self.layout.nbytes])
                self.fds = [os.eventfd(0, os.EFD_NONBLOCK) for _ in range(self.layout.world)]
        base = self._shm.base_tensor()
        arena, control = base[: self.layout.nbytes], base[self.layout.nbytes :].view(torch.int64)
        return rank, self.layout.world, arena, self.layout, self.fds, control, DEADLINE_S

    def local(self) -> LocalArena:
        with self._lock:
            if self._local is None:
                self._local = LocalArena(self.layout, self.device(0), self.barrier.wait)
        return self._local

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        if self._shm is not None:
            self._shm.close()
        self._local = None


def _cuda_host(rig: Rig, rank: int) -> Exchange:
    from workers.dit.cuda import CudaExchange

    return CudaExchange.over_host(rig.device(rank), *rig.host_args(rank))


@dataclass(frozen=True)
class Impl:
    """One exchange implementation under test: ``build(rig, rank)`` makes a rank thread's, or
    ``probe`` names the transport of the probe's rank processes."""

    name: str
    build: Callable[[Rig, int], Exchange] | None = None
    probe: str | None = None
    worlds: tuple[int, ...] = WORLDS
    cuda: bool = False
    full: bool = True  # False: no layout, so no q/k/v all-to-all and no head pieces
    shares_gpus: bool = False  # ranks may share a GPU (logical ranks)
    env: tuple[tuple[str, str], ...] = ()  # the probe ranks' extra environment
    case: tuple[tuple[str, str], ...] = ()  # what every case of the probe adds (its ordering)


IMPLEMENTATIONS = [
    Impl("host", lambda rig, rank: HostExchange(*rig.host_args(rank))),
    Impl("gloo", probe="gloo", worlds=PROCESS_WORLDS),
    Impl("simulated", lambda rig, rank: LocalExchange(rank, rig.local())),
    Impl("none", lambda rig, rank: NoExchange(rank, rig.layout), worlds=(1,)),
    Impl("identity", lambda rig, rank: IdentityExchange(), worlds=(1,), full=False),
    Impl("cuda-host", _cuda_host, cuda=True),
    Impl("nccl", probe="nccl", cuda=True),
    Impl("cuda-ipc", probe="cuda_ipc", cuda=True, shares_gpus=True),
    Impl("cuda-ipc-cpu", probe="cuda_ipc", env=IPC_CPU, worlds=PROCESS_WORLDS),
    Impl("cuda-ipc-events", probe="cuda_ipc", cuda=True, shares_gpus=True, case=EVENTS),
    Impl("cuda-ipc-events-cpu", probe="cuda_ipc", env=IPC_CPU, case=EVENTS, worlds=PROCESS_WORLDS),
]


def _devices(impl: Impl, world: int) -> list[str]:
    if not impl.cuda:
        return ["cpu"] * world
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: run the CUDA exchanges on a GPU machine")
    count = torch.cuda.device_count()
    if impl.shares_gpus:
        peers = all(torch.cuda.can_device_access_peer(a, b) for a in range(count) for b in range(count) if a != b)
        return [f"cuda:{r % count if peers else 0}" for r in range(world)]
    if impl.probe and count < world:
        pytest.skip(f"{impl.name} needs one GPU per rank: {world} ranks, {count} GPU(s)")
    return [f"cuda:{r % count}" for r in range(world)]


def _in_threads(impl: Impl, world: int, cases: list[dict], devices: list[str]) -> list[dict]:
    """Every case on ``world`` rank threads of this process; each rank's result records."""
    assert impl.build is not None
    rigs = [Rig(c["layout"], lambda r: torch.device(devices[r])) for c in cases]
    results: list[list[dict]] = [[] for _ in range(world)]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            for case, rig in zip(cases, rigs):
                ex = impl.build(rig, r)
                try:
                    dev = torch.device(devices[r])
                    results[r].append(run_case(r, case, [(impl.name, ex)], device=dev))
                finally:
                    ex.close()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
            for rig in rigs:
                rig.barrier.abort()  # the other ranks stop waiting for this one

    threads = [threading.Thread(target=rank, args=(r,), name=f"xconf-{r}") for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for rig in rigs:
            rig.close()
    if errors:  # the first cause, not the others' broken barrier
        raise next(
            (e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0]
        )
    return [case_result for per_rank in results for case_result in per_rank]


def _in_processes(impl: Impl, world: int, cases: list[dict], devices: list[str]) -> list[dict]:
    """Every case on ``world`` probe rank processes; each rank's result records."""
    with (
        pytest.MonkeyPatch.context() as mp,
        ProbeGroup(world, [dict(c, transport=impl.probe, **dict(impl.case)) for c in cases], devices=devices) as grp,
    ):
        for name, value in impl.env:
            mp.setenv(name, value)
        grp.start()
        recs = grp.results(timeout_s=120)
    for rec in recs:
        assert rec["error"] is None, rec["error"]
    return [case_result for rec in recs for case_result in rec["cases"]]


@pytest.mark.parametrize(
    "impl,world",
    [pytest.param(i, w, id=f"{i.name}-{w}") for i in IMPLEMENTATIONS for w in i.worlds],
)
def test_every_collective_equals_the_spec(impl: Impl, world: int) -> None:
    devices = _devices(impl, world)
    cases = _cases(world, impl.full)
    run = _in_processes if impl.probe else _in_threads
    results = run(impl, world, cases, devices)
    assert len(results) == world * len(cases)
    failures = [f for res in results for f in res["failures"]]
    assert not failures, failures[:20]
    # every op ran: gather and all-to-all, the q/k/v all-to-all on a qkv plan, head pieces (of the
    # q/k/v too on a qkv plan), the gather handing rows over and the gather of produced row pieces
    # with "overlap"
    ops = sum(
        len(v) for res in results for r in res["runs"] for k, v in r.items() if k.endswith("_s")
    )
    per_block = [2 + (1 + c["overlap"]) * bool(c["layout"].q_offsets) + 3 * c["overlap"] for c in cases]
    runs = [len(c["chunks"]) * c["rounds"] * c["blocks"] for c in cases]
    assert ops == world * sum(n * k for n, k in zip(runs, per_block))


def test_transports_move_bytes_only():
    """Every implementation with a layout takes the ops, their checks and their results from
    ExchangeBase: a bad input fails alike on each, naming what the op expected."""
    from workers.dit.cuda import CudaExchange
    from workers.transports.cuda_ipc import CudaIpcExchange
    from workers.transports.dist import DistExchange

    ops = (
        "all_gather_rows",
        "all_gather_rows_each",
        "all_gather_rows_produced",
        "all_to_all_cols",
        "all_to_all_qkv",
        "all_to_all_qkv_attend",
        "all_to_all_heads",
    )
    for cls in (HostExchange, DistExchange, LocalExchange, NoExchange, CudaExchange, CudaIpcExchange):
        assert issubclass(cls, ExchangeBase)
        assert all(getattr(cls, op) is getattr(ExchangeBase, op) for op in ops), cls
    lay = _cases(2, True)[0]["layout"]
    rig = Rig(lay, lambda r: torch.device("cpu"))
    bad_rows = r"rank 0: all_gather_rows input must be bfloat16 \[1, 6\]"
    try:
        for ex in (
            HostExchange(*rig.host_args(0)),
            LocalExchange(0, rig.local()),
            NoExchange(0, lay),
        ):
            ex.begin(0)
            with pytest.raises(ValueError, match=bad_rows):
                ex.all_gather_rows(torch.zeros(2, 6, dtype=torch.bfloat16))
            with pytest.raises(ValueError, match=r"exchange chunks must be an int in 0..255"):
                ex.all_to_all_cols(torch.zeros(12, 4, dtype=torch.bfloat16), 256)
            with pytest.raises(ValueError, match=r"all_to_all_qkv out must be bfloat16 \[12, 12\]"):
                ex.all_to_all_qkv(torch.zeros(1, 18, dtype=torch.bfloat16), out=torch.zeros(1))
            with pytest.raises(ValueError, match=r"head pieces must be an int"):
                ex.all_to_all_heads(lambda a, b: torch.zeros(12, b - a), -1)
            with pytest.raises(ValueError, match=r"head pieces must be at most 127, got 128"):
                ex.all_to_all_qkv_attend(torch.zeros(1, 18, dtype=torch.bfloat16), 128, print)
            with pytest.raises(ValueError, match=r"head pieces must be an int"):
                ex.all_to_all_qkv_attend(torch.zeros(1, 18, dtype=torch.bfloat16), -1, print)
            with pytest.raises(ValueError, match=r"row pieces must be an int in 0..255"):
                ex.all_gather_rows_produced(lambda a, b: torch.zeros(b - a, 6), 256)
            if not isinstance(ex, HostExchange):  # its op would first wait for rank 1 to begin
                with pytest.raises(ValueError, match=r"all_gather_rows_produced piece input must be bfloat16 \[1, 6\]"):
                    ex.all_gather_rows_produced(lambda a, b: torch.zeros(b - a, 6), 2)
            ex.close()
    finally:
        rig.close()


@pytest.mark.parametrize("pieces", [0, 1, 3, 13])
def test_the_unsplit_gather_of_produced_rows(pieces: int) -> None:
    """The identity exchange (the unsplit run, no layout) produces its 9 rows in the pieces one rank of a split
    would and returns them whole."""
    rows = torch.randn(9, 4)
    asked: list[tuple[int, int]] = []

    def produce(a: int, b: int) -> torch.Tensor:
        asked.append((a, b))
        return rows[a:b].clone()

    got = IdentityExchange(tokens=9).all_gather_rows_produced(produce, pieces)
    assert torch.equal(got, rows)
    n = max(1, pieces)
    assert asked == [(9 * j // n, 9 * (j + 1) // n) for j in range(n) if 9 * (j + 1) // n > 9 * j // n]
    with pytest.raises(ValueError, match="need the token count"):
        IdentityExchange().all_gather_rows_produced(produce, pieces)


def test_the_no_exchange_baseline_gives_its_kernels_data_like_a_splits() -> None:
    """The "none" baseline's results hold the rank's own part and, in the other ranks' parts,
    random values of unit scale (the same for every run of that rank), never zeros: a GPU runs
    the same kernels faster on zeros, which would make the baseline faster than the split for a
    reason that has nothing to do with the exchange.  Each op rewrites the rank's part alone."""
    lay = _cases(2, True)[0]["layout"]
    t0, t1 = lay.rows(1)
    c0, c1 = lay.cols(1)
    ex, again = NoExchange(1, lay), NoExchange(1, lay)
    mine = torch.full((t1 - t0, lay.row_width), 3.0, dtype=torch.bfloat16)
    got = ex.all_gather_rows(mine)
    assert torch.equal(got[t0:t1], mine)
    peers = torch.cat([got[:t0], got[t1:]]).float()
    assert peers.numel() > 0 and torch.isfinite(peers).all()
    assert (peers != 0).float().mean() > 0.9 and 0.3 < peers.std() < 3.0
    assert torch.equal(again.all_gather_rows(mine), got)
    before = got.clone()
    ex.all_gather_rows(mine * 2)
    assert torch.equal(got[:t0], before[:t0]) and torch.equal(got[t1:], before[t1:])
    cols = ex.all_to_all_cols(torch.ones(lay.tokens, c1 - c0, dtype=torch.bfloat16))
    assert torch.equal(cols[:, c0:c1], torch.ones(t1 - t0, c1 - c0, dtype=torch.bfloat16))
    others = torch.cat([cols[:, :c0], cols[:, c1:]], dim=1).float()
    assert (others != 0).float().mean() > 0.9 and torch.isfinite(others).all()


def _withheld(deadline_s: float) -> ProbeGroup:
    """Three probe ranks of the GPU-direct exchange on CPU ranks whose rank 1 never shares its buffer."""
    lay = ArenaLayout.plan(3, [0, 4, 7, 9], [0, 2, 4, 6], 6, "float32", HEAD_DIM)
    case = {"transport": "cuda_ipc", "layout": lay, "chunks": [2], "rounds": 1, "blocks": 1, "deadline_s": deadline_s}
    return ProbeGroup(3, [case])


def _ipc_cpu_env(mp: pytest.MonkeyPatch, **extra: str) -> None:
    for name, value in IPC_CPU + tuple(extra.items()):
        mp.setenv(name, value)


def test_gpu_direct_waits_for_a_peer_that_never_shares_until_the_deadline(monkeypatch):
    """A rank that begins the job without handing its buffer over: the others fail at the first op's deadline,
    naming it (no hang)."""
    _ipc_cpu_env(monkeypatch, H3MS_TEST_IPC_WITHHOLD_RANK="1")
    with _withheld(deadline_s=2.0) as grp:
        grp.start()
        recs = grp.results(timeout_s=120)
    for r in (0, 2):
        err = recs[r]["error"]
        assert err and err["type"] == "ExchangeTimeout", recs[r]
        assert f"rank {r}: cuda_ipc: waiting for rank(s) [1] to share their GPU buffers within 2s" in err["message"]
        assert recs[r]["returncode"] == 3
    assert recs[1]["error"] and recs[1]["error"]["type"] == "ExchangeTimeout", recs[1]  # its peers went away


def test_gpu_direct_abort_while_waiting_for_a_peers_buffer(monkeypatch):
    """The abort generation ends the wait for a peer's buffer at once, long before the op's deadline."""
    _ipc_cpu_env(monkeypatch, H3MS_TEST_IPC_WITHHOLD_RANK="1")
    with _withheld(deadline_s=60.0) as grp:
        lay = case_layout(grp.cases[0])
        arena = Segment.attach(grp.cases[0]["arena_ipc"])
        try:
            grp.start()
            end = time.monotonic() + 60
            while not all(lay.seq_words(arena.base_tensor())) and time.monotonic() < end:
                time.sleep(0.05)  # every rank has begun: 0 and 2 can only be waiting for rank 1's buffer
        finally:
            arena.close()
        time.sleep(0.3)
        t_abort = grp.abort()
        recs = grp.results(timeout_s=60)
    for r in (0, 2):
        err = recs[r]["error"]
        assert err and err["type"] == "ExchangeAborted", recs[r]
        assert "during cuda_ipc: waiting for rank(s) [1] to share their GPU buffers" in err["message"]
        assert err["t"] - t_abort < 2.0
    assert recs[1]["error"] and recs[1]["error"]["type"] == "ExchangeAborted", recs[1]


def test_gpu_direct_parts_larger_than_a_page(monkeypatch):
    """Each part of a send buffer several pages long (the matrix's fit in one), so a part's size or offset that
    is wrong makes parts overlap."""
    _ipc_cpu_env(monkeypatch)
    lay = ArenaLayout.plan(3, [0, 40, 41, 90], [h * 8 for h in (0, 4, 5, 8)], 64, "float32", 8)
    case = {"name": "wide", "layout": lay, "chunks": [0, 3], "rounds": 2, "blocks": 2, "seed": 7,
            "deadline_s": DEADLINE_S, "overlap": True}
    results = _in_processes(Impl("cuda-ipc-cpu", probe="cuda_ipc", env=IPC_CPU), 3, [case], ["cpu"] * 3)
    assert [f for res in results for f in res["failures"]] == []


def test_gpu_direct_events_catch_a_rank_that_never_records(monkeypatch):
    """Ordered by events, a rank that publishes its chunks without recording their send events (or its reads
    without its read events) is caught by its peers' first wait: on a GPU that copy would have read bytes not yet
    written."""
    _ipc_cpu_env(monkeypatch, H3MS_TEST_IPC_UNRECORDED_RANK="1")
    lay = ArenaLayout.plan(3, [0, 4, 7, 9], [0, 2, 4, 6], 6, "float32", HEAD_DIM)
    case = {"transport": "cuda_ipc", "layout": lay, "chunks": [2], "rounds": 1, "blocks": 1, "deadline_s": 5.0,
            "ipc_sync": "events"}
    with ProbeGroup(3, [case]) as grp:
        grp.start()
        recs = grp.results(timeout_s=120)
    for r in (0, 2):
        err = recs[r]["error"]
        assert err and err["type"] == "EventOrderError", recs[r]
        assert "found the event's latest record at none" in err["message"], err
