#!/usr/bin/env bash
# The GPU checks of docs/performance.md ("On a GPU"), in one call on a machine with CUDA GPUs and no network:
#   bash docs/bench/gpu-checks.sh [OUT]
# Needs torch with CUDA, lightning and torchmetrics installed; this checkout is put on PYTHONPATH (no install).
# 1. the device synchronizations per training batch, as torch.cuda.set_sync_debug_mode("warn") reports them;
# 2. the benchmark with --accelerator gpu: ddp against shardplus, shardplus-plain and shardplus-report;
# 3. the compression hooks on NCCL (bf16 needs NCCL), one short run each;
# 4. ShardPlusModelParallelStrategy against ModelParallelStrategy (FSDP2 on CUDA/NCCL, one data-parallel rank per GPU).
# Each step has a time limit, so that a stuck step leaves the others' results; JSON and logs go to OUT.
set -u
OUT=${1:-${OUT:-bench_results/gpu}}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
bench="python3 -m lightning_shardplus.bench --accelerator gpu"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)" \
    | tee -a "$OUT/device.txt"

timeout 75 $bench --host-syncs --steps 100 --warmup 10 --log-every-n-steps 50 \
    --json "$OUT/host-syncs.json" >"$OUT/host-syncs.log" 2>&1
echo "host-syncs: rc $?"; tail -n 40 "$OUT/host-syncs.log"

timeout 130 $bench --configs ddp,shardplus,shardplus-plain,shardplus-report --repeats 5 --steps 200 \
    --json "$OUT/gpu-matrix.json" >"$OUT/gpu-matrix.log" 2>&1
echo "matrix: rc $?"; grep -v '^run ' "$OUT/gpu-matrix.log" | tail -n 25

timeout 50 $bench --configs ddp,none,fp16,bf16,powersgd --repeats 1 --steps 50 \
    --json "$OUT/gpu-compression.json" >"$OUT/gpu-compression.log" 2>&1
echo "compression: rc $?"; grep -v '^run ' "$OUT/gpu-compression.log" | tail -n 15

timeout 90 $bench --model-parallel --devices "$(nvidia-smi -L | wc -l)" --repeats 3 --steps 100 \
    --json "$OUT/gpu-model-parallel.json" >"$OUT/gpu-model-parallel.log" 2>&1
echo "model parallel: rc $?"; grep -v 'samples/s$' "$OUT/gpu-model-parallel.log" | tail -n 8
