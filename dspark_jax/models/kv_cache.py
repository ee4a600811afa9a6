"""A static KV cache: ``batch slots x max_len`` per layer, per-row lengths as data.

Each layer has its own key and value arrays so a jitted decode step can donate and update them
in place. Rows write at their own positions (``lengths[b] + t``); rollback only moves lengths,
because attention masks every slot at or past a row's length (``layers.cached_attention``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.config import TargetConfig


class KVCache(NamedTuple):
    keys: tuple[jax.Array, ...]  # per layer [B, S, num_kv_heads, head_dim]
    values: tuple[jax.Array, ...]  # per layer [B, S, num_kv_heads, head_dim]
    lengths_B: jax.Array  # int32 [B]: committed tokens per row

    @classmethod
    def create(cls, cfg: TargetConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
        if batch <= 0 or max_len <= 0:
            raise ValueError(f"KV cache needs batch > 0 and max_len > 0, got {batch}, {max_len}")
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        # Separate buffers per layer (not one broadcast array) so each can be donated.
        return cls(
            keys=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
            values=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
            lengths_B=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def batch(self) -> int:
        return self.lengths_B.shape[0]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[1]

    def rollback(self, lengths_B: jax.Array) -> KVCache:
        """Forget everything at or past ``lengths_B`` (never grows a row)."""
        return self._replace(lengths_B=jnp.minimum(self.lengths_B, lengths_B.astype(jnp.int32)))
