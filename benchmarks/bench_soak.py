"""A fault soak of a run across hosts, on this machine: trainer processes and generator groups
on 127.0.0.1 while groups are SIGKILLed and restarted, stopped past `hosts.lost_after`,
drained, joined, and the trainer is SIGKILLed once and resumed.

    python benchmarks/bench_soak.py [--steps 400] [--kills 8] [--trainers 2] [--groups 3] \
        [--group-processes 2]

What happens, at random moments drawn from --seed (0.5-2.5 s or 2-6 steps apart; the run
must outlast them: --steps):
- group 0 starts with its weight pulls held open (JAXRL_PULL_DELAY): it is SIGKILLed while a
  pull is under way (the trainer processes have offered their blocks), then started again;
- --kills - 1 more SIGKILLs of a random group at a random moment, each started again;
- one group is SIGSTOPped for longer than hosts.lost_after, then SIGCONTed (counted lost,
  it is told to rejoin);
- every trainer process is SIGKILLed once, after a checkpoint, and all are started again with
  the same command (the run resumes);
- a new group joins mid-run, and one group is drained (SIGTERM) and leaves.
With --group-processes N every group is a jax.distributed job of N processes: a kill hits a
random process of the group (the leader or a follower), the rest of the group ends by itself
(or is killed after 60 s, counted) and the whole group is started again; the stop and the
drain go to the leader.

Checked at the end (an AssertionError says which): the run completes, each step is trained
once in the metrics (none twice, none skipped), every token within the bound k, `lost_rows`
counted, the held-out evaluations made, the group that joined made batches, the drained
group exited 0 having left, and no process is left running: every group
still up exits once told to stop (the ones that do not are killed and reported). Prints the
counts. The test suite runs a short form (tests/test_hosts.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "tiny_arithmetic.yaml"
SETTINGS = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1",
            "task.arithmetic.max_digits=1", "task.num_train=64", "task.num_eval=8",
            "train.prompts_per_step=4", "train.group_size=4", "train.eval_every=0",
            "train.eval_samples=2", "warm_start.steps=0", "forecast.every=0",
            "mesh.data=-1", "sampler.batching=continuous", "sampler.max_new_tokens=32",
            "checkpoint.every=8"]  # fmt: skip


def free_port() -> int:
    """A port p with p + 1 and p + 10 free too (the hub's two sockets, the coordinator)."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        try:
            for extra in (1, 2, 10):
                with socket.socket() as b:
                    b.bind(("127.0.0.1", port + extra))
            return port
        except OSError:
            continue
    raise RuntimeError("no free ports")


class Drill:
    """The run's processes: started, signalled, and all killed at the end (`close`)."""

    def __init__(self, out: Path, settings: list[str], *, trainers: int, env: dict,
                 timeout: float, group_processes: int = 1):  # fmt: skip
        self.out, self.trainers, self.env, self.timeout = out, trainers, env, timeout
        self.group_processes = group_processes
        self.followers: dict[int, list[subprocess.Popen]] = {}  # a group's processes 1..
        self.port = free_port()
        self.args = ["--config", str(CONFIG), "--out", str(out / "run")]
        for s in [*settings, f"hosts.hub=127.0.0.1:{self.port + 1}"]:
            self.args += ["--set", s]
        self.procs: list[subprocess.Popen] = []
        self.groups: dict[int, tuple[subprocess.Popen, Path]] = {}
        self.trainer_procs: list[tuple[subprocess.Popen, Path]] = []
        self.starts = 0

    def _start(self, role: str, log: Path, **extra) -> subprocess.Popen:
        env = {**self.env, "JAXRL_ROLE": role, "JAXRL_HOST": "127.0.0.1", **extra}
        cmd = [sys.executable, "-m", "jaxrl_scale.cli", "train", *self.args]
        with open(log, "w") as f:
            p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def start_trainers(self) -> None:
        self.trainer_procs = []
        for i in range(self.trainers):
            extra = {}
            if self.trainers > 1:
                extra = dict(
                    JAXRL_COORDINATOR=f"127.0.0.1:{self.port + 10}",
                    JAXRL_NUM_PROCESSES=str(self.trainers),
                    JAXRL_PROCESS_ID=str(i),
                )
            log = self.out / f"trainer{i}-{self.starts}.log"
            self.trainer_procs.append((self._start("trainer", log, **extra), log))
        self.starts += 1

    def start_group(self, g: int, **extra) -> None:
        """Group g's processes: one, or a jax.distributed job of `group_processes` (a fresh
        coordinator port each time it starts)."""
        n = sum(1 for p in self.out.glob(f"group{g}-*.log"))
        log = self.out / f"group{g}-{n}.log"
        job = lambda j: {}  # noqa: E731
        if self.group_processes > 1:
            port = free_port()
            job = lambda j: dict(  # noqa: E731
                JAXRL_COORDINATOR=f"127.0.0.1:{port}",
                JAXRL_NUM_PROCESSES=str(self.group_processes),
                JAXRL_PROCESS_ID=str(j),
            )
        self.groups[g] = (self._start("generator", log, JAXRL_GROUP=str(g), **job(0), **extra),
                          log)  # fmt: skip
        self.followers[g] = [
            self._start(
                "generator",
                self.out / f"follower{g}-{n}-{j}.log",
                JAXRL_GROUP=str(g),
                **job(j),
                **extra,
            )  # fmt: skip
            for j in range(1, self.group_processes)
        ]

    def kill_group(self, g: int, victim: int = 0) -> int:
        """SIGKILL process `victim` of group g; the group's other processes end by themselves
        (a jax.distributed job ends with any of its processes) or are killed after 60 s;
        then the group is started again. How many had to be killed."""
        members = [self.groups[g][0], *self.followers[g]]
        members[victim].send_signal(signal.SIGKILL)
        killed = 0
        for p in members:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)
                killed += 1
        self.start_group(g)
        return killed

    def step(self) -> int:
        """The newest step in the metrics (0 before the first)."""
        path = self.out / "run" / "metrics.jsonl"
        if not path.exists():
            return 0
        steps = [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()]
        return max(steps, default=0)

    def pace(self, seconds: float, steps: int) -> None:
        """Wait `seconds`, or less once the trainer has trained `steps` more (a fast machine
        runs through its steps while a slow one is still starting groups: the faults come
        closer together there, so that the run outlasts them on either)."""
        start, deadline = self.step(), time.monotonic() + seconds
        time.sleep(min(0.3, seconds))
        while time.monotonic() < deadline and self.step() < start + steps:
            time.sleep(0.05)

    def wait_for(self, predicate, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not predicate():
            for p, log in self.trainer_procs:
                if p.poll() is not None and p.returncode != 0:
                    raise AssertionError(f"a trainer exited {p.returncode} while waiting for "
                                         f"{what}:\n{log.read_text()[-3000:]}")  # fmt: skip
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {self.timeout:.0f} s waiting for {what}"
                                     f"\n{self.logs()}")  # fmt: skip
            time.sleep(0.1)

    def logs(self, lines: int = 12) -> str:
        """The last `lines` lines of every trainer's and group's log (what a stall leaves)."""
        out = []
        for p, log in [*self.trainer_procs, *self.groups.values()]:
            tail = log.read_text(errors="replace").splitlines()[-lines:] if log.exists() else []
            out.append(f"== {log.name} (exit {p.poll()})\n" + "\n".join(tail))
        return "\n".join(out)

    def close(self) -> list[str]:
        """Kill whatever is still running; the logs of those that were."""
        left = []
        for p in self.procs:
            if p.poll() is None:
                left.append(" ".join(p.args[-2:]))
                p.kill()
            p.wait(timeout=30)
        return left


