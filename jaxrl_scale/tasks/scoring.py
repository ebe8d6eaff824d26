"""Scoring completions: a task's verifier, off the generator's thread, each sample with a timeout.

scorer = Scorer(task, workers=8, timeout=30.0)
result = scorer(completions, examples)   # Scored: rewards [n], named parts, counts

A user's scorer is untrusted code: one that raises, hangs or returns something other than a
finite number costs that sample, never the run. Such a sample scores 0 and is counted
(`reward_errors`, `reward_timeouts`); the first error of each kind is logged once with its text.
A batch in which more than `max_failure_fraction` of the samples scored could not be (errors
and timeouts together) means scoring is broken, not the samples: ScorerBroken ends the run
with the first failure's text rather than train on zeros (task.max_failure_fraction).

Where `score` runs. Each sample's `task.score(completion, example)` runs in one of `workers`
worker processes forked from the trainer (tasks/workers.py says why forked, and what that
means for the task object): a scorer stuck in C code that holds the GIL (a regex that
backtracks for minutes) cannot freeze the trainer's threads, and at `timeout` seconds its
worker is killed and replaced, the sample counted in `reward_timeouts`. Examples go to the
workers and scores come back pickled: an example that does not pickle is its sample's error
(`reward_errors`), its message naming the part (`example['rng'] (a Generator)`).

What the verifier sees. With `strip_think` a completion's thinking is cut off before scoring:
the text after the last `</think>`; a completion that opens `<think>` and never closes it scores
0 (counted in `think_unclosed`); one with neither tag is scored as it is.

Named parts. `score` may return a mapping of named parts (e.g. {"format": 1.0, "correct": 0.0});
the reward is their weighted sum (weights from `task.reward_weights`, then the task's own
`reward_weights` attribute, else 1 each), and each part's batch mean is logged as
`reward/<part>`.

Batch scorers. A task with `score_many(completions, examples)` is called once per batch (a
mixture: once per domain in the batch). A user's (tasks/user.py `UserTask` marks it,
`score_many_in_worker`) runs in a worker process like `score`, the whole batch given `timeout`
seconds (one batch scorer call is one call: a batch past it counts every sample in
`reward_timeouts`), its `stats()` read in that worker right after. The built-in ones bound
their own time and run on the caller's thread: the code task's programs run in its sandbox
pool, the math task's verifier is a process with a timeout of its own.

Threads. `Scorer.__call__` is called from the thread that feeds the trainer and from the main
thread's evaluation at once; each call hands its samples to the shared worker processes and
waits for its own futures.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import threading
import warnings
from collections.abc import Mapping, Sequence

import numpy as np

from jaxrl_scale.configbase import ConfigError
from jaxrl_scale.models.parsers import THINK_CLOSE, split_reasoning
from jaxrl_scale.tasks.workers import PoolBroken, WorkerProcesses, gather


class ScorerBroken(RuntimeError):
    """A verifier that cannot score at all (its library missing, its worker not starting):
    not one sample's failure, so it is raised through and ends the run."""


FATAL = (ScorerBroken, ConfigError)


def strip_think(text: str) -> str | None:
    """The answer after the model's thinking: the text after the last `</think>`; None when a
    `<think>` opens and never closes; the text itself when it has neither tag. The think block
    is models/parsers.py's `split_reasoning`; a later `</think>` in its content cuts again."""
    reasoning, content = split_reasoning(text)
    if reasoning is None:
        return text
    if THINK_CLOSE not in text:
        return None
    return content.rpartition(THINK_CLOSE)[2]


@dataclasses.dataclass(frozen=True)
class Scored:
    """A batch's scores: `rewards` [n], each named part's values [n] (NaN where a sample has
    no such part), what went wrong, counted, and a mixture's mean reward per domain."""

    rewards: np.ndarray
    parts: dict[str, np.ndarray]
    counts: dict[str, int]
    domains: dict[str, float] = dataclasses.field(default_factory=dict)  # a mixture's means
    passed: np.ndarray | None = None  # [n] the pass signal (task.pass_part), else the rewards

    def __post_init__(self):
        if self.passed is None:
            object.__setattr__(self, "passed", self.rewards)

    def stats(self) -> dict[str, float]:
        """The metrics row's part: each part's mean over the samples that have it, each
        domain's mean reward (`reward_mean/<domain>`), the counts."""
        out = {f"reward_mean/{d}": v for d, v in self.domains.items()}
        for name, values in self.parts.items():
            have = values[~np.isnan(values)]
            out[f"reward/{name}"] = float(have.mean()) if have.size else float("nan")
        return {**out, **self.counts}


