"""Running untrusted Python programs (model-written, so hostile) on stdin, with isolation.

sandbox = Sandbox(SandboxLimits(wall_seconds=5.0), workers=8)
sandbox.isolation                          # "namespaces+uid+rlimits" on a root Linux host
sandbox.run("print(input()[::-1])", "abc") -> RunResult(stdout="cba\\n", status="ok", ...)
sandbox.run_many([(program, stdin), ...])  -> [RunResult, ...] (a bounded pool of runs at once)

Each run is its own process group and session, started with an empty environment in a fresh
temporary directory that is deleted afterwards, under rlimits (CPU seconds, address space,
processes, open files, file size, no core files), killed with its whole group by SIGKILL at the
wall-clock limit or when its stdout passes the output cap (output is read in chunks, never
more than the cap). Whatever the level below, it gets a new empty session keyring and a seccomp
filter that fails every keyring system call; its oom_score_adj is 1000 (the OOM killer takes
runs before the trainer); and where this process can make cgroups (v2, else v1) it runs in a
cgroup of its own with `memory.max` (memory_bytes, for all its processes and the files of its
tmpfs) and `pids.max` (`cgroup` says which applies). What else isolates it depends on the
machine; the strongest that works is found once per process by running a probe program, and
`isolation` names the one that runs:

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

A Sandbox copied into a forked process (a worker of tasks/workers.py) runs there under uids,
cgroups and a pool of its own, claimed at its first use in that process: the parent's claims
are flocks on open files the child shares, which cannot tell the two apart, so a child on the
parent's uids would share their process counts and cgroups with the parent's runs (and its
siblings'), and end them with its own. Its `close` gives back only what it claimed.

Statuses come from what the program cannot write: the sandbox's own kills, the launcher's report
on a pipe the program never holds, and the cgroup's count of OOM kills; never from its output.

The interpreter is the trainer's own (`sys.executable`'s real path) with `-I -S -B -X utf8`:
the standard library only, no site-packages, no PYTHON* variables.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import fcntl
import functools
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
import weakref
from collections.abc import Sequence
from pathlib import Path

from jaxrl_scale.configbase import require

LEVELS = ("namespaces+uid+rlimits", "uid+rlimits", "rlimits")  # strongest first
_MODES = {"namespaces+uid+rlimits": "namespaces", "uid+rlimits": "uid", "rlimits": "rlimits"}
_UNSHARE = ("--net", "--pid", "--fork", "--mount", "--ipc", "--uts", "--kill-child")
_LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
_STDERR_TAIL = 4096  # bytes of stderr kept
_REPORT_CAP = 65536  # bytes of the launcher's report read
_CHUNK = 65536
# Unprivileged uids, one per concurrent run on the host (never two live runs on one uid): the
# process limit counts per uid, so runs sharing one would share its count. A Sandbox claims
# its uids for its life with an flock on a file per uid in UID_CLAIMS, which every process of
# this host that runs as root sees; the kernel drops the claims of a process that dies.
UID_BASE = 1_900_000_000
UID_COUNT = 100_000
UID_CLAIMS = "/run/jaxrl-sandbox/uids"
_CGROUP_FOLDER = "jaxrl-sandbox"  # the runs' cgroups: <hierarchy>/jaxrl-sandbox/run-<uid>
_works: set[tuple[str, str]] = set()  # (level, python) found to work in this process
_claiming = threading.Lock()  # a forked process's first claim for a Sandbox, one at a time


def _new_claiming_lock() -> None:
    global _claiming
    _claiming = threading.Lock()  # one held by another thread at the fork stays held


os.register_at_fork(after_in_child=_new_claiming_lock)


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
    sandbox killed it), what happened, its wall time and whether it ran in a memory cgroup.

    status: "ok" (exit 0), "error" (nonzero exit; an uncaught MemoryError, the address-space
    limit refusing memory, is one), "timeout" (the wall clock, or the CPU limit: killed by it
    after using the CPU seconds), "memory" (killed by its memory cgroup's OOM killer),
    "output_limit" (stdout over the cap), "killed" (ended by another signal), or
    "sandbox_error" (the run could not be set up)."""

    stdout: str
    stderr_tail: str
    returncode: int | None
    status: str
    seconds: float
    cgroup: bool = False


