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
from jax.sharding import NamedSharding

from jaxrl_scale.configbase import ConfigError
from jaxrl_scale.parallel import sharding
from jaxrl_scale.rl.config import WarmStartConfig
from jaxrl_scale.rl.step import make_optimizer, sft_step

WINDOW = 50  # steps in the running mean compared with the target loss
WIDTH_ALIGN = 32  # a batch's width is padded to a multiple of this: a few shapes, a few compiles


def demonstration_batch(task, examples, rng: np.random.Generator):
    """(tokens, attention mask, target mask) [n, T] for prompt + demonstration + EOS rows; the
    target mask covers the demonstration and EOS. Rows are right-padded to a multiple of
    WIDTH_ALIGN positions (masked out of attention and the loss, so the loss is that of the
    unpadded rows) so that batches of near widths share one compiled step."""
    tok = task.tokenizer
    prompts = [tok.encode(e["prompt"]) for e in examples]
    seqs = [
        p + tok.encode(task.demonstration(e, rng)) + [tok.eos_ids[0]]
        for p, e in zip(prompts, examples, strict=True)
    ]
    n, width = len(seqs), -(-max(map(len, seqs)) // WIDTH_ALIGN) * WIDTH_ALIGN
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
    if "prompt" not in task.train_examples[0]:  # a multi-turn task's prompt is its env's
        raise ConfigError(
            "warm_start.steps: the task's examples have no 'prompt' to put demonstrations "
            "after (its environments give the prompts); set warm_start.steps=0"
        )
    tx = make_optimizer(cfg.optim, total_steps=cfg.steps)
    opt_state = tx.init(params)
    step, (params, opt_state) = _compile_step(
        graphdef, tx, params, opt_state, frozen, cfg.batch_size
    )
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


def _compile_step(graphdef, tx, params, opt_state, frozen, rows: int):
    """(the jitted sft_step, (params, opt_state) placed for it). On a mesh (parameters created
    there) the layout is explicit: parameters and their moments come out where they went in,
    scalars replicated, so the second step runs the first step's program instead of compiling
    one for its inputs' new placement; the batch's rows split over the batch axes when they
    divide evenly. The optimizer state (made here) is donated, the caller's parameters are
    not. The state is put on its layout before the first step: a committed array is another
    key for jit's cache than the uncommitted scalars optax makes (the step would compile
    twice)."""

    def step(p, o, tokens, attention, target, frozen):
        return sft_step(p, o, tokens, attention, target, frozen, graphdef=graphdef, tx=tx)

    placed = [x.sharding for x in jax.tree.leaves(params)]
    if not placed or not isinstance(placed[0], NamedSharding):
        return jax.jit(step, donate_argnums=1), (params, opt_state)
    mesh = placed[0].mesh
    state = sharding.train_state_shardings((params, opt_state), mesh)
    # Across processes the batch is each process's numpy copy, which jit takes replicated only.
    split = sharding.row_axes(mesh, rows) is not None and jax.process_count() == 1
    row = sharding.batch_sharding(mesh) if split else sharding.replicated(mesh)
    frozen_s = None if frozen is None else sharding.state_shardings(frozen, mesh)

    def on_mesh(p, o, tokens, attention, target, frozen):
        with sharding.traced_on(mesh):
            return step(p, o, tokens, attention, target, frozen)

    compiled = jax.jit(
        on_mesh,
        in_shardings=(*state, row, row, row, frozen_s),
        out_shardings=(*state, sharding.replicated(mesh)),
        donate_argnums=1,
    )
    return compiled, jax.device_put((params, opt_state), state)
