"""HF-format checkpoints (``config.json`` + safetensors, single file or sharded) for Llama and Qwen3.

The HF tensor names are the one interchange vocabulary: the GGUF loader translates into them,
``save_hf_checkpoint`` writes them, and ``module_from_hf_tensors`` maps them onto our NNX state
(fusing q/k/v and gate/up) after a **full inventory check**: missing, unexpected and mis-shaped
tensors are all listed in one ``ValueError``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.checkpoints import save_safetensors
from dspark_jax.config import RopeScaling, TargetConfig, as_int, read_json
from dspark_jax.models.target import TargetModel, Transformer

# Buffers some exporters leave in a checkpoint that carry no weights (recomputed from config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_HF_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


# --------------------------------------------------------------------------------------------
# config.json


def config_from_hf(hf: Mapping) -> TargetConfig:
    """Translate an HF ``config.json`` (Llama or Qwen3) into a ``TargetConfig``."""
    if not isinstance(hf, Mapping):
        raise ValueError(f"an HF config is a JSON object, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    if model_type not in _HF_MODEL_TYPES:
        raise ValueError(
            f"unsupported HF model_type {model_type!r}; supported: {sorted(_HF_MODEL_TYPES)}"
        )
    quantization = hf.get("quantization_config")
    if quantization:  # AWQ/GPTQ/FP8/bitsandbytes weights are packed or scaled under the HF names
        method = quantization.get("quant_method") if isinstance(quantization, Mapping) else None
        raise ValueError(f"quantized checkpoints are not supported (quantization_config with quant_method "
                         f"{method!r}); load the unquantized checkpoint, or a GGUF file")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"HF config sets {flag}=true, which this Llama-family port does not implement")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}; this port implements SwiGLU (silu)")
    if model_type == "qwen3" and hf.get("use_sliding_window"):
        raise ValueError("Qwen3 configs with use_sliding_window=true are not supported")
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    rope_theta = hf.get("rope_theta")
    rope_scaling = None
    if scaling:
        rope_theta = rope_theta or scaling.get("rope_theta")
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type is None:
            if set(scaling) - {"rope_theta"}:  # scaling parameters whose kind is not named
                raise ValueError(f"rope scaling {scaling} names no rope_type; cannot tell how to scale")
            rope_type = "default"
        if rope_type == "llama3":
            fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            missing = [f for f in fields if f not in scaling]
            if missing:
                raise ValueError(f"llama3 rope scaling lacks {', '.join(missing)}: {scaling}")
            rope_scaling = RopeScaling(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
        elif rope_type != "default":
            raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, llama3)")

    def integer(key, default=None):
        """An int entry, exactly (a float such as 2.5 is refused, not truncated, as transformers does)."""
        if hf.get(key) is None:
            if default is None:
                raise ValueError(f"HF config has no {key!r}")
            return default
        return as_int(hf[key], f"HF config {key!r}")

    num_heads = integer("num_attention_heads")
    return TargetConfig(
        vocab_size=integer("vocab_size"),
        hidden_size=integer("hidden_size"),
        intermediate_size=integer("intermediate_size"),
        num_layers=integer("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=integer("num_key_value_heads", num_heads),
        # transformers' Qwen3Config defaults head_dim to 128; LlamaConfig derives it.
        head_dim=integer("head_dim", 128 if model_type == "qwen3" else integer("hidden_size") // num_heads),
        rope_theta=float(rope_theta or 10000.0),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=model_type == "qwen3",
        # transformers' defaults (LlamaConfig 2048, Qwen3Config 32768), for a config.json without it
        max_position_embeddings=integer("max_position_embeddings", 32768 if model_type == "qwen3" else 2048),
        architecture=model_type,
    )


def config_to_hf(cfg: TargetConfig, torch_dtype: str = "float32") -> dict:
    """The HF ``config.json`` of ``cfg``, whose weights are stored in ``torch_dtype``."""
    hf = {
        "architectures": [_HF_MODEL_TYPES[cfg.architecture]],
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": torch_dtype,
    }
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        hf["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return hf


# --------------------------------------------------------------------------------------------
# tensor names <-> NNX state


def expected_hf_tensors(cfg: TargetConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint for ``cfg`` must contain, with its ``[out, in]`` shape."""
    d, hd = cfg.hidden_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.num_heads * hd, d)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.num_kv_heads * hd, d)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.num_kv_heads * hd, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, cfg.num_heads * hd)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, d)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, d)
        shapes[p + "mlp.down_proj.weight"] = (d, cfg.intermediate_size)
    return shapes


