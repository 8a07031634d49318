#!/usr/bin/env bash
# The checks to run first when a session is lent a GPU: one device call of about 8 minutes, leaving time to rerun.
#   run(command="bash bench/gpu_check.sh", timeout_s=560)
# Writes under $OUT (the device tool's folder; /tmp/gpu_check elsewhere):
#   test_gpu.txt      tests/test_gpu.py (NCCL, Triton kernels, offload tiers, checkpoints on CUDA)
#   step_profile.txt  where zcompile_z3's and the offload system's steps go (torch.profiler tables)
#   compare.txt       bench/compare.py's table with FSDP2 + torch.compile beside them (+ .json/.md/.png)
# Each step runs alone: the steps are bound by the CPU launching work, so anything running beside them moves them by
# 20% (bench/results/gpu-h100-2026-11-27.md). Don't `pkill -f python` here: it matches this script's own shell.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
T0=$(date +%s)
since() { echo "$1 rc=$2 after $(( $(date +%s) - T0 )) s"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
date -u

timeout 240 python -m pytest -v -n 6 -p no:cacheprovider tests/test_gpu.py > "$OUT/test_gpu.txt" 2>&1
since "test_gpu" $?
grep -E " (PASSED|FAILED|ERROR)" "$OUT/test_gpu.txt" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //'
tail -2 "$OUT/test_gpu.txt"

timeout 150 python bench/step_profile.py --systems zcompile_z3,zcompile_z3_offload --rows 12 \
    > "$OUT/step_profile.txt" 2>&1
since "step_profile" $?
grep -A4 "^| system" "$OUT/step_profile.txt"

timeout 150 python bench/compare.py --world 1 --model gpt --size medium --micro 8 --seq 256 --device cuda \
    --systems fsdp2_compile,zcompile_z3,zcompile_z3_offload --out "$OUT" > "$OUT/compare.txt" 2>&1
since "compare" $?
grep -A6 "^###" "$OUT/compare.txt"
date -u
