"""Mixture-of-experts layers (Qwen3-MoE): top-k softmax routing and grouped expert matmuls.

Shape key: N tokens (the batch's rows x positions, flattened), D model, E experts, K experts
per token (`num_experts_per_tok`), F expert width (`moe_intermediate_size`).

Routing follows Hugging Face's Qwen3-MoE: the router's logits [N, E] (here always float32,
whatever the compute dtype: near-ties between experts are where low precision flips a
token's choice), softmax over all E experts, the K most probable kept, and with
`norm_topk_prob` their probabilities renormalised to sum to one. A token's output is the
weighted sum of its K experts' SwiGLU outputs; no shared expert, no capacity limit (no token
is ever dropped).

Expert matmuls (`model.moe_matmul`), all exact (no capacity, nothing dropped):
- "ragged": the N x K (token, expert) pairs sorted by expert, each expert's rows multiplied
  by its weights alone (`jax.lax.ragged_dot` with the group sizes). On GPUs and TPUs XLA runs
  it as a grouped matmul, K / E of the dense FLOPs; on CPUs it lowers to a dense matmul over
  masked copies of the pairs, dearer than "dense" (benchmarks/bench_moe.py).
- "tiled": the sorted pairs padded to whole tiles per expert, each tile one batched matmul
  with its expert's matrices: about K / E of the dense FLOPs on any backend, at the cost of a
  copy of an expert's matrices per tile (fine at CPU shapes; "auto" uses it on CPUs).
- "scan": the tiles one after another (`lax.scan`), each with its expert's matrices in place:
  a grouped matmul's buffers, sequential; the planner's CPU stand-in for "ragged".
- "dense": every token through every expert, the outputs combined with the sparse [N, E]
  weights: E / K times the FLOPs, the reference the others are tested against.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxrl_scale.models.config import ModelConfig
from jaxrl_scale.parallel.sharding import constrain_rows, row_axes

PROJECTIONS = ("gate", "up", "down")


def top_experts(logits_ne, k: int):
    """The K most probable experts [N, K] int32, most probable first (ranked by float32
    probability, as Hugging Face ranks them; ties to the lower expert id, as torch.topk breaks
    them). A stable sort, not lax.top_k: the partitioner splits a sort along its other axes,
    where it gathers a TopK's whole batch onto every device."""
    probs_ne = jax.nn.softmax(logits_ne.astype(jnp.float32), axis=-1)
    return jnp.argsort(-probs_ne, axis=-1, stable=True)[..., :k].astype(jnp.int32)


def route(logits_ne, k: int, *, normalize: bool, experts_nk=None):
    """(weights [N, K] float32, experts [N, K] int32) from router logits: the softmax's K
    largest (`top_experts`), or the given `experts_nk` (router replay: the probabilities of
    those experts, so gradients still reach the router through them), renormalised over the K
    with `normalize`."""
    probs_ne = jax.nn.softmax(logits_ne.astype(jnp.float32), axis=-1)
    if experts_nk is None:
        experts_nk = top_experts(logits_ne, k)
    experts_nk = experts_nk.astype(jnp.int32)
    weights_nk = jnp.take_along_axis(probs_ne, experts_nk, axis=-1)
    if normalize:
        weights_nk = weights_nk / jnp.sum(weights_nk, axis=-1, keepdims=True)
    return weights_nk, experts_nk


def rerouted(chosen_nk, replayed_nk):
    """[N] bool: the router's own choice `chosen_nk` is not the replayed set (order aside)."""
    same = jnp.sort(chosen_nk.astype(jnp.int32), -1) == jnp.sort(replayed_nk.astype(jnp.int32), -1)
    return ~jnp.all(same, axis=-1)


def experts_dense(x_nd, weights_nk, experts_nk, gate_edf, up_edf, down_efd, precision=None):
    """Every token through every expert, combined with the routing weights (zero for the
    experts a token did not choose): num_experts / K times the routed FLOPs."""
    n, e = x_nd.shape[0], gate_edf.shape[0]
    combine_ne = jnp.zeros((n, e), jnp.float32)
    combine_ne = combine_ne.at[jnp.arange(n)[:, None], experts_nk].add(weights_nk, mode="drop")
    gate = jnp.einsum("nd,edf->nef", x_nd, gate_edf, precision=precision)
    up = jnp.einsum("nd,edf->nef", x_nd, up_edf, precision=precision)
    y_ned = jnp.einsum("nef,efd->ned", jax.nn.silu(gate) * up, down_efd, precision=precision)
    y_nd = jnp.einsum("ned,ne->nd", y_ned.astype(jnp.float32), combine_ne)
    return y_nd.astype(x_nd.dtype)


