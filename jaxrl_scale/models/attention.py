"""Grouped-query attention under a slot mask, in four implementations behind one call.

Shape key: B batch, T queries, S key slots, H query heads, K kv-heads (G = H / K queries share
one), E head dim. Keys and values are heads-major [B, K, S, E] (the KV cache's layout: a decode step
reads each head's slots contiguously, which XLA's CPU backend runs ~3x faster than
[B, S, K, E]).

Every caller's mask has one form: key slot s is visible to query t of row b iff
`valid_bs[b, s]` (the slot holds a real token) and `s <= qslot_bt[b, t]` (the query sits at
slot qslot, so it sees itself and earlier slots). That covers the training forward (qslot = t),
the sampler's prefill and decode over a cache and the trainer's group-shared prompt, and it is
O(B (T + S)) to hold, where a materialised [B, T, S] mask is O(T S).

A packed training row (`segments` = (seg_bs, sub_bs), self-attention, T = S; packing.py)
narrows it further: slot s is visible to query t only within the same segment (seg[s] ==
seg[t]) and when s holds the segment's prompt (sub[s] == 0) or the query's own sequence
(sub[s] == sub[t]). A segment is one prompt followed by some of its completions, so each
completion sees its prompt and itself, never a sibling or another segment. "xla" and
"blockwise" take it ("blockwise" also skips block pairs no segment spans); "cudnn" and
"splash" cannot express it and packed calls resolve to "blockwise".

Implementations (`model.attention`):
- "xla": scores [B, K, G, T, S] in float32, one softmax. Exact and fastest at short lengths,
  but the scores are stored for the backward pass, so memory grows as T S.
- "blockwise": online softmax over key blocks inside query blocks (flash attention written in
  XLA), with a hand-written backward that recomputes each block from the saved log-sum-exp:
  only [B, K, G, bq, bk] is live at a time and nothing quadratic is stored. Block pairs that the
  mask hides in every row (the causal upper triangle, left padding) are skipped, decided once
  per call before the loops (no collective inside them when the rows are split over devices).
- "cudnn": the fused cuDNN kernel through `jax.nn.dot_product_attention`, for self-attention:
  each row's valid slots are gathered to the front in order (whatever the padding or holes),
  which turns the mask into cuDNN's causal-with-sequence-lengths mask. bfloat16/float16 only.
- "splash": the Pallas splash-attention kernel for TPUs (`jax.experimental.pallas.ops.tpu`),
  for calls whose queries sit at the same static slot offset in every row (self-attention,
  and appending to a cache at a Python-int index): a causal mask with that offset, and the
  slot validity as segment ids. Elsewhere it runs in the Pallas interpreter (slow; tests).
- "auto": "xla" when every key fits in one block (nothing to save), else cuDNN on GPUs for
  half-precision self-attention, splash on TPUs (head dim a multiple of 128), else
  "blockwise".
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

from jaxrl_scale.parallel.sharding import LOGICAL_RULES, row_axes

Implementation = Literal["auto", "xla", "blockwise", "cudnn", "splash"]
IMPLEMENTATIONS: tuple[str, ...] = ("auto", "xla", "blockwise", "cudnn", "splash")

_NEG = float(jnp.finfo(jnp.float32).min)  # a hidden score: finite, so no inf - inf = NaN


def slot_mask(valid_bs, qslot_bt, segments=None):
    """The materialised [B, T, S] form of the slot mask (for "xla" and for tests)."""
    slots_s = jnp.arange(valid_bs.shape[1])
    mask = valid_bs[:, None, :] & (slots_s[None, None, :] <= qslot_bt[:, :, None])
    if segments is None:
        return mask
    seg, sub = segments
    return mask & _segment_mask(seg, sub, seg, sub)


def _segment_mask(qseg, qsub, kseg, ksub):
    """[B, T, S]: key s shares query t's segment and holds its prompt or its own sequence."""
    same = qseg[:, :, None] == kseg[:, None, :]
    return same & ((ksub[:, None, :] == 0) | (ksub[:, None, :] == qsub[:, :, None]))


