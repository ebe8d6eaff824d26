"""On-device generation: batched prefill + chunked decode with a KV cache -> Rollout.

Shapes: B rows, L prompt slots (prompts left-padded), N new-token slots, S = L + N cache slots,
V vocab, D model.

The decode loop is one compiled `lax.while_loop` that runs up to `n` steps (a chunk). Between
chunks the caller may swap in newer parameters and keep the cache (PipelineRL's in-flight
update); every generated token records the policy version that sampled it and its log-prob
under the distribution it was actually drawn from (after temperature / top-k / top-p), which is
what the trainer's importance ratios need. Randomness is `fold_in(key, step)`, so chunking does
not change what is sampled.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_scale.configbase import ConfigError
from jaxrl_scale.generation.config import SamplerConfig, check_sampling, check_thinking_budget
from jaxrl_scale.models.policy import KVCache, Policy, no_routes
from jaxrl_scale.parallel.sharding import LOGICAL_RULES, state_shardings, traced_on

FINISH_REASONS = ("eos", "length", "interrupted")
EOS, LENGTH, INTERRUPTED = range(3)
# A row thinks until it closes its thinking itself (-> CLOSED: it answers freely, no budget) or
# runs over its thinking budget (-> FORCING the interruption text -> ANSWERING within the
# answer budget; such a row finishes "interrupted").
THINKING, FORCING, ANSWERING, CLOSED = range(4)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn (static under jit). temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        check_sampling(self.temperature, self.top_p, self.top_k, key="sampling")


@dataclasses.dataclass(frozen=True)
class Interruption:
    """ScaleRL's forced length interruption: after a thinking budget drawn uniformly from
    [think_min, think_max] tokens without EOS, `token_ids` (e.g. "Okay, time is up. ...
    </think>") are inserted and the row may answer for `answer_budget` more tokens.

    The budget is on thinking only: a row that samples `think_end_ids` (the ids of "</think>")
    itself has closed its thinking and is never interrupted afterwards; it answers until EOS or
    the length limit. Matching is on token ids, exact for a marker the tokenizer keeps as one
    special token (Qwen3's </think>); () turns the check off."""

    token_ids: tuple[int, ...]
    think_min: int
    think_max: int
    answer_budget: int
    think_end_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.token_ids:
            raise ValueError("interruption needs at least one token id")
        check_thinking_budget(self.think_min, self.think_max, self.answer_budget, "interruption")

    @property
    def max_tokens(self) -> int:
        return self.think_max + len(self.token_ids) + self.answer_budget

    @classmethod
    def from_config(cls, cfg: SamplerConfig, tokenizer) -> Interruption | None:
        """The sampler's interruption for `cfg.interruption` (None when off), its texts
        tokenized, checked against the budget: think_max + the text's tokens + answer_budget
        must fit in sampler.max_new_tokens."""
        i = cfg.interruption
        if i is None:
            return None
        encoded = {}
        for name in ("text", "think_end"):
            text = getattr(i, name)
            try:
                encoded[name] = tuple(tokenizer.encode(text)) if text else ()
            except ValueError as e:
                raise ConfigError(
                    f"sampler.interruption.{name}: cannot be tokenized: {e}"
                ) from None
        out = cls(encoded["text"], i.think_min, i.think_max, i.answer_budget, encoded["think_end"])
        if out.max_tokens > cfg.max_new_tokens:
            raise ConfigError(
                f"sampler.max_new_tokens: {cfg.max_new_tokens} is below "
                f"interruption.think_max ({i.think_max}) + the text's {len(encoded['text'])} "
                f"tokens + answer_budget ({i.answer_budget}) = {out.max_tokens}"
            )
        return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rollout:
    """What generation produced. Completion arrays are [B, N]; `completion_mask` is 1 on tokens
    the policy sampled (EOS included), 0 on inserted interruption tokens and padding."""

    prompt_tokens: jax.Array  # [B, L] int32, left-padded
    prompt_mask: jax.Array  # [B, L] bool
    completion_tokens: jax.Array  # [B, N] int32 (pad after the row finished)
    completion_mask: jax.Array  # [B, N] float32
    behavior_logp: jax.Array  # [B, N] float32, 0 where the mask is 0
    versions: jax.Array  # [B, N] int32 policy version per sampled token, -1 elsewhere
    finish_reason: jax.Array  # [B] int32 index into FINISH_REASONS
    lengths: jax.Array  # [B] int32 completion tokens emitted (interruption text included)
    # Router replay (model.router_replay): [B, L + N, routed layers, K] the experts each prompt
    # and completion token was sent to (ModelConfig.route_dtype); None without.
    routes: jax.Array | None = None

    @property
    def interrupted_rate(self) -> float:
        return float(jnp.mean(self.finish_reason == INTERRUPTED))

    def finish_names(self) -> list[str]:
        return [FINISH_REASONS[int(r)] for r in np.asarray(self.finish_reason)]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    cache: KVCache
    h_bd: jax.Array  # final hidden state of each row's latest token, [B, D]
    tokens: jax.Array  # [B, N]
    logp: jax.Array  # [B, N]
    mask: jax.Array  # [B, N]
    versions: jax.Array  # [B, N]
    step: jax.Array  # [] decode steps taken (the sampling randomness is fold_in(key, step))
    # The next completion column: [] one for every row (a static batch), or [B] each row its
    # own (a slot engine's rows, admitted at different steps; see jaxrl_scale.generation.engine).
    col: jax.Array
    position: jax.Array  # [B] position of the next token
    done: jax.Array  # [B]
    finish: jax.Array  # [B]
    phase: jax.Array  # [B] THINKING / FORCING / ANSWERING / CLOSED
    counts: jax.Array  # [B, 4] tokens emitted in each phase
    matched: jax.Array  # [B] leading tokens of the think-end marker just sampled
    think_budget: jax.Array  # [B]
    budget: jax.Array  # [B] the completion column each row ends by (N unless set)
    key: jax.Array
    routes: jax.Array | None = None  # [B, L + N, routed layers, K] with router replay
    # [B] a slot engine's rows with given tokens ahead (an episode's observation, written in
    # their completion columns by the host): a row feeds its own tokens, not sampled ones,
    # while its column is below this (mask 0, no log-prob, version -1). None: never.
    forced_until: jax.Array | None = None
    # Each row its own sampling (a server's requests; `RowSampling`), else None: the static
    # `Sampling` for every row. [B] temperature (0: greedy), [B] top-p, [B, 2] uint32 seed: a
    # row's token at column c is drawn with fold_in(its seed, c), so its tokens depend on its
    # seed alone, not on which rows decode beside it or when it was admitted.
    row_temperature: jax.Array | None = None
    row_top_p: jax.Array | None = None
    row_seed: jax.Array | None = None
    # [B, N, K] the K most probable tokens at each column and their log-probs (of the
    # distribution sampled from), or None: not recorded.
    top_ids: jax.Array | None = None
    top_logp: jax.Array | None = None


# --------------------------------------------------------------------------- sampling


def sample_token(logits_bv, key, sampling: Sampling):
    """(token [B], log-prob [B]) from float32 logits under temperature, top-k and top-p.

    The log-prob is of the distribution actually sampled from (renormalised after truncation);
    greedy (temperature 0) takes the argmax and reports its temperature-1 log-prob.
    """
    if sampling.temperature == 0:
        token_b = jnp.argmax(logits_bv, axis=-1)
        logp_bv = jax.nn.log_softmax(logits_bv, axis=-1)
    else:
        logits_bv = logits_bv / sampling.temperature
        if sampling.top_k:
            kth_b1 = jax.lax.top_k(logits_bv, sampling.top_k)[0][:, -1:]
            logits_bv = jnp.where(logits_bv < kth_b1, -jnp.inf, logits_bv)
        if sampling.top_p < 1:
            sorted_bv = -jnp.sort(-logits_bv, axis=-1)
            probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
            before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv  # mass strictly above
            kept_bv = jnp.where(before_bv < sampling.top_p, sorted_bv, jnp.inf)
            cutoff_b1 = jnp.min(kept_bv, axis=-1, keepdims=True)
            logits_bv = jnp.where(logits_bv < cutoff_b1, -jnp.inf, logits_bv)
        logp_bv = jax.nn.log_softmax(logits_bv, axis=-1)
        token_b = jax.random.categorical(key, logits_bv, axis=-1)
    logp_b = jnp.take_along_axis(logp_bv, token_b[:, None], axis=-1)[:, 0]
    return token_b.astype(jnp.int32), logp_b


def sample_rows(logits_bv, seed_b2, col_b, temperature_b, top_p_b):
    """(token [B], log-prob [B], log-probs [B, V]) with each row's own temperature (0:
    greedy, the temperature-1 log-prob reported, as `sample_token`), top-p and seed: row b's
    draw is keyed by fold_in(seed_b, col_b) alone. The log-probs are of the distribution each
    row samples from (renormalised after truncation)."""
    greedy_b = temperature_b <= 0
    scaled_bv = logits_bv / jnp.where(greedy_b, 1.0, temperature_b)[:, None]
    sorted_bv = -jnp.sort(-scaled_bv, axis=-1)
    probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
    before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv  # mass strictly above
    kept_bv = jnp.where(before_bv < top_p_b[:, None], sorted_bv, jnp.inf)
    cutoff_b1 = jnp.min(kept_bv, axis=-1, keepdims=True)
    truncate_b1 = ((top_p_b < 1) & ~greedy_b)[:, None]
    scaled_bv = jnp.where(truncate_b1 & (scaled_bv < cutoff_b1), -jnp.inf, scaled_bv)
    logp_bv = jax.nn.log_softmax(scaled_bv, axis=-1)
    keys_b = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.wrap_key_data(s), c))(
        seed_b2, col_b
    )
    drawn_b = jax.vmap(jax.random.categorical)(keys_b, scaled_bv)
    token_b = jnp.where(greedy_b, jnp.argmax(logits_bv, axis=-1), drawn_b).astype(jnp.int32)
    logp_b = jnp.take_along_axis(logp_bv, token_b[:, None], axis=-1)[:, 0]
    return token_b, logp_b, logp_bv


