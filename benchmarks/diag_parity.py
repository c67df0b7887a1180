"""Diagnostic: which of reference / split changes between runs on CUDA (prints a table of equalities)."""
import torch
from h3ms_async.dit.layout import layout_for_tokens
from h3ms_async.dit.reference import DiTConfig, ReferenceDiT, make_step_inputs
from h3ms_async.dit.options import SplitOptions
from h3ms_async.dit.split import SplitEngine

CFG = DiTConfig(hidden=1024, layers=3, heads=16, head_dim=128, ffn=2816, t_dim=256, rope_pairs=48)
m8 = ReferenceDiT(CFG, weights="int8", seed=21, device="cuda")
mb = ReferenceDiT(CFG, weights="bf16", seed=21, device="cuda")
inp = make_step_inputs(CFG, layout_for_tokens(4096), 40, torch.bfloat16)
def ref(m):
    return m.forward_blocks(inp.x.cuda(), inp.t_emb.cuda(), inp.segments, inp.rope_freqs.cuda()).cpu()
r = {"ref1": ref(m8), "ref2": ref(m8)}
ref(mb)
r["ref3_after_bf16"] = ref(m8)
for ranks, res in ((2, "resident"), (4, "resident"), (2, "stream")):
    eng = SplitEngine(["cuda:0"] * ranks, SplitOptions(vram_residency=res))
    eng.load_weights(("d", ranks, res), CFG, m8.block_weights)
    r[f"split{ranks}_{res}_a"] = eng.run_blocks(inp.x, m8.modulation(inp.t_emb), inp.segments, inp.rope_freqs)
    r[f"split{ranks}_{res}_b"] = eng.run_blocks(inp.x, m8.modulation(inp.t_emb), inp.segments, inp.rope_freqs)
    r[f"ref_after_{ranks}_{res}"] = ref(m8)
    eng.release()
names = list(r)
for a in names:
    print(f"{a:>24}: " + " ".join("=" if torch.equal(r[a], r[b]) else "." for b in names))
print("columns:", names)
