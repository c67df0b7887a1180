"""GPU-set parsing, rank-plan resolution and the largest-remainder partition (docs/comfyui_facts.md §7)."""
from __future__ import annotations

import pytest

from h3ms_async.runtime.plans import (GPUSelectionError, GPUSet, RankPlan, make_split_plan, parse_index_list, parse_shares,
                              partition, rank_map, resolve)

pytestmark = pytest.mark.fast

GIB = 1024 ** 3


def _resolve(gs: GPUSet, primary=0, visible=4, free=None):
    return resolve(gs, primary, visible_count=visible, free_vram=free or (lambda i: None))


@pytest.mark.parametrize("text", ["", "  ", "auto", "ALL", None])
def test_index_list_auto(text) -> None:
    assert parse_index_list(text, "gpus") is None


@pytest.mark.parametrize("text,expect", [("0,1,3", (0, 1, 3)), ("cuda:2; 0", (2, 0)), (" 1 ,, 2;", (1, 2)),
                                         ("CUDA:3", (3,))])
def test_index_list_values(text, expect) -> None:
    assert parse_index_list(text, "gpus") == expect


@pytest.mark.parametrize("text,match", [("0,x", "gpus: 'x' is not a CUDA index \\(use e.g. 0,1,3\\)"),
                                        ("-1", "negative index"), ("1,cuda:1", "cuda:1 listed twice"),
                                        ("1.5", "is not a CUDA index")])
def test_index_list_errors(text, match) -> None:
    with pytest.raises(GPUSelectionError, match=match):
        parse_index_list(text, "gpus")
    assert issubclass(GPUSelectionError, ValueError)


def test_exclude_errors_name_exclude() -> None:
    with pytest.raises(GPUSelectionError, match="^exclude: 'a'"):
        parse_index_list("a", "exclude")
    assert GPUSet.parse(exclude="").exclude == ()


def test_shares_parsing() -> None:
    assert parse_shares("1, 1;0.7") == (1.0, 1.0, 0.7)
    assert parse_shares("") == () and parse_shares(None) == ()
    with pytest.raises(GPUSelectionError, match="shares: 'a' is not a number \\(use e.g. 1,1,0.7\\)"):
        parse_shares("1,a")
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(GPUSelectionError, match="greater than 0"):
            parse_shares(bad)


def test_gpuset_validation_and_describe() -> None:
    with pytest.raises(GPUSelectionError, match="max_gpus must be between 1 and 8"):
        GPUSet(max_gpus=9)
    with pytest.raises(GPUSelectionError, match="max_gpus must be between 1 and 8"):
        GPUSet(max_gpus=0)
    with pytest.raises(GPUSelectionError, match="min_free_vram_gb"):
        GPUSet(min_free_vram_gb=-1)
    with pytest.raises(GPUSelectionError, match="shares: 2 value\\(s\\) for 3 GPU\\(s\\) \\(cuda:0,cuda:1,cuda:3\\)"):
        GPUSet.parse("0,1,2,3", exclude="2", shares="1,1")
    gs = GPUSet.parse("0,1,3", exclude="2", shares="1,0.7,1", min_free_vram_gb=4, max_gpus=4)
    assert gs.describe() == "gpus 0,1,3, exclude 2, shares cuda:0=1,cuda:1=0.7,cuda:3=1, min free 4 GiB, max 4"
    assert GPUSet().describe() == "gpus auto"
    assert GPUSet.legacy(-1) == GPUSet()
    assert GPUSet.legacy(2) == GPUSet(gpus=(2,), implicit_primary=True)


def test_resolve_auto_primary_first() -> None:
    plan = _resolve(GPUSet(), primary=2)
    assert plan.devices == ("cuda:2", "cuda:0", "cuda:1", "cuda:3") and plan.shares == (1.0,) * 4
    assert plan.notes == ()
    assert _resolve(GPUSet(), primary=None).devices[0] == "cuda:0"


def test_resolve_list_order_shares_and_notes() -> None:
    plan = _resolve(GPUSet.parse("3,1,0", shares="0.5,1,2"), primary=0)
    assert plan.devices == ("cuda:0", "cuda:3", "cuda:1") and plan.shares == (2.0, 0.5, 1.0)
    added = _resolve(GPUSet.parse("1,2"), primary=0)
    assert added.devices == ("cuda:0", "cuda:1", "cuda:2")
    assert added.notes == ("added the model's device cuda:0 as rank 0 (not in the gpus list)",)
    legacy = _resolve(GPUSet.legacy(3), primary=1)
    assert legacy.devices == ("cuda:1", "cuda:3") and legacy.notes == ()
    assert "3 rank(s): cuda:0 (primary) share 2, cuda:3 share 0.5, cuda:1" == plan.describe()


