"""What the HTTP server asks of the engine: a `Request` in token ids, a `Generation` of
per-choice `Delta`s back. `EngineBackend` (engine.py) runs the slot engine on its own thread;
the server's event loop never waits on it: a request goes in through a queue, and deltas come
back through the loop's `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Protocol

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


class QueueFull(Exception):
    """More requests wait than the server holds (HTTP 429)."""


class ShuttingDown(RuntimeError):
    """The backend is closing: a request it took or is offered ends with this (HTTP 503)."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One completion request, in token ids: `n` choices of up to `max_new` tokens each after
    `prompt_ids`, drawn at `temperature` (0: greedy) with nucleus `top_p`, from `seed` (the
    same request and seed give the same tokens, streamed or not, whatever else is decoding;
    None: a fresh seed), each token with its log-prob and `top_logprobs` alternatives."""

    prompt_ids: tuple[int, ...]
    max_new: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    top_logprobs: int = 0
    not_before: int | None = None  # decoded by a policy version at least this (training)


@dataclasses.dataclass(frozen=True)
class Delta:
    """What choice `index` got since its last delta: sampled ids with their log-probs (of the
    distribution sampled from) and, when asked, the top alternatives [(id, log-prob)] per
    token; `finish` is "stop" (an end-of-turn token, included in `token_ids`), "length" or
    None while it runs; `versions`: the policy version each token was sampled with, where the
    backend knows it."""

    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...] | None = None
    finish: str | None = None
    versions: tuple[int, ...] | None = None


_WAKE = Delta(-1, (), ())  # put by `cancel` to wake a reader of `deltas()`


class Generation:
    """A submitted request's deltas, read on the server's event loop (`deltas()`); the
    backend's thread pushes them (`push`, thread-safe). `cancel` stops choices early (a
    client gone, a stop string seen): their slots are freed at the engine's next step."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop, backend: Backend):
        self.request, self._loop, self._backend = request, loop, backend
        self._queue: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
        self.open = set(range(request.n))  # choices not finished (event loop's view)

    def push(self, item: Delta | BaseException) -> None:
        """From the backend's thread: a delta, or the exception that ended the request. A
        loop that has closed (its client gone) takes nothing, and that is no error."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(_deliver, [(self, item)])

    @staticmethod
    def push_all(items: list[tuple[Generation, Delta]]) -> None:
        """From the backend's thread: many generations' deltas, in order, with one wake-up of
        each event loop they belong to (rather than one per delta)."""
        loops: dict[asyncio.AbstractEventLoop, list] = {}
        for generation, delta in items:
            loops.setdefault(generation._loop, []).append((generation, delta))
        for loop, mine in loops.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: its clients are gone
                loop.call_soon_threadsafe(_deliver, mine)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Each choice's deltas in order. What arrived while the reader was busy comes as one
        delta per choice: a server behind a fast engine sends fewer, longer pieces, rather
        than falling further behind one piece at a time."""
        while self.open:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            error = next((i for i in items if isinstance(i, BaseException)), None)
            if error is not None:
                items = items[: items.index(error)]
            for delta in _merged(items):
                if delta.finish is not None:
                    self.open.discard(delta.index)
                yield delta
            if error is not None:
                raise error

    def cancel_from_thread(self) -> None:
        """`cancel()` of every open choice, asked from another thread: run on the event loop
        (a closed loop: its client is gone, nothing to stop)."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self.cancel)

    def cancel(self, index: int | None = None) -> None:
        """Stop choice `index` (None: every open one); its slot is freed. Event loop only. A
        reader waiting in `deltas()` wakes, and ends when no choice is left open."""
        gone = set(self.open) if index is None else {index} & self.open
        self.open -= gone
        if gone:
            self._backend.cancel(self, sorted(gone))
            self._queue.put_nowait(_WAKE)


def _merged(items: list[Delta]) -> list[Delta]:
    """`items` (in arrival order; `_WAKE`s left out) as one delta per choice, in the order
    the choices first appear."""
    by_choice: dict[int, Delta] = {}
    for d in items:
        if d is _WAKE:  # a cancel: the reader's loop condition decides
            continue
        got = by_choice.get(d.index)
        if got is None:
            by_choice[d.index] = d
            continue
        top = None if got.top is None or d.top is None else got.top + d.top
        versions = None if got.versions is None or d.versions is None else \
            got.versions + d.versions  # fmt: skip
        by_choice[d.index] = Delta(d.index, got.token_ids + d.token_ids,
                                   got.logprobs + d.logprobs, top, d.finish, versions)  # fmt: skip
    return list(by_choice.values())


def _deliver(items: list[tuple[Generation, Delta | BaseException]]) -> None:
    for generation, item in items:
        generation._queue.put_nowait(item)


def check_request(request: Request, context: int) -> None:
    """A ValueError naming what a backend of `context` tokens cannot serve in `request`."""
    if not request.prompt_ids:
        raise ValueError("the prompt has no tokens")
    if request.max_new < 1:
        raise ValueError(f"max_tokens must be >= 1, got {request.max_new}")
    total = len(request.prompt_ids) + request.max_new
    if total > context:
        raise ValueError(
            f"the prompt's {len(request.prompt_ids)} tokens and max_tokens "
            f"{request.max_new} make {total}, over the context of {context} tokens"
        )
    if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")


def check_admission(closed: bool, waiting: int, max_queue: int) -> None:
    """ShuttingDown once a backend is closed; QueueFull with `max_queue` requests waiting for a
    slot (a backend calls it under the lock that guards both)."""
    if closed:
        raise ShuttingDown("the server is shutting down")
    if waiting >= max_queue:
        raise QueueFull(f"{waiting} requests are waiting for a slot")


class Backend(Protocol):
    context: int  # the most prompt + generated tokens a request may have
    model_name: str

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Generation:
        """Queue `request` (QueueFull past the queue's size; ValueError for one it cannot
        serve, naming why)."""
        ...

    def cancel(self, generation: Generation, choices: list[int]) -> None: ...

    def stats(self) -> dict[str, float]:
        """queue_length, slots, slots_busy (for /metrics)."""
        ...

    def close(self) -> None: ...
