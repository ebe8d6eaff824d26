"""The scaling-curve figure: x tick labels that never overlap, and R0 shown at zero compute."""

import numpy as np
import pytest

from jaxrl_scale.fit import bootstrap_sigmoid, sigmoid
from jaxrl_scale.fit.data import Curve
from jaxrl_scale.fit.plot import draw_fits, plot_fits


def _entry(name, lo, hi, *, r0=None, held_r0=None, c_cut=None, seed=0):
    """A noisy sigmoid run over [lo, hi] compute and its bootstrap fit (up to c_cut)."""
    c = np.geomspace(lo, hi, 10)
    rng = np.random.default_rng(seed)
    y = np.asarray(sigmoid(c, a=0.6, b=1.2, c_mid=np.sqrt(lo * hi), r0=0.1))
    y = y + 0.005 * rng.standard_normal(c.size)
    keep = c <= (c_cut or np.inf)
    boot = bootstrap_sigmoid(c[keep], y[keep], n=64, r0=held_r0)
    return Curve(name, c, y, r0=r0), boot, c_cut


def _tick_labels(fig):
    """The x tick labels a reader sees: with text, visible, inside their axis's limits."""
    fig.draw_without_rendering()
    labels = []
    for ax in fig.axes:
        lo, hi = ax.get_xlim()
        labels += [
            t
            for t in ax.get_xticklabels(which="both")
            if t.get_visible() and t.get_text() and lo <= t.get_position()[0] <= hi
        ]
    return [(t.get_text(), t.get_window_extent()) for t in labels]


@pytest.mark.parametrize(
    "runs, predict_at",
    [
        ([dict(lo=3e11, hi=9e11)], None),  # under a decade
        ([dict(lo=3e11, hi=9e11, r0=0.1, held_r0=0.1)], 4.5e12),  # the axis: 1.4 decades
        ([dict(lo=1e10, hi=1e13), dict(lo=1e10, hi=1e13, c_cut=1e12, seed=1)], None),
    ],
    ids=["under-a-decade", "predict-at-1.4-decades", "three-decades"],
)
def test_x_tick_labels_do_not_overlap(runs, predict_at):
    entries = [_entry(f"run{i}", **run) for i, run in enumerate(runs)]
    labels = _tick_labels(draw_fits(entries, predict_at=predict_at))
    assert len(labels) >= 3, [text for text, _ in labels]
    for i, (text, box) in enumerate(labels):
        for other, other_box in labels[i + 1 :]:
            assert not box.overlaps(other_box), (text, other)


def _r0_artists(fig, gid):
    return [a for ax in fig.axes for a in ax.get_children() if a.get_gid() == gid]


def test_r0_drawn_at_zero_compute_observed_and_fitted():
    """An R0 held apart from the observed one (`--r0`): both are shown, each at its value."""
    entry = _entry("run", 3e11, 9e11, r0=0.1, held_r0=0.08)
    fig = draw_fits([entry])
    (observed,) = _r0_artists(fig, "r0_observed")
    np.testing.assert_allclose(observed.get_offsets()[:, 1], [0.1])
    (fitted,) = _r0_artists(fig, "r0_fit")
    np.testing.assert_allclose(fitted.get_ydata(), [0.08])
    assert observed.axes is fitted.axes is fig.axes[0]
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["0"]


def test_no_r0_no_marker(tmp_path):
    fig = draw_fits([_entry("run", 3e11, 9e11)])
    assert len(fig.axes) == 1
    assert not _r0_artists(fig, "r0_observed") and not _r0_artists(fig, "r0_fit")
    assert plot_fits([_entry("run", 3e11, 9e11)], tmp_path / "fit.png").stat().st_size > 0
