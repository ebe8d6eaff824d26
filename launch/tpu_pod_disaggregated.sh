#!/usr/bin/env bash
# A run across hosts on one Cloud TPU VM slice: the trainer on some of its workers (one
# jax.distributed job), one generator group on each of the others (jobs of their own).
#
#   launch/tpu_pod_disaggregated.sh [--dry-run] [--keep] --name NAME --zone ZONE \
#       --trainer-workers 0,1 --generator-workers 2-3 [--type v4-32] [--version V] \
#       [--package 'git+https://...'] [--port P] [--trainer-env K=V]... \
#       [--generator-env K=V]... -- --config configs/X.yaml --out gs://bucket/runs/x
#
# Worker lists are indices of the slice's workers, comma-separated, ranges allowed (2-3).
# The slice is reused, or created when --type is given and it does not exist (and deleted on
# Ctrl-C unless --keep), as launch/tpu_pod.sh does; the package is installed on every worker.
# Trainer workers get JAXRL_ROLE=trainer and JAXRL_COORDINATOR (the first trainer worker's
# internal IP, port P) / JAXRL_NUM_PROCESSES / JAXRL_PROCESS_ID; generator workers
# JAXRL_ROLE=generator and JAXRL_GROUP=g (g counts from 0 in --generator-workers order). Every
# process gets JAXRL_HOST=its worker's internal IP and --set hosts.generator_groups=G --set
# hosts.hub=<first trainer worker's IP>:P+1 (batches on P+2). Waits for the trainers, then
# stops the generator workers' processes; exits with the trainers' status.
#
# On a slice of several workers, libtpu expects one program over every worker of the slice.
# A job on only some of them must be given its own TPU topology through libtpu's environment
# (TPU_PROCESS_BOUNDS, TPU_CHIPS_PER_PROCESS_BOUNDS, TPU_PROCESS_ADDRESSES, ...): pass it with
# --trainer-env / --generator-env ({i} in a value becomes the process's index within its
# role: CLOUD_TPU_TASK_ID={i}); the values depend on the TPU generation and on where the
# workers sit in the slice. This launcher sets none of them. docs/hosts.md has the details.
# --dry-run prints the gcloud commands (the workers' IPs as WORKER<n>_IP) and runs nothing.
set -euo pipefail

name=""
zone=""
accelerator=""
version="v2-alpha-tpuv5-lite"
package="jaxrl-scale[tpu]"
port=29500
trainer_spec=""
generator_spec=""
trainer_env=()
generator_env=()
dry_run=0
keep=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name="$2"; shift 2 ;;
    --zone) zone="$2"; shift 2 ;;
    --type) accelerator="$2"; shift 2 ;;
    --version) version="$2"; shift 2 ;;
    --package) package="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --trainer-workers) trainer_spec="$2"; shift 2 ;;
    --generator-workers) generator_spec="$2"; shift 2 ;;
    --trainer-env) trainer_env+=("$2"); shift 2 ;;
    --generator-env) generator_env+=("$2"); shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --keep) keep=1; shift ;;
    --) shift; break ;;
    *) echo "tpu_pod_disaggregated.sh: unknown argument $1 (train arguments go after --)" >&2; exit 2 ;;
  esac