# --------------------------------------------------------------------------- prefill / decode


def _constrain_batch(x, mesh: Mesh | None, axis: int):
    """`x` split over the mesh's batch axes along `axis` (left alone if it does not divide)."""
    if mesh is None:
        return x
    axes = LOGICAL_RULES["batch"]
    ways = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
    if x.shape[axis] % ways:
        return x
    spec = [None] * x.ndim
    spec[axis] = axes
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


@functools.partial(jax.jit, static_argnames=("graphdef", "n_new", "interruption", "mesh", "repeat"))
def prefill(
    graphdef, params, prompt_tokens, prompt_mask, key, *, n_new, interruption, mesh, repeat=1
):
    """Run the prompts through the model into a fresh cache; returns the DecodeState. With
    `repeat` = G, each prompt is run once and its cache copied to G consecutive rows."""
    model = nnx.merge(graphdef, params)
    p, length = prompt_tokens.shape
    b = p * repeat
    # Rows are split over the mesh's batch axes as soon as they exist. Prompts that are the
    # rows (repeat 1), layer by layer: straight into the full cache. Otherwise (a scanned
    # forward, `ModelConfig.scan_prompts`, or prompts copied into G rows each) into a
    # prompt-sized cache, whose rows are repeated and split before each layer's keys and
    # values are widened by the completion's columns: widened first, every device would
    # hold a full-length cache of every prompt.
    scan = model.cfg.scan_prompts
    direct = not scan and repeat == 1
    cache = KVCache.empty(model.cfg, p, length + n_new if direct else length, stacked=scan)
    split = lambda x: _constrain_batch(x, mesh, 0)  # noqa: E731
    if direct:
        cache = jax.tree.map(split, cache)
    positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)
    with traced_on(mesh):
        h_btd, cache, chosen = model.extend(
            cache, prompt_tokens, positions, prompt_mask, 0, scan=scan, return_routes=True
        )
    if not direct:
        # One [rows, K, S, E] array per layer (a scanned forward's stack, unstacked).
        cache = KVCache(k=tuple(cache.k), v=tuple(cache.v), valid=cache.valid)
        rows = lambda x: split(jnp.repeat(x, repeat, axis=0) if repeat > 1 else x)  # noqa: E731
        cache, h_btd, prompt_mask, chosen = jax.tree.map(rows, (cache, h_btd, prompt_mask, chosen))
        widen = lambda x: split(jnp.pad(x, ((0, 0), (0, 0), (0, n_new), (0, 0))))  # noqa: E731
        cache = KVCache(
            k=tuple(widen(x) for x in cache.k),
            v=tuple(widen(x) for x in cache.v),
            valid=split(jnp.pad(cache.valid, ((0, 0), (0, n_new)))),
        )
    routes = prompt_routes(model.cfg, chosen, n_new)
    key, budget_key = jax.random.split(key)
    if interruption is None:
        think_budget = jnp.full((b,), n_new + 1, jnp.int32)  # never reached
    else:
        think_budget = jax.random.randint(
            budget_key, (b,), interruption.think_min, interruption.think_max + 1, jnp.int32
        )
    zeros = jnp.zeros((b, n_new))
    state = DecodeState(
        cache=cache,
        h_bd=h_btd[:, -1],
        tokens=jnp.zeros((b, n_new), jnp.int32),
        logp=zeros,
        mask=zeros,
        versions=jnp.full((b, n_new), -1, jnp.int32),
        step=jnp.zeros((), jnp.int32),
        col=jnp.zeros((), jnp.int32),
        position=jnp.sum(prompt_mask, axis=1).astype(jnp.int32),
        done=jnp.zeros((b,), jnp.bool_),
        finish=jnp.full((b,), LENGTH, jnp.int32),
        phase=jnp.full((b,), THINKING, jnp.int32),
        counts=jnp.zeros((b, 4), jnp.int32),
        matched=jnp.zeros((b,), jnp.int32),
        think_budget=think_budget,
        budget=jnp.full((b,), n_new, jnp.int32),
        key=key,
        routes=routes,
    )
    # Every row-indexed leaf split over the batch axes, as decode returns them: a state laid
    # out otherwise would compile the second chunk's decode again for its new placement.
    return jax.tree.map(lambda x: _constrain_batch(x, mesh, 0) if x.ndim else x, state)


