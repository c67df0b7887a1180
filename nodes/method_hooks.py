"""Method hooks on ComfyUI model objects shared by every clone (the VAE's ``first_stage_model``, the
CLIP's ``cond_stage_model``), held through weak references (``docs/comfyui_facts.md`` §9).

A hook replaces one instance attribute (e.g. ``decode_temporal``) with a wrapper built around the
original bound method; the wrapper reads its live config from the hook, so running the node again
only updates the config, never wraps twice.  The registry keeps a weak reference to the object: a
strong one would keep a model (and its VRAM) alive after ComfyUI dropped it.  Removing a hook is
refused when something else has since replaced the attribute (restoring would drop that other
wrapper).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from h3ms_async.log import get_logger

log = get_logger("Hooks")


@dataclass
class Hook:
    """One installed hook; ``config`` is read by the wrapper on every call."""

    label: str
    attr: str
    ref: weakref.ref[Any]
    original: Any
    had_instance_attr: bool
    wrapper: Callable[..., Any]
    config: dict

    def describe(self) -> dict:
        obj = self.ref()
        model = (
            None
            if obj is None
            else obj.__qualname__
            if isinstance(obj, type)
            else type(obj).__name__
        )
        return {
            "hook": self.label,
            "model": model,
            "methods": [self.attr],
            "detached": False,
            "config": {
                k: v
                for k, v in self.config.items()
                if isinstance(v, (bool, int, float, str, type(None)))
            },
        }


_HOOKS: dict[tuple[int, str], Hook] = {}
_LOCK = threading.Lock()


def _live(obj: Any, attr: str) -> Hook | None:
    hook = _HOOKS.get((id(obj), attr))
    if hook is not None and hook.ref() is not obj:  # the id was reused by another object
        _HOOKS.pop((id(obj), attr), None)
        return None
    return hook


def install(
    obj: Any,
    attr: str,
    label: str,
    make_wrapper: Callable[[Any, dict], Callable[..., Any]],
    config: dict,
) -> bool:
    """Hook ``obj.attr`` with ``make_wrapper(original, config)``; when already hooked, replace only
    the config.

    Returns True when the hook was installed now.
    """
    with _LOCK:
        hook = _live(obj, attr)
        if hook is not None and obj.__dict__.get(attr) is hook.wrapper:
            hook.config.clear()
            hook.config.update(config)
            return False
        live_config = dict(config)
        original = getattr(obj, attr)
        wrapper = make_wrapper(original, live_config)
        had = attr in obj.__dict__
        setattr(obj, attr, wrapper)
        _HOOKS[(id(obj), attr)] = Hook(
            label, attr, weakref.ref(obj), original, had, wrapper, live_config
        )
    log.info("%s hook installed on %s.%s", label, type(obj).__name__, attr)
    return True


def _remove(key: tuple[int, str], hook: Hook) -> bool:
    obj = hook.ref()
    if obj is None:
        _HOOKS.pop(key, None)
        return False
    if obj.__dict__.get(hook.attr) is not hook.wrapper:
        log.error(
            "%s hook on %s.%s left in place: another wrapper was installed on top of it; restart "
            "ComfyUI to remove both",
            hook.label,
            type(obj).__name__,
            hook.attr,
        )
        return False
    if hook.had_instance_attr:
        setattr(obj, hook.attr, hook.original)
    else:
        delattr(obj, hook.attr)
    _HOOKS.pop(key, None)
    log.info("%s hook removed from %s.%s", hook.label, type(obj).__name__, hook.attr)
    return True


def uninstall(obj: Any, attr: str) -> bool:
    """Remove ``obj.attr``'s hook; returns whether one was removed."""
    with _LOCK:
        hook = _live(obj, attr)
        return hook is not None and _remove((id(obj), attr), hook)


def detach_all(labels: tuple[str, ...] | None = None) -> tuple[int, int]:
    """Remove every hook (or those with these labels); returns ``(detached, kept)``."""
    detached = kept = 0
    with _LOCK:
        for key, hook in list(_HOOKS.items()):
            if labels is not None and hook.label not in labels:
                continue
            if hook.ref() is None:
                _HOOKS.pop(key, None)
            elif _remove(key, hook):
                detached += 1
            else:
                kept += 1
    return detached, kept


def installed() -> list[dict]:
    """The live hooks, for the status route's ``hooks`` section."""
    with _LOCK:
        for key, hook in list(_HOOKS.items()):
            if hook.ref() is None:
                _HOOKS.pop(key, None)
        return [h.describe() for h in _HOOKS.values()]
