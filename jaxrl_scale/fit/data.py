"""Curve data in: validation of (compute, reward) points, and CSV / JSONL / run-directory loading.

Bad input is an error naming what is wrong (which point, which column, which line); repairable
input (unsorted points, repeated compute values) is repaired with a `CurveDataWarning` saying so.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MIN_POINTS = 4


class CurveDataError(ValueError):
    """Curve data cannot be fitted; the message names the curve and the offending point."""


class CurveDataWarning(UserWarning):
    """Curve data was repaired (sorted, duplicates averaged, early points dropped)."""


@dataclass(frozen=True)
class Curve:
    name: str
    compute: np.ndarray  # [P] float64, strictly increasing, > 0
    reward: np.ndarray  # [P] float64
    r0: float | None = None  # a measurement at zero compute (a run's step-0 eval), if any
    steps: np.ndarray | None = None  # [P] the run's step at each point, when known
    # [P] each point's known sampling sd (a run's `eval_sampling_sd`), when known
    sd: np.ndarray | None = None
    r0_sd: float | None = None  # the R0 measurement's sampling sd, when known


def clean_curve(
    compute,
    reward,
    *,
    name: str = "curve",
    a_max: float | None = 1.0,
    c_min: float | None = None,
    sd=None,
) -> Curve:
    """Validate and tidy one curve; `sd` (a scalar or [P]), each point's known sampling sd,
    goes along (sorted with its point; for averaged repeats, the sd of their mean).

    Errors: mismatched shapes, NaN/inf, compute <= 0, rewards outside [0, a_max] (when a_max is
    given), fewer than 4 distinct compute values. Repairs, with a warning: points sorted by
    compute, rewards at a repeated compute value averaged, points below `c_min` dropped.
    """
    c = np.asarray(compute, dtype=np.float64)
    r = np.asarray(reward, dtype=np.float64)
    if c.ndim != 1 or c.shape != r.shape:
        raise CurveDataError(
            f"{name}: compute and reward must be 1-D of one length, got {c.shape} and {r.shape}"
        )
    if sd is not None:
        sd = np.broadcast_to(np.asarray(sd, np.float64), c.shape).copy()
    for label, arr in (("compute", c), ("reward", r), ("sd", sd)):
        if arr is None:
            continue
        bad = np.flatnonzero(~np.isfinite(arr))
        if bad.size:
            raise CurveDataError(f"{name}: {label}[{bad[0]}] is {arr[bad[0]]} (must be finite)")
    bad = np.flatnonzero(c <= 0)
    if bad.size:
        raise CurveDataError(f"{name}: compute[{bad[0]}] = {c[bad[0]]} (compute must be > 0)")
    if a_max is not None:
        bad = np.flatnonzero((r < 0) | (r > a_max))
        if bad.size:
            raise CurveDataError(
                f"{name}: reward[{bad[0]}] = {r[bad[0]]} is outside [0, {a_max}] "
                "(set a_max for a metric with another range)"
            )
    if c_min is not None:
        keep = c >= c_min
        if not keep.all():
            warnings.warn(
                f"{name}: dropped {int((~keep).sum())} points with compute < {c_min}",
                CurveDataWarning,
                stacklevel=2,
            )
        c, r = c[keep], r[keep]
        sd = None if sd is None else sd[keep]
    if np.any(np.diff(c) < 0):
        warnings.warn(
            f"{name}: points were not sorted by compute; sorted them",
            CurveDataWarning,
            stacklevel=2,
        )
        order = np.argsort(c, kind="stable")
        c, r = c[order], r[order]
        sd = None if sd is None else sd[order]
    unique, inverse, counts = np.unique(c, return_inverse=True, return_counts=True)
    if unique.size < c.size:
        repeated = unique[counts > 1]
        warnings.warn(
            f"{name}: {repeated.size} compute values appear more than once "
            f"(first: {repeated[0]:g}); averaged their rewards",
            CurveDataWarning,
            stacklevel=2,
        )
        r = np.bincount(inverse, weights=r) / counts
        if sd is not None:
            sd = np.sqrt(np.bincount(inverse, weights=sd**2)) / counts
        c = unique
    if c.size < MIN_POINTS:
        raise CurveDataError(
            f"{name}: {c.size} distinct points; a sigmoid fit needs at least {MIN_POINTS}"
        )
    if sd is not None and np.any(sd < 0):
        raise CurveDataError(f"{name}: sd[{int(np.argmax(sd < 0))}] is negative")
    return Curve(name, c, r, sd=sd)


# --------------------------------------------------------------------------- files


def _number(value, where: str) -> float | None:
    """A cell's numeric value; None for an empty cell or JSON null."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, bool):
        raise CurveDataError(f"{where}: expected a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise CurveDataError(f"{where}: expected a number, got {value!r}") from None


def _rows(path: Path) -> list[tuple[str, dict]]:
    """(location, row) pairs from a CSV or JSONL file."""
    if path.suffix.lower() == ".csv":
        with path.open(newline="") as f:
            return [(f"{path}:{i + 2}", row) for i, row in enumerate(csv.DictReader(f))]
    rows = []
    with path.open() as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise CurveDataError(f"{path}:{i}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise CurveDataError(f"{path}:{i}: expected a JSON object per line")
            rows.append((f"{path}:{i}", row))
    return rows


def curve_from_rows(
    rows: list[dict],
    *,
    x: str = "compute_flops",
    y: str = "eval_pass_rate",
    name: str = "run",
    a_max: float | None = 1.0,
    c_min: float | None = None,
    clean: bool = True,
    where: list[str] | None = None,
    sd: str | None = "auto",
) -> Curve:
    """The one reader from logged rows (metrics.jsonl objects, CSV/JSONL rows) to a curve.

    `sd` names a column with each eval's known sampling sd ("auto": `eval_sampling_sd`, which
    this trainer logs, when y is `eval_pass_rate`; `eval_sampling_sd/<d>` for a mixture's
    domain `eval_pass_rate/<d>`); it is used when every point has it.

    Rows lacking x or y (training steps without an evaluation) are skipped. The R0 rule: rows
    at zero compute (a run's evaluation before any RL) are measurements of R0, which is their
    mean (None when there are none); rows with compute > 0 are the curve's points. With
    `clean`, the points go through `clean_curve` (errors and repairs); without, they are
    returned as logged, however few (the online forecast's history). `where` names each row
    in error messages (file:line).
    """
    where = where or [f"{name}: row {i + 1}" for i in range(len(rows))]
    if sd == "auto":
        # eval_pass_rate's is eval_sampling_sd; a domain's (eval_pass_rate/<d>) has its own
        prefix = "eval_pass_rate"
        sd = "eval_sampling_sd" + y[len(prefix) :] if y.startswith(prefix) else None
    cs, rs, steps, sds = [], [], [], []
    for loc, row in zip(where, rows, strict=True):
        cx, ry = _number(row.get(x), f"{loc}: {x}"), _number(row.get(y), f"{loc}: {y}")
        if cx is not None and ry is not None:
            cs.append(cx)
            rs.append(ry)
            steps.append(row.get("step", -1))
            sds.append(_number(row.get(sd), f"{loc}: {sd}") if sd else None)
    cs, rs, steps = np.array(cs, float), np.array(rs, float), np.array(steps)
    have = sum(v is not None and np.isfinite(v) for v in sds)
    known = bool(sds) and have == len(sds)
    if sd and 0 < have < len(sds):
        warnings.warn(
            f"{name}: {sd} is given for {have} of {len(sds)} evals; not used (the noise is "
            "estimated from the residuals instead)",
            CurveDataWarning,
            stacklevel=2,
        )
    sds = np.array(sds, float) if known else None
    at_zero = cs == 0
    r0 = float(rs[at_zero].mean()) if at_zero.any() else None
    r0_sd = None
    if known and at_zero.any():  # the sd of the step-0 evals' mean
        r0_sd = float(np.sqrt(np.sum(sds[at_zero] ** 2)) / at_zero.sum())
    cs, rs, steps = cs[~at_zero], rs[~at_zero], steps[~at_zero]
    sds = None if sds is None else sds[~at_zero]
    if not clean:
        return Curve(name, cs, rs, r0, steps, sds, r0_sd)
    curve = clean_curve(cs, rs, name=name, a_max=a_max, c_min=c_min, sd=sds)
    as_logged = curve.compute.size == cs.size and np.array_equal(curve.compute, cs)
    return dataclasses.replace(curve, r0=r0, steps=steps if as_logged else None, r0_sd=r0_sd)


def load_curve(
    path: str | Path,
    *,
    x: str = "compute_flops",
    y: str = "eval_pass_rate",
    a_max: float | None = 1.0,
    c_min: float | None = None,
) -> Curve:
    """Read one curve from a CSV file, a JSONL file or a run directory (its metrics.jsonl),
    by `curve_from_rows` (its R0 rule); a column that no row has is an error listing the
    columns that exist."""
    path = Path(path)
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.exists():
        raise CurveDataError(f"{file}: no such file")
    located = _rows(file)
    seen: set[str] = set()
    for _, row in located:
        seen.update(row)
    for col in (x, y):
        if col not in seen:
            raise CurveDataError(f"{file}: no column {col!r} (columns: {', '.join(sorted(seen))})")
    return curve_from_rows(
        [row for _, row in located],
        x=x,
        y=y,
        name=path.name if path.is_dir() else path.stem,
        a_max=a_max,
        c_min=c_min,
        where=[loc for loc, _ in located],
    )
