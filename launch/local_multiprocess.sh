#!/usr/bin/env bash
# N CPU processes on this machine, one run: the multi-host path on a laptop or in tests.
#
#   launch/local_multiprocess.sh [--dry-run] [--processes N] [--devices D] [--port P] \
#       -- --config configs/tiny_arithmetic.yaml --out runs/mp [more jaxrl-scale train args]
#
# Each process gets D fake CPU devices (after the caller's XLA_FLAGS, which it keeps) and the coordinator address 127.0.0.1:P (bound there,
# nothing else), and runs the same `jaxrl-scale train` command; process 0 writes the logs.
# Ctrl-C stops every process. --dry-run prints the commands instead of running them.
set -euo pipefail

processes=2
devices=2
port=29500
dry_run=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --processes) processes="$2"; shift 2 ;;
    --devices) devices="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; break ;;
    *) echo "local_multiprocess.sh: unknown argument $1 (train arguments go after --)" >&2; exit 2 ;;
  esac
done
if [[ $# -eq 0 ]]; then
  echo "local_multiprocess.sh: give the jaxrl-scale train arguments after --" >&2
  exit 2
fi

pids=()
# shellcheck disable=SC2329  # invoked by the trap
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap cleanup INT TERM

for ((i = 0; i < processes; i++)); do
  env_vars=(
    "XLA_FLAGS=${XLA_FLAGS:+${XLA_FLAGS} }--xla_force_host_platform_device_count=${devices}"
    "JAX_PLATFORMS=cpu"
    "JAXRL_COORDINATOR=127.0.0.1:${port}"
    "JAXRL_NUM_PROCESSES=${processes}"
    "JAXRL_PROCESS_ID=${i}"
  )
  if [[ $dry_run -eq 1 ]]; then
    printf 'env'; printf ' %q' "${env_vars[@]}" jaxrl-scale train "$@"; echo
  else
    env "${env_vars[@]}" jaxrl-scale train "$@" &
    pids+=("$!")
  fi
done

status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=$?
done
exit "$status"
