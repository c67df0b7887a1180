set -u; source benchmarks/device_setup.sh; R=$OUT/r; mkdir -p $R; cp .carry/commit.txt $R/
timeout 560 python3 -m pytest -v -p no:cacheprovider -s -rs -m cuda tests/test_cuda.py --durations=10 \
  -k "not (ulysses-pieces8 or all-overlaps-8-16)" > $R/pytest_cuda_rest.log 2>&1
echo "test_cuda rest rc=$? t=$SECONDS" >> $R/summary.txt
grep -hE "PASSED|FAILED|passed|failed" $R/pytest_cuda_rest.log | tail -40 >> $R/summary.txt
tar -C $OUT -czf $OUT/results.tar.gz r && cp $R/summary.txt $OUT/
