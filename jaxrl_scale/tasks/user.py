"""Your own task: an object with examples and a scorer, named by import path or passed in.

    task:
      name: my_project.rewards:make_task    # factory(**task.args) -> an object as below
      args: {data: rows.jsonl}

    train(cfg, out, task=MyTask())          # or the object itself, in a notebook

The object needs `train_examples` and `eval_examples` (lists of dicts whose "prompt" is a
string, or a list of chat messages {"role", "content"} rendered with the checkpoint's chat
template) and `score(completion, example)`, returning a float or a mapping of named parts
(see `Task`). It may bring a `tokenizer` (else the model's is used), a `demonstration(example,
rng) -> str` for the warm start, `reward_weights` for its parts, and `score_many` for batches.
A checkpoint's tokenizer (model.init_from) encodes the prompts when there is one, else the
task's own.

Across hosts each generator job builds the task from the same config: the factory's module
must be importable there too (installed, or on PYTHONPATH) and give the same examples.
"""

from __future__ import annotations

import importlib
import os
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jaxrl_scale.configbase import ConfigError
from jaxrl_scale.models.parsers import tool_family
from jaxrl_scale.tasks.tools import ToolEnv
from jaxrl_scale.tasks.workers import WorkerPool


@runtime_checkable
class Task(Protocol):
    """What the trainer needs of a task.

    `score(completion, example)` gets the completion's text (its thinking cut off, see
    tasks/scoring.py) and the example it answers, and returns its reward: a float (a verifier's
    usual range is [0, 1], which the pass-rate metrics assume), or a mapping of named parts
    summed with `reward_weights`. It runs in forked worker processes (tasks/workers.py), several at
    once, so what it changes on the task stays there; one that raises, hangs past
    task.score_timeout or returns a non-number scores that sample 0, counted. The examples it
    gets and the values it returns cross to and from those processes pickled, so they must
    pickle (plain data: strings, numbers, lists, dicts); an example that does not is its
    sample's error, naming what could not be sent. A `score_many(completions, examples)` runs
    there too, one call per batch given task.score_timeout for the whole batch."""

    train_examples: Sequence[dict]
    eval_examples: Sequence[dict]

    def score(self, completion: str, example: dict) -> float | Mapping[str, float]: ...


