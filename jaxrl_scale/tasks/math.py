"""Math word problems with reference answers, checked by `math-verify` in a worker process.

Data: a local JSONL file, a local Parquet file, or a Hugging Face `datasets` name ("name",
"name:config" or "name:config:split"); rows need a question and a reference answer under
`question_key` / `answer_key`. A reference that is a full solution ("... \\boxed{42}" or
"... #### 42") is reduced to its final answer. The held-out split is `eval_data` when given,
else `num_eval` rows drawn (by the seed) from the training data and removed from it.

Scoring: the completion's final answer is the content of its last `\\boxed{...}` (braces
matched), else of a final-answer line ("Final answer: ...", "The answer is ...", "#### ...").
Score range {0.0, 1.0}. An answer equal to the reference after whitespace and `$` removal
scores 1.0 at once; otherwise `math_verify.verify` decides in a worker process with a timeout,
so a pathological expression cannot hang training (it scores 0.0 and the worker is replaced).
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import re
import threading
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from jaxrl_scale.config import MathConfig
from jaxrl_scale.tokenizer import Tokenizer

DEFAULT_TEMPLATE = MathConfig.template  # one definition, in the config
MAX_ANSWER_CHARS = 512
_FINAL_LINE = re.compile(
    r"(?:final answer\s*(?:is)?\s*[:=]?|the answer is\s*[:=]?|^####)\s*(.+?)\s*\.?\s*$",
    re.IGNORECASE | re.MULTILINE,
)


class MathDataError(ValueError):
    """The math data cannot be used; the message names the file, row and field."""


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) with nested braces matched."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i].strip()
        i += 1
    return None  # unbalanced


def extract_answer(text: str) -> str | None:
    """The final answer of a solution or completion, or None when it states none."""
    boxed = last_boxed(text)
    if boxed:
        return boxed
    lines = _FINAL_LINE.findall(text)
    return lines[-1].strip() if lines else None


def _normalise(answer: str) -> str:
    return re.sub(r"\s+|\$", "", answer).rstrip(".")


def _verify(gold: str, answer: str) -> bool:
    """Runs in the worker: math-verify's parse and verify on `$...$`-wrapped answers."""
    from math_verify import parse, verify

    return bool(verify(parse(f"${gold}$"), parse(f"${answer}$")))


class Verifier:
    """math-verify in a separate process, one call at a time, each with a timeout.

    Shared by threads: in `pipeline_rl` the generator thread scores training rollouts while the
    main thread scores evaluations, and either may find the worker hung and replace it. The
    lock makes each call (submit, wait, replace) one unit, so no thread waits on a pool that
    another has just shut down; calls are one at a time anyway (one worker)."""

    def __init__(self, timeout: float = 5.0):
        self.timeout = timeout
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            context = multiprocessing.get_context("spawn")  # never fork a process running JAX
            self._pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=context)
        return self._pool

    def __call__(self, gold: str, answer: str) -> bool:
        with self._lock:
            future = self._executor().submit(_verify, gold, answer)
            try:
                return future.result(timeout=self.timeout)
            except (concurrent.futures.TimeoutError, BrokenProcessPool):
                self._close(kill=True)  # the worker is stuck or dead: replace it
                return False
            except Exception:  # math-verify could not parse or compare: not a match
                return False

    def close(self, kill: bool = False) -> None:
        with self._lock:
            self._close(kill)

    def _close(self, kill: bool) -> None:
        if self._pool is None:
            return
        if kill:
            for process in list(getattr(self._pool, "_processes", {}).values()):
                process.kill()
        self._pool.shutdown(wait=not kill, cancel_futures=True)
        self._pool = None


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
        examples = load(data)
        if eval_data:
            held_out = load(eval_data)[:num_eval]
        else:
            if num_eval >= len(examples):
                raise MathDataError(
                    f"{data}: {len(examples)} rows cannot give {num_eval} held-out problems "
                    "and leave any to train on"
                )
            order = np.random.default_rng(seed).permutation(len(examples))
            held_out = [examples[i] for i in order[:num_eval]]
            examples = [examples[i] for i in np.sort(order[num_eval:])]
        self.eval_examples = held_out
        self.train_examples = examples[:num_train] if num_train else examples
        self.verifier = Verifier(timeout)

    def score(self, completion: str, example: dict) -> float:
        answer = extract_answer(completion)
        if answer is None or len(answer) > MAX_ANSWER_CHARS:
            return 0.0
        if _normalise(answer) == _normalise(example["answer"]):
            return 1.0
        return 1.0 if self.verifier(example["answer"], answer) else 0.0

    def demonstration(self, example: dict, rng: np.random.Generator | None = None) -> str:
        return f"The answer is \\boxed{{{example['answer']}}}."
