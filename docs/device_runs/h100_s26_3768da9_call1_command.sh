# session 26, call 1: the Ulysses pattern in head pieces on CUDA (tests/test_cuda.py ulysses-pieces8, host staging
# and GPU-direct, fresh workers, first step torch.equal) and the gather-ahead case with 16 row pieces; every CUDA
# exchange of one GPU against the spec (the new all_to_all_qkv_heads included); bench gpu, the Ulysses pattern
# without and with 8 head pieces at 2 and 4 logical ranks, host staging and GPU-direct.
set -u
source benchmarks/device_setup.sh
R=$OUT/r; mkdir -p $R
cp .carry/commit.txt $R/; { nvidia-smi; nvidia-smi topo -m; } > $R/machine.txt 2>&1
echo "setup t=$SECONDS" >> $R/summary.txt
timeout 200 python3 -m pytest -v -p no:cacheprovider -s -rs -m cuda tests/test_cuda.py --durations=5 \
  -k "ulysses-pieces8 or all-overlaps-8-16" > $R/pytest_cuda.log 2>&1
echo "test_cuda rc=$? t=$SECONDS" >> $R/summary.txt
grep -hE "PASSED|FAILED|passed|failed" $R/pytest_cuda.log | tail -5 >> $R/summary.txt
timeout 170 python3 -m pytest -v -p no:cacheprovider -rs tests/test_exchange_conformance.py \
  -k "cuda-host or (cuda-ipc and not cpu)" > $R/pytest_conformance.log 2>&1
echo "conformance rc=$? t=$SECONDS" >> $R/summary.txt
grep -hE "passed|failed" $R/pytest_conformance.log | tail -1 >> $R/summary.txt
left=$((585-SECONDS))
[ $left -gt 60 ] && timeout $left python3 -m h3ms_async bench gpu --tokens 75794 --layers 2 --residency resident \
  --steps 2 --weights int8 --ranks 2,4 --pattern ulysses --exchange host,cuda_ipc --overlap none,pieces8 \
  --out $R/bench_gpu_ulysses > $R/bench_gpu_ulysses.log 2>&1
echo "bench gpu ulysses rc=$? t=$SECONDS" >> $R/summary.txt
tar -C $OUT -czf $OUT/results.tar.gz r && cp $R/summary.txt $OUT/ && rm -rf $R
