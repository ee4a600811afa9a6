"""The target decoder (Llama / SmolLM2 / Qwen3) as Flax NNX modules, and its pure-function form.

``Transformer.__call__`` runs new tokens against a ``KVCache`` and returns logits, the raw
outputs of the requested decoder layers (the drafter's context features, spec §1.2: the residual
stream after layer ``l``, *not* the final-norm output) and the updated cache.

Hot paths never call the module directly: ``TargetModel`` splits it once into a graph definition
and a flat list of parameter arrays, and ``TargetModel.apply`` is a pure function of those arrays
that any ``jax.jit`` (ours or a user's) can trace. The layers are a Python loop, so under ``jit``
they are unrolled and every layer's cache is its own (donatable) buffer; ``lax.scan`` over
stacked layers was measured 4x slower for CPU decode.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import TargetConfig
from dspark_jax.models.kv_cache import KVCache
from dspark_jax.models.layers import (
    Attention,
    Linear,
    RMSNorm,
    SwiGLU,
    project,
    rope_cos_sin,
    rope_inverse_frequencies,
    take_per_row,
)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            qk_norm=cfg.qk_norm,
            eps=cfg.rms_norm_eps,
            rngs=rngs,
            dtype=dtype,
        )
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=dtype)

    def __call__(self, x, cos, sin, keys, values, positions_BxT):
        attn_out, keys, values = self.attn(self.input_norm(x), cos, sin, keys, values, positions_BxT)
        x = x + attn_out
        x = x + self.mlp(self.post_attn_norm(x))
        return x, keys, values


class ForwardOutput(NamedTuple):
    logits: jax.Array  # [B, T, V] float32, or [B, V] when ``logits_at_B`` was given
    taps: jax.Array  # [B, T, len(tap_layers) * d]: tapped layer outputs, ascending layer order
    cache: KVCache


class Transformer(nnx.Module):
    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.embed = nnx.Param(
            (jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size)) * 0.02).astype(dtype)
        )
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs, dtype=dtype) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, rngs=rngs, dtype=dtype
        )

    def __call__(
        self,
        tokens_BxT: jax.Array,
        cache: KVCache,
        *,
        n_new_B: jax.Array | None = None,
        logits_at_B: jax.Array | None = None,
        tap_layers: tuple[int, ...] = (),
    ) -> ForwardOutput:
        """Run ``T`` new tokens per row starting at each row's cache length.

        ``n_new_B`` says how many of the ``T`` tokens are real per row (default: all); the rest are
        padding whose cache writes lie past the new length and so are never seen. With
        ``logits_at_B`` only the hidden state at that index per row goes through the LM head,
        which keeps prefill from paying for ``T x V`` logits it does not need.
        """
        # A layer past the last, a repeat or another order would silently change the taps' width or order.
        tap_layers = self.cfg.check_tap_layers(tap_layers)
        batch, steps = tokens_BxT.shape
        if steps > cache.max_len:  # the writes past the end would be dropped and the logits wrong
            raise ValueError(f"{steps} tokens do not fit a KV cache of {cache.max_len} positions")
        positions_BxT = cache.lengths_B[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
        inv_freq = rope_inverse_frequencies(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)
        cos, sin = rope_cos_sin(positions_BxT, inv_freq)

        x = jnp.take(self.embed[...], tokens_BxT, axis=0)
        taps, keys, values = [], [], []
        for index, layer in enumerate(self.layers):
            x, k, v = layer(x, cos, sin, cache.keys[index], cache.values[index], positions_BxT)
            keys.append(k)
            values.append(v)
            if index in tap_layers:
                taps.append(x)
        tapped = (
            jnp.concatenate(taps, axis=-1) if taps else jnp.zeros((batch, steps, 0), x.dtype)
        )

        x = self.final_norm(x)
        if logits_at_B is not None:
            x = take_per_row(x, logits_at_B)
        head = self.embed if self.lm_head is None else self.lm_head.weight
        logits = project(x, head[...]).astype(jnp.float32)

        if n_new_B is None:
            n_new_B = jnp.full((batch,), steps, jnp.int32)
        new_cache = KVCache(tuple(keys), tuple(values), cache.lengths_B + n_new_B.astype(jnp.int32))
        return ForwardOutput(logits, tapped, new_cache)


@dataclasses.dataclass(frozen=True, eq=False)
class TargetModel:
    """A target split once into (graph definition, flat parameter list) for ``jax.jit``.

    ``apply(params, tokens, cache, ...)`` is pure: pass ``self.params`` (or a transformed copy,
    e.g. sharded) explicitly so a jitted caller treats the weights as arguments, not constants.
    Flattening the NNX state once avoids re-walking ``nnx.Variable`` trees on every step.
    """

    cfg: TargetConfig
    graphdef: Any
    treedef: Any
    params: list

    @classmethod
    def from_module(cls, module: Transformer) -> TargetModel:
        graphdef, state = nnx.split(module)
        leaves, treedef = jax.tree.flatten(state)
        return cls(module.cfg, graphdef, treedef, leaves)

    def module(self, params: list | None = None) -> Transformer:
        state = jax.tree.unflatten(self.treedef, self.params if params is None else params)
        return nnx.merge(self.graphdef, state)

    def apply(self, params: list, tokens_BxT, cache: KVCache, **kwargs) -> ForwardOutput:
        return self.module(params)(tokens_BxT, cache, **kwargs)

    def embedding_and_head(self, params: list) -> tuple[jax.Array, jax.Array]:
        """The input embedding ``[V, d]`` and LM head ``[V, d]`` (the same array when tied), which
        drafters share frozen. Call it inside the jitted function that receives ``params``."""
        module = self.module(params)
        head = module.embed if module.lm_head is None else module.lm_head.weight
        return module.embed[...], head[...]

    def truncated(self, num_layers: int) -> TargetModel:
        """The same model keeping only its first ``num_layers`` decoder layers (then the final
        norm and head): a small but real target for tests and the CI training config."""
        if not 1 <= num_layers <= self.cfg.num_layers:
            raise ValueError(f"num_layers must be in [1, {self.cfg.num_layers}], got {num_layers}")
        module = self.module()
        module.layers = nnx.List(list(module.layers)[:num_layers])
        module.cfg = dataclasses.replace(self.cfg, num_layers=num_layers)
        return TargetModel.from_module(module)

    @property
    def dtype(self):
        """The weights' dtype, which the KV cache and activations take."""
        return self.params[0].dtype

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.create(self.cfg, batch, max_len, self.dtype)

    @property
    def num_params(self) -> int:
        return int(sum(p.size for p in self.params))
