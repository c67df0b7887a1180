"""The status model: step-record schema, ring, listeners, providers, the status JSON, RAM, the step log line."""
from __future__ import annotations

import copy
import datetime
import json
import logging
import re

import msgspec
import psutil
import pytest

from h3ms_async.status.document import SchemaError, Status
from h3ms_async.status.records import RankRecord, StepRecord, format_step_line, now_iso
from workers.dit.protocol import BlockTiming
from h3ms_async.status.hub import RING_SIZE, StatusHub
from h3ms_async.runtime.host_memory import ram_info

pytestmark = pytest.mark.fast

GIB = 1024 ** 3


def make_record(seq: int = 0, *, wall: float = 1.5, ranks: int = 2, tokens: int = 1000, heads: int = 56,
                devices: list[str] | None = None, vram: bool = True) -> StepRecord:
    """A step record with `ranks` ranks splitting tokens and heads as evenly as possible."""
    devices = devices or [f"cuda:{i}" for i in range(ranks)]
    rows = [RankRecord(
        rank=r, device=devices[r % len(devices)],
        tokens=[tokens * r // ranks, tokens * (r + 1) // ranks], heads=[heads * r // ranks, heads * (r + 1) // ranks],
        compute_s=1.0 + 0.125 * r, exchange_s=0.25 + 0.0625 * r, wait_s=0.0625 * (ranks - r),
        moved_bytes=512 * 1024 ** 2, vram_peak_bytes=(10 + r) * GIB if vram else None,
        per_block=[BlockTiming(compute_s=0.02, copy_s=0.005, hidden_s=0.001 * r, exposed_s=0.004)] * 50)
        for r in range(ranks)]
    return StepRecord(at=now_iso(), seq=seq, sigma=0.9375, tokens=tokens, blocks=50, devices=sorted(set(devices)),
                      exchange="host", chunks=4, wall_s=wall, moved_bytes=ranks * 512 * 1024 ** 2,
                      weight_store="warm, 18.5 GiB", ranks=rows)


def check_step_json(rec: dict) -> StepRecord:
    """A step record's JSON form has the typed shape and the split's invariants: ranks 0..N-1 in order, token ranges
    tiling [0, tokens), head groups tiling [0, H), each rank on one of ``devices``, an ISO time."""
    typed = msgspec.convert(rec, StepRecord)
    datetime.datetime.fromisoformat(typed.at)
    assert [r.rank for r in typed.ranks] == list(range(len(typed.ranks)))
    assert typed.ranks[0].tokens[0] == 0 and typed.ranks[-1].tokens[1] == typed.tokens
    assert typed.ranks[0].heads[0] == 0
    for a, b in zip(typed.ranks, typed.ranks[1:]):
        assert a.tokens[1] == b.tokens[0] and a.heads[1] == b.heads[0]
    assert all(r.device in typed.devices for r in typed.ranks)
    return typed


def test_a_recorded_step_serves_its_typed_shape():
    hub = StatusHub()
    stored = hub.record_step(make_record(), log=False)
    assert check_step_json(stored) == msgspec.convert(msgspec.to_builtins(make_record()) | {"at": stored["at"]},
                                                      StepRecord)
    assert json.loads(json.dumps(hub.recent_steps(1)[0], allow_nan=False)) == stored
    assert isinstance(stored["ranks"][0]["tokens"], list)  # JSON arrays, as web/panel.js reads them


@pytest.mark.parametrize("mutate, fragment", [
    (lambda r: r.pop("wall_s"), "missing required field `wall_s`"),
    (lambda r: r.update(typo=1), "unknown field `typo`"),
    (lambda r: r.update(kind="vae"), "`$.kind`"),
    (lambda r: r.update(tokens=True), "`$.tokens`"),
    (lambda r: r.update(exchange="p2p"), "`$.exchange`"),
    (lambda r: r.update(sigma="high"), "`$.sigma`"),
    (lambda r: r["ranks"][0].pop("vram_peak_bytes"), "`$.ranks[0]`"),
    (lambda r: r["ranks"][1]["per_block"][3].update(hidden_s=1.0), "hidden_s 1.0 exceeds copy_s 0.005"),
    (lambda r: r["ranks"][0]["per_block"][0].update(exposed_s=-0.1), "`$.ranks[0].per_block[0].exposed_s`"),
    (lambda r: r["ranks"][1]["per_block"].pop(), "rank(s) [1]: per_block must hold one timing per block (50)"),
])
def test_the_typed_shape_refuses_a_malformed_record(mutate, fragment):
    rec = msgspec.to_builtins(make_record())
    mutate(rec)
    with pytest.raises(msgspec.ValidationError, match=re.escape(fragment)):
        msgspec.convert(rec, StepRecord)


def test_record_step_takes_only_typed_records():
    with pytest.raises(SchemaError, match="build a records.StepRecord"):
        StatusHub().record_step(msgspec.to_builtins(make_record()), log=False)


def test_ring_is_bounded_and_recent_steps_order():
    hub = StatusHub()
    for i in range(RING_SIZE + 10):
        hub.record_step(make_record(i, wall=0.01 * i), log=False)
    steps = hub.recent_steps(RING_SIZE + 100)
    assert len(steps) == RING_SIZE
    assert [s["seq"] for s in steps] == list(range(10, RING_SIZE + 10))
    assert [s["seq"] for s in hub.recent_steps(3)] == [RING_SIZE + 7, RING_SIZE + 8, RING_SIZE + 9]
    assert [s["seq"] for s in hub.recent_steps(50, after=RING_SIZE + 7)] == [RING_SIZE + 8, RING_SIZE + 9]
    assert hub.status()["steps_recorded"] == RING_SIZE + 10


def test_seq_must_increase():
    hub = StatusHub()
    hub.record_step(make_record(hub.next_seq()), log=False)
    assert hub.next_seq() == 1
    with pytest.raises(SchemaError, match=r"field 'seq' must increase, got 0 after 0; take it from .*next_seq"):
        hub.record_step(make_record(0), log=False)
    assert len(hub.recent_steps(10)) == 1  # the refused record was not stored


def test_listeners_get_records_and_a_raising_listener_is_logged(caplog):
    hub = StatusHub()
    seen: list[int] = []

    def broken(rec):
        raise RuntimeError("panel gone")
    hub.add_listener(broken)
    remove = hub.add_listener(lambda rec: seen.append(rec["seq"]))
    with caplog.at_level(logging.ERROR, logger="h3_multistream"):
        hub.record_step(make_record(0), log=False)
    assert seen == [0]
    assert any("step listener" in r.getMessage() and r.exc_info for r in caplog.records)
    remove()
    hub.record_step(make_record(1), log=False)
    assert seen == [0]
    remove()  # removing twice is harmless


def test_record_step_logs_the_step_line(caplog):
    hub = StatusHub()
    with caplog.at_level(logging.INFO, logger="h3_multistream"):
        hub.record_step(make_record(3))
    msgs = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("[H3 MultiStream] [MultiStream] sigma 0.9375 step 3: 1000 tokens x 50 blocks") for m in msgs)


