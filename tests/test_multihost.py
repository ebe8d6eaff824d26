"""Several processes in one run through jax.distributed: CPU processes on 127.0.0.1, gloo
collectives, each process with 2 devices."""

import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import FAST, TINY_CONFIG, xla_flags

from jaxrl_scale.config import load_config
from jaxrl_scale.fit.curves import sigmoid
from jaxrl_scale.rl.metrics import read_metrics
from jaxrl_scale.train import setup, train, train_run

TINY = TINY_CONFIG
# The fast settings over the whole mesh (all processes' devices), deterministic mode.
SETTINGS = [o for o in FAST if not o.startswith(("mesh.", "train.steps="))] + [
    "pipeline.mode=sync",
    "forecast.every=0",
    "mesh.data=-1",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_cmd(out, steps):
    cmd = [sys.executable, "-m", "jaxrl_scale.cli", "train", "--config", str(TINY)]
    cmd += ["--out", str(out), "--set", f"train.steps={steps}"]
    for s in SETTINGS:
        cmd += ["--set", s]
    return cmd


def _env(devices, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXRL_")}
    env["XLA_FLAGS"] = xla_flags(devices)
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra)
    return env


def _launch(out, steps, n=2, port=None, heartbeat=100, extra=()):
    port = port or _free_port()
    procs = []
    for i in range(n):
        env = _env(
            2,
            JAXRL_COORDINATOR=f"127.0.0.1:{port}",
            JAXRL_NUM_PROCESSES=str(n),
            JAXRL_PROCESS_ID=str(i),
        )
        cmd = _train_cmd(out, steps) + ["--set", f"distributed.heartbeat_timeout={heartbeat}"]
        for e in extra:
            cmd += ["--set", e]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return procs


def _params(run_dir):
    cfg = load_config(TINY, [*SETTINGS, "train.steps=3"])
    return [np.asarray(x) for x in jax.tree.leaves(setup(cfg, run_dir).start.train.params)]


def test_two_processes_match_one_process_with_as_many_devices(tmp_path):
    # Packed batches: every process packs the whole host batch (the same rows, in the same
    # order) and places the rows its devices hold, so the run equals one 4-device process
    # packing the same batch. (The unpacked step across processes: the pipeline_rl test.)
    procs = _launch(tmp_path / "two", steps=3, extra=["train.packing=true"])
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    cmd = _train_cmd(tmp_path / "one", 3) + ["--set", "train.packing=true"]
    single = subprocess.run(cmd, env=_env(4), capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    # Process 0 alone wrote the metrics; they agree with the single process's.
    two, one = read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")
    assert [r["step"] for r in two] == [0, 1, 2, 3]
    for a, b in zip(two, one, strict=True):
        for key in ("reward_mean", "eval_pass_rate", "loss", "grad_norm", "kept_tokens"):
            if key in b:
                assert a[key] == pytest.approx(b[key], abs=1e-6), key
    for a, b in zip(two[1:], one[1:], strict=True):
        assert a["train_packed"] == 1 and a["train_positions"] == b["train_positions"]
    for a, b in zip(_params(tmp_path / "two"), _params(tmp_path / "one"), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    # The 2-process checkpoint restores here (8 devices, one process), resharded, and goes on.
    cfg = load_config(TINY, [*SETTINGS, "train.steps=5", "train.packing=true"])
    run = setup(cfg, tmp_path / "two")
    assert run.start.step == 3
    rows = train_run(run)
    assert [r["step"] for r in rows] == [4, 5]
    assert [r["step"] for r in read_metrics(tmp_path / "two")] == [0, 1, 2, 3, 4, 5]


def test_a_dead_process_makes_the_others_exit_with_an_error(tmp_path):
    procs = _launch(tmp_path / "run", steps=10_000, heartbeat=5)
    time.sleep(1.0)
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "run" / "metrics.jsonl").exists():
        time.sleep(0.5)
    procs[1].kill()  # process 1 dies mid-run
    try:
        out = procs[0].communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        procs[0].kill()
        pytest.fail("process 0 hung after process 1 died")
    assert procs[0].returncode != 0
    assert "another task died" in out or "stopped sending heartbeats" in out, out[-2000:]


def _run_two(out, steps, *extra, timeout=300, out1=None):
    """Two processes of one run (process 1 with `out1` as its run directory when given); both
    are killed and the test fails if they are not done within `timeout` seconds."""
    port = _free_port()
    procs = []
    for i in range(2):
        env = _env(
            2,
            JAXRL_COORDINATOR=f"127.0.0.1:{port}",
            JAXRL_NUM_PROCESSES="2",
            JAXRL_PROCESS_ID=str(i),
        )
        cmd = _train_cmd(out1 if i == 1 and out1 is not None else out, steps)
        for e in extra:
            cmd += ["--set", e]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    deadline = time.monotonic() + timeout
    try:
        outs = [p.communicate(timeout=max(deadline - time.monotonic(), 0.1))[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate()[0] for p in procs]
        pytest.fail(f"not done within {timeout} s:\n" + "\n".join(o[-3000:] for o in outs))
    return [p.returncode for p in procs], outs


PIPELINE = ["pipeline.mode=pipeline_rl", "pipeline.generator_devices=2", "sampler.chunk_size=2"]


def test_pipeline_rl_across_processes_splits_generator_and_trainer_devices(tmp_path):
    # Each process gives one of its two devices to the generator: the weights cross from the
    # trainer's devices to the generator's after every step, and both processes issue the same
    # programs in the same order (lockstep), so the run equals one 4-device process in lockstep.
    codes, outs = _run_two(tmp_path / "two", 4, *PIPELINE)
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    cmd = _train_cmd(tmp_path / "one", 4)
    for e in [*PIPELINE, "pipeline.lockstep=true"]:
        cmd += ["--set", e]
    single = subprocess.run(cmd, env=_env(4), capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    two, one = read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")
    assert [r["step"] for r in two] == [0, 1, 2, 3, 4]
    assert [r["staleness_max"] for r in two] == [0, 0, 1, 1, 1]  # one batch ahead, in flight
    # k = 8 configured: the run says it runs as 1, and why.
    assert "max_staleness: 8 runs as 1 here: the run spans processes" in outs[0], outs[0][-3000:]
    for a, b in zip(two, one, strict=True):
        for key in ("reward_mean", "eval_pass_rate", "loss", "staleness_mean"):
            if key in b:
                assert a[key] == pytest.approx(b[key], abs=1e-6), key
    assert two[-1]["policy_version"] == one[-1]["policy_version"] == 4
    for a, b in zip(_params(tmp_path / "two"), _params(tmp_path / "one"), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_a_generator_split_that_leaves_a_process_without_trainer_devices_is_refused(tmp_path):
    codes, outs = _run_two(tmp_path / "run", 3, *PIPELINE[:1], "pipeline.generator_devices=3")
    assert codes == [2, 2]
    assert all("same number of devices from each of the 2 processes" in o for o in outs), outs


def test_a_resumed_run_stops_early_on_every_process_at_the_same_step(tmp_path):
    """On resume, process 0 alone replays the eval curve from the metrics log (which it alone
    keeps, and has just cut back to the checkpoint) and decides the forecast's early stop for
    every process. Process 1 here has a run directory of its own that shares only the
    checkpoints: its copy of the log still holds the rows a killed run wrote after its last
    checkpoint, with which the forecast would go on. Deciding from that copy, process 1 would
    enter step 10's collectives while process 0 stopped after step 9, and both would wait."""
    run, host1 = tmp_path / "run", tmp_path / "host1"
    train(load_config(TINY, [*SETTINGS, "train.steps=8", "train.eval_every=8"]), run)
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(9))  # and a checkpoint at step 8
    # The log's eval curve becomes a clean sigmoid past its inflection, at compute far beyond
    # this tiny run's: the first fit after the resume is identifiable with little gain left
    # (the resumed run's own evaluation, near compute 0, falls below forecast.c_min_fraction's
    # cut). The killed run's later rows climb on: fitted with them, gain is left (> 0.1).
    for r in rows:
        r["compute_flops"] = r["step"] * 1e12
        r["eval_pass_rate"] = float(sigmoid(r["compute_flops"], 0.6, 3.0, 2.5e12, 0.1))
    rows[0]["eval_pass_rate"] = 0.1  # R0
    killed = [
        {"step": s, "compute_flops": s * 1e12, "eval_pass_rate": 0.6 + 0.08 * (s - 8)}
        for s in range(9, 15)
    ]
    log = "".join(json.dumps(r) + "\n" for r in rows + killed)
    (run / "metrics.jsonl").write_text(log)
    host1.mkdir()
    (host1 / "metrics.jsonl").write_text(log)
    (host1 / "checkpoints").symlink_to(run / "checkpoints")
    forecast = ["forecast.every=1", "forecast.bootstrap=10", "forecast.stop_when_gain_below=0.05"]
    codes, outs = _run_two(run, 20, "train.eval_every=1", *forecast, out1=host1, timeout=150)
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "forecast.stop_when_gain_below = 0.05; stopping" in outs[0], outs[0][-3000:]
    after = read_metrics(run)
    assert [r["step"] for r in after] == list(range(10))  # the killed run's rows cut
    assert after[:9] == rows
    assert after[9]["forecast_status"] == "ok" and after[9]["forecast_gain_left_hi"] < 0.05
    assert after[9]["forecast_left_out"] == 1  # the resumed run's own evaluation
    # Both processes saved the last checkpoint together where they stopped.
    saved = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert saved[-1] == 9
    assert (host1 / "metrics.jsonl").read_text() == log  # process 1 writes no log


TRANSFER = """
import os, sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxrl_scale.parallel import distributed
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
devices = {p: [d for d in jax.devices() if d.process_index == p] for p in (0, 1)}
train = Mesh(np.array(devices[0][:2] + devices[1][:2]).reshape(4, 1), ("fsdp", "expert"))
gen = Mesh(np.array(devices[0][2:] + devices[1][2:]).reshape(2, 2), ("data", "expert"))
rng = np.random.default_rng(0)
host = {"embed": rng.normal(size=(12, 8)).astype(np.float32),
        "experts": rng.normal(size=(4, 6, 3)).astype(np.float32),
        "odd": rng.normal(size=(5, 3)).astype(np.float32)}
specs = {"embed": P("fsdp"), "experts": P("fsdp"), "odd": P()}
params = {k: jax.make_array_from_callback(v.shape, NamedSharding(train, specs[k]),
                                          lambda i, v=v: v[i]) for k, v in host.items()}
targets = {"embed": NamedSharding(gen, P()), "experts": NamedSharding(gen, P("expert")),
           "odd": NamedSharding(gen, P())}
for k, x in params.items():  # each process gathers a leaf split over its own 2 devices
    split = distributed.host_split(x)
    assert split.shard_shape(x.shape)[0] == (x.shape[0] // 2 if x.shape[0] % 2 == 0
                                             else x.shape[0]), (k, split)
moved = distributed.transfer(params, targets)
for k, y in moved.items():
    assert y.sharding == targets[k]
    for s in y.addressable_shards:
        assert s.device in gen.devices.flat
        np.testing.assert_array_equal(np.asarray(s.data), host[k][s.index])
print("ok", jax.process_index())
"""


def test_weights_move_to_the_generator_devices_leaf_by_leaf(tmp_path):
    """Across processes each leaf is gathered whole onto every process split over that
    process's trainer devices (half a leaf each here, never the model), and each generator
    device gets exactly its part: whole leaves, experts split, a leaf whose rows do not
    split."""
    script = tmp_path / "transfer.py"
    script.write_text(TRANSFER)
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), f"127.0.0.1:{port}", str(i)],
            env=_env(4),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "ok 0" in outs[0] and "ok 1" in outs[1]
