"""Your own task: the scorer pool (errors, hangs, garbage, parts, thinking), loading by import
path with its errors, and runs trained from YAML and from a task object."""

import math
import threading
import time
import warnings

import numpy as np
import pytest
from conftest import FAST, FIXTURES, TINY_CONFIG

from jaxrl_scale.config import ConfigError, load_config
from jaxrl_scale.tasks import Scorer, Task, make_task, strip_think
from jaxrl_scale.tasks.scoring import ScorerBroken
from jaxrl_scale.train import train


@pytest.fixture
def user_module(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES / "tasks"))
    import user_task

    return user_task


class Echo:
    """score(completion) = the completion read as a number; misbehaves on request."""

    def __init__(self, hang_seconds=5.0):
        self.hang_seconds = hang_seconds

    def score(self, completion, example):
        if completion == "raise":
            raise KeyError("answer")
        if completion == "hang":
            time.sleep(self.hang_seconds)
            return 1.0
        if completion == "text":
            return "1.0"
        if completion == "none":
            return None
        if completion == "nan":
            return float("nan")
        if completion == "parts":
            return {"a": 1.0, "b": 0.5}
        if completion == "np":
            return np.float32(0.5)
        if completion == "true":
            return True
        if completion == "huge":
            return 10**400  # float() overflows
        if completion == "broken":
            raise ScorerBroken("the verifier's library is missing")
        return float(completion)


def _score(scorer, texts):
    return scorer(texts, [{"prompt": "x"}] * len(texts))


# --------------------------------------------------------------------------- the scorer


