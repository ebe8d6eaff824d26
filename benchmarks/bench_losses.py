"""Loss + gradient of every objective at ScaleRL's batch shape, in one compiled call.

    python benchmarks/bench_losses.py [--b 768] [--t 2048]

B = 48 prompts x 16 samples = 768 sequences of T = 2048 tokens. Prints the time per call after
compilation, XLA's temp memory for it, and the ratio to the CISPO/prompt default.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_scale.rl.advantages import group_advantages
from jaxrl_scale.rl.losses import KINDS, policy_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--b", type=int, default=768)
    parser.add_argument("--t", type=int, default=2048)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    b, t = args.b, args.t
    logp = jnp.asarray(rng.normal(-1.5, 0.7, (b, t)), jnp.float32)
    behaviour = logp + jnp.asarray(rng.normal(0, 0.1, (b, t)), jnp.float32)
    lengths = rng.integers(t // 8, t, size=b)
    mask = jnp.asarray(np.arange(t)[None, :] < lengths[:, None], jnp.float32)
    rewards = jnp.asarray(rng.random(b) < 0.4, jnp.float32)
    adv, keep = group_advantages(rewards, args.group)
    mask = mask * keep[:, None]

    print(f"device: {jax.devices()[0].device_kind}; B {b} x T {t}, G {args.group}")
    print(f"{'loss':<8}{'aggregation':<12}{'ms / call':>10}{'temp MiB':>10}{'x cispo/prompt':>16}")
    base = None
    for kind in KINDS:
        for aggregation in ("prompt", "sample", "token"):

            def step(lp, bh, a, m, kind=kind, aggregation=aggregation):
                loss_fn = lambda x: policy_loss(x, bh, a, m, args.group, kind, aggregation)  # noqa: E731
                return jax.value_and_grad(loss_fn, has_aux=True)(lp)

            compiled = jax.jit(step).lower(logp, behaviour, adv, mask).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
            jax.block_until_ready(compiled(logp, behaviour, adv, mask))
            start = time.perf_counter()
            for _ in range(args.repeats):
                out = compiled(logp, behaviour, adv, mask)
            jax.block_until_ready(out)
            ms = (time.perf_counter() - start) / args.repeats * 1e3
            base = base or ms
            print(f"{kind:<8}{aggregation:<12}{ms:>10.1f}{temp:>10.1f}{ms / base:>16.2f}")


if __name__ == "__main__":
    main()
