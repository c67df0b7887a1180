"""Test hook: comfy-kitchen's split INT8 attention (``prequantize_int8_attention`` +
``int8_attention_from_prequantized``) on the CPU, where kitchen has no kernel for it
(docs/attention_parallel.md, "CI").

Installed only on request (:func:`install`; a worker with ``H3MS_TEST_HOOKS=1
H3MS_CK_ATTENTION_CPU=1``), it replaces those kitchen functions (and ``int8_attention_is_available``
/ ``int8_attention``) for CPU tensors and leaves CUDA tensors to kitchen's own code. It produces
kitchen's own ``PrequantizedInt8Attention`` with kitchen's packed layout (head dim padded to
64/128/256; Q scales: 32 per 128-row block; K scales: 4 per ``cta_k`` keys; V int8 transposed to
``[B*Hkv*Dpad, Sk padded to cta_k]`` with one scale per channel), so head slicing, shipping and
rebuilding run on exactly the tensors a GPU run ships.  The arithmetic is a real INT8 attention:
int8 Q·K and uint8 P·int8 V are integer-valued products summed in a float type wide enough to hold
them exactly, so a head's result depends on that head's data only (any slicing, any thread count);
softmax is float64 (so no result depends on how ATen chunks its exp over threads), the output
bf16 (``.float()`` for fp32 inputs), as kitchen's kernel returns it. It
is not bit-comparable with kitchen's CUDA kernel, and does not need to be: CI compares plain ComfyUI
against the pack with the same attention on both sides.
"""

from __future__ import annotations

import math

import comfy_kitchen as ck
import torch
from comfy_kitchen.sage_attention import PrequantizedInt8Attention

# The name only: tests load this file alone by its path (before the pack), so it imports no package
# at module level; the variable is declared in workers/testing/settings.py.
ENV = "H3MS_CK_ATTENTION_CPU"
_KITCHEN = {
    name: getattr(ck, name)
    for name in (
        "int8_attention_is_available",
        "prequantize_int8_attention",
        "int8_attention_from_prequantized",
        "int8_attention",
    )
}
_Q_BLOCK, _Q_SCALES = 128, 32
_K_SCALES = 4


def _kernel_dim(d: int) -> int:
    return 64 if d <= 64 else 128 if d <= 128 else 256


