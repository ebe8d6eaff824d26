"""Packed train steps: a batch's real tokens laid out in rows of a fixed length, so the step
computes close to the tokens that exist instead of every completion slot up to the budget.

A padded batch (step.Batch) is P prompts x G completions, [B, L] prompt slots and [B, N]
completion slots; RL completions are heavy-tailed, so most of the [B, N] slots are padding.
`pack` lays the same sequences out as R rows of S tokens (R bucketed, S fixed):

  row: | prompt p | completion b | completion b+1 | ... | prompt p' | completion b' | ... | pad |
         segment 0 (sub 0, 1, 2, ...)                     segment 1

A segment is one prompt followed by those of its completions that share its row: completions
go to rows first-fit, longest first, and pay for their prompt only in a row that holds none of
their group yet (so a group that fits one row runs its prompt once, as the padded step does;
one spread over rows repeats its prompt in each). The attention mask
(attention.py, `segments`) lets each completion see its own prompt and itself only, and
positions restart per sequence: prompt 0..l-1, each completion l, l+1, ..., so every
completion token sees exactly the context, at exactly the positions, of the padded step.

Completion token n of sequence b is scored from the hidden state of the token before it (its
prompt's last token for n = 0): `prev` holds that position. The loss stays per token in this
layout; `seq` names each token's completion, and the per-sequence quantities (token counts,
GSPO's sequence ratio, the aggregation weights) are segment sums over it (losses.py), so the
packed step's loss, gradients and metrics equal the padded step's to float rounding.

Rows come in a few compiled shapes (`step_rows`): a batch runs as m micro-steps, as few as
hold its rows within a token budget per batch shard (`PackGeometry.of`: at most
`rows_per_micro` rows each), each of R / m rows rounded up to the next of six rungs, the
budget's rows and its halves down to a 32nd (`MICRO_RUNGS`), so a run compiles at most six
steps within one micro-step, and one more per number of micro-steps past it (seven over
every batch size at the demo's shapes on one device, where a ladder of four shapes per
doubling allowed 28), and a batch of short completions costs at most twice the rows it
fills: a micro-step is never rounded up to the budget's rows (it was: at the demo's
shapes, 32 x 16 completions of ~3 tokens under a 192-token budget, the packed step computed
the padded step's 102,400 positions for 1,908 tokens).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_scale.generation.sampler import prompt_width
from jaxrl_scale.models import policy as model_lib
from jaxrl_scale.models.attention import resolve
from jaxrl_scale.parallel import distributed
from jaxrl_scale.rl.compute import attention_flops, matmul_params


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """B = P x G completions packed into R rows of S token positions (every leaf [R, S])."""

    tokens: jax.Array  # int32: prompt and completion tokens, 0 in padding
    positions: jax.Array  # int32: RoPE positions, restarting per sequence
    valid: jax.Array  # bool: a real token
    seg: jax.Array  # int32: segment number within the row (rising; padding: one past the last)
    sub: jax.Array  # int32: 0 for the segment's prompt, 1, 2, ... for its completions
    prev: jax.Array  # int32: the position whose hidden state predicts this token
    seq: jax.Array  # int32: the completion b (0..B-1) a token belongs to, B elsewhere
    loss_mask: jax.Array  # float32: sampled tokens of kept rows
    behavior_logp: jax.Array  # float32
    adv: jax.Array  # float32: the token's completion's advantage
    num_seqs: int = dataclasses.field(metadata=dict(static=True))  # B
    routes: jax.Array | None = None  # [R, S, routed layers, K]: router replay (step.Batch)

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape

    @classmethod
    def shapes(cls, rows: int, row_len: int, num_seqs: int, model=None) -> PackedBatch:
        """Shapes and dtypes of a packed batch (e.g. to derive its shardings before one
        exists); `model` as in `step.Batch.shapes`."""
        s = lambda dtype: jax.ShapeDtypeStruct((rows, row_len), dtype)  # noqa: E731
        i32, f32 = jnp.int32, jnp.float32
        return cls(
            s(i32), s(i32), s(jnp.bool_), s(i32), s(i32), s(i32), s(i32), s(f32), s(f32),
            s(f32), num_seqs=num_seqs, routes=model_lib.route_shapes(model, rows, row_len),
        )  # fmt: skip


_LADDER = (1, 1.25, 1.5, 1.75)  # x 2^k: 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, ...


def bucket_rows(rows: int, multiple: int = 1) -> int:
    """The compiled row count for `rows` rows without a micro-step budget (`step_rows`): a
    multiple of `multiple` (row shards x micro-steps), `multiple` times the next of 1, 2, 3,
    4, 5, 6, 7, 8, 10, 12, 14, 16, 20, ... (four shapes per doubling: at most 1.25x the rows
    needed beyond 4 units)."""
    units = max(1, math.ceil(rows / multiple))
    scale = 1
    while True:
        for step in _LADDER:
            if step * scale >= units and float(step * scale).is_integer():
                return int(step * scale) * multiple
        scale *= 2


# The row counts a micro-step compiles in: the budget's rows and each half of them, this many
# (a batch's rows, rounded up to the next, cost at most twice what they hold, or a 32nd of a
# budget's rows when they hold less).
MICRO_RUNGS = 6


def step_rows(rows: int, multiple: int = 1, per_micro: int | None = None) -> int:
    """The compiled row count R for `rows` packed rows: m = ceil(rows / per_micro)
    micro-steps (1 without `per_micro`: then `bucket_rows`), each of ceil(rows / m) rows
    rounded up to the next of `MICRO_RUNGS` sizes, per_micro / 2^i (i = 5, ..., 0) in whole
    multiples of `multiple` (per_micro is a multiple of it). A run's batches so compile at
    most MICRO_RUNGS shapes of one micro-step, and past the budget (m > 1: over half a
    budget in each) the top rung, or for an odd budget the one below it: a shape or two per
    m. `micro_steps(R, per_micro)` gives m back, and R splits into m equal micro-steps."""
    if not per_micro:
        return bucket_rows(rows, multiple)
    m = micro_steps(max(rows, 1), per_micro)
    each = -(-rows // m)  # rows in each micro-step
    units, top = -(-each // multiple), max(1, per_micro // multiple)  # of `multiple` rows
    rungs = sorted({-(-top // 2**i) for i in range(MICRO_RUNGS)})
    return m * multiple * next((r for r in rungs if r >= units), top)


def micro_steps(rows: int, per_micro: int) -> int:
    """Micro-steps of a packed batch of `rows` compiled rows (`step_rows`) under a budget of
    `per_micro` rows each: ceil(rows / per_micro)."""
    return -(-rows // per_micro)


def default_row_len(padded_row: int, block: int) -> int:
    """Twice the widest padded row (prompt slots + completion budget), cut down to whole
    attention blocks where that leaves room for the widest padded row, rounded up to 8: the
    longest completion always fits, a row holds a group's typical completions behind one
    prompt, and the blockwise attention's blocks line up with the row. Measured
    (benchmarks/bench_packing.py, padded rows of 576, blocks of 512): rows of 576 ran 2.3x
    faster than padded, 1,152 2.5x, 1,024 3.8x."""
    row = 2 * padded_row
    if row > block:
        row = max(row // block * block, padded_row)
    return -(-row // 8) * 8


# What a packed step gives up: packed rows carry segments, which only the blockwise (or the
# dense) attention honours, while a padded step's self-attention runs cuDNN's fused kernel on
# GPUs and splash on TPUs. Assumed speed of those kernels' attention over the blockwise one's
# (FlashAttention-class kernels run attention 2-4x faster than a blockwise loop of XLA ops; the
# low end, so `auto` errs towards the kernel); measure on the accelerator before trusting more.
FUSED_ATTENTION_SPEEDUP = 2.0
# The least fraction of the padded step's cost `auto` must save to pack a batch: each packed
# row count is a compiled shape of its own, and a saving in the noise is not worth one.
MIN_SAVING = 0.05


@dataclasses.dataclass(frozen=True)
class PackGeometry:
    """A run's packed rows: their length, the multiple row counts are rounded to (the batch
    shards), the most rows a micro-step holds (None: one slice; `of` always sets it; see
    `step_rows`), whether each batch picks the layout
    that costs less (`auto`, train.packing: auto) rather than always packing, and the cost
    model `auto` compares the layouts with (`cost`)."""

    row_len: int
    row_multiple: int
    rows_per_micro: int | None
    auto: bool = False
    matmul_flops: float = 1.0  # per position (2 x the model's matmul weights)
    attention_flops: float = 0.0  # per query-key pair (compute.attention_flops)
    padded_speedup: float = 1.0  # the padded step's attention kernel against blockwise

    @classmethod
    def of(cls, cfg, longest_prompt: int, ways: int) -> PackGeometry:
        """From `cfg.train` (packing, pack_length, tokens_per_micro_batch, micro_batches), the
        widest prompt and the trainer's batch shards (`ways`).

        Micro-steps are cut from the packed rows by a token budget per batch shard:
        `train.tokens_per_micro_batch`, else what one of the padded step's micro-steps holds
        (its rows per shard x the padded row), so a packed batch of short completions runs
        as few micro-steps as its rows need, each no bigger than a padded one and no bigger
        than the rows it holds rounded up to the next of `step_rows`' rungs. Rows are
        `train.pack_length` long, else `default_row_len` cut to the budget.
        `train.packing: auto` keeps the padded step as a choice only where its micro-steps
        hold no more positions per shard than the budget allows."""
        t, m = cfg.train, cfg.model
        padded_row = prompt_width(longest_prompt, longest_prompt) + cfg.sampler.max_new_tokens
        padded_micro = t.prompts_per_step * t.group_size // t.micro_batches // ways * padded_row
        budget = t.tokens_per_micro_batch or padded_micro
        row_len = t.pack_length
        if not row_len:
            row_len = default_row_len(padded_row, m.attention_block_size)
            row_len = min(row_len, max(padded_row, budget // 8 * 8))
        rows_per_micro = max(1, budget // row_len) * ways
        auto = t.packing == "auto" and padded_micro <= budget
        kernel = resolve(m.attention, queries=padded_row, keys=padded_row,
                         block_size=m.attention_block_size, dtype=m.dtype, query_offset=0,
                         head_dim=m.resolved_head_dim)  # fmt: skip
        fused = FUSED_ATTENTION_SPEEDUP if kernel in ("cudnn", "splash") else 1.0
        return cls(row_len, ways, rows_per_micro, auto,
                   2.0 * matmul_params(m), float(attention_flops(m)), fused)  # fmt: skip

    def cost(self, positions: int, pairs: float, *, padded: bool) -> float:
        """A step's forward cost in blockwise-attention FLOPs: its positions' matmuls and its
        attended query-key pairs, the padded step's at its kernel's speed."""
        attention = self.attention_flops * pairs
        return self.matmul_flops * positions + (attention / self.padded_speedup if padded
                                                else attention)  # fmt: skip

    def pack(self, batch, group_size: int, alone=None) -> tuple[PackedBatch, dict[str, int]]:
        """`pack` in these rows, and the metrics row's train_tokens / train_positions (with
        `alone`, also how many of them were packed and left out: `alone`, `alone_left`)."""
        packed, stats = pack(batch, group_size, self.row_len, row_multiple=self.row_multiple,
                             rows_per_micro=self.rows_per_micro, alone=alone)  # fmt: skip
        out = {
            "train_tokens": stats.train_tokens,
            "train_positions": stats.train_positions,
            "train_packed": 1,
        }
        if alone is not None:
            out.update(alone=stats.alone, alone_left=stats.alone_left)
        return packed, out

    def costs(self, batch, group_size: int, padded_positions: int, packed_positions: int):
        """(packed, padded) costs of a batch (`cost`): the positions each computes, and the
        query-key pairs its attention scores: a padded row's prompt once per group and its
        completion's keys; a packed row's whole causal triangle (an upper bound for the
        blockwise kernel, which skips only blocks hidden in every row)."""
        b, n = np.shape(batch.tokens)
        p, width = b // group_size, np.shape(batch.prompt_tokens)[1]
        padded_pairs = p * width * (width + 1) / 2 + b * (n * width + n * (n + 1) / 2)
        packed_pairs = packed_positions // self.row_len * self.row_len * (self.row_len + 1) / 2
        return (
            self.cost(packed_positions, packed_pairs, padded=False),
            self.cost(padded_positions, padded_pairs, padded=True),
        )

    def layout(self, batch, group_size: int, padded: dict[str, int], alone=None):
        """(the batch the step computes, its metrics): packed, or with `auto` the padded
        `batch` where packing would not save `MIN_SAVING` of the padded step's cost
        (`costs`, the padded step's fused kernel counted at its speed). Sequences `alone`
        (`pack`) exist only packed: a batch with any is packed."""
        packed, stats = self.pack(batch, group_size, alone)
        if self.auto and not alone:
            cost = self.costs(batch, group_size, padded["train_positions"],
                              stats["train_positions"])  # fmt: skip
            if cost[0] > (1 - MIN_SAVING) * cost[1]:
                return batch, padded
        return packed, stats


def padded_layout(rollout, group_size: int) -> dict[str, int]:
    """train_tokens / train_positions of the padded step on a rollout (sampler.Rollout):
    each prompt's real tokens once for its group plus every emitted completion token, against
    P x L prompt slots plus B x N completion slots."""
    prompts = np.asarray(distributed.to_host(rollout.prompt_mask))[::group_size]
    completions = int(np.asarray(distributed.to_host(rollout.lengths)).sum())
    return {
        "train_tokens": int(prompts.sum()) + completions,
        "train_positions": prompts.size + int(np.prod(rollout.completion_tokens.shape)),
        "train_packed": 0,
    }


@dataclasses.dataclass(frozen=True)
class Alone:
    """A sequence packed as a segment of its own that counts as completion `seq`'s (`pack`):
    its tokens, where they train, their behaviour log-probs (host arrays of one length)."""

    seq: int
    tokens: np.ndarray
    loss_mask: np.ndarray
    behavior_logp: np.ndarray


@dataclasses.dataclass(frozen=True)
class PackStats:
    """What a packing kept and computed (every count is tokens)."""

    rows: int  # rows the packing needed
    bucket: int  # rows computed (rows rounded up to a compiled shape)
    row_len: int
    train_tokens: int  # real prompt and completion tokens in the rows (prompts once per segment)
    segments: int
    prompt_repeats: int  # segments beyond one per group: prompts run again for a split group
    alone: int = 0  # sequences of their own packed (`pack`'s `alone`)
    alone_left: int = 0  # ... left out: longer than a row
    alone_split: int = 0  # completions whose sequences of their own went to other rows

    @property
    def train_positions(self) -> int:
        return self.bucket * self.row_len


def pack(
    batch,
    group_size: int,
    row_len: int,
    *,
    row_multiple: int = 1,
    rows_per_micro: int | None = None,
    share_prompt: bool = True,
    alone: list[Alone] | None = None,
) -> tuple[PackedBatch, PackStats]:
    """Lay a padded batch (step.Batch of host numpy arrays) out in packed rows of `row_len`.

    Completions go to rows first-fit, longest first, each row's completions of one group
    behind one copy of their prompt (`share_prompt`; else one prompt per completion), and the
    row count is rounded up by `step_rows(.., row_multiple, rows_per_micro)`. Completions
    without tokens (length 0) have nothing to score and take no space. Raises ValueError
    naming the sequence when a prompt and one of its completions do not fit in a row.

    `alone`: sequences that belong to completion b's sample without continuing its prompt (an
    agent episode's other branches, rl/agents.py), each a segment of its own (its tokens see
    only each other, positions from 0), its tokens counted as b's (`seq`: b's token counts,
    sequence ratio and aggregation weight include them) with b's advantage. They go in b's
    row, so one micro-step holds all of b's tokens; where b and its sequences do not fit in
    one row, they are placed first-fit on their own (`PackStats.alone_split`: a sequence
    ratio is then taken per micro-step over the part each holds). One longer than a row is
    left out (`PackStats.alone_left`)."""
    prompt_tokens = np.asarray(batch.prompt_tokens)
    prompt_mask = np.asarray(batch.prompt_mask, bool)
    tokens = np.asarray(batch.tokens)
    lengths = np.asarray(batch.mask, bool).sum(axis=1)
    b_total = tokens.shape[0]
    if b_total % group_size:
        raise ValueError(f"{b_total} completions do not split into groups of {group_size}")

    prompt_len = prompt_mask[::group_size].sum(axis=1)
    # First-fit decreasing over completions, longest first: each goes to the first row with
    # room for it, plus its prompt when the row holds none of its group yet. A row's
    # completions of one group then form one segment behind one copy of their prompt.
    alone = [a for a in alone or () if len(a.tokens)]
    if alone and batch.routes is not None:
        raise ValueError("packed sequences of their own carry no recorded experts (routes)")
    left = [a for a in alone if len(a.tokens) > row_len]
    alone = [a for a in alone if len(a.tokens) <= row_len]
    # A completion and its sequences of their own go to one row where they fit together, so
    # a micro-step (a slice of rows) holds all of a sequence's tokens (GSPO's sequence ratio,
    # the sequence mismatch mask); where they do not, the others are placed on their own.
    theirs: dict[int, list[int]] = {}
    for i, a in enumerate(alone):
        theirs.setdefault(int(a.seq), []).append(i)
    extra = {b: sum(len(alone[i].tokens) for i in ids) for b, ids in theirs.items()}
    items, split = [], 0
    for b in np.flatnonzero(lengths):
        b = int(b)
        together = int(prompt_len[b // group_size]) + int(lengths[b]) + extra.get(b, 0)
        if b in theirs and together > row_len:
            items += [(len(alone[i].tokens), 1, i) for i in theirs.pop(b)]
            split += 1
        items.append((int(lengths[b]) + (extra[b] if b in theirs else 0), 0, b))
    items += [(len(alone[i].tokens), 1, i) for b, ids in theirs.items() if not lengths[b]
              for i in ids]  # fmt: skip
    used: list[int] = []
    placed: list[dict[int, list[int]]] = []  # per row: group -> its completions there
    own: list[list[int]] = []  # per row: the `alone` sequences there
    for n, kind, b in sorted(items, key=lambda item: -item[0]):
        if kind == 1:  # a sequence of its own: no prompt to share
            r = next((r for r in range(len(placed)) if used[r] + n <= row_len), len(placed))
            if r == len(placed):
                used.append(0)
                placed.append({})
                own.append([])
            used[r] += n
            own[r].append(b)
            continue
        g = b // group_size
        l_p = int(prompt_len[g])
        if l_p + n > row_len:
            raise ValueError(
                f"train.pack_length {row_len} is shorter than prompt {g} ({l_p} tokens) plus "
                f"its completion {b} ({n} tokens)"
            )
        for r, groups in enumerate(placed):
            cost = n + (0 if share_prompt and g in groups else l_p)
            if used[r] + cost <= row_len:
                break
        else:
            r, cost = len(placed), l_p + n
            used.append(0)
            placed.append({})
            own.append([])
        if b in theirs:  # its sequences of their own: in this row, behind the segments
            own[r].extend(theirs[b])  # (n counted them)
        used[r] += cost
        placed[r].setdefault(g, []).append(int(b))
    segments = [  # (group, completions) of each row, in group and completion order
        [(g, sorted(bs)) for g, bs in sorted(groups.items())] for groups in placed
    ]
    if not share_prompt:
        segments = [[(g, [b]) for g, bs in row for b in bs] for row in segments]
    rows = max(len(placed), 1)
    bucket = step_rows(rows, row_multiple, rows_per_micro)

    shape = (bucket, row_len)
    out = {
        "tokens": np.zeros(shape, np.int32),
        "positions": np.zeros(shape, np.int32),
        "valid": np.zeros(shape, bool),
        "seg": np.zeros(shape, np.int32),
        "sub": np.zeros(shape, np.int32),
        "prev": np.broadcast_to(np.arange(row_len, dtype=np.int32), shape).copy(),
        "seq": np.full(shape, b_total, np.int32),
        "loss_mask": np.zeros(shape, np.float32),
        "behavior_logp": np.zeros(shape, np.float32),
        "adv": np.zeros(shape, np.float32),
    }
    routes = None if batch.routes is None else np.asarray(batch.routes)
    if routes is not None:  # padding positions: distinct experts (model.no_routes)
        out["routes"] = np.empty((*shape, *routes.shape[2:]), routes.dtype)
        out["routes"][...] = np.arange(routes.shape[-1], dtype=routes.dtype)
    length = prompt_tokens.shape[1]
    loss_mask = np.asarray(batch.loss_mask, np.float32)
    behavior = np.asarray(batch.behavior_logp, np.float32)
    adv = np.asarray(batch.adv, np.float32)
    real = 0
    for r, row_segments in enumerate(segments):
        pos = 0
        for k, (g, completions) in enumerate(row_segments):
            first = g * group_size
            prompt = prompt_tokens[first][prompt_mask[first]]
            l_p = prompt.size
            span = slice(pos, pos + l_p)
            out["tokens"][r, span] = prompt
            out["positions"][r, span] = np.arange(l_p)
            out["seg"][r, span] = k
            if routes is not None:
                out["routes"][r, span] = routes[first, :length][prompt_mask[first]]
            last_prompt = pos + l_p - 1
            pos += l_p
            for j, b in enumerate(completions, start=1):
                n = int(lengths[b])
                span = slice(pos, pos + n)
                out["tokens"][r, span] = tokens[b, :n]
                out["positions"][r, span] = l_p + np.arange(n)
                out["seg"][r, span] = k
                out["sub"][r, span] = j
                out["prev"][r, span] = np.concatenate([[last_prompt], np.arange(pos, pos + n - 1)])
                out["seq"][r, span] = b
                out["loss_mask"][r, span] = loss_mask[b, :n]
                out["behavior_logp"][r, span] = behavior[b, :n]
                out["adv"][r, span] = adv[b]
                if routes is not None:
                    out["routes"][r, span] = routes[b, length : length + n]
                pos += n
        for k, i in enumerate(own[r], start=len(row_segments)):
            a = alone[i]
            n = len(a.tokens)
            span = slice(pos, pos + n)
            out["tokens"][r, span] = a.tokens
            out["positions"][r, span] = np.arange(n)
            out["seg"][r, span] = k
            out["sub"][r, span] = 1  # no prompt (sub 0) in its segment: it sees only itself
            # Token 0 has no context here: it is scored from itself and never trained.
            out["prev"][r, span] = np.concatenate([[pos], np.arange(pos, pos + n - 1)])
            out["seq"][r, span] = a.seq
            out["loss_mask"][r, span] = np.concatenate([[0.0], a.loss_mask[1:]])
            out["behavior_logp"][r, span] = a.behavior_logp
            out["adv"][r, span] = adv[a.seq]
            pos += n
        out["valid"][r, :pos] = True
        # Padding: a segment of its own, after the last.
        out["seg"][r, pos:] = len(row_segments) + len(own[r])
        real += pos
    n_segments = sum(len(row) for row in segments) + len(alone)
    stats = PackStats(
        rows=rows,
        bucket=bucket,
        row_len=row_len,
        train_tokens=real,
        segments=n_segments,
        prompt_repeats=n_segments - len(alone) - len({g for row in segments for g, _ in row}),
        alone=len(alone),
        alone_left=len(left),
        alone_split=split,
    )
    return PackedBatch(**out, num_seqs=b_total), stats


def packed_logprobs(
    model, batch: PackedBatch, *, temperature: float = 1.0, chunk_size=None, return_routes=False
):
    """log pi(token | its sequence's context) [R, S] for every completion token of a packed
    batch (0 at prompt and padding positions): the padded step's `completion_logprobs`, laid
    out in the packed rows. Each token is scored from the hidden state at `prev` in its row.
    A batch with `routes` replays them; with `return_routes`, (log-probs, the routers' own
    choices [R, S, routed layers, K])."""
    cfg = model.cfg
    h_rsd, chosen = model.hidden_states(
        batch.tokens,
        mask_bt=batch.valid,
        positions_bt=batch.positions,
        segments=(batch.seg, batch.sub),
        routes=batch.routes,
        return_routes=True,
    )
    h_prev_rsd = jnp.take_along_axis(h_rsd, batch.prev[..., None], axis=1)
    logp_rs = model_lib.score_targets(
        h_prev_rsd,
        batch.tokens,
        model.head_kernel(),
        head_dtype=cfg.lm_head_dtype,
        temperature=temperature,
        chunk_size=chunk_size or cfg.logits_chunk_size,
    )
    logp_rs = jnp.where(batch.seq < batch.num_seqs, logp_rs, 0.0)
    return (logp_rs, chosen) if return_routes else logp_rs


def unpack(values_rs, batch: PackedBatch, new_tokens: int) -> np.ndarray:
    """Per-token values [R, S] of a packed batch back in the padded layout [B, N] (0 where no
    token was packed): for tests and for reading a packed step's per-token outputs. Tokens
    of sequences of their own (`pack`'s `alone`: segments without a prompt) are left out."""
    values_rs, seq = np.asarray(values_rs), np.asarray(batch.seq)
    seg, sub, valid = (np.asarray(x) for x in (batch.seg, batch.sub, batch.valid))
    own = np.zeros(seq.shape, bool)
    for r in range(seq.shape[0]):
        prompted = np.unique(seg[r][(sub[r] == 0) & valid[r]])
        own[r] = valid[r] & ~np.isin(seg[r], prompted)
    out = np.zeros((batch.num_seqs, new_tokens), values_rs.dtype)
    for b in range(batch.num_seqs):
        where = (seq == b) & ~own
        out[b, : int(where.sum())] = values_rs[where]  # a row's tokens sit in order in one row
    return out
