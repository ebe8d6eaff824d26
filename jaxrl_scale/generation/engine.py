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

Episodes (`episodes=True`, rl/episodes.py): a row's completion columns hold a whole
multi-turn episode. A row whose turn ends is handed back as usual but keeps its slot, parked,
while its environment steps on the host; `resume` writes the observation's tokens into its
next columns, and the decode steps feed them into its cache as given (mask 0) before it
samples the next turn, so an episode is never prefilled again; `release` frees the slot.
Other slots decode meanwhile. An observation of F tokens takes F of the row's decode steps.

engine.resume(request, row, observation_ids, limit)   # go on until column `limit`
engine.release(request, row)                          # the episode is over

Threads: an engine is owned by the thread that calls `submit` and `run` (the generator's).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_scale.generation.sampler import (
    LENGTH,
    THINKING,
    DecodeState,
    Interruption,
    Sampling,
    decode,
)
from jaxrl_scale.models.policy import KVCache, no_routes
from jaxrl_scale.parallel import distributed
from jaxrl_scale.parallel.sharding import (
    LOGICAL_RULES,
    batch_sharding,
    batch_ways,
    replicated,
    traced_on,
)


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
    routes: np.ndarray | None = None  # [L + N, routed layers, K]: router replay's experts
    top_ids: np.ndarray | None = None  # [N, K] the K most probable tokens per column
    top_logp: np.ndarray | None = None  # [N, K] their log-probs


def check_slots(slots: int, repeat: int, mesh) -> None:
    """Slots that hold a group and split evenly over the mesh's batch shards (else every
    device would hold, and decode, every slot's cache)."""
    if slots < repeat:
        raise ValueError(
            f"sampler.slots: {slots} cannot hold at least one group of {repeat} rows "
            "(train.group_size)"
        )
    ways = batch_ways(mesh)
    if slots % ways:
        raise ValueError(
            f"sampler.slots: {slots} does not split over the generator's {ways} batch shards "
            f"(use a multiple of {ways}, e.g. {-(-slots // ways) * ways})"
        )


def _slot_shardings(state: DecodeState, mesh):
    """Per-slot fields split over the batch axes, the step counter and key replicated."""

    def one(x):
        return replicated(mesh) if np.ndim(x) == 0 else batch_sharding(mesh, np.ndim(x))

    return jax.tree.map(one, state)


