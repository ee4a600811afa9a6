"""Drafter checkpoints: round trip for every kind, bf16 storage, and clear refusals."""

import json
import re

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from dspark_jax.checkpoints.drafter import (
    build_drafter,
    drafter_tensors,
    load_drafter,
    read_drafter_config,
    save_drafter,
)
from dspark_jax.config import DrafterConfig
from dspark_jax.models.target import TargetModel
from tests.tiny import cast_target, tiny_config, tiny_target

TARGET = tiny_config(num_layers=4)
IDS = np.arange(0, TARGET.vocab_size, 3)


def configs():
    common = dict(tap_layers=(0, 2), mask_token_id=5, block_size=3)
    return {
        "dspark": DrafterConfig.for_target(TARGET, num_layers=1, markov_rank=8, draft_vocab_size=IDS.size, **common),
        "dspark-draft-rows": DrafterConfig.for_target(TARGET, num_layers=1, markov_rank=8, draft_vocab_size=IDS.size,
                                                      markov_w1_rows="draft", **common),
        "dflash": DrafterConfig.dflash(TARGET, num_layers=2, **common),
        "eagle3": DrafterConfig.eagle3(TARGET, draft_vocab_size=IDS.size, **common),
    }


@pytest.mark.parametrize("kind", ["dspark", "dspark-draft-rows", "dflash", "eagle3"])
@pytest.mark.parametrize("storage", ["float32", "bfloat16"])
def test_round_trip(tmp_path, kind, storage):
    cfg = configs()[kind]
    ids = IDS if cfg.draft_vocab_size else None
    drafter = build_drafter(cfg, seed=3, draft_vocab_ids=ids)
    save_drafter(drafter, tmp_path, storage_dtype=storage, metadata={"steps": 7})
    loaded = load_drafter(tmp_path, target=TARGET)
    assert type(loaded) is type(drafter) and loaded.cfg == cfg
    assert read_drafter_config(tmp_path)[1] == {"steps": 7}
    before, after = drafter_tensors(drafter), drafter_tensors(loaded)
    assert before.keys() == after.keys()
    # The target's embedding / LM head ([V, d]) are frozen and passed in: never in a checkpoint.
    assert not any(v.shape == (TARGET.vocab_size, TARGET.hidden_size) for v in before.values())
    for name, value in before.items():
        if storage == "bfloat16" and value.dtype == np.float32:
            value = value.astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(after[name], value, err_msg=name)
    if cfg.markov_w1_rows == "draft":  # one d2t, shared by the reduced head and the Markov W1 rows
        assert loaded.markov.d2t is loaded.draft_head.d2t and "markov.d2t" not in before
        assert before["markov.w1"].shape == (IDS.size + 1, 8)


