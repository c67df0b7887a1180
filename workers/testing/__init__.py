"""Test-only code of the workers: request kinds that sleep, crash or hang on request, kitchen's INT8
attention and chunked sparse attention on the CPU, the GPU-direct exchange's buffers on CPU
ranks, and faults injected into the DiT and VAE paths.  A worker loads it
(:func:`workers.testing.hooks.load`), and the exchange probe its ``ipc_cpu``, only with
``H3MS_TEST_HOOKS=1``; production processes never import it.  This marker imports none of its
modules: each of them imports the package first, so the package importing one back would be a
cycle."""
