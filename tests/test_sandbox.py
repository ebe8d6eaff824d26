"""The sandbox against hostile programs, and the code task's scoring on top of it.

Each attack must end within its time bound with a non-ok status (so it scores 0), leave this
process and its files alive, and leak nothing. Limits are small so the file runs in seconds on a
shared 2-core machine: at most 8 processes per run, 1 CPU second, 2 s wall clock.
"""

import dataclasses
import errno
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time

import pytest
from conftest import ROOT

from jaxrl_scale.models.tokenizer import CharTokenizer
from jaxrl_scale.tasks.code import (
    CodeDataError,
    CodeTask,
    last_code_block,
    normalise_output,
    same_value,
)
from jaxrl_scale.tasks.sandbox import LEVELS, Sandbox, SandboxLimits, SandboxUnavailable

LIMITS = SandboxLimits(
    wall_seconds=2.0,
    cpu_seconds=1,
    memory_bytes=256 << 20,
    max_processes=8,
    max_output_bytes=64 << 10,
    disk_bytes=8 << 20,
)
TOK = CharTokenizer("0123456789")


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(LIMITS, workers=2) as s:
        yield s


def run_bounded(sandbox, program, stdin="", bound=5.0):
    start = time.monotonic()
    result = sandbox.run(program, stdin)
    assert time.monotonic() - start < bound, result
    assert os.getpid() > 0  # still here
    return result


def test_isolation_level_is_reported(sandbox):
    print(f"isolation on this machine: {sandbox.isolation}")
    assert sandbox.isolation in LEVELS
    if os.geteuid() == 0 and sandbox.isolation != LEVELS[0]:
        pytest.fail(f"root on Linux should get namespaces, got {sandbox.isolation}")


def test_a_plain_run(sandbox):
    r = sandbox.run("import sys\nprint(sys.stdin.read()[::-1])", "abc")
    assert (r.stdout, r.status, r.returncode) == ("cba\n", "ok", 0)
    r = sandbox.run("raise SystemExit(3)")
    assert (r.status, r.returncode) == ("error", 3)
    r = sandbox.run("import sys; print(len(sys.stdin.read()))", "x" * 3_000_000)  # > pipe buffer
    assert r.stdout == "3000000\n"


def test_the_run_sees_no_trainer_environment_or_files(sandbox, monkeypatch):
    monkeypatch.setenv("JAXRL_TEST_SECRET", "hunter2")
    program = (
        "import os, glob\n"
        "print(sorted(os.environ.items()))\n"
        "for p in glob.glob('/proc/*/environ'):\n"
        "    try: print(open(p, 'rb').read())\n"
        "    except OSError: pass\n"
        "print(os.getcwd(), os.listdir('/'))\n"
    )
    r = run_bounded(sandbox, program)
    assert r.status == "ok" and "hunter2" not in r.stdout and "JAXRL" not in r.stdout
    if sandbox.isolation.startswith("namespaces"):
        assert "work" in r.stdout and "'home'" not in r.stdout and "'proc'" not in r.stdout


def test_infinite_loop(sandbox):
    r = run_bounded(sandbox, "while True:\n    pass\n", bound=4.0)
    assert r.status == "timeout"


def test_sleeping_past_the_wall_clock(sandbox):
    r = run_bounded(sandbox, "import time\ntime.sleep(60)\n", bound=4.0)
    assert r.status == "timeout" and r.returncode is None
    assert 1.9 < r.seconds < 4.0


def test_fork_bomb(sandbox):
    program = (
        "import os, time\n"
        "n = 0\n"
        "for _ in range(10_000):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "    except OSError:\n"
        "        break\n"
        "print(n, flush=True)\n"
        "while True: os.fork() if False else time.sleep(1)\n"
    )
    r = run_bounded(sandbox, program, bound=5.0)
    assert r.status == "timeout"
    assert int(r.stdout) < LIMITS.max_processes  # the process limit held
    after = sandbox.run("print('alive')")
    assert after.stdout == "alive\n"  # no leftovers hold this worker's process count


