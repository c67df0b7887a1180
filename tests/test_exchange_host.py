"""Host exchange: real rank subprocesses, real /dev/shm arenas, real eventfd doorbells."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from conftest import run_probe_cases
from h3ms_async.runtime.plans import partition
from h3ms_async.tools.bench.exchange import ProbeGroup
from workers.runtime.shm import Segment
from workers.transports.arena import KIND_NAMES, MAX_OPS_PER_JOB, ArenaLayout, decode_seq, encode_seq
from workers.transports.exchange import ExchangeAborted, ExchangeChunkMismatch, ExchangeTimeout
from workers.transports.host import HostExchange
from workers.transports.probe import run_case

SHARES = [1.0, 1.0, 0.7]


def _layout(world: int, tokens: int, heads: int, head_dim: int, dtype: str, qkv: bool = True) -> ArenaLayout:
    shares = [SHARES[i % len(SHARES)] for i in range(world)]
    # The plan gives every rank a head; fewer heads than ranks (ranks with no columns) checks the exchange's edge.
    hb = partition(heads, shares) if heads >= world else [min(r, heads) for r in range(world + 1)]
    return ArenaLayout.plan(world, partition(tokens, shares), [h * head_dim for h in hb], heads * head_dim, dtype,
                            head_dim, qkv)


pytestmark = pytest.mark.usefixtures("no_exchange_leaks")


class _Local:
    """Arena + control + doorbells in this process, for in-process ranks."""

    def __init__(self, layout: ArenaLayout) -> None:
        self.layout = layout
        self.shm = Segment.create(layout.nbytes + 4096, "xtest")
        self.arena = self.shm.base_tensor()[: layout.nbytes]
        self.control = self.shm.base_tensor()[layout.nbytes:].view(torch.int64)
        layout.init_header(self.arena)
        self.fds = [os.eventfd(0, os.EFD_NONBLOCK) for _ in range(layout.world)]

    def exchange(self, rank: int, deadline_s: float = 5.0) -> HostExchange:
        return HostExchange(rank, self.layout.world, self.arena, self.layout, self.fds, self.control, deadline_s)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.arena = self.control = None
        self.shm.close()


def _in_threads(loc: _Local, target, world: int, timeout_s: float) -> None:
    """``target(rank)`` for every rank, each in a thread of its own; then the arena is closed."""
    try:
        threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout_s)
    finally:
        loc.close()


def test_layout_plan_is_aligned_and_round_trips():
    lay = _layout(3, 29, 7, 4, "bfloat16")
    assert lay.tokens_bounds == (0, 11, 22, 29) and lay.col_bounds[-1] == 28
    offsets = [lay.header_bytes, lay.g_offset, *lay.a_offsets, lay.nbytes]
    assert all(o % 4096 == 0 for o in offsets)
    assert lay.a_offsets[0] >= lay.g_offset + 29 * 28 * 2
    assert ArenaLayout.from_dict(lay.to_dict()) == lay
    with pytest.raises(ValueError, match="tokens_bounds must have world"):
        ArenaLayout.plan(2, [0, 3], [0, 1, 2], 4, "float32")
    with pytest.raises(ValueError, match="never decrease"):
        ArenaLayout.plan(2, [0, 3, 2], [0, 1, 2], 4, "float32")
    with pytest.raises(ValueError, match="not supported"):
        ArenaLayout.plan(1, [0, 3], [0, 2], 4, "complex64")
    bad = dict(lay.to_dict(), nbytes=lay.nbytes + 1)
    with pytest.raises(ValueError, match="different code versions"):
        ArenaLayout.from_dict(bad)


def test_sequence_word_round_trips():
    for kind in KIND_NAMES:
        w = encode_seq(0xABCD, 16383, MAX_OPS_PER_JOB, kind, 255, 255)
        assert w > 0 and decode_seq(w) == (0xABCD, 16383, MAX_OPS_PER_JOB, kind, 255, 255)


@pytest.mark.parametrize("world", [1, 3])
def test_counters_count_chunks_signals_and_bytes(world):
    """What every op publishes and rings (the conformance test checks the results): one sequence-word step
    per chunk, a doorbell per peer for each, nothing for a rank without peers."""
    loc = _Local(_layout(world, 29, 7, 4, "bfloat16"))
    case = {"transport": "host", "layout": loc.layout.to_dict(), "chunks": [8], "rounds": 2, "blocks": 2,
            "overlap": True}
    results: list[dict] = [{} for _ in range(world)]

    def rank(r: int) -> None:
        ex = loc.exchange(r, deadline_s=30)
        try:
            results[r] = run_case(r, case, [("host", ex)])
        finally:
            ex.close()

    _in_threads(loc, rank, world, 60)
    for res in results:
        assert res["ok"], res.get("failures")
        st = res["runs"][0]["stats"]
        # 2 rounds x 2 blocks x (5 ops of 8 chunks (gather, all-to-all, q/k/v all-to-all, all-to-all in 8 head
        # pieces, gather of 8 produced pieces) + the q/k/v-in, output-back op of 16 (8 head pieces, each twice) + the
        # one-chunk gather each)
        assert st["chunks_published"] == 228 and st["ops"] == 28
        assert st["signals_sent"] >= 228 * (world - 1)
        assert (st["bytes_read"] > 0) == (world > 1) and (st["signals_sent"] > 0) == (world > 1)


def test_dead_rank_aborts_the_others_quickly():
    world = 3
    cases = [{"transport": "host", "layout": _layout(world, 17, 5, 4, "bfloat16"), "chunks": [4], "rounds": 2,
              "blocks": 2, "deadline_s": 60}]
    with ProbeGroup(world, cases, stall={"rank": 1, "op": 3, "sleep_s": 60}) as grp:
        grp.start()
        grp.wait_line(1, "stalled", timeout_s=60)
        grp.kill(1)
        time.sleep(0.3)  # the survivors are asleep on their doorbells by now
        t_abort = grp.abort()
        # The abort latency is the error's own timestamp (asserted below). A survivor's exit afterwards is torch's
        # interpreter teardown: about a second of CPU that took 5-10 s on a loaded 2-core box, so it is not timed.
        for r in (0, 2):
            grp.procs[r].wait(timeout=60)
        survivors = [grp.record(r) for r in (0, 2)]
    for rec in survivors:
        assert rec["error"] and rec["error"]["type"] == "ExchangeAborted", rec
        assert rec["error"]["t"] - t_abort < 2.0
        assert rec["returncode"] == 3


def test_deadline_names_the_missing_rank_and_op():
    loc = _Local(_layout(2, 8, 2, 4, "float32"))
    try:
        quiet = loc.exchange(1)
        quiet.begin(0)  # rank 1 joins the job but never sends
        ex = loc.exchange(0, deadline_s=0.3)
        ex.begin(0)
        t = time.monotonic()
        with pytest.raises(ExchangeTimeout, match=r"all_gather_rows op 1 chunk 1/2: no data from rank\(s\) \[1\]"):
            ex.all_gather_rows(torch.zeros(4, 8), 2)
        assert 0.25 < time.monotonic() - t < 2.0
        fresh = _Local(_layout(2, 8, 2, 4, "float32"))
        try:
            lonely = fresh.exchange(0, deadline_s=0.2)
            lonely.begin(0)
            with pytest.raises(ExchangeTimeout, match=r"rank\(s\) \[1\] to begin this job"):
                lonely.all_gather_rows(torch.zeros(4, 8), 0)
        finally:
            fresh.close()
    finally:
        loc.close()


def test_chunk_count_mismatch_is_a_clear_error_on_every_rank():
    loc = _Local(_layout(2, 10, 2, 4, "float32"))
    errors: dict[int, BaseException] = {}

    def run(rank: int, chunks: int) -> None:
        ex = loc.exchange(rank, deadline_s=5.0)
        ex.begin(0)
        try:
            ex.all_gather_rows(torch.zeros(5, 8), chunks)
        except BaseException as e:  # noqa: BLE001 - collected for the assertions
            errors[rank] = e

    try:
        t = time.monotonic()
        threads = [threading.Thread(target=run, args=(0, 2)), threading.Thread(target=run, args=(1, 3))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(10)
        assert time.monotonic() - t < 3.0
        assert set(errors) == {0, 1}
        for e in errors.values():
            assert isinstance(e, ExchangeChunkMismatch), e
            assert "exchange_chunks" in str(e)
    finally:
        loc.close()


def test_abort_generation_checked_at_begin_and_inputs_validated():
    loc = _Local(_layout(2, 10, 2, 4, "float32"))
    try:
        ex = loc.exchange(0)
        loc.control[0] = 4
        with pytest.raises(ExchangeAborted, match="generation 4"):
            ex.begin(3)
        ex.begin(4)
        with pytest.raises(ValueError, match=r"input must be float32 \[5, 8\]"):
            ex.all_gather_rows(torch.zeros(4, 8), 0)
        with pytest.raises(ValueError, match="chunks must be an int in 0..255"):
            ex.all_gather_rows(torch.zeros(5, 8), 300)
        with pytest.raises(ValueError, match="one doorbell fd per rank"):
            HostExchange(0, 2, loc.arena, loc.layout, loc.fds[:1], loc.control, 1.0)
    finally:
        loc.close()


@pytest.mark.parametrize("op", ["all_gather_rows_produced", "all_to_all_heads"])
def test_a_produced_pieces_op_takes_the_peers_pieces_before_it_waits_for_its_own_last(op):
    """After a rank's last piece only that piece's two hops are left: by the time it waits for its own last copy out,
    it has already taken (queued the copies in of) every earlier piece of its peer."""
    pieces = 4
    lay = _layout(2, 32, 8, 4, "float32")
    loc = _Local(lay)
    logs: list[list[str]] = [[], []]
    results: dict[int, torch.Tensor] = {}
    errors: dict[int, BaseException] = {}
    full_rows = torch.arange(32 * lay.row_width, dtype=torch.float32).view(32, lay.row_width)
    attn = torch.arange(32 * lay.columns, dtype=torch.float32).view(32, lay.columns).neg()

    def run(rank: int) -> None:
        log = logs[rank]

        def to_host_async(dst: torch.Tensor, src: torch.Tensor):
            dst.copy_(src)
            return lambda: log.append("wait")

        def to_device(dst: torch.Tensor, src: torch.Tensor) -> None:
            dst.copy_(src)
            log.append("in")

        ex = HostExchange(rank, 2, loc.arena, lay, loc.fds, loc.control, 10.0, to_host_async=to_host_async,
                          to_device=to_device)
        try:
            ex.begin(0)
            t0, t1 = lay.rows(rank)
            c0 = lay.cols(rank)[0]
            if op == "all_gather_rows_produced":
                results[rank] = ex.all_gather_rows_produced(lambda a, b: full_rows[t0 + a : t0 + b], pieces)
            else:
                results[rank] = ex.all_to_all_heads(lambda ca, cb: attn[:, c0 + ca : c0 + cb], pieces)
        except BaseException as e:  # noqa: BLE001 - collected for the assertions
            errors[rank] = e
        finally:
            ex.close()

    _in_threads(loc, run, 2, 30)
    assert not errors, errors
    for rank, log in enumerate(logs):
        t0, t1 = lay.rows(rank)
        want = full_rows if op == "all_gather_rows_produced" else attn[t0:t1]
        assert torch.equal(results[rank], want)
        assert log.count("wait") == pieces and log.count("in") == pieces, log
        last_wait = len(log) - 1 - log[::-1].index("wait")
        assert log[:last_wait].count("in") == pieces - 1, log