def _outcome(
    lim: SandboxLimits, launcher_code: int, report: bytes, oom: bool, stderr: str
) -> tuple[int, str, str]:
    """(exit code, status, stderr tail) of a run that ended by itself, from what its program
    cannot forge: the launcher's report (lines of JSON) and its cgroup's OOM kills."""
    said: dict = {}
    for line in report.decode("utf-8", "replace").splitlines():
        with contextlib.suppress(ValueError, TypeError):  # JSONDecodeError is a ValueError
            said.update(json.loads(line))
    code = said.get("code", launcher_code)
    if "setup_error" in said:
        return code, "sandbox_error", f"{stderr}\njaxrl-sandbox: {said['setup_error']}"
    if oom:
        return code, "memory", stderr
    if "code" not in said:  # the program cannot end the launcher, so the sandbox failed
        why = f"the launcher ended (exit {launcher_code}) without a report"
        return code, "sandbox_error", f"{stderr}\njaxrl-sandbox: {why}"
    if code == 0:
        return code, "ok", stderr
    # The CPU limit's signals: SIGXCPU at the soft limit, SIGKILL a second later (a SIGKILL
    # before the program used its seconds is "killed"). SIGXCPU always counts as the limit's:
    # the CPU time the launcher reads can lag the kernel's check on a loaded host, and a
    # program that sends it to itself only fails as it would have.
    signal_number = said.get("signal", 0)
    used = said.get("cpu_seconds", 0.0) >= 0.9 * lim.cpu_seconds
    if signal_number == signal.SIGXCPU or (signal_number == signal.SIGKILL and used):
        return code, "timeout", stderr
    return code, "killed" if signal_number else "error", stderr


