"""The worker side: what a rank process runs (map: docs/architecture.md).

A rank program is a package ``workers.<name>`` with a ``rank`` module (``python -m workers --program
<name>``). ``extend_path`` lets a program live outside this folder too: a ``workers/<name>/``
directory in another ``PYTHONPATH`` entry joins this package (this folder's modules still come
first).
"""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