def import_factory(path: str):
    """The callable `package.module:attribute` names; a ConfigError naming task.name if not."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"task.name: {path!r} is not 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the config's to report
        raise ConfigError(
            f"task.name: cannot import {module_name!r} ({type(e).__name__}: {e}); the module "
            "must be importable where the trainer (and each generator job) runs"
        ) from e
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ConfigError(f"task.name: module {module_name!r} has no {attr!r}")
    if not callable(factory):
        raise ConfigError(f"task.name: {path!r} is a {type(factory).__name__}, not callable")
    return factory


def build(path: str, args: Mapping[str, Any]):
    """`factory(**args)` for the factory at import path `path`, errors naming the key."""
    factory = import_factory(path)
    try:
        return factory(**dict(args))
    except Exception as e:  # noqa: BLE001 - a factory's error, reported with its arguments
        raise ConfigError(
            f"task.args: {path}(**{dict(args)!r}) raised {type(e).__name__}: {e}"
        ) from e


class UserTask:
    """A user's task as the trainer reads it: examples checked, chat prompts rendered to
    text with the tokenizer's chat template, optional parts looked up once.

    The examples the trainer and the scorer see are copies of the user's with "prompt" the
    rendered text; a chat example keeps its messages under "messages"."""

    score_many_in_worker = True  # the user's batch scorer runs in a worker (tasks/scoring.py)

    def __init__(
        self,
        obj,
        *,
        tokenizer=None,
        num_train: int = 0,
        num_eval: int = 0,
        label: str = "task",
        tool_timeout: float = 10.0,
        reward_weights: Mapping[str, float] | None = None,
    ):
        # An environment task (`make_env`, tasks/env.py) rewards episodes, an agent task
        # (`agent`, rl/agents.py) its agent's: neither needs a `score`.
        episodic = hasattr(obj, "make_env") or hasattr(obj, "agent")
        needed = ("train_examples", "eval_examples") + (() if episodic else ("score",))
        missing = [a for a in needed if not hasattr(obj, a)]
        if missing:
            raise ConfigError(
                f"task.name: {label} gave a {type(obj).__name__} without {', '.join(missing)} "
                "(see jaxrl_scale.tasks.Task)"
            )
        if not callable(
            getattr(obj, "score", None)
            or getattr(obj, "make_env", None)
            or getattr(obj, "agent", None)
        ):
            raise ConfigError(f"task.name: {label}'s score is not callable")
        self.obj, self.name = obj, getattr(obj, "name", label)
        self.tokenizer = tokenizer or getattr(obj, "tokenizer", None)  # the model's first
        if self.tokenizer is None:
            raise ConfigError(
                f"task.name: {label} brings no tokenizer: set model.init_from to a checkpoint "
                "(its tokenizer is used) or give the task a `tokenizer`"
            )
        # Its parts' weights: the config's (task.reward_weights) over the object's own.
        self.reward_weights = {**(getattr(obj, "reward_weights", None) or {}),
                               **(reward_weights or {})}  # fmt: skip
        self.pass_part = getattr(obj, "pass_part", None)  # the part that means "solved"
        train = self._examples(obj.train_examples, "train_examples", label)
        held_out = self._examples(obj.eval_examples, "eval_examples", label)
        if num_train and len(train) > num_train:
            warnings.warn(
                f"task {self.name}: training on {num_train} of its {len(train)} examples "
                "(task.num_train; 0 = every one)",
                stacklevel=2,
            )
            train = train[:num_train]
        self.train_examples, self.eval_examples = train, held_out[: num_eval or None]
        for optional in ("score_many", "stats", "make_env", "agent"):  # batches; episodes
            if hasattr(obj, optional):
                setattr(self, optional, getattr(obj, optional))
        if getattr(obj, "tools", None) and not hasattr(obj, "make_env"):  # tool episodes
            self.tools, self.tool_timeout = list(obj.tools), tool_timeout
            self._tool_pools: dict[int, WorkerPool] = {}  # per process (see _tool_env)
            self._tool_pools_lock = threading.Lock()  # episodes are made on several threads
            self.make_env = self._tool_env

    def _examples(self, rows, what: str, label: str) -> list[dict]:
        try:
            rows = list(rows)
        except TypeError:
            raise ConfigError(f"task: {label}'s {what} is not a list of examples") from None
        if not rows:
            raise ConfigError(f"task: {label}'s {what} is empty")
        return [self._example(row, f"{label}'s {what}[{i}]") for i, row in enumerate(rows)]

    def _example(self, row, where: str) -> dict:
        if (
            isinstance(row, Mapping)
            and "prompt" not in row
            and (hasattr(self.obj, "make_env") or hasattr(self.obj, "agent"))
        ):
            return dict(row)  # its environment's reset, or its agent, gives the prompt
        if not isinstance(row, Mapping) or "prompt" not in row:
            raise ConfigError(f"task: {where} is not a dict with a 'prompt': {row!r:.120}")
        prompt = row["prompt"]
        if isinstance(prompt, str):
            if not prompt:
                raise ConfigError(f"task: {where}'s prompt is empty")
            return dict(row)
        if not _is_chat(prompt):
            raise ConfigError(
                f"task: {where}'s prompt is neither a string nor a list of chat messages "
                f"{{'role', 'content'}}: {prompt!r:.120}"
            )
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ConfigError(
                f"task: {where} is a chat prompt but the tokenizer has no chat template "
                "(a checkpoint's tokenizer_config.json 'chat_template' or chat_template.jinja)"
            )
        try:
            text = self.tokenizer.apply_chat_template(
                list(prompt), tools=row.get("tools"), add_generation_prompt=True
            )
        except Exception as e:  # noqa: BLE001 - the template's error, with the row it failed on
            raise ConfigError(f"task: {where}: the chat template failed: {e}") from e
        return {**row, "prompt": text, "messages": list(prompt)}

    def _tool_env(self, example: dict) -> ToolEnv:
        # One pool of tool threads per process, shared by its episodes: an environment made
        # in a worker process (tasks/env.py) cannot use threads started in its parent.
        with self._tool_pools_lock:
            pool = self._tool_pools.get(os.getpid())
            if pool is None:
                pool = self._tool_pools[os.getpid()] = WorkerPool(8, name="jaxrl-tool")
        return ToolEnv(example, self.tools, self.obj.score, pool=pool,
                       timeout=self.tool_timeout, weights=self.reward_weights,
                       family=tool_family(self.tokenizer))  # fmt: skip

    def score(self, completion: str, example: dict):
        return self.obj.score(completion, example)

    def demonstration(self, example: dict, rng: np.random.Generator | None = None) -> str:
        demo = getattr(self.obj, "demonstration", None)
        if demo is None:
            raise ConfigError(
                f"warm_start.steps: task {self.name} has no demonstration(example, rng) to "
                "imitate; set warm_start.steps=0 or give the task one"
            )
        return demo(example, rng)


def _is_chat(prompt) -> bool:
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and len(prompt) > 0
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt)
    )