def _sorted_pairs(experts_nk, e: int):
    """The N x K (token, expert) pairs grouped by expert: (order [N K] into the flattened
    pairs, each sorted pair's token, expert, and the experts' group sizes [E]). An expert id
    of E or more names an expert held elsewhere (expert parallelism): such pairs sort last,
    count in no group and come back as zeros from every matmul here (masked: ragged_dot leaves
    rows past the groups' total unspecified)."""
    flat = experts_nk.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, order // experts_nk.shape[1], flat[order], jnp.bincount(flat, length=e)


def _combine(ys, weights_nk, order, token, n: int, dtype):
    """Sorted pairs' outputs [N K, D] back to tokens [N, D], weighted by their routes."""
    weights = jnp.take(weights_nk.reshape(-1), order)
    y_nd = jnp.zeros((n, ys.shape[-1]), jnp.float32)
    return y_nd.at[token].add(ys.astype(jnp.float32) * weights[:, None]).astype(dtype)


def experts_ragged(x_nd, weights_nk, experts_nk, gate_edf, up_edf, down_efd, precision=None):
    """The (token, expert) pairs sorted by expert and each expert's rows multiplied by its own
    weights (`jax.lax.ragged_dot`), then scattered back and summed with the routing weights."""
    order, token, expert, sizes = _sorted_pairs(experts_nk, gate_edf.shape[0])
    sizes = sizes.astype(jnp.int32)
    xs = jnp.take(x_nd, token, axis=0)
    gate = jax.lax.ragged_dot(xs, gate_edf, sizes, precision=precision)
    up = jax.lax.ragged_dot(xs, up_edf, sizes, precision=precision)
    ys = jax.lax.ragged_dot(jax.nn.silu(gate) * up, down_efd, sizes, precision=precision)
    # Rows past the groups' total (pairs of experts held elsewhere) are left unspecified by
    # ragged_dot: zeroed here, never trusted to be zeros (a NaN there times a 0 weight is NaN).
    ys = jnp.where((expert < gate_edf.shape[0])[:, None], ys, 0)
    return _combine(ys, weights_nk, order, token, x_nd.shape[0], x_nd.dtype)


