"""The parallel block drafter backbone (DFlash-style; spec §1).

Tapped target features are concatenated, projected by ``fc`` (no bias) and RMS-normed into
context rows ``H_ctx``, which become extra keys/values in **every** draft layer; context rows are
never queries. A block is ``[anchor, MASK x (γ−1)]`` embedded with the frozen target embedding
(passed in, never a drafter parameter), and slot ``s`` predicts the token after position
``anchor + s``. Inside a block attention is bidirectional (causal with ``block_causal``); a block
sees context strictly before its anchor (never the anchor's own feature, which does not exist yet
at inference) and never another block.

The same layer code serves training (many anchors per sequence, one attention call with an
explicit mask) and inference (a per-layer context K/V cache appended each round; block K/V are
never stored, so stale drafts cannot persist).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.models.layers import (
    MASK_VALUE,
    Linear,
    RMSNorm,
    SwiGLU,
    apply_rope,
    rope_cos_sin,
    rope_inverse_frequencies,
    write_cache,
)


def context_visible(
    ctx_positions_S: jax.Array, anchors_Q: jax.Array, window: int | None, slot_Q: jax.Array | None = None
) -> jax.Array:
    """``[..., Q, S]``: context slot j is visible to a query whose block anchor is at a iff
    ``j < a``, and with a sliding window ``j >= a - window``, or, counted from the query's own
    position a + s (``slot_Q`` given), ``j > a + s - window``."""
    anchors = anchors_Q[..., :, None]
    visible = ctx_positions_S[..., None, :] < anchors
    if window is not None:
        first = anchors - window if slot_Q is None else anchors + slot_Q[:, None] - window + 1
        visible &= ctx_positions_S[..., None, :] >= first
    return visible


def context_block_attention(
    q_BxQxHxD, k_ctx_BxSxKxD, v_ctx_BxSxKxD, k_blk_BxQxKxD, v_blk_BxQxKxD, ctx_visible_BxQxS, blk_visible_BxQxQ
):
    """Grouped-query attention of block queries over [context ; block] keys, with a finite mask.

    A query with nothing visible (a padding block) gets a uniform softmax, never NaN.
    """
    batch, steps, num_heads, head_dim = q_BxQxHxD.shape
    num_kv = k_ctx_BxSxKxD.shape[2]
    q = q_BxQxHxD.reshape(batch, steps, num_kv, num_heads // num_kv, head_dim)
    keys = jnp.concatenate([k_ctx_BxSxKxD, k_blk_BxQxKxD], axis=1)
    values = jnp.concatenate([v_ctx_BxSxKxD, v_blk_BxQxKxD], axis=1)
    visible = jnp.concatenate([ctx_visible_BxQxS, blk_visible_BxQxQ], axis=-1)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, keys).astype(jnp.float32) * head_dim**-0.5
    scores = jnp.where(visible[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, values)
    return out.reshape(batch, steps, num_heads, head_dim)


class DraftLayer(nnx.Module):
    """A target-shaped pre-norm decoder layer whose attention also reads context K/V."""

    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        b = cfg.backbone
        self.num_heads, self.num_kv_heads, self.head_dim = b.num_heads, b.num_kv_heads, b.head_dim
        self.input_norm = RMSNorm(b.hidden_size, b.rms_norm_eps, dtype)
        # q separate from the fused k/v: context rows need k/v only. Projections start at
        # N(0, 1/fan_in), not DeepSpec's N(0, 0.02): from scratch on SmolLM2's answers, 0.02 ended
        # 250 steps 0.03-0.06 lower in held-out τ (docs/TRAINING.md, "Checked against DeepSpec's code").
        self.q = Linear(b.hidden_size, b.num_heads * b.head_dim, rngs=rngs, dtype=dtype)
        self.kv = Linear(b.hidden_size, 2 * b.num_kv_heads * b.head_dim, rngs=rngs, dtype=dtype)
        self.o = Linear(b.num_heads * b.head_dim, b.hidden_size, rngs=rngs, dtype=dtype)
        self.q_norm = RMSNorm(b.head_dim, b.rms_norm_eps, dtype) if b.qk_norm else None
        self.k_norm = RMSNorm(b.head_dim, b.rms_norm_eps, dtype) if b.qk_norm else None
        self.post_attn_norm = RMSNorm(b.hidden_size, b.rms_norm_eps, dtype)
        self.mlp = SwiGLU(b.hidden_size, b.intermediate_size, rngs=rngs, dtype=dtype)

    def keys_values(self, x_BxTxD, cos, sin):
        """Post-RoPE keys and values of already-normed rows (context or block)."""
        batch, steps, _ = x_BxTxD.shape
        kv = self.kv(x_BxTxD).reshape(batch, steps, 2, self.num_kv_heads, self.head_dim)
        k, v = kv[:, :, 0], kv[:, :, 1]
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), v

    def __call__(self, x_BxQxD, cos, sin, k_ctx, v_ctx, ctx_visible, blk_visible):
        batch, steps, _ = x_BxQxD.shape
        normed = self.input_norm(x_BxQxD)
        q = self.q(normed).reshape(batch, steps, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self.keys_values(normed, cos, sin)
        attn = context_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, ctx_visible, blk_visible)
        x = x_BxQxD + self.o(attn.reshape(batch, steps, -1))
        return x + self.mlp(self.post_attn_norm(x))


class ContextCache(NamedTuple):
    """Per-layer post-RoPE K/V of the projected context rows, and context rows per request."""

    keys: tuple[jax.Array, ...]  # per layer [B, S, num_kv_heads, head_dim]
    values: tuple[jax.Array, ...]
    lengths_B: jax.Array  # int32 [B]: context rows = the position of the next anchor

    @classmethod
    def create(cls, cfg: DrafterConfig, batch: int, max_len: int, dtype=jnp.float32) -> ContextCache:
        b = cfg.backbone
        shape = (batch, max_len, b.num_kv_heads, b.head_dim)
        return cls(
            tuple(jnp.zeros(shape, dtype) for _ in range(b.num_layers)),
            tuple(jnp.zeros(shape, dtype) for _ in range(b.num_layers)),
            jnp.zeros((batch,), jnp.int32),
        )

    def rollback(self, lengths_B: jax.Array) -> ContextCache:
        return self._replace(lengths_B=jnp.minimum(self.lengths_B, lengths_B.astype(jnp.int32)))


class Backbone(nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        b = cfg.backbone
        self.cfg = cfg
        self.fc = Linear(cfg.context_size, b.hidden_size, rngs=rngs, dtype=dtype)
        self.hidden_norm = RMSNorm(b.hidden_size, b.rms_norm_eps, dtype)
        self.layers = nnx.List([DraftLayer(cfg, rngs=rngs, dtype=dtype) for _ in range(b.num_layers)])
        self.final_norm = RMSNorm(b.hidden_size, b.rms_norm_eps, dtype)

    def _rope(self, positions):
        b = self.cfg.backbone
        return rope_cos_sin(positions, rope_inverse_frequencies(b.head_dim, b.rope_theta, b.rope_scaling))

    def _visible(self, layer: int, ctx_positions_S, anchors_BxQ, slot_Q):
        """What draft layer ``layer``'s block queries see: ``(context [B, Q, S], slots [Q, Q])``,
        the context before the anchor (within its window) and the slots of the same block (all,
        or those up to the query's own with ``block_causal``; with ``window_per_slot``, those
        within the window of the query's)."""
        window, per_slot = self.cfg.layer_window(layer), self.cfg.window_per_slot
        ctx = context_visible(ctx_positions_S, anchors_BxQ, window, slot_Q if per_slot else None)
        if self.cfg.layer_block_causal(layer):
            slots = slot_Q[None, :] <= slot_Q[:, None]
        else:
            slots = jnp.ones((slot_Q.shape[0],) * 2, bool)
        if window is not None and per_slot:
            slots &= jnp.abs(slot_Q[:, None] - slot_Q[None, :]) < window
        return ctx, slots

    def project_context(self, features_BxSxF: jax.Array) -> jax.Array:
        """``H_ctx = RMSNorm(fc · F)`` (spec §1.3)."""
        return self.hidden_norm(self.fc(features_BxSxF))

    def embed_blocks(self, embed_VxD, anchor_tokens, keep=None):
        """``[anchor, MASK x (slots−1)]`` per block, through the frozen target embedding.

        ``anchor_tokens [...]`` -> ``[..., slots, d]`` (``cfg.block_slots``); a dropped block
        (``keep`` False) gets MASK in slot 0 too.
        """
        slots, mask = self.cfg.block_slots, self.cfg.mask_token_id
        first = anchor_tokens if keep is None else jnp.where(keep, anchor_tokens, mask)
        tokens = jnp.concatenate(
            [first[..., None], jnp.full((*first.shape, slots - 1), mask, first.dtype)], axis=-1
        )
        return jnp.take(jax.lax.stop_gradient(embed_VxD), tokens, axis=0)

    def forward_train(self, embed_VxD, features_BxSxF, anchors_BxA, anchor_tokens_BxA, keep_BxA):
        """All blocks of a batch of sequences in one pass: ``h [B, A, γ, d]`` (post final norm),
        entry ``k`` drafting the token ``k + 1`` after the anchor.

        Block ``b`` has its anchor at position ``anchors[b]``; it sees context rows ``< anchor``
        (spec §1.7) and its own slots, at positions ``anchor + s`` (spec §1.8); without
        ``draft_from_anchor`` the anchor's slot drafts nothing and is left out of ``h``.
        """
        batch, num_anchors = anchors_BxA.shape
        slots = self.cfg.block_slots
        seq = features_BxSxF.shape[1]
        ctx = self.project_context(features_BxSxF)
        ctx_cos, ctx_sin = self._rope(jnp.broadcast_to(jnp.arange(seq), (batch, seq)))

        x = self.embed_blocks(embed_VxD, anchor_tokens_BxA, keep_BxA).reshape(batch, num_anchors * slots, -1)
        block_anchor_BxQ = jnp.repeat(anchors_BxA, slots, axis=1)
        slot_Q = jnp.tile(jnp.arange(slots), num_anchors)
        cos, sin = self._rope(block_anchor_BxQ + slot_Q)
        keep_BxQ = jnp.repeat(keep_BxA, slots, axis=1)
        block_id_Q = jnp.repeat(jnp.arange(num_anchors), slots)
        same_block_QxQ = block_id_Q[:, None] == block_id_Q[None, :]

        for index, layer in enumerate(self.layers):
            ctx_vis, slot_vis = self._visible(index, jnp.arange(seq), block_anchor_BxQ, slot_Q)
            ctx_vis = ctx_vis & keep_BxQ[..., None]
            blk_vis = (same_block_QxQ & slot_vis)[None] & keep_BxQ[..., None]
            k_ctx, v_ctx = layer.keys_values(ctx, ctx_cos, ctx_sin)
            x = layer(x, cos, sin, k_ctx, v_ctx, ctx_vis, blk_vis)
        return self.final_norm(x).reshape(batch, num_anchors, slots, -1)[:, :, slots - self.cfg.block_size:]

    def extend_context(self, cache: ContextCache, features_BxNxF, n_new_B) -> ContextCache:
        """Append ``n_new_B`` rows of tapped target features per request (the rest is padding)."""
        steps = features_BxNxF.shape[1]
        positions = cache.lengths_B[:, None] + jnp.arange(steps, dtype=jnp.int32)
        cos, sin = self._rope(positions)
        ctx = self.project_context(features_BxNxF)
        keys, values = [], []
        for index, layer in enumerate(self.layers):
            k, v = layer.keys_values(ctx, cos, sin)
            keys.append(write_cache(cache.keys[index], k, positions))
            values.append(write_cache(cache.values[index], v, positions))
        return ContextCache(tuple(keys), tuple(values), cache.lengths_B + n_new_B.astype(jnp.int32))

    def forward_block(self, embed_VxD, cache: ContextCache, anchor_tokens_B) -> jax.Array:
        """One block per request after its context: ``h [B, γ, d]`` (as ``forward_train``'s).

        The anchor sits at position ``cache.lengths_B`` (the context holds every committed token
        before it), so the block sees all cached rows (within the window) and itself.
        """
        slots = self.cfg.block_slots
        batch = anchor_tokens_B.shape[0]
        x = self.embed_blocks(embed_VxD, anchor_tokens_B)
        anchor_BxQ = jnp.broadcast_to(cache.lengths_B[:, None], (batch, slots))
        cos, sin = self._rope(anchor_BxQ + jnp.arange(slots))
        for index, layer in enumerate(self.layers):
            ctx_vis, slot_vis = self._visible(index, jnp.arange(cache.keys[0].shape[1]), anchor_BxQ, jnp.arange(slots))
            blk_vis = jnp.broadcast_to(slot_vis, (batch, slots, slots))
            x = layer(x, cos, sin, cache.keys[index], cache.values[index], ctx_vis, blk_vis)
        return self.final_norm(x)[:, slots - self.cfg.block_size:]
