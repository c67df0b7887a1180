"""``python -m h3ms_async``: the standalone entry point (see h3ms_async.tools.cli)."""
from h3ms_async.tools.cli import main

raise SystemExit(main())
