"""Reference MiniMax H3 DiT block stack: ComfyUI's parameter names and shapes, seeded weights, the
unsplit loop.

The block math is ``workers.dit.ops`` (the same functions the rank processes run).  This module adds
the model around it: a config of any size (tiny for tests, full width for benchmarks), deterministic
weights generated block by block (so a 50-block full-width model never needs all weights at once),
int8 quantization as H3's int8 checkpoints store it, step inputs (residual, t_emb, mod segments,
rope table), and :class:`SimulatedSplit`: R ranks run the ranks' block loop in one process with real
slicing, to check the split's exactness without processes.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import comfy_kitchen as ck
import torch

from h3ms_async.dit.layout import Layout
from h3ms_async.dit.sparse import UnsplitSparse
from workers.dit import ops as dit_ops
from workers.dit.loop import BlockInputs, LoopHooks, LoopPaths, RankBlocks, run_blocks
from workers.dit.ops import ModSegment, Shard
from workers.dit.weights import CpuWeights
from workers.transports.arena import ArenaLayout
from workers.transports.exchange import IdentityExchange
from workers.transports.local import LocalArena, LocalExchange

WEIGHT_KINDS = ("int8", "bf16", "fp32")
INIT_STD = 0.02
#: Deadline of a simulated rank thread's wait for the others (a tiny test model takes milliseconds
#: per block).
SIMULATED_WAIT_S = 300.0


@dataclass(frozen=True)
class DiTConfig:
    """Block-stack hyper-parameters (defaults: the full H3 model)."""

    hidden: int = 5376
    layers: int = 50
    heads: int = 56
    head_dim: int = 128
    ffn: int = 14336
    t_dim: int = 2688
    rope_pairs: int = 48
    eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "head_dim", "ffn", "t_dim", "rope_pairs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DiTConfig.{name} must be a positive integer, got {value!r}")
        if self.rope_pairs % 3:
            raise ValueError(
                f"DiTConfig.rope_pairs={self.rope_pairs} must be a multiple of 3 (t, h, w axes)"
            )
        if 2 * self.rope_pairs > self.head_dim:
            raise ValueError(
                f"DiTConfig.rope_pairs={self.rope_pairs} rotates {2 * self.rope_pairs} dims but "
                f"head_dim is {self.head_dim}; use rope_pairs <= head_dim/2"
            )

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    def block_shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter shapes inside one block, by ComfyUI name."""
        h, i, f, t = self.hidden, self.inner, self.ffn, self.t_dim
        return {
            "adaln_proj.linear.bias": (dit_ops.adaln_width(h),),
            "adaln_proj.linear.weight": (dit_ops.adaln_width(h), t),
            "attn.k_norm.weight": (self.head_dim,),
            "attn.out_proj.weight": (h, i),
            "attn.q_norm.weight": (self.head_dim,),
            "attn.qkv_proj.weight": (3 * i, h),
            "mlp.fc1.weight": (2 * f, h),
            "mlp.fc2.weight": (h, f),
            "norm1.weight": (h,),
            "norm2.weight": (h,),
        }

    @classmethod
    def from_golden(cls, model_kwargs: dict, eps: float = 1e-5) -> DiTConfig:
        """The config of a golden file's ``config.model_kwargs`` (ComfyUI's MiniMaxH3Model
        arguments)."""
        return cls(
            hidden=model_kwargs["hidden_size"],
            layers=model_kwargs["num_layers"],
            heads=model_kwargs["num_attention_heads"],
            head_dim=model_kwargs["attention_head_dim"],
            ffn=model_kwargs["ffn_hidden_size"],
            t_dim=model_kwargs["time_embed_dim"],
            rope_pairs=3 * model_kwargs["rope_inv_freq_len"],
            eps=eps,
        )


def compute_dtype(weights: str, device_type: str) -> torch.dtype:
    """The dtype ComfyUI computes a checkpoint of format ``weights`` in on a ``device_type`` device:
    fp32 on a CPU, where it casts bf16 and int8 checkpoints' weights per layer
    (docs/comfyui_facts.md, Casting), else the model dtype.  The ranks compute in the residual
    stream's dtype and cast each weight to it as ComfyUI's ops do."""
    if weights not in WEIGHT_KINDS:
        raise ValueError(f"weights={weights!r}; use one of {', '.join(WEIGHT_KINDS)}")
    if device_type == "cpu" or weights == "fp32":
        return torch.float32
    return torch.bfloat16


def _is_norm(name: str) -> bool:
    return name.endswith(("norm1.weight", "norm2.weight", "_norm.weight"))