def _laid_out(state: DecodeState, mesh) -> DecodeState:
    """A state a program updated, kept in the slots' layout (`_slot_shardings`), so the next
    program does not compile again for another placement; as is without a mesh."""
    if mesh is None:
        return state
    return jax.lax.with_sharding_constraint(state, _slot_shardings(state, mesh))


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


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """A row's own sampling, on an engine made with `per_row_sampling`: temperature (0:
    greedy), top-p, and a seed (two uint32 words): the row's token at completion column c is
    drawn with fold_in(seed, c), whatever else decodes beside it."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: tuple[int, int] = (0, 0)


def _empty_state(model_cfg, b: int, prompt_len: int, n_new: int, pad_id: int, key, *,
                 per_row: bool = False, top_logprobs: int = 0) -> DecodeState:  # fmt: skip
    """B free slots: every row finished and owned by nobody, its cache empty."""
    rows = lambda value, dtype: jnp.full((b,), value, dtype) if per_row else None  # noqa: E731
    top = (b, n_new, top_logprobs)
    return DecodeState(
        row_temperature=rows(1.0, jnp.float32),
        row_top_p=rows(1.0, jnp.float32),
        row_seed=jnp.zeros((b, 2), jnp.uint32) if per_row else None,
        top_ids=jnp.zeros(top, jnp.int32) if top_logprobs else None,
        top_logp=jnp.zeros(top, jnp.float32) if top_logprobs else None,
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
        routes=no_routes((b, prompt_len + n_new, model_cfg.routed_layers), model_cfg)
        if model_cfg.router_replay else None,
        forced_until=jnp.zeros((b,), jnp.int32),
    )  # fmt: skip


def _admit_local(
    state: DecodeState, k_new, v_new, valid_new, h_new, source, budget, think, routes_new=None
):
    """One batch shard's slots take their prompts: slot i (source[i] >= 0) gets prompt
    source[i] of this shard's prefilled prompts, a fresh row starting at column 0. A prompt's
    keys and values (and with router replay its tokens' experts, `routes_new`) fill the first
    L cache columns; the columns after them keep whatever a previous occupant wrote, invisible
    behind `valid` (False there) and overwritten as the row decodes. Slots with source -1 are
    left as they are."""
    admit = source >= 0
    src = jnp.maximum(source, 0)
    prompt_len = valid_new.shape[1]

    def keep_or(new, old):
        pick = admit.reshape(admit.shape + (1,) * (old.ndim - 1))
        return jnp.where(pick, new.astype(old.dtype), old)

    def prompt_columns(big, small):  # [s, K, S, E] <- [m, K, L, E] by source
        return big.at[:, :, :prompt_len].set(keep_or(small[src], big[:, :, :prompt_len]))

    valid = valid_new[src]
    zeros = jnp.zeros_like(state.logp)
    cache = KVCache(
        k=tuple(map(prompt_columns, state.cache.k, k_new)),
        v=tuple(map(prompt_columns, state.cache.v, v_new)),
        valid=keep_or(jnp.pad(valid, ((0, 0), (0, state.cache.valid.shape[1] - prompt_len))),
                      state.cache.valid),
    )  # fmt: skip
    fresh = dict(
        h_bd=h_new[src],
        tokens=jnp.zeros_like(state.tokens),
        logp=zeros,
        mask=zeros,
        versions=jnp.full_like(state.versions, -1),
        col=jnp.zeros_like(state.col),
        position=jnp.sum(valid, axis=1, dtype=jnp.int32),
        done=jnp.zeros_like(state.done),
        finish=jnp.full_like(state.finish, LENGTH),
        phase=jnp.full_like(state.phase, THINKING),
        counts=jnp.zeros_like(state.counts),
        matched=jnp.zeros_like(state.matched),
        think_budget=think,
        budget=budget,
        forced_until=jnp.zeros_like(state.forced_until),
    )
    if routes_new is not None:  # the prompt's columns; kept for admitted slots only, below
        fresh["routes"] = state.routes.at[:, :prompt_len].set(routes_new[src])
    rows = {name: keep_or(value, getattr(state, name)) for name, value in fresh.items()}
    return dataclasses.replace(state, cache=cache, **rows)


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "n_new", "interruption", "mesh"),
    donate_argnames=("state",),
)
def _prefill_into(state, graphdef, params, tokens, mask, key, source, budget, *, n_new,
                  interruption, mesh):  # fmt: skip
    """Admission as one program: prefill `tokens` [W * m, L] (each of the W batch shards' m
    prompts, the ones its own slots take) and write each admitted slot's prompt into it
    (`source` [slots]: the index of its prompt among its shard's m, -1 for a slot left
    alone; `budget` [slots]: its completion budget). Every device prefills and writes only
    its own shard's rows, so what admission holds per device does not grow with the number
    of devices, and nothing crosses between them."""
    model = nnx.merge(graphdef, params)

    def rows(x):  # split over the batch shards like the slots
        if mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, batch_sharding(mesh, x.ndim))

    tokens, mask, source, budget = map(rows, (tokens, mask, source, budget))
    # The prompts' layers run as one scan for a mixture of experts (`ModelConfig.scan_prompts`:
    # one layer's routed pairs live at a time); the prompt-sized cache comes back stacked
    # and is split per layer for the slots.
    scan = model.cfg.scan_prompts
    cache = KVCache.empty(model.cfg, *tokens.shape, stacked=scan)
    if not scan:
        cache = jax.tree.map(rows, cache)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    with traced_on(mesh):
        h_btd, cache, chosen = model.extend(
            cache, tokens, positions, mask, 0, scan=scan, return_routes=True
        )
    if scan:
        cache = KVCache(k=tuple(map(rows, cache.k)), v=tuple(map(rows, cache.v)),
                        valid=cache.valid)  # fmt: skip
    slots = source.shape[0]
    if interruption is None:
        think = jnp.full((slots,), n_new + 1, jnp.int32)  # never reached
    else:
        think = jax.random.randint(
            key, (slots,), interruption.think_min, interruption.think_max + 1, jnp.int32
        )
    think = rows(think)
    args = (state, cache.k, cache.v, mask, rows(h_btd[:, -1]), source, budget, think)
    if state.routes is not None:
        args += (rows(chosen.astype(state.routes.dtype)),)
    if mesh is None:
        return _admit_local(*args)
    spec = jax.sharding.PartitionSpec
    split = tuple(a for a in LOGICAL_RULES["batch"] if a in mesh.axis_names)
    specs = jax.tree.map(lambda x: spec() if np.ndim(x) == 0 else spec(split), args)
    return jax.shard_map(
        _admit_local, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False
    )(*args)


def lower_admission(graphdef, params, state: DecodeState, *, repeat: int, prompt_len: int,
                    n_new: int, interruption, mesh):  # fmt: skip
    """The admission program lowered for the widest admission a shard can see (what
    `jaxrl-scale memory` plans), from abstract `params` and `state` (`abstract_slots`)."""
    slots = state.done.shape[0]
    ways = batch_ways(mesh)
    width = admission_width(slots // ways, repeat)
    shape = lambda *s, dtype: jax.ShapeDtypeStruct(  # noqa: E731
        s, dtype, sharding=None if mesh is None else batch_sharding(mesh, len(s))
    )
    return _prefill_into.lower(
        state, graphdef, params,
        shape(ways * width, prompt_len, dtype=jnp.int32),
        shape(ways * width, prompt_len, dtype=jnp.bool_),
        jax.random.key(0),
        shape(slots, dtype=jnp.int32),
        shape(slots, dtype=jnp.int32),
        n_new=n_new, interruption=interruption, mesh=mesh,
    )  # fmt: skip


def admission_width(per_shard: int, repeat: int) -> int:
    """The most prompts one shard's slots can take in one admission, as compiled (a power of
    two, so few shapes): each of its `per_shard` slots takes a row of a group of `repeat`,
    and the groups cut by the shard's edges add one."""
    return _bucket(min(per_shard, -(-per_shard // repeat) + 1), per_shard)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("state",))
def _resume(state: DecodeState, idx, given, n_given, limit, *, mesh):
    """Parked rows `idx` [m] (an index past the last slot: nobody) go on: each gets its
    `n_given` [m] tokens of `given` [m, F] (an observation) written at its next completion
    columns, fed as given by the decode steps that reach them, and then samples until column
    `limit` [m] or its end-of-sequence. Nothing is prefilled: the row's cache keeps growing."""
    slots, n_new = state.tokens.shape
    col = state.col[jnp.minimum(idx, slots - 1)]
    width = given.shape[1]
    cols = jnp.where(jnp.arange(width) < n_given[:, None], col[:, None] + jnp.arange(width), n_new)
    rows = jnp.broadcast_to(idx[:, None], cols.shape)
    put = lambda x, v: x.at[idx].set(v, mode="drop")  # noqa: E731
    out = dataclasses.replace(
        state,
        tokens=state.tokens.at[rows, cols].set(given, mode="drop"),
        forced_until=put(state.forced_until, col + n_given),
        budget=put(state.budget, limit),
        done=put(state.done, False),
        finish=put(state.finish, LENGTH),
    )
    return _laid_out(out, mesh)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("dst",))
def _copy_rows(dst: DecodeState, src: DecodeState, to, take, *, mesh):
    """Rows `take` of `src` (cache, buffers, counters: everything a row has) into rows `to`
    of `dst` (an index past its last row: nobody); the step counter and key stay `dst`'s."""

    def one(d, s):
        return d if d.ndim == 0 else d.at[to].set(s[take], mode="drop")

    out = dataclasses.replace(jax.tree.map(one, dst, src), step=dst.step, key=dst.key)
    return _laid_out(out, mesh)


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
        None if state.routes is None else state.routes[idx],
        None if state.top_ids is None else state.top_ids[idx],
        None if state.top_logp is None else state.top_logp[idx],
    )


@functools.partial(jax.jit, static_argnames=("window", "top"))
def _peek_rows(state: DecodeState, idx, *, window: int, top: bool):
    """What rows `idx` have in their last `window` columns before their next one (a server's
    streaming): tokens, log-probs, the next column, the top alternatives (with `top`), and
    the policy versions the tokens were sampled with."""
    n_new = state.tokens.shape[1]
    col = state.col[idx]
    cols = jnp.clip(col[:, None] - window + jnp.arange(window), 0, n_new - 1)  # [m, window]
    rows = idx[:, None]
    top_ids = top_logp = None
    if top and state.top_ids is not None:
        top_ids, top_logp = state.top_ids[rows, cols], state.top_logp[rows, cols]
    return (state.tokens[rows, cols], state.logp[rows, cols], col, top_ids, top_logp,
            state.versions[rows, cols])  # fmt: skip


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("state",))
def _configure_rows(state: DecodeState, idx, temperature, top_p, seed, *, mesh):
    """Rows `idx` [m] (past the last slot: nobody) take their own sampling settings."""
    put = lambda x, v: x.at[idx].set(v, mode="drop")  # noqa: E731
    out = dataclasses.replace(
        state,
        row_temperature=put(state.row_temperature, temperature),
        row_top_p=put(state.row_top_p, top_p),
        row_seed=put(state.row_seed, seed),
    )
    return _laid_out(out, mesh)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("state",))
