"""A split block stack (token shards + head groups, exchanges by slicing/cat) equals the unsplit reference.

``SimulatedSplit`` runs R ranks in this process with real slicing: per-rank norm/modulation on its tokens, an
all-gather, attention for its head group over all tokens with its own sliced qkv weights, an all-to-all, and
out_proj + MLP on its tokens.  Compared with ``torch.equal``.
"""
from __future__ import annotations

import json

import pytest
import torch

from h3ms_async.dit.layout import build_layout
from h3ms_async.runtime.plans import make_split_plan
from h3ms_async.dit.reference import DiTConfig, ReferenceDiT, SimulatedSplit, compute_dtype, make_step_inputs
from workers.dit import ops as dit_ops
from workers.dit.loop import BlockInputs, block_forward_unsplit
from workers.dit.ops import Shard
from workers.testing.faults import ShapeFault

from split_checks import Compared, probe_refusals

CFG = DiTConfig(hidden=256, layers=2, heads=10, head_dim=32, ffn=320, t_dim=16, rope_pairs=12)
TAGS = [1, 1, 0, 0, 1, 2, 1, 1, 1]
#: The second CPU pass (scripts/h3ms.sh) takes the even, the uneven and the smallest shards of these.
EXACTNESS = pytest.mark.exactness
# bf16 q/k norm weights on an fp32 stream (bf16-cpu) take torch's unfused rms_norm, as ComfyUI on a CPU does
pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")


def _layouts():
    # Two steps with different sequences and timesteps: text tag runs, keyframe cond + cond_audio rows.
    return [build_layout(9, 3, 4, 5, 6, keyframes=1, keyframe_audio_frames=2, text_tags=TAGS, sigma=0.7),
            build_layout(9, 4, 4, 5, 7, keyframes=[0, 3], keyframe_audio_frames=1, text_tags=TAGS, sigma=0.35)]


def _check_split(model: ReferenceDiT, shares, steps) -> None:
    """Each step's plan for ``shares``, split where the invariance probe accepts it on this CPU (split_checks)."""
    seen = Compared()
    plan0 = make_split_plan(["cpu"] * len(shares), shares, steps[0].x.shape[0], model.config.heads)
    split = SimulatedSplit(model, plan0.head_bounds)
    for n, inp in enumerate(steps):
        plan = make_split_plan(["cpu"] * len(shares), shares, inp.x.shape[0], model.config.heads)
        what = (f"{model.weights} in {inp.x.dtype} step {n} ranks {len(shares)} shares {shares} "
                f"heads {plan.heads_per_rank()} tokens {plan.tokens_per_rank()}")
        refusals = probe_refusals(model, plan, inp.x.dtype)
        if refusals:
            seen.refused.append(f"{what}: {refusals[0]}")
            continue
        x_before = inp.x.clone()
        out = split.forward_blocks(inp.x, inp.t_emb, inp.segments, inp.rope_freqs, plan.token_bounds)
        assert torch.equal(inp.x, x_before), "the split must not modify its input"
        seen.equal(out, model.forward_blocks(inp.x.clone(), inp.t_emb, inp.segments, inp.rope_freqs), what)
    seen.done()


@pytest.fixture(scope="module", params=["fp32", "bf16", "int8", "bf16-cpu"])
def model_and_steps(request):
    # bf16-cpu: bf16 weights computed in fp32, as ComfyUI computes a bf16 checkpoint on a CPU (reference.compute_dtype)
    kind, _, device = request.param.partition("-")
    model = ReferenceDiT(CFG, kind, seed=11).materialize()  # every check and probe reads the blocks again
    dtype = compute_dtype(kind, device) if device else model.dtype
    steps = [make_step_inputs(CFG, layout, seed=5 + i, dtype=dtype) for i, layout in enumerate(_layouts())]
    return model, steps


