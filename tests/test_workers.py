"""Worker processes for the user's code (tasks/workers.py) and the environments that live in
them (tasks/env.py EnvRunner): a call that holds the GIL is killed at its timeout and costs only
what its worker held; an environment keeps its state, and its event loop, across its calls;
a thread pool whose threads all hang says so instead of timing out silently."""

import asyncio
import os
import re
import socket
import stat
import threading
import time

import pytest

from jaxrl_scale.tasks.env import EnvRunner
from jaxrl_scale.tasks.workers import (
    MAX_ABANDONED,
    PoolBroken,
    WorkerLost,
    WorkerPool,
    WorkerProcesses,
    gather,
)

STUCK_N = 30  # re.match(r"(a+)+$", "a" * 30 + "b"): half a minute in C, holding the GIL


def _stuck():
    re.match(r"(a+)+$", "a" * STUCK_N + "b")


class Heartbeat:
    """A thread that ticks every 5 ms: the trainer's heartbeats and feeding loop stand-in."""

    def __init__(self):
        self.ticks, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self):
        while not self._stop.wait(0.005):
            self.ticks += 1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


# --------------------------------------------------------------------------- worker processes


def _echo(held, x):
    if x == "stuck":
        _stuck()
    if x == "exit":
        os._exit(3)
    if x == "raise":
        raise KeyError("k")
    if x == "lambda":
        return lambda: 1  # cannot be pickled back
    return x, held.shared["name"]


def _keep(held, value):
    return held.keep({"value": value})


def _read(held, handle):
    return held[handle]["value"]


def _stream_kinds(held, fds):
    """What each of the trainer's descriptors is in the worker."""
    return [stat.S_ISCHR(os.fstat(fd).st_mode) for fd in fds]


def test_a_call_that_holds_the_gil_is_killed_at_the_timeout_and_the_pool_goes_on():
    pool = WorkerProcesses(2, timeout=0.5, shares={"name": "task"})
    with Heartbeat() as beat:
        start = time.monotonic()
        got = gather([pool.submit(_echo, x) for x in ["stuck", "a", "b", "c"]])
        took = time.monotonic() - start
    assert took < 3.0, f"{took:.1f} s"
    assert got == [("timeout", None), ("ok", ("a", "task")), ("ok", ("b", "task")),
                   ("ok", ("c", "task"))]  # fmt: skip
    assert beat.ticks >= 10, beat.ticks
    # An error, a worker that dies, a result that cannot cross: each costs its call only.
    (raised, _), (died, lost), (unpicklable, why), (fine, _) = gather(
        [pool.submit(_echo, x) for x in ["raise", "exit", "lambda", "d"]]
    )
    assert (raised, died, unpicklable, fine) == ("error", "error", "error", "ok")
    assert isinstance(lost, WorkerLost) and "exit status 3" in str(lost)
    assert "cannot be sent back" in str(why)
    pool.close()


def test_what_a_worker_keeps_lives_there_and_a_killed_worker_takes_it_along():
    pool = WorkerProcesses(2, timeout=0.5, shares={"name": "task"})
    futures = [pool.submit(_keep, v, spread=True, keeps=1) for v in ("a", "b")]
    handles = [h for _, h in gather(futures)]
    workers = [f.worker for f in futures]
    assert workers[0] is not workers[1]  # spread: each to a worker of its own
    reads = [pool.submit(_read, h, on=w) for h, w in zip(handles, workers, strict=True)]
    assert gather(reads) == [("ok", "a"), ("ok", "b")]
    # Worker 0 is killed under a stuck call; what it kept is gone, worker 1's is not.
    assert gather([pool.submit(_echo, "stuck", on=workers[0])]) == [("timeout", None)]
    (lost, error), ok = gather(
        [pool.submit(_read, h, on=w) for h, w in zip(handles, workers, strict=True)]
    )
    assert lost == "error" and isinstance(error, WorkerLost) and ok == ("ok", "b")
    assert _gone(workers[0].pid, within=5.0)  # killed and reaped
    pool.close()
    assert _gone(workers[1].pid, within=5.0)  # a closed pool's workers are killed
    with pytest.raises(PoolBroken, match="closed"):
        gather([pool.submit(_echo, "a")])


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.01)
    return False


def test_a_worker_holds_none_of_the_trainers_sockets_or_pipes():
    """Or a peer would never see the trainer close a connection, and a reader of a pipe
    never see its end, while a worker lives."""
    a, b = socket.socketpair()
    r, w = os.pipe()
    path = os.path.join(os.path.dirname(__file__), "conftest.py")
    with open(path) as regular:
        pool = WorkerProcesses(1, timeout=5.0)
        [(status, kinds)] = gather([pool.submit(_stream_kinds, [a.fileno(), w, regular.fileno()])])
    assert status == "ok" and kinds == [True, True, False]  # /dev/null (a char device) twice
    pool.close()
    for end in (a, b):
        end.close()
    os.close(r)
    os.close(w)