def quantize_rowwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 ``[N, K]`` and fp32 ``[N, 1]`` scale of a weight, as H3's int8 checkpoints hold it: the
    stored (bf16) weight upcast to fp32, scale = row absmax / 127, round to nearest (kitchen's
    per-row quantizer, equal to ``TensorWiseINT8Layout.quantize(per_channel=True)``)."""
    return ck.quantize_int8_rowwise(weight.float())


class ReferenceDiT:
    """Seeded H3 DiT block stack.

    Block i's weights come from their own ``torch.Generator(seed * 1_000_003 + i)`` walking the
    block's parameters in sorted-name order: fp32 draws of ``0.02*N(0,1)`` (``1 + 0.02*N(0,1)`` for
    norm weights), cast to the stored dtype.  ``int8`` stores the bf16 weights of the four block
    linears quantized per row.  So any block can be made on its own, and the same seed gives the
    same weights whatever the order of requests.
    """

    def __init__(
        self, config: DiTConfig, weights: str, seed: int, *, device: torch.device | str = "cpu"
    ) -> None:
        if weights not in WEIGHT_KINDS:
            raise ValueError(f"weights={weights!r}; use one of {', '.join(WEIGHT_KINDS)}")
        # the reference runs standalone only (CLI, tests), with the kernels the pack's workers use
        # there
        dit_ops.apply_kitchen_policy()
        self.config = config
        self.weights = weights
        self.seed = int(seed)
        self.device = torch.device(device)
        self._loaded: dict[int, dict[str, torch.Tensor]] | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The model dtype: the stored dtype of the float tensors (the int8 format's non-quantized
        ones)."""
        return torch.float32 if self.weights == "fp32" else torch.bfloat16

    @property
    def compute_dtype(self) -> torch.dtype:
        """The residual stream's and activations' dtype on the model's device:
        :func:`compute_dtype`."""
        return compute_dtype(self.weights, self.device.type)

    def _generate_block(self, i: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        out: dict[str, torch.Tensor] = {}
        for name, shape in sorted(self.config.block_shapes().items()):
            w = INIT_STD * torch.randn(shape, generator=gen, dtype=torch.float32)
            if _is_norm(name):
                w = 1.0 + w
            out[name] = w.to(self.dtype)
        if self.weights == "int8":
            for lin in dit_ops.INT8_LINEARS:
                q, s = quantize_rowwise(out[f"{lin}.weight"])
                out[f"{lin}.weight"], out[f"{lin}.weight_scale"] = q, s
        return out

    def block_weights(self, i: int) -> dict[str, torch.Tensor]:
        """Weights of block ``i`` by in-block name (``norm1.weight``, ...), on the model's
        device."""
        if not 0 <= i < self.config.layers:
            raise IndexError(f"block {i} does not exist; the model has {self.config.layers} blocks")
        block = self._loaded[i] if self._loaded is not None else self._generate_block(i)
        return {k: v.to(self.device) for k, v in block.items()}

    def materialize(self) -> ReferenceDiT:
        """Generate every block once (or move loaded weights) onto the model's device; returns
        ``self``.

        :meth:`block_weights` then is a lookup, with no seeded draw or host->device copy, so
        benchmarks time the blocks rather than the weight generator; the values are the same.
        """
        if self._loaded is None:
            self._loaded = {i: self._generate_block(i) for i in range(self.config.layers)}
        self._loaded = {
            i: {k: v.to(self.device) for k, v in block.items()} for i, block in self._loaded.items()
        }
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All block weights as ``blocks.{i}.<name>`` (for small models: it materialises every
        block)."""
        return {
            f"blocks.{i}.{k}": v
            for i in range(self.config.layers)
            for k, v in self.block_weights(i).items()
        }

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Replace the seeded weights with ``blocks.{i}.<name>`` tensors (e.g. a golden file's
        ``state_dict``).

        ``.comfy_quant`` entries are kept (they carry ConvRot settings); every expected tensor must
        be present with its ComfyUI shape."""
        shapes = self.config.block_shapes()
        blocks: dict[int, dict[str, torch.Tensor]] = {i: {} for i in range(self.config.layers)}
        for key, value in sd.items():
            parts = key.split(".", 2)
            if len(parts) != 3 or parts[0] != "blocks" or not parts[1].isdigit():
                raise ValueError(
                    f"state dict key {key!r} is not a block parameter (blocks.<i>.<name>)"
                )
            i = int(parts[1])
            if i not in blocks:
                raise ValueError(
                    f"state dict has block {i} but the config has {self.config.layers} blocks"
                )
            blocks[i][parts[2]] = value
        for i, block in blocks.items():
            for name, shape in shapes.items():
                if name not in block:
                    raise ValueError(f"state dict lacks blocks.{i}.{name}")
                if tuple(block[name].shape) != shape:
                    raise ValueError(
                        f"blocks.{i}.{name} has shape {tuple(block[name].shape)}, config expects "
                        f"{shape}"
                    )
                if dit_ops.is_int8(block[name]) and f"{name}_scale" not in block:
                    raise ValueError(
                        f"blocks.{i}.{name} is int8 but blocks.{i}.{name}_scale is missing"
                    )
        self._loaded = blocks

    def modulation(self, t_emb: torch.Tensor) -> torch.Tensor:
        """Every block's raw adaLN output for the step's timestep rows ``t_emb`` [M, t_dim],
        ``[layers, M, 18·hidden]`` on the model's device (``dit_ops.adaln_rows``): what the owner of
        the model computes once per step and the ranks receive with it (the weight store holds no
        adaLN weights)."""
        t = t_emb.to(self.device)
        with torch.inference_mode():
            return torch.stack(
                [dit_ops.adaln_rows(self.block_weights(i), t) for i in range(self.config.layers)]
            )

    def forward_blocks(
        self,
        x: torch.Tensor,
        t_emb: torch.Tensor,
        segments: Sequence[ModSegment],
        rope_freqs: torch.Tensor,
        *,
        attention: str = "sdpa",
        on_block: Callable[[int], None] | None = None,
        sparse: UnsplitSparse | None = None,
        sigma: float | None = None,
        branch: str = "",
    ) -> torch.Tensor:
        """The unsplit block loop, as ComfyUI runs it (``x`` is updated in place and returned), with
        the modulation rows of :meth:`modulation`, the ones a split of this model gets.

        ``on_block(i)`` is called after block ``i`` (progress bars).  ``sparse``: sparse attention
        over every head with these settings and statistics, at ``sigma`` for conditioning ``branch``
        (what a split with the same settings must equal)."""
        c = self.config
        weights = CpuWeights(
            self.block_weights, c.layers, (0, c.heads), c.heads, c.head_dim, eager=False
        )
        step = (
            None
            if sparse is None
            else sparse.step(
                heads=c.heads,
                head_dim=c.head_dim,
                segments=segments,
                sigma=sigma,
                branch=branch,
                device=x.device,
                dtype=x.dtype,
            )
        )
        with torch.inference_mode():
            run_blocks(
                x,
                BlockInputs(self.modulation(t_emb), segments, rope_freqs),
                RankBlocks(
                    weights,
                    IdentityExchange(),
                    c.heads,
                    c.head_dim,
                    c.eps,
                    dit_ops.builtin_attend(attention),
                ),
                range(c.layers),
                LoopPaths(sparse=step),
                LoopHooks(after_block=on_block),
            )
        return x


def rope_inv_freq(n: int) -> torch.Tensor:
    """``1/10000**(arange(n)/n)`` in fp32 (the value the golden files assume for
    ``rope.inv_freq``)."""
    return 1.0 / (10000.0 ** (torch.arange(n) / n))


def rope_table(position_ids: torch.Tensor, rope_pairs: int, dtype: torch.dtype) -> torch.Tensor:
    """The rotation table the blocks consume, ``[1, S, 1, rope_pairs, 2, 2]`` of ``[[cos, -sin],
    [sin, cos]]``.

    As H3's ``rope_freqs``: positions to fp32, per-axis angles ``pos * inv_freq``, the three axes
    concatenated, cos and sin in fp32, then the table cast to ``dtype``."""
    if position_ids.dim() != 2 or position_ids.shape[1] != 3:
        raise ValueError(f"position_ids must be [S, 3] (t, h, w), got {tuple(position_ids.shape)}")
    if rope_pairs % 3:
        raise ValueError(f"rope_pairs={rope_pairs} must be a multiple of 3")
    n = rope_pairs // 3
    pos = position_ids.to(torch.float32)
    angles = (pos[:, :, None] * rope_inv_freq(n)).reshape(pos.shape[0], 3 * n)
    c, s = torch.cos(angles), torch.sin(angles)
    table = torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)
    return table[None, :, None].to(dtype)


