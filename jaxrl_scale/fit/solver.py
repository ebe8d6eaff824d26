"""The least-squares solver behind every curve fit: one small interface, one file to swap.

`levenberg_marquardt(residual_and_jac, theta0, *args, n_iter, settle)` runs at most `n_iter`
damped Gauss-Newton steps. Under `vmap` a loop runs until its slowest lane stops, so a batch
stops once every lane has settled (`settled`: its next step smaller than `settle`), and lanes
that settled early keep their parameters while the others go on; `settle=None` runs all
`n_iter` steps. The loop is written for small dense problems: one residual + Jacobian
evaluation per iteration, a K x K solve.

`implicit_solution(solve, optimality)` wraps a solver with `jaxopt.implicit_diff.custom_root`, so
gradients of the fitted parameters with respect to the data come from the implicit function
theorem at the optimum instead of differentiating through the iterations.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp


class LMState(NamedTuple):
    theta: jax.Array  # [K]
    jtj: jax.Array  # [K, K] J^T J at theta
    grad: jax.Array  # [K] J^T r at theta
    sse: jax.Array  # [] sum of squared residuals at theta
    damping: jax.Array  # []
    # [] the largest relative change of a parameter the last step proposed, taken or not
    # (inf where its damping was above 1e-2: not a Gauss-Newton estimate of the distance)
    step: jax.Array


def normal_equations(residual, columns):
    """(J^T J, J^T r, r^T r) from the residual [P] and the Jacobian's K columns, each [P].

    Written as K (K + 1) / 2 fused multiply-sums: under vmap this is several times faster on
    CPU than a batch of tiny [K, P] x [P, K] matmuls.
    """
    k = len(columns)
    entries = {}
    for i in range(k):
        for j in range(i + 1):
            entries[i, j] = entries[j, i] = jnp.sum(columns[i] * columns[j])
    jtj = jnp.stack([jnp.stack([entries[i, j] for j in range(k)]) for i in range(k)])
    grad = jnp.stack([jnp.sum(c * residual) for c in columns])
    return jtj, grad, jnp.sum(residual * residual)


def settled(s: LMState, tol: float):
    """Whether an LM state is done: its last step, nearly Gauss-Newton (damping at most
    1e-2: an estimate of the distance to the optimum), proposed to move no parameter by more
    than `tol` relative (|d| <= tol (1 + |theta|)), taken or not (at the optimum, rounding
    rejects steps that small) and the residual is orthogonal to the Jacobian's live columns
    to within GTOL (`stationarity`, from the normal equations the state carries: what
    `is_converged` checks); or the residual is at float precision; or the damping is at its
    ceiling (no step lowers the sum of squares)."""
    col = jnp.diag(s.jtj)
    cos = jnp.abs(s.grad) / jnp.sqrt(col * s.sse + 1e-30)
    live = col > 1e-12 * (jnp.max(col) + 1e-30)
    stationary = jnp.max(jnp.where(live, cos, 0.0)) < GTOL
    close = (s.step <= tol) & stationary
    return close | (s.sse < 1e-20) | (s.damping >= 1e11) | ~jnp.isfinite(s.sse)


def levenberg_marquardt(residual_and_columns, theta0, *args, n_iter: int = 30,
                        settle: float | None = None):  # fmt: skip
    """Minimise sum(residual ** 2) over theta [K]; returns the final LMState (after at most
    `n_iter` steps; with `settle`, fewer once `settled(state, settle)`).

    `residual_and_columns(theta, *args)` returns the residual [P] and the K Jacobian columns.

    Marquardt scaling: the step solves (J^T J + damping * (diag(J^T J) + 1e-9)) d = -J^T r.
    A step that lowers the sum of squares is taken and the damping shrinks; otherwise the damping
    grows and theta stays. Non-finite candidates are rejected. Only the K x K normal equations
    are carried between iterations, never the [P, K] Jacobian.
    """
    jtj, grad, sse = normal_equations(*residual_and_columns(theta0, *args))
    state = LMState(theta0, jtj, grad, sse, jnp.asarray(1e-3, theta0.dtype),
                    jnp.asarray(jnp.inf, theta0.dtype))  # fmt: skip

    def step(_, s: LMState) -> LMState:
        scale = jnp.diag(s.jtj) + 1e-9
        d = solve_spd(s.jtj + s.damping * jnp.diag(scale), -s.grad)
        candidate = s.theta + d
        jtj, grad, sse = normal_equations(*residual_and_columns(candidate, *args))
        accept = jnp.isfinite(sse) & (sse < s.sse)
        pick = lambda new, old: jnp.where(accept, new, old)  # noqa: E731
        return LMState(
            theta=pick(candidate, s.theta),
            jtj=pick(jtj, s.jtj),
            grad=pick(grad, s.grad),
            sse=pick(sse, s.sse),
            damping=jnp.clip(jnp.where(accept, s.damping / 3.0, s.damping * 4.0), 1e-12, 1e12),
            step=jnp.where(
                s.damping <= 1e-2, jnp.max(jnp.abs(d) / (1.0 + jnp.abs(s.theta))), jnp.inf
            ),
        )

    if settle is None:
        return jax.lax.fori_loop(0, n_iter, step, state)

    def more(carry) -> jax.Array:
        i, s = carry
        return (i < n_iter) & ~settled(s, settle)

    return jax.lax.while_loop(more, lambda carry: (carry[0] + 1, step(0, carry[1])), (0, state))[1]


def solve_spd(matrix, rhs):
    """Solve a small symmetric positive-definite system by an unrolled Cholesky factorisation.

    For K <= 8 the unrolled scalar arithmetic vectorises across a vmap batch, where a batched
    LAPACK call per lane would dominate the fit's run time.
    """
    k = matrix.shape[-1]
    low = [[None] * k for _ in range(k)]
    for i in range(k):
        for j in range(i + 1):
            acc = matrix[i, j] - sum(low[i][p] * low[j][p] for p in range(j))
            if i == j:
                low[i][i] = jnp.sqrt(jnp.maximum(acc, 1e-30))
            else:
                low[i][j] = acc / low[j][j]
    fwd = []
    for i in range(k):  # L z = rhs
        fwd.append((rhs[i] - sum(low[i][p] * fwd[p] for p in range(i))) / low[i][i])
    out = [None] * k
    for i in reversed(range(k)):  # L^T x = z
        out[i] = (fwd[i] - sum(low[p][i] * out[p] for p in range(i + 1, k))) / low[i][i]
    return jnp.stack(out)


def stationarity(residual, jac):
    """Largest cosine between the residual [P] and a Jacobian column [P, K]: 0 at an optimum.

    Scale-free (MINPACK's gtol test): a fit is converged when the residual is orthogonal to
    every direction the parameters can move the curve in. A column that vanishes (a parameter
    held fixed or pinned at its bound) cannot move the curve and does not count.
    """
    col_norm = jnp.sqrt(jnp.sum(jac**2, axis=0))
    r_norm = jnp.sqrt(jnp.sum(residual**2))
    cos = jnp.abs(jac.T @ residual) / (col_norm * r_norm + 1e-30)
    live = col_norm > 1e-6 * (jnp.max(col_norm) + 1e-30)
    return jnp.max(jnp.where(live, cos, 0.0))


GTOL = 1e-3  # stationarity below which a fit counts as converged
RTOL = 1e-5  # root-mean-square residual below which a fit is exact (stationarity is noise there)


def is_converged(residual, jac):
    """Finite and stationary, or fitting the data to within float precision."""
    rms = jnp.sqrt(jnp.mean(residual**2))
    finite = jnp.all(jnp.isfinite(jac)) & jnp.isfinite(rms)
    return finite & ((stationarity(residual, jac) < GTOL) | (rms < RTOL))


def implicit_solution(solve, optimality):
    """`solve(theta_init, *args) -> theta` with gradients by implicit differentiation.

    `optimality(theta, *args)` is zero at the solution (e.g. the gradient of the objective).
    jaxopt is imported here, at the first fit, not with the package: its import takes 0.3 s
    of every process that reads a config (measured on the 2-core VM).
    """
    with warnings.catch_warnings():
        # jaxopt announces at import that it is unmaintained; say it once here, not to users.
        warnings.filterwarnings("ignore", message="JAXopt is no longer maintained")
        from jaxopt import implicit_diff, linear_solve

    return implicit_diff.custom_root(optimality, solve=linear_solve.solve_lu)(solve)
