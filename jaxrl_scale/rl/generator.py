"""The generator's side of a rollout: prompts in, completions (a `Rollout`) out.

waves = WaveGenerator(cfg, graphdef, tokenizer, interruption, mesh=m, longest_prompt=L)
ro = waves.generate(params_for_chunk, prompts, key, sampling=s, n_new=N, repeat=G)
batches = EngineBatches(cfg, graphdef, tokenizer, interruption, mesh=m, prompt_len=L,
                        slots=S, curriculum=c, examples=train_examples)
indices, ro = batches.next(params_for_chunk, key, oldest=v)
batches.queue(indices, prompts, key, oldest=v)   # a generator job: the hub's batches,
batches.step(params_for_chunk)                   # one engine run at a time,
indices, ro, tag = batches.pop()                 # once batches.complete()

`WaveGenerator` is the static path (and every held-out evaluation): prompts decoded in waves
of at most `sampler.slots` rows, each until its longest row ends. `EngineBatches` is
continuous batching: it draws each batch's prompts from the curriculum into the slot engine
(`generation.engine`), or takes the batches a generator job is handed, queues the next batch
behind it, and hands a batch over once all its groups are complete. Neither scores, places
batches for the trainer or knows the feeder: that is `rollout.RolloutWorker` (colocated) or
the generator job (hosts/generator_job.py).

Threads. A `WaveGenerator` holds no mutable state: the feeding thread's rollouts and the main
thread's evaluation share it. An `EngineBatches`, with its engine, queue and the curriculum
it draws from, is owned by the thread that calls `next` (the feeding thread) or, in a
generator job, `queue` and `step` (its main thread).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_scale.configbase import ConfigError
from jaxrl_scale.generation.engine import Finished, SlotEngine
from jaxrl_scale.generation.sampler import (
    Interruption,
    Rollout,
    Sampling,
    decode,
    num_chunks,
    pad_prompts,
    prefill,
    prompt_width,
    to_rollout,
)
from jaxrl_scale.parallel import distributed, sharding
from jaxrl_scale.rl.curriculum import Curriculum
from jaxrl_scale.rl.pipeline import ParamsForChunk

if TYPE_CHECKING:  # the root config composes every part's section
    from jaxrl_scale.config import ExperimentConfig


def wave_prompts(cfg: ExperimentConfig, repeat: int, batch_ways: int, n_prompts: int) -> int:
    """Prompts per wave when `n_prompts` prompts of `repeat` rows each are generated on a mesh
    whose batch axes split rows `batch_ways` ways.

    A wave holds at most `sampler.slots` rows (0: one train batch's, train.prompts_per_step x
    train.group_size), the KV cache's bound, and a multiple of `batch_ways` rows, so the cache
    is split over the devices rather than copied whole to each: a multiple of
    m = batch_ways / gcd(batch_ways, repeat) prompts, the most that fit, but no more than
    `n_prompts` rounded up to m (the last wave is filled up with prompts whose rows are
    dropped). Raises ConfigError when not even m prompts fit."""
    rows = cfg.sampler.slots or cfg.train.prompts_per_step * cfg.train.group_size
    multiple = batch_ways // math.gcd(batch_ways, repeat)
    fits = rows // repeat // multiple * multiple
    if not fits:
        bound = "sampler.slots" if cfg.sampler.slots else (
            "sampler.slots = 0: train.prompts_per_step x train.group_size"
        )  # fmt: skip
        raise ConfigError(
            f"sampler.slots / train.eval_samples: a wave holds at most {rows} rows ({bound}), "
            f"but with {repeat} samples per prompt (train.eval_samples, or train.group_size "
            f"in training) the smallest wave whose rows split over the generator's "
            f"{batch_ways} batch shards is {multiple} prompts = {multiple * repeat} rows; "
            f"raise sampler.slots to at least {multiple * repeat} or choose a sample count "
            f"that shares more factors with {batch_ways}"
        )
    return min(fits, -(-n_prompts // multiple) * multiple)


def wave_rows(cfg: ExperimentConfig, repeat: int, batch_ways: int, n_prompts: int) -> int:
    """The rows of one full wave as compiled (`wave_prompts` x `repeat`, fill included)."""
    return wave_prompts(cfg, repeat, batch_ways, n_prompts) * repeat


def batch_chunks(cfg: ExperimentConfig, batch_ways: int) -> int:
    """The chunks a training batch's decode steps span: engine runs of `sampler.admit_every`
    steps, or static chunks of `sampler.chunk_size` numbered on across the batch's waves."""
    s = cfg.sampler
    if cfg.batching == "continuous":
        return num_chunks(s.max_new_tokens, s.admit_every)
    p, g = cfg.train.prompts_per_step, cfg.train.group_size
    waves = -(-p // wave_prompts(cfg, g, batch_ways, p))
    return waves * num_chunks(s.max_new_tokens, s.chunk_size)


class _OnGenerator:
    """What both ways of generating decode with: the run's config, the model's graph, the
    tokenizer (pad and EOS ids), the forced interruption and the generator's mesh."""

    def __init__(self, cfg: ExperimentConfig, graphdef, tokenizer, interruption, mesh):
        self.cfg, self.graphdef, self.tok = cfg, graphdef, tokenizer
        self.interruption, self.mesh = interruption, mesh


class WaveGenerator(_OnGenerator):
    """Static generation on `mesh` (the generator's devices): `tokenizer` gives the pad and
    EOS ids, `longest_prompt` the widest prompt any call will see (prompts are padded to a
    few widths up to it)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        graphdef,
        tokenizer,
        interruption: Interruption | None,
        *,
        mesh: jax.sharding.Mesh,
        own_devices: bool,
        longest_prompt: int,
    ):
        super().__init__(cfg, graphdef, tokenizer, interruption, mesh)
        self.own_devices, self.longest_prompt = own_devices, longest_prompt
        self.multiprocess = jax.process_count() > 1

    def generate(
        self,
        params_for_chunk: ParamsForChunk,
        prompts: Sequence[Sequence[int]],
        key,
        *,
        sampling: Sampling,
        n_new: int,
        repeat: int = 1,
        with_fill: bool = False,
    ) -> Rollout:
        """Sample `repeat` completions of each prompt (consecutive rows), prefilling each
        prompt once for its rows; chunk c decodes with `params_for_chunk(c)` (in-flight
        updates, asked for once the chunk before it has ended). The prompts are decoded in
        waves of `wave_prompts` prompts (the KV cache's bound; rows that split evenly over
        the generator's devices), each wave until its longest row ends; chunks are counted
        across waves. The last wave is filled up with copies of its last prompt, whose rows
        are dropped (`with_fill`: kept after the rows asked for, for the caller to charge
        their decode). Prompts are left-padded to `sampler.prompt_width` columns, capped by
        the longest prompt: a run compiles a few widths."""
        n = len(prompts)
        per_wave = wave_prompts(self.cfg, repeat, sharding.batch_ways(self.mesh), n)
        width = prompt_width(max(len(p) for p in prompts), self.longest_prompt)
        host_tokens, host_mask = pad_prompts(prompts, self.tok.pad_id, width=width)
        fill = -n % per_wave
        if fill:
            host_tokens, host_mask = (
                np.concatenate([x, np.repeat(x[-1:], fill, axis=0)])
                for x in (host_tokens, host_mask)
            )
        parts, chunk = [], 0
        for w in range(0, n, per_wave):
            ro, chunk = self._wave(
                params_for_chunk, chunk, host_tokens[w : w + per_wave],
                host_mask[w : w + per_wave], jax.random.fold_in(key, w) if w else key,
                sampling=sampling, n_new=n_new, repeat=repeat,
            )  # fmt: skip
            parts.append(ro)
        ro = parts[0] if len(parts) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)
        if fill and not with_fill:
            ro = jax.tree.map(lambda x: x[: n * repeat], ro)
        return ro

    def _wave(
        self, params_for_chunk, chunk, host_tokens, host_mask, key, *, sampling, n_new, repeat
    ) -> tuple[Rollout, int]:
        """One wave: (its Rollout, the next chunk index)."""
        mesh = self.mesh
        # Unique prompts are few: every device holds them all; the rows they become are split
        # over the mesh inside prefill. Without repetition the rows are split from the start.
        where = sharding.batch_sharding(mesh) if repeat == 1 else sharding.replicated(mesh)
        if self.multiprocess:
            tokens, mask = (distributed.place(x, where) for x in (host_tokens, host_mask))
        elif self.own_devices:
            tokens, mask = jax.device_put((host_tokens, host_mask), where)
        else:
            tokens, mask = jnp.asarray(host_tokens), jnp.asarray(host_mask)
        version, params = params_for_chunk(chunk)
        state = prefill(
            self.graphdef,
            params,
            tokens,
            mask,
            key,
            n_new=n_new,
            interruption=self.interruption,
            mesh=mesh,
            repeat=repeat,
        )
        static = dict(
            sampling=sampling,
            eos_ids=self.tok.eos_ids,
            pad_id=self.tok.pad_id,
            interruption=self.interruption,
            prompt_len=tokens.shape[1],
            mesh=mesh,
        )
        chunk_size = self.cfg.sampler.chunk_size or n_new
        for c in range(num_chunks(n_new, chunk_size)):
            if c:
                # Each chunk asks for the newest weights once the chunk before it has ended
                # (else every chunk is dispatched at once with the weights of that moment, and
                # weights published while the wave decodes never reach it). No program still
                # uses the copy it leaves, so the generator's devices hold two at most
                # (pipeline.ParamsSource); the device waits one host round trip per chunk. A
                # wave whose rows have all ended stops.
                if distributed.to_host(state.done).all():
                    break
                version, params = params_for_chunk(chunk + c)
            state = decode(self.graphdef, params, state, version, chunk_size, **static)
        jax.block_until_ready(state.done)  # the next wave's weights: see above
        rows = lambda x: np.repeat(x, repeat, axis=0)  # noqa: E731
        ro = to_rollout(rows(host_tokens), rows(host_mask), state)
        return ro, chunk + num_chunks(n_new, chunk_size)


class EngineBatches(_OnGenerator):
    """Continuous batching of training batches in a slot engine of `slots` rows on `mesh`,
    created at the first batch queued. Batches enter in order and are handed over in that
    order, each once all its groups are complete. Colocated, `next` draws each batch's
    `train.prompts_per_step` prompts from `curriculum` (indices into `examples`, encoded by
    `encode`); a generator job (no curriculum) queues the batches the hub hands it
    (`queue`) and runs the engine one run at a time (`step`, `complete`, `pop`)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        graphdef,
        tokenizer,
        interruption: Interruption | None,
        *,
        mesh: jax.sharding.Mesh,
        prompt_len: int,
        slots: int,
        sampling: Sampling,
        curriculum: Curriculum | None = None,
        examples: Sequence[dict] = (),
        encode: Callable[[Sequence[dict]], list[list[int]]] | None = None,
    ):
        super().__init__(cfg, graphdef, tokenizer, interruption, mesh)
        self.prompt_len, self.slots, self.sampling = prompt_len, slots, sampling
        self.curriculum, self.examples, self.encode = curriculum, examples, encode
        # The engine, the batches queued and not yet handed over (the oldest first), and
        # finished rows by request.
        self.engine: SlotEngine | None = None
        self.queued: list[_Queued] = []
        self.finished: dict[int, list[Finished]] = {}
        self.requests = 0
        self.chunk = 0  # engine runs so far: each asks for the newest weights
        # The share of slot-steps with a row decoding since the batch before was handed over
        # (`pop`), and the engine's (steps, slot-steps) counts then.
        self.occupancy = 0.0
        self._counts = (0, 0)

    def queue(self, indices, prompts: Sequence[Sequence[int]], key, oldest: int | None,
              tag=None) -> None:  # fmt: skip
        """Queue a batch's prompts in the engine behind those queued, held until the version
        is at least `oldest` (None: not held); `key` seeds the engine if it is the first.
        `tag` comes back with the batch (`pop`)."""
        cfg = self.cfg
        if self.engine is None:
            self.engine = SlotEngine(
                self.graphdef,
                slots=self.slots,
                prompt_len=self.prompt_len,
                n_new=cfg.sampler.max_new_tokens,
                repeat=cfg.train.group_size,
                sampling=self.sampling,
                eos_ids=self.tok.eos_ids,
                pad_id=self.tok.pad_id,
                interruption=self.interruption,
                key=key,
                model_cfg=cfg.model,
                mesh=self.mesh,
            )
        requests = list(range(self.requests, self.requests + len(prompts)))
        self.requests += len(prompts)
        for request, prompt in zip(requests, prompts, strict=True):
            self.engine.submit(request, prompt, not_before=oldest)
        self.queued.append(_Queued(np.asarray(indices), requests, tag))

    def release(self) -> None:
        """Free the engine's slots on the devices while nothing is queued (a generator job's
        evaluation runs in their place); the next `queue` builds the engine again."""
        if self.queued:
            raise ValueError(f"{len(self.queued)} batch(es) are still queued in the engine")
        self.engine, self._counts = None, (0, 0)

    def _draw(self, key, oldest: int | None) -> None:
        """Draw the next batch's prompts from the curriculum and queue them."""
        cursor = (self.curriculum.epoch, self.curriculum.position)
        indices = self.curriculum.next_batch(self.cfg.train.prompts_per_step)
        prompts = self.encode([self.examples[i] for i in indices])
        self.queue(indices, prompts, key, oldest, tag=cursor)

    def in_flight(self) -> tuple[int, int]:
        """(prompts drawn into the engine and not handed over in a batch, rows of them already
        generating or generated): work the run's end leaves untrained."""
        prompts = sum(len(q.requests) for q in self.queued)
        rows = 0 if self.engine is None else self.engine.busy
        return prompts, rows + sum(len(v) for v in self.finished.values())

    def cursor(self) -> tuple[int, int] | None:
        """The curriculum's (epoch, position) before the oldest batch still queued (drawn,
        not handed over), or None when nothing is queued."""
        return self.queued[0].tag if self.queued else None

    def complete(self) -> bool:
        """Whether the oldest queued batch has all its groups."""
        g = self.cfg.train.group_size
        return bool(self.queued) and all(
            len(self.finished.get(r, ())) >= g for r in self.queued[0].requests
        )

    def step(self, params_for_chunk: ParamsForChunk) -> None:
        """One engine run (`sampler.admit_every` decode steps) with the newest weights
        `params_for_chunk` gives; the rows it hands back are kept by request."""
        # The engine's last run has ended before the next weights are asked for (as its
        # `run` would wait for it next anyway): no program still uses the copy it leaves.
        jax.block_until_ready(self.engine.state.done)
        version, params = params_for_chunk(self.chunk)
        self.chunk += 1
        for row in self.engine.run(params, version, self.cfg.sampler.admit_every):
            self.finished.setdefault(row.request, []).append(row)

    def pop(self):
        """(prompt indices, Rollout, tag) of the oldest queued batch, once `complete`
        (`occupancy` is then the slots' since the batch before, kept when no run came
        between): its groups in the order they were queued, on the host, where scoring reads
        it and the trainer places its rows in their shards when it takes the batch (with
        router replay its experts are most of its bytes)."""
        q = self.queued.pop(0)
        counts = (self.engine.steps, self.engine.slot_steps)
        steps, busy = (now - then for now, then in zip(counts, self._counts, strict=True))
        if steps:  # (none since the batch before: it finished in runs already counted)
            self.occupancy, self._counts = busy / (self.slots * steps), counts
        rows = [f for r in q.requests for f in sorted(self.finished.pop(r), key=lambda f: f.row)]
        stack = lambda name: np.stack([getattr(f, name) for f in rows])  # noqa: E731
        ro = Rollout(
            prompt_tokens=stack("prompt"),
            prompt_mask=stack("prompt_mask"),
            completion_tokens=stack("tokens"),
            completion_mask=stack("mask"),
            behavior_logp=stack("logp"),
            versions=stack("versions"),
            finish_reason=np.asarray([f.finish_reason for f in rows], np.int32),
            lengths=np.asarray([f.length for f in rows], np.int32),
            routes=None if rows[0].routes is None else stack("routes"),
        )
        return q.indices, ro, q.tag

    def next(self, params_for_chunk: ParamsForChunk, key, oldest: int | None):
        """(prompt indices, Rollout) of the oldest queued batch, its groups in the order they
        were drawn. The next batch is queued behind it first, so slots its rows leave are
        taken by the next batch's groups instead of idling; a batch is returned only when all
        its groups are complete (short answers finishing first do not jump the queue). In
        `sync` and `ppo_off_policy` nothing is queued ahead: a round is admitted, then drained,
        so every token of it is sampled by the parameters it was drawn for. `oldest` bounds
        the versions of this batch's tokens; the batch queued behind it is held until the
        version is one more (the next step's bound), so its rows may start early but never
        stale. Chunks are counted from 0 in each call (a fixed schedule's swap)."""
        ahead = 2 if self.cfg.pipeline.mode == "pipeline_rl" else 1
        while len(self.queued) < ahead:
            self._draw(key, None if oldest is None else oldest + len(self.queued))
        self.chunk = 0
        while not self.complete():
            self.step(params_for_chunk)
        indices, ro, _ = self.pop()
        return indices, ro


@dataclasses.dataclass
class _Queued:
    """A batch in the engine: its prompts' indices, their request ids, and the caller's tag
    (colocated: the curriculum's cursor before its draw; a generator job: the hub's work)."""

    indices: np.ndarray
    requests: list[int]
    tag: object = None
