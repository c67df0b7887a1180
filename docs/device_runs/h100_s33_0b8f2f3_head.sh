set -u
source benchmarks/device_setup.sh
R=$OUT/r; mkdir -p $R
cp .carry/commit.txt $R/; { nvidia-smi; nvidia-smi topo -m; python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; } > $R/machine.txt 2>&1
echo "setup t=$SECONDS" >> $R/summary.txt
pack() { tar -C $OUT -czf $OUT/results.tar.gz r && cp $R/summary.txt $OUT/ && rm -rf $R; }
