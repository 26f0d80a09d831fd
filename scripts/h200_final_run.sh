#!/bin/bash
# Every section of `foxhunt-jax bench` on one GPU, in parts that each fit the device tool's
# 600 s per command (BENCHMARKS.md's final runs). Run from the repository root on the GPU
# machine, one part per command, then join the parts here:
#
#   bash scripts/h200_final_run.sh 1     # seed, compile, device          (~220 s on an H200)
#   bash scripts/h200_final_run.sh 2     # collect, train, replay         (~280 s)
#   bash scripts/h200_final_run.sh 3     # forward (the kernels' checks)  (~60 s)
#   foxhunt-jax bench --merge part1.json part2.json part3.json --json benchmarks/h200.json
#
# Each part writes $OUT/partN.json (OUT defaults to ./bench-out). Part 2 times the replay
# beside flashbax when wheels of flashbax and tensorstore lie in .whl/ (the GPU machine has no
# network): they are installed into /tmp/site for this process only.
set -euo pipefail
part=${1:?usage: h200_final_run.sh 1|2|3}
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
VARIANTS=xla:float32,xla:bfloat16,pallas:bfloat16
bench() { python3 -m foxhunt_jax bench "$@" 2>&1 | grep -v "^[WI][0-9]"; }
case $part in
  1) bench --sections seed,compile,device --variants $VARIANTS --epochs 20 --warmup 1 \
       --time-budget 280 --json "$OUT/part1.json" ;;
  2) if compgen -G ".whl/*.whl" > /dev/null; then
       python3 -m pip install -q --no-deps --target /tmp/site .whl/*.whl
       export PYTHONPATH=/tmp/site:$PYTHONPATH
     fi
     bench --sections collect,train,replay --variants $VARIANTS --time-budget 330 \
       --json "$OUT/part2.json" ;;
  3) bench --sections forward --variants pallas:bfloat16 --forward-n 25600,1048576 \
       --time-budget 60 --json "$OUT/part3.json" ;;
  *) echo "error: part must be 1, 2 or 3, got '$part'" >&2; exit 2 ;;
esac
