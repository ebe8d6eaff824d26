"""Does RL learn from an environment's feedback over turns? Two games for the tiny model.

    python benchmarks/bench_multiturn.py [--game sums] [--steps 100] [--seeds 0]
        [--batching static] [--lr 3e-4] [--warm-loss L]

The tiny model of configs/tiny_arithmetic.yaml, a supervised warm start, then CISPO on whole
episodes. Held-out evaluation runs the same problems several ways, as domains of one mixture
evaluated with the same policy, and the script prints each one's success rate after the warm
start and at the end.

--game sums: 1-2 digit sums. The prompt is "37+48="; a right answer ends the episode with
reward 1; a wrong one is answered with the direction of the error and the problem again
(" < 37+48=": the sum is smaller than the guess; " ? 37+48=" for an answer that is not a
number) and gets another turn, up to 2. The warm start (to demonstration loss 0.35): answers
whose last digit is wrong a third of the time; a wrong one is followed by the game's answer
and a second answer drawn the same way ("|" in a demonstration is the end of a turn), so the
warm policy knows the form of a second turn but not how to use the direction. Domains:
"multi" (the game as trained) and "single" (one turn: the same policy allowed one turn).

--game reveal: the sums, a wrong answer shown the sum (" ! 85 37+48="), the warm start on
single-turn answers only. Domains: "revealed" (2 turns) and "single".

--game guess: higher/lower guessing. Each episode hides a digit; the prompt is "=", the model
answers a digit, a wrong guess is told which way the digit lies ("<=" / ">="; "?=" for an
answer that is not a digit) and gets another turn, up to 4 (binary search finds any digit in
4). The warm start teaches the answer's form only (a uniformly random digit, 100 steps).
Domains: "feedback" (the game as trained), "blind" (4 turns, every wrong guess answered "?=":
a policy that never repeats a guess finds the digit 40% of the time, one guessing at random
34%) and "single" (one turn: 10% for any policy).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxrl_scale.config import load_config
from jaxrl_scale.models.tokenizer import CharTokenizer
from jaxrl_scale.train import train

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny_arithmetic.yaml"
ALPHABET = "0123456789+-*= <>?!"
GUESSES = 4  # turns of the guessing game


class Retry:
    """One episode: "a+b=", then up to `turns` answers; a wrong one is told which way it is
    off (" > a+b=": the sum is larger; " ? a+b=" for an answer that is not a number), or with
    `reveal` shown the sum (" ! 85 a+b=")."""

    def __init__(self, example: dict, turns: int, reveal: bool = False):
        self.example, self.turns, self.reveal, self.taken = example, turns, reveal, 0

    def reset(self) -> str:
        return self.example["prompt"]

    def step(self, action: str):
        self.taken += 1
        answer = self.example["answer"]
        guess = action.strip()
        if guess == str(answer):
            return None, 1.0, True
        if self.taken >= self.turns:
            return None, 0.0, True
        if self.reveal:
            return f" ! {answer} {self.example['prompt']}", 0.0, False
        way = "?" if not guess.isdigit() else (">" if answer > int(guess) else "<")
        return f" {way} {self.example['prompt']}", 0.0, False


class Transcripts(CharTokenizer):
    """The alphabet, with "|" read as <eos>: where a demonstration's turn ends."""

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, part in enumerate(text.split("|")):
            ids += ([self.eos_ids[0]] if i else []) + super().encode(part)
        return ids


class Sums:
    name = "sums"

    def __init__(self, turns: int, reveal: bool = False, n_eval: int = 256, seed: int = 0):
        rng = np.random.default_rng(seed)
        pairs = [(a, b) for a in range(100) for b in range(100)]
        order = rng.permutation(len(pairs))
        rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a, b in (pairs[i] for i in order)]
        self.eval_examples, self.train_examples = rows[:n_eval], rows[n_eval:]
        self.tokenizer = Transcripts(ALPHABET)
        self.turns, self.reveal = turns, reveal

    def make_env(self, example: dict) -> Retry:
        return Retry(example, self.turns, self.reveal)

    def demonstration(self, example: dict, rng: np.random.Generator | None = None) -> str:
        """An answer unsure of its last digit (wrong a third of the time); in the game of
        several turns with directions, a wrong one is followed by the game's answer and a
        second answer drawn the same way (the form of a second turn, not the use of the
        feedback)."""
        text = self.answer(example, rng)
        if self.turns > 1 and not self.reveal and text != str(example["answer"]):
            feedback = Retry(example, self.turns, self.reveal).step(text)[0]
            text += "|" + feedback + self.answer(example, rng)
        return text

    @staticmethod
    def answer(example: dict, rng: np.random.Generator | None) -> str:
        text = str(example["answer"])
        if rng is not None and rng.random() < 1 / 3:
            text = text[:-1] + str((int(text[-1]) + int(rng.choice([-1, 1]))) % 10)
        return text


