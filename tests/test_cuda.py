"""CUDA rank workers (skipped without a GPU; run on the device machine by benchmarks/device_run.sh).

Covers: pinned (cudaHostRegister'ed) shm moving through a CUDA worker bit-exactly; the split on logical ranks of one
GPU bit-exact against the unsplit run in this process, for int8 and bf16 weights, chunked and single-shot host
exchange, weights resident and streamed; the NCCL refusal for two ranks on one GPU; each split path (Ulysses, head
pieces, the gather overlap, gather ahead) and the GPU-direct exchange at full H3 width from fresh workers; with
several GPUs, one rank per GPU with uneven shares over host staging, the GPU-direct exchange (peer to peer) and NCCL,
each path included; per-block timings from CUDA events.

Warm-up: measured on the H200 (benchmarks/diag_parity.py), the FIRST block-stack pass of a process differs in the
last bits from every later pass, in this process and in a worker alike (first == first, later == later, split or
not).  A worker is a fresh process, like a freshly started ComfyUI, so each side is warmed once before comparing.
"""
from __future__ import annotations

import hashlib

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: run these on a GPU machine with a CUDA "
                                                                     "build of torch (H3MS_TORCH_SPEC), e.g. "
                                                                     "benchmarks/device_run.sh")]

from h3ms_async.runtime.coordinator import get_coordinator  # noqa: E402
from h3ms_async.dit.layout import layout_for_tokens  # noqa: E402
from h3ms_async.runtime.pool import WorkerPool  # noqa: E402
from h3ms_async.dit.reference import DiTConfig, ReferenceDiT, make_step_inputs  # noqa: E402
from h3ms_async.dit.exchange_choice import ExchangeRefused, no_peer_access  # noqa: E402
from h3ms_async.dit.options import SplitOptions  # noqa: E402
from h3ms_async.dit.split import SplitEngine  # noqa: E402
from workers.runtime.protocol import Echo  # noqa: E402
from workers.runtime.shm import Arena, Segment  # noqa: E402

CFG = DiTConfig(hidden=1024, layers=3, heads=16, head_dim=128, ffn=2816, t_dim=256, rope_pairs=48)


def test_cuda_worker_echo_through_registered_shm():
    pool = WorkerPool(["cuda:0", "cuda:0"], name="cudaecho")
    coord = get_coordinator()
    seg = Segment.create(2 * (256 << 20) + 8192, "cudaecho")
    try:
        coord.run(pool.start(), 300, "start")
        a = Arena(seg)
        src, dst = a.alloc("bfloat16", [128 << 20]), a.alloc("bfloat16", [128 << 20])
        data = seg.tensor(src)
        data.copy_(torch.randn(128 << 20, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16))
        for rank in range(2):
            seg.tensor(dst).zero_()
            r = coord.run(pool.request(rank, Echo(src=src, dst=dst), timeout=120), 150, "echo")
            assert r.registered is True
            assert torch.equal(seg.tensor(dst), data)
            assert r.sha256 == hashlib.sha256(seg.tensor(dst).view(torch.uint8).numpy()).hexdigest()
            print(f"rank {rank}: 256 MiB host->GPU->host in {r.seconds * 1e3:.1f} ms "
                  f"({2 * 256 / 1024 / r.seconds:.1f} GB/s both ways)")
    finally:
        coord.run(pool.release(force=True), 60, "release")
        seg.close()
        seg.unlink()