def test_fork_bomb_that_spins(sandbox):
    program = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    r = run_bounded(sandbox, program, bound=5.0)
    assert r.status != "ok"
    assert sandbox.run("print(1)").stdout == "1\n"


def test_memory_bomb(sandbox):
    r = run_bounded(sandbox, "x = bytearray(8 << 30)\n")  # the address-space limit refuses
    assert r.status == "error" and r.stderr_tail.rstrip().endswith("MemoryError")
    r = run_bounded(sandbox, "x = []\nwhile True:\n    x.append(b'x' * (16 << 20))\n")
    assert r.status in ("error", "memory")  # refused, or killed by the memory cgroup


def test_a_gigabyte_of_output(sandbox):
    program = "import sys\nb = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(b)\n"
    r = run_bounded(sandbox, program, bound=4.0)
    assert r.status == "output_limit" and len(r.stdout) == LIMITS.max_output_bytes
    r = run_bounded(sandbox, program.replace("stdout", "stderr"), bound=4.0)
    assert r.status == "ok" and len(r.stderr_tail) <= 4096  # stderr: only its tail is kept


def test_writing_and_deleting_files_outside_its_directory(sandbox, tmp_path):
    secret = tmp_path / "private"
    secret.mkdir(mode=0o700)
    canary = secret / "canary.txt"
    canary.write_text("alive")
    canary.chmod(0o600)
    trainer_file = os.path.join(os.getcwd(), "sandbox-was-here.txt")
    program = (
        "import os, shutil\n"
        f"for path in [{str(canary)!r}, {trainer_file!r}, '/usr/x', '/etc/passwd', '/bin/sh']:\n"
        "    for act in (lambda: open(path, 'w').write('pwned'), lambda: os.remove(path)):\n"
        "        try:\n"
        "            act(); print('did', path)\n"
        "        except OSError:\n"
        "            pass\n"
        f"shutil.rmtree({str(tmp_path)!r}, ignore_errors=True)\n"
        "open('mine.txt', 'w').write('ok'); print(open('mine.txt').read())\n"
    )
    r = run_bounded(sandbox, program)
    assert r.status == "ok" and "did" not in r.stdout and r.stdout.endswith("ok\n"), r
    assert canary.read_text() == "alive" and stat.S_IMODE(canary.stat().st_mode) == 0o600
    assert not os.path.exists(trainer_file)
    assert os.path.exists("/bin/sh")


def test_writing_a_file_past_the_size_limit(sandbox):
    program = "f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * (1 << 20))\n"
    assert run_bounded(sandbox, program).status != "ok"


