"""A mixture of tasks, one domain each: weighted training prompts, held-out prompts per domain.

    task:
      name: mixture
      mixture:
        - {name: math, weight: 1}
        - {name: code, weight: 1}

Every example is tagged with its `domain`; scoring sends it to its own task's verifier
(tasks/scoring.py), and evaluation logs `eval_pass_rate` over every held-out prompt and
`eval_pass_rate/<domain>` over each domain's, which the online forecast and `jaxrl-scale fit
--y eval_pass_rate/<domain>` fit one curve each (the paper's math+code run).

The training pool holds the domains in proportion to their weights: as many of each domain's
examples as the scarcest domain (relative to its weight) allows, drawn without repeats and
shuffled by the seed, so a batch's expected share of a domain is its weight's share.
"""

from __future__ import annotations

import numpy as np


class MixtureTask:
    """Domains -> tasks (each with the shared tokenizer), and their weights."""

    name = "mixture"

    def __init__(self, components: dict, weights: dict[str, float], *, seed: int = 0):
        if set(components) != set(weights):
            raise ValueError("every domain needs a task and a weight")
        self.components = components
        first = next(iter(components.values()))
        self.tokenizer = first.tokenizer
        rng = np.random.default_rng(seed)
        share = {d: w / sum(weights.values()) for d, w in weights.items()}
        # The largest pool whose domain shares match the weights with no example twice.
        size = min(len(t.train_examples) / share[d] for d, t in components.items())
        train: list[dict] = []
        for d, task in components.items():
            n = max(1, int(round(size * share[d])))
            pick = rng.permutation(len(task.train_examples))[:n]
            train += [{**task.train_examples[i], "domain": d} for i in np.sort(pick)]
        self.train_examples = [train[i] for i in rng.permutation(len(train))]
        self.eval_examples = [
            {**e, "domain": d} for d, task in components.items() for e in task.eval_examples
        ]
        episodic = [hasattr(t, "make_env") for t in components.values()]
        if any(episodic) and not all(episodic):
            raise ValueError("task.mixture: mix multi-turn domains (make_env) with multi-turn "
                             "ones only")  # fmt: skip
        if all(episodic):  # each episode's environment from its domain's task
            self.make_env = lambda example: self.task_of(example).make_env(example)

    def task_of(self, example: dict):
        return self.components[example["domain"]]

    def score(self, completion: str, example: dict):
        return self.task_of(example).score(completion, example)

    def demonstration(self, example: dict, rng: np.random.Generator | None = None) -> str:
        return self.task_of(example).demonstration(example, rng)
