"""torch.distributed exchange (gloo on CPU) against the host exchange; the NCCL rank-map check."""
from __future__ import annotations


import pytest

from conftest import run_probe_cases
from h3ms_async.runtime.plans import partition
from workers.transports.dist import check_nccl_rank_map, init_group
from workers.transports.host import ArenaLayout


pytestmark = pytest.mark.usefixtures("no_exchange_leaks")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo_equals_host_bit_exact(world):
    shares = [1.0, 1.0, 0.7, 1.0][:world]
    cases = []
    for dt in ("bfloat16", "float32"):
        lay = ArenaLayout.plan(world, partition(19 + world, shares), [h * 4 for h in partition(6, shares)],
                               24, dt, 4, True)
        # "both": every op runs on the host arena and on gloo with the same inputs; each result must be
        # torch.equal to the exact expected tensor, so host == gloo bit for bit
        cases.append({"transport": "both", "layout": lay, "chunks": [0, 3], "rounds": 2, "blocks": 2, "seed": 11,
                      "overlap": True})
    recs = run_probe_cases(world, cases)
    for rec in recs:
        transports = [r["transport"] for r in rec["cases"][0]["runs"]]
        assert transports == ["host", "gloo", "host", "gloo"]
        dist_stats = rec["cases"][0]["runs"][1]["stats"]
        # 2 rounds x 2 blocks x (gather, all-to-all, q/k/v all-to-all, all-to-all by head pieces, gather each: one
        # collective each)
        assert dist_stats["transport"] == "gloo" and dist_stats["ops"] == 20
        assert dist_stats["bytes_read"] > 0


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