@pytest.fixture(scope="module")
def models():
    # materialized: every block drawn once onto the GPU, not again at each block_weights() call
    return {kind: ReferenceDiT(CFG, weights=kind, seed=21, device="cuda").materialize() for kind in ("int8", "bf16")}


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("residency", ["resident", "stream"])
def test_split_on_logical_ranks_is_exact(models, ranks, residency):
    layouts = [layout_for_tokens(4096), layout_for_tokens(6000)]
    eng = SplitEngine(["cuda:0"] * ranks, SplitOptions(vram_residency=residency))
    try:
        for kind, model in models.items():
            eng.load_weights(("cuda-test", kind), CFG, model.block_weights)
            for s, lay in enumerate(layouts):
                inp = make_step_inputs(CFG, lay, 40 + s, model.dtype)
                refs = [model.forward_blocks(inp.x.cuda(), inp.t_emb.cuda(), inp.segments,
                                             inp.rope_freqs.cuda()).cpu() for _ in range(2)]
                eng.run_blocks(inp.x, model.modulation(inp.t_emb), inp.segments,
                               inp.rope_freqs)  # warm (see module doc)
                for chunks in (0, 8):
                    out = eng.run_blocks(inp.x, model.modulation(inp.t_emb), inp.segments, inp.rope_freqs,
                                         exchange_chunks=chunks)
                    diff = (out.float() - refs[1].float()).abs().max().item()
                    assert torch.equal(out, refs[1]), f"{kind} chunks={chunks} step {s}: max |diff| {diff:g}"
    finally:
        eng.release()


def test_ck_int8_attention_head_split_is_exact(models):
    """--use-ck-attention parity: comfy-kitchen INT8 attention on 2 and 4 head groups equals the unsplit run."""
    model = models["int8"]
    inp = make_step_inputs(CFG, layout_for_tokens(6000), 7, torch.bfloat16)
    refs = [model.forward_blocks(inp.x.cuda(), inp.t_emb.cuda(), inp.segments, inp.rope_freqs.cuda(),
                                 attention="ck_int8").cpu() for _ in range(2)]
    for ranks in (2, 4):
        eng = SplitEngine(["cuda:0"] * ranks, SplitOptions(attention="ck_int8"))
        try:
            eng.load_weights(("cuda-test", "int8-ck"), CFG, model.block_weights)
            out = eng.run_blocks(inp.x, model.modulation(inp.t_emb), inp.segments, inp.rope_freqs, exchange_chunks=8)
            assert torch.equal(out, refs[1]), f"{ranks} ranks: max |diff| {(out.float() - refs[1].float()).abs().max()}"
        finally:
            eng.release()


def test_short_sequence_is_measured_not_assumed(models):
    """4 heads of 16 at 3000 tokens fall under FlashAttention's split-KV threshold by the flash-tiles rule (measured
    different on the H200 once). The rule is a prior now: the ranks measure the plan; it either runs split and
    equals the unsplit run, or is refused (SplitUnsafe) naming attention and the device."""
    from h3ms_async.dit.errors import SplitUnsafe
    model = models["int8"]
    eng = SplitEngine(["cuda:0"] * 4, SplitOptions())
    try:
        eng.load_weights(("cuda-test", "int8"), CFG, model.block_weights)
        inp = make_step_inputs(CFG, layout_for_tokens(3000), 1, torch.bfloat16)
        refs = [model.forward_blocks(inp.x.cuda(), inp.t_emb.cuda(), inp.segments, inp.rope_freqs.cuda()).cpu()
                for _ in range(2)]
        try:
            eng.run_blocks(inp.x, model.modulation(inp.t_emb), inp.segments, inp.rope_freqs)  # warm (see module doc)
            out = eng.run_blocks(inp.x, model.modulation(inp.t_emb), inp.segments, inp.rope_freqs)
        except SplitUnsafe as exc:
            assert "attention" in str(exc) and "NVIDIA" in str(exc)
        else:
            assert torch.equal(out, refs[1]), f"max |diff| {(out.float() - refs[1].float()).abs().max()}"
    finally:
        eng.release()


def test_nccl_refuses_two_ranks_on_one_gpu():
    with pytest.raises(ValueError, match="one GPU"):
        SplitEngine(["cuda:0", "cuda:0"], SplitOptions(exchange="nccl"))


