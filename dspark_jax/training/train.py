"""Drafter training: prompts -> target cache -> sharded, resumable optax training -> checkpoint.

``run(config)`` is the whole pipeline behind ``dspark train --config configs/NAME.py``:

1. build the prompt mix (``training/data.py``), render it with the target's chat template;
2. build or resume the target cache (``training/target_cache.py``), its answers generated on the
   same mesh as training, each device answering its own rows;
3. pick the reduced draft vocabulary from the cached responses' token counts;
4. train with AdamW (warm-up + cosine to 0, global-norm clipping; spec §5.5) on a
   ``jax.sharding.Mesh`` whose ``data`` axis splits every batch across devices (parameters are
   replicated: a drafter is a few MB, so data parallelism is the sharding that pays);
5. save an orbax checkpoint every ``checkpoint_every`` steps and at the end, and export the
   drafter (``checkpoints/drafter.py``) without the frozen embedding / LM head.

``run_budgeted(configs, budget_s)`` (``dspark train`` with several ``--config`` and ``--budget-s``)
trains several drafters on one data set within a wall-clock budget and with equal steps, together
(``train_together``: one batch a step for all); the plan goes to ``budget.json``. A cache of token
ids alone (``CacheSpec.store_features=False``) has each batch completed by the frozen target
(``batch_completer``), which pays on an accelerator.

``init_from`` starts a run from a trained drafter instead of a random one, with a fresh optimizer
and schedule: an exported drafter directory (fine-tune a shipped drafter on new responses), or
another ``TrainConfig`` (a training leg: it is trained first, or resumed, unless its drafter is
already exported), so one command reproduces a multi-leg run.

Resume is exact: the data order and the anchors of step ``t`` are functions of ``(seed, t)``
alone, and the checkpoint holds parameters and optimizer state, so a killed run continues with
the same loss curve as an uninterrupted one; ``run.json`` records the settings, and a resume with
settings that change what a step computes is refused (``claim_run_dir``). ``log.jsonl`` gets one line per step (every loss
term, the analytic acceptance estimate, learning rate, gradient norm), and with
``heldout_prompts`` the τ and loss on the target's answers to fresh prompts (``heldout_mix``) every
``heldout_every`` steps: the curve that says when more steps on this data stop paying. A step
whose loss or gradient norm is not finite stops the run (``NonFiniteLoss``) before it is saved.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import numbers
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from dspark_jax import multihost
from dspark_jax.checkpoints.drafter import CONFIG_FILE, build_drafter, load_drafter, save_drafter
from dspark_jax.config import DrafterConfig, TargetConfig, as_int, as_ints, from_mapping
from dspark_jax.drafter.model import select_draft_vocab
from dspark_jax.training.losses import TrainBatch, drafter_loss, eagle3_loss
from dspark_jax.training.target_cache import (
    CachedSequence,
    CacheSpec,
    TargetCacheWriter,
    answered_names,
    complete_shards,
    load_target_cache,
    teacher_forced,
)

LOG_FILE = "log.jsonl"
# TrainConfig's int fields, and those that may also be None.
_INT_FIELDS = ("num_prompts", "steps", "batch_size", "seq_len", "num_anchors", "anchor_chunk", "seed",
               "checkpoint_every", "heldout_prompts", "heldout_seed", "heldout_every")
_OPTIONAL_INT_FIELDS = ("target_layers", "data_parallel", "cache_shards")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. ``drafter`` holds ``DrafterConfig`` fields (``kind`` picks DSpark,
    DFlash or EAGLE-3 defaults); tap layers come from ``cache.tap_layers``."""

    name: str
    out_dir: str
    cache: CacheSpec
    drafter: dict
    # Your own prompts instead of the generated mix (``data.read_jsonl``: a JSONL of {"text": ...});
    # num_prompts, data_seed and data_mix are then unused. Lines appended later grow the cache.
    prompts_file: str | None = None
    num_prompts: int = 1000  # per data seed
    data_seed: int | tuple[int, ...] = 0  # more seeds, more prompts (see training_prompts)
    data_mix: str | tuple[str, ...] = "paper"  # a name in data.MIXES, for every seed or one per seed
    target_checkpoint: str | None = None  # a GGUF file or HF directory to train for (default: the embedded SmolLM2)
    target_layers: int | None = None  # keep only the target's first N layers (tiny_test)
    steps: int = 1000
    batch_size: int = 8  # sequences per optimizer step, across all devices
    seq_len: int = 512  # sequences are truncated / padded to this many tokens
    num_anchors: int = 64  # blocks per sequence (spec §5.4; DeepSpec uses 512 at 4k tokens)
    anchor_chunk: int = 16  # anchors whose [chunk, γ, V] logits are alive at once
    learning_rate: float = 6e-4
    warmup_fraction: float = 0.04
    clip_norm: float = 1.0
    seed: int = 42
    checkpoint_every: int = 100
    data_parallel: int | None = None  # devices on the mesh's data axis (default: all)
    storage_dtype: str = "bfloat16"  # of the exported drafter's weights
    benchmarks_dir: str | None = None  # benchmark prompts the training prompts must not overlap
    cache_dir: str | None = None  # default: out_dir/cache (configs on one data set share one)
    cache_shards: int | None = None  # build and train on the cache's first N shards (default: all its prompts span)
    init_from: TrainConfig | str | os.PathLike | None = None  # start from a trained drafter (see the module doc)
    # A block drafter trained from scratch starts its layer i as the target's layer
    # target_init_layers[i] (``copy_target_layers``); legs after the first start from a drafter.
    target_init_layers: tuple[int, ...] | None = None
    # Held-out answers scored every ``heldout_every`` steps (see ``heldout_prompts``); 0: none.
    heldout_prompts: int = 0
    heldout_seed: int = 1
    heldout_mix: str = "paper"
    heldout_every: int = 50
    heldout_cache_dir: str | None = None  # default: out_dir/heldout_cache

    def __post_init__(self):
        # Types are checked here, at load_config, not as a TypeError after the target cache is built.
        if isinstance(self.cache, Mapping):
            object.__setattr__(self, "cache", from_mapping(CacheSpec, self.cache, "TrainConfig.cache"))
        if not isinstance(self.cache, CacheSpec):
            raise ValueError(f"TrainConfig.cache must be a CacheSpec or a dict of its fields, got {self.cache!r}")
        if not isinstance(self.drafter, Mapping):
            raise ValueError(f"TrainConfig.drafter must be a dict of DrafterConfig fields, got {self.drafter!r}")
        for name in _INT_FIELDS:
            object.__setattr__(self, name, as_int(getattr(self, name), f"TrainConfig.{name}"))
        for name in _OPTIONAL_INT_FIELDS:
            if getattr(self, name) is not None:
                object.__setattr__(self, name, as_int(getattr(self, name), f"TrainConfig.{name}", "an int or None"))
        for name in ("steps", "batch_size", "seq_len", "num_anchors", "anchor_chunk", "checkpoint_every", "num_prompts",
                     "heldout_every") + _OPTIONAL_INT_FIELDS:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.seed < 0:  # numpy's generators, which draw the batches, take no negative seed
            raise ValueError(f"TrainConfig.seed must be >= 0, got {self.seed}")
        # A negative learning rate or clip norm climbs the loss, a zero one freezes the drafter; a
        # warm-up over every step never reaches the peak (``schedule``).
        for name, wanted, ok in (("learning_rate", "> 0", lambda v: v > 0), ("clip_norm", "> 0", lambda v: v > 0),
                                 ("warmup_fraction", "in [0, 1)", lambda v: 0 <= v < 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not ok(value):
                raise ValueError(f"TrainConfig.{name} must be a finite number {wanted}, got {value!r}")
            object.__setattr__(self, name, float(value))
        # An int, or a collection of ints: a str would be iterated as its digits.
        if isinstance(self.data_seed, Iterable) and not isinstance(self.data_seed, (str, bytes)):
            object.__setattr__(self, "data_seed", as_ints(self.data_seed, "TrainConfig.data_seed"))
        else:
            object.__setattr__(self, "data_seed", as_int(self.data_seed, "TrainConfig.data_seed",
                                                         "an int or a tuple of distinct ints"))
        # An anchor needs its next token in the response too (``anchor_candidates``): shorter
        # answers give no block to train on, and a set of them trains on a loss of 0.
        if self.cache.min_response_tokens < 2:
            raise ValueError(f"TrainConfig.cache.min_response_tokens must be >= 2 (an anchor and the response token "
                             f"after it), got {self.cache.min_response_tokens}")
        seeds = self.data_seeds
        if not seeds or len(set(seeds)) != len(seeds):
            raise ValueError(f"TrainConfig.data_seed must be an int or distinct ints, got {self.data_seed!r}")
        mixes = self.data_mixes
        if len(mixes) != len(seeds):
            raise ValueError(f"TrainConfig.data_mix names {len(mixes)} mixes for {len(seeds)} data seeds; "
                             "give one name, or one per seed")
        from dspark_jax.training.data import MIXES

        unknown = sorted(set(mixes + (self.heldout_mix,)) - set(MIXES))
        if unknown:
            raise ValueError(f"TrainConfig.data_mix / heldout_mix: unknown mix {unknown}; known: {sorted(MIXES)}")
        if self.heldout_prompts < 0:
            raise ValueError(f"TrainConfig.heldout_prompts must be >= 0, got {self.heldout_prompts}")
        if self.heldout_prompts and self.heldout_seed in seeds:
            raise ValueError(f"heldout_seed {self.heldout_seed} is a data seed: its prompts are training prompts")
        if self.num_anchors % self.anchor_chunk:
            raise ValueError(f"num_anchors ({self.num_anchors}) must be a multiple of anchor_chunk ({self.anchor_chunk})")
        if self.seq_len < self.cache.max_prompt_tokens + 2:
            raise ValueError("seq_len must leave room for response tokens after the longest prompt")
        if not isinstance(self.init_from, (TrainConfig, str, os.PathLike, type(None))):
            raise ValueError(f"init_from must be a TrainConfig, a drafter directory or None, got {self.init_from!r}")
        if self.target_init_layers is not None:
            object.__setattr__(self, "target_init_layers",
                               as_ints(self.target_init_layers, "TrainConfig.target_init_layers"))
            if self.init_from is not None:
                raise ValueError("target_init_layers starts a drafter from scratch; init_from starts it from a "
                                 "trained one: set one of them")
            if self.kind == "eagle3":
                raise ValueError("target_init_layers needs a block drafter (dspark, dflash): EAGLE-3's layer reads "
                                 "[embedding ; features], a shape no target layer has")
            if len(self.target_init_layers) != self.drafter.get("num_layers", 1):
                raise ValueError(f"target_init_layers names {len(self.target_init_layers)} target layers for a drafter "
                                 f"of {self.drafter.get('num_layers', 1)} layers: give one per drafter layer")

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir is not None else Path(self.out_dir) / "cache"

    @property
    def heldout_cache_path(self) -> Path:
        return Path(self.heldout_cache_dir) if self.heldout_cache_dir is not None else Path(self.out_dir) / "heldout_cache"

    @property
    def data_seeds(self) -> tuple[int, ...]:
        return (self.data_seed,) if isinstance(self.data_seed, int) else tuple(self.data_seed)

    @property
    def data_mixes(self) -> tuple[str, ...]:
        return (self.data_mix,) * len(self.data_seeds) if isinstance(self.data_mix, str) else tuple(self.data_mix)

    @property
    def data_sources(self) -> tuple[tuple[int, str], ...]:
        """(data seed, mix name) pairs, in order."""
        return tuple(zip(self.data_seeds, self.data_mixes))

    @property
    def kind(self) -> str:
        return self.drafter.get("kind", "dspark")

    @property
    def legs(self) -> tuple[TrainConfig, ...]:
        """Every training leg this config's drafter went through, first leg first, this one last."""
        start = self.init_from.legs if isinstance(self.init_from, TrainConfig) else ()
        return start + (self,)

    @property
    def init_dir(self) -> Path | None:
        """The exported drafter this run starts from, if any."""
        if isinstance(self.init_from, TrainConfig):
            return Path(self.init_from.out_dir) / "drafter"
        return None if self.init_from is None else Path(self.init_from)


def next_leg(previous: TrainConfig, name: str, **changes) -> TrainConfig:
    """A training leg that starts from ``previous``'s exported drafter: ``previous`` with ``changes``,
    named ``name`` and written to ``runs/<name>``."""
    return dataclasses.replace(previous, name=name, out_dir=f"runs/{name}", init_from=previous,
                               **{"target_init_layers": None, **changes})


def same_legs(config: TrainConfig, drafter: dict, rename: tuple[str, str]) -> TrainConfig:
    """``config`` with another drafter, and so every leg it starts from: a baseline trained leg for
    leg on the same data and budget. ``rename = (old, new)`` rewrites names and out_dirs.

    A baseline takes each leg's ``qk_norm`` from ``config``'s leg, and a block-drafter baseline
    (DFlash) its depth too, so the two compare with the same attention and at equal depth when a
    leg grows the drafter; EAGLE-3 keeps its one layer (spec §8.2).
    """
    inherited = {"qk_norm": config.drafter["qk_norm"]} if "qk_norm" in config.drafter else {}
    if drafter.get("kind") != "eagle3":
        inherited["num_layers"] = config.drafter.get("num_layers", 1)
    clash = sorted(set(inherited) & set(drafter))
    if clash:
        raise ValueError(f"a baseline takes {', '.join(clash)} from each leg; do not set it")
    leg_drafter = {**drafter, **inherited}
    start = config.init_from
    if isinstance(start, TrainConfig):
        start = same_legs(start, drafter, rename)
    old, new = rename
    # EAGLE-3 has no target-shaped layer to start from (TrainConfig.target_init_layers).
    target_init = None if drafter.get("kind") == "eagle3" else config.target_init_layers
    return dataclasses.replace(config, name=config.name.replace(old, new), out_dir=config.out_dir.replace(old, new),
                               drafter=leg_drafter, init_from=start, target_init_layers=target_init)


def load_config(path) -> TrainConfig:
    """A config file is Python that defines ``CONFIG = TrainConfig(...)``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no config file {path}")
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not a config file")
    if path.suffix != ".py":  # importlib finds no loader for other suffixes
        raise ValueError(f"{path} is not a Python config file (configs/NAME.py)")
    spec = importlib.util.spec_from_file_location(f"dspark_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # SyntaxError, an unknown TrainConfig keyword, a NameError: one line, by path
        said = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
        raise ValueError(f"{path}: {said}") from error
    config = getattr(module, "CONFIG", None)
    if not isinstance(config, TrainConfig):
        raise ValueError(f"{path} must define CONFIG = TrainConfig(...)")
    return config


RUN_FILE = "run.json"
# What a resumed run may change: its name, where things go, how often it saves, what it scores
# beside the steps, how many devices share a batch, and its step count (a finished run given more
# steps trains on; ``train_together`` says so, as it alone knows a budget's steps). Any other
# setting changes what a step computes, so a run resumed with it would go on as a hybrid of two runs.
RESUMABLE_FIELDS = frozenset({"name", "out_dir", "steps", "checkpoint_every", "data_parallel", "storage_dtype",
                              "cache_dir", "heldout_cache_dir", "heldout_prompts", "heldout_seed", "heldout_mix",
                              "heldout_every"})


def run_settings(config: TrainConfig) -> dict:
    """The settings that fix what the run's steps compute, as JSON values."""
    settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in RESUMABLE_FIELDS}
    settings["init_from"] = None if config.init_dir is None else str(config.init_dir.resolve())
    return json.loads(json.dumps(settings, default=lambda v: dataclasses.asdict(v) if dataclasses.is_dataclass(v)
                                 else str(v)))


def claim_run_dir(out: Path, settings: dict, *, resuming: bool) -> dict:
    """Record ``settings`` in ``out/run.json`` and return what it held before. A run that resumes
    from a checkpoint there must have the recorded ones; one with no checkpoint yet (or from before
    the record) records its own."""
    path = out / RUN_FILE
    recorded = json.loads(path.read_text()) if path.exists() else {}
    changed = [line for k, v in settings.items() if k in recorded for line in _differences(k, recorded[k], v)]
    if changed and resuming:
        said = "; ".join(changed)
        raise ValueError(f"the run in {out} was started with other settings ({said}): rerun it as it was started, "
                         "or give this run a fresh out_dir (init_from=<that run's drafter> starts where it got to)")
    merged = {**recorded, **settings}
    if merged != recorded and multihost.is_lead():
        out.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")  # a kill mid-write leaves the old record whole
        partial.write_text(json.dumps(merged, indent=1) + "\n")
        os.replace(partial, path)
    return recorded


def _differences(name: str, then, now) -> list[str]:
    """``"name: then-value then, now-value now"`` for each leaf where two JSON values differ."""
    if isinstance(then, dict) and isinstance(now, dict):
        return [line for k in {**then, **now} for line in _differences(f"{name}.{k}", then.get(k), now.get(k))]
    return [] if then == now else [f"{name}: {json.dumps(then)} then, {json.dumps(now)} now"]


def drafter_config(config: TrainConfig, target: TargetConfig) -> DrafterConfig:
    fields = {k: v for k, v in config.drafter.items() if k != "kind"}
    builder = {
        "dspark": DrafterConfig.for_target,
        "dflash": DrafterConfig.dflash,
        "eagle3": DrafterConfig.eagle3,
    }.get(config.kind)
    if builder is None:
        raise ValueError(f"drafter kind must be dspark, dflash or eagle3, got {config.kind!r}")
    # DrafterConfig's fields but the two a run fills in, and for_target's own keywords.
    known = {f.name for f in dataclasses.fields(DrafterConfig)} - {"backbone", "tap_layers"} | {"num_layers", "qk_norm"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"TrainConfig.drafter: unknown keys {unknown}; known keys: {sorted(known)}")
    if config.kind != "eagle3":
        fields = {"num_layers": 1, **fields}
    try:
        return builder(target, tap_layers=config.cache.tap_layers, **fields)
    except (TypeError, ValueError) as error:  # a missing mask_token_id, a bad value: one line, saying where
        raise ValueError(f"TrainConfig.drafter: {error}") from error


# ------------------------------------------------------------------------------------------
# batches


def anchor_candidates(loss_mask: np.ndarray) -> np.ndarray:
    """Positions ``i`` where token ``i`` and ``i + 1`` are both response tokens (spec §5.4)."""
    m = np.asarray(loss_mask) != 0
    return np.flatnonzero(m[:-1] & m[1:])


def sample_anchors(loss_mask: np.ndarray, num_anchors: int, rng: np.random.Generator):
    """Up to ``num_anchors`` candidates uniformly without replacement, ascending; padded with
    ``(0, keep=False)``."""
    cands = anchor_candidates(loss_mask)
    if cands.size > num_anchors:
        cands = np.sort(rng.choice(cands, num_anchors, replace=False))
    anchors = np.zeros(num_anchors, np.int32)
    keep = np.zeros(num_anchors, bool)
    anchors[: cands.size], keep[: cands.size] = cands, True
    return anchors, keep


class BatchSource:
    """Deterministic batches: epoch ``e`` shuffles with ``(seed, e)``; step ``t``'s anchors use
    ``(seed, t)``. Nothing depends on what ran before, which is what makes resume exact."""

    def __init__(self, sequences: list[CachedSequence], config: TrainConfig):
        if len(sequences) < config.batch_size:
            raise ValueError(f"the target cache has {len(sequences)} sequences, fewer than batch_size {config.batch_size}")
        self.seqs, self.cfg = sequences, config
        self.steps_per_epoch = len(sequences) // config.batch_size

    def rows(self, step: int) -> np.ndarray:
        epoch, index = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.seqs))
        return order[index * self.cfg.batch_size : (index + 1) * self.cfg.batch_size]

    def batch(self, step: int) -> TrainBatch:
        """Step ``step``'s sequences, truncated or padded to ``seq_len``, with their anchors; from a
        cache without features, the per-token target arrays are None (``batch_completer``)."""
        cfg = self.cfg
        s, b = cfg.seq_len, cfg.batch_size
        first = self.seqs[0]
        cached = first.features is not None
        ids = np.zeros((b, s), np.int32)
        mask = np.zeros((b, s), np.uint8)
        lengths = np.zeros(b, np.int32)
        if cached:
            feats = np.zeros((b, s, first.features.shape[1]), first.features.dtype)
            hidden = np.zeros((b, s, first.hidden.shape[1]), first.hidden.dtype)
            lse = np.zeros((b, s), np.float32)
        anchors = np.zeros((b, cfg.num_anchors), np.int32)
        keep = np.zeros((b, cfg.num_anchors), bool)
        rng = np.random.default_rng([cfg.seed, 1, step])
        for row, index in enumerate(self.rows(step)):
            seq = self.seqs[index]
            n = lengths[row] = min(len(seq.input_ids), s)
            ids[row, :n], mask[row, :n] = seq.input_ids[:n], seq.loss_mask[:n]
            if cached:
                feats[row, :n], hidden[row, :n], lse[row, :n] = seq.features[:n], seq.hidden[:n], seq.lse[:n]
            anchors[row], keep[row] = sample_anchors(mask[row, :n], cfg.num_anchors, rng)
        if not cached:
            feats = hidden = lse = None
        return TrainBatch(ids, mask, feats, hidden, anchors, keep, lse, lengths)


