"""Drafters speculators trained (its ``DSparkDraftModel``, ``DFlashDraftModel`` and ``Eagle3DraftModel``
checkpoints) draft as it computes.

``tests/fixtures/tiny_speculators/<variant>/`` were saved by speculators' own model class and
``tests/goldens/tiny_speculators.npz`` holds what its training forward computed on them
(``scripts/make_speculators_goldens.py``, run with speculators 0.9.0, torch and transformers; CI
needs none of them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from dspark_jax.checkpoints.drafter import drafter_tensors, load_drafter, read_drafter_config
from dspark_jax.models.target import TargetModel
from tests.test_deepspec import SHAPE
from tests.tiny import assert_decodes_losslessly, tiny_target

FIXTURES = Path(__file__).parent / "fixtures" / "tiny_speculators"
ZLAB = Path(__file__).parent / "fixtures" / "tiny_zlab_dflash"  # z-lab's DFlash layout (the script's make_zlab)
GOLDEN = np.load(Path(__file__).parent / "goldens" / "tiny_speculators.npz")


def its_target(name: str = "gated", golden=GOLDEN, **overrides) -> TargetModel:
    """The tiny Qwen3 target the drafter was built for: the embedding (tied head) it was given."""
    module = tiny_target(seed=0, **{**SHAPE, **overrides}).module()
    module.embed[...] = jnp.asarray(golden[f"{name}/embedding"])
    return TargetModel.from_module(module)


# (markov_head, confidence_head, confidence_with_markov, draft_vocab_size, draft_from_anchor, kind)
EXPECTED = {"gated": ("gated", True, True, 61, True, "dspark"), "rnn": ("rnn", True, False, None, True, "dspark"),
            "vanilla": ("vanilla", False, False, None, True, "dspark"),
            "gated_after_anchor": ("gated", True, True, None, False, "dspark"),
            "dflash": ("none", False, False, 61, False, "dflash"),
            "sliding": ("gated", True, True, None, True, "dspark"),
            "dflash_sliding": ("none", False, False, 61, False, "dflash"),
            "mixed_sliding": ("vanilla", True, False, None, True, "dspark")}
# (sliding_window, block_causal, full_attention_layers): speculators' sliding-window layers (its
# trainer's default) see 8 context positions and, unless sliding_window_non_causal, only the slots
# before them; a full-attention layer among them sees everything.
WINDOWS = {"sliding": (8, True, ()), "dflash_sliding": (8, False, ()), "mixed_sliding": (8, True, (0,))}


@pytest.mark.parametrize("name", EXPECTED)
def test_a_speculators_checkpoint_drafts_what_speculators_computed(name):
    """Each anchored block's hidden states, Markov-corrected logits (over a reduced draft
    vocabulary for ``gated`` and ``dflash``) and confidence logits, against speculators' own
    forward on the same tapped features and tokens: its layer ids 1 and 3 are our taps 0 and 2.
    Where its block's slot 0 drafts nothing (``sample_from_anchor`` false), 4 slots draft 3 tokens,
    which are slots 1-3 of speculators' outputs. The sliding-window ones have anchors past their
    windows."""
    drafter = load_drafter(FIXTURES / name)
    cfg = drafter.cfg
    assert (cfg.markov_head, cfg.confidence_head, cfg.confidence_with_markov, cfg.draft_vocab_size,
            cfg.draft_from_anchor, cfg.kind) == EXPECTED[name]
    assert (cfg.sliding_window, cfg.block_causal, cfg.full_attention_layers) == WINDOWS.get(name, (None, False, ()))
    assert cfg.tap_layers == (0, 2) and cfg.block_slots == 4 and cfg.mask_token_id == 3
    drafts_as_computed(drafter, name)


def drafts_as_computed(drafter, name: str, golden=GOLDEN) -> None:
    """``drafter``'s outputs for the golden's anchored blocks are those speculators (or the program
    that wrote ``golden``) computed."""
    cfg = drafter.cfg
    if cfg.draft_vocab_size is not None:
        np.testing.assert_array_equal(drafter.d2t_N, golden[f"{name}/draft_ids"])
    embed = jnp.asarray(golden[f"{name}/embedding"])
    features, ids = golden[f"{name}/features"], golden[f"{name}/input_ids"]
    anchors = golden[f"{name}/anchors"]
    gamma = cfg.block_size
    drafting = slice(cfg.block_slots - gamma, None)  # the slots that draft, in speculators' outputs
    # One request per anchor: the context holds the features before it, as speculators' mask lets
    # an anchored block see the sequence before its anchor.
    batch = len(anchors)
    context = drafter.extend_context(embed, drafter.new_context(batch, len(ids) + gamma),
                                     jnp.broadcast_to(jnp.asarray(features), (batch, *features.shape)), None,
                                     jnp.asarray(anchors))
    hidden = drafter.backbone.forward_block(embed, context, jnp.asarray(ids[anchors]))
    np.testing.assert_allclose(hidden, golden[f"{name}/hidden"][:, drafting], atol=2e-5)
    blocks = jnp.asarray(np.stack([ids[p:p + gamma] for p in anchors]))  # draft k's previous token: p + k
    corrected, confidence = drafter.teacher_forced(hidden, embed, blocks)
    np.testing.assert_allclose(corrected, golden[f"{name}/corrected_logits"][:, drafting], atol=5e-5)
    if not cfg.confidence_head:
        assert confidence is None
    else:
        np.testing.assert_allclose(confidence, golden[f"{name}/confidence_logits"][:, drafting], atol=2e-5)


def test_a_zlab_dflash_checkpoint_drafts_what_speculators_computes_once_it_converted_it(tmp_path):
    """z-lab's DFlash layout (``DFlashDraftModel``, ``dflash_config``, taps numbered by decoder
    layer, slot 0 drafting nothing), read directly: it drafts what speculators' drafter computes
    after speculators' own converter read the same checkpoint, and decodes losslessly."""
    drafter = load_drafter(ZLAB, target=its_target("zlab"))
    cfg = drafter.cfg
    assert (cfg.kind, cfg.markov_head, cfg.confidence_head, cfg.draft_vocab_size) == ("dflash", "none", False, None)
    assert (cfg.tap_layers, cfg.block_size, cfg.block_slots, cfg.draft_from_anchor) == ((0, 2), 3, 4, False)
    drafts_as_computed(drafter, "zlab")
    assert_decodes_losslessly(its_target("zlab"), drafter)
    for nested, message in ((dict(projector_type="dspark"), r"projector_type 'dspark': a DFlashDraftModel is read as "
                                                             "projector_type 'dflash'"),
                            (dict(mask_token_id=None), "without mask_token_id: the checkpoint is damaged")):
        directory = shutil.copytree(ZLAB, tmp_path / f"copy{len(list(tmp_path.iterdir()))}")
        config = json.loads((directory / "config.json").read_text())
        config["dflash_config"] = {k: v for k, v in {**config["dflash_config"], **nested}.items() if v is not None}
        (directory / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            load_drafter(directory)


@pytest.mark.parametrize("name", ["gated", "rnn", "gated_after_anchor", "dflash", "sliding", "dflash_sliding",
                                  "mixed_sliding"])
def test_a_speculators_drafter_decodes_its_target_losslessly(name):
    """Greedy, the sliding-window ones running past their 8-position windows."""
    target = its_target(name)
    assert_decodes_losslessly(target, load_drafter(FIXTURES / name, target=target))


# (layers, γ, draft_vocab_size, qk_norm, sliding_window, full_attention_layers, eagle3_feature_norm,
#  norm_before_residual, norm_output)
EAGLE3 = {"eagle3": (1, 3, 61, True, None, (), "none", False, False),
          "eagle3_trained": (1, 3, 97, False, 8, (), "joint", True, True),
          "eagle3_fc_norm": (1, 3, 61, True, None, (), "per_layer", False, False),
          "eagle3_two_layers": (2, 3, 61, True, 8, (), "none", True, True),
          "eagle3_mixed": (2, 3, 61, True, 8, (1,), "none", False, False)}


@pytest.mark.parametrize("name", EAGLE3)
def test_a_speculators_eagle3_checkpoint_drafts_what_speculators_computed(name):
    """The logits of each training-time-test step against speculators' own training forward on
    the same features and tokens (features of position t with token t + 1, as its data pipeline
    aligns them), over its draft vocabulary (all 97 tokens, its own head, for ``eagle3_trained``).
    ``eagle3_trained``, ``eagle3_two_layers`` (a plain Qwen3 decoder layer after the first) and
    ``eagle3_mixed`` (its second layer a full-attention one) window 8 positions: step 0 is
    compared everywhere, so the window is checked where speculators and vLLM agree; a later step
    k only at t < 8 - k, because past there speculators' training forward windows by index where
    decoding (vLLM's, and ours, in training too) windows by position (``checkpoints.speculators``)."""
    drafter = load_drafter(FIXTURES / name, target=its_target(name))
    cfg = drafter.cfg
    assert (cfg.kind, cfg.tap_layers, cfg.markov_head, cfg.confidence_head) == ("eagle3", (0, 2), "none", False)
    assert (cfg.backbone.num_layers, cfg.block_size, cfg.draft_vocab_size, cfg.backbone.qk_norm, cfg.sliding_window,
            cfg.full_attention_layers, cfg.eagle3_feature_norm, cfg.eagle3_norm_before_residual,
            cfg.eagle3_norm_output) == EAGLE3[name]
    np.testing.assert_array_equal(drafter.d2t_N, GOLDEN[f"{name}/draft_ids"])
    ids = GOLDEN[f"{name}/input_ids"]
    logits = eagle3_step_logits(drafter, GOLDEN[f"{name}/embedding"], GOLDEN[f"{name}/features"], ids)
    want = GOLDEN[f"{name}/logits"]
    assert logits.shape == want.shape == (3, len(ids) - 1, cfg.draft_vocab_size)
    for k in range(cfg.block_size):
        agree = slice(None) if k == 0 or cfg.sliding_window is None else slice(cfg.sliding_window - k)
        np.testing.assert_allclose(logits[k, agree], want[k, agree], atol=5e-5, err_msg=f"step {k}")


def eagle3_step_logits(drafter, embedding, features, ids) -> np.ndarray:
    """An EAGLE-3 drafter's logits at each training-time-test step, ``[γ, len(ids) - 1, V]``, on
    tapped features and tokens aligned as speculators' data pipeline aligns them."""
    embed = jnp.asarray(embedding)
    graphdef, params = nnx.split(drafter)

    @jax.jit  # eagerly, every op of the steps would compile on its own
    def ttt_logits(params):
        model = nnx.merge(graphdef, params)
        return model.logits(model.forward_train(embed, jnp.asarray(features)[None], jnp.asarray(ids)[None]), embed)

    return np.asarray(ttt_logits(params))[:, 0, : len(ids) - 1]


@pytest.mark.parametrize("name", EAGLE3)
def test_a_speculators_eagle3_drafter_decodes_its_target_losslessly(name):
    """Greedy, running past the 8-position windows."""
    target = its_target(name)
    assert_decodes_losslessly(target, load_drafter(FIXTURES / name, target=target))


def test_an_eagle3_config_without_layer_ids_taps_what_vllm_taps_of_its_target(tmp_path):
    """What ``speculators convert`` writes for the EAGLE authors' checkpoints: no layer ids, so
    vLLM and speculators take hidden states 2, n // 2 and n - 3 of an n-layer target, our taps
    1, 3 and 4 of an 8-layer one. Without a target it cannot load, and says why."""
    rng = np.random.default_rng(0)
    directory = damaged(tmp_path, "eagle3", dict(eagle_aux_hidden_state_layer_ids=None),
                        add={"fc.weight": (0.1 * rng.standard_normal((64, 3 * 64))).astype(np.float32)})
    target = its_target("eagle3", num_layers=8)
    drafter = load_drafter(directory, target=target)
    assert drafter.cfg.tap_layers == (1, 3, 4)
    assert read_drafter_config(directory, target)[0] == drafter.cfg
    assert_decodes_losslessly(target, drafter)
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids is not set, so the tapped layers depend on "
                                         r"the target's depth n \(vLLM takes its hidden states 2, n // 2 and n - 3\): "
                                         "load it with its target"):
        load_drafter(directory)


