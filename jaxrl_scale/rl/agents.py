"""Agent tasks: the user's agent, written against the OpenAI API, trained through a session URL
on the trainer's own slot engine.

    def agent(base_url, api_key, example):          # sync or async
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        ...                                         # any number of calls, tools, thinking
        return reward                               # a float, or named parts (as `score`)

Each of a batch's `train.prompts_per_step` x `train.group_size` episodes opens a session
(serve/sessions.py) and runs `agent(base_url, api_key, example)` on a thread of the agent pool
(`task.agent_workers`), `base_url` being `.../sessions/<id>/v1` on an OpenAI server of this
process (127.0.0.1, a free port) in front of the slot engine, which this module drives from
the feeding thread with the newest weights at every run (`EngineBackend.drive`): the tokens
carry their policy versions, and a batch's calls are held until the version its staleness
bound allows. The engine never waits for an agent: while one thinks or runs its tools, the
other sessions' calls fill the slots.

An episode's sample is the branch its last call continued (serve/sessions.py: the exact ids,
sampled ones masked 1), with the agent's reward; the group's advantages compare the G
episodes of one example. The sampling settings are the run's (`sampler.temperature`,
`sampler.top_p`): an agent's own are not used, so the behaviour log-probs are those the loss
expects. An agent that raises, returns a non-number or outlives `task.agent_timeout` (its
session is then closed: its later calls fail), or that made no call: its episode is left out
of the loss, counted (`agent_errors`, `agent_timeouts`, `agent_idle`), and the run goes on.
Branches beyond an episode's first (histories the agent edited) are counted
(`agent_branches`). The episode's row holds its last branch; its other branches with a sampled
token (row meta `branches`) are packed beside it as sequences of their own (packing.Alone:
each sees only itself) whose tokens count as the row's, with its reward and advantage
(`agent_branches_trained`; packed steps only, train.packing true or auto). A group's rows
share the longest common prefix of their samples' prompts (`_share_prompt`), so a last branch
rendered anew trains beside its siblings' (an episode with no token in common with its group
is dropped, counted: `episodes_prompt_mismatch`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import inspect
import math
import numbers
import os
import queue
import secrets
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx

from jaxrl_scale.rl.episodes import Episode, EpisodeRunner
from jaxrl_scale.rl.pipeline import ParamsForChunk
from jaxrl_scale.serve.engine import EngineBackend
from jaxrl_scale.serve.sessions import Sessions

if TYPE_CHECKING:
    from jaxrl_scale.serve.server import Background

MODEL = "policy"  # the model id the sessions serve (`/models`)


@dataclasses.dataclass(eq=False)
class _Run:
    """One agent episode (the feeding thread's; `started` is set once by its agent thread,
    a float the feeding thread only reads)."""

    example: int
    session: str
    future: cf.Future | None = None
    started: float | None = None  # when its agent began (it may wait for a pool thread)
    timed_out: bool = False


@dataclasses.dataclass
class _Batch:
    indices: np.ndarray
    runs: list[_Run]
    tag: object
    start: float


class EngineAgents:
    """A run's agent episodes on a slot engine of `slots` rows (see the module docstring).
    The same interface as `EngineEpisodes` (`next`, `in_flight`, `cursor`, `release`,
    `occupancy`); owned by the feeding thread.

    `group`: a generator group of several processes (hosts/generator_job.Group), its mesh
    over all their devices. Its leader runs the agents and serves their sessions; every
    decision (a batch complete, fresh weights, each engine turn's submits and cancels) is
    the leader's, `share`d in order, and the followers make the same engine calls (their
    parts of the same programs) and nothing else."""

    def __init__(self, cfg, graphdef, tok, task, agent, *, mesh, slots: int, curriculum,
                 examples, group=None):  # fmt: skip
        self.cfg, self.graphdef, self.tok, self.task, self.agent = cfg, graphdef, tok, task, agent
        self.mesh, self.slots, self.curriculum, self.examples = mesh, slots, curriculum, examples
        several = group is not None and group.size > 1
        self._share = group.share if several else None
        self.follower = several and not group.leader
        self.runner = EpisodeRunner(cfg, task, tok, None, None)  # settles groups, makes rows
        s = cfg.sampler
        self.sessions = Sessions(sampling=(s.temperature, s.top_p))
        self.backend: EngineBackend | None = None  # built with the first weights
        self.server: Background | None = None
        self.pool = None if self.follower else AgentPool(cfg.task.agent_workers, "jaxrl-agent")
        self.queued: list[_Batch] = []
        self.version = -1
        self.chunk = 0
        self._fresh = None  # (version, params) asked for, not yet run
        self.occupancy = 0.0
        self._counts = (0, 0)
        self.meta: list[dict] = []  # the last batch's rows: session, branch, calls
        self._idle = 0

    @property
    def engine(self):
        return None if self.backend is None else self.backend.engine

    # ------------------------------------------------------------------ episodes

    def start(self, params) -> None:
        """The engine (built with `params`: the shapes; each run takes the newest weights)
        and the sessions' server, before the first batch is queued."""
        t = self.cfg.task
        model = nnx.merge(self.graphdef, params)
        self.backend = EngineBackend(
            model, self.tok, slots=self.slots, context=t.max_episode_tokens,
            prompt_len=t.prompt_tokens or None, max_queue=max(64, 4 * self.slots),
            steps=self.cfg.sampler.admit_every, mesh=self.mesh, model_name=MODEL, thread=False,
        )  # fmt: skip
        if self.follower:  # the leader serves the group's sessions
            return
        # (FastAPI and uvicorn: imported where a server starts, not by every run)
        from jaxrl_scale.serve.app import make_app
        from jaxrl_scale.serve.server import Background

        # A key no one has: only the session routes serve (a local process cannot sample
        # from the training engine through /v1).
        self.server = Background(make_app(self.backend, self.tok, sessions=self.sessions,
                                          api_key=secrets.token_urlsafe(24)))  # fmt: skip

    def queue(self, indices, oldest: int | None, tag=None, examples=None, repeat=None) -> _Batch:
        """Start `repeat` (train.group_size) agent episodes of each of `examples[indices]`,
        their calls held until the version is at least `oldest`."""
        examples = self.examples if examples is None else examples
        repeat = repeat or self.cfg.train.group_size
        batch = _Batch(np.asarray(indices), [], tag, time.perf_counter())
        if self.follower:  # the batch's place in line; its agents run on the leader
            self.queued.append(batch)
            return batch
        for i in indices:
            for _ in range(repeat):
                batch.runs.append(_start_run(self.pool, self.sessions, self.server.url,
                                             self.agent, examples[i], int(i), oldest))  # fmt: skip
        self.queued.append(batch)
        return batch

    def _timeouts(self, batch: _Batch) -> None:
        for run in batch.runs:
            if _late(run, self.cfg.task.agent_timeout):
                run.timed_out = True
                run.future.cancel()
                self.sessions.close(run.session, keep=True)  # its later calls fail

    def _done(self, batch: _Batch) -> bool:
        self._timeouts(batch)
        return all(run.future.done() or run.timed_out for run in batch.runs)

    def complete(self) -> bool:
        done = bool(self.queued) and (self.follower or self._done(self.queued[0]))
        return done if self._share is None else self._share(done)  # the leader's

    def step(self, params_for_chunk: ParamsForChunk) -> bool:
        """One engine run with the newest weights, or (nothing to decode) a short wait for
        the agents; False when there was neither (every agent queued has ended)."""
        fresh = self._fresh is None
        if self._share is not None:
            fresh = self._share(fresh)  # the leader's: weights are asked for in step
        if fresh:
            if self.engine is not None and self.engine.busy:
                jax.block_until_ready(self.engine.state.done)
            self._fresh = params_for_chunk(self.chunk)
            self.chunk += 1
        version, params = self._fresh
        if self.follower:
            if self.backend.follow(params, version, self._share):
                self.version = version
            return True
        if self.backend.drive(params, version, self._share):
            self.version, self._fresh = version, None
            return True
        waiting = [r.future for b in self.queued for r in b.runs if not r.future.done()]
        if not waiting:
            return False
        if self._share is None:
            cf.wait(waiting, timeout=0.005, return_when=cf.FIRST_COMPLETED)
            self._idle += 1
        else:  # a group: each step is shared, so fewer and longer ones (a call wakes it)
            self.backend.wait(0.05)
            self._idle += 10
        if self._idle % 10 == 0:  # every 50 ms or so, newer weights (and a stop) asked for
            self._fresh = None
        return True

    def pop(self):
        """(prompt indices, Rollout on the host, rewards [B] (NaN: not trained), stats, tag)
        of the oldest queued batch, once `complete`."""
        batch = self.queued.pop(0)
        if self.follower:  # its rows are the leader's to send
            return None
        if self.engine is not None:
            counts = (self.engine.steps, self.engine.slot_steps)
            steps, busy = (now - then for now, then in zip(counts, self._counts, strict=True))
            if steps:
                self.occupancy, self._counts = busy / (self.slots * steps), counts
        episodes, stats = self._episodes(batch)
        self.meta = [ep.meta for ep in episodes]
        group = len(batch.runs) // len(batch.indices)
        for start in range(0, len(episodes), group):
            _share_prompt(episodes[start : start + group])
        rewards = self.runner.settle_groups(episodes, group)
        stats["episodes_prompt_mismatch"] = sum(
            ep.dropped == "episodes_prompt_mismatch" for ep in episodes
        )
        return batch.indices, self.runner.rollout(episodes), rewards, stats, batch.tag

    def _episodes(self, batch: _Batch) -> tuple[list[Episode], dict]:
        counts = dict.fromkeys(("agent_errors", "agent_timeouts", "agent_idle"), 0)
        calls, seconds, branches, now = [], [], 0, time.perf_counter()
        weights = {**(getattr(self.task, "reward_weights", None) or {}),
                   **self.cfg.task.reward_weights}  # fmt: skip
        episodes = []
        for run in batch.runs:
            session = self.sessions.close(run.session)
            ep = Episode(None, done=True)
            ep.meta = {"session": run.session, "branch": None, "calls": []}
            episodes.append(ep)
            seconds.append(now - (run.started or now))
            if run.timed_out:
                ep.dropped = "agent_timeouts"
            else:
                try:
                    ep.reward = _reward(run.future.result(), weights)
                except (Exception, SystemExit, cf.CancelledError) as e:  # noqa: BLE001 - the
                    # agent's failure (its sys.exit too): counted, its episode dropped
                    ep.dropped, ep.error = "agent_errors", f"{type(e).__name__}: {e}"
                    self.runner.warn_once(
                        "agent", f"an agent failed ({ep.error}); its episode is left out of "
                        "the loss, later failures are only counted (agent_errors)",
                    )  # fmt: skip
            calls.append(session.calls)
            branches += max(len(session.branches) - 1, 0)
            if not session.branches:
                ep.dropped = ep.dropped or "agent_idle"
            else:
                b = session.branches[session.last]
                start = b.calls[0][1]
                ep.prompt, ep.tokens = b.ids[:start], b.ids[start:]
                ep.mask = [float(m) for m in b.mask[start:]]
                ep.logp, ep.versions = b.logp[start:], b.versions[start:]
                ep.turns = len(b.calls)
                ep.truncated = b.ended_with is None  # its last reply ran out of tokens
                # The calls' (start, reply start, end) in the sample's tokens.
                ep.meta.update(branch=b.index, calls=[list(c) for c in b.calls])
                # The other branches with a sampled token: packed beside it, as its tokens.
                ep.meta["branches"] = [
                    {"branch": o.index, "ids": o.ids, "mask": o.mask, "logp": o.logp,
                     "versions": o.versions, "calls": [list(c) for c in o.calls]}
                    for o in session.branches if o is not b and any(o.mask)
                ]  # fmt: skip
            if ep.dropped in counts:
                counts[ep.dropped] += 1
        stats = {
            **counts,
            "agent_calls_mean": float(np.mean(calls)),
            "agent_seconds": float(np.mean(seconds)),
            "agent_branches": branches,
            "turns_mean": float(np.mean([ep.turns for ep in episodes])),
            "episode_seconds": now - batch.start,
        }
        return episodes, stats

    def next(self, params_for_chunk: ParamsForChunk, key, oldest: int | None):
        """(prompt indices, Rollout on the host, rewards [B], stats) of the oldest queued
        batch once every one of its episodes has ended; `oldest` as `EngineBatches.next`."""
        if self.backend is None:
            self._fresh = params_for_chunk(0)
            self.start(self._fresh[1])
            self._fresh = None
        ahead = 2 if self.cfg.pipeline.mode == "pipeline_rl" else 1
        while len(self.queued) < ahead:
            cursor = (self.curriculum.epoch, self.curriculum.position)
            indices = self.curriculum.next_batch(self.cfg.train.prompts_per_step)
            bound = None if oldest is None else oldest + len(self.queued)
            self.queue(indices, bound, tag=cursor)
        self._fresh, self.chunk = params_for_chunk(0), 1
        while not self.complete():
            self.step(params_for_chunk)
        self._fresh = None
        indices, ro, rewards, stats, _ = self.pop()
        return indices, ro, rewards, stats

    def in_flight(self) -> tuple[int, int]:
        prompts = sum(len(b.indices) for b in self.queued)
        return prompts, sum(not r.future.done() for b in self.queued for r in b.runs)

    def cursor(self) -> tuple[int, int] | None:
        return self.queued[0].tag if self.queued else None

    def evaluate(self, params, examples) -> tuple[np.ndarray, dict]:
        """`evaluate_agents` of `params` on `examples`, with this run's agent and slots."""
        return evaluate_agents(self.cfg, self.graphdef, self.tok, self.task, self.agent, params,
                               examples, mesh=self.mesh, slots=self.slots, share=self._share,
                               follower=self.follower)  # fmt: skip

    def release(self) -> None:
        """Nothing to free between batches: the engine serves its sessions for the run's life."""

    def close(self) -> None:
        """End the run's agents: their sessions closed (their calls in flight and later ones
        fail, so the agents end), the engine's requests failed, then the server stopped."""
        for batch in self.queued:
            for run in batch.runs:
                if not run.timed_out:
                    self.sessions.close(run.session)
        self.queued = []
        if self.backend is not None:
            self.backend.close()
        if self.server is not None:
            self.server.close()
        if self.pool is not None:
            self.pool.shutdown()


