"""Generators as jobs of their own: weights over jax.experimental.transfer between layouts, and
real trainer / generator processes on 127.0.0.1 (each test's processes are killed at its end)."""

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import FAST, FIXTURES, HF_FIXTURES, ROOT, TINY_CONFIG, xla_flags
from flax import nnx

from jaxrl_scale.config import ConfigError, MeshConfig, load_config
from jaxrl_scale.hosts.hub import generator_devices
from jaxrl_scale.hosts.weights import WeightClient, WeightServer
from jaxrl_scale.models.policy import Policy, for_generation
from jaxrl_scale.parallel import sharding
from jaxrl_scale.rl.metrics import read_metrics

# ------------------------------------------------------------------ weights between layouts


@pytest.mark.parametrize(
    "trainer, generator, planned",
    [
        (MeshConfig(data=1, fsdp=4, tensor=1), MeshConfig(data=1, fsdp=1, tensor=2), None),
        (MeshConfig(data=1, fsdp=2, tensor=1), MeshConfig(data=1, fsdp=2, tensor=2), None),
        (MeshConfig(data=1, fsdp=3, tensor=1), MeshConfig(data=2, fsdp=1, tensor=1), None),
        # The trainer planned for fewer generator devices than the group has (an axis of -1
        # counts a trainer host's): 2 rows over 4 devices, 3 rows over 2.
        (MeshConfig(data=1, fsdp=2, tensor=1), MeshConfig(data=4, fsdp=1, tensor=1), 2),
        (MeshConfig(data=1, fsdp=3, tensor=1), MeshConfig(data=2, fsdp=1, tensor=1), 1),
    ],
)
def test_pulled_weights_equal_the_generation_copy_in_another_layout(
    tiny_model_config, trainer, generator, planned
):
    """Trainer devices 0..n-1, generator devices from 4 on: every leaf arrives equal to
    `for_generation` of the trainer's parameters (bf16 matrices here), in the generator's
    sharding, whether the trainer has more devices, fewer, or a count that is no multiple,
    and whether or not the trainer's rows split over the generator's devices (`planned`: the
    generator device count the trainer laid its rows out for; they failed to pull before)."""
    import dataclasses

    cfg = dataclasses.replace(tiny_model_config, dtype="bfloat16")
    devices = jax.devices()
    n = trainer.data * trainer.fsdp * trainer.tensor
    mesh = sharding.make_mesh(trainer, devices[:n])
    gen_mesh = sharding.make_mesh(generator, devices[4:])
    model = sharding.init_sharded(lambda rngs: Policy(cfg, rngs=rngs), mesh, 3)
    _, params = nnx.split(model)
    gen_devices = planned or gen_mesh.devices.size
    server = WeightServer(mesh, cfg, gen_devices, host="127.0.0.1", timeout=10)
    server.publish(7, params)
    abstract = jax.eval_shape(lambda p: for_generation(p, cfg, copy=False), params)
    shardings = sharding.state_shardings(abstract, gen_mesh)
    client = WeightClient(abstract, shardings, gen_mesh, host="127.0.0.1", timeout=10)
    try:
        client.connect([server.address])
        pulled = client.pull(7)
        expected = for_generation(params, cfg)
        for got, want, target in zip(
            jax.tree.leaves(pulled), jax.tree.leaves(expected), jax.tree.leaves(shardings),
            strict=True,
        ):  # fmt: skip
            assert got.dtype == want.dtype
            assert got.sharding.is_equivalent_to(target, got.ndim)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert {d for x in jax.tree.leaves(pulled) for d in x.devices()} <= set(devices[4:])
        assert any(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(pulled))
        # Versions not held are refused, naming the trainer process's address.
        server.publish(8, params)
        server.publish(9, params)  # keeps 2: version 7 is gone
        with pytest.raises(LookupError, match=server.address["weights"]):
            client.pull(7)
    finally:
        client.close()
        server.close()


def test_an_offer_nobody_pulls_is_withdrawn_and_a_pulled_one_is_not(tiny_model_config):
    """A generator that asks for a version and dies before pulling it leaves an offer that
    holds that version's blocks: the trainer process withdraws it once `timeout` has passed
    (pulling it itself). An offer whose blocks arrived is acknowledged and left alone, and
    the server goes on serving."""
    import zmq

    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=2, tensor=1), jax.devices()[:2])
    gen_mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=1, tensor=1), jax.devices()[2:4])
    model = sharding.init_sharded(lambda rngs: Policy(tiny_model_config, rngs=rngs), mesh, 0)
    _, params = nnx.split(model)
    server = WeightServer(mesh, tiny_model_config, 2, host="127.0.0.1", timeout=1.0,
                          probe_after=0.2, probe_wait=5.0)  # fmt: skip
    server.publish(0, params)
    abstract = jax.eval_shape(lambda p: for_generation(p, tiny_model_config, copy=False), params)
    client = WeightClient(abstract, sharding.state_shardings(abstract, gen_mesh), gen_mesh,
                          host="127.0.0.1", timeout=10)  # fmt: skip
    dead = zmq.Context.instance().socket(zmq.REQ)
    dead.setsockopt(zmq.LINGER, 0)
    try:
        dead.connect(server.address["weights"])
        dead.send(b'{"version": 0}')
        assert dead.poll(10_000) and "uuid" in json.loads(dead.recv())  # offered, never pulled
        client.connect([server.address])
        first = client.pull(0)  # pulled and acknowledged
        deadline = time.monotonic() + 10
        while server.withdrawn < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.5)  # past the acknowledged offer's deadline too
        assert server.withdrawn == 1
        assert server.replaced == 0  # probed while the offer waited, and the probes arrived
        again = client.pull(0)
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    finally:
        dead.close()
        client.close()
        server.close()