def test_no_network(sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    program = (
        "import socket\n"
        f"s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "s.sendall(b'leak')\n"
        "print('connected')\n"
    )
    try:
        r = run_bounded(sandbox, program)
        assert r.status == "error" and "connected" not in r.stdout
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()


def test_killing_its_parent_and_everyone_else(sandbox):
    for program in (
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('done')",
        "import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('done')",
        "import os, signal\nos.killpg(0, signal.SIGKILL)\nprint('done')",
    ):
        r = run_bounded(sandbox, program)
        assert r.status != "ok" and "done" not in r.stdout  # it may not signal, or only itself
        assert sandbox.run("print(1)").stdout == "1\n"  # the sandbox (and this process) lives


def test_many_runs_at_once(sandbox):
    jobs = [(f"print({i} * 2)", "") for i in range(12)] + [("while True: pass", "")]
    results = sandbox.run_many(jobs)
    assert [r.stdout for r in results[:12]] == [f"{i * 2}\n" for i in range(12)]
    assert results[-1].status == "timeout"


def test_unisolated_runs_need_an_opt_in():
    with pytest.raises(SandboxUnavailable, match="allow_unisolated"):
        Sandbox(LIMITS, isolation="rlimits", workers=1)
    with Sandbox(LIMITS, isolation="rlimits", allow_unisolated=True, workers=1) as s:
        assert s.run("print(2)").stdout == "2\n"
    with pytest.raises(ValueError, match="isolation"):
        Sandbox(LIMITS, isolation="docker")


# ---- what no run may keep, forge or share ----------------------------------------------------

# A program calling the keyring system calls through libc: search and read a key of the
# session keyring, then plant keys in its session and user keyrings.
KEYRING_PROGRAM = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
ADD_KEY, KEYCTL = {add_key}, {keyctl}
found = libc.syscall(KEYCTL, 10, ctypes.c_long(-3), b"user", b"jaxrl-test-secret", 0)
print("search", found, ctypes.get_errno())
buf = ctypes.create_string_buffer(64)
size = libc.syscall(KEYCTL, 11, ctypes.c_long(found), buf, 64)
print("read", buf.raw[: max(size, 0)])
for ring in (-3, -4):  # session, user
    added = libc.syscall(ADD_KEY, b"user", b"jaxrl-test-planted", b"x", 1, ctypes.c_long(ring))
    print("add", added, ctypes.get_errno())
"""


def keyring_calls():
    """add_key, request_key and keyctl's numbers on this machine."""
    calls = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}.get(os.uname().machine)
    if calls is None:
        pytest.skip(f"no keyring system call numbers for {os.uname().machine} in this test")
    return calls


def test_a_program_reaches_no_keyring(sandbox):
    import ctypes

    add_key, _, keyctl = keyring_calls()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    # This process's own session keyring (inherited by what it starts) holds a secret.
    assert libc.syscall(keyctl, 1, None) > 0, ctypes.get_errno()  # join a new one
    secret = libc.syscall(add_key, b"user", b"jaxrl-test-secret", b"hunter2", 7, ctypes.c_long(-3))
    assert secret > 0, ctypes.get_errno()
    try:
        r = run_bounded(sandbox, KEYRING_PROGRAM.format(add_key=add_key, keyctl=keyctl))
        assert r.status == "ok", r
        assert "hunter2" not in r.stdout
        assert r.stdout.split("\n")[0] == "search -1 1"  # EPERM
        assert r.stdout.count("add -1 1") == 2, r.stdout
        # Nothing planted here either (the program's keyrings went with it).
        found = libc.syscall(keyctl, 10, ctypes.c_long(-3), b"user", b"jaxrl-test-planted", 0)
        assert found == -1
    finally:
        libc.syscall(keyctl, 3, ctypes.c_long(secret))  # revoke


def run_bpf(program, arch, nr):
    """What a classic BPF seccomp program returns for a call (only the opcodes it uses)."""
    pc = acc = 0
    while True:
        code, jt, jf, k = program[pc]
        if code == 0x20:  # load a word of seccomp_data: nr at 0, arch at 4
            acc = {0: nr, 4: arch}[k]
        elif code in (0x15, 0x35):  # jeq, jge
            pc += jt if (acc == k if code == 0x15 else acc >= k) else jf
        elif code == 0x06:
            return k
        pc += 1


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_keyring_filter_denies_exactly_the_keyring_calls(machine):
    from jaxrl_scale.tasks.sandbox_launcher import AUDIT_ARCH, KEYRING_CALLS, keyring_filter

    program = keyring_filter(machine)
    arch, allow, eperm = AUDIT_ARCH[machine], 0x7FFF0000, 0x00050001
    for nr in KEYRING_CALLS[machine]:
        assert run_bpf(program, arch, nr) == eperm
    for nr in (0, 1, 59, 221, 247, 251, 400):  # read, write, execve, ... neighbours
        if nr not in KEYRING_CALLS[machine]:
            assert run_bpf(program, arch, nr) == allow, nr
    assert run_bpf(program, 0x40000003, 1) == eperm  # another ABI (i386): nothing
    if machine == "x86_64":
        assert run_bpf(program, arch, 0x40000000 + 250) == eperm  # x32's keyctl
    with pytest.raises(OSError, match="no keyring filter for this machine"):
        keyring_filter("riscv64")


