"""The DiT split's rank program: block ops, messages, the rank executor and its CUDA side."""
