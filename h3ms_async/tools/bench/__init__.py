"""Benchmarks; each prints JSON (results in docs/performance.md)."""
