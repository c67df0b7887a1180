#!/usr/bin/env bash
# One call on the GPU device machine: CUDA tests, then the GPU benchmark; everything it measures lands in $OUT.
#   bash benchmarks/device_run.sh TARGET [extra bench args...]
#   TARGET: tests|bench|all|attention|vae|vae-tests|vae-bench|vae-exact|invariance|invariance-demo|caches|sparse|demo-gpu|
#           paths|paths-more|gpus
#   paths (~10 min): what the landing's CPU-only changes need on a GPU, each file under its own deadline (ComfyUI tree
#   needed): the split paths at full width from fresh workers (tests/test_cuda.py, the tests PATHS_K selects, by
#   default every split path, the gather-ahead cases, the GPU-direct exchange (host waits and CUDA IPC events)
#   against the unsplit step, the per-block timings from CUDA events and the resident blocks placed at the load),
#   every CUDA
#   exchange against the spec (tests/test_exchange_conformance.py -k "cuda or nccl", the GPU-direct cuda-ipc
#   included); a pass lets its paths into h3ms_async/dit/tested_paths.py's TESTED["cuda"]
#   paths-more (~7 min): the bf16 VAE split under DynamicVRAM (vae-exact), the sparse probe and verify
#   (tests/test_sparse_cuda.py), `bench gpu` with host staging and the GPU-direct exchange (host waits, CUDA IPC
#   events) side by side (--exchange host,cuda_ipc,cuda_ipc_events, one token count, 2 blocks)
#   demo-gpu: the demo on 2 logical ranks of cuda:0 at full H3 width (20000 tokens, 2 blocks, 3 steps), int8 then
#   bf16: its per-step table and summary must compare like with like (unsplit and split times of one order)
#   attention: H3 Attention Parallel's CUDA tests and `bench attention` over both transports (extra args go to the bench)
#   vae: vae-tests then vae-bench (over 600 s: one device call runs at most that, so call the halves one by one)
#   vae-tests: the VAE split and cache CUDA tests (first decode after start; DynamicVRAM; the int8 VAE split on
#   logical CUDA ranks); vae-bench: the split decode (full-size H3 VAE, fp16 and bf16, 2 and
#   4 logical ranks); vae-exact: only the bf16 checkpoint under DynamicVRAM (and without) through the VAE split and
#   the exactness probe catching a worker skewed on purpose (about 2 min). All need the ComfyUI tree
#   (tests/comfy_tree.py unpacks it from shared/) and its imports.
#   invariance: `bench invariance` (row/head invariance table of H3's shapes, the engine's decision per size, the
#   probe's cost at full width), then the split's CUDA probe/verify tests (tests/test_invariance_cuda.py)
#   invariance-demo: the issue's bf16 demo whose first rank gets ~10 rows: it must adjust and stay exact (or run
#   unsplit with one warning), then the same with --verify
#   caches: the weight and output caches through ComfyUI's own unload/load at H3's sizes (14.6 GB text encoder,
#   full-size video VAE) under DynamicVRAM, --disable-dynamic-vram, --lowvram and --novram (tests/test_caches_cuda.py:
#   hit vs miss, reload vs restore, bytes held), then `bench caches` (about 4 min).
#   sparse: sparse attention's CUDA tests (engine: split == unsplit sparse at 1-4 logical ranks, Sol-Attn and top-k,
#   pooled statistics over steps; real ComfyUI graph: 2 and 3 ranks == one GPU, needs the ComfyUI tree, else skipped)
#   then `bench sparse` (dense vs sparse per step at full width, 75794 tokens, unsplit and 2/4 logical ranks);
#   summary in $OUT/sparse.json (pytest counts + the bench summary), logs and JSON beside it. Deadlines: 220 s for the
#   tests, the rest of ~6 min (>= 130 s) for the bench; the bench rewrites bench_sparse.json after every variant, so
#   a cut run keeps its numbers.
#   gpus (~8 min, a machine with 2 or more GPUs): one rank per GPU with uneven shares (tests/test_cuda.py -k
#   across_gpus: host staging, the GPU-direct exchange peer to peer, NCCL, the Ulysses pattern and every overlap at
#   once, each torch.equal to the unsplit step from fresh workers; a pass of the cuda_ipc case is what lets
#   SplitPath.CUDA_IPC_P2P into TESTED["cuda"]), every CUDA exchange against the spec
#   (tests/test_exchange_conformance.py -k "nccl or cuda-ipc"), then the measured speed-up: `bench split` at full H3
#   width (75794 tokens, 4 int8 blocks) on 2 GPUs and on every GPU (8 at most) beside the unsplit step on cuda:0,
#   host staging x8, GPU-direct (where the GPUs reach each other), NCCL and the no-exchange baseline, without and
#   with every overlap (bench_split_gpus<N>.json).
# comfy-kitchen travels in .ck/: make it with benchmarks/fetch_kitchen.sh (the cp312 wheel without its ROCm library).
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"; shift || true
out="${OUT:-$PWD/.out}"; mkdir -p "$out"
export PYTHONPATH="$PWD/.ck:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# NVLink SHARP multicast stays off on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
  nvidia-smi; nvidia-smi topo -m
  python3 -c "import torch, comfy_kitchen as ck; print('torch', torch.__version__, 'cuda', torch.version.cuda); print({k: (v['available'], v['disabled']) for k, v in ck.list_backends().items()})"
} > "$out/machine.txt" 2>&1
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -p no:cacheprovider -s tests/test_cuda.py 2>&1 | tee "$out/pytest_cuda.log"
  rc=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 -m h3ms_async bench gpu --out "$out" "$@" 2>&1 | tee "$out/bench_gpu.log" || rc=1
