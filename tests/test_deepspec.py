"""Official DSpark drafters (DeepSpec's ``Qwen3DSparkModel`` checkpoints) load and draft as DeepSpec does.

``tests/fixtures/tiny_deepspec/<variant>/`` were saved by DeepSpec's own model class and
``tests/goldens/tiny_deepspec.npz`` holds what its evaluator drafted from them
(``scripts/make_deepspec_goldens.py``, run with a DeepSpec checkout, torch and transformers; CI
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
from safetensors.numpy import load_file, save_file

from dspark_jax.checkpoints.drafter import load_drafter, read_drafter_config
from dspark_jax.config import SamplingConfig
from dspark_jax.models.target import TargetModel
from dspark_jax.sampling import SamplingParams
from tests.tiny import assert_decodes_losslessly, tiny_target

FIXTURES = Path(__file__).parent / "fixtures" / "tiny_deepspec"
GOLDEN = np.load(Path(__file__).parent / "goldens" / "tiny_deepspec.npz")
# The tiny Qwen3 target the fixtures' drafters were configured for (make_deepspec_goldens.TARGET).
SHAPE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4, num_kv_heads=2,
             head_dim=16, rms_norm_eps=1e-6, qk_norm=True, architecture="qwen3")


def frozen(name: str) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The embedding and LM head saved in the checkpoint: copies of its target's."""
    tensors = load_file(str(FIXTURES / name / "model.safetensors"))
    return jnp.asarray(tensors["embed_tokens.weight"]), jnp.asarray(tensors["lm_head.weight"])


def its_target(name: str, seed: int = 0, **overrides) -> TargetModel:
    """A tiny Qwen3 target whose embedding is the one the checkpoint was saved with."""
    module = tiny_target(seed=seed, **{**SHAPE, **overrides}).module()
    module.embed[...] = frozen(name)[0]
    return TargetModel.from_module(module)


@pytest.mark.parametrize("name", ["gated", "rnn", "dflash"])
def test_a_deepspec_checkpoint_drafts_what_deepspec_drafted(name):
    """The block's hidden states, base and Markov-corrected logits, greedy tokens and confidence
    logits after the same context features, against DeepSpec's own evaluator functions."""
    drafter = load_drafter(FIXTURES / name)
    cfg = drafter.cfg
    assert (cfg.kind, cfg.markov_head, cfg.confidence_head) == {
        "gated": ("dspark", "gated", True), "rnn": ("dspark", "rnn", True), "dflash": ("dflash", "none", False)}[name]
    assert cfg.tap_layers == (0, 2) and cfg.block_size == 4 and cfg.mask_token_id == 3
    assert cfg.confidence_with_markov == (name == "gated")
    assert read_drafter_config(FIXTURES / name)[0] == cfg
    embed, head = frozen(name)
    rows, anchor = int(GOLDEN["context_rows"]), int(GOLDEN["anchor"])
    context = drafter.extend_context(embed, drafter.new_context(1, rows + cfg.block_size + 1),
                                     jnp.asarray(GOLDEN[f"{name}/features"])[None], None, jnp.array([rows]))
    hidden = drafter.backbone.forward_block(embed, context, jnp.array([anchor]))
    np.testing.assert_allclose(hidden[0], GOLDEN[f"{name}/hidden"], atol=2e-5)
    np.testing.assert_allclose(drafter.base_logits(hidden, head)[0], GOLDEN[f"{name}/base_logits"], atol=5e-5)
    tokens = GOLDEN[f"{name}/tokens"]
    corrected, confidence = drafter.teacher_forced(hidden, head, jnp.asarray([[anchor, *tokens[:-1]]]))
    np.testing.assert_allclose(corrected[0], GOLDEN[f"{name}/corrected_logits"], atol=5e-5)
    np.testing.assert_array_equal(np.argmax(corrected[0], axis=-1), tokens)
    if name == "dflash":
        assert confidence is None
    else:
        np.testing.assert_allclose(confidence[0], GOLDEN[f"{name}/confidence_logits"], atol=2e-5)


