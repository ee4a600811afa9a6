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
import numpy as np

from dspark_jax.config import SamplingConfig


class SamplingParams(NamedTuple):
    temperature_B: jax.Array  # float32 [B]
    top_k_B: jax.Array  # int32 [B]
    top_p_B: jax.Array  # float32 [B]

    @classmethod
    def from_configs(cls, configs: Sequence[SamplingConfig]) -> SamplingParams:
        if not configs:
            raise ValueError("need one SamplingConfig per request, got none")
        # Through numpy, which converts a list in C: jnp.asarray of a Python list goes element by
        # element (12.8 s for the three lists of 8.4M requests, 1.1 s this way).
        return cls(
            jnp.asarray(np.array([c.temperature for c in configs], np.float32)),
            jnp.asarray(np.array([c.top_k for c in configs], np.int32)),
            jnp.asarray(np.array([c.top_p for c in configs], np.float32)),
        )

    @classmethod
    def broadcast(cls, config: SamplingConfig, batch: int) -> SamplingParams:
        return cls.from_configs([config]).expand(batch)

    def expand(self, steps: int) -> SamplingParams:
        """Repeat each request's parameters over ``steps`` positions: [B] -> [B * steps]."""
        return SamplingParams(*(jnp.repeat(x, steps) for x in self))


# Top-k and top-p only look at the head of the sorted logits: the k-th value, and the mass down
# to the top-p cutoff. A partial sort of this many candidates (``lax.top_k``) settles both for
# the usual settings (top-k up to this, or a top-p cutoff within it) at about 1% of the cost of
# a full-vocabulary sort, which on CPU dominated every sampled step (9 ms per row at V=49k).
TOP_CANDIDATES = 256