@pytest.fixture(scope="module")
def unisolated():
    """Runs as this process's user (root here), where /proc shows the program itself."""
    with Sandbox(LIMITS, isolation="rlimits", allow_unisolated=True, workers=1) as s:
        yield s


def test_runs_are_the_oom_killers_first_choice(unisolated):
    r = run_bounded(unisolated, "print(open('/proc/self/oom_score_adj').read())")
    assert (r.status, r.stdout.strip()) == ("ok", "1000")
    with open("/proc/self/oom_score_adj") as f:
        assert f.read().strip() != "1000"  # not the trainer


def need_cgroup(sandbox):
    if sandbox.cgroup.startswith("none"):
        pytest.skip(f"no cgroup for runs on this machine: {sandbox.cgroup}")


def test_a_run_holds_its_memory_limit_over_all_its_processes(sandbox):
    """Three processes of 100 MiB each: each under its address-space limit (256 MiB), all
    together over the run's memory cgroup (256 MiB)."""
    need_cgroup(sandbox)
    program = (
        "import os, time\n"
        "pids = []\n"
        "for _ in range(3):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        x = b'x' * (100 << 20)\n"
        "        time.sleep(0.5)\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "print([os.waitpid(p, 0)[1] for p in pids])\n"
    )
    r = run_bounded(sandbox, program)
    assert r.cgroup and r.status == "memory", r
    assert sandbox.run("print(1)").stdout == "1\n"


def test_a_run_as_root_holds_its_process_limit(unisolated):
    """Root ignores RLIMIT_NPROC; the run's pids cgroup does not."""
    need_cgroup(unisolated)
    program = (
        "import os, time\n"
        "n = 0\n"
        "for _ in range(30):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os.close(1), os.close(2), time.sleep(5), os._exit(0)\n"
        "        n += 1\n"
        "    except OSError:\n"
        "        break\n"
        "print(n)\n"
    )
    r = run_bounded(unisolated, program)
    assert r.status == "ok" and r.cgroup
    assert int(r.stdout) == LIMITS.max_processes - 1  # with the program itself: the limit
    assert unisolated.run("print(1)").stdout == "1\n"  # its children are gone


