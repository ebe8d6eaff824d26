"""Scoring completions: a task's verifier, off the generator's thread, each sample with a timeout.

scorer = Scorer(task, workers=8, timeout=30.0)
result = scorer(completions, examples)   # Scored: rewards [n], named parts, counts

A user's scorer is untrusted code: one that raises, hangs or returns something other than a
finite number costs that sample, never the run. Such a sample scores 0 and is counted
(`reward_errors`, `reward_timeouts`); the first error of each kind is logged once with its text.

What the verifier sees. With `strip_think` a completion's thinking is cut off before scoring:
the text after the last `</think>`; a completion that opens `<think>` and never closes it scores
0 (counted in `think_unclosed`); one with neither tag is scored as it is.

Named parts. `score` may return a mapping of named parts (e.g. {"format": 1.0, "correct": 0.0});
the reward is their weighted sum (weights from `task.reward_weights`, then the task's own
`reward_weights` attribute, else 1 each), and each part's batch mean is logged as
`reward/<part>`.

Threads. `Scorer.__call__` is called from the thread that feeds the trainer and from the main
thread's evaluation at once; each call hands its samples to the shared pool and waits for its
own futures. A task with `score_many(completions, examples)` (the code task: its programs run
in its own bounded sandbox pool) is called once per batch on the caller's thread instead.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import math
import numbers
import queue
import threading
import time
import warnings
from collections.abc import Mapping, Sequence

import numpy as np

from jaxrl_scale.configbase import ConfigError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Threads a hanging scorer may hold blocked at once before the pool stops replacing them
# (Python cannot kill a thread; each blocked one is a daemon and costs only its stack).
MAX_ABANDONED = 256


class ScorerBroken(RuntimeError):
    """A verifier that cannot score at all (its library missing, its worker not starting):
    not one sample's failure, so it is raised through and ends the run."""


FATAL = (ScorerBroken, ConfigError)


def strip_think(text: str) -> str | None:
    """The answer after the model's thinking: the text after the last `</think>`; None when a
    `<think>` opens and never closes; the text itself when it has neither tag."""
    close = text.rfind(THINK_CLOSE)
    if close >= 0:
        return text[close + len(THINK_CLOSE) :]
    return None if THINK_OPEN in text else text


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


class _Pool:
    """Daemon threads running (fn, args) jobs from a queue, one job at a time each.

    A job that outlives its timeout is abandoned by its waiter: its thread stays blocked in
    the user's code and a fresh thread takes its place, so the pool keeps `workers` threads
    free to run; a blocked thread that returns later goes back to work or, with the pool
    full, exits. Daemon threads never hold the process open at exit. The counters are
    read and changed under `_lock` (the waiters' threads and the workers' own)."""

    def __init__(self, workers: int):
        self.workers = workers
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live = workers  # threads not abandoned
        self._abandoned = 0  # threads given up on and still blocked
        for _ in range(workers):
            self._start()

    def _start(self) -> None:
        threading.Thread(target=self._work, daemon=True, name="jaxrl-scorer").start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            fn, args, future = self._jobs.get()
            future.started, future.thread = time.monotonic(), me  # before it shows running
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - the user's error, reported per sample
                future.set_exception(e)
            with self._lock:
                if getattr(me, "abandoned", False):  # came back after being replaced
                    me.abandoned = False
                    self._abandoned -= 1
                    if self._live >= self.workers:
                        return
                    self._live += 1

    @property
    def running(self) -> bool:
        with self._lock:
            return self._live > 0

    def submit(self, fn, *args) -> cf.Future:
        future: cf.Future = cf.Future()
        self._jobs.put((fn, args, future))
        return future

    def abandon(self, future: cf.Future) -> None:
        """Give up on a running job: its thread no longer counts, a new one replaces it
        (while fewer than MAX_ABANDONED are blocked at once)."""
        thread = future.thread
        with self._lock:  # the replacement takes the slot at once: `running` never dips
            if getattr(thread, "abandoned", False):
                return
            thread.abandoned = True
            self._abandoned += 1
            replace = self._abandoned <= MAX_ABANDONED
            if not replace:
                self._live -= 1
        if replace:
            self._start()