_PARENT_SCRIPT = r"""
import json, torch
from h3ms_async.dit.layout import layout_for_tokens
from h3ms_async.dit.reference import DiTConfig, ReferenceDiT, make_step_inputs
from h3ms_async.dit.options import SplitOptions
from h3ms_async.dit.split import SplitEngine
cfg = DiTConfig(hidden=1024, layers=3, heads=16, head_dim=128, ffn=2816, t_dim=256, rope_pairs=48)
model = ReferenceDiT(cfg, weights="int8", seed=3)            # weights on the host, like ComfyUI's offloaded DiT
eng = SplitEngine(["cuda:0", "cuda:0"], SplitOptions())
eng.load_weights(("vram",), cfg, model.block_weights)
inp = make_step_inputs(cfg, layout_for_tokens(4096), 1, torch.bfloat16)
for _ in range(2):
    eng.run_blocks(inp.x, model.modulation(inp.t_emb), inp.segments, inp.rope_freqs)
peaks = [r.vram_peak_bytes for r in eng.last_rank_results]
print(json.dumps({"parent_cuda_initialized": torch.cuda.is_initialized(), "rank_vram_peaks": peaks,
                  "parent_allocated": torch.cuda.memory_allocated() if torch.cuda.is_initialized() else 0,
                  "parent_peak": torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else 0}))
eng.release()
"""


def test_parent_process_never_touches_the_gpu():
    """The coordinator side of a split allocates nothing on any GPU (torch's allocator peak stays 0 in the parent),
    so the split never leaves a second copy of the DiT in the model GPU's VRAM: the ranks hold the weights.
    (comfy-kitchen's import may create a CUDA context in the parent; that holds no tensors.)"""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _PARENT_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    print(res)
    assert res["parent_allocated"] == 0 and res["parent_peak"] == 0
    assert all(p and p > 0 for p in res["rank_vram_peaks"])


FULL = DiTConfig(layers=2)  # full H3 width


@pytest.fixture(scope="module")
def full_int8():
    # materialized: a full-width block drawn on the host takes seconds, and each test reads every block five times
    # (the load, the modulation, two reference passes per step)
    return ReferenceDiT(FULL, weights="int8", seed=33, device="cuda").materialize()


def _steps_equal_unsplit(eng: SplitEngine, model: ReferenceDiT, key: str, seed: int, what: str) -> list[dict]:
    """Load ``model`` on ``eng``'s fresh workers and run two steps of 8192 tokens; each must equal the unsplit step
    with torch.equal (ComfyUI's process is long warm: the unsplit side is its second pass). Returns each step's
    record."""
    from h3ms_async.status.hub import get_hub
    eng.load_weights((key, "int8"), FULL, model.block_weights)
    records = []
    for s, tokens in enumerate((8192, 8192)):
        inp = make_step_inputs(FULL, layout_for_tokens(tokens), seed + s, model.dtype)
        ref = [model.forward_blocks(inp.x.cuda(), inp.t_emb.cuda(), inp.segments,
                                    inp.rope_freqs.cuda()).cpu() for _ in range(2)][1]
        out = eng.run_blocks(inp.x, model.modulation(inp.t_emb), inp.segments, inp.rope_freqs)
        diff = (out.float() - ref.float()).abs().max().item()
        assert torch.equal(out, ref), f"{what} step {s}: max |diff| {diff:g}"
        records.append(get_hub().recent_steps(1)[0])
    return records


@pytest.mark.parametrize("path", [dict(pattern="ulysses"), dict(head_pieces=4), dict(gather_overlap=True),
                                  dict(gather_overlap=True, head_pieces=4), dict(pattern="ulysses", head_pieces=8),
                                  dict(pattern="ulysses", head_pieces=8, exchange="cuda_ipc")],
                         ids=["ulysses", "pieces4", "gather-overlap", "both-overlaps", "ulysses-pieces8",
                              "ulysses-pieces8-gpu-direct"])
def test_split_paths_on_logical_ranks_are_exact(full_int8, path, monkeypatch):
    """Each path of h3ms_async/dit/tested_paths.py at full H3 width on 2 logical ranks: fresh workers, and their
    FIRST step equals the unsplit step with torch.equal (ComfyUI's process is long warm: the unsplit side is its
    second pass), then a second step; the step record shows the path ran and both ranks computed tokens and heads.
    A pass here is what lets the path into TESTED["cuda"]."""
    monkeypatch.setenv("H3MS_ALLOW_UNTESTED_PATHS", "1")  # measuring the path is what this test is for
    eng = SplitEngine(["cuda:0"] * 2, SplitOptions(**path))
    try:
        for rec in _steps_equal_unsplit(eng, full_int8, "cuda-paths", 60, str(path)):
            assert rec["pattern"] == path.get("pattern", "gather"), rec
            assert rec["head_pieces"] == path.get("head_pieces", 0), rec
            assert rec["gather_overlap"] is path.get("gather_overlap", False), rec
            assert all(r["tokens"][1] > r["tokens"][0] and r["heads"][1] > r["heads"][0] for r in rec["ranks"]), rec
    finally:
        eng.release()


