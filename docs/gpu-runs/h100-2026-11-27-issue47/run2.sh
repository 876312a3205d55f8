#!/usr/bin/env bash
# Issue 47's second H100 call: the changes the first call prompted, on CUDA.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
R=/tmp/r; mkdir -p $R; t0=$(date +%s)
timeout 150 python3 -m matrix run cases -p matrix.plugin --device cuda --cuda-device per-worker --world-size 1 \
  --model tiny-llama,lora --precision bf16-mixed,fp16-mixed --engine accelerate-fsdp2 --mode train -n 4 \
  --report-dir $R --run-id F2 > $R/F2.log 2>&1
echo "F2 rc=$? at $(( $(date +%s) - t0 )) s"; sed -n 3p $R/F2/summary.md
python3 -c "
import json
for c in json.load(open('$R/F2/results.json'))['cells']:
    t = ((c.get('metrics') or {}).get('curve') or {}).get('torch_engine') or {}
    print(c['id'], c['outcome'], (c.get('known_failure') or {}).get('id'), t.get('rounding'), t.get('worst_share'))"
timeout 60 python3 -m matrix repro tiny-llama-fp16-mixed-train-cuda-accelerate-fsdp2 --run $R/F2 -o $R/a.py > $R/a.gen 2>&1
timeout 120 python3 $R/a.py --json $R/a.json > $R/a.log 2>&1; echo "script exit $? at $(( $(date +%s) - t0 )) s"
grep -E "scaler|^REPRO|^HOLDS|^ANOTHER" $R/a.log | cut -c1-400
tar czf $OUT/r2.tgz -C $R .
