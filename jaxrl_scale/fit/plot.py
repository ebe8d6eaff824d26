"""Scaling-curve figure: data, fitted sigmoid, bootstrap band, extrapolated part dashed."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxrl_scale.fit.bootstrap import BootstrapResult
from jaxrl_scale.fit.data import Curve


def plot_fits(
    entries: list[tuple[Curve, BootstrapResult, float | None]],
    path: str | Path,
    *,
    predict_at: float | None = None,
    xlabel: str = "compute",
    ylabel: str = "reward",
) -> Path:
    """One PNG with every run: (curve, bootstrap, c_cut or None) per entry.

    Points used by the fit are filled, held-out points hollow; the curve is solid over the
    fitted range and dashed beyond it, with the bootstrap interval as a band.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    c_hi = max([float(curve.compute[-1]) for curve, _, _ in entries] + [predict_at or 0.0])
    for i, (curve, boot, c_cut) in enumerate(entries):
        color = f"C{i}"
        fitted = curve.compute <= (c_cut if c_cut is not None else np.inf)
        ax.scatter(curve.compute[fitted], curve.reward[fitted], s=14, color=color, zorder=3)
        ax.scatter(
            curve.compute[~fitted],
            curve.reward[~fitted],
            s=14,
            facecolors="none",
            edgecolors=color,
            zorder=3,
        )
        c_fit_end = float(curve.compute[fitted][-1])
        grid = np.geomspace(float(curve.compute[0]), c_hi * 1.5, 200)
        lo, mid, hi = (np.asarray(v) for v in boot.predict_ci(grid))
        inside = grid <= c_fit_end
        a_lo, a_hi = boot.ci["a"]
        label = f"{curve.name}: A={float(boot.fit.a):.3f} [{a_lo:.3f}, {a_hi:.3f}]"
        ax.plot(grid[inside], mid[inside], color=color, label=label)
        ax.plot(grid[~inside], mid[~inside], color=color, linestyle="--")
        ax.fill_between(grid, lo, hi, color=color, alpha=0.15, linewidth=0)
        if c_cut is not None:
            ax.axvline(c_cut, color=color, linestyle=":", linewidth=1)
    if predict_at is not None:
        ax.axvline(predict_at, color="gray", linestyle="-.", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