@pytest.mark.parametrize("path", [dict(gather_ahead=4), dict(gather_ahead=4, gather_overlap=True, head_pieces=4),
                                  dict(gather_ahead=8, gather_overlap=True, head_pieces=8),
                                  dict(gather_ahead=16, gather_overlap=True, head_pieces=8),
                                  dict(gather_ahead=4, exchange="cuda_ipc"), dict(gather_ahead=4, vram_residency="stream")],
                         ids=["ahead4", "all-overlaps", "all-overlaps-8", "all-overlaps-8-16", "ahead4-gpu-direct",
                              "ahead4-streamed"])
def test_gather_ahead_on_logical_ranks_is_exact(full_int8, path, monkeypatch):
    """The cross-block overlap (each block's tail in 4, 8 or 16 row pieces feeding the next block's gather) at full H3
    width on 2 logical ranks, alone and with every overlap (8 pieces: what the node's auto offers; 16 row pieces: what
    the speed model puts ahead of 8 with host staging on PCIe), host-staged,
    GPU-direct and with streamed weights (the next block's norm1 weight is read
    while the block before still computes: ``CudaWeights.ahead``): fresh workers, their FIRST step and a second one
    equal the unsplit step with torch.equal, the record shows it ran. A pass here is what lets gather ahead into
    TESTED["cuda"]."""
    monkeypatch.setenv("H3MS_ALLOW_UNTESTED_PATHS", "1")  # measuring the path is what this test is for
    eng = SplitEngine(["cuda:0"] * 2, SplitOptions(**path))
    try:
        for rec in _steps_equal_unsplit(eng, full_int8, "cuda-ahead", 70, str(path)):
            assert rec["gather_ahead"] == path["gather_ahead"], rec
            assert rec["head_pieces"] == path.get("head_pieces", 0), rec
            assert all(r["tokens"][1] > r["tokens"][0] and r["heads"][1] > r["heads"][0] for r in rec["ranks"]), rec
    finally:
        eng.release()


# Head pieces at 6000 tokens of this width leave the GPU waiting on the host's launches (each piece's attention lasts
# tens of microseconds, less than queuing the next piece: no copy can hide); at 32768 tokens a piece's attention
# (milliseconds) outlasts its copies, as at H3's sizes.
@pytest.mark.parametrize("kw,tokens", [(dict(exchange_chunks=8), 6000), (dict(exchange_chunks=8, head_pieces=4), 32768),
                                       (dict(exchange="none"), 6000)], ids=["host-x8", "pieces4", "no-exchange"])
def test_block_timings_from_cuda_events(models, kw, tokens, monkeypatch):
    """A CUDA rank's per-block timings come from CUDA events read once per step (workers/dit/block_clock.py): one
    per block, compute + exposed tiling the rank's block loop, hidden <= copy; head pieces hide part of their copies
    behind the next piece's attention; the no-exchange baseline copies nothing and never waits."""
    import msgspec
    from h3ms_async.status.hub import get_hub
    from h3ms_async.status.records import StepRecord
    monkeypatch.setenv("H3MS_ALLOW_UNTESTED_PATHS", "1")
    eng = SplitEngine(["cuda:0"] * 2, SplitOptions())
    try:
        eng.load_weights(("cuda-timing", "bf16"), CFG, models["bf16"].block_weights)
        inp = make_step_inputs(CFG, layout_for_tokens(tokens), 9, torch.bfloat16)
        for _ in range(2):  # the second step is timed warm
            eng.run_blocks(inp.x, models["bf16"].modulation(inp.t_emb), inp.segments, inp.rope_freqs, **kw)
        typed = msgspec.convert(get_hub().recent_steps(1)[-1], StepRecord)
        for r, raw in zip(typed.ranks, eng.last_rank_results):
            assert len(r.per_block) == CFG.layers
            loop_s = raw.wall_s - raw.setup_s - raw.tail_s
            assert sum(b.compute_s + b.exposed_s for b in r.per_block) == pytest.approx(loop_s, rel=0.1, abs=0.005)
            assert all(b.compute_s > 0 and b.hidden_s <= b.copy_s for b in r.per_block), r.per_block
            print(f"rank {r.rank} {kw}: {r.per_block}")
        blocks = [b for r in typed.ranks for b in r.per_block]
        if kw.get("exchange") == "none":
            assert all(b.copy_s == 0 and b.exposed_s == 0 for b in blocks), blocks
        else:
            assert all(b.copy_s > 0 and b.exposed_s > 0 for b in blocks), blocks
        if kw.get("head_pieces"):
            assert sum(b.hidden_s for b in blocks) > 0, blocks
    finally:
        eng.release()


