"""Countdown: reach a target from given numbers with + - * / and parentheses.

Prompt "25,3,7=46:" reads "from 25, 3 and 7 make 46"; a completion is an expression such as
"25+3*7". Each given number may be used at most once (not every number has to be used). Every
problem is generated from an expression over all its numbers, so it has a solution, and that
expression is the demonstration for a supervised warm start.

The verifier never evaluates text as code. It accepts only ASCII digits, the four operators,
parentheses and spaces, bounds the length and the nesting depth, parses with Python's `ast`,
walks the tree allowing only integer literals, the four binary operators and an expression
root, computes with exact fractions and rejects any intermediate value beyond a bound. Score
range {0.0, 1.0}: 1.0 exactly when the expression uses only given numbers, each at most once,
and equals the target.
"""

from __future__ import annotations

import ast
import operator
from collections import Counter
from fractions import Fraction

import numpy as np

from jaxrl_scale.models.tokenizer import CharTokenizer, Tokenizer

ALPHABET = "0123456789+-*/(),=: "
MAX_CHARS = 128  # longer completions score 0 without parsing
MAX_DEPTH = 16  # parenthesis nesting
MAX_VALUE = 10**6  # bound on |numerator| and denominator of every intermediate value
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: None}
_ALLOWED = frozenset("0123456789+-*/() ")


class _Reject(Exception):
    """The completion is not a valid countdown expression."""


def _paren_depth(text: str) -> int:
    depth = deepest = 0
    for ch in text:
        if ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
            if depth < 0:
                return -1
    return deepest


def _value(node: ast.AST, used: list[int]) -> Fraction:
    """Exact value of an allowed tree; records the integer literals it uses."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        if node.value > MAX_VALUE:
            raise _Reject("literal too large")
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left, used), _value(node.right, used)
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise _Reject("division by zero")
            result = left / right
        else:
            result = _OPS[type(node.op)](left, right)
        if abs(result.numerator) > MAX_VALUE or result.denominator > MAX_VALUE:
            raise _Reject("intermediate value out of range")
        return result
    raise _Reject(f"{type(node).__name__} is not allowed")


def evaluate(text: str) -> tuple[Fraction, list[int]]:
    """(value, integer literals used) of a countdown expression; ValueError if it is not one."""
    if len(text) > MAX_CHARS:
        raise ValueError(f"longer than {MAX_CHARS} characters")
    if not text.strip() or not set(text) <= _ALLOWED:
        raise ValueError("only digits, + - * /, parentheses and spaces are allowed")
    depth = _paren_depth(text)
    if depth < 0 or depth > MAX_DEPTH:
        raise ValueError(f"unbalanced parentheses or nesting deeper than {MAX_DEPTH}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"not an expression ({type(e).__name__})") from None
    used: list[int] = []
    try:
        value = _value(tree.body, used)
    except (_Reject, RecursionError) as e:
        raise ValueError(str(e) or type(e).__name__) from None
    return value, used


class CountdownTask:
    name = "countdown"

    def __init__(
        self,
        *,
        numbers: int = 3,
        max_number: int = 20,
        max_target: int = 100,
        num_train: int = 512,
        num_eval: int = 64,
        seed: int = 0,
        tokenizer: Tokenizer | None = None,
    ):
        if not 2 <= numbers <= 6:
            raise ValueError(f"numbers must be in [2, 6], got {numbers}")
        if max_number < 2 or max_target < 1:
            raise ValueError("max_number must be >= 2 and max_target >= 1")
        self.tokenizer = tokenizer or CharTokenizer(ALPHABET)
        self.numbers, self.max_number, self.max_target = numbers, max_number, max_target
        rng = np.random.default_rng(seed)
        seen: set[str] = set()
        pool: list[dict] = []
        total = num_train + num_eval
        for _ in range(200 * total):
            if len(pool) == total:
                break
            example = self._draw(rng)
            if example is not None and example["prompt"] not in seen:
                seen.add(example["prompt"])
                pool.append(example)
        else:
            raise ValueError(
                f"cannot draw {num_train} + {num_eval} distinct problems with numbers={numbers}, "
                f"max_number={max_number}, max_target={max_target}"
            )
        order = rng.permutation(total)
        self.eval_examples = [pool[i] for i in order[:num_eval]]
        self.train_examples = [pool[i] for i in order[num_eval:]]

    def _draw(self, rng: np.random.Generator) -> dict | None:
        """Numbers, a random expression over all of them, its value as the target (kept when
        a positive integer up to max_target)."""
        nums = [int(x) for x in rng.integers(1, self.max_number + 1, self.numbers)]
        terms = [str(n) for n in nums]
        order = list(rng.permutation(len(terms)))
        parts = [terms[i] for i in order]
        while len(parts) > 1:  # combine two neighbours under a random operator
            i = int(rng.integers(len(parts) - 1))
            op = "+-*/"[int(rng.integers(4))]
            parts[i : i + 2] = [f"({parts[i]}{op}{parts[i + 1]})"]
        expression = parts[0][1:-1]
        try:
            value, _ = evaluate(expression)
        except ValueError:
            return None
        if value.denominator != 1 or not 1 <= value <= self.max_target:
            return None
        target = int(value)
        prompt = ",".join(terms) + f"={target}:"
        return {"prompt": prompt, "numbers": nums, "target": target, "solution": expression}

    def score(self, completion: str, example: dict) -> float:
        """1.0 if `completion` is an expression over the given numbers (each at most once)
        equal to the target, else 0.0. Never executes the text; bounded time."""
        try:
            value, used = evaluate(completion)
        except ValueError:
            return 0.0
        if Counter(used) - Counter(example["numbers"]):  # a number not given, or used twice
            return 0.0
        return 1.0 if value == example["target"] else 0.0

    def demonstration(self, example: dict, rng: np.random.Generator | None = None) -> str:
        return example["solution"]
