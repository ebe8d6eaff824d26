"""Training and held-out examples of a data-file task (math, code): one rule for both."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def split_examples(
    examples: Sequence[dict],
    held_out: Sequence[dict] | None,
    *,
    num_train: int,
    num_eval: int,
    seed: int,
    source: str,
    error: Callable[[str], Exception] = ValueError,
) -> tuple[list[dict], list[dict]]:
    """(train, eval): the first `num_eval` rows of `held_out` (a file of its own), else
    `num_eval` rows of `examples` drawn with `seed` (the rest, in file order, to train on);
    the training rows cut to `num_train` (0: all). Too few rows is `error` naming `source`."""
    if held_out is not None:
        return list(examples[:num_train] if num_train else examples), list(held_out[:num_eval])
    if num_eval >= len(examples):
        raise error(
            f"{source}: {len(examples)} rows cannot give {num_eval} held-out problems "
            "and leave any to train on"
        )
    order = np.random.default_rng(seed).permutation(len(examples))
    evals = [examples[i] for i in order[:num_eval]]
    train = [examples[i] for i in np.sort(order[num_eval:])]
    return (train[:num_train] if num_train else train), evals
