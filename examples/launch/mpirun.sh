#!/usr/bin/env bash
# Training with mpirun (Open MPI) and the shardplus CLI, as Horovod users launch: one MPI rank per device.
#
#   ./mpirun.sh                                   # 2 processes on this machine
#   HOSTS=node0:4,node1:4 NP=8 NUM_NODES=2 DEVICES=4 ./mpirun.sh
#
# Needs Open MPI (apt-get install openmpi-bin) and mpi4py (pip install mpi4py) on every node: Lightning's
# MPIEnvironment detects the MPI job through mpi4py and takes ranks, world size and the rendezvous address
# from it; communication is still torch.distributed (NCCL/gloo), not MPI.
# NP must equal DEVICES x NUM_NODES (shardplus stops with an error naming both numbers otherwise).
set -euo pipefail

NP=${NP:-2}                      # total processes
NUM_NODES=${NUM_NODES:-1}
DEVICES=${DEVICES:-$((NP / NUM_NODES))}  # processes per node
HOSTS=${HOSTS:-localhost:$NP}    # host:slots,... (or use a hostfile: --hostfile hosts.txt)
CONFIG=${CONFIG:-configs/digits.yaml}
ACCELERATOR=${ACCELERATOR:-auto}

# --bind-to none: let PyTorch use the cores it wants (Open MPI binds each rank to one core by default).
# -x NAME: forward environment variables to the remote ranks.
# Running as root in a container? add --allow-run-as-root.
exec mpirun \
    -np "$NP" \
    --host "$HOSTS" \
    --bind-to none \
    -x PATH -x PYTHONPATH -x OMP_NUM_THREADS \
    python -m lightning_shardplus.cli fit \
    --config "$CONFIG" \
    --trainer.accelerator="$ACCELERATOR" \
    --trainer.devices="$DEVICES" \
    --trainer.num_nodes="$NUM_NODES" \
    "$@"