def test_refusals(tmp_path):
    cfg = configs()["dspark"]
    save_drafter(build_drafter(cfg, draft_vocab_ids=IDS), tmp_path)
    with pytest.raises(ValueError, match=f"{re.escape(str(tmp_path / 'config.json'))}: drafter does not fit the "
                                         "target: hidden_size: drafter 48, target 64"):
        load_drafter(tmp_path, target=tiny_config(num_layers=4, hidden_size=64, head_dim=16))
    with pytest.raises(ValueError, match="vocab_size: drafter 97, target 120"):
        load_drafter(tmp_path, target=tiny_config(num_layers=4, vocab_size=120))
    with pytest.raises(ValueError, match=r"tap layer ids \[2\] are outside the target's decoder layers 0..1"):
        load_drafter(tmp_path, target=tiny_config(num_layers=2))
    tensors = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    del tensors["markov.w1"]
    tensors["backbone.fc.weight"] = tensors["backbone.fc.weight"][:, :-1]
    safetensors.numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['markov.w1'\].*backbone.fc.weight"):
        load_drafter(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "version": 99}))
    with pytest.raises(ValueError, match="version 99"):
        load_drafter(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a drafter checkpoint"):
        load_drafter(tmp_path / "nothing")
    with pytest.raises(ValueError, match="storage_dtype"):
        save_drafter(build_drafter(cfg, draft_vocab_ids=IDS), tmp_path / "x", storage_dtype="int8")


@pytest.mark.parametrize(
    "file, damage, match",
    [
        ("model.safetensors", lambda data: data[: len(data) // 2], "is not a readable safetensors file"),
        ("model.safetensors", lambda data: b"", "is not a readable safetensors file"),
        ("config.json", lambda data: b"{oops", "is not valid JSON"),
        ("config.json", lambda data: b'{"format": "dspark-jax-drafter", "version": 1}', "has no 'drafter' section"),
        ("config.json", lambda data: b"[1, 2]", "is not a dspark-jax-drafter config: a JSON object expected"),
        ("config.json", lambda data: json.dumps({**json.loads(data), "drafter": {"kind": "dspark"}}).encode(),
         "holds no valid drafter config"),
    ],
    ids=["weights-truncated", "weights-empty", "config-not-json", "config-without-drafter", "config-not-an-object",
         "drafter-config-incomplete"],
)
def test_a_damaged_checkpoint_is_an_error_naming_the_file(tmp_path, file, damage, match):
    save_drafter(build_drafter(configs()["dflash"]), tmp_path)
    path = tmp_path / file
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=f"{re.escape(str(path))} {match}"):
        load_drafter(tmp_path)


def _edit_tensors(path, edit):
    """Rewrite ``path``'s tensors through ``edit``, keeping the file's metadata (its weights id)."""
    with safetensors.safe_open(str(path), "np") as f:
        metadata = f.metadata()
    tensors = safetensors.numpy.load_file(str(path))
    edit(tensors)
    safetensors.numpy.save_file(tensors, str(path), metadata=metadata)


def _set(name, value):
    return lambda tensors: tensors.__setitem__(name, value(tensors[name]))


@pytest.mark.parametrize(
    "edit, match",
    [
        (_set("markov.w1", lambda w: w.astype(np.int32)), r"markov.w1 is stored as int32, not a floating-point type"),
        (_set("draft_head.d2t", lambda d: d.astype(np.float32)), r"draft_head.d2t is stored as float32, not integers"),
        (_set("markov.w1", lambda w: np.where(np.arange(w.size).reshape(w.shape) == 3, np.nan, w)),
         r"non-finite values \(NaN or inf\) in \['markov.w1'\]"),
        (lambda t: t.pop("draft_head.d2t"), r"missing \['draft_head.d2t'\]"),
        (_set("draft_head.d2t", lambda d: d[:-1]), r"draft_head.d2t: file \(32,\), model \(33,\)"),
        (_set("draft_head.d2t", lambda d: np.concatenate([d[:-1], [1000]]).astype(np.int32)),
         r"draft_head.d2t .*draft_vocab_ids must be distinct target ids in \[0, 97\)"),
    ],
    ids=["float-as-int", "d2t-as-float", "nan-weight", "d2t-missing", "d2t-short", "d2t-out-of-vocab"],
)
def test_a_damaged_tensor_is_an_error_naming_the_file_and_tensor(tmp_path, edit, match):
    """Wrong dtypes and non-finite weights used to load silently (cast, or NaN drafts later); a bad
    d2t map used to fail inside the model's constructor without naming the checkpoint."""
    save_drafter(build_drafter(configs()["dspark"], draft_vocab_ids=IDS), tmp_path)
    weights = tmp_path / "model.safetensors"
    _edit_tensors(weights, edit)
    with pytest.raises(ValueError, match=f"{re.escape(str(weights))}.*{match}"):
        load_drafter(tmp_path)


def test_a_path_that_is_not_a_whole_checkpoint_directory_is_named(tmp_path):
    cfg = configs()["dflash"]
    a_file = tmp_path / "drafter.bin"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=f"{re.escape(str(a_file))} is a file, not a drafter checkpoint directory"):
        load_drafter(a_file)
    with pytest.raises(ValueError, match=f"{re.escape(str(a_file))} is a file, not a directory"):
        save_drafter(build_drafter(cfg), a_file)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_drafter(tmp_path / "nowhere")
    checkpoint = tmp_path / "ckpt"
    for name, missing in (("model.safetensors", "has no model.safetensors.*incomplete"),
                          ("config.json", "has model.safetensors but no config.json.*incomplete")):
        save_drafter(build_drafter(cfg), checkpoint)  # half a checkpoint: one file gone, then a directory there
        (checkpoint / name).unlink()
        with pytest.raises(ValueError, match=missing):
            load_drafter(checkpoint)
        (checkpoint / name).mkdir()
        with pytest.raises(ValueError, match=f"{re.escape(str(checkpoint / name))} is not a file"):
            load_drafter(checkpoint)
        (checkpoint / name).rmdir()


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda config: b"\xff\xfe{}", "is not valid JSON"),
        (lambda config: json.dumps({**config, "metadata": [1]}).encode(), "'metadata' must be a JSON object"),
    ],
    ids=["not-utf8", "metadata-not-object"],
)
def test_a_damaged_config_field_is_named(tmp_path, edit, match):
    save_drafter(build_drafter(configs()["dflash"]), tmp_path)
    path = tmp_path / "config.json"
    path.write_bytes(edit(json.loads(path.read_text())))
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}.*{match}"):
        load_drafter(tmp_path)


