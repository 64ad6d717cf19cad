#!/bin/bash
# One GPU per rank: run COMMAND with CUDA_VISIBLE_DEVICES naming only the GPU of this rank's
# index on its node, so that CuPy's device 0 (the one hpcnn --device=gpu uses) is a GPU of its
# own. Put it between the launcher and the program:
#   mpiexec -n 8 jobs/gpu_bind.sh python -m mpi4py -m hpcnn train --device=gpu
# The local index is the launcher's: Slurm's SLURM_LOCALID, Open MPI's
# OMPI_COMM_WORLD_LOCAL_RANK, MPICH's and Intel MPI's MPI_LOCALRANKID, Cray PALS's
# PALS_LOCAL_RANKID. Where the scheduler has already given the rank exactly one GPU (Slurm's
# --gpus-per-task=1 binds each task to its GPU), that one is kept; where CUDA_VISIBLE_DEVICES
# lists the node's GPUs, the rank takes the entry at its index (modulo their number), else the
# GPU numbered by its index.
set -euo pipefail
local_rank="${SLURM_LOCALID:-${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-${PALS_LOCAL_RANKID:-}}}}"
if [ -z "${local_rank}" ]; then
    echo "jobs/gpu_bind.sh: no local rank from the launcher (SLURM_LOCALID," \
         "OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, PALS_LOCAL_RANKID)" >&2
    exit 2
fi
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    IFS=, read -r -a gpus <<< "${CUDA_VISIBLE_DEVICES}"
    export CUDA_VISIBLE_DEVICES="${gpus[local_rank % ${#gpus[@]}]}"
else
    export CUDA_VISIBLE_DEVICES="${local_rank}"
fi
exec "$@"