def batch_completer(target, tap_layers: tuple[int, ...]):
    """``(target params, batch) -> batch`` with the target's per-token arrays: a batch from a cache
    of token ids alone (``CacheSpec.store_features=False``) gets them from the frozen target, by
    one forward over it (``teacher_forced``, ending in the ``stored_arrays`` a full cache stores),
    so both kinds of cache give the same batch to one bf16 rounding step; a batch that has them
    is returned as it is (and the params may be None)."""
    forward = teacher_forced(target, tap_layers)

    def complete(target_params, batch: TrainBatch) -> TrainBatch:
        if batch.features_BxSxF is not None:
            return batch
        features, hidden, lse = forward(target_params, batch.input_ids_BxS, batch.lengths_B)
        return batch._replace(features_BxSxF=features, target_hidden_BxSxD=hidden, target_lse_BxS=lse)

    return complete


# ------------------------------------------------------------------------------------------
# the optimizer step


def schedule(config: TrainConfig) -> optax.Schedule:
    """DeepSpec's: with ``W`` warm-up steps (``warmup_fraction`` of the steps, at least 1), step
    ``t < W`` runs at ``(t + 1) / W`` of the peak, then a cosine from the peak at step ``W`` to 0."""
    warmup = max(1, int(config.warmup_fraction * config.steps))
    peak = config.learning_rate
    return optax.join_schedules(
        [optax.linear_schedule(peak / warmup, peak, transition_steps=warmup - 1),
         optax.cosine_decay_schedule(peak, decay_steps=max(config.steps - warmup, 1))],
        boundaries=[warmup],
    )


def optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """AdamW with torch's defaults and no weight decay, as DeepSpec trains (spec §5.5), less the
    learning rate: the step scales by ``schedule(config)(step)``, passed in as a number, so the
    compiled step does not depend on the run's length (``run_budgeted`` times a step before it
    knows how many it can afford)."""
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8),
    )


def objective(drafter, config: TrainConfig, batch: TrainBatch, embed, head):
    """``(loss, metrics)`` of one batch under the loss of the config's drafter kind (the cached
    bf16 features are upcast first); training and held-out evaluation share it."""
    batch = batch._replace(
        features_BxSxF=batch.features_BxSxF.astype(jnp.float32),
        target_hidden_BxSxD=batch.target_hidden_BxSxD.astype(jnp.float32),
    )
    if config.kind == "eagle3":
        return eagle3_loss(drafter, embed, head, batch)
    return drafter_loss(drafter, embed, head, batch, chunk_size=config.anchor_chunk)


def make_train_step(graphdef, config: TrainConfig, tx: optax.GradientTransformation):
    """The jitted ``(params, opt_state, rest, batch, embed, head, lr) -> (params, opt_state,
    metrics)`` over a batch with the target's per-token arrays (``batch_completer``)."""
    def loss_fn(params, rest, batch, embed, head):
        return objective(nnx.merge(graphdef, params, rest), config, batch, embed, head)

    def step(params, opt_state, rest, batch, embed, head, lr):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, batch, embed, head)
        updates, opt_state = tx.update(grads, opt_state, params)
        updates = jax.tree.map(lambda u: -lr * u, updates)
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads))
        return optax.apply_updates(params, updates), opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1))