def test_a_failing_sample_scores_zero_is_counted_and_logged_once():
    scorer = Scorer(Echo(), workers=2, timeout=5.0)
    texts = ["1", "raise", "0.5", "raise", "text", "none", "nan", "np", "true", "huge"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _score(scorer, texts)
    np.testing.assert_array_equal(got.rewards, [1, 0, 0.5, 0, 0, 0, 0, 0.5, 1, 0])
    assert got.counts["reward_errors"] == 6  # 2 raised, a str, None, NaN, an overflow
    assert got.counts["reward_timeouts"] == 0
    messages = [str(w.message) for w in caught if w.category is UserWarning]  # (not JAX's)
    # One log line per kind of failure (a raise, a non-number), with the first one's text.
    assert sum("KeyError: 'answer'" in m for m in messages) == 1
    assert sum("not a number" in m or "is nan" in m for m in messages) == 1
    assert len(messages) == 2


def test_a_hanging_scorer_costs_its_samples_and_the_pool_keeps_scoring():
    scorer = Scorer(Echo(hang_seconds=10.0), workers=2, timeout=0.3)
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _score(scorer, ["hang", "hang", "1", "0.25"])
    first = time.monotonic() - start
    np.testing.assert_array_equal(got.rewards, [0, 0, 1, 0.25])
    assert got.counts["reward_timeouts"] == 2
    # Both workers hung, were replaced, and the other samples ran: well before the hang ends.
    assert first < 5.0
    again = _score(scorer, ["0.75", "1"])  # the pool still has its two free workers
    np.testing.assert_array_equal(again.rewards, [0.75, 1])
    assert again.counts["reward_timeouts"] == 0


def test_named_parts_are_weighted_summed_and_averaged_over_the_samples_that_have_them():
    scorer = Scorer(Echo(), workers=1, weights={"b": 2.0})
    got = _score(scorer, ["parts", "0.25", "parts"])
    np.testing.assert_allclose(got.rewards, [1.0 + 2 * 0.5, 0.25, 2.0])
    stats = got.stats()
    assert stats["reward/a"] == 1.0 and stats["reward/b"] == 0.5
    assert stats["reward_errors"] == 0
    # Without a pass part the reward is the pass signal; with one, that part's value.
    np.testing.assert_allclose(got.passed, got.rewards)
    graded = Scorer(Echo(), workers=1, weights={"b": 2.0}, pass_part="a")
    np.testing.assert_allclose(_score(graded, ["parts", "0.25"]).passed, [1.0, 0.25])


def test_a_verifier_that_cannot_score_at_all_ends_the_run():
    """One sample's failure is counted; a verifier with no library is not a sample's."""
    with pytest.raises(ScorerBroken, match="library is missing"):
        _score(Scorer(Echo(), workers=2), ["1", "broken", "0"])


def test_the_thinking_is_cut_off_before_scoring_and_an_unclosed_one_scores_zero():
    assert strip_think("<think>2+2 is 4</think> 4") == " 4"
    assert strip_think("no tags") == "no tags"
    assert strip_think("<think>still thinking") is None
    assert strip_think("<think>a</think>b</think>c") == "c"  # after the last close
    assert strip_think("</think>5") == "5"  # the template opened the thinking
    scorer = Scorer(Echo(), workers=1)
    got = _score(scorer, ["<think>hmm</think>0.5", "<think>0.5", "0.75"])
    np.testing.assert_array_equal(got.rewards, [0.5, 0, 0.75])
    assert got.counts["think_unclosed"] == 1
    raw = Scorer(Echo(), workers=1, strip_think=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _score(raw, ["<think>0.5"]).counts["reward_errors"] == 1  # float() of the tag


def test_a_batch_scorer_is_called_once_and_its_failure_costs_the_batch():
    calls = []

    class Batched:
        def score(self, completion, example):
            raise AssertionError("score_many is used instead")

        def score_many(self, completions, examples):
            calls.append(list(completions))
            if "boom" in completions:
                raise OSError("sandbox down")
            return [float(c) for c in completions]

    scorer = Scorer(Batched(), workers=1)
    np.testing.assert_array_equal(_score(scorer, ["1", "<think>x", "0"]).rewards, [1, 0, 0])
    assert calls == [["1", "0"]]  # the unclosed thinking never reaches the task
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        broken = _score(scorer, ["1", "boom"])
    assert broken.counts["reward_errors"] == 2 and not broken.rewards.any()


def test_concurrent_callers_get_their_own_scores():
    scorer = Scorer(Echo(), workers=3)
    out = {}

    def call(k):
        out[k] = _score(scorer, [str(k + i / 100) for i in range(50)]).rewards

    threads = [threading.Thread(target=call, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for k in range(4):
        np.testing.assert_allclose(out[k], k + np.arange(50) / 100)


# --------------------------------------------------------------------------- loading


def test_a_task_loads_by_import_path_with_its_args(user_module):
    cfg = load_config(TINY_CONFIG, ["task.name=user_task:make", "task.args.n_train=10"])
    task = make_task(cfg.task, seed=0)
    assert len(task.train_examples) == 10 and len(task.eval_examples) == 8
    assert isinstance(task.obj, user_module.SumTask) and isinstance(task.obj, Task)
    assert task.reward_weights == {"correct": 1.0, "format": 0.25} and task.pass_part == "correct"
    assert task.tokenizer is task.obj.tokenizer  # the task's own, none from the model
    assert task.demonstration(task.train_examples[3]) == str(task.train_examples[3]["answer"])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["task.name=no_such_module_here:make"], r"task.name: cannot import 'no_such_module_here'"),
        (["task.name=user_task:nothing"], r"task.name: module 'user_task' has no 'nothing'"),
        (["task.name=user_task:broken", "task.args.x=1"], r"task.args: .*no such dataset"),
        (["task.name=user_task:make", "task.args.n_rows=3"], r"task.args: .*n_rows"),
        (["task.name=user_task:no_score"], r"task.name: .*without score"),
        (["task.name=user_task"], r"task.name: .*neither a built-in task"),
        (["task.args.n_train=3"], r"task.args: only a task given by import path"),
    ],
)
def test_a_task_that_does_not_load_is_an_error_naming_the_key(user_module, overrides, match):
    with pytest.raises(ConfigError, match=match):
        make_task(load_config(TINY_CONFIG, overrides).task, seed=0)


def test_bad_examples_are_errors_naming_the_row(user_module):
    cfg = load_config(TINY_CONFIG)

    class Rows:
        def __init__(self, train):
            self.train_examples, self.eval_examples = train, [{"prompt": "1+1="}]
            self.tokenizer = user_module.SumTask().tokenizer

        def score(self, completion, example):
            return 0.0

    for rows, match in [
        ([{"prompt": "1+1="}, {"question": "2+2="}], r"train_examples\[1\] is not a dict"),
        ([{"prompt": 7}], r"neither a string nor a list of chat messages"),
        ([{"prompt": [{"role": "user", "content": "hi"}]}], r"no chat template"),
        ([], r"train_examples is empty"),
    ]:
        with pytest.raises(ConfigError, match=match):
            make_task(cfg.task, seed=0, task=Rows(rows))


# --------------------------------------------------------------------------- runs


def test_a_user_task_trains_from_yaml_its_failing_samples_counted(user_module, tmp_path):
    overrides = [
        *FAST,
        "task.name=user_task:make",
        "task.args.traps=true",
        "train.steps=3",
        "task.max_failure_fraction=1.0",
    ]  # a batch may be mostly traps
    rows = train(load_config(TINY_CONFIG, overrides), tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    steps = rows[1:]
    # Every trap prompt's G = 4 samples raised, scored 0 and were counted; half the problems
    # are traps, so 12 prompts drawn hold some (all traps with probability 2^-12).
    errors = [r["reward_errors"] for r in steps]
    assert all(e % 4 == 0 for e in errors) and 0 < sum(errors) < 48
    # A part is logged for a step whose batch had a sample that returned it (not all traps).
    scored = [r for r in steps if r["reward_errors"] < 16]
    assert scored and all("reward/correct" in r for r in scored)
    for r in scored:
        assert 0 <= r["reward/correct"] <= r["reward/format"] + 1e-9 <= 1 + 1e-9
    for r in steps:
        assert r["reward_timeouts"] == 0 and r["score_seconds"] >= 0
        assert math.isfinite(r["loss"])
        # The pass rate is the "correct" part's (pass_part), never the format bonus's.
        assert r["pass_rate"] <= r.get("reward/correct", 0) + 1e-9
    assert 0 <= rows[-1]["eval_pass_rate"] <= 1
    assert rows[-1]["eval_reward_errors"] == 0  # held-out problems hold no traps


def test_a_task_object_trains_from_a_notebook(user_module, tmp_path):
    obj = user_module.make()
    rows = train(load_config(TINY_CONFIG, [*FAST, "train.steps=1"]), tmp_path, task=obj)
    assert [r["step"] for r in rows] == [0, 1]
    # The object scored in forked worker processes (tasks/workers.py): what its score
    # changes stays there, and the notebook's object is untouched.
    assert obj.calls == 0
    assert rows[1]["reward_errors"] == 0 and "reward/format" in rows[1]


def test_fewer_training_examples_than_a_step_draws_is_refused_at_setup(user_module, tmp_path):
    overrides = [*FAST, "task.name=user_task:make", "task.args.n_train=3"]  # 4 prompts a step
    with pytest.raises(ConfigError, match=r"train.prompts_per_step: 4 prompts a step, but the "
                                          r"task has 3 training example"):  # fmt: skip
        train(load_config(TINY_CONFIG, overrides), tmp_path)
