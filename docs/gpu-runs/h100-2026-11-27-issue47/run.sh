#!/usr/bin/env bash
# Issue 47's CUDA half in one call (device tool, one H100). The project runs from its source with
# -p matrix.plugin; wheels travel in .whl (and .whl524: transformers 5.24.0, the fixed release).
#   1  Q517/Q524  the 48 cells of sig-9ab33610 on the image's transformers 5.17.0, then on 5.24.0
#      F          accelerate-fsdp2, ddp, fsdp2 x fp16/bf16 on one rank (the grad-scaler entry; nccl)
#      Z          ZeRO-0 and ZeRO-1 training, bf16/fp16 (sig-20532d52's cells)
#      C          ddp-compile float8 (sig-773be0f0)
#   2  scripts    repro scripts written here and run here (exit codes), triage of run B of 2026-11-27,
#                 the accelerate and transformers upstream scripts; O1/O2: lightning and
#                 lightning-compile under two cell orders (issue 46's hermetic cells, first time on a GPU)
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
t0=$(date +%s)
S=/tmp/site; S524=/tmp/site524; R=/tmp/r; mkdir -p $S $S524 $R
python3 -m zipfile -e .whl/bitsandbytes-*.whl $S || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S $(ls .whl/*.whl | grep -v bitsandbytes) || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S524 .whl524/*.whl || exit 1
export PYTHONPATH=$S
V='import torch, transformers, peft, accelerate, lightning, bitsandbytes, huggingface_hub; print(torch.__version__, "transformers", transformers.__version__, "hub", huggingface_hub.__version__, "peft", peft.__version__, "accelerate", accelerate.__version__, "lightning", lightning.__version__, "bnb", bitsandbytes.__version__)'
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "$V"; python3 -c "import deepspeed, torchao; print('deepspeed', deepspeed.__version__, 'torchao', torchao.__version__)"; PYTHONPATH=$S524:$S python3 -c "$V"; nproc; } > $R/env.txt 2>&1
cat $R/env.txt; echo "setup $(( $(date +%s) - t0 )) s"
run() { local id=$1 s=$2; shift 2
  ( timeout --signal=TERM --kill-after=20 $s python3 -m matrix run cases -p matrix.plugin --device cuda \
      --cuda-device per-worker --report-dir $R --run-id $id "$@" > $R/$id.log 2>&1; echo "$id rc=$? at $(( $(date +%s) - t0 )) s" >> $R/$id.log ) & }
QSEL="--model lora,qlora --precision int8-fp16-mixed,nf4-bf16-mixed,nf4-fp16-mixed --engine torch,accelerate,hf-trainer,lightning"
run Q517 200 $QSEL -n 4
PYTHONPATH=$S524:$S run Q524 200 $QSEL -n 4
run F 200 --world-size 1 --model tiny-llama,lora,gemma-cache,tiny-transformer --precision fp16-mixed,bf16-mixed --engine accelerate-fsdp2,ddp,fsdp2 -n 3
run Z 200 --world-size 1 --model tiny-llama,lora,gemma-cache,tiny-transformer --precision bf16-mixed,fp16-mixed --engine deepspeed-zero0,deepspeed-zero1 --mode train -n 3
run C 200 --world-size 1 --model tiny-llama --precision float8-tensorwise,float8-rowwise --engine ddp-compile --mode train -n 2
wait; echo "group 1 done at $(( $(date +%s) - t0 )) s"
for id in Q517 Q524 F Z C; do tail -1 $R/$id.log; [ -f $R/$id/results.json ] || python3 -m matrix fold $R/$id > /dev/null 2>&1; sed -n 3p $R/$id/summary.md; done
run O1 170 --model tiny-llama --precision fp32,bf16-mixed,fp16-mixed,bf16-true --engine lightning,lightning-compile --order-seed 1 -n 3
run O2 170 --model tiny-llama --precision fp32,bf16-mixed,fp16-mixed,bf16-true --engine lightning,lightning-compile --order-seed 2 -n 3
mkdir -p $R/scripts
script() { local name=$1 cell=$2 tf=$3; shift 3  # generate here, run here: the exit code and the CHECK lines
  local pp=$S; [ "$tf" = 524 ] && pp=$S524:$S
  PYTHONPATH=$pp timeout 60 python3 -m matrix repro $cell "$@" -o $R/scripts/$name.py > $R/scripts/$name.gen 2>&1 || { echo "$name: repro rc=$?"; return; }
  PYTHONPATH=$pp timeout 150 python3 $R/scripts/$name.py --json $R/scripts/$name.json > $R/scripts/$name.log 2>&1; echo "$name ($cell, transformers $tf): exit $?"; }
( script int8-517 lora-int8-fp16-mixed-train-cuda-torch 517 --run $R/Q517
  script int8-524 lora-int8-fp16-mixed-train-cuda-torch 524 --run $R/Q524
  script nf4-517 qlora-nf4-bf16-mixed-train-cuda-torch 517 --run $R/Q517
  script nf4-524 qlora-nf4-bf16-mixed-train-cuda-torch 524 --run $R/Q524
  script f8-ddp-compile tiny-llama-float8-rowwise-train-cuda-ddp-compile 517 --run $R/C
  echo "stream 1 done at $(( $(date +%s) - t0 )) s" ) > $R/scripts/stream1.txt 2>&1 &
( script ddp-bf16 tiny-llama-bf16-mixed-train-cuda-ddp 517 --world-size 1
  script fsdp2-bf16 tiny-llama-bf16-mixed-train-cuda-fsdp2 517 --world-size 1
  script afsdp2-fp16-train tiny-llama-fp16-mixed-train-cuda-accelerate-fsdp2 517 --run $R/F
  script hf-trainer-bf16 tiny-llama-bf16-mixed-train-cuda-hf-trainer 517
  for u in upstream-accelerate/fsdp2_checkpoint_steps_through_grad_scaler.py upstream-transformers/prequantized_reload_casts_saved_fp32.py; do
    [ -f docs/$u ] || continue
    timeout 90 python3 docs/$u cuda > $R/scripts/$(basename $u .py).log 2>&1; echo "docs/$u cuda: exit $?"
    PYTHONPATH=$S524:$S timeout 90 python3 docs/$u cuda > $R/scripts/$(basename $u .py)-524.log 2>&1; echo "docs/$u cuda, transformers 5.24: exit $?"; done
  echo "stream 2 done at $(( $(date +%s) - t0 )) s" ) > $R/scripts/stream2.txt 2>&1 &
( cp -r .gpu/B $R/B-triage; timeout 230 python3 -m matrix triage $R/B-triage --budget 200 --timeout 100 > $R/B-triage.log 2>&1; echo "triage rc=$? at $(( $(date +%s) - t0 )) s" >> $R/B-triage.log ) &
wait; echo "group 2 done at $(( $(date +%s) - t0 )) s"
cat $R/scripts/stream1.txt $R/scripts/stream2.txt; tail -6 $R/B-triage.log
for id in O1 O2; do tail -1 $R/$id.log; [ -f $R/$id/results.json ] || python3 -m matrix fold $R/$id > /dev/null 2>&1; sed -n 3p $R/$id/summary.md; done
grep -h "^CHECK.*FAILED\|^REPRODUCED\|^HOLDS\|^ANOTHER" $R/scripts/*.log | cut -c1-300 | head -30
tar czf $OUT/gpu-runs.tgz -C $R . ; ls -la $OUT