@pytest.mark.parametrize("sync,chunks", [("host", 0), ("host", 8), ("events", 0), ("events", 8)],
                         ids=["host-0", "host-8", "events-0", "events-8"])
def test_gpu_direct_exchange_on_logical_ranks_is_exact(full_int8, sync, chunks, monkeypatch):
    """The GPU-direct exchange (workers/transports/cuda_ipc.py: each rank's send buffer in its GPU's memory, shared
    by CUDA IPC) at full H3 width on 2 logical ranks of one GPU, its copies waited for on the host or ordered by
    CUDA IPC events: fresh workers, their FIRST step equals the unsplit step with torch.equal, then a second step
    (the buffers reused); the step record names the transport and the ordering, and both ranks computed and moved
    bytes. A pass here is what lets SplitPath.CUDA_IPC (host) and SplitPath.CUDA_IPC_EVENTS (events) into
    TESTED["cuda"]."""
    monkeypatch.setenv("H3MS_ALLOW_UNTESTED_PATHS", "1")  # measuring the path is what this test is for
    eng = SplitEngine(["cuda:0"] * 2, SplitOptions(exchange="cuda_ipc", ipc_sync=sync, exchange_chunks=chunks))
    try:
        for rec in _steps_equal_unsplit(eng, full_int8, f"cuda-ipc-{sync}", 70, f"cuda_ipc {sync} x{chunks}"):
            assert rec["exchange"] == "cuda_ipc" and rec["ipc_sync"] == sync, rec
            assert rec["chunks"] == max(chunks, 1), rec
            assert all(r["tokens"][1] > r["tokens"][0] and r["moved_bytes"] > 0 for r in rec["ranks"]), rec
    finally:
        eng.release()


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
across_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 or more CUDA GPUs ({GPUS} here): run on a machine with "
                                                  "several, e.g. benchmarks/device_run.sh gpus")


def _rank_per_gpu() -> tuple[list[str], tuple[float, ...]]:
    """One rank per GPU (8 at most) with uneven shares 1, 2, 1, 2, ...: head groups and token shards of two sizes."""
    n = min(GPUS, 8)
    return [f"cuda:{i}" for i in range(n)], tuple(1.0 + i % 2 for i in range(n))


@across_gpus
@pytest.mark.parametrize("exchange", ["host", "cuda_ipc", "nccl"])
def test_split_across_gpus_is_exact(full_int8, exchange, monkeypatch):
    """One rank per GPU, uneven shares, at full H3 width: host staging, the GPU-direct exchange (peer-to-peer copies;
    where the GPUs cannot reach each other it must be refused in one line instead) and NCCL. Fresh workers, their
    FIRST step and a second equal the unsplit step on cuda:0 with torch.equal; the record shows the exchange ran on
    every GPU and every rank computed and moved rows. The cuda_ipc pass is what lets SplitPath.CUDA_IPC_P2P into
    TESTED["cuda"]."""
    monkeypatch.setenv("H3MS_ALLOW_UNTESTED_PATHS", "1")  # measuring the path is what this test is for
    devices, shares = _rank_per_gpu()
    options = SplitOptions(exchange=exchange, shares=shares)
    if exchange == "cuda_ipc" and no_peer_access(devices):
        with pytest.raises(ExchangeRefused, match="cannot reach") as exc:
            SplitEngine(devices, options)
        assert "\n" not in str(exc.value) and "set exchange to host" in str(exc.value), exc.value
        return
    eng = SplitEngine(devices, options)
    try:
        for rec in _steps_equal_unsplit(eng, full_int8, f"gpus-{exchange}", 100, f"{exchange} on {devices}"):
            assert rec["exchange"] == exchange and rec["devices"] == devices, rec
            assert all(r["tokens"][1] > r["tokens"][0] and r["moved_bytes"] > 0 for r in rec["ranks"]), rec
    finally:
        eng.release()