def evaluate_agents(cfg, graphdef, tok, task, agent, params, examples, *, mesh, slots: int,
                    share=None, follower: bool = False):  # fmt: skip
    """[examples, k] rewards of `k` = train.eval_samples agent episodes of each held-out
    example with `params` (fixed; train.eval_temperature), a failed episode 0, and the
    counts. On an engine, server and sessions of its own, with a thread of its own: the
    training engine belongs to the feeding thread, which may be generating meanwhile.
    `share` (a generator group of several processes, `EngineAgents`): the engine is driven
    from this thread instead, the leader's turns shared; a `follower` makes the same engine
    calls and returns zeros (the leader's scores are the group's)."""
    t, k = cfg.task, cfg.train.eval_samples
    backend = EngineBackend(
        nnx.merge(graphdef, params), tok, slots=slots, context=t.max_episode_tokens,
        prompt_len=t.prompt_tokens or None, max_queue=max(64, 4 * slots),
        steps=cfg.sampler.admit_every, mesh=mesh, model_name=MODEL, thread=share is None,
    )  # fmt: skip
    if follower:
        try:
            while not share(None):  # the leader's: every episode has ended
                backend.follow(params, -1, share)
        finally:
            backend.close()
        return np.zeros((len(examples), k)), {"agent_errors": 0, "agent_timeouts": 0}
    from jaxrl_scale.serve.app import make_app
    from jaxrl_scale.serve.server import Background

    sessions = Sessions(sampling=(cfg.train.eval_temperature, 1.0))
    server = Background(
        make_app(backend, tok, sessions=sessions, api_key=secrets.token_urlsafe(24))
    )
    pool = AgentPool(t.agent_workers, "jaxrl-agent-eval")
    weights = {**(getattr(task, "reward_weights", None) or {}), **t.reward_weights}
    try:
        runs = [_start_run(pool, sessions, server.url, agent, example, i, None)
                for i, example in enumerate(examples) for _ in range(k)]  # fmt: skip
        while True:
            for run in runs:
                if _late(run, t.agent_timeout):
                    run.timed_out = True
                    run.future.cancel()
                    sessions.close(run.session, keep=True)
            waiting = [r.future for r in runs if not (r.future.done() or r.timed_out)]
            if share is not None:  # the group's engine turns come from this thread
                share(not waiting)
                if not waiting:
                    break
                if not backend.drive(params, -1, share):
                    backend.wait(0.05)  # (each turn is shared: a call wakes it)
                continue
            if not waiting:
                break
            cf.wait(waiting, timeout=0.1, return_when=cf.FIRST_COMPLETED)
        rewards, counts = [], {"agent_errors": 0, "agent_timeouts": 0}
        for run in runs:
            sessions.close(run.session)
            if run.timed_out:
                counts["agent_timeouts"] += 1
                rewards.append(0.0)
                continue
            try:
                rewards.append(_reward(run.future.result(), weights))
            except (Exception, SystemExit, cf.CancelledError):  # noqa: BLE001 - counted; 0
                counts["agent_errors"] += 1
                rewards.append(0.0)
        return np.array(rewards).reshape(len(examples), k), counts
    finally:
        server.close()
        backend.close()
        pool.shutdown()


