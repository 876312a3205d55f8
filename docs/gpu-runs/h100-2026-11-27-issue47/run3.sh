#!/usr/bin/env bash
# Issue 47's third H100 call: the matmul entry's new cell condition on the lightning-compile cells.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
R=/tmp/r; mkdir -p $R
timeout 130 python3 -m matrix run cases -p matrix.plugin --device cuda --cuda-device per-worker \
  --model tiny-llama --precision fp32,bf16-mixed --engine lightning-compile -n 4 --report-dir $R --run-id O3 > $R/O3.log 2>&1
echo "O3 rc=$?"; sed -n 3p $R/O3/summary.md
python3 -c "
import json
for c in json.load(open('$R/O3/results.json'))['cells']:
    print(c['id'], c['outcome'], (c.get('known_failure') or {}).get('id'), ((c.get('metrics') or {}).get('effective') or {}).get('legacy_matmul_getter_refused'))"
tar czf $OUT/r3.tgz -C $R .
