"""What ``SpeculativeDecoder`` needs from a drafter; the DSpark/DFlash ``Drafter`` and the
EAGLE-3 ``Eagle3Drafter`` both provide it.

A drafter keeps a *context*: a pytree of fixed shapes (so it can live in jitted decode state)
holding what it has seen of the committed sequence. Its length is always the anchor's position
``a``: it covers tokens ``0..a-1`` with their target features, while the anchor ``x_a`` (the
last committed token) has no target feature yet. Rows past a context's length are stale and
must be ignored by the drafter (masked by length), so rollback needs no cleaning.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from dspark_jax.config import DrafterConfig
from dspark_jax.drafter.heads import DraftBlock
from dspark_jax.sampling import SamplingParams


class SpeculativeDrafter(Protocol):
    cfg: DrafterConfig

    def new_context(self, batch: int, max_len: int, dtype) -> Any:
        """An empty context for ``batch`` requests of up to ``max_len`` tokens."""

    def extend_context(
        self, embed_VxD: jax.Array, context: Any, features_BxTxF: jax.Array, next_tokens_BxT: jax.Array,
        n_new_B: jax.Array,
    ) -> Any:
        """Commit the first ``n_new_B`` of ``T`` positions per row (the rest is padding): with ``a``
        the context's length, ``features[:, j]`` is the tapped target feature at position
        ``a + j`` and ``next_tokens[:, j]`` the committed token at ``a + j + 1`` (the last one
        committed is the new anchor)."""

    def propose(
        self, embed_VxD: jax.Array, lm_head_VxD: jax.Array, context: Any, anchor_B: jax.Array,
        params: SamplingParams, keys_BxG: jax.Array,
    ) -> tuple[DraftBlock, jax.Array | None]:
        """γ draft tokens after the anchor with the exact distributions they were drawn from
        (``q_BxGxV``, after ``params``' transforms), and per-slot confidence logits or None.
        Token ids must lie in ``[0, V)``: ``SpeculativeDecoder`` raises a ``ValueError`` at the
        first round that drafts one outside it (``verify`` itself stops before such an id)."""
