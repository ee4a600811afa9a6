"""EAGLE-3 drafters as their authors (``SafeAILab/EAGLE``) save them and SpecForge exports them,
which vLLM and SGLang serve as they are, read as dspark-jax EAGLE-3 drafters.

``config.json`` is a Llama config of the one draft layer (``architectures``
``LlamaForCausalLMEagle3``, or the authors' ``LlamaForCausalLM`` with a ``draft_vocab_size``); the
safetensors hold that layer under ``midlayer.``, then ``fc``, ``norm``, ``lm_head`` over
``draft_vocab_size`` tokens with ``d2t`` (target id = draft index + ``d2t``) and the ``t2d`` mask,
and from SpecForge a copy of the target's embedding (``embed_tokens``), which identifies the target
as for drafters trained here. speculators converts such checkpoints into its own format
(``speculators convert``, read by ``checkpoints.speculators``); this reader needs no conversion,
and reads them as vLLM and SGLang do where the converter differs:

* Layer ids (``eagle_config.eagle_aux_hidden_state_layer_ids``, or the same key at the top level)
  come in two numberings. SpecForge counts decoder layers (id i is the output of layer i; its
  default 1, n // 2 - 1, n - 4 for an n-layer target); others, NVIDIA's among them, count
  transformers' hidden states (id i is the output of layer i - 1, 0 the embedding). SGLang tells
  them apart by the first id, 1 only in SpecForge's numbering, and so does this reader. vLLM reads
  every id in transformers' numbering, one layer before the one SpecForge trained on. Without ids:
  the target's hidden states 2, n // 2 and n - 3, as all of them take it.
* ``norm_before_residual``, ``norm_before_fc`` or ``fc_norm``, and ``norm_output`` (EAGLE 3.1: the
  normed output also fed back) as vLLM reads them. speculators' converter reads all but
  ``norm_before_residual`` (a command-line option there) from the config too, and it drops
  ``fc_norm``'s weights, so a converted EAGLE 3.1 drafter starts those norms afresh. SpecForge's
  trainer (August 2026) reads ``norm_output`` otherwise: whether the head normalises its input at
  all, true by default.
* γ is not in the format (vLLM and SGLang take it from their command lines): 7, the
  training-time-test length the EAGLE authors and SpecForge train with; ``--policy fixed:K``
  drafts fewer.

Refused by name: weights in ``pytorch_model.bin`` only (a torch pickle, which this reader does not
unpickle), other draft layers than one Llama layer, ``use_aux_hidden_state`` false, a bias on
``fc``, and a draft width other than the target's.
"""

from __future__ import annotations

from pathlib import Path

from dspark_jax.checkpoints import speculators
from dspark_jax.checkpoints.deepspec import (
    CONFIG_FILE,
    draft_layers,
    eagle3_tensor_sources,
    read_config_json,
)
from dspark_jax.config import as_int, as_ints

NAME = "eagle3"  # converted drafters keep its config.json as metadata "eagle3_config"
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # SpecForge's, and vLLM's name for it
AUTHORS_ARCHITECTURE = "LlamaForCausalLM"  # the EAGLE authors' configs, told from a model by draft_vocab_size
FIRST_LAYER = "midlayer."  # vLLM and speculators' converter read it as layers.0.
LAYER_IDS = "eagle_aux_hidden_state_layer_ids"
SPECFORGE_FIRST_ID = 1  # a first layer id of 1 is SpecForge's numbering (SGLang's test)
GAMMA = 7
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def claims(directory) -> bool:
    """Whether ``directory`` holds an EAGLE-3 drafter of this layout (``read_config`` reads the
    Llama ones and refuses the others, e.g. SGLang's for DeepSeek targets, by name)."""
    raw = read_config_json(directory)
    if raw is None or "speculators_model_type" in raw:  # speculators' (checkpoints.speculators)
        return False
    architectures = raw.get("architectures")
    if not isinstance(architectures, list):
        return False
    # DeepSpec's EAGLE-3 baselines are "...Eagle3Model" (checkpoints.deepspec).
    return (any("Eagle3" in str(a) and not str(a).endswith("Eagle3Model") for a in architectures)
            or (architectures == [AUTHORS_ARCHITECTURE] and "draft_vocab_size" in raw))