def test_deepspecs_eagle3_baseline_drafts_what_its_evaluator_drafted():
    """DeepSpec's EAGLE-3 baseline (``Qwen3Eagle3Model``, taps 0-4 of a 6-layer target, 3 TTT
    steps) as our EAGLE-3 drafter, with its own head over all tokens: after the prompt's context,
    and again after a round commits two more tokens, each proposal step's logits are those
    DeepSpec's evaluator drafted from the same features and tokens, and so are the greedy tokens."""
    target = its_target("eagle3", num_layers=6)
    drafter = load_drafter(FIXTURES / "eagle3", target=target)
    cfg = drafter.cfg
    assert (cfg.kind, cfg.tap_layers, cfg.block_size, cfg.backbone.num_layers, cfg.backbone.qk_norm,
            cfg.draft_vocab_size, cfg.eagle3_feature_norm) == ("eagle3", (0, 1, 2, 3, 4), 3, 1, True, 97, "none")
    embed = jnp.asarray(GOLDEN["eagle3/embedding"])
    ids = jnp.asarray(GOLDEN["eagle3/input_ids"])[None]
    prompt, committed = 9, 2  # make_deepspec_goldens.EAGLE3_PROMPT, EAGLE3_COMMITTED
    greedy = SamplingParams.from_configs([SamplingConfig(temperature=0.0)])
    keys = jax.random.split(jax.random.PRNGKey(0), cfg.block_size)[None]
    # Feature t pairs with token t + 1; the last token committed is the anchor.
    context = drafter.extend_context(embed, drafter.new_context(1, 32), jnp.asarray(GOLDEN["eagle3/prompt_features"])[None],
                                     ids[:, 1:prompt + 1], jnp.asarray([prompt]))
    first, _ = drafter.propose(embed, embed, context, ids[:, prompt], greedy, keys)
    verified = jnp.asarray(GOLDEN["eagle3/verified_features"])[None, :committed]
    context = drafter.extend_context(embed, context, verified, ids[:, prompt + 1:prompt + 1 + committed],
                                     jnp.asarray([committed]))
    second, _ = drafter.propose(embed, embed, context, ids[:, prompt + committed], greedy, keys)
    for block, want in zip((first, second), GOLDEN["eagle3/logits"]):
        np.testing.assert_allclose(block.corrected_logits_BxGxN[0], want, atol=5e-5)
        np.testing.assert_array_equal(block.tokens_BxG[0], want.argmax(-1))
    assert_decodes_losslessly(target, drafter)


def test_deepspecs_eagle3_baseline_is_refused_by_name_where_it_cannot_load_and_converts(tmp_path, capsys):
    """Another target, several layers (each of DeepSpec's takes the token embeddings), sliding
    windows and a damaged config are refused by name; ``dspark convert`` copies it bit for bit."""
    from dspark_jax import cli
    from dspark_jax.checkpoints.drafter import drafter_tensors

    with pytest.raises(ValueError, match="trained for another target of this width and vocabulary"):
        load_drafter(FIXTURES / "eagle3", target=tiny_target(seed=5, **{**SHAPE, "num_layers": 6}))
    config = json.loads((FIXTURES / "eagle3" / "config.json").read_text())
    for edit, message in (
            (dict(num_hidden_layers=2, layer_types=["full_attention"] * 2), "num_hidden_layers 2: each of "
                                                                            "DeepSpec's EAGLE-3 layers takes the token"),
            (dict(layer_types=["sliding_attention"]), "sliding-window draft layers are not supported in DeepSpec's "
                                                      "Qwen3Eagle3Model checkpoints"),
            (dict(ttt_length=None), "without ttt_length: the checkpoint is damaged"),
            (dict(architectures=["Gemma4Eagle3Model"]), r"a drafter of architecture \['Gemma4Eagle3Model'\]")):
        directory = shutil.copytree(FIXTURES / "eagle3", tmp_path / f"copy{len(list(tmp_path.iterdir()))}")
        (directory / "config.json").write_text(json.dumps({k: v for k, v in {**config, **edit}.items() if v is not None}))
        with pytest.raises(ValueError, match=message):
            load_drafter(directory)
    out = tmp_path / "converted"
    assert cli.main(["convert", "--drafter", str(FIXTURES / "eagle3"), "--out", str(out)]) == 0
    assert f"--drafter {out}" in capsys.readouterr().out
    converted, original = load_drafter(out, target=its_target("eagle3", num_layers=6)), load_drafter(FIXTURES / "eagle3")
    assert converted.cfg == original.cfg
    converted_tensors, original_tensors = drafter_tensors(converted), drafter_tensors(original)
    assert converted_tensors.keys() == original_tensors.keys()
    for key, value in original_tensors.items():
        np.testing.assert_array_equal(converted_tensors[key], value, err_msg=key)


