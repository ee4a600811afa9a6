"""Lossless acceptance: which drafted tokens the target keeps, and the token it adds.

Per request ``r`` with a verify length ``ℓ_r`` (data, 0..γ), the target has scored
``[anchor, x_1..x_ℓ]``: ``target_logits[r, k]`` is its distribution for the token after position
``k`` (so it judges ``x_{k+1}``). With ``p_k`` and the draft distribution ``q_k`` both after the
request's temperature/top-k/top-p (``dspark_jax.sampling.probabilities``):

* ``x_k`` is accepted with probability ``min(1, p_{k-1}(x_k) / q_k(x_k))``, left to right, until the
  first rejection or ``ℓ``;
* after a rejection at ``k``, the next token is drawn from ``normalize(max(0, p_{k-1} − q_k))``
  (from ``p_{k-1}`` itself when that mass is ~0, which only happens when ``p ≈ q``);
* when all ``ℓ`` pass, a bonus token is drawn from ``p_ℓ``;
* a draft id outside ``[0, V)`` is never verified: ``ℓ`` ends before it, and the verdict flags
  the row (``SpeculativeDecoder`` raises).

The emitted tokens then follow the target's distribution exactly (speculative sampling). Greedy
rows need no special case: their ``p`` and ``q`` are one-hot argmaxes, so acceptance is argmax
matching and the next token is the target's argmax. ``ℓ = 0`` is one plain target decode step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.sampling import SamplingParams, any_sampled, probabilities

# Residual mass at or below this counts as zero (p = q up to rounding): draw from p, as the
# reference does. A rejection happens with probability equal to the residual mass, so a larger
# cut-off would draw from p, not the residual, in rejections that do happen (1e-6 once did).
RESIDUAL_EPS = 1e-8


class Verdict(NamedTuple):
    num_accepted_B: jax.Array  # int32 drafted tokens kept (before any stop truncation)
    emitted_BxE: jax.Array  # int32 [B, γ+1]: x_1..x_a, then the residual/bonus token; -1 after
    num_emitted_B: jax.Array  # int32 tokens of ``emitted`` to commit (cut after a stop id)
    stopped_B: jax.Array  # bool: a stop id is among the committed tokens
    out_of_vocab_B: jax.Array  # bool: the block holds a draft id outside [0, V) (a broken drafter)


def target_probabilities(target_logits_BxWxV: jax.Array, params: SamplingParams) -> jax.Array:
    """``p`` at every verify position, through the same transforms the draft used."""
    batch, width, vocab = target_logits_BxWxV.shape
    flat = target_logits_BxWxV.reshape(batch * width, vocab)
    return probabilities(flat, params.expand(width)).reshape(batch, width, vocab)


def verify(
    draft_tokens_BxG: jax.Array,
    q_BxGxV: jax.Array,
    target_logits_BxWxV: jax.Array,
    verify_len_B: jax.Array,
    params: SamplingParams,
    keys_B: jax.Array,
    stop_ids: jax.Array,
) -> Verdict:
    """Accept a prefix of each row's draft and add one target token (see module docstring).

    ``target_logits`` has a static width ``W``; positions past a row's ``ℓ + 1`` are ignored,
    and a row's ``ℓ`` counts up to ``W − 1`` (the drafts the target scored). ``keys_B`` are this
    round's per-request keys; ``stop_ids`` an int array (possibly empty) of tokens that end a
    request.
    """
    batch, gamma = draft_tokens_BxG.shape
    width = target_logits_BxWxV.shape[1]
    if width < 1:
        raise ValueError("verification needs at least the anchor's position")
    p_BxWxV = target_probabilities(target_logits_BxWxV, params)
    accept_keys, sample_keys = jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k, 2))(keys_B), 1, 0)

    # Acceptance tests for the drafted positions the verify width covers.
    checked = min(gamma, width - 1)
    # A length past the scored drafts would take a rejection where none was tested.
    verify_len_B = jnp.minimum(verify_len_B, checked)
    tokens = draft_tokens_BxG[:, :checked]
    # A draft id outside the vocabulary (a broken drafter: no q can draw one) ends the verified
    # prefix, so the target's own token follows the drafts before it. Indexing p with it would
    # wrap a negative id onto the last token and could accept and commit it.
    in_vocab_BxG = (draft_tokens_BxG >= 0) & (draft_tokens_BxG < p_BxWxV.shape[-1])
    in_vocab = in_vocab_BxG[:, :checked].astype(jnp.int32)
    verify_len_B = jnp.minimum(verify_len_B, jnp.sum(jnp.cumprod(in_vocab, axis=1), axis=1))
    p_of_x = jnp.take_along_axis(p_BxWxV[:, :checked], tokens[..., None], axis=-1)[..., 0]
    q_of_x = jnp.take_along_axis(q_BxGxV[:, :checked], tokens[..., None], axis=-1)[..., 0]
    uniform = jax.vmap(lambda k: jax.random.uniform(k, (checked,)))(accept_keys)
    # u < min(1, p/q)  <=>  u·q < p  (q(x) > 0: x was drawn from q).
    passed = (uniform * q_of_x < p_of_x) & (jnp.arange(checked)[None, :] < verify_len_B[:, None])
    num_accepted = jnp.sum(jnp.cumprod(passed.astype(jnp.int32), axis=1), axis=1)

    # The token after the accepted prefix: residual after a rejection, bonus after a full pass.
    p_next = jnp.take_along_axis(p_BxWxV, num_accepted[:, None, None], axis=1)[:, 0]
    q_padded = jnp.concatenate([q_BxGxV, jnp.zeros_like(q_BxGxV[:, :1])], axis=1)
    q_next = jnp.take_along_axis(q_padded, num_accepted[:, None, None], axis=1)[:, 0]
    rejected = num_accepted < verify_len_B
    residual = jnp.maximum(p_next - q_next, 0.0)
    mass = residual.sum(-1, keepdims=True)
    use_residual = rejected[:, None] & (mass > RESIDUAL_EPS)
    next_dist = jnp.where(use_residual, residual / jnp.where(mass > 0, mass, 1.0), p_next)
    # Greedy rows' next_dist is one-hot, so an all-greedy batch takes its argmax (no draw).
    next_token = jax.lax.cond(
        any_sampled(params),
        lambda: jax.vmap(jax.random.categorical)(sample_keys, jnp.log(next_dist)).astype(jnp.int32),
        lambda: jnp.argmax(next_dist, axis=-1).astype(jnp.int32),
    )

    slots = jnp.arange(gamma + 1)[None, :]
    drafted = jnp.concatenate([draft_tokens_BxG, jnp.zeros((batch, 1), jnp.int32)], axis=1)
    emitted = jnp.where(slots < num_accepted[:, None], drafted, -1)
    emitted = jnp.where(slots == num_accepted[:, None], next_token[:, None], emitted)

    is_stop = jnp.isin(emitted, stop_ids) & (emitted >= 0)
    first_stop = jnp.argmax(is_stop, axis=1)
    stopped = is_stop.any(axis=1)
    num_emitted = jnp.where(stopped, first_stop + 1, num_accepted + 1).astype(jnp.int32)
    emitted = jnp.where(slots < num_emitted[:, None], emitted, -1)
    return Verdict(num_accepted.astype(jnp.int32), emitted.astype(jnp.int32), num_emitted, stopped,
                   ~in_vocab_BxG.all(axis=1))
