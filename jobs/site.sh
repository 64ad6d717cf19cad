# The site's settings, sourced by every job script in jobs/ after it has moved to the project
# root: the one file to edit for a new cluster. It names no personal path.
#
# hpcnn must run on the site's MPI, with mpi4py built against it (docs/getting-started.md,
# "Installing against the site's MPI"): `module load <mpi> && MPICC=mpicc pip install
# --no-binary=mpi4py mpi4py`, then `pip install -e '.[data]'` (or '.[data,gpu]' on GPU nodes).
# Load here the same module that mpi4py was built with; `hpcnn info` (run first by the training
# jobs) prints the MPI library mpi4py is linked to.

# EDIT: the MPI module mpi4py was built against (and a CUDA module on GPU nodes).
# `module` is a shell function on most sites, some of whose versions read unset variables.
set +u
module load openmpi
set -u

# The environment with hpcnn installed: Slurm passes on the one active at sbatch; PBS does not
# (submit with `qsub -V`), or name it here: HPCNN_VENV=/path/to/venv in the job's environment.
if [ -n "${HPCNN_VENV:-}" ]; then
    source "${HPCNN_VENV}/bin/activate"
fi

# EDIT: the family of the site's mpiexec, which the PBS jobs call (srun needs no such choice):
# openmpi | mpich (MPICH's hydra) | cray (Cray PALS).
SITE_MPIEXEC=openmpi

# The site mpiexec's options that place PER_NODE ranks on each node and bind each rank to
# THREADS cores of its own (srun's equivalent: --ntasks-per-node, --cpus-per-task, --cpu-bind=cores).
bind_options() {    # PER_NODE THREADS
    case "${SITE_MPIEXEC}" in
        openmpi) echo "--map-by ppr:$1:node:PE=$2 --bind-to core" ;;
        mpich)   echo "-ppn $1 -bind-to core:$2" ;;
        cray)    echo "--ppn $1 --cpu-bind=depth --depth=$2" ;;
        *)       echo "jobs/site.sh: SITE_MPIEXEC=${SITE_MPIEXEC}: openmpi, mpich or cray" >&2
                 return 1 ;;
    esac
}

mkdir -p runs
