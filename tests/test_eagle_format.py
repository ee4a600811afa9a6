"""EAGLE-3 drafters as the EAGLE authors save them and SpecForge exports them (``LlamaForCausalLMEagle3``,
``checkpoints.eagle``) draft what speculators computes once its own converter has converted them,
and what SpecForge's own model and training loop compute.

``tests/fixtures/tiny_eagle/<variant>/`` are tiny checkpoints in that layout, and
``tests/goldens/tiny_speculators.npz`` (``eagle/<variant>/...``) holds what speculators' training
forward computed on each after its ``Eagle3Converter`` converted it
(``scripts/make_speculators_goldens.py``, run with speculators 0.9.0);
``tests/goldens/tiny_specforge.npz`` what SpecForge computed on two of them
(``scripts/make_specforge_goldens.py``). CI needs none of it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dspark_jax import cli
from dspark_jax.checkpoints import eagle
from dspark_jax.checkpoints.drafter import drafter_tensors, load_drafter
from tests.test_deepspec import SHAPE
from tests.test_speculators import GOLDEN, eagle3_step_logits, its_target
from tests.tiny import assert_decodes_losslessly, tiny_target

FIXTURES = Path(__file__).parent / "fixtures" / "tiny_eagle"
SPECFORGE = np.load(Path(__file__).parent / "goldens" / "tiny_specforge.npz")  # make_specforge_goldens.py
TARGET_LAYERS = 8  # deep enough for the taps a config without layer ids leaves to the target
# (tap_layers, draft_vocab_size, eagle3_feature_norm, norm_before_residual, norm_output, records its target)
EXPECTED = {
    "specforge": ((1, 2, 3), 61, "none", False, False, True),  # eagle_config ids 1, 2, 3: SpecForge's numbering
    "authors": ((1, 3, 4), 97, "none", False, False, False),  # no ids: hidden states 2, 4, 5 of 8 layers
    "eagle31": ((1, 2, 3), 61, "per_layer", False, True, True),  # ids 2, 3, 4 in transformers' numbering
}


def target_of(name: str):
    return its_target(f"eagle/{name}", num_layers=TARGET_LAYERS)


@pytest.mark.parametrize("name", EXPECTED)
def test_an_eagle_checkpoint_drafts_what_speculators_computes_once_it_converted_it(name):
    """Each training-time-test step's logits over the draft vocabulary, on the features and tokens
    speculators' training forward had (features of position t with token t + 1), for the 3 steps
    it ran (in float64: its float32 run rounds by more than the tolerance on ``eagle31``); the
    drafter drafts 7 (the format does not say γ)."""
    drafter = load_drafter(FIXTURES / name, target=target_of(name))
    cfg = drafter.cfg
    taps, draft_vocab, feature_norm, before_residual, norm_output, records = EXPECTED[name]
    assert (eagle.trained_for(FIXTURES / name, {}) is not None) == records  # SpecForge's copy of the embedding
    assert (cfg.kind, cfg.block_size, cfg.backbone.num_layers, cfg.backbone.qk_norm, cfg.sliding_window) == (
        "eagle3", 7, 1, False, None)  # specforge's Qwen window fields are not a Llama layer's
    assert (cfg.tap_layers, cfg.draft_vocab_size, cfg.eagle3_feature_norm, cfg.eagle3_norm_before_residual,
            cfg.eagle3_norm_output) == (taps, draft_vocab, feature_norm, before_residual, norm_output)
    np.testing.assert_array_equal(drafter.d2t_N, GOLDEN[f"eagle/{name}/draft_ids"])
    ids = GOLDEN[f"eagle/{name}/input_ids"]
    want = GOLDEN[f"eagle/{name}/logits"]
    logits = eagle3_step_logits(drafter, GOLDEN[f"eagle/{name}/embedding"], GOLDEN[f"eagle/{name}/features"],
                                ids)[: len(want)]
    assert logits.shape == want.shape == (3, len(ids) - 1, draft_vocab)
    np.testing.assert_allclose(logits, want, atol=5e-5)


@pytest.mark.parametrize("name", ["specforge", "authors"])
def test_an_eagle_checkpoint_drafts_what_specforge_computes(name):
    """The same checkpoints through SpecForge's own ``LlamaForCausalLMEagle3`` and its
    training-time-test loop (``scripts/make_specforge_goldens.py``), on the same features and
    tokens: each step's logits over the draft vocabulary."""
    drafter = load_drafter(FIXTURES / name, target=target_of(name))
    ids = GOLDEN[f"eagle/{name}/input_ids"]
    want = SPECFORGE[f"eagle/{name}/logits"]
    logits = eagle3_step_logits(drafter, GOLDEN[f"eagle/{name}/embedding"], GOLDEN[f"eagle/{name}/features"],
                                ids)[: len(want)]
    assert logits.shape == want.shape == (3, len(ids) - 1, drafter.cfg.draft_vocab_size)
    np.testing.assert_allclose(logits, want, atol=5e-5)