@dataclass
class StepInputs:
    """What the block loop consumes in one denoising step."""

    x: torch.Tensor  # [S, H] residual stream, model dtype
    t_emb: torch.Tensor  # [M, t_dim], model dtype
    segments: list[ModSegment]  # mod segments (a, b, row)
    rope_freqs: torch.Tensor  # [1, S, 1, rope_pairs, 2, 2], model dtype


def make_step_inputs(
    config: DiTConfig, layout: Layout, seed: int, dtype: torch.dtype
) -> StepInputs:
    """Seeded inputs for one step on ``layout``: N(0,1) residual and t_emb rows, the layout's mod
    segments and the rope table of its positions."""
    gen = torch.Generator().manual_seed(int(seed))
    x = torch.randn(layout.seq_len, config.hidden, generator=gen).to(dtype)
    t_emb = torch.randn(len(layout.t_values), config.t_dim, generator=gen).to(dtype)
    return StepInputs(
        x,
        t_emb,
        list(layout.mod_segments),
        rope_table(layout.position_ids, config.rope_pairs, dtype),
    )


class _Lockstep:
    """The meeting point of :class:`SimulatedSplit`'s rank threads: a barrier, and a baton so that
    one rank computes at a time (the numbers are then those of one thread running the ranks in turn,
    whatever the core count)."""

    def __init__(self, ranks: int) -> None:
        self.barrier = threading.Barrier(ranks, timeout=SIMULATED_WAIT_S)
        self._baton = threading.Lock()
        self._mine = threading.local()

    def take(self) -> None:
        """Wait for this thread's turn to compute."""
        if not self._baton.acquire(timeout=SIMULATED_WAIT_S):
            raise TimeoutError(
                f"simulated split: no rank thread handed over in {SIMULATED_WAIT_S:.0f}s"
            )
        self._mine.held = True

    def give(self) -> None:
        """End this thread's turn (no-op when it does not hold the baton)."""
        if getattr(self._mine, "held", False):
            self._mine.held = False
            self._baton.release()

    def meet(self) -> None:
        """Hand the baton over until every rank has reached this point, then take it back."""
        self.give()
        try:
            self.barrier.wait()
        finally:
            self.take()


