"""The one place logits become tokens.

Everything that turns logits into a distribution or a token — target-only decoding, drafting and
verification — goes through these functions, so the distribution a token was sampled from is
exactly the one verification compares against. Parameters are per request (arrays over the batch):

* ``temperature_B``: 0 means greedy (argmax of the raw logits);
* ``top_k_B``: keep the k most likely tokens (ties at the k-th value kept), 0 disables;
* ``top_p_B``: then keep the smallest most-likely set whose mass reaches p, 1 disables.

The order (temperature, then top-k, then top-p on the renormalised top-k distribution) is HF
transformers'. Each request has its own PRNG key; step ``n`` of a request uses
``fold_in(key, n)``, so a request's samples do not depend on which batch it runs in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.config import SamplingConfig


class SamplingParams(NamedTuple):
    temperature_B: jax.Array  # float32 [B]
    top_k_B: jax.Array  # int32 [B]
    top_p_B: jax.Array  # float32 [B]

    @classmethod
    def from_configs(cls, configs: Sequence[SamplingConfig]) -> SamplingParams:
        if not configs:
            raise ValueError("need one SamplingConfig per request, got none")
        return cls(
            jnp.asarray([c.temperature for c in configs], jnp.float32),
            jnp.asarray([c.top_k for c in configs], jnp.int32),
            jnp.asarray([c.top_p for c in configs], jnp.float32),
        )

    @classmethod
    def broadcast(cls, config: SamplingConfig, batch: int) -> SamplingParams:
        return cls.from_configs([config] * batch)

    def expand(self, steps: int) -> SamplingParams:
        """Repeat each request's parameters over ``steps`` positions: [B] -> [B * steps]."""
        return SamplingParams(*(jnp.repeat(x, steps) for x in self))


def filtered_logits(logits_BxV: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature-scaled logits with top-k/top-p exclusions set to -inf (greedy rows: raw logits).

    The descending sort that top-k/top-p need is skipped at run time when no row uses either.
    """
    logits = logits_BxV.astype(jnp.float32)
    greedy_B = params.temperature_B <= 0.0
    scaled = logits / jnp.where(greedy_B, 1.0, params.temperature_B)[:, None]
    needs_filter = jnp.any(~greedy_B & ((params.top_k_B > 0) | (params.top_p_B < 1.0)))

    def apply_filters(x):
        vocab = x.shape[-1]
        sorted_desc = -jnp.sort(-x, axis=-1)
        k_B = jnp.where(params.top_k_B > 0, jnp.minimum(params.top_k_B, vocab), vocab)
        kth_value = jnp.take_along_axis(sorted_desc, (k_B - 1)[:, None], axis=-1)
        x = jnp.where(x < kth_value, -jnp.inf, x)
        # top-p on the top-k-renormalised distribution: keep a token if the mass strictly before
        # it (in descending order) is below p; the most likely token is always kept.
        sorted_desc = jnp.where(jnp.arange(vocab)[None, :] < k_B[:, None], sorted_desc, -jnp.inf)
        probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
        keep_sorted = mass_before < params.top_p_B[:, None]
        cutoff_index = jnp.sum(keep_sorted, axis=-1) - 1
        cutoff_value = jnp.take_along_axis(sorted_desc, cutoff_index[:, None], axis=-1)
        x = jnp.where(x < cutoff_value, -jnp.inf, x)
        return jnp.where(greedy_B[:, None], scaled, x)

    return jax.lax.cond(needs_filter, apply_filters, lambda x: x, scaled)


def probabilities(logits_BxV: jax.Array, params: SamplingParams) -> jax.Array:
    """The distribution each row is sampled from: one-hot argmax for greedy rows."""
    filtered = filtered_logits(logits_BxV, params)
    greedy_B = params.temperature_B <= 0.0
    one_hot = jax.nn.one_hot(jnp.argmax(logits_BxV, axis=-1), logits_BxV.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy_B[:, None], one_hot, jax.nn.softmax(filtered, axis=-1))


def step_keys(keys_B: jax.Array, step_B: jax.Array) -> jax.Array:
    """Per-request keys for one step: ``fold_in(key_b, step_b)``."""
    return jax.vmap(jax.random.fold_in)(keys_B, step_B)


def sample(logits_BxV: jax.Array, params: SamplingParams, keys_B: jax.Array) -> jax.Array:
    """One token per row: argmax for greedy rows, a draw from ``probabilities`` otherwise."""
    filtered = filtered_logits(logits_BxV, params)
    drawn = jax.vmap(jax.random.categorical)(keys_B, filtered)
    greedy = jnp.argmax(logits_BxV, axis=-1)
    return jnp.where(params.temperature_B <= 0.0, greedy, drawn).astype(jnp.int32)


def request_keys(seeds: Sequence[int]) -> jax.Array:
    """One PRNG key per request from integer seeds (raw uint32 key data, vmappable)."""
    return jnp.stack([jax.random.PRNGKey(int(s)) for s in seeds])