class Sandbox:
    """A pool of at most `workers` concurrent runs under one isolation level.

    isolation: "auto" (the strongest level that works here) or one of LEVELS (an error if it
    does not work). allow_unisolated: permit a level below namespaces ("uid+rlimits": the
    network and world-readable files are reachable; "rlimits": no isolation beyond limits),
    which "auto" otherwise refuses. workers: runs at once (default `default_workers`: one per
    CPU core, fewer when the memory available holds fewer runs of `memory_bytes`). python: the
    interpreter (default: the trainer's own).

    uids: the unprivileged uids this process's runs take, one per worker, claimed host-wide
    until `close` (in a forked process: its own, claimed at first use). cgroup: "cgroup v2"
    or "cgroup v1" (each run in a cgroup with memory.max and pids.max), or "none (why)"."""

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
        self.workers = workers or default_workers(self.limits)
        if isolation != "auto" and isolation not in LEVELS:
            raise ValueError(f"isolation must be 'auto' or one of {LEVELS}, got {isolation!r}")
        parents = _cgroup_parents()
        self._cgroup_parents = parents if isinstance(parents, _CgroupParents) else None
        self.cgroup = f"cgroup v{parents.version}" if self._cgroup_parents else f"none ({parents})"
        self._held = self._hold()
        try:
            self.isolation = self._choose(isolation, allow_unisolated)
        except BaseException:
            self._held.release()
            raise

    def _hold(self) -> _Held:
        """New uid claims, made by this process on files it opens, with their (empty) cgroups
        and a pool: given back at `close`, or when the Sandbox is collected unclosed."""
        claims = _claim_uids(self.workers)
        free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for uid, _ in claims:
            free.put(uid)
        cgroups: dict[int, _RunCgroup | None] = {}
        return _Held(
            pid=os.getpid(),
            uids=tuple(uid for uid, _ in claims),
            free=free,
            cgroups=cgroups,
            pool=cf.ThreadPoolExecutor(self.workers, thread_name_prefix="sandbox"),
            release=weakref.finalize(self, _release, os.getpid(), claims, cgroups),
        )

    def _here(self) -> _Held:
        """What this process holds: in a process forked from the one that claimed the uids,
        claims of its own (the parent's threads, locks and claims are not its own)."""
        held = self._held
        if held.pid == os.getpid():
            return held
        with _claiming:
            if self._held.pid != os.getpid():
                self._held = self._hold()
            return self._held

    @property
    def uids(self) -> tuple[int, ...]:
        return self._here().uids

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
        return self._here().pool.submit(self.run, program, stdin)

    def run_many(self, jobs: Sequence[tuple[str, str]]) -> list[RunResult]:
        """Run every (program, stdin) on the pool; results in the order of `jobs`."""
        return [f.result() for f in [self.submit(p, s) for p, s in jobs]]

    def close(self) -> None:
        """Ends the pool (waiting for runs under way), then gives back its uids and cgroups:
        those this process claimed (a forked copy never gives back its parent's)."""
        held = self._held
        if held.pid == os.getpid():
            held.pool.shutdown(wait=True, cancel_futures=True)
            held.release()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, level: str, program: str, stdin: str) -> RunResult:
        held = self._here()
        uid = held.free.get()  # one live run per uid
        workdir = tempfile.mkdtemp(prefix="jaxrl-sandbox-")
        try:
            cgroup = self._cgroup(held, uid)
            return self._run_in(level, program, stdin, uid, workdir, cgroup)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            held.free.put(uid)

    def _cgroup(self, held: _Held, uid: int) -> _RunCgroup | None:
        """The uid's cgroup, made at its first run; None where cgroups cannot be made (the run
        goes on without one: `RunResult.cgroup` says so)."""
        if self._cgroup_parents is None:
            return None
        if uid not in held.cgroups:  # only the run holding `uid` gets here for it
            try:
                cgroup = _RunCgroup.make(self._cgroup_parents, uid, self.limits)
                cgroup.kill_all()  # a dead process's runs that outlived its claim on the uid
            except OSError:
                cgroup = None
            held.cgroups[uid] = cgroup
        return held.cgroups[uid]

    def _run_in(
        self,
        level: str,
        program: str,
        stdin: str,
        uid: int,
        workdir: str,
        cgroup: _RunCgroup | None,
    ) -> RunResult:
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
        report_read, report_write = os.pipe()  # the launcher's, never the program's
        cfg = {
            "mode": mode,
            "uid": uid,
            "workdir": workdir,
            "root": root,
            "program": program_path,
            "read_only": [prefix, "/etc/ld.so.cache"],
            "python": self.python,
            "argv": [self.python, "-I", "-S", "-B", "-X", "utf8", main],
            "report_fd": report_write,
            "cgroups": cgroup.procs if cgroup else [],
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
        oom_kills = cgroup.oom_kills() if cgroup else 0
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True,  # its own session and process group, killed as one
                close_fds=True,
                pass_fds=(report_write,),
            )
        except BaseException:
            os.close(report_read)
            raise
        finally:
            os.close(report_write)
        try:
            out, err, report, killed = _communicate(
                proc,
                report_read,
                stdin.encode("utf-8", "surrogateescape"),
                lim,
                start + lim.wall_seconds,
            )
        finally:
            _kill_group(proc.pid)
            proc.wait()
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                pipe.close()
            os.close(report_read)
            if cgroup:
                cgroup.kill_all()  # what left the process group (rlimits mode) ends too
        stderr = err.decode("utf-8", "replace")
        code = proc.returncode
        if code < 0:  # the launcher itself died of a signal
            code = 128 - code
        if killed:
            code, status = None, killed
        else:
            oom = cgroup is not None and cgroup.oom_kills() > oom_kills
            code, status, stderr = _outcome(lim, code, report, oom, stderr)
        return RunResult(
            out.decode("utf-8", "replace"),
            stderr,
            code,
            status,
            time.monotonic() - start,
            cgroup is not None,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Held:
    """What a Sandbox holds in the process `pid` that claimed it: uids claimed by flocks on
    descriptors that process opened, `free` (those of no live run), each uid's cgroup (made at
    its first run), a pool whose threads run there, and `release`, which gives back the
    claims and cgroups once, in that process only."""

    pid: int
    uids: tuple[int, ...]
    free: queue.SimpleQueue
    cgroups: dict
    pool: cf.ThreadPoolExecutor
    release: weakref.finalize


def _communicate(proc, report_fd: int, data: bytes, lim: SandboxLimits, deadline: float):
    """Feed stdin, read stdout up to the cap, the tail of stderr and the launcher's report
    until the run ends.

    Returns (stdout, stderr tail, report, None) or, when the sandbox must end the run, the
    reason as the last element ("timeout" or "output_limit") after killing its process group."""
    out, err, report = bytearray(), bytearray(), bytearray()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    sel.register(report_fd, selectors.EVENT_READ, "report")
    view = memoryview(data)
    if view:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE, "in")
    else:
        proc.stdin.close()
    open_reads = 3
    try:
        while open_reads:
            left = deadline - time.monotonic()
            if left <= 0:
                _kill_group(proc.pid)
                return bytes(out), bytes(err[-_STDERR_TAIL:]), bytes(report), "timeout"
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
                        out_capped = bytes(out[: lim.max_output_bytes])
                        return out_capped, bytes(err), bytes(report), "output_limit"
                elif key.data == "report":
                    report += chunk[: _REPORT_CAP - len(report)]
                else:
                    err += chunk
                    del err[:-_STDERR_TAIL]
        left = max(deadline - time.monotonic(), 0.0)
        try:
            proc.wait(left)  # output closed; the exit follows at once
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            return bytes(out), bytes(err), bytes(report), "timeout"
        return bytes(out), bytes(err), bytes(report), None
    finally:
        sel.close()


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def default_workers(limits: SandboxLimits) -> int:
    """One run per CPU core, and no more runs than MemAvailable holds at `memory_bytes` each."""
    cores = os.cpu_count() or 1
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return cores  # no /proc/meminfo (not Linux): cores only
    return max(1, min(cores, kib * 1024 // limits.memory_bytes))


# ---- uids claimed host-wide ----------------------------------------------------------------


def _claim_uids(n: int) -> list[tuple[int, int | None]]:
    """`n` uids no other live Sandbox on this host holds, each with the descriptor of its
    claim (an flock on UID_CLAIMS/<uid>). Only root runs programs under other uids: for
    anyone else the uids are placeholders, unclaimed (descriptor None)."""
    if os.geteuid() != 0:
        return [(UID_BASE + i, None) for i in range(n)]
    try:
        os.makedirs(UID_CLAIMS, mode=0o700, exist_ok=True)
    except OSError as e:
        raise SandboxUnavailable(f"cannot claim uids for runs in {UID_CLAIMS}: {e}") from e
    claims = []
    for uid in range(UID_BASE, UID_BASE + UID_COUNT):
        if len(claims) == n:
            return claims
        fd = _claim(uid)
        if fd is not None:
            claims.append((uid, fd))
    _release(os.getpid(), claims, {})
    raise SandboxUnavailable(
        f"{n} uids wanted, and live sandboxes on this host hold all but {len(claims)} of the "
        f"{UID_COUNT} from {UID_BASE} (claims in {UID_CLAIMS}): close some, or use fewer workers"
    )


def _claim(uid: int) -> int | None:
    """The descriptor holding the claim on `uid`, or None when another holds it."""
    path = f"{UID_CLAIMS}/{uid}"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # its holder removed the file as we opened it: claim the new one


def _release(pid: int, claims: list[tuple[int, int | None]], cgroups: dict) -> None:
    """Removes the runs' cgroups (and their parents once empty: cgroups are left in no one
    else's), then gives the uids back (each claim's file goes first); only in the process
    `pid` that claimed them (a forked child has a copy of this finalizer, run at its exit)."""
    if os.getpid() != pid:
        return
    for cgroup in cgroups.values():
        if cgroup is not None:
            cgroup.remove()
    if cgroups and isinstance(parents := _cgroup_parents(), _CgroupParents):
        parents.remove()
    cgroups.clear()
    for uid, fd in claims:
        if fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{UID_CLAIMS}/{uid}")
            os.close(fd)
    claims.clear()


# ---- cgroups -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _CgroupParents:
    """Where the runs' cgroups go: in v2 one folder; in v1 one per controller."""

    version: int
    memory: str
    pids: str

    def make(self) -> None:
        """Makes the folders (again, after the last Sandbox of a process removed them)."""
        for folder in dict.fromkeys((self.memory, self.pids)):
            _mkdir(folder)
            if self.version == 2:
                _enable_controllers(folder)

    def remove(self) -> None:
        """Removes the folders if no run's cgroup is left in them (any process's)."""
        for folder in dict.fromkeys((self.memory, self.pids)):
            with contextlib.suppress(OSError):  # not empty: another Sandbox's
                os.rmdir(folder)


@functools.cache
def _cgroup_parents() -> _CgroupParents | str:
    """The folders (made here) the runs' cgroups go in, or why there are none."""
    try:
        return make_cgroup_parents(*_cgroup_mounts())
    except OSError as e:
        return f"cannot make cgroups here: {e}"


def make_cgroup_parents(
    mounts: dict[str, tuple[str, str]], own: dict[str, str]
) -> _CgroupParents | str:
    """The runs' cgroup folders, made in the hierarchies `mounts` ({"" for v2, or a v1
    controller: (mount point, root)}), or why none can be; `own`: this process's cgroups.

    v2 (with memory and pids): <mount>/jaxrl-sandbox, at the root of the hierarchy this
    process sees, as a cgroup holding processes (this one's) cannot hand its controllers on.
    v1: <memory mount><own memory cgroup>/jaxrl-sandbox and the same for pids."""
    if "" in mounts:
        point = mounts[""][0]
        if {"memory", "pids"} <= set(_read(f"{point}/cgroup.controllers").split()):
            _enable_controllers(point)
            parents = _CgroupParents(2, f"{point}/{_CGROUP_FOLDER}", f"{point}/{_CGROUP_FOLDER}")
            parents.make()
            return parents
    if "memory" in mounts and "pids" in mounts:
        folders = []
        for controller in ("memory", "pids"):
            point, root = mounts[controller]
            path = own.get(controller, "/")
            if root != "/" and (path + "/").startswith(root + "/"):
                path = path[len(root) :]  # the mount shows the hierarchy from `root` on
            folders.append(f"{point}{path.rstrip('/')}/{_CGROUP_FOLDER}")
        parents = _CgroupParents(1, *folders)
        parents.make()
        return parents
    return "no cgroup hierarchy with the memory and pids controllers is mounted"


def _cgroup_mounts() -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """({"" (v2) or a v1 controller: (mount point, root)}, {same key: this process's cgroup})."""
    mounts: dict[str, tuple[str, str]] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            after = fields[fields.index("-") + 1 :]  # fstype, source, super options
            if after[0] == "cgroup2":
                mounts.setdefault("", (fields[4], fields[3]))
            elif after[0] == "cgroup":
                for controller in set(after[2].split(",")) & {"memory", "pids"}:
                    mounts.setdefault(controller, (fields[4], fields[3]))
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(","):
                own[controller] = path
    return mounts, own


def _enable_controllers(folder: str) -> None:
    wanted = {"memory", "pids"} - set(_read(f"{folder}/cgroup.subtree_control").split())
    if wanted:
        _write(f"{folder}/cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(wanted)))


def _mkdir(path: str) -> None:
    """One cgroup (never its parents: a missing one means a wrong path, not one to make)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


@dataclasses.dataclass(frozen=True)
class _RunCgroup:
    """One uid's cgroup (v2), or its memory and pids cgroups (v1): one run at a time."""

    version: int
    folders: tuple[str, ...]  # the memory one first

    @classmethod
    def make(cls, parents: _CgroupParents, uid: int, lim: SandboxLimits) -> _RunCgroup:
        """Made (or taken over from a process that died holding the uid) with the limits:
        memory_bytes for all the run's memory, its tmpfs files included, and no swap;
        max_processes, and one for the launcher, for its processes and threads."""
        memory, pids = f"{parents.memory}/run-{uid}", f"{parents.pids}/run-{uid}"
        for tries_left in (1, 0):
            try:
                parents.make()
                for folder in dict.fromkeys((memory, pids)):
                    _mkdir(folder)
                break
            except FileNotFoundError:  # another process removed the emptied parents
                if not tries_left:
                    raise
        if parents.version == 2:
            _write(f"{memory}/memory.max", lim.memory_bytes)
            if os.path.exists(f"{memory}/memory.swap.max"):
                _write(f"{memory}/memory.swap.max", 0)
        else:  # memory+swap must stay >= memory: set it around the memory limit
            swap = f"{memory}/memory.memsw.limit_in_bytes"
            with contextlib.suppress(OSError):  # lower than the old memory limit, or no swap
                _write(swap, lim.memory_bytes)
            _write(f"{memory}/memory.limit_in_bytes", lim.memory_bytes)
            with contextlib.suppress(OSError):
                _write(swap, lim.memory_bytes)
        _write(f"{pids}/pids.max", lim.max_processes + 1)
        return cls(parents.version, tuple(dict.fromkeys((memory, pids))))

    @property
    def procs(self) -> list[str]:
        """The files the launcher writes itself into."""
        return [f"{folder}/cgroup.procs" for folder in self.folders]

    def oom_kills(self) -> int:
        """Processes its OOM killer has killed so far."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for line in _read(f"{self.folders[0]}/{name}").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def kill_all(self) -> None:
        """SIGKILL to every process left in it."""
        with contextlib.suppress(OSError):  # ProcessLookupError: gone already
            for pid in _read(f"{self.folders[0]}/cgroup.procs").split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)

    def remove(self) -> None:
        self.kill_all()
        for folder in self.folders:
            with contextlib.suppress(OSError):  # still emptying: the next claimant reuses it
                os.rmdir(folder)
