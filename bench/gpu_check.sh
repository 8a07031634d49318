#!/usr/bin/env bash
# The checks to run when a session is lent a GPU: one device call of about 9 minutes, leaving time to rerun.
#   run(command="bash bench/gpu_check.sh", timeout_s=570)              # the two GPT-2 workloads
#   run(command="bash bench/gpu_check.sh llama tests", timeout_s=570)  # a chosen subset, in this order
# Parts: gpt2-124M (16 x 1024 tokens), gpt2-774M (8 x 1024), llama (Llama-style 1B, 8 x 1024), nested (GPT-2 124M:
# plain torch.compile, zcompile's default regions and regional_compile 'nested', which decides that default),
# offload (GPT-2 774M: zcompile without offload, with the optimizer on the host, with its update delayed one
# step, and with each bucket updated during the backward, issue 57), chunked-loss (GPT-2 124M and 774M: zcompile's
# default chunked head and loss, with its logits made again in the backward, and unchunked), host-work (Python calls,
# eager ops and graph calls per step, and the step of each system stepped in turn: bench/host_work.py on GPT-2 124M
# shapes), cpu-adam (the host's optimizer update rate against its memory bandwidth), tests
# (tests/test_gpu.py). Each workload part is bench/workload.py with plain torch.compile, FSDP2 + torch.compile,
# zcompile stage 3 and zcompile with the optimizer on the host, one system after the other, each under its own
# timeout, the table rewritten as each finishes; each system's steps are profiled (torch.profiler table, and the
# GPU-busy time per step against the step: the kernels' union, a column of the table).
# Writes under $OUT (the device tool's folder; /tmp/gpu_check elsewhere): workload-*.md/json and <part>.txt.
# Don't `pkill -f python` here: it matches this script's own shell.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
T0=$(date +%s)
since() { echo "$1 rc=$2 after $(( $(date +%s) - T0 )) s"; }
parts=${*:-gpt2-124M gpt2-774M}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
date -u

workload() {  # name, per-system timeout, then workload.py arguments
    local name=$1 t=$2
    shift 2
    timeout $(( 4 * t + 30 )) python bench/workload.py --device cuda --timeout "$t" --warmup 3 --steps 8 \
        --profile 15 --out "$OUT" "$@" > "$OUT/$name.txt" 2>&1
    since "$name" $?
    grep -A8 "^###" "$OUT/$name.txt" | tail -9
}

for part in $parts; do
    case $part in
        gpt2-124M) workload gpt2-124M 100 --model gpt2-124M --micro 16 --seq 1024 ;;
        gpt2-774M) workload gpt2-774M 150 --model gpt2-774M --micro 8 --seq 1024 ;;
        llama) workload llama-1B 150 --model llama-1B --micro 8 --seq 1024 \
                   --systems torch_compile,fsdp2_compile,zcompile_z3 ;;
        nested) workload gpt2-124M-nested 100 --model gpt2-124M --micro 16 --seq 1024 \
                   --systems torch_compile,zcompile_z3,zcompile_z3_nested --tag workload-gpt2-124M-nested ;;
        offload) workload gpt2-774M-offload 150 --model gpt2-774M --micro 8 --seq 1024 \
                   --systems zcompile_z3,zcompile_z3_offload,zcompile_z3_offload_delayed,zcompile_z3_offload_in_backward \
                   --tag workload-gpt2-774M-offload ;;
        chunked-loss)
            for size in 124M:16 774M:8; do
                workload "gpt2-${size%:*}-chunked-loss" 150 --model "gpt2-${size%:*}" --micro "${size#*:}" --seq 1024 \
                    --systems zcompile_z3,zcompile_z3_recompute_logits,zcompile_z3_unchunked_loss \
                    --tag "workload-gpt2-${size%:*}-chunked-loss"
            done ;;
        host-work)  # issue 69: the host's work per step and the step ratio, systems stepped in turn, GPT-2 124M shapes
            timeout 540 python bench/host_work.py --device cuda --layers 12 --width 768 --heads 12 --vocab 50304 \
                --seq 1024 --micro 8 --warmup 3 --steps 10 --alternate 20 --fused --timeout 90 \
                --systems torch_compile,zcompile_z3,zcompile_z3_nested --tag host_work-gpu --out "$OUT" \
                > "$OUT/host-work.txt" 2>&1
            since "host-work" $?
            tail -6 "$OUT/host-work.txt" ;;
        cpu-adam)  # the host's update rate against its memory bandwidth (issue 57), 100M and 1B elements
            timeout 300 python bench/cpu_adam_rate.py --sizes 100M,1B --out "$OUT" > "$OUT/cpu-adam.txt" 2>&1
            since "cpu-adam" $?
            tail -13 "$OUT/cpu-adam.txt" ;;
        tests)
            timeout 200 python -m pytest -v -p no:cacheprovider tests/test_gpu.py > "$OUT/tests.txt" 2>&1
            since "test_gpu" $?
            grep -E " (PASSED|FAILED|ERROR)" "$OUT/tests.txt"
            tail -2 "$OUT/tests.txt" ;;
        *) echo "unknown part $part (gpt2-124M, gpt2-774M, llama, nested, offload, chunked-loss, cpu-adam, tests)" ;;
    esac
done
date -u