@across_gpus
@pytest.mark.parametrize("exchange", ["host", "cuda_ipc"])
@pytest.mark.parametrize("path", [dict(pattern="ulysses"), dict(gather_ahead=4, gather_overlap=True, head_pieces=4)],
                         ids=["ulysses", "all-overlaps"])
def test_split_paths_across_gpus_are_exact(full_int8, exchange, path, monkeypatch):
    """The Ulysses pattern and every overlap at once (head pieces, the gather overlap, gather ahead) with one rank per
    GPU and uneven shares, host-staged and GPU-direct: fresh workers, first and second step torch.equal to the
    unsplit step, the record shows the path ran."""
    monkeypatch.setenv("H3MS_ALLOW_UNTESTED_PATHS", "1")
    devices, shares = _rank_per_gpu()
    if exchange == "cuda_ipc" and no_peer_access(devices):
        pytest.skip(f"{devices}: the GPUs cannot reach each other's memory (test_split_across_gpus_is_exact checks "
                    "the refusal)")
    eng = SplitEngine(devices, SplitOptions(exchange=exchange, shares=shares, **path))
    try:
        for rec in _steps_equal_unsplit(eng, full_int8, f"gpus-paths-{exchange}", 110, f"{path} {exchange}"):
            assert rec["exchange"] == exchange and rec["pattern"] == path.get("pattern", "gather"), rec
            assert rec["head_pieces"] == path.get("head_pieces", 0), rec
            assert rec["gather_ahead"] == path.get("gather_ahead", 0), rec
    finally:
        eng.release()


def test_resident_blocks_are_placed_at_the_load(full_int8):
    """With the step about to run named at the load (as the node and the demo name it), each CUDA rank decides its
    residency then and uploads every resident block as soon as the store has it, beside the fill: the first step
    uploads nothing and equals the unsplit step with torch.equal. Without it the first step uploads them."""
    from h3ms_async.dit.step import Step
    inp = make_step_inputs(FULL, layout_for_tokens(8192), 80, full_int8.dtype)
    ref = [full_int8.forward_blocks(inp.x.cuda(), inp.t_emb.cuda(), inp.segments,
                                    inp.rope_freqs.cuda()).cpu() for _ in range(2)][1]
    for named in (True, False):
        eng = SplitEngine(["cuda:0"] * 2, SplitOptions(vram_residency="resident"))
        try:
            step = Step(inp.x, full_int8.modulation(inp.t_emb), inp.segments, inp.rope_freqs)
            eng.load_weights(("placed", str(named)), FULL, full_int8.block_weights, first_step=step if named else None)
            out = eng.run_step(step)
            assert torch.equal(out, ref), f"named={named}: max |diff| {(out.float() - ref.float()).abs().max():g}"
            weights = [r.weights for r in eng.last_rank_results]
            assert [w["resident_blocks"] for w in weights] == [FULL.layers] * 2, weights
            assert [w["uploaded_blocks"] for w in weights] == ([0, 0] if named else [FULL.layers] * 2), weights
        finally:
            eng.release()