# A generator process that asks for a version, starts pulling it and is frozen (SIGSTOP) with
# its connection open, part of the blocks received: a host that hangs mid-pull.
FROZEN_PULLER = r"""
import json, os, signal, sys, time
import jax, zmq
from jax.experimental import transfer
from jax.sharding import SingleDeviceSharding
socket = zmq.Context.instance().socket(zmq.REQ)
socket.connect(sys.argv[1])
socket.send(json.dumps({"version": int(sys.argv[2])}).encode())
offer = json.loads(socket.recv())
device = jax.local_devices()[0]
where = SingleDeviceSharding(device)
specs = [jax.ShapeDtypeStruct((stop - start, chunk), dtype, sharding=where)
         for chunk, dtype in zip(offer["chunks"], offer["dtypes"])
         for start, stop in offer["blocks"]]
own = transfer.start_transfer_server(device.client, "127.0.0.1:0", ["127.0.0.1:0"])
got = own.connect(offer["transfer"]).pull(offer["uuid"], specs)
while not any(x.is_ready() for x in got):
    time.sleep(0.001)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_puller_frozen_mid_pull_holds_up_the_others_only_until_a_probe_fails(
    tiny_model_config, capsys
):
    """A puller frozen mid-pull holds up every pull of its transfer server (jax's transfer
    API; docs/hosts.md). Another generator asks for the same version, is offered it on that
    server and waits. The trainer process probes its own server while the offers wait; the
    probe does not arrive, a new server takes the offers; the waiting generator, its pull
    making no progress, is told of the new server, pulls again from there, and its weights
    arrive, equal, while the frozen one is still stopped."""
    import dataclasses

    # About 370 MB of float32 blocks in 30 leaves: the frozen puller has most still to come.
    cfg = dataclasses.replace(tiny_model_config, vocab_size=32768, hidden_size=1024,
                              intermediate_size=4096, num_layers=4)  # fmt: skip
    devices = jax.devices()
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices[:1])
    gen_mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices[1:2])
    _, params = nnx.split(sharding.init_sharded(lambda rngs: Policy(cfg, rngs=rngs), mesh, 0))
    # The first probe 4 s after the frozen puller's offer: the other generator's offer is
    # made before the server is replaced.
    server = WeightServer(mesh, cfg, 1, host="127.0.0.1", timeout=60, probe_after=4.0,
                          probe_wait=1.5)  # fmt: skip
    server.publish(0, params)
    abstract = jax.eval_shape(lambda p: for_generation(p, cfg, copy=False), params)
    client = WeightClient(abstract, sharding.state_shardings(abstract, gen_mesh), gen_mesh,
                          host="127.0.0.1", timeout=45)  # fmt: skip
    client.recheck = 1.0  # (5 s in a run)
    frozen = subprocess.Popen(
        [sys.executable, "-c", FROZEN_PULLER, server.address["weights"], "0"],
        env=_env("generator", devices=1), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while _state(frozen.pid) != "T" and time.monotonic() < deadline:
            assert frozen.poll() is None, frozen.stdout.read()
            time.sleep(0.01)
        assert _state(frozen.pid) == "T"  # stopped, part of its blocks arrived
        client.connect([server.address])
        pulled = client.pull(0)  # (a TimeoutError after 45 s if held up behind it)
        assert _state(frozen.pid) == "T" and server.replaced >= 1
        assert "pulling its blocks of version 0 again" in capsys.readouterr().err
        expected = for_generation(params, cfg)
        for got, want in zip(jax.tree.leaves(pulled), jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    finally:
        frozen.kill()
        frozen.wait(timeout=30)
        client.close()
        server.close()


def _state(pid: int) -> str:
    """A process's state letter (Linux: R, S, T for stopped, ...)."""
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]


def test_hosts_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="pipeline.mode"):
        load_config(TINY_CONFIG, ["hosts.generator_groups=1", "pipeline.mode=ppo_off_policy"])
    with pytest.raises(ConfigError, match="pipeline.generator_devices"):
        load_config(TINY_CONFIG, ["hosts.generator_groups=1", "pipeline.generator_devices=2"])
    with pytest.raises(ConfigError, match="hosts.hub"):
        load_config(TINY_CONFIG, ["hosts.hub=nohost"])


def test_a_generator_group_counts_every_axis_of_its_mesh():
    # An expert-parallel group {data: 1, expert: 8} is 8 devices (the weights' split, the
    # first pull, the run's device-seconds), as {data: 8} is; -1 takes a host's devices.
    for mesh, n in [("{data: 1, expert: 8}", 8), ("{data: 2, tensor: 2}", 4),
                    ("{data: -1, expert: 2}", jax.local_device_count())]:  # fmt: skip
        cfg = load_config(TINY_CONFIG, ["hosts.generator_groups=1", f"hosts.generator_mesh={mesh}"])
        assert generator_devices(cfg) == n, mesh


def test_trainer_processes_fetch_a_batch_host_to_host_until_each_has_it():
    """Process 0 serves each batch's frames to the other trainer processes over ZeroMQ (no
    collective puts the bytes on a device); a batch is dropped once every reader took it,
    and a wait that is not answered fails naming the server."""
    from jaxrl_scale.hosts.hub import BatchServer, fetch_batch

    server = BatchServer("127.0.0.1", readers=2, timeout=5)
    try:
        frames = [b'{"header": {}}', np.arange(1 << 20, dtype=np.uint8).tobytes()]
        server.put(3, frames)
        assert fetch_batch(server.address, 3, timeout=5) == frames
        assert server.held() == [3]  # one reader still to come
        assert fetch_batch(server.address, 3, timeout=5) == frames
        assert server.held() == []
        with pytest.raises(RuntimeError, match="batch 3 is not held here"):
            fetch_batch(server.address, 3, timeout=5)
    finally:
        server.close()
    with pytest.raises(TimeoutError, match=f"batch server at {server.address}"):
        fetch_batch(server.address, 4, timeout=0.5)


def _hub_cfg(port):
    hosts = ["hosts.generator_groups=1", f"hosts.hub=127.0.0.1:{port}"]
    return load_config(TINY_CONFIG, [*FAST, *hosts, "pipeline.mode=pipeline_rl"])


