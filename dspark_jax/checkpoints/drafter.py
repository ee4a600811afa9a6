"""Drafter checkpoints: ``config.json`` + ``model.safetensors`` in one directory.

A drafter checkpoint never holds the target's embedding or LM head: those are frozen, shared and
passed in at run time (spec §1.1), so a shipped drafter is a few MB and cannot drift from its
target's weights. Tensors are named by their NNX state path (``backbone.layers.0.kv.weight``)
and may be stored in bfloat16 to halve the file; they load back in the dtype asked for. The
reduced head's draft->target id map (``draft_head.d2t``) is stored as int32 with the weights.

Both files carry the weights' id, a digest of the stored tensors (``weights_id`` in
``config.json``, the same key in the safetensors header): each file is written under a temporary
name and renamed over the old one, so a save killed between the two renames leaves two whole
files from different saves, which ``load_drafter`` refuses by their ids. The same weights saved
again keep their id, so what was fitted on them (``calibration.json``, which records it) stays
theirs; other weights get another. Checkpoints written before weights ids have neither and load
as before.

A drafter trained by ``dspark train`` also records the target it was trained for (``target`` in
``config.json``): the target's depth and a sketch of its input embedding (``target_identity``).
Width and vocabulary alone let a drafter of another model run (losslessly, but it accepts almost
nothing), so ``load_drafter`` refuses a target of another depth or whose embedding does not
correlate with the recorded sketch. The sketch survives quantization and a cast to bfloat16;
another model of the same shape does not match it. Checkpoints without the section load as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors.numpy
from flax import nnx

from dspark_jax.checkpoints import deepspec, eagle, save_safetensors, speculators
from dspark_jax.config import DrafterConfig, partial_path
from dspark_jax.drafter.eagle3 import Eagle3Drafter
from dspark_jax.drafter.model import Drafter

FORMAT = "dspark-jax-drafter"
VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
STORAGE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
WEIGHTS_ID = "weights_id"  # the weights' digest, in config.json and in the safetensors header
D2T = "draft_head.d2t"
TARGET = "target"  # config.json: the target the drafter was trained for (target_identity)
SKETCH_ROWS, SKETCH_COLUMNS = 64, 8  # the embedding entries a sketch samples, evenly spaced
# Least correlation of a target's sketch with the recorded one: SmolLM2's embedding gives 0.986 at
# Q4_0, 1.000 at Q8_0 and in bfloat16; a random one of its shape 0.00, its rows shifted by one 0.23.
SAME_TARGET_CORRELATION = 0.5
# Readers of drafters other programs saved: DeepSpec's (the official DSpark drafters) and z-lab's,
# speculators', and the EAGLE authors' and SpecForge's EAGLE-3 ones.
# Each has NAME, claims(directory), read_config(directory, target_depth), read_drafter(directory,
# cfg) and trained_for(directory, raw); target_depth is the target's number of decoder layers
# where known (a format may leave the tapped layers to the target, as vLLM does).
OTHER_FORMATS = (deepspec, speculators, eagle)


def _depth(target) -> int | None:
    """The decoder layers of ``target`` (a model, its config, or None)."""
    return None if target is None else getattr(target, "cfg", target).num_layers


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


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)  # numpy's issubdtype says no for bfloat16


def _check_overwritable(path: Path) -> None:
    """Refuse to save over a ``config.json`` that is clearly another program's (a Hugging Face
    model directory given by mistake would lose its config and weights). An unreadable one is
    taken for a damaged drafter's, which saving again repairs."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):  # absent, unreadable or not JSON (UnicodeDecodeError is a ValueError)
        return
    if isinstance(raw, dict) and raw.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} config (format={raw.get('format')!r}): refusing to overwrite "
                         "another program's checkpoint; save the drafter into its own directory")


def sketch_of_rows(rows_of, vocab: int, width: int) -> np.ndarray:
    """Evenly spaced entries of a ``[vocab, width]`` embedding, as float32: a few hundred numbers
    that tell one model's embedding from another's and move little under quantization.
    ``rows_of(ids)`` returns those rows (``[len(ids), width]``), so only they are read."""
    rows = np.unique(np.linspace(0, vocab - 1, SKETCH_ROWS).round().astype(int))
    columns = np.unique(np.linspace(0, width - 1, SKETCH_COLUMNS).round().astype(int))
    return np.asarray(rows_of(rows), dtype=np.float32)[:, columns].ravel()


