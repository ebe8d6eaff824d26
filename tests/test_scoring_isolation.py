"""The scorer's worker processes: a scorer that holds the GIL is killed at its timeout while the
trainer's threads go on, a task defined where pickle cannot reach still scores, and scoring
that is broken (too many failures, no worker) ends the run instead of training on zeros."""

import os
import re
import threading
import time
import warnings

import numpy as np
import pytest
from conftest import TINY_CONFIG, Heartbeat

from jaxrl_scale.config import ConfigError, load_config
from jaxrl_scale.tasks import Scorer, UserTask, make_scorer, workers
from jaxrl_scale.tasks.scoring import ScorerBroken

# re.match(r"(a+)+$", "a" * n + "b") backtracks 2^n steps inside C, holding the GIL: about
# half a minute at n = 30 here, far past any timeout below.
STUCK_N = 30


class Regex:
    """score = the completion read as a number; "stuck" runs a regex that holds the GIL,
    "raise" raises, "hang" sleeps (a timeout that releases the GIL)."""

    def score(self, completion, example):
        if completion == "stuck":
            re.match(r"(a+)+$", "a" * STUCK_N + "b")
        if completion == "raise":
            raise KeyError("answer")
        if completion == "hang":
            time.sleep(30)
        return float(completion)


def _score(scorer, texts):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first failure of each kind is logged
        return scorer(texts, [{"prompt": "x"}] * len(texts))


def test_a_scorer_stuck_in_a_regex_that_holds_the_gil_costs_its_sample_and_nothing_else():
    """A thread timeout cannot end code that holds the GIL: the waiter never ran again until
    the regex finished. In a worker process the sample's worker is killed at the timeout;
    the other samples score, the caller returns, and other threads ran meanwhile."""
    scorer = Scorer(Regex(), workers=2, timeout=0.5)
    with Heartbeat() as beat:
        start = time.monotonic()
        got = _score(scorer, ["stuck", "1", "0.5", "0.25", "0.75"])
        took = time.monotonic() - start
    assert took < 3.0, f"{took:.1f} s"
    np.testing.assert_array_equal(got.rewards, [0, 1, 0.5, 0.25, 0.75])
    assert got.counts["reward_timeouts"] == 1 and got.counts["reward_errors"] == 0
    assert beat.ticks >= 10, beat.ticks  # the trainer's threads were never frozen
    again = _score(scorer, ["stuck", "0.5"])  # a fresh worker took the killed one's place
    np.testing.assert_array_equal(again.rewards, [0, 0.5])
    assert again.counts["reward_timeouts"] == 1


def test_a_task_that_pickle_cannot_carry_scores_in_the_workers():
    """A task as a notebook makes one: a class local to a function, holding a lambda. The
    workers are forked, so nothing of it is pickled; what a call changes in the task stays
    in its worker (the trainer's copy is untouched)."""

    class Notebook:
        def __init__(self):
            self.parse = lambda text: float(text) * 2
            self.calls = 0

        def score(self, completion, example):
            self.calls += 1
            return self.parse(completion) + example["bonus"]

    task = Notebook()
    got = Scorer(task, workers=2)(["1", "0.25"], [{"bonus": 0.5}, {"bonus": 0.0}])
    np.testing.assert_array_equal(got.rewards, [2.5, 0.5])
    assert task.calls == 0


def test_a_batch_with_too_many_failures_ends_the_run_naming_the_key():
    """Errors and timeouts together; the threshold is a fraction of the samples scored."""
    scorer = Scorer(Regex(), workers=2, timeout=0.3, max_failure_fraction=0.5)
    at = _score(scorer, ["raise", "hang", "1", "0.5"])  # 2 of 4: not above half
    assert at.counts["reward_errors"] == 1 and at.counts["reward_timeouts"] == 1
    with pytest.raises(ScorerBroken, match=r"3 of 4 samples.*task.max_failure_fraction = 0.5"):
        _score(scorer, ["raise", "hang", "raise", "1"])
    with pytest.raises(ScorerBroken, match=r"KeyError: 'answer'"):  # the first failure's text
        _score(scorer, ["raise", "raise", "raise", "1"])
    # Unclosed thinking is the model's doing, not the scorer's: not counted against it.
    think = _score(scorer, ["<think>a", "<think>b", "<think>c", "1"])
    assert think.counts["think_unclosed"] == 3 and think.rewards[3] == 1


