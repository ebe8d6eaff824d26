"""Verifiable tasks: prompts, a verifier `score(completion, example) -> float`, a held-out split.

task = get_task("arithmetic", max_digits=2)
task.train_examples, task.eval_examples      # lists of example dicts with a "prompt"
task.score("46", {"prompt": "12+34=", "answer": 46})  -> 1.0
"""

from __future__ import annotations

from jaxrl_scale.tasks.arithmetic import ArithmeticTask

TASKS = {"arithmetic": ArithmeticTask}


def get_task(name: str, **kwargs):
    """Build a registered task; unknown names are an error listing the known ones."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name](**kwargs)


__all__ = ["TASKS", "ArithmeticTask", "get_task"]
