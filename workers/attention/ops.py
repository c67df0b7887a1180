"""comfy-kitchen's prequantized INT8 attention, cut into head slices and put back together.

``prequantize_int8_attention`` packs Q/K/V once for all heads (per-block scales inside each head,
nothing shared between heads), so a head slice of the packed tensors is exactly what quantizing
those heads alone would give, and ``int8_attention_from_prequantized`` on the slice equals the same
heads of the whole call (measured bit-exact on the H200, docs/attention_parallel.md).  Kitchen's
layout: ``q`` / ``k`` int8 ``[B, H, S, Dpad]``, ``q_scale`` / ``k_scale`` fp32 ``[B, H, n]``, ``v``
int8 ``[B*H*Dpad, Sk_pad]`` (transposed, rows grouped by head) and ``v_scale`` fp32 ``[B*H*Dpad]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from workers.attention.protocol import AttnProbed

#: The packed tensors of one call, in the order they travel.
PACKED = ("q", "k", "v", "q_scale", "k_scale", "v_scale")


def head_slice(pq: Any, h0: int, h1: int) -> dict[str, torch.Tensor]:
    """Views of heads ``[h0, h1)`` of a ``PrequantizedInt8Attention`` (q, k, v and their scales), by
    name."""
    b, heads, _, dpad = pq.q.shape
    if pq.k.shape[1] != heads:
        raise ValueError(
            f"grouped-query attention ({heads} query heads, {pq.k.shape[1]} key heads) cannot be "
            "split by heads here"
        )
    if not 0 <= h0 < h1 <= heads:
        raise ValueError(f"head range [{h0}, {h1}) is outside [0, {heads})")
    sk_pad = pq.v.shape[-1]
    n = h1 - h0
    return {
        "q": pq.q[:, h0:h1],
        "k": pq.k[:, h0:h1],
        "v": pq.v.view(b, heads, dpad, sk_pad)[:, h0:h1].reshape(b * n * dpad, sk_pad),
        "q_scale": pq.q_scale[:, h0:h1],
        "k_scale": pq.k_scale[:, h0:h1],
        "v_scale": pq.v_scale.view(b, heads, dpad)[:, h0:h1].reshape(b * n * dpad),
    }


def meta(pq: Any) -> dict:
    """The non-tensor fields of a ``PrequantizedInt8Attention``, as they travel (``attn_protocol``'s
    ``meta``)."""
    if pq.attn_mask is not None:
        raise ValueError("attention masks cannot be split by heads here")
    return {
        "original_head_dim": int(pq.original_head_dim),
        "input_dtype": str(pq.input_dtype).removeprefix("torch."),
        "attention_scale": float(pq.attention_scale),
        "cta_k": int(pq.cta_k),
    }


def rebuild(tensors: Mapping[str, torch.Tensor], fields: Mapping[str, Any]) -> Any:
    """A ``PrequantizedInt8Attention`` from a slice's tensors and the call's :func:`meta`."""
    from comfy_kitchen.sage_attention import PrequantizedInt8Attention

    dtype = getattr(torch, str(fields["input_dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"meta.input_dtype {fields['input_dtype']!r} is not a torch dtype")
    missing = [name for name in PACKED if name not in tensors]
    if missing:
        raise ValueError(f"packed attention slice lacks {missing}; it needs {list(PACKED)}")
    return PrequantizedInt8Attention(
        q=tensors["q"],
        k=tensors["k"],
        v=tensors["v"],
        q_scale=tensors["q_scale"],
        k_scale=tensors["k_scale"],
        v_scale=tensors["v_scale"],
        original_head_dim=int(fields["original_head_dim"]),
        input_dtype=dtype,
        attention_scale=float(fields["attention_scale"]),
        cta_k=int(fields["cta_k"]),
        attn_mask=None,
    )


def attend(tensors: Mapping[str, torch.Tensor], fields: Mapping[str, Any]) -> torch.Tensor:
    """Kitchen's INT8 attention on one slice (looked up on the module at call time, so a test hook
    applies)."""
    import comfy_kitchen as ck

    from workers.dit import ops as dit_ops

    # a head slice of a batch > 1 is strided; kitchen's kernels take dense tensors (a no-op for
    # batch 1 and shm views)
    out = ck.int8_attention_from_prequantized(
        rebuild({k: t.contiguous() for k, t in tensors.items()}, fields)
    )
    if dit_ops.SHAPE_FAULT is not None:  # the test hook (tests/test_attention_parallel.py)
        dit_ops.SHAPE_FAULT.apply("attention", (out.shape[1],), out, dit_ops.is_probing())
    return out


def probe_ranges(
    shape: tuple[int, int, int, int],
    kv_len: int,
    dtype: torch.dtype,
    ranges: list[tuple[int, int]],
    device: torch.device,
) -> AttnProbed:
    """Whether each head range of ``ranges`` attends to the whole call's bits on ``device``: random
    q of ``shape`` ``[B, H, S, D]`` and k, v of ``kv_len`` tokens (the same numbers on every device,
    ``workers.dit.invariance.RandomPool``), packed once by kitchen as the node packs them, the whole
    call and each range's :func:`attend` compared with ``torch.equal``. Answers per range ``exact``
    and ``max_abs_diff``, the whole call's ``digest`` (compared across devices), the device
    ``fingerprint`` and ``ms``."""
    import comfy_kitchen as ck

    from workers.dit import invariance

    clock = invariance.Clock(device)
    t0 = clock.start()
    pool = invariance.RandomPool(device)
    with torch.inference_mode():
        b, h, _, d = shape
        q = pool.view(dtype, *shape)
        k = pool.view(dtype, b, h, kv_len, d)
        pq = ck.prequantize_int8_attention(q, k, k.clone(), scale=None, attn_mask=None)
        full = ck.int8_attention_from_prequantized(pq)
        fields = meta(pq)
        exact: list[bool] = []
        diffs: list[float] = []
        for h0, h1 in ranges:
            part = attend(head_slice(pq, h0, h1), fields)
            ok = bool(torch.equal(full[:, h0:h1], part))
            exact.append(ok)
            diffs.append(0.0 if ok else float((full[:, h0:h1].float() - part.float()).abs().max()))
        dig = invariance.digest(full)
    return AttnProbed(
        fingerprint=invariance.fingerprint(device),
        exact=exact,
        max_abs_diff=diffs,
        digest=dig,
        ms=clock.ms(t0),
    )