def _state_to_hf_names(cfg: TargetConfig) -> dict[str, list[str]]:
    """Our state path -> the HF tensors it is made of (several when fused, in concat order)."""
    names = {"embed": ["model.embed_tokens.weight"], "final_norm.weight": ["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = ["lm_head.weight"]
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        names[ours + "input_norm.weight"] = [hf + "input_layernorm.weight"]
        names[ours + "post_attn_norm.weight"] = [hf + "post_attention_layernorm.weight"]
        names[ours + "attn.qkv.weight"] = [hf + f"self_attn.{x}_proj.weight" for x in "qkv"]
        names[ours + "attn.o.weight"] = [hf + "self_attn.o_proj.weight"]
        if cfg.qk_norm:
            names[ours + "attn.q_norm.weight"] = [hf + "self_attn.q_norm.weight"]
            names[ours + "attn.k_norm.weight"] = [hf + "self_attn.k_norm.weight"]
        names[ours + "mlp.gate_up.weight"] = [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]
        names[ours + "mlp.down.weight"] = [hf + "mlp.down_proj.weight"]
    return names


def _path_name(path) -> str:
    return ".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def check_inventory(
    cfg: TargetConfig, shapes: Mapping[str, tuple[int, ...]], *, redundant_ok: tuple[str, ...] = ()
) -> None:
    """Raise one ``ValueError`` listing every missing, unexpected and mis-shaped tensor."""
    expected = expected_hf_tensors(cfg)
    present = {n for n in shapes if not n.endswith(_IGNORED_SUFFIXES) and n not in redundant_ok}
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    misshaped = sorted(
        f"{n}: checkpoint {tuple(shapes[n])}, config expects {expected[n]}"
        for n in present & set(expected)
        if tuple(shapes[n]) != expected[n]
    )
    if missing or unexpected or misshaped:
        problems = []
        for title, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
            if items:
                shown = items if len(items) <= 20 else items[:20] + [f"... ({len(items) - 20} more)"]
                problems.append(f"{len(items)} {title}: " + ", ".join(shown))
        raise ValueError("checkpoint does not match the target config: " + "; ".join(problems))


def _redundant_tied_head(cfg: TargetConfig, tensors: Mapping) -> tuple[str, ...]:
    """Some tied-embedding exports also store ``lm_head.weight``; accept it only if identical."""
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        if np.array_equal(np.asarray(tensors["lm_head.weight"]), np.asarray(tensors["model.embed_tokens.weight"])):
            return ("lm_head.weight",)
    return ()


def module_from_hf_tensors(
    cfg: TargetConfig, tensors: Mapping[str, np.ndarray], dtype=jnp.float32
) -> Transformer:
    """Build a ``Transformer`` whose weights are the given HF-named tensors."""
    check_inventory(
        cfg, {n: tuple(t.shape) for n, t in tensors.items()}, redundant_ok=_redundant_tied_head(cfg, tensors)
    )
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, abstract_state = nnx.split(abstract)
    sources = _state_to_hf_names(cfg)

    def fill(path, leaf):
        parts = [np.asarray(tensors[name]) for name in sources[_path_name(path)]]
        value = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        assert value.shape == leaf.shape, (_path_name(path), value.shape, leaf.shape)
        return jnp.asarray(value, dtype=dtype)

    state = jax.tree_util.tree_map_with_path(fill, abstract_state)
    return nnx.merge(graphdef, state)


def hf_tensors_from_module(module: Transformer) -> dict[str, np.ndarray]:
    """The inverse of ``module_from_hf_tensors``: split fused weights back into HF tensors."""
    cfg = module.cfg
    sources = _state_to_hf_names(cfg)
    expected = expected_hf_tensors(cfg)
    out: dict[str, np.ndarray] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(module))[0]:
        names = sources[_path_name(path)]
        value = np.asarray(leaf)
        splits = np.cumsum([expected[n][0] for n in names])[:-1]
        for name, part in zip(names, np.split(value, splits, axis=0)):
            out[name] = np.ascontiguousarray(part)
    return out


# --------------------------------------------------------------------------------------------
# files


SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@contextlib.contextmanager
def open_safetensors(path: Path):
    """``safe_open`` (``framework="flax"`` reads bfloat16, which the numpy reader cannot), with a
    damaged file named in a ``ValueError`` rather than the reader's own error."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="flax") as f:
            yield f
    except SafetensorError as error:
        raise ValueError(f"{path} is not a readable safetensors file ({error}): damaged or incompletely "
                         "written") from None


def safetensors_files(directory: Path) -> dict[str, Path]:
    """Map tensor name -> file, for a single ``model.safetensors`` or a sharded index. Where a
    directory has both, the single file is the checkpoint, as transformers loads it."""
    index, single = directory / INDEX_FILE, directory / SINGLE_FILE
    if single.exists():
        with open_safetensors(single) as f:
            return {name: single for name in f.keys()}
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index} has no 'weight_map' of tensor names to shard files")
        missing_files = sorted({f for f in weight_map.values() if not (directory / f).exists()})
        if missing_files:
            raise ValueError(f"sharded checkpoint {directory} lacks shard files: {missing_files}")
        return {name: directory / f for name, f in weight_map.items()}
    raise ValueError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def read_tensors(files: Mapping[str, Path], names: set[str], dtype) -> dict[str, np.ndarray]:
    """The tensors ``names``, each cast to ``dtype`` as it is read: a bfloat16 model never holds a
    float32 copy of itself (every float dtype converts to float32 exactly, so the one rounding to
    ``dtype`` gives what a float32 detour would)."""
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        if name in names:
            by_file.setdefault(path, []).append(name)
    out = {}
    for path, file_names in by_file.items():
        with open_safetensors(path) as f:
            for name in file_names:
                out[name] = np.asarray(f.get_tensor(name).astype(dtype))
    return out


def _read_shapes(files: Mapping[str, Path]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for path in sorted(set(files.values())):
        with open_safetensors(path) as f:
            for name in f.keys():
                if files.get(name) == path:
                    shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def load_hf_checkpoint(directory: str | os.PathLike, dtype=jnp.float32) -> TargetModel:
    """Load an HF Llama/Qwen3 checkpoint directory into a ``TargetModel``.

    The inventory is checked from the safetensors headers before any tensor is read, so a
    mismatched multi-GB checkpoint fails in milliseconds.
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.exists():
        raise ValueError(f"{directory} has no config.json")
    try:
        cfg = config_from_hf(read_json(config_path))
    except ValueError as error:
        raise ValueError(f"{config_path}: {error}") from None
    files = safetensors_files(directory)
    shapes = _read_shapes(files)
    tied_extra = ("lm_head.weight",) if cfg.tie_word_embeddings and "lm_head.weight" in shapes else ()
    check_inventory(cfg, shapes, redundant_ok=tied_extra)
    names = [n for n in shapes if not n.endswith(_IGNORED_SUFFIXES)]
    tensors = read_tensors(files, set(names), dtype)
    return TargetModel.from_module(module_from_hf_tensors(cfg, tensors, dtype))


def save_hf_checkpoint(
    module: Transformer, directory: str | os.PathLike, *, max_shard_bytes: int | None = None
) -> Path:
    """Write ``config.json`` and safetensors (sharded with an index when ``max_shard_bytes``)."""
    return save_hf_tensors(module.cfg, hf_tensors_from_module(module), directory, max_shard_bytes=max_shard_bytes)


def save_hf_tensors(
    cfg: TargetConfig, tensors: Mapping[str, np.ndarray], directory: str | os.PathLike, *,
    max_shard_bytes: int | None = None,
) -> Path:
    """``save_hf_checkpoint`` for tensors that already carry HF names (as a GGUF file's do)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _remove_weights(directory)
    stored = sorted({t.dtype.name for t in tensors.values()})
    torch_dtype = stored[0] if len(stored) == 1 else "float32"  # HF's config names one dtype for the model
    (directory / "config.json").write_text(json.dumps(config_to_hf(cfg, torch_dtype), indent=2))
    if max_shard_bytes is None:
        save_safetensors(dict(tensors), directory / SINGLE_FILE, metadata={"format": "pt"})
        return directory
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        if shards[-1] and size + tensors[name].nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += tensors[name].nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, directory / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return directory


def _remove_weights(directory: Path) -> None:
    """Remove the weights of a checkpoint saved in ``directory`` before (the single file, or an
    index and its shards), as transformers' ``save_pretrained`` does: left beside the new ones, the
    old form could be the one a loader reads."""
    index = directory / INDEX_FILE
    try:
        weight_map = read_json(index).get("weight_map") if index.is_file() else None
    except ValueError:  # an unreadable index goes, and names no shards
        weight_map = None
    shards = {f for f in weight_map.values() if isinstance(f, str)} if isinstance(weight_map, dict) else set()
    for name in {SINGLE_FILE, INDEX_FILE, *shards}:
        path = directory / name
        if path.is_file() and path.parent == directory:
            path.unlink()
