"""The supervised warm start: maximum likelihood on a task's demonstrations before RL.

params, losses = warm_start(params, graphdef, task, cfg.warm_start, seed=cfg.seed)

At most `warm_start.steps` steps of `warm_start.batch_size` demonstrations, with the optimiser
`warm_start.optim` (step.make_optimizer); it stops early once the mean loss of the last 50
steps is below `warm_start.target_loss` (a target lands every seed at a similar skill, where a
fixed step count lands each at a different point of a steep learning curve).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxrl_scale.rl.config import WarmStartConfig
from jaxrl_scale.rl.step import make_optimizer, sft_step

WINDOW = 50  # steps in the running mean compared with the target loss


def demonstration_batch(task, examples, rng: np.random.Generator):
    """(tokens, attention mask, target mask) [n, T] for prompt + demonstration + EOS rows; the
    target mask covers the demonstration and EOS."""
    tok = task.tokenizer
    prompts = [tok.encode(e["prompt"]) for e in examples]
    seqs = [
        p + tok.encode(task.demonstration(e, rng)) + [tok.eos_ids[0]]
        for p, e in zip(prompts, examples, strict=True)
    ]
    n, width = len(seqs), max(map(len, seqs))
    tokens = np.full((n, width), tok.pad_id, np.int32)
    attention = np.zeros((n, width), bool)
    target = np.zeros((n, width), np.float32)
    for i, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
        tokens[i, : len(s)], attention[i, : len(s)] = s, True
        target[i, len(p) : len(s)] = 1.0
    return tokens, attention, target


def warm_start(params, graphdef, task, cfg: WarmStartConfig, *, seed: int, frozen=None):
    """(params, per-step losses) after the warm start; `params` unchanged when steps = 0.
    `params` are the trainable parameters (a LoRA policy's adapters over `frozen`)."""
    if cfg.steps == 0:
        return params, []
    tx = make_optimizer(cfg.optim, total_steps=cfg.steps)
    step = jax.jit(
        lambda p, o, tokens, attention, target, frozen: sft_step(
            p, o, tokens, attention, target, frozen, graphdef=graphdef, tx=tx
        )
    )
    opt_state = tx.init(params)
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(cfg.steps):
        pick = rng.integers(0, len(task.train_examples), cfg.batch_size)
        batch = demonstration_batch(task, [task.train_examples[i] for i in pick], rng)
        params, opt_state, loss = step(params, opt_state, *batch, frozen)
        if not cfg.target_loss:  # no host read per step: dispatch runs ahead
            losses.append(loss)
            continue
        losses.append(float(loss))
        if len(losses) >= WINDOW and np.mean(losses[-WINDOW:]) < cfg.target_loss:
            break
    return params, [float(x) for x in jax.device_get(losses)]
