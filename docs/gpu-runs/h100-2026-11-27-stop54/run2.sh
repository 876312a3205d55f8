#!/usr/bin/env bash
# Stop 54, second call: the shown_by scripts of the two entries the first call's run N led to (written and run here).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
t0=$(date +%s); S=/tmp/site; R=/tmp/r; mkdir -p $S $R/scripts
python3 -m zipfile -e .whl/bitsandbytes-*.whl $S || exit 1
export PYTHONPATH=$S
script() { local name=$1 cell=$2; shift 2
  timeout 90 python3 -m matrix repro $cell "$@" -o $R/scripts/$name.py > $R/scripts/$name.gen 2>&1 || { echo "$name: repro rc=$?"; tail -3 $R/scripts/$name.gen; return; }
  timeout 150 python3 $R/scripts/$name.py --json $R/scripts/$name.json > $R/scripts/$name.log 2>&1; echo "$name ($cell): exit $? at $(( $(date +%s) - t0 )) s"; }
script fsdp2-int8 lora-int8-fp16-mixed-train-cuda-fsdp2 --world-size 1 &
script fsdp2-nf4 lora-nf4-bf16-mixed-eval-cuda-fsdp2 --world-size 1 &
script afsdp2-loaded lora-fp16-loaded-mixed-train-cuda-accelerate-fsdp2 --world-size 1 &
wait
grep -h "^CHECK.*FAILED\|^REPRODUCED\|^HOLDS\|^ANOTHER" $R/scripts/*.log | cut -c1-300
tar czf $OUT/gpu-scripts.tgz -C $R scripts