def _tile_layout(experts_nk, e: int, tile: int):
    """Where every (token, expert) pair goes when each expert's sorted pairs are padded to
    whole tiles of at most `tile` rows: (tile, tiles, order, token, dest [N K] each pair's
    row, past the end for pairs held elsewhere, tile_e [tiles] each tile's expert)."""
    n, k = experts_nk.shape
    # Tiles no taller than an expert's average share (a power of two, 8 at least), so a few
    # decoded tokens do not each fill a whole tile per expert.
    tile = min(tile, max(8, 1 << max(n * k // e - 1, 0).bit_length()))
    tiles = -(-n * k // tile) + e  # each expert wastes under one tile
    order, token, sorted_e, sizes = _sorted_pairs(experts_nk, e)
    padded = -(-sizes // tile) * tile
    starts = jnp.cumsum(padded) - padded  # where each expert's tiles begin
    held = sorted_e < e  # pairs of experts held elsewhere get no row (expert parallelism)
    here = jnp.minimum(sorted_e, e - 1)
    rank = jnp.arange(n * k) - (jnp.cumsum(sizes) - sizes)[here]
    dest = jnp.where(held, starts[here] + rank, tiles * tile)
    tile_e = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(tiles) * tile, side="right")
    tile_e = jnp.minimum(tile_e, e - 1)  # tiles past the last expert's hold zeros
    return tile, tiles, order, token, dest, tile_e


def _tiled_experts(tile_matmuls, x_nd, weights_nk, experts_nk, gate_edf, tile: int):
    """Pairs laid out in tiles (`_tile_layout`), `tile_matmuls(xt [tiles, tile, D], tile_e)`
    -> [tiles, tile, D] run on them, and the rows combined back into tokens."""
    n, d = x_nd.shape
    tile, tiles, order, token, dest, tile_e = _tile_layout(experts_nk, gate_edf.shape[0], tile)
    xs = jnp.zeros((tiles * tile, d), x_nd.dtype).at[dest].set(x_nd[token], mode="drop")
    ys = tile_matmuls(xs.reshape(tiles, tile, d), tile_e)
    ys = ys.reshape(tiles * tile, d).at[dest].get(mode="fill", fill_value=0)
    return _combine(ys, weights_nk, order, token, n, x_nd.dtype)


def experts_tiled(
    x_nd, weights_nk, experts_nk, gate_edf, up_edf, down_efd, precision=None, tile: int = 64
):
    """Grouped matmuls as batched ones: the (token, expert) pairs sorted by expert, each
    expert's rows padded to whole tiles of at most `tile` rows, and every tile multiplied by its
    own expert's matrices (gathered per tile). (N K / tile + E) tiles at most: about K / E of the
    dense FLOPs, for tile x E extra rows and one copy of an expert's matrices per tile. For
    CPUs, where ragged_dot costs more than the dense reference (module docstring)."""

    def tile_matmuls(xt, tile_e):
        gate = jnp.einsum("tcd,tdf->tcf", xt, gate_edf[tile_e], precision=precision)
        up = jnp.einsum("tcd,tdf->tcf", xt, up_edf[tile_e], precision=precision)
        h = jax.nn.silu(gate) * up
        return jnp.einsum("tcf,tfd->tcd", h, down_efd[tile_e], precision=precision)

    return _tiled_experts(tile_matmuls, x_nd, weights_nk, experts_nk, gate_edf, tile)


def experts_scan(
    x_nd, weights_nk, experts_nk, gate_edf, up_edf, down_efd, precision=None, tile: int = 64
):
    """The tiles of `experts_tiled` one at a time (`lax.scan`), each multiplied by its expert's
    matrices indexed in place: the FLOPs of the tiled form and the buffers of a grouped matmul
    (the sorted pairs' rows and hidden units, never a copy of the experts' weights per tile).
    Sequential, so slow where ragged_dot runs; what `jaxrl-scale memory` compiles on CPUs to
    plan the ragged grouped matmul an accelerator runs (whose CPU lowering is dense)."""

    def one_tile(_, tile_in):
        x_cd, e = tile_in
        gate = jnp.dot(x_cd, gate_edf[e], precision=precision)
        up = jnp.dot(x_cd, up_edf[e], precision=precision)
        return None, jnp.dot(jax.nn.silu(gate) * up, down_efd[e], precision=precision)

    # Saved for the backward pass: the matmuls' outputs (the pairs' hidden units), not the
    # expert matrices indexed per tile, which would stack into a copy per tile again.
    one_tile = jax.checkpoint(one_tile, policy=jax.checkpoint_policies.dots_saveable)

    def tile_matmuls(xt, tile_e):
        return jax.lax.scan(one_tile, None, (xt, tile_e))[1]

    return _tiled_experts(tile_matmuls, x_nd, weights_nk, experts_nk, gate_edf, tile)


def resolve_matmul(name: str) -> str:
    """`model.moe_matmul` for the backend jax runs on ("auto": tiled on CPUs, else ragged)."""
    if name != "auto":
        return name
    return "tiled" if jax.default_backend() == "cpu" else "ragged"


MATMULS = {
    "ragged": experts_ragged,
    "tiled": experts_tiled,
    "scan": experts_scan,
    "dense": experts_dense,
}


class MoE(nnx.Module):
    """A routed SwiGLU layer: router [D, E], experts' gate/up [E, D, F] and down [E, F, D]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param, precision=None):
        d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.num_experts = e
        self.matmul = cfg.moe_matmul
        self.precision = precision
        self.router_kernel = param(rngs, (d, e), ("embed", None))
        self.gate_kernel = param(rngs, (e, d, f), ("expert", "embed", "mlp"))
        self.up_kernel = param(rngs, (e, d, f), ("expert", "embed", "mlp"))
        self.down_kernel = param(rngs, (e, f, d), ("expert", "mlp", "embed"))

    def router_logits(self, x_nd):
        """[..., E] float32 at full precision (the router decides discretely: see the module)."""
        return jnp.dot(
            x_nd.astype(jnp.float32),
            self.router_kernel[...],
            precision=jax.lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )

    def __call__(self, x_btd):
        return self.forward(x_btd)[0]

    def forward(self, x_btd, experts_btk=None):
        """(output [B, T, D], the experts the router chooses [B, T, K] int32); `experts_btk`:
        route every token to these experts instead (router replay; the router's own choice is
        still returned, to count where the two differ).

        Tokens are grouped per batch shard of the mesh being traced under (one group without
        one): each shard sorts and multiplies its own rows' pairs, so the layer stays
        data-parallel (a sort over the whole batch would gather every row onto every device)."""
        b, t, d = x_btd.shape
        mesh = jax.sharding.get_abstract_mesh()
        axes = None if mesh.empty else row_axes(mesh, b)
        groups = 1 if axes is None else math.prod(mesh.shape[a] for a in axes)
        ways = 1 if mesh.empty else dict(mesh.shape).get("expert", 1)
        x_gnd = constrain_rows(x_btd.reshape(groups, b // groups * t, d))
        replay = None if experts_btk is None else experts_btk.reshape(groups, -1, self.k)
        logits_gne = self.router_logits(x_gnd)
        chosen_gnk = top_experts(logits_gne, self.k)
        weights_gnk, experts_gnk = route(
            logits_gne,
            self.k,
            normalize=self.normalize,
            experts_nk=chosen_gnk if replay is None else replay,
        )
        kernels = [getattr(self, f"{p}_kernel")[...].astype(x_btd.dtype) for p in PROJECTIONS]
        matmul = functools.partial(MATMULS[resolve_matmul(self.matmul)], precision=self.precision)

        def run(x_1nd, weights_1nk, experts_1nk, *kernels):  # one group
            return matmul(x_1nd[0], weights_1nk[0], experts_1nk[0], *kernels)[None]

        if ways > 1:
            if self.num_experts % ways:
                raise ValueError(
                    f"mesh.expert: {ways} expert shards do not split model.num_experts = "
                    f"{self.num_experts}"
                )
            rows_split = axes is not None and "expert" in axes
            run = functools.partial(
                _expert_parallel, run, held=self.num_experts // ways, rows_split=rows_split
            )
        if axes is not None or ways > 1:  # each shard its own group
            rows = PartitionSpec(axes)
            experts = PartitionSpec("expert" if ways > 1 else None)  # else whole on each
            run = jax.shard_map(
                run, in_specs=(rows, rows, rows, experts, experts, experts), out_specs=rows
            )
        y_gnd = run(x_gnd, weights_gnk, experts_gnk, *kernels)
        return constrain_rows(y_gnd).reshape(b, t, d), chosen_gnk.reshape(b, t, self.k)


def _expert_parallel(run, x_1nd, weights_1nk, experts_1nk, *kernels, held: int, rows_split: bool):
    """One device's share of an expert-parallel layer, inside the shard_map: it holds experts
    [i H, (i + 1) H) of its expert shard i (`held` = H = E / |expert|). The rows of the expert
    shards beside it are gathered (`rows_split`: the batch is split over "expert" too; else
    every shard holds the same rows), each pair routed to a held expert runs here (the others
    name an expert past H: zeros), and the partial outputs are summed back onto the rows'
    own shards (a reduce-scatter; a sum where the rows were not split). Exact and dropless:
    the gather and the reduce-scatter together move what an all-to-all dispatch and its
    return would, with room for every row to pick this shard's experts."""
    if rows_split:
        x_1nd, weights_1nk, experts_1nk = (
            jax.lax.all_gather(a, "expert", axis=1, tiled=True)
            for a in (x_1nd, weights_1nk, experts_1nk)
        )
    first = jax.lax.axis_index("expert") * held
    local = experts_1nk - first
    here = (local >= 0) & (local < held)
    y_1nd = run(x_1nd, jnp.where(here, weights_1nk, 0.0), jnp.where(here, local, held), *kernels)
    if rows_split:
        return jax.lax.psum_scatter(y_1nd, "expert", scatter_dimension=1, tiled=True)
    return jax.lax.psum(y_1nd, "expert")
