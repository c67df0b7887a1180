"""Requests to a pool's workers: one to one rank (its answer, or a :class:`WorkerError` naming the
worker and quoting its log; a worker that dies or misses the deadline is marked dead), and one to
every rank, failing fast: the first failure aborts the other ranks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from h3ms_async.runtime.channel import ChannelClosed, RemoteError
from h3ms_async.runtime.worker_handle import WorkerHandle, WorkerState, WorkerTimeout
from workers.runtime import protocol

#: How long a request whose channel closed waits for its worker's exit, so the error can name the
#: exit status.
EXIT_REPORT_WAIT_S = 1.0


async def request_one(
    w: WorkerHandle, msg: protocol.Request, timeout: float, program: str | None
) -> protocol.Answer:
    """Send ``msg`` to ``w`` (a worker of rank program ``program``) and return its answer."""
    kind = msg.kind
    if w.state != WorkerState.READY or w.channel is None:
        raise w.error(
            f"cannot take {kind!r}: it is {w.state}" + (f" ({w.death})" if w.death else "")
        )
    if kind not in w.serves:
        raise ValueError(
            f"pool {w.pool!r} (rank program {program or 'none'}) does not serve "
            f"{kind!r}; it serves {', '.join(sorted(w.serves))}: send it to its own program's "
            "pool"
        )
    w.inflight += 1
    try:
        result = await w.channel.request(msg, timeout)
    except RemoteError as exc:
        raise w.error(f"failed {kind!r}: {exc.error}", tb=exc.tb) from None
    except ChannelClosed as exc:
        # The exit usually follows the EOF within milliseconds: wait for it, so the message
        # names the status.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(w.exited.wait(), EXIT_REPORT_WAIT_S)
        w.mark_dead(f"channel closed ({exc})")
        raise w.error(f"died during {kind!r}: {w.death}") from None
    except TimeoutError:
        w.mark_dead(f"no answer to {kind!r} within {timeout:g} s; killed it")
        raise w.error(f"did not answer {kind!r} within {timeout:g} s", cls=WorkerTimeout) from None
    finally:
        w.inflight -= 1
    w.jobs_done += 1
    return result


async def request_all(
    workers: Sequence[WorkerHandle],
    per_rank: Sequence[protocol.Request | None],
    timeout: float,
    program: str | None,
    abort: Callable[[], None],
) -> list[Any]:
    """Send ``per_rank[r]`` to ``workers[r]`` (None: nothing to that rank, whose answer is None);
    return the answers in rank order.  The first error or death calls ``abort`` (the other ranks
    stop their exchange) and is raised; cancellation aborts too."""
    first_failure = True

    async def one_rank(w: WorkerHandle, msg: protocol.Request | None) -> Any:
        nonlocal first_failure
        if msg is None:
            return None
        try:
            return await request_one(w, msg, timeout, program)
        except Exception:
            if first_failure:  # the other ranks stop at once (their errors need no abort)
                first_failure = False
                abort()
            raise

    def not_dead(error: Exception) -> bool:
        rank = getattr(error, "rank", None)
        return rank is None or workers[rank].state is not WorkerState.DEAD

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one_rank(w, m)) for w, m in zip(workers, per_rank)]
    except ExceptionGroup as failed:
        # In failure order; a dead worker is the cause (another rank's error may be its abort).
        errors = sorted(failed.exceptions, key=not_dead)
        raise errors[0] from None
    except asyncio.CancelledError:
        abort()
        raise
    return [t.result() for t in tasks]