def _embedding_sketch(target) -> np.ndarray:
    embedding, _ = target.embedding_and_head(target.params)
    return sketch_of_rows(lambda rows: embedding[rows], *embedding.shape)  # only these rows leave the device


def identity(num_layers: int | None, sketch: np.ndarray) -> dict:
    """The ``target`` section of a drafter's ``config.json``: a target's depth (None where a
    checkpoint from elsewhere does not say it) and embedding sketch."""
    return {"num_layers": None if num_layers is None else int(num_layers),
            "embedding_sketch": [float(f"{x:.4g}") for x in sketch]}


def embedding_sketch(directory, name: str = "embed_tokens.weight") -> np.ndarray | None:
    """The sketch of the embedding a checkpoint from elsewhere saved as tensor ``name`` (only the
    sampled rows are read), or None where it saved none."""
    from dspark_jax.checkpoints.hf import open_safetensors, safetensors_files

    files = safetensors_files(Path(directory))
    if name not in files:
        return None
    with open_safetensors(files[name]) as f:
        embedding = f.get_slice(name)
        vocab, width = embedding.get_shape()
        return sketch_of_rows(lambda rows: np.concatenate([embedding[r:r + 1] for r in rows]), vocab, width)


def target_identity(target) -> dict:
    """What a drafter records of the ``target`` model it is trained for (a ``TargetModel`` or any
    model of ``decoding.target_protocol``): its depth and a sketch of its input embedding."""
    return identity(target.cfg.num_layers, _embedding_sketch(target))


def _check_trained_target(directory: Path, recorded, target, *, in_config: bool = True) -> None:
    """Refuse ``target`` (a model, or only its config) when it is not the model ``recorded``
    (``target_identity``, from ``config.json``; ``in_config=False``: from a DeepSpec checkpoint's
    own copy of the embedding, which cannot be deleted to run the drafter anyway) describes."""
    path = directory / CONFIG_FILE
    depth = recorded.get("num_layers") if isinstance(recorded, dict) else None
    valid = (isinstance(recorded, dict) and (depth is None or isinstance(depth, int))
             and isinstance(recorded.get("embedding_sketch"), list) and len(recorded["embedding_sketch"]) > 0
             and all(isinstance(x, (int, float)) for x in recorded["embedding_sketch"]))
    if not valid:
        raise ValueError(f"{path}: its '{TARGET}' section (the target it was trained for) is damaged: expected "
                         "num_layers and an embedding_sketch list of numbers")
    run_anyway = ("it would decode losslessly but accept few drafts: train a drafter for this target (dspark train)"
                  + (f", or delete the '{TARGET}' section of {CONFIG_FILE} to run it anyway" if in_config else ""))
    cfg = getattr(target, "cfg", target)
    if depth is not None and depth != cfg.num_layers:
        raise ValueError(f"{path}: trained for a target of {recorded['num_layers']} decoder layers, and this target "
                         f"has {cfg.num_layers}: its tapped layers mean other features here; {run_anyway}")
    if not hasattr(target, "embedding_and_head"):  # a config alone: nothing more to compare
        return
    mine = _embedding_sketch(target)
    theirs = np.asarray(recorded["embedding_sketch"], dtype=np.float32)
    if mine.shape != theirs.shape:
        raise ValueError(f"{path}: its '{TARGET}' section holds {theirs.size} embedding samples where a target of "
                         f"this shape gives {mine.size}: the section is damaged")
    spread = mine.std() * theirs.std()
    correlation = float(np.mean((mine - mine.mean()) * (theirs - theirs.mean())) / spread) if spread > 0 else 0.0
    if not correlation >= SAME_TARGET_CORRELATION:
        raise ValueError(f"{path}: trained for another target of this width and vocabulary: this target's input "
                         f"embedding does not match the one it was trained with (correlation {correlation:.2f} on "
                         f"{mine.size} sampled weights; the same model quantized or cast gives above "
                         f"{SAME_TARGET_CORRELATION}); {run_anyway}")


def config_json(config: dict) -> str:
    """The text of a ``config.json``: indented, with the embedding sketch's numbers on one line."""
    text = json.dumps(config, indent=2) + "\n"
    return re.sub(r'"embedding_sketch": (\[[^\]]*\])', lambda m: f'"embedding_sketch": {json.dumps(json.loads(m[1]))}', text)


