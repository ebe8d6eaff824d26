"""How completions are sampled (`sampler.*`, with `sampler.interruption.*`): the one
definition of valid sampling settings, shared by the sampler's own checks."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl_scale.configbase import require


def check_sampling(temperature: float, top_p: float, top_k: int, key: str = "sampler") -> None:
    """The one definition of valid sampling settings (also sampler.Sampling's)."""
    require(temperature >= 0, f"{key}.temperature", f"must be >= 0, got {temperature}")
    require(0 < top_p <= 1, f"{key}.top_p", f"must be in (0, 1], got {top_p}")
    require(top_k >= 0, f"{key}.top_k", f"must be >= 0, got {top_k}")


def check_thinking_budget(
    think_min: int, think_max: int, answer_budget: int, key: str = "sampler.interruption"
) -> None:
    """The one definition of a valid interruption budget (also sampler.Interruption's)."""
    require(
        1 <= think_min <= think_max,
        f"{key}.think_min",
        f"need 1 <= think_min <= think_max, got {think_min}, {think_max}",
    )
    require(answer_budget >= 1, f"{key}.answer_budget", "must be >= 1")


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
        require(bool(self.text), f"{key}.text", "must not be empty")
        check_thinking_budget(self.think_min, self.think_max, self.answer_budget, key)
        require(self.think_end is None or bool(self.think_end), f"{key}.think_end", "empty")


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
    # Multi-turn episodes on the slot engine: rows of cache memory (not decoded) where an
    # episode waiting for its environment waits, its slot taken by another (-1: as many as
    # `slots`; 0: none, a waiting episode keeps its slot).
    parked_rows: int = -1

    def __post_init__(self):
        require(self.max_new_tokens >= 1, "sampler.max_new_tokens", "must be >= 1")
        check_sampling(self.temperature, self.top_p, self.top_k)
        require(self.temperature > 0, "sampler.temperature", "must be > 0 for RL sampling")
        truncation = (
            "RL samples from the full distribution: the trainer computes log-probs over the "
            "full softmax, so a truncated sampler's importance ratios are biased (rho <= 1 on "
            "every token)"
        )
        require(self.top_p == 1, "sampler.top_p", f"must be 1.0, got {self.top_p}: {truncation}")
        require(self.top_k == 0, "sampler.top_k", f"must be 0, got {self.top_k}: {truncation}")
        require(self.chunk_size >= 0, "sampler.chunk_size", "must be >= 0")
        require(self.slots >= 0, "sampler.slots", "must be >= 0 (0: one batch's rows)")
        require(self.admit_every >= 1, "sampler.admit_every", "must be >= 1")
        require(self.parked_rows >= -1, "sampler.parked_rows", "must be >= -1 (-1: = slots)")
        if self.interruption is not None:
            i = self.interruption
            # The text is at least one token; the trainer re-checks with its tokenized length.
            require(
                i.think_max + 1 + i.answer_budget <= self.max_new_tokens,
                "sampler.max_new_tokens",
                f"{self.max_new_tokens} cannot hold interruption.think_max ({i.think_max}) + "
                f"the interruption text + answer_budget ({i.answer_budget})",
            )
