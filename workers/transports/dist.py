"""The exchange over ``torch.distributed``: gloo on CPU (tests, CI), NCCL on CUDA (NVLink machines).

The collectives of ``workers.transports.exchange`` on its rank plan (an ``ArenaLayout`` is used only
for its bounds here).  Gloo in torch 2.13 (checked) supports ``all_gather_into_tensor`` for equal
sizes and ``all_to_all_single`` with per-rank splits, so every op is one collective
(``all_gather_rows_each`` and ``all_to_all_heads`` the base's: the gather, or the whole columns).

Collectives are not chunked (``chunks`` is accepted for interface parity; NCCL pipelines
internally).  A collective cannot be interrupted: the abort word is checked between ops, and a stuck
collective ends with the group's timeout (or the pool killing the workers).
"""

from __future__ import annotations

import datetime
import logging
import os
import time

import torch
import torch.distributed as dist

from workers.dit.protocol import Transport
from workers.transports.arena import ArenaLayout
from workers.transports.exchange import JobExchange, packed_qkv

log = logging.getLogger("h3_multistream.worker")


def check_nccl_rank_map(devices: list[str]) -> None:
    """Refuse rank maps NCCL cannot run: every rank needs its own CUDA device (one communicator, one
    GPU per rank)."""
    seen: dict[tuple[str, int], list[int]] = {}
    for rank, name in enumerate(devices):
        dev = torch.device(name)
        if dev.type != "cuda":
            raise ValueError(
                f"exchange=nccl needs CUDA devices, rank {rank} is on {name!r} (rank map "
                f"{list(devices)}); use exchange=host"
            )
        seen.setdefault((dev.type, dev.index or 0), []).append(rank)
    shared = {f"cuda:{idx}": ranks for (_, idx), ranks in seen.items() if len(ranks) > 1}
    if shared:
        where = ", ".join(f"ranks {r} on {d}" for d, r in shared.items())
        raise ValueError(
            "exchange=nccl cannot put two ranks on one GPU (NCCL refuses duplicate devices in a "
            f"communicator): rank map {list(devices)} has {where}. Use exchange=host for this rank "
            "map, or give every rank its own GPU"
        )


