"""EAGLE-3-style autoregressive drafter, the baseline DSpark is compared with (spec §8.2).

One decoder layer whose attention input is ``[RMSNorm(e_{t+1}) ; RMSNorm(g_t)]`` (2d wide) and
whose residual stream is ``g_t``: the projected target feature ``fc · F_t`` (no norm) at step 0,
the layer's own previous output at later steps. Position ``t`` pairs the feature of ``t`` with
the embedding of token ``x_{t+1}`` and predicts the target's distribution over ``x_{t+2}``.

Training unrolls γ "training-time test" steps in one pass per step: at step k a query at index
t sees the step-0 keys at positions ``<= t`` and its own keys from steps 1..k (the SpecForge
TTT mask), with RoPE positions offset by k. Inference runs the same layer causally over a
KV cache: the committed (feature, next-token) pairs, then one proposal step per draft token.

speculators' variants (``DrafterConfig.eagle3_*``, read from its checkpoints) add RMSNorms on the
features before ``fc``, start the residual stream from the normed ``g_t``, feed the final norm's
output back as the next step's ``g`` (and to the head, without a second norm), and may limit the
attention to a sliding window of positions.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import DrafterConfig
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
    write_cache,
)
from dspark_jax.sampling import SamplingParams, probabilities, sample


class Eagle3Context(NamedTuple):
    """The committed pairs ``(F_t, x_{t+1})``, ``t < a`` (``a``: the anchor's position): their K/V
    at positions ``0..a-1`` and the layer's output at ``a-1``. That output has seen the anchor
    (paired with ``F_{a-1}``), so it already predicts ``x_{a+1}``, the first draft token."""

    cache: KVCache
    hidden_BxD: jax.Array


class Eagle3Drafter(ReducedHeadMixin, nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, draft_vocab_ids=None):
        b = cfg.backbone
        if b.num_layers != 1:
            raise ValueError(f"the EAGLE-3 drafter has exactly one layer, config asks for {b.num_layers}")
        self.cfg = cfg
        d = b.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = b.num_heads, b.num_kv_heads, b.head_dim
        # speculators' variants RMS-normalise the features before fc: all at once, or each tapped layer's.
        widths = {"none": [], "joint": [cfg.context_size], "per_layer": [d] * len(cfg.tap_layers)}
        self.feature_norms = nnx.List([RMSNorm(w, b.rms_norm_eps, dtype) for w in widths[cfg.eagle3_feature_norm]])
        self.fc = Linear(cfg.context_size, d, rngs=rngs, dtype=dtype)
        self.embed_norm = RMSNorm(d, b.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(d, b.rms_norm_eps, dtype)
        self.qkv = Linear(2 * d, (b.num_heads + 2 * b.num_kv_heads) * b.head_dim, rngs=rngs, dtype=dtype)
        self.o = Linear(b.num_heads * b.head_dim, d, rngs=rngs, dtype=dtype)
        self.q_norm = RMSNorm(b.head_dim, b.rms_norm_eps, dtype) if b.qk_norm else None
        self.k_norm = RMSNorm(b.head_dim, b.rms_norm_eps, dtype) if b.qk_norm else None
        self.post_attn_norm = RMSNorm(d, b.rms_norm_eps, dtype)
        self.mlp = SwiGLU(d, b.intermediate_size, rngs=rngs, dtype=dtype)
        self.final_norm = RMSNorm(d, b.rms_norm_eps, dtype)
        # EAGLE-3 proper drafts over a reduced vocabulary; without one, the frozen target head.
        self.draft_head = make_reduced_head(cfg, draft_vocab_ids, rngs, dtype)

    # ---------------------------------------------------------------------------------------
    # shared pieces

    def _rope(self, positions):
        b = self.cfg.backbone
        return rope_cos_sin(positions, rope_inverse_frequencies(b.head_dim, b.rope_theta, b.rope_scaling))

    def _layer_input(self, g_BxTxD, e_BxTxD):
        """The attention's input ``[RMSNorm(e) ; RMSNorm(g)]`` and where the residual stream starts:
        ``g``, or its normed copy with ``eagle3_norm_before_residual``."""
        normed = self.hidden_norm(g_BxTxD)
        residual = normed if self.cfg.eagle3_norm_before_residual else g_BxTxD
        return jnp.concatenate([self.embed_norm(e_BxTxD), normed], axis=-1), residual

    def _qkv(self, x_BxTx2D, positions_BxT):
        batch, steps, _ = x_BxTx2D.shape
        qkv = self.qkv(x_BxTx2D).reshape(batch, steps, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q = qkv[:, :, : self.num_heads]
        k = qkv[:, :, self.num_heads : self.num_heads + self.num_kv_heads]
        v = qkv[:, :, self.num_heads + self.num_kv_heads :]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self._rope(positions_BxT)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _finish(self, residual_BxTxD, attn_BxTxHxD):
        """The layer's output: the next step's hidden state (normed with ``eagle3_norm_output``)."""
        batch, steps = attn_BxTxHxD.shape[:2]
        x = residual_BxTxD + self.o(attn_BxTxHxD.reshape(batch, steps, -1))
        x = x + self.mlp(self.post_attn_norm(x))
        return self.final_norm(x) if self.cfg.eagle3_norm_output else x

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
        window = self.cfg.sliding_window
        groups = self.num_heads // self.num_kv_heads
        outputs, diag_keys, diag_values = [], [], []
        for k in range(steps):
            shifted = jnp.concatenate(
                [tokens_BxS[:, k + 1 :], jnp.zeros((batch, k + 1), tokens_BxS.dtype)], axis=1
            )
            x, residual = self._layer_input(g, jnp.take(embed, shifted, axis=0))
            q, key, value = self._qkv(x, positions + k)
            if k == 0:
                base_k, base_v = key, value
            else:
                diag_keys.append(key)
                diag_values.append(value)
            # A sliding window counts positions, as cached inference sees them: the query at t + k
            # sees step-0 keys after t + k - window and its own keys of steps j > k - window.
            # (speculators' training forward windows the step-0 keys by the index t instead.)
            visible_SxS = causal_SxS if window is None else causal_SxS & (index[None, :] > index[:, None] + k - window)
            own = [j for j in range(k) if window is None or j + 1 > k - window]  # diag_keys[j]: step j + 1's
            qg = q.reshape(batch, seq, self.num_kv_heads, groups, self.head_dim)
            scale = self.head_dim**-0.5
            base = jnp.einsum("btkgd,bskd->btkgs", qg, base_k).astype(jnp.float32) * scale
            base = jnp.where(visible_SxS[None, :, None, None, :], base, MASK_VALUE)
            # Own keys of steps 1..k: one extra score per step, at the same index t.
            diag = [jnp.einsum("btkgd,btkd->btkg", qg, diag_keys[j]).astype(jnp.float32)[..., None] * scale for j in own]
            probs = jax.nn.softmax(jnp.concatenate([base, *diag], axis=-1), axis=-1)
            out = jnp.einsum("btkgs,bskd->btkgd", probs[..., :seq], base_v)
            for column, j in enumerate(own):
                out = out + probs[..., seq + column, None] * diag_values[j][:, :, :, None, :]
            g = self._finish(residual, out.reshape(batch, seq, self.num_heads, self.head_dim))
            outputs.append(g)
        return jnp.stack(outputs)

    # ---------------------------------------------------------------------------------------
    # inference: causal over a KV cache

    def new_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
        shape = (batch, max_len, self.num_kv_heads, self.head_dim)
        return KVCache((jnp.zeros(shape, dtype),), (jnp.zeros(shape, dtype),), jnp.zeros((batch,), jnp.int32))

    def forward_cached(self, g_BxTxD, next_tokens_BxT, embed_VxD, cache: KVCache, n_new_B=None):
        """Run (hidden, next-token) pairs causally after the cache: ``(hidden [B, T, d], cache)``.

        For committed context, ``g`` is ``project_features(F_t)``; for a proposal step it is the
        previous step's output hidden.
        """
        batch, steps, _ = g_BxTxD.shape
        positions = cache.lengths_B[:, None] + jnp.arange(steps, dtype=jnp.int32)
        e = jnp.take(jax.lax.stop_gradient(embed_VxD), next_tokens_BxT, axis=0)
        x, residual = self._layer_input(g_BxTxD, e)
        q, k, v = self._qkv(x, positions)
        keys = write_cache(cache.keys[0], k, positions)
        values = write_cache(cache.values[0], v, positions)
        hidden = self._finish(residual, cached_attention(q, keys, values, positions, self.cfg.sliding_window))
        n_new_B = jnp.full((batch,), steps, jnp.int32) if n_new_B is None else n_new_B
        return hidden, KVCache((keys,), (values,), cache.lengths_B + n_new_B.astype(jnp.int32))

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
