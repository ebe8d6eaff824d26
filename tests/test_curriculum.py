"""Prompt sampling: epochs over a shuffled pool, No-Positive-Resampling, snapshots."""

import numpy as np
import pytest

from jaxrl_scale.rl.curriculum import Curriculum


def test_each_epoch_visits_every_prompt_once_in_a_seeded_order():
    a, b = Curriculum(12, seed=1), Curriculum(12, seed=1)
    first = np.concatenate([a.next_batch(4) for _ in range(3)])
    assert sorted(first.tolist()) == list(range(12)) and a.epoch == 0
    second = np.concatenate([a.next_batch(4) for _ in range(3)])
    assert sorted(second.tolist()) == list(range(12)) and a.epoch == 1
    assert first.tolist() != second.tolist()  # reshuffled
    assert np.concatenate([b.next_batch(6) for _ in range(2)]).tolist() == first.tolist()
    assert Curriculum(12, seed=2).next_batch(12).tolist() != first.tolist()


def test_a_prompt_at_the_threshold_is_retired_and_never_drawn_again():
    c = Curriculum(8, seed=0, retire_threshold=0.9)
    picked = c.next_batch(4)
    c.update(picked, [1.0, 0.9, 0.89, 0.0])
    assert c.retired[picked].tolist() == [True, True, False, False] and c.active == 6
    drawn = np.concatenate([c.next_batch(3) for _ in range(10)])
    assert not set(drawn.tolist()) & set(picked[:2].tolist())
    off = Curriculum(8, seed=0, no_positive_resampling=False)
    off.update(off.next_batch(4), [1.0] * 4)
    assert off.active == 8 and not np.isnan(off.pass_rate).all()


def test_too_few_active_prompts_is_an_error_naming_the_fix():
    c = Curriculum(4, seed=0)
    c.update(np.arange(3), [1.0] * 3)
    with pytest.raises(RuntimeError, match="curriculum.retire_threshold"):
        c.next_batch(2)


def test_a_snapshot_is_a_copy_and_restores_the_same_draws():
    c = Curriculum(10, seed=3)
    c.update(c.next_batch(4), [1.0, 0.0, 0.5, 0.25])
    snapshot = c.state_dict()
    before = {k: np.copy(v) for k, v in snapshot.items()}
    later = [c.next_batch(4).tolist() for _ in range(4)]  # crosses an epoch
    c.update(np.arange(10), np.ones(10))
    for k, v in snapshot.items():  # the live object moved on; the snapshot did not
        np.testing.assert_array_equal(v, before[k])
    restored = Curriculum(10, seed=3)
    restored.load_state_dict(snapshot)
    assert [restored.next_batch(4).tolist() for _ in range(4)] == later
    with pytest.raises(ValueError, match="for 10 prompts, not 7"):
        Curriculum(7, seed=3).load_state_dict(snapshot)


def test_a_group_with_no_pass_rate_keeps_what_was_known():
    c = Curriculum(4, seed=0, retire_threshold=0.9)
    c.update([0, 1], [0.5, 1.0])
    c.update([0, 1], [np.nan, np.nan])  # no episode of either group could be trained
    assert c.pass_rate[0] == 0.5 and c.pass_rate[1] == 1.0 and c.retired[1]
