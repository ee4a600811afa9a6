"""Official DSpark drafters: DeepSpec's ``Qwen3DSparkModel`` checkpoints, read as dspark-jax drafters.

DeepSpec (the reference implementation, ``deepseek-ai/DeepSpec``) saves a drafter with
transformers' ``save_pretrained``: ``config.json`` + safetensors, as ``deepseek-ai/
dspark_qwen3_4b_block7`` and its siblings are published. The config is the target's Qwen3 config
copied, with the drafter's depth in ``num_hidden_layers`` and the DSpark fields beside it
(``block_size``, ``mask_token_id``, ``target_layer_ids``, ``num_target_layers``,
``markov_rank`` / ``markov_head_type``, ``enable_confidence_head`` /
``confidence_head_with_markov``). Tensors carry torch names and layouts
(``layers.{i}.self_attn.q_proj.weight`` ...); k/v and gate/up are fused here as our layers fuse
them. DFlash drafters are the same class with ``markov_rank`` 0 and no confidence head.

The checkpoint's ``embed_tokens`` and ``lm_head`` are copies of its target's. They are not read
whole (a drafter takes its target's at run time), but a sketch of ``embed_tokens`` is the
drafter's record of its target, so ``load_drafter`` refuses a target they do not match, as it
does for drafters trained here.

Refused by name: other architectures (Gemma 4 drafters, ``DSparkDraftModel`` exports),
``target_layer_ids`` of -1 (the embedding output) or of the target's last layer, sliding-window
layers and attention biases.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from dspark_jax.config import DrafterConfig, as_int, as_ints

ARCHITECTURE = "Qwen3DSparkModel"
CONFIG_FILE = "config.json"
FROZEN = ("embed_tokens.weight", "lm_head.weight")  # copies of the target's


def is_deepspec_checkpoint(directory) -> bool:
    """Whether ``directory`` holds a DSpark drafter saved by another program: its ``config.json``
    names a DSpark architecture or is a speculators DSpark config. ``read_deepspec_config`` reads
    DeepSpec's own and refuses the others by name."""
    try:
        raw = json.loads((Path(directory) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(raw, dict):
        return False
    architectures = raw.get("architectures")
    return raw.get("speculators_model_type") == "dspark" or (
        isinstance(architectures, list) and any("DSpark" in str(a) for a in architectures))


def read_deepspec_config(directory) -> tuple[DrafterConfig, dict]:
    """The ``DrafterConfig`` of a DeepSpec checkpoint and its whole ``config.json``."""
    from dspark_jax.checkpoints.hf import config_from_hf

    path = Path(directory) / CONFIG_FILE
    raw = json.loads(path.read_text())

    def refuse(reason: str):
        return ValueError(f"{path}: {reason}")

    if raw.get("architectures") != [ARCHITECTURE]:
        kind = ("a speculators DSpark export" if raw.get("speculators_model_type") == "dspark"
                else f"a DSpark drafter of architecture {raw.get('architectures')}")
        raise refuse(f"{kind}; this reads DeepSpec's {ARCHITECTURE} checkpoints (its Qwen3 drafters)")
    missing = [key for key in ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "markov_rank",
                               "enable_confidence_head") if key not in raw]
    if missing:
        raise refuse(f"a {ARCHITECTURE} config without {', '.join(missing)}: the checkpoint is damaged")
    try:
        taps = as_ints(raw["target_layer_ids"], "target_layer_ids")
        rank, gamma, mask, _ = (as_int(raw[key], key)
                                for key in ("markov_rank", "block_size", "mask_token_id", "num_target_layers"))
    except (TypeError, ValueError) as error:
        raise refuse(f"{error}: the checkpoint is damaged") from None
    if -1 in taps:
        raise refuse("target_layer_ids has -1 (the target's embedding output), which dspark-jax drafters do not tap")
    if any(kind != "full_attention" for kind in raw.get("layer_types") or []):
        raise refuse(f"layer_types {raw['layer_types']}: sliding-window draft layers are not supported")
    try:
        backbone = config_from_hf(raw)  # the draft layers' shape: the target's Qwen3 config, drafter depth
    except ValueError as error:
        raise refuse(str(error)) from None
    confidence = bool(raw["enable_confidence_head"])
    with_markov = confidence and bool(raw.get("confidence_head_with_markov", False))
    fields = dict(
        backbone=dataclasses.replace(backbone, qk_norm=True),  # DeepSpec's draft attention always has q/k norms
        tap_layers=taps, mask_token_id=mask, block_size=gamma,
        markov_head=str(raw.get("markov_head_type", "none")).lower() if rank > 0 else "none",
        markov_rank=rank, markov_w1_rows="target", confidence_head=confidence, confidence_with_markov=with_markov,
    )
    if rank == 0 and not confidence:  # DFlash: DeepSpec runs it as the same class
        fields |= dict(kind="dflash", ce_weight=1.0, tv_weight=0.0, confidence_weight=0.0)
    try:
        return DrafterConfig(**fields), raw
    except ValueError as error:
        raise refuse(f"holds no drafter dspark-jax can build: {error}") from None


def _layer_names(index: int) -> dict[str, tuple[str, ...]]:
    """Our names in draft layer ``index`` -> the DeepSpec tensors fused into each (output rows)."""
    theirs = f"layers.{index}."
    return {
        "q.weight": (theirs + "self_attn.q_proj.weight",),
        "kv.weight": (theirs + "self_attn.k_proj.weight", theirs + "self_attn.v_proj.weight"),
        "o.weight": (theirs + "self_attn.o_proj.weight",),
        "q_norm.weight": (theirs + "self_attn.q_norm.weight",),
        "k_norm.weight": (theirs + "self_attn.k_norm.weight",),
        "mlp.gate_up.weight": (theirs + "mlp.gate_proj.weight", theirs + "mlp.up_proj.weight"),
        "mlp.down.weight": (theirs + "mlp.down_proj.weight",),
        "input_norm.weight": (theirs + "input_layernorm.weight",),
        "post_attn_norm.weight": (theirs + "post_attention_layernorm.weight",),
    }


def tensor_sources(cfg: DrafterConfig) -> dict[str, tuple[str, ...]]:
    """Every tensor of our drafter -> the DeepSpec tensors it is made of."""
    sources = {"backbone.fc.weight": ("fc.weight",), "backbone.hidden_norm.weight": ("hidden_norm.weight",),
               "backbone.final_norm.weight": ("norm.weight",)}
    for index in range(cfg.backbone.num_layers):
        sources |= {f"backbone.layers.{index}.{ours}": theirs for ours, theirs in _layer_names(index).items()}
    if cfg.markov_head != "none":
        sources |= {"markov.w1": ("markov_head.markov_w1.weight",), "markov.w2.weight": ("markov_head.markov_w2.weight",)}
        extra = {"gated": ("gate", "gate_proj"), "rnn": ("joint", "joint_proj")}.get(cfg.markov_head)
        if extra:
            sources |= {f"markov.{extra[0]}.{p}": (f"markov_head.{extra[1]}.{p}",) for p in ("weight", "bias")}
    if cfg.confidence_head:
        sources["confidence.proj.weight"] = ("confidence_head.proj.weight",)
        sources["confidence.proj.bias"] = ("confidence_head.proj.bias",)
    return sources


def read_deepspec_drafter(directory):
    """``(cfg, tensors)``: a DeepSpec checkpoint's drafter config and our drafter's tensors by
    state path (float32); ``trained_for`` reads the record of its target. Every tensor the config
    needs must be there, and nothing else: a missing or extra one is a ``ValueError`` naming it."""
    from dspark_jax.checkpoints.hf import read_tensors, safetensors_files

    directory = Path(directory)
    cfg = read_deepspec_config(directory)[0]
    files = safetensors_files(directory)
    sources = tensor_sources(cfg)
    if cfg.confidence_head and "confidence_head.proj.bias" not in files:  # checkpoints in the wild have none
        cfg = dataclasses.replace(cfg, confidence_bias=False)
        del sources["confidence.proj.bias"]
    wanted = {name for names in sources.values() for name in names}
    missing = sorted(wanted - set(files))
    unexpected = sorted(set(files) - wanted - set(FROZEN))
    if missing or unexpected:
        raise ValueError(f"{directory}: the safetensors do not hold the {ARCHITECTURE} its {CONFIG_FILE} describes: "
                         f"missing {missing}, unexpected {unexpected}")
    read = read_tensors(files, wanted, np.float32)
    tensors = {ours: np.concatenate([read[name] for name in theirs], axis=0) for ours, theirs in sources.items()}
    return cfg, tensors


def trained_for(directory, num_target_layers: int) -> dict:
    """The record of a DeepSpec checkpoint's target (``checkpoints.drafter.identity``): its depth,
    from the config, and a sketch of ``embed_tokens``, of which only the sampled rows are read."""
    from dspark_jax.checkpoints.drafter import identity, sketch_of_rows
    from dspark_jax.checkpoints.hf import open_safetensors, safetensors_files

    files = safetensors_files(Path(directory))
    if "embed_tokens.weight" not in files:
        raise ValueError(f"{directory}: no embed_tokens.weight, the checkpoint's record of its target: the "
                         "checkpoint is damaged")
    with open_safetensors(files["embed_tokens.weight"]) as f:
        embedding = f.get_slice("embed_tokens.weight")
        vocab, width = embedding.get_shape()
        sketch = sketch_of_rows(lambda rows: np.concatenate([embedding[r:r + 1] for r in rows]), vocab, width)
    return identity(num_target_layers, sketch)


def convert_deepspec_drafter(directory, out, *, storage_dtype: str = "float32") -> Path:
    """Write the DeepSpec checkpoint in ``directory`` to ``out`` as a dspark-jax drafter: its draft
    layers and heads (without the copies of the target's embedding and LM head: a 4B target's
    drafter loses most of its size), the record of its target, and its DeepSpec config in the
    metadata. What it drafts is unchanged (bit for bit in float32)."""
    from dspark_jax.checkpoints.drafter import load_drafter, save_drafter

    directory = Path(directory)
    raw = read_deepspec_config(directory)[1]
    metadata = {"converted_from": str(directory.resolve()), "deepspec_config": raw}
    return save_drafter(load_drafter(directory), out, storage_dtype=storage_dtype, metadata=metadata,
                        target=trained_for(directory, raw["num_target_layers"]))
