"""DSpark and DFlash drafters trained with speculators (``vllm-project/speculators``, whose
checkpoints vLLM serves): ``DSparkDraftModel`` and ``DFlashDraftModel`` checkpoints, read as
dspark-jax drafters.

speculators saves a drafter with transformers' ``save_pretrained``: ``config.json`` (its
``speculators_model_type``, "dspark" or "dflash", the draft layers' Qwen3 config nested as
``transformer_layer_config``, and the block fields: ``block_size``, ``mask_token_id``,
``aux_hidden_state_layer_ids``, ``draft_vocab_size``, ``sample_from_anchor``; DSpark's also
``markov_rank`` / ``markov_head_type``, ``enable_confidence_head`` /
``confidence_head_with_markov``) and safetensors under DeepSpec's tensor names
(``checkpoints.deepspec.tensor_sources``). Where it differs from DeepSpec's:

* Its tapped layers count the target's hidden states as transformers does (0 is the embedding
  output, ``i`` the output of decoder layer ``i - 1``): layer id ``i`` is our tap ``i - 1``.
* ``sample_from_anchor`` false (DFlash's default, z-lab's convention; checkpoints speculators
  converted from z-lab's are of this kind, and exports from before the key existed): block slot 0
  holds the anchor and drafts nothing, slot ``k`` drafts the ``k``-th token after it, so
  ``block_size`` slots draft ``block_size - 1`` tokens (our ``draft_from_anchor=False``). True
  (DSpark's default, DeepSpec's convention): slot ``k`` drafts token ``k + 1``.
* A reduced draft vocabulary (``draft_vocab_size`` below the target's) has its own ``lm_head``
  over those tokens and ``d2t``, an offset per draft token (target id = draft index + ``d2t``),
  read as our reduced head and its ids; the Markov head's ``W1`` still has a row per target token.
  With the full vocabulary the target's LM head is used, as here.
* It saves no copy of the target's embedding, so the checkpoint records nothing of its target
  but its width, vocabulary and the verifier's name (``speculators_config.verifier``): a target of
  the same shape is not refused (``trained_for`` gives None).

Refused by name: speculators' other drafters (EAGLE-3, MTP, ...), a tap of the embedding output
(layer id 0), sliding-window draft layers, attention biases and a draft width other than the
target's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark_jax.checkpoints.deepspec import (
    CONFIG_FILE,
    draft_layers,
    drafter_config,
    read_config_json,
    read_sources,
    tensor_sources,
)
from dspark_jax.config import DrafterConfig, as_int, as_ints

NAME = "speculators"
# What speculators may leave in a checkpoint that the drafter does not use: the target's weights
# (its embedding, head and final norm come from the target here) and the draft vocabulary's mask.
VERIFIER_TENSORS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
REQUIRED = ("transformer_layer_config", "block_size", "mask_token_id", "aux_hidden_state_layer_ids",
            "draft_vocab_size")
MODEL_TYPES = {"dspark": ("markov_rank", "enable_confidence_head"), "dflash": ()}  # what each adds


def claims(directory) -> bool:
    """Whether ``directory`` holds a drafter speculators saved (of any kind: ``read_config``
    reads its DSpark and DFlash drafters and refuses the others by name)."""
    raw = read_config_json(directory)
    return raw is not None and "speculators_model_type" in raw


def read_config(directory) -> tuple[DrafterConfig, dict]:
    """The ``DrafterConfig`` of a speculators DSpark or DFlash checkpoint and its whole ``config.json``."""
    path = Path(directory) / CONFIG_FILE
    raw = read_config_json(directory)

    def refuse(reason: str):
        return ValueError(f"{path}: {reason}")

    kind = raw.get("speculators_model_type")
    if kind not in MODEL_TYPES:
        raise refuse(f"a speculators {kind} drafter; this reads speculators' DSpark and DFlash drafters and DeepSpec's")
    missing = [key for key in REQUIRED + MODEL_TYPES[kind] if raw.get(key) is None]
    if missing:
        raise refuse(f"a speculators {kind} config without {', '.join(missing)}: the checkpoint is damaged")
    # Exports from before speculators had the key (its PR #760) used DFlash's layout, DSpark's too.
    from_anchor = raw.get("sample_from_anchor", False)
    if not isinstance(from_anchor, bool):
        raise refuse(f"sample_from_anchor is {from_anchor!r}, not true or false: the checkpoint is damaged")
    layers = raw["transformer_layer_config"]
    if not isinstance(layers, dict):
        raise refuse(f"transformer_layer_config is {layers!r}, not the draft layers' config: the checkpoint is damaged")
    try:
        layer_ids = as_ints(raw["aux_hidden_state_layer_ids"], "aux_hidden_state_layer_ids")
        slots, mask, draft_vocab = (as_int(raw[key], key) for key in ("block_size", "mask_token_id", "draft_vocab_size"))
        rank = as_int(raw.get("markov_rank", 0), "markov_rank")
    except (TypeError, ValueError) as error:
        raise refuse(f"{error}: the checkpoint is damaged") from None
    if 0 in layer_ids:
        raise refuse("aux_hidden_state_layer_ids has 0 (the target's embedding output), which dspark-jax drafters "
                     "do not tap")
    backbone = draft_layers(layers, lambda reason: refuse(f"transformer_layer_config: {reason}"))
    width = raw.get("target_hidden_size")
    if width is not None and width != backbone.hidden_size:
        raise refuse(f"target_hidden_size {width} differs from the draft layers' {backbone.hidden_size}: dspark-jax "
                     "drafters are as wide as their target")
    if not from_anchor and slots < 2:
        raise refuse(f"block_size {slots} with sample_from_anchor false drafts nothing")
    confidence = bool(raw.get("enable_confidence_head", False))
    return drafter_config(
        backbone, taps=tuple(i - 1 for i in layer_ids), mask_token_id=mask,
        block_size=slots if from_anchor else slots - 1, draft_from_anchor=from_anchor, markov_rank=rank,
        markov_head_type=raw.get("markov_head_type", "vanilla"), confidence_head=confidence,
        confidence_with_markov=confidence and bool(raw.get("confidence_head_with_markov", False)),
        draft_vocab_size=draft_vocab if draft_vocab != backbone.vocab_size else None, refuse=refuse), raw


def read_drafter(directory, cfg: DrafterConfig):
    """``(cfg, tensors)``: a speculators checkpoint's drafter config (``read_config``'s) and our
    drafter's tensors by state path (float32; a reduced vocabulary's target ids as
    ``draft_head.d2t``)."""
    from dspark_jax.checkpoints.drafter import D2T

    sources = tensor_sources(cfg)
    if cfg.draft_vocab_size is None:  # the target's head; vocabulary maps, where saved, are the identity
        ignored, integers = [*VERIFIER_TENSORS, "lm_head.weight", "d2t", "t2d"], ()
    else:
        sources["draft_head.linear.weight"] = ("lm_head.weight",)
        ignored, integers = [*VERIFIER_TENSORS, "t2d"], ("d2t",)
    cfg, tensors = read_sources(directory, cfg, sources, ignored=ignored, described=f"speculators {cfg.kind} drafter",
                                integers=integers)
    if cfg.draft_vocab_size is not None:
        tensors[D2T] = (np.arange(cfg.draft_vocab_size) + tensors.pop("d2t")).astype(np.int32)  # as saved here
    return cfg, tensors


def trained_for(directory, raw: dict) -> None:
    """speculators records no sketch of its target (``checkpoints.drafter.identity``)."""
    return None
