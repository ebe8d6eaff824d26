"""Does an agent learn through its session URL? A calculator agent vs the same policy without it.

    python benchmarks/bench_agent_learning.py [--steps 30] [--seeds 0 1]

The task: products a*b (a in 2..9, b in 10..99) for a char-level policy trained from scratch
(`configs/tiny_arithmetic.yaml`'s model, no warm start), written as an agent task: the agent
asks the policy through the OpenAI SDK at its session URL (`train(cfg, out, task=...)`,
rl/agents.py) and returns its reward.

- tool: the agent offers a calculator; a reply that starts with "?" calls it, and the
  calculator's result is the agent's answer; any other reply is the policy's own answer.
- plain: the same agent without the calculator; the reply is the answer.

Both start from the same initial policy (same seed) and train with the same settings; the
reward is 1 for the right product. Prints the held-out reward (`eval_pass_rate`, mean over 2
episodes of each held-out problem) at every evaluation for both, then each run's gain and the
difference at the end. What it shows: rewards computed by an agent's own code from replies it
got over HTTP train the policy (the calculator call is learned); a tiny policy cannot multiply,
so without the tool the reward stays near 0.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
import openai

from jaxrl_scale.config import load_config
from jaxrl_scale.models.chat import ChatTemplate
from jaxrl_scale.models.tokenizer import CharTokenizer
from jaxrl_scale.train import train

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny_arithmetic.yaml"
ALPHABET = "0123456789*=?"
# A user turn is its text and "="; an assistant turn its text and the end token.
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}="
    "{% else %}{{ m['content'] }}<eos>{% endif %}{% endfor %}"
)


class Products:
    """`a*b` for the policy; the agent's reward is 1 for the product."""

    def __init__(self, tool: bool):
        self.tool = tool
        rows = [{"a": a, "b": b} for a in range(2, 10) for b in range(10, 100)]
        order = np.random.default_rng(0).permutation(len(rows))
        self.train_examples = [rows[i] for i in order[:-64]]
        self.eval_examples = [rows[i] for i in order[-64:]]
        self.tokenizer = CharTokenizer(ALPHABET)
        self.tokenizer.chat_template = ChatTemplate(TEMPLATE, special_tokens={"eos_token": "<eos>"})

    def agent(self, base_url, api_key, example):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        question = f"{example['a']}*{example['b']}"
        reply = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": question}], max_tokens=4
        )
        text = reply.choices[0].message.content or ""
        product = str(example["a"] * example["b"])
        called = self.tool and text.startswith("?")  # the calculator, on the agent's side
        return float((product if called else text.strip()) == product)


def run(tool: bool, seed: int, steps: int) -> list[tuple[int, float]]:
    overrides = [
        f"seed={seed}", f"train.steps={steps}", "train.eval_every=5", "train.eval_samples=2",
        "train.prompts_per_step=16", "train.group_size=8", "warm_start.steps=0",
        "task.max_episode_tokens=16", "task.agent_timeout=60", "task.agent_workers=64",
        "sampler.batching=continuous", "sampler.interruption=null", "sampler.slots=64",
        "pipeline.mode=sync", "checkpoint.every=0", "forecast.every=0",
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as out:
        rows = train(load_config(CONFIG, overrides), out, task=Products(tool))
    return [(r["step"], r["eval_pass_rate"]) for r in rows if "eval_pass_rate" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    print(f"# {date.today()}, {platform.processor() or platform.machine()}, "
          f"{args.steps} steps of 16 prompts x 8 episodes")  # fmt: skip
    for seed in args.seeds:
        curves = {}
        for tool in (True, False):
            start = time.perf_counter()
            curves[tool] = run(tool, seed, args.steps)
            name = "tool" if tool else "plain"
            evals = "  ".join(f"{s}:{v:.3f}" for s, v in curves[tool])
            print(f"seed {seed} {name:5s} held-out reward by step  {evals}  "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
        gains = {t: c[-1][1] - c[0][1] for t, c in curves.items()}
        print(
            f"seed {seed}: gain tool {gains[True]:+.3f}, plain {gains[False]:+.3f}; "
            f"tool - plain at the end {curves[True][-1][1] - curves[False][-1][1]:+.3f}"
        )


if __name__ == "__main__":
    main()