def prompt_routes(cfg, chosen_pltk, n_new: int):
    """A decode state's routes from the prompts' [P, L, routed layers, K]: theirs, then the N
    completion columns', which decoding fills (None without router replay)."""
    if not cfg.router_replay:
        return None
    p = chosen_pltk.shape[0]
    return jnp.concatenate(
        [chosen_pltk.astype(cfg.route_dtype), no_routes((p, n_new, cfg.routed_layers), cfg)], 1
    )


def _decode_step(
    model: Policy, s: DecodeState, version, *, sampling, eos_ids, pad_id, interruption, prompt_len
):
    n_new = s.tokens.shape[1]
    logits_bv = model.logits(s.h_bd)
    logp_bv = None
    if s.row_temperature is not None:  # each row its own sampling and seed
        col_b = jnp.broadcast_to(s.col, s.done.shape)
        sampled_b, logp_b, logp_bv = sample_rows(
            logits_bv, s.row_seed, col_b, s.row_temperature, s.row_top_p
        )
    else:
        sampled_b, logp_b = sample_token(logits_bv, jax.random.fold_in(s.key, s.step), sampling)
    active = ~s.done
    forcing = active & (s.phase == FORCING)
    if interruption is not None:
        forced_ids = jnp.asarray(interruption.token_ids, jnp.int32)
        forced_b = forced_ids[jnp.minimum(s.counts[:, FORCING], len(interruption.token_ids) - 1)]
        token_b = jnp.where(forcing, forced_b, sampled_b)
    else:
        token_b = sampled_b
    col = s.col
    if s.forced_until is not None:  # an observation's tokens go into the cache as given
        fed = active & (col < s.forced_until)
        given_b = s.tokens[jnp.arange(col.shape[0]), jnp.minimum(col, n_new - 1)]
        token_b = jnp.where(fed, given_b, token_b)
        forcing = forcing | fed
    token_b = jnp.where(active, token_b, pad_id)
    sampled = active & ~forcing
    if col.ndim:  # each row at its own column (a finished row's may be past the end: dropped)
        at = (jnp.arange(col.shape[0]), col)
        put = lambda x, v: x.at[at].set(v, mode="drop")  # noqa: E731
    else:
        put = lambda x, v: x.at[:, col].set(v)  # noqa: E731
    tokens = put(s.tokens, token_b)
    logp = put(s.logp, jnp.where(sampled, logp_b, 0.0))
    mask = put(s.mask, sampled.astype(jnp.float32))
    versions = put(s.versions, jnp.where(sampled, version, -1))
    top_ids, top_logp = s.top_ids, s.top_logp
    if top_ids is not None:  # the K most probable tokens of what was sampled from
        if logp_bv is None:
            logp_bv = jax.nn.log_softmax(logits_bv, axis=-1)
        best_bk, ids_bk = jax.lax.top_k(logp_bv, top_ids.shape[2])
        top_ids = put(top_ids, ids_bk.astype(top_ids.dtype))
        top_logp = put(top_logp, best_bk)

    counts = s.counts + (active[:, None] & (s.phase[:, None] == jnp.arange(4))).astype(jnp.int32)
    is_eos = sampled & jnp.isin(token_b, jnp.asarray(eos_ids, jnp.int32))
    phase, matched = s.phase, s.matched
    if interruption is not None:
        thinking = phase == THINKING
        if interruption.think_end_ids:
            end = jnp.asarray(interruption.think_end_ids, jnp.int32)
            extends = token_b == end[jnp.minimum(matched, len(end) - 1)]
            matched = jnp.where(extends, matched + 1, (token_b == end[0]).astype(jnp.int32))
            matched = jnp.where(sampled & thinking, matched, 0)
            closed = thinking & (matched >= len(end))
        else:
            closed = jnp.zeros_like(thinking)
        over_budget = thinking & ~closed & (counts[:, THINKING] >= s.think_budget) & ~is_eos
        forced_all = (phase == FORCING) & (counts[:, FORCING] >= len(interruption.token_ids))
        phase = jnp.select(
            [closed, over_budget, forced_all], [CLOSED, FORCING, ANSWERING], default=phase
        )
        answered = (phase == ANSWERING) & (counts[:, ANSWERING] >= interruption.answer_budget)
    else:
        answered = jnp.zeros_like(is_eos)
    full = col + 1 >= jnp.minimum(s.budget, n_new)
    finishing = active & (is_eos | answered | full)
    forced = (phase == FORCING) | (phase == ANSWERING)
    reason = jnp.where(forced, INTERRUPTED, jnp.where(is_eos, EOS, LENGTH))
    finish = jnp.where(finishing, reason, s.finish)

    h_btd, cache, chosen = model.extend(
        s.cache,
        token_b[:, None],
        s.position[:, None],
        active[:, None],
        prompt_len + col,
        return_routes=True,
    )
    routes = s.routes
    if routes is not None:  # the experts the token just fed went to, at its column
        chosen = chosen[:, 0].astype(routes.dtype)
        if col.ndim:
            routes = routes.at[jnp.arange(col.shape[0]), prompt_len + col].set(chosen, mode="drop")
        else:
            routes = routes.at[:, prompt_len + col].set(chosen)
    return DecodeState(
        cache=cache,
        # A finished row keeps its last token's state (an episode's row resumed without an
        # observation samples its next turn from it); a pad fed for it is masked out.
        h_bd=jnp.where(active[:, None], h_btd[:, 0], s.h_bd),
        tokens=tokens,
        logp=logp,
        mask=mask,
        versions=versions,
        step=s.step + 1,
        col=col + active.astype(jnp.int32) if col.ndim else col + 1,
        position=s.position + active.astype(jnp.int32),
        done=s.done | finishing,
        finish=finish,
        phase=phase,
        counts=counts,
        matched=matched,
        think_budget=s.think_budget,
        budget=s.budget,
        key=s.key,
        routes=routes,
        forced_until=s.forced_until,
        row_temperature=s.row_temperature,
        row_top_p=s.row_top_p,
        row_seed=s.row_seed,
        top_ids=top_ids,
        top_logp=top_logp,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "graphdef",
        "sampling",
        "eos_ids",
        "pad_id",
        "interruption",
        "prompt_len",
        "mesh",
    ),
    donate_argnames=("state",),
)
def decode(
    graphdef,
    params,
    state: DecodeState,
    version,
    max_steps,
    *,
    sampling,
    eos_ids,
    pad_id,
    interruption,
    prompt_len,
    mesh=None,
):
    """Up to `max_steps` decode steps (a chunk), stopping early when every row is done (a
    static batch also stops at its last column; a slot engine's rows each stop at their own).
    `mesh`: the one the state and parameters live on (traced on it: `sharding.traced_on`)."""
    model = nnx.merge(graphdef, params)
    step_fn = functools.partial(
        _decode_step,
        model,
        sampling=sampling,
        eos_ids=eos_ids,
        pad_id=pad_id,
        interruption=interruption,
        prompt_len=prompt_len,
    )
    limit = state.step + max_steps
    if not state.col.ndim:
        limit = jnp.minimum(limit, state.tokens.shape[1])

    def cond(s):
        return (s.step < limit) & ~jnp.all(s.done)

    with traced_on(mesh):
        return jax.lax.while_loop(cond, lambda s: step_fn(s, version), state)