def init_group(
    rank: int,
    world: int,
    backend: str,
    init_file: str,
    timeout_s: float,
    *,
    devices: list[str] | None = None,
    local_device: str | None = None,
) -> None:
    """Join the process group through a rendezvous file in the private run dir (``file://<init_file>``).

    ``devices`` is the whole rank map (as the coordinator names the GPUs, for the one-GPU-per-rank
    check); ``local_device`` is this rank's device as this process sees it (a worker with
    CUDA_VISIBLE_DEVICES narrowed to its own GPU sees it as ``cuda:0``); it defaults to
    ``devices[rank]``.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (CUDA), got {backend!r}")
    if not os.path.isabs(init_file):
        raise ValueError(f"init_file must be an absolute path in the run dir, got {init_file!r}")
    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed group is already initialised in this worker; call destroy_group() "
            "first"
        )
    if backend == "nccl":
        if devices is None or len(devices) != world:
            raise ValueError(
                f"backend='nccl' needs the rank map (one device per rank, {world}), got {devices!r}"
            )
        check_nccl_rank_map(devices)
        # NVLink SHARP multicast stays off on the machines we support (README: `NCCL_NVLS_ENABLE`);
        # an explicit setting from the environment wins
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(torch.device(local_device or devices[rank]))
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def destroy_group() -> None:
    """Leave the process group (no-op when none is initialised)."""
    if dist.is_initialized():
        dist.destroy_process_group()


class DistExchange(JobExchange):
    """The exchange over the default process group.

    ``control`` (optional int64 shm tensor, word 0 = abort generation) makes ``begin()`` and every
    op raise :class:`ExchangeAborted` once the pool has aborted the job.  ``stats()["wait_s"]`` is
    the time inside collectives.
    """

    def __init__(
        self, rank: int, world: int, layout: ArenaLayout, *, control: torch.Tensor | None = None
    ) -> None:
        if not dist.is_initialized() or dist.get_world_size() != world or dist.get_rank() != rank:
            raise RuntimeError(
                f"DistExchange(rank={rank}, world={world}) needs init_group() with the same "
                "rank/world"
            )
        self.transport = Transport(dist.get_backend()).value
        super().__init__(rank, world, layout, control)
        rows = [layout.rows(r) for r in range(world)]
        self._counts = [b - a for a, b in rows]

    def _all_gather_rows(self, local: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        """Equal shards go straight through ``all_gather_into_tensor``; uneven ones are padded to
        the largest shard and trimmed on the way out."""
        lay = self.layout
        width = lay.row_width
        biggest = max(self._counts)
        if self.world == 1:
            out.copy_(local)
            return out
        if all(c == biggest for c in self._counts):
            self._collective(dist.all_gather_into_tensor, out, local.contiguous())
        else:
            t = time.perf_counter()
            send = torch.zeros((biggest, width), dtype=local.dtype, device=local.device)
            send[: local.shape[0]].copy_(local)
            recv = torch.empty(
                (self.world * biggest, width), dtype=local.dtype, device=local.device
            )
            self._stats["copy_s"] += time.perf_counter() - t
            self._collective(dist.all_gather_into_tensor, recv, send)
            t = time.perf_counter()
            for r in range(self.world):
                a, b = lay.rows(r)
                out[a:b].copy_(recv[r * biggest : r * biggest + (b - a)])
            self._stats["copy_s"] += time.perf_counter() - t
        nb = local.element_size() * width
        self._stats["bytes_written"] += nb * biggest * (self.world - 1)
        self._stats["bytes_read"] += nb * biggest * (self.world - 1)
        return out

    def _all_to_all_cols(self, local: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        """Rank r's ``[S, c_r]`` input is row-major, so the rows for rank q are one contiguous run
        of ``n_q * c_r`` elements: one flat ``all_to_all_single`` with those splits, and rank p's
        ``[n_r, c_p]`` block lands at its columns."""
        lay = self.layout
        me = self.rank
        c0, c1 = lay.cols(me)
        mine = self._counts[me]
        if self.world == 1:
            out.copy_(local)
            return out
        widths = [b - a for a, b in (lay.cols(p) for p in range(self.world))]
        send = local.contiguous().view(-1)
        in_splits = [c * (c1 - c0) for c in self._counts]
        out_splits = [mine * w for w in widths]
        recv = self._all_to_all(send, in_splits, out_splits)
        t = time.perf_counter()
        off = 0
        for p, w in enumerate(widths):
            p0, p1 = lay.cols(p)
            out[:, p0:p1].copy_(recv[off : off + mine * w].view(mine, w))
            off += mine * w
        self._stats["copy_s"] += time.perf_counter() - t
        return out

    def _all_to_all_qkv(self, local: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        """One ``all_to_all_single`` of every rank's packed q, k and v columns."""
        lay = self.layout
        me = self.rank
        c0, c1 = lay.cols(me)
        if self.world == 1:
            out.copy_(packed_qkv(local, lay.qkv_cols(me)))
            return out
        send = torch.cat(
            [packed_qkv(local, lay.qkv_cols(p)).reshape(-1) for p in range(self.world)]
        )
        widths = [3 * (b - a) for a, b in (lay.cols(p) for p in range(self.world))]
        in_splits = [self._counts[me] * w for w in widths]
        out_splits = [c * 3 * (c1 - c0) for c in self._counts]
        recv = self._all_to_all(send, in_splits, out_splits)
        t = time.perf_counter()
        out.copy_(recv.view(lay.tokens, 3 * (c1 - c0)))
        self._stats["copy_s"] += time.perf_counter() - t
        return out

    def close(self) -> None:
        """Nothing to drop per object: the process group outlives it (``destroy_group`` ends
        that)."""

    def _all_to_all(
        self, send: torch.Tensor, in_splits: list[int], out_splits: list[int]
    ) -> torch.Tensor:
        """One ``all_to_all_single`` of the flat ``send`` (``in_splits`` elements to each rank, in
        rank order); returns what arrived (``out_splits`` from each) and counts the bytes that
        crossed."""
        recv = torch.empty(sum(out_splits), dtype=send.dtype, device=send.device)
        self._collective(dist.all_to_all_single, recv, send, out_splits, in_splits)
        esz, me = send.element_size(), self.rank
        self._stats["bytes_written"] += esz * (sum(in_splits) - in_splits[me])
        self._stats["bytes_read"] += esz * (sum(out_splits) - out_splits[me])
        return recv

    def _collective(self, fn, *args) -> None:
        t = time.perf_counter()
        fn(*args)
        self._stats["wait_s"] += time.perf_counter() - t