def test_the_hub_drops_malformed_batches_and_goes_on():
    """A batch missing an array, with rows of another size, or a header without its
    statistics is dropped and counted; the hub thread lives on and answers."""
    import zmq

    from jaxrl_scale.hosts.hub import Hub, encode_batch
    from jaxrl_scale.rl.curriculum import Curriculum

    port = _free_port()
    cfg = _hub_cfg(port)
    hub = Hub(cfg, Curriculum(64, seed=0), start=0, k=1, chunks=1, weights=[])
    ctx = zmq.Context.instance()
    push, req = ctx.socket(zmq.PUSH), ctx.socket(zmq.REQ)
    try:
        push.connect(f"tcp://127.0.0.1:{port + 1}")
        req.connect(f"tcp://127.0.0.1:{port}")
        rows, prompts = 16, 4  # FAST: 4 prompts x 4
        whole = {f: np.zeros((rows, 4), np.int32) for f in
                 ("prompt_tokens", "prompt_mask", "completion_tokens", "completion_mask",
                  "behavior_logp", "versions")}  # fmt: skip
        whole.update(finish_reason=np.zeros(rows, np.int32), lengths=np.zeros(rows, np.int32),
                     rewards=np.zeros(rows), pass_rates=np.zeros(prompts),
                     indices=np.arange(prompts))  # fmt: skip
        header = {"gen": 1, "batch": 0, "run": hub.run, "stats": {}, "seconds": 1.0}
        no_pass = {k: v for k, v in whole.items() if k != "pass_rates"}
        short = {**whole, "rewards": np.zeros(rows - 1)}
        bad = [(header, no_pass), (header, short), ({**header, "stats": None}, whole)]
        for h, arrays in bad:
            push.send_multipart(encode_batch(h, arrays))
        deadline = time.monotonic() + 30
        while hub.rejected < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hub.rejected == 3
        req.send_json({"op": "join", "group": 0, "host": "here", "token": "t"})
        assert req.poll(10_000) and req.recv_json()["run"] == hub.run  # still serving
        assert not hub.has(0)
    finally:
        push.close(0)
        req.close(0)
        hub.stop(grace=0.1)


def test_the_groups_make_the_held_out_evaluation_and_a_lost_groups_part_goes_again():
    """The trainer's evaluation of a version is handed to the generator groups in parts,
    before any batch; a malformed result is dropped, a part whose group falls silent for
    hosts.lost_after goes to the next group asking, and the trainer gets every part's
    scores in order."""
    import threading

    import zmq

    from jaxrl_scale.hosts.hub import Hub, encode_batch
    from jaxrl_scale.rl.curriculum import Curriculum

    port = _free_port()
    hosts = ["hosts.generator_groups=2", f"hosts.hub=127.0.0.1:{port}", "hosts.lost_after=1"]
    cfg = load_config(TINY_CONFIG, [*FAST, *hosts, "pipeline.mode=pipeline_rl"])
    hub = Hub(cfg, Curriculum(64, seed=0), start=0, k=1, chunks=1, weights=[])
    ctx = zmq.Context.instance()
    push, a, b = ctx.socket(zmq.PUSH), ctx.socket(zmq.REQ), ctx.socket(zmq.REQ)
    got = []
    try:
        push.connect(f"tcp://127.0.0.1:{port + 1}")
        gens = []
        for sock, token in ((a, "a"), (b, "b")):
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send_json({"op": "join", "group": token, "host": "here", "token": token})
            assert sock.poll(10_000)
            gens.append(sock.recv_json()["gen"])

        def ask(sock, gen, seq):
            sock.send_json({"op": "work", "run": hub.run, "gen": gen, "seq": seq})
            assert sock.poll(10_000)
            return sock.recv_json()

        parts = [(0, 3), (3, 8)]  # FAST: 8 held-out examples, 2 samples each
        waiter = threading.Thread(target=lambda: got.append(hub.evaluate(5, [1, 2], parts)))
        waiter.start()
        time.sleep(0.5)  # the trainer thread's request is in
        first = ask(a, gens[0], 1)
        assert first == {"eval": 0, "part": 0, "lo": 0, "hi": 3, "version": 5, "key": [1, 2],
                         "parts": 2}  # fmt: skip
        second = ask(b, gens[1], 1)
        assert second["part"] == 1 and "batch" not in second
        header = {"eval": 0, "part": 1, "gen": gens[1], "run": hub.run, "counts": {"n": 2}}
        push.send_multipart(encode_batch(header, {"scores": np.ones((4, 2))}))  # 5 rows due
        deadline = time.monotonic() + 1.5  # group a falls silent; b only beats
        while time.monotonic() < deadline:
            b.send_json({"op": "beat", "run": hub.run, "gen": gens[1]})
            assert b.poll(10_000) and "version" in b.recv_json()
            time.sleep(0.2)
        # The malformed part and the lost group's go out again, to the group that asks.
        again = [ask(b, gens[1], 2 + i) for i in range(2)]
        assert sorted(w["part"] for w in again) == [0, 1] and all(w["eval"] == 0 for w in again)
        for j, rows in ((0, 3), (1, 5)):
            header = {"eval": 0, "part": j, "gen": gens[1], "run": hub.run, "counts": {"n": j}}
            push.send_multipart(encode_batch(header, {"scores": np.full((rows, 2), j)}))
        waiter.join(timeout=10)
        (results,) = got
        assert [r[0].shape for r in results] == [(3, 2), (5, 2)]
        assert [r[1] for r in results] == [{"n": 0}, {"n": 1}]
        assert hub.rejected == 1  # the malformed part: dropped, counted, handed out again
        assert "batch" in ask(b, gens[1], 4)  # then batches again
    finally:
        for sock in (push, a, b):
            sock.close(0)
        hub.stop(grace=0.1)


def test_a_group_that_beats_but_makes_no_progress_counts_as_lost():
    """A hung decode: the group holds a batch and its heartbeat goes on, but it starts no
    decode chunk for hosts.stalled_after seconds; it counts as lost (its batch handed out
    again, its rows counted) while a group whose chunks go on keeps its batch."""
    import zmq

    from jaxrl_scale.hosts.hub import Hub
    from jaxrl_scale.rl.curriculum import Curriculum

    port = _free_port()
    hosts = ["hosts.generator_groups=2", f"hosts.hub=127.0.0.1:{port}", "hosts.stalled_after=1"]
    cfg = load_config(TINY_CONFIG, [*FAST, *hosts, "pipeline.mode=pipeline_rl"])
    hub = Hub(cfg, Curriculum(64, seed=0), start=0, k=1, chunks=1, weights=[])
    ctx = zmq.Context.instance()
    socks = [ctx.socket(zmq.REQ), ctx.socket(zmq.REQ)]

    def call(sock, msg):
        sock.send_json({"run": hub.run, **msg})
        assert sock.poll(10_000)
        return sock.recv_json()

    try:
        gens = []
        for i, sock in enumerate(socks):
            sock.connect(f"tcp://127.0.0.1:{port}")
            gens.append(
                call(sock, {"op": "join", "group": i, "host": "here", "token": str(i)})["gen"]
            )
            assert "batch" in call(sock, {"op": "work", "gen": gens[i], "seq": 1})
        deadline = time.monotonic() + 2.0
        step = 0
        while time.monotonic() < deadline:
            step += 1
            hung = call(socks[0], {"op": "beat", "gen": gens[0], "progress": 1})
            call(socks[1], {"op": "beat", "gen": gens[1], "progress": step})
            time.sleep(0.1)
        assert hung.get("rejoin") or call(socks[0], {"op": "beat", "gen": gens[0]}).get("rejoin")
        assert "version" in call(socks[1], {"op": "beat", "gen": gens[1], "progress": step + 1})
        assert hub.lost_rows == 16 and hub.lost_batches == 1  # FAST: 4 prompts x 4, one batch
    finally:
        for sock in socks:
            sock.close(0)
        hub.stop(grace=0.1)


