"""The cross-block overlap (``gather_ahead``): each block's tail in row pieces, each followed by the next block's
norm1 + modulation of those rows published into the next block's all-gather (``Exchange.all_gather_rows_produced``).
On real worker processes (CPU ranks) over the host arena and gloo, 2 and 3 ranks, uneven shares: the unsplit output,
recorded as run; the probe measures the tail's linears on the row pieces, and a piece size that rounds differently
turns the overlap off for that plan with one warning while the step stays split and exact."""

from __future__ import annotations

import pytest
import torch

from h3ms_async.dit import exactness
from h3ms_async.dit.reference import DiTConfig, ReferenceDiT
from h3ms_async.status.hub import get_hub
from split_checks import Compared, fault_engines, fault_step
from test_split import CFG_UNEVEN, _check_exact, _layouts, engine_factory  # noqa: F401 - the fixture

CFG = DiTConfig(hidden=128, layers=3, heads=8, head_dim=32, ffn=192, t_dim=16, rope_pairs=12)
# fault_step: 200 tokens, two equal ranks of 100 rows each, cut into tail pieces of 25 rows by gather_ahead=4


@pytest.fixture(scope="module")
def model():
    # int8: kitchen's int8 GEMMs are row-invariant on every CPU measured, so only the fault can make a piece differ
    return ReferenceDiT(CFG, weights="int8", seed=5)


@pytest.fixture
def engine(monkeypatch):
    yield from fault_engines(monkeypatch)



def test_gather_ahead_runs_exact_and_is_recorded(engine, model):
    """Tails in 4 row pieces (25 rows each) with the head pieces and the gather overlap on: equal to the unsplit
    output over two steps, the pieces' verdicts recorded per tail linear, what the step ran recorded; one exchange
    chunk per row piece of every gather but the first block's."""
    eng = engine(gather_ahead=4, head_pieces=2, gather_overlap=True)
    eng.load_weights(("ahead", 1), CFG, model.block_weights)
    for seed in (3, 4):
        out, ref = fault_step(eng, model, seed)
        assert torch.equal(out, ref)
        rec = get_hub().recent_steps(1)[0]
        assert (rec["gather_ahead"], rec["head_pieces"], rec["gather_overlap"]) == (4, 2, True)
    # to the one peer: the job's begin; block 0's gather (one chunk, rows handed over as they arrive), every block's
    # all-to-all in 2 head pieces, and blocks 1 and 2's gathers in 4 row pieces, published during the block before
    assert [r.signals for r in eng.last_rank_results] == [1 + 1 + CFG.layers * 2 + (CFG.layers - 1) * 4] * 2
    rows = {r["op"]: r for r in get_hub().status()["exactness"]["verdicts"] if r["op"] in exactness.TAIL_OPS}
    assert sorted(rows) == sorted(exactness.TAIL_OPS) and {r["verdict"] for r in rows.values()} == {"exact"}
    assert rows["mlp.fc2.tail"]["shards"] == [25] * 8  # each rank's own 4 pieces
    out, ref = fault_step(eng, model, 5, gather_ahead=0)
    assert torch.equal(out, ref) and get_hub().recent_steps(1)[0]["gather_ahead"] == 0


def test_a_differing_tail_piece_runs_the_tail_whole(engine, model, caplog):
    """fc2 rounds differently on a 25-row call (a tail piece), on purpose: the plan stays split and exact, the tails
    run whole, one warning names the piece, the status shows the pieces' verdict adjusted."""
    eng = engine(f"linear:25:{CFG.ffn}", gather_ahead=4)
    eng.load_weights(("ahead", 2), CFG, model.block_weights)
    for seed in (3, 4):  # the second step reuses the cached verdict
        out, ref = fault_step(eng, model, seed)
        assert torch.equal(out, ref)
        rec = get_hub().recent_steps(1)[0]
        assert rec["gather_ahead"] == 0 and [r["tokens"] for r in rec["ranks"]] == [[0, 100], [100, 200]]
    warned = [r.getMessage() for r in caplog.records if "runs whole before the next block" in r.getMessage()]
    assert len(warned) == 1 and "mlp.fc2.tail" in warned[0] and "tokens [0, 25)" in warned[0], warned
    row = [r for r in get_hub().status()["exactness"]["verdicts"] if r["op"] == "mlp.fc2.tail"][-1]
    assert row["verdict"] == "adjusted" and "runs whole before the next block" in row["detail"]


def test_gather_ahead_uneven_host_and_gloo(engine_factory):  # noqa: F811 - the fixture
    """Three ranks of uneven shares and head groups, tails in 3 row pieces (and in more pieces than a rank has rows
    at the smaller layout's share), through the host arena chunked and with head pieces, and over gloo (one
    collective at the end): the unsplit output."""
    seen = Compared()
    model = ReferenceDiT(CFG_UNEVEN, weights="int8", seed=7)
    # one set of workers, started for gloo: the exchange and the overlaps are per-step settings
    eng = engine_factory(["cpu"] * 3, shares=(1.0, 1.0, 0.7), exchange="nccl")
    eng.load_weights(("t", "uneven"), CFG_UNEVEN, model.block_weights)
    runs = ({"exchange": "host", "exchange_chunks": 3}, {"exchange": "host", "head_pieces": 3, "gather_overlap": True},
            {})
    for kw in runs:
        for ahead in (3, 16):
            _check_exact(eng, model, _layouts(), seen, gather_ahead=ahead, **kw)
            assert get_hub().recent_steps(1)[0]["gather_ahead"] == ahead
    seen.done()


def test_gather_ahead_on_two_ranks_over_gloo(engine_factory, model):  # noqa: F811 - the fixture
    """Two ranks over gloo, equal shares: the unsplit output."""
    exactness.VERDICTS.clear()  # verdicts measured by faulty workers of another test stay theirs
    eng = engine_factory(["cpu"] * 2, exchange="nccl", gather_ahead=4)
    eng.load_weights(("ahead", 3), CFG, model.block_weights)
    assert eng.transport == "gloo"
    out, ref = fault_step(eng, model)
    assert torch.equal(out, ref)
    assert get_hub().recent_steps(1)[0]["gather_ahead"] == 4
