"""The feeders of pipeline.py with a fake producer and trainer (no model): PipelineRL's bound."""

import dataclasses
import time

import jax
import numpy as np
import pytest

from jaxrl_scale.pipeline import ParamsSource, PipelineFeeder


@dataclasses.dataclass
class FakeBatch:
    versions: np.ndarray


@dataclasses.dataclass
class FakeState:
    step: int
    params: object = None


def _producer(seconds: float):
    """Two decode chunks per batch, each reading the newest parameters (in-flight swaps)."""

    def produce(params_source, key):
        versions = []
        for _ in range(2):
            version, _ = params_source()
            time.sleep(seconds / 2)
            versions.append(version)
        return FakeBatch(np.array([versions, versions]))

    return produce


@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_fast_generator_waits_instead_of_wasting_batches(k):
    """The generator is 5x faster than the trainer: it runs k versions ahead, never further,
    and no batch is generated only to be dropped."""
    state = FakeState(step=0)
    source = ParamsSource(0, None)
    feeder = PipelineFeeder(
        _producer(0.004), source, jax.random.key(0), k=k, version=lambda: state.step
    )
    lags = []
    try:
        for _ in range(6 * k + 6):
            batch = feeder.next()
            lags.append(state.step - int(batch.versions.min()))
            time.sleep(0.02)  # the train step
            state = FakeState(step=state.step + 1)
            feeder.trained(state)
    finally:
        feeder.stop()
    assert feeder.dropped == 0 and feeder.take_dropped() == []
    assert max(lags) <= k
    assert lags[-1] == k and lags.count(k) >= 3  # it does run ahead by the full bound
    assert not feeder.thread.is_alive()


def test_a_skipped_update_does_not_stall_the_generator():
    """The gate counts published updates, not policy versions: a step whose update was
    skipped (non-finite) still lets the generator go on."""
    source = ParamsSource(0, None)
    feeder = PipelineFeeder(_producer(0.002), source, jax.random.key(0), k=1, version=lambda: 0)
    try:
        for _ in range(5):
            batch = feeder.next()
            assert int(batch.versions.max()) == 0
            feeder.trained(FakeState(step=0))  # version stays 0
    finally:
        feeder.stop()
    assert feeder.dropped == 0
