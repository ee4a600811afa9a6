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
from tests.tiny import tiny_config

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
    with pytest.raises(ValueError, match="hidden_size"):
        load_drafter(tmp_path, target=tiny_config(num_layers=4, hidden_size=64, head_dim=16))
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
