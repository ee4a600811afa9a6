"""Tiny random targets for unit tests."""

import jax.numpy as jnp
import numpy as np
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


def sharp_tiny_target(seed: int = 3, vocab_size: int = 12, num_layers: int = 4, scale: float = 40.0) -> TargetModel:
    """A tiny target with its tied head sharpened: random init gives near-uniform distributions,
    under which a wrong acceptance rule is nearly invisible; peaked p and q give tests power."""
    module = tiny_target(seed=seed, vocab_size=vocab_size, num_layers=num_layers).module()
    module.embed[...] = module.embed[...] * scale
    return TargetModel.from_module(module)


def llama_cpp_permute(weight_OxI: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter (`permute` in convert_hf_to_gguf.py) does to q/k rows, which the
    GGUF loader undoes."""
    out = weight_OxI.shape[0]
    return weight_OxI.reshape(num_heads, 2, out // num_heads // 2, *weight_OxI.shape[1:]).swapaxes(1, 2).reshape(
        weight_OxI.shape)