def _quant_groups(x: torch.Tensor, rows: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 ``x`` [B,H,S,D] and one fp32 scale per ``group`` rows, the row count padded to
    ``rows``."""
    b, h, s, d = x.shape
    xf = torch.nn.functional.pad(x.float(), (0, 0, 0, rows - s))
    g = xf.view(b, h, rows // group, group, d)
    scale = (g.abs().amax(dim=(3, 4)) / 127.0).clamp_min(1e-30)
    q = (
        torch.round(g / scale[..., None, None])
        .clamp_(-127, 127)
        .to(torch.int8)
        .view(b, h, rows, d)[:, :, :s]
    )
    return q.contiguous(), scale.contiguous()


def prequantize_int8_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
) -> PrequantizedInt8Attention:
    """Kitchen's ``prequantize_int8_attention`` for CPU tensors (CUDA tensors go to kitchen)."""
    if q.is_cuda:
        return _KITCHEN["prequantize_int8_attention"](q, k, v, scale=scale, attn_mask=attn_mask)
    if attn_mask is not None:
        raise ValueError("the CPU INT8 attention test hook takes no attn_mask")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError("q, k and v must be [batch, heads, sequence, head_dim] of one dtype")
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"q head count ({hq}) must be divisible by k/v head count ({hkv})")
    dk = _kernel_dim(d)
    q, k, v = (torch.nn.functional.pad(t, (0, dk - d)) for t in (q, k, v))
    cta_k = 128 if dk >= 128 and sk > 1024 else 64
    sk_pad = -(-sk // cta_k) * cta_k
    q8, q_scale = _quant_groups(q, -(-sq // _Q_BLOCK) * _Q_BLOCK, _Q_BLOCK // _Q_SCALES)
    k8, k_scale = _quant_groups(k, sk_pad, cta_k // _K_SCALES)
    # [B, Hkv, Dk, Sk_pad]
    vt = torch.nn.functional.pad(v.float().transpose(2, 3), (0, sk_pad - sk))
    v_scale = (vt.abs().amax(dim=3) / 127.0).clamp_min(1e-30)
    v8 = torch.round(vt / v_scale[..., None]).clamp_(-127, 127).to(torch.int8)
    attention_scale = d**-0.5 if scale is None else float(scale)
    if not math.isfinite(attention_scale):
        raise ValueError(f"scale must be finite, got {attention_scale}")
    return PrequantizedInt8Attention(
        q=q8,
        k=k8,
        v=v8.reshape(b * hkv * dk, sk_pad),
        q_scale=q_scale.view(b, hq, -1),
        k_scale=k_scale.view(b, hkv, -1),
        v_scale=v_scale.reshape(-1),
        original_head_dim=d,
        input_dtype=q.dtype,
        attention_scale=attention_scale,
        cta_k=cta_k,
        attn_mask=None,
    )


def int8_attention_from_prequantized(pq: PrequantizedInt8Attention) -> torch.Tensor:
    """Kitchen's ``int8_attention_from_prequantized`` for CPU tensors (CUDA tensors go to
    kitchen)."""
    if pq.q.is_cuda:
        return _KITCHEN["int8_attention_from_prequantized"](pq)
    b, hq, sq, dk = pq.q.shape
    hkv, sk = pq.k.shape[1], pq.k.shape[2]
    sk_pad = pq.v.shape[1]
    out_dtype = torch.bfloat16 if pq.input_dtype == torch.float32 else pq.input_dtype
    out = torch.empty(b, hq, sq, dk, dtype=out_dtype)
    q_group, k_group = _Q_BLOCK // _Q_SCALES, pq.cta_k // _K_SCALES
    v8 = pq.v.view(b, hkv, dk, sk_pad)
    v_scale = pq.v_scale.view(b, hkv, dk)
    for bi in range(b):
        for h in range(hq):  # one head at a time: a head's numbers never depend on another head's
            hk = h // (hq // hkv)
            qs = pq.q_scale[bi, h].repeat_interleave(q_group)[:sq]
            ks = pq.k_scale[bi, hk].repeat_interleave(k_group)[:sk]
            # |sum| <= 256 * 127 * 127 < 2**24: the fp32 product of int8 values is exact in any
            # summation order
            dots = pq.q[bi, h].float() @ pq.k[bi, hk].float().T
            scores = dots * (qs[:, None] * ks[None, :]) * pq.attention_scale
            # in (0, 1], the row's largest is 1; in float64, so that ATen's vector and scalar exp
            # (which one an element gets depends on where its thread's chunk of the tensor starts,
            # i.e. on the thread count) agree far below the rounding to P's 8 bits and to bf16
            e = torch.exp((scores - scores.amax(dim=-1, keepdim=True)).double())
            p8 = torch.round(e * 255.0)
            # uint8 P times int8 V summed over the keys: exact in float64 for any sequence length
            # used here
            acc = p8 @ v8[bi, hk, :, :sk].double().T
            out[bi, h] = (
                acc * (v_scale[bi, hk].double() / (255.0 * e.sum(dim=-1, keepdim=True)))
            ).to(out_dtype)
    out = out[..., : pq.original_head_dim]
    return out.float() if pq.input_dtype == torch.float32 else out


def int8_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Kitchen's one-call ``int8_attention``: the same two halves."""
    if q.is_cuda:
        return _KITCHEN["int8_attention"](q, k, v, scale=scale, attn_mask=attn_mask)
    return int8_attention_from_prequantized(
        prequantize_int8_attention(q, k, v, scale=scale, attn_mask=attn_mask)
    )


def int8_attention_is_available(device: torch.device | str | None = None) -> bool:
    """True for the CPU (this hook; also for no device on a machine without CUDA), kitchen's answer
    otherwise."""
    if (
        torch.device(
            "cpu" if device is None and not torch.cuda.is_available() else device or "cuda"
        ).type
        == "cpu"
    ):
        return True
    return _KITCHEN["int8_attention_is_available"](device)


def install() -> None:
    """Swap the hook into ``comfy_kitchen`` (do it before ComfyUI imports its attention module,
    which asks ``int8_attention_is_available()`` once at import)."""
    ck.prequantize_int8_attention = prequantize_int8_attention
    ck.int8_attention_from_prequantized = int8_attention_from_prequantized
    ck.int8_attention = int8_attention
    ck.int8_attention_is_available = int8_attention_is_available


def uninstall() -> None:
    """Put kitchen's own functions back (tests that install the hook undo it for the rest of the
    session)."""
    for name, fn in _KITCHEN.items():
        setattr(ck, name, fn)
