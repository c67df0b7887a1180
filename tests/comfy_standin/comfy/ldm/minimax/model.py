"""Stand-in for ``comfy.ldm.minimax.model.MiniMaxH3Model`` (tests only).

What is faithful, and to which fact:
- parameter names and shapes of ``blocks.{i}.*`` (h3_dit_facts §1.3), config read from the live modules (§1.1);
- ``forward`` runs the DIFFUSION_MODEL wrappers through ``WrapperExecutor.new_class_executor(self._forward, self, ...)``
  with args ``(x, timestep, context, transformer_options, minimax_payload=, denoise_mask=, audio_denoise_mask=)``
  (§2.1, §3.2);
- ``_forward``: compute dtype = ``context.dtype``; packed order text | audio | video; ``t_v = 1 - sigma``,
  ``t_a = 1 - time_shift_sigma(sigma, 12, 3)`` in Python floats; mod rows ``t_row * 3 + tag`` (video 0, text 1,
  audio 2); t_emb fp32 sin/cos embedder then ``.to(dtype)``; rope rotation table ``[1, S, 1, pairs, 2, 2]`` cast to
  dtype (§2.2);
- the block loop (§3.1): before block i ``transformer_options["block_index"] = i``; if
  ``transformer_options["patches_replace"]["dit"]`` holds ``("double_block", i)`` it calls
  ``h = patch(args, {"original_block": block_wrap})["img"]`` with
  ``args = {img, t_emb, mod_segments, rope_freqs, layout, transformer_options}``; ``block_wrap(args)`` returns
  ``{"img": block(args["img"], args["t_emb"], args["mod_segments"], args["rope_freqs"],
  transformer_options=args["transformer_options"], attention=args.get("attention"))}``; otherwise the block is called
  directly.  A block mutates ``x`` in place and returns it (§2.3);
- the final layer (§2.5) and the negated outputs in the input dtypes (§2.2).
Simplified: no keyframes/refs, no masks, no PDD heads, a plain packed layout with made-up positions for text and
audio rows; the token refiner is assumed already applied (context has width H, §2.2).

The block math itself is the project's reference op sequence (``workers.dit_ops.block_forward_unsplit``), so that
"unpatched ComfyUI" here means "the unsplit reference block loop".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
import torch
import torch.nn.functional as F

from ...patcher_extension import WrapperExecutor, WrappersMP, get_all_wrappers


def time_shift_sigma(s: float, shift_from: float, shift_to: float) -> float:
    base = s / (shift_from + s * (1.0 - shift_from))
    return shift_to * base / (1.0 + (shift_to - 1.0) * base)


@dataclass
class PackedLayout:
    segments: list[tuple[int, int, str]]
    seq_len: int


class Attention(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int, dtype: torch.dtype, eps: float):
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.qkv_proj = torch.nn.Linear(hidden, 3 * inner, bias=False, dtype=dtype)
        self.q_norm = torch.nn.RMSNorm(head_dim, eps=eps, dtype=dtype)
        self.k_norm = torch.nn.RMSNorm(head_dim, eps=eps, dtype=dtype)
        self.out_proj = torch.nn.Linear(inner, hidden, bias=False, dtype=dtype)


class FeedForward(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int, dtype: torch.dtype):
        super().__init__()
        self.fc1 = torch.nn.Linear(hidden, 2 * ffn, bias=False, dtype=dtype)
        self.fc2 = torch.nn.Linear(ffn, hidden, bias=False, dtype=dtype)


class AdalnProj(torch.nn.Module):
    def __init__(self, t_dim: int, out: int, dtype: torch.dtype):
        super().__init__()
        self.linear = torch.nn.Linear(t_dim, out, bias=True, dtype=dtype)


class DiTBlock(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int, ffn: int, t_dim: int, dtype: torch.dtype, eps: float):
        super().__init__()
        self.norm1 = torch.nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.norm2 = torch.nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.attn = Attention(hidden, heads, head_dim, dtype, eps)
        self.mlp = FeedForward(hidden, ffn, dtype)
        self.adaln_proj = AdalnProj(t_dim, 6 * hidden * 3, dtype)

    def plain_weights(self) -> dict[str, torch.Tensor]:
        """The block's tensors under the weight-store names (int8 weights as qdata + ``*_scale``)."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.named_parameters():
            if hasattr(p, "_qdata"):
                out[name] = p._qdata
                out[name + "_scale"] = p._params.scale
            else:
                out[name] = p.detach()
        return out

    def forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options=None, attention=None):
        if attention is not None:
            raise NotImplementedError("the stand-in block has no attention= override")
        from workers.dit_ops import block_forward_unsplit
        head_dim = self.attn.q_norm.weight.shape[0]
        out = block_forward_unsplit(x, self.plain_weights(), t_emb, mod_segments, rope_freqs, self.attn.heads,
                                    head_dim, self.norm1.eps)
        if out is not x:
            x.copy_(out)
        return x  # ComfyUI's block mutates x in place and returns it (§2.3)


