"""The MiniMax H3 DiT block, op for op as ComfyUI runs it, in pieces a rank can run on its shard.

The block loop over these ops (``workers.dit.loop``) serves the unsplit reference
(``h3ms_async.dit.reference``), the in-process simulated split and the rank processes
(``workers.dit.rank``), so a split can only differ from the reference through what it slices, never
through how it computes.  Every op mirrors ComfyUI's ``DiTBlock`` (comfy/ldm/minimax/model.py): the
same dtypes, the same rounding points, in place where ComfyUI is in place. See
``docs/comfyui_facts.md`` §1, §2.

Weights are plain tensors in a dict keyed as ComfyUI's state dict inside one block
(``norm1.weight``, ``attn.qkv_proj.weight``, ...).  A linear is int8 when its ``.weight`` is
``torch.int8``; it then carries ``.weight_scale`` (fp32, one value or one per output row) and
optionally ``.comfy_quant`` (uint8 bytes of the checkpoint's JSON, read for ConvRot).

Exactness of a split rests on three facts (``docs/comfyui_facts.md`` §2.3, §4.1): int8 linears are
exact under token (row of x) and output-row slicing; rms_norm, modulation, gating and the fused
rms+rope kernel are per row; attention heads are independent.  Float GEMMs under sliced shapes are
*not* guaranteed exact; tests measure them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import comfy_kitchen as ck
import torch
import torch.nn.functional as F

from workers.runtime import config

#: whatever a block's weights are held as (tensors; the store's sources)
_W = TypeVar("_W")

Row = int | torch.Tensor
"""A mod-segment row: an int, or a LongTensor of per-token rows (masked segments)."""
ModSegment = tuple[int, int, Row]
"""A modulation segment: tokens [a, b) take the modulation row ``Row`` (not a shared-memory
segment)."""

# Names of the four linears that int8 checkpoints quantize; everything else stays in model dtype.
INT8_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


def apply_kitchen_policy() -> None:
    """Set comfy-kitchen's backends as ComfyUI's ``comfy/quant_ops.py`` does, for standalone use
    (the CLI's reference, workers without a ComfyUI parent; with one, that module sets them:
    ``workers.runtime.comfy_host``): ``cuda`` needs torch built with CUDA >= 13, ``triton`` needs
    ``H3MS_ENABLE_TRITON_BACKEND=1`` (ComfyUI's ``--enable-triton-backend``).
    """
    cuda = torch.version.cuda
    if cuda is None or int(cuda.split(".")[0]) < 13:
        ck.disable_backend("cuda")
    if not config.ENABLE_TRITON_BACKEND.get():
        ck.disable_backend("triton")


# ComfyUI puts SDPA under an explicit backend priority only for large inputs on CUDA (comfy/ops.py).
_SDPA_PRIORITY_MIN_ELEMENTS = 1024 * 128


@dataclass(frozen=True)
class Shard:
    """What one rank owns: tokens [t0, t1) of the packed sequence and attention heads [g0, g1)."""

    t0: int
    t1: int
    g0: int
    g1: int

    def __post_init__(self) -> None:
        if not (0 <= self.t0 < self.t1):
            raise ValueError(
                f"Shard tokens [{self.t0}, {self.t1}) are empty or negative; each rank needs >= 1 "
                "token"
            )
        if not (0 <= self.g0 < self.g1):
            raise ValueError(
                f"Shard heads [{self.g0}, {self.g1}) are empty or negative; each rank needs >= 1 "
                "head"
            )

    @property
    def tokens(self) -> slice:
        return slice(self.t0, self.t1)

    @property
    def n_tokens(self) -> int:
        return self.t1 - self.t0

    @property
    def n_heads(self) -> int:
        return self.g1 - self.g0


@dataclass(frozen=True)
class QuantInfo:
    """The int8 linear parameters ComfyUI passes to ``int8_linear`` besides the tensors."""

    convrot: bool = False
    convrot_groupsize: int = 256


class CallFault(Protocol):
    """A test hook's fault (``workers/testing/faults.py``): may perturb one call's output."""

    def apply(
        self, kind: str, shape: tuple[int, ...], out: torch.Tensor, probing: bool
    ) -> None: ...


#: The test hooks' shape fault (``H3MS_TEST_HOOKS=1``, read once at import); None in production.
SHAPE_FAULT: CallFault | None = None
if config.TEST_HOOKS.get():
    from workers.testing.faults import shape_fault_from_env

    SHAPE_FAULT = shape_fault_from_env()
_PROBING = [False]


def is_probing() -> bool:
    """Whether the current calls are the invariance probe's (:func:`probing`)."""
    return _PROBING[0]


@contextlib.contextmanager
def probing() -> Iterator[None]:
    """Calls made inside are the invariance probe's (a ``steps_only`` shape fault leaves them
    alone)."""
    _PROBING[0] = True
    try:
        yield
    finally:
        _PROBING[0] = False


def is_int8(weight: torch.Tensor) -> bool:
    """True for a quantized linear weight (int8 storage); its scale lives under
    ``<linear>.weight_scale``."""
    return weight.dtype == torch.int8


def quant_info(weights: dict[str, torch.Tensor], linear: str) -> QuantInfo:
    """ConvRot settings of one int8 linear, from its ``comfy_quant`` JSON bytes when present
    (default: off)."""
    raw = weights.get(f"{linear}.comfy_quant")
    if raw is None:
        return QuantInfo()
    try:
        conf = json.loads(bytes(raw.cpu().numpy().tobytes()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"{linear}.comfy_quant is not UTF-8 JSON ({exc}); re-export the int8 checkpoint"
        ) from exc
    fmt = conf.get("format")
    if fmt != "int8_tensorwise":
        raise ValueError(
            f"{linear}.comfy_quant format {fmt!r} is not supported; only 'int8_tensorwise' "
            "checkpoints are"
        )
    return QuantInfo(bool(conf.get("convrot", False)), int(conf.get("convrot_groupsize", 256)))


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    quant: QuantInfo = QuantInfo(),
    input_act: str | None = None,
) -> torch.Tensor:
    """:func:`_linear` (below), through the test hook's shape fault when one is set
    (:data:`SHAPE_FAULT`)."""
    out = _linear(x, weight, scale, bias, quant=quant, input_act=input_act)
    if SHAPE_FAULT is not None:
        SHAPE_FAULT.apply(
            "linear", (x.shape[0], weight.shape[1], weight.shape[0]), out, _PROBING[0]
        )
    return out


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    quant: QuantInfo,
    input_act: str | None,
) -> torch.Tensor:
    """One H3 linear as ComfyUI dispatches it: int8 weight → ``ck.int8_linear``, else ``F.linear``.

    ``input_act="swiglu"`` means the input is ``[gate | up]`` and the linear sees ``silu(gate) *
    up``.  The int8 path fuses it into kitchen's activation quantizer (``linear_input_act``); the
    float path computes ``silu(gate).mul_(up)`` in the input dtype first, as ComfyUI's eager
    fallback does.
    """
    if is_int8(weight):
        if scale is None:
            raise ValueError(
                "int8 linear weight without its weight_scale; the block weights must carry "
                "<linear>.weight_scale"
            )
        return ck.int8_linear(
            x.contiguous(),
            weight,
            scale,
            bias,
            out_dtype=x.dtype,
            convrot=quant.convrot,
            convrot_groupsize=quant.convrot_groupsize,
            input_act=input_act,
        )
    if input_act == "swiglu":
        half = x.shape[-1] // 2
        x = F.silu(x[..., :half]).mul_(x[..., half:])
    elif input_act is not None:
        raise ValueError(
            f"input_act {input_act!r} is not used by H3 blocks; only 'swiglu' is supported"
        )
    # ComfyUI's cast_bias_weight: weight and bias go to the activation (compute) dtype per layer,
    # e.g. bf16 weights computed in fp32 on CPU or with --force-fp32.
    if weight.dtype != x.dtype:
        weight = weight.to(dtype=x.dtype)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(dtype=x.dtype)
    return F.linear(x, weight, bias)


