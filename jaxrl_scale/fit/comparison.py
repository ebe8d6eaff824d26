"""Compare runs the paper's way: rank by the ceiling A with intervals; when two ceilings are
within a margin (0.02 in the paper) they are indistinguishable, so refit both with A held at
the mean of their ceilings (each R0 held at its run's start) and compare the efficiency B,
with a bootstrap interval for the difference."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_scale.fit.bootstrap import (
    METHODS,
    BootstrapResult,
    Method,
    _jacobian,
    _simulate,
    bootstrap_sigmoid,
    noise_model,
    resample,
)
from jaxrl_scale.fit.data import Curve
from jaxrl_scale.fit.sigmoid_fit import FitResult, FitSpec, fit_batch, pad_curves


@dataclasses.dataclass(frozen=True)
class SharedCeiling:
    """Two runs refitted with one A (the mean of their own ceilings, R0 held at each run's
    own start where known): which reaches a given fraction of it with less compute, and
    whether the data can tell."""

    runs: tuple[str, str]
    a: float
    b: tuple[float, float]
    c_mid: tuple[float, float]
    r0: tuple[float, float]  # each run's R0 in the refit: held at Curve.r0 where given
    b_diff_ci: tuple[float, float]  # interval for B[0] - B[1] at `level`
    level: float

    @property
    def distinguishable(self) -> bool:
        """The interval excludes 0 (a NaN interval, where nothing converged, excludes
        nothing)."""
        lo, hi = self.b_diff_ci
        return lo > 0.0 or hi < 0.0

    @property
    def more_efficient(self) -> str:
        """The run with the larger B (the point estimate; see `verdict` for whether the
        difference is more than noise)."""
        return self.runs[0] if self.b[0] >= self.b[1] else self.runs[1]

    @property
    def verdict(self) -> str:
        return self.more_efficient if self.distinguishable else "indistinguishable"


@dataclasses.dataclass(frozen=True)
class Comparison:
    boots: dict[str, BootstrapResult]  # per run, in the order given
    ranking: list[str]  # by fitted A (a level run: its level), highest first
    shared: list[SharedCeiling]  # pairs whose A differ by less than the margin
    margin: float


def _parametric(curve: Curve, point: FitResult, fitted, n: int, key, a_max: float):
    """Rewards [n, P], weights [n, P] and held R0s [n] for n AR(1) resamples of one run (as
    `bootstrap_sigmoid`'s "auto"): its point fit's curve plus noise with (rho, sigma) drawn
    from the posterior of its own residuals. The held R0 is the step-0 eval, which carries the
    same noise, so each resample draws it too, as one more step of the AR(1) chain one eval
    before the first, and refits with R0 held at that draw. Measured on bench_comparison.py's
    same-recipe pairs with the true noise model in place of the posterior (1000 pairs): with
    R0 kept fixed, 12% of pairs with independent noise came out distinguishable; drawn from
    the chain, 4-6% under every noise model; drawn independently of it, 2.5% with AR(1) 0.5
    noise (too wide: the step-0 eval drifts with the first evals). No half of pairs
    resamples as `bootstrap_sigmoid` mixes in: on those pairs (400) it moved neither the false
    positives nor the power by more than the measurement's noise."""
    held = curve.r0 is not None
    p = curve.compute.size
    one = jax.tree.map(lambda v: v[0], point)
    residuals = np.asarray(curve.reward - fitted)
    jac = _jacobian(one, curve.compute, fit_r0=not held)
    if not (np.isfinite(residuals).all() and np.isfinite(jac).all()) or p <= jac.shape[1]:
        # No spare point (or no finite fit) says nothing about the noise: resamples with no
        # points, which no refit counts as converged, so the interval is NaN.
        r0 = jnp.full((n,), curve.r0 if held else 0.0)
        return jnp.broadcast_to(jnp.asarray(curve.reward), (n, p)), jnp.zeros((n, p)), r0
    noise = noise_model(residuals, jac)
    start = jnp.asarray([curve.r0]) if held else jnp.zeros((0,))
    ys, ws, _ = _simulate(
        key, jnp.concatenate([start, fitted]), p + start.size, jnp.asarray(noise.rho),
        jnp.log(jnp.asarray(noise.weight) + 1e-300), jnp.asarray(noise.scale),
        float(noise.dof), float(a_max), n=n,
    )  # fmt: skip
    r0 = ys[:, 0] if held else jnp.zeros((n,))
    return ys[:, start.size :], ws[:, start.size :], r0


def _fits(curve: Curve, n_boot: int, seed: int, a_max: float, method: str):
    """Point fit (row 0) and n_boot resamples (rows 1...) of one curve: its own ceilings A
    [1 + n] with R0 held at `curve.r0` where known (at a fresh draw of it per resample for
    "auto"), and the rewards, weights and held R0s to refit."""
    log_c, y, w = (jnp.asarray(v[0]) for v in pad_curves([curve]))
    r0 = jnp.full((1,), 0.0 if curve.r0 is None else curve.r0, float)
    spec = FitSpec(a_max=a_max, fit_r0=curve.r0 is None)
    point = fit_batch(log_c, y[None], w[None], r0, jnp.zeros(1), spec=spec)
    fitted = point.predict(jnp.exp(log_c))[0]
    if method == "auto":
        ys, ws, held = _parametric(curve, point, fitted, n_boot, jax.random.key(seed), a_max)
    else:
        ys, ws = resample(curve, fitted, n=n_boot, seed=seed, method=method)
        held = jnp.broadcast_to(r0, (n_boot,))
    ys, ws = jnp.concatenate([y[None], ys]), jnp.concatenate([w[None], ws])
    held = jnp.concatenate([r0, held])
    free = fit_batch(log_c, ys, ws, held, jnp.zeros(n_boot + 1), spec=spec)
    return log_c, ys, ws, held, free


def shared_ceiling(
    first: Curve,
    second: Curve,
    *,
    a_max: float = 1.0,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    method: Method = "auto",
) -> SharedCeiling:
    """The paper's comparison of two runs whose ceilings are within the margin.

    Each run is fitted on its own (R0 held at `Curve.r0` where given, e.g. the step-0 eval);
    the shared A is the mean of the two ceilings; each run is refitted with A held there for
    its own B and C_mid. The interval for B[0] - B[1] comes from resampling both runs and
    repeating all of it (the shared A moves with the resample); when it covers 0 the verdict
    is "indistinguishable".

    `method`: "auto" (the default) resamples each run from its point fit plus AR(1) noise
    drawn from its own residuals' posterior, the held R0 (a noisy eval too) redrawn with it.
    "pairs", "block" and "residual" resample the points and keep R0 where it was, as if the
    noise were independent and R0 exact. benchmarks/bench_comparison.py, 20 evals per run:
    two runs of one recipe come out "distinguishable" 0.6% / 0.5% / 4.0% of the time under
    "auto" with independent / AR(1) 0.5 / AR(1) 0.8 noise, and 14% / 28% / 51% under "pairs";
    the price is power (B 1.5x apart: 58% / 41% / 64% of pairs told apart, pairs 92-93%).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    parts = [_fits(c, n_boot, seed + i, a_max, method) for i, c in enumerate((first, second))]
    shared_a = (parts[0][4].a + parts[1][4].a) / 2  # [1 + n]: point, then resamples
    held = []
    ok = parts[0][4].converged & parts[1][4].converged
    for (log_c, ys, ws, r0, _), curve in zip(parts, (first, second), strict=True):
        spec = FitSpec(a_max=a_max, fit_r0=curve.r0 is None, fit_a=False)
        fit = fit_batch(log_c, ys, ws, r0, shared_a, spec=spec)
        held.append(fit)
        ok = ok & fit.converged
    b0, b1 = (np.asarray(f.b) for f in held)
    keep = np.asarray(ok)[1:]
    diff = (b0 - b1)[1:][keep]
    tail = (1 - level) / 2
    lo, hi = np.quantile(diff, [tail, 1 - tail]) if diff.size else (np.nan, np.nan)
    return SharedCeiling(
        runs=(first.name, second.name),
        a=float(shared_a[0]),
        b=(float(b0[0]), float(b1[0])),
        c_mid=(float(held[0].c_mid[0]), float(held[1].c_mid[0])),
        r0=(float(held[0].r0[0]), float(held[1].r0[0])),
        b_diff_ci=(float(lo), float(hi)),
        level=level,
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
        c.name: bootstrap_sigmoid(c.compute, c.reward, n=n_boot, seed=seed, r0=c.r0, a_max=a_max)
        for c in curves
    }
    # A run that holds a level with no rise ranks by that level (its sigmoid's A is a curve
    # through the noise, or no fit at all).
    ceiling = {name: b.flat.mean if b.on_level else float(b.fit.a) for name, b in boots.items()}
    ranking = sorted(names, key=lambda n: -ceiling[n])
    by_name = {c.name: c for c in curves}
    shared = [
        shared_ceiling(by_name[i], by_name[j], a_max=a_max, n_boot=n_boot, seed=seed)
        for i, j in itertools.combinations(ranking, 2)
        if abs(ceiling[i] - ceiling[j]) < margin
    ]
    return Comparison(boots, ranking, shared, margin)