def mean_metrics(score, config: TrainConfig, sequences: list[CachedSequence]) -> dict:
    """τ (``tau_probabilistic``), greedy τ, per-slot acceptance and loss of ``score`` (batch ->
    the objective's metrics, jitted), averaged over whole batches of ``sequences`` drawn like
    training's first epoch."""
    source = BatchSource(sequences, config)
    metrics = [jax.device_get(score(source.batch(step))) for step in range(source.steps_per_epoch)]

    def mean(key):
        return np.mean([m[key] for m in metrics], axis=0)

    return {
        "tau": float(mean("tau_probabilistic")),
        "tau_greedy": float(mean("tau_greedy")),
        "loss": float(mean("loss")),
        "accept_rate": mean("accept_rate").round(4).tolist(),
        "greedy_conditional_accept": mean("greedy_conditional_accept").round(4).tolist(),
        "sequences": source.steps_per_epoch * config.batch_size,
    }


def make_mesh(data_parallel: int | None, *, local: bool = False) -> Mesh:
    """A ``data`` axis over the first ``data_parallel`` devices (default: all), or with ``local``
    over this process's own: work that processes split by hand (the target cache) runs on those."""
    if data_parallel is not None and jax.process_count() > 1:
        raise ValueError(f"data_parallel={data_parallel}: with {jax.process_count()} processes every device "
                         "takes part (leave data_parallel unset)")
    devices = jax.local_devices() if local else jax.devices()
    n = len(devices) if data_parallel is None else data_parallel
    if not 1 <= n <= len(devices):
        raise ValueError(f"data_parallel={n} but {len(devices)} devices are visible")
    return Mesh(np.asarray(devices[:n]), ("data",))


def training_mesh(config: TrainConfig) -> Mesh:
    """The mesh a run trains on, refused where its batches cannot split over it: checked before
    the target cache is built (minutes to hours), not after."""
    mesh = make_mesh(config.data_parallel)
    if config.batch_size % mesh.size:
        raise ValueError(f"batch_size {config.batch_size} is not divisible by the {mesh.size} data-parallel devices: "
                         f"train on a number of devices that divides it (data_parallel in the config, or dspark "
                         f"train --data-parallel N), or with a batch_size that is a multiple of {mesh.size}")
    return mesh


# ------------------------------------------------------------------------------------------
# the pipeline


def load_target(config: TrainConfig):
    """The target and tokenizer a run trains for: ``target_checkpoint`` (the embedded one by
    default), cut to its first ``target_layers``."""
    from dspark_jax.checkpoints import load_target as load_checkpoint

    target, tokenizer = load_checkpoint(config.target_checkpoint)
    if not tokenizer.stop_ids:
        raise ValueError(f"the tokenizer of {config.target_checkpoint} names no EOS token, which ends the target's "
                         "answers to the training prompts")
    if config.target_layers is not None:
        target = target.truncated(config.target_layers)
    return target, tokenizer


def training_prompts(config: TrainConfig) -> list:
    """The prompts of ``prompts_file`` when it is given. Otherwise ``num_prompts`` prompts from
    each data seed (of that seed's mix), seeds in order, a text an
    earlier seed already gave dropped. Appending a seed appends prompts: the cache built for the
    shorter list is a prefix of the new one and grows (``TargetCacheWriter``). Ids of later seeds
    carry the seed (``math-000012@s2``) so that every id stays unique."""
    from dspark_jax.training.data import MIXES, build_prompts, normalise_text, read_jsonl

    if config.prompts_file is not None:
        return read_jsonl(config.prompts_file)
    seen, prompts = set(), []
    for i, (seed, mix) in enumerate(config.data_sources):
        for prompt in build_prompts(config.num_prompts, seed=seed, mix=MIXES[mix]):
            key = normalise_text(prompt.text)
            if key not in seen:
                seen.add(key)
                prompts.append(prompt if i == 0 else dataclasses.replace(prompt, id=f"{prompt.id}@s{seed}"))
    return prompts


def build_cache(config: TrainConfig, target, tokenizer, *, progress: bool = True,
                deadline: float | None = None) -> list[str]:
    """Build or resume (or grow) the config's target cache; returns the ids of the prompts this
    config trains on (what ``load_training_set`` takes). With a ``deadline`` the build stops
    early (``TargetCacheWriter.build``), and the cache is complete up to ``complete_shards``."""
    from dspark_jax.training.data import check_against_benchmarks

    prompts = training_prompts(config)
    if config.benchmarks_dir is not None:
        checked = check_against_benchmarks(prompts, config.benchmarks_dir)
        if progress:
            print(f"training prompts checked against {checked} benchmark prompts: no overlap")
    ids, names = render_prompts(config, prompts, tokenizer)
    say_left_out(config, prompts, names)
    writer = TargetCacheWriter(target, config.cache, config.cache_path, stop_ids=tokenizer.stop_ids,
                               mesh=make_mesh(config.data_parallel, local=True))
    writer.build(ids, names, progress=progress, num_shards=config.cache_shards, deadline=deadline)
    return _within_cache_shards(config, names)


def training_names(config: TrainConfig, tokenizer) -> list[str]:
    """Ids of the prompts ``config`` trains on, in cache order (``build_cache`` without building)."""
    prompts = training_prompts(config)
    names = render_prompts(config, prompts, tokenizer)[1]
    say_left_out(config, prompts, names)
    return _within_cache_shards(config, names)


