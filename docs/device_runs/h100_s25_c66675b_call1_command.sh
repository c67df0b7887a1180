# session 25, one call: what the produced-pieces order touches, on the GPU from fresh workers (tests/test_cuda.py:
# head pieces, both overlaps, every gather-ahead case incl. GPU-direct and streamed, the per-block timings with
# pieces); bench gpu host staging with 8 pieces at the order before (a copy of the tree with .carry/host_before.py)
# and at HEAD; bench model --validate with 8 and 8 pieces at 2, 4 and 8 logical ranks (8: host staging bound by its
# copies, where the two hops' overlap shows); the GPU-direct exchange ordered by events against the spec.
set -u
source benchmarks/device_setup.sh
R=$OUT/r; mkdir -p $R
cp .carry/commit.txt $R/; { nvidia-smi; nvidia-smi topo -m; } > $R/machine.txt 2>&1
echo "setup t=$SECONDS" >> $R/summary.txt
timeout 200 python3 -m pytest -v -p no:cacheprovider -s -rs -m cuda tests/test_cuda.py --durations=10 \
  -k "gather_ahead_on_logical or (split_paths_on_logical and (pieces4 or both)) or (block_timings and pieces4)" \
  > $R/pytest_cuda.log 2>&1
echo "test_cuda rc=$? t=$SECONDS" >> $R/summary.txt
grep -hE "passed|failed" $R/pytest_cuda.log | tail -1 >> $R/summary.txt
mkdir -p old && cp -r h3ms_async workers old/ && cp .carry/host_before.py old/workers/transports/host.py
B="bench gpu --tokens 75794 --layers 2 --residency resident --steps 2 --weights int8 --ranks 2 --exchange host --overlap none,gather+pieces8+ahead8"
for v in old new; do
  if [ $v = old ]; then (cd old && PYTHONPATH=$PWD:$PYTHONPATH timeout 75 python3 -m h3ms_async $B --out $R/$v > $R/bench_gpu_$v.log 2>&1)
  else timeout 75 python3 -m h3ms_async $B --out $R/$v > $R/bench_gpu_$v.log 2>&1; fi
  echo "bench $v rc=$? t=$SECONDS" >> $R/summary.txt
done
left=$((545-SECONDS)); [ $left -gt 230 ] && left=230
timeout $left python3 -m h3ms_async bench model --validate --tokens 75794 --weights int8 --ranks 2,4,8 \
  --schedule gather+pieces8+ahead8 --validate-ranks 2,4,8 --out $R/bench_model_validate_p8a8.json \
  > $R/bench_model_validate_p8a8.log 2>&1
echo "validate p8a8 rc=$? t=$SECONDS" >> $R/summary.txt
left=$((585-SECONDS))
[ $left -gt 20 ] && timeout $left python3 -m pytest -v -p no:cacheprovider -rs tests/test_exchange_conformance.py \
  -k "cuda-ipc-events" > $R/pytest_conformance_events.log 2>&1
echo "conformance events rc=$? t=$SECONDS" >> $R/summary.txt
tar -C $OUT -czf $OUT/results.tar.gz r && cp $R/summary.txt $OUT/ && rm -rf $R
