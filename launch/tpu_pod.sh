#!/usr/bin/env bash
# A Cloud TPU VM slice: create it (or reuse it), install the package on every worker, run the
# same `jaxrl-scale train` on all workers, stream their logs; Ctrl-C stops the workers (and
# deletes the slice if this script created it and --keep was not given).
#
#   launch/tpu_pod.sh [--dry-run] [--keep] --name NAME --zone ZONE --type v5litepod-16 \
#       [--version v2-alpha-tpuv5-lite] [--package 'git+https://...'] \
#       -- --config configs/X.yaml --out gs://bucket/runs/x
#
# jax.distributed detects the slice's workers by itself. --dry-run prints the gcloud commands.
set -euo pipefail

name=""
zone=""
accelerator=""
version="v2-alpha-tpuv5-lite"
package="jaxrl-scale[tpu]"
dry_run=0
keep=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name="$2"; shift 2 ;;
    --zone) zone="$2"; shift 2 ;;
    --type) accelerator="$2"; shift 2 ;;
    --version) version="$2"; shift 2 ;;
    --package) package="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --keep) keep=1; shift ;;
    --) shift; break ;;
    *) echo "tpu_pod.sh: unknown argument $1 (train arguments go after --)" >&2; exit 2 ;;
  esac
done
if [[ -z "$name" || -z "$zone" || -z "$accelerator" || $# -eq 0 ]]; then
  echo "tpu_pod.sh: need --name, --zone, --type and train arguments after --" >&2
  exit 2
fi

run() {
  if [[ $dry_run -eq 1 ]]; then
    printf '%q ' "$@"
    echo
  else
    "$@"
  fi
}

train_args=$(printf '%q ' "$@")
created=0
if [[ $dry_run -eq 1 ]] || ! gcloud compute tpus tpu-vm describe "$name" --zone "$zone" >/dev/null 2>&1; then
  run gcloud compute tpus tpu-vm create "$name" --zone "$zone" \
    --accelerator-type "$accelerator" --version "$version"
  created=1
fi

# shellcheck disable=SC2329  # invoked by the trap
cleanup() {
  run gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all \
    --command "pkill -f 'jaxrl-scale train' || true"
  if [[ $created -eq 1 && $keep -eq 0 ]]; then
    run gcloud compute tpus tpu-vm delete "$name" --zone "$zone" --quiet
  fi
}
trap cleanup INT TERM

run gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all \
  --command "pip install --quiet '${package}'"
run gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all \
  --command "jaxrl-scale train ${train_args}"