fi
if [ "$what" = attention ]; then
  python3 -m pytest -q -p no:cacheprovider -s tests/test_attention_parallel_cuda.py 2>&1 | tee "$out/pytest_attention_cuda.log"
  rc=${PIPESTATUS[0]}
  python3 -m h3ms_async bench attention --out "$out/bench_attention.json" "$@" 2>&1 | tee "$out/bench_attention.log" || rc=1
  echo "attention: ${SECONDS} s wall (tests + bench)" | tee -a "$out/bench_attention.log"
fi
if [ "$what" = vae ] || [ "$what" = vae-tests ]; then
  python3 -m pytest -q -p no:cacheprovider -s -m cuda tests/test_vae_split_cuda.py \
    tests/test_vae_quant_comfy.py 2>&1 | tee "$out/pytest_vae_cuda.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ "$what" = caches ]; then
  python3 -m pytest -q -p no:cacheprovider -s -m cuda tests/test_caches_cuda.py 2>&1 | tee "$out/pytest_caches_cuda.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  python3 -m h3ms_async bench caches --out "$out" 2>&1 | tee "$out/bench_caches.log" || rc=1
  echo "caches: ${SECONDS} s wall" | tee -a "$out/bench_caches.log"
fi
if [ "$what" = vae-exact ]; then
  python3 -m pytest -q -p no:cacheprovider -s -m cuda \
    "tests/test_vae_split_cuda.py::test_bf16_checkpoint_splits_exactly_under_dynamic_vram_and_without" 2>&1 \
    | tee "$out/pytest_vae_exact.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  echo "vae-exact: ${SECONDS} s wall" | tee -a "$out/pytest_vae_exact.log"
fi
# paths / paths-more: each file under its own deadline, two device calls of under 10 minutes each
# PATHS_K picks the tests of tests/test_cuda.py one call runs
set_a=("tests/test_cuda.py|${PATHS_K:-split_paths or gather_ahead or gpu_direct or block_timings or placed_at_the_load}|450"
       "tests/test_exchange_conformance.py|cuda or nccl|120")
set_b=("tests/test_vae_split_cuda.py|bf16_checkpoint|150" "tests/test_sparse_cuda.py||110")
if [ "$what" = paths ] || [ "$what" = paths-more ]; then
  [ "$what" = paths ] && tests=("${set_a[@]}") || tests=("${set_b[@]}")
  for t in "${tests[@]}"; do
    IFS='|' read -r file kexpr limit <<< "$t"
    name=$(basename "$file" .py)
    # -v: each test's name and outcome as it ends, so a run its deadline cuts still says which passed
    timeout "$limit" python3 -m pytest -v -p no:cacheprovider -s "$file" ${kexpr:+-k "$kexpr"} \
      > "$out/pytest_paths_$name.log" 2>&1
    echo "$file ${kexpr:+-k '$kexpr'}: rc $? at ${SECONDS} s" | tee -a "$out/paths_summary.txt"
  done
fi
if [ "$what" = paths-more ]; then
  timeout 180 python3 -m h3ms_async bench gpu --exchange host,cuda_ipc,cuda_ipc_events --tokens 39975 --layers 2 \
    --weights int8 --ranks 2 --residency resident --overlap none --out "$out" > "$out/bench_gpu_exchange.log" 2>&1
  echo "bench gpu --exchange host,cuda_ipc,cuda_ipc_events: rc $? at ${SECONDS} s" | tee -a "$out/paths_summary.txt"
fi
if [ "$what" = paths ] || [ "$what" = paths-more ]; then
  grep -hE "passed|failed" "$out"/pytest_paths_*.log | tee -a "$out/paths_summary.txt"
fi
if [ "$what" = vae ] || [ "$what" = vae-bench ]; then
  root=$(python3 -c "import sys; sys.path.insert(0, 'tests'); import comfy_tree; print(comfy_tree.ensure_tree())")
  shims=$(python3 -c "import sys; sys.path.insert(0, 'tests'); import comfy_tree; print(' '.join('--extra-path ' + d for d in comfy_tree.shim_dirs()))")
  for dt in fp16 bf16; do
    # shellcheck disable=SC2086  # one --extra-path per shim folder
    python3 -m h3ms_async bench vae --comfy-root "$root" $shims --dtype "$dt" --ranks 2,4 \
      --out "$out" "$@" 2>&1 | tee "$out/bench_vae_$dt.log" || rc=1
  done
  echo "vae-bench: ${SECONDS} s wall" | tee -a "$out/bench_vae_bf16.log"
