import json

import numpy as np

from jaxrl_scale.cli import main
from jaxrl_scale.fit import bootstrap_sigmoid
from jaxrl_scale.rl.metrics import read_metrics
from jaxrl_scale.rl.rollout import sampling_sd

# The demo's pipeline at toy scale: warm start here (--from-scratch), 10 RL steps, every one
# evaluated, then the final fit and the half-run forecast. The online forecast leaves out the
# evals below 0.3 of the latest one's compute, so it fits at most 8 points (one padded width
# to compile) with the 200 resamples tests/test_forecast.py compiles too.
SMALL = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_layers=1",
    "task.arithmetic.max_digits=1",
    "task.num_train=64",
    "task.num_eval=16",
    "train.prompts_per_step=8",
    "train.group_size=4",
    "train.steps=10",
    "train.eval_every=1",
    "train.eval_samples=2",
    "forecast.bootstrap=200",
    "forecast.c_min_fraction=0.3",
]


def test_demo_from_scratch_trains_fits_and_reports(tmp_path, capsys, monkeypatch):
    import jaxrl_scale.demo as demo

    monkeypatch.setattr(demo, "WARM_START_STEPS", 30)
    args = ["demo", "--out", str(tmp_path), "--from-scratch"]
    for o in SMALL:
        args += ["--set", o]
    assert main(args) == 0
    out = capsys.readouterr().out
    for label in ("pass rate before RL", "fitted ceiling A [95%]", "fit at half the run said"):
        assert label in out
    for name in ("metrics.jsonl", "fit.png", "fit.json", "tensorboard"):
        assert (tmp_path / name).exists() and str(tmp_path / name) in out
    assert (tmp_path / "policy" / "model.safetensors").exists()  # the warm start it made
    summary = json.loads((tmp_path / "fit.json").read_text())
    rows = read_metrics(tmp_path)
    evals = [r for r in rows if r.get("eval_pass_rate") is not None]
    assert [r["step"] for r in evals] == list(range(11))
    # R0 is the step-0 evaluation; the fit is over the 10 evaluations after it.
    assert summary["r0"] == evals[0]["eval_pass_rate"]
    assert summary["final_pass_rate"] == evals[-1]["eval_pass_rate"]
    compute = np.array([r["compute_flops"] for r in evals[1:]])
    rate = np.array([r["eval_pass_rate"] for r in evals[1:]])
    # The fit is told each eval's logged sampling sd (and R0's).
    sds = np.array([r["eval_sampling_sd"] for r in evals[1:]])
    again = bootstrap_sigmoid(
        compute, rate, n=2000, r0=summary["r0"], eval_sd=sds, r0_sd=evals[0]["eval_sampling_sd"]
    )
    assert summary["a"] == float(again.fit.a) and summary["a_ci"] == list(again.ci["a"])
    half = summary["half_run"]
    assert half["c_cut"] == 0.5 * compute[-1] and half["actual_final"] == rate[-1]
    assert half["points_fitted"] == int((compute <= 0.5 * compute[-1]).sum())
    # Every evaluation after the first few carries the online forecast.
    assert all("forecast_status" in r for r in evals[4:])
    # And its sampling sd: with 16 prompts x 2 samples scored 0 or 1, a prompt's two scores
    # have variance 0 or 1/2, so (32 sd)^2 counts the prompts whose two samples disagree.
    mixed = np.array([(32 * r["eval_sampling_sd"]) ** 2 for r in evals])
    assert np.allclose(mixed, np.round(mixed), atol=1e-6) and np.all((mixed >= 0) & (mixed <= 16))
    assert mixed.max() >= 1  # a half-trained policy disagrees with itself somewhere


def test_sampling_sd_by_hand():
    # prompt 1 scores (1, 0, 1, 1): variance 1/4 (ddof 1); prompt 2 (0, 0, 0, 0): 0.
    # sqrt((1/4 + 0) / 4) / 2 = 1/8.
    assert sampling_sd([[1, 0, 1, 1], [0, 0, 0, 0]]) == 0.125
    assert np.isnan(sampling_sd([[1], [0]]))  # one sample per prompt: no within-prompt spread


def test_demo_without_its_policy_says_how_to_make_it(tmp_path, capsys, monkeypatch):
    import jaxrl_scale.models.hf as hf

    monkeypatch.setattr(hf, "asset_path", lambda name: tmp_path / "missing" / name)
    assert main(["demo", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "make_demo_policy.py" in err and "--from-scratch" in err


def test_demo_without_its_config_is_an_error_not_default_settings(tmp_path, capsys, monkeypatch):
    import jaxrl_scale.config as config

    monkeypatch.setattr(config, "asset_path", lambda name: tmp_path / "missing" / name)
    assert main(["demo", "--out", str(tmp_path / "run")]) == 2
    assert "demo.yaml: no such config file" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing ran


def test_a_built_wheel_carries_what_the_demo_needs(tmp_path):
    """The demo's config and starting policy ship in the wheel; an installed package reads
    them from itself, not from a source tree."""
    import shutil
    import subprocess
    import sys
    import zipfile

    from conftest import ROOT

    source = tmp_path / "source"  # a copy: the build writes next to the sources
    skip = shutil.ignore_patterns(".*", "runs", "build", "dist", "*.egg-info", "__pycache__")
    shutil.copytree(ROOT, source, ignore=skip)
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*build, "-w", str(tmp_path), str(source)], check=True, timeout=300)
    (wheel,) = tmp_path.glob("jaxrl_scale-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(site)
    for name in ("demo.yaml", "demo_policy/config.json", "demo_policy/model.safetensors"):
        assert f"jaxrl_scale/assets/{name}" in names
    code = (
        "import jaxrl_scale.config as c, jaxrl_scale.models.hf as hf; "
        "print(c.asset_path('demo.yaml')); print(hf.resolve_checkpoint('asset:demo_policy')); "
        "cfg = c.load_config(c.asset_path('demo.yaml')); print(cfg.train.steps)"
    )
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    config_path, policy_path, steps = out.stdout.split()
    assert config_path.startswith(str(site)) and policy_path.startswith(str(site))
    assert int(steps) == 300


def test_bad_override_exits_2_naming_key(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--set", "model.num_layer=1"]) == 2
    assert "model.num_layers" in capsys.readouterr().err
