"""Verifiable tasks: prompts, a verifier `score(completion, example) -> float`, a held-out split.

task = make_task(cfg.task, seed=0)              # from a TaskConfig
task = get_task("arithmetic", max_digits=2)     # or by name with keyword arguments
task.train_examples, task.eval_examples         # lists of example dicts with a "prompt"
task.score("46", {"prompt": "12+34=", "answer": 46})  -> 1.0

arithmetic and countdown bring a character tokenizer (used unless one is passed); math takes
the model's tokenizer.
"""

from __future__ import annotations

from jaxrl_scale.tasks.arithmetic import ArithmeticTask
from jaxrl_scale.tasks.countdown import CountdownTask
from jaxrl_scale.tasks.math import MathTask

TASKS = {"arithmetic": ArithmeticTask, "countdown": CountdownTask, "math": MathTask}


def get_task(name: str, **kwargs):
    """Build a registered task; unknown names are an error listing the known ones."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name](**kwargs)


def make_task(cfg, *, seed: int, tokenizer=None):
    """The task a TaskConfig describes; `tokenizer` (the model's) replaces a built-in one."""
    common = dict(num_train=cfg.num_train, num_eval=cfg.num_eval, seed=seed, tokenizer=tokenizer)
    if cfg.name == "arithmetic":
        a = cfg.arithmetic
        return ArithmeticTask(max_digits=a.max_digits, ops=a.ops, demo_noise=a.demo_noise, **common)
    if cfg.name == "countdown":
        c = cfg.countdown
        return CountdownTask(
            numbers=c.numbers, max_number=c.max_number, max_target=c.max_target, **common
        )
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


__all__ = ["TASKS", "ArithmeticTask", "CountdownTask", "MathTask", "get_task", "make_task"]
