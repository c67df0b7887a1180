"""H3 Attention Parallel's coordinator side: the engine and its schedule model."""