def filtered_logits(logits_BxV: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature-scaled logits with top-k/top-p exclusions set to -inf (greedy rows: raw logits).

    Nothing is sorted when no row uses top-k or top-p. Otherwise each row is settled from its
    ``TOP_CANDIDATES`` largest logits when they suffice; only a row that needs more (top-k above
    that, or a top-p cutoff past it) makes the batch run a full sort. Which of the two settles a
    row depends on that row alone, so a request's distribution does not depend on its batch.
    """
    logits = logits_BxV.astype(jnp.float32)
    greedy_B = params.temperature_B <= 0.0
    scaled = logits / jnp.where(greedy_B, 1.0, params.temperature_B)[:, None]
    filtering_B = ~greedy_B & ((params.top_k_B > 0) | (params.top_p_B < 1.0))

    def apply_filters(x):
        vocab = x.shape[-1]
        k_B = jnp.where(params.top_k_B > 0, jnp.minimum(params.top_k_B, vocab), vocab)
        head, _ = jax.lax.top_k(x, min(TOP_CANDIDATES, vocab))
        cutoff_B, settled_B = _cutoff(head, k_B, params.top_p_B, jax.nn.logsumexp(x, axis=-1), vocab)

        def with_full_sort(cutoff_B):
            full_B, _ = _cutoff(-jnp.sort(-x, axis=-1), k_B, params.top_p_B, None, vocab)
            return jnp.where(settled_B, cutoff_B, full_B)

        cutoff_B = jax.lax.cond(jnp.any(filtering_B & ~settled_B), with_full_sort, lambda c: c, cutoff_B)
        cutoff_B = jnp.where(filtering_B, cutoff_B, -jnp.inf)
        return jnp.where(greedy_B[:, None], scaled, jnp.where(x < cutoff_B[:, None], -jnp.inf, x))

    return jax.lax.cond(jnp.any(filtering_B), apply_filters, lambda x: x, scaled)


def _cutoff(sorted_desc, k_B, top_p_B, vocab_lse_B, vocab: int):
    """``(cutoff_B, settled_B)`` from the ``n`` largest logits of each row, in descending order.

    Tokens below ``cutoff_B`` are dropped: the k-th value, raised to the top-p cutoff (top-p keeps
    a token while the top-k-renormalised mass strictly before it is below p, so the most likely
    token always stays; p = 1 keeps all k). ``vocab_lse_B`` normalises rows without top-k; None
    when ``sorted_desc`` is the whole row. ``settled_B`` is False where the n values cannot decide:
    n < k < vocab (the normaliser needs the rest), or no top-k and top-p keeps all n.
    """
    n = sorted_desc.shape[-1]
    in_top_k = jnp.arange(n)[None, :] < k_B[:, None]
    masked = jnp.where(in_top_k, sorted_desc, -jnp.inf)
    lse_B = jax.nn.logsumexp(masked, axis=-1)
    if vocab_lse_B is not None:
        lse_B = jnp.where(k_B > n, vocab_lse_B, lse_B)
    probs = jnp.exp(masked - lse_B[:, None])
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = in_top_k & ((mass_before < top_p_B[:, None]) | (top_p_B[:, None] >= 1.0))
    kept_B = jnp.sum(kept, axis=-1)
    cutoff_B = jnp.take_along_axis(sorted_desc, (kept_B - 1)[:, None], axis=-1)[:, 0]
    settled_B = (n == vocab) | (k_B <= n) | ((k_B == vocab) & (kept_B < n))
    return cutoff_B, settled_B


def any_sampled(params: SamplingParams) -> jax.Array:
    """True when some row samples. An all-greedy batch skips the softmax and the random draw:
    on CPU a Gumbel draw over V=49k costs 2.5 ms against 0.2 ms for the argmax it ends in."""
    return jnp.any(params.temperature_B > 0.0)


def probabilities(logits_BxV: jax.Array, params: SamplingParams) -> jax.Array:
    """The distribution each row is sampled from: one-hot argmax for greedy rows."""
    greedy_B = params.temperature_B <= 0.0
    one_hot = jax.nn.one_hot(jnp.argmax(logits_BxV, axis=-1), logits_BxV.shape[-1], dtype=jnp.float32)

    def mixed():
        softmax = jax.nn.softmax(filtered_logits(logits_BxV, params), axis=-1)
        return jnp.where(greedy_B[:, None], one_hot, softmax)

    return jax.lax.cond(any_sampled(params), mixed, lambda: one_hot)


def step_keys(keys_B: jax.Array, step_B: jax.Array) -> jax.Array:
    """Per-request keys for one step: ``fold_in(key_b, step_b)``."""
    return jax.vmap(jax.random.fold_in)(keys_B, step_B)


def sample(logits_BxV: jax.Array, params: SamplingParams, keys_B: jax.Array) -> jax.Array:
    """One token per row: argmax for greedy rows, a draw from ``probabilities`` otherwise."""
    greedy = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)

    def mixed():
        drawn = jax.vmap(jax.random.categorical)(keys_B, filtered_logits(logits_BxV, params))
        return jnp.where(params.temperature_B <= 0.0, greedy, drawn.astype(jnp.int32))

    return jax.lax.cond(any_sampled(params), mixed, lambda: greedy)


def seed_fits(seed: int) -> bool:
    """Whether an integer seed is one ``request_keys`` takes: a signed 64-bit integer."""
    return -(2**63) <= seed < 2**63


def request_keys(seeds: Sequence[int]) -> jax.Array:
    """One PRNG key per request from signed 64-bit seeds (raw uint32 key data [len(seeds), 2],
    vmappable), each seed its own stream: ``jax.random.PRNGKey`` of the seed's low 32 bits, with
    the high 32 bits folded in where they are not zero. Seeds in [0, 2**32) so get exactly
    ``PRNGKey(seed)``; ``PRNGKey`` alone (JAX without x64) would truncate the rest to their low
    bits, giving 2**32 the key of 0. Made in vmapped calls (a key per call took seconds of dispatch
    for thousands of requests)."""
    seeds = list(seeds)
    out_of_range = [seed for seed in seeds if not seed_fits(seed)]
    if out_of_range:
        raise ValueError(f"seeds must fit in a signed 64-bit integer, got {out_of_range}")
    seeds_np = np.asarray(seeds, dtype=np.int64)
    low, high = seeds_np.astype(np.uint32), (seeds_np >> 32).astype(np.uint32)
    keys = jax.vmap(jax.random.PRNGKey)(jnp.asarray(low))
    if not high.any():  # the usual seeds: no fold to dispatch (nor to compile for each batch size)
        return keys
    folded = jax.vmap(jax.random.fold_in)(keys, jnp.asarray(high))
    return jnp.where(jnp.asarray(high != 0)[:, None], folded, keys)
