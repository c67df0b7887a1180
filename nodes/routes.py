"""Wire the core's status hub and HTTP routes into ComfyUI's PromptServer (``docs/comfyui_facts.md``
§9).

Routes go on ``PromptServer.instance.routes`` (ComfyUI adds that table to its app after loading
custom nodes); "busy" is ComfyUI's prompt queue having a running item; each step record is pushed to
the frontend over ComfyUI's websocket as ``h3multistream.step``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from h3ms_async.log import get_logger
from h3ms_async.observability.routes import (
    action_clear_text_cache,
    action_clear_weights,
    action_release_workers,
    add_routes,
)
from h3ms_async.status.hub import get_hub

from . import method_hooks
from .model_wrapper import live_states
from .release_node import action_detach_hooks

log = get_logger("Routes")

STEP_EVENT = "h3multistream.step"
_undo: dict[int, Callable[[], None]] = {}


def queue_busy(server: Any) -> bool:
    """True while ComfyUI runs a prompt (``prompt_queue.get_current_queue()`` answers ``(running,
    queued)``)."""
    running, _queued = server.prompt_queue.get_current_queue()
    return len(running) > 0


def register(server: Any) -> bool:
    """Register routes, busy probe, release actions, the hooks section and the step push on
    ``server``, once per server object; returns True when it registered now."""
    if id(server) in _undo:
        return False
    hub = get_hub()
    hub.set_busy_probe(lambda: queue_busy(server))
    hub.register_action("release_workers", action_release_workers)
    hub.register_action("clear_weights", action_clear_weights)
    hub.register_action("detach_hooks", action_detach_hooks)
    hub.register_action("clear_text_cache", action_clear_text_cache)
    hooks = lambda: [s.describe() for s in live_states()] + method_hooks.installed()  # noqa: E731
    hub.register_provider("hooks", hooks)
    remove_listener = hub.add_listener(lambda rec: server.send_sync(STEP_EVENT, rec))
    add_routes(server.routes, hub=hub)

    def undo() -> None:
        remove_listener()
        hub.unregister_provider("hooks", hooks)
        hub.set_busy_probe(None)

    _undo[id(server)] = undo
    log.debug("routes registered on ComfyUI's PromptServer")
    return True


def unregister(server: Any) -> None:
    """Undo :func:`register` for ``server`` (its route table keeps the routes: aiohttp tables cannot
    drop them)."""
    undo = _undo.pop(id(server), None)
    if undo is not None:
        undo()
