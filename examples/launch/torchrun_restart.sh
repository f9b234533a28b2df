#!/usr/bin/env bash
# A torchrun job that survives worker failures: when a process dies (a crash, an OOM kill, a lost GPU), torchrun
# stops the others and starts all of them again, up to MAX_RESTARTS times; each start resumes from the last
# checkpoint. Run it once on every node (NNODES=1: just run it).
#
#   NODE_RANK=0 MASTER_ADDR=node0.example.com ./examples/launch/torchrun_restart.sh
#
# `--ckpt_path last` loads checkpoints/last.ckpt (examples/launch/resumable.yaml writes it every 50 optimizer steps):
# the weights, the optimizer, the loop counters, gradient-compression state (PowerSGD) and where the training
# samplers were in the epoch, so the restarted job reads exactly the samples that were next and ends with the
# weights an uninterrupted job would have (bitwise on CPU with deterministic settings), minus the steps since the
# checkpoint, which it trains again. tests/test_elastic.py runs this on one machine with a worker killed mid-epoch.
#
# The number of processes must stay devices x num_nodes of the Trainer: to continue on another number of nodes,
# start a new job with the new numbers and --ckpt_path pointing at the checkpoint; the rest of the epoch is
# resharded over the new processes, every remaining sample read once.
set -euo pipefail

NNODES=${NNODES:-1}                  # number of machines
NODE_RANK=${NODE_RANK:-0}
NPROC_PER_NODE=${NPROC_PER_NODE:-2}  # processes per node: one per GPU (or a few on CPU)
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
MAX_RESTARTS=${MAX_RESTARTS:-3}
CONFIG=${CONFIG:-configs/digits.yaml}
ACCELERATOR=${ACCELERATOR:-auto}     # gpu on GPU nodes (NCCL), cpu for gloo

# torchrun's c10d rendezvous shares its TCPStore with every attempt's workers, without a per-attempt prefix: a
# restarted worker can read the address of a dead one and fail to connect (torch 2.13, gloo). Opt out of sharing.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

# c10d rendezvous: the restarted workers of every node meet again at the same endpoint.
exec torchrun \
    --nnodes="$NNODES" \
    --node-rank="$NODE_RANK" \
    --nproc-per-node="$NPROC_PER_NODE" \
    --max-restarts="$MAX_RESTARTS" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" \
    --rdzv-id="${RDZV_ID:-shardplus}" \
    -m lightning_shardplus.cli fit \
    --config "$CONFIG" \
    --config examples/launch/resumable.yaml \
    --trainer.accelerator="$ACCELERATOR" \
    --trainer.devices="$NPROC_PER_NODE" \
    --trainer.num_nodes="$NNODES" \
    --ckpt_path last \
    "$@"
