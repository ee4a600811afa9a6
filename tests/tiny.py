"""Tiny random targets for unit tests, and the lossless-decoding check run on them."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.config import TargetConfig
from dspark_jax.decoding.autoregressive import AutoregressiveGenerator
from dspark_jax.decoding.speculative import FixedPolicy, SpeculativeDecoder
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


def cast_target(target: TargetModel, dtype) -> TargetModel:
    """``target`` with its weights in ``dtype`` (what ``--dtype`` loads)."""
    return TargetModel(target.cfg, target.graphdef, target.treedef, [p.astype(dtype) for p in target.params])


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


def llama_cpp_rope_freqs(scaling, head_dim: int, theta: float) -> np.ndarray:
    """The ``rope_freqs.weight`` llama.cpp's converter writes for Llama 3's RoPE scaling: each
    rotary pair's frequency divisor, computed as its converter does (in Python floats)."""
    old_len, low, high = scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor
    divisors = []
    for frequency in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelength = 2 * np.pi / frequency
        if wavelength < old_len / high:
            divisors.append(1.0)
        elif wavelength > old_len / low:
            divisors.append(scaling.factor)
        else:
            smooth = (old_len / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / scaling.factor + smooth))
    return np.array(divisors, np.float32)


_GGUF_GLOBALS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}


def gguf_tensors(target) -> dict[str, np.ndarray]:
    """A target's weights under GGUF names, q/k rows permuted for llama as llama.cpp's converter does."""
    from dspark_jax.checkpoints.gguf import _LAYER_TENSORS
    from dspark_jax.checkpoints.hf import hf_tensors_from_module

    kinds = {hf_name: kind for kind, hf_name in _LAYER_TENSORS.items()}
    cfg, out = target.cfg, {}
    for name, value in hf_tensors_from_module(target.module()).items():
        if name in _GGUF_GLOBALS:
            out[_GGUF_GLOBALS[name]] = value
            continue
        layer, hf_name = name.removeprefix("model.layers.").split(".", 1)
        kind = kinds[hf_name.removesuffix(".weight")]
        if cfg.architecture == "llama" and kind in ("attn_q", "attn_k"):
            value = llama_cpp_permute(value, cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads)
        out[f"blk.{layer}.{kind}.weight"] = value
    return out


def write_gguf(path, cfg, tensors, *, arch=None, qtype=None, tokens=None, metadata=None):
    """A GGUF file for ``cfg`` holding ``tensors`` (GGUF names; matrices quantized to ``qtype``),
    with ``tokens`` as its vocabulary (default: placeholder names); ``metadata(writer)`` adds keys."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch or cfg.architecture)
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens or [f"t{i}" for i in range(cfg.vocab_size)])
    if metadata:
        metadata(writer)
    for name, value in tensors.items():
        if qtype is not None and value.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_decodes_losslessly(target: TargetModel, drafter) -> None:
    """Greedy speculative decoding of two short prompts, 12 tokens each, verifying γ drafts a
    round, gives the target's own greedy tokens."""
    prompts = [[5, 17, 23, 42, 8], [60, 2, 71]]
    want = AutoregressiveGenerator(target).generate(prompts, max_new_tokens=12)
    got = SpeculativeDecoder(target, drafter, policy=FixedPolicy(drafter.cfg.block_size)).generate(
        prompts, max_new_tokens=12)
    assert got.tokens == want.tokens
