"""Packed against padded train steps on heavy-tailed completion lengths.

    python benchmarks/bench_packing.py [--budget 512] [--steps 3] [--row-len 0]
    python benchmarks/bench_packing.py --recipe configs/scalerl_qwen3-8b_math.yaml [--seeds 3]
    python benchmarks/bench_packing.py --recipe asset:demo.yaml --set train.prompts_per_step=32 \
        --set sampler.max_new_tokens=192 --set mesh.data=1 --mean 3 --no-plan --time 3

One RL train step (CISPO, prompt aggregation, AdamW) on a batch of P prompts x G completions
with a completion budget N: the padded step computes [B, N] completion slots (each prompt
once for its group), the packed step (packing.py) the real tokens in rows of `--row-len`
positions (0: a run's default, packing.default_row_len). Two length distributions, both with
a mean near a quarter of the budget: lognormal (sigma 1, the heavy tail RL completions have;
lengths past the budget are cut at it, as a sampler stops there) and geometric. Prints, per
distribution:
  - padding efficiency: real tokens / positions computed, padded and packed;
  - step time (compile excluded, median of `--steps` after one warm-up), padded / packed;
  - temporary memory of the compiled steps (`.compile().memory_analysis()`), padded / packed;
  - the host-side packing time per batch.
The model is a small decoder (hidden 256, 4 layers, vocabulary 8,192) so a CPU step takes
seconds; the ratio is what the padding costs at any size whose step time is linear in
positions (attention adds a term quadratic in the row length, equal per row in both).

`--recipe CONFIG` (with `--set KEY=VALUE` overrides): the config's own shape (its model,
batch, budget, trainer mesh on fake CPU devices), lognormal lengths with a mean of a quarter of
the budget (`--mean N`: of N tokens): positions computed and micro-steps, padded against
packed (the run's `PackGeometry`; the rows rounded to the padded micro-steps as packing did
before the token budget; and rounded to whole micro-steps of the budget, as packing did
before `packing.step_rows`), the real tokens / positions of each, the cost `train.packing:
auto` compares, and the planner's train step per device, padded and packed (abstract shapes:
compiles, allocates nothing; minutes on a CPU). `--time N`: the config's model, one device,
N timed train steps of each layout (median, compile excluded): for models small enough to run
here (the demo's).
"""

from __future__ import annotations

import os

# --recipe plans the recipe's trainer mesh on fake CPU devices (before jax is imported).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=24")

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_scale.config import LossConfig, ModelConfig, OptimConfig
from jaxrl_scale.models.policy import Policy
from jaxrl_scale.rl.packing import default_row_len, micro_steps, pack
from jaxrl_scale.rl.step import Batch, compile_train_step, init_train_state, make_optimizer

CFG = ModelConfig(
    architecture="qwen3",
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=768,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
)
PROMPTS, GROUP, PROMPT_LEN = 4, 8, 64


def lengths(kind: str, budget: int, rows: int, rng, mean: float | None = None) -> np.ndarray:
    """Completion lengths with a mean near `mean` (budget / 4), cut at the budget."""
    if kind == "lognormal":
        sigma = 1.0
        median = (mean or budget / 4) / np.exp(sigma**2 / 2)
        n = rng.lognormal(np.log(median), sigma, rows)
    else:
        n = rng.geometric(4 / budget, rows)
    return np.clip(np.round(n), 1, budget).astype(int)