def resolve(
    implementation: str,
    *,
    queries: int,
    keys: int,
    block_size: int,
    dtype,
    query_offset: int | None,
    head_dim: int = 128,
    packed: bool = False,
) -> str:
    """The implementation "auto" stands for at this shape on this platform (others as given;
    "cudnn" or "splash" where it cannot serve the call falls back to "blockwise"). One query
    (a decode step) always runs "xla": its scores [B, H, 1, S] are linear in S already.
    `query_offset`: the slot of query 0 when it is the same static int for every row (0 for
    self-attention), else None. `packed`: the call carries segments (packed training rows),
    which only "xla" and "blockwise" honour."""
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    self_attention = query_offset == 0 and queries == keys
    platform = jax.default_backend()
    if queries == 1:
        return "xla"
    if packed:  # only "xla" and "blockwise" take segments
        if implementation == "auto" and keys <= block_size:
            return "xla"
        return "blockwise" if implementation in ("auto", "cudnn", "splash") else implementation
    if implementation == "auto":
        if keys <= block_size:
            return "xla"
        if platform == "gpu" and self_attention and half:
            return "cudnn"
        if platform == "tpu" and query_offset is not None and head_dim % 128 == 0:
            return "splash"
        return "blockwise"
    if implementation == "cudnn" and not (self_attention and half):
        return "blockwise"
    if implementation == "splash" and query_offset is None:
        return "blockwise"
    return implementation


def attend(
    q_bthe,
    k_bkse,
    v_bkse,
    valid_bs,
    qslot_bt,
    *,
    scale: float,
    precision=None,
    implementation: str = "xla",
    block_size: int = 512,
    query_offset: int | None = None,
    segments=None,
):
    """softmax(q k^T * scale + mask) v -> [B, T, H, E] in q's dtype; scores and softmax in
    float32. A query that sees no key gets zeros (xla: a uniform average of the values);
    "cudnn" and "splash" give the slot mask's output only at queries whose own slot is valid.
    "splash" needs `query_offset` (qslot_bt = query_offset + t in every row). `segments`:
    (seg_bs, sub_bs) of a packed self-attention call ("xla" and "blockwise" only)."""
    if segments is not None and implementation not in ("xla", "blockwise"):
        raise ValueError(f"{implementation} attention cannot take packed segments")
    if implementation == "xla":
        mask = slot_mask(valid_bs, qslot_bt, segments)
        return _attend_xla(q_bthe, k_bkse, v_bkse, mask, scale, precision)
    if implementation == "blockwise":
        return blockwise_attention(
            q_bthe, k_bkse, v_bkse, valid_bs, qslot_bt, segments, scale, precision, block_size
        )
    if implementation == "cudnn":
        return cudnn_self_attention(q_bthe, k_bkse, v_bkse, valid_bs, scale=scale)
    if implementation == "splash":
        if query_offset is None:
            raise ValueError("splash attention needs a static query offset")
        return splash_attention(
            q_bthe, k_bkse, v_bkse, valid_bs, offset=query_offset, scale=scale, block=block_size
        )
    raise ValueError(f"model.attention: unknown implementation {implementation!r}")


