# COLD_ARGS=--lora bash .carry/next/call3.sh
# the first prompt at all 50 full-width int8 blocks: plain ComfyUI against the node, then the store kept across a
# rank map one rank longer (COLD_ARGS=--lora: a LoRA on every block)
source .carry/next/head.sh
OUT=$R/cold timeout 585 bash benchmarks/device_comfy.sh cold > $R/cold.log 2>&1
echo "cold ${COLD_ARGS:-} rc=$? t=$SECONDS" >> $R/summary.txt
grep -E '"(node_cold_over_comfy_cold|bit_exact|cold_s|wall_s|line)"' $R/cold/comfy_cold_start.json >> $R/summary.txt 2>&1
pack
