"""The rollout worker: prompts -> generation -> scores -> advantages -> a batch for the trainer.

worker = RolloutWorker(cfg, task, graphdef, mesh=mesh, gen_mesh=None)
ro = worker.rollouts(params_for_chunk, key)   # Rollouts: batch on the trainer's devices, ...
rate = worker.evaluate(params, key)           # held-out mean@k

It owns the task, its tokenizer, the curriculum and the sampling settings, and it is the one
place where rollouts cross between host and device: completions come to the host to be
decoded and scored, and the scored batch goes to the trainer's devices (each process placing
its own rows in a multi-process run); `rollouts_to_host` / `rollouts_from_host` do the same
for batches a checkpoint keeps.

Threads. `rollouts` runs on the thread that feeds the trainer (the generator thread in
threaded `pipeline_rl`, else the main thread) and is the only code that touches the
curriculum after setup, and the slot engine with its queue (`sampler.batching:
continuous`); every batch carries a snapshot of the curriculum taken right after it was
drawn and scored, and checkpoints save snapshots, never the live object. `evaluate` runs
on the main thread, concurrently with `rollouts` in threaded `pipeline_rl`: it reads only
what never changes (held-out examples, tokenizer, sampling settings) and calls the task's
verifier, which is safe to share (math's holds a lock; the others are pure functions).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_scale import distributed, sharding
from jaxrl_scale.advantages import group_advantages
from jaxrl_scale.compute import batch_flops
from jaxrl_scale.config import ConfigError, ExperimentConfig
from jaxrl_scale.curriculum import Curriculum
from jaxrl_scale.engine import Finished, SlotEngine
from jaxrl_scale.model import for_generation
from jaxrl_scale.pipeline import ParamsForChunk
from jaxrl_scale.sampler import (
    INTERRUPTED,
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
from jaxrl_scale.step import Batch


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """One scored generation round: everything the trainer needs."""

    batch: Batch  # on the trainer's devices
    indices: np.ndarray  # [P] prompt indices
    versions: np.ndarray  # [B, N] policy version per sampled token (-1 elsewhere)
    stats: dict[str, float]
    curriculum: dict[str, np.ndarray]  # the curriculum right after this batch was scored


def decodes_with_copy(cfg: ExperimentConfig, gen_mesh) -> bool:
    """Whether the generator decodes with its own copy of the parameters (in the dtypes of
    `model.for_generation`) rather than the trainer's: on its own devices, or beside a
    pipeline_rl train step that donates the trainer's."""
    return gen_mesh is not None or cfg.pipeline.mode == "pipeline_rl"


