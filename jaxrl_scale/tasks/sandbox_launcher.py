"""The sandbox's launcher: sets up one run's isolation, then runs the untrusted program under it.

Started by `sandbox.Sandbox` as `python -I -S -B sandbox_launcher.py CONFIG_JSON` (inside
`unshare --net --pid --fork --mount --ipc --uts --kill-child` when namespaces are used), so it
imports only the standard library and trusts nothing but its argument. Steps:

1. mode "namespaces": it is PID 1 of a new PID namespace with a private mount namespace. It
   builds a new root on a tmpfs: read-only bind mounts of /usr (and /bin, /lib, /lib64 links),
   the interpreter's prefix and /etc/ld.so.cache; /dev with null, zero, random, urandom; /tmp
   and the working directory /work as size-capped tmpfs; then chroots into it. No /proc, no
   /sys, no /home, /root or project files.
2. It forks. The child drops supplementary groups, gid and uid to the run's unprivileged id
   (modes "namespaces" and "uid"), sets no_new_privs, the rlimits, and execs the interpreter on
   the program with an empty environment (only PATH and LANG).
3. The launcher (root, which the program cannot signal) waits for the program (killing it
   a little after the wall-clock limit should the trainer be gone) and exits with its status:
   the exit code, or 128 + signal. In mode "uid" it then kills every process left
   under the run's uid; in mode "namespaces" its own exit kills the whole namespace.

A setup failure exits 125 with a line "jaxrl-sandbox: ..." on stderr.
"""

import ctypes
import json
import os
import resource
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38
SETUP_FAILED = 125
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _bind_read_only(source: str, target: str) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(source, target, None, MS_BIND | MS_REC)
    kept = os.statvfs(target).f_flag & (MS_NOEXEC | MS_NODEV)  # flags the source must keep
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | kept)


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


def _run_program(cfg: dict) -> None:
    """In the forked child: drop privileges and limits, then exec the program (never returns)."""
    try:
        uid = cfg["uid"]
        if cfg["mode"] in ("namespaces", "uid"):
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)  # a fresh uid per concurrent run: RLIMIT_NPROC counts this run only
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
        _limit(cfg)
        os.closerange(3, 65536)
        os.execve(cfg["python"], cfg["argv"], ENV)
    except BaseException as e:
        os.write(2, f"jaxrl-sandbox: cannot start the program: {e}\n".encode())
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
    try:
        if cfg["mode"] == "namespaces":
            _new_root(cfg)
        else:
            os.chdir(cfg["workdir"])
        pid = os.fork()
    except BaseException as e:
        print(f"jaxrl-sandbox: setup failed: {e}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
    if pid == 0:
        _run_program(cfg)
    # A backstop of our own for the wall clock, should the trainer die before it kills us.
    signal.signal(signal.SIGALRM, lambda *_: os.kill(pid, signal.SIGKILL))
    signal.alarm(int(cfg["wall_seconds"]) + 2)
    for fd in (0, 1):  # the program's ends stay with it; ours close so EOF reaches the host
        os.close(fd)
    while True:  # as PID 1 we also reap orphans; the program's own status ends the loop
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(SETUP_FAILED)
        if done == pid:
            break
    if cfg["mode"] == "uid":
        _kill_uid(cfg["uid"])
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    main()
