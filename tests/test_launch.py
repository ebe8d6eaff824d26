"""The launchers: shellcheck-clean, and their dry runs print the commands they would run."""

import os
import shlex
import shutil
import subprocess

import pytest
from conftest import ROOT

LAUNCH = ROOT / "launch"
SCRIPTS = sorted([*LAUNCH.glob("*.sh"), *LAUNCH.glob("*.sbatch")])


def _dry(script, *args, env=None):
    result = subprocess.run(
        ["bash", str(LAUNCH / script), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    return [shlex.split(line) for line in result.stdout.splitlines()]


def test_shellcheck_passes():
    shellcheck = shutil.which("shellcheck") or str(ROOT / ".venv" / "bin" / "shellcheck")
    result = subprocess.run([shellcheck, *map(str, SCRIPTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_local_multiprocess_dry_run():
    lines = _dry(
        "local_multiprocess.sh",
        "--dry-run",
        "--processes",
        "3",
        "--port",
        "29611",
        "--",
        "--config",
        "configs/tiny_arithmetic.yaml",
        "--out",
        "runs/mp",
    )
    assert len(lines) == 3
    for i, words in enumerate(lines):
        assert "JAXRL_COORDINATOR=127.0.0.1:29611" in words
        assert f"JAXRL_PROCESS_ID={i}" in words and "JAXRL_NUM_PROCESSES=3" in words
        assert words[words.index("jaxrl-scale") :] == [
            "jaxrl-scale",
            "train",
            "--config",
            "configs/tiny_arithmetic.yaml",
            "--out",
            "runs/mp",
        ]


def test_slurm_dry_run():
    import os

    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
    args = ("--dry-run", "--config", "c.yaml", "--out", "/shared/x")
    (words,) = _dry("gpu_slurm.sbatch", *args, env=env)
    # JAX's pool on each GPU: 0.95 of the device unless the environment says otherwise.
    assert words == [
        "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95",
        "srun",
        "--kill-on-bad-exit=1",
        "jaxrl-scale",
        "train",
        "--config",
        "c.yaml",
        "--out",
        "/shared/x",
    ]


def test_slurm_keeps_a_memory_fraction_the_user_set():
    import os

    env = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}
    (words,) = _dry("gpu_slurm.sbatch", "--dry-run", "--config", "c.yaml", env=env)
    assert words[0] == "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9"


def test_tpu_pod_dry_run_creates_installs_and_runs_on_every_worker():
    lines = _dry(
        "tpu_pod.sh",
        "--dry-run",
        "--name",
        "pod",
        "--zone",
        "us-central2-b",
        "--type",
        "v4-32",
        "--",
        "--config",
        "c.yaml",
        "--out",
        "gs://b/run one",
    )
    assert lines[0][:5] == ["gcloud", "compute", "tpus", "tpu-vm", "create"]
    assert "v4-32" in lines[0]
    install, train = lines[1], lines[2]
    assert "--worker=all" in install and "pip install" in install[-1]
    assert "--worker=all" in train
    assert shlex.split(train[-1]) == [
        "jaxrl-scale",
        "train",
        "--config",
        "c.yaml",
        "--out",
        "gs://b/run one",
    ]


@pytest.mark.parametrize("script", ["local_multiprocess.sh", "gpu_slurm.sbatch", "tpu_pod.sh"])
def test_missing_train_arguments_is_an_error(script):
    result = subprocess.run(
        ["bash", str(LAUNCH / script), "--dry-run"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "train" in result.stderr


def test_local_disaggregated_dry_run():
    env = {**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=0"}
    lines = _dry("local_disaggregated.sh", "--dry-run", "--port", "29700", "--devices", "4",
                 "2", "3", "--", "--config", "c.yaml", "--out", "runs/d", env=env)  # fmt: skip
    trainers = [w for w in lines if "JAXRL_ROLE=trainer" in w]
    generators = [w for w in lines if "JAXRL_ROLE=generator" in w]
    assert len(trainers) == 2 and len(generators) == 3
    for i, words in enumerate(trainers):
        assert f"JAXRL_PROCESS_ID={i}" in words and "JAXRL_COORDINATOR=127.0.0.1:29700" in words
    for g, words in enumerate(generators):
        assert f"JAXRL_GROUP={g}" in words and not any("COORDINATOR" in w for w in words)
    # The caller's XLA flags are kept; each process's device count comes last (and wins).
    flags = "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count="
    assert all(f"XLA_FLAGS={flags}4" in w for w in trainers)
    assert all(f"XLA_FLAGS={flags}2" in w for w in generators)
    for words in lines:
        tail = words[words.index("jaxrl-scale") :]
        assert tail[:6] == ["jaxrl-scale", "train", "--config", "c.yaml", "--out", "runs/d"]
        assert "hosts.generator_groups=3" in tail and "hosts.hub=127.0.0.1:29701" in tail
    bad = subprocess.run(["bash", str(LAUNCH / "local_disaggregated.sh"), "--dry-run", "0", "1",
                          "--", "--out", "x"], capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "positive integers" in bad.stderr
