#!/bin/sh
# A job's own preloader: started by the job's launch script before torchrun, stopped at its end.
# Every rank (and every restart) started with WARMSTART=1 in this environment forks from it.
#
#   server/preload-job.sh torchrun --nproc-per-node 8 train.py ...
#
# The preloader takes the job's environment as it is here: export what the ranks need first.
set -eu
export WARMSTART=1
warmstart preload start >&2
trap 'warmstart preload stop >&2' EXIT INT TERM
"$@"
