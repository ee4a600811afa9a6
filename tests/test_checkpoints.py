"""HF checkpoint round trips, the tensor inventory check, config translation, GGUF helpers."""

import dataclasses
import json
import re

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
from dspark_jax.config import RopeScaling, TargetConfig
from dspark_jax.models.layers import rope_inverse_frequencies
from dspark_jax.models.target import TargetModel
from tests.tiny import (
    gguf_tensors,
    llama_cpp_permute,
    llama_cpp_rope_freqs,
    tiny_config,
    tiny_target,
    write_gguf,
)

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


LLAMA31_ROPE = dict(head_dim=32, rope_theta=500000.0, max_position_embeddings=16384,
                   rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                            original_max_position_embeddings=2048))


@pytest.mark.parametrize("rope", [LLAMA31_ROPE, dict(LLAMA31_ROPE, rope_scaling=RopeScaling(32.0, 2.0, 16.0, 4096))],
                         ids=["llama3.1", "scaled"])
def test_a_gguf_of_llama31_loads_its_rope_scaling_from_the_divisors_llama_cpp_stores(tmp_path, rope):
    """Llama 3.1 and 3.2 GGUFs hold their RoPE scaling as each frequency's divisor
    (``rope_freqs.weight``): the loader finds the HF parameters that give them (low_freq_factor 1,
    the others scaled to match), so the model rotates as the HF one does."""
    from dspark_jax.checkpoints.gguf import load_gguf

    target = tiny_target(seed=4, **GGUF_SIZES, **rope)
    tensors = {**gguf_tensors(target), "rope_freqs.weight": llama_cpp_rope_freqs(
        target.cfg.rope_scaling, target.cfg.head_dim, target.cfg.rope_theta)}
    loaded, _ = load_gguf(write_gguf(tmp_path / "llama31.gguf", target.cfg, tensors), cache=False)
    scaling = target.cfg.rope_scaling
    low = scaling.low_freq_factor  # (L, low, high) / low give the same frequencies
    assert loaded.cfg == dataclasses.replace(target.cfg, rope_scaling=RopeScaling(
        scaling.factor, 1.0, scaling.high_freq_factor / low, round(scaling.original_max_position_embeddings / low)))
    frequencies = [np.asarray(rope_inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
                   for cfg in (loaded.cfg, target.cfg)]
    np.testing.assert_allclose(*frequencies, rtol=1e-6)
    assert not np.allclose(frequencies[1], rope_inverse_frequencies(32, 500000.0)), "the test lost its point"


@pytest.mark.parametrize("divisors, why", [
    (np.linspace(1.0, 0.5, 8), "does not follow Llama 3's RoPE scaling"),
    (np.r_[np.ones(4), np.full(4, 8.0)], "fewer than two divisors between 1 and the largest"),
    (np.ones(5), "has 5 values; heads of size 16 have 8 rotary pairs"),
])
def test_a_gguf_whose_rope_divisors_are_not_llama3s_is_refused_by_name(tmp_path, divisors, why):
    def scaled(writer):
        writer.add_head_count(4)
        writer.add_embedding_length(64)
        writer.add_feed_forward_length(128)
        writer.add_block_count(2)
        writer.add_tensor("rope_freqs.weight", divisors.astype(np.float32))

    with pytest.raises(ValueError, match=r"rope_freqs.weight .*" + re.escape(why)):
        config_from_gguf(metadata_gguf(tmp_path / "scaled.gguf", scaled))


def metadata_gguf(path, fill):
    """A reader of a llama GGUF holding what ``fill(writer)`` writes and a two-token vocabulary:
    for the checks that read the metadata alone."""
    import gguf

    from dspark_jax.checkpoints.gguf import read_gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    fill(writer)
    writer.add_token_list(["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read_gguf(path)


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path):
    from dspark_jax.checkpoints.gguf import load_gguf

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match=f"{garbage} is not a GGUF file"):
        load_gguf(garbage, cache=False)


@pytest.mark.parametrize("endian", ["little", "big"])
def test_read_gguf_reads_what_ggufs_own_reader_reads(tmp_path, endian):
    """``read_gguf`` parses from a plain view of the file instead of gguf's memmap slices (3x
    faster on a vocabulary); every field and tensor must be the one ``gguf.GGUFReader`` gives:
    the embedded GGUF (quantized tensors, 98k vocabulary strings), and a big-endian file, which
    only a correct byte order reads back."""
    import gguf

    from dspark_jax.checkpoints.gguf import embedded_gguf_path, read_gguf

    if endian == "little":
        path = embedded_gguf_path()
    else:
        path = tmp_path / "big.gguf"
        writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
        writer.add_block_count(3)
        writer.add_rope_freq_base(12345.5)
        writer.add_token_list(["a", "bé", "<|x|>"])
        writer.add_token_scores([0.5, -1.0, 2.0])
        writer.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
        writer.add_tensor("ids", np.array([1, -2, 3], dtype=np.int32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    ours, theirs = read_gguf(path), gguf.GGUFReader(str(path))
    assert ours.byte_order == theirs.byte_order == ("S" if endian == "big" else "I")
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        got = ours.fields[name]
        assert (got.offset, got.types, got.data) == (field.offset, field.types, field.data), name
        assert len(got.parts) == len(field.parts), name
        for a, b in zip(got.parts, field.parts):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        assert got.contents() == field.contents(), name
    assert len(ours.tensors) == len(theirs.tensors) > 0
    for got, tensor in zip(ours.tensors, theirs.tensors):
        assert (got.name, got.tensor_type, list(got.shape), got.data_offset) == (
            tensor.name, tensor.tensor_type, list(tensor.shape), tensor.data_offset)
        assert got.data.dtype == tensor.data.dtype and np.array_equal(got.data, tensor.data), tensor.name
    if endian == "big":
        assert ours.fields["llama.block_count"].contents() == 3
        assert ours.fields["tokenizer.ggml.tokens"].contents() == ["a", "bé", "<|x|>"]
        np.testing.assert_array_equal(ours.tensors[1].data, [1, -2, 3])


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


# --------------------------------------------------------------------------------------------
# GGUF files as llama.cpp writes them: tensor types, architectures, checks before dequantizing

GGUF_SIZES = dict(hidden_size=64, intermediate_size=128)  # rows of whole 32-value Q8_0/Q4_0 blocks


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("overrides", [{}, QWEN3], ids=["llama", "qwen3"])
def test_a_gguf_loads_with_the_weights_gguf_dequantizes(tmp_path, overrides, qtype):
    """Each tensor type is dequantized by the ``gguf`` package; llama's q/k rows are unpermuted
    (after dequantizing, which is row-wise, so the order does not matter), qwen3's are left alone."""
    import gguf

    from dspark_jax.checkpoints.gguf import load_gguf

    target = tiny_target(seed=12, **GGUF_SIZES, **overrides)
    quant = gguf.GGMLQuantizationType[qtype]
    path = write_gguf(tmp_path / f"{qtype}.gguf", target.cfg, gguf_tensors(target), qtype=quant)
    loaded, _ = load_gguf(path, cache=False)
    assert loaded.cfg == target.cfg
    expected = {name: gguf.quants.dequantize(gguf.quants.quantize(value, quant), quant) if value.ndim == 2 else value
                for name, value in hf_tensors_from_module(target.module()).items()}
    want = TargetModel.from_module(module_from_hf_tensors(target.cfg, expected))
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_array_equal(a, b)


def _refuse_to_dequantize(monkeypatch):
    import gguf

    real = gguf.quants.dequantize

    def refuse(data, qtype):
        if data.shape[0] > 1:  # one block is how the loader asks whether a type can be read
            raise AssertionError("dequantized before the file was checked")
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", refuse)


def test_a_gguf_tensor_type_gguf_cannot_dequantize_is_refused_by_name(tmp_path, monkeypatch):
    """gguf's ``dequantize`` raises a bare NotImplementedError naming neither tensor nor file; the
    loader names both, and what it can read, before dequantizing anything."""
    from dspark_jax.checkpoints.gguf import load_gguf

    target = tiny_target(seed=13, **GGUF_SIZES)
    tensors = gguf_tensors(target)
    tensors["output_norm.weight"] = tensors["output_norm.weight"].astype(np.float64)
    tensors["blk.1.ffn_norm.weight"] = tensors["blk.1.ffn_norm.weight"].astype(np.float64)
    path = write_gguf(tmp_path / "f64.gguf", target.cfg, tensors)
    _refuse_to_dequantize(monkeypatch)
    with pytest.raises(ValueError) as error:
        load_gguf(path, cache=False)
    message = str(error.value)
    assert message.startswith(f"{path}: ")
    assert "2 tensors of type F64 (output_norm.weight, blk.1.ffn_norm.weight)" in message
    assert "supported:" in message and "Q4_K" in message and "Q8_0" in message and "BF16" in message


def test_a_gguf_that_does_not_match_its_metadata_fails_before_dequantizing(tmp_path, monkeypatch):
    """A mismatched file (a llama-architecture mixture of experts, a missing tensor) is refused from
    its header, in milliseconds, not after dequantizing gigabytes to float32."""
    from dspark_jax.checkpoints.gguf import load_gguf

    target = tiny_target(seed=14, **GGUF_SIZES)
    tensors = gguf_tensors(target)
    del tensors["blk.2.ffn_down.weight"]
    path = write_gguf(tmp_path / "missing.gguf", target.cfg, tensors)
    _refuse_to_dequantize(monkeypatch)
    with pytest.raises(ValueError, match=f"{path}: checkpoint does not match .* 1 missing: model.layers.2.mlp.down_proj"):
        load_gguf(path, cache=False)
    moe = gguf_tensors(target)
    for kind in ("ffn_gate", "ffn_up", "ffn_down"):
        moe[f"blk.0.{kind}_exps.weight"] = np.stack([moe.pop(f"blk.0.{kind}.weight")] * 2)
    path = write_gguf(tmp_path / "moe.gguf", target.cfg, moe, metadata=lambda w: w.add_expert_count(2))
    with pytest.raises(ValueError, match=f"{path}: .*mixture-of-experts.*llama.expert_count = 2"):
        load_gguf(path, cache=False)


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_an_unsupported_gguf_architecture_is_refused_naming_the_file(tmp_path, arch):
    from dspark_jax.checkpoints.gguf import load_gguf

    target = tiny_target(seed=15, **GGUF_SIZES)
    path = write_gguf(tmp_path / f"{arch}.gguf", target.cfg, gguf_tensors(target), arch=arch)
    with pytest.raises(ValueError, match=f"{path}: unsupported GGUF architecture '{arch}'; supported: llama, qwen3"):
        load_gguf(path, cache=False)


def test_a_gguf_with_partial_rotary_embeddings_is_refused(tmp_path):
    """``rope.dimension_count`` below the head size rotates only part of each head: loading it as a
    full rotation would give silently wrong logits."""
    from dspark_jax.checkpoints.gguf import load_gguf

    target = tiny_target(seed=16, **GGUF_SIZES)
    path = write_gguf(tmp_path / "partial.gguf", target.cfg, gguf_tensors(target),
                      metadata=lambda w: w.add_rope_dimension_count(8))
    with pytest.raises(ValueError, match=r"llama.rope.dimension_count = 8 .* head size \(16\)"):
        load_gguf(path, cache=False)


def test_a_quantized_hf_checkpoint_is_refused_by_name(tmp_path):
    """AWQ/GPTQ/FP8 exports keep quantized weights (or scales beside them) under the HF names: refused
    by their quantization_config, not by a list of hundreds of unexpected tensors."""
    save_hf_checkpoint(tiny_target(seed=17).module(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json: quantized checkpoints .*quant_method 'awq'"):
        load_hf_checkpoint(tmp_path)


@pytest.mark.parametrize("overrides", [{}, dict(QWEN3, rms_norm_eps=1e-6, rope_theta=1e6)], ids=["llama", "qwen3"])
def test_convert_of_a_quantized_gguf_loads_back_with_identical_logits(tmp_path, overrides, monkeypatch):
    """``dspark convert`` writes what ``load_gguf`` made of the file (dequantized, q/k unpermuted):
    the HF directory loads back to the same config and logits."""
    import gguf

    from dspark_jax import cli
    from dspark_jax.checkpoints.gguf import load_gguf

    target = tiny_target(seed=18, **GGUF_SIZES, **overrides)
    path = write_gguf(tmp_path / "q8.gguf", target.cfg, gguf_tensors(target), qtype=gguf.GGMLQuantizationType.Q8_0)
    assert cli.main(["convert", "--gguf", str(path), "--out", str(tmp_path / "hf")]) == 0
    from_gguf, _ = load_gguf(path, cache=False)
    converted, _ = cli.load_target(str(tmp_path / "hf"))
    assert converted.cfg == from_gguf.cfg == target.cfg
    np.testing.assert_array_equal(logits_of(converted), logits_of(from_gguf))
    np.testing.assert_allclose(logits_of(converted), logits_of(target), atol=0.1)  # Q8_0: close, not equal
    # --dtype bfloat16: the same weights, rounded once, from the GGUF's converted copy, from the HF
    # directory, and from the GGUF, each cast tensor by tensor as it is read (no float32 model held).
    from dspark_jax.checkpoints import gguf as gguf_module
    from dspark_jax.checkpoints import hf as hf_module

    read, cast_as_read = gguf_module.hf_tensors_from_gguf, []
    monkeypatch.setattr(gguf_module, "hf_tensors_from_gguf",
                        lambda reader, cfg, dtype="float32": cast_as_read.append(dtype) or read(reader, cfg, dtype))
    lean = load_gguf(path, "bfloat16", cache=False)[0]
    assert cast_as_read == ["bfloat16"]
    build, handed = hf_module.module_from_hf_tensors, []
    monkeypatch.setattr(hf_module, "module_from_hf_tensors", lambda cfg, tensors, dtype: handed.append(
        {t.dtype.name for t in tensors.values()}) or build(cfg, tensors, dtype))
    # The GGUF's first load reads it in float32 to keep that copy; the second reads the copy.
    loads = [cli.load_target(source, "bfloat16")[0] for source in (str(path), str(path), str(tmp_path / "hf"))]
    for half in (*loads, lean):
        assert half.dtype == jnp.bfloat16 and half.cfg == target.cfg
        for got, want in zip(half.params, converted.params, strict=True):
            np.testing.assert_array_equal(got, want.astype(jnp.bfloat16))
    assert handed == [{"bfloat16"}, {"bfloat16"}], handed  # the converted copy and the HF directory, as read
    # convert --dtype bfloat16 writes those weights, half the size, and says so in config.json.
    assert cli.main(["convert", "--gguf", str(path), "--out", str(tmp_path / "hf16"), "--dtype", "bfloat16"]) == 0
    stored = load_file(str(tmp_path / "hf16" / "model.safetensors"))
    assert {t.dtype.name for t in stored.values()} == {"bfloat16"}
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "float32"
    for got, want in zip(cli.load_target(str(tmp_path / "hf16"))[0].params, converted.params, strict=True):
        np.testing.assert_array_equal(got, want.astype(jnp.bfloat16).astype(jnp.float32))


def test_a_config_without_head_dim_or_positions_takes_transformers_defaults():
    """Qwen3Config's head_dim defaults to 128, not hidden_size // num_attention_heads (Llama's);
    max_position_embeddings to 32768 for Qwen3 and 2048 for Llama (transformers 5.25), which bounds
    the cache a prompt and its answer may take here."""
    absent = ("head_dim", "max_position_embeddings")
    hf = {k: v for k, v in config_to_hf(tiny_config(**QWEN3)).items() if k not in absent}
    qwen3, llama = config_from_hf(hf), config_from_hf(dict(hf, model_type="llama"))
    assert (qwen3.head_dim, qwen3.max_position_embeddings) == (128, 32768)
    assert (llama.head_dim, llama.max_position_embeddings) == (48 // 4, 2048)


def test_gguf_rope_scaling_is_refused_naming_the_field(tmp_path):
    """linear / YaRN scaling: refused by field and value (the HF loader refuses them too, so the
    message must not send the user there)."""
    import gguf

    from dspark_jax.checkpoints.gguf import load_gguf

    target = tiny_target(seed=19, **GGUF_SIZES, **QWEN3)

    def yarn(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)

    path = write_gguf(tmp_path / "yarn.gguf", target.cfg, gguf_tensors(target), metadata=yarn)
    with pytest.raises(ValueError) as error:
        load_gguf(path, cache=False)
    assert "qwen3.rope.scaling.type = 'yarn'" in str(error.value) and "HF checkpoint" not in str(error.value)


def test_a_gguf_missing_a_required_key_is_refused_naming_it(tmp_path):
    """Not ``int(None)``'s TypeError: the missing key (or a per-layer list where one number belongs) is named."""
    from dspark_jax.checkpoints.gguf import config_from_gguf

    def sizes(block_count, head_count):
        def fill(writer):
            if block_count is not None:
                writer.add_block_count(block_count)
            writer.add_head_count(head_count)
            writer.add_embedding_length(64)
            writer.add_feed_forward_length(128)
        return fill

    with pytest.raises(ValueError, match="GGUF metadata has no 'llama.block_count'"):
        config_from_gguf(metadata_gguf(tmp_path / "partial.gguf", sizes(None, 4)))
    with pytest.raises(ValueError, match=r"GGUF metadata 'llama.attention.head_count' is \[4, 8\], not one integer"):
        config_from_gguf(metadata_gguf(tmp_path / "per-layer.gguf", sizes(2, [4, 8])))


def test_one_part_of_a_split_gguf_is_refused_naming_the_split(tmp_path):
    """llama.cpp's gguf-split writes big models as NAME-00001-of-0000N.gguf; one part alone is
    named as such, not reported as hundreds of missing tensors."""
    from dspark_jax.checkpoints.gguf import load_gguf

    target = tiny_target(seed=20, **GGUF_SIZES)
    path = write_gguf(tmp_path / "m-00001-of-00002.gguf", target.cfg, gguf_tensors(target),
                      metadata=lambda w: (w.add_uint16("split.no", 0), w.add_uint16("split.count", 2)))
    with pytest.raises(ValueError, match=r"part 1 of 2 of a split GGUF; .*llama-gguf-split --merge"):
        load_gguf(path, cache=False)


def test_saved_weights_are_as_readable_as_the_files_beside_them(tmp_path):
    """safetensors 0.8 creates its files 0600 whatever the umask (its issue #782): a converted
    target or a trained drafter would be unreadable by a teammate or a serving user."""
    import os

    from dspark_jax.checkpoints.drafter import build_drafter, save_drafter
    from tests.test_drafter_checkpoints import configs

    old = os.umask(0o022)
    try:
        hf_dir = save_hf_checkpoint(tiny_target(seed=7).module(), tmp_path / "hf", max_shard_bytes=20_000)
        drafter_dir = save_drafter(build_drafter(configs()["dflash"]), tmp_path / "drafter")
    finally:
        os.umask(old)
    weights = sorted(hf_dir.glob("*.safetensors")) + [drafter_dir / "model.safetensors"]
    assert len(weights) > 2
    assert {oct(path.stat().st_mode & 0o777) for path in weights} == {oct(0o644)}
    assert oct((hf_dir / "config.json").stat().st_mode & 0o777) == oct(0o644)
