"""Does RL learn from feedback over turns? Integer sums where a wrong answer is told so.

    python benchmarks/bench_multiturn.py [--steps 100] [--seeds 0] [--batching static]

The tiny arithmetic model (configs/tiny_arithmetic.yaml) on 1-2 digit sums as a multi-turn
task: the prompt is "37+48=", a right answer ends the episode with reward 1, a wrong one is
answered with the direction of the error and the problem again (" < 37+48=": the sum is
smaller than the guess) and gets another turn, up to 2. A supervised warm start on
single-turn demonstrations whose last digit is wrong a third of the time, then CISPO on whole
episodes. Held-out evaluation runs the same problems twice, as two domains of one mixture:
"multi" (the retry allowed) and "single" (one turn: the same policy allowed one turn). Prints,
per seed, both success rates after the warm start and at the end, and the second turn's
success rate (episodes that took one).
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
ALPHABET = "0123456789+-*= <>"


class Retry:
    """One episode: "a+b=", then up to `turns` answers; a wrong one is told which way it is
    off (" > a+b=": the sum is larger; " ? a+b=" for an answer that is not a number)."""

    def __init__(self, example: dict, turns: int):
        self.example, self.turns, self.taken = example, turns, 0

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
        way = "?" if not guess.isdigit() else (">" if answer > int(guess) else "<")
        return f" {way} {self.example['prompt']}", 0.0, False


class Sums:
    name = "sums"

    def __init__(self, turns: int, n_eval: int = 256, seed: int = 0):
        rng = np.random.default_rng(seed)
        pairs = [(a, b) for a in range(100) for b in range(100)]
        order = rng.permutation(len(pairs))
        rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a, b in (pairs[i] for i in order)]
        self.eval_examples, self.train_examples = rows[:n_eval], rows[n_eval:]
        self.tokenizer = CharTokenizer(ALPHABET)
        self.turns = turns

    def make_env(self, example: dict) -> Retry:
        return Retry(example, self.turns)

    def demonstration(self, example: dict, rng: np.random.Generator | None = None) -> str:
        text = str(example["answer"])
        if rng is not None and rng.random() < 1 / 3:  # unsure of its last digit
            text = text[:-1] + str((int(text[-1]) + int(rng.choice([-1, 1]))) % 10)
        return text


def multi() -> Sums:
    return Sums(turns=2)


def single() -> Sums:
    return Sums(turns=1)


def run(seed: int, steps: int, batching: str) -> dict[str, float]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the components' module
    overrides = [
        f"seed={seed}", f"train.steps={steps}", "train.eval_every=25", "checkpoint.every=0",
        "task.name=mixture", "task.mixture=[{name: 'bench_multiturn:multi', weight: 1}, "
        "{name: 'bench_multiturn:single', weight: 0.0001}]", "task.num_train=0",
        "task.max_turns=2", "task.max_episode_tokens=32", f"sampler.batching={batching}",
        "train.prompts_per_step=32", "warm_start.target_loss=0.6",
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        rows = train(load_config(CONFIG, overrides), out)
        seconds = time.perf_counter() - start
    evals = [r for r in rows if "eval_pass_rate" in r]
    first, last = evals[0], evals[-1]
    return {
        "multi_start": first["eval_pass_rate/multi"],
        "single_start": first["eval_pass_rate/single"],
        "multi_end": last["eval_pass_rate/multi"],
        "single_end": last["eval_pass_rate/single"],
        "turns_end": last["eval_turns_mean"],
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--batching", choices=["static", "continuous"], default="static")
    args = parser.parse_args()
    print("seed  multi start -> end   single start -> end   2nd turn end  turns  seconds")
    for seed in args.seeds:
        r = run(seed, args.steps, args.batching)
        # the second turn's success: what multi adds over single, per episode that took one
        second = (r["multi_end"] - r["single_end"]) / max(r["turns_end"] - 1, 1e-9)
        print(
            f"{seed:4d}  {r['multi_start']:.3f} -> {r['multi_end']:.3f}"
            f"        {r['single_start']:.3f} -> {r['single_end']:.3f}"
            f"        ~{second:.2f}     {r['turns_end']:.2f}  {r['seconds']:.0f}"
        )


if __name__ == "__main__":
    main()
