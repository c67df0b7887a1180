"""What runs the library from the command line: the CLI, the demo and the benchmarks."""