def test_auto_residency_streams_the_blocks_another_process_took_the_room_for(full_int8):
    """``vram_residency auto`` keeps every block resident when the GPU has room at the first step; once another
    process takes all but 2 GiB (this one here, standing in for ComfyUI, whose weights and casts grow while the store
    fills: an H100 ran out of memory so at the node's first step with a LoRA), the next step streams its last blocks
    instead of running out of memory, and still equals the unsplit step with torch.equal."""
    inp = make_step_inputs(FULL, layout_for_tokens(8192), 81, full_int8.dtype)
    ref = [full_int8.forward_blocks(inp.x.cuda(), inp.t_emb.cuda(), inp.segments,
                                    inp.rope_freqs.cuda()).cpu() for _ in range(2)][1]
    mod = full_int8.modulation(inp.t_emb)
    eng = SplitEngine(["cuda:0"] * 2, SplitOptions(vram_residency="auto"))
    hog = None
    try:
        eng.load_weights(("shed", "int8"), FULL, full_int8.block_weights)
        assert torch.equal(eng.run_blocks(inp.x, mod, inp.segments, inp.rope_freqs), ref)
        weights = [r.weights for r in eng.last_rank_results]
        assert [w["resident_blocks"] for w in weights] == [FULL.layers] * 2, weights
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        hog = torch.empty(free - (2 << 30), dtype=torch.uint8, device="cuda")
        out = eng.run_blocks(inp.x, mod, inp.segments, inp.rope_freqs)
        assert torch.equal(out, ref), f"max |diff| {(out.float() - ref.float()).abs().max():g}"
        weights = [r.weights for r in eng.last_rank_results]
        assert all(w["resident_blocks"] < FULL.layers and w["streamed_blocks"] > 0 for w in weights), weights
    finally:
        del hog
        torch.cuda.empty_cache()
        eng.release()


@pytest.mark.parametrize("how", ["interrupt", "kill"])
def test_gpu_direct_events_stop_on_an_interrupt_and_on_a_killed_rank(full_int8, how, monkeypatch):
    """Ordered by CUDA IPC events the ranks' hosts run ahead of their GPU (at most workers/dit/cuda.py's AHEAD_OPS
    ops): an interrupt a third into a step still ends it on every rank, leaving every worker alive (the queued work
    drained, nothing retired); a rank killed a third into a step fails it on every rank, within the exchange
    deadline, not hanging on the dead rank's events. The next step after either equals the unsplit step."""
    import os
    import signal
    import threading
    import time
    from h3ms_async.dit.errors import SplitError, SplitInterrupted
    monkeypatch.setenv("H3MS_ALLOW_UNTESTED_PATHS", "1")  # measuring the path is what this test is for
    eng = SplitEngine(["cuda:0"] * 2, SplitOptions(exchange="cuda_ipc", ipc_sync="events", exchange_chunks=8,
                                                   exchange_deadline_s=20.0))
    try:
        eng.load_weights(("cuda-ipc-stop", how), FULL, full_int8.block_weights)
        inp = make_step_inputs(FULL, layout_for_tokens(65536), 90, full_int8.dtype)
        mod = full_int8.modulation(inp.t_emb)
        t = time.monotonic()
        eng.run_blocks(inp.x, mod, inp.segments, inp.rope_freqs)
        third = (time.monotonic() - t) / 3
        fire = time.monotonic() + third
        if how == "interrupt":
            with pytest.raises(SplitInterrupted):
                eng.run_blocks(inp.x, mod, inp.segments, inp.rope_freqs, interrupt=lambda: time.monotonic() > fire)
            states = [w["state"] for w in eng.pool.snapshot()]
            assert all(s in ("ready", "busy") for s in states), states  # nobody retired for an interrupt
        else:
            victim = eng.pool.snapshot()[1]["pid"]
            killer = threading.Timer(third, os.kill, (victim, signal.SIGKILL))
            killer.start()
            with pytest.raises(SplitError, match="rank 1"):
                eng.run_blocks(inp.x, mod, inp.segments, inp.rope_freqs)
            killer.join()
        print(f"{how}: the step ended {time.monotonic() - fire:.2f} s after it ({3 * third:.2f} s a step)")
        assert time.monotonic() - fire < 20.0
        ref = [full_int8.forward_blocks(inp.x.cuda(), inp.t_emb.cuda(), inp.segments,
                                        inp.rope_freqs.cuda()).cpu() for _ in range(2)][1]
        out = eng.run_blocks(inp.x, mod, inp.segments, inp.rope_freqs)
        assert torch.equal(out, ref), f"after {how}: max |diff| {(out.float() - ref.float()).abs().max():g}"
    finally:
        eng.release()