class Scorer:
    """A task's `score` over batches of completions, in `workers` worker processes, each
    sample with `timeout` seconds once it starts; a batch with more than
    `max_failure_fraction` of its scored samples failed raises ScorerBroken (1.0: never).
    See the module's docstring."""

    def __init__(
        self,
        task,
        *,
        workers: int = 8,
        timeout: float = 30.0,
        strip_think: bool = True,
        weights: Mapping[str, float] | None = None,
        pass_part: str | None = None,
        max_failure_fraction: float = 1.0,
    ):
        self.task, self.timeout, self.strip_think = task, timeout, strip_think
        self._weights, self._pass_part = dict(weights or {}), pass_part
        self.max_failure_fraction = max_failure_fraction
        tasks = (getattr(task, "components", None) or {None: task}).values()
        self._pool = None  # no worker process when every task bounds its own time
        if not all(_bounds_itself(t) for t in tasks):
            self._pool = WorkerProcesses(
                workers, timeout=timeout, shares=task, name="jaxrl-scorer",
                timeout_key="task.score_timeout",
            )  # fmt: skip
        self._logged: set[str] = set()  # error kinds already logged (first text of each)
        self._log_lock = threading.Lock()  # two callers may hit a first error at once

    def __call__(self, completions: Sequence[str], examples: Sequence[dict]) -> Scored:
        if len(completions) != len(examples):
            raise ValueError(f"{len(completions)} completions for {len(examples)} examples")
        counts = {"reward_errors": 0, "reward_timeouts": 0}
        if self.strip_think:
            counts["think_unclosed"] = 0
        texts: list[str | None] = []
        for c in completions:
            answer = strip_think(c) if self.strip_think else c
            if answer is None:
                counts["think_unclosed"] += 1
            texts.append(answer)
        values: list[object] = [0.0] * len(texts)
        todo = [i for i, t in enumerate(texts) if t is not None]
        failures: list[str] = []  # this batch's failures' texts, for ScorerBroken's message
        # What runs in the worker processes is handed over first; built-in batch scorers run
        # here meanwhile.
        futures: dict = {}  # future -> its sample's index, or a batch's indices (a list)
        here = []
        for task, domain, indices in self._by_task(todo, examples):
            if _bounds_itself(task):
                here.append((task, indices))
            elif hasattr(task, "score_many"):  # a user's batch scorer
                batch = ([texts[i] for i in indices], [examples[i] for i in indices])
                futures[self._pool.submit(_score_batch, domain, *batch)] = indices
            else:
                for i in indices:
                    futures[self._pool.submit(_score, domain, texts[i], examples[i])] = i
        for task, indices in here:
            self._score_many(task, indices, texts, examples, values, counts, failures)
        self._collect(futures, values, counts, failures)
        scored = self._combine(values, counts, examples, failures)
        self._check_failures(counts, len(todo), failures)
        return scored

    def _by_task(self, todo, examples) -> list[tuple[object, str | None, list[int]]]:
        """(task, domain, sample indices) groups: a mixture's samples go to their domain's
        task (domain None: the task itself)."""
        components = getattr(self.task, "components", None)
        if components is None:
            return [(self.task, None, todo)]
        groups: dict[str, list[int]] = {}
        for i in todo:
            groups.setdefault(examples[i]["domain"], []).append(i)
        return [(components[d], d, indices) for d, indices in groups.items()]

    def _score_many(self, task, todo, texts, examples, values, counts, failures) -> None:
        try:
            got = list(task.score_many([texts[i] for i in todo], [examples[i] for i in todo]))
            if len(got) != len(todo):
                raise ValueError(f"score_many returned {len(got)} scores for {len(todo)}")
        except FATAL:
            raise
        except Exception as e:  # noqa: BLE001 - a broken scorer costs its batch, counted
            counts["reward_errors"] += len(todo)
            failures.append(f"{type(e).__name__}: {e}")
            self._log("error", failures[-1])
            return
        for i, v in zip(todo, got, strict=True):
            values[i] = v
        # A batch scorer's own counters (the code task's runs, timeouts, seconds); with an
        # evaluation scoring at the same time they include its runs.
        for name, value in (task.stats() if hasattr(task, "stats") else {}).items():
            counts[name] = counts.get(name, 0) + value

    def _collect(self, futures: dict, values, counts, failures) -> None:
        """The worker processes' outcomes into `values` and `counts`: per sample, or per
        batch (a user's `score_many`: its scores and its stats, or its failure counted once
        for each of its samples)."""
        try:
            outcomes = gather(list(futures))
        except PoolBroken as e:
            raise ScorerBroken(f"task {self._name}: the scorer's worker processes: {e}") from e
        for (status, got), where in zip(outcomes, futures.values(), strict=True):
            batch = isinstance(where, list)
            n = len(where) if batch else 1
            if status == "ok" and batch:
                scores, stats = got
                for i, v in zip(where, scores, strict=True):
                    values[i] = v
                for name, value in stats.items():
                    counts[name] = counts.get(name, 0) + value
            elif status == "ok":
                values[where] = got
            elif status == "timeout":
                counts["reward_timeouts"] += n
                failures.append(
                    f"score_many gave no scores for a batch of {n} within {self.timeout:g} s "
                    "(task.score_timeout, for the whole batch)"
                    if batch
                    else f"no score within {self.timeout:g} s (task.score_timeout)"
                )
                self._log("timeout", failures[-1])
            else:
                if isinstance(got, FATAL):
                    raise got
                counts["reward_errors"] += n
                failures.append(f"{'score_many: ' if batch else ''}{type(got).__name__}: {got}")
                self._log("error", failures[-1])

    def _check_failures(self, counts, attempted: int, failures: list[str]) -> None:
        """ScorerBroken when more than `max_failure_fraction` of the `attempted` samples
        failed: a scorer that fails that often is broken, and zeros are no training signal."""
        failed = counts["reward_errors"] + counts["reward_timeouts"]
        if not attempted or failed <= self.max_failure_fraction * attempted:
            return
        raise ScorerBroken(
            f"task {self._name}: {failed} of {attempted} samples could not be scored "
            f"({counts['reward_errors']} errors, {counts['reward_timeouts']} timeouts; the "
            f"first: {failures[0] if failures else '?'}), more than task.max_failure_fraction "
            f"= {self.max_failure_fraction:g} of the batch: scoring is broken, so the run ends "
            "rather than train on zeros"
        )

    @property
    def _name(self) -> str:
        return getattr(self.task, "name", type(self.task).__name__)

    def _task_of(self, example: dict):
        components = getattr(self.task, "components", None)
        return self.task if components is None else components[example["domain"]]

    def _combine(self, values, counts, examples, failures) -> Scored:
        n = len(values)
        rewards, passed = np.zeros(n), np.zeros(n)
        parts: dict[str, np.ndarray] = {}
        for i, v in enumerate(values):
            task = self._task_of(examples[i])
            try:
                rewards[i], passed[i] = self._reward(task, v, parts, i, n)
            except (TypeError, ValueError, ArithmeticError) as e:
                rewards[i] = passed[i] = 0.0
                counts["reward_errors"] += 1
                failures.append(str(e))
                self._log("garbage", failures[-1])
        domains: dict[str, float] = {}
        if getattr(self.task, "components", None) is not None:
            labels = np.array([e["domain"] for e in examples])
            domains = {d: float(rewards[labels == d].mean()) for d in dict.fromkeys(labels)}
        return Scored(rewards, parts, counts, domains, passed)

    def _reward(self, task, value, parts: dict[str, np.ndarray], i: int, n: int):
        """(reward, pass signal) of one sample's score: a number is both; named parts are
        summed with their task's weights (the config's first), and the pass signal is the
        part `pass_part` names (task.pass_part, else the task's own), else the reward."""
        if not isinstance(value, Mapping):
            reward = _number(value, "score")
            return reward, reward
        checked = {str(k): _number(v, f"part {k!r}") for k, v in value.items()}
        for name, v in checked.items():
            parts.setdefault(name, np.full(n, np.nan))[i] = v
        weights = {**(getattr(task, "reward_weights", None) or {}), **self._weights}
        reward = _number(sum(weights.get(k, 1.0) * v for k, v in checked.items()), "the sum")
        pass_part = self._pass_part or getattr(task, "pass_part", None)
        return reward, checked.get(pass_part, 0.0) if pass_part else reward

    def _log(self, kind: str, text: str) -> None:
        with self._log_lock:
            if kind in self._logged:
                return
            self._logged.add(kind)
        warnings.warn(
            f"task {self._name}: a sample scored 0 ({text}); later ones of this kind are only "
            "counted (reward_errors, reward_timeouts)",
            stacklevel=3,
        )


