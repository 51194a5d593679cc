#!/usr/bin/env bash
# The course's GPU checks in one run, for a machine with CUDA (a lent GPU, or an instructor's):
# the kernels' builds (L3's, L4's), every gpu-marked test, L4's and L13's paths on CUDA through
# the smoke scripts, and L3's kernel's timing with and without L13's window. Each step has its own time limit and its own
# log under OUT_DIR (default gpu-logs/), so a step that hangs or fails leaves the others' logs;
# summary.txt lists each step's exit status and seconds.
#
#     bash scripts/gpu_checks.sh [OUT_DIR]          (PYTHON=python3 by default; run from the repository)
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu-logs}
mkdir -p "$out"
export PYTHONPATH=.
py=${PYTHON:-python3}

step() {  # step NAME SECONDS COMMAND...: runs COMMAND into OUT/NAME.log, appends its status to summary.txt
    local name=$1 limit=$2 began=$SECONDS
    shift 2
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "$name rc=$? ${SECONDS}s total, $((SECONDS - began))s" | tee -a "$out/summary.txt"
}

step versions 60 "$py" -c "import torch, transformers; print(torch.__version__, torch.version.cuda, \
transformers.__version__, torch.cuda.get_device_name())"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
step build 300 "$py" -c "from l3_block_kernel.paged_attention import load_extension; load_extension()"
step build_l4 300 "$py" -c "from l4_paged_prefill.kernel_build import load_extension; load_extension()"
step pytest_gpu 300 "$py" -m pytest -p no:cacheprovider -m gpu -q -rs tests/test_l3_kernel.py tests/test_l4_kernel.py \
    tests/test_l12_kernel.py tests/test_l13_kernel.py tests/test_lessons_worked_examples.py
step l4_smoke_cuda 120 "$py" scripts/l4_smoke.py --device cuda
step l4_smoke_cuda_fp32 120 "$py" scripts/l4_smoke.py --device cuda --dtype float32 --block-size 8 --prefill-chunk 5
step l13_smoke_cuda 120 "$py" scripts/l13_smoke.py --device cuda
step l13_smoke_cuda_swap 120 "$py" scripts/l13_smoke.py --device cuda --num-blocks 24 --prefill-chunk 32 --preempt swap
step l3_smoke_cuda 120 "$py" scripts/l3_smoke.py --device cuda
step bench_window 180 "$py" scripts/bench_l3_kernel.py --window 1024 --batches 1,8,32 --contexts 2048,8192,32768 \
    --json "$out/bench_window.json"
