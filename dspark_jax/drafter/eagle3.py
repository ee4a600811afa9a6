"""EAGLE-3-style autoregressive drafter, the baseline DSpark is compared with (spec §8.2).

One decoder layer whose attention input is ``[RMSNorm(e_{t+1}) ; RMSNorm(g_t)]`` (2d wide) and
whose residual stream is ``g_t``: the projected target feature ``fc · F_t`` (no norm) at step 0,
the drafter's own previous output at later steps. Position ``t`` pairs the feature of ``t`` with
the embedding of token ``x_{t+1}`` and predicts the target's distribution over ``x_{t+2}``. More
layers, where a checkpoint has them (speculators and vLLM stack them), are plain pre-norm decoder
layers over that layer's output; the last one's output is the next step's ``g``.

Training unrolls γ "training-time test" steps in one pass per step: at step k a query at index
t sees the step-0 keys at positions ``<= t`` and its own keys from steps 1..k (the SpecForge
TTT mask), in every layer, with RoPE positions offset by k. Inference runs the same layers
causally over a KV cache: the committed (feature, next-token) pairs, then one proposal step per
draft token.

speculators' variants (``DrafterConfig.eagle3_*``, read from its checkpoints) add RMSNorms on the
features before ``fc``, start the first layer's residual stream from the normed ``g_t``, feed the
final norm's output back as the next step's ``g`` (and to the head, without a second norm), and
may limit the attention to a sliding window of positions.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.drafter.heads import DraftBlock, scatter_to_target
from dspark_jax.drafter.model import ReducedHeadMixin, make_reduced_head
from dspark_jax.models.kv_cache import KVCache
from dspark_jax.models.layers import (
    MASK_VALUE,
    Linear,
    RMSNorm,
    SwiGLU,
    apply_rope,
    cached_attention,
    project,
    rope_cos_sin,
    rope_inverse_frequencies,
    split_qkv,
    write_cache,
)
from dspark_jax.sampling import SamplingParams, probabilities, sample


class Eagle3Context(NamedTuple):
    """The committed pairs ``(F_t, x_{t+1})``, ``t < a`` (``a``: the anchor's position): their K/V
    at positions ``0..a-1`` and the layer's output at ``a-1``. That output has seen the anchor
    (paired with ``F_{a-1}``), so it already predicts ``x_{a+1}``, the first draft token."""

    cache: KVCache
    hidden_BxD: jax.Array


class _LayerBody:
    """What every EAGLE-3 draft layer has past its input: fused q/k/v (QK-normed where the target
    is) with RoPE, the attention's output projection and a SwiGLU MLP, each added to the residual
    stream. The first layer's input is 2d wide, a later layer's d."""

    def _build_body(self, b: TargetConfig, input_width: int, rngs: nnx.Rngs, dtype):
        self.num_heads, self.num_kv_heads, self.head_dim = b.num_heads, b.num_kv_heads, b.head_dim
        self.qkv = Linear(input_width, (b.num_heads + 2 * b.num_kv_heads) * b.head_dim, rngs=rngs, dtype=dtype)
        self.o = Linear(b.num_heads * b.head_dim, b.hidden_size, rngs=rngs, dtype=dtype)
        self.q_norm = RMSNorm(b.head_dim, b.rms_norm_eps, dtype) if b.qk_norm else None
        self.k_norm = RMSNorm(b.head_dim, b.rms_norm_eps, dtype) if b.qk_norm else None
        self.post_attn_norm = RMSNorm(b.hidden_size, b.rms_norm_eps, dtype)
        self.mlp = SwiGLU(b.hidden_size, b.intermediate_size, rngs=rngs, dtype=dtype)

    def project_qkv(self, x_BxTxW, cos, sin):
        q, k, v = split_qkv(self.qkv(x_BxTxW), self.num_heads, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def add_attention_and_mlp(self, residual_BxTxD, attn_BxTxHxD):
        batch, steps = attn_BxTxHxD.shape[:2]
        x = residual_BxTxD + self.o(attn_BxTxHxD.reshape(batch, steps, -1))
        return x + self.mlp(self.post_attn_norm(x))


class Eagle3Layer(_LayerBody, nnx.Module):
    """A later draft layer: a pre-norm decoder layer over the previous layer's output."""

    def __init__(self, b: TargetConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.input_norm = RMSNorm(b.hidden_size, b.rms_norm_eps, dtype)
        self._build_body(b, b.hidden_size, rngs, dtype)


def ttt_attention(q_BxSxHxD, base_keys, base_values, own_keys, own_values, visible_SxS):
    """A training-time-test step's attention at each index t: over the step-0 keys the mask shows,
    and over the same index's own keys of later steps (one score per step, ``own_*`` [B, S, K, hd])."""
    batch, seq, num_heads, head_dim = q_BxSxHxD.shape
    num_kv = base_keys.shape[2]
    qg = q_BxSxHxD.reshape(batch, seq, num_kv, num_heads // num_kv, head_dim)
    scale = head_dim**-0.5
    base = jnp.einsum("btkgd,bskd->btkgs", qg, base_keys).astype(jnp.float32) * scale
    base = jnp.where(visible_SxS[None, :, None, None, :], base, MASK_VALUE)
    own = [jnp.einsum("btkgd,btkd->btkg", qg, k).astype(jnp.float32)[..., None] * scale for k in own_keys]
    probs = jax.nn.softmax(jnp.concatenate([base, *own], axis=-1), axis=-1)
    out = jnp.einsum("btkgs,bskd->btkgd", probs[..., :seq], base_values)
    for column, v in enumerate(own_values):
        out = out + probs[..., seq + column, None] * v[:, :, :, None, :]
    return out.reshape(batch, seq, num_heads, head_dim)


class Eagle3Drafter(ReducedHeadMixin, _LayerBody, nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, draft_vocab_ids=None):
        b = cfg.backbone
        self.cfg = cfg
        d = b.hidden_size
        # speculators' variants RMS-normalise the features before fc: all at once, or each tapped layer's.
        widths = {"none": [], "joint": [cfg.context_size], "per_layer": [d] * len(cfg.tap_layers)}
        self.feature_norms = nnx.List([RMSNorm(w, b.rms_norm_eps, dtype) for w in widths[cfg.eagle3_feature_norm]])
        self.fc = Linear(cfg.context_size, d, rngs=rngs, dtype=dtype)
        # The first layer's weights sit on the drafter itself: the one-layer drafters saved before
        # later layers existed keep their tensor names.
        self.embed_norm = RMSNorm(d, b.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(d, b.rms_norm_eps, dtype)
        self._build_body(b, 2 * d, rngs, dtype)
        self.later_layers = nnx.List([Eagle3Layer(b, rngs=rngs, dtype=dtype) for _ in range(b.num_layers - 1)])
        self.final_norm = RMSNorm(d, b.rms_norm_eps, dtype)
        # EAGLE-3 proper drafts over a reduced vocabulary; without one, the frozen target head.
        self.draft_head = make_reduced_head(cfg, draft_vocab_ids, rngs, dtype)

    # ---------------------------------------------------------------------------------------
    # shared pieces

    def _layers(self, g_BxTxD, e_BxTxD, positions_BxT, attend):
        """The drafter's output for (hidden, embedding) pairs at ``positions``: the next step's
        hidden state. ``attend(layer, q, k, v)`` is each layer's attention, training's or the cache's.

        The first layer reads ``[RMSNorm(e) ; RMSNorm(g)]``; its residual stream starts from ``g``,
        or from the normed ``g`` with ``eagle3_norm_before_residual``."""
        b = self.cfg.backbone
        cos, sin = rope_cos_sin(positions_BxT, rope_inverse_frequencies(b.head_dim, b.rope_theta, b.rope_scaling))
        normed = self.hidden_norm(g_BxTxD)
        x = jnp.concatenate([self.embed_norm(e_BxTxD), normed], axis=-1)
        h = self.add_attention_and_mlp(normed if self.cfg.eagle3_norm_before_residual else g_BxTxD,
                                       attend(0, *self.project_qkv(x, cos, sin)))
        for index, layer in enumerate(self.later_layers, start=1):
            h = layer.add_attention_and_mlp(h, attend(index, *layer.project_qkv(layer.input_norm(h), cos, sin)))
        return self.final_norm(h) if self.cfg.eagle3_norm_output else h

    def project_features(self, features_BxTxF):
        if self.feature_norms:
            chunks = jnp.split(features_BxTxF, len(self.feature_norms), axis=-1)
            features_BxTxF = jnp.concatenate([norm(c) for norm, c in zip(self.feature_norms, chunks)], axis=-1)
        return self.fc(features_BxTxF)

    def logits(self, hidden_BxTxD, lm_head_VxD):
        """Logits over the draft vocabulary: the reduced head, or the frozen target head (both
        after the trainable final norm, which ``eagle3_norm_output`` hidden states have had)."""
        normed = hidden_BxTxD if self.cfg.eagle3_norm_output else self.final_norm(hidden_BxTxD)
        if self.draft_head is not None:
            return self.draft_head(normed)
        return project(normed, jax.lax.stop_gradient(lm_head_VxD)).astype(jnp.float32)

    # ---------------------------------------------------------------------------------------
    # training: γ TTT steps

    def forward_train(self, embed_VxD, features_BxSxF, tokens_BxS, steps: int | None = None):
        """Output hidden states ``[K, B, S, d]`` of the K training-time-test steps.

        At step k, index t holds the embedding of ``tokens[t + 1 + k]`` (the token after the one
        step k-1 predicted; zero past the end) at RoPE position ``t + k``; the output predicts the
        target distribution over ``tokens[t + 2 + k]``.
        """
        steps = self.cfg.block_size if steps is None else steps
        batch, seq = tokens_BxS.shape
        embed = jax.lax.stop_gradient(embed_VxD)
        g = self.project_features(features_BxSxF)
        positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
        index = jnp.arange(seq)
        causal_SxS = index[None, :] <= index[:, None]
        num_layers = 1 + len(self.later_layers)
        base = [None] * num_layers  # per layer: the step-0 keys and values
        own = [[] for _ in range(num_layers)]  # per layer: the keys and values of steps 1, 2, ...
        outputs = []
        for k in range(steps):
            shifted = jnp.concatenate(
                [tokens_BxS[:, k + 1 :], jnp.zeros((batch, k + 1), tokens_BxS.dtype)], axis=1
            )

            def attend(layer, q, key, value, k=k):
                if k == 0:
                    base[layer] = key, value
                else:
                    own[layer].append((key, value))
                # A sliding window counts positions, as cached inference sees them: the query at
                # t + k sees step-0 keys after t + k - window and its own keys of steps j > k - window.
                # (speculators' training forward windows the step-0 keys by the index t instead.)
                window = self.cfg.layer_window(layer)
                visible_SxS = causal_SxS if window is None else causal_SxS & (index[None, :] > index[:, None] + k - window)
                seen = [j for j in range(k) if window is None or j + 1 > k - window]  # own[layer][j]: step j + 1's
                keys, values = [own[layer][j][0] for j in seen], [own[layer][j][1] for j in seen]
                return ttt_attention(q, *base[layer], keys, values, visible_SxS)

            g = self._layers(g, jnp.take(embed, shifted, axis=0), positions + k, attend)
            outputs.append(g)
        return jnp.stack(outputs)

    # ---------------------------------------------------------------------------------------
    # inference: causal over a KV cache

    def new_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
        shape = (batch, max_len, self.num_kv_heads, self.head_dim)
        layers = range(1 + len(self.later_layers))
        return KVCache(tuple(jnp.zeros(shape, dtype) for _ in layers), tuple(jnp.zeros(shape, dtype) for _ in layers),
                       jnp.zeros((batch,), jnp.int32))

    def forward_cached(self, g_BxTxD, next_tokens_BxT, embed_VxD, cache: KVCache, n_new_B=None):
        """Run (hidden, next-token) pairs causally after the cache: ``(hidden [B, T, d], cache)``.

        For committed context, ``g`` is ``project_features(F_t)``; for a proposal step it is the
        previous step's output hidden.
        """
        batch, steps, _ = g_BxTxD.shape
        positions = cache.lengths_B[:, None] + jnp.arange(steps, dtype=jnp.int32)
        keys, values = list(cache.keys), list(cache.values)

        def attend(layer, q, k, v):
            keys[layer] = write_cache(keys[layer], k, positions)
            values[layer] = write_cache(values[layer], v, positions)
            return cached_attention(q, keys[layer], values[layer], positions, self.cfg.layer_window(layer))

        e = jnp.take(jax.lax.stop_gradient(embed_VxD), next_tokens_BxT, axis=0)
        hidden = self._layers(g_BxTxD, e, positions, attend)
        n_new_B = jnp.full((batch,), steps, jnp.int32) if n_new_B is None else n_new_B
        return hidden, KVCache(tuple(keys), tuple(values), cache.lengths_B + n_new_B.astype(jnp.int32))

    # ---------------------------------------------------------------------------------------
    # speculative decoding (the SpeculativeDrafter interface, dspark_jax.drafter.interface)

    def new_context(self, batch: int, max_len: int, dtype=jnp.float32) -> Eagle3Context:
        return Eagle3Context(self.new_cache(batch, max_len, dtype), jnp.zeros((batch, self.cfg.hidden_size), dtype))

    def extend_context(self, embed_VxD, context: Eagle3Context, features_BxTxF, next_tokens_BxT, n_new_B):
        """Commit pairs ``(F_t, x_{t+1})`` at positions ``a..a+n-1`` and keep the last one's output."""
        hidden, cache = self.forward_cached(
            self.project_features(features_BxTxF), next_tokens_BxT, embed_VxD, context.cache, n_new_B
        )
        last = jnp.take_along_axis(hidden, jnp.maximum(n_new_B - 1, 0)[:, None, None], axis=1)[:, 0]
        last = jnp.where((n_new_B > 0)[:, None], last, context.hidden_BxD)  # nothing committed: keep
        return Eagle3Context(cache, last.astype(context.hidden_BxD.dtype))

    def propose(
        self,
        embed_VxD: jax.Array,
        lm_head_VxD: jax.Array,
        context: Eagle3Context,
        anchor_B: jax.Array,
        params: SamplingParams,
        keys_BxG: jax.Array,
    ) -> tuple[DraftBlock, None]:
        """γ draft tokens, drawn autoregressively; no confidence head.

        Token 1 comes from the context's last output; step ``k >= 1`` runs the layer on (previous
        output, ``x_{a+k}``) at position ``a+k-1``, whose K/V row goes into this call's copy of the
        cache only, so the committed context never holds a speculative row.
        """

        d2t = self.d2t_N

        def draw(hidden_BxD, keys_B):
            logits_BxN = self.logits(hidden_BxD, lm_head_VxD)
            index_B = sample(logits_BxN, params, keys_B)
            token_B = index_B if d2t is None else d2t[index_B]
            q_BxV = scatter_to_target(probabilities(logits_BxN, params), d2t, self.cfg.vocab_size)
            return token_B, logits_BxN, q_BxV

        def step(carry, keys_B):
            hidden_BxD, cache, token_B = carry
            out, cache = self.forward_cached(hidden_BxD[:, None], token_B[:, None], embed_VxD, cache)
            hidden_BxD = out[:, 0].astype(hidden_BxD.dtype)
            drawn = draw(hidden_BxD, keys_B)
            return (hidden_BxD, cache, drawn[0]), drawn

        first = draw(context.hidden_BxD, keys_BxG[:, 0])
        carry = (context.hidden_BxD, context.cache, first[0])
        _, rest = jax.lax.scan(step, carry, jnp.moveaxis(keys_BxG[:, 1:], 1, 0))
        tokens_BxG, logits_BxGxN, q_BxGxV = (
            jnp.concatenate([x0[:, None], jnp.moveaxis(xs, 0, 1)], axis=1) for x0, xs in zip(first, rest)
        )
        prev_BxG = jnp.concatenate([anchor_B.astype(jnp.int32)[:, None], tokens_BxG[:, :-1]], axis=1)
        return DraftBlock(tokens_BxG, logits_BxGxN, q_BxGxV, prev_BxG), None
