# session 25, second call (warm): bench model --validate with 8 head pieces and 16 row pieces; the parts with 16 and
# 16; then the rest of tests/test_cuda.py with what is left of the device time.
set -u
source benchmarks/device_setup.sh
R=$OUT/r; mkdir -p $R
cp .carry/commit.txt $R/
timeout 150 python3 -m h3ms_async bench model --validate --tokens 75794 --weights int8 --ranks 2,4,8 \
  --schedule gather+pieces8+ahead16 --out $R/bench_model_validate_p8a16.json > $R/bench_model_validate_p8a16.log 2>&1
echo "validate p8a16 rc=$? t=$SECONDS" >> $R/summary.txt
timeout 120 python3 -m h3ms_async bench model --tokens 75794 --weights int8 --ranks 2,4,8 \
  --schedule gather+pieces16+ahead16 --out $R/bench_model_p16a16.json > $R/bench_model_p16a16.log 2>&1
echo "parts p16a16 rc=$? t=$SECONDS" >> $R/summary.txt
left=$((500-SECONDS))
[ $left -gt 30 ] && timeout $left python3 -m pytest -v -p no:cacheprovider -s -rs -m cuda tests/test_cuda.py \
  -k "not (gather_ahead_on_logical or (split_paths_on_logical and (pieces4 or both)) or (block_timings and pieces4))" \
  > $R/pytest_cuda_rest.log 2>&1
echo "test_cuda rest rc=$? t=$SECONDS" >> $R/summary.txt
tar -C $OUT -czf $OUT/results.tar.gz r && cp $R/summary.txt $OUT/ && rm -rf $R
