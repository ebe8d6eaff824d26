"""Decoder-only policy (Qwen2/Qwen2.5, Qwen3, Llama-3) in Flax NNX, with a true FP32 logits head.

Shape key: B batch, T query tokens, S key tokens, D model, H heads, K kv-heads, E head dim,
F mlp, V vocab. Kernels are stored [in, out] in float32 and carry logical axis names
(`logical_axes` metadata) that `sharding.py` maps onto mesh axes.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_scale.models import attention, lora
from jaxrl_scale.models.config import ModelConfig, RopeScalingConfig
from jaxrl_scale.models.layers import dense
from jaxrl_scale.models.moe import MoE
from jaxrl_scale.parallel.sharding import constrain_rows

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# model.matmul_precision -> the precision every matmul of the forward pass asks XLA for. On CPU
# every float32 matmul is exact; on GPUs the default for float32 is TF32 and on TPUs one bf16
# pass; HIGH is 3 bf16 passes (TPU) and HIGHEST is full float32 (6 passes on a TPU). "default"
# leaves the choice to jax's `jax_default_matmul_precision`.
PRECISIONS = {
    "default": None,
    "high": jax.lax.Precision.HIGH,
    "highest": jax.lax.Precision.HIGHEST,
}


INIT_STD = 0.02  # normal init of every matrix, as the HF families use

# model.remat -> what a decoder layer keeps for the backward pass ("none" only checkpoints a
# scanned layer, where the whole scan body must be one checkpoint: see Policy._run).
REMAT_POLICIES = {
    "none": jax.checkpoint_policies.everything_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...]):
    return nnx.Param(
        INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32), logical_axes=axes
    )


def _ones(shape: tuple[int, ...], axes: tuple[str | None, ...]):
    return nnx.Param(jnp.ones(shape, jnp.float32), logical_axes=axes)


def _zeros(shape: tuple[int, ...], axes: tuple[str | None, ...]):
    return nnx.Param(jnp.zeros(shape, jnp.float32), logical_axes=axes)


# --------------------------------------------------------------------------- pieces


def rms_norm(x, weight, eps: float, out_dtype):
    """x * rsqrt(mean(x^2) + eps) * weight, computed in float32 (as HF does)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * normed).astype(out_dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScalingConfig | None):
    """Inverse frequencies [E/2]; Llama-3 scaling divides low frequencies by `factor` and blends."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_medium, blended, scaled)


def rope_tables(positions_bt, inv_freq_e2):
    """(cos, sin) [B, T, 1, E] of the rotary angles, float32; computed once per forward pass and
    shared by every layer."""
    angles_bte = positions_bt[..., None].astype(jnp.float32) * inv_freq_e2
    angles_bte = jnp.concatenate([angles_bte, angles_bte], axis=-1)[:, :, None, :]
    return jnp.cos(angles_bte), jnp.sin(angles_bte)


def apply_rope(x_bthe, rope):
    """Rotate-half RoPE on the last axis with precomputed (cos, sin) tables."""
    cos, sin = (t.astype(x_bthe.dtype) for t in rope)
    half = x_bthe.shape[-1] // 2
    rotated = jnp.concatenate([-x_bthe[..., half:], x_bthe[..., :half]], axis=-1)
    return x_bthe * cos + rotated * sin


def default_positions(mask_bt):
    """Positions counting only real tokens, so left-padded rows start at 0."""
    return jnp.maximum(jnp.cumsum(mask_bt.astype(jnp.int32), axis=-1) - 1, 0)


def head_logits(h_xd, kernel_dv, head_dtype: str):
    """LM head -> float32 logits. float32: float32 inputs, float32 accumulation and HIGHEST
    precision, so the product is float32 on every backend (ScaleRL's FP32 head; DEFAULT would be
    TF32 on GPUs and a single bf16 pass on TPUs, whatever `model.matmul_precision` says);
    bfloat16: a bf16 matmul with bf16 output, cast afterwards (the ablation's other arm)."""
    dtype = _DTYPES[head_dtype]
    precision = jax.lax.Precision.HIGHEST if head_dtype == "float32" else None
    lead = h_xd.shape[:-1]
    logits = jnp.dot(
        h_xd.reshape(-1, h_xd.shape[-1]).astype(dtype),
        kernel_dv.astype(dtype),
        precision=precision,
        preferred_element_type=dtype,
    ).reshape(*lead, kernel_dv.shape[-1])
    return logits.astype(jnp.float32)


# --------------------------------------------------------------------------- modules


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, k, e = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        self.cfg = cfg
        self.q_kernel = _param(rngs, (d, h, e), ("embed", "heads", "head_dim"))
        self.k_kernel = _param(rngs, (d, k, e), ("embed", "kv_heads", "head_dim"))
        self.v_kernel = _param(rngs, (d, k, e), ("embed", "kv_heads", "head_dim"))
        self.o_kernel = _param(rngs, (h, e, d), ("heads", "head_dim", "embed"))
        if cfg.qkv_bias:
            self.q_bias = _zeros((h, e), ("heads", "head_dim"))
            self.k_bias = _zeros((k, e), ("kv_heads", "head_dim"))
            self.v_bias = _zeros((k, e), ("kv_heads", "head_dim"))
        if cfg.qk_norm:
            self.q_norm = _ones((e,), ("norm",))
            self.k_norm = _ones((e,), ("norm",))
        _add_adapters(self, cfg, ("q", "k", "v", "o"))

    def __call__(self, x_btd, rope, valid_bs, qslot_bt, kv=None, write_index=None, segments=None):
        """Attention of T queries over S key slots under the slot mask (attention.py: slot s is
        visible to a query at slot qslot iff valid_bs[s] and s <= qslot). With `kv` = (keys,
        values) [B, K, S, E] of a cache, this call's keys and values are written at slots
        write_index.. (one index for every row, or one per row [B]) and attention runs over all
        S slots; without, the call is self-attention over its own T tokens (S = T), narrowed
        to packed segments by `segments` = (seg, sub) [B, T] (attention.py). Returns (out,
        updated kv), kv None without a cache."""
        cfg = self.cfg
        dtype = x_btd.dtype
        precision = PRECISIONS[cfg.matmul_precision]

        def project(name):
            kernel_dhe = getattr(self, f"{name}_kernel")
            y_bthe = _project(self, name, x_btd, kernel_dhe, 1, precision)
            if cfg.qkv_bias:
                y_bthe = y_bthe + getattr(self, f"{name}_bias")[...].astype(dtype)
            return y_bthe

        q_bthe = project("q")
        k_btke = project("k")
        v_btke = project("v")
        if cfg.qk_norm:
            q_bthe = rms_norm(q_bthe, self.q_norm[...], cfg.rms_norm_eps, dtype)
            k_btke = rms_norm(k_btke, self.k_norm[...], cfg.rms_norm_eps, dtype)
        q_bthe = apply_rope(q_bthe, rope)
        k_bkte = apply_rope(k_btke, rope).swapaxes(1, 2)
        v_bkte = v_btke.swapaxes(1, 2)
        if kv is not None:
            kv = tuple(
                _write_slots(cache, new.astype(cache.dtype), write_index)
                for cache, new in zip(kv, (k_bkte, v_bkte), strict=True)
            )
            k_bkte, v_bkte = (c.astype(dtype) for c in kv)
        # Query 0's slot when it is one static int for every row (splash and cuDNN need it).
        offset = 0 if kv is None else write_index if isinstance(write_index, int) else None
        implementation = attention.resolve(
            cfg.attention,
            queries=q_bthe.shape[1],
            keys=k_bkte.shape[2],
            block_size=cfg.attention_block_size,
            dtype=dtype,
            query_offset=offset,
            head_dim=cfg.resolved_head_dim,
            packed=segments is not None,
        )
        out_bthe = attention.attend(
            q_bthe,
            k_bkte,
            v_bkte,
            valid_bs,
            qslot_bt,
            scale=cfg.resolved_head_dim**-0.5,
            precision=precision,
            implementation=implementation,
            block_size=cfg.attention_block_size,
            query_offset=offset,
            segments=segments,
        )
        return _project(self, "o", out_bthe, self.o_kernel, 2, precision), kv


def _write_slots(cache_bkse, new_bkte, write_index):
    """`new` written into the cache at slots write_index..+T: one index for every row (a
    contiguous slice) or one per row [B] (a scatter: rows of a slot engine sit at different
    columns). A Python int equal to the cache's length appends (the cache grows by T)."""
    if isinstance(write_index, int) and write_index == cache_bkse.shape[2]:
        return jnp.concatenate([cache_bkse, new_bkte], axis=2)
    if jnp.ndim(write_index) == 0:
        return jax.lax.dynamic_update_slice(cache_bkse, new_bkte, (0, 0, write_index, 0))
    b, _, t, _ = new_bkte.shape
    slots_bt = write_index[:, None] + jnp.arange(t)
    # A finished engine row's column may be past the cache's end: its write is dropped.
    rows_b1 = jnp.arange(b)[:, None]
    return cache_bkse.at[rows_b1, :, slots_bt].set(new_bkte.swapaxes(1, 2), mode="drop")


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.precision = PRECISIONS[cfg.matmul_precision]
        self.gate_kernel = _param(rngs, (d, f), ("embed", "mlp"))
        self.up_kernel = _param(rngs, (d, f), ("embed", "mlp"))
        self.down_kernel = _param(rngs, (f, d), ("mlp", "embed"))
        _add_adapters(self, cfg, ("gate", "up", "down"))

    def __call__(self, x_btd):
        precision = self.precision
        gate = jax.nn.silu(_project(self, "gate", x_btd, self.gate_kernel, 1, precision))
        up = _project(self, "up", x_btd, self.up_kernel, 1, precision)
        return _project(self, "down", gate * up, self.down_kernel, 1, precision)


def _add_adapters(module, cfg: ModelConfig, names: tuple[str, ...]) -> None:
    """LoRA's (A, B) beside each of `module`'s kernels that `model.lora` targets."""
    module.lora_scale = cfg.lora.scale if cfg.lora.enabled else 0.0
    if not cfg.lora.enabled:
        return
    targets = cfg.lora.projections
    for name in names:
        if f"{name}_proj" not in targets:
            continue
        kernel = getattr(module, f"{name}_kernel")
        n_in = 2 if name == "o" else 1
        a, b = lora.adapter_pair(
            kernel.get_value().shape,
            kernel.get_metadata()["logical_axes"],
            n_in,
            cfg.lora.rank,
        )
        setattr(module, f"{name}_lora_a", a)
        setattr(module, f"{name}_lora_b", b)


def _project(module, name: str, x, kernel, n_in: int, precision):
    """x @ kernel in x's dtype, plus the kernel's LoRA adapter's s (x A) B where it has one."""
    y = dense(x, kernel[...].astype(x.dtype), n_in=n_in, precision=precision)
    d = lora.delta(module, name, x, n_in=n_in, precision=precision, scale=module.lora_scale)
    return y if d is None else y + d


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer: int = 0):
        self.cfg = cfg
        self.attn_norm = _ones((cfg.hidden_size,), ("norm",))
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = _ones((cfg.hidden_size,), ("norm",))
        if cfg.routed(layer):  # a mixture of experts (moe.py), as Hugging Face picks layers
            self.mlp = MoE(cfg, rngs=rngs, param=_param, precision=PRECISIONS[cfg.matmul_precision])
        else:
            self.mlp = MLP(cfg, rngs=rngs)

    def __call__(
        self, x_btd, rope, valid_bs, qslot_bt, kv=None, write_index=None, segments=None,
        experts_btk=None,
    ):  # fmt: skip
        """(x, kv, the experts a routed layer's router chose [B, T, K] or None); a routed
        layer sends its tokens to `experts_btk` where given (router replay: moe.py)."""
        eps, dtype = self.cfg.rms_norm_eps, x_btd.dtype
        h = rms_norm(x_btd, self.attn_norm[...], eps, dtype)
        attn, kv = self.attn(h, rope, valid_bs, qslot_bt, kv, write_index, segments)
        x_btd = x_btd + attn
        h = rms_norm(x_btd, self.mlp_norm[...], eps, dtype)
        if isinstance(self.mlp, MoE):
            y, chosen = self.mlp.forward(h, experts_btk)
            return x_btd + y, kv, chosen
        return x_btd + self.mlp(h), kv, None


