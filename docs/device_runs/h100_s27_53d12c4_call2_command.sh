# session 27, call 2: bench gpu, the Ulysses pattern without and with 8 head pieces (its output now moved back in
# the same pieces) at 2 and 4 logical ranks, host staging and GPU-direct, beside the unsplit step and the
# no-exchange baseline of the same run.
set -u
source benchmarks/device_setup.sh
R=$OUT/r; mkdir -p $R
cp .carry/commit.txt $R/; nvidia-smi > $R/machine.txt 2>&1
echo "setup t=$SECONDS" >> $R/summary.txt
timeout 330 python3 -m h3ms_async bench gpu --tokens 75794 --layers 2 --residency resident \
  --steps 2 --weights int8 --ranks 2,4 --pattern ulysses --exchange host,cuda_ipc --overlap none,pieces8 \
  --out $R/bench_gpu_ulysses > $R/bench_gpu_ulysses.log 2>&1
echo "bench gpu ulysses rc=$? t=$SECONDS" >> $R/summary.txt
grep -E "ms|exact" $R/bench_gpu_ulysses.log | tail -30 >> $R/summary.txt
tar -C $OUT -czf $OUT/results.tar.gz r && cp $R/summary.txt $OUT/ && rm -rf $R
