# session 26, call 2: real ComfyUI on CUDA at HEAD (tests/test_cuda_comfy.py: DynamicVRAM / --novram /
# --disable-dynamic-vram / --use-ck-attention groups, bf16 + int8, LoRA, 3 ranks 1,2,1; the LoRA strength change
# refreshing resident blocks, never run on a GPU before).
set -u
source benchmarks/device_setup.sh
R=$OUT/r; mkdir -p $R
cp .carry/commit.txt $R/; nvidia-smi > $R/machine.txt 2>&1
echo "setup t=$SECONDS" >> $R/summary.txt
OUT=$R timeout $((585-SECONDS)) python3 -m pytest -v -p no:cacheprovider -s -rs -m cuda tests/test_cuda_comfy.py \
  --durations=10 > $R/pytest_cuda_comfy.log 2>&1
echo "cuda_comfy rc=$? t=$SECONDS" >> $R/summary.txt
grep -hE "PASSED|FAILED|passed|failed" $R/pytest_cuda_comfy.log | tail -8 >> $R/summary.txt
tar -C $OUT -czf $OUT/results.tar.gz r && cp $R/summary.txt $OUT/ && rm -rf $R