# --------------------------------------------------------------------------- threads


def test_a_thread_pool_whose_threads_all_hang_fails_its_calls_instead_of_timing_out():
    """Past MAX_ABANDONED blocked threads the pool has none left: a call could never run,
    and reporting it as one more timeout hid that every later call scores nothing."""
    pool, release = WorkerPool(1), threading.Event()
    hung = [pool.submit(release.wait) for _ in range(MAX_ABANDONED + 1)]
    try:
        assert {status for status, _ in pool.gather(hung, 0.01)} == {"timeout"}
        [(status, error)] = pool.gather([pool.submit(lambda: 1)], 0.01)
        assert status == "error" and isinstance(error, PoolBroken), (status, error)
        assert f"{MAX_ABANDONED} abandoned" in str(error)
    finally:
        release.set()


# --------------------------------------------------------------------------- environments


class Counter:
    """Counts its steps; "stuck" runs a regex that holds the GIL."""

    def __init__(self, example):
        self.name, self.steps = example["name"], 0

    def reset(self):
        return f"{self.name}:"

    def step(self, action):
        if action == "stuck":
            _stuck()
        self.steps += 1
        return f"{self.name} step {self.steps}", 0.0, False


class CounterTask:
    def make_env(self, example):
        return Counter(example)


def test_an_environment_whose_step_holds_the_gil_costs_only_the_episodes_of_its_worker():
    """Four episodes on two workers (two each): one step holds the GIL. Its worker is killed
    at the timeout, so its episode and the one sharing that worker (whose step waited behind
    it) fail, each counted by its episode; the other worker's two go on with their state;
    the trainer never froze."""
    runner = EnvRunner(workers=2, timeout=0.5)
    made = runner.make(CounterTask(), [{"name": n} for n in "abcd"])
    envs = [env for env, why in made]
    assert all(why is None for _, why in made)
    assert [obs for obs, _ in runner.reset(envs)] == ["a:", "b:", "c:", "d:"]
    with Heartbeat() as beat:
        start = time.monotonic()
        steps = runner.step(envs, ["stuck", "go", "go", "go"])
        took = time.monotonic() - start
    assert took < 3.0, f"{took:.1f} s"
    assert beat.ticks >= 10, beat.ticks
    mates = [i for i in (1, 2, 3) if envs[i].worker is envs[0].worker]
    others = [i for i in (1, 2, 3) if i not in mates]
    assert len(mates) == 1 and len(others) == 2  # spread: two per worker
    assert steps[0] == (None, "no answer within 0.5 s")
    for i in others:
        assert steps[i] == ((f"{'abcd'[i]} step 1", 0.0, False), None)
    again = runner.step(envs, ["go"] * 4)
    for i in [0, *mates]:  # gone with the killed worker
        for result, why in (steps[i], again[i]) if i else (again[i],):
            assert result is None and why.startswith("WorkerLost: its worker process"), why
    for i in others:  # their environment's state lived on: this is its second step
        assert again[i] == ((f"{'abcd'[i]} step 2", 0.0, False), None)


class Ticker:
    """An async environment: reset starts a background task, each step reads what it made."""

    def __init__(self, example):
        self.values: list[int] = []

    async def _tick(self):
        for i in range(1000):
            self.values.append(i)
            await asyncio.sleep(0.001)

    async def reset(self):
        self.task = asyncio.get_running_loop().create_task(self._tick())
        await asyncio.sleep(0.01)
        return "go"

    async def step(self, action):
        if self.task.done():  # cancelled, or its loop is gone
            raise RuntimeError("the task reset started is gone")
        await asyncio.sleep(0.01)
        return f"{len(self.values)} ticks", 0.0, False


class TickerTask:
    def make_env(self, example):
        return Ticker(example)


def test_an_async_environment_keeps_what_reset_started_until_step():
    """A fresh event loop per call cancelled what `reset` started before `step` ran; the
    worker's one loop keeps it, on the waves' path and on the slot engine's."""
    runner = EnvRunner(workers=2, timeout=5.0)
    [(env, why)] = runner.make(TickerTask(), [{}])
    assert why is None and runner.reset([env]) == [("go", None)]
    [(first, why)] = runner.step([env], ["x"])
    assert why is None, why
    [(second, why)] = runner.step([env], ["x"])
    assert why is None, why
    assert int(first[0].split()[0]) < int(second[0].split()[0])  # still ticking
    # The slot engine's calls: opened and stepped without waiting.
    future = runner.start_open(TickerTask(), {})
    while not (done := runner.outcomes({future: "open"})):
        time.sleep(0.01)
    (opened, why) = done[future]
    assert why is None and opened[1] == "go"
    step = runner.start_step(opened[0], "x")
    while not (done := runner.outcomes({step: "step"})):
        time.sleep(0.01)
    (result, why) = done[step]
    assert why is None and result[0].endswith("ticks")