def test_a_speculators_eagle3_checkpoint_is_refused_by_name_where_it_cannot_load(tmp_path):
    refusals = [
        (dict(eagle_aux_hidden_state_layer_ids=[0, 3]), r"eagle_aux_hidden_state_layer_ids has 0 \(the target's "
                                                        r"embedding output\)"),
        (dict(embed_requires_grad=True), "embed_requires_grad is true: the drafter trained its own token embedding"),
        (dict(fc_norm=True), "norm_before_fc and fc_norm are both true"),
        (dict(norm_output="yes"), "norm_output is 'yes', not true or false"),
        (dict(layers=dict(num_hidden_layers=2)), "1 layer_types for 2 layers: the checkpoint is damaged"),
        (dict(layers=dict(sliding_window=None)), "sliding_window.*the checkpoint is damaged"),
        (dict(speculators_config=dict(default_proposal_method="tree")), "no 'tree' proposal method with "
                                                                         "speculative_tokens: the checkpoint is damaged"),
        (dict(draft_vocab_size=None), "a speculators eagle3 config without draft_vocab_size: the checkpoint is damaged"),
        (dict(layers=dict(attention_bias=True)), "transformer_layer_config: .*attention_bias=true"),
    ]
    for edit, message in refusals:
        with pytest.raises(ValueError, match=message):
            load_drafter(damaged(tmp_path, "eagle3_trained", edit), target=its_target("eagle3_trained"))
    for name, dropped in (("eagle3_trained", "input_norm.weight"), ("eagle3_trained", "lm_head.weight"),
                          ("eagle3_two_layers", "layers.1.self_attn.k_norm.weight")):
        with pytest.raises(ValueError, match=rf"missing \['{dropped}'\]"):
            load_drafter(damaged(tmp_path, name, drop=dropped), target=its_target(name))
    # Its copy of the target's embedding identifies its target: another one of the same shape is refused.
    with pytest.raises(ValueError, match="trained for another target of this width and vocabulary"):
        load_drafter(FIXTURES / "eagle3_trained", target=tiny_target(**SHAPE))
    # Full attention when the layer's type says so, whatever its window field holds.
    full = load_drafter(damaged(tmp_path, "eagle3_trained", dict(layers=dict(layer_types=["full_attention"]))))
    assert full.cfg.sliding_window is None


