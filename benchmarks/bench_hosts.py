"""Runs across hosts, on this machine: the weight sync between processes, and the throughput of
generator jobs against colocated lockstep.

    python benchmarks/bench_hosts.py [--part sync|engine|groups|run|all] [--hidden 512 --layers 8]
    python benchmarks/bench_hosts.py --part sync --qwen05b     # Qwen2.5-0.5B's shape

sync: a server process (2 CPU devices, the model's parameters fsdp-sharded) publishes a version
in the generator's dtype (bf16); this process (2 other devices) pulls it over
jax.experimental.transfer, `--repeats` times. Prints bytes/s and the ratio of the pull's time to
a local device-to-device copy of the same bytes in one process (`jax.device_put` onto other
devices), measured here too.

engine: 1 trainer process + 2 generator groups on the RL workload below, with completions
of heavy-tailed length (the random policy's own EOS, one token of 32: geometric lengths, mean
about 30, cut at 96), decoded by the groups in static waves and on the slot engine
(`sampler.batching`). Prints samples/s of each over steps after the second, their ratio, the
groups' slot occupancy and the trainer's idle fraction.

groups: 1 trainer process and 1, 2 or 3 generator groups (the slot engine, max_new_tokens 96):
samples/s and the trainer's idle fraction for each.

run: the same RL workload (tiny arithmetic, 12 prompts x 4, 16 steps, k = 4) as 1 trainer
process + 2 generator groups (launch/local_disaggregated.sh) and as 3 colocated processes in
lockstep (launch/local_multiprocess.sh), each process with 2 CPU devices. Prints samples/s of
each over steps after the second (compilation excluded), their ratio, and the fraction of the
trainer's time spent waiting for batches. On a 2-core machine the processes share the cores:
the ratio says what overlap buys when generation and training compete for the same CPUs, not
what separate hosts give.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "tiny_arithmetic.yaml"
QWEN05B = ROOT / "configs" / "scalerl_qwen2.5-0.5b_math.yaml"


def _model_cfg(args):
    from jaxrl_scale.config import load_config

    if args.qwen05b:
        return load_config(QWEN05B, ["model.dtype=bfloat16"]).model
    sets = [f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}",
            f"model.intermediate_size={args.hidden * 3}", "model.vocab_size=32000",
            "model.dtype=bfloat16"]  # fmt: skip
    return load_config(CONFIG, sets).model


def serve(args) -> None:
    """The trainer's side: publish version 0 and offer it on request until killed."""
    import jax
    from flax import nnx

    from jaxrl_scale.config import MeshConfig
    from jaxrl_scale.hosts.weights import WeightServer
    from jaxrl_scale.models.policy import Policy
    from jaxrl_scale.parallel import sharding

    cfg = _model_cfg(args)
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=2, tensor=1), jax.devices()[:2])
    model = sharding.init_sharded(lambda rngs: Policy(cfg, rngs=rngs), mesh, 0)
    server = WeightServer(mesh, cfg, 2, host="127.0.0.1", timeout=600)
    server.publish(0, nnx.split(model)[1])
    Path(args.serve).write_text(json.dumps(server.address))
    while True:
        time.sleep(1)