def test_status_defaults_shape_and_json():
    hub = StatusHub()
    st = hub.status()
    assert set(st) == {"version", "running", "plans", "last_step", "steps_recorded", "workers", "weight_store",
                       "caches", "hooks", "ram", "vae_workers", "vae_split", "text_encoder_outputs", "exactness"}
    msgspec.convert(st, Status)
    assert st["exactness"] == {"verdicts": [], "verify": []}
    assert st["running"] is False and st["last_step"] == {} and st["workers"] == [] and st["plans"] == {}
    assert st["vae_workers"] == [] and st["vae_split"] == {"engines": []}
    assert st["text_encoder_outputs"] == {"entries": 0, "hits": 0, "misses": 0, "bytes": 0}
    assert st["version"] != "unknown"
    json.dumps(st, allow_nan=False)
    hub.record_step(make_record(0), log=False)
    st = hub.status()
    assert check_step_json(st["last_step"]).seq == 0
    msgspec.convert(st, Status)


def test_providers_fill_sections_and_failures_stay_in_their_section():
    hub = StatusHub()
    hub.register_provider("plans", lambda: {"dit": "cuda:0 (60%) + cuda:1 (40%)"})
    hub.register_provider("workers", lambda: [{"rank": 0, "device": "cpu", "pid": 1234, "state": "running",
                                              "uptime_s": 3.5, "rss_bytes": 10, "vram_bytes": None, "jobs_done": 2,
                                              "log": "/tmp/x/rank0.log"}])
    hub.register_provider("caches", lambda: 1 / 0)
    hub.register_provider("hooks", lambda: [object()])                       # not an object row
    hub.register_provider("weight_store", lambda: {"bytes": float("inf")})  # not JSON
    hub.set_busy_probe(lambda: True)
    st = hub.status()
    assert st["plans"] == {"dit": "cuda:0 (60%) + cuda:1 (40%)"}
    assert st["workers"][0]["pid"] == 1234
    assert st["caches"] == {"error": "ZeroDivisionError: division by zero"}
    assert "status section 'hooks': Expected `object`" in st["hooks"]["error"]
    assert "at `$[0]`" in st["hooks"]["error"]
    assert "not JSON-serialisable" in st["weight_store"]["error"]
    assert st["running"] is True
    msgspec.convert(st, Status)
    assert hub.worker_log_path(0) == "/tmp/x/rank0.log"
    with pytest.raises(KeyError):
        hub.worker_log_path(1)


