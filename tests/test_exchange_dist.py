"""torch.distributed exchange: gloo's counters (``tests/test_exchange_conformance.py`` checks its results); the NCCL
rank-map check."""
from __future__ import annotations


import pytest

from conftest import run_probe_cases
from h3ms_async.runtime.plans import partition
from workers.transports.arena import ArenaLayout
from workers.transports.dist import check_nccl_rank_map, init_group


pytestmark = pytest.mark.usefixtures("no_exchange_leaks")


def test_gloo_runs_one_collective_per_op():
    """Its counters (the conformance test checks the results): every op one collective, whatever its
    chunks or head pieces, and the bytes that crossed."""
    lay = ArenaLayout.plan(2, partition(21, [1.0, 0.7]), [h * 4 for h in partition(6, [1.0, 0.7])], 24,
                           "bfloat16", 4, True)
    case = {"transport": "gloo", "layout": lay, "chunks": [3], "rounds": 2, "blocks": 2, "overlap": True}
    for rec in run_probe_cases(2, [case]):
        st = rec["cases"][0]["runs"][0]["stats"]
        # 2 rounds x 2 blocks x (gather, all-to-all, q/k/v all-to-all, all-to-all by head pieces, q/k/v all-to-all
        # by head pieces, gather each, gather of produced pieces)
        assert st["transport"] == "gloo" and st["ops"] == 28
        assert st["bytes_read"] > 0 and st["bytes_written"] > 0


def test_nccl_refuses_two_ranks_on_one_gpu():
    check_nccl_rank_map(["cuda:0", "cuda:1", "cuda:2"])
    with pytest.raises(ValueError, match=r"ranks \[0, 1\] on cuda:0.*exchange=host"):
        check_nccl_rank_map(["cuda:0", "cuda:0", "cuda:1"])
    with pytest.raises(ValueError, match=r"ranks \[0, 2\] on cuda:0"):
        check_nccl_rank_map(["cuda", "cuda:1", "cuda:0"])
    with pytest.raises(ValueError, match="needs CUDA devices.*exchange=host"):
        check_nccl_rank_map(["cpu", "cpu"])
    # init_group checks the map before touching CUDA or the rendezvous file
    with pytest.raises(ValueError, match="cannot put two ranks on one GPU"):
        init_group(0, 2, "nccl", "/tmp/h3ms-never-created", 5.0, devices=["cuda:1", "cuda:1"])
    with pytest.raises(ValueError, match="absolute path"):
        init_group(0, 2, "gloo", "relative/init", 5.0)
