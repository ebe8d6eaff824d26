"""The rollout worker: prompts -> generation -> scores -> advantages -> a batch for the trainer.

worker = RolloutWorker(cfg, task, graphdef, mesh=mesh, gen_mesh=None)
ro = worker.rollouts(params_for_chunk, key)   # Rollouts: batch on the host, ...
batch = worker.to_trainer(ro.batch)          # in the trainer's shards
rate = worker.evaluate(params, key)           # held-out mean@k

It owns the task, its tokenizer, the curriculum and the sampling settings; the generation
itself is `generation.py`'s (static waves, or the slot engine's batch queue). It is the one
place where rollouts cross between host and device: completions come to the host to be
decoded and scored, the scored batch stays on the host while it waits, and `to_trainer` puts
it in the trainer's shards when the train loop takes it (each process placing its own rows
in a multi-process run); `rollouts_to_host` / `rollouts_from_host` keep waiting batches in a
checkpoint.

Threads. `rollouts` runs on the thread that feeds the trainer (the generator thread in
threaded `pipeline_rl`, else the main thread) and is the only code that touches the
curriculum after setup, and the slot engine with its queue (`sampler.batching:
continuous`, `generation.EngineBatches`); every batch carries a snapshot of the curriculum
taken right after it was drawn and scored, and checkpoints save snapshots, never the live
object. `evaluate` runs
on the main thread, concurrently with `rollouts` in threaded `pipeline_rl`: it reads only
what never changes (held-out examples, tokenizer, sampling settings) and calls the task's
verifier, which is safe to share (math's holds a lock; the others are pure functions).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxrl_scale.configbase import ConfigError
from jaxrl_scale.generation.sampler import (
    INTERRUPTED,
    Interruption,
    Rollout,
    Sampling,
)
from jaxrl_scale.models.lora import merge_params, state_bytes
from jaxrl_scale.models.policy import for_generation
from jaxrl_scale.parallel import distributed, sharding
from jaxrl_scale.rl.advantages import group_advantages
from jaxrl_scale.rl.agents import EngineAgents
from jaxrl_scale.rl.compute import batch_flops
from jaxrl_scale.rl.curriculum import Curriculum
from jaxrl_scale.rl.episodes import EngineEpisodes, EpisodeRunner
from jaxrl_scale.rl.generator import EngineBatches, WaveGenerator, batch_chunks, wave_prompts
from jaxrl_scale.rl.packing import Alone, PackedBatch, PackGeometry, padded_layout
from jaxrl_scale.rl.pipeline import ParamsForChunk
from jaxrl_scale.rl.step import Batch
from jaxrl_scale.tasks import Scorer, make_scorer
from jaxrl_scale.tasks.env import EnvRunner
from jaxrl_scale.tasks.scoring import ScorerBroken

if TYPE_CHECKING:  # the root config composes every part's section
    from jaxrl_scale.config import ExperimentConfig


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """One scored generation round: everything the trainer needs."""

    # Host arrays (packed with train.packing), placed in the trainer's shards when the train
    # loop takes the batch (`RolloutWorker.to_trainer`): the batches waiting in a feeder
    # hold no device memory (with router replay their experts are most of their bytes).
    batch: Batch | PackedBatch
    indices: np.ndarray  # [P] prompt indices
    versions: np.ndarray  # [B, N] policy version per sampled token (-1 elsewhere)
    stats: dict[str, float]
    curriculum: dict[str, np.ndarray]  # the curriculum right after this batch was scored
    samples: list[dict] | None = None  # log.rollouts: the first rows, for rollouts.jsonl


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
        frozen=None,  # a LoRA base (lora.py): params given to this worker are then adapters
    ):
        self.cfg, self.task, self.tok, self.graphdef = cfg, task, task.tokenizer, graphdef
        self.scorer = make_scorer(cfg.task, task)  # the verifier's worker processes
        if cfg.model.vocab_size < self.tok.vocab_size:
            raise ConfigError(
                f"model.vocab_size: {cfg.model.vocab_size} is below the task tokenizer's "
                f"{self.tok.vocab_size}"
            )
        self.mesh, self.gen_mesh = mesh, gen_mesh
        self.multiprocess = jax.process_count() > 1
        # The base as the generator decodes with it, placed once: on the generator's devices,
        # or the trainer's own buffers (never donated) in the compute dtype.
        self.generator_base = None if frozen is None else self._place(frozen, copy=False)
        s = cfg.sampler
        self.sampling = Sampling(s.temperature, s.top_p, s.top_k)
        self.interruption = Interruption.from_config(s, self.tok)
        self.reference = bool(cfg.loss.kl_coef)  # GRPO's KL term: the flops of its forward
        if len(task.train_examples) < cfg.train.prompts_per_step:  # a batch draws distinct ones
            raise ConfigError(
                f"train.prompts_per_step: {cfg.train.prompts_per_step} prompts a step, but the "
                f"task has {len(task.train_examples)} training example(s) (each step draws "
                "distinct ones; lower train.prompts_per_step, or give the task more examples"
                + (f", task.num_train is {cfg.task.num_train}" if cfg.task.num_train else "")
                + ")"
            )
        self.curriculum = Curriculum(
            len(task.train_examples),
            seed=cfg.seed,
            retire_threshold=cfg.curriculum.retire_threshold,
            no_positive_resampling=cfg.curriculum.no_positive_resampling,
        )
        # A multi-turn task's prompts come from its environments (rl/episodes.py): the
        # episode budget bounds them.
        self.episodic = hasattr(task, "make_env")
        self.agent = agent_of(cfg, task)
        if self.agent is not None:  # its episodes are its calls: rl/agents.py
            check_agent_run(cfg, self.tok, self.episodic)
            if self.multiprocess and not cfg.hosts.generator_groups:
                raise ConfigError(
                    "hosts.generator_groups: an agent task on several trainer processes runs "
                    "its agents on a generator group (one process of it serves the sessions); "
                    "set hosts.generator_groups >= 1"
                )
        if self.episodic and cfg.model.router_replay:
            raise ConfigError(
                "model.router_replay: a multi-turn task's episodes record no experts (their "
                "observations are not sampled); set model.router_replay=false"
            )
        if self.episodic and cfg.batching == "continuous" and self.interruption is not None:
            raise ConfigError(
                "sampler.interruption: a multi-turn task's episodes on the slot engine take no "
                "thinking interruption (use sampler.batching=static, or turn_tokens)"
            )
        examples = task.train_examples + task.eval_examples
        if self.episodic or self.agent is not None:
            longest = cfg.task.max_episode_tokens
            self.longest_prompt = cfg.task.prompt_tokens  # (the memory check's)
        else:  # widest prompts are padded to
            encoded = self._encode(examples)
            longest = self.longest_prompt = max(len(p) for p in encoded)
            _warn_unknown_characters(self.tok, encoded)
        row_shards = sharding.batch_ways(mesh)  # packed rows (train.packing), else None
        self.packing = PackGeometry.of(cfg, longest, row_shards) if cfg.train.packing else None
        self._warned_branches = False  # (assemble's caller's thread)
        self.waves = WaveGenerator(
            cfg, graphdef, self.tok, self.interruption, mesh=gen_mesh or mesh,
            own_devices=gen_mesh is not None, longest_prompt=longest,
        )  # fmt: skip
        # Continuous batching (rows in flight: sampler.slots, 0 = one batch's rows).
        self.continuous = None
        slots = s.slots or cfg.train.prompts_per_step * cfg.train.group_size
        self.episodes = None
        self.graphdef, self.slots = graphdef, slots
        if self.agent is not None:
            self.continuous = EngineAgents(
                cfg, graphdef, self.tok, task, self.agent, mesh=gen_mesh or mesh, slots=slots,
                curriculum=self.curriculum, examples=task.train_examples,
            )  # fmt: skip
        elif self.episodic:
            envs = EnvRunner(workers=cfg.task.env_workers, timeout=cfg.task.env_timeout)
            if self.tok.chat_template is None:
                _check_plain_environment(task, envs)
            self.episodes = EpisodeRunner(cfg, task, self.tok, self.generate, envs)
            if cfg.batching == "continuous":
                self.continuous = EngineEpisodes(
                    cfg, graphdef, self.tok, self.episodes, mesh=gen_mesh or mesh,
                    slots=slots, sampling=self.sampling, curriculum=self.curriculum,
                    examples=task.train_examples,
                )  # fmt: skip
        elif cfg.batching == "continuous":
            self.continuous = EngineBatches(
                cfg, graphdef, self.tok, self.interruption, mesh=gen_mesh or mesh,
                prompt_len=-(-longest // 8) * 8,
                slots=slots, sampling=self.sampling, curriculum=self.curriculum,
                examples=task.train_examples, encode=self._encode,
            )  # fmt: skip
        # Static waves (evaluation's always) are checked here, so a config whose waves cannot
        # split over the generator's devices fails at setup rather than at the first eval.
        ways = sharding.batch_ways(gen_mesh or mesh)
        wave_prompts(cfg, cfg.train.eval_samples, ways, len(task.eval_examples))
        self.chunks = batch_chunks(cfg, ways)  # lockstep swaps weights at the middle one

    # ------------------------------------------------------------------ placement

    def to_trainer(self, batch: Batch) -> Batch:
        """The batch (host arrays) split over the trainer mesh's batch axes, each device given
        only its own rows; across processes each process places its own."""
        shardings = sharding.batch_shardings(batch, self.mesh)
        if self.multiprocess:
            return jax.tree.map(distributed.place, batch, shardings)
        return jax.device_put(batch, shardings)

    def to_generator(self, params):
        """The parameters the generator decodes with (`model.for_generation`: matrices in the
        compute dtype, bit-identical samples). On its own devices: resharded there. On the
        trainer's in pipeline_rl, whose generator decodes while the train step that donates
        the trainer's parameters runs: a copy. Otherwise (sync, ppo_off_policy: generation ends
        before training starts) the trainer's own, with no copy beside the train state.
        With LoRA, `params` are the adapters: only they move, on top of `generator_base`."""
        placed = self._place(params, copy=decodes_with_copy(self.cfg, self.gen_mesh))
        return merge_params(self.generator_base, placed)

    def update_bytes(self, params, *, remote: bool = False) -> int:
        """Bytes one weight update moves or copies to a generator (`to_generator`, or a
        generator job's pull with `remote`): 0 where it decodes with the trainer's own
        buffers."""
        if not remote and not decodes_with_copy(self.cfg, self.gen_mesh):
            return 0
        return state_bytes(jax.eval_shape(lambda p: for_generation(p, self.cfg.model), params))

    def _place(self, params, *, copy: bool):
        if self.gen_mesh is not None:
            params = for_generation(params, self.cfg.model, copy=False)
            return distributed.transfer(params, sharding.state_shardings(params, self.gen_mesh))
        if copy:
            return for_generation(params, self.cfg.model)
        if self.cfg.model.lora.enabled:  # the base, cast where the compute dtype is narrower
            return for_generation(params, self.cfg.model, copy=False)
        return params

    # ------------------------------------------------------------------ generation

    def generate(self, params_for_chunk: ParamsForChunk, prompts, key, **kwargs) -> Rollout:
        """Static generation of `prompts` on the generator's devices (`WaveGenerator.generate`:
        `sampling`, `n_new`, `repeat`, `with_fill`)."""
        return self.waves.generate(params_for_chunk, prompts, key, **kwargs)

    @property
    def engine(self):
        """The slot engine (continuous batching, once the first batch was drawn) or None."""
        return None if self.continuous is None else self.continuous.engine

    def _encode(self, examples) -> list[list[int]]:
        return [self.tok.encode(e["prompt"]) for e in examples]

    def close(self) -> None:
        """Stop what serves an agent task's sessions (its server thread, its agent pool)."""
        if self.agent is not None:
            self.continuous.close()

    def in_flight(self) -> tuple[int, int]:
        """(prompts drawn into the engine and not handed over in a batch, rows of them already
        generating or generated): work the run's end leaves untrained."""
        return (0, 0) if self.continuous is None else self.continuous.in_flight()

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
        if self.episodic or self.agent is not None:
            if cfg.batching == "continuous":
                indices, ro, rewards, stats = self.continuous.next(params_for_chunk, key, oldest)
                stats["slot_occupancy"] = self.continuous.occupancy
            else:
                indices = self.curriculum.next_batch(cfg.train.prompts_per_step)
                examples = [self.task.train_examples[i] for i in indices]
                ro, rewards, stats = self.episodes.run(
                    params_for_chunk, examples, key, sampling=self.sampling, repeat=g
                )
            scored = score_episodes(cfg, ro, rewards, stats, reference=self.reference)
            self.curriculum.update(indices, scored.pass_rates)
            seconds = time.perf_counter() - start
            meta = getattr(self.continuous, "meta", None) if self.agent is not None else None
            return self.assemble(scored, indices, self._curriculum_snapshot(), seconds, meta)
        if cfg.batching == "continuous":
            indices, ro = self.continuous.next(params_for_chunk, key, oldest)
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
        scored = score_rollout(self.cfg, self.scorer, ro, examples, reference=self.reference)
        if cfg.batching == "continuous":
            scored.stats["slot_occupancy"] = self.continuous.occupancy
        self.curriculum.update(indices, scored.pass_rates)
        seconds = time.perf_counter() - start
        return self.assemble(scored, indices, self._curriculum_snapshot(), seconds)

    def idle(self, params_for_chunk: ParamsForChunk) -> bool:
        """While pipeline_rl's generator thread waits (for the trainer, for room in the
        buffer): for an agent task, one engine run for the batch queued ahead (its agents'
        calls decode meanwhile, with the newest weights), or a few milliseconds' wait for
        them; whether there was anything to do (False once the batch's agents have all
        ended: the feeder then waits as for any task). Other tasks: nothing (False)."""
        if self.agent is None or not self.continuous.queued:
            return False
        return self.continuous.step(params_for_chunk)

    def assemble(self, scored: Scored, indices, curriculum: dict, seconds: float,
                 meta: list[dict] | None = None) -> Rollouts:  # fmt: skip
        """The trainer's batch from a scored rollout (made here or by a generator job):
        advantages, the batch on the host, the row's statistics, and with `log.rollouts`
        its first rows as samples (`meta`: what each row adds, an agent's session).
        `curriculum`: the snapshot taken after the batch's pass rates were recorded."""
        cfg, ro = self.cfg, scored.ro
        check_environments(cfg, scored)
        adv, keep = group_advantages(
            scored.rewards, cfg.train.group_size, normalize=cfg.loss.normalize,
            baseline=cfg.loss.baseline,
        )  # fmt: skip
        branches = None  # an agent task's rows: each row's other branches (rl/agents.py)
        if meta is not None:
            meta = [dict(m) for m in meta]
            branches = [m.pop("branches", []) for m in meta]
        alone = _alone(branches, keep) if branches is not None else None
        if alone and self.packing is None and not self._warned_branches:
            self._warned_branches = True
            warnings.warn(
                "an agent's other branches train in packed steps only (train.packing: true or "
                "auto); with train.packing false only each episode's last branch trains "
                "(agent_branches_trained counts those that did)", stacklevel=2,
            )  # fmt: skip
        batch, layout = _trainer_batch(ro, adv, keep, cfg.train.group_size, self.packing, alone)
        if branches is not None:
            layout["agent_branches_trained"] = layout.pop("alone", 0)
            layout["agent_branches_left"] = layout.pop("alone_left", 0)  # longer than a row
        stats = {
            **scored.stats,
            **layout,  # train_tokens, train_positions
            "kept_fraction": float(np.asarray(keep).mean()),
            "retired": int(np.asarray(curriculum["retired"]).sum()),
            "gen_seconds": seconds,
        }
        samples = None
        if cfg.log.rollouts:
            samples = _samples(self.tok, ro, scored.rewards, adv, cfg.log.rollouts, meta,
                               branches)  # fmt: skip
        return Rollouts(batch, np.asarray(indices), scored.versions, stats, curriculum, samples)

    def _curriculum_snapshot(self) -> dict[str, np.ndarray]:
        """The curriculum as a checkpoint keeps it. A batch queued ahead in the engine was
        drawn but not trained: the snapshot's cursor sits before it, so a resumed run draws
        those prompts again (the rows in flight are regenerated, not skipped)."""
        state = self.curriculum.state_dict()
        cursor = None if self.continuous is None else self.continuous.cursor()
        if cursor is not None:
            state["epoch"], state["position"] = map(np.asarray, cursor)
        return state

    def evaluate(self, params, key) -> float:
        """mean@k pass rate on the held-out split (k = train.eval_samples)."""
        return self.evaluate_with_sd(params, key)[0]

    def evaluate_with_sd(self, params, key, *, placed=None) -> tuple[float, float]:
        """(mean@k pass rate on the held-out split, its sampling sd; see `sampling_sd`)."""
        row = self.evaluate_row(params, key, placed=placed)
        return row["eval_pass_rate"], row["eval_sampling_sd"]

    def evaluate_row(self, params, key, *, placed=None) -> dict[str, float]:
        """The metrics of a held-out evaluation (`held_out_row`) of `params`. `placed`: the
        same parameters already as the generator decodes them (the newest published copy),
        evaluated without placing another copy beside the generator's."""
        frozen = (-1, self.to_generator(params) if placed is None else placed)
        examples = self.task.eval_examples
        if self.agent is not None:
            scores, counts = self.continuous.evaluate(frozen[1], examples)
            return held_out_row(scores, counts, examples)
        scores, counts = held_out_scores(
            self.cfg, self.scorer, self.generate, self.episodes if self.episodic else None,
            lambda chunk: frozen, examples, key,
        )  # fmt: skip
        return held_out_row(scores, counts, examples)


