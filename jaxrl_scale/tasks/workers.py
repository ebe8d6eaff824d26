"""A pool of daemon threads for untrusted user code (scorers, environments) with timeouts.

pool = WorkerPool(8)
future = pool.submit(fn, *args)     # a concurrent.futures.Future; `future.started` once it runs
pool.abandon(future)                # its caller gave up on it: a fresh thread takes its place

Python cannot kill a thread, so a call that hangs keeps its thread; the pool replaces it so
that `workers` threads stay free, and daemon threads never hold the process open at exit.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time

# Threads hanging calls may hold blocked at once before the pool stops replacing them (each
# blocked one is a daemon and costs only its stack).
MAX_ABANDONED = 256


class WorkerPool:
    """Daemon threads running (fn, args) jobs from a queue, one job at a time each.

    A job that outlives its timeout is abandoned by its waiter: its thread stays blocked in
    the user's code and a fresh thread takes its place, so the pool keeps `workers` threads
    free to run; a blocked thread that returns later goes back to work or, with the pool
    full, exits. Daemon threads never hold the process open at exit. The counters are
    read and changed under `_lock` (the waiters' threads and the workers' own)."""

    def __init__(self, workers: int, *, name: str = "jaxrl-worker"):
        self.workers, self.name = workers, name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live = workers  # threads not abandoned
        self._abandoned = 0  # threads given up on and still blocked
        for _ in range(workers):
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
        per future ("ok", result), ("error", exception) or ("timeout", None) (abandoned, or
        never run because every thread is blocked), in order."""
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
                    out[f] = ("timeout", None)
                elif f.exception() is not None:
                    out[f] = ("error", f.exception())
                else:
                    out[f] = ("ok", f.result())
            elif f.running() and now - f.started > timeout:
                self.abandon(f)
                out[f] = ("timeout", None)
            elif not running:  # every thread blocked: it would never run
                f.cancel()
                out[f] = ("timeout", None)
        return out
