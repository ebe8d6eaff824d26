"""The math task: loading, answer extraction, math-verify equivalence in a worker with a timeout."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jaxrl_scale.models.tokenizer import CharTokenizer
from jaxrl_scale.tasks.math import (
    MathDataError,
    MathTask,
    Verifier,
    VerifierError,
    extract_answer,
    last_boxed,
    load_examples,
)

FIXTURE = Path(__file__).parent / "fixtures" / "math_small.jsonl"
TOK = CharTokenizer("0123456789")


@pytest.fixture(scope="module")
def task():
    t = MathTask(data=str(FIXTURE), tokenizer=TOK, num_eval=3, seed=0)
    yield t
    t.verifier.close()


def test_loading_splits_and_reduces_solutions_to_answers(task):
    assert len(task.eval_examples) == 3 and len(task.train_examples) == 9
    questions = [e["question"] for e in task.train_examples + task.eval_examples]
    assert len(set(questions)) == 12
    by_question = {e["question"]: e for e in task.train_examples + task.eval_examples}
    assert by_question["Solve $x+1=3$ for $x$."]["answer"] == "2"  # from \boxed{2}
    assert by_question[next(q for q in questions if q.startswith("Tom"))]["answer"] == "7"
    e = by_question["What is $2+3$?"]
    assert e["prompt"].startswith("What is $2+3$?\nPlease reason step by step")
    assert "\\boxed{}" in e["prompt"]


def test_extraction():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{\\frac{1}{2") is None
    assert extract_answer("so the final answer is: 42.") == "42"
    assert extract_answer("The answer is $\\frac{3}{4}$") == "$\\frac{3}{4}$"
    assert extract_answer("reasoning\n#### 7") == "7"
    assert extract_answer("I am not sure") is None


def test_final_answer_lines_are_read_as_documented():
    """The final-answer line's reading, pinned: the marker, whitespace (line breaks too), an
    optional "is", ":" or "=", the rest of that line without a final "."; the last one wins."""
    assert extract_answer("Final answer:\n\n42") == "42"
    assert extract_answer("The final answer: 3 . \n more") == "3"
    assert extract_answer("final answer: 1\nfinal answer: 2") == "2"
    assert extract_answer("FINAL ANSWER = 12 ") == "12"
    assert extract_answer("the final answer is") is None  # nothing after the marker
    assert extract_answer("x #### 5") is None  # "####" only opens a line
    assert extract_answer("The answer is \\boxed{4}. The answer is 5") == "4"  # boxed first


def test_long_whitespace_runs_are_read_in_linear_time(task):
    """The final-answer regex backtracked on runs of whitespace (~k^2.8: over a second for a
    line with two runs of 800 spaces), on the thread that feeds the trainer, with no timeout
    that could stop it. Each shape below took 0.5-1.4 s; now each character is read a bounded
    number of times, and only a completion's last TAIL_CHARS are read at all."""
    k = 800
    shapes = {
        "final answer" + " " * k + "4" + " " * k + "2": "42",
        "The answer is" + " " * k + "4" + " " * k + ".2": "4.2",
        "#### " + "\t" * k + "4" + " \n" * k + "2": "4",
        "\\boxed{" + "{" * (10 * k) + "final answer" + " " * (5 * k) + "4": "4",  # unbalanced
    }
    start = time.perf_counter()
    answers = [extract_answer(text) for text in shapes]
    scores = task.score_many(list(shapes), [{"answer": want} for want in shapes.values()])
    took = time.perf_counter() - start
    assert [a.replace(" ", "") for a in answers] == list(shapes.values())
    assert scores == [0.0, 0.0, 1.0, 1.0]  # answers over MAX_ANSWER_CHARS score 0 at once
    assert took < 0.1, f"{took:.3f} s"