class AgentPool:
    """`workers` daemon threads running agents: a `concurrent.futures` executor's threads are
    joined when the interpreter exits, so one agent that never returns (its timeout closes
    its session, but Python cannot stop a thread) would keep a finished run's process alive.
    The queue is the threads' only shared state (thread-safe)."""

    def __init__(self, workers: int, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = workers
        self._closed = False  # set by `shutdown` (the owner's thread; read by it alone)
        for i in range(workers):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn, *args) -> cf.Future:
        if self._closed:
            raise RuntimeError("the agent pool is shut down")
        future: cf.Future = cf.Future()
        self._queue.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Cancel what has not started; each thread ends after its agent (or at exit)."""
        self._closed = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(self._workers):  # one stop per thread
            self._queue.put(None)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - the agent's failure, its future's
                future.set_exception(e)


def _start_run(pool, sessions: Sessions, url: str, agent, example: dict, index: int,
               not_before: int | None) -> _Run:  # fmt: skip
    """An episode: its session opened, its agent queued on the pool."""
    sid, secret = sessions.open(not_before=not_before)
    run = _Run(index, sid)
    run.future = pool.submit(_call_agent, run, agent, f"{url}/sessions/{sid}/v1", secret, example)
    return run


def _share_prompt(group: list[Episode]) -> None:
    """Give a group's episodes one prompt: the longest common prefix of their samples'
    prompts (the example's opening messages, as rendered), each sample's rest moved to the
    front of its completion columns, given (mask 0). A sample stays the exact ids its calls
    consumed and sampled; only where the prompt ends moves. So an episode whose trained branch
    was rendered anew (an agent that compacted or edited its history: another prompt than its
    siblings' first call) trains with its group instead of being dropped as a mismatch. The
    prefix is that of the live samples that begin as the group's most common prompt does; a
    sample that begins otherwise (no token in common) is left for settle_groups to drop,
    counted; every sample that begins with the prefix moves, a dropped one too (its row in
    rollouts.jsonl stays whole)."""
    prompts = [tuple(ep.prompt) for ep in group if ep.prompt and ep.dropped is None]
    if len(set(prompts)) < 2:
        return
    shared = max(dict.fromkeys(prompts), key=prompts.count)  # the first, on a tie
    near = [list(p) for p in prompts if p[0] == shared[0]]
    common = len(os.path.commonprefix(near))  # of lists: element-wise; >= 1
    for ep in group:
        if len(ep.prompt) > common and tuple(ep.prompt[:common]) == shared[:common]:
            rest = ep.prompt[common:]
            ep.prompt = ep.prompt[:common]
            ep.tokens = rest + ep.tokens
            ep.mask = [0.0] * len(rest) + ep.mask
            ep.logp = [0.0] * len(rest) + ep.logp
            ep.versions = [-1] * len(rest) + ep.versions


def _late(run: _Run, timeout: float) -> bool:
    """Whether `run`'s agent has run past `timeout` seconds (its wait for a thread aside)."""
    started = run.started
    return not (run.future.done() or run.timed_out or started is None) and (
        time.perf_counter() - started > timeout
    )


def _call_agent(run: _Run, agent, base_url: str, api_key: str, example: dict):
    """On an agent thread: the agent's episode, run to its end (an async agent on an event
    loop of its own)."""
    run.started = time.perf_counter()
    out = agent(base_url, api_key, example)
    if inspect.isawaitable(out):
        out = asyncio.run(_awaited(out))
    return out


async def _awaited(awaitable):
    return await awaitable


def _reward(value, weights: Mapping[str, float]) -> float:
    """An agent's return as a reward: a number, or named parts summed with their weights."""
    if isinstance(value, Mapping):
        return _number(sum(weights.get(str(k), 1.0) * _number(v) for k, v in value.items()))
    return _number(value)


def _number(value) -> float:
    if not isinstance(value, numbers.Real):
        raise TypeError(f"the agent returned a {type(value).__name__}, not a number: {value!r:.80}")
    if not math.isfinite(float(value)):
        raise ValueError(f"the agent returned {value}")
    return float(value)