def test_resolve_errors() -> None:
    with pytest.raises(GPUSelectionError, match="the model's device cuda:1 is excluded; it must take part"):
        _resolve(GPUSet.parse(exclude="1"), primary=1)
    msg = ("cuda:5 does not exist: 4 CUDA device\\(s\\) visible "
           "\\(CUDA_VISIBLE_DEVICES / --cuda-device limit what ComfyUI sees\\)")
    with pytest.raises(GPUSelectionError, match=msg):
        _resolve(GPUSet.parse("0,5"))
    with pytest.raises(GPUSelectionError, match="cuda:7 does not exist"):
        _resolve(GPUSet.parse(exclude="7"))
    with pytest.raises(GPUSelectionError, match="cuda:4 does not exist"):
        _resolve(GPUSet(), primary=4)
    with pytest.raises(GPUSelectionError, match="shares: 2 value\\(s\\) for 3 GPU\\(s\\)"):
        _resolve(GPUSet.parse(exclude="3", shares="1,1"))
    with pytest.raises(GPUSelectionError, match="no CUDA device"):
        _resolve(GPUSet(), visible=0)


def test_resolve_free_vram_floor_and_max() -> None:
    free = {0: 1 * GIB, 1: 10 * GIB, 2: 2 * GIB, 3: None}
    asked = []

    def probe(i):
        asked.append(i)
        return free[i]

    plan = _resolve(GPUSet(min_free_vram_gb=4), primary=0, free=probe)
    assert plan.devices == ("cuda:0", "cuda:1", "cuda:3")
    assert plan.notes == ("skipped cuda:2: 2.0 GiB free < min_free_vram_gb 4",)
    assert 0 not in asked  # the primary is never checked
    capped = _resolve(GPUSet(max_gpus=2), primary=1)
    assert capped.devices == ("cuda:1", "cuda:0") and capped.notes == ("max_gpus 2: dropped cuda:2, cuda:3",)
    limited = RankPlan(("cuda:0", "cuda:1", "cuda:2"), (1.0, 1.0, 1.0)).limited(2)
    assert limited.devices == ("cuda:0", "cuda:1") and limited.notes == ("at most 2 ranks: dropped cuda:2",)


@pytest.mark.parametrize("total,shares,sizes", [
    (56, (1, 1, 1), [18, 19, 19]),
    (56, (1, 1, 0.7), [21, 21, 14]),
    (7, (1, 1), [3, 4]),
    (56, (1,) * 8, [7] * 8),
    (10, (1,) * 8, [1, 1, 1, 1, 1, 1, 2, 2]),
    (5, (100, 1, 1), [3, 1, 1]),
    (3, (1, 1, 1), [1, 1, 1]),
])
def test_partition_examples(total, shares, sizes) -> None:
    bounds = partition(total, shares)
    assert bounds[0] == 0 and bounds[-1] == total
    assert [b - a for a, b in zip(bounds, bounds[1:])] == sizes


def test_partition_errors() -> None:
    with pytest.raises(GPUSelectionError, match="cannot split 2 tokens across 3 ranks"):
        partition(2, (1, 1, 1))
    with pytest.raises(GPUSelectionError, match="greater than 0"):
        partition(10, (1, 0))


def test_rank_map() -> None:
    assert rank_map("cpu,cpu,cpu") == ["cpu"] * 3
    assert rank_map("cuda:0, CUDA:0;cuda:1") == ["cuda:0", "cuda:0", "cuda:1"]
    for bad, match in (("gpu0", "not a device"), ("cuda:x", "not a device"), ("", "empty"),
                       ("cpu," * 9, "at most 8"), ("cpu,cuda:0", "mixes cpu and cuda")):
        with pytest.raises(GPUSelectionError, match=match):
            rank_map(bad)


def test_make_split_plan() -> None:
    plan = make_split_plan(["cuda:0", "cuda:1", "cuda:2"], (1, 1, 0.7), 1000, 56)
    assert plan.head_bounds == (0, 21, 42, 56) and plan.heads_per_rank() == [21, 21, 14]
    assert plan.token_bounds[-1] == 1000 and plan.ranks == 3 and sum(plan.tokens_per_rank()) == 1000
    assert make_split_plan(["cpu"] * 2, None, 7, 8).token_bounds == (0, 3, 7)
    with pytest.raises(GPUSelectionError, match="9 ranks but the model has only 8 attention heads"):
        make_split_plan(["cpu"] * 9, None, 100, 8)
    with pytest.raises(GPUSelectionError, match="cannot split 2 tokens across 3 ranks"):
        make_split_plan(["cpu"] * 3, None, 2, 8)
    with pytest.raises(GPUSelectionError, match="shares: 2 value\\(s\\) for 3 rank\\(s\\)"):
        make_split_plan(["cpu"] * 3, (1, 1), 20, 8)
