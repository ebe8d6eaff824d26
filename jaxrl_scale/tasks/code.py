"""Programming problems graded by running the completion's program on unit tests in a sandbox.

Data: JSONL rows, one problem each, in one of two styles:
  stdin/stdout   {"prompt": str, "tests": [{"input": str, "output": str}, ...]}
  function call  {"prompt": str, "fn_name": str, "tests": [{"args": [...], "output": ...}, ...]}
and optionally "solution" (a reference program, the warm start's demonstration). A malformed
row is a CodeDataError naming the file and line. The held-out split is `eval_data` when given,
else `num_eval` rows drawn (by the seed) from the training data and removed from it.

Scoring: the completion's program is its last closed fenced block whose language is python,
py, python3 or none; a completion without one scores 0.0. The program runs once per test in
the Sandbox (sandbox.py). A stdin/stdout test passes when its stdout equals the expected
output after trimming: surrounding blank space, and trailing blank space on every line. A
function-call test calls `fn_name` (a top-level function, else a method of `Solution()`) on
the JSON arguments and passes when the JSON result equals `output` in value and type
(`same_value`: `true` is not `1`, `1.0` is not an expected `1`; `1` is an expected `1.0`).
Score range [0, 1]: 1.0 when every test passes, else 0.0; with `partial_credit` the fraction
of tests passed.
`score_many` runs a batch's programs on the sandbox's pool at once; `stats()` returns and
resets the counts of runs, timeouts, sandbox failures, seconds and runs under a memory cgroup
(`code_cgroup_runs`; fewer than `code_runs` where the machine gives runs no cgroup) since its
last call.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
from pathlib import Path

import numpy as np

from jaxrl_scale.models.tokenizer import Tokenizer
from jaxrl_scale.tasks.sandbox import RunResult, Sandbox, SandboxLimits
from jaxrl_scale.tasks.splits import split_examples

DEFAULT_TEMPLATE = (
    "{prompt}\n\nWrite a complete Python 3 program that reads the input from standard input and "
    "writes the answer to standard output. Put the program in one ```python code block."
)
DEFAULT_FN_TEMPLATE = (
    "{prompt}\n\nWrite a Python 3 function `{fn_name}`. Put the code in one ```python code block."
)
_PYTHON_FENCES = ("", "python", "py", "python3")
# Appended to a function-call program: call the function on the JSON arguments from stdin.
_CALL = """

import json as _json, sys as _sys
_args = _json.loads(_sys.stdin.read())
_fn = globals().get({fn!r})
if _fn is None:
    _fn = getattr(globals()["Solution"](), {fn!r})
_sys.stdout.write("\\n" + _json.dumps(_fn(*_args)) + "\\n")
"""


class CodeDataError(ValueError):
    """The code data cannot be used; the message names the file, line and field."""


def last_code_block(text: str) -> str | None:
    """The body of the last closed ``` fence whose language is python/py/python3 or empty."""
    blocks, body, language = [], None, ""
    for line in text.splitlines():
        stripped = line.strip()
        if body is None:
            if stripped.startswith("```"):
                body, language = [], stripped[3:].strip().lower()
        elif stripped == "```":
            if language in _PYTHON_FENCES:
                blocks.append("\n".join(body))
            body = None
        else:
            body.append(line)
    return blocks[-1] if blocks else None


def normalise_output(text: str) -> str:
    """Output as compared: trailing blank space of each line and blank lines at the ends gone."""
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _check_row(row, where: str) -> dict:
    if not isinstance(row, dict):
        raise CodeDataError(f"{where}: expected a JSON object")
    if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
        raise CodeDataError(f"{where}: missing or empty 'prompt' (keys: {sorted(row)})")
    tests = row.get("tests")
    if not isinstance(tests, list) or not tests:
        raise CodeDataError(f"{where}: 'tests' must be a non-empty list")
    fn_name = row.get("fn_name")
    if fn_name is not None and not (isinstance(fn_name, str) and fn_name.isidentifier()):
        raise CodeDataError(f"{where}: 'fn_name' must be a Python identifier, got {fn_name!r}")
    for i, test in enumerate(tests):
        if fn_name is None:
            ok = isinstance(test, dict) and all(
                isinstance(test.get(k), str) for k in ("input", "output")
            )
            need = "string 'input' and 'output'"
        else:
            ok = isinstance(test, dict) and isinstance(test.get("args"), list) and "output" in test
            need = "a list 'args' and an 'output'"
        if not ok:
            raise CodeDataError(f"{where}: tests[{i}] needs {need}, got {test!r:.200}")
    if "solution" in row and not isinstance(row["solution"], str):
        raise CodeDataError(f"{where}: 'solution' must be a string")
    return row


def load_examples(
    path: str, *, template: str, fn_template: str = DEFAULT_FN_TEMPLATE
) -> list[dict]:
    """JSONL rows -> examples {prompt, question, tests[, fn_name][, solution]}."""
    file = Path(path)
    if file.suffix != ".jsonl":
        raise CodeDataError(f"{path}: the code task reads .jsonl files")
    if not file.exists():
        raise CodeDataError(f"{path}: no such file")
    examples = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise CodeDataError(f"{where}: not valid JSON ({e.msg})") from None
        row = _check_row(row, where)
        fn_name = row.get("fn_name")
        text = (template if fn_name is None else fn_template).format(
            prompt=row["prompt"], fn_name=fn_name
        )
        example = {"prompt": text, "question": row["prompt"], "tests": row["tests"]}
        for key in ("fn_name", "solution"):
            if row.get(key) is not None:
                example[key] = row[key]
        examples.append(example)
    if not examples:
        raise CodeDataError(f"{path}: no rows")
    return examples