def test_an_eagle_drafter_decodes_its_target_losslessly():
    """SpecForge's export (its reduced vocabulary mapped back to target ids); the others decode
    through the same paths as speculators' EAGLE-3 drafters (``tests/test_speculators.py``)."""
    target = target_of("specforge")
    assert_decodes_losslessly(target, load_drafter(FIXTURES / "specforge", target=target))


def edited(tmp_path, name: str, edit=None, drop=(), rename=None) -> Path:
    """A copy of fixture ``name`` with config entries changed (None deletes one) and tensors
    dropped or renamed (``rename(name) -> name``)."""
    directory = shutil.copytree(FIXTURES / name, tmp_path / f"copy{len(list(tmp_path.iterdir()))}")
    config = json.loads((directory / "config.json").read_text())
    for key, value in (edit or {}).items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    if drop or rename:
        tensors = load_file(str(directory / "model.safetensors"))
        tensors = {(rename or str)(key): value for key, value in tensors.items() if key not in drop}
        save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_layer_ids_are_read_in_the_numbering_their_first_id_tells(tmp_path):
    """A first id of 1 is SpecForge's numbering (decoder layers: ids are our taps), as SGLang tells
    it; any other is transformers' (hidden states: id - 1), at the top level or in eagle_config."""
    target = target_of("specforge")
    for edit, taps in ((dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}), (1, 3, 4)),
                       (dict(eagle_config=None, eagle_aux_hidden_state_layer_ids=[1, 3, 5]), (1, 3, 5)),
                       (dict(eagle_config=None, eagle_aux_hidden_state_layer_ids=[3, 5, 7]), (2, 4, 6)),
                       (dict(eagle_config=None), (1, 3, 4))):  # none: hidden states 2, n // 2, n - 3
        assert load_drafter(edited(tmp_path, "specforge", edit), target=target).cfg.tap_layers == taps


def test_an_eagle_checkpoint_loads_with_its_layer_named_as_vllm_names_it(tmp_path):
    """``layers.0.`` instead of ``midlayer.`` (vLLM's name for it): the same drafter."""
    target = target_of("specforge")
    renamed = edited(tmp_path, "specforge", rename=lambda key: key.replace("midlayer.", "layers.0."))
    original, loaded = load_drafter(FIXTURES / "specforge", target=target), load_drafter(renamed, target=target)
    assert loaded.cfg == original.cfg
    for key, value in drafter_tensors(original).items():
        np.testing.assert_array_equal(drafter_tensors(loaded)[key], value, err_msg=key)