def _same_weights(a, b):
    before, after = drafter_tensors(a), drafter_tensors(b)
    return before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)


def test_a_save_that_fails_midway_leaves_the_earlier_drafter(tmp_path):
    """Metadata json cannot write used to fail after the new weights were in place: the directory
    then loaded the new weights under the old config without a word."""
    cfg = configs()["dspark"]
    first, second = (build_drafter(cfg, seed=s, draft_vocab_ids=IDS) for s in (1, 2))
    save_drafter(first, tmp_path, metadata={"run": 1})
    with pytest.raises(TypeError, match="metadata must be JSON-serialisable .*nothing was written"):
        save_drafter(second, tmp_path, metadata={"loss": object()})
    with pytest.raises(TypeError, match="metadata must be a dict"):
        save_drafter(second, tmp_path, metadata=[1])
    loaded = load_drafter(tmp_path)
    assert _same_weights(loaded, first) and read_drafter_config(tmp_path)[1] == {"run": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]  # nothing left over


def test_a_save_killed_between_its_two_files_is_refused_on_load(tmp_path, monkeypatch):
    """A kill after the weights are replaced but before config.json is: the two files come from
    different saves (with equal shapes, nothing else would notice)."""
    import dspark_jax.checkpoints.drafter as module

    cfg = configs()["dspark"]
    first, second = (build_drafter(cfg, seed=s, draft_vocab_ids=IDS) for s in (1, 2))
    save_drafter(first, tmp_path)
    real_replace = module.os.replace

    def killed_before_config(src, dst):
        if str(dst).endswith("config.json"):
            raise KeyboardInterrupt  # the process dies here
        real_replace(src, dst)

    monkeypatch.setattr(module.os, "replace", killed_before_config)
    with pytest.raises(KeyboardInterrupt):
        save_drafter(second, tmp_path)
    monkeypatch.setattr(module.os, "replace", real_replace)
    with pytest.raises(ValueError, match="come from different saves"):
        load_drafter(tmp_path)
    save_drafter(second, tmp_path)  # saving again repairs it
    assert _same_weights(load_drafter(tmp_path), second)


