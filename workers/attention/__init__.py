"""H3 Attention Parallel's rank program: head-slice ops, messages, the helper."""
