"""Drafters trained with speculators (``vllm-project/speculators``, whose checkpoints vLLM
serves): ``DSparkDraftModel``, ``DFlashDraftModel`` and ``Eagle3DraftModel`` checkpoints, read as
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
* Its DSpark and DFlash drafters save no copy of the target's embedding, so such a checkpoint
  records nothing of its target but its width, vocabulary and the verifier's name
  (``speculators_config.verifier``): a target of the same shape is not refused (``trained_for``
  gives None). Its EAGLE-3 drafters keep the copy (``embed_tokens``), whose sketch refuses another
  target as for drafters trained here (not its depth, which the config does not say).
* Sliding-window layers (``layer_types`` "sliding_attention", every layer by default in
  speculators' trainer, window 2048): a block sees the ``sliding_window`` context positions
  before its anchor (our ``sliding_window``, as its training mask has it), and its slots attend
  causally within the block (our ``block_causal``; vLLM runs such layers causally too) unless
  ``sliding_window_non_causal`` is true. Full-attention layers among them (its trainer's
  ``--full-attention-indices``; our ``full_attention_layers``) see all context and the whole
  block. vLLM's attention applies the window from each slot's own position, so it leaves out a
  few of the oldest context keys (at most γ + 1) that the training mask shows; this port follows
  the training mask (``window_per_slot`` off; z-lab's checkpoints, read as vLLM runs them, turn
  it on).

EAGLE-3 drafters (``speculators_model_type`` "eagle3") keep the target-side layout too (layer
ids as above in ``eagle_aux_hidden_state_layer_ids``, ``lm_head`` over ``draft_vocab_size`` tokens
with ``d2t``; with the full vocabulary its ``lm_head`` is still its own, as vLLM reads it) and
draft as many tokens as the default proposal method's ``speculative_tokens``. Their draft layers
(one by default; more are plain decoder layers after the first, as speculators and vLLM stack
them) take speculators' options: ``norm_before_fc`` or ``fc_norm`` (the features' norms before
``fc``), ``norm_before_residual`` (the first layer's), ``norm_output`` and sliding-window layers
(``layer_types`` "sliding_attention", speculators' training default; full-attention ones among
them as above), read as our ``eagle3_*`` fields, ``sliding_window`` and
``full_attention_layers``. speculators' training forward windows a later training-time step's
query by its index, not its position; decoding here windows by position, as a KV cache sees it
(the two differ only past ``sliding_window`` tokens, by the few keys at the window's edge).

An EAGLE-3 config without layer ids (what ``speculators convert`` writes for the EAGLE authors'
checkpoints) leaves them to the target, as vLLM and speculators do: hidden states 2, n // 2 and
n - 3 of an n-layer target (``load_drafter`` with a target; without one it is refused by name).

Refused by name: speculators' other drafters (MTP, ...), a tap of the embedding output (layer id
0), an EAGLE-3 drafter that trained its own embedding (``embed_requires_grad``), attention
biases and a draft width other than the target's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark_jax.checkpoints.deepspec import (
    CONFIG_FILE,
    draft_layers,
    drafter_config,
    eagle3_tensor_sources,
    read_config_json,
    read_sources,
    tensor_sources,
)
from dspark_jax.config import EAGLE3_FIELDS, DrafterConfig, as_int, as_ints

NAME = "speculators"
# What speculators may leave in a checkpoint that the drafter does not use: the target's weights
# (its embedding, head and final norm come from the target here) and the draft vocabulary's mask.
VERIFIER_TENSORS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
REQUIRED = ("transformer_layer_config", "block_size", "mask_token_id", "aux_hidden_state_layer_ids",
            "draft_vocab_size")
MODEL_TYPES = {"dspark": ("markov_rank", "enable_confidence_head"), "dflash": ()}  # what each adds
EAGLE3 = "eagle3"


def claims(directory) -> bool:
    """Whether ``directory`` holds a drafter speculators saved (of any kind: ``read_config``
    reads its DSpark, DFlash and EAGLE-3 drafters and refuses the others by name)."""
    raw = read_config_json(directory)
    return raw is not None and "speculators_model_type" in raw


def read_config(directory, target_depth: int | None = None) -> tuple[DrafterConfig, dict]:
    """The ``DrafterConfig`` of a speculators DSpark, DFlash or EAGLE-3 checkpoint and its whole
    ``config.json``; ``target_depth`` (the target's decoder layers) settles an EAGLE-3 drafter's
    taps where its config leaves them to the target."""
    path = Path(directory) / CONFIG_FILE
    raw = read_config_json(directory)

    def refuse(reason: str):
        return ValueError(f"{path}: {reason}")

    kind = raw.get("speculators_model_type")
    if kind == EAGLE3:
        return _eagle3_config(raw, refuse, target_depth), raw
    if kind not in MODEL_TYPES:
        raise refuse(f"a speculators {kind} drafter; this reads speculators' DSpark, DFlash and EAGLE-3 drafters and "
                     "DeepSpec's")
    missing = [key for key in REQUIRED + MODEL_TYPES[kind] if raw.get(key) is None]
    if missing:
        raise refuse(f"a speculators {kind} config without {', '.join(missing)}: the checkpoint is damaged")
    # Exports from before speculators had the key (its PR #760) used DFlash's layout, DSpark's too.
    from_anchor = raw.get("sample_from_anchor", False)
    non_causal = raw.get("sliding_window_non_causal", False)
    for key, value in (("sample_from_anchor", from_anchor), ("sliding_window_non_causal", non_causal)):
        if not isinstance(value, bool):
            raise refuse(f"{key} is {value!r}, not true or false: the checkpoint is damaged")
    try:
        layer_ids = as_ints(raw["aux_hidden_state_layer_ids"], "aux_hidden_state_layer_ids")
        slots, mask, draft_vocab = (as_int(raw[key], key) for key in ("block_size", "mask_token_id", "draft_vocab_size"))
        rank = as_int(raw.get("markov_rank", 0), "markov_rank")
    except (TypeError, ValueError) as error:
        raise refuse(f"{error}: the checkpoint is damaged") from None
    taps = hidden_state_taps(layer_ids, "aux_hidden_state_layer_ids", refuse)
    # Sliding-window layers attend causally within a block unless sliding_window_non_causal says
    # otherwise; full-attention ones bidirectionally (speculators' training mask, vLLM's too).
    backbone, window, full = _draft_layers(raw, raw["transformer_layer_config"], refuse)
    if not from_anchor and slots < 2:
        raise refuse(f"block_size {slots} with sample_from_anchor false drafts nothing")
    confidence = bool(raw.get("enable_confidence_head", False))
    return drafter_config(
        backbone, taps=taps, mask_token_id=mask,
        block_size=slots if from_anchor else slots - 1, draft_from_anchor=from_anchor, markov_rank=rank,
        markov_head_type=raw.get("markov_head_type", "vanilla"), confidence_head=confidence,
        confidence_with_markov=confidence and bool(raw.get("confidence_head_with_markov", False)),
        draft_vocab_size=draft_vocab if draft_vocab != backbone.vocab_size else None, sliding_window=window,
        block_causal=window is not None and not non_causal, full_attention_layers=full, refuse=refuse), raw


def hidden_state_taps(layer_ids: tuple[int, ...], key: str, refuse) -> tuple[int, ...]:
    """Our taps for layer ids in transformers' hidden-state numbering (speculators' and vLLM's)."""
    if 0 in layer_ids:
        raise refuse(f"{key} has 0 (the target's embedding output), which dspark-jax drafters do not tap")
    return tuple(i - 1 for i in layer_ids)


def _draft_layers(raw: dict, layers: dict, refuse):
    """``(shape, window, full)`` of the draft layers of ``transformer_layer_config``
    (``deepspec.draft_layers``), which are as wide as the target."""
    if not isinstance(layers, dict):
        raise refuse(f"transformer_layer_config is {layers!r}, not the draft layers' config: the checkpoint is damaged")
    return target_wide(raw, *draft_layers(layers, lambda reason: refuse(f"transformer_layer_config: {reason}")),
                       refuse=refuse)


def target_wide(raw: dict, backbone, window, full, *, refuse):
    """``(backbone, window, full)`` as given, once the config's ``target_hidden_size`` (where it
    says one) is checked to be the draft layers' width: dspark-jax drafters are as wide as their
    target, whose features ``fc`` takes."""
    width = raw.get("target_hidden_size")
    if width is not None and width != backbone.hidden_size:
        raise refuse(f"target_hidden_size {width} differs from the draft layers' {backbone.hidden_size}: dspark-jax "
                     "drafters are as wide as their target")
    return backbone, window, full


def default_eagle3_layer_ids(target_depth: int | None, refuse) -> list[int]:
    """The layer ids vLLM, SGLang and speculators take for an EAGLE-3 drafter whose config names
    none (the EAGLE authors' checkpoints, and what ``speculators convert`` writes for them): hidden
    states 2, n // 2 and n - 3 of an n-layer target, in transformers' numbering. Without the
    target's depth they are refused by name."""
    if target_depth is None:
        raise refuse("eagle_aux_hidden_state_layer_ids is not set, so the tapped layers depend on the target's "
                     "depth n (vLLM takes its hidden states 2, n // 2 and n - 3): load it with its target "
                     "(load_drafter(..., target=...), as every dspark command that decodes does), or write them "
                     "into the config")
    return [2, target_depth // 2, target_depth - 3]


def _eagle3_config(raw: dict, refuse, target_depth: int | None) -> DrafterConfig:
    """Our ``DrafterConfig`` of a speculators ``Eagle3DraftModel``."""
    missing = [key for key in ("transformer_layer_config", "draft_vocab_size") if raw.get(key) is None]
    if missing:
        raise refuse(f"a speculators eagle3 config without {', '.join(missing)}: the checkpoint is damaged")
    layer_ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if layer_ids is None:
        layer_ids = default_eagle3_layer_ids(target_depth, refuse)
    embedding_trained = raw.get("embed_requires_grad", False)
    if not isinstance(embedding_trained, bool):
        raise refuse(f"embed_requires_grad is {embedding_trained!r}, not true or false: the checkpoint is damaged")
    if embedding_trained:
        raise refuse("embed_requires_grad is true: the drafter trained its own token embedding, and dspark-jax's "
                     "EAGLE-3 drafter embeds with its target's")
    try:
        layer_ids = as_ints(layer_ids, "eagle_aux_hidden_state_layer_ids")
        draft_vocab = as_int(raw["draft_vocab_size"], "draft_vocab_size")
        gamma = _speculative_tokens(raw.get("speculators_config"))
    except (TypeError, ValueError) as error:
        raise refuse(f"{error}: the checkpoint is damaged") from None
    taps = hidden_state_taps(layer_ids, "eagle_aux_hidden_state_layer_ids", refuse)
    return eagle3_config(raw, _draft_layers(raw, raw["transformer_layer_config"], refuse), taps=taps, gamma=gamma,
                         draft_vocab=draft_vocab, refuse=refuse)


def eagle3_config(raw: dict, layers, *, taps, gamma: int, draft_vocab: int, refuse) -> DrafterConfig:
    """Our EAGLE-3 ``DrafterConfig`` for draft layers ``layers`` (``(shape, window, full)``) and the
    layer options a config ``raw`` may set, as speculators and vLLM read them: ``norm_before_fc``
    or ``fc_norm``, ``norm_before_residual`` and ``norm_output`` (EAGLE 3.1)."""
    for flag in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output"):
        if not isinstance(raw.get(flag, False), bool):
            raise refuse(f"{flag} is {raw[flag]!r}, not true or false: the checkpoint is damaged")
    if raw.get("norm_before_fc", False) and raw.get("fc_norm", False):
        raise refuse("norm_before_fc and fc_norm are both true, which speculators and vLLM do not allow: the "
                     "checkpoint is damaged")
    backbone, window, full = layers
    feature_norm = "joint" if raw.get("norm_before_fc") else "per_layer" if raw.get("fc_norm") else "none"
    try:
        return DrafterConfig(
            **EAGLE3_FIELDS, backbone=backbone, tap_layers=taps, block_size=gamma, sliding_window=window,
            full_attention_layers=full, mask_token_id=0,  # EAGLE-3 drafts without a mask token
            draft_vocab_size=draft_vocab,
            eagle3_feature_norm=feature_norm, eagle3_norm_before_residual=raw.get("norm_before_residual", False),
            eagle3_norm_output=raw.get("norm_output", False))
    except ValueError as error:
        raise refuse(f"holds no drafter dspark-jax can build: {error}") from None


def _speculative_tokens(speculators_config) -> int:
    """γ: the draft tokens of the config's default proposal method, as vLLM reads it."""
    if not isinstance(speculators_config, dict):
        raise ValueError("no speculators_config (its proposal methods say how many tokens to draft)")
    default = speculators_config.get("default_proposal_method")
    methods = [m for m in speculators_config.get("proposal_methods") or []
               if isinstance(m, dict) and m.get("proposal_type") == default]
    if not methods or "speculative_tokens" not in methods[0]:
        raise ValueError(f"speculators_config has no {default!r} proposal method with speculative_tokens")
    return as_int(methods[0]["speculative_tokens"], "speculative_tokens")


def read_drafter(directory, cfg: DrafterConfig):
    """``(cfg, tensors)``: a speculators checkpoint's drafter config (``read_config``'s) and our
    drafter's tensors by state path (float32; a reduced head's target ids as ``draft_head.d2t``)."""
    if cfg.kind == EAGLE3:  # its own head, whatever its vocabulary
        sources = eagle3_tensor_sources(cfg)
    else:  # its own head over a reduced vocabulary; else the target's
        sources = tensor_sources(cfg)
        if cfg.draft_vocab_size is not None:
            sources["draft_head.linear.weight"] = ("lm_head.weight",)
    return read_mapped(directory, cfg, sources, described=f"speculators {cfg.kind} drafter")


def read_mapped(directory, cfg: DrafterConfig, sources: dict[str, tuple[str, ...]], *, described: str):
    """``(cfg, tensors)`` as ``deepspec.read_sources`` reads them, for a checkpoint that may keep a
    copy of the target's embedding (and speculators' of its head and norm) and maps its head's
    rows to target ids as speculators, vLLM and the EAGLE authors do: ``d2t`` an offset per draft
    token (target id = draft index + ``d2t``), ``t2d`` a mask over target ids."""
    from dspark_jax.checkpoints.drafter import D2T

    # Vocabulary maps matter for a reduced vocabulary only; over all tokens, where saved, they are the identity.
    mapped = cfg.draft_vocab_size is not None and cfg.draft_vocab_size < cfg.vocab_size
    ignored = [*VERIFIER_TENSORS, "t2d", *([] if mapped else ["d2t"]),
               *([] if "draft_head.linear.weight" in sources else ["lm_head.weight"])]
    cfg, tensors = read_sources(directory, cfg, sources, ignored=ignored, described=described,
                                integers=("d2t",) if mapped else ())
    if cfg.draft_vocab_size is not None:
        offsets = tensors.pop("d2t") if mapped else 0
        tensors[D2T] = (np.arange(cfg.draft_vocab_size) + offsets).astype(np.int32)  # as saved here
    return cfg, tensors


def trained_for(directory, raw: dict) -> dict | None:
    """The record of an EAGLE-3 checkpoint's target (``checkpoints.drafter.identity``): a sketch of
    the copy of its embedding speculators keeps, without the depth, which it does not say. Its
    DSpark and DFlash drafters keep no such copy: None."""
    from dspark_jax.checkpoints.drafter import embedding_sketch, identity

    sketch = embedding_sketch(directory) if raw.get("speculators_model_type") == EAGLE3 else None
    return None if sketch is None else identity(None, sketch)
