"""The feeders of pipeline.py with a fake producer and trainer (no model): PipelineRL's bound,
the lockstep swap point, the PPO-off-policy schedule, resumed batches."""

import dataclasses
import time

import jax
import numpy as np
import pytest

from jaxrl_scale.buffer import oldest_version
from jaxrl_scale.config import ConfigError, PipelineConfig
from jaxrl_scale.pipeline import (
    LockstepFeeder,
    ParamsSource,
    PipelineFeeder,
    SyncFeeder,
    make_feeder,
)


@dataclasses.dataclass
class FakeBatch:
    versions: np.ndarray  # [2 rows, chunks]: the version that decoded each chunk


def _producer(seconds: float, chunks: int = 2):
    """Each chunk asks for its parameters by index (in-flight swaps) and takes `seconds` /
    chunks; the batch records which version decoded which chunk."""

    def produce(params_for_chunk, key):
        versions = []
        for c in range(chunks):
            version, _ = params_for_chunk(c)
            time.sleep(seconds / chunks)
            versions.append(version)
        return FakeBatch(np.array([versions, versions]))

    return produce


@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_fast_generator_waits_instead_of_wasting_batches(k):
    """The generator is 5x faster than the trainer: it runs k versions ahead, never further,
    and no batch is generated only to be dropped. A feeder that never ran ahead (or ran
    further) fails the lag assertions."""
    feeder = PipelineFeeder(
        _producer(0.004), ParamsSource(0, None), jax.random.key(0), k=k, version=0
    )
    lags = []
    try:
        for step in range(1, 6 * k + 7):
            batch = feeder.next()
            lags.append((step - 1) - int(batch.versions.min()))
            time.sleep(0.02)  # the train step
            feeder.trained(None, step)
    finally:
        feeder.stop()
    assert feeder.take_dropped() == []
    assert max(lags) <= k
    assert lags[-1] == k and lags.count(k) >= 3  # it does run ahead by the full bound
    assert not feeder.thread.is_alive()


def test_a_resumed_generator_thread_counts_versions_from_the_restored_step():
    feeder = PipelineFeeder(
        _producer(0.002), ParamsSource(7, None), jax.random.key(0), k=1, version=7
    )
    try:
        assert int(feeder.next().versions.min()) == 7
        feeder.trained(None, 8)
        assert int(feeder.next().versions.min()) >= 7  # at most one behind version 8
    finally:
        feeder.stop()
    assert feeder.take_dropped() == []


def test_lockstep_swaps_weights_at_the_middle_chunk():
    """Batch n + 1 is generated inside `trained(…, n)`: chunks before chunks / 2 with the
    version the step started from, the rest with the one it produced."""
    source = ParamsSource(0, None)
    feeder = LockstepFeeder(
        _producer(0, chunks=4), source, jax.random.key(0), chunks=4, start=0, pending=[]
    )
    seen = []
    for step in range(1, 5):
        seen.append(feeder.next().versions[0].tolist())
        feeder.trained(None, step)
    assert seen == [[0, 0, 0, 0], [0, 0, 1, 1], [1, 1, 2, 2], [2, 2, 3, 3]]
    assert len(feeder.pending) == 1  # the batch for step 5, which a checkpoint keeps


def test_ppo_off_policy_generates_k_batches_per_policy():
    source = ParamsSource(0, None)
    feeder = SyncFeeder(
        _producer(0, chunks=1), source, jax.random.key(0), per_policy=3, round_=0, pending=[]
    )
    versions = []
    for step in range(1, 8):
        versions.append(int(feeder.next().versions.min()))
        feeder.trained(None, step)
    assert versions == [0, 0, 0, 3, 3, 3, 6]


def test_params_source_places_what_is_published():
    source = ParamsSource(0, 1, place=lambda p: p * 10)
    assert source.latest() == (0, 10)
    source.publish(3, 2)
    assert source.latest() == (3, 20)


def _resumed(*oldest):
    return [FakeBatch(np.array([[v, v + 1], [v, -1]])) for v in oldest]


def test_make_feeder_uses_resumed_batches_and_counts_the_stale_ones():
    cfg = PipelineConfig(mode="ppo_off_policy", max_staleness=2)
    feeder = make_feeder(
        cfg,
        _producer(0, chunks=1),
        ParamsSource(10, None),
        jax.random.key(0),
        version=10,
        chunks=1,
        resumed=_resumed(9, 7),  # 1 behind (kept), 3 behind (staler than k = 2)
    )
    assert oldest_version(feeder.next().versions) == 9
    assert [oldest_version(b.versions) for b in feeder.take_dropped()] == [7]
    assert feeder.take_dropped() == []  # handed over once


def test_make_feeder_picks_the_mode():
    produce, key = _producer(0, chunks=1), jax.random.key(0)
    make = lambda **kw: make_feeder(  # noqa: E731
        PipelineConfig(**kw), produce, ParamsSource(0, None), key, version=0, chunks=2
    )
    assert isinstance(make(mode="sync"), SyncFeeder)
    assert isinstance(make(mode="pipeline_rl", lockstep=True), LockstepFeeder)
    threaded = make(mode="pipeline_rl")
    threaded.stop()
    assert isinstance(threaded, PipelineFeeder) and threaded.pending == []
    with pytest.raises(ConfigError, match="pipeline.max_staleness"):
        make(mode="pipeline_rl", lockstep=True, max_staleness=0)
    # Across processes pipeline_rl always runs in lockstep.
    multi = make_feeder(
        PipelineConfig(mode="pipeline_rl"),
        produce,
        ParamsSource(0, None),
        key,
        version=0,
        chunks=2,
        multiprocess=True,
    )
    assert isinstance(multi, LockstepFeeder)