def soak(out: Path, *, steps: int, kills: int, trainers: int, groups: int, seed: int,
         k: int = 4, lost_after: float = 4.0, env: dict | None = None, settings=(),
         timeout: float = 240.0, group_processes: int = 1, say=print) -> dict:  # fmt: skip
    """Run the drill (module docstring) in `out`; its counts. AssertionError on a failure."""
    rng = random.Random(seed)
    base = {k2: v for k2, v in (env or os.environ).items() if not k2.startswith("JAXRL_")}
    base.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    base.setdefault("JAX_PLATFORMS", "cpu")
    sets = [*SETTINGS, *settings, f"train.steps={steps}", f"pipeline.max_staleness={k}",
            f"hosts.generator_groups={groups}", f"hosts.lost_after={lost_after}",
            f"train.eval_every={steps // 4}",
            "hosts.timeout=60"]  # fmt: skip
    if group_processes > 1:  # a group of 2 over 2 x 2 devices; a lost process ends it soon
        sets += [f"hosts.generator_mesh.data={2 * group_processes}",
                 "distributed.heartbeat_timeout=15"]  # fmt: skip
    drill = Drill(out, sets, trainers=trainers, env=base, timeout=timeout,
                  group_processes=group_processes)  # fmt: skip
    counts = dict(kills=0, killed_in_pull=0, stopped=0, trainer_kills=0, joined=0, drained=0,
                  followers_killed=0, rest_killed=0)  # fmt: skip
    start = time.monotonic()
    try:
        drill.start_trainers()
        drill.start_group(0, JAXRL_PULL_DELAY="4")
        for g in range(1, groups):
            drill.start_group(g)
        # A kill during a weight pull: group 0's pulls are held open 4 s after the offers.
        log0 = drill.groups[0][1]
        drill.wait_for(lambda: "weights: pulling version" in log0.read_text(), "a pull")
        counts["rest_killed"] += drill.kill_group(0)
        counts["kills"] += 1
        counts["killed_in_pull"] += 1
        say(f"killed group 0 during a weight pull (step {drill.step()}, "
            f"{time.monotonic() - start:.0f} s)")  # fmt: skip
        # The faults, in an order drawn from the seed, each 0.5-2.5 s after the one before or
        # 2-6 steps, whichever comes first (the run must outlast them: --steps).
        events = ["kill"] * (kills - 1) + ["stop", "trainer", "join", "drain"]
        rng.shuffle(events)
        events.remove("drain")
        events.append("drain")  # the drained group leaves last
        next_group = groups

        def joined() -> list[int]:  # the groups up and taking work
            return [g for g, (p, log) in drill.groups.items()
                    if p.poll() is None and "joined the trainer" in log.read_text()]  # fmt: skip

        for event in events:
            drill.pace(rng.uniform(0.5, 2.5), rng.randint(2, 6))
            for p, log in drill.trainer_procs:
                assert p.poll() in (None, 0), (
                    f"a trainer exited {p.returncode} ({event} was next):\n"
                    f"{log.read_text()[-3000:]}"
                )
                assert p.poll() is None, (
                    f"the run ended before the faults did ({event} was next): raise --steps"
                )
            if event == "drain":  # a group still starting has no SIGTERM handler yet
                drill.wait_for(lambda: bool(joined()), "a joined group to drain")
            g = rng.choice(joined() or list(drill.groups))
            if event == "kill":  # any process of the group; the group started again
                victim = rng.randrange(group_processes)
                counts["rest_killed"] += drill.kill_group(g, victim)
                counts["followers_killed"] += victim > 0
                counts["kills"] += 1
            elif event == "stop":  # silent past lost_after, then back: told to rejoin
                drill.groups[g][0].send_signal(signal.SIGSTOP)
                time.sleep(lost_after + 2)
                drill.groups[g][0].send_signal(signal.SIGCONT)
                counts["stopped"] += 1
            elif event == "trainer":  # after a checkpoint; every process, then all again
                drill.wait_for(lambda: any(d.name.isdigit() for d in  # saved, not saving
                                           (out / "run" / "checkpoints").glob("[0-9]*")),
                               "a checkpoint")  # fmt: skip
                for p, _ in drill.trainer_procs:
                    p.send_signal(signal.SIGKILL)
                for p, _ in drill.trainer_procs:
                    p.wait(timeout=30)
                drill.start_trainers()
                counts["trainer_kills"] += 1
                g = None
            elif event == "join":
                drill.start_group(next_group)
                g, next_group = next_group, next_group + 1
                counts["joined"] += 1
            else:  # drain
                drill.groups[g][0].send_signal(signal.SIGTERM)
                counts["drained"] += 1
                drained = g
            say(f"{event} {'' if g is None else f'group {g} '}at step {drill.step()} "
                f"({time.monotonic() - start:.0f} s)")  # fmt: skip
        for p, log in drill.trainer_procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired as e:
                raise AssertionError(
                    f"the trainer did not finish:\n{log.read_text()[-3000:]}\n{drill.logs()}"
                ) from e
            assert p.returncode == 0, log.read_text()[-3000:]
        counts["seconds"] = time.monotonic() - start
        # Every group still up is told to stop and exits; the drained one left by itself.
        members = [p for p, _ in drill.groups.values()]
        members += [p for f in drill.followers.values() for p in f]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(p.poll() is None for p in members):
            time.sleep(0.2)
        proc, log = drill.groups[drained]
        text = log.read_text()
        assert proc.poll() == 0 and "drained; left the trainer" in text, text[-2000:]
        counts["group_exits"] = sorted(str(p.poll()) for p in members)
    finally:
        left = drill.close()
    assert not left, f"still running at the end (killed now): {left}"
    rows = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r["step"] for r in rows if r["step"] > 0]
    assert trained == list(range(1, steps + 1)), f"steps in the metrics: {trained}"
    assert all(r["staleness_max"] <= k for r in rows), [r["staleness_max"] for r in rows]
    evaluated = [r["step"] for r in rows if "eval_pass_rate" in r]  # (made by the groups)
    assert evaluated == sorted({*range(0, steps + 1, steps // 4), steps}), evaluated
    joined = (out / f"group{groups}-0.log").read_text()
    assert "generating batch" in joined, f"the group that joined made no batch:\n{joined[-2000:]}"
    counts.update(
        steps=steps,
        lost_rows=rows[-1]["lost_rows"],
        staleness_max=max(r["staleness_max"] for r in rows),
    )
    logs = "".join(p.read_text() for p in out.glob("trainer0-*.log"))
    counts.update(
        lost=logs.count("silent for"),
        left=logs.count("left (drained)"),
        left_holding_work=logs.count("left (drained);"),  # its work handed out again
        handed_out_again=logs.count("handed out again"),
        dropped=logs.count("was not this run's to make"),
    )
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--kills", type=int, default=8)
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-processes", type=int, default=1,
                        help="processes per generator group (a job of its own each)")  # fmt: skip
    args = parser.parse_args()
    os.environ["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    with tempfile.TemporaryDirectory() as tmp:
        counts = soak(Path(tmp), steps=args.steps, kills=args.kills, trainers=args.trainers,
                      groups=args.groups, seed=args.seed,
                      group_processes=args.group_processes, timeout=900)  # fmt: skip
    print(f"soak: {args.trainers} trainer process(es), {args.groups} groups of "
          f"{args.group_processes} process(es), {args.steps} steps, seed {args.seed}")  # fmt: skip
    for name, value in counts.items():
        print(f"  {name:<18}{value:.0f}" if isinstance(value, float) else f"  {name:<18}{value}")


if __name__ == "__main__":
    main()
