"""reasoning-gym's datasets as a task: built from the config, graded by the library's own
score_answer, and trained on."""

import sys

import pytest
import reasoning_gym
from conftest import FAST, TINY_CONFIG

from jaxrl_scale.config import ConfigError, load_config
from jaxrl_scale.tasks import make_scorer, make_task
from jaxrl_scale.tasks.reasoning_gym import final_answer
from jaxrl_scale.train import train

TWO = [
    "task.name=reasoning_gym",
    "task.reasoning_gym.datasets={basic_arithmetic: 1, leg_counting: 1}",
]


def test_problems_come_from_the_weighted_datasets_and_score_as_the_library_does():
    cfg = load_config(TINY_CONFIG, [*TWO, "task.num_train=40", "task.num_eval=8"])
    task = make_task(cfg.task, seed=3)
    assert len(task.train_examples) == 40 and len(task.eval_examples) == 8
    sources = {e["dataset"] for e in task.train_examples}
    assert sources == {"basic_arithmetic", "leg_counting"}
    e = task.train_examples[0]
    assert e["prompt"].startswith(e["entry"]["question"])
    # The same problem from the library itself, graded by its own function.
    reference = reasoning_gym.get_score_answer_fn(e["dataset"])
    right, wrong = f"<answer> {e['answer']} </answer>", "<answer>no idea</answer>"
    assert reference(e["answer"], e["entry"]) == 1.0
    scored = make_scorer(cfg.task, task)([right, wrong, f"x <answer>1</answer> {right}"], [e] * 3)
    assert list(scored.rewards) == [1.0, reference("no idea", e["entry"]), 1.0]
    assert final_answer("no tags 42 ") == "no tags 42"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["task.name=reasoning_gym"], r"task.reasoning_gym.datasets: name at least one"),
        (
            ["task.name=reasoning_gym", "task.reasoning_gym.datasets={no_such_dataset: 1}"],
            r"task.reasoning_gym: reasoning-gym could not build",
        ),
        ([*TWO, "task.reasoning_gym.configs={chess: {}}"], r"task.reasoning_gym.configs"),
        (["task.reasoning_gym.datasets={leg_counting: 0}"], r"weights must be > 0"),
    ],
)
def test_bad_settings_are_errors_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        make_task(load_config(TINY_CONFIG, overrides).task, seed=0)


def test_without_the_extra_the_error_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'jaxrl-scale\[reasoning-gym\]'"):
        make_task(load_config(TINY_CONFIG, TWO).task, seed=0)


def test_a_reasoning_gym_task_trains(tmp_path):
    overrides = [
        *FAST, "task.name=reasoning_gym", "task.reasoning_gym.datasets={basic_arithmetic: 1}",
        "task.reasoning_gym.configs={basic_arithmetic: {min_terms: 2, max_terms: 2, "
        "min_digits: 1, max_digits: 1}}", "model.vocab_size=128", "sampler.max_new_tokens=8",
    ]  # fmt: skip
    rows = train(load_config(TINY_CONFIG, overrides), tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[1:]:
        assert 0 <= r["reward_mean"] <= 1 and r["reward_errors"] == 0
    assert 0 <= rows[-1]["eval_pass_rate"] <= 1
