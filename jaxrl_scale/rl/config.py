"""The RL side of a run: the objective (`loss.*`), the optimiser (`optim.*`), the supervised
warm start (`warm_start.*`), the step (`train.*`), PipelineRL-k (`pipeline.*`), the
curriculum (`curriculum.*`) and checkpoints (`checkpoint.*`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl_scale.configbase import require
from jaxrl_scale.rl.losses import KINDS


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The policy-gradient objective; unset hyper-parameters take the kind's defaults."""

    kind: Literal["cispo", "dapo", "gspo", "grpo"] = "cispo"
    aggregation: Literal["prompt", "sample", "token"] = "prompt"
    normalize: Literal["batch", "prompt", "none"] = "batch"
    baseline: Literal["mean", "rloo"] = "mean"
    eps_max: float | None = None  # cispo
    eps_low: float | None = None  # dapo, gspo, grpo
    eps_high: float | None = None
    kl_coef: float | None = None  # grpo: k3 KL to the policy at the start of RL
    # Drop the objective of tokens ("token") or whole sequences ("sequence", by their
    # geometric-mean ratio) whose ratio pi_trainer / pi_sampler lies outside
    # [1 / mismatch_threshold, mismatch_threshold], with every loss kind (losses.py). The
    # ratio is the sampler/trainer numerics and, off-policy, up to k versions of policy lag
    # together: the mask bounds both (a hard trust region), not the numerics alone.
    mismatch_mask: Literal["none", "token", "sequence"] = "none"
    mismatch_threshold: float = 2.0

    def hyper(self) -> dict[str, float]:
        """The hyper-parameters set here, checked against what the loss kind takes."""

        takes = dict(KINDS[self.kind].defaults)
        given = {
            k: v
            for k in ("eps_max", "eps_low", "eps_high", "kl_coef")
            if (v := getattr(self, k)) is not None
        }
        wrong = sorted(set(given) - set(takes))
        require(
            not wrong,
            f"loss.{wrong[0] if wrong else ''}",
            f"is not a parameter of loss.kind={self.kind} (it takes {sorted(takes)})",
        )
        return given

    def __post_init__(self):
        self.hyper()
        require(self.kl_coef is None or self.kl_coef >= 0, "loss.kl_coef", "must be >= 0")
        require(
            self.mismatch_threshold > 1,
            "loss.mismatch_threshold",
            f"must be > 1 (the band is [1/t, t]), got {self.mismatch_threshold}",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW after global-norm clipping, linear warm-up then a constant (or cosine) learning
    rate: step.make_optimizer builds it, for RL (`optim`) and the warm start
    (`warm_start.optim`) alike."""

    learning_rate: float = 3e-4
    warmup_steps: int = 10
    schedule: Literal["constant", "cosine"] = "constant"
    weight_decay: float = 0.01
    adam_eps: float = 1e-15
    grad_clip: float = 1.0

    def __post_init__(self):
        require(self.learning_rate > 0, "optim.learning_rate", "must be > 0")
        require(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        require(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        require(self.adam_eps > 0, "optim.adam_eps", "must be > 0")
        require(self.grad_clip > 0, "optim.grad_clip", "must be > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmStartConfig:
    """Supervised steps on the task's demonstrations before RL (warm_start.py)."""

    steps: int = 0  # at most this many; 0: no warm start
    # Stop early once the mean demonstration loss of the last 50 steps is below this (0: run
    # every step). A target loss lands every seed at a similar skill, where a fixed step count
    # lands each at a different point of a steep learning curve.
    target_loss: float = 0.0
    batch_size: int = 128
    optim: OptimConfig = dataclasses.field(
        default_factory=lambda: OptimConfig(learning_rate=3e-3, warmup_steps=0)
    )

    def __post_init__(self):
        require(self.steps >= 0, "warm_start.steps", "must be >= 0")
        require(self.target_loss >= 0, "warm_start.target_loss", "must be >= 0")
        require(self.batch_size >= 1, "warm_start.batch_size", "must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 20
    prompts_per_step: int = 8  # P
    group_size: int = 8  # G samples per prompt
    micro_batches: int = 1  # gradient accumulation over this many slices of the batch
    max_nonfinite: int = 5  # abort after this many skipped updates in a row
    eval_every: int = 10
    eval_samples: int = 4  # k in mean@k
    eval_temperature: float = 1.0
    # Packed train steps (packing.py): the batch's real tokens in rows of `pack_length`
    # positions (0: twice the padded row, cut to attention blocks), each prompt once per row
    # segment, instead of every completion slot up to the budget. Same loss, gradients and
    # metrics as the padded step, to float rounding. true: every batch packed; auto: a batch
    # is packed where that computes fewer positions than the padded step; false: padded.
    packing: bool | Literal["auto"] = "auto"
    pack_length: int = 0
    # With packing: micro-steps of at most this many positions per batch shard (a device, or
    # its fsdp / tensor group), whole rows (0: `micro_batches` slices), so a batch of long
    # completions runs as more micro-steps instead of running out of memory.
    tokens_per_micro_batch: int = 0
    # At setup, refuse a run whose train step or generator the memory plan says does not fit
    # the devices (memory/check.py: a rough screen first, the compiled plan past a quarter
    # of the memory).
    check_memory: bool = True

    def __post_init__(self):
        for name in (
            "steps",
            "prompts_per_step",
            "group_size",
            "micro_batches",
            "max_nonfinite",
            "eval_samples",
        ):
            require(getattr(self, name) >= 1, f"train.{name}", "must be >= 1")
        require(self.eval_every >= 0, "train.eval_every", "must be >= 0")
        for name in ("pack_length", "tokens_per_micro_batch"):
            require(getattr(self, name) >= 0, f"train.{name}", "must be >= 0")
            require(
                self.packing or not getattr(self, name),
                f"train.{name}",
                "applies to packed steps only (set train.packing: true or auto)",
            )
        if self.tokens_per_micro_batch and self.pack_length:
            require(
                self.tokens_per_micro_batch >= self.pack_length,
                "train.tokens_per_micro_batch",
                f"must hold at least one packed row (train.pack_length {self.pack_length})",
            )
        require(
            self.prompts_per_step % self.micro_batches == 0,
            "train.micro_batches",
            f"must divide prompts_per_step ({self.prompts_per_step})",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    mode: Literal["pipeline_rl", "ppo_off_policy", "sync"] = "pipeline_rl"
    max_staleness: int = 8  # k
    # Devices (the last ones; across processes, the last generator_devices / processes of each
    # process) that only generate; the trainer's mesh spans the others. 0: both share every
    # device. New parameters reach the generator by a resharding copy, never a file.
    generator_devices: int = 0
    # pipeline_rl only: generation and training take turns from one thread in a fixed order
    # (the generator one batch ahead, new weights swapped in halfway through its decoding), so
    # a run is deterministic for a seed. Always on across processes, where every process must
    # issue the same programs in the same order.
    lockstep: bool = False

    def __post_init__(self):
        require(self.max_staleness >= 0, "pipeline.max_staleness", "must be >= 0")
        require(self.generator_devices >= 0, "pipeline.generator_devices", "must be >= 0")
        require(
            self.mode != "ppo_off_policy" or self.max_staleness >= 1,
            "pipeline.max_staleness",
            "ppo_off_policy needs k >= 1 (k minibatches per policy)",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurriculumConfig:
    no_positive_resampling: bool = True
    retire_threshold: float = 0.9  # a prompt whose latest pass rate reaches this is retired

    def __post_init__(self):
        require(0 < self.retire_threshold <= 1, "curriculum.retire_threshold", "must be in (0, 1]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0 = only at the end
    keep: int = 3

    def __post_init__(self):
        require(self.every >= 0, "checkpoint.every", "must be >= 0")
        require(self.keep >= 1, "checkpoint.keep", "must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogConfig:
    # Samples per step written to rollouts.jsonl in the run directory (0: none): each
    # sequence's ids, its train mask, behaviour log-probs, policy versions, reward and
    # advantage, its text; an agent episode's session, branch and call boundaries too.
    rollouts: int = 0

    def __post_init__(self):
        require(self.rollouts >= 0, "log.rollouts", "must be >= 0")