@pytest.mark.parametrize("shares", [(1,), pytest.param((1, 1), marks=EXACTNESS), (1, 1, 1),
                                    pytest.param((1, 1, 0.7), marks=EXACTNESS), (1,) * 5,
                                    pytest.param((1,) * 8, marks=EXACTNESS), (2, 1, 1, 0.5, 1)],
                         ids=lambda s: ",".join(map(str, s)))
def test_split_equals_unsplit(model_and_steps, shares) -> None:
    model, steps = model_and_steps
    _check_split(model, shares, steps)


def test_split_with_per_token_rows_equals_unsplit() -> None:
    # Masked segments carry a LongTensor of rows; clipping must slice it with the tokens.
    model = ReferenceDiT(CFG, "int8", seed=3)
    layout = build_layout(9, 3, 4, 5, 6, keyframes=1, text_tags=TAGS)
    inp = make_step_inputs(CFG, layout, seed=2, dtype=model.dtype)
    a, b, row = inp.segments[-1]
    per_token = torch.where(torch.arange(b - a) % 3 == 0, torch.tensor(row), torch.tensor(3))
    inp.segments[-1] = (a, b, per_token)
    _check_split(model, (1, 1, 0.7), [inp])


def test_split_convrot_int8_equals_unsplit() -> None:
    model = ReferenceDiT(CFG, "int8", seed=4)
    sd = model.state_dict()
    quant = torch.tensor(list(json.dumps({"format": "int8_tensorwise", "convrot": True,
                                          "convrot_groupsize": 64}).encode()), dtype=torch.uint8)
    for i in range(CFG.layers):
        for lin in dit_ops.INT8_LINEARS:
            sd[f"blocks.{i}.{lin}.comfy_quant"] = quant
    model.load_state_dict(sd)
    assert dit_ops.quant_info(model.block_weights(0), "mlp.fc2") == dit_ops.QuantInfo(True, 64)
    inp = make_step_inputs(CFG, _layouts()[0], seed=9, dtype=model.dtype)
    plain = ReferenceDiT(CFG, "int8", seed=4)
    rotated = model.forward_blocks(inp.x.clone(), inp.t_emb, inp.segments, inp.rope_freqs)
    assert not torch.equal(rotated, plain.forward_blocks(inp.x.clone(), inp.t_emb, inp.segments, inp.rope_freqs))
    _check_split(model, (1, 1, 1), [inp])


def test_block_forward_is_in_place_like_comfyui() -> None:
    model = ReferenceDiT(CFG, "bf16", seed=1)
    inp = make_step_inputs(CFG, _layouts()[0], seed=1, dtype=model.dtype)
    x = inp.x.clone()
    with torch.inference_mode():
        mod = model.modulation(inp.t_emb)[:1]
        out = block_forward_unsplit(x, model.block_weights(0), BlockInputs(mod, inp.segments, inp.rope_freqs),
                                    CFG.heads, CFG.head_dim, CFG.eps)
    assert out is x and not torch.equal(x, inp.x)


def test_clip_segments_shifts_and_slices_rows() -> None:
    rows = torch.arange(10, 20)
    segs = [(0, 4, 1), (4, 10, 0), (10, 20, rows)]
    assert dit_ops.clip_segments(segs, 3, 12)[:2] == [(0, 1, 1), (1, 7, 0)]
    last = dit_ops.clip_segments(segs, 3, 12)[2]
    assert last[:2] == (7, 9) and torch.equal(last[2], rows[:2])
    assert dit_ops.clip_segments(segs, 12, 20)[0][:2] == (0, 8)
    with pytest.raises(ValueError, match="empty"):
        dit_ops.clip_segments(segs, 5, 5)


