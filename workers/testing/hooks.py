"""What a worker started with ``H3MS_TEST_HOOKS=1`` loads (:func:`load`)."""

from __future__ import annotations


def load() -> None:
    """Serve the test request kinds; with ``H3MS_CK_ATTENTION_CPU=1``, kitchen's INT8 attention on
    the CPU, with ``H3MS_CK_SPARSE_CPU=1`` its chunked sparse attention. (The compute faults are
    taken at import by the modules they hook.)"""
    from workers.testing import handlers, settings  # noqa: F401 - handlers registers itself

    if settings.CK_ATTENTION_CPU.get():
        from workers.testing import ck_cpu

        ck_cpu.install()
    if settings.CK_SPARSE_CPU.get():
        from workers.testing import ck_sparse_cpu

        ck_sparse_cpu.install()