def test_an_eagle_checkpoint_is_refused_by_name_where_it_cannot_load(tmp_path):
    target = target_of("specforge")
    refusals = [
        (dict(architectures=["Eagle3DeepseekV2ForCausalLM"]), r"an EAGLE-3 drafter of architecture "
                                                              r"\['Eagle3DeepseekV2ForCausalLM'\]; this reads"),
        (dict(num_hidden_layers=2), "num_hidden_layers 2: the EAGLE authors' and SpecForge's drafters have one"),
        (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": False}),
         "use_aux_hidden_state is False: an EAGLE-3 drafter without the target's tapped features"),
        (dict(eagle_aux_hidden_state_layer_ids=[2, 3, 4]), "eagle_aux_hidden_state_layer_ids differ between the top "
                                                           "level and eagle_config"),
        (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}),
         r"eagle_aux_hidden_state_layer_ids has 0 \(the target's embedding output\)"),
        (dict(bias=True), "bias is true: fc has a bias"),
        (dict(target_hidden_size=128), "target_hidden_size 128 differs from the draft layers' 64"),
        (dict(fc_norm=True, norm_before_fc=True), "norm_before_fc and fc_norm are both true"),
        (dict(attention_bias=True), "attention_bias=true"),
    ]
    for edit, message in refusals:
        with pytest.raises(ValueError, match=message):
            load_drafter(edited(tmp_path, "specforge", edit), target=target)
    with pytest.raises(ValueError, match=r"missing \['midlayer.hidden_norm.weight'\]"):
        load_drafter(edited(tmp_path, "specforge", drop=("midlayer.hidden_norm.weight",)), target=target)
    # The EAGLE authors publish torch pickles: named, with the way out.
    pickled = edited(tmp_path, "authors")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match="its weights are in pytorch_model.bin, a torch pickle, which dspark-jax does "
                                         "not unpickle: save them as model.safetensors first"):
        load_drafter(pickled, target=target_of("authors"))
    # SpecForge's copy of the target's embedding identifies its target; the authors' keep none.
    with pytest.raises(ValueError, match="trained for another target of this width and vocabulary"):
        load_drafter(FIXTURES / "specforge", target=tiny_target(**{**SHAPE, "num_layers": TARGET_LAYERS}))
    load_drafter(FIXTURES / "authors", target=tiny_target(**{**SHAPE, "num_layers": TARGET_LAYERS}))
    # Without ids, the taps are the target's to settle.
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids is not set, so the tapped layers depend on "
                                         "the target's depth"):
        load_drafter(FIXTURES / "authors")


def test_convert_writes_an_eagle_checkpoint_as_a_dspark_jax_drafter(tmp_path):
    """Bit for bit, with the record of its target where it keeps a copy of the embedding; the
    authors' one, whose taps are its target's to settle, is refused by name."""
    out = tmp_path / "converted"
    assert cli.main(["convert", "--drafter", str(FIXTURES / "specforge"), "--out", str(out)]) == 0
    target = target_of("specforge")
    converted, original = load_drafter(out, target=target), load_drafter(FIXTURES / "specforge", target=target)
    assert converted.cfg == original.cfg
    for key, value in drafter_tensors(original).items():
        np.testing.assert_array_equal(drafter_tensors(converted)[key], value, err_msg=key)
    config = json.loads((out / "config.json").read_text())
    assert config["target"]["num_layers"] is None and config["metadata"]["eagle3_config"]["draft_vocab_size"] == 61
    with pytest.raises(SystemExit, match="eagle_aux_hidden_state_layer_ids is not set"):
        cli.main(["convert", "--drafter", str(FIXTURES / "authors"), "--out", str(tmp_path / "authors")])


def test_norm_before_residual_is_read_from_the_config_as_vllm_reads_it(tmp_path):
    """speculators' converter takes it from its command line only; vLLM from the config."""
    target = target_of("eagle31")
    assert not load_drafter(FIXTURES / "eagle31", target=target).cfg.eagle3_norm_before_residual
    edited_one = edited(tmp_path, "eagle31", dict(norm_before_residual=True))
    assert load_drafter(edited_one, target=target).cfg.eagle3_norm_before_residual
