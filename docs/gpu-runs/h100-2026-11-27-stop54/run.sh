#!/usr/bin/env bash
# Stop 54's CUDA checks in one call (device tool, one H100). The project runs from its source with -p matrix.plugin;
# wheels travel in .whl. Base code (5839013, before the folders and issue 50's changes) travels in .gpu/base-5839013.tgz.
#   N / B   the same CUDA selection with the new code and with the base code: outcomes and signature ids must match
#           (issue 49: ids unchanged by the move; issue 50: outcomes unchanged); each run's kind one-time work per worker
#   scripts the shown_by scripts of the CUDA catalogue entries in force on this stack (issue 47), exit codes
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
t0=$(date +%s)
S=/tmp/site; R=/tmp/r; BASE=/tmp/base; mkdir -p $S $R $BASE
python3 -m zipfile -e .whl/bitsandbytes-*.whl $S || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S $(ls .whl/*.whl | grep -v bitsandbytes) || exit 1
tar xzf .gpu/base-5839013.tgz -C $BASE || exit 1
export PYTHONPATH=$S
V='import torch, transformers, peft, accelerate, lightning, bitsandbytes; print(torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__, "accelerate", accelerate.__version__, "lightning", lightning.__version__, "bnb", bitsandbytes.__version__)'
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "$V"; nproc; git log --oneline -1 2>/dev/null; } > $R/env.txt 2>&1
cat $R/env.txt; echo "setup $(( $(date +%s) - t0 )) s"
SEL="--device cuda --world-size 1 --model tiny-llama,lora,gemma-cache,tiny-transformer --engine torch,accelerate,hf-trainer,lightning,ddp,fsdp2,accelerate-fsdp2 --cuda-device per-worker -n 6"
( timeout --signal=TERM --kill-after=20 330 python3 -m matrix run cases -p matrix.plugin $SEL --report-dir $R --run-id N > $R/N.log 2>&1; echo "N rc=$? at $(( $(date +%s) - t0 )) s" >> $R/N.log ) &
( cd $BASE && timeout --signal=TERM --kill-after=20 330 python3 -m matrix run cases -p matrix.plugin $SEL --report-dir $R --run-id B > $R/B.log 2>&1; echo "B rc=$? at $(( $(date +%s) - t0 )) s" >> $R/B.log ) &
mkdir -p $R/scripts
script() { local name=$1 cell=$2; shift 2
  timeout 90 python3 -m matrix repro $cell "$@" -o $R/scripts/$name.py > $R/scripts/$name.gen 2>&1 || { echo "$name: repro rc=$?"; return; }
  timeout 200 python3 $R/scripts/$name.py --json $R/scripts/$name.json > $R/scripts/$name.log 2>&1; echo "$name ($cell): exit $?"; }
( script aot-cache tiny-llama-bf16-mixed-eval-cuda-torch-compile
  script matmul-api tiny-llama-bf16-mixed-train-cuda-lightning-compile
  script afsdp2-scaler tiny-llama-fp16-mixed-eval-cuda-accelerate-fsdp2 --world-size 1
  echo "scripts done at $(( $(date +%s) - t0 )) s" ) > $R/scripts/stream.txt 2>&1 &
wait; echo "all done at $(( $(date +%s) - t0 )) s"
for id in N B; do tail -1 $R/$id.log; [ -f $R/$id/results.json ] || python3 -m matrix fold $R/$id > /dev/null 2>&1; sed -n 3p $R/$id/summary.md; done
cat $R/scripts/stream.txt
grep -h "^CHECK.*FAILED\|^REPRODUCED\|^HOLDS\|^ANOTHER" $R/scripts/*.log | cut -c1-300 | head -20
python3 - <<'PY'
import json
runs = {k: {c["id"]: c for c in json.load(open(f"/tmp/r/{k}/results.json"))["cells"]} for k in "NB"}
both = sorted(set(runs["N"]) & set(runs["B"]))
ran = [c for c in both if runs["N"][c]["outcome"] != "skipped" or runs["B"][c]["outcome"] != "skipped"]
def v(c):
    s = c.get("signature") or {}
    return (c["outcome"], s.get("id"))
diff = [(c, v(runs["B"][c]), v(runs["N"][c])) for c in ran if v(runs["B"][c]) != v(runs["N"][c])]
print(f"cells in both: {len(both)}, ran in either: {len(ran)}, outcome or signature id differs: {len(diff)}")
for d in diff[:40]: print("  DIFF", *d)
for k in "NB":
    doc = json.load(open(f"/tmp/r/{k}/results.json"))
    setups = doc.get("kind_setups") or []
    print(k, "kind one-time work records:", len(setups), "total s:", round(sum(s.get("seconds") or 0 for s in setups), 1),
          "per record:", sorted(round(s.get("seconds") or 0, 1) for s in setups)[-8:])
    cells = [c for c in doc["cells"] if c["outcome"] != "skipped"]
    print(k, "cells ran:", len(cells), "cell time s:", round(sum(c.get("duration_s") or 0 for c in cells), 1))
PY
tar czf $OUT/gpu-runs.tgz -C $R . ; ls -la $OUT
