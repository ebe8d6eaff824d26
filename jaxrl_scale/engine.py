"""Continuous batching: a fixed set of decode slots that finished rows leave and new prompts join.

Shapes: B slots, L prompt columns (prompts left-padded to L), N new-token columns, S = L + N
cache columns per slot.

A static batch decodes until its longest row ends, so with heavy-tailed completion lengths
most rows sit finished while a few run on. Here every slot holds one row with its own cache
region and its own completion column; a compiled step decodes every occupied slot one token
(`sampler.decode`, the same step as the static path, with a column per row). Between runs of
steps the host reads the slots' done flags once, frees the finished rows' slots and admits
waiting prompts into them; the finished rows cross to the host while the next steps run.
Each prompt is prefilled once for its G rows (`sampler.prefill`) and its cache rows are
scattered into the slots, overwriting every column a previous occupant wrote, so nothing of
it is visible to the newcomer. New parameters can be passed to any run, so one completion
may carry tokens of several policy versions; every token records the version that sampled
it, and a prompt can be held until the version is recent enough (`submit(not_before=)`).

engine = SlotEngine(graphdef, slots=64, prompt_len=32, n_new=256, repeat=8, ...)
engine.submit(request_id, prompt_ids)        # queued; admitted when G slots are free
                                             # (max_new=...: this prompt's own budget)
done = engine.run(params, version, steps=8)  # decode up to 8 steps; the rows that had
                                             # finished before them

Threads: an engine is owned by the thread that calls `submit` and `run` (the generator's).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_scale import distributed
from jaxrl_scale.model import KVCache
from jaxrl_scale.sampler import (
    LENGTH,
    DecodeState,
    Interruption,
    Sampling,
    decode,
    prefill,
)
from jaxrl_scale.sharding import LOGICAL_RULES, batch_sharding, replicated


@dataclasses.dataclass(frozen=True)
class Finished:
    """One completed row, on the host: the caller's request id and which of its G rows."""

    request: int
    row: int
    prompt: np.ndarray  # [L] int32, left-padded
    prompt_mask: np.ndarray  # [L] bool
    tokens: np.ndarray  # [N] int32, pad after `length`
    mask: np.ndarray  # [N] float32, 1 on sampled tokens
    logp: np.ndarray  # [N] float32 behaviour log-probs
    versions: np.ndarray  # [N] int32 version per sampled token, -1 elsewhere
    finish_reason: int  # index into sampler.FINISH_REASONS
    length: int  # completion tokens emitted (interruption text included)


def _slot_shardings(state: DecodeState, mesh):
    """Per-slot fields split over the batch axes (when the slots divide evenly), the step
    counter and key replicated."""
    ways = math.prod(mesh.shape[a] for a in LOGICAL_RULES["batch"])
    slots = state.done.shape[0]

    def one(x):
        if np.ndim(x) == 0 or slots % ways:
            return replicated(mesh)
        return batch_sharding(mesh, np.ndim(x))

    return jax.tree.map(one, state)


def abstract_slots(model_cfg, slots: int, prompt_len: int, n_new: int, mesh) -> DecodeState:
    """The shapes, dtypes and shardings of an engine's decode state, nothing allocated (what
    `jaxrl-scale memory` compiles the decode program against)."""
    empty = functools.partial(_empty_state, model_cfg, slots, prompt_len, n_new, 0)
    abstract = jax.eval_shape(empty, jax.random.key(0))
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract,
        _slot_shardings(abstract, mesh),
    )


def _bucket(n: int, cap: int) -> int:
    """The power of two >= n (at most cap): few distinct shapes, few compiles."""
    return min(1 << max(n - 1, 0).bit_length(), cap)


def _empty_state(model_cfg, b: int, prompt_len: int, n_new: int, pad_id: int, key) -> DecodeState:
    """B free slots: every row finished and owned by nobody, its cache empty."""
    return DecodeState(
        cache=KVCache.empty(model_cfg, b, prompt_len + n_new),
        h_bd=jnp.zeros((b, model_cfg.hidden_size), jnp.dtype(model_cfg.lm_head_dtype)),
        tokens=jnp.full((b, n_new), pad_id, jnp.int32),
        logp=jnp.zeros((b, n_new)),
        mask=jnp.zeros((b, n_new)),
        versions=jnp.full((b, n_new), -1, jnp.int32),
        step=jnp.zeros((), jnp.int32),
        col=jnp.zeros((b,), jnp.int32),
        position=jnp.zeros((b,), jnp.int32),
        done=jnp.ones((b,), jnp.bool_),
        finish=jnp.full((b,), LENGTH, jnp.int32),
        phase=jnp.zeros((b,), jnp.int32),
        counts=jnp.zeros((b, 4), jnp.int32),
        matched=jnp.zeros((b,), jnp.int32),
        think_budget=jnp.zeros((b,), jnp.int32),
        budget=jnp.zeros((b,), jnp.int32),
        key=key,
    )