def _samples(tok, ro: Rollout, rewards, adv, n: int, meta: list[dict] | None,
             branches: list[list[dict]] | None = None) -> list[dict]:  # fmt: skip
    """The first `n` samples as rollouts.jsonl writes them: `tokens` the sequence's ids
    (prompt, then completion), `mask` as long, 1 exactly where a sampled id trains, `logp` and
    `versions` alike (0 and -1 off the mask), `reward` (null: left out of the loss) and
    `advantage`, the `text`; plus the row's `meta` (an agent's session, branch, calls), then
    the row's other `branches` (an agent's), each a sample with the row's reward."""
    ro = jax.tree.map(distributed.to_host, ro)
    adv = np.asarray(distributed.to_host(adv))
    out = []
    for i in range(len(rewards)):
        if len(out) >= n:
            break
        prompt = ro.prompt_tokens[i][ro.prompt_mask[i].astype(bool)].tolist()
        k = int(ro.lengths[i])
        tokens = prompt + ro.completion_tokens[i, :k].tolist()
        reward = float(rewards[i])
        sample = {
            "tokens": tokens,
            "mask": [0] * len(prompt) + [int(m) for m in ro.completion_mask[i, :k]],
            "logp": [0.0] * len(prompt) + [float(x) for x in ro.behavior_logp[i, :k]],
            "versions": [-1] * len(prompt) + [int(v) for v in ro.versions[i, :k]],
            "reward": reward if np.isfinite(reward) else None,
            "advantage": float(adv[i]),
            "text": tok.decode(tokens, skip_special_tokens=False),
        }
        if meta is not None:
            sample.update(meta[i])
        out.append(sample)
        for b in branches[i] if branches is not None else ():
            out.append({
                "tokens": b["ids"], "mask": b["mask"], "logp": b["logp"],
                "versions": b["versions"], "reward": sample["reward"],
                "advantage": sample["advantage"],
                "text": tok.decode(b["ids"], skip_special_tokens=False),
                "session": sample.get("session"), "branch": b["branch"], "calls": b["calls"],
            })  # fmt: skip
    return out[:n]


