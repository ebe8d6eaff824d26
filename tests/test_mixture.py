"""A mixture of tasks: the config, the weighted pool, scoring by domain, evaluation and one
fitted curve per domain."""

import json
from collections import Counter

import numpy as np
import pytest
from conftest import FAST, FIXTURES, TINY_CONFIG

from jaxrl_scale.cli import main
from jaxrl_scale.config import ConfigError, load_config
from jaxrl_scale.tasks import MixtureTask, make_scorer, make_task
from jaxrl_scale.train import train

TWO = [
    "task.name=mixture",
    "task.mixture=[{name: arithmetic, weight: 3}, "
    "{name: 'user_task:make', weight: 1, args: {n_train: 40}}]",
]


@pytest.fixture
def user_module(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES / "tasks"))
    import user_task

    return user_task


def test_the_pool_holds_the_domains_in_proportion_to_their_weights(user_module):
    cfg = load_config(TINY_CONFIG, [*TWO, "task.num_train=200", "task.num_eval=8"])
    task = make_task(cfg.task, seed=0)
    assert isinstance(task, MixtureTask) and list(task.components) == ["arithmetic", "make"]
    counts = Counter(e["domain"] for e in task.train_examples)
    # sums has 40 examples at a quarter of the pool: 160 in all, 120 of them arithmetic.
    assert counts == {"arithmetic": 120, "make": 40}
    assert len({e["prompt"] for e in task.train_examples if e["domain"] == "make"}) == 40
    # Shuffled: the first quarter of the pool is not one domain.
    assert 0 < sum(e["domain"] == "make" for e in task.train_examples[:40]) < 40
    held_out = Counter(e["domain"] for e in task.eval_examples)
    assert held_out == {"arithmetic": 8, "make": 8}
    # One tokenizer for every domain: the first one's (no model tokenizer here).
    assert task.components["make"].tokenizer is task.tokenizer
    assert task.tokenizer is task.components["arithmetic"].tokenizer


def test_each_sample_is_scored_by_its_domain_and_logged_per_domain(user_module, tmp_path):
    import code_sums

    data = code_sums.write_problems(tmp_path / "sums.jsonl", n=4)
    code = f"{{name: 'code_sums:make', args: {{data: '{data}', num_eval: 4}}, domain: code}}"
    three = [TWO[0], TWO[1].replace("}]", "}, " + code + "]")]
    cfg = load_config(TINY_CONFIG, three)
    task = make_task(cfg.task, seed=0)
    a, s, c = (next(e for e in task.train_examples if e["domain"] == d)
               for d in ("arithmetic", "make", "code"))  # fmt: skip
    x, y = c["question"].split("+")
    program = f"```python\nprint({x}+{y})\n```"
    scored = make_scorer(cfg.task, task)(
        [str(a["answer"]), "x", str(s["answer"]), "7x", program, program.replace("+", "-")],
        [a, a, s, s, c, c],
    )
    # arithmetic: exact match; sums: correct + 0.25 x format (its reward_weights); code: the
    # program's output, run in the sandbox (the batch scorer of its domain).
    np.testing.assert_allclose(scored.rewards, [1.0, 0.0, 1.25, 0.0, 1.0, float(y == "0")])
    # The pass signal: sums' "correct" part (its pass_part), the others' rewards.
    np.testing.assert_allclose(scored.passed, [1.0, 0.0, 1.0, 0.0, 1.0, float(y == "0")])
    stats = scored.stats()
    assert stats["reward_mean/arithmetic"] == 0.5 and stats["reward_mean/make"] == 0.625
    assert stats["reward/correct"] == 0.5  # parts over the samples that return them
    assert stats["code_runs"] == 2


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["task.name=mixture"], r"task.mixture: a mixture needs its components"),
        (["task.mixture=[{name: math}]"], r"task.mixture: is read only with task.name: mixture"),
        (["task.name=mixture", "task.mixture=[{name: chess}]"], r"task.mixture\[0\].name"),
        (
            ["task.name=mixture", "task.mixture=[{name: math, weight: 0}]"],
            r"task.mixture\[0\].weight: must be > 0",
        ),
        (
            ["task.name=mixture", "task.mixture=[{name: math}, {name: math}]"],
            r"domains \['math'\] repeat",
        ),
        (["task.name=mixture", "task.mixture=[{name: math, wieght: 1}]"], r"wieght"),
    ],
)
def test_a_bad_mixture_is_an_error_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY_CONFIG, overrides)


def test_a_mixture_run_logs_and_fits_one_curve_per_domain(user_module, tmp_path, capsys):
    overrides = [
        *FAST, *TWO, "train.steps=4", "train.eval_every=1", "forecast.min_points=4",
        "forecast.every=2", "forecast.bootstrap=200",
    ]  # fmt: skip
    rows = train(load_config(TINY_CONFIG, overrides), tmp_path)
    evals = [r for r in rows if "eval_pass_rate" in r]
    assert len(evals) == 5
    for r in evals:
        # The overall rate is the mean over both domains' 8 prompts each.
        both = (r["eval_pass_rate/arithmetic"] + r["eval_pass_rate/make"]) / 2
        assert r["eval_pass_rate"] == pytest.approx(both)
        assert r["eval_sampling_sd/make"] >= 0
    for r in rows[1:]:
        assert {"reward_mean/arithmetic", "reward_mean/make"} & set(r)
    # The online forecast refits each domain's curve beside the overall one (every 2nd eval).
    for r, points in ((rows[2], 2), (rows[4], 4)):
        for suffix in ("", "/arithmetic", "/make"):
            assert r[f"forecast_points{suffix}"] == points
            assert r[f"forecast_status{suffix}"]
    # The offline fitter reads a domain's column (and its sampling sd) from the run.
    capsys.readouterr()
    args = ["fit", str(tmp_path), "--y", "eval_pass_rate/make", "--json", "--bootstrap", "100"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["y"] == "eval_pass_rate/make"
    fitted = report["runs"][0]
    assert fitted["points"] == 4 and fitted["r0"] == rows[0]["eval_pass_rate/make"]
