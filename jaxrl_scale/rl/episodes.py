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
(prompt included: truncated, counted).

Episodes that cannot be trained are left out of the loss, counted, never scored 0: one whose
environment failed (raised, hung past `task.env_timeout`, answered malformed: `env_errors`),
one whose first observation differs from its group's (`episodes_prompt_mismatch`: the train
step reads one prompt per group), one whose first observation alone fills
`task.max_episode_tokens` (`episodes_prompt_too_long`). Their rewards are NaN, which
`group_advantages` reads as missing; every row of a group carries the group's prompt. In a
held-out evaluation such an episode's return is 0.

A turn that ends with the end-of-turn token the model sampled continues with the rest of the
template's turn end (Qwen's "\n" after "<|im_end|>"); a turn cut off by `task.turn_tokens`
before any is closed with the template's whole turn end, as context (mask 0), and the
episode goes on.

Each turn re-reads its episode's whole context (a prefill per turn): simple, and the way
evaluation runs every episode to its end.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import threading
import time
import warnings

import jax
import numpy as np

from jaxrl_scale.generation.engine import SlotEngine
from jaxrl_scale.generation.sampler import EOS, LENGTH, Rollout, pad_prompts, prompt_width
from jaxrl_scale.parallel import distributed
from jaxrl_scale.rl.pipeline import ParamsForChunk
from jaxrl_scale.tasks.env import EnvError, EnvRunner, Observations, check_tools


@dataclasses.dataclass(eq=False)
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
    truncated: bool = False  # it ended unfinished (its finish reason: length)
    out_of_turns: bool = False  # ... because task.max_turns ran out (else its tokens did)
    error: str | None = None
    request: int = -1  # its row's id in a slot engine (EngineEpisodes)
    ended_with: int | None = None  # the end-of-turn token its last turn sampled, if any
    dropped: str | None = None  # why it cannot be trained (a stats key), if so
    shift: int = 0  # engine completion columns before `tokens` (the prompt's rest, given)

    def fail(self, why: str) -> None:
        self.error, self.done, self.reward = why, True, 0.0
        # Lost with its worker process, killed for another environment's hang (tasks/env.py):
        # not this environment's failure.
        self.dropped = "episodes_lost" if "WorkerLost" in why else "env_errors"

    def room(self, budget: int) -> int:
        return budget - len(self.prompt) - len(self.tokens)

    def add(self, tokens, mask, logp, versions) -> None:
        self.tokens += [int(t) for t in tokens]
        self.mask += [float(m) for m in mask]
        self.logp += [float(x) for x in logp]
        self.versions += [int(v) for v in versions]


