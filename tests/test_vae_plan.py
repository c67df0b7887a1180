"""The VAE chunk plan and the ordered blend/write against ComfyUI's recorded ones (the shared golden files:
``$H3MS_GOLDEN_DIR``, else ``$H3MS_SHARED/golden``, else ``../shared/golden``)."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

from conftest import GOLDEN_DIR as GOLDEN
from h3ms_async.vae import plan as vae_plan
from h3ms_async.vae.plan import Assembler, VaeGeometry, chunk_counts, deal, make_plan

pytestmark = [pytest.mark.fast,
              pytest.mark.skipif(not (GOLDEN / "vae_plans.json").is_file(), reason=f"no golden files in {GOLDEN}")]


def _plans() -> list[dict]:
    return json.loads((GOLDEN / "vae_plans.json").read_text())["plans"]


def test_geometry_constants_match_the_recording() -> None:
    consts = json.loads((GOLDEN / "vae_plans.json").read_text())["constants"]
    geo = VaeGeometry()
    for name in ("frame_pre_padding", "tokens_chunk_size", "token_overlap", "frame_overlap"):
        assert getattr(geo, name) == consts[name], name


def test_plans_T_1_to_120_equal_comfyui() -> None:
    plans = _plans()
    assert [p["T"] for p in plans] == list(range(1, 121))
    for p in plans:
        assert list(chunk_counts(p["T"])) == p["decode_temporal_chunks"], p["T"]
        if p["decode_path"] != "temporal":
            with pytest.raises(ValueError, match="T=1"):
                make_plan(p["T"])
            continue
        plan = make_plan(p["T"])
        assert (plan.pad_tokens, plan.num_chunks, plan.padded_len) == (p["pad_tokens"], p["num_chunks"],
                                                                       p["padded_len"]), p["T"]
        assert [list(s) for s in plan.spans] == p["spans"], p["T"]
        assert plan.output_frames == p["output_frames"], p["T"]


def test_assembly_of_recorded_chunks_is_bit_exact_and_writes_the_recorded_parts() -> None:
    g = torch.load(GOLDEN / "vae_blend_fp16.pt", weights_only=True)
    plan = make_plan(g["plan"]["T"])
    assert [list(s) for s in plan.spans] == g["plan"]["spans"]
    out = torch.empty(g["plan"]["output_shape"], dtype=torch.float32)
    buf = g["nonpersistent_buffers"]
    asm = Assembler(plan, out, vae_plan.blend,
                    lambda part: vae_plan.finalize(part, buf["pixel_mean"], buf["pixel_std"]))
    for i, raw in enumerate(g["chunk_outputs"]):
        assert torch.equal(g["chunk_inputs"][i], g["z_padded"][:, :, plan.spans[i][0]:plan.spans[i][1]])
        asm.add(raw)
    assert asm.done
    assert asm.parts_written == g["plan"]["parts_written"]
    assert torch.equal(out, g["final"])
    assert hashlib.sha256(out.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() == g["checksums"]["final"]
    assert torch.equal(vae_plan.pad_latent(g["z_denorm"], plan), g["z_padded"])


def test_assembler_refuses_wrong_input() -> None:
    plan = make_plan(7)
    with pytest.raises(ValueError, match="frames but the plan writes"):
        Assembler(plan, torch.empty(1, 3, plan.output_frames + 1, 2, 2), vae_plan.blend, lambda p: p.float())
    asm = Assembler(plan, torch.empty(1, 3, plan.output_frames, 2, 2), vae_plan.blend, lambda p: p.float())
    with pytest.raises(ValueError, match="raw frames"):
        asm.add(torch.zeros(1, 3, 27, 2, 2))


def test_deal_is_round_robin() -> None:
    assert deal(5, 2) == [0, 1, 0, 1, 0]
    assert deal(3, 8) == [0, 1, 2]
    with pytest.raises(ValueError, match="ranks"):
        deal(3, 0)
