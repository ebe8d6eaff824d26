"""Which task a run trains on and its built-in tasks' settings (`task.*`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl_scale.configbase import require


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticConfig:
    """task.arithmetic: procedural integer problems (tasks/arithmetic.py)."""

    max_digits: int = 2  # operands have 1..max_digits digits
    ops: str = "+-"  # operators drawn from
    # Probability that a warm-start demonstration is wrong (its last digit off by one), so the
    # warm-started policy knows the answer but is unsure of it: what RL fixes.
    demo_noise: float = 0.0

    def __post_init__(self):
        key = "task.arithmetic"
        require(self.max_digits >= 1, f"{key}.max_digits", f"must be >= 1, got {self.max_digits}")
        require(
            bool(self.ops) and set(self.ops) <= set("+-*"), f"{key}.ops", "use characters of '+-*'"
        )
        require(0 <= self.demo_noise <= 1, f"{key}.demo_noise", "must be in [0, 1]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CountdownConfig:
    """task.countdown: reach a target with + - * / over given numbers (tasks/countdown.py)."""

    numbers: int = 3  # given numbers per problem
    max_number: int = 20  # each in 1..max_number
    max_target: int = 100  # targets in 1..max_target

    def __post_init__(self):
        key = "task.countdown"
        require(2 <= self.numbers <= 6, f"{key}.numbers", f"must be in [2, 6], got {self.numbers}")
        require(self.max_number >= 2, f"{key}.max_number", "must be >= 2")
        require(self.max_target >= 1, f"{key}.max_target", "must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MathConfig:
    """task.math: word problems with reference answers, checked by math-verify (tasks/math.py)."""

    data: str | None = (
        None  # .jsonl / .parquet file, or a Hugging Face dataset name[:config[:split]]
    )
    eval_data: str | None = None  # held-out file or dataset; None: num_eval rows of `data`
    question_key: str = "problem"
    answer_key: str = "answer"
    template: str = (
        "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
    )
    verify_timeout: float = 5.0  # seconds per math-verify call before the answer scores 0

    def __post_init__(self):
        require("{question}" in self.template, "task.math.template", "must contain '{question}'")
        require(self.verify_timeout > 0, "task.math.verify_timeout", "must be > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """The verifiable task (see jaxrl_scale/tasks): what every task has, then one section per
    task; only the section `name` picks is read."""

    name: Literal["arithmetic", "countdown", "math"] = "arithmetic"
    num_train: int = 512  # prompts in the training pool (math: 0 = every row)
    num_eval: int = 64  # held-out prompts
    arithmetic: ArithmeticConfig = dataclasses.field(default_factory=ArithmeticConfig)
    countdown: CountdownConfig = dataclasses.field(default_factory=CountdownConfig)
    math: MathConfig = dataclasses.field(default_factory=MathConfig)

    def __post_init__(self):
        require(self.num_train >= 0, "task.num_train", "must be >= 0")
        require(self.num_train >= 1 or self.name == "math", "task.num_train", "must be >= 1")
        require(self.num_eval >= 1, "task.num_eval", "must be >= 1")
