"""Scaling-curve figure: data, fitted sigmoid, bootstrap band, extrapolated part dashed."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import NullFormatter

from jaxrl_scale.fit.bootstrap import BootstrapResult
from jaxrl_scale.fit.data import Curve

# Tick series for an axis showing fewer than two powers of ten, coarsest first: the first to
# give three ticks is used.
MANTISSAS = ((1.0,), (1.0, 2.0, 5.0), tuple(range(1, 10)), tuple(np.arange(1.0, 10.0, 0.5)))


def plot_fits(
    entries: list[tuple[Curve, BootstrapResult, float | None]],
    path: str | Path,
    *,
    predict_at: float | None = None,
    xlabel: str = "compute",
    ylabel: str = "reward",
) -> Path:
    """`draw_fits` saved as one PNG."""
    fig = draw_fits(entries, predict_at=predict_at, xlabel=xlabel, ylabel=ylabel)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def draw_fits(
    entries: list[tuple[Curve, BootstrapResult, float | None]],
    *,
    predict_at: float | None = None,
    xlabel: str = "compute",
    ylabel: str = "reward",
) -> Figure:
    """The figure with every run: (curve, bootstrap, c_cut or None) per entry.

    Points used by the fit are filled, held-out points hollow; the curve is solid over the
    fitted range and dashed beyond it, with the bootstrap interval as a band. Runs with a
    measurement at zero compute get it in a narrow panel left of the log axis (see `_draw_r0`).
    A bare Figure, not pyplot's: nothing to close, no backend to choose.
    """
    with_r0 = [
        (i, curve, boot) for i, (curve, boot, _) in enumerate(entries) if curve.r0 is not None
    ]
    if with_r0:
        fig = Figure(figsize=(7.5, 4.5), dpi=120)
        r0_ax, ax = fig.subplots(1, 2, sharey=True, width_ratios=(1, 12))
    else:
        fig = Figure(figsize=(7, 4.5), dpi=120)
        ax = fig.subplots()
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
        if boot.on_level:  # no rise: the level (mid) and its band, the model drawn
            lo_mu, hi_mu = boot.flat.interval
            label = f"{curve.name}: level {boot.flat.mean:.3f} [{lo_mu:.3f}, {hi_mu:.3f}], no rise"
        if boot.a_lower is not None:  # bounded below only: the bound, drawn as a floor
            label = f"{curve.name}: A >= {boot.a_lower:.3f} (one-sided, {boot.level:.0%})"
            if boot.on_level:
                label += f", level {boot.flat.mean:.3f}"
            ax.axhline(boot.a_lower, color=color, linestyle=(0, (1, 3)), linewidth=1.2)
            ax.annotate("ceiling >=", (grid[-1], boot.a_lower), color=color, fontsize=7,
                        ha="right", va="bottom")  # fmt: skip
        ax.plot(grid[inside], mid[inside], color=color, label=label)
        ax.plot(grid[~inside], mid[~inside], color=color, linestyle="--")
        ax.fill_between(grid, lo, hi, color=color, alpha=0.15, linewidth=0)
        if c_cut is not None:
            ax.axvline(c_cut, color=color, linestyle=":", linewidth=1)
    if predict_at is not None:
        ax.axvline(predict_at, color="gray", linestyle="-.", linewidth=1)
    ax.set_xscale("log")
    _label_log_axis(ax, xlabel)
    handles = ax.get_legend_handles_labels()[0]
    if with_r0:
        handles += _draw_r0(r0_ax, ax, with_r0)
    fig.axes[0].set_ylabel(ylabel)  # the leftmost panel
    ax.legend(handles=handles, fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout(w_pad=0.3)
    return fig


def _label_log_axis(ax, xlabel: str) -> None:
    """Tick labels that cannot collide. Left alone, matplotlib labels minor ticks (3x10^11,
    4x10^11, ...) whenever few decades show, and at about 1.3 decades they run into each other.
    Two or more powers of ten in view: label those only. Fewer: plain multiples of one 10^k,
    named in the axis label, along the coarsest series in MANTISSAS that gives three ticks."""
    lo, hi = ax.get_xlim()
    ax.set_xlim(lo, hi)  # the ticks chosen below are for these limits
    ax.xaxis.set_minor_formatter(NullFormatter())
    first, last = math.floor(math.log10(lo)), math.floor(math.log10(hi))
    powers = last - math.ceil(math.log10(lo)) + 1  # powers of ten in view
    if powers >= 2:
        ax.set_xlabel(xlabel)
        return
    for mantissas in MANTISSAS:
        ticks = [m * 10.0**e for e in range(first, last + 1) for m in mantissas]
        ticks = [t for t in ticks if lo <= t <= hi]
        if len(ticks) >= 3:
            break
    k = math.floor(math.log10(ticks[0]))
    ax.set_xticks(ticks, [f"{t / 10.0**k:g}" for t in ticks])
    ax.set_xlabel(f"{xlabel} (×$10^{{{k}}}$)")


def _draw_r0(r0_ax, ax, with_r0: list[tuple[int, Curve, BootstrapResult]]) -> list:
    """Zero compute has no place on a log axis, so R0 gets a panel of its own at C = 0, broken
    off the compute axis: the observed value (the step-0 eval) filled like the data, the fit's
    R0 as a dash on its bootstrap interval (none when R0 was held). Returns legend entries."""
    xs = np.linspace(-0.4, 0.4, len(with_r0)) if len(with_r0) > 1 else [0.0]
    for x, (i, curve, boot) in zip(xs, with_r0, strict=True):
        r0_ax.scatter([x], [curve.r0], s=14, color=f"C{i}", zorder=3, gid="r0_observed")
        r0_ax.plot(
            [x], [float(boot.fit.r0)], marker="_", markersize=10, color=f"C{i}", gid="r0_fit"
        )
    r0_ax.set_ylim(r0_ax.get_ylim())  # a loose interval runs off the panel, not squashes it
    for x, (i, _, boot) in zip(xs, with_r0, strict=True):
        r0_ax.vlines(x, *boot.ci["r0"], color=f"C{i}", linewidth=1)
    r0_ax.set_xlim(-1, 1)
    r0_ax.set_xticks([0], ["0"])
    r0_ax.grid(axis="y", alpha=0.3)
    r0_ax.spines["right"].set_visible(False)
    ax.spines["left"].set_visible(False)
    ax.tick_params(axis="y", left=False)
    # The break: slanted strokes where the two x axes stop (matplotlib's broken-axis marks).
    mark = dict(marker=[(-1, -2), (1, 2)], markersize=8, linestyle="none", color="k", clip_on=False)
    r0_ax.plot([1, 1], [0, 1], transform=r0_ax.transAxes, **mark)
    ax.plot([0, 0], [0, 1], transform=ax.transAxes, **mark)
    key = dict(color="gray", linestyle="none")
    return [
        Line2D([], [], marker="o", markersize=4, label="R0 observed (C = 0)", **key),
        Line2D([], [], marker="_", markersize=10, label="R0 in the fit", **key),
    ]
