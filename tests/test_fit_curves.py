import numpy as np
import pytest

from jaxrl_scale.fit import power_law, sigmoid

PAPER = dict(a=0.610, b=1.92, c_mid=2542.0, r0=0.30)  # ScaleRL 8B


def test_sigmoid_worked_values_from_scalerl():
    # R(C) = 0.30 + 0.31 / (1 + (2542 / C) ** 1.92), values from SCALERL.md section 1.
    got = np.asarray(sigmoid(np.array([500.0, 8000.0, 100000.0]), **PAPER))
    np.testing.assert_allclose(got, [0.313083, 0.579112, 0.609732], atol=1e-6)


def test_sigmoid_by_hand_at_twice_the_midpoint():
    # (C_mid / C) ** B = 0.5 ** 2 = 0.25 -> R = 0.2 + (0.8 - 0.2) / 1.25 = 0.68
    assert float(sigmoid(200.0, 0.8, 2.0, 100.0, 0.2)) == pytest.approx(0.68, abs=1e-6)


def test_sigmoid_midpoint_and_limits():
    assert float(sigmoid(PAPER["c_mid"], **PAPER)) == pytest.approx((0.30 + 0.610) / 2, abs=1e-6)
    assert float(sigmoid(1e-6, **PAPER)) == pytest.approx(0.30, abs=1e-6)
    assert float(sigmoid(1e12, **PAPER)) == pytest.approx(0.610, abs=1e-6)
    # No overflow where (C_mid / C) ** B is astronomically large.
    assert np.isfinite(float(sigmoid(1e-30, **PAPER)))


def test_power_law_by_hand():
    # 0.7 - 0.9 * 100 ** -0.5 = 0.7 - 0.09 = 0.61
    assert float(power_law(100.0, 0.7, 0.9, 0.5)) == pytest.approx(0.61, abs=1e-6)
