# session 27, call 1: the Ulysses pattern with its output moved back in head pieces (all_to_all_qkv_attend) on
# CUDA: tests/test_cuda.py ulysses-pieces8 (host staging and GPU-direct, fresh workers, torch.equal, first step
# included) and the gather-ahead case with 16 pieces; every CUDA exchange of one GPU against the spec (the new op
# included); the model of the Ulysses pattern in 8 head pieces validated on 2 and 4 logical ranks.
set -u
source benchmarks/device_setup.sh
R=$OUT/r; mkdir -p $R
cp .carry/commit.txt $R/; { nvidia-smi; nvidia-smi topo -m; } > $R/machine.txt 2>&1
echo "setup t=$SECONDS" >> $R/summary.txt
timeout 200 python3 -m pytest -v -p no:cacheprovider -s -rs -m cuda tests/test_cuda.py --durations=5 \
  -k "ulysses-pieces8 or all-overlaps-8-16" > $R/pytest_cuda.log 2>&1
echo "test_cuda rc=$? t=$SECONDS" >> $R/summary.txt
grep -hE "PASSED|FAILED|passed|failed|Error" $R/pytest_cuda.log | tail -8 >> $R/summary.txt
timeout 170 python3 -m pytest -v -p no:cacheprovider -rs tests/test_exchange_conformance.py \
  -k "cuda-host or (cuda-ipc and not cpu)" > $R/pytest_conformance.log 2>&1
echo "conformance rc=$? t=$SECONDS" >> $R/summary.txt
grep -hE "passed|failed" $R/pytest_conformance.log | tail -1 >> $R/summary.txt
left=$((585-SECONDS))
[ $left -gt 60 ] && timeout $left python3 -m h3ms_async bench model --validate --validate-pattern ulysses \
  --schedule pieces8 --tokens 75794 --weights int8 --ranks 2,4,8 --validate-ranks 2,4 \
  --out $R/bench_model_validate_ulysses.json > $R/bench_model_validate_ulysses.log 2>&1
echo "validate ulysses rc=$? t=$SECONDS" >> $R/summary.txt
tail -c 3000 $R/bench_model_validate_ulysses.log >> $R/summary.txt
tar -C $OUT -czf $OUT/results.tar.gz r && cp $R/summary.txt $OUT/ && rm -rf $R