done
if [[ -z "$name" || -z "$zone" || -z "$trainer_spec" || -z "$generator_spec" || $# -eq 0 ]]; then
  echo "tpu_pod_disaggregated.sh: need --name, --zone, --trainer-workers, --generator-workers" \
    "and train arguments after --" >&2
  exit 2
fi
for kv in "${trainer_env[@]}" "${generator_env[@]}"; do
  if ! [[ $kv =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; then
    echo "tpu_pod_disaggregated.sh: --trainer-env / --generator-env take KEY=VALUE, got $kv" >&2
    exit 2
  fi
done

# "0,2-3" -> "0 2 3"
workers() {
  local part parts out=()
  IFS=',' read -r -a parts <<<"$1"
  for part in "${parts[@]}"; do
    if [[ $part =~ ^([0-9]+)-([0-9]+)$ ]]; then
      for ((w = BASH_REMATCH[1]; w <= BASH_REMATCH[2]; w++)); do out+=("$w"); done
    elif [[ $part =~ ^[0-9]+$ ]]; then
      out+=("$part")
    else
      echo "tpu_pod_disaggregated.sh: bad worker list '$1' (e.g. 0,1 or 2-3)" >&2
      return 2
    fi
  done
  echo "${out[*]}"
}
trainer_list=$(workers "$trainer_spec")
generator_list=$(workers "$generator_spec")
read -r -a trainer_workers <<<"$trainer_list"
read -r -a generator_workers <<<"$generator_list"
if [[ ${#trainer_workers[@]} -eq 0 || ${#generator_workers[@]} -eq 0 ]]; then
  echo "tpu_pod_disaggregated.sh: --trainer-workers and --generator-workers may not be empty" >&2
  exit 2
fi
for t in "${trainer_workers[@]}"; do
  for g in "${generator_workers[@]}"; do
    if [[ $t -eq $g ]]; then
      echo "tpu_pod_disaggregated.sh: worker $t is both a trainer and a generator worker" >&2
      exit 2
    fi
  done
done

run() {
  if [[ $dry_run -eq 1 ]]; then
    printf '%q ' "$@"
    echo
  else
    "$@"
  fi
}

pids=()
start() {  # run in the background, remembering the pid
  if [[ $dry_run -eq 1 ]]; then
    run "$@"
  else
    "$@" &
    pids+=("$!")
  fi
}

created=0
if [[ -n "$accelerator" ]]; then
  if [[ $dry_run -eq 1 ]] || ! gcloud compute tpus tpu-vm describe "$name" --zone "$zone" >/dev/null 2>&1; then
    run gcloud compute tpus tpu-vm create "$name" --zone "$zone" \
      --accelerator-type "$accelerator" --version "$version"
    created=1
  fi
fi

# The workers' internal IPs, in worker order.
describe=(gcloud compute tpus tpu-vm describe "$name" --zone "$zone"
  --format='value(networkEndpoints[].ipAddress)')
ips=()
if [[ $dry_run -eq 1 ]]; then
  run "${describe[@]}"
  for w in "${trainer_workers[@]}" "${generator_workers[@]}"; do ips[w]="WORKER${w}_IP"; done
else
  raw=$("${describe[@]}")
  read -r -a ips <<<"${raw//[;,]/ }"
  for w in "${trainer_workers[@]}" "${generator_workers[@]}"; do
    if [[ -z "${ips[w]:-}" ]]; then
      echo "tpu_pod_disaggregated.sh: slice $name has no worker $w (it has ${#ips[@]})" >&2
      exit 2
    fi
  done
fi
first=${ips[${trainer_workers[0]}]}
groups=${#generator_workers[@]}
hosts=(--set "hosts.generator_groups=${groups}" --set "hosts.hub=${first}:$((port + 1))")

# shellcheck disable=SC2329  # invoked by the trap
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  run gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all \
    --command "pkill -f 'jaxrl-scale train' || true"
  if [[ $created -eq 1 && $keep -eq 0 ]]; then
    run gcloud compute tpus tpu-vm delete "$name" --zone "$zone" --quiet
  fi
}
trap cleanup INT TERM

run gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all \
  --command "pip install --quiet '${package}'"

for i in "${!trainer_workers[@]}"; do
  w=${trainer_workers[i]}
  env_vars=(
    "JAXRL_ROLE=trainer"
    "JAXRL_COORDINATOR=${first}:${port}"
    "JAXRL_NUM_PROCESSES=${#trainer_workers[@]}"
    "JAXRL_PROCESS_ID=${i}"
    "JAXRL_HOST=${ips[w]}"
    "${trainer_env[@]//\{i\}/$i}"
  )
  command=$(printf '%q ' env "${env_vars[@]}" jaxrl-scale train "$@" "${hosts[@]}")
  start gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker="$w" --command "$command"
done
trainer_pids=("${pids[@]}")
for g in "${!generator_workers[@]}"; do
  w=${generator_workers[g]}
  env_vars=(
    "JAXRL_ROLE=generator"
    "JAXRL_GROUP=${g}"
    "JAXRL_HOST=${ips[w]}"
    "${generator_env[@]//\{i\}/$g}"
  )
  command=$(printf '%q ' env "${env_vars[@]}" jaxrl-scale train "$@" "${hosts[@]}")
  start gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker="$w" --command "$command"
done
[[ $dry_run -eq 1 ]] && exit 0

status=0
for pid in "${trainer_pids[@]}"; do
  wait "$pid" || status=$?
done
# The hub tells the generators to stop; give them a moment, then stop what is left.
sleep 10
gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker="${generator_list// /,}" \
  --command "pkill -f 'jaxrl-scale train' || true" || true
for pid in "${pids[@]:${#trainer_pids[@]}}"; do
  wait "$pid" 2>/dev/null || true
done
exit "$status"