def test_head_rows_and_slices() -> None:
    q, k, v = dit_ops.head_rows(2, 5, heads=10, head_dim=32)
    assert (q.start, q.stop, k.start, k.stop, v.start, v.stop) == (64, 160, 384, 480, 704, 800)
    with pytest.raises(ValueError, match="not inside"):
        dit_ops.head_rows(4, 11, heads=10, head_dim=32)
    w = ReferenceDiT(CFG, "int8", seed=2).block_weights(0)
    part, scale = dit_ops.slice_qkv_weights(w, 2, 5, CFG.heads, CFG.head_dim)
    full = w["attn.qkv_proj.weight"]
    assert part.is_contiguous() and torch.equal(part, torch.cat([full[64:160], full[384:480], full[704:800]]))
    assert torch.equal(scale, torch.cat([w["attn.qkv_proj.weight_scale"][r] for r in (slice(64, 160),
                                                                                       slice(384, 480),
                                                                                       slice(704, 800))]))
    w["attn.qkv_proj.weight_scale"] = torch.tensor(0.01)
    assert dit_ops.slice_qkv_weights(w, 2, 5, CFG.heads, CFG.head_dim)[1].numel() == 1
    with pytest.raises(ValueError, match="expected 3\\*heads\\*head_dim"):
        dit_ops.slice_qkv_weights(w, 0, 1, 12, 32)


def test_int8_head_slice_matches_full_projection() -> None:
    w = ReferenceDiT(CFG, "int8", seed=2).block_weights(1)
    x = torch.randn(37, CFG.hidden).to(torch.bfloat16)
    full = dit_ops.linear(x, w["attn.qkv_proj.weight"], w["attn.qkv_proj.weight_scale"])
    part = dit_ops.linear(x, *dit_ops.slice_qkv_weights(w, 7, 10, CFG.heads, CFG.head_dim))
    inner = CFG.inner
    cols = [slice(b + 7 * 32, b + 10 * 32) for b in (0, inner, 2 * inner)]
    assert torch.equal(part, torch.cat([full[:, c] for c in cols], dim=1))


def test_shard_and_linear_errors() -> None:
    with pytest.raises(ValueError, match="needs >= 1 token"):
        Shard(4, 4, 0, 1)
    with pytest.raises(ValueError, match="needs >= 1 head"):
        Shard(0, 4, 2, 2)
    assert Shard(2, 9, 1, 4).n_tokens == 7 and Shard(2, 9, 1, 4).n_heads == 3
    w8 = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="weight_scale"):
        dit_ops.linear(torch.zeros(3, 8), w8)
    with pytest.raises(ValueError, match="only 'swiglu'"):
        dit_ops.linear(torch.zeros(3, 8), torch.zeros(4, 4), input_act="gelu")
    bad = {"x.comfy_quant": torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)}
    with pytest.raises(ValueError, match="not supported"):
        dit_ops.quant_info(bad, "x")


def test_float_swiglu_is_gate_then_up() -> None:
    f = torch.randn(5, 8)
    w = torch.randn(3, 4)
    expect = torch.nn.functional.linear(torch.nn.functional.silu(f[:, :4]) * f[:, 4:], w)
    assert torch.equal(dit_ops.linear(f, w, input_act="swiglu"), expect)


@EXACTNESS
@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
def test_small_token_shards_of_four_rows(kind) -> None:
    # 4-row shards (the engine's prior MIN_SHARD_TOKENS; MKL's small-M path rounds 1-3 rows differently): split and
    # exact where the probe measures them row-invariant on this CPU, refused (skipped, with the op) elsewhere.
    model = ReferenceDiT(CFG, kind, seed=8)
    inp = make_step_inputs(CFG, _layouts()[0], seed=4, dtype=model.dtype)
    plan = make_split_plan(["cpu"] * 3, (1, 24, 1), inp.x.shape[0], CFG.heads)
    assert plan.tokens_per_rank()[0] == 4 and plan.tokens_per_rank()[2] == 4
    _check_split(model, (1, 24, 1), [inp])


