"""Tool use: Python functions offered to the model, its calls parsed and answered.

    def add(a: int, b: int) -> int:
        "Add two integers."
        return a + b

    class Task:                        # a task with `tools` (and `score`) runs tool episodes
        tools = [add]
        ...

A task that gives `tools` and no `make_env` gets a `ToolEnv` per episode: the prompt (the
example's chat messages as given, or its string as a user message) goes out with the tools'
JSON schemas in the chat template's `tools`; each model turn's content (its thinking cut
off) is searched for calls in its model family's format (models/parsers.py): Qwen/Hermes
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, or Llama-3 JSON
`{"name": ..., "parameters": {...}}` turns (`family`, `tool_family(tokenizer)` picks it);
calls are answered as tool messages and the model takes another turn; a turn without a call
is the final answer, scored by the task's `score` (its thinking cut off), which ends the
episode: a number, or named parts summed with the task's `reward_weights` (1 each
otherwise), as single-turn samples are. A malformed call, an unknown tool, bad arguments, a
tool that raises or runs past `timeout`: the model is told so in the tool message and the
episode goes on; each is counted (`tool_errors`). `python_tool(sandbox)` runs the model's
code in the code task's sandbox.
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable, Mapping, Sequence

from jaxrl_scale.models.parsers import MalformedCall, check_family, parse
from jaxrl_scale.tasks.scoring import strip_think
from jaxrl_scale.tasks.workers import WorkerPool

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array",
               dict: "object"}  # fmt: skip


def schema(fn: Callable) -> dict:
    """The function's JSON schema as chat templates take it: its name, the docstring's first
    paragraph as the description, each parameter's type from its annotation."""
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        kind = _JSON_TYPES.get(typing.get_origin(hints.get(name)) or hints.get(name), "string")
        properties[name] = {"type": kind}
        if p.default is inspect.Parameter.empty:
            required.append(name)
    doc = inspect.getdoc(fn) or ""
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": doc.split("\n\n")[0].strip(),
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def parse_calls(text: str, family: str = "hermes") -> list[dict | str]:
    """The calls in a model turn's content, in order, as the tools take them: {"name",
    "arguments"} each (arguments a dict), or the text of why a call could not be read."""
    return [call.error if isinstance(call, MalformedCall)
            else {"name": call.name, "arguments": json.loads(call.arguments)}
            for call in parse(text, family).calls]  # fmt: skip


class ToolEnv:
    """One tool-use episode (see the module's docstring). `tool_errors` counts what went
    wrong with the model's calls; the episode runner reads it at the end."""

    def __init__(self, example: dict, tools: Sequence[Callable], score, *, pool: WorkerPool,
                 timeout: float = 10.0, weights: Mapping[str, float] | None = None,
                 family: str = "hermes"):  # fmt: skip
        self.example, self.score, self.pool, self.timeout = example, score, pool, timeout
        self.family = check_family(family)  # the tool call format (models/parsers.py)
        self.weights = dict(weights or {})
        self.functions = {fn.__name__: fn for fn in tools}
        self.tools = [schema(fn) for fn in tools]
        self.tool_errors = 0

    def reset(self):
        # A chat prompt's messages as the user gave them (UserTask keeps them beside the
        # rendered text): rendering that text again as a user message would wrap it twice.
        prompt = self.example.get("messages") or self.example["prompt"]
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt

    def step(self, action: str):
        calls = parse_calls(action, self.family)
        if not calls:  # the final answer
            answer = strip_think(action)
            return None, self._reward(self.score(answer, self.example)) if answer else 0.0, True
        return [{"role": "tool", "content": self._answer(call)} for call in calls], 0.0, False

    def _reward(self, value) -> float:
        """A score as the episode's reward: a number, or its named parts' weighted sum."""
        if isinstance(value, Mapping):
            return sum(self.weights.get(str(k), 1.0) * float(v) for k, v in value.items())
        return float(value)

    def _answer(self, call: dict | str) -> str:
        if isinstance(call, str):
            return self._error(call)
        fn = self.functions.get(call["name"])
        if fn is None:
            known = ", ".join(self.functions)
            return self._error(f"no tool named {call['name']!r} (tools: {known})")
        try:
            inspect.signature(fn).bind(**call["arguments"])
        except TypeError as e:
            return self._error(f"{call['name']}: {e}")
        [(status, got)] = self.pool.gather([self.pool.submit(lambda: fn(**call["arguments"]))],
                                           self.timeout)  # fmt: skip
        if status == "timeout":
            return self._error(f"{call['name']} did not answer within {self.timeout:g} s")
        if status == "error":
            return self._error(f"{call['name']} raised {type(got).__name__}: {got}")
        return got if isinstance(got, str) else json.dumps(got, default=str)

    def _error(self, why: str) -> str:
        self.tool_errors += 1
        return f"error: {why}"


def python_tool(sandbox) -> Callable[[str], str]:
    """A tool `python(code)` that runs the model's program in `sandbox` (tasks/sandbox.py)
    and answers its standard output, or what went wrong."""

    def python(code: str) -> str:
        """Run a Python program and return what it prints.

        code: the program's source."""
        result = sandbox.run(code, "")
        if result.status == "ok":
            return result.stdout
        return f"{result.status}: {result.stderr_tail[-500:]}"

    return python
