#!/usr/bin/env bash
# Prepare everything a GPU device call carries (no internet there): .whl (the wheels ComfyUI and the pack need that
# the device image lacks, cp312 manylinux) and .carry (comfy-kitchen's CUDA build from benchmarks/fetch_kitchen.sh,
# packed; the ComfyUI archive; a PyAV placeholder: PyAV's wheel is too big to carry). Then: carry [".whl", ".carry"]
# and `source benchmarks/device_setup.sh` on the device.
set -euo pipefail
cd "$(dirname "$0")/.."
for d in /.ck/ /.whl/ /.carry/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
bash benchmarks/fetch_kitchen.sh
rm -rf .whl && mkdir .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl \
  msgspec torchsde trampoline alembic Mako SQLAlchemy greenlet simpleeval blake3 pydantic==2.14.4 \
  pydantic_core==2.50.5 annotated_types typing_inspection pydantic_settings python_dotenv comfy_aimdo==0.6.0
rm -rf .carry && mkdir -p .carry/shims/av
cp ../shared/comfyui/ComfyUI-*.tar.xz .carry/
cat > .carry/shims/av/__init__.py <<'PY'
"""Placeholder ``av`` (PyAV) for the GPU device machine: ComfyUI imports it at module level for video files only;
H3's sampling and decoding never use it. Every name resolves to a placeholder that raises when called."""
import importlib.abc
import importlib.machinery
import sys
import types


class _Missing:
    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: PyAV is not installed on this machine")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):
        return (object,)


def _getattr_of(modname):
    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{modname}.{attr}")
    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("av."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = _getattr_of(spec.name)
        return mod

    def exec_module(self, module):
        pass


__getattr__ = _getattr_of("av")
__path__ = []
sys.meta_path.append(_Finder())
PY
tar -cJf .carry/comfy_kitchen.tar.xz .ck
du -sh .whl .carry
