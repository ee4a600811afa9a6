"""Building blocks of the Llama family: RMSNorm, RoPE, GQA attention over a static cache, SwiGLU.

Weights are stored ``[out, in]`` (the torch/HF layout) and applied with an NT contraction
(``einsum('...k,nk->...n')``): on XLA:CPU that is markedly cheaper for the skinny products of
decoding than the ``[in, out]`` layout (see ``shared/reference/cpu_feasibility.md``). The q/k/v and
gate/up projections are fused so each decoder layer streams three weight matrices, not seven.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import RopeScaling

# A large finite negative instead of -inf: a fully masked row then gives a uniform softmax
# rather than NaN (padding rows exist in batched prefill).
MASK_VALUE = -1e30


# Row counts (batch x new tokens) for which XLA:CPU gets a skinny product faster as a broadcast
# multiply + sum than as a dot: jaxlib 0.10 lowers M >= 2 dots to a YNNPACK dot that is slow for
# thin matrices, while the multiply-reduce becomes a YNNPACK reduce fusion that streams each
# weight row once (T(8)/T(1) of the SmolLM2 forward: 2.05 -> 1.53; docs/BENCHMARKS.md). M = 1
# stays a dot (the reduce form is pathological there), as do prefills and all non-CPU backends.
SKINNY_ROWS = (2, 64)


def project(x: jax.Array, weight_NxK: jax.Array) -> jax.Array:
    """``x @ weight.T`` for ``[out, in]`` weights, in the fastest form for this backend and shape."""
    rows = math.prod(x.shape[:-1])
    if jax.default_backend() == "cpu" and SKINNY_ROWS[0] <= rows <= SKINNY_ROWS[1]:
        flat = x.reshape(rows, x.shape[-1])
        out = (weight_NxK[None, :, :] * flat[:, None, :]).sum(-1)
        return out.reshape(*x.shape[:-1], weight_NxK.shape[0])
    return jnp.einsum("...k,nk->...n", x, weight_NxK)


class Linear(nnx.Module):
    """A bias-free projection with ``[out, in]`` weights."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        init_std: float | None = None,
    ):
        """Weights ~ N(0, init_std²); the default ``1/sqrt(in_features)`` keeps activations O(1)."""
        std = 1.0 / math.sqrt(in_features) if init_std is None else init_std
        self.weight = nnx.Param(
            (jax.random.normal(rngs.params(), (out_features, in_features)) * std).astype(dtype)
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return project(x, self.weight[...])


class RMSNorm(nnx.Module):
    """RMSNorm as HF Llama/Qwen3 compute it: normalise in float32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> jax.Array:
    """Per-pair rotation frequencies, with Llama-3 frequency-dependent scaling when configured."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables ``[..., head_dim]`` for integer positions (HF's half-split layout)."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [B, T, heads, D]`` with ``cos/sin [B, T, D]`` (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def take_per_row(values_BxSx: jax.Array, index_Bx: jax.Array) -> jax.Array:
    """``values[b, index[b, ...], ...]``: each row's own positions, ``index`` of shape ``[B]`` or
    ``[B, ...]``. Mapped over rows for the reason ``write_cache`` gives."""
    return jax.vmap(lambda values_Sx, index_x: values_Sx[index_x])(values_BxSx, index_Bx)


def write_cache(cache_BxSxKxD: jax.Array, new_BxTxKxD: jax.Array, positions_BxT: jax.Array):
    """Write new rows at per-row positions; writes past the cache end are dropped.

    Mapped over rows so that the scatter's row dimension is a batching dimension: a batch split
    across devices then writes each row's cache where it lives. Indexing with a row-index array
    instead makes XLA's partitioner gather every row's keys onto every device."""

    def write_row(cache_SxKxD, new_TxKxD, positions_T):
        return cache_SxKxD.at[positions_T].set(new_TxKxD.astype(cache_SxKxD.dtype), mode="drop")

    return jax.vmap(write_row)(cache_BxSxKxD, new_BxTxKxD, positions_BxT)


def cached_attention(
    q_BxTxHxD: jax.Array,
    keys_BxSxKxD: jax.Array,
    values_BxSxKxD: jax.Array,
    positions_BxT: jax.Array,
    window: int | None = None,
) -> jax.Array:
    """Causal grouped-query attention of new queries over the whole static cache.

    Query at absolute position p sees cache slots ``s <= p`` (and ``s > p - window`` with a sliding
    window); the new keys must already be written. Slots past a row's length hold stale data from
    rolled-back steps and are masked by the same rule, which is what makes rollback a matter of
    moving lengths.
    """
    batch, steps, num_heads, head_dim = q_BxTxHxD.shape
    num_kv = keys_BxSxKxD.shape[2]
    q = q_BxTxHxD.reshape(batch, steps, num_kv, num_heads // num_kv, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, keys_BxSxKxD).astype(jnp.float32)
    scores = scores / math.sqrt(head_dim)
    slots = jnp.arange(keys_BxSxKxD.shape[1])
    visible_BxTxS = slots[None, None, :] <= positions_BxT[:, :, None]
    if window is not None:
        visible_BxTxS &= slots[None, None, :] > positions_BxT[:, :, None] - window
    scores = jnp.where(visible_BxTxS[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(values_BxSxKxD.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, values_BxSxKxD)
    return out.reshape(batch, steps, num_heads, head_dim)


def split_qkv(fused_BxTxN: jax.Array, num_heads: int, num_kv_heads: int, head_dim: int):
    """``(q [B, T, H, hd], k [B, T, K, hd], v [B, T, K, hd])`` of a fused q/k/v projection's output."""
    heads = fused_BxTxN.reshape(*fused_BxTxN.shape[:-1], num_heads + 2 * num_kv_heads, head_dim)
    v_start = num_heads + num_kv_heads
    return heads[..., :num_heads, :], heads[..., num_heads:v_start, :], heads[..., v_start:, :]


class Attention(nnx.Module):
    """GQA self-attention with fused q/k/v, optional per-head QK-norm (Qwen3) and RoPE."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qk_norm: bool,
        eps: float,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
    ):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qkv = Linear(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, rngs=rngs, dtype=dtype)
        self.o = Linear(num_heads * head_dim, hidden_size, rngs=rngs, dtype=dtype)
        self.q_norm = RMSNorm(head_dim, eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps, dtype) if qk_norm else None

    def __call__(self, x_BxTxD, cos, sin, keys, values, positions_BxT):
        batch, steps, _ = x_BxTxD.shape
        q, k, v = split_qkv(self.qkv(x_BxTxD), self.num_heads, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys = write_cache(keys, k, positions_BxT)
        values = write_cache(values, v, positions_BxT)
        out = cached_attention(q, keys, values, positions_BxT)
        return self.o(out.reshape(batch, steps, -1)), keys, values


class SwiGLU(nnx.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matrix."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.gate_up = Linear(hidden_size, 2 * intermediate_size, rngs=rngs, dtype=dtype)
        self.down = Linear(intermediate_size, hidden_size, rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = jnp.split(self.gate_up(x), 2, axis=-1)
        return self.down(jax.nn.silu(gate) * up)
