"""The feeders of pipeline.py with a fake producer and trainer (no model): PipelineRL's bound,
the lockstep swap point, the PPO-off-policy schedule, resumed batches."""

import dataclasses
import threading
import time

import jax
import numpy as np
import pytest

from jaxrl_scale.config import ConfigError, PipelineConfig
from jaxrl_scale.rl.buffer import oldest_version
from jaxrl_scale.rl.pipeline import (
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

    def produce(params_for_chunk, key, *, oldest):
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


def test_the_generator_thread_works_ahead_while_it_waits():
    """`idle` (an agent task's engine runs for the batch queued ahead) is called while the
    generator waits for room in the buffer and for the trainer, with the newest parameters
    each time; the bound still holds, and `stop` ends it."""
    calls = []  # (the trainer's published version then, the version idle got)
    published = [0]

    def idle(params_for_chunk):
        calls.append((published[0], params_for_chunk(0)[0]))
        time.sleep(0.002)
        return True

    source = ParamsSource(0, None)
    feeder = PipelineFeeder(_producer(0.002), source, jax.random.key(0), k=1, version=0,
                            idle=idle)  # fmt: skip
    try:
        for step in range(1, 4):
            batch = feeder.next()
            assert (step - 1) - int(batch.versions.min()) <= 1
            time.sleep(0.1)  # a slow train step: the generator waits, idle runs
            source.publish(step, None)
            published[0] = step
            feeder.trained(None, step)
    finally:
        feeder.stop()
    assert len(calls) >= 20 and not feeder.thread.is_alive()
    assert {got for _, got in calls} >= {1, 2}  # each time the newest published
    assert all(got >= seen for seen, got in calls)


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


def test_stop_abandons_the_batch_in_progress_and_counts_it():
    """A batch of 1,000 chunks (10 s) is being generated when the run stops: the generator
    halts at its next chunk, the thread ends at once, and the batch is counted as untrained."""
    started = threading.Event()

    def produce(params_for_chunk, key, *, oldest):
        versions = []
        for c in range(1000):
            versions.append(params_for_chunk(c)[0])
            started.set()
            time.sleep(0.01)
        return FakeBatch(np.array([versions]))

    feeder = PipelineFeeder(produce, ParamsSource(0, None), jax.random.key(0), k=1, version=0)
    assert started.wait(timeout=10)
    began = time.perf_counter()
    feeder.stop()
    assert time.perf_counter() - began < 2
    assert not feeder.thread.is_alive()
    assert feeder.untrained() == 1 and feeder.abandoned == 1


def test_a_resumed_generator_thread_samples_with_fresh_keys():
    """Batch keys are numbered from the run's first step: a run resumed at version 5 samples
    its first batch with the key the uninterrupted run used for its sixth, not its first."""

    def keys(version: int, steps: int) -> list[list[int]]:
        seen = []

        def produce(params_for_chunk, key, *, oldest):
            seen.append(jax.random.key_data(key).tolist())
            return FakeBatch(np.array([[params_for_chunk(0)[0]]]))

        source = ParamsSource(version, None)
        feeder = PipelineFeeder(produce, source, jax.random.key(0), k=1, version=version)
        try:
            for step in range(version + 1, version + steps + 1):
                feeder.next()
                feeder.trained(None, step)
        finally:
            feeder.stop()
        return seen

    whole, resumed = keys(0, 6), keys(5, 1)
    assert resumed[0] == whole[5] and resumed[0] not in whole[:5]


def test_lockstep_swaps_weights_at_the_middle_chunk():
    """Batch n + 1 is generated inside `trained(…, n)`: chunks before chunks / 2 with the
    version the step started from, the rest with the one it produced."""
    source = ParamsSource(0, None)
    feeder = LockstepFeeder(
        _producer(0, chunks=4), source, jax.random.key(0), chunks=4, start=0, pending=[]
    )
    seen = []
    assert not feeder.ready()  # the first batch is generated by next()
    for step in range(1, 5):
        seen.append(feeder.next().versions[0].tolist())
        feeder.trained(None, step)
    assert seen == [[0, 0, 0, 0], [0, 0, 1, 1], [1, 1, 2, 2], [2, 2, 3, 3]]
    assert len(feeder.pending) == 1 and feeder.ready()  # step 5's batch, kept by a checkpoint


def test_ppo_off_policy_generates_k_batches_per_policy():
    source = ParamsSource(0, None)
    feeder = SyncFeeder(
        _producer(0, chunks=1), source, jax.random.key(0), per_policy=3, round_=0, pending=[]
    )
    versions, ready = [], []
    for step in range(1, 8):
        ready.append(feeder.ready())
        versions.append(int(feeder.next().versions.min()))
        feeder.trained(None, step)
    assert versions == [0, 0, 0, 3, 3, 3, 6]
    assert ready == [False, True, True, False, True, True, False]  # a round starts: generate


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


def test_params_source_keeps_at_most_two_copies_where_the_generator_reads():
    """A version published and never handed to the generator is dropped before the next one
    is placed: placing sees only the generator's copy alive; and the source itself keeps no
    copy the generator has let go of."""
    import weakref

    from jaxrl_scale.rl.pipeline import ParamsSource

    class Copy:
        def __init__(self, version):
            self.version = version

    alive = weakref.WeakSet()
    seen = []  # copies alive while each version is placed

    def place(params):
        seen.append(len(alive))
        copy = Copy(params)
        alive.add(copy)
        return copy

    source = ParamsSource(0, 0, place=place)
    running = source.latest()  # the generator decodes with version 0
    source.publish(1, 1)  # never handed out
    source.publish(2, 2)  # placing 2: version 1 is gone, 0 is the generator's
    assert seen == [0, 1, 1] and running[0] == 0
    assert source.latest()[0] == 2 and len(alive) == 2  # 0 (still running) and 2
    del running  # the generator let go of 0: nothing keeps it
    assert len(alive) == 1
    source.publish(3, 3)  # 2 was handed out: it stays while 3 is placed, then goes
    assert seen[-1] == 1 and len(alive) == 1 and source.newest()[0] == 3


def test_a_reader_never_gets_a_version_older_than_one_published():
    """While a version is placed after an unpicked one was dropped, the generator waits for
    it instead of being handed its older copy: a batch that may start only once version 1
    was published never samples with 0 (the staleness bound)."""
    import threading

    from jaxrl_scale.rl.pipeline import ParamsSource

    placing, release = threading.Event(), threading.Event()

    def place(params):
        if params == 2:
            placing.set()
            release.wait(10)
        return params

    source = ParamsSource(0, 0, place=place)
    assert source.latest()[0] == 0  # the generator decodes with 0
    source.publish(1, 1)  # published (a batch needing >= 1 may start), not picked up
    trainer = threading.Thread(target=source.publish, args=(2, 2))
    trainer.start()
    assert placing.wait(10)
    got = []
    generator = threading.Thread(target=lambda: got.append(source.latest()[0]))
    generator.start()
    generator.join(0.3)
    assert generator.is_alive() and not got  # waiting for 2, not handed 0
    release.set()
    trainer.join(10)
    generator.join(10)
    assert got == [2] and not generator.is_alive()