class EpisodeRunner:
    """Runs a task's episodes with `generate` (a WaveGenerator's, or a rollout worker's) and
    `runner` (the environments' thread pool); `tok` encodes observations. `begin`,
    `end_turn` and `observe` move one episode on; the slot engine's `EngineEpisodes` uses
    them too."""

    def __init__(self, cfg, task, tok, generate, runner: EnvRunner):
        self.cfg, self.task, self.tok, self.generate, self.runner = cfg, task, tok, generate, runner
        self.observations = Observations(tok)
        # Failure kinds already logged: the generator thread's episodes and the main thread's
        # evaluation may fail at once (everything else here is per call).
        self._logged: set[str] = set()
        self._log_lock = threading.Lock()

    def run(self, params_for_chunk, examples, key, *, sampling, repeat: int, training=True):
        """(Rollout on the host of len(examples) x repeat episodes, their rewards [B], stats),
        every live episode's next turn generated at once (a wave per turn). `training`: the
        rewards of episodes that cannot be trained are NaN (`settle_groups`); else (a
        held-out evaluation) each episode's return, 0 for one its environment failed."""
        t = self.cfg.task
        start = time.perf_counter()
        env_seconds = 0.0
        rows = [e for e in examples for _ in range(repeat)]
        made = self.runner.make(self.task, rows)
        episodes = [Episode(env) for env, _ in made]
        for ep, (_, why) in zip(episodes, made, strict=True):
            if why is not None:
                self.fail(ep, f"make_env: {why}")
        live = [ep for ep in episodes if not ep.done]
        clock = time.perf_counter()
        first = self.runner.reset([ep.env for ep in live])
        env_seconds += time.perf_counter() - clock
        for ep, (obs, why) in zip(live, first, strict=True):
            if why is not None:
                self.fail(ep, f"reset: {why}")
            else:
                self.begin(ep, obs)
        for turn in range(t.max_turns):
            live = [ep for ep in episodes if not ep.done]
            if not live:
                break
            contexts = [ep.prompt + ep.tokens for ep in live]
            ro = self.generate(
                params_for_chunk, contexts, jax.random.fold_in(key, turn),
                sampling=sampling, n_new=self.turn_tokens,
            )  # fmt: skip
            host = jax.tree.map(distributed.to_host, ro)
            actions = []
            for i, ep in enumerate(live):
                sampled = int(host.lengths[i])
                n = min(sampled, ep.room(t.max_episode_tokens))
                actions.append(self.end_turn(
                    ep, host.completion_tokens[i, :n], host.completion_mask[i, :n],
                    host.behavior_logp[i, :n], host.versions[i, :n], cut=n < sampled,
                ))  # fmt: skip
            clock = time.perf_counter()
            steps = self.runner.step([ep.env for ep in live], actions)
            env_seconds += time.perf_counter() - clock
            for ep, (result, why) in zip(live, steps, strict=True):
                self.observe(ep, result, why)
        rewards = self.settle_groups(episodes, repeat)
        if not training:
            rewards = np.array([ep.reward for ep in episodes])
        return self.rollout(episodes), rewards, self.stats(episodes, env_seconds, start)

    @property
    def turn_tokens(self) -> int:
        return self.cfg.task.turn_tokens or self.cfg.sampler.max_new_tokens

    def begin(self, ep: Episode, obs) -> bool:
        """The episode's first observation as its prompt; whether it goes on to a turn."""
        try:
            ep.prompt = self.tok.encode(self.observations.first(obs, self._tools(ep)))
        except Exception as e:  # noqa: BLE001 - the environment's data, reported per episode
            self.fail(ep, f"reset: {_why(e)}")
            return False
        if not ep.prompt:
            self.fail(ep, "reset: the first observation has no tokens")
            return False
        if ep.room(self.cfg.task.max_episode_tokens) <= 0:
            ep.done = ep.truncated = True
            ep.dropped = "episodes_prompt_too_long"
            self.warn_once(
                "too long",
                f"a first observation of {len(ep.prompt)} tokens fills task.max_episode_tokens "
                f"({self.cfg.task.max_episode_tokens}; the chat template's tool schemas "
                "count too): such episodes get no turn and are left out of the loss "
                "(counted: episodes_prompt_too_long)",
            )
        return not ep.done

    @staticmethod
    def _tools(ep: Episode):
        """The environment's `tools` (offered through the chat template), checked."""
        return check_tools(getattr(ep.env, "tools", None))

    def end_turn(self, ep: Episode, tokens, mask, logp, versions, *, cut: bool) -> str:
        """A model turn as sampled (`cut`: it ran into the episode's budget): the action text
        its environment steps with."""
        ep.add(tokens, mask, logp, versions)
        ep.turns += 1
        last = int(tokens[-1]) if len(tokens) else None
        ep.ended_with = last if not cut and last in self.tok.eos_ids else None
        if cut or ep.room(self.cfg.task.max_episode_tokens) <= 0:
            ep.truncated = True
        return self.tok.decode(tokens)

    def observe(self, ep: Episode, result, why: str | None) -> list[int] | None:
        """The environment's step after a turn: its reward counted, and the observation's
        tokens (added to the episode) that the next turn follows, or None: the episode is
        over (done, out of turns or tokens, failed)."""
        t = self.cfg.task
        if why is not None:
            self.fail(ep, f"step: {why}")
            return None
        obs, reward, done = result
        ep.reward += reward
        if done or obs is None or ep.truncated or ep.turns >= t.max_turns:
            ep.done = True
            if not (done or obs is None or ep.truncated):  # the environment would go on
                ep.truncated = ep.out_of_turns = True
            return None
        room = max(ep.room(t.max_episode_tokens), 0)
        obs, cut = _bounded(obs, room * MAX_CHARS_PER_TOKEN)
        try:
            text = self.observations.after_turn(obs, self._tools(ep), ended_with=ep.ended_with)
            ids = self.tok.encode(text)
        except Exception as e:  # noqa: BLE001 - the environment's data, reported per episode
            self.fail(ep, f"step's observation: {_why(e)}")
            return None
        keep = ids[:room]
        ep.add(keep, [0.0] * len(keep), [0.0] * len(keep), [-1] * len(keep))
        if cut or len(keep) < len(ids) or ep.room(t.max_episode_tokens) <= 0:
            ep.done = ep.truncated = True
            return None
        return keep

    def stats(self, episodes: list[Episode], env_seconds: float, start: float) -> dict:
        """A batch's episode statistics; `env_seconds`: time the generator waited on
        environments with nothing to decode."""
        return {
            "turns_mean": float(np.mean([ep.turns for ep in episodes])),
            "env_seconds": env_seconds,
            "env_errors": sum(ep.dropped == "env_errors" for ep in episodes),
            "episodes_lost": sum(ep.dropped == "episodes_lost" for ep in episodes),
            # Unfinished episodes, one key per cause: the token budget, the turns.
            "episodes_truncated": sum(
                ep.truncated and not ep.out_of_turns and ep.error is None and ep.dropped is None
                for ep in episodes
            ),
            "episodes_out_of_turns": sum(ep.out_of_turns and ep.error is None for ep in episodes),
            "episodes_prompt_too_long": sum(
                ep.dropped == "episodes_prompt_too_long" for ep in episodes
            ),
            "episodes_prompt_mismatch": sum(
                ep.dropped == "episodes_prompt_mismatch" for ep in episodes
            ),
            "tool_errors": sum(getattr(ep.env, "tool_errors", 0) for ep in episodes),
            "episode_seconds": time.perf_counter() - start,
        }

    def fail(self, ep: Episode, why: str) -> None:
        """End `ep` with reward 0 for `why` (counted; the first of its kind is logged)."""
        ep.fail(why)
        self.warn_once(
            why.partition(":")[0],
            f"an episode's environment failed ({why}); it is left out of the loss, and "
            "later ones are only counted (env_errors)",
        )

    def warn_once(self, kind: str, text: str) -> None:
        with self._log_lock:
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            name = getattr(self.task, "name", "env")
            warnings.warn(f"task {name}: {text}", stacklevel=4)

    def settle_groups(self, episodes: list[Episode], group_size: int) -> np.ndarray:
        """Each episode's reward, NaN where it cannot be trained ([B]); every row of a group
        of `group_size` consecutive episodes given the group's prompt: the first observation
        most of its live episodes share (an episode with another is dropped, counted)."""
        for start in range(0, len(episodes), group_size):
            group = episodes[start : start + group_size]
            prompts = [tuple(ep.prompt) for ep in group if ep.prompt and ep.dropped is None]
            if not prompts:
                prompts = [tuple(ep.prompt) for ep in group if ep.prompt]
            if not prompts:
                continue
            shared = max(dict.fromkeys(prompts), key=prompts.count)  # the first, on a tie
            for ep in group:
                if ep.prompt and tuple(ep.prompt) != shared and ep.dropped is None:
                    ep.dropped = "episodes_prompt_mismatch"
                    self.warn_once(
                        "mismatch",
                        "the episodes of one example began with different observations "
                        "(reset() must be a function of the example); those unlike their "
                        "group's are left out of the loss (counted: episodes_prompt_mismatch)",
                    )
                if tuple(ep.prompt) != shared:
                    ep.prompt = list(shared)
        return np.array([np.nan if ep.dropped else ep.reward for ep in episodes])

    def rollout(self, episodes: list[Episode]) -> Rollout:
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