def block_quant(weights: dict[str, torch.Tensor]) -> dict[str, QuantInfo]:
    """:func:`quant_info` of each of a block's ``INT8_LINEARS``, read once per weight load: on a
    CUDA rank the ``comfy_quant`` bytes sit in VRAM, and reading them per call would sync the host
    with the GPU per linear."""
    return {name: quant_info(weights, name) for name in INT8_LINEARS}


def _linear_named(
    x: torch.Tensor,
    weights: dict[str, torch.Tensor],
    name: str,
    input_act: str | None = None,
    quant: QuantInfo | None = None,
) -> torch.Tensor:
    w = weights[f"{name}.weight"]
    if is_int8(w):
        return linear(
            x,
            w,
            weights[f"{name}.weight_scale"],
            None,
            quant=quant_info(weights, name) if quant is None else quant,
            input_act=input_act,
        )
    return linear(x, w, None, weights.get(f"{name}.bias"), input_act=input_act)


#: Prefix of a block's adaLN projection: its weights stay with the model's owner, which computes
#: the modulation rows once per step (:func:`adaln_rows`); the ranks get the rows with the step.
ADALN_PREFIX = "adaln_proj."


def held_by_ranks(name: str) -> bool:
    """Whether the block parameter ``name`` (in-block name) is one the ranks hold: every one but
    the adaLN projection's."""
    return not name.startswith(ADALN_PREFIX)


