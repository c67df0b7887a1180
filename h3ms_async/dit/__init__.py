"""The DiT split's coordinator side: packed layouts, the reference block stack, the step engine."""
