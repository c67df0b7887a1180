"""The status document (what ``GET /h3multistream/status`` answers) as typed structs.

Sections other modules own (plans, workers, weight store, caches, hooks, ...) come from providers
registered on the hub; each is converted to its type here (:func:`validate_section`, msgspec does
the checking) when it comes in, so a provider that returns a malformed section shows ``{"error":
...}`` in that section instead of breaking the route. :class:`Status` is the whole document's shape,
what a consumer checks it against (``msgspec.convert(doc, Status)``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, UnsetType

from h3ms_async import PACK_ROOT
from h3ms_async.runtime.host_memory import RamInfo

SECTIONS = (
    "plans",
    "workers",
    "weight_store",
    "caches",
    "hooks",
    "vae_workers",
    "vae_split",
    "text_encoder_outputs",
)
#: Sections present only while a module provides them: "attention" (H3 Attention Parallel).
OPTIONAL_SECTIONS = ("attention",)

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
Text = Annotated[str, msgspec.Meta(min_length=1)]
Rows = list[dict[str, Any]]
Object = dict[str, Any]


class SchemaError(ValueError):
    """A record or status section does not match its type; the message names the field and the
    fix."""


class WorkerRow(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One rank worker as a pool reports it (``workers``, ``vae_workers``, an attention engine's
    ``helpers``); ``state`` e.g. "ready", "busy", "exited(1)". Optional fields are left out when
    unset."""

    rank: NonNegInt
    device: Text
    pid: Annotated[int, msgspec.Meta(ge=1)] | None
    state: Text
    uptime_s: NonNegFloat | UnsetType | None = UNSET
    rss_bytes: NonNegInt | UnsetType | None = UNSET
    vram_bytes: NonNegInt | UnsetType | None = UNSET
    jobs_done: NonNegInt | UnsetType = UNSET
    log: Text | UnsetType | None = UNSET
    error: str | UnsetType = UNSET


class AttentionEngine(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One H3 Attention Parallel engine: its devices and helper workers, the tuned head splits
    (``splits``) and its recent calls with per-device transport and timings."""

    devices: list[str]
    helpers: list[WorkerRow]
    calls: NonNegInt
    recent_calls: Rows
    shares: list[float] | UnsetType | None = UNSET
    transport: str | UnsetType = UNSET
    running: bool | UnsetType = UNSET
    splits: Rows | UnsetType = UNSET


class AttentionSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``attention`` section: every live H3 Attention Parallel engine."""

    engines: list[AttentionEngine]


class SectionError(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a section shows when its provider raised or answered with the wrong shape."""

    error: str


#: Each provider-filled section's type: ``plans``, ``weight_store``, ``vae_split`` and
#: ``text_encoder_outputs`` are objects, ``caches`` and ``hooks`` lists of objects.
SECTION_TYPES: dict[str, Any] = {
    "plans": Object,
    "workers": list[WorkerRow],
    "weight_store": Object,
    "caches": Rows,
    "hooks": Rows,
    "vae_workers": list[WorkerRow],
    "vae_split": Object,
    "text_encoder_outputs": Object,
    "attention": AttentionSection,
}


class Status(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """The status document. An object section that failed holds ``{"error": ...}`` (an object too),
    a list section a :class:`SectionError`; ``attention`` is present only while H3 Attention
    Parallel provides it (checked as :class:`AttentionSection` when it comes in)."""

    version: str
    running: bool
    last_step: Object  # a StepRecord's JSON form, or {} before the first step
    steps_recorded: NonNegInt
    ram: RamInfo
    plans: Object
    workers: list[WorkerRow] | SectionError
    weight_store: Object
    caches: Rows | SectionError
    hooks: Rows | SectionError
    vae_workers: list[WorkerRow] | SectionError
    vae_split: Object
    text_encoder_outputs: Object
    exactness: dict[str, Rows]
    attention: Any = UNSET


def validate_section(section: str, value: Any) -> Any:
    """One provider-filled section converted to its type (:data:`SECTION_TYPES`) and back to its
    JSON form; an ``{"error": str}`` section passes as it is. Raises :class:`SchemaError` naming the
    section and the field (an unknown section, a wrong shape, a value JSON cannot carry)."""
    if section not in SECTION_TYPES:
        raise SchemaError(
            f"status: unknown section {section!r}; known sections: "
            f"{', '.join(SECTIONS + OPTIONAL_SECTIONS)}"
        )
    try:
        msgspec.convert(value, SectionError)
        return value
    except msgspec.ValidationError:
        pass
    try:
        typed = msgspec.convert(value, SECTION_TYPES[section])
    except msgspec.ValidationError as exc:
        raise SchemaError(f"status section {section!r}: {exc}") from None
    try:
        out = msgspec.to_builtins(typed)
        json.dumps(out, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise SchemaError(
            f"status section {section!r} is not JSON-serialisable ({exc}); return plain "
            "dicts/lists/str/numbers"
        ) from None
    return out


def pack_version() -> str:
    """The pack's version: its pyproject's, else the installed distribution's, else "unknown"."""
    try:
        import tomllib

        data = tomllib.loads((PACK_ROOT / "pyproject.toml").read_text())
        return str(data["project"]["version"])
    except Exception:  # noqa: BLE001 - an installed wheel has no pyproject beside it
        pass
    try:
        from importlib.metadata import version

        return version("comfyui-h3-multistream-async")
    except Exception:  # noqa: BLE001
        return "unknown"
