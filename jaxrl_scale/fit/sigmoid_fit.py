"""Least-squares fits of the ScaleRL sigmoid, one curve or thousands at once.

Shapes: N curves, P points per curve, K = 4 solver parameters, G grid starts.

The fit works in log-compute, standardised per curve: x = (ln C - mean) / std, where the curve is
R = r0 + (A - r0) * logistic(beta * (x - m)); then B = beta / std and C_mid = exp(mean + std * m).
Bounds become smooth reparameterisations, theta = (u_a, u_b, m, u_r):

    r0 = top - softplus(u_r)                  (top = A when A is held fixed, else a_max)
    A  = r0 + (a_max - r0) * logistic(u_a)    so r0 < A < a_max
    beta = beta_min + exp(u_b)                so B > b_min (beta_min = b_min * std)

Starts come from variable projection: for fixed (beta, m) the curve is linear in (r0, A), so a
G-point grid over (beta, m) is solved in closed form and the best point seeds Levenberg-Marquardt.

On CPU, a large batch runs one part per core (threads) and, within a part, one cache-sized
block of curves after another, each block stopping once its fits have settled: about 300,000
bootstrap fits/s on 2 cores (benchmarks/bench_fit.py).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_scale.fit.curves import sigmoid
from jaxrl_scale.fit.solver import (
    implicit_solution,
    is_converged,
    levenberg_marquardt,
    stationarity,
)

BETA_GRID = np.geomspace(0.25, 24.0, 10)  # steepness in standardised log-compute units
# Midpoint. The data sit in about [-1.7, 1.7], or reach -3 and below when evals come at equal
# compute steps; real runs often rise fastest before their first eval, so the grid reaches far
# below the data.
M_GRID = np.linspace(-6.0, 4.0, 25)
# The default lower bound on B. B is unit-free (changing compute units moves C_mid, not B);
# at B = 0.5 a curve takes a factor 81^4 (about 4e7) in compute to go from 10% to 90% of its
# gain. Without a floor, data that have levelled off fit as well with B -> 0 (a curve flat over
# the data, still rising somewhere beyond any compute ever spent) and any ceiling above them.
B_MIN = 0.5


@dataclasses.dataclass(frozen=True)
class FitSpec:
    """What is free in a fit (static under jit)."""

    a_max: float = 1.0
    fit_r0: bool = True
    fit_a: bool = True
    n_iter: int = 40
    b_min: float = B_MIN
    # LM stops once every lane of a block has settled (solver.settled: stationary, and its
    # last Gauss-Newton step would move no parameter by more than this, relative); None: all
    # n_iter steps. A moves by at most ~1e-4 from all 40 steps' fit (tests/test_fit_profile.py);
    # float64 fits (gradients checked against finite differences) settle at its square.
    settle: float | None = 1e-3


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FitResult:
    """Fitted parameters and diagnostics; every field is [] for one curve or [N] for a batch."""

    a: jax.Array
    b: jax.Array
    c_mid: jax.Array
    r0: jax.Array
    converged: jax.Array  # finite, and the residual is orthogonal to the curve's tangent space
    identifiable: jax.Array  # converged and the data reach the inflection (C_mid <= max C)
    rmse: jax.Array  # weighted root-mean-square residual
    stationarity: jax.Array  # max |cos(residual, Jacobian column)|; 0 at an exact optimum

    def predict(self, c):
        """R at compute `c`; shape fields.shape + c.shape."""
        c = jnp.asarray(c)
        expand = lambda x: jnp.reshape(x, jnp.shape(x) + (1,) * c.ndim)  # noqa: E731
        return sigmoid(c, expand(self.a), expand(self.b), expand(self.c_mid), expand(self.r0))


# --------------------------------------------------------------------------- one curve


def _unpack(theta, r0_fixed, a_fixed, beta_min, spec: FitSpec):
    u_a, u_b, m, u_r = theta[0], theta[1], theta[2], theta[3]
    top = spec.a_max if spec.fit_a else a_fixed
    r0 = top - jax.nn.softplus(u_r) if spec.fit_r0 else r0_fixed
    a = r0 + (spec.a_max - r0) * jax.nn.sigmoid(u_a) if spec.fit_a else a_fixed
    return a, beta_min + jnp.exp(u_b), m, r0


def _residual_and_columns(theta, x, y, w, r0_fixed, a_fixed, beta_min, spec: FitSpec):
    """Weighted residual sqrt(w) * (curve - y) [P] and the 4 Jacobian columns [P], in closed
    form (one exp per point; a held parameter's column is zero)."""
    u_a, u_b, m, u_r = theta[0], theta[1], theta[2], theta[3]
    beta = beta_min + jnp.exp(u_b)
    top = spec.a_max if spec.fit_a else a_fixed
    r0 = top - jax.nn.softplus(u_r) if spec.fit_r0 else r0_fixed
    sig_a = jax.nn.sigmoid(u_a)
    span = (spec.a_max - r0) * sig_a if spec.fit_a else a_fixed - r0
    s = jax.nn.sigmoid(beta * (x - m))
    q = s * (1.0 - s)
    sqrt_w = jnp.sqrt(w)
    zero = jnp.zeros_like(s)
    d_ua = (spec.a_max - r0) * sig_a * (1.0 - sig_a) * s if spec.fit_a else zero
    d_ub = span * q * (x - m) * jnp.exp(u_b)
    d_m = -span * q * beta
    # d r0 / d u_r = -sigmoid(u_r), times d curve / d r0 at fixed u_a.
    d_r0 = 1.0 - (sig_a * s if spec.fit_a else s)
    d_ur = -jax.nn.sigmoid(u_r) * d_r0 if spec.fit_r0 else zero
    residual = sqrt_w * (r0 + span * s - y)
    return residual, tuple(sqrt_w * d for d in (d_ua, d_ub, d_m, d_ur))


def _residual_and_jac(theta, x, y, w, r0_fixed, a_fixed, beta_min, spec: FitSpec):
    residual, columns = _residual_and_columns(theta, x, y, w, r0_fixed, a_fixed, beta_min, spec)
    return residual, jnp.stack(columns, axis=-1)


def _optimality(theta, x, y, w, r0_fixed, a_fixed, beta_min, spec: FitSpec):
    """J^T r on free parameters; theta itself on held ones (the solver leaves those at 0)."""
    r, j = _residual_and_jac(theta, x, y, w, r0_fixed, a_fixed, beta_min, spec)
    free = jnp.array([spec.fit_a, True, True, spec.fit_r0])
    return jnp.where(free, j.T @ r, theta)


def _grid_start(x, y, w, r0_fixed, a_fixed, beta_min, spec: FitSpec):
    """For N curves at once: the best (beta, m) on the grid with (r0, A) solved in closed form,
    as thetas [N, 4]. x is [P] (shared by every curve) or [N, P]; y, w [N, P]; held values [N].

    For fixed (beta, m) the curve is r0 * (1 - s) + A * s with s = logistic(beta * (x - m)), so
    every weighted sum the 2 x 2 least-squares problem needs is a contraction over P: with a
    shared x, three [G, P] x [P, N] matmuls. Written for the whole batch rather than per curve
    under vmap so that every [G, N] array is laid out with the batch innermost: the elementwise
    work reads memory in order and the best grid point is a reduction over the major axis.
    """
    # The grid's steepness is exp(u_b), on top of the floor beta_min.
    beta_g, m_g = (jnp.asarray(g, y.dtype).ravel() for g in np.meshgrid(BETA_GRID, M_GRID))
    if x.ndim == 1:  # [G, P] sigmoids, computed once for the batch (whose floors are equal)
        steep = beta_min[0] + beta_g
        s = jax.nn.sigmoid(steep[:, None] * (x[None, :] - m_g[:, None]))
        contract = lambda a, v: a @ v.T  # noqa: E731  [G, P] x [N, P] -> [G, N]
    else:  # [N, G, P]
        steep = beta_min[:, None, None] + beta_g[None, :, None]
        s = jax.nn.sigmoid(steep * (x[:, None, :] - m_g[None, :, None]))
        contract = lambda a, v: jnp.einsum("ngp,np->gn", a, v)  # noqa: E731
    # Centre the rewards so the expanded sum of squares below does not cancel in float32.
    w_sum = jnp.sum(w, axis=-1)
    y_mean = jnp.sum(w * y, axis=-1) / w_sum  # [N]
    yc = y - y_mean[:, None]
    sw, ssw, syw = contract(s, w), contract(s * s, w), contract(s, w * yc)  # [G, N]
    # Weighted sums over u = 1 - s and v = s.
    uu, uv, vv = w_sum - 2 * sw + ssw, sw - ssw, ssw
    uy, vy = -syw, syw  # sum(w * yc) = 0
    tiny = 1e-12
    shape = sw.shape
    r0_c, a_c = r0_fixed - y_mean, a_fixed - y_mean  # held values, centred [N]
    if spec.fit_a and spec.fit_r0:  # normal equations for (r0, A) by Cramer's rule
        inv_det = 1.0 / (uu * vv - uv * uv + tiny)
        r0, a = (uy * vv - vy * uv) * inv_det, (vy * uu - uy * uv) * inv_det
    elif spec.fit_a:
        r0 = jnp.broadcast_to(r0_c, shape)
        a = (vy - r0 * uv) / (vv + tiny)
    elif spec.fit_r0:
        a = jnp.broadcast_to(a_c, shape)
        r0 = (uy - a * uv) / (uu + tiny)
    else:
        r0, a = jnp.broadcast_to(r0_c, shape), jnp.broadcast_to(a_c, shape)
    # Respect the bounds r0 < A <= a_max and keep a free r0 within one data range below the
    # lowest reward: a nearly flat sigmoid over the data makes (r0, A) ill-conditioned.
    present = w > 0
    y_lo = jnp.min(jnp.where(present, yc, jnp.inf), axis=-1)
    y_hi = jnp.max(jnp.where(present, yc, -jnp.inf), axis=-1)
    if spec.fit_a:  # A above its bound: hold it there and re-solve r0 for that A
        top = spec.a_max - y_mean
        over = a > top
        a = jnp.where(over, top, a)
        if spec.fit_r0:
            r0 = jnp.where(over, (uy - a * uv) / (uu + tiny), r0)
    if spec.fit_r0:
        r0 = jnp.clip(r0, y_lo - (y_hi - y_lo), a - 1e-4)
    if spec.fit_a:
        a = jnp.maximum(a, r0 + 1e-4)
    sse = r0 * r0 * uu + 2 * r0 * a * uv + a * a * vv - 2 * r0 * uy - 2 * a * vy
    sse = jnp.where(jnp.isfinite(sse), sse, jnp.inf)
    # The first grid point with the least sse (argmin's variadic reduction is several times
    # slower on CPU than these two plain ones).
    index = jnp.arange(shape[0])[:, None]
    best = jnp.min(jnp.where(sse == jnp.min(sse, axis=0), index, shape[0]), axis=0)  # [N]
    best = jnp.minimum(best, shape[0] - 1)  # every sse non-finite: any point will do
    pick = lambda v: jnp.sum(jnp.where(index == best, v, 0.0), axis=0)  # noqa: E731
    a, r0 = pick(a) + y_mean, pick(r0) + y_mean
    beta, m = beta_g[best], m_g[best]
    # Start strictly inside the bounds, where the gradient in u_a is alive.
    frac = jnp.clip((a - r0) / (spec.a_max - r0), 0.02, 0.98)
    u_a = jnp.log(frac) - jnp.log1p(-frac) if spec.fit_a else jnp.zeros_like(a)
    top = spec.a_max if spec.fit_a else a_fixed
    gap = jnp.maximum(top - r0, 1e-4)
    u_r = gap + jnp.log(-jnp.expm1(-gap)) if spec.fit_r0 else jnp.zeros_like(a)
    return jnp.stack([u_a, jnp.log(beta), m, u_r], axis=-1).astype(y.dtype)


def _solve(theta0, x, y, w, r0_fixed, a_fixed, beta_min, spec: FitSpec):
    residual_and_columns = functools.partial(_residual_and_columns, spec=spec)
    settle = spec.settle
    if settle is not None and y.dtype == jnp.float64:
        settle = settle**2
    return levenberg_marquardt(
        residual_and_columns, theta0, x, y, w, r0_fixed, a_fixed, beta_min,
        n_iter=spec.n_iter, settle=settle,
    ).theta  # fmt: skip


def _fit_standardised(theta0, x, y, w, r0_fixed, a_fixed, beta_min, spec: FitSpec):
    """One curve in standardised log-compute from the start theta0: (A, beta, m, r0, rmse,
    stationarity, converged)."""
    # Closures, not partials: custom_root would treat a partial's keywords as array arguments.
    # The start is custom_root's initial guess, which gradients do not flow through.
    solve = implicit_solution(
        lambda theta, *args: _solve(theta, *args, spec),
        lambda theta, *args: _optimality(theta, *args, spec),
    )
    theta = solve(theta0, x, y, w, r0_fixed, a_fixed, beta_min)
    a, beta, m, r0 = _unpack(theta, r0_fixed, a_fixed, beta_min, spec)
    r, j = _residual_and_jac(
        jax.lax.stop_gradient(theta), x, y, w, r0_fixed, a_fixed, beta_min, spec
    )
    rmse = jnp.sqrt(jnp.sum(r * r) / jnp.sum(w))
    converged = jnp.all(jnp.isfinite(theta)) & is_converged(r, j)
    return a, beta, m, jnp.asarray(r0, a.dtype), rmse, stationarity(r, j), converged


def min_support(spec: FitSpec) -> int:
    """Distinct points a fit needs to count as converged: more than its free parameters
    (a residual degree of freedom), and at least 4."""
    free = 2 + int(spec.fit_a) + int(spec.fit_r0)
    return max(4, free + 1)


def _fit_block(log_c, y, w, r0_fixed, a_fixed, spec: FitSpec) -> FitResult:
    """fit_batch for one block of curves, every array in memory at once."""
    shared = log_c.ndim == 1
    present = jnp.any(w > 0, axis=0) if shared else w > 0
    n = jnp.sum(present, axis=-1, keepdims=True)
    mean = jnp.sum(jnp.where(present, log_c, 0.0), axis=-1, keepdims=True) / n
    var = jnp.sum(jnp.where(present, (log_c - mean) ** 2, 0.0), axis=-1, keepdims=True) / n
    std = jnp.sqrt(var) + 1e-12
    x = jnp.where(present, (log_c - mean) / std, 0.0)
    y = jnp.where(w > 0, y, 0.0)
    beta_min = jnp.broadcast_to(spec.b_min * std[..., 0], r0_fixed.shape)  # [N]
    theta0 = jax.lax.stop_gradient(_grid_start(x, y, w, r0_fixed, a_fixed, beta_min, spec))
    a, beta, m, r0, rmse, cosine, converged = jax.vmap(
        functools.partial(_fit_standardised, spec=spec),
        in_axes=(0, None if shared else 0, 0, 0, 0, 0, 0),
    )(theta0, x, y, w, r0_fixed, a_fixed, beta_min)
    mean, std = mean[..., 0], std[..., 0]
    c_mid = jnp.exp(mean + std * m)
    c_max = jnp.exp(jnp.max(jnp.where(w > 0, log_c, -jnp.inf), axis=-1))
    # A curve with no more points than free parameters is fitted exactly, whatever the truth
    # (a bootstrap resample that drew few distinct points): it says nothing, so it does not
    # count as converged.
    converged = converged & (jnp.sum(w > 0, axis=-1) >= min_support(spec))
    return FitResult(
        a=a,
        b=beta / std,
        c_mid=c_mid,
        r0=r0,
        converged=converged,
        identifiable=converged & (c_mid <= c_max),
        rmse=rmse,
        stationarity=cosine,
    )


CPU_BLOCK = 512  # curves per block on CPU: a block's [G, 512] and [512, P] arrays stay in cache


@functools.partial(jax.jit, static_argnames="spec")
def _fit_blocked(log_c, y, w, r0_fixed, a_fixed, spec: FitSpec) -> FitResult:
    """_fit_block over the batch; on CPU one cache-sized block after another (lax.map), which
    runs about twice as fast as the whole batch at once: every elementwise pass of the solver
    then reads memory that is still in cache. Accelerators take the batch whole."""
    n = y.shape[0]
    if jax.default_backend() != "cpu" or n <= CPU_BLOCK:
        return _fit_block(log_c, y, w, r0_fixed, a_fixed, spec)
    blocks = -(-n // CPU_BLOCK)
    pad = blocks * CPU_BLOCK - n

    def split(v):  # [N, ...] -> [blocks, CPU_BLOCK, ...], padded with copies of the first curve
        v = jnp.concatenate([v, jnp.broadcast_to(v[:1], (pad, *v.shape[1:]))]) if pad else v
        return v.reshape(blocks, CPU_BLOCK, *v.shape[1:])

    shared = log_c.ndim == 1  # a shared ln C [P] goes to every block whole

    def fit(blocked):
        return _fit_block(log_c, *blocked, spec) if shared else _fit_block(*blocked, spec)

    per_curve = (y, w, r0_fixed, a_fixed) if shared else (log_c, y, w, r0_fixed, a_fixed)
    out = jax.lax.map(fit, tuple(split(v) for v in per_curve))
    return jax.tree.map(lambda v: v.reshape(blocks * CPU_BLOCK, *v.shape[2:])[:n], out)


def _cpu_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def fit_batch(log_c, y, w, r0_fixed, a_fixed, spec: FitSpec) -> FitResult:
    """Fit N curves: ln C [P] (shared by all) or [N, P], rewards and weights [N, P] (weight 0 =
    absent point; bootstrap counts are weights), held r0 / A values [N]. Differentiable.

    On CPU a large batch is split into one part per core, each fitted by its own thread (XLA
    runs a single while loop on one core; the threads release the GIL while XLA computes).
    """
    args = (log_c, y, w, r0_fixed, a_fixed)
    n = np.shape(y)[0]
    workers = _cpu_workers() if jax.default_backend() == "cpu" else 1
    if workers < 2 or n < 2 * CPU_BLOCK or _is_traced(*args):
        return _fit_blocked(*args, spec=spec)
    # Equal parts (one compiled program), padded with copies of the first curve.
    part = -(-n // (workers * CPU_BLOCK)) * CPU_BLOCK
    idx = np.arange(workers * part)
    idx[n:] = 0

    args = [jnp.asarray(v) for v in args]  # to the device once, not once per thread

    # Every part's inputs are gathered here, in the calling thread: the threads only run one
    # compiled program.
    parts_in = [
        [v if i == 0 and v.ndim == 1 else v[idx[k * part : (k + 1) * part]]
         for i, v in enumerate(args)]
        for k in range(workers)
    ]  # fmt: skip

    def run(k):
        return jax.block_until_ready(_fit_blocked(*parts_in[k], spec=spec))

    # The first call of a shape compiles its program (and writes the persistent compilation
    # cache) in this thread alone, before any thread runs it: two threads compiling and
    # serialising executables at once crashed the process in the compilation cache.
    signature = (spec, *((v.shape, v.dtype) for v in parts_in[0]))
    with _COMPILED_LOCK:
        first = signature not in _COMPILED
        _COMPILED.add(signature)
    done = [run(0)] if first else []
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        parts = done + list(pool.map(run, range(len(done), workers)))
    return jax.tree.map(lambda *v: jnp.concatenate(v)[:n], *parts)


# Shapes fit_batch has compiled. A lock, not one owner: fits run from any thread (the CLI's, a
# trainer's forecast).
_COMPILED: set = set()
_COMPILED_LOCK = threading.Lock()


# --------------------------------------------------------------------------- public API


def _is_traced(*xs) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in xs)


def _held(value, n: int, name: str):
    """A held parameter as [N] (None -> zeros, unused)."""
    if value is None:
        return jnp.zeros((n,), float)
    arr = jnp.asarray(value, float)
    if arr.ndim == 0:
        return jnp.broadcast_to(arr, (n,))
    if arr.shape != (n,):
        raise ValueError(f"{name} must be a scalar or shaped [{n}], got {arr.shape}")
    return arr


def pad_curves(curves, width: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Curves of different lengths as [N, P] (ln C, reward, weight) with weight 0 padding;
    P is the longest curve's length, or `width` when that is more."""
    width = max(width, *(c.compute.size for c in curves))
    log_c = np.zeros((len(curves), width), np.float64)
    y = np.zeros((len(curves), width), np.float64)
    w = np.zeros((len(curves), width), np.float64)
    for i, c in enumerate(curves):
        p = c.compute.size
        log_c[i, :p], y[i, :p], w[i, :p] = np.log(c.compute), c.reward, 1.0
        log_c[i, p:] = log_c[i, 0]  # finite filler under weight 0
    return log_c, y, w


def fit_sigmoid(
    compute,
    reward,
    r0=None,
    *,
    mask=None,
    a=None,
    a_max: float = 1.0,
    c_min: float | None = None,
    n_iter: int = 40,
    b_min: float = B_MIN,
) -> FitResult:
    """Least-squares fit of R = r0 + (A - r0) / (1 + (C_mid / C) ** B), r0 < A <= a_max, B > 0.

    Args:
      compute, reward: [P] for one curve or [N, P] for many; `mask` [N, P] marks present points
        of ragged curves. Concrete inputs are validated (`CurveDataError` names the bad point)
        and tidied (sorted, repeated compute averaged, points below `c_min` dropped, with a
        `CurveDataWarning`). Traced inputs (under `jax.grad`) are used as given.
      r0: None to fit it, else a float or [N] held value (e.g. the measured step-0 pass rate).
      a: None to fit A, else a held value (used for shared-A comparisons).
      a_max: upper bound on A (1 for pass rates) and on rewards.
      b_min: lower bound on B (`B_MIN`): without one, data that have levelled off fit as well
        by a curve still rising beyond any compute ever spent, with any ceiling above them.

    Returns:
      FitResult with fields [] (one curve) or [N]; `converged` flags fits whose residual is
      orthogonal to every parameter direction, `identifiable` those whose data also reach
      the inflection point (C_mid <= max C).
    """
    from jaxrl_scale.fit.data import CurveDataError, clean_curve

    spec = FitSpec(
        a_max=float(a_max), fit_r0=r0 is None, fit_a=a is None, n_iter=n_iter, b_min=b_min
    )
    single = np.ndim(compute) == 1
    if _is_traced(compute, reward, r0, a, mask):
        log_c = jnp.log(jnp.asarray(compute))
        y = jnp.atleast_2d(jnp.asarray(reward))
        w = jnp.ones_like(y) if mask is None else jnp.atleast_2d(jnp.asarray(mask, y.dtype))
    else:
        c2, r2 = np.atleast_2d(compute), np.atleast_2d(reward)
        if c2.shape != r2.shape or c2.ndim != 2:
            raise CurveDataError(
                f"compute and reward must share one shape, [P] or [N, P]: {c2.shape}, {r2.shape}"
            )
        m2 = np.ones(c2.shape, bool) if mask is None else np.atleast_2d(np.asarray(mask, bool))
        if m2.shape != c2.shape:
            raise CurveDataError(f"mask must be shaped like compute {c2.shape}, got {m2.shape}")
        curves = [
            clean_curve(
                c2[i][m2[i]],
                r2[i][m2[i]],
                name=f"curve {i}" if not single else "curve",
                a_max=a_max,
                c_min=c_min,
            )
            for i in range(c2.shape[0])
        ]
        log_c, y, w = (jnp.asarray(v) for v in pad_curves(curves))
        if single:
            log_c = log_c[0]
    n = y.shape[0]
    result = fit_batch(log_c, y, w, _held(r0, n, "r0"), _held(a, n, "a"), spec=spec)
    if single:
        result = jax.tree.map(lambda v: v[0], result)
    return result


def influence(compute, reward, r0=None, *, target: str | float = "a", **fit_kwargs):
    """d(target)/d(reward_i) for each point [P]: which evaluation points move the fit most.

    `target` is a parameter name ("a", "b", "c_mid", "r0") or a compute value, for the
    predicted reward there. Gradients come from implicit differentiation at the optimum.
    """
    from jaxrl_scale.fit.data import clean_curve

    curve = clean_curve(compute, reward, a_max=fit_kwargs.get("a_max", 1.0))
    compute = jnp.asarray(curve.compute, float)

    def value(y):
        fit = fit_sigmoid(compute, y, r0, **fit_kwargs)
        return getattr(fit, target) if isinstance(target, str) else fit.predict(target)

    return jax.grad(value)(jnp.asarray(curve.reward, float))