def sync(args) -> None:
    import jax
    from flax import nnx

    from jaxrl_scale.config import MeshConfig
    from jaxrl_scale.hosts.weights import WeightClient
    from jaxrl_scale.models.policy import Policy, for_generation
    from jaxrl_scale.parallel import sharding

    cfg = _model_cfg(args)
    with tempfile.TemporaryDirectory() as tmp:
        address_file = Path(tmp) / "address.json"
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
               "JAX_PLATFORMS": "cpu"}  # fmt: skip
        cmd = [sys.executable, __file__, "--serve", str(address_file)]
        cmd += ["--hidden", str(args.hidden), "--layers", str(args.layers)]
        cmd += ["--qwen05b"] if args.qwen05b else []
        server = subprocess.Popen(cmd, env=env)
        try:
            deadline = time.monotonic() + 600
            while not address_file.exists():
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the weight server process did not start")
                time.sleep(0.2)
            time.sleep(0.2)
            address = json.loads(address_file.read_text())
            gen_mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=1, tensor=1), jax.devices()[2:4])
            abstract = jax.eval_shape(
                lambda: for_generation(
                    nnx.split(Policy(cfg, rngs=nnx.Rngs(params=0)))[1], cfg, copy=False
                )
            )
            client = WeightClient(abstract, sharding.state_shardings(abstract, gen_mesh),
                                  gen_mesh, host="127.0.0.1", timeout=600)  # fmt: skip
            client.connect([address])
            pulled = jax.block_until_ready(client.pull(0))  # connect, compile the re-layout
            nbytes = sum(x.nbytes for x in jax.tree.leaves(pulled))
            # The same bytes copied device to device inside one process.
            here = jax.device_put(pulled, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
            jax.block_until_ready(jax.device_put(here, jax.devices()[1]))
            pulls, copies = [], []
            for _ in range(args.repeats):  # interleaved: the VM's drift hits both
                start = time.perf_counter()
                pulled = jax.block_until_ready(client.pull(0))
                pulls.append(time.perf_counter() - start)
                start = time.perf_counter()
                jax.block_until_ready(jax.device_put(here, jax.devices()[1]))
                copies.append(time.perf_counter() - start)
            pull_s, local_s = float(np.median(pulls)), float(np.median(copies))
            client.close()
        finally:
            server.kill()
            server.wait()
    print(f"weight sync: {nbytes / 2**20:.1f} MiB ({len(jax.tree.leaves(pulled))} leaves, "
          f"{sorted({str(x.dtype) for x in jax.tree.leaves(pulled)})})")  # fmt: skip
    for name, seconds in (("pull between processes", pull_s), ("local device copy", local_s)):
        print(f"  {name:<24}{seconds * 1e3:8.1f} ms  ({nbytes / seconds / 2**30:.2f} GiB/s)")
    print(f"  pull / local copy: {pull_s / local_s:.2f}x the time (medians of {args.repeats}; "
          f"1 trainer process: {nbytes / pull_s / 2**30:.2f} GiB/s from it)")  # fmt: skip


WORKLOAD = ["model.hidden_size=64", "model.intermediate_size=192", "task.num_train=512",
            "task.num_eval=12", "train.prompts_per_step=12", "train.group_size=4",
            "train.eval_every=0", "train.eval_samples=2", "warm_start.steps=0",
            "checkpoint.every=0", "forecast.every=0", "mesh.data=-1",
            "sampler.batching=static"]  # fmt: skip


def _run(kind: str, out: Path, steps: int, k: int, *extra: str, groups: int = 2) -> list[dict]:
    sets = [*WORKLOAD, f"train.steps={steps}", f"pipeline.max_staleness={k}", *extra]
    train_args = ["--config", str(CONFIG), "--out", str(out)]
    for s in sets:
        train_args += ["--set", s]
    port = str(29900 + (os.getpid() % 50) * 10)
    if kind == "disaggregated":
        cmd = ["bash", str(ROOT / "launch/local_disaggregated.sh"), "--port", port, "1",
               str(groups)]  # fmt: skip
    else:
        cmd = ["bash", str(ROOT / "launch/local_multiprocess.sh"), "--port", port,
               "--processes", "3"]  # fmt: skip
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run([*cmd, "--", *train_args], env=env, capture_output=True, text=True,
                          timeout=1800)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{kind} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _samples_per_s(rows: list[dict], rows_per_step: int, devices: int) -> float:
    """Samples/s over the steps after the second (the first two compile)."""
    timed = rows[2:]
    wall = (timed[-1]["device_seconds"] - rows[1]["device_seconds"]) / devices
    return len(timed) * rows_per_step / wall


def engine(args) -> None:
    heavy = [
        "sampler.max_new_tokens=384",
        "sampler.chunk_size=8",
        "sampler.admit_every=8",
        "train.packing=true",
    ]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for batching in ("static", "continuous"):
            rows = _run("disaggregated", Path(tmp) / batching, args.steps, 8, *heavy,
                        f"sampler.batching={batching}")  # fmt: skip
            rows = [r for r in rows if r["step"] > 0]
            results[batching] = (
                _samples_per_s(rows, 12 * 4, 6),
                np.mean([r.get("slot_occupancy", np.nan) for r in rows[2:]]),
                np.mean([r["trainer_idle_fraction"] for r in rows[2:]]),
                np.mean([r["gen_length_mean"] for r in rows[2:]]),
            )
    for batching, (sps, occupancy, idle, length) in results.items():
        print(f"{batching:>11}: {sps:8.1f} samples/s  mean length {length:5.1f}  slot "
              f"occupancy {occupancy:.0%}  trainer waiting {idle:.0%}")  # fmt: skip
    ratio = results["continuous"][0] / results["static"][0]
    print(f"generator groups on the slot engine / in static waves: {ratio:.2f}x samples/s")


def groups(args) -> None:
    """samples/s of 1 trainer process against the number of generator groups (1, 2, 3)."""
    heavy = ["sampler.max_new_tokens=96", "sampler.batching=continuous"]
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1, 2, 3):
            rows = _run("disaggregated", Path(tmp) / f"g{n}", args.steps, 4, *heavy, groups=n)
            rows = [r for r in rows if r["step"] > 0]
            sps = _samples_per_s(rows, 12 * 4, 2 + 2 * n)
            idle = np.mean([r["trainer_idle_fraction"] for r in rows[2:]])
            print(f"{n} group(s): {sps:8.1f} samples/s  trainer waiting {idle:.0%}")


def run(args) -> None:
    rows_per_step = 12 * 4
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("disaggregated", "colocated"):
            rows = [r for r in _run(kind, Path(tmp) / kind, args.steps, 4) if r["step"] > 0]
            timed = rows[2:]  # the first two steps compile
            devices = 6  # 3 processes x 2 devices either way
            wall = (timed[-1]["device_seconds"] - rows[1]["device_seconds"]) / devices
            idle = sum(r["trainer_idle_fraction"] for r in timed) / len(timed)
            results[kind] = (len(timed) * rows_per_step / wall, idle,
                             max(r["staleness_max"] for r in rows))  # fmt: skip
    for kind, (sps, idle, stale) in results.items():
        print(f"{kind:>14}: {sps:8.1f} samples/s  trainer waiting {idle:.0%} of its time  "
              f"staleness_max {stale}")  # fmt: skip
    ratio = results["disaggregated"][0] / results["colocated"][0]
    print(f"disaggregated / colocated lockstep: {ratio:.2f}x samples/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("sync", "engine", "groups", "run", "all"),
                        default="all")  # fmt: skip
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--qwen05b", action="store_true")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args)
    if args.part in ("sync", "all"):
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        sync(args)
    if args.part in ("engine", "all"):
        engine(args)
    if args.part in ("groups", "all"):
        groups(args)
    if args.part in ("run", "all"):
        run(args)


if __name__ == "__main__":
    main()
