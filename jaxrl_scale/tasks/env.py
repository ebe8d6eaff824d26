"""Multi-turn environments: a task's `make_env(example)` gives one environment per episode.

    class Guess:                                  # the Environment protocol
        def __init__(self, example): self.target = example["answer"]
        def reset(self): return "Guess my number (0-9):"
        def step(self, action):                   # -> (observation or None, reward, done)
            if action.strip() == str(self.target):
                return None, 1.0, True
            return "higher" if int(action) < self.target else "lower", 0.0, False

An observation is a string or a list of chat messages; `reset` gives the episode's first
(the prompt), `step` the one after each model turn. Both may be `async def`. Calls run on
`EnvRunner` with a timeout each: an environment that raises, hangs or returns something
malformed (a message whose content is not a string, `tools` that are not a list of dicts)
ends its episode, counted (`env_errors`): the episode's reward is missing, not 0, so it is
left out of the loss and its group's advantages (the policy is not punished for the
environment's fault; rl/episodes.py).

`reset()` must be a function of the example: the G episodes of one example are one group,
trained as continuations of one prompt, so an episode whose first observation differs from
its group's is left out of the loss too (counted, `episodes_prompt_mismatch`).

How observations become tokens (`Observations`): the model's turns are kept as sampled; only
what the environment adds is tokenized. Without a chat template an observation's text is
appended as it is. With one, a string observation is a user message (a list: the messages as
given, e.g. tool results) rendered by the checkpoint's template as it continues a conversation
after an assistant turn, with the next assistant header (the generation prompt) at its end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import inspect
import math
import numbers
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from jaxrl_scale.tasks.workers import Worker, WorkerProcesses, gather, settled

Observation = str | list[dict]


@runtime_checkable
class Environment(Protocol):
    def reset(self) -> Observation: ...

    def step(self, action: str) -> tuple[Observation | None, float, bool]: ...


class EnvError(ValueError):
    """An environment broke its protocol (the message says how)."""


# Each thread's event loop, kept from call to call (`_call`); an environment's worker process
# runs its calls on one thread, so it has one loop for its whole life. The loop runs only
# inside a call: between calls what it holds is paused, not cancelled.
_LOOP = threading.local()


def _call(fn, *args):
    """`fn(*args)`; an awaitable it returns is run to its end on this thread's long-lived
    event loop (not a fresh one per call, which would cancel what `reset` started before
    `step` could use it). The loop runs only while a call runs it: a task that `reset`
    starts is still there when `step` comes, but it advanced only during this worker's calls
    (any of its environments'), never between them; a timer or a heartbeat in it waits for
    the next call."""
    out = fn(*args)
    if not inspect.isawaitable(out):
        return out
    loop = getattr(_LOOP, "loop", None)
    if loop is None or loop.is_closed() or _LOOP.pid != os.getpid():  # (a forked copy's)
        loop = _LOOP.loop = asyncio.new_event_loop()
        _LOOP.pid = os.getpid()
        asyncio.set_event_loop(loop)
    return loop.run_until_complete(out)


def check_observation(obs, what: str) -> Observation:
    """A string, or chat messages whose role is a string and whose content is a string (or a
    list of content parts, dicts): anything else is an EnvError naming what is wrong."""
    if isinstance(obs, str):
        return obs
    if not isinstance(obs, Sequence) or not obs:
        raise EnvError(f"{what} is neither a string nor a list of chat messages: {obs!r:.120}")
    for i, m in enumerate(obs):
        if not (isinstance(m, Mapping) and "role" in m and "content" in m):
            raise EnvError(f"{what}: message {i} is not a dict with 'role' and 'content': "
                           f"{m!r:.120}")  # fmt: skip
        if not isinstance(m["role"], str):
            raise EnvError(f"{what}: message {i}'s role is a {type(m['role']).__name__}")
        content = m["content"]
        parts = isinstance(content, list) and all(isinstance(p, Mapping) for p in content)
        if not (isinstance(content, str) or parts):
            raise EnvError(f"{what}: message {i}'s content is a {type(content).__name__}, "
                           f"not a string: {content!r:.60}")  # fmt: skip
    return [dict(m) for m in obs]


def check_tools(tools, what: str = "the environment's tools") -> list[dict] | None:
    """An environment's `tools` (JSON schemas for the chat template): None or a list of
    dicts, else an EnvError."""
    if tools is None:
        return None
    if isinstance(tools, str | Mapping) or not isinstance(tools, Sequence):
        raise EnvError(f"{what} is a {type(tools).__name__}, not a list of JSON schemas")
    if not all(isinstance(t, Mapping) for t in tools):
        raise EnvError(f"{what}: each must be a dict (a JSON schema): {tools!r:.120}")
    return list(tools)


def check_step(result) -> tuple[Observation | None, float, bool]:
    """`step`'s (observation or None, reward, done), checked."""
    if not isinstance(result, tuple) or len(result) != 3:
        raise EnvError(f"step returned {result!r:.120}, not (observation, reward, done)")
    obs, reward, done = result
    if not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise EnvError(f"step's reward is {reward!r:.60}, not a finite number")
    obs = None if obs is None else check_observation(obs, "step's observation")
    return obs, float(reward), bool(done)


class EnvRunner:
    """Many episodes' environments, each living in one of `workers` worker processes for its
    whole episode, each call given `timeout` seconds (task.env_timeout) from the start of its
    sending (tasks/workers.py: the processes are forked, so a task's `make_env` and its
    environments need not pickle; only examples, actions, observations and results cross,
    and those must). A call that raises or hangs costs its episode; a hung one has its worker
    killed, and with it the other environments that worker held: their calls fail with
    WorkerLost, "its worker process (pid N) was killed because another environment's call
    ran past task.env_timeout (T s)", each counted by its episode as lost (not its
    environment's error). A new environment goes to the free worker holding fewest, so up to
    `workers` live episodes have a process each. An environment's calls run one at a time
    (reset, then a step per turn); its coroutines run on its worker's one event loop
    (`_call`), which runs only during that worker's calls.

    The environments callers hold are `RemoteEnv`s (dropping one frees it in its worker).
    One set of workers per task object, all forked the first time it opens an environment.
    When no worker can be started at all, PoolBroken is raised: that ends the run."""

    def __init__(self, *, workers: int = 16, timeout: float = 60.0):
        self.workers, self.timeout = workers, timeout
        self._pools: dict[int, tuple[object, WorkerProcesses]] = {}  # id(task) -> its workers
        self._lock = threading.Lock()  # the feeding thread and an evaluation open at once

    def _pool(self, task) -> WorkerProcesses:
        with self._lock:
            if id(task) not in self._pools:
                pool = WorkerProcesses(
                    self.workers, timeout=self.timeout, shares=task, name="jaxrl-env",
                    call="environment's call", timeout_key="task.env_timeout",
                )  # fmt: skip
                self._pools[id(task)] = (task, pool)
            return self._pools[id(task)][1]

    def make(self, task, examples) -> list[tuple[RemoteEnv | None, str | None]]:
        """(environment, None) per example, or (None, why) when `make_env` failed."""
        pool = self._pool(task)
        made = lambda got, worker: RemoteEnv(pool, worker, *got)  # noqa: E731
        futures = [pool.submit(_make, e, spread=True, keeps=1, finish=made) for e in examples]
        return self._all(futures, lambda env: env)

    def reset(self, envs) -> list[tuple[Observation | None, str | None]]:
        return self._all(
            [env.call(_reset) for env in envs], lambda o: check_observation(o, "reset's result")
        )

    def step(self, envs, actions: Sequence[str]) -> list[tuple[tuple | None, str | None]]:
        futures = [env.call(_step, a) for env, a in zip(envs, actions, strict=True)]
        return self._all(futures, check_step)

    def _all(self, futures, check) -> list[tuple[object | None, str | None]]:
        return [self._outcome(got, check) for got in gather(futures)]

    # Without waiting (the slot engine's episodes, rl/episodes.py): calls started one by one,
    # their outcomes collected as they come.

    def start_open(self, task, example) -> cf.Future:
        """`make_env(example)` then its `reset()`, as one call: (environment, observation)."""
        pool = self._pool(task)
        opened = lambda got, worker: (RemoteEnv(pool, worker, got[0], got[2]), got[1])  # noqa: E731
        return pool.submit(_open, example, spread=True, keeps=1, finish=opened)

    def start_step(self, env: RemoteEnv, action: str) -> cf.Future:
        return env.call(_step, action)

    def outcomes(self, futures: Mapping[cf.Future, str]) -> dict[cf.Future, tuple]:
        """The calls of `futures` (each "open" or "step") that have ended (a call past the
        timeout ends when its worker is killed): (value checked, None) or (None, why), as
        `make` / `reset` / `step` give them."""
        checks = {"open": _check_open, "step": check_step}
        return {f: self._outcome(got, checks[futures[f]]) for f, got in settled(futures).items()}

    def _outcome(self, got: tuple[str, object], check) -> tuple[object | None, str | None]:
        status, value = got
        if status == "timeout":
            return None, f"no answer within {self.timeout:g} s"
        if status == "error":
            return None, f"{type(value).__name__}: {value}"
        try:
            return check(value), None
        except EnvError as e:
            return None, str(e)


class RemoteEnv:
    """An environment living in a worker process (`worker`), as its episode holds it: calls
    go to that worker. `tools` and `tool_errors` mirror the environment's own as of its last
    call (set by the pool's dispatcher thread before that call's future completes, read by the
    episode's thread after it)."""

    MIRRORED = ("tools", "tool_errors")

    def __init__(self, pool: WorkerProcesses, worker: Worker, handle: int, mirrored: dict):
        self.worker, self._pool, self._handle = worker, pool, handle
        self.__dict__.update(mirrored)
        weakref.finalize(self, pool.release, worker, handle)

    def call(self, fn, *args) -> cf.Future:
        """A future of `fn(held, handle, *args)` in the environment's worker: its result."""
        return self._pool.submit(fn, self._handle, *args, on=self.worker, finish=self._mirror)

    def _mirror(self, got, worker):
        result, mirrored = got
        self.__dict__.update(mirrored)
        return result


# In an environment's worker process (tasks/workers.py: `held.shared` is the task).


def _mirrored(env) -> dict:
    out = {}
    for name in RemoteEnv.MIRRORED:
        try:
            out[name] = getattr(env, name)
        except AttributeError:
            pass
        except Exception as e:  # noqa: BLE001 - a property that raises: the episode's error
            raise EnvError(f"the environment's {name}: {type(e).__name__}: {e}") from e
    return out


def _make(held, example):
    env = held.shared.make_env(example)
    mirrored = _mirrored(env)  # first: an environment whose `tools` raise is not kept
    return held.keep(env), mirrored


def _reset(held, handle: int):
    env = held[handle]
    return _call(env.reset), _mirrored(env)


def _step(held, handle: int, action: str):
    env = held[handle]
    return _call(env.step, action), _mirrored(env)


def _open(held, example):
    """`make_env(example)` and its `reset()`: (handle, observation, mirrored attributes); the
    environment is kept once its reset and its mirrored attributes have answered (and is
    dropped again if the reply cannot be sent: tasks/workers.py)."""
    try:
        env = held.shared.make_env(example)
    except Exception as e:  # noqa: BLE001 - the user's error, reported per episode
        raise EnvError(f"make_env: {type(e).__name__}: {e}") from e
    obs = _call(env.reset)
    mirrored = _mirrored(env)
    return held.keep(env), obs, mirrored


def _check_open(opened):
    env, obs = opened
    return env, check_observation(obs, "reset's result")


class Observations:
    """Observations as the text that goes into an episode's token sequence (see the module's
    docstring). `first(obs)`: the prompt; `after_turn(obs, ended_with=...)`: what follows a
    model turn.

    An observation after a turn is cut from one rendering of a probe conversation (a user
    message, an assistant message, then the observation's messages, with the generation
    prompt): the text after the probe assistant's content. That is the template's turn end,
    the observation as the template writes it, and the next assistant header. Earlier turns
    are never rendered again, so a template that renders the last assistant turn differently
    from earlier ones (Qwen3 gives the last an empty `<think>` block and drops it once a later
    message follows) or drops earlier reasoning changes nothing here: the episode keeps the
    model's tokens as sampled, reasoning included, which is the context it really sampled
    its next turn from."""

    PROBE_USER, PROBE_ASSISTANT = "\u2063probe-user\u2063", "\u2063probe-assistant\u2063"

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.chat = getattr(tokenizer, "chat_template", None) is not None

    def first(self, obs: Observation, tools=None) -> str:
        """`tools`: the JSON schemas the template offers the model (an env's `tools`)."""
        if isinstance(obs, str) and not self.chat:
            return obs
        return self._render(self._messages(obs), tools)

    def after_turn(
        self, obs: Observation, tools=None, *, ended_with: int | None = None, **template_kwargs
    ) -> str:
        """The text after a model turn: the template's turn end, the observation, the next
        assistant header. `ended_with`: the end-of-turn token the model sampled last, which
        stands for the template's (the template's turn end, an end token, is left out and
        what it writes after one stays); None: the turn was cut off before one (by
        `task.turn_tokens`), so the template's whole turn end closes it here, as context.
        `template_kwargs` go to the template (e.g. Qwen3's enable_thinking)."""
        if not self.chat:
            if not isinstance(obs, str):
                raise EnvError("a chat observation needs the tokenizer's chat template")
            return obs
        probe = [
            {"role": "user", "content": self.PROBE_USER},
            {"role": "assistant", "content": self.PROBE_ASSISTANT},
        ]
        full = self._render(probe + self._messages(obs), tools, **template_kwargs)
        if full.count(self.PROBE_ASSISTANT) != 1:
            raise EnvError(
                "the chat template does not write an assistant turn's content as given, so "
                "where a turn ends cannot be found in its rendering"
            )
        rest = full[full.index(self.PROBE_ASSISTANT) + len(self.PROBE_ASSISTANT) :]
        if ended_with is not None:  # the model's own end stands for the template's
            for end in self._ends():
                if rest.startswith(end):
                    return rest[len(end) :]
        return rest

    def _ends(self) -> list[str]:
        """The tokenizer's end-of-turn tokens as text, longest first (Llama-3's turn may end
        with <|eot_id|>, <|eom_id|> or <|end_of_text|>; the template writes <|eot_id|>)."""
        texts = {self.tok.decode([i], skip_special_tokens=False) for i in self.tok.eos_ids}
        return sorted((t for t in texts if t), key=len, reverse=True)

    def _messages(self, obs: Observation) -> list[dict]:
        if not self.chat:
            raise EnvError("a chat observation needs the tokenizer's chat template")
        return [{"role": "user", "content": obs}] if isinstance(obs, str) else obs

    def _render(self, messages: list[dict], tools, **template_kwargs) -> str:
        """The template's rendering with the generation prompt; whatever the template raises
        on what the environment gave (a TypeError, a ValueError) is an EnvError."""
        try:
            return self.tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, **template_kwargs
            )
        except Exception as e:  # noqa: BLE001 - the environment's data, reported per episode
            raise EnvError(f"the chat template cannot render it ({type(e).__name__}: {e})") from e


