"""How rollouts reach the trainer: the three modes, behind one small interface.

- `sync` (k = 0): generate one batch with the current parameters, train on it, repeat.
- `ppo_off_policy`: generate k batches with one set of parameters, then take k steps on them.
- `pipeline_rl` (PipelineRL-k): a generator thread samples continuously into a
  `RolloutBuffer`; the trainer publishes parameters after every step and the generator picks
  them up between decode chunks (in flight), so one completion may carry several versions.
  As in PipelineRL, the side that is ahead waits: the generator starts batch n only once the
  trainer has published n - k updates, so no batch arrives more than k versions old and none
  is generated only to be thrown away.
- `pipeline_rl` with `lockstep` (always so across processes): no generator thread; the next
  batch is generated inside `trained`, on the generator's devices, while the step just
  dispatched runs on the trainer's, with the new weights swapped in halfway through the
  batch's decode steps.

A producer is `produce(params_for_chunk, key, oldest=v) -> batch`: it calls
`params_for_chunk(c)` -> (version, params) for the parameters to decode chunk c with (c = 0
also prefills), and the batch has a `versions` array (per-token policy version, -1 if none).
Where new weights reach the generator is therefore an explicit chunk index, never a count of
calls. A chunk is a fixed run of decode steps: `sampler.chunk_size` steps on the static path
(numbered on across its waves), one engine run of `sampler.admit_every` steps on the slot
engine. `make_feeder`'s `chunks` is how many chunks a batch's decode steps span
(`RolloutWorker.chunks`), so chunk `ceil(chunks / 2)` begins about halfway through them.
`oldest` is the oldest version a token of this batch may carry (the staleness bound of
the step that trains it); the next batch's is one more. A producer that starts the next
batch's rows early (the slot engine queues it behind this one) holds each back until it can
sample it with a version at least that. `pipeline_rl`'s generator thread, while it waits (for
the trainer's updates, for room in the buffer), calls `idle(params_for_chunk)` if given: the
producer's work queued ahead goes on (an agent task's calls keep decoding while its agents
wait for replies); it returns whether there was any, and returns within a few milliseconds.

The policy version is the number of train steps taken (a step whose update was skipped as
non-finite counts: its parameters equal the previous version's, so staleness is overstated,
never understated). It is counted on the host, so nothing here waits for the device.

Every feeder has `next()` (the batch to train on), `ready()` (whether `next()` would return
without generating or waiting), `trained(params, version)` (called as soon
as the step that made `version` is dispatched, before its result is read), `take_dropped()`
(batches generated but never to be trained on, for the run to count and charge), `pending`
(batches generated but not yet handed out that a checkpoint can keep: empty for the generator
thread, whose timing is not reproducible) and `stop()` (which waits for the generator thread
to end: a batch in progress is abandoned at its next chunk and counted by `untrained()`).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax

from jaxrl_scale.configbase import ConfigError
from jaxrl_scale.rl.buffer import RolloutBuffer, oldest_version
from jaxrl_scale.rl.config import PipelineConfig

ParamsForChunk = Callable[[int], tuple[int, Any]]
Producer = Callable[..., Any]  # (params_for_chunk, key, *, oldest: int) -> batch


class ParamsSource:
    """The newest published parameters and their version, read by the generator. `place` puts
    a published (version, params) where the generator reads them (a copy, or another device
    set). Written by the trainer thread, read by the generator thread: behind a lock.

    Where the generator reads them at most two placed copies exist at once: the one it decodes
    with and the newest. A version published and never handed out (`latest`) is dropped
    before the next one is placed, so placing never makes a third; until that one is placed,
    `latest` waits for it (so a reader never gets a version older than one already
    published). The generator lets go of a copy before it asks for the next: its programs
    that used it have finished. Readers that are not the generator (held-out evaluation) use
    `newest`, which neither waits nor hands out."""

    def __init__(
        self, version: int, params, *, place: Callable[[Any], Any] = lambda params: params
    ):
        self._cond = threading.Condition()
        self._place = place
        self._latest: tuple[int, Any] | None = None  # None: the next is being placed
        self._handed: int | None = None  # the version `latest` last handed out
        self._failed: BaseException | None = None
        self.publish(version, params)

    def publish(self, version: int, params) -> None:
        with self._cond:
            if self._latest is not None and self._latest[0] != self._handed:
                self._latest = None  # superseded before the generator took it: freed
        try:
            placed = self._place(params)
        except BaseException as e:
            with self._cond:  # the trainer fails; a reader waiting for this one fails too
                self._failed = e
                self._cond.notify_all()
            raise
        with self._cond:
            self._latest = (version, placed)
            self._cond.notify_all()

    def latest(self) -> tuple[int, Any]:
        """The newest (version, params), for the generator to decode with; waits while the
        newest is being placed after an older one was dropped."""
        with self._cond:
            while self._latest is None:
                if self._failed is not None:
                    raise RuntimeError("publishing the newest parameters failed") from (
                        self._failed
                    )
                self._cond.wait()
            self._handed = self._latest[0]
            return self._latest

    def newest(self) -> tuple[int, Any] | None:
        """The newest (version, params) without handing them to the generator; None while
        one is being placed."""
        with self._cond:
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
        self.dropped: list[Any] = []

    def trained(self, params, version: int) -> None:
        self.source.publish(version, params)

    def take_dropped(self) -> list[Any]:
        out, self.dropped = self.dropped, []
        return out

    def ready(self) -> bool:
        return bool(self.pending)

    def next(self) -> Any:
        if not self.pending:
            frozen = self.source.latest()
            for i in range(self.per_policy):
                key = jax.random.fold_in(self.key, self.round * self.per_policy + i)
                self.pending.append(self.produce(lambda chunk: frozen, key, oldest=frozen[0]))
            self.round += 1
        return self.pending.pop(0)

    def stop(self) -> None:
        pass

    def untrained(self) -> int:
        """Batches generated that neither the trainer nor a checkpoint took: none (a
        checkpoint keeps `pending`)."""
        return 0


class _Halted(Exception):
    """Raised into a producer by `params_for_chunk` once its feeder is stopping."""


class PipelineFeeder:
    """pipeline_rl: a generator thread fills a buffer from the newest published parameters.

    The staleness bound is kept by making the side that is ahead wait: batch n (counting from
    0 in this feeder) is the (n + 1)-th the trainer takes, after n updates, so its oldest token
    is at most k versions old if it starts with the parameters of update n - k or later. The
    generator therefore waits until `trained` has published n - k updates before it starts
    batch n; the trainer waits on an empty buffer. The buffer still drops (and keeps for
    `take_dropped`) anything staler, which this schedule never produces.

    Batch keys are numbered from the run's first step (`version`), as in lockstep, so a
    resumed run samples with keys the run before it never used."""

    def __init__(self, produce: Producer, source: ParamsSource, key, *, k: int, version: int,
                 idle: Callable[[ParamsForChunk], bool] | None = None):  # fmt: skip
        self.produce, self.source, self.key, self.idle = produce, source, key, idle
        self.k = k
        self.start_version = version
        self.buffer = RolloutBuffer(k)
        self.dropped: list[Any] = []  # stale batches handed over at start (consumer thread)
        # Updates published so far: written by the trainer thread (`trained`), waited on by
        # the generator thread, so it lives behind the condition's lock.
        self._published = 0
        self._progress = threading.Condition()
        self.halt = threading.Event()
        # Set by the generator thread, read after `stop` joined it: a batch made and never
        # buffered (halted while waiting for room), a batch halted mid-generation.
        self.unbuffered = 0
        self.abandoned = 0
        self.thread = threading.Thread(target=self._run, name="generator", daemon=True)
        self.thread.start()

    def _wait_for_update(self, n: int) -> bool:
        """Block until n updates have been published (False if halted meanwhile), the
        producer's work ahead going on meanwhile (`idle`)."""
        while True:
            with self._progress:
                if self._published >= n or self.halt.is_set():
                    return not self.halt.is_set()
                if self.idle is None:
                    self._progress.wait(timeout=0.1)
                    continue
            if not self._idle():  # nothing ahead to decode: wait for the trainer
                with self._progress:
                    if self._published < n and not self.halt.is_set():
                        self._progress.wait(timeout=0.1)

    def _idle(self) -> bool:
        """One `idle` call (the lock not held: it decodes); False when halted."""
        try:
            return bool(self.idle(self._newest))
        except _Halted:
            return False

    def _newest(self, chunk: int) -> tuple[int, Any]:
        """The parameters for the next chunk (in flight); between chunks is where a stopping
        feeder halts the batch in progress."""
        if self.halt.is_set():
            raise _Halted
        return self.source.latest()

    def _run(self) -> None:
        n = 0
        try:
            while self._wait_for_update(n - self.k):
                key = jax.random.fold_in(self.key, 2**20 + self.start_version + n)
                # Taken after n updates, so with version start + n, its tokens k at most older.
                try:
                    batch = self.produce(self._newest, key, oldest=self.start_version + n - self.k)
                except _Halted:
                    self.abandoned = 1
                    return
                n += 1
                idle = self._idle if self.idle is not None else None
                if not self.buffer.put(batch, batch.versions, halt=self.halt, idle=idle):
                    self.unbuffered = 1  # halted while waiting for room
                    return
        except BaseException as e:  # surfaced in the trainer thread
            self.buffer.put_error(e)

    @property
    def pending(self) -> list[Any]:
        return []  # in flight on the generator thread: regenerated on resume, not kept

    def ready(self) -> bool:
        return self.buffer.ready()

    def next(self) -> Any:
        with self._progress:
            version = self.start_version + self._published
        return self.buffer.get(version)

    def take_dropped(self) -> list[Any]:
        out, self.dropped = self.dropped, []
        return out + self.buffer.take_dropped()

    def trained(self, params, version: int) -> None:
        self.source.publish(version, params)
        with self._progress:
            self._published += 1
            self._progress.notify_all()

    def stop(self) -> None:
        """Halt the generator and wait until its thread has ended. It looks at the halt
        between decode chunks (engine runs), so the wait is at most the chunk in progress
        (with `sampler.chunk_size: 0`, a static wave's whole decode); the batch it was
        generating is abandoned and counted (`abandoned`, `untrained`)."""
        self.halt.set()
        while self.thread.is_alive():
            self.thread.join(timeout=60)
            if self.thread.is_alive():
                print("pipeline_rl: stopping; waiting for the generator's decode chunk in "
                      "progress to end", flush=True)  # fmt: skip

    def untrained(self) -> int:
        """Batches generated (or begun) that neither the trainer nor a checkpoint took: the
        buffer's (up to k at a run's end), one the generator had made when it was halted, and
        one it was generating (`abandoned`). Exact once `stop` has returned. A resumed run
        generates them again."""
        return len(self.buffer) + self.unbuffered + self.abandoned