class SimulatedSplit:
    """R ranks of the split run in one process, each a thread running the rank's block loop
    (``workers.dit.loop``) on its own weights view, with the real slicing; the exchanges go through
    shared buffers (``workers.transports.local``).  The result is each rank's rows concatenated.
    """

    def __init__(self, model: ReferenceDiT, head_bounds: Sequence[int]) -> None:
        c = model.config
        if (
            len(head_bounds) < 2
            or head_bounds[0] != 0
            or head_bounds[-1] != c.heads
            or any(b <= a for a, b in itertools.pairwise(head_bounds))
        ):
            raise ValueError(
                f"head_bounds {list(head_bounds)} must rise strictly from 0 to {c.heads}"
            )
        self.model = model
        self.head_bounds = list(head_bounds)
        self.ranks = len(head_bounds) - 1
        blocks = [model.block_weights(i) for i in range(c.layers)]
        self._weights = [
            CpuWeights(blocks.__getitem__, c.layers, (g0, g1), c.heads, c.head_dim, eager=True)
            for g0, g1 in itertools.pairwise(head_bounds)
        ]

    def forward_blocks(
        self,
        x: torch.Tensor,
        t_emb: torch.Tensor,
        segments: Sequence[ModSegment],
        rope_freqs: torch.Tensor,
        token_bounds: Sequence[int],
    ) -> torch.Tensor:
        """Run all blocks split over the ranks, every rank with the model's modulation rows
        (:meth:`ReferenceDiT.modulation`); returns a new ``[S, H]`` tensor (``x`` is not
        modified)."""
        c = self.model.config
        mod = self.model.modulation(t_emb)
        seq = x.shape[0]
        if len(token_bounds) != self.ranks + 1 or token_bounds[0] != 0 or token_bounds[-1] != seq:
            raise ValueError(
                f"token_bounds {list(token_bounds)} must have {self.ranks + 1} entries from 0 to "
                f"{seq}"
            )
        shards = [
            Shard(t0, t1, g0, g1)
            for (t0, t1), (g0, g1) in zip(
                itertools.pairwise(token_bounds), itertools.pairwise(self.head_bounds)
            )
        ]
        layout = ArenaLayout.plan(
            self.ranks,
            list(token_bounds),
            [g * c.head_dim for g in self.head_bounds],
            c.hidden,
            x.dtype,
        )
        lockstep = _Lockstep(self.ranks)
        arena = LocalArena(layout, x.device, lockstep.meet)
        rows = [x[s.tokens].clone() for s in shards]
        errors: list[BaseException] = []

        def rank(r: int) -> None:
            s = shards[r]
            ex = LocalExchange(r, arena)
            try:
                lockstep.take()
                with torch.inference_mode():
                    run_blocks(
                        rows[r],
                        BlockInputs(mod, dit_ops.clip_segments(segments, s.t0, s.t1), rope_freqs),
                        RankBlocks(self._weights[r], ex, s.n_heads, c.head_dim, c.eps),
                        range(c.layers),
                    )
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread below
                errors.append(exc)
                lockstep.barrier.abort()  # the other ranks stop waiting for this one
            finally:
                lockstep.give()

        threads = [
            threading.Thread(target=rank, args=(r,), name=f"simulated-rank-{r}")
            for r in range(self.ranks)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:  # the first cause, not the others' broken barrier
            raise next(
                (e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0]
            )
        return torch.cat(rows)
