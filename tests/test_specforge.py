"""Drafters SpecForge exports (``DSparkDraftModel`` and ``DFlashDraftModel`` with their fields in
``dflash_config``, read by ``checkpoints.deepspec``) draft what SpecForge's own training forward
computes.

``tests/fixtures/tiny_specforge/<variant>/`` were saved by SpecForge's own model classes and
``tests/goldens/tiny_specforge.npz`` holds what its training forward (``OnlineDSparkModel``,
``OnlineDFlashModel``) computed on them (``scripts/make_specforge_goldens.py``, run on SpecForge's
code of 2026-08-08 with torch and transformers; CI needs none of them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dspark_jax.checkpoints.drafter import load_drafter
from tests.test_speculators import drafts_as_computed, its_target
from tests.tiny import assert_decodes_losslessly

FIXTURES = Path(__file__).parent / "fixtures" / "tiny_specforge"
GOLDEN = np.load(Path(__file__).parent / "goldens" / "tiny_specforge.npz")
# (kind, markov_head, confidence_head, confidence_with_markov, draft_from_anchor, γ): SpecForge's
# DSpark trains slot k of a block on token k + 1 after its anchor (DeepSpec's convention) and its
# DFlash on token k (z-lab's: slot 0 drafts nothing).
EXPECTED = {"dspark_gated": ("dspark", "gated", True, True, True, 4),
            "dspark_rnn": ("dspark", "rnn", True, False, True, 4),
            "dspark_sliding": ("dspark", "vanilla", True, True, True, 4),
            "dflash_sliding": ("dflash", "none", False, False, False, 3)}
SLIDING = ("dspark_sliding", "dflash_sliding")  # a 6-position window before a full-attention layer


@pytest.mark.parametrize("name", EXPECTED)
def test_a_specforge_export_drafts_what_specforge_computed(name):
    """Each anchored block's hidden states, the logits SpecForge's loss scores (Markov-corrected
    for DSpark) and the confidence logits, against its own training forward on the same tapped
    features and tokens. The ``SLIDING`` ones' first layer sees 6 positions up to each slot's own,
    causally within the block (SpecForge's training mask, z-lab's and vLLM's rule), their second
    all of them; every anchor has more context than that."""
    drafter = load_drafter(FIXTURES / name)
    cfg = drafter.cfg
    assert (cfg.kind, cfg.markov_head, cfg.confidence_head, cfg.confidence_with_markov, cfg.draft_from_anchor,
            cfg.block_size) == EXPECTED[name]
    assert cfg.tap_layers == (0, 2) and cfg.mask_token_id == 3 and cfg.block_slots == 4
    assert (cfg.sliding_window, cfg.window_per_slot, cfg.block_causal, cfg.full_attention_layers) == (
        (6, True, True, (1,)) if name in SLIDING else (None, False, False, ()))
    drafts_as_computed(drafter, name, GOLDEN)


def test_a_specforge_export_decodes_its_target_losslessly():
    """The DSpark export on the sliding-window layout, past its window: no other fixture puts a
    Markov head on windows counted from each slot (the others decode in ``tests/test_zlab.py``,
    ``tests/test_deepspec.py`` and ``tests/test_speculators.py``)."""
    target = its_target("dspark_sliding", GOLDEN)
    assert_decodes_losslessly(target, load_drafter(FIXTURES / "dspark_sliding", target=target))


def test_a_specforge_export_takes_specforge_defaults_for_the_fields_it_leaves_out(tmp_path):
    """A Markov rank without a head type is a vanilla head; without ``enable_confidence_head``,
    ``confidence_head_alpha`` above 0 means a confidence head (on the hidden state alone unless
    ``confidence_head_with_markov``); without either, none, and its saved head is then refused."""
    def without(name: str, *keys, **changed) -> Path:
        directory = shutil.copytree(FIXTURES / name, tmp_path / f"copy{len(list(tmp_path.iterdir()))}")
        config = json.loads((directory / "config.json").read_text())
        nested = {k: v for k, v in config["dflash_config"].items() if k not in keys}
        config["dflash_config"] = nested | changed
        (directory / "config.json").write_text(json.dumps(config))
        return directory

    rnn = load_drafter(without("dspark_rnn", "enable_confidence_head", "confidence_head_with_markov")).cfg
    assert rnn == load_drafter(FIXTURES / "dspark_rnn").cfg
    # A gated head's config without its type reads as a vanilla one, whose tensors lack the gate.
    with pytest.raises(ValueError, match=r"unexpected \['markov_head.gate_proj.bias', 'markov_head.gate_proj.weight'\]"):
        load_drafter(without("dspark_gated", "markov_head_type"))
    with pytest.raises(ValueError, match=r"unexpected \['confidence_head.proj.bias', 'confidence_head.proj.weight'\]"):
        load_drafter(without("dspark_rnn", "enable_confidence_head", "confidence_head_alpha"))
    with pytest.raises(ValueError, match="confidence_head_alpha is 'high', not a number: the checkpoint is damaged"):
        load_drafter(without("dspark_rnn", "enable_confidence_head", confidence_head_alpha="high"))


def test_a_specforge_export_whose_config_states_causality_is_refused_where_specforge_would_ignore_it(tmp_path):
    """SpecForge masks sliding-window layers causally within the block whatever ``is_causal``
    says, and a DSpark export's full-attention layers bidirectionally."""
    for name, causal, message in (("dspark_sliding", False, "is_causal False with sliding-window layers: SpecForge "
                                                            "masks a DSparkDraftModel's sliding-window layers causally"),
                                  ("dspark_sliding", True, "is_causal true: a DSparkDraftModel attends within a block "
                                                           "bidirectionally"),
                                  ("dspark_gated", True, "is_causal true: a DSparkDraftModel attends within a block "
                                                         "bidirectionally")):
        directory = shutil.copytree(FIXTURES / name, tmp_path / f"copy{len(list(tmp_path.iterdir()))}")
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "is_causal": causal}))
        with pytest.raises(ValueError, match=message):
            load_drafter(directory)