@dataclasses.dataclass
class _Batch:
    """A training batch of episodes queued in the engine (owned by the feeding thread)."""

    indices: np.ndarray  # prompt indices
    episodes: list[Episode]
    tag: object  # the caller's (colocated: the curriculum's cursor before the draw)
    not_before: int | None  # the oldest version its tokens may carry
    opening: int = 0  # environments still being made and reset
    ready: list[int] = dataclasses.field(default_factory=list)  # requests opened, not queued
    start: float = 0.0
    waited: float = 0.0  # the engine's `waited` when it was queued


class EngineEpisodes:
    """Continuous batching of episodes (`sampler.batching: continuous` with a multi-turn
    task): each batch's `train.prompts_per_step` x `train.group_size` episodes run on a slot
    engine of `slots` rows (`generation.engine`, `episodes=True`), one row per episode: its
    first observation prefilled into the prompt columns, then its turns and observations in
    `task.max_episode_tokens` completion columns. Nothing waits for an environment: a row
    whose turn ends is parked on its slot while its environment steps on `runner`'s thread
    pool and the other slots decode; the observation is then fed into the row's cache (never
    a prefill of the episode) and the next turn sampled. Environments are made and reset on
    the pool too, and a batch's episodes enter the engine in batch order once opened; the
    batch behind is queued as `EngineBatches` queues it (held until its version bound).

    Colocated, `next` draws each batch's prompts from `curriculum`; a generator job (no
    curriculum) queues the batches the hub hands it (`queue`) and moves them on one step at
    a time (`step`, `complete`, `pop`), as it does `EngineBatches`. Owned by the thread that
    calls these (the feeding thread, or the generator job's)."""

    def __init__(self, cfg, graphdef, tok, runner: EpisodeRunner, *, mesh, slots: int,
                 sampling, curriculum, examples):  # fmt: skip
        self.cfg, self.graphdef, self.tok, self.runner = cfg, graphdef, tok, runner
        self.mesh, self.slots, self.sampling = mesh, slots, sampling
        self.curriculum, self.examples = curriculum, examples
        parked = cfg.sampler.parked_rows  # (single-turn tool episodes never wait)
        self.parked_rows = 0 if cfg.task.max_turns == 1 else slots if parked < 0 else parked
        self.engine: SlotEngine | None = None  # built once the first batch has opened
        self.key = None  # the engine's key: the first batches'
        self.queued: list[_Batch] = []
        self.live: dict[int, Episode] = {}  # request -> episode, while it runs
        self.calls: dict[cf.Future, tuple[int, str]] = {}  # env calls: (request, open | step)
        self.batch_of: dict[int, _Batch] = {}  # request -> its batch, while it opens
        self.requests = 0
        self.version = -1  # of the last run
        self.chunk = 0  # engine runs in this `next` (or since the job's last `pop`)
        self._fresh = None  # (version, params) asked for before a `next` loop, not yet run
        self.waited = 0.0  # seconds with nothing to decode, every live row at its environment
        # The share of slot-steps with a row decoding since the batch before was handed
        # over, and the engine's (steps, slot-steps) counts then (as `EngineBatches`).
        self.occupancy = 0.0
        self._counts = (0, 0)

    def _build(self, first: _Batch) -> None:
        """The engine, once the first batch's environments have opened: its prompt columns
        `task.prompt_tokens`, or (0) the first batch's longest first observation rounded up
        to 8; a longer first observation's rest is fed as given tokens in the completion
        columns, which hold the episode's whole budget."""
        cfg, t = self.cfg, self.cfg.task
        longest = max([len(ep.prompt) for ep in first.episodes] + [1])
        width = t.prompt_tokens or min(-(-longest // 8) * 8, t.max_episode_tokens)
        self.engine = SlotEngine(
            self.graphdef, slots=self.slots, prompt_len=width, n_new=t.max_episode_tokens,
            repeat=1, sampling=self.sampling, eos_ids=self.tok.eos_ids, pad_id=self.tok.pad_id,
            model_cfg=cfg.model, key=self.key, mesh=self.mesh, episodes=True,
            parked_rows=self.parked_rows,
        )  # fmt: skip

    def _draw(self, key, oldest: int | None) -> None:
        """Draw the next batch's prompts from the curriculum and queue them."""
        cursor = (self.curriculum.epoch, self.curriculum.position)
        indices = self.curriculum.next_batch(self.cfg.train.prompts_per_step)
        self.queue(indices, key, oldest, tag=cursor)

    def queue(self, indices, key, oldest: int | None, tag=None) -> None:
        """Queue a batch: `train.group_size` episodes of each of `examples[indices]`, their
        environments opened now, held in the engine until the version is at least `oldest`
        (None: not held); `key` seeds the engine if it is the first. `tag` comes back with
        the batch (`pop`)."""
        cfg = self.cfg
        self.key = key if self.key is None else self.key
        batch = _Batch(np.asarray(indices), [], tag, oldest, start=time.perf_counter(),
                       waited=self.waited)  # fmt: skip
        for i in indices:
            for _ in range(cfg.train.group_size):
                ep = Episode(None)
                batch.episodes.append(ep)
                ep.request = self.requests
                self.requests += 1
                self.live[ep.request] = ep
                self.batch_of[ep.request] = batch
                future = self.runner.runner.start_open(self.runner.task, self.examples[i])
                self.calls[future] = (ep.request, "open")
                batch.opening += 1
        self.queued.append(batch)

    def _limit(self, ep: Episode) -> int:
        """The engine completion column the episode's next turn ends by."""
        budget = self.cfg.task.max_episode_tokens
        return ep.shift + min(len(ep.tokens) + self.runner.turn_tokens, budget - len(ep.prompt))

    def _settle(self) -> None:
        """The environment calls that have ended: episodes queued, resumed or ended."""
        if not self.calls:
            return
        outcomes = self.runner.runner.outcomes({f: kind for f, (_, kind) in self.calls.items()})
        for future, (value, why) in outcomes.items():
            request, kind = self.calls.pop(future)
            ep = self.live[request]
            if kind == "open":
                batch = self.batch_of.pop(request)
                batch.opening -= 1
                if why is not None:  # _open names make_env's failures itself
                    kind = "" if why.startswith("EnvError: make_env:") else "reset: "
                    self.runner.fail(ep, kind + why.removeprefix("EnvError: "))
                else:
                    ep.env = value[0]
                    if self.runner.begin(ep, value[1]):
                        batch.ready.append(request)
            else:
                ids = self.runner.observe(ep, value, why)
                if ids is None:
                    self.engine.release(request, 0)
                else:
                    self.engine.resume(request, 0, ids, self._limit(ep))
            if ep.done:
                del self.live[request]
        if self.engine is None:
            if self.queued[0].opening:
                return
            self._build(self.queued[0])
        for batch in self.queued:  # into the engine in batch order: none jumps a held one
            for request in batch.ready:
                ep = self.live[request]
                head = self.engine.prompt_len
                ep.shift = max(len(ep.prompt) - head, 0)
                self.engine.submit(request, ep.prompt[:head], max_new=self._limit(ep),
                                   not_before=batch.not_before, given=ep.prompt[head:])  # fmt: skip
            batch.ready = []
            if batch.opening:
                break

    def _turn_ended(self, row) -> None:
        ep = self.live[row.request]
        start = ep.shift + len(ep.tokens)
        action = self.runner.end_turn(
            ep, row.tokens[start : row.length], row.mask[start : row.length],
            row.logp[start : row.length], row.versions[start : row.length], cut=False,
        )  # fmt: skip
        self.calls[self.runner.runner.start_step(ep.env, action)] = (row.request, "step")

    def in_flight(self) -> tuple[int, int]:
        """(prompts drawn and not handed over in a batch, their episodes still running)."""
        prompts = sum(len(b.indices) for b in self.queued)
        return prompts, len(self.live)

    def cursor(self) -> tuple[int, int] | None:
        return self.queued[0].tag if self.queued else None

    def release(self) -> None:
        """Free the engine's slots on the devices while nothing is queued (a generator job's
        evaluation runs in their place); the next batch builds the engine again."""
        if self.queued:
            raise ValueError(f"{len(self.queued)} batch(es) are still queued in the engine")
        self.engine, self._counts = None, (0, 0)

    def complete(self) -> bool:
        """Whether every episode of the oldest queued batch has ended."""
        return bool(self.queued) and all(ep.done for ep in self.queued[0].episodes)

    def step(self, params_for_chunk: ParamsForChunk) -> None:
        """One move on: the environment calls that ended are settled; then one engine run
        with the newest weights, or, when it would decode nothing while environments are
        busy, a short wait for them (none busy: newer weights may release a held prompt, so
        the engine runs). (No engine yet: the first batch's environments are opening.)"""
        self._settle()
        engine = self.engine
        if engine is not None and (
            engine.would_run(self.version) or (engine.pending and not self.calls)
        ):
            if self._fresh is None:
                jax.block_until_ready(engine.state.done)  # as EngineBatches.step
                self._fresh = params_for_chunk(self.chunk)
                self.chunk += 1
            (self.version, params), self._fresh = self._fresh, None
            for row in engine.run(params, self.version, self.cfg.sampler.admit_every):
                self._turn_ended(row)
        elif self.calls:  # every live row is at its environment
            clock = time.perf_counter()
            cf.wait(list(self.calls), timeout=0.05, return_when=cf.FIRST_COMPLETED)
            self.waited += time.perf_counter() - clock

    def pop(self):
        """(prompt indices, Rollout on the host, rewards [B] (NaN: cannot be trained), stats,
        tag) of the oldest queued batch, once `complete`."""
        batch = self.queued.pop(0)
        if self.engine is not None:
            counts = (self.engine.steps, self.engine.slot_steps)
            steps, busy = (now - then for now, then in zip(counts, self._counts, strict=True))
            if steps:  # (none since the batch before: it finished in runs already counted)
                self.occupancy, self._counts = busy / (self.slots * steps), counts
        episodes = batch.episodes
        rewards = self.runner.settle_groups(episodes, self.cfg.train.group_size)
        stats = self.runner.stats(episodes, self.waited - batch.waited, batch.start)
        return batch.indices, self.runner.rollout(episodes), rewards, stats, batch.tag

    def next(self, params_for_chunk: ParamsForChunk, key, oldest: int | None):
        """(prompt indices, Rollout on the host, rewards [B], stats) of the oldest queued
        batch once every one of its episodes has ended; `oldest` as `EngineBatches.next`."""
        ahead = 2 if self.cfg.pipeline.mode == "pipeline_rl" else 1
        while len(self.queued) < ahead:
            self._draw(key, None if oldest is None else oldest + len(self.queued))
        if self.engine is not None and self.engine.busy:  # its last run has ended before
            jax.block_until_ready(self.engine.state.done)  # the next weights are asked for
        # What a held prompt is admitted by, asked for now: the first run uses it.
        self._fresh = params_for_chunk(0)
        self.version, self.chunk = self._fresh[0], 1
        while not self.complete():
            self.step(params_for_chunk)
        self._fresh = None
        indices, ro, rewards, stats, _ = self.pop()
        return indices, ro, rewards, stats


# What an observation's text is cut to before it is rendered and tokenized, per token of room
# left: no tokenizer's token is longer, so the cut never shortens what fits, and a tool that
# answers 50 MB costs a bounded tokenization on the generator's thread.
MAX_CHARS_PER_TOKEN = 64


def _bounded(obs, limit: int):
    """(`obs` with its text cut to `limit` characters in all, whether any was cut)."""
    if isinstance(obs, str):
        return obs[:limit], len(obs) > limit
    out, left, cut = [], limit, False
    for m in obs:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            cut |= len(content) > left
            m = {**m, "content": content[:left]}
            left = max(left - len(content), 0)
        out.append(m)
    return out, cut


def _why(e: Exception) -> str:
    """An error's text for the counts' log: an EnvError says what is wrong itself."""
    return str(e) if isinstance(e, EnvError) else f"{type(e).__name__}: {e}"