def _admit(state: DecodeState, new: DecodeState, slot_idx):
    """`new`'s rows written into the slots `slot_idx` (an index >= B is padding: dropped).
    Every per-row field is replaced, the cache rows whole, and the rows start at column 0."""

    def put(big, small):
        return big.at[slot_idx].set(small.astype(big.dtype), mode="drop")

    cache = KVCache(
        k=tuple(map(put, state.cache.k, new.cache.k)),
        v=tuple(map(put, state.cache.v, new.cache.v)),
        valid=put(state.cache.valid, new.cache.valid),
    )
    rows = {
        f.name: put(getattr(state, f.name), getattr(new, f.name))
        for f in dataclasses.fields(DecodeState)
        if f.name not in ("cache", "step", "col", "key")
    }
    col = state.col.at[slot_idx].set(0, mode="drop")
    return dataclasses.replace(state, cache=cache, col=col, **rows)


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "n_new", "interruption", "mesh", "repeat"),
    donate_argnames=("state",),
)
def _prefill_into(state, graphdef, params, tokens, mask, key, budget, slot_idx, **static):
    """Prefill prompts (`sampler.prefill`, G rows each) straight into the slots `slot_idx`:
    one program, so an admission costs one dispatch."""
    new = prefill(graphdef, params, tokens, mask, key, **static)
    return _admit(state, dataclasses.replace(new, budget=budget), slot_idx)


@jax.jit
def _take_rows(state: DecodeState, idx):
    """The output fields of rows `idx`, gathered on device (only they cross to the host)."""
    return (
        state.tokens[idx],
        state.mask[idx],
        state.logp[idx],
        state.versions[idx],
        state.finish[idx],
        jnp.sum(state.counts[idx], axis=1),
    )