class Policy(nnx.Module):
    """The policy network: tokens [B, T] -> float32 logits [B, T, V].

    `mask_bt` (1 = real token) handles per-row padding; positions default to the count of real
    tokens before each one, so left-padded prompts see the same positions as unpadded ones.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, v = cfg.hidden_size, cfg.vocab_size
        self.embedding = _param(rngs, (v, d), ("vocab", "embed"))
        self.layers = nnx.List([Block(cfg, rngs=rngs, layer=i) for i in range(cfg.num_layers)])
        self.final_norm = _ones((d,), ("norm",))
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (d, v), ("embed", "vocab"))
        if cfg.lora.enabled:  # after the base: the base equals a rank-0 policy's of this seed
            lora.init_adapters(self, rngs.params())

    @property
    def compute_dtype(self):
        return _DTYPES[self.cfg.dtype]

    def hidden_states(
        self, tokens_bt, *, mask_bt=None, positions_bt=None, segments=None, routes=None,
        return_routes=False,
    ):  # fmt: skip
        """Final-normed hidden states [B, T, D], in float32 when the head is float32.
        `segments`: (seg, sub) [B, T] of packed rows (attention.py, packing.py). `routes`
        [B, T, routed layers, K]: the experts each token is sent to in each routed layer
        (router replay); with `return_routes`, (hidden, the routers' own choices)."""
        if mask_bt is None:
            mask_bt = jnp.ones(tokens_bt.shape, jnp.bool_)
        mask_bt = mask_bt.astype(jnp.bool_)
        if positions_bt is None:
            positions_bt = default_positions(mask_bt)
        b, t = tokens_bt.shape
        qslot_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        h_btd, _, chosen = self._run(
            tokens_bt, positions_bt, mask_bt, qslot_bt, scan=self.cfg.scan_layers,
            segments=segments, routes=routes,
        )  # fmt: skip
        return (h_btd, chosen) if return_routes else h_btd

    def _run(
        self,
        tokens_bt,
        positions_bt,
        valid_bs,
        qslot_bt,
        cache=None,
        write_index=None,
        scan=False,
        return_cache=True,
        segments=None,
        routes=None,
    ):
        """Embedding, blocks (reading/writing `cache` if given), final norm. Returns (hidden,
        None or (keys, values), chosen): the cache as per-layer tuples from the loop,
        [layers, ...] arrays from the scan (`scan`: one lax.scan over the layers' stacked
        weights; without `return_cache` its updated cache is not kept, which a scan cannot
        leave to XLA). `segments`: a packed self-attention call's (seg, sub) (attention.py).
        `routes` [B, T, routed layers, K]: experts to replay; `chosen` (same shape, int32,
        None without routed layers): the experts the routers chose."""
        cfg = self.cfg
        inv_freq_e2 = rope_inv_freq(cfg.resolved_head_dim, cfg.rope_theta, cfg.rope_scaling)
        rope = rope_tables(positions_bt, inv_freq_e2)
        x_btd = jnp.take(self.embedding[...], tokens_bt, axis=0).astype(self.compute_dtype)
        x_btd = constrain_rows(x_btd)
        graphdef, _ = nnx.split(self.layers[0])  # a scan's layers are alike (ModelConfig)
        kv = None if cache is None else (cache.k, cache.v)
        if scan:
            # Under a differentiated scan, a custom_vjp (the blockwise attention) called inside
            # a checkpoint that does not take the whole scan body, or with its mask as loop
            # constants, has its forward linearised and the inner loops' block scores saved
            # ([q blocks, k blocks, ..., bq, bk]: the T x S this was to avoid; see
            # tests/test_attention.py). So the whole body is one checkpoint ("none" saves
            # everything) and the mask rides in the carry.
            apply = _layer_fn(graphdef, "none", write_index)
            # The stacked copy is cast to the compute dtype first (the layer would cast each
            # matrix anyway; `for_generation`'s rule), so it costs weights x 2 bytes in bf16.
            stacked = _stack(
                [for_generation(nnx.state(blk), cfg, copy=False) for blk in self.layers]
            )
            if kv is not None:
                kv = tuple(c if isinstance(c, jax.Array) else jnp.stack(c) for c in kv)

            @functools.partial(jax.checkpoint, policy=REMAT_POLICIES[cfg.remat])
            def body(carry, xs):
                x_btd, valid_bs, qslot_bt, segments = carry
                state, kv_l, routes_l = xs
                x_btd, kv_l, chosen_l = apply(
                    state, x_btd, rope, valid_bs, qslot_bt, kv_l, segments, routes_l
                )
                kv_l = kv_l if return_cache else None
                return (x_btd, valid_bs, qslot_bt, segments), (kv_l, chosen_l)

            carry = (x_btd, valid_bs, qslot_bt, segments)
            # Every layer is routed or none is (ModelConfig): routes scan with the layers.
            routes_l = None if routes is None else jnp.moveaxis(routes, 2, 0)
            (x_btd, *_), (kv, chosen) = jax.lax.scan(body, carry, (stacked, kv, routes_l))
            chosen = None if chosen is None else jnp.moveaxis(chosen, 0, 2)
        else:
            new_k, new_v, chosen = [], [], []
            for i, blk in enumerate(self.layers):  # dense and MoE layers may alternate
                layer = _layer_fn(nnx.graphdef(blk), cfg.remat, write_index)
                kv_l = None if kv is None else (kv[0][i], kv[1][i])
                routed = cfg.routed(i)
                replay = routes[:, :, len(chosen)] if routed and routes is not None else None
                x_btd, kv_l, chosen_l = layer(
                    nnx.state(blk), x_btd, rope, valid_bs, qslot_bt, kv_l, segments, replay
                )
                if routed:
                    chosen.append(chosen_l)
                if kv_l is not None:
                    new_k.append(kv_l[0])
                    new_v.append(kv_l[1])
            kv = None if kv is None or not return_cache else (tuple(new_k), tuple(new_v))
            chosen = jnp.stack(chosen, axis=2) if chosen else None
        h_btd = rms_norm(x_btd, self.final_norm[...], cfg.rms_norm_eps, _DTYPES[cfg.lm_head_dtype])
        return h_btd, kv, chosen

    def extend(
        self,
        cache: KVCache,
        tokens_bt,
        positions_bt,
        valid_bt,
        write_index,
        *,
        scan=False,
        return_cache=True,
        routes=None,
        return_routes=False,
    ):
        """Run T new tokens against a KV cache: write them at slots write_index..+T (one index
        for every row, or one per row [B]; the Python int len(cache) appends, growing the
        cache) and attend over every valid slot up to each query's own. Returns (hidden [B, T,
        D], new cache, or None without `return_cache`), and with `return_routes` the routers'
        choices [B, T, routed layers, K] third (`routes`: experts to replay instead). `scan`
        runs the layers as one lax.scan (the cache's keys and values then come back stacked,
        [layers, B, K, S, E])."""
        b, t = tokens_bt.shape
        valid_bt = valid_bt.astype(jnp.bool_)
        query_slots_bt = jnp.broadcast_to(
            jnp.asarray(write_index)[..., None] + jnp.arange(t), (b, t)
        )
        if isinstance(write_index, int) and write_index == cache.valid.shape[1]:
            valid_bs = jnp.concatenate([cache.valid, valid_bt], axis=1)
        elif jnp.ndim(write_index) == 0:
            valid_bs = jax.lax.dynamic_update_slice(cache.valid, valid_bt, (0, write_index))
        else:
            rows_b1 = jnp.arange(b)[:, None]
            valid_bs = cache.valid.at[rows_b1, query_slots_bt].set(valid_bt, mode="drop")
        h_btd, kv, chosen = self._run(
            tokens_bt,
            positions_bt,
            valid_bs,
            query_slots_bt,
            cache,
            write_index,
            scan=scan,
            return_cache=return_cache,
            routes=routes,
        )
        cache = KVCache(k=kv[0], v=kv[1], valid=valid_bs) if return_cache else None
        return (h_btd, cache, chosen) if return_routes else (h_btd, cache)

    def head_kernel(self):
        """Vocabulary projection [D, V] (the transposed embedding when tied)."""
        return self.embedding[...].T if self.cfg.tie_embeddings else self.lm_head[...]

    def logits(self, h_btd):
        return head_logits(h_btd, self.head_kernel(), self.cfg.lm_head_dtype)

    def __call__(self, tokens_bt, *, mask_bt=None, positions_bt=None):
        return self.logits(
            self.hidden_states(tokens_bt, mask_bt=mask_bt, positions_bt=positions_bt)
        )


def _layer_fn(graphdef, remat: str, write_index):
    """(layer state, x, rope, valid, qslot, kv, segments, experts) -> (x, kv, chosen experts):
    one decoder layer (`Block`) as a pure
    function of its weights, rematerialised under `model.remat`'s policy. `write_index` is
    closed over, so a Python int (an append) stays one."""

    def apply(state, x_btd, rope, valid_bs, qslot_bt, kv, segments=None, experts_btk=None):
        x_btd, kv, chosen = nnx.merge(graphdef, state)(
            x_btd, rope, valid_bs, qslot_bt, kv, write_index, segments, experts_btk
        )
        return constrain_rows(x_btd), kv, chosen

    if remat == "none":
        return apply
    return jax.checkpoint(apply, policy=REMAT_POLICIES[remat])


def _is_norm(var) -> bool:
    return var.get_metadata().get("logical_axes") == ("norm",)


def for_generation(params, cfg: ModelConfig, *, copy: bool = True):
    """The parameters a generator decodes with: the layers' matrices and biases, and an untied
    embedding, in the compute dtype, which is what the model casts them to at use, so decoding
    is bit-identical to decoding with the float32 parameters at about half their bytes
    (Qwen3-8B: 30.5 GiB -> 16.4 GiB). Norm weights (scaled in float32) and the head's kernel
    (the FP32 head; the embedding when tied) and MoE routers (float32 logits: moe.py) keep
    their dtype, and nothing is widened (a
    bfloat16 LoRA base stays bfloat16 under float32 compute). With `copy`, every leaf is a new
    buffer, so the train step may donate `params` while the generator reads the result."""
    dtype = _DTYPES[cfg.dtype]
    head = {"lm_head"} | ({"embedding"} if cfg.tie_embeddings else set())

    def one(path, var):
        x = var.get_value()
        keep = _is_norm(var) or path[0].key in head or path[-1].key == "router_kernel"
        if keep or x.dtype.itemsize <= jnp.dtype(dtype).itemsize:
            return var.replace(jnp.copy(x)) if copy else var
        return var.replace(x.astype(dtype))

    return jax.tree_util.tree_map_with_path(
        one, params, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def route_shapes(model, rows: int, positions: int):
    """The shape of `rows` x `positions` tokens' recorded experts under `model` (a
    ModelConfig; None, or one without router replay: None)."""
    if model is None or not model.router_replay:
        return None
    shape = (rows, positions, model.routed_layers, model.num_experts_per_tok)
    return jax.ShapeDtypeStruct(shape, model.route_dtype)


def no_routes(shape, model_cfg, xp=jnp):
    """Recorded experts [*shape, K] for positions no token was routed at: experts 0..K-1,
    distinct, so a replay there (masked out of every loss) still divides by a sum of K
    probabilities. `xp=numpy` builds them on the host."""
    k = model_cfg.num_experts_per_tok
    ids = xp.arange(k, dtype=model_cfg.route_dtype)
    return xp.array(xp.broadcast_to(ids, (*shape, k)))


def _stack(states):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *states)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values, one [B, K, S, E] array per layer (separate arrays, so a decode step
    updates each in place) or one [layers, B, K, S, E] array (from a scanned forward), and
    which slots hold real tokens [B, S]."""

    k: tuple[jax.Array, ...] | jax.Array
    v: tuple[jax.Array, ...] | jax.Array
    valid: jax.Array

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, slots: int, *, stacked=False) -> KVCache:
        shape = (batch, cfg.num_kv_heads, slots, cfg.resolved_head_dim)
        dtype = _DTYPES[cfg.dtype]
        if stacked:
            k = v = jnp.zeros((cfg.num_layers, *shape), dtype)
        else:
            k = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
            v = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
        return cls(k=k, v=v, valid=jnp.zeros((batch, slots), jnp.bool_))

    def repeat_rows(self, n: int) -> KVCache:
        """Every row n times in a row (rows r*n .. r*n + n - 1 copy row r)."""
        rows = lambda x, axis: jnp.repeat(x, n, axis=axis)  # noqa: E731
        k, v = (
            rows(c, 1) if isinstance(c, jax.Array) else tuple(rows(x, 0) for x in c)
            for c in (self.k, self.v)
        )
        return KVCache(k=k, v=v, valid=rows(self.valid, 0))


def init_policy(cfg: ModelConfig, seed: int = 0) -> Policy:
    """A randomly initialised policy on one device (sharding.init_sharded builds on a mesh)."""
    return Policy(cfg, rngs=nnx.Rngs(params=seed))


# --------------------------------------------------------------------------- log-probs


def _chunk_logprobs(h_bcd, targets_bc, kernel_dv, head_dtype: str, temperature: float):
    logits_bcv = head_logits(h_bcd, kernel_dv, head_dtype) / temperature
    logz_bc = jax.nn.logsumexp(logits_bcv, axis=-1)
    picked_bc = jnp.take_along_axis(logits_bcv, targets_bc[..., None], axis=-1)[..., 0]
    return picked_bc - logz_bc


def token_logprobs(
    model: Policy,
    tokens_bt,
    *,
    mask_bt=None,
    positions_bt=None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
):
    """log pi(tokens[:, t] | tokens[:, :t]) as float32 [B, T]; position 0 (no context) is 0.

    `temperature` divides the logits, matching what a sampler at that temperature draws from.
    The [B, T, V] logits never exist at once (see `logprobs_from_hidden`).
    """
    h_btd = model.hidden_states(tokens_bt, mask_bt=mask_bt, positions_bt=positions_bt)
    return logprobs_from_hidden(
        h_btd,
        tokens_bt,
        model.head_kernel(),
        head_dtype=model.cfg.lm_head_dtype,
        temperature=temperature,
        chunk_size=chunk_size or model.cfg.logits_chunk_size,
    )


def logprobs_from_hidden(
    h_btd, tokens_bt, kernel_dv, *, head_dtype: str, temperature: float, chunk_size: int
):
    """Per-token log-probs [B, T] from final hidden states; position 0 (no context) is 0."""
    # Position i predicts token i + 1: score hidden states 0..T-2 against tokens 1..T-1.
    logp_bt = score_targets(
        h_btd[:, :-1],
        tokens_bt[:, 1:],
        kernel_dv,
        head_dtype=head_dtype,
        temperature=temperature,
        chunk_size=chunk_size,
    )
    return jnp.pad(logp_bt, ((0, 0), (1, 0)))


def score_targets(
    h_btd, targets_bt, kernel_dv, *, head_dtype: str, temperature: float, chunk_size: int
):
    """log-softmax(h[:, t] @ kernel)[targets[:, t]] [B, T], `chunk_size` positions at a time.

    Each chunk's projection and log-softmax run inside a rematerialised `lax.map` body, so only
    one [B, chunk, V] block of logits is live at a time, in the forward and the backward pass.
    """
    b, t = targets_bt.shape
    chunk_size = max(1, min(chunk_size, t))  # no padding beyond the sequence
    n_chunks = -(-t // chunk_size)
    pad = n_chunks * chunk_size - t
    h_btd = jnp.pad(h_btd, ((0, 0), (0, pad), (0, 0)))
    targets_bt = jnp.pad(targets_bt, ((0, 0), (0, pad)))
    h_nbcd = h_btd.reshape(b, n_chunks, chunk_size, -1).swapaxes(0, 1)
    targets_nbc = targets_bt.reshape(b, n_chunks, chunk_size).swapaxes(0, 1)

    one_chunk = jax.checkpoint(_chunk_logprobs, static_argnums=(3, 4))
    logp_nbc = jax.lax.map(
        lambda xs: one_chunk(*xs, kernel_dv, head_dtype, temperature), (h_nbcd, targets_nbc)
    )
    return logp_nbc.swapaxes(0, 1).reshape(b, -1)[:, :t]


def completion_logprobs(
    model: Policy,
    prompt_tokens_pl,
    prompt_mask_pl,
    tokens_bn,
    mask_bn,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    routes=None,
    return_routes=False,
):
    """log pi(completion token n | prompt, completion tokens before n) as float32 [B, N], for
    B = P x G completions of P left-padded prompts (rows g*G .. g*G + G - 1 continue prompt g).

    Each prompt runs through the model once; its keys and values are shared by its G
    completions, which then run against them as the sampler's cache does. The same numbers as
    `token_logprobs` on the concatenated rows, for a 1/G share of the prompt work (the
    gradient of the shared prompt sums over its completions).

    `routes` [B, L + N, routed layers, K] (router replay): the experts the sampler sent each
    prompt and completion token to, which the forward reuses; with `return_routes`, (log-probs,
    the routers' own choices for the completion tokens [B, N, routed layers, K]).
    """
    p, length = prompt_tokens_pl.shape
    b, n = tokens_bn.shape
    if b % p:
        raise ValueError(f"{b} completions do not split into groups over {p} prompts")
    g = b // p
    cfg = model.cfg
    prompt_mask_pl = prompt_mask_pl.astype(jnp.bool_)
    fused = attention.resolve(
        cfg.attention,
        queries=length + n,
        keys=length + n,
        block_size=cfg.attention_block_size,
        dtype=model.compute_dtype,
        query_offset=0,
        head_dim=cfg.resolved_head_dim,
    )
    if fused == "cudnn":
        # The fused kernel takes self-attention only: run each completion
        # behind its own copy of the prompt (the prompt's work is G times, a small share of
        # long completions), then score as below.
        tokens_bt = jnp.concatenate([jnp.repeat(prompt_tokens_pl, g, axis=0), tokens_bn], 1)
        mask_bt = jnp.concatenate([jnp.repeat(prompt_mask_pl, g, axis=0), mask_bn], 1)
        h_btd, chosen = model.hidden_states(
            tokens_bt, mask_bt=mask_bt, routes=routes, return_routes=True
        )
        hidden_bnd = h_btd[:, length - 1 : length + n - 1]
        chosen = None if chosen is None else chosen[:, length:]
    else:
        # The prompt's cache holds its L slots only; the completions append to it (their own
        # keys live one layer at a time, not in an L + N cache per layer).
        scan = cfg.scan_layers
        cache = KVCache.empty(cfg, p, length, stacked=scan)
        prompt_routes, routes = (None, None) if routes is None else (
            routes[::g, :length], routes[:, length:]
        )  # fmt: skip
        h_pld, cache = model.extend(
            cache, prompt_tokens_pl, default_positions(prompt_mask_pl), prompt_mask_pl, 0,
            scan=scan, routes=prompt_routes,
        )  # fmt: skip
        start_b = jnp.repeat(jnp.sum(prompt_mask_pl, axis=1, dtype=jnp.int32), g)
        positions_bn = start_b[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
        h_bnd, _, chosen = model.extend(
            cache.repeat_rows(g),
            tokens_bn,
            positions_bn,
            mask_bn,
            length,
            scan=scan,
            return_cache=False,
            routes=routes,
            return_routes=True,
        )
        # The prompt's last slot (a real token: prompts are left-padded) predicts completion
        # token 0; completion token n - 1 predicts token n.
        first_b1d = jnp.repeat(h_pld[:, -1:], g, axis=0)
        hidden_bnd = jnp.concatenate([first_b1d, h_bnd[:, :-1]], axis=1)
    logp_bn = score_targets(
        hidden_bnd,
        tokens_bn,
        model.head_kernel(),
        head_dtype=cfg.lm_head_dtype,
        temperature=temperature,
        chunk_size=chunk_size or cfg.logits_chunk_size,
    )
    return (logp_bn, chosen) if return_routes else logp_bn