class RolloutWorker:
    def __init__(
        self,
        cfg: ExperimentConfig,
        task,
        graphdef,
        *,
        mesh: jax.sharding.Mesh,
        gen_mesh: jax.sharding.Mesh | None = None,
    ):
        self.cfg, self.task, self.tok, self.graphdef = cfg, task, task.tokenizer, graphdef
        if cfg.model.vocab_size < self.tok.vocab_size:
            raise ConfigError(
                f"model.vocab_size: {cfg.model.vocab_size} is below the task tokenizer's "
                f"{self.tok.vocab_size}"
            )
        self.mesh, self.gen_mesh = mesh, gen_mesh
        self.multiprocess = jax.process_count() > 1
        s = cfg.sampler
        self.sampling = Sampling(s.temperature, s.top_p, s.top_k)
        self.interruption = Interruption.from_config(s, self.tok)
        self.reference = bool(cfg.loss.kl_coef)  # GRPO's KL term: the flops of its forward
        self.curriculum = Curriculum(
            len(task.train_examples),
            seed=cfg.seed,
            retire_threshold=cfg.curriculum.retire_threshold,
            no_positive_resampling=cfg.curriculum.no_positive_resampling,
        )
        # Continuous batching: the engine, its batches submitted and not yet returned (this
        # one and the next, queued behind it), and finished rows by request. Created and used
        # on the thread that calls `rollouts` only.
        self.engine: SlotEngine | None = None
        # Each queued batch: (prompt indices, request ids, curriculum cursor before its draw).
        self.queued: list[tuple[np.ndarray, list[int], tuple[int, int]]] = []
        self.finished: dict[int, list[Finished]] = {}
        self.requests = 0
        if s.slots and s.slots < cfg.train.group_size:
            raise ConfigError(
                f"sampler.slots: {s.slots} cannot hold one group of "
                f"train.group_size = {cfg.train.group_size} rows"
            )
        # Continuous batching: rows in flight (0 = one batch's rows).
        self.slots = s.slots or cfg.train.prompts_per_step * cfg.train.group_size
        self._longest: int | None = None  # the task's longest prompt, measured when needed
        # Static waves (evaluation's always) are checked here, so a config whose waves cannot
        # split over the generator's devices fails at setup rather than at the first eval.
        ways = sharding.batch_ways(gen_mesh or mesh)
        wave_prompts(cfg, cfg.train.eval_samples, ways, len(task.eval_examples))
        # The chunks a training batch's decode steps span (lockstep swaps weights at the
        # middle one): engine runs of `admit_every` steps, or static chunks of `chunk_size`
        # numbered on across the batch's waves.
        if cfg.batching == "continuous":
            self.chunks = num_chunks(s.max_new_tokens, s.admit_every)
        else:
            p, g = cfg.train.prompts_per_step, cfg.train.group_size
            waves = -(-p // wave_prompts(cfg, g, ways, p))
            self.chunks = waves * num_chunks(s.max_new_tokens, s.chunk_size)

    # ------------------------------------------------------------------ placement

    def to_trainer(self, batch: Batch) -> Batch:
        """The batch split over the trainer mesh's batch axes, from wherever it was made.
        Across processes the batch is on the host and each process places its own rows."""
        shardings = sharding.batch_shardings(batch, self.mesh)
        if self.multiprocess:
            return jax.tree.map(distributed.place, batch, shardings)
        return jax.device_put(batch, shardings)

    def to_generator(self, params):
        """The parameters the generator decodes with (`model.for_generation`: matrices in the
        compute dtype, bit-identical samples). On its own devices: resharded there. On the
        trainer's in pipeline_rl, whose generator decodes while the train step that donates
        the trainer's parameters runs: a copy. Otherwise (sync, ppo_off_policy: generation ends
        before training starts) the trainer's own, with no copy beside the train state."""
        if self.gen_mesh is not None:
            params = for_generation(params, self.cfg.model, copy=False)
            return distributed.transfer(params, sharding.state_shardings(params, self.gen_mesh))
        if decodes_with_copy(self.cfg, self.gen_mesh):
            return for_generation(params, self.cfg.model)
        return params

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        params_for_chunk: ParamsForChunk,
        prompts,
        key,
        *,
        sampling,
        n_new,
        repeat=1,
        with_fill: bool = False,
    ) -> Rollout:
        """Sample `repeat` completions of each prompt (consecutive rows), prefilling each
        prompt once for its rows; chunk c decodes with `params_for_chunk(c)` (in-flight
        updates, asked for once the chunk before it has ended). The prompts are decoded in
        waves of `wave_prompts` prompts (the KV cache's bound; rows that split evenly over
        the generator's devices), each wave until its longest row ends; chunks are counted
        across waves. The last wave is filled up with copies of its last prompt, whose rows
        are dropped (`with_fill`: kept after the rows asked for, for the caller to charge
        their decode). Prompts are left-padded to `sampler.prompt_width` columns,
        capped by the task's longest prompt: a run compiles a few widths."""
        n = len(prompts)
        per_wave = wave_prompts(
            self.cfg, repeat, sharding.batch_ways(self.gen_mesh or self.mesh), n
        )
        width = prompt_width(max(len(p) for p in prompts), self._longest_prompt())
        host_tokens, host_mask = pad_prompts(prompts, self.tok.pad_id, width=width)
        fill = -n % per_wave
        if fill:
            host_tokens, host_mask = (
                np.concatenate([x, np.repeat(x[-1:], fill, axis=0)])
                for x in (host_tokens, host_mask)
            )
        parts, chunk = [], 0
        for w in range(0, n, per_wave):
            ro, chunk = self._generate_wave(
                params_for_chunk, chunk, host_tokens[w : w + per_wave],
                host_mask[w : w + per_wave], jax.random.fold_in(key, w) if w else key,
                sampling=sampling, n_new=n_new, repeat=repeat,
            )  # fmt: skip
            parts.append(ro)
        ro = parts[0] if len(parts) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)
        if fill and not with_fill:
            ro = jax.tree.map(lambda x: x[: n * repeat], ro)
        return ro

    def _longest_prompt(self) -> int:
        """The task's longest prompt (train and held-out), in tokens: the widest prompts are
        padded to."""
        if self._longest is None:
            examples = self.task.train_examples + self.task.eval_examples
            self._longest = max(len(p) for p in self._encode(examples))
        return self._longest

    def _generate_wave(
        self, params_for_chunk, chunk, host_tokens, host_mask, key, *, sampling, n_new, repeat
    ) -> tuple[Rollout, int]:
        """One wave: (its Rollout, the next chunk index)."""
        mesh = self.gen_mesh or self.mesh
        # Unique prompts are few: every device holds them all; the rows they become are split
        # over the mesh inside prefill. Without repetition the rows are split from the start.
        where = sharding.batch_sharding(mesh) if repeat == 1 else sharding.replicated(mesh)
        if self.multiprocess:
            tokens, mask = (distributed.place(x, where) for x in (host_tokens, host_mask))
        elif self.gen_mesh is not None:
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

    def _texts(self, ro: Rollout) -> list[str]:
        tokens, lengths = distributed.to_host(ro.completion_tokens), distributed.to_host(ro.lengths)
        return [self.tok.decode(t[:n]) for t, n in zip(tokens, lengths, strict=True)]

    def _encode(self, examples) -> list[list[int]]:
        return [self.tok.encode(e["prompt"]) for e in examples]

    # ------------------------------------------------------------------ continuous batching

    def _submit_batch(self, key, oldest: int | None) -> None:
        """Draw the next batch's prompts and queue them in the engine, in batch order, held
        until the version is at least `oldest` (None: not held)."""
        cfg = self.cfg
        if self.engine is None:
            self.engine = SlotEngine(
                self.graphdef,
                slots=self.slots,
                prompt_len=-(-self._longest_prompt() // 8) * 8,
                n_new=cfg.sampler.max_new_tokens,
                repeat=cfg.train.group_size,
                sampling=self.sampling,
                eos_ids=self.tok.eos_ids,
                pad_id=self.tok.pad_id,
                interruption=self.interruption,
                key=key,
                model_cfg=cfg.model,
                mesh=self.gen_mesh or self.mesh,
            )
        cursor = (self.curriculum.epoch, self.curriculum.position)
        indices = self.curriculum.next_batch(cfg.train.prompts_per_step)
        prompts = self._encode([self.task.train_examples[i] for i in indices])
        requests = list(range(self.requests, self.requests + len(prompts)))
        self.requests += len(prompts)
        for request, prompt in zip(requests, prompts, strict=True):
            self.engine.submit(request, prompt, not_before=oldest)
        self.queued.append((indices, requests, cursor))

    def in_flight(self) -> tuple[int, int]:
        """(prompts drawn into the engine and not handed over in a batch, rows of them already
        generating or generated): work the run's end leaves untrained."""
        prompts = sum(len(requests) for _, requests, _ in self.queued)
        rows = 0 if self.engine is None else self.engine.busy
        return prompts, rows + sum(len(v) for v in self.finished.values())

    def _continuous_rollout(self, params_for_chunk: ParamsForChunk, key, oldest: int | None):
        """(prompt indices, Rollout) of the oldest queued batch, its groups in the order they
        were drawn. The next batch is queued behind it first, so slots its rows leave are
        taken by the next batch's groups instead of idling; a batch is returned only when all
        its groups are complete (short answers finishing first do not jump the queue). In
        `sync` and `ppo_off_policy` nothing is queued ahead: a round is admitted, then drained,
        so every token of it is sampled by the parameters it was drawn for. `oldest` bounds
        the versions of this batch's tokens; the batch queued behind it is held until the
        version is one more (the next step's bound), so its rows may start early but never
        stale."""
        ahead = 2 if self.cfg.pipeline.mode == "pipeline_rl" else 1
        while len(self.queued) < ahead:
            bound = None if oldest is None else oldest + len(self.queued)
            self._submit_batch(key, bound)
        indices, requests, _ = self.queued[0]
        g, chunk = self.cfg.train.group_size, 0
        while any(len(self.finished.get(r, ())) < g for r in requests):
            # The engine's last run has ended before the next weights are asked for (as its
            # `run` would wait for it next anyway): no program still uses the copy it leaves.
            jax.block_until_ready(self.engine.state.done)
            version, params = params_for_chunk(chunk)
            chunk += 1
            for row in self.engine.run(params, version, self.cfg.sampler.admit_every):
                self.finished.setdefault(row.request, []).append(row)
        self.queued.pop(0)
        rows = [f for r in requests for f in sorted(self.finished.pop(r), key=lambda f: f.row)]
        stack = lambda name: jnp.asarray(np.stack([getattr(f, name) for f in rows]))  # noqa: E731
        ro = Rollout(
            prompt_tokens=stack("prompt"),
            prompt_mask=stack("prompt_mask"),
            completion_tokens=stack("tokens"),
            completion_mask=stack("mask"),
            behavior_logp=stack("logp"),
            versions=stack("versions"),
            finish_reason=jnp.asarray([f.finish_reason for f in rows], jnp.int32),
            lengths=jnp.asarray([f.length for f in rows], jnp.int32),
        )
        return indices, ro

    def rollouts(
        self, params_for_chunk: ParamsForChunk, key, *, oldest: int | None = None
    ) -> Rollouts:
        """Draw a batch of prompts, sample G completions each, score, compute advantages.
        `oldest`: the oldest version its tokens may carry (the feeder's staleness bound;
        what the slot engine holds the batch it queues next to). An exception raised by
        `params_for_chunk` (a feeder stopping) abandons the batch between two chunks: its
        prompts stay drawn (the curriculum snapshots that checkpoints keep predate them) and
        on the slot engine stay queued, counted by `in_flight`."""
        cfg, g = self.cfg, self.cfg.train.group_size
        start = time.perf_counter()
        if cfg.batching == "continuous":
            indices, ro = self._continuous_rollout(params_for_chunk, key, oldest)
            examples = [self.task.train_examples[i] for i in indices]
        else:
            indices = self.curriculum.next_batch(cfg.train.prompts_per_step)
            examples = [self.task.train_examples[i] for i in indices]
            ro = self.generate(
                params_for_chunk,
                self._encode(examples),
                key,
                sampling=self.sampling,
                n_new=cfg.sampler.max_new_tokens,
                repeat=g,
                with_fill=True,
            )
        # Rows decoded only to fill the last wave up: not trained, their decode charged.
        rows, fill = len(examples) * g, None
        if ro.lengths.shape[0] > rows:
            fill = jax.tree.map(lambda x: x[rows:], ro)
            ro = jax.tree.map(lambda x: x[:rows], ro)
        texts = self._texts(ro)
        rewards = np.array([self.task.score(t, examples[i // g]) for i, t in enumerate(texts)])
        pass_rates = rewards.reshape(-1, g).mean(axis=1)
        self.curriculum.update(indices, pass_rates)
        adv, keep = group_advantages(
            rewards, g, normalize=cfg.loss.normalize, baseline=cfg.loss.baseline
        )
        if self.multiprocess:  # built on the host; each process then places its rows
            ro = jax.tree.map(distributed.to_host, ro)
            batch = Batch.from_rollout(ro, adv, keep, xp=np)
        else:  # built where it was generated, then moved device to device
            batch = Batch.from_rollout(ro, adv, keep)
        batch = self.to_trainer(batch)
        lengths, finish, versions, prompt_mask = (
            distributed.to_host(x)
            for x in (ro.lengths, ro.finish_reason, ro.versions, ro.prompt_mask)
        )
        prompt_lens = prompt_mask[::g].sum(axis=1)
        stats = {
            "reward_mean": float(rewards.mean()),
            "pass_rate": float(pass_rates.mean()),
            "gen_length_mean": float(lengths.mean()),
            "interrupted_rate": float(np.mean(finish == INTERRUPTED)),
            "kept_fraction": float(np.asarray(keep).mean()),
            "retired": int(self.curriculum.retired.sum()),
            "gen_tokens": int(lengths.sum()),
            **batch_flops(cfg.model, prompt_lens, lengths, reference=self.reference),
            "gen_fill_rows": 0 if fill is None else int(fill.lengths.shape[0]),
            "gen_seconds": time.perf_counter() - start,
        }
        if fill is not None:  # compute spent, nothing to train on: on the x-axis
            fill_lengths, fill_mask = map(distributed.to_host, (fill.lengths, fill.prompt_mask))
            fill_prompts = fill_mask[::g].sum(axis=1)
            stats["gen_flops"] += batch_flops(cfg.model, fill_prompts, fill_lengths)["gen_flops"]
        return Rollouts(batch, indices, versions, stats, self._curriculum_snapshot())

    def _curriculum_snapshot(self) -> dict[str, np.ndarray]:
        """The curriculum as a checkpoint keeps it. A batch queued ahead in the engine was
        drawn but not trained: the snapshot's cursor sits before it, so a resumed run draws
        those prompts again (the rows in flight are regenerated, not skipped)."""
        state = self.curriculum.state_dict()
        if self.queued:
            epoch, position = self.queued[0][2]
            state["epoch"], state["position"] = np.asarray(epoch), np.asarray(position)
        return state

    def evaluate(self, params, key) -> float:
        """mean@k pass rate on the held-out split (k = train.eval_samples)."""
        return self.evaluate_with_sd(params, key)[0]

    def evaluate_with_sd(self, params, key, *, placed=None) -> tuple[float, float]:
        """(mean@k pass rate on the held-out split, its sampling sd; see `sampling_sd`).
        `placed`: the same parameters already as the generator decodes them (the newest
        published copy), evaluated without placing another copy beside the generator's."""
        k = self.cfg.train.eval_samples
        examples = self.task.eval_examples
        frozen = (-1, self.to_generator(params) if placed is None else placed)
        ro = self.generate(
            lambda chunk: frozen,
            self._encode(examples),
            key,
            sampling=Sampling(self.cfg.train.eval_temperature),
            n_new=self.cfg.sampler.max_new_tokens,
            repeat=k,
        )
        texts = self._texts(ro)
        scores = [self.task.score(t, examples[i // k]) for i, t in enumerate(texts)]
        scores = np.asarray(scores, float).reshape(len(examples), k)
        return float(scores.mean()), sampling_sd(scores)


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


def sampling_sd(scores) -> float:
    """The sd of a mean@k eval over its k samples per prompt, the prompt set held fixed:
    sqrt(sum_i s_i^2 / k) / n for n prompts whose k scores have sample variance s_i^2.

    This is the part of an eval's error that is drawn afresh at every eval (the same prompts
    are evaluated every time, so which prompts they are is not). NaN when k = 1.
    """
    scores = np.asarray(scores, float)
    n, k = scores.shape
    if k < 2:
        return float("nan")
    return float(np.sqrt(np.sum(np.var(scores, axis=1, ddof=1)) / k) / n)


# --------------------------------------------------------------------------- checkpointed batches


def rollouts_to_host(batches: list[Rollouts]) -> dict[str, Any]:
    """Batches as a tree of host arrays (for a checkpoint)."""

    def one(ro: Rollouts) -> dict[str, Any]:
        return {
            "batch": {
                f.name: distributed.to_host(getattr(ro.batch, f.name))
                for f in dataclasses.fields(Batch)
            },
            "indices": np.asarray(ro.indices),
            "versions": np.asarray(ro.versions),
            "stats": {k: np.asarray(v) for k, v in ro.stats.items()},
            "curriculum": dict(ro.curriculum),
        }

    return {str(i): one(ro) for i, ro in enumerate(batches)}


def rollouts_from_host(tree: dict[str, Any], worker: RolloutWorker) -> list[Rollouts]:
    """The inverse of `rollouts_to_host`, each batch placed on the trainer's devices."""
    out = []
    for i in range(len(tree)):
        t = tree[str(i)]
        out.append(
            Rollouts(
                worker.to_trainer(Batch(**t["batch"])),
                t["indices"],
                t["versions"],
                {k: np.asarray(v).item() for k, v in t["stats"].items()},
                t["curriculum"],
            )
        )
    return out
