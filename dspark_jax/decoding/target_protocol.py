"""What ``AutoregressiveGenerator`` and ``SpeculativeDecoder`` need from a target model.

``dspark_jax.models.target.TargetModel`` implements it; so can any other model (a Flax linen or
NNX stack, a hand-written function): ``tests/test_target_protocol.py`` runs both decoders on a
small ``flax.linen`` decoder written in the test. The decoders use nothing else.

Semantics (``B`` batch rows, ``T`` new tokens per call, ``V`` vocabulary, ``d`` hidden size):

* ``apply(params, tokens_BxT, cache, *, n_new_B=None, logits_at_B=None, tap_layers=())`` is a pure
  function of its arguments (the decoders call it inside ``jax.jit`` and pass ``params``
  explicitly; it must not read ``self.params``). Row ``b``'s new tokens sit at positions
  ``cache.lengths_B[b] + t`` for ``t = 0..T-1``: positions *are* the cache lengths, so rows of
  one batch are at different positions. Token ``t`` attends to every committed position of its
  row (``< lengths_B[b]``) and to new tokens ``0..t`` of the same call; nothing at or past
  ``lengths_B[b]`` that was written by an earlier call may be seen (slots past the length hold
  stale data after a rollback).
* ``n_new_B`` (int32 ``[B]``, default all ``T``) counts how many of the ``T`` tokens of each row
  are real; the returned cache's ``lengths_B`` is ``cache.lengths_B + n_new_B``. The rest are
  padding: they may be written past the new length, and their outputs are ignored. ``0`` freezes
  a row (finished requests).
* ``logits_at_B`` (int32 ``[B]``): when given, ``logits`` is ``[B, V]`` at that index of each row
  (prefill and single-token decode need one position only); otherwise ``[B, T, V]``. float32.
* ``tap_layers``: a static tuple of ascending decoder-layer indices; ``taps`` is ``[B, T,
  len(tap_layers) * d]``, the *raw* outputs of those layers (the residual stream after the
  layer, not the final norm), concatenated in ascending layer order. The drafter's context
  features come from these.
* ``new_cache(batch, max_len)`` returns an empty cache (``lengths_B`` zeros, room for ``max_len``
  positions per row). The cache is a pytree (it travels through ``jax.jit`` and may be donated).
  Each of its leaves has exactly one axis of size ``batch`` (any position: continuous batching
  finds it by comparing the shapes at batch 1 and 2, and copies a refilled request's rows along
  it).
* ``cache.rollback(lengths_B)`` returns the cache with lengths ``min(current, lengths_B)`` and
  nothing else changed: it only moves lengths (the masking rule above makes that enough).
* ``embedding_and_head(params)`` returns the input embedding and the LM head, both ``[V, d]``
  (``logits = head @ h``; the same array when tied), for drafters that share them frozen. Called
  inside the jitted step with the traced ``params``.
* ``cfg`` is read for ``vocab_size``, ``max_position_embeddings`` (the longest cache a request may
  need) and, through ``DrafterConfig.check_target``, ``hidden_size``, ``num_layers`` and (DSpark
  drafters copy the target's attention shape) ``num_heads``, ``num_kv_heads``, ``head_dim``.
* ``params`` is the pytree the decoders pass back to ``apply`` and ``embedding_and_head``.

Exactness: greedy speculative output equals target-only output token for token only if a
position's logits do not depend on how many other positions share its forward. See
``docs/EXACTNESS.md`` and the ``strict`` mode of ``SpeculativeDecoder``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax


@runtime_checkable
class TargetCache(Protocol):
    """A per-row KV cache: a pytree with per-row committed lengths."""

    lengths_B: jax.Array  # int32 [B]: committed positions per row

    def rollback(self, lengths_B: jax.Array) -> TargetCache:
        """Lengths become ``min(lengths, lengths_B)``; nothing else changes."""
        ...


class TargetOutput(NamedTuple):
    """What ``apply`` returns (``dspark_jax.models.target.ForwardOutput`` has this shape)."""

    logits: jax.Array  # float32 [B, T, V], or [B, V] with ``logits_at_B``
    taps: jax.Array  # [B, T, len(tap_layers) * d]: raw outputs of the tapped layers
    cache: Any  # the TargetCache after the call


class TargetSpec(Protocol):
    """The fields of ``cfg`` the decoders read (``dspark_jax.config.TargetConfig`` has them)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int


@runtime_checkable
class SpeculativeTarget(Protocol):
    """A target model the generators can decode with (module docstring: exact semantics)."""

    cfg: Any  # a TargetSpec
    params: Any  # a pytree

    def apply(
        self,
        params: Any,
        tokens_BxT: jax.Array,
        cache: Any,
        *,
        n_new_B: jax.Array | None = None,
        logits_at_B: jax.Array | None = None,
        tap_layers: tuple[int, ...] = (),
    ) -> TargetOutput: ...

    def new_cache(self, batch: int, max_len: int) -> TargetCache: ...

    def embedding_and_head(self, params: Any) -> tuple[jax.Array, jax.Array]: ...


def feature_dtype(target: SpeculativeTarget) -> Any:
    """The dtype of the target's activations (its embedding's), for drafter context buffers."""
    embed = jax.eval_shape(lambda p: target.embedding_and_head(p)[0], target.params)
    return embed.dtype