def _alone(branches: list[list[dict]], keep) -> list[Alone]:
    """The other branches of the kept rows (`keep`), as packed sequences of their own
    (packing.Alone) counted as their row's."""
    keep = np.asarray(distributed.to_host(keep))
    return [
        Alone(
            i,
            np.asarray(b["ids"], np.int32),
            np.asarray(b["mask"], np.float32),
            np.asarray(b["logp"], np.float32),
        )  # fmt: skip
        for i, row in enumerate(branches)
        if keep[i]
        for b in row
    ]


def agent_of(cfg: ExperimentConfig, task):
    """The run's agent (`task.agent`'s import path, else the task's own `agent`), or None."""
    if not cfg.task.agent:
        return getattr(task, "agent", None)
    from jaxrl_scale.tasks.user import import_factory

    try:
        return import_factory(cfg.task.agent)
    except ConfigError as e:
        raise ConfigError(str(e).replace("task.name", "task.agent", 1)) from None


def check_agent_run(cfg: ExperimentConfig, tok, episodic: bool) -> None:
    if episodic:
        raise ConfigError("task.agent: a task runs an agent or environments (make_env), not both")
    if cfg.batching != "continuous":
        raise ConfigError(
            "sampler.batching: an agent's calls are served by the slot engine: set "
            "sampler.batching=continuous"
        )
    if tok.chat_template is None:
        raise ConfigError(
            "model.init_from: an agent's calls are chat messages, rendered with the checkpoint's "
            "chat template, and this tokenizer has none"
        )
    if cfg.model.router_replay or cfg.sampler.interruption is not None:
        key = "model.router_replay" if cfg.model.router_replay else "sampler.interruption"
        raise ConfigError(f"{key}: not with an agent task (set it off)")


