"""Countdown: generated problems are solvable; the verifier parses, never executes."""

import time

import pytest

from jaxrl_scale.tasks.countdown import CountdownTask, evaluate

EXAMPLE = {"prompt": "25,3,7=46:", "numbers": [25, 3, 7], "target": 46}


@pytest.fixture(scope="module")
def task():
    return CountdownTask(numbers=3, num_train=300, num_eval=40, seed=0)


def test_every_problem_is_solved_by_its_demonstration_and_splits_are_disjoint(task):
    assert len(task.train_examples) == 300 and len(task.eval_examples) == 40
    prompts = {e["prompt"] for e in task.train_examples}
    assert not prompts & {e["prompt"] for e in task.eval_examples}
    for e in task.train_examples + task.eval_examples:
        assert 1 <= e["target"] <= 100 and len(e["numbers"]) == 3
        assert task.score(task.demonstration(e), e) == 1.0
        assert e["prompt"] == ",".join(map(str, e["numbers"])) + f"={e['target']}:"
        # the prompt and demonstration fit the character tokenizer
        assert task.tokenizer.decode(task.tokenizer.encode(e["prompt"])) == e["prompt"]


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("25+3*7", 1.0),
        (" (25 + 3*7) ", 1.0),
        ("3*7+25", 1.0),
        ("25*3-7", 0.0),  # wrong value
        ("25+21", 0.0),  # 21 is not given
        ("25+3*7+3-3", 0.0),  # 3 used three times
        ("7*7-3", 0.0),  # 7 is given once, used twice
        ("(25+7)/2+3*5", 0.0),
        ("", 0.0),
        ("46", 0.0),
        ("25+3*7=46", 0.0),  # '=' is not part of an expression
        ("-(-25-3*7)", 0.0),  # unary minus is not an operator of the game
    ],
)
def test_scores(completion, score):
    assert CountdownTask.score(None, completion, EXAMPLE) == score


def test_exact_fractions():
    example = {"numbers": [1, 3, 6], "target": 2}
    assert CountdownTask.score(None, "(1/3)*6", example) == 1.0  # floats would give 2.0000000004
    assert evaluate("7/2") == (pytest.approx(3.5), [7, 2])


ATTACKS = [
    "__import__('os').system('touch /tmp/countdown_pwned')",
    "().__class__.__bases__[0].__subclasses__()",
    "(lambda: 25)()",
    "[x for x in (25, 3, 7)]",
    "open('/etc/passwd').read()",
    "25 .__add__(21)",
    "9**9**9",
    "25**3",
    "10**100000",
    "1" * 100_000,
    "(" * 5000 + "25" + ")" * 5000,
    "(" * 17 + "25" + ")" * 17,
    "２５+3*7",  # full-width digits
    "٢٥+3*7",  # Arabic-Indic digits
    "25+3*7\x00",
    "25 if True else 3",
    "25+3*7;0",
    "0x19+3*7",
    "2_5+3*7",
    "25.0+3*7",
    "(((((((((1+1)*(1+1))*((1+1)*(1+1)))*(((1+1)*(1+1))*((1+1)*(1+1))))",
    "999999*999999",
]


@pytest.mark.parametrize("attack", ATTACKS)
def test_attacks_score_zero_quickly_and_run_nothing(attack, tmp_path):
    start = time.perf_counter()
    assert CountdownTask.score(None, attack, EXAMPLE) == 0.0
    assert time.perf_counter() - start < 1.0  # bounded: no evaluation, no huge numbers
    import os

    assert not os.path.exists("/tmp/countdown_pwned")


def test_bad_settings():
    with pytest.raises(ValueError, match="numbers"):
        CountdownTask(numbers=1)
    with pytest.raises(ValueError, match="cannot draw"):
        CountdownTask(numbers=2, max_number=2, max_target=2, num_train=50, num_eval=5)
