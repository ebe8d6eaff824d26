"""The code task from the config (task.code.*), and a CPU run whose reward is the policy's own
programs run in the sandbox, with the held-out pass rate rising."""

import numpy as np
import pytest
from conftest import FIXTURES, TINY_CONFIG

from jaxrl_scale.config import ConfigError, load_config
from jaxrl_scale.models.tokenizer import CharTokenizer
from jaxrl_scale.tasks import make_scorer, make_task
from jaxrl_scale.tasks.code import CodeTask
from jaxrl_scale.train import train


@pytest.fixture
def code_sums(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES / "tasks"))
    import code_sums

    return code_sums


def test_the_code_task_from_its_config_section(code_sums, tmp_path):
    data = code_sums.write_problems(tmp_path / "sums.jsonl", n=4)
    overrides = [
        "task.name=code", f"task.code.data={data}", "task.num_eval=4", "task.num_train=0",
        "task.code.partial_credit=true", "task.code.workers=2", "task.code.limits.wall_seconds=5",
    ]  # fmt: skip
    cfg = load_config(TINY_CONFIG, overrides)
    task = make_task(cfg.task, seed=0, tokenizer=CharTokenizer(code_sums.ALPHABET))
    assert isinstance(task, CodeTask) and len(task.eval_examples) == 4
    assert len(task.train_examples) == 12  # 16 problems, 4 held out
    e = task.train_examples[0]
    a, b = e["question"].split("+")
    right = f"```python\nprint({a}+{b})\n```"
    wrong = f"```python\nprint({a}-{b}-1)\n```"
    scored = make_scorer(cfg.task, task)([right, wrong, "no program"], [e, e, e])
    np.testing.assert_array_equal(scored.rewards, [1.0, 0.0, 0.0])
    assert scored.counts["code_runs"] == 2 and scored.counts["code_no_block"] == 1


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["task.name=code"], r"task.code.data: the code task needs"),
        (["task.code.limits.wall_seconds=0"], r"task.code.limits.wall_seconds: must be > 0"),
        (["task.code.limits.max_processes=1"], r"task.code.limits.max_processes: must be >= 2"),
        (["task.code.isolation=docker"], r"task.code.isolation: expected one of 'auto'"),
        (["task.code.limits.wall_secs=3"], r"unknown config key 'task.code.limits.wall_secs'"),
        (["task.code.template=no placeholder"], r"task.code.template: must contain"),
    ],
)
def test_bad_code_settings_are_errors_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        make_task(load_config(TINY_CONFIG, overrides).task, seed=0, tokenizer=None)


def test_a_run_rewarded_by_running_its_own_programs_rises(code_sums, tmp_path):
    """a+b= answered by a program printing it: a warm start on demonstrations that print a
    wrong sum a third of the time, then RL on what the programs print in the sandbox."""
    data = code_sums.write_problems(tmp_path / "sums.jsonl")
    overrides = [
        "task.name=code_sums:make", f"task.args.data={data}", "task.args.num_eval=32",
        "task.num_train=0", "sampler.max_new_tokens=24", "train.prompts_per_step=8",
        "train.group_size=8", "train.steps=8", "train.eval_every=8", "train.eval_samples=4",
        "warm_start.steps=300", "warm_start.target_loss=0", "warm_start.batch_size=32",
        "pipeline.mode=sync", "checkpoint.every=0", "mesh.data=1",
    ]  # fmt: skip
    rows = train(load_config(TINY_CONFIG, overrides), tmp_path / "run")
    evals = [r["eval_pass_rate"] for r in rows if "eval_pass_rate" in r]
    assert len(evals) == 2
    # Measured: 0.72-0.73 -> 0.82-0.89 over steps 0 and 16 (on two machines); 0.727 -> 0.844
    # over 8 steps (this 2-core VM, 2026-11-28), the length the test runs.
    assert evals[-1] > evals[0] + 0.05
    for r in rows[1:]:
        # Every one of the step's 64 completions ran as a program or had none to run.
        assert r["code_runs"] + r["code_no_block"] == 64
        assert r["reward_errors"] == 0 and r["score_seconds"] > 0
