# bf16 at 2 logical ranks, both patterns, then real ComfyUI on CUDA (tests/test_cuda_comfy.py)
source .carry/next/head.sh
timeout 120 python3 -m h3ms_async bench gpu --tokens 75794 --layers 2 --residency resident --steps 2 --weights bf16 \
  --ranks 2 --pattern ulysses --exchange host,cuda_ipc --overlap none,pieces8 \
  --out $R/bench_gpu_ulysses_bf16 > $R/bench_gpu_ulysses_bf16.log 2>&1
echo "bf16 ulysses rc=$? t=$SECONDS" >> $R/summary.txt
timeout 120 python3 -m h3ms_async bench gpu --tokens 75794 --layers 2 --residency resident --steps 2 --weights bf16 \
  --ranks 2 --pattern gather --exchange host,cuda_ipc --overlap none,gather+pieces8+ahead8 \
  --out $R/bench_gpu_gather_bf16 > $R/bench_gpu_gather_bf16.log 2>&1
echo "bf16 gather rc=$? t=$SECONDS" >> $R/summary.txt
OUT=$R timeout $((585-SECONDS)) python3 -m pytest -v -p no:cacheprovider -s -rs -m cuda tests/test_cuda_comfy.py \
  --durations=10 > $R/pytest_cuda_comfy.log 2>&1
echo "cuda_comfy rc=$? t=$SECONDS" >> $R/summary.txt
grep -hE "FAILED|passed|failed" $R/pytest_cuda_comfy.log | tail -8 >> $R/summary.txt
pack
