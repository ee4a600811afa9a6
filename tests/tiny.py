"""Tiny random targets for unit tests."""

import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import TargetConfig
from dspark_jax.models.target import TargetModel, Transformer


def tiny_config(**overrides) -> TargetConfig:
    values = dict(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        qk_norm=False,
        max_position_embeddings=512,
    )
    values.update(overrides)
    return TargetConfig(**values)


def tiny_target(seed: int = 0, dtype=jnp.float32, **overrides) -> TargetModel:
    return TargetModel.from_module(Transformer(tiny_config(**overrides), rngs=nnx.Rngs(seed), dtype=dtype))
