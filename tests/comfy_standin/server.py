"""Stand-in for ComfyUI's ``server.PromptServer`` (node_surface_facts §1.0/§1.3): a class attribute ``instance``
(None until the server exists), an aiohttp ``RouteTableDef`` at ``instance.routes``, ``send_sync(event, data, sid)``
for websocket pushes, and ``prompt_queue.get_current_queue() -> (running, queued)``."""
from __future__ import annotations

import threading
from typing import Any

from aiohttp import web


class PromptQueue:
    def __init__(self) -> None:
        self.running: list[Any] = []
        self.queued: list[Any] = []

    def get_current_queue(self) -> tuple[list[Any], list[Any]]:
        return list(self.running), list(self.queued)


class PromptServer:
    instance: "PromptServer | None" = None

    def __init__(self) -> None:
        self.routes = web.RouteTableDef()
        self.prompt_queue = PromptQueue()
        self.sent: list[tuple[str, Any, Any]] = []
        self._lock = threading.Lock()
        PromptServer.instance = self

    def send_sync(self, event: str, data: Any, sid: Any = None) -> None:
        with self._lock:
            self.sent.append((event, data, sid))
