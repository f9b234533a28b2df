#!/usr/bin/env bash
# Multi-node training with torchrun and the shardplus CLI: run this script once on every node.
#
#   node 0:  NODE_RANK=0 MASTER_ADDR=node0.example.com ./torchrun_multinode.sh
#   node 1:  NODE_RANK=1 MASTER_ADDR=node0.example.com ./torchrun_multinode.sh
#
# torchrun starts NPROC_PER_NODE processes on each node; Lightning's TorchElasticEnvironment reads the ranks and
# the world size from it. The Trainer must agree: --trainer.devices = processes per node and
# --trainer.num_nodes = nodes (shardplus stops with an error naming both numbers otherwise).
set -euo pipefail

NNODES=${NNODES:-2}                  # number of machines
NODE_RANK=${NODE_RANK:?set NODE_RANK to 0..NNODES-1 on each node}
NPROC_PER_NODE=${NPROC_PER_NODE:-1}  # processes per node: one per GPU (or a few on CPU)
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the address of node 0, reachable from every node}
MASTER_PORT=${MASTER_PORT:-29500}    # a free TCP port on node 0
CONFIG=${CONFIG:-configs/digits.yaml}
ACCELERATOR=${ACCELERATOR:-auto}     # gpu on GPU nodes (NCCL), cpu for gloo

# Static rendezvous on node 0. For elastic jobs use instead:
#   --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id=my-job
exec torchrun \
    --nnodes="$NNODES" \
    --node-rank="$NODE_RANK" \
    --nproc-per-node="$NPROC_PER_NODE" \
    --master-addr="$MASTER_ADDR" \
    --master-port="$MASTER_PORT" \
    -m lightning_shardplus.cli fit \
    --config "$CONFIG" \
    --trainer.accelerator="$ACCELERATOR" \
    --trainer.devices="$NPROC_PER_NODE" \
    --trainer.num_nodes="$NNODES" \
    "$@"