def test_max_failure_fraction_is_a_config_key_that_make_scorer_reads():
    cfg = load_config(TINY_CONFIG)
    assert cfg.task.max_failure_fraction == 0.5
    with pytest.raises(ConfigError, match=r"task.max_failure_fraction: must be in \[0, 1\]"):
        load_config(TINY_CONFIG, ["task.max_failure_fraction=1.5"])
    strict = load_config(TINY_CONFIG, ["task.max_failure_fraction=0.2"])
    scorer = make_scorer(strict.task, Regex())
    with pytest.raises(ScorerBroken, match=r"1 of 4 samples"):
        _score(scorer, ["raise", "1", "1", "1"])
    lenient = make_scorer(load_config(TINY_CONFIG, ["task.max_failure_fraction=1.0"]).task,
                          Regex())  # fmt: skip
    assert _score(lenient, ["raise", "raise"]).counts["reward_errors"] == 2


def test_a_scorer_with_no_worker_process_ends_the_run(monkeypatch):
    """No worker can start (the process table is full): every sample would score 0. Forks
    are retried for workers.FORK_RETRY_SECONDS first (a full table may empty again)."""
    forks = []

    def no_fork():
        forks.append(time.monotonic())
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(workers, "FORK_RETRY_SECONDS", 0.5)
    monkeypatch.setattr(os, "fork", no_fork)
    scorer = Scorer(Regex(), workers=2)
    with pytest.raises(ScorerBroken, match=r"no worker process can be started"):
        _score(scorer, ["1", "0.5"])
    assert len(forks) >= 3 and forks[-1] - forks[0] >= 0.4, forks  # retried, backing off


def test_a_fork_that_fails_for_a_moment_costs_no_sample(monkeypatch):
    """One EAGAIN (a process table full for a moment) ended the run."""
    real_fork, forks = os.fork, []

    def flaky_fork():
        forks.append(1)
        if len(forks) <= 3:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return real_fork()

    monkeypatch.setattr(os, "fork", flaky_fork)
    scorer = Scorer(Regex(), workers=1)
    got = _score(scorer, ["1", "0.5"])
    np.testing.assert_array_equal(got.rewards, [1, 0.5])
    assert got.counts["reward_errors"] == 0 and len(forks) == 4


class Batch:
    """A user's batch scorer: "stuck" in a batch runs a regex that holds the GIL; its stats
    count the samples it scored (in the process that scored them)."""

    train_examples = eval_examples = [{"prompt": "x"}]
    tokenizer = "a tokenizer"  # (never used: the prompts are strings)

    def __init__(self):
        self.scored = 0

    def score(self, completion, example):
        raise AssertionError("score_many is used instead")

    def score_many(self, completions, examples):
        if "stuck" in completions:
            re.match(r"(a+)+$", "a" * STUCK_N + "b")
        self.scored += len(completions)
        return [float(c) for c in completions]

    def stats(self):
        scored, self.scored = self.scored, 0
        return {"batch_scored": scored}


def test_a_users_batch_scorer_stuck_in_a_regex_costs_its_batch_and_nothing_else():
    """A user's `score_many` ran on the feeding thread with no timeout: one stuck in C froze
    the run. It runs in a worker process, its batch given task.score_timeout."""
    task = UserTask(Batch())
    scorer = Scorer(task, workers=2, timeout=0.5)
    with Heartbeat() as beat:
        start = time.monotonic()
        got = _score(scorer, ["1", "stuck", "0.5"])
        took = time.monotonic() - start
    assert took < 3.0, f"{took:.1f} s"
    assert beat.ticks >= 10, beat.ticks
    assert got.counts["reward_timeouts"] == 3 and not got.rewards.any()
    fine = _score(scorer, ["1", "0.5"])
    np.testing.assert_array_equal(fine.rewards, [1, 0.5])
    assert fine.counts["batch_scored"] == 2  # its stats, from the process that scored
    assert task.obj.scored == 0  # (the trainer's copy never scored)


def test_an_example_that_cannot_be_pickled_costs_its_sample_naming_what():
    """Examples cross to the worker processes pickled: one that cannot is that sample's
    error, naming the part that could not be sent."""
    scorer = Scorer(Regex(), workers=1)
    examples = [{"prompt": "x"}, {"prompt": "x", "state": threading.Lock()}]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = scorer(["1", "0.5"], examples)
    np.testing.assert_array_equal(got.rewards, [1, 0])
    assert got.counts["reward_errors"] == 1
    [message] = [str(w.message) for w in caught if w.category is UserWarning]
    assert "example['state'] (a lock)" in message and "pickle" in message, message