def save_drafter(drafter, directory, *, storage_dtype: str = "float32", metadata: dict | None = None,
                 target=None) -> Path:
    """Write ``drafter`` to ``directory`` (created); float tensors stored as ``storage_dtype``.
    With ``target`` (the model it was trained for, or its ``identity``) that is recorded, and
    ``load_drafter`` refuses other models (module docstring).

    Other files in the directory (``calibration.json``) are kept. Saving over an earlier drafter
    replaces each file whole; a save that fails or is killed part-way leaves the earlier drafter,
    or a pair of files that ``load_drafter`` refuses (module docstring), never a silent mix.
    """
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage_dtype must be one of {sorted(STORAGE_DTYPES)}, got {storage_dtype!r}")
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file, not a directory: a drafter checkpoint is a directory "
                         f"({CONFIG_FILE} + {WEIGHTS_FILE}); give save_drafter a directory path")
    if metadata is not None and not isinstance(metadata, dict):  # load_drafter reads a JSON object
        raise TypeError(f"save_drafter: metadata must be a dict, got {type(metadata).__name__}")
    _check_overwritable(out / CONFIG_FILE)
    tensors = {
        name: value.astype(STORAGE_DTYPES[storage_dtype]) if _is_float(value.dtype) else value
        for name, value in drafter_tensors(drafter).items()
    }
    weights_id = weights_digest(tensors)
    config = {
        "format": FORMAT,
        "version": VERSION,
        "drafter": drafter.cfg.to_dict(),
        "storage_dtype": storage_dtype,
        "metadata": metadata or {},
        WEIGHTS_ID: weights_id,
    }
    if target is not None:
        config[TARGET] = target if isinstance(target, dict) else target_identity(target)
    try:  # before any file is touched: metadata JSON cannot hold must not cost the earlier drafter
        config_text = config_json(config)
    except (TypeError, ValueError) as error:
        raise TypeError(f"save_drafter: metadata must be JSON-serialisable ({error}); nothing was written") from error
    out.mkdir(parents=True, exist_ok=True)
    partial = {name: partial_path(out / name) for name in (WEIGHTS_FILE, CONFIG_FILE)}
    try:
        save_safetensors(tensors, partial[WEIGHTS_FILE], metadata={WEIGHTS_ID: weights_id})
        partial[CONFIG_FILE].write_text(config_text)
    except BaseException:
        for path in partial.values():
            path.unlink(missing_ok=True)
        raise
    # Weights first: a kill between the renames leaves new weights beside the old config, which
    # the weights ids tell apart; a symlinked file (a shared copy) is replaced, its target untouched.
    os.replace(partial[WEIGHTS_FILE], out / WEIGHTS_FILE)
    os.replace(partial[CONFIG_FILE], out / CONFIG_FILE)
    return out


