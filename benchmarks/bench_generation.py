"""Static batches vs continuous batching (the slot engine) on heavy-tailed completion lengths.

    python benchmarks/bench_generation.py [--prompts 128] [--group 4] [--slots 64] [--new 256]

Same random-init policy, prompts, slots and budget for both paths; sampling at temperature 1.
Two length mixes:

- geometric: the policy's own EOS (a set of token ids sized for a mean of about --mean tokens
  under the near-uniform next-token distribution of a random policy);
- lognormal: every row gets a budget drawn from a lognormal (median --mean / e^0.5, sigma 1,
  clipped to [1, --new]) and no EOS, so each row's length is exactly its draw.

static decodes the rows in waves of --slots rows (--slots / --group prompts), each wave until
its longest row ends; continuous keeps --slots rows in flight, refilling a slot's group as soon
as a whole group's slots are free, reading the done flags every --admit-every steps. Prints
generated tokens/s, slot utilisation (tokens / (decode steps x slots)) and continuous / static
for each of --repeats interleaved pairs, then their median.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_scale.config import ModelConfig
from jaxrl_scale.generation.engine import SlotEngine
from jaxrl_scale.generation.sampler import Sampling, decode, prefill
from jaxrl_scale.models.policy import init_policy

CFG = ModelConfig(vocab_size=2048, hidden_size=128, intermediate_size=384, num_layers=2,
                  num_heads=4, num_kv_heads=2)  # fmt: skip
PROMPT_LEN = 16


def _workload(args, mix: str):
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, CFG.vocab_size, (args.prompts, PROMPT_LEN)).astype(np.int32)
    if mix == "geometric":
        eos = tuple(range(1, 1 + max(1, round(CFG.vocab_size / args.mean))))
        budgets = np.full(args.prompts * args.group, args.new)
    else:
        eos = ()
        draws = rng.lognormal(np.log(args.mean) - 0.5, 1.0, args.prompts * args.group)
        budgets = np.clip(np.round(draws), 1, args.new).astype(int)
    return prompts, eos, budgets


def run_static(graphdef, params, args, prompts, eos, budgets):
    per_wave = args.slots // args.group
    static = dict(sampling=Sampling(1.0), eos_ids=eos, pad_id=0, interruption=None,
                  prompt_len=PROMPT_LEN)  # fmt: skip
    tokens, steps = 0, 0
    for w in range(0, len(prompts), per_wave):
        chunk = jnp.asarray(prompts[w : w + per_wave])
        state = prefill(graphdef, params, chunk, jnp.ones(chunk.shape, bool),
                        jax.random.key(w), n_new=args.new, interruption=None, mesh=None,
                        repeat=args.group)  # fmt: skip
        rows = budgets[w * args.group : (w + len(chunk)) * args.group]
        state = dataclasses.replace(state, budget=jnp.asarray(rows, jnp.int32))
        state = decode(graphdef, params, state, 0, args.new, **static)
        tokens += int(jnp.sum(state.counts))
        steps += int(state.step)
    return tokens, steps * args.slots


def run_continuous(graphdef, params, args, prompts, eos, budgets):
    engine = SlotEngine(graphdef, slots=args.slots, prompt_len=PROMPT_LEN, n_new=args.new,
                        repeat=args.group, sampling=Sampling(1.0), eos_ids=eos, pad_id=0,
                        model_cfg=CFG, key=jax.random.key(0))  # fmt: skip
    for i, p in enumerate(prompts):
        # One budget per prompt (the engine's unit); the lognormal mix draws per prompt here.
        engine.submit(i, p, max_new=int(budgets[i * args.group]))
    tokens = 0
    while engine.busy or engine.pending:
        tokens += sum(f.length for f in engine.run(params, 0, args.admit_every))
    return tokens, int(engine.state.step) * args.slots


def timed(fn, *a):
    start = time.perf_counter()
    tokens, slot_steps = fn(*a)
    return tokens, slot_steps, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--new", type=int, default=256, help="completion budget")
    parser.add_argument("--mean", type=float, default=32.0, help="mean completion length")
    parser.add_argument("--admit-every", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="static/continuous pairs timed")
    args = parser.parse_args()
    model = init_policy(CFG, seed=0)
    graphdef, params = nnx.split(model)
    rows = args.prompts * args.group
    print(f"{rows} rows ({args.prompts} prompts x {args.group}), {args.slots} slots, budget "
          f"{args.new}, mean length target {args.mean:g}; jax {jax.__version__} on "
          f"{jax.devices()[0].platform}")  # fmt: skip
    print(f"{'mix':<11}{'path':<12}{'tokens':>8}{'mean len':>10}{'tokens/s':>11}"
          f"{'slot util':>11}")  # fmt: skip
    for mix in ("geometric", "lognormal"):
        prompts, eos, budgets = _workload(args, mix)
        if mix == "lognormal":  # the engine takes one budget per prompt: use those for both
            budgets = np.repeat(budgets[:: args.group], args.group)
        for fn in (run_static, run_continuous):  # compile every shape the runs meet
            fn(graphdef, params, args, prompts, eos, budgets)
        ratios = []
        for _ in range(args.repeats):  # interleaved: the machine's drift hits both paths
            rates = {}
            for name, fn in (("static", run_static), ("continuous", run_continuous)):
                tokens, slot_steps, secs = timed(fn, graphdef, params, args, prompts, eos,
                                                 budgets)  # fmt: skip
                rates[name] = tokens / secs
                print(f"{mix:<11}{name:<12}{tokens:>8}{tokens / rows:>10.1f}"
                      f"{tokens / secs:>11,.0f}{tokens / slot_steps:>11.1%}")  # fmt: skip
            ratios.append(rates["continuous"] / rates["static"])
        each = " / ".join(f"{r:.2f}x" for r in ratios)
        print(f"{mix:<11}continuous / static: {np.median(ratios):.2f}x (median of {each})")


if __name__ == "__main__":
    main()