class SlotEngine:
    """`slots` decode slots for prompts of up to `prompt_len` tokens, each row up to `n_new`
    completion tokens, `repeat` rows per prompt (a group); `model_cfg` is the policy's
    ModelConfig, `mesh` the devices the slots are split over (None: the default device).
    Owned by one thread: `submit` and `run` mutate the queue, the slots and the device state."""

    def __init__(
        self,
        graphdef,
        *,
        slots: int,
        prompt_len: int,
        n_new: int,
        repeat: int,
        sampling: Sampling,
        eos_ids: Sequence[int],
        pad_id: int,
        interruption: Interruption | None = None,
        model_cfg,
        key=None,
        mesh: jax.sharding.Mesh | None = None,
    ):
        if slots < repeat:
            raise ValueError(f"slots ({slots}) must hold at least one group of {repeat} rows")
        self.graphdef, self.slots, self.repeat, self.mesh = graphdef, slots, repeat, mesh
        self.prompt_len, self.n_new, self.pad_id = prompt_len, n_new, pad_id
        # Admissions draw from one stream, decode steps from another (the state's, donated).
        self.key, decode_key = jax.random.split(jax.random.key(0) if key is None else key)
        self.static = dict(
            sampling=sampling,
            eos_ids=tuple(int(i) for i in eos_ids),
            pad_id=pad_id,
            interruption=interruption,
            prompt_len=prompt_len,
        )
        self.interruption = interruption
        # (request, prompt [L], prompt mask [L], completion budget, oldest version allowed),
        # in submission order.
        self.waiting: collections.deque[tuple] = collections.deque()
        # Host bookkeeping of each slot: (request id, row) or None when free; each request's
        # [prompt, prompt mask, rows not yet handed back] until its last row is.
        self.occupant: list[tuple[int, int] | None] = [None] * slots
        self.prompts: dict[int, list] = {}
        self.admissions = 0
        empty = functools.partial(_empty_state, model_cfg, slots, prompt_len, n_new, pad_id)
        if mesh is None:
            self.state = empty(decode_key)
        else:  # the slots split over the mesh's batch axes, like a batch's rows; made in place
            shardings = _slot_shardings(jax.eval_shape(empty, decode_key), mesh)
            self.state = jax.jit(empty, out_shardings=shardings)(decode_key)

    # ------------------------------------------------------------------ queue

    def submit(
        self,
        request: int,
        prompt: Sequence[int],
        max_new: int | None = None,
        not_before: int | None = None,
    ) -> None:
        """Queue a prompt; its `repeat` rows are admitted together once that many slots are
        free. `request` is the caller's id, returned with each finished row; `max_new` caps
        this prompt's completions (at most the engine's n_new, the default); `not_before`
        holds it (and everything queued behind it) until a run's version is at least that,
        so none of its tokens is older (the staleness bound of the step that trains it)."""
        if request in self.prompts:
            raise ValueError(f"request {request} was already submitted")
        max_new = self.n_new if max_new is None else int(max_new)
        if not 1 <= max_new <= self.n_new:
            raise ValueError(f"max_new must be in [1, {self.n_new}], got {max_new}")
        if len(prompt) == 0:
            raise ValueError(f"request {request}: the prompt is empty")
        if len(prompt) > self.prompt_len:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds prompt_len {self.prompt_len}")
        tokens = np.full(self.prompt_len, self.pad_id, np.int32)
        mask = np.zeros(self.prompt_len, bool)
        start = self.prompt_len - len(prompt)  # left-padded, as every prompt of the sampler
        tokens[start:], mask[start:] = prompt, True
        self.prompts[request] = [tokens, mask, self.repeat]  # rows not yet handed back
        self.waiting.append((request, tokens, mask, max_new, not_before))

    @property
    def busy(self) -> int:
        """Slots holding a row that has not been handed back."""
        return sum(o is not None for o in self.occupant)

    @property
    def pending(self) -> int:
        """Prompts queued and not yet admitted."""
        return len(self.waiting)

    # ------------------------------------------------------------------ steps

    def _put(self, host: np.ndarray) -> np.ndarray | jax.Array:
        """A host array, the same on every process, as an input of the engine's programs:
        across processes each one places its copy on its devices of the mesh."""
        if self.mesh is None or jax.process_count() == 1:
            return host  # moved with the call that takes it
        return distributed.place(host, replicated(self.mesh))

    def _admit_waiting(self, params, version: int) -> None:
        free = [i for i, o in enumerate(self.occupant) if o is None]
        n = 0  # groups admitted: in order, while slots last and the version allows
        while n < min(len(free) // self.repeat, len(self.waiting)):
            not_before = self.waiting[n][4]
            if not_before is not None and version < not_before:
                break
            n += 1
        if not n:
            return
        groups = [self.waiting.popleft() for _ in range(n)]
        width = _bucket(n, self.slots // self.repeat)
        tokens = np.full((width, self.prompt_len), self.pad_id, np.int32)
        mask = np.zeros((width, self.prompt_len), bool)
        mask[:, -1] = True  # padding prompts: one token each, their rows dropped below
        slot_idx = np.full(width * self.repeat, self.slots, np.int32)  # >= B: dropped
        budget = np.full(width * self.repeat, self.n_new, np.int32)
        for g, (request, t, m, max_new, _) in enumerate(groups):
            tokens[g], mask[g] = t, m
            budget[g * self.repeat : (g + 1) * self.repeat] = max_new
            for r in range(self.repeat):
                slot = free[g * self.repeat + r]
                slot_idx[g * self.repeat + r] = slot
                self.occupant[slot] = (request, r)
        key = jax.random.fold_in(self.key, self.admissions)
        self.admissions += 1
        self.state = _prefill_into(
            self.state,
            self.graphdef,
            params,
            *map(self._put, (tokens, mask)),
            key,
            *map(self._put, (budget, slot_idx)),
            n_new=self.n_new,
            interruption=self.interruption,
            mesh=self.mesh,
            repeat=self.repeat,
        )

    def _collect(self):
        """Free the slots whose rows have finished and start gathering those rows on the
        device; `_hand_back` reads them. Reading the done flags waits for the last decode."""
        done = distributed.to_host(self.state.done)
        slots = [i for i, o in enumerate(self.occupant) if o is not None and done[i]]
        if not slots:
            return None
        width = _bucket(len(slots), self.slots)
        idx = np.asarray(slots + [slots[0]] * (width - len(slots)), np.int32)
        rows = _take_rows(self.state, self._put(idx))
        owners = [self.occupant[i] for i in slots]
        for i in slots:
            self.occupant[i] = None
        return owners, rows

    def _hand_back(self, collected) -> list[Finished]:
        if collected is None:
            return []
        owners, rows = collected
        tokens, mask, logp, versions, finish, lengths = map(distributed.to_host, rows)
        out = []
        for j, (request, row) in enumerate(owners):
            n = int(lengths[j])
            t = tokens[j].copy()
            t[n:] = self.pad_id
            entry = self.prompts[request]
            out.append(
                Finished(request, row, entry[0], entry[1], t, mask[j], logp[j], versions[j],
                         int(finish[j]), n)
            )  # fmt: skip
            entry[2] -= 1
            if not entry[2]:  # forgotten once every row was handed back
                del self.prompts[request]
        return out

    def run(self, params, version: int, steps: int) -> list[Finished]:
        """Free the slots of rows that finished, admit what fits, decode up to `steps` steps
        with `params` (tokens tagged `version`), and return the rows freed: those that
        finished by the previous call's last step. One read of the done flags per call; the
        finished rows cross to the host while this call's steps run."""
        collected = self._collect()
        self._admit_waiting(params, version)
        if self.busy:
            self.state = decode(
                self.graphdef, params, self.state, jnp.int32(version), steps, **self.static
            )
        return self._hand_back(collected)
