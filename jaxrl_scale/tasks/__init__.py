"""Verifiable tasks: prompts, a verifier `score(completion, example) -> float`, a held-out split.

task = make_task(cfg.task, seed=0)              # from a TaskConfig
task = get_task("arithmetic", max_digits=2)     # or by name with keyword arguments
task.train_examples, task.eval_examples         # lists of example dicts with a "prompt"
task.score("46", {"prompt": "12+34=", "answer": 46})  -> 1.0

arithmetic and countdown bring a character tokenizer (used unless one is passed); math takes
the model's tokenizer. Your own task: `task.name: package.module:factory` with `task.args`, or
the object itself (`make_task(cfg, seed=0, task=obj)`), per the `Task` protocol (tasks/user.py).
Scoring runs in `scoring.Scorer` (a thread pool, a timeout per sample, errors counted).
"""

from __future__ import annotations

import dataclasses

from jaxrl_scale.tasks.arithmetic import ArithmeticTask
from jaxrl_scale.tasks.countdown import CountdownTask
from jaxrl_scale.tasks.math import MathTask
from jaxrl_scale.tasks.mixture import MixtureTask
from jaxrl_scale.tasks.scoring import Scorer, strip_think
from jaxrl_scale.tasks.user import Task, UserTask

TASKS = {"arithmetic": ArithmeticTask, "countdown": CountdownTask, "math": MathTask}


def get_task(name: str, **kwargs):
    """Build a registered task; unknown names are an error listing the known ones."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name](**kwargs)


def make_task(cfg, *, seed: int, tokenizer=None, task=None):
    """The task a TaskConfig describes; `tokenizer` (the model's) replaces a built-in one.
    `task`: a user's object (the `Task` protocol), taken in place of `cfg.name`'s."""
    if cfg.name == "mixture" and task is None:  # each domain's task, one tokenizer for all
        parts = {}
        for c in cfg.mixture:
            one = dataclasses.replace(cfg, name=c.name, args=dict(c.args), mixture=())
            parts[c.label] = make_task(one, seed=seed, tokenizer=tokenizer)
            tokenizer = tokenizer or parts[c.label].tokenizer
        return MixtureTask(parts, {c.label: c.weight for c in cfg.mixture}, seed=seed)
    if task is not None or cfg.imported:
        from jaxrl_scale.tasks import user

        label = type(task).__name__ if task is not None else cfg.name
        obj = task if task is not None else user.build(cfg.name, cfg.args)
        return UserTask(
            obj, tokenizer=tokenizer, num_train=cfg.num_train, num_eval=cfg.num_eval,
            label=label, tool_timeout=cfg.tool_timeout,
        )  # fmt: skip
    common = dict(num_train=cfg.num_train, num_eval=cfg.num_eval, seed=seed, tokenizer=tokenizer)
    if cfg.name == "arithmetic":
        a = cfg.arithmetic
        return ArithmeticTask(max_digits=a.max_digits, ops=a.ops, demo_noise=a.demo_noise, **common)
    if cfg.name == "countdown":
        c = cfg.countdown
        return CountdownTask(
            numbers=c.numbers, max_number=c.max_number, max_target=c.max_target, **common
        )
    if cfg.name == "code":
        return _code_task(cfg.code, common)
    if cfg.name == "reasoning_gym":
        from jaxrl_scale.tasks.reasoning_gym import ReasoningGymTask

        r = cfg.reasoning_gym
        template = {} if r.template is None else {"template": r.template}
        return ReasoningGymTask(datasets=r.datasets, configs=r.configs, **template, **common)
    m = cfg.math
    if not m.data:
        from jaxrl_scale.configbase import ConfigError

        raise ConfigError(
            "task.math.data: the math task needs a file or dataset (--set task.math.data=...)"
        )
    return MathTask(
        data=m.data,
        eval_data=m.eval_data,
        question_key=m.question_key,
        answer_key=m.answer_key,
        template=m.template,
        timeout=m.verify_timeout,
        **common,
    )


def _code_task(c, common: dict):
    from jaxrl_scale.configbase import ConfigError
    from jaxrl_scale.tasks.code import CodeTask
    from jaxrl_scale.tasks.sandbox import SandboxUnavailable

    if not c.data:
        raise ConfigError("task.code.data: the code task needs a .jsonl file of problems")
    template = {} if c.template is None else {"template": c.template}
    try:
        return CodeTask(
            data=c.data, eval_data=c.eval_data, partial_credit=c.partial_credit,
            sandbox=c.limits, isolation=c.isolation, allow_unisolated=c.allow_unisolated,
            workers=c.workers or None, **template, **common,
        )  # fmt: skip
    except SandboxUnavailable as e:
        raise ConfigError(f"task.code.isolation: {e}") from e


def make_scorer(cfg, task) -> Scorer:
    """The scorer a TaskConfig sets up for `task` (task.score_workers, score_timeout, ...)."""
    return Scorer(
        task,
        workers=cfg.score_workers,
        timeout=cfg.score_timeout,
        strip_think=cfg.strip_think,
        weights=cfg.reward_weights,
        pass_part=cfg.pass_part,
    )


__all__ = [
    "TASKS",
    "ArithmeticTask",
    "CountdownTask",
    "MathTask",
    "MixtureTask",
    "Scorer",
    "Task",
    "UserTask",
    "get_task",
    "make_scorer",
    "make_task",
    "strip_think",
]
