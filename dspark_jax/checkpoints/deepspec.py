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

DeepSpec's EAGLE-3 baselines (``Qwen3Eagle3Model``, as ``deepseek-ai/eagle3_qwen3_4b_ttt7`` is
published: the paper's Table 1 EAGLE-3) are read as our EAGLE-3 drafter: ``target_layer_ids`` its
taps, ``ttt_length`` its γ, its one layer in the tensor names speculators' EAGLE-3 drafters use,
and its own head over all tokens; its ``embed_tokens`` (a frozen copy of the target's) is the
record of its target. Several layers are refused: each of DeepSpec's takes the token embeddings,
where ours after the first are plain decoder layers.

The checkpoint's ``embed_tokens`` and ``lm_head`` are copies of its target's. They are not read
whole (a drafter takes its target's at run time), but a sketch of ``embed_tokens`` is the
drafter's record of its target, so ``load_drafter`` refuses a target they do not match, as it
does for drafters trained here.

SpecForge and ModelOpt export the same drafter as ``DSparkDraftModel`` with its DSpark fields in
a nested ``dflash_config`` (``projector_type`` "dspark"): read the same way once they are lifted
to the top level, as vLLM does, with SpecForge's defaults for the fields it leaves out (SpecForge
trains these drafters as DeepSpec does: slot k of a block on the (k + 1)-th token after the
anchor). z-lab's DFlash drafters (``DFlashDraftModel``, ``target_layer_ids``
and ``mask_token_id`` in a ``dflash_config`` or at the top level, ``block_size`` 16 where not
said, as z-lab's code reads them) are the same layers without heads, whose block
slot 0 holds the anchor and drafts nothing: ``block_size`` slots draft ``block_size - 1`` tokens
(``draft_from_anchor=False``). Either may leave out the copies of the target's embedding and
head; it then records nothing of its target. z-lab's layers attend as its code and vLLM run
them: a ``sliding_attention`` layer causally within its block, over the ``sliding_window``
positions up to each slot's own (``window_per_slot``), a ``full_attention`` layer
bidirectionally, unless ``is_causal`` (or vLLM's older ``causal``) states every layer's.

A ``DSparkDraftModel``'s sliding-window layers attend as SpecForge's training masks them, which
is z-lab's rule for DFlash's.

Refused by name: other architectures (Gemma 4 drafters), ``target_layer_ids`` of -1 (the
embedding output) or of the target's last layer, sliding-window layers in DeepSpec's checkpoints,
stated causality in them and their exports (but false with full attention alone), attention
biases, and the scales z-lab's code applies for targets that scale their embeddings and logits
(``NEUTRAL_SCALES``).
speculators' DSpark and DFlash checkpoints (``checkpoints.speculators``) share these tensor names.

Like ``checkpoints.speculators``, this module is a reader ``checkpoints.drafter`` dispatches to:
``NAME``, ``claims``, ``read_config``, ``read_drafter`` and ``trained_for``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from dspark_jax.config import DFLASH_FIELDS, EAGLE3_FIELDS, DrafterConfig, as_int, as_ints

NAME = "deepspec"
ARCHITECTURE = "Qwen3DSparkModel"
# SpecForge / ModelOpt exports of the same drafter: DeepSpec's DSpark fields nested in
# ``dflash_config`` (z-lab DFlash's layout), lifted to the top level as vLLM does.
EXPORTED = "DSparkDraftModel"
# z-lab's DFlash drafters: the same layers and tensors, no heads, and block slot 0 drafts nothing.
ZLAB_DFLASH = "DFlashDraftModel"
ZLAB_BLOCK_SIZE = 16  # what z-lab's code takes where a config names no block_size
# DeepSpec's EAGLE-3 baseline drafters (the paper's Table 1 ones): one EAGLE-3 layer, its own head.
EAGLE3_ARCHITECTURE = "Qwen3Eagle3Model"
NESTED = {EXPORTED: "dspark", ZLAB_DFLASH: "dflash"}  # architecture -> its dflash_config's projector_type
CONFIG_FILE = "config.json"
FROZEN = ("embed_tokens.weight", "lm_head.weight")  # copies of the target's
# The sliding-window fields of a draft layers' HF config.
SLIDING_FIELDS = ("layer_types", "sliding_window", "use_sliding_window")
# Fields z-lab's code reads to scale a drafter's input embeddings and logits (for targets that
# scale theirs, as Gemma's do): at these values they change nothing, and nothing else is read.
NEUTRAL_SCALES = {"input_embedding_scale": (None, 1), "output_multiplier": (None, 1),
                  "final_logit_softcapping": (None, 0)}


def read_config_json(directory) -> dict | None:
    """``directory``'s ``config.json`` as a JSON object, or None where there is none."""
    try:
        raw = json.loads((Path(directory) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def claims(directory) -> bool:
    """Whether ``directory`` holds a drafter DeepSpec (or another program naming a DSpark
    architecture) or z-lab saved: ``read_config`` reads DeepSpec's Qwen3 ones, their exports and
    z-lab's DFlash ones, and refuses the others by name."""
    raw = read_config_json(directory)
    if raw is None or "speculators_model_type" in raw:  # speculators' (checkpoints.speculators)
        return False
    architectures = raw.get("architectures")
    return isinstance(architectures, list) and (  # Gemma 4 ones too, to refuse them by name
        architectures == [ZLAB_DFLASH] or any("DSpark" in str(a) or str(a).endswith("Eagle3Model")
                                              for a in architectures))


def read_config(directory, target_depth: int | None = None) -> tuple[DrafterConfig, dict]:
    """The ``DrafterConfig`` of a DeepSpec checkpoint and its whole ``config.json`` (its tapped
    layers are always named: ``target_depth`` is not needed)."""
    path = Path(directory) / CONFIG_FILE
    raw = json.loads(path.read_text())

    def refuse(reason: str):
        return ValueError(f"{path}: {reason}")

    architecture = (raw.get("architectures") or [None])[0]
    if raw.get("architectures") == [EAGLE3_ARCHITECTURE]:
        return _eagle3_config(raw, refuse), raw
    zlab = architecture == ZLAB_DFLASH
    # z-lab's code reads each field from dflash_config, else from the top level, so it may have none.
    if architecture in NESTED and len(raw["architectures"]) == 1 and (zlab or isinstance(raw.get("dflash_config"), dict)):
        raw = _lifted(raw, NESTED[architecture], refuse)
        if zlab:  # DFlash: no Markov head, no confidence head
            raw = {"markov_rank": 0, "enable_confidence_head": False, "block_size": ZLAB_BLOCK_SIZE, **raw}
        else:
            raw = {**_specforge_defaults(raw, refuse), **raw}
    elif raw.get("architectures") != [ARCHITECTURE]:
        raise refuse(f"a drafter of architecture {raw.get('architectures')}; this reads DeepSpec's {ARCHITECTURE} "
                     f"checkpoints (its Qwen3 drafters) and its {EAGLE3_ARCHITECTURE} ones, {EXPORTED} exports (with "
                     f"a dflash_config), z-lab's {ZLAB_DFLASH} ones, and speculators' (whose config.json has a "
                     "speculators_model_type)")
    required = ("block_size", "mask_token_id", "target_layer_ids", "markov_rank", "enable_confidence_head",
                *(() if zlab else ("num_target_layers",)))  # z-lab's code does not need the target's depth
    missing = [key for key in required if key not in raw]
    if missing:
        raise refuse(f"a {architecture} config without {', '.join(missing)}: the checkpoint is damaged")
    try:
        taps = as_ints(raw["target_layer_ids"], "target_layer_ids")
        rank, gamma, mask = (as_int(raw[key], key) for key in ("markov_rank", "block_size", "mask_token_id"))
        if "num_target_layers" in raw:
            as_int(raw["num_target_layers"], "num_target_layers")
    except (TypeError, ValueError) as error:
        raise refuse(f"{error}: the checkpoint is damaged") from None
    if -1 in taps:
        raise refuse("target_layer_ids has -1 (the target's embedding output), which dspark-jax drafters do not tap")
    scaled = [f"{key} {raw[key]!r}" for key, neutral in NEUTRAL_SCALES.items() if raw.get(key) not in neutral]
    if scaled:
        raise refuse(f"{', '.join(scaled)}: z-lab's code scales the drafter's input embeddings or logits by these "
                     "(for targets that scale theirs), which dspark-jax drafters do not")
    causal = _stated_causality(raw, refuse)
    if not zlab:  # DeepSpec's DSpark attends within a block bidirectionally, in full-attention layers
        if architecture == ARCHITECTURE and any(kind != "full_attention" for kind in raw.get("layer_types") or []):
            raise refuse(f"layer_types {raw['layer_types']}: sliding-window draft layers are not supported in "
                         f"{architecture} checkpoints")
        if causal:
            raise refuse(f"is_causal true: a {architecture} attends within a block bidirectionally")
    backbone, window, full = draft_layers(raw, refuse)  # the target's Qwen3 config, at the drafter's depth
    if not zlab and window is not None and causal is not None:
        raise refuse(f"is_causal {causal} with sliding-window layers: SpecForge masks a {EXPORTED}'s sliding-window "
                     "layers causally within the block, as z-lab runs DFlash's, whatever the config says")
    # SpecForge trains an export's sliding-window layers with its DFlash masks: z-lab's rule.
    attention = _zlab_attention(window, full, causal, refuse) if zlab or window is not None else {}
    if zlab and gamma < 2:
        raise refuse(f"block_size {gamma}: slot 0 of a {ZLAB_DFLASH} block drafts nothing, so this block drafts "
                     "no token")
    confidence = bool(raw["enable_confidence_head"])
    return drafter_config(backbone, taps=taps, mask_token_id=mask, block_size=gamma - 1 if zlab else gamma,
                          draft_from_anchor=not zlab, markov_rank=rank,
                          markov_head_type=raw.get("markov_head_type", "none"), confidence_head=confidence,
                          confidence_with_markov=confidence and bool(raw.get("confidence_head_with_markov", False)),
                          refuse=refuse, **attention), raw


def _eagle3_config(raw: dict, refuse) -> DrafterConfig:
    """Our ``DrafterConfig`` of DeepSpec's EAGLE-3 baseline: its one layer is our EAGLE-3
    drafter's, with its own head over all tokens (a copy of its target's, frozen in training) and
    γ its ``ttt_length``. Its ``embed_tokens`` (a frozen copy of the target's) is only the record
    of its target: ours embeds with the target's."""
    missing = [key for key in ("target_layer_ids", "ttt_length", "num_target_layers") if key not in raw]
    if missing:
        raise refuse(f"a {EAGLE3_ARCHITECTURE} config without {', '.join(missing)}: the checkpoint is damaged")
    try:
        taps = as_ints(raw["target_layer_ids"], "target_layer_ids")
        gamma = as_int(raw["ttt_length"], "ttt_length")
        as_int(raw["num_target_layers"], "num_target_layers")
    except (TypeError, ValueError) as error:
        raise refuse(f"{error}: the checkpoint is damaged") from None
    if any(kind != "full_attention" for kind in raw.get("layer_types") or []):
        raise refuse(f"layer_types {raw['layer_types']}: sliding-window draft layers are not supported in "
                     f"DeepSpec's {EAGLE3_ARCHITECTURE} checkpoints")
    backbone, _, _ = draft_layers(raw, refuse)  # the target's Qwen3 config, at the drafter's depth
    if backbone.num_layers != 1:
        raise refuse(f"num_hidden_layers {backbone.num_layers}: each of DeepSpec's EAGLE-3 layers takes the token "
                     "embeddings, and dspark-jax stacks plain decoder layers after the first (as speculators and "
                     "vLLM do)")
    try:
        return DrafterConfig(**EAGLE3_FIELDS, backbone=dataclasses.replace(backbone, qk_norm=True), tap_layers=taps,
                             block_size=gamma, mask_token_id=0,  # EAGLE-3 drafts without a mask token
                             draft_vocab_size=backbone.vocab_size, ttt_step_decay=raw.get("step_loss_decay", 0.8))
    except ValueError as error:
        raise refuse(f"holds no drafter dspark-jax can build: {error}") from None


def _specforge_defaults(raw: dict, refuse) -> dict:
    """What SpecForge's ``DSparkDraftModel`` takes for the DSpark fields its ``dflash_config`` may
    leave out: no Markov head, a vanilla one where a rank is given, and a confidence head where
    the config weighs its loss (``confidence_head_alpha`` above 0), on the hidden state alone."""
    alpha = raw.get("confidence_head_alpha") or 0.0
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise refuse(f"confidence_head_alpha is {alpha!r}, not a number: the checkpoint is damaged")
    return {"markov_rank": 0, "markov_head_type": "vanilla", "enable_confidence_head": alpha > 0,
            "confidence_head_with_markov": False}


def _stated_causality(raw: dict, refuse) -> bool | None:
    """Whether the config makes every draft layer causal (True) or bidirectional (False) within a
    block: ``is_causal`` (z-lab's code and vLLM read it first), else ``causal`` (vLLM's older
    ``dflash_config`` key); None where it says neither."""
    for key in ("is_causal", "causal"):
        value = raw.get(key)
        if value is not None:
            if not isinstance(value, bool):
                raise refuse(f"{key} is {value!r}, not true or false: the checkpoint is damaged")
            return value
    return None


def _zlab_attention(window: int | None, full: tuple[int, ...], causal: bool | None, refuse) -> dict:
    """``DrafterConfig``'s attention fields for a z-lab DFlash drafter, as z-lab's code and vLLM
    run its layers: a sliding-window layer causal within the block and seeing the window up to
    each slot's own position, a full-attention layer bidirectional, unless the config states the
    causality of every layer (``causal``)."""
    if window is None:
        return dict(block_causal=bool(causal))
    if causal and full:
        raise refuse(f"is_causal true with full-attention layers {list(full)} among sliding-window ones: "
                     "dspark-jax exempts a full-attention layer from the window and causality together")
    return dict(sliding_window=window, window_per_slot=True, block_causal=causal is not False,
                full_attention_layers=full)


def draft_layers(layers: dict, refuse):
    """``(shape, window, full)`` of a checkpoint's draft layers from their HF config: their
    ``TargetConfig`` shape, the sliding window of its ``sliding_attention`` layers (None: there are
    none) and the ``full_attention`` layers among them (``DrafterConfig.full_attention_layers``);
    ``refuse(reason)`` makes the error naming the file."""
    from dspark_jax.checkpoints.hf import config_from_hf

    try:  # the sliding-window fields are read here, not by the HF reader (targets have no windows)
        backbone = config_from_hf({k: v for k, v in layers.items() if k not in SLIDING_FIELDS})
    except ValueError as error:
        raise refuse(str(error)) from None
    kinds = layers.get("layer_types") or ["full_attention"] * backbone.num_layers
    if not isinstance(kinds, list) or not set(kinds) <= {"full_attention", "sliding_attention"}:
        raise refuse(f"layer_types {kinds}: a draft layer's attention is full_attention or sliding_attention")
    if len(kinds) != backbone.num_layers:
        raise refuse(f"{len(kinds)} layer_types for {backbone.num_layers} layers: the checkpoint is damaged")
    if "sliding_attention" not in kinds:
        return backbone, None, ()
    try:
        window = as_int(layers.get("sliding_window"), "a sliding-window layer's sliding_window")
    except (TypeError, ValueError) as error:
        raise refuse(f"{error}: the checkpoint is damaged") from None
    return backbone, window, tuple(i for i, kind in enumerate(kinds) if kind == "full_attention")


def _lifted(raw: dict, projector: str, refuse) -> dict:
    """A config with its ``dflash_config`` fields at the top level (as DeepSpec's), which must be
    of ``projector`` kind where it says."""
    nested = raw.get("dflash_config", {})
    if not isinstance(nested, dict):
        raise refuse(f"dflash_config is {nested!r}, not an object: the checkpoint is damaged")
    nested = dict(nested)
    said = nested.pop("projector_type", projector)
    if said != projector:
        raise refuse(f"dflash_config.projector_type {said!r}: a {raw['architectures'][0]} is read as projector_type "
                     f"{projector!r}")
    clashing = sorted(key for key, value in nested.items() if key in raw and raw[key] != value)
    if clashing:
        raise refuse(f"{', '.join(clashing)} differ between the top level and dflash_config: the checkpoint is damaged")
    return {**nested, **raw}


def drafter_config(backbone, *, taps, mask_token_id: int, block_size: int, markov_rank: int, markov_head_type,
                   confidence_head: bool, confidence_with_markov: bool, refuse, draft_vocab_size=None,
                   draft_from_anchor: bool = True, sliding_window: int | None = None, block_causal: bool = False,
                   full_attention_layers: tuple[int, ...] = (), window_per_slot: bool = False) -> DrafterConfig:
    """Our ``DrafterConfig`` for a DeepSpec-style DSpark drafter (DeepSpec's or speculators') whose
    draft layers have ``backbone``'s shape; ``refuse(reason)`` makes the error naming the file. No
    Markov head and no confidence head is a DFlash drafter, which both run as the same class."""
    fields = dict(
        backbone=dataclasses.replace(backbone, qk_norm=True),  # their draft attention always has q/k norms
        tap_layers=taps, mask_token_id=mask_token_id, block_size=block_size,
        markov_head=str(markov_head_type).lower() if markov_rank > 0 else "none",
        markov_rank=markov_rank, markov_w1_rows="target", confidence_head=confidence_head,
        confidence_with_markov=confidence_with_markov, draft_vocab_size=draft_vocab_size,
        draft_from_anchor=draft_from_anchor, sliding_window=sliding_window, block_causal=block_causal,
        full_attention_layers=full_attention_layers, window_per_slot=window_per_slot,
    )
    if markov_rank == 0 and not confidence_head:
        fields |= DFLASH_FIELDS
    try:
        return DrafterConfig(**fields)
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


def _layer_body_sources(ours: str, theirs: str, qk_norm: bool) -> dict[str, tuple[str, ...]]:
    """An EAGLE-3 draft layer's attention and MLP (``drafter.eagle3._LayerBody``) -> the tensors
    of the layer ``theirs`` (a prefix such as ``layers.0.``)."""
    sources = {
        ours + "qkv.weight": tuple(f"{theirs}self_attn.{x}_proj.weight" for x in "qkv"),
        ours + "o.weight": (theirs + "self_attn.o_proj.weight",),
        ours + "post_attn_norm.weight": (theirs + "post_attention_layernorm.weight",),
        ours + "mlp.gate_up.weight": (theirs + "mlp.gate_proj.weight", theirs + "mlp.up_proj.weight"),
        ours + "mlp.down.weight": (theirs + "mlp.down_proj.weight",),
    }
    if qk_norm:
        sources |= {f"{ours}{x}_norm.weight": (f"{theirs}self_attn.{x}_norm.weight",) for x in "qk"}
    return sources


def eagle3_tensor_sources(cfg: DrafterConfig) -> dict[str, tuple[str, ...]]:
    """Every tensor of our EAGLE-3 drafter -> the tensors of a speculators or DeepSpec EAGLE-3
    checkpoint (the same names) it is made of. Its first layer's are the drafter's own; a later
    layer is a plain decoder layer (``later_layers``)."""
    qk_norm = cfg.backbone.qk_norm
    sources = {
        "fc.weight": ("fc.weight",),
        "embed_norm.weight": ("layers.0.input_layernorm.weight",),
        "hidden_norm.weight": ("layers.0.hidden_norm.weight",),
        **_layer_body_sources("", "layers.0.", qk_norm),
        "final_norm.weight": ("norm.weight",),
        "draft_head.linear.weight": ("lm_head.weight",),
    }
    for index in range(1, cfg.backbone.num_layers):
        later, layer = f"later_layers.{index - 1}.", f"layers.{index}."
        sources |= {later + "input_norm.weight": (layer + "input_layernorm.weight",),
                    **_layer_body_sources(later, layer, qk_norm)}
    if cfg.eagle3_feature_norm == "joint":
        sources["feature_norms.0.weight"] = ("input_norm.weight",)
    elif cfg.eagle3_feature_norm == "per_layer":
        sources |= {f"feature_norms.{i}.weight": (f"fc_norm.{i}.weight",) for i in range(len(cfg.tap_layers))}
    return sources


def read_sources(directory, cfg: DrafterConfig, sources: dict[str, tuple[str, ...]], *, ignored, described: str,
                 integers=()) -> tuple[DrafterConfig, dict[str, np.ndarray]]:
    """``(cfg, tensors)``: our drafter's tensors by state path (float32), each the checkpoint's
    ``sources`` fused, and the checkpoint's ``integers`` under their own names (int32);
    ``ignored`` are tensors it may hold that the drafter does not use. Every tensor needed must be
    there, and nothing else: a missing or extra one is a ``ValueError`` naming it and
    ``described`` (what the config describes)."""
    from dspark_jax.checkpoints.hf import read_tensors, safetensors_files

    files = safetensors_files(Path(directory))
    sources = dict(sources)
    if cfg.confidence_head and "confidence_head.proj.bias" not in files:  # DeepSpec's in the wild have none
        cfg = dataclasses.replace(cfg, confidence_bias=False)
        del sources["confidence.proj.bias"]
    wanted = {name for names in sources.values() for name in names}
    missing = sorted((wanted | set(integers)) - set(files))
    unexpected = sorted(set(files) - wanted - set(integers) - set(ignored))
    if missing or unexpected:
        raise ValueError(f"{directory}: the safetensors do not hold the {described} its {CONFIG_FILE} describes: "
                         f"missing {missing}, unexpected {unexpected}")
    read = read_tensors(files, wanted, np.float32)
    tensors = {ours: np.concatenate([read[name] for name in theirs], axis=0) for ours, theirs in sources.items()}
    return cfg, tensors | read_tensors(files, set(integers), np.int32)


def read_drafter(directory, cfg: DrafterConfig):
    """``(cfg, tensors)``: a DeepSpec checkpoint's drafter config (``read_config``'s, adjusted to
    what the tensors hold) and our drafter's tensors by state path (float32); ``trained_for``
    reads the record of its target."""
    from dspark_jax.checkpoints.drafter import D2T

    if cfg.kind != "eagle3":
        return read_sources(directory, cfg, tensor_sources(cfg), ignored=FROZEN, described=ARCHITECTURE)
    cfg, tensors = read_sources(directory, cfg, eagle3_tensor_sources(cfg), ignored=("embed_tokens.weight",),
                                described=EAGLE3_ARCHITECTURE)
    return cfg, tensors | {D2T: np.arange(cfg.vocab_size, dtype=np.int32)}  # its head's rows: every token


def trained_for(directory, raw: dict) -> dict | None:
    """The record of a DeepSpec checkpoint's target (``checkpoints.drafter.identity``): its depth,
    from its ``config.json`` (``raw``), and a sketch of ``embed_tokens``, of which only the
    sampled rows are read; None for an export without the copy of the embedding."""
    from dspark_jax.checkpoints.drafter import embedding_sketch, identity

    sketch = embedding_sketch(directory)
    if sketch is None:
        # Exports, z-lab's drafters too, may leave the target's copies out; DeepSpec's own keep them.
        if raw.get("architectures") not in ([ARCHITECTURE], [EAGLE3_ARCHITECTURE]):
            return None
        raise ValueError(f"{directory}: no embed_tokens.weight, the checkpoint's record of its target: the "
                         "checkpoint is damaged")
    return identity(raw.get("num_target_layers"), sketch)