def _grouped(q_bthe, k: int):
    """[B, T, H, E] -> [B, K, G, T, E]: query head h reads kv head h // G."""
    b, t, h, e = q_bthe.shape
    return q_bthe.reshape(b, t, k, h // k, e).transpose(0, 2, 3, 1, 4)


def _ungrouped(x_bkgte):
    b, k, g, t, e = x_bkgte.shape
    return x_bkgte.transpose(0, 3, 1, 2, 4).reshape(b, t, k * g, e)


def _attend_xla(q_bthe, k_bkse, v_bkse, mask_bts, scale, precision):
    q_bkgte = _grouped(q_bthe, k_bkse.shape[1])
    scores = jnp.einsum(
        "bkgte,bkse->bkgts",
        q_bkgte,
        k_bkse,
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    scores = jnp.where(mask_bts[:, None, None], scores * scale, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bkse.dtype)
    return _ungrouped(jnp.einsum("bkgts,bkse->bkgte", probs, v_bkse, precision=precision))


# --------------------------------------------------------------------------- blockwise


def _blocks(x, axis: int, size: int, fill):
    """Pad `axis` to a multiple of `size` with `fill` and move the block index to the front:
    [..., n * size, ...] -> [n, ..., size, ...]."""
    n = -(-x.shape[axis] // size)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n * size - x.shape[axis])
    x = jnp.pad(x, pad, constant_values=fill)
    x = x.reshape(*x.shape[:axis], n, size, *x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def _unblocks(x, axis: int, length: int):
    """Inverse of `_blocks` (block index at the front goes back before `axis`)."""
    x = jnp.moveaxis(x, 0, axis)
    x = x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])
    return jax.lax.slice_in_dim(x, 0, length, axis=axis)


def _block_mask(valid_bs, slots_s, qslot_bt, qseg=None, kseg=None):
    """The slot mask of one (query block, key block) pair, [B, 1, 1, bq, bk]; with the
    blocks' segments ((seg, sub) of the queries and of the keys), the packed mask."""
    mask = valid_bs[:, None, :] & (slots_s[None, None, :] <= qslot_bt[:, :, None])
    if qseg is not None:
        mask = mask & _segment_mask(*qseg, *kseg)
    return mask[:, None, None]


def _block_scores(q_bkgte, k_bkse, mask, scale, precision):
    """Scores [B, K, G, bq, bk] in float32, hidden ones _NEG."""
    s = jnp.einsum(
        "bkgte,bkse->bkgts",
        q_bkgte,
        k_bkse,
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    return jnp.where(mask, s * scale, _NEG)


def _visible_blocks(qslot, valid, slots, qseg=None, kseg=None):
    """[nq, nk] bool: whether key block j holds a slot that some query of block i sees, in any
    row (False: the block pair's work can be skipped). A query block sees a key block in row b
    iff the block's first valid slot is at or before the block's last query slot.

    Decided once per call for all rows together, before the loops over blocks: under a mesh
    that splits the rows, the loops then read a replicated table (one [nq, nk] all-reduce here)
    instead of agreeing on each step's skip with an all-reduce inside the loop. A decision per
    device would skip more only where devices' rows hide different blocks (padding); the
    causal upper triangle, most of what is skipped, is hidden in every row. With packed
    segments, a pair is also hidden in a row where no segment spans both blocks (segment
    numbers rise along a packed row, so comparing the blocks' ranges decides it)."""
    last_query_ib = jnp.max(qslot, axis=-1)
    hidden = jnp.iinfo(jnp.int32).max
    first_key_jb = jnp.min(jnp.where(valid, slots[:, None, :], hidden), axis=-1)
    seen_ijb = first_key_jb[None, :, :] <= last_query_ib[:, None, :]
    if qseg is not None:
        real_q, q_seg = qslot >= 0, qseg[0]
        q_lo = jnp.min(jnp.where(real_q, q_seg, hidden), axis=-1)  # [nq, B]
        q_hi = jnp.max(jnp.where(real_q, q_seg, -1), axis=-1)
        k_lo = jnp.min(jnp.where(valid, kseg[0], hidden), axis=-1)  # [nk, B]
        k_hi = jnp.max(jnp.where(valid, kseg[0], -1), axis=-1)
        seen_ijb &= (k_lo[None] <= q_hi[:, None]) & (q_lo[:, None] <= k_hi[None])
    return jnp.any(seen_ijb, axis=-1)


def _skip_if_hidden(visible, step, carry):
    """Run `step(carry)` where the block pair is visible (else carry passes through)."""
    return jax.lax.cond(visible, step, lambda c: c, carry)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def blockwise_attention(
    q_bthe, k_bkse, v_bkse, valid_bs, qslot_bt, segments, scale, precision, block
):
    out, _ = _blockwise_fwd(
        q_bthe, k_bkse, v_bkse, valid_bs, qslot_bt, segments, scale, precision, block
    )
    return out


def _layout(q_bthe, k_bkse, v_bkse, valid_bs, qslot_bt, segments, block):
    """Everything cut into blocks: queries [nq, B, K, G, bq, E] and their slots [nq, B, bq]
    (padding queries at slot -1 see nothing); keys/values [nk, B, K, bk, E], their validity
    [nk, B, bk] and slot numbers [nk, bk]; with `segments`, the queries' and the keys' (seg,
    sub) [nq, B, bq] / [nk, B, bk] (else None)."""
    t, s = q_bthe.shape[1], k_bkse.shape[2]
    bq, bk = min(block, t), min(block, s)
    q = _blocks(_grouped(q_bthe, k_bkse.shape[1]), 3, bq, 0)
    qslot = _blocks(qslot_bt, 1, bq, -1)
    k = _blocks(k_bkse, 2, bk, 0)
    v = _blocks(v_bkse, 2, bk, 0)
    valid = _blocks(valid_bs, 1, bk, False)
    slots = _blocks(jnp.arange(s), 0, bk, s)
    qseg = kseg = None
    if segments is not None:
        qseg = tuple(_blocks(x, 1, bq, -1) for x in segments)
        kseg = tuple(_blocks(x, 1, bk, -2) for x in segments)
    return q, qslot, k, v, valid, slots, qseg, kseg


def _blockwise_fwd(q_bthe, k_bkse, v_bkse, valid_bs, qslot_bt, segments, scale, precision, block):
    q, qslot, k, v, valid, slots, qseg, kseg = _layout(
        q_bthe, k_bkse, v_bkse, valid_bs, qslot_bt, segments, block
    )
    visible_ij = _visible_blocks(qslot, valid, slots, qseg, kseg)

    def one_query_block(xs):
        q_i, qslot_i, qseg_i, visible_j = xs
        stats = q_i.shape[:-1]  # [B, K, G, bq]

        def one_key_block(carry, ys):
            k_j, v_j, valid_j, slots_j, kseg_j, visible = ys
            mask = _block_mask(valid_j, slots_j, qslot_i, qseg_i, kseg_j)

            def step(carry):
                m, denom, acc = carry
                s = _block_scores(q_i, k_j, mask, scale, precision)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
                alpha = jnp.exp(m - m_new)
                pv = jnp.einsum(
                    "bkgts,bkse->bkgte",
                    p.astype(v_j.dtype),
                    v_j,
                    precision=precision,
                    preferred_element_type=jnp.float32,
                )
                return m_new, alpha * denom + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv

            return _skip_if_hidden(visible, step, carry), None

        init = (
            jnp.full(stats, _NEG, jnp.float32),
            jnp.zeros(stats, jnp.float32),
            jnp.zeros((*stats, q_i.shape[-1]), jnp.float32),
        )
        keys = (k, v, valid, slots, kseg, visible_j)
        (m, denom, acc), _ = jax.lax.scan(one_key_block, init, keys)
        seen = denom > 0
        out = acc / jnp.where(seen, denom, 1.0)[..., None]
        return out.astype(q_i.dtype), jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), 0.0)

    out, lse = jax.lax.map(one_query_block, (q, qslot, qseg, visible_ij))
    t = q_bthe.shape[1]
    out_bthe = _ungrouped(_unblocks(out, 3, t))
    lse_bkgt = _unblocks(lse, 3, t)
    residuals = (
        q_bthe, k_bkse, v_bkse, valid_bs, qslot_bt, segments, out_bthe, lse_bkgt, visible_ij
    )  # fmt: skip
    return out_bthe, residuals


def _blockwise_bwd(scale, precision, block, residuals, dout_bthe):
    q_bthe, k_bkse, v_bkse, valid_bs, qslot_bt, segments, out_bthe, lse_bkgt, visible_ij = residuals
    n_kv = k_bkse.shape[1]
    t, s = q_bthe.shape[1], k_bkse.shape[2]
    bq = min(block, t)
    q, qslot, k, v, valid, slots, qseg, kseg = _layout(
        q_bthe, k_bkse, v_bkse, valid_bs, qslot_bt, segments, block
    )
    do = _blocks(_grouped(dout_bthe, n_kv), 3, bq, 0)
    # D = rowsum(dO * O): the softmax Jacobian's correction term, per query.
    d_bkgt = jnp.sum(
        _grouped(dout_bthe.astype(jnp.float32) * out_bthe.astype(jnp.float32), n_kv), axis=-1
    )
    lse = _blocks(lse_bkgt, 3, bq, 0.0)
    d = _blocks(d_bkgt, 3, bq, 0.0)

    def probs_and_dscores(mask, q_i, do_i, lse_i, d_i, k_j, v_j):
        """The block's probabilities (recomputed from the saved log-sum-exp) and the gradient
        of its scores."""
        p = jnp.where(
            mask, jnp.exp(_block_scores(q_i, k_j, mask, scale, precision) - lse_i[..., None]), 0.0
        )
        dp = jnp.einsum(
            "bkgte,bkse->bkgts", do_i, v_j, precision=precision, preferred_element_type=jnp.float32
        )
        return p, p * (dp - d_i[..., None])

    def dq_block(xs):
        q_i, qslot_i, qseg_i, do_i, lse_i, d_i, visible_j = xs

        def one_key_block(dq, ys):
            k_j, v_j, valid_j, slots_j, kseg_j, visible = ys

            mask = _block_mask(valid_j, slots_j, qslot_i, qseg_i, kseg_j)

            def step(dq):
                _, ds = probs_and_dscores(mask, q_i, do_i, lse_i, d_i, k_j, v_j)
                return dq + jnp.einsum(
                    "bkgts,bkse->bkgte",
                    ds.astype(k_j.dtype),
                    k_j,
                    precision=precision,
                    preferred_element_type=jnp.float32,
                )

            return _skip_if_hidden(visible, step, dq), None

        zeros = jnp.zeros(q_i.shape, jnp.float32)
        dq, _ = jax.lax.scan(one_key_block, zeros, (k, v, valid, slots, kseg, visible_j))
        return (dq * scale).astype(q_i.dtype)

    def dkv_block(ys):
        k_j, v_j, valid_j, slots_j, kseg_j, visible_i = ys

        def one_query_block(carry, xs):
            q_i, qslot_i, qseg_i, do_i, lse_i, d_i, visible = xs
            mask = _block_mask(valid_j, slots_j, qslot_i, qseg_i, kseg_j)

            def step(carry):
                dk, dv = carry
                p, ds = probs_and_dscores(mask, q_i, do_i, lse_i, d_i, k_j, v_j)
                dv = dv + jnp.einsum(
                    "bkgts,bkgte->bkse",
                    p.astype(do_i.dtype),
                    do_i,
                    precision=precision,
                    preferred_element_type=jnp.float32,
                )
                dk = dk + jnp.einsum(
                    "bkgts,bkgte->bkse",
                    ds.astype(q_i.dtype),
                    q_i,
                    precision=precision,
                    preferred_element_type=jnp.float32,
                )
                return dk, dv

            return _skip_if_hidden(visible, step, carry), None

        zeros = jnp.zeros(k_j.shape, jnp.float32)
        queries = (q, qslot, qseg, do, lse, d, visible_i)
        (dk, dv), _ = jax.lax.scan(one_query_block, (zeros, zeros), queries)
        return (dk * scale).astype(k_j.dtype), dv.astype(v_j.dtype)

    dq = jax.lax.map(dq_block, (q, qslot, qseg, do, lse, d, visible_ij))
    dk, dv = jax.lax.map(dkv_block, (k, v, valid, slots, kseg, visible_ij.T))
    dq_bthe = _ungrouped(_unblocks(dq, 3, t))
    return dq_bthe, _unblocks(dk, 2, s), _unblocks(dv, 2, s), None, None, None


blockwise_attention.defvjp(_blockwise_fwd, _blockwise_bwd)


# --------------------------------------------------------------------------- cuDNN


def _gather_slots(x, idx_bn, axis: int):
    """x[b, ..., idx_bn[b, n], ...] along `axis`: each row reads its own slots."""
    n = idx_bn.shape[1]
    idx = idx_bn.reshape(idx_bn.shape[0], *([1] * (axis - 1)), n, *([1] * (x.ndim - axis - 1)))
    return jnp.take_along_axis(x, idx, axis=axis)


def _compaction(valid_bs):
    """Each row's slots reordered with its valid ones first, in order, then the rest:
    (src_bs, dest_bs), where position p of the new order holds slot src_bs[b, p] and slot s
    moves to position dest_bs[b, s]."""
    valid = valid_bs.astype(jnp.int32)
    rank_bs = jnp.cumsum(valid, axis=1) - 1
    rest_bs = jnp.sum(valid, axis=1, keepdims=True) + jnp.cumsum(1 - valid, axis=1) - 1
    dest_bs = jnp.where(valid_bs, rank_bs, rest_bs)
    return jnp.argsort(dest_bs, axis=1).astype(jnp.int32), dest_bs


def cudnn_self_attention(q_bthe, k_bkse, v_bkse, valid_bs, *, scale: float, implementation="cudnn"):
    """Causal self-attention (T = S, query t at slot t) under any slot validity, through
    `jax.nn.dot_product_attention`. Each row's valid slots move to the front, in order (left
    padding, holes and right padding alike): the query at a row's i-th valid slot then sits at
    position i and sees positions 0..i, exactly the valid slots up to its own, so "causal +
    sequence lengths" is the slot mask; the output moves back. Outputs at slots that hold no
    token are not the slot mask's (a slot without a token predicts nothing).
    `implementation=None` runs the same path in XLA (tests)."""
    src_bs, dest_bs = _compaction(valid_bs)
    len_b = jnp.sum(valid_bs, axis=1, dtype=jnp.int32)
    q = _gather_slots(q_bthe, src_bs, 1)
    k = _gather_slots(k_bkse.swapaxes(1, 2), src_bs, 1)
    v = _gather_slots(v_bkse.swapaxes(1, 2), src_bs, 1)
    out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        scale=scale,
        is_causal=True,
        query_seq_lengths=len_b,
        key_value_seq_lengths=len_b,
        implementation=implementation,
    )
    return _gather_slots(out, dest_bs, 1)


