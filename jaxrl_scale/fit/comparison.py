"""Compare runs the paper's way: rank by the ceiling A with intervals; when two ceilings are
within a margin (0.02 in the paper) they are indistinguishable, so refit both with one shared A
and compare the efficiency B instead."""

from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np

from jaxrl_scale.fit.bootstrap import BootstrapResult, bootstrap_sigmoid
from jaxrl_scale.fit.data import Curve
from jaxrl_scale.fit.sigmoid_fit import FitSpec, fit_batch, pad_curves


@dataclasses.dataclass(frozen=True)
class SharedCeiling:
    """Two runs refitted with one A: which reaches a given fraction of it with less compute."""

    runs: tuple[str, str]
    a: float
    b: tuple[float, float]
    c_mid: tuple[float, float]

    @property
    def more_efficient(self) -> str:
        return self.runs[0] if self.b[0] >= self.b[1] else self.runs[1]


@dataclasses.dataclass(frozen=True)
class Comparison:
    boots: dict[str, BootstrapResult]  # per run, in the order given
    ranking: list[str]  # by fitted A, highest first
    shared: list[SharedCeiling]  # pairs whose A differ by less than the margin
    margin: float


def shared_ceiling(first: Curve, second: Curve, *, a_max: float = 1.0) -> SharedCeiling:
    """Least-squares fit of two curves with a common A and their own B, C_mid, r0.

    Profiles the joint sum of squares over A: a coarse grid, then a fine grid around the best
    value, each grid evaluated as one batched fit with A held.
    """
    log_c, y, w = pad_curves([first, second])
    spec = FitSpec(a_max=a_max, fit_a=False)
    lo = max(float(first.reward.max()), float(second.reward.max())) - 0.2
    lo, hi = max(lo, 1e-3), a_max

    def profile(grid):
        k = grid.size
        fits = fit_batch(
            jnp.asarray(np.repeat(log_c, k, axis=0)),
            jnp.asarray(np.repeat(y, k, axis=0)),
            jnp.asarray(np.repeat(w, k, axis=0)),
            jnp.zeros(2 * k, float),
            jnp.asarray(np.tile(grid, 2), float),
            spec=spec,
        )
        sse = np.asarray(fits.rmse) ** 2 * np.repeat(w.sum(axis=1), k)
        total = sse[:k] + sse[k:]
        total[~(np.asarray(fits.converged)[:k] & np.asarray(fits.converged)[k:])] = np.inf
        best = int(np.argmin(total))
        return best, fits

    coarse = np.linspace(lo, hi, 64)
    best, _ = profile(coarse)
    step = coarse[1] - coarse[0]
    fine = np.linspace(max(lo, coarse[best] - step), min(hi, coarse[best] + step), 64)
    best, fits = profile(fine)
    k = fine.size
    b, c_mid = np.asarray(fits.b), np.asarray(fits.c_mid)
    return SharedCeiling(
        runs=(first.name, second.name),
        a=float(fine[best]),
        b=(float(b[best]), float(b[k + best])),
        c_mid=(float(c_mid[best]), float(c_mid[k + best])),
    )


def compare_runs(
    curves: list[Curve],
    *,
    margin: float = 0.02,
    n_boot: int = 2000,
    seed: int = 0,
    a_max: float = 1.0,
) -> Comparison:
    names = [c.name for c in curves]
    if len(set(names)) != len(names):
        raise ValueError(f"run names must be unique, got {names}")
    boots = {
        c.name: bootstrap_sigmoid(c.compute, c.reward, n=n_boot, seed=seed, a_max=a_max)
        for c in curves
    }
    ceiling = {name: float(b.fit.a) for name, b in boots.items()}
    ranking = sorted(names, key=lambda n: -ceiling[n])
    by_name = {c.name: c for c in curves}
    shared = [
        shared_ceiling(by_name[i], by_name[j], a_max=a_max)
        for i, j in itertools.combinations(ranking, 2)
        if abs(ceiling[i] - ceiling[j]) < margin
    ]
    return Comparison(boots, ranking, shared, margin)