def rank_weights(weights: Mapping[str, _W]) -> dict[str, _W]:
    """The part of a block's weights the ranks hold (:func:`held_by_ranks`): what the weight store
    keeps of a block."""
    return {name: t for name, t in weights.items() if held_by_ranks(name)}


def adaln_width(hidden: int) -> int:
    """Columns of a block's raw adaLN output: 6 vectors (shift, scale, gate for attention and MLP)
    for each of 3 modalities."""
    return 18 * hidden


def adaln_rows(
    weights: dict[str, torch.Tensor], t_emb: torch.Tensor, *, apply_silu: bool = True
) -> torch.Tensor:
    """A block's raw adaLN output ``[M, 18·hidden]``: ``adaln_proj.linear`` of ``silu(t_emb)``
    (of ``t_emb`` when ``apply_silu`` is off: curve-form checkpoints), what ComfyUI's
    ``AdalnProj.forward`` computes before it chunks; split into the six vectors by
    :func:`modulation`."""
    inp = F.silu(t_emb) if apply_silu else t_emb
    return _linear_named(inp, weights, "adaln_proj.linear")


def modulation(rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A block's modulation vectors ``(shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp,
    gate_mlp)`` from its raw adaLN output ``rows`` [M, 18·hidden] (:func:`adaln_rows`); row
    ``3·t_row + tag`` of each belongs to one timestep and modality, as ComfyUI's ``AdalnProj``
    views and chunks it."""
    return rows.view(rows.shape[0] * 3, -1).chunk(6, dim=-1)


def clip_segments(segments: Sequence[ModSegment], t0: int, t1: int) -> list[ModSegment]:
    """Mod segments restricted to tokens [t0, t1) and shifted to shard coordinates (row tensors
    sliced alike).

    Each element gets exactly one sequence of ops whatever the segment boundaries
    (``docs/comfyui_facts.md`` §1.3), so clipping is exact.
    """
    if t0 < 0 or t1 <= t0:
        raise ValueError(f"clip_segments: token range [{t0}, {t1}) is empty or negative")
    out: list[ModSegment] = []
    for a, b, row in segments:
        lo, hi = max(a, t0), min(b, t1)
        if lo >= hi:
            continue
        part = row[lo - a : hi - a] if isinstance(row, torch.Tensor) else row
        out.append((lo - t0, hi - t0, part))
    return out


def _mod_vec(vec: torch.Tensor, row: Row, dtype: torch.dtype) -> torch.Tensor:
    # Curve-form adaln is fp32; ComfyUI casts the picked row to the stream dtype at use.
    return vec[row].to(dtype)


def norm_modulate(
    x_rows: torch.Tensor,
    norm_w: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    segments: Sequence[ModSegment],
    eps: float,
) -> torch.Tensor:
    """``rms_norm(x)`` then, per segment in order and in place, ``mul_(1 + scale[row])`` and
    ``add_(shift[row])``.

    ``1 + scale`` is its own op in the stream dtype (rounded before the multiply), as in ComfyUI.
    ``segments`` must already be in ``x_rows``' local coordinates (``clip_segments``).  Returns a
    new tensor.
    """
    n = F.rms_norm(
        x_rows, (x_rows.shape[-1],), norm_w.to(device=x_rows.device, dtype=x_rows.dtype), eps
    )
    for a, b, row in segments:
        sc = _mod_vec(scale, row, n.dtype)
        sh = _mod_vec(shift, row, n.dtype)
        n[a:b].mul_(1.0 + sc).add_(sh)
    return n


def gated_residual_(
    x_rows: torch.Tensor, y_rows: torch.Tensor, gate: torch.Tensor, segments: Sequence[ModSegment]
) -> torch.Tensor:
    """``x[a:b].addcmul_(y[a:b], gate[row])`` per segment: one fused rounding, in place on
    ``x_rows``."""
    for a, b, row in segments:
        x_rows[a:b].addcmul_(y_rows[a:b], _mod_vec(gate, row, x_rows.dtype))
    return x_rows


def head_rows(g0: int, g1: int, heads: int, head_dim: int) -> tuple[range, range, range]:
    """Rows of ``attn.qkv_proj.weight`` that produce heads [g0, g1): the q, k and v row blocks, in
    that order."""
    if not (0 <= g0 < g1 <= heads):
        raise ValueError(f"head group [{g0}, {g1}) is not inside the model's {heads} heads")
    inner = heads * head_dim
    return tuple(
        range(base + g0 * head_dim, base + g1 * head_dim) for base in (0, inner, 2 * inner)
    )  # type: ignore[return-value]


def slice_qkv_weights(
    weights: dict[str, torch.Tensor], g0: int, g1: int, heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Contiguous ``(weight, scale)`` of the fused qkv projection for heads [g0, g1) (scale None for
    float).

    The result is a copy laid out ``[q rows | k rows | v rows]`` of the group, so the group's
    projection output has the same q|k|v packing as the full one.  Done once per weight load, not
    per step.
    """
    w = weights["attn.qkv_proj.weight"]
    expect = 3 * heads * head_dim
    if w.shape[0] != expect:
        raise ValueError(
            f"attn.qkv_proj.weight has {w.shape[0]} rows, expected 3*heads*head_dim = {expect}; "
            "check heads/head_dim against the checkpoint"
        )
    if (g0, g1) == (0, heads):
        return w, weights.get("attn.qkv_proj.weight_scale") if is_int8(w) else None
    blocks = [slice(r.start, r.stop) for r in head_rows(g0, g1, heads, head_dim)]
    w_part = torch.cat([w[s] for s in blocks]).contiguous()
    if not is_int8(w):
        return w_part, None
    scale = weights["attn.qkv_proj.weight_scale"]
    if scale.numel() == 1:
        return w_part, scale
    return w_part, torch.cat([scale[s] for s in blocks]).contiguous()


