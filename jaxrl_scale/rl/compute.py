"""Compute accounting: the x-axis of scaling curves, in analytic FLOPs and in device-seconds.

FLOPs. N counts the weights of every matmul a token passes through in the decoder layers
(attention and MLP projections; in a mixture-of-experts layer the router and the K experts
the token is routed to, the active parameters), H_v = D * V those of the vocabulary head; the
embedding lookup is free. With a = 4 * layers * heads * head_dim (a query scoring and mixing
one key: 2 * 2 * E FLOPs per head and layer), one forward pass over an RL batch of P prompts
of real length L_p, each continued by G completions of n_b emitted tokens, costs

    F = sum_p [ 2 N L_p + a L_p (L_p + 1) / 2 ]                  each prompt once (shared prefix)
      + sum_b [ 2 N n_b + 2 H_v n_b + a (n_b L_p + n_b (n_b + 1) / 2) ]     each completion

The head runs on completion positions only (the prompt's last position predicts the first
completion token, and the last completion token predicts nothing), and completion token j of
a row sits at position L_p + j, attending L_p + j + 1 keys. Padding is not counted: F is the
algorithm's work, independent of how rows are batched. Generation (prefill once per prompt +
KV-cached decoding of every emitted token, interruption text included) costs F; a training
step costs 3 F (forward + backward, the prompt run once per group), plus F for the frozen
reference's forward when GRPO's KL term is on. A batch generated but never trained on (dropped)
still costs its F. Held-out evaluation is not training compute and is not counted.

Device-seconds (`RunClock`): wall time of the RL loop times every device the run holds
(generators included, as the paper counts GPU-hours), from the first RL step on: the warm
start, the step-0 evaluation, held-out evaluations, checkpoint writes and XLA compilation are
left out.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence

import jax

from jaxrl_scale.models.config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    """Weights of all matmuls per token (layers + head), excluding the embedding lookup."""
    return layer_params(cfg) + cfg.hidden_size * cfg.vocab_size


def layer_params(cfg: ModelConfig) -> int:
    """N: weights of the decoder layers' matmuls a token passes through (attention and MLP
    projections). A mixture-of-experts layer counts its active weights: the router [D, E]
    and the K chosen experts' projections, not all E (a token computes only those)."""
    d, f, e = cfg.hidden_size, cfg.intermediate_size, cfg.resolved_head_dim
    attn = d * cfg.num_heads * e * 2 + d * cfg.num_kv_heads * e * 2  # q, o and k, v
    routed = d * cfg.num_experts + 3 * d * cfg.moe_intermediate_size * cfg.num_experts_per_tok
    return sum(attn + (routed if cfg.routed(i) else 3 * d * f) for i in range(cfg.num_layers))


def attention_flops(cfg: ModelConfig) -> int:
    """a: FLOPs of one query scoring and mixing one key, over all heads and layers."""
    return 4 * cfg.num_layers * cfg.num_heads * cfg.resolved_head_dim


def forward_flops(cfg: ModelConfig, seq_len: int) -> float:
    """FLOPs of one forward pass over `seq_len` tokens with logits at every position."""
    return 2.0 * matmul_params(cfg) * seq_len + attention_flops(cfg) * seq_len * (seq_len + 1) / 2


def train_flops(cfg: ModelConfig, seq_len: int) -> float:
    """FLOPs of forward + backward over `seq_len` tokens: 3x the forward pass."""
    return 3.0 * forward_flops(cfg, seq_len)


def batch_forward_flops(
    cfg: ModelConfig, prompt_lens: Sequence[int], completion_lens: Sequence[int]
) -> float:
    """F of the module docstring: one forward pass over P prompts (real lengths) and their
    P x G completions (emitted lengths; the G of a prompt consecutive)."""
    p, b = len(prompt_lens), len(completion_lens)
    if p == 0 or b % p:
        raise ValueError(f"{b} completions do not split into groups over {p} prompts")
    g = b // p
    n_layers, head, a = layer_params(cfg), cfg.hidden_size * cfg.vocab_size, attention_flops(cfg)
    total = 0.0
    for i, length in enumerate(prompt_lens):
        total += 2.0 * n_layers * length + a * length * (length + 1) / 2
        for n in completion_lens[i * g : (i + 1) * g]:
            total += 2.0 * (n_layers + head) * n + a * (n * length + n * (n + 1) / 2)
    return total


def batch_flops(
    cfg: ModelConfig,
    prompt_lens: Sequence[int],
    completion_lens: Sequence[int],
    *,
    reference: bool = False,
) -> dict[str, float]:
    """{"gen_flops": F, "train_flops": 3 F (+ F for a KL reference)} of one RL batch."""
    forward = batch_forward_flops(cfg, prompt_lens, completion_lens)
    return {"gen_flops": forward, "train_flops": (4.0 if reference else 3.0) * forward}


_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


class RunClock:
    """Device-seconds of RL work (module docstring). `excluded()` brackets work that does not
    count (evaluation, checkpoints); XLA compilation is taken from jax.monitoring's compile
    events. Compilation on a generator thread overlapping training is subtracted too: a small
    undercount, early in a run."""

    def __init__(self, devices: int, *, seconds: float = 0.0):
        self.devices = devices
        self._base = seconds  # device-seconds of earlier (resumed) sessions
        self._start: float | None = None
        # Compile listeners run on whichever thread compiles (trainer or generator).
        self._lock = threading.Lock()
        self._left_out = 0.0
        self._excluding = 0  # open `excluded()` blocks: compiles inside them are already out

    def _on_event(self, event: str, duration: float, **_) -> None:
        if event in _COMPILE_EVENTS:
            with self._lock:
                if not self._excluding:
                    self._left_out += duration

    def start(self) -> None:
        self._start = time.perf_counter()
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def stop(self) -> None:
        if self._start is not None:
            jax.monitoring.unregister_event_duration_listener(self._on_event)

    @contextlib.contextmanager
    def excluded(self):
        begin = time.perf_counter()
        with self._lock:
            self._excluding += 1
        try:
            yield
        finally:
            with self._lock:
                self._excluding -= 1
                self._left_out += time.perf_counter() - begin

    def device_seconds(self) -> float:
        if self._start is None:
            return self._base
        with self._lock:
            counted = time.perf_counter() - self._start - self._left_out
        return self._base + max(counted, 0.0) * self.devices