def _within_cache_shards(config: TrainConfig, names: list[str]) -> list[str]:
    return names if config.cache_shards is None else names[: config.cache_shards * config.cache.shard_size]


def load_training_set(config: TrainConfig, names: list[str]) -> list[CachedSequence]:
    """The cached sequences of these prompts: the shards they span, less the answers to later
    prompts that a grown cache put in their last shard."""
    wanted = set(names)
    shards = -(-len(names) // config.cache.shard_size)
    sequences = [s for s in load_target_cache(config.cache_path, shards) if s.name in wanted]
    # The cache is keyed by the prompts' tokens: the same prompts under new ids (an edited
    # prompts_file) would find no answers and train on fewer sequences without a word.
    unanswered = sorted(wanted - answered_names(config.cache_path, shards))
    if unanswered:
        raise ValueError(f"the target cache {config.cache_path} answered these prompts under other ids "
                         f"({len(unanswered)} ids it does not know, e.g. {unanswered[:3]}): restore their ids, "
                         "or give the run another cache_dir")
    return sequences


def prompts_not_trained_on(configs: Sequence[TrainConfig], count: int, *, seed: int, mix) -> list:
    """``build_prompts(count, seed, mix)`` less the text of every prompt any leg of ``configs``
    trained on, in order. Seeds alone do not keep sets apart: the generators reuse templates and
    sources (a stdlib function, a word problem's numbers), so another seed can repeat a prompt."""
    from dspark_jax.training.data import build_prompts, normalise_text

    data_sets = {(leg.prompts_file, leg.num_prompts, leg.data_sources): leg for config in configs for leg in config.legs}
    seen = {normalise_text(p.text) for leg in data_sets.values() for p in training_prompts(leg)}
    return [p for p in build_prompts(count, seed=seed, mix=mix) if normalise_text(p.text) not in seen]


def heldout_prompts(config: TrainConfig) -> list:
    """Fresh prompts of ``heldout_mix`` (``heldout_seed``) with the text of every prompt any leg
    trained on removed (and checked against the benchmarks), in order; the first
    ``heldout_prompts`` that fit ``max_prompt_tokens`` are the held-out set."""
    from dspark_jax.training.data import MIXES, check_against_benchmarks

    # Every leg's, not only this one's: a leg on fresh seeds is compared with the legs before it.
    fresh = prompts_not_trained_on([config], 4 * config.heldout_prompts, seed=config.heldout_seed,
                                   mix=MIXES[config.heldout_mix])
    if config.benchmarks_dir is not None:
        check_against_benchmarks(fresh, config.benchmarks_dir)
    return fresh


def build_heldout_cache(config: TrainConfig, target, tokenizer, *, prompts=None, progress: bool = True) -> list[CachedSequence]:
    """The target's answers to the held-out prompts (``prompts``, default ``heldout_prompts(config)``;
    the first ``config.heldout_prompts`` that fit), cached like the training set's (resumable)."""
    ids, names = render_prompts(config, heldout_prompts(config) if prompts is None else prompts, tokenizer)
    ids, names = ids[: config.heldout_prompts], names[: config.heldout_prompts]
    # Small shards, and no batch wider than one (an accelerator config's 512 rows would be padding)
    # beyond a row per device.
    mesh = make_mesh(config.data_parallel, local=True)
    shard = min(config.cache.shard_size, 16)
    batch = -(-min(config.cache.batch_size, shard) // mesh.size) * mesh.size
    spec = dataclasses.replace(config.cache, shard_size=shard, batch_size=batch)
    TargetCacheWriter(target, spec, config.heldout_cache_path, stop_ids=tokenizer.stop_ids, mesh=mesh).build(
        ids, names, progress=progress)
    sequences = load_target_cache(config.heldout_cache_path)
    if len(sequences) < config.batch_size:
        raise ValueError(f"{len(sequences)} held-out sequences are fewer than batch_size {config.batch_size}; "
                         "raise heldout_prompts")
    return sequences


def render_prompts(config: TrainConfig, prompts, tokenizer) -> tuple[list[list[int]], list[str]]:
    """Token ids (chat template) and ids of the prompts; longer than ``max_prompt_tokens`` are
    left out, by rule."""
    ids, names = [], []
    for prompt in prompts:
        tokens = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}])
        if len(tokens) <= config.cache.max_prompt_tokens:
            ids.append(tokens)
            names.append(prompt.id)
    return ids, names


def say_left_out(config: TrainConfig, prompts, names: list[str]) -> None:
    """Say how many training prompts of each domain ``render_prompts`` left out for their length:
    domains' lengths differ, so a tight ``max_prompt_tokens`` shifts the mix ``data_mix`` asks for.
    None left is an error."""
    if len(names) == len(prompts):
        return
    if not names:
        raise ValueError(f"{config.name}: none of the {len(prompts)} training prompts fits max_prompt_tokens "
                         f"({config.cache.max_prompt_tokens} tokens with the chat template): raise it")
    kept = set(names)
    totals, left = {}, {}
    for prompt in prompts:
        totals[prompt.domain] = totals.get(prompt.domain, 0) + 1
        left[prompt.domain] = left.get(prompt.domain, 0) + (prompt.id not in kept)
    if multihost.is_lead():
        said = ", ".join(f"{d} {left[d]} of {totals[d]}" for d in sorted(totals) if left[d])
        print(f"note: {config.name} leaves out {len(prompts) - len(names)} of its {len(prompts)} training prompts, "
              f"longer than max_prompt_tokens ({config.cache.max_prompt_tokens}): {said}", file=sys.stderr)


def draft_vocab(config: TrainConfig, sequences, vocab_size: int) -> np.ndarray | None:
    """The most frequent response tokens (the reduced head's vocabulary), or None."""
    size = config.drafter.get("draft_vocab_size")
    if size is None:
        return None
    counts = np.zeros(vocab_size, np.int64)
    for seq in sequences:
        counts += np.bincount(seq.input_ids[seq.loss_mask != 0], minlength=vocab_size)
    return select_draft_vocab(counts, size)


def _read_log(path: Path, before_step: int) -> list[str]:
    if not path.exists():
        return []
    return [line for line in path.read_text().splitlines() if json.loads(line)["step"] < before_step]