def test_a_rejoined_group_counts_its_processes_once():
    """A group that rejoins gets a new id while its old entry lives until hosts.lost_after:
    generator_processes counts each group (by its number) once, as its newest join."""
    import zmq

    from jaxrl_scale.hosts.hub import Hub
    from jaxrl_scale.rl.curriculum import Curriculum

    port = _free_port()
    hub = Hub(_hub_cfg(port), Curriculum(64, seed=0), start=0, k=1, chunks=1, weights=[])
    req = zmq.Context.instance().socket(zmq.REQ)

    def join(group, token, processes):
        req.send_json({"op": "join", "group": group, "host": "here", "token": token,
                       "processes": processes})  # fmt: skip
        assert req.poll(10_000)
        return req.recv_json()["gen"]

    try:
        req.connect(f"tcp://127.0.0.1:{port}")
        first = join(0, "a", 2)
        assert hub.processes() == 2
        assert join(0, "b", 2) != first  # the same group again: its old entry not yet lost
        assert hub.processes() == 2  # (4 before)
        join(1, "c", 1)
        assert hub.processes() == 3
        join(0, "d", 4)  # rejoined as a bigger job: its newest join counts
        assert hub.processes() == 5
    finally:
        req.close(0)
        hub.stop(grace=0.1)


def test_the_dispatch_keeps_cursors_only_for_batches_not_yet_back():
    from jaxrl_scale.hosts.hub import Dispatch
    from jaxrl_scale.rl.curriculum import Curriculum

    cfg = _hub_cfg(_free_port())
    dispatch = Dispatch(cfg, Curriculum(64, seed=0), start=0, k=2, chunks=1)
    for version in range(cfg.train.steps):
        while dispatch.next < min(version + 3, cfg.train.steps):  # k = 2 ahead
            assert dispatch.assign(1, version)["batch"] == dispatch.next - 1
        got = dispatch.accept(1, version, np.zeros(cfg.train.prompts_per_step))
        assert got is not None
        assert set(dispatch.cursors) <= set(dispatch.assigned)  # the arrived ones forgotten
    assert not dispatch.cursors and not dispatch.assigned


def test_a_batch_that_arrives_early_waits_to_put_its_pass_rates_in():
    """Batch 1 arriving before batch 0: its pass rates go into the curriculum after batch
    0's, and batch 0's snapshot (what a checkpoint after training it keeps) holds batch 0's
    alone; a resumed run draws batch 1 again."""
    from jaxrl_scale.hosts.hub import Dispatch
    from jaxrl_scale.rl.curriculum import Curriculum

    cfg = _hub_cfg(_free_port())
    dispatch = Dispatch(cfg, Curriculum(64, seed=0), start=0, k=2, chunks=1)
    first, second = (dispatch.assign(1, 0)["indices"] for _ in range(2))
    p = cfg.train.prompts_per_step
    assert dispatch.accept(1, 1, np.full(p, 0.5)) == []  # nothing in yet
    assert np.isnan(dispatch.curriculum.pass_rate).all()
    ready = dispatch.accept(1, 0, np.full(p, 0.25))
    assert [m for m, _ in ready] == [0, 1]
    snap0, snap1 = ready[0][1], ready[1][1]
    rates0 = np.asarray(snap0["pass_rate"])
    np.testing.assert_array_equal(rates0[first], 0.25)
    assert np.isnan(np.delete(rates0, first)).all()  # batch 1's not in batch 0's snapshot
    assert int(snap0["position"]) == p  # a resume draws batch 1 (drawn after 0) again
    np.testing.assert_array_equal(np.asarray(snap1["pass_rate"])[second], 0.5)


# ------------------------------------------------------------------ real processes

SETTINGS = [o for o in FAST if not o.startswith(("mesh.", "train.steps="))] + [
    "mesh.data=-1",
    "forecast.every=0",
    "sampler.batching=static",
]


