"""The built-in arithmetic task: split, answers, verifier, demonstrations."""

import re

import numpy as np
import pytest

from jaxrl_scale.tasks import ArithmeticTask, get_task


def _solve(prompt: str) -> int:
    a, op, b = re.fullmatch(r"(\d+)([+\-*])(\d+)=", prompt).groups()
    return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def test_split_is_fixed_by_the_seed_and_held_out_is_disjoint():
    a = ArithmeticTask(max_digits=2, num_train=300, num_eval=50, seed=3)
    b = ArithmeticTask(max_digits=2, num_train=300, num_eval=50, seed=3)
    c = ArithmeticTask(max_digits=2, num_train=300, num_eval=50, seed=4)
    prompts = lambda t: [e["prompt"] for e in t.train_examples + t.eval_examples]  # noqa: E731
    assert prompts(a) == prompts(b) and prompts(a) != prompts(c)
    train = {e["prompt"] for e in a.train_examples}
    held_out = {e["prompt"] for e in a.eval_examples}
    assert len(train) == 300 and len(held_out) == 50 and not train & held_out


def test_answers_are_right_and_difficulty_is_graded():
    task = ArithmeticTask(max_digits=3, ops="+-*", num_train=500, num_eval=20, seed=0)
    for e in task.train_examples:
        assert e["answer"] == _solve(e["prompt"])
        assert e["prompt"].count("=") == 1
    digits = [e["digits"] for e in task.train_examples]
    assert set(digits) == {1, 2, 3}  # easy and hard problems in one pool
    assert {e["prompt"][-1] for e in task.train_examples} == {"="}


def test_verifier_is_an_exact_integer_match():
    task = ArithmeticTask(num_train=4, num_eval=1)
    ex = {"prompt": "50-95=", "answer": -45}
    assert task.score("-45", ex) == 1.0
    assert task.score("  -45 ", ex) == 1.0
    for wrong in [
        "45",
        "-46",
        "",
        " ",
        "-",
        "-45.0",
        "-4.5e1",
        "-45abc",
        "- 45",
        "--45",
        "-٤٥",
        "-45" + "0" * 40,
        "0x2d",
    ]:
        assert task.score(wrong, ex) == 0.0, wrong


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops="/")
    with pytest.raises(ValueError, match="distinct problems"):
        ArithmeticTask(max_digits=1, ops="+", num_train=200, num_eval=10)  # only 100 exist
    with pytest.raises(ValueError, match="known tasks: arithmetic"):
        get_task("chess")


def test_noisy_demonstrations_are_off_by_one_in_the_last_digit():
    task = ArithmeticTask(num_train=400, num_eval=10, seed=0, demo_noise=0.5)
    rng = np.random.default_rng(0)
    wrong = 0
    for e in task.train_examples:
        demo, answer = task.demonstration(e, rng), str(e["answer"])
        if demo != answer:
            wrong += 1
            assert demo[:-1] == answer[:-1]
            assert (int(demo[-1]) - int(answer[-1])) % 10 in (1, 9)
    assert 160 <= wrong <= 240  # binomial(400, 0.5): mean 200, sd 10
    clean = ArithmeticTask(num_train=400, num_eval=10, seed=0)
    assert all(clean.demonstration(e, rng) == str(e["answer"]) for e in clean.train_examples)


def test_held_out_follows_the_training_distribution():
    # 2,500 distinct sums of 1-2 digit numbers: the 100 one-digit problems run out early in the
    # drawing, so a split by drawing order would put most of them in the first (held-out) part.
    task = ArithmeticTask(max_digits=2, ops="+", num_train=2000, num_eval=500, seed=0)
    short = lambda examples: sum(e["digits"] == 1 for e in examples)  # noqa: E731
    total = short(task.train_examples) + short(task.eval_examples)
    assert 90 <= total <= 100  # nearly all of them are drawn
    # A random split: hypergeometric, mean 100 * 500 / 2500 = 20, sd about 3.6.
    assert 8 <= short(task.eval_examples) <= 32


def test_get_task_builds_every_registered_task_by_name(tmp_path):
    """The public `get_task` knows every name the config does (code and reasoning_gym
    included; before, three), and each built task scores as its own verifier does."""
    import json

    from jaxrl_scale.models.tokenizer import CharTokenizer
    from jaxrl_scale.tasks import TASKS
    from jaxrl_scale.tasks.config import BUILTIN

    assert set(TASKS) == set(BUILTIN)
    data = tmp_path / "sums.jsonl"
    rows = [
        {"prompt": f"{a}+{a}", "tests": [{"input": "", "output": str(2 * a)}]} for a in range(6)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = CharTokenizer("0123456789+-*= ()`\npythonri")
    code = get_task("code", data=str(data), tokenizer=tok, num_eval=2, workers=1)
    assert code.name == "code" and len(code.train_examples) == 4
    e = code.train_examples[0]
    a = e["question"].split("+")[0]
    assert code.score(f"```python\nprint({a}*2)\n```", e) == 1.0
    assert code.score(f"```python\nprint({a}*2+1)\n```", e) == 0.0
    gym = get_task("reasoning_gym", datasets={"leg_counting": 1}, num_train=6, num_eval=2, seed=1)
    assert gym.name == "reasoning_gym" and len(gym.eval_examples) == 2
    e = gym.train_examples[0]
    assert e["question"] and e["metadata"] == e["entry"]["metadata"]
    assert gym.score(f"<think>hm</think> <answer>{e['answer']}</answer>", e) == 1.0
    assert gym.score(f"<think><answer>no idea</answer></think> {e['answer']} ", e) == 1.0
    mixed = get_task(
        "mixture",
        mixture=[{"name": "arithmetic", "args": {"max_digits": 1}, "weight": 1},
                 {"name": "countdown", "weight": 1, "domain": "cd"}],
        num_train=20, num_eval=4, seed=0,
    )  # fmt: skip
    assert {e["domain"] for e in mixed.train_examples} == {"arithmetic", "cd"}
    e = next(e for e in mixed.eval_examples if e["domain"] == "arithmetic")
    assert mixed.score(str(e["answer"]), e) == 1.0


def test_get_task_names_the_tokenizer_a_task_needs():
    with pytest.raises(ValueError, match=r"get_task\('code'\).*pass tokenizer="):
        get_task("code", data="problems.jsonl")