def damaged(tmp_path, name: str, edit_config=None, drop=None, add=None) -> Path:
    """A copy of fixture ``name`` with config entries changed (``None`` deletes one; ``layers``
    and ``speculators_config`` update those nested objects) and tensors dropped or added."""
    directory = shutil.copytree(FIXTURES / name, tmp_path / f"copy{len(list(tmp_path.iterdir()))}")
    config = json.loads((directory / "config.json").read_text())
    for key, value in (edit_config or {}).items():
        if key in ("layers", "speculators_config"):
            nested = config["transformer_layer_config" if key == "layers" else key]
            nested |= value
        elif value is None:
            del config[key]
        else:
            config[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    if drop or add:
        tensors = load_file(str(directory / "model.safetensors"))
        tensors.pop(drop, None)
        tensors |= add or {}
        save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_a_speculators_checkpoint_is_refused_by_name_where_it_cannot_load(tmp_path):
    def damaged_dspark(edit_config=None, drop=None, add=None) -> Path:
        return damaged(tmp_path, "gated", edit_config, drop, add)

    refusals = [
        (dict(speculators_model_type="mtp"), "a speculators mtp drafter; this reads speculators' DSpark, DFlash and "
                                             "EAGLE-3 drafters"),
        (dict(sample_from_anchor="no"), "sample_from_anchor is 'no', not true or false"),
        (dict(sample_from_anchor=False, block_size=1), "block_size 1 with sample_from_anchor false drafts nothing"),
        (dict(markov_rank=None), "a speculators dspark config without markov_rank: the checkpoint is damaged"),
        (dict(aux_hidden_state_layer_ids=[0, 3]), r"aux_hidden_state_layer_ids has 0 \(the target's embedding output\)"),
        (dict(aux_hidden_state_layer_ids=[1, 4]), "tap layer 3 is the target's final layer"),
        (dict(layers=dict(layer_types=["sliding_attention", "chunked_attention"], sliding_window=8)),
         r"layer_types .*: a draft layer's attention is full_attention or sliding_attention"),
        (dict(layers=dict(layer_types=["sliding_attention"], sliding_window=8)), "1 layer_types for 2 layers: the "
                                                                                   "checkpoint is damaged"),
        (dict(layers=dict(layer_types=["sliding_attention"] * 2)), "sliding_window.*the checkpoint is damaged"),
        (dict(sliding_window_non_causal="yes"), "sliding_window_non_causal is 'yes', not true or false"),
        (dict(layers=dict(attention_bias=True)), "transformer_layer_config: .*attention_bias=true"),
        (dict(target_hidden_size=128), "target_hidden_size 128 differs from the draft layers' 64"),
        (dict(mask_token_id=None), "config without mask_token_id: the checkpoint is damaged"),
        (dict(block_size="four"), "block_size.*the checkpoint is damaged"),
    ]
    for edit, message in refusals:
        with pytest.raises(ValueError, match=message):
            load_drafter(damaged_dspark(edit), target=its_target())
    tensors = [
        (dict(drop="d2t"), r"missing \['d2t'\]"),
        (dict(drop="lm_head.weight"), r"missing \['lm_head.weight'\]"),
        (dict(drop="markov_head.gate_proj.bias"), r"missing \['markov_head.gate_proj.bias'\]"),
        (dict(add={"extra.weight": np.zeros(3, np.float32)}), r"unexpected \['extra.weight'\]"),
        (dict(add={"d2t": -np.arange(61)}), "draft_vocab_ids must be distinct"),  # every draft token: id 0
    ]
    for change, message in tensors:
        with pytest.raises(ValueError, match=message):
            load_drafter(damaged_dspark(**change), target=its_target())
    with pytest.raises(ValueError, match="hidden_size: drafter 64, target 32"):
        load_drafter(FIXTURES / "gated", target=tiny_target(**{**SHAPE, "hidden_size": 32, "head_dim": 8}))
    # An export from before speculators had sample_from_anchor used DFlash's layout.
    older = load_drafter(damaged_dspark(dict(sample_from_anchor=None)), target=its_target())
    assert (older.cfg.draft_from_anchor, older.cfg.block_size, older.cfg.block_slots) == (False, 3, 4)
    # The verifier's own weights, which speculators may leave in a checkpoint, are not the drafter's.
    verifier = damaged_dspark(add={"verifier_norm.weight": np.ones(64, np.float32)})
    assert load_drafter(verifier, target=its_target()).cfg.draft_vocab_size == 61


def test_convert_writes_a_speculators_drafter_as_a_dspark_jax_one(tmp_path, capsys):
    """The same tensors (the reduced head's ids too), bit for bit; its speculators config comes
    along; no record of its target (speculators saves none)."""
    from dspark_jax import cli

    out = tmp_path / "converted"
    assert cli.main(["convert", "--drafter", str(FIXTURES / "gated"), "--out", str(out)]) == 0
    assert f"--drafter {out}" in capsys.readouterr().out
    converted = drafter_tensors(load_drafter(out, target=its_target()))
    original = drafter_tensors(load_drafter(FIXTURES / "gated"))
    assert converted.keys() == original.keys() and "draft_head.d2t" in converted
    for name, value in original.items():
        np.testing.assert_array_equal(converted[name], value, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["metadata"]["speculators_config"]["speculators_model_type"] == "dspark"
    assert "target" not in config
    assert read_drafter_config(FIXTURES / "gated")[1]["speculators"]["draft_vocab_size"] == 61
    with pytest.raises(SystemExit, match=r"--drafter .*: .*holds no drafter DeepSpec, z-lab, speculators, SpecForge "
                                         "or the EAGLE authors saved"):
        cli.main(["convert", "--drafter", str(out), "--out", str(tmp_path / "again")])
    assert not (tmp_path / "again").exists()
    # An EAGLE-3 one keeps its options, its own full-vocabulary head and its second layer.
    for name in ("eagle3_trained", "eagle3_two_layers"):
        eagle3 = tmp_path / name
        assert cli.main(["convert", "--drafter", str(FIXTURES / name), "--out", str(eagle3)]) == 0
        converted, original = load_drafter(eagle3), load_drafter(FIXTURES / name)
        assert converted.cfg == original.cfg and converted.cfg.sliding_window == 8
        assert json.loads((eagle3 / "config.json").read_text())["target"]["num_layers"] is None  # not said
        load_drafter(eagle3, target=its_target(name))
        with pytest.raises(ValueError, match="trained for another target of this width and vocabulary"):
            load_drafter(eagle3, target=tiny_target(**SHAPE))
        converted_tensors, original_tensors = drafter_tensors(converted), drafter_tensors(original)
        assert converted_tensors.keys() == original_tensors.keys()
        for key, value in original_tensors.items():
            np.testing.assert_array_equal(converted_tensors[key], value, err_msg=f"{name}: {key}")
