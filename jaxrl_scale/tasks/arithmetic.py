"""Integer arithmetic with graded difficulty: "37+48=" -> "85".

Operands have 1..max_digits digits (drawn per problem, so short problems are easy and long ones
hard: pass rates differ by prompt). The verifier is an exact match of the completion, stripped
of surrounding whitespace, against the integer answer; score range {0.0, 1.0}. The training pool
and the held-out split are fixed by the seed, are random parts of one set of distinct problems
(so held-out problems follow the training distribution) and never share a problem.
"""

from __future__ import annotations

import numpy as np

from jaxrl_scale.models.tokenizer import CharTokenizer, Tokenizer

ALPHABET = "0123456789+-*= "
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticTask:
    name = "arithmetic"

    def __init__(
        self,
        *,
        max_digits: int = 2,
        ops: str = "+-",
        num_train: int = 512,
        num_eval: int = 64,
        seed: int = 0,
        demo_noise: float = 0.0,
        tokenizer: Tokenizer | None = None,
    ):
        if not ops or set(ops) - set(_APPLY):
            raise ValueError(f"ops must be characters of '+-*', got {ops!r}")
        self.tokenizer = tokenizer or CharTokenizer(ALPHABET)
        self.max_digits, self.ops = max_digits, ops
        self.demo_noise = demo_noise
        rng = np.random.default_rng(seed)
        # One pool of distinct problems, then a random split: held-out problems are an i.i.d.
        # sample of the same distribution as the training ones, never one of them.
        seen: set[str] = set()
        pool: list[dict] = []
        total, attempts = num_train + num_eval, 0
        while len(pool) < total:
            attempts += 1
            if attempts > 100 * total:
                raise ValueError(
                    f"cannot draw {num_train} + {num_eval} distinct problems with "
                    f"max_digits={max_digits}, ops={ops!r}"
                )
            example = self._draw(rng)
            if example["prompt"] not in seen:
                seen.add(example["prompt"])
                pool.append(example)
        order = rng.permutation(total)
        self.eval_examples = [pool[i] for i in order[:num_eval]]
        self.train_examples = [pool[i] for i in order[num_eval:]]

    def _draw(self, rng: np.random.Generator) -> dict:
        digits = int(rng.integers(1, self.max_digits + 1))
        a, b = (int(rng.integers(0, 10**digits)) for _ in range(2))
        op = self.ops[int(rng.integers(len(self.ops)))]
        return {"prompt": f"{a}{op}{b}=", "answer": _APPLY[op](a, b), "digits": digits}

    def score(self, completion: str, example: dict) -> float:
        """1.0 if the completion is exactly the answer (surrounding spaces ignored), else 0.0."""
        text = completion.strip()
        if not text or len(text) > 32:
            return 0.0
        body = text[1:] if text[0] == "-" else text
        if not body.isascii() or not body.isdigit():
            return 0.0
        return 1.0 if int(text) == int(example["answer"]) else 0.0

    def demonstration(self, example: dict, rng: np.random.Generator | None = None) -> str:
        """A completion to imitate in the supervised warm start: the answer, except that with
        probability `demo_noise` (drawn from `rng`) its last digit is one more or one less
        (mod 10): imperfect data whose majority is still right."""
        text = str(example["answer"])
        if rng is None or not self.demo_noise or rng.random() >= self.demo_noise:
            return text
        last = (int(text[-1]) + int(rng.choice([-1, 1]))) % 10
        return text[:-1] + str(last)
