"""The HTTP server in a process of its own, beside the engine's (`jaxrl-scale serve`'s default).

In one process the engine thread and the event loop share one interpreter lock: while the loop
parses requests, detokenizes and writes chunks, the engine thread waits for the lock between
its device calls, and an accelerator waits with it (on an H200 the server streamed 0.27-0.63
of the engine's tokens/s that way, docs/benchmarks.md). Split, each has an interpreter of its
own:

- the engine's process (the one that loaded the policy) runs `Relay`: the backend (the slot
  engine on its thread, serve/engine.py) and a loop taking the front's requests;
- the front process (`python -m jaxrl_scale.serve.remote SPEC`) runs the app on uvicorn over
  a `RemoteBackend`, which forwards requests and hands the engine's deltas to their readers.

They talk over two ZeroMQ sockets in a directory only this user can enter (requests one way,
deltas the other), in pickles: both ends are processes of this server, and nothing else can
reach the sockets. Each side watches the other: a front whose engine process died fails its
open requests (503) and exits; the engine's process sees its front exit (`serving.serve`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import signal
import sys
import threading
import time
from pathlib import Path

import zmq

from jaxrl_scale.serve.backend import (
    Backend,
    Delta,
    Generation,
    Request,
    ShuttingDown,
    check_admission,
    check_request,
)

log = logging.getLogger("jaxrl_scale.serve")
POLL_MS = 100  # how often each side looks at its peer and its stop flag
STATS_S = 0.25  # the engine's stats reach the front at least this often while they change


def _addresses(directory: Path) -> tuple[str, str]:
    """(requests, deltas) socket addresses in `directory`."""
    return f"ipc://{directory}/requests", f"ipc://{directory}/deltas"


def _portable(item):
    """A delta, or an exception that survives a pickle's round trip (any other becomes a
    RuntimeError of its text: some exceptions pickle but cannot be rebuilt)."""
    if isinstance(item, Delta):
        return item
    try:
        pickle.loads(pickle.dumps(item))
        return item
    except Exception:  # noqa: BLE001 - whatever it was, its message is what the client gets
        return RuntimeError(f"{type(item).__name__}: {item}")


def _settle(choices: set, items: list, untouched: set | None = None) -> None:
    """A request's open `choices` (and those `untouched`: no token yet) after `items`: a
    finished delta closes its choice, an exception every one."""
    for item in items:
        if not isinstance(item, Delta):
            choices.clear()
            continue
        if untouched is not None:
            untouched.discard(item.index)
        if item.finish is not None:
            choices.discard(item.index)


def _socket(kind: int):
    """A socket whose sends never block: no bound on what waits for a slow peer (deltas must
    not be dropped while it lives), and a send with no peer at all (not connected yet, or
    dead) raises zmq.Again at once instead of waiting for one."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


class _Outlet:
    """Stands in for a request's event loop on the engine's side: what the backend's thread
    hands to its Generation (`push`, `push_all`: `call_soon_threadsafe(_deliver, items)`)
    goes on the wire under the request's key instead."""

    def __init__(self, relay: Relay, key: int):
        self.relay, self.key = relay, key

    def call_soon_threadsafe(self, fn, items) -> None:
        self.relay.send_items(self.key, [item for _, item in items])