# --------------------------------------------------------------------------- TPU splash

_LANES = 128  # splash's tiles are multiples of a TPU vreg's 128 lanes


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@functools.lru_cache(maxsize=64)
def _splash_kernel(groups: int, tq: int, ts: int, offset: int, bq: int, bk: int, interpret: bool):
    """One (row, kv head)'s kernel: G query heads against one key head over a [tq, ts] causal
    mask shifted by `offset`. Built once per shape (its block map is computed in numpy)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as mask,
    )

    causal = mask.MultiHeadMask([mask.CausalMask((tq, ts), offset=offset)] * groups)
    sizes = kernel.BlockSizes(
        block_q=bq, block_kv=bk, block_kv_compute=bk,
        block_q_dkv=bq, block_kv_dkv=bk, block_kv_dkv_compute=bk,
        block_q_dq=bq, block_kv_dq=bk,
    )  # fmt: skip
    with jax.ensure_compile_time_eval():  # concrete block maps, safe to cache across traces
        splash = kernel.make_splash_mqa_single_device(
            causal, block_sizes=sizes, interpret=interpret
        )
    return splash, kernel.SegmentIds


def splash_attention(q_bthe, k_bkse, v_bkse, valid_bs, *, offset: int, scale: float, block: int):
    """Query t of every row at slot offset + t, through the splash kernel. The slot mask is a
    causal mask with that offset and segment ids: a real query (its slot valid) sees the valid
    slots up to its own, exactly the slot mask; a padding query sees padding slots (never an
    empty row; its output is never read, and no gradient reaches it). T and S are padded to
    whole blocks (padded keys carry a segment no query has). Under a mesh (the train step) the
    rows are split over its batch axes and the heads over "tensor" with shard_map, since XLA
    does not partition a Pallas call."""
    b, t, h, e = q_bthe.shape
    k, s = k_bkse.shape[1], k_bkse.shape[2]
    g = h // k
    bq = min(_round_up(block, _LANES), _round_up(t, _LANES))
    bk = min(_round_up(block, _LANES), _round_up(s, _LANES))
    tq, ts = _round_up(t, bq), _round_up(s, bk)
    splash, segment_ids = _splash_kernel(g, tq, ts, offset, bq, bk, jax.default_backend() != "tpu")

    def local(q_bthe, k_bkse, v_bkse, valid_bs):
        q_bkgte = _grouped((q_bthe * scale).astype(q_bthe.dtype), k_bkse.shape[1])
        q_bkgte = jnp.pad(q_bkgte, ((0, 0),) * 3 + ((0, tq - t), (0, 0)))
        k_p, v_p = (jnp.pad(x, ((0, 0), (0, 0), (0, ts - s), (0, 0))) for x in (k_bkse, v_bkse))
        valid = valid_bs.astype(jnp.int32)
        q_seg = jnp.pad(
            jax.lax.dynamic_slice_in_dim(valid, offset, t, axis=1), ((0, 0), (0, tq - t))
        )
        kv_seg = jnp.pad(valid, ((0, 0), (0, ts - s)), constant_values=-1)

        def one(q_gte, k_se, v_se, q_seg, kv_seg):
            return splash(q_gte, k_se, v_se, segment_ids=segment_ids(q_seg, kv_seg))

        heads = jax.vmap(one, in_axes=(0, 0, 0, None, None))
        out_bkgte = jax.vmap(heads)(q_bkgte, k_p, v_p, q_seg, kv_seg)[:, :, :, :t]
        return _ungrouped(out_bkgte.astype(q_bthe.dtype))

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return local(q_bthe, k_bkse, v_bkse, valid_bs)
    rows = row_axes(mesh, b)
    heads = LOGICAL_RULES["kv_heads"]
    heads = heads if heads in mesh.axis_names and k % mesh.shape[heads] == 0 else None
    P = jax.sharding.PartitionSpec
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(rows, None, heads, None), P(rows, heads, None, None),
                  P(rows, heads, None, None), P(rows, None)),
        out_specs=P(rows, None, heads, None),
        check_vma=False,
    )(q_bthe, k_bkse, v_bkse, valid_bs)  # fmt: skip
