"""Worker processes for the user's code (tasks/workers.py) and the environments that live in
them (tasks/env.py EnvRunner): a call that holds the GIL is killed at its timeout and costs only
what its worker held; an environment keeps its state, and its event loop, across its calls;
a thread pool whose threads all hang says so instead of timing out silently."""

import asyncio
import concurrent.futures as cf
import os
import re
import socket
import stat
import threading
import time
import warnings

import pytest
from conftest import Heartbeat

from jaxrl_scale.tasks import workers
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


def _hog_the_gil_soon(held, n):
    """Starts a thread that holds the worker's GIL for a few seconds (from 0.2 s on, after this
    call's reply has gone): the worker's loop then reads nothing more meanwhile."""
    threading.Thread(
        target=lambda: (time.sleep(0.2), re.match(r"(a+)+$", "a" * n + "b")), daemon=True
    ).start()
    return os.getpid()


def _pid(held, *_):
    return os.getpid()


def test_a_worker_that_stops_reading_costs_its_call_and_blocks_no_other():
    """A user thread left holding a worker's GIL: the worker reads no more. A call whose
    arguments fill the socket's buffer blocked the dispatcher in its send, so no deadline was
    checked and no other worker's call ran; now the send is driven by the wait loop and the
    call's time counts from the start of its send."""
    pool = WorkerProcesses(2, timeout=0.5)
    [(status, hogged)] = gather([first := pool.submit(_hog_the_gil_soon, 28)])
    assert status == "ok"
    time.sleep(0.4)  # the hog holds the GIL now
    start = time.monotonic()
    big = pool.submit(_pid, b"x" * (16 << 20), on=first.worker)  # far past a socket's buffer
    small = [pool.submit(_pid) for _ in range(3)]
    done, _ = cf.wait(small, timeout=2.0)
    assert len(done) == 3, "the other worker's calls waited behind a blocked send"
    assert gather(small) == [("ok", small[0].result())] * 3 and small[0].result() != hogged
    assert gather([big]) == [("timeout", None)]
    assert time.monotonic() - start < 2.0
    pool.close()


def test_a_fork_that_fails_for_a_moment_is_retried_and_the_free_worker_runs_meanwhile(
    monkeypatch,
):
    """A transient EAGAIN broke a pool for good; while forks back off, a call that spreads
    waited for the next fork instead of going to the free worker that was there."""
    real_fork, forks = os.fork, []

    def flaky_fork():  # the first fork works, the next three fail, then they work again
        forks.append(time.monotonic())
        if 2 <= len(forks) <= 4:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return real_fork()

    monkeypatch.setattr(os, "fork", flaky_fork)
    pool = WorkerProcesses(2, timeout=5.0)
    first = pool.submit(_keep, "a", spread=True, keeps=1)
    assert gather([first])[0][0] == "ok"
    start = time.monotonic()
    second = pool.submit(_keep, "b", spread=True, keeps=1)  # a fork fails: the free one runs it
    assert cf.wait([second], timeout=0.5).done == {second}
    assert time.monotonic() - start < 0.5 and second.worker is first.worker
    deadline = time.monotonic() + 5.0  # the backoff forks the second worker soon after
    while len(forks) < 5 and time.monotonic() < deadline:
        gather([pool.submit(_pid, spread=True)])
        time.sleep(0.05)
    assert len(forks) == 5, forks
    assert len({pid for _, pid in gather([pool.submit(_pid) for _ in range(8)])}) <= 2
    pool.close()


def test_the_pool_forks_its_workers_when_it_is_made():
    """Each worker pins the trainer's memory as it was at its fork: forked when the pool is
    made (before the run's large host buffers exist), not at the first call."""
    pool = WorkerProcesses(3, timeout=5.0)
    deadline = time.monotonic() + 5.0
    while len(pool._dispatcher.workers) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(pool._dispatcher.workers) == 3
    pool.close()


