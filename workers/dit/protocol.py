"""The messages of the transformer split: typed requests (``workers.runtime.protocol.Request``), checked by the
one decoder of ``workers.runtime.protocol``.

Both sides import this module: the coordinator (``h3ms_async.dit.split``) to send, the worker (``workers.dit.rank``) to
serve.  Field meanings:

``dit_load``    map the shared-memory weight store and prepare this rank's weights.
    store       name of the weight-store segment
    manifest    list, one map per block: parameter name (as inside a ComfyUI block) -> tensor descriptor
    config      {hidden, heads, head_dim, eps, layers, devices, attention, compute_dtype}; attention is "sdpa",
                "ck_int8" or "comfy" (the parent ComfyUI's selected function, ``workers.runtime.comfy_host``); the rank
                warms that attention up in compute_dtype before its first step
    heads       [g0, g1]: this rank's head group
    key         the store's key as text (logged, and a load with the same key is a no-op)

``dit_step``    run every block on this rank's token range, exchanging with the other ranks.
    job         step number (logs)
    x           descriptor of the residual stream [S, H]; rank r reads and finally writes rows [t0, t1)
    t_emb       descriptor [M, T] (in a small side segment with the per-token rows: M changes between steps, the
                step segment and the arena stay);  rope: descriptor [1, S, 1, P, 2, 2]
    segments    list of [a, b, row]; row is an int or a descriptor of an int64 [b - a] per-token row index
    tokens      [t0, t1]
    arena       exchange arena segment name ("" for exchange "dist"); layout: ArenaLayout.to_dict()
    exchange    "host" | "dist" | "none";  chunks: pipelined chunks per exchange (0/1 = single shot).
                "none" is the benchmark baseline: each rank computes its shard with no exchange at all (the other
                ranks' rows are zeros), which measures what the ranks' compute costs on their own, e.g. two CUDA
                contexts time-slicing one GPU.  Its output is wrong by design and never returned to a caller.
    abort_gen   the pool's abort generation when the step was submitted
    deadline_s  per-exchange deadline
    blocks      [b0, b1): the blocks to run (normally all)
    residency   "auto" | "resident" | "stream": where block weights live on a CUDA rank (CPU ranks read shm);
                a change between steps re-places the weights from the same store

    trace       digest every op's output rows per block (``workers.dit.invariance.digest``) and answer them
                (the ``verify`` setting's localisation of a difference); off for normal steps

``dit_probe``   measure on this rank's device whether its shards give the unsplit call's bits
                (``workers.dit.invariance``): each linear of ``ops`` over ``tokens`` rows against each of
                ``candidates`` (this rank's token range in each candidate plan), the qkv projection and attention
                for its head group ``heads``; random data of the real shapes, in the loaded compute dtype, with the
                loaded attention function.  Answers the rank's fingerprint and one verdict per op.

``dit_release`` drop this rank's weights, exchange objects and process group.
"""
from __future__ import annotations

from typing import ClassVar, Literal, Optional, Union, get_args

import msgspec

from workers.runtime.protocol import Plain, Request, TensorDesc

#: Exchange transports a step may name.
Exchange = Literal["host", "dist", "none"]
EXCHANGES: tuple[str, ...] = get_args(Exchange)
#: Weight residency choices of a CUDA rank.
Residency = Literal["auto", "resident", "stream"]
RESIDENCIES: tuple[str, ...] = get_args(Residency)


class DitLoad(Request, tag="dit_load"):
    store: str
    manifest: list[dict[str, TensorDesc]]
    config: Plain
    heads: tuple[int, int]
    key: str
    PLAIN: ClassVar[tuple[str, ...]] = ("config",)


class DitStep(Request, tag="dit_step"):
    job: int
    x: TensorDesc
    t_emb: TensorDesc
    rope: TensorDesc
    segments: list[tuple[int, int, Union[int, TensorDesc]]]
    tokens: tuple[int, int]
    arena: str
    layout: Plain
    exchange: Exchange
    chunks: int
    abort_gen: int
    deadline_s: float
    blocks: tuple[int, int]
    residency: Residency
    trace: bool = False
    PLAIN: ClassVar[tuple[str, ...]] = ("layout",)


#: How an op is split across the ranks: by token rows, by head (output columns), or not at all (same call everywhere).
Split = Literal["tokens", "heads", "none"]


class LinearOp(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One linear of the block as the ranks call it: its name, weight shape and storage, int8 settings.

    ``in_features`` is the weight's; ``mlp.fc2`` (``input_act="swiglu"``) sees twice that many input columns."""

    name: str
    out_features: int
    in_features: int
    weight_dtype: str
    scale_numel: int = 0
    bias: bool = False
    convrot: bool = False
    convrot_groupsize: int = 256
    input_act: Optional[str] = None
    split: Split = "tokens"


class DitProbe(Request, tag="dit_probe"):
    ops: list[LinearOp]
    tokens: int
    candidates: list[tuple[int, int]]
    heads: tuple[int, int]
    t_rows: int = 2


class DitRelease(Request, tag="dit_release"):
    pass
