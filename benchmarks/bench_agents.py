"""Agents on the slot engine: does the engine wait for agents, and what do sessions cost
against the multi-turn environment path on the same game?

    python benchmarks/bench_agents.py [--steps 4] [--wait 0.05]

The higher/lower game of docs/agents.md (6 turns of up to 16 tokens, a user turn after each;
a random model never guesses, so every episode plays all 6), played three ways by the tiny
Qwen2 test checkpoint with the published Qwen2.5 template, 8 prompts x 4 episodes a step on
16 slots, pipeline.mode sync:
  agent        an OpenAI-SDK agent through its session URL (rl/agents.py)
  agent+wait   the same agent sleeping `--wait` seconds before each call (a tool, a thought)
  env          the game as an environment (`make_env`, rl/episodes.py on the slot engine)
Prints, per way, the medians over steps 2.. (step 1 compiles): sampled tokens per second of
generation (`gen_tokens / gen_seconds`) and episodes per second; then agent+wait / agent
tokens/s (goal >= 0.80: the engine fills its slots with other sessions' calls while agents
wait) and agent / env episodes/s (what the HTTP sessions cost).
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "I am thinking of a number from 0 to 99. Guess it; answer with the number only."


def _digits(text: str) -> str:
    return "".join(c for c in text or "" if c.isdigit())


class Game:
    """The game for both paths: `agent` (docs/agents.md's) and `make_env`."""

    def __init__(self, wait: float = 0.0, n: int = 400):
        rng = random.Random(0)
        rows = [{"target": rng.randrange(100)} for _ in range(n)]
        self.train_examples, self.eval_examples = rows[8:], rows[:8]
        self.wait = wait

    def agent(self, base_url, api_key, example):
        import openai

        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": PROMPT}]
        for tries in range(1, 7):
            time.sleep(self.wait)
            reply = (
                client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
                .choices[0]
                .message
            )
            messages.append({"role": "assistant", "content": reply.content})
            guess = _digits(reply.content)
            if guess and int(guess) == example["target"]:
                return 1.0 / tries
            hint = "Higher." if guess and int(guess) < example["target"] else "Lower."
            messages.append({"role": "user", "content": hint if guess else "A number, please."})
        return 0.0


class GameEnv:
    def __init__(self, example):
        self.target, self.tries = example["target"], 0

    def reset(self):
        return PROMPT

    def step(self, action):
        self.tries += 1
        guess = _digits(action)
        if guess and int(guess) == self.target:
            return None, 1.0 / self.tries, True
        hint = "Higher." if guess and int(guess) < self.target else "Lower."
        return (hint if guess else "A number, please."), 0.0, False


class EnvGame(Game):
    agent = None

    def make_env(self, example):
        return GameEnv(example)


def _checkpoint(folder: Path) -> Path:
    for f in (ROOT / "tests" / "fixtures" / "hf" / "qwen2").iterdir():
        shutil.copy(f, folder / f.name)
    shutil.copy(ROOT / "tests" / "fixtures" / "chat_templates" / "qwen2.5.jinja",
                folder / "chat_template.jinja")  # fmt: skip
    return folder


def run(way: str, args, checkpoint: Path, out: Path) -> tuple[float, float]:
    from jaxrl_scale.config import load_config
    from jaxrl_scale.train import train

    overrides = [
        f"model.init_from={checkpoint}", f"train.steps={args.steps}", "train.prompts_per_step=8",
        "train.group_size=4", "train.eval_every=0", "warm_start.steps=0", "mesh.data=1",
        "pipeline.mode=sync", "sampler.batching=continuous", "sampler.interruption=null",
        "sampler.slots=16", "task.max_episode_tokens=384", "checkpoint.every=0",
        "forecast.every=0", "task.num_eval=8", "train.eval_samples=1", "task.agent_workers=32",
    ]  # fmt: skip
    if way == "env":
        task = EnvGame()
        overrides += ["task.max_turns=6", "task.turn_tokens=16", "sampler.parked_rows=16",
                      "task.env_workers=4"]  # fmt: skip
    else:
        task = Game(wait=args.wait if way == "agent+wait" else 0.0)
    cfg = load_config(ROOT / "configs" / "tiny_arithmetic.yaml", overrides)
    rows = [r for r in train(cfg, out, task=task) if r["step"] >= 2]
    failed = sum(r.get("agent_errors", 0) + r.get("agent_timeouts", 0) for r in rows)
    if way != "env" and not any(r["gen_tokens"] for r in rows):
        raise SystemExit(
            f"{way}: no agent call was decoded ({failed} agents failed; the warning above says why)"
        )
    tokens = statistics.median(r["gen_tokens"] / r["gen_seconds"] for r in rows)
    episodes = statistics.median(32 / r["gen_seconds"] for r in rows)
    return tokens, episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--wait", type=float, default=0.05)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {args.steps} steps, "
          f"wait {args.wait * 1e3:.0f} ms")  # fmt: skip
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = _checkpoint(Path(tmp))
        for way in ("agent", "agent+wait", "env"):
            tokens, episodes = run(way, args, checkpoint, Path(tmp) / way.replace("+", "_"))
            got[way] = (tokens, episodes)
            print(f"{way:10s}  {tokens:8.0f} sampled tokens/s  {episodes:6.2f} episodes/s",
                  flush=True)  # fmt: skip
    print(
        f"agent+wait / agent tokens/s: {got['agent+wait'][0] / got['agent'][0]:.3f} "
        f"(goal >= 0.80); agent / env episodes/s: {got['agent'][1] / got['env'][1]:.3f}"
    )


if __name__ == "__main__":
    main()
