"""The power law R = A - D * C ** (-B), kept to show why the sigmoid replaced it.

Fitted in standardised log-compute x = (ln C - mean) / std as R = A - D' * exp(-beta * x) with
A = a_max - softplus(u_a), D' = exp(u_d), beta = exp(u_b); then B = beta / std and
D = D' * exp(B * mean). Starts: a grid over beta with (A, D') solved by linear least squares.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_scale.fit.data import clean_curve
from jaxrl_scale.fit.solver import is_converged, levenberg_marquardt

BETA_GRID = np.geomspace(0.05, 20.0, 40)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PowerLawFit:
    a: jax.Array
    d: jax.Array
    b: jax.Array
    converged: jax.Array
    rmse: jax.Array

    def predict(self, c):
        return self.a - self.d * jnp.asarray(c) ** (-self.b)


def _residual(theta, x, y, a_max):
    a = a_max - jax.nn.softplus(theta[0])
    return a - jnp.exp(theta[1]) * jnp.exp(-jnp.exp(theta[2]) * x) - y


def _residual_and_columns(theta, x, y, a_max):
    fn = functools.partial(_residual, x=x, y=y, a_max=a_max)
    jac = jax.jacfwd(fn)(theta)
    return fn(theta), tuple(jac[:, k] for k in range(3))


@functools.partial(jax.jit, static_argnames=("a_max", "n_iter"))
def _fit(log_c, y, *, a_max: float, n_iter: int):
    mean, std = jnp.mean(log_c), jnp.std(log_c) + 1e-12
    x = (log_c - mean) / std
    # Start: for each beta, R = A - D' * e with e = exp(-beta x) is linear in (A, D').
    beta = jnp.asarray(BETA_GRID, y.dtype)
    e = jnp.exp(-beta[:, None] * x[None, :])
    e_mean, y_mean = jnp.mean(e, axis=1), jnp.mean(y)
    cov = jnp.mean((e - e_mean[:, None]) * (y - y_mean), axis=1)
    var = jnp.mean((e - e_mean[:, None]) ** 2, axis=1) + 1e-12
    d = jnp.maximum(-cov / var, 1e-6)
    a = jnp.minimum(y_mean + d * e_mean, a_max - 1e-4)
    sse = jnp.sum((a[:, None] - d[:, None] * e - y) ** 2, axis=1)
    k = jnp.argmin(sse)
    gap = a_max - a[k]
    theta0 = jnp.stack([gap + jnp.log(-jnp.expm1(-gap)), jnp.log(d[k]), jnp.log(beta[k])])
    theta = levenberg_marquardt(
        functools.partial(_residual_and_columns, a_max=a_max), theta0, x, y, n_iter=n_iter
    ).theta
    r, cols = _residual_and_columns(theta, x, y, a_max)
    b = jnp.exp(theta[2]) / std
    return PowerLawFit(
        a=a_max - jax.nn.softplus(theta[0]),
        d=jnp.exp(theta[1]) * jnp.exp(b * mean),
        b=b,
        converged=is_converged(r, jnp.stack(cols, axis=-1)),
        rmse=jnp.sqrt(jnp.mean(r * r)),
    )


def fit_power_law(compute, reward, *, a_max: float = 1.0, n_iter: int = 60) -> PowerLawFit:
    """Least-squares fit of R = A - D * C ** (-B) with A <= a_max, D > 0, B > 0 (one curve)."""
    curve = clean_curve(compute, reward, a_max=a_max)
    log_c = jnp.log(jnp.asarray(curve.compute, float))
    return _fit(log_c, jnp.asarray(curve.reward, float), a_max=float(a_max), n_iter=n_iter)