def test_a_deepspec_drafter_decodes_its_target_losslessly():
    target = its_target("gated")
    assert_decodes_losslessly(target, load_drafter(FIXTURES / "gated", target=target))


def test_a_deepspec_drafter_refuses_another_target_and_names_what_is_wrong(tmp_path, monkeypatch):
    """Its saved embedding is the record of its target, checked before the drafter's weights are
    read (a 4B target's drafter is a gigabyte); the rest of the refusals name the field or tensor;
    a confidence head saved without a bias (checkpoints in the wild have none) loads."""
    with monkeypatch.context() as patch:
        patch.setattr("dspark_jax.checkpoints.deepspec.read_drafter",
                      lambda directory, cfg: pytest.fail("read the weights for a target it refuses"))
        with pytest.raises(ValueError, match=r"trained for another target of this width and vocabulary.*\(dspark train\)$"):
            load_drafter(FIXTURES / "gated", target=tiny_target(seed=5, **SHAPE))
        with pytest.raises(ValueError, match="trained for a target of 4 decoder layers, and this target has 5"):
            load_drafter(FIXTURES / "gated", target=its_target("gated", num_layers=5))

    def damaged(edit_config=None, drop=None) -> Path:
        directory = shutil.copytree(FIXTURES / "gated", tmp_path / f"copy{len(list(tmp_path.iterdir()))}")
        if edit_config:
            config = json.loads((directory / "config.json").read_text())
            (directory / "config.json").write_text(json.dumps({**config, **edit_config}))
        if drop:
            tensors = load_file(str(directory / "model.safetensors"))
            del tensors[drop]
            save_file(tensors, str(directory / "model.safetensors"))
        return directory

    refusals = [
        (dict(architectures=["Gemma4DSparkModel"]), None, r"\['Gemma4DSparkModel'\]; this reads DeepSpec's Qwen3DSparkModel"),
        (dict(architectures=["DSparkDraftModel"]), None, r"architecture \['DSparkDraftModel'\]"),
        (dict(target_layer_ids=[-1, 2]), None, "target_layer_ids has -1"),
        (dict(block_size="seven"), None, "block_size.*the checkpoint is damaged"),
        (dict(layer_types=["sliding_attention", "full_attention"]), None, "sliding-window draft layers are not "
                                                                         "supported in Qwen3DSparkModel checkpoints"),
        (dict(is_causal=True), None, "is_causal true: a Qwen3DSparkModel attends within a block bidirectionally"),
        (dict(output_multiplier=2), None, "output_multiplier 2: z-lab's code scales"),
        (dict(target_layer_ids=[0, 3]), None, "tap layer 3 is the target's final layer"),
        (None, "markov_head.gate_proj.bias", r"missing \['markov_head.gate_proj.bias'\]"),
        (dict(markov_head_type="vanilla"), None, r"unexpected \['markov_head.gate_proj.bias', "
                                                 r"'markov_head.gate_proj.weight'\]"),
    ]
    for edit, drop, message in refusals:
        with pytest.raises(ValueError, match=message):
            load_drafter(damaged(edit, drop), target=its_target("gated"))
    no_bias = load_drafter(damaged(drop="confidence_head.proj.bias"), target=its_target("gated"))
    assert not no_bias.cfg.confidence_bias and no_bias.confidence.proj.bias is None


def test_the_command_line_takes_a_deepspec_directory_as_its_drafter(capsys):
    from dspark_jax.cli import load_drafter_arg, parse_policy_arg, policy_text

    target = its_target("gated")
    name, drafter, policy, note = load_drafter_arg(str(FIXTURES / "gated"), target, parse_policy_arg("threshold:0.5"))
    assert (name, drafter.cfg.markov_head, policy_text(policy), note) == ("gated", "gated", "threshold:0.5", None)
    with pytest.raises(SystemExit, match="--drafter .*: .*trained for another target"):
        load_drafter_arg(str(FIXTURES / "gated"), tiny_target(seed=5, **SHAPE))