def held_out_scores(
    cfg: ExperimentConfig, scorer, generate, episodes, params_for_chunk, examples, key
) -> tuple[np.ndarray, dict[str, float]]:
    """k = train.eval_samples samples of each held-out example, scored: ([examples, k]
    pass signals, or episode returns for a multi-turn task; the scorer's or the episodes'
    counts). `generate`: static waves (`WaveGenerator.generate`); `episodes`: a multi-turn
    task's runner, else None. Run by the trainer's worker, or by a generator job for a part
    of the held-out set (hosts/hub.py)."""
    k = cfg.train.eval_samples
    sampling = Sampling(cfg.train.eval_temperature)
    if episodes is not None:  # whole episodes; the pass rate is the mean episode return
        _, returns, stats = episodes.run(params_for_chunk, examples, key, sampling=sampling,
                                         repeat=k, training=False)  # fmt: skip
        keep = ("turns_mean", "env_errors", "episodes_truncated", "episodes_out_of_turns",
                "tool_errors")  # fmt: skip
        return returns.reshape(len(examples), k), {name: stats[name] for name in keep}
    tok = scorer.task.tokenizer
    ro = generate(
        params_for_chunk,
        [tok.encode(e["prompt"]) for e in examples],
        key,
        sampling=sampling,
        n_new=cfg.sampler.max_new_tokens,
        repeat=k,
    )
    texts = completion_texts(tok, ro)
    scored = scorer(texts, [examples[i // k] for i in range(len(texts))])
    return scored.passed.reshape(len(examples), k), dict(scored.counts)


def held_out_row(scores: np.ndarray, counts: dict[str, float], examples) -> dict[str, float]:
    """The metrics of a held-out evaluation from its scores [examples, k]: `eval_pass_rate`
    (mean@k) and its sampling sd `eval_sampling_sd` (see `sampling_sd`), the counts as
    `eval_<name>`, and for a mixture of domains the same over each domain's prompts
    (`eval_pass_rate/<domain>`, `eval_sampling_sd/<domain>`)."""
    row = {"eval_pass_rate": float(scores.mean()), "eval_sampling_sd": sampling_sd(scores)}
    row.update({f"eval_{name}": v for name, v in counts.items()})  # errors, turns, ...
    domains = np.array([e.get("domain") for e in examples], dtype=object)
    for d in dict.fromkeys(domains.tolist()) if domains[0] is not None else ():
        mine = scores[domains == d]
        row[f"eval_pass_rate/{d}"] = float(mine.mean())
        row[f"eval_sampling_sd/{d}"] = sampling_sd(mine)
    return row


@dataclasses.dataclass(frozen=True)
class Scored:
    """A generated batch, scored: what a generator hands the trainer (rollout.py `assemble`
    turns it into the trainer's batch). `ro` is on the generator's devices or the host."""

    ro: Rollout  # the rows asked for (fill rows cut off)
    rewards: np.ndarray  # [B]
    versions: np.ndarray  # [B, N] policy version per sampled token, on the host
    pass_rates: np.ndarray  # [P]: each group's mean pass signal (Scored.passed)
    stats: dict[str, float]


def completion_texts(tok, ro: Rollout) -> list[str]:
    """Each row's completion, decoded (on the host, from wherever `ro` lives)."""
    tokens, lengths = distributed.to_host(ro.completion_tokens), distributed.to_host(ro.lengths)
    return [tok.decode(t[:n]) for t, n in zip(tokens, lengths, strict=True)]


def score_rollout(
    cfg: ExperimentConfig, scorer: Scorer, ro: Rollout, examples, *, reference: bool
) -> Scored:
    """Decode and score (`scorer`, over its task) `ro`'s completions of `examples` (G
    consecutive rows each, then any rows that only filled up the last wave), with the
    statistics of its rows: lengths, the generation's FLOPs (fill rows' decode included, as
    they were computed), rewards, their named parts and the samples scoring failed on."""
    g, tok = cfg.train.group_size, scorer.task.tokenizer
    rows, fill = len(examples) * g, None
    if ro.lengths.shape[0] > rows:  # rows decoded only to fill the last wave up
        fill = jax.tree.map(lambda x: x[rows:], ro)
        ro = jax.tree.map(lambda x: x[:rows], ro)
    texts = completion_texts(tok, ro)
    lengths = distributed.to_host(ro.lengths)
    start = time.perf_counter()
    scores = scorer(texts, [examples[i // g] for i in range(len(texts))])
    rewards = scores.rewards
    finish, versions, prompt_mask = (
        distributed.to_host(x) for x in (ro.finish_reason, ro.versions, ro.prompt_mask)
    )
    prompt_lens = prompt_mask[::g].sum(axis=1)
    pass_rates = scores.passed.reshape(-1, g).mean(axis=1)  # the curriculum's, the row's
    stats = {
        "reward_mean": float(rewards.mean()),
        "pass_rate": float(pass_rates.mean()),
        "gen_length_mean": float(lengths.mean()),
        "interrupted_rate": float(np.mean(finish == INTERRUPTED)),
        "gen_tokens": int(lengths.sum()),
        **batch_flops(cfg.model, prompt_lens, lengths, reference=reference),
        "gen_fill_rows": 0 if fill is None else int(fill.lengths.shape[0]),
        **scores.stats(),  # reward/<part>, reward_errors, reward_timeouts, think_unclosed
        "score_seconds": time.perf_counter() - start,
    }
    if fill is not None:  # compute spent, nothing to train on: on the x-axis
        fill_lengths, fill_mask = map(distributed.to_host, (fill.lengths, fill.prompt_mask))
        fill_prompts = fill_mask[::g].sum(axis=1)
        stats["gen_flops"] += batch_flops(cfg.model, fill_prompts, fill_lengths)["gen_flops"]
    return Scored(ro, rewards, versions, pass_rates, stats)


def score_episodes(
    cfg: ExperimentConfig, ro: Rollout, rewards, stats: dict, *, reference: bool
) -> Scored:
    """A batch of episodes (rl/episodes.py) as a scored batch: its returns are the rewards
    and pass signals; `gen_tokens` counts the model's tokens only (observations are context),
    the FLOPs every token the model read or wrote."""
    g = cfg.train.group_size
    sampled = ro.completion_mask.sum(axis=1)
    trained = np.isfinite(rewards)  # NaN: an episode left out of the loss (rl/episodes.py)
    with np.errstate(invalid="ignore", divide="ignore"):  # a group with none: NaN, unknown
        pass_rates = np.nansum(rewards.reshape(-1, g), 1) / trained.reshape(-1, g).sum(1)
    prompt_lens = ro.prompt_mask.sum(axis=1)
    stats = {
        "reward_mean": float(rewards[trained].mean()) if trained.any() else float("nan"),
        "pass_rate": float(np.nanmean(pass_rates)) if trained.any() else float("nan"),
        "episodes_trained": int(trained.sum()),
        "gen_length_mean": float(sampled.mean()),
        "interrupted_rate": 0.0,
        "gen_tokens": int(sampled.sum()),
        **batch_flops(cfg.model, prompt_lens, ro.lengths, reference=reference),
        "gen_fill_rows": 0,
        **stats,
    }
    return Scored(ro, rewards, ro.versions, pass_rates, stats)


def check_environments(cfg: ExperimentConfig, scored: Scored) -> None:
    """A batch of episodes more than `task.max_failure_fraction` of which failed in their
    environment ends the run (ScorerBroken), as broken scoring does: a run that trains on
    what little is left for hours is worse than one that stops and says why."""
    failed, n = scored.stats.get("env_errors", 0), len(scored.rewards)
    if failed and failed > cfg.task.max_failure_fraction * n:
        raise ScorerBroken(
            f"{failed} of a batch's {n} episodes failed in their environment (the first "
            "failure of each kind is logged above): more than task.max_failure_fraction "
            f"({cfg.task.max_failure_fraction:g}); fix the environment, or raise the key"
        )


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


def _trainer_batch(ro, adv, keep, group_size: int, packing: PackGeometry | None, alone=None):
    """(the batch the trainer computes, on the host; its row's train_tokens /
    train_positions / train_packed): packed in `packing`'s rows (`PackGeometry.layout`, with
    the sequences `alone`), or padded (without them)."""
    ro = jax.tree.map(distributed.to_host, ro)
    batch = Batch.from_rollout(ro, adv, keep, xp=np)
    padded = padded_layout(ro, group_size)
    if packing is None:
        return batch, padded
    return packing.layout(batch, group_size, padded, alone)


# --------------------------------------------------------------------------- checkpointed batches


def rollouts_to_host(batches: list[Rollouts]) -> dict[str, Any]:
    """Batches as a tree of host arrays (for a checkpoint; a packed batch's completion count
    rides as an array)."""

    def one(ro: Rollouts) -> dict[str, Any]:
        batch = {
            f.name: distributed.to_host(getattr(ro.batch, f.name))
            for f in dataclasses.fields(ro.batch)
            if f.name != "num_seqs" and getattr(ro.batch, f.name) is not None
        }
        if isinstance(ro.batch, PackedBatch):
            batch["num_seqs"] = np.asarray(ro.batch.num_seqs)
        return {
            "batch": batch,
            "indices": np.asarray(ro.indices),
            "versions": np.asarray(ro.versions),
            "stats": {k: np.asarray(v) for k, v in ro.stats.items()},
            "curriculum": dict(ro.curriculum),
        }

    return {str(i): one(ro) for i, ro in enumerate(batches)}


def rollouts_from_host(tree: dict[str, Any], *, router_replay: bool = False) -> list[Rollouts]:
    """The inverse of `rollouts_to_host` (host batches, as a feeder hands them over), with
    their recorded experts where the run replays them (`router_replay`: model.router_replay)."""
    out, unreplayed = [], 0
    for i in range(len(tree)):
        t = tree[str(i)]
        fields = dict(t["batch"])
        if not router_replay:  # experts recorded by a replaying run: this one routes afresh
            unreplayed += fields.pop("routes", None) is not None
        elif "routes" not in fields:
            raise ConfigError(
                "model.router_replay: the checkpoint's waiting batches were sampled without "
                "recording their experts; resume with model.router_replay=false (until they "
                "are trained) or from a checkpoint of a replaying run"
            )
        out.append(
            Rollouts(
                _batch_from_host(fields),
                t["indices"],
                t["versions"],
                {k: np.asarray(v).item() for k, v in t["stats"].items()},
                t["curriculum"],
            )
        )
    if unreplayed:
        warnings.warn(
            f"{unreplayed} waiting batches of the checkpoint recorded their experts; "
            "model.router_replay is off, so they train with the trainer's own routes",
            stacklevel=2,
        )
    return out


def _batch_from_host(fields: dict[str, Any]) -> Batch | PackedBatch:
    if "num_seqs" in fields:
        return PackedBatch(**{**fields, "num_seqs": int(fields["num_seqs"])})
    return Batch(**fields)


def _warn_unknown_characters(tok, encoded: list[list[int]], share: float = 0.01) -> None:
    """Warn when the tokenizer turned more than `share` of the prompts' tokens into its
    padding or unknown token: text it does not cover, which the model would see as padding
    (a prompt's own tokens are never padding; rows are padded later, beside them)."""
    unk = getattr(tok.backend.model, "unk_token", None)
    flagged = {i for i in (tok.backend.token_to_id(unk) if unk else None,) if i is not None}
    if tok.pad_id not in tok.eos_ids:  # a pad that is the end token may stand in a prompt
        flagged.add(tok.pad_id)
    total = sum(len(p) for p in encoded)
    bad = sum(1 for p in encoded for i in p if i in flagged)
    if total and bad / total > share:
        names = ", ".join(f"{i} {tok.backend.id_to_token(i)!r}" for i in sorted(flagged))
        warnings.warn(
            f"the tokenizer turns {bad / total:.0%} of the prompts' tokens ({bad:,} of "
            f"{total:,}) into padding or unknown tokens (id {names}): text it does not cover, "
            "which the model sees as padding. Use a tokenizer that covers the task's text "
            "(model.init_from a checkpoint made for it), or keep the prompts to its characters",
            stacklevel=3,
        )


def _check_plain_environment(task, envs) -> None:
    """Refuse, at setup, episodes that need a chat template the tokenizer lacks: a task with
    `tools`, or environments whose first observation is chat messages (probed on one
    environment of the first training example)."""
    need = (
        "the tokenizer has no chat template (a checkpoint's tokenizer_config.json "
        "'chat_template' or chat_template.jinja): start from an instruct checkpoint "
        "(model.init_from), or give the environment plain-text observations"
    )
    if getattr(task, "tools", None):
        raise ConfigError(f"task: a tool task's episodes are chat conversations, but {need}")
    [(env, why)] = envs.make(task, task.train_examples[:1])
    if env is None:  # the environment's own error: counted per episode when the run meets it
        return
    [(obs, why)] = envs.reset([env])
    if isinstance(obs, list) or getattr(env, "tools", None):
        what = "chat messages" if isinstance(obs, list) else "offered with tools"
        raise ConfigError(f"task: the environment's first observation is {what}, but {need}")