@pytest.mark.parametrize(
    ("completion", "answer", "score"),
    [
        ("Adding gives \\boxed{5}.", "5", 1.0),
        ("It is \\boxed{0.5}", "\\frac{1}{2}", 1.0),  # equivalent, decided by math-verify
        ("It is \\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("It is \\boxed{2^{10}}", "1024", 1.0),
        ("It is \\boxed{6}", "5", 0.0),
        ("no answer here", "5", 0.0),
        ("\\boxed{" + "9" * 600 + "}", "5", 0.0),  # over-long answer
    ],
)
def test_scores(task, completion, answer, score):
    assert task.score(completion, {"answer": answer}) == score


def test_a_hanging_verification_times_out_and_the_worker_is_replaced():
    verifier = Verifier(timeout=2.0)
    try:
        assert verifier("1", "1")  # warms the worker (spawn + imports)
        start = time.perf_counter()
        # sympy would compute this power tower exactly: it does not finish.
        assert verifier("1", "9^{9^{9^{9^{9}}}} - 9^{9^{9^{9^{9}}}} + 1") is False
        assert time.perf_counter() - start < 10
        assert verifier.abandoned == 1  # counted (and logged)
        assert verifier("\\frac{1}{2}", "0.5")  # a fresh worker answers again
    finally:
        verifier.close()


def test_bad_data(tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "oops"\n')
    with pytest.raises(MathDataError, match="bad.jsonl:2: not valid JSON"):
        load_examples(
            str(bad_json), question_key="problem", answer_key="answer", template="{question}"
        )
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"problem": "1+1"}) + "\n")
    with pytest.raises(MathDataError, match="row 1: missing or empty 'answer'"):
        load_examples(
            str(missing), question_key="problem", answer_key="answer", template="{question}"
        )
    with pytest.raises(MathDataError, match="no such file"):
        load_examples(
            str(tmp_path / "nope.jsonl"), question_key="q", answer_key="a", template="{question}"
        )
    with pytest.raises(ValueError, match="model.init_from"):
        MathTask(data=str(FIXTURE), tokenizer=None)
    with pytest.raises(MathDataError, match="cannot give 12 held-out"):
        MathTask(data=str(FIXTURE), tokenizer=TOK, num_eval=12)


def test_parquet_and_separate_eval_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    renamed = [{"question": r["problem"], "final": r["answer"]} for r in rows]
    pq.write_table(pa.Table.from_pylist(renamed[:8]), tmp_path / "train.parquet")
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in renamed[8:]))
    task = MathTask(
        data=str(tmp_path / "train.parquet"),
        eval_data=str(tmp_path / "eval.jsonl"),
        tokenizer=TOK,
        num_eval=3,
        question_key="question",
        answer_key="final",
    )
    assert [e["question"] for e in task.train_examples] == [r["question"] for r in renamed[:8]]
    assert [e["question"] for e in task.eval_examples] == [r["question"] for r in renamed[8:11]]
    assert task.eval_examples[0]["answer"] == renamed[8]["final"]


def test_two_threads_share_the_verifier_while_one_call_hangs():
    """In pipeline_rl the generator thread scores rollouts while the main thread scores
    evaluations. A hanging call replaces the worker; a call from the other thread must still
    get its true answer, not a pool shut down under it (which scored 0)."""
    verifier = Verifier(timeout=1.5)
    results, errors = [], []

    def hang():
        try:
            results.append(("hang", verifier("1", "9^{9^{9^{9^{9}}}} - 9^{9^{9^{9^{9}}}} + 1")))
        except Exception as e:  # noqa: BLE001  reported below
            errors.append(e)

    def equivalent():
        try:
            for _ in range(3):
                results.append(("equal", verifier("\\frac{1}{2}", "0.5")))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    try:
        assert verifier("1", "1")  # warm the worker
        threads = [threading.Thread(target=hang), threading.Thread(target=equivalent)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors and not any(t.is_alive() for t in threads)
        assert ("hang", False) in results
        assert [ok for name, ok in results if name == "equal"] == [True, True, True]
    finally:
        verifier.close()


def test_a_script_without_a_main_guard_still_verifies(tmp_path):
    """A user's script that scores at its top level, with no `if __name__ == "__main__":`
    guard: the worker must not run the script again (a multiprocessing child would, fail,
    and every equivalent answer would score 0)."""
    script = tmp_path / "score.py"
    script.write_text(
        "from jaxrl_scale.tasks.math import MathTask\n"
        "from jaxrl_scale.models.tokenizer import CharTokenizer\n"
        f"task = MathTask(data={str(FIXTURE)!r}, tokenizer=CharTokenizer('0123456789'), "
        "num_eval=3)\n"
        "print('score', task.score('It is \\\\boxed{0.5}', {'answer': '\\\\frac{1}{2}'}))\n"
        "task.verifier.close()\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["score 1.0"], done.stdout + done.stderr[-2000:]


def test_without_math_verify_scoring_is_an_error_not_zero(tmp_path, monkeypatch):
    (tmp_path / "math_verify.py").write_text("raise ImportError('not installed here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the worker inherits the import path
    task = MathTask(data=str(FIXTURE), tokenizer=TOK, num_eval=3)
    try:
        assert task.score("\\boxed{5}", {"answer": "5"}) == 1.0  # equal text: no worker
        with pytest.raises(VerifierError, match=r"pip install 'jaxrl-scale\[math\]'"):
            task.score("It is \\boxed{0.5}", {"answer": "\\frac{1}{2}"})
    finally:
        task.verifier.close()