def weights_digest(tensors: dict[str, np.ndarray]) -> str:
    """The id of a checkpoint's stored tensors: equal for the same names, dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        value = np.ascontiguousarray(tensors[name])
        digest.update(f"{name}:{value.dtype.name}:{value.shape}\n".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()[:32]


def drafter_weights_id(directory) -> str | None:
    """The weights id ``config.json`` records in a drafter ``directory``; None where it records
    none (a checkpoint from before weights ids) or ``directory`` holds no drafter."""
    try:
        return _read_config(directory)[1].get(WEIGHTS_ID)
    except (OSError, ValueError):
        return None


def _checkpoint_dir(directory) -> Path:
    """``directory`` checked as a drafter checkpoint directory that has its ``config.json``."""
    directory = Path(directory)
    if not directory.exists():
        raise FileNotFoundError(f"{directory} does not exist: not a drafter checkpoint (a directory holding "
                                f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    if not directory.is_dir():
        raise ValueError(f"{directory} is a file, not a drafter checkpoint directory: give the directory that "
                         f"holds its {CONFIG_FILE} and {WEIGHTS_FILE}")
    path = directory / CONFIG_FILE
    if not path.exists():
        if (directory / WEIGHTS_FILE).exists():  # half a checkpoint, not some other directory
            raise ValueError(f"{directory} has {WEIGHTS_FILE} but no {CONFIG_FILE}: the checkpoint is incomplete "
                             "(an interrupted save or copy); save or copy it again")
        raise FileNotFoundError(f"{directory} is not a drafter checkpoint: no {CONFIG_FILE}")
    if not path.is_file():
        raise ValueError(f"{path} is not a file: the checkpoint is damaged")
    return directory


def _read_config(directory) -> tuple[DrafterConfig, dict]:
    """The drafter config of a checkpoint directory and its whole checked ``config.json``."""
    path = _checkpoint_dir(directory) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}): the checkpoint is damaged") from error
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a {FORMAT} config: a JSON object expected, got {raw!r}")
    if raw.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} config (format={raw.get('format')!r})")
    if raw.get("version") != VERSION:
        raise ValueError(f"{path} has format version {raw.get('version')}; this code reads version {VERSION}")
    if not isinstance(raw.get("drafter"), dict):
        raise ValueError(f"{path} has no 'drafter' section (the drafter's config): the checkpoint is damaged")
    if not isinstance(raw.get("metadata", {}), dict):
        raise ValueError(f"{path}: 'metadata' must be a JSON object, got {raw['metadata']!r}: the checkpoint is damaged")
    try:
        cfg = DrafterConfig.from_dict(raw["drafter"])
    except (TypeError, ValueError) as error:  # a missing field is a TypeError from the dataclass
        raise ValueError(f"{path} holds no valid drafter config: {error}") from error
    return cfg, raw


def other_format(directory):
    """The reader (one of ``OTHER_FORMATS``) of the drafter another program saved in
    ``directory``, or None for a dspark-jax drafter (or no drafter)."""
    return next((reader for reader in OTHER_FORMATS if reader.claims(directory)), None)


def read_drafter_config(directory, target=None) -> tuple[DrafterConfig, dict]:
    """The drafter config and the free-form metadata of a checkpoint directory (for one another
    program saved, ``{its reader's NAME: its config.json}``); ``target`` (a model or its
    config), where given, settles what such a checkpoint leaves to its target."""
    reader = other_format(directory)
    if reader is not None:
        cfg, raw = reader.read_config(directory, _depth(target))
        return cfg, {reader.NAME: raw}
    cfg, raw = _read_config(directory)
    return cfg, raw.get("metadata", {})


def _read_weights(directory: Path) -> tuple[dict[str, np.ndarray], str | None]:
    """The tensors of ``directory``'s weights file and its weights id (None before weights ids)."""
    weights = directory / WEIGHTS_FILE
    if not weights.exists():
        raise ValueError(f"{directory} has no {WEIGHTS_FILE} beside its {CONFIG_FILE}: the checkpoint is incomplete "
                         "(an interrupted save or copy); save or copy it again")
    if not weights.is_file():
        raise ValueError(f"{weights} is not a file: the checkpoint is damaged")
    try:
        with safetensors.safe_open(str(weights), "np") as f:
            header = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (safetensors.SafetensorError, OSError) as error:
        raise ValueError(f"{weights} is not a readable safetensors file ({error}): the checkpoint is damaged or "
                         "incompletely written") from error
    return tensors, header.get(WEIGHTS_ID)


def load_drafter(directory, *, target=None, dtype=jnp.float32):
    """Load a drafter; with ``target`` given, refuse one that does not fit it (naming why).

    ``target`` is the target model (its config is checked, and its embedding against the one the
    drafter was trained with, where the checkpoint records it), or only its ``TargetConfig``.

    Every way a checkpoint can be damaged is a ``ValueError`` naming the file: tensors missing,
    unexpected, of the wrong shape or kind (integer weights, a float ``d2t``), non-finite weights,
    and a ``config.json`` and ``model.safetensors`` from different saves.

    A drafter DeepSpec, z-lab, speculators, SpecForge or the EAGLE authors saved
    (``checkpoints.deepspec``: the official DSpark drafters and their DFlash and EAGLE-3 baselines,
    z-lab's DFlash ones; ``checkpoints.speculators``; ``checkpoints.eagle``) loads too; one that
    keeps a copy of its target's embedding is refused for a target whose embedding is not that one.
    """
    directory = Path(directory)
    reader = other_format(directory)
    if reader is not None:
        cfg, their_config = reader.read_config(directory, _depth(target))
        raw, weights = {}, directory
    else:
        cfg, raw = _read_config(directory)
        weights = directory / WEIGHTS_FILE
    # The weights are read once the target is checked: a wrong one fails before they load.
    if target is not None:
        try:
            cfg.check_target(getattr(target, "cfg", target))
        except ValueError as error:  # say which checkpoint: a run may load several
            raise ValueError(f"{directory / CONFIG_FILE}: {error} (a drafter is trained for one target: train or "
                             "pick one for this target)") from None
        recorded = reader.trained_for(directory, their_config) if reader is not None else raw.get(TARGET)
        if recorded is not None:
            _check_trained_target(directory, recorded, target, in_config=reader is None)
    if reader is not None:
        cfg, tensors = reader.read_drafter(directory, cfg)  # under our names already
        weights_id = None
    else:
        tensors, weights_id = _read_weights(directory)
    ids = tensors.get(D2T) if cfg.draft_vocab_size is not None else None
    if ids is not None and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{weights}: {D2T} is stored as {ids.dtype}, not integers (the reduced head's draft -> "
                         "target token ids): the checkpoint is damaged")
    # A missing or mis-shaped d2t is reported with the other tensors below: build with a stand-in.
    usable = ids is not None and ids.shape == (cfg.draft_vocab_size,)
    stand_in = np.arange(cfg.draft_vocab_size) if cfg.draft_vocab_size is not None else None
    try:
        abstract = nnx.eval_shape(lambda: build_drafter(cfg, dtype=dtype, draft_vocab_ids=ids if usable else stand_in))
    except ValueError as error:  # only the ids can be wrong here: the config was checked
        raise ValueError(f"{weights}: {D2T} holds no valid draft vocabulary ({error}): the checkpoint is damaged") from None
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
            f"{weights} does not match the drafter config in {CONFIG_FILE}: missing {missing}, unexpected "
            f"{unexpected}, wrong shapes {wrong}; the checkpoint is damaged, or its two files come from different drafters"
        )
    for name, leaf in sorted(expected.items()):  # a cast would hide a damaged or foreign file
        kind = tensors[name].dtype
        if _is_float(leaf.dtype) and not _is_float(kind):
            raise ValueError(f"{weights}: {name} is stored as {kind}, not a floating-point type: the checkpoint is "
                             "damaged or was not written by save_drafter")
    bad = sorted(name for name, value in tensors.items()
                 if _is_float(value.dtype) and not np.isfinite(value.astype(np.float32)).all())
    if bad:
        raise ValueError(f"{weights}: non-finite values (NaN or inf) in {bad}: the drafter's weights are damaged "
                         "(a diverged run or a corrupted file); use an earlier checkpoint or train again")
    if weights_id != raw.get(WEIGHTS_ID):
        raise ValueError(
            f"{directory}: {CONFIG_FILE} and {WEIGHTS_FILE} come from different saves (weights ids "
            f"{raw.get(WEIGHTS_ID)} and {weights_id}): a save into this directory was interrupted, or the files were "
            "copied from two checkpoints; save the drafter again or copy both files from one checkpoint (after "
            f"editing {WEIGHTS_FILE} on purpose, drop '{WEIGHTS_ID}' from {CONFIG_FILE})"
        )

    def fill(path, leaf):
        value = tensors[_path_name(path)]
        return jnp.asarray(value, dtype=leaf.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, abstract_state))


