"""The policy's configuration (`model.*`, with `model.lora.*` and `model.rope_scaling.*`):
its shape, what it computes in, and its LoRA adapters."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Literal

import numpy as np

from jaxrl_scale.configbase import DType, require


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScalingConfig:
    """Llama-3 frequency-dependent RoPE scaling (HF `rope_type: llama3`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        require(self.factor >= 1.0, "model.rope_scaling.factor", f"must be >= 1, got {self.factor}")
        require(
            0 < self.low_freq_factor < self.high_freq_factor,
            "model.rope_scaling",
            "need 0 < low_freq_factor < high_freq_factor, got "
            f"{self.low_freq_factor}, {self.high_freq_factor}",
        )
        require(
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
        require(self.rank >= 0, "model.lora.rank", f"must be >= 0 (0 = off), got {self.rank}")
        require(self.alpha > 0, "model.lora.alpha", f"must be > 0, got {self.alpha}")
        require(bool(self.targets), "model.lora.targets", "name at least one projection")
        for t in self.targets:
            require(
                t in LORA_TARGETS or t in LORA_GROUPS,
                "model.lora.targets",
                f"unknown target {t!r} (projections: {', '.join(LORA_TARGETS)}; groups: "
                f"{', '.join(LORA_GROUPS)})",
            )
        require(
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
            require(value > 0, f"model.{name}", f"must be > 0, got {value}")
        require(
            self.num_heads % self.num_kv_heads == 0,
            "model.num_kv_heads",
            f"must divide num_heads ({self.num_heads}), got {self.num_kv_heads}",
        )
        if self.head_dim is None:
            require(
                self.hidden_size % self.num_heads == 0,
                "model.head_dim",
                f"unset, and hidden_size ({self.hidden_size}) is not divisible by num_heads "
                f"({self.num_heads}); set it explicitly",
            )
        require(self.resolved_head_dim % 2 == 0, "model.head_dim", "must be even for RoPE")
        require(self.rope_theta > 0, "model.rope_theta", f"must be > 0, got {self.rope_theta}")
        require(
            self.rms_norm_eps > 0, "model.rms_norm_eps", f"must be > 0, got {self.rms_norm_eps}"
        )
        self._check_experts()
        require(
            self.matmul_precision == "default" or self.dtype == "float32",
            "model.matmul_precision",
            f"{self.matmul_precision!r} only changes float32 matmuls; with model.dtype="
            f"{self.dtype} the activations are {self.dtype} whatever the precision (set "
            "model.dtype=float32 for full-precision activations)",
        )

    def _check_experts(self) -> None:
        require(
            not self.router_replay or self.architecture == "qwen3_moe",
            "model.router_replay",
            f"replays the experts of routed layers; {self.architecture} has none",
        )
        if self.architecture != "qwen3_moe":
            require(
                self.num_experts == 0,
                "model.num_experts",
                f"experts need architecture qwen3_moe, not {self.architecture}",
            )
            return
        e, k = self.num_experts, self.num_experts_per_tok
        require(e >= 1, "model.num_experts", f"qwen3_moe needs >= 1 expert, got {e}")
        require(1 <= k <= e, "model.num_experts_per_tok", f"must be in [1, {e}], got {k}")
        require(
            self.moe_intermediate_size > 0,
            "model.moe_intermediate_size",
            f"must be > 0, got {self.moe_intermediate_size}",
        )
        require(self.decoder_sparse_step >= 1, "model.decoder_sparse_step", "must be >= 1")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        require(not bad, "model.mlp_only_layers", f"{bad} are not layers of {self.num_layers}")
        mlp = {"gate_proj", "up_proj", "down_proj"} & set(self.lora.projections)
        if self.lora.enabled and mlp:
            warnings.warn(
                f"model.lora: {', '.join(sorted(mlp))} get adapters in dense MLP layers only; "
                "the routed layers' experts stay frozen (attention projections are adapted)",
                stacklevel=2,
            )
        kinds = {self.routed(i) for i in range(self.num_layers)}
        require(
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
    def scan_prompts(self) -> bool:
        """Whether the programs that run prompts into a cache for decoding (a wave's prefill,
        the slot engine's admission) scan the layers. A scan takes its layers' weights as
        one stacked copy (Policy.forward), a whole copy of the weights on every device that
        holds them unsplit (a data-parallel generator: 15 GiB a device at 8B in bf16); the
        layers in sequence reuse one layer's buffers for the next, so a dense model's prompts
        run unscanned. A mixture of experts keeps the scan (`scan_layers`): its routed pairs
        are large and, unscanned, each layer's are not reused (the 30B-A3B shape's admission
        grows 1.2 GiB a layer unscanned, 0.4 scanned, its experts split 8 ways)."""
        return self.scan_layers and self.routed_layers > 0

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