def test_two_saves_into_one_directory_write_their_own_partial_files(tmp_path, monkeypatch):
    """Another save into the directory (a second training run, say) runs whole between this one's
    writing and its renaming: each writes partial files of its own, so this one, renaming last,
    is the checkpoint, whole. With one shared partial name the other save wrote into this one's
    files and renamed them away under it."""
    import dspark_jax.checkpoints.drafter as module

    cfg = configs()["dspark"]
    first, second = (build_drafter(cfg, seed=s, draft_vocab_ids=IDS) for s in (1, 2))
    real_replace = module.os.replace

    def the_other_save_first(src, dst):
        monkeypatch.setattr(module.os, "replace", real_replace)
        save_drafter(second, tmp_path)
        real_replace(src, dst)

    monkeypatch.setattr(module.os, "replace", the_other_save_first)
    save_drafter(first, tmp_path)
    assert _same_weights(load_drafter(tmp_path), first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_weights_from_another_save_are_refused(tmp_path):
    """Two checkpoints of one architecture, config.json of one beside the weights of the other."""
    cfg = configs()["dflash"]
    a = save_drafter(build_drafter(cfg, seed=1), tmp_path / "a")
    b = save_drafter(build_drafter(cfg, seed=2), tmp_path / "b")
    (a / "model.safetensors").write_bytes((b / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=f"{re.escape(str(a))}: config.json and model.safetensors come from "
                                         "different saves"):
        load_drafter(a)
    # Files from before weights ids (the shipped drafters) carry none and still load.
    legacy = tmp_path / "legacy"
    save_drafter(build_drafter(cfg, seed=1), legacy)
    config = json.loads((legacy / "config.json").read_text())
    del config["weights_id"]
    (legacy / "config.json").write_text(json.dumps(config))
    tensors = safetensors.numpy.load_file(str(legacy / "model.safetensors"))
    safetensors.numpy.save_file(tensors, str(legacy / "model.safetensors"))
    load_drafter(legacy)


def test_a_resave_round_trips_and_keeps_the_calibration(tmp_path):
    from dspark_jax.config import SamplingConfig
    from dspark_jax.training.calibrate import read_calibrations, save_calibration

    cfg = configs()["dspark-draft-rows"]
    drafter = build_drafter(cfg, seed=4, draft_vocab_ids=IDS)
    save_drafter(drafter, tmp_path, storage_dtype="float32", metadata={"steps": 3})
    save_calibration(tmp_path, {"method": "sts", "temperatures": [1.5, 2.0, 0.5]}, SamplingConfig())
    calibrations = read_calibrations(tmp_path)
    loaded = load_drafter(tmp_path, target=TARGET)
    save_drafter(loaded, tmp_path, storage_dtype="float32", metadata={"steps": 3})
    again = load_drafter(tmp_path, target=TARGET)
    assert again.cfg == cfg and _same_weights(again, drafter)
    assert read_drafter_config(tmp_path)[1] == {"steps": 3}
    assert read_calibrations(tmp_path) == calibrations
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibration.json", "config.json", "model.safetensors"]


def test_storage_dtype_applies_to_a_drafter_held_in_bfloat16(tmp_path):
    """numpy does not count bfloat16 as floating: a bf16 drafter saved as float32 kept bf16 tensors."""
    import jax.numpy as jnp

    drafter = build_drafter(configs()["dspark"], draft_vocab_ids=IDS, dtype=jnp.bfloat16)
    save_drafter(drafter, tmp_path, storage_dtype="float32")
    stored = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    assert {str(v.dtype) for k, v in stored.items() if k != "draft_head.d2t"} == {"float32"}
    assert stored["draft_head.d2t"].dtype == np.int32
    assert _same_weights(load_drafter(tmp_path, dtype=jnp.bfloat16), drafter)


def test_the_shipped_drafters_load(embedded_target):
    """They predate weights ids (neither file has one) and must keep loading; they record the
    embedded target, and refuse another model of its shape (its embedding's rows shifted by one)."""
    from dspark_jax.drafters import SHIPPED, shipped_drafter_path

    target, _ = embedded_target
    module = target.module()
    module.embed[...] = np.roll(np.asarray(module.embed[...]), 1, axis=0)
    other = TargetModel.from_module(module)
    for name in SHIPPED:
        cfg, _ = read_drafter_config(shipped_drafter_path(name))
        assert load_drafter(shipped_drafter_path(name), target=target).cfg == cfg
        with pytest.raises(ValueError, match="trained for another target of this width and vocabulary"):
            load_drafter(shipped_drafter_path(name), target=other)


def _quantized_q4_0(target):
    """``target`` with its embedding through llama.cpp's 4-bit Q4_0 and back."""
    import gguf

    module = target.module()
    embedding = np.asarray(module.embed[...])
    kind = gguf.GGMLQuantizationType.Q4_0
    module.embed[...] = gguf.quants.dequantize(gguf.quants.quantize(embedding, kind), kind).reshape(embedding.shape)
    return TargetModel.from_module(module)


def test_a_drafter_refuses_a_target_it_was_not_trained_for(tmp_path):
    """Width and vocabulary alone let another model's drafter run (losslessly, accepting almost
    nothing). The depth and embedding sketch a drafter records refuse it; the same model quantized,
    cast, or given as its config alone still loads it."""
    import jax.numpy as jnp

    shape = dict(num_layers=4, hidden_size=64)  # Q4_0 quantizes rows in blocks of 32
    target = tiny_target(seed=0, **shape)
    drafter = build_drafter(DrafterConfig.dflash(target.cfg, num_layers=1, tap_layers=(0, 1), mask_token_id=5))
    save_drafter(drafter, tmp_path, target=target)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["target"]["num_layers"] == 4 and len(config["target"]["embedding_sketch"]) == 64 * 8
    for same in (target, cast_target(target, jnp.bfloat16), _quantized_q4_0(target), target.cfg):
        assert _same_weights(load_drafter(tmp_path, target=same), drafter)
    with pytest.raises(ValueError, match=f"{re.escape(str(tmp_path / 'config.json'))}: trained for another target "
                                         r"of this width and vocabulary: .*\(correlation -?0\.\d\d on 512 sampled"):
        load_drafter(tmp_path, target=tiny_target(seed=1, **shape))
    with pytest.raises(ValueError, match="trained for a target of 4 decoder layers, and this target has 3: .*"
                                         "delete the 'target' section of config.json to run it anyway"):
        load_drafter(tmp_path, target=tiny_config(num_layers=3, hidden_size=64))
    for damaged in ({"num_layers": 4}, {"num_layers": 4, "embedding_sketch": ["x"]}, [4]):
        (tmp_path / "config.json").write_text(json.dumps({**config, "target": damaged}))
        with pytest.raises(ValueError, match="its 'target' section .* is damaged"):
            load_drafter(tmp_path, target=target)
    del config["target"]  # what the refusals tell a user who wants to run it anyway
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert _same_weights(load_drafter(tmp_path, target=tiny_target(seed=1, **shape)), drafter)


def test_save_refuses_to_overwrite_another_programs_checkpoint(tmp_path):
    """A directory holding someone else's config.json (a Hugging Face model's, say) used to be
    overwritten, weights too; a damaged drafter config may still be saved over (the repair)."""
    hf = tmp_path / "SmolLM2"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (hf / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(ValueError, match=f"{re.escape(str(hf / 'config.json'))} is not a dspark-jax-drafter config"):
        save_drafter(build_drafter(configs()["dflash"]), hf)
    assert (hf / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors"]
    damaged = save_drafter(build_drafter(configs()["dflash"]), tmp_path / "damaged")
    (damaged / "config.json").write_text("{half")
    drafter = build_drafter(configs()["dflash"], seed=5)
    save_drafter(drafter, damaged)
    assert _same_weights(load_drafter(damaged), drafter)


@pytest.mark.parametrize("change, message", [
    (dict(block_size=3.0), "block_size must be an int, got 3.0"),
    (dict(mask_token_id=True), "mask_token_id must be an int"),
    (dict(draft_vocab_size="33"), "draft_vocab_size must be an int or None"),
    (dict(confidence_head="false"), "confidence_head must be true or false, got 'false'"),
    (dict(ce_weight=float("nan")), "ce_weight must be a finite number"),
    (dict(tap_layers=[2, 0]), r"tap layer ids must be strictly ascending, got \[2, 0\]"),
])
def test_a_drafter_config_refuses_values_of_the_wrong_kind(change, message):
    """As a hand-edited config.json gives them: a float γ passed the range checks and failed in the
    first draft; a string "false" switched the confidence head on."""
    good = configs()["dspark"].to_dict()
    with pytest.raises(ValueError, match=message):
        DrafterConfig.from_dict({**good, **change})
    assert DrafterConfig.from_dict(good) == configs()["dspark"]
