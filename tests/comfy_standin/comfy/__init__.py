"""Stand-in for the ``comfy`` package (tests only; see ../README.md)."""
