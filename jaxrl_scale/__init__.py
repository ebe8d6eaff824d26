"""jaxrl_scale: JAX-native RL post-training (the ScaleRL recipe) with a batched curve fitter."""

from importlib import metadata

try:
    __version__ = metadata.version("jaxrl-scale")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "unknown"