def to_rollout(prompt_tokens, prompt_mask, state: DecodeState) -> Rollout:
    return Rollout(
        prompt_tokens=prompt_tokens,
        prompt_mask=prompt_mask,
        completion_tokens=state.tokens,
        completion_mask=state.mask,
        behavior_logp=state.logp,
        versions=state.versions,
        finish_reason=state.finish,
        lengths=jnp.sum(state.counts, axis=1),
        routes=state.routes,
    )


def prompt_width(longest: int, cap: int | None = None) -> int:
    """Columns to pad prompts of up to `longest` tokens to: the next power of two times 8, at
    most `cap` (the longest prompt there will be) rounded up to 8. A run then compiles its
    prefill, decode and train step for a few prompt widths, not one per multiple of 8."""
    width = 8 << (max(-(-longest // 8), 1) - 1).bit_length()
    if cap is not None:
        width = min(width, -(-max(longest, cap) // 8) * 8)
    return width


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, width: int | None = None):
    """Left-pad token-id lists to `width` columns (None: the longest rounded up to 8):
    (tokens, mask) numpy."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    longest = max(len(p) for p in prompts)
    length = -(-longest // 8) * 8 if width is None else width
    if longest > length:
        raise ValueError(f"a prompt of {longest} tokens does not fit in {length} columns")
    tokens = np.full((len(prompts), length), pad_id, np.int32)
    mask = np.zeros((len(prompts), length), bool)
    for i, p in enumerate(prompts):
        tokens[i, length - len(p) :] = p
        mask[i, length - len(p) :] = True
    return tokens, mask


def generate(
    model: Policy,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    key=None,
    eos_ids: Sequence[int] = (),
    pad_id: int = 0,
    chunk_size: int | None = None,
    interruption: Interruption | None = None,
    version: int = 0,
    mesh: Mesh | None = None,
) -> Rollout:
    """Sample completions for `prompts` (lists of token ids).

    `chunk_size` splits decoding into compiled chunks of that many steps (the same tokens as
    one chunk); with `mesh`, parameters and the batch are placed on it first.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if interruption is not None and interruption.max_tokens > max_new_tokens:
        raise ValueError(
            f"max_new_tokens ({max_new_tokens}) is below the interruption's think_max + text + "
            f"answer_budget ({interruption.max_tokens})"
        )
    sampling = Sampling(temperature, top_p, top_k)
    key = jax.random.key(0) if key is None else key
    tokens, mask = pad_prompts(prompts, pad_id)
    graphdef, params = nnx.split(model)
    if mesh is not None:
        params = jax.device_put(params, state_shardings(params, mesh))
        batch = NamedSharding(mesh, PartitionSpec(LOGICAL_RULES["batch"], None))
        tokens, mask = jax.device_put((tokens, mask), batch)
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    state = prefill(
        graphdef,
        params,
        tokens,
        mask,
        key,
        n_new=max_new_tokens,
        interruption=interruption,
        mesh=mesh,
    )
    chunk = chunk_size or max_new_tokens
    static = dict(
        sampling=sampling,
        eos_ids=tuple(int(i) for i in eos_ids),
        pad_id=pad_id,
        interruption=interruption,
        prompt_len=tokens.shape[1],
        mesh=mesh,
    )
    for _ in range(num_chunks(max_new_tokens, chunk_size)):
        state = decode(graphdef, params, state, version, chunk, **static)
    return to_rollout(tokens, mask, state)


def num_chunks(max_new_tokens: int, chunk_size: int | None) -> int:
    """Decode chunks for a budget. The host dispatches every chunk without reading anything
    back: once all rows are done, a chunk's on-device loop condition exits at once."""
    return -(-max_new_tokens // (chunk_size or max_new_tokens))
