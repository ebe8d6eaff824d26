"""jaxrl_scale: JAX-native RL post-training (the ScaleRL recipe) with a batched curve fitter.

The public face, what a notebook or a script calls (docs/api.md has each one's arguments):

    import jaxrl_scale as jr

    cfg = jr.load_config("configs/tiny_arithmetic.yaml", overrides=["train.steps=20"])
    rows = jr.train(cfg, "runs/tiny")                     # the run's metrics rows
    model, tokenizer = jr.load_pretrained("path/to/hf_folder")
    ro = jr.generate(model, [[1, 2, 3]], max_new_tokens=16, key=jax.random.key(0))
    adv, keep = jr.group_advantages(rewards, group_size=8)
    loss, metrics = jr.policy_loss(logp, behavior_logp, adv, mask, group_size=8)
    task = jr.get_task("countdown")
    fit = jr.fit.fit_sigmoid(compute, reward)             # and the rest of jaxrl_scale.fit

Importing the package is cheap: each name loads its part (and JAX) on first use. The parts
themselves (models/, generation/, rl/, ...) are the library's inside; docs/architecture.md
says which is which.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING

try:
    __version__ = metadata.version("jaxrl-scale")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "unknown"

# name -> (module, attribute); attribute None: the module itself.
_PUBLIC = {
    "load_config": ("jaxrl_scale.config", "load_config"),
    "train": ("jaxrl_scale.train", None),  # the module is callable as its train() (train.py)
    "load_pretrained": ("jaxrl_scale.models.hf", "load_pretrained"),
    "generate": ("jaxrl_scale.generation.sampler", "generate"),
    "policy_loss": ("jaxrl_scale.rl.losses", "policy_loss"),
    "group_advantages": ("jaxrl_scale.rl.advantages", "group_advantages"),
    "get_task": ("jaxrl_scale.tasks", "get_task"),
    "fit": ("jaxrl_scale.fit", None),
}
__all__ = [
    "__version__",
    "load_config",
    "train",
    "load_pretrained",
    "generate",
    "policy_loss",
    "group_advantages",
    "get_task",
    "fit",
]

if TYPE_CHECKING:
    from jaxrl_scale import fit, train
    from jaxrl_scale.config import load_config
    from jaxrl_scale.generation.sampler import generate
    from jaxrl_scale.models.hf import load_pretrained
    from jaxrl_scale.rl.advantages import group_advantages
    from jaxrl_scale.rl.losses import policy_loss
    from jaxrl_scale.tasks import get_task


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'jaxrl_scale' has no attribute {name!r}")
    module, attribute = _PUBLIC[name]
    value = importlib.import_module(module)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
