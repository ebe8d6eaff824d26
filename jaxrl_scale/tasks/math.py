"""Math word problems with reference answers, checked by `math-verify` in a worker process.

Data: a local JSONL file, a local Parquet file, or a Hugging Face `datasets` name ("name",
"name:config" or "name:config:split"); rows need a question and a reference answer under
`question_key` / `answer_key`. A reference that is a full solution ("... \\boxed{42}" or
"... #### 42") is reduced to its final answer. The held-out split is `eval_data` when given,
else `num_eval` rows drawn (by the seed) from the training data and removed from it.

Scoring: the completion's final answer is the content of its last `\\boxed{...}` (braces
matched), else of a final-answer line ("Final answer: ...", "The answer is ...", "#### ...").
Only the completion's last TAIL_CHARS characters are read, in time linear in their length:
this runs on the thread that feeds the trainer, so no completion may make it backtrack.
Score range {0.0, 1.0}. An answer equal to the reference after whitespace and `$` removal
scores 1.0 at once; otherwise `math_verify.verify` decides in a worker process with a timeout,
so a pathological expression cannot hang training (it scores 0.0, counted and logged, and the
worker is replaced). The worker is an interpreter of its own (`Verifier`): the script that
starts training needs no `if __name__ == "__main__":` guard, and a worker that cannot start
(math-verify not installed) is an error, not a run of 0.0 scores.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

from jaxrl_scale.models.tokenizer import Tokenizer
from jaxrl_scale.tasks.config import MathConfig
from jaxrl_scale.tasks.scoring import ScorerBroken
from jaxrl_scale.tasks.splits import split_examples

DEFAULT_TEMPLATE = MathConfig.template  # one definition, in the config
MAX_ANSWER_CHARS = 512
TAIL_CHARS = 16384  # of a completion read for its final answer (it states it at its end)
# Where a final-answer line's answer starts. Literals only: a search is linear, and what
# follows each one is read with str methods (`_final_line`), never by backtracking.
_FINAL_MARKER = re.compile(r"final answer|the answer is|^####", re.IGNORECASE | re.MULTILINE)
_BRACE = re.compile(r"[{}]")
_SPACE = re.compile(r"\s*")


class MathDataError(ValueError):
    """The math data cannot be used; the message names the file, row and field."""


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) with nested braces matched."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    begin = text.index("{", start) + 1
    depth = 1
    for brace in _BRACE.finditer(text, begin):  # one step per brace: linear
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return text[begin : brace.start()].strip()
    return None  # unbalanced


def extract_answer(text: str) -> str | None:
    """The final answer of a solution or completion (its last TAIL_CHARS characters), or None
    when it states none."""
    text = text[-TAIL_CHARS:]
    return last_boxed(text) or _final_line(text)


def _final_line(text: str) -> str | None:
    """The answer of the last final-answer line: after a marker ("final answer", "the answer
    is", a line's leading "####"), whitespace (line breaks too), an optional "is", ":" or
    "=", the rest of that line up to an optional final "." and whitespace. A marker inside an
    answer already read is part of it. Each character is read a bounded number of times."""
    found, end = None, 0
    for marker in _FINAL_MARKER.finditer(text):
        if marker.start() < end:  # inside the previous answer's line
            continue
        i = _SPACE.match(text, marker.end()).end()
        if text[i : i + 2].lower() == "is":
            i = _SPACE.match(text, i + 2).end()
        if text[i : i + 1] in (":", "="):
            i = _SPACE.match(text, i + 1).end()
        stop = text.find("\n", i)
        stop = len(text) if stop < 0 else stop
        answer = text[i:stop].rstrip().removesuffix(".").rstrip()
        if answer:
            found, end = answer, stop
    return found


def _normalise(answer: str) -> str:
    return re.sub(r"\s+|\$", "", answer).rstrip(".")


def _verify(gold: str, answer: str) -> bool:
    """Runs in the worker: math-verify's parse and verify on `$...$`-wrapped answers."""
    from math_verify import parse, verify

    return bool(verify(parse(f"${gold}$"), parse(f"${answer}$")))


def serve() -> None:
    """The verifier's worker process: a `ready` line once math-verify is imported, then for
    each `[gold, answer]` JSON line on stdin a line `1` (equivalent) or `0` on stdout."""
    replies = os.fdopen(os.dup(1), "w")  # the parent reads only these lines: whatever the
    os.dup2(2, 1)  # libraries print goes to stderr
    try:
        import math_verify  # noqa: F401
    except ImportError as e:
        message = f"the math task needs math-verify ({e}): pip install 'jaxrl-scale[math]'"
        replies.write(f"error: {message}\n")
        replies.flush()
        return
    replies.write("ready\n")
    replies.flush()
    for line in sys.stdin:
        gold, answer = json.loads(line)
        try:
            equal = _verify(gold, answer)
        except Exception:  # math-verify could not parse or compare: not a match
            equal = False
        replies.write("1\n" if equal else "0\n")
        replies.flush()


class VerifierError(ScorerBroken):
    """The math-verify worker cannot run; scoring would silently be wrong."""


class Verifier:
    """math-verify in a separate process, one call at a time, each with a timeout.

    The worker is a fresh interpreter that runs `serve` (not a multiprocessing child, which
    would import the script that started training again and, in a script without an
    `if __name__ == "__main__":` guard, run its training again instead of verifying). A call
    that takes longer than `timeout` seconds, or whose worker dies, scores 0.0, is counted in
    `abandoned` and logged, and the worker is replaced. A worker that cannot start (no
    math-verify installed, or no `ready` line within `start_timeout` seconds) is a
    VerifierError, never a score.

    Shared by threads: in `pipeline_rl` the generator thread scores training rollouts while the
    main thread scores evaluations, and either may find the worker hung and replace it. The
    lock makes each call (write, wait, replace) one unit, so no thread talks to a worker that
    another has just killed; calls are one at a time anyway (one worker)."""

    def __init__(self, timeout: float = 5.0, *, start_timeout: float = 120.0):
        self.timeout, self.start_timeout = timeout, start_timeout
        self.abandoned = 0  # calls scored 0.0 because they timed out or their worker died
        self._lock = threading.Lock()
        self._worker: subprocess.Popen | None = None

    def _started(self) -> subprocess.Popen:
        if self._worker is not None:
            return self._worker
        # The parent's import path, as multiprocessing gives its children, and nothing else.
        code = (
            f"import sys; sys.path[:] = {sys.path!r}; import jaxrl_scale.tasks.math as m; m.serve()"
        )
        command = [sys.executable, "-c", code]
        worker = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = _read_line(worker, self.start_timeout)
        if line != "ready\n":
            worker.kill()
            worker.wait()
            if line and line.startswith("error: "):
                raise VerifierError(line[len("error: ") :].strip())
            raise VerifierError(
                "the math-verify worker process "
                + ("exited" if line == "" else f"did not start within {self.start_timeout:g} s")
                + f" (its stderr is above; {sys.executable} runs it)"
            )
        self._worker = worker
        return worker

    def __call__(self, gold: str, answer: str) -> bool:
        with self._lock:
            worker = self._started()
            try:
                worker.stdin.write(json.dumps([gold, answer]) + "\n")
                worker.stdin.flush()
                reply = _read_line(worker, self.timeout)
            except BrokenPipeError:  # the worker died between calls
                reply = ""
            if reply in ("1\n", "0\n"):
                return reply == "1\n"
            self._close(kill=True)  # stuck (no reply in time) or dead: replace it
            self.abandoned += 1
            why = f"no answer within {self.timeout:g} s" if reply is None else "the worker died"
            print(
                f"math-verify: {why} checking {answer[:80]!r} against {gold[:80]!r}; scored 0.0, "
                f"worker replaced ({self.abandoned} so far)",
                file=sys.stderr,
                flush=True,
            )
            return False

    def close(self, kill: bool = False) -> None:
        with self._lock:
            self._close(kill)

    def _close(self, kill: bool) -> None:
        worker, self._worker = self._worker, None
        if worker is None:
            return
        if kill:
            worker.kill()
        with contextlib.suppress(BrokenPipeError):
            worker.stdin.close()  # a live worker's loop ends at the end of its input
        try:
            worker.wait(timeout=10)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        worker.stdout.close()


def _read_line(worker: subprocess.Popen, timeout: float) -> str | None:
    """The worker's next line ("" if it exited), or None when none came within `timeout`."""
    ready, _, _ = select.select([worker.stdout], [], [], timeout)
    return worker.stdout.readline() if ready else None


def _read_rows(source: str) -> list[dict]:
    path = Path(source)
    if path.suffix == ".jsonl":
        if not path.exists():
            raise MathDataError(f"{path}: no such file")
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise MathDataError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise MathDataError(f"{path}:{number}: expected a JSON object")
            rows.append(row)
        return rows
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise MathDataError(
                f"{path}: reading Parquet needs pyarrow (pip install 'jaxrl-scale[math]')"
            ) from None
        if not path.exists():
            raise MathDataError(f"{path}: no such file")
        return pq.read_table(path).to_pylist()
    try:
        import datasets
    except ImportError:
        raise MathDataError(
            f"{source!r} is not a .jsonl / .parquet file; loading a Hugging Face dataset by "
            "name needs the datasets library (pip install 'jaxrl-scale[math]')"
        ) from None
    name, _, rest = source.partition(":")
    config, _, split = rest.partition(":")
    return list(datasets.load_dataset(name, config or None, split=split or "train"))


def load_examples(source: str, *, question_key: str, answer_key: str, template: str) -> list[dict]:
    """Rows -> examples {prompt, question, answer}; a bad row is an error naming it."""
    examples = []
    for number, row in enumerate(_read_rows(source), start=1):
        where = f"{source}: row {number}"
        for key in (question_key, answer_key):
            if not isinstance(row.get(key), str | int | float) or str(row[key]).strip() == "":
                raise MathDataError(f"{where}: missing or empty {key!r} (keys: {sorted(row)})")
        reference = str(row[answer_key])
        answer = (
            extract_answer(reference)
            if ("\\boxed" in reference or "####" in reference)
            else reference
        )
        if not answer:
            raise MathDataError(f"{where}: no final answer in {answer_key!r}")
        question = str(row[question_key])
        examples.append(
            {"prompt": template.format(question=question), "question": question, "answer": answer}
        )
    if not examples:
        raise MathDataError(f"{source}: no rows")
    return examples


class MathTask:
    name = "math"

    def __init__(
        self,
        *,
        data: str,
        tokenizer: Tokenizer | None,
        eval_data: str | None = None,
        num_eval: int = 64,
        num_train: int = 0,
        seed: int = 0,
        question_key: str = "problem",
        answer_key: str = "answer",
        template: str = DEFAULT_TEMPLATE,
        timeout: float = 5.0,
    ):
        if tokenizer is None:
            raise ValueError(
                "the math task takes its tokenizer from the model: set model.init_from to a "
                "Hugging Face folder"
            )
        if "{question}" not in template:
            raise ValueError("task.template must contain '{question}'")
        self.tokenizer = tokenizer
        load = lambda s: load_examples(  # noqa: E731
            s, question_key=question_key, answer_key=answer_key, template=template
        )
        self.train_examples, self.eval_examples = split_examples(
            load(data), load(eval_data) if eval_data else None, num_train=num_train,
            num_eval=num_eval, seed=seed, source=data, error=MathDataError,
        )  # fmt: skip
        self.verifier = Verifier(timeout)

    def score(self, completion: str, example: dict) -> float:
        answer = extract_answer(completion)
        if answer is None or len(answer) > MAX_ANSWER_CHARS:
            return 0.0
        if _normalise(answer) == _normalise(example["answer"]):
            return 1.0
        return 1.0 if self.verifier(example["answer"], answer) else 0.0

    def score_many(self, completions: list[str], examples: list[dict]) -> list[float]:
        """One after another on the caller's thread: the verifier is one worker process
        with its own timeout per call, so a pool of threads would only queue on it."""
        return [self.score(c, e) for c, e in zip(completions, examples, strict=True)]

    def demonstration(self, example: dict, rng: np.random.Generator | None = None) -> str:
        return f"The answer is \\boxed{{{example['answer']}}}."