fi
if [ "$what" = demo-gpu ]; then
  for w in int8 bf16; do
    python3 -m h3ms_async demo --ranks cuda:0,cuda:0 --tokens 20000 --hidden 5376 --heads 56 --head-dim 128 \
      --layers 2 --steps 3 --weights "$w" "$@" 2>&1 | tee "$out/demo_gpu_$w.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
  echo "demo-gpu: ${SECONDS} s wall" | tee -a "$out/demo_gpu_bf16.log"
fi
if [ "$what" = invariance ]; then
  python3 -m h3ms_async bench invariance --out "$out/bench_invariance.json" "$@" > "$out/bench_invariance.log" 2>&1 \
    || rc=1
  tail -5 "$out/bench_invariance.log"
  python3 -m pytest -q -p no:cacheprovider -s tests/test_invariance_cuda.py 2>&1 | tee "$out/pytest_invariance_cuda.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  echo "invariance: ${SECONDS} s wall" | tee -a "$out/bench_invariance.log"
fi
if [ "$what" = invariance-demo ]; then
  for extra in "" "--verify"; do
    # shellcheck disable=SC2086  # --verify or nothing
    python3 -m h3ms_async demo --ranks cuda:0,cuda:0 --shares 1,2000 --tokens 20000 --hidden 5376 --heads 56 \
      --head-dim 128 --layers 2 --weights bf16 --steps 2 $extra "$@" 2>&1 | tee -a "$out/invariance_demo.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
  echo "invariance-demo: ${SECONDS} s wall" | tee -a "$out/invariance_demo.log"
fi
if [ "$what" = sparse ]; then
  OUT="$out" timeout 220 python3 -m pytest -q -p no:cacheprovider -s -rs tests/test_sparse_cuda.py \
    tests/test_sparse_cuda_comfy.py 2>&1 | tee "$out/pytest_sparse_cuda.log"
  trc=${PIPESTATUS[0]}
  [ "$trc" = 0 ] || rc=1
  left=$((345 - SECONDS)); [ "$left" -ge 130 ] || left=130  # the bench gets what the tests left of ~6 min
  timeout "$left" python3 -m h3ms_async bench sparse --out "$out" "$@" \
    > "$out/bench_sparse.stdout" 2> "$out/bench_sparse.log"
  brc=$?
  [ "$brc" = 0 ] || rc=1
  TRC=$trc BRC=$brc WALL=$SECONDS OUTDIR="$out" python3 - <<'PY' > "$out/sparse.json"
import json, os, re
out = os.environ["OUTDIR"]
log = open(os.path.join(out, "pytest_sparse_cuda.log"), errors="replace").read()
summary = next((ln for ln in reversed(log.splitlines()) if re.search(r"\d+ (passed|failed|error)", ln)), "")
counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
bench = {}
try:
    bench = json.load(open(os.path.join(out, "bench_sparse.json")))
except (OSError, ValueError) as exc:
    bench = {"error": f"no bench_sparse.json: {exc}"}
print(json.dumps({"tests_rc": int(os.environ["TRC"]), "tests": counts, "bench_rc": int(os.environ["BRC"]),
                  "bench_summary": bench.get("summary"), "bench_errors": bench.get("errors") or bench.get("error"),
                  "wall_s": int(os.environ["WALL"])}, indent=1))
PY
  cat "$out/sparse.json"
fi
if [ "$what" = gpus ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -s -rs -m cuda tests/test_cuda.py -k across_gpus 2>&1 \
    | tee "$out/pytest_gpus.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_exchange_conformance.py -k "nccl or cuda-ipc" \
    2>&1 | tee "$out/pytest_conformance_gpus.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  count=$(python3 -c "import torch; print(min(torch.cuda.device_count(), 8))")
  for n in $(printf '%s\n' 2 "$count" | sort -nu); do
    [ "$n" -ge 2 ] || continue
    # the GPU-direct exchange only where every pair of these GPUs reaches the other's memory
    read -r ranks exchanges < <(python3 -c "
from h3ms_async.dit.exchange_choice import no_peer_access
ranks = [f'cuda:{i}' for i in range($n)]
print(','.join(ranks), 'host,nccl,none' if no_peer_access(ranks) else 'host,cuda_ipc,nccl,none')")
    timeout 240 python3 -m h3ms_async bench split --ranks "$ranks" --device cuda:0 --tokens 75794 --layers 4 \
      --hidden 5376 --heads 56 --head-dim 128 --weights int8 --exchange "$exchanges" --chunks 8 \
      --overlap none,gather+pieces4+ahead4 --steps 2 --warmup 1 --probe-rounds 0 \
      > "$out/bench_split_gpus$n.json" 2> "$out/bench_split_gpus$n.log" || rc=1
  done
  echo "gpus: ${SECONDS} s wall" | tee -a "$out/pytest_gpus.log"
fi
exit $rc