def _bounds_itself(task) -> bool:
    """Whether `task` is a built-in batch scorer that bounds its own time (the code task's
    sandbox, the math task's verifier process), run on the caller's thread. A user's
    `score_many` (UserTask.score_many_in_worker) runs in a worker process, as `score` does."""
    return hasattr(task, "score_many") and not getattr(task, "score_many_in_worker", False)


def _score(held, domain: str | None, completion: str, example: dict):
    """In a scorer's worker process: the sample's task (its domain's, in a mixture) scores it."""
    task = held.shared if domain is None else held.shared.components[domain]
    return task.score(completion, example)


def _score_batch(held, domain: str | None, completions: list[str], examples: list[dict]):
    """In a scorer's worker process: a user's `score_many` over a batch, and its `stats()`
    read right after (its counters live in this process): (scores, stats)."""
    task = held.shared if domain is None else held.shared.components[domain]
    scores = list(task.score_many(completions, examples))
    if len(scores) != len(completions):
        raise ValueError(f"score_many returned {len(scores)} scores for {len(completions)}")
    return scores, dict(task.stats()) if hasattr(task, "stats") else {}


def _number(value, what: str) -> float:
    """`value` as a finite float, or a ValueError naming what it was."""
    if not isinstance(value, numbers.Real) and not (
        isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "biuf"
    ):
        raise ValueError(f"{what} is a {type(value).__name__}, not a number: {value!r:.80}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{what} is {out}")
    return out
