#!/usr/bin/env bash
# The GPU measurements the issues name, as one prepared run on a lent device (see
# docs/benchmarks.md). Wheels the device image lacks are carried in .whl/ (git-ignored) and
# installed beside the image's jax; each benchmark has its own time limit and log in $OUT.
set -u
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
if [ -d .whl ]; then
    pip install -q --no-deps --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1
fi
export PYTHONPATH="/tmp/site:$PWD"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
{ date -u; nvidia-smi --query-gpu=name,memory.total --format=csv; python -c 'import jax; print(jax.__version__, jax.devices())'; } > "$OUT/machine.txt" 2>&1
run() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" python "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? ${SECONDS}s-$start" >> "$OUT/summary.txt"
}
# bench_serve measures the HTTP server in its own process and on a thread, so runs twice.
run serve_large 200 benchmarks/bench_serve.py --hidden 1024 --layers 16 --new 192 --repeats 2
run serve_small 150 benchmarks/bench_serve.py --repeats 2
run model_05b 120 benchmarks/bench_model.py --qwen05b --repeats 5
run agents 100 benchmarks/bench_agents.py --steps 4
grep -h -E "^median|^-- |http layer|tok/s|MFU" "$OUT"/*.log | tail -n 40