def convert_drafter(directory, out, *, storage_dtype: str = "float32") -> Path:
    """Write the drafter another program saved in ``directory`` (``OTHER_FORMATS``) to ``out`` as a
    dspark-jax drafter: its draft layers and heads (without a DeepSpec checkpoint's copies of the
    target's embedding and LM head: a 4B target's drafter loses most of its size), the record of its
    target where it has one, and its own config in the metadata. What it drafts is unchanged (bit
    for bit in float32)."""
    directory = Path(directory)
    reader = other_format(directory)
    if reader is None:
        _checkpoint_dir(directory)  # a missing directory or config is named as such
        raise ValueError(f"{directory} holds no drafter DeepSpec, z-lab, speculators, SpecForge or the EAGLE authors "
                         "saved (a Qwen3DSparkModel, a Qwen3Eagle3Model, a DFlashDraftModel, a speculators DSpark, "
                         "DFlash or EAGLE-3 config.json, or a LlamaForCausalLMEagle3)")
    raw = reader.read_config(directory)[1]
    metadata = {"converted_from": str(directory.resolve()), f"{reader.NAME}_config": raw}
    return save_drafter(load_drafter(directory), out, storage_dtype=storage_dtype, metadata=metadata,
                        target=reader.trained_for(directory, raw))
