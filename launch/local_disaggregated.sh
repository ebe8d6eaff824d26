#!/usr/bin/env bash
# A run across hosts, on this machine: TRAINERS trainer processes (one jax.distributed job) and
# GENERATOR_GROUPS generator groups (jobs of their own, of --group-processes N processes
# each, 1 by default), all on 127.0.0.1.
#
#   launch/local_disaggregated.sh [--dry-run] [--devices D] [--generator-devices D] \
#       [--group-processes N] [--port P] \
#       TRAINERS GENERATOR_GROUPS -- --config configs/tiny_arithmetic.yaml --out runs/dis [...]
#
# Each process gets D fake CPU devices (after the caller's XLA_FLAGS, which it keeps).
# Trainers: the coordinator at 127.0.0.1:P (when there are several), the hub at 127.0.0.1:P+1
# (and P+2 for batches). Generators: JAXRL_ROLE=generator, JAXRL_GROUP=g; a group of several
# processes is a jax.distributed job with its coordinator at 127.0.0.1:P+10+g (its mesh,
# hosts.generator_mesh, spans N x D devices). Waits for the trainers, stops what is left of the
# generators, and exits with the trainers' status. Ctrl-C stops every process. --dry-run prints
# the commands.
set -euo pipefail

devices=2
generator_devices=2
group_processes=1
port=29500
dry_run=0
positional=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --devices) devices="$2"; shift 2 ;;
    --generator-devices) generator_devices="$2"; shift 2 ;;
    --group-processes) group_processes="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; break ;;
    -*) echo "local_disaggregated.sh: unknown option $1" >&2; exit 2 ;;
    *) positional+=("$1"); shift ;;
  esac
done
if [[ ${#positional[@]} -ne 2 || $# -eq 0 ]]; then
  echo "usage: local_disaggregated.sh [options] TRAINERS GENERATOR_GROUPS -- <train arguments>" >&2
  exit 2
fi
trainers=${positional[0]}
groups=${positional[1]}
if ! [[ $trainers =~ ^[1-9][0-9]*$ && $groups =~ ^[1-9][0-9]*$ ]]; then
  echo "local_disaggregated.sh: TRAINERS and GENERATOR_GROUPS must be positive integers" >&2
  exit 2
fi
if ! [[ $group_processes =~ ^[1-9][0-9]*$ ]]; then
  echo "local_disaggregated.sh: --group-processes must be a positive integer" >&2
  exit 2
fi
hosts=(--set "hosts.generator_groups=${groups}" --set "hosts.hub=127.0.0.1:$((port + 1))")

trainer_pids=()
generator_pids=()
# shellcheck disable=SC2329  # invoked by the trap
cleanup() {
  for pid in "${trainer_pids[@]}" "${generator_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap cleanup INT TERM

# A jax.distributed job's variables for process $3 of $2, coordinator at 127.0.0.1:$1.
job() {
  env_vars+=("JAXRL_COORDINATOR=127.0.0.1:$1" "JAXRL_NUM_PROCESSES=$2" "JAXRL_PROCESS_ID=$3")
}

run() {
  if [[ $dry_run -eq 1 ]]; then
    printf 'env'; printf ' %q' "$@"; echo
  else
    env "$@" &
  fi
}

for ((i = 0; i < trainers; i++)); do
  env_vars=(
    "XLA_FLAGS=${XLA_FLAGS:+${XLA_FLAGS} }--xla_force_host_platform_device_count=${devices}"
    "JAX_PLATFORMS=cpu"
    "JAXRL_ROLE=trainer"
    "JAXRL_HOST=127.0.0.1"
  )
  if [[ $trainers -gt 1 ]]; then job "$port" "$trainers" "$i"; fi
  run "${env_vars[@]}" jaxrl-scale train "$@" "${hosts[@]}"
  if [[ $dry_run -eq 0 ]]; then trainer_pids+=("$!"); fi
done
for ((g = 0; g < groups; g++)); do
  for ((j = 0; j < group_processes; j++)); do
    env_vars=(
      "XLA_FLAGS=${XLA_FLAGS:+${XLA_FLAGS} }--xla_force_host_platform_device_count=${generator_devices}"
      "JAX_PLATFORMS=cpu"
      "JAXRL_ROLE=generator"
      "JAXRL_GROUP=${g}"
      "JAXRL_HOST=127.0.0.1"
    )
    if [[ $group_processes -gt 1 ]]; then job $((port + 10 + g)) "$group_processes" "$j"; fi
    run "${env_vars[@]}" jaxrl-scale train "$@" "${hosts[@]}"
    if [[ $dry_run -eq 0 ]]; then generator_pids+=("$!"); fi
  done
done
[[ $dry_run -eq 1 ]] && exit 0

status=0
for pid in "${trainer_pids[@]}"; do
  wait "$pid" || status=$?
done
# The hub tells generators to stop; give them a moment, then make sure (SIGKILL: a SIGTERM
# would drain a group, which finishes the work it holds first).
for pid in "${generator_pids[@]}"; do
  for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
done
exit "$status"