def test_the_runs_cgroups_in_a_v2_hierarchy(tmp_path):
    """Where the runs' cgroups go and what they are given, on a stand-in for a cgroup v2
    hierarchy (plain files where the kernel has its own: this machine may have v1)."""
    from jaxrl_scale.tasks.sandbox import _RunCgroup, make_cgroup_parents

    (tmp_path / "cgroup.controllers").write_text("cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("cpu\n")
    (tmp_path / "jaxrl-sandbox").mkdir()
    (tmp_path / "jaxrl-sandbox/cgroup.subtree_control").write_text("")
    parents = make_cgroup_parents({"": (str(tmp_path), "/")}, {"": "/system.slice/trainer"})
    assert parents.version == 2 and parents.memory == parents.pids == f"{tmp_path}/jaxrl-sandbox"
    for folder in (tmp_path, tmp_path / "jaxrl-sandbox"):  # both pass the controllers on
        assert (folder / "cgroup.subtree_control").read_text() == "+memory +pids"
    run = tmp_path / "jaxrl-sandbox/run-7"
    run.mkdir()
    (run / "memory.swap.max").write_text("max")
    cgroup = _RunCgroup.make(parents, 7, LIMITS)
    assert (run / "memory.max").read_text() == str(LIMITS.memory_bytes)
    assert (run / "memory.swap.max").read_text() == "0"
    assert (run / "pids.max").read_text() == str(LIMITS.max_processes + 1)  # and the launcher
    assert cgroup.procs == [f"{run}/cgroup.procs"]
    (run / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 1\n")
    assert cgroup.oom_kills() == 1
    (tmp_path / "cgroup.controllers").write_text("cpu io\n")  # no memory controller in v2
    assert make_cgroup_parents({"": (str(tmp_path), "/")}, {}).startswith("no cgroup")


def test_the_runs_cgroups_in_v1_hierarchies(tmp_path):
    from jaxrl_scale.tasks.sandbox import _RunCgroup, make_cgroup_parents

    (tmp_path / "memory/jobs/trainer").mkdir(parents=True)
    (tmp_path / "pids").mkdir()
    mounts = {"memory": (f"{tmp_path}/memory", "/"), "pids": (f"{tmp_path}/pids", "/")}
    parents = make_cgroup_parents(mounts, {"memory": "/jobs/trainer", "pids": "/"})
    assert parents.version == 1
    assert parents.memory == f"{tmp_path}/memory/jobs/trainer/jaxrl-sandbox"  # under its own
    assert parents.pids == f"{tmp_path}/pids/jaxrl-sandbox"
    cgroup = _RunCgroup.make(parents, 7, LIMITS)
    memory, pids = cgroup.folders
    with open(f"{memory}/memory.limit_in_bytes") as f:
        assert f.read() == str(LIMITS.memory_bytes)
    with open(f"{pids}/pids.max") as f:
        assert f.read() == str(LIMITS.max_processes + 1)
    with open(f"{memory}/memory.oom_control", "w") as f:
        f.write("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert cgroup.oom_kills() == 3
    with pytest.raises(FileNotFoundError):  # never makes a cgroup's parents
        make_cgroup_parents(mounts, {"memory": "/elsewhere", "pids": "/"})


def test_workers_default_to_what_memory_and_cores_hold():
    huge = dataclasses.replace(LIMITS, memory_bytes=1 << 50)  # more than this machine has
    with Sandbox(huge) as s:
        assert s.workers == 1
    with Sandbox(huge, workers=3) as s:
        assert s.workers == 3
    from jaxrl_scale.tasks.sandbox import default_workers

    assert default_workers(huge) == 1
    assert default_workers(dataclasses.replace(LIMITS, memory_bytes=1 << 20)) == os.cpu_count()


@pytest.mark.parametrize(
    ("program", "status"),
    [
        (
            "import sys\nsys.stderr.write('jaxrl-sandbox: setup failed: x\\n')\nsys.exit(125)",
            "error",
        ),
        ("import sys\nsys.stderr.write('Traceback:\\nMemoryError\\n')\nsys.exit(1)", "error"),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "killed"),  # no CPU used
    ],
)
def test_statuses_printed_by_a_program_are_not_the_sandboxs(sandbox, program, status):
    r = run_bounded(sandbox, program)
    assert r.status == status, r


def test_a_launcher_that_reports_nothing_is_a_sandbox_error():
    with pytest.raises(SandboxUnavailable, match="without a report"):
        Sandbox(LIMITS, isolation="rlimits", allow_unisolated=True, python="/bin/true")


def test_uids_are_claimed_host_wide(sandbox):
    from jaxrl_scale.tasks.sandbox import UID_CLAIMS

    if os.geteuid() != 0:
        pytest.skip("uids are claimed only by root (no one else runs programs under them)")
    # More uids than a process once took from its block before wrapping around.
    with Sandbox(LIMITS, workers=600) as a, Sandbox(LIMITS, workers=600) as b:
        assert len(set(a.uids) | set(b.uids) | set(sandbox.uids)) == 1202
        claimed = a.uids[0]
        assert os.path.exists(f"{UID_CLAIMS}/{claimed}")
    assert not os.path.exists(f"{UID_CLAIMS}/{claimed}")  # given back at close
    # Another process whose pid differs from this one's by 100000.
    child = (
        "import json, os, sys\n"
        "os.getpid = lambda: int(sys.argv[1]) + 100_000\n"
        "from jaxrl_scale.tasks.sandbox import Sandbox, SandboxLimits\n"
        "with Sandbox(SandboxLimits(), workers=2) as s:\n"
        "    print(json.dumps(s.uids), flush=True)\n"
        "    sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child, str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        theirs = json.loads(proc.stdout.readline())
        assert len(theirs) == 2 and not set(theirs) & set(sandbox.uids)
    finally:
        proc.stdin.close()
        assert proc.wait(30) == 0


# A run that says which uid it ran under, then stays for the seconds on its stdin.
UID_PROGRAM = "import os, time\nprint(os.getuid(), flush=True)\ntime.sleep(float(input()))\n"


def test_a_forked_process_runs_under_uids_of_its_own():
    """A Sandbox copied into a forked process (an environment's worker) claims its own uids:
    its runs never share a uid, a process count or a cgroup with the parent's runs under way,
    and its close gives back nothing of the parent's."""
    import select

    from jaxrl_scale.tasks.sandbox import UID_CLAIMS

    if os.geteuid() != 0:
        pytest.skip("uids are claimed only by root (no one else runs programs under them)")
    limits = dataclasses.replace(LIMITS, wall_seconds=15.0)  # room for a loaded machine
    try:  # the uid level where unshare is missing: that is enough to show the uids
        s = Sandbox(limits, workers=2, allow_unisolated=True)
    except SandboxUnavailable as e:
        pytest.skip(f"no sandbox with an unprivileged uid here: {e}")
    with s:
        ours = set(s.uids)
        parent_run = s.submit(UID_PROGRAM, "2.5")  # under way while the child runs
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, give back its own, and never return into pytest
            try:
                os.close(read_end)
                r = s.run(UID_PROGRAM, "0.3")
                report = {"uids": list(s.uids), "status": r.status, "stdout": r.stdout}
                s.close()
                os.write(write_end, json.dumps(report).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        try:
            ready, _, _ = select.select([read_end], [], [], 20)
            child = json.loads(os.read(read_end, 65536) or "null") if ready else None
        finally:
            os.close(read_end)
            if not ready:
                os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert child is not None, "the child's run never ran (no uid free in its copy)"
        assert len(child["uids"]) == 2 and not set(child["uids"]) & ours, child
        assert child["status"] == "ok" and int(child["stdout"]) in child["uids"], child
        r = parent_run.result()  # not ended with the child's run (same uid, same cgroup)
        assert r.status == "ok" and int(r.stdout) in ours, r
        # The child's close left the parent's claims alone: a fresh claimant skips them.
        assert all(os.path.exists(f"{UID_CLAIMS}/{uid}") for uid in ours)
        with Sandbox(LIMITS, workers=2, allow_unisolated=True) as other:
            assert not set(other.uids) & ours
        r = s.run("import os\nprint(os.getuid())")  # the parent's Sandbox runs on
        assert r.status == "ok" and int(r.stdout) in ours, r


def test_read_only_binds_are_read_only_below_too(tmp_path):
    """A mount below a read-only bind's source is read-only in the bind as well."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to make a private mount namespace")
    from jaxrl_scale.tasks import sandbox_launcher

    source, target = tmp_path / "source", tmp_path / "target"
    script = (
        "import importlib.util, os, sys\n"
        "spec = importlib.util.spec_from_file_location('launcher', sys.argv[1])\n"
        "m = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(m)\n"
        "source, target = sys.argv[2], sys.argv[3]\n"
        "m._mount(None, '/', None, m.MS_REC | m.MS_PRIVATE)\n"
        "os.makedirs(source + '/below')\n"
        "m._mount('tmpfs', source + '/below', 'tmpfs', 0, 'size=1m')\n"
        "m._bind_read_only(source, target)\n"
        "for path in (target + '/top.txt', target + '/below/x.txt'):\n"
        "    try:\n"
        "        open(path, 'w').close()\n"
        "        print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno)\n"
        "open(source + '/below/x.txt', 'w').close()  # the source stays writable\n"
    )
    done = subprocess.run(
        ["unshare", "--mount", sys.executable, "-I", "-S", "-c", script,
         sandbox_launcher.__file__, str(source), str(target)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == [f"refused {errno.EROFS}"] * 2, done.stdout


# ---- the code task ------------------------------------------------------------------------


def write_rows(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


ADD = {
    "prompt": "Read two integers and print their sum.",
    "tests": [
        {"input": "1 2\n", "output": "3\n"},
        {"input": "5 5\n", "output": "10"},
        {"input": "-1 1\n", "output": "0\n"},
    ],
    "solution": "a, b = map(int, input().split())\nprint(a + b)",
}
FN = {
    "prompt": "Return the square of x.",
    "fn_name": "square",
    "tests": [{"args": [3], "output": 9}, {"args": [-2], "output": 4}],
}


def fenced(code, language="python"):
    return f"Here you go:\n```{language}\n{code}\n```\n"


@pytest.fixture(scope="module")
def task(sandbox, tmp_path_factory):
    folder = tmp_path_factory.mktemp("code")
    data = write_rows(folder / "train.jsonl", [ADD, FN, ADD])
    held_out = write_rows(folder / "eval.jsonl", [ADD])
    return CodeTask(data=data, eval_data=held_out, tokenizer=TOK, num_eval=1, sandbox=sandbox)


def test_code_blocks_and_output_comparison():
    text = "```python\nprint(1)\n```\nthen\n```\nprint(2)\n```\n```cpp\nint main(){}\n```"
    assert last_code_block(text) == "print(2)"  # last python/unlabelled block; cpp ignored
    assert last_code_block("no code") is None
    assert last_code_block("```python\nprint(1)\n") is None  # never closed
    assert normalise_output("\n 3  \n4\t\n\n") == "3\n4"


def test_right_wrong_and_partial_scores(task, sandbox, tmp_path):
    add = next(e for e in task.train_examples if "fn_name" not in e)
    right = fenced("a, b = map(int, input().split())\nprint(a + b)")
    assert task.score(right, add) == 1.0
    assert task.score(fenced("print(3)"), add) == 0.0
    assert task.score("print(3)", add) == 0.0  # no block
    assert task.score(fenced("print(0)") + "\n" + right, add) == 1.0  # the last block wins
    assert task.score(right + fenced("print(0)"), add) == 0.0
    partial = CodeTask(
        data=write_rows(tmp_path / "d.jsonl", [ADD, ADD]),
        tokenizer=TOK,
        num_eval=1,
        partial_credit=True,
        sandbox=sandbox,
    )
    assert partial.score(fenced("print(3)"), add) == pytest.approx(1 / 3)
    assert partial.score(fenced("while True: pass"), add) == 0.0


def test_function_call_tests(task):
    fn = next(e for e in task.train_examples if "fn_name" in e)
    assert task.score(fenced("def square(x):\n    print('noise')\n    return x * x"), fn) == 1.0
    solution = "class Solution:\n    def square(self, x):\n        return x ** 2"
    assert task.score(fenced(solution), fn) == 1.0
    assert task.score(fenced("def square(x):\n    return x + x"), fn) == 0.0


@pytest.mark.parametrize(
    ("got", "want", "same"),
    [
        (1, 1, True),
        (True, 1, False),  # Python's True == 1
        (1, True, False),
        (False, 0, False),
        (True, True, True),
        (1.0, 1, False),  # a float is not an expected int
        (1, 1.0, True),  # an int stands for an expected float of equal value
        (0.5, 0.5, True),
        ([1, True], [1, 1], False),
        ([1, [2]], [1, [2]], True),
        ([1], [1, 2], False),
        ({"a": True}, {"a": 1}, False),
        ({"a": 1}, {"a": 1}, True),
        ({"a": 1}, {"b": 1}, False),
        ("1", 1, False),
        (None, None, True),
        (None, 0, False),
    ],
)
def test_function_call_results_compare_by_value_and_type(got, want, same):
    assert same_value(got, want) is same


def test_a_function_returning_true_does_not_pass_for_1(task):
    one = {"prompt": "p", "question": "p", "fn_name": "f", "tests": [{"args": [], "output": 1}]}
    assert task.score(fenced("def f():\n    return 1"), one) == 1.0
    assert task.score(fenced("def f():\n    return True"), one) == 0.0
    assert task.score(fenced("def f():\n    return 1.0"), one) == 0.0
    half = {**one, "tests": [{"args": [], "output": 2.0}]}
    assert task.score(fenced("def f():\n    return 2"), half) == 1.0


def test_score_many_stats_and_demonstration(task):
    add = next(e for e in task.train_examples if "fn_name" not in e)
    task.stats()
    completions = [task.demonstration(add), "nothing", fenced("import time\ntime.sleep(9)")]
    assert task.score_many(completions, [add] * 3) == [1.0, 0.0, 0.0]
    stats = task.stats()
    assert stats["code_runs"] == 6 and stats["code_timeouts"] == 3
    assert stats["code_cgroup_runs"] == (0 if task.sandbox.cgroup.startswith("none") else 6)
    assert stats["code_no_block"] == 1 and stats["code_seconds"] > 0
    assert task.stats()["code_runs"] == 0  # reset
    with pytest.raises(ValueError, match="solution"):
        task.demonstration(next(e for e in task.train_examples if "fn_name" in e))


def test_a_program_printing_the_sandboxs_errors_is_an_ordinary_program(task):
    add = next(e for e in task.train_examples if "fn_name" not in e)
    task.stats()
    forged = "import sys\nsys.stderr.write('jaxrl-sandbox: setup failed: x\\n')\nsys.exit(125)"
    assert task.score(fenced(forged), add) == 0.0
    stats = task.stats()
    assert stats["code_runs"] >= 1 and stats["code_errors"] == 0  # not the sandbox's failure


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("{not json", "2: not valid JSON"),
        ({"tests": [{"input": "", "output": ""}]}, "2: missing or empty 'prompt'"),
        ({"prompt": "p", "tests": []}, "2: 'tests' must be a non-empty list"),
        ({"prompt": "p", "tests": [{"input": 1, "output": "1"}]}, r"2: tests\[0\] needs"),
        ({"prompt": "p", "fn_name": "f", "tests": [{"args": 1, "output": 1}]}, r"2: tests\[0\]"),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path, sandbox, row, message):
    path = write_rows(tmp_path / "bad.jsonl", [ADD, row])
    with pytest.raises(CodeDataError, match=f"bad.jsonl:{message}"):
        CodeTask(data=path, tokenizer=TOK, num_eval=1, sandbox=sandbox)


# ---- the other sandbox: jinja2's, which renders checkpoints' chat templates ------------------


def test_jinja2_is_required_past_its_published_sandbox_escapes():
    """jinja2 3.1.4 and 3.1.5 let a template escape the sandbox (`str.format`, `|attr`); chat
    templates come from downloaded checkpoints (models/chat.py)."""
    import re

    import jinja2
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if re.match(r"jinja2\b", d)]
    floor = re.fullmatch(r"jinja2>=(\d+)\.(\d+)\.(\d+)", pin.replace(" ", ""))
    assert floor is not None, pin
    assert tuple(map(int, floor.groups())) >= (3, 1, 6)
    assert tuple(map(int, jinja2.__version__.split(".")[:3])) >= (3, 1, 6)
