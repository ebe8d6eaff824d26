"""Multi-turn episodes on the static path: every live episode's next turn generated in waves.

An episode is one token sequence: the first observation (the prompt), then the model's turns
exactly as sampled, each followed by the environment's observation (tasks/env.py,
`Observations`) while the episode goes on. As a Rollout row the prompt sits in the prompt
columns and everything after it in the completion columns:

    prompt | turn 1 (mask 1) | observation 1 (mask 0) | turn 2 (mask 1) | ... | pad

Observation tokens are context: mask 0, so no loss, no behaviour log-prob, version -1, and
out of `gen_tokens`; the model's tokens keep their log-probs and policy versions. The episode's
reward is the sum of its steps' rewards; group advantages compare the G episodes of one
example as they compare G completions. An episode ends when its environment says done, when
it has had `task.max_turns` turns, or when its tokens reach `task.max_episode_tokens`
(prompt included: truncated, counted); an environment that fails (raises, hangs past
`task.env_timeout`, answers malformed) ends its episode with reward 0, counted.

Each turn re-reads its episode's whole context (a prefill per turn): simple, and the way
evaluation runs every episode to its end.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings

import jax
import numpy as np

from jaxrl_scale.generation.sampler import EOS, LENGTH, Rollout, pad_prompts, prompt_width
from jaxrl_scale.parallel import distributed
from jaxrl_scale.tasks.env import EnvError, EnvRunner, Observations


@dataclasses.dataclass
class Episode:
    """One episode as it runs, on the host (owned by the thread running the episodes)."""

    env: object | None
    prompt: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    mask: list[float] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    done: bool = False
    truncated: bool = False
    error: str | None = None

    def fail(self, why: str) -> None:
        self.error, self.done, self.reward = why, True, 0.0

    def room(self, budget: int) -> int:
        return budget - len(self.prompt) - len(self.tokens)

    def add(self, tokens, mask, logp, versions) -> None:
        self.tokens += [int(t) for t in tokens]
        self.mask += [float(m) for m in mask]
        self.logp += [float(x) for x in logp]
        self.versions += [int(v) for v in versions]


class EpisodeRunner:
    """Runs a task's episodes with `generate` (a WaveGenerator's, or a rollout worker's) and
    `runner` (the environments' thread pool); `tok` encodes observations."""

    def __init__(self, cfg, task, tok, generate, runner: EnvRunner):
        self.cfg, self.task, self.tok, self.generate, self.runner = cfg, task, tok, generate, runner
        self.observations = Observations(tok)
        # Failure kinds already logged: the generator thread's episodes and the main thread's
        # evaluation may fail at once (everything else here is per call).
        self._logged: set[str] = set()
        self._log_lock = threading.Lock()

    def run(self, params_for_chunk, examples, key, *, sampling, repeat: int):
        """(Rollout on the host of len(examples) x repeat episodes, their rewards [B], stats)."""
        t = self.cfg.task
        start = time.perf_counter()
        env_seconds = 0.0
        rows = [e for e in examples for _ in range(repeat)]
        made = self.runner.make(self.task, rows)
        episodes = [Episode(env) for env, _ in made]
        for ep, (_, why) in zip(episodes, made, strict=True):
            if why is not None:
                self._fail(ep, f"make_env: {why}")
        live = [ep for ep in episodes if not ep.done]
        clock = time.perf_counter()
        first = self.runner.reset([ep.env for ep in live])
        env_seconds += time.perf_counter() - clock
        for ep, (obs, why) in zip(live, first, strict=True):
            if why is not None:
                self._fail(ep, f"reset: {why}")
                continue
            try:
                tools = getattr(ep.env, "tools", None)  # offered through the chat template
                ep.prompt = self.tok.encode(self.observations.first(obs, tools))
            except (EnvError, ValueError) as e:
                self._fail(ep, f"reset: {e}")
                continue
            if ep.room(t.max_episode_tokens) <= 0:
                ep.done = ep.truncated = True
        for turn in range(t.max_turns):
            live = [ep for ep in episodes if not ep.done]
            if not live:
                break
            contexts = [ep.prompt + ep.tokens for ep in live]
            ro = self.generate(
                params_for_chunk, contexts, jax.random.fold_in(key, turn),
                sampling=sampling, n_new=t.turn_tokens or self.cfg.sampler.max_new_tokens,
            )  # fmt: skip
            host = jax.tree.map(distributed.to_host, ro)
            actions = []
            for i, ep in enumerate(live):
                n = min(int(host.lengths[i]), ep.room(t.max_episode_tokens))
                ep.add(host.completion_tokens[i, :n], host.completion_mask[i, :n],
                       host.behavior_logp[i, :n], host.versions[i, :n])  # fmt: skip
                ep.turns += 1
                actions.append(self.tok.decode(host.completion_tokens[i, :n]))
                if n < int(host.lengths[i]) or ep.room(t.max_episode_tokens) <= 0:
                    ep.truncated = True
            clock = time.perf_counter()
            steps = self.runner.step([ep.env for ep in live], actions)
            env_seconds += time.perf_counter() - clock
            for ep, (result, why) in zip(live, steps, strict=True):
                if why is not None:
                    self._fail(ep, f"step: {why}")
                    continue
                obs, reward, done = result
                ep.reward += reward
                if done or obs is None or ep.truncated or turn == t.max_turns - 1:
                    ep.done = True  # (out of turns: truncated below)
                    ep.truncated |= not (done or obs is None)
                    continue
                try:
                    text = self.observations.after_turn(obs, getattr(ep.env, "tools", None))
                    ids = self.tok.encode(text)
                except (EnvError, ValueError) as e:
                    self._fail(ep, f"step's observation: {e}")
                    continue
                keep = ids[: max(ep.room(t.max_episode_tokens), 0)]
                ep.add(keep, [0.0] * len(keep), [0.0] * len(keep), [-1] * len(keep))
                if len(keep) < len(ids) or ep.room(t.max_episode_tokens) <= 0:
                    ep.done = ep.truncated = True
        stats = {
            "turns_mean": float(np.mean([ep.turns for ep in episodes])),
            "env_seconds": env_seconds,
            "env_errors": sum(ep.error is not None for ep in episodes),
            "episodes_truncated": sum(ep.truncated and ep.error is None for ep in episodes),
            "tool_errors": sum(getattr(ep.env, "tool_errors", 0) for ep in episodes),
            "episode_seconds": time.perf_counter() - start,
        }
        rewards = np.array([ep.reward for ep in episodes])
        return self._rollout(episodes), rewards, stats

    def _fail(self, ep: Episode, why: str) -> None:
        ep.fail(why)
        kind = why.partition(":")[0]
        with self._log_lock:
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            warnings.warn(
                f"task {getattr(self.task, 'name', 'env')}: an episode ended with reward 0 "
                f"({why}); later ones are only counted (env_errors)",
                stacklevel=3,
            )

    def _rollout(self, episodes: list[Episode]) -> Rollout:
        """The episodes as a host Rollout: prompts left-padded (a few widths), completions
        in `task.max_episode_tokens` columns."""
        n = self.cfg.task.max_episode_tokens
        prompts = [ep.prompt or [self.tok.pad_id] for ep in episodes]
        width = prompt_width(max(map(len, prompts)), n)
        prompt_tokens, prompt_mask = pad_prompts(prompts, self.tok.pad_id, width=width)
        b = len(episodes)
        tokens = np.full((b, n), self.tok.pad_id, np.int32)
        mask, logp = np.zeros((b, n), np.float32), np.zeros((b, n), np.float32)
        versions = np.full((b, n), -1, np.int32)
        for i, ep in enumerate(episodes):
            k = len(ep.tokens)
            tokens[i, :k], mask[i, :k], logp[i, :k], versions[i, :k] = (
                ep.tokens, ep.mask, ep.logp, ep.versions,
            )  # fmt: skip
        finish = np.array([LENGTH if ep.truncated else EOS for ep in episodes], np.int32)
        lengths = np.array([len(ep.tokens) for ep in episodes], np.int32)
        return Rollout(prompt_tokens, prompt_mask, tokens, mask, logp, versions, finish, lengths)
