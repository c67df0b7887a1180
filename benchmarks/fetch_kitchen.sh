#!/usr/bin/env bash
# Prepare .ck/: comfy-kitchen for the GPU device machine (Python 3.12, no internet there), small enough to carry.
# The cp312 wheel is 64.7 MiB, over the 64 MiB carry limit; unpacked without its ROCm library it is ~41 MiB
# (the unpacked package minus backends/hip).  Then: device run with carry [".ck"] and `bash benchmarks/device_run.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-0.2.40}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$tmp" "comfy-kitchen==$version"
rm -rf .ck && mkdir .ck
python3 -m zipfile -e "$tmp"/comfy_kitchen-*.whl .ck
rm -f .ck/comfy_kitchen/backends/hip/_C*.so
du -sh .ck