def test_bad_worker_rows_and_unknown_sections_are_refused():
    hub = StatusHub()
    hub.register_provider("workers", lambda: [{"rank": 0, "device": "cpu", "state": "running"}])
    assert "status section 'workers': Object missing required field `pid` - at `$[0]`" in \
        hub.status()["workers"]["error"]
    with pytest.raises(ValueError, match="unknown status section 'gpus'"):
        hub.register_provider("gpus", dict)
    with pytest.raises(ValueError, match="unknown action 'reboot'"):
        hub.register_action("reboot", dict)


def test_busy_probe_that_raises_counts_as_idle():
    hub = StatusHub()
    hub.set_busy_probe(lambda: 1 / 0)
    assert hub.busy() is False


def test_the_status_shape_refuses_a_broken_object():
    st = StatusHub().status()
    bad = copy.deepcopy(st)
    bad["running"] = "no"
    with pytest.raises(msgspec.ValidationError, match=re.escape("`$.running`")):
        msgspec.convert(bad, Status)
    bad = copy.deepcopy(st)
    del bad["ram"]["text"]
    with pytest.raises(msgspec.ValidationError, match="missing required field `text`"):
        msgspec.convert(bad, Status)


def test_format_step_line_fields():
    line = format_step_line(msgspec.to_builtins(make_record(12, wall=3.2144, ranks=3,
                                                            devices=["cuda:0", "cuda:0", "cuda:1"])))
    assert line.startswith("sigma 0.9375 step 12: 1000 tokens x 50 blocks on cuda:0+cuda:0+cuda:1, 3.214s ")
    assert "(exchange host x4; compute 1.000/1.125/1.250s, exchange 0.250/0.312/0.375s, " \
           "wait 0.188/0.125/0.062s; 1.50 GiB moved)" in line
    assert ", weight store warm, 18.5 GiB" in line
    # two ranks on cuda:0 are two processes on one GPU: their peaks add up
    assert line.endswith("VRAM peak cuda:0 21.00 GiB / cuda:1 12.00 GiB")
    cpu = msgspec.to_builtins(make_record(0, ranks=1, devices=["cpu"], vram=False))
    cpu["sigma"], cpu["chunks"], cpu["exchange"] = None, 1, "none"
    line = format_step_line(cpu)
    assert line.startswith("step 0: 1000 tokens x 50 blocks on cpu, ")
    assert "(exchange none; compute" in line and "VRAM" not in line


def _write(root, name, text):
    p = root / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def test_ram_info_cgroup_v2_limit(tmp_path):
    if psutil.virtual_memory().available < 3 * GIB:
        pytest.skip("needs 3 GiB of free host RAM so that the fake cgroup's figure is the smaller one")
    limit = 2 * GIB  # below any CI host's RAM, so the container figure wins
    _write(tmp_path, "memory.max", f"{limit}\n")
    _write(tmp_path, "memory.current", f"{GIB}\n")
    _write(tmp_path, "memory.stat", f"active_file {GIB // 4}\ninactive_file {GIB // 4}\ndirty {GIB // 8}\n"
                                    "writeback 0\nanon 123\n")
    info = ram_info(tmp_path)
    reclaim = GIB // 4 + GIB // 4 - GIB // 8 - int(0.05 * limit)
    assert info.total_bytes == limit and info.container_limit is True
    assert info.available_bytes == GIB + reclaim  # this host has more than ~1.2 GiB free, so the cgroup wins
    assert info.text.endswith("of 2.0 GiB (container limit)")