def _scalars(metrics: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in jax.device_get(metrics).items():
        value = np.asarray(value)
        out[key] = float(value) if value.ndim == 0 else [float(x) for x in value]
    return out


def warm_start(directory: Path, cfg: DrafterConfig, target, *, seed: int):
    """The exported drafter at ``directory``, refused unless it was trained for the ``target``
    model and is the drafter ``cfg`` describes (its reduced vocabulary comes with it), or the same
    block drafter grown: fewer layers get identity layers appended (``Drafter.deepened``), a
    narrower vanilla Markov head is widened (``Drafter.widened_markov``), a vanilla head becomes a
    gated one (``Drafter.gated_markov``); all function-preserving, seeded by ``seed``."""
    if not (directory / CONFIG_FILE).exists():
        raise FileNotFoundError(f"init_from: no exported drafter at {directory} (train that run first)")
    drafter = load_drafter(directory, target=target)
    have = drafter.cfg
    if have.kind == cfg.kind != "eagle3" and cfg.backbone.num_layers > have.backbone.num_layers:
        drafter = drafter.deepened(cfg.backbone.num_layers, seed=seed)
    if (have.kind == cfg.kind == "dspark" and have.markov_head == "vanilla" and cfg.markov_head in ("vanilla", "gated")
            and cfg.markov_rank >= have.markov_rank and have.markov_w1_rows in ("target", cfg.markov_w1_rows)
            and (cfg.markov_rank, cfg.markov_w1_rows) != (have.markov_rank, have.markov_w1_rows)):
        drafter = drafter.widened_markov(cfg.markov_rank, w1_rows=cfg.markov_w1_rows, seed=seed)
    if have.kind == cfg.kind == "dspark" and (have.markov_head, cfg.markov_head) == ("vanilla", "gated"):
        drafter = drafter.gated_markov()
    if drafter.cfg != cfg:
        differ = sorted(f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(drafter.cfg, f.name))
        differ += [f"backbone.{f.name}" for f in dataclasses.fields(cfg.backbone)
                   if getattr(cfg.backbone, f.name) != getattr(drafter.cfg.backbone, f.name)]
        raise ValueError(f"init_from: the drafter at {directory} differs from this config's in {differ}")
    return drafter


def copy_target_layers(drafter, target, layers: tuple[int, ...]):
    """``drafter`` with its layer ``i`` a copy of the target's layer ``layers[i]`` (a block
    drafter's layers have the target's shape), its final norm the target's, and its context
    projection starting as the last tapped layer's output under the first copied layer's input
    norm, so that the copied attention first reads the context as the target's late layers do.
    The Markov and confidence heads keep their random init. From scratch, this start raised
    slot-1 acceptance for DSpark and DFlash, and lowered DFlash's later slots (``docs/TRAINING.md``)."""
    cfg, module = drafter.cfg, target.module()
    bad = [i for i in layers if not 0 <= i < target.cfg.num_layers]
    if bad:
        raise ValueError(f"target_init_layers {bad} are outside the target's layers 0..{target.cfg.num_layers - 1}")
    if cfg.backbone.qk_norm != target.cfg.qk_norm:
        raise ValueError(f"target_init_layers copies the target's attention, which has {'' if target.cfg.qk_norm else 'no '}"
                         f"QK-norm: set the drafter's qk_norm={target.cfg.qk_norm}")
    q_rows = cfg.backbone.num_heads * cfg.backbone.head_dim
    for layer, index in zip(drafter.backbone.layers, layers, strict=True):
        source = module.layers[index]
        qkv = source.attn.qkv.weight[...]
        layer.q.weight[...] = qkv[:q_rows]
        layer.kv.weight[...] = qkv[q_rows:]  # [k ; v]: the order DraftLayer.keys_values splits
        layer.o.weight[...] = source.attn.o.weight[...]
        for name in ("q_norm", "k_norm"):
            if getattr(layer, name) is not None:
                getattr(layer, name).weight[...] = getattr(source.attn, name).weight[...]
        layer.input_norm.weight[...] = source.input_norm.weight[...]
        layer.post_attn_norm.weight[...] = source.post_attn_norm.weight[...]
        layer.mlp.gate_up.weight[...] = source.mlp.gate_up.weight[...]
        layer.mlp.down.weight[...] = source.mlp.down.weight[...]
    d = cfg.backbone.hidden_size
    fc = jnp.zeros_like(drafter.backbone.fc.weight[...])
    drafter.backbone.fc.weight[...] = fc.at[:, -d:].set(jnp.eye(d, dtype=fc.dtype))
    drafter.backbone.hidden_norm.weight[...] = module.layers[layers[0]].input_norm.weight[...]
    drafter.backbone.final_norm.weight[...] = module.final_norm.weight[...]
    # Every parameter its own buffer: training donates them, and one target array set twice is one buffer.
    graph, state = nnx.split(drafter)
    return nnx.merge(graph, jax.tree.map(lambda x: jnp.array(x, copy=True), state))


class Trainer:
    """One drafter's run: its parameters and optimizer state on a device mesh (resumed from the
    newest checkpoint in ``out_dir``), its batches and compiled step. ``train_together`` runs the
    loop; ``run_budgeted`` first times ``batch_seconds`` and ``step_seconds`` to choose how many
    steps it can afford."""

    def __init__(self, config: TrainConfig, target, sequences, *, heldout=None, completion_from: Trainer | None = None):
        if not sequences:
            raise ValueError(f"{config.name}: the target cache {config.cache_path} holds no answer to train on: every "
                             f"answer was shorter than min_response_tokens ({config.cache.min_response_tokens}); raise "
                             "max_new_tokens or lower min_response_tokens, in a fresh cache_dir")
        self.config, self.heldout = config, heldout
        self.out = Path(config.out_dir).absolute()
        cfg = drafter_config(config, target.cfg)
        embed, head = jax.jit(target.embedding_and_head)(target.params)
        if config.init_dir is not None:
            drafter = warm_start(config.init_dir, cfg, target, seed=config.seed)
        else:
            drafter = build_drafter(cfg, seed=config.seed, draft_vocab_ids=draft_vocab(config, sequences, target.cfg.vocab_size))
            if drafter.draft_head is not None:
                drafter.init_draft_head(head)
            if config.target_init_layers is not None:
                drafter = copy_target_layers(drafter, target, config.target_init_layers)
        self.graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
        self.tx = optimizer(config)

        mesh = training_mesh(config)
        replicated = NamedSharding(mesh, PartitionSpec())
        self.by_row = NamedSharding(mesh, PartitionSpec("data"))
        self.params, self.rest, self.embed, self.head = jax.device_put((params, rest, embed, head), replicated)
        self.opt_state = jax.device_put(self.tx.init(self.params), replicated)
        # A cache of token ids alone: the frozen target completes each batch before the step.
        # Trainers on one mesh and taps share one completer and one copy of the target's weights.
        self.complete = self.target_params = None
        if sequences[0].features is None and completion_from is not None:
            if completion_from.by_row != self.by_row or completion_from.config.cache.tap_layers != config.cache.tap_layers:
                raise ValueError(f"{config.name} cannot share {completion_from.config.name}'s batch completion: "
                                 "they differ in mesh or tapped layers")
            self.complete, self.target_params = completion_from.complete, completion_from.target_params
        elif sequences[0].features is None:
            self.complete = jax.jit(batch_completer(target, config.cache.tap_layers))
            self.target_params = jax.device_put(target.params, replicated)

        self.manager = ocp.CheckpointManager(
            self.out / "checkpoints",
            options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=config.checkpoint_every, create=True),
        )
        self.start = self.manager.latest_step() or 0
        claim_run_dir(self.out, run_settings(config), resuming=self.start > 0)
        if self.start:
            restored = self.manager.restore(
                self.start, args=ocp.args.StandardRestore({"params": self.params, "opt_state": self.opt_state}))
            self.params, self.opt_state = restored["params"], restored["opt_state"]

        self.source = BatchSource(sequences, config)
        self.step_fn = make_train_step(self.graphdef, config, self.tx)
        graphdef = self.graphdef
        self.score = jax.jit(lambda params, rest, batch, embed, head: objective(
            nnx.merge(graphdef, params, rest), config, batch, embed, head)[1])

    def device_batch(self, batch: TrainBatch) -> TrainBatch:
        """A host batch on the mesh, by rows, with the target's per-token arrays."""
        batch = jax.device_put(batch, self.by_row)
        return batch if self.complete is None else self.complete(self.target_params, batch)

    def step(self, batch: TrainBatch, lr: float) -> dict:
        """One optimizer step on a ``device_batch``; returns its metrics (on device)."""
        self.params, self.opt_state, metrics = self.step_fn(
            self.params, self.opt_state, self.rest, batch, self.embed, self.head, np.float32(lr))
        return metrics

    def save(self, *, force: bool):
        """Checkpoint the state after ``start`` steps (every ``checkpoint_every``-th, or now if ``force``)."""
        self.manager.save(self.start, args=ocp.args.StandardSave({"params": self.params, "opt_state": self.opt_state}),
                          force=force)

    def batch_seconds(self, repeats: int = 3) -> float:
        """Median wall time to assemble, send and complete a batch, after a first that compiles."""
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            jax.block_until_ready(self.device_batch(self.source.batch(self.start + i)))
            times.append(time.perf_counter() - t0)
        return float(np.median(times[1:]))

    def step_seconds(self, batch: TrainBatch, repeats: int = 3) -> float:
        """Median wall time of one step on ``batch`` (a ``device_batch``) after a first that
        compiles; on copies of the state, so the run itself does not move."""
        params, opt_state = jax.tree.map(lambda x: x.copy(), (self.params, self.opt_state))
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            params, opt_state, metrics = self.step_fn(params, opt_state, self.rest, batch, self.embed, self.head,
                                                      np.float32(0.0))
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
        return float(np.median(times[1:]))

    def heldout_metrics(self, config: TrainConfig) -> dict:
        return mean_metrics(lambda b: self.score(self.params, self.rest, self.device_batch(b), self.embed, self.head),
                            config, self.heldout)


