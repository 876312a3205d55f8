#!/bin/bash
# usage: run_matrix.sh VENV SCRIPT VERSION... ; swaps accelerate (pure Python, --no-deps) and runs SCRIPT
venv=$1; script=$2; shift 2
for v in "$@"; do
  nice -n 10 $venv/bin/python -m pip install -q --no-deps accelerate==$v 2>&1 | grep -v Location
  start=$(date +%s.%N)
  nice -n 10 $venv/bin/python $script > logs/$(basename $script .py)_acc$v.log 2>&1; rc=$?
  end=$(date +%s.%N)
  printf "%s accelerate=%s rc=%s wall=%.1fs verdict=%s\n" "$(basename $script)" "$v" "$rc" "$(echo "$end - $start" | bc)" "$(tail -1 logs/$(basename $script .py)_acc$v.log)"
done
