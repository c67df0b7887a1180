"""h3ms_async/dit/tested_paths.py: a split path runs on a device kind only where a test of it passed there; "auto"
picks among those; asking for an untested one is one line naming it and the fix."""
from __future__ import annotations

import pytest

from h3ms_async.dit import tested_paths
from h3ms_async.dit.options import SplitOptions
from h3ms_async.dit.split import SplitEngine
from h3ms_async.dit.pattern import pick_pattern
from h3ms_async.dit.tested_paths import SplitPath
from workers.dit.protocol import Transport

pytestmark = pytest.mark.fast


def test_the_table_names_a_test_that_exists_for_every_entry():
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    for kind, paths in tested_paths.TESTED.items():
        for path, test in paths.items():
            file, _, name = test.partition("::")
            name = name.partition("[")[0]  # a parametrized test's case: test_x[id]
            assert f"def {name}(" in (root / file).read_text(), f"{kind} {path}: {test} does not exist"


def test_untested_paths_are_refused_and_auto_falls_back(monkeypatch):
    monkeypatch.setitem(tested_paths.TESTED, "cuda", {})
    monkeypatch.delenv("H3MS_ALLOW_UNTESTED_PATHS", raising=False)
    for opts, named in ((dict(pattern="ulysses"), "the Ulysses pattern"), (dict(head_pieces=3), "head pieces"),
                        (dict(gather_overlap=True), "the gather overlap")):
        with pytest.raises(tested_paths.UntestedPath) as exc:
            SplitEngine(["cuda:0", "cuda:1"], SplitOptions(**opts))
        msg = str(exc.value)
        assert named in msg and "on cuda" in msg and "use pattern 'gather'" in msg and "\n" not in msg
    assert tested_paths.asked_paths("auto", 0, False) == []
    assert not tested_paths.is_tested(SplitPath.ULYSSES, ["cuda:0", "cuda:0"])
    assert tested_paths.is_tested(SplitPath.ULYSSES, ["cpu", "cpu"])
    monkeypatch.setenv("H3MS_ALLOW_UNTESTED_PATHS", "1")
    assert tested_paths.is_tested(SplitPath.ULYSSES, ["cuda:0", "cuda:0"])


def test_auto_never_picks_an_untested_pattern(monkeypatch):
    """At 8 host-staged ranks the model prefers Ulysses, yet on a device kind where Ulysses has no passing test
    "auto" loads the all-gather."""
    from h3ms_async.dit import speed_model
    from h3ms_async.dit.exactness import NO_OVERLAP
    from h3ms_async.dit.reference import DiTConfig
    cfg = DiTConfig(layers=1)
    none = {"gather": NO_OVERLAP, "ulysses": NO_OVERLAP}
    assert speed_model.choose_pattern(cfg.hidden, cfg.heads, cfg.head_dim, 8, "host", none) == "ulysses"
    monkeypatch.delenv("H3MS_ALLOW_UNTESTED_PATHS", raising=False)
    monkeypatch.setitem(tested_paths.TESTED, "cuda", {})
    for devices, picked in ((["cuda:0"] * 8, "gather"), (["cpu"] * 8, "ulysses")):
        assert pick_pattern(SplitOptions(pattern="auto"), devices, Transport.HOST, cfg) == picked, devices


def test_auto_weighs_each_pattern_with_the_overlaps_it_may_run(monkeypatch):
    """At 4 host-staged ranks of H3, "auto" loads Ulysses when the options let the engine run head pieces under it
    (with them the model predicts it faster) and the all-gather when they do not: the overlaps are off, or head
    pieces under Ulysses have no passing test on the device kind."""
    from h3ms_async.dit.reference import DiTConfig
    monkeypatch.delenv("H3MS_ALLOW_UNTESTED_PATHS", raising=False)
    cfg = DiTConfig(layers=1)
    tuned = SplitOptions(pattern="auto", head_pieces=8, gather_overlap=True, gather_ahead=8, overlap_tuning=True)
    cuda = ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert pick_pattern(tuned, cuda, Transport.HOST, cfg) == "ulysses"
    assert pick_pattern(tuned, cuda, Transport.NONE, cfg) == "ulysses"  # the no-exchange baseline: as host staging
    assert pick_pattern(SplitOptions(pattern="auto"), cuda, Transport.HOST, cfg) == "gather"
    monkeypatch.setitem(tested_paths.TESTED, "cuda", {p: t for p, t in tested_paths.TESTED["cuda"].items()
                                                      if p != SplitPath.ULYSSES_PIECES})
    assert pick_pattern(tuned, cuda, Transport.HOST, cfg) == "gather"
