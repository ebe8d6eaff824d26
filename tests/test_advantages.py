import jax
import numpy as np
import pytest

from jaxrl_scale.rl.advantages import group_advantages

# Three prompts x four samples. Group 0: mean 0.5; group 1: all equal (no signal);
# group 2: mean 0.25.
REWARDS = np.array([1, 0, 1, 0, 1, 1, 1, 1, 0, 0, 0, 1], np.float32)
KEEP = [True] * 4 + [False] * 4 + [True] * 4


def test_none_is_group_centred_and_zero_variance_dropped():
    adv, keep = group_advantages(REWARDS, group_size=4, normalize="none")
    want = [0.5, -0.5, 0.5, -0.5, 0, 0, 0, 0, -0.25, -0.25, -0.25, 0.75]
    np.testing.assert_allclose(adv, want, atol=1e-7)
    np.testing.assert_array_equal(keep, KEEP)


def test_batch_normalisation_by_hand():
    # Kept advantages: 0.5, -0.5, 0.5, -0.5, -0.25, -0.25, -0.25, 0.75 (mean 0).
    # Population variance (4 * 0.25 + 3 * 0.0625 + 0.5625) / 8 = 1.75 / 8 = 0.21875,
    # std 0.4677072; the zero-variance group is excluded from it.
    adv, _ = group_advantages(REWARDS, group_size=4, normalize="batch")
    std = np.sqrt(0.21875) + 1e-6
    want = np.array([0.5, -0.5, 0.5, -0.5, 0, 0, 0, 0, -0.25, -0.25, -0.25, 0.75]) / std
    np.testing.assert_allclose(adv, want, rtol=1e-6)
    assert float(adv[0]) == pytest.approx(1.069045, abs=1e-5)


def test_prompt_normalisation_by_hand():
    # Group 0 std 0.5 -> +-1; group 2 std sqrt(0.25 * 0.75) = 0.4330127:
    # -0.25 / 0.4330127 = -0.5773503, 0.75 / 0.4330127 = 1.7320508.
    adv, _ = group_advantages(REWARDS, group_size=4, normalize="prompt")
    want = [1, -1, 1, -1, 0, 0, 0, 0, -0.5773503, -0.5773503, -0.5773503, 1.7320508]
    np.testing.assert_allclose(adv, want, atol=1e-5)


def test_rloo_baseline_by_hand():
    # Group 0: a 1 is compared with the others' mean (0 + 1 + 0) / 3 = 1/3 -> 2/3;
    # a 0 with (1 + 1 + 0) / 3 = 2/3 -> -2/3. Group 2: a 0 -> 0 - 1/3; the 1 -> 1 - 0.
    adv, keep = group_advantages(REWARDS, group_size=4, normalize="none", baseline="rloo")
    third = 1 / 3
    want = [2 * third, -2 * third] * 2 + [0] * 4 + [-third] * 3 + [1.0]
    np.testing.assert_allclose(adv, want, atol=1e-6)
    np.testing.assert_array_equal(keep, KEEP)


def test_all_groups_zero_variance_gives_zeros_not_nan():
    adv, keep = group_advantages(np.ones(8), group_size=4)
    assert not np.any(keep)
    np.testing.assert_array_equal(adv, np.zeros(8))


def test_jit_matches_eager_and_bad_arguments():
    f = jax.jit(group_advantages, static_argnames=("group_size", "normalize", "baseline"))
    np.testing.assert_allclose(f(REWARDS, group_size=4), group_advantages(REWARDS, 4), rtol=1e-6)
    with pytest.raises(ValueError, match="groups of 5"):
        group_advantages(REWARDS, group_size=5)
    with pytest.raises(ValueError, match="normalize"):
        group_advantages(REWARDS, group_size=4, normalize="group")


def test_rows_without_a_reward_are_left_out_of_their_group_by_hand():
    # Group 0: rows 1 and 3 have no reward (NaN: their environment failed); the others,
    # 1 and 0, give mean 0.5 -> +-0.5. Group 1: one reward left, nothing to compare: dropped.
    # Group 2: 0, 0, 1 of three -> mean 1/3: -1/3, -1/3, 2/3; population std sqrt(2)/3.
    nan = np.nan
    rewards = np.array([1, nan, 0, nan, nan, nan, 1, nan, 0, 0, nan, 1], np.float32)
    adv, keep = group_advantages(rewards, group_size=4, normalize="none")
    want = [0.5, 0, -0.5, 0, 0, 0, 0, 0, -1 / 3, -1 / 3, 0, 2 / 3]
    np.testing.assert_allclose(adv, want, atol=1e-6)
    assert list(np.asarray(keep)) == [True, False, True, False] + [False] * 4 + [
        True, True, False, True]  # fmt: skip
    adv, _ = group_advantages(rewards, group_size=4, normalize="prompt")
    np.testing.assert_allclose(adv[8:], np.array([-1, -1, 0, 2]) / np.sqrt(2), atol=1e-5)
    np.testing.assert_allclose(adv[:4], [1, 0, -1, 0], atol=1e-5)
    # Leave-one-out: group 2's 1 against the other two's mean 0 -> 1; a 0 against 0.5 -> -0.5.
    adv, _ = group_advantages(rewards, group_size=4, normalize="none", baseline="rloo")
    np.testing.assert_allclose(adv[8:], [-0.5, -0.5, 0, 1], atol=1e-6)
    assert np.isfinite(np.asarray(adv)).all()