def read_config(directory, target_depth: int | None = None):
    """``(DrafterConfig, config.json)`` of the checkpoint; ``target_depth`` (the target's decoder
    layers) settles the taps where the config names none."""
    directory = Path(directory)
    path = directory / CONFIG_FILE
    raw = read_config_json(directory)

    def refuse(reason: str):
        return ValueError(f"{path}: {reason}")

    if not (set(raw["architectures"]) & {*ARCHITECTURES, AUTHORS_ARCHITECTURE}):
        raise refuse(f"an EAGLE-3 drafter of architecture {raw['architectures']}; this reads the EAGLE authors' and "
                     f"SpecForge's Llama ones ({ARCHITECTURES[0]})")
    pickles = [name for name in PICKLES if (directory / name).exists()]
    if pickles and not any(directory.glob("*.safetensors*")):
        raise refuse(f"its weights are in {pickles[0]}, a torch pickle, which dspark-jax does not unpickle: save them "
                     "as model.safetensors first (safetensors.torch.save_file(torch.load(path), "
                     "'model.safetensors'), where torch is installed)")
    if raw.get("num_hidden_layers") != 1:
        raise refuse(f"num_hidden_layers {raw.get('num_hidden_layers')!r}: the EAGLE authors' and SpecForge's "
                     "drafters have one draft layer (midlayer), and this reads those")
    if raw.get("bias"):
        raise refuse("bias is true: fc has a bias, which dspark-jax's EAGLE-3 drafter does not")
    layers = speculators.target_wide(raw, *draft_layers(raw, refuse), refuse=refuse)
    try:
        draft_vocab = as_int(raw.get("draft_vocab_size") or raw["vocab_size"], "draft_vocab_size")
    except (TypeError, ValueError) as error:
        raise refuse(f"{error}: the checkpoint is damaged") from None
    cfg = speculators.eagle3_config(raw, layers, taps=_taps(raw, target_depth, refuse), gamma=GAMMA,
                                    draft_vocab=draft_vocab, refuse=refuse)
    return cfg, raw


def _taps(raw: dict, target_depth: int | None, refuse) -> tuple[int, ...]:
    """Our taps for the config's layer ids, in whichever numbering they are (the module's note)."""
    nested = raw.get("eagle_config") or {}
    if not isinstance(nested, dict):
        raise refuse(f"eagle_config is {nested!r}, not an object: the checkpoint is damaged")
    if nested.get("use_aux_hidden_state", True) is not True:
        raise refuse(f"eagle_config.use_aux_hidden_state is {nested['use_aux_hidden_state']!r}: an EAGLE-3 drafter "
                     "without the target's tapped features, which dspark-jax does not build")
    said = [ids for ids in (raw.get(LAYER_IDS), nested.get(LAYER_IDS)) if ids is not None]
    if len(said) == 2 and said[0] != said[1]:
        raise refuse(f"{LAYER_IDS} differ between the top level and eagle_config: the checkpoint is damaged")
    if not said:
        return tuple(i - 1 for i in speculators.default_eagle3_layer_ids(target_depth, refuse))
    try:
        layer_ids = as_ints(said[0], LAYER_IDS)
    except (TypeError, ValueError) as error:
        raise refuse(f"{error}: the checkpoint is damaged") from None
    if layer_ids and layer_ids[0] == SPECFORGE_FIRST_ID:
        return layer_ids
    return speculators.hidden_state_taps(layer_ids, LAYER_IDS, refuse)


def read_drafter(directory, cfg):
    """``(cfg, tensors)``: our drafter's tensors by state path (float32; the head's target ids as
    ``draft_head.d2t``), its layer read from ``midlayer.`` (or ``layers.0.``, as vLLM names it)."""
    from dspark_jax.checkpoints.hf import safetensors_files

    sources = eagle3_tensor_sources(cfg)
    if any(name.startswith(FIRST_LAYER) for name in safetensors_files(Path(directory))):
        sources = {ours: tuple(FIRST_LAYER + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name
                               for name in theirs) for ours, theirs in sources.items()}
    return speculators.read_mapped(directory, cfg, sources, described="EAGLE-3 drafter")


def trained_for(directory, raw: dict) -> dict | None:
    """The record of the checkpoint's target (``checkpoints.drafter.identity``): a sketch of the
    copy of its embedding SpecForge keeps, without the depth, which the config does not say; None
    where it keeps no copy."""
    from dspark_jax.checkpoints.drafter import embedding_sketch, identity

    sketch = embedding_sketch(directory)
    return None if sketch is None else identity(None, sketch)