class _Rope(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(n, dtype=torch.float32) / n)))


class _TimeEmbedder(torch.nn.Module):
    def __init__(self, freq_dim: int, hidden: int, t_dim: int):
        super().__init__()
        self.freq_dim = freq_dim
        self.proj_in = torch.nn.Linear(freq_dim, hidden, dtype=torch.float32)
        self.proj_out = torch.nn.Linear(hidden, t_dim, dtype=torch.float32)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(1e4) * torch.arange(half, dtype=torch.float32) / half)
        arg = t[:, None].float() * freqs[None]
        emb = torch.cat([torch.cos(arg), torch.sin(arg)], dim=-1)
        return self.proj_out(F.silu(self.proj_in(emb)))


class _FinalLayer(torch.nn.Module):
    def __init__(self, hidden: int, t_dim: int, video_dim: int, audio_dim: int, dtype: torch.dtype, eps: float):
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.adaln_proj = AdalnProj(t_dim, 2 * hidden, dtype)
        self.video_out = torch.nn.Linear(hidden, video_dim, dtype=torch.float32)
        self.audio_out = torch.nn.Linear(hidden, audio_dim, dtype=torch.float32)


class MiniMaxH3Model(torch.nn.Module):
    def __init__(self, hidden: int = 64, layers: int = 3, heads: int = 4, head_dim: int = 16, ffn: int = 96,
                 t_dim: int = 32, rope_inv_freq_len: int = 2, latents_dim: int = 4, audio_latents_dim: int = 8,
                 dtype: torch.dtype = torch.bfloat16, eps: float = 1e-5, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.hidden_size = hidden
        self.dtype = dtype
        self.video_patch_proj = torch.nn.Linear(latents_dim * 4, hidden, dtype=torch.float32)
        self.audio_patch_proj = torch.nn.Linear(audio_latents_dim, hidden, dtype=torch.float32)
        self.time_embedder = _TimeEmbedder(16, hidden, t_dim)
        self.rope = _Rope(rope_inv_freq_len)
        self.blocks = torch.nn.ModuleList(
            DiTBlock(hidden, heads, head_dim, ffn, t_dim, dtype, eps) for _ in range(layers))
        self.final_layer = _FinalLayer(hidden, t_dim, latents_dim * 4, audio_latents_dim, dtype, eps)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_((torch.randn(p.shape, generator=g) * (1.0 / math.sqrt(p.shape[-1]))).to(p.dtype))

    def forward(self, x, timestep, context, transformer_options=None, minimax_payload=None, denoise_mask=None,
                audio_denoise_mask=None, **kwargs):
        transformer_options = {} if transformer_options is None else transformer_options
        executor = WrapperExecutor.new_class_executor(
            self._forward, self, get_all_wrappers(WrappersMP.DIFFUSION_MODEL, transformer_options))
        return executor.execute(x, timestep, context, transformer_options, minimax_payload=minimax_payload,
                                denoise_mask=denoise_mask, audio_denoise_mask=audio_denoise_mask, **kwargs)

    def _forward(self, x, timestep, context, transformer_options=None, minimax_payload=None, **kwargs):
        transformer_options = {} if transformer_options is None else transformer_options
        video, audio = x
        if video.shape[0] != 1:
            raise ValueError("MiniMax H3 supports batch size 1")
        dtype = context.dtype
        _, c, nt, hl, wl = video.shape
        ca, ta = audio.shape[1], audio.shape[3]
        hh, ww = hl // 2, wl // 2
        v_rows = (video[0].float().reshape(c, nt, hh, 2, ww, 2).permute(1, 2, 4, 0, 3, 5)
                  .reshape(nt * hh * ww, c * 4))
        a_rows = audio[0].float().permute(1, 2, 0).reshape(2 * ta, ca)
        text = context[0]
        n_text, n_audio, n_video = text.shape[0], a_rows.shape[0], v_rows.shape[0]
        seq = n_text + n_audio + n_video
        layout = PackedLayout([(0, n_text, "text"), (n_text, n_text + n_audio, "audio"),
                               (n_text + n_audio, seq, "video")], seq)
        transformer_options["minimax_h3_layout"] = layout

        sigma = max(float(timestep[0].float()) / 1000.0, 1e-6)
        t_v = 1.0 - sigma
        t_a = 1.0 - time_shift_sigma(sigma, 12.0, 3.0)
        seg_t = {"text": t_v, "video": t_v, "audio": t_a}
        tag = {"video": 0, "text": 1, "audio": 2}
        unique_t = sorted(set(seg_t.values()))
        t_row = {t: i for i, t in enumerate(unique_t)}
        mod_segments = [(a, b, t_row[seg_t[kind]] * 3 + tag[kind]) for a, b, kind in layout.segments]

        h = torch.empty(seq, self.hidden_size, dtype=dtype)
        h[:n_text] = text.to(dtype)
        h[n_text:n_text + n_audio] = self.audio_patch_proj(a_rows).to(dtype)
        h[n_text + n_audio:] = self.video_patch_proj(v_rows).to(dtype)
        t_emb = self.time_embedder(torch.tensor(unique_t, dtype=torch.float32)).to(dtype)

        pos = torch.zeros(seq, 3, dtype=torch.float64)
        pos[:n_text, 0] = torch.arange(n_text, dtype=torch.float64)
        pos[n_text:n_text + n_audio, 0] = torch.arange(ta, dtype=torch.float64).repeat(2)
        grid = torch.stack(torch.meshgrid(torch.arange(nt), torch.arange(hh), torch.arange(ww), indexing="ij"), -1)
        pos[n_text + n_audio:] = grid.reshape(-1, 3).double()
        angles = (pos.float()[:, :, None] * self.rope.inv_freq).reshape(seq, -1)
        cos, sin = torch.cos(angles), torch.sin(angles)
        rope_freqs = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)
        rope_freqs = rope_freqs.reshape(1, seq, 1, angles.shape[1], 2, 2).to(dtype)

        blocks_replace = transformer_options.get("patches_replace", {}).get("dit", {})
        for i, block in enumerate(self.blocks):
            transformer_options["block_index"] = i
            patch = blocks_replace.get(("double_block", i))
            if patch is not None:
                def block_wrap(args, block=block):
                    return {"img": block(args["img"], args["t_emb"], args["mod_segments"], args["rope_freqs"],
                                         transformer_options=args["transformer_options"],
                                         attention=args.get("attention"))}
                args = {"img": h, "t_emb": t_emb, "mod_segments": mod_segments, "rope_freqs": rope_freqs,
                        "layout": layout, "transformer_options": transformer_options}
                h = patch(args, {"original_block": block_wrap})["img"]
            else:
                h = block(h, t_emb, mod_segments, rope_freqs, transformer_options=transformer_options)

        fl = self.final_layer
        shift, scale = fl.adaln_proj.linear(t_emb).chunk(2, dim=-1)
        outs = {}
        for a, b, kind in layout.segments[1:]:
            row = t_row[seg_t[kind]]
            normed = F.rms_norm(h[a:b], (self.hidden_size,), fl.norm.weight.to(h.dtype), fl.norm.eps)
            y = (normed * (1 + scale[row]) + shift[row]).to(torch.float32)
            outs[kind] = (fl.video_out if kind == "video" else fl.audio_out)(y)
        v_out = (outs["video"].reshape(nt, hh, ww, c, 2, 2).permute(3, 0, 1, 4, 2, 5).reshape(1, c, nt, hl, wl))
        a_out = outs["audio"].reshape(2, ta, ca).permute(2, 0, 1).reshape(1, ca, 2, ta)
        return [-v_out.to(video.dtype), -a_out.to(audio.dtype)]
