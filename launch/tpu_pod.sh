#!/usr/bin/env bash
# Training on a Cloud TPU pod slice: the same command on every TPU VM worker at once, one
# process per VM (all of its chips). JAX_DISTRIBUTED_AUTO=1 makes trainer/parallel/distributed.py
# call jax.distributed.initialize() without arguments: JAX reads the worker id, the worker count
# and the coordinator (worker 0) from the TPU metadata server.
#
#   launch/tpu_pod.sh TPU_NAME ZONE [--config configs/1b.yaml] [section.key=value ...]
#
# Knobs (environment):
#   PROJECT   gcloud project (default: gcloud's configured one)
#   REPO_DIR  where the project is checked out and installed on every VM (default: accel-trainer,
#             relative to the home directory)
#   PYTHON    interpreter on the VMs with the project installed (default: python3)
# Put run.workdir and data.path on storage every worker mounts at the same path (an NFS share
# such as Filestore, or a bucket mounted with gcsfuse): they are local paths, not gs:// URLs.
# When one worker dies the others exit non-zero within seconds; run the script again to resume
# from the latest checkpoint. Only starts processes: install the project on the VMs beforehand.
set -euo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: launch/tpu_pod.sh TPU_NAME ZONE [--config FILE] [section.key=value ...]" >&2
  exit 2
fi
if ! command -v gcloud >/dev/null; then
  echo "tpu_pod.sh: gcloud is not a command here; install the Google Cloud CLI and log in" \
    "(gcloud auth login)" >&2
  exit 2
fi
tpu=$1
zone=$2
shift 2
remote="cd ${REPO_DIR:-accel-trainer} && JAX_DISTRIBUTED_AUTO=1 ${PYTHON:-python3} -m trainer.main"
if [[ $# -gt 0 ]]; then
  remote+=" $(printf '%q ' "$@")"
fi
exec gcloud compute tpus tpu-vm ssh "$tpu" --zone="$zone" ${PROJECT:+--project="$PROJECT"} \
  --worker=all --command="$remote"
