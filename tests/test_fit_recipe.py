"""The recipe's ceiling across seeds, against numbers worked by hand."""

import math

import numpy as np
import pytest

from jaxrl_scale.fit.recipe import compare_ceilings, recipe_ceiling

Z = 1.959963984540054  # the normal 97.5% quantile
T2 = 4.302652729911275  # Student t, 2 degrees of freedom, 97.5% quantile (tables)


def test_three_seeds_by_hand():
    # The seeds' ceilings have sample variance (0.02^2 + 0 + 0.02^2) / 2 = 4e-4, so
    # se = sqrt(4e-4 / 3) = 0.011547 and the interval is 0.82 +- 4.3027 * 0.011547.
    r = recipe_ceiling("x", [0.80, 0.82, 0.84], [[0.78, 0.82], [0.80, 0.84], [0.82, 0.86]])
    assert r.a == pytest.approx(0.82)
    assert r.se == pytest.approx(math.sqrt(4e-4 / 3))
    assert r.ci == pytest.approx((0.82 - T2 * 0.0115470, 0.82 + T2 * 0.0115470), abs=1e-6)
    assert r.between_sd == pytest.approx(0.02)


def test_one_seed_has_no_recipe_interval_and_bad_input_is_named():
    r = recipe_ceiling("solo", [0.7], [[0.65, 0.75]])
    assert r.seeds == 1 and all(math.isnan(v) for v in r.ci)
    assert r.se == pytest.approx(0.05 / Z)  # the run's own standard error
    d = compare_ceilings(r, r)
    assert "2 or more seeds" in d.verdict
    with pytest.raises(ValueError, match="bad: need one interval per seed"):
        recipe_ceiling("bad", [0.7, 0.8], [[0.6, 0.8]])
    with pytest.raises(ValueError, match="not finite"):
        recipe_ceiling("nan", [0.7, np.nan], [[0.6, 0.8], [0.6, 0.8]])


def test_difference_interval_welch_by_hand():
    first = recipe_ceiling("a", [0.80, 0.82, 0.84], [[0.79, 0.81], [0.81, 0.83], [0.83, 0.85]])
    second = recipe_ceiling("b", [0.70, 0.72, 0.74], [[0.69, 0.71], [0.71, 0.73], [0.73, 0.75]])
    # Equal se (sqrt(4e-4 / 3)) and seeds: Welch's degrees of freedom are 2 (S - 1) = 4, so the
    # interval is 0.1 +- t4 * sqrt(2 * 4e-4 / 3), t4 = 2.776445 (tables).
    d = compare_ceilings(first, second)
    half = 2.7764451051977987 * math.sqrt(2 * 4e-4 / 3)
    assert d.diff == pytest.approx(0.1)
    assert d.ci == pytest.approx((0.1 - half, 0.1 + half), abs=1e-6)
    assert d.verdict == "a"
    assert compare_ceilings(second, first).verdict == "a"
    close = recipe_ceiling("c", [0.79, 0.83], [[0.78, 0.80], [0.82, 0.84]])
    assert compare_ceilings(first, close).verdict == "indistinguishable"


def test_seeds_that_all_agree_give_a_point_interval_not_an_error():
    same = recipe_ceiling("s", [0.5, 0.5], [[0.4, 0.6], [0.4, 0.6]])
    assert same.ci == (0.5, 0.5)
    other = recipe_ceiling("o", [0.7, 0.7], [[0.6, 0.8], [0.6, 0.8]])
    d = compare_ceilings(other, same)
    assert d.ci == pytest.approx((0.2, 0.2)) and d.verdict == "o"