def flash_tiles_ok(heads_local: int, heads_total: int, tokens: int, sm_count: int) -> bool:
    """Whether a head group keeps CUDA SDPA's kernel choice identical to the unsplit run (so it
    stays bit-exact).

    PyTorch's FlashAttention-2 forward picks a split-KV schedule when ``heads * ceil(S / 64)`` query
    tiles fall under ``0.8 * 2 * SMs`` (H200: 211); a split-KV run rounds differently.  A head group
    is safe when it keeps enough tiles on its own, or when it is the whole model (then it is the
    unsplit run).  Measured on the H200: 4 of 16 heads at 3000 tokens (188 tiles) differed, at 4096
    tokens (256 tiles) it was exact.  Real H3 sequences (tens of thousands of tokens) have thousands
    of tiles per rank.
    """
    if heads_local >= heads_total:
        return True
    return heads_local * -(-tokens // 64) >= 0.8 * 2 * sm_count


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA under ComfyUI's backend policy: an explicit FLASH > CUDNN > EFFICIENT > MATH priority
    for large CUDA inputs (``q.nelement() >= 1024*128``), PyTorch's default choice otherwise.  q, k,
    v: ``[1, h, S, D]``."""
    if q.is_cuda and q.nelement() >= _SDPA_PRIORITY_MIN_ELEMENTS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        order = [
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.CUDNN_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.MATH,
        ]
        with sdpa_kernel(order, set_priority=True):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False
            )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)


#: Attention kernels of standalone use, mirroring ComfyUI's two H3 choices: PyTorch SDPA (ComfyUI's
#: default on NVIDIA) or comfy-kitchen's INT8 attention (``--use-ck-attention``). Under ComfyUI the
#: ranks run ComfyUI's own selected function instead (``workers.runtime.comfy_host``).
ATTENTION_BACKENDS = ("sdpa", "ck_int8")

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``attend(q, k, v, heads) -> [S, h·D]`` from q, k, v ``[1, h, S, D]`` views (see
``workers.runtime.comfy_host``)."""
Trace = Callable[[str, torch.Tensor], None]
"""``trace(op, output)``: sees each op's output in a block (``verify`` digests them to find the
first difference)."""


def ck_int8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """comfy-kitchen INT8 attention as ComfyUI's ``--use-ck-attention`` runs it: quantize, then
    attend.

    Every scale is per head (v's per head over the whole sequence), so a head group over all tokens
    gives exactly the unsplit result's heads (``docs/comfyui_facts.md`` §4.3; measured on the H200,
    ``docs/device_runs/``). q, k, v: ``[1, h, S, D]``.
    """
    if not ck.int8_attention_is_available(q.device):
        raise RuntimeError(
            f"attention='ck_int8' needs comfy-kitchen's INT8 attention, unavailable on {q.device}; "
            "use attention='sdpa' (ComfyUI without --use-ck-attention)"
        )
    pq = ck.prequantize_int8_attention(q, k, v, scale=None, attn_mask=None)
    return ck.int8_attention_from_prequantized(pq)


def builtin_attend(attention: str) -> Attend:
    """The standalone kernel ``attention`` (one of ``ATTENTION_BACKENDS``) as an :data:`Attend`."""
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"attention={attention!r} is not one of {ATTENTION_BACKENDS}")
    kernel = sdpa if attention == "sdpa" else ck_int8_attention

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
        out = kernel(q, k, v)
        return out.transpose(1, 2).reshape(q.shape[2], heads * q.shape[3])

    return attend


