"""Verifiable tasks: prompts, a verifier `score(completion, example) -> float`, a held-out split.

task = make_task(cfg.task, seed=0)              # from a TaskConfig
task = get_task("arithmetic", max_digits=2)     # or by name with keyword arguments
task = get_task("code", data="problems.jsonl", tokenizer=tok)   # every registered name
task.train_examples, task.eval_examples         # lists of example dicts with a "prompt"
task.score("46", {"prompt": "12+34=", "answer": 46})  -> 1.0

`TASKS` is the one registry of built-in names (arithmetic, countdown, math, code,
reasoning_gym, mixture): `make_task` and `get_task` both build through it. arithmetic,
countdown and reasoning_gym bring a character tokenizer (used unless one is passed); math and
code take the model's (`tokenizer=`). Your own task: `task.name: package.module:factory`
with `task.args`, or the object itself (`make_task(cfg, seed=0, task=obj)`), per the `Task`
protocol (tasks/user.py).
Scoring runs in `scoring.Scorer` (worker processes, a timeout per sample, errors counted).
"""

from __future__ import annotations

import dataclasses

from jaxrl_scale.configbase import ConfigError
from jaxrl_scale.tasks.arithmetic import ArithmeticTask
from jaxrl_scale.tasks.countdown import CountdownTask
from jaxrl_scale.tasks.math import MathTask
from jaxrl_scale.tasks.mixture import MixtureTask
from jaxrl_scale.tasks.sandbox import SandboxUnavailable
from jaxrl_scale.tasks.scoring import Scorer, strip_think
from jaxrl_scale.tasks.user import Task, UserTask


def _code(**kwargs):
    from jaxrl_scale.tasks.code import CodeTask

    return CodeTask(**kwargs)


def _reasoning_gym(**kwargs):
    from jaxrl_scale.tasks.reasoning_gym import ReasoningGymTask

    return ReasoningGymTask(**kwargs)


def _mixture(*, mixture, seed: int = 0, tokenizer=None, **common):
    """`mixture`: [{name, args, weight, domain}] as in task.mixture; each domain's task is
    `get_task(name, **args)` with the mixture's seed, tokenizer and other keywords."""
    parts, weights = {}, {}
    for c in mixture:
        c = dict(c)
        label = c.get("domain") or c["name"]
        parts[label] = get_task(
            c["name"], seed=seed, tokenizer=tokenizer, **common, **dict(c.get("args") or {})
        )
        tokenizer = tokenizer or parts[label].tokenizer
        weights[label] = float(c.get("weight", 1.0))
    return MixtureTask(parts, weights, seed=seed)


# The one registry of built-in tasks: name -> factory(**keywords). `make_task` builds a
# config's task through it, `get_task` a caller's; tasks.config.BUILTIN lists the same names.
TASKS = {
    "arithmetic": ArithmeticTask,
    "countdown": CountdownTask,
    "math": MathTask,
    "code": _code,
    "reasoning_gym": _reasoning_gym,
    "mixture": _mixture,
}
NEEDS_TOKENIZER = ("math", "code")  # tasks that read the model's tokenizer, not their own


def get_task(name: str, **kwargs):
    """Build a registered task by name with its keyword arguments (e.g.
    `get_task("code", data="problems.jsonl", tokenizer=tok)`, `get_task("reasoning_gym",
    datasets={"leg_counting": 1}, num_train=64, num_eval=16, seed=0)`). math and code need the
    model's `tokenizer=`; the others bring a character tokenizer unless one is passed.
    Unknown names are an error listing the known ones."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    if name in NEEDS_TOKENIZER and kwargs.get("tokenizer") is None:
        raise ValueError(
            f"get_task({name!r}): the {name} task reads the model's tokenizer: pass "
            "tokenizer= (the second value load_pretrained returns)"
        )
    return TASKS[name](**kwargs)


def make_task(cfg, *, seed: int, tokenizer=None, task=None):
    """The task a TaskConfig describes (built through `TASKS`); `tokenizer` (the model's)
    replaces a built-in one. `task`: a user's object (the `Task` protocol), taken in place of
    `cfg.name`'s."""
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
            label=label, tool_timeout=cfg.tool_timeout, reward_weights=cfg.reward_weights,
        )  # fmt: skip
    common = dict(num_train=cfg.num_train, num_eval=cfg.num_eval, seed=seed, tokenizer=tokenizer)
    try:
        return TASKS[cfg.name](**_settings(cfg), **common)
    except SandboxUnavailable as e:
        raise ConfigError(f"task.code.isolation: {e}") from e


def _settings(cfg) -> dict:
    """The factory's keywords from the task's own config section (task.<name>.*)."""
    if cfg.name == "arithmetic":
        a = cfg.arithmetic
        return dict(max_digits=a.max_digits, ops=a.ops, demo_noise=a.demo_noise)
    if cfg.name == "countdown":
        c = cfg.countdown
        return dict(numbers=c.numbers, max_number=c.max_number, max_target=c.max_target)
    if cfg.name == "reasoning_gym":
        r = cfg.reasoning_gym
        return dict(datasets=r.datasets, configs=r.configs, **_template(r.template))
    if cfg.name == "code":
        c = cfg.code
        if not c.data:
            raise ConfigError("task.code.data: the code task needs a .jsonl file of problems")
        return dict(
            data=c.data, eval_data=c.eval_data, partial_credit=c.partial_credit,
            sandbox=c.limits, isolation=c.isolation, allow_unisolated=c.allow_unisolated,
            workers=c.workers or None, **_template(c.template),
        )  # fmt: skip
    m = cfg.math
    if not m.data:
        raise ConfigError(
            "task.math.data: the math task needs a file or dataset (--set task.math.data=...)"
        )
    return dict(
        data=m.data, eval_data=m.eval_data, question_key=m.question_key,
        answer_key=m.answer_key, template=m.template, timeout=m.verify_timeout,
    )  # fmt: skip


def _template(template: str | None) -> dict:
    return {} if template is None else {"template": template}


def make_scorer(cfg, task) -> Scorer:
    """The scorer a TaskConfig sets up for `task` (task.score_workers, score_timeout, ...)."""
    return Scorer(
        task,
        workers=cfg.score_workers,
        timeout=cfg.score_timeout,
        strip_think=cfg.strip_think,
        weights=cfg.reward_weights,
        pass_part=cfg.pass_part,
        max_failure_fraction=cfg.max_failure_fraction,
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