class NonFiniteLoss(ValueError):
    """A training step whose loss or gradient norm is NaN or infinite (a damaged target cache, a
    learning rate that diverges): the run stops there, its last checkpoint kept, nothing exported."""

    def __init__(self, trainer: Trainer, config: TrainConfig, record: dict):
        trainer.manager.wait_until_finished()  # a save under way counts as kept
        kept = trainer.manager.latest_step()
        kept = ("no checkpoint was saved yet" if kept is None
                else f"its last checkpoint (step {kept}) in {trainer.out / 'checkpoints'} is kept")
        super().__init__(f"{config.name}: step {record['step']} has loss {record['loss']} and gradient norm "
                         f"{record['grad_norm']}: training stopped without saving or exporting it, and {kept}; "
                         f"check the target cache {config.cache_path} (NaN features) or lower learning_rate")


def train_together(trainers: list[Trainer], steps: int | None = None, *, stop_after: int | None = None,
                   deadline: float | None = None, progress: bool = True):
    """Train every trainer to ``steps`` (default: each config's) on the same batches: a batch is
    assembled (and completed by the target, for a cache of token ids) once per step for all of
    them, so drafters compared on one data set share that cost. Each resumes from its own newest
    checkpoint, logs every step to its ``log.jsonl`` (with held-out sequences, also their τ and
    loss every ``heldout_every``-th step and the last) and saves checkpoints. Returns the trained
    drafters, or None when ``stop_after`` interrupted the run (what a kill looks like, for tests).

    Past ``deadline`` (a ``time.monotonic()`` value) no step starts: every trainer checkpoints
    the step it reached and the drafters come back as they are (``Trainer.start`` says how far),
    so a run whose steps turn out slower than planned still ends with something to export."""
    configs = [t.config if steps is None else dataclasses.replace(t.config, steps=steps) for t in trainers]
    total = configs[0].steps
    if any(c.steps != total for c in configs):
        raise ValueError("trainers trained together need the same number of steps")
    for trainer, config in zip(trainers, configs):
        started_for = claim_run_dir(trainer.out, {"steps": config.steps}, resuming=False).get("steps", total)
        if trainer.start and started_for != total and multihost.is_lead():
            print(f"note: {config.name} resumes at step {trainer.start} of {total}, not of the {started_for} it "
                  f"started with: its learning rate follows the {total}-step schedule from here", file=sys.stderr)
    schedules, bars, logs = [], [], []
    for trainer, config in zip(trainers, configs):
        log_path = trainer.out / LOG_FILE
        if multihost.is_lead():
            log_path.write_text("".join(line + "\n" for line in _read_log(log_path, trainer.start)))
        logs.append(log_path.open("a") if multihost.is_lead() else None)
        schedules.append(schedule(config))
        bars.append(tqdm(total=total, initial=trainer.start, desc=f"train {config.name}", disable=not progress))
    try:
        for step in range(min(t.start for t in trainers), total):
            if deadline is not None and multihost.lead_value(time.monotonic() >= deadline):
                for trainer in trainers:
                    if trainer.manager.latest_step() != trainer.start:
                        trainer.save(force=True)
                break
            t0 = time.perf_counter()
            # Waited for, so that the log's times are each its own (dispatch is asynchronous).
            batch = jax.block_until_ready(trainers[0].device_batch(trainers[0].source.batch(step)))
            batch_seconds = time.perf_counter() - t0
            done = step + 1
            for trainer, config, lr, log, bar in zip(trainers, configs, schedules, logs, bars):
                if step < trainer.start:  # resumed past this step
                    continue
                t0 = time.perf_counter()
                metrics = trainer.step(batch, lr(step))
                record = {"step": step, "lr": float(lr(step)), **_scalars(metrics),
                          "seconds": time.perf_counter() - t0, "batch_seconds": batch_seconds}
                if not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])):
                    # The step's parameters are no use (NaN stays NaN): stop before they are saved.
                    if log is not None:
                        log.write(json.dumps(record) + "\n")
                        log.flush()
                    raise NonFiniteLoss(trainer, config, record)
                if trainer.heldout is not None and (done % config.heldout_every == 0 or done == total):
                    scored = trainer.heldout_metrics(config)
                    record.update(heldout_tau=scored["tau"], heldout_tau_greedy=scored["tau_greedy"],
                                  heldout_loss=scored["loss"])
                if log is not None:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.4f}", tau=f"{record['tau_probabilistic']:.2f}")
                trainer.start = done
                trainer.save(force=done == total)
            if stop_after is not None and done == stop_after and done < total:
                return None
    finally:
        for trainer, log, bar in zip(trainers, logs, bars):
            trainer.manager.wait_until_finished()
            if log is not None:
                log.close()
            bar.close()
    return [nnx.merge(t.graphdef, t.params, t.rest) for t in trainers]


def train(config: TrainConfig, target, sequences, *, heldout=None, stop_after: int | None = None,
          progress: bool = True):
    """Train (resuming from the newest checkpoint in ``out_dir``); returns the trained drafter,
    or None when ``stop_after`` interrupted the run (``train_together``)."""
    trained = train_together([Trainer(config, target, sequences, heldout=heldout)], stop_after=stop_after,
                             progress=progress)
    return None if trained is None else trained[0]


def check_before_cache(config: TrainConfig, target) -> None:
    """Refuse, before the target cache is built (minutes to hours), a drafter ``config`` cannot
    build for ``target`` and an ``out_dir`` that cannot be a directory."""
    drafter_config(config, target.cfg)
    out = Path(config.out_dir).absolute()
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == out else f"is below {existing}, a file"
        raise ValueError(f"TrainConfig.out_dir {config.out_dir} {where}, not a directory: give the run another out_dir")


def export(config: TrainConfig, drafter, target, sequences, seconds: float, **extra) -> Path:
    """Save the trained drafter to ``out_dir/drafter`` with a summary of its run and the identity of
    the ``target`` it was trained for (the lead process writes it; every process returns once it is
    written)."""
    out = Path(config.out_dir) / "drafter"
    if not multihost.is_lead():
        multihost.barrier(f"exported {out}")
        return out
    records = [json.loads(line) for line in (Path(config.out_dir) / LOG_FILE).read_text().splitlines()]
    last = records[-1]
    summary = {
        "config": config.name,
        "steps": config.steps,
        "init_from": None if config.init_dir is None else str(config.init_dir),
        "sequences": len(sequences),
        "response_tokens": int(sum(int(s.loss_mask.sum()) for s in sequences)),
        "final": {k: last[k] for k in ("loss", "tau_probabilistic", "accept_rate", "heldout_tau") if k in last},
        "train_seconds_this_run": seconds,
        **extra,
    }
    save_drafter(drafter, out, storage_dtype=config.storage_dtype, metadata=summary, target=target)
    multihost.barrier(f"exported {out}")
    return out