def test_ram_info_cgroup_v1_and_no_limit(tmp_path):
    v1 = tmp_path / "v1"
    _write(v1, "memory/memory.limit_in_bytes", f"{GIB}\n")
    _write(v1, "memory/memory.usage_in_bytes", f"{GIB // 2}\n")
    _write(v1, "memory/memory.stat", "total_active_file 0\ntotal_inactive_file 0\n")
    info = ram_info(v1)
    assert info.total_bytes == GIB and info.available_bytes <= GIB // 2
    unlimited = tmp_path / "v2max"
    _write(unlimited, "memory.max", "max\n")
    _write(unlimited, "memory.current", "1\n")
    info = ram_info(unlimited)
    assert info.container_limit is False and info.text.startswith("RAM available ")
    assert 0 < info.available_bytes <= info.total_bytes


def test_exactness_verdicts_and_verify_are_typed_and_bounded():
    from h3ms_async.status.records import VerdictRecord, VerifyRecord
    from h3ms_async.status.hub import VERDICTS_KEPT
    hub = StatusHub()
    for i in range(VERDICTS_KEPT + 3):
        hub.record_verdict(VerdictRecord(program="dit", op="mlp.fc2", device="cpu X", dtype="bfloat16",
                                         shape=f"{i}x64x128", shards=[i, 1], verdict="adjusted",
                                         detail="moved to 16", probe_ms=1.5, at=now_iso()))
    hub.record_verify(VerifyRecord(at=now_iso(), devices=["cpu X"], bit_exact=False, max_abs_diff=0.5,
                                   first_difference="block 1 mlp.fc2", steps_checked=1))
    ex = hub.status()["exactness"]
    assert len(ex["verdicts"]) == VERDICTS_KEPT and ex["verdicts"][-1]["shape"] == f"{VERDICTS_KEPT + 2}x64x128"
    assert len(ex["verify"]) == 1 and ex["verify"][0]["first_difference"] == "block 1 mlp.fc2"
    with pytest.raises(SchemaError, match="^verdict: got a dict; build a records.VerdictRecord$"):
        hub.record_verdict({"op": "x"})  # type: ignore[arg-type]
    with pytest.raises(SchemaError, match="^verify: got a VerdictRecord; build a records.VerifyRecord$"):
        hub.record_verify(VerdictRecord(program="dit", op="mlp.fc2", device="cpu X", dtype="bfloat16",  # type: ignore[arg-type]
                                        shape="1x64x128", shards=[1, 1], verdict="exact", detail="",
                                        probe_ms=1.5, at=now_iso()))
    msgspec.convert(hub.status(), Status)


def test_record_verdict_refuses_an_unknown_verdict():
    from h3ms_async.status.hub import record_verdict
    with pytest.raises(SchemaError, match="exact\\|adjusted\\|unsplit"):
        record_verdict("dit", "mlp.fc2", "cpu", "float32", "8x8x8", [4, 4], "maybe", "", 0.0)
    out = record_verdict("vae", "vae.chunk", "cpu", "float16", "1x16x8x8", [2, 3], "exact", "", 3.0)
    assert out["verdict"] == "exact" and out["shards"] == [2, 3]


def test_a_gpu_ranks_record_says_where_its_weights_live():
    """The step record's residency fields come from the weights summary a CUDA rank answers (resident blocks x block
    bytes in VRAM, the rest streamed); a CPU rank answers none and its record says null (the host store)."""
    from h3ms_async.dit.step import _residency
    cuda = {"resident_blocks": 40, "streamed_blocks": 10, "block_bytes": 512 << 20, "prefetch_copy_s": 0.1}
    assert _residency(cuda) == {"weights_vram_bytes": 20 << 30, "resident_blocks": 40, "streamed_blocks": 10}
    assert _residency(None) == {}
    rec = msgspec.convert({**msgspec.to_builtins(make_record()).get("ranks")[0], **_residency(cuda)}, RankRecord)
    assert rec.weights_vram_bytes == 20 << 30 and make_record().ranks[0].resident_blocks is None


def test_block_means_average_a_ranks_blocks_in_milliseconds():
    from h3ms_async.status.records import block_means
    rows = [{"compute_s": 0.004, "copy_s": 0.002, "hidden_s": 0.001, "exposed_s": 0.001},
            {"compute_s": 0.002, "copy_s": 0.0, "hidden_s": 0.0, "exposed_s": 0.003}]
    got = block_means(rows)
    assert got == pytest.approx({"compute_ms": 3.0, "copy_ms": 1.0, "hidden_ms": 0.5, "exposed_ms": 2.0,
                                 "block_ms": 5.0, "exposed_pct": 40.0})
    assert block_means([])["exposed_pct"] == 0.0
