"""What a fit's residuals say about the evaluation noise along a run: AR(1) noise of unknown
size (`noise_model`), or a known sampling part plus an AR(1) drift (`drift_model`). The
bootstrap draws its resamples from these posteriors; the level model (level.py) and the
decline test (decline.py) read them too.
"""

from __future__ import annotations

import dataclasses

import numpy as np

RHO_GRID = np.linspace(-0.9, 0.97, 80)  # AR(1) coefficients "auto" weighs


@dataclasses.dataclass(frozen=True)
class NoiseModel:
    """What a fit's residuals say about its evaluation noise, modelled as AR(1) along the run:
    e_t = rho * e_{t-1} + innovation, with marginal sd sigma.

    `weight` is the posterior of rho over `rho` (the grid) given the residuals, with sigma
    integrated out; given rho, sigma^2 is `scale * dof / chi2(dof)`. Built by `noise_model`.
    """

    rho: np.ndarray  # [G] grid of AR(1) coefficients
    weight: np.ndarray  # [G] posterior probability of each
    scale: np.ndarray  # [G] sigma^2 estimate at each rho
    dof: int  # residual degrees of freedom: points minus the fit's rank

    @property
    def mean_rho(self) -> float:
        return float(np.sum(self.weight * self.rho))

    @property
    def sd(self) -> float:
        """Posterior-mean estimate of the noise's marginal sd."""
        return float(np.sqrt(np.sum(self.weight * self.scale)))


def _ar1_solve(x, rho):
    """R(rho)^-1 x for the AR(1) correlation matrix R_ij = rho^|i-j| (tridiagonal inverse):
    x [P, ...], rho [G] -> [G, P, ...]."""
    r = rho.reshape((-1,) + (1,) * x.ndim)
    out = np.array(np.broadcast_to((1 + r * r) * x, (rho.size,) + x.shape))
    out[:, 0], out[:, -1] = x[0], x[-1]
    out[:, 1:] -= r * x[:-1]
    out[:, :-1] -= r * x[1:]
    return out / (1 - r * r)


def noise_model(residuals, jacobian, grid=RHO_GRID, *, prior: str = "jeffreys") -> NoiseModel:
    """The posterior of an AR(1) noise model from a fit's residuals [P] (in run order) and its
    Jacobian [P, K] at the fit.

    Restricted (REML) likelihood of the linearised model: the residuals live in the P - K
    dimensions the fit cannot absorb, so a smooth fit that soaks up the slow part of correlated
    noise does not make it look independent. With a prior pi(rho) over `grid` and 1/sigma^2 on
    sigma^2, p(rho | e) is proportional to
        pi(rho) |R|^-1/2 |J' R^-1 J|^-1/2 q(rho)^-(P-K)/2,
        q = e' R^-1 e - (J' R^-1 e)' (J' R^-1 J)^-1 J' R^-1 e,
    and sigma^2 | rho is q / chi2(P - K). A short run says little about rho, so the posterior is
    wide and the intervals drawn from it are wide: that is the honest price of few points.

    `prior`: "jeffreys" (the default), the AR(1) reference prior pi(rho) ~ (1 - rho^2)^-1/2,
    or "flat". Measured (benchmarks/bench_calibration.py): with the flat prior, a 10-eval run
    with AR(1) 0.8 noise rarely shows how strong its drift is and its 95% interval for A
    covered 85.5%; the Jeffreys prior, which gives strong persistence its due weight, 91%.
    """
    e = np.asarray(residuals, np.float64)
    jac = np.asarray(jacobian, np.float64)
    p = e.size
    sv = np.linalg.svd(jac, compute_uv=False)
    keep = sv > 1e-9 * max(sv[0], 1e-300)
    if not keep.all():  # a direction the fit cannot move: drop it (an orthonormal basis)
        u = np.linalg.svd(jac, full_matrices=False)[0]
        jac = u[:, keep]
    dof = p - jac.shape[1]
    if dof < 1:
        raise ValueError(f"{p} points and {jac.shape[1]} fitted parameters leave no noise estimate")
    re, rj = _ar1_solve(e, grid), _ar1_solve(jac, grid)  # [G, P], [G, P, K]
    jrj = np.einsum("pk,gpl->gkl", jac, rj)
    jre = np.einsum("pk,gp->gk", jac, re)
    quad = np.einsum("p,gp->g", e, re) - np.einsum(
        "gk,gk->g", jre, np.linalg.solve(jrj, jre[..., None])[..., 0]
    )
    quad = np.maximum(quad, 1e-300)
    log_det = (p - 1) * np.log1p(-grid * grid) + np.linalg.slogdet(jrj)[1]
    if prior not in ("jeffreys", "flat"):
        raise ValueError(f"noise_model: prior must be 'jeffreys' or 'flat', got {prior!r}")
    log_prior = -0.5 * np.log1p(-grid * grid) if prior == "jeffreys" else 0.0
    log_post = log_prior - 0.5 * log_det - 0.5 * dof * np.log(quad)
    weight = np.exp(log_post - log_post.max())
    return NoiseModel(np.asarray(grid, float), weight / weight.sum(), quad / dof, dof)


