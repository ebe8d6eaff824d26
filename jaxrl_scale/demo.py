"""The CPU demo: the policy model end to end, in well under a minute.

Until the RL loop lands, the demo exercises everything beneath it: it builds the configured policy
sharded over all local devices, fits it by maximum likelihood to short arithmetic lines (a
stand-in for RL, same chunked fp32 log-probs and jitted update), greedily completes a few
prompts, exports a Hugging Face folder, reloads it and checks the logits agree bit for bit.
Writes `<out>/model/` and `<out>/summary.json`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrl_scale import sharding
from jaxrl_scale.compute import train_flops
from jaxrl_scale.config import ExperimentConfig
from jaxrl_scale.hf import load_pretrained, save_pretrained
from jaxrl_scale.model import Policy, token_logprobs
from jaxrl_scale.tokenizer import CharTokenizer

ALPHABET = "0123456789+="
SEQ_LEN = 12  # "23+45=68" plus <eos>, right-padded


def _arithmetic_batch(rng: np.random.Generator, tok: CharTokenizer, n: int):
    tokens = np.full((n, SEQ_LEN), tok.pad_id, np.int32)
    mask = np.zeros((n, SEQ_LEN), np.float32)
    for i in range(n):
        a, b = rng.integers(0, 50, size=2)
        ids = tok.encode(f"{a}+{b}={a + b}") + [tok.eos_ids[0]]
        tokens[i, : len(ids)] = ids
        mask[i, 1 : len(ids)] = 1.0  # every predicted token counts
    return tokens, mask


def _greedy(model: Policy, tok: CharTokenizer, prompts: list[str], n_new: int) -> list[str]:
    """Full-forward greedy decoding (the KV-cache sampler is a later piece)."""
    width = max(len(p) for p in prompts) + n_new
    buf = np.full((len(prompts), width), tok.pad_id, np.int32)
    lengths = np.array([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = tok.encode(p)
    forward = nnx.jit(lambda m, t: m(t).argmax(-1))
    done = np.zeros(len(prompts), bool)
    for _ in range(n_new):
        nxt = np.asarray(forward(model, jnp.asarray(buf)))[np.arange(len(prompts)), lengths - 1]
        for i in np.flatnonzero(~done):
            done[i] = nxt[i] in tok.eos_ids or lengths[i] >= width
            if not done[i]:
                buf[i, lengths[i]] = nxt[i]
                lengths[i] += 1
    return [tok.decode(row[:n]) for row, n in zip(buf, lengths, strict=True)]


def run_demo(cfg: ExperimentConfig, out: Path, steps: int = 150, batch: int = 64) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    tok = CharTokenizer(ALPHABET)
    if cfg.model.vocab_size < tok.vocab_size:
        raise ValueError(f"model.vocab_size must be >= {tok.vocab_size} for the demo alphabet")
    mesh = sharding.make_mesh(cfg.mesh)
    model = sharding.init_sharded(lambda: Policy(cfg.model, rngs=nnx.Rngs(params=cfg.seed)), mesh)
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    print(
        f"policy: {cfg.model.architecture}, {cfg.model.num_layers} layers, mesh {dict(mesh.shape)}"
    )

    @nnx.jit
    def train_step(model, optimizer, tokens, mask):
        def loss_fn(model):
            logp = token_logprobs(model, tokens)
            return -jnp.sum(logp * mask) / jnp.sum(mask)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(cfg.seed)
    place = sharding.batch_sharding(mesh)
    start, losses = time.perf_counter(), []
    for step in range(steps):
        tokens, mask = _arithmetic_batch(rng, tok, batch)
        losses.append(float(train_step(model, optimizer, *jax.device_put((tokens, mask), place))))
        if step % 25 == 0 or step == steps - 1:
            print(f"step {step:4d}  nll/token {losses[-1]:.3f}")
    train_seconds = time.perf_counter() - start

    prompts = ["12+7=", "30+25=", "4+4="]
    completions = _greedy(model, tok, prompts, n_new=4)
    for c in completions:
        print(f"greedy: {c}")

    export = save_pretrained(model, tok, out / "model")
    reloaded, _ = load_pretrained(export)
    probe = jnp.asarray(_arithmetic_batch(rng, tok, 4)[0])
    max_diff = float(jnp.abs(reloaded(probe) - model(probe)).max())
    print(f"exported {export} and reloaded it: max |logit diff| = {max_diff:g}")

    summary = {
        "architecture": cfg.model.architecture,
        "mesh": dict(mesh.shape),
        "steps": steps,
        "nll_first": losses[0],
        "nll_last": losses[-1],
        "train_seconds": train_seconds,
        "train_flops": steps * batch * train_flops(cfg.model, SEQ_LEN),
        "greedy": dict(zip(prompts, completions, strict=True)),
        "export": str(export),
        "reload_max_abs_logit_diff": max_diff,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