def test_a_shape_dependent_gemm_is_refused_not_compared(monkeypatch) -> None:
    # The checks above cannot pass by comparing nothing: fc2 made to round differently at the shards' row count (the
    # probe's test hook, as a kernel library picking another kernel for that shape) is refused by the probe, and the
    # split at that plan does differ from unsplit.
    model = ReferenceDiT(CFG, "fp32", seed=8)
    inp = make_step_inputs(CFG, _layouts()[0], seed=4, dtype=model.dtype)
    plan = make_split_plan(["cpu"] * 3, None, inp.x.shape[0], CFG.heads)
    rows = plan.tokens_per_rank()[1]
    assert probe_refusals(model, plan, inp.x.dtype) == []
    monkeypatch.setattr(dit_ops, "SHAPE_FAULT", ShapeFault("linear", (rows, CFG.ffn)))
    refusals = probe_refusals(model, plan, inp.x.dtype)
    # (out_proj has fc2's 320 input features in this config: both are hit, nothing else)
    assert any(r.startswith("mlp.fc2") for r in refusals), refusals
    assert all(r.startswith(("mlp.fc2", "attn.out_proj")) for r in refusals), refusals
    assert any(f"[{plan.token_bounds[1]}, {plan.token_bounds[2]}]" in r for r in refusals), refusals
    out = SimulatedSplit(model, plan.head_bounds).forward_blocks(inp.x, inp.t_emb, inp.segments, inp.rope_freqs,
                                                                 plan.token_bounds)
    assert not torch.equal(out, model.forward_blocks(inp.x.clone(), inp.t_emb, inp.segments, inp.rope_freqs))


@pytest.mark.parametrize("pieces", [3, 12])
def test_the_ulysses_pieces_trace_what_the_one_piece_path_traces(pieces):
    """One rank of the Ulysses pattern in this process (its head pieces still cut: 10 heads in 3, and in 12 with two
    empty): every traced op output (the q, k, v projection put together from the pieces, attention, the tail's
    linears, the block) equals, tensor for tensor, what the pattern traces without pieces, which is what verify
    compares with the unsplit run."""
    from workers.dit.loop import LoopHooks, LoopPaths, RankBlocks, run_blocks
    from workers.dit.weights import CpuWeights
    from workers.transports.arena import ArenaLayout
    from workers.transports.local import LocalArena, LocalExchange

    model = ReferenceDiT(CFG, weights="bf16", seed=3)
    inp = make_step_inputs(CFG, _layouts()[0], 4, model.dtype)
    mod = model.modulation(inp.t_emb)
    seq = inp.x.shape[0]
    layout = ArenaLayout.plan(1, [0, seq], [0, CFG.heads * CFG.head_dim], CFG.hidden, inp.x.dtype, CFG.head_dim, True)
    blocks = [model.block_weights(i) for i in range(CFG.layers)]

    def run(head_pieces: int) -> tuple[torch.Tensor, dict[tuple[int, str], torch.Tensor]]:
        traced: dict[tuple[int, str], torch.Tensor] = {}
        weights = CpuWeights(blocks.__getitem__, CFG.layers, (0, CFG.heads), CFG.heads, CFG.head_dim, eager=True)
        rows = inp.x.clone()
        with torch.inference_mode():
            run_blocks(
                rows,
                BlockInputs(mod, inp.segments, inp.rope_freqs),
                RankBlocks(weights, LocalExchange(0, LocalArena(layout, rows.device, lambda: None)), CFG.heads,
                           CFG.head_dim, CFG.eps),
                range(CFG.layers),
                LoopPaths(pattern="ulysses", head_pieces=head_pieces),
                LoopHooks(trace=lambda i, op, t: traced.__setitem__((i, op), t.clone())),
            )
        return rows, traced

    whole, want = run(0)
    out, got = run(pieces)
    assert torch.equal(out, whole)
    assert sorted(got) == sorted(want) and {op for _, op in got} >= {"attn.qkv_proj", "attention", "block"}
    for key, t in want.items():
        assert torch.equal(got[key], t), key
