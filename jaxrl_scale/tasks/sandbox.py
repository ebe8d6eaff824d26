"""Running untrusted Python programs (model-written, so hostile) on stdin, with isolation.

sandbox = Sandbox(SandboxLimits(wall_seconds=5.0), workers=8)
sandbox.isolation                          # "namespaces+uid+rlimits" on a root Linux host
sandbox.run("print(input()[::-1])", "abc") -> RunResult(stdout="cba\\n", status="ok", ...)
sandbox.run_many([(program, stdin), ...])  -> [RunResult, ...] (a bounded pool of runs at once)

Each run is its own process group and session, started with an empty environment in a fresh
temporary directory that is deleted afterwards, under rlimits (CPU seconds, address space,
processes, open files, file size, no core files), killed with its whole group by SIGKILL at the
wall-clock limit or when its stdout passes the output cap (output is read in chunks, never
more than the cap). What else isolates it depends on the machine; the strongest that works is
found once per process by running a probe program, and `isolation` names the one that runs:

- "namespaces+uid+rlimits" (root and `unshare`): new network (no network at all), PID, mount,
  IPC and UTS namespaces; a new root of read-only system directories with a private /tmp and
  working directory (size-capped tmpfs); the program runs as an unprivileged uid of its own,
  so RLIMIT_NPROC caps its processes (root ignores that limit) and it can signal nothing of the
  trainer's. See sandbox_launcher.py.
- "uid+rlimits" (root, no usable `unshare`): the unprivileged uid and rlimits only: no network
  or filesystem isolation beyond file permissions.
- "rlimits" (neither): limits only. The program could read the trainer's files, use the network
  and signal the trainer's processes.

A Sandbox refuses both levels below namespaces unless `allow_unisolated=True`.

The interpreter is the trainer's own (`sys.executable`'s real path) with `-I -S -B -X utf8`:
the standard library only, no site-packages, no PYTHON* variables.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import json
import os
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from jaxrl_scale.configbase import require

LEVELS = ("namespaces+uid+rlimits", "uid+rlimits", "rlimits")  # strongest first
_MODES = {"namespaces+uid+rlimits": "namespaces", "uid+rlimits": "uid", "rlimits": "rlimits"}
_UNSHARE = ("--net", "--pid", "--fork", "--mount", "--ipc", "--uts", "--kill-child")
_LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
_SETUP_FAILED = 125  # the launcher's exit code when it could not set the run up
_STDERR_TAIL = 4096  # bytes of stderr kept
_CHUNK = 65536
# Unprivileged uids, one per concurrent run of this process (never reused by two live runs):
# the process limit counts per uid, so runs sharing one would share its count.
# Each process takes its uids from a block of its own (by its pid), so two trainers, or a
# trainer and a generator job, on one host never share a uid's process count.
UID_BASE = 1_900_000_000
UIDS_PER_PROCESS = 1_000
_uids_lock = threading.Lock()
_uids_next = 0  # within this process's block
_works: set[tuple[str, str]] = set()  # (level, python) found to work in this process


class SandboxUnavailable(RuntimeError):
    """The requested isolation cannot run on this machine (the message says why)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Per-run limits. The CPU, memory, process, file and open-file limits are rlimits of the
    program's process (the process limit counts threads too); `disk_bytes` caps each of its
    tmpfs (/work and /tmp, namespaces only)."""

    wall_seconds: float = 10.0  # wall clock before the run's process group is killed
    cpu_seconds: int = 5  # RLIMIT_CPU (SIGXCPU at this, SIGKILL a second later)
    memory_bytes: int = 1 << 30  # RLIMIT_AS (address space)
    max_processes: int = 16  # RLIMIT_NPROC (counted per uid; enforced when not run as root)
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_file_bytes: int = 16 << 20  # RLIMIT_FSIZE: largest file the program may write
    max_output_bytes: int = 1 << 20  # stdout read before the run is killed ("output_limit")
    disk_bytes: int = 64 << 20  # size of its /work and of its /tmp (tmpfs, namespaces only)

    def __post_init__(self):  # named by their config keys (task.code.limits)
        for name in (f.name for f in dataclasses.fields(self)):
            value = getattr(self, name)
            require(value > 0, f"task.code.limits.{name}", f"must be > 0, got {value}")
        require(
            self.max_processes >= 2,
            "task.code.limits.max_processes",
            "must be >= 2 (the interpreter's own)",
        )


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One run: its stdout (at most the output cap, decoded UTF-8 with replacement), the last
    bytes of its stderr, its exit code (128 + signal when killed by a signal; None when the
    sandbox killed it), what happened and its wall time.

    status: "ok" (exit 0), "error" (nonzero exit), "timeout" (wall or CPU limit), "memory"
    (MemoryError), "output_limit" (stdout over the cap), "killed" (ended by a signal), or
    "sandbox_error" (the run could not be set up)."""

    stdout: str
    stderr_tail: str
    returncode: int | None
    status: str
    seconds: float


