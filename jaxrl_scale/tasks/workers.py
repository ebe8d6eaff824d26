"""Where the user's code runs: worker processes that a timeout really ends, and a thread pool.

pool = WorkerProcesses(8, timeout=30.0, shares=task)   # 8 workers, forked at once
future = pool.submit(fn, *args)     # fn(held, *args) in a worker; held.shared is `task`
gather([future])                    # [("ok", value) | ("error", exception) | ("timeout", None)]

Why processes. Python cannot stop a thread, and a thread stuck in C code that holds the GIL
(a regex that backtracks, a tight loop in an extension) stops every other thread with it: the
trainer's feeding loop, its heartbeats, and the waiter whose timeout would have given up on
it. A process can be killed. The user's scorers and environments run in worker processes; a
call past its timeout (from the moment its arguments start to go out) has its worker killed
(SIGKILL to its process group, so what it started goes too) and the call counts as a timeout;
a fresh worker takes its place.

Why fork. A worker is `os.fork()`ed from the trainer rather than started fresh (`spawn`) or
by a fork server: the task is the user's object, often defined in a notebook or in a script's
`__main__`, holding what pickle cannot carry (closures, tokenizers, clients), and a forked
worker has it as it was, with nothing pickled or imported again; only each call's arguments
and result cross, pickled (on the caller's thread and in the worker: one that does not pickle
fails its call with a TypeError naming the part, e.g. `example['rng']`). Forking a process
that runs other threads (JAX's, the trainer's) copies only the forking thread, so a worker
never touches JAX, a device, or a lock another thread might have held: it runs the small loop
below and the user's Python code, nothing else. If it still meets such a lock (another thread
was writing to stdout at the fork), its call times out and the worker is replaced, as any
hang is. What forking means for the user's code (docs/tasks.md, "Where your code runs"):

- the worker's task is a copy: what a call changes in it stays in that worker;
- threads the task started before the fork (a thread pool made in `__init__`) are not there;
- the trainer's sockets and pipes are not inherited: a worker has /dev/null in their place,
  so it never holds a trainer's connection or a subprocess's pipe open; regular files stay;
- memory: a worker shares the trainer's pages as they were at its fork (copy-on-write), so
  what the trainer frees or rewrites after the fork stays allocated in the worker for its
  life. A pool forks all its workers when it is made, not one by one as calls come (the
  scorer's pool is made at setup, before the run's rollout and training buffers exist); a
  worker forked later to replace a killed one pins the trainer's memory of that moment.

Ownership. Each pool has a dispatcher thread that owns its workers: it forks them, sends each
one call at a time, reads the replies, and kills a worker whose call has run past its timeout.
It never blocks on a worker: each worker's socket is non-blocking, and what a call sends and
what it answers move as the socket takes them, from the thread's one wait (a worker whose loop
no longer reads, its GIL held by a thread the user's code left behind, costs only its own call).
Other threads hand it calls (a queue) and wait on futures; `gather` gives up on a dispatcher
that has not come round its loop for DISPATCHER_STUCK_AFTER seconds (PoolBroken) rather than
wait for it forever. A worker ignores SIGINT (the trainer handles Ctrl-C) and dies with its
dispatcher thread (PR_SET_PDEATHSIG on Linux), so none outlives the trainer or its pool.

A fork that fails (EAGAIN, ENOMEM: the process table or memory full for a moment) is tried
again, backing off from 50 ms to 1 s; a pool whose forks have failed for FORK_RETRY_SECONDS
with no worker alive and a call waiting is broken (PoolBroken: that ends the run).

State across calls. A call may keep an object in its worker (`held.keep(obj)` -> a handle) for
later calls pinned to that worker (`submit(..., on=worker)`): an environment lives in one
worker for its whole episode. A call that fails (it raises, or its reply cannot be sent) keeps
nothing. A killed worker takes what it kept with it: calls pinned to it fail with WorkerLost,
whose text names the worker and why it ended.

`WorkerPool` is a pool of daemon threads, for calls that must share their caller's memory (a
tool episode's tools, which run inside its environment's worker process).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import ctypes
import dataclasses
import inspect
import os
import pickle
import queue
import select
import signal
import socket
import stat
import struct
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping

# --------------------------------------------------------------------------- worker processes

FORK_RETRY_SECONDS = 5.0  # forks failing this long, no worker alive and a call waiting: broken
DISPATCHER_STUCK_AFTER = 60.0  # a dispatcher this long between looks at its workers is stuck


class CallTimeout(TimeoutError):
    """A call ran past its timeout; its worker process was killed."""


class WorkerLost(RuntimeError):
    """The worker process a call ran in, or was pinned to, has ended; what it kept is gone."""


class PoolBroken(RuntimeError):
    """No worker process can be started (or the pool was closed): no call can run."""


_PR_SET_PDEATHSIG = 1
try:  # looked up in the trainer: a forked child should not load libraries
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
except (OSError, AttributeError):
    _PRCTL = None
_HEADER = struct.Struct("!Q")  # each message on a worker's socket: its length, then a pickle
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)  # a dead worker: EPIPE, never SIGPIPE
_CHUNK = 1 << 20


def _ignore_jax_fork_warning() -> None:
    """JAX warns at every fork; a worker never touches JAX (the module's docstring). One
    targeted filter, put at the front of the process's filters before each fork: it is never
    swapped in and back out (warnings.catch_warnings around a fork put another thread's
    temporary filters back for good when the two overlapped), and putting it there again only
    moves it, so it holds under a filter another thread set meanwhile ("always", to record)."""
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)


class Held:
    """What a worker process holds: `shared` (its pool's object as it was at the fork) and the
    objects earlier calls kept, by handle. Used by the worker's one thread only."""

    def __init__(self, shared):
        self.shared = shared
        self._kept: dict[int, object] = {}
        self._next = 0

    def keep(self, obj) -> int:
        self._next += 1
        self._kept[self._next] = obj
        return self._next

    def __getitem__(self, handle: int):
        return self._kept[handle]

    def drop(self, handle: int) -> None:
        self._kept.pop(handle, None)

    def drop_since(self, mark: int) -> None:
        """Forget what was kept after `mark` (a `_next` read earlier): a failed call's."""
        for handle in [h for h in self._kept if h > mark]:
            del self._kept[handle]


def _drop(held: Held, handle: int) -> None:
    held.drop(handle)


@dataclasses.dataclass(eq=False)
class Worker:
    """A worker process as its pool's dispatcher thread sees it. Owned by that thread; other
    threads only name it (`submit(on=...)`) and read its `pid`."""

    pid: int
    sock: socket.socket  # non-blocking
    kept: int = 0  # objects it holds for later calls
    job: _Job | None = None  # the call it runs now
    started: float = 0.0  # when that call's sending began
    ended: str | None = None  # why it is gone
    out: memoryview | None = None  # what is left to send of that call
    got: bytearray = dataclasses.field(default_factory=bytearray)  # its reply so far


@dataclasses.dataclass(eq=False)
class _Job:
    data: bytes  # (fn, args), pickled by the caller
    future: cf.Future
    on: Worker | None  # pinned to the worker that holds its state
    spread: bool  # it keeps an object: to the worker that holds fewest
    keeps: int  # objects it adds to its worker's (-1: a drop)
    finish: Callable | None  # (value, worker) -> the future's value, on the dispatcher thread


class WorkerProcesses:
    """Calls `fn(held, *args)` in `workers` forked worker processes, one call at a time each,
    every call given `timeout` seconds from the moment its sending begins (see the module's
    docstring). `shares`: the object each worker has from its fork (`held.shared`). For the
    messages: `call` names what one call is, `timeout_key` the setting `timeout` comes from."""

    def __init__(self, workers: int, *, timeout: float, shares=None, name: str = "jaxrl-worker",
                 call: str = "call", timeout_key: str = "the pool's timeout"):  # fmt: skip
        self.workers, self.timeout = workers, timeout
        lost = f"another {call} ran past {timeout_key} ({timeout:g} s)"
        self._dispatcher = _Dispatcher(workers, timeout, shares, name, lost)
        weakref.finalize(self, self._dispatcher.close)

    def submit(self, fn: Callable, *args, on: Worker | None = None, spread: bool = False,
               keeps: int = 0, finish: Callable | None = None) -> cf.Future:  # fmt: skip
        """A future of `fn(held, *args)` run in a worker (`fn` a module-level function: it is
        sent by name; the arguments are pickled here, and a call whose arguments do not
        pickle fails at once with a TypeError naming the part). `on`: the worker to run it in
        (a call that uses what an earlier one kept); `spread`: to the free worker holding
        fewest kept objects, forking one while fewer than `workers` run; `keeps`: the objects
        it keeps; `finish(value, worker)`: the future's value, made from the worker's reply.
        Once done, `future.worker` ran it."""
        future: cf.Future = cf.Future()
        future.dispatcher = self._dispatcher
        try:
            data = pickle.dumps((fn, args), pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - the caller's arguments, reported per call
            future.set_exception(_unsendable(fn, args, e))
            return future
        self._dispatcher.submit(_Job(data, future, on, spread, keeps, finish))
        return future

    def release(self, worker: Worker, handle: int) -> None:
        """Forget an object `worker` kept (safe from a finalizer, on any thread)."""
        data = pickle.dumps((_drop, (handle,)), pickle.HIGHEST_PROTOCOL)
        self._dispatcher.submit(_Job(data, cf.Future(), worker, False, -1, None))

    def close(self) -> None:
        """Kill the workers; calls not yet done fail with PoolBroken."""
        self._dispatcher.close()


def outcome(future: cf.Future) -> tuple[str, object]:
    """A finished call of a WorkerProcesses: ("ok", value), ("timeout", None) or ("error",
    exception); PoolBroken is raised: no call of that pool can run."""
    if future.cancelled():
        return "error", cf.CancelledError("the call was cancelled")
    error = future.exception()
    if error is None:
        return "ok", future.result()
    if isinstance(error, PoolBroken):
        raise error
    return ("timeout", None) if isinstance(error, CallTimeout) else ("error", error)


def gather(futures) -> list[tuple[str, object]]:
    """Wait for calls of WorkerProcesses (their pools end each one in time) and give each
    one's `outcome`, in order. PoolBroken if a pool's dispatcher thread stops coming round
    its loop (DISPATCHER_STUCK_AFTER): nothing would end its calls then."""
    pending = set(futures)
    while pending:
        _, pending = cf.wait(pending, timeout=min(1.0, DISPATCHER_STUCK_AFTER / 4))
        for dispatcher in {getattr(f, "dispatcher", None) for f in pending} - {None}:
            dispatcher.check_alive()
    return [outcome(f) for f in futures]


def settled(futures) -> dict[cf.Future, tuple[str, object]]:
    """Without waiting: the `outcome` of each of `futures` that has finished (PoolBroken as
    `gather` raises it)."""
    for dispatcher in {getattr(f, "dispatcher", None) for f in futures if not f.done()} - {None}:
        dispatcher.check_alive()
    return {f: outcome(f) for f in futures if f.done()}


def _unsendable(fn: Callable, args: tuple, error: Exception) -> TypeError:
    """The error of a call that does not pickle, naming the innermost part that does not
    (`example['rng'] (a lock)`)."""
    try:
        names = list(inspect.signature(fn).parameters)[1:]  # (after `held`)
    except (TypeError, ValueError):
        names = []
    what = f"{getattr(fn, '__name__', fn)}'s arguments"
    for i, part in [(-1, fn), *enumerate(args)]:
        try:
            pickle.dumps(part)
        except Exception:  # noqa: BLE001 - this one
            if i < 0:
                what = f"the function {fn!r} (sent by name: a module-level one)"
            else:
                path, part = _unpicklable(part, names[i] if i < len(names) else f"argument {i + 1}")
                what = f"{path} (a {type(part).__name__})"
            break
    return TypeError(
        f"{what} cannot be sent to a worker process: it does not pickle ({type(error).__name__}"
        f": {error}); what a call takes and returns crosses between processes, so it must pickle"
    )


def _unpicklable(value, path: str, depth: int = 0) -> tuple[str, object]:
    """The innermost part of `value` (which does not pickle) that does not: its path, itself."""
    if depth > 8:
        return path, value
    if isinstance(value, Mapping):
        parts = [(f"{path}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, list | tuple):
        parts = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    else:
        return path, value
    for sub, part in parts:
        try:
            pickle.dumps(part)
        except Exception:  # noqa: BLE001 - this one
            return _unpicklable(part, sub, depth + 1)
    return path, value


class _Dispatcher:
    """The thread that owns one pool's workers. Other threads only call `submit`, `close` and
    `check_alive`: `_lock` orders them against the thread's exit (no call is queued after its
    last look). It is re-entrant because a finalizer (`WorkerProcesses.release`) may run
    inside it, on whichever thread the garbage collector interrupts."""

    def __init__(self, workers: int, timeout: float, shares, name: str, lost: str):
        self.limit, self.timeout, self.shares, self.name = workers, timeout, shares, name
        self.lost = lost  # why the calls pinned to a worker killed for a timeout fail
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # calls handed over (any thread)
        self._lock = threading.RLock()
        self.closing = False  # under _lock
        self.broken: str | None = None  # set by the dispatcher thread, or by `check_alive`
        self.beat = self.handed = time.monotonic()  # its loop's last round; the last submit
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        weakref.finalize(self, _close_fds, self._wake_r, self._wake_w)
        # Owned by the dispatcher thread:
        self.workers: list[Worker] = []
        self.pending: collections.deque[_Job] = collections.deque()
        self.unreaped: list[int] = []  # killed, not yet exited (uninterruptible sleep)
        self.fork_failing: float | None = None  # since when forks fail (None: they work)
        self.fork_backoff = 0.0  # the wait before the next try, doubled at each failure
        self.retry_fork = 0.0  # after a fork failed, not before this time (0: any time)
        self.thread = threading.Thread(target=self.run, daemon=True, name=name)
        self.thread.start()

    # Any thread.

    def submit(self, job: _Job) -> None:
        with self._lock:
            why = "the pool is closed" if self.closing else self.broken
            if why is None:
                self.handed = time.monotonic()
                self.inbox.put(job)
        if why is not None:
            job.future.set_exception(PoolBroken(why))
            return
        self._wake()

    def close(self) -> None:
        with self._lock:
            self.closing = True
        self._wake()

    def check_alive(self) -> None:
        """PoolBroken when the thread has not come round its loop (which it does at least
        every second while it has calls) for DISPATCHER_STUCK_AFTER seconds since it was
        last handed one: nothing would end its calls. The pool stays broken."""
        with self._lock:
            late = time.monotonic() - max(self.beat, self.handed)
            if late > DISPATCHER_STUCK_AFTER and self.broken is None and not self.closing:
                self.broken = (
                    f"the {self.name} pool's dispatcher thread has not looked at its workers "
                    f"for {DISPATCHER_STUCK_AFTER:g} s (stuck: in a fork that does not return, "
                    "unpickling a reply, or a bug), so nothing would end its calls"
                )
            why = self.broken
        if why is not None:
            raise PoolBroken(why)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: it is awake already
            os.write(self._wake_w, b"\0")

    # The dispatcher thread.

    def run(self) -> None:
        try:
            self._prefork()
            while True:
                self.beat = time.monotonic()
                self._take()  # before looking at `closing`: a close after it wakes the wait
                if self.closing:
                    break
                self._place()
                self._wait()
        except BaseException as e:  # a bug here must not leave callers waiting forever
            self.broken = f"the worker pool's dispatcher failed: {type(e).__name__}: {e}"
            raise
        finally:
            self._shutdown()

    def _prefork(self) -> None:
        """Every worker now, while the trainer holds little memory (each pins what it had at
        its fork). A fork that fails here is tried again when a call needs a worker."""
        while len(self.workers) < self.limit and self._fork() is not None:
            pass
        self.fork_failing, self.fork_backoff, self.retry_fork = None, 0.0, 0.0

    def _take(self) -> None:
        with contextlib.suppress(OSError):
            os.read(self._wake_r, 4096)
        while True:
            try:
                self.pending.append(self.inbox.get_nowait())
            except queue.Empty:
                return

    def _place(self) -> None:
        """Each pending call to a free worker that may run it, in order; the others wait."""
        jobs, self.pending = self.pending, collections.deque()
        for job in jobs:
            if job.future.done():  # (failed meanwhile: its worker ended)
                continue
            if job.on is not None:
                if job.on.ended is not None:
                    _fail(job, WorkerLost(f"its worker process (pid {job.on.pid}) {job.on.ended}"))
                elif job.on.job is not None or not self._send(job.on, job):
                    self.pending.append(job)
                continue
            worker = self._free_worker(job.spread)
            if worker is None and self.broken is not None:
                _fail(job, PoolBroken(self.broken))
            elif worker is None or not self._send(worker, job):
                self.pending.append(job)

    def _free_worker(self, spread: bool) -> Worker | None:
        """A free worker, or a new one while fewer than `limit` run and none is free. With
        `spread`, a new one (holding none) while fewer than `limit` run and each holds some
        (counting those being made), else a free one of those holding fewest, else None: it
        waits for one. While forks fail (backing off), the workers there are serve."""
        if not spread:
            free = next((w for w in self.workers if w.job is None), None)
            if free is not None or len(self.workers) >= self.limit:
                return free
            return self._fork()
        load = {w: w.kept + max(w.job.keeps if w.job else 0, 0) for w in self.workers}
        if len(self.workers) < self.limit and min(load.values(), default=1) > 0:
            worker = self._fork()
            if worker is not None or not load:
                return worker
        fewest = min(load.values())
        return next((w for w in self.workers if w.job is None and load[w] == fewest), None)

    def _fork(self) -> Worker | None:
        now = time.monotonic()
        if now < self.retry_fork:
            return None
        parent_end, child_end = socket.socketpair()
        for stream in (sys.stdout, sys.stderr):  # or the child would print it again
            with contextlib.suppress(Exception):
                stream.flush()
        _ignore_jax_fork_warning()
        try:
            pid = os.fork()
        except OSError as e:
            parent_end.close()
            child_end.close()
            self.fork_failing = self.fork_failing or now
            self.fork_backoff = min(max(2 * self.fork_backoff, 0.05), 1.0)
            self.retry_fork = now + self.fork_backoff
            if not self.workers and now - self.fork_failing >= FORK_RETRY_SECONDS:
                self.broken = (
                    f"no worker process can be started: os.fork() has failed for "
                    f"{now - self.fork_failing:.1f} s ({e})"
                )
            return None
        if pid == 0:  # the worker: it never returns into the trainer's code
            code = 1
            try:
                parent_end.close()
                _worker_main(child_end, self.shares, os.getppid())
                code = 0
            finally:
                os._exit(code)
        self.fork_failing, self.fork_backoff, self.retry_fork = None, 0.0, 0.0
        self.beat = time.monotonic()  # (forking a large trainer takes a while)
        child_end.close()
        parent_end.setblocking(False)
        with contextlib.suppress(OSError):  # (the child does it too: whichever comes first)
            os.setpgid(pid, pid)
        worker = Worker(pid, parent_end)
        self.workers.append(worker)
        return worker

    def _send(self, worker: Worker, job: _Job) -> bool:
        """Start sending `job` to `worker` (its time counts from now; the wait loop sends the
        rest); False when `worker` turned out dead (ended here), so the job waits for another.
        True also when the job was cancelled meanwhile."""
        if not job.future.running() and not job.future.set_running_or_notify_cancel():
            return True
        worker.job, worker.started = job, time.monotonic()
        worker.out = memoryview(_HEADER.pack(len(job.data)) + job.data)
        if not self._flush(worker):  # dead before it took a byte: the job goes elsewhere
            worker.job = None
            self._end(worker, "died", None)
            return False
        return True

    def _flush(self, worker: Worker) -> bool:
        """Send what the socket takes now of `worker`'s call; False: the worker is gone."""
        try:
            while worker.out is not None:
                sent = worker.sock.send(worker.out[:_CHUNK], _NOSIGNAL)
                worker.out = worker.out[sent:] if sent < len(worker.out) else None
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            return False
        return True

    def _wait(self) -> None:
        """Until a reply, a send's progress, a deadline, a fork's retry or a wake-up."""
        now = time.monotonic()
        deadlines = [w.started + self.timeout for w in self.workers if w.job is not None]
        if deadlines or self.pending:  # come round at least this often while busy
            deadlines.append(now + min(1.0, DISPATCHER_STUCK_AFTER / 4))
        if self.unreaped:
            deadlines.append(now + 0.1)
        if self.pending and self.retry_fork > now:  # a call may wait for that fork
            deadlines.append(self.retry_fork)
        poll = select.poll()
        poll.register(self._wake_r, select.POLLIN)
        by_fd = {}
        for w in self.workers:
            by_fd[w.sock.fileno()] = w
            poll.register(w.sock, select.POLLIN | (select.POLLOUT if w.out is not None else 0))
        timeout = max(min(deadlines) - now, 0.0) * 1000 if deadlines else None
        try:
            events = poll.poll(timeout)
        except InterruptedError:
            events = []
        for fd, event in events:
            worker = by_fd.get(fd)
            if worker is None:
                continue
            sending = worker.out is not None and event & (select.POLLOUT | select.POLLERR)
            if sending and not self._flush(worker):
                self._end(worker, "died", None)
                continue
            if event & (select.POLLIN | select.POLLHUP | select.POLLERR):
                self._receive(worker)
        now = time.monotonic()
        for worker in list(self.workers):
            if worker.job is not None and now - worker.started > self.timeout:
                late = f"no answer within {self.timeout:g} s"
                self._end(worker, f"was killed because {self.lost}", CallTimeout(late))
        self._reap()

    def _receive(self, worker: Worker) -> None:
        """Read what `worker` has sent; a whole reply completes its call."""
        try:
            while True:
                chunk = worker.sock.recv(_CHUNK)
                if not chunk:
                    self._end(worker, "died", None)
                    return
                worker.got += chunk
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._end(worker, "died", None)
            return
        if len(worker.got) < _HEADER.size:
            return
        end = _HEADER.size + _HEADER.unpack_from(worker.got)[0]
        if len(worker.got) < end:
            return
        data, worker.got = bytes(worker.got[_HEADER.size : end]), worker.got[end:]
        job, worker.job = worker.job, None
        if job is None:
            return
        try:
            status, value = pickle.loads(data)
        except Exception as e:  # noqa: BLE001 - a reply that does not unpickle here
            status, value = "error", RuntimeError(f"the worker's reply cannot be read: {e}")
        if status == "ok":
            worker.kept += job.keeps
            if job.finish is not None:
                try:
                    value = job.finish(value, worker)
                except Exception as e:  # noqa: BLE001 - reported per call
                    status, value = "error", e
        job.future.worker = worker
        if status == "ok":
            job.future.set_result(value)
        else:
            job.future.set_exception(value)

    def _end(self, worker: Worker, why: str, error: BaseException | None) -> None:
        """`worker` is gone (killed here, or dead): its call fails with `error` (None: the
        worker died under it), the calls pinned to it with WorkerLost. `why` completes
        "its worker process (pid N) ..." in their messages."""
        if worker.ended is not None:
            return
        code = self._kill(worker)
        if why == "died" and code is not None:
            why += f" (signal {-code})" if code < 0 else f" (exit status {code})"
        worker.ended = why
        self.workers.remove(worker)
        worker.sock.close()
        lost = WorkerLost(f"its worker process (pid {worker.pid}) {why}")
        if worker.job is not None:
            _fail(worker.job, error or lost)
            worker.job = None
        for job in [j for j in self.pending if j.on is worker]:
            self.pending.remove(job)
            _fail(job, lost)

    def _kill(self, worker: Worker) -> int | None:
        """SIGKILL to the worker's process group; its exit status (negative: a signal), or
        None when it has not exited yet (reaped later)."""
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(worker.pid, signal.SIGKILL)
        for _ in range(100):  # a killed process exits at once, unless in uninterruptible I/O
            try:
                pid, status = os.waitpid(worker.pid, os.WNOHANG)
            except ChildProcessError:
                return None
            if pid:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.001)
        self.unreaped.append(worker.pid)
        return None

    def _reap(self) -> None:
        for pid in list(self.unreaped):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    continue
            self.unreaped.remove(pid)

    def _shutdown(self) -> None:
        with self._lock:
            self.closing = True
        self._take()
        why = self.broken or "the pool is closed"
        for job in self.pending:
            _fail(job, PoolBroken(why))
        self.pending.clear()
        for worker in list(self.workers):
            self._end(worker, "was stopped: its pool is closed", PoolBroken(why))
        deadline = time.monotonic() + 5.0
        while self.unreaped and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.01)


def _fail(job: _Job, error: BaseException) -> None:
    future = job.future
    if future.done() or (not future.running() and not future.set_running_or_notify_cancel()):
        return
    future.set_exception(error)


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _worker_main(sock: socket.socket, shared, trainer: int) -> None:
    """A forked worker: cut loose from the trainer, then run calls until its socket closes."""
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer handles Ctrl-C, kills it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # its own group: a kill takes what the user's code started too
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != trainer:  # the trainer died before the line above
        return
    _shed_streams(keep=sock.fileno())
    # Fresh stdout and stderr: the trainer's may hold unflushed text or a lock taken by
    # another thread at the fork.
    for name, fd in (("stdout", 1), ("stderr", 2)):
        with contextlib.suppress(OSError, ValueError):
            setattr(sys, name, open(fd, "w", buffering=1, closefd=False, errors="replace"))  # noqa: SIM115
    held = Held(shared)
    while True:
        try:
            data = _recv_message(sock)
        except (EOFError, OSError):
            return
        mark = held._next
        try:
            fn, args = pickle.loads(data)
            reply = ("ok", fn(held, *args))
        except BaseException as e:  # noqa: BLE001 - the user's error, reported per call
            reply = ("error", _portable(e))
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        try:
            data = pickle.dumps(reply, pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - a result that cannot cross
            error = TypeError(f"the call's result cannot be sent back: {type(e).__name__}: {e}")
            reply, data = ("error", error), pickle.dumps(("error", error))
        if reply[0] == "error":  # its caller never gets the handles: nobody could drop them
            held.drop_since(mark)
        sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_message(sock: socket.socket) -> bytes:
    """One message (blocking); EOFError when the socket has closed."""
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    return _recv_exactly(sock, size)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if not n:
            raise EOFError
        got += n
    return bytes(buf)


def _shed_streams(keep: int) -> None:
    """/dev/null in place of every inherited socket, pipe and other stream (not regular files,
    directories or devices), but stdin, stdout, stderr and `keep`: a worker must not hold the
    trainer's connections, or a subprocess's pipe that the trainer reads to its end, open."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    null = os.open(os.devnull, os.O_RDWR)
    for fd in fds:
        if fd <= 2 or fd in (keep, null):
            continue
        try:
            mode = os.fstat(fd).st_mode
        except OSError:  # (listdir's own descriptor, now closed)
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISCHR(mode)
                or stat.S_ISBLK(mode)):  # fmt: skip
            os.dup2(null, fd)  # the number stays taken: whatever still owns it closes /dev/null
    os.close(null)


def _portable(error: BaseException) -> BaseException:
    """`error` if it survives pickling, else a RuntimeError with its type and text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")


# --------------------------------------------------------------------------- threads

# Threads hanging calls may hold blocked at once before the pool stops replacing them (each
# blocked one is a daemon and costs only its stack).
MAX_ABANDONED = 256


class WorkerPool:
    """Daemon threads running (fn, args) jobs from a queue, one job at a time each.

    A job that outlives its timeout is abandoned by its waiter: its thread stays blocked in
    the user's code and a fresh thread takes its place, so the pool keeps `workers` threads
    free to run; a blocked thread that returns later goes back to work or, with the pool
    full, exits. Once MAX_ABANDONED threads are blocked at once, calls that cannot run fail
    with PoolBroken instead of waiting. Daemon threads never hold the process open at exit.
    A forked process (an environment's worker) starts its own threads at its first call. The
    counters are read and changed under `_lock` (the waiters' threads and the workers' own)."""

    def __init__(self, workers: int, *, name: str = "jaxrl-worker"):
        self.workers, self.name = workers, name
        self._pid = -1  # the process whose threads these are
        self._start_threads()

    def _start_threads(self) -> None:
        self._pid = os.getpid()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live = self.workers  # threads not abandoned
        self._abandoned = 0  # threads given up on and still blocked
        for _ in range(self.workers):
            self._start()

    def _start(self) -> None:
        threading.Thread(target=self._work, daemon=True, name=self.name).start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            fn, args, future = self._jobs.get()
            future.started, future.thread = time.monotonic(), me  # before it shows running
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - the user's error, reported per sample
                future.set_exception(e)
            with self._lock:
                if getattr(me, "abandoned", False):  # came back after being replaced
                    me.abandoned = False
                    self._abandoned -= 1
                    if self._live >= self.workers:
                        return
                    self._live += 1

    @property
    def running(self) -> bool:
        with self._lock:
            return self._live > 0

    def submit(self, fn, *args) -> cf.Future:
        if self._pid != os.getpid():  # forked: the threads stayed in the parent
            self._start_threads()
        future: cf.Future = cf.Future()
        self._jobs.put((fn, args, future))
        return future

    def abandon(self, future: cf.Future) -> None:
        """Give up on a running job: its thread no longer counts, a new one replaces it
        (while fewer than MAX_ABANDONED are blocked at once)."""
        thread = future.thread
        with self._lock:  # the replacement takes the slot at once: `running` never dips
            if getattr(thread, "abandoned", False):
                return
            thread.abandoned = True
            self._abandoned += 1
            replace = self._abandoned <= MAX_ABANDONED
            if not replace:
                self._live -= 1
        if replace:
            self._start()

    def gather(self, futures, timeout: float, *, poll: float = 0.05) -> list[tuple[str, object]]:
        """Wait for `futures` (submitted here), each given `timeout` seconds once it started:
        per future ("ok", result), ("error", exception) or ("timeout", None) (abandoned), in
        order; ("error", PoolBroken) for one that never ran because every thread is blocked."""
        out: dict[cf.Future, tuple[str, object]] = {}
        pending = set(futures)
        while pending:
            cf.wait(pending, timeout=min(timeout, poll))
            out.update(self.settled(pending, timeout))
            pending -= out.keys()
        return [out[f] for f in futures]

    def settled(self, futures, timeout: float) -> dict[cf.Future, tuple[str, object]]:
        """Without waiting: the outcome (as `gather` gives it) of each of `futures` that has
        one, a running one past its `timeout` abandoned as ("timeout", None)."""
        out: dict[cf.Future, tuple[str, object]] = {}
        now, running = time.monotonic(), self.running
        for f in futures:
            if f.done():
                if f.cancelled():
                    out[f] = ("error", self._broken())
                elif f.exception() is not None:
                    out[f] = ("error", f.exception())
                else:
                    out[f] = ("ok", f.result())
            elif f.running() and now - f.started > timeout:
                self.abandon(f)
                out[f] = ("timeout", None)
            elif not running:  # every thread blocked: it would never run
                f.cancel()
                out[f] = ("error", self._broken())
        return out

    def _broken(self) -> PoolBroken:
        return PoolBroken(
            f"every thread of the {self.name} pool is blocked in a call that never returned "
            f"({MAX_ABANDONED} abandoned)"
        )