class Guess:
    """One game: find `example["digit"]` in up to `turns` guesses; `feedback` False answers
    every wrong guess "?=" (the direction withheld)."""

    def __init__(self, example: dict, turns: int, feedback: bool):
        self.digit, self.turns, self.feedback, self.taken = example["digit"], turns, feedback, 0

    def reset(self) -> str:
        return "="

    def step(self, action: str):
        self.taken += 1
        guess = action.strip()
        if guess == str(self.digit):
            return None, 1.0, True
        if self.taken >= self.turns:
            return None, 0.0, True
        if not self.feedback or len(guess) != 1 or not guess.isdigit():
            return "?=", 0.0, False
        return ("<=" if self.digit < int(guess) else ">="), 0.0, False


class Game:
    name = "guess"

    def __init__(self, turns: int, feedback: bool, n_train: int = 8192, n_eval: int = 200):
        rng = np.random.default_rng(0)
        # ("prompt": the warm start's, the same as `reset`'s)
        self.train_examples = [
            {"prompt": "=", "digit": int(d)} for d in rng.integers(0, 10, n_train)
        ]
        self.eval_examples = [{"prompt": "=", "digit": i % 10} for i in range(n_eval)]
        self.tokenizer = CharTokenizer(ALPHABET)
        self.turns, self.feedback = turns, feedback

    def make_env(self, example: dict) -> Guess:
        return Guess(example, self.turns, self.feedback)

    def demonstration(self, example: dict, rng: np.random.Generator | None = None) -> str:
        return str((rng or np.random.default_rng()).integers(10))  # the form, not the digit


def multi() -> Sums:
    return Sums(turns=2)


def single() -> Sums:
    return Sums(turns=1)


def revealed() -> Sums:
    return Sums(turns=2, reveal=True)


def feedback() -> Game:
    return Game(GUESSES, feedback=True)


def blind() -> Game:
    return Game(GUESSES, feedback=False)


def single_guess() -> Game:
    return Game(1, feedback=True)


GAMES = {  # domains (the first is trained on), and what the game's episodes need
    "sums": (("multi", "single"), ["task.max_turns=2", "task.max_episode_tokens=32",
                                   "warm_start.target_loss=0.35"]),
    "reveal": (("revealed", "single"), ["task.max_turns=2", "task.max_episode_tokens=40",
                                        "warm_start.target_loss=0.6"]),
    "guess": (("feedback", "blind", "single_guess"), [
        f"task.max_turns={GUESSES}", "task.max_episode_tokens=16", "task.turn_tokens=3",
        "warm_start.steps=100", "warm_start.target_loss=0",
    ]),
}  # fmt: skip


def run(
    game: str, seed: int, steps: int, batching: str, lr: float, warm_loss: float | None = None
) -> dict[str, float]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the components' module
    domains, extra = GAMES[game]
    mixture = ", ".join(
        f"{{name: 'bench_multiturn:{d}', weight: {1 if i == 0 else 0.0001}}}"
        for i, d in enumerate(domains)
    )
    overrides = [
        f"seed={seed}", f"train.steps={steps}", "train.eval_every=25", "checkpoint.every=0",
        "task.name=mixture", f"task.mixture=[{mixture}]", "task.num_train=0",
        f"sampler.batching={batching}", "train.prompts_per_step=32",
        f"optim.learning_rate={lr}", *extra,
    ]  # fmt: skip
    if warm_loss is not None:
        overrides.append(f"warm_start.target_loss={warm_loss}")
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        rows = train(load_config(CONFIG, overrides), out)
        seconds = time.perf_counter() - start
    evals = [r for r in rows if "eval_pass_rate" in r]
    out = {"seconds": seconds, "turns_end": evals[-1]["eval_turns_mean"]}
    for d in domains:
        out[d] = (evals[0][f"eval_pass_rate/{d}"], evals[-1][f"eval_pass_rate/{d}"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--game", choices=sorted(GAMES), default="sums")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--batching", choices=["static", "continuous"], default="static")
    parser.add_argument("--lr", type=float, default=3e-4, help="optim.learning_rate")
    parser.add_argument(
        "--warm-loss", type=float, default=None, help="warm_start.target_loss (default: the game's)"
    )
    args = parser.parse_args()
    domains = GAMES[args.game][0]
    print("seed  " + "".join(f"{d + ' start -> end':>24s}" for d in domains) + "   turns  seconds")
    for seed in args.seeds:
        r = run(args.game, seed, args.steps, args.batching, args.lr, args.warm_loss)
        cells = "".join(f"{r[d][0]:>15.3f} -> {r[d][1]:.3f}" for d in domains)
        print(f"{seed:4d}  {cells}   {r['turns_end']:5.2f}  {r['seconds']:7.0f}")


if __name__ == "__main__":
    main()