class Relay:
    """The engine's side: `backend` (an EngineBackend, or any `Backend`) serving the requests
    a front process sends to the sockets bound in `directory`.

    Threads: `serve` runs on its caller's thread (the process's main thread), which takes the
    front's messages and submits and cancels on the backend; the backend's own thread sends
    deltas (through `_Outlet`). The outgoing socket is used by both, under `_send_lock`; the
    table of open requests, under `_lock`."""

    def __init__(self, backend: Backend, directory: Path):
        self.backend = backend
        requests, deltas = _addresses(directory)
        self._in = _socket(zmq.PULL)
        self._in.bind(requests)
        self._out = _socket(zmq.PUSH)
        self._out.bind(deltas)
        self._closed = False  # (under _send_lock: the sockets are closed)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._open: dict[int, list] = {}  # key -> [generation, its choices not finished]

    def send_items(self, key: int, items: list) -> None:
        """From any thread: `items` (deltas, or the exception that ended the request) for the
        request `key`; a request whose every choice ended (or that failed) is forgotten."""
        with self._lock:
            entry = self._open.get(key)
            if entry is not None:
                _settle(entry[1], items)
                if not entry[1]:
                    del self._open[key]
        self._send(("deltas", key, [_portable(i) for i in items]))

    def _send(self, message) -> None:
        """Send, never wait: with no front connected (not yet, or no more) it is dropped."""
        with self._send_lock:
            if self._closed:
                return
            with contextlib.suppress(zmq.Again):
                self._out.send_pyobj(message, flags=zmq.NOBLOCK)

    def serve(self, stop=lambda: False) -> None:
        """Relay until the front says it closed, or `stop()` (checked every POLL_MS)."""
        poller = zmq.Poller()
        poller.register(self._in, zmq.POLLIN)
        sent_at, sent = 0.0, None
        while not stop():
            if poller.poll(POLL_MS):
                message = self._in.recv_pyobj()
                if message[0] == "close":
                    return
                self._handle(message)
            now = time.monotonic()
            if now - sent_at > STATS_S:
                stats = self.backend.stats()
                if stats != sent:
                    sent = stats
                    self._send(("stats", stats))
                sent_at = now

    def _handle(self, message) -> None:
        kind, key = message[0], message[1]
        if kind == "submit":
            request: Request = message[2]
            entry = [None, set(range(request.n))]
            with self._lock:  # before the engine's thread can send its first delta
                self._open[key] = entry
            try:
                entry[0] = self.backend.submit(request, _Outlet(self, key))
            except Exception as e:  # noqa: BLE001 - this request's fault: it learns why
                self.send_items(key, [e])
        elif kind == "cancel":
            with self._lock:
                entry = self._open.get(key)
                if entry is not None:
                    entry[1].difference_update(message[2])
                    if not entry[1]:
                        del self._open[key]
            if entry is not None and entry[0] is not None:
                self.backend.cancel(entry[0], list(message[2]))

    def close(self) -> None:
        """Forget what is open and close the sockets (close the backend first: its thread
        sends here until it stops; a send after this is dropped)."""
        with self._lock:
            self._open = {}
        with self._send_lock:
            self._closed = True
            self._out.close()
        self._in.close()