def make_batch(kind: str, budget: int, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    b = PROMPTS * GROUP
    prompt_len = rng.integers(PROMPT_LEN // 2, PROMPT_LEN + 1, PROMPTS)
    prompt_mask = np.zeros((b, PROMPT_LEN), bool)
    for g, n in enumerate(prompt_len):
        prompt_mask[g * GROUP : (g + 1) * GROUP, PROMPT_LEN - n :] = True
    vocab = CFG.vocab_size
    prompts = np.repeat(rng.integers(1, vocab, (PROMPTS, PROMPT_LEN)), GROUP, 0)
    n_b = lengths(kind, budget, b, rng)
    mask = np.arange(budget)[None, :] < n_b[:, None]
    return Batch(
        prompt_tokens=np.where(prompt_mask, prompts, 0).astype(np.int32),
        prompt_mask=prompt_mask,
        tokens=np.where(mask, rng.integers(1, vocab, (b, budget)), 0).astype(np.int32),
        mask=mask,
        loss_mask=mask.astype(np.float32),
        behavior_logp=np.where(mask, -rng.uniform(0.5, 3.0, (b, budget)), 0).astype(np.float32),
        adv=rng.normal(size=b).astype(np.float32),
    )


def _step_and_state(model=None, group=GROUP, **micro):
    graphdef, params = nnx.split(Policy(model or CFG, rngs=nnx.Rngs(params=0)))
    tx = make_optimizer(OptimConfig(learning_rate=1e-6), total_steps=100)
    loss = LossConfig(kind="cispo", aggregation="prompt")
    step = compile_train_step(graphdef, tx, group_size=group, loss_cfg=loss, temperature=1.0,
                              **micro)  # fmt: skip
    return step, init_train_state(params, tx)


def measure(step, state, batch, steps: int) -> tuple[float, int, object]:
    """(median seconds per step, temporary bytes of the compiled step, the state after)."""
    batch = jax.tree.map(jnp.asarray, batch)
    temp = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    state, metrics = step(state, batch)  # warm-up (compile)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return float(np.median(times)), int(temp), state


def recipe(path: str, seeds: int, plan: bool, overrides=(), mean=None, time_steps=0) -> None:
    from jaxrl_scale.config import load_config
    from jaxrl_scale.memory.abstract import experts_program, task_prompt_len
    from jaxrl_scale.memory.train_step import train_step_memory
    from jaxrl_scale.parallel import sharding
    from jaxrl_scale.rl.packing import FUSED_ATTENTION_SPEEDUP, PackGeometry, bucket_rows

    cfg = load_config(path, list(overrides))
    mesh, _ = sharding.make_meshes(cfg)
    ways, (prompt_len, _) = sharding.batch_ways(mesh), task_prompt_len(cfg)
    t, n = cfg.train, cfg.sampler.max_new_tokens
    p, g = t.prompts_per_step, t.group_size
    geometry = PackGeometry.of(cfg, prompt_len, ways)
    print(f"{path}: {p} x {g} completions of up to {n:,} tokens behind {prompt_len:,} prompt "
          f"slots, {ways} batch shards, train.micro_batches {t.micro_batches}; packed rows of "
          f"{geometry.row_len:,}, {geometry.rows_per_micro} a micro-step")  # fmt: skip
    padded = p * prompt_len + p * g * n
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        n_b = lengths("lognormal", n, p * g, rng, mean)
        mask = np.arange(n)[None, :] < n_b[:, None]
        prompt_mask = np.ones((p * g, prompt_len), bool)
        ones = np.ones(mask.shape, np.float32)
        batch = Batch(prompt_mask.astype(np.int32), prompt_mask, mask.astype(np.int32), mask,
                      mask * ones, -ones, np.ones(p * g, np.float32))  # fmt: skip
        packed, stats = pack(batch, g, geometry.row_len, row_multiple=geometry.row_multiple,
                             rows_per_micro=geometry.rows_per_micro)  # fmt: skip
        before = bucket_rows(stats.rows, ways * t.micro_batches) * geometry.row_len
        whole = bucket_rows(stats.rows, geometry.rows_per_micro) * geometry.row_len
        fused = dataclasses.replace(geometry, padded_speedup=FUSED_ATTENTION_SPEEDUP)
        cost = {}
        for name, geo in (("here", geometry), ("fused", fused)):
            packed_cost, padded_cost = geo.costs(batch, g, padded, stats.train_positions)
            cost[name] = packed_cost / padded_cost
        real = int(n_b.sum()) + p * prompt_len
        print(f"  seed {seed}: lengths mean {n_b.mean():,.1f} (median {np.median(n_b):,.0f}); "
              f"positions padded {padded:,} in {t.micro_batches} micro-steps (tokens / "
              f"positions {real / padded:.3f}), packed {stats.train_positions:,} in "
              f"{micro_steps(stats.bucket, geometry.rows_per_micro)} (tokens / positions "
              f"{stats.train_tokens / stats.train_positions:.3f}; "
              f"{stats.train_positions / padded:.3f} of padded; rounded to the padded "
              f"micro-steps {before:,}, to whole micro-steps of the budget {whole:,}); auto's "
              f"cost packed / padded {cost['here']:.2f} here ({geometry.padded_speedup:g}x), "
              f"{cost['fused']:.2f} beside a fused kernel "
              f"({FUSED_ATTENTION_SPEEDUP:g}x)")  # fmt: skip
        if time_steps and seed == 0:
            _time_layouts(cfg, batch, packed, geometry, time_steps)
    if not plan:
        return
    planned, _ = experts_program(cfg)  # the buffers an accelerator's grouped matmul holds
    for packing in ("false", "true"):
        one = load_config(path, [f"train.packing={packing}", f"model.moe_matmul={planned}"])
        start = time.perf_counter()
        part = train_step_memory(one, mesh, prompt_len)
        print(f"  planned train step, packing {packing}: {part['per_device_bytes'] / 2**30:.2f} "
              f"GiB per device (temporaries {part['temporaries_bytes'] / 2**30:.2f}), "
              f"{part['rows_per_micro_batch']} rows a micro-step, "
              f"{part['positions_per_micro_batch_per_shard']:,} positions per shard "
              f"({time.perf_counter() - start:.0f} s to compile)")  # fmt: skip


def _time_layouts(cfg, batch: Batch, packed, geometry, steps: int) -> None:
    """Step time of the config's model on one device, padded against packed."""
    t = cfg.train
    padded_step, state = _step_and_state(cfg.model, t.group_size, micro_batches=t.micro_batches)
    packed_step, _ = _step_and_state(cfg.model, t.group_size,
                                     rows_per_micro=geometry.rows_per_micro)  # fmt: skip
    t_pad, m_pad, state = measure(padded_step, state, batch, steps)
    t_pack, m_pack, state = measure(packed_step, state, packed, steps)
    print(f"  step time on {jax.devices()[0].device_kind}: padded {t_pad:.3f} s, packed "
          f"{t_pack:.3f} s -> {t_pad / t_pack:.2f}x faster packed; temporaries "
          f"{m_pad / 2**20:.0f} / {m_pack / 2**20:.0f} MiB")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=512, help="completion budget N")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--row-len", type=int, default=0, help="packed row length (0: a run's default)"
    )
    parser.add_argument("--kinds", nargs="+", default=["lognormal", "geometric"])
    parser.add_argument("--block", type=int, default=512, help="model.attention_block_size")
    parser.add_argument("--recipe", help="a recipe config: its shape instead of the small model")
    parser.add_argument("--seeds", type=int, default=3, help="--recipe: batches drawn")
    parser.add_argument("--no-plan", action="store_true", help="--recipe: skip the planner")
    parser.add_argument("--set", action="append", default=[], dest="overrides",
                        help="--recipe: a config override KEY=VALUE (repeatable)")  # fmt: skip
    parser.add_argument("--mean", type=float, help="--recipe: mean completion length")
    parser.add_argument("--time", type=int, default=0,
                        help="--recipe: time N steps of the config's model")  # fmt: skip
    args = parser.parse_args()
    if args.recipe:
        return recipe(args.recipe, args.seeds, not args.no_plan, args.overrides, args.mean,
                      args.time)  # fmt: skip
    global CFG
    CFG = dataclasses.replace(CFG, attention_block_size=args.block)
    row_len = args.row_len or default_row_len(PROMPT_LEN + args.budget, args.block)
    print(
        f"model: hidden {CFG.hidden_size}, {CFG.num_layers} layers, vocabulary {CFG.vocab_size}; "
        f"{PROMPTS} prompts x {GROUP} completions, prompt slots {PROMPT_LEN}, budget "
        f"{args.budget}, packed rows of {row_len}, attention blocks of {args.block}; "
        f"{jax.devices()[0].device_kind}"
    )
    step, state = _step_and_state()
    for kind in args.kinds:
        batch = make_batch(kind, args.budget)
        start = time.perf_counter()
        packed, stats = pack(batch, GROUP, row_len)
        pack_s = time.perf_counter() - start
        n_b = batch.mask.sum(1)
        padded_positions = PROMPTS * PROMPT_LEN + batch.tokens.size
        real = int(n_b.sum()) + int(batch.prompt_mask[::GROUP].sum())
        t_pad, m_pad, state = measure(step, state, batch, args.steps)
        t_pack, m_pack, state = measure(step, state, packed, args.steps)
        print(
            f"\n{kind}: completion lengths mean {n_b.mean():.0f} / {args.budget} "
            f"(median {np.median(n_b):.0f}, max {n_b.max()}); {stats.rows} packed rows "
            f"({stats.bucket} computed), {stats.prompt_repeats} prompt repeats"
        )
        print(
            f"  tokens / positions: padded {real / padded_positions:.2f}, packed "
            f"{stats.train_tokens / stats.train_positions:.2f}"
        )
        print(
            f"  step time: padded {t_pad:.3f} s, packed {t_pack:.3f} s -> "
            f"{t_pad / t_pack:.2f}x faster packed"
        )
        print(
            f"  temporary memory: padded {m_pad / 2**20:.0f} MiB, packed {m_pack / 2**20:.0f} MiB"
            f" -> {m_pad / max(m_pack, 1):.2f}x less packed"
        )
        print(f"  packing on the host: {pack_s * 1e3:.1f} ms per batch")


if __name__ == "__main__":
    main()