def test_convert_writes_a_deepspec_drafter_as_a_dspark_jax_one(tmp_path, capsys):
    """The same tensors, bit for bit, without the checkpoint's copies of the target's embedding and
    head; the record of its target and its DeepSpec config come along."""
    from dspark_jax import cli
    from dspark_jax.checkpoints.drafter import drafter_tensors

    out = tmp_path / "converted"
    assert cli.main(["convert", "--deepspec", str(FIXTURES / "gated"), "--out", str(out)]) == 0
    assert f"--drafter {out}" in capsys.readouterr().out
    converted = drafter_tensors(load_drafter(out, target=its_target("gated")))
    original = drafter_tensors(load_drafter(FIXTURES / "gated"))
    assert converted.keys() == original.keys()
    for name, value in original.items():
        np.testing.assert_array_equal(converted[name], value, err_msg=name)
    assert not any(v.shape == (SHAPE["vocab_size"], SHAPE["hidden_size"]) for v in load_file(
        str(out / "model.safetensors")).values())
    config = json.loads((out / "config.json").read_text())
    assert config["metadata"]["deepspec_config"]["architectures"] == ["Qwen3DSparkModel"]
    assert config["target"]["num_layers"] == 4
    with pytest.raises(ValueError, match="trained for another target.*delete the 'target' section"):
        load_drafter(out, target=tiny_target(seed=5, **SHAPE))
    gemma = shutil.copytree(FIXTURES / "gated", tmp_path / "gemma")
    (gemma / "config.json").write_text(json.dumps({**json.loads((gemma / "config.json").read_text()),
                                                   "architectures": ["Gemma4DSparkModel"]}))
    with pytest.raises(SystemExit, match=r"--drafter .*: .*\['Gemma4DSparkModel'\]"):
        cli.main(["convert", "--deepspec", str(gemma), "--out", str(tmp_path / "no")])
    assert not (tmp_path / "no").exists()


def test_a_dspark_draft_model_export_reads_its_fields_from_dflash_config(tmp_path):
    """SpecForge / ModelOpt exports: ``DSparkDraftModel`` with DeepSpec's DSpark fields in a
    ``dflash_config`` load as the ``Qwen3DSparkModel`` they lift to (vLLM's normalisation); one
    without the copies of the target's embedding and head loads too, with no record of its target."""
    from dspark_jax.checkpoints.drafter import drafter_tensors

    nested_keys = ("mask_token_id", "target_layer_ids", "markov_rank", "markov_head_type", "enable_confidence_head",
                   "confidence_head_with_markov")

    def exported(name, nested=None, drop_frozen=False) -> Path:
        directory = shutil.copytree(FIXTURES / "gated", tmp_path / name)
        config = json.loads((directory / "config.json").read_text())
        lifted = {key: config.pop(key) for key in nested_keys}
        config |= {"architectures": ["DSparkDraftModel"], "dflash_config": {"projector_type": "dspark", **lifted,
                                                                            **(nested or {})}}
        (directory / "config.json").write_text(json.dumps(config))
        if drop_frozen:
            tensors = load_file(str(directory / "model.safetensors"))
            save_file({k: v for k, v in tensors.items() if k not in ("embed_tokens.weight", "lm_head.weight")},
                      str(directory / "model.safetensors"))
        return directory

    original = load_drafter(FIXTURES / "gated", target=its_target("gated"))
    for directory in (exported("export"), exported("bare", drop_frozen=True)):
        drafter = load_drafter(directory, target=its_target("gated"))
        assert drafter.cfg == original.cfg
        for name, value in drafter_tensors(original).items():
            np.testing.assert_array_equal(drafter_tensors(drafter)[name], value, err_msg=name)
    with pytest.raises(ValueError, match="trained for another target"):  # the export with the embedding's copy
        load_drafter(tmp_path / "export", target=tiny_target(seed=5, **SHAPE))
    assert load_drafter(tmp_path / "bare", target=tiny_target(seed=5, **SHAPE)).cfg == original.cfg
    with pytest.raises(ValueError, match="dflash_config.projector_type 'dflash': a DSparkDraftModel is read as projector_type 'dspark'"):
        load_drafter(exported("dflash", nested={"projector_type": "dflash"}))
    clash = exported("clash")
    config = json.loads((clash / "config.json").read_text())
    (clash / "config.json").write_text(json.dumps({**config, "mask_token_id": 7}))
    with pytest.raises(ValueError, match="mask_token_id differ between the top level and dflash_config"):
        load_drafter(clash)