def warm_up(attend: Attend, device: torch.device, dtypes: Sequence[torch.dtype]) -> None:
    """Two attention calls per dtype: one large enough for ComfyUI's CUDA SDPA backend priority (>=
    128k elements) and one below it, which ComfyUI sends to torch's default priority.

    On the H200 a fresh process's first call under that priority returns cuDNN attention's result
    and every later call FlashAttention's; ComfyUI's own process is long warm when the split starts,
    so a rank must be too, on both paths (a small VAE decoder's attention takes the second).
    """
    for dt in dtypes:
        for seq in (1024, 32):
            q = torch.full((1, 1, seq, 128), 0.01, dtype=dt, device=device)
            with torch.inference_mode():
                attend(q, q.clone(), q.clone(), 1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def norm_rope_(
    qkv: torch.Tensor,
    q_norm_w: torch.Tensor,
    k_norm_w: torch.Tensor,
    rope_freqs: torch.Tensor,
    n_heads: int,
    head_dim: int,
    eps: float,
    trace: Trace | None = None,
) -> None:
    """In place on a head group's packed ``[S, 3·h·D]`` projection (the group's rows of the fused
    qkv weight, ``slice_qkv_weights``), as ComfyUI after its qkv linear: q, k, v are strided views
    of the one buffer (:func:`qkv_views`); the fused per-head RMSNorm + split-half rope runs on q
    and k (both with the q-norm epsilon); ``trace`` sees the projection first."""
    seq, width = qkv.shape
    if width != 3 * n_heads * head_dim:
        raise ValueError(
            f"the qkv projection has {width} columns for {n_heads} heads x {head_dim}; expected "
            f"{3 * n_heads * head_dim} (slice the weight with slice_qkv_weights)"
        )
    if rope_freqs.shape[1] != seq:
        raise ValueError(
            f"rope_freqs covers {rope_freqs.shape[1]} tokens but the sequence has {seq}; pass the "
            "full table (head groups see all tokens)"
        )
    if trace is not None:
        trace("attn.qkv_proj", qkv)
    q4, k4, _ = qkv_views(qkv, n_heads, head_dim)
    qw = q_norm_w.to(device=qkv.device)
    kw = k_norm_w.to(device=qkv.device)
    ck.rms_rope_split_half_(
        q4, k4, rope_freqs, qw, kw, epsilon=eps, rot_dim=2 * rope_freqs.shape[-3]
    )


def attend_group(
    qkv: torch.Tensor,
    n_heads: int,
    head_dim: int,
    attend: Attend | None = None,
    trace: Trace | None = None,
) -> torch.Tensor:
    """Attention of a group's ``n_heads`` heads over all tokens in one call, on
    :func:`norm_rope_`'s projection: ``[S, h·D]`` (head-major).  v is cloned; attention sees ``[1,
    h, S, D]`` transposed views; ``attend`` defaults to SDPA (``builtin_attend("sdpa")``); ``trace``
    sees the output."""
    out = attend_views(*qkv_views(qkv, n_heads, head_dim), attend or _SDPA)
    if trace is not None:
        trace("attention", out)
    return out


def attend_head_piece(
    qkv: torch.Tensor, n_heads: int, head_dim: int, h0: int, h1: int, attend: Attend | None = None
) -> torch.Tensor:
    """Attention of heads ``[h0, h1)`` of a group's packed projection (:func:`norm_rope_`):
    ``[S, (h1-h0)·D]``, the heads' q, k, v packed alone as a rank whose group they are packs them,
    which is the layout the invariance probe measures head groups in."""
    piece = torch.cat(
        [qkv[:, r.start : r.stop] for r in head_rows(h0, h1, n_heads, head_dim)], dim=1
    )
    return attend_views(*qkv_views(piece, h1 - h0, head_dim), attend or _SDPA)


def qkv_views(
    qkv: torch.Tensor, n_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k as ``[1, S, h, D]`` and v as ``[S, h, D]``: strided views of one packed
    ``[S, 3·h·D]`` projection."""
    seq = qkv.shape[0]
    q, k, v = qkv.split(n_heads * head_dim, dim=-1)
    return (
        q.view(1, seq, n_heads, head_dim),
        k.view(1, seq, n_heads, head_dim),
        v.view(seq, n_heads, head_dim),
    )


def attend_views(
    q4: torch.Tensor, k4: torch.Tensor, v: torch.Tensor, attend: Attend
) -> torch.Tensor:
    """``attend`` on :func:`qkv_views`' views as ComfyUI passes them: ``[1, h, S, D]`` transposes, v
    cloned."""
    n_heads = q4.shape[2]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q4[0], k4[0], v.clone()))
    out = attend(qh, kh, vh, n_heads)
    if SHAPE_FAULT is not None:
        SHAPE_FAULT.apply("attention", (n_heads,), out, _PROBING[0])
    return out


def out_mlp(
    x_rows: torch.Tensor,
    attn_rows: torch.Tensor,
    weights: dict[str, torch.Tensor],
    gate_msa: torch.Tensor,
    shift_mlp: torch.Tensor,
    scale_mlp: torch.Tensor,
    gate_mlp: torch.Tensor,
    segments_local: Sequence[ModSegment],
    eps: float,
    quant: dict[str, QuantInfo],
    trace: Trace | None = None,
) -> torch.Tensor:
    """Rest of the block on a token range: out_proj, gated residual, norm2 + modulation, fc1, swiglu
    fc2, gated residual.  ``attn_rows`` holds all heads (``[n, h·D]``, head-major) for these tokens;
    ``quant`` is the block's
    :func:`block_quant`; ``trace`` sees each linear's output.  Mutates and returns ``x_rows``."""
    a = _linear_named(attn_rows, weights, "attn.out_proj", quant=quant["attn.out_proj"])
    gated_residual_(x_rows, a, gate_msa, segments_local)
    n2 = norm_modulate(x_rows, weights["norm2.weight"], shift_mlp, scale_mlp, segments_local, eps)
    f = _linear_named(n2, weights, "mlp.fc1", quant=quant["mlp.fc1"])
    m = _linear_named(f, weights, "mlp.fc2", input_act="swiglu", quant=quant["mlp.fc2"])
    if trace is not None:
        for name, t in (("attn.out_proj", a), ("mlp.fc1", f), ("mlp.fc2", m)):
            trace(name, t)
    return gated_residual_(x_rows, m, gate_mlp, segments_local)


_SDPA = builtin_attend("sdpa")
