"""reasoning-gym's procedural datasets, scored by the library's own `score_answer`.

    task:
      name: reasoning_gym
      reasoning_gym:
        datasets: {basic_arithmetic: 1, leg_counting: 2}   # name -> weight
        configs: {basic_arithmetic: {max_terms: 3}}        # optional, per dataset

An optional dependency (`pip install 'jaxrl-scale[reasoning-gym]'`). The problems are one
composite dataset of num_train + num_eval items drawn with the run's seed (each from a dataset
picked by weight); the first num_eval are held out. The prompt is the question with
`template`; the answer is the text inside the completion's last <answer>...</answer> (the
whole completion when it has none) and `score_answer` grades it in [0, 1] (some datasets give
partial credit). The model's tokenizer is used; without one (CPU experiments) a character
tokenizer over printable ASCII.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping

import numpy as np

from jaxrl_scale.configbase import ConfigError
from jaxrl_scale.models.tokenizer import CharTokenizer, Tokenizer
from jaxrl_scale.tasks.scoring import strip_think

DEFAULT_TEMPLATE = "{question}\nGive only the final answer, inside <answer></answer> tags."
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
ASCII = string.printable.replace("\x0b", "").replace("\x0c", "").replace("\r", "")


def final_answer(completion: str) -> str:
    """The text of the last <answer>...</answer>, stripped; the whole completion without one."""
    found = ANSWER.findall(completion)
    return (found[-1] if found else completion).strip()


class ReasoningGymTask:
    name = "reasoning_gym"

    def __init__(
        self,
        *,
        datasets: Mapping[str, float],
        configs: Mapping[str, Mapping] | None = None,
        template: str = DEFAULT_TEMPLATE,
        num_train: int = 512,
        num_eval: int = 64,
        seed: int = 0,
        tokenizer: Tokenizer | None = None,
    ):
        try:
            import reasoning_gym
            from reasoning_gym.composite import DatasetSpec
        except ImportError:
            raise ConfigError(
                "task.name: reasoning_gym needs the optional dependency reasoning-gym: "
                "pip install 'jaxrl-scale[reasoning-gym]'"
            ) from None
        if not datasets:
            raise ConfigError("task.reasoning_gym.datasets: name at least one dataset")
        configs = dict(configs or {})
        unknown = sorted(set(configs) - set(datasets))
        if unknown:
            raise ConfigError(f"task.reasoning_gym.configs: {unknown} are not in datasets")
        specs = [
            DatasetSpec(name=n, weight=float(w), config=dict(configs.get(n, {})))
            for n, w in datasets.items()
        ]
        try:
            self.dataset = reasoning_gym.create_dataset(
                "composite", size=num_train + num_eval, seed=seed, datasets=specs
            )
        except Exception as e:  # noqa: BLE001 - an unknown name or bad config, named
            raise ConfigError(
                f"task.reasoning_gym: reasoning-gym could not build {dict(datasets)} "
                f"({type(e).__name__}: {e})"
            ) from e
        self.template = template
        self.tokenizer = tokenizer or CharTokenizer(ASCII)
        rows = [self._example(self.dataset[i]) for i in range(num_train + num_eval)]
        self.eval_examples, self.train_examples = rows[:num_eval], rows[num_eval:]

    def _example(self, entry: dict) -> dict:
        return {
            "prompt": self.template.format(question=entry["question"]),
            "question": entry["question"],
            "answer": str(entry["answer"]),
            "metadata": entry["metadata"],
            "dataset": entry["metadata"]["source_dataset"],
            "entry": entry,
        }

    def score(self, completion: str, example: dict) -> float:
        """reasoning-gym's score of the completion's final answer, in [0, 1]: its text after
        the thinking (0.0 when a `<think>` never closes), inside its last <answer> tags."""
        answer = strip_think(completion)
        if answer is None:
            return 0.0
        return float(self.dataset.score_answer(final_answer(answer), example["entry"]))

    def demonstration(self, example: dict, rng: np.random.Generator | None = None) -> str:
        return f"<answer>{example['answer']}</answer>"
