"""Typed experiment configuration: frozen dataclasses per concern, filled from YAML.

`load_config("configs/demo.yaml", overrides=["model.num_layers=4"])` reads the YAML file (and
the file its top-level `base:` names, which it overrides), applies dotted `key=value` overrides
(values parsed as YAML scalars), and builds the dataclasses with dacite. An unknown key (with
the closest valid key), a wrong type or an out-of-range value is a `ConfigError` naming the
dotted key.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import dacite
import numpy as np
import yaml

DType = Literal["float32", "bfloat16"]


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the dotted key."""


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScalingConfig:
    """Llama-3 frequency-dependent RoPE scaling (HF `rope_type: llama3`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        _require(
            self.factor >= 1.0, "model.rope_scaling.factor", f"must be >= 1, got {self.factor}"
        )
        _require(
            0 < self.low_freq_factor < self.high_freq_factor,
            "model.rope_scaling",
            "need 0 < low_freq_factor < high_freq_factor, got "
            f"{self.low_freq_factor}, {self.high_freq_factor}",
        )
        _require(
            self.original_max_position_embeddings > 0,
            "model.rope_scaling.original_max_position_embeddings",
            "must be > 0",
        )


# The projections a LoRA adapter can target (PEFT's module names), and the groups that name
# several at once.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_GROUPS = {
    "all": LORA_TARGETS,
    "attention": LORA_TARGETS[:4],
    "mlp": LORA_TARGETS[4:],
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Low-rank adapters on the decoder's projections (lora.py); rank 0 (the default) is off.

    Each targeted kernel W [in, out] gains A [in, rank] and B [rank, out] and computes
    x W + (alpha / rank) x A B (alpha / sqrt(rank) with `rslora`), as PEFT does. B starts at 0,
    so the adapted policy starts equal to the base. Only A and B train; the base is frozen and
    kept in `base_dtype` (bfloat16 halves it; norms and the FP32 head's kernel stay float32).
    `init_from`: a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to
    start from; its rank, alpha and targets are the run's (a different value set here is an
    error). A learning rate about 10x full fine-tuning's is the usual starting point.
    """

    rank: int = 0
    alpha: float = 32.0
    targets: tuple[str, ...] = ("all",)
    base_dtype: DType = "float32"
    rslora: bool = False
    init_from: str | None = None

    def __post_init__(self):
        _require(self.rank >= 0, "model.lora.rank", f"must be >= 0 (0 = off), got {self.rank}")
        _require(self.alpha > 0, "model.lora.alpha", f"must be > 0, got {self.alpha}")
        _require(bool(self.targets), "model.lora.targets", "name at least one projection")
        for t in self.targets:
            _require(
                t in LORA_TARGETS or t in LORA_GROUPS,
                "model.lora.targets",
                f"unknown target {t!r} (projections: {', '.join(LORA_TARGETS)}; groups: "
                f"{', '.join(LORA_GROUPS)})",
            )
        _require(
            self.base_dtype == "float32" or self.rank > 0 or self.init_from is not None,
            "model.lora.base_dtype",
            "only applies to a LoRA run (model.lora.rank > 0)",
        )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """The adapter's output scale: alpha / rank (alpha / sqrt(rank) with rslora)."""
        return self.alpha / (self.rank**0.5 if self.rslora else self.rank)

    @property
    def projections(self) -> tuple[str, ...]:
        """The targeted projections, groups expanded, in LORA_TARGETS order."""
        named = {p for t in self.targets for p in LORA_GROUPS.get(t, (t,))}
        return tuple(p for p in LORA_TARGETS if p in named)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Decoder-only policy of the Qwen2/Qwen2.5, Qwen3 and Llama-3 families.

    `architecture` fixes the HF naming on export; `qkv_bias` (Qwen2) and `qk_norm` (Qwen3) are the
    switches that actually differ. Parameters are always stored in float32; `dtype` is the compute
    dtype. `lm_head_dtype: float32` runs the vocabulary projection on float32 inputs with float32
    accumulation at full precision on every backend (ScaleRL's FP32 head); `bfloat16` is the
    other arm of that ablation. `matmul_precision` is the precision of every other matmul
    (projections, MLP, attention), the same in the sampler and the trainer: with float32 compute
    "default" is TF32 on GPUs and one bf16 pass on TPUs, "highest" is true float32 (about 2x the
    forward's cost, and what removes most of the sampler/trainer log-prob mismatch).
    """

    architecture: Literal["qwen2", "qwen3", "llama", "qwen3_moe"] = "qwen2"
    vocab_size: int = 64
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_heads
    rope_theta: float = 10_000.0
    rope_scaling: RopeScalingConfig | None = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    # Mixture of experts (qwen3_moe; Hugging Face's field names): a routed layer sends each
    # token to its `num_experts_per_tok` most probable of `num_experts` SwiGLU experts of
    # width `moe_intermediate_size`, weighted by their router probabilities (renormalised
    # over the chosen ones with `norm_topk_prob`). Layers i with (i + 1) % decoder_sparse_step
    # == 0 that are not in `mlp_only_layers` are routed; the others are dense MLPs.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # How the experts' matmuls run (moe.py): "ragged" (jax.lax.ragged_dot, a grouped matmul
    # on GPUs and TPUs), "tiled" (batched matmuls over whole tiles of each expert's tokens),
    # "scan" (the tiles one at a time: a grouped matmul's memory, sequential; what the memory
    # planner compiles on CPUs for ragged), "dense" (every token through every expert: E / K
    # times the FLOPs, the reference); "auto" is ragged on GPUs and TPUs and tiled on CPUs,
    # where XLA lowers ragged_dot to a masked dense matmul.
    moe_matmul: Literal["auto", "ragged", "tiled", "scan", "dense"] = "auto"
    # Router replay: the sampler records every token's experts in every routed layer (top-k
    # ids, `route_dtype`) with the rollout, and the trainer's forward routes each token to
    # those experts (their routing weights still from the trainer's router, so it learns), so
    # a near-tie that the sampler's numerics broke one way cannot flip the trainer's choice.
    router_replay: bool = False
    dtype: DType = "float32"
    lm_head_dtype: DType = "float32"
    matmul_precision: Literal["default", "high", "highest"] = "default"
    logits_chunk_size: int = 256  # tokens per chunk when computing per-token log-probs
    # Attention implementation (attention.py): auto | xla | blockwise | cudnn | splash. "auto"
    # stores scores only when every key fits in one block, and otherwise runs cuDNN's fused
    # kernel on GPUs (half precision), the Pallas splash kernel on TPUs, or the blockwise
    # online softmax, whose memory is linear in T.
    attention: Literal["auto", "xla", "blockwise", "cudnn", "splash"] = "auto"
    attention_block_size: int = 512  # queries and keys per block of the blockwise attention
    # Per decoder layer in the training forward: "none" keeps every activation for the backward
    # pass, "full" keeps only the layer's input and recomputes the rest, "dots" also keeps the
    # outputs of its weight matmuls (projections, MLP) and recomputes the cheap rest.
    remat: Literal["none", "full", "dots"] = "none"
    # Run the trainer's layers as one lax.scan over stacked weights: the compiled program holds
    # one layer, so a 36-64-layer model compiles in seconds (at the cost of one stacked copy of
    # the compute-dtype weights, live during the step). The sampler's decode keeps its loop.
    scan_layers: bool = False
    # A Hugging Face folder (config.json, *.safetensors, tokenizer.json) to start from. Its
    # config.json fixes the architecture fields above; the runtime fields (dtype through
    # lora: `runtime_fields()`) still come from here.
    init_from: str | None = None
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "logits_chunk_size",
            "attention_block_size",
        ):
            value = getattr(self, name)
            _require(value > 0, f"model.{name}", f"must be > 0, got {value}")
        _require(
            self.num_heads % self.num_kv_heads == 0,
            "model.num_kv_heads",
            f"must divide num_heads ({self.num_heads}), got {self.num_kv_heads}",
        )
        if self.head_dim is None:
            _require(
                self.hidden_size % self.num_heads == 0,
                "model.head_dim",
                f"unset, and hidden_size ({self.hidden_size}) is not divisible by num_heads "
                f"({self.num_heads}); set it explicitly",
            )
        _require(self.resolved_head_dim % 2 == 0, "model.head_dim", "must be even for RoPE")
        _require(self.rope_theta > 0, "model.rope_theta", f"must be > 0, got {self.rope_theta}")
        _require(
            self.rms_norm_eps > 0, "model.rms_norm_eps", f"must be > 0, got {self.rms_norm_eps}"
        )
        self._check_experts()
        _require(
            self.matmul_precision == "default" or self.dtype == "float32",
            "model.matmul_precision",
            f"{self.matmul_precision!r} only changes float32 matmuls; with model.dtype="
            f"{self.dtype} the activations are {self.dtype} whatever the precision (set "
            "model.dtype=float32 for full-precision activations)",
        )

    def _check_experts(self) -> None:
        _require(
            not self.router_replay or self.architecture == "qwen3_moe",
            "model.router_replay",
            f"replays the experts of routed layers; {self.architecture} has none",
        )
        if self.architecture != "qwen3_moe":
            _require(
                self.num_experts == 0,
                "model.num_experts",
                f"experts need architecture qwen3_moe, not {self.architecture}",
            )
            return
        e, k = self.num_experts, self.num_experts_per_tok
        _require(e >= 1, "model.num_experts", f"qwen3_moe needs >= 1 expert, got {e}")
        _require(1 <= k <= e, "model.num_experts_per_tok", f"must be in [1, {e}], got {k}")
        _require(
            self.moe_intermediate_size > 0,
            "model.moe_intermediate_size",
            f"must be > 0, got {self.moe_intermediate_size}",
        )
        _require(self.decoder_sparse_step >= 1, "model.decoder_sparse_step", "must be >= 1")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        _require(not bad, "model.mlp_only_layers", f"{bad} are not layers of {self.num_layers}")
        mlp = {"gate_proj", "up_proj", "down_proj"} & set(self.lora.projections)
        if self.lora.enabled and mlp:
            warnings.warn(
                f"model.lora: {', '.join(sorted(mlp))} get adapters in dense MLP layers only; "
                "the routed layers' experts stay frozen (attention projections are adapted)",
                stacklevel=2,
            )
        kinds = {self.routed(i) for i in range(self.num_layers)}
        _require(
            not self.scan_layers or len(kinds) == 1,
            "model.scan_layers",
            "needs every layer of one kind; these mix routed and dense MLP layers "
            "(model.mlp_only_layers, model.decoder_sparse_step)",
        )

    def routed(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a mixture of experts (Hugging Face's rule)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def routed_layers(self) -> int:
        return sum(self.routed(i) for i in range(self.num_layers))

    @property
    def route_dtype(self):
        """The dtype recorded expert ids travel in (router replay): one byte for up to 256
        experts (Qwen3-30B-A3B: 48 layers x 8 ids = 384 bytes a token), two above."""
        return np.uint8 if self.num_experts <= 256 else np.uint16

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def runtime_fields(self) -> dict[str, Any]:
        """The fields a Hugging Face checkpoint does not fix (how to compute, not what)."""
        names = (
            "dtype",
            "lm_head_dtype",
            "matmul_precision",
            "logits_chunk_size",
            "attention",
            "attention_block_size",
            "remat",
            "scan_layers",
            "moe_matmul",
            "router_replay",
            "lora",
        )
        return {name: getattr(self, name) for name in names}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh shape. -1 on one axis means "all remaining devices"."""

    data: int = -1
    fsdp: int = 1
    # Expert parallelism: an MoE layer's experts split over this axis (num_experts a multiple
    # of it); outside MoE layers it splits rows like `data`, and with fsdp > 1 the other
    # weights like `fsdp`. (Generator devices split the experts over all of them.)
    expert: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = {"data": self.data, "fsdp": self.fsdp, "expert": self.expert, "tensor": self.tensor}
        for name, size in sizes.items():
            _require(size == -1 or size >= 1, f"mesh.{name}", f"must be -1 or >= 1, got {size}")
        _require(list(sizes.values()).count(-1) <= 1, "mesh", "at most one axis may be -1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticConfig:
    """task.arithmetic: procedural integer problems (tasks/arithmetic.py)."""

    max_digits: int = 2  # operands have 1..max_digits digits
    ops: str = "+-"  # operators drawn from
    # Probability that a warm-start demonstration is wrong (its last digit off by one), so the
    # warm-started policy knows the answer but is unsure of it: what RL fixes.
    demo_noise: float = 0.0

    def __post_init__(self):
        key = "task.arithmetic"
        _require(self.max_digits >= 1, f"{key}.max_digits", f"must be >= 1, got {self.max_digits}")
        _require(
            bool(self.ops) and set(self.ops) <= set("+-*"), f"{key}.ops", "use characters of '+-*'"
        )
        _require(0 <= self.demo_noise <= 1, f"{key}.demo_noise", "must be in [0, 1]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CountdownConfig:
    """task.countdown: reach a target with + - * / over given numbers (tasks/countdown.py)."""

    numbers: int = 3  # given numbers per problem
    max_number: int = 20  # each in 1..max_number
    max_target: int = 100  # targets in 1..max_target

    def __post_init__(self):
        key = "task.countdown"
        _require(2 <= self.numbers <= 6, f"{key}.numbers", f"must be in [2, 6], got {self.numbers}")
        _require(self.max_number >= 2, f"{key}.max_number", "must be >= 2")
        _require(self.max_target >= 1, f"{key}.max_target", "must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MathConfig:
    """task.math: word problems with reference answers, checked by math-verify (tasks/math.py)."""

    data: str | None = (
        None  # .jsonl / .parquet file, or a Hugging Face dataset name[:config[:split]]
    )
    eval_data: str | None = None  # held-out file or dataset; None: num_eval rows of `data`
    question_key: str = "problem"
    answer_key: str = "answer"
    template: str = (
        "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
    )
    verify_timeout: float = 5.0  # seconds per math-verify call before the answer scores 0

    def __post_init__(self):
        _require("{question}" in self.template, "task.math.template", "must contain '{question}'")
        _require(self.verify_timeout > 0, "task.math.verify_timeout", "must be > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """The verifiable task (see jaxrl_scale/tasks): what every task has, then one section per
    task; only the section `name` picks is read."""

    name: Literal["arithmetic", "countdown", "math"] = "arithmetic"
    num_train: int = 512  # prompts in the training pool (math: 0 = every row)
    num_eval: int = 64  # held-out prompts
    arithmetic: ArithmeticConfig = dataclasses.field(default_factory=ArithmeticConfig)
    countdown: CountdownConfig = dataclasses.field(default_factory=CountdownConfig)
    math: MathConfig = dataclasses.field(default_factory=MathConfig)

    def __post_init__(self):
        _require(self.num_train >= 0, "task.num_train", "must be >= 0")
        _require(self.num_train >= 1 or self.name == "math", "task.num_train", "must be >= 1")
        _require(self.num_eval >= 1, "task.num_eval", "must be >= 1")


def check_sampling(temperature: float, top_p: float, top_k: int, key: str = "sampler") -> None:
    """The one definition of valid sampling settings (also sampler.Sampling's)."""
    _require(temperature >= 0, f"{key}.temperature", f"must be >= 0, got {temperature}")
    _require(0 < top_p <= 1, f"{key}.top_p", f"must be in (0, 1], got {top_p}")
    _require(top_k >= 0, f"{key}.top_k", f"must be >= 0, got {top_k}")


def check_thinking_budget(
    think_min: int, think_max: int, answer_budget: int, key: str = "sampler.interruption"
) -> None:
    """The one definition of a valid interruption budget (also sampler.Interruption's)."""
    _require(
        1 <= think_min <= think_max,
        f"{key}.think_min",
        f"need 1 <= think_min <= think_max, got {think_min}, {think_max}",
    )
    _require(answer_budget >= 1, f"{key}.answer_budget", "must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class InterruptionConfig:
    """ScaleRL's forced length interruption (see sampler.Interruption): a row still thinking
    after a budget drawn from [think_min, think_max] tokens gets `text` inserted and answers
    within `answer_budget` tokens. A row that samples `think_end` itself has closed its
    thinking and is never interrupted (null: no marker, every token counts as thinking)."""

    text: str
    think_min: int
    think_max: int
    answer_budget: int
    think_end: str | None = "</think>"

    def __post_init__(self):
        key = "sampler.interruption"
        _require(bool(self.text), f"{key}.text", "must not be empty")
        check_thinking_budget(self.think_min, self.think_max, self.answer_budget, key)
        _require(self.think_end is None or bool(self.think_end), f"{key}.think_end", "empty")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerConfig:
    """How the generator samples for RL. `top_p` / `top_k` exist to be refused with the reason:
    the trainer's log-probs are over the full softmax, the sampler's over the truncated one, so
    every importance ratio of a truncated sampler is biased below 1 (generate() still offers
    truncation for evaluation and inference)."""

    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    chunk_size: int = 0  # decode steps between in-flight weight swaps; 0 = one chunk
    interruption: InterruptionConfig | None = None
    # "static": each batch's rows decode together until the longest ends. "continuous": a slot
    # engine (generation/engine.py) keeps `slots` rows in flight, a finished row's slot taking the
    # next waiting group (in pipeline_rl the next batch's prompts queued behind this one's).
    # "auto": continuous in pipeline_rl, static in sync and ppo_off_policy (ExperimentConfig.
    # batching).
    batching: Literal["auto", "static", "continuous"] = "auto"
    # Rows decoded at once (the KV cache's size); 0 = one train batch's rows. They split over
    # the generator's batch shards (each device holds its own). static (and held-out
    # evaluation) decodes in waves of at most this many rows whose count splits over the
    # generator's batch shards, each until its longest row ends.
    slots: int = 0
    admit_every: int = 8  # continuous: decode steps between reads of the done flags

    def __post_init__(self):
        _require(self.max_new_tokens >= 1, "sampler.max_new_tokens", "must be >= 1")
        check_sampling(self.temperature, self.top_p, self.top_k)
        _require(self.temperature > 0, "sampler.temperature", "must be > 0 for RL sampling")
        truncation = (
            "RL samples from the full distribution: the trainer computes log-probs over the "
            "full softmax, so a truncated sampler's importance ratios are biased (rho <= 1 on "
            "every token)"
        )
        _require(self.top_p == 1, "sampler.top_p", f"must be 1.0, got {self.top_p}: {truncation}")
        _require(self.top_k == 0, "sampler.top_k", f"must be 0, got {self.top_k}: {truncation}")
        _require(self.chunk_size >= 0, "sampler.chunk_size", "must be >= 0")
        _require(self.slots >= 0, "sampler.slots", "must be >= 0 (0: one batch's rows)")
        _require(self.admit_every >= 1, "sampler.admit_every", "must be >= 1")
        if self.interruption is not None:
            i = self.interruption
            # The text is at least one token; the trainer re-checks with its tokenized length.
            _require(
                i.think_max + 1 + i.answer_budget <= self.max_new_tokens,
                "sampler.max_new_tokens",
                f"{self.max_new_tokens} cannot hold interruption.think_max ({i.think_max}) + "
                f"the interruption text + answer_budget ({i.answer_budget})",
            )


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
    # [1 / mismatch_threshold, mismatch_threshold], with every loss kind (losses.py).
    mismatch_mask: Literal["none", "token", "sequence"] = "none"
    mismatch_threshold: float = 2.0

    def hyper(self) -> dict[str, float]:
        """The hyper-parameters set here, checked against what the loss kind takes."""
        from jaxrl_scale.rl.losses import KINDS

        takes = dict(KINDS[self.kind].defaults)
        given = {
            k: v
            for k in ("eps_max", "eps_low", "eps_high", "kl_coef")
            if (v := getattr(self, k)) is not None
        }
        wrong = sorted(set(given) - set(takes))
        _require(
            not wrong,
            f"loss.{wrong[0] if wrong else ''}",
            f"is not a parameter of loss.kind={self.kind} (it takes {sorted(takes)})",
        )
        return given

    def __post_init__(self):
        self.hyper()
        _require(self.kl_coef is None or self.kl_coef >= 0, "loss.kl_coef", "must be >= 0")
        _require(
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
        _require(self.learning_rate > 0, "optim.learning_rate", "must be > 0")
        _require(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        _require(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        _require(self.adam_eps > 0, "optim.adam_eps", "must be > 0")
        _require(self.grad_clip > 0, "optim.grad_clip", "must be > 0")


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
        _require(self.steps >= 0, "warm_start.steps", "must be >= 0")
        _require(self.target_loss >= 0, "warm_start.target_loss", "must be >= 0")
        _require(self.batch_size >= 1, "warm_start.batch_size", "must be >= 1")


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

    def __post_init__(self):
        for name in (
            "steps",
            "prompts_per_step",
            "group_size",
            "micro_batches",
            "max_nonfinite",
            "eval_samples",
        ):
            _require(getattr(self, name) >= 1, f"train.{name}", "must be >= 1")
        _require(self.eval_every >= 0, "train.eval_every", "must be >= 0")
        for name in ("pack_length", "tokens_per_micro_batch"):
            _require(getattr(self, name) >= 0, f"train.{name}", "must be >= 0")
            _require(
                self.packing or not getattr(self, name),
                f"train.{name}",
                "applies to packed steps only (set train.packing: true or auto)",
            )
        if self.tokens_per_micro_batch and self.pack_length:
            _require(
                self.tokens_per_micro_batch >= self.pack_length,
                "train.tokens_per_micro_batch",
                f"must hold at least one packed row (train.pack_length {self.pack_length})",
            )
        _require(
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
        _require(self.max_staleness >= 0, "pipeline.max_staleness", "must be >= 0")
        _require(self.generator_devices >= 0, "pipeline.generator_devices", "must be >= 0")
        _require(
            self.mode != "ppo_off_policy" or self.max_staleness >= 1,
            "pipeline.max_staleness",
            "ppo_off_policy needs k >= 1 (k minibatches per policy)",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurriculumConfig:
    no_positive_resampling: bool = True
    retire_threshold: float = 0.9  # a prompt whose latest pass rate reaches this is retired

    def __post_init__(self):
        _require(0 < self.retire_threshold <= 1, "curriculum.retire_threshold", "must be in (0, 1]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0 = only at the end
    keep: int = 3

    def __post_init__(self):
        _require(self.every >= 0, "checkpoint.every", "must be >= 0")
        _require(self.keep >= 1, "checkpoint.keep", "must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForecastConfig:
    """The online forecast: refit the sigmoid to the eval curve while training (forecast.py)."""

    every: int = 1  # refit after every M-th held-out evaluation; 0 = off
    x: Literal["compute_flops", "device_seconds"] = "compute_flops"
    budget: float = 0.0  # compute to predict the pass rate at; 0 = the run's projected end
    bootstrap: int = 1000  # resamples for the intervals
    level: float = 0.95
    method: Literal["auto", "pairs", "block", "residual"] = "auto"  # fit.bootstrap_sigmoid
    min_points: int = 4  # evaluations after step 0 before the first fit
    # Leave out evals below this fraction of the latest eval's compute (early transients, as
    # the paper drops its first ~1.5k of 50k GPU-hours); never leaves fewer than min_points.
    # 0.05 is measured (docs/benchmarks.md, "early cut-off"): on curves with an early
    # transient it narrowed A's interval by a fifth and raised identifiable fits from 90% to
    # 97% at the same coverage; on clean curves it costs about 5% width; 0.2 cost 50%.
    c_min_fraction: float = 0.05
    # Stop the run once the upper bound of the gain still to come (ceiling A minus the fitted
    # pass rate now) is below this; 0 = never stop early.
    stop_when_gain_below: float = 0.0
    # Stop (with a checkpoint) once the evals have fallen after a peak by more than their noise
    # allows (fit.decline).
    stop_when_declining: bool = False

    def __post_init__(self):
        _require(self.every >= 0, "forecast.every", "must be >= 0")
        _require(self.budget >= 0, "forecast.budget", "must be >= 0")
        _require(self.bootstrap >= 10, "forecast.bootstrap", "must be >= 10")
        _require(0 < self.level < 1, "forecast.level", f"must be in (0, 1), got {self.level}")
        _require(self.min_points >= 4, "forecast.min_points", "must be >= 4 (the curve has 4)")
        _require(0 <= self.c_min_fraction < 1, "forecast.c_min_fraction", "must be in [0, 1)")
        _require(self.stop_when_gain_below >= 0, "forecast.stop_when_gain_below", "must be >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """Several processes (hosts) in one run, through jax.distributed (distributed.py). Unset
    fields come from JAXRL_COORDINATOR / JAXRL_NUM_PROCESSES / JAXRL_PROCESS_ID, or from the
    Cloud TPU / Slurm environment; with none of those the run is one process."""

    coordinator_address: str | None = None  # "host:port" of process 0, bound exactly
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout: int = 300  # seconds to wait for every process to join
    heartbeat_timeout: int = 100  # seconds without a heartbeat before a process counts as dead

    def __post_init__(self):
        _require(
            self.num_processes is None or self.num_processes >= 1,
            "distributed.num_processes",
            "must be >= 1",
        )
        _require(
            self.process_id is None or self.process_id >= 0,
            "distributed.process_id",
            "must be >= 0",
        )
        for name in ("initialization_timeout", "heartbeat_timeout"):
            _require(getattr(self, name) >= 1, f"distributed.{name}", "must be >= 1 second")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostsConfig:
    """Trainer and generators as separate jobs (docs/hosts.md). The trainer's processes form
    one `jax.distributed` job (`distributed`, `mesh`); each generator group is a job of its own
    on other hosts (`generator_mesh` over its devices), started with `--role generator --group
    N`. Weights move device to device over `jax.experimental.transfer`; control messages and
    scored rollouts over ZeroMQ. 0 groups: generation is colocated with training, as before."""

    generator_groups: int = 0
    hub: str = "127.0.0.1:5555"  # host:port the trainer's process 0 binds; generators connect
    # The address other hosts reach this process at, for its weight and transfer servers
    # ("": the hub's host on the trainer's process 0, else this host's name; JAXRL_HOST).
    address: str = ""
    generator_mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    # Seconds a wait on another host may take before it fails naming that host and what it
    # waited for; a generator retries the trainer for this long (a trainer restarting).
    timeout: float = 300.0
    lost_after: float = 60.0  # seconds of silence after which a group's batch is drawn again

    def __post_init__(self):
        _require(self.generator_groups >= 0, "hosts.generator_groups", "must be >= 0")
        host, _, port = self.hub.rpartition(":")
        _require(bool(host) and port.isdigit(), "hosts.hub", f"must be host:port, got {self.hub!r}")
        for name in ("timeout", "lost_after"):
            _require(getattr(self, name) > 0, f"hosts.{name}", "must be > 0 seconds")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    seed: int = 0
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    sampler: SamplerConfig = dataclasses.field(default_factory=SamplerConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    warm_start: WarmStartConfig = dataclasses.field(default_factory=WarmStartConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    curriculum: CurriculumConfig = dataclasses.field(default_factory=CurriculumConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    forecast: ForecastConfig = dataclasses.field(default_factory=ForecastConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    hosts: HostsConfig = dataclasses.field(default_factory=HostsConfig)

    def __post_init__(self):
        if self.hosts.generator_groups:
            _require(self.pipeline.mode != "ppo_off_policy", "pipeline.mode",
                     "ppo_off_policy is not run across hosts (hosts.generator_groups): use "
                     "pipeline_rl or sync")  # fmt: skip
            _require(
                not self.pipeline.generator_devices,
                "pipeline.generator_devices",
                "must be 0 when generators are jobs of their own (hosts.generator_groups)",
            )
            _require(
                self.pipeline.mode == "sync" or self.pipeline.max_staleness >= 1,
                "pipeline.max_staleness",
                "must be >= 1 in pipeline_rl across hosts",
            )
        x, e = self.mesh.expert, self.model.num_experts
        _require(
            x in (-1, 1) or self.model.init_from is not None or (e and e % x == 0),
            "mesh.expert",
            f"{x} expert shards need an MoE policy whose model.num_experts is a multiple of "
            f"{x}, got {e}",
        )
        slots, g = self.sampler.slots, self.train.group_size
        _require(
            not slots or slots >= g,
            "sampler.slots",
            f"{slots} cannot hold one group of train.group_size = {g} rows",
        )

    @property
    def batching(self) -> str:
        """`sampler.batching` with "auto" resolved: continuous in pipeline_rl, where the engine
        refills a finished row's slot from the batch queued next while the trainer trains;
        static in sync and ppo_off_policy, whose rounds are admitted whole and drained, so
        with slots >= a round's rows the engine would decode the same schedule with more host
        round trips (with fewer slots, `continuous` refills them within the round)."""
        if self.sampler.batching != "auto":
            return self.sampler.batching
        return "continuous" if self.pipeline.mode == "pipeline_rl" else "static"


# --------------------------------------------------------------------------- YAML plumbing

OPTIM_KEYS = tuple(f.name for f in dataclasses.fields(OptimConfig))
ASSET = "asset:"  # names a file shipped in jaxrl_scale/assets (e.g. asset:demo.yaml)


def asset_path(name: str) -> Path:
    """The path of a file or folder shipped in the package's assets."""
    return Path(__file__).resolve().parent / "assets" / name.removeprefix(ASSET)


def _resolve(path: str | Path, relative_to: Path | None = None) -> Path:
    if str(path).startswith(ASSET):
        return asset_path(str(path))
    path = Path(path)
    return path if relative_to is None else relative_to / path


def _dataclass_of(tp: Any) -> type | None:
    """The dataclass inside `tp` (also `X | None`), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        return inner[0] if len(inner) == 1 else None
    return None


# Keys that moved to their own section: a config written for the old layout gets the new name.
MOVED = {
    **{f"train.{k}": f"optim.{k}" for k in OPTIM_KEYS},
    "train.sft_steps": "warm_start.steps",
    "train.sft_target_loss": "warm_start.target_loss",
    "train.sft_batch_size": "warm_start.batch_size",
    "train.sft_learning_rate": "warm_start.optim.learning_rate",
    **{f"task.{k}": f"task.arithmetic.{k}" for k in ("max_digits", "ops", "demo_noise")},
    **{f"task.{k}": f"task.countdown.{k}" for k in ("numbers", "max_number", "max_target")},
    **{
        f"task.{k}": f"task.math.{k}"
        for k in ("data", "eval_data", "question_key", "answer_key", "template", "verify_timeout")
    },
}


def _check_keys(cls: type, data: Mapping[str, Any], prefix: str) -> None:
    """Raise for any key in `data` that `cls` lacks, suggesting the closest valid one."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in names and dotted in MOVED:
            raise ConfigError(f"config key '{dotted}' is now '{MOVED[dotted]}'")
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{dotted}'{hint} (valid: {', '.join(names)})")
        sub = _dataclass_of(hints[key])
        if sub is not None and isinstance(value, Mapping):
            _check_keys(sub, value, f"{dotted}.")


def _to_float(value: Any) -> Any:
    # YAML 1.1 reads "1e-6" as a string; accept numeric strings and ints for float fields.
    if isinstance(value, bool):
        return value  # left for dacite to reject
    if isinstance(value, int):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def from_dict(cls: type, data: Mapping[str, Any], prefix: str = ""):
    """Build dataclass `cls` from nested mappings, strictly."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    _check_keys(cls, data, prefix)
    try:
        return dacite.from_dict(
            cls,
            dict(data),
            config=dacite.Config(strict=True, type_hooks={float: _to_float}, cast=[tuple]),
        )
    except dacite.WrongTypeError as e:
        key = f"{prefix}{e.field_path}"
        raise ConfigError(f"{key}: expected {_type_name(e.field_type)}, got {e.value!r}") from None
    except dacite.DaciteError as e:
        raise ConfigError(f"{prefix or 'config'}: {e}") from None


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:  # name the choices, not the type
        return "one of " + ", ".join(repr(v) for v in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):  # e.g. bool | Literal["auto"]
        return " or ".join(
            "true or false" if a is bool else "null" if a is type(None) else _type_name(a)
            for a in typing.get_args(tp)
        )
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def parse_override(item: str) -> tuple[list[str], Any]:
    """'a.b=value' -> (['a', 'b'], parsed value); the value is read as a YAML scalar."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override '{item}' must look like key.path=value")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else None


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    f"override '{item}': '{'.'.join(path[: i + 1])}' is not a section"
                )
            node = child
        node[path[-1]] = value
    return data


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, section by section."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """One YAML file as a dict; a top-level `base: other.yaml` (relative to this file) is read
    first and this file's keys override it, so an ablation arm states only what it changes."""
    path = path.resolve()
    if path in chain:
        raise ConfigError(f"{path}: 'base' files include each other: {[str(p) for p in chain]}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base: expected a path to a YAML file, got {base!r}")
    return _merge(_read_yaml(_resolve(base, path.parent), (*chain, path)), data)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Read YAML `path` (or start from defaults), following `base:` files, and apply dotted
    overrides. `asset:NAME` (as `path` or as a `base:`) is a config shipped in the package."""
    data = _read_yaml(_resolve(path)) if path is not None else {}
    return from_dict(ExperimentConfig, apply_overrides(data, overrides))


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_config(cfg: ExperimentConfig, header: str = "") -> str:
    """`cfg` as YAML that `load_config` reads back into an equal config; `header` lines become
    comments at the top."""
    comments = "".join(f"# {line}\n" for line in header.splitlines())
    return comments + yaml.safe_dump(to_dict(cfg), sort_keys=False)
