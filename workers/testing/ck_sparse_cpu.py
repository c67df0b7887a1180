"""Test hook: comfy-kitchen's chunked Sol-Attn (``sol_attn_chunked``) on the CPU, where kitchen has
only the eager reference of the unchunked ``sol_attn`` (``docs/comfyui_facts.md`` §10).

Installed only on request (:func:`install`; a worker with ``H3MS_TEST_HOOKS=1
H3MS_CK_SPARSE_CPU=1``), it replaces ``sol_attn_chunked`` and ``sol_attn_is_available`` for CPU
devices and leaves CUDA ones to kitchen's own code.  It takes the call as kitchen's kernel does: the
fused qkv projection in chunks (``[M, 3·h·128]`` bfloat16, 64-aligned starts, a callable is called
once per pass), last step's ``kmean``/``vscale`` or None (then it measures them on this call first).
It applies kitchen's RMSNorm + split-half rope to q and k (``rms_rope_split_half_``), centres k by
``kmean`` and rounds v to int8 steps of ``vscale`` (so a step's result depends on the statistics it
is given, as the kernel's quantizing producer's does), runs kitchen's eager ``sol_attn`` (per head:
a head gets the same bits whatever other heads share the call) and returns ``(out [1, T, h, 128]
bf16, kmean_next, vscale_next)``, the statistics as the kernel defines them (post-rope K mean, V
absmax / 127 with its margin, per head and channel, fp32).  It is not bit-comparable with the CUDA
kernel and need not be: the tests compare a split with the same sparse attention unsplit, both
running it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import comfy_kitchen as ck
import torch

# The name only; the variable is declared in workers/testing/settings.py.
ENV = "H3MS_CK_SPARSE_CPU"
_KITCHEN = {name: getattr(ck, name) for name in ("sol_attn_chunked", "sol_attn_is_available")}
HEAD_DIM = 128
BLOCK = 64
#: kitchen's clip headroom on last step's V absmax (``_SOL_VSCALE_MARGIN``).
VSCALE_MARGIN = 1.1


def sol_attn_is_available(device: torch.device | None = None) -> bool:
    if device is not None and device.type == "cpu":
        return True
    return bool(_KITCHEN["sol_attn_is_available"](device))


def _gather(
    qkv_chunks: Iterable[torch.Tensor] | Callable[[], Iterable[torch.Tensor]], t: int, width: int
) -> torch.Tensor:
    """The chunks of one producer pass, checked as the kernel checks them, as one ``[T, width]``
    tensor."""
    parts: list[torch.Tensor] = []
    t0 = 0
    for chunk in qkv_chunks() if callable(qkv_chunks) else qkv_chunks:
        if t0 % BLOCK:
            raise ValueError("sol_attn_chunked: chunk starts must be 64-aligned")
        if chunk.shape[-1] != width or chunk.dtype != torch.bfloat16:
            raise ValueError(
                f"sol_attn_chunked: chunks must be [M, {width}] bfloat16, got "
                f"{tuple(chunk.shape)} {chunk.dtype}"
            )
        parts.append(chunk)
        t0 += chunk.shape[-2]
    if t0 != t:
        raise ValueError(f"sol_attn_chunked: chunks cover {t0} tokens, T={t}")
    return torch.cat(parts)


def _per_head(x: torch.Tensor) -> torch.Tensor:
    """``[T, h, D]`` as ``[h, T, D]`` contiguous fp32: each head's reduction over the tokens reads
    only that head, whatever the other heads."""
    return x.float().permute(1, 0, 2).contiguous()


def sol_attn_chunked(
    qkv_chunks,
    t: int,
    h: int,
    rope_freqs: torch.Tensor,
    qk_norm_weights: tuple[torch.Tensor, torch.Tensor],
    kmean: torch.Tensor | None = None,
    vscale: torch.Tensor | None = None,
    tau: float = 1.0,
    topk_ratio: float = 0.0,
    scale: float | None = None,
    sink_blocks: list[int] | None = None,
    sink_q: list[int] | None = None,
    rope_eps: float = 1e-6,
    tail: bool = True,
    block_len: torch.Tensor | None = None,
    coarse_gate: torch.Tensor | None = None,
    token_aug: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if rope_freqs.device.type != "cpu":
        return _KITCHEN["sol_attn_chunked"](
            qkv_chunks, t, h, rope_freqs, qk_norm_weights, kmean, vscale, tau, topk_ratio, scale,
            sink_blocks, sink_q, rope_eps, tail, block_len, coarse_gate, token_aug,
        )  # fmt: skip
    d = HEAD_DIM
    qkv = _gather(qkv_chunks, t, 3 * h * d)
    q, k, v = (part.reshape(1, t, h, d) for part in qkv.split(h * d, dim=-1))
    q, k = q.clone(), k.clone()
    qw, kw = (w.to(torch.bfloat16) for w in qk_norm_weights)
    ck.rms_rope_split_half_(
        q, k, rope_freqs, qw, kw, epsilon=rope_eps, rot_dim=2 * rope_freqs.shape[-3]
    )
    kh, vh = _per_head(k[0]), _per_head(v[0])  # [h, T, D]
    kmean_next = kh.mean(dim=1)
    vscale_next = (vh.abs().amax(dim=1) / 127.0 * VSCALE_MARGIN).clamp_min(1e-8)
    if kmean is None or vscale is None:
        kmean, vscale = kmean_next, vscale_next
    vscale = vscale.float().clamp_min(1e-8)
    kc = (kh - kmean.float()[:, None]).to(torch.bfloat16).permute(1, 0, 2)[None]
    vq = (torch.round(vh / vscale[:, None]).clamp_(-127, 127) * vscale[:, None]).to(torch.bfloat16)
    out = ck.sol_attn(
        q, kc.contiguous(), vq.permute(1, 0, 2)[None].contiguous(),
        tau=tau, scale=scale, sink_blocks=sink_blocks, sink_q=sink_q, topk_ratio=topk_ratio,
        tail=tail, block_len=block_len, coarse_gate=coarse_gate, token_aug=token_aug,
    )  # fmt: skip
    return out, kmean_next, vscale_next


def install() -> None:
    """Swap the hook into ``comfy_kitchen``."""
    ck.sol_attn_chunked = sol_attn_chunked
    ck.sol_attn_is_available = sol_attn_is_available


def uninstall() -> None:
    """Put kitchen's own functions back."""
    for name, fn in _KITCHEN.items():
        setattr(ck, name, fn)
