#!/usr/bin/env bash
# Stop 55's CUDA check in one call (device tool, one H100): stop 54's run N selection with this stop's tree
# (cells' working directories removed once recorded; the engine behind LibraryClock; library_seconds recorded).
# Outcomes and signature ids against stop 54's N (docs/gpu-runs/h100-2026-11-27-stop54/N), each engine's
# cell time beside its floor, and the cell directories left under pytest's basetemp.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
t0=$(date +%s)
S=/tmp/site; R=/tmp/r; mkdir -p $S $R
python3 -m zipfile -e .whl/bitsandbytes-*.whl $S || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S $(ls .whl/*.whl | grep -v bitsandbytes) || exit 1
export PYTHONPATH=$S
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c 'import torch, transformers, peft, accelerate, lightning; print(torch.__version__, transformers.__version__, peft.__version__, accelerate.__version__, lightning.__version__)'; nproc; } > $R/env.txt 2>&1
cat $R/env.txt; echo "setup $(( $(date +%s) - t0 )) s"
SEL="--device cuda --world-size 1 --model tiny-llama,lora,gemma-cache,tiny-transformer --engine torch,accelerate,hf-trainer,lightning,ddp,fsdp2,accelerate-fsdp2 --cuda-device per-worker -n 6"
timeout --signal=TERM --kill-after=20 200 python3 -m matrix run cases -p matrix.plugin $SEL --report-dir $R --run-id N55 --basetemp /tmp/bt > $R/N55.log 2>&1; echo "N55 rc=$? at $(( $(date +%s) - t0 )) s"
[ -f $R/N55/results.json ] || python3 -m matrix fold $R/N55 > /dev/null 2>&1
sed -n 3p $R/N55/summary.md
echo "cell directories left under the basetemp: $(find /tmp/bt -maxdepth 2 -type d -name 'test_cell_*' 2>/dev/null | wc -l)"
python3 - <<'PY'
import gzip, json, statistics
new = {c["id"]: c for c in json.load(open("/tmp/r/N55/results.json"))["cells"]}
old = {c["id"]: c for c in json.load(gzip.open("docs/gpu-runs/h100-2026-11-27-stop54/N/results.json.gz"))["cells"]}
both = sorted(set(new) & set(old))
ran = [c for c in both if new[c]["outcome"] != "skipped" or old[c]["outcome"] != "skipped"]
def v(c):
    s = c.get("signature") or {}
    return (c["outcome"], s.get("id"))
diff = [(c, v(old[c]), v(new[c])) for c in ran if v(old[c]) != v(new[c])]
print(f"cells in both: {len(both)}, ran in either: {len(ran)}, outcome or signature id differs: {len(diff)}")
for d in diff[:40]: print("  DIFF", *d)
by = {}
for c in new.values():
    if c["outcome"] == "skipped": continue
    by.setdefault(c["engine"], []).append((c["duration_s"], (c.get("metrics") or {}).get("library_seconds")))
for engine, rows in sorted(by.items()):
    cell = sum(d for d, _ in rows); floor = [f for _, f in rows if isinstance(f, (int, float))]
    print(f"{engine}: {len(rows)} cells, cell {cell:.1f} s, floor {sum(floor):.1f} s over {len(floor)} cells, ratio {cell / max(sum(floor), 1e-9):.1f}x")
PY
mkdir -p $OUT/N55; cp $R/env.txt $OUT/; cp $R/N55/summary.md $OUT/N55/; gzip -c $R/N55/results.json > $OUT/N55/results.json.gz; tail -5 $R/N55.log > $OUT/N55/tail.txt
echo "all done at $(( $(date +%s) - t0 )) s"