def test_a_fork_leaves_the_warning_filters_of_other_threads_alone(monkeypatch):
    """A fork used to swap the process's warning filters (warnings.catch_warnings): one that
    overlapped another thread's catch_warnings put that thread's temporary filter back for
    good (here: every warning ignored, for the rest of the run)."""
    real_fork, release = os.fork, threading.Event()

    def slow_fork():
        release.wait(5.0)
        return real_fork()

    monkeypatch.setattr(os, "fork", slow_fork)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # another thread's, for a moment
        pool = WorkerProcesses(1, timeout=5.0)
        call = pool.submit(_pid)
        time.sleep(0.1)  # the fork has begun
    release.set()
    assert gather([call])[0][0] == "ok"
    assert ("ignore", None, Warning, None, 0) not in warnings.filters
    pool.close()


class _SlowToUnpickle:
    """A reply whose unpickling (on the dispatcher's thread) takes seconds."""

    def __reduce__(self):
        return time.sleep, (3.0,)


def _slow_reply(held):
    return _SlowToUnpickle()


def test_a_dispatcher_that_stops_ends_its_callers_wait(monkeypatch):
    """Whatever stops a pool's dispatcher thread (a bug, a reply whose unpickling hangs),
    `gather` does not wait for it forever: PoolBroken ends the run."""
    monkeypatch.setattr(workers, "DISPATCHER_STUCK_AFTER", 0.5)
    pool = WorkerProcesses(1, timeout=30.0)
    start = time.monotonic()
    with pytest.raises(PoolBroken, match=r"dispatcher .* 0.5 s"):
        gather([pool.submit(_slow_reply)])
    assert time.monotonic() - start < 2.5
    pool.close()


def _unsent(held, example):
    return example


def test_arguments_that_do_not_pickle_fail_the_call_naming_what():
    pool = WorkerProcesses(1, timeout=5.0)
    [(status, error)] = gather([pool.submit(_unsent, {"answer": 1, "rng": threading.Lock()})])
    assert status == "error" and isinstance(error, TypeError)
    assert "example['rng'] (a lock)" in str(error), error
    pool.close()


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
    for i in [0, *mates]:  # gone with the killed worker, which the reason names
        for result, why in (steps[i], again[i]) if i else (again[i],):
            assert result is None and why == (
                f"WorkerLost: its worker process (pid {envs[0].worker.pid}) was killed because "
                "another environment's call ran past task.env_timeout (0.5 s)"
            ), why
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


class BadTools:
    """`tools` raises on request; a reset whose observation cannot be pickled on request."""

    def __init__(self, example):
        self.example = example

    @property
    def tools(self):
        if self.example.get("tools") == "raise":
            raise RuntimeError("no schemas")
        return None

    def reset(self):
        return threading.Lock() if self.example.get("reset") == "lock" else "go"

    def step(self, action):
        return None, 1.0, True


class BadToolsTask:
    def make_env(self, example):
        return BadTools(example)


def _kept(held):
    return len(held._kept)


def test_an_environment_that_fails_to_open_is_not_kept_in_its_worker():
    """One whose `tools` raised, or whose reply could not be sent, stayed in its worker's
    objects for the worker's life: the handle never reached anyone who could drop it."""
    runner, task = EnvRunner(workers=1, timeout=5.0), BadToolsTask()
    made = runner.make(task, [{"tools": "raise"}, {"reset": "lock"}, {}])
    assert made[0][0] is None and "the environment's tools: RuntimeError" in made[0][1]
    assert made[1][0] is not None and made[2][0] is not None
    opened = [runner.start_open(task, e) for e in ({"tools": "raise"}, {"reset": "lock"}, {})]
    cf.wait(opened, timeout=5.0)
    got = runner.outcomes(dict.fromkeys(opened, "open"))
    assert [why is None for _, why in got.values()] == [False, False, True]
    assert "cannot be sent back" in got[opened[1]][1]
    pool = runner._pool(task)
    assert gather([pool.submit(_kept)]) == [("ok", 3)]  # made[1], made[2], opened[2]
