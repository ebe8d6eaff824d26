"""Rebuild the demo's starting policy, jaxrl_scale/assets/demo_policy (run by hand).

    python scripts/make_demo_policy.py [--out jaxrl_scale/assets/demo_policy]

A supervised warm start (8000 steps) of the tiny model in jaxrl_scale/assets/demo.yaml on the
arithmetic task's noisy demonstrations (task.arithmetic.demo_noise: half of them have the last
digit off by one), from a random init with the config's seed, saved as a Hugging Face folder.
About 6 minutes on 2 CPU cores. The result depends on the jax/XLA version only through floating-
point rounding.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxrl_scale.config import asset_path, load_config
from jaxrl_scale.demo import WARM_START_STEPS, make_demo_policy

CONFIG = "asset:demo.yaml"  # jaxrl_scale/assets/demo.yaml


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=asset_path("demo_policy"))
    parser.add_argument("--steps", type=int, default=WARM_START_STEPS)
    parser.add_argument("--config", default=CONFIG)
    args = parser.parse_args()
    path = make_demo_policy(load_config(args.config), args.out, args.steps)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
