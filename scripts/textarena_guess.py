"""A textarena game as a multi-turn task: GuessTheNumber-v0 through the trainer.

    pip install -e '.[textarena]'
    python scripts/textarena_guess.py [--steps 3] [--out runs/guess]

The task is the part to copy (`GuessTheNumber` below: one game per episode, seeded by its
example). Run as a script it trains a tiny random model over printable ASCII for a few steps
on the slot engine, a smoke run of textarena's messages through episodes: with a real
checkpoint set `model.init_from` and drop the tokenizer (the checkpoint's chat template then
renders the game's messages as user turns).
"""

from __future__ import annotations

import argparse
import string
import sys
import tempfile
from pathlib import Path

import textarena

from jaxrl_scale.models.tokenizer import CharTokenizer
from jaxrl_scale.tasks.env import TextArena


class GuessTheNumber:
    name = "guess_the_number"

    def __init__(self, n_train: int = 10_000, n_eval: int = 32):
        rows = [{"seed": i} for i in range(n_train + n_eval)]
        self.eval_examples, self.train_examples = rows[:n_eval], rows[n_eval:]
        self.tokenizer = CharTokenizer(string.printable)  # tiny models only

    def make_env(self, example: dict) -> TextArena:
        return TextArena(textarena.make("GuessTheNumber-v0-raw"), seed=example["seed"])


def task() -> GuessTheNumber:
    return GuessTheNumber()


def main() -> None:
    from jaxrl_scale.config import load_config
    from jaxrl_scale.train import train

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # this module, for task.name
    config = Path(__file__).resolve().parent.parent / "configs" / "tiny_arithmetic.yaml"
    overrides = [
        f"train.steps={args.steps}", "train.eval_every=0", "checkpoint.every=0",
        "model.vocab_size=128", "task.name=textarena_guess:task", "task.num_train=0",
        "task.max_turns=4", "task.max_episode_tokens=1024", "task.turn_tokens=8",
        "sampler.batching=continuous", "sampler.slots=16", "warm_start.steps=0",
        "train.prompts_per_step=4", "train.group_size=4",
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        rows = train(load_config(config, overrides), args.out or tmp)
    for row in rows:
        if "turns_mean" in row:
            keys = ("step", "reward_mean", "turns_mean", "env_errors", "episodes_truncated")
            print("  ".join(f"{k} {row[k]:.3g}" for k in keys if k in row))


if __name__ == "__main__":
    main()
