# Sourced by torch.sbatch and jax.sbatch after setting RECIPE: checks the job's parameters and sets
#   NNODES         nodes of the job (sbatch --nodes)
#   GPUS_PER_NODE  $GPUS_PER_NODE, else sbatch --gpus-per-node (SLURM_GPUS_PER_NODE, "8" or "h100:8")
#   HEAD_NODE      the job's first node (scontrol show hostnames), where the rendezvous listens
#   PORT           $PORT, else 20000 + job id mod 20000 (so two jobs sharing a first node differ)
#   RUN_DIR        shared storage every node writes (required; created), PYTHON (default python3)
# and puts the repository (REPO, default the submit directory) on PYTHONPATH. A missing or bad parameter ends the
# job before anything starts, with one line on stderr and exit status 2.

die() {
    echo "$RECIPE: error: $*" >&2
    exit 2
}

[[ -n ${SLURM_JOB_ID:-} && -n ${SLURM_JOB_NUM_NODES:-} && -n ${SLURM_JOB_NODELIST:-} ]] \
    || die "not inside a Slurm job (SLURM_JOB_ID / SLURM_JOB_NUM_NODES / SLURM_JOB_NODELIST unset): submit with sbatch"
[[ -n ${RUN_DIR:-} ]] \
    || die "set RUN_DIR to a folder on shared storage that every node can write (records and checkpoints go there)"
NNODES=$SLURM_JOB_NUM_NODES
gpus=${SLURM_GPUS_PER_NODE:-}
GPUS_PER_NODE=${GPUS_PER_NODE:-${gpus##*:}}
[[ $GPUS_PER_NODE =~ ^[1-9][0-9]*$ ]] \
    || die "GPUs per node ${GPUS_PER_NODE:+'$GPUS_PER_NODE' }unknown or not a positive integer:" \
        "submit with --gpus-per-node G (or set GPUS_PER_NODE=G)"
hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST") || die "scontrol show hostnames '$SLURM_JOB_NODELIST' failed"
HEAD_NODE=${hosts%%$'\n'*}
[[ -n $HEAD_NODE ]] || die "scontrol show hostnames '$SLURM_JOB_NODELIST' named no node"
PORT=${PORT:-$((20000 + SLURM_JOB_ID % 20000))}
[[ $PORT =~ ^[0-9]+$ ]] && ((PORT > 0 && PORT < 65536)) || die "PORT=$PORT is not a TCP port (1-65535)"
PYTHON=${PYTHON:-python3}
mkdir -p "$RUN_DIR" 2>/dev/null || die "cannot create RUN_DIR=$RUN_DIR"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

# refuse_flags FLAG... -- ARGS...: the user's arguments must not set the flags the recipe sets under RUN_DIR.
refuse_flags() {
    local -a own=()
    while [[ $1 != -- ]]; do own+=("$1"); shift; done
    shift
    local arg flag
    for arg in "$@"; do
        for flag in "${own[@]}"; do
            [[ $arg == "$flag" || $arg == "$flag="* ]] \
                && die "$flag is set by the recipe (under RUN_DIR=$RUN_DIR); leave it out"
        done
    done
    return 0
}