class Scorer:
    """A task's `score` over batches of completions, in a pool of `workers` threads, each
    sample with `timeout` seconds once it starts (see the module's docstring)."""

    def __init__(
        self,
        task,
        *,
        workers: int = 8,
        timeout: float = 30.0,
        strip_think: bool = True,
        weights: Mapping[str, float] | None = None,
        pass_part: str | None = None,
    ):
        self.task, self.timeout, self.strip_think = task, timeout, strip_think
        self._weights, self._pass_part = dict(weights or {}), pass_part
        self._pool = _Pool(workers)
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
        # Per-sample scorers go to the pool first; batch scorers run here meanwhile.
        each, batched = [], []
        for task, indices in self._by_task(todo, examples):
            if hasattr(task, "score_many"):
                batched.append((task, indices))
            else:
                each += [(task.score, i) for i in indices]
        futures = {self._pool.submit(fn, texts[i], examples[i]): i for fn, i in each}
        if futures and not self._pool.running:  # every thread blocked in the scorer
            for f in futures:
                f.cancel()
            counts["reward_timeouts"] += len(futures)
            futures = {}
        for task, indices in batched:
            self._score_many(task, indices, texts, examples, values, counts)
        self._collect(futures, values, counts)
        return self._combine(values, counts, examples)

    def _by_task(self, todo, examples) -> list[tuple[object, list[int]]]:
        """(task, sample indices) groups: a mixture's samples go to their domain's task."""
        components = getattr(self.task, "components", None)
        if components is None:
            return [(self.task, todo)]
        groups: dict[str, list[int]] = {}
        for i in todo:
            groups.setdefault(examples[i]["domain"], []).append(i)
        return [(components[d], indices) for d, indices in groups.items()]

    def _score_many(self, task, todo, texts, examples, values, counts) -> None:
        try:
            got = list(task.score_many([texts[i] for i in todo], [examples[i] for i in todo]))
            if len(got) != len(todo):
                raise ValueError(f"score_many returned {len(got)} scores for {len(todo)}")
        except FATAL:
            raise
        except Exception as e:  # noqa: BLE001 - a broken scorer costs its batch, counted
            counts["reward_errors"] += len(todo)
            self._log("error", f"{type(e).__name__}: {e}")
            return
        for i, v in zip(todo, got, strict=True):
            values[i] = v
        # A batch scorer's own counters (the code task's runs, timeouts, seconds); with an
        # evaluation scoring at the same time they include its runs.
        for name, value in (task.stats() if hasattr(task, "stats") else {}).items():
            counts[name] = counts.get(name, 0) + value

    def _collect(self, futures: dict, values, counts) -> None:
        pending = set(futures)
        while pending:
            done, pending = cf.wait(pending, timeout=min(self.timeout, 0.05))
            for f in done:
                if f.exception() is not None:
                    e = f.exception()
                    if isinstance(e, FATAL):
                        raise e
                    counts["reward_errors"] += 1
                    self._log("error", f"{type(e).__name__}: {e}")
                else:
                    values[futures[f]] = f.result()
            now = time.monotonic()
            late = {f for f in pending if f.running() and now - f.started > self.timeout}
            for f in late:
                self._pool.abandon(f)
                counts["reward_timeouts"] += 1
                self._log("timeout", f"no score within {self.timeout:g} s")
            pending -= late
            if pending and not self._pool.running:
                counts["reward_timeouts"] += len(pending)
                for f in pending:
                    f.cancel()
                pending = set()

    def _task_of(self, example: dict):
        components = getattr(self.task, "components", None)
        return self.task if components is None else components[example["domain"]]

    def _combine(self, values, counts, examples) -> Scored:
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
                self._log("garbage", str(e))
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
        name = getattr(self.task, "name", type(self.task).__name__)
        warnings.warn(
            f"task {name}: a sample scored 0 ({text}); later ones of this kind are only "
            "counted (reward_errors, reward_timeouts)",
            stacklevel=3,
        )


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