def run(config: TrainConfig, *, stop_after: int | None = None, progress: bool = True,
        loaded: tuple | None = None) -> Path | None:
    """The whole pipeline; returns the exported drafter directory (None if stopped early).
    ``loaded``: the ``load_target(config)`` pair, where the caller has it (a later leg's run)."""
    progress = progress and multihost.is_lead()
    training_mesh(config)
    target, tokenizer = loaded or load_target(config)
    check_before_cache(config, target)  # and before an earlier leg trains
    if isinstance(config.init_from, TrainConfig) and not (config.init_dir / CONFIG_FILE).exists():
        leg = config.init_from
        same_target = (leg.target_checkpoint, leg.target_layers) == (config.target_checkpoint, config.target_layers)
        run(leg, progress=progress, loaded=(target, tokenizer) if same_target else None)
    sequences = load_training_set(config, build_cache(config, target, tokenizer, progress=progress))
    heldout = build_heldout_cache(config, target, tokenizer, progress=progress) if config.heldout_prompts else None
    start = time.perf_counter()
    drafter = train(config, target, sequences, heldout=heldout, stop_after=stop_after, progress=progress)
    if drafter is None:
        return None
    return export(config, drafter, target, sequences, time.perf_counter() - start)


BUDGET_FILE = "budget.json"
# What drafters compared under one budget must share: their data and their batches' shape.
SHARED_FIELDS = ("prompts_file", "num_prompts", "data_seed", "data_mix", "target_checkpoint", "target_layers", "cache", "cache_path",
                 "cache_shards", "benchmarks_dir", "batch_size", "seq_len", "num_anchors", "seed", "data_parallel")


def run_budgeted(configs: list[TrainConfig], budget_s: float, *, data_fraction: float = 0.3, margin: float = 0.15,
                 progress: bool = True) -> list[Path]:
    """Drafters trained side by side on one data set within ``budget_s`` seconds of wall time, all
    for the same number of steps (the same data and budget, as the baselines need).

    The target cache is built (resumed, grown) until ``data_fraction`` of the budget has passed,
    and the drafters train on the shards complete by then, together (``train_together``: one
    batch a step for all). A batch and each drafter's step are compiled and timed, and they all
    get the steps that the rest of the budget affords, less ``margin`` of it for logging and
    checkpoints. The plan is written to ``budget.json`` in every run's directory, and a rerun
    with those plans resumes (same shards, same steps) instead of planning again. Configs' own
    ``steps`` are ignored. No step starts past the budget: drafters whose steps ran slower than
    timed are checkpointed and exported with the steps they got (their metadata says how many)."""
    if not configs:
        raise ValueError("run_budgeted needs at least one config")
    if budget_s <= 0 or not 0 < data_fraction < 1 or not 0 <= margin < 1:
        raise ValueError(f"need budget_s > 0, 0 < data_fraction < 1 and 0 <= margin < 1; got {budget_s}, "
                         f"{data_fraction}, {margin}")
    first = configs[0]
    for config in configs[1:]:
        differ = [f for f in SHARED_FIELDS if getattr(config, f) != getattr(first, f)]
        if differ:
            raise ValueError(f"{config.name} and {first.name} differ in {differ}: one budget compares drafters "
                             "on the same data and batches")
    for config in configs:
        if isinstance(config.init_from, TrainConfig) and not (config.init_dir / CONFIG_FILE).exists():
            raise ValueError(f"{config.name} starts from {config.init_from.name}, which is not exported yet: "
                             "train the earlier leg first")
    run_names = [c.name for c in configs]
    if len(set(run_names)) != len(configs) or len({str(Path(c.out_dir).absolute()) for c in configs}) != len(configs):
        raise ValueError(f"configs under one budget need distinct names and out_dirs, got {run_names}")

    training_mesh(first)  # the configs share batch_size and data_parallel
    progress = progress and multihost.is_lead()
    clock = time.monotonic()
    plans = [Path(c.out_dir) / BUDGET_FILE for c in configs]
    plan = json.loads(plans[0].read_text()) if plans[0].exists() else None
    if plan is not None and any(not p.exists() or json.loads(p.read_text()) != plan for p in plans):
        raise ValueError(f"{BUDGET_FILE} is missing or differs across {[str(p) for p in plans]}: "
                         "resume the runs that planned together, or start in fresh out_dirs")
    target, tokenizer = load_target(first)
    for config in configs:
        check_before_cache(config, target)
    if plan is None:
        names = build_cache(first, target, tokenizer, progress=progress, deadline=clock + data_fraction * budget_s)
    else:
        names = training_names(first, tokenizer)
    size = first.cache.shard_size
    spanned = -(-len(names) // size)
    shards = plan["cache_shards"] if plan is not None else complete_shards(first.cache_path, spanned)
    if shards < spanned:
        configs = [dataclasses.replace(c, cache_shards=shards) for c in configs]
        names = names[: shards * size]
    sequences = load_training_set(configs[0], names)
    heldout = build_heldout_cache(first, target, tokenizer, progress=progress) if first.heldout_prompts else None
    trainers = [Trainer(configs[0], target, sequences, heldout=heldout)]
    trainers += [Trainer(c, target, sequences, heldout=heldout, completion_from=trainers[0]) for c in configs[1:]]
    if plan is None:
        batch_seconds = trainers[0].batch_seconds()
        batch = trainers[0].device_batch(trainers[0].source.batch(trainers[0].start))
        seconds = {c.name: t.step_seconds(batch) for c, t in zip(configs, trainers)}
        round_seconds = batch_seconds + sum(seconds.values())
        left = budget_s - (time.monotonic() - clock)
        steps = int((1 - margin) * left / round_seconds)
        # Every process timed the steps (they run on all devices); the lead's clock decides.
        steps, left = multihost.lead_value((steps, left))
        if steps < 1:
            raise ValueError(f"{left:.0f} s of the budget are left and a step of every drafter takes "
                             f"{round_seconds:.2f} s: raise the budget or lower data_fraction")
        plan = {"steps": steps, "cache_shards": shards, "sequences": len(sequences), "budget_s": budget_s,
                "data_fraction": data_fraction, "batch_seconds": batch_seconds, "step_seconds": seconds,
                "planned_after_s": budget_s - left, "drafters": [c.name for c in configs]}
        if multihost.is_lead():
            for path in plans:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(plan, indent=2) + "\n")
        if progress:
            print(f"budget: {shards} cache shards ({len(sequences)} sequences), {steps} steps for each of "
                  f"{', '.join(seconds)} (s/step {', '.join(f'{v:.3f}' for v in seconds.values())}, "
                  f"s/batch {batch_seconds:.3f})")
    t0 = time.perf_counter()
    drafters = train_together(trainers, plan["steps"], deadline=clock + budget_s, progress=progress)
    seconds = time.perf_counter() - t0
    done = trainers[0].start
    if done < plan["steps"] and progress:
        print(f"budget: the deadline came after {done} of {plan['steps']} steps; exporting those "
              "(rerun the command to resume)")
    return [export(dataclasses.replace(config, steps=done), drafter, target, sequences, seconds, budget=plan)
            for config, drafter in zip(configs, drafters)]
