# the whole CUDA test file from fresh workers, then every CUDA exchange of one GPU against the spec, then real
# ComfyUI on CUDA if time is left
source .carry/next/head.sh
timeout 80 python3 -m h3ms_async bench ipc --samples 200 --messages 2000 --pool-sizes 1,2,4 --start-device cuda:0 \
  --program dit > $R/bench_ipc_start_cuda.json 2> $R/bench_ipc_start_cuda.log
echo "start phases rc=$? t=$SECONDS" >> $R/summary.txt
grep -A60 '"pool_start"' $R/bench_ipc_start_cuda.json >> $R/summary.txt
timeout 380 python3 -m pytest -v -p no:cacheprovider -s -rs -m cuda tests/test_cuda.py --durations=10 \
  > $R/pytest_cuda.log 2>&1
echo "test_cuda rc=$? t=$SECONDS" >> $R/summary.txt
grep -hE "FAILED|passed|failed" $R/pytest_cuda.log | tail -8 >> $R/summary.txt
timeout 120 python3 -m pytest -v -p no:cacheprovider -rs tests/test_exchange_conformance.py \
  -k "cuda-host or (cuda-ipc and not cpu)" > $R/pytest_conformance_cuda.log 2>&1
echo "conformance rc=$? t=$SECONDS" >> $R/summary.txt
grep -hE "FAILED|passed|failed" $R/pytest_conformance_cuda.log | tail -3 >> $R/summary.txt
left=$((580-SECONDS))
[ $left -gt 100 ] && timeout $left python3 -m h3ms_async bench gpu --tokens 75794 --layers 2 --residency resident \
  --steps 2 --weights bf16 --ranks 2 --pattern ulysses --exchange host,cuda_ipc --overlap none,pieces8,pieces16 \
  --out $R/bench_gpu_ulysses_bf16 > $R/bench_gpu_ulysses_bf16.log 2>&1
echo "bf16 ulysses rc=$? t=$SECONDS" >> $R/summary.txt
grep -E "ms|exact" $R/bench_gpu_ulysses_bf16.log | tail -14 >> $R/summary.txt
pack
