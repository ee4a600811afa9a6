"""Drafter checkpoints: ``config.json`` + ``model.safetensors`` in one directory.

A drafter checkpoint never holds the target's embedding or LM head: those are frozen, shared and
passed in at run time (spec §1.1), so a shipped drafter is a few MB and cannot drift from its
target's weights. Tensors are named by their NNX state path (``backbone.layers.0.attn.qkv.weight``)
and may be stored in bfloat16 to halve the file; they load back in the dtype asked for. The
reduced head's draft->target id map (``draft_head.d2t``) is stored as int32 with the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors.numpy
from flax import nnx

from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.drafter.eagle3 import Eagle3Drafter
from dspark_jax.drafter.model import Drafter

FORMAT = "dspark-jax-drafter"
VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
STORAGE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def build_drafter(cfg: DrafterConfig, *, seed: int = 0, dtype=jnp.float32, draft_vocab_ids=None):
    """A freshly initialised drafter of the kind the config names."""
    rngs = nnx.Rngs(seed)
    if cfg.kind == "eagle3":
        return Eagle3Drafter(cfg, rngs=rngs, dtype=dtype, draft_vocab_ids=draft_vocab_ids)
    return Drafter(cfg, rngs=rngs, dtype=dtype, draft_vocab_ids=draft_vocab_ids)


def _path_name(path) -> str:
    return ".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def drafter_tensors(drafter) -> dict[str, np.ndarray]:
    """Every variable of the drafter (parameters and the d2t map) by state path."""
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(drafter))[0]
    return {_path_name(path): np.asarray(leaf) for path, leaf in leaves}


def save_drafter(drafter, directory, *, storage_dtype: str = "float32", metadata: dict | None = None) -> Path:
    """Write ``drafter`` to ``directory`` (created); float tensors stored as ``storage_dtype``."""
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage_dtype must be one of {sorted(STORAGE_DTYPES)}, got {storage_dtype!r}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: value.astype(STORAGE_DTYPES[storage_dtype]) if np.issubdtype(value.dtype, np.floating) else value
        for name, value in drafter_tensors(drafter).items()
    }
    safetensors.numpy.save_file(tensors, str(out / WEIGHTS_FILE))
    config = {
        "format": FORMAT,
        "version": VERSION,
        "drafter": drafter.cfg.to_dict(),
        "storage_dtype": storage_dtype,
        "metadata": metadata or {},
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_drafter_config(directory) -> tuple[DrafterConfig, dict]:
    """The drafter config and the free-form metadata of a checkpoint directory."""
    path = Path(directory) / CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"{directory} is not a drafter checkpoint: no {CONFIG_FILE}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}): the checkpoint is damaged") from error
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a {FORMAT} config: a JSON object expected, got {raw!r}")
    if raw.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} config (format={raw.get('format')!r})")
    if raw.get("version") != VERSION:
        raise ValueError(f"{path} has format version {raw.get('version')}; this code reads version {VERSION}")
    if not isinstance(raw.get("drafter"), dict):
        raise ValueError(f"{path} has no 'drafter' section (the drafter's config): the checkpoint is damaged")
    try:
        cfg = DrafterConfig.from_dict(raw["drafter"])
    except (TypeError, ValueError) as error:  # a missing field is a TypeError from the dataclass
        raise ValueError(f"{path} holds no valid drafter config: {error}") from error
    return cfg, raw.get("metadata", {})


def load_drafter(directory, *, target: TargetConfig | None = None, dtype=jnp.float32):
    """Load a drafter; with ``target`` given, refuse one that does not fit it (naming why)."""
    cfg, _ = read_drafter_config(directory)
    if target is not None:
        cfg.check_target(target)
    weights = Path(directory) / WEIGHTS_FILE
    try:
        tensors = safetensors.numpy.load_file(str(weights))
    except safetensors.SafetensorError as error:
        raise ValueError(f"{weights} is not a readable safetensors file ({error}): the checkpoint is damaged or "
                         "incompletely written") from error
    ids = tensors.get("draft_head.d2t")
    abstract = nnx.eval_shape(lambda: build_drafter(cfg, dtype=dtype, draft_vocab_ids=ids))
    graphdef, abstract_state = nnx.split(abstract)
    expected = {
        _path_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]
    }
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = sorted(
        f"{name}: file {tuple(tensors[name].shape)}, model {tuple(leaf.shape)}"
        for name, leaf in expected.items()
        if name in tensors and tuple(tensors[name].shape) != tuple(leaf.shape)
    )
    if missing or unexpected or wrong:
        raise ValueError(
            f"drafter checkpoint {directory} does not match its config: missing {missing}, "
            f"unexpected {unexpected}, wrong shapes {wrong}"
        )

    def fill(path, leaf):
        value = tensors[_path_name(path)]
        return jnp.asarray(value, dtype=leaf.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, abstract_state))