def _job(program: str, example: dict, test: dict) -> tuple[str, str]:
    fn = example.get("fn_name")
    if fn is None:
        return program, test["input"]
    return program + _CALL.format(fn=fn), json.dumps(test["args"])


def _passed(result: RunResult, example: dict, test: dict) -> bool:
    if result.status != "ok":
        return False
    if example.get("fn_name") is None:
        return normalise_output(result.stdout) == normalise_output(test["output"])
    lines = result.stdout.rstrip("\n").rsplit("\n", 1)  # the harness prints the last line
    try:
        return same_value(json.loads(lines[-1]), test["output"])
    except json.JSONDecodeError:
        return False


def same_value(got, want) -> bool:
    """JSON values equal in value and type: `true` is not `1`, nor `1.0` an expected `1`;
    an int may stand for an expected float of equal value. Lists and objects compare
    element by element."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if isinstance(want, float):
        return isinstance(got, int | float) and got == want
    if isinstance(want, list):
        return (
            isinstance(got, list)
            and len(got) == len(want)
            and all(same_value(g, w) for g, w in zip(got, want, strict=True))
        )
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and got.keys() == want.keys()
            and all(same_value(got[k], want[k]) for k in want)
        )
    return type(got) is type(want) and got == want


class CodeTask:
    name = "code"

    def __init__(
        self,
        *,
        data: str,
        tokenizer: Tokenizer | None,
        eval_data: str | None = None,
        num_eval: int = 64,
        num_train: int = 0,
        seed: int = 0,
        template: str = DEFAULT_TEMPLATE,
        partial_credit: bool = False,
        sandbox: Sandbox | SandboxLimits | None = None,
        isolation: str = "auto",
        allow_unisolated: bool = False,
        workers: int | None = None,
    ):
        """`sandbox`: a Sandbox to share, or the limits of one this task builds with
        `isolation`, `allow_unisolated` and `workers` (see Sandbox)."""
        if tokenizer is None:
            raise ValueError(
                "the code task takes its tokenizer from the model: set model.init_from to a "
                "Hugging Face folder"
            )
        if "{prompt}" not in template:
            raise ValueError("task.code.template must contain '{prompt}'")
        self.tokenizer = tokenizer
        self.partial_credit = partial_credit
        load = lambda path: load_examples(path, template=template)  # noqa: E731
        self.train_examples, self.eval_examples = split_examples(
            load(data), load(eval_data) if eval_data else None, num_train=num_train,
            num_eval=num_eval, seed=seed, source=data, error=CodeDataError,
        )  # fmt: skip
        if isinstance(sandbox, Sandbox):
            self.sandbox = sandbox
        else:
            self.sandbox = Sandbox(
                sandbox, isolation=isolation, allow_unisolated=allow_unisolated, workers=workers
            )
        self._local = threading.local()  # per-thread counters (`stats`)

    _COUNTS = (
        "code_runs", "code_timeouts", "code_seconds", "code_no_block", "code_errors",
        "code_cgroup_runs",
    )  # fmt: skip

    def score(self, completion: str, example: dict) -> float:
        return self.score_many([completion], [example])[0]

    def score_many(self, completions: list[str], examples: list[dict]) -> list[float]:
        """Scores of a batch, every test of every program run on the sandbox's pool at once;
        without partial credit a program's tests not yet started are dropped at its first
        failure (its score is 0 whatever they give)."""
        if len(completions) != len(examples):
            raise ValueError(f"{len(completions)} completions for {len(examples)} examples")
        programs = [last_code_block(c) for c in completions]
        owner, runs = {}, {}  # future -> (completion, test); completion -> its futures
        for i, (program, example) in enumerate(zip(programs, examples, strict=True)):
            if program is None:
                continue
            for test in example["tests"]:
                future = self.sandbox.submit(*_job(program, example, test))
                owner[future] = (i, test)
                runs.setdefault(i, []).append(future)
        passed = np.zeros(len(completions))
        results = []
        for future in cf.as_completed(owner):
            if future.cancelled():
                continue
            i, test = owner[future]
            result = future.result()
            results.append(result)
            ok = _passed(result, examples[i], test)
            passed[i] += ok
            if not ok and not self.partial_credit:
                for other in runs[i]:
                    other.cancel()
        c = self._counts()
        c["code_runs"] += len(results)
        c["code_timeouts"] += sum(r.status == "timeout" for r in results)
        c["code_errors"] += sum(r.status == "sandbox_error" for r in results)
        c["code_cgroup_runs"] += sum(r.cgroup for r in results)
        c["code_seconds"] += sum(r.seconds for r in results)
        c["code_no_block"] += sum(p is None for p in programs)
        scores = []
        for i, example in enumerate(examples):
            fraction = passed[i] / len(example["tests"])
            scores.append(float(fraction if self.partial_credit else fraction == 1.0))
        return scores

    def _counts(self) -> dict[str, float]:
        """The calling thread's counters: the trainer's rollouts and a concurrent evaluation
        each read back only their own runs."""
        if not hasattr(self._local, "counts"):
            self._local.counts = dict.fromkeys(self._COUNTS, 0.0)
        return self._local.counts

    def stats(self) -> dict[str, float]:
        """This thread's counts since its last call (runs, timeouts, sandbox failures, run
        seconds summed, completions without a program, runs in a memory cgroup), reset by the
        call."""
        counts = dict(self._counts())
        self._local.counts = dict.fromkeys(self._COUNTS, 0.0)
        return counts

    def demonstration(self, example: dict, rng: np.random.Generator | None = None) -> str:
        if "solution" not in example:
            raise ValueError(
                "the code task's warm start needs a 'solution' field in its rows; this "
                f"problem has none: {example['question'][:80]!r}"
            )
        return f"```python\n{example['solution']}\n```"

    def close(self) -> None:
        self.sandbox.close()