class RemoteBackend:
    """The front's side: the `Backend` protocol over the sockets in `directory`, served by a
    `Relay` in the engine's process (`engine_pid`: when that process is gone, every open
    request fails with ShuttingDown and `on_lost` is called).

    Threads: the event loop submits and cancels (the outgoing socket is its, and `close`'s
    once the loop has ended, under `_lock`); the reader thread takes the engine's messages and
    pushes each delta to its Generation. The table of open requests and the counters are
    shared, under `_lock`. `max_queue` is kept here (`_waiting`)."""

    def __init__(self, directory: Path, *, context: int, model_name: str, slots: int,
                 max_queue: int = 64, engine_pid: int | None = None, on_lost=None):  # fmt: skip
        self.context, self.model_name, self.slots, self.max_queue = (
            context, model_name, slots, max_queue,
        )  # fmt: skip
        self.engine_pid, self.on_lost, self.lost = engine_pid, on_lost, False
        requests, deltas = _addresses(directory)
        self._out = _socket(zmq.PUSH)  # (connected: its messages wait for the engine's side)
        self._out.setsockopt(zmq.LINGER, 1000)  # a last "close" still reaches the engine
        self._out.connect(requests)
        self._in = _socket(zmq.PULL)
        self._in.connect(deltas)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        # key -> [generation, choices not finished, choices without a token yet]
        self._open: dict[int, list] = {}
        self._busy = 0
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="jaxrl-serve-front", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ event loop side

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Generation:
        check_request(request, self.context)
        generation = Generation(request, loop, self)
        with self._lock:
            check_admission(self._closed, self._waiting(), self.max_queue)
            key = next(self._ids)
            choices = set(range(request.n))
            self._open[key] = [generation, choices, set(choices)]
            try:
                self._out.send_pyobj(("submit", key, request), flags=zmq.NOBLOCK)
            except zmq.Again:  # (a connected socket queues: only a broken one says so)
                del self._open[key]
                raise ShuttingDown("the engine's process does not take requests") from None
        return generation

    def cancel(self, generation: Generation, choices: list[int]) -> None:
        with self._lock:
            key = next((k for k, e in self._open.items() if e[0] is generation), None)
            if key is None:
                return
            entry = self._open[key]
            entry[1].difference_update(choices)
            entry[2].difference_update(choices)
            if not entry[1]:
                del self._open[key]
            if not self._closed:
                self._out.send_pyobj(("cancel", key, list(choices)), flags=zmq.NOBLOCK)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"queue_length": self._waiting(), "slots": self.slots, "slots_busy": self._busy}

    def _waiting(self) -> int:
        """Requests with a choice that holds no slot (under `_lock`). A choice that got a
        token and has not finished holds one; the engine gives free slots to the choices
        without a token in the order they came, so those beyond the free slots wait."""
        free = self.slots - sum(len(e[1] - e[2]) for e in self._open.values())
        waiting = 0
        for _, _, untouched in self._open.values():
            if len(untouched) > free:
                waiting += 1
            free = max(0, free - len(untouched))
        return waiting

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                with contextlib.suppress(zmq.ZMQError):
                    self._out.send_pyobj(("close", None), flags=zmq.NOBLOCK)
        self._reader.join(timeout)
        self._fail_all(ShuttingDown("the server shut down"))
        self._out.close()
        self._in.close()

    # ------------------------------------------------------------------ reader thread

    def _read(self) -> None:
        poller = zmq.Poller()
        poller.register(self._in, zmq.POLLIN)
        while True:
            with self._lock:
                if self._closed:
                    return
            if self.engine_pid is not None and not _alive(self.engine_pid):
                self.lost = True
                log.error("the engine's process (pid %d) ended", self.engine_pid)
                with self._lock:  # no request taken from here on
                    self._closed = True
                self._fail_all(ShuttingDown("the engine's process ended"))
                if self.on_lost is not None:
                    self.on_lost()
                return
            if poller.poll(POLL_MS):
                # A call of its own: what a message held (a generation, its deltas) is let
                # go before the next wait.
                try:
                    self._take(self._in.recv_pyobj())
                except Exception:  # noqa: BLE001 - one bad message must not end the reader
                    log.exception("a message from the engine's process could not be read")

    def _take(self, message) -> None:
        if message[0] == "stats":
            with self._lock:
                self._busy = message[1]["slots_busy"]
            return
        _, key, items = message
        with self._lock:
            entry = self._open.get(key)
            if entry is None:  # cancelled meanwhile
                return
            _settle(entry[1], items, entry[2])
            if not entry[1]:
                del self._open[key]
        generation = entry[0]
        Generation.push_all([(generation, i) for i in items if isinstance(i, Delta)])
        for item in items:
            if not isinstance(item, Delta):
                generation.push(item)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            gone, self._open = list(self._open.values()), {}
        for entry in gone:
            entry[0].push(error)


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (a parent gone makes its children orphans: the check
    is that the pid is still this process's parent)."""
    return os.getppid() == pid


# ---------------------------------------------------------------------- the front process


class Front:
    """The front process for `backend` (in this process, the engine's), bound to `host` and
    `port`, and the `relay` that serves it (run `relay.serve` on a thread of this process;
    `proc` is the front's Popen). The sockets live in a fresh directory only this user can
    enter. `backend`'s own queue should have no bound of its own: the front keeps
    `max_queue` (an engine that refused a request the front took would fail it)."""

    def __init__(self, backend: Backend, tokenizer, *, model_name: str, slots: int,
                 max_queue: int, host: str, port: int, api_key: str | None = None):  # fmt: skip
        import shutil
        import subprocess
        import tempfile

        self._rmtree = shutil.rmtree
        # mode 0700; an ipc path holds ~100 bytes at most: a long TMPDIR gives way to /tmp
        where = None if len(tempfile.gettempdir()) < 60 else "/tmp"
        self.directory = Path(tempfile.mkdtemp(prefix="jaxrl-serve-", dir=where))
        self.relay = None
        try:
            self.relay = Relay(backend, self.directory)
            spec = self.directory / "spec.pickle"
            spec.write_bytes(pickle.dumps({
                "directory": str(self.directory), "tokenizer": tokenizer, "api_key": api_key,
                "host": host, "port": port, "context": backend.context,
                "model_name": model_name, "slots": slots, "max_queue": max_queue,
                "engine_pid": os.getpid(),
            }))  # fmt: skip
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jaxrl_scale.serve.remote", str(spec)]
            )
        except BaseException:
            if self.relay is not None:
                self.relay.close()
            shutil.rmtree(self.directory, ignore_errors=True)
            raise

    def close(self) -> None:
        """Kill the front if it still runs, close the relay (close the backend first) and
        remove the sockets' directory."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.relay.close()
        self._rmtree(self.directory, ignore_errors=True)


def front_main(spec_path: str) -> int:
    """The front process: the app over a RemoteBackend, on uvicorn, until SIGTERM (or its
    engine's process ends: exit 1). `spec_path`: a pickle the engine's process wrote (the
    tokenizer, the key, where to bind, the engine's sizes), read and deleted here."""
    from jaxrl_scale.serve.app import make_app
    from jaxrl_scale.serve.server import run_server

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    path = Path(spec_path)
    spec = pickle.loads(path.read_bytes())
    path.unlink()
    backend = RemoteBackend(
        Path(spec["directory"]),
        context=spec["context"],
        model_name=spec["model_name"],
        slots=spec["slots"],
        max_queue=spec["max_queue"],
        engine_pid=spec["engine_pid"],
        on_lost=lambda: os.kill(os.getpid(), signal.SIGTERM),
    )
    app = make_app(backend, spec["tokenizer"], api_key=spec["api_key"])
    try:
        run_server(app, spec["host"], spec["port"])
    finally:
        backend.close()
    return 1 if backend.lost else 0


if __name__ == "__main__":
    sys.exit(front_main(sys.argv[1]))
