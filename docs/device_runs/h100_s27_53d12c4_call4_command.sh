set -u; source benchmarks/device_setup.sh; R=$OUT/r; mkdir -p $R; cp .carry/commit.txt $R/
timeout 200 python3 -m h3ms_async bench gpu --tokens 75794 --layers 2 --residency resident --steps 2 --weights bf16 \
  --ranks 2,4 --pattern ulysses --exchange host,cuda_ipc --overlap none,pieces8 --out $R/bench_gpu_ulysses_bf16 \
  > $R/bench_gpu_ulysses_bf16.log 2>&1
echo "bf16 ulysses rc=$? t=$SECONDS" >> $R/summary.txt
timeout $((440-SECONDS)) python3 -m h3ms_async bench gpu --tokens 75794 --layers 2 --residency resident --steps 2 \
  --weights int8 --ranks 2,4 --pattern gather --exchange host,cuda_ipc --overlap none,gather+pieces8+ahead8 \
  --out $R/bench_gpu_gather_all8 > $R/bench_gpu_gather_all8.log 2>&1
echo "gather all8 rc=$? t=$SECONDS" >> $R/summary.txt
tar -C $OUT -czf $OUT/results.tar.gz r && cp $R/summary.txt $OUT/
