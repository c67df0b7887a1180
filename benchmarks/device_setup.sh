#!/usr/bin/env bash
# Source this on the GPU device machine (no internet) before a run that needs real ComfyUI:
#   carry [".whl", ".carry"]: the wheels ComfyUI needs that the image lacks (msgspec among them: the wire protocol
#   decodes with it; a cp312 manylinux wheel), .carry/comfy_kitchen.tar.xz (comfy-kitchen's CUDA build,
#   benchmarks/fetch_kitchen.sh, packed: unpacked it would take the working tree past the 64 MiB carry limit) and
#   .carry/ComfyUI-*.tar.xz (+ .carry/shims: a PyAV placeholder, PyAV is too big).
# It installs the wheels into /tmp/site, unpacks comfy-kitchen into .ck/ and puts it on PYTHONPATH, points the test
# harness at the ComfyUI archive (unpacked into .comfyui/ by the tests) and at the shims (appended last to sys.path,
# as on CPU).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || return 1
[ -d .ck ] || tar -xJf .carry/comfy_kitchen.tar.xz || return 1
export PYTHONPATH="/tmp/site:$PWD/.ck:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export H3MS_COMFY_ARCHIVE="$(ls "$PWD"/.carry/ComfyUI-*.tar.xz | head -n 1)" H3MS_EXTRA_SHIMS="$PWD/.carry/shims"
