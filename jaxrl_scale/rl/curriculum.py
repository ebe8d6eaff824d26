"""Which prompts to train on next: epochs over a shuffled pool, with No-Positive-Resampling.

A prompt whose latest group pass rate reaches the threshold (0.9 in ScaleRL) is retired and never
sampled again. The state is a few numpy arrays (`state_dict()` returns copies: a snapshot that
later draws do not change), so checkpoints carry it exactly.

One owner: the rollout worker's producing thread (rollout.py); other threads see snapshots.
"""

from __future__ import annotations

import numpy as np


class Curriculum:
    def __init__(
        self,
        n_prompts: int,
        *,
        seed: int,
        retire_threshold: float = 0.9,
        no_positive_resampling: bool = True,
    ):
        self.n = n_prompts
        self.seed = seed
        self.threshold = retire_threshold
        self.enabled = no_positive_resampling
        self.epoch = 0
        self.position = 0
        self.order = self._shuffle(0)
        self.pass_rate = np.full(n_prompts, np.nan)
        self.retired = np.zeros(n_prompts, bool)

    def _shuffle(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    @property
    def active(self) -> int:
        return int(self.n - self.retired.sum())

    def next_batch(self, k: int) -> np.ndarray:
        """The next k prompt indices, skipping retired prompts, reshuffling at each epoch end."""
        if self.active < k:
            raise RuntimeError(
                f"only {self.active} prompts remain unretired, fewer than a batch of {k}; "
                "the task is solved at this threshold (raise curriculum.retire_threshold)"
            )
        picked: list[int] = []
        while len(picked) < k:
            if self.position >= self.n:
                self.epoch += 1
                self.position = 0
                self.order = self._shuffle(self.epoch)
            index = int(self.order[self.position])
            self.position += 1
            if not self.retired[index] and index not in picked:
                picked.append(index)
        return np.asarray(picked)

    def update(self, indices, pass_rates) -> None:
        """Record each prompt's latest group pass rate; retire those at the threshold. A NaN
        rate (a group none of whose episodes could be trained) keeps what was known."""
        indices, pass_rates = np.asarray(indices), np.asarray(pass_rates, float)
        known = np.isfinite(pass_rates)
        indices, pass_rates = indices[known], pass_rates[known]
        self.pass_rate[indices] = pass_rates
        if self.enabled:
            self.retired[indices] |= pass_rates >= self.threshold

    def state_dict(self) -> dict[str, np.ndarray]:
        """A snapshot (copies): epoch, position, pass rates (NaN: never sampled), retired."""
        return {
            "epoch": np.asarray(self.epoch, np.int64),
            "position": np.asarray(self.position, np.int64),
            "pass_rate": self.pass_rate.astype(np.float64),
            "retired": self.retired.astype(np.uint8),
        }

    def load_state_dict(self, state: dict) -> None:
        if np.shape(state["retired"]) != (self.n,):
            raise ValueError(
                f"curriculum state is for {np.size(state['retired'])} prompts, not {self.n}"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.order = self._shuffle(self.epoch)
        self.pass_rate = np.array(state["pass_rate"], np.float64)
        self.retired = np.array(state["retired"], bool)
