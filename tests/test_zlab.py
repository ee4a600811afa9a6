"""z-lab DFlash drafters (``DFlashDraftModel`` checkpoints) draft as z-lab's own code computes,
with the causality and sliding windows its layers declare.

``tests/fixtures/tiny_zlab/<variant>/`` were saved from z-lab's ``DFlashDraftModel`` and
``tests/goldens/tiny_zlab.npz`` holds what its forward computed on them
(``scripts/make_zlab_goldens.py``, run with a z-lab/dflash checkout, torch and transformers; CI
needs none of them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.checkpoints.drafter import load_drafter
from dspark_jax.models.target import TargetModel
from tests.test_deepspec import SHAPE
from tests.tiny import assert_decodes_losslessly, tiny_target

FIXTURES = Path(__file__).parent / "fixtures" / "tiny_zlab"
GOLDEN = np.load(Path(__file__).parent / "goldens" / "tiny_zlab.npz")
# (sliding_window, window_per_slot, block_causal, full_attention_layers) of each variant
# (make_zlab_goldens.VARIANTS): z-lab runs a sliding-window layer causally, over the window up to
# each query's position, and a full-attention one bidirectionally, unless ``is_causal`` says.
ATTENTION = {"causal": (None, False, True, ()), "sliding": (6, True, True, ()),
             "sliding_bidirectional": (3, True, False, ()), "mixed": (6, True, True, (0,))}


def its_target(name: str) -> TargetModel:
    """The tiny Qwen3 target of the golden: its embedding (and tied head) is the one z-lab's
    drafter drafted with."""
    module = tiny_target(seed=0, **SHAPE).module()
    module.embed[...] = jnp.asarray(GOLDEN[f"{name}/embedding"])
    return TargetModel.from_module(module)


@pytest.mark.parametrize("name", ATTENTION)
def test_a_zlab_dflash_checkpoint_drafts_what_zlab_computes(name):
    """Each anchored block's hidden states and logits against z-lab's forward on the same tapped
    features and block: the anchor's slot drafts nothing, so 4 slots draft 3 tokens. The later
    anchors are past every window (6 positions, 3 in ``sliding_bidirectional``, whose window is
    shorter than the block, so its first and last slots do not see each other)."""
    drafter = load_drafter(FIXTURES / name, target=its_target(name))
    cfg = drafter.cfg
    assert (cfg.kind, cfg.tap_layers, cfg.block_size, cfg.block_slots, cfg.draft_from_anchor) == (
        "dflash", (0, 2), 3, 4, False)
    assert (cfg.sliding_window, cfg.window_per_slot, cfg.block_causal, cfg.full_attention_layers) == ATTENTION[name]
    hidden = drafted_hidden(drafter, name)
    np.testing.assert_allclose(hidden, GOLDEN[f"{name}/hidden"], atol=2e-5)
    embed = jnp.asarray(GOLDEN[f"{name}/embedding"])
    np.testing.assert_allclose(drafter.base_logits(hidden, embed), GOLDEN[f"{name}/logits"], atol=5e-5)


def drafted_hidden(drafter, name: str):
    """``drafter``'s hidden states for the golden's anchored blocks, one request per anchor whose
    context is the features before it (z-lab's draft cache)."""
    embed = jnp.asarray(GOLDEN[f"{name}/embedding"])
    features, ids, anchors = (GOLDEN[f"{name}/{key}"] for key in ("features", "input_ids", "anchors"))
    batch = len(anchors)
    context = drafter.extend_context(embed, drafter.new_context(batch, len(ids) + drafter.cfg.block_slots),
                                     jnp.broadcast_to(jnp.asarray(features), (batch, *features.shape)), None,
                                     jnp.asarray(anchors))
    return drafter.backbone.forward_block(embed, context, jnp.asarray(ids[anchors]))


def test_a_zlab_config_may_leave_to_zlabs_code_what_it_defaults(tmp_path):
    """z-lab's code reads each field from ``dflash_config``, else from the top level, takes 16
    block slots where ``block_size`` is not said, and never reads ``num_target_layers``. The
    causal checkpoint so written drafts 15 tokens a block, and its first three drafting slots
    are the golden's: in causal layers the slots after them change nothing."""
    directory = shutil.copytree(FIXTURES / "causal", tmp_path / "bare")
    config = json.loads((directory / "config.json").read_text())
    config |= config.pop("dflash_config")
    del config["block_size"], config["num_target_layers"]
    (directory / "config.json").write_text(json.dumps(config))
    drafter = load_drafter(directory, target=its_target("causal"))
    cfg = drafter.cfg
    assert (cfg.block_slots, cfg.block_size, cfg.tap_layers, cfg.mask_token_id, cfg.block_causal) == (
        16, 15, (0, 2), 3, True)
    np.testing.assert_allclose(drafted_hidden(drafter, "causal")[:, :3], GOLDEN["causal/hidden"], atol=2e-5)


@pytest.mark.parametrize("name", ATTENTION)
def test_a_zlab_dflash_drafter_decodes_its_target_losslessly(name):
    """Greedy, running past the windows."""
    target = its_target(name)
    assert_decodes_losslessly(target, load_drafter(FIXTURES / name, target=target))


def test_a_zlab_dflash_checkpoint_is_refused_by_name_where_it_cannot_load(tmp_path):
    """What z-lab's code would run differently from any dspark-jax drafter, or what is damaged."""

    def edited(name: str, **changes) -> Path:
        directory = shutil.copytree(FIXTURES / name, tmp_path / f"copy{len(list(tmp_path.iterdir()))}")
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, **changes}))
        return directory

    refusals = [
        (edited("mixed", is_causal=True), r"is_causal true with full-attention layers \[0\] among sliding-window "
                                          "ones"),
        (edited("sliding", is_causal="yes"), "is_causal is 'yes', not true or false: the checkpoint is damaged"),
        (edited("causal", input_embedding_scale=8.0), "input_embedding_scale 8.0: z-lab's code scales the drafter's "
                                                      "input embeddings or logits"),
        (edited("causal", output_multiplier=0.5, final_logit_softcapping=30.0),
         "output_multiplier 0.5, final_logit_softcapping 30.0: z-lab's code scales"),
        (edited("causal", dflash_config=[0, 2]), r"dflash_config is \[0, 2\], not an object: the checkpoint is damaged"),
        (edited("sliding", sliding_window=None), "a sliding-window layer's sliding_window must be an int, got None: "
                                                 "the checkpoint is damaged"),
        (edited("sliding", layer_types=["sliding_attention", "chunked_attention"]),
         r"layer_types \['sliding_attention', 'chunked_attention'\]: a draft layer's attention is full_attention "
         "or sliding_attention"),
    ]
    for directory, message in refusals:
        with pytest.raises(ValueError, match=message):
            load_drafter(directory)
    # The values at which those fields change nothing load, and vLLM's older dflash_config key
    # ``causal`` states the causality of every layer where ``is_causal`` does not.
    neutral = edited("causal", input_embedding_scale=1.0, output_multiplier=1, final_logit_softcapping=None)
    assert load_drafter(neutral).cfg == load_drafter(FIXTURES / "causal").cfg
    config = json.loads((FIXTURES / "sliding" / "config.json").read_text())
    stated = edited("sliding", dflash_config={**config["dflash_config"], "causal": False})
    assert load_drafter(stated).cfg.block_causal is False


def test_convert_keeps_a_zlab_drafters_attention(tmp_path):
    """``dspark convert`` writes the mixed drafter as a dspark-jax one with the same attention
    fields and tensors, bit for bit."""
    from dspark_jax import cli
    from dspark_jax.checkpoints.drafter import drafter_tensors

    out = tmp_path / "converted"
    assert cli.main(["convert", "--drafter", str(FIXTURES / "mixed"), "--out", str(out)]) == 0
    converted, original = load_drafter(out, target=its_target("mixed")), load_drafter(FIXTURES / "mixed")
    assert converted.cfg == original.cfg and converted.cfg.window_per_slot
    converted_tensors, original_tensors = drafter_tensors(converted), drafter_tensors(original)
    assert converted_tensors.keys() == original_tensors.keys()
    for key, value in original_tensors.items():
        np.testing.assert_array_equal(converted_tensors[key], value, err_msg=key)