class GymText:
    """A Gymnasium-style text environment (GEM's and gymnasium's text games take this shape)
    as an `Environment`: `reset(seed=...) -> (observation, info)` and `step(action) ->
    (observation, reward, terminated, truncated, info)`; gym's older `(observation, reward,
    done, info)` too. A task's `make_env` wraps one per episode:

        def make_env(self, example):
            return GymText(MyGame(example["level"]), seed=example["seed"])
    """

    def __init__(self, env, *, seed: int | None = None):
        self.env, self.seed = env, seed

    def reset(self) -> Observation:
        if self.seed is None:
            out = _call(self.env.reset)
        else:
            out = _call(lambda: self.env.reset(seed=self.seed))
        return out[0] if isinstance(out, tuple) else out

    def step(self, action: str) -> tuple[Observation | None, float, bool]:
        out = _call(self.env.step, action)
        if not isinstance(out, tuple) or len(out) not in (4, 5):
            raise EnvError(f"the gym environment's step returned {out!r:.120}")
        if len(out) == 5:
            obs, reward, terminated, truncated, _ = out
            done = bool(terminated or truncated)
        else:
            obs, reward, done, _ = out
        return (None if done else obs), float(reward), bool(done)


class TextArena:
    """A single-player textarena game as an `Environment` (textarena's own API: `reset(
    num_players, seed)`, `get_observation() -> (player, observation)`, `step(action) -> (done,
    info)`, `close() -> (rewards, info)` with the reward per player). A task's `make_env`:

        def make_env(self, example):
            return TextArena(textarena.make("GuessTheNumber-v0-raw"), seed=example["seed"])

    Each observation is what the game said since the model's last turn: with a "-raw" game the
    game's messages (the model's own action, which textarena echoes, left out); with a wrapped
    game whose observation is the whole transcript so far, the part after the last one (the
    echo of the action included, as the wrapper formats it). The
    episode's reward is the game's reward for `player` at its end (0 at every other turn).
    """

    def __init__(self, env, *, seed: int | None = None, player: int = 0):
        self.env, self.seed, self.player = env, seed, player
        self._seen = ""

    def _observation(self) -> str:
        got = _call(self.env.get_observation)
        if not isinstance(got, tuple) or len(got) != 2:
            raise EnvError(f"textarena's get_observation returned {got!r:.120}")
        obs = got[1]
        if isinstance(obs, str):  # a whole transcript: its new part
            new = obs[len(self._seen) :] if obs.startswith(self._seen) else obs
            self._seen = obs
            return new
        if isinstance(obs, Sequence):  # raw: (sender, message, kind) triples
            said = [m[1] for m in obs if isinstance(m, Sequence) and len(m) >= 2]
            if len(said) != len(obs) or not all(isinstance(t, str) for t in said):
                raise EnvError(f"textarena's observation is {obs!r:.120}")
            return "\n".join(m[1] for m in obs if m[0] != self.player)
        raise EnvError(f"textarena's observation is {obs!r:.120}")

    def reset(self) -> Observation:
        _call(lambda: self.env.reset(num_players=1, seed=self.seed))
        return self._observation()

    def step(self, action: str) -> tuple[Observation | None, float, bool]:
        out = _call(self.env.step, action)
        if not isinstance(out, tuple) or len(out) != 2:
            raise EnvError(f"textarena's step returned {out!r:.120}, not (done, info)")
        if not out[0]:
            return self._observation(), 0.0, False
        closed = _call(self.env.close)
        rewards = closed[0] if isinstance(closed, tuple) else closed
        if not isinstance(rewards, Mapping) or self.player not in rewards:
            raise EnvError(
                f"textarena's close gave no reward for player {self.player}: {closed!r:.120}"
            )
        return None, float(rewards[self.player]), True