@dataclasses.dataclass(frozen=True)
class DriftModel:
    """Evaluation noise with a known sampling part: e = sampling + drift, where the sampling
    noise is independent with known variances `sampling_var` [P] (binomial from the eval set's
    size, or the run's logged `eval_sampling_sd`) and the drift of the policy between
    checkpoints is AR(1) with coefficient rho and sd tau, both unknown.

    `weight` is the posterior over the (rho, tau) grid (flattened, [G]). Built by
    `drift_model`."""

    rho: np.ndarray  # [G]
    tau: np.ndarray  # [G]
    weight: np.ndarray  # [G]
    sampling_var: np.ndarray  # [P]

    @property
    def mean_rho(self) -> float:
        return float(np.sum(self.weight * self.rho))

    @property
    def sd(self) -> float:
        """Posterior-mean marginal sd of one eval's noise (sampling and drift)."""
        return float(np.sqrt(np.mean(self.sampling_var) + np.sum(self.weight * self.tau**2)))


DRIFT_RHO_GRID = np.linspace(-0.6, 0.97, 32)
DRIFT_TAU_GRID = np.concatenate([[0.0], np.geomspace(0.05, 8.0, 24)])  # x the sampling sd


def drift_model(residuals, jacobian, sampling_var) -> DriftModel:
    """The posterior of the drift (rho, tau) given a fit's residuals [P] (in run order), its
    Jacobian [P, K] and the known sampling variances [P].

    Restricted (REML) likelihood of the linearised model, as in `noise_model`, with the
    covariance diag(sampling_var) + tau^2 R(rho). Priors: the AR(1) reference prior
    (1 - rho^2)^-1/2 on rho and a half-Cauchy on tau whose scale is the sampling sd (a priori
    the drift is as likely under that size as over it). Knowing the sampling part is what
    lets a short run rule out a large drift: its residuals cannot be much smaller than the
    sampling noise, and a drift that would make them much larger is not seen.
    """
    e = np.asarray(residuals, np.float64)
    jac = np.asarray(jacobian, np.float64)
    v = np.asarray(sampling_var, np.float64)
    p = e.size
    u, sv, _ = np.linalg.svd(jac, full_matrices=False)
    jac = u[:, sv > 1e-9 * max(sv[0], 1e-300)]  # an orthonormal basis of what the fit can move
    if p - jac.shape[1] < 1:
        raise ValueError(f"{p} points and {jac.shape[1]} fitted parameters leave no noise estimate")
    scale = float(np.sqrt(np.mean(v)))
    rho, tau = (g.ravel() for g in np.meshgrid(DRIFT_RHO_GRID, scale * DRIFT_TAU_GRID))
    lag = np.abs(np.arange(p)[:, None] - np.arange(p)[None, :])
    cov = np.diag(v)[None] + (tau**2)[:, None, None] * rho[:, None, None] ** lag[None]
    chol = np.linalg.cholesky(cov)  # [G, P, P]
    we = np.linalg.solve(chol, np.broadcast_to(e[:, None], (rho.size, p, 1)))[..., 0]
    wj = np.linalg.solve(chol, np.broadcast_to(jac, (rho.size, *jac.shape)))
    jtj = np.einsum("gpk,gpl->gkl", wj, wj)
    jte = np.einsum("gpk,gp->gk", wj, we)
    quad = np.einsum("gp,gp->g", we, we) - np.einsum(
        "gk,gk->g", jte, np.linalg.solve(jtj, jte[..., None])[..., 0]
    )
    log_det = 2 * np.sum(np.log(np.diagonal(chol, axis1=1, axis2=2)), axis=1)
    log_lik = -0.5 * (log_det + np.linalg.slogdet(jtj)[1] + quad)
    # Prior mass of each grid cell: the density times the cell's width along tau.
    mids = np.sqrt(DRIFT_TAU_GRID[1:] * DRIFT_TAU_GRID[:-1])
    mids[0] = DRIFT_TAU_GRID[1] / 2  # the cell of tau = 0 reaches half way to the next point
    edges = np.concatenate([[0.0], mids, [np.inf]])
    cdf = 2 / np.pi * np.arctan(edges)  # half-Cauchy, unit scale (tau in sampling-sd units)
    tau_mass = np.tile(np.diff(cdf), (DRIFT_RHO_GRID.size, 1)).T.ravel()
    rho_prior = (1 - rho**2) ** -0.5
    rho_prior = rho_prior / np.sum(rho_prior[: DRIFT_RHO_GRID.size])
    log_post = log_lik + np.log(tau_mass) + np.log(rho_prior)
    weight = np.exp(log_post - log_post.max())
    return DriftModel(rho, tau, weight / weight.sum(), v)
