"""The sandbox's launcher: sets up one run's isolation, then runs the untrusted program under it.

Started by `sandbox.Sandbox` as `python -I -S -B sandbox_launcher.py CONFIG_JSON` (inside
`unshare --net --pid --fork --mount --ipc --uts --kill-child` when namespaces are used), so it
imports only the standard library and trusts nothing but its argument. Steps:

1. It sets its oom_score_adj to 1000 (the program inherits it, and, as the program is
   unprivileged, cannot lower it): under memory pressure the kernel kills runs, not the
   trainer. It joins the run's cgroups (memory.max, pids.max) when the Sandbox made some.
2. mode "namespaces": it is PID 1 of a new PID namespace with a private mount namespace. It
   builds a new root on a tmpfs: read-only bind mounts of /usr (and /bin, /lib, /lib64 links),
   the interpreter's prefix and /etc/ld.so.cache, every mount below them read-only too; /dev
   with null, zero, random, urandom; /tmp and the working directory /work as size-capped
   tmpfs; then chroots into it. No /proc, no /sys, no /home, /root or project files.
3. It forks. The child drops supplementary groups, gid and uid to the run's unprivileged id
   (modes "namespaces" and "uid"), joins a new empty session keyring, sets no_new_privs,
   installs a seccomp filter that fails add_key, request_key and keyctl with EPERM (no
   keyring is reachable, nothing stored in one outlives the run), sets the rlimits and execs
   the interpreter on the program with an empty environment (only PATH and LANG).
4. The launcher (root, which the program cannot signal) waits for the program (killing it
   a little after the wall-clock limit should the trainer be gone) and exits with its status:
   the exit code, or 128 + signal. In mode "uid" it then kills every process left
   under the run's uid; in mode "namespaces" its own exit kills the whole namespace.

It reports to the Sandbox on its own pipe (`report_fd`, closed on exec so the program never
holds it), one JSON object a line: {"setup_error": why} when the run could not be set up
(then it exits 125), else {"code": exit status, "signal": the signal that ended the program or
0, "cpu_seconds": its CPU time}. The program's output says nothing of the sandbox's statuses.
"""

import contextlib
import ctypes
import errno
import json
import os
import re
import resource
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SETUP_FAILED = 125
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
# The keyring system calls (add_key, request_key, keyctl) and the audit arch of each machine.
KEYRING_CALLS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 ABI: the same calls under other numbers
KEYCTL_JOIN_SESSION_KEYRING = 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _bind_read_only(source: str, target: str) -> None:
    """Bind `source` at `target` with every mount below it, each one read-only and nosuid."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(source, target, None, MS_BIND | MS_REC)
    for point in _mounts_at_or_below(target):  # a bind's read-only flag is the top mount's only
        kept = os.statvfs(point).f_flag & (MS_NOEXEC | MS_NODEV)  # flags the source must keep
        _mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | kept)


def _mounts_at_or_below(path: str) -> list[str]:
    """Mount points at or below `path` in this mount namespace (/proc/self/mountinfo)."""
    below = path.rstrip("/") + "/"
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:  # field 5 is the mount point, with space, tab, newline, \\ as \\ooo
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4])
            if point == path or point.startswith(below):
                points.append(point)
    return list(dict.fromkeys(points))


def _new_root(cfg: dict) -> None:
    """Builds the run's filesystem under a tmpfs and chroots into it (cwd: /work)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates to the host
    root = cfg["root"]  # an empty directory of the host's (the run's temporary one)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for name in ("bin", "lib", "lib64", "lib32", "sbin"):  # merged-/usr links, or real dirs
        path = "/" + name
        if os.path.islink(path):
            os.symlink(os.readlink(path), root + path)
        elif os.path.isdir(path):
            _bind_read_only(path, root + path)
    _bind_read_only("/usr", root + "/usr")
    for path in cfg["read_only"]:  # the interpreter's prefix, /etc/ld.so.cache
        if os.path.exists(path) and not os.path.exists(root + path):
            _bind_read_only(path, root + path)
    os.makedirs(root + "/dev")
    _mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID, "size=64k,mode=755")
    for dev in ("null", "zero", "random", "urandom"):
        open(f"{root}/dev/{dev}", "w").close()
        _mount(f"/dev/{dev}", f"{root}/dev/{dev}", None, MS_BIND)
    disk = cfg["disk_bytes"]
    for path, mode in (("/tmp", "1777"), ("/work", "755")):
        os.makedirs(root + path)
        flags = MS_NOSUID | MS_NODEV
        _mount("tmpfs", root + path, "tmpfs", flags, f"size={disk},nr_inodes=4096,mode={mode}")
    with open(cfg["program"], "rb") as src, open(root + "/work/main.py", "wb") as dst:
        dst.write(src.read())
    os.chown(root + "/work", cfg["uid"], cfg["uid"])
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "mode=755")
    os.chroot(root)
    os.chdir("/work")


