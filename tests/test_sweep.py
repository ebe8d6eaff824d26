"""The recipe study runner: configs x seeds, per-run fits, comparison, resumability."""

import json

import numpy as np
import pytest
from conftest import ROOT

from jaxrl_scale.cli import main
from jaxrl_scale.fit import bootstrap_sigmoid
from jaxrl_scale.fit.report import run_curve
from jaxrl_scale.rl.metrics import read_metrics
from jaxrl_scale.sweep import mean_curve

# conftest.FAST's policy and batch shapes, padded train steps (no packing) and 8 evaluations
# after step 0: the sweep runs the train steps the other FAST runs compile, and its fits the
# 8-point programs of tests/test_forecast.py and tests/test_cli.py's online forecast.
TOY = """base: {tiny}
model: {{hidden_size: 32, intermediate_size: 64, num_layers: 1}}
task: {{num_train: 64, num_eval: 8, arithmetic: {{max_digits: 1}}}}
train: {{prompts_per_step: 4, group_size: 4, steps: 8, eval_every: 1, eval_samples: 2,
         packing: false}}
warm_start: {{steps: 20}}
sampler: {{max_new_tokens: 4}}
pipeline: {{mode: sync}}
checkpoint: {{every: 0}}
forecast: {{every: 0}}
mesh: {{data: 1}}
"""


@pytest.fixture
def configs(tmp_path):
    paths = []
    for kind in ("cispo", "dapo", "gspo"):
        path = tmp_path / "study" / f"{kind}.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(
            TOY.format(tiny=ROOT / "configs" / "tiny_arithmetic.yaml") + f"loss: {{kind: {kind}}}\n"
        )
        paths.append(path)
    return paths


def test_sweep_runs_fits_compares_and_resumes(configs, tmp_path, monkeypatch, capsys):
    import jaxrl_scale.train as train_module

    out = tmp_path / "runs"
    real_train = train_module.train
    trained = []

    def dies_on_the_fourth(cfg, out, **kwargs):
        trained.append(out)
        if len(trained) == 4:
            raise KeyboardInterrupt  # the sweep is killed during its 4th run
        return real_train(cfg, out, **kwargs)

    monkeypatch.setattr(train_module, "train", dies_on_the_fourth)
    args = [
        "sweep",
        *map(str, configs),
        "--seeds",
        "0",
        "1",
        "--out",
        str(out),
        "--bootstrap",
        "200",
    ]
    with pytest.raises(KeyboardInterrupt):
        main(args)
    assert len(list(out.glob("*/seed*/result.json"))) == 3
    trained.clear()
    monkeypatch.setattr(
        train_module, "train", lambda *a, **kw: trained.append(1) or real_train(*a, **kw)
    )
    assert main(args) == 0
    assert len(trained) == 3  # only the runs not yet finished
    printed = capsys.readouterr().out
    assert "finished earlier, skipped" in printed and "ranking by the recipe's A" in printed

    study = json.loads((out / "study.json").read_text())
    assert [(r["config"], r["seed"]) for r in study["runs"]] == [
        (k, s) for k in ("cispo", "dapo", "gspo") for s in (0, 1)
    ]
    assert (out / "study.png").exists() and (out / "study.md").exists()
    assert study["predictive_validity"]["runs"] == 6
    assert sorted(study["ranking"]) == ["cispo", "dapo", "gspo"]
    by_config = {c["config"]: c for c in study["configs"]}
    # The recipe's A is the mean of its seeds' own A; configs are ranked by it, and every pair
    # of configs gets a ceiling verdict.
    for name, c in by_config.items():
        seeds_a = [r["a"] for r in study["runs"] if r["config"] == name]
        assert c["recipe_a"] == pytest.approx(np.mean(seeds_a))
        lo, hi = c["recipe_a_ci"]
        assert lo <= c["recipe_a"] <= hi
    assert study["ranking"] == sorted(by_config, key=lambda k: -by_config[k]["recipe_a"])
    assert len(study["ceilings"]) == 3
    # A config's curve is its seeds' eval curves averaged step by step, fitted with R0 held at
    # their mean step-0 eval.
    rows = [read_metrics(out / "dapo" / f"seed{s}") for s in (0, 1)]
    step0 = [next(r["eval_pass_rate"] for r in run if r["step"] == 0) for run in rows]
    evals = [[r["eval_pass_rate"] for r in run if r["step"] > 0] for run in rows]
    curve = mean_curve(rows, "dapo")
    assert curve.r0 == pytest.approx(np.mean(step0))
    np.testing.assert_allclose(curve.reward, np.mean(evals, axis=0))
    again = bootstrap_sigmoid(curve.compute, curve.reward, n=200, r0=curve.r0)
    assert by_config["dapo"]["a"] == pytest.approx(float(again.fit.a))
    # Per run: R0 is that run's step-0 eval.
    run = next(r for r in study["runs"] if r["config"] == "gspo" and r["seed"] == 1)
    gspo = read_metrics(out / "gspo" / "seed1")
    assert run["r0"] == next(r["eval_pass_rate"] for r in gspo if r["step"] == 0)
    assert run["r0"] == run_curve(gspo).r0

    # --refit fits finished runs again from their metrics and trains nothing: a result.json
    # whose fit is stale (here: tampered) gets the fit back.
    result = out / "gspo" / "seed1" / "result.json"
    stale = json.loads(result.read_text())
    result.write_text(json.dumps({**stale, "a": 0.123, "a_ci": [0.1, 0.2]}))
    trained.clear()
    assert main([*args, "--refit"]) == 0
    assert trained == [] and "finished earlier, refitted" in capsys.readouterr().out
    refitted = json.loads(result.read_text())
    assert refitted["a"] == pytest.approx(stale["a"]) and refitted["a_ci"] != [0.1, 0.2]
    assert refitted["wall_seconds"] == stale["wall_seconds"]


def test_duplicate_config_names_are_an_error(configs, tmp_path, capsys):
    other = tmp_path / "other" / "cispo.yaml"
    other.parent.mkdir()
    other.write_text(configs[0].read_text())
    assert main(["sweep", str(configs[0]), str(other), "--out", str(tmp_path / "o")]) == 2
    assert "unique" in capsys.readouterr().err