def _stop_rows(state: DecodeState, idx, *, mesh):
    """Rows `idx` [m] (past the last slot: nobody) stop decoding (their request cancelled)."""
    out = dataclasses.replace(state, done=state.done.at[idx].set(True, mode="drop"))
    return _laid_out(out, mesh)


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
        episodes: bool = False,
        parked_rows: int = 0,
        per_row_sampling: bool = False,
        top_logprobs: int = 0,
        in_order: bool = True,
    ):
        check_slots(slots, repeat, mesh)
        if episodes and interruption is not None:
            raise ValueError("a slot engine running episodes takes no thinking interruption")
        if parked_rows and (not episodes or parked_rows % batch_ways(mesh)):
            raise ValueError(f"parked_rows: {parked_rows} needs episodes and must split over "
                             f"the {batch_ways(mesh)} batch shards")  # fmt: skip
        # Episodes: a row whose turn ended is parked, on its slot (`parked`) or, when its
        # slot is wanted, moved to a row of `parking` (`stored`), until `resume` gives it
        # the observation to go on from (back on a slot) or `release` ends it.
        self.episodes = episodes
        # Slots whose row waits -> the run that parked it; rows move to parking only once
        # they have waited a whole run (an answer that comes within one finds its slot).
        self.parked: dict[int, int] = {}
        self.runs = 0
        self.slot_of: dict[tuple[int, int], int] = {}  # (request, row) -> slot, on a slot
        self.stored: dict[tuple[int, int], int] = {}  # (request, row) -> parking row
        self.free_parking = list(range(parked_rows))
        # Resumes asked for, applied by the next runs: ((request, row), tokens, limit).
        self.resumes: list[tuple[tuple[int, int], np.ndarray, int]] = []
        self.moves = 0  # rows moved between slots and parking (each way counts)
        # Decode steps taken, and slot-steps of them that had a row decoding (a row that
        # ends mid-run counts to the run's end): occupancy = slot_steps / (slots x steps).
        self.steps, self.slot_steps, self._dispatched = 0, 0, 0
        self.ways = batch_ways(mesh)  # batch shards: each admits into its own slots
        self.graphdef, self.slots, self.repeat, self.mesh = graphdef, slots, repeat, mesh
        self.prompt_len, self.n_new, self.pad_id = prompt_len, n_new, pad_id
        # A server's engine: each request's rows sample with their own settings (`submit`'s
        # `sampling`), and the top `top_logprobs` alternatives of every token are recorded.
        self.per_row, self.top_logprobs = per_row_sampling, top_logprobs
        # In order: a prompt held for a version holds those queued behind it (a training
        # batch after its predecessor). Not (a server's independent requests): any
        # admissible prompt goes, in queue order among those.
        self.in_order = in_order
        # Admissions draw from one stream, decode steps from another (the state's, donated).
        self.key, decode_key = jax.random.split(jax.random.key(0) if key is None else key)
        self.static = dict(
            sampling=sampling,
            eos_ids=tuple(int(i) for i in eos_ids),
            pad_id=pad_id,
            interruption=interruption,
            prompt_len=prompt_len,
            mesh=mesh,
        )
        self.interruption = interruption
        # (request, prompt [L], mask [L], budget, oldest version allowed), as submitted.
        self.waiting: collections.deque[tuple] = collections.deque()
        # Host bookkeeping of each slot: (request id, row) or None when free; each request's
        # [prompt, prompt mask, rows not yet handed back] until its last row is.
        self.occupant: list[tuple[int, int] | None] = [None] * slots
        self.prompts: dict[int, list] = {}
        self.admissions = 0

        def make(rows):
            empty = functools.partial(
                _empty_state, model_cfg, rows, prompt_len, n_new, pad_id,
                per_row=per_row_sampling, top_logprobs=top_logprobs,
            )  # fmt: skip
            if mesh is None:
                return empty(decode_key)
            # The rows split over the mesh's batch axes, like a batch's rows; made in place.
            shardings = _slot_shardings(jax.eval_shape(empty, decode_key), mesh)
            return jax.jit(empty, out_shardings=shardings)(decode_key)

        self.state = make(slots)
        self.parking = make(parked_rows) if parked_rows else None

    # ------------------------------------------------------------------ queue

    def submit(
        self,
        request: int,
        prompt: Sequence[int],
        max_new: int | None = None,
        not_before: int | None = None,
        given: Sequence[int] = (),
        sampling: RowSampling | None = None,
    ) -> None:
        """Queue a prompt; its `repeat` rows are admitted together once that many slots are
        free. `request` is the caller's id, returned with each finished row; `max_new` caps
        this prompt's completions (at most the engine's n_new, the default); `not_before`
        holds it (and everything queued behind it) until a run's version is at least that,
        so none of its tokens is older (the staleness bound of the step that trains it).
        `given` (episodes: the rest of a prompt longer than prompt_len) are the first tokens
        of its completion columns, fed into the cache as given (mask 0, version -1) before
        anything is sampled; they count in `max_new`. `sampling`: the rows' own settings, on an
        engine made with `per_row_sampling` (default: temperature 1, top-p 1, seed 0)."""
        if request in self.prompts:
            raise ValueError(f"request {request} was already submitted")
        max_new = self.n_new if max_new is None else int(max_new)
        if not 1 <= max_new <= self.n_new:
            raise ValueError(f"max_new must be in [1, {self.n_new}], got {max_new}")
        if len(prompt) == 0:
            raise ValueError(f"request {request}: the prompt is empty")
        if len(prompt) > self.prompt_len:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds prompt_len {self.prompt_len}")
        given = np.asarray(given, np.int32)
        if sampling is not None and not self.per_row:
            raise ValueError("a request's own sampling needs an engine with per_row_sampling")
        if len(given) >= max_new:
            raise ValueError(f"{len(given)} given tokens leave none of max_new = {max_new}")
        tokens = np.full(self.prompt_len, self.pad_id, np.int32)
        mask = np.zeros(self.prompt_len, bool)
        start = self.prompt_len - len(prompt)  # left-padded, as every prompt of the sampler
        tokens[start:], mask[start:] = prompt, True
        self.prompts[request] = [tokens, mask, self.repeat]  # rows not yet handed back
        row_sampling = (sampling or RowSampling()) if self.per_row else None
        self.waiting.append((request, tokens, mask, max_new, not_before, given, row_sampling))

    def cancel(self, request: int) -> None:
        """Forget `request`: out of the queue if it waits, its rows stopped and their slots
        free at once if it decodes; its rows are never handed back. Not for episodes."""
        if self.episodes:
            raise ValueError("an engine of episodes releases rows (`release`), not requests")
        if request not in self.prompts:
            return
        del self.prompts[request]
        self.waiting = collections.deque(w for w in self.waiting if w[0] != request)
        slots = [i for i, o in enumerate(self.occupant) if o is not None and o[0] == request]
        for i in slots:
            self.occupant[i] = None
        if slots:
            self._stop(slots)

    def _stop(self, slots: list[int], m: int | None = None) -> None:
        idx = np.full(m or _bucket(len(slots), self.slots), self.slots, np.int32)
        idx[: len(slots)] = slots
        self.state = _stop_rows(self.state, self._put(idx), mesh=self.mesh)

    def peek(self, window: int | None = None, top: bool = True) -> list[tuple]:
        """The rows decoding now and what they have so far, as of the last run's steps (it
        waits for them): (request, row, first column, tokens, log-probs, top ids, top
        log-probs), the arrays over the row's columns [first column, next column): its last
        `window` columns (default: all; a run of k steps adds at most k), given tokens
        included; the top alternatives only with `top`; last, the tokens' policy versions.
        A server streams from it."""
        slots = [i for i, o in enumerate(self.occupant) if o is not None]
        if not slots:
            return []
        window = min(window or self.n_new, self.n_new)
        got = self._peek(slots, window, top)
        tokens, logp, col, top_ids, top_logp, versions = (
            None if x is None else distributed.to_host(x) for x in got
        )
        out = []
        for j, slot in enumerate(slots):
            request, row = self.occupant[slot]
            end = min(int(col[j]), self.n_new)
            first = max(end - window, 0)
            keep = slice(window - (end - first), window)  # the window's columns from `first`
            out.append((request, row, first, tokens[j, keep], logp[j, keep],
                        None if top_ids is None else top_ids[j, keep],
                        None if top_logp is None else top_logp[j, keep],
                        versions[j, keep]))  # fmt: skip
        return out

    def _peek(self, slots: list[int], window: int, top: bool, m: int | None = None):
        m = m or _bucket(len(slots), self.slots)
        idx = np.asarray(slots + [slots[0]] * (m - len(slots)), np.int32)
        return _peek_rows(self.state, self._put(idx), window=window, top=top)

    def warm_up(self, params, windows: Sequence[int] = (), given: bool = True) -> int:
        """Compile, before traffic comes, every program traffic can call (a server's first
        requests would otherwise wait seconds for each new shape, on an accelerator with a
        real model): admission at each of its widths, and at each bucketed number of rows
        the programs that configure, stop, read (`peek` at each of `windows`, with and
        without the top alternatives) and hand back rows; with `given`, the feed of given
        tokens at every width; the decode run. No call takes a row (their indices point past
        the last slot, or only read), so the engine is as it was. Call it while nothing is
        submitted. Returns the number of calls made."""
        if self.busy or self.pending or self.episodes:
            raise ValueError("warm_up needs an idle engine of requests (not episodes)")
        calls, per_shard = 0, self.slots // self.ways
        counts = sorted({_bucket(n, self.slots) for n in range(1, self.slots + 1)})
        for width in sorted({_bucket(n, per_shard) for n in range(1, per_shard + 1)}):
            tokens = np.full((self.ways * width, self.prompt_len), self.pad_id, np.int32)
            mask = np.zeros((self.ways * width, self.prompt_len), bool)
            mask[:, -1] = True
            source = np.full(self.slots, -1, np.int32)
            self._prefill(params, tokens, mask, source, np.full(self.slots, self.n_new, np.int32))
            calls += 1
        self.state = decode(self.graphdef, params, self.state, jnp.int32(0), 1, **self.static)
        calls += 1
        widths = sorted({_bucket(n, self.n_new) for n in range(1, self.n_new + 1)})
        for m in counts:
            if self.per_row:
                self._configure([], m)
            self._stop([], m)
            for window in windows:
                for top in (False, True):
                    self._peek([0], min(window, self.n_new), top, m)
            jax.block_until_ready(_take_rows(self.state, self._put(np.zeros(m, np.int32))))
            calls += 2 + self.per_row + 2 * len(windows)
            for width in widths if given else ():
                self._feed([], m, width)
                calls += 1
        jax.block_until_ready(self.state)
        return calls

    @property
    def busy(self) -> int:
        """Slots holding a row that has not been handed back."""
        return sum(o is not None for o in self.occupant)

    @property
    def pending(self) -> int:
        """Prompts queued and not yet admitted."""
        return len(self.waiting)

    @property
    def decoding(self) -> int:
        """Slots whose row decodes, or has finished and is not yet handed back."""
        return self.busy - len(self.parked)

    def can_admit(self, version: int) -> bool:
        """Whether a run with `version` would admit the next waiting prompt (making room by
        moving parked rows to parking)."""
        if not self.waiting:
            return False
        heads = [self.waiting[0]] if self.in_order else self.waiting
        if not any(w[4] is None or version >= w[4] for w in heads):
            return False
        return self.slots - self.busy + self._movable(ahead=1) >= self.repeat

    def would_run(self, version: int) -> bool:
        """Whether a run with `version` would decode anything: a row decoding, a resume it
        can place, or a prompt it can admit."""
        if self.decoding or self.can_admit(version):
            return True
        room = self.slots - self.busy + self._movable(ahead=1)
        return any(key in self.slot_of or room for key, _, _ in self.resumes)

    # ------------------------------------------------------------------ episodes

    def resume(self, request: int, row: int, tokens: Sequence[int], limit: int) -> None:
        """A parked row goes on (at the next run that has a slot for it): `tokens` (an
        observation, may be empty) are fed into its cache as given, then it samples until
        completion column `limit` (exclusive; at most n_new) or its end-of-sequence, and is
        handed back again."""
        key = (request, row)
        if not (key in self.stored or self.slot_of.get(key) in self.parked):
            raise ValueError(f"request {request} row {row} is not parked")
        if any(k == key for k, _, _ in self.resumes):
            raise ValueError(f"request {request} row {row} was already resumed")
        if not 0 < limit <= self.n_new:
            raise ValueError(f"limit must be in [1, {self.n_new}], got {limit}")
        self.resumes.append((key, np.asarray(tokens, np.int32), int(limit)))

    def release(self, request: int, row: int) -> None:
        """A parked row's episode is over: its slot (or parking row) is free."""
        key = (request, row)
        if any(k == key for k, _, _ in self.resumes):
            raise ValueError(f"request {request} row {row} was resumed, not released")
        if key in self.stored:
            self.free_parking.append(self.stored.pop(key))
        elif self.slot_of.get(key) in self.parked:
            slot = self.slot_of.pop(key)
            self.parked.pop(slot)
            self.occupant[slot] = None
        else:
            raise ValueError(f"request {request} row {row} is not parked")
        entry = self.prompts[request]
        entry[2] -= 1
        if not entry[2]:
            del self.prompts[request]

    def _movable(self, ahead: int = 0) -> int:
        """Parked rows that could leave their slots for parking in this run (`ahead` 1:
        in the next one, asked between runs)."""
        return min(len(self._waiting_long(ahead)), len(self.free_parking))

    def _waiting_long(self, ahead: int = 0) -> list[int]:
        """Parked slots, not resumed, whose row has waited since before the run."""
        resuming = {key for key, _, _ in self.resumes}
        return [s for s, at in sorted(self.parked.items())
                if at < self.runs + ahead and self.occupant[s] not in resuming]  # fmt: skip

    def _copy(self, to_parking: bool, pairs: list[tuple[int, int]]) -> None:
        """Rows (slot, parking row) copied from the slots to parking or back."""
        m = _bucket(len(pairs), max(self.slots, self.parking.done.shape[0]))
        pad = [(self.slots, self.parking.done.shape[0])] * (m - len(pairs))
        slots, rows = (np.asarray(x, np.int32) for x in zip(*(pairs + pad), strict=True))
        if to_parking:
            self.parking = _copy_rows(self.parking, self.state, *map(self._put, (rows, slots)),
                                      mesh=self.mesh)  # fmt: skip
        else:
            self.state = _copy_rows(self.state, self.parking, *map(self._put, (slots, rows)),
                                    mesh=self.mesh)  # fmt: skip
        self.moves += len(pairs)

    def _make_room(self, version: int) -> None:
        """Move parked rows to parking while slots are wanted: for resumes of stored rows
        and for prompts a run could admit."""
        if self.parking is None:
            return
        wanted = sum(key in self.stored for key, _, _ in self.resumes)
        for entry in self.waiting:  # the prompts a run could admit, in order
            not_before = entry[4]
            if not_before is not None and version < not_before:
                break
            wanted += self.repeat
        short = min(wanted - (self.slots - self.busy), self._movable())
        if short <= 0:
            return
        pairs = []
        for slot in self._waiting_long():
            key = self.occupant[slot]
            row = self.free_parking.pop()
            pairs.append((slot, row))
            self.parked.pop(slot)
            self.occupant[slot] = None
            del self.slot_of[key]
            self.stored[key] = row
            if len(pairs) == short:
                break
        self._copy(True, pairs)

    def _apply_resumes(self) -> None:
        """Resumed rows go on: on their slots, or from parking into free slots (those that
        find none wait for the next run)."""
        if not self.resumes:
            return
        free = [i for i, o in enumerate(self.occupant) if o is None]
        back, go, later = [], [], []
        for key, tokens, limit in self.resumes:
            if key in self.stored:
                if not free:
                    later.append((key, tokens, limit))
                    continue
                slot = free.pop(0)
                row = self.stored.pop(key)
                self.free_parking.append(row)
                back.append((slot, row))
                self.occupant[slot], self.slot_of[key] = key, slot
            else:
                slot = self.slot_of[key]
                self.parked.pop(slot)
            go.append((slot, tokens, limit))
        self.resumes = later
        if back:
            self._copy(False, back)
        self._feed(go)

    def _feed(self, go: list[tuple[int, np.ndarray, int]], m: int = 0, width: int = 0) -> None:
        """Slots (slot, given tokens, limit) go on: the tokens fed as given from the row's
        next completion column, then sampling until column `limit`. (`m`, `width`: the
        program's shape, for `warm_up`; default: the bucket of `go`'s.)"""
        if not (go or m):
            return
        m = m or _bucket(len(go), self.slots)
        width = width or _bucket(max(max(len(t) for _, t, _ in go), 1), self.n_new)
        idx = np.full(m, self.slots, np.int32)  # past the last slot: nobody
        given = np.full((m, width), self.pad_id, np.int32)
        n_given, limit = np.zeros(m, np.int32), np.zeros(m, np.int32)
        for j, (slot, tokens, end) in enumerate(go):
            idx[j], n_given[j], limit[j] = slot, len(tokens), end
            given[j, : len(tokens)] = tokens
        self.state = _resume(self.state, *(self._put(x) for x in (idx, given, n_given, limit)),
                             mesh=self.mesh)  # fmt: skip

    def _put(self, host: np.ndarray, rows: bool = False) -> np.ndarray | jax.Array:
        """A host array, the same on every process, as an input of the engine's programs:
        replicated, or with `rows` split over the batch shards like the slots. Across
        processes each one places its part on its devices of the mesh."""
        if self.mesh is None:
            return host  # moved with the call that takes it
        where = batch_sharding(self.mesh, host.ndim) if rows else replicated(self.mesh)
        if jax.process_count() == 1:
            return jax.device_put(host, where) if rows else host
        return distributed.place(host, where)

    def _admit_waiting(self, params, version: int) -> None:
        free = [i for i, o in enumerate(self.occupant) if o is None]
        room = len(free) // self.repeat
        if self.in_order:
            n = 0  # groups admitted: in order, while slots last and the version allows
            while n < min(room, len(self.waiting)):
                not_before = self.waiting[n][4]
                if not_before is not None and version < not_before:
                    break
                n += 1
            groups = [self.waiting.popleft() for _ in range(n)]
        else:  # any the version allows, while slots last
            ok = [w for w in self.waiting if w[4] is None or version >= w[4]][:room]
            taken = {id(w) for w in ok}
            self.waiting = collections.deque(w for w in self.waiting if id(w) not in taken)
            groups = ok
        if not groups:
            return
        # Each batch shard prefills the prompts its own slots take (a group cut by a shard's
        # edge is prefilled on both sides): `needed[d]` lists shard d's groups, `source` gives
        # each slot its prompt's index among them.
        per_shard = self.slots // self.ways
        needed: list[list[int]] = [[] for _ in range(self.ways)]
        source = np.full(self.slots, -1, np.int32)
        budget = np.full(self.slots, self.n_new, np.int32)
        given = []  # (slot, tokens, limit) of prompts with given tokens after them
        configured = []  # (slot, RowSampling) on a per-row engine
        for g, (request, _, _, max_new, _, after, row_sampling) in enumerate(groups):
            for r in range(self.repeat):
                slot = free[g * self.repeat + r]
                if len(after):
                    given.append((slot, after, max_new))
                if row_sampling is not None:
                    configured.append((slot, row_sampling))
                shard = needed[slot // per_shard]
                if not shard or shard[-1] != g:
                    shard.append(g)
                source[slot], budget[slot] = len(shard) - 1, max_new
                self.occupant[slot] = (request, r)
                if self.episodes:
                    self.slot_of[(request, r)] = slot
        width = _bucket(max(map(len, needed)), per_shard)
        tokens = np.full((self.ways * width, self.prompt_len), self.pad_id, np.int32)
        mask = np.zeros((self.ways * width, self.prompt_len), bool)
        mask[:, -1] = True  # padding prompts: one token each, taken by no slot
        for d, shard in enumerate(needed):
            for j, g in enumerate(shard):
                tokens[d * width + j], mask[d * width + j] = groups[g][1], groups[g][2]
        self._prefill(params, tokens, mask, source, budget)
        self._configure(configured)
        self._feed(given)  # before any decode step samples in their rows

    def _prefill(self, params, tokens, mask, source, budget) -> None:
        key = jax.random.fold_in(self.key, self.admissions)
        self.admissions += 1
        self.state = _prefill_into(
            self.state,
            self.graphdef,
            params,
            *(self._put(x, rows=True) for x in (tokens, mask)),
            key,
            *(self._put(x, rows=True) for x in (source, budget)),
            n_new=self.n_new,
            interruption=self.interruption,
            mesh=self.mesh,
        )

    def _configure(self, configured: list[tuple[int, RowSampling]], m: int = 0) -> None:
        if not (configured or m):
            return
        m = m or _bucket(len(configured), self.slots)
        idx = np.full(m, self.slots, np.int32)
        temperature, top_p = np.ones(m, np.float32), np.ones(m, np.float32)
        seed = np.zeros((m, 2), np.uint32)
        for j, (slot, rs) in enumerate(configured):
            idx[j], temperature[j], top_p[j], seed[j] = slot, rs.temperature, rs.top_p, rs.seed
        self.state = _configure_rows(self.state, *(self._put(x) for x in (idx, temperature,
                                                                           top_p, seed)),
                                     mesh=self.mesh)  # fmt: skip

    def _collect(self):
        """Free the slots whose rows have finished and start gathering those rows on the
        device; `_hand_back` reads them. Reading the done flags waits for the last decode."""
        done = distributed.to_host(self.state.done)
        step = int(distributed.to_host(self.state.step))
        self.slot_steps += self._dispatched * (step - self.steps)
        self.steps = step
        slots = [
            i for i, o in enumerate(self.occupant)
            if o is not None and done[i] and i not in self.parked
        ]  # fmt: skip
        if not slots:
            return None
        width = _bucket(len(slots), self.slots)
        idx = np.asarray(slots + [slots[0]] * (width - len(slots)), np.int32)
        rows = _take_rows(self.state, self._put(idx))
        owners = [self.occupant[i] for i in slots]
        for i in slots:
            if self.episodes:  # the turn is handed back, the row stays
                self.parked[i] = self.runs
            else:
                self.occupant[i] = None
        return owners, rows

    def _hand_back(self, collected) -> list[Finished]:
        if collected is None:
            return []
        owners, rows = collected
        tokens, mask, logp, versions, finish, lengths, routes, top_ids, top_logp = (
            None if x is None else distributed.to_host(x) for x in rows
        )
        out = []
        for j, (request, row) in enumerate(owners):
            n = int(lengths[j])
            t = tokens[j].copy()
            t[n:] = self.pad_id
            entry = self.prompts[request]
            out.append(
                Finished(request, row, entry[0], entry[1], t, mask[j], logp[j], versions[j],
                         int(finish[j]), n, None if routes is None else routes[j],
                         None if top_ids is None else top_ids[j],
                         None if top_logp is None else top_logp[j])
            )  # fmt: skip
            if self.episodes:  # handed back at every turn's end; forgotten at `release`
                continue
            entry[2] -= 1
            if not entry[2]:  # forgotten once every row was handed back
                del self.prompts[request]
        return out

    def run(self, params, version: int, steps: int) -> list[Finished]:
        """Free the slots of rows that finished, admit what fits, decode up to `steps` steps
        with `params` (tokens tagged `version`), and return the rows freed: those that
        finished by the previous call's last step. One read of the done flags per call; the
        finished rows cross to the host while this call's steps run."""
        self.runs += 1
        collected = self._collect()  # (parked rows' done flags are not read again)
        self._make_room(version)
        self._apply_resumes()
        self._admit_waiting(params, version)
        self._dispatched = self.decoding
        if self.decoding:
            self.state = decode(
                self.graphdef, params, self.state, jnp.int32(version), steps, **self.static
            )
        return self._hand_back(collected)
