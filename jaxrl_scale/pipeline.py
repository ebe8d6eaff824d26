"""How rollouts reach the trainer: the three modes, behind one `next()` / `stop()` interface.

- `sync` (k = 0): generate one batch with the current parameters, train on it, repeat.
- `ppo_off_policy`: generate k batches with one set of parameters, then take k steps on them.
- `pipeline_rl` (PipelineRL-k): a generator thread samples continuously into a
  `RolloutBuffer`; the trainer publishes parameters after every step and the generator picks
  them up between decode chunks (in flight), so one completion may carry several versions.
  As in PipelineRL, the side that is ahead waits: the generator starts batch n only once the
  trainer has published n - k updates, so no batch arrives more than k versions old and none
  is generated only to be thrown away.

A producer is `rollouts(params_source, key) -> batch` where `params_source()` returns the newest
(version, params) and the batch has a `versions` array (per-token policy version, -1 if none).

Every feeder has `next()` (the batch to train on) and `trained(state)`, called as soon as the
train step on that batch is dispatched (before its result is read), `take_dropped()` (batches
generated but never to be trained on, for the run to count and charge), and `stop()`. In
`pipeline_rl` with `lockstep` (always so across processes) there is no generator thread: the
next batch is generated inside `trained`, on the generator's devices, while the dispatched step
runs on the trainer's.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import jax

from jaxrl_scale.buffer import RolloutBuffer

Producer = Callable[[Callable[[], tuple[int, Any]], jax.Array], Any]


class ParamsSource:
    """The newest published parameters and their version, read by the generator. `place` puts
    a published (version, params) where the generator reads them (a copy, or another device
    set); the version is an int, or a device scalar that has not been read yet."""

    def __init__(
        self, version, params, *, place: Callable[[Any, Any], tuple] = lambda v, p: (v, p)
    ):
        self._lock = threading.Lock()
        self._place = place
        self.publish(version, params)

    def publish(self, version, params) -> None:
        latest = self._place(version, params)
        with self._lock:
            self._latest = latest

    def __call__(self) -> tuple[int, Any]:
        with self._lock:
            return self._latest


class SyncFeeder:
    """sync: one batch per policy version; ppo_off_policy: `per_policy` batches per version.
    Batch keys depend only on the round, so a run is reproducible; `pending` (the batches of
    the current round not yet trained on) is what a checkpoint must keep to resume exactly."""

    def __init__(
        self, produce: Producer, source: ParamsSource, key, *, per_policy: int, round_, pending
    ):
        self.produce, self.source, self.key = produce, source, key
        self.per_policy, self.round = per_policy, round_
        self.pending: list[Any] = list(pending)

    def trained(self, state) -> None:
        self.source.publish(int(state.step), state.params)

    def take_dropped(self) -> list[Any]:
        return []

    def next(self) -> Any:
        if not self.pending:
            version, params = self.source()
            frozen = lambda: (version, params)  # noqa: E731
            for i in range(self.per_policy):
                key = jax.random.fold_in(self.key, self.round * self.per_policy + i)
                self.pending.append(self.produce(frozen, key))
            self.round += 1
        return self.pending.pop(0)

    def stop(self) -> None:
        pass


class PipelineFeeder:
    """pipeline_rl: a generator thread fills a buffer from the newest published parameters.

    The staleness bound is kept by making the side that is ahead wait: batch n (counting from
    0 in this feeder) is the (n + 1)-th the trainer takes, after n updates, so its oldest token
    is at most k versions old if it starts with the parameters of update n - k or later. The
    generator therefore waits until `trained` has published n - k updates before it starts
    batch n; the trainer waits on an empty buffer. The buffer still drops (and keeps for
    `take_dropped`) anything staler, which this schedule never produces."""

    def __init__(
        self, produce: Producer, source: ParamsSource, key, *, k: int, version: Callable[[], int]
    ):
        self.produce, self.source, self.key, self.version = produce, source, key, version
        self.k = k
        self.buffer = RolloutBuffer(k)
        # Updates published so far: written by the trainer thread (`trained`), waited on by
        # the generator thread, so it lives behind the condition's lock.
        self._published = 0
        self._progress = threading.Condition()
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._run, name="generator", daemon=True)
        self.thread.start()

    @property
    def dropped(self) -> int:
        return self.buffer.dropped

    def _wait_for_update(self, n: int) -> bool:
        """Block until n updates have been published (False if halted meanwhile)."""
        with self._progress:
            while self._published < n:
                if self.halt.is_set():
                    return False
                self._progress.wait(timeout=0.1)
        return not self.halt.is_set()

    def _run(self) -> None:
        n = 0
        try:
            while self._wait_for_update(n - self.k):
                batch = self.produce(self.source, jax.random.fold_in(self.key, 2**20 + n))
                n += 1
                if not self.buffer.put(batch, batch.versions, halt=self.halt):
                    return
        except BaseException as e:  # surfaced in the trainer thread
            self.buffer.put_error(e)

    def next(self) -> Any:
        return self.buffer.get(self.version())

    def take_dropped(self) -> list[Any]:
        return self.buffer.take_dropped()

    def trained(self, state) -> None:
        self.source.publish(int(state.step), state.params)
        with self._progress:
            self._published += 1
            self._progress.notify_all()

    def stop(self) -> None:
        self.halt.set()
        self.thread.join(timeout=60)


class LockstepFeeder:
    """pipeline_rl from one thread, in an order fixed in advance (so every process issues the
    same programs in the same order). While the trainer's step v -> v + 1 runs (dispatched,
    not yet finished), the next batch is generated: its first half of decode chunks with
    version v, which is already on the generator, its second half with v + 1, pushed as soon
    as the step was dispatched (an in-flight update; the generator waits for the step only if
    it gets there first). The generator is one batch ahead, so staleness is at most 1."""

    def __init__(
        self, produce: Producer, source: ParamsSource, key, *, chunks: int, start: int, pending
    ):
        """`start` numbers the next batch generated (its key); `pending` holds the batch already
        generated for the next step, if any (a resumed run's)."""
        self.produce, self.source, self.key = produce, source, key
        self.swap_after = -(-chunks // 2)  # params_source() calls that still get the old version
        self.n = start
        self.pending: list[Any] = list(pending)

    def _produce(self, params_source) -> Any:
        batch = self.produce(params_source, jax.random.fold_in(self.key, 2**20 + self.n))
        self.n += 1
        return batch

    def take_dropped(self) -> list[Any]:
        return []

    def next(self) -> Any:
        if not self.pending:  # the first batch: nothing to overlap it with
            self.pending = [self._produce(self.source)]
        return self.pending.pop(0)

    def trained(self, state) -> None:
        old = self.source()
        self.source.publish(state.step, state.params)  # the version stays on the device
        new = self.source()
        calls = itertools.count(1)
        self.pending = [self._produce(lambda: old if next(calls) <= self.swap_after else new)]

    def stop(self) -> None:
        pass
