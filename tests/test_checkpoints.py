"""HF checkpoint round trips, the tensor inventory check, config translation, GGUF helpers."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dspark_jax.checkpoints.gguf import config_from_gguf, unpermute_rope_rows
from dspark_jax.checkpoints.hf import (
    config_from_hf,
    config_to_hf,
    expected_hf_tensors,
    hf_tensors_from_module,
    load_hf_checkpoint,
    module_from_hf_tensors,
    save_hf_checkpoint,
)
from dspark_jax.config import TargetConfig
from tests.tiny import llama_cpp_permute, tiny_config, tiny_target

QWEN3 = dict(qk_norm=True, head_dim=24, tie_word_embeddings=False, architecture="qwen3")


def logits_of(target, tokens=((3, 1, 4, 1, 5, 9),)):
    tokens = jnp.asarray(tokens, jnp.int32)
    return np.asarray(target.apply(target.params, tokens, target.new_cache(tokens.shape[0], 16)).logits)


@pytest.mark.parametrize("overrides", [{}, QWEN3], ids=["llama", "qwen3"])
@pytest.mark.parametrize("shard_bytes", [None, 20_000], ids=["single", "sharded"])
def test_save_load_round_trip(tmp_path, overrides, shard_bytes):
    target = tiny_target(seed=3, **overrides)
    save_hf_checkpoint(target.module(), tmp_path, max_shard_bytes=shard_bytes)
    if shard_bytes:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    loaded = load_hf_checkpoint(tmp_path)
    assert loaded.cfg == target.cfg
    for a, b in zip(loaded.params, target.params):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(logits_of(loaded), logits_of(target))


def test_fused_weights_split_into_hf_tensors():
    target = tiny_target(seed=4, **QWEN3)
    tensors = hf_tensors_from_module(target.module())
    assert set(tensors) == set(expected_hf_tensors(target.cfg))
    for name, shape in expected_hf_tensors(target.cfg).items():
        assert tensors[name].shape == shape, name
    # The q rows come first in the fused qkv matrix.
    qkv = np.asarray(target.module().layers[0].attn.qkv.weight[...])
    np.testing.assert_array_equal(qkv[: 4 * 24], tensors["model.layers.0.self_attn.q_proj.weight"])


def _tensors_and_cfg():
    cfg = tiny_config(**QWEN3)
    return cfg, hf_tensors_from_module(tiny_target(seed=5, **QWEN3).module())


def test_missing_unexpected_and_misshaped_tensors_are_all_listed():
    cfg, tensors = _tensors_and_cfg()
    del tensors["model.layers.1.mlp.up_proj.weight"]
    del tensors["model.layers.2.self_attn.k_norm.weight"]
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(96, np.float32)
    tensors["model.norm.weight"] = np.ones(47, np.float32)
    with pytest.raises(ValueError) as error:
        module_from_hf_tensors(cfg, tensors)
    message = str(error.value)
    assert "2 missing" in message and "model.layers.1.mlp.up_proj.weight" in message
    assert "model.layers.2.self_attn.k_norm.weight" in message
    assert "1 unexpected" in message and "q_proj.bias" in message
    assert "1 mis-shaped" in message and "model.norm.weight: checkpoint (47,), config expects (48,)" in message


def test_loader_checks_inventory_before_reading(tmp_path):
    target = tiny_target(seed=6)
    save_hf_checkpoint(target.module(), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors.pop("model.layers.2.mlp.down_proj.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="1 missing: model.layers.2.mlp.down_proj.weight"):
        load_hf_checkpoint(tmp_path)


def test_config_that_does_not_match_tensors_is_refused(tmp_path):
    save_hf_checkpoint(tiny_target(seed=7).module(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] = 4
    config["intermediate_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        load_hf_checkpoint(tmp_path)
    assert "model.layers.3." in str(error.value) and "mis-shaped" in str(error.value)


def test_tied_checkpoint_with_redundant_lm_head(tmp_path):
    cfg, tensors = tiny_config(), hf_tensors_from_module(tiny_target(seed=8).module())
    same = dict(tensors, **{"lm_head.weight": tensors["model.embed_tokens.weight"].copy()})
    module_from_hf_tensors(cfg, same)  # identical copy: accepted
    different = dict(tensors, **{"lm_head.weight": tensors["model.embed_tokens.weight"] + 1})
    with pytest.raises(ValueError, match="unexpected: lm_head.weight"):
        module_from_hf_tensors(cfg, different)


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(tiny_config())))
    with pytest.raises(ValueError, match="neither model.safetensors"):
        load_hf_checkpoint(tmp_path)



def test_a_save_replaces_the_weights_of_an_earlier_save_in_its_directory(tmp_path):
    """A sharded checkpoint saved over a single file (or the other way round) leaves one form: the
    other, left behind, could be the one a loader reads. Where both are present the single file
    is the checkpoint, as transformers loads it."""
    old, new = tiny_target(seed=9), tiny_target(seed=10)
    save_hf_checkpoint(old.module(), tmp_path, max_shard_bytes=20_000)
    save_hf_checkpoint(new.module(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    np.testing.assert_array_equal(logits_of(load_hf_checkpoint(tmp_path)), logits_of(new))
    save_hf_checkpoint(old.module(), tmp_path, max_shard_bytes=20_000)
    assert not (tmp_path / "model.safetensors").exists()
    np.testing.assert_array_equal(logits_of(load_hf_checkpoint(tmp_path)), logits_of(old))
    save_file(hf_tensors_from_module(new.module()), str(tmp_path / "model.safetensors"))  # both forms, by hand
    np.testing.assert_array_equal(logits_of(load_hf_checkpoint(tmp_path)), logits_of(new))


def test_damaged_checkpoint_files_are_named(tmp_path):
    save_hf_checkpoint(tiny_target(seed=11).module(), tmp_path)
    weights, config = tmp_path / "model.safetensors", tmp_path / "config.json"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file \("):
        load_hf_checkpoint(tmp_path)
    weights.write_bytes(whole)
    hf = json.loads(config.read_text())
    for text, match in [("{half", r"config.json is not valid JSON \("),
                        ("[1, 2]", "config.json holds a JSON list, not the object expected"),
                        (json.dumps({k: v for k, v in hf.items() if k != "intermediate_size"}),
                         "config.json: HF config has no 'intermediate_size'"),
                        (json.dumps(dict(hf, num_hidden_layers=2.5)),
                         "config.json: HF config 'num_hidden_layers' must be an int, got 2.5")]:
        config.write_text(text)
        with pytest.raises(ValueError, match=match):
            load_hf_checkpoint(tmp_path)
    config.write_text(json.dumps(hf))
    weights.unlink()
    for index, match in [("{half", "index.json is not valid JSON"), ("{}", "index.json has no 'weight_map'")]:
        (tmp_path / "model.safetensors.index.json").write_text(index)
        with pytest.raises(ValueError, match=match):
            load_hf_checkpoint(tmp_path)


def test_damaged_tokenizer_files_are_named(tmp_path):
    from dspark_jax.tokenizer import Tokenizer

    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {"a\n": 0}')
    with pytest.raises(ValueError, match="tokenizer.json is not a tokenizer the tokenizers library reads"):
        Tokenizer.from_directory(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{half")
    with pytest.raises(ValueError, match=r"tokenizer_config.json is not valid JSON \("):
        Tokenizer.from_directory(tmp_path)

def test_hf_config_translation():
    for cfg in (tiny_config(), tiny_config(**QWEN3)):
        assert config_from_hf(config_to_hf(cfg)) == cfg
    llama3 = dict(
        model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    )
    cfg = config_from_hf(llama3)
    assert cfg.head_dim == 16 and cfg.rope_scaling.factor == 32.0 and not cfg.tie_word_embeddings
    with pytest.raises(ValueError, match="model_type"):
        config_from_hf(dict(llama3, model_type="mistral"))
    with pytest.raises(ValueError, match="attention_bias"):
        config_from_hf(dict(llama3, attention_bias=True))
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        config_from_hf(dict(llama3, hidden_act="gelu"))
    with pytest.raises(ValueError, match="rope scaling type 'yarn'"):
        config_from_hf(dict(llama3, rope_scaling=dict(rope_type="yarn", factor=4.0)))
    with pytest.raises(ValueError, match="names no rope_type"):
        config_from_hf(dict(llama3, rope_scaling=dict(factor=4.0)))
    assert config_from_hf(dict(llama3, rope_scaling=dict(rope_theta=1e4))).rope_scaling is None
    with pytest.raises(ValueError, match="llama3 rope scaling lacks low_freq_factor, high_freq_factor"):
        config_from_hf(dict(llama3, rope_scaling=dict(rope_type="llama3", factor=8.0,
                                                       original_max_position_embeddings=8192)))


def test_a_gguf_with_llama31_rope_factors_is_refused_by_name(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "llama31.gguf"), "llama")
    writer.add_head_count(4)
    writer.add_embedding_length(64)
    writer.add_token_list(["a", "b"])
    writer.add_tensor("rope_freqs.weight", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"per-frequency factors \(rope_freqs.weight"):
        config_from_gguf(gguf.GGUFReader(str(tmp_path / "llama31.gguf")))


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path):
    from dspark_jax.checkpoints.gguf import load_gguf

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match=f"{garbage} is not a GGUF file"):
        load_gguf(garbage, cache=False)


def test_the_embedded_target_can_skip_the_converted_copy(monkeypatch):
    from dspark_jax.checkpoints import gguf

    asked = []
    monkeypatch.setattr(gguf, "load_gguf", lambda path, dtype, *, cache: asked.append(cache))
    gguf.load_embedded_target(cache=False)
    gguf.load_embedded_target()
    assert asked == [False, True]


def test_more_tokens_than_the_cache_holds_is_an_error():
    target = tiny_target()
    tokens = jnp.zeros((1, 10), jnp.int32)
    with pytest.raises(ValueError, match="10 tokens do not fit a KV cache of 8 positions"):
        target.apply(target.params, tokens, target.new_cache(1, 8))


def test_unknown_config_keys_are_refused():
    values = tiny_config().to_dict()
    assert TargetConfig.from_dict(values) == tiny_config()
    with pytest.raises(ValueError, match=r"unknown TargetConfig keys: \['hidden_dim'\]"):
        TargetConfig.from_dict(dict(values, hidden_dim=48))
    with pytest.raises(ValueError, match="rope_scaling keys"):
        TargetConfig.from_dict(dict(values, rope_scaling=dict(factor=2.0, beta=1.0)))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(num_kv_heads=3), "multiple of num_kv_heads"),
        (dict(head_dim=15), "even"),
        (dict(num_layers=0), "num_layers"),
        (dict(architecture="gpt2"), "architecture"),
    ],
)
def test_invalid_target_configs(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**overrides)


def test_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp's converter permutes q/k rows (`permute` in convert_hf_to_gguf.py); we undo it."""
    w = np.random.default_rng(0).normal(size=(3 * 8, 5)).astype(np.float32)
    permuted = llama_cpp_permute(w, 3)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, 3), w)


def test_embedded_target_config(embedded_target):
    target, tokenizer = embedded_target
    cfg = target.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert target.num_params == 134_515_008
    assert tokenizer.eos_token_id == 2 and tokenizer.bos_token_id == 1
    assert jax.tree.leaves(target.params)[0].dtype == jnp.float32
