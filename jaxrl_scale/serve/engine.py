"""`EngineBackend`: the slot engine (generation/engine.py) serving requests on a thread of its
own. The server's event loop submits a `Request` (one engine request per choice) and reads
`Delta`s; the engine thread admits, decodes a few steps at a time, and pushes each choice's
new tokens back (streamed from `SlotEngine.peek`, ended by the finished row).

Threads: the engine thread owns the `SlotEngine` (every call on it). What the event loop
hands over (submissions, cancellations) goes through `_inbox`, under `_lock`; the counters
`stats()` reads are written under the same lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import time

from flax import nnx

from jaxrl_scale.generation.engine import RowSampling, SlotEngine
from jaxrl_scale.generation.sampler import EOS, Sampling
from jaxrl_scale.serve.backend import (
    MAX_TOP_LOGPROBS,
    Delta,
    Generation,
    Request,
    ShuttingDown,
    check_admission,
    check_request,
)

log = logging.getLogger("jaxrl_scale.serve")


@dataclasses.dataclass
class _Choice:
    """One choice of a request, as the engine thread tracks it."""

    generation: Generation
    index: int
    given: int  # prompt tokens fed in its completion columns (not sent back)
    sent: int = 0  # completion columns already pushed (given ones included)


class EngineBackend:
    """`slots` rows decoding at once, each up to `context` tokens (prompt and generated); a
    prompt's first `prompt_len` tokens are prefilled, any beyond are fed one decode step each
    (default prompt_len: half the context). A slot's cache holds prompt_len + context
    columns. `max_queue`: requests waiting for slots before
    `submit` raises QueueFull. `steps`: decode steps between two looks at the slots (the
    streaming granularity). `warm_up`: compile every program traffic can call before serving
    (`SlotEngine.warm_up`; a server's first requests of each new shape would otherwise wait
    for its compile). `thread` False: no engine thread; the owner's thread drives the engine
    (`drive`), with the weights of its choice (training: each run's newest)."""

    def __init__(self, model, tokenizer, *, slots: int = 16, context: int = 2048,
                 prompt_len: int | None = None, max_queue: int = 64, steps: int = 8,
                 mesh=None, model_name: str = "jaxrl-scale", warm_up: bool = False,
                 thread: bool = True):  # fmt: skip
        prompt_len = prompt_len or context // 2
        if not 1 <= prompt_len <= context:
            raise ValueError(f"prompt_len must be in [1, context = {context}], got {prompt_len}")
        self.context, self.prompt_len, self.model_name = context, prompt_len, model_name
        self.max_queue, self.steps, self.tokenizer = max_queue, steps, tokenizer
        graphdef, self.params = nnx.split(model)
        self.engine = SlotEngine(
            # Completion columns for a whole context: a short prompt may take all of it
            # in new tokens, a long one's rest beyond prompt_len goes there as given tokens.
            graphdef, slots=slots, prompt_len=prompt_len, n_new=context, repeat=1,
            sampling=Sampling(1.0), eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id,
            model_cfg=model.cfg, mesh=mesh, per_row_sampling=True,
            top_logprobs=MAX_TOP_LOGPROBS, in_order=False,
        )  # fmt: skip
        self.slots = slots
        if warm_up:  # on this thread, before the engine thread owns the engine
            start = time.perf_counter()
            calls = self.engine.warm_up(self.params, windows=(steps,))
            log.info("compiled the engine's programs (%d calls) in %.1f s", calls,
                     time.perf_counter() - start)  # fmt: skip
        if not thread:  # driven: each run gets its weights; these would be a copy kept
            self.params = None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[tuple[str, object]] = []  # ("submit", Generation) / ("cancel", ...)
        self._waiting = 0  # requests submitted and not all of whose choices hold a slot
        self._busy = 0
        self._closed = False
        self._ids = itertools.count()
        self._choices: dict[int, _Choice] = {}  # engine request id -> choice (engine thread)
        self._progress: list = []  # driven: the last run's peek, sent during the next run
        # Driven with `share` (a generator group of several processes): the engine calls of
        # this turn (submits, cancels), for the group's followers to make alike (`follow`).
        self._ops: list | None = None
        self._thread = None
        if thread:
            self._thread = threading.Thread(target=self._loop, name="jaxrl-serve-engine",
                                            daemon=True)  # fmt: skip
            self._thread.start()

    # ------------------------------------------------------------------ event loop side

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Generation:
        check_request(request, self.context)
        generation = Generation(request, loop, self)
        with self._lock:
            check_admission(self._closed, self._waiting, self.max_queue)
            self._waiting += 1
            self._inbox.append(("submit", generation))
            self._wake.notify()
        return generation

    def cancel(self, generation: Generation, choices: list[int]) -> None:
        with self._lock:
            self._inbox.append(("cancel", (generation, list(choices))))
            self._wake.notify()

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"queue_length": self._waiting, "slots": self.slots, "slots_busy": self._busy}

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        else:  # driven: the owner's thread, which owns the engine, is this one
            error = ShuttingDown("the server shut down")
            # The engine is discarded: its rows are left as they are (no program runs
            # here that a generator group's followers would not run too).
            self._fail_all(error, cancel=False)
            with self._lock:
                inbox, self._inbox = self._inbox, []
            for kind, item in inbox:  # taken, never submitted: they learn it too
                if kind == "submit":
                    item.push(error)

    # ------------------------------------------------------------------ driven

    def drive(self, params, version: int, share=None) -> bool:
        """Without an engine thread: one turn on this thread (the engine's owner), with
        `params`, its tokens tagged `version`: what the event loop handed over is taken, the
        engine runs a few steps, the last run's tokens are sent. False when there was
        nothing to do. `share` (a generator group's leader: its value reaches the group's
        followers, rl/agents.py): the turn's engine calls are shared before the engine runs,
        None when there is no turn; each follower makes them alike (`follow`)."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        engine = self.engine
        if not (inbox or engine.would_run(version) or self._progress):
            if share is not None:
                share(None)
            return False  # (prompts held for a newer version, at most)
        self._progress = self._turn(inbox, self._progress, params, version, share)
        self._count()
        return True

    def wait(self, timeout: float) -> None:
        """Driven: wait until the event loop hands something over (a request, a
        cancellation), at most `timeout` seconds."""
        with self._lock:
            if not (self._inbox or self._closed):
                self._wake.wait(timeout)

    def follow(self, params, version: int, share) -> bool:
        """A generator group's follower: the leader's turn (`drive` with `share`; `share`
        here returns the leader's value): the same engine calls, the same run and peek, so
        every process issues the same programs; what they make is the leader's to send.
        False when the leader had no turn."""
        turn = share(None)
        if turn is None:
            return False
        engine = self.engine
        for op in turn["ops"]:
            if op[0] == "cancel":
                engine.cancel(op[1])
                continue
            _, rid, head, max_new, given, temperature, top_p, words, not_before = op
            engine.submit(rid, head, max_new=max_new, given=given,
                          sampling=RowSampling(temperature, top_p, tuple(words)),
                          not_before=not_before)  # fmt: skip
        if engine.busy or engine.pending:
            engine.run(params, version, turn["steps"])
        if engine.busy:
            engine.peek(window=self.steps, top=turn["top"])
        return True

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        """Each turn: take what the event loop handed over, start the next decode steps
        (`run`: asynchronous on the device), and while they run, send what the steps before
        gave (their streamed tokens, then the rows they finished); then read this run's
        progress (`peek`: waits for the steps). The device never waits for the sending."""
        engine = self.engine
        progress: list = []  # the last run's peek, sent during the next run
        while True:
            with self._lock:
                while not (self._inbox or self._closed or engine.busy or engine.pending
                           or progress):  # fmt: skip
                    self._wake.wait()
                inbox, self._inbox = self._inbox, []
                closed = self._closed
            if closed:
                error = ShuttingDown("the server shut down")
                self._fail_all(error)
                for kind, item in inbox:  # taken, never submitted: they learn it too
                    if kind == "submit":
                        item.push(error)
                return
            # A turn of its own: what it held (requests, deltas) is let go before the wait.
            progress = self._turn(inbox, progress, self.params, 0)
            del inbox
            self._count()

    def _turn(self, inbox: list, progress: list, params, version: int, share=None) -> list:
        """Hand over `inbox`, run the engine with `params` (tokens tagged `version`), send the
        last run's `progress`; returns this run's. `share`: see `drive`."""
        engine = self.engine
        self._ops = [] if share is not None else None
        try:
            arriving = any(kind == "submit" for kind, _ in inbox)
            for kind, item in inbox:
                if kind == "cancel":
                    self._cancel(*item)
                    continue
                try:
                    self._submit(item)
                except Exception as e:  # noqa: BLE001 - this request's fault: it learns why
                    self._cancel(item, list(range(item.request.n)))
                    item.push(e)
            inbox = []
            # While requests are arriving and slots are free, short runs: the next
            # arrivals are admitted a few steps later rather than a whole run later.
            steps = self.steps
            if arriving and engine.busy + engine.pending < self.slots:
                steps = max(1, self.steps // 4)
            busy = engine.busy or engine.pending
            top = self._tops()  # (before the run: a choice it ends is read once more at most)
            if share is not None:
                share({"ops": self._ops, "steps": steps, "top": top})
                self._ops = None
            finished = engine.run(params, version, steps) if busy else []
            out = self._stream(progress)
            out += [d for f in finished if (d := self._finish(f)) is not None]
            Generation.push_all(out)
            return engine.peek(window=self.steps, top=top) if engine.busy else []
        except Exception as e:  # noqa: BLE001 - the engine broke: every request learns it
            log.exception("the engine failed")
            self._fail_all(e)
            for kind, item in inbox:  # taken but not yet submitted when it broke
                if kind == "submit":
                    item.push(e)
            if self._thread is None:  # driven: the owner (a training run) stops on it
                raise
            return []

    def _tops(self) -> bool:
        """Whether a decoding request asked for top alternatives (else peek leaves them)."""
        return any(c.generation.request.top_logprobs for c in self._choices.values())

    def _submit(self, generation: Generation) -> None:
        r = generation.request
        seed = r.seed if r.seed is not None else int.from_bytes(os.urandom(8), "little")
        prompt = list(r.prompt_ids)
        head, given = prompt[: self.prompt_len], prompt[self.prompt_len :]
        for index in range(r.n):
            rid = next(self._ids)
            words = (seed & 0xFFFFFFFF, ((seed >> 32) + 0x9E3779B9 * index) & 0xFFFFFFFF)
            sampling = RowSampling(r.temperature, r.top_p, words)
            self.engine.submit(rid, head, max_new=len(given) + r.max_new, given=given,
                               sampling=sampling, not_before=r.not_before)  # fmt: skip
            self._choices[rid] = _Choice(generation, index, len(given))
            if self._ops is not None:
                self._ops.append(["submit", rid, [int(t) for t in head], len(given) + r.max_new,
                                  [int(t) for t in given], r.temperature, r.top_p,
                                  list(words), r.not_before])  # fmt: skip

    def _cancel(self, generation: Generation, indices: list[int]) -> None:
        for rid, c in list(self._choices.items()):
            if c.generation is generation and c.index in indices:
                self.engine.cancel(rid)
                del self._choices[rid]
                if self._ops is not None:
                    self._ops.append(["cancel", rid])

    def _delta(self, c: _Choice, first: int, tokens, logp, top_ids, top_logp, versions,
               finish=None) -> Delta:  # fmt: skip
        """Choice `c`'s delta from arrays over its columns [first, first + len(tokens)):
        the columns after those it was sent (and after its given prompt tokens)."""
        start = max(c.sent, c.given) - first
        k = c.generation.request.top_logprobs
        top = None
        if k and top_ids is not None:
            top = tuple(
                tuple((int(i), _finite(v)) for i, v in zip(ids[:k], vals[:k], strict=True))
                for ids, vals in zip(top_ids[start:], top_logp[start:], strict=True)
            )
        c.sent = first + len(tokens)
        return Delta(c.index, tuple(int(t) for t in tokens[start:]),
                     tuple(_finite(v) for v in logp[start:]), top, finish,
                     tuple(int(v) for v in versions[start:]))  # fmt: skip

    def _finish(self, f) -> tuple[Generation, Delta] | None:
        c = self._choices.pop(f.request, None)
        if c is None:  # cancelled meanwhile
            return None
        n = f.length
        finish = "stop" if f.finish_reason == EOS else "length"
        cut = lambda x: None if x is None else x[:n]  # noqa: E731
        delta = self._delta(c, 0, f.tokens[:n], f.logp[:n], cut(f.top_ids), cut(f.top_logp),
                            f.versions[:n], finish)  # fmt: skip
        return c.generation, delta

    def _stream(self, progress) -> list[tuple[Generation, Delta]]:
        out = []
        for rid, _, first, tokens, logp, top_ids, top_logp, versions in progress:
            c = self._choices.get(rid)
            if c is None or first + len(tokens) <= max(c.sent, c.given):
                continue
            if first > max(c.sent, c.given):  # (a window that skipped columns: the finished
                continue  # row sends them all)
            out.append((c.generation, self._delta(c, first, tokens, logp, top_ids, top_logp,
                                                  versions)))  # fmt: skip
        return out

    def _fail_all(self, error: BaseException, cancel: bool = True) -> None:
        for rid, c in list(self._choices.items()):
            if cancel:
                with contextlib.suppress(Exception):  # failing every request is all there is
                    self.engine.cancel(rid)
            c.generation.push(error)
        self._choices.clear()

    def _count(self) -> None:
        queued = {w[0] for w in self.engine.waiting}  # requests with a choice not on a slot
        waiting = {id(c.generation) for rid, c in self._choices.items() if rid in queued}
        with self._lock:
            self._busy = self.engine.busy
            self._waiting = len(waiting) + sum(k == "submit" for k, _ in self._inbox)


LOGP_FLOOR = -9999.0  # for a token outside top-p's nucleus (-inf): JSON has no infinity


def _finite(v) -> float:
    return max(float(v), LOGP_FLOOR)
