"""ComfyUI nodes of H3 MultiStream (async). Imported by the pack root, relative to the pack; see
../__init__.py."""
