#!/usr/bin/env bash
# The split inside real ComfyUI on one CUDA GPU, then its node-level cost; everything lands in $OUT.
# tests <= 8 min, cost <= 5 min: run them as separate device calls (a call may take 10 min at most).
#   source benchmarks/device_setup.sh && bash benchmarks/device_comfy.sh [tests|lora|cost|cold|all]  (carry .whl .carry)
#   lora: only the LoRA groups of tests/test_cuda_comfy.py (SDPA + DynamicVRAM, SDPA + --novram).
#   cold: benchmarks/comfy_cold_start.py, all 50 full-width int8 blocks (a ~46 GB checkpoint written to disk first):
#   plain ComfyUI's load + first step against the node's (workers' start, weight-store fill, ranks' load, probe), then
#   the node's second prompt (nothing refilled); a call of its own (fewer blocks: COLD_LAYERS=25; with a LoRA on
#   every block, the fill's slower path: COLD_ARGS=--lora). On an H100 host it took 310 s (352 s with the LoRA) on a
#   machine already used once; the first call on a fresh machine unpacks ComfyUI first and needed more than 290 s.
# 1. tests/test_cuda_comfy.py: ComfyUI started as main.py starts (DynamicVRAM on; once --disable-dynamic-vram),
#    ranks cuda:0,cuda:0 and cuda:0,cuda:0,cuda:0 (shares 1,2,1), bf16 and int8, SDPA and --use-ck-attention, a LoRA,
#    every output torch.equal to plain ComfyUI including each first call after the workers start.
# 2. benchmarks/comfy_node_cost.py: full-width H3 int8, 4 blocks, ~75k tokens, plain ComfyUI vs the node on 2 logical
#    ranks, and `python -m h3ms_async bench gpu` at the same token count.
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
out="${OUT:-$PWD/.out}"; mkdir -p "$out"; export OUT="$out"
{
  nvidia-smi
  python3 -c "import torch, comfy_kitchen as ck; print('torch', torch.__version__, 'cuda', torch.version.cuda); print({k: (v['available'], v['disabled']) for k, v in ck.list_backends().items()})"
} > "$out/machine.txt" 2>&1
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 480 python3 -m pytest -q -p no:cacheprovider -s -m cuda tests/test_cuda_comfy.py 2>&1 \
    | tee "$out/pytest_cuda_comfy.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
if [ "$what" = lora ]; then
  timeout 290 python3 -m pytest -q -p no:cacheprovider -s -m cuda tests/test_cuda_comfy.py \
    -k "sdpa-dynamic or sdpa-novram" 2>&1 | tee "$out/pytest_cuda_comfy_lora.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
if [ "$what" = cost ] || [ "$what" = all ]; then
  timeout 270 python3 benchmarks/comfy_node_cost.py --out "$out" 2>&1 | tee "$out/comfy_node_cost.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
if [ "$what" = cold ]; then
  # shellcheck disable=SC2086  # COLD_ARGS: extra options, split on spaces
  timeout 580 python3 benchmarks/comfy_cold_start.py --layers "${COLD_LAYERS:-50}" ${COLD_ARGS:-} --timeout 560 \
    --out "$out" 2>&1 \
    | tee "$out/comfy_cold_start.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
exit $rc