def _limit(cfg: dict) -> None:
    cpu = cfg["cpu_seconds"]
    for rlimit, value, hard in (
        (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL a second on
        (resource.RLIMIT_AS, cfg["memory_bytes"], None),
        (resource.RLIMIT_NPROC, cfg["max_processes"], None),
        (resource.RLIMIT_NOFILE, cfg["max_open_files"], None),
        (resource.RLIMIT_FSIZE, cfg["max_file_bytes"], None),
        (resource.RLIMIT_CORE, 0, None),
        (resource.RLIMIT_MEMLOCK, 0, None),
        (resource.RLIMIT_MSGQUEUE, 0, None),
    ):
        resource.setrlimit(rlimit, (value, value if hard is None else hard))


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def keyring_filter(machine: str) -> list[tuple[int, int, int, int]]:
    """A classic BPF seccomp program: add_key, request_key and keyctl fail with EPERM, as does
    every call of another ABI (i386 or x32 on x86_64); everything else is allowed.

    Returns its instructions (code, jt, jf, k)."""
    if machine not in KEYRING_CALLS:
        raise OSError(errno.ENOSYS, f"no keyring filter for this machine ({machine})")
    ld_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, ..|JGE|K, RET|K
    allow, deny = 0x7FFF0000, 0x00050000 | errno.EPERM  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO
    tests = [(jeq, n) for n in KEYRING_CALLS[machine]]
    if machine == "x86_64":
        tests.append((jge, X32_SYSCALL_BIT))
    # 0: arch; 1: native? skip 2; 2: deny; 3: nr; 4..: each test jumps to the last (deny)
    program = [(ld_abs, 0, 0, 4), (jeq, 1, 0, AUDIT_ARCH[machine]), (ret, 0, 0, deny)]
    program.append((ld_abs, 0, 0, 0))
    for i, (op, k) in enumerate(tests):
        program.append((op, len(tests) - i, 0, k))  # over the later tests and the allow
    return [*program, (ret, 0, 0, allow), (ret, 0, 0, deny)]


def _shut_keyrings() -> None:
    """A new empty session keyring, then no keyring system call at all (seccomp)."""
    machine = os.uname().machine
    program = keyring_filter(machine)  # another machine fails here, before the join
    joined = _libc.syscall(KEYRING_CALLS[machine][2], KEYCTL_JOIN_SESSION_KEYRING, None)
    if joined < 0 and ctypes.get_errno() not in (errno.EPERM, errno.ENOSYS):  # not blocked
        _check(-1, "keyctl(join session keyring)")
    filters = (_SockFilter * len(program))(*program)
    prog = _SockFprog(len(program), filters)
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")


def _report(fd: int, **fields) -> None:
    os.write(fd, (json.dumps(fields) + "\n").encode())


def _run_program(cfg: dict, report: int) -> None:
    """In the forked child: drop privileges and limits, then exec the program (never returns)."""
    try:
        uid = cfg["uid"]
        if cfg["mode"] in ("namespaces", "uid"):
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)  # a fresh uid per concurrent run: RLIMIT_NPROC counts this run only
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
        _shut_keyrings()
        _limit(cfg)
        os.closerange(3, report)  # `report` itself is close-on-exec
        os.closerange(report + 1, 65536)
        os.execve(cfg["python"], cfg["argv"], ENV)
    except BaseException as e:
        _report(report, setup_error=f"cannot start the program: {e}")
    os._exit(SETUP_FAILED)


def _kill_uid(uid: int) -> None:
    """Kill every process running as `uid` (from a child that takes that uid: kill(-1))."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)  # all processes this uid may signal, except itself
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    report = cfg["report_fd"]
    try:
        os.set_inheritable(report, False)
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # the OOM killer's first choice: runs, not the trainer
        for procs in cfg["cgroups"]:  # each cgroup's cgroup.procs ("0": this process)
            with open(procs, "w") as f:
                f.write("0")
        if cfg["mode"] == "namespaces":
            _new_root(cfg)
        else:
            os.chdir(cfg["workdir"])
        pid = os.fork()
    except BaseException as e:
        _report(report, setup_error=f"setup failed: {e}")
        os._exit(SETUP_FAILED)
    if pid == 0:
        _run_program(cfg, report)
    # A backstop of our own for the wall clock, should the trainer die before it kills us.
    signal.signal(signal.SIGALRM, lambda *_: os.kill(pid, signal.SIGKILL))
    signal.alarm(int(cfg["wall_seconds"]) + 2)
    for fd in (0, 1):  # the program's ends stay with it; ours close so EOF reaches the host
        os.close(fd)
    while True:  # as PID 1 we also reap orphans; the program's own status ends the loop
        try:
            done, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            _report(report, setup_error="the program's process vanished")
            os._exit(SETUP_FAILED)
        if done == pid:
            break
    if cfg["mode"] == "uid":
        with contextlib.suppress(OSError):  # its pids cgroup full: the host kills them then
            _kill_uid(cfg["uid"])
    killed_by = 0 if os.WIFEXITED(status) else os.WTERMSIG(status)
    code = 128 + killed_by if killed_by else os.WEXITSTATUS(status)
    _report(report, code=code, signal=killed_by, cpu_seconds=usage.ru_utime + usage.ru_stime)
    os._exit(code)


if __name__ == "__main__":
    main()