def _free_port() -> int:
    """A port p with p + 1 free too (the hub's two sockets)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue
    raise RuntimeError("no two adjacent free ports")


def _env(role, devices=2, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXRL_")}
    env.update(XLA_FLAGS=xla_flags(devices),
               JAX_PLATFORMS="cpu", JAXRL_ROLE=role, JAXRL_HOST="127.0.0.1", **extra)  # fmt: skip
    env["PATH"] = f"{os.path.dirname(sys.executable)}:{env.get('PATH', '')}"
    return env


def _args(out, hub, *extra):
    cmd = ["--config", str(TINY_CONFIG), "--out", str(out)]
    for s in [*SETTINGS, f"hosts.hub=127.0.0.1:{hub}", *extra]:
        cmd += ["--set", s]
    return cmd


class Processes:
    """Processes a test starts; all are killed when it ends."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        self.logs = []

    def start(self, env, args, log):
        cmd = [sys.executable, "-m", "jaxrl_scale.cli", "train", *args]
        self.logs.append(open(log, "w"))  # noqa: SIM115 (closed by kill_all)
        p = subprocess.Popen(cmd, env=env, stdout=self.logs[-1], stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def kill_all(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        for f in self.logs:
            f.close()


@pytest.fixture
def processes():
    ps = Processes()
    yield ps
    ps.kill_all()


def _wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def _finish(p, timeout, log, *others):
    """Wait for `p` to exit 0; on failure show its log's tail and the tails of `others` (the
    logs of the processes beside it)."""

    def tails():
        shown = [f"--- {x.name}:\n{x.read_text()[-3000:]}" for x in (log, *others) if x.exists()]
        return "\n".join(shown)

    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"did not finish in {timeout} s:\n{tails()}")
    assert p.returncode == 0, tails()


def _lockstep_rows(tmp_path, processes, *, disaggregated: bool):
    out = tmp_path / ("dis" if disaggregated else "colocated")
    extra = ["train.steps=4", "pipeline.lockstep=true", "pipeline.max_staleness=1"]
    port = _free_port()
    if not disaggregated:
        log = tmp_path / "colocated.log"
        p = processes.start(_env("trainer"), _args(out, port + 1, *extra), log)
        _finish(p, 300, log)
        return read_metrics(out)
    script = ROOT / "launch" / "local_disaggregated.sh"
    cmd = ["bash", str(script), "--port", str(port), "1", "1", "--", *_args(out, 0, *extra)]
    env = _env("trainer")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return read_metrics(out)


def test_one_generator_group_in_lockstep_equals_the_colocated_lockstep_run(tmp_path, processes):
    """A fixed schedule (lockstep: the first half of a batch's chunks with the version before,
    the rest with the newest) across hosts, through the launcher, gives the colocated run's
    numbers: the same prompts, keys, samples, losses and evaluations."""
    colocated = _lockstep_rows(tmp_path, processes, disaggregated=False)
    apart = _lockstep_rows(tmp_path, processes, disaggregated=True)
    assert [r["step"] for r in apart] == [r["step"] for r in colocated] == [0, 1, 2, 3, 4]
    for a, b in zip(apart, colocated, strict=True):
        for key in ("loss", "reward_mean", "gen_tokens", "eval_pass_rate", "staleness_max",
                    "grad_norm", "mismatch"):  # fmt: skip
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (a["step"], key)


def test_the_trainer_killed_resumes_and_its_generator_rejoins(tmp_path, processes):
    """The trainer is SIGKILLed once its checkpoint at step 2 exists and started again, with
    the same run directory, only after longer than hosts.timeout (a restart's load and
    compile): it resumes there, and the generator, still running, waited for it and rejoins
    by itself."""
    port = _free_port()
    out = tmp_path / "run"
    extra = ["train.steps=16", "checkpoint.every=2", "hosts.generator_groups=1",
             "pipeline.max_staleness=2", "hosts.timeout=8"]  # fmt: skip
    args = _args(out, port + 1, *extra)
    gen_log = tmp_path / "gen.log"
    gen = processes.start(_env("generator", JAXRL_GROUP="0"), args, gen_log)
    first_log = tmp_path / "trainer1.log"
    first = processes.start(_env("trainer"), args, first_log)
    _wait_for(lambda: (out / "checkpoints" / "2").exists() or first.poll() is not None, 240,
              "the checkpoint at step 2")  # fmt: skip
    first.send_signal(signal.SIGKILL)
    assert first.wait(timeout=30) == -signal.SIGKILL, "the trainer ended before it was killed"
    killed_at = max(r["step"] for r in read_metrics(out))
    assert killed_at < 16
    _wait_for(lambda: "lost the trainer" in gen_log.read_text(), 60, "the generator to miss it")
    time.sleep(4)  # (it went silent more than hosts.timeout ago)
    second_log = tmp_path / "trainer2.log"
    second = processes.start(_env("trainer"), args, second_log)
    _finish(second, 300, second_log, gen_log, first_log)
    rows = read_metrics(out)
    assert rows[-1]["step"] == 16
    assert [r["step"] for r in rows] == sorted({r["step"] for r in rows})  # no step twice
    assert all(r["staleness_max"] <= 2 for r in rows)
    _wait_for(lambda: gen.poll() is not None, 30, "the generator to be told to stop")
    text = gen_log.read_text()
    assert text.count("joined the trainer") == 2, text[-2000:]
    assert gen.returncode == 0


def test_trainer_processes_wait_for_a_slow_but_healthy_first_batch(tmp_path, processes):
    """2 trainer processes and a group whose first batch takes 22 s to score (a user's
    scorer, its heartbeat going on), more than 4 x hosts.timeout: process 0 waits, since the
    group is heard from, and so do the others, however long it takes (they gave up after
    4 x hosts.timeout before)."""
    port = _free_port()
    fixtures = str(ROOT / "tests" / "fixtures" / "tasks")
    extra = ["train.steps=1", "task.name=user_task:make", "task.args.slow_first=22",
             "warm_start.steps=0", "train.eval_every=0", "hosts.generator_groups=1",
             "hosts.timeout=5", "task.score_timeout=120"]  # fmt: skip
    out = tmp_path / "run"
    gen_log = tmp_path / "gen.log"  # first: it waits for the hub (its startup is not silence)
    processes.start(_env("generator", JAXRL_GROUP="0", PYTHONPATH=fixtures),
                    _args(out, port + 1, *extra), gen_log)  # fmt: skip
    trainers = []
    for i in range(2):
        env = _env("trainer", PYTHONPATH=fixtures, JAXRL_COORDINATOR=f"127.0.0.1:{port + 10}",
                   JAXRL_NUM_PROCESSES="2", JAXRL_PROCESS_ID=str(i))  # fmt: skip
        log = tmp_path / f"trainer{i}.log"
        trainers.append((processes.start(env, _args(out, port + 1, *extra), log), log))
    for p, log in trainers:
        _finish(p, 240, log, gen_log)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["gen_seconds"] > 21  # the first batch took that long


def test_generator_role_without_a_trainer_fails_naming_the_hub(tmp_path):
    args = _args(tmp_path, _free_port(), "hosts.generator_groups=1", "hosts.timeout=3")
    cmd = [sys.executable, "-m", "jaxrl_scale.cli", "train", *args]
    done = subprocess.run(cmd, env=_env("generator", JAXRL_GROUP="0"), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1
    assert "no answer from the trainer's hub at 127.0.0.1:" in done.stderr


def test_memory_plans_the_trainer_and_a_generator_group_apart():
    """With generator jobs, the plan has the trainer's devices (train step, and the two
    versions kept for the generators, each split over all trainer devices; no evaluation)
    and one group's devices (two copies: decoding and receiving; held-out evaluation waves
    between its batches, in a batch's place)."""
    from jaxrl_scale.memory import plan

    cfg = load_config(TINY_CONFIG, ["mesh.data=4", "hosts.generator_groups=2",
                                    "hosts.generator_mesh.data=2"])  # fmt: skip
    report = plan(cfg, device_memory_gib=1.0, mem_fraction=1.0)
    model = Policy(cfg.model, rngs=nnx.Rngs(params=0))
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    trainer, gen = report["trainer_host"], report["generator"]
    assert trainer["held_versions_bytes"] == 2 * -(-total // 4)  # float32 model: same bytes
    assert (
        trainer["per_device_bytes"] == trainer["train_step_bytes"] + trainer["held_versions_bytes"]
    )
    assert gen["parameters_bytes"] == 2 * report["generate"]["parameters_bytes"]
    batch = gen["decode_state_bytes"] + gen["working_bytes"]
    evaluation = report["evaluate"]
    assert evaluation["parameters_bytes"] == 0  # it decodes with the copy the group holds
    assert gen["per_device_bytes"] == gen["parameters_bytes"] + max(
        batch, evaluation["per_device_bytes"]
    )
    assert report["generate_mesh"] == {"data": 2, "fsdp": 1, "expert": 1, "tensor": 1}
    assert report["fits"] is True
    from jaxrl_scale.memory.report import format_plan

    assert (
        "planned as 1 trainer process (--processes: its hosts), and each generator group "
        "as one process" in format_plan(report)
    )


def test_memory_plans_the_trainers_layout_of_a_new_version():
    """Publishing lays the new version out while two are held, beside the train state; the
    layout program's temporaries are planned. Where a leaf's split over the trainer differs
    from the row layout's (mesh.tensor > 1), XLA's partitioner replicates it first: at least
    the largest leaf on each device; a replicated train state needs none."""
    from jaxrl_scale.memory import plan

    wide = ["model.hidden_size=256", "model.intermediate_size=1024", "hosts.generator_groups=1",
            "hosts.generator_mesh.data=2"]  # fmt: skip
    largest = 256 * 1024 * 4  # an MLP kernel, float32
    split = ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"]
    for mesh, least, most in [(["mesh.data=4"], 0, 64), (split, largest, None)]:
        report = plan(load_config(TINY_CONFIG, [*mesh, *wide]))
        trainer, train = report["trainer_host"], report["train_step"]
        version = trainer["held_versions_bytes"] // 2
        resident = train["parameters_bytes"] + train["optimizer_state_bytes"]
        layout = trainer["layout_temporaries_bytes"]
        assert trainer["publish_bytes"] == resident + 3 * version + layout
        assert layout >= least and (most is None or layout <= most), (mesh, layout)
        assert trainer["per_device_bytes"] == max(
            trainer["publish_bytes"], train["per_device_bytes"] + 2 * version
        )


def test_model_sampler_and_engine_do_not_load_the_transport():
    code = ("import sys, jaxrl_scale.models.policy, jaxrl_scale.generation.sampler, "
            "jaxrl_scale.generation.engine, jaxrl_scale.rl.generator, jaxrl_scale.train; "
            "print(sorted(m for m in ('zmq', 'jaxrl_scale.hosts.hub', 'jaxrl_scale.hosts.weights', "
            "'jax.experimental.transfer') if m in sys.modules))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env("trainer"), timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_multi_turn_episodes_run_on_a_generator_job(tmp_path, processes):
    """A user's environment task, by import path, importable on both hosts: its episodes
    run on the generator job (the environments live there), on its slot engine as
    sampler.batching asks (in static waves before: a slow environment stalled its wave), and
    reach the trainer with their masks and counts."""
    port = _free_port()
    fixtures = str(ROOT / "tests" / "fixtures" / "tasks")
    extra = ["train.steps=2", "task.name=retry_env:make", "task.max_turns=2",
             "task.max_episode_tokens=24", "warm_start.steps=0",
             "hosts.generator_groups=1", "sampler.batching=continuous"]  # fmt: skip
    out = tmp_path / "run"
    trainer_log, gen_log = tmp_path / "trainer.log", tmp_path / "gen.log"
    trainer = processes.start(_env("trainer", PYTHONPATH=fixtures), _args(out, port, *extra),
                              trainer_log)  # fmt: skip
    processes.start(_env("generator", JAXRL_GROUP="0", PYTHONPATH=fixtures),
                    _args(out, port, *extra), gen_log)  # fmt: skip
    _finish(trainer, 300, trainer_log, gen_log)
    rows = [r for r in read_metrics(out) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 1 <= r["turns_mean"] <= 2 and r["env_errors"] == 0
        assert r["gen_tokens"] <= 2 * 4 * 16  # sampled tokens only: 2 turns of <= 4
        assert (r["gen_batching"], r["staleness_bound"], r["generator_processes"]) == (
            "continuous", 8, 1)  # fmt: skip
        assert 0 < r["slot_occupancy"] <= 1 and r["episodes_trained"] == 16
    assert "static waves" not in trainer_log.read_text() + gen_log.read_text()


def test_agents_run_and_are_served_on_their_generator_job(tmp_path, processes):
    """An agent task by import path across hosts, on a generator group of two processes of
    one device each (a jax.distributed job of its own, its mesh over both): the leader runs the
    agents and serves their sessions on the group's engine, the follower makes the same
    engine calls (the trainer's process runs none), for the batches and the held-out
    evaluation; their counts and sessions reach the trainer's rows and rollouts.jsonl."""
    instruct = tmp_path / "instruct"
    instruct.mkdir()
    for f in (HF_FIXTURES / "qwen2").iterdir():
        shutil.copy(f, instruct / f.name)
    shutil.copy(FIXTURES / "chat_templates" / "qwen2.5.jinja", instruct / "chat_template.jinja")
    port, out = _free_port(), tmp_path / "run"
    settings = [
        f"model.init_from={instruct}", "task.name=sums_agent:make", "task.max_episode_tokens=96",
        "task.agent_timeout=60", "train.prompts_per_step=2", "train.group_size=2",
        "train.steps=2", "train.eval_every=2", "train.eval_samples=1", "warm_start.steps=0",
        "sampler.batching=continuous", "sampler.interruption=null", "sampler.slots=4",
        "checkpoint.every=0", "mesh.data=-1", "forecast.every=0", "log.rollouts=2",
        "pipeline.mode=pipeline_rl", "pipeline.max_staleness=1", "hosts.generator_groups=1",
        f"hosts.hub=127.0.0.1:{port}",
    ]  # fmt: skip
    args = ["--config", str(TINY_CONFIG), "--out", str(out)]
    for setting in settings:
        args += ["--set", setting]
    fixtures, calls = str(ROOT / "tests" / "fixtures" / "tasks"), tmp_path / "calls.jsonl"
    trainer_log, gen_log = tmp_path / "trainer.log", tmp_path / "gen.log"
    env = dict(PYTHONPATH=fixtures, SUMS_AGENT_LOG=str(calls))
    trainer = processes.start(_env("trainer", **env), args, trainer_log)
    gens = []
    for i in range(2):
        job = dict(JAXRL_COORDINATOR=f"127.0.0.1:{port + 10}", JAXRL_NUM_PROCESSES="2",
                   JAXRL_PROCESS_ID=str(i), **env)  # fmt: skip
        log = gen_log if i == 0 else tmp_path / "gen1.log"
        # One device each (as one process per GPU): the leader lays a version out only after
        # telling the follower which (it waited in that program for a follower still waiting
        # to be told, before).
        gens.append(processes.start(_env("generator", devices=1, JAXRL_GROUP="0", **job), args,
                                    log))  # fmt: skip
    _finish(trainer, 300, trainer_log, gen_log, tmp_path / "gen1.log")
    rows = read_metrics(out)
    assert "eval_pass_rate" in rows[0] and "eval_pass_rate" in rows[-1]
    trained = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in trained] == [1, 2]
    for r in trained:
        assert r["agent_calls_mean"] == 2 and r["agent_errors"] == 0 == r["agent_timeouts"]
        assert r["episodes_trained"] == 4 and r["generator_processes"] == 2
        assert r["gen_batching"] == "continuous" and r["staleness_max"] <= 1
    made = [json.loads(line) for line in calls.read_text().splitlines()]
    # 2 batches x 4 episodes, 2 evaluations x 4 examples: every one on the generator job
    assert len(made) >= 16 and {(m["pid"], m["process"]) for m in made} == {(gens[0].pid, "0")}
    assert all(m["role"] == "generator" and "/sessions/" in m["url"] for m in made)
    samples = [json.loads(line) for line in (out / "rollouts.jsonl").open()]
    assert [s["step"] for s in samples] == [1, 1, 2, 2]
    for s in samples:  # the group's sessions, with their calls, in the trainer's file
        assert s["session"] in "".join(m["url"] for m in made) and len(s["calls"]) == 2
        assert len(s["mask"]) == len(s["tokens"]) and sum(s["mask"]) > 0


def test_a_generator_group_of_two_processes_pulls_its_own_rows_and_decodes_in_step(tmp_path):
    """A group spanning 2 processes (a jax.distributed job of its own, 2 devices each, its
    mesh {data: -1}: 4 over both), started by the launcher with --group-processes 2 as a new
    user would: its leader talks to the hub, each process pulls only its own devices' rows
    of every version (about half of each version's bytes), and all decode in step, on the
    slot engine and for the held-out evaluations: the run completes, every token within the
    bound. The trainer, which cannot see the group's devices, laid its versions out in 2
    rows for a host's 2: each row is kept on 2 of the group's 4 devices (every pull failed,
    and the group rejoined until hosts.restart_timeout, before)."""
    out = tmp_path / "run"
    k = 2
    extra = ["train.steps=4", f"pipeline.max_staleness={k}", "train.eval_every=2",
             "sampler.batching=continuous", "hosts.timeout=120"]  # fmt: skip
    script = ROOT / "launch" / "local_disaggregated.sh"
    cmd = ["bash", str(script), "--port", str(_free_port()), "--group-processes", "2", "1", "1",
           "--", *_args(out, 0, *extra)]  # fmt: skip
    done = subprocess.run(cmd, env=_env("trainer"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert all(r["staleness_max"] <= k for r in rows[1:])
    assert all(0 < r["slot_occupancy"] <= 1 for r in rows[1:])
    assert [r["step"] for r in rows if "eval_pass_rate" in r] == [0, 2, 4]
    # What ran: the engine, k, and the group's two processes.
    assert {(r["gen_batching"], r["staleness_bound"], r["generator_processes"])
            for r in rows[1:]} == {("continuous", k, 2)}  # fmt: skip
    assert "each block of 1 rows is kept on 2 devices" in done.stdout, done.stdout[-2000:]
    shares = re.findall(r"generator group 0 \(.*?\)( process 1)?: pulled \d+ version\(s\), "
                        r"([\d.]+) of each", done.stdout)  # fmt: skip
    assert sorted(p for p, _ in shares) == ["", " process 1"], done.stdout[-2000:]
    assert all(0.4 < float(share) < 0.75 for _, share in shares), shares


def test_a_group_that_cannot_run_the_trainers_model_ends_the_run_naming_the_key(
    tmp_path, processes
):
    """A group started with another model than the trainer's (model.hidden_size differs):
    every pull would fail so, however often it rejoined. The group tells the hub and the
    trainer's run ends at once with an error naming the key (it rejoined and pulled again
    until hosts.restart_timeout before); the group exits too."""
    port = _free_port()
    extra = ["train.steps=2", "hosts.generator_groups=1", "hosts.timeout=20",
             "hosts.restart_timeout=600"]  # fmt: skip
    out = tmp_path / "run"
    trainer_log, gen_log = tmp_path / "trainer.log", tmp_path / "gen.log"
    trainer = processes.start(_env("trainer"), _args(out, port, *extra), trainer_log)
    gen = processes.start(_env("generator", JAXRL_GROUP="0"),
                          _args(out, port, *extra, "model.hidden_size=48"), gen_log)  # fmt: skip
    text = _ended(trainer, gen, trainer_log, gen_log)
    assert trainer.returncode == 2, text[-3000:]
    assert "config error: model: the trainer offers" in text, text[-3000:]
    assert "(generator group 0 on 127.0.0.1)" in text
    assert gen.returncode == 2 and "told the trainer" in gen_log.read_text()
    assert "rejoin" not in gen_log.read_text() and "lost the trainer" not in gen_log.read_text()


# A user's task whose scorer always raises (its grading service down): every batch fails
# more than task.max_failure_fraction (0.5) of its samples.
BROKEN_SCORER = """
from jaxrl_scale.models.tokenizer import CharTokenizer


class Task:
    name = "graded"

    def __init__(self):
        rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(8) for b in range(8)]
        self.train_examples, self.eval_examples = rows[:56], rows[56:]
        self.tokenizer = CharTokenizer("0123456789+-*= ")

    def score(self, completion, example):
        raise RuntimeError("the grading service is down")


def make():
    return Task()
"""


def test_broken_scoring_in_a_group_ends_the_trainers_run_with_the_scorers_error(
    tmp_path, processes
):
    """A group whose scorer fails every sample raises ScorerBroken; it tells the hub, and
    the trainer's run ends at once with the scorer's error (the group died unheard before:
    the hub dropped it after hosts.lost_after and the trainer failed after hosts.timeout
    with 'no generator group heard from')."""
    (tmp_path / "graded.py").write_text(BROKEN_SCORER)
    port = _free_port()
    extra = ["train.steps=2", "task.name=graded:make", "warm_start.steps=0",
             "hosts.generator_groups=1", "hosts.timeout=600"]  # fmt: skip
    out = tmp_path / "run"
    trainer_log, gen_log = tmp_path / "trainer.log", tmp_path / "gen.log"
    env = {"PYTHONPATH": str(tmp_path)}
    trainer = processes.start(_env("trainer", **env), _args(out, port, *extra), trainer_log)
    gen = processes.start(_env("generator", JAXRL_GROUP="0", **env), _args(out, port, *extra),
                          gen_log)  # fmt: skip
    text = _ended(trainer, gen, trainer_log, gen_log)
    assert trainer.returncode != 0, text[-3000:]
    assert "ScorerBroken: task graded: " in text, text[-3000:]
    assert "could not be scored" in text and "the grading service is down" in text
    assert "(generator group 0 on 127.0.0.1)" in text
    assert "no generator group has been heard from" not in text
    assert gen.returncode != 0 and "told the trainer" in gen_log.read_text()


# The shipped multi-host recipes: (trainer processes, devices per host). Each runs on that
# topology (its meshes, generator group, pipeline mode and k as written) on 127.0.0.1, with
# fake CPU devices, the model and the shapes shrunk, through the launcher users run.
RECIPES = {"scalerl_qwen3-8b_math.yaml": (1, 8), "scalerl_qwen3-30b-a3b_math.yaml": (4, 8)}
# What shrinks: the model to a few thousand parameters (its architecture, dtype, attention,
# remat, scan and router replay kept), the task to arithmetic (the math task needs a
# checkpoint's tokenizer), the lengths and the batch; the meshes, groups and pipeline stay.
SHRUNK = [
    "task.name=arithmetic", "task.num_train=64", "task.num_eval=8",
    "task.arithmetic.max_digits=1", "model.vocab_size=32", "model.hidden_size=32",
    "model.intermediate_size=64", "model.num_layers=2", "model.num_heads=4",
    "model.num_kv_heads=2", "model.head_dim=8", "model.logits_chunk_size=8",
    "sampler.max_new_tokens=6", "sampler.interruption=null", "sampler.slots=32",
    "train.prompts_per_step=2", "train.group_size=16", "train.micro_batches=1",
    "train.eval_every=0", "train.eval_samples=2", "train.steps=3", "checkpoint.every=0",
    "forecast.every=0", "optim.warmup_steps=1", "hosts.timeout=120",
]  # fmt: skip
MOE = ["model.num_experts=8", "model.num_experts_per_tok=2", "model.moe_intermediate_size=16"]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_each_multi_host_recipe_runs_on_its_topology(tmp_path, recipe):
    """Its trainer processes x devices form the recipe's mesh, its generator group has the
    recipe's mesh on a host of its own, and the pipeline is the one it names: PipelineRL-8
    runs with tokens more than one version stale, never more than k."""
    trainers, devices = RECIPES[recipe]
    cfg = load_config(ROOT / "configs" / recipe)
    assert cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.expert * cfg.mesh.tensor == trainers * devices
    assert generator_devices(cfg) == devices and cfg.hosts.generator_groups == 1
    assert cfg.pipeline.mode == "pipeline_rl" and cfg.pipeline.generator_devices == 0
    k = cfg.pipeline.max_staleness
    out = tmp_path / "run"
    shrunk = [*SHRUNK, *(MOE if cfg.model.num_experts else [])]
    args = ["--config", str(ROOT / "configs" / recipe), "--out", str(out)]
    args += [x for s in shrunk for x in ("--set", s)]
    script = ROOT / "launch" / "local_disaggregated.sh"
    cmd = ["bash", str(script), "--port", str(_free_port()), "--devices", str(devices),
           "--generator-devices", str(devices), str(trainers), "1", "--", *args]  # fmt: skip
    env = _env("trainer")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [r for r in read_metrics(out) if r["step"] > 0]
    assert [r["step"] for r in rows] == list(range(1, 4))
    assert all(r["staleness_max"] <= k for r in rows)
    assert max(r["staleness_max"] for r in rows) >= 2  # PipelineRL-k, not lockstep
    assert "runs as" not in done.stderr  # no reduced bound was warned about
    # The group decodes on the slot engine (the recipes' continuous batching), not in waves.
    assert all(0 < r["slot_occupancy"] <= 1 for r in rows), [r.get("slot_occupancy") for r in rows]
    # Held-out evaluations (step 0 and the last) are made by the generator group.
    assert [r["step"] for r in read_metrics(out) if "eval_pass_rate" in r] == [0, 3]
    assert done.stdout.count("generating evaluation") == 2


def test_a_run_survives_the_fault_soak(tmp_path):
    """The soak's short form (benchmarks/bench_soak.py): 3 groups SIGKILLed and restarted 5
    times (once during a weight pull), one SIGSTOPped past hosts.lost_after, the trainer
    SIGKILLed once and resumed, a group joining mid-run and one drained: the run completes,
    each step trained once, every token within k, the lost rows counted, the drained group
    left without loss of its own, the group that joined made batches, the held-out evaluations
    were made by the groups on the slot engine, and nothing is left running."""
    spec = importlib.util.spec_from_file_location(
        "bench_soak", ROOT / "benchmarks" / "bench_soak.py"
    )
    bench_soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_soak)
    env = _env("trainer")
    counts = bench_soak.soak(tmp_path, steps=240, kills=5, trainers=1, groups=3, seed=0, env=env)
    assert counts["kills"] == 5 and counts["killed_in_pull"] == 1
    assert counts["trainer_kills"] == counts["stopped"] == counts["joined"] == 1
    assert counts["lost"] >= 1  # the stopped group, at least (killed ones are silent too)
    assert counts["left"] == 1  # the drained group, which left rather than being lost,
    assert counts["left_holding_work"] == 0  # with nothing of its own handed out again
    assert counts["lost_rows"] >= 0 and counts["staleness_max"] <= 4


def _ended(trainer, gen, trainer_log, gen_log) -> str:
    """The trainer's log once it and its group have exited (each given a bound)."""
    started = time.monotonic()
    try:
        trainer.wait(timeout=240)
        gen.wait(timeout=60)
    except subprocess.TimeoutExpired:
        logs = f"{trainer_log.read_text()[-2000:]}\n{gen_log.read_text()[-2000:]}"
        pytest.fail(f"still running after {time.monotonic() - started:.0f} s:\n{logs}")
    return trainer_log.read_text()
