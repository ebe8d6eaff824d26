"""The RL loop, readable top to bottom.

prompts (curriculum) -> sampler (policy version v, in-flight swaps between decode chunks)
-> rewards (task verifier) -> advantages -> buffer (tagged with versions) -> train step if the
batch is at most k versions old -> new parameters published to the generator
-> every N steps: held-out eval, metrics row, checkpoint.

Modes: `sync` (k = 0: generate with the current policy, then train; deterministic for a seed),
`ppo_off_policy` (generate k batches with one policy, then take k steps), `pipeline_rl`
(a generator thread and the trainer run concurrently; the buffer holds at most k batches and
the trainer refuses any batch more than k versions old); the feeders are in pipeline.py, the
staleness-bounded buffer in buffer.py.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_scale import distributed, sharding
from jaxrl_scale.advantages import group_advantages
from jaxrl_scale.checkpoint import Checkpointer, abstract_like
from jaxrl_scale.compute import RunClock, batch_flops
from jaxrl_scale.config import ConfigError, ExperimentConfig, MeshConfig
from jaxrl_scale.curriculum import Curriculum
from jaxrl_scale.forecast import OnlineForecast
from jaxrl_scale.hf import load_pretrained
from jaxrl_scale.metrics import MetricsWriter, read_metrics
from jaxrl_scale.model import Policy
from jaxrl_scale.pipeline import LockstepFeeder, ParamsSource, PipelineFeeder, SyncFeeder
from jaxrl_scale.sampler import Interruption, Sampling, decode, pad_prompts, prefill, to_rollout
from jaxrl_scale.step import Batch, compile_train_step, init_train_state, make_optimizer, sft_step
from jaxrl_scale.tasks import make_task


@dataclasses.dataclass
class Rollouts:
    """One scored generation round, ready for the trainer."""

    batch: Batch
    indices: np.ndarray  # [P] prompt indices
    versions: np.ndarray  # [B, N] policy version per sampled token (-1 elsewhere)
    stats: dict[str, float]


class Trainer:
    def __init__(self, cfg: ExperimentConfig, out: str | Path, *, resume: bool = True):
        distributed.initialize(cfg.distributed)  # several processes: jax.distributed first
        self.multiprocess = jax.process_count() > 1
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        mesh, self.gen_mesh = _meshes(cfg)
        # ------------------------------------------------------------------ model and task
        loaded_tok = None
        if cfg.model.init_from:
            model, loaded_tok = load_pretrained(
                cfg.model.init_from,
                mesh=mesh,
                dtype=cfg.model.dtype,
                lm_head_dtype=cfg.model.lm_head_dtype,
                matmul_precision=cfg.model.matmul_precision,
                logits_chunk_size=cfg.model.logits_chunk_size,
            )
            model_cfg = dataclasses.replace(model.cfg, init_from=cfg.model.init_from)
            cfg = dataclasses.replace(cfg, model=model_cfg)
        else:
            model = sharding.init_sharded(
                lambda: Policy(cfg.model, rngs=nnx.Rngs(params=cfg.seed)), mesh
            )
        self.cfg, self.mesh = cfg, mesh
        self.task = make_task(cfg.task, seed=cfg.seed, tokenizer=loaded_tok)
        self.tok = self.task.tokenizer
        if cfg.model.vocab_size < self.tok.vocab_size:
            raise ConfigError(
                f"model.vocab_size: {cfg.model.vocab_size} is below the task tokenizer's "
                f"{self.tok.vocab_size}"
            )
        _check_divisible(cfg, self.mesh, self.gen_mesh)
        self.graphdef, params = nnx.split(model)
        self.sampling = Sampling(cfg.sampler.temperature, cfg.sampler.top_p, cfg.sampler.top_k)
        self.interruption = _interruption(cfg, self.tok)
        # ------------------------------------------------------------------ optimisation
        self.tx = make_optimizer(cfg.train.learning_rate, cfg.train)
        # GRPO's KL penalty pulls towards the policy RL starts from (after the warm start).
        self.reference = bool(cfg.loss.kl_coef)
        state = init_train_state(params, self.tx, reference=self.reference)
        self.state_sharding = _state_sharding(state, self.mesh)
        self.state = jax.device_put(state, self.state_sharding)
        two, one = (sharding.batch_sharding(self.mesh, n) for n in (2, 1))
        rows = [f.name for f in dataclasses.fields(Batch) if f.name != "adv"]  # [B, ...] arrays
        self.batch_sharding = Batch(**dict.fromkeys(rows, two), adv=one)
        self.train_step = compile_train_step(
            self.graphdef,
            self.tx,
            group_size=cfg.train.group_size,
            loss_cfg=cfg.loss,
            temperature=cfg.sampler.temperature,
            micro_batches=cfg.train.micro_batches,
            state_sharding=self.state_sharding,
            batch_sharding=self.batch_sharding,
        )
        self.curriculum = Curriculum(
            len(self.task.train_examples),
            seed=cfg.seed,
            retire_threshold=cfg.curriculum.retire_threshold,
            no_positive_resampling=cfg.curriculum.no_positive_resampling,
        )
        self.key = jax.random.key(cfg.seed)
        self.totals = {
            "compute_flops": 0.0,
            "device_seconds": 0.0,
            "tokens": 0,
            "skipped_updates": 0,
            "dropped_batches": 0,
        }
        # ------------------------------------------------------------------ resume
        self.checkpointer = Checkpointer(self.out, keep=cfg.checkpoint.keep)
        self.start_step = 0
        restored = self.checkpointer.restore_latest(abstract_like(self.state)) if resume else None
        if restored is not None:  # the resume order of checkpoint.py
            step, self.state, extra = restored
            self.curriculum.load_state_dict(extra["curriculum"])
            self.key = jax.random.wrap_key_data(jnp.asarray(extra["key"], jnp.uint32))
            self.totals = {"dropped_batches": 0, **extra["totals"]}
            self.start_step = step
        # Batches the interrupted run had generated but not trained on (deterministic modes).
        self._resumed = self._rollouts_from_arrays(
            self.checkpointer.arrays(self.start_step) if restored is not None else None
        )
        self.metrics = MetricsWriter(
            self.out,
            resume_step=self.start_step if restored else None,
            enabled=distributed.is_main(),  # one writer per run: process 0
        )
        self.forecaster = OnlineForecast(cfg.forecast, cfg.train.steps, seed=cfg.seed)
        if restored:
            self.forecaster.replay(read_metrics(self.out))

    # ---------------------------------------------------------------------- placement

    def _place_state(self, params):
        """A fresh train state (version 0) from `params`, laid out as the train step expects."""
        state = init_train_state(params, self.tx, reference=self.reference)
        return jax.device_put(state, self.state_sharding)

    def _to_trainer(self, batch: Batch) -> Batch:
        """The batch moved to the trainer's layout (split over the mesh's batch axes), from
        wherever the generator made it. Across processes the batch is on the host and each
        process places its own rows."""
        if self.multiprocess:
            return jax.tree.map(distributed.place, batch, self.batch_sharding)
        return jax.device_put(batch, self.batch_sharding)

    def _to_generator(self, params):
        """Parameters resharded onto the generator's devices (a copy), when it has its own."""
        if self.gen_mesh is None:
            return params
        return distributed.transfer(params, sharding.state_shardings(params, self.gen_mesh))

    # ---------------------------------------------------------------------- generation

    def _encode(self, examples) -> list[list[int]]:
        return [self.tok.encode(e["prompt"]) for e in examples]

    def _generate(self, params_source, prompts: list[list[int]], key, *, sampling, n_new, repeat=1):
        """Sample `repeat` completions of each prompt (consecutive rows) with in-flight
        parameter swaps: `params_source()` -> (version, params) is read before prefill and
        again between decode chunks. Each prompt is prefilled once for its `repeat` rows."""
        host_tokens, host_mask = pad_prompts(prompts, self.tok.pad_id)
        mesh = self.gen_mesh or self.mesh
        # Unique prompts are few: every device holds them all; the rows they become are split
        # over the mesh inside prefill. Without repetition the rows are split from the start.
        where = (
            sharding.batch_sharding(mesh)
            if repeat == 1
            else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        )
        if self.multiprocess:
            tokens, mask = (
                distributed.place(host_tokens, where),
                distributed.place(host_mask, where),
            )
        elif self.gen_mesh is not None:
            tokens, mask = jax.device_put((host_tokens, host_mask), where)
        else:
            tokens, mask = jnp.asarray(host_tokens), jnp.asarray(host_mask)
        version, params = params_source()
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
        chunk = self.cfg.sampler.chunk_size or n_new
        while True:
            state = decode(self.graphdef, params, state, version, chunk, **static)
            if bool(jnp.all(state.done)) or int(state.step) >= n_new:
                break
            version, params = params_source()
        rows = lambda x: np.repeat(x, repeat, axis=0)  # noqa: E731
        return to_rollout(rows(host_tokens), rows(host_mask), state)

    def _completions(self, ro) -> list[str]:
        tokens, lengths = distributed.to_host(ro.completion_tokens), distributed.to_host(ro.lengths)
        return [self.tok.decode(t[:n]) for t, n in zip(tokens, lengths, strict=True)]

    def rollouts(self, params_source, key) -> Rollouts:
        """Draw a batch of prompts, sample G completions each, score, compute advantages."""
        cfg, g = self.cfg, self.cfg.train.group_size
        start = time.perf_counter()
        indices = self.curriculum.next_batch(cfg.train.prompts_per_step)
        examples = [self.task.train_examples[i] for i in indices]
        ro = self._generate(
            params_source,
            self._encode(examples),
            key,
            sampling=self.sampling,
            n_new=cfg.sampler.max_new_tokens,
            repeat=g,
        )
        texts = self._completions(ro)
        rewards = np.array([self.task.score(t, examples[i // g]) for i, t in enumerate(texts)])
        pass_rates = rewards.reshape(-1, g).mean(axis=1)
        self.curriculum.update(indices, pass_rates)
        adv, keep = group_advantages(
            rewards, g, normalize=cfg.loss.normalize, baseline=cfg.loss.baseline
        )
        if self.multiprocess:  # built on the host; each process then places its rows
            batch = Batch.from_rollout(jax.tree.map(distributed.to_host, ro), adv, keep, xp=np)
        else:
            batch = Batch.from_rollout(ro, adv, keep)
        batch = self._to_trainer(batch)
        lengths = distributed.to_host(ro.lengths)
        prompt_lens = distributed.to_host(ro.prompt_mask)[::g].sum(axis=1)
        stats = {
            "reward_mean": float(rewards.mean()),
            "pass_rate": float((pass_rates).mean()),
            "gen_length_mean": float(lengths.mean()),
            "interrupted_rate": ro.interrupted_rate,
            "kept_fraction": float(np.asarray(keep).mean()),
            "retired": int(self.curriculum.retired.sum()),
            "gen_tokens": int(lengths.sum()),
            **batch_flops(cfg.model, prompt_lens, lengths, reference=self.reference),
            "gen_seconds": time.perf_counter() - start,
        }
        return Rollouts(batch, indices, distributed.to_host(ro.versions), stats)

    def evaluate(self, params, key) -> float:
        """mean@k pass rate on the held-out split."""
        k = self.cfg.train.eval_samples
        examples = self.task.eval_examples
        sampling = Sampling(self.cfg.train.eval_temperature)
        params = self._to_generator(params)
        ro = self._generate(
            lambda: (-1, params),
            self._encode(examples),
            key,
            sampling=sampling,
            n_new=self.cfg.sampler.max_new_tokens,
            repeat=k,
        )
        texts = self._completions(ro)
        return float(np.mean([self.task.score(t, examples[i // k]) for i, t in enumerate(texts)]))

    # ---------------------------------------------------------------------- warm start

    def supervised_warm_start(self) -> list[float]:
        """Up to `train.sft_steps` steps of maximum likelihood on the task's demonstrations,
        fewer when the mean loss of the last 50 steps reaches `train.sft_target_loss`."""
        cfg = self.cfg.train
        if cfg.sft_steps == 0 or self.start_step > 0:
            return []
        tx = make_optimizer(cfg.sft_learning_rate, dataclasses.replace(cfg, warmup_steps=0))
        step = jax.jit(lambda p, o, t, a, m: sft_step(p, o, t, a, m, graphdef=self.graphdef, tx=tx))
        params, opt_state = self.state.params, tx.init(self.state.params)
        rng = np.random.default_rng(self.cfg.seed)
        losses = []
        n = cfg.sft_batch_size
        eos = self.tok.eos_ids[0]
        for _ in range(cfg.sft_steps):
            pick = rng.integers(0, len(self.task.train_examples), n)
            examples = [self.task.train_examples[i] for i in pick]
            seqs = [
                self.tok.encode(e["prompt"])
                + self.tok.encode(self.task.demonstration(e, rng))
                + [eos]
                for e in examples
            ]
            width = max(map(len, seqs))
            tokens = np.full((n, width), self.tok.pad_id, np.int32)
            attn = np.zeros((n, width), bool)
            target = np.zeros((n, width), np.float32)
            for i, (e, s) in enumerate(zip(examples, seqs, strict=True)):
                tokens[i, : len(s)], attn[i, : len(s)] = s, True
                target[i, len(self.tok.encode(e["prompt"])) : len(s)] = 1.0
            params, opt_state, loss = step(params, opt_state, tokens, attn, target)
            if not cfg.sft_target_loss:  # no host sync per step: dispatch runs ahead
                losses.append(loss)
                continue
            losses.append(float(loss))
            if len(losses) >= 50 and np.mean(losses[-50:]) < cfg.sft_target_loss:
                break
        self.state = self._place_state(params)
        return [float(x) for x in jax.device_get(losses)]

    # ---------------------------------------------------------------------- the loop

    def _log_step(self, step: int, metrics, ro: Rollouts, *, staleness, idle, eval_rate):
        t = self.totals
        stats = ro.stats
        t["compute_flops"] += stats["gen_flops"] + stats["train_flops"]
        t["tokens"] += stats["gen_tokens"]
        t["skipped_updates"] += int(metrics["skipped"])
        t["device_seconds"] = self.clock.device_seconds()
        now = time.perf_counter()
        tokens_per_s = stats["gen_tokens"] / max(now - self._last_log, 1e-9)
        self._last_log = now
        row = {
            "step": step,
            "policy_version": int(self.state.step),
            "compute_flops": t["compute_flops"],
            "device_seconds": t["device_seconds"],
            "tokens": t["tokens"],
            **{
                k: v
                for k, v in stats.items()
                if k not in ("gen_flops", "train_flops", "gen_tokens")
            },
            **{k: float(v) for k, v in metrics.items()},
            "staleness_mean": staleness[0],
            "staleness_max": staleness[1],
            "trainer_idle_fraction": idle,
            "tokens_per_s": tokens_per_s,
            "skipped_updates": t["skipped_updates"],
            "dropped_batches": t["dropped_batches"],
        }
        if eval_rate is not None:
            row["eval_pass_rate"] = eval_rate
            fields = self.forecaster.observe(step, row[self.cfg.forecast.x], eval_rate)
            row.update(fields or {})
        self.metrics.write(row)
        return row

    def _staleness(self, versions: np.ndarray) -> tuple[float, int]:
        sampled = versions[versions >= 0]
        if sampled.size == 0:
            return 0.0, 0
        lag = int(self.state.step) - sampled
        return float(lag.mean()), int(lag.max())

    def _save(self, step: int, feeder) -> None:
        extra = {
            "curriculum": self.curriculum.state_dict(),
            "key": np.asarray(jax.random.key_data(self.key)).tolist(),
            "totals": self.totals,
        }
        pending = list(getattr(feeder, "pending", []))  # the threaded generator's are not kept
        arrays = self._rollouts_to_arrays(pending) if pending else None
        self.checkpointer.save(step, self.state, extra, arrays)

    def _rollouts_to_arrays(self, batches: list[Rollouts]) -> dict[str, np.ndarray]:
        arrays: dict[str, np.ndarray] = {"count": np.asarray(len(batches))}
        for i, ro in enumerate(batches):
            batch = jax.tree.map(distributed.to_host, ro.batch)
            for f in dataclasses.fields(Batch):
                arrays[f"{i}.batch.{f.name}"] = getattr(batch, f.name)
            arrays[f"{i}.indices"], arrays[f"{i}.versions"] = ro.indices, ro.versions
            arrays[f"{i}.stats"] = np.asarray(json.dumps(ro.stats))
        return arrays

    def _rollouts_from_arrays(self, arrays: dict[str, np.ndarray] | None) -> list[Rollouts]:
        if arrays is None:
            return []
        batches = []
        for i in range(int(arrays["count"])):
            fields = {f.name: arrays[f"{i}.batch.{f.name}"] for f in dataclasses.fields(Batch)}
            batches.append(
                Rollouts(
                    self._to_trainer(Batch(**fields)),
                    arrays[f"{i}.indices"],
                    arrays[f"{i}.versions"],
                    json.loads(str(arrays[f"{i}.stats"])),
                )
            )
        return batches

    @property
    def _lockstep(self) -> bool:
        pipeline = self.cfg.pipeline
        return pipeline.mode == "pipeline_rl" and (pipeline.lockstep or self.multiprocess)

    def train(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        k = 0 if cfg.pipeline.mode == "sync" else cfg.pipeline.max_staleness
        rows: list[dict[str, Any]] = []
        self.stopped_early: str | None = None
        step = self.start_step
        if self.start_step == 0:
            self.supervised_warm_start()
            rows.append(self._initial_eval())
        self._last_log = time.perf_counter()
        # The compute clock runs from the first RL step: warm start and step-0 eval are out.
        self.clock = RunClock(self._devices(), seconds=self.totals["device_seconds"])
        self.clock.start()
        source = self._make_source()
        feeder = self._feeder(source, k)
        try:
            for step in range(self.start_step + 1, cfg.train.steps + 1):
                wait_start = time.perf_counter()
                ro = feeder.next()
                waited = time.perf_counter() - wait_start
                self._charge_dropped(feeder.take_dropped())
                step_start = time.perf_counter()
                staleness = self._staleness(ro.versions)
                if staleness[1] > k:
                    raise RuntimeError(
                        f"internal: batch {staleness[1]} versions old exceeds k = {k}"
                    )
                self.state, metrics = self.train_step(self.state, ro.batch)
                feeder.trained(self.state)  # new weights to the generator (lockstep: it runs)
                metrics = jax.device_get(metrics)
                if int(self.state.nonfinite) >= cfg.train.max_nonfinite:
                    raise FloatingPointError(
                        f"{int(self.state.nonfinite)} non-finite losses/gradients in a row at step "
                        f"{step}: lower train.learning_rate or check the model's dtype"
                    )
                idle = waited / max(waited + time.perf_counter() - step_start, 1e-9)
                eval_rate = None
                on_schedule = bool(cfg.train.eval_every) and step % cfg.train.eval_every == 0
                if on_schedule or step == cfg.train.steps:
                    with self.clock.excluded():
                        eval_rate = self.evaluate(
                            self.state.params, jax.random.fold_in(self.key, 10**9 + step)
                        )
                rows.append(
                    self._log_step(
                        step,
                        metrics,
                        ro,
                        staleness=staleness,
                        idle=idle,
                        eval_rate=eval_rate,
                    )
                )
                if distributed.is_main():
                    _progress(rows[-1], cfg.train.steps)
                    if "forecast_status" in rows[-1]:
                        print(self.forecaster.last.describe(), flush=True)
                stop = self.forecaster.should_stop() if eval_rate is not None else None
                if stop is not None:
                    if distributed.is_main():
                        print(stop, flush=True)
                    self.stopped_early = stop
                    break
                if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                    with self.clock.excluded():
                        self._save(step, feeder)
            self._save(step, feeder)
        finally:
            feeder.stop()
            self.clock.stop()
            self.checkpointer.close()
            self.metrics.close()
        return rows

    def _devices(self) -> int:
        """Every device the run holds: the trainer's and the generator's."""
        meshes = [self.mesh] + ([self.gen_mesh] if self.gen_mesh is not None else [])
        return sum(m.devices.size for m in meshes)

    def _charge_dropped(self, batches: list[Rollouts]) -> None:
        """Batches generated but never trained on: counted, logged, and their generation
        compute charged to the x-axis."""
        for ro in batches:
            self.totals["dropped_batches"] += 1
            self.totals["compute_flops"] += ro.stats["gen_flops"]
        if batches and distributed.is_main():
            print(
                f"dropped {len(batches)} stale batch(es); {self.totals['dropped_batches']} so far",
                file=sys.stderr,
                flush=True,
            )

    def _initial_eval(self) -> dict[str, Any]:
        row = {
            "step": 0,
            "policy_version": 0,
            "compute_flops": 0.0,
            "device_seconds": 0.0,
            "tokens": 0,
            "staleness_max": 0,
            "eval_pass_rate": self.evaluate(self.state.params, jax.random.fold_in(self.key, 10**9)),
        }
        self.forecaster.observe(0, 0.0, row["eval_pass_rate"])
        self.metrics.write(row)
        return row

    # ---------------------------------------------------------------------- feeding modes

    def _make_source(self) -> ParamsSource:
        version, params = int(self.state.step), self.state.params
        if self.gen_mesh is not None:
            return ParamsSource(version, params, place=self._push)
        if self.cfg.pipeline.mode == "pipeline_rl":
            # The train step donates its state; a concurrent generator needs its own copy.
            return ParamsSource(version, params, place=lambda v, p: jax.tree.map(jnp.copy, (v, p)))
        return ParamsSource(version, params)

    def _push(self, version, params):
        """(version, params) copied onto the generator's devices: `version` may be the train
        state's step counter, still on the trainer's devices."""
        if not isinstance(version, jax.Array):
            return version, self._to_generator(params)
        replicated = jax.sharding.NamedSharding(self.gen_mesh, jax.sharding.PartitionSpec())
        shardings = (replicated, sharding.state_shardings(params, self.gen_mesh))
        return distributed.transfer((version, params), shardings)

    def _feeder(self, source, k: int):
        mode = self.cfg.pipeline.mode
        # Batches generated before an interruption, unless too stale for this run's k.
        resumed, stale = [], []
        for ro in self._resumed:
            (resumed if self._staleness(ro.versions)[1] <= k else stale).append(ro)
        self._charge_dropped(stale)
        self._resumed = []
        if self._lockstep:
            if k < 1:
                raise ConfigError(
                    "pipeline.max_staleness: pipeline_rl in lockstep (always so across "
                    "processes) keeps the generator one batch ahead and needs k >= 1"
                )
            n_new, chunk = self.cfg.sampler.max_new_tokens, self.cfg.sampler.chunk_size
            return LockstepFeeder(
                self.rollouts,
                source,
                self.key,
                chunks=-(-n_new // (chunk or n_new)),
                start=int(self.state.step) + len(resumed),
                pending=resumed,
            )
        if mode == "pipeline_rl":
            return PipelineFeeder(
                self.rollouts, source, self.key, k=k, version=lambda: int(self.state.step)
            )
        per_policy = 1 if mode == "sync" else k
        return SyncFeeder(
            self.rollouts,
            source,
            self.key,
            per_policy=per_policy,
            round_=-(-int(self.state.step) // per_policy),  # rounds begun so far
            pending=resumed,
        )


def _meshes(cfg: ExperimentConfig):
    """(trainer mesh, generator mesh or None): `pipeline.generator_devices` takes the last
    devices for generation (batch-parallel, with the trainer's tensor axis) and leaves the rest,
    shaped by `mesh`, to the trainer. Across processes every process gives its last
    generator_devices / processes devices, so each holds devices of both meshes."""
    g = cfg.pipeline.generator_devices
    if g == 0:
        return sharding.make_mesh(cfg.mesh), None
    devices = jax.devices()
    if g >= len(devices):
        raise ConfigError(
            f"pipeline.generator_devices: {g} leaves no device for training "
            f"(there are {len(devices)})"
        )
    tensor = cfg.mesh.tensor if cfg.mesh.tensor > 0 else 1
    if g % tensor:
        raise ConfigError(
            f"pipeline.generator_devices: {g} is not a multiple of mesh.tensor={tensor}"
        )
    per_process: dict[int, list] = {}
    for d in devices:
        per_process.setdefault(d.process_index, []).append(d)
    n = len(per_process)
    if g % n or g // n >= min(len(ds) for ds in per_process.values()):
        raise ConfigError(
            f"pipeline.generator_devices: {g} must take the same number of devices from each "
            f"of the {n} processes and leave each some to train with (whole hosts that only "
            "generate are not supported)"
        )
    take = g // n
    gen = [d for p in sorted(per_process) for d in per_process[p][-take:]]
    train = [d for p in sorted(per_process) for d in per_process[p][:-take]]
    gen_mesh = sharding.make_mesh(MeshConfig(data=g // tensor, fsdp=1, tensor=tensor), gen)
    return sharding.make_mesh(cfg.mesh, train), gen_mesh


def _state_sharding(state, mesh):
    """The train state's layout: parameters (and the optimizer moments that mirror them) where
    their logical axes put them on `mesh`; everything else (counters, scalars) replicated."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def one(x):
        s = getattr(x, "sharding", None)
        return s if isinstance(s, jax.sharding.NamedSharding) and s.mesh == mesh else replicated

    return jax.tree.map(one, state)


def _interruption(cfg: ExperimentConfig, tok) -> Interruption | None:
    """The sampler's Interruption from config, its texts tokenized, checked against the budget:
    think_max + the text's tokens + answer_budget must fit in sampler.max_new_tokens."""
    i = cfg.sampler.interruption
    if i is None:
        return None
    encoded = {}
    for name in ("text", "think_end"):
        text = getattr(i, name)
        try:
            encoded[name] = tuple(tok.encode(text)) if text else ()
        except ValueError as e:
            raise ConfigError(f"sampler.interruption.{name}: cannot be tokenized: {e}") from None
    needed = i.think_max + len(encoded["text"]) + i.answer_budget
    if needed > cfg.sampler.max_new_tokens:
        raise ConfigError(
            f"sampler.max_new_tokens: {cfg.sampler.max_new_tokens} is below "
            f"interruption.think_max ({i.think_max}) + the text's {len(encoded['text'])} tokens "
            f"+ answer_budget ({i.answer_budget}) = {needed}"
        )
    return Interruption(
        encoded["text"], i.think_min, i.think_max, i.answer_budget, encoded["think_end"]
    )


def _check_divisible(cfg: ExperimentConfig, mesh, gen_mesh) -> None:
    """Batches split evenly over the batch axes of the meshes they live on."""
    batch = cfg.train.prompts_per_step * cfg.train.group_size
    checks = [("train.prompts_per_step x train.group_size", batch, mesh, "mesh")]
    if gen_mesh is not None:
        checks += [
            ("train.prompts_per_step x train.group_size", batch, gen_mesh, "generator"),
            (
                "task.num_eval x train.eval_samples",
                cfg.task.num_eval * cfg.train.eval_samples,
                gen_mesh,
                "generator",
            ),
        ]
    for name, size, m, where in checks:
        ways = m.shape["data"] * m.shape["fsdp"]
        if size % ways:
            raise ConfigError(
                f"{name}: {size} does not split over the {where}'s {ways} batch shards"
            )


def _progress(row: dict[str, Any], total: int) -> None:
    """A one-line status: redrawn in place on a terminal, printed on eval steps otherwise."""
    line = (
        f"step {row['step']}/{total}  reward {row.get('reward_mean', 0):.3f}  "
        f"loss {row.get('loss', 0):+.4f}  staleness {row.get('staleness_max', 0)}"
    )
    if "eval_pass_rate" in row:
        line += f"  eval {row['eval_pass_rate']:.3f}"
    if sys.stdout.isatty():
        print("\r" + line.ljust(100), end="\n" if "eval_pass_rate" in row else "", flush=True)
    elif "eval_pass_rate" in row:
        print(line, flush=True)


def train(cfg: ExperimentConfig, out: str | Path, *, resume: bool = True) -> list[dict[str, Any]]:
    """Train with RL per `cfg`, writing metrics, TensorBoard logs and checkpoints under `out`."""
    return Trainer(cfg, out, resume=resume).train()