class LockstepFeeder:
    """pipeline_rl from one thread, in an order fixed in advance (so every process issues the
    same programs in the same order). While the trainer's step v -> v + 1 runs (dispatched,
    not yet finished), the next batch is generated: chunks before `swap_at` (the middle of the
    `chunks` a batch's decode steps span) with version v, which is already on the generator,
    the rest with v + 1, pushed as soon as the step was dispatched (an in-flight update; the
    generator waits for the step only if it gets there first). The generator is one batch
    ahead, so staleness is at most 1. On the slot engine (`sampler.batching: continuous`) a
    chunk is one engine run of `sampler.admit_every` steps (on the static path
    `sampler.chunk_size` steps), so on both the swap lands about halfway through the batch's
    decode steps."""

    def __init__(
        self, produce: Producer, source: ParamsSource, key, *, chunks: int, start: int, pending
    ):
        """`start` numbers the next batch generated (its key); `pending` holds the batch already
        generated for the next step, if any (a resumed run's)."""
        self.produce, self.source, self.key = produce, source, key
        self.swap_at = -(-chunks // 2)  # the first chunk decoded with the new weights
        self.n = start
        self.pending: list[Any] = list(pending)
        self.dropped: list[Any] = []

    def _produce(self, params_for_chunk: ParamsForChunk, oldest: int) -> Any:
        key = jax.random.fold_in(self.key, 2**20 + self.n)
        batch = self.produce(params_for_chunk, key, oldest=oldest)
        self.n += 1
        return batch

    def take_dropped(self) -> list[Any]:
        out, self.dropped = self.dropped, []
        return out

    def ready(self) -> bool:
        return bool(self.pending)

    def next(self) -> Any:
        if not self.pending:  # the first batch: nothing to overlap it with
            frozen = self.source.latest()
            self.pending = [self._produce(lambda chunk: frozen, frozen[0] - 1)]
        return self.pending.pop(0)

    def trained(self, params, version: int) -> None:
        old = self.source.latest()
        self.source.publish(version, params)
        new = self.source.latest()
        # Trained by `new` (as the first batch by `frozen`): with k >= 1 a token may be one
        # version older, `old`; the batch queued behind it waits for `new`.
        self.pending = [self._produce(lambda chunk: old if chunk < self.swap_at else new, old[0])]

    def stop(self) -> None:
        pass

    def untrained(self) -> int:
        """Batches generated that neither the trainer nor a checkpoint took: none (a
        checkpoint keeps `pending`)."""
        return 0


def staleness_bound(cfg: PipelineConfig) -> int:
    """k: how many versions behind the trainer a batch's oldest token may be (0 in sync)."""
    return 0 if cfg.mode == "sync" else cfg.max_staleness


def staleness_in_effect(cfg: PipelineConfig, *, colocated_processes: int = 1) -> int:
    """The k a run's batches are held to (the rows' `staleness_bound`): `staleness_bound`,
    but at most 1 where pipeline_rl runs in lockstep (`pipeline.lockstep`, or generation
    colocated with a trainer of several processes: `make_feeder`), whose generator works one
    batch ahead."""
    k = staleness_bound(cfg)
    if cfg.mode == "pipeline_rl" and (cfg.lockstep or colocated_processes > 1):
        return min(k, 1)
    return k


def make_feeder(
    cfg: PipelineConfig,
    produce: Producer,
    source: ParamsSource,
    key,
    *,
    version: int,
    chunks: int,
    multiprocess: bool = False,
    resumed: list[Any] = (),
    idle: Callable[[ParamsForChunk], bool] | None = None,
):
    """The feeder for `cfg.mode`, starting at policy `version` (the steps taken so far).
    `chunks`: how many chunks a batch's decode steps span (`RolloutWorker.chunks`; lockstep
    swaps weights at the middle one). `resumed`: batches an interrupted run had generated but
    not trained on (deterministic modes); those staler than this run's k are handed to
    `take_dropped`, the rest are used. `idle`: what `pipeline_rl`'s generator thread does
    while it waits (the module docstring)."""
    k = staleness_bound(cfg)
    fresh, stale = [], []
    for batch in resumed:
        oldest = oldest_version(batch.versions)
        (fresh if oldest is None or version - oldest <= k else stale).append(batch)
    if cfg.mode == "pipeline_rl" and (cfg.lockstep or multiprocess):
        if k < 1:
            raise ConfigError(
                "pipeline.max_staleness: pipeline_rl in lockstep (always so across processes) "
                "keeps the generator one batch ahead and needs k >= 1"
            )
        if k > 1:
            why = "pipeline.lockstep is set" if cfg.lockstep else "the run spans processes"
            warnings.warn(
                f"pipeline.max_staleness: {k} runs as 1 here: {why}, so pipeline_rl runs in "
                "lockstep (the generator one batch ahead; across processes every process "
                "must issue the same programs in the same order). PipelineRL-k across hosts "
                "runs the generators as jobs of their own (hosts.generator_groups, "
                "docs/hosts.md)",
                stacklevel=2,
            )
        feeder = LockstepFeeder(
            produce, source, key, chunks=chunks, start=version + len(fresh), pending=fresh
        )
    elif cfg.mode == "pipeline_rl":
        feeder = PipelineFeeder(produce, source, key, k=k, version=version, idle=idle)
        stale += fresh  # the generator thread's schedule starts afresh
    else:
        per_policy = 1 if cfg.mode == "sync" else k
        feeder = SyncFeeder(
            produce,
            source,
            key,
            per_policy=per_policy,
            round_=-(-version // per_policy),  # rounds begun so far
            pending=fresh,
        )
    feeder.dropped = stale
    return feeder