def _status(code: int, stderr: str) -> str:
    if code == 0:
        return "ok"
    if code == _SETUP_FAILED and "jaxrl-sandbox:" in stderr:
        return "sandbox_error"
    if code == 128 + signal.SIGXCPU:
        return "timeout"
    if "MemoryError" in stderr:
        return "memory"
    return "killed" if code > 128 else "error"


class Sandbox:
    """A pool of at most `workers` concurrent runs under one isolation level.

    isolation: "auto" (the strongest level that works here) or one of LEVELS (an error if it
    does not work). allow_unisolated: permit a level below namespaces ("uid+rlimits": the
    network and world-readable files are reachable; "rlimits": no isolation beyond limits),
    which "auto" otherwise refuses. python:
    the interpreter (default: the trainer's own). uid_base: first uid for runs (each worker
    gets its own uid; the default range is far from any system or login user's)."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        isolation: str = "auto",
        allow_unisolated: bool = False,
        workers: int | None = None,
        python: str | None = None,
    ):
        self.limits = limits or SandboxLimits()
        self.python = os.path.realpath(python or sys.executable)
        self.workers = workers or os.cpu_count() or 1
        if isolation != "auto" and isolation not in LEVELS:
            raise ValueError(f"isolation must be 'auto' or one of {LEVELS}, got {isolation!r}")
        self._uids: queue.SimpleQueue[int] = queue.SimpleQueue()
        for uid in _take_uids(self.workers):
            self._uids.put(uid)
        self.isolation = self._choose(isolation, allow_unisolated)
        self._pool = cf.ThreadPoolExecutor(self.workers, thread_name_prefix="sandbox")

    def _choose(self, isolation: str, allow_unisolated: bool) -> str:
        reasons = {}
        for level in LEVELS if isolation == "auto" else (isolation,):
            why = self._probe(level)
            if why is None:
                break
            reasons[level] = why
        else:
            tried = "; ".join(f"{lvl}: {why}" for lvl, why in reasons.items())
            raise SandboxUnavailable(f"no sandbox isolation works here ({tried})")
        if level != LEVELS[0] and not allow_unisolated:  # no namespaces: an opt-in
            tried = "; ".join(f"{lvl}: {why}" for lvl, why in reasons.items())
            could = (
                "use the network (the trainer's own ports on loopback included) and read "
                "world-readable files"
                if level == "uid+rlimits"
                else "read files, use the network and signal processes"
            )
            raise SandboxUnavailable(
                f"only {level} can isolate untrusted programs here"
                + (f" ({tried})" if tried else "")
                + f"; the programs could {could}. Pass allow_unisolated=True "
                "(task.code.allow_unisolated) to run them anyway."
            )
        return level

    def _probe(self, level: str) -> str | None:
        key = (level, self.python)
        if key in _works:
            return None
        if level != "rlimits" and os.geteuid() != 0:
            return "needs root to run programs under another uid"
        if level.startswith("namespaces") and not shutil.which("unshare"):
            return "no unshare command"
        result = self._run(level, "print(6 * 7)", "")
        if result.status == "ok" and result.stdout == "42\n":
            _works.add(key)  # once per process (a failure may be these limits': not kept)
            return None
        return f"probe {result.status}: {result.stderr_tail[-300:].strip()}"

    def run(self, program: str, stdin: str = "") -> RunResult:
        """Run one program (blocks until it ends; at most `workers` run at once)."""
        return self._run(self.isolation, program, stdin)

    def submit(self, program: str, stdin: str = "") -> cf.Future:
        """Queue one run on the pool; returns a Future of its RunResult."""
        return self._pool.submit(self.run, program, stdin)

    def run_many(self, jobs: Sequence[tuple[str, str]]) -> list[RunResult]:
        """Run every (program, stdin) on the pool; results in the order of `jobs`."""
        return [f.result() for f in [self.submit(p, s) for p, s in jobs]]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, level: str, program: str, stdin: str) -> RunResult:
        uid = self._uids.get()  # one live run per uid
        workdir = tempfile.mkdtemp(prefix="jaxrl-sandbox-")
        try:
            return self._run_in(level, program, stdin, uid, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            self._uids.put(uid)

    def _run_in(self, level: str, program: str, stdin: str, uid: int, workdir: str) -> RunResult:
        mode, lim = _MODES[level], self.limits
        program_path = os.path.join(workdir, "main.py")
        Path(program_path).write_text(program, encoding="utf-8", errors="surrogatepass")
        if mode == "uid":
            os.chown(workdir, uid, uid)
            os.chmod(program_path, 0o644)
        main = "/work/main.py" if mode == "namespaces" else program_path
        root = os.path.join(workdir, "root")
        os.mkdir(root)
        prefix = os.path.dirname(os.path.dirname(self.python))  # .../bin/python -> ...
        cfg = {
            "mode": mode,
            "uid": uid,
            "workdir": workdir,
            "root": root,
            "program": program_path,
            "read_only": [prefix, "/etc/ld.so.cache"],
            "python": self.python,
            "argv": [self.python, "-I", "-S", "-B", "-X", "utf8", main],
            "cpu_seconds": lim.cpu_seconds,
            "memory_bytes": lim.memory_bytes,
            "max_processes": lim.max_processes,
            "max_open_files": lim.max_open_files,
            "max_file_bytes": lim.max_file_bytes,
            "disk_bytes": lim.disk_bytes,
            "wall_seconds": lim.wall_seconds,
        }
        command = [self.python, "-I", "-S", "-B", str(_LAUNCHER), json.dumps(cfg)]
        if mode == "namespaces":
            command = [shutil.which("unshare") or "unshare", *_UNSHARE, *command]
        start = time.monotonic()
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            start_new_session=True,  # its own session and process group, killed as one
            close_fds=True,
        )
        try:
            out, err, killed = _communicate(
                proc, stdin.encode("utf-8", "surrogateescape"), lim, start + lim.wall_seconds
            )
        finally:
            _kill_group(proc.pid)
            proc.wait()
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                pipe.close()
        stderr = err.decode("utf-8", "replace")
        code = None if killed else proc.returncode
        if code is not None and code < 0:  # the launcher itself died of a signal
            code = 128 - code
        status = killed or _status(code, stderr)
        return RunResult(
            out.decode("utf-8", "replace"), stderr, code, status, time.monotonic() - start
        )


def _communicate(proc, data: bytes, lim: SandboxLimits, deadline: float):
    """Feed stdin, read stdout up to the cap and the tail of stderr until the run ends.

    Returns (stdout, stderr tail, None) or, when the sandbox must end the run, the reason as
    the third element ("timeout" or "output_limit") after killing its process group."""
    out, err = bytearray(), bytearray()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    view = memoryview(data)
    if view:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE, "in")
    else:
        proc.stdin.close()
    open_reads = 2
    try:
        while open_reads:
            left = deadline - time.monotonic()
            if left <= 0:
                _kill_group(proc.pid)
                return bytes(out), bytes(err[-_STDERR_TAIL:]), "timeout"
            for key, _ in sel.select(left):
                if key.data == "in":
                    try:
                        view = view[os.write(key.fd, view[:_CHUNK]) :]
                    except (BrokenPipeError, BlockingIOError) as e:
                        if isinstance(e, BlockingIOError):
                            continue
                        view = view[:0]  # the program stopped reading: fine
                    if not view:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, _CHUNK)
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_reads -= 1
                elif key.data == "out":
                    out += chunk
                    if len(out) > lim.max_output_bytes:
                        _kill_group(proc.pid)
                        return bytes(out[: lim.max_output_bytes]), bytes(err), "output_limit"
                else:
                    err += chunk
                    del err[:-_STDERR_TAIL]
        left = max(deadline - time.monotonic(), 0.0)
        try:
            proc.wait(left)  # output closed; the exit follows at once
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            return bytes(out), bytes(err), "timeout"
        return bytes(out), bytes(err), None
    finally:
        sel.close()


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _take_uids(n: int) -> list[int]:
    global _uids_next
    block = UID_BASE + (os.getpid() % 100_000) * UIDS_PER_PROCESS
    with _uids_lock:
        first, _uids_next = _uids_next, _uids_next + n
    return [block + (first + i) % UIDS_PER_PROCESS for i in range(n)]
