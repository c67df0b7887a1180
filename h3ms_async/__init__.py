"""H3 MultiStream (async), the core: never imports ComfyUI (map: docs/architecture.md)."""

from pathlib import Path

#: The pack's root folder (holds ``h3ms_async/``, ``workers/``, ``web/``): worker processes get it
#: on their path.
PACK_ROOT = Path(__file__).resolve().parent.parent
